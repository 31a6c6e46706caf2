"""Which Lightning strategies the precision core works with, checked at setup (for either Trainer package)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from torch import nn


def lightning_module(model: nn.Module, pl: ModuleType) -> Any:
    """The LightningModule of package ``pl`` inside strategy wrappers (DDP's ``module``); typed ``Any``: ``pl`` is
    either Trainer package, chosen at run time."""
    while not isinstance(model, pl.LightningModule) and isinstance(inner := getattr(model, "module", None), nn.Module):
        model = inner
    return model


def shards_with_fsdp2(model: nn.Module, pl: ModuleType) -> bool:
    """Whether ``model``'s Trainer runs Lightning's ModelParallelStrategy (FSDP2: ``fully_shard`` in
    ``configure_model``), so the plugin leaves the masters and the 16-bit compute to FSDP2's MixedPrecisionPolicy."""
    try:
        strategy = lightning_module(model, pl).trainer.strategy
    except (AttributeError, RuntimeError):  # not attached to a Trainer (a direct call)
        return False
    return isinstance(strategy, getattr(pl.strategies, "ModelParallelStrategy", ()))  # absent in old packages


_PLUGIN = "StablePrecision(...)"


def _from_ray(strategy: Any) -> bool:
    """Whether ``strategy`` is one of Ray Train's subclasses (``ray.train.lightning``), without importing Ray."""
    return any(cls.__module__.startswith("ray.") for cls in type(strategy).__mro__)


def check_strategy(plugin: Any, model: nn.Module, pl: ModuleType) -> str | None:
    """Refuse, at setup, the strategies whose own numerics would collide with ours; returns a warning where ranks
    could disagree (else None). ``plugin`` is a ``StablePrecision`` of package ``pl``. FSDP2 (ModelParallelStrategy)
    is supported with every precision, FP8 and ``diagnose``; the stepper checks its policies (``plugin.mp_policy``).

    Under Ray Train, ``RayDDPStrategy`` (with ``prepare_trainer``) is served like DDP; FSDP2 runs as
    ``ModelParallelStrategy`` with ``RayLightningEnvironment`` as a plugin (``prepare_trainer`` refuses any strategy
    class but Ray's three, so it is not called there); ``RayFSDPStrategy`` (FSDP1) and ``RayDeepSpeedStrategy`` are
    refused like their Lightning bases, naming those alternatives.

    Raises:
        ValueError: DeepSpeed (its own loss scaler and masters: the loss would be scaled twice); FSDP1, Ray's
            included (needs Lightning's FSDPPrecision).
    """
    try:
        strategy = lightning_module(model, pl).trainer.strategy
    except (AttributeError, RuntimeError):  # not attached to a Trainer (a direct call)
        return None
    strategies = pl.strategies
    call = f"StablePrecision({plugin.precision!r}) with {type(strategy).__name__}"
    if isinstance(strategy, strategies.DeepSpeedStrategy):
        raise ValueError(
            f"{call}: DeepSpeed brings its own loss scaler, FP32 master weights and backward, so StablePrecision"
            " would scale the loss twice. Use Trainer(strategy='deepspeed', precision='16-mixed' or 'bf16-mixed')"
            " without StablePrecision (OverflowMonitor and ScaleCheckpoint still observe DeepSpeed's scale and"
            " skipped steps), or StablePrecision with DDP or ModelParallelStrategy (FSDP2)"
            + (" (under Ray: RayDDPStrategy)." if _from_ray(strategy) else ".")
        )
    if isinstance(strategy, strategies.FSDPStrategy) and _from_ray(strategy):
        raise ValueError(
            f"{call}: RayFSDPStrategy is FSDP1, which shards flat parameters and only works with Lightning's"
            f" FSDPPrecision. Under Ray use FSDP2: Trainer(strategy=ModelParallelStrategy(), plugins=[{_PLUGIN},"
            " RayLightningEnvironment()]) with fully_shard(..., mp_policy=plugin.mp_policy) in configure_model, and"
            " do not call ray.train.lightning.prepare_trainer (it accepts only RayDDPStrategy, RayFSDPStrategy and"
            " RayDeepSpeedStrategy); or RayDDPStrategy with prepare_trainer."
        )
    if isinstance(strategy, strategies.FSDPStrategy):
        raise ValueError(
            f"{call}: FSDP1 shards flat parameters and only works with Lightning's FSDPPrecision. Use"
            " ModelParallelStrategy (FSDP2, fully_shard(..., mp_policy=plugin.mp_policy) in configure_model), which"
            " StablePrecision supports."
        )
    unsynced = plugin.scaler is not None and not callable(getattr(plugin.scaler, "sync_found_inf_", None))
    if unsynced and getattr(strategy, "world_size", 1) > 1:
        return (
            f"{call}: the scaler {type(plugin.scaler).__name__} has no sync_found_inf_(), so an inf/NaN gradient only"
            " some ranks see makes only those ranks skip the step. Use lit_mpstable.scaling.DynamicLossScaler."
        )
    return None


def ray_fsdp2_strategy(**kwargs: Any) -> Any:
    """Lightning's ``ModelParallelStrategy`` (FSDP2) for a Ray Train worker: the FSDP2 path under Ray.

    Ray's ``prepare_trainer`` accepts only ``RayDDPStrategy``, ``RayFSDPStrategy`` (FSDP1, which StablePrecision
    refuses) and ``RayDeepSpeedStrategy``, so it is not called here; what it would check is set directly. Ray has
    already initialised the process group and gives each worker its device: the strategy takes the device from
    ``ray.train.torch.get_device()`` (as Ray's own strategies do), and the data-parallel size defaults to the Ray
    world size (``tensor_parallel_size=1``). Pass ``RayLightningEnvironment()`` in the Trainer's plugins, beside
    ``StablePrecision``::

        trainer = pl.Trainer(strategy=ray_fsdp2_strategy(), plugins=[StablePrecision("bf16-true"),
                             RayLightningEnvironment()], accelerator="cpu", devices=1, ...)

    ``kwargs`` go to ``ModelParallelStrategy`` (``data_parallel_size``, ``tensor_parallel_size``, ``timeout``, ...).

    Raises:
        ModuleNotFoundError: Ray Train is not installed (``pip install 'lit_mpstable[ray]'``).
        RuntimeError: called outside a Ray Train worker.
    """
    try:
        import ray.train
        import ray.train.torch
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "ray_fsdp2_strategy() needs Ray Train: pip install 'lit_mpstable[ray]' (ray[train])."
        ) from err
    from lightning.pytorch.strategies import ModelParallelStrategy

    class RayModelParallelStrategy(ModelParallelStrategy):
        """ModelParallelStrategy on the device Ray gave this worker (one per worker: local rank 0 of its list)."""

        @property
        def root_device(self) -> Any:
            return ray.train.torch.get_device()

    world_size = ray.train.get_context().get_world_size()
    kwargs.setdefault("tensor_parallel_size", 1)
    kwargs.setdefault("data_parallel_size", world_size // kwargs["tensor_parallel_size"])
    return RayModelParallelStrategy(**kwargs)

"""Which Lightning strategies the precision core works with, checked at setup (for either Trainer package)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from torch import nn

__all__ = ["check_strategy", "lightning_module", "shards_with_fsdp2"]


def lightning_module(model: nn.Module, pl: ModuleType) -> nn.Module:
    """The LightningModule of package ``pl`` inside strategy wrappers (DDP's ``module``)."""
    while not isinstance(model, pl.LightningModule) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def shards_with_fsdp2(model: nn.Module, pl: ModuleType) -> bool:
    """Whether ``model``'s Trainer runs Lightning's ModelParallelStrategy (FSDP2: ``fully_shard`` in
    ``configure_model``), so the plugin leaves the masters and the 16-bit compute to FSDP2's MixedPrecisionPolicy."""
    try:
        strategy = lightning_module(model, pl).trainer.strategy
    except (AttributeError, RuntimeError):  # not attached to a Trainer (a direct call)
        return False
    return isinstance(strategy, getattr(pl.strategies, "ModelParallelStrategy", ()))  # absent in old packages


def check_strategy(plugin: Any, model: nn.Module, pl: ModuleType) -> str | None:
    """Refuse, at setup, the strategies whose own numerics would collide with ours; returns a warning where ranks
    could disagree (else None). ``plugin`` is a ``StablePrecision`` of package ``pl``. FSDP2 (ModelParallelStrategy)
    is supported with every precision, FP8 and ``diagnose``; the stepper checks its policies (``plugin.mp_policy``).

    Raises:
        ValueError: DeepSpeed (its own loss scaler and masters: the loss would be scaled twice); FSDP1 (needs
            Lightning's FSDPPrecision).
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
            " without StablePrecision, or StablePrecision with DDP or ModelParallelStrategy (FSDP2)."
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

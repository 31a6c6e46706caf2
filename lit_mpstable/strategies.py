"""Which Lightning strategies the precision core works with, checked at setup (for either Trainer package)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from torch import nn

__all__ = ["check_strategy", "lightning_module"]


def lightning_module(model: nn.Module, pl: ModuleType) -> nn.Module:
    """The LightningModule of package ``pl`` inside strategy wrappers (DDP's ``module``)."""
    while not isinstance(model, pl.LightningModule) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def check_strategy(plugin: Any, model: nn.Module, pl: ModuleType) -> str | None:
    """Refuse, at setup, the strategies whose own numerics would collide with ours; returns a warning where ranks
    could disagree (else None). ``plugin`` is a ``StablePrecision`` of package ``pl``.

    Raises:
        ValueError: DeepSpeed (its own loss scaler and masters: the loss would be scaled twice); FSDP1 (needs
            Lightning's FSDPPrecision); with FSDP2, FP32 master weights (its MixedPrecisionPolicy is the tool), FP8
            (the layers are sharded before the plugin could swap them) or ``diagnose=True`` (whole gradients).
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
            " ModelParallelStrategy (FSDP2, fully_shard in configure_model), which StablePrecision supports."
        )
    if isinstance(strategy, strategies.ModelParallelStrategy):
        if plugin.true_16bit and plugin.master_weights:
            raise ValueError(
                f"{call}, master_weights=True: the FP32 masters would be unsharded copies beside FSDP2's sharded"
                " parameters, which it gathers and reduces in 16 bits. FSDP2's own tool keeps sharded FP32 masters:"
                " fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,"
                " reduce_dtype=torch.float32)) in configure_model with StablePrecision('32-true') (plus"
                " scaler=DynamicLossScaler(...) for param_dtype=torch.float16); or master_weights=False."
            )
        if plugin.fp8 is not None or plugin.diagnose:
            what = "fp8" if plugin.fp8 is not None else "diagnose=True"
            why = ("fully_shard in configure_model has already made the nn.Linear layers FSDP modules, so none would"
                   " be swapped for FP8Linear" if plugin.fp8 is not None else
                   "the overflow tracer reads whole parameter gradients, FSDP2 holds DTensor shards")
            raise ValueError(f"{call}, {what}: {why}. Use DDP for it, or leave it off with FSDP2.")
    unsynced = plugin.scaler is not None and not callable(getattr(plugin.scaler, "sync_found_inf_", None))
    if unsynced and getattr(strategy, "world_size", 1) > 1:
        return (
            f"{call}: the scaler {type(plugin.scaler).__name__} has no sync_found_inf_(), so an inf/NaN gradient only"
            " some ranks see makes only those ranks skip the step. Use lit_mpstable.scaling.DynamicLossScaler."
        )
    return None

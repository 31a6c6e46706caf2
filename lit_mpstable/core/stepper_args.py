"""Argument checks of :class:`~lit_mpstable.core.stepper.PrecisionStepper` that look at several arguments together or
inside a container (the per-argument checks are in :mod:`lit_mpstable.base.validate`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch

from lit_mpstable.core.loss_scaler import DynamicLossScaler

__all__ = ["MasterMode", "OpPolicyName", "PrecisionName", "check_arguments"]

PrecisionName = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "auto"]
MasterMode = Literal["fp32", "kahan", "stochastic"]
OpPolicyName = Literal["autocast", "auto"]


def check_arguments(call: str, precision: str, scaler: Any, fp32_modules: Any) -> None:
    """What the per-argument checks cannot see: containers that are not lists, a class for an instance, an adaptive
    scaler sized for another format than the run's FP16, a scale whose reciprocal is not a finite FP32 number."""
    if isinstance(fp32_modules, (str, type)):
        fp32_modules = [fp32_modules]  # one name or one module type
    elif fp32_modules is None or isinstance(fp32_modules, (bytes, dict)) or not isinstance(fp32_modules, Iterable):
        raise TypeError(f"{call}(fp32_modules={fp32_modules!r}): must be a list of module names or nn.Module types;"
                        " () for none.")
    if any(spec == "" for spec in fp32_modules):
        raise ValueError(f"{call}(fp32_modules={list(fp32_modules)!r}): '' names the root, the whole model in FP32;"
                         " use precision='32-true' for that, or name the submodules to keep in FP32.")
    if isinstance(scaler, type):
        raise TypeError(f"{call}(scaler={scaler.__name__} (the class)): pass an instance, {scaler.__name__}(), or a"
                        " name ('dynamic', 'static', 'adaptive').")
    if isinstance(scaler, DynamicLossScaler) and scaler.is_enabled() and precision in ("16-mixed", "16-true"):
        target = getattr(scaler, "target_format", "fp16")
        if target in ("bf16", "fp32"):
            raise ValueError(
                f"{call}({precision!r}, scaler={type(scaler).__name__}(target_format={target!r})): the scale would be"
                f" sized for {target.upper()}'s range while this run's gradients are FP16 (max 65504), so every step"
                " would overflow; use target_format='fp16' (the default).")
    scale = scaler.get_scale() if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() else None
    if scale is not None and not (_MIN_SCALE <= scale <= _MAX_SCALE):
        raise ValueError(
            f"{call}(scaler={type(scaler).__name__}(init_scale={scale!r})): 1/scale must be a finite FP32 number"
            f" (unscaling multiplies by it): use a scale in [{_MIN_SCALE:.3g}, {_MAX_SCALE:.3g}]; 2.**16 is usual.")


_MIN_SCALE = 1.0 / torch.finfo(torch.float32).max
_MAX_SCALE = float(torch.finfo(torch.float32).max)

"""Argument checks of :class:`~lit_mpstable.core.step.stepper.PrecisionStepper` that look at several arguments together
or inside a container (the per-argument checks are in :mod:`lit_mpstable.base.validate`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import nn
from torch.optim import Optimizer

from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler

PrecisionName = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "auto"]
MasterMode = Literal["fp32", "kahan", "stochastic"]
OpPolicyName = Literal["autocast", "auto"]


def check_arguments(call: str, precision: str, scaler: object, fp32_modules: object) -> None:
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


# ------------------------------------------------------------------------------------------------ method arguments
# Checks of the stepper's per-call arguments: isinstance and float comparisons only (no tensor is read).
def check_optimizer(call: str, value: object, name: str = "optimizer") -> Optimizer:
    """``value`` if it is a torch optimizer (Fabric's wrapper is one).

    Raises:
        TypeError: anything else (a name, None, a LightningOptimizer's ``.optimizer`` forgotten).
    """
    if not isinstance(value, Optimizer):
        raise TypeError(f"{call}({name}={_short(value)}): must be a torch.optim.Optimizer (the one the model's"
                        " parameters are stepped by).")
    return value


def check_optimizers(call: str, value: object) -> list[Optimizer]:
    """``value`` as a list if it is a list or tuple of torch optimizers.

    Raises:
        TypeError: not a list or tuple, or an entry is not an optimizer.
    """
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{call}(optimizers={_short(value)}): must be a list of torch.optim.Optimizer.")
    return [check_optimizer(call, optimizer, f"optimizers[{index}]") for index, optimizer in enumerate(value)]


def check_module(call: str, value: object, name: str = "module") -> nn.Module:
    """``value`` if it is an ``nn.Module``.

    Raises:
        TypeError: anything else.
    """
    if not isinstance(value, nn.Module):
        raise TypeError(f"{call}({name}={_short(value)}): must be a torch.nn.Module (the model).")
    return value


def check_clip(call: str, name: str, value: object) -> None:
    """A clip threshold: a real number >= 0 (inf: no clipping). NaN passes: as in torch, it makes the gradients NaN,
    and the step is skipped like any non-finite step (the weights are left alone).

    Raises:
        TypeError: not a real number.
        ValueError: negative.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{call}({name}={_short(value)}): must be a number >= 0 (inf: no clipping).")
    if value < 0:
        raise ValueError(f"{call}({name}={value!r}): must be a number >= 0 (inf: no clipping); a negative threshold"
                         " would flip the gradients' signs.")


def check_norm_type(call: str, value: Any) -> None:
    """A p-norm's order: a number, or ``"inf"`` (what ``torch.nn.utils.clip_grad_norm_`` takes).

    Raises:
        TypeError: neither (``"x"``, None, a bool).
    """
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or math.isnan(number):
        raise TypeError(f"{call}(norm_type={_short(value)}): must be a number (2.0: the Euclidean norm) or 'inf'.")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

"""The checked unscale and step every weight keeper shares: the scaler's check around the optimizer's own step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.optim import Optimizer

from lit_mpstable.core.scaling.scalers import LossScaler


class GradView(NamedTuple):
    """What the step reads of an optimizer's gradients: the tensors whose ``.grad`` holds them (the model's and the
    masters') and the unscale factor the step still owes them (None: they are true values)."""

    holders: list[torch.Tensor]
    multiplier: torch.Tensor | None


def clip_either_(norm_: Callable[..., torch.Tensor], value_: Callable[[Optimizer, float], None],
                 optimizer: Optimizer, max_norm: float | torch.Tensor | None, norm_type: float,
                 clip_value: float | None, total_norm: torch.Tensor | None) -> torch.Tensor | None:
    """A keeper's one clip: by value (``clip_value``; returns None) or by total norm (``max_norm``; returns it)."""
    if (clip_value is None) == (max_norm is None):
        raise TypeError(f"clip_: give exactly one of max_norm and clip_value, got max_norm={max_norm!r} and"
                        f" clip_value={clip_value!r}")
    if clip_value is not None:
        value_(optimizer, clip_value)
        return None
    return norm_(optimizer, max_norm, norm_type, total_norm=total_norm)


def unscale_checked_(optimizer: Optimizer, checker: LossScaler | None,
                     scaler: object, device: torch.device | str) -> None:
    """Unscale ``optimizer``'s gradients in place and check them for inf/NaN, agreed across ranks (no host sync)."""
    if checker is None:
        return
    # The scale-1 check of scaler=None creates its state where the gradients are (no loss was scaled to create it).
    # An inf only some ranks see (written after DDP's all-reduce, or in a gradient shard) must skip the step on every
    # rank: the check ends with one all-reduce of the found-inf flag (and the adaptive amax), on the device.
    checker.check_grads_(optimizer, first_grad_device(optimizer) or device)


def step_checked(optimizer: Optimizer, checker: LossScaler | None, update: Callable[[], Any] | None,
                 kwargs: dict[str, Any]) -> tuple[Any, bool]:
    """Step ``optimizer`` (or run ``update``) unless the checker found inf/NaN; returns the output and the skip."""
    if checker is None:
        return (update() if update is not None else optimizer.step(**kwargs)), False
    output = checker.step_with(optimizer, update) if update is not None else checker.step(optimizer, **kwargs)
    return output, checker.last_step_skipped


def first_grad_device(optimizer: Optimizer) -> torch.device | None:
    return next((p.grad.device for g in optimizer.param_groups for p in g["params"] if p.grad is not None), None)


def clip_norm_(
    params: list[torch.Tensor], max_norm: float, norm_type: float, total_norm: torch.Tensor | None
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` of ``params``' gradients, with their ``total_norm`` when it is known
    already (a SpikeGuard judged it): then the gradients are read once less."""
    if total_norm is None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
    return total_norm

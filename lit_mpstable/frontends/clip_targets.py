"""What ``fabric.clip_gradients`` clips under the Fabric front end: the tensors the optimizer updates, unscaled."""

from __future__ import annotations

import weakref
from types import SimpleNamespace
from typing import Any, cast

import torch
from torch.optim import Optimizer

from lit_mpstable.core.weights.master import MasterWeights
from lit_mpstable.core.weights.weights import WeightKeeper


class _ClipTargets(list):
    """The tensors ``fabric.clip_gradients`` clips; a list that can be watched for its release (``weakref``)."""

    __slots__ = ("__weakref__",)


@torch.no_grad()
def _write_back_scaled(grads: list[torch.Tensor], copies: list[torch.Tensor], scale: torch.Tensor) -> None:
    for grad, copy in zip(grads, copies):
        grad.copy_(copy * scale.to(copy.device))


def _first_grad_device(optimizer: Optimizer) -> torch.device | None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                return param.grad.device
    return None


def clip_targets(optimizer: Optimizer, params: list[torch.Tensor], keeper: WeightKeeper, scaler: Any,
                 device: str) -> list[Any]:
    """The parameters ``optimizer`` updates (``params``: the stepper's ``main_params``, the FP32 masters with
    ``master_weights``; ``keeper``, ``scaler`` and ``device``: the stepper's), their gradients unscaled, for
    Fabric to clip. On a step that will be skipped (inf/NaN) one empty placeholder stands in (torch's
    ``clip_grad_value_`` refuses an empty list; the norm is 0). With FP32 masters the model's 16-bit gradients show
    the clipped values once Fabric lets go of the returned list."""
    if not params:
        where = _first_grad_device(optimizer) or torch.device(device)
        placeholder = torch.empty(0, device=where)
        placeholder.grad = torch.empty(0, device=where)
        return [placeholder]
    if keeper.defers_unscale and scaler is not None:
        return _unscaled_copies(scaler.get_scale_tensor(), params)
    if not keeper.exposes_grads:
        return params
    targets = _ClipTargets(params)
    # Fabric gives no hook after its clip: the masters' clipped gradients are shown on the model when the
    # returned list is released, i.e. when Fabric's clip_gradients_value/norm returns (CPython frees it then).
    weakref.finalize(targets, cast(MasterWeights, keeper).expose_grads_, optimizer)  # the masters' own helper
    return targets


def _unscaled_copies(scale: torch.Tensor, params: list[torch.Tensor]) -> list[Any]:
    # Compact weights keep their 16-bit gradients scaled until the step unscales them in FP32 (unscaled in FP16
    # they would underflow). Fabric clips FP32 unscaled copies of them instead, written back scaled when it lets
    # go of the list: unclipped values come back exactly (the scale is a power of two), a clipped one is rounded
    # once, at the scaled magnitude. Costs an FP32 copy of the gradients while Fabric clips.
    grads = [p.grad for p in params if p.grad is not None]
    copies = [g.float() / scale.to(g.device) for g in grads]
    targets = _ClipTargets(SimpleNamespace(grad=c) for c in copies)
    weakref.finalize(targets, _write_back_scaled, grads, copies, scale)
    return targets

"""The stepper's side of a :class:`~lit_mpstable.core.spike.SpikeGuard`: the argument check, the loss it observes
(averaged across ranks), and the true gradients' total norm it judges. Everything stays on the device."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from lit_mpstable.core.spike import SpikeGuard

__all__ = ["check_spike_guard", "observe_loss", "true_grad_norm"]


def check_spike_guard(call: str, spike_guard: Any, checker: Any) -> SpikeGuard | None:
    """``spike_guard`` validated: None or a :class:`SpikeGuard`, with a checker to join its decision.

    Raises:
        TypeError: not a SpikeGuard.
        ValueError: nothing checks the step (``skip_nonfinite=False`` without a scaler): a spike could not be skipped.
    """
    if spike_guard is None:
        return None
    if not isinstance(spike_guard, SpikeGuard):
        raise TypeError(f"{call}(spike_guard={spike_guard!r}): must be None or a lit_mpstable.SpikeGuard, e.g."
                        " SpikeGuard(zscore=6.0, window=128).")
    if checker is None:
        raise ValueError(f"{call}(spike_guard={spike_guard!r}, skip_nonfinite=False): a spike is skipped through the"
                         " step's inf/NaN check, which skip_nonfinite=False turns off; keep skip_nonfinite=True.")
    return spike_guard


def observe_loss(guard: SpikeGuard, loss: torch.Tensor) -> None:
    """Give ``guard`` the unscaled loss; under ``torch.distributed`` the mean over ranks (one all-reduce on the
    device, no host read), so every rank judges the same value and decides alike."""
    value = loss.detach()
    if value.numel() != 1:
        return  # not a reduced loss (a custom backward target): the guard judges the gradient norm alone
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        value = value.float().reshape(1).clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)  # gloo has no AVG
        value = value[0] / dist.get_world_size()
    guard.observe_loss_(value)


def true_grad_norm(optimizer: Optimizer, multiplier: torch.Tensor | None = None) -> torch.Tensor | None:
    """The total L2 norm of ``optimizer``'s gradients after the unscale, times ``multiplier`` (compact weights keep
    their gradients scaled and unscale by this factor inside the step), in FP32 on the device; None without
    gradients. A sharded (DTensor) norm is made full, so every rank judges the whole model's norm."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return None
    # FP32 per-tensor norms (a scaled FP16 gradient's norm can overflow FP16 itself); plain tensors on one device in
    # one multi-tensor kernel, sharded (DTensor) ones made full.
    plain = all(type(g) is torch.Tensor for g in grads) and len({g.device for g in grads}) == 1
    if plain:
        norms = list(torch._foreach_norm(grads, 2, dtype=torch.float32))
    else:
        norms = [torch.linalg.vector_norm(g, 2, dtype=torch.float32) for g in grads]
        norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
    norm = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), 2)
    return norm * multiplier.to(norm.device) if multiplier is not None else norm

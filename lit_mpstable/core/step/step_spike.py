"""The stepper's side of a :class:`~lit_mpstable.core.guards.spike.SpikeGuard`: the argument check, the loss it observes
(averaged across ranks), and the true gradients' total norm it judges. Everything stays on the device."""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from lit_mpstable.core.guards.spike import SpikeGuard
from lit_mpstable.core.tensors import grad_norms


def check_spike_guard(call: str, spike_guard: object, checker: object) -> SpikeGuard | None:
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


def level_shift_note(guard: SpikeGuard, step: int) -> str:
    """The message for a restart of ``guard``'s statistics after :attr:`SpikeGuard.max_consecutive` spikes in a row."""
    return (f"SpikeGuard: {guard.max_consecutive} steps in a row were skipped as spikes, up to step {step}; taken as"
            f" a lasting change of the loss or gradient-norm level (new data, a schedule change), not a spike, the"
            f" statistics restart ({guard.warmup} steps of warmup) and training goes on. If those batches were bad"
            " data, the next ones are trained on: raise max_consecutive, or fix the data.")


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
    # FP32 per-tensor norms (a scaled FP16 gradient's norm can overflow FP16 itself), sharded (DTensor) ones made full.
    norms = grad_norms(grads, 2, full=True)
    norm = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), 2)
    return norm * multiplier.to(norm.device) if multiplier is not None else norm

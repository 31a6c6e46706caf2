"""What the step checks beyond the scaler's gradient check: inf/NaN that entered after it (the step-input check), and
the notes for a skip it explains and for a batch dropped between unscale and step."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim import Optimizer

from lit_mpstable.core.keeper_steps import first_grad_device
from lit_mpstable.core.scalers import LossScaler
from lit_mpstable.core.tensors import local_view

__all__ = ["check_step_inputs_", "late_nonfinite_note", "stale_grads_note"]


def check_step_inputs_(checker: LossScaler, optimizer: Optimizer, *, scaled: bool, device: str | torch.device,
                       spike: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Fold into the step's skip flag whether anything the step reads holds inf/NaN now: the gradients as hooks and
    clipping left them after the check (a NaN clip norm makes them NaN), the parameters (FP32 masters), the
    optimizer's state and the loss scale (``scaled``: a loss scale exists). On the device, no host read: the step's one
    sync reads the flag.

    ``spike`` (a SpikeGuard's 0-dim bool decision) joins the folded flag too, agreed across ranks in the same
    all-reduce (a spike seen on one rank skips the step on all). Returns the gradient check as it was before (None
    where the scaler cannot take a flag) and the spike flag as agreed (None without ``spike``)."""
    fold = checker.fold_found_inf_  # both checker kinds have it (a duck-typed scaler's folds nothing)
    tensors = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:
                continue  # a parameter without a gradient is not stepped
            tensors += [param.grad, param]
            # Plain tensors only: quantized states (torchao's 8-bit subclasses) support no foreach kernels, and
            # their codes are integers that cannot hold inf/NaN.
            tensors += [v for v in optimizer.state.get(param, {}).values()
                        if type(v) in (torch.Tensor, nn.Parameter) and v.is_floating_point() and v.dim() > 0]
    scale = checker.get_scale_tensor() if scaled else None
    if scale is not None:
        tensors.append(scale.view(1))
    tensors = [local_view(t) for t in tensors if not t.is_sparse]
    flag = _nonfinite(tensors) if tensors else None
    if _distributed():
        # Every rank skips together (a hook may write on one rank only): one all-reduce of the flags, on the device.
        device = flag.device if flag is not None else first_grad_device(optimizer) or torch.device(device)
        zero = torch.zeros((), device=device)
        agreed = torch.stack([flag.float() if flag is not None else zero,
                              spike.to(device).float() if spike is not None else zero])
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        flag = agreed[0] > 0
        spike = agreed[1] > 0 if spike is not None else None
    if spike is not None:
        flag = spike if flag is None else flag | spike.to(flag.device)
    return (fold(optimizer, flag) if flag is not None else None), spike


def late_nonfinite_note(optimizer: Optimizer) -> str:
    """The note for a step skipped for inf/NaN the gradient check did not see (nothing is blamed on a module)."""
    return (f"{type(optimizer).__name__}: a step was skipped for inf/NaN that entered after the gradient check (a"
            " hook or clipping wrote into the gradients after unscale_, or the optimizer state, the FP32 master"
            " weights or the loss scale hold inf/NaN); this is not a precision problem and nothing was blamed.")


def stale_grads_note(optimizer: Optimizer) -> str | None:
    """The note for a backward begun after ``unscale_`` without a step: that batch's gradients are dropped (the new
    scaled ones cannot be added to unscaled ones); None when it had none."""
    if not any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
        return None
    return (f"{type(optimizer).__name__}: a backward began after unscale_()/clipping without a step() (nor"
            " zero_grad()): the unscaled gradients of that batch were dropped, since the new scaled ones cannot"
            " be added to them. Call step() or zero_grad() before the next backward.")


def _distributed() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _nonfinite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Whether any of ``tensors`` holds inf/NaN, as a 0-dim device bool: one multi-tensor L1 norm per device (a few
    kernel launches, not one per tensor), accumulated in FP32 (an FP16 sum would overflow); no host read."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    flags = [~torch.isfinite(torch.stack(torch._foreach_norm(group, 1, dtype=torch.float32))).all()
             for group in by_device.values()]
    first = flags[0]
    return first if len(flags) == 1 else torch.stack([f.to(first.device) for f in flags]).any()

"""What the step checks beyond the scaler's gradient check: inf/NaN that entered after it (the step-input check), and
the notes for a skip it explains and for a batch dropped between unscale and step."""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.optim import Optimizer

from lit_mpstable.core.scaling.loss_scaler import one_on
from lit_mpstable.core.scaling.scalers import LossScaler
from lit_mpstable.core.tensors import GradOff, local_view
from lit_mpstable.core.weights.keeper import first_grad_device

STATE_SHARES = 16
"""The parameters (or FP32 masters) and optimizer state are checked in this many shares, one per applied step of
their optimizer: only the step writes them, and reading them all every step (about 3x the model's bytes for Adam)
cost ~12% of a bf16-mixed GPT step on the CPU; a share costs a sixteenth of that (0.2 ms with the Python around it).
The gradients and the scale, which hooks and clipping write between the gradient check and the step, are checked
whole every step (only those written since the gradient check are read again)."""


def check_step_inputs_(checker: LossScaler, optimizer: Optimizer, *, scaled: bool, device: str | torch.device,
                       spike: torch.Tensor | None = None,
                       share: int | None = 0,
                       grads: list[torch.Tensor] | None = None,
                       factor: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Fold into the step's skip flag whether what the step reads holds inf/NaN now: the gradients as hooks and
    clipping left them after the check (a NaN clip norm makes them NaN; ``grads``: those written since the check,
    the others need no second read; None: all of ``optimizer``'s), the loss scale (``scaled``: a loss scale exists)
    and ``factor``, the multiplier a compact keeper's step still applies to the gradients (its unscale times its clip
    factor: a NaN ``max_norm`` makes it NaN), every step; the parameters (FP32 masters) and the optimizer's state,
    share ``share`` of :data:`STATE_SHARES` (None: all of them), checked into the gradient check's own flag where the
    checker can (``check_also_``: one process). On the device, no host read: the step's one sync reads the flag.

    ``spike`` (a SpikeGuard's 0-dim bool decision) joins the folded flag too, agreed across ranks in the same
    all-reduce (a spike seen on one rank skips the step on all). Returns the gradient check as it was before (None
    where the scaler cannot take a flag) and the spike flag as agreed (None without ``spike``)."""
    if grads is None:
        grads = [g for group in optimizer.param_groups for p in group["params"] if (g := p.grad) is not None]
    # The gradients written since the check and this step's share of the held state: one check kernel (per device
    # and dtype) into one FP32 flag, which folds into the step's flag as it is (no bool, no stack).
    tensors = [g if type(g) is torch.Tensor else local_view(g) for g in grads if not g.is_sparse] if grads else []
    held = held_tensors(optimizer, None if share is None else share % STATE_SHARES)
    distributed = _distributed()
    # The held share goes into the gradient check's own flag where it can (one kernel, nothing to fold); a
    # multi-process run checks it apart, in the flag its all-reduce agrees on.
    if held and (distributed or not checker.check_also_(optimizer, held)):
        tensors += held
    if not tensors and not scaled and factor is None and spike is None and not distributed:
        return None, None  # a clean step: nothing was written since the check, nothing else to read apart
    scale = checker.get_scale_tensor() if scaled else None
    if scale is not None and scale.is_floating_point() and not scale.is_inference():
        # The scale joins the check kernel (it writes the scale back times 1, exactly): one kernel, not six ops.
        tensors, scale = [*tensors, scale], None
    flag = _found_nonfinite(tensors) if tensors else None
    if scale is not None or factor is not None:
        checks = [] if flag is None else [flag > 0]
        checks += [~torch.isfinite(t).all() for t in (scale, factor) if t is not None]
        flag = _any(checks)
    if distributed:
        # Every rank skips together (a hook may write on one rank only): one all-reduce of the flags, on the device.
        device = flag.device if flag is not None else first_grad_device(optimizer) or torch.device(device)
        zero = torch.zeros((), device=device)
        agreed = torch.stack([flag.float() if flag is not None else zero,
                              spike.to(device).float() if spike is not None else zero])
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        flag = agreed[0] > 0
        spike = agreed[1] > 0 if spike is not None else None
    if spike is not None:
        flag = spike if flag is None else (flag > 0) | spike.to(flag.device)
    # Both checker kinds fold (a duck-typed scaler's folds nothing).
    return (checker.fold_found_inf_(optimizer, flag) if flag is not None else None), spike


def batch_ends(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each of ``tensors``' (a batch's non-empty floating tensors) minimum and maximum, 0-dim on its device, taken now
    (a later in-place write into the batch does not change them): a NaN makes both NaN, an infinity is one of them,
    and nothing batch-sized is allocated. One ``torch.aminmax`` per tensor and nothing else: whether they hold inf/NaN
    (:func:`ends_nonfinite`) is asked only when the answer is needed, after an overflow."""
    return [end for t in tensors for end in torch.aminmax(t.detach() if t.requires_grad else t)]


def ends_nonfinite(ends: list[torch.Tensor]) -> torch.Tensor:
    """Whether any of :func:`batch_ends`' ``ends`` is inf/NaN, as a 0-dim bool on the first one's device, without a
    host read: GradScaler's check kernel over them at an inverse scale of 1 (it writes each back unchanged; copies of
    ends taken under inference mode, a validation batch's, which only inference mode may write)."""
    device = ends[0].device
    ends = [end.clone() if end.is_inference() else end if end.device == device else end.to(device) for end in ends]
    found = torch.zeros((), dtype=torch.float32, device=device)
    torch._amp_foreach_non_finite_check_and_unscale_(ends, found, one_on(device))
    return found > 0


def held_nonfinite(optimizer: Optimizer) -> bool:
    """Whether any parameter (FP32 master) or optimizer state tensor of the stepped parameters holds inf/NaN, agreed
    across ranks. A host read: asked only on a step skipped for an overflow, before blaming precision for it (corrupt
    state makes the next gradients NaN, and that is no precision problem). Every parameter: a skip may have dropped
    the gradients already."""
    held = held_tensors(optimizer, stepped=False)
    flag = _unchanged_nonfinite(held) if held else torch.zeros((), dtype=torch.bool)
    if _distributed():
        device = first_grad_device(optimizer) or flag.device
        agreed = flag.to(device).float().view(1)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        return bool(agreed.item() > 0)
    return bool(flag)


def held_tensors(optimizer: Optimizer, share: int | None = None, *, stepped: bool = True) -> list[torch.Tensor]:
    """The tensors a step reads besides the gradients: each parameter (``stepped``: with a gradient, the ones the
    step updates) and its plain floating-point state; of share ``share`` of :data:`STATE_SHARES` only (consecutive
    parameters of about equal size in all), or all."""
    if share is None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None or not stepped]
    else:
        params = [p for p in _shares(optimizer)[share] if p.grad is not None or not stepped]
        if not params:  # most of a small model's shares (a share holds whole parameters)
            return []
    held = []
    for param in params:
        held.append(param)
        # Plain tensors only: quantized states (torchao's 8-bit subclasses) support no foreach kernels, and their
        # codes are integers that cannot hold inf/NaN.
        held += [v for v in optimizer.state.get(param, {}).values()
                 if type(v) in (torch.Tensor, nn.Parameter) and v.is_floating_point() and v.dim() > 0]
    return [local_view(t) for t in held if not t.is_sparse]


_SHARES: dict[int, tuple[weakref.ref, tuple[int, ...], list[list[torch.Tensor]]]] = {}
"""Per optimizer (by id, its weak reference telling a new optimizer at a reused address apart): the parameter ids the
shares were made from, and the shares."""


def _shares(optimizer: Optimizer) -> list[list[torch.Tensor]]:
    """``optimizer``'s parameters in :data:`STATE_SHARES` shares (:func:`_share`), computed once per set of parameters
    (by identity: a parameter added, or replaced in its group, makes them anew); a step then reads its share's
    parameters without summing every parameter's size again."""
    groups = optimizer.param_groups
    params = groups[0]["params"] if len(groups) == 1 else [p for group in groups for p in group["params"]]
    if torch.compiler.is_compiling():  # traced once per graph: no cache (its finalizer would fail dynamo's guards)
        return [_share(params, i) for i in range(STATE_SHARES)]
    key = tuple(map(id, params))
    cached = _SHARES.get(id(optimizer))
    if cached is None or cached[0]() is not optimizer or cached[1] != key:
        if cached is None or cached[0]() is not optimizer:  # the entry goes with the optimizer (it holds parameters)
            weakref.finalize(optimizer, _SHARES.pop, id(optimizer), None)
        shares = [_share(params, i) for i in range(STATE_SHARES)]
        cached = _SHARES[id(optimizer)] = (weakref.ref(optimizer), key, shares)
    return cached[2]


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


_DIST = torch.distributed.is_available()  # the build's half, asked once


def _distributed() -> bool:
    return _DIST and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def _unchanged_nonfinite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Whether any of ``tensors`` holds inf/NaN, as a 0-dim device bool, exactly and without a host read: GradScaler's
    unscale kernel with an inverse scale of exactly 1, which writes each tensor back unchanged (x * 1 is exact in every
    floating format, inf and NaN stay). Only tensors the step itself writes in place are given (gradients,
    parameters, optimizer state), so each is writable. A third of the cost of a multi-tensor L1 norm on the CPU."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    flags = []
    with torch.no_grad():
        for (dev, _), group in groups.items():
            found = torch.zeros((), dtype=torch.float32, device=dev)  # FP32 always, 0-dim as GradScaler's
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, one_on(dev))
            flags.append(found > 0)
    return _any(flags)


_NO_GRAD = GradOff()  # _found_nonfinite's torch.no_grad(), entered on the steps that check a share


def _found_nonfinite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """:func:`_unchanged_nonfinite` as the kernel leaves it: a 0-dim FP32 flag (1.0: found) on the first tensor's
    device, one check kernel per device and dtype into it (another device's flag is added on that device)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    found = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    with _NO_GRAD:
        for (dev, _), group in groups.items():
            if dev == found.device:
                torch._amp_foreach_non_finite_check_and_unscale_(group, found, one_on(dev))
            else:
                other = torch.zeros((), dtype=torch.float32, device=dev)
                torch._amp_foreach_non_finite_check_and_unscale_(group, other, one_on(dev))
                torch.maximum(found, other.to(found.device), out=found)
    return found


def _share(tensors: list[torch.Tensor], index: int) -> list[torch.Tensor]:
    """Share ``index`` of :data:`STATE_SHARES`: the tensors that start in it, laid end to end by element count."""
    total = sum(t.numel() for t in tensors)
    chosen, start = [], 0
    for t in tensors:
        if start * STATE_SHARES // max(total, 1) == index:
            chosen.append(t)
        start += t.numel()
    return chosen


def _any(flags: list[torch.Tensor]) -> torch.Tensor:
    first = flags[0]
    return first if len(flags) == 1 else torch.stack([f.to(first.device) for f in flags]).any()

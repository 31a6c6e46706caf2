"""Tensor helpers of the step: the one pass over the gradients, nested batches mapped tensor by tensor and the
default dtype."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from itertools import repeat
from operator import attrgetter
from typing import Any, NamedTuple

import torch


class GradPass(NamedTuple):
    """What one pass over a step's gradients found, on the device (0-dim tensors, never read here).

    Attributes:
        norm: the global L2 norm of the gradients in FP32, as they were read (a deferring keeper's still scaled);
            inf/NaN when any gradient holds inf/NaN.
        found: 1.0 where ``norm`` is not finite, else 0.0 (FP32, GradScaler's found-inf flag, which the gradient check
            takes as its own): some gradient holds inf/NaN, or one is so large (above ~1.8e19, where FP32 squares
            overflow, as Adam's second moment would) that the norm overflows. None from a pass asked for no flag
            (``check=False``: GradScaler's unscale kernel checked the gradients already).
        fp32: every gradient read is FP32: ``norm`` is the number ``torch.nn.utils.clip_grad_norm_`` computes.
    """

    norm: torch.Tensor
    found: torch.Tensor | None
    fp32: bool

    @property
    def finite(self) -> torch.Tensor:
        """Whether ``norm`` is finite (a 0-dim bool, one kernel when asked; the step itself reads :attr:`found`)."""
        return self.found == 0 if self.found is not None else self.norm.isfinite()


_PLAIN = {torch.Tensor}
_FP32 = {torch.float32}
_IS_SPARSE, _DEVICE, _DTYPE = attrgetter("is_sparse"), attrgetter("device"), attrgetter("dtype")


def grad_pass(grads: Sequence[torch.Tensor], found: torch.Tensor | None = None, *, check: bool = True
              ) -> GradPass | None:
    """One multi-tensor pass over ``grads`` (one ``torch._foreach_norm``): their global L2 norm and its inf/NaN flag,
    what the step's gradient check, a SpikeGuard and a clip by norm all read. Four kernels: the per-tensor norms, their
    stack, its norm (torch's ``clip_grad_norm_`` reduction, bit for bit) and GradScaler's check kernel on that norm
    (at an inverse scale of 1: it writes the norm back unchanged) into ``found``, a 0-dim FP32 zero on their device
    (a flag nothing holds any more; None: one is made, a kernel more); ``check=False``: no flag (three kernels), for
    gradients GradScaler's unscale kernel checked already. No host read. None where the pass does not apply (no
    gradients; sparse ones, DTensor shards, or several devices): the caller checks them its own way."""
    if not grads:
        return None
    # C-level maps, no Python call per gradient: plain dense tensors on one device.
    if set(map(type, grads)) != _PLAIN or any(map(_IS_SPARSE, grads)) or len(devices := set(map(_DEVICE, grads))) > 1:
        return None
    (device,) = devices
    norms = torch._foreach_norm(grads if isinstance(grads, list) else list(grads), 2, dtype=torch.float32)
    norm = torch.linalg.vector_norm(torch.stack(norms), 2)  # FP32 norms, a 16-bit gradient's too
    if not check:
        return GradPass(norm, None, set(map(_DTYPE, grads)) == _FP32)
    if norm.requires_grad:  # a create_graph backward's gradients: the pass reads their values only
        norm = norm.detach()
    if found is None or found.device != device:
        found = torch.zeros((), dtype=torch.float32, device=device)
    torch._amp_foreach_non_finite_check_and_unscale_([norm], found, one_on(device))
    return GradPass(norm, found, set(map(_DTYPE, grads)) == _FP32)


_PLAIN_TYPES = {torch.Tensor, torch.nn.Parameter}


class GradOff:
    """``torch.no_grad()`` for the check kernels on the step path, as one reusable object: entering it costs two C
    calls instead of torch's Python ``set_grad_enabled`` objects (not reentrant: keep one per use, and enter nothing
    that enters the same one inside)."""

    def __enter__(self) -> None:
        self.prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        torch._C._set_grad_enabled(self.prev)


def first_grad_device(optimizer: torch.optim.Optimizer) -> torch.device | None:
    """Where ``optimizer``'s first gradient lives (None: it has none)."""
    return next((p.grad.device for g in optimizer.param_groups for p in g["params"] if p.grad is not None), None)


_ONES: dict[torch.device, torch.Tensor] = {}


def one_on(device: torch.device) -> torch.Tensor:
    """A 0-dim FP32 1.0 on ``device``, made once: the inverse scale of an inf/NaN check at scale 1, which GradScaler's
    unscale kernel only reads (never write into it)."""
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones((), dtype=torch.float32, device=device)
    return one


def dense_values(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` with each sparse one (COO: the gradient of ``nn.Embedding(sparse=True)``) replaced by its coalesced
    values: the same norms, extremes and inf/NaN, in a plain tensor the multi-tensor ops take. ``tensors`` itself
    where none is sparse."""
    if not any(map(_IS_SPARSE, tensors)):
        return tensors
    return [t.coalesce().values() if t.is_sparse else t for t in tensors]


def grad_norms(grads: list[torch.Tensor], norm_type: float, *, full: bool = False) -> list[torch.Tensor]:
    """Each gradient's norm in FP32 (a 16-bit gradient's too, without an FP32 copy of it): one multi-tensor kernel
    where they are plain tensors on one device, else one call each; ``full``: a sharded (DTensor) norm made whole.
    A sparse gradient's norm is its coalesced values' (:func:`dense_values`)."""
    grads = dense_values(grads)
    if all(type(g) is torch.Tensor for g in grads) and len({g.device for g in grads}) == 1:
        return list(torch._foreach_norm(grads, norm_type, dtype=torch.float32))
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]
    return [n.full_tensor() if full and hasattr(n, "full_tensor") else n for n in norms]


def amax_per_tensor(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Largest absolute value of each tensor, as one 1-D float32 tensor on their (common) device; no host sync.

    A tensor holding NaN gives NaN and one holding inf gives inf, so the result doubles as an inf/NaN check.
    Empty tensors give 0.
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    device = tensors[0].device
    present = [t for t in tensors if t.numel() > 0]
    if not present:
        return torch.zeros(len(tensors), dtype=torch.float32, device=device)
    if device.type == "cpu":
        # The inf-norm is an unvectorised loop on the CPU (~20x slower than aminmax there, measured); aminmax
        # propagates NaN, and max(max, -min) is the amax.
        pairs = [torch.aminmax(t) for t in present]
        mins = torch.stack([p.min for p in pairs]).float()
        maxs = torch.stack([p.max for p in pairs]).float()
        amax = torch.maximum(maxs, mins.neg())
    else:
        # One fused multi-tensor kernel on CUDA.
        amax = torch.stack(torch._foreach_norm(present, ord=float("inf"))).float()
    if len(present) == len(tensors):
        return amax
    out = torch.zeros(len(tensors), dtype=torch.float32, device=device)
    out[torch.tensor([i for i, t in enumerate(tensors) if t.numel() > 0], device=device)] = amax
    return out


def floating_tensors(data: object) -> list[torch.Tensor]:
    """The non-empty floating tensors of ``data`` (nested lists, tuples, namedtuples, dicts)."""
    if type(data) in _FLAT and all(map(isinstance, data, repeat(torch.Tensor))):  # type: ignore[call-overload]
        # The usual batch, (inputs, targets): no recursion.
        return [t for t in data if t.is_floating_point() and t.numel()]  # type: ignore[attr-defined]
    found: list[torch.Tensor] = []
    _collect_floating(data, found)
    return found


_FLAT = {tuple, list}


def _collect_floating(data: Any, found: list[torch.Tensor]) -> None:
    # The containers map_tensors walks, in its order (a namedtuple is a tuple), without rebuilding them.
    if isinstance(data, torch.Tensor):
        if data.is_floating_point() and data.numel():
            found.append(data)
    elif isinstance(data, (list, tuple)):
        for item in data:
            _collect_floating(item, found)
    elif isinstance(data, dict):
        for item in data.values():
            _collect_floating(item, found)


def map_tensors(data: Any, fn: Any) -> Any:
    """``data`` with ``fn`` applied to every tensor; lists, tuples, namedtuples and dicts rebuilt as they were."""
    if isinstance(data, torch.Tensor):
        out = fn(data)
        return data if out is None else out
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(map_tensors(v, fn) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(map_tensors(v, fn) for v in data)
    if isinstance(data, dict):
        return type(data)((k, map_tensors(v, fn)) for k, v in data.items())
    return data


def local_view(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2), any other tensor as it is."""
    if type(tensor) in _PLAIN_TYPES:  # no attribute to look for (a failed getattr costs a raised AttributeError)
        return tensor
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


@contextmanager
def default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    """``torch.set_default_dtype(dtype)`` inside the block, the previous default restored after (also on error)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)

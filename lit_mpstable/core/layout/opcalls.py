"""One op call as the op policy sees it: its shapes, running it in FP32 inside autocast (the 16-bit inputs kept for
the backward), and measuring it both ways, in time, accuracy and memory."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Measurement:
    """Time per forward (forward + backward of the family's calls, weighted by how often each ran), the worst
    relative error against FP64, autocast's way and in FP32, and the bytes FP32 holds for the backward beyond what
    autocast holds (per forward; negative when it holds less)."""

    autocast_ms: float
    fp32_ms: float
    autocast_err: float
    fp32_err: float
    fp32_extra_bytes: float = 0.0


@dataclass(frozen=True)
class _Spec:
    """A tensor argument, remembered by shape and dtype only; ``slot`` numbers distinct tensors, so a call passing one
    tensor twice (self-attention: query is key is value) is measured that way, on its fused path. ``parameter``: an
    ``nn.Parameter`` (resident memory, not the step's)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    slot: int
    parameter: bool = False


@dataclass
class OpCall:
    """One distinct call seen in a forward (function + argument shapes), how often it ran, and the elements of its
    output. ``count`` may be fractional: a call cut to fit the measuring memory (:meth:`fitted`) stands for more."""

    family: str
    func: Callable
    args: tuple
    kwargs: dict[str, object]
    count: float = 1
    out_numel: int = 0

    @property
    def key(self) -> str:
        return f"{getattr(self.func, '__qualname__', self.func)}{self.args!r}{sorted(self.kwargs.items())!r}"

    @property
    def specs(self) -> list[_Spec]:
        return [s for s in leaves((self.args, self.kwargs)) if isinstance(s, _Spec)]

    @property
    def nbytes(self) -> float:
        return self.count * sum(s.dtype.itemsize * math.prod(s.shape) for s in self.specs)

    @property
    def measure_bytes(self) -> int:
        """What measuring the call holds at most, estimated high: 18 bytes per input and output element (16-bit
        data, FP32 copies, gradients; measured 10 to 13 for convolutions and batch norms on the CPU)."""
        return 18 * sum(self._numels())

    def _numels(self) -> tuple[int, int]:
        """Elements that scale with the batch (batch-like inputs, the output) and the rest (weights, statistics)."""
        batch, scaled, fixed = self.batch, self.out_numel, 0
        for s in {s.slot: s for s in self.specs}.values():
            if _batch_like(s) and s.shape[0] == batch:
                scaled += math.prod(s.shape)
            else:
                fixed += math.prod(s.shape)
        return scaled, fixed

    def fitted(self, max_bytes: float) -> OpCall | None:
        """This call, or a smaller one of the same kind whose :attr:`measure_bytes` fit ``max_bytes`` (see
        :meth:`cut`); None when not even one sample fits."""
        if self.measure_bytes <= max_bytes:
            return self
        scaled, fixed = self._numels()
        keep = int(self.batch * (max_bytes / 18 - fixed) / max(scaled, 1))
        return self.cut(keep) if keep >= 1 else None

    @property
    def batch(self) -> int:
        """The leading dim of the first batch-like argument (a tensor of 2 dims or more, not a parameter), else 1."""
        return next((s.shape[0] for s in self.specs if _batch_like(s)), 1)

    def cut(self, keep: int) -> OpCall:
        """The same call on ``keep`` of its :attr:`batch`: every batch-like tensor whose leading dim is the batch's
        cut to ``keep``, and :attr:`count` raised by as much, so times and bytes still stand for the full call (big
        ops scale linearly in their batch)."""
        batch = self.batch
        if keep >= batch:
            return self

        def cut(v: object) -> object:
            if isinstance(v, _Spec) and _batch_like(v) and v.shape[0] == batch:
                return replace(v, shape=(keep, *v.shape[1:]))
            return v

        args, kwargs = _map(cut, (self.args, self.kwargs))
        return OpCall(self.family, self.func, args, kwargs, self.count * batch / keep, self.out_numel * keep // batch)


def _batch_like(spec: _Spec) -> bool:
    # Weights and 1-d statistics (BatchNorm's running mean) never carry the batch, whatever their size.
    return len(spec.shape) >= 2 and not spec.parameter


def run_in(
    dtype: torch.dtype, family: str, device_type: str, func: Callable, args: tuple, kwargs: dict,
    saved: SavedTensors | None = None,
) -> Any:
    """``func`` with autocast off and its floating inputs in ``dtype``. Norms cast only their input: their FP32
    running statistics are updated in place, and CPU/CUDA norm kernels take FP32 affine parameters with 16-bit
    inputs. The output stays in ``dtype``, as an FP32 island's does; the next autocast op casts it as it needs.

    Eagerly, a 16-bit input cast up to FP32 is kept for the backward as its 16-bit source and cast again there (an
    exact round trip): FP32 compute without FP32 copies of its inputs held until the backward. A compiled graph
    decides what it keeps itself (its partitioner recomputes such casts). ``saved`` counts what is held."""
    sources: dict[int, torch.Tensor] = {}
    if family == "norm" and args:
        args = (_cast(args[0], dtype, sources), *args[1:])
    elif family == "norm":
        kwargs = {**kwargs, "input": _cast(kwargs["input"], dtype, sources)}
    else:
        args, kwargs = _cast(args, dtype, sources), _cast(kwargs, dtype, sources)
    if torch.compiler.is_compiling() or (not sources and saved is None):
        hooks: AbstractContextManager = nullcontext()
    else:
        saved = saved if saved is not None else SavedTensors()
        saved.sources = sources
        hooks = saved.hooks()
    with torch.autocast(device_type, enabled=False), hooks:
        return func(*args, **kwargs)


# What SavedTensors keeps for a saved tensor: the tensor, or the 16-bit source it was upcast from (with the dtype
# and strides to recreate the upcast copy).
_Packed = torch.Tensor | tuple[torch.Tensor, torch.dtype, tuple[int, ...]]


class SavedTensors:
    """``saved_tensors_hooks`` that keep an upcast's 16-bit ``sources`` in its place (by data pointer; recast with
    the same strides when the backward asks) and count the bytes held, per storage."""

    def __init__(self, sources: dict[int, torch.Tensor] | None = None) -> None:
        self.sources = sources or {}
        self.storages: dict[int, int] = {}

    def hooks(self) -> AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> _Packed:
        ptr = plain_ptr(t)
        source = self.sources.get(ptr) if ptr is not None else None
        if source is not None and source.shape == t.shape and source.dtype.itemsize < t.dtype.itemsize:
            self._count(source)
            return source, t.dtype, t.stride()
        self._count(t)
        return t

    @staticmethod
    def _unpack(packed: _Packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        source, dtype, stride = packed
        return torch.empty_strided(source.shape, stride, dtype=dtype, device=source.device).copy_(source)

    def _count(self, t: torch.Tensor) -> None:
        if (ptr := plain_ptr(t)) is not None:  # tensor subclasses (DTensor) and sparse tensors: not counted
            self.storages[ptr] = t.untyped_storage().nbytes()


def plain_ptr(t: torch.Tensor) -> int | None:
    """Where the storage of a plain dense tensor (parameters included) starts, else None."""
    plain = type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided and t.device.type != "meta"
    return t.untyped_storage().data_ptr() if plain else None


def _map(fn: Callable[[object], object], value: object) -> Any:
    """``fn`` on every leaf of nested lists, tuples and dicts (an op's arguments); ``torch.Size`` is a leaf."""
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return type(value)(_map(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: _map(fn, v) for k, v in value.items()}
    return fn(value)


def leaves(value: object) -> list[object]:
    found: list[object] = []
    _map(found.append, value)
    return found


def _cast(value: object, dtype: torch.dtype, sources: dict[int, torch.Tensor] | None = None) -> Any:
    """``value`` with its floating tensors in ``dtype``; ``sources`` maps each new upcast copy to what it came from."""

    def cast(v: object) -> object:
        if not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.dtype == dtype:
            return v
        out = v.to(dtype)
        upcast = v.dtype.itemsize < dtype.itemsize and not torch.compiler.is_compiling()
        if sources is not None and upcast and (ptr := plain_ptr(out)) is not None:
            sources[ptr] = v  # a fresh copy, in its own storage
        return out

    return _map(cast, value)


def specs_of(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    slots: dict[int, int] = {}

    def spec(v: object) -> object:
        if not isinstance(v, torch.Tensor):
            return v
        return _Spec(tuple(v.shape), v.dtype, v.requires_grad, slots.setdefault(id(v), len(slots)),
                     isinstance(v, nn.Parameter))

    return _map(spec, (args, kwargs))


# ------------------------------------------------------------------------------------------- measurement
# Per device, dtype and call: (autocast s, fp32 s, autocast error, fp32 error, fp32 extra bytes, seconds it took).
_MEASURED: dict[tuple, tuple[float, ...]] = {}


def measure_calls(calls: list[OpCall], device_type: str, dtype: torch.dtype, budget_s: float) -> Measurement:
    """Time the recorded calls of one family (forward + backward, autocast's way and in FP32) on fresh tensors of
    the same shapes, largest first, until ``budget_s`` is spent; each result is cached per device, dtype and shapes
    (a cached call is charged what it cost once, so a later run measures the same calls, for free). Errors are
    relative to an FP64 run of the same call; the bytes are those each way holds for the backward, parameters
    aside. Totals are weighted by how often each call ran (a call cut to fit in memory counts for the full one)."""
    totals, spent = [0.0, 0.0, 0.0, 0.0, 0.0], 0.0
    for i, call in enumerate(sorted(calls, key=lambda c: c.nbytes, reverse=True)):
        if i and spent > budget_s:
            break
        key = (device_type, dtype, call.key)
        if key not in _MEASURED:
            started = time.perf_counter()
            _MEASURED[key] = (*_measure_one(call, device_type, dtype), time.perf_counter() - started)
        t_auto, t_fp32, e_auto, e_fp32, extra, cost_s = _MEASURED[key]
        spent += cost_s
        totals = [totals[0] + call.count * t_auto, totals[1] + call.count * t_fp32, max(totals[2], e_auto),
                  max(totals[3], e_fp32), totals[4] + call.count * extra]
    return Measurement(totals[0] * 1e3, totals[1] * 1e3, totals[2], totals[3], totals[4])


def _measure_one(call: OpCall, device_type: str, dtype: torch.dtype, repeats: int = 2) -> tuple[float, ...]:
    def run(fp32: bool, args: tuple, kwargs: dict, *, backward: bool = True,
            saved: SavedTensors | None = None) -> torch.Tensor:
        with torch.autocast(device_type, dtype=dtype, cache_enabled=False):
            if fp32:
                out = run_in(torch.float32, call.family, device_type, call.func, args, kwargs, saved)
            else:
                with saved.hooks() if saved is not None else nullcontext():
                    out = call.func(*args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        inputs = [t for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        if backward and inputs and out.requires_grad:
            for t in inputs:
                t.grad = None
            out.backward(torch.ones_like(out))
        return out

    with torch.inference_mode(False), torch.enable_grad():
        args, kwargs, parameters = _fresh(call, device_type)
        seconds: dict[bool, list[float]] = {False: [], True: []}
        held: dict[bool, int] = {}
        for i in range(repeats + 1):  # the first round warms up (kernel selection, allocator); alternate the two
            for fp32 in (False, True):
                saved = SavedTensors() if i == 0 else None
                start = clock(device_type)
                run(fp32, args, kwargs, saved=saved)
                if saved is not None:
                    held[fp32] = sum(n for ptr, n in saved.storages.items() if ptr not in parameters)
                if i:
                    seconds[fp32].append(clock(device_type) - start)
        del args, kwargs
        # The error on an eighth of the batch: elementwise, it does not depend on the batch, and the FP64 reference
        # costs several times the 16-bit call (8-byte elements, unfused kernels with im2col buffers).
        args, kwargs, _ = _fresh(call.cut(max(1, call.batch // 8)), device_type)
        with torch.no_grad():
            with torch.autocast(device_type, enabled=False):
                ref = call.func(*_cast(args, torch.float64), **_cast(kwargs, torch.float64))
            ref = ref[0] if isinstance(ref, tuple) else ref
            errors = [_rel_err(run(fp32, args, kwargs, backward=False), ref) for fp32 in (False, True)]
    return min(seconds[False]), min(seconds[True]), errors[0], errors[1], float(held[True] - held[False])


def _fresh(call: OpCall, device_type: str) -> tuple[tuple, dict, set[int | None]]:
    """New tensors for the call's arguments (one per slot), and the storages of those standing for parameters."""
    generator = torch.Generator(device_type).manual_seed(0)  # the training run's RNG stream stays untouched
    made: dict[int, torch.Tensor] = {}

    def fresh(value: object) -> object:
        if not isinstance(value, _Spec) or value.slot in made:
            return made[value.slot] if isinstance(value, _Spec) else value
        if not value.dtype.is_floating_point:
            t = torch.ones(value.shape, dtype=value.dtype, device=device_type)
        else:  # positive values: a sampled running variance must not be negative; the timing does not care
            t = torch.rand(value.shape, generator=generator, dtype=value.dtype, device=device_type).add_(0.5)
            t.requires_grad_(value.requires_grad)
        made[value.slot] = t
        return t

    args, kwargs = _map(fresh, (call.args, call.kwargs))
    return args, kwargs, {plain_ptr(made[s.slot]) for s in call.specs if s.parameter}


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    err = float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    return err if err == err else math.inf  # NaN (an FP16 overflow) counts as the worst error


def clock(device_type: str) -> float:
    """Seconds: on the CPU the process's CPU time (a shared machine's other processes do not add to it), on CUDA wall
    time after the kernels queued so far have finished."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return time.process_time()
    torch.cuda.synchronize()
    return time.perf_counter()

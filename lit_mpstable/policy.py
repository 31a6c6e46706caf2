"""Per-op precision policy: the dtype each op family runs in under autocast, forced or chosen by measurement."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["FAMILIES", "Measurement", "OpCall", "OpPolicy", "StepCost", "choose", "measure_calls"]

Family = Literal["matmul", "conv", "attention", "norm", "softmax"]

# The public functions of each family, as a TorchFunctionMode sees them (F.* and Tensor methods). An
# nn.MultiheadAttention forward is one call here, projections included: its inner SDPA is not visible on its own.
FAMILIES: dict[str, tuple[Callable, ...]] = {
    "matmul": (F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
               torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.baddbmm),
    "conv": (F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d),
    "attention": (F.scaled_dot_product_attention, F.multi_head_attention_forward),
    "norm": (F.layer_norm, F.group_norm, F.batch_norm, F.instance_norm, F.rms_norm),
    "softmax": (F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax,
                torch.Tensor.log_softmax),
}
assert tuple(FAMILIES) == get_args(Family)
_FAMILY_OF = {func: family for family, funcs in FAMILIES.items() for func in funcs}
_LOWERED = ("matmul", "conv", "attention")  # autocast runs these in its 16-bit dtype on every device
_AUTOCAST_FP32 = {"cuda": {"norm", "softmax"}}  # and these in FP32 on CUDA: "auto" has nothing to decide there
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_FORMAT_IDS = {dtype: name for name, dtype in _DTYPES.items()}


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
class StepCost:
    """One training step of the model: its wall time and peak tensor memory, measured or estimated in the first
    step (see :class:`OpPolicy`); what a family's saved time and added memory are weighed against."""

    ms: float
    peak_bytes: float


def choose(m: Measurement, margin: float = 0.2, step: StepCost | None = None) -> str:
    """``"fp32"`` only when FP32 is faster by more than ``margin``, numerically no worse, and (given ``step``)
    pays for the memory it adds with speed: the step's time x peak memory must not grow,
    ``(step.ms - saved_ms) * (step.peak_bytes + extra_bytes) <= step.ms * step.peak_bytes``; else ``"autocast"``.

    The margin is a guess that covers timer noise on a shared CPU (a few percent) and what a per-op measurement
    cannot see: the casts between neighbouring ops. nn.MultiheadAttention measured ~10 % faster in FP32 yet made
    the demo Transformer's step no faster; SDPA in lit_mpstable.zoo.GPT measures ~40 % faster, and is. Time x memory
    is the cost of a step on a machine whose memory bounds the batch: FP32 that is 10 % faster for 5 % more memory
    lowers it; 3 % faster for 5 % more does not.
    """
    faster = m.fp32_ms < (1.0 - margin) * m.autocast_ms
    pays = step is None or m.fp32_extra_bytes <= 0 or (
        (step.ms - (m.autocast_ms - m.fp32_ms)) * (step.peak_bytes + m.fp32_extra_bytes) <= step.ms * step.peak_bytes
    )
    return "fp32" if faster and pays and m.fp32_err <= m.autocast_err else "autocast"


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
    kwargs: dict[str, Any]
    count: float = 1
    out_numel: int = 0

    @property
    def key(self) -> str:
        return f"{getattr(self.func, '__qualname__', self.func)}{self.args!r}{sorted(self.kwargs.items())!r}"

    @property
    def specs(self) -> list[_Spec]:
        return [s for s in _leaves((self.args, self.kwargs)) if isinstance(s, _Spec)]

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

        def cut(v: Any) -> Any:
            if isinstance(v, _Spec) and _batch_like(v) and v.shape[0] == batch:
                return replace(v, shape=(keep, *v.shape[1:]))
            return v

        args, kwargs = _map(cut, (self.args, self.kwargs))
        return OpCall(self.family, self.func, args, kwargs, self.count * batch / keep, self.out_numel * keep // batch)


def _batch_like(spec: _Spec) -> bool:
    # Weights and 1-d statistics (BatchNorm's running mean) never carry the batch, whatever their size.
    return len(spec.shape) >= 2 and not spec.parameter


@dataclass
class _Recording:
    """The first training forward: its calls, when it started, and the bytes it held for the backward."""

    calls: dict[str, OpCall]
    started: float
    activation_bytes: int = 0
    parameter_bytes: int = 0


class OpPolicy:
    """Which dtype each op family runs in while autocast is on: autocast's own choice, FP32, or the 16-bit format.

    ``spec`` is ``"autocast"`` (PyTorch's per-op lists everywhere), ``"auto"`` (every family measured on the model's
    own shapes, see below), or a mapping ``{family: request}`` with requests ``"autocast"``, ``"auto"``, ``"fp32"``
    or the 16-bit format id; families left out keep ``"autocast"``. A forced dtype applies only where autocast is
    on, so FP32 islands always win.

    ``"auto"``: the first forward with gradients enabled runs as autocast would and records every call of the
    families to decide (shapes only), and the bytes the forward holds for its backward (the step's activation
    memory). The next forward starts by measuring (:func:`measure_calls`): after the first step, when its
    activations are gone, each call cut to fit in the memory they held (:meth:`OpCall.fitted`). The time between the
    two forwards (CPU time on the CPU) is the step's time; its peak memory is CUDA's peak allocation, or on the CPU the activations plus
    four bytes per parameter byte (weights, gradients and two optimizer moments as AdamW keeps: a guess). Then
    :func:`choose` decides each family. A compiled model (``torch.compile``) runs the recording forward eagerly,
    so the calls are the model's own and compiling starts from the decided policy: one compilation, no more.

    Args:
        dtype: the autocast dtype (``torch.bfloat16`` or ``torch.float16``).
        margin: how much faster FP32 must be for ``"auto"`` to pick it.
        budget_s: the most time measuring may take, spread over the families to decide (one call each at least).
        measure: ``(calls, device_type, dtype, budget_s) -> Measurement``, in place of :func:`measure_calls`.

    Raises:
        ValueError: an unknown family, request or policy name (each is named).
        TypeError: ``spec`` is neither a string nor a mapping.
    """

    def __init__(
        self, spec: str | Mapping[str, str] = "autocast", *, dtype: torch.dtype, margin: float = 0.2,
        budget_s: float = 0.3, measure: Callable[..., Measurement] | None = None,
    ) -> None:
        self.dtype, self.margin, self.budget_s = dtype, margin, budget_s
        self._measure = measure or measure_calls
        self.requested = _parse(spec, dtype)
        self.choices: dict[str, str] = dict(self.requested)
        """Per family: ``"autocast"``, a format id (``"fp32"``, ``"bf16"``, ``"fp16"``), or ``"auto"`` until decided."""
        self.measurements: dict[str, Measurement] = {}
        self.step_cost: StepCost | None = None
        """The first step's time and peak memory that ``"auto"`` weighed the families against (once decided)."""
        self._recording: _Recording | None = None

    @property
    def pending(self) -> bool:
        """Whether some family waits to be measured (decided at the start of the second training forward)."""
        return "auto" in self.choices.values()

    @property
    def is_default(self) -> bool:
        """Whether every family is left to autocast."""
        return all(choice == "autocast" for choice in self.choices.values())

    def context(self, device_type: str) -> AbstractContextManager:
        """Enter inside ``torch.autocast``. Free when nothing is forced (no mode at all); with ``"auto"`` the first
        forward with gradients enabled is recorded, and the next one decides the families before it runs."""
        if self._recording is not None:
            self._decide(device_type)
        # Record a training forward: under no_grad (Lightning's sanity-check validation) nothing runs backward, so the
        # measurement would not be the one training pays for.
        if self.pending and torch.is_grad_enabled():
            return self._record(device_type)
        forced = self._forced()
        return _PolicyMode(device_type, forced) if forced else nullcontext()

    def _forced(self) -> dict[str, torch.dtype]:
        # Forcing autocast's own 16-bit dtype on the families it lowers anyway changes nothing: no interception.
        return {
            family: _DTYPES[choice] for family, choice in self.choices.items()
            if choice not in ("auto", "autocast") and not (family in _LOWERED and _DTYPES[choice] == self.dtype)
        }

    @contextmanager
    def _record(self, device_type: str) -> Generator[None, None, None]:
        recording = _Recording({}, _clock(device_type))
        auto = [family for family, choice in self.choices.items() if choice == "auto"]
        mode = _PolicyMode(device_type, self._forced(), record=auto, calls=recording.calls)
        saved = _Saved()
        with _eager(), mode, saved.hooks():
            yield
        parameters = mode.parameters
        recording.parameter_bytes = sum(parameters.values())
        recording.activation_bytes = sum(n for ptr, n in saved.storages.items() if ptr not in parameters)
        self._recording = recording

    def _decide(self, device_type: str) -> None:
        recording, self._recording = self._recording, None
        assert recording is not None
        if device_type == "cuda" and torch.cuda.is_available():
            peak = float(torch.cuda.max_memory_allocated())
        else:
            peak = float(recording.activation_bytes + 4 * recording.parameter_bytes)
        self.step_cost = StepCost((_clock(device_type) - recording.started) * 1e3, peak)
        # Measure in no more memory than the step held beyond its resident state: activations, then gradients.
        memory = max(recording.activation_bytes + recording.parameter_bytes, 1 << 20)
        auto = [family for family, choice in self.choices.items() if choice == "auto"]
        seen = {f: [c for c in recording.calls.values() if c.family == f] for f in auto}
        decide = [f for f in auto if seen[f] and f not in _AUTOCAST_FP32.get(device_type, ())]
        for family in auto:
            self.choices[family] = "autocast"  # absent from the forward, or already FP32 under autocast here
            calls = [fitted for call in seen[family] if (fitted := call.fitted(memory)) is not None]
            if family in decide and calls:
                m = self._measure(calls, device_type, self.dtype, self.budget_s / len(decide))
                self.measurements[family], self.choices[family] = m, choose(m, self.margin, self.step_cost)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Every rank must compute alike: rank 0's decision holds everywhere (one broadcast, once per run).
            decided = [self.choices]
            torch.distributed.broadcast_object_list(decided, src=0)
            self.choices = decided[0]

    # --------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, str]:
        """The choice per family (``"auto"`` where it is not decided yet)."""
        return dict(self.choices)

    def load_state_dict(self, state: Mapping[str, str]) -> None:
        """Adopt the saved decisions of the families requested ``"auto"`` (a resumed run keeps its choice without
        measuring again); a family the user forces keeps the forced value. Strict on families and values."""
        if set(state) != set(FAMILIES):
            raise KeyError(f"OpPolicy.load_state_dict: expected families {list(FAMILIES)}, got {sorted(state)}.")
        saved = _parse(dict(state), self.dtype)
        for family, request in self.requested.items():
            if request == "auto" and saved[family] != "auto":
                self.choices[family] = saved[family]
        if not self.pending:
            self._recording = None


def _parse(spec: Any, dtype: torch.dtype) -> dict[str, str]:
    """``spec`` as a full ``{family: request}`` dict, validated against the autocast ``dtype``."""
    if isinstance(spec, str):
        if spec not in ("autocast", "auto"):
            raise ValueError(
                f"op_policy={spec!r}: allowed names are 'autocast' (PyTorch's per-op lists) and 'auto' (the faster"
                f" of FP32 and {_FORMAT_IDS.get(dtype, dtype)} per op family, measured), or a mapping"
                f" {{family: dtype}} with families {list(FAMILIES)}."
            )
        return dict.fromkeys(FAMILIES, spec)
    if not isinstance(spec, Mapping):
        raise TypeError(f"op_policy={spec!r}: expected 'autocast', 'auto' or a mapping {{family: dtype}}.")
    allowed = ["autocast", "auto", "fp32"] + ([_FORMAT_IDS[dtype]] if dtype in (torch.bfloat16, torch.float16) else [])
    unknown = sorted(str(k) for k in spec if k not in FAMILIES)
    bad = {k: v for k, v in spec.items() if v not in allowed}
    if unknown or bad:
        parts = [f"unknown op families {unknown} (known: {list(FAMILIES)})"] if unknown else []
        parts += [f"values {bad} not allowed (allowed: {allowed})"] if bad else []
        raise ValueError(f"op_policy={dict(spec)!r}: {'; '.join(parts)}.")
    return {family: str(spec.get(family, "autocast")) for family in FAMILIES}


def _eager() -> AbstractContextManager:
    """A compiled model runs this forward eagerly: the recording must see each call as it runs, with its real
    tensors, which a traced graph replaces. (Inside a region being compiled, there is nothing to switch.)"""
    return nullcontext() if torch.compiler.is_compiling() else torch.compiler.set_stance("force_eager")


class _PolicyMode(TorchFunctionMode):
    """Runs the forced families in their dtype with autocast off inside the op, and (``calls``) records the shapes of
    the ``record`` families and the parameters the forward uses. Ops where autocast is off (FP32 islands) are left
    alone: islands win. Under ``torch.compile`` this runs while tracing, and what it does is part of the graph."""

    def __init__(
        self, device_type: str, dtypes: Mapping[str, torch.dtype], *, record: Iterable[str] = (),
        calls: dict[str, OpCall] | None = None,
    ) -> None:
        super().__init__()
        self.device_type, self.calls, record = device_type, calls, set(record)
        self.dtypes = {func: dtypes[family] for func, family in _FAMILY_OF.items() if family in dtypes}
        self.record = {func: family for func, family in _FAMILY_OF.items() if family in record}
        self.parameters: dict[int, int] = {}  # recording: storage -> bytes of every parameter an op was given

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # Every torch call of the forward passes here (~1 us each, measured): two dict lookups for all but the few.
        kwargs = kwargs or {}
        if self.calls is not None:
            return self._recorded(func, args, kwargs)
        dtype = self.dtypes.get(func)
        if dtype is None or not torch.is_autocast_enabled(self.device_type):
            return func(*args, **kwargs)
        return _run_in(dtype, _FAMILY_OF[func], self.device_type, func, args, kwargs)

    def _recorded(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        for value in _leaves((args, kwargs)):
            if isinstance(value, nn.Parameter):
                self.parameters[_plain_ptr(value) or id(value)] = value.numel() * value.element_size()
        dtype = self.dtypes.get(func)
        autocast = torch.is_autocast_enabled(self.device_type)
        if dtype is None or not autocast:
            out = func(*args, **kwargs)
        else:
            out = _run_in(dtype, _FAMILY_OF[func], self.device_type, func, args, kwargs)
        if func in self.record and autocast:
            first = out[0] if isinstance(out, tuple) else out
            call = OpCall(self.record[func], func, *_specs(args, kwargs),
                          out_numel=first.numel() if isinstance(first, torch.Tensor) else 0)
            if call.key in self.calls:
                self.calls[call.key].count += 1
            else:
                self.calls[call.key] = call
        return out


def _run_in(
    dtype: torch.dtype, family: str, device_type: str, func: Callable, args: tuple, kwargs: dict,
    saved: _Saved | None = None,
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
        saved = saved if saved is not None else _Saved()
        saved.sources = sources
        hooks = saved.hooks()
    with torch.autocast(device_type, enabled=False), hooks:
        return func(*args, **kwargs)


class _Saved:
    """``saved_tensors_hooks`` that keep an upcast's 16-bit ``sources`` in its place (by data pointer; recast with
    the same strides when the backward asks) and count the bytes held, per storage."""

    def __init__(self, sources: dict[int, torch.Tensor] | None = None) -> None:
        self.sources = sources or {}
        self.storages: dict[int, int] = {}

    def hooks(self) -> AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        source = self.sources.get(_plain_ptr(t))
        if source is not None and source.shape == t.shape and source.dtype.itemsize < t.dtype.itemsize:
            self._count(source)
            return source, t.dtype, t.stride()
        self._count(t)
        return t

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        source, dtype, stride = packed
        return torch.empty_strided(source.shape, stride, dtype=dtype, device=source.device).copy_(source)

    def _count(self, t: torch.Tensor) -> None:
        if (ptr := _plain_ptr(t)) is not None:  # tensor subclasses (DTensor) and sparse tensors: not counted
            self.storages[ptr] = t.untyped_storage().nbytes()

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


def _plain_ptr(t: torch.Tensor) -> int | None:
    """Where the storage of a plain dense tensor (parameters included) starts, else None."""
    plain = type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided and t.device.type != "meta"
    return t.untyped_storage().data_ptr() if plain else None


def _map(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn`` on every leaf of nested lists, tuples and dicts (an op's arguments); ``torch.Size`` is a leaf."""
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return type(value)(_map(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: _map(fn, v) for k, v in value.items()}
    return fn(value)


def _leaves(value: Any) -> list[Any]:
    found: list[Any] = []
    _map(found.append, value)
    return found


def _cast(value: Any, dtype: torch.dtype, sources: dict[int, torch.Tensor] | None = None) -> Any:
    """``value`` with its floating tensors in ``dtype``; ``sources`` maps each new upcast copy to what it came from."""

    def cast(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.dtype == dtype:
            return v
        out = v.to(dtype)
        if sources is not None and v.dtype.itemsize < dtype.itemsize and not torch.compiler.is_compiling():
            sources[_plain_ptr(out)] = v  # a fresh copy: a plain tensor, its own storage
        return out

    return _map(cast, value)


def _specs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    slots: dict[int, int] = {}

    def spec(v: Any) -> Any:
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
    def run(fp32: bool, args: tuple, kwargs: dict, *, backward: bool = True, saved: _Saved | None = None) -> Any:
        with torch.autocast(device_type, dtype=dtype, cache_enabled=False):
            if fp32:
                out = _run_in(torch.float32, call.family, device_type, call.func, args, kwargs, saved)
            else:
                with saved.hooks() if saved is not None else nullcontext():
                    out = call.func(*args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        leaves = [t for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        if backward and leaves and out.requires_grad:
            for leaf in leaves:
                leaf.grad = None
            out.backward(torch.ones_like(out))
        return out

    with torch.inference_mode(False), torch.enable_grad():
        args, kwargs, parameters = _fresh(call, device_type)
        seconds: dict[bool, list[float]] = {False: [], True: []}
        held: dict[bool, int] = {}
        for i in range(repeats + 1):  # the first round warms up (kernel selection, allocator); alternate the two
            for fp32 in (False, True):
                saved = _Saved() if i == 0 else None
                start = _clock(device_type)
                run(fp32, args, kwargs, saved=saved)
                if saved is not None:
                    held[fp32] = sum(n for ptr, n in saved.storages.items() if ptr not in parameters)
                if i:
                    seconds[fp32].append(_clock(device_type) - start)
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


def _fresh(call: OpCall, device_type: str) -> tuple[tuple, dict, set[int]]:
    """New tensors for the call's arguments (one per slot), and the storages of those standing for parameters."""
    generator = torch.Generator(device_type).manual_seed(0)  # the training run's RNG stream stays untouched
    made: dict[int, torch.Tensor] = {}

    def fresh(value: Any) -> Any:
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
    return args, kwargs, {_plain_ptr(made[s.slot]) for s in call.specs if s.parameter}


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    err = float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    return err if err == err else math.inf  # NaN (an FP16 overflow) counts as the worst error


def _clock(device_type: str) -> float:
    """Seconds: on the CPU the process's CPU time (a shared machine's other processes do not add to it), on CUDA wall
    time after the kernels queued so far have finished."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return time.process_time()
    torch.cuda.synchronize()
    return time.perf_counter()

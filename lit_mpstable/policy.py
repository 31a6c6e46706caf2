"""Per-op precision policy: the dtype each op family runs in under autocast, forced or chosen by measurement."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["FAMILIES", "Measurement", "OpCall", "OpPolicy", "choose", "measure_calls"]

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
    """Time per forward (forward + backward of the family's calls, weighted by how often each ran) and the worst
    relative error against FP64, autocast's way and in FP32."""

    autocast_ms: float
    fp32_ms: float
    autocast_err: float
    fp32_err: float


def choose(m: Measurement, margin: float = 0.2) -> str:
    """``"fp32"`` only when FP32 is faster by more than ``margin`` *and* numerically no worse; else ``"autocast"``.

    The margin is a guess that covers timer noise on a shared CPU (a few percent) and what a per-op measurement
    cannot see: the casts between neighbouring ops. nn.MultiheadAttention measured ~10 % faster in FP32 yet made
    the demo Transformer's step no faster; SDPA in lit_mpstable.zoo.GPT measures ~40 % faster, and is.
    """
    faster = m.fp32_ms < (1.0 - margin) * m.autocast_ms
    return "fp32" if faster and m.fp32_err <= m.autocast_err else "autocast"


@dataclass(frozen=True)
class _Spec:
    """A tensor argument, remembered by shape and dtype only; ``slot`` numbers distinct tensors, so a call passing one
    tensor twice (self-attention: query is key is value) is measured that way, on its fused path."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    slot: int


@dataclass
class OpCall:
    """One distinct call seen in a forward (function + argument shapes) and how often it ran."""

    family: str
    func: Callable
    args: tuple
    kwargs: dict[str, Any]
    count: int = 1

    @property
    def key(self) -> str:
        return f"{getattr(self.func, '__qualname__', self.func)}{self.args!r}{sorted(self.kwargs.items())!r}"

    @property
    def nbytes(self) -> int:
        specs = [s for s in _leaves((self.args, self.kwargs)) if isinstance(s, _Spec)]
        return self.count * sum(s.dtype.itemsize * math.prod(s.shape) for s in specs)


class OpPolicy:
    """Which dtype each op family runs in while autocast is on: autocast's own choice, FP32, or the 16-bit format.

    ``spec`` is ``"autocast"`` (PyTorch's per-op lists everywhere), ``"auto"`` (every family measured on the model's
    own shapes during the first forward, see :func:`measure_calls` and :func:`choose`), or a mapping
    ``{family: request}`` with requests ``"autocast"``, ``"auto"``, ``"fp32"`` or the 16-bit format id; families left
    out keep ``"autocast"``. A forced dtype applies only where autocast is on, so FP32 islands always win.

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

    @property
    def pending(self) -> bool:
        """Whether some family waits for the first forward to be measured."""
        return "auto" in self.choices.values()

    @property
    def is_default(self) -> bool:
        """Whether every family is left to autocast."""
        return all(choice == "autocast" for choice in self.choices.values())

    def context(self, device_type: str) -> AbstractContextManager:
        """Enter inside ``torch.autocast``. Free when nothing is forced (no mode at all); with ``"auto"`` the first
        forward with gradients enabled runs as autocast would, is recorded, and decides the families when it ends."""
        # Decide on a training forward: under no_grad (Lightning's sanity-check validation) nothing runs backward,
        # so the measurement would not be the one training pays for.
        if self.pending and torch.is_grad_enabled():
            return self._record_then_decide(device_type)
        forced = self._forced()
        return _PolicyMode(device_type, forced) if forced else nullcontext()

    def _forced(self) -> dict[str, torch.dtype]:
        # Forcing autocast's own 16-bit dtype on the families it lowers anyway changes nothing: no interception.
        return {
            family: _DTYPES[choice] for family, choice in self.choices.items()
            if choice not in ("auto", "autocast") and not (family in _LOWERED and _DTYPES[choice] == self.dtype)
        }

    @contextmanager
    def _record_then_decide(self, device_type: str) -> Generator[None, None, None]:
        calls: dict[str, OpCall] = {}
        auto = [family for family, choice in self.choices.items() if choice == "auto"]
        with _PolicyMode(device_type, self._forced(), record=auto, calls=calls):
            yield
        seen = {f: [c for c in calls.values() if c.family == f] for f in auto}
        decide = [f for f in auto if seen[f] and f not in _AUTOCAST_FP32.get(device_type, ())]
        for family in auto:
            self.choices[family] = "autocast"  # absent from the forward, or already FP32 under autocast here
            if family in decide:
                m = self._measure(seen[family], device_type, self.dtype, self.budget_s / len(decide))
                self.measurements[family], self.choices[family] = m, choose(m, self.margin)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Every rank must compute alike: rank 0's decision holds everywhere (one broadcast, once per run).
            decided = [self.choices]
            torch.distributed.broadcast_object_list(decided, src=0)
            self.choices = decided[0]

    # --------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, str]:
        """The choice per family (``"auto"`` where the first forward has not run yet)."""
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


class _PolicyMode(TorchFunctionMode):
    """Runs the forced families in their dtype with autocast off inside the op, and (``calls``) records the shapes of
    the ``record`` families. Ops where autocast is off (FP32 islands) are left alone: islands win."""

    def __init__(
        self, device_type: str, dtypes: Mapping[str, torch.dtype], *, record: Iterable[str] = (),
        calls: dict[str, OpCall] | None = None,
    ) -> None:
        super().__init__()
        self.device_type, self.calls, record = device_type, calls, set(record)
        self.dtypes = {func: dtypes[family] for func, family in _FAMILY_OF.items() if family in dtypes}
        self.record = {func: family for func, family in _FAMILY_OF.items() if family in record}

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # Every torch call of the forward passes here (~1 us each, measured): two dict lookups for all but the few.
        kwargs = kwargs or {}
        if self.calls is not None and func in self.record and torch.is_autocast_enabled(self.device_type):
            call = OpCall(self.record[func], func, *_specs(args, kwargs))
            if call.key in self.calls:
                self.calls[call.key].count += 1
            else:
                self.calls[call.key] = call
        dtype = self.dtypes.get(func)
        if dtype is None or not torch.is_autocast_enabled(self.device_type):
            return func(*args, **kwargs)
        return _run_in(dtype, _FAMILY_OF[func], self.device_type, func, args, kwargs)


def _run_in(dtype: torch.dtype, family: str, device_type: str, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``func`` with autocast off and its floating inputs in ``dtype``. Norms cast only their input: their FP32
    running statistics are updated in place, and CPU/CUDA norm kernels take FP32 affine parameters with 16-bit
    inputs. The output stays in ``dtype``, as an FP32 island's does; the next autocast op casts it as it needs."""
    if family == "norm" and args:
        args = (_cast(args[0], dtype), *args[1:])
    elif family == "norm":
        kwargs = {**kwargs, "input": _cast(kwargs["input"], dtype)}
    else:
        args, kwargs = _cast(args, dtype), _cast(kwargs, dtype)
    with torch.autocast(device_type, enabled=False):
        return func(*args, **kwargs)


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


def _cast(value: Any, dtype: torch.dtype) -> Any:
    return _map(lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v, value)


def _specs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    slots: dict[int, int] = {}

    def spec(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        return _Spec(tuple(v.shape), v.dtype, v.requires_grad, slots.setdefault(id(v), len(slots)))

    return _map(spec, (args, kwargs))


# ------------------------------------------------------------------------------------------- measurement
# Per device, dtype and call shapes: (autocast s, fp32 s, autocast error, fp32 error, seconds the measuring took).
_MEASURED: dict[tuple, tuple[float, float, float, float, float]] = {}


def measure_calls(calls: list[OpCall], device_type: str, dtype: torch.dtype, budget_s: float) -> Measurement:
    """Time the recorded calls of one family (forward + backward, autocast's way and in FP32) on fresh tensors of
    the same shapes, largest first, until ``budget_s`` is spent; each result is cached per device, dtype and shapes
    (a cached call is charged what it cost once, so a later run measures the same calls, for free). Errors are
    relative to an FP64 run of the same call. Totals are weighted by how often each call ran."""
    totals, spent = [0.0, 0.0, 0.0, 0.0], 0.0
    for i, call in enumerate(sorted(calls, key=lambda c: c.nbytes, reverse=True)):
        if i and spent > budget_s:
            break
        key = (device_type, dtype, call.key)
        if key not in _MEASURED:
            started = time.perf_counter()
            _MEASURED[key] = (*_measure_one(call, device_type, dtype), time.perf_counter() - started)
        t_auto, t_fp32, e_auto, e_fp32, cost_s = _MEASURED[key]
        spent += cost_s
        totals = [totals[0] + call.count * t_auto, totals[1] + call.count * t_fp32, max(totals[2], e_auto),
                  max(totals[3], e_fp32)]
    return Measurement(totals[0] * 1e3, totals[1] * 1e3, totals[2], totals[3])


def _measure_one(call: OpCall, device_type: str, dtype: torch.dtype, repeats: int = 2) -> tuple[float, ...]:
    generator = torch.Generator(device_type).manual_seed(0)  # the training run's RNG stream stays untouched
    made: dict[int, torch.Tensor] = {}

    def fresh(value: Any) -> Any:
        if not isinstance(value, _Spec) or value.slot in made:
            return made[value.slot] if isinstance(value, _Spec) else value
        if not value.dtype.is_floating_point:
            t = torch.ones(value.shape, dtype=value.dtype, device=device_type)
        else:  # positive values: a sampled running variance must not be negative; the timing does not care
            t = torch.rand(value.shape, generator=generator, device=device_type).add_(0.5).to(value.dtype)
            t.requires_grad_(value.requires_grad)
        made[value.slot] = t
        return t

    def run(fp32: bool, *, backward: bool = True) -> torch.Tensor:
        with torch.autocast(device_type, dtype=dtype, cache_enabled=False):
            out = _run_in(torch.float32, call.family, device_type, call.func, args, kwargs) if fp32 else \
                call.func(*args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        if backward and leaves and out.requires_grad:
            for leaf in leaves:
                leaf.grad = None
            out.backward(torch.ones_like(out))
        return out

    with torch.inference_mode(False), torch.enable_grad():
        args, kwargs = _map(fresh, (call.args, call.kwargs))
        leaves = [t for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        seconds: dict[bool, list[float]] = {False: [], True: []}
        for i in range(repeats + 1):  # the first round warms up (kernel selection, allocator); alternate the two
            for fp32 in (False, True):
                _sync(device_type)
                start = time.perf_counter()
                run(fp32)
                _sync(device_type)
                if i:
                    seconds[fp32].append(time.perf_counter() - start)
        with torch.no_grad():
            with torch.autocast(device_type, enabled=False):
                ref = call.func(*_cast(args, torch.float64), **_cast(kwargs, torch.float64))
            ref = ref[0] if isinstance(ref, tuple) else ref
            errors = [_rel_err(run(fp32, backward=False), ref) for fp32 in (False, True)]
    return min(seconds[False]), min(seconds[True]), errors[0], errors[1]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    err = float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    return err if err == err else math.inf  # NaN (an FP16 overflow) counts as the worst error


def _sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()

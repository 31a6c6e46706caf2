"""Per-op precision policy: the dtype each op family runs in under autocast, forced or chosen by measurement."""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from lit_mpstable.core.formats import FORMAT_DTYPES, FORMAT_IDS
from lit_mpstable.core.layout.opcalls import (
    Measurement,
    OpCall,
    SavedTensors,
    clock,
    leaves,
    measure_calls,
    plain_ptr,
    run_in,
    specs_of,
)

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


@dataclass(frozen=True)
class StepCost:
    """One training step of the model: its time and peak tensor memory, measured or estimated in the first step
    (see :class:`OpPolicy`); what a family's saved time and added memory are weighed against."""

    ms: float
    peak_bytes: float


def choose(m: Measurement, margin: float = 0.2, step: StepCost | None = None) -> str:
    """``"fp32"`` only when FP32 is faster by more than ``margin``, numerically no worse, and (given ``step``)
    pays for the memory it adds with speed: the step's time x peak memory must not grow,
    ``(step.ms - saved_ms) * (step.peak_bytes + extra_bytes) <= step.ms * step.peak_bytes``; else ``"autocast"``.

    The margin is a guess that covers timer noise on a shared CPU (a few percent) and what a per-op measurement
    cannot see: the casts between neighbouring ops. nn.MultiheadAttention measured ~10 % faster in FP32 yet made
    the demo Transformer's step no faster; SDPA in lit_mpstable.app.zoo.GPT measures ~40 % faster, and is. Time x memory
    is the cost of a step on a machine whose memory bounds the batch: FP32 that is 10 % faster for 5 % more memory
    lowers it; 3 % faster for 5 % more does not.
    """
    faster = m.fp32_ms < (1.0 - margin) * m.autocast_ms
    pays = step is None or m.fp32_extra_bytes <= 0 or (
        (step.ms - (m.autocast_ms - m.fp32_ms)) * (step.peak_bytes + m.fp32_extra_bytes) <= step.ms * step.peak_bytes
    )
    return "fp32" if faster and pays and m.fp32_err <= m.autocast_err else "autocast"


def describe(family: str, choice: str, m: Measurement, margin: float = 0.2, step: StepCost | None = None) -> str:
    """``family=choice (timings; why)`` for the log: when the slower of the two was kept, the rule of :func:`choose`
    that kept it (under the margin, a larger error, or the peak memory FP32 would add for the time it saves)."""
    text = f"{family}={choice} ({m.fp32_ms:.1f} ms fp32 vs {m.autocast_ms:.1f} ms autocast"
    if choice == "fp32":
        return f"{text}; FP32 holds {_mib(m.fp32_extra_bytes)} more)" if m.fp32_extra_bytes > 0 else f"{text})"
    if m.fp32_ms >= m.autocast_ms:
        return f"{text})"
    if not m.fp32_ms < (1.0 - margin) * m.autocast_ms:
        saved = 1.0 - m.fp32_ms / m.autocast_ms
        return f"{text}; kept: FP32 is {saved:.0%} faster, under the {margin:.0%} margin for timer noise and casts)"
    if m.fp32_err > m.autocast_err:
        return f"{text}; kept: FP32's error {m.fp32_err:.2g} exceeds autocast's {m.autocast_err:.2g})"
    if step is not None and m.fp32_extra_bytes > 0:
        share = m.fp32_extra_bytes / step.peak_bytes if step.peak_bytes > 0 else math.inf
        return (f"{text}; kept: FP32 would raise the step's peak memory by {_mib(m.fp32_extra_bytes)} ({share:.0%})"
                f" to save {m.autocast_ms - m.fp32_ms:.1f} ms of a {step.ms:.1f} ms step)")
    return f"{text})"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


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
    two forwards (CPU time on the CPU) is the step's time; its peak memory is CUDA's peak allocation, or on the CPU
    the activations plus four times the parameters (weights, gradients and two optimizer moments as AdamW keeps: a
    guess). Then :func:`choose` decides each family. A compiled model (``torch.compile``) runs the recording forward
    eagerly, so the calls are the model's own, and compiles from the second forward on, with the decided policy:
    one compilation.

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
        self.steers = any(request != "autocast" for request in self.requested.values())
        """Whether the policy may ever depart from autocast (fixed at construction: a run whose policy is
        ``"autocast"`` never enters :meth:`context`)."""
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
            family: FORMAT_DTYPES[choice] for family, choice in self.choices.items()
            if choice not in ("auto", "autocast") and not (family in _LOWERED and FORMAT_DTYPES[choice] == self.dtype)
        }

    @contextmanager
    def _record(self, device_type: str) -> Generator[None, None, None]:
        recording = _Recording({}, clock(device_type))
        auto = [family for family, choice in self.choices.items() if choice == "auto"]
        mode = _PolicyMode(device_type, self._forced(), record=auto, calls=recording.calls)
        saved = SavedTensors()
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
        self.step_cost = StepCost((clock(device_type) - recording.started) * 1e3, peak)
        # Measure in no more memory than the step held beyond its resident state (activations, then gradients), by
        # estimate; half of it, for what the estimate cannot see (kernel workspaces, the allocator's rounding).
        memory = max((recording.activation_bytes + recording.parameter_bytes) / 2, 1 << 20)
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
        if not isinstance(state, Mapping):
            raise TypeError(f"OpPolicy.load_state_dict(op_policy={state!r}): must be a dict {{family: choice}}.")
        if set(state) != set(FAMILIES):
            raise KeyError(f"OpPolicy.load_state_dict: expected families {list(FAMILIES)}, got {sorted(state)}.")
        try:
            saved = _parse(dict(state), self.dtype)
        except ValueError as error:  # the same rule as the constructor's, named as a load
            raise ValueError(f"OpPolicy.load_state_dict: the checkpoint's {error}") from None
        for family, request in self.requested.items():
            if request == "auto" and saved[family] != "auto":
                self.choices[family] = saved[family]
        if not self.pending:
            self._recording = None


def _parse(spec: object, dtype: torch.dtype) -> dict[str, str]:
    """``spec`` as a full ``{family: request}`` dict, validated against the autocast ``dtype``."""
    if isinstance(spec, str):
        if spec not in ("autocast", "auto"):
            raise ValueError(
                f"op_policy={spec!r}: allowed names are 'autocast' (PyTorch's per-op lists) and 'auto' (the faster"
                f" of FP32 and {FORMAT_IDS.get(dtype, dtype)} per op family, measured), or a mapping"
                f" {{family: dtype}} with families {list(FAMILIES)}."
            )
        return dict.fromkeys(FAMILIES, spec)
    if not isinstance(spec, Mapping):
        raise TypeError(f"op_policy={spec!r}: expected 'autocast', 'auto' or a mapping {{family: dtype}}.")
    allowed = ["autocast", "auto", "fp32"] + ([FORMAT_IDS[dtype]] if dtype in (torch.bfloat16, torch.float16) else [])
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

    def __torch_function__(self, func: Callable, types: object, args: tuple = (), kwargs: dict | None = None) -> Any:
        # Every torch call of the forward passes here (~1 us each, measured): two dict lookups for all but the few.
        kwargs = kwargs or {}
        if self.calls is not None:
            return self._recorded(func, args, kwargs)
        dtype = self.dtypes.get(func)
        if dtype is None or not torch.is_autocast_enabled(self.device_type):
            return func(*args, **kwargs)
        return run_in(dtype, _FAMILY_OF[func], self.device_type, func, args, kwargs)

    def _recorded(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        assert self.calls is not None  # called only when recording
        for value in leaves((args, kwargs)):
            if isinstance(value, nn.Parameter):
                self.parameters[plain_ptr(value) or id(value)] = value.numel() * value.element_size()
        dtype = self.dtypes.get(func)
        autocast = torch.is_autocast_enabled(self.device_type)
        if dtype is None or not autocast:
            out = func(*args, **kwargs)
        else:
            out = run_in(dtype, _FAMILY_OF[func], self.device_type, func, args, kwargs)
        if func in self.record and autocast:
            first = out[0] if isinstance(out, tuple) else out
            call = OpCall(self.record[func], func, *specs_of(args, kwargs),
                          out_numel=first.numel() if isinstance(first, torch.Tensor) else 0)
            if call.key in self.calls:
                self.calls[call.key].count += 1
            else:
                self.calls[call.key] = call
        return out



"""One compiled pass per parameter for CompactWeights' Adam and AdamW steps, instead of FP32 copies of everything.

The generic path (:class:`~lit_mpstable.core.weights.compact.CompactWeights` stepping FP32 stand-ins) reads and writes
each tensor several times and runs the optimizer's own ~10 passes in FP32. Here one kernel, compiled by
``torch.compile`` (inductor), reads the 16-bit weight, compensation, gradient and moments once, does torch's Adam
arithmetic in FP32 (the same operations in the same order), and writes them back: the weight and its compensation
rounded to nearest (``"kahan"``) or the weight stochastically rounded (``"stochastic"``), the moments stochastically
rounded. The random bits are :func:`hash32` of the element index and a per-step key, the very numbers the generic
path draws, and the rounding is its rounding but for ties (:func:`_round_stochastic_bf16`). Nothing is allocated.

In this file: :class:`FusedAdam` (when the kernel runs and how it is compiled), the arguments it keeps per parameter
(:class:`KernelArgs`), the arithmetic (:func:`_adam`), and the same arithmetic as a C loop for the CPU
(:func:`native_kernel`). :class:`~lit_mpstable.core.weights.compact.CompactWeights` decides which parameters take it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import torch

from lit_mpstable.core import native
from lit_mpstable.core.compiled import graph_count, own_graphs_since
from lit_mpstable.core.native import compiler as _compiler
from lit_mpstable.core.weights.compact_rounding import _signed32, hash32, step_keys


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small CPU ``tensor`` on ``device`` without waiting for the device: a copy from pinned memory, queued (a copy
    from pageable memory waits for the work queued before it)."""
    if device.type == "cpu":
        return tensor
    try:
        tensor = tensor.pin_memory()
    except RuntimeError:  # no pinning on this machine: a plain copy
        pass
    return tensor.to(device, non_blocking=True)


_LOOK_UP = object()  # FusedAdam.run_'s default: look the C loop up and check every input

class FusedAdam:
    """The compiled step of one BF16 parameter for exact ``torch.optim.Adam``/``AdamW`` groups.

    :meth:`eligible` says whether a group can take it (no ``amsgrad``, ``capturable``, ``differentiable``; no
    ``fused`` group off the CPU, whose ``step`` torch keeps on the device); :meth:`run_` runs it. The kernel is
    compiled per mode, with dynamic sizes: learning-rate schedules, steps and parameter sizes cause no recompilation
    (one-element parameters and gradients that are views at an offset into a larger buffer get their own variant).
    Steps without a clip value or Adam's L2 term (AdamW, Adam without weight decay) take a second kernel that leaves
    both out (:meth:`plain`): the same values; a run that clips by value, or mixes the two, compiles both.
    """

    # A call this long compiled (a warm call takes microseconds to milliseconds; the first call of a run traces and
    # loads the kernel from inductor's disk cache in ~6 s on a 2-core CPU, compiles it cold in 18-20 s): said once.
    SLOW_S = 15.0

    def __init__(self) -> None:
        options: dict[str, str | int | bool | Callable[..., Any]] = {"emulate_precision_casts": True}
        self._kernel: Callable[..., None] = torch.compile(_adam_kernel, dynamic=True, fullgraph=True, options=options)
        self._plain_kernel: Callable[..., None] = torch.compile(
            _adam_plain_kernel, dynamic=True, fullgraph=True, options=options
        )  # compiled at its first call, as the other
        self._said_slow = False

    @staticmethod
    def eligible(optimizer: torch.optim.Optimizer, group: dict[str, Any], device: torch.device) -> bool:
        return (
            type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
            and not group.get("amsgrad", False) and not group.get("capturable", False)
            and not (group.get("fused", False) and device.type != "cpu")
            and not group.get("differentiable", False)
        )

    @staticmethod
    def scalars(
        group: dict[str, Any], step: float, multiplier: torch.Tensor, clip: float | None
    ) -> torch.Tensor:
        """The kernel's scalars for one parameter at optimizer step ``step`` (already incremented), computed in
        Python floats as torch's single-tensor Adam does; ``multiplier`` is a 0-d FP32 tensor (no host read)."""
        values = host_to_device(torch.tensor(FusedAdam.values(group, step, clip), dtype=torch.float32),
                                multiplier.device)
        values[0] *= multiplier
        return values

    @staticmethod
    def values(group: dict[str, Any], step: float, clip: float | None) -> list[float]:
        """:meth:`scalars` as Python floats (to be rounded to FP32), the first the gradient's sign alone (the
        multiplier not yet applied)."""
        lr = float(group["lr"])
        beta1, beta2 = (float(b) for b in group["betas"])
        weight_decay, eps = float(group["weight_decay"]), float(group["eps"])
        decoupled = bool(group.get("decoupled_weight_decay", False))
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        return [
            -1.0 if group.get("maximize", False) else 1.0, float("inf") if clip is None else float(clip),
            (1 - lr * weight_decay) if decoupled else 1.0, 0.0 if decoupled else weight_decay,
            1 - beta1, beta2, 1 - beta2, bias_correction2**0.5, eps, -(lr / bias_correction1),
        ]

    @staticmethod
    def plain(group: dict[str, Any], clip: float | None) -> bool:
        """Whether a step of ``group`` with clip value ``clip`` has neither a clip nor Adam's L2 term (AdamW, or Adam
        without weight decay): the kernel's graph without them (the same values, ~8% faster)."""
        return clip is None and (bool(group.get("decoupled_weight_decay", False)) or float(group["weight_decay"]) == 0)

    def run_(
        self, w: torch.Tensor, comp: torch.Tensor | None, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
        scalars: torch.Tensor, key: torch.Tensor, *, eager: bool, plain: bool = False, native: Any = _LOOK_UP,
    ) -> None:
        """Step flat tensors in place: ``w`` and ``comp`` (``None`` for ``"stochastic"``), moments ``m`` and ``v``,
        from gradient ``g`` (:meth:`scalars` says the rest); ``key``: the random key of the first element, a 0-d int32
        tensor on ``w``'s device (:func:`keys`). Nothing is allocated: every value lives in the kernel's registers.
        ``eager``: run the kernel uncompiled, as under a TorchDispatchMode; ``plain``: scalars without a clip (inf) or
        an L2 term (0) (:meth:`plain`), for the graph that leaves them out.
        ``native``: the C loop (:func:`native_kernel`, None: none) as ``CompactWeights._step_fused_`` looks it up once a
        step, for tensors its ``_fusable`` checked (dtypes, shapes, contiguity); by default it is looked up here and
        every input checked (:func:`native_takes`, ~10 us a call)."""
        # Under a TorchDispatchMode (a FLOP counter, a tracer, a recorder of host reads) torch.compile skips the frame
        # and marks the kernel's code skipped for the rest of the process: every later CompactWeights would fall back
        # to FP32 copies. The eager kernel (what torch.compile runs itself under a mode) leaves the compiler's state
        # alone and lets the mode see every operation; its words are the compiled ones but for an FP32 ulp now and then.
        if eager:
            (_adam_plain_kernel if plain else _adam_kernel)(w, comp, g, m, v, scalars, key)
            return
        if w.is_cpu:  # the C loop where it builds: the same words, ~2-4x faster than inductor's C++
            if native is _LOOK_UP:
                native = native_kernel()
                usable = native is not None and native_takes(w, comp, g, m, v, scalars, key)
            else:  # what _fusable leaves open: a tensor subclass (a DTensor) or state on another device
                usable = native is not None and type(w) is torch.Tensor and type(g) is torch.Tensor and (
                    g.is_cpu and m.is_cpu and v.is_cpu and (comp is None or (comp.is_cpu and comp.is_contiguous()))
                )
            if usable:
                native(w, comp, g, m, v, scalars, key, plain)
                return
        start = time.perf_counter()
        before = graph_count()  # graphs compiled by this call are ours, not the user's model's
        try:
            (self._plain_kernel if plain else self._kernel)(w, comp, g, m, v, scalars, key)
        finally:
            own_graphs_since(before)
        elapsed = time.perf_counter() - start
        if elapsed > self.SLOW_S and not self._said_slow:
            self._said_slow = True
            if _first_to_say(_SLOW_MARKER):
                warnings.warn(
                    f"lit_mpstable: the first fused Adam step of master_weights='kahan'/'stochastic' took"
                    f" {elapsed:.0f} s: inductor compiled its kernel and keeps it in its disk cache; each new process"
                    " still loads it at its first step (13-28 s measured per process on a loaded machine). Said once"
                    " per cache (a sweep's other jobs stay quiet);"
                    " lit_mpstable.core.weights.compact.CompactWeights(fused=False) steps without compiling.",
                    stacklevel=4,
                )


def multiplier_tensor(multiplier: torch.Tensor | float | None, device: torch.device) -> torch.Tensor:
    """The gradient multiplier as the 0-d FP32 tensor on ``device`` the kernel's scalars take (no host read)."""
    if isinstance(multiplier, torch.Tensor):
        return multiplier.detach().to(device=device, dtype=torch.float32).reshape(())
    return host_to_device(torch.tensor(1.0 if multiplier is None else float(multiplier), dtype=torch.float32), device)


def keys(offsets: list[int], device: torch.device) -> list[torch.Tensor]:
    """The random keys ``offsets`` as 0-d int32 tensors on ``device``, each with its own storage: a key that is a
    view (an element of one tensor of keys) would make the compiled kernel guard on the number of keys, compiling
    again for each new count of parameters."""
    return [host_to_device(torch.tensor(_signed32(o), dtype=torch.int32), device) for o in offsets]


_SLOW_MARKER = "lit_mpstable_fused_adam_said"


def _first_to_say(marker: str) -> bool:
    """Whether this process is the first to give a one-time notice for this inductor cache (every job of a sweep and
    every rank shares it): only rank 0 of a process group, and only once per cache, marked by a file in it."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return False
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        path = os.path.join(cache_dir(), marker)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "x"):  # atomic: of a sweep's concurrent jobs exactly one creates it
            return True
    except FileExistsError:
        return False
    except (ImportError, OSError):  # no cache to mark: say it (once per process, as before)
        return True


# ----------------------------------------------------------------------------- the kernel's arguments
class KernelArgs:
    """One parameter's kernel arguments that outlive a step: the flat views of the weight, compensation and moments
    (four views and a detach cost ~7 us per parameter and step in Python) and its random key's 0-d tensor (refilled
    in place: half the cost of a new one). The views are kept while they are of the same tensors, by identity, start
    and size: a parameter given new data (``p.data = ...``), moments replaced (a loaded optimizer state) or a
    compensation replaced get new ones."""

    __slots__ = ("comp", "flat", "key", "m", "param", "v", "where")

    def __init__(self, param: torch.Tensor) -> None:
        self.param = param
        self.comp: torch.Tensor | None = None
        self.m: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.flat: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor] | None = None
        self.where: tuple[int, int, int, int] = (0, 0, 0, 0)
        self.key = torch.empty((), dtype=torch.int32)


def _entry(views: dict[int, KernelArgs], p: torch.Tensor) -> KernelArgs:
    entry = views.get(id(p))
    if entry is None or entry.param is not p:
        entry = views[id(p)] = KernelArgs(p)
    return entry


def flat_views(
    views: dict[int, KernelArgs], p: torch.Tensor, comp: torch.Tensor | None, m: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The flat views of ``p``, its compensation ``comp`` and moments ``m``, ``v`` for the kernel (kept in
    ``views``, see :class:`KernelArgs`)."""
    entry = _entry(views, p)
    where = (p.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel())
    kept = entry.flat
    if kept is None or entry.comp is not comp or entry.m is not m or entry.v is not v or entry.where != where:
        kept = entry.flat = (flat(p.detach()), flat(comp) if comp is not None else None, flat(m), flat(v))
        entry.comp, entry.m, entry.v, entry.where = comp, m, v, where
    return kept


def fill_key(views: dict[int, KernelArgs], p: torch.Tensor, key: int) -> torch.Tensor:
    """``p``'s random key of this step (a signed 32-bit int, as
    :func:`~lit_mpstable.core.weights.compact_rounding.step_keys` gives it) as a 0-d int32 CPU tensor of its own, kept
    in ``views`` (a key that is a view would make the kernel guard on the number of keys: :func:`keys`)."""
    return _entry(views, p).key.fill_(key)


def flat(t: torch.Tensor) -> torch.Tensor:
    # A contiguous tensor as the 1-d one the kernel takes; a view costs microseconds, so none where it is one already.
    return t if t.dim() == 1 else t.view(-1)


_BF16, _FP32, _STRIDED = torch.bfloat16, torch.float32, torch.strided
Stepped = tuple[int, torch.Tensor, torch.Tensor | None, int]  # group index, parameter, compensation, random stream


class _Entry(NamedTuple):
    # One parameter of ManyArgs: its tensors are held (no other tensor can take their addresses while kept).
    group: int
    param: torch.Tensor
    data: torch.Tensor  # the parameter's data when kept
    comp: torch.Tensor | None
    state: dict[str, Any]
    m: torch.Tensor
    v: torch.Tensor
    step: torch.Tensor
    pointers: tuple[int, int, int, int]  # of data, m, v, step
    numel: int


class ManyArgs:
    """One optimizer's fused step as one call of the C loop (:attr:`NativeKernel.many`), kept from step to step: per
    parameter with a gradient (in the groups' order) its tensors, pointers, size, random stream and step counter,
    and the arrays the call reads. :meth:`run_` checks at every step, in Python and without reading a tensor, that
    they are the same (the groups' parameters, the parameters with a gradient, their data, state and moments; every
    gradient a contiguous BF16 CPU tensor), about a microsecond a parameter, and steps them with the words a call per
    parameter writes; or it does nothing and returns False (then step them one by one and :meth:`make` a new one)."""

    __slots__ = ("comp", "crcs", "entries", "g", "idle", "keys", "m", "mult", "n", "params", "plain", "scalars",
                 "sizes", "step", "step64", "v", "w", "which")

    def __init__(self, optimizer: torch.optim.Optimizer, stepped: Sequence[Stepped]) -> None:
        count = len(stepped)
        groups = optimizer.param_groups
        self.params = [p for group in groups for p in group["params"]]
        self.sizes = [len(group["params"]) for group in groups]
        ids = {id(p) for _, p, _, _ in stepped}
        self.idle = [p for p in self.params if id(p) not in ids]  # without a gradient when kept: none now either
        self.entries: list[_Entry] = []
        for group, p, comp, _ in stepped:
            state = optimizer.state[p]
            m, v, step = state["exp_avg"], state["exp_avg_sq"], state["step"]
            pointers = (p.data_ptr(), m.data_ptr(), v.data_ptr(), step.data_ptr())
            self.entries.append(_Entry(group, p, p.detach(), comp, state, m, v, step, pointers, p.numel()))
        self.crcs = [crc for _, _, _, crc in stepped]
        array = ctypes.c_void_p * count
        self.w, self.m, self.v, self.step = (array(*(e.pointers[i] for e in self.entries)) for i in range(4))
        self.comp = array(*(None if e.comp is None else e.comp.data_ptr() for e in self.entries))
        self.g = array()  # this step's gradients
        self.step64 = (ctypes.c_int32 * count)(*(e.step.dtype == torch.float64 for e in self.entries))
        self.n = (ctypes.c_int64 * count)(*(e.numel for e in self.entries))
        self.scalars = (ctypes.c_float * (10 * count))()  # a set per group and step count, usually one
        self.which = (ctypes.c_int32 * count)()  # each parameter's set
        self.plain = (ctypes.c_int32 * count)()
        self.keys = (ctypes.c_int32 * count)()
        self.mult = (ctypes.c_float * 1)()  # the multiplier when it is no tensor

    @staticmethod
    def make(optimizer: torch.optim.Optimizer, stepped: Sequence[Stepped]) -> ManyArgs | None:
        """``stepped``: (group index, parameter, compensation or None, its random stream) of every parameter the C
        loop just stepped one by one; None where one of them, or a group, is not what the C loop takes."""
        cpu = torch.device("cpu")
        if not stepped or not all(FusedAdam.eligible(optimizer, group, cpu) for group in optimizer.param_groups):
            return None
        for _, p, comp, _ in stepped:
            state = optimizer.state.get(p, {})
            if state.keys() != {"step", "exp_avg", "exp_avg_sq"}:
                return None
            step = state["step"]
            data = [p.detach(), state["exp_avg"], state["exp_avg_sq"]] + ([comp] if comp is not None else [])
            if not (p.numel() > 0 and all(type(t) is torch.Tensor and t.is_cpu and t.dtype == _BF16
                                          and t.is_contiguous() and t.numel() == p.numel() for t in data)
                    and type(step) is torch.Tensor and step.is_cpu and step.numel() == 1
                    and step.dtype in (torch.float32, torch.float64)):
                return None
        return ManyArgs(optimizer, stepped)

    def run_(self, optimizer: torch.optim.Optimizer, native: NativeKernel, seed: int, steps: int,
             multiplier: torch.Tensor | float | None, clip: float | None) -> bool:
        """Step every parameter (random keys of ``seed`` at ``steps``; gradients times ``multiplier``, clamped to
        ``clip``), count their steps and drop their gradients; False (nothing done) where anything changed."""
        groups = optimizer.param_groups
        cpu = torch.device("cpu")
        flat = [p for group in groups for p in group["params"]]
        if (len(flat) != len(self.params) or any(a is not b for a, b in zip(flat, self.params))
                or [len(group["params"]) for group in groups] != self.sizes
                or any(p.grad is not None for p in self.idle)
                or not all(FusedAdam.eligible(optimizer, group, cpu) for group in groups)):
            return False
        state_of = optimizer.state
        grads = []
        counts = []
        for _, p, _, _, state, m, v, step, (ptr, m_ptr, v_ptr, step_ptr), numel in self.entries:
            g = p.grad
            if (g is None or type(g) is not torch.Tensor or g.dtype is not _BF16 or not g.is_cpu
                    or g.layout is not _STRIDED or not g.is_contiguous() or p.dtype is not _BF16 or p.data_ptr() != ptr
                    or p.numel() != numel
                    or state_of.get(p) is not state or len(state) != 3 or state.get("exp_avg") is not m
                    or state.get("exp_avg_sq") is not v or state.get("step") is not step or m.data_ptr() != m_ptr
                    or v.data_ptr() != v_ptr or step.data_ptr() != step_ptr):
                return False
            grads.append(g)
            counts.append(step.item() + 1)  # a CPU tensor, as torch's Adam reads it
        # The kernel's scalars, per group and step count; the multiplier is applied in C.
        sets: dict[tuple[int, float], int] = {}
        scalars, which, plain = self.scalars, self.which, self.plain
        for k, (entry, count) in enumerate(zip(self.entries, counts)):
            group = groups[entry.group]
            index = sets.get((entry.group, count))
            if index is None:
                index = sets[entry.group, count] = len(sets)
                scalars[10 * index : 10 * index + 10] = cast(Any, FusedAdam.values(group, count, clip))
            which[k] = index
            plain[k] = FusedAdam.plain(group, clip)
        self.keys[:] = cast(Any, step_keys(seed, steps, self.crcs))
        self.g[:] = cast(Any, [g.data_ptr() for g in grads])
        held = None  # the FP32 multiplier tensor the C loop reads, kept alive through the call
        if isinstance(multiplier, torch.Tensor):
            held = multiplier if (type(multiplier) is torch.Tensor and multiplier.dtype == _FP32 and multiplier.is_cpu
                                  and multiplier.numel() == 1) else multiplier_tensor(multiplier, cpu)
            mult: Any = held.data_ptr()
        else:
            self.mult[0] = 1.0 if multiplier is None else float(multiplier)
            mult = self.mult
        native.many(len(self.entries), self.w, self.comp, self.g, self.m, self.v, self.n, scalars, which, plain,
                    self.keys, mult, self.step, self.step64, torch.get_num_threads())
        del held
        for entry in self.entries:
            entry.param.grad = None
        return True


# ----------------------------------------------------------------------------- the arithmetic
_SPLIT = float(2**23 + 1)  # Veltkamp's constant that rounds an FP32 number to one significant bit
_BIG = 2.0**103  # beyond it a * _SPLIT would overflow: such values are rounded to nearest


def _round_stochastic_bf16(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """FP32 ``x`` stochastically rounded to BF16 with the 16 random bits ``k`` (an FP32 tensor holding k - 32767):
    bit for bit ``lit_mpstable.core.weights.compact_rounding.round_stochastic_`` (adding k to the low half of x's bits
    and truncating),
    in float arithmetic a compiled kernel keeps vectorized (its bit casts are not, beside BF16 data), except that a
    tie (one draw in 65536 for each x) rounds to even and that ``|x| >= 2**103`` rounds to nearest.

    With ``e = 2**floor(log2 |x|)`` and FP32's spacing ``d = e * 2**-23`` there, ``y = |x| + (k - 32767) d`` is exact
    and sits within half a BF16 spacing (``2**16 d``) of the value the bit trick picks, so rounding y to nearest picks
    it; ``y >= e`` keeps y out of the finer grid below e; subnormals have d = 2**-149.
    """
    a = x.abs()
    clamped = torch.clamp(a, max=_BIG)
    t = clamped * _SPLIT
    p = t - (t - clamped)  # a to one significant bit: e or 2e
    e = torch.where(p > a, p * 0.5, p)
    y = torch.maximum(a + k * torch.clamp(e * 2.0**-23, min=2.0**-149), e)
    return torch.copysign(y, x).to(torch.bfloat16)


def _adam_kernel(
    w: torch.Tensor, comp: torch.Tensor | None, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
    scalars: torch.Tensor, key: torch.Tensor,
) -> None:
    _adam(w, comp, g, m, v, scalars, key, plain=False)


def _adam_plain_kernel(
    w: torch.Tensor, comp: torch.Tensor | None, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
    scalars: torch.Tensor, key: torch.Tensor,
) -> None:
    # A function of its own, not a flag of _adam_kernel: torch.compile keeps at most 8 graphs per function (mode,
    # one-element and offset variants), and a flag would double them.
    _adam(w, comp, g, m, v, scalars, key, plain=True)


def _adam(
    w: torch.Tensor, comp: torch.Tensor | None, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
    scalars: torch.Tensor, key: torch.Tensor, *, plain: bool,
) -> None:
    # torch's _single_tensor_adam, operation for operation, on FP32 values of the 16-bit tensors. scalars: gradient
    # multiplier (negative to maximize: the clip is symmetric), clip, 1 - lr * wd (AdamW; else 1), wd (Adam's L2; else
    # 0), 1 - beta1, beta2, 1 - beta2, sqrt(bias correction 2), eps, -lr / bias correction 1. Tensors, not Python
    # numbers: one graph serves every group and step (multiplying by 1 and adding 0 are exact). ``plain``: no clip
    # (scalars[1] is inf) and no L2 term (scalars[3] is 0), so the graph leaves both out, bit for bit the same values:
    # a clamp to +-inf returns its input, NaN included, and the L2 where picks the gradient. The NaN-propagating clamp
    # alone costs ~8% of the kernel on the CPU.
    value = w.float() + comp.float() if comp is not None else w.float()
    grad = g.float() * scalars[0]
    value = value * scalars[2]
    if not plain:
        grad = grad.clamp(-scalars[1], scalars[1])
        # Adam's L2 term; where there is none it is skipped as torch does (an inf weight times 0 would be NaN).
        grad = torch.where(scalars[3] != 0, grad + value * scalars[3], grad)
    exp_avg = torch.lerp(m.float(), grad, scalars[4])
    exp_avg_sq = v.float() * scalars[5] + scalars[6] * grad * grad
    denom = exp_avg_sq.sqrt() / scalars[7] + scalars[8]
    value = value + scalars[9] * exp_avg / denom
    index = torch.arange(w.numel(), device=w.device, dtype=torch.int32)
    k = ((hash32(index + key) >> 16) & 0xFFFF).float() - 32767.0  # shared by weight and moments, as eagerly
    if comp is not None:
        rounded = value.to(w.dtype)
        w.copy_(rounded)
        comp.copy_((value - rounded.float()).to(comp.dtype))  # needs emulate_precision_casts: the rounding is real
    else:
        w.copy_(_round_stochastic_bf16(value, k))
    m.copy_(_round_stochastic_bf16(exp_avg, k))
    v.copy_(_round_stochastic_bf16(exp_avg_sq, k))


# ----------------------------------------------------------------------------- the C loop on the CPU
# Inductor's C++ for :func:`_adam` converts the random bits' int32 lanes to FP32 and reinterprets bits one element at
# a time (torch 2.13: ``VecConvert<float, 2, int32_t, 2>`` has no vector specialization), about half the kernel's time.
# As a plain C loop the same arithmetic vectorizes whole: 0.44x / 0.30x torch's own AdamW step, against the compiled
# kernel's 1.11x / 1.32x (kahan / stochastic; ``bench/bench_adam_kernel.py``, docs/memory.md).
#
# The numbers are the compiled kernel's: torch's Adam arithmetic in FP32, operation for operation, with
# ``-ffp-contract=off`` (no fused multiply-add the compiled kernel does not make: its lerp rounds twice, as torch's
# decomposition of ``torch.lerp`` writes it), the same element keys and :func:`hash32`. Where the compiled kernel's
# float formulation rounds a tie to even (one draw in 65536), this loop adds and truncates as the eager rounding does.
#
# Built by :mod:`lit_mpstable.core.native` (cached in inductor's folder by digest); where it cannot be,
# :func:`native_kernel` returns ``None`` and the compiled kernel steps. ``LIT_MPSTABLE_NATIVE=0`` turns it off.

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float bf2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
/* Round to nearest even, NaN to the quiet NaN: c10::BFloat16's conversion. */
static inline uint16_t rne(float f) {
    uint32_t u = f2u(f);
    uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return f != f ? (uint16_t)0x7FC0 : r;
}
/* 16 random bits added to the low half, then truncation: round_stochastic_'s bit trick. */
static inline uint16_t sr(float f, uint32_t k) { return (uint16_t)((f2u(f) + k) >> 16); }
/* lowbias32, as hash32 */
static inline uint32_t hash32(uint32_t x) {
    x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; x ^= x >> 16; return x;
}

/* _adam above, operation for operation; KAHAN and PLAIN are constants, so each loop is branch-free. */
#define BODY(KAHAN, PLAIN) \
    for (uint32_t j = 0; j < len; j++) { \
        float value = KAHAN ? bf2f(w[j]) + bf2f(comp[j]) : bf2f(w[j]); \
        float grad = bf2f(g[j]) * s0; \
        value = value * s2; \
        if (!PLAIN) { \
            grad = grad < -s1 ? -s1 : (grad > s1 ? s1 : grad); \
            grad = s3 != 0.0f ? grad + value * s3 : grad; \
        } \
        float mf = bf2f(m[j]); \
        float exp_avg = coeff * (grad - mf) + (big ? grad : mf); \
        float exp_avg_sq = bf2f(v[j]) * s5 + s6 * grad * grad; \
        float denom = sqrtf(exp_avg_sq) / s7 + s8; \
        value = value + s9 * exp_avg / denom; \
        uint32_t k = hash32(base + j) >> 16; \
        if (KAHAN) { uint16_t r = rne(value); w[j] = r; comp[j] = rne(value - bf2f(r)); } \
        else { w[j] = sr(value, k); } \
        m[j] = sr(exp_avg, k); \
        v[j] = sr(exp_avg_sq, k); \
    }

static void block(uint16_t *restrict w, uint16_t *restrict comp, const uint16_t *restrict g, uint16_t *restrict m,
                  uint16_t *restrict v, uint32_t len, const float *s, uint32_t base, int plain) {
    const float s0 = s[0], s1 = s[1], s2 = s[2], s3 = s[3], s4 = s[4], s5 = s[5], s6 = s[6], s7 = s[7];
    const float s8 = s[8], s9 = s[9];
    const int big = fabsf(s4) >= 0.5f;  /* torch's lerp: weight - 1 and the end as base from 0.5 up */
    const float coeff = big ? s4 - 1.0f : s4;
    if (comp) { if (plain) { BODY(1, 1) } else { BODY(1, 0) } }
    else { if (plain) { BODY(0, 1) } else { BODY(0, 0) } }
}

#define CHUNK 16384
void lmp_adam_bf16(uint16_t *w, uint16_t *comp, const uint16_t *g, uint16_t *m, uint16_t *v, int64_t n,
                   const float *scalars, const int32_t *key, int plain, int threads) {
    int64_t chunks = (n + CHUNK - 1) / CHUNK;
    uint32_t first = (uint32_t)*key;
    (void)threads;
#ifdef _OPENMP
    #pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1 && chunks > 4)
#endif
    for (int64_t c = 0; c < chunks; c++) {
        int64_t lo = c * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
        block(w + lo, comp ? comp + lo : 0, g + lo, m + lo, v + lo, (uint32_t)(hi - lo), scalars,
              first + (uint32_t)lo, plain);
    }
}

/* Many parameters in one call (a whole optimizer's step): parameter i has n[i] elements at w[i], comp[i] (NULL:
   stochastic), g[i], m[i], v[i], its key at key[i] and its scalars at scalars + 10 * which[i], whose first (the sign)
   is multiplied by *mult, the FP32 gradient multiplier (as values[0] *= multiplier); plain[i] picks the loop. Then its
   step counter, FP32 at step[i] (FP64 where step64[i]), is counted up by one, as torch's Adam does. */
void lmp_adam_bf16_many(int64_t count, uint16_t **w, uint16_t **comp, uint16_t **g, uint16_t **m, uint16_t **v,
                        const int64_t *n, const float *scalars, const int32_t *which, const int32_t *plain,
                        const int32_t *key, const float *mult, void **step, const int32_t *step64, int threads) {
    for (int64_t i = 0; i < count; i++) {
        float s[10];
        memcpy(s, scalars + 10 * (int64_t)which[i], sizeof s);
        s[0] = s[0] * *mult;
        lmp_adam_bf16(w[i], comp[i], g[i], m[i], v[i], n[i], s, key + i, plain[i], threads);
        if (step64[i]) *(double *)step[i] += 1.0; else *(float *)step[i] += 1.0f;
    }
}
"""

_POINTER = ctypes.c_void_p



class NativeKernel:
    """The loaded C loop. Called, one parameter's step ``(w, comp, g, m, v, scalars, key, plain)`` over flat
    contiguous CPU tensors (BF16 but the FP32 scalars and the 0-d int32 key, read in C: no host read in torch's
    sense); :attr:`many`, ``lmp_adam_bf16_many`` of the source: several parameters in one call, their arguments as
    arrays of pointers and numbers (:class:`~lit_mpstable.core.weights.compact.CompactWeights` keeps them from step to
    step), each parameter's words those of a call of its own."""

    __slots__ = ("many", "one")

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.one = lib.lmp_adam_bf16
        self.one.restype = None
        self.one.argtypes = [_POINTER] * 5 + [ctypes.c_int64, _POINTER, _POINTER, ctypes.c_int, ctypes.c_int]
        self.many = lib.lmp_adam_bf16_many
        self.many.restype = None
        self.many.argtypes = [ctypes.c_int64] + [_POINTER] * 13 + [ctypes.c_int]

    def __call__(
        self, w: torch.Tensor, comp: torch.Tensor | None, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
        scalars: torch.Tensor, key: torch.Tensor, plain: bool,
    ) -> None:
        self.one(
            w.data_ptr(), None if comp is None else comp.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(),
            w.numel(), scalars.data_ptr(), key.data_ptr(), int(plain), torch.get_num_threads(),
        )


def native_kernel() -> NativeKernel | None:
    """The loaded C loop (:class:`NativeKernel`), or ``None`` where it cannot be built (then the compiled kernel
    steps). Built at the first call on a machine (0.2-2.5 s measured), then loaded from the cache."""
    # native.enabled(), inline: asked at every step, where a call into another module is another file on its path
    if os.environ.get(native.SWITCH, "1") == "0":
        return None
    return _load_native()


@functools.cache
def _load_native() -> NativeKernel | None:
    # A compiler without OpenMP (Apple's clang): one thread; one that does not know -march=native: the baseline ISA.
    lib = native.load("adam_bf16", SOURCE, _compiler(), openmp=True)
    return None if lib is None else NativeKernel(lib)


def native_takes(
    w: torch.Tensor, comp: torch.Tensor | None, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
    scalars: torch.Tensor, key: torch.Tensor,
) -> bool:
    """Whether the C loop can step these tensors: plain tensors (no subclass such as a DTensor, whose pointer is not
    its data) on the CPU and contiguous, the data BF16, the scalars FP32, the key int32 (what
    :class:`~lit_mpstable.core.weights.compact.CompactWeights` passes; anything else takes the compiled kernel)."""
    data = (w, g, m, v) if comp is None else (w, comp, g, m, v)
    return (
        all(type(t) is torch.Tensor for t in (*data, scalars, key))
        and all(t.is_cpu and t.dtype == torch.bfloat16 and t.is_contiguous() for t in data)
        and all(t.numel() == w.numel() for t in data)
        and scalars.is_cpu and scalars.dtype == torch.float32 and scalars.is_contiguous()
        and scalars.numel() == 10 and key.is_cpu and key.dtype == torch.int32 and key.numel() == 1
    )

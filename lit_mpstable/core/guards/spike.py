"""SpikeGuard: rolling loss and gradient-norm statistics on the device, a spike flag that joins the non-finite flag.

A step whose loss or total (unscaled) gradient norm lies more than ``zscore`` standard deviations above the mean of
the last ``window`` applied steps is skipped like an overflow (OLMo-core's ``SkipStepAdamW`` rule, 6 sigma over 128
steps), and optionally the gradient norm is clipped to ``mean + clip_zscore * std`` (ZClip). Everything stays on the
device: the decision is a 0-dim bool tensor that the stepper ORs into its found-inf flag, so the one host read the
skip already costs decides both. Skipped steps (spikes and non-finite steps alike) never enter the statistics.

The stepper calls it at two points of a step::

    guard.observe_loss_(loss)                      # with the unscaled loss, before backward (each micro-batch)
    ...backward, unscale_, non-finite check...
    norm = torch.nn.utils.get_total_norm(grads)    # the true gradients' total norm, before any clipping
    spike = guard.decide(norm)                     # 0-dim bool on the device, OR-ed into found_inf
    threshold = guard.clip_threshold()             # None, or a device tensor: clip to min(max_norm, threshold)
    ...step or skip on (found_inf | spike)...
    guard.commit_(skipped)                         # the step's final 0-dim skip flag: fold only applied steps

On the CPU the same arithmetic runs as two C calls over the guard's tensors (``decide`` and ``commit_``: a few
microseconds instead of ~25 small ops), where a C compiler builds them (:mod:`lit_mpstable.core.native`;
``LIT_MPSTABLE_NATIVE=0`` turns them off); the torch ops stay for every other device, for a step that dynamo traces
(``torch.compile``) and under a ``TorchDispatchMode``. Reading CPU memory in C waits for nothing: no host sync.

Skipping means not calling ``optimizer.step()``: Adam's step counter, its bias correction and its moments then stay
exactly those of an optimizer that never saw the batch (OLMo-core's first ``SkipStepAdamW`` zeroed the update
inside ``step`` while the counter advanced, so the bias correction ran ahead). Any optimizer works, because the guard
only contributes to the skip flag.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Iterable
from typing import Any, Literal, NamedTuple, get_args

import torch

from lit_mpstable.base.validate import int_arg, real_arg
from lit_mpstable.core import native
from lit_mpstable.core.guards.spike_state import checked_state, watch_arg

Watched = Literal["loss", "grad_norm"]

# Floors on the standard deviation, relative to the mean's magnitude. The statistics (the clip threshold) use 1%:
# on a nearly flat series (a plateaued loss, a steady norm) a change of a few percent is then not "6 sigma".
# ScaleCheckpoint's rollback rule floors at 5%; a skip is cheaper than a rollback, so the guard may be more sensitive.
_MIN_REL_STD = 0.01
# The skip decision on the gradient norm floors at 50%, i.e. a norm is a spike only when it is both 6 sigma above the
# rolling mean and at least 1 + 6 * 0.5 = 4x that mean. Measured on the CPU GPT (bench/spike_guard.py, batch 16 x 64
# tokens, bf16, AdamW, clip 1.0; 3 seeds x 1000 clean steps): the per-batch norm is heavy-tailed, not Gaussian, so
# the window's std understates its tail. At the 1% floor the benchmark skipped 7/3000 clean steps (steps 149-834,
# none in the warmup); replayed on the three seeds' recorded series, every flag was the gradient norm (z 6-15),
# none the loss: healthy batches at 2.0-3.0x the rolling mean, in a quiet window (relative std 9-23%). The largest
# clean norm seen was 3.0x its rolling mean; the injected gradient spikes (x1e3 on 1% of one layer's gradient
# coordinates, as SPAM's) are 7-12x. With this floor: 0/3000 false skips, 20/20 caught (the spiked run still
# skipped one clean step, a norm just over 4x). A longer warmup or a log scale (log-z 4.6-9.4 on those steps) do
# not separate the two; the ratio does. Norms between
# the clean tail and 4x are left to clipping (fixed, or clip_zscore), which bounds their update anyway.
_SKIP_REL_STD = {"loss": _MIN_REL_STD, "grad_norm": 0.5}
_TINY = 1e-12
_FRESH = 64  # the C loops' new flags (and ZClip thresholds) made at a time: see SpikeGuard._take_fresh
_NAMES: tuple[str, ...] = get_args(Watched)
# The window's statistics as decide() needs them: mean, judged std, count, spike gate, clip caps, clip threshold.
_Prepared = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


class SpikeGuard:
    """Skip loss and gradient-norm spikes on the device, and optionally clip the norm adaptively (ZClip).

    Keeps the last ``window`` losses and total gradient norms of applied steps in ring buffers (device tensors, with
    their counts), created on the CPU and moved to the device of the first value it sees (or :meth:`bind`). After
    ``warmup`` applied values, a step whose watched value lies more than ``zscore`` standard deviations above the
    rolling mean is flagged. No method reads a tensor's value on the host (a CPU guard's C loops read its memory,
    which waits for no device). Whether a CPU guard uses its C loops is settled when it binds to the CPU.

    Args:
        zscore: how many standard deviations above the rolling mean make a spike (OLMo-core: 6).
        window: how many applied steps the statistics cover (OLMo-core: 128).
        warmup: applied values needed before anything is flagged or clipped.
        watch: which values can flag a spike: ``"loss"``, ``"grad_norm"`` or both. The statistics of both are kept
            either way (the z-scores are metrics).
        clip_zscore: clip the gradient norm to ``mean + clip_zscore * std`` of the recent norms (ZClip uses 2.5);
            ``None``: no adaptive clipping.
        max_consecutive: after this many steps in a row skipped as spikes, the series is taken to have moved to a
            new level (new data, a schedule change) rather than to be spiking: the statistics restart (``warmup``
            steps again) and training goes on (see :meth:`count_run_`). Skipped values never enter the statistics,
            so without a limit a lasting shift would be skipped for ever and training would stop, silently.
            ``None``: no limit.

    Raises:
        TypeError, ValueError: an argument has the wrong type or value (the message names it).
    """

    def __init__(
        self,
        zscore: float = 6.0,
        window: int = 128,
        warmup: int = 20,
        watch: Iterable[Watched] = ("loss", "grad_norm"),
        clip_zscore: float | None = None,
        max_consecutive: int | None = 16,
    ) -> None:
        call = type(self).__name__
        self.zscore = real_arg(call, "zscore", zscore, low=0.0, low_open=True,
                               unit="standard deviations above the rolling mean; 6 is OLMo-core's")
        self.window = int_arg(call, "window", window, low=2, high=1 << 20,
                              unit="applied steps in the statistics; a standard deviation needs 2; 128 is usual")
        self.warmup = int_arg(call, "warmup", warmup, low=2,
                              unit="applied steps before the guard judges; a standard deviation needs 2")
        self.watch = watch_arg(call, watch, _NAMES)
        self.clip_zscore = real_arg(call, "clip_zscore", clip_zscore, low=0.0, low_open=True, none=True,
                                    unit="standard deviations for adaptive clipping; ZClip uses 2.5; None turns it off")
        self.max_consecutive = int_arg(call, "max_consecutive", max_consecutive, low=1, none=True,
                                       unit="steps skipped as spikes in a row before the statistics restart; None:"
                                            " no limit")
        self.level_shifts = 0
        """How often :attr:`max_consecutive` spikes in a row restarted the statistics (host-side)."""
        self.consecutive_spikes = 0
        """Steps skipped as spikes since the last applied step or restart (host-side, from the caller's flags)."""
        self.device: torch.device | None = None
        """Where the statistics live; None until the first value (or :meth:`bind`)."""
        # Both watched series side by side (column 0 the loss, column 1 the gradient norm), so that a step's
        # statistics, judgement and fold are one short run of small kernels for both, not one per series. A slot no
        # applied value has reached yet holds NaN, so the sums skip it without a mask (state_dict saves it as 0).
        self._values = torch.full((self.window, len(_NAMES)), math.nan)  # ring buffers, slot = count % window
        self._counts = torch.zeros(len(_NAMES), dtype=torch.int64)  # applied values ever folded, per series
        self._spikes = torch.zeros((), dtype=torch.int64)
        # This step's loss (summed over micro-batches) and norm, as given (detached, FP32); None: not given.
        self._loss: torch.Tensor | None = None
        self._norm: torch.Tensor | None = None
        self._pending: torch.Tensor | None = None  # both stacked (NaN where not given), made once per step
        self._finite: torch.Tensor | None = None  # which of them are finite, as decide() found them
        self._decided = False  # whether decide() ran this step (host-side)
        self._opaque = False  # whether a value of this step is a tensor subclass (the C loops read plain ones only)
        self._native_spike = False  # whether _last_spike is this step's flag made by the C loops (plain, bool, CPU)
        self._fresh: dict[torch.dtype, list[torch.Tensor]] = {}  # 0-dim CPU tensors the C loops write: _take_fresh
        self._last_spike = torch.zeros((), dtype=torch.bool)
        self._judged: tuple[torch.Tensor, torch.Tensor] | None = None  # last z-scores, window sizes: metrics, lazily
        self._threshold: torch.Tensor | None = None  # the clip threshold decide() computed this step
        self._caps: torch.Tensor | None = None  # and the caps of this step's fold (inf for the loss)
        # The statistics of the window as it stands, made once after each fold (the window changes only there) and
        # used by every decide() and clip_threshold() until the next: (mean, judged std, number of values, the
        # z-score above which each series is a spike (inf: in warmup or not watched), the clip caps and threshold or
        # None): see _prepare().
        self._prepared: _Prepared | None = None
        self._consts: dict[str, Any] = {}  # per-device constants (as tensors: an op on a Python number costs more)

    # ------------------------------------------------------------------------------------------- live state
    @property
    def loss_zscore(self) -> torch.Tensor:
        """The last judged loss's z-score, a 0-dim float32 device tensor (NaN before two applied losses, or when the
        step had no loss). Reading its value syncs."""
        return self._zscore(0)

    @property
    def grad_norm_zscore(self) -> torch.Tensor:
        """The last judged gradient norm's z-score (as :attr:`loss_zscore`), against a standard deviation of at least
        half the rolling mean: above ``zscore`` means skipped (see ``_SKIP_REL_STD``)."""
        return self._zscore(1)

    def _zscore(self, row: int) -> torch.Tensor:
        if self._judged is None:
            return torch.full((), math.nan, device=self.device)
        z, n = self._judged
        # A series not measured this step reads NaN (its placeholder): no stale value passed off as fresh.
        return torch.where(n[row] >= 2, z[row], math.nan)

    @property
    def spikes_skipped(self) -> torch.Tensor:
        """Steps skipped because this guard flagged them, a 0-dim int64 device tensor. Reading its value syncs."""
        return self._spikes

    @property
    def last_spike(self) -> torch.Tensor:
        """The last :meth:`decide`'s flag, a 0-dim bool device tensor."""
        return self._last_spike

    # ---------------------------------------------------------------------------------------------- binding
    def bind(self, device: torch.device | str) -> SpikeGuard:
        """Keep the statistics on ``device`` (moving them there if they live elsewhere); returns the guard."""
        device = torch.device(device)
        if self.device != device:
            self._values, self._counts, self._spikes, self._last_spike = (
                t.to(device) for t in (self._values, self._counts, self._spikes, self._last_spike))
            self._judged = None if self._judged is None else (self._judged[0].to(device), self._judged[1].to(device))
            self._clear()
            self._prepared = None
            # The skip's floor is never below the statistics' own (see _SKIP_REL_STD), so one maximum judges both;
            # with ZClip a second row holds the clip's floors, so that one maximum makes both standard deviations.
            floors = [[max(_SKIP_REL_STD[name], _MIN_REL_STD) for name in _NAMES]]
            if self.clip_zscore is not None:
                floors.append([_MIN_REL_STD] * len(_NAMES))
            f32: dict[str, Any] = {"device": device, "dtype": torch.float32}
            # The z-score a watched series must exceed once warm (inf for a series not watched: never exceeded), and
            # the clip's z-score (inf for the loss: its cap is inf; mean + inf * std is inf).
            gate = torch.tensor([self.zscore if name in self.watch else math.inf for name in _NAMES], **f32)
            clip_zscore = torch.tensor([math.inf if name == "loss" else self.clip_zscore or 0.0 for name in _NAMES],
                                       **f32)
            self._consts = {
                "slots": torch.arange(self.window, device=device).unsqueeze(1),  # a column: broadcasts per series
                "window": torch.tensor(self.window, device=device),
                "table": self._table(gate, clip_zscore), "rows": torch.arange(len(_NAMES), device=device),
                "floors": torch.tensor(floors if len(floors) > 1 else floors[0], **f32),
                "tiny": torch.tensor(_TINY, **f32),
                "inf": torch.tensor(math.inf, **f32),
                "warmup": torch.tensor(self.warmup, device=device), "gate": gate, "clip_zscore": clip_zscore,
                "missing": torch.full((), math.nan, device=device),  # the placeholder of a value not given
                "non_blocking": device.type != "cpu",
                "native": self._native_buffers(gate, clip_zscore, floors) if device.type == "cpu" else None,
            }
            self.device = device
        return self

    @staticmethod
    def _native_buffers(gate: torch.Tensor, clip_zscore: torch.Tensor, floors: list[list[float]]) -> _Native | None:
        """On the CPU: the C loops (None where they cannot be built or are turned off), their constants (as the
        torch path's, in FP32: the gates, the clip's z-scores, the skip's floors, the statistics' floor, the smallest
        std) and the buffers decide() writes and keeps: the z-scores and window sizes (read by the metrics) and the
        caps of the step's fold."""
        kernel = spike_kernel()
        if kernel is None:
            return None
        config = torch.cat([gate, clip_zscore, torch.tensor([*floors[0], _MIN_REL_STD, _TINY])]).float()
        return _Native.of(kernel, config, torch.full((2,), math.nan), torch.zeros(2, dtype=torch.int64),
                          torch.full((2,), math.inf))

    def _native(self) -> _Native | None:
        """The C loops, when they may run now: bound to the CPU, not while dynamo traces (it cannot trace a ctypes
        call: the torch ops compile), not under a TorchDispatchMode (a tracer or a counter sees every operation)."""
        found: _Native | None = self._consts.get("native")
        if found is None or torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
            return None
        return found if self._values.is_contiguous() else None

    def _table(self, gate: torch.Tensor, clip_zscore: torch.Tensor) -> torch.Tensor:
        """What the statistics need from the number n of values in the window (0..window), per series, looked up once
        per fold: the mean's divisor max(n, 1), the variance's max(n - 1, 1), and, when the warmup fits in the
        window (n >= warmup is then the warmup's test), the spike's z-score gate and the clip's z-score: inf before
        warmup. Shape (window + 1, series, 4)."""
        sizes = torch.arange(self.window + 1, device=gate.device, dtype=torch.float32).unsqueeze(1)
        warm = sizes >= self.warmup if self.warmup <= self.window else torch.ones_like(sizes, dtype=torch.bool)
        columns = [sizes.clamp(min=1.0), (sizes - 1.0).clamp(min=1.0),
                   torch.where(warm, gate, math.inf), torch.where(warm, clip_zscore, math.inf)]
        return torch.stack([c.expand(-1, len(_NAMES)) for c in columns], 2)

    def _value(self, value: torch.Tensor, what: str) -> torch.Tensor:
        """``value`` detached, as a 0-dim FP32 tensor on the guard's device (binding it there on first use)."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"SpikeGuard.{what}: expected a tensor, got {type(value).__name__} {value!r}; pass the"
                            " tensor itself (a Python number would need a host read to produce).")
        if value.numel() != 1:
            raise ValueError(f"SpikeGuard.{what}: expected one value, got a tensor of shape {tuple(value.shape)};"
                             " pass the reduced (scalar) loss or the total gradient norm.")
        if self.device is None:
            self.bind(value.device)
        if value.requires_grad:
            value = value.detach()
        if value.dim():
            value = value.reshape(())
        if value.dtype is torch.float32 and value.device == self.device:
            return value  # what to() would return, without its dispatch
        # Non-blocking only towards an accelerator (host memory might be read before a non-blocking copy lands).
        return value.to(self.device, torch.float32, non_blocking=self._consts["non_blocking"])

    # ------------------------------------------------------------------------------------------------- step
    def observe_loss_(self, loss: torch.Tensor) -> None:
        """Record the step's (unscaled) loss; micro-batches of one step add up, as their gradients do."""
        value = self._value(loss, "observe_loss_(loss)")
        self._loss = value if self._loss is None else self._loss + value
        self._pending = None
        self._opaque = self._opaque or type(value) is not torch.Tensor

    def decide(self, grad_norm: torch.Tensor | None = None) -> torch.Tensor:
        """Whether this step is a spike: a 0-dim bool tensor on the device, to OR into the non-finite flag.

        Judges the loss given to :meth:`observe_loss_` and ``grad_norm`` (the total norm of the true, unscaled
        gradients before any clipping) against the statistics of the applied steps before this one. A non-finite
        value is not a spike (the non-finite check owns it). Also sets :attr:`loss_zscore`/:attr:`grad_norm_zscore`.

        Raises:
            ValueError: ``grad_norm`` is None although it is watched or clipped.
        """
        if grad_norm is None:
            if "grad_norm" in self.watch or self.clip_zscore is not None:
                raise ValueError(
                    f"SpikeGuard(watch={self.watch!r}, clip_zscore={self.clip_zscore!r}).decide(grad_norm=None): the"
                    " gradient norm is watched or clipped, so pass the step's total unscaled gradient norm.")
        else:
            self._norm, self._pending = self._value(grad_norm, "decide(grad_norm)"), None
            self._opaque = self._opaque or type(self._norm) is not torch.Tensor
        if self.device is None:  # nothing seen yet, nothing to judge
            return self._last_spike.clone()
        found = self._native()
        if found is not None and not self._opaque:
            return self._decide_native(found)
        self._native_spike = False
        value = self._stacked()
        mean, judged, n, gate, caps, threshold = self._prepared or self._prepare()
        z = (value - mean) / judged
        # NaN z (a value not given, or non-finite) compares False; an inf value (inf z) is excluded as non-finite.
        self._finite = finite = torch.lt(value.abs(), self._consts["inf"])  # the fold takes these, unless capped
        spike = (finite & (z > gate)).any()  # gate: inf in warmup and for a series not watched
        self._judged = (z, n)  # n is this step's own tensor: the metrics read it later
        self._threshold, self._caps = threshold, caps
        self._last_spike = spike
        self._decided = True
        return spike

    def _decide_native(self, found: _Native) -> torch.Tensor:
        """:meth:`decide`'s statistics and judgement in one C call (the same numbers, see ``SOURCE``)."""
        spike = self._take_fresh(torch.bool)  # new each step, as the torch path's: a caller may keep it
        threshold = None if self.clip_zscore is None else self._take_fresh(torch.float32)
        loss, norm = self._loss, self._norm
        config, z, n, caps = found.pointers
        found.kernel.decide(
            self._values.data_ptr(), self._counts.data_ptr(), self.window, self.warmup, config,
            None if loss is None else loss.data_ptr(), None if norm is None else norm.data_ptr(), spike.data_ptr(),
            z, n, None if threshold is None else caps, None if threshold is None else threshold.data_ptr())
        self._judged = (found.z, found.n)  # read by the metrics until the next decide() writes them
        self._threshold, self._caps, self._finite = threshold, None if threshold is None else found.caps, None
        self._last_spike = spike
        self._decided = self._native_spike = True
        return spike

    def _take_fresh(self, dtype: torch.dtype) -> torch.Tensor:
        """A 0-dim CPU tensor of ``dtype`` for the C loops to write, never handed out before (a caller may keep it).
        Made _FRESH at a time, as the views of one tensor (one op): a ``torch.empty`` each step costs ~6 us after a
        backward on the CPU (its dispatch, not the allocation), the pool's pop ~0.1 us and one op every _FRESH steps."""
        pool = self._fresh.get(dtype)
        if not pool:
            pool = self._fresh[dtype] = list(torch.empty(_FRESH, dtype=dtype).unbind())
        return pool.pop()

    def clip_threshold(self, grad_norm: torch.Tensor | None = None) -> torch.Tensor | None:
        """The adaptive clip norm ``mean + clip_zscore * std`` of the recent applied norms, as a 0-dim float32
        device tensor (``inf`` during warmup), or None without ``clip_zscore``. Clip to ``min(max_norm, threshold)``
        (``torch.nn.utils.clip_grads_with_norm_`` takes it as is); no host read.

        Args:
            grad_norm: this step's norm, only to bind the guard to its device when nothing was seen yet.

        Raises:
            RuntimeError: the guard has no device yet and no ``grad_norm`` was given.
        """
        if self.clip_zscore is None:
            return None
        if self._threshold is not None:  # decide() made it this step, from the same statistics
            return self._threshold
        if self.device is None:
            if grad_norm is None:
                raise RuntimeError("SpikeGuard.clip_threshold(): the guard has seen no value yet, so it has no device;"
                                   " pass grad_norm=... or call bind(device) first.")
            self.bind(grad_norm.device)
        return (self._prepared or self._prepare())[5]

    def commit_(self, skipped: torch.Tensor | bool, *, spiked: torch.Tensor | None = None) -> None:
        """End the step: fold its loss and norm into the statistics unless ``skipped`` (the step's final flag: a
        spike, a non-finite gradient or any other skip), count a skipped spike, and clear the pending values.

        With ``clip_zscore`` the norm enters the statistics clipped to its threshold (ZClip: an outlier that was
        clipped does not widen the band for the next one).

        Args:
            skipped: 0-dim tensor (bool, or the scaler's float found-inf flag) or a Python bool.
            spiked: the spike flag to count, when it differs from this guard's own :meth:`decide` (e.g. agreed across
                ranks); default: the last :meth:`decide`'s.
        """
        if self.device is None:  # no value was ever given: nothing to fold or count
            self._clear()
            return
        given = self._loss is not None or self._norm is not None
        found = self._native()
        if found is not None and self._commit_native(found, skipped, spiked, given):
            self._clear()
            return
        if isinstance(skipped, bool):  # the stepper's own flag, read on the host already: no tensor work for it
            if not skipped and given:
                self._fold(None)
            elif skipped:
                self._count_spike(True, spiked)
        else:
            skipped_t = skipped.detach().to(self.device).reshape(()) != 0
            if given:
                self._fold(skipped_t)
            self._count_spike(skipped_t, spiked)
        self._clear()

    def _commit_native(self, found: _Native, skipped: torch.Tensor | bool, spiked: torch.Tensor | None,
                       given: bool) -> bool:
        """:meth:`commit_` in one C call where every tensor is a plain CPU one of the dtype it reads (flags: bool);
        False (nothing done) otherwise."""
        if spiked is None and self._decided:
            spiked = self._last_spike
        # The caps of this step's decide(), its own buffer or the torch path's (2,) CPU FP32 statistics.
        caps = self._caps if self.clip_zscore is not None and self._threshold is not None else None
        # The flag this guard's C loops made this step is known to be a plain CPU bool: not checked again.
        own = spiked is self._last_spike and self._native_spike
        if self._opaque or not (_plain(caps) and (own or _flag(spiked))):
            return False
        if isinstance(skipped, bool):
            flag, host = None, int(skipped)
        elif _flag(skipped):
            flag, host = skipped.data_ptr(), 0
        else:
            return False
        loss, norm = self._loss, self._norm
        found.kernel.commit(
            self._values.data_ptr(), self._counts.data_ptr(), self.window, self._spikes.data_ptr(),
            None if loss is None else loss.data_ptr(), None if norm is None else norm.data_ptr(),
            None if caps is None else caps.data_ptr(), int(given), flag, host,
            None if spiked is None else spiked.data_ptr())
        if given:
            self._prepared = None  # the window may have changed
        return True

    def _fold(self, skipped: torch.Tensor | None) -> None:
        value, take, consts = self._stacked(), self._finite, self._consts
        if self.clip_zscore is not None:  # ZClip: a clipped norm enters capped at its threshold (the loss's cap: inf)
            if self._threshold is not None and self._caps is not None:  # decided this step (else the norm is NaN)
                value = torch.minimum(value, self._caps)
            take = None
        if take is None:
            take = torch.lt(value.abs(), consts["inf"])  # a value not given is NaN: never taken
        take = take & ~skipped if skipped is not None else take
        # torch.where on a one-hot slot instead of indexing by a Python int: no host read, no graph break.
        slot = consts["slots"] == torch.remainder(self._counts, consts["window"])
        slot &= take
        torch.where(slot, value, self._values, out=self._values)
        self._counts.add_(take)
        self._prepared = None  # the window changed

    def _stacked(self) -> torch.Tensor:
        """This step's loss and norm as one (2,) tensor, NaN where not given; made once per step."""
        if self._pending is None:
            missing = self._consts["missing"]
            self._pending = torch.stack([missing if self._loss is None else self._loss,
                                         missing if self._norm is None else self._norm])
            self._finite = None
        return self._pending

    def _count_spike(self, skipped: torch.Tensor | bool, spiked: torch.Tensor | None) -> None:
        if spiked is not None:
            self._spikes.add_((spiked.to(self.device).reshape(()) != 0) & skipped)
        elif self._decided:
            self._spikes.add_(self._last_spike & skipped)

    def count_run_(self, skipped_as_spike: bool, applied: bool) -> bool:
        """After a step, with host flags the caller has read anyway (the stepper: its skip decision, and on skipped
        steps whether a spike caused it): count the steps skipped as spikes in a row; an applied step ends the run.
        At :attr:`max_consecutive` the statistics restart (empty window, ``warmup`` again; the skip count stays) and
        this returns True, so the caller can say so. No device work except at the restart."""
        if applied:
            self.consecutive_spikes = 0
        elif skipped_as_spike:
            self.consecutive_spikes += 1
            if self.max_consecutive is not None and self.consecutive_spikes >= self.max_consecutive:
                self._values.fill_(math.nan)
                self._counts.zero_()
                self._prepared = None
                self.consecutive_spikes, self.level_shifts = 0, self.level_shifts + 1
                return True
        return False

    def forget_(self) -> None:
        """Drop the step's pending values without folding them (the step will be run again, e.g. replayed)."""
        self._clear()

    def _clear(self) -> None:
        self._loss = self._norm = self._pending = self._finite = self._threshold = self._caps = None
        self._decided = self._opaque = self._native_spike = False

    def _prepare(self) -> _Prepared:
        """The window's statistics, per series, over its applied values: the mean, the judged standard deviation
        (floored, see ``_SKIP_REL_STD``), the number of values (at most ``window``, int64), the z-score a value must
        exceed to be a spike (inf in warmup or when not watched), and with ``clip_zscore`` the caps a folded value
        takes (inf for the loss, the clip threshold for the norm) and the clip threshold alone. Made after a fold,
        kept until the next: a step's decide() and clip_threshold() read the same tensors."""
        consts, values, counts = self._consts, self._values, self._counts
        n = torch.minimum(counts, consts["window"])
        mean_div, var_div, gate, clip_zscore = consts["table"][n, consts["rows"]].unbind(1)  # one look-up: _table
        if self.warmup > self.window:  # the warmup is not a test on n: on the counts themselves
            ready = counts >= consts["warmup"]
            gate = torch.where(ready, consts["gate"], consts["inf"])
            clip_zscore = torch.where(ready, consts["clip_zscore"], consts["inf"])
        mean = values.nansum(0) / mean_div  # max(n, 1): an empty window has mean 0
        var = (values - mean).square().nansum(0) / var_div  # max(n - 1, 1)
        # Both floors (the skip's, with ZClip the statistics' 1% too) in one maximum, then at least _TINY.
        judged = torch.maximum(var.sqrt(), consts["floors"] * mean.abs()).clamp_(min=consts["tiny"])
        caps = threshold = None
        if self.clip_zscore is not None:
            judged, std = judged.unbind(0)
            # In warmup, and always for the loss, clip_zscore is inf: the cap is inf (std is positive).
            caps = mean + clip_zscore * std
            threshold = caps[1]
        self._prepared = (mean, judged, n, gate, caps, threshold)
        return self._prepared

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The statistics, for an exact resume mid-window; tensors and ints only (``weights_only=True`` loads it).

        Keys: ``window`` (int), ``loss`` and ``grad_norm`` (the ring buffers, float32 of length ``window``),
        ``loss_count`` and ``grad_norm_count`` (int64 0-dim: applied values folded so far), ``spikes_skipped``,
        ``consecutive_spikes`` and ``level_shifts`` (ints; optional when loading: states saved before them load with
        0). A step's pending values are not saved: checkpoints are written between steps.
        """
        state: dict[str, Any] = {"window": self.window}
        for row, name in enumerate(_NAMES):
            state[name] = self._values[:, row].detach().nan_to_num(0.0)  # a slot not reached yet: 0
            state[f"{name}_count"] = self._counts[row].detach().clone()
        state["spikes_skipped"] = self._spikes.detach().clone()
        state["consecutive_spikes"], state["level_shifts"] = self.consecutive_spikes, self.level_shifts
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (strict), onto the guard's device if it has one.

        Raises:
            KeyError, TypeError, ValueError: other keys, a value of the wrong type or value (see
                :func:`~lit_mpstable.core.guards.spike_state.checked_state`); nothing is restored then.
        """
        expected = set(self.state_dict())
        values, counts, spikes, run, shifts = checked_state(state, expected, _NAMES, self.window)
        device = self.device or torch.device("cpu")
        self._counts = counts.to(device)
        reached = torch.arange(self.window, device=device).unsqueeze(1) < self._counts
        self._values = torch.where(reached, values.t().to(device), math.nan).contiguous()
        self._prepared = None
        self._spikes = spikes.to(device)
        self.consecutive_spikes, self.level_shifts = run, shifts
        self._clear()


# ------------------------------------------------------------------------------------------------ the C loops
# On the CPU a step's ~25 small torch ops cost ~150-210 us after a backward (each op ~5-10 us of dispatch, not of
# arithmetic: the window is 2 x 128 floats). The same statistics, judgement and fold as two C functions over the
# tensors' memory, called through ctypes, cost a few microseconds. Their arithmetic is the torch path's, operation for
# operation in FP32 (-ffp-contract=off: no fused multiply-add), and the window's sums follow torch's own CPU summation
# order (``cascade_sum`` in ATen's SumKernel.cpp, as it runs for a reduction over the window of a (window, 2) FP32
# tensor: four interleaved partial sums over rows of four, each a cascade of chunks of 16 or more values, NaN loaded
# as 0), so the sums, means and variances are torch's bit for bit. The square root is IEEE's (correctly rounded);
# torch's vectorized CPU one (measured with torch 2.13 on AVX-512) is an ulp off for ~15% of inputs, so a standard
# deviation, and the z-scores and clip threshold made from it, can differ from the torch path's by an ulp, and a
# decision only for a value within that of the gate (tests/core/test_spike_native.py compares the two). Built by
# :mod:`lit_mpstable.core.native`; without a compiler the guard keeps its torch ops.

SOURCE = r"""
#include <stdint.h>
#include <math.h>

static int64_t ceil_log2(int64_t x) {  /* c10's CeilLog2 */
    if (x <= 2) return 1;
    return (int64_t)(63 - __builtin_clzll((uint64_t)x - 1)) + 1;
}

/* One element of the column: the value or, centred, its squared distance from the mean; NaN (a slot no applied value
   has reached) loads as 0, as torch's nansum loads it. */
static inline float load(const float *x, int64_t i, float mean, int centred) {
    float v = x[2 * i];
    if (centred) { float d = v - mean; v = d * d; }
    return v != v ? 0.0f : v;
}

/* torch's nansum over `size` rows of one column (stride 2): row_sum over multi_row_sum<float, 4> of SumKernel.cpp. */
static float nansum(const float *x, int64_t size, float mean, int centred) {
    const int64_t rows = size / 4;
    const int64_t power = ceil_log2(rows) / 4 > 4 ? ceil_log2(rows) / 4 : 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    float acc[4][4] = {{0.0f}};
    int64_t i = 0;
    while (i + step <= rows) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++) acc[0][k] += load(x, 4 * i + k, mean, centred);
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < 4; k++) { acc[j][k] += acc[j - 1][k]; acc[j - 1][k] = 0.0f; }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < rows; i++)
        for (int k = 0; k < 4; k++) acc[0][k] += load(x, 4 * i + k, mean, centred);
    for (int j = 1; j < 4; j++)
        for (int k = 0; k < 4; k++) acc[0][k] += acc[j][k];
    for (int64_t e = rows * 4; e < size; e++) acc[0][0] += load(x, e, mean, centred);
    return ((acc[0][0] + acc[0][1]) + acc[0][2]) + acc[0][3];
}

static inline float maximum(float a, float b) { return a != a ? a : (b != b ? b : (a > b ? a : b)); }
static inline float minimum(float a, float b) { return a != a ? a : (b != b ? b : (a < b ? a : b)); }

/* SpikeGuard._prepare and decide for both series (row 0 the loss, 1 the norm). values: the (window, 2) ring buffers;
   counts: applied values per series; config: the spike's z-score gates (2), the clip's z-scores (2), the skip's
   floors (2), the statistics' floor, the smallest std; loss, norm: NULL where not given. Writes the spike flag, the
   z-scores, the window sizes and, with caps (ZClip), the caps a folded value takes and the clip threshold. */
void lmp_spike_decide(const float *values, const int64_t *counts, int64_t window, int64_t warmup, const float *config,
                      const float *loss, const float *norm, uint8_t *spike, float *z, int64_t *n, float *caps,
                      float *threshold) {
    const float x[2] = {loss ? *loss : NAN, norm ? *norm : NAN};
    int flagged = 0;
    for (int r = 0; r < 2; r++) {
        const int64_t size = counts[r] < window ? counts[r] : window;
        const int warm = counts[r] >= warmup;
        const float mean = nansum(values + r, window, 0.0f, 0) / (float)(size > 1 ? size : 1);
        const float var = nansum(values + r, window, mean, 1) / (float)(size - 1 > 1 ? size - 1 : 1);
        const float sd = sqrtf(var);
        const float judged = maximum(maximum(sd, config[4 + r] * fabsf(mean)), config[7]);
        n[r] = size;
        z[r] = (x[r] - mean) / judged;
        flagged |= fabsf(x[r]) < INFINITY && z[r] > (warm ? config[r] : INFINITY);
        if (caps) {
            const float std = maximum(maximum(sd, config[6] * fabsf(mean)), config[7]);
            caps[r] = mean + (warm ? config[2 + r] : INFINITY) * std;
        }
    }
    *spike = (uint8_t)flagged;
    if (threshold) *threshold = caps[1];
}

/* SpikeGuard.commit_: unless the step was skipped (*skipped where given, else skipped_host), fold its finite values
   (capped by caps where given) into the ring buffers; count a skipped spike (*spiked where given). */
void lmp_spike_commit(float *values, int64_t *counts, int64_t window, int64_t *spikes, const float *loss,
                      const float *norm, const float *caps, int fold, const uint8_t *skipped, int skipped_host,
                      const uint8_t *spiked) {
    const int skip = skipped ? *skipped != 0 : skipped_host;
    if (fold && !skip) {
        const float x[2] = {loss ? *loss : NAN, norm ? *norm : NAN};
        for (int r = 0; r < 2; r++) {
            const float v = caps ? minimum(x[r], caps[r]) : x[r];
            if (fabsf(v) < INFINITY) {
                values[(counts[r] % window) * 2 + r] = v;
                counts[r] += 1;
            }
        }
    }
    if (spiked && skip && *spiked) *spikes += 1;
}
"""


class _SpikeKernel:
    """The loaded C loops of :data:`SOURCE`."""

    __slots__ = ("commit", "decide")

    def __init__(self, lib: ctypes.PyDLL) -> None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self.decide = lib.lmp_spike_decide
        self.decide.restype = None
        self.decide.argtypes = [p, p, i64, i64, p, p, p, p, p, p, p, p]
        self.commit = lib.lmp_spike_commit
        self.commit.restype = None
        self.commit.argtypes = [p, p, i64, p, p, p, p, i32, p, i32, p]


def spike_kernel() -> _SpikeKernel | None:
    """The C loops, or None where they cannot be built or ``LIT_MPSTABLE_NATIVE=0`` (the guard then runs its torch
    ops). Built at the first call on a machine, then loaded from the cache."""
    return _load_kernel() if native.enabled() else None


@functools.cache
def _load_kernel() -> _SpikeKernel | None:
    lib = native.load("spike_guard", SOURCE, native.compiler())
    # Called through PyDLL, which keeps the GIL: the loops take ~0.1 us and call no Python, and a CDLL call releases
    # and takes back the GIL around them (another Python thread, a logger's, may then run first).
    return None if lib is None else _SpikeKernel(ctypes.PyDLL(lib._name, handle=lib._handle))


class _Native(NamedTuple):
    """What a CPU guard's C calls take besides its state (see :meth:`SpikeGuard._native_buffers`)."""

    kernel: _SpikeKernel
    config: torch.Tensor
    z: torch.Tensor
    n: torch.Tensor
    caps: torch.Tensor
    pointers: tuple[int, int, int, int]
    """The data pointers of config, z, n and caps (buffers of their own, never replaced), read once."""

    @classmethod
    def of(cls, kernel: _SpikeKernel, config: torch.Tensor, z: torch.Tensor, n: torch.Tensor,
           caps: torch.Tensor) -> _Native:
        return cls(kernel, config, z, n, caps, (config.data_ptr(), z.data_ptr(), n.data_ptr(), caps.data_ptr()))

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy or a pickle of a guard (a ctypes function is neither) takes the C loops of the process it lands in,
        # or its torch ops where there are none (LIT_MPSTABLE_NATIVE=0, no compiler).
        return (_native_again, (self.config, self.z, self.n, self.caps))


def _native_again(config: torch.Tensor, z: torch.Tensor, n: torch.Tensor, caps: torch.Tensor) -> _Native | None:
    kernel = spike_kernel()
    return None if kernel is None else _Native.of(kernel, config, z, n, caps)


def _plain(value: torch.Tensor | None) -> bool:
    """Whether the C loops may read ``value`` (None: not given), a 0-dim FP32 tensor on the guard's device (the CPU:
    see ``SpikeGuard._value``), as FP32 memory: a plain tensor (no subclass, whose pointer need not be its data)."""
    return value is None or type(value) is torch.Tensor


def _flag(value: torch.Tensor | None) -> bool:
    """Whether the C loops may read the flag ``value`` (None: none): a plain one-element bool CPU tensor."""
    return value is None or (type(value) is torch.Tensor and value.dtype is torch.bool and value.is_cpu
                             and value.numel() == 1)


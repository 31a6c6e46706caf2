"""What the callbacks share: finding the plugin, step counting, the windowed-overflow metric, and the one place
the ``mp/*`` metrics are logged."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torchmetrics import Metric

from lit_mpstable.base.validate import INT32_MAX, int_arg
from lit_mpstable.callbacks._snapshot import state_finite
from lit_mpstable.callbacks.views import ForeignPrecision, PrecisionView, view_of
from lit_mpstable.core.formats import FORMAT_IDS
from lit_mpstable.core.guards.ladder import REASONS, Ladder, Rung, classify, describe, ladder_of
from lit_mpstable.core.guards.triage import needs_triage
from lit_mpstable.core.loaded_state import (
    Field,
    check_fields,
    check_mapping,
    count,
    count_list,
    finite,
    finite_list,
    flag,
    optional,
    records,
    text_list,
)
from lit_mpstable.core.step.step_guard import ends_nonfinite
from lit_mpstable.frontends.common import StableFrontEnd

METRIC_NAMES = (
    "mp/loss_scale", "mp/overflow_rate", "mp/skipped_steps", "mp/grad_norm", "mp/grad_underflow_frac",
    "mp/fallback_active", "mp/rollbacks", "mp/fp8_saturation_frac", "mp/fp8_underflow_frac", "mp/grad_rel_error",
    "mp/grad_cosine", "mp/triage_events", "mp/spikes_skipped", "mp/grad_norm_zscore", "mp/loss_zscore",
    "mp/amax_growth", "mp/kurtosis_max",
    "mp/update_ratio_max", "mp/adam_lag_frac", "mp/attn_logit_max", "mp/spike_score",
)
_PROG_BAR = frozenset({"mp/loss_scale", "mp/overflow_rate"})
# Telemetry logged on the step it was measured. grad_underflow_frac is not among them: the telemetry's is a forecast
# (FP16 has already flushed what underflowed); PrecisionProbe measures it and logs it itself.
_STATS = ("grad_norm", "fp8_saturation_frac", "fp8_underflow_frac")
MAX_WINDOW = 2**20
"""Longest window of steps a callback keeps (a ring buffer on the device: 2**20 steps is already 12 MiB)."""


# ------------------------------------------------------------------------------------------------ validation
def is_int(value: Any, low: int, high: int = INT32_MAX) -> bool:
    """An int (not a bool) in ``[low, high]``; step counts are bounded so nothing overflows or allocates forever."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def is_number(value: Any) -> bool:
    """A finite real number (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check(ok: bool, call: str, rule: str) -> None:
    """Raise ``ValueError("{call}: {rule}")`` unless ``ok``; ``call`` echoes the argument and its value."""
    if not ok:
        raise ValueError(f"{call}: {rule}")


def strict_keys(owner: str, state: Any, expected: set[str]) -> None:
    """Check a callback's loaded state before anything of it is used: a dict with exactly ``expected``'s keys, and
    every field as :data:`STATE_FIELDS` says for ``owner`` (the same rules as the constructors: counts are ints >= 0,
    flags are bools, losses finite). A corrupted checkpoint is refused by name, never loaded silently.

    Raises:
        TypeError: ``state`` is not a dict, or a field has the wrong type (``"False"``, ``None``, a string count).
        KeyError: keys differ (each named).
        ValueError: a field is out of range (a negative counter, a NaN loss).
    """
    call = f"{owner}.load_state_dict"
    check_mapping(call, state, expected)
    check_fields(call, state, STATE_FIELDS.get(owner, {}))


def _step_or_unset(call: str, name: str, value: Any) -> None:
    int_arg(call, name, value, low=-1, unit="an optimizer step, -1 for none")


def _pairs(call: str, name: str, value: Any) -> None:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{call}({name}={value!r}): must be a list of [overflows, steps] pairs.")
    for index, pair in enumerate(value):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise TypeError(f"{call}({name}[{index}]={pair!r}): must be an [overflows, steps] pair.")
        count_list(call, f"{name}[{index}]", list(pair))


def _rows(call: str, name: str, value: Any) -> None:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{call}({name}={value!r}): must be a list of [overflows, skipped, steps] rows.")
    for index, row in enumerate(value):
        if not isinstance(row, (list, tuple)) or len(row) != 3:
            raise TypeError(f"{call}({name}[{index}]={row!r}): must be an [overflows, skipped, steps] row.")
        finite_list(0.0)(call, f"{name}[{index}]", list(row))


def _runs(call: str, name: str, value: Any) -> None:
    check_mapping(call, value, name=name)
    for key, run in value.items():
        if not isinstance(key, str):
            raise TypeError(f"{call}({name}[{key!r}]): keys must be module names.")
        count(call, f"{name}[{key!r}]", run)


STATE_FIELDS: dict[str, dict[str, Field]] = {
    "ScaleCheckpoint": {"rollbacks": count, "skips": count, "events": records, "losses": finite_list(),
                        "skipped_at": count_list, "lr_scale": finite(0.0, 1.0, low_open=True)},
    "OverflowMonitor": {"counts": _rows, "position": count, "above": flag, "blamed": text_list,
                        "indicators": lambda c, n, v: check_mapping(
                            c, v, {"ratios", "judged", "above", "spike_score"}, name=n),
                        "attention_warned": text_list},
    "PrecisionProbe": {"history": records, "pending": flag},
    "PrecisionFallback": {"overflow_run": count, "nonfinite_run": count, "previous_nonfinite": optional(flag),
                          "recent": _pairs, "cooldown_end": _step_or_unset, "decisions": records,
                          "blamed": text_list, "grad_error_runs": _runs, "last_probe_step": _step_or_unset},
    "QKClip": {"heads_clipped": count},
    "AMPPreflight": {"result": lambda c, n, v: check_mapping(c, v, name=n)},
}
"""Each callback's loaded fields and their checks (one table, so every callback loads by the same rules)."""


# ------------------------------------------------------------------------------------------------ across ranks
def any_rank(trainer: pl.Trainer, flags: Sequence[bool], device: torch.device) -> list[bool]:
    """Each flag OR-ed over the ranks: one all-reduce (MAX) and one host read; the flags as they are on one process.
    Every rank must call it at the same point."""
    if trainer.world_size == 1:
        return [bool(flag) for flag in flags]
    reduced = trainer.strategy.reduce(torch.tensor([float(f) for f in flags], device=device), reduce_op="max")
    return [value > 0 for value in reduced.tolist()]


def agreed_names(trainer: pl.Trainer, names: Sequence[str]) -> list[str]:
    """The same names on every rank: rank 0's, or, when rank 0 has none, those of the first rank that has any (an
    inf only some ranks see, in a gradient shard or written after DDP's all-reduce, is blamed there only).

    One all-gather of the lists when several processes run. Every rank must call it at the same point.
    """
    if trainer.world_size == 1 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return list(names)
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, list(names))
    return next((list(g) for g in gathered if g), [])


# ------------------------------------------------------------------------------------------------ plugin access
STEP_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
              "on_before_zero_grad", "on_train_batch_end")
"""The hooks Lightning calls on every callback at every training step, each in its profiler's context (~12 Python
calls a callback and hook, whether the callback implements it or not): a :class:`PluginCallback` sets those it leaves
to ``pl.Callback`` to None on the instance, which Lightning's dispatch (``if callable(fn)``) skips."""


class PluginCallback(pl.Callback):
    """Base of the callbacks: finds the precision plugin at fit start. ``StablePrecision`` is used as it is; with
    Lightning's own plugins (``MixedPrecision``, ``HalfPrecision``, ``FSDPPrecision``, ...) a callback whose
    ``foreign_note`` is set works from a :class:`ForeignPrecision` view of it (its GradScaler's scale and skipped
    steps) and says once what it cannot do there; one whose ``foreign_note`` is None says once that it needs
    StablePrecision and leaves every hook inert. Of the per-step hooks (:data:`STEP_HOOKS`) Lightning calls only
    those the callback implements."""

    foreign_note: str | None = None
    """What this callback does differently with Lightning's own precision plugins, or None: nothing without ours."""

    def __init__(self) -> None:
        self._plugin: PrecisionView | None = None
        self._warned_no_plugin = False
        self._global_step: Any = None  # optimizer_steps(trainer), from fit start: .completed is trainer.global_step
        self._log_every = 0  # the trainer's log_every_n_steps, from fit start
        for hook in STEP_HOOKS:  # Lightning skips a hook that is not callable: only the implemented ones are called
            if getattr(type(self), hook) is getattr(pl.Callback, hook):
                setattr(self, hook, None)

    def _dispatch(self, hook: str, on: bool, owner: type) -> None:
        """Whether Lightning calls ``owner``'s per-step ``hook`` (one of :data:`STEP_HOOKS`), for a hook that has
        nothing to do for a while (None on the instance: Lightning skips it, ~12 Python calls a step saved). A
        subclass's own hook, or a wrapper set on the instance (a profiler's), is left as it is."""
        if getattr(type(self), hook) is not getattr(owner, hook):
            return
        current = self.__dict__.get(hook, getattr(owner, hook))
        if on and current is None:
            del self.__dict__[hook]
        elif not on and current is getattr(owner, hook):  # the class's own: not wrapped
            self.__dict__[hook] = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._global_step = optimizer_steps(trainer)
        self._log_every = run_trainer(trainer).log_every_n_steps
        plugin = trainer.precision_plugin
        if isinstance(plugin, StableFrontEnd):
            self._plugin = plugin
            return
        self._plugin = view_of(plugin, trainer) if self.foreign_note is not None else None
        if not self._warned_no_plugin:
            self._warned_no_plugin = True
            name, theirs = type(self).__name__, type(plugin).__name__
            rank_zero_warn(
                f"{name} with {theirs}: {self.foreign_note}" if self.foreign_note is not None else
                f"{name} does nothing: the trainer's precision plugin is {theirs}; it needs StablePrecision"
                " (Trainer(plugins=[StablePrecision(...)]) instead of precision=...)."
            )

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if isinstance(self._plugin, ForeignPrecision):
            self._plugin.remove()


# ------------------------------------------------------------------------------------------------ the ladder
def run_ladder(trainer: pl.Trainer, plugin: PrecisionView | None, face: str, *rungs: Rung,
               watching: bool = True) -> Ladder | None:
    """At fit start: the run's ladder (kept on the plugin: every face shares it), ``rungs`` switched on by ``face``,
    which watches the ends of the steps (:func:`watch_step`; ``watching=False``: it may still stand aside before the
    train start, see :meth:`~lit_mpstable.core.guards.ladder.Ladder.watch`). None without a plugin of ours."""
    if plugin is None or isinstance(plugin, ForeignPrecision):
        return None
    ladder = ladder_of(plugin)
    ladder.new_fit(trainer, plugin.overflow_count)
    for rung in rungs:
        ladder.switch_on(rung, face)
    ladder.watch(face, watching)
    return ladder


def run_counters(plugin: PrecisionView) -> Any:
    """Where ``plugin``'s run counters (``step_count``, ``overflow_count``, ``skipped_steps``, ``last_step_skipped``)
    are plain attributes: our stepper's ``counters`` (the front end's and the stepper's properties are views of them,
    two calls a read), or the view itself (Lightning's plugins)."""
    stepper = getattr(plugin, "stepper", None)
    return plugin if stepper is None else stepper.counters


def watch_step(ladder: Ladder, trainer: pl.Trainer, pl_module: pl.LightningModule, plugin: PrecisionView,
               face: str, global_step: int | None = None) -> dict[str, Any] | None:
    """The decision for this batch's step (``trainer.global_step - 1``), taken once for all faces by the first that
    calls at batch end: nothing for an applied step; for a rejected one its fault (:func:`~lit_mpstable.core.guards.
    ladder.classify`, the flags agreed across ranks: host reads on rejected steps only) and the rung that acts. A
    ``"stop"`` stops the fit here, with the reason. Within ``restored_window`` steps of a checkpoint load a non-finite
    step or a spike is ``"restored"`` (:meth:`~lit_mpstable.core.guards.ladder.Ladder.restored`). Every face calls it at
    the same point on every rank. ``global_step``: ``trainer.global_step``, where the caller has read it already
    (Lightning's property is a chain of six calls)."""
    step = (trainer.global_step if global_step is None else global_step) - 1
    if step != ladder.watched:  # a batch without an optimizer step (accumulation) shows the step watched before
        ladder.watched = step
        counters = run_counters(plugin)
        count = counters.overflow_count
        overflowed, ladder.overflows = count > ladder.overflows, count
        if counters.last_step_skipped:
            loss_bad, data, unscaled, late, spike = needs_triage(plugin, overflowed)
            suspect = loss_bad or late
            state_bad = suspect and not state_finite(pl_module, trainer.optimizers)
            flags = any_rank(trainer, [data, spike, loss_bad, late, unscaled, state_bad,
                                       bool(getattr(plugin, "last_step_spiked", False))], pl_module.device)
            fault, replayable = classify(nonfinite_input=flags[0], spike=flags[1], nonfinite_loss=flags[2],
                                         late=flags[3], unscaled_overflow=flags[4], state_bad=flags[5],
                                         spiked=flags[6])
            if ladder.restored(step, fault):  # soon after a checkpoint load: the loaded state is the suspect
                fault, replayable = "restored", False
            # Named after the first face that watches (a face after it may watch for it, see Ladder.watcher).
            rung = ladder.decide(step, fault, REASONS[fault], by=ladder.watcher or face, replayable=replayable,
                                 exclude=[Rung.FALLBACK])  # a fallback is its face's own decision (its triggers)
            if rung is Rung.STOP:
                stop(ladder, trainer, step)
    return ladder.decided(step)


class _PropertyStep:
    """``trainer.global_step`` through Lightning's property, where :func:`optimizer_steps` does not find its counter."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self._trainer = trainer

    @property
    def completed(self) -> int:
        return self._trainer.global_step


def optimizer_steps(trainer: pl.Trainer) -> Any:
    """The counter ``trainer.global_step`` reads, as an object whose ``completed`` is its value: the fit loop's
    optimizer-step progress, which Lightning updates in place (a step, a reset, a checkpoint load). Read as an attribute
    where the property is a chain of six calls (loop, module, optimization mode, progress: ~1 us, and every face reads
    it every step). Where the counter is not found, or does not hold ``global_step`` now, Lightning's property."""
    module = trainer.lightning_module
    try:
        loop = trainer.fit_loop.epoch_loop
        automatic = module is None or module.automatic_optimization
        counter = (loop.automatic_optimization.optim_progress.optimizer.step.total if automatic
                   else loop.manual_optimization.optim_step_progress.total)
        found = counter.completed == trainer.global_step
    except AttributeError:
        found = False
    return counter if found else _PropertyStep(trainer)


def stop(ladder: Ladder, trainer: pl.Trainer, step: int, *, concluded: bool = False) -> None:
    """The stop rung: the fit ends after this batch, the reason said once (``concluded``: by the face whose replay
    concluded the step, which the ladder marked done already)."""
    event = ladder.decided(step)
    trainer.should_stop = True
    if event is not None and (concluded or not event.get("done")):
        ladder.done(step)
        rank_zero_warn(describe(event) + " The run stops: inf/NaN in the weights or optimizer state and no snapshot"
                       " to roll back to (add ScaleCheckpoint, or resume from an earlier checkpoint).")




class StepCounter:
    """Optimizer steps, overflows and skipped steps the plugin recorded since the last call: host ints, no sync.

    A batch in which no optimizer stepped (gradient accumulation) shows 0 steps.
    """

    def __init__(self) -> None:
        self.seen = (0, 0, 0)
        self._plugin: PrecisionView | None = None
        self._counters: Any = None  # run_counters(_plugin)

    def _now(self, plugin: PrecisionView) -> tuple[int, int, int]:
        if plugin is not self._plugin:
            self._plugin, self._counters = plugin, run_counters(plugin)
        counters = self._counters
        return counters.step_count, counters.overflow_count, counters.skipped_steps

    def reset(self, plugin: PrecisionView) -> None:
        self.seen = self._now(plugin)

    def delta(self, plugin: PrecisionView) -> tuple[int, int, int]:
        now, seen = self._now(plugin), self.seen
        self.seen = now
        return now[0] - seen[0], now[1] - seen[1], now[2] - seen[2]


_Part = tuple[torch.Tensor, list[torch.Tensor] | None, int]
"""One backward's entry in :class:`LaggedFlag`: its loss (detached; or, where the plugin keeps no batch ends, the
verdict already formed on the device: a bool), the step's batch ends then, and their count."""


class LaggedFlag:
    """Whether a step had a non-finite loss that its batch does not explain (a batch holding inf/NaN is a data
    problem, not a precision one), read one step later, when the device has long computed it: a per-step check
    without a per-step host sync.

    :meth:`mark` keeps each backward's loss and the plugin's batch ends (``input_ends``, the step's minima and maxima,
    by reference with their count) and launches nothing. On one process the next step reads the loss itself (the one
    read; several backwards in a step are checked on the device first and their flag is read), and the batch is asked
    whether it held inf/NaN (``ends_nonfinite``, host reads) only after a non-finite loss. Across processes each
    rank's verdict is formed on the device at the step's end and summed over the ranks, so every rank reads the same
    value."""

    def __init__(self) -> None:
        self._parts: list[_Part] = []  # the step in progress, per backward
        self.previous: tuple[str, torch.Tensor, list[_Part]] | None = None
        """The last closed step: ``("loss", its loss, parts)`` (finite or not), ``("flag", its flag, parts)``
        (non-zero: a non-finite loss, judged against the batch here when parts are given), or None."""

    @staticmethod
    def loss_nonfinite(loss: torch.Tensor) -> torch.Tensor:
        """Whether ``loss`` holds inf/NaN, as a 0-dim (one-element) bool on its device: ``x * 0`` is 0 for every
        finite ``x`` and NaN otherwise (two kernels; ``isfinite`` takes five)."""
        flag = loss.mul(0).ne(0)
        return flag if flag.numel() == 1 else flag.any()

    def mark(self, loss: torch.Tensor, plugin: Any) -> None:
        """Note one backward's ``loss``; a batch of the step so far that held inf/NaN excuses it (asked later)."""
        value, ends = loss.detach(), getattr(plugin, "input_ends", None)
        if ends is None and (data := plugin.input_nonfinite) is not None:  # a plugin that keeps no ends: ask now
            value = self.loss_nonfinite(value) > data  # non-finite, and not a poisoned batch
        self._parts.append((value, ends, 0 if ends is None else len(ends)))

    def clear(self) -> None:
        """Forget the step in progress (a new fit); the previous step's flag stays (it may come from a checkpoint)."""
        self._parts = []

    @staticmethod
    def _excused(ends: list[torch.Tensor] | None, count: int) -> torch.Tensor | None:
        return ends_nonfinite(ends[:count]) if ends is not None and count else None

    def _flag(self, value: torch.Tensor) -> torch.Tensor:
        return value if value.dtype == torch.bool else self.loss_nonfinite(value)

    def end_step(self, trainer: pl.Trainer) -> bool | None:
        """Close the step; return the previous step's flag (on any rank), ``None`` if there was none."""
        parts, self._parts = self._parts, []
        closed: tuple[str, torch.Tensor, list[_Part]] | None = None
        if parts and trainer.world_size > 1:  # each rank's verdict now, summed: the same on every rank
            verdict = None
            for value, ends, n in parts:
                flag = self._flag(value)
                flag = flag if (data := self._excused(ends, n)) is None else flag > data
                verdict = flag if verdict is None else verdict | flag
            assert verdict is not None
            closed = ("flag", trainer.strategy.reduce(verdict.float(), reduce_op="sum"), [])
        elif len(parts) == 1 and parts[0][0].dtype != torch.bool and parts[0][0].numel() == 1:
            closed = ("loss", parts[0][0], parts)  # read as it is: no kernel on a clean step
        elif parts:
            flags = [self._flag(value) for value, _, _ in parts]
            verdict = flags[0]
            for flag in flags[1:]:
                verdict = verdict | flag
            closed = ("flag", verdict, parts)
        previous, self.previous = self.previous, closed
        return None if previous is None else self._read(previous)

    def _read(self, previous: tuple[str, torch.Tensor, list[_Part]]) -> bool:
        kind, value, parts = previous
        read = value.item()  # the one read of a clean step
        if (math.isfinite(read) if kind == "loss" else not read > 0):
            return False
        # A non-finite loss on this process: excused only where its batch held inf/NaN (host reads, bad steps only).
        return any(bool(self._flag(value)) and not ((data := self._excused(ends, n)) is not None and bool(data))
                   for value, ends, n in parts) if parts else True

    def unread(self) -> bool | None:
        """The flag :meth:`end_step` will return next (synchronises), for checkpoints."""
        return None if self.previous is None else self._read(self.previous)

    def load(self, value: bool | None) -> None:
        self._parts = []
        self.previous = None if value is None else ("flag", torch.tensor(float(value)), [])


class WindowedCounts(Metric):
    """Overflows, skipped steps and optimizer steps of the last ``window`` stepping batches, as a ring buffer.

    One ``(window, 3)`` state, summed across processes when :meth:`compute` synchronises (so the rate
    ``overflows / steps`` is the rate over all ranks). :meth:`update` keeps its three host ints on the host: the rows
    reach the device state in one copy when it is read (:attr:`counts`, :meth:`compute`, a cross-process sync: the
    logging steps and checkpoints), not as three scalar writes every step. No host sync.
    """

    _counts: torch.Tensor  # the state add_state registers

    full_state_update = False

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window
        # slot -> row, updated since the state was last written; [position]: a plain list, so the per-step update
        # writes no attribute of the module (nn.Module and Metric.__setattr__ are ~2 us a write)
        self._rows: dict[int, tuple[int, int, int]] = {}
        self._position = [0]
        self.add_state("_counts", default=torch.zeros(window, 3), dist_reduce_fx="sum")

    @property
    def position(self) -> int:
        """Stepping batches recorded since the start (or :meth:`reset`); the next row goes to ``position % window``."""
        return self._position[0]

    @position.setter
    def position(self, value: int) -> None:
        self._position[0] = value

    @property
    def counts(self) -> torch.Tensor:
        """The window, ``(window, 3)`` rows of ``[overflows, skipped, steps]``, with every update in it."""
        self.flush_()
        return self._counts

    def update(self, overflows: int, skipped: int, steps: int) -> None:
        self.record(overflows, skipped, steps)

    def record(self, overflows: int, skipped: int, steps: int) -> None:
        """:meth:`update` without torchmetrics' wrapper around it (a grad-mode switch and two module attribute
        writes a call): the per-step path. Its bookkeeping is kept where it matters: a cached :meth:`compute`
        result is dropped, and the metric counts as updated."""
        position = self._position
        self._rows[position[0] % self.window] = (overflows, skipped, steps)
        position[0] += 1
        if self._computed is not None or not self._update_count:
            self._computed = None
            self._update_count += 1

    def flush_(self) -> None:
        """Write the rows updated since the last write into the device state: one copy."""
        if self._rows:
            state = self._counts
            slots = torch.tensor(list(self._rows), device=state.device)
            state[slots] = torch.tensor(list(self._rows.values()), dtype=state.dtype, device=state.device)
            self._rows.clear()

    def sync(self, *args: Any, **kwargs: Any) -> None:
        self.flush_()  # before the state is reduced across processes
        super().sync(*args, **kwargs)

    def compute(self) -> torch.Tensor:
        """``[overflows, skipped, steps]`` summed over the window (and over processes)."""
        return self.counts.sum(0)

    def reset(self) -> None:
        super().reset()
        self._rows.clear()
        self.position = 0


# ------------------------------------------------------------------------------------------------ logging
def _scalar(value: Any, dtype: torch.dtype) -> float | torch.Tensor | None:
    if isinstance(value, Mapping):  # per-format statistics: the format the model computes in
        value = value.get(FORMAT_IDS.get(dtype, ""))
    if isinstance(value, torch.Tensor):
        return value.detach().float().reshape(()) if value.numel() == 1 else None
    return float(value) if is_number(value) else None


def plugin_metrics(plugin: PrecisionView, *, overflow_rate: float) -> dict[str, Any]:
    """The ``mp/*`` values of the plugin's state after this step: the loss scale (only when scaling; reading it
    synchronises: call on logging steps), the windowed ``overflow_rate`` given, skipped steps, fallback, and with a
    SpikeGuard the spikes skipped and the last z-scores (one more read, on the same logging steps)."""
    values: dict[str, Any] = {"mp/loss_scale": plugin.loss_scale} if plugin.scaler is not None else {}
    values.update({
        "mp/overflow_rate": overflow_rate,
        "mp/skipped_steps": float(plugin.skipped_steps),
        "mp/fallback_active": float(plugin.fallback_active),
    })
    guard = getattr(plugin, "spike_guard", None)
    if guard is not None:
        # SpikeGuard's device values in one read (this runs on logging steps only); a z-score not measured on the
        # last judged step (NaN) is left out rather than logged as a value.
        spikes, grad_z, loss_z = torch.stack([guard.spikes_skipped.float(), guard.grad_norm_zscore.float(),
                                              guard.loss_zscore.float()]).tolist()
        values["mp/spikes_skipped"] = spikes
        values.update({name: z for name, z in (("mp/grad_norm_zscore", grad_z), ("mp/loss_zscore", loss_z))
                       if math.isfinite(z)})
    growth = getattr(plugin, "growth_metrics", None)  # activation growth (device tensors), once sampled
    if growth is not None:
        values.update(growth())
    return values


def measured_metrics(plugin: PrecisionView) -> dict[str, float]:
    """The telemetry measured on the step just taken, as ``mp/*`` floats; empty on every other step (a value is never
    repeated as if fresh). Reads device values (one sync) only when there is something to read."""
    if plugin.stats.get("stats_step") != plugin.step_count - 1:
        return {}
    values = {f"mp/{key}": _scalar(plugin.stats.get(key), plugin.dtype) for key in _STATS}
    return {name: float(value) for name, value in values.items() if value is not None}


def log_measured(trainer: pl.Trainer, values: Mapping[str, float]) -> None:
    """Metrics measured only on some steps go straight to the trainer's loggers, labelled with this step: logged
    through ``LightningModule.log`` Lightning would repeat the last value at every later logging step of the epoch
    as if it were fresh."""
    if not values:
        return
    for name in values:
        assert name in METRIC_NAMES, name
    # The step label Lightning gives this batch's own metrics (it increments it after on_train_batch_end).
    step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step - 1)
    for logger in trainer.loggers:
        logger.log_metrics(dict(values), step=step)


def log_mp(pl_module: pl.LightningModule, values: Mapping[str, Any], *, prog_bar: bool = False) -> None:
    """The one place ``mp/*`` metrics are logged, always with the same arguments per name (Lightning accepts a
    name logged twice in one hook only then): per step; with ``prog_bar`` the loss scale and overflow rate also in
    the progress bar (callers pass it only when a scaler makes them move). Each fact has one writer:
    OverflowMonitor the plugin's state, ScaleCheckpoint ``mp/rollbacks``, PrecisionProbe its measurements."""
    for name, value in values.items():
        assert name in METRIC_NAMES, name
        bar = prog_bar and name in _PROG_BAR
        if not _relogged(pl_module, name, value, prog_bar=bar):
            pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=bar, batch_size=1)


def _relogged(pl_module: pl.LightningModule, name: str, value: Any, *, prog_bar: bool) -> bool:
    """``pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=prog_bar, batch_size=1)`` for a name this
    hook has logged before with these arguments, done as ``log`` ends: the value into Lightning's stored result for it
    (its ``update_metrics``), whence it reaches ``callback_metrics``, the progress bar and the loggers as before.

    ``log`` itself re-validates the call, reads ``training_step``'s signature, builds and compares the name's metadata
    and walks the stored result (a module and a dataclass copied) to move it to the value's device: ~250 us a name on
    a CPU, ten names a logging step. Nothing is done here (False: call ``log``) wherever ``log`` would do more: the
    name's first log from this hook, other arguments (``log`` raises), the first batch of an epoch (``log`` resets the
    hook's results), a dataloader index, a value on another device or of more than one element. Lightning's step
    results have no public handle (as :meth:`StepMetrics.retire`); an attribute missing there means ``log``."""
    trainer = pl_module._trainer
    results = getattr(trainer, "_results", None)
    connector = getattr(trainer, "_logger_connector", None)
    fx = getattr(pl_module, "_current_fx_name", None)
    if results is None or connector is None or fx is None or getattr(results, "dataloader_idx", 0) is not None:
        return False
    item = results.get(f"{fx}.{name}")
    meta = getattr(item, "meta", None)
    try:  # another Lightning release may name these otherwise: then ``log``, before anything is written
        if (meta is None or not getattr(item, "is_tensor", False) or meta.prog_bar is not prog_bar or not meta.logger
                or not meta.on_step or meta.on_epoch or meta.enable_graph or not meta.is_mean_reduction
                or meta.metric_attribute is not None or meta.sync.should or connector.should_reset_tensors(fx)
                or not callable(results.update_metrics)):
            return False
    except AttributeError:
        return False
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return False
        tensor = value.detach().clone().squeeze()
    else:
        default = torch.get_default_dtype()  # Lightning's: the default dtype, at least FP32
        tensor = torch.tensor(value, device=pl_module.device,
                              dtype=default if default in (torch.float32, torch.float64) else torch.float32)
    if tensor.device != item.value.device:
        return False
    results.update_metrics(f"{fx}.{name}", tensor, 1)
    connector._current_fx = fx
    return True


class StepMetrics:
    """The ``mp/*`` metrics one callback logged (:func:`log_mp`) on its last logging step, until :meth:`retire` takes
    them out of Lightning's step results at a later batch end.

    Lightning keeps a value logged on one step among its step results and, at every later batch end of the epoch,
    reads it again into ``callback_metrics`` and the progress bar (a detach a metric; for a progress-bar metric an
    ``.item()``, a host sync) until it is logged again: ~1 us a metric a step, and with a loss scaler two host reads a
    step for ``mp/loss_scale`` and ``mp/overflow_rate``. Retired, a value stays where it was shown
    (``callback_metrics``, ``progress_bar_metrics``, the loggers); Lightning only stops re-reading it, and no longer
    sends it to the loggers again as if fresh at a logging step of its own (a monitor with its own
    ``log_every_n_steps``)."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        """Names logged since the last :meth:`retire` (empty on most steps: the check a step costs)."""

    def log(self, pl_module: pl.LightningModule, values: Mapping[str, Any], *, prog_bar: bool = False) -> None:
        """:func:`log_mp`, the names noted for :meth:`retire`."""
        log_mp(pl_module, values, prog_bar=prog_bar)
        self.names.update(values)

    def retire(self, trainer: pl.Trainer) -> None:
        """At a batch end after the logging step (a callback's hook runs before Lightning reads its step results):
        the logged values leave Lightning's step results, as its own reset leaves them (``has_reset``) until logged
        again."""
        names, self.names = self.names, set()
        results = getattr(trainer, "_results", None)  # Lightning's step results: no public handle
        for item in results.values() if results is not None else ():
            meta = getattr(item, "meta", None)
            if meta is not None and meta.name in names and meta.on_step and not meta.on_epoch:
                item.has_reset = True


class _RunTrainer(Protocol):
    """What Lightning's connectors set on a Trainer when it is built (outside its class, so mypy does not see them)."""

    callbacks: list[pl.Callback]
    log_every_n_steps: int


def run_trainer(trainer: pl.Trainer) -> _RunTrainer:
    """``trainer``, typed with the attributes its connectors set (``callbacks``, ``log_every_n_steps``)."""
    return cast(_RunTrainer, trainer)

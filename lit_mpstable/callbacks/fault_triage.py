"""FaultTriage: a rejected step is replayed (as is, in FP32, from the last snapshot) and classified transient,
precision, data or state, with the matching action."""

from __future__ import annotations

import copy
import inspect
import sys
from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lit_mpstable.callbacks._common import (
    PluginCallback,
    StepMetrics,
    _PropertyStep,
    agreed_names,
    any_rank,
    check,
    is_int,
    run_ladder,
    run_trainer,
    stop,
    strict_keys,
    watch_step,
)
from lit_mpstable.callbacks._snapshot import restore_snapshot, take_snapshot
from lit_mpstable.callbacks.scale_checkpoint import ScaleCheckpoint
from lit_mpstable.core.guards.ladder import Ladder, Rung
from lit_mpstable.core.guards.triage import (
    BUDGET_WINDOW,
    LADDER,
    REPLAY_BUDGET,
    budget_note,
    check_budget,
    climb,
    describe,
    replays_spent,
    restore_rng,
    rng_state,
    traced,
    traced_names,
    triage_event,
)
from lit_mpstable.frontends.trainer import TrainerPrecision, held_logs, training_step_args


class FaultTriage(PluginCallback):
    """Replays a rejected step to tell a passing fault from a deterministic one, and acts on what it finds.

    On every training batch it keeps what a replay needs: a reference to the batch, its index, the torch RNG states
    (CPU, and CUDA where initialised) and references to what ``training_step`` had logged: host copies of a few KiB,
    no host read; where the module holds ``torchmetrics.Metric`` modules, device copies of their states too (a few
    small tensors: ~4 us each on a CPU). A clean step costs nothing more: its verdict is the plugin's
    ``last_step_skipped``, read after the sync the skip decision already made.

    A rejected step is triaged when the loss scale does not explain it: its loss was non-finite (the scale only
    multiplies after the loss), its batch held inf/NaN (``stats["nonfinite_input"]``), its gradients overflowed with no
    scaler or a scale already at 1, or inf/NaN entered after the gradient check (``stats["nonfinite_after_check"]``:
    the weights or the optimizer state). A routine FP16 overflow at a scale above 1 is the scaler's business: not
    replayed. The same batch is then replayed with the RNG restored, at most ``max_replays`` times, up the
    :class:`Replay` ladder: as is, in FP32 (``plugin.full_precision()``; skipped where FSDP2 fixed the precision), from
    ScaleCheckpoint's last snapshot (skipped without one). A replay is clean when its loss, its gradients, the weights
    and the optimizer state are all finite
    on every rank. A step the plugin's SpikeGuard rejected as a spike is triaged too; its replay counts as clean only
    if it is also not a spike by the guard's current statistics (judged without folding anything into them). The first
    clean replay names the kind:

    - ``"transient"``: the as-is replay's step is applied through the plugin (clipping, hooks, masters, counters):
      nothing is skipped;
    - ``"precision"``: the FP32 replay's step is applied, and the modules where inf/NaN first appeared in the as-is
      replay fall back (``plugin.fallback``; the whole model one rung if none is named);
    - ``"state"``: ScaleCheckpoint rolls back (``roll_back``, counted in its budget), and the replay's step from the
      snapshot is applied;
    - ``"data"``: no replay was clean (or none was left): the batch stays skipped, its index recorded.

    The plugin counts what happened: the rejected execution as a skipped step, an applied replay as a step of its
    own. What ``training_step`` logs (``self.log``) is what the executions that count logged: a rejected replay logs
    nothing; an applied replay's values replace the rejected execution's, in the step's value and in the epoch
    aggregates, as if the step had run once; a ``torchmetrics.Metric`` of the module counts the batch once too (each
    replay updates it from its state at the step's start; a batch left skipped keeps the rejected execution's
    update, as without this callback). Every event goes into :attr:`events`, a rank-zero message and
    ``mp/triage_events``, and the checkpoint. Distributed runs decide alike on every rank: the trigger and each
    replay's verdict are reduced (any rank's non-finite value counts), the blamed names agreed, before anything is
    done; every rank replays together. A ``torch.compile``'d module runs its as-is replay eagerly (it is traced); the
    other replays run compiled.

    A run that cannot be replayed says so once and classifies nothing: manual optimization (the step is the user's
    own code), gradient accumulation (only the last of the step's batches is at hand) or a ``training_step`` that
    takes ``dataloader_iter`` (it fetches its own batch). Any dataloader is replayed, an ``IterableDataset`` (a
    stream, nanoGPT's ``get_batch``) as a map-style one: a replay reuses the batch object the step was given and never
    touches the dataset or the loader (nothing is fetched between the step and its replays, so the replay reads what
    the step read).

    It is the face of the remedy ladder's replay rung (:mod:`lit_mpstable.core.guards.ladder`): a rejected step is
    classified once per step, by the first of the ladder's faces to see it, and replayed here only when the ladder
    hands it to this rung; the verdict is recorded in the step's ladder event (``plugin.ladder_events``) as well as in
    :attr:`events`. It never reorders ``trainer.callbacks``: list it before a callback that undoes a fault at batch end
    (``FaultInjector`` restores its batch there; a warning says so at setup). One instance per run.

    Replays are budgeted: a rejected step is triaged only while the events of the last ``budget_window`` steps
    (this one included) ran at most ``replay_budget - max_replays`` replays, leaving room for a full climb. Beyond
    that it stays skipped untriaged, as without this callback (counted in :attr:`over_budget`), and a warning says so
    once: faults on most steps are no passing fault, and replaying each would multiply the run's time.

    Args:
        max_replays: rungs of the ladder to try, 1 to 3 (1: as is only; 2: and in FP32; 3: and from the snapshot).
        replay_budget: replays allowed within ``budget_window`` consecutive steps, >= ``max_replays`` (12 by
            default: at most ~12% more time, four full climbs).
        budget_window: the steps ``replay_budget`` counts over (100 by default).

    Raises:
        ValueError: ``max_replays`` is not an int in [1, 3]; ``replay_budget`` is not an int >= ``max_replays``;
            ``budget_window`` is not an int >= 1.
    """

    def __init__(self, max_replays: int = 3, replay_budget: int = REPLAY_BUDGET,
                 budget_window: int = BUDGET_WINDOW) -> None:
        super().__init__()
        check(is_int(max_replays, 1, len(LADDER)), f"{type(self).__name__}(max_replays={max_replays!r})",
              "must be an int in [1, 3]: replays as is, then in FP32, then from the last snapshot; 3 tries them all.")
        check_budget(type(self).__name__, max_replays, replay_budget, budget_window)
        self.max_replays, self.replay_budget, self.budget_window = max_replays, replay_budget, budget_window
        self.events: list[dict[str, Any]] = []
        """Per triaged step: ``step``, ``kind``, ``action`` (``"use_replay"``, ``"fallback"``, ``"skip"``,
        ``"rollback"``), ``blamed`` (module names), ``batch_idx``, ``replays`` (``"as_is:nonfinite"``, ...) and, for
        ``"state"``, ``restored_step``."""
        self.replays_run = 0
        """Forward-backward replays run so far (0 while every step is clean)."""
        self.cannot_replay: str | None = None
        """Why this run cannot be replayed (said once), or None."""
        self.over_budget = 0
        """Rejected steps left untriaged because the replay budget had no room (this process's runs; not saved)."""
        self._batch: Any = None
        self._batch_idx = -1
        self._step = -1
        self._rng: tuple[torch.Tensor, list[torch.Tensor] | None] | None = None
        self._step_logs: _StepLogs | None = None
        self._metrics: list[Any] = []  # the module's torchmetrics.Metric modules (found at the train start)
        self._metric_states: _MetricStates | None = None
        self._schedules: list[int | None] = []  # each LR scheduler's last_epoch at the batch start
        self._lrs: list[Any] = []  # the optimizer's learning rates at the batch start, by group
        self._ladder: Ladder | None = None
        self._logged = StepMetrics()  # mp/* values of the last logging step (retired at the next batch end)

    @property
    def skipped_batches(self) -> list[int]:
        """Indices of the batches classified ``"data"`` (skipped)."""
        return [event["batch_idx"] for event in self.events if event["kind"] == "data"]

    # ------------------------------------------------------------------------------------------------ hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        callbacks = run_trainer(trainer).callbacks
        before = callbacks[:callbacks.index(self)] if self in callbacks else []
        undoing = [type(cb).__name__ for cb in before if type(cb).__name__ == "FaultInjector"]
        if stage == "fit" and undoing:
            rank_zero_warn(f"FaultTriage is listed after {undoing[0]}, which undoes its fault at batch end, before"
                           " FaultTriage replays the step: list FaultTriage first (callbacks run in list order; none"
                           " reorders them).")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._ladder = run_ladder(trainer, self._plugin, "FaultTriage", Rung.REPLAY)
        if self._ladder is not None:
            face = f"FaultTriage(replay_budget={self.replay_budget}, budget_window={self.budget_window})"
            self._ladder.claim("replay_budget", self.replay_budget, face)
            self._ladder.claim("budget_window", self.budget_window, face)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._plugin is None:
            return
        reason = _why_not_replayable(trainer, pl_module)
        if reason is not None and self.cannot_replay is None:
            rank_zero_warn(f"FaultTriage cannot replay steps in this run: {reason}. Rejected steps stay skipped and"
                           " nothing is classified.")
        self.cannot_replay = reason
        self._metrics = _metrics_of(pl_module) if reason is None else []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._plugin is None or self.cannot_replay is not None:
            return
        # References and host copies only (the RNG states are small host tensors): nothing waits for the device.
        self._batch, self._batch_idx, self._rng = batch, batch_idx, rng_state()
        self._step_logs = _StepLogs(trainer)
        self._metric_states = _MetricStates(self._metrics) if self._metrics else None
        self._schedules = [getattr(config.scheduler, "last_epoch", None) for config in trainer.lr_scheduler_configs]
        self._lrs = [group["lr"] for group in trainer.optimizers[0].param_groups] if trainer.optimizers else []
        self._step = self._global_step.completed

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._logged.names:  # the batch after a logging step
            self._logged.retire(trainer)
        plugin, ladder = self._plugin, self._ladder
        if plugin is None or ladder is None:
            return
        batch, self._batch = self._batch, None
        global_step = self._global_step.completed
        watch_step(ladder, trainer, pl_module, plugin, "FaultTriage", global_step)
        triaged = False
        step = global_step - 1
        if ladder.pending(step, Rung.REPLAY):
            # The events are alike on every rank, so is the budget's verdict.
            spent = replays_spent(self.events, self._step, self.budget_window)
            if batch is None or self.cannot_replay is not None:
                ladder.forget(step, f"FaultTriage cannot replay it ({self.cannot_replay or 'no batch'})")
            elif spent + self.max_replays <= self.replay_budget:
                self._triage(trainer, pl_module, batch)
                triaged = True
            else:
                ladder.forget(step, "the replay budget is spent")
                self.over_budget += 1
                if self.over_budget == 1:
                    rank_zero_warn(budget_note("FaultTriage", self._step, spent, self.max_replays, self.replay_budget,
                                               self.budget_window))
        every = self._log_every
        if triaged or (every and self._global_step.completed % every == 0):
            self._logged.log(pl_module, {"mp/triage_events": float(len(self.events))})

    # ------------------------------------------------------------------------------------------------ triage
    def _triage(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        plugin, step, batch_idx = cast(TrainerPrecision, self._plugin), self._step, self._batch_idx
        assert self._rng is not None
        after = rng_state()
        host = _TrainerReplay(self, trainer, pl_module, batch)
        kind, outcomes, traced, extra = climb(host, self.max_replays)
        known = dict(pl_module.named_modules())
        # Only a fault that reproduces has a place to blame: where inf/NaN first appeared in the as-is replay.
        blamed = [n for n in agreed_names(trainer, traced if kind == "precision" else []) if n in known and n]
        if kind == "precision":
            extra["effect"] = plugin.fallback(blamed or None, reason=f"FaultTriage: step {step} was clean only in FP32",
                                              step=step)
        restore_rng(after)  # the RNG goes on from where the rejected step left it
        event = triage_event(step, kind, blamed, batch_idx, outcomes, **extra)
        self.events.append(event)
        assert self._ladder is not None
        stops = self._ladder.conclude(step, kind, replays=outcomes, blamed=blamed, **extra) is Rung.STOP
        if stops:  # no snapshot to roll back to: the ladder's last rung, said as such (not "skip")
            event["action"] = "stop"
        rank_zero_info(describe(event, "FaultTriage"))
        if stops:
            stop(self._ladder, trainer, step, concluded=True)

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Keys: ``events`` (as :attr:`events`), ``replays_run``."""
        return {"events": copy.deepcopy(self.events), "replays_run": self.replays_run}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        strict_keys(type(self).__name__, state_dict, {"events", "replays_run"})
        self.events = copy.deepcopy(list(state_dict["events"]))
        self.replays_run = int(state_dict["replays_run"])


def _step_schedules(trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int,
                    before: Sequence[int | None]) -> None:
    """Lightning stepped the per-step LR schedulers due at this batch (interval and frequency) before
    ``on_train_batch_end``, while the step stood skipped: step again, now that it is applied, those the plugin held
    (their ``last_epoch`` is still what it was at the batch start, ``before``), or the schedule lags one step behind
    the weights for the rest of the run. Not the others: a scheduler of ``frequency`` > 1 had an applied step since
    it last stepped, so it was not held."""
    for config, start in zip(trainer.lr_scheduler_configs, before):
        due = config.interval == "step" and not config.reduce_on_plateau and (batch_idx + 1) % config.frequency == 0
        if due and (start is None or getattr(config.scheduler, "last_epoch", None) == start):
            pl_module.lr_scheduler_step(config.scheduler, None)


_STEP_HOOK = "training_step"


class _StepLogs:
    """What the ``self.log`` calls of ``training_step`` had accumulated in Lightning's results before a step, so that
    a replay applied in the step's place logs for it as if the step had run once: the rejected execution's values
    leave the step's value and the epoch aggregates (its NaN in no epoch mean), the replay's take their place. Taken
    at every batch start as references, not copies: Lightning rebinds a result's tensors at each update, never writes
    them in place, so nothing is copied and nothing waits for the device."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.before = {key: (result.value, getattr(result, "cumulated_batch_size", None), result._forward_cache,
                             result.has_reset) for key, result in self._step_results()}

    def _step_results(self) -> list[tuple[str, Any]]:
        """``training_step``'s tensor results (a logged ``torchmetrics.Metric`` is the module's own state)."""
        results = getattr(self.trainer, "_results", None)  # Lightning's step results: no public handle
        return [(key, result) for key, result in (results or {}).items()
                if result.is_tensor and result.meta.fx == _STEP_HOOK]

    def relog(self, pl_module: pl.LightningModule, held: Sequence[Callable[[], None]]) -> None:
        """The step's results back to before the step, then ``held`` (the applied replay's ``self.log`` calls) made as
        ``training_step``'s. The hook names are put back after, so the hooks that log after this one see what they
        would have seen (Lightning resets a hook's results in an epoch's first batch when another hook logged last)."""
        for key, result in self._step_results():
            if key in self.before:
                result.value, cumulated, result._forward_cache, result.has_reset = self.before[key]
                if cumulated is not None:
                    result.cumulated_batch_size = cumulated
            else:  # first logged by the rejected execution
                result.reset()
        connector = self.trainer._logger_connector
        hooks = pl_module._current_fx_name, connector._current_fx
        pl_module._current_fx_name = _STEP_HOOK
        try:
            for log in held:
                log()
        finally:
            pl_module._current_fx_name, connector._current_fx = hooks


class _MetricStates:
    """The states of ``torchmetrics.Metric`` modules, copied (device copies of their tensors, no host read): a replay
    runs ``training_step`` from the states the step started with, so the metrics it updates count the batch once.
    Taken at every batch start while the module holds metrics (a few small copies a step: a metric's sums and counts;
    a list state is copied as a list, its tensors never written in place)."""

    def __init__(self, metrics: Sequence[Any]) -> None:
        self.states = [(metric, {name: _copied(value) for name, value in metric.metric_state.items()})
                       for metric in metrics]

    def restore(self) -> None:
        """Put the copied states back (copies again: a replay's update may write them in place)."""
        for metric, state in self.states:
            for name, value in state.items():
                setattr(metric, name, _copied(value))


@contextmanager
def _at_step(triage: FaultTriage) -> Generator[None, None, None]:
    """Within the block ``trainer.global_step`` is the replayed step's: the replay runs from the batch end, after
    Lightning counted the rejected execution, and a ``training_step`` may weigh its loss by the step (a warmup,
    annealing). Where the counter is Lightning's property (not found as an object), it stays."""
    counter = triage._global_step
    if counter is None or isinstance(counter, _PropertyStep):
        yield
        return
    counted, counter.completed = counter.completed, triage._step
    try:
        yield
    finally:
        counter.completed = counted


def _copied(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else list(value)


def _metrics_of(pl_module: pl.LightningModule) -> list[Any]:
    """The ``torchmetrics.Metric`` modules of ``pl_module`` (none without torchmetrics imported: a module holding a
    metric has imported it)."""
    torchmetrics = sys.modules.get("torchmetrics")
    metric = getattr(torchmetrics, "Metric", None)
    return [m for m in pl_module.modules() if isinstance(m, metric)] if metric is not None else []


class _TrainerReplay:
    """The Trainer's side of a triage (:class:`~lit_mpstable.core.guards.triage.ReplayHost`): replays through
    ``training_step``, steps through the plugin, snapshots from ScaleCheckpoint."""

    def __init__(self, triage: FaultTriage, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        self.triage, self.trainer, self.module, self.batch = triage, trainer, pl_module, batch
        self.plugin = cast(TrainerPrecision, triage._plugin)  # StablePrecision only (FaultTriage has no foreign_note)
        self.optimizer = trainer.optimizers[0]
        self.can_fp32 = bool(self.plugin.can_fallback)  # FSDP2 fixed the precision at fully_shard
        self.checkpoint = next((c for c in run_trainer(trainer).callbacks if isinstance(c, ScaleCheckpoint)), None)
        self.held_logs: list[Callable[[], None]] = []  # the last replay's self.log calls: made if its step is applied
        # The metrics as the rejected execution left them: where a rejected replay puts them back (a batch that stays
        # skipped counts in them as without FaultTriage).
        self.rejected_metrics = _MetricStates(triage._metrics) if triage._metric_states is not None else None

    def full_precision(self) -> AbstractContextManager:
        return self.plugin.full_precision()

    def replay(self, *, trace: bool) -> tuple[torch.Tensor | None, list[str]]:
        """One forward and backward of the batch with the RNG of the rejected step; the loss (None if the step returned
        none) and, with ``trace``, where inf/NaN first appeared (nothing for a non-finite batch: no module made it)."""
        triage, pl_module = self.triage, self.module
        assert triage._rng is not None
        triage.replays_run += 1
        restore_rng(triage._rng)
        if triage._metric_states is not None:  # its training_step updates them from where the step started
            triage._metric_states.restore()
        self.optimizer.zero_grad(set_to_none=True)
        pl_module.zero_grad(set_to_none=True)
        with traced(pl_module, trace) as tracer, held_logs(pl_module) as self.held_logs, _at_step(triage):
            # In the precision the replay runs in: a '*-true' batch is 16-bit, and the FP32 replay needs it in FP32.
            output = self.trainer.strategy.training_step(
                *training_step_args(pl_module, self.plugin.convert_input(self.batch), triage._batch_idx))
            loss = output.get("loss") if isinstance(output, dict) else output
            if isinstance(loss, torch.Tensor):
                self.plugin.replay_backward(loss, pl_module)
        return (loss.detach() if isinstance(loss, torch.Tensor) else None), traced_names(tracer)

    def apply(self, loss: torch.Tensor | None) -> None:
        triage = self.triage
        assert triage._step_logs is not None
        triage._step_logs.relog(self.module, self.held_logs)
        # A scheduler the plugin did not hold (frequency > 1: a step was applied since it last stepped) moved the LR
        # after the rejected execution: the replay steps at the LR the step began with, as the step would have.
        groups, configs = self.optimizer.param_groups, self.trainer.lr_scheduler_configs
        moved = any(start is not None and getattr(config.scheduler, "last_epoch", None) != start
                    for config, start in zip(configs, triage._schedules))
        now = [group["lr"] for group in groups]
        if moved and len(triage._lrs) == len(groups):
            for group, lr in zip(groups, triage._lrs):
                group["lr"] = lr
        try:
            self.plugin.optimizer_step(self.optimizer, self.module, lambda: loss)
        finally:
            for group, lr in zip(groups, now):
                group["lr"] = lr
        _step_schedules(self.trainer, self.module, triage._batch_idx, triage._schedules)

    def discard(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.module.zero_grad(set_to_none=True)
        if getattr(self.plugin, "spike_guard", None) is not None:
            self.plugin.spike_guard.forget_()  # a rejected replay's loss and norm never enter the statistics
        self.plugin.stepper.restore_buffers_()  # the next replay starts from the buffers as the step did
        if self.rejected_metrics is not None:
            self.rejected_metrics.restore()

    def has_snapshot(self) -> bool:
        return self.checkpoint is not None and self.checkpoint.snapshot_step is not None

    def enter_snapshot(self) -> Any:
        assert self.checkpoint is not None
        backup = take_snapshot(self.trainer, self.module, self.plugin, None)
        try:
            self.checkpoint.restore_snapshot(self.trainer, self.module)
        except BaseException:  # a restore that failed half-way: the current step's state back
            restore_snapshot(self.trainer, self.module, self.plugin, backup)
            raise
        return backup

    def leave_snapshot(self, backup: Any) -> None:
        restore_snapshot(self.trainer, self.module, self.plugin, backup)

    def roll_back(self) -> int | None:
        assert self.checkpoint is not None
        return self.checkpoint.roll_back(self.trainer, self.module, kind="fault triage: state", step=self.triage._step)

    def any_rank(self, flags: Sequence[bool]) -> list[bool]:
        return any_rank(self.trainer, flags, self.module.device)


def _why_not_replayable(trainer: pl.Trainer, pl_module: pl.LightningModule) -> str | None:
    if not pl_module.automatic_optimization:
        return "manual optimization (the step is the LightningModule's own code, which a replay cannot re-enter)"
    if trainer.accumulate_grad_batches > 1:
        return (f"gradient accumulation (accumulate_grad_batches={trainer.accumulate_grad_batches}: a step's gradients"
                " come from several batches and only the last is at hand)")
    if "dataloader_iter" in inspect.signature(pl_module.training_step).parameters:
        return "training_step takes dataloader_iter (it fetches its own batch, which cannot be fetched again)"
    return None

"""ScaleCheckpoint: the snapshot owner; inf/NaN weights or optimizer state roll back to a last-known-good snapshot."""

from __future__ import annotations

import copy
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit_mpstable.callbacks._common import (
    PluginCallback,
    StepMetrics,
    any_rank,
    check,
    is_int,
    is_number,
    run_ladder,
    run_trainer,
    strict_keys,
    watch_step,
)
from lit_mpstable.callbacks._restored import earlier_checkpoint, load_in_process
from lit_mpstable.callbacks._snapshot import (
    layout_key,
    nonfinite_entries,
    restore_snapshot,
    state_finite,
    take_snapshot,
)
from lit_mpstable.core.guards.ladder import Ladder, Rung

OnSpike = Literal["skip", "rollback"]
DEPRECATED = ("spike_zscore", "window", "min_history", "on_spike", "spike_patience")
"""The host-side spike detector's arguments: SpikeGuard is the one spike detector now; passing one warns once."""


class ScaleCheckpoint(PluginCallback):
    """The snapshot owner and the face of the remedy ladder's rollback rung (:mod:`lit_mpstable.core.guards.ladder`):
    keeps a last-known-good snapshot, and rolls back to it when the weights or the optimizer state hold inf/NaN.

    - Every ``every_n_steps`` optimizer steps, at train start and after a precision fallback, it checks that the
      weights and the optimizer state are finite (one host sync) and snapshots module, optimizers, LR schedulers and
      plugin state, on ``snapshot_device`` ("cpu" by default: never a second copy in accelerator memory; "device"
      keeps it where the tensors are, faster to restore). Non-finite weights or optimizer state roll back; a snapshot
      is itself checked (weights, FP32 masters, loss scale, optimizer state) before it is kept and before a rollback
      restores it, and a run whose state at train start holds inf/NaN (resumed from a bad checkpoint) raises
      ``ValueError`` naming the entries.
    - A step the ladder finds rejected for inf/NaN in the weights or optimizer state rolls back at once (unless
      ``FaultTriage`` replays it first: its ``"state"`` verdict calls :meth:`roll_back`).
    - A rollback restores the snapshot exactly; the plugin's event counters stay as they are. Decided alike on every
      rank. After ``max_rollbacks`` rollbacks the next one raises ``RuntimeError``. Metric: ``mp/rollbacks`` (its one
      writer).
    - The restored-state rung (``restored_window=N``, off by default; Trainer): a non-finite step or a spike within
      ``N`` optimizer steps of a checkpoint load (``trainer.fit(ckpt_path=...)``) is blamed on the loaded state
      (fault ``"restored"``): rolling back to the snapshot of that state would loop (Megatron-LM#5281), so the run
      loads, in process, the newest checkpoint of the loaded one's directory written before it (by modification time
      and ``global_step``) that holds the training state and passes its numeric fingerprint. Weights, plugin state,
      optimizers, LR schedulers and ``global_step`` come from that file (the run resumes at its ``global_step`` and
      trains on to ``max_steps``; the data goes on with the next batch); a new snapshot is taken of it, and the window
      starts again from it. Each attempt is warned and recorded in :attr:`events` with the file's path (``checkpoint``)
      and counted against ``max_rollbacks``; when they are spent, or no earlier checkpoint passes, the run stops with
      the reason named (the ladder's stop rung).
    - ``lr_factor`` (levanter#391): each rollback (or restore) multiplies every param group's ``lr`` (and
      ``initial_lr``, ``max_lr``, ``min_lr`` where present) and the LR schedulers' ``base_lrs`` by ``lr_factor``, so a
      schedule computed from its base keeps the reduction; the reductions accumulate (:attr:`lr_scale`, saved and
      resumed in this callback's state). 1.0 (the default) changes nothing.
    - Its snapshots have a public API, used by ``FaultTriage``'s snapshot rung and ``PreemptionCheckpoint``:
      :attr:`snapshot_step`, :meth:`restore_snapshot`, :meth:`roll_back`, :meth:`snapshot_state` and
      :meth:`load_snapshot_state`.

    Spikes are ``SpikeGuard``'s (``StablePrecision(spike_guard=SpikeGuard(...))``: on the device, no host read), which
    skips them. The host-side detector this callback had (``spike_zscore``, ``window``, ``min_history``, ``on_spike``,
    ``spike_patience``) is gone: passing one of them warns once, naming SpikeGuard, and has no effect.

    Lightning stores ``plugin.state_dict()`` in every full checkpoint; this callback's own state (counts, events) rides
    in the callback state. Snapshots stay in memory. One instance per run (a second one with another
    ``every_n_steps`` is refused at fit start).

    Raises:
        ValueError: an argument is out of range (``restored_window`` an int >= 0, ``lr_factor`` in (0, 1]); at train
            start, the state holds inf/NaN; a second instance with another ``every_n_steps``; at setup, a
            ``WeightAveraging`` callback (``EMAWeightAveraging``) listed before it or ``FaultTriage`` (:meth:`setup`).
    """

    foreign_note = ("it snapshots and rolls back non-finite weights or optimizer state; skipping a batch needs"
                    " StablePrecision.")
    _warned_deprecated = False

    def __init__(
        self, every_n_steps: int = 50, *, spike_zscore: float | None = None, window: int | None = None,
        max_rollbacks: int = 3, min_history: int | None = None, on_spike: OnSpike | None = None,
        spike_patience: int | None = None, snapshot_device: str = "cpu", restored_window: int = 0,
        lr_factor: float = 1.0,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        check(is_int(every_n_steps, 1), f"{name}(every_n_steps={every_n_steps!r})", "must be an int >= 1 (steps).")
        check(is_int(max_rollbacks, 0), f"{name}(max_rollbacks={max_rollbacks!r})", "must be an int >= 0.")
        check(snapshot_device in ("cpu", "device"), f"{name}(snapshot_device={snapshot_device!r})",
              "allowed: 'cpu' (off the accelerator) or 'device' (where the tensors are).")
        check(is_int(restored_window, 0), f"{name}(restored_window={restored_window!r})",
              "must be an int >= 0 (optimizer steps after a checkpoint load in which a non-finite step or a spike"
              " restores the checkpoint before; 0: off).")
        check(is_number(lr_factor) and 0 < lr_factor <= 1, f"{name}(lr_factor={lr_factor!r})",
              "must be a number in (0, 1] (each rollback multiplies the learning rates by it; 1.0: unchanged).")
        given = dict(spike_zscore=spike_zscore, window=window, min_history=min_history, on_spike=on_spike,
                     spike_patience=spike_patience)
        passed = [f"{k}={v!r}" for k, v in given.items() if v is not None]
        if passed and not ScaleCheckpoint._warned_deprecated:
            ScaleCheckpoint._warned_deprecated = True
            rank_zero_warn(f"{name}({', '.join(passed)}): ScaleCheckpoint no longer detects spikes; these arguments"
                           " have no effect and go in the next release. SpikeGuard is the one spike detector:"
                           " StablePrecision(spike_guard=SpikeGuard(zscore=6.0, warmup=20)) skips spikes on the device;"
                           " ScaleCheckpoint rolls back inf/NaN weights or optimizer state.", category=FutureWarning)
        self.every_n_steps, self.max_rollbacks, self.snapshot_device = every_n_steps, max_rollbacks, snapshot_device
        self.restored_window, self.lr_factor = restored_window, float(lr_factor)
        self.lr_scale = 1.0
        """The product of the LR reductions applied so far (``lr_factor`` per rollback); saved in the state."""
        self.rollbacks = 0
        self.skips = 0
        """Kept for the checkpoint format: ScaleCheckpoint skips nothing itself now (always 0 in new runs)."""
        self.events: list[dict[str, Any]] = []
        """One dict per rollback: ``step``, ``kind``, ``action`` (``"rollback"``, or ``"restore_previous"`` with
        ``checkpoint``, the file restored, or ``"stop"`` with ``reason``), ``loss`` and ``zscore`` (None),
        ``restored_step``, and with ``lr_factor`` below 1 ``lr_scale``."""
        self._snapshot: dict[str, Any] | None = None
        self._layout: tuple | None = None  # the precision layout at the snapshot
        self._groups: tuple[int, ...] | None = None  # the optimizers' param groups (sizes) at the snapshot
        self._ladder: Ladder | None = None
        self._logged = StepMetrics()  # mp/* values of the last logging step (retired at the next batch end)

    @property
    def snapshot_step(self) -> int | None:
        """The global step of the snapshot a rollback would restore."""
        return None if self._snapshot is None else self._snapshot["step"]

    def snapshot_state(self) -> dict[str, Any] | None:
        """The snapshot a rollback would restore and its precision layout, as plain values (what a preemption
        checkpoint saves); None before the first."""
        if self._snapshot is None:
            return None
        layout = self._layout
        return {"snapshot": self._snapshot,
                "layout": None if layout is None else [layout[0], str(layout[1]).removeprefix("torch."),
                                                       list(layout[2])]}

    def load_snapshot_state(self, saved: dict[str, Any]) -> None:
        """Take ``saved`` (from :meth:`snapshot_state`) as the snapshot to roll back to (a resumed run's)."""
        layout = saved["layout"]
        self._snapshot = saved["snapshot"]
        self._layout = None if layout is None else (layout[0], getattr(torch, layout[1]), tuple(layout[2]))

    def restore_snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
        """Load the last snapshot now, uncounted and unrecorded (a trial: ``FaultTriage`` replays a step from it and
        calls :meth:`roll_back` only if that replay is clean); returns its step.

        Raises:
            RuntimeError: no snapshot yet (see :attr:`snapshot_step`).
        """
        if self._plugin is None or self._snapshot is None:
            raise RuntimeError("ScaleCheckpoint.restore_snapshot(): no snapshot yet; check snapshot_step first.")
        restore_snapshot(trainer, pl_module, self._plugin, self._snapshot)
        return self._snapshot["step"]

    def roll_back(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *, kind: str,
                  step: int | None = None) -> int:
        """Roll back to the last snapshot as a detected fault would (counted, recorded in :attr:`events` under
        ``kind`` at ``step``, the step it answers: default ``trainer.global_step``, one past a step that has ended),
        warned, within ``max_rollbacks``; returns the snapshot's step. Call it on every rank alike.

        Raises:
            RuntimeError: no snapshot yet, or the ``max_rollbacks`` budget is spent.
        """
        if self._plugin is None or self._snapshot is None:
            raise RuntimeError(f"ScaleCheckpoint.roll_back(kind={kind!r}): no snapshot yet; check snapshot_step first.")
        at = trainer.global_step if step is None else step
        self._roll_back(trainer, pl_module, dict(step=at, kind=kind, loss=None, zscore=None))
        return self._snapshot["step"]

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a weight-averaging callback (Lightning's ``WeightAveraging``, ``EMAWeightAveraging``) listed before a
        callback that rolls inf/NaN weights back at batch end (this one, or ``FaultTriage``, whose ``"state"`` verdict
        calls :meth:`roll_back`): callbacks run in list order and none reorders them, so it would average the NaN in
        before the rollback, and its average, every later checkpoint and the model at fit end would hold NaN."""
        callbacks = list(run_trainer(trainer).callbacks)
        if stage != "fit" or self not in callbacks:
            return
        rolling = [cb for cb in callbacks if cb is self or _is_a(cb, "FaultTriage")]
        last = max(callbacks.index(cb) for cb in rolling)
        averaging = [type(cb).__name__ for cb in callbacks[:last] if _is_a(cb, "WeightAveraging")]
        if averaging:
            names = [type(cb).__name__ for cb in rolling]
            works = ", ".join(f"{name}(...)" for name in names + averaging)
            raise ValueError(
                f"ScaleCheckpoint: {type(callbacks[last]).__name__} is listed after {averaging[0]}, which averages the"
                f" weights at batch end: callbacks run in list order (none reorders them), so a NaN that"
                f" {' or '.join(names)} rolls back would be averaged in first, and the average, every later checkpoint"
                f" and the model at fit end would hold NaN. List {averaging[0]} after {' and '.join(names)}:"
                f" callbacks=[{works}].")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        rungs = (Rung.ROLLBACK, Rung.RESTORE) if self.restored_window else (Rung.ROLLBACK,)
        self._ladder = run_ladder(trainer, self._plugin, "ScaleCheckpoint", *rungs)
        if self._ladder is not None:
            self._ladder.claim("snapshot_every", self.every_n_steps,
                               f"ScaleCheckpoint(every_n_steps={self.every_n_steps})")
            if self.restored_window:
                self._ladder.claim("restored_window", self.restored_window,
                                   f"ScaleCheckpoint(restored_window={self.restored_window})")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._plugin is not None:
            self._take(trainer, pl_module)
        if self._ladder is not None and self.restored_window and trainer.ckpt_path is not None:
            self._ladder.loaded(trainer.global_step, self._loaded_path(str(trainer.ckpt_path)))

    def _loaded_path(self, path: str) -> str:
        """The file the fit's state came from: ``ckpt_path``, or the earlier one the fingerprint's
        ``on_fingerprint_mismatch="previous"`` loaded instead (followed along its events)."""
        for event in getattr(getattr(self._plugin, "fingerprint", None), "events", []):
            if event.get("fallback") and str(event["source"]).startswith(path):
                path = str(event["fallback"])
        return path

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._logged.names:  # the batch after a logging step
            self._logged.retire(trainer)
        if self._plugin is None:
            return
        step = self._global_step.completed
        ladder = self._ladder
        # The ladder where this batch's step was decided (rejected); None for an applied step: nothing is pending.
        if ladder is not None and watch_step(ladder, trainer, pl_module, self._plugin, "ScaleCheckpoint", step) is None:
            ladder = None
        if ladder is not None and ladder.pending(step - 1, Rung.RESTORE):  # soon after a load: the file before it
            self._restore_previous(trainer, pl_module, ladder, step - 1)
        elif ladder is not None and ladder.pending(step - 1, Rung.ROLLBACK):  # rejected for inf/NaN in the state
            event = ladder.decided(step - 1)
            assert event is not None
            self._roll_back(trainer, pl_module, dict(step=step - 1, kind=event["reason"], loss=None, zscore=None))
            ladder.done(step - 1, restored_step=self.snapshot_step)
        elif step != self.snapshot_step and (
            step % self.every_n_steps == 0 or layout_key(self._plugin) != self._layout or self._regrouped(trainer)
        ):
            if trainer.strategy.reduce_boolean_decision(state_finite(pl_module, trainer.optimizers), all=True):
                self._take(trainer, pl_module)
            else:
                self._roll_back_found(trainer, pl_module, "non-finite weights or optimizer state")
        if self._log_every and step % self._log_every == 0:
            self._logged.log(pl_module, {"mp/rollbacks": float(self.rollbacks)})

    def _regrouped(self, trainer: pl.Trainer) -> bool:
        """Whether the optimizers' param groups changed since the snapshot (``add_param_group``, as BaseFinetuning's
        unfreezing does): an optimizer cannot load the snapshot's state any more, so a new one is taken now. A
        snapshot loaded with a checkpoint holds the groups the run has when it first asks."""
        groups = _groups_key(trainer)
        if self._groups is None:
            self._groups = groups
        return groups != self._groups

    def _take(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._plugin is not None
        device = "cpu" if self.snapshot_device == "cpu" else None
        snapshot = take_snapshot(trainer, pl_module, self._plugin, device)
        # A snapshot is only as good as what it copied: a run resumed from NaN weights (or a NaN FP32 master, scale or
        # optimizer state) must not become the state every rollback returns to.
        bad = nonfinite_entries(snapshot)
        (bad_anywhere,) = any_rank(trainer, [bool(bad)], pl_module.device)
        if not bad_anywhere:
            snapshot["lr_scale"] = self.lr_scale  # the LR reductions the snapshot's optimizer state holds
            self._snapshot, self._layout = snapshot, layout_key(self._plugin)
            self._groups = _groups_key(trainer)
            return
        where = ", ".join(bad) if bad else "on another rank"
        if self._snapshot is None:
            raise ValueError(
                f"ScaleCheckpoint at train start (step {trainer.global_step}): the state to snapshot holds inf/NaN"
                f" ({where}), so there is no last-known-good state to roll back to. The weights or optimizer state"
                " were loaded that way (a corrupted checkpoint, or a run saved after it diverged): resume from an"
                " earlier checkpoint, or start fresh.")
        self._roll_back_found(trainer, pl_module, f"non-finite weights, masters or optimizer state ({where})")

    def _roll_back_found(self, trainer: pl.Trainer, pl_module: pl.LightningModule, kind: str) -> None:
        """A check after an applied step found inf/NaN in the state: the ladder's rollback (no rejected step to
        replay)."""
        step, ladder = trainer.global_step, self._ladder
        if ladder is not None and ladder.decide(step - 1, "nonfinite_state", kind, by="ScaleCheckpoint",
                                                replayable=False) is None:
            return  # the ladder gave this step to another rung (FaultTriage replays it, its "state" verdict rolls back)
        self._roll_back(trainer, pl_module, dict(step=step, kind=kind, loss=None, zscore=None))
        if ladder is not None:
            ladder.done(step - 1, restored_step=self.snapshot_step)

    def _roll_back(self, trainer: pl.Trainer, pl_module: pl.LightningModule, event: dict[str, Any]) -> None:
        assert self._plugin is not None and self._snapshot is not None
        bad = nonfinite_entries(self._snapshot)
        if bad:  # never restore a bad state (snapshots are checked when taken: this is the last line of defence)
            raise ValueError(
                f"ScaleCheckpoint at step {event['step']}: {event['kind']}, and the snapshot of step"
                f" {self.snapshot_step} to roll back to holds inf/NaN too ({', '.join(bad)}); resume from an earlier"
                " checkpoint.")
        self._check_budget(event)
        restore_snapshot(trainer, pl_module, self._plugin, self._snapshot)
        self.rollbacks += 1
        self._reduce_lr(trainer, float(self._snapshot.get("lr_scale", 1.0)))
        self.events.append({**event, "action": "rollback", "restored_step": self.snapshot_step,
                            **({"lr_scale": self.lr_scale} if self.lr_factor != 1.0 else {})})
        rank_zero_warn(
            f"ScaleCheckpoint at step {event['step']}: {event['kind']}; model, optimizer, LR schedule and plugin state"
            f" restored to step {self.snapshot_step} (rollback {self.rollbacks} of {self.max_rollbacks})"
            + (f"; learning rates x{self.lr_scale:g} of the schedule's." if self.lr_factor != 1.0 else ".")
        )

    def _reduce_lr(self, trainer: pl.Trainer, restored_scale: float) -> None:
        """After a rollback: the LR reductions so far times one more ``lr_factor``, applied to state restored with
        ``restored_scale`` of them (the snapshot's or the file's): every param group's rates and each LR scheduler's
        ``base_lrs`` (and its last rates; ``CyclicLR``'s ``max_lrs``; the schedulers ``SequentialLR`` and
        ``ChainedScheduler`` hand over to, else the next one puts the full rate back) by their ratio. Nothing with
        ``lr_factor=1``."""
        if self.lr_factor == 1.0:
            return
        self.lr_scale *= self.lr_factor
        ratio = self.lr_scale / restored_scale
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                for key in ("lr", "initial_lr", "max_lr", "min_lr"):
                    value = group.get(key)
                    if isinstance(value, torch.Tensor):
                        value.mul_(ratio)
                    elif isinstance(value, (int, float)) and not isinstance(value, bool):
                        group[key] = value * ratio
        for config in trainer.lr_scheduler_configs:
            _scale_schedule(config.scheduler, ratio)

    def _restore_previous(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ladder: Ladder, step: int) -> None:
        """The restore rung: the checkpoint written before the loaded one that passes, loaded in process; the run stops
        (reason named) when the attempts are spent or none passes. The same files, checks and decision on every rank."""
        assert self._plugin is not None and ladder.load is not None
        path, loaded_step = ladder.load["path"], ladder.load["step"]
        if self.rollbacks >= self.max_rollbacks:
            why = (f"{self.rollbacks} rollbacks/restores done (max_rollbacks={self.max_rollbacks}); the last state"
                   f" loaded, from {path}, went bad again")
            return self._give_up(trainer, ladder, step, why)
        previous, checkpoint, rejected = earlier_checkpoint(self._plugin, path, loaded_step)
        if previous is None or checkpoint is None:
            return self._give_up(trainer, ladder, step, f"{path} was loaded at step {loaded_step}; {rejected}")
        restored_scale = float(dict(dict(checkpoint.get("callbacks") or {}).get(self.state_key) or {}).get(
            "lr_scale", 1.0))
        resumed = load_in_process(trainer, checkpoint, previous)
        self.rollbacks += 1
        self._reduce_lr(trainer, restored_scale)
        skipped = [f"{p} ({d[0]})" for p, d in rejected.items()] if isinstance(rejected, dict) else []
        self.events.append(dict(step=step, kind="restored state", action="restore_previous", loss=None, zscore=None,
                                checkpoint=str(previous), failed=path, restored_step=resumed, lr_scale=self.lr_scale,
                                skipped=skipped))
        ladder.done(step, checkpoint=str(previous), failed=path, restored_step=resumed)
        ladder.rewind(resumed)
        ladder.loaded(resumed, str(previous))
        self._take(trainer, pl_module)  # the snapshot a later rollback returns to: the restored file's state
        rank_zero_warn(
            f"ScaleCheckpoint at step {step}: a bad step {step - loaded_step + 1} steps after loading {path}: the"
            f" restored state is suspect; restored {previous} instead (global_step={resumed}; attempt"
            f" {self.rollbacks} of max_rollbacks={self.max_rollbacks})"
            + "".join(f"; skipped {s}" for s in skipped)
            + (f"; learning rates x{self.lr_scale:g} of the schedule's." if self.lr_factor != 1.0 else "."))
        return None

    def _give_up(self, trainer: pl.Trainer, ladder: Ladder, step: int, why: str) -> None:
        ladder.give_up(step, why)
        trainer.should_stop = True
        self.events.append(dict(step=step, kind="restored state", action="stop", loss=None, zscore=None, reason=why))
        rank_zero_warn(f"ScaleCheckpoint at step {step}: a non-finite step or a spike soon after a checkpoint load,"
                       f" and no earlier checkpoint to restore: {why}. The run stops; resume from an earlier"
                       " checkpoint, or check how the loaded one was written.")

    def _check_budget(self, event: dict[str, Any]) -> None:
        if self.rollbacks < self.max_rollbacks:
            return
        raise RuntimeError(
            f"ScaleCheckpoint: {event['kind']} at step {event['step']}, after {self.rollbacks} rollbacks to the"
            f" snapshot of step {self.snapshot_step} (max_rollbacks={self.max_rollbacks}): training keeps diverging."
            " Try a lower learning rate or a longer warmup, gradient clipping, PrecisionFallback or a wider precision"
            " ('bf16-mixed', '32-true'), checking the data near this step, or a larger max_rollbacks."
        )

    def state_dict(self) -> dict[str, Any]:
        """Keys: ``rollbacks``, ``skips``, ``events``, ``lr_scale``, and ``losses`` and ``skipped_at`` (empty: kept so
        that older checkpoints load). Snapshots stay in memory only (:meth:`snapshot_state`)."""
        return {"rollbacks": self.rollbacks, "skips": self.skips, "events": copy.deepcopy(self.events),
                "losses": [], "skipped_at": [], "lr_scale": self.lr_scale}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if isinstance(state_dict, dict) and "lr_scale" not in state_dict:  # written before lr_factor: no reduction
            state_dict = {**state_dict, "lr_scale": 1.0}
        strict_keys(type(self).__name__, state_dict, set(self.state_dict()))
        self.rollbacks, self.skips = int(state_dict["rollbacks"]), int(state_dict["skips"])
        self.events = copy.deepcopy(list(state_dict["events"]))
        self.lr_scale = float(state_dict["lr_scale"])


def _scale_schedule(scheduler: object, ratio: float) -> None:
    """An LR scheduler's rates, and those of the schedulers it holds, times ``ratio``."""
    for attribute in ("base_lrs", "_last_lr", "max_lrs"):
        values = getattr(scheduler, attribute, None)
        if isinstance(values, list):
            setattr(scheduler, attribute, [v * ratio for v in values])
    for child in getattr(scheduler, "_schedulers", None) or []:
        _scale_schedule(child, ratio)


def _is_a(callback: object, name: str) -> bool:
    """Whether ``callback``'s class, or one it derives from, is called ``name``: on either Trainer package's tree
    (``lightning.pytorch`` or ``pytorch_lightning``), and without importing the one the run does not use."""
    return any(cls.__name__ == name for cls in type(callback).__mro__)


def _groups_key(trainer: pl.Trainer) -> tuple[int, ...]:
    """The size of each param group of each optimizer: what an optimizer's ``load_state_dict`` needs to match."""
    return tuple(len(group["params"]) for optimizer in trainer.optimizers for group in optimizer.param_groups)

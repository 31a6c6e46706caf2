"""ScaleCheckpoint: a spiking batch is skipped; bad weights or persistent spikes roll back to a last-known-good
snapshot."""

from __future__ import annotations

import copy
import math
from collections import deque
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit_mpstable.callbacks._common import (
    MAX_WINDOW,
    PluginCallback,
    any_rank,
    check,
    is_int,
    is_number,
    log_mp,
    run_trainer,
    strict_keys,
)
from lit_mpstable.callbacks._rules import spike_zscore
from lit_mpstable.callbacks._snapshot import (
    layout_key,
    nonfinite_entries,
    restore_snapshot,
    state_finite,
    take_snapshot,
)

OnSpike = Literal["skip", "rollback"]


class ScaleCheckpoint(PluginCallback):
    """Keeps a poisoned batch out of the weights, and a last-known-good snapshot to roll back to when that is not
    enough.

    - In ``on_before_backward`` it reads the loss (one host sync per backward). A loss more than ``spike_zscore``
      standard deviations above the last ``window`` finite losses calls ``plugin.skip_step()``: the batch never
      reaches the weights. A non-finite loss is left to the plugin's own inf/NaN check, which skips the step and counts
      (and attributes) it as an overflow; it is handled here, as a spike, with ``on_spike="rollback"`` or where nothing
      checks (a plugin without a scaler and with ``skip_nonfinite=False``, Lightning's ``HalfPrecision``). With
      ``on_spike="skip"`` (the default) that is all: nothing else is undone, since nothing else went wrong. A rollback
      follows when spikes persist (``spike_patience`` skipped batches within ``window`` optimizer steps), or on every
      spike with ``on_spike="rollback"``.
    - Every ``every_n_steps`` optimizer steps, at train start and after a precision fallback, it checks that the
      weights and the optimizer state are finite (one host sync) and snapshots module, optimizers, LR schedulers and
      plugin state, on ``snapshot_device`` ("cpu" by default: never a second copy in accelerator memory; "device"
      keeps it where the tensors are, faster to restore). Non-finite weights or optimizer state roll back; a snapshot
      is itself checked (weights, FP32 masters, loss scale, optimizer state) before it is kept and before a rollback
      restores it, and a run whose state at train start holds inf/NaN (resumed from a bad checkpoint) raises
      ``ValueError`` naming the entries.
    - A rollback restores the snapshot exactly; the plugin's event counters stay as they are. Decided alike on every
      rank: any rank's trigger acts on all of them, under the same ``kind``; an event's ``loss`` and ``zscore`` are
      this rank's (each rank sees its own batch).
    - After ``max_rollbacks`` rollbacks the next one raises ``RuntimeError``. Metric: ``mp/rollbacks`` (its one
      writer); skipped batches show in ``mp/skipped_steps``.

    With ``StablePrecision(spike_guard=SpikeGuard(...))`` the plugin owns spike detection (on the device, no host
    read): this callback reads no loss, and each step the guard skipped counts towards ``spike_patience`` (or rolls
    back at once with ``on_spike="rollback"``); ``spike_zscore`` and ``min_history`` then go unused. Without a guard
    it detects loss spikes itself as described above.

    Lightning stores ``plugin.state_dict()`` in every full checkpoint; this callback's own state (counts, events, the
    recent losses) rides in the callback state. Snapshots stay in memory. One instance per run.

    Raises:
        ValueError: an argument is out of range; at train start, the state holds inf/NaN.
    """

    foreign_note = ("a spiking or non-finite loss rolls back to the last snapshot (the batch's update is undone with"
                    " it); skipping only that batch needs StablePrecision.")

    def __init__(
        self, every_n_steps: int = 50, *, spike_zscore: float = 6.0, window: int = 50, max_rollbacks: int = 3,
        min_history: int = 10, on_spike: OnSpike = "skip", spike_patience: int = 3, snapshot_device: str = "cpu",
    ) -> None:
        super().__init__()
        name = type(self).__name__
        check(is_int(every_n_steps, 1), f"{name}(every_n_steps={every_n_steps!r})", "must be an int >= 1 (steps).")
        check(is_number(spike_zscore) and 0 < spike_zscore < math.inf, f"{name}(spike_zscore={spike_zscore!r})",
              "must be a finite number > 0 (standard deviations above the recent mean loss); 6.0 is usual.")
        check(is_int(window, 2, MAX_WINDOW), f"{name}(window={window!r})",
              f"must be an int in [2, {MAX_WINDOW}] (recent losses).")
        check(is_int(max_rollbacks, 0), f"{name}(max_rollbacks={max_rollbacks!r})", "must be an int >= 0.")
        check(is_int(min_history, 2) and min_history <= window, f"{name}(min_history={min_history!r})",
              f"must be an int in [2, window={window}] (losses needed before spikes are judged).")
        check(on_spike in get_args(OnSpike), f"{name}(on_spike={on_spike!r})", f"allowed: {list(get_args(OnSpike))}.")
        check(is_int(spike_patience, 1), f"{name}(spike_patience={spike_patience!r})",
              "must be an int >= 1 (skipped batches within `window` steps before a rollback).")
        check(snapshot_device in ("cpu", "device"), f"{name}(snapshot_device={snapshot_device!r})",
              "allowed: 'cpu' (off the accelerator) or 'device' (where the tensors are).")
        self.every_n_steps, self.spike_zscore, self.max_rollbacks = every_n_steps, spike_zscore, max_rollbacks
        self.min_history, self.on_spike, self.spike_patience = min_history, on_spike, spike_patience
        self.window, self.snapshot_device = window, snapshot_device
        self.rollbacks = 0
        self.skips = 0
        """Batches skipped for a spiking or non-finite loss (each also counted in ``plugin.skipped_steps``)."""
        self.events: list[dict[str, Any]] = []
        """One dict per skip or rollback: ``step``, ``kind``, ``action`` (``"skip"``/``"rollback"``), ``loss``,
        ``zscore`` (None if not judged) and, for a rollback, ``restored_step``."""
        self.losses: deque[float] = deque(maxlen=window)
        self._skipped_at: deque[int] = deque()  # optimizer steps of recent skips, for persistence
        self._snapshot: dict[str, Any] | None = None
        self._layout: tuple | None = None  # the precision layout at the snapshot
        self._pending: dict[str, Any] | None = None  # the skip decided in this batch

    @property
    def snapshot_step(self) -> int | None:
        """The global step of the snapshot a rollback would restore."""
        return None if self._snapshot is None else self._snapshot["step"]

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

    def roll_back(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *, kind: str) -> int:
        """Roll back to the last snapshot as a detected fault would (counted, recorded in :attr:`events` under
        ``kind``, warned, within ``max_rollbacks``); returns the snapshot's step. Call it on every rank alike.

        Raises:
            RuntimeError: no snapshot yet, or the ``max_rollbacks`` budget is spent.
        """
        if self._plugin is None or self._snapshot is None:
            raise RuntimeError(f"ScaleCheckpoint.roll_back(kind={kind!r}): no snapshot yet; check snapshot_step first.")
        self._roll_back(trainer, pl_module, dict(step=trainer.global_step, kind=kind, loss=None, zscore=None))
        return self._snapshot["step"]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pending = None
        if self._plugin is not None:
            self._take(trainer, pl_module)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._plugin is None or self._pending is not None or getattr(self._plugin, "spike_guard", None) is not None:
            return  # with a SpikeGuard the plugin owns spike detection, on the device (no read of the loss here)
        # The hook sees the loss as the plugin scaled it (DeepSpeed scales inside its own backward: 1.0 there).
        value = loss.detach().float().item() / getattr(self._plugin, "hook_loss_scale", self._plugin.loss_scale)
        z = spike_zscore(value, self.losses, self.min_history)
        finite = math.isfinite(value)
        # Any rank's trigger acts on every rank, and all of them name the same kind (one all-reduce).
        nonfinite, spike = any_rank(trainer, [not finite, finite and z is not None and z > self.spike_zscore],
                                    pl_module.device)
        if not (nonfinite or spike):
            self.losses.append(value)
            return
        if not spike and self._plugin.checks_nonfinite and self.on_spike == "skip":
            # A non-finite loss makes non-finite gradients, which the plugin's own check skips and counts (and
            # attributes: an FP16 overflow in one layer is then the fallback's to fix, not a rollback's).
            return
        if self._plugin.can_skip:
            self._plugin.skip_step()
        self._pending = dict(step=trainer.global_step, kind="non-finite loss" if nonfinite else "loss spike",
                             loss=value, zscore=z)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._plugin is None:
            return
        step = trainer.global_step
        if self._pending is None and getattr(self._plugin, "last_step_spiked", False):
            # The plugin's SpikeGuard skipped this step: count it towards spike_patience (a rollback when spikes
            # persist, or at once with on_spike="rollback"), as a spike found here would be.
            self._pending = dict(step=step - 1, **_guard_event(self._plugin))
        if self._pending is not None:  # backward is over: the weights may change now
            event, self._pending = self._pending, None
            self._on_skip(trainer, pl_module, event)
        elif step != self.snapshot_step and (
            step % self.every_n_steps == 0 or layout_key(self._plugin) != self._layout
        ):
            if trainer.strategy.reduce_boolean_decision(state_finite(pl_module, trainer.optimizers), all=True):
                self._take(trainer, pl_module)
            else:
                self._roll_back(trainer, pl_module, dict(step=step, kind="non-finite weights or optimizer state",
                                                         loss=None, zscore=None))
        every = run_trainer(trainer).log_every_n_steps
        if every and step % every == 0:
            log_mp(pl_module, {"mp/rollbacks": float(self.rollbacks)})

    def _on_skip(self, trainer: pl.Trainer, pl_module: pl.LightningModule, event: dict[str, Any]) -> None:
        step = event["step"]
        assert self._plugin is not None  # a skip event comes from the plugin
        self._skipped_at.append(step)
        while self._skipped_at and self._skipped_at[0] <= step - self.window:
            self._skipped_at.popleft()
        if self.on_spike == "rollback" or len(self._skipped_at) >= self.spike_patience or not self._plugin.can_skip:
            if self.on_spike == "skip" and self._plugin.can_skip:
                event["kind"] += f" ({len(self._skipped_at)} skipped within {self.window} steps)"
            self._skipped_at.clear()
            self._roll_back(trainer, pl_module, event)
            return
        self.skips += 1
        self.events.append({**event, "action": "skip"})
        rank_zero_warn(
            f"ScaleCheckpoint at step {step}: {event['kind']} (loss {_fmt(event['loss'], '.4g')}, z-score"
            f" {_fmt(event['zscore'], '.1f')}); that batch was skipped, nothing else changed"
            f" ({len(self._skipped_at)} of spike_patience={self.spike_patience} within {self.window} steps before a"
            " rollback)."
        )

    def _take(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._plugin is not None
        device = "cpu" if self.snapshot_device == "cpu" else None
        snapshot = take_snapshot(trainer, pl_module, self._plugin, device)
        # A snapshot is only as good as what it copied: a run resumed from NaN weights (or a NaN FP32 master, scale or
        # optimizer state) must not become the state every rollback returns to.
        bad = nonfinite_entries(snapshot)
        (bad_anywhere,) = any_rank(trainer, [bool(bad)], pl_module.device)
        if not bad_anywhere:
            self._snapshot, self._layout = snapshot, layout_key(self._plugin)
            return
        where = ", ".join(bad) if bad else "on another rank"
        if self._snapshot is None:
            raise ValueError(
                f"ScaleCheckpoint at train start (step {trainer.global_step}): the state to snapshot holds inf/NaN"
                f" ({where}), so there is no last-known-good state to roll back to. The weights or optimizer state"
                " were loaded that way (a corrupted checkpoint, or a run saved after it diverged): resume from an"
                " earlier checkpoint, or start fresh.")
        self._roll_back(trainer, pl_module, dict(step=trainer.global_step, loss=None, zscore=None,
                                                 kind=f"non-finite weights, masters or optimizer state ({where})"))

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
        self.events.append({**event, "action": "rollback", "restored_step": self.snapshot_step})
        rank_zero_warn(
            f"ScaleCheckpoint at step {event['step']}: {event['kind']} (loss {_fmt(event['loss'], '.4g')}, z-score"
            f" {_fmt(event['zscore'], '.1f')}); model, optimizer, LR schedule and plugin state restored to step"
            f" {self.snapshot_step} (rollback {self.rollbacks} of {self.max_rollbacks})."
        )

    def _check_budget(self, event: dict[str, Any]) -> None:
        if self.rollbacks < self.max_rollbacks:
            return
        raise RuntimeError(
            f"ScaleCheckpoint: {event['kind']} at step {event['step']} (loss {_fmt(event['loss'], '.4g')}, z-score"
            f" {_fmt(event['zscore'], '.1f')} vs the last {len(self.losses)} finite losses), after {self.rollbacks}"
            f" rollbacks to the snapshot of step {self.snapshot_step} (max_rollbacks={self.max_rollbacks}): training"
            " keeps diverging. Try a lower learning rate or a longer warmup, gradient clipping, PrecisionFallback or"
            " a wider precision ('bf16-mixed', '32-true'), checking the data near this step, or a larger"
            " spike_zscore / max_rollbacks."
        )

    def state_dict(self) -> dict[str, Any]:
        """Keys: ``rollbacks``, ``skips``, ``events``, ``losses`` (the recent finite losses), ``skipped_at`` (steps of
        the recent skips). Snapshots stay in memory only."""
        return {"rollbacks": self.rollbacks, "skips": self.skips, "events": copy.deepcopy(self.events),
                "losses": list(self.losses), "skipped_at": list(self._skipped_at)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        strict_keys(type(self).__name__, state_dict, set(self.state_dict()))
        self.rollbacks, self.skips = int(state_dict["rollbacks"]), int(state_dict["skips"])
        self.events = copy.deepcopy(list(state_dict["events"]))
        self.losses.clear()
        self.losses.extend(float(v) for v in state_dict["losses"])
        self._skipped_at = deque(int(v) for v in state_dict["skipped_at"])


def _guard_event(plugin: Any) -> dict[str, Any]:
    """The kind, loss and z-score of a step the plugin's SpikeGuard skipped, read now (a rare event: its host reads
    cost nothing on the steps between): the series with the larger z-score names the kind."""
    guard, loss = plugin.spike_guard, getattr(plugin, "last_loss", None)
    zscores = {"loss": float(guard.loss_zscore), "gradient-norm": float(guard.grad_norm_zscore)}
    judged = {name: z for name, z in zscores.items() if math.isfinite(z)}
    if not judged:
        return dict(kind="loss or gradient-norm spike (SpikeGuard)", loss=None, zscore=None)
    name = max(judged, key=judged.__getitem__)
    return dict(kind=f"{name} spike (SpikeGuard)", loss=None if loss is None else float(loss), zscore=judged[name])


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)

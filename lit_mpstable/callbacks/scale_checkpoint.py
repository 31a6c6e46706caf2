"""ScaleCheckpoint: a last-known-good snapshot in memory, and a rollback to it on a loss spike or bad weights."""

from __future__ import annotations

import copy
import math
from collections import deque
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit_mpstable.callbacks._common import PluginCallback, any_rank, check, is_int, is_number, log_mp, strict_keys
from lit_mpstable.callbacks._rules import spike_zscore
from lit_mpstable.callbacks._snapshot import layout_key, restore_snapshot, take_snapshot, weights_finite

__all__ = ["ScaleCheckpoint", "spike_zscore"]


class ScaleCheckpoint(PluginCallback):
    """Keeps a last-known-good snapshot in memory and rolls back to it on a loss spike or non-finite weights.

    - Every ``every_n_steps`` optimizer steps, at train start and after a precision fallback, it checks that the
      weights are finite (one host sync) and snapshots module, optimizers, LR schedulers and plugin state, cloned
      on their devices (one extra copy of weights and optimizer state in memory).
    - In ``on_before_backward`` it reads the loss (one host sync per backward): a non-finite loss, or one more
      than ``spike_zscore`` standard deviations above the last ``window`` finite losses, makes it call
      ``plugin.skip_step()`` (the batch never reaches the weights) and, at the end of the batch, restore the
      snapshot exactly; only the plugin's event counters stay as they are. Non-finite weights at a snapshot step
      roll back too. Decided alike on every rank: any rank's trigger rolls back all of them, under the same
      ``kind``; an event's ``loss`` and ``zscore`` are this rank's (each rank sees its own batch).
    - After ``max_rollbacks`` rollbacks the next one raises ``RuntimeError``. Metric: ``mp/rollbacks``.

    Lightning already stores ``plugin.state_dict()`` in every full checkpoint; ``on_save_checkpoint`` makes sure.
    One instance per run: two would undo each other's rollbacks.

    Raises:
        ValueError: an argument is out of range.
    """

    def __init__(
        self, every_n_steps: int = 50, *, spike_zscore: float = 6.0, window: int = 50, max_rollbacks: int = 3,
        min_history: int = 10,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        check(is_int(every_n_steps, 1), f"{name}(every_n_steps={every_n_steps!r})", "must be an int >= 1 (steps).")
        check(is_number(spike_zscore) and spike_zscore > 0, f"{name}(spike_zscore={spike_zscore!r})",
              "must be a number > 0 (standard deviations above the recent mean loss); 6.0 is usual.")
        check(is_int(window, 2), f"{name}(window={window!r})", "must be an int >= 2 (recent losses).")
        check(is_int(max_rollbacks, 0), f"{name}(max_rollbacks={max_rollbacks!r})", "must be an int >= 0.")
        check(is_int(min_history, 2) and min_history <= window, f"{name}(min_history={min_history!r})",
              f"must be an int in [2, window={window}] (losses needed before spikes are judged).")
        self.every_n_steps, self.spike_zscore, self.max_rollbacks = every_n_steps, spike_zscore, max_rollbacks
        self.min_history = min_history
        self.rollbacks = 0
        self.events: list[dict[str, Any]] = []
        """One dict per rollback: ``step``, ``kind``, ``loss``, ``zscore`` (None if not judged), ``restored_step``."""
        self.losses: deque[float] = deque(maxlen=window)
        self._snapshot: dict[str, Any] | None = None
        self._layout: tuple | None = None  # the precision layout at the snapshot
        self._pending: dict[str, Any] | None = None  # the rollback decided in this batch

    @property
    def snapshot_step(self) -> int | None:
        """The global step of the snapshot a rollback would restore."""
        return None if self._snapshot is None else self._snapshot["step"]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pending = None
        if self._plugin is not None:
            self._take(trainer, pl_module)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._plugin is None or self._pending is not None:
            return
        value = loss.detach().float().item() / self._plugin.loss_scale  # the hook sees the scaled loss
        z = spike_zscore(value, self.losses, self.min_history)
        finite = math.isfinite(value)
        # Any rank's trigger rolls back every rank, and all of them name the same kind (one all-reduce).
        nonfinite, spike = any_rank(trainer, [not finite, finite and z is not None and z > self.spike_zscore],
                                    pl_module.device)
        if not (nonfinite or spike):
            self.losses.append(value)
            return
        kind = "non-finite loss" if nonfinite else "loss spike"
        self._check_budget(kind, trainer.global_step, value, z)
        self._plugin.skip_step()
        self._pending = dict(step=trainer.global_step, kind=kind, loss=value, zscore=z)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._plugin is None:
            return
        step = trainer.global_step
        if self._pending is not None:  # backward is over: the weights may change now
            self._roll_back(trainer, pl_module, self._pending)
        elif step != self.snapshot_step and (step % self.every_n_steps == 0 or layout_key(self._plugin) != self._layout):
            if trainer.strategy.reduce_boolean_decision(weights_finite(pl_module), all=True):
                self._take(trainer, pl_module)
            else:
                self._check_budget("non-finite weights", step, None, None)
                self._roll_back(trainer, pl_module, dict(step=step, kind="non-finite weights", loss=None, zscore=None))
        if trainer.log_every_n_steps and step % trainer.log_every_n_steps == 0:
            log_mp(pl_module, {"mp/rollbacks": float(self.rollbacks)})

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._plugin is not None and "optimizer_states" in checkpoint:  # a full checkpoint, not weights only
            checkpoint.setdefault(type(self._plugin).__qualname__, self._plugin.state_dict())

    def _take(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._plugin is not None
        self._snapshot, self._layout = take_snapshot(trainer, pl_module, self._plugin), layout_key(self._plugin)

    def _roll_back(self, trainer: pl.Trainer, pl_module: pl.LightningModule, event: dict[str, Any]) -> None:
        assert self._plugin is not None and self._snapshot is not None
        restore_snapshot(trainer, pl_module, self._plugin, self._snapshot)
        self._pending, self.rollbacks = None, self.rollbacks + 1
        self.events.append({**event, "restored_step": self.snapshot_step})
        rank_zero_warn(
            f"ScaleCheckpoint at step {event['step']}: {event['kind']} (loss {_fmt(event['loss'], '.4g')}, z-score"
            f" {_fmt(event['zscore'], '.1f')}); the batch was skipped and model, optimizer, LR schedule and plugin"
            f" state restored to step {self.snapshot_step} (rollback {self.rollbacks} of {self.max_rollbacks})."
        )

    def _check_budget(self, kind: str, step: int, loss: float | None, z: float | None) -> None:
        if self.rollbacks < self.max_rollbacks:
            return
        raise RuntimeError(
            f"ScaleCheckpoint: {kind} at step {step} (loss {_fmt(loss, '.4g')}, z-score {_fmt(z, '.1f')} vs the last"
            f" {len(self.losses)} finite losses), after {self.rollbacks} rollbacks to the snapshot of step"
            f" {self.snapshot_step} (max_rollbacks={self.max_rollbacks}): training keeps diverging. Try a lower"
            " learning rate or a longer warmup, gradient clipping, PrecisionFallback or a wider precision"
            " ('bf16-mixed', '32-true'), checking the data near this step, or a larger spike_zscore / max_rollbacks."
        )

    def state_dict(self) -> dict[str, Any]:
        """Keys: ``rollbacks``, ``events``, ``losses`` (the recent finite losses). Snapshots stay in memory only."""
        return {"rollbacks": self.rollbacks, "events": copy.deepcopy(self.events), "losses": list(self.losses)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        strict_keys(type(self).__name__, state_dict, set(self.state_dict()))
        self.rollbacks, self.events = int(state_dict["rollbacks"]), copy.deepcopy(list(state_dict["events"]))
        self.losses.clear()
        self.losses.extend(float(v) for v in state_dict["losses"])


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)

"""What the callbacks read from a ``DeepSpeedStrategy`` run: DeepSpeed owns the loss scaler, the FP32 masters and
the step, so its engine is read, never driven.

DeepSpeed's engine counts the steps its optimizer refused (``engine.skipped_steps``, raised when the optimizer's
``overflow`` flag is set after ``step()``), says whether the last step changed the weights
(``engine.was_step_applied()``), and its FP16 optimizers (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``, ZeRO's) keep
the current loss scale as ``optimizer.loss_scale`` (the loss scaler's ``cur_scale``). BF16 runs have no scale
(1.0), but still skip a step whose gradient norm is inf/NaN, without a word (DeepSpeed#8415): counted here alike.
Every read is a host value the engine already holds: no sync.
"""

from __future__ import annotations

from typing import Any

import torch

from lit_mpstable.callbacks._foreign import ForeignPrecision
from lit_mpstable.frontends.live_state import Findings


def runs_deepspeed(trainer: Any) -> bool:
    """Whether ``trainer`` runs Lightning's ``DeepSpeedStrategy`` (Ray's subclass included), without importing
    DeepSpeed."""
    return any(cls.__name__ == "DeepSpeedStrategy" for cls in type(getattr(trainer, "strategy", None)).__mro__)


class DeepSpeedView(ForeignPrecision):
    """``StablePrecision``'s live state, read from a DeepSpeed engine (``trainer.strategy.model``).

    ``OverflowMonitor`` logs ``mp/loss_scale`` (the FP16 optimizer's current scale; 1.0 in BF16) and
    ``mp/skipped_steps`` (every step DeepSpeed skipped, FP16 overflow or BF16 inf/NaN norm). ``ScaleCheckpoint``
    snapshots the module and DeepSpeed's optimizer state (its FP32 masters and loss scaler included) and rolls
    back under ZeRO stage 0; under ZeRO stages 1-3 each rank's optimizer state is a partition that only DeepSpeed's
    own checkpoints restore, so a snapshot is refused there with the alternative. Skipping one batch and fallbacks
    need StablePrecision (``can_skip`` / ``can_fallback`` False).
    """

    def __init__(self, plugin: Any, trainer: Any) -> None:  # no ForeignPrecision step hooks: the engine counts
        self.plugin, self._trainer = plugin, trainer
        self.precision = str(getattr(plugin, "precision", "32-true"))
        self.engine = trainer.strategy.model
        optimizer = getattr(self.engine, "optimizer", None)
        # DeepSpeed checks gradients for inf/NaN where its optimizer carries an ``overflow`` flag (FP16 and BF16).
        self.scaler = optimizer if hasattr(optimizer, "overflow") else None
        self.stats: dict[str, Any] = {}
        self.findings = Findings()
        self.islands = type("NoIslands", (), {"names": []})()
        self.input_nonfinite = None
        self.fallback_active = False
        self._start = trainer.global_step
        self._start_skipped = int(getattr(self.engine, "skipped_steps", 0))
        self._handles = ["deepspeed: the engine counts, no hooks"]  # live until remove(), as the base's are

    def remove(self) -> None:
        self._handles.clear()

    @property
    def dtype(self) -> torch.dtype:
        if self._enabled("fp16_enabled"):
            return torch.float16
        if self._enabled("bfloat16_enabled"):
            return torch.bfloat16
        return super().dtype

    def _enabled(self, name: str) -> bool:
        method = getattr(self.engine, name, None)
        return bool(method()) if callable(method) else False

    @property
    def loss_scale(self) -> float:
        """The FP16 optimizer's current loss scale; 1.0 in BF16 or FP32 (no scaling)."""
        optimizer = getattr(self.engine, "optimizer", None)
        for name in ("loss_scale", "cur_scale"):
            value = getattr(optimizer, name, None)
            if isinstance(value, (int, float, torch.Tensor)) and not isinstance(value, bool):
                return float(value)
        return 1.0

    hook_loss_scale = 1.0
    """The scale of the loss ``on_before_backward`` sees: none, DeepSpeed scales it inside ``engine.backward``
    (ScaleCheckpoint divides by this, not by :attr:`loss_scale`, or a halved scale would look like a spike)."""

    @property
    def skipped_steps(self) -> int:
        return int(getattr(self.engine, "skipped_steps", 0)) - self._start_skipped

    @property
    def last_step_skipped(self) -> bool:
        applied = getattr(self.engine, "was_step_applied", None)
        return callable(applied) and self.step_count > 0 and not applied()

    @property
    def zero_stage(self) -> int:
        stage = getattr(self.engine, "zero_optimization_stage", None)
        return int(stage()) if callable(stage) else 0

    def state_dict(self) -> dict[str, Any]:
        """The engine's counters; DeepSpeed's optimizer state (masters, scaler) rides in the snapshot's optimizer
        entry (``trainer.optimizers`` is DeepSpeed's optimizer)."""
        if self.zero_stage > 0:
            raise ValueError(
                f"ScaleCheckpoint with DeepSpeed ZeRO stage {self.zero_stage}: each rank's optimizer state is a"
                " partition of the FP32 masters that only DeepSpeed's own checkpoints restore, so no in-memory"
                " snapshot can be rolled back to. Use ZeRO stage 0 (DeepSpeedStrategy(stage=0)) for rollbacks, or"
                " drop ScaleCheckpoint (OverflowMonitor still logs the scale and every skipped step)."
            )
        return {"global_steps": int(getattr(self.engine, "global_steps", 0))}

    def restore_state(self, state: dict[str, Any]) -> None:
        """A rollback: the optimizer entry restores DeepSpeed's masters and scaler; the engine's step counters stay
        (history, as StablePrecision's event counters do)."""

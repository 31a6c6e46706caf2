"""The run's event counters, in one place: steps taken or skipped, overflows, skips, applied steps per optimizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.optim import Optimizer

# The scaler's own event counters (what it saw: its steps, overflows, hits of the scale floor). The scaler owns them
# and counts them itself (it runs without a stepper too); they are history like the run's, so a rollback that restores
# the scaler's numeric state keeps their live values (see RunCounters.keep_live_).
SCALER_COUNTERS = ("overflow_count", "step_count", "min_scale_hits")


@dataclass
class RunCounters:
    """The run's history, owned here and read by everyone else (the stepper's properties are views of it). A rollback
    keeps it (it undoes the weights, not the history); a resume restores it."""

    step_count: int = 0
    """Optimizer steps taken or skipped (one per optimizer per iteration)."""
    overflow_count: int = 0
    """Steps skipped because their gradients held inf/NaN."""
    skipped_steps: int = 0
    """Steps not applied: overflows plus steps discarded by ``skip_step``."""
    last_step_skipped: bool = False
    applied_by: dict[int, int] = field(default_factory=dict)
    """Applied steps per optimizer (by id, in this process), for the LR hold; not part of the state."""

    def record(self, *, skipped: bool, overflow: bool, optimizer: Optimizer | None = None) -> None:
        """Count one step of ``optimizer`` (None: a step no optimizer is known for)."""
        self.last_step_skipped = skipped
        self.step_count += 1
        self.skipped_steps += int(skipped)
        self.overflow_count += int(overflow)
        if optimizer is not None and not skipped:
            self.applied_by[id(optimizer)] = self.applied_by.get(id(optimizer), 0) + 1

    def applied(self, optimizer: Optimizer | None = None) -> int:
        """Steps applied (not skipped), of ``optimizer`` alone if given (seen through a front end's wrapper)."""
        if optimizer is None:
            return self.step_count - self.skipped_steps
        for _ in range(3):  # a front end's wrapper (Fabric's, Lightning's) around the optimizer that steps
            inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
            if not isinstance(inner, Optimizer) or inner is optimizer:
                break
            optimizer = inner
        return self.applied_by.get(id(optimizer), 0)

    def state_dict(self) -> dict[str, Any]:
        """``step_count``, ``overflow_count``, ``last_step_skipped``, ``skipped_steps`` (plain Python values)."""
        return {"step_count": self.step_count, "overflow_count": self.overflow_count,
                "last_step_skipped": self.last_step_skipped, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count, self.overflow_count = int(state["step_count"]), int(state["overflow_count"])
        self.skipped_steps, self.last_step_skipped = int(state["skipped_steps"]), bool(state["last_step_skipped"])

    @staticmethod
    def view(name: str, doc: str | None = None) -> property:
        """A property of an owner's ``counters.<name>``: the stepper shows the counters, this object owns them."""
        return property(lambda owner: getattr(owner.counters, name),
                        lambda owner, value: setattr(owner.counters, name, value), doc=doc)

    @staticmethod
    def keep_live_(saved: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
        """A scaler's saved state with its event counters at their ``live`` values (a rollback keeps history)."""
        return {**saved, **{k: live[k] for k in SCALER_COUNTERS if k in live and k in saved}}

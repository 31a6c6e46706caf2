"""GrowthMonitor's checkpoint: what :meth:`~lit_mpstable.core.guards.growth.GrowthMonitor.state_dict` saves and
:meth:`~lit_mpstable.core.guards.growth.GrowthMonitor.load_state_dict` restores (checked before, by ``check_state``).
``monitor`` is typed loosely: growth imports this module, not the reverse."""

from __future__ import annotations

from typing import Any


def saved_state(monitor: Any) -> dict[str, Any]:
    """The monitor's state: plain values and tensors (a state loaded before ``attach`` is returned as it waits)."""
    if monitor._pending is not None:
        return monitor._pending
    monitor._flush()
    return {"steps": monitor.steps, "samples": monitor.samples, "sampled": sorted(monitor._sampled), "layers": {
        name: {"rows": None if h.rows is None else h.rows.clone(), "steps": list(h.steps), "next": h.next}
        for name, h in monitor._history.items()}}


def restore_state(monitor: Any, state: dict[str, Any]) -> None:
    """Put a checked ``state`` into the monitor, or keep it until ``attach`` when no layer is attached yet."""
    monitor._flush()  # this step's samples go into the slots the state replaces
    if not monitor._history:
        monitor._pending = {**state, "layers": dict(state["layers"]), "sampled": list(state["sampled"])}
        return
    monitor.steps, monitor.samples = int(state["steps"]), int(state["samples"])
    monitor._sampled = set(state["sampled"])
    for name, saved in state["layers"].items():
        history = monitor._history[name]
        history.rows = None if saved["rows"] is None else saved["rows"].detach().float().clone()
        history.steps, history.next = list(saved["steps"]), int(saved["next"])
    monitor._rows = monitor._slopes = None  # placed again, and fitted, when next read or written

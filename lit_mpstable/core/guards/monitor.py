"""Step monitors: the per-step checks (the step-input check, the non-finite check, SpikeGuard's statistics, growth
sampling) as one protocol the stepper loops over, fed by one multi-tensor pass over the gradients.

:func:`grad_pass` computes, once per step and on the device, what every monitor needs from the gradients: their global
L2 norm (one ``torch._foreach_norm`` over all of them) and whether they are all finite (read off the same norms: a
norm is finite exactly when its tensor is). :class:`MonitorSet` feeds that pass to each monitor and folds their skip
votes into one device flag, so the step makes its one host read (the skip decision) for all of them together.

The stepper adopting this (replacing its separate checks) is the house issue's step work; this module is the protocol
and the shared pass, pure torch, no host read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class GradPass:
    """What one pass over a step's gradients found, on the device (0-dim tensors, never read here).

    Attributes:
        norm: the global L2 norm of the gradients (FP32); inf/NaN when any gradient holds inf/NaN.
        finite: whether every gradient is finite (bool).
        count: how many gradient tensors the pass read (a host int: no device value).
    """

    norm: torch.Tensor
    finite: torch.Tensor
    count: int


def grad_pass(grads: Sequence[torch.Tensor], *, scale: torch.Tensor | float | None = None) -> GradPass:
    """One multi-tensor pass over ``grads``: their global L2 norm, divided by ``scale`` (the loss scale, to unscale
    the norm without touching the gradients), and the finite flag. No host read.

    Raises:
        ValueError: ``grads`` holds something that is not a floating-point tensor (names its index and type).
    """
    for index, grad in enumerate(grads):
        if not isinstance(grad, torch.Tensor) or not grad.is_floating_point():
            raise ValueError(f"grad_pass(grads=[..., {type(grad).__name__} at {index}, ...]): each must be a"
                             " floating-point tensor (a parameter's gradient).")
    if not grads:
        zero = torch.zeros((), dtype=torch.float32)
        return GradPass(norm=zero, finite=torch.ones((), dtype=torch.bool), count=0)
    device = grads[0].device
    norms = torch._foreach_norm(list(grads), 2, dtype=torch.float32)  # one fused kernel per device and dtype, FP32
    norm = torch.linalg.vector_norm(torch.stack([n.float().to(device) for n in norms]), 2)
    if scale is not None:
        norm = norm / scale
    return GradPass(norm=norm, finite=torch.isfinite(norm), count=len(grads))


@runtime_checkable
class StepMonitor(Protocol):
    """A per-step check the stepper loops over. Every method is called on every rank at the same point; none reads a
    device value on a clean step (their votes are folded on the device and read once, in the skip decision)."""

    def on_unscaled(self, grads: Sequence[torch.Tensor], grad_pass: GradPass) -> None:
        """The step's gradients, unscaled, and the one pass over them (shared by every monitor)."""

    def vote_skip(self) -> torch.Tensor | None:
        """This monitor's vote to skip the step: a 0-dim bool tensor on the device, or None (no opinion)."""

    def on_step_end(self, skipped: bool) -> None:
        """The step was applied or skipped (``skipped``: the one host read of the step, already made)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class MonitorSet:
    """The step's monitors, fed one :func:`grad_pass` and asked for one folded vote.

    Args:
        monitors: objects satisfying :class:`StepMonitor` (checked once, here).

    Raises:
        ValueError: a monitor that lacks a method of the protocol (names it and what is missing).
    """

    def __init__(self, monitors: Sequence[Any]) -> None:
        for monitor in monitors:
            if not isinstance(monitor, StepMonitor):
                missing = [m for m in ("on_unscaled", "vote_skip", "on_step_end", "state_dict", "load_state_dict")
                           if not callable(getattr(monitor, m, None))]
                raise ValueError(f"MonitorSet(monitors=[..., {monitor!r}, ...]): not a StepMonitor (missing"
                                 f" {missing}).")
        self.monitors = list(monitors)

    def on_unscaled(self, grads: Sequence[torch.Tensor], *, scale: torch.Tensor | float | None = None) -> GradPass:
        """One pass over ``grads`` (see :func:`grad_pass`), handed to every monitor; returns it."""
        shared = grad_pass(grads, scale=scale)
        for monitor in self.monitors:
            monitor.on_unscaled(grads, shared)
        return shared

    def vote_skip(self, found: torch.Tensor | None = None) -> torch.Tensor | None:
        """Every monitor's vote OR-ed with ``found`` (e.g. the pass's ``~finite``) into one 0-dim bool on the device;
        None when nobody votes."""
        votes = [v for v in (found, *(m.vote_skip() for m in self.monitors)) if v is not None]
        if not votes:
            return None
        flag = votes[0].reshape(()).bool()
        for vote in votes[1:]:
            flag = flag | vote.reshape(()).bool().to(flag.device)
        return flag

    def on_step_end(self, skipped: bool) -> None:
        for monitor in self.monitors:
            monitor.on_step_end(skipped)

    def state_dict(self) -> dict[str, Any]:
        """Keys: ``monitors`` (each monitor's state, in order)."""
        return {"monitors": [m.state_dict() for m in self.monitors]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["monitors"]
        if len(saved) != len(self.monitors):
            raise ValueError(f"MonitorSet.load_state_dict: {len(saved)} monitor states for {len(self.monitors)}"
                             " monitors.")
        for monitor, one in zip(self.monitors, saved):
            monitor.load_state_dict(one)

"""The StepMonitor protocol and its one shared pass over the gradients (lit_mpstable/core/guards/monitor.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import HostReads

from lit_mpstable.core.guards.monitor import MonitorSet, StepMonitor, grad_pass


class Votes:
    """A monitor that votes to skip when the shared norm passes ``limit``; records what it was fed."""

    def __init__(self, limit: float) -> None:
        self.limit, self.seen, self.ends = limit, [], []
        self._vote: torch.Tensor | None = None

    def on_unscaled(self, grads, grad_pass) -> None:
        self.seen.append(grad_pass)
        self._vote = grad_pass.norm > self.limit

    def vote_skip(self):
        return self._vote

    def on_step_end(self, skipped: bool) -> None:
        self.ends.append(skipped)

    def state_dict(self):
        return {"limit": self.limit}

    def load_state_dict(self, state) -> None:
        self.limit = state["limit"]


def test_one_pass_gives_every_monitor_the_same_norm_and_flag_without_a_host_read():
    grads = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2, dtype=torch.bfloat16)]
    low, high = Votes(0.1), Votes(1e6)
    monitors = MonitorSet([low, high])
    with HostReads() as seen:
        shared = monitors.on_unscaled(grads, scale=4.0)
        flag = monitors.vote_skip(~shared.finite)
    assert seen.ops == []
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])) / 4.0
    torch.testing.assert_close(shared.norm, expected)
    assert low.seen == [shared] and high.seen == [shared] and shared.count == 3
    assert bool(flag) and bool(shared.finite)  # low voted to skip: the folded flag says skip
    monitors.on_step_end(True)
    assert low.ends == high.ends == [True]


def test_a_nonfinite_gradient_shows_in_the_shared_flag():
    shared = grad_pass([torch.ones(3), torch.tensor([1.0, float("nan")])])
    assert not bool(shared.finite)
    assert bool(MonitorSet([]).vote_skip(~shared.finite)) and MonitorSet([]).vote_skip() is None


def test_state_round_trips_and_bad_monitors_or_grads_are_refused():
    monitors = MonitorSet([Votes(1.0), Votes(2.0)])
    other = MonitorSet([Votes(0.0), Votes(0.0)])
    other.load_state_dict(monitors.state_dict())
    assert [m.limit for m in other.monitors] == [1.0, 2.0]
    assert isinstance(Votes(1.0), StepMonitor)
    with pytest.raises(ValueError, match=r"MonitorSet\(monitors=\[.*not a StepMonitor \(missing \['on_unscaled'"):
        MonitorSet([object()])
    with pytest.raises(ValueError, match=r"grad_pass\(grads=\[\.\.\., Tensor at 1"):
        grad_pass([torch.ones(2), torch.ones(2, dtype=torch.int64)])
    with pytest.raises(ValueError, match="2 monitor states for 1 monitors"):
        MonitorSet([Votes(1.0)]).load_state_dict(monitors.state_dict())

"""SpikeGuard's per-step cost on its torch path, counted in tensor operations (what a step pays on the CPU is ~10 us
per small op, and a launch each on a GPU), and the edge cases its compact statistics must keep: a warmup longer than
the window, unreached slots saved as zeros, the caller's loss tensor left untouched."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import OpNames as _Ops

from lit_mpstable.core.guards.spike import SpikeGuard


@pytest.fixture(autouse=True)
def torch_path(monkeypatch) -> None:
    # The counts are those of the torch path (a GPU's, a compiled step's): the guards here keep it from the start, as
    # an op counter (a TorchDispatchMode) would make them take it anyway. The C loops: tests/core/test_spike_native.py.
    monkeypatch.setenv("LIT_MPSTABLE_NATIVE", "0")


def _warm(guard: SpikeGuard, steps: int = 40) -> SpikeGuard:
    g = torch.Generator().manual_seed(0)
    for i in range(steps):
        guard.observe_loss_(torch.tensor(2.0 + 0.1 * torch.randn((), generator=g).item()))
        guard.decide(torch.tensor(1.0 + 0.1 * i / steps))
        guard.clip_threshold()
        guard.commit_(False)
    return guard


def _step_ops(guard: SpikeGuard) -> list[str]:
    loss, norm = torch.tensor(2.0), torch.tensor(1.05)
    with _Ops() as ops:
        guard.observe_loss_(loss)
        guard.decide(norm)
        guard.clip_threshold()
        guard.commit_(False)  # the stepper's flag, read on the host already
    return ops.names


def test_a_step_is_a_short_run_of_small_ops():
    # Was 64 ops per step (the masked statistics, isfinite's five kernels, copies into fixed buffers), 106 with ZClip
    # (clip_threshold() computed the statistics a second time); each costs ~10 us after a backward on the CPU.
    # Then 29 and 45 (ZClip's threshold a second maximum, clamp, select... of its own, and Python numbers as operands:
    # a scalar op costs ~2x a tensor one here). Now 27 and 34: the window's statistics once per fold, both floors in
    # one maximum, the divisors and the warmup's gates in one look-up by the window's size, every constant a tensor.
    plain = _step_ops(_warm(SpikeGuard()))
    zclip = _step_ops(_warm(SpikeGuard(clip_zscore=2.5)))
    assert len(plain) <= 27, (len(plain), plain)
    assert len(zclip) <= 34, (len(zclip), zclip)
    assert "aten.isfinite.default" not in plain and not any("_local_scalar_dense" in name for name in plain + zclip)
    assert not [name for name in plain + zclip if name.endswith(".Scalar")], "a Python number as an operand"


def test_the_statistics_are_made_once_per_fold():
    # A decide() that finds the window as the last one left it (a second optimizer's, or the step after a skip) only
    # judges the new values: ~8 ops, not the statistics' ~16 again.
    for guard in (_warm(SpikeGuard()), _warm(SpikeGuard(clip_zscore=2.5))):
        loss, norm = torch.tensor(2.0), torch.tensor(1.05)
        guard.observe_loss_(loss)
        first = guard.decide(norm)
        z = torch.stack([guard.loss_zscore, guard.grad_norm_zscore])
        guard.commit_(True, spiked=first)  # skipped: nothing folded
        with _Ops() as ops:
            guard.observe_loss_(loss)
            again = guard.decide(norm)
            guard.clip_threshold()
        assert len(ops.names) <= 8, ops.names
        assert torch.equal(again, first) and torch.equal(torch.stack([guard.loss_zscore, guard.grad_norm_zscore]), z)


def test_warmup_longer_than_the_window_still_judges():
    # The window holds 4 values, the warmup asks for 10 applied ones: judging starts at the 11th value, not never.
    guard = SpikeGuard(window=4, warmup=10, clip_zscore=2.5)
    flags, thresholds = [], []
    for i in range(14):
        norm = torch.tensor(100.0 if i in (5, 12) else 1.0 + 0.01 * (i % 3))
        guard.observe_loss_(torch.tensor(2.0))
        flags.append(bool(guard.decide(norm)))
        thresholds.append(float(guard.clip_threshold()))
        guard.commit_(flags[-1])
    assert flags[5] is False and flags[12] is True  # step 5: 5 values seen, under the warmup
    assert all(math.isinf(t) for t in thresholds[:10]) and all(math.isfinite(t) for t in thresholds[10:])


def test_unreached_slots_are_saved_as_zeros_and_resume_exactly():
    guard = SpikeGuard(window=8, warmup=2)
    for i in range(3):
        guard.observe_loss_(torch.tensor(2.0 + i))
        guard.decide(torch.tensor(1.0 + i))
        guard.commit_(False)
    state = guard.state_dict()
    assert torch.equal(state["loss"], torch.tensor([2.0, 3.0, 4.0, 0, 0, 0, 0, 0]))
    assert torch.isfinite(state["grad_norm"]).all() and int(state["grad_norm_count"]) == 3
    twin = SpikeGuard(window=8, warmup=2)
    twin.load_state_dict(state)
    for g in (guard, twin):
        g.observe_loss_(torch.tensor(2.5))
        g.decide(torch.tensor(1.5))
    # Zeros in the unreached slots would pull the mean down: the restored guard must judge exactly as the original.
    assert torch.equal(guard.loss_zscore, twin.loss_zscore) and torch.equal(guard.grad_norm_zscore,
                                                                            twin.grad_norm_zscore)
    assert guard.loss_zscore.item() == (2.5 - 3.0) / 1.0  # [2, 3, 4]: mean 3, unbiased std 1


def test_the_callers_loss_is_never_written():
    guard = _warm(SpikeGuard())
    first, second = torch.tensor(1.25), torch.tensor(0.5)
    guard.observe_loss_(first)
    guard.observe_loss_(second)  # micro-batches add up, into a new tensor
    guard.decide(torch.tensor(1.0))
    guard.commit_(False)
    assert first.item() == 1.25 and second.item() == 0.5

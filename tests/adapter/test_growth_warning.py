"""StablePrecision(growth_every_n_steps=10) in FP8 through the Trainer: a SwiGLU block whose gate and up rows are driven
into alignment (Smooth-SwiGLU's mechanism, as in tests/core/test_growth.py, grown faster so the run reaches a real
non-finite step in a few hundred steps) is named by OverflowMonitor >= 50 steps before its first non-finite loss;
PrecisionFallback(on_growth=True) moves that layer alone out of FP8; a clean run raises nothing.

``mode="dead_channel"`` (the fallback's end-loss task, ``experiments/growth_fallback.py``): hidden unit 0 grows as in
the alignment mode into a massive activation (Sun et al. 2024) until it is ``cap`` times every other unit's amax,
and its column of ``mlp.down`` is pinned to zero (from the start): the output does not depend on unit 0 in exact
arithmetic or in BF16, while FP8's per-tensor scale of ``mlp.down``'s input (448 / amax) flushes every other unit.
The task is :mod:`lit_mpstable.app.growth_demo`'s."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lit_mpstable.app.growth_demo import GrowthTask
from lit_mpstable.app.growth_demo import run_growth_task as _run  # the task lives in the package (experiments/ run it)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2))
def test_growth_warned_50_steps_before_the_first_nonfinite_step(seed: int) -> None:
    module, plugin, growth, _ = _run(seed, grow=True, steps=400)
    assert module.first_nonfinite is not None, "the injected growth must reach a non-finite loss"
    assert growth, "no growth warning"
    first = growth[0][0]
    assert module.first_nonfinite - first >= 50, (first, module.first_nonfinite)
    assert "'mlp.down'" in growth[0][1] and "'out'" not in growth[0][1]
    assert plugin.runaway_layers() and set(plugin.stats["growth"]) >= {"inp", "mlp.gate", "mlp.up", "mlp.down", "out"}


@pytest.mark.slow
def test_fallback_on_growth_moves_only_the_runaway_layers() -> None:
    module, plugin, _, callbacks = _run(0, grow=True, steps=200, fallback=True)
    fallback = callbacks[1]
    moved = [d["modules"] for d in fallback.decisions if d["action"] == "fallback"]
    assert moved and moved[0] == ["mlp.down"], fallback.decisions  # its input's kurtosis, from step 91
    # Later the gate and up rows, grown 1e5x, make their own FP8 weight casts flush the rest of their weights.
    assert moved[1:] == [["mlp.gate", "mlp.up"]], fallback.decisions
    assert plugin.stats["growth"]["mlp.gate"]["weight_underflow"] > 0.05  # as last read, at step 160
    fp8 = {n for n, m in module.named_modules() if type(m).__name__ == "FP8Linear"}
    assert fp8 == set()  # the first and last layers never were FP8


@pytest.mark.slow
def test_clean_run_raises_no_alarm() -> None:
    module, plugin, growth, _ = _run(0, grow=False, steps=300)
    assert module.first_nonfinite is None and growth == [] and plugin.runaway_layers() == []
    assert set(plugin.stats["growth"]) == {"inp", "mlp.gate", "mlp.up", "mlp.down", "out"}


def test_growth_task_rejects_an_unknown_mode_and_a_cap_bf16_cannot_hold() -> None:
    with pytest.raises(ValueError, match=r"mode='dead'.*allowed"):
        GrowthTask(0, grow=True, mode="dead")
    with pytest.raises(ValueError, match=r"cap=1e\+40"):
        GrowthTask(0, grow=True, mode="dead_channel", cap=1e40)


@pytest.mark.slow
def test_dead_channel_fallback_moves_only_mlp_down_and_ends_near_bf16() -> None:
    """The dead massive-activation unit: BF16 does not see it (bit for bit the clean run), FP8 loses mlp.down's input
    to E4M3's flush, and the fallback, moving mlp.down alone out of FP8, ends closer to BF16 than FP8 alone."""
    steps = 200  # the growth saturates near step 160; FP8 has lost mlp.down's other units from ~step 140

    def end_loss(module: GrowthTask) -> float:
        with torch.no_grad():
            return nn.functional.mse_loss(module.float()(module.x), module.y).item()

    bf16, _, _, _ = _run(0, grow=True, steps=steps, recipe=None, mode="dead_channel")
    clean, _, _, _ = _run(0, grow=False, steps=steps, recipe=None, mode="dead_channel")
    fp8, _, _, _ = _run(0, grow=True, steps=steps, mode="dead_channel")
    fallback_run, _, _, callbacks = _run(0, grow=True, steps=steps, fallback=True, mode="dead_channel")
    assert bf16.saturated_at is not None and bf16.unit_ratio() > 1e7  # the unit did grow
    assert bf16.losses == clean.losses  # BF16 never sees unit 0
    moved = [d["modules"] for d in callbacks[1].decisions if d["action"] == "fallback"]
    assert moved == [["mlp.down"]], callbacks[1].decisions
    fp8_layers = {n for n, m in fallback_run.named_modules() if type(m).__name__ == "FP8Linear"}
    assert fp8_layers == {"mlp.gate", "mlp.up"}
    reference = end_loss(bf16)
    assert abs(end_loss(fallback_run) / reference - 1) < 0.1 < end_loss(fp8) / reference - 1

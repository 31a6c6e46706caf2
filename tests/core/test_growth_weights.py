"""GrowthMonitor names an FP8 layer whose own weight cast flushes most of the weight: a weight row grown far beyond
the others (a massive activation made in the weights) sets the per-tensor scale, and E4M3 flushes the rest of the
matrix to zero, with no NaN and nothing unusual in the layer's input. Before, only the activations were watched, and
such a layer stayed in FP8 while its output lost every other row."""

from __future__ import annotations

import pytest
import torch
from helpers import HostReads
from test_growth_scale import _Net, _step, _stepper

from lit_mpstable.core.guards.growth_stats import WEIGHT_FLUSH_LIMIT
from lit_mpstable.fp8 import FP8Config
from lit_mpstable.fp8.linear import FP8Linear


def _layer(recipe: str) -> FP8Linear:
    torch.manual_seed(0)
    return FP8Linear(64, 64, config=FP8Config(recipe=recipe))


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_a_clean_weight_flushes_nothing_and_a_grown_row_flushes_the_rest(recipe: str) -> None:
    layer = _layer(recipe)
    layer(torch.randn(8, 64))  # delayed: the weight's scale from its amax (at the initial scale 1, ~1% flushes)
    assert float(layer.growth_weight_flush()) == 0.0
    with torch.no_grad():
        layer.weight[0] *= 1e6
        if recipe == "delayed":  # the amax history has caught up with the row: the scale it casts with
            layer.scale[1] = 448.0 / layer.weight.abs().amax()
    flushed = float(layer.growth_weight_flush())
    assert flushed > 0.95  # every row but the grown one is under E4M3's smallest subnormal at that scale


def test_delayed_scaling_reads_the_scale_its_next_forward_casts_with() -> None:
    layer = _layer("delayed")
    with torch.no_grad():
        layer.scale[1] = 1e-4  # weights of ~0.1 scaled to 1e-5: under E4M3's 2**-9
    assert float(layer.growth_weight_flush()) > 0.99
    with torch.no_grad():
        layer.weight.zero_()
    assert float(layer.growth_weight_flush()) == 0.0  # zeros are not flushed values


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_block_recipes_confine_an_outlier_to_its_block_and_report_none(recipe: str) -> None:
    assert _layer(recipe).growth_weight_flush() is None


def test_the_monitor_names_the_layer_only_once_its_weight_flushes_and_reads_once() -> None:
    stepper, model, opt = _stepper("current")
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    _step(stepper, model, opt, x)
    growth = stepper.growth
    clean = growth.stats()
    assert clean["a"]["weight_underflow"] == clean["b"]["weight_underflow"] == 0.0
    assert growth.runaway(stats=clean) == []
    with torch.no_grad():
        model.b.weight[0] *= 1e6  # b's input is unchanged: only its weight says anything
    opt.param_groups[0]["lr"] = 0.0  # the grown row stays as it is while the steps pass
    _step(stepper, model, opt, x)
    assert growth.stats()["b"]["weight_underflow"] == 0.0  # refreshed once per window x n steps (8 here)
    for _ in range(growth.window * growth.every_n_steps - 1):
        _step(stepper, model, opt, x)
    with HostReads() as reads:
        stats = growth.stats()
    assert len(reads.ops) == 1  # the ring buffer and the weight fractions in one read
    assert stats["b"]["weight_underflow"] > 1 - 1 / 16 - 0.01 > WEIGHT_FLUSH_LIMIT  # all but row 0
    assert stats["b"]["kurtosis"] < 100 and stats["a"]["weight_underflow"] == 0.0
    assert growth.runaway(stats=stats) == ["b"]


def test_a_plain_linear_layer_reports_no_weight_fraction() -> None:
    from lit_mpstable.core.guards.growth import GrowthMonitor

    model = _Net()
    monitor = GrowthMonitor(every_n_steps=1, window=3).attach(model)
    model(torch.randn(4, 16))
    assert all("weight_underflow" not in row for row in monitor.stats().values())


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_the_counted_fraction_is_the_fp8_casts_own_count(fmt: str) -> None:
    # Counted without casting (float arithmetic is several times faster on a CPU): it must agree with the cast on
    # weights spread over many decades, zeros among them.
    from lit_mpstable.fp8.quant import compute_scale, quantize

    torch.manual_seed(0)
    for trial in range(12):
        layer = FP8Linear(128, 128, config=FP8Config(recipe="current", format=fmt))
        with torch.no_grad():
            layer.weight.mul_(torch.exp(torch.randn(128, 128) * 3))
            layer.weight[0] *= 10.0**trial
            layer.weight[1, :8] = 0
        w, dtype = layer.weight.detach().clone(), layer._dtype(1)
        scale = compute_scale(w.abs().amax().float(), dtype)
        cast = ((quantize(w, scale, dtype).float() == 0) & (w != 0)).sum() / (w != 0).sum()
        assert float(layer.growth_weight_flush()) == float(cast), trial


def test_nan_and_inf_are_not_flushed_values() -> None:
    layer = FP8Linear(4, 1, config=FP8Config(recipe="delayed"))  # its scale buffer starts at 1
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[float("nan"), float("inf"), 1e-4, 0.0]]))
    # 1e-4 flushes (under 2**-10); NaN and inf stay themselves
    assert float(layer.growth_weight_flush()) == pytest.approx(1 / 3)

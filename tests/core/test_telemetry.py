"""Gradient telemetry: fractions against hand-computed edge cases, per-module grouping, no host sync."""

from __future__ import annotations

import importlib
import math
import sys

import pytest
import torch
from helpers import HostReads, TinyMLP, regression_data
from torch import nn

from lit_mpstable.core.formats import FORMATS, overflow_fraction, underflow_fraction
from lit_mpstable.core.telemetry import DEFAULT_FORMATS, GradStats, GradTelemetry, grad_stats
from lit_mpstable.core.tensors import amax_per_tensor

INF, NAN = float("inf"), float("nan")


def _after(value: float) -> float:
    """The next float32 above ``value`` (one ulp up)."""
    return torch.nextafter(torch.tensor(value), torch.tensor(INF)).item()


def edge_cases(name: str) -> dict[str, float]:
    fmt = FORMATS[name]
    return {
        "largest normal": fmt.max,  # fits
        "max + 1 ulp": _after(fmt.max),  # overflows
        "smallest subnormal": fmt.smallest_subnormal,  # survives
        "half smallest subnormal": fmt.smallest_subnormal / 2,  # flushes to zero (ties to even)
        "just above half": _after(fmt.smallest_subnormal / 2),  # rounds up to the smallest subnormal
        "one": 1.0,
        "zero": 0.0,  # not counted
        "inf": INF,  # nonzero, overflows
        "nan": NAN,  # not counted
    }


def _params(*tensors: torch.Tensor, names: tuple[str, ...] = ()) -> list[tuple[str, nn.Parameter]]:
    pairs = []
    for i, values in enumerate(tensors):
        param = nn.Parameter(torch.zeros_like(values))
        param.grad = values.clone()
        pairs.append((names[i] if names else f"p{i}", param))
    return pairs


@pytest.mark.parametrize("name", DEFAULT_FORMATS)
def test_fractions_on_named_edge_cases(name):
    # 7 counted elements (all but zero and nan): 1 flushes (half smallest subnormal), 2 overflow (max + 1 ulp, inf).
    values = torch.tensor(list(edge_cases(name).values()))
    stats = grad_stats(_params(values), formats=[name])
    assert stats.underflow_frac[name].item() == pytest.approx(1 / 7)
    assert stats.overflow_frac[name].item() == pytest.approx(2 / 7)
    assert math.isnan(stats.amax.item()) and math.isnan(stats.norm.item())


@pytest.mark.parametrize("scale", [2.0**10, 2.0**-7, torch.tensor(2.0**10)])
def test_scale_applies_before_the_cast(scale):
    # The same edge cases divided by the scale give the same fractions once multiplied back.
    cases = edge_cases("fp16")
    del cases["inf"], cases["nan"]
    values = torch.tensor(list(cases.values())) / float(scale)
    stats = grad_stats(_params(values), scale=scale, formats=["fp16", "fp8_e4m3"])
    assert stats.underflow_frac["fp16"].item() == pytest.approx(1 / 6)
    assert stats.overflow_frac["fp16"].item() == pytest.approx(1 / 6)
    # FP8 E4M3 (max 448, smallest subnormal 2**-9): the three values near 2**-25 flush, 65504 and above overflow.
    assert stats.underflow_frac["fp8_e4m3"].item() == pytest.approx(3 / 6)
    assert stats.overflow_frac["fp8_e4m3"].item() == pytest.approx(2 / 6)


def test_agrees_with_format_range_checks_on_random_data():
    g = torch.randn(1000) * torch.logspace(-12, 8, 1000)
    stats = grad_stats(_params(g[:600], g[600:]), scale=2.0**4)
    for name in DEFAULT_FORMATS:
        assert stats.underflow_frac[name].item() == pytest.approx(underflow_fraction(g, name, 2.0**4).item())
        assert stats.overflow_frac[name].item() == pytest.approx(overflow_fraction(g, name, 2.0**4).item())
    assert stats.norm.item() == pytest.approx(g.norm().item(), rel=1e-6)
    assert stats.amax.item() == g.abs().max().item()


def test_16_bit_gradients_are_compared_in_float32():
    # In float16, bf16's max (3.4e38) would round to inf and inf would not count as overflowing.
    stats = grad_stats(_params(torch.tensor([1.0, INF, 2.0**-24], dtype=torch.float16)))
    assert stats.overflow_frac["bf16"].item() == pytest.approx(1 / 3)
    assert stats.underflow_frac["fp16"].item() == 0.0
    assert stats.underflow_frac["fp8_e5m2"].item() == pytest.approx(1 / 3)


def test_per_module_grouping_and_to_floats():
    torch.manual_seed(0)
    model = TinyMLP()
    model.register_parameter("gain", nn.Parameter(torch.ones(1)))
    x, y = regression_data(8)
    nn.functional.mse_loss(model(x) * model.gain, y).backward()
    model.fc2.bias.grad = None  # a parameter without a gradient is left out
    stats = grad_stats(model, per_module=True)
    assert list(stats.modules) == ["", "fc1", "fc2", "fc3"]  # the root's own parameters come first
    fc1 = torch.cat([model.fc1.weight.grad.flatten(), model.fc1.bias.grad])
    assert stats.modules["fc1"].norm.item() == pytest.approx(fc1.norm().item(), rel=1e-6)
    assert stats.modules["fc2"].amax.item() == model.fc2.weight.grad.abs().max().item()
    assert stats.modules[""].norm.item() == pytest.approx(model.gain.grad.abs().item())
    norms = [s.norm for s in stats.modules.values()]
    assert stats.norm.item() == pytest.approx(torch.stack(norms).norm().item(), rel=1e-6)

    floats = stats.to_floats()
    assert set(floats) == {"norm", "amax", "underflow_frac", "overflow_frac", "zero_frac", "modules"}
    assert set(floats["underflow_frac"]) == set(DEFAULT_FORMATS)
    assert floats["modules"]["fc3"]["amax"] == stats.modules["fc3"].amax.item()
    assert all(isinstance(v, float) for v in floats["modules"]["fc1"]["overflow_frac"].values())


def test_no_gradients_give_zeros():
    stats = grad_stats(nn.Linear(2, 2))
    assert stats.norm.item() == 0.0 and stats.to_floats()["underflow_frac"]["fp16"] == 0.0


def test_computing_does_not_sync():
    pairs = _params(torch.randn(32), torch.randn(4, 4))
    with HostReads() as reads:
        stats = grad_stats(pairs, scale=torch.tensor(2.0**16), per_module=True)
    assert reads.ops == []
    assert isinstance(stats, GradStats) and stats.norm.dim() == 0


def test_amax_per_tensor_propagates_inf_and_nan():
    tensors = [torch.tensor([1.0, -3.0]), torch.tensor([NAN, 1.0]), torch.tensor([-INF]), torch.empty(0)]
    amax = amax_per_tensor(tensors).tolist()
    assert amax[0] == 3.0 and math.isnan(amax[1]) and amax[2] == INF and amax[3] == 0.0


def test_telemetry_is_due_every_n_steps():
    telemetry = GradTelemetry(every_n_steps=3, formats=["fp16"])
    pairs = _params(torch.randn(8))
    results = [telemetry.maybe_compute(pairs, step) for step in range(7)]
    # Step 0, then the last step of every 3 (the steps Lightning's log_every_n_steps=3 logs after).
    assert [r is not None for r in results] == [True, False, True, False, False, True, False]
    assert telemetry.latest is results[5] and list(telemetry.latest.underflow_frac) == ["fp16"]


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_every_n_steps_names_the_argument(bad):
    with pytest.raises(ValueError, match=r"GradTelemetry\(every_n_steps="):
        GradTelemetry(every_n_steps=bad)


def test_unknown_format_names_the_argument():
    with pytest.raises(ValueError, match=r"grad_stats\(formats=.*'fp7'"):
        grad_stats(_params(torch.ones(2)), formats=["fp16", "fp7"])
    with pytest.raises(ValueError, match=r"GradTelemetry\(formats="):
        GradTelemetry(formats=["e4m3"])


def test_core_imports_without_lightning_hydra_omegaconf(monkeypatch):
    # In-process (a subprocess would spend seconds importing torch): block the packages, drop our modules, reimport;
    # monkeypatch puts every sys.modules entry back afterwards.
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning", "hydra", "omegaconf"):
        monkeypatch.setitem(sys.modules, name, None)
    for name in [m for m in sys.modules if m == "lit_mpstable" or m.startswith("lit_mpstable.")]:
        monkeypatch.delitem(sys.modules, name)
    for name in ("lit_mpstable.core.scaling.scalers", "lit_mpstable.core.telemetry", "lit_mpstable.core.attribution"):
        module = importlib.import_module(name)
        assert module.__name__ == name and module.__file__, name  # imported for real, from its file
    blocked = ("lightning", "lightning.pytorch", "pytorch_lightning", "hydra", "omegaconf")
    assert all(sys.modules[name] is None for name in blocked)  # nothing put a real package back


def test_zero_fraction_counts_exact_zeros_over_all_elements() -> None:
    # What FP16 already flushed shows as exact zeros; underflow_frac only sees the nonzero elements.
    from lit_mpstable.core.telemetry import grad_stats

    a = torch.nn.Parameter(torch.ones(4))
    a.grad = torch.tensor([0.0, 0.0, 1.0, 2.0**-30])
    b = torch.nn.Parameter(torch.ones(4))
    b.grad = torch.tensor([0.0, 3.0, 0.0, 0.0])
    stats = grad_stats([("m.a", a), ("n.b", b)], formats=("fp16",), per_module=True).to_floats()
    assert stats["zero_frac"] == pytest.approx(5 / 8)
    assert stats["modules"]["m"]["zero_frac"] == pytest.approx(2 / 4)
    assert stats["underflow_frac"]["fp16"] == pytest.approx(1 / 3)  # 2**-30 among the 3 nonzero


@pytest.mark.parametrize("init_scale, named", [(2.0**-12, True), (2.0**-30, True), (2.0**10, False)])
def test_a_loss_scale_that_flushes_the_fp16_gradients_is_named_once(init_scale: float, named: bool) -> None:
    # 16-mixed at a collapsed scale: the gradients flush to zero in the FP16 backward and nothing said so.
    from helpers import TinyMLP, regression_data

    from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler
    from lit_mpstable.core.step.stepper import PrecisionStepper

    torch.manual_seed(0)
    model = TinyMLP()
    stepper = PrecisionStepper("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=init_scale),
                               telemetry_every_n_steps=1, device="cpu")
    stepper.setup_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stepper.setup_optimizers(model, [optimizer])
    x, y = regression_data(16)
    for _ in range(3):
        optimizer.zero_grad()
        with stepper.forward_context():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        stepper.scale_loss(loss).backward()
        stepper.step(optimizer)
    notes = [note for note in stepper.warnings if note.startswith("The loss scale flushes the FP16 gradients")]
    assert len(notes) == (1 if named else 0)
    if named:
        assert f"at loss scale {init_scale:g}" in notes[0] and "scaler='adaptive'" in notes[0]


def test_the_stepper_asks_the_observer_only_on_due_steps_and_after_a_traced_one(monkeypatch):
    """``GradObserver.quiet``: between due steps (0, then N-1, 2N-1, ...) the stepper does not call ``observe`` at all;
    the same statistics come out on the due steps, and a step after a traced one (an overflow armed the tracer) is
    observed again, so a later overflow is blamed by the guess, not by a stale trace."""
    from helpers import mse_backward, tiny_stepper

    from lit_mpstable.core.telemetry import GradObserver

    telemetry = GradTelemetry(every_n_steps=4)
    due = [s for s in range(40) if telemetry.is_due(s)]
    assert [telemetry.next_due(s) for s in due[:-1]] == due[1:]
    assert all(telemetry.next_due(s) == min(d for d in due if d > s) for s in range(35))
    calls = []
    observe = GradObserver.observe
    monkeypatch.setattr(GradObserver, "observe", lambda self, *a, **k: calls.append(a[2]) or observe(self, *a, **k))
    model, stepper, optimizer = tiny_stepper("bf16-mixed", telemetry_every_n_steps=4)
    x, y = regression_data(16)
    seen = []
    for step in range(12):
        mse_backward(stepper, model, x, y)
        if step == 5:
            model.fc1.weight.grad[0, 0] = float("inf")  # an overflow in a layer: blamed, the tracer armed
        stepper.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        seen.append(stepper.stats.get("stats_step"))
    # Due: 0, 3, 7, 11; step 5 overflowed (blame armed the tracer), so 6 is traced.
    assert calls == [0, 3, 6, 7, 11]
    assert seen == [0, 0, 0, 3, 3, 3, 3, 7, 7, 7, 7, 11]


def test_an_overflow_storm_arms_one_tracer_and_blames_each_step_by_it():
    """Step after step of overflow (a storm in one layer): each blame arms the tracer the last traced step put down,
    whose hooks exist already; it names the layer on every traced step and has no hooks left once a clean step ends
    the storm. A new model (a new fit) gets a tracer of its own."""
    from lit_mpstable.core.telemetry import GradObserver

    model, x = TinyMLP(), regression_data(8)[0]
    storm = {"on": True}
    model.fc2.register_forward_hook(lambda m, a, out: out * float("inf") if storm["on"] else None)
    observer = GradObserver(None, DEFAULT_FORMATS)
    tracers, blamed = [], []
    for step in range(5):
        storm["on"] = step < 4
        model(x).sum().backward()
        updates, warning = observer.observe(model, lambda: list(model.named_parameters()), step, lambda: 1.0)
        blamed.append((updates.get("blamed_modules"), warning is not None))
        if storm["on"]:
            observer.blame(model, list(model.named_parameters()))
            tracers.append(observer.tracer)
        model.zero_grad(set_to_none=True)
    assert blamed == [(None, False), (["fc2"], True), (["fc2"], True), (["fc2"], True), (None, False)]
    assert observer.tracer is None and all(t is tracers[0] for t in tracers)
    assert not any(m._forward_pre_hooks for m in model.modules()) and len(model.fc2._forward_hooks) == 1
    other = TinyMLP()
    observer.blame(other, list(other.named_parameters()))
    assert observer.tracer is not tracers[0] and observer.tracer.model is other


@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
def test_16_true_compact_weights_report_the_true_gradients_as_fp32_masters_do(mode: str) -> None:
    """16-true with compact weights keeps the gradients scaled until the step unscales them in FP32; the telemetry
    reads them as the step will, so it reports what FP32 masters (which hold the unscaled FP32 copy) report, and the
    norm is the scaled gradients' divided by the loss scale."""
    from helpers import mse_backward

    from lit_mpstable.core.step.stepper import PrecisionStepper

    keys = ("grad_norm", "grad_amax", "grad_underflow_frac", "grad_overflow_frac", "grad_zero_frac")
    seen = {}
    for master in (True, mode):
        torch.manual_seed(0)
        model = TinyMLP()
        stepper = PrecisionStepper("16-true", master_weights=master, telemetry_every_n_steps=1, device="cpu")
        stepper.setup_module(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        stepper.setup_optimizers(model, [optimizer])
        mse_backward(stepper, model, *regression_data(16))
        scaled = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        scale = stepper.loss_scale
        stepper.step(optimizer)
        seen[master] = stepper.stats
    assert scale == 2.0**15 and seen[mode]["grad_overflow_frac"] == 0.0  # not the scaled gradients times the scale
    assert seen[mode]["grad_norm"] == pytest.approx(torch.linalg.vector_norm(scaled).item() / scale, rel=1e-6)
    assert {k: seen[mode][k] for k in keys} == pytest.approx({k: seen[True][k] for k in keys}, rel=1e-6)
    assert seen[mode]["grad_underflow_per_module"] == seen[True]["grad_underflow_per_module"]


def test_owed_factors_are_applied_in_fp32_before_measuring() -> None:
    # Still-scaled FP16 gradients owing 1/S read as the unscaled FP32 ones: 2**-20 * S is representable, but the
    # unscaled value in FP16 would be subnormal (rounded); the forecast at scale S counts it as FP16 keeps it.
    scale = 2.0**12
    true = torch.tensor([2.0**-20, 3.0, -(2.0**-3), 0.0])
    owed = {"p0": torch.tensor(1 / scale)}
    scaled = grad_stats(_params((true * scale).half()), scale=scale, formats=["fp16", "bf16"], owed=owed).to_floats()
    expected = grad_stats(_params(true), scale=scale, formats=["fp16", "bf16"]).to_floats()
    assert scaled == expected
    assert scaled["amax"] == 3.0 and scaled["overflow_frac"]["fp16"] == 0.0

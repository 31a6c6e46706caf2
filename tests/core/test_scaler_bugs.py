"""Loss-scaler bugs found from outside: foreign scalers, the scale floor, data faults, loaded state."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers import TinyMLP, regression_data

from lit_mpstable.core.scaling.adaptive_scaler import AdaptiveLossScaler
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler, StaticLossScaler
from lit_mpstable.core.step.stepper import PrecisionStepper

INF, NAN = float("inf"), float("nan")


class SubclassedScaler(torch.amp.GradScaler):
    """A user's GradScaler subclass: nothing overridden."""


class DuckScaler:
    """A scaler that is no GradScaler: GradScaler's methods, delegated to one it owns."""

    def __init__(self, **kwargs: Any) -> None:
        self._inner = torch.amp.GradScaler("cpu", **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("scale", "unscale_", "step", "update", "get_scale", "state_dict", "load_state_dict", "is_enabled"):
            return getattr(self._inner, name)
        raise AttributeError(name)


def _loop(stepper: PrecisionStepper, steps: int, bad: set[int], *, scheduler: bool = True, clip: bool = False):
    torch.manual_seed(0)
    model = TinyMLP()
    stepper.setup_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler else None
    stepper.setup_optimizers(model, [opt], [sched] if sched else [])
    x, y = regression_data(32)
    for step in range(steps):
        with stepper.forward_context():
            loss = torch.nn.functional.mse_loss(model(stepper.convert_input(x)).float(), y)
        stepper.scale_loss(loss).backward()
        if step in bad:
            model.fc2.weight.grad.view(-1)[0] = INF
        if clip:
            stepper.clip_grad_norm_(opt, 1.0)
        stepper.step(opt)
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return model, opt


@pytest.mark.parametrize("make", [lambda: SubclassedScaler("cpu", init_scale=256.0),
                                  lambda: DuckScaler(init_scale=256.0)], ids=["subclass", "duck"])
@pytest.mark.parametrize("clip", [False, True])
def test_a_foreign_scaler_reports_its_skipped_steps(make, clip: bool) -> None:
    scaler = make()
    stepper = PrecisionStepper("16-mixed", scaler=scaler)
    _, opt = _loop(stepper, 4, {1, 2}, clip=clip)
    assert scaler.get_scale() == 64.0  # it did skip twice (256 -> 128 -> 64)
    assert stepper.overflow_count == stepper.skipped_steps == 2
    assert stepper.applied_steps() == 2
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)  # the LR held on both skipped steps
    assert stepper.scaler is scaler  # the user's object is what the run shows


# ------------------------------------------------------------------------------------------------ the scale floor
TINY = torch.finfo(torch.float32).tiny  # 2**-126


def _storm(scaler, overflows: int) -> list[float]:
    scaler.scale(torch.ones(()))
    scales = []
    for _ in range(overflows):
        scaler._per_optimizer_states[0]["found_inf_per_device"] = {"cpu": torch.tensor(1.0)}
        scaler._note_skip(True) if hasattr(scaler, "_note_skip") else None
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("kwargs", [{}, {"hysteresis": 2}, {"growth_interval": 5}], ids=["default", "hysteresis",
                                                                                        "interval"])
def test_an_overflow_storm_stops_at_the_floor_and_says_so(kwargs: dict) -> None:
    ref = _storm(torch.amp.GradScaler("cpu", init_scale=2.0**-120), 12)
    assert ref[-1] < TINY  # GradScaler's own rule leaves the range where 1/scale is finite
    with pytest.warns(RuntimeWarning, match="2\\*\\*-126"):
        scales = _storm(DynamicLossScaler("cpu", init_scale=2.0**-120, **kwargs), 24)
    assert min(scales) == TINY and math.isfinite(1.0 / scales[-1])


def test_an_init_scale_below_the_floor_is_refused() -> None:
    with pytest.raises(ValueError, match="init_scale=1e-39.*2\\*\\*-126"):
        DynamicLossScaler("cpu", init_scale=1e-39)
    with pytest.raises(ValueError, match="init_scale"):
        StaticLossScaler("cpu", init_scale=1e-40)
    DynamicLossScaler("cpu", init_scale=TINY)  # the floor itself is allowed


@pytest.mark.parametrize("precision, make", [
    ("16-mixed", lambda: torch.amp.GradScaler("cpu", init_scale=2.0**-120)),  # adopted
    ("16-true", lambda: "auto"),
], ids=["adopted-gradscaler", "16-true-default"])
def test_after_an_overflow_storm_a_clean_step_writes_finite_weights(precision: str, make) -> None:
    stepper = PrecisionStepper(precision, scaler=make(), master_weights=False)
    if precision == "16-true":
        stepper.scaler.load_state_dict({**stepper.scaler.state_dict(), "scale": 2.0**-120})
    model, _ = _loop(stepper, 14, set(range(12)), scheduler=False)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert stepper.overflow_count == 12
    assert stepper.loss_scale >= TINY
    assert stepper.applied_steps() == 2


def test_a_nan_batch_skips_its_step_but_does_not_back_off_the_scale() -> None:
    stepper = PrecisionStepper("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**10, growth_interval=3))
    torch.manual_seed(0)
    model = TinyMLP()
    stepper.setup_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper.setup_optimizers(model, [opt])
    x, y = regression_data(32)
    scales = []
    for step in range(4):
        batch = x.clone()
        if step == 1:
            batch[0, 0] = NAN
        loss = torch.nn.functional.mse_loss(model(stepper.convert_input(batch)), y)
        stepper.scale_loss(loss).backward()
        stepper.step(opt)
        opt.zero_grad()
        scales.append(stepper.loss_scale)
    assert stepper.skipped_steps == stepper.overflow_count == 1
    # Three clean steps grow the scale once (growth_interval=3); the NaN batch neither backs off nor resets the count.
    assert scales == [2.0**10, 2.0**10, 2.0**10, 2.0**11]
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ------------------------------------------------------------------------------------------ one loss, two optimizers
def _two_optimizers(scaler_or_stepper, steps: int, bad: dict[int, str]):
    torch.manual_seed(0)
    model = TinyMLP()
    opts = [torch.optim.SGD(model.fc1.parameters(), lr=0.05),
            torch.optim.SGD([*model.fc2.parameters(), *model.fc3.parameters()], lr=0.05)]
    stepper = scaler_or_stepper if isinstance(scaler_or_stepper, PrecisionStepper) else None
    if stepper is not None:
        stepper.setup_module(model)
        stepper.setup_optimizers(model, opts)
    x, y = regression_data(32)
    scales = []
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        (stepper.scale_loss(loss) if stepper else scaler_or_stepper.scale(loss)).backward()
        if step in bad:
            getattr(model, bad[step]).weight.grad.view(-1)[0] = INF
        for opt in opts:
            stepper.step(opt) if stepper else scaler_or_stepper.step(opt)
        if stepper is None:
            scaler_or_stepper.update()
        for opt in opts:
            opt.zero_grad()
        scales.append(stepper.loss_scale if stepper else scaler_or_stepper.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


def test_one_loss_two_optimizers_update_the_scale_once_per_iteration_as_gradscaler() -> None:
    bad = {1: "fc1", 4: "fc3"}  # only the first optimizer overflows, then only the second
    kwargs = dict(init_scale=2.0**10, growth_interval=2)
    ref_scales, ref_params = _two_optimizers(torch.amp.GradScaler("cpu", **kwargs), 8, bad)
    stepper = PrecisionStepper("16-mixed", scaler=DynamicLossScaler("cpu", **kwargs))
    scales, params = _two_optimizers(stepper, 8, bad)
    assert scales == ref_scales
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert stepper.overflow_count == 2 and stepper.applied_steps() == 14


# ----------------------------------------------------------------------------------------- loaded state is checked
CORRUPT = [
    ("scale", NAN), ("scale", INF), ("scale", 0.0), ("scale", -1.0), ("scale", 1e-45), ("growth_factor", 0.0),
    ("growth_factor", 1.0), ("backoff_factor", 2.0), ("backoff_factor", 0.0), ("growth_interval", 0),
    ("growth_interval", "2000"), ("_growth_tracker", -1), ("hysteresis", 0), ("_hysteresis_tracker", -1),
    ("_hysteresis_tracker", 5), ("min_scale", NAN), ("max_scale", -2.0), ("overflow_count", -3),
    ("min_scale_hits", -1), ("step_count", -1), ("step_count", None), ("scale", "65536"), ("hysteresis", True),
]


@pytest.mark.parametrize("make", [lambda: DynamicLossScaler("cpu", hysteresis=2), lambda: StaticLossScaler("cpu"),
                                  lambda: AdaptiveLossScaler("cpu")], ids=["dynamic", "static", "adaptive"])
@pytest.mark.parametrize("key, value", CORRUPT, ids=[f"{k}={v!r}" for k, v in CORRUPT])
def test_a_corrupt_field_is_refused_by_name_and_changes_nothing(make, key: str, value) -> None:
    scaler = make()
    state = scaler.state_dict()
    before = dict(state)
    with pytest.raises((ValueError, TypeError), match=key):
        scaler.load_state_dict({**state, key: value})
    assert scaler.state_dict() == before


@pytest.mark.parametrize("state", [
    {"min_scale": 8.0, "max_scale": 4.0}, {"min_scale": 4.0, "scale": 2.0},
], ids=["min>max", "scale<min"])
def test_fields_that_disagree_are_refused(state: dict) -> None:
    scaler = DynamicLossScaler("cpu")
    with pytest.raises(ValueError, match="min_scale"):
        scaler.load_state_dict({**scaler.state_dict(), **state})


@pytest.mark.parametrize("key, value", [("overflowed_since_note", "False"), ("underflow_boost", 0.5),
                                        ("_amax_history", [NAN] * 16), ("_amax_history", [1.0]),
                                        ("_extra_headroom", 0.0), ("_overflow_streak", -1), ("headroom", INF),
                                        ("target_format", "bf16x"), ("raise_blocked_until", -5),
                                        ("_last_overflow_scale", NAN)])
def test_adaptive_fields_are_refused_by_name(key: str, value) -> None:
    scaler = AdaptiveLossScaler("cpu")
    with pytest.raises((ValueError, TypeError), match=key):
        scaler.load_state_dict({**scaler.state_dict(), key: value})


def test_missing_and_unknown_keys_are_named_value_errors() -> None:
    scaler = DynamicLossScaler("cpu")
    state = scaler.state_dict()
    with pytest.raises(ValueError, match="missing keys \\['step_count'\\]"):
        scaler.load_state_dict({k: v for k, v in state.items() if k != "step_count"})
    with pytest.raises(KeyError, match="unknown keys \\['junk'\\]"):
        scaler.load_state_dict({**state, "junk": 1})
    with pytest.raises(TypeError, match="load_state_dict\\(None\\)"):
        scaler.load_state_dict(None)


@pytest.mark.parametrize("new_scale", [NAN, INF, 0.0, -4.0, 1e-45, torch.tensor(NAN), torch.tensor(0.0)],
                         ids=["nan", "inf", "zero", "negative", "subnormal", "nan-tensor", "zero-tensor"])
def test_update_new_scale_is_checked(new_scale) -> None:
    scaler = DynamicLossScaler("cpu")
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(new_scale=new_scale)
    assert scaler.get_scale() == 2.0**16
    scaler.update(new_scale=torch.tensor(8.0))  # a good one still works, tensor or float
    scaler.update(new_scale=4.0)
    assert scaler.get_scale() == 4.0

"""DynamicLossScaler against torch.amp.GradScaler, hand-computed trajectories, bounds (the scale floor), a NaN batch,
one loss over two optimizers, state (a loaded state is checked field by field)."""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch
from helpers import HostReads, TinyMLP, regression_data

from lit_mpstable.core.scaling.adaptive_scaler import AdaptiveLossScaler
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler, StaticLossScaler
from lit_mpstable.core.step.stepper import PrecisionStepper

INF, NAN = float("inf"), float("nan")


def _run(scaler, steps: int, bad: dict[int, float], *, seed: int = 0, fused: bool = False):
    """Train TinyMLP for `steps` with scaled losses; `bad[k]` poisons one gradient element on step k."""
    torch.manual_seed(seed)
    model = TinyMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    x, y = regression_data(32)
    scales, skipped = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if step in bad:
            model.fc2.weight.grad.view(-1)[3] = bad[step]
        before = model.fc2.weight.detach().clone()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(torch.equal(before, model.fc2.weight))
    return scales, skipped, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("fused", [False, True])
def test_matches_gradscaler_step_for_step(fused: bool) -> None:
    # growth_interval=3 makes growth happen often enough to be compared; inf and nan both poison steps.
    bad = {2: INF, 3: NAN, 9: -INF, 10: INF, 11: INF, 20: NAN}
    kwargs = dict(init_scale=2.0**10, growth_interval=3)
    ref = _run(torch.amp.GradScaler("cpu", **kwargs), 30, bad, fused=fused)
    ours = _run(DynamicLossScaler("cpu", **kwargs), 30, bad, fused=fused)
    assert ours[0] == ref[0]  # scale trajectory
    assert ours[1] == ref[1]  # which steps were skipped
    for a, b in zip(ours[2], ref[2]):
        assert torch.equal(a, b)  # parameters bit for bit


def test_default_arguments_equal_gradscaler() -> None:
    ours, ref = DynamicLossScaler("cpu"), torch.amp.GradScaler("cpu")
    for name in ("get_scale", "get_growth_factor", "get_backoff_factor", "get_growth_interval", "is_enabled"):
        assert getattr(ours, name)() == getattr(ref, name)()
    a, b = _run(ours, 6, {1: INF}), _run(ref, 6, {1: INF})
    assert a[0] == b[0] == [2.0**16, 2.0**15, 2.0**15, 2.0**15, 2.0**15, 2.0**15]


def test_last_step_skipped_and_counters() -> None:
    scaler = DynamicLossScaler("cpu", init_scale=8.0, growth_interval=100)
    _, skipped, _ = _run(scaler, 5, {1: INF, 4: NAN})
    assert skipped == [False, True, False, False, True]
    assert scaler.last_step_skipped is True
    assert scaler.overflow_count == 2
    assert scaler.step_count == 5


def _trajectory(scaler: DynamicLossScaler, overflows: list[bool]) -> list[float]:
    """Drive update() directly with a found-inf pattern (no model): the scale after each step."""
    scaler.scale(torch.ones(()))  # lazily creates the scale on the CPU
    out = []
    for found in overflows:
        opt_state = scaler._per_optimizer_states[0]
        opt_state["found_inf_per_device"] = {"cpu": torch.tensor(float(found))}
        scaler.update()
        out.append(scaler.get_scale())
    return out


def test_hysteresis_hand_computed() -> None:
    # hysteresis=2: first overflow only skips, second backs off, third too (budget used up) until the scale grows.
    s = DynamicLossScaler("cpu", init_scale=64.0, growth_interval=2, hysteresis=2)
    pattern = [True, False, True, True, False, False, True, True]
    expected = [64.0, 64.0, 32.0, 16.0, 16.0, 32.0, 32.0, 16.0]
    # step 0: overflow, budget 2->1, no backoff; step 1 clean (tracker 1);
    # step 2: overflow, budget 1->0 -> 32; step 3: overflow, budget used -> 16; steps 4,5 clean -> grow to 32 and
    # refill budget to 2; step 6: overflow, budget 2->1, no backoff; step 7: overflow -> 16.
    assert _trajectory(s, pattern) == expected


def test_bounds_and_min_scale_report() -> None:
    s = DynamicLossScaler("cpu", init_scale=4.0, growth_interval=1, min_scale=1.0, max_scale=16.0)
    assert _trajectory(s, [False] * 4) == [8.0, 16.0, 16.0, 16.0]  # capped at max_scale
    s = DynamicLossScaler("cpu", init_scale=4.0, growth_interval=100, min_scale=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s.scale(torch.ones(()))
        for _ in range(5):
            s._per_optimizer_states[0]["found_inf_per_device"] = {"cpu": torch.tensor(1.0)}
            s.last_step_skipped = True  # what step() records from its host sync
            s.update()
    assert s.get_scale() == 1.0
    assert s.min_scale_hits == 3  # overflows at scale 1.0 (steps 3, 4, 5)
    messages = [str(w.message) for w in caught if "min_scale" in str(w.message)]
    assert len(messages) == 1  # reported once, not silently accepted and not spammed


def test_static_scaler_skips_but_never_changes() -> None:
    s = StaticLossScaler("cpu", init_scale=128.0)
    scales, skipped, _ = _run(s, 4, {1: INF})
    assert scales == [128.0] * 4
    assert skipped == [False, True, False, False]
    assert s.overflow_count == 1


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(init_scale=0.0), "init_scale"),
        (dict(init_scale=-1.0), "init_scale"),
        (dict(growth_factor=1.0), "growth_factor"),
        (dict(backoff_factor=1.5), "backoff_factor"),
        (dict(backoff_factor=0.0), "backoff_factor"),
        (dict(growth_interval=0), "growth_interval"),
        (dict(hysteresis=0), "hysteresis"),
        (dict(min_scale=8.0, max_scale=4.0, init_scale=4.0), "min_scale"),
        (dict(init_scale=0.5, min_scale=1.0), "init_scale"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=argument) as info:
        DynamicLossScaler("cpu", **kwargs)
    assert repr(next(iter(kwargs.values()))) in str(info.value)


def test_state_dict_round_trip_resumes_exactly() -> None:
    bad = {1: INF, 5: INF}
    full = DynamicLossScaler("cpu", init_scale=2.0**8, growth_interval=2, hysteresis=2)
    full_scales, _, _ = _run(full, 8, bad)

    first = DynamicLossScaler("cpu", init_scale=2.0**8, growth_interval=2, hysteresis=2)
    _run(first, 4, bad)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    resumed = DynamicLossScaler("cpu", init_scale=1.0, growth_interval=9, hysteresis=1)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == first.state_dict()
    # Continue the same pattern (shifted by 4 steps): the scale trajectory matches the uninterrupted run.
    tail = _trajectory(resumed, [k + 4 in bad for k in range(4)])
    assert tail == full_scales[4:]


def test_load_state_dict_is_strict_but_takes_gradscaler_dicts() -> None:
    s = DynamicLossScaler("cpu")
    state = s.state_dict()
    with pytest.raises(KeyError, match="hysteresis"):
        s.load_state_dict({k: v for k, v in state.items() if k != "hysteresis"})
    with pytest.raises(KeyError, match="bogus"):
        s.load_state_dict({**state, "bogus": 1})
    with pytest.raises(RuntimeError, match="disabled"):
        s.load_state_dict({})
    ref = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    s.load_state_dict(ref.state_dict())
    assert s.get_scale() == 512.0 and s.get_growth_interval() == 7


def test_no_extra_host_sync_in_update() -> None:
    # update() must not read device values (item, float, if tensor:, tolist...) on clean steps or after an overflow.
    s = DynamicLossScaler("cpu", init_scale=4.0, growth_interval=3, min_scale=1.0)
    s.scale(torch.ones(()))
    for found in (0.0, 0.0, 1.0, 0.0, 0.0, 0.0):
        s._per_optimizer_states[0]["found_inf_per_device"] = {"cpu": torch.tensor(found)}
        with HostReads() as reads:
            s.update()
        assert reads.ops == [], found


def test_pickle_round_trip() -> None:
    import pickle

    s = DynamicLossScaler("cpu", init_scale=32.0, hysteresis=3)
    _run(s, 3, {1: INF})
    clone = pickle.loads(pickle.dumps(s))
    assert clone.state_dict() == s.state_dict()
    assert math.isclose(clone.get_scale(), 32.0)


def test_bounds_hold_on_the_stepping_path() -> None:
    # Through step() the host knows each iteration's outcome and clamps only when the scale can cross a bound.
    capped = DynamicLossScaler("cpu", init_scale=2.0**23, growth_interval=1, max_scale=2.0**24)
    assert _run(capped, 3, {})[0] == [2.0**24] * 3
    floored = DynamicLossScaler("cpu", init_scale=2.0**3, min_scale=2.0**2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scales, skipped, _ = _run(floored, 4, {k: INF for k in range(4)})
    assert scales == [4.0] * 4 and skipped == [True] * 4
    assert floored.min_scale_hits == 3 and floored.overflow_count == 4
    state = floored.state_dict()
    resumed = DynamicLossScaler("cpu", init_scale=2.0**3, min_scale=2.0**2)
    resumed.load_state_dict(state)
    assert resumed.overflow_count == 4 and resumed.state_dict() == state


def test_bounds_hold_after_an_update_without_step_or_with_new_scale() -> None:
    # The host mirror loses track when update() runs without step() or with new_scale: it then clamps every time.
    s = DynamicLossScaler("cpu", init_scale=4.0, growth_interval=2, max_scale=4.0)
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x, y = regression_data(8)
    scales = []
    for step in range(6):
        opt.zero_grad()
        s.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        s.unscale_(opt)
        if step == 0:
            s.update()  # the user decided not to step
        elif step == 1:
            s.step(opt)
            s.update(new_scale=4.0)
        else:
            s.step(opt)
            s.update()
        scales.append(s.get_scale())
    assert max(scales) <= 4.0


def test_init_scale_above_max_scale_is_accepted_as_gradscaler_accepts_it() -> None:
    # PyTorch's own test_grad_scale_will_not_overflow: init_scale=1e38 with fast growth; the scale stays finite.
    model = torch.nn.Linear(5, 1)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = DynamicLossScaler("cpu", growth_interval=1, growth_factor=2**4, init_scale=1e38)
    loss = ((model(torch.randn(1, 5)) - 1e-30 * torch.randn(1, 1)) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert math.isfinite(scaler.get_scale()) and scaler.get_scale() == pytest.approx(1e38)
    # The cap applies to growth: a scale above max_scale neither grows nor is pulled down to it; backoff still works.
    capped = DynamicLossScaler("cpu", init_scale=2.0**30, growth_interval=1)
    scales, skipped, _ = _run(capped, 4, {2: INF})
    assert scales == [2.0**30, 2.0**30, 2.0**29, 2.0**29]
    assert skipped == [False, False, True, False]


def test_gradscaler_step_for_step_with_max_scale_none() -> None:
    # Without the cap, a scale far above 2**24 follows GradScaler exactly (the README's claim).
    bad = {3: INF, 4: NAN}
    kwargs = dict(init_scale=2.0**30, growth_interval=1)
    ref = _run(torch.amp.GradScaler("cpu", **kwargs), 8, bad)
    ours = _run(DynamicLossScaler("cpu", max_scale=None, **kwargs), 8, bad)
    assert ours[0] == ref[0] and ours[1] == ref[1]


def test_device_none_follows_the_machine() -> None:
    scaler = DynamicLossScaler()
    assert scaler._device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert scaler.is_enabled()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_scaler_is_not_silently_disabled_without_cuda() -> None:
    # torch.amp.GradScaler("cuda") disables itself here, so FP16 would train unscaled; ours keeps scaling.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not torch.amp.GradScaler("cuda").is_enabled()
    scaler = DynamicLossScaler("cuda", init_scale=2.0**10)
    assert scaler.is_enabled()
    assert scaler.scale(torch.ones(())).item() == 2.0**10
    assert scaler.adopt_device_("cpu") == "cuda" and scaler._device == "cpu"
    assert scaler.adopt_device_("cpu") is None


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_undo_backoff_puts_the_scale_and_trackers_back_and_keeps_the_overflow_counted(hysteresis: int) -> None:
    # The rejected execution of a step FaultTriage replays clean backed the scale off for nothing: undo puts the scale
    # and the growth (and hysteresis) trackers back; the overflow stays counted. A clean update has nothing to undo.
    scaler = DynamicLossScaler("cpu", init_scale=2.0**10, growth_interval=3, hysteresis=hysteresis)
    reference = DynamicLossScaler("cpu", init_scale=2.0**10, growth_interval=3, hysteresis=hysteresis)
    _run(scaler, 5, {1: INF, 3: INF})
    _run(reference, 5, {1: INF, 3: INF})
    assert scaler.undo_backoff_() is False  # step 4 was clean
    _run(scaler, 1, {0: NAN})  # a fresh model: only the scaler's state matters here
    _run(reference, 1, {})
    assert scaler.overflow_count == 3
    assert scaler.undo_backoff_() is True and scaler.undo_backoff_() is False
    assert scaler.get_scale() == reference.get_scale() == 2.0**10 / 2 ** (2 // hysteresis)  # the two real backoffs
    assert scaler._growth_tracker.item() == reference._growth_tracker.item() - 1  # as before the rejected step
    assert scaler._get_hysteresis_tracker() == reference._get_hysteresis_tracker()
    assert scaler.overflow_count == 3 and scaler.step_count == 6


def test_undo_backoff_has_nothing_to_undo_after_a_data_skip_or_a_load() -> None:
    scaler = DynamicLossScaler("cpu", init_scale=2.0**10)
    _run(scaler, 1, {0: INF})
    state = scaler.state_dict()
    scaler.load_state_dict(state)
    assert scaler.undo_backoff_() is False and scaler.get_scale() == 2.0**9


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

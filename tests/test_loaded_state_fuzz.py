"""Corrupted loaded state: the plugin's and every callback's ``load_state_dict`` refuse a bad field by name (a
TypeError/ValueError/KeyError naming the loader and the field) and change nothing; never a raw ``int()`` or
``NoneType`` error, never a silent load. The strategies corrupt one field of the saved state itself, drawn from its
own keys."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import TinyMLP
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_mpstable import StablePrecision
from lit_mpstable.callbacks import AMPPreflight, OverflowMonitor, PrecisionFallback, PrecisionProbe, ScaleCheckpoint

# Fields where one of the corruptions below is a legitimate value (no scale bound or a bound of 1.5; no unread flag;
# -1: not yet).
LEGITIMATE = [("min_scale", None), ("max_scale", None), ("min_scale", 1.5), ("max_scale", 1.5),
              ("previous_nonfinite", None), ("cooldown_end", -1),
              ("last_probe_step", -1), ("grad_error_runs", {"a": 1})]  # {"a": 1}: a module name and its run
INVALID = st.sampled_from([None, "False", "True", "3", math.nan, math.inf, -math.inf, -1, -7, 1.5, "junk", [None],
                           {"a": 1}, object()])


def _plugin(precision: str, **kwargs) -> StablePrecision:
    torch.manual_seed(0)
    plugin = StablePrecision(precision, **kwargs)
    module = plugin.convert_module(TinyMLP())
    adam = kwargs.get("optimizer_state", "fp32") != "fp32"  # BF16/FP8 moments replace Adam's own
    params = module.parameters()
    optimizer = torch.optim.AdamW(params, lr=1e-2) if adam else torch.optim.SGD(params, lr=0.1)
    plugin.stepper.setup_optimizers(module, [optimizer])
    if adam:  # one step, so the moments hold values and step counts
        loss = module(torch.randn(4, 16, dtype=torch.bfloat16)).float().square().mean()
        plugin.stepper.scale_loss(loss).backward()
        plugin.stepper.step(optimizer)
    return plugin


PLUGINS = {
    "16-mixed": lambda: _plugin("16-mixed"),
    "adaptive": lambda: _plugin("16-mixed", scaler="adaptive"),
    "bf16-true": lambda: _plugin("bf16-true"),
    "kahan": lambda: _plugin("bf16-true", master_weights="kahan"),
    "bf16-moments": lambda: _plugin("bf16-true", optimizer_state="bf16"),
    "fp8-moments-kahan": lambda: _plugin("bf16-true", master_weights="kahan", optimizer_state="fp8"),
}
CALLBACKS = {"ScaleCheckpoint": ScaleCheckpoint, "OverflowMonitor": OverflowMonitor,
             "PrecisionProbe": PrecisionProbe, "PrecisionFallback": PrecisionFallback, "AMPPreflight": AMPPreflight}


def _legitimate(state, path, value) -> bool:
    original = state
    for key in path:
        original = original[key]
    if isinstance(original, (float, torch.Tensor)) and value == 1.5:  # a fine ratio, scale or tensor value
        return True
    if isinstance(original, torch.Tensor) and original.dtype == torch.float8_e4m3fn and value in (math.inf, -math.inf):
        return True  # E4M3 saturates an inf to its largest code: a valid FP8 moment

    return any(str(path[-1]) == field and type(value) is type(ok) and value == ok for field, ok in LEGITIMATE)


def _paths(state, path=()):
    """Every field of a saved state (a dict of tensors by its first entry)."""
    if isinstance(state, dict) and state and path[-1:] not in (("result",),):
        items = list(state.items())
        if all(isinstance(v, torch.Tensor) for _, v in items):
            items = items[:1]
        for key, value in items:
            yield from _paths(value, (*path, key))
    elif isinstance(state, list) and path[-2:-1] == ("moments",):  # [exp_avg, exp_avg_sq] of one parameter
        for index, value in enumerate(state):
            yield from _paths(value, (*path, index))
    elif path:
        yield path


def _corrupt(state, path, value):
    state = copy.deepcopy(state)
    target = state
    for key in path[:-1]:
        target = target[key]
    tensor = target[path[-1]]
    if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and isinstance(value, float):
        target[path[-1]] = torch.full(tensor.shape, value).to(tensor.dtype)  # a NaN/inf tensor (E4M3: NaN codes)
    else:
        target[path[-1]] = value
    return state


def _assert_refused(make, state, path, value) -> None:
    target = make()
    before = copy.deepcopy(target.state_dict())
    with pytest.raises((TypeError, ValueError, KeyError)) as error:
        target.load_state_dict(_corrupt(state, path, value))
    message = str(error.value)
    assert "load_state_dict" in message and str(path[-1]) in message, (path, value, message)
    after = target.state_dict()
    for key in before:  # a refused load changes nothing
        assert repr(after[key]) == repr(before[key]) or (
            isinstance(before[key], dict) and before[key].keys() == after[key].keys()), key


@pytest.mark.parametrize("kind", sorted(PLUGINS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_plugin_refuses_any_corrupted_field_by_name(kind: str, data) -> None:
    make = PLUGINS[kind]
    state = make().state_dict()
    path = data.draw(st.sampled_from(sorted(_paths(state), key=repr)), label="field")
    value = data.draw(INVALID, label="value")
    if _legitimate(state, path, value):
        return
    _assert_refused(make, state, path, value)


@pytest.mark.parametrize("name", sorted(CALLBACKS))
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_callback_refuses_any_corrupted_field_by_name(name: str, data) -> None:
    make = CALLBACKS[name]
    state = make().state_dict()
    path = data.draw(st.sampled_from(sorted(_paths(state), key=repr)), label="field")
    value = data.draw(INVALID, label="value")
    if _legitimate(state, path, value) or (path[-1] == "result" and isinstance(value, dict)):
        return
    _assert_refused(make, state, path, value)


@pytest.mark.parametrize("owner", ["plugin", *sorted(CALLBACKS)])
@pytest.mark.parametrize("junk", [None, "junk", [1, 2]])
def test_load_state_dict_of_junk_names_the_loader(owner: str, junk) -> None:
    target = PLUGINS["16-mixed"]() if owner == "plugin" else CALLBACKS[owner]()
    with pytest.raises(TypeError, match=r"load_state_dict\(state_dict=.*must be a dict"):
        target.load_state_dict(junk)


def test_the_false_string_is_not_read_as_a_global_fp32_fallback() -> None:
    plugin = PLUGINS["16-mixed"]()
    state = plugin.state_dict()
    state["layout"]["fp32"] = "False"
    with pytest.raises(TypeError, match=r"layout\['fp32'\]='False'\): must be True or False"):
        plugin.load_state_dict(state)
    assert not plugin.fallback_active


def test_a_nan_scale_is_refused_and_a_valid_state_round_trips() -> None:
    plugin = PLUGINS["16-mixed"]()
    state = plugin.state_dict()
    with pytest.raises(ValueError, match=r"scaler\['scale'\]=nan\)"):
        plugin.load_state_dict({**state, "scaler": {**state["scaler"], "scale": math.nan}})
    assert plugin.loss_scale == 65536.0
    good = {**state, "scaler": {**state["scaler"], "scale": 1024.0}, "step_count": 7, "skipped_steps": 2}
    fresh = PLUGINS["16-mixed"]()
    fresh.load_state_dict(good)
    assert fresh.loss_scale == 1024.0 and fresh.state_dict()["step_count"] == 7


def _second_moment(moments: dict, name: str) -> dict:
    return moments["moments"][name][1]["tensors"]


def _negative(moments: dict, name: str) -> str:
    tensors = _second_moment(moments, name)
    if "value" in tensors:  # BF16: a negative exp_avg_sq, whose sqrt is NaN
        tensors["value"] = -tensors["value"].abs() - 1
        return r"\['value'\]\): .*negative"
    tensors["k"] = -tensors["k"]  # FP8: the expansion exponent must be > 0
    return r"\['k'\]\): .*must be finite and > 0"


def _nan(moments: dict, name: str) -> str:
    tensors = _second_moment(moments, name)
    key = "value" if "value" in tensors else "amax"
    tensors[key] = torch.full_like(tensors[key], math.nan)
    return rf"\[{key!r}\]\): .*inf/NaN"


def _nan_codes(moments: dict, name: str) -> str:
    tensors = moments["moments"][name][0]["tensors"]
    if "codes" not in tensors:  # BF16: an inf first moment
        tensors["value"] = torch.full_like(tensors["value"], math.inf)
        return r"\['value'\]\): .*inf/NaN"
    tensors["codes"] = torch.full_like(tensors["codes"].view(torch.uint8), 0x7F).view(torch.float8_e4m3fn)
    return r"\['codes'\]\): .*NaN"


def _renamed(moments: dict, name: str) -> str:
    moments["moments"]["renamed.weight"] = moments["moments"].pop(name)
    moments["steps"]["renamed.weight"] = moments["steps"].pop(name)
    return r"missing.*'fc1.weight'.*unknown.*'renamed.weight'"


def _missing(moments: dict, name: str) -> str:
    del moments["moments"][name], moments["steps"][name]
    return r"missing.*'fc1.weight'.*restart at 0"


MOMENT_CORRUPTIONS = {
    "negative exp_avg_sq": _negative,
    "NaN exp_avg_sq": _nan,
    "NaN exp_avg codes": _nan_codes,
    "steps 2.5": lambda m, n: (m["steps"].__setitem__(n, 2.5), r"\['steps'\]\['fc1.weight'\]=2.5\): must be an int")[1],
    "steps '7'": lambda m, n: (m["steps"].__setitem__(n, "7"), r"\['steps'\]\['fc1.weight'\]='7'\): must be an int")[1],
    "seed 'x'": lambda m, n: (m.__setitem__("seed", "x"), r"\['seed'\]='x'\): must be an int")[1],
    "missing parameter": _missing,
    "renamed parameter": _renamed,
    "shape of another model": lambda m, n: (m["moments"][n][0].__setitem__("shape", [3, 3]),
                                            r"\['shape'\]=\[3, 3\]\)")[1],
}


@pytest.mark.parametrize("kind", ["bf16-moments", "fp8-moments-kahan"])
@pytest.mark.parametrize("corruption", sorted(MOMENT_CORRUPTIONS))
def test_moments_refuse_each_corruption_by_name_and_change_nothing(kind: str, corruption: str) -> None:
    # BF16/FP8 Adam moments used to load unvalidated: a NaN or negative second moment made every weight NaN, a
    # missing or renamed parameter's moments restarted at 0, steps=2.5 or '7' were accepted.
    make = PLUGINS[kind]
    state = make().state_dict()
    key = "masters" if state["masters"] else "compact"
    match = MOMENT_CORRUPTIONS[corruption](state[key]["optimizer_state"], "fc1.weight")
    state["step_count"] += 5  # valid: a half load would show it
    target = make()
    before = copy.deepcopy(target.state_dict())
    with pytest.raises((TypeError, ValueError, KeyError), match=match) as error:
        target.load_state_dict(state)
    assert "load_state_dict" in str(error.value)
    after = target.state_dict()
    assert repr(after) == repr(before)  # nothing was half loaded


@pytest.mark.parametrize("kind", ["bf16-moments", "fp8-moments-kahan"])
def test_valid_moments_round_trip(kind: str) -> None:
    state = PLUGINS[kind]().state_dict()
    fresh = PLUGINS[kind]()
    fresh.load_state_dict(copy.deepcopy(state))
    assert repr(fresh.state_dict()) == repr(state)

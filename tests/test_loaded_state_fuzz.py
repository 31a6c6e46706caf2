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
    plugin.stepper.setup_optimizers(module, [torch.optim.SGD(module.parameters(), lr=0.1)])
    return plugin


PLUGINS = {
    "16-mixed": lambda: _plugin("16-mixed"),
    "adaptive": lambda: _plugin("16-mixed", scaler="adaptive"),
    "bf16-true": lambda: _plugin("bf16-true"),
    "kahan": lambda: _plugin("bf16-true", master_weights="kahan"),
}
CALLBACKS = {"ScaleCheckpoint": ScaleCheckpoint, "OverflowMonitor": OverflowMonitor,
             "PrecisionProbe": PrecisionProbe, "PrecisionFallback": PrecisionFallback, "AMPPreflight": AMPPreflight}


def _legitimate(state, path, value) -> bool:
    original = state
    for key in path:
        original = original[key]
    if isinstance(original, (float, torch.Tensor)) and value == 1.5:  # a fine ratio, scale or tensor value
        return True
    return any(str(path[-1]) == field and type(value) is type(ok) and value == ok for field, ok in LEGITIMATE)


def _paths(state, path=()):
    """Every field of a saved state (a dict of tensors by its first entry)."""
    if isinstance(state, dict) and state and path[-1:] not in (("result",),):
        items = list(state.items())
        if all(isinstance(v, torch.Tensor) for _, v in items):
            items = items[:1]
        for key, value in items:
            yield from _paths(value, (*path, key))
    elif path:
        yield path


def _corrupt(state, path, value):
    state = copy.deepcopy(state)
    target = state
    for key in path[:-1]:
        target = target[key]
    if isinstance(target[path[-1]], torch.Tensor) and isinstance(value, float):
        target[path[-1]] = torch.full_like(target[path[-1]], value)  # a NaN/inf tensor
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

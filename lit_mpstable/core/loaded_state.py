"""Checks of loaded state (checkpoints, snapshots, ``load_state_dict``): every field as its constructor checks it.

A corrupted checkpoint must be refused by name before anything is changed, never load silently (a NaN scale skips
every later step; ``"False"`` read as True is a global FP32 fallback) nor fail inside ``int()``. A failure names the
loader, the field, its value and the rule: ``StablePrecision.load_state_dict(scaler['scale']=nan): must be ...``.
``TypeError`` for a wrong type or a missing mapping, ``ValueError`` for a value out of range, ``KeyError`` for keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, get_args

import torch

from lit_mpstable.base.validate import bool_arg, check_keys, int_arg, real_arg
from lit_mpstable.core.formats import FormatName
from lit_mpstable.core.spike_state import OPTIONAL as GUARD_OPTIONAL

__all__ = [
    "Field", "check_fields", "check_mapping", "check_plugin_state", "count", "count_list", "flag", "finite",
    "finite_list", "finite_tensors", "name_list", "optional", "records", "tensor_tree", "text", "text_list",
]

Field = Callable[[str, str, Any], object]  # a check: raises on a bad value; what it returns is ignored
"""``(call, name, value)``: raises ``TypeError``/``ValueError`` naming ``call(name=value)`` unless ``value`` is
valid."""

# 1/scale must stay a finite FP32 number (unscaling multiplies by it).
_MIN_SCALE = 1.0 / torch.finfo(torch.float32).max
_MAX_SCALE = float(torch.finfo(torch.float32).max)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_mapping(call: str, value: Any, expected: set[str] | None = None, name: str = "state_dict") -> Mapping:
    """``value`` if it is a mapping (with exactly ``expected``'s keys when given).

    Raises:
        TypeError: not a mapping (``None``, a list, a string).
        KeyError: keys differ (each named).
    """
    if not isinstance(value, Mapping):
        raise TypeError(f"{call}({name}={_short(value)}): must be a dict, as state_dict() returns it.")
    if expected is not None:
        check_keys(call, value, expected, name=name,
                   suffix="; was the state written by another version of lit_mpstable?")
    return value


def check_fields(call: str, state: Mapping, fields: Mapping[str, Field], prefix: str = "") -> None:
    """Check each key of ``fields`` present in ``state`` with its check (keys are checked by the caller)."""
    for key, field in fields.items():
        if key in state:
            field(call, f"{prefix}{key}" if not prefix else f"{prefix}[{key!r}]", state[key])


# ------------------------------------------------------------------------------------------------ field checks
def count(call: str, name: str, value: Any) -> None:
    """An int >= 0 (not a bool, not a string)."""
    int_arg(call, name, value, low=0, unit="a count")


def flag(call: str, name: str, value: Any) -> None:
    """A bool (``"False"`` is a string, and a string is true)."""
    bool_arg(call, name, value)


def text(*allowed: str) -> Field:
    def check(call: str, name: str, value: Any) -> None:
        if not isinstance(value, str) or (allowed and value not in allowed):
            rule = f"one of {list(allowed)!r}" if allowed else "a string"
            raise (TypeError if not isinstance(value, str) else ValueError)(f"{call}({name}={_short(value)}): must be"
                                                                             f" {rule}.")
    return check


def finite(low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False) -> Field:
    """A finite real (a 0-dim tensor is read as its value) within the bounds."""
    def check(call: str, name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
            value = float(value)
        real_arg(call, name, value, low=low, high=high, low_open=low_open, high_open=high_open)
    return check


def optional(field: Field) -> Field:
    def check(call: str, name: str, value: Any) -> None:
        if value is not None:
            field(call, name, value)
    return check


def _sequence(call: str, name: str, value: Any) -> list:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{call}({name}={_short(value)}): must be a list.")
    return list(value)


def finite_list(low: float | None = None) -> Field:
    def check(call: str, name: str, value: Any) -> None:
        for index, item in enumerate(_sequence(call, name, value)):
            finite(low)(call, f"{name}[{index}]", item)
    return check


def count_list(call: str, name: str, value: Any) -> None:
    for index, item in enumerate(_sequence(call, name, value)):
        count(call, f"{name}[{index}]", item)


def name_list(call: str, name: str, value: Any) -> None:
    """A list of non-empty strings (module names)."""
    for index, item in enumerate(_sequence(call, name, value)):
        if not isinstance(item, str) or not item:
            raise (TypeError if not isinstance(item, str) else ValueError)(
                f"{call}({name}[{index}]={_short(item)}): must be a non-empty module name.")


def text_list(call: str, name: str, value: Any) -> None:
    for index, item in enumerate(_sequence(call, name, value)):
        if not isinstance(item, str):
            raise TypeError(f"{call}({name}[{index}]={_short(item)}): must be a string.")


def records(call: str, name: str, value: Any) -> None:
    """A list of dicts of plain values (a report: probe history, rollback events)."""
    for index, item in enumerate(_sequence(call, name, value)):
        if not isinstance(item, Mapping):
            raise TypeError(f"{call}({name}[{index}]={_short(item)}): must be a dict (one record).")


def finite_tensors(call: str, name: str, value: Any) -> None:
    """``{parameter name: floating tensor}`` with every element finite (one host read for all of them)."""
    check_mapping(call, value, name=name)
    tensors = []
    for key, tensor in value.items():
        if not isinstance(key, str) or not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise TypeError(f"{call}({name}[{key!r}]={_short(tensor)}): must be a floating tensor keyed by a"
                            " parameter name.")
        if tensor.numel():
            tensors.append(tensor.detach().abs().amax().float().cpu())
    if tensors and not bool(torch.stack(tensors).isfinite().all()):
        bad = [key for key, tensor in value.items() if tensor.numel() and not bool(tensor.isfinite().all())]
        raise ValueError(f"{call}({name}): the tensors of {bad[:5]} hold inf/NaN; the checkpoint is corrupted (or was"
                         " saved after the run diverged): resume from an earlier one.")


def tensor_tree(call: str, name: str, value: Any) -> None:
    """Nested dicts/lists of tensors and plain values (FP8 scaling state): floating tensors finite, no None."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.numel() and not bool(value.isfinite().all()):
            raise ValueError(f"{call}({name}): holds inf/NaN; the checkpoint is corrupted.")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            tensor_tree(call, f"{name}[{key!r}]", item)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            tensor_tree(call, f"{name}[{index}]", item)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{call}({name}={value!r}): must be finite.")
    elif value is None:
        raise TypeError(f"{call}({name}=None): must be a value.")


# ------------------------------------------------------------------------------------------------ the plugin
_SCALER: dict[str, Field] = {
    "scale": finite(_MIN_SCALE, _MAX_SCALE),
    "growth_factor": finite(1.0, low_open=True),
    "backoff_factor": finite(0.0, 1.0, low_open=True, high_open=True),
    "growth_interval": lambda c, n, v: int_arg(c, n, v, low=1),
    "_growth_tracker": count,
    "hysteresis": lambda c, n, v: int_arg(c, n, v, low=1),
    "_hysteresis_tracker": count,
    "min_scale": optional(finite(_MIN_SCALE, _MAX_SCALE)),
    "max_scale": optional(finite(_MIN_SCALE, _MAX_SCALE)),
    "overflow_count": count,
    "min_scale_hits": count,
    "step_count": count,
    "target_format": text(*get_args(FormatName)),
    "headroom": finite(1.0),
    "amax_history_len": lambda c, n, v: int_arg(c, n, v, low=1),
    "underflow_boost": finite(0.0, low_open=True),
    "overflowed_since_note": flag,
    "raise_blocked_until": count,
    "_amax_history": finite_list(0.0),
    "_extra_headroom": finite(0.0, low_open=True),
    "_last_overflow_scale": finite(0.0),
    "_overflow_streak": count,
}
def _fp8_state(call: str, name: str, value: Any) -> None:
    check_mapping(call, value, name=name)
    tensor_tree(call, name, value)


_LAYOUT: dict[str, Field] = {
    "fp32": flag, "fp8_off": flag, "fp8_removed": name_list, "fp32_modules": name_list, "fp8": _fp8_state,
}
_COMPACT: dict[str, Field] = {
    "mode": text("kahan", "stochastic"), "seed": lambda c, n, v: int_arg(c, n, v, low=0, high=2**63 - 1),
    "steps": lambda c, n, v: int_arg(c, n, v, low=0, high=2**63 - 1), "compensation": finite_tensors,
}


def check_plugin_state(call: str, state: Any, expected: set[str], precisions: tuple[str, ...]) -> None:
    """Check a plugin state dict (``PrecisionStepper.state_dict``'s keys) before anything of it is loaded.

    Raises:
        TypeError, ValueError, KeyError: a field is missing, unknown, of the wrong type or out of range (named).
    """
    check_mapping(call, state, expected)
    if not isinstance(state["precision"], str) or state["precision"] not in precisions:
        raise (ValueError if isinstance(state["precision"], str) else TypeError)(
            f"{call}(precision={_short(state['precision'])}): must be one of {list(precisions)}.")
    check_fields(call, state, {"step_count": count, "overflow_count": count, "skipped_steps": count,
                               "last_step_skipped": flag})
    if state["skipped_steps"] > state["step_count"]:
        raise ValueError(f"{call}(skipped_steps={state['skipped_steps']}, step_count={state['step_count']}): more"
                         " steps skipped than taken; the checkpoint is corrupted.")
    scaler = check_mapping(call, state["scaler"], name="scaler")
    if scaler and "scale" not in scaler:
        raise KeyError(f"{call}: scaler state {sorted(map(str, scaler))} has no 'scale'; every loss scaler saves one.")
    check_fields(call, scaler, _SCALER, prefix="scaler")
    low, high = scaler.get("min_scale"), scaler.get("max_scale")
    if low is not None and high is not None and low > high:
        raise ValueError(f"{call}(scaler['min_scale']={low!r}, scaler['max_scale']={high!r}): min_scale must not"
                         " exceed max_scale.")
    if "_amax_history" in scaler and "amax_history_len" in scaler and len(scaler["_amax_history"]) != scaler[
            "amax_history_len"]:
        raise ValueError(f"{call}(scaler['_amax_history'] of length {len(scaler['_amax_history'])}): must hold"
                         f" amax_history_len={scaler['amax_history_len']} values.")
    layout = check_mapping(call, state["layout"], name="layout")
    check_fields(call, layout, _LAYOUT, prefix="layout")
    # "optimizer_state": BF16/FP8 Adam moments a keeper holds (checked when the keeper loads them).
    masters = check_mapping(call, state["masters"], name="masters")
    finite_tensors(call, "masters", {k: v for k, v in masters.items() if k != "optimizer_state"})
    compact = check_mapping(call, state["compact"], name="compact")
    if compact:
        check_mapping(call, compact, set(_COMPACT) | ({"optimizer_state"} & set(compact)), name="compact")
        check_fields(call, compact, _COMPACT, prefix="compact")
    check_mapping(call, state["op_policy"], name="op_policy")
    count_list(call, "schedules", state["schedules"])
    guard = check_mapping(call, state["spike_guard"], name="spike_guard")  # its values: SpikeGuard.load_state_dict
    if guard:  # {} without a guard; otherwise SpikeGuard.state_dict's keys, whether or not this run has a guard
        check_mapping(call, guard, {"window", "loss", "loss_count", "grad_norm", "grad_norm_count", "spikes_skipped"}
                      | (GUARD_OPTIONAL & set(guard)), name="spike_guard")
    recast = check_mapping(call, state.get("recast", {}), name="recast")  # present while a fallback recasts
    if recast:
        check_mapping(call, recast, {"weights", "optimizer_state"}, name="recast")
        finite_tensors(call, "recast['weights']", recast["weights"])
        moments = check_mapping(call, recast["optimizer_state"], name="recast['optimizer_state']")
        for name, entry in moments.items():  # {parameter name: {state key: tensor}}
            finite_tensors(call, f"recast['optimizer_state'][{name!r}]", entry)
    growth = check_mapping(call, state["growth"], name="growth")  # its values: GrowthMonitor.check_state
    if growth:  # {} without a growth monitor; otherwise GrowthMonitor.state_dict's keys, with a monitor or not
        check_mapping(call, growth, {"steps", "samples", "sampled", "layers"}, name="growth")


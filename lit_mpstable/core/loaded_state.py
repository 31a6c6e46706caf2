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
from lit_mpstable.core.moment_codec import BLOCK_SIZE
from lit_mpstable.core.spike_state import OPTIONAL as GUARD_OPTIONAL

Field = Callable[[str, str, Any], object]  # a check: raises on a bad value; what it returns is ignored
"""``(call, name, value)``: raises ``TypeError``/``ValueError`` naming ``call(name=value)`` unless ``value`` is
valid."""

# 1/scale must stay a finite FP32 number (unscaling multiplies by it).
_MIN_SCALE = 1.0 / torch.finfo(torch.float32).max
_MAX_SCALE = float(torch.finfo(torch.float32).max)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_mapping(call: str, value: object, expected: set[str] | None = None, name: str = "state_dict") -> Mapping:
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
def count(call: str, name: str, value: object) -> None:
    """An int >= 0 (not a bool, not a string)."""
    int_arg(call, name, value, low=0, unit="a count")


def flag(call: str, name: str, value: object) -> None:
    """A bool (``"False"`` is a string, and a string is true)."""
    bool_arg(call, name, value)


def text(*allowed: str) -> Field:
    def check(call: str, name: str, value: object) -> None:
        if not isinstance(value, str) or (allowed and value not in allowed):
            rule = f"one of {list(allowed)!r}" if allowed else "a string"
            raise (TypeError if not isinstance(value, str) else ValueError)(f"{call}({name}={_short(value)}): must be"
                                                                             f" {rule}.")
    return check


def finite(low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False) -> Field:
    """A finite real (a 0-dim tensor is read as its value) within the bounds."""
    def check(call: str, name: str, value: object) -> None:
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
            value = float(value)
        real_arg(call, name, value, low=low, high=high, low_open=low_open, high_open=high_open)
    return check


def optional(field: Field) -> Field:
    def check(call: str, name: str, value: object) -> None:
        if value is not None:
            field(call, name, value)
    return check


def _sequence(call: str, name: str, value: object) -> list:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{call}({name}={_short(value)}): must be a list.")
    return list(value)


def finite_list(low: float | None = None) -> Field:
    def check(call: str, name: str, value: object) -> None:
        for index, item in enumerate(_sequence(call, name, value)):
            finite(low)(call, f"{name}[{index}]", item)
    return check


def count_list(call: str, name: str, value: object) -> None:
    for index, item in enumerate(_sequence(call, name, value)):
        count(call, f"{name}[{index}]", item)


def name_list(call: str, name: str, value: object) -> None:
    """A list of non-empty strings (module names)."""
    for index, item in enumerate(_sequence(call, name, value)):
        if not isinstance(item, str) or not item:
            raise (TypeError if not isinstance(item, str) else ValueError)(
                f"{call}({name}[{index}]={_short(item)}): must be a non-empty module name.")


def text_list(call: str, name: str, value: object) -> None:
    for index, item in enumerate(_sequence(call, name, value)):
        if not isinstance(item, str):
            raise TypeError(f"{call}({name}[{index}]={_short(item)}): must be a string.")


def records(call: str, name: str, value: object) -> None:
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


def tensor_tree(call: str, name: str, value: object) -> None:
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


# ------------------------------------------------------------------------------------------------ Adam moments
# What ``MomentStore.state_dict`` and ``AdamMoments.state_dict`` (``optimizer_state="bf16"``/``"fp8"``) save. A bad
# moment is no smaller a fault than a bad master: a NaN or negative second moment makes every later update NaN.
_STORE_KEYS = {"kind", "shape", "signed", "rounding", "seed", "key", "tensors"}
_STORE_TENSORS = {"fp32": {"value"}, "bf16": {"value"}, "fp8": {"codes", "amax", "k"}}
_VALUE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# FP8 moments of an earlier version were kept in blocks of another power of two (MomentStore re-encodes them).
_BLOCK_SIZES = (BLOCK_SIZE, *(2**e for e in range(4, 11) if 2**e != BLOCK_SIZE))
_Deferred = list[tuple[str, torch.Tensor, str]]  # (field, a 0-dim bool tensor that is True when bad, the rule)


def _seed(call: str, name: str, value: object) -> None:
    int_arg(call, name, value, low=0, high=2**63 - 1)


def _tensor(call: str, name: str, value: object, dtype: torch.dtype, numel: int | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != dtype:
        got = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else _short(value)
        raise TypeError(f"{call}({name}={got}): must be a {dtype} tensor, as MomentStore.state_dict() saves it.")
    if numel is not None and value.numel() != numel:
        raise ValueError(f"{call}({name} of {value.numel()} elements): the moment has {numel}.")
    return value


def _store_checks(call: str, name: str, value: Any, kind: str, signed: bool) -> _Deferred:
    """The checks of one stored moment that need no tensor read, then those that do (returned, to be read at once)."""
    check_mapping(call, value, _STORE_KEYS, name=name)
    text(kind)(call, f"{name}['kind']", value["kind"])
    count_list(call, f"{name}['shape']", value["shape"])
    flag(call, f"{name}['signed']", value["signed"])
    if value["signed"] != signed:
        raise ValueError(f"{call}({name}['signed']={value['signed']!r}): must be {signed}: exp_avg is stored signed,"
                         " exp_avg_sq (non-negative) unsigned.")
    text("stochastic", "nearest")(call, f"{name}['rounding']", value["rounding"])
    _seed(call, f"{name}['seed']", value["seed"])
    _seed(call, f"{name}['key']", value["key"])
    tensors = check_mapping(call, value["tensors"], _STORE_TENSORS[kind], name=f"{name}['tensors']")
    numel = math.prod(value["shape"])
    where = f"{name}['tensors']"
    if kind != "fp8":
        stored = _tensor(call, f"{where}['value']", tensors["value"], _VALUE_DTYPES[kind])
        if stored.numel() != numel:
            raise ValueError(f"{call}({name}['shape']={value['shape']!r}): {numel} elements, but tensors['value']"
                             f" holds {stored.numel()}.")
        checks = [(f"{where}['value']", ~stored.isfinite().all(), "holds inf/NaN")]
        if not signed:
            checks.append((f"{where}['value']", (stored < 0).any(), "holds negative values; exp_avg_sq is a mean of"
                           " squares (>= 0), and its square root would make every update NaN"))
        return checks
    codes = _tensor(call, f"{where}['codes']", tensors["codes"], torch.float8_e4m3fn if signed else torch.uint8)
    if codes.numel() != numel:
        raise ValueError(f"{call}({name}['shape']={value['shape']!r}): {numel} elements, but tensors['codes'] holds"
                         f" {codes.numel()}.")
    amax = _tensor(call, f"{where}['amax']", tensors["amax"], torch.float32)
    blocks = -(-numel // BLOCK_SIZE)
    if amax.dim() != 1 or amax.numel() not in {-(-numel // size) for size in _BLOCK_SIZES}:
        raise ValueError(f"{call}({name}: tensors['amax'] has shape {tuple(amax.shape)}, this store's has"
                         f" ({blocks},)): one value per block of {BLOCK_SIZE} elements (or of an earlier version's"
                         " block size).")
    _tensor(call, f"{where}['k']", tensors["k"], torch.float32, amax.numel())
    k = tensors["k"]
    checks = [(f"{where}['amax']", ~(amax.isfinite() & (amax >= 0)).all(), "holds inf/NaN or negative values; must"
               " be finite and >= 0 (each block's largest magnitude)"),
              (f"{where}['k']", ~(k.isfinite() & (k > 0)).all(), "holds inf/NaN or values <= 0; must be finite and > 0"
               " (each block's range-expansion exponent)")]
    if signed:  # E4M3's codes 0x7f and 0xff are NaN; E4M4 (uint8) has none
        checks.append((f"{where}['codes']", ((codes.view(torch.uint8) & 127) == 127).any(), "holds NaN codes"
                       " (0x7f/0xff)"))
    return checks


def _refuse_deferred(call: str, checks: _Deferred) -> None:
    """Raise for the first failed check of ``checks``, reading all of them in one transfer."""
    if not checks:
        return
    by_device: dict[torch.device, list[int]] = {}
    for index, (_, bad, _) in enumerate(checks):
        by_device.setdefault(bad.device, []).append(index)
    failed = torch.zeros(len(checks), dtype=torch.bool)
    for indices in by_device.values():  # one transfer per device
        failed[indices] = torch.stack([checks[index][1].detach() for index in indices]).cpu()
    if bool(failed.any()):
        name, _, rule = checks[int(failed.nonzero()[0])]
        raise ValueError(f"{call}({name}): {rule}; the checkpoint is corrupted (or was saved after the run"
                         " diverged): resume from an earlier one.")


def moment_store(kind: str, signed: bool) -> Field:
    """One ``MomentStore.state_dict()`` of an Adam moment kept in ``kind``; ``signed``: ``exp_avg`` (else the
    non-negative ``exp_avg_sq``)."""
    def check(call: str, name: str, value: object) -> None:
        _refuse_deferred(call, _store_checks(call, name, value, kind, signed))
    return check


def moment_state(call: str, name: str, value: Any) -> None:
    """``AdamMoments.state_dict()``: ``kind``, ``seed``, ``steps`` and ``moments`` by parameter name (the names are the
    keeper's to check against its parameters). One host read for all the tensors."""
    check_mapping(call, value, {"kind", "seed", "steps", "moments"}, name=name)
    text("bf16", "fp8")(call, f"{name}['kind']", value["kind"])
    kind = value["kind"]
    _seed(call, f"{name}['seed']", value["seed"])
    steps = check_mapping(call, value["steps"], name=f"{name}['steps']")
    for key, step in steps.items():
        count(call, f"{name}['steps'][{key!r}]", step)
    moments = check_mapping(call, value["moments"], name=f"{name}['moments']")
    check_keys(call, moments, steps, name=f"{name}['moments']", suffix=f" (the parameters of {name}['steps']).")
    checks: _Deferred = []
    for key, pair in moments.items():
        where = f"{name}['moments'][{key!r}]"
        if not isinstance(key, str) or not key:
            raise TypeError(f"{call}({where}): must be keyed by a parameter name.")
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise TypeError(f"{call}({where}={_short(pair)}): must be [exp_avg, exp_avg_sq], two stored moments.")
        checks += _store_checks(call, f"{where}[0]", pair[0], kind, True)
        checks += _store_checks(call, f"{where}[1]", pair[1], kind, False)
        if pair[0]["shape"] != pair[1]["shape"]:
            raise ValueError(f"{call}({where}[1]['shape']={pair[1]['shape']!r}): exp_avg has shape"
                             f" {pair[0]['shape']!r}; both moments have their parameter's shape.")
    _refuse_deferred(call, checks)


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
def _fp8_state(call: str, name: str, value: object) -> None:
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
    # "optimizer_state": BF16/FP8 Adam moments a keeper holds (their names are checked against its parameters).
    masters = check_mapping(call, state["masters"], name="masters")
    finite_tensors(call, "masters", {k: v for k, v in masters.items() if k != "optimizer_state"})
    check_fields(call, masters, {"optimizer_state": moment_state}, prefix="masters")
    compact = check_mapping(call, state["compact"], name="compact")
    if compact:
        check_mapping(call, compact, set(_COMPACT) | ({"optimizer_state"} & set(compact)), name="compact")
        check_fields(call, compact, {**_COMPACT, "optimizer_state": moment_state}, prefix="compact")
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


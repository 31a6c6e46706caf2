"""Checks of loaded state (checkpoints, snapshots, ``load_state_dict``): every field as its constructor checks it.

A corrupted checkpoint must be refused by name before anything is changed, never load silently (a NaN scale skips
every later step; ``"False"`` read as True is a global FP32 fallback) nor fail inside ``int()``. A failure names the
loader, the field, its value and the rule: ``StablePrecision.load_state_dict(scaler['scale']=nan): must be ...``.
``TypeError`` for a wrong type or a missing mapping, ``ValueError`` for a value out of range, ``KeyError`` for keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from lit_mpstable.base.validate import bool_arg, check_keys, int_arg, real_arg

Field = Callable[[str, str, object], object]  # a check: raises on a bad value; what it returns is ignored
"""``(call, name, value)``: raises ``TypeError``/``ValueError`` naming ``call(name=value)`` unless ``value`` is
valid."""


def short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_mapping(call: str, value: object, expected: set[str] | None = None, name: str = "state_dict") -> Mapping:
    """``value`` if it is a mapping (with exactly ``expected``'s keys when given).

    Raises:
        TypeError: not a mapping (``None``, a list, a string).
        KeyError: keys differ (each named).
    """
    if not isinstance(value, Mapping):
        raise TypeError(f"{call}({name}={short(value)}): must be a dict, as state_dict() returns it.")
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
            raise (TypeError if not isinstance(value, str) else ValueError)(f"{call}({name}={short(value)}): must be"
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
        raise TypeError(f"{call}({name}={short(value)}): must be a list.")
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
                f"{call}({name}[{index}]={short(item)}): must be a non-empty module name.")


def text_list(call: str, name: str, value: object) -> None:
    for index, item in enumerate(_sequence(call, name, value)):
        if not isinstance(item, str):
            raise TypeError(f"{call}({name}[{index}]={short(item)}): must be a string.")


def records(call: str, name: str, value: object) -> None:
    """A list of dicts of plain values (a report: probe history, rollback events)."""
    for index, item in enumerate(_sequence(call, name, value)):
        if not isinstance(item, Mapping):
            raise TypeError(f"{call}({name}[{index}]={short(item)}): must be a dict (one record).")


def finite_tensors(call: str, name: str, value: object) -> None:
    """``{parameter name: floating tensor}`` with every element finite (one host read for all of them)."""
    value = check_mapping(call, value, name=name)
    tensors = []
    for key, tensor in value.items():
        if not isinstance(key, str) or not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise TypeError(f"{call}({name}[{key!r}]={short(tensor)}): must be a floating tensor keyed by a"
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

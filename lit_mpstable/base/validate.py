"""Argument checks shared by every public constructor: a failure names the call, the argument, its value and the rule.

``TypeError`` for a value of the wrong type (``True`` is not an int here, ``"yes"`` is not a bool), ``ValueError``
for one out of range. Torch keeps counters such as GradScaler's growth tracker in int32, so ints are bounded by
``INT32_MAX`` unless a caller says otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal, overload

INT32_MAX = 2**31 - 1


def _echo(call: str, name: str, value: Any) -> str:
    return f"{call}({name}={value!r})"


def bool_arg(call: str, name: str, value: Any) -> bool:
    """``value`` if it is a bool.

    Raises:
        TypeError: anything else (``1``, ``"yes"``, ``None``).
    """
    if not isinstance(value, bool):
        raise TypeError(f"{_echo(call, name, value)}: must be True or False.")
    return value


# Overloads: without ``none=True`` the result is never None, so callers need no narrowing.
@overload
def int_arg(
    call: str, name: str, value: Any, *, low: int | None = ..., high: int | None = ..., none: Literal[False] = ...,
    unit: str = ...,
) -> int: ...
@overload
def int_arg(
    call: str, name: str, value: Any, *, low: int | None = ..., high: int | None = ..., none: bool, unit: str = ...,
) -> int | None: ...
def int_arg(
    call: str, name: str, value: Any, *, low: int | None = None, high: int | None = INT32_MAX, none: bool = False,
    unit: str = "",
) -> int | None:
    """``value`` if it is an int (not a bool) in ``[low, high]``, or None when ``none`` allows it.

    Raises:
        TypeError: not an int.
        ValueError: out of range.
    """
    if value is None and none:
        return None
    where = f"an int in [{'-inf' if low is None else low}, {'inf' if high is None else high}]"
    hint = f" ({unit})" if unit else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_echo(call, name, value)}: must be {where}{' or None' if none else ''}{hint}.")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{_echo(call, name, value)}: must be {where}{hint}.")
    return value


@overload
def real_arg(
    call: str, name: str, value: Any, *, low: float | None = ..., high: float | None = ...,
    low_open: bool = ..., high_open: bool = ..., none: Literal[False] = ..., unit: str = ...,
) -> float: ...
@overload
def real_arg(
    call: str, name: str, value: Any, *, low: float | None = ..., high: float | None = ...,
    low_open: bool = ..., high_open: bool = ..., none: bool, unit: str = ...,
) -> float | None: ...
def real_arg(
    call: str, name: str, value: Any, *, low: float | None = None, high: float | None = None,
    low_open: bool = False, high_open: bool = False, none: bool = False, unit: str = "",
) -> float | None:
    """``value`` as a float if it is a finite real number (not a bool) within the bounds, or None when allowed.

    Raises:
        TypeError: not a real number.
        ValueError: NaN, infinite or out of range.
    """
    if value is None and none:
        return None
    lo = "(" if low_open or low is None else "["
    hi = ")" if high_open or high is None else "]"
    low_text = "-inf" if low is None else f"{low:g}"
    high_text = "inf" if high is None else f"{high:g}"
    where = f"a finite number in {lo}{low_text}, {high_text}{hi}"
    hint = f" ({unit})" if unit else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{_echo(call, name, value)}: must be {where}{' or None' if none else ''}{hint}.")
    number = float(value)
    below = low is not None and (number <= low if low_open else number < low)
    above = high is not None and (number >= high if high_open else number > high)
    if not math.isfinite(number) or below or above:
        raise ValueError(f"{_echo(call, name, value)}: must be {where}{hint}.")
    return number


def choice_arg(call: str, name: str, value: Any, allowed: Iterable[Any]) -> Any:
    """``value`` if it is one of ``allowed`` (compared by equality and type, so ``1`` is not ``True``).

    Raises:
        ValueError: anything else.
    """
    options = list(allowed)
    if not any(type(value) is type(option) and value == option for option in options):
        raise ValueError(f"{_echo(call, name, value)}: allowed values are {options!r}.")
    return value


def check_keys(call: str, keys: Iterable[Any], expected: Iterable[Any], *, suffix: str = ".", name: str = "",
               error: type[KeyError] = KeyError) -> None:
    """The one strict-keys check of loaded state: refuse ``keys`` unless they are exactly ``expected``.

    Args:
        call: what was called, e.g. ``"PrecisionLayout.load_state_dict"``.
        suffix: the likely cause, e.g. ``"; saved with another FP8 recipe?"`` (the message ends with it).
        name: the loaded mapping's name, when it is not the whole state (``"state_dict['scaler']"``).
        error: the ``KeyError`` subclass to raise.

    Raises:
        KeyError: a key is missing or unknown; the message lists both.
    """
    keys, expected = set(keys), set(expected)
    if keys != expected:
        missing, unknown = sorted(expected - keys), sorted(map(str, keys - expected))
        where = f"{name} has " if name else ""
        raise error(f"{call}: {where}missing keys {missing}, unknown keys {unknown}{suffix}")

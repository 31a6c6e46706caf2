"""A loss scaler's state: the device it is built for, and the checks a loaded state dict passes before it is used."""

from __future__ import annotations

from typing import Any

import torch

from lit_mpstable.base.validate import bool_arg, check_keys, choice_arg, int_arg, real_arg

# The keys torch.amp.GradScaler.state_dict() writes; a dict with exactly these loads as a legacy checkpoint.
GRADSCALER_KEYS = frozenset({"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})
# Lowest scale when min_scale is None: the smallest normal float32, so 1/scale stays finite.
SCALE_FLOOR = torch.finfo(torch.float32).tiny

_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps")


def resolve_device(call: str, device: str | None) -> str:
    """The device type a scaler is built for: ``device``, or for None CUDA when available, else the CPU.

    Raises:
        ValueError: not a device type a loss scaler runs on.
    """
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice_arg(call, "device", device, _DEVICE_TYPES)


class StateKeyError(KeyError, ValueError):
    """A loaded state dict's keys differ from the expected ones (a ``KeyError``, and a ``ValueError`` like every other
    refused loaded value)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def check_loaded(call: str, state: dict[str, Any], *, floor: float) -> None:
    """Validate a DynamicLossScaler (or plain GradScaler) state dict field by field, as the constructor does.

    Raises:
        TypeError: a field has the wrong type (``"False"`` is not a bool, ``3.0`` is not an int).
        ValueError: a field is out of range, or two fields disagree (each message names them).
    """
    real_arg(call, "scale", state["scale"], low=floor, unit="the scale must be finite and >= 2**-126 (or min_scale)"
             " so that 1/scale is finite; the checkpoint is corrupt")
    real_arg(call, "growth_factor", state["growth_factor"], low=1.0, low_open=True, unit="clean steps grow the scale"
             " by it")
    real_arg(call, "backoff_factor", state["backoff_factor"], low=0.0, high=1.0, low_open=True, high_open=True,
             unit="an overflow shrinks the scale by it")
    int_arg(call, "growth_interval", state["growth_interval"], low=1)
    int_arg(call, "_growth_tracker", state["_growth_tracker"], low=0, unit="clean steps since the last growth")
    if "hysteresis" not in state:
        return
    int_arg(call, "hysteresis", state["hysteresis"], low=1)
    int_arg(call, "_hysteresis_tracker", state["_hysteresis_tracker"], low=0, high=state["hysteresis"],
            unit="overflows still tolerated, at most hysteresis")
    real_arg(call, "min_scale", state["min_scale"], low=0.0, low_open=True, none=True)
    real_arg(call, "max_scale", state["max_scale"], low=0.0, low_open=True, none=True)
    if state["min_scale"] is not None and state["max_scale"] is not None and state["min_scale"] > state["max_scale"]:
        raise ValueError(f"{call}(min_scale={state['min_scale']!r}, max_scale={state['max_scale']!r}): min_scale must"
                         " be <= max_scale; the checkpoint is corrupt.")
    if state["min_scale"] is not None and state["scale"] < state["min_scale"]:
        raise ValueError(f"{call}(scale={state['scale']!r}, min_scale={state['min_scale']!r}): the scale must be >="
                         " min_scale; the checkpoint is corrupt.")
    for key in ("overflow_count", "min_scale_hits", "step_count"):
        int_arg(call, key, state[key], low=0, high=None, unit="a counter")


def check_new_scale(call: str, new_scale: Any) -> None:
    """``update(new_scale=...)``: a finite scale >= 2**-126, as a float or a one-element tensor (read: one sync)."""
    if isinstance(new_scale, torch.Tensor):
        if new_scale.numel() != 1 or not new_scale.is_floating_point():
            raise ValueError(f"{call}(new_scale={new_scale!r}): a one-element floating tensor or a float is needed.")
        value = float(new_scale.detach().reshape(()).item())
    else:
        value = new_scale
    real_arg(call, "new_scale", value, low=SCALE_FLOOR, unit="a finite scale >= 2**-126, so that 1/scale is finite")


def check_state_keys(call: str, keys: set[str], expected: set[str]) -> None:
    """Refuse a loaded state dict whose keys differ from ``expected`` (the keys this scaler's ``state_dict()`` writes).

    Raises:
        StateKeyError: a key is missing or unknown (the message lists both).
    """
    check_keys(call, keys, expected, error=StateKeyError,
               suffix="; was it saved by a different scaler class or version?")


def check_init_args(name: str, init_scale: float, growth_factor: float, backoff_factor: float, growth_interval: int,
                    hysteresis: int, min_scale: float | None, max_scale: float | None, enabled: bool) -> None:
    """Validate ``DynamicLossScaler``'s constructor arguments (``name`` is the class being built).

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of range, or two disagree (each message names them and the rule).
    """
    real_arg(name, "init_scale", init_scale, low=SCALE_FLOOR, unit="the scale stays >= 2**-126, the smallest"
             " normal float32, so that 1/scale is finite; 2.**16 is usual")
    real_arg(name, "growth_factor", growth_factor, low=1.0, low_open=True,
             unit="clean steps grow the scale by it; 2.0 is usual")
    real_arg(name, "backoff_factor", backoff_factor, low=0.0, high=1.0, low_open=True, high_open=True,
             unit="an overflow shrinks the scale by it; 0.5 is usual")
    int_arg(name, "growth_interval", growth_interval, low=1, unit="clean steps between growths; torch keeps the"
            " tracker in int32")
    int_arg(name, "hysteresis", hysteresis, low=1, unit="overflowing steps tolerated before a backoff; 1 backs"
            " off on every overflow, as GradScaler does")
    real_arg(name, "min_scale", min_scale, low=0.0, low_open=True, none=True)
    real_arg(name, "max_scale", max_scale, low=0.0, low_open=True, none=True)
    bool_arg(name, "enabled", enabled)
    if min_scale is not None and max_scale is not None and min_scale > max_scale:
        raise ValueError(f"{name}(min_scale={min_scale!r}, max_scale={max_scale!r}): min_scale must be <= max_scale.")
    if min_scale is not None and init_scale < min_scale:
        raise ValueError(f"{name}(init_scale={init_scale!r}): init_scale must be >= min_scale={min_scale!r}.")

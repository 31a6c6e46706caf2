"""A saved :class:`~lit_mpstable.core.guards.spike.SpikeGuard` state checked value by value before anything is
restored."""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch

OPTIONAL = frozenset({"consecutive_spikes", "level_shifts"})
"""Keys a state may lack (saved before they existed): they load as 0."""


def checked_state(
    state: object, expected: set[str], names: Sequence[str], window: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """A SpikeGuard state checked whole before anything is restored: :func:`saved_statistics` and the run of
    consecutive spikes and the level shifts (0 where a state saved before them lacks them).

    Raises:
        KeyError: keys differ from ``expected`` (beyond the optional ones; each is named).
        TypeError: a value has the wrong type.
        ValueError: another ``window``, a buffer of the wrong shape or holding inf/NaN, a negative count.
    """
    call = "SpikeGuard.load_state_dict"
    if not isinstance(state, dict):
        raise TypeError(f"{call}(state={type(state).__name__}): expected the dict from SpikeGuard.state_dict().")
    if not expected - OPTIONAL <= set(state) <= expected:
        missing, unknown = sorted(expected - OPTIONAL - set(state)), sorted(set(state) - set(expected))
        raise KeyError(f"{call}: missing keys {missing}, unknown keys {unknown}; was it saved by another version"
                       " of lit_mpstable, or is it not a SpikeGuard's state?")
    if state["window"] != window or isinstance(state["window"], bool):
        raise ValueError(f"{call}: state['window']={state['window']!r} but this guard has window={window!r};"
                         " the ring buffers cannot be resized exactly: build the guard with the saved window.")
    run, shifts = (int(count_value(call, key, state.get(key, 0))) for key in ("consecutive_spikes", "level_shifts"))
    return (*saved_statistics(call, state, names, window), run, shifts)


def saved_statistics(
    call: str, state: dict[str, Any], names: Sequence[str], window: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ring buffers (``(len(names), window)`` FP32), their counts (int64) and the skipped spikes (0-dim int64)
    of a state whose keys were checked already, on the CPU.

    Raises:
        TypeError: a buffer is not a floating-point tensor, or a count not an integer.
        ValueError: a buffer of the wrong shape or holding inf/NaN, a negative count.
    """
    values, counts = [], []
    for name in names:
        buf = state[name]
        if not isinstance(buf, torch.Tensor) or not buf.is_floating_point():
            raise TypeError(f"{call}: state[{name!r}] must be a floating-point tensor, got {buf!r}.")
        if tuple(buf.shape) != (window,):
            raise ValueError(f"{call}: state[{name!r}] has shape {tuple(buf.shape)}, expected ({window},)"
                             " (one value per step of the window).")
        if not bool(torch.isfinite(buf).all()):  # a host read, at load time only
            raise ValueError(f"{call}: state[{name!r}] holds inf/NaN; only finite values of applied steps enter"
                             " the statistics, so this state is corrupt.")
        values.append(buf.detach().to("cpu", torch.float32))
        counts.append(count_value(call, f"{name}_count", state[f"{name}_count"]))
    return torch.stack(values), torch.stack(counts), count_value(call, "spikes_skipped", state["spikes_skipped"])


def count_value(call: str, key: str, value: object) -> torch.Tensor:
    """A saved count as a 0-dim int64 tensor; refused if negative or not an integer."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point() or value.dtype == torch.bool:
            raise TypeError(f"{call}: state[{key!r}]={value!r} must be an integer 0-dim tensor or an int.")
        tensor = value.detach().reshape(()).to(torch.int64)
    elif isinstance(value, int) and not isinstance(value, bool):
        tensor = torch.tensor(value, dtype=torch.int64)
    else:
        raise TypeError(f"{call}: state[{key!r}]={value!r} must be an integer 0-dim tensor or an int.")
    if int(tensor) < 0:
        raise ValueError(f"{call}: state[{key!r}]={int(tensor)} is negative; a count of applied steps cannot be.")
    return tensor.clone()


def watch_arg(call: str, watch: object, names: tuple[str, ...]) -> tuple[str, ...]:
    """``watch`` checked: the names it gives from ``names``, in their order."""
    # Any sequence or set of names (a Hydra ListConfig too), never a bare string (its letters are no names).
    if isinstance(watch, (str, bytes)) or not isinstance(watch, (Sequence, AbstractSet)):
        raise TypeError(f"{call}(watch={watch!r}): must be a tuple of names from {names!r}, e.g. ('loss',).")
    given = tuple(watch)
    bad = [name for name in given if name not in names]
    if bad:
        raise ValueError(f"{call}(watch={watch!r}): {bad[0]!r} is not one of {names!r}.")
    if not given:
        raise ValueError(f"{call}(watch={watch!r}): must name at least one of {names!r}; to turn spike skipping"
                         " off, leave spike_guard=None.")
    if len(set(given)) != len(given):
        raise ValueError(f"{call}(watch={watch!r}): each name at most once.")
    return tuple(name for name in names if name in given)

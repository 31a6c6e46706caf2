"""A saved :class:`~lit_mpstable.core.spike.SpikeGuard` state checked value by value before anything is restored."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["saved_statistics"]


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
        counts.append(_count(call, f"{name}_count", state[f"{name}_count"]))
    return torch.stack(values), torch.stack(counts), _count(call, "spikes_skipped", state["spikes_skipped"])


def _count(call: str, key: str, value: Any) -> torch.Tensor:
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

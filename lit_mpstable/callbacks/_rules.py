"""The callbacks' decisions as pure functions: plain values and tensors in, plain values out; no Lightning, no state."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn


def fallback_reason(
    *, overflow_run: int, patience: int, loss_scale: float | None, min_scale: float | None, nonfinite_run: int,
    nonfinite_patience: int | None, overflow_rate: float | None, max_overflow_rate: float | None, window: int,
) -> str | None:
    """Why the run should widen its precision now, or ``None``. ``loss_scale``/``overflow_rate`` are ``None`` when
    not measured this step; ``min_scale``/``nonfinite_patience``/``max_overflow_rate`` ``None`` when disabled."""
    if overflow_run >= patience:
        return f"{overflow_run} consecutive steps overflowed (patience={patience})"
    if loss_scale is not None and min_scale is not None and loss_scale <= min_scale:
        return f"the loss scale fell to {loss_scale:g} (min_scale={min_scale:g})"
    if nonfinite_patience is not None and nonfinite_run >= nonfinite_patience:
        return (f"the loss was non-finite on {nonfinite_run} consecutive steps"
                f" (nonfinite_loss_patience={nonfinite_patience})")
    if overflow_rate is not None and max_overflow_rate is not None and overflow_rate > max_overflow_rate:
        return f"{overflow_rate:.1%} of the last {window} steps overflowed (max_overflow_rate={max_overflow_rate:.1%})"
    return None


def compare_outputs(reference: torch.Tensor, low: torch.Tensor, *, atol: float, rtol: float) -> dict[str, Any]:
    """Max abs and relative (to the reference's max abs) error of ``low`` against ``reference``, and how many
    values are non-finite in ``low`` only; ``passed`` when there are none and ``max abs <= atol + rtol * max|ref|``.
    One host sync."""
    ref, out = reference.detach().float(), low.detach().float().reshape(reference.shape)
    ref_ok, out_ok = torch.isfinite(ref), torch.isfinite(out)
    zero = ref.new_zeros(())
    err = torch.where(ref_ok & out_ok, (out - ref).abs(), 0.0).amax() if ref.numel() else zero
    scale = torch.where(ref_ok, ref.abs(), 0.0).amax() if ref.numel() else zero
    abs_err, ref_max, n_bad = torch.stack([err, scale, (ref_ok & ~out_ok).sum().float()]).tolist()
    rel_err = abs_err / ref_max if ref_max > 0 else (0.0 if abs_err == 0 else float("inf"))
    return {
        "max_abs_error": abs_err, "max_rel_error": rel_err, "ref_max_abs": ref_max, "nonfinite": int(n_bad),
        "passed": n_bad == 0 and abs_err <= atol + rtol * ref_max,
    }


def first_tensor(output: Any) -> torch.Tensor:
    """The first floating-point tensor in a (nested) model output.

    Raises:
        TypeError: there is none.
    """
    found: list[torch.Tensor] = []
    apply_to_collection(output, torch.Tensor, lambda t: found.append(t) if t.is_floating_point() else None)
    if not found:
        raise TypeError(f"the forward returned no floating-point tensor ({type(output).__name__})")
    return found[0]


def default_forward(module: nn.Module, batch: Any) -> Any:
    """``module(**batch)`` for a mapping, ``module(*batch)`` when ``forward`` takes the whole tuple (inputs and
    targets), else ``module(batch[0])``; ``module(batch)`` for anything else."""
    if isinstance(batch, Mapping):
        return module(**batch)
    if isinstance(batch, (tuple, list)) and batch:
        try:
            inspect.signature(module.forward).bind(*batch)
        except TypeError:
            return module(batch[0])
        return module(*batch)
    return module(batch)

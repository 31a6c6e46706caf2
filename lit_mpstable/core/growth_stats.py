"""The statistics behind :class:`~lit_mpstable.core.growth.GrowthMonitor`, computed in two halves to keep a sampled
step cheap.

A sample is launch-bound on small activations (a 64 x 256 input is a few microseconds of arithmetic per pass, the
dispatch of each op several), so the work is split by what needs the activation:

- :func:`reduce_activation`, in the layer's forward hook: the passes over the activation, 15 ops (amax, the two
  centred power sums, three counts) returning 0-dim device tensors; the activation is not kept (no memory held
  past the hook);
- :func:`finish_rows`, once for all the layers sampled in a step: the scalar arithmetic that turns those sums into
  ``[log2 amax, kurtosis, saturation, underflow]`` rows, ~20 ops whatever the number of layers.

Nothing is read on the host in either half.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["format_range", "thresholds", "reduce_activation", "finish_rows", "layer_stats", "WIDTH"]

TINY = 2.0**-126  # amax of an all-zero tensor: log2 stays finite
# The format ids of lit_mpstable.core.formats, their ranges read from torch.finfo here.
DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "fp16": torch.float16,
          "bf16": torch.bfloat16}

Sums = tuple[torch.Tensor, ...]  # amax, sum of centred**2, sum of centred**4, and the counts above the saturation
# threshold, nonzero, at or below the flush threshold (FP32, 0-dim; the counts exact up to 2**24 elements)
WIDTH = 6  # values per sample in Sums


def format_range(fmt: str, caller: str) -> tuple[float, float]:
    """(largest finite value, smallest subnormal) of format ``fmt``."""
    if fmt not in DTYPES:
        raise ValueError(f"{caller}(fmt={fmt!r}): unknown format; allowed: {sorted(DTYPES)}.")
    info = torch.finfo(DTYPES[fmt])
    return float(info.max), float(info.tiny) * float(info.eps)


def thresholds(fmt: str, scale: float | torch.Tensor, caller: str = "layer_stats") -> tuple[Any, Any]:
    """(saturation, flush) thresholds on ``|x|`` for activations multiplied by ``scale`` before a cast to ``fmt``:
    the thresholds are divided by the scale (a 0-dim operation) instead of the activations multiplied by it."""
    fmt_max, smallest_subnormal = format_range(fmt, caller)
    return fmt_max / scale, smallest_subnormal / 2 / scale  # at or below half the smallest subnormal: flushed


def reduce_activation(x: torch.Tensor, saturate_above: Any, flush_at: Any) -> tuple[Sums, int]:
    """The passes over one activation: its :data:`Sums` and element count (see :func:`finish_rows`).

    The power sums are of ``(x - mean) / amax``: kurtosis is scale-free, and dividing by amax keeps the fourth
    powers in range (``1e30**4`` overflows FP32); a NaN or inf, or an amax of 0, makes them NaN. Two counts are
    summed from FP32 comparisons written into buffers already made (a bool comparison costs twice as much on the
    CPU): exact up to 2**24 elements, within a few counts of 1e8 beyond.
    """
    x = x.detach().reshape(-1)
    if x.dtype != torch.float32:
        x = x.float()
    n = x.numel()
    if n == 0:
        return (torch.zeros((), device=x.device),) * WIDTH, 0
    a = x.abs()
    amax = a.amax()
    square = torch.sub(x, x.sum(), alpha=1.0 / n).div_(amax).square_()
    square_sum, fourth_sum = square.sum(), torch.dot(square, square)
    above = torch.gt(a, saturate_above, out=square).sum()  # square's sums are taken: its memory is free
    nonzero = torch.count_nonzero(a)  # int64: stacked with the others as FP32
    low = torch.le(a, flush_at, out=a).sum()  # a's last use
    return (amax, square_sum, fourth_sum, above, nonzero, low), n


def finish_rows(sums: list[torch.Tensor], numels: list[int]) -> torch.Tensor:
    """``[log2 amax, kurtosis, saturation, underflow]`` (FP32, one row per layer) from the concatenated
    :func:`reduce_activation` results of the layers, in ~20 ops for all of them:

    - kurtosis: ``E[(x - mean)**4] / var**2`` (3 for a Gaussian; 0 for a tensor whose standard deviation is below
      1e-6 of its amax, or holding an inf; NaN if it holds a NaN);
    - saturation: the fraction of elements above the saturation threshold (inf counts, NaN does not);
    - underflow: the fraction of the nonzero elements at or below the flush threshold (0 without nonzero ones).
    """
    amax, square_sum, fourth_sum, above, nonzero, low = torch.stack(sums).view(-1, WIDTH).unbind(1)
    n = torch.tensor(numels, dtype=torch.float32, device=amax.device).clamp_min(1)
    var = square_sum / n
    kurtosis = fourth_sum / n / (var * var)
    # A spread below 1e-6 of amax is rounding noise (x / amax is inexact): the tensor counts as constant. So does
    # an all-zero one (its sums are 0 / 0: NaN, which fails the comparison), and one holding an inf (NaN too).
    kurtosis = torch.where(var > 1e-12, kurtosis, 0.0)
    kurtosis = torch.where(amax.isnan(), amax, kurtosis)
    underflow = ((low + nonzero - n) / nonzero.clamp_min(1)).clamp_min(0.0)  # low counts the zeros too
    return torch.stack([amax.clamp_min(TINY).log2(), kurtosis, above / n, underflow], dim=1)


def layer_stats(x: torch.Tensor, fmt: str = "fp8_e4m3", scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``[log2 amax, kurtosis, saturation, underflow]`` of ``x`` as one FP32 device tensor; no host read.

    - kurtosis: the fourth standardized moment ``E[(x - mean)**4] / var**2`` of all elements (3 for a Gaussian,
      up to the element count when one element dominates; 0 for a tensor whose standard deviation is below 1e-6
      of its amax), in FP32 on ``x / amax``, so no power overflows;
    - saturation: the fraction of elements with ``|x| * scale`` above ``fmt``'s largest finite value (inf counts);
    - underflow: the fraction of the nonzero elements that ``* scale`` flushes to zero in ``fmt``.

    A NaN in ``x`` makes amax and kurtosis NaN; an inf makes amax inf and kurtosis 0.
    """
    sums, n = reduce_activation(x, *thresholds(fmt, scale))
    return finish_rows(list(sums), [n])[0]

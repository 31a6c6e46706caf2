"""The table of floating-point formats and the range checks built on it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

FormatName = Literal["fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]

FORMAT_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}
"""The one table of format ids and their torch dtypes."""

FORMAT_IDS: dict[torch.dtype, str] = {dtype: name for name, dtype in FORMAT_DTYPES.items()}
"""A torch dtype's format id (``torch.bfloat16`` -> ``"bf16"``)."""

PRECISION_FORMATS: dict[str, str] = {
    "32-true": "fp32", "16-mixed": "fp16", "16-true": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16",
    "transformer-engine": "bf16", "transformer-engine-float16": "fp16",
}
"""The 16-bit (or FP32) compute format of each of Lightning's precision strings (TransformerEngine's plugin
included: its base precision)."""

PRECISION_DTYPES: dict[str, torch.dtype] = {name: FORMAT_DTYPES[fmt] for name, fmt in PRECISION_FORMATS.items()}
"""The compute dtype of each of Lightning's precision strings (``"16-mixed"`` -> ``torch.float16``)."""


@dataclass(frozen=True)
class Format:
    """Range facts of one format, read from ``torch.finfo`` so they cannot drift from the dtype."""

    name: str
    dtype: torch.dtype
    max: float
    """Largest finite value."""
    smallest_normal: float
    smallest_subnormal: float
    """Values below half of this flush to zero when cast (round to nearest even)."""
    eps: float
    """Distance from 1.0 to the next representable value."""

    @classmethod
    def from_dtype(cls, name: str, dtype: torch.dtype) -> Format:
        info = torch.finfo(dtype)
        # smallest subnormal = 2**(emin - mantissa bits) = tiny * eps for every format in the table
        return cls(name, dtype, float(info.max), float(info.tiny), float(info.tiny) * float(info.eps), float(info.eps))


FORMATS: dict[str, Format] = {
    name: Format.from_dtype(name, dtype)
    for name, dtype in (
        ("fp32", torch.float32),
        ("fp16", torch.float16),
        ("bf16", torch.bfloat16),
        ("fp8_e4m3", torch.float8_e4m3fn),
        ("fp8_e5m2", torch.float8_e5m2),
    )
}
assert set(FORMATS) == set(get_args(FormatName))


def get_format(name: str | torch.dtype) -> Format:
    """Look a format up by id (``"fp16"``) or by dtype (``torch.float16``).

    Raises:
        ValueError: the name or dtype is not in the table.
    """
    if isinstance(name, torch.dtype):
        for fmt in FORMATS.values():
            if fmt.dtype == name:
                return fmt
        known = [f.dtype for f in FORMATS.values()]
        raise ValueError(f"get_format({name!r}): no format with that dtype; known: {known}")
    if name not in FORMATS:
        raise ValueError(f"get_format({name!r}): unknown format; allowed: {sorted(FORMATS)}")
    return FORMATS[name]


def overflow_fraction(tensor: torch.Tensor, fmt: str | torch.dtype, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Fraction of the finite elements of ``tensor * scale`` that exceed ``fmt``'s largest finite value.

    Returns a 0-dim tensor on the tensor's device (no host synchronisation).
    """
    limit = get_format(fmt).max
    values = tensor.detach().float().abs() * scale
    finite = torch.isfinite(values)
    return (values > limit).logical_and(finite).sum() / finite.sum().clamp_min(1)


def underflow_fraction(tensor: torch.Tensor, fmt: str | torch.dtype, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Fraction of the nonzero elements of ``tensor * scale`` that flush to zero when cast to ``fmt``.

    A value flushes when it is below half the smallest subnormal (round to nearest even sends it to 0).
    Returns a 0-dim tensor on the tensor's device (no host synchronisation).
    """
    threshold = get_format(fmt).smallest_subnormal / 2
    values = tensor.detach().float().abs() * scale
    nonzero = values > 0
    return ((values <= threshold) & nonzero).sum() / nonzero.sum().clamp_min(1)

"""Element formats of the block-scaled recipes (E2M1, E4M3, E5M2): rounding onto their grids, and block views."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ElementFormat:
    """A sign-magnitude minifloat without inf/NaN encodings (OCP MX spec v1.0, section 5.3)."""

    name: str
    mbits: int
    """Explicit mantissa bits."""
    emin: int
    """Exponent of the smallest normal; subnormals share its quantum ``2**(emin - mbits)``."""
    emax: int
    """Exponent of the largest normal: the MX spec's ``emax_elem`` in the shared-scale rule."""
    max: float
    """Largest finite magnitude; larger values saturate to it."""
    torch_dtype: torch.dtype | None = None
    """The torch dtype holding it, where torch has one (the FP8 formats)."""


E2M1 = ElementFormat("fp4_e2m1", mbits=1, emin=0, emax=2, max=6.0)
"""FP4: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
E4M3 = ElementFormat("fp8_e4m3", mbits=3, emin=-6, emax=8, max=448.0, torch_dtype=torch.float8_e4m3fn)
E5M2 = ElementFormat("fp8_e5m2", mbits=2, emin=-14, emax=15, max=57344.0, torch_dtype=torch.float8_e5m2)


def _quantum(magnitude: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    # The grid spacing at |v|: 2**(e - mbits) with e = floor(log2|v|), never below the subnormal spacing. frexp
    # gives |v| = m * 2**k with m in [0.5, 1), so floor(log2|v|) = k - 1 exactly (log2 would round).
    _, k = torch.frexp(magnitude)
    exponent = (k - 1).clamp(min=fmt.emin) - fmt.mbits
    return torch.ldexp(torch.ones_like(magnitude), exponent)


def round_to_format(v: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """``v`` (fp32) rounded to the nearest value of ``fmt``, ties to even, saturating at ``±fmt.max``; fp32 out.

    NaN stays NaN; ±inf saturates to ``±fmt.max`` (the formats have no inf). Dividing by the power-of-two quantum
    is exact, and ``torch.round`` rounds half to even, whose parity is the last mantissa bit's.
    """
    magnitude = v.abs().clamp(max=fmt.max)
    quantum = _quantum(magnitude, fmt)
    rounded = (torch.round(magnitude / quantum) * quantum).clamp(max=fmt.max)
    return torch.copysign(rounded, v)


def stochastic_round_to_format(
    v: torch.Tensor,
    fmt: ElementFormat,
    *,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``v`` (fp32) rounded to one of its two neighbours in ``fmt``, up with probability equal to its distance
    from the lower one over their gap, so ``E[result] = v`` inside the range; saturating at ``±fmt.max``.

    ``noise`` holds one uniform draw in [0, 1) per element (``v``'s shape); without it they are drawn here from
    ``generator`` (the default generator when None), so a seeded generator repeats the result. Values already on the
    grid are returned unchanged.
    """
    magnitude = v.abs().clamp(max=fmt.max)
    quantum = _quantum(magnitude, fmt)
    low = torch.floor(magnitude / quantum) * quantum
    if noise is None:
        noise = torch.rand(v.shape, generator=generator, dtype=torch.float32, device=v.device)
    # u < p rounds up with probability p exactly (u in [0, 1)); p = 0 on the grid never rounds up.
    up = noise < (magnitude - low) / quantum
    rounded = torch.where(up, low + quantum, low).clamp(max=fmt.max)
    return torch.copysign(rounded, v)


def tiled(x: torch.Tensor, rows: int, cols: int, *, pad: bool = False) -> torch.Tensor:
    """``(..., R, C)`` viewed as ``(..., R/rows, rows, C/cols, cols)`` in fp32; a 1-D ``x`` is one row.

    With ``pad`` the last two dims are zero-padded up to multiples first (zeros never raise a tile's amax);
    without it the caller has checked divisibility.
    """
    x = x.float()
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if pad:
        x = F.pad(x, (0, -x.shape[-1] % cols, 0, -x.shape[-2] % rows))
    *lead, r, c = x.shape
    return x.reshape(*lead, r // rows, rows, c // cols, cols)


def untiled(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The inverse of :func:`tiled`: back to the original ``shape``, padding dropped."""
    *lead, r_tiles, rows, c_tiles, cols = t.shape
    full = t.reshape(*lead, r_tiles * rows, c_tiles * cols)
    if len(shape) == 1:
        return full[0, : shape[-1]]
    return full[..., : shape[-2], : shape[-1]]


def tile_amax(t: torch.Tensor) -> torch.Tensor:
    """Each tile's max ``|x|`` from a :func:`tiled` view, kept broadcastable: ``(..., R/rows, 1, C/cols, 1)``.

    NaN anywhere in a tile makes its amax NaN (``amax`` propagates NaN), so the block's scale is NaN too.
    """
    return t.abs().amax(dim=(-3, -1), keepdim=True)

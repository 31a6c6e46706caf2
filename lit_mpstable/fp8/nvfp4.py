"""NVFP4: E2M1 elements, one E4M3 scale per 16 elements (1x16, or 16x16 for weights), one FP32 tensor scale."""

from __future__ import annotations

from typing import NamedTuple

import torch

from lit_mpstable.fp8.minifloat import (
    E2M1,
    E4M3,
    round_to_format,
    stochastic_round_to_format,
    tile_amax,
    tiled,
    untiled,
)

NVFP4_BLOCK_SIZE = 16
"""Elements per E4M3 block scale (NVIDIA's NVFP4; 16x16 tiles for weights in the NVFP4 training recipe)."""

_E4M3_TINY = torch.finfo(torch.float8_e4m3fn).tiny  # 2**-6: block scales are kept normal, as torchao and TE do


class NVFP4Quantized(NamedTuple):
    """An NVFP4 tensor, unpacked: ``x ~= elements * (tensor_scale * block_scale)`` per tile."""

    elements: torch.Tensor
    """fp32 values on the E2M1 grid, in the tiled layout ``(..., R/rows, rows, C/cols, cols)``."""
    block_scale: torch.Tensor
    """``torch.float8_e4m3fn`` decode scales, one per tile: ``(..., R/rows, 1, C/cols, 1)``."""
    tensor_scale: torch.Tensor
    """The fp32 per-tensor decode scale ``amax / (448 * 6)`` (1.0 for an all-zero tensor)."""
    shape: torch.Size
    """The original shape."""


def nvfp4_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """The per-tensor decode scale ``amax(|x|) / (448 * 6)``, so a tile holding the tensor's amax gets the largest
    E4M3 block scale (torchao's ``per_tensor_amax_to_scale``; TE's global encode scale ``2688 / amax`` is its
    reciprocal up to rounding).

    An all-zero tensor gets 1.0 instead of 0 (torchao divides by it and returns NaN; TE uses 1.0 there too).
    """
    scale = x.float().abs().amax() / (E4M3.max * E2M1.max)
    return torch.where(scale == 0, 1.0, scale)


def nvfp4_quantize(
    x: torch.Tensor,
    *,
    tile: tuple[int, int] = (1, NVFP4_BLOCK_SIZE),
    tensor_scale: torch.Tensor | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> NVFP4Quantized:
    """NVFP4-quantise ``x`` with two-level scaling, as torchao's ``nvfp4_quantize`` with a per-tensor scale.

    Per tile: ``block = (amax_tile / 6) / tensor_scale`` clamped to ``[2**-6, 448]`` and rounded to E4M3; elements
    ``x * ((1 / tensor_scale) / block)`` clamped to ``±6`` and rounded to E2M1, to nearest even or, with
    ``stochastic``, stochastically (unbiased; the NVFP4 recipe does this for gradients only) with one uniform draw
    per element of ``x``, in ``x``'s order: ``noise`` (``x``'s shape, values in [0, 1)) where given, else
    ``torch.rand(x.shape, generator=generator)``. ``torch.compile`` cannot trace a ``torch.Generator``: under it, draw
    ``noise`` outside the compiled region, or leave both None for the default generator, which it can.
    ``tile=(1, 16)`` is the activation/gradient layout, ``(16, 16)`` the weight layout (one scale per 16x16 tile, so
    a weight and its transpose quantise alike). 1x16 with round-to-nearest gives torchao's bytes and values.

    Non-finite values, as torchao: a NaN makes its tile's scale NaN and the tensor scale NaN, and an inf makes the
    tensor scale inf: either way the whole tensor dequantizes to NaN, so the overflow is not hidden.

    Raises:
        ValueError: a dim the tile does not divide (cuBLAS and torchao need whole blocks: pad it, or keep the layer
            in high precision), a tile other than (1, 16) / (16, 16), or ``noise`` not of ``x``'s shape.
    """
    if tile not in ((1, NVFP4_BLOCK_SIZE), (NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)):
        raise ValueError(f"nvfp4_quantize(tile={tile!r}): tile must be (1, 16) for activations and gradients or "
                         "(16, 16) for weights.")
    rows, cols = tile
    if x.dim() == 0 or x.shape[-1] % cols or (rows > 1 and (x.dim() < 2 or x.shape[-2] % rows)):
        raise ValueError(
            f"nvfp4_quantize(x of shape {tuple(x.shape)}, tile={tile!r}): the tile must divide the last "
            f"{'two dims' if rows > 1 else 'dim'}, since each E4M3 scale covers one whole tile; pad with zeros to a "
            "multiple of 16, or keep this tensor's layer in high precision."
        )
    if tensor_scale is None:
        tensor_scale = nvfp4_tensor_scale(x)
    t = tiled(x, rows, cols)
    block = (tile_amax(t) / E2M1.max) / tensor_scale
    block_scale = block.clamp(_E4M3_TINY, E4M3.max).to(torch.float8_e4m3fn)
    # One multiplier per tile, reciprocal of the tensor scale first: torchao's order, so the fp32 products, hence the
    # elements, agree bit for bit. TE's kernels scale by 2688 / amax and invert the product instead: on bf16 inputs
    # about 5 elements in 10**4 round differently (none on fp32 ones, in our measurement).
    encode = (1.0 / tensor_scale) / block_scale.float()
    v = (t * encode).clamp(-E2M1.max, E2M1.max)
    if stochastic:
        if noise is None:
            noise = torch.rand(x.shape, generator=generator, device=x.device)
        elif noise.shape != x.shape:
            raise ValueError(f"nvfp4_quantize(noise of shape {tuple(noise.shape)}): noise must have x's shape "
                             f"{tuple(x.shape)}, one uniform draw per element.")
        elements = stochastic_round_to_format(v, E2M1, noise=tiled(noise, rows, cols))
    else:
        elements = round_to_format(v, E2M1)
    return NVFP4Quantized(elements, block_scale, tensor_scale, x.shape)


def nvfp4_dequantize(q: NVFP4Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``elements * (tensor_scale * block_scale)`` in fp32, back in the original shape, cast to ``dtype``."""
    values = q.elements * (q.tensor_scale * q.block_scale.float())
    return untiled(values, q.shape).to(dtype)

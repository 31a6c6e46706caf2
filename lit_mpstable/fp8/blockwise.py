"""Blockwise FP8 (DeepSeek-V3, TransformerEngine's Float8BlockScaling): E4M3 with one FP32 scale per 1x128 tile of
activations and gradients and per 128x128 block of weights."""

from __future__ import annotations

from typing import NamedTuple

import torch

from lit_mpstable.fp8.minifloat import E4M3, tile_amax, tiled, untiled

BLOCKWISE_TILE = 128
"""Tile edge: 1x128 for inputs and gradients, 128x128 for weights (DeepSeek-V3, section 3.3.2)."""

_FP32_MAX = torch.finfo(torch.float32).max


class BlockwiseQuantized(NamedTuple):
    """A blockwise FP8 tensor: ``x ~= data * scale_inv`` per tile, in the tiled (zero-padded) layout."""

    data: torch.Tensor
    """``torch.float8_e4m3fn``, ``(..., R/rows, rows, C/cols, cols)`` after padding."""
    scale_inv: torch.Tensor
    """fp32 decode scales, one per tile: ``(..., R/rows, 1, C/cols, 1)``; NaN for a tile holding inf or NaN."""
    shape: torch.Size


def blockwise_scale(amax: torch.Tensor, *, power_2_scale: bool = True) -> torch.Tensor:
    """The encode scale ``448 / amax`` per tile in fp32, as TransformerEngine's ``compute_scale_from_amax``.

    The division rounds once (TE's ``__fdiv_rn``); a scale past fp32's range becomes fp32's max; with
    ``power_2_scale`` (TE's default for ``Float8BlockScaling``) it is rounded down to a power of two by dropping
    its mantissa bits, so scaling and unscaling are exact and only the E4M3 cast rounds. A tile with amax 0 gets 1;
    a non-finite amax gives a meaningless scale (0, inf or NaN), and :func:`blockwise_quantize` marks its tile NaN.
    DeepSeek-V3's ``amax / 448`` decode scale is ``power_2_scale=False`` (TE's ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES``).
    """
    amax = amax.float()
    scale = torch.full_like(amax, E4M3.max) / amax
    scale = torch.where(torch.isinf(scale), _FP32_MAX, scale)
    if power_2_scale:
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)  # positive: keep the exponent field
    return torch.where(amax == 0, 1.0, scale)


def blockwise_quantize(
    x: torch.Tensor, *, tile: tuple[int, int] = (1, BLOCKWISE_TILE), power_2_scale: bool = True
) -> BlockwiseQuantized:
    """Blockwise E4M3 quantisation of ``x``'s last two dims (a 1-D ``x`` is one row).

    ``tile=(1, 128)`` for inputs and gradients, ``(128, 128)`` for weights. Dims the tile does not divide are
    zero-padded up to a multiple and the padding dropped on dequantization, as TransformerEngine does (zeros never
    raise a tile's amax). Elements: ``x * scale`` clamped to ``±448`` and rounded to nearest even.

    Non-finite values: a tile holding inf or NaN gets a NaN decode scale and dequantizes to NaN throughout (TE's
    reference quantizer gives the inf tile scale 0 and decode scale inf, so NaN too), so an overflow still reaches
    the loss scaler.

    Raises:
        ValueError: ``tile`` is not (1, 128) or (128, 128).
    """
    if tile not in ((1, BLOCKWISE_TILE), (BLOCKWISE_TILE, BLOCKWISE_TILE)):
        raise ValueError(f"blockwise_quantize(tile={tile!r}): tile must be (1, 128) for inputs and gradients or "
                         "(128, 128) for weights, as DeepSeek-V3 and TransformerEngine's Float8BlockScaling.")
    t = tiled(x, *tile, pad=True)
    amax = tile_amax(t)
    scale = blockwise_scale(amax, power_2_scale=power_2_scale)
    data = (t * scale).clamp(-E4M3.max, E4M3.max).to(torch.float8_e4m3fn)
    scale_inv = torch.where(torch.isfinite(amax), scale.reciprocal(), torch.nan)
    return BlockwiseQuantized(data, scale_inv, x.shape)


def blockwise_dequantize(q: BlockwiseQuantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * scale_inv`` in fp32, padding dropped, cast to ``dtype``."""
    values = q.data.float() * q.scale_inv
    return untiled(values, q.shape).to(dtype)

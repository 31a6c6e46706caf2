"""NVFP4: E2M1 elements, one E4M3 scale per 16 elements (1x16, or 16x16 for weights), one FP32 tensor scale."""

from __future__ import annotations

from typing import Literal, NamedTuple

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

NVFP4BlockScaleFloor = Literal["e4m3_tiny"]
"""``block_scale_floor`` values besides None: ``"e4m3_tiny"`` clamps block scales at E4M3's smallest normal, 2**-6
(torchao's ``NVFP4Tensor``); None keeps E4M3-subnormal and zero block scales (TransformerEngine's kernels)."""

E4M3_MAX_4OVER6 = 256.0
"""The E4M3 max in the global encode scale with Four Over Six (TE's ``nvfp4_4over6``, arXiv 2512.02010): it leaves
room for a block scaled to 4, whose scale is 1.5 times its map-to-6 scale (256 * 1.5 = 384 <= 448)."""

_E4M3_TINY = torch.finfo(torch.float8_e4m3fn).tiny  # 2**-6: torchao's E4M3_EPS
_FLT_MAX = torch.finfo(torch.float32).max


class NVFP4Quantized(NamedTuple):
    """An NVFP4 tensor, unpacked: ``x ~= elements * decode scale`` per tile, in the tiled (zero-padded) layout."""

    elements: torch.Tensor
    """fp32 values on the E2M1 grid, in the tiled layout ``(..., R/rows, rows, C/cols, cols)`` after padding."""
    block_scale: torch.Tensor
    """``torch.float8_e4m3fn`` block scales, one per tile: ``(..., R/rows, 1, C/cols, 1)``."""
    tensor_scale: torch.Tensor
    """The fp32 per-tensor decode scale: ``amax / 2688`` (torchao; 1.0 for an all-zero tensor), or TE's
    ``fl32(1 / S_enc)`` with ``S_enc`` from :func:`nvfp4_global_encode_scale`."""
    shape: torch.Size
    """The original shape."""
    global_amax: torch.Tensor | None = None
    """TE's arithmetic: the tensor amax that :func:`nvfp4_dequantize` multiplies by (TE's order); None for
    torchao's ``NVFP4Tensor`` arithmetic (``block_scale_floor="e4m3_tiny"``), which multiplies by ``tensor_scale``."""
    e4m3_max: float = E4M3.max
    """The E4M3 max of the global scale: 448, or 256 with Four Over Six."""


def nvfp4_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """The per-tensor decode scale ``amax(|x|) / (448 * 6)`` of torchao's ``NVFP4Tensor``
    (``per_tensor_amax_to_scale``).

    An all-zero tensor gets 1.0 instead of 0 (torchao divides by it and returns NaN).
    """
    scale = x.float().abs().amax() / (E4M3.max * E2M1.max)
    return torch.where(scale == 0, 1.0, scale)


def nvfp4_global_encode_scale(amax: torch.Tensor, e4m3_max: float = E4M3.max) -> torch.Tensor:
    """TransformerEngine's global encode scale ``S_enc = min(e4m3_max * 6 / amax, FLT_MAX)`` (one fp32 division),
    1 where ``amax`` is 0 (or ``S_enc`` is 0); NaN where ``amax`` is inf or NaN, so the whole tensor dequantizes
    to NaN and an overflow still reaches the loss scaler."""
    amax = amax.float()
    s_enc = (torch.full_like(amax, e4m3_max * E2M1.max) / amax).clamp(max=_FLT_MAX)
    s_enc = torch.where((amax == 0) | (s_enc == 0), 1.0, s_enc)
    return torch.where(torch.isfinite(amax), s_enc, torch.nan)


def nvfp4_quantize(
    x: torch.Tensor,
    *,
    tile: tuple[int, int] = (1, NVFP4_BLOCK_SIZE),
    tensor_scale: torch.Tensor | None = None,
    global_amax: torch.Tensor | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
    block_scale_floor: NVFP4BlockScaleFloor | None = None,
    four_over_six: bool = False,
    four_over_six_error: Literal["mae", "mse"] = "mae",
) -> NVFP4Quantized:
    """NVFP4-quantise ``x`` with two-level scaling.

    ``block_scale_floor=None`` (the default): TransformerEngine's arithmetic (``core_nvfp4.cuh``), with
    ``amax = max|x|`` (or ``global_amax``) and ``S_enc`` of :func:`nvfp4_global_encode_scale`: per tile
    ``S_dec = e4m3(min(tile_amax * (S_enc * fl32(1/6)), 448))`` with no lower clamp (E4M3-subnormal scales are kept,
    and a tile below half the smallest one gets scale 0), ``enc = min(1 / (S_dec * fl32(1 / S_enc)), FLT_MAX)``,
    elements ``e2m1(clamp(x * enc, -6, 6))``. ``"e4m3_tiny"``: torchao's ``NVFP4Tensor``
    (``tensor_scale = amax / 2688``, default :func:`nvfp4_tensor_scale`): ``S_dec = e4m3(clamp((tile_amax / 6) /
    tensor_scale, 2**-6, 448))``, elements ``e2m1(clamp(x * ((1 / tensor_scale) / S_dec), -6, 6))``. Both equal
    the golden vectors of their references bit for bit.

    ``four_over_six`` (TE variant only; TE's ``nvfp4_4over6``, arXiv 2512.02010): ``S_enc`` uses 256 for the E4M3
    max, and each tile chooses between its map-to-6 scale and the map-to-4 one, ``e4m3(fl32(unrounded map-to-6
    scale * 1.5))``, whichever dequantizes (TE's order) with the smaller error, ``four_over_six_error``: the sum of
    absolute errors (``"mae"``, TE's default) or of squared errors (``"mse"``); a tie keeps 6.

    Elements round to nearest even or, with ``stochastic``, stochastically (unbiased; the NVFP4 recipe does this
    for gradients only) with one uniform draw per element of ``x``, in ``x``'s order: ``noise`` (``x``'s shape,
    values in [0, 1)) where given, else ``torch.rand(x.shape, generator=generator)``. ``torch.compile`` cannot
    trace a ``torch.Generator``: under it, draw ``noise`` outside the compiled region, or leave both None.
    ``tile=(1, 16)`` is the activation/gradient layout, ``(16, 16)`` the weight layout (one scale per 16x16 tile, so
    a weight and its transpose quantise alike). Dims the tile does not divide are zero-padded, as TE's
    ``NVFP4QuantizerRef._pad_tensor`` (rows to a multiple of the tile's rows, columns to 16; the amax is ``x``'s).

    Non-finite values: a NaN or inf makes the tensor scale NaN (TE variant) or NaN/inf (torchao's), so the whole
    tensor dequantizes to NaN: the overflow is not hidden.

    Raises:
        ValueError: a tile other than (1, 16) / (16, 16), ``noise`` not of ``x``'s shape, an unknown
            ``block_scale_floor`` or ``four_over_six_error``, ``four_over_six`` with ``"e4m3_tiny"``, or
            ``tensor_scale`` without it.
    """
    if tile not in ((1, NVFP4_BLOCK_SIZE), (NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)):
        raise ValueError(f"nvfp4_quantize(tile={tile!r}): tile must be (1, 16) for activations and gradients or "
                         "(16, 16) for weights.")
    if block_scale_floor not in (None, "e4m3_tiny"):
        raise ValueError(f"nvfp4_quantize(block_scale_floor={block_scale_floor!r}): block_scale_floor must be None "
                         "(TransformerEngine's arithmetic) or 'e4m3_tiny' (torchao's NVFP4Tensor).")
    te = block_scale_floor is None
    if four_over_six_error not in ("mae", "mse"):
        raise ValueError(f"nvfp4_quantize(four_over_six_error={four_over_six_error!r}): must be 'mae' (the sum of "
                         "absolute errors, TransformerEngine's default) or 'mse' (of squared errors).")
    if four_over_six and not te:
        raise ValueError("nvfp4_quantize(four_over_six=True, block_scale_floor='e4m3_tiny'): Four Over Six is "
                         "defined on TransformerEngine's arithmetic; use block_scale_floor=None.")
    if tensor_scale is not None and te:
        raise ValueError("nvfp4_quantize(tensor_scale=..., block_scale_floor=None): TransformerEngine's arithmetic "
                         "takes global_amax; tensor_scale is torchao's (block_scale_floor='e4m3_tiny').")
    if x.dim() == 0:
        raise ValueError(f"nvfp4_quantize(x of shape {tuple(x.shape)}): x must have at least one dim.")
    if stochastic and noise is not None and noise.shape != x.shape:
        raise ValueError(f"nvfp4_quantize(noise of shape {tuple(noise.shape)}): noise must have x's shape "
                         f"{tuple(x.shape)}, one uniform draw per element.")
    rows, cols = tile
    t = tiled(x, rows, cols, pad=True)
    block_amax = tile_amax(t)
    amax = x.float().abs().amax() if global_amax is None else global_amax.float().reshape(())
    e4m3_max = E4M3_MAX_4OVER6 if four_over_six else E4M3.max
    if te:
        s_enc = nvfp4_global_encode_scale(amax, e4m3_max)
        dec_enc = 1.0 / s_enc  # fl32(1 / S_enc)
        unrounded = block_amax * (s_enc * torch.tensor(1.0 / E2M1.max, dtype=torch.float32))
        block_scale = _e4m3(unrounded)
        encode = _te_encode(block_scale, dec_enc)
        tensor_scale = dec_enc
    else:
        if tensor_scale is None:
            tensor_scale = nvfp4_tensor_scale(x) if global_amax is None else torch.where(
                amax == 0, 1.0, amax / (E4M3.max * E2M1.max))
        block = (block_amax / E2M1.max) / tensor_scale
        block_scale = block.clamp(_E4M3_TINY, E4M3.max).to(torch.float8_e4m3fn)
        # torchao's order: the reciprocal of the tensor scale first, then over the block scale.
        encode = (1.0 / tensor_scale) / block_scale.float()
    if four_over_six:
        scale4 = _e4m3(unrounded * 1.5)
        encode4 = _te_encode(scale4, dec_enc)
        err6 = _block_error(t, encode, block_scale, amax, e4m3_max, four_over_six_error)
        err4 = _block_error(t, encode4, scale4, amax, e4m3_max, four_over_six_error)
        use4 = err4 < err6  # a tie keeps 6
        block_scale = torch.where(use4, scale4.float(), block_scale.float()).to(torch.float8_e4m3fn)
        encode = torch.where(use4, encode4, encode)
    v = (t * encode).clamp(-E2M1.max, E2M1.max)
    if stochastic:
        if noise is None:
            noise = torch.rand(x.shape, generator=generator, device=x.device)
        elements = stochastic_round_to_format(v, E2M1, noise=tiled(noise, rows, cols, pad=True))
    else:
        elements = round_to_format(v, E2M1)
    return NVFP4Quantized(elements, block_scale, tensor_scale, x.shape, amax if te else None, e4m3_max)


def nvfp4_dequantize(q: NVFP4Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values in fp32, back in the original shape (padding dropped), cast to ``dtype``.

    TE's arithmetic (``q.global_amax`` set), in its dequantize kernel's order:
    ``elements * ((f32(S_dec) * amax) * fl32(1 / (e4m3_max * 6)))``; torchao's:
    ``elements * (tensor_scale * f32(S_dec))``. The two orders differ in the last bit for many elements.
    """
    if q.global_amax is None:
        values = q.elements * (q.tensor_scale * q.block_scale.float())
    else:
        values = q.elements * _te_decode(q.block_scale, q.global_amax, q.e4m3_max)
    return untiled(values, q.shape).to(dtype)


def _e4m3(unrounded: torch.Tensor) -> torch.Tensor:
    # TE: min(s, 448) then the satfinite E4M3 cast, no lower clamp (E4M3 subnormals kept, <= 2**-10 gives 0).
    return unrounded.clamp(max=E4M3.max).to(torch.float8_e4m3fn)


def _te_encode(block_scale: torch.Tensor, dec_enc: torch.Tensor) -> torch.Tensor:
    return (1.0 / (block_scale.float() * dec_enc)).clamp(max=_FLT_MAX)


def _te_decode(block_scale: torch.Tensor, amax: torch.Tensor, e4m3_max: float) -> torch.Tensor:
    inv = torch.tensor(1.0 / (e4m3_max * E2M1.max), dtype=torch.float32, device=block_scale.device)
    return (block_scale.float() * amax) * inv


def _block_error(
    t: torch.Tensor, encode: torch.Tensor, block_scale: torch.Tensor, amax: torch.Tensor, e4m3_max: float,
    metric: str,
) -> torch.Tensor:
    codes = round_to_format((t * encode).clamp(-E2M1.max, E2M1.max), E2M1)
    diff = (t - codes * _te_decode(block_scale, amax, e4m3_max)).abs()
    return (diff if metric == "mae" else diff.square()).sum(dim=(-3, -1), keepdim=True)

"""OCP Microscaling (MX v1.0): MXFP4 (E2M1) and MXFP8 (E4M3/E5M2) elements with one E8M0 scale per 32."""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch

from lit_mpstable.fp8.minifloat import E2M1, E4M3, E5M2, ElementFormat, round_to_format

MXElement = Literal["fp4_e2m1", "fp8_e4m3", "fp8_e5m2"]
MX_ELEMENTS: dict[str, ElementFormat] = {"fp4_e2m1": E2M1, "fp8_e4m3": E4M3, "fp8_e5m2": E5M2}

_E8M0_BIAS, _E8M0_NAN = 127, 255


class MXQuantized(NamedTuple):
    """An MX tensor, unpacked: ``x ~= elements * 2**(scale_e8m0 - 127)`` blockwise along the last dim."""

    elements: torch.Tensor
    """fp32 values on the element format's grid, ``x``'s shape."""
    scale_e8m0: torch.Tensor
    """uint8 biased exponents, ``(..., n // block_size)``; 255 is E8M0's NaN."""
    block_size: int


def mx_quantize(x: torch.Tensor, element: MXElement = "fp4_e2m1", *, block_size: int = 32) -> MXQuantized:
    """MX-quantise ``x`` along its last dim, as the OCP MX spec v1.0, section 6.3.

    Per block of ``block_size`` elements: ``X = 2**(floor(log2(amax)) - emax_elem)`` clamped to E8M0's
    ``[2**-127, 2**127]``, elements ``round_to_nearest_even(x / X)`` saturated to the format's max (the floor rule
    lets a block's largest values exceed it by up to one binade). torchao's ``to_mx`` (scaling mode FLOOR) gives the
    same bytes, elements and dequantized values, with one exception: for a block whose scale is ``2**-127`` (amax
    below ``2**(emax_elem - 126)``) torchao divides by ``2**-126`` (a Triton subnormal workaround) yet dequantizes
    with ``2**-127``, halving the block; we divide by ``2**-127`` as the spec says.

    Non-finite values, as torchao: a block holding NaN gets the NaN scale (255) and dequantizes to NaN throughout;
    a block whose amax is inf gets ``2**(128 - emax_elem)`` (the exponent field of inf), so ±inf saturates to the
    format's max and dequantizes back to ±inf (the product overflows fp32) while its finite neighbours round to 0.
    An all-zero block gets scale ``2**-127`` and stays zero.

    Raises:
        ValueError: ``element`` unknown, or the last dim is not a multiple of ``block_size`` (MX hardware and
            torchao need whole blocks: pad the tensor, or keep the layer in high precision).
    """
    if element not in MX_ELEMENTS:
        raise ValueError(f"mx_quantize(element={element!r}): element must be one of {list(get_args(MXElement))}.")
    _check_blocks("mx_quantize", x, block_size)
    fmt = MX_ELEMENTS[element]
    blocks = x.float().unflatten(-1, (-1, block_size))
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # floor(log2(amax)) is the fp32 exponent field minus its bias: exact, 128 for inf/NaN, and -127 for a subnormal
    # amax (lower than the true floor, but the clamp below sends both to -127).
    floor_log2 = ((amax.view(torch.int32) >> 23) & 0xFF) - _E8M0_BIAS
    exponent = (floor_log2 - fmt.emax).clamp(-_E8M0_BIAS, _E8M0_BIAS)
    scale = torch.ldexp(torch.ones_like(amax), exponent)  # 2**-127 is an fp32 subnormal: exact
    elements = _round(blocks / scale, fmt)  # division by a power of two: exact
    biased = torch.where(torch.isnan(amax), _E8M0_NAN, exponent + _E8M0_BIAS).to(torch.uint8)
    return MXQuantized(elements.flatten(-2), biased.squeeze(-1), block_size)


def mx_dequantize(q: MXQuantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``elements * 2**(scale - 127)`` in fp32 (NaN where the scale is 255), then cast to ``dtype``.

    Every product is exact in fp32 and bf16 (a few significant bits times a power of two) unless it overflows.
    """
    exponent = q.scale_e8m0.to(torch.int32) - _E8M0_BIAS
    scale = torch.ldexp(torch.ones(exponent.shape, device=exponent.device), exponent)
    scale = torch.where(q.scale_e8m0 == _E8M0_NAN, torch.nan, scale).unsqueeze(-1)
    values = q.elements.unflatten(-1, (-1, q.block_size)) * scale
    return values.flatten(-2).to(dtype)


def _round(v: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    if fmt.torch_dtype is not None:  # torch's FP8 cast rounds to nearest even; clamp first to saturate
        return v.clamp(-fmt.max, fmt.max).to(fmt.torch_dtype).float()
    return round_to_format(v, fmt)


def _check_blocks(caller: str, x: torch.Tensor, block_size: int) -> None:
    if x.dim() == 0 or x.shape[-1] % block_size:
        raise ValueError(
            f"{caller}(x of shape {tuple(x.shape)}): the last dim must be a multiple of the block size "
            f"{block_size}, since each scale covers {block_size} consecutive elements of it; pad that dim with zeros "
            "to a multiple, or keep this tensor's layer in high precision."
        )

"""OCP Microscaling (MX v1.0): MXFP4 (E2M1) and MXFP8 (E4M3/E5M2) elements with one E8M0 scale per 32."""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F

from lit_mpstable.fp8.minifloat import E2M1, E4M3, E5M2, ElementFormat, round_to_format

MXElement = Literal["fp4_e2m1", "fp8_e4m3", "fp8_e5m2"]
MX_ELEMENTS: dict[str, ElementFormat] = {"fp4_e2m1": E2M1, "fp8_e4m3": E4M3, "fp8_e5m2": E5M2}
MXScaleRule = Literal["rceil", "floor"]
"""How a block's E8M0 scale is chosen: ``"rceil"`` rounds ``amax / max`` up to a power of two (TransformerEngine's
MXFP8 kernels, PTX ``cvt.rp.satfinite.ue8m0x2.f32``, torchao's training default); ``"floor"`` is OCP MX v1.0's
``2**(floor(log2(amax)) - emax_elem)``."""

_E8M0_BIAS, _E8M0_NAN = 127, 255


class MXQuantized(NamedTuple):
    """An MX tensor, unpacked: ``x ~= elements * 2**(scale_e8m0 - 127)`` blockwise along the last dim."""

    elements: torch.Tensor
    """fp32 values on the element format's grid, ``x``'s shape."""
    scale_e8m0: torch.Tensor
    """uint8 biased exponents, ``(..., ceil(n / block_size))``; 255 is E8M0's NaN."""
    block_size: int


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """``2.0**exponent`` in fp32 built from its bits, exact for integer exponents in ``[-149, 127]`` (subnormal
    powers included, which ``ldexp``/``pow`` need not give exactly on every device)."""
    e = exponent.to(torch.int32)
    normal = ((e + 127).clamp(1, 254) << 23).view(torch.float32)
    subnormal = (torch.ones_like(e) << (e + 149).clamp(0, 22)).view(torch.float32)
    return torch.where(e >= -126, normal, subnormal)


def mx_scale_exponent(amax: torch.Tensor, fmt: ElementFormat, scale_rule: str = "rceil") -> torch.Tensor:
    """The biased E8M0 exponent (int32, 0..254; 255 for a NaN ``amax``) of blocks whose max ``|x|`` is ``amax``.

    ``"rceil"``, as TransformerEngine's ``float_to_e8m0(amax * fl32(1 / max))``: ``d = amax * fl32(1 / max)``
    rounded once in fp32, then its biased exponent, plus one if its mantissa is nonzero (rounding up to a power of
    two); ``d`` = 0 gives 0, a subnormal ``d`` gives 0 up to ``2**-127`` and 1 above, an infinite ``d`` or one
    past ``2**127`` gives 254 (saturating). ``"floor"``, as OCP MX v1.0 section 6.3:
    ``clamp(floor(log2(amax)) - emax_elem, -127, 127) + 127`` with ``floor(log2)`` the fp32 exponent field (a zero
    or subnormal ``amax`` gives 0; an infinite one the exponent field of inf, 128).
    """
    amax = amax.float()
    if scale_rule == "rceil":
        d = amax * torch.tensor(1.0 / fmt.max, dtype=torch.float32)  # fl32(1 / max), then one rounding
        bits = d.view(torch.int32)
        field, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        up = (mantissa > 0) & (field != 0xFE) & ~((field == 0) & (mantissa <= 0x400000))
        biased = torch.where(torch.isinf(d), 0xFE, field + up.to(torch.int32)).clamp(max=0xFE)
    else:
        floor_log2 = ((amax.view(torch.int32) >> 23) & 0xFF) - _E8M0_BIAS
        biased = (floor_log2 - fmt.emax).clamp(-_E8M0_BIAS, _E8M0_BIAS) + _E8M0_BIAS
    return torch.where(torch.isnan(amax), _E8M0_NAN, biased)


def mx_quantize(
    x: torch.Tensor, element: MXElement = "fp4_e2m1", *, block_size: int = 32, scale_rule: MXScaleRule = "rceil"
) -> MXQuantized:
    """MX-quantise ``x`` along its last dim: per block of ``block_size`` elements one E8M0 scale ``2**(e - 127)``
    (:func:`mx_scale_exponent`, ``scale_rule``) and elements ``x * 2**(127 - e)`` rounded to nearest even,
    saturated to the format's max. With ``e = 0`` the factor is ``2**127``, as TransformerEngine's ``exp2f_rcp``
    and the OCP spec's division by ``2**-127``.

    ``"rceil"`` (the default; TransformerEngine's MXFP8 and torchao's training default) never saturates a finite
    block; ``"floor"`` (OCP's rule, torchao's ``ScaleCalculationMode.FLOOR``) lets a block's largest values exceed
    the max by up to one binade. Both equal the golden vectors of TE's and OCP's arithmetic bit for bit (where
    torchao's eager casts differ: docs/fp8-recipes.md).

    A last dim that ``block_size`` does not divide is quantized with its partial last block scaled by the amax of
    the elements present (TE's MXFP8 reference; the same as zero-padding). An all-zero block gets ``e = 0`` and
    stays zero.

    Non-finite values: a block holding NaN gets the NaN scale (255) and dequantizes to NaN throughout; a block whose
    amax is inf gets the largest scale (``"rceil"``: ``2**127``; ``"floor"``: the exponent field of inf), so ±inf
    saturates to the format's max and dequantizes back to ±inf (the product overflows fp32) while its finite
    neighbours round to 0.

    Raises:
        ValueError: ``element`` or ``scale_rule`` unknown, or ``x`` has no dim.
    """
    if element not in MX_ELEMENTS:
        raise ValueError(f"mx_quantize(element={element!r}): element must be one of {list(get_args(MXElement))}.")
    if scale_rule not in get_args(MXScaleRule):
        raise ValueError(f"mx_quantize(scale_rule={scale_rule!r}): scale_rule must be one of "
                         f"{list(get_args(MXScaleRule))} ('rceil' as TransformerEngine, 'floor' as OCP MX v1.0).")
    if x.dim() == 0:
        raise ValueError(f"mx_quantize(x of shape {tuple(x.shape)}): x must have at least one dim; the block "
                         "scales run along the last one.")
    fmt = MX_ELEMENTS[element]
    n = x.shape[-1]
    blocks = mx_blocks(x, block_size)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    biased = mx_scale_exponent(amax, fmt, scale_rule)
    factor = pow2(_E8M0_BIAS - biased.clamp(max=0xFE))  # 2**(127 - e): exact, 2**127 at e = 0
    elements = _round(blocks * factor, fmt)
    return MXQuantized(elements.flatten(-2)[..., :n], biased.squeeze(-1).to(torch.uint8), block_size)


def mx_dequantize(q: MXQuantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``elements * 2**(scale - 127)`` in fp32 (NaN where the scale is 255), then cast to ``dtype``.

    Every product is exact in fp32 and bf16 (a few significant bits times a power of two) unless it overflows.
    """
    biased = q.scale_e8m0.to(torch.int32)
    scale = torch.where(biased == _E8M0_NAN, torch.nan, pow2(biased - _E8M0_BIAS)).unsqueeze(-1)
    n = q.elements.shape[-1]
    values = mx_blocks(q.elements, q.block_size) * scale
    return values.flatten(-2)[..., :n].to(dtype)


def mx_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``(..., n)`` viewed as ``(..., ceil(n / block_size), block_size)`` in fp32, zero-padded (zeros never raise a
    block's amax)."""
    return F.pad(x.float(), (0, -x.shape[-1] % block_size)).unflatten(-1, (-1, block_size))


def _round(v: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    if fmt.torch_dtype is not None:  # torch's FP8 cast rounds to nearest even; clamp first to saturate
        return v.clamp(-fmt.max, fmt.max).to(fmt.torch_dtype).float()
    return round_to_format(v, fmt)

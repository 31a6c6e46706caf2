"""``fake_quantize``: what a recipe's quantizer does to a tensor, per role, as one public function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F

from lit_mpstable.fp8.blockwise import blockwise_dequantize, blockwise_quantize
from lit_mpstable.fp8.mx import MXElement, mx_dequantize, mx_quantize
from lit_mpstable.fp8.nvfp4 import nvfp4_dequantize, nvfp4_quantize
from lit_mpstable.fp8.quant import current_scale, dequantize, quantize, quantize_mx, to_stored
from lit_mpstable.fp8.recipe import Recipe, Role, resolve

QuantRecipe = Literal["current", "blockwise", "mxfp4", "mxfp8", "nvfp4"]
QuantRole = Literal["input", "weight", "grad"]
Operand = Literal["input", "weight", "grad"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_ROLE_OF = {"input": "fprop", "weight": "fprop", "grad": "dgrad"}  # fake_quantize's tensor role -> its GEMM


def nvfp4_kwargs(spec: Recipe) -> dict[str, Any]:
    """The recipe's keyword arguments of ``nvfp4_quantize``."""
    return {"block_scale_floor": spec.block_scale_floor, "four_over_six": spec.four_over_six}


def quantize_mx_as(spec: Recipe, t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant.quantize_mx(t, dtype)`` with the recipe's ``scale_rule``: ``(FP8 data of t's shape, fp32 block scales)``
    (FP8Linear's MX path)."""
    return quantize_mx(t, dtype, scale_rule=spec.scale_rule)


# ----------------------------------------------------------------------------------------------- operands
def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t`` zero-padded so ``cols`` divides its last dim and ``rows`` its second-to-last (zeros raise no amax)."""
    pad_cols = -t.shape[-1] % cols
    pad_rows = -t.shape[-2] % rows if rows > 1 else 0
    return F.pad(t, (0, pad_cols, 0, pad_rows)) if pad_cols or pad_rows else t


def _unpad(values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return values[..., : shape[-2], : shape[-1]] if len(shape) >= 2 else values[..., : shape[-1]]


def _tile(operand: str, block: tuple[int, int] | None) -> tuple[int, int]:
    """``operand``'s block: a weight takes the role's (2-D where it has rows > 1), inputs and gradients its row."""
    assert block is not None  # the block formats always have blocks (FORMATS)
    return block if operand == "weight" else (1, block[1])


def _fp8_dtype(operand: str, grad_dtype: torch.dtype) -> torch.dtype:
    return grad_dtype if operand == "grad" else torch.float8_e4m3fn


def _mx_element(operand: str, fp4: bool, grad_dtype: torch.dtype) -> MXElement:
    if fp4:
        return "fp4_e2m1"
    return "fp8_e5m2" if _fp8_dtype(operand, grad_dtype) == torch.float8_e5m2 else "fp8_e4m3"


def _bf16(spec: Recipe, t: torch.Tensor, operand: str, block: tuple[int, int] | None, **_: Any) -> torch.Tensor:
    return to_stored(t.float(), torch.bfloat16).float()  # rounded under torch.compile too (inductor elides a cast)


def _tensor(spec: Recipe, t: torch.Tensor, operand: str, block: tuple[int, int] | None, *,
            grad_dtype: torch.dtype, **_: Any) -> torch.Tensor:
    dtype = _fp8_dtype(operand, grad_dtype)
    scale = current_scale(t.detach().abs().amax().float(), dtype, margin=spec.margin)
    return dequantize(quantize(t, scale, dtype), scale)


def _mx(spec: Recipe, t: torch.Tensor, operand: str, block: tuple[int, int] | None, *, fp4: bool,
        grad_dtype: torch.dtype, **_: Any) -> torch.Tensor:
    cols = _tile(operand, block)[1]
    q = mx_quantize(_pad(t, 1, cols), _mx_element(operand, fp4, grad_dtype), block_size=cols,
                    scale_rule=spec.scale_rule)
    return _unpad(mx_dequantize(q), t.shape)


def _blockwise(spec: Recipe, t: torch.Tensor, operand: str, block: tuple[int, int] | None, **_: Any) -> torch.Tensor:
    return blockwise_dequantize(blockwise_quantize(t, tile=_tile(operand, block)))  # pads its own tiles


def _nvfp4(spec: Recipe, t: torch.Tensor, operand: str, block: tuple[int, int] | None, *,
           noise: torch.Tensor | None = None, generator: torch.Generator | None = None, stochastic: bool = False,
           **_: Any) -> torch.Tensor:
    rows, cols = _tile(operand, block)
    padded = _pad(t, rows, cols)
    if noise is not None and padded.shape != noise.shape:
        noise = _pad(noise, rows, cols)
    q = nvfp4_quantize(padded, tile=(rows, cols), stochastic=stochastic, noise=noise, generator=generator,
                       **nvfp4_kwargs(spec))
    return _unpad(nvfp4_dequantize(q), t.shape)


QUANTIZERS: dict[str, Callable[..., torch.Tensor]] = {
    "tensor": _tensor, "mx": _mx, "tiles": _blockwise, "two_level": _nvfp4, "bf16": _bf16,
}
"""``FormatInfo.kind`` -> the quantizer (quantise and dequantise to fp32) of one GEMM operand."""


def quantize_operand(
    spec: Recipe,
    role: Role,
    operand: Operand,
    t: torch.Tensor,
    *,
    grad_dtype: torch.dtype = torch.float8_e5m2,
    stochastic: bool = False,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``t``, one operand of the GEMM ``role``, quantised as ``spec`` says along its last dim (a weight in 2-D blocks
    where the role's block has rows > 1) and dequantised to fp32, ``t``'s shape. Partial blocks are zero-padded.

    ``stochastic`` with ``noise`` (``t``'s shape) or ``generator``: stochastic rounding (formats that have it).
    """
    info = spec.info(role)
    return QUANTIZERS[info.kind](spec, t, operand, spec.block(role), fp4=info.fp4, grad_dtype=grad_dtype,
                                 stochastic=stochastic, noise=noise, generator=generator)


def fake_quantize(
    x: torch.Tensor,
    recipe: str | Recipe,
    *,
    role: QuantRole = "input",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``x`` quantized with ``recipe``'s quantizer for ``role`` and dequantized, in ``x``'s dtype and shape.

    ``recipe``: a registered name (``"current"``, ``"mxfp8"``, ``"nvfp4"``, ...) or a :class:`Recipe`
    (``recipe("nvfp4", block_scale_floor="e4m3_tiny")``). ``role``: ``"input"`` and ``"weight"`` take the recipe's
    ``fprop`` format and block (a weight's 2-D blocks over the last two dims where the block has rows > 1),
    ``"grad"`` its ``dgrad`` format, rounded stochastically where ``"dgrad"`` is in ``stochastic_rounding``.

    The quantizer alone: no random Hadamard transform (see :mod:`lit_mpstable.fp8.hadamard`), no amax history
    (``"delayed"`` scales by this tensor's amax, as ``"current"``). Blocks run along the last dim (a GEMM's
    reduction dim); a dim the block does not divide is zero-padded, as the references pad, and the padding dropped.

    Formats, blocks and scales per recipe: docs/fp8-recipes.md; gradients take E5M2 under the per-tensor formats
    and ``"mxfp8"`` (the package's ``format="hybrid"``). ``generator`` draws the stochastic rounding of
    ``"nvfp4"`` gradients (the default generator when None; a seeded one repeats the draw; inputs and weights round
    to nearest even) and is used nowhere else. Under ``torch.compile`` pass None (it cannot trace a generator), or
    call ``nvfp4.nvfp4_quantize`` with ``noise``.

    The arithmetic is fp32 (a float64 ``x`` is rounded to fp32 first). Non-finite values never come back finite,
    and poison what the reference quantizers poison: per-tensor formats and ``"nvfp4"`` the whole tensor (a NaN or
    inf amax makes the per-tensor scale non-finite: every element NaN, as torchao and TransformerEngine);
    ``"blockwise"`` the 1x128 tile (128x128 block) holding it (NaN, as TE's reference); MX (torchao's ``to_mx``) a
    NaN's 32-element block (NaN), while a block whose amax is inf keeps ±inf there and rounds its finite elements to
    0, leaving other blocks untouched. The gradient is straight-through (the identity), as in quantization-aware
    training.

    Raises:
        TypeError: ``x`` is not a floating-point tensor, or ``generator`` is not a ``torch.Generator``.
        ValueError: ``recipe`` or ``role`` unknown, or ``x`` is 0-dim.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"fake_quantize(x of {got}): x must be a float32, bfloat16, float16 or float64 tensor.")
    spec = resolve(recipe, f"fake_quantize(recipe={recipe!r})")
    if role not in get_args(QuantRole):
        raise ValueError(f"fake_quantize(role={role!r}): role must be one of {list(get_args(QuantRole))}; blocks and "
                         "rounding differ by role.")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"fake_quantize(generator={generator!r}): generator must be a torch.Generator or None.")
    if x.dim() == 0:
        raise ValueError(f"fake_quantize(x of shape {tuple(x.shape)}): x must have at least one dim; block scales "
                         "run along the last one.")
    if x.numel() == 0:  # nothing to scale (an empty tensor has no amax): empty out, its gradient straight through
        return x.clone()
    return _StraightThrough.apply(x, spec, role, generator)


class _StraightThrough(torch.autograd.Function):
    # Rounding has a zero (or, through the FP8 casts, an accidental) derivative; QAT passes the gradient through.
    @staticmethod
    def forward(ctx, x: torch.Tensor, spec: Recipe, role: str, generator: torch.Generator | None) -> torch.Tensor:
        gemm: Role = _ROLE_OF[role]  # type: ignore[assignment]  # the three keys map to roles
        t = x.float()
        if role == "weight" and t.dim() == 1:
            t = t.unsqueeze(0)
        stochastic = role == "grad" and gemm in spec.stochastic_rounding
        values = quantize_operand(spec, gemm, role, t, stochastic=stochastic, generator=generator)  # type: ignore[arg-type]  # role is checked by fake_quantize
        return values.reshape(x.shape).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad, None, None, None


def reference_quantize(
    spec: Recipe, operand: QuantRole, x: torch.Tensor, *, grad_dtype: torch.dtype = torch.float8_e5m2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our reference for one operand of ``spec`` (``"input"``/``"weight"``: ``fprop``, ``"grad"``: ``dgrad``,
    rounded to nearest): ``(dequantized values in fp32, decode scales in fp32)`` with the scales per tensor
    (per-tensor formats: ``1 / scale``), per block (MX: the E8M0 power of two; blockwise: the tile's ``scale_inv``;
    NVFP4: E4M3 block scale times the tensor scale), what a backend's quantized codes and scales are compared with
    (:func:`lit_mpstable.fp8.native.check_conformance`)."""
    role: Role = "dgrad" if operand == "grad" else "fprop"
    info = spec.info(role)
    block = spec.block(role)
    t = x.float()
    if not info.quantized:
        return t.to(torch.bfloat16).float(), torch.ones(1)
    if info.kind == "mx":
        cols = _tile(operand, block)[1]
        q = mx_quantize(_pad(t, 1, cols), _mx_element(operand, info.fp4, grad_dtype), block_size=cols,
                        scale_rule=spec.scale_rule)
        scales = torch.ldexp(torch.ones_like(q.scale_e8m0, dtype=torch.float32), q.scale_e8m0.long() - 127)
        return _unpad(mx_dequantize(q), t.shape), scales
    if info.kind == "two_level":
        rows, cols = _tile(operand, block)
        nq = nvfp4_quantize(_pad(t, rows, cols), tile=(rows, cols), **nvfp4_kwargs(spec))
        return _unpad(nvfp4_dequantize(nq), t.shape), nq.block_scale.float().flatten() * nq.tensor_scale
    if info.kind == "tiles":
        bq = blockwise_quantize(t, tile=_tile(operand, block))
        return blockwise_dequantize(bq), bq.scale_inv.flatten()
    dtype = _fp8_dtype(operand, grad_dtype)
    scale = current_scale(t.abs().amax(), dtype, margin=spec.margin)
    return dequantize(quantize(t, scale, dtype), scale), scale.reciprocal().reshape(1)

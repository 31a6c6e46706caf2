"""``fake_quantize``: what a recipe's quantizer does to a tensor, per role, as one public function."""

from __future__ import annotations

from typing import Literal, get_args

import torch

from lit_mpstable.fp8.blockwise import BLOCKWISE_TILE, blockwise_dequantize, blockwise_quantize
from lit_mpstable.fp8.mx import MXElement, mx_dequantize, mx_quantize
from lit_mpstable.fp8.nvfp4 import NVFP4_BLOCK_SIZE, nvfp4_dequantize, nvfp4_quantize
from lit_mpstable.fp8.quant import MX_BLOCK_SIZE, current_scale, dequantize, quantize

QuantRecipe = Literal["current", "blockwise", "mxfp4", "mxfp8", "nvfp4"]
QuantRole = Literal["input", "weight", "grad"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def fake_quantize(
    x: torch.Tensor,
    recipe: QuantRecipe,
    *,
    role: QuantRole = "input",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``x`` quantized with ``recipe``'s quantizer for ``role`` and dequantized, in ``x``'s dtype and shape.

    The quantizer alone: no random Hadamard transform (see :mod:`lit_mpstable.fp8.hadamard`), no amax history.
    Blocks run along the last dim (a GEMM's reduction dim); weights' 2-D blocks over the last two dims.

    - ``"current"``: one scale per tensor, ``448 / amax`` (E4M3) for inputs and weights, ``57344 / amax`` (E5M2)
      for gradients (the package's ``format="hybrid"``).
    - ``"blockwise"``: E4M3 with power-of-two FP32 scales (TransformerEngine's ``Float8BlockScaling`` default), one
      per 1x128 tile of inputs and gradients and per 128x128 block of weights; partial tiles are zero-padded.
    - ``"mxfp4"`` / ``"mxfp8"``: OCP MX v1.0, E2M1 / E4M3 elements (E5M2 for gradients with ``"mxfp8"``) with an
      E8M0 scale per 32 elements, every role.
    - ``"nvfp4"``: E2M1 elements, an E4M3 scale per 1x16 block (16x16 for weights) and an FP32 tensor scale;
      gradients are rounded stochastically from ``generator`` (the default generator when None; a seeded one
      repeats the draw), inputs and weights to nearest even. ``generator`` is used nowhere else. Under
      ``torch.compile`` pass None (it cannot trace a generator), or call ``nvfp4.nvfp4_quantize`` with ``noise``.

    The arithmetic is fp32 (a float64 ``x`` is rounded to fp32 first). Non-finite values never come back finite,
    and poison what the reference quantizers poison: ``"current"`` and ``"nvfp4"`` the whole tensor (a NaN or inf
    amax makes the per-tensor scale non-finite: every element NaN, as torchao and TransformerEngine); ``"blockwise"``
    the 1x128 tile (128x128 block) holding it (NaN, as TE's reference); MX (torchao's ``to_mx``) a NaN's 32-element
    block (NaN), while a block whose amax is inf keeps ±inf there and rounds its finite elements to 0, leaving other
    blocks untouched. The gradient is straight-through (the identity), as in quantization-aware training.

    Raises:
        TypeError: ``x`` is not a floating-point tensor, or ``generator`` is not a ``torch.Generator``.
        ValueError: ``recipe`` or ``role`` unknown, or (MX, NVFP4) the block does not divide ``x``'s last dim (an
            empty ``x`` comes back empty, as long as the block divides its dims), or
            for NVFP4 weights its second-to-last: the message says which dim and what to do.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"fake_quantize(x of {got}): x must be a float32, bfloat16, float16 or float64 tensor.")
    if recipe not in get_args(QuantRecipe):
        raise ValueError(f"fake_quantize(recipe={recipe!r}): recipe must be one of {list(get_args(QuantRecipe))}.")
    if role not in get_args(QuantRole):
        raise ValueError(f"fake_quantize(role={role!r}): role must be one of {list(get_args(QuantRole))}; blocks and "
                         "rounding differ by role.")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"fake_quantize(generator={generator!r}): generator must be a torch.Generator or None.")
    if x.dim() == 0:
        raise ValueError(f"fake_quantize(x of shape {tuple(x.shape)}): x must have at least one dim; block scales "
                         "run along the last one.")
    if recipe in ("mxfp4", "mxfp8"):
        _check_divides(x, recipe, role, rows=1, cols=MX_BLOCK_SIZE)
    if recipe == "nvfp4":
        _check_divides(x, recipe, role, rows=NVFP4_BLOCK_SIZE if role == "weight" else 1, cols=NVFP4_BLOCK_SIZE)
    if x.numel() == 0:  # nothing to scale (an empty tensor has no amax): empty out, its gradient straight through
        return x.clone()
    return _StraightThrough.apply(x, recipe, role, generator)


class _StraightThrough(torch.autograd.Function):
    # Rounding has a zero (or, through the FP8 casts, an accidental) derivative; QAT passes the gradient through.
    @staticmethod
    def forward(ctx, x: torch.Tensor, recipe: str, role: str, generator: torch.Generator | None) -> torch.Tensor:
        return _fake_quantize(x, recipe, role, generator)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad, None, None, None


def _fake_quantize(x: torch.Tensor, recipe: str, role: str, generator: torch.Generator | None) -> torch.Tensor:
    if recipe == "current":
        dtype = torch.float8_e5m2 if role == "grad" else torch.float8_e4m3fn
        scale = current_scale(x.abs().amax(), dtype)
        return dequantize(quantize(x, scale, dtype), scale, x.dtype)
    if recipe == "blockwise":
        tile = (BLOCKWISE_TILE, BLOCKWISE_TILE) if role == "weight" else (1, BLOCKWISE_TILE)
        return blockwise_dequantize(blockwise_quantize(x, tile=tile), x.dtype)
    if recipe in ("mxfp4", "mxfp8"):
        element: MXElement = "fp4_e2m1" if recipe == "mxfp4" else "fp8_e5m2" if role == "grad" else "fp8_e4m3"
        return mx_dequantize(mx_quantize(x, element, block_size=MX_BLOCK_SIZE), x.dtype)
    rows = NVFP4_BLOCK_SIZE if role == "weight" else 1
    q = nvfp4_quantize(x, tile=(rows, NVFP4_BLOCK_SIZE), stochastic=role == "grad", generator=generator)
    return nvfp4_dequantize(q, x.dtype)


def _check_divides(x: torch.Tensor, recipe: str, role: str, *, rows: int, cols: int) -> None:
    call = f"fake_quantize(x of shape {tuple(x.shape)}, recipe={recipe!r}, role={role!r})"
    fix = (f"pad it with zeros to a multiple of {cols}, or keep this tensor's layer in high precision (the hardware "
           "kernels of TransformerEngine and torchao refuse partial blocks too).")
    if x.shape[-1] % cols:
        raise ValueError(f"{call}: the last dim ({x.shape[-1]}) must be a multiple of {cols}, the {recipe} block "
                         f"along it; {fix}")
    if rows > 1 and (x.dim() < 2 or x.shape[-2] % rows):
        dim = x.shape[-2] if x.dim() >= 2 else None
        raise ValueError(f"{call}: a weight's second-to-last dim ({dim}) must be a multiple of {rows}, since its "
                         f"scales cover {rows}x{cols} tiles; {fix}")

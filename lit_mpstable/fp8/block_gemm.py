"""The three GEMMs of a linear layer under the block-scaled recipes (blockwise FP8, MXFP4, NVFP4) and any recipe whose
roles take different formats, emulated exactly: each operand quantised as its GEMM role's format says
(:func:`~lit_mpstable.fp8.quantizers.quantize_operand`) along that GEMM's reduction dim, dequantised, multiplied in
fp32. The registered recipes, per GEMM (``x``: (tokens, in), ``W``: (out, in), ``dY``: (tokens, out)):

============  ==========================  ==========================  =========================================
recipe        forward ``x W^T``           dgrad ``dY W``              wgrad ``dY^T x``
============  ==========================  ==========================  =========================================
blockwise     x 1x128, W 128x128          dY 1x128, W 128x128 (same)  dY^T, x^T 1x128 along tokens
mxfp4         x, W 32 along ``in``        dY, W^T 32 along ``out``    dY^T, x^T 32 along tokens
nvfp4         x 1x16, W 16x16             dY 1x16 (SR), W 16x16 (same) RHT(dY^T) 1x16 (SR), RHT(x^T) 1x16
============  ==========================  ==========================  =========================================

The weight's 2-D blocks (blockwise, nvfp4) make a weight and its transpose quantise alike, so the forward and the
dgrad use one quantized weight. RHT is the 16x16 random Hadamard transform along the token dim of both wgrad operands:
orthogonal, so it cancels in the product and only spreads outliers before quantisation. SR (stochastic rounding)
draws its noise from :func:`hash_uniform` of (the layer's seed, its step counter, a stream), so a resumed run repeats
it and ``torch.compile`` traces it (no ``torch.Generator``). The token dim is zero-padded up to the block where it is
not a multiple (zeros add nothing to the product; padded rows of a Hadamard block are what a kernel would see).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.nn.functional as F

from lit_mpstable.fp8.hadamard import HADAMARD_SIZE, random_hadamard_transform
from lit_mpstable.fp8.quant import as_stored, to_stored
from lit_mpstable.fp8.quantizers import quantize_operand
from lit_mpstable.fp8.recipe import Recipe

_MASK = 0xFFFFFFFF
# Stream tags of the two stochastically rounded operands, so their noise never coincides.
DGRAD_STREAM, WGRAD_STREAM = 1, 2


def layer_seed(name: str) -> int:
    """A layer's 31-bit seed from its qualified name (CRC-32): the same on every rank and after a resume, and whether
    a parent was ``torch.compile``d or not (the compiled wrapper's ``_orig_mod.`` is not part of the name)."""
    return zlib.crc32(name.replace("_orig_mod.", "").encode()) & 0x7FFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit integer finaliser (xor-shift-multiply, multipliers below 2**31 so int64 products never overflow).
    x = x & _MASK
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK
    x = ((x ^ (x >> 15)) * 0x1B873593) & _MASK
    return x ^ (x >> 16)


def hash_uniform(
    shape: tuple[int, ...] | torch.Size, seed: torch.Tensor | int, counter: torch.Tensor | int, stream: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Uniform fp32 draws in [0, 1), one per element of ``shape``, a pure function of (seed, counter, stream, index).

    Counter-based (as Philox is): nothing to carry but the counter, any device gives the same bits, and it compiles
    to plain integer ops. 24 random bits per draw (``k * 2**-24``), enough for E2M1's one mantissa bit.
    """
    seed = torch.as_tensor(seed, dtype=torch.int64, device=device)
    counter = torch.as_tensor(counter, dtype=torch.int64, device=device)
    key = _mix(_mix(_mix(seed) ^ (counter & _MASK)) ^ ((counter >> 32) + stream * 0x9E3779B))
    numel = 1
    for size in shape:
        numel *= size
    index = torch.arange(numel, dtype=torch.int64, device=device)
    bits = _mix(_mix(index ^ key) + key)
    return ((bits >> 8).to(torch.float32) * 2.0**-24).reshape(shape)


def rht_signs(seed: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The layer's fixed ±1 diagonal of the 16x16 random Hadamard transform (fp32), from its seed."""
    draws = hash_uniform((HADAMARD_SIZE,), seed, 0, 0, device=device)
    return torch.where(draws < 0.5, -1.0, 1.0)


def shares_weight(spec: Recipe) -> bool:
    """Whether the forward and the dgrad use one quantized weight: the same format and 2-D weight blocks."""
    block = spec.fprop_block
    return spec.fprop == spec.dgrad and block == spec.dgrad_block and block is not None and block[0] > 1


def quantize_weight(spec: Recipe, weight: torch.Tensor) -> torch.Tensor | None:
    """The weight as forward and dgrad both see it (fp32) where they share it (:func:`shares_weight`), else None
    (its blocks run along a different dim in each GEMM)."""
    return quantize_operand(spec, "fprop", "weight", weight) if shares_weight(spec) else None


def block_gemm_forward(spec: Recipe, x2: torch.Tensor, weight: torch.Tensor, w_q: torch.Tensor | None,
                       grad_dtype: torch.dtype = torch.float8_e5m2) -> torch.Tensor:
    """``Q(x) @ Q(W)^T`` in fp32 with the recipe's ``fprop`` format; ``w_q`` is :func:`quantize_weight`'s result."""
    w = w_q if w_q is not None else quantize_operand(spec, "fprop", "weight", weight)
    return quantize_operand(spec, "fprop", "input", x2, grad_dtype=grad_dtype) @ w.t()


def block_gemms_backward(
    spec: Recipe,
    g2: torch.Tensor,
    x2: torch.Tensor,
    weight: torch.Tensor,
    w_q: torch.Tensor | None,
    *,
    seed: torch.Tensor | int = 0,
    counter: torch.Tensor | int = 0,
    signs: torch.Tensor | None = None,
    grad_dtype: torch.dtype = torch.float8_e5m2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_W)`` in fp32 from the output gradient ``g2`` (tokens, out) and the forward's ``x2``, with the
    recipe's ``dgrad`` and ``wgrad`` formats.

    ``seed``/``counter`` key the stochastic rounding of the gradient operands of the roles in
    ``spec.stochastic_rounding``; ``signs`` is the random Hadamard diagonal (:func:`rht_signs`) for ``spec.hadamard``.
    """
    sr_dgrad, sr_wgrad = "dgrad" in spec.stochastic_rounding, "wgrad" in spec.stochastic_rounding
    noise = hash_uniform(g2.shape, seed, counter, DGRAD_STREAM, g2.device) if sr_dgrad else None
    w_cols = w_q if w_q is not None and shares_weight(spec) else quantize_operand(
        spec, "dgrad", "weight", weight.t()).t()  # blocks along out_features (2-D ones: the transposed tiles)
    g_q = quantize_operand(spec, "dgrad", "grad", g2, grad_dtype=grad_dtype, stochastic=sr_dgrad, noise=noise)
    grad_x = g_q @ w_cols
    # wgrad reduces over the tokens: both operands transposed, tokens last, padded to whole blocks.
    hadamard = "wgrad" in spec.hadamard
    token_block = max(spec.info("wgrad").multiple, HADAMARD_SIZE if hadamard else 1)
    pad = -g2.shape[0] % token_block
    g_t, x_t = F.pad(g2.float().t(), (0, pad)), F.pad(x2.float().t(), (0, pad))
    if hadamard:
        assert signs is not None  # FP8Linear registers rht_signs for a recipe with hadamard
        g_t, x_t = random_hadamard_transform(g_t, signs), random_hadamard_transform(x_t, signs)
    noise = hash_uniform(g_t.shape, seed, counter, WGRAD_STREAM, g2.device) if sr_wgrad else None
    g_tq = quantize_operand(spec, "wgrad", "grad", g_t, grad_dtype=grad_dtype, stochastic=sr_wgrad, noise=noise)
    grad_w = g_tq @ quantize_operand(spec, "wgrad", "input", x_t, grad_dtype=grad_dtype).t()
    return grad_x, grad_w


class BlockLinearFunction(torch.autograd.Function):
    """The block recipes' three GEMMs (:mod:`lit_mpstable.fp8.block_gemm`), and any recipe whose roles differ; saves
    the inputs and, for a shared 2-D-block weight, the quantized weight, so the dgrad uses the very weight the
    forward used."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        layer: Any,  # an FP8Linear (its recipe, stochastic-rounding seed and signs)
        out_dtype: torch.dtype,
        counter: torch.Tensor | None,
    ) -> torch.Tensor:
        spec, grad_dtype = layer.fp8_config.spec, layer.fp8_config.grad_dtype
        x2 = x.reshape(-1, x.shape[-1])
        w_q = quantize_weight(spec, weight)
        y = block_gemm_forward(spec, as_stored(x2), weight, w_q, grad_dtype)  # fp32; bias added before the rounding
        if bias is not None:
            y = y + bias.float()
        ctx.layer, ctx.spec, ctx.x_shape, ctx.x_dtype = layer, spec, x.shape, x.dtype
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x2, weight, w_q, counter)
        return to_stored(y, out_dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        layer, spec = ctx.layer, ctx.spec
        x2, weight, w_q, counter = ctx.saved_tensors
        g2 = as_stored(grad_out.reshape(-1, grad_out.shape[-1]))
        with torch.autocast(grad_out.device.type, enabled=False):
            keyed = spec.needs_counter
            grad_x, grad_w = block_gemms_backward(
                spec, g2, as_stored(x2), weight, w_q,  # compiled: x2 may be recomputed, fused
                seed=layer.sr_seed if keyed else 0, counter=counter if keyed else 0,
                signs=layer.rht_signs if "wgrad" in spec.hadamard else None, grad_dtype=layer.fp8_config.grad_dtype,
            )  # fmt: skip
            grad_b = to_stored(g2.float().sum(0), layer.bias.dtype) if ctx.has_bias else None
        grad_x, grad_w = to_stored(grad_x, ctx.x_dtype), to_stored(grad_w, weight.dtype)
        return grad_x.reshape(ctx.x_shape), grad_w, grad_b, None, None, None


@torch.library.custom_op("lit_mpstable::counter_snapshot", mutates_args=())
def counter_snapshot(counter: torch.Tensor) -> torch.Tensor:
    """A copy of a buffer that the forward reads before it updates it, for the backward: nvfp4's step counter, the
    delayed recipe's scales (:class:`~lit_mpstable.fp8.linear.FP8Linear`).

    An opaque op on purpose: with a plain ``clone()``, torch.compile's partitioner (torch 2.13) recomputes the copy
    in the backward from the buffer, which the forward's ``add_`` has advanced by then, so the compiled backward
    drew the noise of the next step (caught by ``test_compiles_without_graph_breaks_and_matches_eager``). A custom
    op is saved, not recomputed.
    """
    return counter.clone()


@counter_snapshot.register_fake
def _(counter: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(counter)

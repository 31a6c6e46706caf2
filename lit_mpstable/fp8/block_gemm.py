"""The three GEMMs of a linear layer under the block-scaled recipes (blockwise FP8, MXFP4, NVFP4), emulated exactly:
each operand quantised along that GEMM's reduction dim, dequantised, multiplied in fp32.

Per recipe and GEMM (``x``: (tokens, in), ``W``: (out, in), ``dY``: (tokens, out)):

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

from lit_mpstable.fp8.blockwise import BLOCKWISE_TILE, blockwise_dequantize, blockwise_quantize
from lit_mpstable.fp8.hadamard import HADAMARD_SIZE, random_hadamard_transform
from lit_mpstable.fp8.mx import mx_dequantize, mx_quantize
from lit_mpstable.fp8.nvfp4 import NVFP4_BLOCK_SIZE, nvfp4_dequantize, nvfp4_quantize
from lit_mpstable.fp8.quant import as_stored, to_stored

_MASK = 0xFFFFFFFF
# Stream tags of the two stochastically rounded operands, so their noise never coincides.
DGRAD_STREAM, WGRAD_STREAM = 1, 2
_TOKEN_BLOCK = {"blockwise": 1, "mxfp4": 32, "nvfp4": NVFP4_BLOCK_SIZE}  # blockwise pads its own tiles


def layer_seed(name: str) -> int:
    """A layer's 31-bit seed from its qualified name (CRC-32): the same on every rank and after a resume."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


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


def quantize_weight(recipe: str, weight: torch.Tensor) -> torch.Tensor | None:
    """The weight as forward and dgrad both see it (fp32), for the 2-D-block recipes; None for mxfp4, whose blocks
    run along a different dim in each GEMM."""
    if recipe == "blockwise":
        return blockwise_dequantize(blockwise_quantize(weight, tile=(BLOCKWISE_TILE, BLOCKWISE_TILE)))
    if recipe == "nvfp4":
        return nvfp4_dequantize(nvfp4_quantize(weight, tile=(NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)))
    return None


def _rows(recipe: str, t: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` (2-D) quantised in 1-row blocks along its last dim and dequantised (fp32); ``noise``: nvfp4 SR."""
    if recipe == "blockwise":
        return blockwise_dequantize(blockwise_quantize(t, tile=(1, BLOCKWISE_TILE)))
    if recipe == "mxfp4":
        return mx_dequantize(mx_quantize(t, "fp4_e2m1", block_size=32))
    q = nvfp4_quantize(t, tile=(1, NVFP4_BLOCK_SIZE), stochastic=noise is not None, noise=noise)
    return nvfp4_dequantize(q)


def block_gemm_forward(recipe: str, x2: torch.Tensor, weight: torch.Tensor, w_q: torch.Tensor | None) -> torch.Tensor:
    """``Q(x) @ Q(W)^T`` in fp32; ``w_q`` is :func:`quantize_weight`'s result where the recipe has one."""
    w = w_q if w_q is not None else _rows(recipe, weight)
    return _rows(recipe, x2) @ w.t()


def block_gemms_backward(
    recipe: str,
    g2: torch.Tensor,
    x2: torch.Tensor,
    weight: torch.Tensor,
    w_q: torch.Tensor | None,
    *,
    seed: torch.Tensor | int = 0,
    counter: torch.Tensor | int = 0,
    signs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_W)`` in fp32 from the output gradient ``g2`` (tokens, out) and the forward's ``x2``.

    nvfp4: ``seed``/``counter`` key the stochastic rounding of both gradient operands; ``signs`` is the random
    Hadamard diagonal (:func:`rht_signs`).
    """
    nvfp4 = recipe == "nvfp4"
    noise = hash_uniform(g2.shape, seed, counter, DGRAD_STREAM, g2.device) if nvfp4 else None
    w_cols = w_q if w_q is not None else _rows(recipe, weight.t()).t()  # mxfp4: blocks along out_features
    grad_x = _rows(recipe, g2, noise) @ w_cols
    # wgrad reduces over the tokens: both operands transposed, tokens last, padded to whole blocks.
    pad = -g2.shape[0] % _TOKEN_BLOCK[recipe]
    g_t, x_t = F.pad(g2.float().t(), (0, pad)), F.pad(x2.float().t(), (0, pad))
    if nvfp4:
        assert signs is not None
        g_t, x_t = random_hadamard_transform(g_t, signs), random_hadamard_transform(x_t, signs)
        noise = hash_uniform(g_t.shape, seed, counter, WGRAD_STREAM, g2.device)
    grad_w = _rows(recipe, g_t, noise) @ _rows(recipe, x_t).t()
    return grad_x, grad_w


class BlockLinearFunction(torch.autograd.Function):
    """The block recipes' three GEMMs (:mod:`lit_mpstable.fp8.block_gemm`); saves the inputs and, for 2-D weight
    blocks, the quantized weight, so the dgrad uses the very weight the forward used."""

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
        recipe = layer.fp8_config.recipe
        x2 = x.reshape(-1, x.shape[-1])
        w_q = quantize_weight(recipe, weight)
        y = block_gemm_forward(recipe, as_stored(x2), weight, w_q)  # fp32; bias added before the one rounding
        if bias is not None:
            y = y + bias.float()
        ctx.layer, ctx.recipe, ctx.x_shape, ctx.x_dtype = layer, recipe, x.shape, x.dtype
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x2, weight, w_q, counter)
        return to_stored(y, out_dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        layer = ctx.layer
        x2, weight, w_q, counter = ctx.saved_tensors
        g2 = as_stored(grad_out.reshape(-1, grad_out.shape[-1]))
        with torch.autocast(grad_out.device.type, enabled=False):
            nvfp4 = ctx.recipe == "nvfp4"
            grad_x, grad_w = block_gemms_backward(
                ctx.recipe, g2, as_stored(x2), weight, w_q,  # compiled: x2 may be recomputed, fused
                seed=layer.sr_seed if nvfp4 else 0, counter=counter if nvfp4 else 0,
                signs=layer.rht_signs if nvfp4 else None,
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

"""Pure FP8 quantisation: amax -> scale, saturating casts, and OCP MX block scaling."""

from __future__ import annotations

import torch

from lit_mpstable.fp8.minifloat import E4M3, E5M2
from lit_mpstable.fp8.mx import mx_blocks, mx_scale_exponent, pow2

MX_BLOCK_SIZE = 32
"""Elements sharing one E8M0 scale (OCP Microscaling Formats spec v1.0, MXFP8)."""

def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype: 448 for E4M3, 57344 for E5M2."""
    return float(torch.finfo(dtype).max)


def compute_scale(
    amax: torch.Tensor, dtype: torch.dtype, *, margin: int = 0, previous: torch.Tensor | float = 1.0
) -> torch.Tensor:
    """The multiplier that maps ``amax`` onto the largest FP8 value: ``fp8_max / amax / 2**margin``, in fp32,
    correctly rounded.

    Where ``amax`` is 0 or not finite, or the scale would not be finite (amax below ~fp8_max / 3e38), there is no
    information to scale by, so ``previous`` is kept (1.0 for a tensor never seen). No host synchronisation.
    """
    amax = amax.float()  # fp32: the reciprocal of a tiny bf16/fp16 amax overflows those formats
    # A tensor divided by a tensor rounds once. ``fp8_max / amax`` would not: torch computes a Python number over a
    # tensor as ``amax.reciprocal() * fp8_max``, 1 ulp off the quotient for ~1 amax in 4 (torchao divides in
    # float64, TE's kernel in fp32: both round once, so the three agree bit for bit).
    scale = torch.full_like(amax, fp8_max(dtype)) / amax / 2.0**margin
    usable = torch.isfinite(amax) & (amax > 0) & torch.isfinite(scale)
    previous = torch.as_tensor(previous, dtype=torch.float32, device=amax.device)
    return torch.where(usable, scale, previous)


def current_scale(amax: torch.Tensor, dtype: torch.dtype, *, margin: int = 0) -> torch.Tensor:
    """The current recipe's scale: :func:`compute_scale` of this tensor's own ``amax``, but NaN where ``amax`` is
    inf or NaN, so the whole tensor quantizes to NaN, as torchao's and TransformerEngine's current scaling do (the
    scale 1.0 kept the finite elements: ``[1e-3, 0.3, 1000, inf]`` gave ``[0.00195, 0.3125, 448, nan]``). An
    all-zero tensor keeps scale 1."""
    return torch.where(torch.isfinite(amax), compute_scale(amax, dtype, margin=margin), torch.nan)


def amax_from_history(history: torch.Tensor, algo: str = "max") -> torch.Tensor:
    """The amax a delayed scale is computed from: the max over ``history[..., :]`` or its newest entry ``[..., 0]``."""
    if algo == "max":
        return history.amax(dim=-1)
    if algo == "most_recent":
        return history[..., 0]
    raise ValueError(f"amax_from_history(algo={algo!r}): algo must be 'max' or 'most_recent'.")


def update_amax_history_(history: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Roll ``history`` one step along its last dim and write ``amax`` as the newest entry (index 0), in place.

    A non-finite amax (an overflowing step that the loss scaler will skip) is recorded as 0, so one bad step
    does not freeze the scale for the whole history length.
    """
    amax = amax.float()
    history.copy_(history.roll(1, dims=-1))
    history[..., 0] = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
    return history


def _saturating_cast(scaled: torch.Tensor, source: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Clamp finite values to the format's range (the plain cast gives NaN/inf, or on some builds silently clips inf
    # to 448), and send non-finite inputs to NaN on every device, so an overflow still reaches the loss scaler.
    limit = fp8_max(dtype)
    clamped = scaled.clamp(-limit, limit)
    return torch.where(torch.isfinite(source), clamped, torch.nan).to(dtype)


def quantize(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` cast to ``dtype`` (an FP8 dtype) with saturation at ``±fp8_max``; inf/NaN inputs become NaN.

    The product is formed in fp32, so ``x ~= dequantize(quantize(x, s, dtype), s)`` up to FP8 rounding.
    """
    return _saturating_cast(x.float() * scale, x, dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q / scale`` in fp32, then cast to ``dtype``: the inverse of :func:`quantize` on representable values."""
    return (q.float() / scale).to(dtype)


def mx_block_scales(
    x: torch.Tensor, dtype: torch.dtype, *, block_size: int = MX_BLOCK_SIZE, scale_rule: str = "rceil"
) -> torch.Tensor:
    """Power-of-two (E8M0) scales, one per ``block_size`` consecutive elements of the last dim, in fp32.

    ``scale_rule="rceil"`` (the default, TransformerEngine's MXFP8 and torchao's training default): ``amax / max``
    rounded up to a power of two (``float_to_e8m0(amax * fl32(1 / max))``), so no finite element saturates;
    ``"floor"``, OCP MX v1.0 section 6.3: ``X = 2**(floor(log2(amax_block)) - emax)`` with ``emax`` the exponent of
    the format's largest normal (8 for E4M3, 15 for E5M2), which lets values reach up to ``2**(emax+1)``, so values
    above ``fp8_max`` (448 for E4M3) saturate. Both are clamped to E8M0's range ``[2**-127, 2**127]``
    (:func:`lit_mpstable.fp8.mx.mx_scale_exponent`). An all-zero block gets ``2**-127``; a block holding inf or
    NaN gets NaN. A partial last block is scaled by the amax of its elements. Shape: ``(..., ceil(n / block_size))``.

    Raises:
        ValueError: ``scale_rule`` is not ``"rceil"`` or ``"floor"``.
    """
    if scale_rule not in ("rceil", "floor"):
        raise ValueError(f"mx_block_scales(scale_rule={scale_rule!r}): scale_rule must be 'rceil' "
                         "(TransformerEngine) or 'floor' (OCP MX v1.0).")
    amax = mx_blocks(x, block_size).abs().amax(dim=-1)
    fmt = E5M2 if dtype == torch.float8_e5m2 else E4M3
    scale = pow2(mx_scale_exponent(amax, fmt, scale_rule).clamp(max=254) - 127)
    return torch.where(torch.isfinite(amax), scale, torch.nan)  # E8M0's NaN: the block held inf/NaN


def quantize_mx(
    x: torch.Tensor, dtype: torch.dtype, *, block_size: int = MX_BLOCK_SIZE, scale_rule: str = "rceil"
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX-quantise along the last dim: ``(data, block_scale)`` with ``x ~= data * block_scale`` blockwise.

    ``data`` has ``x``'s shape and FP8 ``dtype``; ``block_scale`` is :func:`mx_block_scales` (fp32 powers of two, so
    ``block_scale.to(torch.float8_e8m0fnu)`` is lossless). The division by a power of two is exact.
    """
    scale = mx_block_scales(x, dtype, block_size=block_size, scale_rule=scale_rule)
    blocks = mx_blocks(x, block_size)
    data = _saturating_cast(blocks / scale.unsqueeze(-1), blocks, dtype)
    return data.flatten(-2)[..., : x.shape[-1]], scale


def dequantize_mx(
    data: torch.Tensor,
    block_scale: torch.Tensor,
    *,
    block_size: int = MX_BLOCK_SIZE,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``data * block_scale`` blockwise along the last dim, in fp32, then cast to ``dtype``."""
    values = mx_blocks(data, block_size) * block_scale.unsqueeze(-1)
    return values.flatten(-2)[..., : data.shape[-1]].to(dtype)


def clip_threshold(dtype: torch.dtype) -> float:
    # Up to half an ulp above the max a value rounds to the max anyway; only what lies beyond is clipped (464 for
    # E4M3, 61440 for E5M2). Counting from the max itself would flag amax * (448 / amax) = 448.00003 as saturated.
    info = torch.finfo(dtype)
    emax = int(info.max).bit_length() - 1
    return info.max + 2.0**emax * info.eps / 2


def as_stored(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the values eager execution stores for it: ``t`` itself, except under ``torch.compile`` for a
    bf16/fp16 ``t``, which comes back in fp32, explicitly rounded to ``t.dtype``'s grid.

    Inductor computes a fused chain of 16-bit ops in fp32 and elides the downcast-upcast pair between them (unless
    its global ``emulate_precision_casts`` is set), so an FP8 cast fused with the bf16 op that produced its input
    (a GELU, a gradient's GELU backward) read the unrounded fp32 values: other amaxes, other FP8 data than eager.
    Rounding in integer/float arithmetic, which inductor keeps, makes the compiled values eager's (as far as the
    producer's own fp32 values agree). Readers take ``.float()`` of the result either way.
    """
    if t.dtype not in _ROUNDED or not torch.compiler.is_compiling():
        return t
    return _round_to(t.float(), t.dtype)


def to_stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, rounded explicitly under ``torch.compile`` (:func:`as_stored`), so that an op fused with
    this cast downstream reads the rounded values, as it does in eager."""
    if dtype in _ROUNDED and t.dtype != dtype and torch.compiler.is_compiling():
        t = _round_to(t.float(), dtype)
    return t.to(dtype)


_ROUNDED = (torch.bfloat16, torch.float16)


def _round_to(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # fp32 ``v`` rounded to nearest even onto bf16's or fp16's grid (overflow to inf), in fp32: ``v.to(dtype).float()``
    # as arithmetic. bf16 keeps fp32's exponent: drop the low 16 bits of the magnitude, rounding on the bits (NaN is
    # clamped to inf's bits first, so nothing overflows int32, and put back after). fp16: divide by the quantum at
    # |v| (a power of two: exact), round half to even, multiply back; past fp16's max is inf, as the cast gives.
    bits = v.view(torch.int32)
    if dtype == torch.bfloat16:
        magnitude = (bits & 0x7FFFFFFF).clamp(max=0x7F800000)
        rounded = (magnitude + (0x7FFF + ((magnitude >> 16) & 1))) & -0x10000
        out = (rounded | (bits & -0x80000000)).view(torch.float32)
        return torch.where(torch.isnan(v), v, out)
    exponent = (((bits >> 23) & 0xFF) - 127).clamp(min=-14) - 10  # the fp16 quantum's exponent, >= -24: normal
    quantum = ((exponent + 127) << 23).view(torch.float32)
    rounded = torch.round(v / quantum) * quantum
    return torch.where(rounded.abs() > torch.finfo(torch.float16).max, v.sign() * torch.inf, rounded)


def inside_backward() -> bool:
    # The autograd engine runs a graph task only during backward; a module forward inside one is a recompute
    # (torch.utils.checkpoint recomputes in the backward, with use_reentrant True or False). A compiled graph
    # recomputes inside its own backward graph, without calling the module again.
    if torch.compiler.is_compiling() or _GRAPH_TASK_ID is None:
        return False
    return _GRAPH_TASK_ID() != -1


_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)  # -1 outside a backward pass

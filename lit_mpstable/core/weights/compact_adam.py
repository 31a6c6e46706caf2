"""The arithmetic of CompactWeights' fused Adam step (:mod:`~lit_mpstable.core.weights.compact_fused` compiles and runs
it): torch's Adam, operation for operation, on FP32 values of 16-bit tensors, and a stochastic rounding to BF16 in float
arithmetic that a compiled kernel keeps vectorized."""

from __future__ import annotations

import torch

from lit_mpstable.core.weights.compact_rounding import hash32

_SPLIT = float(2**23 + 1)  # Veltkamp's constant that rounds an FP32 number to one significant bit
_BIG = 2.0**103  # beyond it a * _SPLIT would overflow: such values are rounded to nearest


def _round_stochastic_bf16(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """FP32 ``x`` stochastically rounded to BF16 with the 16 random bits ``k`` (an FP32 tensor holding k - 32767):
    bit for bit ``lit_mpstable.core.weights.compact_rounding.round_stochastic_`` (adding k to the low half of x's bits
    and truncating),
    in float arithmetic a compiled kernel keeps vectorized (its bit casts are not, beside BF16 data), except that a
    tie (one draw in 65536 for each x) rounds to even and that ``|x| >= 2**103`` rounds to nearest.

    With ``e = 2**floor(log2 |x|)`` and FP32's spacing ``d = e * 2**-23`` there, ``y = |x| + (k - 32767) d`` is exact
    and sits within half a BF16 spacing (``2**16 d``) of the value the bit trick picks, so rounding y to nearest picks
    it; ``y >= e`` keeps y out of the finer grid below e; subnormals have d = 2**-149.
    """
    a = x.abs()
    clamped = torch.clamp(a, max=_BIG)
    t = clamped * _SPLIT
    p = t - (t - clamped)  # a to one significant bit: e or 2e
    e = torch.where(p > a, p * 0.5, p)
    y = torch.maximum(a + k * torch.clamp(e * 2.0**-23, min=2.0**-149), e)
    return torch.copysign(y, x).to(torch.bfloat16)


def _adam_kernel(
    w: torch.Tensor, comp: torch.Tensor | None, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
    scalars: torch.Tensor, key: torch.Tensor,
) -> None:
    _adam(w, comp, g, m, v, scalars, key, plain=False)


def _adam_plain_kernel(
    w: torch.Tensor, comp: torch.Tensor | None, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
    scalars: torch.Tensor, key: torch.Tensor,
) -> None:
    # A function of its own, not a flag of _adam_kernel: torch.compile keeps at most 8 graphs per function (mode,
    # one-element and offset variants), and a flag would double them.
    _adam(w, comp, g, m, v, scalars, key, plain=True)


def _adam(
    w: torch.Tensor, comp: torch.Tensor | None, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
    scalars: torch.Tensor, key: torch.Tensor, *, plain: bool,
) -> None:
    # torch's _single_tensor_adam, operation for operation, on FP32 values of the 16-bit tensors. scalars: gradient
    # multiplier (negative to maximize: the clip is symmetric), clip, 1 - lr * wd (AdamW; else 1), wd (Adam's L2; else
    # 0), 1 - beta1, beta2, 1 - beta2, sqrt(bias correction 2), eps, -lr / bias correction 1. Tensors, not Python
    # numbers: one graph serves every group and step (multiplying by 1 and adding 0 are exact). ``plain``: no clip
    # (scalars[1] is inf) and no L2 term (scalars[3] is 0), so the graph leaves both out, bit for bit the same values:
    # a clamp to +-inf returns its input, NaN included, and the L2 where picks the gradient. The NaN-propagating clamp
    # alone costs ~8% of the kernel on the CPU.
    value = w.float() + comp.float() if comp is not None else w.float()
    grad = g.float() * scalars[0]
    value = value * scalars[2]
    if not plain:
        grad = grad.clamp(-scalars[1], scalars[1])
        # Adam's L2 term; where there is none it is skipped as torch does (an inf weight times 0 would be NaN).
        grad = torch.where(scalars[3] != 0, grad + value * scalars[3], grad)
    exp_avg = torch.lerp(m.float(), grad, scalars[4])
    exp_avg_sq = v.float() * scalars[5] + scalars[6] * grad * grad
    denom = exp_avg_sq.sqrt() / scalars[7] + scalars[8]
    value = value + scalars[9] * exp_avg / denom
    index = torch.arange(w.numel(), device=w.device, dtype=torch.int32)
    k = ((hash32(index + key) >> 16) & 0xFFFF).float() - 32767.0  # shared by weight and moments, as eagerly
    if comp is not None:
        rounded = value.to(w.dtype)
        w.copy_(rounded)
        comp.copy_((value - rounded.float()).to(comp.dtype))  # needs emulate_precision_casts: the rounding is real
    else:
        w.copy_(_round_stochastic_bf16(value, k))
    m.copy_(_round_stochastic_bf16(exp_avg, k))
    v.copy_(_round_stochastic_bf16(exp_avg_sq, k))

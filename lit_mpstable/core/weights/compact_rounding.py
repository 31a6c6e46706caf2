"""Stochastic rounding into BF16/FP16 and the counter-based keys its random numbers are hashed from."""

from __future__ import annotations

import torch

_LOW = (torch.float16, torch.bfloat16)


def stochastic_round(
    value: torch.Tensor, dtype: torch.dtype, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Round ``value`` to ``dtype`` (BF16 or FP16) up or down at random, so that ``E[round(x)] == x``.

    Each element becomes one of its two ``dtype`` neighbours, the upper one with probability (x - lower) / (upper -
    lower), resolved to 2**-16 for BF16 and 2**-24 for FP16 (so an update below 2**-16 of a BF16 ulp never counts).
    Values ``dtype`` holds exactly are kept and inf stays inf; beyond FP16's range the result is nearest rounding's.
    """
    if dtype not in _LOW:
        raise ValueError(f"stochastic_round(dtype={dtype!r}): dtype must be torch.bfloat16 or torch.float16.")
    src = value.detach().to(torch.float32, copy=True)
    uniform = torch.rand(src.shape, generator=generator, device=src.device)
    return round_stochastic_(torch.empty_like(src, dtype=dtype), src, noise(uniform, dtype))


def noise(uniform: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # BF16: 16 random bits (the uniform number's top 16 of 24); FP16: the uniform numbers themselves.
    return uniform.mul_(65536.0).to(torch.int32) if dtype == torch.bfloat16 else uniform


def round_stochastic_(dst: torch.Tensor, src: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Write FP32 ``src`` (overwritten), stochastically rounded with :func:`noise` (kept), into 16-bit ``dst``."""
    noise = noise.view(src.shape)
    if dst.dtype == torch.bfloat16:
        # BF16 is FP32's upper half: adding 16 random bits to the lower half carries into the upper one with
        # probability (lower half) / 2**16, then truncation rounds toward zero. The sign is not in those bits, so the
        # carry rounds away from zero: up in magnitude, for negative values too (torchao's construction).
        bits = src.view(torch.int32)
        bits.add_(noise).bitwise_and_(-65536)
        return dst.copy_(src)  # exact now
    # FP16 has its own exponent bits: take the nearest neighbour and the one on the other side of src, and pick the
    # far one with probability |residual| / spacing (both exact in FP32; an infinite spacing gives probability 0).
    near = src.to(torch.float16)
    residual = src.sub_(near)
    far = torch.nextafter(near, torch.where(residual > 0, torch.inf, -torch.inf).to(torch.float16))
    spacing = far.float().sub_(near).abs_()
    return dst.copy_(torch.where(noise < residual.abs_().div_(spacing), far, near))


def step_keys(seed: int, step: int, streams: list[int]) -> list[int]:
    """The random key of element 0 of each stream (a parameter's CRC-32) at ``step`` of ``seed``: splitmix64 over
    the three, folded to 32 bits, as a signed int (the int32 that :func:`hash32` and the kernels add the element
    index to)."""
    h = _round(_round(_H0, seed), step)  # what the streams share: once a step, not once a stream
    keys = []
    for stream in streams:
        k = _round(h, stream)
        keys.append(_signed32(k ^ (k >> 32)))
    return keys


_H0 = 0x9E3779B97F4A7C15


def _round(h: int, v: int) -> int:
    # One value into splitmix64's state.
    h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return h ^ (h >> 29)


# 0x846CA68B as a signed 32-bit integer: the hash runs on int32 tensors with wrapping arithmetic.
_M1, _M2 = 0x7FEB352D, 0x846CA68B - 2**32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' ``lowbias32`` of every element of an int32 tensor (wrapping multiplication; the logical right
    shifts are arithmetic ones masked): a bijection of 32-bit words whose output bits each flip with probability
    ~1/2 when one input bit does. Eager and compiled code give the same words."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _M1
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _M2
    return x ^ ((x >> 16) & 0xFFFF)


def words(numel: int, offset: int, device: torch.device) -> torch.Tensor:
    """32 random bits (int32) for each of ``numel`` elements whose keys are ``offset, offset + 1, ...`` (mod 2**32)."""
    return hash32(torch.arange(numel, dtype=torch.int32, device=device).add_(_signed32(offset)))


def noise_bits(numel: int, offset: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The random numbers of ``numel`` elements whose keys are ``offset, offset + 1, ...`` (mod 2**32): for BF16, 16
    random bits per element (int32 in [0, 65536)); for FP16, uniform FP32 numbers in [0, 1) with 24 random bits."""
    bits = words(numel, offset, device)
    if dtype == torch.bfloat16:
        return bits.bitwise_right_shift_(16).bitwise_and_(0xFFFF)
    return bits.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF).to(torch.float32).mul_(2.0**-24)


def _signed32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - 2**32 if value >= 2**31 else value

"""The bit-level codecs of the compact Adam moments (:mod:`lit_mpstable.core.weights.optim_state`): BF16 with stochastic
rounding from counter-based random words, and FP8 (E4M3, or an unsigned E4M4 for the second moment) with per-block
scales and COAT's dynamic range expansion."""

from __future__ import annotations

import math

import torch

from lit_mpstable.core.weights.compact_rounding import step_keys, words

BLOCK_SIZE = 64
"""Elements per FP8 block, along the flattened tensor: 8 bytes of ``amax`` and ``k`` per 64 codes, 1.125 bytes per
element (0.281x FP32 for both moments). Half COAT's group of 128: the codes of a block spread over its range
(``amax / amin``), and a smaller block spans less of it. On the CPU GPT (the same gradients fed to FP32 and FP8
moments, 150 steps, 2 seeds) the update's relative error per step falls from 4.2% (128) to 3.7% (64); 32 would
give 3.2% at 1.25 bytes per element, over the 0.3x budget. A slice stepped on its own must start on a block
boundary."""

# Bounds of the expansion exponent: k is inf for a block of equal magnitudes (any k stores them exactly) and tends
# to 0 for a block spanning FP32's whole range; beyond these the FP32 arithmetic gains nothing.
_K_MIN, _K_MAX = 2.0**-4, 2.0**20


def _e4m3_table() -> torch.Tensor:
    # The 127 non-negative finite E4M3 values, increasing (uint8 codes 0..126; 127 is NaN).
    return torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _ue4m4_table() -> torch.Tensor:
    c = torch.arange(256, dtype=torch.float64)
    values = torch.exp2(torch.floor(c / 16) - 16) * (1 + torch.remainder(c, 16) / 16)
    values[0] = 0.0
    return values.float()


# (value table, log2 of the range T that a block is expanded onto): signed moments use E4M3, non-negative ones E4M4.
_TABLES = {True: (_e4m3_table(), math.log2(448.0 / 2.0**-6)), False: (_ue4m4_table(), math.log2(0.96875 / 2.0**-15))}
_YMAX = {signed: float(table[-1]) for signed, (table, _) in _TABLES.items()}  # host floats: reading them is no sync
_ON_DEVICE: dict[tuple[bool, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _table(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, log2(values / ymax)) of the codes on ``device``: one copy per device, made once (a copy per step
    would queue a host-to-device transfer each time)."""
    tables = _ON_DEVICE.get((signed, device))
    if tables is None:
        values = _TABLES[signed][0]
        tables = _ON_DEVICE[signed, device] = (values.to(device), torch.log2(values / _YMAX[signed]).to(device))
    return tables


# ------------------------------------------------------------------------------------------------ random bits
def random_words(numel: int, offset: int, seed: int, step: int, key: int, device: torch.device) -> torch.Tensor:
    """32 random bits (int32) for elements ``offset .. offset + numel - 1``: ``hash32(index + key(seed, step, key))``.
    Different keys give shifted copies of one stream, at random 32-bit distances (as CompactWeights' rounding)."""
    return words(numel, step_keys(seed, step, [key])[0] + offset, device)


# ------------------------------------------------------------------------------------------------ BF16
def to_bf16(x: torch.Tensor, words: torch.Tensor | None) -> torch.Tensor:
    if words is None:
        return x.to(torch.bfloat16)
    # BF16 is FP32's upper half: adding 16 random bits to the lower half carries into the upper one with probability
    # (lower half) / 2**16, then truncation drops it: rounding away from zero with exactly that probability.
    bits = x.contiguous().view(torch.int32) + ((words >> 16) & 0xFFFF)
    rounded = (bits & -65536).view(torch.float32)
    return torch.where(torch.isnan(x), x, rounded).to(torch.bfloat16)  # exact: the low half is zero


# ------------------------------------------------------------------------------------------------ FP8 + expansion
def _expanded_inverse(log_mag: torch.Tensor, amax: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``amax * (mag / ymax) ** (1 / k)`` (blocks in rows) from ``log_mag = log2(mag / ymax)``: the value a stored
    magnitude stands for. Encoding calls it on both neighbours, so reading back gives exactly one of the two values
    rounding chose between."""
    return amax[:, None] * torch.exp2(log_mag / k[:, None])


def _floor_code(y: torch.Tensor, signed: bool, table: torch.Tensor) -> torch.Tensor:
    """The largest code whose value is <= ``y`` (FP32, in [0, ymax]), as int64: ``searchsorted`` on the value
    table computed directly (searchsorted is ~50x slower on the CPU)."""
    if signed:
        # E4M3's nearest value, one code down where it is above y (non-negative codes are ordered like values).
        code = y.to(torch.float8_e4m3fn).view(torch.uint8).long()
        return code - (table[code] > y).long()
    # Unsigned E4M4 from y's FP32 bits: code = 16 (exponent + 16) + the top 4 mantissa bits, truncated (a floor);
    # below 2**-16 (and for y = 0) it is 0, the code of 0.
    bits = y.view(torch.int32)
    code = (((bits >> 23) - (127 - 16)) << 4) + ((bits >> 19) & 15)
    return code.clamp_(0, table.numel() - 1).long()


def encode_fp8(
    x: torch.Tensor, signed: bool, uniform: torch.Tensor | None, *, block_size: int = BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    (table, log_table), log2_range = _table(signed, x.device), _TABLES[signed][1]
    top, ymax = table.numel() - 1, _YMAX[signed]
    n = x.numel()
    blocks = -(-n // block_size)
    padded = torch.zeros(blocks * block_size, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1)
    rows = padded.view(blocks, block_size)
    a = rows.abs()
    finite = torch.isfinite(rows).all(dim=1)
    amax = a.amax(dim=1)
    amin = torch.where(a > 0, a, torch.inf).amin(dim=1)
    nonzero = amax > 0
    # Logs, not amax / amin: the ratio overflows FP32 for a block holding both 1e30 and 1e-10.
    k = (log2_range / (torch.log2(amax) - torch.log2(amin))).clamp(_K_MIN, _K_MAX)
    k = torch.where(nonzero & finite, k, torch.ones_like(k))
    amax_safe = torch.where(nonzero & finite, amax, torch.ones_like(amax))
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    y = ymax * torch.exp2(k[:, None] * torch.log2(a / amax_safe[:, None]))
    low = _floor_code(y, signed, table)
    high = (low + 1).clamp_(max=top)
    x_low = _expanded_inverse(log_table[low], amax_safe, k)
    x_high = _expanded_inverse(log_table[high], amax_safe, k)
    gap = x_high - x_low
    p = torch.where(gap > 0, (a - x_low) / gap, torch.zeros_like(gap)).clamp_(0, 1)
    if uniform is None:
        up = p > 0.5
    else:
        up = uniform.view(blocks, block_size) < p
    codes = (low + up.to(low.dtype)).to(torch.uint8)
    if signed:
        codes = codes | (torch.signbit(rows).to(torch.uint8) << 7)
    codes = codes.view(-1)[:n].view(x.shape)
    if signed:
        codes = codes.view(torch.float8_e4m3fn)
    amax = torch.where(finite, amax, torch.full_like(amax, torch.nan))
    return codes, amax, k


def decode_fp8(
    codes: torch.Tensor, amax: torch.Tensor, k: torch.Tensor, *, block_size: int = BLOCK_SIZE
) -> torch.Tensor:
    signed = codes.dtype == torch.float8_e4m3fn
    _, log_table = _table(signed, codes.device)
    flat = codes.reshape(-1).view(torch.uint8).long()
    n = flat.numel()
    blocks = amax.numel()
    padded = torch.zeros(blocks * block_size, dtype=torch.long, device=codes.device)
    padded[:n] = flat
    rows = padded.view(blocks, block_size)
    log_mag = log_table[rows & 127] if signed else log_table[rows]
    # amax == 0 (a zero block) must read 0, not 0 * inf: ones stand in for it, and the magnitudes are 0 there.
    values = _expanded_inverse(log_mag, torch.where(amax > 0, amax, torch.ones_like(amax)), k)
    values = torch.where((amax > 0)[:, None], values, amax[:, None].expand_as(values))  # 0, or NaN for a bad block
    if signed:
        values = torch.where(rows >= 128, -values, values)
    return values.reshape(-1)[:n].view(codes.shape)


# ------------------------------------------------------------------------------------------------ functional API

"""Compact storage for Adam/AdamW moments (FP32, BF16 with stochastic rounding, FP8 with dynamic range expansion)
and the AdamW step that reads and writes it.

A weight keeper holds, per parameter, two :class:`MomentStore` objects (:func:`adam_moments`) instead of
``optimizer.state[p]["exp_avg"/"exp_avg_sq"]`` and calls :func:`adamw_step_` on the FP32 value of the parameter (an
FP32 master, or the FP32 copy of a slice of a compact weight): the moments are read into FP32 temporaries, torch's
AdamW arithmetic runs on them, and they are written back rounded.

Formats (bytes per element of one moment):

- ``"fp32"`` (4): the moment itself; the step is ``torch.optim.AdamW``'s, bit for bit (same operations, same order).
- ``"bf16"`` (2): stochastically rounded (rounding to nearest loses the EMA's small updates). The rounding is
  unbiased, ``E[round(x)] == x``.
- ``"fp8"`` (1 + 8/64): 8-bit codes in blocks of :data:`BLOCK_SIZE` consecutive elements of the flattened tensor,
  each block with an FP32 ``amax`` and an FP32 exponent ``k``: COAT's dynamic range expansion (Xi et al., ICLR 2025;
  why: ``docs/memory.md``). A block's nonzero magnitudes span ``[amin, amax]``; the magnitude is stored as
  ``y = ymax * (|x| / amax) ** k`` with ``k = log(T) / log(amax / amin)``, which maps the block's range exactly onto
  the format's range ``T``, and read back with the inverse power. The first moment uses E4M3 codes
  (``torch.float8_e4m3fn``; ``T = 448 / 2**-6``, its normal range). The second is non-negative, so its sign bit
  becomes a fourth mantissa bit: an unsigned E4M4 (``uint8``; code 0 is zero, code ``c >= 1`` is
  ``2**((c >> 4) - 16) * (1 + (c & 15) / 16)``, ``T = 0.96875 / 2**-15``), half E4M3's rounding error. Exact zeros
  stay zero and do not count in ``amin``.

Rounding (``"bf16"``, ``"fp8"``): ``"stochastic"`` (default) picks one of the value's two stored neighbours, the upper
one with probability proportional to the distance, measured in the value's own domain (after the inverse power for
FP8), so the stored moment is unbiased; ``"nearest"`` picks the nearer one. The random bits are a hash of
``(seed, step, key, element index)``: the same for a parameter stepped whole or in slices, and on any device (integer
arithmetic; FP8's pow/log2 may still differ by an ulp between devices), and nothing but ``seed`` and ``key`` (kept in
the state dict) is needed to resume bit-exactly. No function here reads a device tensor on the host.

Non-finite values: BF16 keeps NaN and inf as they are. In FP8 a NaN or inf makes its whole block read back as NaN
(blocks are independent), so a bad step cannot hide in a rounded code; steps with non-finite gradients are the
stepper's to skip before this runs.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal, get_args

import torch

from lit_mpstable.base.validate import check_keys, int_arg
from lit_mpstable.core.loaded_state import check_mapping, count, count_list, flag, short, text
from lit_mpstable.core.weights.compact_rounding import step_keys, words

if TYPE_CHECKING:
    from torch.optim.optimizer import StateDict

StateKind = Literal["fp32", "bf16", "fp8"]
Rounding = Literal["stochastic", "nearest"]
_KINDS: tuple[str, ...] = get_args(StateKind)
_ROUNDINGS: tuple[str, ...] = get_args(Rounding)


# ------------------------------------------------------------------------------------------------ the codecs
# The bit level: BF16 with stochastic rounding from counter-based random words, and FP8 (E4M3, or an unsigned E4M4
# for the second moment) with per-block scales and COAT's dynamic range expansion.
BLOCK_SIZE = 64
"""Elements per FP8 block, along the flattened tensor: 8 bytes of ``amax`` and ``k`` per 64 codes, 1.125 bytes per
element (0.281x FP32 for both moments; half COAT's 128, measured in ``docs/memory.md``). A slice stepped on its own
must start on a block boundary."""

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


def state_bytes(numel: int, kind: StateKind) -> int:
    """Bytes one moment of ``numel`` elements takes in ``kind`` (FP8: codes plus 8 bytes per started block)."""
    _check_kind(kind, "state_bytes")
    if kind == "fp32":
        return 4 * numel
    if kind == "bf16":
        return 2 * numel
    return numel + 8 * (-(-numel // BLOCK_SIZE))


def quantize_moment(
    x: torch.Tensor, kind: StateKind, *, signed: bool = True, rounding: Rounding = "stochastic", seed: int = 0,
    step: int = 0, key: int = 0, offset: int = 0,
) -> dict[str, torch.Tensor]:
    """``x`` (any float dtype; read as FP32) stored in ``kind``, as a dict of plain tensors.

    Keys: ``"value"`` (FP32 or BF16, ``x``'s shape) or, for FP8, ``"codes"`` (``x``'s shape; ``float8_e4m3fn`` when
    ``signed``, else ``uint8`` E4M4), ``"amax"`` and ``"k"`` (FP32, one per block of :data:`BLOCK_SIZE`).

    Args:
        signed: False for a non-negative moment (``exp_avg_sq``): FP8 then spends the sign bit on precision
            (negative values are stored as their magnitude).
        seed, step, key, offset: the random bits of element ``i`` are a hash of ``(seed, step, key, offset + i)``.

    Raises:
        ValueError: ``kind`` or ``rounding`` is unknown.
    """
    _check_kind(kind, "quantize_moment")
    _check_rounding(rounding, "quantize_moment")
    x = x.detach().float()
    if kind == "fp32":
        return {"value": x.clone()}
    stochastic = rounding == "stochastic"
    words = random_words(x.numel(), offset, seed, step, key, x.device).view(x.shape) if stochastic else None
    if kind == "bf16":
        return {"value": to_bf16(x, words)}
    uniform = None
    if words is not None:
        blocks = -(-x.numel() // BLOCK_SIZE)
        uniform = torch.ones(blocks * BLOCK_SIZE, dtype=torch.float32, device=x.device)  # padding never rounds up
        uniform[: x.numel()] = ((words.reshape(-1) >> 8) & 0xFFFFFF).float() * 2.0**-24
    codes, amax, k = encode_fp8(x, signed, uniform)
    return {"codes": codes, "amax": amax, "k": k}


def dequantize_moment(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The FP32 moment that :func:`quantize_moment` (or :meth:`MomentStore.state_dict`) stored; a new tensor."""
    if "codes" in state:
        return decode_fp8(state["codes"], state["amax"], state["k"])
    if "value" in state:
        return state["value"].float().clone()
    raise ValueError(
        f"dequantize_moment(state with keys {sorted(state)!r}): expected 'value' (fp32, bf16) or 'codes', 'amax' and"
        " 'k' (fp8), as quantize_moment returns them."
    )


# ------------------------------------------------------------------------------------------------ stores
class MomentStore:
    """One moment of one parameter (``numel`` elements, flattened), kept in ``kind``, read and written in slices.

    :meth:`read` gives FP32 (for ``"fp32"``: the stored tensor itself, so an in-place update is the write);
    :meth:`write_` rounds FP32 values back. A slice of an FP8 store starts on a multiple of :data:`BLOCK_SIZE`
    and ends on one or at the end (a block's ``amax`` and ``k`` are shared by its elements).

    Args:
        signed: False for ``exp_avg_sq`` (non-negative; see :func:`quantize_moment`).
        seed, key: with the step and the element index, they choose the random bits of stochastic rounding; give
            every moment of every parameter its own ``key`` (:func:`adam_moments` does).

    Raises:
        ValueError: ``kind`` or ``rounding`` is unknown, or ``shape`` is not a sequence of non-negative ints.
    """

    def __init__(
        self, kind: StateKind, shape: Sequence[int] | torch.Size, device: torch.device | str | None = None, *,
        signed: bool = True, rounding: Rounding = "stochastic", seed: int = 0, key: int = 0,
    ) -> None:
        _check_kind(kind, "MomentStore")
        _check_rounding(rounding, "MomentStore")
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise ValueError(f"MomentStore(shape={shape!r}): shape must be a sequence of ints >= 0 (the parameter's).")
        self.kind, self.shape, self.signed, self.rounding = kind, torch.Size(shape), bool(signed), rounding
        self.seed, self.key = int(seed), int(key)
        self.numel = self.shape.numel()
        self.tensors = quantize_moment(torch.zeros(self.numel, device=device), kind, signed=self.signed,
                                       rounding="nearest")

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tensors (equals :func:`state_bytes`)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def _range(self, start: int, stop: int | None, caller: str) -> tuple[int, int]:
        stop = self.numel if stop is None else stop
        if not 0 <= start <= stop <= self.numel:
            raise ValueError(f"MomentStore.{caller}(start={start!r}, stop={stop!r}): need 0 <= start <= stop <="
                             f" {self.numel} (the moment's elements).")
        if self.kind == "fp8" and (start % BLOCK_SIZE or (stop % BLOCK_SIZE and stop != self.numel)):
            raise ValueError(
                f"MomentStore.{caller}(start={start!r}, stop={stop!r}): an FP8 moment is read and written in whole"
                f" blocks of {BLOCK_SIZE} elements; slice the parameter on multiples of {BLOCK_SIZE}."
            )
        return start, stop

    def read(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Elements ``[start, stop)`` as a flat FP32 tensor (``"fp32"``: a view of the store; else a new tensor)."""
        start, stop = self._range(start, stop, "read")
        if self.kind == "fp32":
            return self.tensors["value"].view(-1)[start:stop]
        if self.kind == "bf16":
            return self.tensors["value"].view(-1)[start:stop].float()
        b0, b1 = start // BLOCK_SIZE, -(-stop // BLOCK_SIZE)
        codes = self.tensors["codes"].view(-1)[start:stop]
        return decode_fp8(codes, self.tensors["amax"][b0:b1], self.tensors["k"][b0:b1])

    @torch.no_grad()
    def write_(self, value: torch.Tensor, *, step: int, start: int = 0) -> None:
        """Store ``value`` (flat or any shape, FP32) as elements ``[start, start + value.numel())``, rounded with the
        random bits of ``step``; for ``"fp32"`` a copy (nothing when ``value`` is what :meth:`read` returned)."""
        start, stop = self._range(start, start + value.numel(), "write_")
        if self.kind == "fp32":
            dst = self.tensors["value"].view(-1)[start:stop]
            if dst.data_ptr() != value.data_ptr():
                dst.copy_(value.reshape(-1))
            return
        new = quantize_moment(value.reshape(-1), self.kind, signed=self.signed, rounding=self.rounding,
                              seed=self.seed, step=step, key=self.key, offset=start)
        if self.kind == "bf16":
            self.tensors["value"].view(-1)[start:stop].copy_(new["value"])
            return
        b0, b1 = start // BLOCK_SIZE, -(-stop // BLOCK_SIZE)
        self.tensors["codes"].view(-1)[start:stop].copy_(new["codes"])
        self.tensors["amax"][b0:b1].copy_(new["amax"])
        self.tensors["k"][b0:b1].copy_(new["k"])

    def state_dict(self) -> dict[str, object]:
        """``kind``, ``shape`` (list), ``signed``, ``rounding``, ``seed``, ``key`` and ``tensors`` (the stored
        tensors, shared with the store, not copied: clone them for an in-memory snapshot); plain values only."""
        return {"kind": self.kind, "shape": list(self.shape), "signed": self.signed, "rounding": self.rounding,
                "seed": self.seed, "key": self.key, "tensors": dict(self.tensors)}

    @torch.no_grad()
    def load_state_dict(self, state: StateDict) -> None:
        """Restore :meth:`state_dict` (copied into this store's tensors, on its device).

        Raises:
            KeyError: a key is missing or unknown.
            ValueError: the kind, shape or sign differs from this store's.
        """
        if set(state) != _STORE_KEYS:
            raise KeyError(f"MomentStore.load_state_dict: keys {sorted(state)!r}, expected {sorted(_STORE_KEYS)!r};"
                           " was it saved by MomentStore.state_dict?")
        for name, mine in (("kind", self.kind), ("shape", list(self.shape)), ("signed", self.signed)):
            if state[name] != mine:
                raise ValueError(f"MomentStore.load_state_dict: saved with {name}={state[name]!r}, this store has"
                                 f" {name}={mine!r}; build the store as it was saved.")
        if set(state["tensors"]) != set(self.tensors):
            raise KeyError(f"MomentStore.load_state_dict: tensors {sorted(state['tensors'])!r}, expected"
                           f" {sorted(self.tensors)!r}.")
        # Every field, before anything is changed: a NaN, a negative second moment or a NaN code is refused by name.
        _refuse_deferred("MomentStore.load_state_dict",
                         _store_checks("MomentStore.load_state_dict", "state", state, self.kind, self.signed))
        self.rounding, self.seed, self.key = state["rounding"], int(state["seed"]), int(state["key"])
        block = _saved_block(self, state["tensors"])
        if block is not None:  # FP8 moments of an earlier block size: read in theirs, stored again in this one
            saved = state["tensors"]
            values = decode_fp8(saved["codes"].reshape(-1), saved["amax"].reshape(-1), saved["k"].reshape(-1),
                                block_size=block)
            self.write_(values.to(self.tensors["amax"].device), step=0)
            warnings.warn(f"MomentStore.load_state_dict: FP8 moments saved in blocks of {block} elements were stored"
                          f" again in this version's blocks of {BLOCK_SIZE} (one more rounding of each value, not an"
                          " exact resume).", stacklevel=2)
            return
        for name, dst in self.tensors.items():  # all checked before any is copied
            saved = state["tensors"][name]
            if not isinstance(saved, torch.Tensor) or tuple(saved.shape) != tuple(dst.shape):
                shape = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
                raise ValueError(f"MomentStore.load_state_dict: tensors[{name!r}] has shape {shape}, this store's"
                                 f" has {tuple(dst.shape)}.")
        for name, dst in self.tensors.items():
            dst.copy_(state["tensors"][name])


def adam_moments(
    kind: StateKind, shape: Sequence[int] | torch.Size, device: torch.device | str | None = None, *, seed: int = 0,
    index: int = 0, rounding: Rounding | None = None,
) -> tuple[MomentStore, MomentStore]:
    """``(exp_avg, exp_avg_sq)`` stores for the parameter at position ``index`` (keys ``2 index`` and ``2 index + 1``,
    so no two moments share random bits); ``exp_avg_sq`` is unsigned.

    ``rounding=None`` chooses per moment: stochastic for both in BF16; in FP8 nearest for ``exp_avg`` and
    stochastic for ``exp_avg_sq``. An EMA whose per-step weight ``1 - beta`` is below the format's relative spacing
    stalls under rounding to nearest: ``1 - beta2 = 1e-3`` is below both formats', ``1 - beta1 = 0.1`` is not, and
    stochastic rounding's noise on FP8's ``exp_avg`` reaches the update directly (measured: ``docs/memory.md``).
    """
    if rounding is None:
        first_rounding: Rounding = "nearest" if kind == "fp8" else "stochastic"
        second_rounding: Rounding = "stochastic"
    else:
        first_rounding = second_rounding = rounding
    first = MomentStore(kind, shape, device, signed=True, rounding=first_rounding, seed=seed, key=2 * index)
    second = MomentStore(kind, shape, device, signed=False, rounding=second_rounding, seed=seed, key=2 * index + 1)
    return first, second


@torch.no_grad()
def adamw_step_(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: MomentStore, exp_avg_sq: MomentStore, *, step: int,
    lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
    decoupled_weight_decay: bool = True, maximize: bool = False, start: int = 0,
) -> None:
    """One AdamW step of the FP32 tensor ``param`` (elements ``[start, start + param.numel())`` of the moments).

    The arithmetic is ``torch.optim.AdamW``'s single-tensor step (the one it runs on the CPU; its CUDA foreach
    path does the same elementwise operations), including the bias corrections from ``step``, computed as Python
    floats: with ``"fp32"`` moments the result equals ``torch.optim.AdamW`` bit for bit. Other kinds update FP32
    copies of the moments, step the parameter with them, then store them rounded. ``decoupled_weight_decay=False``
    is ``torch.optim.Adam``'s L2 penalty. No host sync.

    Args:
        param: FP32 and contiguous, updated in place: an FP32 master, or a keeper's FP32 copy of a slice.
        grad: the gradient of ``param`` (cast to FP32 if it is not).
        step: the step number after this step's increment (1 on the first step), as ``state["step"]`` in torch.

    Raises:
        ValueError: ``param`` is not FP32 and contiguous, shapes differ, or ``step`` < 1.
    """
    if param.dtype != torch.float32 or not param.is_contiguous():
        raise ValueError(f"adamw_step_(param of dtype {param.dtype}, contiguous={param.is_contiguous()}): param must be"
                         " a contiguous FP32 tensor (a master, or a keeper's FP32 copy of a slice).")
    if grad.numel() != param.numel():
        raise ValueError(f"adamw_step_(grad of {grad.numel()} elements): param has {param.numel()}.")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"adamw_step_(step={step!r}): step must be an int >= 1 (the count after this step).")
    beta1, beta2 = betas
    p = param.view(-1)
    g = grad.reshape(-1).float()
    if maximize:
        g = -g
    if weight_decay != 0:
        if decoupled_weight_decay:
            p.mul_(1 - lr * weight_decay)
        else:
            g = g.add(p, alpha=weight_decay)
    stop = start + p.numel()
    m, v = exp_avg.read(start, stop), exp_avg_sq.read(start, stop)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-step_size)
    exp_avg.write_(m, step=step, start=start)
    exp_avg_sq.write_(v, step=step, start=start)


def _check_kind(kind: object, caller: str) -> None:
    if kind not in _KINDS:
        raise ValueError(f"{caller}(kind={kind!r}): kind must be one of {list(_KINDS)} (where Adam's moments live).")


def _check_rounding(rounding: object, caller: str) -> None:
    if rounding not in _ROUNDINGS:
        raise ValueError(f"{caller}(rounding={rounding!r}): rounding must be one of {list(_ROUNDINGS)}; 'stochastic'"
                         " keeps the moments' small EMA updates (unbiased).")


def _saved_block(store: MomentStore, saved: Mapping[str, object]) -> int | None:
    """The block size of an FP8 moment saved in blocks other than :data:`BLOCK_SIZE` (codes of the store's shape,
    ``amax`` and ``k`` of another length: a power of two from 16 to 1024 that gives it), else None."""
    amax, codes = saved.get("amax"), saved.get("codes")
    if store.kind != "fp8" or not isinstance(amax, torch.Tensor) or not isinstance(codes, torch.Tensor):
        return None
    if amax.numel() == store.tensors["amax"].numel() or codes.numel() != store.numel:
        return None
    blocks = [2**e for e in range(4, 11) if -(-store.numel // 2**e) == amax.numel()]
    k = saved.get("k")
    return blocks[0] if blocks and isinstance(k, torch.Tensor) and k.numel() == amax.numel() else None


# ------------------------------------------------------------------------------------------------ Adam moments
# What ``MomentStore.state_dict`` and ``AdamMoments.state_dict`` (``optimizer_state="bf16"``/``"fp8"``) save. A bad
# moment is no smaller a fault than a bad master: a NaN or negative second moment makes every later update NaN.
_STORE_KEYS = {"kind", "shape", "signed", "rounding", "seed", "key", "tensors"}
_STORE_TENSORS = {"fp32": {"value"}, "bf16": {"value"}, "fp8": {"codes", "amax", "k"}}
_VALUE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# FP8 moments of an earlier version were kept in blocks of another power of two (MomentStore re-encodes them).
_BLOCK_SIZES = (BLOCK_SIZE, *(2**e for e in range(4, 11) if 2**e != BLOCK_SIZE))
_Deferred = list[tuple[str, torch.Tensor, str]]  # (field, a 0-dim bool tensor that is True when bad, the rule)


def _seed(call: str, name: str, value: object) -> None:
    int_arg(call, name, value, low=0, high=2**63 - 1)


def _tensor(call: str, name: str, value: object, dtype: torch.dtype, numel: int | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != dtype:
        got = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else short(value)
        raise TypeError(f"{call}({name}={got}): must be a {dtype} tensor, as MomentStore.state_dict() saves it.")
    if numel is not None and value.numel() != numel:
        raise ValueError(f"{call}({name} of {value.numel()} elements): the moment has {numel}.")
    return value


def _store_checks(call: str, name: str, value: object, kind: str, signed: bool) -> _Deferred:
    """The checks of one stored moment that need no tensor read, then those that do (returned, to be read at once)."""
    value = check_mapping(call, value, _STORE_KEYS, name=name)
    text(kind)(call, f"{name}['kind']", value["kind"])
    count_list(call, f"{name}['shape']", value["shape"])
    flag(call, f"{name}['signed']", value["signed"])
    if value["signed"] != signed:
        raise ValueError(f"{call}({name}['signed']={value['signed']!r}): must be {signed}: exp_avg is stored signed,"
                         " exp_avg_sq (non-negative) unsigned.")
    text("stochastic", "nearest")(call, f"{name}['rounding']", value["rounding"])
    _seed(call, f"{name}['seed']", value["seed"])
    _seed(call, f"{name}['key']", value["key"])
    tensors = check_mapping(call, value["tensors"], _STORE_TENSORS[kind], name=f"{name}['tensors']")
    numel = math.prod(value["shape"])
    where = f"{name}['tensors']"
    if kind != "fp8":
        stored = _tensor(call, f"{where}['value']", tensors["value"], _VALUE_DTYPES[kind])
        if stored.numel() != numel:
            raise ValueError(f"{call}({name}['shape']={value['shape']!r}): {numel} elements, but tensors['value']"
                             f" holds {stored.numel()}.")
        checks = [(f"{where}['value']", ~stored.isfinite().all(), "holds inf/NaN")]
        if not signed:
            checks.append((f"{where}['value']", (stored < 0).any(), "holds negative values; exp_avg_sq is a mean of"
                           " squares (>= 0), and its square root would make every update NaN"))
        return checks
    codes = _tensor(call, f"{where}['codes']", tensors["codes"], torch.float8_e4m3fn if signed else torch.uint8)
    if codes.numel() != numel:
        raise ValueError(f"{call}({name}['shape']={value['shape']!r}): {numel} elements, but tensors['codes'] holds"
                         f" {codes.numel()}.")
    amax = _tensor(call, f"{where}['amax']", tensors["amax"], torch.float32)
    blocks = -(-numel // BLOCK_SIZE)
    if amax.dim() != 1 or amax.numel() not in {-(-numel // size) for size in _BLOCK_SIZES}:
        raise ValueError(f"{call}({name}: tensors['amax'] has shape {tuple(amax.shape)}, this store's has"
                         f" ({blocks},)): one value per block of {BLOCK_SIZE} elements (or of an earlier version's"
                         " block size).")
    _tensor(call, f"{where}['k']", tensors["k"], torch.float32, amax.numel())
    k = tensors["k"]
    checks = [(f"{where}['amax']", ~(amax.isfinite() & (amax >= 0)).all(), "holds inf/NaN or negative values; must"
               " be finite and >= 0 (each block's largest magnitude)"),
              (f"{where}['k']", ~(k.isfinite() & (k > 0)).all(), "holds inf/NaN or values <= 0; must be finite and > 0"
               " (each block's range-expansion exponent)")]
    if signed:  # E4M3's codes 0x7f and 0xff are NaN; E4M4 (uint8) has none
        checks.append((f"{where}['codes']", ((codes.view(torch.uint8) & 127) == 127).any(), "holds NaN codes"
                       " (0x7f/0xff)"))
    return checks


def _refuse_deferred(call: str, checks: _Deferred) -> None:
    """Raise for the first failed check of ``checks``, reading all of them in one transfer."""
    if not checks:
        return
    by_device: dict[torch.device, list[int]] = {}
    for index, (_, bad, _) in enumerate(checks):
        by_device.setdefault(bad.device, []).append(index)
    failed = torch.zeros(len(checks), dtype=torch.bool)
    for indices in by_device.values():  # one transfer per device
        failed[indices] = torch.stack([checks[index][1].detach() for index in indices]).cpu()
    if bool(failed.any()):
        name, _, rule = checks[int(failed.nonzero()[0])]
        raise ValueError(f"{call}({name}): {rule}; the checkpoint is corrupted (or was saved after the run"
                         " diverged): resume from an earlier one.")


def moment_state(call: str, name: str, value: object) -> None:
    """``AdamMoments.state_dict()``: ``kind``, ``seed``, ``steps`` and ``moments`` by parameter name (the names are the
    keeper's to check against its parameters). One host read for all the tensors."""
    value = check_mapping(call, value, {"kind", "seed", "steps", "moments"}, name=name)
    text("bf16", "fp8")(call, f"{name}['kind']", value["kind"])
    kind = value["kind"]
    _seed(call, f"{name}['seed']", value["seed"])
    steps = check_mapping(call, value["steps"], name=f"{name}['steps']")
    for key, step in steps.items():
        count(call, f"{name}['steps'][{key!r}]", step)
    moments = check_mapping(call, value["moments"], name=f"{name}['moments']")
    check_keys(call, moments, steps, name=f"{name}['moments']", suffix=f" (the parameters of {name}['steps']).")
    checks: _Deferred = []
    for key, pair in moments.items():
        where = f"{name}['moments'][{key!r}]"
        if not isinstance(key, str) or not key:
            raise TypeError(f"{call}({where}): must be keyed by a parameter name.")
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise TypeError(f"{call}({where}={short(pair)}): must be [exp_avg, exp_avg_sq], two stored moments.")
        checks += _store_checks(call, f"{where}[0]", pair[0], kind, True)
        checks += _store_checks(call, f"{where}[1]", pair[1], kind, False)
        if pair[0]["shape"] != pair[1]["shape"]:
            raise ValueError(f"{call}({where}[1]['shape']={pair[1]['shape']!r}): exp_avg has shape"
                             f" {pair[0]['shape']!r}; both moments have their parameter's shape.")
    _refuse_deferred(call, checks)

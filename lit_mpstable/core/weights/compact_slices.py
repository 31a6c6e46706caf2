"""How compact weights step an optimizer in pieces: parameters (or slices of them) grouped into calls of bounded FP32
copies, the optimizer-state layouts that may be sliced, and the helpers that keep that state 16-bit."""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lit_mpstable.core.weights.memory import plain_tensors

LOW = (torch.float16, torch.bfloat16)
# Random numbers are a hash of (seed, step, parameter, element index): an element gets the same ones however the step
# is sliced, on any device, eagerly or in the fused kernel. Slices are at least this many elements.
MIN_SLICE = 2**12
# Updates that are elementwise given per-parameter scalars (step, NAdam's mu_product, ASGD's eta): a parameter can be
# stepped in slices, bit for bit. Exact types only: a subclass may add a per-tensor norm (LAMB, LARS).
ELEMENTWISE = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Rprop", "ASGD"))
# torchao's low-bit Adams (exact types): elementwise too, with states quantized in blocks of ``block_size`` elements
# that a slice on block boundaries views in place (their subclasses implement view(-1) and slice for resharding).
TORCHAO_BLOCKWISE = ("Adam8bit", "AdamW8bit", "Adam4bit", "AdamW4bit", "AdamFp8", "AdamWFp8")
# bitsandbytes' 8-bit Adams: codes ``state1``/``state2`` (uint8, the parameter's shape) and one ``absmax`` per block of
# 256 elements, updated in place by its blockwise kernel.
BNB_BLOCKWISE = ("Adam8bit", "AdamW8bit")
BNB_BLOCK = 256


@dataclass
class Piece:
    """Part of one parameter's step: elements [start, stop) of a compact parameter, or a whole parameter that is
    stepped as it is (``name`` None: FP32 islands, frozen or unnamed parameters); ``fused``: a whole parameter the
    fused kernel takes; ``per_element``: set on a whole parameter that :func:`chunks` may slice."""

    group: int
    param: nn.Parameter
    name: str | None
    start: int
    stop: int
    nbytes: int
    fused: bool = False
    per_element: int = 0  # bytes of FP32 copies per element of a parameter that may be sliced (0: never)

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.param.numel()

    def view(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.whole else t.view(-1)[self.start : self.stop]


class StandIns:
    """The FP32 stand-ins of :class:`~lit_mpstable.core.weights.compact.CompactWeights` (a mixin): a piece of a
    parameter entered as an FP32 tensor with its gradient and state, and left by rounding the stepped values back."""

    mode: str
    _comp: dict[str, torch.Tensor]
    _before: dict[int, dict[Any, Any]]

    def _round_(self, dst: torch.Tensor, src: torch.Tensor, piece: Piece, noise: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def _enter(
        self, optimizer: Optimizer, piece: Piece, multiplier: torch.Tensor | float | None, clip: float | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tensor the optimizer steps for ``piece`` (an FP32 stand-in, or the parameter itself), with its FP32
        gradient and state in place; returns it and the parameter's original gradient when that was replaced."""
        p = piece.param
        if piece.name is None:
            if multiplier is None and clip is None:
                return p, None
            original = p.grad
            assert original is not None  # pieces are made for parameters with a gradient
            p.grad = transform(original.to(torch.float32, copy=True), multiplier, clip).to(original.dtype)
            return p, original
        value = piece.view(p.detach()).to(torch.float32, copy=True)
        if self.mode == "kahan":
            value.add_(piece.view(self._comp[piece.name]))
        proxy = nn.Parameter(value)
        assert p.grad is not None
        proxy.grad = transform(piece.view(p.grad).to(torch.float32, copy=True), multiplier, clip)
        # Every slice of a parameter starts from its state before this step, though earlier slices are written back.
        state = self._before.setdefault(id(p), dict(optimizer.state.get(p, {})))
        if state:
            non_castable = getattr(optimizer, "non_castable_tensor_keys", ())
            optimizer.state[proxy] = {
                key: piece.view(v).to(torch.float32, copy=True) if per_element(key, v, p, non_castable)
                else v if piece.whole or not isinstance(v, torch.Tensor)
                else piece.view(v) if quantized(v, p) or codes(key, v, p)  # its own blocks, stepped in place
                else v[piece.start // BNB_BLOCK : -(-piece.stop // BNB_BLOCK)] if absmax(key, v, p)
                else v.clone()
                for key, v in state.items()
            }
        return proxy, None

    def _leave(self, optimizer: Optimizer, piece: Piece, proxy: torch.Tensor) -> None:
        """Round the stepped FP32 stand-in back into the 16-bit parameter, compensation and state."""
        p = piece.param
        if piece.name is None:
            if piece.stop == p.numel():
                p.grad = None
            return
        proxy.grad = None  # frees the FP32 gradient before the rounding temporaries
        new_state = optimizer.state.pop(proxy, {})
        value, weight = proxy.detach(), piece.view(p.detach())
        noise: list[torch.Tensor] = []  # drawn once, when first needed
        if self.mode == "kahan":
            weight.copy_(value)  # round to nearest
            comp = piece.view(self._comp[piece.name])
            comp.copy_(value.sub_(weight))  # the residual is exact in FP32; its rounding is what is lost
        else:
            self._round_(weight, value, piece, noise)
        if new_state:
            non_castable = getattr(optimizer, "non_castable_tensor_keys", ())
            state = optimizer.state[p]
            for key, v in new_state.items():
                if per_element(key, v, proxy, non_castable):
                    dst = state.get(key)
                    if type(dst) is not torch.Tensor or dst.dtype != p.dtype or dst.shape != p.shape:
                        dst = state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    self._round_(piece.view(dst), v, piece, noise)
                elif piece.start == 0 and (piece.whole or not isinstance(v, torch.Tensor) or v.dim() == 0):
                    state[key] = v  # per-parameter scalars: every slice computes the same ones
        if piece.stop == p.numel():
            p.grad = None


def quantized_state_classes() -> list[type]:
    """torchao's quantized optimizer-state classes (8-bit, 4-bit, FP8), for ``torch.serialization.safe_globals``.

    ``torch.load(weights_only=True)`` refuses a checkpoint holding them unless they are allowed; importing
    ``torchao.optim`` allows them process-wide (it calls ``add_safe_globals``), this names them explicitly:
    ``with torch.serialization.safe_globals(quantized_state_classes()): torch.load(path, weights_only=True)``.
    bitsandbytes keeps plain tensors, which need nothing.
    """
    try:
        from torchao.optim.subclass_4bit import OptimState4bit
        from torchao.optim.subclass_8bit import OptimState8bit
        from torchao.optim.subclass_fp8 import OptimStateFp8
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError("quantized_state_classes() needs torchao: pip install torchao") from error
    return [OptimState8bit, OptimState4bit, OptimStateFp8]


def budget(chunk_bytes: int | None, device: torch.device, optimizer: Optimizer) -> tuple[int, int]:
    """Bytes of FP32 copies per optimizer call: at first, and at most once the step has freed gradients.

    Small chunks on the CPU: their FP32 copies come back from the allocator's cache (larger ones are fresh pages
    every step, slower) and the transient stays small; measured in bench/bench_compact_core.py. The low-bit Adams
    allocate FP32 temporaries about the size of the copies on top, when every gradient is still held (and each
    call costs torchao's ~1 ms, a torch.compile wrapper per parameter): they start at 512 KiB and grow by half the
    gradient bytes freed (copies and temporaries together take their place), to 4 MiB. On an accelerator, fewer
    optimizer calls matter more (a guessed default; no GPU
    measurement yet)."""
    if chunk_bytes is not None:
        return chunk_bytes, chunk_bytes
    if device.type != "cpu":
        return 256 * 2**20, 256 * 2**20
    return (2**19, 4 * 2**20) if block_size(optimizer) is not None else (4 * 2**20, 4 * 2**20)

def chunks(pieces: list[Piece], base: int, cap: int, freed: int) -> Iterator[list[Piece]]:
    """Group the pieces into optimizer calls of about ``min(base + freed / 2, cap)`` bytes of FP32 copies each,
    ``freed`` being the gradient bytes dropped by the calls before (the given ``freed``: the fused step's), so
    that the step's transient (copies and the optimizer's temporaries) stays near its first call's; sliceable
    parameters that do not fit are cut into slices of a multiple of 4096 elements (a power-of-two multiple when
    the budget grows: few distinct shapes for a compiled optimizer)."""
    chunk: list[Piece] = []
    used = pending = 0  # pending: gradients the current chunk will free

    def limit() -> int:
        return min(base + freed // 2, cap)

    for piece in pieces:
        if piece.per_element and piece.nbytes > limit() - used:
            if chunk:
                yield chunk
                chunk, used, freed, pending = [], 0, freed + pending, 0
            size = max(MIN_SLICE, limit() // piece.per_element // MIN_SLICE * MIN_SLICE)
            if cap > base:
                size = MIN_SLICE << ((size // MIN_SLICE).bit_length() - 1)
            for start in range(0, piece.stop, size):
                if chunk:
                    yield chunk
                stop = min(piece.stop, start + size)
                chunk = [Piece(piece.group, piece.param, piece.name, start, stop, (stop - start) * piece.per_element)]
                used = chunk[0].nbytes
            pending += grad_bytes(piece.param)
            continue
        if chunk and used + piece.nbytes > limit():
            yield chunk
            chunk, used, freed, pending = [], 0, freed + pending, 0
        chunk.append(piece)
        used += piece.nbytes
        pending += grad_bytes(piece.param)
    if chunk:
        yield chunk


def memory_report(model: nn.Module, optimizers: list[Optimizer], compensation: list[torch.Tensor]) -> dict[str, int]:
    """Bytes held by training state, by kind; counts tensors (quantized states by their inner tensors), not
    allocator overhead. Reads no device data.

    Keys: ``params_16bit`` (every FP16/BF16 parameter of the model, frozen ones too), ``compensation``,
    ``grads`` (the model's gradients that exist now), ``optimizer_state`` (every tensor in the optimizers'
    ``state``, ``step`` counters included), ``params_fp32_other`` (trainable parameters of any other dtype),
    ``total`` (their sum).
    """
    params = list(model.parameters())
    state: dict[int, torch.Tensor] = {}
    for optimizer in optimizers:
        for param_state in optimizer.state.values():
            for value in param_state.values():
                state.update((id(t), t) for t in plain_tensors(value))
    report = {
        "params_16bit": nbytes(p for p in params if p.dtype in LOW),
        "compensation": nbytes(compensation),
        "grads": nbytes(p.grad for p in params if p.grad is not None),
        "optimizer_state": nbytes(state.values()),
        "params_fp32_other": nbytes(p for p in params if p.dtype not in LOW and p.requires_grad),
    }
    report["total"] = sum(report.values())
    return report


def cast_state_(optimizer: Optimizer, param: torch.Tensor) -> None:
    """The per-element floating state of ``param`` in ``optimizer`` in the parameter's dtype (after a recast)."""
    state = optimizer.state.get(param)
    if state:
        non_castable = getattr(optimizer, "non_castable_tensor_keys", ())
        for key, value in state.items():
            if per_element(key, value, param, non_castable) and value.dtype != param.dtype:
                state[key] = value.to(param.dtype)


def per_element(key: object, value: object, param: torch.Tensor, non_castable: Container[object]) -> bool:
    # Exactly what torch's Optimizer.load_state_dict casts to the parameter's dtype (floating, not "step"), unless the
    # optimizer opts out (bitsandbytes), and per element: so it is 16-bit between steps and round-trips bit for bit.
    return (
        type(value) is torch.Tensor and value.is_floating_point() and key != "step" and key not in non_castable
        and value.shape == param.shape
    )


def quantized(value: object, param: torch.Tensor) -> bool:
    # A per-element state held by a wrapper subclass (torchao's 8-bit, 4-bit, FP8 states).
    return isinstance(value, torch.Tensor) and type(value) is not torch.Tensor and value.shape == param.shape


def codes(key: object, value: object, param: torch.Tensor) -> bool:
    # bitsandbytes' 8-bit codes of a state: per element, not floating.
    return key in ("state1", "state2") and type(value) is torch.Tensor and value.dtype == torch.uint8 and (
        value.shape == param.shape)


def absmax(key: object, value: object, param: torch.Tensor) -> bool:
    # bitsandbytes' per-block scales of a state.
    return key in ("absmax1", "absmax2") and type(value) is torch.Tensor and value.shape == (
        -(-param.numel() // BNB_BLOCK),)


def block_size(optimizer: Optimizer) -> int | None:
    """The quantization block of a torchao low-bit Adam or a bitsandbytes 8-bit Adam (exact types; bitsandbytes:
    8-bit, no update-norm clipping, not paged), else None."""
    cls = type(optimizer)
    if cls.__module__.startswith("bitsandbytes.optim") and cls.__name__ in BNB_BLOCKWISE:
        args = getattr(optimizer, "args", None)
        ok = (getattr(args, "optim_bits", None) == 8 and getattr(args, "max_unorm", None) == 0
              and not getattr(optimizer, "is_paged", True) and callable(getattr(optimizer, "init_state", None)))
        return BNB_BLOCK if ok else None
    if not cls.__module__.startswith("torchao.optim") or cls.__name__ not in TORCHAO_BLOCKWISE:
        return None
    block = getattr(optimizer, "block_size", None)
    new_buffer = getattr(optimizer, "_new_buffer", None)
    if not isinstance(block, int) or isinstance(block, bool) or block <= 0 or not callable(new_buffer):
        return None
    return block if MIN_SLICE % block == 0 else None


def init_blockwise_(
    optimizer: Optimizer, p: torch.Tensor, state: dict[Any, Any], block: int, group_index: int, index: int
) -> bool:
    """Whether ``p`` (``optimizer.param_groups[group_index]["params"][index]``) has quantized states that can be
    stepped in slices; on its first step, creates them whole first (as the optimizer's own ``step`` would on the FP32
    stand-in; a slice would get a state of its own shape)."""
    group = optimizer.param_groups[group_index]
    if block == BNB_BLOCK and type(optimizer).__module__.startswith("bitsandbytes"):
        return init_bnb_(optimizer, p, state, group, group_index, index)
    if p.numel() % block or group["amsgrad"]:
        return False  # whole: torchao keeps such states unquantized; its amsgrad fails on FP32 stand-ins anyway
    if not state:
        # The optimizer's own constructor of zero states, on a stand-in with the parameter's shape and the FP32 dtype
        # the optimizer sees (an expanded scalar: no memory). Unquantized states become 16-bit as usual.
        stand_in = torch.empty((), dtype=torch.float32, device=p.device).expand(p.shape)
        new_buffer = optimizer._new_buffer  # type: ignore[attr-defined]  # torchao's low-bit Adams (checked above)
        fresh = {"step": torch.tensor(0.0), "exp_avg": new_buffer(stand_in, True),
                 "exp_avg_sq": new_buffer(stand_in, False)}
        for key, value in fresh.items():
            state[key] = value if key == "step" or quantized(value, p) else value.to(p.dtype)
        optimizer.state[p] = state
    return True


def init_bnb_(
    optimizer: Optimizer, p: torch.Tensor, state: dict[Any, Any], group: dict[str, Any], group_index: int, index: int
) -> bool:
    # 8-bit codes (what bitsandbytes gives a parameter of min_8bit_size or more elements) are sliced; smaller ones
    # keep FP32 states whole. Created whole first, by the optimizer's init_state on a stand-in of p's shape (it reads
    # the shape and device only).
    if p.numel() < optimizer.args.min_8bit_size:  # type: ignore[attr-defined]
        return False
    if not state:
        stand_in = torch.empty((), dtype=torch.float32, device=p.device).expand(p.shape)
        optimizer.init_state(group, stand_in, group_index, index)  # type: ignore[attr-defined]
        state.update(optimizer.state.pop(stand_in))
        optimizer.state[p] = state
    return codes("state1", state.get("state1"), p)


def transform(grad: torch.Tensor, multiplier: torch.Tensor | float | None, clip: float | None) -> torch.Tensor:
    # In place on a fresh FP32 copy.
    if multiplier is not None:
        grad.mul_(multiplier)
    if clip is not None:
        grad.clamp_(-clip, clip)
    return grad


def check_keys(what: str, expected: set[str], given: set[str], cause: str) -> None:
    if expected != given:
        raise KeyError(
            f"CompactWeights.load_state_dict: missing {what}keys {sorted(expected - given)}, unknown {what}keys"
            f" {sorted(given - expected)}; {cause}"
        )


def grad_bytes(param: torch.Tensor) -> int:
    grad = param.grad
    return 0 if grad is None else grad.numel() * grad.element_size()


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)

"""16-bit weights that train like FP32 ones: Kahan-compensated or stochastically rounded updates, 16-bit state."""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.optim import Optimizer

from lit_mpstable.core.compact_fused import FusedAdam, host_to_device, noise_bits
from lit_mpstable.core.memory import plain_tensors

__all__ = ["CompactMode", "CompactWeights", "quantized_state_classes", "stochastic_round"]

CompactMode = Literal["kahan", "stochastic"]
_MODES: tuple[str, ...] = get_args(CompactMode)
_LOW = (torch.float16, torch.bfloat16)
# Random numbers are a hash of (seed, step, parameter, element index): an element gets the same ones however the step
# is sliced, on any device, eagerly or in the fused kernel. Slices are at least this many elements.
_MIN_SLICE = 2**12
# Updates that are elementwise given per-parameter scalars (step, NAdam's mu_product, ASGD's eta): a parameter can be
# stepped in slices, bit for bit. Exact types only: a subclass may add a per-tensor norm (LAMB, LARS).
_ELEMENTWISE = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Rprop", "ASGD"))
# torchao's low-bit Adams (exact types): elementwise too, with states quantized in blocks of ``block_size`` elements
# that a slice on block boundaries views in place (their subclasses implement view(-1) and slice for resharding).
_TORCHAO_BLOCKWISE = ("Adam8bit", "AdamW8bit", "Adam4bit", "AdamW4bit", "AdamFp8", "AdamWFp8")
# bitsandbytes' 8-bit Adams: codes ``state1``/``state2`` (uint8, the parameter's shape) and one ``absmax`` per block of
# 256 elements, updated in place by its blockwise kernel.
_BNB_BLOCKWISE = ("Adam8bit", "AdamW8bit")
_BNB_BLOCK = 256


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
    return _round_stochastic_(torch.empty_like(src, dtype=dtype), src, _noise(uniform, dtype))


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


def _noise(uniform: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # BF16: 16 random bits (the uniform number's top 16 of 24); FP16: the uniform numbers themselves.
    return uniform.mul_(65536.0).to(torch.int32) if dtype == torch.bfloat16 else uniform


def _round_stochastic_(dst: torch.Tensor, src: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Write FP32 ``src`` (overwritten), stochastically rounded with :func:`_noise` (kept), into 16-bit ``dst``."""
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


def _mix(*values: int) -> int:
    # splitmix64 over the values, folded to 32 bits: the key hash32 adds the element index to.
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return (h ^ (h >> 32)) & 0xFFFFFFFF


@dataclass
class _Piece:
    """Part of one parameter's step: elements [start, stop) of a compact parameter, or a whole parameter that is
    stepped as it is (``name`` None: FP32 islands, frozen or unnamed parameters); ``fused``: a whole parameter the
    fused kernel takes; ``per_element``: set on a whole parameter that :meth:`CompactWeights._chunks` may slice."""

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


class CompactWeights:
    """16-bit weights that train like FP32 ones, with 16-bit optimizer state and no FP32 copy between steps.

    BF16 keeps 8 significant bits, so an update below half an ulp rounds away and plain 16-bit training stalls. FP32
    masters (:class:`~lit_mpstable.core.master.MasterWeights`) fix that for 4 more bytes per parameter (and FP32 state);
    this class for 2 or none:

    - ``"kahan"``: a BF16 compensation per weight holds what the weight could not (Zamirai et al. 2020, "Revisiting
      BFloat16 Training"; optimi): ``w + comp`` carries 8 more significant bits than ``w``.
    - ``"stochastic"``: weights are rounded up or down at random, without bias, so small updates survive on average.

    The optimizers keep the model's own 16-bit parameters: ``optimizer.state_dict()``, LR schedulers and checkpoints
    work unchanged. :meth:`step_` replaces ``optimizer.step()``: chunk by chunk (about ``chunk_bytes`` of FP32 copies
    of value, gradient and per-element state; the optimizer's temporaries come on top), FP32 stand-ins take the
    parameters' places in the groups, the optimizer steps them, and the results are rounded back. Per-element floating
    state (exp_avg, momentum_buffer...) is kept in the parameter's dtype and rounded stochastically in both modes: with
    nearest rounding Adam's ``exp_avg_sq``, which moves by 0.1% of itself per step (below half a BF16 ulp), could
    never decrease, and steps would shrink once gradients do. Other state (``step``, torchao's quantized subclasses,
    bitsandbytes' codes and absmax) stays as the optimizer keeps it. Elementwise ``torch.optim`` optimizers and the
    low-bit Adams (torchao's ``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8`` and their Adam forms; bitsandbytes'
    ``AdamW8bit`` and ``Adam8bit``: slices on their quantization blocks, whose states they update in place) step large
    parameters in slices, others whole parameters. FP32 parameters (FP32 islands), frozen and unnamed ones are
    stepped as they are.

    Random numbers are a function of ``(seed, steps, parameter name, element)``: independent of the chunking and the
    device, and repeated exactly by a resumed or rolled-back run.

    ``fused``: exact ``torch.optim.Adam``/``AdamW`` groups (no ``amsgrad``) on BF16 parameters skip the FP32
    stand-ins: one kernel compiled by ``torch.compile`` per parameter reads each 16-bit tensor once, does the same
    arithmetic in registers and allocates nothing (:mod:`lit_mpstable.core.compact_fused`; the same random numbers, results
    equal to the stand-ins' to FP32 rounding). ``None`` (default): on the CPU, falling back to the stand-ins with a
    warning if compiling fails; ``True``: on any device (inductor's GPU kernels are not measured by this project
    yet), and a failure to compile raises; ``False``: never (no compiler needed). The first fused step of a run
    compiles (18-20 s on a 2-core CPU, ~6 s from inductor's disk cache). An optimizer with step hooks (its own or
    global ones) is not fused: its hooks see the step inside ``optimizer.step()``, on the stand-ins.

    Raises:
        ValueError: ``mode``, ``seed``, ``chunk_bytes`` or ``fused`` is invalid, an optimizer is not per-parameter
            (LBFGS), or it has bitsandbytes per-parameter overrides (see :meth:`bind_new_`).
    """

    def __init__(
        self, model: nn.Module, optimizers: Sequence[Optimizer], mode: CompactMode, *, seed: int = 0,
        chunk_bytes: int | None = None, fused: bool | None = None,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"CompactWeights(mode={mode!r}): mode must be one of {_MODES}.")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise ValueError(f"CompactWeights(seed={seed!r}): seed must be an int in [0, 2**64).")
        if chunk_bytes is not None and (isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int)
                                        or chunk_bytes < 1):
            raise ValueError(
                f"CompactWeights(chunk_bytes={chunk_bytes!r}): chunk_bytes must be a positive int (bytes of FP32"
                " copies per optimizer call; at least 4096 elements of a parameter are stepped at a time) or None"
                " (4 MiB on the CPU, 256 MiB on accelerators)."
            )
        if fused is not None and not isinstance(fused, bool):
            raise ValueError(
                f"CompactWeights(fused={fused!r}): fused must be True (compiled Adam/AdamW steps on any device), False"
                " (never) or None (on the CPU, when torch.compile works)."
            )
        self.mode: CompactMode = mode
        self.seed = seed
        self.fused = fused
        self._fused_failed = False
        self.chunk_bytes = chunk_bytes
        self.steps = 0  # step_ calls so far: part of every random key
        self._model = model
        self._optimizers: list[Optimizer] = []
        self._params: dict[str, nn.Parameter] = {}  # compact: 16-bit, trainable when bound, named in the model
        self._names: dict[int, str] = {}
        self._comp: dict[str, torch.Tensor] = {}
        self._unnamed: dict[int, torch.Tensor] = {}  # 16-bit but not the model's: stepped as they are
        self._fused: FusedAdam | None = None  # built at the first fused step
        self._before: dict[int, dict[Any, Any]] = {}  # during step_: each parameter's state before it
        for optimizer in optimizers:
            if all(optimizer is not o for o in self._optimizers):
                self.bind_new_(optimizer)

    def bind_new_(self, optimizer: Optimizer) -> list[str]:
        """Bind ``optimizer`` (if new) and the 16-bit trainable parameters it holds that are not bound yet (added with
        ``add_param_group`` or unfrozen since); returns their names. Cheap when nothing is new: call it every step.

        Raises:
            ValueError: LBFGS, or bitsandbytes per-parameter overrides (``GlobalOptimManager.override_config``) for
                a parameter of ``optimizer``: it looks them up by the parameter's identity, so the FP32 stand-ins
                stepped in its place would silently go without them.
        """
        overrides = getattr(getattr(optimizer, "mng", None), "pid2config", None)
        if overrides and any(id(p) in overrides for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(
                f"CompactWeights: {type(optimizer).__name__} has bitsandbytes per-parameter overrides"
                " (GlobalOptimManager.override_config), which it finds by the parameter's identity; the FP32 stand-ins"
                " that master_weights='kahan'/'stochastic' step in the parameters' place would not get them. Give those"
                " parameters a param group of their own with the options instead."
            )
        if all(optimizer is not o for o in self._optimizers):
            if isinstance(optimizer, torch.optim.LBFGS):
                raise ValueError(
                    "CompactWeights: LBFGS keeps one state for all parameters and re-evaluates the loss inside step(),"
                    " which stepping in chunks cannot follow; use a per-parameter optimizer (SGD, Adam, ...)."
                )
            self._optimizers.append(optimizer)
        new: list[str] = []
        named: dict[int, str] | None = None
        unnamed = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in self._names or id(p) in self._unnamed or not p.requires_grad or p.dtype not in _LOW:
                    continue
                named = named if named is not None else {id(q): n for n, q in self._model.named_parameters()}
                name = named.get(id(p))
                if name is None:
                    self._unnamed[id(p)], unnamed = p, unnamed + 1
                    continue
                self._params[name], self._names[id(p)] = p, name
                if self.mode == "kahan":
                    # BF16 for FP16 weights too: an FP16 compensation (residuals below 2**-11 |w|) is subnormal for
                    # |w| < 2**-3 and zero below 2**-13; BF16 keeps 8 bits at any magnitude.
                    self._comp[name] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                new.append(name)
        if unnamed:
            warnings.warn(
                f"CompactWeights: {unnamed} 16-bit trainable parameters of {type(optimizer).__name__} are not the"
                " model's, so they have no name to checkpoint a compensation under; they are stepped as they are"
                " (updates below half an ulp are lost).", stacklevel=2,
            )
        return new

    @torch.no_grad()
    def follow_recast_(self, changed: Sequence[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """Carry the state of parameters a precision fallback or restore cast in place (``(parameter, its data
        before)``): into FP32, a Kahan parameter takes its compensation (``w + comp``: the value the run held) and
        the compensation is zeroed; back into 16 bits, the compensation takes the rounding residual; per-element
        optimizer state follows the parameter's dtype (Adam's ``lerp_`` refuses mixed dtypes)."""
        for param, old in changed:
            name = self._names.get(id(param))
            comp = self._comp.get(name) if name is not None else None
            if comp is not None and param.dtype == torch.float32 and old.dtype in _LOW:
                param.add_(comp.float())
                comp.zero_()
            elif comp is not None and param.dtype in _LOW and old.dtype == torch.float32:
                comp.copy_(old - param.float())
            for optimizer in self._optimizers:
                _cast_state_(optimizer, param)

    # ------------------------------------------------------------------------------------------ reading
    def named_buffers(self) -> Iterator[tuple[str, nn.Parameter, torch.Tensor | None]]:
        """Yield ``(qualified name, 16-bit parameter, compensation or None)`` for every compact parameter."""
        for name, p in self._params.items():
            yield name, p, self._comp.get(name)

    # ------------------------------------------------------------------------------------------ stepping
    @torch.no_grad()
    def step_(
        self, optimizer: Optimizer, *, grad_multiplier: torch.Tensor | float | None = None,
        clip_value: float | None = None, **step_kwargs: Any,
    ) -> Any:
        """One ``optimizer.step(**step_kwargs)`` on the current gradients, in FP32; no host sync.

        Gradients are cast to FP32, multiplied by ``grad_multiplier`` (fold loss-scale unscaling and clip-by-norm
        into it), then clamped to ``[-clip_value, clip_value]``. Parameters without a gradient are skipped, as the
        optimizer would (none with one: the optimizer is not called). Afterwards every stepped parameter's gradient
        is None (freed chunk by chunk). The optimizer is called once per chunk (its step hooks too); parameters the
        fused kernel stepped are out of its groups, and with them alone it is called once with empty groups (what
        counts its steps, an LR scheduler, still sees one). If it raises, the chunks before stay stepped, and the
        failing chunk's parameters, gradients and per-element state are unchanged. Skipping a step (inf/NaN) is
        the caller's decision: then do not call this.

        Raises:
            ValueError: the optimizer is not bound, a closure is given (it would run once per chunk), or
                ``clip_value`` is not positive.
            RuntimeError: a 16-bit trainable parameter of the optimizer was not bound (call :meth:`bind_new_`).
        """
        if all(optimizer is not o for o in self._optimizers):
            raise ValueError(
                f"CompactWeights.step_: optimizer {type(optimizer).__name__} (id {id(optimizer):#x}) is not bound;"
                " pass it at construction or call bind_new_(optimizer) first."
            )
        if step_kwargs.get("closure") is not None:
            raise ValueError(
                "CompactWeights.step_(closure=...): the optimizer is called once per chunk, so a closure would run"
                " forward and backward several times; run it first, then call step_ without it."
            )
        if clip_value is not None and not clip_value > 0:
            raise ValueError(f"CompactWeights.step_(clip_value={clip_value!r}): must be positive, or None.")
        self.steps += 1
        self._before = {}
        groups, output = optimizer.param_groups, None
        pieces = self._pieces(optimizer)
        grads = [(piece.param, _grad_bytes(piece.param)) for piece in pieces if piece.fused]
        pieces, fused = self._step_fused_(optimizer, pieces, grad_multiplier, clip_value)
        freed = sum(nbytes for p, nbytes in grads if p.grad is None)  # the fused step dropped them
        base, cap = self._budget(pieces[0].param.device, optimizer) if pieces else (0, 0)
        chunks = list(self._chunks(pieces, base, cap, freed))
        for chunk in chunks or ([[]] if fused else []):  # fused alone: one call for the hooks (empty groups)
            saved = [group["params"] for group in groups]
            entered: list[tuple[_Piece, torch.Tensor, torch.Tensor | None]] = []
            try:
                lists: list[list[torch.Tensor]] = [[] for _ in groups]
                for piece in chunk:
                    proxy, grad = self._enter(optimizer, piece, grad_multiplier, clip_value)
                    entered.append((piece, proxy, grad))
                    lists[piece.group].append(proxy)
                for group, params in zip(groups, lists):
                    group["params"] = params
                output = optimizer.step(**step_kwargs)
            except BaseException:
                for piece, proxy, grad in entered:
                    optimizer.state.pop(proxy, None)
                    if piece.name is None and grad is not None:
                        piece.param.grad = grad  # restore the untransformed gradient
                raise
            finally:
                for group, params in zip(groups, saved):
                    group["params"] = params
            for piece, proxy, _ in entered:
                self._leave(optimizer, piece, proxy)
        self._before = {}
        return output

    def _step_fused_(
        self, optimizer: Optimizer, pieces: list[_Piece], multiplier: torch.Tensor | float | None, clip: float | None
    ) -> tuple[list[_Piece], bool]:
        """Step the parameters the fused kernel takes (:meth:`_pieces` leaves them whole: the kernel allocates
        nothing, so slices would only add calls); returns the other pieces, in order, and whether any was stepped."""
        rest: list[_Piece] = []
        stepped = False
        scalars: dict[tuple[int, float, torch.device], torch.Tensor] = {}  # one small tensor per group, usually
        for i, piece in enumerate(pieces):
            p = piece.param
            if not piece.fused:
                rest.append(piece)
                continue
            state = optimizer.state[p]
            if not state:  # as torch's Adam initializes it, the moments in the parameter's dtype
                scalar_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                state["step"] = torch.tensor(0.0, dtype=scalar_dtype)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            key = (piece.group, float(state["step"]) + 1, p.device)
            if key not in scalars:
                mult = _multiplier_tensor(multiplier, p.device)
                scalars[key] = FusedAdam.scalars(optimizer.param_groups[piece.group], key[1], mult, clip)
            self._fused = FusedAdam() if self._fused is None else self._fused
            comp = self._comp[piece.name].view(-1) if self.mode == "kahan" else None  # type: ignore[index]
            try:
                self._fused.step_(
                    p.detach().view(-1), comp, p.grad.view(-1), state["exp_avg"].view(-1),
                    state["exp_avg_sq"].view(-1), scalars[key], self._key(piece),
                )
            except Exception as error:  # compiling failed (no C++ compiler, an unsupported device...)
                if self.fused is True:
                    raise RuntimeError(
                        f"CompactWeights(fused=True): the fused Adam step of {piece.name!r} failed: {error}"
                    ) from error
                self._fused_failed = True
                warnings.warn(
                    f"CompactWeights: the fused Adam step did not compile ({type(error).__name__}:"
                    f" {str(error).strip().splitlines()[0] if str(error).strip() else ''}); stepping"
                    " through FP32 copies instead (slower). Pass fused=False to skip the attempt.", stacklevel=3,
                )
                return rest + pieces[i:], stepped
            state["step"] += 1
            p.grad = None
            stepped = True
        return rest, stepped

    def _fusable(self, optimizer: Optimizer, piece: _Piece) -> bool:
        p, grad = piece.param, piece.param.grad
        if (
            self.fused is False or self._fused_failed or piece.name is None or p.dtype != torch.bfloat16
            or _has_step_hooks(optimizer)  # they must see the step inside optimizer.step(), on its parameters
            or (p.device.type != "cpu" and self.fused is not True)
            or p.numel() == 0 or not FusedAdam.eligible(optimizer, optimizer.param_groups[piece.group], p.device)
            or not p.is_contiguous() or grad is None or grad.layout != torch.strided or not grad.is_contiguous()
            or grad.dtype != p.dtype
        ):
            return False
        state = optimizer.state.get(p, {})
        if not state:
            return True
        if set(state) != {"step", "exp_avg", "exp_avg_sq"} or not torch.is_tensor(state["step"]):
            return False
        step = state["step"]
        return step.device.type == "cpu" and step.numel() == 1 and all(
            type(state[k]) is torch.Tensor and state[k].dtype == p.dtype and state[k].shape == p.shape
            and state[k].is_contiguous() for k in ("exp_avg", "exp_avg_sq")
        )

    def _pieces(self, optimizer: Optimizer) -> list[_Piece]:
        non_castable = getattr(optimizer, "non_castable_tensor_keys", ())
        block = _block_size(optimizer)
        sliceable = block is not None or type(optimizer) in _ELEMENTWISE
        pieces: list[_Piece] = []
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                grad = p.grad
                if grad is None:
                    continue
                name = self._names.get(id(p))
                if name is not None and p.dtype not in _LOW:  # cast to FP32 since (a fallback): it holds it all
                    if name in self._comp:
                        self._comp[name].zero_()  # follow_recast_ moved it into the weight already
                    _cast_state_(optimizer, p)
                    name = None
                if name is None:
                    if p.requires_grad and p.dtype in _LOW and id(p) not in self._unnamed:
                        raise RuntimeError(
                            f"CompactWeights.step_: a {p.dtype} trainable parameter of shape {tuple(p.shape)} was"
                            " added to the optimizer, unfrozen or cast to 16 bits after binding; call"
                            " bind_new_(optimizer) first."
                        )
                    pieces.append(_Piece(gi, p, None, 0, p.numel(), p.numel() * grad.element_size()))
                    continue
                state = optimizer.state.get(p, {})
                sliced = (sliceable and p.is_contiguous() and grad.layout == torch.strided and grad.is_contiguous()
                          and (block is None or _init_blockwise_(optimizer, p, state, block, gi, pi)))
                for key, value in state.items():  # e.g. loaded from an FP32 run: keep the invariant (16-bit)
                    if _per_element(key, value, p, non_castable) and value.dtype != p.dtype:
                        state[key] = value.to(p.dtype)
                n_states = sum(_per_element(k, v, p, non_castable) for k, v in state.items()) if state else 2
                per_element = 4 * (2 + n_states)
                numel = p.numel()
                whole = _Piece(gi, p, name, 0, numel, numel * per_element)
                if self._fusable(optimizer, whole):  # one kernel, no FP32 copies: nothing to slice
                    whole.fused = True
                elif sliced:
                    whole.per_element = per_element
                pieces.append(whole)
        return pieces

    def _budget(self, device: torch.device, optimizer: Optimizer) -> tuple[int, int]:
        """Bytes of FP32 copies per optimizer call: at first, and at most once the step has freed gradients.

        Small chunks on the CPU: their FP32 copies come back from the allocator's cache (larger ones are fresh pages
        every step, slower) and the transient stays small; measured in bench/bench_compact_core.py. The low-bit Adams
        allocate FP32 temporaries about the size of the copies on top, when every gradient is still held (and each
        call costs torchao's ~1 ms, a torch.compile wrapper per parameter): they start at 512 KiB and grow by half the
        gradient bytes freed (copies and temporaries together take their place), to 4 MiB. On an accelerator, fewer optimizer calls matter more (a guessed default; no GPU
        measurement yet)."""
        if self.chunk_bytes is not None:
            return self.chunk_bytes, self.chunk_bytes
        if device.type != "cpu":
            return 256 * 2**20, 256 * 2**20
        return (2**19, 4 * 2**20) if _block_size(optimizer) is not None else (4 * 2**20, 4 * 2**20)

    def _chunks(self, pieces: list[_Piece], base: int, cap: int, freed: int) -> Iterator[list[_Piece]]:
        """Group the pieces into optimizer calls of about ``min(base + freed / 2, cap)`` bytes of FP32 copies each,
        ``freed`` being the gradient bytes dropped by the calls before (the given ``freed``: the fused step's), so
        that the step's transient (copies and the optimizer's temporaries) stays near its first call's; sliceable
        parameters that do not fit are cut into slices of a multiple of 4096 elements (a power-of-two multiple when
        the budget grows: few distinct shapes for a compiled optimizer)."""
        chunk: list[_Piece] = []
        used = pending = 0  # pending: gradients the current chunk will free

        def limit() -> int:
            return min(base + freed // 2, cap)

        for piece in pieces:
            if piece.per_element and piece.nbytes > limit() - used:
                if chunk:
                    yield chunk
                    chunk, used, freed, pending = [], 0, freed + pending, 0
                size = max(_MIN_SLICE, limit() // piece.per_element // _MIN_SLICE * _MIN_SLICE)
                if cap > base:
                    size = _MIN_SLICE << ((size // _MIN_SLICE).bit_length() - 1)
                for start in range(0, piece.stop, size):
                    if chunk:
                        yield chunk
                    stop = min(piece.stop, start + size)
                    chunk = [_Piece(piece.group, piece.param, piece.name, start, stop, (stop - start) * piece.per_element)]
                    used = chunk[0].nbytes
                pending += _grad_bytes(piece.param)
                continue
            if chunk and used + piece.nbytes > limit():
                yield chunk
                chunk, used, freed, pending = [], 0, freed + pending, 0
            chunk.append(piece)
            used += piece.nbytes
            pending += _grad_bytes(piece.param)
        if chunk:
            yield chunk

    def _enter(
        self, optimizer: Optimizer, piece: _Piece, multiplier: torch.Tensor | float | None, clip: float | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tensor the optimizer steps for ``piece`` (an FP32 stand-in, or the parameter itself), with its FP32
        gradient and state in place; returns it and the parameter's original gradient when that was replaced."""
        p = piece.param
        if piece.name is None:
            if multiplier is None and clip is None:
                return p, None
            original = p.grad
            p.grad = _transform(original.to(torch.float32, copy=True), multiplier, clip).to(original.dtype)
            return p, original
        value = piece.view(p.detach()).to(torch.float32, copy=True)
        if self.mode == "kahan":
            value.add_(piece.view(self._comp[piece.name]))
        proxy = nn.Parameter(value)
        proxy.grad = _transform(piece.view(p.grad).to(torch.float32, copy=True), multiplier, clip)
        # Every slice of a parameter starts from its state before this step, though earlier slices are written back.
        state = self._before.setdefault(id(p), dict(optimizer.state.get(p, {})))
        if state:
            non_castable = getattr(optimizer, "non_castable_tensor_keys", ())
            optimizer.state[proxy] = {
                key: piece.view(v).to(torch.float32, copy=True) if _per_element(key, v, p, non_castable)
                else v if piece.whole or not isinstance(v, torch.Tensor)
                else piece.view(v) if _quantized(v, p) or _codes(key, v, p)  # its own blocks, stepped in place
                else v[piece.start // _BNB_BLOCK : -(-piece.stop // _BNB_BLOCK)] if _absmax(key, v, p)
                else v.clone()
                for key, v in state.items()
            }
        return proxy, None

    def _leave(self, optimizer: Optimizer, piece: _Piece, proxy: torch.Tensor) -> None:
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
                if _per_element(key, v, proxy, non_castable):
                    dst = state.get(key)
                    if type(dst) is not torch.Tensor or dst.dtype != p.dtype or dst.shape != p.shape:
                        dst = state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    self._round_(piece.view(dst), v, piece, noise)
                elif piece.start == 0 and (piece.whole or not isinstance(v, torch.Tensor) or v.dim() == 0):
                    state[key] = v  # per-parameter scalars: every slice computes the same ones
        if piece.stop == p.numel():
            p.grad = None

    def _round_(self, dst: torch.Tensor, src: torch.Tensor, piece: _Piece, noise: list[torch.Tensor]) -> None:
        """Stochastic rounding of ``src`` (overwritten) into ``dst``. The random numbers are
        :func:`~lit_mpstable.core.compact_fused.noise_bits` of (seed, steps, parameter, element) and shared by the weight
        and its state tensors: each is rounded without bias, for a third of the random numbers; their errors at one
        element are correlated, which changes only second-order terms (the ratio m / sqrt(v) even gains)."""
        if not noise:
            noise.append(noise_bits(src.numel(), self._key(piece) + piece.start, src.device, piece.param.dtype))
        _round_stochastic_(dst, src, noise[0])

    def _key(self, piece: _Piece) -> int:
        # Hash of (seed, steps, parameter name): the random key of the parameter's element 0 at this step.
        return _mix(self.seed, self.steps, zlib.crc32(piece.name.encode()))  # type: ignore[union-attr]

    # --------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """``mode``, ``seed``, ``steps`` (the random keys) and ``compensation`` (``{parameter name: tensor}``, empty
        for ``"stochastic"``); plain values and tensors only, so ``torch.load(weights_only=True)`` reads it.

        The tensors share storage with the compensations (detached, not copied): clone them for an in-memory
        snapshot that later steps must not change. The weights and optimizer state are in the model's and the
        optimizers' own state dicts.
        """
        return {
            "mode": self.mode, "seed": self.seed, "steps": self.steps,
            "compensation": {name: comp.detach() for name, comp in self._comp.items()},
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values (load the model's weights from the same checkpoint).

        Raises:
            KeyError: a key or parameter name is missing or unknown (each one is listed).
            ValueError: the mode or a tensor's shape differs.
        """
        _check_keys("", {"mode", "seed", "steps", "compensation"}, set(state), "a different lit_mpstable version?")
        if state["mode"] != self.mode:
            raise ValueError(
                f"CompactWeights.load_state_dict: saved with mode={state['mode']!r}, this object has"
                f" mode={self.mode!r}; build it with the saved mode, or call zero_compensation_() instead of loading."
            )
        comp = state["compensation"]
        _check_keys(
            "compensation ", set(self._comp), set(comp), "saved from a different model, or with other parameters"
            " trainable or in FP32?",
        )
        for name, buffer in self._comp.items():
            if comp[name].shape != buffer.shape:
                raise ValueError(
                    f"CompactWeights.load_state_dict: compensation {name!r} has shape {tuple(comp[name].shape)}, the"
                    f" parameter {tuple(buffer.shape)}; was it saved from a different model?"
                )
        if self._comp:
            torch._foreach_copy_(list(self._comp.values()), [comp[name] for name in self._comp])
        self.seed, self.steps = int(state["seed"]), int(state["steps"])

    @torch.no_grad()
    def zero_compensation_(self) -> None:
        """Zero every compensation: the weights alone are the value (e.g. after loading a checkpoint without one)."""
        if self._comp:
            torch._foreach_zero_(list(self._comp.values()))

    def memory_report(self) -> dict[str, int]:
        """Bytes held by training state, by kind; counts tensors (quantized states by their inner tensors), not
        allocator overhead. Reads no device data.

        Keys: ``params_16bit`` (every FP16/BF16 parameter of the model, frozen ones too), ``compensation``,
        ``grads`` (the model's gradients that exist now), ``optimizer_state`` (every tensor in the optimizers'
        ``state``, ``step`` counters included), ``params_fp32_other`` (trainable parameters of any other dtype),
        ``total`` (their sum).
        """
        params = list(self._model.parameters())
        state: dict[int, torch.Tensor] = {}
        for optimizer in self._optimizers:
            for param_state in optimizer.state.values():
                for value in param_state.values():
                    state.update((id(t), t) for t in plain_tensors(value))
        report = {
            "params_16bit": _nbytes(p for p in params if p.dtype in _LOW),
            "compensation": _nbytes(self._comp.values()),
            "grads": _nbytes(p.grad for p in params if p.grad is not None),
            "optimizer_state": _nbytes(state.values()),
            "params_fp32_other": _nbytes(p for p in params if p.dtype not in _LOW and p.requires_grad),
        }
        report["total"] = sum(report.values())
        return report


def _cast_state_(optimizer: Optimizer, param: torch.Tensor) -> None:
    """The per-element floating state of ``param`` in ``optimizer`` in the parameter's dtype (after a recast)."""
    state = optimizer.state.get(param)
    if state:
        non_castable = getattr(optimizer, "non_castable_tensor_keys", ())
        for key, value in state.items():
            if _per_element(key, value, param, non_castable) and value.dtype != param.dtype:
                state[key] = value.to(param.dtype)


def _per_element(key: Any, value: Any, param: torch.Tensor, non_castable: Any) -> bool:
    # Exactly what torch's Optimizer.load_state_dict casts to the parameter's dtype (floating, not "step"), unless the
    # optimizer opts out (bitsandbytes), and per element: so it is 16-bit between steps and round-trips bit for bit.
    return (
        type(value) is torch.Tensor and value.is_floating_point() and key != "step" and key not in non_castable
        and value.shape == param.shape
    )


def _quantized(value: Any, param: torch.Tensor) -> bool:
    # A per-element state held by a wrapper subclass (torchao's 8-bit, 4-bit, FP8 states).
    return isinstance(value, torch.Tensor) and type(value) is not torch.Tensor and value.shape == param.shape


def _codes(key: Any, value: Any, param: torch.Tensor) -> bool:
    # bitsandbytes' 8-bit codes of a state: per element, not floating.
    return key in ("state1", "state2") and type(value) is torch.Tensor and value.dtype == torch.uint8 and (
        value.shape == param.shape)


def _absmax(key: Any, value: Any, param: torch.Tensor) -> bool:
    # bitsandbytes' per-block scales of a state.
    return key in ("absmax1", "absmax2") and type(value) is torch.Tensor and value.shape == (
        -(-param.numel() // _BNB_BLOCK),)


def _block_size(optimizer: Optimizer) -> int | None:
    """The quantization block of a torchao low-bit Adam or a bitsandbytes 8-bit Adam (exact types; bitsandbytes:
    8-bit, no update-norm clipping, not paged), else None."""
    cls = type(optimizer)
    if cls.__module__.startswith("bitsandbytes.optim") and cls.__name__ in _BNB_BLOCKWISE:
        args = getattr(optimizer, "args", None)
        ok = (getattr(args, "optim_bits", None) == 8 and getattr(args, "max_unorm", None) == 0
              and not getattr(optimizer, "is_paged", True) and callable(getattr(optimizer, "init_state", None)))
        return _BNB_BLOCK if ok else None
    if not cls.__module__.startswith("torchao.optim") or cls.__name__ not in _TORCHAO_BLOCKWISE:
        return None
    block = getattr(optimizer, "block_size", None)
    new_buffer = getattr(optimizer, "_new_buffer", None)
    ok = isinstance(block, int) and not isinstance(block, bool) and block > 0 and callable(new_buffer)
    return block if ok and _MIN_SLICE % block == 0 else None


def _init_blockwise_(
    optimizer: Optimizer, p: torch.Tensor, state: dict[Any, Any], block: int, group_index: int, index: int
) -> bool:
    """Whether ``p`` (``optimizer.param_groups[group_index]["params"][index]``) has quantized states that can be
    stepped in slices; on its first step, creates them whole first (as the optimizer's own ``step`` would on the FP32
    stand-in; a slice would get a state of its own shape)."""
    group = optimizer.param_groups[group_index]
    if block == _BNB_BLOCK and type(optimizer).__module__.startswith("bitsandbytes"):
        return _init_bnb_(optimizer, p, state, group, group_index, index)
    if p.numel() % block or group["amsgrad"]:
        return False  # whole: torchao keeps such states unquantized; its amsgrad fails on FP32 stand-ins anyway
    if not state:
        # The optimizer's own constructor of zero states, on a stand-in with the parameter's shape and the FP32 dtype
        # the optimizer sees (an expanded scalar: no memory). Unquantized states become 16-bit as usual.
        stand_in = torch.empty((), dtype=torch.float32, device=p.device).expand(p.shape)
        fresh = {"step": torch.tensor(0.0), "exp_avg": optimizer._new_buffer(stand_in, True),  # type: ignore[operator]
                 "exp_avg_sq": optimizer._new_buffer(stand_in, False)}  # type: ignore[operator]
        for key, value in fresh.items():
            state[key] = value if key == "step" or _quantized(value, p) else value.to(p.dtype)
        optimizer.state[p] = state
    return True


def _init_bnb_(
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
    return _codes("state1", state.get("state1"), p)


def _has_step_hooks(optimizer: Optimizer) -> bool:
    # The optimizer's own step pre/post hooks and the global ones (torch.optim.optimizer.register_optimizer_step_*).
    from torch.optim import optimizer as module

    return bool(
        getattr(optimizer, "_optimizer_step_pre_hooks", None) or getattr(optimizer, "_optimizer_step_post_hooks", None)
        or getattr(module, "_global_optimizer_pre_hooks", None) or getattr(module, "_global_optimizer_post_hooks", None)
    )


def _multiplier_tensor(multiplier: torch.Tensor | float | None, device: torch.device) -> torch.Tensor:
    if isinstance(multiplier, torch.Tensor):
        return multiplier.detach().to(device=device, dtype=torch.float32).reshape(())
    return host_to_device(torch.tensor(1.0 if multiplier is None else float(multiplier), dtype=torch.float32), device)


def _transform(grad: torch.Tensor, multiplier: torch.Tensor | float | None, clip: float | None) -> torch.Tensor:
    # In place on a fresh FP32 copy.
    if multiplier is not None:
        grad.mul_(multiplier)
    if clip is not None:
        grad.clamp_(-clip, clip)
    return grad


def _check_keys(what: str, expected: set[str], given: set[str], cause: str) -> None:
    if expected != given:
        raise KeyError(
            f"CompactWeights.load_state_dict: missing {what}keys {sorted(expected - given)}, unknown {what}keys"
            f" {sorted(given - expected)}; {cause}"
        )


def _grad_bytes(param: torch.Tensor) -> int:
    grad = param.grad
    return 0 if grad is None else grad.numel() * grad.element_size()


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


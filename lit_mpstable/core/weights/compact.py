"""16-bit weights that train like FP32 ones: Kahan-compensated or stochastically rounded updates, 16-bit state.

One class, :class:`CompactWeights`, read top to bottom: binding, the step (pieces of parameters entered as FP32
stand-ins and rounded back, or handed whole to the fused Adam kernel of
:mod:`~lit_mpstable.core.weights.compact_fused`), its state, and its part of the weight keeper's step. After it, the
pieces' layout rules: which optimizer states may be sliced, how the pieces are grouped into calls of bounded FP32
copies. The rounding and its random keys are :mod:`~lit_mpstable.core.weights.compact_rounding`'s.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim import optimizer as _optimizer_module  # its global step hooks

from lit_mpstable.base.notes import Notes
from lit_mpstable.core.replicas import agree_seed, broadcast_
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler
from lit_mpstable.core.scaling.scalers import LossScaler
from lit_mpstable.core.tensors import grad_norms
from lit_mpstable.core.weights import compact_fused
from lit_mpstable.core.weights.compact_fused import (
    FusedAdam,
    KernelArgs,
    ManyArgs,
    fill_key,
    flat,
    flat_views,
    keys,
    multiplier_tensor,
)
from lit_mpstable.core.weights.compact_rounding import noise_bits, round_stochastic_, step_keys
from lit_mpstable.core.weights.keeper import GradView, Keeper, cast_state_, first_grad_device
from lit_mpstable.core.weights.keeper import per_element as is_per_element
from lit_mpstable.core.weights.memory import nbytes, plain_tensors
from lit_mpstable.core.weights.moment_keeper import KEY, AdamMoments, split_moments, step_without_params

if TYPE_CHECKING:
    from torch.optim.optimizer import Kwargs, StateDict

CompactMode = Literal["kahan", "stochastic"]
_MODES: tuple[str, ...] = get_args(CompactMode)


# ------------------------------------------------------------------------------------------------- the pieces
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


class CompactWeights(Keeper):
    """16-bit weights that train like FP32 ones, with 16-bit optimizer state and no FP32 copy between steps.

    BF16 keeps 8 significant bits, so an update below half an ulp rounds away and plain 16-bit training stalls. FP32
    masters (:class:`~lit_mpstable.core.weights.master.MasterWeights`) fix that for 4 more bytes per parameter (and FP32
    state); this class for 2 or none:

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
    low-bit Adams (torchao's and bitsandbytes', sliced on their quantization blocks) step large parameters in slices,
    others whole parameters. FP32 parameters (FP32 islands), frozen and unnamed ones are stepped as they are.

    Random numbers are a function of ``(seed, steps, parameter name, element)``: independent of the chunking and the
    device, and repeated exactly by a resumed or rolled-back run.

    ``fused``: exact ``torch.optim.Adam``/``AdamW`` groups (no ``amsgrad``) on BF16 parameters skip the FP32
    stand-ins for one pass per parameter that allocates nothing (:mod:`~lit_mpstable.core.weights.compact_fused`,
    ``docs/memory.md``: the same random numbers, results equal to the stand-ins' to FP32 rounding). ``None``
    (default): on the CPU, falling back to the stand-ins with a warning if compiling fails; ``True``: on any device
    (GPU kernels are not measured by this project yet), and a failure to compile raises; ``False``: never. An
    optimizer with step hooks (its own or global ones) is not fused: its hooks see the step inside
    ``optimizer.step()``, on the stand-ins.

    As the :class:`~lit_mpstable.core.weights.weights.WeightKeeper` of ``master_weights="kahan"``/``"stochastic"``,
    the gradients stay scaled and 16-bit until the step's FP32 chunks unscale them: :meth:`unscale_` only checks
    (``check_``), and the unscale and clip factors wait per optimizer until the step. With
    ``optimizer_state="bf16"``/``"fp8"`` exact Adam/AdamW groups are stepped one whole parameter at a time through
    :class:`~lit_mpstable.core.weights.moment_keeper.AdamMoments` instead of the optimizer's step on stand-ins.

    Raises:
        ValueError: ``mode``, ``seed``, ``chunk_bytes`` or ``fused`` is invalid, an optimizer is not per-parameter
            (LBFGS), or it has bitsandbytes per-parameter overrides (see :meth:`bind_new_`); ``checker`` cannot
            check without unscaling (compact weights unscale in FP32 themselves).
    """

    state_key: str | None = "compact"
    defers_unscale = True
    exposes_grads = False

    def __init__(
        self, model: nn.Module, optimizers: Sequence[Optimizer], mode: CompactMode, *, seed: int = 0,
        chunk_bytes: int | None = None, fused: bool | None = None, checker: LossScaler | None = None,
        optimizer_state: str = "fp32", owner: str = "PrecisionStepper", precision: str | None = None,
        notes: Notes | None = None,
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
        if checker is not None and not checker.checks_without_unscaling:
            raise ValueError(
                f"{owner}({precision!r}, master_weights={mode!r},"
                f" scaler={type(checker).__name__}(...)): compact weights unscale in FP32 themselves and need"
                " a scaler that checks without unscaling (check_()); use scaler='dynamic' or DynamicLossScaler."
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
        self._views: dict[int, KernelArgs] = {}  # per parameter (by id): its kernel arguments of the last fused step
        self._many: dict[int, ManyArgs] = {}  # per optimizer (by id): its whole step as one call of the C loop
        self._crc: dict[str, int] = {}  # per parameter name: its CRC-32, part of every random key
        self._before: dict[int, dict[str, Any]] = {}  # during step_: each parameter's state before it
        for optimizer in optimizers:
            if all(optimizer is not o for o in self._optimizers):
                self.bind_new_(optimizer)
        self._pending: dict[int, list[Any]] = {}  # per optimizer this iteration: [multiplier, clip value]
        self.keeps_stepped_grads = False
        """Set before a step to keep the gradients it steps with (OverflowMonitor does on a logging step: Adam's lag
        compares them with the second moment after the step, and the step frees them); :meth:`take_stepped_grads`
        hands them over and clears it. Until then the 16-bit gradients stay allocated, as they were before the step."""
        self._stepped: dict[int, tuple[torch.Tensor, torch.Tensor | None, float | None]] = {}  # by parameter id
        self.moments: AdamMoments | None = None
        if optimizer_state != "fp32":
            self.moments = AdamMoments(optimizer_state, seed=self.seed, owner=owner)
            names = {id(p): name for name, p in model.named_parameters()}
            for optimizer in optimizers:
                self.moments.bind_(optimizer, names)
        if precision == "16-true" and notes is not None:
            notes.add(
                f"compact-16-true:{mode}",
                f"{owner}('16-true', master_weights={mode!r}): optimizer state stays FP16, where"
                " Adam's second moment (about 1e-3 * grad**2) falls into the subnormal range for gradients below"
                " ~1e-2 and its rounding distorts the steps; with Adam-family optimizers prefer 'bf16-true' or"
                " master_weights=True (SGD-like optimizers are fine)."
            )

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
                if id(p) in self._names or id(p) in self._unnamed or not p.requires_grad or p.dtype not in LOW:
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
    def _recast_(self, changed: Sequence[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """Carry the state of parameters a precision fallback or restore cast in place (``(parameter, its data
        before)``; :meth:`follow_model_weights_` with ``recast``): into FP32, a Kahan parameter takes its compensation
        (``w + comp``: the value the run held) and the compensation is zeroed; back into 16 bits, the compensation
        takes the rounding residual; per-element optimizer state follows the parameter's dtype (Adam's ``lerp_``
        refuses mixed dtypes)."""
        self._many.clear()  # the C loop's arguments of the old tensors
        for param, old in changed:
            self._views.pop(id(param), None)  # the fused kernel's views of its old tensors
            name = self._names.get(id(param))
            comp = self._comp.get(name) if name is not None else None
            if comp is not None and param.dtype == torch.float32 and old.dtype in LOW:
                param.add_(comp.float())
                comp.zero_()
            elif comp is not None and param.dtype in LOW and old.dtype == torch.float32:
                comp.copy_(old - param.float())
            for optimizer in self._optimizers:
                cast_state_(optimizer, param)

    # ------------------------------------------------------------------------------------------ reading
    def named_buffers(self) -> Iterator[tuple[str, nn.Parameter, torch.Tensor | None]]:
        """Yield ``(qualified name, 16-bit parameter, compensation or None)`` for every compact parameter."""
        for name, p in self._params.items():
            yield name, p, self._comp.get(name)

    # ------------------------------------------------------------------------------------------ stepping
    # Eager always: a train step compiled whole (forward, backward and optimizer.step in one torch.compile'd function)
    # breaks its graph here. Traced, the random keys' 64-bit hash became constants inductor could not index with
    # (an InductorError at the first step), and the step's chunks, hooks and kernel choice are host decisions anyway.
    @torch.compiler.disable
    @torch.no_grad()
    def step_(
        self, optimizer: Optimizer, *, grad_multiplier: torch.Tensor | float | None = None,
        clip_value: float | None = None, **step_kwargs: Any,
    ) -> object:
        """One ``optimizer.step(**step_kwargs)`` on the current gradients, in FP32; no host sync.

        Gradients are cast to FP32, multiplied by ``grad_multiplier`` (fold loss-scale unscaling and clip-by-norm
        into it), then clamped to ``[-clip_value, clip_value]``. Parameters without a gradient are skipped, as the
        optimizer would (none with one: the optimizer is not called). Afterwards every stepped parameter's gradient
        is None (freed chunk by chunk). The optimizer is called once per chunk (its step hooks too); parameters the
        fused kernel stepped are out of its groups, and with them alone it is called once with empty groups (what
        counts its steps, an LR scheduler, still sees one; when the C loop steps them all in one call, only where
        something would see it: a wrapper of ``optimizer.step`` or step keywords). If it raises, the chunks before
        stay stepped, and the failing chunk's parameters, gradients and per-element state are unchanged. Skipping a
        step (inf/NaN) is the caller's decision: then do not call this.

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
        many = self._many.get(id(optimizer))
        if many is not None:
            done, output = self._step_many_(optimizer, many, grad_multiplier, clip_value, step_kwargs)
            if done:
                return output
        groups, output = optimizer.param_groups, None
        pieces = self._pieces(optimizer)
        rest, fused = self._step_fused_(optimizer, pieces, grad_multiplier, clip_value)
        if fused and not rest:  # every parameter fused: next time, if the C loop took them, all in one call
            self._keep_many_(optimizer, pieces)
        chunks: list[list[Piece]] = []
        if rest:  # chunks grow by the gradient bytes the fused step dropped (of the parameter's size and dtype)
            freed = sum(piece.param.numel() * piece.param.element_size() for piece in pieces
                        if piece.fused and piece.param.grad is None)
            base, cap = budget(self.chunk_bytes, rest[0].param.device, optimizer)
            chunks = list(split_pieces(rest, base, cap, freed))
        if fused and not chunks:
            output = step_without_params(optimizer, **step_kwargs)
        for chunk in chunks:
            saved = [group["params"] for group in groups]
            entered: list[tuple[Piece, torch.Tensor, torch.Tensor | None]] = []
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

    def _step_many_(
        self, optimizer: Optimizer, many: ManyArgs, multiplier: torch.Tensor | float | None, clip: float | None,
        step_kwargs: dict[str, Any],
    ) -> tuple[bool, object]:
        """Step every parameter of ``optimizer`` in one call of the C loop, as the last step did them one by one
        (:class:`~lit_mpstable.core.weights.compact_fused.ManyArgs`: the same words); ``(False, None)`` and nothing
        done where anything changed since (then the parameters are stepped one by one again)."""
        native = (None if self.fused is False or self._fused_failed or torch._C._len_torch_dispatch_stack() > 0
                  or _has_step_hooks(optimizer) else compact_fused.native_kernel())
        if native is None or not many.run_(optimizer, native, self.seed, self.steps, multiplier, clip):
            del self._many[id(optimizer)]
            return False, None
        if not step_kwargs and "step" not in vars(optimizer):
            return True, None  # the call with empty groups below would do nothing
        return True, step_without_params(optimizer, **step_kwargs)  # as when the fused kernel stepped them one by one

    def _keep_many_(self, optimizer: Optimizer, pieces: list[Piece]) -> None:
        # After a step whose parameters were all fused: the C loop's arguments for all of them at once, where it
        # stepped them (on the CPU, outside a TorchDispatchMode, the kernel not failed).
        if (self._fused_failed or torch._C._len_torch_dispatch_stack() > 0
                or compact_fused.native_kernel() is None):
            return
        stepped = [(piece.group, piece.param, self._comp.get(cast(str, piece.name)) if self.mode == "kahan" else None,
                    self._crc_of(cast(str, piece.name))) for piece in pieces]
        many = ManyArgs.make(optimizer, stepped)
        if many is not None:
            self._many[id(optimizer)] = many

    def _pieces(self, optimizer: Optimizer) -> list[Piece]:
        non_castable = getattr(optimizer, "non_castable_tensor_keys", ())
        block = block_size(optimizer)
        sliceable = block is not None or type(optimizer) in ELEMENTWISE
        pieces: list[Piece] = []
        fusable_groups: dict[tuple[int, str], bool] = {}  # _fusable's per-group answers, for this step
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                grad = p.grad
                if grad is None:
                    continue
                name = self._names.get(id(p))
                if name is not None and p.dtype not in LOW:  # cast to FP32 since (a fallback): it holds it all
                    if name in self._comp:
                        self._comp[name].zero_()  # _recast_ moved it into the weight already
                    cast_state_(optimizer, p)
                    name = None
                if name is None:
                    if p.requires_grad and p.dtype in LOW and id(p) not in self._unnamed:
                        raise RuntimeError(
                            f"CompactWeights.step_: a {p.dtype} trainable parameter of shape {tuple(p.shape)} was"
                            " added to the optimizer, unfrozen or cast to 16 bits after binding; call"
                            " bind_new_(optimizer) first."
                        )
                    pieces.append(Piece(gi, p, None, 0, p.numel(), p.numel() * grad.element_size()))
                    continue
                numel = p.numel()
                # Adam's state as the fused kernel takes it (16-bit moments): 16 bytes of FP32 copies per element
                # should the kernel fail and the step fall back to stand-ins; nothing to cast or count first.
                whole = Piece(gi, p, name, 0, numel, numel * 16)
                if self._fusable(optimizer, whole, fusable_groups):
                    whole.fused = True
                    pieces.append(whole)
                    continue
                state = optimizer.state.get(p, {})
                sliced = (sliceable and p.is_contiguous() and grad.layout == torch.strided and grad.is_contiguous()
                          and (block is None or init_blockwise_(optimizer, p, state, block, gi, pi)))
                for key, value in state.items():  # e.g. loaded from an FP32 run: keep the invariant (16-bit)
                    if is_per_element(key, value, p, non_castable) and value.dtype != p.dtype:
                        state[key] = value.to(p.dtype)
                n_states = sum(is_per_element(k, v, p, non_castable) for k, v in state.items()) if state else 2
                per_element = 4 * (2 + n_states)
                whole = Piece(gi, p, name, 0, numel, numel * per_element)
                if self._fusable(optimizer, whole, fusable_groups):  # state cast to 16 bits just now (an FP32 load)
                    whole.fused = True
                elif sliced:
                    whole.per_element = per_element
                pieces.append(whole)
        return pieces

    def _step_fused_(
        self, optimizer: Optimizer, pieces: list[Piece], multiplier: torch.Tensor | float | None, clip: float | None
    ) -> tuple[list[Piece], bool]:
        """Step the parameters the fused kernel takes (:meth:`_pieces` leaves them whole: the kernel allocates
        nothing, so slices would only add calls); returns the other pieces, in order, and whether any was stepped."""
        fused = [piece for piece in pieces if piece.fused]
        if self._views and len(fused) < len(pieces):
            for piece in pieces:
                if not piece.fused:  # stepped otherwise now (cast to FP32, other state): its old tensors go
                    self._views.pop(id(piece.param), None)
        if not fused:
            return pieces, False
        self._fused = FusedAdam() if self._fused is None else self._fused
        # Per step, not per parameter: whether a TorchDispatchMode is on, the kernel's scalars (one small tensor per
        # group and step count, usually one per group).
        views = self._views
        on_device: dict[torch.device, list[Piece]] = {}
        key_of: dict[int, torch.Tensor] = {}
        on_cpu = [piece for piece in fused if piece.param.device.type == "cpu"]
        for piece, first in zip(on_cpu, self._keys(on_cpu)):  # each parameter's key tensor of the last step, refilled
            key_of[id(piece)] = fill_key(views, piece.param, first)
        for piece in fused:
            if piece.param.device.type != "cpu":
                on_device.setdefault(piece.param.device, []).append(piece)
        for device, group in on_device.items():
            key_of.update(zip(map(id, group), keys(self._keys(group), device)))
        eager = torch._C._len_torch_dispatch_stack() > 0
        # Once a step, not per parameter; looked up in its module, where a test stands the C loop aside.
        native = None if eager else compact_fused.native_kernel()
        scalars: dict[tuple[int, float, torch.device], tuple[torch.Tensor, bool]] = {}
        rest: list[Piece] = []
        steps: list[torch.Tensor] = []  # of the stepped parameters: counted up together at the end
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
            step = state["step"]
            key = (piece.group, step.item() + 1, p.device)
            if key not in scalars:
                options = optimizer.param_groups[piece.group]
                mult = multiplier_tensor(multiplier, p.device)
                scalars[key] = FusedAdam.scalars(options, key[1], mult, clip), FusedAdam.plain(options, clip)
            values, plain = scalars[key]
            comp = self._comp[piece.name] if self.mode == "kahan" else None  # type: ignore[index]
            grad = p.grad
            assert grad is not None  # _fusable marks a piece fused only when its gradient is there
            w, c, m, v = flat_views(views, p, comp, state["exp_avg"], state["exp_avg_sq"])
            try:
                self._fused.run_(
                    w, c, flat(grad), m, v, values, key_of[id(piece)], eager=eager, plain=plain, native=native
                )
            except Exception as error:  # compiling failed (no C++ compiler, an unsupported device...)
                _count_(steps)
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
                return rest + pieces[i:], bool(steps)
            steps.append(step)
            p.grad = None
        _count_(steps)
        return rest, True

    def _fusable(self, optimizer: Optimizer, piece: Piece, groups: dict[tuple[int, str], bool] | None = None) -> bool:
        """Whether the fused kernel can step ``piece``; ``groups`` caches the per-group answer (the optimizer's hooks,
        its type and the group's options) over one step's pieces."""
        p, grad = piece.param, piece.param.grad
        if (
            piece.name is None or p.dtype != torch.bfloat16 or p.numel() == 0 or not p.is_contiguous()
            or grad is None or grad.layout != torch.strided or not grad.is_contiguous() or grad.dtype != p.dtype
        ):
            return False
        where = (piece.group, p.device.type)
        group_ok = groups.get(where) if groups is not None else None
        if group_ok is None:
            group_ok = not (
                self.fused is False or self._fused_failed
                or _has_step_hooks(optimizer)  # they must see the step inside optimizer.step(), on its parameters
                or (p.device.type != "cpu" and self.fused is not True)
                or not FusedAdam.eligible(optimizer, optimizer.param_groups[piece.group], p.device)
            )
            if groups is not None:
                groups[where] = group_ok
        if not group_ok:
            return False
        state = optimizer.state.get(p, {})
        if not state:
            return True
        if state.keys() != _ADAM_KEYS or not isinstance(state["step"], torch.Tensor):
            return False
        step, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
        return (
            step.device.type == "cpu" and step.numel() == 1
            and type(m) is torch.Tensor and m.dtype == p.dtype and m.shape == p.shape and m.is_contiguous()
            and type(v) is torch.Tensor and v.dtype == p.dtype and v.shape == p.shape and v.is_contiguous()
        )

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
                key: piece.view(v).to(torch.float32, copy=True) if is_per_element(key, v, p, non_castable)
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
                if is_per_element(key, v, proxy, non_castable):
                    dst = state.get(key)
                    if type(dst) is not torch.Tensor or dst.dtype != p.dtype or dst.shape != p.shape:
                        dst = state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    self._round_(piece.view(dst), v, piece, noise)
                elif piece.start == 0 and (piece.whole or not isinstance(v, torch.Tensor) or v.dim() == 0):
                    state[key] = v  # per-parameter scalars: every slice computes the same ones
        if piece.stop == p.numel():
            p.grad = None

    def _round_(self, dst: torch.Tensor, src: torch.Tensor, piece: Piece, noise: list[torch.Tensor]) -> None:
        """Stochastic rounding of ``src`` (overwritten) into ``dst``. The random numbers are
        :func:`~lit_mpstable.core.weights.compact_fused.noise_bits` of (seed, steps, parameter, element) and shared by
        the weight
        and its state tensors: each is rounded without bias, for a third of the random numbers; their errors at one
        element are correlated, which changes only second-order terms (the ratio m / sqrt(v) even gains)."""
        if not noise:
            noise.append(noise_bits(src.numel(), self._keys([piece])[0] + piece.start, src.device, piece.param.dtype))
        round_stochastic_(dst, src, noise[0])

    def _keys(self, pieces: list[Piece]) -> list[int]:
        # Hash of (seed, steps, parameter name): the random key of each piece's parameter's element 0 at this step.
        return step_keys(self.seed, self.steps, [self._crc_of(cast(str, piece.name)) for piece in pieces])

    def _crc_of(self, name: str) -> int:
        crc = self._crc.get(name)
        if crc is None:
            crc = self._crc[name] = zlib.crc32(name.encode())
        return crc

    # --------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, object]:
        """``mode``, ``seed``, ``steps`` (the random keys) and ``compensation`` (``{parameter name: tensor}``, empty
        for ``"stochastic"``); plain values and tensors only, so ``torch.load(weights_only=True)`` reads it.

        The tensors share storage with the compensations (detached, not copied): clone them for an in-memory
        snapshot that later steps must not change. The weights and optimizer state are in the model's and the
        optimizers' own state dicts.
        """
        state: dict[str, object] = {
            "mode": self.mode, "seed": self.seed, "steps": self.steps,
            "compensation": {name: comp.detach() for name, comp in self._comp.items()},
        }
        if self.moments is not None:  # BF16/FP8 moments: their state under "optimizer_state"
            state[KEY] = self.moments.state_dict()
        return state

    @torch.no_grad()
    def _load_(self, state: StateDict) -> None:
        """:meth:`load_state_dict`: restore :meth:`state_dict`'s values (load the model's weights from the same
        checkpoint).

        Raises:
            KeyError: a key or parameter name is missing or unknown (each one is listed).
            ValueError: the mode or a tensor's shape differs, or the checkpoint and this object disagree on BF16/FP8
                moments.
        """
        state, moments = split_moments("CompactKeeper", state, self.moments)
        self._many.clear()
        check_keys("", {"mode", "seed", "steps", "compensation"}, set(state), "a different lit_mpstable version?")
        if state["mode"] != self.mode:
            raise ValueError(
                f"CompactWeights.load_state_dict: saved with mode={state['mode']!r}, this object has"
                f" mode={self.mode!r}; build it with the saved mode, or call zero_compensation_() instead of loading."
            )
        comp = state["compensation"]
        check_keys(
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
        if self.moments is not None:
            self.moments.load_state_dict(moments)

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
            "params_16bit": nbytes(p for p in params if p.dtype in LOW),
            "compensation": nbytes(self._comp.values()),
            "grads": nbytes(p.grad for p in params if p.grad is not None),
            "optimizer_state": nbytes(state.values()),
            "params_fp32_other": nbytes(p for p in params if p.dtype not in LOW and p.requires_grad),
        }
        report["total"] = sum(report.values())
        return report

    # ----------------------------------------------------------------------------- the weight keeper's step
    def adopt_optimizer_(self, optimizer: Optimizer) -> None:
        pass  # bound at its first unscale_ (bind_new_ is cheap and runs every step)

    @torch.no_grad()
    def _replicate_(self, replicas: ProcessGroup | None) -> list[str]:
        """:meth:`follow_model_weights_`: the weights are the model's own: nothing to follow. ``replicas``: the
        process group of DDP replicas: the compensation and the seed of stochastic rounding (weights, optimizer state,
        BF16/FP8 moments) are taken from its first rank, so every replica rounds alike. The compensation of a DTensor
        parameter (FSDP2) is each rank's own shard, no replica, and stays."""
        if replicas is not None:
            broadcast_([comp for _, _, comp in sorted(self.named_buffers(), key=lambda item: item[0])
                        if comp is not None and not isinstance(comp, DTensor)], replicas)
            device = next((p.device for p in self._model.parameters()), torch.device("cpu"))
            self.seed = agree_seed(self.seed, replicas, device)
            if self.moments is not None:
                self.moments.reseed_(self.seed)
        return []

    def unscale_(self, optimizer: Optimizer, checker: LossScaler | None,
                 scaler: object, device: torch.device | str) -> None:
        """Bind what is new, check the gradients without unscaling them (``check_``) and keep the unscale factor for
        the step's FP32 chunks."""
        self.bind_new_(optimizer)
        if self.moments is not None:
            self.moments.bind_(optimizer, {id(p): name for name, p in self._model.named_parameters()})
        super().unscale_(optimizer, checker, scaler, device)  # checks only: the gradients stay scaled
        multiplier: torch.Tensor | None = None
        if checker is not None and isinstance(scaler, DynamicLossScaler):
            multiplier = scaler.get_scale_tensor().reciprocal()
        self._pending[id(optimizer)] = [multiplier, None]

    def _clip_norm_(self, optimizer: Optimizer, max_norm: float | torch.Tensor, norm_type: float,
                    total_norm: torch.Tensor | None) -> torch.Tensor:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        pending = self._pending[id(optimizer)]
        multiplier = pending[0] if pending[0] is not None else torch.ones((), device=grads[0].device if grads else None)
        if not grads:
            return torch.zeros(())
        if total_norm is not None:  # a SpikeGuard's norm of the same gradients, times the same multiplier
            norm = total_norm
        else:
            per_tensor = grad_norms(grads, norm_type)
            norm = torch.linalg.vector_norm(torch.stack(per_tensor), norm_type) * multiplier  # true gradients, FP32
        # clip_grad_norm_'s rule, as a factor for the step's FP32 chunks: no host sync.
        coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        pending[0] = multiplier * coefficient
        return norm

    def _clip_value_(self, optimizer: Optimizer, clip_value: float) -> None:
        pending = self._pending[id(optimizer)]
        if clip_value != clip_value:  # NaN: torch's clamp makes every gradient NaN, so the step is skipped (the check
            # of the pending factor sees it), as in the other weight modes
            device = first_grad_device(optimizer)
            pending[0] = (pending[0] if pending[0] is not None else torch.ones((), device=device)) * float("nan")
            return
        pending[1] = float(clip_value) if pending[1] is None else min(pending[1], float(clip_value))

    def _update(self, optimizer: Optimizer, kwargs: Kwargs) -> Callable[[], object]:
        multiplier, clip = self._pending.pop(id(optimizer), [None, None])

        def update() -> object:
            if self.keeps_stepped_grads:  # references, no copy: each path of the step reads a gradient, never writes it
                self._stepped.update((id(p), (p.grad, multiplier, clip)) for group in optimizer.param_groups
                                     for p in group["params"] if p.grad is not None)
            if self.moments is not None:
                return self._moment_step_(optimizer, multiplier, clip, kwargs)
            return self.step_(optimizer, grad_multiplier=multiplier, clip_value=clip, **kwargs)

        return update

    def take_stepped_grads(self) -> dict[int, torch.Tensor]:
        """The gradients the steps since :attr:`keeps_stepped_grads` was set stepped with, as the step saw them (FP32,
        unscaled and clipped), by parameter id; then stops keeping them. Empty where nothing was kept (a skipped
        step). One FP32 copy of the kept gradients, on the logging step only."""
        stepped, self._stepped, self.keeps_stepped_grads = self._stepped, {}, False
        return {key: transform(grad.to(torch.float32, copy=True), multiplier, clip)
                for key, (grad, multiplier, clip) in stepped.items()}

    def _done_(self, optimizer: Optimizer, *, stepped: bool) -> None:
        self._pending.pop(id(optimizer), None)  # a dropped step's factors

    @torch.no_grad()
    def _moment_step_(self, optimizer: Optimizer, multiplier: torch.Tensor | None, clip: float | None,
                      kwargs: Kwargs) -> object:
        """The step with BF16/FP8 moments: per parameter, its FP32 value (Kahan: plus the compensation) is stepped
        with the FP32 gradient (unscaled, clipped) and rounded back as :meth:`CompactWeights.step_` rounds."""
        moments = self.moments
        assert moments is not None
        self.steps += 1  # the weights' random keys advance as with the optimizer's step

        def update(p: torch.Tensor, name: str, step_fn: Callable[[torch.Tensor, torch.Tensor], object]) -> None:
            assert p.grad is not None  # update() runs on the parameters that have a gradient
            grad = transform(p.grad.to(torch.float32, copy=True), multiplier, clip)
            p.grad = None
            if p.dtype not in LOW:  # an FP32 island, or cast to FP32 by a fallback: stepped in place
                comp = self._comp.get(name)
                if comp is not None:
                    comp.zero_()  # _recast_ moved it into the weight already
                step_fn(p.data, grad)
                return
            value = p.detach().to(torch.float32, copy=True)
            comp = self._comp.get(name)
            if comp is not None:
                value.add_(comp)
            step_fn(value, grad)
            weight = p.detach()
            if comp is not None:
                weight.copy_(value)  # round to nearest; the residual is exact in FP32
                comp.copy_(value.sub_(weight))
            else:
                self._round_(weight, value, Piece(0, cast(nn.Parameter, p), name, 0, p.numel(), 0), [])

        return moments.step_(optimizer, {id(p): name for name, p in self._model.named_parameters()}, update, **kwargs)

    def grads(self, optimizer: Optimizer, *, absorb: bool = False) -> GradView:
        """The model's gradients, scaled and 16-bit, with the unscale (and clip) factor the step still owes them;
        nothing is written elsewhere, so there is nothing to absorb."""
        pending = self._pending.get(id(optimizer))
        return GradView([p for group in optimizer.param_groups for p in group["params"]],
                        pending[0] if pending else None)

    def fp32_weights(self) -> dict[str, torch.Tensor]:
        """A Kahan weight is its 16-bit part plus its compensation; stochastic rounding keeps nothing more."""
        return {name: p.detach().float() + c.float() for name, p, c in self.named_buffers() if c is not None}

    def state_tensors(self) -> list[torch.Tensor]:
        comp = [c for _, _, c in self.named_buffers() if c is not None]
        return comp + (self.moments.tensors() if self.moments is not None else [])

    def _precise(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return {}, dict(self._comp)


# ------------------------------------------------------------------------------------------------- the pieces' rules
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

def split_pieces(pieces: list[Piece], base: int, cap: int, freed: int) -> Iterator[list[Piece]]:
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
    optimizer: Optimizer, p: torch.Tensor, state: dict[str, object], block: int, group_index: int, index: int
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
    optimizer: Optimizer, p: torch.Tensor, state: dict[str, object], group: dict[str, Any], group_index: int, index: int
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


_ADAM_KEYS = frozenset(("step", "exp_avg", "exp_avg_sq"))  # the state torch's Adam keeps without amsgrad


def _has_step_hooks(optimizer: Optimizer) -> bool:
    # The optimizer's own step pre/post hooks and the global ones (torch.optim.optimizer.register_optimizer_step_*).
    module = _optimizer_module
    return bool(
        getattr(optimizer, "_optimizer_step_pre_hooks", None) or getattr(optimizer, "_optimizer_step_post_hooks", None)
        or getattr(module, "_global_optimizer_pre_hooks", None) or getattr(module, "_global_optimizer_post_hooks", None)
    )


def _count_(steps: list[torch.Tensor]) -> None:
    # Each stepped parameter's step counter + 1, in one call (they are 0-d CPU tensors, FP32 or FP64).
    if steps:
        torch._foreach_add_(steps, 1)

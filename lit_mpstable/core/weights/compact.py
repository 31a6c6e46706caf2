"""16-bit weights that train like FP32 ones: Kahan-compensated or stochastically rounded updates, 16-bit state."""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, cast, get_args

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lit_mpstable.base.notes import Notes
from lit_mpstable.core.replicas import agree_seed, broadcast_
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler
from lit_mpstable.core.scaling.scalers import LossScaler
from lit_mpstable.core.tensors import grad_norms
from lit_mpstable.core.weights.carry import carry_precise_state_
from lit_mpstable.core.weights.compact_fused import FusedAdam, FusedSteps
from lit_mpstable.core.weights.compact_rounding import mix, noise_bits, round_stochastic_
from lit_mpstable.core.weights.compact_slices import (
    ELEMENTWISE,
    LOW,
    Piece,
    StandIns,
    block_size,
    budget,
    cast_state_,
    check_keys,
    init_blockwise_,
    transform,
)
from lit_mpstable.core.weights.compact_slices import chunks as split_chunks
from lit_mpstable.core.weights.compact_slices import memory_report as compact_memory
from lit_mpstable.core.weights.compact_slices import per_element as is_per_element
from lit_mpstable.core.weights.keeper_steps import GradView, clip_either_, first_grad_device, step_checked
from lit_mpstable.core.weights.moment_keeper import KEY, AdamMoments, split_moments

_Piece = Piece  # the old private name (tests build pieces by it)

CompactMode = Literal["kahan", "stochastic"]
_MODES: tuple[str, ...] = get_args(CompactMode)


class CompactWeights(FusedSteps, StandIns):
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
    low-bit Adams (torchao's ``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8`` and their Adam forms; bitsandbytes'
    ``AdamW8bit`` and ``Adam8bit``: slices on their quantization blocks, whose states they update in place) step large
    parameters in slices, others whole parameters. FP32 parameters (FP32 islands), frozen and unnamed ones are
    stepped as they are.

    Random numbers are a function of ``(seed, steps, parameter name, element)``: independent of the chunking and the
    device, and repeated exactly by a resumed or rolled-back run.

    ``fused``: exact ``torch.optim.Adam``/``AdamW`` groups (no ``amsgrad``) on BF16 parameters skip the FP32
    stand-ins: one kernel compiled by ``torch.compile`` per parameter reads each 16-bit tensor once, does the same
    arithmetic in registers and allocates nothing (:mod:`lit_mpstable.core.weights.compact_fused`; the same random
    numbers, results
    equal to the stand-ins' to FP32 rounding). ``None`` (default): on the CPU, falling back to the stand-ins with a
    warning if compiling fails; ``True``: on any device (inductor's GPU kernels are not measured by this project
    yet), and a failure to compile raises; ``False``: never (no compiler needed). The first fused step of a run
    compiles (18-20 s on a 2-core CPU, ~6 s from inductor's disk cache). An optimizer with step hooks (its own or
    global ones) is not fused: its hooks see the step inside ``optimizer.step()``, on the stand-ins.

    As the :class:`~lit_mpstable.core.weights.weights.WeightKeeper` of ``master_weights="kahan"``/``"stochastic"``
    (:meth:`unscale_` ... :meth:`checked_step_`), the gradients stay as they are (scaled, 16-bit) until the FP32
    chunks of the step unscale them: the check at :meth:`unscale_` only looks (``check_``), and the unscale and clip
    factors wait per optimizer until the step (the 16-bit gradients are not rounded twice). With
    ``optimizer_state="bf16"``/``"fp8"`` exact Adam/AdamW groups are stepped one whole parameter at a time through
    :class:`~lit_mpstable.core.weights.moment_keeper.AdamMoments` (FP32 copy of the weight, plus its compensation,
    stepped and rounded back) instead of the optimizer's step on FP32 stand-ins.

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
        self._views: dict[int, Any] = {}  # per parameter: the fused kernel's flat views and random key tensor
        self._crc: dict[str, int] = {}  # per parameter name: its CRC-32, part of every random key
        self._before: dict[int, dict[Any, Any]] = {}  # during step_: each parameter's state before it
        for optimizer in optimizers:
            if all(optimizer is not o for o in self._optimizers):
                self.bind_new_(optimizer)
        self._pending: dict[int, list[Any]] = {}  # per optimizer this iteration: [multiplier, clip value]
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
    def follow_recast_(self, changed: Sequence[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """Carry the state of parameters a precision fallback or restore cast in place (``(parameter, its data
        before)``): into FP32, a Kahan parameter takes its compensation (``w + comp``: the value the run held) and
        the compensation is zeroed; back into 16 bits, the compensation takes the rounding residual; per-element
        optimizer state follows the parameter's dtype (Adam's ``lerp_`` refuses mixed dtypes)."""
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
        rest, fused = self._step_fused_(optimizer, pieces, grad_multiplier, clip_value)
        chunks: list[list[Piece]] = []
        if rest:  # chunks grow by the gradient bytes the fused step dropped (of the parameter's size and dtype)
            freed = sum(piece.param.numel() * piece.param.element_size() for piece in pieces
                        if piece.fused and piece.param.grad is None)
            base, cap = budget(self.chunk_bytes, rest[0].param.device, optimizer)
            chunks = list(split_chunks(rest, base, cap, freed))
        for chunk in chunks or ([[]] if fused else []):  # fused alone: one call for the hooks (empty groups)
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

    def _pieces(self, optimizer: Optimizer) -> list[Piece]:
        non_castable = getattr(optimizer, "non_castable_tensor_keys", ())
        block = block_size(optimizer)
        sliceable = block is not None or type(optimizer) in ELEMENTWISE
        pieces: list[Piece] = []
        fusable_groups: dict[Any, bool] = {}  # _fusable's per-group answers, for this step
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                grad = p.grad
                if grad is None:
                    continue
                name = self._names.get(id(p))
                if name is not None and p.dtype not in LOW:  # cast to FP32 since (a fallback): it holds it all
                    if name in self._comp:
                        self._comp[name].zero_()  # follow_recast_ moved it into the weight already
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

    def _chunks(self, pieces: list[Piece], base: int, cap: int, freed: int) -> Iterator[list[Piece]]:
        return split_chunks(pieces, base, cap, freed)

    def _round_(self, dst: torch.Tensor, src: torch.Tensor, piece: Piece, noise: list[torch.Tensor]) -> None:
        """Stochastic rounding of ``src`` (overwritten) into ``dst``. The random numbers are
        :func:`~lit_mpstable.core.weights.compact_fused.noise_bits` of (seed, steps, parameter, element) and shared by
        the weight
        and its state tensors: each is rounded without bias, for a third of the random numbers; their errors at one
        element are correlated, which changes only second-order terms (the ratio m / sqrt(v) even gains)."""
        if not noise:
            noise.append(noise_bits(src.numel(), self._key(piece) + piece.start, src.device, piece.param.dtype))
        round_stochastic_(dst, src, noise[0])

    def _key(self, piece: Piece) -> int:
        # Hash of (seed, steps, parameter name): the random key of the parameter's element 0 at this step.
        crc = self._crc.get(piece.name)  # type: ignore[arg-type]
        if crc is None:
            crc = self._crc[piece.name] = zlib.crc32(piece.name.encode())  # type: ignore[index,union-attr]
        return mix(self.seed, self.steps, crc)

    # --------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """``mode``, ``seed``, ``steps`` (the random keys) and ``compensation`` (``{parameter name: tensor}``, empty
        for ``"stochastic"``); plain values and tensors only, so ``torch.load(weights_only=True)`` reads it.

        The tensors share storage with the compensations (detached, not copied): clone them for an in-memory
        snapshot that later steps must not change. The weights and optimizer state are in the model's and the
        optimizers' own state dicts.
        """
        state: dict[str, Any] = {
            "mode": self.mode, "seed": self.seed, "steps": self.steps,
            "compensation": {name: comp.detach() for name, comp in self._comp.items()},
        }
        if self.moments is not None:  # BF16/FP8 moments: their state under "optimizer_state"
            state[KEY] = self.moments.state_dict()
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values (load the model's weights from the same checkpoint).

        Raises:
            KeyError: a key or parameter name is missing or unknown (each one is listed).
            ValueError: the mode or a tensor's shape differs, or the checkpoint and this object disagree on BF16/FP8
                moments.
        """
        state, moments = split_moments("CompactKeeper", state, self.moments)
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
        """Bytes held by training state, by kind (:func:`~lit_mpstable.core.weights.compact_slices.memory_report`):
        ``params_16bit``, ``compensation``, ``grads``, ``optimizer_state``, ``params_fp32_other``, ``total``."""
        return compact_memory(self._model, self._optimizers, list(self._comp.values()))

    # ----------------------------------------------------------------------------- the weight keeper's step
    def adopt_optimizer_(self, optimizer: Optimizer) -> None:
        pass  # bound at its first unscale_ (bind_new_ is cheap and runs every step)

    @torch.no_grad()
    def follow_model_weights_(self, replicas: ProcessGroup | None = None) -> list[str]:
        """The weights are the model's own: nothing to follow. ``replicas``: the process group of DDP replicas: the
        compensation and the seed of stochastic rounding (weights, optimizer state, BF16/FP8 moments) are taken from
        its first rank, so every replica rounds alike."""
        if replicas is not None:
            weights = self
            broadcast_([comp for _, _, comp in sorted(weights.named_buffers(), key=lambda item: item[0])
                        if comp is not None], replicas)
            device = next((p.device for p in self._model.parameters()), torch.device("cpu"))
            weights.seed = agree_seed(weights.seed, replicas, device)
            if self.moments is not None:
                self.moments.reseed_(weights.seed)
        return []

    def unscale_(self, optimizer: Optimizer, checker: LossScaler | None,
                 scaler: object, device: torch.device | str) -> None:
        self.bind_new_(optimizer)
        if self.moments is not None:
            self.moments.bind_(optimizer, {id(p): name for name, p in self._model.named_parameters()})
        multiplier: torch.Tensor | None = None
        if checker is not None:
            checker.check_grads_(optimizer, first_grad_device(optimizer) or device, unscale=False)
            if isinstance(scaler, DynamicLossScaler):
                multiplier = scaler.get_scale_tensor().reciprocal()
        self._pending[id(optimizer)] = [multiplier, None]

    def absorb_grads_(self, optimizer: Optimizer) -> None:
        pass

    def clip_grad_norm_(
        self, optimizer: Optimizer, max_norm: float, norm_type: float, total_norm: torch.Tensor | None = None
    ) -> torch.Tensor:
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

    def clip_grad_value_(self, optimizer: Optimizer, clip_value: float) -> None:
        pending = self._pending[id(optimizer)]
        if clip_value != clip_value:  # NaN: torch's clamp makes every gradient NaN, so the step is skipped (the check
            # of the pending factor sees it), as in the other weight modes
            device = first_grad_device(optimizer)
            pending[0] = (pending[0] if pending[0] is not None else torch.ones((), device=device)) * float("nan")
            return
        pending[1] = float(clip_value) if pending[1] is None else min(pending[1], float(clip_value))

    def expose_grads_(self, optimizer: Optimizer) -> None:
        pass

    def clip_(self, optimizer: Optimizer, *, max_norm: float | torch.Tensor | None = None, norm_type: float = 2.0,
              clip_value: float | None = None, total_norm: torch.Tensor | None = None) -> torch.Tensor | None:
        return clip_either_(self.clip_grad_norm_, self.clip_grad_value_, optimizer, max_norm, norm_type, clip_value,
                            total_norm)

    def end_step_(self, optimizer: Optimizer, checker: LossScaler | None,
                  step_kwargs: dict[str, Any] | None) -> tuple[Any, bool]:
        """Step (``step_kwargs``: the optimizer's keyword arguments) or, with None, drop this iteration's gradients."""
        if step_kwargs is None:
            self.drop_(optimizer)
            return None, True
        return self.checked_step_(optimizer, checker, **step_kwargs)

    def grads(self, optimizer: Optimizer, *, absorb: bool = False) -> GradView:
        return GradView(self.grad_holders(optimizer), self.grad_multiplier(optimizer))

    def checked_step_(self, optimizer: Optimizer, checker: LossScaler | None, **kwargs: Any) -> tuple[Any, bool]:
        multiplier, clip = self._pending.pop(id(optimizer), [None, None])
        weights = self
        update = lambda: weights.step_(optimizer, grad_multiplier=multiplier, clip_value=clip, **kwargs)  # noqa: E731
        if self.moments is not None:
            update = lambda: self._moment_step_(optimizer, multiplier, clip, kwargs)  # noqa: E731
        return step_checked(optimizer, checker, update, kwargs)

    @torch.no_grad()
    def _moment_step_(self, optimizer: Optimizer, multiplier: torch.Tensor | None, clip: float | None,
                      kwargs: dict[str, Any]) -> Any:
        """The step with BF16/FP8 moments: per parameter, its FP32 value (Kahan: plus the compensation) is stepped
        with the FP32 gradient (unscaled, clipped) and rounded back as :meth:`CompactWeights.step_` rounds."""
        weights, moments = self, self.moments
        assert moments is not None
        weights.steps += 1  # the weights' random keys advance as with the optimizer's step

        def update(p: torch.Tensor, name: str, step_fn: Callable[[torch.Tensor, torch.Tensor], object]) -> None:
            assert p.grad is not None  # update() runs on the parameters that have a gradient
            grad = transform(p.grad.to(torch.float32, copy=True), multiplier, clip)
            p.grad = None
            if p.dtype not in LOW:  # an FP32 island, or cast to FP32 by a fallback: stepped in place
                comp = weights._comp.get(name)
                if comp is not None:
                    comp.zero_()  # follow_recast_ moved it into the weight already
                step_fn(p.data, grad)
                return
            value = p.detach().to(torch.float32, copy=True)
            comp = weights._comp.get(name)
            if comp is not None:
                value.add_(comp)
            step_fn(value, grad)
            weight = p.detach()
            if comp is not None:
                weight.copy_(value)  # round to nearest; the residual is exact in FP32
                comp.copy_(value.sub_(weight))
            else:
                weights._round_(weight, value, Piece(0, cast(nn.Parameter, p), name, 0, p.numel(), 0), [])

        return moments.step_(optimizer, {id(p): name for name, p in self._model.named_parameters()}, update, **kwargs)

    def drop_(self, optimizer: Optimizer) -> None:
        self._pending.pop(id(optimizer), None)

    def grad_multiplier(self, optimizer: Optimizer) -> torch.Tensor | None:
        """The unscale factor the step still owes the 16-bit gradients (None: nothing pending)."""
        pending = self._pending.get(id(optimizer))
        return pending[0] if pending else None

    def grad_holders(self, optimizer: Optimizer) -> list[torch.Tensor]:
        return [p for group in optimizer.param_groups for p in group["params"]]

    def fp32_weights(self) -> dict[str, torch.Tensor]:
        """A Kahan weight is its 16-bit part plus its compensation; stochastic rounding keeps nothing more."""
        return {name: p.detach().float() + c.float() for name, p, c in self.named_buffers() if c is not None}

    def state_tensors(self) -> list[torch.Tensor]:
        comp = [c for _, _, c in self.named_buffers() if c is not None]
        return comp + (self.moments.tensors() if self.moments is not None else [])

    def carry_(self, module: nn.Module, masters: dict[str, Any], compact: dict[str, Any], *, saved: str,
               target: str) -> str | None:
        return carry_precise_state_(module, masters, compact, master=None, compact_weights=self, saved=saved,
                                    target=target)


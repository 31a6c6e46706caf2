"""One compiled pass per parameter for CompactWeights' Adam and AdamW steps, instead of FP32 copies of everything.

The generic path (:class:`~lit_mpstable.core.weights.compact.CompactWeights` stepping FP32 stand-ins) reads and writes
each tensor several times and runs the optimizer's own ~10 passes in FP32. Here one kernel, compiled by
``torch.compile`` (inductor), reads the 16-bit weight, compensation, gradient and moments once, does torch's Adam
arithmetic in FP32 (the same operations in the same order), and writes them back: the weight and its compensation
rounded to nearest (``"kahan"``) or the weight stochastically rounded (``"stochastic"``), the moments stochastically
rounded. The random bits are :func:`hash32` of the element index and a per-step key, the very numbers the generic
path draws, and the rounding is its rounding but for ties (``compact_adam._round_stochastic_bf16``). The arithmetic
lives in :mod:`~lit_mpstable.core.weights.compact_adam`; here: when it runs, on what, and how it is compiled. Nothing is
allocated.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from lit_mpstable.core.compiled import graph_count, own_graphs_since
from lit_mpstable.core.weights import compact_native
from lit_mpstable.core.weights.compact_adam import _adam_kernel, _adam_plain_kernel
from lit_mpstable.core.weights.compact_rounding import _signed32
from lit_mpstable.core.weights.compact_slices import Piece
from lit_mpstable.core.weights.compact_views import KernelArgs, fill_key, flat, flat_views


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small CPU ``tensor`` on ``device`` without waiting for the device: a copy from pinned memory, queued (a copy
    from pageable memory waits for the work queued before it)."""
    if device.type == "cpu":
        return tensor
    try:
        tensor = tensor.pin_memory()
    except RuntimeError:  # no pinning on this machine: a plain copy
        pass
    return tensor.to(device, non_blocking=True)


_LOOK_UP = object()  # FusedAdam.run_'s default: look the C loop up and check every input

class FusedAdam:
    """The compiled step of one BF16 parameter for exact ``torch.optim.Adam``/``AdamW`` groups.

    :meth:`eligible` says whether a group can take it (no ``amsgrad``, ``capturable``, ``differentiable``; no
    ``fused`` group off the CPU, whose ``step`` torch keeps on the device); :meth:`step_` runs it. The kernel is
    compiled per mode, with dynamic sizes: learning-rate schedules, steps and parameter sizes cause no recompilation
    (one-element parameters and gradients that are views at an offset into a larger buffer get their own variant).
    Steps without a clip value or Adam's L2 term (AdamW, Adam without weight decay) take a second kernel that leaves
    both out (:meth:`plain`): the same values; a run that clips by value, or mixes the two, compiles both.
    """

    # A call this long compiled (a warm call takes microseconds to milliseconds; the first call of a run traces and
    # loads the kernel from inductor's disk cache in ~6 s on a 2-core CPU, compiles it cold in 18-20 s): said once.
    SLOW_S = 15.0

    def __init__(self) -> None:
        options: dict[str, str | int | bool | Callable[..., Any]] = {"emulate_precision_casts": True}
        self._kernel: Callable[..., None] = torch.compile(_adam_kernel, dynamic=True, fullgraph=True, options=options)
        self._plain_kernel: Callable[..., None] = torch.compile(
            _adam_plain_kernel, dynamic=True, fullgraph=True, options=options
        )  # compiled at its first call, as the other
        self._said_slow = False

    @staticmethod
    def eligible(optimizer: torch.optim.Optimizer, group: dict[str, Any], device: torch.device) -> bool:
        return (
            type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
            and not group.get("amsgrad", False) and not group.get("capturable", False)
            and not (group.get("fused", False) and device.type != "cpu")
            and not group.get("differentiable", False)
        )

    @staticmethod
    def scalars(
        group: dict[str, Any], step: float, multiplier: torch.Tensor, clip: float | None
    ) -> torch.Tensor:
        """The kernel's scalars for one parameter at optimizer step ``step`` (already incremented), computed in
        Python floats as torch's single-tensor Adam does; ``multiplier`` is a 0-d FP32 tensor (no host read)."""
        lr = float(group["lr"])
        beta1, beta2 = (float(b) for b in group["betas"])
        weight_decay, eps = float(group["weight_decay"]), float(group["eps"])
        decoupled = bool(group.get("decoupled_weight_decay", False))
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        values = torch.tensor([
            -1.0 if group.get("maximize", False) else 1.0, float("inf") if clip is None else float(clip),
            (1 - lr * weight_decay) if decoupled else 1.0, 0.0 if decoupled else weight_decay,
            1 - beta1, beta2, 1 - beta2, bias_correction2**0.5, eps, -(lr / bias_correction1),
        ], dtype=torch.float32)
        values = host_to_device(values, multiplier.device)
        values[0] *= multiplier
        return values

    def step_(
        self, w: torch.Tensor, comp: torch.Tensor | None, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
        scalars: torch.Tensor, offset: int,
    ) -> None:
        """Step flat tensors in place: ``w`` and ``comp`` (``None`` for ``"stochastic"``), moments ``m`` and ``v``,
        from gradient ``g`` (:meth:`scalars` says the rest); ``offset`` is the random key of the first element.
        Nothing is allocated: every value lives in the kernel's registers."""
        key = host_to_device(torch.tensor(_signed32(offset), dtype=torch.int32), w.device)
        self.run_(w, comp, g, m, v, scalars, key, eager=torch._C._len_torch_dispatch_stack() > 0)

    @staticmethod
    def plain(group: dict[str, Any], clip: float | None) -> bool:
        """Whether a step of ``group`` with clip value ``clip`` has neither a clip nor Adam's L2 term (AdamW, or Adam
        without weight decay): the kernel's graph without them (the same values, ~8% faster)."""
        return clip is None and (bool(group.get("decoupled_weight_decay", False)) or float(group["weight_decay"]) == 0)

    def run_(
        self, w: torch.Tensor, comp: torch.Tensor | None, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
        scalars: torch.Tensor, key: torch.Tensor, *, eager: bool, plain: bool = False, native: Any = _LOOK_UP,
    ) -> None:
        """:meth:`step_` with the key as a 0-d int32 tensor on ``w``'s device (:func:`keys` makes a step's keys in one
        transfer). ``eager``: run the kernel uncompiled, as under a TorchDispatchMode (see :meth:`step_`); ``plain``:
        scalars without a clip (inf) or an L2 term (0) (:meth:`plain`), for the graph that leaves them out.
        ``native``: the C loop (:func:`compact_native.kernel`, None: none) as :class:`FusedSteps` looks it up once a
        step, for tensors its ``_fusable`` checked (dtypes, shapes, contiguity); by default it is looked up here and
        every input checked (:func:`compact_native.takes`, ~10 us a call)."""
        # Under a TorchDispatchMode (a FLOP counter, a tracer, a recorder of host reads) torch.compile skips the frame
        # and marks the kernel's code skipped for the rest of the process: every later CompactWeights would fall back
        # to FP32 copies. The eager kernel (what torch.compile runs itself under a mode) leaves the compiler's state
        # alone and lets the mode see every operation; its words are the compiled ones but for an FP32 ulp now and then.
        if eager:
            (_adam_plain_kernel if plain else _adam_kernel)(w, comp, g, m, v, scalars, key)
            return
        if w.is_cpu:  # the C loop where it builds: the same words, ~2-4x faster than inductor's C++
            if native is _LOOK_UP:
                native = compact_native.kernel()
                usable = native is not None and compact_native.takes(w, comp, g, m, v, scalars, key)
            else:  # what _fusable leaves open: a tensor subclass (a DTensor) or state on another device
                usable = native is not None and type(w) is torch.Tensor and type(g) is torch.Tensor and (
                    g.is_cpu and m.is_cpu and v.is_cpu and (comp is None or (comp.is_cpu and comp.is_contiguous()))
                )
            if usable:
                native(w, comp, g, m, v, scalars, key, plain)
                return
        start = time.perf_counter()
        before = graph_count()  # graphs compiled by this call are ours, not the user's model's
        try:
            (self._plain_kernel if plain else self._kernel)(w, comp, g, m, v, scalars, key)
        finally:
            own_graphs_since(before)
        elapsed = time.perf_counter() - start
        if elapsed > self.SLOW_S and not self._said_slow:
            self._said_slow = True
            if _first_to_say(_SLOW_MARKER):
                warnings.warn(
                    f"lit_mpstable: the first fused Adam step of master_weights='kahan'/'stochastic' took"
                    f" {elapsed:.0f} s: inductor compiled its kernel and keeps it in its disk cache; each new process"
                    " still loads it at its first step (13-28 s measured per process on a loaded machine). Said once"
                    " per cache (a sweep's other jobs stay quiet);"
                    " lit_mpstable.core.weights.compact.CompactWeights(fused=False) steps without compiling.",
                    stacklevel=4,
                )


def keys(offsets: list[int], device: torch.device) -> list[torch.Tensor]:
    """The random keys ``offsets`` as 0-d int32 tensors on ``device``, each with its own storage: a key that is a
    view (an element of one tensor of keys) would make the compiled kernel guard on the number of keys, compiling
    again for each new count of parameters."""
    return [host_to_device(torch.tensor(_signed32(o), dtype=torch.int32), device) for o in offsets]


class FusedSteps:
    """The fused-kernel part of :class:`~lit_mpstable.core.weights.compact.CompactWeights` (a mixin: it reads the
    weights' mode, compensation buffers and random keys)."""

    fused: bool | None
    mode: str
    _fused: FusedAdam | None
    _fused_failed: bool
    _comp: dict[str, torch.Tensor]
    _views: dict[int, KernelArgs]  # per parameter (by id): its kernel arguments of the last fused step

    def _key(self, piece: Piece) -> int:
        raise NotImplementedError

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
        for piece in fused:
            if piece.param.device.type == "cpu":  # each parameter's key tensor of the last step, refilled in place
                key_of[id(piece)] = fill_key(views, piece.param, self._key(piece))
            else:
                on_device.setdefault(piece.param.device, []).append(piece)
        for device, group in on_device.items():
            key_of.update(zip(map(id, group), keys([self._key(piece) for piece in group], device)))
        eager = torch._C._len_torch_dispatch_stack() > 0
        native = None if eager else compact_native.kernel()  # once a step, not per parameter
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
                mult = _multiplier_tensor(multiplier, p.device)
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

    def _fusable(self, optimizer: Optimizer, piece: Piece, groups: dict[Any, bool] | None = None) -> bool:
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


_ADAM_KEYS = frozenset(("step", "exp_avg", "exp_avg_sq"))  # the state torch's Adam keeps without amsgrad


def _has_step_hooks(optimizer: Optimizer) -> bool:
    # The optimizer's own step pre/post hooks and the global ones (torch.optim.optimizer.register_optimizer_step_*).
    from torch.optim import optimizer as module

    return bool(
        getattr(optimizer, "_optimizer_step_pre_hooks", None) or getattr(optimizer, "_optimizer_step_post_hooks", None)
        or getattr(module, "_global_optimizer_pre_hooks", None) or getattr(module, "_global_optimizer_post_hooks", None)
    )


def _count_(steps: list[torch.Tensor]) -> None:
    # Each stepped parameter's step counter + 1, in one call (they are 0-d CPU tensors, FP32 or FP64).
    if steps:
        torch._foreach_add_(steps, 1)


def _multiplier_tensor(multiplier: torch.Tensor | float | None, device: torch.device) -> torch.Tensor:
    if isinstance(multiplier, torch.Tensor):
        return multiplier.detach().to(device=device, dtype=torch.float32).reshape(())
    return host_to_device(torch.tensor(1.0 if multiplier is None else float(multiplier), dtype=torch.float32), device)


_SLOW_MARKER = "lit_mpstable_fused_adam_said"


def _first_to_say(marker: str) -> bool:
    """Whether this process is the first to give a one-time notice for this inductor cache (every job of a sweep and
    every rank shares it): only rank 0 of a process group, and only once per cache, marked by a file in it."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return False
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        path = os.path.join(cache_dir(), marker)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "x"):  # atomic: of a sweep's concurrent jobs exactly one creates it
            return True
    except FileExistsError:
        return False
    except (ImportError, OSError):  # no cache to mark: say it (once per process, as before)
        return True

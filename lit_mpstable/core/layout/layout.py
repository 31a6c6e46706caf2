"""The precision layout of a model: its base dtype, FP32 islands, FP8 layers, and the fallbacks on top of them."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from lit_mpstable.base.validate import check_keys
from lit_mpstable.core.layout.islands import FP32Islands, match_modules, tied_modules
from lit_mpstable.fp8 import FP8Config, convert_from_fp8, fp8_backend
from lit_mpstable.fp8.budget import keep_high_precision_
from lit_mpstable.fp8.swap import no_fp8_layers_message, select_fp8_modules

_SWAPPED = "_lit_mpstable_fp8_swap"  # set on the FP8 layers a layout swapped in (a user's own are left alone)


class PrecisionLayout:
    """Decides, and applies in place, which parts of a model compute in which format.

    The ladder a global fallback climbs, one rung per call: FP8 layers back to the base precision, then the whole
    model to FP32 (FP8 included). A module fallback takes the named modules one rung up: an FP8 layer back to the
    base precision, any other module into an FP32 island. Where parameters are cast (``*-true``), an island takes
    along every module sharing a parameter with it (a tied embedding and head: one ``Parameter`` has one dtype), and
    a module whose parameter the root module holds too climbs the global ladder instead. Parameters are cast in
    place (``param.data``) and FP8 layers of every backend share the ``Parameter`` objects of the layers they
    replace, so optimizers and master weights stay bound through every fallback and restore.

    FP8 goes through the backend seam only (:class:`~lit_mpstable.fp8.FP8Backend`, built here, so a backend refuses
    what it cannot do when the plugin is constructed). The layers to run in FP8 are selected once per model, on the
    first :meth:`attach` (a stale ``filter`` is an error there), and remembered by qualified name: a restore, a
    rollback, a resume and a second ``fit`` re-apply that decision instead of selecting among layers already swapped.

    Args:
        dtype: the base compute dtype (``torch.float32`` for ``"32-true"``).
        cast_parameters: ``*-true`` modes: parameters themselves live in ``dtype`` (else autocast does the casting).
        fp32_modules: the user's FP32 islands (types or qualified-name patterns).
        fp8: the FP8 recipe, or ``None``.

    Raises:
        ValueError: the FP8 backend cannot do what ``fp8`` asks.
        ModuleNotFoundError: the FP8 backend's package is not installed.
    """

    def __init__(
        self,
        dtype: torch.dtype,
        *,
        cast_parameters: bool,
        fp32_modules: Iterable[type[nn.Module] | str] = (),
        fp8: FP8Config | None = None,
    ) -> None:
        self.dtype, self.cast_parameters, self.fp8 = dtype, cast_parameters, fp8
        self.fp8_backend = fp8_backend(fp8) if fp8 is not None else None
        self.islands = FP32Islands(fp32_modules)
        self._user_islands = tuple(self.islands.specs)  # the user's; fallback islands are in fp32_modules
        self.module: nn.Module | None = None
        self.device_type = "cpu"
        self.fp32 = False  # global fallback to FP32
        self.fp8_off = False  # global fallback out of FP8
        self.fp8_removed: list[str] = []  # FP8 layers moved back to the base precision
        self.fp32_modules: list[str] = []  # modules moved into FP32 islands
        self._fp8_selected: list[str] | None = None  # chosen once per model, then re-applied
        self._fp8_layers: list[str] = []
        self.after_recast: Callable[[list[tuple[nn.Parameter, torch.Tensor]]], object] | None = None
        """Called after a re-application that changed parameter dtypes, with ``(parameter, its data before)`` for
        each: state kept per parameter (compact weights' compensation, optimizer state) follows the recast."""
        self.find_ddp: Callable[[], nn.parallel.DistributedDataParallel | None] | None = None
        """Returns the ``DistributedDataParallel`` wrapping :attr:`module` now, or ``None`` (set by a front end that
        knows its strategy): a recast of ``*-true`` parameters rebuilds its reducer."""
        self.after_fp8_swap: Callable[[], object] | None = None
        """Called after layers were swapped back into FP8 (a restore or a rollback across a fallback), which come back
        in the configured recipe: a precision schedule switches them to the recipe it has them in by now."""

    # ----------------------------------------------------------------------------------------------- reading
    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float32 if self.fp32 else self.dtype

    @property
    def fallback_active(self) -> bool:
        return self.fp32 or self.fp8_off or bool(self.fp8_removed) or bool(self.fp32_modules)

    @property
    def fp8_layers(self) -> list[str]:
        """Qualified names of the layers that compute in FP8 now (kept by ``_apply``: read on every forward)."""
        return list(self._fp8_layers)

    @property
    def fp8_selected(self) -> list[str]:
        """Qualified names of the layers the FP8 filter selected for this model (FP8 unless a fallback moved them)."""
        return list(self._fp8_selected or [])

    def keep_high_precision_(self, names: list[str]) -> None:
        """Take ``names`` out of the FP8 selection for the run (the layers return to the base precision) and
        re-attach: the probe's high-precision budget, applied once."""
        if self.module is None:
            raise RuntimeError(f"PrecisionLayout.keep_high_precision_({names!r}) before attach(module): the layers are"
                               " the model's (a stepper attaches it in setup_module).")
        self._fp8_selected = keep_high_precision_(self.module, self.fp8_selected, names)
        self.attach(self.module, self.device_type)

    def forward_context(self) -> ContextManager:
        """The FP8 backend's forward context (TransformerEngine's autocast) while FP8 layers are active, else a no-op.

        Cheap (one list check): the plugin enters it around every forward.
        """
        if self._fp8_layers:
            assert self.fp8_backend is not None  # FP8 layers are only ever converted by a backend
            return self.fp8_backend.forward_context()
        return contextlib.nullcontext()

    def sync_fp8_(self, group: object = None) -> None:
        """Make the FP8 scaling state agree across the ranks of ``group`` (default: all ranks). Call it once per
        optimizer step, after the step (skipped or not), on every rank.

        Native delayed recipe: one MAX all-reduce of all layers' amax histories together, on the device (no host
        sync), then the scales recomputed from them, so every rank starts the next step with the same scales.
        Nothing to do on one process (numerics unchanged), for the stateless recipes, or for TransformerEngine
        (its autocast reduces amaxes itself).
        """
        if self._fp8_layers:
            assert self.fp8_backend is not None and self.module is not None  # FP8 layers live in an attached model
            self.fp8_backend.sync_(self.module, self._fp8_layers, group)

    def validate(self, module: nn.Module) -> None:
        """Check the user's islands and the FP8 filter against ``module`` without changing it; warns about the
        modules an island takes along because they share a parameter with it (``*-true`` only).

        Raises:
            ValueError: an island pattern or FP8 filter entry matches nothing, an island shares a parameter with the
                root module in a ``*-true`` mode (the root cannot be an island), or ``fp8`` is set and no layer of
                ``module`` is eligible (FP8 would silently do nothing).
        """
        if self._user_islands:
            islands = match_modules(module, self._user_islands)
            tied = tied_modules(module, islands) if self.cast_parameters else {}
            call, dtype = f"fp32_modules={list(self._user_islands)!r}", str(self.dtype).removeprefix("torch.")
            if "" in tied:
                raise ValueError(
                    f"{call}: {tied['']!r} is a parameter of the root module {type(module).__name__} too, and a"
                    f" parameter has one dtype: with the island's FP32 the root's own use of it meets {dtype}"
                    " activations, and the root cannot be an island (its caller's code runs outside it). Use a"
                    " '*-mixed' precision (parameters stay FP32 there, islands share them freely), or untie the"
                    " parameter.")
            if tied:
                together = ", ".join(f"{name!r} (holds {param!r})" for name, param in tied.items())
                warnings.warn(f"{call} takes {together} into FP32 too: a parameter has one dtype, and the island"
                              f" holds it in FP32. List them in fp32_modules to say so, or untie the weights to keep"
                              f" them in {dtype}.", stacklevel=2)
        if self.fp8 is not None and not select_fp8_modules(module, self.fp8):
            raise ValueError(no_fp8_layers_message(module, self.fp8))

    # ---------------------------------------------------------------------------------------------- applying
    def attach(self, module: nn.Module, device_type: str) -> None:
        """Apply the layout to ``module`` (again after a second ``fit``, or after a fallback decision)."""
        if module is not self.module:
            self._fp8_selected = None  # another model: select its layers on first use
            # FP8 layers an earlier layout (a previous fit's plugin) swapped in are that run's decision, not the
            # model's: back to nn.Linear, so this layout's filter selects among the user's layers.
            left = [name for name, layer in module.named_modules() if getattr(layer, _SWAPPED, False)]
            if left:
                convert_from_fp8(module, left)
            self.validate(module)
        self.module, self.device_type = module, device_type
        self._apply()

    def _apply(self) -> None:
        assert self.module is not None
        before = [(param, param.data) for param, dtype in self._planned_dtypes().values() if param.dtype != dtype]
        self._apply_layout()
        changed = [(param, data) for param, data in before if param.dtype != data.dtype]
        if changed and self.after_recast is not None:
            self.after_recast(changed)

    def _apply_layout(self) -> None:
        assert self.module is not None
        # The islands in force are derived, never edited: the user's specs plus the modules moved by fallbacks, and
        # the modules sharing their parameters.
        self.islands.detach()
        self.islands = FP32Islands(self._island_specs())
        dtype = self.compute_dtype
        if self.cast_parameters:
            islands = match_modules(self.module, self.islands.specs) if self.islands.specs else {}
            backend = self.fp8_backend
            _cast_outside(self.module, dtype, islands, owns_buffers=None if backend is None else
                          (lambda module: not backend.is_fp8_layer(module)))
        if self.fp8_backend is not None:
            self._apply_fp8()
        # In *-true modes an island's output goes back to the 16-bit dtype the next layer expects.
        out = dtype if self.cast_parameters and dtype != torch.float32 else None
        self.islands.attach(self.module, device_type=self.device_type, output_dtype=out)

    def _apply_fp8(self) -> None:
        module, backend = self.module, self.fp8_backend
        # Called only with a model attached and FP8 configured (the backend is built from the config).
        assert module is not None and backend is not None and self.fp8 is not None
        if self._fp8_selected is None:
            self._fp8_selected = select_fp8_modules(module, self.fp8)
        off = self.fp8_off or self.fp32
        wanted = [] if off else [name for name in self._fp8_selected if name not in self.fp8_removed]
        active = [name for name in self._fp8_selected if backend.is_fp8_layer(module.get_submodule(name))]
        backend.revert_(module, [name for name in active if name not in wanted])
        converted = [name for name in wanted if name not in active]
        backend.convert_(module, converted)
        for name in converted:
            setattr(module.get_submodule(name), _SWAPPED, True)
        self._fp8_layers = wanted
        if converted and self.after_fp8_swap is not None:
            self.after_fp8_swap()

    def fallback(self, modules: Iterable[str] | None = None) -> str:
        """One rung up the ladder, globally (``modules=None``) or for the named modules; returns what was done."""
        if self.module is None:
            raise RuntimeError("fallback(): no model attached yet (call it during fit).")
        if isinstance(modules, str):
            raise TypeError(f"fallback(modules={modules!r}): pass a list of qualified module names, e.g."
                            f" [{modules!r}], or None for the whole model.")
        if modules is not None:
            modules = list(modules)
            try:  # a name that matches no module is refused before anything changes
                match_modules(self.module, modules)
            except (ValueError, TypeError) as error:
                raise type(error)(f"fallback(modules={modules!r}): {error}") from None
        saved = self._fallbacks()
        if modules is None:
            if self.fp8_layers and not self.fp8_off:
                self.fp8_off = True
                action = "FP8 layers now compute in the base precision"
            else:
                self.fp32 = True
                action = "the whole model now computes in FP32"
        else:
            fp8_layers = set(self.fp8_layers)
            out_of_fp8 = [name for name in modules if name in fp8_layers and name not in self.fp8_removed]
            islands = [name for name in modules if name not in fp8_layers and name not in self.fp32_modules]
            tied_before = self._tied()
            self.fp8_removed.extend(out_of_fp8)
            self.fp32_modules.extend(islands)
            tied = {name: param for name, param in self._tied().items() if name not in tied_before}
            if "" in tied:
                # The root cannot be an island (its caller's code runs outside it): the ladder's next rung instead.
                self._set_fallbacks(saved)
                return (f"{self.fallback(None)} ({islands} cannot run in FP32 alone: {tied['']!r} is a parameter of"
                        " the root module too, and a parameter has one dtype)")
            parts = [f"{out_of_fp8} left FP8"] if out_of_fp8 else []
            if islands:
                together = (f", with {list(tied)} (they share {', '.join(map(repr, tied.values()))}, and a parameter"
                            " has one dtype)") if tied else ""
                parts.append(f"{islands} now run in FP32{together}")
            action = "; ".join(parts) or "nothing new to move"
        self._apply_or_refuse(saved, f"fallback({modules!r})")
        return action

    def restore(self) -> None:
        """Undo every fallback: the configured precision, FP8 layers and the user's own islands again."""
        saved = self._fallbacks()
        self._set_fallbacks((False, False, [], []))
        if self.module is not None:
            self._apply_or_refuse(saved, "restore()")

    # ------------------------------------------------------------------------------------ data parallel
    def _fallbacks(self) -> tuple:
        return self.fp32, self.fp8_off, list(self.fp8_removed), list(self.fp32_modules)

    def _set_fallbacks(self, saved: tuple) -> None:
        self.fp32, self.fp8_off = saved[0], saved[1]
        self.fp8_removed, self.fp32_modules = list(saved[2]), list(saved[3])

    def recast_names(self) -> list[str]:
        """Qualified names of the parameters the fallbacks in force hold in another dtype than the configured layout
        (``*-true`` parameters recast to FP32 by a global or module fallback); empty without a model or such a
        fallback."""
        if self.module is None or not self.cast_parameters or not (self.fp32 or self.fp32_modules):
            return []
        now, configured = self._planned_dtypes(), self._planned_dtypes(fallbacks=False)
        return [name for name, param in self.module.named_parameters()
                if id(param) in now and now[id(param)][1] != configured[id(param)][1] == self.dtype]

    def _island_specs(self, fallbacks: bool = True) -> list[type[nn.Module] | str]:
        """The FP32 islands the fallbacks now set (``fallbacks=False``: none) make: the user's, the modules moved, and
        where parameters are cast, the modules sharing a parameter with them (the root never: refused before)."""
        specs = [*self._user_islands, *(self.fp32_modules if fallbacks else [])]
        return [*specs, *self._tied(specs)]

    def _tied(self, specs: list[type[nn.Module] | str] | None = None) -> dict[str, str]:
        """:func:`tied_modules` of the islands ``specs`` (default: those in force) where parameters are cast."""
        assert self.module is not None  # islands are matched in an attached model
        specs = [*self._user_islands, *self.fp32_modules] if specs is None else specs
        if not self.cast_parameters or not specs:
            return {}
        return tied_modules(self.module, match_modules(self.module, specs))

    def _planned_dtypes(self, fallbacks: bool = True) -> dict[int, tuple[nn.Parameter, torch.dtype]]:
        """The dtype each floating parameter will have once the fallbacks now set (``fallbacks=False``: none) are
        applied."""
        assert self.module is not None  # planned only for an attached model
        islands = match_modules(self.module, self._island_specs(fallbacks))
        inside = {id(p) for island in islands.values() for p in island.parameters()}
        plan = {}
        for param in self.module.parameters():
            if param.is_floating_point():
                kept = (self.compute_dtype if fallbacks else self.dtype) if self.cast_parameters else param.dtype
                dtype = torch.float32 if id(param) in inside else kept
                plan[id(param)] = (param, dtype)
        return plan

    def _apply_or_refuse(self, saved: tuple, call: str) -> None:
        """Apply the fallbacks now set; under data parallelism a change of parameter dtypes (``param.data`` cast
        in place drops the parameter's autograd accumulator, the one DDP's reducer hooks) rebuilds DDP's reducer,
        or, where no ``DistributedDataParallel`` can be found, is refused with the previous fallbacks kept."""
        try:
            recast = any(param.dtype != dtype for param, dtype in self._planned_dtypes().values())
        except ValueError:
            self._set_fallbacks(saved)  # a name that matches no module: nothing changes
            raise
        ddp = self.find_ddp() if recast and self.find_ddp is not None else None
        if recast and ddp is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._set_fallbacks(saved)
            raise RuntimeError(
                f"PrecisionLayout.{call}: it recasts {self.dtype} parameters in place, and with"
                f" {dist.get_world_size()} processes no DistributedDataParallel wrapping the model was found to"
                " re-register them with (a recast parameter gets a new autograd accumulator, so DDP's gradient"
                " all-reduce would silently stop and the replicas drift apart). Use the Trainer's 'ddp' strategies,"
                " a '*-mixed' precision (nothing is recast), or rebuild the DDP wrapper after the call yourself"
                " (lit_mpstable.core.layout.layout.rebuild_ddp_reducer_)."
            )
        self._apply()
        if ddp is not None:
            rebuild_ddp_reducer_(ddp)

    # ------------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, object]:
        """Keys: ``fp32``, ``fp8_off``, ``fp8_removed``, ``fp32_modules`` (the fallbacks) and ``fp8`` (the FP8
        backend's scaling state of the active FP8 layers by ``"<layer>.<key>"``: amax histories and scales for the
        native delayed recipe, TransformerEngine's serialised state, nothing for stateless recipes); plain values
        and tensors."""
        module, backend = self.module, self.fp8_backend
        return {
            "fp32": self.fp32,
            "fp8_off": self.fp8_off,
            "fp8_removed": list(self.fp8_removed),
            "fp32_modules": list(self.fp32_modules),
            "fp8": backend.state_dict(module, self._fp8_layers) if module is not None and backend is not None else {},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Re-apply the saved fallbacks exactly (a rollback may undo later ones), then the FP8 state. Strict.

        An empty ``fp8`` entry (written without FP8, or before the model was attached) keeps the current FP8 state.

        Raises:
            KeyError: the keys differ from :meth:`state_dict`'s, or the FP8 state belongs to other layers.
        """
        check_keys("PrecisionLayout.load_state_dict", state, self.state_dict())
        saved = self._fallbacks()
        self._set_fallbacks((bool(state["fp32"]), bool(state["fp8_off"]), state["fp8_removed"], state["fp32_modules"]))
        if self.module is not None:
            self._apply_or_refuse(saved, "load_state_dict()")
            if state["fp8"] and self.fp8_backend is None:
                raise KeyError(
                    f"PrecisionLayout.load_state_dict: the checkpoint holds FP8 state ({sorted(state['fp8'])[:4]}...)"
                    " but this run has fp8=None; resume with the FP8 config it was written with."
                )
            if state["fp8"]:
                assert self.fp8_backend is not None  # refused just above
                self.fp8_backend.load_state_dict(self.module, self._fp8_layers, state["fp8"])


def _cast_outside(root: nn.Module, dtype: torch.dtype, islands: dict[str, nn.Module],
                  owns_buffers: Callable[[nn.Module], bool] | None = None) -> None:
    """Cast the floating parameters and buffers of ``root`` to ``dtype`` in place, except inside ``islands``: a
    round trip through 16 bits would round their FP32 values (and overflow FP16 for statistics above 65504).
    Buffers of a module for which ``owns_buffers`` is false are left alone: an FP8 layer's amax history and scales
    are its backend's FP32 state, not the model's (a 16-bit scale is rounded, and ``_scaled_mm`` refuses it)."""
    inside = {id(m) for island in islands.values() for m in island.modules()}
    for module in root.modules():
        if id(module) in inside:
            continue
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)  # same Parameter object: optimizers and masters stay bound
        if owns_buffers is not None and not owns_buffers(module):
            continue
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_floating_point() and buffer.dtype != dtype:
                setattr(module, name, buffer.to(dtype))


def rebuild_ddp_reducer_(ddp: nn.parallel.DistributedDataParallel) -> None:
    """Re-register the parameters of ``ddp``'s module with a new reducer (buckets, autograd hooks), as DDP does when
    it is unpickled; call it on every rank alike, between iterations, after parameters were cast in place.

    A cast that changes a parameter's dtype (``param.data = param.data.to(dtype)``, ``module.float()``) gives it a
    new autograd accumulator; DDP's reducer hooks the old one, so without this the gradient all-reduce of those
    parameters silently stops (or DDP reports them unused). The old reducer's hooks are removed first (on the
    accumulators that survived), the buffers to broadcast are collected again (a cast buffer is a new tensor) and
    Python communication hooks registered with ``register_comm_hook`` are registered with the new reducer.
    No collective runs here (the parameters are equal on every rank already).
    """
    ddp._remove_autograd_hooks()
    parameters, expect_sparse_gradient = ddp._build_params_for_reducer()
    names = ddp._build_debug_param_to_name_mapping(parameters)
    ddp._ddp_init_helper(parameters, expect_sparse_gradient, names, ddp.static_graph)
    ddp._has_rebuilt_buckets = False
    if ddp.static_graph:  # the new reducer records the graph again in its first iteration (a delayed all-reduce)
        ddp._static_graph_delay_allreduce_enqueued = False
        ddp.reducer._set_static_graph()
        assert ddp.logger is not None  # _ddp_init_helper above built it
        ddp.logger._set_static_graph()
    for hook, state in ddp._comm_hooks:
        dist._register_comm_hook(ddp.reducer, state, hook)
    ddp._assign_modules_buffers()

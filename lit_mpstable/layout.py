"""The precision layout of a model: its base dtype, FP32 islands, FP8 layers, and the fallbacks on top of them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any, ContextManager

import torch
from torch import nn

from lit_mpstable.fp8 import FP8Config, fp8_backend, select_fp8_modules
from lit_mpstable.islands import FP32Islands, match_modules

__all__ = ["PrecisionLayout"]


class PrecisionLayout:
    """Decides, and applies in place, which parts of a model compute in which format.

    The ladder a global fallback climbs, one rung per call: FP8 layers back to the base precision, then the whole
    model to FP32 (FP8 included). A module fallback takes the named modules one rung up: an FP8 layer back to the
    base precision, any other module into an FP32 island. Parameters are cast in place (``param.data``) and FP8
    layers of every backend share the ``Parameter`` objects of the layers they replace, so optimizers and master
    weights stay bound through every fallback and restore.

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
        self, dtype: torch.dtype, *, cast_parameters: bool, fp32_modules: Iterable[Any] = (), fp8: FP8Config | None = None
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

    def forward_context(self) -> ContextManager:
        """The FP8 backend's forward context (TransformerEngine's autocast) while FP8 layers are active, else a no-op.

        Cheap (one list check): the plugin enters it around every forward.
        """
        if self._fp8_layers:
            return self.fp8_backend.forward_context()
        return contextlib.nullcontext()

    def sync_fp8_(self, group: Any = None) -> None:
        """Make the FP8 scaling state agree across the ranks of ``group`` (default: all ranks). Call it once per
        optimizer step, after the step (skipped or not), on every rank.

        Native delayed recipe: one MAX all-reduce of all layers' amax histories together, on the device (no host
        sync), then the scales recomputed from them, so every rank starts the next step with the same scales.
        Nothing to do on one process (numerics unchanged), for the stateless recipes, or for TransformerEngine
        (its autocast reduces amaxes itself).
        """
        if self._fp8_layers:
            self.fp8_backend.sync_(self.module, self._fp8_layers, group)

    def validate(self, module: nn.Module) -> None:
        """Check the user's islands and the FP8 filter against ``module`` without changing it.

        Raises:
            ValueError: an island pattern or FP8 filter entry matches nothing, or ``fp8`` is set and no layer of
                ``module`` is eligible (FP8 would silently do nothing).
        """
        if self._user_islands:
            match_modules(module, self._user_islands)
        if self.fp8 is not None and not select_fp8_modules(module, self.fp8):
            raise ValueError(
                f"fp8={self.fp8.recipe!r}: no nn.Linear layer of {type(module).__name__} is eligible for FP8 (the"
                " default filter leaves out the first and last linear layers and those whose in/out features are not"
                " multiples of 16), so FP8 would do nothing; pass FP8Config(filter=[...]) naming layers, or fp8=None."
            )

    # ---------------------------------------------------------------------------------------------- applying
    def attach(self, module: nn.Module, device_type: str) -> None:
        """Apply the layout to ``module`` (again after a second ``fit``, or after a fallback decision)."""
        if module is not self.module:
            self._fp8_selected = None  # another model: select its layers on first use
            self.validate(module)
        self.module, self.device_type = module, device_type
        self._apply()

    def _apply(self) -> None:
        assert self.module is not None
        # The islands in force are derived, never edited: the user's specs plus the modules moved by fallbacks.
        self.islands.detach()
        self.islands = FP32Islands([*self._user_islands, *self.fp32_modules])
        dtype = self.compute_dtype
        if self.cast_parameters:
            _cast_outside(self.module, dtype, match_modules(self.module, self.islands.specs) if self.islands.specs else {})
        if self.fp8_backend is not None:
            self._apply_fp8()
        # In *-true modes an island's output goes back to the 16-bit dtype the next layer expects.
        out = dtype if self.cast_parameters and dtype != torch.float32 else None
        self.islands.attach(self.module, device_type=self.device_type, output_dtype=out)

    def _apply_fp8(self) -> None:
        module, backend = self.module, self.fp8_backend
        if self._fp8_selected is None:
            self._fp8_selected = select_fp8_modules(module, self.fp8)
        off = self.fp8_off or self.fp32
        wanted = [] if off else [name for name in self._fp8_selected if name not in self.fp8_removed]
        active = [name for name in self._fp8_selected if backend.is_fp8_layer(module.get_submodule(name))]
        backend.revert_(module, [name for name in active if name not in wanted])
        backend.convert_(module, [name for name in wanted if name not in active])
        self._fp8_layers = wanted

    def fallback(self, modules: Iterable[str] | None = None) -> str:
        """One rung up the ladder, globally (``modules=None``) or for the named modules; returns what was done."""
        if self.module is None:
            raise RuntimeError("fallback(): no model attached yet (call it during fit).")
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
            self.fp8_removed.extend(out_of_fp8)
            self.fp32_modules.extend(islands)
            parts = [f"{out_of_fp8} left FP8"] if out_of_fp8 else []
            parts += [f"{islands} now run in FP32"] if islands else []
            action = "; ".join(parts) or "nothing new to move"
        self._apply()
        return action

    def restore(self) -> None:
        """Undo every fallback: the configured precision, FP8 layers and the user's own islands again."""
        self._clear_fallbacks()
        if self.module is not None:
            self._apply()

    def _clear_fallbacks(self) -> None:
        self.fp32 = self.fp8_off = False
        self.fp8_removed, self.fp32_modules = [], []

    # ------------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Keys: ``fp32``, ``fp8_off``, ``fp8_removed``, ``fp32_modules`` (the fallbacks) and ``fp8`` (the FP8
        backend's scaling state of the active FP8 layers by ``"<layer>.<key>"``: amax histories and scales for the
        native delayed recipe, TransformerEngine's serialised state, nothing for stateless recipes); plain values
        and tensors."""
        active = self.module is not None and self.fp8_backend is not None
        return {
            "fp32": self.fp32,
            "fp8_off": self.fp8_off,
            "fp8_removed": list(self.fp8_removed),
            "fp32_modules": list(self.fp32_modules),
            "fp8": self.fp8_backend.state_dict(self.module, self._fp8_layers) if active else {},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Re-apply the saved fallbacks exactly (a rollback may undo later ones), then the FP8 state. Strict.

        An empty ``fp8`` entry (written without FP8, or before the model was attached) keeps the current FP8 state.

        Raises:
            KeyError: the keys differ from :meth:`state_dict`'s, or the FP8 state belongs to other layers.
        """
        expected = set(self.state_dict())
        if set(state) != expected:
            raise KeyError(
                f"PrecisionLayout.load_state_dict: missing keys {sorted(expected - set(state))}, unknown keys"
                f" {sorted(set(state) - expected)}."
            )
        self._clear_fallbacks()
        self.fp32, self.fp8_off = bool(state["fp32"]), bool(state["fp8_off"])
        self.fp8_removed, self.fp32_modules = list(state["fp8_removed"]), list(state["fp32_modules"])
        if self.module is not None:
            self._apply()
            if state["fp8"] and self.fp8_backend is None:
                raise KeyError(
                    f"PrecisionLayout.load_state_dict: the checkpoint holds FP8 state ({sorted(state['fp8'])[:4]}...)"
                    " but this run has fp8=None; resume with the FP8 config it was written with."
                )
            if state["fp8"]:
                self.fp8_backend.load_state_dict(self.module, self._fp8_layers, state["fp8"])


def _cast_outside(root: nn.Module, dtype: torch.dtype, islands: dict[str, nn.Module]) -> None:
    """Cast the floating parameters and buffers of ``root`` to ``dtype`` in place, except inside ``islands``: a
    round trip through 16 bits would round their FP32 values (and overflow FP16 for statistics above 65504)."""
    inside = {id(m) for island in islands.values() for m in island.modules()}
    for module in root.modules():
        if id(module) in inside:
            continue
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)  # same Parameter object: optimizers and masters stay bound
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_floating_point() and buffer.dtype != dtype:
                setattr(module, name, buffer.to(dtype))

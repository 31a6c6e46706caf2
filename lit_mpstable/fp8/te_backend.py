"""The TransformerEngine FP8 backend: te.Linear layers, TE's autocast around the forward, TE's own scaling state."""

from __future__ import annotations

import io
import sys
from typing import Any, ClassVar, ContextManager

import torch
from torch import nn

from lit_mpstable.fp8.backend import FP8Backend, optional_import, replace_module, share_hooks
from lit_mpstable.fp8.config import FP8Config
from lit_mpstable.fp8.native import conformance_gate

_EXTRA_STATE = "_extra_state"  # the key torch.nn.Module gives get_extra_state()'s value in a state dict
_STATE_KEY = "extra_state"


_TE_RECIPES = {
    "delayed": ("DelayedScaling", "1.0", "delayed"),
    "current": ("Float8CurrentScaling", "2.2", "config"),
    "mxfp8": ("MXFP8BlockScaling", "2.0", "config"),
    "blockwise": ("Float8BlockScaling", "2.3", "e4m3"),
    "nvfp4": ("NVFP4BlockScaling", "2.7", "none"),
}
"""Recipe name -> (TE recipe class, the TE version that has it, its format argument: ``"config"`` FP8Config.format,
``"e4m3"`` E4M3 everywhere (DeepSeek-V3), ``"none"`` (the format is the recipe), ``"delayed"`` DelayedScaling's
knobs). A new recipe that TE runs is one entry here."""
_TE_HARDWARE = {"blockwise": ((9, 0), "Hopper"), "nvfp4": ((10, 0), "Blackwell")}
"""Recipes whose TE kernels need a GPU of at least this compute capability (Float8BlockScaling's GEMMs are Hopper
ones; NVFP4's need Blackwell's FP4 tensor cores)."""


def transformer_engine_recipe(config: FP8Config) -> Any:
    """TransformerEngine's recipe for ``config``: DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling,
    Float8BlockScaling (``"blockwise"``, E4M3) or NVFP4BlockScaling (``"nvfp4"``, TE's defaults: RHT on the wgrad
    inputs, 16x16 weight tiles, stochastic rounding of gradients, as our emulation does).

    Raises:
        ModuleNotFoundError: TransformerEngine is not installed.
        ValueError: this TransformerEngine version has no class for the recipe, or the recipe has no TE mapping.
    """
    recipe = optional_import("transformer_engine.common.recipe", "transformer_engine")
    fp8_format = recipe.Format.HYBRID if config.format == "hybrid" else recipe.Format.E4M3
    spec = config.spec
    if spec.name not in _TE_RECIPES:
        raise ValueError(f"FP8Config(recipe={spec.name!r}, backend='transformer_engine'): no mapping of this recipe to"
                         f" a TransformerEngine recipe (te_backend._TE_RECIPES has {list(_TE_RECIPES)}); use"
                         " backend='native', or export its per-layer map (export_recipe_map) for TE's CustomRecipe.")
    name, version, fmt = _TE_RECIPES[spec.name]
    if not hasattr(recipe, name):
        raise ValueError(
            f"FP8Config(recipe={spec.name!r}, backend='transformer_engine'): this TransformerEngine has no"
            f" recipe.{name} (it needs TE >= {version}); upgrade it, or use backend='native' (exact emulation)."
        )
    kwargs = {
        "delayed": dict(margin=config.margin, fp8_format=fp8_format, amax_history_len=config.amax_history_len,
                        amax_compute_algo=config.amax_compute_algo),
        "config": dict(fp8_format=fp8_format),
        "e4m3": dict(fp8_format=recipe.Format.E4M3),  # DeepSeek-V3: E4M3 for gradients too
        "none": {},  # FP4 elements and E4M3 scales are the recipe itself: no format to pass
    }[fmt]
    return getattr(recipe, name)(**kwargs)


def hardware_refusal(name: str, library: str) -> str | None:
    """Why ``library``'s kernels for the recipe ``name`` cannot run on this machine's current CUDA device (None if
    they can, or if the recipe needs nothing beyond the library's own checks)."""
    needs = _TE_HARDWARE.get(name)
    if needs is None:
        return None
    needed, arch = needs
    if not torch.cuda.is_available():
        have = "no CUDA device"
    elif (capability := torch.cuda.get_device_capability()) < needed:
        have = f"CUDA device {torch.cuda.current_device()} of compute capability {capability}"
    else:
        return None
    return (f"FP8Config(recipe={name!r}, backend={library!r}): {library}'s {name} kernels need a {arch} GPU"
            f" (compute capability >= {needed}), and this machine has {have}; use backend='native', which emulates"
            f" {name} exactly on any device (same numerics, no speed-up).")


class TransformerEngineBackend(FP8Backend):
    """``transformer_engine.pytorch.Linear`` layers that take over the original ``Parameter`` objects.

    - Conversion builds a ``te.Linear`` of the same shape and dtype and hands it the original ``weight`` and
      ``bias`` (TE accepts re-registered parameters, as FSDP2 does to it); reverting hands them to an
      ``nn.Linear``. So optimizers and master weights stay bound through fallbacks and restores, and the
      reverted layer holds the trained weights.
    - :meth:`forward_context`: ``te.autocast(enabled=True, recipe=...)`` (TE >= 2.x), else
      ``te.fp8_autocast(enabled=True, fp8_recipe=...)``, with the recipe built once.
    - State: TE's own ``get_extra_state()`` (its amax histories and scales, serialised by TE into a uint8 tensor;
      empty for stateless recipes), under ``"<fqn>.extra_state"``. It is kept out of ``model.state_dict()`` so a
      model checkpoint loads into the plain model Lightning restores before ``convert_module`` (and a strict load
      into a TE layer without it leaves TE's state alone); the plugin's state carries it.
    - Cross-rank amaxes: TE reduces them itself inside its autocast (``DelayedScaling.reduce_amax=True``, over the
      default process group), so :meth:`sync_` has nothing to do. No saturation/underflow telemetry.

    Raises:
        ModuleNotFoundError: TransformerEngine is not installed.
        ValueError: its recipe class for ``config.recipe`` is missing, or the recipe's kernels cannot run on this
            machine (``"blockwise"`` needs Hopper, ``"nvfp4"`` Blackwell); FP8Config refuses ``emulate=True`` and
            ``"mxfp4"`` (TE has no MXFP4 recipe).
    """

    name: ClassVar[str] = "transformer_engine"

    def __init__(self, config: FP8Config) -> None:
        super().__init__(config)
        te = optional_import("transformer_engine.pytorch", "transformer_engine")
        self.recipe = transformer_engine_recipe(config)
        if (refusal := hardware_refusal(config.spec.name, "transformer_engine")) is not None:
            raise ValueError(refusal)
        if hasattr(te, "autocast"):  # TE 2.x; fp8_autocast is deprecated there (and warns on every call)
            self._autocast, self._recipe_kwarg = te.autocast, "recipe"
        else:
            self._autocast, self._recipe_kwarg = te.fp8_autocast, "fp8_recipe"

    @classmethod
    def is_fp8_layer(cls, module: nn.Module) -> bool:
        te = sys.modules.get("transformer_engine.pytorch")
        return te is not None and isinstance(module, te.Linear)

    def checks_conformance(self) -> bool:
        return torch.cuda.is_available()  # TE's kernels run on CUDA only: on a CPU there is nothing to check

    def convert_(self, model: nn.Module, names: list[str]) -> None:
        te = optional_import("transformer_engine.pytorch", "transformer_engine")
        names = conformance_gate(self, model, names)
        for name in names:
            linear = model.get_submodule(name)
            layer = te.Linear(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                params_dtype=linear.weight.dtype,
                device=linear.weight.device,
            )
            layer.weight = linear.weight
            if linear.bias is not None:
                layer.bias = linear.bias
            layer.train(linear.training)
            share_hooks(linear, layer)
            layer.register_state_dict_post_hook(_drop_extra_state)
            layer.register_load_state_dict_pre_hook(_keep_extra_state)
            replace_module(model, name, layer)

    def forward_context(self) -> ContextManager:
        return self._autocast(enabled=True, **{self._recipe_kwarg: self.recipe})

    @classmethod
    def layer_state(cls, layer: nn.Module) -> dict[str, torch.Tensor]:
        state = layer.get_extra_state()
        if isinstance(state, io.BytesIO):  # TE 1.x serialised with torch.save into a buffer
            state = torch.frombuffer(bytearray(state.getvalue()), dtype=torch.uint8)
        return {_STATE_KEY: state.detach().clone()}

    @classmethod
    def load_layer_state(cls, layer: nn.Module, state: dict[str, torch.Tensor]) -> None:
        tensor = state[_STATE_KEY]
        value: torch.Tensor | io.BytesIO = tensor
        if isinstance(layer.get_extra_state(), io.BytesIO):  # hand it back in the form this TE reads
            value = io.BytesIO(tensor.numpy().tobytes())
        layer.set_extra_state(value)


def _drop_extra_state(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    state_dict.pop(prefix + _EXTRA_STATE, None)


def _keep_extra_state(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    # A state dict without TE's extra state (ours: see the class docstring) loads the parameters and leaves TE's
    # FP8 state as it is: TE's set_extra_state returns at once for None (its path for checkpoints without FP8 state).
    state_dict.setdefault(prefix + _EXTRA_STATE, None)

"""A TransformerEngine stand-in for CPU tests, the way Lightning tests its TE plugin: ``sys.modules`` entries for
``transformer_engine``, ``.pytorch`` (``Linear``, an autocast) and ``.common.recipe``, recording what is asked of
them. Only the behaviour our backend relies on is modelled:

- ``Linear(in_features, out_features, bias=..., params_dtype=..., device=...)`` is no ``nn.Linear`` subclass,
  keeps an empty plain tensor as ``bias`` when it has none, refuses to run outside TE's autocast, and keeps its
  FP8 state (a 4-step amax history of its input, updated in training mode) outside the state dict, serialised by
  ``get_extra_state`` into a uint8 tensor (empty before the first step) and restored by ``set_extra_state``, which
  returns at once for ``None`` or an empty tensor.
- ``fp8_autocast(enabled, fp8_recipe=...)`` (TE 1.x) or ``autocast(enabled, recipe=...)`` (TE 2.x): records its
  keyword arguments and makes the recipe current for the layers.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def install_transformer_engine(
    monkeypatch: pytest.MonkeyPatch, *, api: str = "fp8_autocast", recipes: tuple[str, ...] | None = None
) -> types.SimpleNamespace:
    """Put the stand-in into ``sys.modules`` (undone by ``monkeypatch``); returns what it records:
    ``linear`` (constructor arguments), ``autocast`` (autocast keyword arguments), ``forwards`` (the recipe in
    force at each layer call), ``Linear`` (the layer class) and ``recipe`` (the recipe module)."""
    calls = types.SimpleNamespace(linear=[], autocast=[], forwards=[], active=[])

    class Linear(nn.Module):
        def __init__(self, in_features, out_features, bias=True, *, params_dtype=None, device=None) -> None:
            super().__init__()
            self.in_features, self.out_features = in_features, out_features
            self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=params_dtype, device=device))
            bias_data = torch.zeros(out_features, dtype=params_dtype, device=device)
            self.bias = nn.Parameter(bias_data) if bias else torch.empty(0)
            self.amax_history = torch.zeros(4)
            calls.linear.append((in_features, out_features, bias, params_dtype, device))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not calls.active:
                raise RuntimeError("stand-in te.Linear called outside TransformerEngine's autocast")
            calls.forwards.append(calls.active[-1])
            if self.training:
                self.amax_history = torch.cat([x.detach().abs().amax().float().reshape(1), self.amax_history[:-1]])
            bias = self.bias if isinstance(self.bias, nn.Parameter) else None
            return F.linear(x, self.weight, bias)

        def get_extra_state(self) -> torch.Tensor:
            if not self.amax_history.any():
                return torch.empty(0, dtype=torch.uint8)
            return torch.frombuffer(bytearray(pickle.dumps(self.amax_history.tolist())), dtype=torch.uint8)

        def set_extra_state(self, state: torch.Tensor | None) -> None:
            if state is None or state.numel() == 0:
                return
            self.amax_history = torch.tensor(pickle.loads(state.numpy().tobytes()))

    class Recipe:
        def __init__(self, **kwargs) -> None:
            self.kwargs = kwargs

        def __repr__(self) -> str:
            return f"{type(self).__name__}({self.kwargs})"

    names = recipes if recipes is not None else ("DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling")
    recipe = _module(
        "transformer_engine.common.recipe", Format=types.SimpleNamespace(HYBRID="HYBRID", E4M3="E4M3"),
        **{name: type(name, (Recipe,), {}) for name in names},
    )  # fmt: skip

    @contextlib.contextmanager
    def _autocast(recipe_object):
        calls.active.append(recipe_object)
        try:
            yield
        finally:
            calls.active.pop()

    def fp8_autocast(enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None):
        calls.autocast.append(dict(enabled=enabled, fp8_recipe=fp8_recipe))
        return _autocast(fp8_recipe)

    def autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None):
        calls.autocast.append(dict(enabled=enabled, recipe=recipe))
        return _autocast(recipe)

    pytorch = _module("transformer_engine.pytorch", Linear=Linear, **{api: {"fp8_autocast": fp8_autocast,
                                                                           "autocast": autocast}[api]})
    for name, module in {
        "transformer_engine": _module("transformer_engine", pytorch=pytorch),
        "transformer_engine.pytorch": pytorch,
        "transformer_engine.common": _module("transformer_engine.common", recipe=recipe),
        "transformer_engine.common.recipe": recipe,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    calls.Linear, calls.recipe = Linear, recipe
    return calls


def install_conformance_stand_in(
    monkeypatch: pytest.MonkeyPatch, *, quantize=None, zero_grads: bool = False
) -> type:
    """A ``backend="torchao"`` stand-in for the conformance check on a CPU (undone by ``monkeypatch``): it converts
    layers to native ``FP8Linear`` (after ``conformance_gate``, as the real backends do), exposes
    ``quantize(spec, x, operand)`` as its quantizer (None: none exposed) and, with ``zero_grads``, returns all-zero
    weight gradients (TE's NVFP4 stochastic rounding on some GPUs, TE PR #3281). Returns the class."""
    import dataclasses

    from lit_mpstable.fp8 import backends
    from lit_mpstable.fp8.native import NativeBackend, conformance_gate

    class StandIn(NativeBackend):
        name = "torchao"
        converted: list[list[str]] = []

        def checks_conformance(self) -> bool:
            return True

        def convert_(self, model: nn.Module, names: list[str]) -> None:
            names = conformance_gate(self, model, names)
            StandIn.converted.append(list(names))
            NativeBackend(dataclasses.replace(self.config, backend="native")).convert_(model, names)
            for name in names:
                if zero_grads:
                    model.get_submodule(name).weight.register_hook(torch.zeros_like)

        def probe_quantize(self, x: torch.Tensor, operand: str):
            return quantize(self.config.spec, x, operand) if quantize is not None else None

    StandIn.converted = []
    monkeypatch.setitem(backends.BACKENDS, "torchao", StandIn)
    return StandIn

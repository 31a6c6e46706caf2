"""The FP32 values a recasting fallback holds, carried in the stepper's state so that a resume is exact in any order.

A fallback active at the save (``*-true`` parameters recast to FP32: the whole model, or modules moved into FP32
islands) holds values only FP32 holds. A resume that loads the model and the optimizer before the stepper puts them
into a freshly built model's 16-bit parameters (rounded), and ``Optimizer.load_state_dict`` casts their optimizer
state to that dtype (rounded); re-applying the fallback then recasts the rounded values. So while such a fallback is
active the stepper's state also holds the FP32 values of those parameters and of their per-element optimizer state
(Adam's moments, ...), by parameter name (stable across processes, unlike optimizer indices or object ids), and its
load copies them in after re-applying the fallback. Loaded first, the copies are harmless: the model and optimizer
loads that follow land in FP32 parameters exactly. Without such a fallback nothing is written (the key is absent).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypedDict

import torch
from torch import nn
from torch.optim import Optimizer

from lit_mpstable.core.weights.keeper import per_element

KEY = "recast"
"""The stepper state's key, present only while a recasting fallback is active."""


class RecastState(TypedDict, total=False):
    """What :func:`recast_state` saves (``{}`` without a recast parameter), by parameter name."""

    weights: dict[str, torch.Tensor]
    optimizer_state: dict[str, dict[str, torch.Tensor]]  # per parameter: its per-element state, by key


def _state_of(param: torch.Tensor, optimizers: Iterable[Optimizer]) -> dict[str, torch.Tensor]:
    # What torch's Optimizer.load_state_dict would cast to the parameter's dtype: its per-element floating state.
    for optimizer in optimizers:
        state = optimizer.state.get(param)
        if state:
            skip = getattr(optimizer, "non_castable_tensor_keys", ())
            return {key: value.detach() for key, value in state.items()
                    if isinstance(key, str) and per_element(key, value, param, skip)}
    return {}


def recast_state(module: nn.Module, names: Sequence[str], optimizers: Iterable[Optimizer],
                 pending: RecastState | None = None) -> RecastState:
    """``{"weights": {name: tensor}, "optimizer_state": {name: {key: tensor}}}`` for the recast parameters ``names``
    (``{}`` without any). Like ``nn.Module.state_dict`` the tensors share storage with the live ones (detached, not
    copied). A parameter whose optimizer was not met yet keeps the state loaded for it (``pending``)."""
    if not names:
        return {}
    params = dict(module.named_parameters())
    optimizers = list(optimizers)
    waiting = pending.get("optimizer_state", {}) if pending else {}
    moments = {name: _state_of(params[name], optimizers) or waiting.get(name, {}) for name in names}
    return {
        "weights": {name: params[name].detach() for name in names},
        "optimizer_state": {name: state for name, state in moments.items() if state},
    }


@torch.no_grad()
def apply_recast_state_(module: nn.Module, optimizers: Sequence[Optimizer], state: RecastState, *,
                        weights: bool = True) -> RecastState:
    """Copy :func:`recast_state`'s values into the parameters (with ``weights``) and into the per-element state the
    ``optimizers`` hold for them, where the parameter has the saved dtype (the fallback was re-applied) and shape.
    Returns what is left for an optimizer not met yet: the state of parameters none of ``optimizers`` holds (a front
    end that binds optimizers at their first step); the state of a parameter an optimizer holds without state yet is
    dropped (that optimizer's own load, still to come, lands in the recast parameter exactly)."""
    params = dict(module.named_parameters())
    if weights:
        for name, weight in state.get("weights", {}).items():
            param = params.get(name)
            if param is not None and param.dtype == weight.dtype and param.shape == weight.shape:
                param.copy_(weight)
    held = {id(p): optimizer for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}
    left: dict[str, dict[str, torch.Tensor]] = {}
    for name, saved in state.get("optimizer_state", {}).items():
        param = params.get(name)
        if param is None:
            continue
        optimizer = held.get(id(param))
        if optimizer is None:
            left[name] = saved
            continue
        live = optimizer.state.get(param)
        if not live:
            continue
        for key, value in saved.items():
            current = live.get(key)
            if (isinstance(current, torch.Tensor) and current.is_floating_point() and value.dtype == param.dtype
                    and current.shape == value.shape):
                if current.dtype == value.dtype:
                    current.copy_(value)
                else:  # the optimizer met the parameter before the recast: its state is still 16-bit
                    live[key] = value.to(device=current.device, copy=True)
    return {"weights": {}, "optimizer_state": left} if left else {}

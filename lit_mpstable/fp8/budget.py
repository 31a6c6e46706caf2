"""Which linear layers stay in the base precision under a :class:`HighPrecisionBudget`: measured (the per-layer
gradient error of the low format on a real batch) or by the fixed "last layers" rule, and applying the choice."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from lit_mpstable.fp8.backend import replace_module
from lit_mpstable.fp8.backends import backend_of, find_fp8_layers
from lit_mpstable.fp8.config import FP8Config, HighPrecisionBudget
from lit_mpstable.fp8.linear import FP8Linear

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def linear_weight_numel(module: nn.Module) -> dict[str, int]:
    """``{name: weight elements}`` of every linear layer of ``module`` (``nn.Linear`` and FP8 layers of any backend):
    the parameters a budget's ``fraction`` is a share of."""
    return {
        name: m.weight.numel() for name, m in module.named_modules()
        if type(m) is nn.Linear or backend_of(m) is not None
    }  # fmt: skip


def last_fraction_layers(module: nn.Module, layers: Sequence[str], fraction: float) -> list[str]:
    """The fixed rule of NVIDIA's NVFP4 recipe: walking ``layers`` from the last (``named_modules`` order), those
    whose weights together hold at most ``fraction`` of all linear weight elements of ``module``; a layer that would
    overflow the budget is skipped and the walk goes on to earlier, smaller ones."""
    sizes = linear_weight_numel(module)
    order = [name for name in sizes if name in set(layers)]
    return _fill(reversed(order), sizes, fraction * sum(sizes.values()))


def _fill(ranked: Any, sizes: dict[str, int], limit: float) -> list[str]:
    chosen, used = [], 0
    for name in ranked:
        if used + sizes[name] <= limit:
            chosen.append(name)
            used += sizes[name]
    return chosen


def layer_gradient_errors(
    module: nn.Module,
    layers: Sequence[str],
    loss_fn: LossFn,
    batch: Any,
    *,
    config: FP8Config | None = None,
    mode: Literal["all", "each"] = "all",
) -> dict[str, float]:
    """How far the low format moves each layer's weight gradient from the base precision's, on ``batch``.

    One reference pass with every layer in ``layers`` as a plain ``nn.Linear``, then (``mode="all"``) one pass with
    all of them quantised (fresh native layers, emulated exactly, whatever ``config.backend``): per layer,
    ``||g_low - g_base|| / ||g_base||`` of its weight gradient, which includes the error the other layers'
    quantisation sends it. ``mode="each"``: one pass per layer, that layer alone quantised, and its cost is the
    relative error of all listed layers' weight gradients together (its effect on the whole model; N + 1 passes).

    ``loss_fn(module, batch)`` returns the scalar loss (its own autocast, if any). The RNG is restored before each
    pass (dropout draws alike) and after; the module's layers, their FP8 state and the parameters' ``.grad`` are
    restored afterwards. ``config``: the recipe to measure; None takes the first listed FP8 layer's (native).

    Raises:
        ValueError: ``layers`` is empty or names no linear layer, ``mode`` is unknown, or no config is given or
            found.
    """
    if mode not in ("all", "each"):
        raise ValueError(f"layer_gradient_errors(mode={mode!r}): mode must be 'all' (one pass) or 'each'.")
    sizes = linear_weight_numel(module)
    if not layers or (unknown := [name for name in layers if name not in sizes]):
        raise ValueError(f"layer_gradient_errors(layers={list(layers)!r}): name linear layers of the module;"
                         f" {'none given' if not layers else f'{unknown!r} are not'}. Linear layers: {list(sizes)}.")
    config = _measuring_config(module, layers, config)
    originals = {name: module.get_submodule(name) for name in layers}
    plain = {name: _as_linear(layer) for name, layer in originals.items()}
    params = [p for p in module.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices):
            rng = _rng_state(devices)

            def grads(low: Sequence[str]) -> dict[str, torch.Tensor]:
                for name in layers:
                    layer = plain[name]
                    replace_module(module, name, FP8Linear.from_linear(layer, config, name) if name in low else layer)
                for p in params:
                    p.grad = None
                _set_rng_state(rng, devices)
                loss_fn(module, batch).backward()
                return {name: _weight_grad(plain[name]) for name in layers}

            base = grads(())
            if mode == "all":
                low = grads(layers)
                return {name: _relative(low[name], base[name]) for name in layers}
            reference = torch.cat([base[name].flatten() for name in layers])
            return {
                name: _relative(torch.cat([g.flatten() for g in grads((name,)).values()]), reference)
                for name in layers
            }
    finally:
        for name, layer in originals.items():
            replace_module(module, name, layer)
        for p, grad in zip(params, saved_grads):
            p.grad = grad


def choose_high_precision(
    module: nn.Module,
    layers: Sequence[str],
    loss_fn: LossFn,
    batch: Any,
    budget: HighPrecisionBudget,
    *,
    config: FP8Config | None = None,
    mode: Literal["all", "each"] = "all",
) -> list[str]:
    """The layers of ``layers`` to keep in the base precision under ``budget``, most costly first.

    ``by="probe"``: :func:`layer_gradient_errors` ranks them (``loss_fn``, ``batch``, ``config``, ``mode`` as
    there), and the costliest are taken while their weights fit in ``budget.fraction`` of all linear weight elements
    (a layer that would overflow it is skipped for smaller ones). ``by="last"``: :func:`last_fraction_layers`,
    nothing measured. Apply the result with :func:`keep_high_precision_`.

    Raises:
        TypeError: ``budget`` is not a HighPrecisionBudget.
        ValueError: as :func:`layer_gradient_errors`.
    """
    if not isinstance(budget, HighPrecisionBudget):
        raise TypeError(f"choose_high_precision(budget={budget!r}): budget must be a HighPrecisionBudget.")
    if budget.by == "last":
        return last_fraction_layers(module, layers, budget.fraction)
    errors = layer_gradient_errors(module, layers, loss_fn, batch, config=config, mode=mode)
    return fill_budget(module, errors, budget.fraction)


def fill_budget(module: nn.Module, errors: dict[str, float], fraction: float) -> list[str]:
    """The layers of ``errors`` (name -> measured cost, e.g. :func:`layer_gradient_errors`) to keep in the base
    precision, costliest first, while their weights fit in ``fraction`` of all linear weight elements of ``module``
    (a layer that would overflow it is skipped for smaller ones). Ties keep ``errors``' order."""
    sizes = linear_weight_numel(module)
    ranked = sorted(errors, key=lambda name: errors[name], reverse=True)
    return _fill(ranked, sizes, fraction * sum(sizes.values()))


def keep_high_precision_(module: nn.Module, selected: Sequence[str], names: Sequence[str]) -> list[str]:
    """Move ``names`` back to the base precision (those that are FP8 layers now, any backend, same parameters) and
    return ``selected`` without them: the layout's new list of FP8 layers. One call, e.g. in the layout:
    ``self._fp8_selected = keep_high_precision_(self.module, self._fp8_selected, chosen)``.

    Raises:
        ValueError: a name is not in ``selected``.
    """
    if unknown := [name for name in names if name not in selected]:
        raise ValueError(f"keep_high_precision_(names={list(names)!r}): {unknown!r} are not among the selected FP8"
                         f" layers {list(selected)}.")
    fp8 = find_fp8_layers(module)
    for name in names:
        if name in fp8:
            fp8[name].revert_(module, [name])
    return [name for name in selected if name not in set(names)]


def _measuring_config(module: nn.Module, layers: Sequence[str], config: FP8Config | None) -> FP8Config:
    if config is None:
        config = next((m.fp8_config for name in layers if isinstance(m := module.get_submodule(name), FP8Linear)),
                      None)
    if config is None:
        raise ValueError("layer_gradient_errors(config=None): none of the layers is a native FP8 layer to take the"
                         " recipe from; pass config=FP8Config(recipe=...).")
    # Emulated natively whatever the backend: the numbers are the format's, and no library state is touched.
    return dataclasses.replace(config, backend="native", emulate=True, filter=None, keep_high_precision="first_last")


def _as_linear(layer: nn.Module) -> nn.Linear:
    backend = backend_of(layer)
    if backend is not None:
        return backend.to_linear(layer)
    assert isinstance(layer, nn.Linear)  # the listed layers are linear_weight_numel's: nn.Linear or FP8 layers
    return layer


def _weight_grad(layer: nn.Linear) -> torch.Tensor:
    grad = layer.weight.grad
    assert grad is not None  # the loss's backward reaches every listed layer's weight
    return grad.detach().float().clone()


def _relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value - reference).norm() / reference.norm().clamp_min(torch.finfo(torch.float32).tiny))


def _rng_state(devices: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor]], devices: list[int]) -> None:
    torch.set_rng_state(state[0])
    for device, value in zip(devices, state[1]):
        torch.cuda.set_rng_state(value, device)

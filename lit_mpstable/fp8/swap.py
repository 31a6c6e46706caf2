"""Choosing the FP8 layers, swapping them in and out, and their state and telemetry across a model, any backend."""

from __future__ import annotations

import fnmatch
import warnings
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from lit_mpstable.base.validate import check_keys
from lit_mpstable.fp8.backend import FP8Backend
from lit_mpstable.fp8.backends import backend_of, find_fp8_layers, fp8_backend
from lit_mpstable.fp8.config import FP8Config, HighPrecisionBudget, fp8_config
from lit_mpstable.fp8.linear import FP8_TENSORS

_TOTAL = "total"


def _ancestors(name: str) -> list[str]:
    # "a.b.c" -> ["a.b.c", "a.b", "a", ""]: a filter entry naming a container selects the linears inside it.
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def select_fp8_modules(model: nn.Module, config: FP8Config) -> list[str]:
    """Qualified names of the ``nn.Linear`` layers ``config.filter`` selects, in ``named_modules`` order.

    Only exact ``nn.Linear`` modules are candidates: subclasses may bypass ``forward`` (``MultiheadAttention``'s
    ``out_proj``) or override it; layers some backend already made FP8 are not candidates again (a caller that
    re-applies a decision keeps the names, as ``PrecisionLayout`` does). The filter:

    - ``None``: every candidate whose ``in_features`` and ``out_features`` are multiples of 16 (FP8 GEMM kernels
      need it; 32 for ``"mxfp4"``, whose blocks run along both in turn), except those
      ``config.keep_high_precision`` keeps in the base precision: ``"first_last"``, the first and the last linear
      layer of the model (embedding-side and output-side layers are the most sensitive; FP8 layers count for
      "first" and "last"); a list, the layers it names (or their parents; fnmatch patterns); a
      :class:`HighPrecisionBudget` with ``by="last"``, the last layers holding up to ``fraction`` of the linear
      parameters (:func:`~lit_mpstable.fp8.budget.last_fraction_layers`); with ``by="probe"``, none yet: the
      probe's choice is applied later (:func:`~lit_mpstable.fp8.budget.keep_high_precision_`). With ``"mxfp4"``
      and ``"nvfp4"`` a layer left out for its dims is named in a warning (it stays in the base precision).
    - a list: a candidate is selected when an entry matches it or one of its parent modules: a string by
      ``fnmatch`` on the qualified name (``"blocks.*.mlp"``), a type by ``isinstance``. Replaces the default rule;
      a list of names in ``keep_high_precision`` still removes layers.
    - a callable ``(module, fqn) -> bool``, called on each candidate. Replaces the default rule.

    Raises:
        ValueError: a list entry (of ``filter`` or ``keep_high_precision``) matches no candidate (a stale filter
            would quantise other layers than meant), or an explicit filter selects a layer whose dims the
            ``"mxfp4"`` / ``"nvfp4"`` block does not divide (say which to leave out; ``"blockwise"`` pads any shape).
    """
    modules = dict(model.named_modules())
    fp8 = {name for name, m in modules.items() if backend_of(m) is not None}
    candidates = [name for name, m in modules.items() if type(m) is nn.Linear and name not in fp8]
    linears = [name for name, m in modules.items() if type(m) is nn.Linear or name in fp8]
    rule, keep = config.filter, config.keep_high_precision
    if rule is None:
        multiple = max(16, config.block_size)
        eligible = [name for name in candidates if _divides(modules[name], multiple)]
        if config.block_size > 1 and (left := [n for n in candidates if n not in eligible]):
            warnings.warn(
                f"FP8Config(recipe={config.recipe_name!r}): {_shapes(modules, left)} have in/out features that are"
                f" not multiples of {multiple} (the {config.recipe_name} block), so they stay in the base precision.",
                RuntimeWarning, stacklevel=2,
            )  # fmt: skip
        if keep == "first_last":
            kept = {linears[0], linears[-1]} if linears else set()
        elif isinstance(keep, HighPrecisionBudget):
            from lit_mpstable.fp8.budget import last_fraction_layers

            kept = set(last_fraction_layers(model, eligible, keep.fraction)) if keep.by == "last" else set()
        else:
            kept = set(_match_names(model, modules, linears, keep, "keep_high_precision"))
        return _apply_map(model, config, candidates, [name for name in eligible if name not in kept])
    if callable(rule):
        selected = [name for name in candidates if rule(modules[name], name)]
    else:
        selected = _match_names(model, modules, candidates, rule, "filter")
    if isinstance(keep, tuple):
        kept = set(_match_names(model, modules, linears, keep, "keep_high_precision"))
        selected = [name for name in selected if name not in kept]
    selected = _apply_map(model, config, candidates, selected)
    multiple_of = {n: layer.block_size for n in selected if (layer := config.for_layer(n)) is not None}
    if bad := [n for n in selected if not _divides(modules[n], multiple_of[n])]:
        raise ValueError(
            f"FP8Config(recipe={config.recipe_name!r}, filter={rule!r}): the filter selects {_shapes(modules, bad)},"
            f" whose in/out features are not multiples of {max(multiple_of[n] for n in bad)}, the"
            f" {config.recipe_name} block (every GEMM reduces"
            " over one of them); leave them out of the filter (they then stay in the base precision), or use"
            " recipe='blockwise', which pads partial tiles."
        )
    return selected


def _apply_map(model: nn.Module, config: FP8Config, candidates: list[str], names: list[str]) -> list[str]:
    """A per-module recipe map: ``names`` without the layers it leaves in the base precision (no pattern matches and
    no ``"default"``); a pattern that matches no linear layer is refused."""
    if not config.is_map:
        return names
    if stale := [p for p in config.map_patterns() if not any(fnmatch.fnmatchcase(n, p) for n in candidates)]:
        raise ValueError(
            f"FP8Config(recipe={{{', '.join(f'{p!r}: ...' for p in stale)}}}): the pattern(s) {stale} match no"
            f" nn.Linear layer of {type(model).__name__} (patterns are fnmatch on qualified names, first match wins);"
            f" fix or drop them. Linear layers: {candidates}"
        )
    return [name for name in names if config.for_layer(name) is not None]


def _divides(module: nn.Module, multiple: int) -> bool:
    assert isinstance(module, nn.Linear)  # called on the candidates, which are plain nn.Linear
    return module.in_features % multiple == 0 and module.out_features % multiple == 0


def _shapes(modules: dict[str, nn.Module], names: list[str]) -> str:
    return ", ".join(f"{name} ({modules[name].in_features} -> {modules[name].out_features})" for name in names)


def _match_names(
    model: nn.Module, modules: dict[str, nn.Module], candidates: list[str], rule: Sequence[str | type], field: str
) -> list[str]:
    selected: list[str] = []
    used: set[int] = set()
    for name in candidates:
        for index, entry in enumerate(rule):
            if any(_matches(entry, parent, modules[parent]) for parent in _ancestors(name)):
                used.add(index)
                if name not in selected:
                    selected.append(name)
    stale = [entry for index, entry in enumerate(rule) if index not in used]
    if stale:
        raise ValueError(
            f"FP8Config({field}={list(rule)!r}): {stale!r} match no nn.Linear layer of {type(model).__name__}; fix or"
            f" drop them (a stale filter quantises other layers than meant). Linear layers: {candidates}"
            f"{_linear_like_note(model)}"
        )
    return selected


def no_fp8_layers_message(model: nn.Module, config: FP8Config) -> str:
    """Why ``config`` selects no layer of ``model`` (:func:`select_fp8_modules` is empty) and which filter would.

    Names the ``nn.Linear`` layers (the default filter leaves out the first and last) and the Linear-like modules of
    other types, which FP8 never converts (e.g. transformers' ``Conv1D`` in GPT-2, whose weight is stored (in, out)).
    """
    modules = dict(model.named_modules())
    fp8 = {name for name, m in modules.items() if backend_of(m) is not None}
    candidates = [name for name, m in modules.items() if type(m) is nn.Linear and name not in fp8]
    head = (
        f"fp8={config.recipe_name!r}: no nn.Linear layer of {type(model).__name__} is eligible for FP8, so FP8 would do"
        " nothing."
    )
    rule = (
        " Only exact nn.Linear layers are converted; the default filter also leaves out the first and the last of"
        " them and those whose in/out features are not multiples of 16."
    )
    if candidates:
        shown = candidates if len(candidates) <= 4 else [*candidates[:3], "..."]
        fix = (
            f" Pass FP8Config(filter={candidates!r}) (or patterns naming some of them) to run them in FP8, or fp8=None."
            if len(candidates) <= 4
            else " Pass FP8Config(filter=[...]) naming some of them (names or fnmatch patterns), or fp8=None."
        )
        found = f" nn.Linear layers: {shown}."
    else:
        found = " The model has no nn.Linear layer left to convert."
        fix = " Use fp8=None, or build those layers as nn.Linear."
    return head + rule + found + _linear_like_note(model) + fix


def _linear_like_note(model: nn.Module) -> str:
    # Modules holding a 2-D weight of their own that are not exact nn.Linear: the GEMM layers a user may expect FP8
    # to convert (GPT-2's Conv1D, Linear subclasses). Embeddings hold a 2-D table but do no GEMM.
    found: dict[str, list[str]] = defaultdict(list)
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if (
            weight is None or weight.dim() != 2 or type(module) is nn.Linear or backend_of(module) is not None
            or isinstance(module, (nn.Embedding, nn.EmbeddingBag))
        ):
            continue
        found[type(module).__name__].append(name)
    if not found:
        return ""
    listed = "; ".join(
        f"{kind} ({len(names)}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
        for kind, names in found.items()
    )
    return (
        f" Linear-like layers of other types, which FP8 does not convert (only exact nn.Linear is): {listed}."
    )


def _matches(entry: str | type, name: str, module: nn.Module) -> bool:
    return isinstance(module, entry) if isinstance(entry, type) else fnmatch.fnmatchcase(name, entry)


def _by_backend(layers: dict[str, type[FP8Backend]]) -> dict[type[FP8Backend], list[str]]:
    groups: dict[type[FP8Backend], list[str]] = defaultdict(list)
    for name, backend in layers.items():
        groups[backend].append(name)
    return groups


def export_recipe_map(model: nn.Module, config: FP8Config | str | None = None) -> dict[str, dict[str, Any]]:
    """The chosen per-layer recipes of ``model`` (converted): ``{qualified name: Recipe fields}`` as plain values
    (formats per role ``fprop``/``dgrad``/``wgrad``, blocks, scale rule, block scale floor, stochastic rounding,
    Hadamard, 4-over-6, per-tensor knobs); layers in the base precision are absent. ``yaml.safe_dump`` writes it; it
    is what to write by hand into TransformerEngine's ``CustomRecipe`` quantizer factory or Megatron's precision
    config file (neither reads ours). Native layers carry their own recipe (a per-module map's entry); the layers of
    another backend take ``config``'s.

    Raises:
        ValueError: a layer of another backend and no ``config`` (or a map config) to read its recipe from.
    """
    resolved = fp8_config(config)
    out: dict[str, dict[str, Any]] = {}
    for name in find_fp8_layers(model):
        layer_config = getattr(model.get_submodule(name), "fp8_config", None)
        if not isinstance(layer_config, FP8Config):
            if resolved is None:
                raise ValueError(f"export_recipe_map(model, config=None): {name!r} is a library FP8 layer, which keeps"
                                 " no recipe; pass the FP8Config it was converted with.")
            layer_config = resolved
        out[name] = layer_config.spec.as_dict()
    return out


def convert_to_fp8(model: nn.Module, config: FP8Config | str | None) -> list[str]:
    """Swap the layers :func:`select_fp8_modules` picks for the FP8 layers of ``config.backend``, in place; returns
    their names. They share the original parameters (optimizers built earlier keep working).

    ``config`` may be a recipe name (see :func:`fp8_config`); None converts nothing.
    """
    resolved = fp8_config(config)
    if resolved is None:
        return []
    backend = fp8_backend(resolved)
    names = select_fp8_modules(model, resolved)
    backend.convert_(model, names)
    return names


def convert_from_fp8(model: nn.Module, names: list[str] | None = None) -> list[str]:
    """Move FP8 layers (any backend) back to plain ``nn.Linear`` with the same parameters, in place; returns their
    names. ``names=None`` converts every FP8 layer. Their FP8 state (amax histories) is dropped.

    Raises:
        ValueError: a name is not an FP8 layer of ``model``.
    """
    layers = find_fp8_layers(model)
    names = list(layers) if names is None else list(names)
    unknown = [name for name in names if name not in layers]
    if unknown:
        raise ValueError(
            f"convert_from_fp8(names={names!r}): {unknown!r} are not FP8 layers; those are {list(layers)}."
        )
    for backend, group in _by_backend({name: layers[name] for name in names}).items():
        backend.revert_(model, group)
    return names


def fp8_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every FP8 layer's scaling state, keyed ``"<fqn>.<key>"`` (e.g. ``"fc2.amax_history"``).

    Plain tensors only (copies), so it saves and loads with ``torch.load(..., weights_only=True)``. Empty when no
    layer holds state (no FP8 layer, or a stateless recipe).
    """
    state: dict[str, torch.Tensor] = {}
    for backend, names in _by_backend(find_fp8_layers(model)).items():
        state.update(backend.state_dict(model, names))
    return state


def load_fp8_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Restore :func:`fp8_state_dict`'s output into the model's FP8 layers. Strict.

    Raises:
        KeyError: keys are missing or unknown (another recipe or filter, or layers moved back to base precision).
        ValueError: a shape differs (another ``amax_history_len``).
    """
    expected = fp8_state_dict(model)
    check_keys("load_fp8_state_dict", state, expected,
               suffix="; was it saved with another FP8 recipe or filter, or before/after a fallback moved layers back"
                      " to base precision?")
    for backend, names in _by_backend(find_fp8_layers(model)).items():
        prefixes = tuple(f"{name}." for name in names)
        backend.load_state_dict(model, names, {k: v for k, v in state.items() if k.startswith(prefixes)})


def collect_fp8_stats_(model: nn.Module, enabled: bool = True) -> None:
    """Turn per-layer FP8 telemetry on or off for every FP8 layer; off clears old stats. A backend that records
    none warns once when asked."""
    for backend, names in _by_backend(find_fp8_layers(model)).items():
        backend.collect_stats_(model, names, enabled)


def fp8_stats(model: nn.Module) -> dict[str, dict[str, torch.Tensor | float]]:
    """Latest FP8 telemetry: ``{fqn: stats}`` for layers that collected some, plus ``"total"``.

    Per layer, for each operand ``x``, ``w``, ``grad_out``: ``<t>_saturation_frac``, ``<t>_underflow_frac``,
    ``<t>_amax`` (0-dim tensors) and ``<t>_numel`` (a float). ``"total"`` holds ``fp8_saturation_frac`` and
    ``fp8_underflow_frac``: the fractions averaged over all operands of all layers, weighted by element count, as
    0-dim tensors (no host sync). The result is empty when no layer collected stats.
    """
    per_layer = {}
    for name, backend in find_fp8_layers(model).items():
        if stats := backend.layer_stats(model.get_submodule(name)):
            per_layer[name] = stats
    if not per_layer:
        return {}
    if _TOTAL in per_layer:
        raise RuntimeError(f"fp8_stats: a layer is named {_TOTAL!r}, which collides with the totals entry.")
    totals: dict[str, torch.Tensor | float] = {}
    for metric in ("saturation_frac", "underflow_frac"):
        weighted: list[torch.Tensor] = []
        count: list[float] = []
        for stats in per_layer.values():
            for tensor in FP8_TENSORS:
                if f"{tensor}_{metric}" in stats:
                    # fractions are 0-dim tensors (no host sync), sizes are floats: see FP8Linear.fp8_stats
                    fraction = cast(torch.Tensor, stats[f"{tensor}_{metric}"])
                    numel = cast(float, stats[f"{tensor}_numel"])
                    weighted.append(fraction * numel)
                    count.append(numel)
        totals[f"fp8_{metric}"] = torch.stack(weighted).sum() / sum(count)
    return {**per_layer, _TOTAL: totals}

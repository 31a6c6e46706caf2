"""Structured configs derived from the constructors: one dataclass per public constructor, plus ``_target_``.

Each schema is built from its constructor's signature (names, defaults and type hints), so the two cannot drift:
a new argument, a changed default or an ``int`` becoming ``int | None`` shows up in the schema by itself. A config is
only a schema: validation lives once, in the constructor. ``register_configs()`` puts the schemas in Hydra's
ConfigStore (``schema/<name>``), so a composed ``plugin.*`` or callback node is type-checked before anything is built.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import importlib
import inspect
import types
import typing
from typing import Any, Literal, Optional, Union

from omegaconf import MISSING

_PRIMITIVES = (bool, int, float, str)
_SEQUENCES = (list, tuple, set, frozenset, collections.abc.Sequence, collections.abc.Iterable,
              collections.abc.Collection)
_MAPPINGS = (dict, collections.abc.Mapping)


def schema_type(hint: Any) -> Any:
    """The closest type OmegaConf 2.3 can check for a constructor's type hint.

    ``int``, ``float``, ``str`` and enums stay; ``bool`` becomes ``Any`` (OmegaConf would read ``2`` as True); ``X |
    None`` becomes ``Optional[X]``; a ``Literal`` of strings becomes ``str`` (OmegaConf has no ``Literal``: the
    constructor checks the choice); sequences become ``list[X]`` and string-keyed mappings ``dict[str, X]``; unions of
    different kinds, classes and callables become ``Any`` (the constructor checks them).
    """
    if hint is bool:
        # OmegaConf reads 2, "yes" or "maybe" into a bool field as True: left unchecked here, the constructor's own
        # check refuses them by name (an override `true`/`false` is a bool already).
        return Any
    if hint is Any or hint in _PRIMITIVES or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return hint
    if hint in _SEQUENCES:
        return list[Any]
    if hint in _MAPPINGS:
        return dict[str, Any]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        kinds = {type(arg) for arg in args}
        return kinds.pop() if len(kinds) == 1 and kinds <= set(_PRIMITIVES) else Any
    if origin in (Union, types.UnionType):
        members = {schema_type(arg) for arg in args if arg is not type(None)}
        inner = members.pop() if len(members) == 1 else Any
        return Optional[inner] if type(None) in args and inner is not Any else inner
    if origin in _SEQUENCES:
        items = [arg for arg in args if arg is not Ellipsis]
        return types.GenericAlias(list, (_item_type(items[0]) if len(set(items)) == 1 else Any,))  # list[item]
    if origin in _MAPPINGS:
        key, value = args or (Any, Any)
        return types.GenericAlias(dict, (str, _item_type(value))) if key is str else Any  # dict[str, value]
    return Any


def _item_type(hint: Any) -> Any:
    # An item that is itself a container, a class or a union of kinds stays unchecked (Any): the constructor checks it.
    item = schema_type(hint)
    base = typing.get_args(item)[0] if typing.get_origin(item) is Union else item
    return item if base in _PRIMITIVES or (isinstance(base, type) and issubclass(base, enum.Enum)) else Any


def _field(name: str, hint: Any, default: Any, owner: str) -> tuple[str, Any, Any]:
    # The third item is a dataclasses.Field (typeshed types field(default=x) as x's type, for dataclass bodies).
    if default is inspect.Parameter.empty:
        return name, hint, dataclasses.field(default=MISSING)
    if isinstance(default, (tuple, list, set, frozenset)):
        items = list(default)
        return name, hint, dataclasses.field(default_factory=lambda: list(items))
    if isinstance(default, dict):
        entries = dict(default)
        return name, hint, dataclasses.field(default_factory=lambda: dict(entries))
    if default is None or isinstance(default, (*_PRIMITIVES, enum.Enum)):
        return name, hint, dataclasses.field(default=default)
    raise TypeError(
        f"derive_schema({owner}): the default of {name!r} is {default!r}, which a config cannot hold; give the"
        " constructor a plain default (None, a number, a string, a list) or a hand-written schema."
    )


def derive_schema(target: str | type, *, name: str | None = None) -> type:
    """A dataclass mirroring the constructor ``target`` (a class, or its import path, which becomes ``_target_``):
    one field per argument, with its default and :func:`schema_type` of its hint. ``name`` defaults to the class
    name + ``Config``.

    Raises:
        TypeError: an annotation does not evaluate (a name imported only under ``TYPE_CHECKING``?), or a default is
            not a plain value.
    """
    if isinstance(target, str):
        module, _, attribute = target.rpartition(".")
        constructor = getattr(importlib.import_module(module), attribute)
    else:
        constructor, attribute = target, target.__name__
        target = f"{target.__module__}.{target.__qualname__}"
    signature = inspect.signature(constructor)
    annotated = constructor if dataclasses.is_dataclass(constructor) else constructor.__init__
    try:
        hints = typing.get_type_hints(annotated)
    except NameError as error:
        raise TypeError(f"derive_schema({target!r}): an annotation does not evaluate ({error}).") from error
    fields: list[tuple[str, Any, Any]] = [("_target_", str, dataclasses.field(default=target))]
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        fields.append(_field(param.name, schema_type(hints.get(param.name, Any)), param.default, target))
    schema = dataclasses.make_dataclass(name or f"{attribute}Config", fields)
    schema.__module__ = __name__  # where ours live: lit_mpstable.app.config.StablePrecisionConfig (pickle, reprs)
    schema.__doc__ = f"Schema of ``{target}``, derived from its signature (fields, defaults, types)."
    return schema


StablePrecisionConfig = derive_schema("lit_mpstable.StablePrecision")
DynamicLossScalerConfig = derive_schema("lit_mpstable.core.scaling.loss_scaler.DynamicLossScaler")
StaticLossScalerConfig = derive_schema("lit_mpstable.core.scaling.loss_scaler.StaticLossScaler")
AdaptiveLossScalerConfig = derive_schema("lit_mpstable.core.scaling.adaptive_scaler.AdaptiveLossScaler")
FP8RecipeConfig = derive_schema("lit_mpstable.fp8.FP8Config", name="FP8RecipeConfig")
OverflowMonitorConfig = derive_schema("lit_mpstable.callbacks.OverflowMonitor")
PrecisionFallbackConfig = derive_schema("lit_mpstable.callbacks.PrecisionFallback")
PrecisionProbeConfig = derive_schema("lit_mpstable.callbacks.PrecisionProbe")
ScaleCheckpointConfig = derive_schema("lit_mpstable.callbacks.ScaleCheckpoint")
AMPPreflightConfig = derive_schema("lit_mpstable.callbacks.AMPPreflight")
FaultTriageConfig = derive_schema("lit_mpstable.callbacks.FaultTriage")
PreemptionCheckpointConfig = derive_schema("lit_mpstable.callbacks.PreemptionCheckpoint")
SpikeGuardConfig = derive_schema("lit_mpstable.SpikeGuard")
"""``plugin.spike_guard``: ``null`` (the default: off) or ``{_target_: lit_mpstable.SpikeGuard, zscore: 6.0, ...}``."""

SCHEMAS: dict[str, type] = {
    "stable_precision": StablePrecisionConfig,
    "dynamic_loss_scaler": DynamicLossScalerConfig,
    "static_loss_scaler": StaticLossScalerConfig,
    "adaptive_loss_scaler": AdaptiveLossScalerConfig,
    "fp8_recipe": FP8RecipeConfig,
    "overflow_monitor": OverflowMonitorConfig,
    "precision_fallback": PrecisionFallbackConfig,
    "precision_probe": PrecisionProbeConfig,
    "scale_checkpoint": ScaleCheckpointConfig,
    "amp_preflight": AMPPreflightConfig,
    "spike_guard": SpikeGuardConfig,
    "fault_triage": FaultTriageConfig,
    "preemption_checkpoint": PreemptionCheckpointConfig,
}
"""ConfigStore names (``schema/<name>``) of the schemas; the YAML options under ``callbacks/`` and ``scaler/`` use
the same names."""


def register_configs() -> None:
    """Store every schema in Hydra's ConfigStore under the group ``schema`` (``schema/stable_precision``, ...).

    Call it before ``@hydra.main`` runs (at import of your app) to have the lit_mpstable nodes type-checked: the
    ``callbacks/`` and ``scaler/`` options pick their schema up when it is registered.
    """
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        store.store(group="schema", name=name, node=node)

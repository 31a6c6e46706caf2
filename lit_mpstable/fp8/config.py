"""FP8Config, its validation, and the preset factory keyed by recipe name."""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args

import torch
from torch import nn

from lit_mpstable.base.validate import int_arg
from lit_mpstable.fp8.recipe import Recipe, recipe_names, resolve
from lit_mpstable.fp8.schedule import ScheduleArg, check_schedule

FP8Recipe = Literal["delayed", "current", "mxfp8", "blockwise", "mxfp4", "nvfp4"]
"""The built-in recipe names (the registry, :func:`lit_mpstable.fp8.recipe_names`, may hold more)."""
RecipeMap = Mapping[str, Union[str, Recipe]]
BudgetRule = Literal["probe", "last"]
FP8Format = Literal["hybrid", "e4m3"]
FP8BackendName = Literal["native", "torchao", "transformer_engine"]
AmaxComputeAlgo = Literal["max", "most_recent"]
ConformanceAction = Literal["raise", "native", "off"]
ModuleFilter = Union[Sequence[Union[str, type]], Callable[[nn.Module, str], bool], None]


@dataclass(frozen=True)
class HighPrecisionBudget:
    """Keep at most ``fraction`` of the linear parameters in the base precision, chosen ``by`` a rule.

    - ``by="probe"``: early in the run (within the first 2% of steps) each low-precision layer's weight-gradient
      error against the base precision is measured on a real batch
      (:func:`lit_mpstable.fp8.choose_high_precision`), and the layers that cost most go back to the base
      precision, as many as fit in the budget.
    - ``by="last"``: the fixed rule of NVIDIA's NVFP4 recipe: the last linear layers (in ``named_modules`` order)
      holding up to ``fraction`` of the linear parameters, decided when the layers are selected.

    Raises:
        ValueError: ``fraction`` outside (0, 1) or ``by`` unknown.
        TypeError: ``fraction`` is not a real number.
    """

    fraction: float = 0.15
    """Share of all ``nn.Linear`` weight elements that may stay in high precision; the NVFP4 paper keeps ~15%."""
    by: BudgetRule = "probe"

    def __post_init__(self) -> None:
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)):
            raise TypeError(f"HighPrecisionBudget(fraction={self.fraction!r}): fraction must be a number in (0, 1),"
                            " e.g. 0.15.")
        if not 0.0 < float(self.fraction) < 1.0:
            raise ValueError(f"HighPrecisionBudget(fraction={self.fraction!r}): fraction must lie in (0, 1), the "
                             "share of linear parameters kept in high precision; 0.15 is the NVFP4 recipe's. To keep "
                             "none use keep_high_precision=[] ; for all, fp8=None.")
        if self.by not in get_args(BudgetRule):
            raise ValueError(f"HighPrecisionBudget(by={self.by!r}): by must be one of {list(get_args(BudgetRule))}.")


KeepHighPrecision = Union[Literal["first_last"], Sequence[str], HighPrecisionBudget]


@dataclass(frozen=True)
class FP8Config:
    """Which ``nn.Linear`` layers run their three GEMMs in FP8, and how their scales are chosen.

    The recipes (``"delayed"``, ``"current"``, ``"mxfp8"``, ``"blockwise"``, ``"mxfp4"``, ``"nvfp4"`` and any
    registered one) are data: :class:`~lit_mpstable.fp8.Recipe`; docs/fp8-recipes.md tabulates their formats, blocks
    and scales. ``format`` and ``margin`` apply to the per-tensor recipes (``format`` also picks mxfp8's gradient
    dtype); the block recipes fix their own element formats.

    Raises:
        ValueError: a field is out of range (the message names the field, the value and what is allowed).
        TypeError: ``filter`` is neither None, a callable, nor a list of names, patterns and module types.
    """

    recipe: Union[FP8Recipe, str, Recipe, RecipeMap] = "delayed"
    """A registered recipe name, a :class:`~lit_mpstable.fp8.Recipe`, or a per-module map ``{"glob.pattern.*": name |
    Recipe, ..., "default": name | Recipe}``: each eligible layer takes the first pattern (fnmatch on its qualified
    name) that matches it, else ``"default"``, else stays in the base precision. Kept as given (a map as a tuple of
    pairs); :attr:`spec` is the resolved Recipe."""
    format: FP8Format = "hybrid"
    """``"hybrid"``: E4M3 for inputs and weights, E5M2 for gradients; ``"e4m3"``: E4M3 for all three."""
    margin: int = 0
    """Scales are divided by ``2**margin`` (headroom above the amax), as TransformerEngine's ``margin``."""
    amax_history_len: int = 1024
    """Steps of amax kept per tensor by the delayed recipe (TransformerEngine's default)."""
    amax_compute_algo: AmaxComputeAlgo = "max"
    """Delayed recipe: the amax is the max over the history, or the most recent entry."""
    filter: ModuleFilter = None
    """None = default rule (every nn.Linear but the first and last, dims multiples of 16); else a list of
    qualified names / fnmatch patterns / module types, or a callable ``(module, fqn) -> bool``."""
    backend: FP8BackendName = "native"
    """``"native"``: this package's FP8Linear; ``"torchao"`` / ``"transformer_engine"``: those libraries' layers."""
    emulate: bool | None = None
    """None = ``torch._scaled_mm`` on a GPU that runs it, else exact emulation (on a CPU too, but for the delayed
    recipe and the torchao backend: torch's CPU kernel gives the same product, up to thousands of times slower);
    True/False force one."""
    keep_high_precision: KeepHighPrecision = "first_last"
    """Which linear layers stay in the base precision when ``filter`` is None: ``"first_last"`` (the first and
    the last), a list of qualified names / fnmatch patterns (those, and no others), or a
    :class:`HighPrecisionBudget`. Explicit names also apply on top of an explicit ``filter``."""
    conformance: ConformanceAction = "raise"
    """``backend="torchao"`` / ``"transformer_engine"``: at setup the backend's quantized values and scales on a few
    probe tensors, and a probe layer's gradients, are checked against our reference for the recipe
    (:func:`~lit_mpstable.fp8.native.check_conformance`). On a mismatch, or all-zero or non-finite gradients:
    ``"raise"`` refuses the backend (a ValueError with the numbers), ``"native"`` warns with them and runs the recipe
    on ``backend="native"`` (exact emulation), ``"off"`` skips the check."""
    schedule: ScheduleArg = None
    """A :class:`~lit_mpstable.fp8.PrecisionSchedule` (or a list of them): formats of chosen layers and roles change
    in process at a step, at the start of LR decay or on a trigger (the precision plugin applies it; kept as a
    tuple)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", check_schedule(self.schedule, "FP8Config(schedule") or None)
        self._resolve_recipe()
        for name, allowed in (
            ("format", FP8Format),
            ("backend", FP8BackendName),
            ("amax_compute_algo", AmaxComputeAlgo),
            ("conformance", ConformanceAction),
        ):
            value = getattr(self, name)
            if value not in get_args(allowed):
                raise ValueError(f"FP8Config({name}={value!r}): {name} must be one of {list(get_args(allowed))}.")
        # 2**margin must stay a normal float32 factor; the history lives on the device, three rows per layer.
        int_arg("FP8Config", "margin", self.margin, low=0, high=64,
                unit="scales shrink by 2**margin; 0 is usual")
        int_arg("FP8Config", "amax_history_len", self.amax_history_len, low=1, high=2**16,
                unit="steps of amax per tensor; 1024 is TransformerEngine's default")
        if self.emulate is not None and not isinstance(self.emulate, bool):
            raise TypeError(f"FP8Config(emulate={self.emulate!r}): emulate must be None (auto), True or False.")
        object.__setattr__(self, "filter", _check_filter(self.filter))
        object.__setattr__(self, "keep_high_precision", _check_keep(self.keep_high_precision))
        if isinstance(self.keep_high_precision, HighPrecisionBudget) and self.filter is not None:
            raise ValueError(
                f"FP8Config(filter={self.filter!r}, keep_high_precision={self.keep_high_precision!r}): a budget chooses"
                " among all eligible layers, which an explicit filter overrides; use one of the two (filter=None with"
                " the budget, or a filter with a list of names to keep)."
            )
        self._check_backend()

    def _resolve_recipe(self) -> None:
        # A name or a Recipe resolves to one spec; a map to (pattern, spec) pairs and an optional default.
        value = self.recipe
        pairs: tuple[tuple[str, Recipe], ...] = ()
        if isinstance(value, Mapping):
            if not value:
                raise ValueError("FP8Config(recipe={}): an empty map selects no layer; use fp8=None to turn FP8 off.")
            items = [(str(k), resolve(v, f"FP8Config(recipe={{{k!r}: {v!r}}})")) for k, v in value.items()]
            if bad := [k for k, _ in items if not k.strip()]:
                raise ValueError(f"FP8Config(recipe={dict(value)!r}): an empty pattern {bad!r}; name layers by fnmatch"
                                 " patterns of their qualified names, or use 'default'.")
            default = next((spec for k, spec in items if k == "default"), None)
            pairs = tuple((k, self._with_scaling(spec)) for k, spec in items if k != "default")
            spec = self._with_scaling(default) if default is not None else None
            object.__setattr__(self, "recipe", tuple((k, v) for k, v in value.items()))
        elif isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value) and value:
            object.__setattr__(self, "recipe", dict(value))
            return self._resolve_recipe()
        else:
            if not isinstance(value, (str, Recipe)):
                raise ValueError(f"FP8Config(recipe={value!r}): recipe must be a registered name {recipe_names()}, a"
                                 " Recipe, or a map {'glob.pattern.*': name | Recipe, 'default': ...}.")
            if isinstance(value, str) and value not in recipe_names():
                raise ValueError(f"FP8Config(recipe={value!r}): recipe must be one of {recipe_names()} (or a Recipe,"
                                 " or a per-module map).")
            spec = self._with_scaling(resolve(value, f"FP8Config(recipe={value!r})"))
        object.__setattr__(self, "_spec", spec)
        object.__setattr__(self, "_map", pairs)

    def _with_scaling(self, spec: Recipe) -> Recipe:
        # FP8Config's per-tensor knobs, where set, are the recipe's; a Recipe that sets them keeps its own.
        changes = {}
        for field in ("margin", "amax_history_len", "amax_compute_algo"):
            mine, default = getattr(self, field), _DEFAULTS[field]
            if mine != default and getattr(spec, field) != mine:
                if getattr(spec, field) != default:
                    raise ValueError(f"FP8Config({field}={mine!r}, recipe=Recipe({spec.name!r}, {field}="
                                     f"{getattr(spec, field)!r})): two values for {field}; set it in one place.")
                changes[field] = mine
        return dataclasses.replace(spec, **changes) if changes else spec

    @property
    def spec(self) -> Recipe:
        """The resolved :class:`~lit_mpstable.fp8.Recipe` (a map's ``"default"``; see :meth:`for_layer`).

        Raises:
            ValueError: a map without ``"default"``: each layer has its own (:meth:`for_layer`).
        """
        spec = self.__dict__.get("_spec")
        if spec is None:
            raise ValueError(f"FP8Config(recipe={self.recipe!r}).spec: a per-module map without 'default' has no"
                             " single recipe; use config.for_layer(name).")
        return spec

    @property
    def recipe_name(self) -> str:
        """The recipe's name, or ``"map"`` for a per-module map."""
        return "map" if self.is_map else self.spec.name

    @property
    def is_map(self) -> bool:
        """Whether ``recipe`` is a per-module map."""
        return bool(self.__dict__.get("_map"))

    def for_layer(self, name: str) -> FP8Config | None:
        """The config of the layer ``name``: this one for a single recipe; for a map, this config with the first
        matching pattern's recipe (else ``"default"``'s), or None (the layer stays in the base precision)."""
        if not self.is_map:
            return self
        spec = next((s for pattern, s in self.__dict__["_map"] if fnmatch.fnmatchcase(name, pattern)),
                    self.__dict__.get("_spec"))
        return None if spec is None else dataclasses.replace(self, recipe=spec)

    def map_patterns(self) -> list[str]:
        """A map's patterns, in order (empty for a single recipe)."""
        return [pattern for pattern, _ in self.__dict__.get("_map", ())]

    def _check_backend(self) -> None:
        # What the optional backends cannot express is refused here, not ignored at conversion time.
        call = f"FP8Config(recipe={self.recipe!r}, backend={self.backend!r}"
        if self.backend != "native" and self.is_map:
            raise ValueError(f"{call}): a per-module recipe map runs on backend='native'; the libraries take one recipe"
                             " per model here (export the map with export_recipe_map to configure them by hand).")
        if self.backend == "native":
            return
        spec = self.spec
        if self.margin and not spec.history:
            raise ValueError(
                f"{call}, margin={self.margin!r}): {self.backend} applies a margin only to the delayed recipe."
            )
        if self.backend == "transformer_engine" and self.emulate:
            raise ValueError(f"{call}, emulate=True): TransformerEngine has no emulation; use backend='native'.")
        if self.backend == "torchao" and spec.history:
            raise ValueError(f"{call}): torchao removed delayed scaling; use recipe='current', or backend='native'.")
        if self.backend == "transformer_engine" and spec.fp4 and spec.info("fprop").mx:
            raise ValueError(f"{call}): TransformerEngine has no MXFP4 training recipe (its FP4 recipe is"
                             " NVFP4BlockScaling); use recipe='nvfp4', or backend='native' for MXFP4 emulated exactly.")
        if self.backend == "torchao" and spec.blocked and not spec.mx_uniform and self.emulate:
            raise ValueError(f"{call}, emulate=True): torchao runs {spec.name} only through its GPU kernels; use"
                             " backend='native', which emulates it exactly on any device.")
        if self.backend == "torchao" and spec.mx_uniform and self.format == "hybrid":
            raise ValueError(
                f"{call}, format='hybrid'): torchao's MXFP8 training casts gradients to E4M3 as well;"
                " set format='e4m3'."
            )

    @property
    def block_size(self) -> int:
        """What a layer's in/out features must be multiples of for this recipe's emulated GEMMs (1: partial blocks are
        zero-padded, as for mxfp8 and blockwise)."""
        if self.is_map:
            specs = [s for _, s in self.__dict__["_map"]] + ([self.spec] if self.__dict__.get("_spec") else [])
            return max(s.multiple for s in specs)
        return self.spec.multiple

    @property
    def forward_dtype(self) -> torch.dtype:
        """The FP8 dtype of inputs and weights."""
        return torch.float8_e4m3fn

    @property
    def grad_dtype(self) -> torch.dtype:
        """The FP8 dtype of output gradients."""
        return torch.float8_e5m2 if self.format == "hybrid" else torch.float8_e4m3fn


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(FP8Config)}


def _check_filter(value: ModuleFilter) -> ModuleFilter:
    # A list becomes a tuple so the frozen config stays hashable and nobody edits it behind our back.
    if value is None or callable(value) and not isinstance(value, type):
        return value
    if isinstance(value, (str, type)):
        value = (value,)
    if not isinstance(value, Sequence):
        raise TypeError(
            f"FP8Config(filter={value!r}): filter must be None, a callable (module, fqn) -> bool, or a list of"
            " qualified names, fnmatch patterns and module types."
        )
    for item in value:
        if isinstance(item, str) and not item.strip():
            # "" names the root: as an ancestor of every layer it would select them all.
            raise ValueError(f"FP8Config(filter={list(value)!r}): an empty name would select every layer; name layers"
                             " or patterns, or use filter=None for the default rule.")
        if not (isinstance(item, str) or isinstance(item, type) and issubclass(item, nn.Module)):
            raise TypeError(
                f"FP8Config(filter=[..., {item!r}, ...]): each filter entry must be a qualified name, an fnmatch"
                " pattern or an nn.Module subclass."
            )
    if not value:
        raise ValueError("FP8Config(filter=[]): an empty filter selects no layer; use fp8=None to turn FP8 off.")
    return tuple(value)


def _check_keep(value: Any) -> KeepHighPrecision:
    allowed = ("keep_high_precision must be 'first_last', a list of layer names or fnmatch patterns, or"
               " HighPrecisionBudget(fraction=0.15, by='probe' | 'last')")
    if isinstance(value, HighPrecisionBudget):
        return value
    if isinstance(value, str):
        if value != "first_last":
            raise ValueError(
                f"FP8Config(keep_high_precision={value!r}): {allowed}; a single layer name goes in a list."
            )
        return value
    if not isinstance(value, Sequence) or not all(isinstance(item, str) and item.strip() for item in value):
        raise TypeError(f"FP8Config(keep_high_precision={value!r}): {allowed}.")
    return tuple(value)


def fp8_config(name: str | FP8Config | Mapping[str, Any] | None) -> FP8Config | None:
    """The preset for a recipe name (``"delayed"``, ``"current"``, ``"mxfp8"``, ``"blockwise"``, ``"mxfp4"``,
    ``"nvfp4"``); an FP8Config or None passes through.

    ``fp8_config("delayed") == FP8Config(recipe="delayed")``, so ``fp8="delayed"`` in Python or YAML and the
    explicit config build the same object. A mapping (e.g. a Hydra node ``{recipe: delayed, margin: 1}``) gives
    ``FP8Config(**mapping)``.

    Raises:
        ValueError: an unknown recipe name.
        TypeError: neither a string, an FP8Config nor None.
    """
    if name is None or isinstance(name, FP8Config):
        return name
    if isinstance(name, Recipe):
        return FP8Config(recipe=name)
    if isinstance(name, Mapping):
        fields = {str(key): value for key, value in name.items() if key != "_target_"}
        known = [f.name for f in dataclasses.fields(FP8Config)]
        if unknown := sorted(set(fields) - set(known)):
            raise ValueError(f"fp8={dict(name)!r}: unknown FP8Config fields {unknown}; the fields are {known}.")
        return FP8Config(**fields)
    if not isinstance(name, str):
        raise TypeError(f"fp8_config({name!r}): expected a recipe name, an FP8Config, a mapping of its fields or None.")
    if name not in recipe_names():
        raise ValueError(f"fp8_config({name!r}): unknown FP8 recipe; allowed: {recipe_names()} or None.")
    return FP8Config(recipe=name)

"""FSDP2 (``fully_shard``) and the precision core: the MixedPrecisionPolicy each precision asks for, and the check
that a sharded model was given it.

Under FSDP2 the FP32 master weights are FSDP2's own: every rank keeps its shard of the parameters in FP32 and the
optimizer updates those; ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` makes the
all-gathered copies, hence forward and backward, 16-bit, and reduces the gradients in FP32. No second copy. The policy
is fixed per ``fully_shard`` unit when it is applied, so the precision layout of a sharded model (its 16-bit dtype,
FP32 islands: units of their own with :func:`island_mp_policy`, FP8 layers) is decided before sharding
(``plugin.convert_module(self)`` at the top of ``configure_model``, ``docs/scale-out.md``) and checked after
(:func:`check_fsdp_policies`). A fallback can widen ``*-mixed`` runs only: a unit's compute dtype and its FP8 layers
are fixed once sharded.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import nn

from lit_mpstable.fp8.config import FP8Config

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

_DTYPES = {"16-true": torch.float16, "bf16-true": torch.bfloat16, "16-mixed": torch.float16,
           "bf16-mixed": torch.bfloat16}
_NAMES: dict[torch.dtype | None, str] = {torch.float16: "torch.float16", torch.bfloat16: "torch.bfloat16",
                                        torch.float32: "torch.float32"}


def _policy_class() -> type[MixedPrecisionPolicy]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy


def mp_policy(precision: str, *, master_weights: bool = True) -> MixedPrecisionPolicy:
    """The ``MixedPrecisionPolicy`` to pass to every ``fully_shard`` call for ``precision``.

    - ``"bf16-true"`` / ``"16-true"`` with master weights: ``param_dtype`` the 16-bit dtype, ``reduce_dtype`` FP32:
      FP32 sharded parameters (the masters) computed in 16 bits, gradients reduced in FP32.
    - ``*-true`` without master weights: parameters already 16-bit (nothing to cast), reduced in FP32.
    - ``"*-mixed"`` and ``"32-true"``: no ``param_dtype`` (autocast computes over the FP32 parameters), FP32 reduce.
    """
    if precision in ("16-true", "bf16-true") and master_weights:
        return _policy_class()(param_dtype=_DTYPES[precision], reduce_dtype=torch.float32)
    return _policy_class()(reduce_dtype=torch.float32)


def island_mp_policy(precision: str) -> MixedPrecisionPolicy:
    """The policy of an FP32 island's own ``fully_shard`` unit: FP32 compute inside (no ``param_dtype``), FP32
    reduce, and in ``*-true`` modes the output cast back to the 16-bit dtype the next layer computes in."""
    output = _DTYPES[precision] if precision in ("16-true", "bf16-true") else None
    return _policy_class()(reduce_dtype=torch.float32, output_dtype=output)


def fsdp_units(module: nn.Module) -> dict[str, MixedPrecisionPolicy]:
    """``{qualified name: MixedPrecisionPolicy}`` of the submodules of ``module`` (itself included, as ``""``) that
    ``fully_shard`` has made FSDP2 units; empty for a model that is not sharded."""
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError:  # a torch build without torch.distributed
        return {}
    # FSDP2 has no public getter for a unit's policy; its state object (fully_shard.state) keeps the one it was given.
    # fully_shard's contract decorator adds .state at run time; its stubs type it as a plain overloaded function.
    return {name: fully_shard.state(unit)._mp_policy for name, unit in module.named_modules()  # type: ignore[attr-defined]
            if isinstance(unit, FSDPModule)}


class DtypeRow(TypedDict):
    """One row of :func:`fsdp2_dtype_table`."""

    unit: str
    params: int
    param_dtype: str | None
    reduce_dtype: str | None
    shards: int | None
    output_dtype: str | None


def fsdp2_dtype_table(module: nn.Module) -> list[DtypeRow]:
    """One row per ``fully_shard`` unit of ``module`` (outermost first): what it computes, reduces and returns in.

    Keys: ``unit`` (qualified name, ``""`` for the root), ``params`` (elements it manages, its own and not a nested
    unit's), ``param_dtype`` (the dtype forward and backward compute in: the policy's ``param_dtype``, else the
    parameters' own), ``reduce_dtype`` (the gradient reduce-scatter's: the policy's ``reduce_dtype``, else the compute
    dtype, as FSDP2 does), ``output_dtype`` (the policy's, else None: outputs stay as computed), ``shards`` (the
    size of the mesh the unit's parameters are spread over: the data-parallel size its gradients are reduced across;
    None for a unit without parameters of its own).
    Empty for a model no ``fully_shard`` reached. Strings, so the rows go into ``plugin.stats`` and reports as they are.
    """
    units = fsdp_units(module)
    def name(dtype: torch.dtype | None) -> str | None:
        return None if dtype is None else _NAMES.get(dtype, str(dtype))

    # A unit without parameters of its own (a root over sharded blocks) shows its policy's dtypes.
    rows: dict[str, DtypeRow]
    rows = {unit: {"unit": unit, "params": 0, "param_dtype": name(policy.param_dtype),
                   "reduce_dtype": name(policy.reduce_dtype or policy.param_dtype), "shards": None,
                   "output_dtype": name(policy.output_dtype)} for unit, policy in units.items()}
    for qualified, param in module.named_parameters():
        unit = _owner(qualified, units)
        if unit is None:
            continue
        row, policy = rows[unit], units[unit]
        row["params"] += param.numel()
        compute = policy.param_dtype or param.dtype
        row["param_dtype"], row["reduce_dtype"] = name(compute), name(policy.reduce_dtype or compute)
        mesh = getattr(param, "device_mesh", None)  # FSDP2's parameters are DTensors on the unit's mesh
        row["shards"] = max(row["shards"] or 1, mesh.size() if mesh is not None else 1)
    return sorted(rows.values(), key=lambda row: (row["unit"].count(".") + bool(row["unit"]), row["unit"]))


_16BIT = ("torch.float16", "torch.bfloat16")


def reduce_dtype_warning(rows: Iterable[Mapping[str, Any]]) -> str | None:
    """Why reducing gradients in 16 bits is risky, for the units of :func:`fsdp2_dtype_table` that do (None when
    none does)."""
    rows = [row for row in rows if row["reduce_dtype"] in _16BIT and row["params"]]
    if not rows:
        return None
    names = [row["unit"] or "<root>" for row in rows]
    dtypes = sorted({row["reduce_dtype"] for row in rows})
    ranks = max(row["shards"] or 1 for row in rows)
    return (
        f"FSDP2 units {names[:6]}{'...' if len(names) > 6 else ''} reduce gradients in {'/'.join(dtypes)} across"
        f" {ranks} data-parallel rank(s): every partial sum of the reduce-scatter is rounded to 8 (BF16) or 11 (FP16)"
        " bits, an error that grows with the data-parallel size. BF16 gradient reduction destabilised a run at 48"
        " nodes x 8 GPUs (384 data-parallel ranks; pytorch#106395) that FP32 reduction fixed. Pass"
        " MixedPrecisionPolicy(reduce_dtype=torch.float32) (plugin.mp_policy does)."
    )


def _show(policy: object) -> str:
    fields = [f"{key}={_NAMES.get(getattr(policy, key), getattr(policy, key))}"
              for key in ("param_dtype", "reduce_dtype", "output_dtype") if getattr(policy, key) is not None]
    return f"MixedPrecisionPolicy({', '.join(fields)})"


def _owner(name: str, units: Iterable[str]) -> str | None:
    """The innermost unit whose subtree holds the parameter ``name`` (FSDP2 manages it there), or None."""
    owners = [unit for unit in units if unit == "" or name.startswith(unit + ".")]
    return max(owners, key=len) if owners else None


def check_fsdp_policies(
    module: nn.Module, precision: str, *, master_weights: bool, islands: Iterable[str] = (),
    owner: str = "StablePrecision",
) -> None:
    """Check that the ``fully_shard`` units of ``module`` compute and reduce in the formats ``precision`` asks for.

    Every trainable parameter must be managed by a unit (else its gradient is never reduced across ranks). A unit
    managing parameters outside the ``islands`` (qualified module names) needs :func:`mp_policy`'s dtypes and
    parameters in the matching dtype (FP32 masters; 16-bit without masters); a unit inside an island needs FP32
    compute (:func:`island_mp_policy`). ``output_dtype`` and ``cast_forward_inputs`` are the user's choice. A unit
    that reduces in 16 bits (accepted without master weights) warns with :func:`reduce_dtype_warning`.

    Raises:
        ValueError: a mismatch, naming the module, the policy found and what to pass instead.
    """
    units = fsdp_units(module)
    if not units:
        return
    islands = tuple(islands)
    true_16bit = precision in ("16-true", "bf16-true")
    dtype = _DTYPES.get(precision, torch.float32)
    call = f"{owner}({precision!r}{', master_weights=False' if true_16bit and not master_weights else ''}) with FSDP2"
    unmanaged = []
    for name, param in module.named_parameters():
        unit = _owner(name, units)
        if unit is None:
            if param.requires_grad:
                unmanaged.append(name)
            continue
        if not param.is_floating_point():
            continue
        island = next((prefix for prefix in islands if name.startswith(prefix + ".")), None)
        policy = units[unit]
        want = island_mp_policy(precision) if island else mp_policy(precision, master_weights=master_weights)
        problem = _mismatch(policy, param.dtype, precision, dtype, island=island is not None, masters=master_weights)
        if problem:
            where = f"module {unit!r}" if unit else "root module"
            if island is not None:
                where = f"FP32 island {island!r}" + (f" (in the {where})" if unit != island else "")
            raise ValueError(
                f"{call}: {where} (parameter {name!r}, {param.dtype}) was sharded with {_show(policy)}; {problem}."
                f" Pass fully_shard({'the island' if island else '...'}, mp_policy={_show(want)})"
                f" (plugin.{'island_mp_policy' if island else 'mp_policy'})"
                + (" as its own unit, before its parent." if island is not None and unit != island else ".")
            )
    if not unmanaged and (warning := reduce_dtype_warning(fsdp2_dtype_table(module))):
        warnings.warn(warning, stacklevel=3)  # accepted (no masters to protect), but not where it scales
    if unmanaged:
        raise ValueError(
            f"{call}: parameters {unmanaged[:6]}{'...' if len(unmanaged) > 6 else ''} belong to no fully_shard unit, so"
            " their gradients are not reduced across ranks (and they compute in their own dtype). Shard the root"
            " module as well: fully_shard(model, mp_policy=plugin.mp_policy) after its blocks."
        )


def _mismatch(
    policy: MixedPrecisionPolicy, param_dtype: torch.dtype, precision: str, dtype: torch.dtype, *, island: bool,
    masters: bool,
) -> str | None:
    """Why ``policy`` over a parameter of ``param_dtype`` does not give ``precision`` (None when it does)."""
    compute = policy.param_dtype or param_dtype  # FSDP2 computes in param_dtype, else in the parameter's own dtype
    fp32_reduce = policy.reduce_dtype in (None, torch.float32) if compute == torch.float32 else \
        policy.reduce_dtype == torch.float32
    true_16bit = precision in ("16-true", "bf16-true")
    if island or not true_16bit:
        if param_dtype != torch.float32:
            return "its parameters must stay FP32 (autocast and FP32 islands compute over FP32 parameters)"
        if compute != torch.float32:
            return (f"param_dtype={_NAMES.get(compute, compute)} computes outside autocast"
                    f"{' in an FP32 island' if island else ''}; leave param_dtype unset")
        if not fp32_reduce:
            return f"reduce_dtype={_NAMES.get(policy.reduce_dtype)} rounds FP32 gradients; reduce in FP32"
        return None
    if masters:
        if param_dtype != torch.float32:
            return ("the sharded parameters are the FP32 masters, so they must be FP32 (build the model in FP32; the"
                    " plugin's init context does so with master weights)")
        if compute != dtype:
            return f"the model must compute in {_NAMES[dtype]}: set param_dtype={_NAMES[dtype]}"
        if not fp32_reduce:
            return "reduce_dtype must be torch.float32: the masters accumulate FP32 gradient sums"
        return None
    if param_dtype != dtype or compute != dtype:
        return (f"without master weights the parameters themselves are {_NAMES[dtype]} (convert_module casts them"
                " before fully_shard) and param_dtype is unset")
    return None


def check_fsdp2_setup(
    owner: str, precision: str, *, master_mode: str | None, fp8: FP8Config | None, sharded_before_fp8: bool
) -> None:
    """What FSDP2 cannot take, refused when the model is set up (before or after ``fully_shard``).

    Raises:
        ValueError: ``master_weights="kahan"``/``"stochastic"`` (FSDP2 keeps FP32 shards instead), or FP8 asked for
            a model sharded before its layers were swapped (``sharded_before_fp8``).
    """
    call = f"{owner}({precision!r}"
    if master_mode in ("kahan", "stochastic"):
        raise ValueError(
            f"{call}, master_weights={master_mode!r}) with FSDP2: FSDP2 keeps each rank's shard of the parameters in"
            " FP32 and computes in 16 bits (its MixedPrecisionPolicy): FP32-master quality at a fraction of the"
            " memory per rank. Use master_weights=True with fully_shard(..., mp_policy=plugin.mp_policy)."
        )
    if sharded_before_fp8 and fp8 is not None:  # (set only with FP8)
        raise ValueError(
            f"{call}, fp8={fp8.recipe!r}) with FSDP2: the model was sharded before its FP8 layers were swapped in, and"
            " FSDP2 binds parameters to the layer objects it sharded. Call"
            " self.trainer.precision_plugin.convert_module(self) at the top of configure_model, before fully_shard"
            " (the strategy's own call afterwards changes nothing)."
        )


def unsharded_message(owner: str, precision: str, module: nn.Module) -> str:
    """Why a ``*-true`` run under FSDP2 whose model no ``fully_shard`` reached cannot train (it would be FP32)."""
    return (
        f"{owner}({precision!r}) with FSDP2: no module of {type(module).__name__} was sharded, so it would compute in"
        " FP32. In configure_model, fully_shard each block and then the root module with"
        " mp_policy=self.trainer.precision_plugin.mp_policy."
    )


def fsdp2_fallback_refusal(
    modules: Iterable[str] | None, *, true_16bit: bool, dtype: torch.dtype, fp8_layers: list[str]
) -> str | None:
    """Why a fallback (``modules=None``: global) cannot be done on an FSDP2 model, or None when it can: FSDP2 fixes
    each unit's compute dtype at ``fully_shard``, and binds parameters to the layer objects it sharded (an FP8 layer
    cannot be swapped back). ``*-mixed`` fallbacks that move no FP8 layer work (autocast decides there)."""
    touched = fp8_layers if modules is None else [name for name in modules if name in fp8_layers]
    if true_16bit:
        return (f"each fully_shard unit computes in the param_dtype it was given ({_NAMES[dtype]}), so no module can"
                " move to FP32 while training; train in a '*-mixed' precision, whose FSDP2 fallbacks work")
    if touched:
        return (f"the FP8 layers {touched} cannot be swapped back: FSDP2 binds parameters to the layer objects it"
                " sharded; leave fp8 off for this run, or use DDP")
    return None


def fp8_all_gather_(module: nn.Module) -> list[str]:
    """Make FSDP2 all-gather the weights of ``module``'s torchao FP8 layers in FP8 (torchao's
    ``enable_fsdp_float8_all_gather``): half the all-gather traffic of BF16. Call it after the FP8 swap
    (``plugin.convert_module(self)`` in ``configure_model``) and before ``fully_shard``; returns the layers wrapped.

    Only torchao's tensorwise ``Float8Linear`` (``FP8Config(backend="torchao", recipe="current")``) can; it runs on
    the CPU (gloo) too. The weight becomes a new ``Parameter`` holding torchao's ``WeightWithDynamicFloat8CastTensor``
    (as torchao's own conversion with that option does), so call it before any optimizer is built. Idempotent.

    Raises:
        ModuleNotFoundError: torchao is not installed.
        ValueError: ``module`` holds no torchao FP8 layer.
    """
    from lit_mpstable.fp8.backend import optional_import

    optional_import("torchao.float8", "torchao")
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    layers = {name: layer for name, layer in module.named_modules() if isinstance(layer, Float8Linear)}
    if not layers:
        raise ValueError(
            f"fp8_all_gather_({type(module).__name__}): no torchao Float8Linear layer to gather in FP8; use"
            " StablePrecision(fp8=FP8Config(backend='torchao', recipe='current')) and call"
            " plugin.convert_module(self) first."
        )
    for layer in layers.values():
        weight = layer.weight
        if isinstance(weight.data, WeightWithDynamicFloat8CastTensor):
            continue
        cast = layer.config.cast_config_weight
        if getattr(cast.scaling_granularity, "name", "TENSORWISE") != "TENSORWISE":
            raise ValueError(f"fp8_all_gather_: {layer!r} scales per row; torchao gathers only tensorwise weights.")
        wrapped = WeightWithDynamicFloat8CastTensor(weight.data, layer.linear_mm_config, cast.target_dtype)
        layer.weight = nn.Parameter(wrapped, requires_grad=weight.requires_grad)
    return list(layers)


def setup_fsdp2(
    owner: str, precision: str, module: nn.Module, *, requested: bool, master_mode: str | None, fp8: FP8Config | None,
    swapped_elsewhere: bool, true_16bit: bool,
) -> tuple[bool, bool, bool]:
    """Whether the run is FSDP2 (``requested``, or ``fully_shard`` already ran on ``module``), whether ``module`` is
    sharded now, and whether its parameters may be cast to 16 bits; refuses what FSDP2 cannot take
    (:func:`check_fsdp2_setup`; ``swapped_elsewhere``: the FP8 layers were swapped on another module object).

    Raises:
        ValueError: see :func:`check_fsdp2_setup`.
    """
    sharded = bool(fsdp_units(module))
    fsdp2 = requested or sharded
    # Never cast FSDP2's sharded parameters; with masters they stay FP32, for they are the masters.
    cast = true_16bit and not (fsdp2 and (sharded or master_mode is not None))
    if fsdp2:
        check_fsdp2_setup(owner, precision, master_mode=master_mode, fp8=fp8,
                          sharded_before_fp8=sharded and fp8 is not None and swapped_elsewhere)
    return fsdp2, sharded, cast

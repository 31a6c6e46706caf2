"""Recipes as data: :class:`Recipe` (a frozen dataclass), the registry of named recipes and :func:`recipe`.

A recipe says, per GEMM role of a linear layer (``fprop`` ``y = x W^T``, ``dgrad`` ``dX = dY W``, ``wgrad``
``dW = dY^T x``), which low-precision format its two operands take (or ``"bf16"``), the block shape, the scale rule
of MX blocks, the floor of NVFP4 block scales, which roles round stochastically or take the random Hadamard
transform, and the per-tensor scaling knobs. ``FP8Linear``, the quantizers, the budget, the module swap and the
backends read these fields; none tests a recipe's name. A new recipe is one :func:`register_recipe` call (plus,
where a library should run it, one entry in that backend's table).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

Role = Literal["fprop", "dgrad", "wgrad"]
ROLES: tuple[Role, ...] = ("fprop", "dgrad", "wgrad")
ScaleRule = Literal["rceil", "floor"]
BlockScaleFloor = Literal["e4m3_tiny"]
AmaxAlgo = Literal["max", "most_recent"]


class FormatInfo(NamedTuple):
    """What one operand format is: the data the code reads instead of testing names."""

    blocks: tuple[tuple[int, int], ...]
    """The block shapes ``(weight rows, cols along the reduction dim)`` it allows, the first the default; () means
    one scale per tensor."""
    multiple: int
    """What a layer's in/out features must be multiples of for it (1: partial blocks are zero-padded)."""
    history: bool = False
    """Scales come from an amax history (state per layer)."""
    stochastic: bool = False
    """Its quantizer can round stochastically."""
    mx: bool = False
    """An OCP MX format (E8M0 block scales: ``scale_rule`` applies)."""
    fp4: bool = False
    """E2M1 elements."""
    quantized: bool = True
    """False for ``"bf16"``: the operands stay in high precision (rounded to bfloat16)."""
    kind: str = "tensor"
    """Which quantizer implements it (a key of ``quantizers.QUANTIZERS``: per tensor, MX, tiles, two-level)."""


FORMATS: dict[str, FormatInfo] = {
    "delayed": FormatInfo((), 1, history=True),
    "current": FormatInfo((), 1),
    "mxfp8": FormatInfo(((1, 32),), 1, mx=True, kind="mx"),
    "blockwise": FormatInfo(((128, 128), (1, 128)), 1, kind="tiles"),
    "mxfp4": FormatInfo(((1, 32),), 32, mx=True, fp4=True, kind="mx"),
    "nvfp4": FormatInfo(((16, 16), (1, 16)), 16, stochastic=True, fp4=True, kind="two_level"),
    "bf16": FormatInfo((), 1, quantized=False, kind="bf16"),
}
"""Per-role operand formats: ``"delayed"`` / ``"current"`` (E4M3, E5M2 gradients with ``FP8Config(format="hybrid")``,
one FP32 scale per tensor), ``"mxfp8"`` (E4M3/E5M2, E8M0 per 32), ``"blockwise"`` (E4M3, power-of-two FP32 scales per
1x128 / 128x128), ``"mxfp4"`` (E2M1, E8M0 per 32), ``"nvfp4"`` (E2M1, E4M3 per 16 and an FP32 tensor scale),
``"bf16"`` (high precision)."""


@dataclass(frozen=True)
class Recipe:
    """A low-precision training recipe, as data (``lit_mpstable.fp8.recipe(name, **fields)`` builds one).

    Raises:
        ValueError: a field value is not allowed (the message names the field, the value and what is allowed): a
            format not in :data:`FORMATS`, a block its format does not have, stochastic rounding on a role whose
            format cannot round stochastically or that has no gradient operand, a Hadamard role other than
            ``"wgrad"``, ``"delayed"`` on some roles only (its amax history covers all three operands).
    """

    name: str
    fprop: str
    """The forward GEMM's operand format (a key of :data:`FORMATS`)."""
    dgrad: str = ""
    """The input-gradient GEMM's format; ``""``: as ``fprop``."""
    wgrad: str = ""
    """The weight-gradient GEMM's format; ``""``: as ``dgrad``."""
    fprop_block: tuple[int, int] | None = None
    """``(rows, cols)``: cols the block length along the GEMM's reduction dim; rows > 1 makes the weight's blocks 2-D
    (the forward and the dgrad then share one quantized weight). None: the format's default."""
    dgrad_block: tuple[int, int] | None = None
    wgrad_block: tuple[int, int] | None = None
    scale_rule: ScaleRule = "rceil"
    """MX block scales: ``"rceil"`` (amax / max rounded up to a power of two: TransformerEngine's and torchao's
    training rule, nothing saturates) or ``"floor"`` (OCP MX v1.0)."""
    block_scale_floor: BlockScaleFloor | None = None
    """NVFP4 block scales: None keeps subnormal E4M3 scales (TransformerEngine); ``"e4m3_tiny"`` clamps them at
    2**-6 (torchao's ``NVFP4Tensor``)."""
    stochastic_rounding: tuple[Role, ...] = ()
    """Roles whose gradient operand is rounded stochastically (``"dgrad"``, ``"wgrad"``; NVFP4 formats only)."""
    hadamard: tuple[Role, ...] = ()
    """Roles whose two operands take the 16x16 random Hadamard transform along the reduction dim (``"wgrad"``)."""
    four_over_six: bool = False
    """NVFP4: each block's scale chosen from two candidates (map the block amax to 6 or to 4), the one with the
    smaller error ("Four Over Six", TransformerEngine ``nvfp4_4over6``)."""
    margin: int = 0
    """Per-tensor formats: scales divided by ``2**margin``."""
    amax_history_len: int = 1024
    """``"delayed"``: amaxes kept per tensor."""
    amax_compute_algo: AmaxAlgo = "max"
    """``"delayed"``: the max over the history, or the most recent amax."""

    def __post_init__(self) -> None:
        call = f"Recipe({self.name!r})"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Recipe(name={self.name!r}): name must be a non-empty string.")
        if not self.dgrad:
            object.__setattr__(self, "dgrad", self.fprop)
        if not self.wgrad:
            object.__setattr__(self, "wgrad", self.dgrad)
        for role in ROLES:
            fmt = getattr(self, role)
            if fmt not in FORMATS:
                raise ValueError(f"{call}: {role}={fmt!r}; a role's format must be one of {list(FORMATS)}.")
            block = getattr(self, f"{role}_block")
            allowed = FORMATS[fmt].blocks
            if role == "wgrad":  # no weight operand: 1-D blocks only
                allowed = tuple(b for b in allowed if b[0] == 1)
            if block is None:
                object.__setattr__(self, f"{role}_block", allowed[0] if allowed else None)
            else:
                block = tuple(block)
                if block not in allowed:
                    raise ValueError(f"{call}: {role}_block={block!r}; the {fmt} format of {role} allows "
                                     f"{list(allowed) or 'no block (one scale per tensor)'}.")
                object.__setattr__(self, f"{role}_block", block)
        history = [FORMATS[getattr(self, role)].history for role in ROLES]
        if any(history) and not all(history):
            raise ValueError(f"{call}: fprop/dgrad/wgrad = {self.formats}; 'delayed' keeps one amax history per"
                             " operand across the three GEMMs, so it goes on all three roles or none ('current' is"
                             " its stateless per-tensor peer).")
        if self.scale_rule not in get_args(ScaleRule):
            raise ValueError(f"{call}: scale_rule={self.scale_rule!r}; allowed: {list(get_args(ScaleRule))}.")
        if self.block_scale_floor not in (None, *get_args(BlockScaleFloor)):
            raise ValueError(f"{call}: block_scale_floor={self.block_scale_floor!r}; allowed: None (TE) or"
                             " 'e4m3_tiny' (torchao's NVFP4Tensor).")
        if self.amax_compute_algo not in get_args(AmaxAlgo):
            raise ValueError(f"{call}: amax_compute_algo={self.amax_compute_algo!r}; allowed:"
                             f" {list(get_args(AmaxAlgo))}.")
        for field in ("stochastic_rounding", "hadamard"):
            roles = getattr(self, field)
            roles = (roles,) if isinstance(roles, str) else tuple(roles)
            object.__setattr__(self, field, roles)
            for role in roles:
                if role not in ROLES:
                    raise ValueError(f"{call}: {field}={roles!r}; each entry must be one of {list(ROLES)}.")
        for role in self.stochastic_rounding:
            if role == "fprop" or not FORMATS[getattr(self, role)].stochastic:
                raise ValueError(f"{call}: stochastic_rounding={self.stochastic_rounding!r}; only the gradient"
                                 " operand of 'dgrad' / 'wgrad' rounds stochastically, and only in a format that can"
                                 f" (nvfp4); {role} is {getattr(self, role)!r}.")
        if bad := [role for role in self.hadamard if role != "wgrad" or not FORMATS[self.wgrad].quantized]:
            raise ValueError(f"{call}: hadamard={self.hadamard!r}; the random Hadamard transform applies to the"
                             f" quantized wgrad operands only, not {bad}.")
        if not isinstance(self.four_over_six, bool):
            raise ValueError(f"{call}: four_over_six={self.four_over_six!r}; must be True or False.")
        if self.four_over_six and not any(self.info(role).fp4 and not self.info(role).mx for role in ROLES):
            raise ValueError(f"{call}: four_over_six=True; it chooses NVFP4 block scales, and no role is nvfp4"
                             f" ({self.formats}).")
        if self.four_over_six and self.block_scale_floor is not None:
            raise ValueError(f"{call}: four_over_six=True with block_scale_floor={self.block_scale_floor!r}; Four Over"
                             " Six is TransformerEngine's variant (block_scale_floor=None).")

    # ------------------------------------------------------------------------------------------- derived
    @property
    def formats(self) -> dict[str, str]:
        """``{"fprop": ..., "dgrad": ..., "wgrad": ...}``."""
        return {role: getattr(self, role) for role in ROLES}

    def info(self, role: Role) -> FormatInfo:
        return FORMATS[getattr(self, role)]

    def block(self, role: Role) -> tuple[int, int] | None:
        return getattr(self, f"{role}_block")

    @property
    def uniform(self) -> bool:
        """All three roles share one format and its default blocks, with no per-role switch."""
        return len(set(self.formats.values())) == 1

    @property
    def history(self) -> bool:
        """Per-tensor scales from an amax history (the delayed recipe's state)."""
        return FORMATS[self.fprop].history

    @property
    def per_tensor(self) -> bool:
        """One scale per tensor on every role (the delayed / current GEMM path, ``torch._scaled_mm`` where it runs)."""
        return all(not FORMATS[f].blocks and FORMATS[f].quantized for f in self.formats.values()) and self.uniform

    @property
    def mx_uniform(self) -> bool:
        """An MX FP8 format on every role (the MX path of FP8Linear, with per-operand telemetry)."""
        return self.uniform and FORMATS[self.fprop].mx and not FORMATS[self.fprop].fp4

    @property
    def blocked(self) -> bool:
        """Some operand is scaled per block (or the roles differ): the block GEMM path, no amax history."""
        return not self.per_tensor

    @property
    def multiple(self) -> int:
        """What a layer's in/out features must be multiples of (the largest over the roles' formats)."""
        return max(FORMATS[f].multiple for f in self.formats.values())

    @property
    def fp4(self) -> bool:
        return any(FORMATS[f].fp4 for f in self.formats.values())

    @property
    def needs_counter(self) -> bool:
        """Stochastic rounding or a Hadamard transform: a per-layer step counter and seed."""
        return bool(self.stochastic_rounding or self.hadamard)

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain values (tuples as lists): what :meth:`FP8Config.export_map` writes."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out[field.name] = list(value) if isinstance(value, tuple) else value
        return out


_REGISTRY: dict[str, Recipe] = {}


def register_recipe(spec: Recipe, *, replace: bool = False) -> Recipe:
    """Add ``spec`` to the registry under ``spec.name``, so that ``fp8=spec.name``, ``FP8Config(recipe=spec.name)``,
    Hydra's ``fp8: <name>`` and :func:`recipe` find it. Returns it.

    Raises:
        ValueError: the name is taken (pass ``replace=True`` to overwrite).
        TypeError: ``spec`` is not a Recipe.
    """
    if not isinstance(spec, Recipe):
        raise TypeError(f"register_recipe({spec!r}): expected a Recipe.")
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"register_recipe(Recipe({spec.name!r})): the name is taken; registered: {recipe_names()};"
                         " pass replace=True to overwrite it.")
    _REGISTRY[spec.name] = spec
    return spec


def recipe_names() -> list[str]:
    """The registered recipe names, in registration order."""
    return list(_REGISTRY)


def recipe(name: str | Recipe, /, **fields: Any) -> Recipe:
    """The registered recipe ``name`` (or a Recipe itself) with ``fields`` replaced.

    ``recipe("mxfp8", scale_rule="floor")`` is OCP's MXFP8; ``recipe("nvfp4", block_scale_floor="e4m3_tiny")``
    torchao's NVFP4Tensor arithmetic; ``recipe("mxfp8", name="mx_fwd_nv_bwd", dgrad="nvfp4", wgrad="bf16",
    dgrad_block=(16, 16))`` MXFP8 forward, NVFP4 input gradient, BF16 weight gradient. Changing a role's format
    resets that role's block to the new format's default unless it is given.

    Raises:
        ValueError: ``name`` is not registered, or a field is unknown (both named, with what is allowed), or a
            value is not allowed (see :class:`Recipe`).
    """
    if isinstance(name, Recipe):
        base = name
    elif isinstance(name, str) and name in _REGISTRY:
        base = _REGISTRY[name]
    else:
        raise ValueError(f"recipe({name!r}): unknown recipe; registered: {recipe_names()}.")
    known = [f.name for f in dataclasses.fields(Recipe)]
    if unknown := sorted(set(fields) - set(known)):
        raise ValueError(f"recipe({base.name!r}, {', '.join(f'{k}=...' for k in unknown)}): unknown Recipe field(s)"
                         f" {unknown}; the fields are {known}.")
    if not fields:
        return base
    for role in ROLES:  # a new format brings its own default block
        if role in fields and f"{role}_block" not in fields and fields[role] != getattr(base, role):
            fields[f"{role}_block"] = None
    return dataclasses.replace(base, **fields)


def resolve(value: str | Recipe, call: str) -> Recipe:
    """A recipe name or a Recipe as a Recipe; a ValueError naming ``call`` otherwise."""
    if isinstance(value, Recipe):
        return value
    if isinstance(value, str) and value in _REGISTRY:
        return _REGISTRY[value]
    raise ValueError(f"{call}: {value!r} is not a recipe; use a registered name {recipe_names()} or a Recipe"
                     " (lit_mpstable.fp8.recipe(name, **fields)).")


# The built-in recipes: what TransformerEngine's and torchao's training recipes run.
register_recipe(Recipe("delayed", "delayed"))
register_recipe(Recipe("current", "current"))
register_recipe(Recipe("mxfp8", "mxfp8", scale_rule="rceil"))
register_recipe(Recipe("blockwise", "blockwise"))
register_recipe(Recipe("mxfp4", "mxfp4", scale_rule="rceil"))
register_recipe(Recipe("nvfp4", "nvfp4", stochastic_rounding=("dgrad", "wgrad"), hadamard=("wgrad",)))

"""The block-scaled quantizers against the golden vectors of TransformerEngine's and torchao's arithmetic
(``shared/golden/``, its README says how they were made): every case of every file, scales, codes and dequantized
values bit for bit (the sign of zero counts, NaN where the reference gives NaN).

The vectors ship in ``tests/golden/`` (data only, with the README that says how they were made);
``LIT_MPSTABLE_GOLDEN=<folder>`` checks another set with the same layout instead."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lit_mpstable.fp8.blockwise import blockwise_dequantize, blockwise_quantize
from lit_mpstable.fp8.hadamard import random_hadamard_transform
from lit_mpstable.fp8.minifloat import untiled
from lit_mpstable.fp8.mx import MXElement, MXScaleRule, mx_dequantize, mx_quantize
from lit_mpstable.fp8.nvfp4 import nvfp4_dequantize, nvfp4_global_encode_scale, nvfp4_quantize
from lit_mpstable.fp8.quantizers import fake_quantize


def _golden_dir() -> Path | None:
    root = Path(__file__).resolve().parents[2]
    env = os.environ.get("LIT_MPSTABLE_GOLDEN")
    for d in ([Path(env)] if env else []) + [root / "tests" / "golden", root.parent / "shared" / "golden"]:
        if (d / "README.md").is_file():
            return d
    return None


GOLDEN = _golden_dir()
pytestmark = pytest.mark.skipif(GOLDEN is None, reason="golden vectors not found (set LIT_MPSTABLE_GOLDEN)")

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
Case = dict[str, torch.Tensor]


def _cases(name: str) -> dict[str, Case]:
    assert GOLDEN is not None
    flat = torch.load(GOLDEN / f"{name}.pt", weights_only=True)
    cases: dict[str, Case] = {}
    for key, value in flat.items():
        case, field = key.split(".", 1)
        cases.setdefault(case, {})[field] = value
    return cases


def _differ(ours: torch.Tensor, ref: torch.Tensor) -> int:
    """How many elements differ in their bits (the README's ``same_bits``); a shape mismatch counts them all."""
    if ours.shape != ref.shape or ours.dtype != ref.dtype:
        return ref.numel()
    view = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[ref.element_size()]
    return int((ours.contiguous().view(view) != ref.contiguous().view(view)).sum())


def _check(name: str, compare: Callable[[Case], dict[str, tuple[torch.Tensor, torch.Tensor]]]) -> None:
    cases = _cases(name)
    assert cases, name
    bad = {}
    for case, fields in cases.items():
        counts = {key: _differ(ours, ref) for key, (ours, ref) in compare(fields).items()}
        if any(counts.values()):
            bad[case] = {k: v for k, v in counts.items() if v}
    assert not bad, f"{name}: elements differing per case and field: {bad}"


def _e4m3(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).float()


# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "rows"), [("blockwise_e4m3_1x128_te", 1), ("blockwise_e4m3_128x128_te", 128)])
def test_blockwise_equals_te_reference(name: str, rows: int) -> None:
    def compare(g: Case) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        q = blockwise_quantize(g["x"], tile=(rows, 128))
        return {"scale_inv": (q.scale_inv.reshape(g["scale_inv"].shape), g["scale_inv"]),
                "codes": (untiled(q.data.float(), q.shape), _e4m3(g["codes"])),
                "dequant": (blockwise_dequantize(q), g["dequant"])}

    _check(name, compare)


_MX_FILES = [("mxfp8_e4m3_rceil_te", "fp8_e4m3", "rceil"), ("mxfp4_e2m1_rceil_te", "fp4_e2m1", "rceil"),
             ("mxfp8_e4m3_floor_ocp", "fp8_e4m3", "floor"), ("mxfp4_e2m1_floor_ocp", "fp4_e2m1", "floor")]


@pytest.mark.parametrize(("name", "element", "rule"), _MX_FILES)
def test_mx_equals_te_rceil_and_ocp_floor(name: str, element: MXElement, rule: MXScaleRule) -> None:
    decode = _e4m3 if element == "fp8_e4m3" else (lambda c: E2M1[c.long()])

    def compare(g: Case) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        q = mx_quantize(g["x"], element, scale_rule=rule)
        return {"scale_e8m0": (q.scale_e8m0, g["scale_e8m0"]), "codes": (q.elements, decode(g["codes"])),
                "dequant": (mx_dequantize(q), g["dequant"]),
                "dequant_as_x": (mx_dequantize(q, g["x"].dtype), g["dequant"].to(g["x"].dtype))}

    _check(name, compare)


@pytest.mark.parametrize(("name", "element", "rule"), _MX_FILES)
def test_mx_differs_from_torchao_eager_only_where_the_readme_says(name: str, element: MXElement,
                                                                 rule: MXScaleRule) -> None:
    # torchao 0.18's eager to_mx differs from TE / the spec in two places only (the README): RCEIL's ceil(log2) in
    # fp32 misses the round-up a hair above a power of two (its exponent one lower), and blocks with e = 0 (it
    # multiplies by 1 under RCEIL, divides by 2**-126 under FLOOR): there the scale agrees but values do not.
    # (In this set: format_max_fp32 52 MXFP8 / 51 MXFP4 blocks; subnormal_fp32 / _bf16 58 / 103 MXFP8 and 59 / 71
    # (RCEIL) or 47 / 71 (FLOOR) MXFP4 blocks.)
    checked = 0
    for case, g in _cases(name).items():
        if "scale_e8m0_torchao" not in g:
            continue
        checked += 1
        q = mx_quantize(g["x"], element, scale_rule=rule)
        scales = q.scale_e8m0 != g["scale_e8m0_torchao"]
        values = (mx_dequantize(q).view(torch.int32) != g["dequant_torchao"].view(torch.int32))
        values = values.unflatten(-1, (-1, 32)).any(-1) & ~scales
        if rule == "floor":
            assert not scales.any(), case
        assert torch.equal(q.scale_e8m0[scales].int() - 1, g["scale_e8m0_torchao"][scales].int()), case
        assert (q.scale_e8m0[values] == 0).all(), case
    assert checked


def _nvfp4_te(g: Case, x: torch.Tensor, rows: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    q = nvfp4_quantize(x, tile=(rows, 16))
    scale = q.block_scale.reshape(g["block_scale"].shape)
    assert q.global_amax is not None
    return {"global_amax": (q.global_amax.reshape(1), g["global_amax"]),
            "s_enc": (nvfp4_global_encode_scale(q.global_amax).reshape(1), g["s_enc"]),
            "block_scale": (scale.float(), g["block_scale"]),
            "block_scale_e4m3": (scale.view(torch.uint8), g["block_scale_e4m3"]),
            "codes": (untiled(q.elements, q.shape), E2M1[g["codes"].long()]),
            "dequant": (nvfp4_dequantize(q), g["dequant"])}


@pytest.mark.parametrize(("name", "rows"), [("nvfp4_1x16_te", 1), ("nvfp4_16x16_te", 16)])
def test_nvfp4_equals_te_arithmetic(name: str, rows: int) -> None:
    _check(name, lambda g: _nvfp4_te(g, g["x"], rows))


def test_nvfp4_torchao_variant_equals_nvfp4tensor() -> None:
    def compare(g: Case) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        q = nvfp4_quantize(g["x"], block_scale_floor="e4m3_tiny")
        scale = q.block_scale.reshape(g["block_scale"].shape)
        return {"per_tensor_scale": (q.tensor_scale.reshape(1), g["per_tensor_scale"]),
                "block_scale": (scale.float(), g["block_scale"]),
                "block_scale_e4m3": (scale.view(torch.uint8), g["block_scale_e4m3"]),
                "codes": (untiled(q.elements, q.shape), E2M1[g["codes"].long()]),
                "dequant": (nvfp4_dequantize(q), g["dequant"])}

    _check("nvfp4_1x16_torchao_nvfp4tensor", compare)


def test_random_hadamard_transform_then_nvfp4_equals_te_wgrad_path() -> None:
    def compare(g: Case) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        rht = random_hadamard_transform(g["x"].t().contiguous(), g["sign_vector"].float())
        return {"rht": (rht, g["rht"]), **_nvfp4_te(g, rht, 1)}

    _check("nvfp4_rht16_1x16_te", compare)


# fake_quantize with a recipe's defaults is the hardware's arithmetic: RCEIL MX, TE's NVFP4 (round to nearest).
_FAKE = [("blockwise_e4m3_1x128_te", "blockwise", "input"), ("blockwise_e4m3_128x128_te", "blockwise", "weight"),
         ("mxfp8_e4m3_rceil_te", "mxfp8", "input"), ("mxfp4_e2m1_rceil_te", "mxfp4", "input"),
         ("nvfp4_1x16_te", "nvfp4", "input"), ("nvfp4_16x16_te", "nvfp4", "weight")]


@pytest.mark.parametrize(("name", "recipe", "role"), _FAKE)
def test_fake_quantize_defaults_equal_the_hardware_recipes(name: str, recipe: str, role: str) -> None:
    refused = []

    def compare(g: Case) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        x = g["x"]
        try:
            out = fake_quantize(x, recipe, role=role)  # type: ignore[arg-type]
        except ValueError:
            refused.append(tuple(x.shape))
            return {}
        return {"dequant": (out, g["dequant"].to(x.dtype))}

    _check(name, compare)
    if refused:  # the quantizers pad; fake_quantize's own shape check is lifted with the Recipe work (#45)
        pytest.xfail(f"fake_quantize still refuses the shapes {refused}")

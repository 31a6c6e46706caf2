"""Recipes as data: ``Recipe``, ``recipe(name, **fields)``, the registry, per-role formats through FP8Linear,
per-module maps and their export."""

from __future__ import annotations

import dataclasses
import inspect
import sys

import pytest
import torch
import yaml
from fp8_stand_ins import install_conformance_stand_in
from helpers import compiles_like_eager
from torch import nn

import lit_mpstable.fp8.backends as backends_module
import lit_mpstable.fp8.native as native_module
from lit_mpstable.fp8 import (
    FP8Config,
    FP8Linear,
    Recipe,
    convert_to_fp8,
    export_recipe_map,
    fake_quantize,
    fp8_config,
    recipe,
    recipe_names,
    register_recipe,
)
from lit_mpstable.fp8.mx import mx_quantize
from lit_mpstable.fp8.nvfp4 import nvfp4_quantize
from lit_mpstable.fp8.quantizers import reference_quantize

_REGISTRY_MODULE = sys.modules["lit_mpstable.fp8.recipe"]  # the attribute of that name is the function


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, Recipe]:
    """The registry, restored after the test."""
    saved = dict(_REGISTRY_MODULE._REGISTRY)
    yield _REGISTRY_MODULE._REGISTRY
    _REGISTRY_MODULE._REGISTRY.clear()
    _REGISTRY_MODULE._REGISTRY.update(saved)


def test_registered_recipes_are_frozen_data_with_the_hardware_defaults() -> None:
    assert recipe_names()[:6] == ["delayed", "current", "mxfp8", "blockwise", "mxfp4", "nvfp4"]
    mx = recipe("mxfp8")
    assert mx.scale_rule == "rceil" and mx.formats == {"fprop": "mxfp8", "dgrad": "mxfp8", "wgrad": "mxfp8"}
    nv = recipe("nvfp4")
    assert nv.block_scale_floor is None and nv.four_over_six is False  # TE's arithmetic
    assert nv.fprop_block == (16, 16) and nv.wgrad_block == (1, 16)
    assert nv.stochastic_rounding == ("dgrad", "wgrad") and nv.hadamard == ("wgrad",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        nv.scale_rule = "floor"  # type: ignore[misc]  # frozen on purpose
    ocp = recipe("mxfp8", scale_rule="floor")
    assert ocp.scale_rule == "floor" and recipe("mxfp8").scale_rule == "rceil"  # a copy, the registry untouched
    assert recipe("nvfp4", block_scale_floor="e4m3_tiny").block_scale_floor == "e4m3_tiny"


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: recipe("mxfp8", scale_rul="floor"), ["scale_rul", "unknown Recipe field", "scale_rule"]),
        (lambda: recipe("fp6"), ["recipe('fp6')", "nvfp4", "mxfp8"]),
        (lambda: recipe("mxfp8", scale_rule="ceil"), ["scale_rule='ceil'", "rceil", "floor"]),
        (lambda: recipe("mxfp8", dgrad="fp6"), ["dgrad='fp6'", "nvfp4", "bf16"]),
        (lambda: recipe("mxfp8", stochastic_rounding=("dgrad",)), ["stochastic_rounding", "mxfp8"]),
        (lambda: recipe("nvfp4", stochastic_rounding=("xgrad",)), ["stochastic_rounding", "xgrad", "fprop"]),
        (lambda: recipe("nvfp4", hadamard=("fprop",)), ["hadamard", "fprop", "wgrad"]),
        (lambda: recipe("nvfp4", fprop_block=(8, 8)), ["fprop_block=(8, 8)", "(16, 16)"]),
        (lambda: recipe("delayed", wgrad="current"), ["delayed", "all three roles"]),
        (lambda: recipe("mxfp8", four_over_six=True), ["four_over_six", "nvfp4"]),
        (lambda: recipe("nvfp4", four_over_six=True, block_scale_floor="e4m3_tiny"), ["four_over_six", "e4m3_tiny"]),
        (lambda: FP8Config(recipe="fp6"), ["recipe='fp6'", "nvfp4"]),
        (lambda: fake_quantize(torch.ones(4, 32), "fp6"), ["fp6", "nvfp4"]),
        (lambda: FP8Config(recipe={"*.mlp.*": "fp6"}), ["fp6", "nvfp4"]),
        (lambda: FP8Config(recipe={"*": "nvfp4"}, backend="transformer_engine"),
         ["map", "native", "export_recipe_map"]),
    ],
)
def test_bad_recipe_input_is_a_value_error_naming_it(call, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        call()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_a_registered_recipe_works_by_name_everywhere(registry: dict[str, Recipe]) -> None:
    mixed = register_recipe(recipe("mxfp8", name="mx_fwd_nv_bwd", dgrad="nvfp4", wgrad="bf16"))
    assert mixed.dgrad_block == (16, 16) and mixed.wgrad_block is None  # the new formats' own defaults
    with pytest.raises(ValueError, match="taken"):
        register_recipe(mixed)
    assert fp8_config("mx_fwd_nv_bwd") == FP8Config(recipe="mx_fwd_nv_bwd")
    assert FP8Config(recipe="mx_fwd_nv_bwd").spec is mixed
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(fake_quantize(x, "mx_fwd_nv_bwd", role="input"), fake_quantize(x, "mxfp8", role="input"))
    no_sr = recipe("nvfp4", stochastic_rounding=(), hadamard=())
    assert torch.equal(fake_quantize(x, "mx_fwd_nv_bwd", role="grad"), fake_quantize(x, no_sr, role="grad"))
    assert not torch.equal(fake_quantize(x, "mx_fwd_nv_bwd", role="grad"), fake_quantize(x, "mxfp8", role="grad"))


def test_per_role_formats_run_in_fp8linear_each_gemm_in_its_own_format() -> None:
    # MXFP8 forward, NVFP4 input gradient (16x16 weight tiles, round to nearest), BF16 weight gradient.
    spec = recipe("mxfp8", name="mixed", dgrad="nvfp4", wgrad="bf16")
    torch.manual_seed(0)
    layer = FP8Linear.from_linear(nn.Linear(64, 32, bias=False), FP8Config(recipe=spec), "fc")
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(16, 64, generator=gen) * torch.logspace(-2, 1, 64)).requires_grad_(True)
    dy = torch.randn(16, 32, generator=gen)
    y = layer(x)
    y.backward(dy)
    w = layer.weight.detach()
    mx, nv = recipe("mxfp8"), recipe("nvfp4", stochastic_rounding=())  # the mixed recipe rounds to nearest
    assert spec.stochastic_rounding == () and spec.hadamard == ()
    assert torch.equal(y, fake_quantize(x.detach(), mx) @ fake_quantize(w, mx, role="weight").t())
    assert torch.equal(x.grad, fake_quantize(dy, nv, role="grad") @ fake_quantize(w, nv, role="weight"))
    grad_w = dy.bfloat16().float().t() @ x.detach().bfloat16().float()
    assert torch.equal(layer.weight.grad, grad_w)
    # Each role really took its own format: the all-MXFP8 layer gives other gradients.
    plain = FP8Linear.from_linear(nn.Linear(64, 32, bias=False), FP8Config(recipe="mxfp8"), "fc")
    plain.weight = layer.weight
    x2 = x.detach().clone().requires_grad_(True)
    plain.weight.grad = None
    plain(x2).backward(dy)
    assert not torch.equal(x2.grad, x.grad) and not torch.equal(plain.weight.grad, grad_w)
    assert "recipe='mixed'" in repr(layer)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(32, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.mlp(self.attn(x)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), _Block(), _Block(), nn.Linear(32, 16))


def test_a_module_map_gives_each_layer_the_first_matching_recipe_and_exports() -> None:
    floor = recipe("mxfp8", name="mxfp8_ocp", scale_rule="floor")
    config = FP8Config(recipe={"*.mlp.*": "nvfp4", "*.attn": floor, "1.*": "current"})
    model = _model()
    names = convert_to_fp8(model, config)
    assert names == ["1.attn", "1.mlp.0", "1.mlp.2", "1.proj", "2.attn", "2.mlp.0", "2.mlp.2"]
    assert type(model[2].proj) is nn.Linear  # unmatched, no default: stays in high precision
    assert model[1].mlp[0].fp8_config.spec.name == "nvfp4" and model[1].attn.fp8_config.spec is floor
    assert model[1].proj.fp8_config.spec.name == "current"  # "1.*" matches "1.mlp.0" too, but "*.mlp.*" is first
    model(torch.randn(4, 16)).sum().backward()
    exported = export_recipe_map(model)
    assert list(exported) == names
    assert exported["1.attn"]["fprop"] == "mxfp8" and exported["1.attn"]["scale_rule"] == "floor"
    assert exported["2.mlp.0"]["stochastic_rounding"] == ["dgrad", "wgrad"]
    assert yaml.safe_load(yaml.safe_dump(exported)) == exported  # plain data
    with_default = FP8Config(recipe={"*.mlp.*": "nvfp4", "default": "mxfp8"})
    model = _model()
    convert_to_fp8(model, with_default)
    assert model[2].proj.fp8_config.spec.name == "mxfp8" and type(model[0]) is nn.Linear  # first/last kept


def test_a_map_pattern_that_matches_nothing_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError) as info:
        convert_to_fp8(_model(), FP8Config(recipe={"*.mlp.*": "nvfp4", "*.ffn.*": "mxfp8"}))
    assert "'*.ffn.*'" in str(info.value) and "match no nn.Linear" in str(info.value)
    assert "'*.mlp.*'" not in str(info.value).split("match no")[0]


# ------------------------------------------------------------------------------------------- conformance
_MX_RULE_MERGED = "scale_rule" in inspect.signature(mx_quantize).parameters  # r-arith's RCEIL arithmetic


def _floor_scales(spec: Recipe, x: torch.Tensor, operand: str):
    # A backend whose MX scales follow OCP's FLOOR rule whatever the recipe says.
    return reference_quantize(recipe(spec, scale_rule="floor"), operand, x, grad_dtype=torch.float8_e4m3fn)


@pytest.fixture(autouse=False)
def fresh_checks() -> None:
    native_module._CHECKED.clear()  # each test sees its own stand-in, not a cached verdict
    yield
    native_module._CHECKED.clear()


@pytest.mark.skipif(not _MX_RULE_MERGED, reason="needs mx_quantize(scale_rule=...) from the r-arith branch: before "
                    "the merge our 'rceil' reference is not built, so there is nothing to compare FLOOR scales with")
def test_conformance_refuses_a_backend_with_floor_scales_for_rceil_mxfp8(monkeypatch, fresh_checks) -> None:
    # Passes once r-arith's RCEIL arithmetic is merged (the lead runs it then).
    install_conformance_stand_in(monkeypatch, quantize=_floor_scales)
    config = FP8Config(recipe="mxfp8", backend="torchao", format="e4m3")
    with pytest.raises(ValueError) as info:
        convert_to_fp8(_model(), config)
    message = str(info.value)
    assert "backend='torchao'" in message and "of scales" in message and "backend='native'" in message
    assert "input: 0.0%" not in message


def test_conformance_passes_a_backend_equal_to_the_reference(monkeypatch, fresh_checks) -> None:
    stand_in = install_conformance_stand_in(monkeypatch, quantize=_floor_scales)
    config = FP8Config(recipe=recipe("mxfp8", scale_rule="floor"), backend="torchao", format="e4m3")
    names = convert_to_fp8(_model(), config)
    assert stand_in.converted[-1] == names  # not refused, nothing fell back
    report = native_module.check_conformance(stand_in(config))
    assert report.ok and report.unprobed == () and set(report.scales_differ) == {"input", "weight", "grad"}


def test_conformance_refuses_all_zero_gradients_or_falls_back_to_native(monkeypatch, fresh_checks) -> None:
    stand_in = install_conformance_stand_in(monkeypatch, zero_grads=True)
    with pytest.raises(ValueError) as info:
        convert_to_fp8(_model(), FP8Config(recipe="nvfp4", backend="torchao"))
    assert "gradient is all zero" in str(info.value) and "1.attn" in str(info.value)
    model = _model()
    with pytest.warns(RuntimeWarning, match="all zero.*run on backend='native'"):
        names = convert_to_fp8(model, FP8Config(recipe="nvfp4", backend="torchao", conformance="native"))
    assert stand_in.converted[-1] == [] and isinstance(model.get_submodule(names[0]), FP8Linear)
    model(torch.randn(4, 16)).sum().backward()
    assert all(model.get_submodule(name).weight.grad.abs().sum() > 0 for name in names)  # native: real gradients
    # conformance="off" skips the check: the broken backend converts them.
    assert convert_to_fp8(_model(), FP8Config(recipe="nvfp4", backend="torchao", conformance="off")) == names


def test_conformance_against_the_real_torchao_names_its_rceil_scales(fresh_checks) -> None:
    # torchao 0.18's MXFP8 training rounds block scales up (RCEIL); a recipe asking for OCP's FLOOR differs in about
    # a fifth of the scales (issue 45: 21%), which the check names instead of training on other numerics.
    pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    floor = FP8Config(recipe=recipe("mxfp8", scale_rule="floor"), backend="torchao", format="e4m3")
    report = native_module.check_conformance(backends_module.BACKENDS["torchao"](floor))
    assert not report.ok and 0.1 < report.scales_differ["input"] < 0.3 and 0 < report.values_differ["input"] < 0.02
    current = FP8Config(recipe="current", backend="torchao")
    assert native_module.check_conformance(backends_module.BACKENDS["torchao"](current)).ok  # bit for bit


@pytest.mark.slow
@pytest.mark.parametrize("spec", [
    recipe("mxfp8", name="mx_fwd_nv_bwd", dgrad="nvfp4", wgrad="bf16"),
    recipe("nvfp4", name="nv_bf16_wgrad", wgrad="bf16", stochastic_rounding=("dgrad",), hadamard=()),
], ids=lambda spec: spec.name)
def test_a_per_role_recipe_compiles_without_graph_breaks_and_matches_eager(spec: Recipe) -> None:
    def layer() -> FP8Linear:
        torch.manual_seed(0)
        return FP8Linear.from_linear(nn.Linear(64, 32), FP8Config(recipe=spec), "fc")

    gen = torch.Generator().manual_seed(1)
    compiles_like_eager(layer, torch.randn(16, 64, generator=gen), torch.randn(16, 32, generator=gen))


def test_a_map_comes_through_a_hydra_node() -> None:
    from omegaconf import OmegaConf

    node = OmegaConf.create({"recipe": {"*.mlp.*": "nvfp4", "default": "mxfp8"}, "margin": 0})
    config = fp8_config(node)
    assert config is not None and config.is_map and config.map_patterns() == ["*.mlp.*"]
    assert config.for_layer("1.mlp.0").spec.name == "nvfp4" and config.for_layer("1.attn").spec.name == "mxfp8"
    assert dataclasses.replace(config, emulate=True).for_layer("1.mlp.0").spec.name == "nvfp4"  # survives replace
    assert hash(config) == hash(fp8_config(node))


# ------------------------------------------------------------------------------- fields reach the arithmetic
# The reference arithmetic gains these keywords on the r-arith branch; before the merge the old arithmetic runs
# (MX FLOOR, NVFP4 block scales clamped at 2**-6). Each test below holds in both states and checks the field's
# effect once the keyword exists (the lead runs them after merging both branches).
_NV_FLOOR_MERGED = "block_scale_floor" in inspect.signature(nvfp4_quantize).parameters
_NV_46_MERGED = "four_over_six" in inspect.signature(nvfp4_quantize).parameters


def test_scale_rule_reaches_mx_quantize_and_fp8linear() -> None:
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    rceil, floor = fake_quantize(x, "mxfp8"), fake_quantize(x, recipe("mxfp8", scale_rule="floor"))
    assert torch.equal(floor, fake_quantize(x, "mxfp8")) != _MX_RULE_MERGED  # differ exactly when RCEIL exists
    torch.manual_seed(0)
    base = nn.Linear(128, 32, bias=False)
    specs = ("mxfp8", recipe("mxfp8", scale_rule="floor"))
    layers = [FP8Linear.from_linear(base, FP8Config(recipe=r), "fc") for r in specs]
    ys = [layer(x) for layer in layers]
    assert torch.equal(ys[0], rceil @ fake_quantize(base.weight.detach(), "mxfp8", role="weight").t())
    assert torch.equal(ys[0], ys[1]) != _MX_RULE_MERGED


def test_block_scale_floor_reaches_nvfp4_quantize() -> None:
    # Rows whose amax is far below the tensor's get subnormal E4M3 block scales in TE's arithmetic (None) and the
    # 2**-6 clamp in torchao's ("e4m3_tiny").
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(6)) * torch.logspace(-7, 1, 64).unsqueeze(1)
    te, tao = fake_quantize(x, "nvfp4"), fake_quantize(x, recipe("nvfp4", block_scale_floor="e4m3_tiny"))
    assert torch.equal(te, tao) != _NV_FLOOR_MERGED


def test_four_over_six_is_refused_by_name_until_its_arithmetic_exists_then_lowers_the_error() -> None:
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(7))
    spec = recipe("nvfp4", four_over_six=True)
    if not _NV_46_MERGED:
        with pytest.raises(ValueError, match="four_over_six"):
            fake_quantize(x, spec)
        return
    error = [float((fake_quantize(x, r) - x).norm() / x.norm()) for r in ("nvfp4", spec)]
    assert error[1] < error[0]  # Four Over Six: 0.0951 -> 0.0870 on Gaussian data (issue 45)

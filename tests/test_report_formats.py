"""The stability report's per-layer format map: FP8 recipe, base precision (and why) or FP32 island, per layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from torch import nn

from lit_mpstable import StablePrecision
from lit_mpstable.app.config import register_configs
from lit_mpstable.app.report import write_report
from lit_mpstable.app.report_formats import format_lines, layer_formats
from lit_mpstable.fp8 import FP8Config, HighPrecisionBudget

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers", "ignore:FP8Linear. torch._scaled_mm")


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16))


def test_each_layer_is_named_with_its_format_and_the_reason_it_is_not_low() -> None:
    plugin = StablePrecision("bf16-mixed", fp8="current", fp32_modules=["1"])
    plugin.stepper.setup_module(model())
    assert layer_formats(plugin) == {
        "0": "bf16 (autocast), filter", "1": "fp32 (island)", "2": "fp8 current", "3": "fp8 current",
        "4": "bf16 (autocast), filter",
    }  # fmt: skip
    plugin.fallback(["3"], reason="test")
    assert layer_formats(plugin)["3"] == "bf16 (autocast), fallback"
    plugin.fallback(None, reason="test")  # FP8 off
    assert set(layer_formats(plugin).values()) == {"bf16 (autocast), fallback", "bf16 (autocast), filter",
                                                   "fp32 (island)"}


def test_the_probes_layers_and_fp4_recipes_are_named_as_such() -> None:
    torch.manual_seed(0)
    plugin = StablePrecision("bf16-true", fp8=FP8Config(recipe="nvfp4", keep_high_precision=HighPrecisionBudget(0.3)))
    net = model()
    plugin.stepper.setup_module(net)
    x = torch.randn(16, 16, dtype=torch.bfloat16)
    kept = plugin.choose_high_precision_(lambda m, b: m(b).float().pow(2).mean(), x)
    formats = layer_formats(plugin)
    assert kept and all(formats[name] == "bf16, probe budget" for name in kept)
    assert {formats[name] for name in ("0", "2", "3", "4") if name not in kept} == {"nvfp4"}
    assert layer_formats(StablePrecision("bf16-mixed")) == {}  # no model yet


def test_the_report_shows_the_map_and_counts(tmp_path: Path) -> None:
    summary = {"model": "M", "precision": "bf16-mixed", "layer_formats": {"a": "fp8 current", "b": "fp8 current",
                                                                           "c": "bf16 (autocast), filter"}}
    text = write_report(summary, tmp_path).read_text()
    assert "## Formats per layer" in text and "fp8 current: 2, bf16 (autocast), filter: 1" in text
    assert "| a | fp8 current |" in text and "| c | bf16 (autocast), filter |" in text
    assert format_lines({"layer_formats": {}}) == []


def test_a_run_of_the_app_puts_the_map_in_its_summary_and_report(tmp_path: Path) -> None:
    from lit_mpstable.app.train import run

    register_configs()
    GlobalHydra.instance().clear()
    overrides = ["precision=bf16_mixed", "fp8=current", "experiment=none", "trainer.max_steps=3",
                 "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
                 "trainer.limit_val_batches=0", "model.d_model=32"]
    with initialize_config_module(config_module="lit_mpstable.conf", version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    summary = run(cfg, tmp_path)
    formats = summary["layer_formats"]
    assert "fp8 current" in formats.values() and any(v.endswith("filter") for v in formats.values())
    report = (tmp_path / "report.md").read_text()
    assert all(f"| {name} | {fmt} |" in report for name, fmt in formats.items())


def test_a_layer_of_a_per_role_recipe_is_shown_with_its_role_formats() -> None:
    from lit_mpstable.app.report_formats import _low_format
    from lit_mpstable.fp8 import FP8Linear, recipe

    def layer(spec) -> FP8Linear:
        return FP8Linear.from_linear(nn.Linear(32, 32), FP8Config(recipe=spec), "fc")

    assert _low_format(layer("nvfp4"), None) == "nvfp4"
    assert _low_format(layer("mxfp8"), None) == "fp8 mxfp8"
    mixed = recipe("mxfp8", name="mixed", dgrad="nvfp4", wgrad="bf16")
    assert _low_format(layer(mixed), None) == "mixed (mxfp8/nvfp4/bf16)"  # an FP4 role: no "fp8 " before it

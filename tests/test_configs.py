"""Configs: schemas mirror the constructors, every group option composes and instantiates, the entry point runs."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import get_class, instantiate

from lit_mpstable.config import SCHEMAS, register_configs

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_mirrors_the_constructor(name: str) -> None:
    schema = SCHEMAS[name]
    fields = {f.name: f for f in dataclasses.fields(schema) if f.name != "_target_"}
    target = get_class(schema._target_)
    params = {
        p.name: p for p in inspect.signature(target).parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    assert set(fields) == set(params), f"{name}: fields and {target.__name__}'s arguments differ"
    for key, field in fields.items():
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        expected = params[key].default
        expected = list(expected) if isinstance(expected, tuple) else expected
        assert default == expected, f"{name}.{key}: schema default {default!r} != constructor default {expected!r}"


def _compose(overrides: list[str]):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "group, option", [(g, o) for g in ("precision", "scaler", "fp8", "callbacks") for o in _options(g)]
)
def test_every_option_composes_and_instantiates(group: str, option: str) -> None:
    overrides = [f"{group}={option}"]
    if group == "scaler" and option not in ("default", "none"):
        overrides.append("precision=fp16_mixed")  # scaling is for FP16 modes
    cfg = _compose(overrides)
    plugin = instantiate(cfg.plugin)
    assert type(plugin).__name__ == "StablePrecision"
    callbacks = [instantiate(node) for node in cfg.callbacks.values()]
    if group == "callbacks":
        assert len(callbacks) == (0 if option == "none" else 1 if option != "default" else 4)
    if group == "precision":
        expected = {"fp32": "32-true", "bf16_mixed": "bf16-mixed", "fp16_mixed": "16-mixed", "bf16_true": "bf16-true",
                    "fp16_true": "16-true", "auto": "bf16-mixed"}[option]
        assert plugin.precision == expected
    if group == "fp8":
        assert (plugin.fp8 is None) == (option == "none")


@pytest.mark.parametrize("option", _options("model"))
def test_models_and_data_instantiate(option: str) -> None:
    cfg = _compose([f"model={option}", f"data={'digits' if option == 'mlp' else 'stdlib_chars'}"])
    data = instantiate(cfg.data)
    extra = {"vocab_size": data.vocab_size, "seq_len": data.seq_len} if hasattr(data, "vocab_size") else {}
    model = instantiate(cfg.model, **extra)
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.parametrize(
    "overrides",
    [
        ["precision=bf16_mixed"],
        ["precision=fp16_mixed", "model=mlp", "data=digits", "scaler=dynamic"],
        ["precision=bf16_true", "fp8=current"],
    ],
)
def test_five_step_runs_write_summary_and_report(overrides: list[str], tmp_path: Path) -> None:
    from lit_mpstable.train import run

    quick = ["trainer.max_steps=5", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
             "trainer.limit_val_batches=0"]
    if "model=mlp" not in overrides:
        quick.append("model.d_model=32")
    cfg = _compose([*overrides, *quick])
    summary = run(cfg, tmp_path)
    assert summary["steps"] == 5 and summary["final_train_loss"] == pytest.approx(summary["train_loss_curve"][-1])
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 5
    assert "Stability report" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "loss_scale.png").stat().st_size > 0


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lit_mpstable.train", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_two_job_multirun_with_the_basic_launcher(tmp_path: Path) -> None:
    result = _cli("-m", "precision=fp32,bf16_mixed", "model=mlp", "data=digits", "callbacks=none",
                  "trainer.max_steps=3", "trainer.enable_progress_bar=false", f"hydra.sweep.dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    summaries = sorted(tmp_path.glob("*/summary.json"))
    assert [json.loads(p.read_text())["precision"] for p in summaries] == ["32-true", "bf16-mixed"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("precision=fp17", "Available options in 'precision'"),
        ("plugin.master_weights=maybe", "StablePrecision(master_weights='maybe'): allowed"),
        ("callbacks.precision_fallback.mode=layer", "PrecisionFallback(mode='layer'): allowed"),
        ("plugin.precision=fp16", "StablePrecision(precision='fp16')"),
    ],
)
def test_bad_overrides_name_the_key_and_allowed_values(override: str, message: str, tmp_path: Path) -> None:
    result = _cli(override, "trainer.max_steps=1", f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr  # one message, not a wall


def test_scaler_instance_node_instantiates() -> None:
    # A scaler node with its own _target_ (any argument of the constructor) instead of a name.
    cfg = _compose(["precision=fp16_mixed"])
    cfg.plugin.scaler = {"_target_": "lit_mpstable.scaling.DynamicLossScaler", "device": "cpu", "hysteresis": 2}
    plugin = instantiate(cfg.plugin)
    assert plugin.scaler.hysteresis == 2 and plugin.loss_scale == 2.0**16

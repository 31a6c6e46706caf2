"""Experiments: aggregate.py on a synthetic sweep, every experiment config composes, the demo models' scripted faults,
a joblib multirun works."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import get_class, instantiate

import lit_mpstable.conf
from lit_mpstable.app.config import register_configs
from lit_mpstable.app.demos import FaultyMLP, WeightedLossMLP
from lit_mpstable.app.zoo import MLPClassifier

ROOT = Path(__file__).resolve().parents[1]
CONF = Path(lit_mpstable.conf.__file__).parent

# experiments/aggregate.py is a script, not a package module: load it from its path.
_spec = importlib.util.spec_from_file_location("aggregate", ROOT / "experiments" / "aggregate.py")
aggregate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(aggregate)

_spec = importlib.util.spec_from_file_location("spike_lr_sweep", ROOT / "experiments" / "spike_lr_sweep.py")
spike_lr_sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(spike_lr_sweep)

_spec = importlib.util.spec_from_file_location("growth_fallback", ROOT / "experiments" / "growth_fallback.py")
growth_fallback = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(growth_fallback)

_spec = importlib.util.spec_from_file_location("growth_fallback_gpt", ROOT / "experiments" / "growth_fallback_gpt.py")
growth_fallback_gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(growth_fallback_gpt)

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def _summary(precision: str, scales: list[float], skipped: list[bool], losses: list[float]) -> dict:
    return {
        "precision": precision, "model": "MLPClassifier", "steps": len(losses), "steps_per_s": 10.0,
        "peak_memory_mib": 2.0, "final_train_loss": losses[-1], "val_loss": 0.5, "val_acc": 0.9,
        "loss_scale": scales[-1], "skipped_steps": sum(skipped), "overflow_rate": sum(skipped) / len(losses),
        "fallbacks": 0, "rollbacks": 0, "events": [], "loss_scale_trajectory": scales, "skipped_trajectory": skipped,
        "train_loss_curve": losses, "val_loss_curve": [[len(losses), 0.5]],
    }


def _fake_sweep(root: Path) -> Path:
    """Two finished jobs as Hydra writes them, and one that wrote no summary (failed or still running)."""
    jobs = {
        "0": (["precision=fp32", "model=mlp", "trainer.max_steps=4"], _summary("32-true", [1.0] * 4, [False] * 4,
                                                                             [2.3, 2.0, 1.8, 1.7])),
        "1": (["precision=fp16_mixed", "model=mlp", "trainer.max_steps=4"],
              _summary("16-mixed", [2.0**20, 2.0**15, 2.0**15, 2.0**15], [True, False, False, False],
                       [2.3, 2.3, 1.9, 1.8])),
        "2": (["precision=bf16_mixed", "model=mlp", "trainer.max_steps=4"], None),
    }
    for job, (overrides, summary) in jobs.items():
        (root / job / ".hydra").mkdir(parents=True)
        (root / job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        if summary is not None:
            (root / job / "summary.json").write_text(json.dumps(summary))
    (root / "multirun.yaml").write_text(
        "hydra:\n  overrides:\n    hydra:\n    - hydra/launcher=joblib\n    - hydra.mode=MULTIRUN\n    task:\n"
        "    - precision=fp32,fp16_mixed,bf16_mixed\n    - model=mlp\n    - trainer.max_steps=4\n"
    )
    return root


def test_aggregate_writes_one_row_per_job(tmp_path: Path) -> None:
    sweep = _fake_sweep(tmp_path / "sweep")
    paths = aggregate.main([str(sweep), "--out", str(tmp_path / "out")])

    with paths["csv"].open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["label"], r["status"]) for r in rows] == [
        ("0", "precision=fp32", "ok"), ("1", "precision=fp16_mixed", "ok"),
        ("2", "precision=bf16_mixed", "no summary.json"),
    ]
    fp16 = rows[1]
    assert fp16["skipped_steps"] == "1" and float(fp16["overflow_rate"]) == 0.25
    assert float(fp16["effective_steps_per_s"]) == pytest.approx(10.0 * 3 / 4)
    assert fp16["settle_step"] == "1"  # 2**20 is 32x the final scale; from step 1 on it stays at 2**15
    text = paths["md"].read_text()
    assert "| 1 | precision=fp16_mixed | ok | 16-mixed |" in text
    assert "Shared overrides: `model=mlp` `trainer.max_steps=4`" in text
    assert "python -m lit_mpstable.train -m hydra/launcher=joblib precision=fp32,fp16_mixed,bf16_mixed" in text
    assert paths["loss_curves.png"].stat().st_size > 0 and paths["loss_scale.png"].stat().st_size > 0


def test_aggregate_rejects_a_directory_without_jobs(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no job directories"):
        aggregate.load_runs(tmp_path)


def _compose(overrides: list[str]):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lit_mpstable.conf", version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_instantiates(name: str) -> None:
    cfg = _compose([f"experiment={name}"])
    plugin = instantiate(cfg.plugin)
    assert type(plugin).__name__ == "StablePrecision"
    callbacks = [instantiate(node) for node in (cfg.callbacks or {}).values()]
    assert all(hasattr(cb, "state_dict") for cb in callbacks)
    assert get_class(cfg.model._target_).__module__.startswith("lit_mpstable.")  # importable wherever installed
    expected = {"classic_fp32": "32-true", "classic_bf16_true": "bf16-true", "classic_fp8_mxfp8": "bf16-mixed",
                "classic_mlp_fp16_adaptive": "16-mixed", "bf16_small_lr": "bf16-true", "fault_storm": "16-mixed"}
    if name in expected:
        assert plugin.precision == expected[name]


def test_command_line_overrides_win_over_an_experiment() -> None:
    cfg = _compose(["experiment=bf16_small_lr", "precision=fp32", "plugin.master_weights=false"])
    assert cfg.plugin.precision == "32-true" and cfg.plugin.master_weights is False and cfg.model.lr == 1e-4


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.rand(8, 64, generator=g), torch.randint(0, 10, (8,), generator=g)


def _twins(cls: type, **kwargs) -> tuple[MLPClassifier, MLPClassifier]:
    model = cls(hidden=32, **kwargs)
    clean = MLPClassifier(hidden=32)
    clean.load_state_dict(model.state_dict())
    return model, clean


def test_faulty_mlp_spikes_exactly_the_scripted_batch() -> None:
    faulty, clean = _twins(FaultyMLP, spike_batch=1, spike_factor=1e6)
    batch = _batch()
    losses = [faulty.training_step(batch, i) for i in range(3)]
    reference = clean.training_step(batch, 0)
    assert losses[0] == reference and losses[2] == reference
    assert losses[1] == reference * 1e6 and faulty.batches_seen == 3


def test_faulty_mlp_storm_overflows_fp16_only_and_only_on_its_batches() -> None:
    faulty, clean = _twins(FaultyMLP, storm_module="model.0", storm_start=1, storm_stop=2)
    batch = _batch()
    reference = clean.training_step(batch, 0)
    assert all(faulty.training_step(batch, i) == reference for i in range(3))  # FP32: y * 2**20 / 2**20 == y
    faulty.half().batches_seen = 0
    x, y = batch
    finite = [bool(torch.isfinite(faulty.training_step((x.half(), y), i))) for i in range(3)]
    assert finite == [True, False, True]  # FP16: y * 2**20 passes 65504 on the storm batch


def test_weighted_loss_mlp_scales_the_loss_and_adams_eps_alike() -> None:
    weighted, clean = _twins(WeightedLossMLP, loss_weight=2.0**-24)
    batch = _batch()
    assert weighted.training_step(batch, 0) == clean.training_step(batch, 0) * 2.0**-24
    eps = [g["eps"] for g in weighted.configure_optimizers()["optimizer"].param_groups]
    assert eps == [g["eps"] * 2.0**-24 for g in clean.configure_optimizers()["optimizer"].param_groups]


@pytest.mark.slow
def test_two_job_multirun_with_the_joblib_launcher_aggregates(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = subprocess.run(
        [sys.executable, "-m", "lit_mpstable.app.train", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
         "experiment=classic_mlp_fp32,classic_mlp_fp16_dynamic", "trainer.max_steps=2", "trainer.limit_val_batches=0",
         "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", f"hydra.sweep.dir={sweep}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Joblib" in result.stdout + result.stderr  # the joblib launcher ran the jobs
    paths = aggregate.main([str(sweep), "--out", str(tmp_path / "out")])
    with paths["csv"].open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["label"], r["precision"], r["steps"]) for r in rows] == [
        ("experiment=classic_mlp_fp32", "32-true", "2"), ("experiment=classic_mlp_fp16_dynamic", "16-mixed", "2"),
    ]


def _sweep_run(method: str, mult: float, seed: int, val: list[tuple[int, float]], diverged_at: int | None = None,
               ) -> dict:
    return {"method": method, "mult": mult, "seed": seed, "val": val, "diverged_at": diverged_at,
            "final_val": val[-1][1], "best_val": min(v for _, v in val)}


def test_spike_lr_sweep_counts_a_guard_that_never_reaches_fixeds_best_as_a_miss() -> None:
    # seed 0: fixed diverges at x4 and reaches its best (2.0) at step 100; the guard survives x4 and gets there at 50.
    # seed 1: both stable at x1..x2; fixed's best is 2.0 at step 100 and the guard never goes below 2.1.
    runs = [_sweep_run("fixed", 1, 0, [(0, 5.0), (50, 2.5), (100, 2.0)]),
            _sweep_run("fixed", 4, 0, [(0, 5.0), (50, 9.0)], diverged_at=50),
            _sweep_run("guard", 1, 0, [(0, 5.0), (50, 2.0), (100, 1.9)]),
            _sweep_run("guard", 4, 0, [(0, 5.0), (50, 2.4), (100, 2.2)]),
            _sweep_run("fixed", 1, 1, [(0, 5.0), (50, 2.5), (100, 2.0)]),
            _sweep_run("fixed", 2, 1, [(0, 5.0), (50, 2.6), (100, 2.3)]),
            _sweep_run("guard", 1, 1, [(0, 5.0), (50, 2.6), (100, 2.1)]),
            _sweep_run("guard", 2, 1, [(0, 5.0), (50, 2.7), (100, 2.2)])]
    summary = spike_lr_sweep.summarise(runs, argparse.Namespace(seeds=2))
    seed0, seed1 = summary["per_seed"][0], summary["per_seed"][1]
    assert (seed0["fixed"]["largest_stable_mult"], seed0["guard"]["largest_stable_mult"]) == (1, 4)
    assert (seed0["stable_ratio"], seed0["steps_ratio"]) == (4.0, 0.5)
    assert (seed1["stable_ratio"], seed1["guard"]["steps_to_fixed_best"]) == (1.0, None)
    assert seed1["steps_ratio"] == math.inf  # a miss, not a seed left out of the median
    assert summary["median_steps_ratio"] == math.inf and not summary["target_steps_met"]


@pytest.mark.slow
def test_spike_lr_sweep_smoke_run_writes_its_table_json_and_figure(tmp_path: Path) -> None:
    spike_lr_sweep.main(["--steps", "4", "--eval-every", "2", "--val-seqs", "32", "--mults", "1", "8",
                         "--out", str(tmp_path)])
    text = (tmp_path / "results.json").read_text()
    json.loads(text, parse_constant=lambda name: pytest.fail(f"results.json holds {name}: not strict JSON"))
    runs = json.loads(text)["runs"]
    assert sorted((r["mult"], r["method"]) for r in runs) == [(1, "fixed"), (1, "guard"), (8, "fixed"), (8, "guard")]
    assert all([s for s, _ in r["val"]] == [0, 2, 4] or r["diverged_at"] for r in runs)
    assert "Median stable-LR ratio" in (tmp_path / "table.md").read_text()
    assert (tmp_path / "sweep.png").stat().st_size > 0


@pytest.mark.slow
def test_growth_fallback_dead_channel_smoke_run_writes_its_table_json_and_figure(tmp_path: Path) -> None:
    growth_fallback.main(["--seeds", "1", "--steps", "6", "--mode", "dead_channel", "--out", str(tmp_path)])
    text = (tmp_path / "results_dead_channel.json").read_text()
    json.loads(text, parse_constant=lambda name: pytest.fail(f"results json holds {name}: not strict JSON"))
    rows = json.loads(text)["rows"]
    assert sorted(r["variant"] for r in rows) == sorted([*growth_fallback.VARIANTS, *growth_fallback.CLEAN])
    assert all(len(r["train_loss"]) == 6 and r["saturated_at"] is None for r in rows)  # the growth starts at 80
    assert "| 0 |" in (tmp_path / "results_dead_channel.md").read_text()
    assert (tmp_path / "loss_dead_channel.png").stat().st_size > 0


@pytest.mark.slow
def test_growth_fallback_gpt_smoke_run_writes_its_table_json_and_figure(tmp_path: Path) -> None:
    growth_fallback_gpt.main(["--seeds", "1", "--steps", "4", "--out", str(tmp_path)])
    text = (tmp_path / "gpt.json").read_text()
    json.loads(text, parse_constant=lambda name: pytest.fail(f"results json holds {name}: not strict JSON"))
    rows = json.loads(text)["rows"]
    assert [r["variant"] for r in rows] == list(growth_fallback_gpt.VARIANTS)
    assert all(len(r["train_loss"]) == 4 and r["saturated_at"] is None and r["column_0_zero"] for r in rows)
    assert [len(r["fp8_layers_at_end"]) for r in rows] == [0, 7, 7, 0, 7, 5]
    assert "| 0 |" in (tmp_path / "gpt.md").read_text()
    assert (tmp_path / "gpt.png").stat().st_size > 0


@pytest.mark.slow
def test_gpt_dead_channel_is_invisible_to_bf16_and_the_fallback_moves_only_the_two_out_layers() -> None:
    """The task's two claims, with the growth started at step 2: BF16 trains bit for bit as without the growth (the
    dead column never reaches the output), and PrecisionFallback(on_growth=True) moves both MLPs' ``out`` layers, and
    only them, out of FP8."""
    run = growth_fallback_gpt.run
    grown, clean = run(0, "bf16", 40, grow_from=2), run(0, "bf16 clean", 40, grow_from=2)
    assert grown["unit_ratio_at_end"] > 100  # the unit did grow (1.2 ** 38 from ~1)
    assert grown["train_loss"] == clean["train_loss"] and grown["loss"] == clean["loss"]
    fallback = run(0, "fp8+fallback", 40, grow_from=2)
    moved = sorted(name for decision in fallback["fallbacks"] for name in decision["modules"])
    assert moved == ["model.blocks.0.out", "model.blocks.1.out"], fallback["fallbacks"]
    assert fallback["fp8_layers_at_end"] == [n for n in growth_fallback_gpt.FP8_LAYERS if not n.endswith(".out")]
    assert fallback["column_0_zero"]

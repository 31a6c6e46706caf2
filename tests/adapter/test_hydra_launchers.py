"""Hydra sweeps for real: a two-job multirun of ``python -m lit_mpstable.app.train`` through the joblib launcher
and through submitit's local executor (the same code path as SLURM, without a cluster), each job writing its
summary. Each sweep takes ~30 s on 2 cores: marked slow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Two tiny jobs: the MLP classics, 2 steps, no validation, nothing printed per step.
JOBS = ["experiment=classic_mlp_fp32,classic_mlp_fp16_dynamic", "trainer.max_steps=2", "trainer.limit_val_batches=0",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
LAUNCHERS = {
    "joblib": ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"],
    # submitit_local: each job is a subprocess submitit starts and polls, as it would a SLURM job.
    "submitit_local": ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5", "hydra.launcher.cpus_per_task=1",
                       "hydra.launcher.gpus_per_node=0"],
}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_a_two_job_multirun_writes_both_summaries(tmp_path: Path, launcher: str) -> None:
    pytest.importorskip({"joblib": "hydra_plugins.hydra_joblib_launcher",
                         "submitit_local": "hydra_plugins.hydra_submitit_launcher"}[launcher])
    sweep = tmp_path / "sweep"
    result = subprocess.run(
        [sys.executable, "-m", "lit_mpstable.app.train", "-m", *LAUNCHERS[launcher], *JOBS,
         f"hydra.sweep.dir={sweep}"],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    summaries = {json.loads(path.read_text())["precision"]: path for path in sorted(sweep.glob("*/summary.json"))}
    assert sorted(summaries) == ["16-mixed", "32-true"], sorted(sweep.rglob("*"))
    for path in summaries.values():
        assert json.loads(path.read_text())["steps"] == 2
    if launcher == "submitit_local":
        assert list(sweep.glob(".submitit/*/*_log.out")), "submitit's own job logs"

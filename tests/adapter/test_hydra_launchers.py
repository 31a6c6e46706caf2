"""Hydra sweeps and torchrun for real, as docs/scale-out.md's "More than one machine" section gives them: a two-job
multirun of ``python -m lit_mpstable.train`` through the joblib launcher and through submitit's local executor
(SLURM's code path without a cluster), and a 2-process torchrun (DDP, gloo); every job or rank writes its summary.
The commands are read from that page, shortened to 2 steps. ~30 s each on 2 cores: marked slow."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Tiny jobs: 2 steps, no validation, nothing printed per step.
TINY = ["trainer.max_steps=2", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false"]
LAUNCHERS = {
    "joblib": ["hydra.launcher.n_jobs=2"],
    # submitit_local: each job is a subprocess submitit starts and polls, as it would a SLURM job.
    "submitit_local": [
        "hydra.launcher.timeout_min=5", "hydra.launcher.cpus_per_task=1", "hydra.launcher.gpus_per_node=0",
    ],
}


def readme_command(start: str) -> list[str]:
    """The scale-out page's command line beginning with ``start``, split as a shell would (the README links it)."""
    section = (ROOT / "docs" / "scale-out.md").read_text().split("## More than one machine", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith(start)]
    assert len(lines) == 1, (start, lines)
    return shlex.split(lines[0])


def _run(command: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=400, env=env, check=False)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_the_readmes_multirun_writes_both_summaries(tmp_path: Path, launcher: str) -> None:
    pytest.importorskip({"joblib": "hydra_plugins.hydra_joblib_launcher",
                         "submitit_local": "hydra_plugins.hydra_submitit_launcher"}[launcher])
    command = readme_command(f"python -m lit_mpstable.train -m hydra/launcher={launcher} ")
    sweep = tmp_path / "sweep"
    result = _run([sys.executable, *command[1:], *LAUNCHERS[launcher], *TINY, f"hydra.sweep.dir={sweep}"])
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    summaries = {json.loads(path.read_text())["precision"]: path for path in sorted(sweep.glob("*/summary.json"))}
    assert sorted(summaries) == ["16-mixed", "32-true"], sorted(sweep.rglob("*"))
    for path in summaries.values():
        assert json.loads(path.read_text())["steps"] == 2
    if launcher == "submitit_local":
        assert list(sweep.glob(".submitit/*/*_log.out")), "submitit's own job logs"


@pytest.mark.slow
def test_the_readmes_torchrun_trains_ddp_on_two_processes(tmp_path: Path) -> None:
    command = readme_command("torchrun ")
    run_dir = [arg for arg in command if arg.startswith("hydra.run.dir=")]
    assert run_dir == ["hydra.run.dir=outputs/torchrun/rank${oc.env:RANK}"]
    command = [arg if not arg.startswith("hydra.run.dir=") else f"hydra.run.dir={tmp_path}/rank${{oc.env:RANK}}"
               for arg in command]
    result = _run([sys.executable, "-m", "torch.distributed.run", *command[1:], *TINY])
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    assert "Starting with 2 processes" in result.stdout + result.stderr
    summaries = [json.loads((tmp_path / f"rank{rank}" / "summary.json").read_text()) for rank in (0, 1)]
    assert [s["steps"] for s in summaries] == [2, 2] and {s["precision"] for s in summaries} == {"16-mixed"}

"""The wheel as a user gets it: built from a copy of the sources, installed into a fresh virtual environment that
holds only the core dependencies, then run from an empty folder (``lit-mpstable-train``, ``python -m
lit_mpstable.app.train``) and composed into another Hydra app through the search-path plugin."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # ~30 s: a build, an install and four fresh interpreters

ROOT = Path(__file__).resolve().parents[1]
# Left out of the fresh environment: the `report` and `demo` extras, and this environment's own lit_mpstable (an
# editable install of the checkout would shadow the wheel).
_LEFT_OUT = ("matplotlib", "mpl_toolkits", "pylab", "rich", "sklearn", "scikit_learn", "lit_mpstable", "__editable__")


def _run(args: list, *, cwd: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing from the checkout
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert not check or result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources. No build isolation and no
    # index: CI has no network, and this environment has setuptools (the dev extra).
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("lit_mpstable", "hydra_plugins"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", tmp / "dist", src])
    return next((tmp / "dist").glob("lit_mpstable-*.whl"))


@pytest.fixture(scope="module")
def venv(wheel: Path) -> Path:
    """A fresh environment: the core dependencies (torch, Lightning, Hydra, ...) as links to this environment's
    packages, so nothing is downloaded, and the wheel installed with ``--no-deps``."""
    env = wheel.parents[1] / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", env])
    deps = wheel.parents[1] / "deps"
    deps.mkdir()
    for folder in {Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")}:
        for entry in folder.iterdir():
            if not entry.name.startswith(_LEFT_OUT) and entry.suffix != ".pth" and not (deps / entry.name).exists():
                (deps / entry.name).symlink_to(entry)
    site = Path(_run([env / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
                .stdout.strip())
    (site / "_core_dependencies.pth").write_text(f"{deps}\n")
    # pip comes with the links; run by the new interpreter, it installs there (console script included).
    _run([env / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel])
    return env


@pytest.fixture
def empty(tmp_path: Path) -> Path:
    folder = tmp_path / "empty"
    folder.mkdir()
    return folder


def test_the_wheel_holds_the_configs_the_plugin_and_core_dependencies_only(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    configs = {p.relative_to(ROOT).as_posix() for p in (ROOT / "lit_mpstable" / "conf").rglob("*.yaml")}
    assert len(configs) > 40 and configs <= names
    assert "hydra_plugins/lit_mpstable_searchpath/lit_mpstable_searchpath.py" in names
    assert "hydra_plugins/__init__.py" not in names  # a namespace package shared with every Hydra plugin
    assert not any(n.startswith(("conf/", "experiments/", "tests/", "bench/")) for n in names)
    requires = [line.split(": ", 1)[1] for line in metadata.splitlines() if line.startswith("Requires-Dist: ")]
    core = {r.split(">")[0].split("<")[0] for r in requires if "extra ==" not in r}
    assert core == {"torch", "lightning", "torchmetrics", "hydra-core"}
    extra = {name: {r.split(">")[0] for r in requires if f'extra == "{name}"' in r} for name in ("report", "demo")}
    assert extra == {"report": {"matplotlib", "rich"}, "demo": {"scikit-learn"}}


def test_lit_mpstable_train_runs_from_an_empty_folder_with_core_dependencies_only(venv: Path, empty: Path) -> None:
    run_dir = empty.parent / "run"
    result = _run([venv / "bin" / "lit-mpstable-train", "experiment=none", "trainer.max_steps=3", "model.d_model=32",
                   "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
                   "trainer.enable_model_summary=false", f"hydra.run.dir={run_dir}"], cwd=empty)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["precision"] == "bf16-mixed" and summary["model"] == "GPTLM"
    report = (run_dir / "report.md").read_text()
    assert 'matplotlib is not installed (pip install "lit_mpstable[report]")' in report  # said, not silent
    assert not list(run_dir.glob("*.png"))
    assert 'rich is not installed; pip install "lit_mpstable[report]"' in result.stdout
    assert list(empty.iterdir()) == []  # outputs went to the run directory, nothing into the working folder


def test_python_dash_m_composes_outside_a_checkout(venv: Path, empty: Path) -> None:
    probe = ("import importlib.util, lit_mpstable, hydra_plugins.lit_mpstable_searchpath as p; "
             "print(lit_mpstable.__file__); print(p.__file__); print(importlib.util.find_spec('matplotlib'))")
    package, plugin, matplotlib = _run([venv / "bin" / "python", "-c", probe], cwd=empty).stdout.split()
    site = venv.resolve() / "lib"
    assert Path(package).resolve().is_relative_to(site) and Path(plugin).resolve().is_relative_to(site)
    assert matplotlib == "None"  # really a core-only environment
    result = _run([venv / "bin" / "python", "-m", "lit_mpstable.app.train", "--cfg", "job", "precision=fp16_mixed",
                   "scaler=adaptive", "plugin.scaler.init_scale=256", "experiment=fault_storm"], cwd=empty)
    assert "_target_: lit_mpstable.core.scaling.adaptive_scaler.AdaptiveLossScaler" in result.stdout
    assert "init_scale: 256.0" in result.stdout  # typed: the schema made it a float
    assert "_target_: lit_mpstable.app.demos.FaultyMLP" in result.stdout  # an experiment's model, from the package


_APP = '''
import json

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate

import lit_mpstable
from lit_mpstable.app.config import register_configs

register_configs()  # typed lit_mpstable nodes


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    trainer = instantiate(cfg.trainer)
    plugin = trainer.precision_plugin
    print(json.dumps({
        "plugin": type(plugin).__name__, "precision": plugin.precision, "scaler": type(plugin.scaler).__name__,
        "loss_scale": plugin.loss_scale, "patience": cfg.callbacks.precision_fallback.patience,
        "callbacks": {name: type(instantiate(node)).__name__ for name, node in cfg.callbacks.items()},
        "providers": [source.provider for source in HydraConfig.get().runtime.config_sources],
        "package": lit_mpstable.__file__,
    }))


main()
'''
_CONFIG = """
defaults:
  - schema/stable_precision@plugin  # typed plugin node (register_configs() ran)
  - precision: fp16_mixed           # lit_mpstable's groups, found through the search path
  - scaler: dynamic
  - fp8: none
  - callbacks: mine                 # the app's own option of the shared callbacks group
  - _self_
trainer:
  _target_: lightning.pytorch.Trainer
  accelerator: cpu
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  plugins: ${plugin}
"""
_CALLBACKS = """
defaults:
  - overflow_monitor
  - precision_fallback
lr_monitor:
  _target_: lightning.pytorch.callbacks.LearningRateMonitor
"""


def test_another_hydra_app_composes_our_groups_through_the_search_path(venv: Path, empty: Path) -> None:
    app = empty.parent / "app"
    (app / "conf" / "callbacks").mkdir(parents=True)
    (app / "app.py").write_text(_APP)
    (app / "conf" / "config.yaml").write_text(_CONFIG)
    (app / "conf" / "callbacks" / "mine.yaml").write_text(_CALLBACKS)
    result = _run([venv / "bin" / "python", app / "app.py", "plugin.scaler.init_scale=1024", "plugin.scaler.device=cpu",
                   "callbacks.precision_fallback.patience=4", f"hydra.run.dir={empty.parent / 'app_run'}"], cwd=empty)
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["plugin"] == "StablePrecision" and out["precision"] == "16-mixed"
    assert out["scaler"] == "DynamicLossScaler" and out["loss_scale"] == 1024.0 and out["patience"] == 4
    assert out["callbacks"] == {"overflow_monitor": "OverflowMonitor", "precision_fallback": "PrecisionFallback",
                                "lr_monitor": "LearningRateMonitor"}
    assert "lit_mpstable" in out["providers"]  # the search-path plugin's entry
    assert Path(out["package"]).resolve().is_relative_to(venv.resolve())

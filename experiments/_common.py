"""What the experiment scripts share: compose a run from ``lit_mpstable/conf/`` (``experiment=...``), fit it with a
recorder, summarise, and write a table, a figure and the command that reproduces them into ``experiments/results/``."""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the package without installing
    sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from hydra import compose as _hydra_compose  # noqa: E402
from hydra import initialize_config_module  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from lit_mpstable import StablePrecision  # noqa: E402
from lit_mpstable.app.config import register_configs  # noqa: E402
from lit_mpstable.app.train import build  # noqa: E402
from lit_mpstable.core.weights.memory import MemoryProbe  # noqa: E402

__all__ = [
    "CONF", "QUIET", "RESULTS", "ROOT", "Fit", "Recorder", "command_line", "compose", "environment_line", "fit",
    "markdown_table", "pyplot", "quiet", "smooth", "tail_mean", "write_result",
]

CONF = ROOT / "lit_mpstable" / "conf"
"""The configs (package data, composed as ``pkg://lit_mpstable.conf``)."""
RESULTS = ROOT / "experiments" / "results"
QUIET = ("trainer.enable_progress_bar=false", "trainer.enable_model_summary=false")
"""Overrides every experiment run gets: no progress bar or model summary in the logs."""


def quiet() -> None:
    """Silence the messages every run repeats; fallback and rollback warnings stay visible."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    for pattern in (".*does not have many workers.*", ".*LeafSpec.*", ".*FP16 arithmetic is emulated.*",
                    ".*is not supported by the model summary.*"):
        warnings.filterwarnings("ignore", message=pattern)


def compose(overrides: Sequence[str]) -> DictConfig:
    """``train.yaml`` with ``overrides``, as ``python -m lit_mpstable.train <overrides>`` would compose it."""
    register_configs()
    GlobalHydra.instance().clear()
    chosen = any(str(o).lstrip("+~").startswith("experiment=") for o in overrides)
    one_run = [] if chosen else ["experiment=none"]  # the default experiment is the side-by-side showcase
    with initialize_config_module(config_module="lit_mpstable.conf", version_base="1.3"):
        return _hydra_compose(config_name="train", overrides=[*QUIET, *one_run, *overrides])


class Recorder(pl.Callback):
    """Per optimizer step: the trained loss, loss scale, skip flag, whether a precision fallback was active after
    the step (``plugin.fallback_active``), and the step's wall and process CPU time (batch start to batch end:
    validation left out; CPU time leaves out the waits for a core on a shared machine). Per validation: (step,
    loss, acc). Peak tensor memory of step ``probe_step`` when it is not None
    (``lit_mpstable.core.weights.memory.MemoryProbe``).
    """

    def __init__(self, probe_step: int | None = 2) -> None:
        self.loss: list[float] = []
        self.scale: list[float] = []
        self.skipped: list[bool] = []
        self.fallback: list[bool] = []
        self.step_s: list[float] = []
        self.step_cpu_s: list[float] = []
        self.val: list[tuple[int, float, float]] = []
        self.peak_bytes: int | None = None
        self.probe_step = probe_step
        self._probe: MemoryProbe | None = None
        self._t0 = self._cpu0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.probe_step and self.peak_bytes is None:
            self._probe = MemoryProbe()
            self._probe.start(pl_module, trainer.optimizers, getattr(trainer.precision_plugin, "state_tensors", list)())
        self._t0, self._cpu0 = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.step_s.append(time.perf_counter() - self._t0)
        self.step_cpu_s.append(time.process_time() - self._cpu0)
        if self._probe is not None:
            self._probe.stop()
            self.peak_bytes, self._probe = self._probe.peak_bytes, None
        plugin = trainer.precision_plugin
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.loss.append(float(loss))
        self.scale.append(plugin.loss_scale)
        self.skipped.append(plugin.last_step_skipped)
        self.fallback.append(plugin.fallback_active)

    def on_validation_end(self, trainer, pl_module) -> None:
        metrics = trainer.callback_metrics
        if not trainer.sanity_checking and "val/loss" in metrics:
            self.val.append((trainer.global_step, float(metrics["val/loss"]), float(metrics.get("val/acc", "nan"))))

    def median_step_s(self, warmup: int = 2, *, cpu: bool = False) -> float:
        """Median step time after ``warmup`` steps: wall time, or process CPU time with ``cpu=True``."""
        times = self.step_cpu_s if cpu else self.step_s
        return statistics.median(times[warmup:] or times)


@dataclass
class Fit:
    """One finished run: what it was built from and what it recorded."""

    cfg: DictConfig
    trainer: pl.Trainer
    plugin: StablePrecision
    model: pl.LightningModule
    data: pl.LightningDataModule
    callbacks: list[pl.Callback]
    """The callbacks the config asked for (``cfg.callbacks``), in order."""
    recorder: Recorder
    seconds: float

    @property
    def val_loss(self) -> float:
        """The last validation's loss; NaN when the run never validated (a smoke run shorter than the interval)."""
        return self.recorder.val[-1][1] if self.recorder.val else math.nan

    @property
    def val_acc(self) -> float:
        return self.recorder.val[-1][2] if self.recorder.val else math.nan


def fit(cfg: DictConfig, *, extra_callbacks: Sequence[pl.Callback] = (), probe_step: int | None = 2) -> Fit:
    """Build the run with ``lit_mpstable.app.train.build``, add ``extra_callbacks`` (after the config's own) and a
    :class:`Recorder`, and fit."""
    recorder = Recorder(probe_step)
    built = build(cfg, extra_callbacks=[*extra_callbacks, recorder])
    trainer, plugin, model, data, callbacks = built.trainer, built.plugin, built.model, built.data, built.callbacks
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    return Fit(cfg, trainer, plugin, model, data, callbacks, recorder, time.perf_counter() - start)


# ------------------------------------------------------------------------------------------------ numbers
def tail_mean(values: Sequence[float], n: int = 20) -> float:
    """Mean of the last ``n`` values (the end of a noisy training curve)."""
    tail = list(values)[-n:]
    return sum(tail) / len(tail)


def smooth(values: Sequence[float], n: int = 10) -> list[float]:
    """Trailing mean over the finite values among the last ``n`` (NaN where there are none); same length."""
    out = []
    for i in range(len(values)):
        window = [v for v in values[max(0, i - n + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(window) / len(window) if window else math.nan)
    return out


# ------------------------------------------------------------------------------------------------ output
def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def command_line(script: str, argv: Sequence[str] | None = None) -> str:
    """The command that reproduces this run, relative to the repository root."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python", f"experiments/{script}", *map(shlex.quote, args)])


def environment_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    load = " load %.1f," % os.getloadavg()[0] if hasattr(os, "getloadavg") else ""
    return (f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {cpu} ({os.cpu_count()} cores,{load}"
            f" shared), {time.strftime('%Y-%m-%d %H:%M')}")


def write_result(name: str, *, title: str, intro: str, tables: str, command: str, data: dict[str, Any],
                 note: str = "", out_dir: Path = RESULTS) -> Path:
    """``<name>.md`` (title, setup, tables, figure, command, ``note``, environment) and ``<name>.json`` (raw
    numbers); the script saves ``<name>.png`` itself."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = (f"# {title}\n\n{intro.strip()}\n\n{tables.strip()}\n\n![{name}]({name}.png)\n\n"
            f"Reproduce: `{command}`{' ' + note if note else ''}\n\nMachine: {environment_line()}.\n")
    path = out_dir / f"{name}.md"
    path.write_text(text)
    (out_dir / f"{name}.json").write_text(json.dumps(data, indent=1))
    return path


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

"""Where `make run`'s extra time goes (issue #44): the main job's FP16 digits MLP with its faults, trained as the
built-in (Lightning's ``MixedPrecision("16-mixed")``), then ours with the parts of the main job added one at a time:
the plugin alone, + SpikeGuard, + the callbacks (the main job as `make run` runs it). Paired rounds (each round runs
every variant once, in a rotated order), per run the fit's wall time and process CPU time; medians and the ratios to
the built-in per round. The outcome of each run (validation accuracy, skipped steps) is shown beside its time: the
variants meet the same faults, not the same remedies.

Run: ``python experiments/make_run_cost.py [--rounds 3] [--out experiments/results/make_run_cost]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from _common import command_line, compose, environment_line, markdown_table, quiet  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from omegaconf import open_dict  # noqa: E402

from lit_mpstable.app.train import build  # noqa: E402


class _Clock(pl.Callback):
    """The fit's wall and process CPU time, train start to train end (validation included, as `make run`'s table)."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.wall, self.cpu = time.perf_counter() - self._wall, time.process_time() - self._cpu


VARIANTS = ["built-in", "ours: plugin alone", "ours: + SpikeGuard", "ours: + callbacks (make run)"]


def _run(variant: str, out: Path) -> dict[str, Any]:
    cfg = compose(["experiment=showcase", "trainer.enable_progress_bar=false"])
    faults = [instantiate(cfg.compare.faults)]
    clock = _Clock()
    plugin = None
    if variant == "built-in":
        plugin = instantiate(cfg.compare.baseline)
    elif variant != "ours: + callbacks (make run)":
        with open_dict(cfg):
            if variant == "ours: plugin alone":
                cfg.plugin.spike_guard = None
    built = build(cfg, plugin=plugin, config_callbacks=variant == VARIANTS[-1], extra_callbacks=[*faults, clock],
                  default_root_dir=str(out))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built.trainer.fit(built.model, datamodule=built.data)
    metrics = built.trainer.callback_metrics
    live = built.trainer.precision_plugin
    skipped = getattr(live, "skipped_steps", None)
    return {"wall_s": clock.wall, "cpu_s": clock.cpu, "val_acc": float(metrics.get("val/acc", float("nan"))),
            "skipped": skipped}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/make_run_cost"))
    args = parser.parse_args(argv)
    quiet()
    torch.set_num_threads(1)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    scratch = args.out / "runs"
    for round_ in range(args.rounds):
        order = VARIANTS[round_ % len(VARIANTS):] + VARIANTS[:round_ % len(VARIANTS)]
        for variant in order:
            runs[variant].append(_run(variant, scratch))
            r = runs[variant][-1]
            print(f"round {round_}: {variant}: wall {r['wall_s']:.2f} s, cpu {r['cpu_s']:.2f} s, val acc"
                  f" {r['val_acc']:.3f}", flush=True)
    rows = []
    for variant in VARIANTS:
        own = runs[variant]
        base = runs["built-in"]
        wall = [o["wall_s"] / b["wall_s"] for o, b in zip(own, base, strict=True)]
        cpu = [o["cpu_s"] / b["cpu_s"] for o, b in zip(own, base, strict=True)]
        rows.append([variant, f"{statistics.median(o['wall_s'] for o in own):.2f}",
                     f"{statistics.median(o['cpu_s'] for o in own):.2f}", f"{statistics.median(wall):.3f}",
                     f"{statistics.median(cpu):.3f}", f"{own[-1]['val_acc']:.1%}",
                     "-" if own[-1]["skipped"] is None else str(own[-1]["skipped"])])
    table = markdown_table(["variant", "wall (s)", "CPU (s)", "wall / built-in", "CPU / built-in", "val acc",
                            "skipped (ours)"], rows)
    args.out.mkdir(parents=True, exist_ok=True)
    text = (f"# Where make run's time goes\n\n{__doc__.split(chr(10) + chr(10))[0]}\n\n{table}\n\nMedians over"
            f" {args.rounds} paired rounds; ratios are per round, then the median.\n\nReproduce:"
            f" `{command_line('make_run_cost.py', argv)}`\n\nMachine: {environment_line()}.\n")
    (args.out / "make_run_cost.md").write_text(text)
    (args.out / "make_run_cost.json").write_text(json.dumps(runs, indent=1))
    print(table)


if __name__ == "__main__":
    main()

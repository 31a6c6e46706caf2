"""Where `make run`'s extra time goes (issue #44): the main job's FP16 digits MLP with its faults, trained as the
built-in (Lightning's ``MixedPrecision("16-mixed")``), then ours with the parts of the main job added one at a time:
the plugin alone, + SpikeGuard, + the callbacks (the main job as `make run` runs it). Paired rounds (each round runs
every variant once, in a rotated order), per run the fit's wall time and process CPU time; medians and the ratios to
the built-in per round. The outcome of each run (validation accuracy, skipped steps) is shown beside its time: the
variants meet the same faults, not the same remedies.

Run: ``python experiments/make_run_cost.py [--rounds 3] [--out experiments/results/make_run_cost]``.
``--trees before=/path/to/tree,after=.`` pairs versions: each round runs every variant once per tree, each tree's round
in a process of its own with that tree's package first on ``sys.path`` (the order of the trees alternating), and
the ratios are to the built-in of the same round and process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
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


class _HookTimes:
    """Thread CPU time and calls of every hook of the lit_mpstable callbacks, over a fit (``--hooks``): each hook that
    Lightning dispatches at train start, wrapped on the instance (set up by the last callback, after the others chose
    what they dispatch)."""

    HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
             "on_before_zero_grad", "on_train_batch_end", "on_validation_start", "on_validation_end",
             "on_train_epoch_start", "on_train_epoch_end")

    def __init__(self) -> None:
        self.us: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, callbacks: list[pl.Callback]) -> None:
        for callback in callbacks:
            if not type(callback).__module__.startswith("lit_mpstable"):
                continue
            for hook in self.HOOKS:
                fn = getattr(callback, hook)
                if callable(fn) and getattr(type(callback), hook) is not getattr(pl.Callback, hook):
                    setattr(callback, hook, self._timed(f"{type(callback).__name__}.{hook}", fn))

    def _timed(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.us[name] = self.us.get(name, 0.0) + (time.thread_time_ns() - start) / 1e3
                self.calls[name] = self.calls.get(name, 0) + 1

        return timed


class _WrapAtTrainStart(pl.Callback):
    def __init__(self, times: _HookTimes) -> None:
        self.times = times

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.times.wrap(list(trainer.callbacks))


def _run(variant: str, out: Path, hooks: _HookTimes | None = None) -> dict[str, Any]:
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
    extra = [*faults, clock] + ([_WrapAtTrainStart(hooks)] if hooks is not None else [])
    built = build(cfg, plugin=plugin, config_callbacks=variant == VARIANTS[-1], extra_callbacks=extra,
                  default_root_dir=str(out))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built.trainer.fit(built.model, datamodule=built.data)
    metrics = built.trainer.callback_metrics
    live = built.trainer.precision_plugin
    skipped = getattr(live, "skipped_steps", None)
    return {"wall_s": clock.wall, "cpu_s": clock.cpu, "val_acc": float(metrics.get("val/acc", float("nan"))),
            "skipped": skipped}


def _round(round_: int, scratch: Path) -> dict[str, dict[str, Any]]:
    """One run of every variant, in an order rotated by ``round_``."""
    order = VARIANTS[round_ % len(VARIANTS):] + VARIANTS[:round_ % len(VARIANTS)]
    return {variant: _run(variant, scratch) for variant in order}


def _child_round(tree: str, round_: int, scratch: Path) -> dict[str, dict[str, Any]]:
    """:func:`_round` in a new process that imports ``tree``'s package (this script and ``_common`` from here:
    ``_common`` puts its own tree first unless it is on ``sys.path`` already, so it goes last)."""
    code = ("import runpy, sys; sys.path[:0] = [sys.argv[1]]; sys.path.append(sys.argv[2]); sys.argv = sys.argv[3:];"
            " runpy.run_path(sys.argv[0], run_name='__main__')")
    root = str(Path(__file__).resolve().parents[1])
    child = subprocess.run([sys.executable, "-c", code, str(Path(tree).resolve()), root, __file__, "--child-round",
                            str(round_), "--out", str(scratch)], capture_output=True, text=True, check=True)
    return json.loads(child.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/make_run_cost"))
    parser.add_argument("--trees", default="", help="NAME=PATH,...: package trees paired round by round")
    parser.add_argument("--child-round", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--hooks", action="store_true", help="instead: the callbacks' time per hook in make run's fit")
    args = parser.parse_args(argv)
    quiet()
    torch.set_num_threads(1)
    if args.hooks:
        _run(VARIANTS[-1], args.out / "runs")  # warm-up
        times = _HookTimes()
        run = _run(VARIANTS[-1], args.out / "runs", times)
        total = sum(times.us.values())
        rows = [[name, times.calls[name], f"{us / 1e3:.1f}", f"{us / times.calls[name]:.1f}"]
                for name, us in sorted(times.us.items(), key=lambda kv: -kv[1])]
        rows.append(["**all**", sum(times.calls.values()), f"{total / 1e3:.1f}", ""])
        table = markdown_table(["hook", "calls", "ms in the fit", "us a call"], rows)
        text = (f"# make run: the callbacks' time per hook\n\nThe main job's fit (`{VARIANTS[-1]}`), every hook of"
                f" the lit_mpstable callbacks timed (thread CPU time, the timer's wrapper included); the fit took"
                f" {run['cpu_s']:.2f} s of process CPU time.\n\n{table}\n\nReproduce:"
                f" `{command_line('make_run_cost.py', argv)}`\n\nMachine: {environment_line()}.\n")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "make_run_hooks.md").write_text(text)
        (args.out / "make_run_hooks.json").write_text(json.dumps({"us": times.us, "calls": times.calls, "run": run}))
        print(table)
        return
    if args.child_round is not None:
        import lit_mpstable

        print(json.dumps({"package": str(Path(lit_mpstable.__file__).parent),
                          "runs": _round(args.child_round, args.out)}))
        return
    trees = dict(item.split("=", 1) for item in args.trees.split(",")) if args.trees else {"": ""}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {t: {v: [] for v in VARIANTS} for t in trees}
    packages: dict[str, str] = {}
    scratch = args.out / "runs"
    names = list(trees)
    for round_ in range(args.rounds):
        for tree in names[round_ % len(names):] + names[:round_ % len(names)]:
            if trees[tree]:
                result = _child_round(trees[tree], round_, scratch)
                packages[tree], done = result["package"], result["runs"]
            else:
                done = _round(round_, scratch)
            for variant, r in done.items():
                runs[tree][variant].append(r)
                print(f"round {round_}: {tree + ': ' if tree else ''}{variant}: wall {r['wall_s']:.2f} s, cpu"
                      f" {r['cpu_s']:.2f} s, val acc {r['val_acc']:.3f}", flush=True)
    rows = []
    for tree in names:
        base = runs[tree]["built-in"]
        for variant in VARIANTS:
            own = runs[tree][variant]
            wall = [o["wall_s"] / b["wall_s"] for o, b in zip(own, base, strict=True)]
            cpu = [o["cpu_s"] / b["cpu_s"] for o, b in zip(own, base, strict=True)]
            rows.append(([tree] if tree else []) + [
                variant, f"{statistics.median(o['wall_s'] for o in own):.2f}",
                f"{statistics.median(o['cpu_s'] for o in own):.2f}", f"{statistics.median(wall):.3f}",
                f"{statistics.median(cpu):.3f}", f"{own[-1]['val_acc']:.1%}",
                "-" if own[-1]["skipped"] is None else str(own[-1]["skipped"])])
    table = markdown_table((["tree"] if args.trees else []) + [
        "variant", "wall (s)", "CPU (s)", "wall / built-in", "CPU / built-in", "val acc", "skipped (ours)"], rows)
    args.out.mkdir(parents=True, exist_ok=True)
    trees_line = "".join(f"\n\n{tree}: `{packages.get(tree, path)}`" for tree, path in trees.items() if path)
    text = (f"# Where make run's time goes\n\n{__doc__.split(chr(10) + chr(10))[0]}\n\n{table}\n\nMedians over"
            f" {args.rounds} paired rounds; ratios are per round, then the median.{trees_line}\n\nReproduce:"
            f" `{command_line('make_run_cost.py', argv)}`\n\nMachine: {environment_line()}.\n")
    (args.out / "make_run_cost.md").write_text(text)
    (args.out / "make_run_cost.json").write_text(json.dumps(runs if args.trees else runs[""], indent=1))
    print(table)


if __name__ == "__main__":
    main()

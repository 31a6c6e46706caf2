"""The classic mixed-precision table against an FP32 baseline on the same model and data: speed-up, memory saved,
overflow rate, accuracy/loss gap, loss-scale settling and effective throughput.

    .venv/bin/python experiments/classic.py                    # ~3 min on 2 cores: sweep (2 jobs), then timing
    .venv/bin/python experiments/classic.py --jobs 1           # the sweep on one core (~5 min)
    .venv/bin/python experiments/classic.py --reuse            # keep an existing sweep, redo the timing only
    .venv/bin/python experiments/classic.py --rows classic_mlp_fp32,classic_mlp_fp16_dynamic trainer.max_steps=20

Rows are ``experiment/classic_*.yaml`` configs. Quality (losses, accuracy, overflow, loss scale, peak tensor memory)
comes from one full run per row, launched as one Hydra multirun of ``python -m lit_mpstable.train`` (joblib launcher
with ``--jobs`` > 1) into ``--sweep-dir``; ``experiments/aggregate.py`` turns it into
``experiments/results/classic_sweep/``. Speed comes from separate short runs made alone, round-robin: each round
runs every row once (round r starts at row r), a run's time is the median of its steps after warm-up, and a row's
speed-up is the median over rounds of baseline time / row time in the same round. FP16 is emulated on CPUs, so the
FP16 rows use the digits MLP with its own FP32 baseline. Writes ``experiments/results/classic.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import QUIET, RESULTS, ROOT, command_line, compose, fit, markdown_table, pyplot, quiet, write_result  # noqa: E402
from aggregate import load_runs  # noqa: E402
from aggregate import main as aggregate_main  # noqa: E402

from lit_mpstable.app.report import settle_step  # noqa: E402

# (experiment, label, baseline experiment); listed slowest first, so a parallel sweep ends sooner.
ROWS: tuple[tuple[str, str, str], ...] = (
    ("classic_fp8_mxfp8", "FP8 mxfp8 (on bf16-mixed)", "classic_fp32"),
    ("classic_fp8_delayed", "FP8 delayed (on bf16-mixed)", "classic_fp32"),
    ("classic_fp8_current", "FP8 current (on bf16-mixed)", "classic_fp32"),
    ("classic_fp32", "FP32 (baseline)", "classic_fp32"),
    ("classic_bf16_true", "bf16-true + FP32 masters", "classic_fp32"),
    ("classic_bf16_mixed", "bf16-mixed", "classic_fp32"),
    ("classic_bf16_mixed_auto", "bf16-mixed, op_policy=auto", "classic_fp32"),
    ("classic_mlp_fp32", "FP32 (baseline)", "classic_mlp_fp32"),
    ("classic_mlp_fp16_dynamic", "fp16-mixed, dynamic scaler", "classic_mlp_fp32"),
    ("classic_mlp_fp16_adaptive", "fp16-mixed, adaptive scaler", "classic_mlp_fp32"),
)
DISPLAY_ORDER = ("classic_fp32", "classic_bf16_mixed", "classic_bf16_mixed_auto", "classic_bf16_true",
                 "classic_fp8_delayed", "classic_fp8_current", "classic_fp8_mxfp8", "classic_mlp_fp32",
                 "classic_mlp_fp16_dynamic", "classic_mlp_fp16_adaptive")
SWEEPS = ROOT / "multirun" / "classic"  # multirun/ is git-ignored
GOAL = 0.005  # the accuracy/loss gap to stay under: 0.5%


def sweep(names: list[str], sweep_dir: Path, jobs: int, overrides: list[str]) -> Path:
    """One Hydra multirun of ``lit_mpstable.train`` over ``experiment=<names>``; its output goes to sweep.log."""
    launcher = ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={jobs}"] if jobs > 1 else []
    command = [sys.executable, "-m", "lit_mpstable.app.train", "-m", "experiment=" + ",".join(names), *launcher,
               f"hydra.sweep.dir={sweep_dir}", *QUIET, *overrides]
    sweep_dir.mkdir(parents=True, exist_ok=True)
    log = sweep_dir / "sweep.log"
    print(f"sweep: {' '.join(command[1:])} (log: {log})", flush=True)
    with log.open("w") as f:
        result = subprocess.run(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise RuntimeError(f"classic: the sweep failed (exit {result.returncode}); last lines of {log}:\n"
                           + "\n".join(log.read_text().splitlines()[-30:]))
    return sweep_dir


def timing(names: list[str], rounds: int, steps: int, warmup: int, overrides: list[str]) -> dict[str, dict]:
    """Median step time (s), wall and process CPU, per row and round: ``{"wall": {row: [...]}, "cpu": {...}}``;
    and under ``"op_policy"`` the per-family choice of the rows that made one (``plugin.stats["op_policy"]``).
    Round r runs the rows starting at row r."""
    times: dict[str, dict] = {kind: {name: [] for name in names} for kind in ("wall", "cpu")}
    times["op_policy"] = {}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            cfg = compose([f"experiment={name}", f"trainer.max_steps={warmup + steps}", "trainer.limit_val_batches=0",
                           *overrides])
            run = fit(cfg, probe_step=None)
            times["wall"][name].append(run.recorder.median_step_s(warmup))
            times["cpu"][name].append(run.recorder.median_step_s(warmup, cpu=True))
            if run.plugin.op_policy != "autocast" and run.plugin.stats.get("op_policy"):
                times["op_policy"][name] = dict(run.plugin.stats["op_policy"])
        print(f"timing round {r + 1}/{rounds} (CPU ms): "
              + ", ".join(f"{n} {times['cpu'][n][-1] * 1e3:.0f}" for n in names), flush=True)
    return times


class OpProfile(pl.Callback):
    """Self CPU time per step of ``steps`` training steps from step ``start`` on, by op group (torch.profiler)."""

    GROUPS = (("matmuls", ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm")),
              ("attention", ("scaled_dot_product",)))

    def __init__(self, start: int = 4, steps: int = 3) -> None:
        self.start, self.steps = start, steps
        self.ms_per_step: dict[str, float] = {}
        self._prof: torch.profiler.profile | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.start:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._prof.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._prof is not None and trainer.global_step >= self.start + self.steps:
            self._stop(self.steps)

    def on_train_end(self, trainer, pl_module) -> None:
        if self._prof is not None:  # the run ended early: never leave a profiler running
            self._stop(max(trainer.global_step - self.start, 1))

    def _stop(self, steps: int) -> None:
        assert self._prof is not None
        self._prof.__exit__(None, None, None)
        totals: dict[str, float] = defaultdict(float)
        for event in self._prof.key_averages():
            group = next((g for g, keys in self.GROUPS if any(k in event.key for k in keys)), "rest")
            totals[group] += event.self_cpu_time_total / 1e3 / steps
        self.ms_per_step = {g: totals[g] for g in ("matmuls", "attention", "rest")}
        self.ms_per_step["total"] = sum(totals.values())
        self._prof = None


def op_profiles(names: list[str], overrides: list[str]) -> dict[str, dict[str, float]]:
    """Where a GPT step's CPU time goes, per row: matrix products, attention (SDPA forward and backward), the rest."""
    profiles = {}
    for name in names:
        own = [o for o in overrides if not o.startswith("trainer.max_steps=")]  # 8 steps: the profile needs 7
        cfg = compose([f"experiment={name}", "trainer.max_steps=8", "trainer.limit_val_batches=0", *own])
        if "seq_len" not in cfg.data:
            continue
        probe = OpProfile()
        fit(cfg, extra_callbacks=[probe], probe_step=None)
        profiles[name] = probe.ms_per_step
    return profiles


def profile_table(profiles: dict[str, dict[str, float]]) -> str:
    labels = {name: label for name, label, _ in ROWS}
    rows = [[labels[n], *(f"{p[k]:.1f}" for k in ("matmuls", "attention", "rest", "total"))]
            for n in DISPLAY_ORDER if (p := profiles.get(n))]
    return markdown_table(["GPT row", "matmuls (mm, addmm, _scaled_mm)", "attention (SDPA fwd + bwd)",
                           "everything else", "total"], rows)


def table_rows(names: list[str], runs: dict[str, dict], times: dict[str, dict]) -> list[dict]:
    rows = []
    baselines = {name: base for name, _, base in ROWS}
    labels = {name: label for name, label, _ in ROWS}
    for name in [n for n in DISPLAY_ORDER if n in names]:
        # None -> NaN: a smoke run shorter than the validation interval has no val loss
        s, base = (_nan_for_none(runs[n]["summary"]) for n in (name, baselines[name]))
        cfg = compose([f"experiment={name}"])
        per_step = int(cfg.data.batch_size) * int(cfg.data.get("seq_len", 1))
        cpu, wall = times["cpu"], times["wall"]
        ratios = [b / t for b, t in zip(cpu[baselines[name]], cpu[name])]
        wall_ratios = [b / t for b, t in zip(wall[baselines[name]], wall[name])]
        step_s = statistics.median(cpu[name])
        applied = (s["steps"] - s["skipped_steps"]) / s["steps"]
        loss_gap = (s["val_loss"] - base["val_loss"]) / base["val_loss"]
        acc_gap = s["val_acc"] - base["val_acc"]
        rows.append({
            "experiment": name, "label": labels[name], "model": s["model"], "precision": s["precision"],
            "unit": "tokens" if "seq_len" in cfg.data else "samples", "step_ms": step_s * 1e3,
            "wall_step_ms": statistics.median(wall[name]) * 1e3,
            "speedup": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
            "wall_speedup": statistics.median(wall_ratios),
            "throughput": per_step / step_s, "effective_throughput": per_step / step_s * applied,
            "peak_mib": s["peak_memory_mib"],
            "memory_saved": 1 - s["peak_memory_mib"] / base["peak_memory_mib"],
            "overflow_rate": s["overflow_rate"], "skipped": s["skipped_steps"], "steps": s["steps"],
            "settle_step": settle_step(s["loss_scale_trajectory"]), "final_scale": s["loss_scale"],
            "val_loss": s["val_loss"], "val_acc": s["val_acc"], "loss_gap": loss_gap, "acc_gap": acc_gap,
            "within_goal": name == baselines[name] or (abs(loss_gap) < GOAL and abs(acc_gap) < GOAL),
            "val_curve": s["val_loss_curve"],
        })
    return rows


def _nan_for_none(summary: dict) -> dict:
    return {key: math.nan if value is None else value for key, value in summary.items()}


def markdown(rows: list[dict]) -> str:
    header = ["row", "model", "CPU ms/step (wall)", "speed-up vs FP32 (range; wall)", "throughput /s", "effective /s",
              "peak MiB", "memory saved", "overflow rate", "settle step (final scale)", "val loss (gap)",
              "val acc (gap)", "gap < 0.5%"]
    body = []
    for r in rows:
        baseline = r["label"].endswith("(baseline)")
        scale = f"{r['settle_step']} (2^{math.log2(r['final_scale']):.0f})" if r["final_scale"] != 1.0 else \
            f"{r['settle_step']} (1)"
        body.append([
            r["label"], r["model"], f"{r['step_ms']:.1f} ({r['wall_step_ms']:.1f})",
            "1" if baseline else
            f"{r['speedup']:.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f}; {r['wall_speedup']:.2f}x)",
            f"{r['throughput']:,.0f} {r['unit']}", f"{r['effective_throughput']:,.0f}", f"{r['peak_mib']:.1f}",
            "-" if baseline else f"{round(r['memory_saved'] * 100, 1) + 0.0:.1f}%",
            f"{r['overflow_rate']:.1%} ({r['skipped']})", scale,
            f"{r['val_loss']:.4f}" + ("" if baseline else f" ({r['loss_gap']:+.2%})"),
            f"{r['val_acc']:.2%}" + ("" if baseline else f" ({r['acc_gap'] * 100:+.2f} pp)"),
            "-" if baseline else ("yes" if r["within_goal"] else "no"),
        ])
    return markdown_table(header, body)


def figure(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    names = [f"{r['label']}\n({r['model'].replace('Classifier', '')})" for r in rows]
    colors = [f"C{i}" for i in range(len(rows))]
    ys = range(len(rows))
    spread = [[r["speedup"] - r["speedup_min"] for r in rows], [r["speedup_max"] - r["speedup"] for r in rows]]
    axes[0].barh(ys, [r["speedup"] for r in rows], color=colors, xerr=spread)
    axes[0].axvline(1.0, color="k", lw=0.8)
    axes[0].set(yticks=list(ys), yticklabels=names, xlabel="speed-up vs FP32, CPU time (median over rounds, range)",
                title="Step time")
    axes[0].invert_yaxis()
    axes[1].barh(ys, [r["peak_mib"] for r in rows], color=colors)
    axes[1].set(yticks=list(ys), yticklabels=[], xlabel="MiB", title="Peak tensor memory of one step")
    axes[1].invert_yaxis()
    for r, color in zip(rows, colors):
        if r["model"] == "GPTLM" and r["val_curve"]:
            axes[2].plot([v[0] for v in r["val_curve"]], [v[1] for v in r["val_curve"]], "o-", color=color, ms=3,
                         lw=1.2, label=r["label"])
    axes[2].set(xlabel="optimizer step", ylabel="val loss", title="GPT validation loss")
    if axes[2].lines:
        axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (e.g. trainer.max_steps=20)")
    parser.add_argument("--rows", default=",".join(name for name, _, _ in ROWS),
                        help="comma-separated experiment names (baselines are added)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel sweep jobs (joblib launcher when > 1)")
    parser.add_argument("--sweep-dir", type=Path, default=None,
                        help=f"default: a new {SWEEPS.relative_to(ROOT)}/<time> (with --reuse: the latest one)")
    parser.add_argument("--reuse", action="store_true", help="use the runs already in the sweep directory")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds")
    parser.add_argument("--timing-steps", type=int, default=15, help="timed steps per run, after --warmup")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    quiet()
    wanted = set(args.rows.split(","))
    wanted |= {base for name, _, base in ROWS if name in wanted}
    names = [name for name, _, _ in ROWS if name in wanted]
    unknown = wanted - {name for name, _, _ in ROWS}
    if unknown:
        parser.error(f"--rows: unknown {sorted(unknown)}; known: {[name for name, _, _ in ROWS]}")

    if args.sweep_dir is None:
        earlier = sorted(SWEEPS.glob("*")) if SWEEPS.exists() else []
        if args.reuse and not earlier:
            parser.error(f"--reuse: no earlier sweep under {SWEEPS}")
        args.sweep_dir = earlier[-1] if args.reuse else SWEEPS / time.strftime("%Y-%m-%d_%H-%M-%S")
    start = time.perf_counter()
    if not args.reuse:
        sweep(names, args.sweep_dir, args.jobs, args.overrides)
    swept = load_runs(args.sweep_dir)
    by_name = {o.split("=", 1)[1]: run for run in swept for o in run["overrides"] if o.startswith("experiment=")}
    missing = [n for n in names if by_name.get(n, {}).get("summary") is None]
    if missing:
        raise RuntimeError(f"classic: no summary.json for {missing} in {args.sweep_dir}; run without --reuse.")
    print(f"sweep done in {time.perf_counter() - start:.0f} s", flush=True)
    times = timing(names, args.rounds, args.timing_steps, args.warmup, args.overrides)
    rows = table_rows(names, by_name, times)
    profiles = op_profiles(names, args.overrides)
    text = markdown(rows)
    for name, choices in times["op_policy"].items():
        text += f"\n\n`{name}`: the dtype per op family that `op_policy=auto` chose (`plugin.stats`): `{choices}`."
    if profiles:
        text += ("\n\n## Where a GPT step's time goes\n\nSelf CPU ms per step by op group, `torch.profiler` over steps"
                 " 4-6 of a short run (profiling adds overhead; compare the rows with each other):\n\n"
                 + profile_table(profiles))
    print(text)

    given = list(sys.argv[1:] if argv is None else argv)
    command = command_line("classic.py", [a for a in given if a != "--reuse"])
    sweep_shown = args.sweep_dir.resolve().relative_to(ROOT) if args.sweep_dir.resolve().is_relative_to(ROOT) \
        else args.sweep_dir
    note = f"Quality columns from the sweep `{sweep_shown}`" + (", reused (`--reuse`) for this table." if args.reuse
                                                               else ".")
    aggregate_main([str(args.sweep_dir), "--out", str(args.out / "classic_sweep")])
    intro = (
        "Main rows: the GPT on stdlib text (`model/gpt.yaml`: d=128, 2 layers, 4 heads, 445k parameters;\n"
        "batches of 16x64 characters; AdamW lr 3e-3, warmup 20, cosine; 300 steps; validation every 50 steps on 20\n"
        "held-out batches). FP16 is emulated on CPUs (~7x slower than BF16 on this GPT), so the FP16 rows use the\n"
        "digits MLP (64-256-256-10, batch 64, 300 steps), against their own FP32 baseline. Rows are\n"
        "`experiment=classic_*` (in `lit_mpstable/conf/`), no callbacks.\n\n"
        f"- ms/step, speed-up: {args.rounds} rounds of short runs made alone ({args.warmup} warm-up +"
        f" {args.timing_steps} timed steps, median), rows round-robin; speed-up = median over rounds of\n"
        "  baseline time / row time in the same round (range: min-max). Process CPU time per step (one torch\n"
        "  thread, so the work a step does, without the waits for a core on this shared 2-core machine); the\n"
        "  wall-time equivalents are in brackets after ';' and in the JSON.\n"
        "- throughput = tokens (GPT) or samples (MLP) per step / median CPU time per step; effective =\n"
        "  throughput x applied steps / all steps of the full run.\n"
        "- peak MiB: peak tensor memory of step 2 of the full run (`lit_mpstable.core.weights.memory.MemoryProbe`:\n"
        "  parameters, masters, gradients, optimizer state and the step's activations); memory saved vs FP32.\n"
        "- overflow rate (skipped steps), settle step (`lit_mpstable.app.report.settle_step`: first step from which\n"
        "  the loss scale stays within 2x of its final value), val loss / acc: from the full 300-step run; gaps\n"
        "  relative (loss) and in percentage points (accuracy) against the baseline; goal: both under 0.5%.\n\n"
        "The sweep's own table (every summary field, loss curves, loss scales): [classic_sweep/comparison.md]"
        "(classic_sweep/comparison.md)."
    )
    write_result("classic", title="Mixed precision against FP32: the classic table", intro=intro, tables=text,
                 command=command, note=note, out_dir=args.out,
                 data={"rows": rows, "step_s_per_round": times, "op_profile_ms": profiles})
    figure(rows, args.out / "classic.png")
    print(f"wrote {args.out / 'classic.md'} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

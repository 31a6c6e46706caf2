"""Optimizer state precision and the growth early warning, measured.

    PYTHONPATH=. .venv/bin/python experiments/optimizer_state.py                  # all parts
    PYTHONPATH=. .venv/bin/python experiments/optimizer_state.py --parts moments --gpt-steps 150

Parts:

- ``moments``: ``StablePrecision("bf16-true", master_weights=True|"kahan", optimizer_state="fp32"|"bf16"|"fp8")`` on
  the digits MLP and the small CPU GPT of ``lit_mpstable.app.zoo`` (AdamW + warmup/cosine), 3 seeds each: final
  validation loss against FP32 moments (same seed), and the optimizer state's bytes from ``memory_report()``.
- ``warning``: the FP8 growth task of ``tests/adapter/test_growth_warning.py`` (a SwiGLU block whose gate and up rows
  are driven into alignment; ``fp8="current"``, native emulated) with ``growth_every_n_steps=10``: the lead of
  OverflowMonitor's first growth warning over the first non-finite loss, 5 seeds; 5 clean runs for false alarms.
- ``overhead``: the digits MLP's step time with ``growth_every_n_steps=10`` against without (paired, alternating).

- ``figures``: no runs; the table and the figures again from ``results.json`` (every part writes them too).

Writes ``experiments/results/optimizer_state/results.md`` (and ``.json``), ``frontier.png`` (validation loss against
optimizer-state memory for the state formats) and ``lead_time.png`` (per seed: the step of the first growth warning
and of the first non-finite loss).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "adapter")]
OUT = ROOT / "experiments" / "results" / "optimizer_state"

from lit_mpstable import StablePrecision  # noqa: E402
from lit_mpstable.app.zoo import GPTLM, CharLMData, DigitsData, MLPClassifier  # noqa: E402


def _trainer(plugin, steps: int, **kwargs) -> pl.Trainer:
    options = dict(accelerator="cpu", devices=1, max_steps=steps, max_epochs=-1, plugins=[plugin], logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0, limit_val_batches=1.0, val_check_interval=None,
                   check_val_every_n_epoch=None)
    return pl.Trainer(**{**options, **kwargs})


def run_moments(model: str, master_weights, kind: str, seed: int, steps: int) -> dict:
    pl.seed_everything(seed, verbose=False)
    if model == "mlp":
        data, module = DigitsData(), MLPClassifier(total_steps=steps)
    else:
        data = CharLMData(max_chars=200_000)
        module = GPTLM(data.vocab_size, total_steps=steps)
    plugin = StablePrecision("bf16-true", master_weights=master_weights, optimizer_state=kind)
    trainer = _trainer(plugin, steps)
    start, cpu = time.perf_counter(), time.process_time()
    trainer.fit(module, datamodule=data)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    state_bytes = plugin.memory_report()["optimizer_state"]  # before validate() sets the model up again
    val = trainer.validate(module, datamodule=data, verbose=False)[0]["val/loss"]
    return {"model": model, "weights": str(master_weights), "kind": kind, "seed": seed, "val_loss": float(val),
            "state_bytes": state_bytes, "seconds": seconds,
            "cpu_seconds": cpu_seconds}


def run_warning(seed: int, grow: bool, steps: int) -> dict:
    from test_growth_warning import _run

    module, plugin, growth, _ = _run(seed, grow=grow, steps=steps)
    first = growth[0][0] if growth else None
    return {"seed": seed, "grow": grow, "warned_at": first, "nonfinite_at": module.first_nonfinite,
            "lead": (module.first_nonfinite - first) if (first is not None and module.first_nonfinite) else None,
            "named": growth[0][1].split(" in ", 1)[1].split(";")[0] if growth else ""}


class _Timer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._t = 0.0

    def on_train_batch_start(self, *args) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.times.append(time.perf_counter() - self._t)


def run_overhead(rounds: int, steps: int) -> dict:
    medians: dict[str, list[float]] = {"off": [], "every 10": []}
    for r in range(rounds):
        for label, every in (("off", None), ("every 10", 10)) if r % 2 == 0 else (("every 10", 10), ("off", None)):
            pl.seed_everything(0, verbose=False)
            timer = _Timer()
            plugin = StablePrecision("bf16-mixed", fp8="current", growth_every_n_steps=every)
            _trainer(plugin, steps, callbacks=[timer], limit_val_batches=0).fit(MLPClassifier(total_steps=steps),
                                                                              datamodule=DigitsData())
            medians[label].append(statistics.median(timer.times[10:]))
    ratios = [on / off for on, off in zip(medians["every 10"], medians["off"])]
    return {"median_step_s": {k: statistics.median(v) for k, v in medians.items()},
            "paired_ratio_median": statistics.median(ratios), "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["moments", "warning", "overhead"],
                        choices=["moments", "warning", "overhead", "figures"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--mlp-steps", type=int, default=300)
    parser.add_argument("--gpt-steps", type=int, default=300)
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt"])
    parser.add_argument("--weights", nargs="+", default=["fp32", "kahan"])
    parser.add_argument("--overhead-rounds", type=int, default=4)
    parser.add_argument("--overhead-steps", type=int, default=150)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: comparable CPU times)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import logging
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    if "moments" in args.parts:
        kept, rows = [r for r in results.get("moments", []) if r["model"] not in args.models], []
        for model in args.models:
            steps = args.mlp_steps if model == "mlp" else args.gpt_steps
            for weights in args.weights:
                mw = True if weights == "fp32" else weights
                for seed in range(args.seeds):
                    for kind in ("fp32", "bf16", "fp8"):
                        row = run_moments(model, mw, kind, seed, steps)
                        row["steps"] = steps
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        results["moments"] = kept + rows
                        path.write_text(json.dumps(results, indent=1))  # each run kept as soon as it is measured
    if "warning" in args.parts:
        rows = [run_warning(seed, True, 400) for seed in range(5)]
        rows += [run_warning(seed, False, 400) for seed in range(5)]
        for row in rows:
            print(json.dumps(row), flush=True)
        results["warning"] = rows
        path.write_text(json.dumps(results, indent=1))  # each part kept as soon as it is measured
    if "overhead" in args.parts:
        results["overhead"] = run_overhead(rounds=args.overhead_rounds, steps=args.overhead_steps)
        print(json.dumps(results["overhead"]), flush=True)
    for part in set(args.parts) - {"figures"}:
        results.setdefault("commands", {})[part] = " ".join(sys.argv[1:])
    path.write_text(json.dumps(results, indent=1))
    (OUT / "results.md").write_text(markdown(results))
    figures(results, OUT)


_LABELS = {"True": "FP32 masters", "kahan": "kahan (compact)"}


def figures(results: dict, out: Path) -> None:
    """``frontier.png`` and ``lead_time.png`` from the measured rows (a part not measured yet: no figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results.get("moments", [])
    models = [m for m in ("mlp", "gpt") if any(r["model"] == m for r in rows)]
    if models:
        fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.0), squeeze=False)
        for ax, model in zip(axes[0], models):
            for weights, marker in (("True", "o"), ("kahan", "s")):
                sub = [r for r in rows if r["model"] == model and r["weights"] == weights]
                ref = {r["seed"]: r["val_loss"] for r in sub if r["kind"] == "fp32"}
                fp32_bytes = next((r["state_bytes"] for r in sub if r["kind"] == "fp32"), None)
                xs, ys, lo, hi, kinds = [], [], [], [], []
                for kind in ("fp32", "bf16", "fp8"):
                    gaps = [100 * (r["val_loss"] / ref[r["seed"]] - 1) for r in sub
                            if r["kind"] == kind and r["seed"] in ref]
                    if not gaps:
                        continue
                    state = next(r["state_bytes"] for r in sub if r["kind"] == kind)
                    mean = statistics.mean(gaps)
                    xs.append(state / 2**20)
                    ys.append(mean)
                    lo.append(mean - min(gaps))
                    hi.append(max(gaps) - mean)
                    kinds.append(f"{kind} ({state / fp32_bytes:.2f}x)" if fp32_bytes else kind)
                if not xs:
                    continue
                steps = sub[0]["steps"]
                seeds = len({r["seed"] for r in sub})
                ax.errorbar(xs, ys, yerr=[lo, hi], marker=marker, capsize=3,
                            label=f"{_LABELS.get(weights, weights)}, {steps} steps, {seeds} seeds")
                for x, y, kind in zip(xs, ys, kinds):
                    ax.annotate(kind, (x, y), textcoords="offset points", xytext=(4, 6 if marker == "o" else -12),
                                fontsize=8, color="tab:blue" if marker == "o" else "tab:orange")
            for level, style in ((0.3, ":"), (0.5, "--")):
                ax.axhline(level, color="grey", linestyle=style, linewidth=0.8)
            ax.axhline(0.0, color="black", linewidth=0.6)
            ax.set_xlabel("optimizer state (MiB, memory_report)")
            ax.set_ylabel("val loss vs FP32 moments (%; mean, seed range)")
            ax.set_title(f"{'digits MLP' if model == 'mlp' else 'CPU GPT'}: moments' format vs memory")
            ax.legend(fontsize=8, loc="best")
        fig.text(0.01, 0.01, "targets: bf16 within 0.3% (dotted) at <= 0.5x; fp8 within 0.5% (dashed) at <= 0.3x",
                 fontsize=8)
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        fig.savefig(out / "frontier.png", dpi=110)
        plt.close(fig)
    warned = [r for r in results.get("warning", []) if r["grow"]]
    if warned:
        clean = [r for r in results["warning"] if not r["grow"]]
        fig, ax = plt.subplots(figsize=(7.0, 3.2))
        for i, r in enumerate(warned):
            if r["warned_at"] is not None:
                end = r["nonfinite_at"] if r["nonfinite_at"] is not None else r["warned_at"]
                ax.plot([r["warned_at"], end], [i, i], color="tab:blue", linewidth=6, alpha=0.35)
                ax.plot(r["warned_at"], i, "o", color="tab:orange", label="first warning" if i == 0 else None)
            if r["nonfinite_at"] is not None:
                ax.plot(r["nonfinite_at"], i, "x", color="tab:red", markersize=9,
                        label="first non-finite loss" if i == 0 else None)
                if r["lead"] is not None:
                    ax.annotate(f"lead {r['lead']}", (r["nonfinite_at"], i), textcoords="offset points",
                                xytext=(8, -3), fontsize=8)
        ax.axvline(80, color="grey", linestyle=":", linewidth=0.8, label="growth injected (step 80)")
        ax.set_yticks(range(len(warned)), [f"seed {r['seed']}" for r in warned])
        ax.set_xlabel("optimizer step")
        alarms = sum(r["warned_at"] is not None for r in clean)
        ax.set_title(f"Growth warning lead (FP8, every 10 steps; goal >= 50 steps); clean runs: {alarms}/{len(clean)}"
                     " false alarms", fontsize=9)
        ax.set_xlim(0, max(r["nonfinite_at"] or r["warned_at"] or 0 for r in warned) + 60)
        ax.legend(fontsize=7, loc="center left")
        fig.tight_layout()
        fig.savefig(out / "lead_time.png", dpi=110)
        plt.close(fig)


def markdown(results: dict) -> str:
    lines = ["# Optimizer state precision and the growth early warning", "",
             f"Commands (CPU, torch {torch.__version__}; `PYTHONPATH=. .venv/bin/python experiments/optimizer_state.py"
             " ARGS`, one part or model at a time):", ""]
    lines += [f"- {part}: `{argv}`" for part, argv in sorted(results.get("commands", {}).items())]
    lines += ["", "Figures: [frontier.png](frontier.png) (validation loss vs optimizer-state memory),"
              " [lead_time.png](lead_time.png) (the growth warning's lead).", ""]
    if "moments" in results:
        lines += ["## Moments: validation loss vs FP32 moments, and state memory", "",
                  "| model | weights | steps | moments | val loss (mean of seeds) |"
                  " vs fp32 moments (mean of per-seed %) |"
                  " worst seed | state bytes | vs fp32 moments |", "|---|---|---|---|---|---|---|---|---|"]
        rows = results["moments"]
        keys = sorted({(r["model"], r["weights"]) for r in rows}, key=lambda k: (k[0] != "mlp", k[1]))
        for model, weights in keys:
            sub = [r for r in rows if r["model"] == model and r["weights"] == weights]
            ref = {r["seed"]: r for r in sub if r["kind"] == "fp32"}
            for kind in ("fp32", "bf16", "fp8"):
                rs = [r for r in sub if r["kind"] == kind]
                if not rs:
                    continue
                deltas = [100 * (r["val_loss"] / ref[r["seed"]]["val_loss"] - 1) for r in rs if r["seed"] in ref]
                worst = max(deltas, key=abs) if deltas else float("nan")
                state = rs[0]["state_bytes"]
                ref_bytes = next(iter(ref.values()))["state_bytes"] if ref else state
                lines.append(
                    f"| {model} | {'FP32 masters' if weights == 'True' else weights} | {rs[0]['steps']} | {kind} |"
                    f" {statistics.mean(r['val_loss'] for r in rs):.4f} | {statistics.mean(deltas):+.2f}% |"
                    f" {worst:+.2f}% | {state:,} | {state / ref_bytes:.3f}x |")
        lines += ["", "With compact weights (`kahan`) the `fp32` row is today's compact path, whose optimizer state"
                  " is already kept in 16 bits by CompactWeights (so its ratio column compares against 16-bit"
                  " state).", ""]
    if "warning" in results:
        rows = results["warning"]
        grown = [r for r in rows if r["grow"]]
        clean = [r for r in rows if not r["grow"]]
        lines += ["## Early warning (FP8 current scaling, SwiGLU alignment injected from step 80)", "",
                  "| seed | first warning (step) | first non-finite loss (step) | lead (steps) | named |",
                  "|---|---|---|---|---|"]
        for r in grown:
            lines.append(f"| {r['seed']} | {r['warned_at']} | {r['nonfinite_at']} | {r['lead']} | {r['named']} |")
        alarms = sum(r["warned_at"] is not None for r in clean)
        lines += ["", f"Clean runs (400 steps, 5 seeds): {alarms} false alarms.", ""]
    if "overhead" in results:
        o = results["overhead"]
        lines += ["## Overhead of sampling every 10 steps (digits MLP, fp8='current', CPU)", "",
                  f"Median step: off {o['median_step_s']['off'] * 1e3:.2f} ms, every 10"
                  f" {o['median_step_s']['every 10'] * 1e3:.2f} ms; paired ratio (median of"
                  f" {len(o['ratios'])} rounds) {o['paired_ratio_median']:.3f}x.", ""]
    lines += [f"Note: {note}" for note in results.get("notes", [])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

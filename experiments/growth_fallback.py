"""The growth warning with the fallback on: does the run that FP8 would lose end where BF16 ends?

    PYTHONPATH=. .venv/bin/python experiments/growth_fallback.py --mode dead_channel [--recipe delayed]
    PYTHONPATH=. .venv/bin/python experiments/growth_fallback.py [--grow-until 240]   # the alignment task

The tasks are the FP8 growth tasks of ``lit_mpstable.app.growth_demo`` (a pre-norm residual SwiGLU block on a
fixed regression, AdamW; hidden unit 0's gate and up rows driven into alignment from step 80, Smooth-SwiGLU's
mechanism). Per seed, runs from the same weights on the same batches, each ``StablePrecision("bf16-mixed",
growth_every_n_steps=10)`` with OverflowMonitor:

- ``bf16``: no FP8, the reference;
- ``fp8``: ``fp8="current"`` (``--recipe delayed``: delayed scaling), no fallback;
- ``fp8+fallback``: the same with ``PrecisionFallback(on_growth=True)``: the layers it moves out of FP8, and when;
- ``--mode dead_channel`` only, the same task without the growth: ``bf16 clean``, ``fp8 clean`` (FP8's own floor on
  the task) and ``fp8 clean, down bf16`` (the fallback's end configuration from the start: ``mlp.down`` in BF16).

The issue's target (#29): with the fallback on, only the affected layer leaves FP8 and the run ends within 0.5% of
BF16's loss. "Ends": the mean-squared error over the task's whole data set after the last step, evaluated in the
run's own precision (the plugin's forward context: FP8 layers stay FP8), and for reference in FP32 (the FP8 layers'
weights without quantization: the module in FP32). Writes ``experiments/results/growth_fallback/``:
``results.{json,md}`` (alignment; ``results_until<N>.*`` with ``--grow-until N``), ``results_dead_channel[_delayed]
.{json,md}`` and ``loss_dead_channel[_delayed].png`` (training loss vs step of the three variants, seed 0).

Why a second task. The alignment task cannot answer the question: its growth never stops, so BF16 loses the run too
(5 seeds, 320 steps, Intel Xeon: first non-finite step 276-293 for FP8, 283-297 for BF16; the fallback moves
``mlp.down`` out of FP8 at step 91-101 in 5/5 seeds for its input, then ``mlp.gate`` and ``mlp.up`` for their own
weights, whose grown rows make the FP8 cast flush over 5% of the rest, at the growth monitor's weight refreshes
(every 80 steps: step 161 or 241), and its first non-finite step is 281-289: nothing survives). Stopped at step 240
(``--grow-until 240``), FP8 ends +113% to +407% from BF16 and the fallback +4.7% to +155% (the same moves; with the
weights read at every sample, gate and up left at step 161-171 and it ended +4.7% to +36%): the injection scrambles
the loss. (Before the growth monitor read FP8 weights, the fallback moved ``mlp.down`` alone and ended -55% to +145%
from BF16, on an AMD EPYC.) ``--mode dead_channel`` is the "massive activation" pattern (Sun et al. 2024: a few
hidden units 1e3-1e4x the rest, which the network compensates), made exact: unit 0 grows as in the alignment task
until its amax over the data set is ``--cap`` (1e8) x every other unit's (step 156-161, a magnitude BF16 holds with
2**100 to spare), and its column of ``mlp.down`` is zero from the start (pinned after every optimizer step). In exact
arithmetic and in BF16 the output then does not depend on unit 0 (0 x a finite value is 0 and adds nothing to the
GEMM's sum; no gradient reaches its gate and up rows), so the BF16 run with the growth ends bit for bit where the
clean BF16 run ends (checked per seed, and by ``test_dead_channel_fallback_moves_only_mlp_down_and_ends_near_bf16``):
BF16 survives unharmed. In FP8 the per-tensor scale of ``mlp.down``'s input is 448 / amax, so once unit 0 is ~2**17 x
the others, E4M3 flushes them to zero: the MLP's output and ``mlp.down``'s weight gradient vanish, silently (no NaN,
no overflow). Delayed scaling (saturating casts) clips unit 0 while its amax history lags the growth, which would
cost nothing here (its column is zero), and flushes the rest like current scaling once the history catches up
(measured: as harmful as current).

Measured (5 seeds, 320 steps, ``--mode dead_channel``, CPU, one thread; results_dead_channel*.md):

- FP8 current scaling without the fallback: 99.0-99.6% of ``mlp.down``'s input flushed at the end (seed 0, read
  every 10 steps in a one-off probe: 0.2% at step 91, 13% at 111, 63% at 121, 99% from 131), end loss +170% to
  +1011% over BF16 (mean +438%), no non-finite step.
- The fallback moves ``mlp.down`` alone out of FP8, at step 91 in 5/5 seeds (the first growth sample after the start
  names it: in seed 0, the same probe, the kurtosis of its input is 193 > 100, unit 0 is 11x the others);
  ``mlp.gate`` and ``mlp.up`` stay FP8 to the end. End loss vs BF16: +0.45%, +0.08%, +0.58%, +0.11%, +0.38% (mean
  +0.32%, 4/5 seeds within 0.5%; in the FP32 evaluation +0.49%, +0.16%, +0.47%, +0.11%, +0.48%: 5/5).
- The floor: clean FP8 (no growth) already ends +0.48% to +0.95% from BF16 (mean +0.75%; +0.95%, +0.48%, +0.89%,
  +0.50%, +0.95%): FP8 alone ends at or beyond 0.5% on this task in 4/5 seeds. The fallback's gap minus that floor
  is -0.31% to -0.57% (its ``mlp.down`` runs in BF16, the clean FP8 run's does not); against the clean run in the
  fallback's end configuration (``mlp.down`` in BF16 from the start: +0.12% to +0.77%, mean +0.57%) it is -0.04% to
  -0.47%: the growth leaves no measurable cost once ``mlp.down`` has moved; what remains is FP8's own noise on the
  other two layers.
- ``--recipe delayed``: FP8 +205% to +1059% (mean +458%); the fallback moves ``mlp.down`` alone (step 91; step 101
  in seed 3) and ends +0.16% to +0.74% (mean +0.42%, 3/5 within 0.5%; FP32 evaluation also 3/5) against a
  clean-FP8 floor of +0.37% to +1.01% (fallback - floor: -0.09% to -0.63%; against the ``mlp.down``-in-BF16
  floor: -0.33% to +0.30%).

- The same on an Intel Xeon with AMX (``results_dead_channel_xeon_amx.*``; the runs above are an AMD EPYC's): the
  fallback moves ``mlp.down`` alone at step 91 in 5/5 seeds and ends +0.40%, +0.37%, +0.48%, +0.11%, +0.75% (mean
  +0.42%, 4/5 within 0.5%) against a clean-FP8 floor of +0.34% to +1.05% (mean +0.75%).
- ``--recipe blockwise`` (DeepSeek-V3's 1x128 / 128x128 blocks, Intel Xeon): the growth flushes ``mlp.down``'s input
  as it does per tensor (98.9-99.2%, FP8 +1114% to +1570%), since unit 0 sits in every row's block; the fallback
  moves ``mlp.down`` alone (step 91, 5/5) and ends +0.13% to +1.04% (mean +0.61%, 1/5 within 0.5%) against a
  clean-blockwise floor of +0.16% to +1.15% (mean +0.70%): finer scales do not take the floor under 0.5% here.

- ``--format e4m3`` (E4M3 gradients instead of E5M2, current scaling, Intel Xeon; ``results_dead_channel_e4m3.*``):
  the fallback moves ``mlp.down`` alone (step 91, 5/5) and ends +0.43% to +0.83% (mean +0.61%, 2/5 within 0.5%)
  against a clean floor of +0.64% to +0.97% (mean +0.82%): the gradients' format is not what keeps the floor up;
  a finer gradient grid with less range does no better here.

Target: "only the affected layer leaves FP8" met (5/5 seeds, every recipe); "within 0.5% of BF16" met in 4/5 seeds
(current) and 3/5 (delayed), not in every seed, and the misses (+0.58%, +0.57%, +0.74%) are below the same seed's
clean-FP8 gap: on this task 0.5% is inside FP8's own noise. ``growth_fallback_gpt.py`` answers the target on the
CPU GPT, whose clean-FP8 floor is -0.24% to +0.37%: 5/5 seeds within 0.5%.

With the growth monitor's weight rule (an FP8 layer whose own weight cast flushes over 5% of it is named; the weights
are read every 80 steps), rerun on the Intel Xeon (``results_dead_channel_weight_rule[_delayed].*``; ``--out`` a
scratch folder, copied): ``mlp.down`` alone leaves, at step 91-101, in 5/5 seeds with both recipes (the grown gate
and up rows flush 1.4-3% of their weights, under the 5%). End loss vs BF16: current +0.13% to +0.69% (mean +0.37%,
4/5 within 0.5%), delayed +0.17% to +0.68% (mean +0.39%, 4/5), against clean-FP8 floors of +0.62% and +0.84% mean.
The GPT task above answers the target.

The growth monitor's ``underflow`` now reads the flush (99.0-99.7% at the end, against 99.0-99.6% computed here on
the whole data set): it read 0.0-1.2% when it measured every layer at scale 1 rather than at the scale the FP8 layer
casts with (448 / amax under current scaling); the fallback triggers on kurtosis here (step 90), before the flush
begins, so its decisions did not change.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import time
import warnings
from pathlib import Path

import torch

from lit_mpstable import FP8Config

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "results" / "growth_fallback"

from lit_mpstable.app.growth_demo import DEAD_CAP, GROW_FROM, MODES  # noqa: E402
from lit_mpstable.app.growth_demo import run_growth_task as _run  # noqa: E402

VARIANTS = {"bf16": dict(recipe=None, fallback=False), "fp8": dict(recipe="current", fallback=False),
            "fp8+fallback": dict(recipe="current", fallback=True)}
# dead_channel only: the same task without the growth. "fp8 clean, down bf16": the fallback's end configuration
# (mlp.down out of FP8) from the start, the floor of what the fallback can reach.
CLEAN = {"bf16 clean": dict(recipe=None, fallback=False), "fp8 clean": dict(recipe="current", fallback=False),
         "fp8 clean, down bf16": dict(recipe="current", fallback=False, fp8_layers=["mlp.gate", "mlp.up"])}


@torch.no_grad()
def final_loss(module, plugin) -> dict[str, float]:
    module.eval()
    with plugin.forward_context():
        own = torch.nn.functional.mse_loss(module(module.x).float(), module.y)
    fp32 = torch.nn.functional.mse_loss(module.float()(module.x), module.y)
    return {"own": float(own), "fp32": float(fp32)}


def e4m3_flushed(hidden: torch.Tensor) -> float:
    """The fraction of the nonzero elements of ``mlp.down``'s input (the whole data set as one tensor) that E4M3 with
    per-tensor current scaling (448 / amax) flushes to zero: what the growth monitor's ``underflow`` reads (on the
    sampled batch) at the layer's own scale."""
    nonzero = hidden[hidden != 0]
    q = (nonzero * (448.0 / nonzero.abs().amax())).to(torch.float8_e4m3fn).float()
    return float((q == 0).float().mean())


def run(seed: int, variant: str, args: argparse.Namespace) -> dict:
    start = time.process_time()
    spec = {**VARIANTS, **CLEAN}[variant]
    recipe = spec["recipe"] and args.recipe
    if recipe and ("fp8_layers" in spec or args.format != "hybrid"):
        recipe = FP8Config(recipe=args.recipe, filter=spec.get("fp8_layers"), format=args.format)
    module, plugin, growth, callbacks = _run(seed, grow=variant not in CLEAN, steps=args.steps,
                                             grow_until=args.grow_until, mode=args.mode, cap=args.cap,
                                             fallback=spec["fallback"], recipe=recipe)
    fp8 = sorted(n for n, m in module.named_modules() if type(m).__name__ == "FP8Linear")
    moved = ([{"step": d.get("step"), "modules": d["modules"]} for d in callbacks[1].decisions
              if d["action"] == "fallback"] if spec["fallback"] else [])
    out = {"seed": seed, "variant": variant, "recipe": str(recipe) if isinstance(recipe, FP8Config) else recipe,
           "mode": args.mode, "steps": args.steps, "grow_until": args.grow_until,
           "first_nonfinite": module.first_nonfinite,
           "first_warning": growth[0][0] if growth else None, "fp8_layers_at_end": fp8, "fallbacks": moved,
           "skipped_steps": int(plugin.skipped_steps) if hasattr(plugin, "skipped_steps") else None,
           "loss": final_loss(module, plugin), "cpu_s": time.process_time() - start}
    if args.mode == "dead_channel":
        out |= {"saturated_at": module.saturated_at, "unit_ratio_at_end": module.unit_ratio(),
                "e4m3_flushed_at_end": e4m3_flushed(module.hidden()),
                "down_input_at_end": (plugin.runaway_layers(), plugin.stats["growth"].get("mlp.down"))[1]}
    print(json.dumps(out), flush=True)
    out["train_loss"] = module.losses
    return out


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    lines = ["# The growth warning with the fallback on (FP8 current scaling, SwiGLU alignment from step 80)", "",
             f"`PYTHONPATH=. .venv/bin/python experiments/growth_fallback.py --seeds {args.seeds} --steps {args.steps}"
             + (f" --grow-until {args.grow_until}" if args.grow_until is not None else "") + "`"
             " (CPU, one thread). Loss: MSE over the task's data after the last step, in the run's own precision"
             " (FP32 evaluation in brackets); gap: against the same seed's BF16 run.", "",
             "| seed | bf16: first non-finite step, end loss | fp8 (no fallback): first non-finite step, end loss |"
             " fp8+fallback: first warning; moved (step: layers); FP8 layers at the end; first non-finite step |"
             " fp8+fallback loss | gap vs bf16 |",
             "|---|---|---|---|---|---|"]
    by = {(r["seed"], r["variant"]): r for r in rows}
    gaps = []
    for seed in sorted({r["seed"] for r in rows}):
        b, f, fb = by[(seed, "bf16")], by[(seed, "fp8")], by[(seed, "fp8+fallback")]
        gap = fb["loss"]["own"] / b["loss"]["own"] - 1
        gaps.append(gap)
        moved = "; ".join(f"step {m['step']}: {'+'.join(m['modules'])}" for m in fb["fallbacks"]) or "none"
        lines.append(
            f"| {seed} | {b['first_nonfinite']}, {b['loss']['own']:.4f} ({b['loss']['fp32']:.4f}) |"
            f" {f['first_nonfinite']}, {f['loss']['own']:.4g} | {fb['first_warning']}; {moved};"
            f" {'+'.join(fb['fp8_layers_at_end'])}; {fb['first_nonfinite']} |"
            f" {fb['loss']['own']:.4f} ({fb['loss']['fp32']:.4f}) | {gap:+.2%} |")
    finite = [g for g in gaps if math.isfinite(g)]
    if finite:
        worst = max(finite, key=abs)
        lines += ["", f"Gap vs BF16, mean over seeds: {statistics.mean(finite):+.2%}; worst {worst:+.2%}."]
    return "\n".join(lines) + "\n"


def gap(a: float, b: float) -> float:
    return a / b - 1 if math.isfinite(a) and math.isfinite(b) and b > 0 else math.nan


def markdown_dead(rows: list[dict], args: argparse.Namespace) -> str:
    by = {(r["seed"], r["variant"]): r for r in rows}
    fmt = "" if args.format == "hybrid" else f", {args.format.upper()} for all three tensors"
    lines = [f"# The fallback on a dead massive-activation unit (FP8 {args.recipe} scaling{fmt}, unit 0 grows from step"
             f" 80 to {args.cap:.0e}x the other units, its mlp.down column pinned to zero)", "",
             f"`{command(args)}` (CPU, one thread). Loss: MSE over the task's data after the last step, in the run's"
             " own precision (FP32 evaluation in brackets); gaps against the same seed's BF16 run. Clean: the same task"
             " without the growth (unit 0 dead, not growing): clean FP8 vs clean BF16 is FP8's floor on this task."
             " bf16 = clean: the BF16 run with the growth ends bit for bit where the clean BF16 run ends. Flushed: the"
             " fraction of the nonzero elements of mlp.down's input (the data set) that E4M3 at 448 / amax flushes.",
             "",
             "| seed | bf16 loss; = clean | growth stops (step) | fp8 loss, gap; mlp.down's input flushed by E4M3 at"
             " the end (the growth monitor's underflow reading) | fp8+fallback: first warning; moved (step:"
             " layers); FP8 layers at the end | fp8+fallback loss, gap | clean fp8 gap (floor); clean with mlp.down in"
             " BF16 | fallback gap - floor; - the mlp.down-in-BF16 floor |",
             "|---|---|---|---|---|---|---|---|"]
    stats: dict[str, list[float]] = {k: [] for k in ("fp8", "fallback", "floor", "excess", "floor_down",
                                                     "excess_down")}
    only_down = True
    for seed in sorted({r["seed"] for r in rows}):
        b, f, fb = by[(seed, "bf16")], by[(seed, "fp8")], by[(seed, "fp8+fallback")]
        cb, cf, cd = by[(seed, "bf16 clean")], by[(seed, "fp8 clean")], by[(seed, "fp8 clean, down bf16")]
        g_f, g_fb = gap(f["loss"]["own"], b["loss"]["own"]), gap(fb["loss"]["own"], b["loss"]["own"])
        floor, floor_down = gap(cf["loss"]["own"], cb["loss"]["own"]), gap(cd["loss"]["own"], cb["loss"]["own"])
        for key, value in (("fp8", g_f), ("fallback", g_fb), ("floor", floor), ("excess", g_fb - floor),
                           ("floor_down", floor_down), ("excess_down", g_fb - floor_down)):
            stats[key].append(value)
        only_down &= bool(fb["fallbacks"]) and all(m["modules"] == ["mlp.down"] for m in fb["fallbacks"])
        moved = "; ".join(f"step {m['step']}: {'+'.join(m['modules'])}" for m in fb["fallbacks"]) or "none"
        under = (f["down_input_at_end"] or {}).get("underflow", math.nan)
        same = "yes" if b["loss"] == cb["loss"] else "no"
        lines.append(
            f"| {seed} | {b['loss']['own']:.5f} ({b['loss']['fp32']:.5f}); {same} | {b['saturated_at']} |"
            f" {f['loss']['own']:.5f}, {g_f:+.1%}; {f['e4m3_flushed_at_end']:.1%} ({under:.1%}) |"
            f" {fb['first_warning']}; {moved};"
            f" {'+'.join(fb['fp8_layers_at_end'])} | {fb['loss']['own']:.5f} ({fb['loss']['fp32']:.5f}), {g_fb:+.2%} |"
            f" {floor:+.2%}; {floor_down:+.2%} | {g_fb - floor:+.2%}; {g_fb - floor_down:+.2%} |")
    mean = {k: statistics.mean(v) for k, v in stats.items()}
    worst = {k: max(v, key=abs) for k, v in stats.items()}
    within = sum(abs(g) <= 0.005 for g in stats["fallback"])
    lines += ["", f"Gap vs BF16 (mean; worst): FP8 {mean['fp8']:+.1%}; {worst['fp8']:+.1%}, FP8+fallback"
              f" {mean['fallback']:+.2%}; {worst['fallback']:+.2%} ({within}/{len(stats['fallback'])} seeds within"
              f" 0.5%), clean FP8 (floor) {mean['floor']:+.2%}; {worst['floor']:+.2%}, fallback - floor"
              f" {mean['excess']:+.2%}; {worst['excess']:+.2%}; clean FP8 with mlp.down in BF16 (the fallback's end"
              f" configuration) {mean['floor_down']:+.2%}; {worst['floor_down']:+.2%}, fallback - that floor"
              f" {mean['excess_down']:+.2%}; {worst['excess_down']:+.2%}. Only mlp.down left FP8 in every seed:"
              f" {'yes' if only_down else 'no'}."]
    return "\n".join(lines) + "\n"


def figure(rows: list[dict], args: argparse.Namespace, path: Path, seed: int = 0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in loss_curves(ax, rows, seed):
        if r["variant"] == "bf16" and r.get("saturated_at") is not None:
            ax.axvline(r["saturated_at"], color="purple", ls="--", lw=1,
                       label=f"growth stops (unit 0 at {args.cap:.0e}x, step {r['saturated_at']})")
        for m in r["fallbacks"]:
            ax.axvline(m["step"], color="grey", ls=":", lw=1)
            ax.annotate(f"{'+'.join(m['modules'])} leaves FP8", (m["step"], ax.get_ylim()[1]), fontsize=8,
                        va="top", ha="left", rotation=90)
    ax.axvline(GROW_FROM, color="red", ls="--", lw=1, label=f"growth starts (step {GROW_FROM})")
    ax.set(yscale="log", xlabel="step", ylabel="train loss (10-step mean)",
           title=f"Dead massive-activation unit, seed {seed}, FP8 {args.recipe} scaling"
                 + ("" if args.format == "hybrid" else f" ({args.format.upper()})"))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def loss_curves(ax, rows: list[dict], seed: int) -> list[dict]:
    """Plot the 10-step mean training loss of seed ``seed``'s bf16, fp8 and fp8+fallback runs; return those rows."""
    style = {"bf16": dict(color="black", ls="--", lw=1, zorder=3), "fp8": dict(color="tab:orange"),
             "fp8+fallback": dict(color="tab:green", lw=2.5)}
    drawn = [r for r in rows if r["seed"] == seed and r["variant"] in style]
    for r in drawn:
        losses = torch.tensor(r["train_loss"], dtype=torch.float64)
        width = min(10, len(losses))
        smooth = losses.unfold(0, width, 1).mean(1)
        ax.plot(range(width, width + len(smooth)), smooth.tolist(), label=r["variant"], **style[r["variant"]])
    return drawn


def command(args: argparse.Namespace) -> str:
    extra = "".join(f" --{k.replace('_', '-')} {v}" for k, v in (("mode", args.mode), ("recipe", args.recipe),
                                                               ("format", args.format),
                                                               ("grow_until", args.grow_until)) if v not in
                    (None, "align", "current", "hybrid"))
    cap = f" --cap {args.cap:g}" if args.mode == "dead_channel" and args.cap != DEAD_CAP else ""
    return f"PYTHONPATH=. .venv/bin/python experiments/growth_fallback.py --seeds {args.seeds} --steps {args.steps}" \
        + extra + cap


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=320)
    parser.add_argument("--grow-until", type=int, default=None,
                        help="stop the injected growth at this step (default: it never stops, as in the warning part)")
    parser.add_argument("--mode", choices=MODES, default="align",
                        help="align: the warning part's task; dead_channel: unit 0 grows, its mlp.down column is zero")
    parser.add_argument("--cap", type=float, default=DEAD_CAP,
                        help="dead_channel: unit 0's amax / the other units' where its growth stops")
    parser.add_argument("--recipe", choices=("current", "delayed", "blockwise"), default="current",
                        help="the FP8 recipe")
    parser.add_argument("--format", choices=("hybrid", "e4m3"), default="hybrid",
                        help="per-tensor recipes' element formats: hybrid (E5M2 gradients) or e4m3 (E4M3 for all)")
    parser.add_argument("--out", default=str(OUT), help="the results folder")
    args = parser.parse_args(argv)
    for name in ("seeds", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}={getattr(args, name)!r}: must be >= 1.")
    if args.grow_until is not None and args.grow_until < 0:
        raise ValueError(f"--grow-until={args.grow_until!r}: must be a step >= 0 (the growth starts at step 80).")
    if not 1 < args.cap < 1e30:
        raise ValueError(f"--cap={args.cap!r}: must be in (1, 1e30) (an amax ratio BF16 holds).")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = [line for line in flags.splitlines() if line.startswith(("Model name", "Flags"))]
    load = os.getloadavg()
    print("\n".join(cpu), f"load average at start: {load}", sep="\n", flush=True)
    variants = list(VARIANTS) + (list(CLEAN) if args.mode == "dead_channel" else [])
    rows = [run(seed, variant, args) for seed in range(args.seeds) for variant in variants]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.mode == "align":
        tag = "" if args.grow_until is None else f"_until{args.grow_until}"
        table = markdown(rows, args)
    else:
        tag = "_dead_channel" + ("" if args.recipe == "current" else f"_{args.recipe}") \
            + ("" if args.format == "hybrid" else f"_{args.format}") \
            + ("" if args.cap == DEAD_CAP else f"_cap{args.cap:g}") \
            + ("" if args.grow_until is None else f"_until{args.grow_until}")
        table = markdown_dead(rows, args)
        figure(rows, args, out / f"loss{tag}.png")
    head = json.dumps({"cpu": cpu, "args": vars(args), "load_at_start": load}, indent=2)
    body = ",\n".join(json.dumps(r) for r in rows)  # a row a line: the loss curves would take a line a number
    (out / f"results{tag}.json").write_text(head[:-2] + ',\n  "rows": [\n' + body + "\n]}\n")
    (out / f"results{tag}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()

"""LR sweep on the CPU GPT: fixed gradient clipping at 1.0 against SpikeGuard (ZClip-style clip and skip).

    .venv/bin/python experiments/spike_lr_sweep.py --seeds 3            # ~9 min on 1 thread (loaded machine)
    .venv/bin/python experiments/spike_lr_sweep.py --steps 40 --seeds 1  # smoke run
    .venv/bin/python experiments/spike_lr_sweep.py --n-layers 4 --warmup 100 --steps 600 --beta2 0.999 --seeds 3
        --out experiments/results/spike_lr_sweep/deep_beta2_999   # (one command) the deeper regime below, ~37 min

The issue's target (#26): over the GPT's learning rate x{1, 2, 4, 8}, the largest multiplier that does not diverge
with SpikeGuard is >= 2x fixed clipping's, and SpikeGuard reaches fixed clipping's best validation loss in >= 20%
fewer steps. Both methods train ``lit_mpstable.app.zoo.GPT`` (d 128, 2 blocks by default: ``--d-model``,
``--n-layers``; context 64) on the standard-library character corpus (``CharLMData``, batch 16) through a plain
:class:`PrecisionStepper` loop with AdamW (betas 0.9, 0.95 by default, weight decay 0.01), a linear warmup then a
cosine decay to 0, from the same initial weights and on the same batches per seed:

- ``fixed``: ``clip_grad_norm_(optimizer, 1.0)``, no guard;
- ``guard``: ``PrecisionStepper(spike_guard=SpikeGuard(clip_zscore=2.5))`` and ``clip_grad_norm_(optimizer,
  --guard-max-norm)`` (default inf: the adaptive ZClip threshold alone, ``mean + 2.5 std`` of the recent norms,
  none during the guard's warmup) plus the default spike skip (6 sigma over 128 steps). A skipped step holds the LR.
  ``--guard-mode clip`` / ``skip`` keeps one part only; ``--clip-zscore`` sets ZClip's z.

A run **diverges** when a validation loss is NaN/inf or above the initial (step 0) validation loss, i.e. training
lost everything it had learnt; it is then stopped. A run that ends above ``1.1 x`` the best final loss of the sweep
is listed as **degraded**. "Steps to fixed's best": the first evaluation step at which any LR of a method reaches
the best validation loss fixed clipping reached at any LR (evaluations every ``--eval-every`` steps).

Regime, chosen by where *fixed clipping* starts to fail (bf16-mixed, seed 0, fixed clipping only, before any guard
run of the sweep), base 1.2e-2: with warmup 20 x4..x16 (0.048-0.192) end degraded (val 2.82-3.19 vs 2.58 at x2) but
none diverges, and x32 (0.384) diverges by step 25; with no warmup (1 step; beta2 0.95 or 0.999) x1..x16 do not
diverge either (at x8-x16 the loss jumps to 9-21 in the first steps, then stalls near 3.1-3.3) and x32 (beta2
0.95) diverges; over
1000 steps (warmup 20, beta2 0.95 or 0.999) x2 and x8 show no late divergence. FP16-mixed: x16 stable, x32 NaN, at
~10x the CPU time, so it is not swept. Hence base 0.048: x1..x4 (0.048-0.192) do not diverge with fixed clipping, x8
(0.384) is its first divergence, and the question is whether the guard rescues x8. These LRs are 2-32x the model's
best LR (0.012-0.024): this 2-block GPT does not diverge at any LR a user would pick.

Result (3 seeds, ``table.md``, re-run on an Intel Xeon with AMX; the first run, on an AMD EPYC, gave the same
verdicts): the guard diverges exactly where fixed clipping does (x8, every seed, by step 25-50, 0 spike skips), so
the stable-LR ratio is 1 (target >= 2: NOT met); the guard reaches fixed clipping's best val loss in 2 of 3 seeds
(275 and 225 vs 300 steps; on the AMD run 1 of 3), so the median steps ratio is 0.92 (target <= 0.8: NOT met).
Why clipping cannot be beaten here (the table's norm columns, the total gradient norm before clipping): at x1 the
median norm is 1.2-1.5 over steps 1-20 and 0.25-0.28 after, so clip 1.0 acts on 17-21 of 300 steps; at x8 the norm
is 4-5 in steps 1-20 and 5-8 after, so clip 1.0 acts on every step (a normalised-gradient method), while ZClip's
limit (mean + 2.5 std of those same norms) sits at 9-13 and clips 0-2 of 25 steps: where this GPT diverges, the
adaptive limit is always looser than the fixed one. At x8 with 3 seeds
(``ablation_x8_*.md``: ``--mults 8`` with ``--guard-mode skip``, ``--guard-mode clip``, ``--clip-zscore 3.0``,
``--guard-max-norm 1.0``) every guard variant diverges by step 25 with 0 skips; the guard on top of clip 1.0 gives
the same losses as clip 1.0 alone. Post hoc (a one-off probe, not this script's options): the most aggressive
public settings, ``SpikeGuard(zscore=3, warmup=4, clip_zscore=2.5)``, with max_norm inf or 1.0, still diverge at x8
by step 25 on all 3 seeds (0-20 skips). Why (seed 0, x8, a one-off per-step trace of loss, norm and z-scores): the loss
swings between 4 and 8 from step 3 on, while the guard is still in its 20-step warmup (no judging, no clipping), so
the rolling statistics then learn the instability: the largest z-scores over steps 21-40 are 4.1 (loss) and 3.8
(norm), under the skip's 6; the ZClip threshold (8.8-11.6) is looser than the fixed 1.0 it replaces; and AdamW's
update size does not follow the gradient norm, so no clipping bounds it.

A deeper regime, after a realistic warmup (``--n-layers 4 --warmup 100 --steps 600 --beta2 0.999``; d 128, 144-168
CPU ms/step, bf16-mixed), probed like the first with fixed clipping only, seed 0, base 1.2e-2, before any guard run:

- 4 blocks, warmup 100 of 600 steps, beta2 0.95: x4 (0.048) val 2.31, x8 (0.096) 2.62, x16 (0.192) 3.21, x32
  (0.384) 3.17: none diverges; at x32 the val loss climbs 3.14 -> 3.81 over steps 25-175 and recovers to 3.17 (a
  stall near the unigram loss, below the step-0 val 5.22, so degraded but not diverged);
- the same with beta2 0.999: x16 (0.192) does not diverge (3.33), x32 (0.384) diverges at step 125 (val 3.16 at 25,
  then 3.32, 3.44, 4.27 at step 100, 8.61 at 125), x64 (0.768) at step 75. Hence base 0.048 again: x8 (0.384) is
  fixed clipping's first divergence, now at the peak of a 100-step warmup (after the guard's own 20-step warmup).
- not probed: d 192 / 6 blocks (279 CPU ms/step at 40 steps, measured; ~3 min a 600-step run on the loaded
  machine) and 1000-step runs with warmup 100.

Result, deeper regime (3 seeds, ``results/spike_lr_sweep/deep_beta2_999/table.md``, the command at the top, 37 min
wall): fixed clipping diverges at x8 on every seed (step 125, 100, 125); the guard diverges at x8 on every seed
too (step 100, 125, 100; 2, 19, 0 skips), so the stable-LR ratio is 1 on every seed (target >= 2: NOT met). Fixed
clipping's best val loss is always at x1 (2.50, 2.44, 2.39 at steps 550, 600, 600); the guard never reaches it (its
x1 ends at 2.56, 2.55, 2.55), so the steps ratio is inf (target <= 0.8: NOT met). At x2 the guard ends lower on
seeds 1 and 2 (2.62, 2.64 vs 3.04, 2.97) and higher on seed 0 (2.85 vs 2.67); at x4 both stall near 3.2. Why (train
losses in ``results.json``, x8): the loss drifts up over 20-40 steps while the LR warms towards its peak (means per
10 steps 2.8-2.9 -> 3.1-3.4 -> 4-5 -> 5-10), not in one batch, so the rolling statistics follow the drift and the
6-sigma skip fires late or never; on seed 1 it skips every step from 107 to the stop at 125, but no step after 106
is applied and the val loss is 6.15 at 125 (3.77 at 100): the weights were broken before the first skip. In both
regimes this GPT's divergence is a gradual LR instability, which neither fixed clipping nor this guard prevented.

Writes ``experiments/results/spike_lr_sweep/{results.json, table.md, sweep.png}`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from lit_mpstable import SpikeGuard  # noqa: E402
from lit_mpstable.app.zoo import GPT, CharLMData  # noqa: E402
from lit_mpstable.core.step.stepper import PrecisionStepper  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "spike_lr_sweep"
METHODS = ("fixed", "guard")
DEGRADED = 1.1


def make_guard(args: argparse.Namespace) -> SpikeGuard:
    """The guard of ``--guard-mode``: ``both`` (ZClip clip and spike skip), ``clip`` (no skip) or ``skip`` (no clip)."""
    clip = args.clip_zscore if args.guard_mode in ("both", "clip") else None
    zscore = 6.0 if args.guard_mode in ("both", "skip") else 1e30  # 1e30: nothing is ever a spike
    return SpikeGuard(zscore=zscore, clip_zscore=clip)


def run(method: str, mult: float, seed: int, args: argparse.Namespace, data: CharLMData) -> dict:
    """One training run; returns its validation curve, train losses, skipped steps and verdict."""
    torch.manual_seed(seed)
    model = GPT(data.vocab_size, d_model=args.d_model, n_layers=args.n_layers)
    guard = make_guard(args) if method == "guard" else None
    stepper = PrecisionStepper(args.precision, device="cpu", spike_guard=guard)
    stepper.setup_module(model)
    lr = args.lr * mult
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, args.beta2), weight_decay=0.01)
    stepper.setup_optimizers(model, [opt])
    def lr_factor(s: int) -> float:
        return min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))

    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    gen = torch.Generator().manual_seed(seed)
    max_norm = 1.0 if method == "fixed" else args.guard_max_norm

    def val_loss() -> float:
        model.eval()
        total, n = 0.0, 0
        with torch.no_grad():
            for j in range(0, min(len(data.val_set), args.val_seqs), 64):
                x, y = data.val_set[j:j + 64]
                with stepper.forward_context():
                    logits = model(x)
                total += float(F.cross_entropy(logits.float().flatten(0, 1), y.flatten())) * len(x)
                n += len(x)
        model.train()
        return total / n

    val = [(0, val_loss())]
    train, skipped, norms, limits, cpu0 = [], [], [], [], time.process_time()
    diverged_at = None
    for step in range(1, args.steps + 1):
        idx = torch.randint(len(data.train_set), (data.batch_size,), generator=gen)
        x, y = data.train_set[idx]
        with stepper.forward_context():
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        stepper.scale_loss(loss).backward()
        norm = stepper.clip_grad_norm_(opt, max_norm)  # the total norm before clipping
        threshold = guard.clip_threshold() if guard is not None else None  # ZClip's, from this step's decide()
        norms.append(float(norm))
        limits.append(min(max_norm, float(threshold)) if threshold is not None else max_norm)
        stepper.step(opt)
        opt.zero_grad(set_to_none=True)
        if stepper.last_step_skipped:
            skipped.append(step)
        else:
            schedule.step()
        train.append(float(loss))
        if step % args.eval_every == 0 or step == args.steps:
            val.append((step, val_loss()))
            if not math.isfinite(val[-1][1]) or val[-1][1] > val[0][1]:
                diverged_at = step
                break
    return {"method": method, "mult": mult, "lr": lr, "seed": seed, "val": val, "train": train,
            "skipped": skipped, "grad_norms": norms, "clip_limits": limits, "diverged_at": diverged_at,
            "final_val": val[-1][1],
            "best_val": min(v for _, v in val if math.isfinite(v)),
            "cpu_s_per_step": (time.process_time() - cpu0) / max(1, len(train))}


def summarise(results: list[dict], args: argparse.Namespace) -> dict:
    """Per method and seed: the largest stable multiplier, the best val loss and the steps to fixed's best."""
    out: dict = {"per_seed": {}}
    for seed in range(args.seeds):
        rows = [r for r in results if r["seed"] == seed]
        finals = [r["final_val"] for r in rows if r["diverged_at"] is None]
        best_final = min(finals) if finals else math.nan
        for r in rows:
            r["degraded"] = r["diverged_at"] is None and r["final_val"] > DEGRADED * best_final
        fixed_best = min(r["best_val"] for r in rows if r["method"] == "fixed")
        seed_out = {"fixed_best_val": fixed_best}
        for method in METHODS:
            mine = [r for r in rows if r["method"] == method]
            stable = [r["mult"] for r in mine if r["diverged_at"] is None]
            healthy = [r["mult"] for r in mine if r["diverged_at"] is None and not r["degraded"]]
            reach = [s for r in mine for s, v in r["val"] if v <= fixed_best]
            seed_out[method] = {"largest_stable_mult": max(stable, default=None),
                                "largest_healthy_mult": max(healthy, default=None),
                                "best_val": min(r["best_val"] for r in mine),
                                "steps_to_fixed_best": min(reach, default=None)}
        f, g = seed_out["fixed"], seed_out["guard"]
        seed_out["stable_ratio"] = (g["largest_stable_mult"] / f["largest_stable_mult"]
                                    if f["largest_stable_mult"] and g["largest_stable_mult"] else None)
        # fixed always reaches its own best; a guard that never does is a miss (inf), not a seed without data
        seed_out["steps_ratio"] = (g["steps_to_fixed_best"] / f["steps_to_fixed_best"]
                                   if g["steps_to_fixed_best"] and f["steps_to_fixed_best"] else math.inf)
        out["per_seed"][seed] = seed_out
    ratios = [s["stable_ratio"] for s in out["per_seed"].values() if s["stable_ratio"] is not None]
    steps = [s["steps_ratio"] for s in out["per_seed"].values()]
    out["median_stable_ratio"] = statistics.median(ratios) if ratios else None
    out["median_steps_ratio"] = statistics.median(steps) if steps else None
    out["target_stable_met"] = out["median_stable_ratio"] is not None and out["median_stable_ratio"] >= 2.0
    out["target_steps_met"] = out["median_steps_ratio"] is not None and out["median_steps_ratio"] <= 0.8
    return out


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.3g}" if values else "-"


def table(results: list[dict], summary: dict) -> str:
    lines = ["| seed | LR x | LR | method | final val | best val | diverged at | degraded | skipped steps |"
             " median norm (steps 1-20 / after) | median clip limit after step 20 | steps clipped |"
             " CPU ms/step |", "| ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"
             " ---: |"]
    for r in sorted(results, key=lambda r: (r["seed"], r["mult"], r["method"])):
        norms, limits = r["grad_norms"], r["clip_limits"]
        late = [v for v in limits[20:] if math.isfinite(v)]
        clipped = sum(n > lim for n, lim in zip(norms, limits))
        lines.append(f"| {r['seed']} | {r['mult']:g} | {r['lr']:.3g} | {r['method']} | {r['final_val']:.4f} |"
                     f" {r['best_val']:.4f} | {r['diverged_at'] if r['diverged_at'] is not None else '-'} |"
                     f" {'yes' if r['degraded'] else 'no'} | {len(r['skipped'])} |"
                     f" {_median(norms[:20])} / {_median(norms[20:])} | {_median(late)} |"
                     f" {clipped}/{len(norms)} | {1e3 * r['cpu_s_per_step']:.1f} |")
    lines += ["", "| seed | fixed: largest stable (healthy) LR x | guard: largest stable (healthy) LR x | ratio"
              " (target >= 2) | fixed's best val | steps to it: fixed | guard | ratio (target <= 0.8) |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for seed, s in summary["per_seed"].items():
        f, g = s["fixed"], s["guard"]

        def fmt(x: object) -> str:
            return "-" if x is None else f"{x:g}" if isinstance(x, (int, float)) else str(x)

        lines.append(f"| {seed} | {fmt(f['largest_stable_mult'])} ({fmt(f['largest_healthy_mult'])}) |"
                     f" {fmt(g['largest_stable_mult'])} ({fmt(g['largest_healthy_mult'])}) |"
                     f" {fmt(s['stable_ratio'])} | {s['fixed_best_val']:.4f} | {fmt(f['steps_to_fixed_best'])} |"
                     f" {fmt(g['steps_to_fixed_best'])} | {fmt(s['steps_ratio'])} |")
    met = {key: "met" if summary[key] else "NOT met" for key in ("target_stable_met", "target_steps_met")}
    lines += ["", f"Median stable-LR ratio {summary['median_stable_ratio']} (target >= 2:"
              f" {met['target_stable_met']}); median steps ratio {summary['median_steps_ratio']} (target <= 0.8:"
              f" {met['target_steps_met']})."]
    return "\n".join(lines)


def plot(results: list[dict], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, final) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.get_cmap("viridis")
    mults = sorted({r["mult"] for r in results})
    for r in results:
        if r["seed"] != 0:
            continue
        steps, vals = zip(*r["val"])
        c = colors(mults.index(r["mult"]) / max(1, len(mults) - 1))
        curves.plot(steps, vals, color=c, ls="-" if r["method"] == "guard" else "--",
                    label=f"x{r['mult']:g} {r['method']}")
    curves.set(xlabel="step", ylabel="validation loss", title="validation loss, seed 0 (dashed: fixed clip 1.0)",
               yscale="log")
    curves.legend(fontsize=7, ncol=2)
    for method, marker in zip(METHODS, ("s", "o")):
        for key, ls in (("final_val", "-"), ("best_val", ":")):
            ys = [statistics.median(r[key] for r in results if r["method"] == method and r["mult"] == m)
                  for m in mults]
            final.plot(mults, ys, marker=marker, ls=ls, label=f"{method}: {key.replace('_val', '')}")
        for r in results:
            if r["method"] == method and r["diverged_at"] is not None:
                final.scatter([r["mult"]], [r["final_val"]], marker="x", color="red", zorder=3)
    final.set(xlabel=f"LR multiplier (base {args.lr:g})", ylabel=f"val loss (median of {args.seeds} seed(s))",
              title="final / best val loss vs LR (x: diverged)", xscale="log", yscale="log")
    final.set_xticks(mults, [f"x{m:g}" for m in mults])
    final.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())  # the log axis's own minor labels clash
    final.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def strict_json(value: Any) -> Any:
    """``value`` with every non-finite float as the string ``"inf"``, ``"-inf"`` or ``"nan"``: strict JSON (what
    parsers other than Python's accept) has no Infinity or NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=0.048,
                        help="base learning rate: x8 (0.384) is the first LR at which fixed clipping diverges")
    parser.add_argument("--mults", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--d-model", type=int, default=128, help="the GPT's width (a multiple of 16)")
    parser.add_argument("--n-layers", type=int, default=2, help="the GPT's number of blocks")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--val-seqs", type=int, default=256)
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "16-mixed", "32-true"])
    parser.add_argument("--guard-max-norm", type=float, default=math.inf,
                        help="fixed ceiling under SpikeGuard's adaptive clip (default inf: ZClip alone)")
    parser.add_argument("--beta2", type=float, default=0.95, help="AdamW's beta2 (0.95; 0.999 is torch's default)")
    parser.add_argument("--guard-mode", default="both", choices=["both", "clip", "skip"],
                        help="SpikeGuard's parts: ZClip clip and spike skip, clip only, or skip only")
    parser.add_argument("--clip-zscore", type=float, default=2.5, help="ZClip's z (2.5 in ZClip)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS),
                        help="which methods to run (both for the sweep; one to probe a regime)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    for name in ("lr", "guard_max_norm"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)!r}: must be > 0.")
    if args.d_model < 16 or args.d_model % 16:
        raise ValueError(f"--d-model={args.d_model!r}: must be a multiple of 16.")
    for name in ("steps", "n_layers", "warmup", "seeds", "eval_every", "val_seqs", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)!r}: must be an integer >= 1.")
    if not args.mults or min(args.mults) <= 0:
        raise ValueError(f"--mults={args.mults!r}: must be one or more multipliers > 0.")
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    data = CharLMData(seq_len=64, batch_size=16)
    data.setup()

    load = os.getloadavg()  # other processes share the cores: CPU ms/step is the figure to compare, not wall time
    results, start = [], time.perf_counter()
    for seed in range(args.seeds):
        for mult in args.mults:
            for method in args.methods:  # alternated per LR, so machine load falls on both alike
                r = run(method, mult, seed, args, data)
                results.append(r)
                print(f"seed {seed} x{mult:g} {method}: final {r['final_val']:.4f} best {r['best_val']:.4f}"
                      f" diverged {r['diverged_at']} skipped {len(r['skipped'])}"
                      f" ({time.perf_counter() - start:.0f} s)", flush=True)
    if set(args.methods) != set(METHODS):
        print("one method only (a regime probe): nothing summarised or written")
        return
    summary = summarise(results, args)
    text = table(results, summary)
    print(text)

    args.out.mkdir(parents=True, exist_ok=True)
    command = "python experiments/spike_lr_sweep.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    try:
        cpu = [line for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
               if line.startswith("Model name")]
        avx = {f for f in Path("/proc/cpuinfo").read_text().split() if f.startswith("avx")}
        cpu.append(f"flags {' '.join(sorted(avx))}")
    except OSError:
        cpu = []
    setup = (f"lit_mpstable.app.zoo.GPT (d {args.d_model}, {args.n_layers} blocks, context 64) on CharLMData"
             f" (batch 16); {args.steps} steps, AdamW base LR {args.lr:g} x {args.mults}, warmup {args.warmup} then"
             f" cosine to 0; precision {args.precision}; AdamW betas (0.9, {args.beta2:g}); fixed = clip 1.0, guard ="
             f" SpikeGuard mode {args.guard_mode} (clip_zscore {args.clip_zscore:g}) with max_norm"
             f" {args.guard_max_norm:g}; val on {args.val_seqs} held-out sequences every {args.eval_every} steps;"
             f" {args.seeds} seed(s); {args.threads} thread(s), torch {torch.__version__}, {' '.join(cpu)}."
             f" Diverged: a val loss NaN/inf or above the step-0 val loss. Degraded: final val > {DEGRADED} x the"
             f" best final of the seed's sweep. Load average at start {load[0]:.1f}. Total"
             f" {time.perf_counter() - start:.0f} s.")
    (args.out / "table.md").write_text(f"# LR sweep: fixed clip 1.0 vs SpikeGuard (clip and skip)\n\n{setup}\n\n"
                                       f"{text}\n\nReproduce: `{command.strip()}`\n")
    (args.out / "results.json").write_text(json.dumps(strict_json({
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "summary": summary, "runs": results}), indent=1, allow_nan=False))
    plot(results, args, args.out / "sweep.png")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

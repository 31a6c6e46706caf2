"""Do the leading indicators warn before the CPU GPT's loss spikes, and stay quiet on clean runs? (issue #46)

    .venv/bin/python experiments/indicators/lead_time.py                       # 5 spiking + 5 clean seeds
    .venv/bin/python experiments/indicators/lead_time.py --seeds 1 --steps 60  # smoke run

``make run``'s model (``lit_mpstable.app.zoo.GPT``: d 128, 2 blocks, 4 heads, context 64) on the standard-library
character corpus (batch 16), trained by a plain loop with AdamW (betas 0.9/``--beta2``, weight decay 0.01, no
gradient clipping), a linear warmup of ``--warmup`` steps then a constant LR. Two arms, each on ``--seeds`` seeds:
``spike`` at ``--spike-lr`` and ``clean`` at ``make run``'s LR (3e-3). Every ``--log-every`` steps the indicators
are measured exactly as :class:`OverflowMonitor` does (``Indicators.snapshot_`` before the step, ``measure`` after,
``judge`` on the read values) and each warning's step is kept.

The **loss spike** is the first step ``s > 30`` whose training loss exceeds ``--spike-factor`` (1.3) times
the median loss of the 20 steps before it, or is not finite. The **lead** of a seed is the spike step minus the step
of the first update-ratio or Adam-lag warning at or before it (none: no lead). The target: lead >= 20 steps in >= 4/5
spiking seeds, and 0 warnings on the clean seeds (whose loss, by construction, may still be noisy).
Writes ``results.json``, ``table.md`` and ``loss_curves.png`` (warnings marked) under
``experiments/results/indicators/``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from lit_mpstable.app.zoo import GPT, CharLMData  # noqa: E402
from lit_mpstable.core.guards.indicators import Indicators, parameter_names  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "results" / "indicators"


def loss_spike(losses: list[float], warmup: int, factor: float) -> int | None:
    """The first spike step (1-based), as the module docstring defines it."""
    for s in range(31, len(losses) + 1):
        loss = losses[s - 1]
        if not math.isfinite(loss) or loss > factor * statistics.median(losses[s - 21:s - 1]):
            return s
    return None


def run(lr: float, seed: int, args: argparse.Namespace, data: CharLMData) -> dict:
    torch.manual_seed(seed)
    model = GPT(data.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, args.beta2), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    indicators = Indicators(ratio_factor=args.ratio_factor, lag_limit=args.lag_limit)
    names = parameter_names(model, opt)
    gen = torch.Generator().manual_seed(seed)
    losses, warnings, logged = [], [], []
    for step in range(1, args.steps + 1):
        logging = step % args.log_every == 0
        if logging:
            indicators.snapshot_(opt)
        idx = torch.randint(len(data.train_set), (data.batch_size,), generator=gen)
        x, y = data.train_set[idx]
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        schedule.step()
        indicators.update_spike_score(loss, opt)
        losses.append(float(loss.detach()))
        if logging:
            ratios, lags, lag_total = indicators.measure(opt)
            flat = torch.cat([ratios, lags, lag_total.reshape(1), indicators.spike_score.score().reshape(1)]).tolist()
            n = len(names)
            ratio_v, lag_v, total, score = flat[:n], flat[n:2 * n], flat[2 * n], flat[2 * n + 1]
            logged.append({"step": step, "update_ratio_max": max(ratio_v), "adam_lag_frac": total,
                           "spike_score": score})
            for text in indicators.judge(ratio_v, lag_v, total, names, step):
                warnings.append({"step": step, "kind": "update_ratio" if text.startswith("update") else "adam_lag",
                                 "text": text})
        if not math.isfinite(losses[-1]):
            break
    spike = loss_spike(losses, args.warmup, args.spike_factor)
    def lead(kinds: tuple[str, ...]) -> int | None:
        before = [w["step"] for w in warnings if w["kind"] in kinds and spike is not None and w["step"] <= spike]
        return spike - before[0] if before and spike is not None else None

    return {"lr": lr, "seed": seed, "losses": losses, "warnings": warnings, "logged": logged, "spike": spike,
            "lead": lead(("update_ratio", "adam_lag")), "lead_update_ratio": lead(("update_ratio",)),
            "lead_adam_lag": lead(("adam_lag",))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--spike-lr", type=float, default=0.4)
    parser.add_argument("--clean-lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--beta2", type=float, default=0.95)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--ratio-factor", type=float, default=2.0)
    parser.add_argument("--lag-limit", type=float, default=0.5)
    parser.add_argument("--spike-factor", type=float, default=1.3)
    parser.add_argument("--arms", default="spike,clean")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = CharLMData(seq_len=64, batch_size=16)
    data.setup()
    results, start = [], time.time()
    for arm in args.arms.split(","):
        lr = args.spike_lr if arm == "spike" else args.clean_lr
        for seed in range(args.seeds):
            r = run(lr, seed, args, data) | {"arm": arm}
            results.append(r)
            print(f"{arm} lr={lr:g} seed={seed}: spike at {r['spike']}, warnings at"
                  f" {[(w['step'], w['kind']) for w in r['warnings']]}, lead {r['lead']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    cpu = f"{platform.processor() or platform.machine()}, torch {torch.__version__}, threads 1, {os.cpu_count()} cpus"
    summary = summarise(results)
    (args.out / "results.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "cpu": cpu, "summary": summary,
         "runs": results, "seconds": round(time.time() - start)}, indent=1))
    lines = ["| arm | LR | seed | loss spike at | warnings (step: indicator) | lead (steps) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        shown = ", ".join(f"{w['step']}: {w['kind']}" for w in r["warnings"]) or "none"
        lines.append(f"| {r['arm']} | {r['lr']:g} | {r['seed']} | {r['spike']} | {shown} | {r['lead']} |")
    lines += ["", f"Summary: {json.dumps(summary)}", "", f"CPU: {cpu}", "",
              "Command: `" + " ".join(["python", *sys.argv]) + "`"]
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    plot(results, args.out / "loss_curves.png")
    print(json.dumps(summary))


def summarise(results: list[dict]) -> dict:
    spiking = [r for r in results if r["arm"] == "spike"]
    clean = [r for r in results if r["arm"] == "clean"]
    leads = [r["lead"] for r in spiking if r["lead"] is not None]
    return {"spiking_seeds": len(spiking), "seeds_with_a_spike": sum(r["spike"] is not None for r in spiking),
            "seeds_warned_20_ahead": sum(lead >= 20 for lead in leads), "leads": [r["lead"] for r in spiking],
            "median_lead": statistics.median(leads) if leads else None,
            "leads_update_ratio": [r["lead_update_ratio"] for r in spiking],
            "leads_adam_lag": [r["lead_adam_lag"] for r in spiking],
            "clean_seeds": len(clean), "clean_warnings": sum(len(r["warnings"]) for r in clean),
            "clean_spikes": sum(r["spike"] is not None for r in clean)}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = sorted({r["arm"] for r in results}, reverse=True)
    fig, axes = plt.subplots(1, len(arms), figsize=(6 * len(arms), 4), squeeze=False)
    for ax, arm in zip(axes[0], arms):
        for r in (r for r in results if r["arm"] == arm):
            line, = ax.plot(range(1, len(r["losses"]) + 1), r["losses"], lw=0.8, label=f"seed {r['seed']}")
            for w in r["warnings"]:
                ax.axvline(w["step"], color=line.get_color(), ls="--" if w["kind"] == "update_ratio" else ":", lw=1)
            if r["spike"] is not None:
                ax.plot(r["spike"], min(r["losses"][r["spike"] - 1], 10), "x", color=line.get_color(), ms=9)
        ax.set_title(f"{arm} (LR {results[[r['arm'] for r in results].index(arm)]['lr']:g}): dashed = update-ratio"
                     " warning, dotted = Adam lag, x = loss spike", fontsize=8)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss")
        ax.set_ylim(0, 8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

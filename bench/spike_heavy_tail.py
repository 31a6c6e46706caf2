"""SpikeGuard's false skips on clean heavy-tailed data, and its catch of injected spikes there.

A regression whose targets carry Student-t noise (``--df`` degrees of freedom: 1 is Cauchy, 2 has no variance; the
per-batch loss and gradient norm are then heavy-tailed, with no spike injected), an MLP (16 -> 64 -> 64 -> 1), AdamW,
batch 32, through a plain PrecisionStepper loop in 'bf16-mixed' with the default SpikeGuard(). Per tail: the clean
steps skipped over ``--seeds`` runs of ``--steps`` steps (each skip with the statistic that flagged it), and in a run
with injected spikes (loss x 1e4 and every 100th coordinate of fc2's weight gradient x 1e3, FaultInjector's two
kinds, ``--spikes`` of each after the warmup) how many were skipped.

    PYTHONPATH=. .venv/bin/python bench/spike_heavy_tail.py [--steps 1000 --seeds 3 --df 1 2 3]

Writes ``bench/results/spike_heavy_tail.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lit_mpstable import SpikeGuard
from lit_mpstable.core.step.stepper import PrecisionStepper
from lit_mpstable.faults import GRAD_SPIKE_FACTOR, GRAD_SPIKE_STRIDE, LOSS_SPIKE_FACTOR

ROOT = Path(__file__).resolve().parents[1]


def run(df: float, seed: int, steps: int, spikes: dict[int, str], watch: tuple[str, ...]) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
    guard = SpikeGuard(watch=watch)
    stepper = PrecisionStepper("bf16-mixed", device="cpu", spike_guard=guard)
    stepper.setup_module(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stepper.setup_optimizers(model, [opt])
    gen = torch.Generator().manual_seed(1000 + seed)
    w = torch.randn(16, 1, generator=gen) / 4
    t = torch.distributions.StudentT(torch.tensor(float(df)))
    torch.manual_seed(2000 + seed)  # the noise draws
    skipped, why = [], []
    clean_ratios: list[tuple[float, float]] = []  # per judged step: loss and norm over their rolling means
    spiked_ratios: list[tuple[float, float]] = []
    fc2 = model[2].weight
    for step in range(steps):
        x = torch.randn(32, 16, generator=gen)
        y = x @ w + 0.1 * t.sample((32, 1))
        kind = spikes.get(step)
        handle = None
        if kind == "grad_spike":
            def hook(grad: torch.Tensor) -> torch.Tensor:
                grad = grad.clone()
                grad.view(-1)[::GRAD_SPIKE_STRIDE] *= GRAD_SPIKE_FACTOR
                return grad
            handle = fc2.register_hook(hook)
        opt.zero_grad(set_to_none=True)
        with stepper.forward_context():
            loss = F.mse_loss(model(x).float(), y)
        if kind == "loss_spike":
            loss = loss * LOSS_SPIKE_FACTOR
        stepper.scale_loss(loss).backward()
        if handle is not None:
            handle.remove()
        stepper.clip_grad_norm_(opt, 1.0)
        loss_z, norm_z = float(guard.loss_zscore), float(guard.grad_norm_zscore)  # bench only: host reads
        mean = guard._stats()[0]  # the rolling means the step is judged against (bench only: private)
        ratios = (float(loss.detach() / mean[0]), float(guard._norm / mean[1]))
        if step >= guard.warmup:
            (spiked_ratios if kind else clean_ratios).append(ratios)
        stepper.step(opt)
        if stepper.last_step_skipped:
            skipped.append(step)
            why.append({"step": step, "injected": kind, "loss_z": round(loss_z, 2), "grad_norm_z": round(norm_z, 2),
                        "loss_ratio": round(ratios[0], 2), "grad_norm_ratio": round(ratios[1], 2)})
    return {"skipped": skipped, "why": why, "clean_ratios": clean_ratios, "spiked_ratios": spiked_ratios}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--df", type=float, nargs="+", default=[1.0, 2.0, 3.0])
    parser.add_argument("--spikes", type=int, default=10)
    parser.add_argument("--watch", nargs="+", default=["loss", "grad_norm"], help="SpikeGuard(watch=...)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    for df in args.df:
        clean = [run(df, seed, args.steps, {}, tuple(args.watch)) for seed in range(args.seeds)]
        false = sum(len(r["skipped"]) for r in clean)
        first = 100  # after the warmup and a filled window
        gap = (args.steps - first) // (2 * args.spikes)
        schedule = {first + i * gap: ("loss_spike" if i % 2 == 0 else "grad_spike") for i in range(2 * args.spikes)}
        spiked = run(df, 0, args.steps, schedule, tuple(args.watch))
        caught = {k: sum(1 for s, kk in schedule.items() if kk == k and s in spiked["skipped"])
                  for k in ("loss_spike", "grad_spike")}
        false_in_spiked = [s for s in spiked["skipped"] if s not in schedule]
        results[f"df={df:g}"] = {
            "false_skips": false, "clean_steps": args.steps * args.seeds,
            "false_skip_rate": false / (args.steps * args.seeds),
            "caught": caught, "injected_each": args.spikes, "false_skips_in_spiked_run": len(false_in_spiked),
            "clean_skips": [w for r in clean for w in r["why"]][:20],
            "clean_ratio_max": [max(max(x[i] for x in r["clean_ratios"]) for r in clean) for i in (0, 1)],
            "clean_ratio_p999": [sorted(x[i] for r in clean for x in r["clean_ratios"])[
                int(0.999 * sum(len(r["clean_ratios"]) for r in clean))] for i in (0, 1)],
            "injected_ratio_min": {k: min(x[i] for x, (s, kk) in zip(spiked["spiked_ratios"], sorted(schedule.items()))
                                          if kk == k) for k, i in (("loss_spike", 0), ("grad_spike", 1))},
        }
        total = args.steps * args.seeds
        print(f"df={df:g}: false skips {false}/{total} ({100 * false / total:.2f}%),"
              f" caught loss {caught['loss_spike']}/{args.spikes}, grad {caught['grad_spike']}/{args.spikes},"
              f" false in spiked run {len(false_in_spiked)}; clean ratio max (loss, norm)"
              f" {results[f'df={df:g}']['clean_ratio_max']}, p99.9 {results[f'df={df:g}']['clean_ratio_p999']},"
              f" injected min {results[f'df={df:g}']['injected_ratio_min']}", flush=True)
    suffix = "" if len(args.watch) == 2 else "_" + "_".join(args.watch)
    out = ROOT / "bench" / "results" / f"spike_heavy_tail{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

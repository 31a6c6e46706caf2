"""Preempted and resumed vs uninterrupted: 2-rank gloo DDP, StablePrecision('16-mixed') with every callback, 300 steps;
SIGTERM and SIGUSR1 at 5 random steps each, delivered to one rank; max |delta| of the per-step losses and the final
weights (target: 0).

The run is ``lit_mpstable.app.preemption_demo``'s (the one ``tests/adapter/test_preemption.py`` checks), with its
faults repeated every 30 steps so that every window of 30 steps holds overflow skips, a PrecisionFallback fallback and
restore, and a ScaleCheckpoint rollback. Writes ``bench/results/preemption_continuation.{json,md}``. About 2 min on
2 CPU cores:

    PYTHONPATH=. .venv/bin/python bench/preemption_continuation.py [--steps 300] [--points 5] [--seed 0] [--devices 2]

``--devices 1``: one process with a shuffling loader (a RandomSampler); writes ``..._1proc.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import tempfile
import time
import warnings
from pathlib import Path

import torch

from lit_mpstable.app import preemption_demo as scenario

ROOT = Path(__file__).resolve().parents[1]

CYCLE = 30


def faults(steps: int) -> dict[str, tuple[int, ...]]:
    """The test's faults every CYCLE steps: overflows at +3, +4 (a fallback, restored 4 steps later) and +13, a loss
    spike at +10 (a rollback to the snapshot of the restore)."""
    starts = range(0, steps - CYCLE + 1, CYCLE)
    return {"inf_grad_steps": tuple(s + d for s in starts for d in (3, 4, 13)),
            "spike_steps": tuple(s + 10 for s in starts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--points", type=int, default=5, help="random signal steps per signal")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--devices", type=int, default=2, choices=(1, 2),
                        help="2: gloo DDP (DistributedSampler); 1: one process (RandomSampler)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    plan = {**faults(args.steps), **({"fault_rank": 0} if args.devices == 1 else {})}
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="preemption_"))
    started = time.time()
    full = scenario.run(tmp / "full", args.steps, faults=plan, devices=args.devices)
    f0 = full[0]
    summary = {
        "skipped_steps": f0["plugin"]["skipped_steps"], "overflows": f0["plugin"]["overflow_count"],
        "fallback_decisions": len(f0["callbacks"]["PrecisionFallback{'mode': 'global', 'patience': 2}"]["decisions"]),
        "rollbacks": f0["callbacks"]["ScaleCheckpoint"]["rollbacks"],
    }
    print(f"uninterrupted: {summary} ({time.time() - started:.0f} s)", flush=True)
    rows = []
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        for step in sorted(rng.sample(range(1, args.steps - 2), args.points)):
            rank = rng.randrange(args.devices)
            t0 = time.time()
            first, resumed, path = scenario.preempted_and_resumed(tmp / f"{signum.name}-{step}", args.steps, step,
                                                                  signum, rank, faults=plan, devices=args.devices)
            saved = torch.load(path, weights_only=True)["global_step"]
            delta = scenario.max_delta(full, first, resumed)
            rows.append({"signal": signum.name, "signal_step": step, "rank": rank, "saved_at_step": saved, **delta})
            print(f"{signum.name} at step {step} on rank {rank}: saved at {saved}, {delta} ({time.time() - t0:.0f} s)",
                  flush=True)
    exact = all(r["loss"] == 0 and r["weights"] == 0 and r["state_equal"] for r in rows)
    result = {"steps": args.steps, "world_size": args.devices, "precision": "16-mixed", "faults": plan,
              "uninterrupted": summary, "runs": rows, "all_exact": exact,
              "torch": torch.__version__, "seconds": round(time.time() - started)}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "preemption_continuation" + ("" if args.devices == 2 else "_1proc")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    lines = ["# Preemption: resumed vs uninterrupted", "",
             (f"{'2-rank gloo DDP' if args.devices == 2 else 'one process, shuffle=True (RandomSampler)'},"
             f" StablePrecision('16-mixed') + every callback, {args.steps} steps; the uninterrupted run"
             f" skipped {summary['skipped_steps']} steps ({summary['overflows']} overflows), made"
             f" {summary['fallback_decisions']} fallback/restore decisions and {summary['rollbacks']} rollbacks."), "",
             "| signal | signal step | rank | saved at | max abs d loss | max abs d weight | states equal |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['signal']} | {r['signal_step']} | {r['rank']} | {r['saved_at_step']} | {r['loss']:g} |"
              f" {r['weights']:g} | {r['state_equal']} |" for r in rows]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"all exact: {exact}; {result['seconds']} s", flush=True)


if __name__ == "__main__":
    main()

"""SpikeGuard's targets on the CPU GPT (lit_mpstable.app.zoo.GPT, d_model 128, 2 layers, seq 64, batch 16, on the
standard-library character corpus), through a plain PrecisionStepper loop in 'bf16-mixed' with AdamW and clipping 1.0:

- caught: per seed, 20 injected spikes (10 "loss_spike": loss x 1e4; 10 "grad_spike": every 100th coordinate of one
  layer's weight gradient x 1e3, as FaultInjector does), spread over the run after the guard's warmup -> how many
  were skipped;
- false skips: skipped steps over ``--seeds`` clean runs of ``--steps`` steps each (with the guard);
- final val loss, per seed and its mean over seeds, of the spiked run with the guard vs the spike-free run without it,
  vs the spike-free run with it, vs the spike-free run that skips the same steps (what skipping those batches costs
  by itself), and of the spiked run without it vs the spike-free one;
- step-time overhead: CPU time per step (one thread), guard on vs off, the median of the per-round paired ratios over
  alternating rounds; and, since the whole step's noise on a shared machine is of the order of the target (1%), the
  guard's own CPU time per step (inside the stepper's observe_loss and the guard's decide, clip_threshold, commit_;
  the norm it judges is the one clipping computes anyway) as a fraction of the unguarded step.

Each skip is listed with its loss and gradient-norm z-scores (which statistic flagged it). ``--norm-floor 0.01``
reruns the rule before the gradient norm's 50% skip floor (see ``lit_mpstable/core/guards/spike.py``), for comparison.

Writes ``bench/results/spike_guard.json``. A few minutes on 2 CPU cores with the defaults:

    PYTHONPATH=. .venv/bin/python bench/spike_guard.py [--steps 1000 --seeds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from lit_mpstable import SpikeGuard
from lit_mpstable.app.zoo import GPT, CharLMData
from lit_mpstable.core.guards import spike
from lit_mpstable.core.step import stepper as stepper_module
from lit_mpstable.core.step.stepper import PrecisionStepper

ROOT = Path(__file__).resolve().parents[1]


class Run:
    def __init__(self, data: CharLMData, seed: int, guard: bool, lr: float = 3e-3) -> None:
        torch.manual_seed(seed)
        self.model = GPT(data.vocab_size)
        self.stepper = PrecisionStepper("bf16-mixed", device="cpu", spike_guard=SpikeGuard() if guard else None)
        self.stepper.setup_module(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.stepper.setup_optimizers(self.model, [self.opt])
        self.data = data
        self.gen = torch.Generator().manual_seed(seed)
        self.skipped: list[int] = []
        self.why: list[dict] = []  # per skipped step: its loss and gradient-norm z-scores (read here, bench only)

    def batch(self):
        idx = torch.randint(len(self.data.train_set), (self.data.batch_size,), generator=self.gen)
        return self.data.train_set[idx]

    def step(self, i: int, kind: str | None = None) -> None:
        x, y = self.batch()
        with self.stepper.forward_context():
            logits = self.model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        if kind == "loss_spike":
            loss = loss * 1e4
        if kind == "skip":  # a clean batch whose step is skipped: what skipping alone costs
            self.stepper.skip_step()
        self.stepper.scale_loss(loss).backward()
        if kind == "grad_spike":
            grad = self.model.blocks[0].fc.weight.grad
            grad.view(-1)[::100] *= 1e3
        self.stepper.clip_grad_norm_(self.opt, 1.0)
        self.stepper.step(self.opt)
        self.opt.zero_grad(set_to_none=True)
        if self.stepper.last_step_skipped:
            self.skipped.append(i)
            guard = self.stepper.spike_guard
            if guard is not None:
                self.why.append({"step": i, "loss_z": round(float(guard.loss_zscore), 2),
                                 "grad_norm_z": round(float(guard.grad_norm_zscore), 2)})

    @torch.no_grad()
    def val_loss(self) -> float:
        total, n = 0.0, 0
        for j in range(0, min(len(self.data.val_set), 512), 64):
            x, y = self.data.val_set[j:j + 64]
            with self.stepper.forward_context():
                logits = self.model(x)
            total += float(F.cross_entropy(logits.float().flatten(0, 1), y.flatten())) * len(x)
            n += len(x)
        return total / n


def spike_schedule(steps: int, seed: int) -> dict[int, str]:
    """20 spike steps after the warmup, at least 10 apart: 10 of each kind, in a shuffled order."""
    import random

    rng = random.Random(seed)
    slots = rng.sample(range(60, steps - 10, 10), 20)
    kinds = ["loss_spike"] * 10 + ["grad_spike"] * 10
    rng.shuffle(kinds)
    return {s + rng.randrange(10): k for s, k in zip(sorted(slots), kinds)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--round-steps", type=int, default=10)
    parser.add_argument("--only-overhead", action="store_true", help="measure the step-time overhead alone")
    parser.add_argument("--norm-floor", type=float, default=None,
                        help="ablation: the gradient norm's skip floor on std/mean (default: SpikeGuard's own, 0.5;"
                             " 0.01 is the rule before it); writes spike_guard_floor<value>.json")
    args = parser.parse_args()
    if args.norm_floor is not None:
        if not args.norm_floor >= 0:
            raise ValueError(f"--norm-floor={args.norm_floor!r}: must be a number >= 0 (a fraction of the mean).")
        spike._SKIP_REL_STD["grad_norm"] = args.norm_floor
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    data = CharLMData(seq_len=64, batch_size=16)
    data.setup()
    out: dict = {"steps": args.steps, "seeds": args.seeds}

    if not args.only_overhead:
        accuracy(args, data, out)
    overhead(args, data, out)
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    name = "spike_guard_overhead.json" if args.only_overhead else "spike_guard.json"
    if args.norm_floor is not None:
        out["norm_floor"] = args.norm_floor
        name = name.replace(".json", f"_floor{args.norm_floor:g}.json")
    (ROOT / "bench" / "results" / name).write_text(json.dumps(out, indent=2))


def accuracy(args: argparse.Namespace, data: CharLMData, out: dict) -> None:
    """Per seed, four runs from the same weights on the same batches: spiked with the guard, spiked without, clean
    without, clean with (the last one counts false skips). 20 spikes per seed."""
    caught_total = {"loss_spike": 0, "grad_spike": 0}
    seeds, false, why = {}, {}, {}
    for seed in range(args.seeds):
        faults = spike_schedule(args.steps, seed)
        runs = {name: Run(data, seed, guard=name.endswith("guarded") and not name.endswith("unguarded"))
                for name in ("spiked_guarded", "spiked_unguarded", "spike_free", "spike_free_guarded")}
        for name, run in runs.items():
            for i in range(args.steps):
                run.step(i, faults.get(i) if name.startswith("spiked") else None)
        spiked = runs["spiked_guarded"]
        # The spike-free run that skips the very steps the guarded run skipped: the cost of skipping those batches,
        # apart from any harm the spikes did.
        runs["spike_free_skipping_same"] = skipping = Run(data, seed, guard=False)
        for i in range(args.steps):
            skipping.step(i, "skip" if i in spiked.skipped else None)
        caught = {k: sum(1 for s, kind in faults.items() if kind == k and s in spiked.skipped)
                  for k in ("loss_spike", "grad_spike")}
        for k, v in caught.items():
            caught_total[k] += v
        val = {name: run.val_loss() for name, run in runs.items()}
        seeds[seed] = {
            "caught": caught, "missed": [{"step": s, "kind": k} for s, k in sorted(faults.items())
                                         if s not in spiked.skipped],
            "false_skips_in_spiked_run": [s for s in spiked.skipped if s not in faults], "z_scores": spiked.why,
            "val_loss": val,
            "guarded_vs_spike_free": val["spiked_guarded"] / val["spike_free"] - 1,
            "guarded_vs_spike_free_guarded": val["spiked_guarded"] / val["spike_free_guarded"] - 1,
            "guarded_vs_spike_free_skipping_same": val["spiked_guarded"] / val["spike_free_skipping_same"] - 1,
            "skipping_same_vs_spike_free": val["spike_free_skipping_same"] / val["spike_free"] - 1,
            "unguarded_vs_spike_free": val["spiked_unguarded"] / val["spike_free"] - 1,
        }
        false[seed], why[seed] = list(runs["spike_free_guarded"].skipped), runs["spike_free_guarded"].why
        print("seed", seed, {k: v for k, v in seeds[seed].items() if k != "z_scores"}, flush=True)
    out["caught"] = {**caught_total, "total": sum(caught_total.values()), "of": 20 * args.seeds}
    out["per_seed"] = seeds
    out["val_loss"] = {
        key: statistics.mean(s[key] for s in seeds.values())
        for key in ("guarded_vs_spike_free", "guarded_vs_spike_free_guarded", "unguarded_vs_spike_free",
                    "guarded_vs_spike_free_skipping_same", "skipping_same_vs_spike_free")
    }
    total = sum(len(v) for v in false.values())
    out["false_skips"] = {"per_seed": false, "total": total, "steps": args.seeds * args.steps,
                          "rate": total / (args.seeds * args.steps), "z_scores": why}
    print("caught", out["caught"], "\nval (mean over seeds)", out["val_loss"], "\nfalse", out["false_skips"]["total"],
          flush=True)


def overhead(args: argparse.Namespace, data: CharLMData, out: dict) -> None:

    # 3. overhead: alternating rounds, CPU time per step (one thread), after a warmup past the guard's own
    runs = {on: Run(data, 0, guard=on) for on in (False, True)}
    for run in runs.values():
        for i in range(40):
            run.step(i)
    inside: list[float] = []  # CPU time spent in the guard's methods, per call
    # The stepper's observe_loss (the detach, the rank average, the guard's observe_loss_) and the guard's methods.
    wrapped = {(SpikeGuard, name): getattr(SpikeGuard, name) for name in ("decide", "clip_threshold", "commit_")}
    wrapped[(stepper_module, "observe_loss")] = stepper_module.observe_loss

    def timed(method):
        def call(*a, **k):
            start = time.process_time()
            try:
                return method(*a, **k)
            finally:
                inside.append(time.process_time() - start)
        return call

    per_step: dict[bool, list[float]] = {False: [], True: []}
    guard_ms: list[float] = []
    for (owner, name), method in wrapped.items():
        setattr(owner, name, timed(method))
    try:
        for r in range(args.rounds):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                inside.clear()
                start = time.process_time()
                for i in range(args.round_steps):
                    runs[on].step(i)
                per_step[on].append((time.process_time() - start) / args.round_steps)
                if on:
                    guard_ms.append(sum(inside) / args.round_steps * 1e3)
    finally:
        for (owner, name), method in wrapped.items():
            setattr(owner, name, method)
    off, on = statistics.median(per_step[False]), statistics.median(per_step[True])
    paired = [b / a for a, b in zip(per_step[False], per_step[True])]
    out["overhead"] = {"off_ms": off * 1e3, "on_ms": on * 1e3, "ratio": on / off - 1,
                       "paired_median": statistics.median(paired) - 1,
                       "paired_quartiles": [q - 1 for q in statistics.quantiles(paired, n=4)],
                       "guard_ms_per_step": statistics.median(guard_ms),
                       "guard_fraction_of_off_step": statistics.median(guard_ms) / (off * 1e3),
                       "load_average": os.getloadavg()[0], "rounds": args.rounds, "round_steps": args.round_steps}
    try:
        flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        out["cpu"] = [line for line in flags.splitlines() if line.startswith(("Model name", "Flags"))]
    except OSError:
        out["cpu"] = []
    print("overhead", out["overhead"], "\n" + "\n".join(out["cpu"]), flush=True)


if __name__ == "__main__":
    main()

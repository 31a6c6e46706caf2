"""The step's reads of the gradients, two trees paired: ``unscale_`` + ``clip_grad_norm_`` + ``step`` of a
PrecisionStepper with SpikeGuard on GPT-sized gradients (bench_precision's GPTSize parameter shapes, ~2.9M
parameters, SGD so the optimizer costs little), per precision, CPU time per step.

    .venv/bin/python bench/bench_grad_pass.py --trees /tmp/before . --rounds 8

Each round runs every tree once per config in a fresh process (``PYTHONPATH=<tree>``), alternating the order; the
table shows the median over rounds of each run's median step and the paired ratio after/before. ``--worker`` is the
per-process measurement (prints one JSON line).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

CONFIGS = {"bf16-mixed": {}, "bf16-mixed+clip-only": {"guard": False}, "16-mixed": {},
           "bf16-true": {}, "bf16-true-kahan": {"master_weights": "kahan"}}


def worker(config: str, steps: int) -> None:
    import torch
    from torch import nn

    from lit_mpstable import SpikeGuard
    from lit_mpstable.core.step.stepper import PrecisionStepper

    torch.set_num_threads(1)
    torch.manual_seed(0)
    options = dict(CONFIGS[config])
    guard = options.pop("guard", True)
    precision = config.split("+")[0].removesuffix("-kahan")
    shapes = [(2000, 256), (256, 256)] * 2 + [(256, 1024), (1024, 256)] * 8 + [(256,)] * 40 + [(256, 256)] * 24
    model = nn.ParameterList([nn.Parameter(torch.randn(s) * 0.02) for s in shapes])
    stepper = PrecisionStepper(precision, spike_guard=SpikeGuard(warmup=2) if guard else None,
                               telemetry_every_n_steps=None, device="cpu", **options)
    stepper.setup_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    stepper.setup_optimizers(model, [optimizer])
    times = []
    for step in range(steps):
        loss = sum((p.float() * 1e-3).square().sum() for p in model) * (1 + 0.01 * step)
        stepper.scale_loss(loss).backward()
        start = time.process_time()
        stepper.unscale_(optimizer)
        stepper.clip_grad_norm_(optimizer, 1.0)
        stepper.step(optimizer)
        times.append(time.process_time() - start)
        optimizer.zero_grad(set_to_none=True)
    assert stepper.skipped_steps == 0
    print(json.dumps({"config": config, "us": statistics.median(times[3:]) * 1e6}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs=2, metavar=("BEFORE", "AFTER"), default=None)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps)
        return
    trees = args.trees or [".", "."]
    configs = args.configs.split(",")
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    print(f"{platform.processor() or platform.machine()}, avx512f={'avx512f' in flags}, avx2={'avx2' in flags},"
          f" {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; trees: {trees}")
    runs: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.rounds):
        for config in configs:
            order = [0, 1] if round_ % 2 == 0 else [1, 0]
            for index in order:
                env = dict(os.environ, PYTHONPATH=os.path.abspath(trees[index]))
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", config,
                                      "--steps", str(args.steps)], env=env, capture_output=True, text=True,
                                     check=True, cwd=os.path.abspath(trees[index]))
                runs.setdefault((config, index), []).append(json.loads(out.stdout.strip().splitlines()[-1])["us"])
    print("| config | before us/step | after us/step | after/before (paired median) |\n|---|---|---|---|")
    for config in configs:
        before, after = runs[(config, 0)], runs[(config, 1)]
        ratio = statistics.median(a / b for a, b in zip(after, before))
        print(f"| {config} | {statistics.median(before):.0f} | {statistics.median(after):.0f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()

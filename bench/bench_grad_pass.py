"""The step's reads of the gradients, two trees paired: ``unscale_`` + ``clip_grad_norm_`` + ``step`` of a
PrecisionStepper with SpikeGuard on GPT-sized gradients (bench_precision's GPTSize parameter shapes, ~2.9M
parameters, SGD so the optimizer costs little), per precision, CPU time per step.

    .venv/bin/python bench/bench_grad_pass.py --trees /tmp/before . --rounds 8

Each round runs every tree once per config in a fresh process (``PYTHONPATH=<tree>``), alternating the order; the
table shows the median over rounds of each run's median step and the paired ratio after/before. ``--worker`` is the
per-process measurement (prints one JSON line).

``--fit`` measures the same part inside a Lightning fit of ``bench_precision.py`` configs instead (the tiny MLP, where
an op costs 10-23 us with the step's caches cold): the scaler's gradient check (``check_grads_``: the check and, with
a SpikeGuard or a clip, the norm's pass) and the fold of SpikeGuard's / the step-input check's flag
(``fold_found_inf_``), CPU time per call (median over the fit's calls after the first 20; the timing wrapper's own
~1 us included alike in both trees), torch ops and Python calls per call (exact):

    .venv/bin/python bench/bench_grad_pass.py --trees /tmp/before . --fit mlp/SP-bf16-mixed+cb,mlp/SP-bf16-mixed
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


_FIT_PARTS = ("check_grads_", "fold_found_inf_")


def fit_worker(config: str, steps: int) -> None:
    """One fit of ``config``: per call of each of :data:`_FIT_PARTS`, median CPU us, ops and Python calls."""
    import cProfile
    import pstats

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import step_profile

    from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.count += 1
            return func(*args, **(kwargs or {}))

    found: dict[str, dict[str, list[float]]] = {part: {"us": [], "ops": [], "calls": []} for part in _FIT_PARTS}

    def wrap(name: str) -> None:
        original = getattr(DynamicLossScaler, name)

        def measured(*args, **kwargs):  # type: ignore[no-untyped-def]
            record = found[name]
            if len(record["us"]) % 10 == 4:  # calls counted on one call in ten, ops on another, neither timed
                profiler = cProfile.Profile()
                profiler.enable()
                out = original(*args, **kwargs)
                profiler.disable()
                stats = pstats.Stats(profiler)
                record["calls"].append(sum(entry[1] for entry in stats.stats.values()) - 1)  # type: ignore[attr-defined]
                record["us"].append(float("nan"))
                return out
            if len(record["us"]) % 10 == 9:
                with Ops() as ops:
                    out = original(*args, **kwargs)
                record["ops"].append(ops.count)
                record["us"].append(float("nan"))
                return out
            start = time.process_time()
            out = original(*args, **kwargs)
            record["us"].append((time.process_time() - start) * 1e6)
            return out

        setattr(DynamicLossScaler, name, measured)

    for part in _FIT_PARTS:
        wrap(part)
    torch.set_num_threads(1)
    step_profile._quiet()
    step_profile._fit(config, step_profile.Window(10**9, 1, lambda: None, lambda: None), steps)
    result = {}
    for part, record in found.items():
        us = [t for t in record["us"][20:] if t == t]
        result[part] = {"us": statistics.median(us) if us else None,
                        "ops": statistics.median(record["ops"][2:]) if record["ops"][2:] else None,
                        "calls": statistics.median(record["calls"][2:]) if record["calls"][2:] else None,
                        "per_step": len(record["us"]) / steps}
    print(json.dumps({"config": config, "parts": result}))


def fit_main(trees: list[str], configs: list[str], rounds: int, steps: int) -> None:
    runs: dict[tuple[str, int], list[dict]] = {}
    for round_ in range(rounds):
        for config in configs:
            for index in ([0, 1] if round_ % 2 == 0 else [1, 0]):
                env = dict(os.environ, PYTHONPATH=os.path.abspath(trees[index]))
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--fit-worker", config,
                                      "--steps", str(steps)], env=env, capture_output=True, text=True, check=True,
                                     cwd=os.path.abspath(trees[index]))
                runs.setdefault((config, index), []).append(json.loads(out.stdout.strip().splitlines()[-1])["parts"])
    print("| config | part | calls/step | before us | after us | before ops | after ops | before Python calls |"
          " after Python calls |\n|---|---|---|---|---|---|---|---|---|")
    for config in configs:
        for part in _FIT_PARTS:
            cells = []
            for key in ("us", "ops", "calls"):
                for index in (0, 1):
                    values = [run[part][key] for run in runs[(config, index)] if run[part][key] is not None]
                    cells.append(f"{statistics.median(values):.1f}" if values else "-")
            per_step = statistics.median(run[part]["per_step"] for run in runs[(config, 1)])
            print(f"| {config} | {part} | {per_step:.2f} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs=2, metavar=("BEFORE", "AFTER"), default=None)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--fit", help="bench_precision configs: the in-fit part instead (see the docstring)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--fit-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps)
        return
    if args.fit_worker:
        fit_worker(args.fit_worker, args.steps)
        return
    trees = args.trees or [".", "."]
    configs = args.configs.split(",")
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    print(f"{platform.processor() or platform.machine()}, avx512f={'avx512f' in flags}, avx2={'avx2' in flags},"
          f" {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; trees: {trees}")
    if args.fit:
        fit_main(trees, args.fit.split(","), args.rounds, max(args.steps, 200))
        return
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

"""What OverflowMonitor(indicators=True) costs per step through the Trainer with StablePrecision (issue #46: <= 1% of
a GPT step), where the SpikeScore's gradient norm comes from the step's own gradient check.

    .venv/bin/python experiments/indicators/overhead_trainer.py [--reps 6] [--steps 60] [--log-every 10]

``make run``'s GPT (``GPTLM``: d 128, 2 blocks, batch 16 x 64 characters) with ``StablePrecision("bf16-mixed")``.
Each repetition fits twice, ``OverflowMonitor(indicators=False)`` then ``OverflowMonitor(indicators=True)`` (the order
alternates between repetitions), logging every ``--log-every`` steps; a step's time is the thread CPU time from its
batch start to its batch end (the monitor's own work included), the first 5 steps dropped; a fit's time is its mean
step. The overhead is the median over repetitions of (with / without - 1); it spreads by several % on a shared
machine, so the thread CPU time inside the monitor's per-batch hooks is also summed in both fits, and the difference
(the indicators' own time there) given as a fraction of the step without them. Prints the CPU flags; writes JSON and
Markdown to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import lightning.pytorch as pl  # noqa: E402
from common import cpu_flags, environment  # noqa: E402

from lit_mpstable import StablePrecision  # noqa: E402
from lit_mpstable.app.zoo import GPTLM, CharLMData  # noqa: E402
from lit_mpstable.callbacks import OverflowMonitor  # noqa: E402


class StepClock(pl.Callback):
    """Thread CPU time per training step, batch start to batch end (listed first and last: see ``fit``)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.thread_time()


class TimedMonitor(OverflowMonitor):
    """OverflowMonitor with the thread CPU time inside its two per-batch hooks summed (the indicators' work there:
    their per-step queueing, the logging step's snapshot, measure, read, judging and metrics; not the step's own
    gradient check, which measures the norm they take)."""

    spent = 0.0

    def on_train_batch_start(self, *args) -> None:
        start = time.thread_time()
        super().on_train_batch_start(*args)
        self.spent += time.thread_time() - start

    def on_train_batch_end(self, *args) -> None:
        start = time.thread_time()
        super().on_train_batch_end(*args)
        self.spent += time.thread_time() - start


class StepEnd(pl.Callback):
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.clock.times.append(time.thread_time() - self.clock._start)


def fit(indicators: bool, args: argparse.Namespace, data: CharLMData) -> tuple[float, float]:
    """The mean step and the monitor's hook time per step (seconds)."""
    torch.manual_seed(0)
    clock = StepClock()
    monitor = TimedMonitor(log_every_n_steps=args.log_every, indicators=indicators)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=args.log_every, limit_val_batches=0,
                         plugins=[StablePrecision("bf16-mixed")],
                         callbacks=[clock, monitor, StepEnd(clock)])
    trainer.fit(GPTLM(data.vocab_size, total_steps=args.steps), datamodule=data)
    # the mean: logging steps (1 in --log-every) count at their share
    return statistics.fmean(clock.times[5:]), monitor.spent / args.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "indicators" / "trainer")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("CPU flags:", cpu_flags(), flush=True)
    data = CharLMData()
    data.setup()
    rows = []
    for rep in range(args.reps):
        order = (False, True) if rep % 2 == 0 else (True, False)
        fits = {on: fit(on, args, data) for on in order}
        times = {on: step for on, (step, _) in fits.items()}
        hooks = {on: spent for on, (_, spent) in fits.items()}
        rows.append({"without_ms": times[False] * 1e3, "with_ms": times[True] * 1e3,
                     "overhead": times[True] / times[False] - 1,
                     "hooks_without_ms": hooks[False] * 1e3, "hooks_with_ms": hooks[True] * 1e3,
                     "own": (hooks[True] - hooks[False]) / times[False]})
        print(f"rep {rep}: without {times[False] * 1e3:.2f} ms, with {times[True] * 1e3:.2f} ms,"
              f" {100 * rows[-1]['overhead']:+.2f}%; the monitor's hooks {hooks[False] * 1e3:.3f} ->"
              f" {hooks[True] * 1e3:.3f} ms a step, {100 * rows[-1]['own']:+.2f}%", flush=True)
    median = statistics.median(r["overhead"] for r in rows)
    own = sorted(r["own"] for r in rows)
    quartiles = statistics.quantiles(own, n=4) if len(own) > 1 else own * 3
    summary = {"environment": environment(), "cpu_flags": cpu_flags(),
               "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "median_overhead": median,
               "median_own": statistics.median(own), "own_quartiles": quartiles}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_text(json.dumps(summary, indent=1))
    lines = [f"OverflowMonitor(indicators=True) through the Trainer with StablePrecision('bf16-mixed') on make run's"
             f" GPT, logging every {args.log_every} steps: median overhead {100 * median:+.2f}% of a step over"
             f" {args.reps} paired repetitions of {args.steps}-step fits (thread CPU time, mean step each,"
             f" the first 5 dropped). The indicators' own time (the monitor's hook time with them minus without,"
             f" over the step without): median {100 * summary['median_own']:+.2f}% (quartiles"
             f" {100 * quartiles[0]:+.2f}% .. {100 * quartiles[2]:+.2f}%).", "",
             "| rep | without (ms) | with (ms) | overhead | hooks without (ms) | hooks with (ms) | own |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {i} | {r['without_ms']:.2f} | {r['with_ms']:.2f} | {100 * r['overhead']:+.2f}% |"
              f" {r['hooks_without_ms']:.3f} | {r['hooks_with_ms']:.3f} | {100 * r['own']:+.2f}% |"
              for i, r in enumerate(rows)]
    lines += ["", f"CPU flags: {cpu_flags()}; torch {torch.__version__}; 1 thread.", "",
              "Command: `python experiments/indicators/overhead_trainer.py " + " ".join(sys.argv[1:]) + "`"]
    (args.out / "overhead.md").write_text("\n".join(lines) + "\n")
    print(lines[0])


if __name__ == "__main__":
    main()

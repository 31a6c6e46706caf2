"""Per-step cost of each lit_mpstable callback, and of all four, on a small GPT (bf16-mixed, CPU).

    .venv/bin/python bench/bench_callbacks.py                                  # ~3-4 min on 2 shared cores
    .venv/bin/python bench/bench_callbacks.py --quick                          # smoke run, < 30 s
    .venv/bin/python bench/bench_callbacks.py --configs "all four" --repeats 20 # one A/B pair, more rounds

Workload: ``lit_mpstable.app.zoo.GPTLM`` (d_model 128, 2 layers, seq 64, batch 16) on ``CharLMData``, AdamW, under
``StablePrecision("bf16-mixed")``, 1 thread. Configs run round-robin (each round starts one config later), each
run a freshly seeded fit of ``steps`` steps; the first ``warmup`` steps are dropped. Two measures:

- **Hook time** (precise): every hook of the callbacks under test is wrapped in a timer; their total time over
  the kept steps (snapshots and logging steps included) over the rest of the step time. On the CPU there is no
  asynchronous device, so this is the whole cost a callback adds (the timer's wrapper included).
- **End to end** (noisy on a shared machine): process CPU time per step, from one ``on_train_batch_end`` to the
  next (the timer is the last callback, so the others' hooks fall inside the step); per run the median and the
  mean (the mean also carries ScaleCheckpoint's snapshot every 50 steps); ratios to the no-callback config are
  paired per round, and the table shows their median over rounds.

AMPPreflight's one-off check at the first batch (two forwards) is reported on its own, outside the per-step
numbers. Callbacks are default-constructed; the trainer's ``log_every_n_steps`` (50) sets the logging steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lit_mpstable import StablePrecision
from lit_mpstable.app.zoo import GPTLM, CharLMData
from lit_mpstable.callbacks import AMPPreflight, OverflowMonitor, PrecisionFallback, ScaleCheckpoint

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TRAINER = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               num_sanity_val_steps=0, accelerator="cpu", devices=1, limit_val_batches=0)


CONFIGS = {
    "none": lambda: [],
    "OverflowMonitor": lambda: [OverflowMonitor()],
    "PrecisionFallback": lambda: [PrecisionFallback()],
    "ScaleCheckpoint": lambda: [ScaleCheckpoint()],
    "AMPPreflight": lambda: [AMPPreflight()],
    "all four": lambda: [OverflowMonitor(), PrecisionFallback(), ScaleCheckpoint(), AMPPreflight()],
}
_HOOKS = ("on_train_batch_start", "on_before_backward", "on_train_batch_end")


class _Timer(pl.Callback):
    """Per-step CPU time, and the time spent in the wrapped hooks of the callbacks under test, per step."""

    def __init__(self, callbacks: list[pl.Callback]) -> None:
        self.cpu: list[float] = []
        self.hooks: list[float] = []  # hook time inside each step
        self.preflight_s = 0.0  # the first batch's AMPPreflight check
        self._in_step, self._last = 0.0, None
        for callback in callbacks:
            for hook in _HOOKS:
                if callable(fn := getattr(callback, hook)):  # a per-step hook a callback leaves to pl.Callback is None
                    setattr(callback, hook, self._timed(fn, callback, hook))

    def _timed(self, fn, callback, hook):
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.process_time() - start
                if isinstance(callback, AMPPreflight) and hook == "on_train_batch_start" and not self.cpu:
                    self.preflight_s += spent  # one-off, reported on its own
                else:
                    self._in_step += spent

        return timed

    def on_train_batch_start(self, *args: Any) -> None:
        if self._last is None:
            self._last = time.process_time()

    def on_train_batch_end(self, *args: Any) -> None:
        now = time.process_time()
        self.cpu.append(now - self._last)
        self.hooks.append(self._in_step)
        self._last, self._in_step = now, 0.0


def run_once(name: str, data: CharLMData, steps: int) -> _Timer:
    torch.manual_seed(0)
    module = GPTLM(data.vocab_size)
    callbacks = CONFIGS[name]()
    timer = _Timer(callbacks)
    trainer = pl.Trainer(plugins=[StablePrecision("bf16-mixed")], max_steps=steps, callbacks=[*callbacks, timer],
                         **TRAINER)
    trainer.fit(module, datamodule=data)
    return timer


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 12 steps")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset; 'none' is always run")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    unknown = [name for name in args.configs.split(",") if name not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; registered: {list(CONFIGS)}")
    if args.quick:
        args.repeats, args.steps, args.warmup = 2, 12, 2
    torch.set_num_threads(1)
    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    lightning_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _measure(args)
    finally:
        lightning_log.setLevel(level)


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    data = CharLMData()
    names = ["none"] + [name for name in args.configs.split(",") if name != "none"]
    medians: dict[str, list[float]] = {n: [] for n in names}
    means: dict[str, list[float]] = {n: [] for n in names}
    hook_share: dict[str, list[float]] = {n: [] for n in names}
    hook_ms: dict[str, list[float]] = {n: [] for n in names}
    preflight: list[float] = []
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            timer = run_once(name, data, args.steps)
            kept, hooks = timer.cpu[args.warmup:], timer.hooks[args.warmup:]
            medians[name].append(statistics.median(kept))
            means[name].append(statistics.fmean(kept))
            hook_share[name].append(sum(hooks) / (sum(kept) - sum(hooks)))  # relative to the step without them
            hook_ms[name].append(statistics.fmean(hooks) * 1e3)
            if timer.preflight_s:
                preflight.append(timer.preflight_s)
        print(f"round {r + 1}/{args.repeats}: " + ", ".join(f"{n} {medians[n][-1] * 1e3:.2f} ms" for n in names))

    def ratio(values: dict[str, list[float]], name: str) -> float:
        return statistics.median(a / b for a, b in zip(values[name], values["none"]))

    rows = [{
        "config": name, "median_step_ms": statistics.median(medians[name]) * 1e3,
        "hook_ms_per_step": statistics.median(hook_ms[name]), "hook_overhead": statistics.median(hook_share[name]),
        "ratio_median": ratio(medians, name), "ratio_mean": ratio(means, name),
    } for name in names]
    lines = [
        "# bench_callbacks results", "",
        f"GPTLM bf16-mixed, 1 thread, {args.repeats} rounds x {args.steps} steps ({args.warmup} warm-up dropped);"
        " CPU time per step.", "",
        "| config | median step (ms) | hook time per step (ms) | hook overhead | end-to-end ratio (median steps) |"
        " end-to-end ratio (mean steps) |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['config']} | {r['median_step_ms']:.2f} | {r['hook_ms_per_step']:.3f} | {r['hook_overhead']:.2%} |"
        f" {r['ratio_median']:.4f} | {r['ratio_mean']:.4f} |" for r in rows
    ]
    once = statistics.median(preflight) * 1e3 if preflight else float("nan")
    lines += ["", f"AMPPreflight's one-off check at the first batch: {once:.1f} ms CPU (median over runs)."]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "callbacks_quick" if args.quick else "callbacks" if len(names) == len(CONFIGS) else "callbacks_subset"
    result = {"rows": rows, "preflight_s": preflight, "medians_s": medians, "means_s": means, "hook_share": hook_share,
              "args": {
        k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__}
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()

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

``--workload mlp``: the whole stack on ``bench_precision.py``'s tiny MLP, where the callbacks' fixed cost shows
(``mlp/SP-bf16-mixed+cb``: StablePrecision("bf16-mixed", spike_guard=SpikeGuard()) and the four callbacks). Three
configs alternate in each round: Lightning's ``bf16-mixed``, the plugin with SpikeGuard and no callback, and the
whole stack; per run (``--steps``, first ``--warmup`` dropped) the thread CPU time of each step, from one batch end
to the next (no hook is wrapped), its 10th percentile (a fast step: the least disturbed by other processes on a
shared machine), its median (a clean step) and its mean (logging steps and snapshots included).
Per round: the callbacks' cost (stack minus no-callback, us a step) and the stack's throughput ratio to Lightning.
``--trees before=/path,after=.`` runs each round once per tree, each in a process of its own with that tree's package
on ``PYTHONPATH`` (the order alternating), so two versions are paired round by round:

    .venv/bin/python bench/bench_callbacks.py --workload mlp --trees before=/tmp/cb_before,after=. --rounds 8
"""

from __future__ import annotations

import argparse
import json
import logging
import os
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


# ------------------------------------------------------------------------------------------------ the MLP stack
MLP_CONFIGS = ("mlp/L-bf16-mixed", "stack without callbacks", "mlp/SP-bf16-mixed+cb")


class _StepClock(pl.Callback):
    """Thread CPU time per step, from one batch end to the next (listed last: every other hook falls inside)."""

    def __init__(self) -> None:
        self.us: list[float] = []
        self._last: int | None = None

    def on_train_batch_end(self, *args: Any) -> None:
        now = time.thread_time_ns()
        if self._last is not None:
            self.us.append((now - self._last) / 1e3)
        self._last = now


def _mlp_run(name: str, steps: int) -> list[float]:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_precision import CONFIGS, SUITES
    from common import TRAINER_DEFAULTS

    from lit_mpstable import SpikeGuard

    work = SUITES["policy-mlp"].workload(steps)
    if name == "stack without callbacks":
        kwargs: dict[str, Any] = {"plugins": [StablePrecision("bf16-mixed", spike_guard=SpikeGuard())]}
    else:
        kwargs = CONFIGS[name].trainer()  # type: ignore[misc]
    clock = _StepClock()
    trainer = pl.Trainer(**TRAINER_DEFAULTS, max_steps=steps, **{**kwargs, "callbacks": [
        *kwargs.get("callbacks", []), clock]})
    trainer.fit(work.module, train_dataloaders=work.loader)
    return clock.us


def _mlp_round(steps: int, warmup: int, repeats: int) -> dict[str, Any]:
    """``repeats`` runs of each MLP config, alternating; per config the runs' medians and means (us a step)."""
    import lit_mpstable

    out: dict[str, Any] = {"package": str(Path(lit_mpstable.__file__).parent), "q10_us": {}, "median_us": {},
                           "mean_us": {}}
    for name in MLP_CONFIGS:
        out["q10_us"][name], out["median_us"][name], out["mean_us"][name] = [], [], []
    for r in range(repeats):
        for name in MLP_CONFIGS[r % 3:] + MLP_CONFIGS[:r % 3]:
            kept = _mlp_run(name, steps)[warmup:]
            out["q10_us"][name].append(statistics.quantiles(kept, n=10)[0])
            out["median_us"][name].append(statistics.median(kept))
            out["mean_us"][name].append(statistics.fmean(kept))
    return out


def _quartiles(values: list[float]) -> list[float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return [q[0], statistics.median(values), q[2]]


def _mlp_main(args: argparse.Namespace) -> dict[str, Any]:
    import subprocess
    import sys

    trees = dict(item.split("=", 1) for item in args.trees.split(",")) if args.trees else {"this": ""}
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    names = list(trees)
    for r in range(args.rounds):
        for tree in names[r % len(names):] + names[:r % len(names)]:
            if trees[tree]:
                env = {**os.environ, "PYTHONPATH": str(Path(trees[tree]).resolve())}
                child = subprocess.run([sys.executable, __file__, "--workload", "mlp", "--child", "--steps",
                                        str(args.steps), "--warmup", str(args.warmup), "--repeats", str(args.repeats)],
                                       env=env, capture_output=True, text=True, check=True)
                rounds[tree].append(json.loads(child.stdout.strip().splitlines()[-1]))
            else:
                rounds[tree].append(_mlp_round(args.steps, args.warmup, args.repeats))
            print(f"round {r + 1}/{args.rounds}: {tree} done", flush=True)
    stack, bare, lightning = MLP_CONFIGS[2], MLP_CONFIGS[1], MLP_CONFIGS[0]
    rows = []
    for tree, results in rounds.items():
        cost_q10, cost_median, cost_mean, ratio, ratio_bare = [], [], [], [], []
        for res in results:
            q10, med, mean = res["q10_us"], res["median_us"], res["mean_us"]
            for i in range(len(med[stack])):  # paired within a round: the runs alternate
                cost_q10.append(q10[stack][i] - q10[bare][i])
                cost_median.append(med[stack][i] - med[bare][i])
                cost_mean.append(mean[stack][i] - mean[bare][i])
                ratio.append(med[lightning][i] / med[stack][i])
                ratio_bare.append(med[lightning][i] / med[bare][i])
        rows.append({"tree": tree, "package": results[0]["package"], "runs": len(cost_median),
                     "callbacks_us_q10_step": _quartiles(cost_q10), "callbacks_us_median_step": _quartiles(cost_median),
                     "callbacks_us_mean_step": _quartiles(cost_mean),
                     "stack_x_lightning": _quartiles(ratio), "no_callbacks_x_lightning": _quartiles(ratio_bare),
                     "lightning_us": statistics.median(x for res in results for x in res["median_us"][lightning])})
    lines = [
        "# The callbacks' per-step cost on the tiny MLP stack", "",
        "`mlp/SP-bf16-mixed+cb` (StablePrecision(\"bf16-mixed\", spike_guard=SpikeGuard()) + the four callbacks)"
        f" against the same plugin without callbacks and Lightning's bf16-mixed; {args.rounds} rounds x"
        f" {args.repeats} runs of {args.steps} steps ({args.warmup} dropped), thread CPU time, 1 thread. Quartiles"
        " over the paired runs [Q1, median, Q3].", "",
        "| tree | callbacks, us a fast step (stack - no callbacks, step 10th percentiles) | callbacks, us a clean"
        " step (step medians) | callbacks, us a step (means: logging steps and snapshots included) | stack x"
        " Lightning bf16-mixed | no callbacks x Lightning | Lightning us/step |",
        "|---|---|---|---|---|---|---|",
    ]
    fmt = lambda q, spec: "[" + ", ".join(format(v, spec) for v in q) + "]"  # noqa: E731
    lines += [f"| {r['tree']} | {fmt(r['callbacks_us_q10_step'], '.1f')} | {fmt(r['callbacks_us_median_step'], '.1f')}"
              f" | {fmt(r['callbacks_us_mean_step'], '.1f')}"
              f" | {fmt(r['stack_x_lightning'], '.3f')} | {fmt(r['no_callbacks_x_lightning'], '.3f')} |"
              f" {r['lightning_us']:.0f} |" for r in rows]
    print("\n".join(lines))
    result = {"rows": rows, "rounds": rounds, "args": {k: str(v) for k, v in vars(args).items()},
              "torch": torch.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mlp_stack.json").write_text(json.dumps(result, indent=1))
    (args.out / "mlp_stack.md").write_text("\n".join(lines) + "\n")
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("gpt", "mlp"), default="gpt")
    parser.add_argument("--trees", default="", help="mlp: NAME=PATH,... package trees paired round by round")
    parser.add_argument("--rounds", type=int, default=6, help="mlp: rounds (a process per tree each)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=None, help="rounds (mlp: runs per config a round); 6 (mlp 2)")
    parser.add_argument("--steps", type=int, default=None, help="steps a run; 60 (mlp 300)")
    parser.add_argument("--warmup", type=int, default=None, help="first steps dropped; 5 (mlp 20)")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 12 steps")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset; 'none' is always run")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    mlp = args.workload == "mlp"
    for name, gpt, for_mlp in (("repeats", 6, 2), ("steps", 60, 300), ("warmup", 5, 20)):
        if getattr(args, name) is None:
            setattr(args, name, for_mlp if mlp else gpt)
    if mlp:
        if args.out == RESULTS_DIR:
            args.out = RESULTS_DIR / "cb_cost"
        torch.set_num_threads(1)
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if args.child:
                print(json.dumps(_mlp_round(args.steps, args.warmup, args.repeats)))
                return {}
            return _mlp_main(args)
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

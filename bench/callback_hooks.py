"""Per-step cost of each callback hook in a ``bench_precision.py`` config (default: the whole stack on the tiny MLP,
``mlp/SP-bf16-mixed+cb``): CPU time (thread time, median over the counted steps), torch ops and Python calls per
step of every hook a lit_mpstable callback overrides, each measured inside a real Lightning fit.

    PYTHONPATH=. .venv/bin/python bench/callback_hooks.py                       # the whole stack, 3 fits
    PYTHONPATH=. .venv/bin/python bench/callback_hooks.py --configs mlp/SP-bf16-mixed+cb --steps 300
    PYTHONPATH=. .venv/bin/python bench/callback_hooks.py --triage           # + FaultTriage, as make run has it

Run it from a tree with that tree's package on ``PYTHONPATH`` (a baseline copy too: the script only wraps hooks).
Three fits per config: one timed (hooks wrapped in a thread-time timer), one counting aten ops (a
``TorchDispatchMode`` on inside the hooks only), one counting Python calls (``sys.setprofile``, calls and C calls).
Op and call counts are exact; the times include the timer's wrapper (~1 us) and vary with the machine's load. Steps
are counted from ``--first`` on; logging steps (every 50) are included, so a median is a clean non-logging step.
Only the hooks Lightning dispatches at train start are wrapped (a callback sets a per-step hook it has nothing for to
None: Lightning skips it); AMPPreflight's batch start, owed at train start, stays wrapped (1 call a step) although
Lightning stops dispatching it after the first batch's check.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from bench_precision import CONFIGS, SUITES, _quiet  # noqa: E402
from common import TRAINER_DEFAULTS  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
         "on_before_zero_grad", "on_train_batch_end")


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


class _Calls:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            self.n += 1


class Recorder:
    """Wraps the overridden per-step hooks of the lit_mpstable callbacks; ``mode``: time, ops or calls."""

    def __init__(self, mode: str, first: int) -> None:
        self.mode, self.first = mode, first
        self.step = 0
        self.values: dict[str, dict[int, float]] = collections.defaultdict(lambda: collections.defaultdict(float))

    def wrap(self, callback: pl.Callback) -> None:
        """At train start, the hooks Lightning dispatches then (a callback sets those it has nothing for to None)."""
        for hook in HOOKS:
            if not callable(getattr(callback, hook)) or getattr(type(callback), hook) is getattr(pl.Callback, hook):
                continue
            name = f"{type(callback).__name__}.{hook}"
            original = getattr(callback, hook)
            setattr(callback, hook, self._wrapped(name, original))

    def _wrapped(self, name: str, original: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            if self.step < self.first:
                return original(*args, **kwargs)
            if self.mode == "time":
                start = time.thread_time_ns()
                out = original(*args, **kwargs)
                self.values[name][self.step] += (time.thread_time_ns() - start) / 1e3
                return out
            if self.mode == "ops":
                with _Ops() as ops:
                    out = original(*args, **kwargs)
                self.values[name][self.step] += ops.n
                return out
            calls = _Calls()
            sys.setprofile(calls)
            try:
                out = original(*args, **kwargs)
            finally:
                sys.setprofile(None)
            self.values[name][self.step] += max(calls.n - 1, 0)  # the setprofile(None) call itself
            return out
        return run


class _Counter(pl.Callback):
    def __init__(self, recorder: Recorder, callbacks: list[pl.Callback]) -> None:
        self.recorder, self.callbacks = recorder, callbacks

    def on_train_start(self, *args: Any) -> None:  # listed last: after every callback decided what it dispatches
        for callback in self.callbacks:
            self.recorder.wrap(callback)

    def on_train_batch_end(self, *args: Any) -> None:
        self.recorder.step += 1


def measure(name: str, mode: str, steps: int, first: int, triage: bool = False) -> Recorder:
    config, suite = CONFIGS[name], SUITES[CONFIGS[name].suite]
    work = suite.workload(steps)
    kwargs = config.trainer()  # type: ignore[misc]
    callbacks = list(kwargs.pop("callbacks", []))
    if triage:
        from lit_mpstable.callbacks import FaultTriage

        callbacks.insert(0, FaultTriage())  # first, as its docs ask
    recorder = Recorder(mode, first)
    ours = [callback for callback in callbacks if type(callback).__module__.startswith("lit_mpstable")]
    trainer = pl.Trainer(**TRAINER_DEFAULTS, max_steps=steps, callbacks=callbacks + [_Counter(recorder, ours)],
                         **kwargs)
    trainer.fit(work.module, train_dataloaders=work.loader)
    return recorder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="mlp/SP-bf16-mixed+cb")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--first", type=int, default=20, help="first counted step (default 20)")
    parser.add_argument("--triage", action="store_true", help="also FaultTriage (make run's stack), listed first")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    _quiet()
    import lit_mpstable

    print(f"lit_mpstable from {Path(lit_mpstable.__file__).parent}; torch {torch.__version__}")
    for name in args.configs.split(","):
        timed, ops, calls = (measure(name, mode, args.steps, args.first, args.triage)
                             for mode in ("time", "ops", "calls"))
        counted = range(args.first, args.steps)
        print(f"\n{name}: per step ({len(counted)} steps from step {args.first}; median [mean] over them)")
        print("| hook | CPU us | torch ops | Python calls |\n| --- | --- | --- | --- |")
        totals = [[0.0, 0.0] for _ in range(3)]
        for hook in timed.values:
            cells = []
            for column, recorder in enumerate((timed, ops, calls)):
                per_step = [recorder.values[hook].get(s, 0.0) for s in counted]
                med, mean = statistics.median(per_step), statistics.fmean(per_step)
                totals[column] = [totals[column][0] + med, totals[column][1] + mean]
                cells.append(f"{med:.1f} [{mean:.1f}]")
            print(f"| {hook} | " + " | ".join(cells) + " |")
        print("| **all** | " + " | ".join(f"{med:.1f} [{mean:.1f}]" for med, mean in totals) + " |")

if __name__ == "__main__":
    main()

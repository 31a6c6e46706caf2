"""What one Lightning training step does besides the model's own work: torch ops and Python calls per step, for the
configs of ``bench_precision.py`` (by name), counted over steps in the middle of a short fit.

    PYTHONPATH=. .venv/bin/python bench/step_profile.py --configs mlp/L-bf16-mixed,mlp/SP-bf16-mixed
    PYTHONPATH=. .venv/bin/python bench/step_profile.py --configs mlp/SP-bf16-mixed --top 25   # the hot functions
    PYTHONPATH=. .venv/bin/python bench/step_profile.py --configs mlp/SP-bf16-mixed --package 20  # the package's own

A step here runs from one ``on_train_batch_end`` to the next (the batch fetch and all of Lightning's per-step work,
as ``bench_precision.py`` times it). Torch ops: every aten op that reaches the dispatcher (a ``TorchDispatchMode``
counter: forward, backward, optimizer, our checks), per step. Python calls: ``cProfile``'s total calls (builtins
included) per step, and the functions with most own time and most calls. ``--package``: the bytecodes the package's
own frames run and the calls they make (through torch's helpers too), per step and by function: the plugin's fixed
cost in units a busy machine cannot blur. Counts are exact and do not depend on the machine's load; times from a
profiled run are inflated and only rank the functions.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import sys
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from bench_precision import CONFIGS, SUITES, _quiet  # noqa: E402
from common import TRAINER_DEFAULTS  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class Window(pl.Callback):
    """Runs ``begin`` at the end of step ``first - 1`` and ``end`` at the end of step ``first + count - 1``."""

    def __init__(self, first: int, count: int, begin: Any, end: Any) -> None:
        self.first, self.count, self.begin, self.end = first, count, begin, end

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if idx == self.first - 1:
            self.begin()
        elif idx == self.first + self.count - 1:
            self.end()


def _fit(name: str, window: Window, steps: int) -> None:
    config, suite = CONFIGS[name], SUITES[CONFIGS[name].suite]
    work = suite.workload(steps)
    kwargs = config.trainer()  # type: ignore[misc]
    extra = list(kwargs.pop("callbacks", []))
    trainer = pl.Trainer(**TRAINER_DEFAULTS, max_steps=steps, callbacks=extra + [window], **kwargs)
    trainer.fit(work.module, train_dataloaders=work.loader)


def count_ops(name: str, first: int, count: int) -> collections.Counter[str]:
    counter = OpCounter()
    _fit(name, Window(first, count, counter.__enter__, lambda: counter.__exit__(None, None, None)), first + count + 1)
    return counter.ops


def profile_calls(name: str, first: int, count: int) -> pstats.Stats:
    profiler = cProfile.Profile()
    _fit(name, Window(first, count, profiler.enable, profiler.disable), first + count + 1)
    return pstats.Stats(profiler, stream=io.StringIO())


class PackageWork:
    """Exact counts of what the package's own code runs per step: bytecodes executed in ``lit_mpstable`` frames
    (``sys.settrace`` with opcode events) and calls made from them, Python and C, through the non-package helpers they
    call (GradScaler's, autocast's), the optimizer's own step and Lightning's hooks and loops left out. By function
    (file, name, first line), so a change shows where it landed. Tracing is slow: the counts, not the times, mean
    something."""

    _OUTSIDE = ("torch/optim/", "lightning/pytorch/loops", "lightning/pytorch/trainer/call.py")

    def __init__(self) -> None:
        import lit_mpstable

        self.root = str(Path(lit_mpstable.__file__).parent)
        self.bytecodes: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def _name(self, code: Any) -> str:
        return f"{Path(code.co_filename).relative_to(self.root)}:{code.co_name}:{code.co_firstlineno}"

    def _owner(self, frame: Any) -> str | None:
        while frame is not None:  # the innermost package frame, unless the optimizer or Lightning comes first
            filename = frame.f_code.co_filename
            if filename.startswith(self.root):
                return self._name(frame.f_code)
            if any(part in filename for part in self._OUTSIDE):
                return None
            frame = frame.f_back
        return None

    def _trace(self, frame: Any, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(self.root):
            return None
        frame.f_trace_opcodes = True
        return self._local

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            self.bytecodes[self._name(frame.f_code)] += 1
        return self._local

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call") and (owner := self._owner(frame.f_back if event == "call" else frame)):
            self.calls[owner] += 1

    def start(self) -> None:
        sys.settrace(self._trace)
        sys.setprofile(self._profile)

    def stop(self) -> None:
        sys.settrace(None)
        sys.setprofile(None)


def count_package_work(name: str, first: int, count: int) -> PackageWork:
    work = PackageWork()
    _fit(name, Window(first, count, work.start, work.stop), first + count + 1)
    return work


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="mlp/L-bf16-mixed,mlp/SP-bf16-mixed")
    parser.add_argument("--first", type=int, default=20, help="first counted step (0-based; default 20)")
    parser.add_argument("--count", type=int, default=20, help="steps counted (default 20)")
    parser.add_argument("--top", type=int, default=0, help="also list the N functions with most own time and calls")
    parser.add_argument("--ops", action="store_true", help="also list every op per step")
    parser.add_argument("--package", type=int, default=0, metavar="N",
                        help="also count the package's own bytecodes and calls per step (exact), and list the N"
                             " functions running most bytecodes")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    _quiet()
    import lit_mpstable

    print(f"lit_mpstable from {Path(lit_mpstable.__file__).parent}; torch {torch.__version__}")
    rows = []
    for name in args.configs.split(","):
        ops = count_ops(name, args.first, args.count)
        stats = profile_calls(name, args.first, args.count)
        total_calls = sum(entry[1] for entry in stats.stats.values())  # type: ignore[attr-defined]
        rows.append((name, sum(ops.values()) / args.count, total_calls / args.count))
        if args.package:
            work = count_package_work(name, args.first, args.count)
            n = args.count
            print(f"\n{name}: the package's own work per step: {sum(work.bytecodes.values()) / n:.0f} bytecodes,"
                  f" {sum(work.calls.values()) / n:.0f} calls made")
            for function, bytecodes in work.bytecodes.most_common(args.package):
                print(f"  {bytecodes / n:7.1f} bytecodes {work.calls[function] / n:6.1f} calls  {function}")
        if args.ops:
            print(f"\n{name}: ops per step")
            for op, n in sorted(ops.items(), key=lambda kv: -kv[1]):
                print(f"  {n / args.count:6.2f}  {op}")
        if args.top:
            for key in ("tottime", "ncalls"):
                out = io.StringIO()
                stats.stream = out  # type: ignore[attr-defined]
                stats.sort_stats(key).print_stats(args.top)
                print(f"\n{name}: top {args.top} by {key} over {args.count} steps")
                print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))
    print("\n| config | torch ops/step | Python calls/step |\n| --- | --- | --- |")
    for name, ops_per_step, calls_per_step in rows:
        print(f"| {name} | {ops_per_step:.1f} | {calls_per_step:.0f} |")


if __name__ == "__main__":
    main()

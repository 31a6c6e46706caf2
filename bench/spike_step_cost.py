"""SpikeGuard's own cost inside a Lightning step (issue #44): CPU time, torch ops and Python calls per step of the
guard's methods (``observe_loss_``, ``decide``, ``clip_threshold``, ``commit_``, ``count_run_``), measured in a fit
of the tiny MLP of ``bench_precision.py`` (``mlp/SP-bf16-mixed+cb``: the plugin with ``SpikeGuard()`` and every
callback of ``stable_callbacks()``, or ``--zclip``: ``SpikeGuard(clip_zscore=2.5)``), for the package on
``PYTHONPATH``: run it once per tree, alternating, to compare two trees (the guard's methods are wrapped, so the
numbers are the guard's share of the step as the step's cold caches make it, not a tight loop's).

    PYTHONPATH=. .venv/bin/python bench/spike_step_cost.py [--steps 300 --zclip --out FILE.json]
    LIT_MPSTABLE_NATIVE=0 PYTHONPATH=. .venv/bin/python bench/spike_step_cost.py   # the guard's torch ops on the CPU
    PYTHONPATH=. .venv/bin/python bench/spike_step_cost.py --precision [--repeats 8 --out-dir DIR]

Per step: the median over steps (after ``--skip`` steps) of the summed CPU time (``time.process_time_ns``) of each
method's calls; ops (a ``TorchDispatchMode`` counter inside the methods, views included) and Python calls
(``sys.setprofile`` events inside the methods, builtins included) from two more, counting fits (exact). ``path`` says
which path the guard's steps took: ``"native"`` (its C loops, the CPU default where a C compiler builds them) or
``"torch"``. A dispatch mode makes the guard take its torch ops (so a mode sees every operation): the op counts are
always the torch path's; the C loops' steps run no op outside a mode, but one every 64 steps (new flags' ``empty``).

``--precision``: ``bench_precision.py``'s whole-step throughput instead, paired in one run (configs alternated round
by round): ``mlp/L-bf16-mixed``, ``mlp/SP-bf16-mixed``, ``mlp/SP-bf16-mixed+cb`` (the guard's C loops) and
``mlp/SP-bf16-mixed+cb-torch`` (the same stack, its guard bound with ``LIT_MPSTABLE_NATIVE=0``: the torch ops).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_precision  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from bench_precision import SUITES, Config, _quiet, register, stable_callbacks  # noqa: E402
from common import TRAINER_DEFAULTS  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import lit_mpstable  # noqa: E402
from lit_mpstable import SpikeGuard, StablePrecision  # noqa: E402

METHODS = ("observe_loss_", "decide", "clip_threshold", "commit_", "count_run_")


class _Ops(TorchDispatchMode):
    def __init__(self, sink: collections.Counter[str]) -> None:
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.sink[str(func)] += 1
        return func(*args, **(kwargs or {}))


class _Steps(pl.Callback):
    """Closes a step's tally at each ``on_train_batch_end``."""

    def __init__(self, tally: dict[str, float], rows: list[dict[str, float]]) -> None:
        self.tally, self.rows = tally, rows

    def on_train_batch_end(self, *args: Any) -> None:
        self.rows.append(dict(self.tally))
        self.tally.clear()


def _fit(steps: int, zclip: bool, wrap: Any) -> tuple[list[dict[str, float]], str]:
    tally: dict[str, float] = collections.defaultdict(float)
    rows: list[dict[str, float]] = []
    originals = {name: getattr(SpikeGuard, name) for name in METHODS}
    for name, method in originals.items():
        setattr(SpikeGuard, name, wrap(name, method, tally))
    try:
        work = SUITES["policy-mlp"].workload(steps)
        guard = SpikeGuard(clip_zscore=2.5) if zclip else SpikeGuard()
        trainer = pl.Trainer(**TRAINER_DEFAULTS, max_steps=steps,
                             plugins=[StablePrecision("bf16-mixed", spike_guard=guard)],
                             callbacks=stable_callbacks() + [_Steps(tally, rows)])
        trainer.fit(work.module, train_dataloaders=work.loader)
    finally:
        for name, method in originals.items():
            setattr(SpikeGuard, name, method)
    native = getattr(guard, "_native", None)  # a tree before the C loops has none
    return rows, "native" if native is not None and native() is not None else "torch"


def _torch_guard() -> SpikeGuard:
    """A SpikeGuard bound to the CPU with its C loops off (``LIT_MPSTABLE_NATIVE=0`` while it binds): its torch ops."""
    saved = os.environ.get("LIT_MPSTABLE_NATIVE")
    os.environ["LIT_MPSTABLE_NATIVE"] = "0"
    try:
        return SpikeGuard().bind("cpu")
    finally:
        if saved is None:
            del os.environ["LIT_MPSTABLE_NATIVE"]
        else:
            os.environ["LIT_MPSTABLE_NATIVE"] = saved


def _precision(repeats: int, out: Path) -> None:
    register(Config("mlp/SP-bf16-mixed+cb-torch", "policy-mlp",
                    "mlp/SP-bf16-mixed+cb with the guard's torch ops (LIT_MPSTABLE_NATIVE=0 when it binds)",
                    trainer=lambda: {"plugins": [StablePrecision("bf16-mixed", spike_guard=_torch_guard())],
                                     "callbacks": stable_callbacks()}))
    configs = "mlp/L-bf16-mixed,mlp/SP-bf16-mixed,mlp/SP-bf16-mixed+cb,mlp/SP-bf16-mixed+cb-torch"
    bench_precision.main(["--no-memory", "--repeats", str(repeats), "--configs", configs, "--out", str(out)])


def _timed(name: str, method: Any, tally: dict[str, float]) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time_ns()
        try:
            return method(*args, **kwargs)
        finally:
            tally[name] += (time.process_time_ns() - start) / 1e3
    return call


def _counted_ops(name: str, method: Any, tally: dict[str, float]) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        ops: collections.Counter[str] = collections.Counter()
        try:
            with _Ops(ops):
                return method(*args, **kwargs)
        finally:
            tally[f"{name}:ops"] += sum(ops.values())
    return call


def _counted_calls(name: str, method: Any, tally: dict[str, float]) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        calls = [0]

        def profile(frame: Any, event: str, arg: Any) -> None:
            calls[0] += event in ("call", "c_call")

        sys.setprofile(profile)
        try:
            return method(*args, **kwargs)
        finally:
            sys.setprofile(None)
            tally[f"{name}:calls"] += calls[0] - 1  # less the setprofile(None) call itself
    return call


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--skip", type=int, default=40, help="steps dropped at the start (warmup, first kernels)")
    parser.add_argument("--zclip", action="store_true", help="SpikeGuard(clip_zscore=2.5) instead of SpikeGuard()")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    parser.add_argument("--precision", action="store_true", help="bench_precision.py's paired whole-step run instead")
    parser.add_argument("--repeats", type=int, default=8, help="--precision: rounds over the configs")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results/spike_fused"),
                        help="--precision: where bench_precision writes precision.{json,md}")
    args = parser.parse_args(argv)
    if args.precision:
        _precision(args.repeats, args.out_dir)
        return {}
    torch.set_num_threads(1)
    _quiet()
    timed, path = _fit(args.steps, args.zclip, _timed)
    timed = timed[args.skip:]
    short = min(args.steps, args.skip + 20)
    counted = [{**a, **b} for a, b in zip(_fit(short, args.zclip, _counted_ops)[0][args.skip:],
                                          _fit(short, args.zclip, _counted_calls)[0][args.skip:])]
    result: dict[str, Any] = {"package": str(Path(lit_mpstable.__file__).parent), "zclip": args.zclip,
                              "path": path, "steps": len(timed), "us": {}, "ops": {}, "calls": {}}
    for name in METHODS + ("total",):
        per_step = [sum(row.get(m, 0.0) for m in METHODS) if name == "total" else row.get(name, 0.0) for row in timed]
        result["us"][name] = statistics.median(per_step)
        for kind in ("ops", "calls"):
            keys = [f"{m}:{kind}" for m in (METHODS if name == "total" else (name,))]
            result[kind][name] = statistics.mean(sum(row.get(k, 0.0) for k in keys) for row in counted)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()

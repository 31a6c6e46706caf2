"""GrowthMonitor (``StablePrecision(growth_every_n_steps=10)``): what one sampled step costs, and where it goes.

    git show 6b6083e:lit_mpstable/core/guards/growth.py > /tmp/growth_before.py   # the monitor before this bench,
    optional PYTHONPATH=. .venv/bin/python bench/bench_growth.py --workloads mlp,gpt --baseline /tmp/growth_before.py  #
    ~8 min PYTHONPATH=. .venv/bin/python bench/bench_growth.py --part profile       # the breakdown only, digits MLP
    (~20 s) PYTHONPATH=. .venv/bin/python bench/bench_growth.py --quick              # smoke run ->
    growth_overhead_quick.*

Workloads (through the Trainer, ``StablePrecision("bf16-mixed", fp8="current")``, 1 thread, no validation, no
logger): ``mlp``: ``zoo.MLPClassifier`` (64-256-256-10, 3 linears) on ``zoo.DigitsData`` (batch 64); ``gpt``:
``zoo.GPTLM`` (d_model 128, 2 blocks, seq 64, 9 linears) on ``zoo.CharLMData`` (batch 16).

**Profile.** Runs with ``growth_every_n_steps=10`` and ``OverflowMonitor``; every method of the monitor is wrapped:
CPU time (``time.thread_time``, exclusive of nested monitor calls) and the number of torch ops it dispatches (a
``TorchDispatchMode``, in a separate run), from sampled step 40 to step 43, split into the forward hooks that
sample, the idle hooks (the Python check on steps between samples), the flush (the deferred arithmetic of the
queued samples) and the reads (``stats``/``runaway``/``metrics``: the plugin and ``OverflowMonitor`` side, once per
new sample); the median over 5 runs.

**Overhead** (``blocks``), two ways in each fit: the monitor is on for one block of 10 steps (its first step
sampled) and off for the next, alternately, switched between blocks outside the timed steps (off: the stepper runs
without it, as ``growth_every_n_steps=None``; a ``--baseline`` monitor from before on-demand hooks also has its
permanent hooks removed; the monitor's state untouched: nothing is flushed early). Fits alternate between the current
monitor (``on``) and ``--baseline`` (``base``). Per on-block:

- (a) the component fraction: CPU time inside the monitor (hooks, hooking and unhooking the layers, flush; the reads
  only with ``--reads``, which adds OverflowMonitor: it reads ``runaway_layers()`` once per new sample) over the
  block's CPU time, less the wrapper's own cost per call (measured by wrapping a no-op), raw in parentheses.
  ``due`` (the stepper's Python check, ~0.2 us a call by ``timeit``, below the wrapper's resolution) is not timed:
  it is in (b) only;
- (b) the whole-step paired ratio: the on-block's CPU time over the mean of its two neighbouring off-blocks.

Both as the median with a distribution-free 95% confidence interval (order statistics of the binomial); (b) also as
the mean with a normal interval. ``--part overhead`` instead times whole fits per config, alternating per round
(noisier: a fit's CPU time varies by 10-20% on this shared machine).

Writes ``bench/results/growth_overhead.{json,md}`` (``_quick`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lit_mpstable import StablePrecision  # noqa: E402
from lit_mpstable.app.zoo import GPTLM, CharLMData, DigitsData, MLPClassifier  # noqa: E402
from lit_mpstable.callbacks import OverflowMonitor  # noqa: E402
from lit_mpstable.core.guards.growth import GrowthMonitor  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TRAINER = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               num_sanity_val_steps=0, accelerator="cpu", devices=1, limit_val_batches=0)
EVERY = 10
WARMUP = 10  # steps dropped at the start of each run (one whole sampling period)
BLOCK_STEPS = {"mlp": 1000, "gpt": 300}  # per fit of the blocks part: ~7 s and ~40 s on this CPU


def workload(name: str) -> tuple[Any, Any]:
    torch.manual_seed(0)
    if name == "mlp":
        return MLPClassifier(total_steps=10_000), DigitsData(batch_size=64)
    if name == "gpt":
        data = _GPT_DATA.setdefault("data", CharLMData(seq_len=64, batch_size=16, max_chars=400_000))
        return GPTLM(data.vocab_size, d_model=128, n_layers=2, seq_len=64, total_steps=10_000), data
    raise ValueError(f"workload(name={name!r}): unknown; allowed: ['mlp', 'gpt'].")


_GPT_DATA: dict[str, Any] = {}


# ------------------------------------------------------------------------------------------------ instrumentation
class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class Meter:
    """CPU time (exclusive of nested monitor calls) and, with ``count_ops``, torch ops, per monitor method."""

    METHODS = ("step", "_hook_layers", "_unhook", "_flush", "stats", "runaway", "metrics", "state_dict")

    def __init__(self, count_ops: bool = False, cls: type = GrowthMonitor, skip_idle: bool = False) -> None:
        self.count_ops, self.cls = count_ops, cls
        self.skip_idle = skip_idle  # hook calls on steps that are not due run untimed, only counted (idle_calls):
        # two thread_time calls (~1.5 us each, cold) would cost more than the check they time
        self.idle_calls = 0
        self.seconds: dict[str, float] = {}
        self.ops: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self._stack: list[list[float]] = []  # [start, nested seconds]
        self._saved: dict[str, Any] = {}

    def reset(self) -> None:
        self.seconds, self.ops, self.calls = {}, {}, {}

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def _wrap(self, label: str, fn, monitor: Any = None):
        meter = self
        keys = (f"{label} (idle)", f"{label} (sampling)") if monitor is not None else (label, label)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if monitor is not None and meter.skip_idle:
                now = monitor.clock() if monitor.clock is not None else monitor.steps
                if now % monitor.every_n_steps:
                    meter.idle_calls += 1
                    return fn(*args, **kwargs)
            samples = monitor.samples if monitor is not None else 0
            mode = _Count() if meter.count_ops else None
            meter._stack.append([time.thread_time(), 0.0])
            try:
                if mode is None:
                    return fn(*args, **kwargs)
                with mode:
                    return fn(*args, **kwargs)
            finally:
                start, nested = meter._stack.pop()
                spent = time.thread_time() - start
                key = keys[monitor is not None and monitor.samples != samples]
                meter.seconds[key] = meter.seconds.get(key, 0.0) + spent - nested
                meter.calls[key] = meter.calls.get(key, 0) + 1
                if mode is not None:  # nested calls count their own ops under their own mode only
                    meter.ops[key] = meter.ops.get(key, 0) + mode.ops
                if meter._stack:
                    meter._stack[-1][1] += spent

        return timed

    def install(self) -> None:
        for method in self.METHODS:
            if hasattr(self.cls, method):
                self._saved[method] = getattr(self.cls, method)
                setattr(self.cls, method, self._wrap(method, self._saved[method]))
        make_hook = self._saved["_hook"] = self.cls._hook

        def _hook(monitor: Any, name: str):
            return self._wrap("hook", make_hook(monitor, name), monitor)

        self.cls._hook = _hook

    def uninstall(self) -> None:
        for method, fn in self._saved.items():
            setattr(self.cls, method, fn)
        self._saved = {}


class Clock(pl.Callback):
    """Per-step CPU time (``thread_time``) and the monitor's CPU time up to each step's end."""

    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        self.step_s: list[float] = []
        self.monitor_s: list[float] = []
        self._last: float | None = None

    def on_train_batch_start(self, *args: Any) -> None:
        if self._last is None:
            self._last = time.thread_time()

    def on_train_batch_end(self, *args: Any) -> None:
        now = time.thread_time()
        assert self._last is not None
        self.step_s.append(now - self._last)
        self.monitor_s.append(self.meter.total_s)
        self._last = now


def instrument_cost(repeats: int = 20000) -> float:
    """Seconds of CPU time one wrapped call adds to the meter's total by itself (the wrapper around a no-op)."""
    meter = Meter()
    timed = meter._wrap("noop", lambda: None, monitor=argparse.Namespace(samples=0))  # the hooks' wrapper
    for _ in range(repeats):
        timed()
    return meter.seconds["noop (idle)"] / repeats


def idle_cost(repeats: int = 15, calls: int = 400) -> float:
    """Seconds of CPU time one idle hook call adds to a layer's forward (the hook check and nn.Module's hook path):
    a Linear(256, 256) with a monitor whose clock is never due against one without, alternating; the median."""
    plain, hooked = nn.Linear(256, 256), nn.Linear(256, 256)
    GrowthMonitor(every_n_steps=10, clock=lambda: 5).attach(hooked)
    x = torch.randn(64, 256)
    diffs = []
    for _ in range(repeats):
        spent = []
        for layer in (plain, hooked):
            start = time.thread_time()
            for _ in range(calls):
                layer(x)
            spent.append(time.thread_time() - start)
        diffs.append((spent[1] - spent[0]) / calls)
    return max(statistics.median(diffs), 0.0)


def fit(name: str, growth: int | None, steps: int, meter: Meter, *, overflow_monitor: bool = False,
        probe: Any = None) -> Clock:
    module, data = workload(name)
    meter.reset()
    clock = Clock(meter)
    callbacks: list[pl.Callback] = [clock] + ([OverflowMonitor()] if overflow_monitor else []) + (
        [probe] if probe is not None else [])
    plugin = StablePrecision("bf16-mixed", fp8="current", growth_every_n_steps=growth)
    trainer = pl.Trainer(plugins=[plugin], max_steps=steps, callbacks=callbacks, **TRAINER)
    trainer.fit(module, datamodule=data)
    return clock


# ------------------------------------------------------------------------------------------------ profile
class _SampledStep(pl.Callback):
    """Resets the meter at the start of sampled step ``at`` and snapshots it at the start of step ``at + 3``: the
    sampled step's hooks, the flush of its rows (by the first hook of step ``at + 1``), the hooks of two steps
    between samples, and the reads a logging step makes after a sample (``runaway_layers``, ``growth_metrics``)."""

    def __init__(self, meter: Meter, at: int) -> None:
        self.meter, self.at = meter, at
        self.snapshot: dict[str, Any] = {}
        self.step_s = 0.0
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step  # batch_idx restarts each epoch
        if step == self.at:
            self.meter.reset()
            self._start = time.thread_time()
        elif step == self.at + 2 + 1:
            self.snapshot = {"seconds": dict(self.meter.seconds), "ops": dict(self.meter.ops),
                             "calls": dict(self.meter.calls)}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at + 1:  # counted after the optimizer step
            self.step_s = time.thread_time() - self._start
        elif trainer.global_step == self.at + 2:  # the reads OverflowMonitor makes on a logging step after a sample
            trainer.precision_plugin.runaway_layers()
            trainer.precision_plugin.growth_metrics()


def profile(name: str, repeats: int) -> dict[str, Any]:
    """Ops and CPU time per monitor method over one sampled step (step 40 of a run: step 40's forward is sampled,
    its flush runs at step 41's first hook), with the reads OverflowMonitor makes; the median over ``repeats`` runs."""
    runs = []
    for count_ops in (True, False):  # ops counted in one run; times taken without the counting mode's cost
        for _ in range(1 if count_ops else repeats):
            meter = Meter(count_ops=count_ops)
            meter.install()
            try:
                probe = _SampledStep(meter, at=40)
                fit(name, EVERY, 44, meter, overflow_monitor=True, probe=probe)
            finally:
                meter.uninstall()
            runs.append((count_ops, probe.snapshot, probe.step_s))
    ops = runs[0][1]["ops"]
    timed = [r for r in runs if not r[0]]
    labels = sorted({label for _, snap, _ in timed for label in snap["seconds"]})
    return {
        "ops": ops, "calls": runs[0][1]["calls"],
        "ms": {lb: statistics.median(snap["seconds"].get(lb, 0.0) for _, snap, _ in timed) * 1e3 for lb in labels},
        "sampled_step_ms": statistics.median(s for _, _, s in timed) * 1e3,
    }


# ------------------------------------------------------------------------------------------------ overhead
def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """Distribution-free interval for the median: order statistics k, n-1-k with P(Binomial(n, 1/2) < k) <= 2.5%."""
    xs, n = sorted(values), len(values)
    k, tail = 0, 0.0
    while True:
        nxt = tail + math.comb(n, k) / 2**n
        if nxt > (1 - confidence) / 2:
            break
        tail, k = nxt, k + 1
    return xs[max(k - 1, 0)], xs[min(n - k, n - 1)]


def t_ci(values: list[float]) -> tuple[float, float]:
    mean, n = statistics.fmean(values), len(values)
    half = 1.96 * statistics.stdev(values) / math.sqrt(n) if n > 1 else float("nan")
    return mean - half, mean + half


def load_baseline(path: str) -> type:
    """``GrowthMonitor`` from another version of ``growth.py`` (e.g. ``git show
    main:lit_mpstable/core/guards/growth.py``), run as a third config (``base``) in the same rounds."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("growth_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    base = module.GrowthMonitor
    if "hooks" in inspect.signature(base.attach).parameters:
        return base

    class Permanent(base):  # a monitor from before on-demand hooks: its hooks stay on the layers
        hooks = "always"

        def attach(self, module: Any, *, names: Any = None, hooks: str = "always") -> Any:
            return super().attach(module, names=names)

        def due(self) -> bool:  # the stepper asks; this monitor's hooks follow the clock themselves
            return False

        def runaway(self, *, stats: Any = None, **kwargs: Any) -> Any:  # it reads its statistics again
            return super().runaway(**kwargs)

    return Permanent


def overhead(name: str, rounds: int, steps: int, baseline: type | None = None) -> dict[str, Any]:
    import lit_mpstable.core.step.stepper as stepper_module

    meters = {"on": Meter()} | ({"base": Meter(cls=baseline)} if baseline is not None else {})
    for meter in meters.values():
        meter.install()
    configs = ["off", *meters]
    per_round: list[dict[str, float]] = []
    try:
        for r in range(rounds):
            order = configs[r % len(configs):] + configs[: r % len(configs)]  # each config first in turn
            result: dict[str, float] = {}
            for config in order:
                meter = meters.get(config, meters["on"])
                stepper_module.GrowthMonitor = meter.cls  # type: ignore[attr-defined]
                clock = fit(name, None if config == "off" else EVERY, steps, meter)
                kept = (len(clock.step_s) - WARMUP) // EVERY * EVERY
                window = clock.step_s[WARMUP: WARMUP + kept]
                result[f"{config}_ms"] = statistics.fmean(window) * 1e3
                if config != "off":
                    spent = clock.monitor_s[WARMUP + kept - 1] - clock.monitor_s[WARMUP - 1]
                    result[f"{config}_monitor_ms"] = spent / kept * 1e3
                    result[f"{config}_fraction"] = result[f"{config}_monitor_ms"] / result[f"{config}_ms"]
            for config in meters:
                result[f"{config}_ratio"] = result[f"{config}_ms"] / result["off_ms"]
            per_round.append(result)
            print(f"  {name} round {r + 1}/{rounds}: " + ", ".join(
                f"{k} {v:.4f}" for k, v in result.items()), flush=True)
    finally:
        stepper_module.GrowthMonitor = GrowthMonitor  # type: ignore[attr-defined]
        for meter in meters.values():
            meter.uninstall()
    out: dict[str, Any] = {"rounds": per_round, "steps_per_run": steps, "warmup": WARMUP,
                           "step_ms_off_median": statistics.median(r["off_ms"] for r in per_round)}
    for config in meters:
        ratios = [r[f"{config}_ratio"] for r in per_round]
        fractions = [r[f"{config}_fraction"] for r in per_round]
        out[config] = {
            "ratio_median": statistics.median(ratios), "ratio_median_ci95": median_ci(ratios),
            "ratio_mean": statistics.fmean(ratios), "ratio_mean_ci95": t_ci(ratios),
            "fraction_median": statistics.median(fractions), "fraction_median_ci95": median_ci(fractions),
            "monitor_ms_median": statistics.median(r[f"{config}_monitor_ms"] for r in per_round),
        }
    if baseline is not None:
        monitor_ratio = [r["on_monitor_ms"] / r["base_monitor_ms"] for r in per_round]
        out["monitor_ms_on_over_base_median"] = statistics.median(monitor_ratio)
        out["monitor_ms_on_over_base_ci95"] = median_ci(monitor_ratio)
    return out


def _noop(module: Any, inputs: Any, output: Any) -> None:
    return None


class Alternator(pl.Callback):
    """Within one fit, the monitor's hooks on for one block of ``block`` steps (its first step sampled), off for the
    next: per block the CPU time of its steps and of the monitor. The hooks are removed and put back between
    blocks (outside the timed steps) without touching the monitor's state, so nothing is flushed early."""

    def __init__(self, meter: Meter, block: int = EVERY, null: bool = False, empty: bool = False) -> None:
        self.meter, self.block, self.empty = meter, block, empty  # empty: no-op hooks in place of the monitor's
        self.null = null  # an A/A check: the hooks stay off in every block, the blocks still alternate labels
        self.blocks: list[dict[str, Any]] = []
        self._last: float | None = None
        self._current = {"on": True, "step_s": 0.0, "monitor_s": 0.0}
        self._removed: list[tuple[Any, str]] | None = None
        self._monitor: Any = None
        self._empty: list[Any] = []

    def on_train_batch_start(self, *args: Any) -> None:
        if self._last is None:
            self._last = time.thread_time()
            self._mark()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.thread_time()
        assert self._last is not None
        self._current["step_s"] += now - self._last
        if trainer.global_step % self.block == 0:  # a block ends: switch, outside the timed steps
            self._current["monitor_s"] = self.meter.total_s - self._monitor0
            self._current["calls"] = sum(self.meter.calls.values()) - self._calls0
            self._current["idle_calls"] = self.meter.idle_calls - self._idle0
            self.blocks.append(self._current)
            self._current = {"on": not self._current["on"], "step_s": 0.0, "monitor_s": 0.0}
            self._toggle(trainer.precision_plugin.stepper, trainer.lightning_module)
            self._mark()
        self._last = time.thread_time()

    def _mark(self) -> None:
        self._monitor0, self._calls0 = self.meter.total_s, sum(self.meter.calls.values())
        self._idle0 = self.meter.idle_calls

    def _toggle(self, stepper: Any, module: Any) -> None:
        """Off: the stepper runs without its monitor (as ``growth_every_n_steps=None``), and a monitor with
        permanent hooks (``--baseline`` from before on-demand hooks) has them removed; on: put back."""
        if self.null and self._removed is not None:
            return
        if self._removed is None:
            monitor, stepper.growth = stepper.growth, None
            for handle in monitor._handles:
                handle.remove()
            monitor._handles = []
            self._monitor = monitor
            self._removed = [(m, n) for n, m in module.named_modules() if n in monitor._history]
        elif self.empty:  # no-op hooks on the layers, the monitor still off
            self._empty = [m.register_forward_hook(_noop) for m, _ in self._removed]
            self._removed = None
        else:
            stepper.growth = monitor = self._monitor
            if monitor.hooks == "always":
                monitor._handles = [m.register_forward_hook(monitor._hook(n)) for m, n in self._removed]
            self._removed = None
        if self._removed is not None:
            while self._empty:
                self._empty.pop().remove()


def blocks(name: str, runs: int, steps: int, baseline: type | None = None, every: int = EVERY,
           null: bool = False, empty: bool = False, reads: bool = False) -> dict[str, Any]:
    """(b) within each fit: blocks of 10 steps alternately with and without the monitor's hooks; per on-block the
    ratio of its CPU time to the mean of its two neighbouring off-blocks. Fits alternate between the current
    monitor (``on``) and ``baseline`` (``base``) when given. ``every`` > 10 (``--idle-only``): the on-blocks hold
    hooks that never sample: what the hooks cost by being there."""
    import lit_mpstable.core.step.stepper as stepper_module

    classes = {"on": GrowthMonitor} | ({"base": baseline} if baseline is not None else {})
    calibration, idle = instrument_cost(), idle_cost()
    out: dict[str, Any] = {"runs": runs, "steps_per_run": steps, "instrument_us_per_call": calibration * 1e6,
                           "idle_us_per_call": idle * 1e6}
    per: dict[str, dict[str, list[float]]] = {c: {"ratio": [], "fraction": [], "fraction_raw": [],
                                                   "monitor_ms": [], "off_ms": []} for c in classes}
    try:
        for r in range(runs):
            config = list(classes)[r % len(classes)]
            meter = Meter(cls=classes[config], skip_idle=True)
            meter.install()
            stepper_module.GrowthMonitor = meter.cls  # type: ignore[attr-defined]
            try:
                module, data = workload(name)
                alternator = Alternator(meter, null=null, empty=empty)
                plugin = StablePrecision("bf16-mixed", fp8="current", growth_every_n_steps=every)
                readers = [OverflowMonitor()] if reads else []  # the warning's reads, once per new sample
                pl.Trainer(plugins=[plugin], max_steps=steps, callbacks=[alternator, *readers], **TRAINER).fit(
                    module, datamodule=data)
            finally:
                meter.uninstall()
            bl = alternator.blocks[2:]  # the first two blocks: warmup
            for i in range(1, len(bl) - 1):
                if not bl[i]["on"]:
                    continue
                off = (bl[i - 1]["step_s"] + bl[i + 1]["step_s"]) / 2
                # timed calls each add the wrapper's own cost; idle calls ran untimed and are priced at `idle`
                spent = bl[i]["monitor_s"] + bl[i]["idle_calls"] * idle
                per[config]["ratio"].append(bl[i]["step_s"] / off)
                per[config]["fraction_raw"].append(spent / bl[i]["step_s"])
                per[config]["fraction"].append(max(spent - bl[i]["calls"] * calibration, 0.0) / bl[i]["step_s"])
                per[config]["monitor_ms"].append(spent / EVERY * 1e3)
                per[config]["off_ms"].append(off / EVERY * 1e3)
            print(f"  {name} run {r + 1}/{runs} ({config}): ratio median"
                  f" {statistics.median(per[config]['ratio']):.4f}, fraction"
                  f" {statistics.median(per[config]['fraction']):.3%}", flush=True)
    finally:
        stepper_module.GrowthMonitor = GrowthMonitor  # type: ignore[attr-defined]
    for config, values in per.items():
        out[config] = {
            "pairs": len(values["ratio"]),
            "ratio_median": statistics.median(values["ratio"]), "ratio_median_ci95": median_ci(values["ratio"]),
            "ratio_mean": statistics.fmean(values["ratio"]), "ratio_mean_ci95": t_ci(values["ratio"]),
            "fraction_median": statistics.median(values["fraction"]),
            "fraction_median_ci95": median_ci(values["fraction"]),
            "fraction_raw_median": statistics.median(values["fraction_raw"]),
            "monitor_ms_median": statistics.median(values["monitor_ms"]),
            "step_ms_off_median": statistics.median(values["off_ms"]),
        }
    return out


# ------------------------------------------------------------------------------------------------ report
def environment() -> dict[str, Any]:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].strip() for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma")
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "loadavg_start": os.getloadavg(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_flags": [f for f in wanted if f in flags.split()], "argv": sys.argv,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = ["# GrowthMonitor overhead (`bench/bench_growth.py`)", "",
             f"torch {env['torch']}, {env['threads']} thread, CPU {env['cpu_capability']} {env['cpu_flags']},"
             f" load average at start {env['loadavg_start']}, {env['time']}.", ""]
    for name, part in results.get("profile", {}).items():
        lines += [f"## Profile, {name}: one sampled step", "",
                  f"Sampled step (its forward hooks): {part['sampled_step_ms']:.2f} ms CPU.", "",
                  "| monitor method | calls | torch ops | CPU ms (median of runs) |", "|---|---|---|---|"]
        for label, ms in sorted(part["ms"].items(), key=lambda kv: -kv[1]):
            lines.append(f"| `{label}` | {part['calls'].get(label, 0)} | {part['ops'].get(label, 0)} | {ms:.3f} |")
        lines.append("")
    for name, part in results.get("blocks", {}).items():
        lines += [f"## Overhead, {name}: blocks of {EVERY} steps alternately with and without the monitor, in"
                  f" {part['runs']} fits of {part['steps_per_run']} steps", "",
                  f"Instrumentation: {part['instrument_us_per_call']:.2f} us of CPU per timed call (measured here,"
                  " subtracted in (a)); hook calls on steps that are not due run untimed and count"
                  f" {part['idle_us_per_call']:.2f} us each (a hooked Linear(256, 256) against a plain one).", "",
                  "| monitor | pairs | (a) monitor CPU / step CPU (raw) | (a) monitor ms per step | step ms without |"
                  " (b) on-block / neighbouring off-blocks: median | (b) mean |", "|---|---|---|---|---|---|---|"]
        lines += _config_rows(part, lambda config, c, fraction, ratios: (
            f"| `{config}` | {c['pairs']} | {fraction} ({c['fraction_raw_median']:.3%}) |"
            f" {c['monitor_ms_median']:.4f} | {c['step_ms_off_median']:.3f} | {ratios}"))
        lines.append("")
    for name, part in results.get("overhead", {}).items():
        lines += [f"## Overhead, {name}: {len(part['rounds'])} paired rounds of {part['steps_per_run']} steps"
                  f" (step without the monitor: {part['step_ms_off_median']:.3f} ms CPU, median)", "",
                  "| config | (a) monitor CPU / step CPU | (a) monitor ms per step | (b) whole step / off:"
                  " median | (b) mean |", "|---|---|---|---|---|"]
        lines += _config_rows(part, lambda config, c, fraction, ratios: (
            f"| `{config}` | {fraction} | {c['monitor_ms_median']:.4f} | {ratios}"))
        if "monitor_ms_on_over_base_median" in part:
            lo, hi = part["monitor_ms_on_over_base_ci95"]
            lines.append(f"\nMonitor CPU time, `on` / `base`, paired per round: "
                         f"{part['monitor_ms_on_over_base_median']:.3f} [{lo:.3f}, {hi:.3f}].")
        lines.append("")
    return "\n".join(lines)


def _config_rows(part: dict, row) -> list[str]:
    """A table row per measured config (``on``, then ``base`` if run): ``row(config, results, fraction, ratios)``
    with the (a) fraction and the (b) ratio cells (median and mean with their 95% intervals) formatted."""
    lines = []
    for config in ("on", "base"):
        if config in part:
            c = part[config]
            (flo, fhi), (lo, hi), (mlo, mhi) = c["fraction_median_ci95"], c["ratio_median_ci95"], c["ratio_mean_ci95"]
            fraction = f"{c['fraction_median']:.3%} [{flo:.3%}, {fhi:.3%}]"
            ratios = f"{c['ratio_median']:.4f} [{lo:.4f}, {hi:.4f}] | {c['ratio_mean']:.4f} [{mlo:.4f}, {mhi:.4f}] |"
            lines.append(row(config, c, fraction, ratios))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("profile", "blocks", "overhead", "all"), default="all",
                        help="all: profile and blocks (overhead: whole fits per config, noisier)")
    parser.add_argument("--runs", type=int, default=6, help="fits of --block-steps steps (blocks part)")
    parser.add_argument("--idle-only", action="store_true", help="blocks part: hooks that never sample")
    parser.add_argument("--null", action="store_true", help="blocks part: an A/A check, the hooks off in all blocks")
    parser.add_argument("--empty-hooks", action="store_true", help="blocks part: no-op hooks in the on-blocks")
    parser.add_argument("--reads", action="store_true",
                        help="blocks part: with OverflowMonitor, which reads runaway_layers() after each new sample")
    parser.add_argument("--block-steps", type=int, default=None,
                        help=f"steps per fit in the blocks part (default per workload: {BLOCK_STEPS})")
    parser.add_argument("--workloads", default="mlp")
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--steps", type=int, default=110)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--baseline", default=None, help="another growth.py, run as config 'base' in the rounds")
    parser.add_argument("--out", default=None, help="file stem (default bench/results/growth_overhead[_quick])")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if args.quick:
        args.rounds, args.steps, args.runs, args.block_steps = 2, 30, 2, args.block_steps or 100
    results: dict[str, Any] = {"environment": environment()}
    print(json.dumps(results["environment"]), flush=True)
    for name in args.workloads.split(","):
        if args.part in ("profile", "all"):
            results.setdefault("profile", {})[name] = profile(name, repeats=1 if args.quick else 5)
            print(json.dumps(results["profile"][name]), flush=True)
        if args.part in ("blocks", "all"):
            baseline = load_baseline(args.baseline) if args.baseline else None
            steps = args.block_steps or BLOCK_STEPS[name]
            results.setdefault("blocks", {})[name] = blocks(name, args.runs, steps, baseline,
                                                            every=10**9 if args.idle_only else EVERY,
                                                            null=args.null, empty=args.empty_hooks,
                                                            reads=args.reads)
        if args.part == "overhead":
            baseline = load_baseline(args.baseline) if args.baseline else None
            results.setdefault("overhead", {})[name] = overhead(name, args.rounds, args.steps, baseline)
    results["environment"]["loadavg_end"] = os.getloadavg()
    stem = Path(args.out) if args.out else RESULTS / ("growth_overhead_quick" if args.quick else "growth_overhead")
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.json").write_text(json.dumps(results, indent=1))  # stem may hold dots
    Path(f"{stem}.md").write_text(markdown(results) + "\n")
    print(markdown(results))


if __name__ == "__main__":
    main()

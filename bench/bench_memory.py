"""Memory of the *-true modes through the Trainer: FP32 masters, Kahan-compensated and stochastically rounded 16-bit
weights, 8-bit AdamW states (torchao's ``+8bit``, bitsandbytes' ``+bnb8bit``), against Lightning's own 32-true and
bf16-true, in one run.

Per config: peak tensor memory of one training step (``lit_mpstable.core.weights.memory.MemoryProbe``: resident state
plus the step's own allocations, profiled) and process CPU time per step (median over the steps of a run after warm-up,
then the median over alternating rounds of the per-round ratio to Lightning's bf16-true).

    .venv/bin/python bench/bench_memory.py --rounds 9      # ~8 min on 2 shared cores
    .venv/bin/python bench/bench_memory.py --quick         # smoke run
    .venv/bin/python bench/bench_memory.py --configs SP-kahan,SP-stochastic --kinds mlp --rounds 9 --out /tmp/m

Before and after a change, in one run (``--ab``): each round runs one child process per tree (this one and the given
one, in alternating order), each child every config once per workload, so every ratio to Lightning's bf16-true is
paired inside one process and one time window; the ratio of the two trees' ratios is paired by round. CPU time only.

    .venv/bin/python bench/bench_memory.py --ab /path/to/main --configs SP-kahan,SP-stochastic --rounds 6 --steps 10

Where a step's CPU time goes, phase by phase (``--phases``; BENCH_MEMORY_TREE=/path/to/other measures another tree):

    .venv/bin/python bench/bench_memory.py --phases --kinds mlp --configs SP-kahan,SP-stochastic --rounds 4 --steps 14

The Python of ``CompactWeights.step_`` alone (``--step-python``), and what the gradients' inf/NaN check costs after
backward vs folded into backward by hooks (``--check-costs``, MLP):

    .venv/bin/python bench/bench_memory.py --step-python --steps 200
    .venv/bin/python bench/bench_memory.py --check-costs --rounds 60
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_flags  # noqa: E402

# The lit_mpstable to measure: this tree's, or the one an --ab run names for its child processes.
sys.path.insert(0, os.environ.get("BENCH_MEMORY_TREE") or str(Path(__file__).resolve().parent.parent))
from lit_mpstable import StablePrecision  # noqa: E402
from lit_mpstable.app.zoo import GPT  # noqa: E402
from lit_mpstable.core.weights.memory import MemoryProbe  # noqa: E402

TRAINER = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               num_sanity_val_steps=0, accelerator="cpu", devices=1)


def _adamw8bit(params: Any, lr: float) -> torch.optim.Optimizer:
    from torchao.optim import AdamW8bit

    return AdamW8bit(params, lr=lr)


def _bnb_adamw8bit(params: Any, lr: float) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr=lr)


class Workload(pl.LightningModule):
    def __init__(self, kind: str, optimizer: Callable[..., torch.optim.Optimizer]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.make_optimizer = kind, optimizer
        if kind == "gpt":  # lit_mpstable.app.zoo.GPT: d_model 256, 4 layers, seq 128, batch 8
            self.net = GPT(vocab_size=256, d_model=256, n_layers=4, n_heads=4, seq_len=128)
            g = torch.Generator().manual_seed(0)
            stream = torch.randint(1, 5, (64 * 128 + 1,), generator=g).cumsum(0) % 256
            self.data = (stream[:-1].view(64, 128), stream[1:].view(64, 128))
            self.batch = 8
        else:  # parameter-dominated: 784-1024x3-10, batch 256
            self.net = nn.Sequential(nn.Linear(784, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
                                     nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10))
            g = torch.Generator().manual_seed(0)
            self.data = (torch.randn(2048, 784, generator=g), torch.randint(0, 10, (2048,), generator=g))
            self.batch = 256

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*self.data), batch_size=self.batch)

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters(), lr=1e-3)


CONFIGS: dict[str, tuple[Callable[[], dict[str, Any]], Callable[..., torch.optim.Optimizer]]] = {
    "L-32-true": (lambda: {"precision": "32-true"}, torch.optim.AdamW),
    "L-bf16-true": (lambda: {"precision": "bf16-true"}, torch.optim.AdamW),
    "SP-masters": (lambda: {"plugins": [StablePrecision("bf16-true")]}, torch.optim.AdamW),
    "SP-kahan": (lambda: {"plugins": [StablePrecision("bf16-true", master_weights="kahan")]}, torch.optim.AdamW),
    "SP-stochastic": (lambda: {"plugins": [StablePrecision("bf16-true", master_weights="stochastic")]},
                      torch.optim.AdamW),
    "L-bf16-true+8bit": (lambda: {"precision": "bf16-true"}, _adamw8bit),
    "SP-kahan+8bit": (lambda: {"plugins": [StablePrecision("bf16-true", master_weights="kahan")]}, _adamw8bit),
    "SP-stochastic+8bit": (lambda: {"plugins": [StablePrecision("bf16-true", master_weights="stochastic")]},
                           _adamw8bit),
    "L-bf16-true+bnb8bit": (lambda: {"precision": "bf16-true"}, _bnb_adamw8bit),
    "SP-kahan+bnb8bit": (lambda: {"plugins": [StablePrecision("bf16-true", master_weights="kahan")]}, _bnb_adamw8bit),
    "SP-stochastic+bnb8bit": (lambda: {"plugins": [StablePrecision("bf16-true", master_weights="stochastic")]},
                              _bnb_adamw8bit),
}


class Meter(pl.Callback):
    def __init__(self, memory_step: int | None) -> None:
        self.memory_step, self.cpu, self.peak, self._start, self._probe = memory_step, [], None, 0.0, None
        self.loss = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.memory_step:
            self._probe = MemoryProbe()
            plugin = trainer.precision_plugin
            self._probe.start(pl_module, trainer.optimizers, getattr(plugin, "state_tensors", list)())
        self._start = time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.cpu.append(time.process_time() - self._start)
        self.loss = float(outputs["loss"] if isinstance(outputs, dict) else outputs)
        if self._probe is not None:
            self._probe.stop()
            self.peak, self._probe = self._probe.peak_bytes, None


def run(kind: str, name: str, steps: int, memory_step: int | None) -> Meter:
    trainer_kwargs, optimizer = CONFIGS[name]
    meter = Meter(memory_step)
    module = Workload(kind, optimizer)
    trainer = pl.Trainer(max_steps=steps, callbacks=[meter], **TRAINER, **trainer_kwargs())
    trainer.fit(module)
    return meter


# The phases --phases times (thread CPU time, summed per step; indented ones run inside the one above): where an
# attribute is missing (another version of the package), the row stays empty.
PHASES = [
    ("lightning.pytorch.loops.optimization.automatic", "Closure.closure", "forward + backward (Lightning's closure)"),
    ("torch.optim.optimizer", "Optimizer.zero_grad", "  zero_grad (L: frees the last gradients)"),
    ("lit_mpstable.frontends.trainer", "StablePrecision.pre_backward", "  pre_backward (SP: scale the loss)"),
    ("torch.autograd", "backward", "  torch.autograd.backward"),
    ("torch.optim.adam", "_single_tensor_adam", "torch's Adam arithmetic (L-bf16-true)"),
    ("lit_mpstable.core.step.stepper", "PrecisionStepper.unscale_", "stepper.unscale_"),
    ("lit_mpstable.core.scaling.loss_scaler", "DynamicLossScaler.check_",
     "  scaler.check_: the gradients' inf/NaN check"),
    ("lit_mpstable.core.step.stepper", "PrecisionStepper.step", "stepper.step"),
    ("lit_mpstable.core.step.stepper", "check_step_inputs_", "  step-input check (gradients written since, a share)"),
    ("lit_mpstable.core.step.stepper", "Iteration.update_scale_", "  scale update"),
    ("lit_mpstable.core.weights.compact", "CompactWeights.step_", "  CompactWeights.step_"),
    ("lit_mpstable.core.weights.compact", "CompactWeights._pieces", "    _pieces: which parameters the kernel takes"),
    ("lit_mpstable.core.weights.compact", "CompactWeights._step_fused_", "    _step_fused_"),
    ("lit_mpstable.core.weights.compact_fused", "keys", "      random keys"),
    ("lit_mpstable.core.weights.compact_fused", "FusedAdam.scalars", "      kernel scalars"),
    ("lit_mpstable.core.weights.compact_fused", "FusedAdam.run_",
     "      kernel calls (the C loop on a CPU, else compiled)"),
    ("torch.optim.adamw", "AdamW.step", "AdamW.step (L: around the closure; SP: empty groups)"),
]


def phases(kinds: list[str], names: list[str], steps: int, rounds: int, out: Path) -> None:
    """Per-phase CPU time of a step (:data:`PHASES`), each config ``rounds`` times in alternating order; the median
    over the steps after two of warm-up of every run. The timers add ~2 us per timed call."""
    import functools
    import importlib

    spent: dict[str, float] = {}

    def timed(function: Callable[..., Any], label: str) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.thread_time() - start
        return wrapper

    for module_name, path, label in PHASES:
        owner: Any = importlib.import_module(module_name)
        *outer, attr = path.split(".")
        for name in outer:
            owner = getattr(owner, name, None)
        if owner is not None and hasattr(owner, attr):
            setattr(owner, attr, timed(getattr(owner, attr), label))

    class PhaseMeter(pl.Callback):
        def __init__(self) -> None:
            self.rows: list[dict[str, float]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            spent.clear()
            self._start = time.thread_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.rows.append({**spent, "whole step": time.thread_time() - self._start})

    load = os.getloadavg()
    lines = ["# Where a step's CPU time goes (bench/bench_memory.py --phases)", "",
             f"torch {torch.__version__}, 1 thread, {rounds} alternating runs of {steps} steps per config; thread CPU"
             " time, median over the steps after 2 of warm-up (ms). Load average at start:"
             f" {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}.", ""]
    for kind in kinds:
        rows: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for r in range(rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                trainer_kwargs, optimizer = CONFIGS[name]
                meter = PhaseMeter()
                trainer = pl.Trainer(max_steps=steps, callbacks=[meter], **TRAINER, **trainer_kwargs())
                trainer.fit(Workload(kind, optimizer))
                rows[name] += meter.rows[2:]
        labels = ["whole step"] + [label for _, _, label in PHASES]
        lines += [f"## {kind}", "", "| phase | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for label in labels:
            cells = [f"{1e3 * statistics.median(row.get(label, 0.0) for row in rows[name]):.3f}"
                     if any(label in row for row in rows[name]) else "" for name in names]
            if any(cells):
                lines.append(f"| {label.replace(' ', '&nbsp;', len(label) - len(label.lstrip()))} | "
                             + " | ".join(cells) + " |")
        lines.append("")
    out.mkdir(parents=True, exist_ok=True)
    (out / "phases.md").write_text("\n".join(lines))
    print("\n".join(lines))


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def child_round(kinds: list[str], names: list[str], steps: int, offset: int, repeats: int) -> None:
    """One --ab round in this process: every config ``repeats`` times per workload, in rotated (by ``offset``) then
    reversed order (ABC CBA: a drift hits all alike); prints each config's CPU seconds per step (median over the
    steps after two of warm-up in each of its runs) as one JSON line."""
    out: dict[str, dict[str, float]] = {}
    order = names[offset % len(names):] + names[: offset % len(names)]
    for kind in kinds:
        per_step: dict[str, list[float]] = {name: [] for name in names}
        for repeat in range(repeats):
            for name in order if repeat % 2 == 0 else order[::-1]:
                per_step[name] += run(kind, name, steps, memory_step=None).cpu[2:]
        out[kind] = {name: statistics.median(values) for name, values in per_step.items()}
    print("RESULT " + json.dumps(out), flush=True)


def ab(args: argparse.Namespace, kinds: list[str], names: list[str]) -> None:
    """Before (``--ab`` tree) and after (this tree) in one run; see the module docstring."""
    trees = {"before": str(Path(args.ab).resolve()), "after": str(Path(__file__).resolve().parent.parent)}
    load, flags = os.getloadavg(), cpu_flags()
    print(f"load average at start: {load}; CPU flags: {flags}", flush=True)
    cpu: dict[str, dict[str, dict[str, list[float]]]] = {
        t: {k: {n: [] for n in names} for k in kinds} for t in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for tree in order:
            command = [sys.executable, str(Path(__file__).resolve()), "--child", "--offset", str(r), "--steps",
                       str(args.steps), "--kinds", ",".join(kinds), "--configs", ",".join(names), "--repeats",
                       str(args.repeats)]
            env = {**os.environ, "BENCH_MEMORY_TREE": trees[tree], "PYTHONPATH": trees[tree]}
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
            for kind, row in json.loads(line[len("RESULT "):]).items():
                for name, value in row.items():
                    cpu[tree][kind][name].append(value)
        print(f"  round {r + 1}/{args.rounds} done", flush=True)
    base = "L-bf16-true"
    results: dict[str, Any] = {}
    lines = ["# Compact weights before and after, in one run (bench/bench_memory.py --ab)", "",
             f"torch {torch.__version__}, 1 thread, {args.rounds} rounds; each round one child process per tree"
             f" (alternating which goes first), each child every config {args.repeats}x per workload (ABC CBA;"
             f" {args.steps} steps a run, CPU time per step: median of the steps after 2 of warm-up in each run)."
             " Ratios to Lightning's bf16-true are paired inside a child; after/before is paired by round."
             " Median [IQR].", "",
             f"load average at start: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}; CPU flags: {flags};"
             f" before = {trees['before']}", ""]
    for kind in kinds:
        results[kind] = {}
        lines += [f"## {kind}", "", "| config | before ms/step | after ms/step | before x L-bf16-true |"
                  " after x L-bf16-true | after / before |", "|---|---|---|---|---|---|"]
        for name in names:
            ratio = {t: [a / b for a, b in zip(cpu[t][kind][name], cpu[t][kind][base])] for t in trees}
            change = [a / b for a, b in zip(cpu["after"][kind][name], cpu["before"][kind][name])]
            row = {"cpu_ms": {t: 1e3 * statistics.median(cpu[t][kind][name]) for t in trees},
                   "vs_bf16_true": {t: statistics.median(ratio[t]) for t in trees},
                   "vs_bf16_true_iqr": {t: _quartiles(ratio[t]) for t in trees},
                   "after_over_before": statistics.median(change), "after_over_before_iqr": _quartiles(change),
                   "raw_cpu_s": {t: cpu[t][kind][name] for t in trees}}
            results[kind][name] = row
            cell = {t: f"{row['vs_bf16_true'][t]:.3f} [{row['vs_bf16_true_iqr'][t][0]:.3f},"
                       f" {row['vs_bf16_true_iqr'][t][1]:.3f}]" for t in trees}
            lines.append(f"| {name} | {row['cpu_ms']['before']:.1f} | {row['cpu_ms']['after']:.1f} |"
                         f" {cell['before']} | {cell['after']} | {row['after_over_before']:.3f}"
                         f" [{row['after_over_before_iqr'][0]:.3f}, {row['after_over_before_iqr'][1]:.3f}] |")
        lines.append("")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "rounds": args.rounds, "steps": args.steps, "repeats": args.repeats,
            "threads": 1, "load_average_at_start": load, "load_average_at_end": os.getloadavg(), "trees": trees,
            "cpu_flags": flags,
            "command": "bench/bench_memory.py " + " ".join(sys.argv[1:])}
    (out / "compact_ab.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    (out / "compact_ab.md").write_text("\n".join(lines))
    print("\n".join(lines))


def step_python(kinds: list[str], calls: int) -> None:
    """``CompactWeights.step_`` alone on each workload's BF16 parameters (AdamW, random gradients, "kahan"), the
    fused kernel's calls replaced by no-ops after one real step: the Python around them, warm, per call (thread CPU
    time, median of ``calls`` after 20 of warm-up). BENCH_MEMORY_TREE=/path/to/other measures another tree."""
    from lit_mpstable.core.weights.compact import CompactWeights
    from lit_mpstable.core.weights.compact_fused import FusedAdam

    real = FusedAdam.run_
    for kind in kinds:
        net = Workload(kind, torch.optim.AdamW).net.bfloat16()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        weights = CompactWeights(net, [opt], "kahan")
        grads = [torch.randn_like(p) for p in net.parameters()]
        multiplier, times = torch.tensor(2.0**-16), []
        for call in range(calls + 21):
            for p, g in zip(net.parameters(), grads):
                p.grad = g
            FusedAdam.run_ = real if call == 0 else (lambda *args, **kwargs: None)  # type: ignore[method-assign]
            start = time.thread_time()
            weights.step_(opt, grad_multiplier=multiplier)
            times.append(time.thread_time() - start)
        FusedAdam.run_ = real  # type: ignore[method-assign]
        print(f"{kind}: CompactWeights.step_ without its kernel calls: {1e6 * statistics.median(times[21:]):.1f} us"
              f" ({len(grads)} parameters; load average {os.getloadavg()[0]:.2f})", flush=True)


def check_costs(rounds: int) -> None:
    """What the gradients' inf/NaN check costs on the MLP (784-1024x3-10, batch 256, BF16), done after backward
    (``loss_scaler.nonfinite_on_cpu``, as the step does) or folded into backward by a post-accumulate-grad hook per
    parameter (``torch.aminmax`` of each gradient while it is in cache), against no check: forward + backward + check,
    thread CPU time, the three alternating, median over ``rounds`` of the difference to no check. Then exact and
    inexact reductions of one 1M-element BF16 tensor (hot)."""
    from lit_mpstable.core.scaling.loss_scaler import nonfinite_on_cpu

    net = Workload("mlp", torch.optim.AdamW).net.bfloat16()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x, y = torch.randn(256, 784).bfloat16(), torch.randint(0, 10, (256,))
    params, bounds, hooked = list(net.parameters()), {}, [False]

    def hook(p: torch.Tensor) -> None:
        if hooked[0]:
            bounds[id(p)] = torch.aminmax(p.grad)

    for p in params:
        p.register_post_accumulate_grad_hook(hook)
    spent: dict[str, list[float]] = {"none": [], "after backward": [], "hooks": []}
    for r in range(rounds + 4):
        for mode in list(spent) if r % 2 else list(spent)[::-1]:
            hooked[0] = mode == "hooks"
            for p in params:
                p.grad = None
            start = time.thread_time()
            F.cross_entropy(net(x).float(), y).backward()
            if mode == "after backward":
                nonfinite_on_cpu(opt)
            elif mode == "hooks":
                torch.stack([b for p in params for b in bounds[id(p)]]).isfinite().all()
            if r >= 4:
                spent[mode].append(time.thread_time() - start)
    for mode in ("after backward", "hooks"):
        extra = [a - b for a, b in zip(spent[mode], spent["none"])]
        print(f"check {mode}: +{1e3 * statistics.median(extra):.3f} ms over no check (forward + backward"
              f" {1e3 * statistics.median(spent['none']):.2f} ms)", flush=True)
    g = torch.randn(2**20).bfloat16()
    candidates: dict[str, Callable[[], Any]] = {
        "sum (exact up to FP32's range; the check's for BF16/FP32)": lambda: g.sum(),
        "aminmax (exact; the check's for FP16)": lambda: torch.aminmax(g),
        "max (NaN and +inf only)": lambda: g.max(),
        "_foreach_max (NaN and +inf only)": lambda: torch._foreach_max([g]),
        "GradScaler's check-and-unscale kernel (exact, writes back)":
            lambda: torch._amp_foreach_non_finite_check_and_unscale_([g], torch.zeros(()), torch.ones(())),
        "isfinite().all() (exact)": lambda: torch.isfinite(g).all(),
        "int16 view: aminmax (not exact: -inf/-NaN bits sit mid-range)": lambda: torch.aminmax(g.view(torch.int16)),
        "int16 view: & 0x7F80, max (exact)": lambda: torch.bitwise_and(g.view(torch.int16), 0x7F80).max(),
    }
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(20):
        for name, function in candidates.items():
            start = time.thread_time()
            function()
            times[name].append(time.thread_time() - start)
    for name, values in times.items():
        print(f"1M BF16 elements, {name}: {1e6 * statistics.median(values):.0f} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ab", metavar="TREE", help="another lit_mpstable checkout to compare with (before)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--offset", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=2, help="--ab: runs of each config per child (ABC CBA)")
    parser.add_argument("--phases", action="store_true", help="per-phase CPU time of a step instead (phases.md)")
    parser.add_argument("--step-python", action="store_true",
                        help="the Python of CompactWeights.step_ alone (kernel calls as no-ops), --steps calls")
    parser.add_argument("--check-costs", action="store_true",
                        help="the gradients' inf/NaN check after backward vs in post-accumulate-grad hooks (MLP)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory"))
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="comma-separated subset of the configs (L-bf16-true is always run; L-32-true too, but"
                             " with --ab or --phases)")
    parser.add_argument("--kinds", default="mlp,gpt", help="comma-separated workloads: mlp, gpt")
    args = parser.parse_args()
    always = {"L-bf16-true"} if args.ab or args.child or args.phases else {"L-32-true", "L-bf16-true"}
    chosen = [name for name in CONFIGS if name in {*always, *args.configs.split(",")}]
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        parser.error(f"--configs: unknown {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    kinds = args.kinds.split(",")
    if not kinds or set(kinds) - {"mlp", "gpt"}:
        parser.error(f"--kinds={args.kinds!r}: a comma-separated subset of mlp, gpt")
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if args.child:
        return child_round(kinds, chosen, args.steps, args.offset, args.repeats)
    if args.ab:
        return ab(args, kinds, chosen)
    if args.phases:
        return phases(kinds, chosen, args.steps, args.rounds, Path(args.out))
    if args.step_python:
        return step_python(kinds, args.steps)
    if args.check_costs:
        return check_costs(args.rounds)
    rounds, steps = (1, 4) if args.quick else (args.rounds, args.steps)
    results: dict[str, Any] = {}
    load = os.getloadavg()
    print(f"load average at start: {load}", flush=True)
    for kind in kinds:
        names = chosen
        peaks = {name: run(kind, name, 4, memory_step=2).peak for name in names}
        cpu: dict[str, list[float]] = {name: [] for name in names}
        losses: dict[str, float] = {}
        for r in range(rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:  # alternate: drift hits all alike
                meter = run(kind, name, steps, memory_step=None)
                cpu[name].append(statistics.median(meter.cpu[2:]))
                losses[name] = meter.loss
            print(f"  [{kind}] round {r + 1}/{rounds} done", flush=True)
        base = "L-bf16-true"
        rows = {}
        for name in names:
            ratios = [a / b for a, b in zip(cpu[name], cpu[base])]
            rows[name] = {
                "peak_mib": peaks[name] / 2**20, "peak_vs_fp32": peaks[name] / peaks["L-32-true"],
                "peak_vs_bf16_true": peaks[name] / peaks[base], "cpu_ms": 1e3 * statistics.median(cpu[name]),
                "time_vs_bf16_true": statistics.median(ratios),
                "time_vs_bf16_true_iqr": [statistics.quantiles(ratios, n=4)[0], statistics.quantiles(ratios, n=4)[2]]
                if len(ratios) > 1 else [ratios[0], ratios[0]],
                "final_loss": losses[name],
            }
        results[kind] = rows
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "rounds": rounds, "steps": steps, "threads": 1,
            "load_average_at_start": load, "command": "bench/bench_memory.py " + " ".join(sys.argv[1:])}
    (out / "memory.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    lines = ["# Memory of the *-true modes (bench/bench_memory.py)", "",
             f"torch {torch.__version__}, 1 thread, {rounds} alternating rounds of {steps} steps; peak tensor memory of"
             " step 2 (resident state + the step's allocations, torch.profiler); CPU time per step, median of the"
             " per-round ratio to Lightning's bf16-true [IQR].", ""]
    titles = {"mlp": "MLP 784-1024x3-10, batch 256 (parameter-dominated)",
              "gpt": "lit_mpstable.app.zoo.GPT, d_model 256, 4 layers, seq 128, batch 8"}
    for kind, rows in results.items():
        lines += [f"## {titles[kind]}", "", "| config | peak MiB | x FP32 peak | x L-bf16-true peak | CPU ms/step |"
                  " x L-bf16-true time | loss after the run |", "|---|---|---|---|---|---|---|"]
        for name, row in rows.items():
            iqr = row["time_vs_bf16_true_iqr"]
            lines.append(f"| {name} | {row['peak_mib']:.1f} | {row['peak_vs_fp32']:.3f} |"
                         f" {row['peak_vs_bf16_true']:.3f} |"
                         f" {row['cpu_ms']:.1f} | {row['time_vs_bf16_true']:.3f} [{iqr[0]:.3f}, {iqr[1]:.3f}] |"
                         f" {row['final_loss']:.4f} |")
        lines.append("")
    (out / "memory.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

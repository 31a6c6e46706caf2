"""Memory of the *-true modes through the Trainer: FP32 masters, Kahan-compensated and stochastically rounded 16-bit
weights, 8-bit AdamW states (torchao's ``+8bit``, bitsandbytes' ``+bnb8bit``), against Lightning's own 32-true and
bf16-true, in one run.

Per config: peak tensor memory of one training step (``lit_mpstable.core.memory.MemoryProbe``: resident state plus the
step's own allocations, profiled) and process CPU time per step (median over the steps of a run after warm-up,
then the median over alternating rounds of the per-round ratio to Lightning's bf16-true).

    .venv/bin/python bench/bench_memory.py --rounds 9      # ~8 min on 2 shared cores
    .venv/bin/python bench/bench_memory.py --quick         # smoke run
    .venv/bin/python bench/bench_memory.py --configs SP-kahan,SP-stochastic --kinds mlp --rounds 9 --out /tmp/m
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lit_mpstable import StablePrecision  # noqa: E402
from lit_mpstable.app.zoo import GPT  # noqa: E402
from lit_mpstable.core.memory import MemoryProbe  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory"))
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="comma-separated subset of the configs (L-32-true and L-bf16-true are always run)")
    parser.add_argument("--kinds", default="mlp,gpt", help="comma-separated workloads: mlp, gpt")
    args = parser.parse_args()
    chosen = [name for name in CONFIGS if name in {"L-32-true", "L-bf16-true", *args.configs.split(",")}]
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

"""Shared pieces of the benchmarks: workloads (model + data), step timers, a peak-memory probe, statistics, tables."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import Transformer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = [
    "GPTSize",
    "MLPSize",
    "BenchModule",
    "Workload",
    "gpt_workload",
    "mlp_workload",
    "StepClock",
    "StepTimer",
    "MemoryProbe",
    "resident_bytes",
    "summary",
    "environment",
    "cpu_flags",
    "markdown_table",
    "TRAINER_DEFAULTS",
]

# The settings for every benchmark Trainer: nothing but the training loop itself.
TRAINER_DEFAULTS: dict[str, Any] = dict(
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    accelerator="cpu",
    devices=1,
)


# ------------------------------------------------------------------------------------------------ workloads
@dataclass(frozen=True)
class GPTSize:
    """lightning.pytorch.demos.Transformer sized so one bf16 step takes ~130 ms at 1 thread on the bench CPU.

    ``nlayers`` counts per stack: the demo model is encoder-decoder, so 2 means 2 + 2 = 4 transformer layers.
    """

    vocab: int = 2000
    d_model: int = 256
    nhead: int = 4
    nlayers: int = 2
    ffn: int = 1024
    seq: int = 64
    batch: int = 8
    dropout: float = 0.0  # no dropout: fewer RNG kernels, so step times vary less; the matmuls are the same


@dataclass(frozen=True)
class MLPSize:
    """A tiny MLP: so little compute that a loss scaler's per-step cost dominates the step."""

    d_in: int = 16
    hidden: int = 32
    d_out: int = 16
    batch: int = 16


class BenchModule(pl.LightningModule):
    """One LightningModule for every config; the raw loops call the same ``loss`` and ``configure_optimizers``."""

    def __init__(self, net: nn.Module, task: str, lr: float) -> None:
        super().__init__()
        self.net, self.task, self.lr = net, task, lr
        self.last_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """``(inputs, targets)`` as the batch holds them (AMPPreflight calls this); the demo model needs both."""
        return self.net(x, y) if self.task == "lm" else self.net(x)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        if self.task == "lm":
            return F.nll_loss(self.net(x, y), y.reshape(-1))  # the demo model returns log-probabilities
        return F.mse_loss(self.net(x).float(), y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.last_loss = loss.detach()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


@dataclass
class Workload:
    """A freshly seeded model and the data for one run of ``steps`` steps (every config starts identical)."""

    module: BenchModule
    loader: DataLoader
    tokens_per_step: int


def token_windows(vocab: int, seq: int, n: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` (input, next-token target) windows of length ``seq`` from a deterministic synthetic token stream:
    a random walk mod ``vocab``, so the next token is learnable."""
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(1, 5, (n * seq + 1,), generator=g).cumsum(0) % vocab
    windows = stream[: n * seq + 1].unfold(0, seq + 1, seq)[:n]
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def gpt_workload(size: GPTSize, steps: int, *, seed: int = 0) -> Workload:
    """The demo Transformer on a deterministic synthetic token stream (a random walk mod vocab: learnable)."""
    x, y = token_windows(size.vocab, size.seq, steps * size.batch, seed=seed)
    torch.manual_seed(seed)
    net = Transformer(
        vocab_size=size.vocab, ninp=size.d_model, nhead=size.nhead, nhid=size.ffn, nlayers=size.nlayers,
        dropout=size.dropout,
    )
    module = BenchModule(net, "lm", lr=3e-4)
    loader = DataLoader(TensorDataset(x, y), batch_size=size.batch, shuffle=False)
    return Workload(module, loader, size.batch * size.seq)


def mlp_workload(size: MLPSize, steps: int, *, seed: int = 0) -> Workload:
    """A 3-layer MLP on a fixed linear-regression task."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps * size.batch, size.d_in, generator=g)
    w = torch.randn(size.d_in, size.d_out, generator=g) / size.d_in**0.5
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Linear(size.d_in, size.hidden), nn.ReLU(), nn.Linear(size.hidden, size.hidden), nn.ReLU(),
        nn.Linear(size.hidden, size.d_out),
    )
    module = BenchModule(net, "mse", lr=1e-3)
    loader = DataLoader(TensorDataset(x, x @ w), batch_size=size.batch, shuffle=False)
    return Workload(module, loader, size.batch)


# --------------------------------------------------------------------------------------------------- timing
class StepClock:
    """Per-step wall time and process CPU time, each measured from the previous ``tick``.

    CPU time (``time.process_time``) leaves out the time the process waited for a core, so on a shared machine it
    shows the work a config does; wall time is what a user waits for. Both are kept.
    """

    def __init__(self) -> None:
        self.wall_s: list[float] = []
        self.cpu_s: list[float] = []
        self._last: tuple[float, float] | None = None

    def start(self) -> None:
        if self._last is None:
            self._last = (time.perf_counter(), time.process_time())

    def tick(self) -> None:
        now = (time.perf_counter(), time.process_time())
        assert self._last is not None, "StepClock.tick() before start()"
        self.wall_s.append(now[0] - self._last[0])
        self.cpu_s.append(now[1] - self._last[1])
        self._last = now


class StepTimer(pl.Callback):
    """Times every training step end to end: from one ``on_train_batch_end`` to the next.

    So a step includes fetching its batch and all of Lightning's per-step work, as the raw loops' steps do.
    """

    def __init__(self) -> None:
        self.clock = StepClock()
        self.threads: int | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.threads = torch.get_num_threads()  # proves Lightning did not change the thread count

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.clock.start()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.clock.tick()


# --------------------------------------------------------------------------------------------------- memory
# The probe lives in the package (lit_mpstable.core.weights.memory) so train.py reports the same number.
from lit_mpstable.core.weights.memory import MemoryProbe, resident_bytes  # noqa: E402


class MemoryCallback(pl.Callback):
    """Runs a :class:`MemoryProbe` around training step ``step`` (0-based) of a Lightning fit."""

    def __init__(self, step: int) -> None:
        self.step, self.probe = step, MemoryProbe()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.step:
            self.probe.start(pl_module, trainer.optimizers)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.step:
            self.probe.stop()


# ----------------------------------------------------------------------------------------------- statistics
def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles (inclusive method: with 2 values they lie between them), extremes and count."""
    values = list(values)
    q1, q3 = (values[0], values[0]) if len(values) == 1 else statistics.quantiles(values, n=4, method="inclusive")[::2]
    median = statistics.median(values)
    return {"median": median, "q1": q1, "q3": q3, "min": min(values), "max": max(values), "n": len(values)}


def environment() -> dict[str, Any]:
    """What a reader needs to judge the numbers: versions, CPU, threads, load."""
    import lightning

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "argv": sys.argv,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def cpu_flags() -> str:
    """The CPU's vector-unit flags that decide the kernels' speed (inductor's and ATen's), from /proc/cpuinfo."""
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16")
    try:
        with open("/proc/cpuinfo") as f:
            line = next(x for x in f if x.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    have = set(line.split(":", 1)[1].split())
    return " ".join(flag for flag in wanted if flag in have) or "none of " + " ".join(wanted)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_iqr(s: dict[str, float] | None, digits: int = 3, scale: float = 1.0) -> str:
    """``median [q1, q3]``; ``n/a`` when there is nothing to show."""
    if s is None:
        return "n/a"
    return f"{s['median'] * scale:.{digits}f} [{s['q1'] * scale:.{digits}f}, {s['q3'] * scale:.{digits}f}]"


StepFn = Callable[[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]

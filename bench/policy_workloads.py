"""Workloads for the per-op precision policy benchmarks: a GPT whose attention is F.scaled_dot_product_attention
(lit_mpstable.app.zoo.GPT), and a small CNN (convolutions + batch norm). The MLP is common.mlp_workload."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from common import BenchModule, Workload, token_windows
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_mpstable.app.zoo import GPT

__all__ = ["SDPAGPTSize", "CNNSize", "LogitsModule", "sdpa_gpt_workload", "cnn_workload"]


@dataclass(frozen=True)
class SDPAGPTSize:
    """lit_mpstable.app.zoo.GPT as the issue measured it: 4 layers, d=256, seq 128 (attention is a real share)."""

    vocab: int = 256  # byte-level
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    seq: int = 128
    batch: int = 8


@dataclass(frozen=True)
class CNNSize:
    """Three 3x3 conv + batch-norm + ReLU stages on 32x32 RGB images, 10 classes."""

    channels: tuple[int, int, int] = (32, 64, 64)
    image: int = 32
    classes: int = 10
    batch: int = 32


class LogitsModule(BenchModule):
    """A BenchModule whose net returns logits: cross-entropy in FP32 (the loss is a reduction)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.net(x)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self.net(x).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def sdpa_gpt_workload(size: SDPAGPTSize, steps: int, *, seed: int = 0) -> Workload:
    """zoo.GPT (pre-norm, causal SDPA) on the harness's synthetic token stream (a random walk mod vocab)."""
    x, y = token_windows(size.vocab, size.seq, steps * size.batch, seed=seed)
    torch.manual_seed(seed)
    net = GPT(size.vocab, size.d_model, size.n_layers, size.n_heads, size.seq)
    loader = DataLoader(TensorDataset(x, y), batch_size=size.batch, shuffle=False)
    return Workload(LogitsModule(net, "logits", lr=3e-4), loader, size.batch * size.seq)


def cnn_workload(size: CNNSize, steps: int, *, seed: int = 0) -> Workload:
    """A small CNN on synthetic images whose class is the brightest of 10 fixed patterns (learnable)."""
    g = torch.Generator().manual_seed(seed)
    n = steps * size.batch
    patterns = torch.randn(size.classes, 3, size.image, size.image, generator=g)
    y = torch.randint(0, size.classes, (n,), generator=g)
    x = patterns[y] + 0.5 * torch.randn(n, 3, size.image, size.image, generator=g)
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    c_in = 3
    for i, c in enumerate(size.channels):
        layers += [nn.Conv2d(c_in, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
        layers += [nn.MaxPool2d(2)] if i < len(size.channels) - 1 else []
        c_in = c
    net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, size.classes))
    loader = DataLoader(TensorDataset(x, y), batch_size=size.batch, shuffle=False)
    return Workload(LogitsModule(net, "logits", lr=1e-3), loader, size.batch)

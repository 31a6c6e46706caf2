"""MemoryProbe reads a known allocation back, and counts FP32 masters held by an optimizer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lit_mpstable.core.weights.master import MasterWeights
from lit_mpstable.core.weights.memory import MemoryProbe, resident_bytes

MiB = 2**20


def test_known_allocation_reads_back() -> None:
    model = nn.Linear(256, 256, bias=False)  # 256 KiB of FP32 weights
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = MemoryProbe()
    probe.start(model, [opt])
    a = torch.empty(10 * MiB, dtype=torch.uint8)
    b = torch.empty(5 * MiB, dtype=torch.uint8)
    del a, b
    probe.stop()
    assert probe.resident == 256 * 256 * 4
    assert probe.peak_bytes - probe.resident == pytest.approx(15 * MiB, rel=0.01)


def test_resident_bytes_counts_masters_and_state() -> None:
    model = nn.Linear(64, 64, bias=False).bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    MasterWeights(model, [opt])
    model(torch.randn(4, 64, dtype=torch.bfloat16)).sum().backward()
    n = 64 * 64
    # bf16 weight + bf16 grad, FP32 master; no optimizer state before the first step.
    assert resident_bytes(model, [opt]) == n * 2 + n * 2 + n * 4


def test_stop_before_start_raises_runtime_error_naming_the_order() -> None:
    with pytest.raises(RuntimeError, match=r"MemoryProbe\.stop\(\) before start\(module, optimizers\)"):
        MemoryProbe().stop()

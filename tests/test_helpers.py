"""The test helpers that other tests trust: HostReads sees every way code reads a tensor's value on the host."""

from __future__ import annotations

import pytest
import torch
from helpers import HostReads

T = torch.tensor([1.0, 2.0])

READS = {
    "item": lambda: T[0].item(),
    "if tensor": lambda: 1 if T[0] else 0,
    "float": lambda: float(T[1]),
    "int": lambda: int(T[1]),
    "bool of any": lambda: bool((T > 1).any()),
    "equal": lambda: torch.equal(T, T),
    "nonzero": lambda: T.nonzero(),
    "mask index": lambda: T[T > 1],
    "mask assignment": lambda: T.clone().__setitem__(T > 1, 0.0),
    "tolist": lambda: T.tolist(),
    "numpy": lambda: T.numpy(),
    "unique": lambda: torch.unique(T),
}
CLEAN = {
    "arithmetic": lambda: (T * 2).sum(),
    "where": lambda: torch.where(T > 1, T, 0.0),
    "integer index": lambda: T[torch.tensor([0])],
    "shape": lambda: T.shape[0] + T.numel(),
}


@pytest.mark.parametrize("name", READS)
def test_host_reads_sees_every_read(name: str) -> None:
    with HostReads() as reads:
        READS[name]()
    assert reads.ops, name


@pytest.mark.parametrize("name", CLEAN)
def test_host_reads_leaves_device_work_alone(name: str) -> None:
    with HostReads() as reads:
        CLEAN[name]()
    assert reads.ops == []


def test_host_reads_restores_the_patched_methods() -> None:
    tolist, numpy = torch.Tensor.tolist, torch.Tensor.numpy
    with HostReads():
        pass
    assert torch.Tensor.tolist is tolist and torch.Tensor.numpy is numpy

"""Shared test setup: one thread, a fixed seed, the default dtype restored, GPU items skipped without CUDA."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import `helpers` as a plain module


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _determinism() -> None:
    # One thread: the machine is shared and 2 threads under load make tiny steps 100x slower.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


os.environ.setdefault("PYTHONHASHSEED", "0")

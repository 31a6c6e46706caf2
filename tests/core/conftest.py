"""Fixtures shared by the core tests."""

from __future__ import annotations

import pytest

from lit_mpstable.core.guards.spike import spike_kernel


@pytest.fixture(params=["native", "torch"])
def spike_guard_path(request, monkeypatch) -> str:
    """Runs a test twice: through SpikeGuard's C loops (:func:`~lit_mpstable.core.guards.spike.spike_kernel`, the CPU
    default where a C compiler builds them) and through its torch ops (every other device, a traced or compiled step,
    and a CPU without a compiler). The choice is made when a guard binds to the CPU."""
    monkeypatch.setenv("LIT_MPSTABLE_NATIVE", "1" if request.param == "native" else "0")
    if request.param == "native":
        assert spike_kernel() is not None  # CI and development machines have a C compiler
    return request.param

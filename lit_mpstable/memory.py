"""Peak tensor memory of one training step on the CPU, from ``torch.profiler``'s allocation events."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["MemoryProbe", "resident_bytes"]


def resident_bytes(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """Bytes held between steps: parameters, gradients, the optimizers' own parameters (FP32 masters) and their
    state; each storage counted once."""
    params = list(module.parameters()) + [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    tensors = params + [p.grad for p in params if p.grad is not None]
    tensors += [t for opt in optimizers for state in opt.state.values() for t in state.values() if torch.is_tensor(t)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@contextmanager
def _quiet_fd2() -> Iterator[None]:
    # Kineto prints "profiler_start/stop" lines straight to file descriptor 2; silence just those calls.
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class MemoryProbe:
    """Peak CPU tensor memory of one training step, from ``torch.profiler``'s allocation events.

    Gradients are dropped (``set_to_none``) just before the profiled step, as the step's own ``zero_grad`` would:
    the profiler cannot see frees of blocks allocated before it started. Peak = parameters, masters and optimizer
    state (resident) + the highest running sum of the step's allocations minus frees. RSS is too noisy for this and
    tracemalloc sees no tensors.
    """

    def __init__(self) -> None:
        self.resident = 0
        self.peak_bytes: int | None = None
        self._prof: torch.profiler.profile | None = None

    def start(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        for param in module.parameters():
            param.grad = None  # with FP32 masters the optimizers do not reach the 16-bit grads
        self.resident = resident_bytes(module, optimizers)
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        with _quiet_fd2():
            self._prof.__enter__()

    def stop(self) -> None:
        assert self._prof is not None, "MemoryProbe.stop() without start()"
        with _quiet_fd2():
            self._prof.__exit__(None, None, None)
        events = [e for e in self._prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        running = peak = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            running += event.nbytes()
            peak = max(peak, running)
        self.peak_bytes = self.resident + peak
        self._prof = None

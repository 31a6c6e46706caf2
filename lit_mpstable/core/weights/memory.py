"""Peak tensor memory of one training step on the CPU, from ``torch.profiler``'s allocation events."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn


def plain_tensors(value: object) -> list[torch.Tensor]:
    """The plain tensors holding ``value``'s data: itself, or for a wrapper subclass (torchao's 8-bit and FP8
    optimizer states, DTensor) its inner tensors, recursively; nothing for a non-tensor."""
    if not isinstance(value, torch.Tensor):
        return []
    if type(value) is torch.Tensor or type(value) is nn.Parameter or not hasattr(value, "__tensor_flatten__"):
        return [value]
    names, _ = value.__tensor_flatten__()
    return [t for name in names for t in plain_tensors(getattr(value, name))]


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the tensors' elements (not of their storages, nor allocator overhead)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def resident_bytes(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """Bytes held between steps: parameters, gradients, the optimizers' own parameters (FP32 masters) and their
    state; each storage counted once."""
    return training_memory(module, optimizers)["total"]


def training_memory(
    module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], *,
    extra: Mapping[str, Iterable[torch.Tensor]] | None = None,
) -> dict[str, int]:
    """Bytes of training state by kind, each storage counted once (in the first kind it appears in): ``weights`` (the
    model's parameters), ``masters`` (parameters the optimizers hold that are not the model's: FP32 masters),
    ``gradients`` (of both), ``optimizer_state`` (every tensor in the optimizers' ``state``, quantized states by
    their inner tensors; also the BF16/FP8 moment stores a weight keeper holds, given among ``extra``), then each
    ``extra`` kind (e.g. ``compensation``), and ``total``. Reads no device data."""
    from lit_mpstable.core.weights.moment_keeper import is_moment_tensor  # the moment stores count as optimizer state

    extras = {kind: list(tensors) for kind, tensors in (extra or {}).items()}
    moments = [t for tensors in extras.values() for t in tensors if is_moment_tensor(t)]
    seen: set[int] = set()

    def count(tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for tensor in tensors:
            for plain in plain_tensors(tensor):
                storage = plain.untyped_storage()
                key = storage.data_ptr() or id(storage)
                if key not in seen:
                    seen.add(key)
                    total += storage.nbytes()
        return total

    model_params = list(module.parameters())
    held = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    own = {id(p) for p in model_params}
    report = {
        "weights": count(model_params),
        "masters": count(p for p in held if id(p) not in own),
        "gradients": count(p.grad for p in (*model_params, *held) if p.grad is not None),
        "optimizer_state": count([*(v for opt in optimizers for state in opt.state.values() for v in state.values()),
                                  *moments]),
    }
    for kind, tensors in extras.items():
        report[kind] = count(tensors)
    report["total"] = sum(report.values())
    return report


@contextmanager
def quiet_fd2() -> Iterator[None]:
    """Silence file descriptor 2 inside the block (Kineto prints its profiler start/stop lines there)."""
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

    def start(
        self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], extra: Iterable[torch.Tensor] = ()
    ) -> None:
        """Profile from here; ``extra``: resident tensors neither the module nor the optimizers hold (a precision
        plugin's compensation buffers: ``plugin.state_tensors()``)."""
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        for param in module.parameters():
            param.grad = None  # with FP32 masters the optimizers do not reach the 16-bit grads
        self.resident = training_memory(module, optimizers, extra={"extra": extra})["total"]
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        with quiet_fd2():
            self._prof.__enter__()

    def stop(self) -> None:
        if self._prof is None:
            raise RuntimeError("MemoryProbe.stop() before start(module, optimizers): start() begins the profile.")
        with quiet_fd2():
            self._prof.__exit__(None, None, None)
        profiler = self._prof.profiler
        assert profiler is not None and profiler.kineto_results is not None  # both set by __enter__/__exit__ above
        events = [e for e in profiler.kineto_results.events() if e.name() == "[memory]"]
        running = peak = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            running += event.nbytes()  # type: ignore[attr-defined]  # torch's _KinetoEvent stub lacks nbytes()
            peak = max(peak, running)
        self.peak_bytes = self.resident + peak
        self._prof = None

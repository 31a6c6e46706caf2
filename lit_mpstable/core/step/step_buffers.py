"""The module's buffers across a step: a skipped step (or a rejected replay of it) leaves them as the step before
left them. A skip protects the weights by not calling ``optimizer.step()``; buffers that the forward itself writes
(BatchNorm's running statistics and batch count) need a copy from before the forward."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase


class StepBuffers:
    """Copies of a module's persistent buffers taken before a step's first training forward, written back when the
    step is skipped.

    Which buffers: the persistent ones (the module's ``state_dict``: BatchNorm's ``running_mean``, ``running_var``
    and ``num_batches_tracked``, any running average a model keeps). Non-persistent buffers are caches (masks,
    rotary tables) or precision state with rules of their own (an FP8 layer's amax history must keep the amax of an
    overflowing step to back its scale off), and are left alone.

    Which are copied: on the first step all of them; afterwards those of torch's norm layers with running statistics
    (BatchNorm, SyncBatchNorm, InstanceNorm: their kernel writes the statistics without moving the tensors' version
    counters) and those a step has been seen to change (their version counter moved between the first forward and
    the step's end: a host-side integer, no device read). A model whose forward writes no buffer then copies nothing;
    BatchNorm's statistics cost one small copy a step. A buffer of another module that changes for the first time on
    a later step is watched from then on (that step's change is not undone if it is skipped).

    The restore is a host-side decision on the path that already knows the step was skipped (the step's one host
    read), a ``copy_`` on the device: a clean step adds no host read.
    """

    def __init__(self) -> None:
        self._module: nn.Module | None = None
        self._slots: list[tuple[nn.Module, str]] = []  # (owning module, buffer name) of each persistent buffer
        self._norms: set[int] = set()  # slots of norm layers, whose statistics change without a version bump
        self._watched: set[int] | None = None  # slots a step was seen to change; None: nothing learned yet (all)
        self._versions: list[int] = []  # each slot's version counter when the copies were taken
        self._saved: dict[int, torch.Tensor] | None = None  # the copies of the step in progress; None: none taken
        self.copied = 0
        """Buffers copied at the start of the latest step (0 once the model is known to change none)."""

    def begin_(self, module: nn.Module | None) -> None:
        """Before a forward: copy the buffers if this is the step's first training forward (gradients enabled, not
        inference mode: validation forwards change no statistics and take no copy). Later forwards of the same step
        (micro-batches, a replay) keep the first copy."""
        if self._saved is not None or module is None:
            return
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return
        if module is not self._module:
            self._module, self._watched = module, None
            self._slots = [(owner, name) for owner in module.modules() for name, buffer in owner._buffers.items()
                           if buffer is not None and name not in owner._non_persistent_buffers_set]
            self._norms = {i for i, (owner, _) in enumerate(self._slots) if isinstance(owner, _NormBase)}
        if not self._slots:
            return
        buffers = self._buffers()
        self._versions = [_version(b) for b in buffers]
        watched = range(len(buffers)) if self._watched is None else self._watched
        with torch.no_grad():
            self._saved = {i: b.detach().clone() for i in watched if (b := buffers[i]) is not None}
        self.copied = len(self._saved)

    def end_(self, *, skipped: bool) -> None:
        """At the step's end: learn which buffers it changed and, if it was ``skipped``, write the copies back. The
        next training forward takes new copies."""
        saved, self._saved = self._saved, None
        if saved is None:
            return
        buffers = self._buffers()
        changed = {i for i, b in enumerate(buffers) if b is not None and _version(b) != self._versions[i]}
        changed |= self._norms
        self._watched = changed if self._watched is None else self._watched | changed
        if skipped:
            _write_back(buffers, saved)

    def restore_(self) -> bool:
        """Write the copies back now (a replay of the step was rejected, or the step is dropped), keeping none: the
        next training forward copies again. Returns whether there were copies."""
        saved, self._saved = self._saved, None
        if not saved:
            return False
        _write_back(self._buffers(), saved)
        return True

    def _buffers(self) -> list[torch.Tensor | None]:
        # By name each time: a cast (a fallback's) replaces the tensor a module holds under it.
        return [owner._buffers.get(name) for owner, name in self._slots]


def _version(tensor: torch.Tensor | None) -> int:
    # An inference tensor has no version counter (nor can it be written outside inference mode).
    return -1 if tensor is None or tensor.is_inference() else tensor._version


def _write_back(buffers: list[torch.Tensor | None], saved: dict[int, torch.Tensor]) -> None:
    with torch.no_grad():
        for i, copy in saved.items():
            buffer = buffers[i]
            if buffer is not None:
                buffer.copy_(copy)

"""The iteration in progress, host state only: which optimizers were unscaled and stepped, and why a skip happened;
it decides when the iteration's one scale update is due."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

import torch
from torch.optim import Optimizer

from lit_mpstable.core.scaling.scalers import LossScaler
from lit_mpstable.core.weights.weights import WeightKeeper


class Iteration:
    """What the iteration in progress has done, per optimizer (by id)."""

    def __init__(self) -> None:
        self.unscaled: set[int] = set()  # optimizers unscaled (and checked) in this iteration, not yet stepped
        self.stepped: set[int] = set()  # optimizers stepped since the last scale update
        self.data_fault = False  # a skip of this iteration is not the scale's fault (an inf/NaN batch, or a late one)
        self.overflowed = False  # a skip of this iteration counts as an overflow (not inf/NaN entering late)
        self.stepped_on: dict[int, GradSet] = {}  # per optimizer: the gradients (and versions) it last stepped on
        self.checked: dict[int, GradSet] = {}  # per optimizer: its gradients (and versions) as the check saw them

    def awaited(self, optimizers: Sequence[Optimizer], done: Optimizer, keeper: WeightKeeper) -> bool:
        """Whether another optimizer still has to step on this iteration's gradients (one loss, several optimizers):
        unscaled and not stepped, or holding gradients. The scale changes only after the last one, as GradScaler
        documents (one ``update()`` per iteration), so every optimizer unscales with the scale its loss was scaled by.
        Host state only."""
        for optimizer in optimizers:
            if optimizer is done or id(optimizer) in self.stepped:
                continue
            if id(optimizer) in self.unscaled:
                return True
            # Gradients it already stepped on (a loop that zeroes before backward) are not this iteration's.
            if any(g is not None and (g, g._version) not in self.stepped_on.get(id(optimizer), ())
                   for g in _grads(keeper, optimizer)):
                return True
        return False

    def note_checked(self, optimizer: Optimizer) -> None:
        """``optimizer``'s gradients as the gradient check left them: the step-input check reads again only those
        written since (by a hook or clipping)."""
        self.checked[id(optimizer)] = GradSet(p.grad for g in optimizer.param_groups for p in g["params"]
                                              if p.grad is not None)

    def note_stepped_on(self, optimizers: Sequence[Optimizer], optimizer: Optimizer, keeper: WeightKeeper) -> None:
        if len(optimizers) > 1:  # only awaited reads it
            self.stepped_on[id(optimizer)] = GradSet(g for g in _grads(keeper, optimizer) if g is not None)

    def update_scale_(self, checker: LossScaler | None) -> None:
        """The iteration's one scale update, once every optimizer that had gradients stepped (or at the next
        backward, or a checkpoint, for one that never stepped): skipped without a backoff when the data was at
        fault."""
        if checker is not None and self.stepped:
            checker.skip_update_(overflow=self.overflowed) if self.data_fault else checker.update()
        self.stepped.clear()
        self.data_fault = self.overflowed = False


def _grads(keeper: WeightKeeper, optimizer: Optimizer) -> list[torch.Tensor | None]:
    return [p.grad for p in keeper.grads(optimizer).holders]


class GradSet:
    """Gradient tensors with their version counters at one moment, by identity (tensors do not hash by value); held
    weakly, so gradients dropped by ``zero_grad()`` are freed."""

    def __init__(self, grads: Iterable[torch.Tensor]) -> None:
        self._seen = {id(g): (weakref.ref(g), g._version) for g in grads}

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, item: tuple[torch.Tensor, int]) -> bool:
        grad, version = item
        seen = self._seen.get(id(grad))
        return seen is not None and seen[0]() is grad and seen[1] == version

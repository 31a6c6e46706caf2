"""What the fused Adam kernel of compact weights (:mod:`lit_mpstable.core.weights.compact_fused`) takes per parameter
and keeps from step to step: flat views of the 16-bit tensors and the random key's tensor."""

from __future__ import annotations

import torch

from lit_mpstable.core.weights.compact_rounding import _signed32


class KernelArgs:
    """One parameter's kernel arguments that outlive a step: the flat views of the weight, compensation and moments
    (four views and a detach cost ~7 us per parameter and step in Python) and its random key's 0-d tensor (refilled
    in place: half the cost of a new one). The views are kept while they are of the same tensors, by identity, start
    and size: a parameter given new data (``p.data = ...``), moments replaced (a loaded optimizer state) or a
    compensation replaced get new ones."""

    __slots__ = ("comp", "flat", "key", "m", "param", "v", "where")

    def __init__(self, param: torch.Tensor) -> None:
        self.param = param
        self.comp: torch.Tensor | None = None
        self.m: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.flat: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor] | None = None
        self.where: tuple[int, int, int, int] = (0, 0, 0, 0)
        self.key = torch.empty((), dtype=torch.int32)


def _entry(views: dict[int, KernelArgs], p: torch.Tensor) -> KernelArgs:
    entry = views.get(id(p))
    if entry is None or entry.param is not p:
        entry = views[id(p)] = KernelArgs(p)
    return entry


def flat_views(
    views: dict[int, KernelArgs], p: torch.Tensor, comp: torch.Tensor | None, m: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The flat views of ``p``, its compensation ``comp`` and moments ``m``, ``v`` for the kernel (kept in
    ``views``, see :class:`KernelArgs`)."""
    entry = _entry(views, p)
    where = (p.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel())
    kept = entry.flat
    if kept is None or entry.comp is not comp or entry.m is not m or entry.v is not v or entry.where != where:
        kept = entry.flat = (flat(p.detach()), flat(comp) if comp is not None else None, flat(m), flat(v))
        entry.comp, entry.m, entry.v, entry.where = comp, m, v, where
    return kept


def fill_key(views: dict[int, KernelArgs], p: torch.Tensor, key: int) -> torch.Tensor:
    """``p``'s random key of this step as a 0-d int32 CPU tensor of its own, kept in ``views`` (a key that is a view
    would make the kernel guard on the number of keys: :func:`~lit_mpstable.core.weights.compact_fused.keys`)."""
    return _entry(views, p).key.fill_(_signed32(key))


def flat(t: torch.Tensor) -> torch.Tensor:
    # A contiguous tensor as the 1-d one the kernel takes; a view costs microseconds, so none where it is one already.
    return t if t.dim() == 1 else t.view(-1)

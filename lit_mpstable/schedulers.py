"""Holding an LR scheduler on skipped optimizer steps, as DeepSpeed, Megatron-LM and accelerate do."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["hold_on_skip"]

_skipped: weakref.WeakKeyDictionary[Any, Callable[[], bool]] = weakref.WeakKeyDictionary()


def _held_step(self: Any, *args: Any, **kwargs: Any) -> Any:
    skipped = _skipped.get(self)
    if skipped is not None and skipped():
        # The optimizer step was skipped (inf/NaN gradients): the schedule stays where the weights are.
        return None
    return super(type(self), self).step(*args, **kwargs)


def hold_on_skip(scheduler: Any, skipped: Callable[[], bool]) -> None:
    """Make ``scheduler.step()`` a no-op whenever ``skipped()`` says the last optimizer step was skipped.

    The scheduler's class is swapped for a one-method subclass, so its ``state_dict`` (its ``__dict__``) is
    unchanged and checkpoints stay plain; ``skipped`` lives in a weak map, not on the scheduler.
    """
    _skipped[scheduler] = skipped
    cls = type(scheduler)
    if getattr(cls, "_lit_mpstable_held", False):
        return
    scheduler.__class__ = type(
        cls.__name__, (cls,),
        {"step": _held_step, "_lit_mpstable_held": True, "__module__": cls.__module__, "__reduce_ex__": _reduce_ex},
    )


def _reduce_ex(self: Any, protocol: int) -> Any:
    # Pickle as the original class (the held subclass is made at run time and cannot be imported): a copy is a
    # plain scheduler with the same state.
    return _rebuild, (type(self).__mro__[1], self.__dict__)


def _rebuild(cls: type, state: dict[str, Any]) -> Any:
    scheduler = cls.__new__(cls)
    scheduler.__dict__.update(state)
    return scheduler

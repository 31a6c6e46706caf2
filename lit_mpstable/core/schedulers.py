"""Holding LR schedulers while the weights do not move, as DeepSpeed, Megatron-LM and accelerate do."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["ScheduleHold", "hold_on_skip"]

# scheduler -> [applied_steps(), the count when the scheduler last stepped]
_progress: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


def _held_step(self: Any, *args: Any, **kwargs: Any) -> Any:
    progress = _progress.get(self)
    if progress is not None:
        applied = progress[0]()
        if applied == progress[1]:
            # No optimizer step was applied since this scheduler last stepped (skipped for inf/NaN gradients):
            # the schedule stays where the weights are.
            return None
        progress[1] = applied
    return super(type(self), self).step(*args, **kwargs)


def hold_on_skip(scheduler: Any, applied_steps: Callable[[], int]) -> None:
    """Make ``scheduler.step()`` a no-op unless ``applied_steps()`` (optimizer steps actually applied) grew since
    the scheduler last stepped: a per-step schedule holds on a skipped step, a per-epoch one only when the whole
    epoch was skipped.

    The scheduler's class is swapped for a one-method subclass, so its ``state_dict`` (its ``__dict__``) is
    unchanged and checkpoints stay plain; the counter lives in a weak map, not on the scheduler.
    """
    _progress[scheduler] = [applied_steps, applied_steps()]
    cls = type(scheduler)
    if getattr(cls, "_lit_mpstable_held", False):
        return
    scheduler.__class__ = type(
        cls.__name__, (cls,),
        {"step": _held_step, "_lit_mpstable_held": True, "__module__": cls.__module__, "__reduce_ex__": _reduce_ex},
    )


class ScheduleHold:
    """The schedulers one run holds (:func:`hold_on_skip`), and where each stood when it last stepped.

    That baseline is training state: a checkpoint taken between a scheduler's steps must bring it back, or the
    first step after a resume compares against the restored step counters and moves a schedule it should hold.
    """

    def __init__(self, applied_steps: Callable[[], int]) -> None:
        self.applied_steps = applied_steps
        self._held: list[weakref.ref] = []
        self._pending: list[int] | None = None

    def hold(self, schedulers: list[Any]) -> None:
        """Hold these schedulers (a new ``fit`` replaces the previous ones); a loaded baseline applies to them."""
        for scheduler in schedulers:
            hold_on_skip(scheduler, self.applied_steps)
        self._held = [weakref.ref(s) for s in schedulers]
        if self._pending is not None:
            self.load_state_dict(self._pending)

    def state_dict(self) -> list[int]:
        """The applied-step count at each held scheduler's last step, in the order they were held."""
        return [int(_progress[s][1]) for ref in self._held if (s := ref()) is not None and s in _progress]

    def load_state_dict(self, baselines: list[int]) -> None:
        """Restore the baselines (kept until the schedulers are held, if they are not yet); a checkpoint holding
        another number of schedulers re-bases them all on the current count."""
        live = [s for ref in self._held if (s := ref()) is not None and s in _progress]
        if not live:
            self._pending = list(baselines)
            return
        self._pending = None
        same = len(baselines) == len(live)
        for i, scheduler in enumerate(live):
            _progress[scheduler][1] = int(baselines[i]) if same else self.applied_steps()


def _reduce_ex(self: Any, protocol: int) -> Any:
    # Pickle as the original class (the held subclass is made at run time and cannot be imported): a copy is a
    # plain scheduler with the same state.
    return _rebuild, (type(self).__mro__[1], self.__dict__)


def _rebuild(cls: type, state: dict[str, Any]) -> Any:
    scheduler = cls.__new__(cls)
    scheduler.__dict__.update(state)
    return scheduler

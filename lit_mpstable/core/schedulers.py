"""Holding LR schedulers while the weights do not move, as DeepSpeed, Megatron-LM and accelerate do."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from torch.optim import Optimizer

# scheduler -> [applied_steps(), the count when the scheduler last stepped]
_progress: weakref.WeakKeyDictionary[object, list[Any]] = weakref.WeakKeyDictionary()


def _held_step(self: Any, *args: object, **kwargs: object) -> object:  # self: of a scheduler class, untyped for super()
    progress = _progress.get(self)
    if progress is not None:
        applied = progress[0]()
        if applied == progress[1]:
            # No optimizer step was applied since this scheduler last stepped (skipped for inf/NaN gradients):
            # the schedule stays where the weights are.
            return None
        progress[1] = applied
    return super(type(self), self).step(*args, **kwargs)


def hold_on_skip(scheduler: object, applied_steps: Callable[[], int]) -> None:
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
    """The schedulers one run holds (:func:`hold_on_skip`), each by its own optimizer's applied steps, and how far
    each is behind them.

    With several optimizers (a GAN's generator and discriminator) a scheduler follows the steps its own optimizer
    applied: a skipped discriminator step holds the discriminator's schedule even when the generator stepped.

    Where each scheduler stands is training state: a checkpoint taken between a scheduler's steps must bring it
    back, or the first step after a resume moves a schedule it should hold. It is saved relative to the count (steps
    applied since the scheduler last stepped), since the per-optimizer counts live in this process only.

    Args:
        applied_steps: ``applied_steps(optimizer)``: the steps ``optimizer`` applied; ``applied_steps(None)``: all
            optimizers' (for a scheduler without an ``optimizer`` attribute).
    """

    def __init__(self, applied_steps: Callable[[Optimizer | None], int]) -> None:
        self.applied_steps = applied_steps
        self._held: list[weakref.ref[object]] = []
        self._pending: list[int] | None = None

    def _count(self, scheduler: object) -> Callable[[], int]:
        return functools.partial(self.applied_steps, getattr(scheduler, "optimizer", None))

    def hold(self, schedulers: Sequence[object]) -> None:
        """Hold these schedulers (a new ``fit`` replaces the previous ones); a loaded position applies to them."""
        for scheduler in schedulers:
            hold_on_skip(scheduler, self._count(scheduler))
        self._held = [weakref.ref(s) for s in schedulers]
        if self._pending is not None:
            self.load_state_dict(self._pending)

    def _live(self) -> list[object]:
        return [s for ref in self._held if (s := ref()) is not None and s in _progress]

    def release_(self, optimizer: Optimizer) -> None:
        """Let ``optimizer``'s schedulers (and those without an optimizer) take their next step although no step was
        applied: the user skipped the batch (``training_step`` returned None), and Lightning's schedule moves on such
        a batch; the hold is for the steps the plugin skips."""
        for scheduler in self._live():
            if getattr(scheduler, "optimizer", None) in (optimizer, None):
                progress = _progress[scheduler]
                progress[1] = min(progress[1], progress[0]() - 1)

    def state_dict(self) -> list[int]:
        """Per held scheduler, in the order they were held: the steps its optimizer applied since it last stepped."""
        return [int(_progress[s][0]() - _progress[s][1]) for s in self._live()]

    def load_state_dict(self, behind: list[int]) -> None:
        """Restore where each scheduler stands (kept until the schedulers are held, if they are not yet); a
        checkpoint holding another number of schedulers puts them all level with their optimizers' counts.

        Raises:
            ValueError: not a list of ints >= 0.
        """
        if not isinstance(behind, (list, tuple)) or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in behind):
            raise ValueError(
                f"ScheduleHold.load_state_dict({behind!r}): expected a list of ints >= 0 (steps applied since each"
                " held scheduler last stepped); the checkpoint is corrupt."
            )
        live = self._live()
        if not live:
            self._pending = list(behind)
            return
        self._pending = None
        same = len(behind) == len(live)
        for i, scheduler in enumerate(live):
            _progress[scheduler][1] = _progress[scheduler][0]() - (int(behind[i]) if same else 0)


def _reduce_ex(self: object, protocol: int) -> tuple[object, ...]:
    # Pickle as the original class (the held subclass is made at run time and cannot be imported): a copy is a
    # plain scheduler with the same state.
    return _rebuild, (type(self).__mro__[1], self.__dict__)


_T = TypeVar("_T")


def _rebuild(cls: type[_T], state: Mapping[str, object]) -> _T:
    scheduler = cls.__new__(cls)
    scheduler.__dict__.update(state)
    return scheduler

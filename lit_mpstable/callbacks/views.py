"""What the callbacks read when the trainer's precision plugin is not ``StablePrecision``: a view with
``StablePrecision``'s live state (precision, loss scale, step and skip counts, ``can_skip``/``can_fallback``), read
from Lightning's own plugin and its GradScaler (:class:`ForeignPrecision`) or, under ``DeepSpeedStrategy``, from
DeepSpeed's engine (:class:`DeepSpeedView`). :func:`view_of` picks the reader and shares one view per plugin and fit.
"""

from __future__ import annotations

import weakref
from typing import Any

from lit_mpstable.callbacks._deepspeed import DeepSpeedView, runs_deepspeed
from lit_mpstable.callbacks._foreign import ForeignPrecision

# One view per foreign plugin and fit, shared by every callback (one step hook per optimizer).
_VIEWS: weakref.WeakKeyDictionary[Any, ForeignPrecision] = weakref.WeakKeyDictionary()


def view_of(plugin: Any, trainer: Any) -> ForeignPrecision:
    """The view of ``plugin`` for ``trainer``'s fit: the one already made for this plugin and trainer while its step
    hooks are in place, else a new one (the stale one's hooks removed)."""
    view = _VIEWS.get(plugin)
    if view is None or view._trainer is not trainer or not view._handles:
        if view is not None:
            view.remove()
        reader = DeepSpeedView if runs_deepspeed(trainer) else ForeignPrecision  # DeepSpeed: its engine is read
        view = _VIEWS[plugin] = reader(plugin, trainer)
    return view

"""What the callbacks read when the trainer's precision plugin is not ``StablePrecision``: a view with
``StablePrecision``'s live state (precision, loss scale, step and skip counts, ``can_skip``/``can_fallback``), read
from Lightning's own plugin and its GradScaler (:class:`ForeignPrecision`) or, under ``DeepSpeedStrategy``, from
DeepSpeed's engine (:class:`DeepSpeedView`). :func:`view_of` picks the reader and shares one view per plugin and fit.
:class:`PrecisionView` names what every callback reads and calls: ``StablePrecision`` (Trainer and Fabric) and both
views satisfy it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch

from lit_mpstable.callbacks._deepspeed import DeepSpeedView, runs_deepspeed
from lit_mpstable.callbacks._foreign import ForeignPrecision
from lit_mpstable.frontends.live_state import Findings


@runtime_checkable
class PrecisionView(Protocol):
    """What the callbacks read from, and call on, a precision plugin: ``StablePrecision`` itself, Lightning's own
    plugins seen through :class:`ForeignPrecision`, DeepSpeed's engine through :class:`DeepSpeedView`. A callback
    that needs more (the stepper, a replay) requires ``StablePrecision`` and says so at fit start.

    ``fallback``/``restore_precision`` work where ``can_fallback`` is True, ``skip_step`` where ``can_skip`` is;
    the views refuse them (``RuntimeError``)."""

    precision: Any
    findings: Findings
    can_skip: bool

    @property
    def scaler(self) -> Any: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def compute_dtype(self) -> torch.dtype: ...
    @property
    def loss_scale(self) -> float: ...
    @property
    def step_count(self) -> int: ...
    @property
    def overflow_count(self) -> int: ...
    @property
    def skipped_steps(self) -> int: ...
    @property
    def last_step_skipped(self) -> bool: ...
    @property
    def fallback_active(self) -> bool: ...
    @property
    def checks_nonfinite(self) -> bool: ...
    @property
    def input_nonfinite(self) -> Any: ...
    @property
    def stats(self) -> dict[str, Any]: ...
    @property
    def islands(self) -> Any: ...
    @property
    def can_fallback(self) -> bool: ...

    def forward_context(self) -> AbstractContextManager[Any]: ...
    def skip_step(self) -> None: ...
    def fallback(self, modules: Iterable[str] | None = None, *, reason: str) -> str: ...
    def restore_precision(self) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def restore_state(self, state: dict[str, Any]) -> None: ...


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

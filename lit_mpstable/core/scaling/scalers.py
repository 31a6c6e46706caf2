"""The ``LossScaler`` protocol the stepper calls, and :func:`build_scaler`, which turns the ``scaler`` argument into a
scaler that satisfies it (checked once, here: the step path calls the protocol and never asks what a scaler can do).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol, get_args, runtime_checkable

import torch

from lit_mpstable.base.notes import Notes
from lit_mpstable.base.validate import choice_arg
from lit_mpstable.core.scaling.adaptive_scaler import AdaptiveLossScaler
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler, StaticLossScaler, fold_found_inf
from lit_mpstable.core.scaling.scaler_state import SCALE_FLOOR
from lit_mpstable.core.tensors import GradPass

ScalerName = Literal["auto", "dynamic", "static", "adaptive"]
_SCALERS = {"dynamic": DynamicLossScaler, "static": StaticLossScaler, "adaptive": AdaptiveLossScaler}
# What a scaler instance must have to be seen through ForeignScaler (it forwards these).
_GRADSCALER_METHODS = ("scale", "unscale_", "step", "update", "get_scale", "state_dict", "load_state_dict")


@runtime_checkable
class LossScaler(Protocol):
    """What the step calls on a scaler, in step order: GradScaler's ``step`` and ``update``, the scale as a device
    tensor, and what the step needs beyond them (one checked unscale agreed across ranks, a step with the caller's own
    update, the folded step-input check, and the three ways an iteration ends without its update).
    ``DynamicLossScaler`` (and its subclasses) satisfy it themselves; any other scaler is seen through
    :class:`ForeignScaler`. The rest of GradScaler's methods (``scale``, ``get_scale``, ``state_dict``, ...) are called
    on the run's scaler itself, not through this protocol.

    Attributes:
        last_step_skipped: whether the last ``step``/``step_with`` skipped (set from its one host sync).
        checks_without_unscaling: whether ``check_grads_(unscale=False)`` and :meth:`step_with` work (compact weights
            need them).
        measures_norm: set by the stepper when the step reads the gradients' norm: ``check_grads_`` then makes the
            one pass over them that :meth:`grad_pass` returns (a scaler may ignore it and return None).
    """

    last_step_skipped: bool
    checks_without_unscaling: bool
    measures_norm: bool

    def adopt_device_(self, device_type: str) -> str | None: ...
    def get_scale_tensor(self) -> torch.Tensor | None: ...
    def check_grads_(self, optimizer: torch.optim.Optimizer, device: torch.device | str, *,
                     unscale: bool = True) -> None: ...
    def grad_pass(self, optimizer: torch.optim.Optimizer) -> GradPass | None: ...
    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool: ...
    def check_also_(self, optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor]) -> bool: ...
    def fold_found_inf_(self, optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> torch.Tensor | None: ...
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any: ...
    def step_with(self, optimizer: torch.optim.Optimizer, update: Callable[[], Any]) -> Any: ...
    def update(self, new_scale: float | torch.Tensor | None = None) -> None: ...
    def skip_update_(self, *, overflow: bool = True) -> None: ...
    def undo_backoff_(self) -> bool: ...
    def forget_(self, optimizer: torch.optim.Optimizer) -> None: ...


_METHODS = tuple(name for name, value in vars(LossScaler).items() if callable(value) and not name.startswith("_"))
_ATTRIBUTES = tuple(LossScaler.__annotations__)


def check_protocol(call: str, scaler: object) -> None:
    """Refuse a scaler that lacks a :class:`LossScaler` method or attribute (once, at construction).

    Raises:
        ValueError: the message names every missing member.
    """
    missing = [name for name in _METHODS if not callable(getattr(scaler, name, None))]
    missing += [name for name in _ATTRIBUTES if not hasattr(scaler, name)]
    if missing:
        raise ValueError(f"{call}(scaler={type(scaler).__name__}(...)): a loss scaler needs every LossScaler method;"
                         f" missing {missing}. Subclass DynamicLossScaler, or pass a torch.amp.GradScaler.")


def build_scaler(call: str, precision: str, scaler: object, device: str, *, skip_nonfinite: bool, warnings: Notes
                 ) -> tuple[torch.amp.GradScaler | Any | None, LossScaler | None]:
    """The run's scaler from the ``scaler`` argument, and the :class:`LossScaler` the step calls.

    ``"auto"``/``"dynamic"``/``"static"``/``"adaptive"`` build ours on ``device`` (for ``"16-true"`` from a scale of
    2**15, whose seed gradient an FP16 loss holds); an instance is validated; an enabled scaler, named or
    an instance, outside the FP16 precisions is refused (``"auto"`` means none there); a plain
    ``torch.amp.GradScaler`` is adopted into a ``DynamicLossScaler`` with its settings and state (ours also reports
    skipped steps); a disabled one means no scaling. The step calls ours directly and any other scaler through
    :class:`ForeignScaler`; without a scaler, ``skip_nonfinite`` keeps a fixed scale of 1 for the inf/NaN check.
    Messages to show once are appended to ``warnings``.

    Returns:
        ``(scaler, checker)``: the scaler the run scales with (the user's instance, ours, or None) and the protocol
        object the step calls (None when nothing checks).

    Raises:
        ValueError: an unknown name, scaling outside FP16, a scaler without GradScaler's methods or the protocol's, a
            GradScaler that torch disabled for lack of CUDA, or ``skip_nonfinite=False`` with a scaler.
    """
    built = _build(call, precision, scaler, device, warnings)
    if built is not None and not skip_nonfinite:
        raise ValueError(
            f"{call}({precision!r}, skip_nonfinite=False): a loss scaler always skips a step whose gradients hold"
            " inf/NaN (that is how it finds a scale that fits); use scaler=None to turn the check off too."
        )
    # Without a scaler, a fixed scale of 1 does GradScaler's fused inf/NaN check and skip: NaN never reaches the
    # weights in BF16 or FP32 either. A scaler that is not ours is seen through ForeignScaler, chosen once here.
    checker: DynamicLossScaler | ForeignScaler | None
    if built is None:
        checker = StaticLossScaler(device, init_scale=1.0) if skip_nonfinite else None
        if checker is not None:
            checker.checks_only = True  # it never scales a loss: its scale stays exactly 1
    else:
        checker = built if isinstance(built, DynamicLossScaler) else ForeignScaler(built)
    if checker is not None:
        check_protocol(call, checker)
    return built, checker


def _build(call: str, precision: str, scaler: Any, device: str, warnings: Notes) -> Any:
    fp16 = precision in ("16-mixed", "16-true")
    if isinstance(scaler, str):
        choice_arg(call, "scaler", scaler, get_args(ScalerName))
        if scaler == "auto":
            if not fp16:
                return None
            scaler = "dynamic"
        _refuse_outside_fp16(call, precision, repr(scaler))
        # "16-true" computes the loss in FP16, and backward's seed gradient is the scale itself: 2**16 (GradScaler's
        # default) is inf there, so step 0 would always overflow. Start at 2**15, the largest power of two FP16
        # holds; "16-mixed" keeps GradScaler's default (its loss comes out of autocast in FP32).
        return _SCALERS[scaler](device, init_scale=_FP16_TRUE_INIT_SCALE) if precision == "16-true" \
            else _SCALERS[scaler](device)
    if scaler is None:
        return None
    missing = [name for name in _GRADSCALER_METHODS if not callable(getattr(scaler, name, None))]
    if missing:
        raise ValueError(f"{call}(scaler={scaler!r}): a scaler instance needs GradScaler's methods; missing {missing}.")
    if not scaler.is_enabled():
        if getattr(scaler, "_device", None) == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"{call}(scaler={type(scaler).__name__}('cuda')): torch disabled this GradScaler because CUDA is"
                " not available here, so FP16 would train unscaled. Pass scaler='dynamic' or"
                " DynamicLossScaler(...) (device=None follows the run), or a scaler built for 'cpu'."
            )
        warnings.add(
            "scaler-disabled", f"{call}(scaler={type(scaler).__name__}(enabled=False)): taken as no loss scaling"
            " (scaler=None)."
        )
        return None
    # The rule for a name holds for an instance too (a Hydra scaler node arrives as one): no scaling outside FP16.
    _refuse_outside_fp16(call, precision, f"{type(scaler).__name__}(...)")
    if type(scaler) is torch.amp.GradScaler:
        # Adopted with its settings and state: our subclass also reports skipped steps (LR hold, counters,
        # attribution), which a plain GradScaler keeps to itself.
        adopted = DynamicLossScaler(
            scaler._device, scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(),
            scaler.get_growth_interval(), max_scale=None,
        )
        adopted.load_state_dict(scaler.state_dict())
        return adopted
    return scaler


_FP16_TRUE_INIT_SCALE = 2.0**15
"""The first scale of a scaler chosen by name for ``"16-true"``: the largest power of two FP16 holds."""


def _refuse_outside_fp16(call: str, precision: str, shown: str) -> None:
    """Refuse loss scaling in a BF16 or FP32 precision, for a name, an instance and a Hydra node alike."""
    if precision not in ("16-mixed", "16-true"):
        raise ValueError(
            f"{call}({precision!r}, scaler={shown}): loss scaling is only for the FP16 precisions '16-mixed' and"
            " '16-true' (BF16 and FP32 share FP32's exponent range, so a scale buys nothing); use scaler=None (or"
            " leave the default 'auto'): every step is still checked for inf/NaN and skipped (skip_nonfinite)."
        )


class ForeignScaler:
    """A scaler that is not one of ours (a ``torch.amp.GradScaler`` subclass, or any object with GradScaler's
    methods), seen through :class:`LossScaler`: ``last_step_skipped`` after each ``step``, ``found_inf``, ``forget_``,
    ``skip_update_`` and a floored scale. It cannot check without unscaling (``check_grads_(unscale=False)``), and it
    agrees across ranks through the stepper's folded step-input check, not in ``check_grads_``.

    Which way the outcome is read is decided once, here: a GradScaler (subclass) keeps each optimizer's inf checks in
    ``_per_optimizer_states`` until ``update()``, and its own step reads them; anything else is asked whether it
    called ``optimizer.step()`` (a step post-hook), which is how GradScaler skips an unfused optimizer.
    """

    def __init__(self, scaler: Any) -> None:
        self.inner = scaler
        self.gradscaler = isinstance(scaler, torch.amp.GradScaler)
        self.last_step_skipped = False

    checks_without_unscaling = False
    measures_norm = False  # set by the stepper, unused: the unscale is the foreign scaler's own

    def is_enabled(self) -> bool:
        return bool(self.inner.is_enabled())

    def scale(self, outputs: object) -> Any:
        return self.inner.scale(outputs)

    def get_scale(self) -> float:
        return self.inner.get_scale()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.inner.unscale_(optimizer)

    def get_scale_tensor(self) -> torch.Tensor | None:
        """A GradScaler's 0-dim device scale (None before ``scale()``, and for any other scaler)."""
        scale = self.inner._scale if self.gradscaler else None
        return scale if isinstance(scale, torch.Tensor) else None

    def adopt_device_(self, device_type: str) -> str | None:
        """Nothing to move: a foreign scaler stays where its owner built it."""
        return None

    def check_grads_(self, optimizer: torch.optim.Optimizer, device: torch.device | str, *,
                     unscale: bool = True) -> None:
        """Unscale ``optimizer``'s gradients (the scaler's own check). Nothing to create on ``device`` (only a scaler
        that scaled a loss unscales), and no cross-rank agreement here: the stepper's step-input check (one
        all-reduce, folded in) makes every rank skip together.

        Raises:
            TypeError: ``unscale=False``: a foreign scaler only checks while unscaling (``checks_without_unscaling``
                is False).
        """
        if not unscale:
            raise TypeError(f"{type(self.inner).__name__} cannot check gradients without unscaling them (check_()); use"
                            " DynamicLossScaler.")
        self.inner.unscale_(optimizer)

    def grad_pass(self, optimizer: torch.optim.Optimizer) -> GradPass | None:
        """None: a foreign scaler's check makes no pass the step could read (the stepper reads the gradients)."""
        return None

    def _found(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        state = self.inner._per_optimizer_states.get(id(optimizer)) if self.gradscaler else None
        flags = list(state["found_inf_per_device"].values()) if state else []
        return sum(flags) if flags else None

    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s gradients hold inf/NaN after ``unscale_`` (a host sync)."""
        found = self._found(optimizer)
        if found is not None:
            return bool(found)
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        return bool(grads) and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())

    def step_with(self, optimizer: torch.optim.Optimizer, update: Callable[[], Any]) -> Any:
        """Refused, as ``check_grads_(unscale=False)``: only a scaler that checks without unscaling steps with the
        caller's update.

        Raises:
            TypeError: always.
        """
        raise TypeError(f"{type(self.inner).__name__} cannot step with the caller's own update (step_with()); use"
                        " DynamicLossScaler.")

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        ran: list[bool] = []
        handle = optimizer.register_step_post_hook(lambda *_: ran.append(True))
        try:
            output = self.inner.step(optimizer, *args, **kwargs)
        finally:
            handle.remove()
        found = self._found(optimizer)
        # A fused optimizer steps whatever the gradients hold and skips inside: its flag says what happened.
        self.last_step_skipped = bool(found) if found is not None else not ran
        return output

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        self.inner.update(new_scale)
        scale = self.get_scale_tensor()
        if scale is not None:
            scale.clamp_(min=SCALE_FLOOR)  # 1/scale stays finite (GradScaler's own rule would reach 0)

    def skip_update_(self, *, overflow: bool = True) -> None:
        """End the iteration without an update (its overflow was the data's): a GradScaler's checks are dropped, its
        scale and growth tracker untouched; another scaler is updated (it cannot be told otherwise)."""
        if self.gradscaler:
            self.inner._per_optimizer_states.clear()
        else:
            self.update()

    def undo_backoff_(self) -> bool:
        """Nothing undone (False): a foreign scaler's update is its own; only ours keeps where the scale stood."""
        return False

    def check_also_(self, optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor]) -> bool:
        """False: nothing checked into a foreign scaler's flag (the stepper checks ``tensors`` apart and folds)."""
        return False

    def fold_found_inf_(self, optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> torch.Tensor | None:
        """:meth:`DynamicLossScaler.fold_found_inf_` for a GradScaler; None (nothing folded) for any other scaler."""
        return fold_found_inf(self.inner, optimizer, flag) if self.gradscaler else None

    def forget_(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop this iteration's record for ``optimizer`` (a GradScaler's per-optimizer state)."""
        if self.gradscaler:
            self.inner._per_optimizer_states.pop(id(optimizer), None)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

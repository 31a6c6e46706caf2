"""The adaptive loss scaler: each next scale from the measured gradient amax, a safe scale after one clean step."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, get_args

import torch

from lit_mpstable.base.validate import bool_arg, choice_arg, int_arg, real_arg
from lit_mpstable.core.formats import FormatName, get_format
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler
from lit_mpstable.core.scaling.scaler_state import GRADSCALER_KEYS, SCALE_FLOOR
from lit_mpstable.core.tensors import GradPass, amax_per_tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2, tensor parallel); any other tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


# Guessed bound: the k-th consecutive overflow backs off by backoff_factor**(2**(k-1)), at most backoff_factor**8
# (2**-8 at 0.5): a scale 2**9 too large is left in 4 steps instead of 9, and the first clean scale undershoots by
# at most 8 binades for that one step (the measured amax then sets it).
_MAX_BACKOFF_DOUBLINGS = 3
# The amax window lives on the device and is re-read every step; longer windows than this only slow it down.
_MAX_AMAX_HISTORY = 2**16
# AdaptiveLossScaler's device-side state beyond DynamicLossScaler's, and its dtypes.
_ADAPTIVE_STATE = {
    "_amax_history": torch.float32,  # unscaled amax of the last clean steps, newest first; 0 = empty slot
    "_extra_headroom": torch.float32,  # >= 1, learned from overflows the amax does not explain
    "_last_overflow_scale": torch.float32,  # scale of the last overflowing step while it is unresolved; 0 = none
    "_overflow_streak": torch.int32,  # consecutive overflowing steps
}


class AdaptiveLossScaler(DynamicLossScaler):
    """A loss scaler that sets each next scale from the measured gradient amax: a safe scale after one clean step.

    After every clean step the scale becomes the largest power of two ``s`` with ``amax * s * headroom <= max`` of
    ``target_format`` (65504 for FP16), bounded by ``min_scale``/``max_scale``. ``amax`` is the largest unscaled
    gradient magnitude over the last ``amax_history_len`` clean steps: the window max lowers the scale as soon as
    gradients grow, but raises it only once a large amax has left the window, so one quiet step cannot lift the
    scale into overflow. Steps whose gradients are all zero (or absent) keep the scale.

    The amax costs one extra read of the gradients (a single multi-tensor kernel on CUDA), made where the step checks
    them (``unscale_``, or :meth:`check_` for compact 16-bit weights, which unscale in their own step), and stays on
    the device; the only host synchronisation is the skip decision GradScaler makes. With sharded (DTensor) gradients
    it is this rank's until :meth:`sync_found_inf_` takes the MAX over the ranks: call it in distributed runs (the
    plugin does).

    On inf/NaN the step is skipped, as in GradScaler, and the scale backs off: by ``backoff_factor``, and faster on
    consecutive overflows (``backoff_factor**2``, then ``**4``, at most ``**8``), since an overflowing step measures
    nothing. The next clean step checks whether its gradients would have fit at the scale that overflowed. If not,
    the gradients grew and the amax rule has already adjusted. If they would have, something the parameter-gradient
    amax does not see overflowed (an activation gradient inside backward, or a one-step spike), so the rule gets extra
    headroom that keeps it below that scale; without it the same overflowing scale would be chosen again on every
    clean step. The extra headroom is relative to the amax, so the scale still follows gradients that shrink, and it
    halves after each ``growth_interval`` consecutive clean steps (GradScaler's probing rhythm).

    What "steady" means: the scale is right for the current gradients after the first clean step, and from then on it
    tracks their amax; it settles on one value only as far as the amax does. On the digits MLP in FP16 (300 steps,
    ``experiment=classic_mlp_fp16_adaptive``) the amax falls from 2^-3.5 to 2^-6 as the model converges (a spike to
    2^-1.7 at step 22), so the scale goes 2^16 -> 2^18 after step 1 and then between 2^16 and 2^20 (12 changes, 0
    overflows, 0 skipped steps): within 2x of its final 2^20 only from step 227. Each change follows the gradients
    and costs nothing; a changing scale is not instability. (DynamicLossScaler keeps 2^16 there for 2000 steps.)

    Measured underflow (:meth:`note_underflow_`, which ``PrecisionProbe`` calls) lowers the headroom: while the probe
    finds gradients flushing to zero and nothing overflows, each report multiplies the next scales by
    ``growth_factor``, down to no headroom at all (``amax * scale <= max``: parameter gradients never overflow). An
    overflow gives the headroom back and, when it followed such a raise, refuses raises for ``growth_interval`` steps
    (the headroom was needed: activation gradients inside backward are larger than the parameters').

    Args:
        target_format: the format the scaled gradients live in (``"fp16"``; ``"fp8_e5m2"`` for FP8 gradients).
        headroom: factor >= 1 kept between ``amax * scale`` and the format's max, for gradients inside backward that
            are larger than the parameter gradients and for growth between steps (a guessed default: one binade).
        amax_history_len: clean steps in the amax window.
        growth_interval: consecutive clean steps after which learned extra headroom halves.

    Raises:
        ValueError: an argument is out of range (each message names the argument and the rule).
    """

    def __init__(
        self,
        device: str | None = None,
        init_scale: float = 2.0**16,
        *,
        target_format: FormatName = "fp16",
        headroom: float = 2.0,
        amax_history_len: int = 16,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float | None = None,
        max_scale: float | None = 2.0**24,
        enabled: bool = True,
    ) -> None:
        name = type(self).__name__
        choice_arg(name, "target_format", target_format, get_args(FormatName))
        fmt = get_format(target_format)
        real_arg(name, "headroom", headroom, low=1.0, unit="the factor kept between amax * scale and the format's"
                 " max; 2.0 is usual")
        int_arg(name, "amax_history_len", amax_history_len, low=1, high=_MAX_AMAX_HISTORY,
                unit="clean steps in the amax window; 16 is usual")
        super().__init__(
            device,
            init_scale,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            min_scale=min_scale,
            max_scale=max_scale,
            enabled=enabled,
        )
        self.target_format = fmt.name
        self.headroom = float(headroom)
        self.amax_history_len = amax_history_len
        self._init_state: dict[str, Any] = {
            "_amax_history": [0.0] * amax_history_len,
            "_extra_headroom": 1.0,
            "_last_overflow_scale": 0.0,
            "_overflow_streak": 0,
        }
        self.underflow_boost = 1.0
        """Headroom given up for measured underflow (:meth:`note_underflow_`): a power of ``growth_factor`` in
        ``[1, headroom]`` multiplying the rule's scale. Host state: it changes only on probe reports and overflows."""
        self.overflowed_since_note = False
        """Whether a step overflowed since the last :meth:`note_underflow_` (from the step's own host sync)."""
        self.raise_blocked_until = 0
        """``step_count`` before which :meth:`note_underflow_` raises nothing (an overflow followed a raise)."""
        self._state: dict[str, torch.Tensor] | None = None  # created next to the scale, like GradScaler's own
        self._step_amax: torch.Tensor | None = None  # scaled gradient amax of this iteration, all optimizers
        self._last_amax: torch.Tensor | None = None

    @property
    def last_amax(self) -> torch.Tensor | None:
        """Unscaled gradient amax seen by the last ``update()`` as a 0-dim device tensor (no sync).

        inf/NaN when that step overflowed, 0 without gradients, None before the first update.
        """
        return self._last_amax

    # ----------------------------------------------------------------------------------------- lazy state
    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._lazy_init_adaptive_state(dev)

    def _lazy_init_adaptive_state(self, dev: torch.device) -> None:
        self._state = {
            key: torch.tensor(self._init_state[key], dtype=dtype, device=dev) for key, dtype in _ADAPTIVE_STATE.items()
        }

    def adopt_device_(self, device_type: str) -> str | None:
        previous = super().adopt_device_(device_type)
        if previous is not None and self._state is not None:
            self._state = {key: tensor.to(device_type) for key, tensor in self._state.items()}
        return previous

    def _read_state(self) -> dict[str, Any]:
        if self._state is None:
            return {key: list(v) if isinstance(v, list) else v for key, v in self._init_state.items()}
        return {key: tensor.tolist() for key, tensor in self._state.items()}

    # ---------------------------------------------------------------------------------------- stepping
    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        # Measured before unscaling (GradScaler's fused-optimizer path passes inv_scale=1 and leaves them scaled, so
        # it is the same on both paths). Folding it into the inf check would save nothing, as GradScaler's kernel
        # checks in the pass that unscales in place.
        self._measure_amax_(optimizer, found_inf.device)
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

    def check_(self, optimizer: torch.optim.Optimizer) -> None:
        # Compact 16-bit weights check without unscaling (their step unscales in FP32): the amax is measured here.
        super().check_(optimizer)
        if self._enabled and self._scale is not None:
            self._measure_amax_(optimizer, self._scale.device)

    def _check_by_pass_(self, optimizer: torch.optim.Optimizer, *, unscale: bool) -> GradPass | None:
        # The check read off the gradient norm's pass (a SpikeGuard or SpikeScore wants the norm): the amax too.
        measured = super()._check_by_pass_(optimizer, unscale=unscale)
        if measured is not None and self._scale is not None:
            self._measure_amax_(optimizer, self._scale.device)
        return measured

    def _measure_amax_(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        """Take the amax of ``optimizer``'s still-scaled gradients into this iteration's (the max over optimizers),
        on ``device``: one extra read of the gradients, wherever the step's check made it (unscaling or not)."""
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    grad = param.grad._values() if param.grad.is_sparse else param.grad
                    by_device[grad.device].append(grad)
        for grads in by_device.values():
            # Sharded (DTensor) gradients: this rank's shard; sync_found_inf_ takes the MAX across ranks.
            grads = [_local(grad) for grad in grads]
            amax = amax_per_tensor(grads).max().to(device, non_blocking=True)
            self._step_amax = amax if self._step_amax is None else torch.maximum(self._step_amax, amax)

    def _sync_values(self, device: torch.device) -> list[torch.Tensor]:
        amax = self._step_amax if self._step_amax is not None else torch.zeros((), device=device)
        # inf for NaN (not nan_to_num: it also turns inf into the largest finite value): MAX with NaN differs between
        # backends, and either one marks the step as overflowing.
        amax = amax.float()
        return [torch.where(torch.isnan(amax), math.inf, amax)]

    def _load_synced_values(self, values: torch.Tensor) -> None:
        self._step_amax = values[0]

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Set the next scale from this iteration's amax and inf checks; all on the device, no host sync.

        Passing ``new_scale`` sets the scale by hand (clamped to the bounds) until the next update measures again.
        """
        # This iteration's overflow, as step()'s sync found it (read before super().update() consumes it).
        overflowed = self._host_found if self._host_found is not None else self.last_step_skipped
        try:
            super().update(new_scale)
        finally:
            self._step_amax = None
        if overflowed and new_scale is None:
            self.overflowed_since_note = True
            if self.underflow_boost > 1.0:
                self.underflow_boost = 1.0  # the headroom given up was needed after all
                self.raise_blocked_until = self.step_count + self._growth_interval

    def _scale_tensors(self) -> list[torch.Tensor]:
        return super()._scale_tensors() + (list(self._state.values()) if self._state is not None else [])

    def _scale_host_state(self) -> dict[str, Any]:
        return {"underflow_boost": self.underflow_boost, "overflowed_since_note": self.overflowed_since_note,
                "raise_blocked_until": self.raise_blocked_until}

    def skip_update_(self, *, overflow: bool = True) -> None:
        super().skip_update_(overflow=overflow)
        self._step_amax = None  # the data's overflow measured nothing

    def note_underflow_(self, underflow_frac: float, *, threshold: float = 0.01) -> bool:
        """Take a measured underflow into account: the fraction of gradient elements, nonzero in FP32, that the run's
        precision flushed to zero (``PrecisionProbe`` calls it after each probe with its ``mp/grad_underflow_frac``).

        Above ``threshold``, when no step overflowed since the last call (nor, after a raise that overflowed, within
        ``growth_interval`` steps of it), the rule gives up one ``growth_factor`` of headroom: the next scales are
        that much higher, at most until ``amax * scale`` reaches the format's max. Host values only, no sync. In
        distributed runs pass the same value on every rank (the probe's average). Returns whether it raised.

        Raises:
            ValueError: ``underflow_frac`` or ``threshold`` is not a fraction.
        """
        name = f"{type(self).__name__}.note_underflow_"
        real_arg(name, "underflow_frac", underflow_frac, low=0.0, high=1.0)
        real_arg(name, "threshold", threshold, low=0.0, high=1.0, high_open=True)
        overflowed, self.overflowed_since_note = self.overflowed_since_note, False
        if not self._enabled or overflowed or underflow_frac <= threshold or self.step_count < self.raise_blocked_until:
            return False
        raised = min(self.underflow_boost * self._growth_factor, self.headroom)
        if raised <= self.underflow_boost:
            return False
        self.underflow_boost = raised
        return True

    def _update_scale_(self, scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor) -> None:
        assert self._state is not None and self._overflow_count is not None and self._min_scale_hits is not None
        found = found_inf > 0
        state = self._state
        history, extra = state["_amax_history"], state["_extra_headroom"]
        last_overflow, streak = state["_last_overflow_scale"], state["_overflow_streak"]
        fmax = get_format(self.target_format).max
        step_amax = self._step_amax if self._step_amax is not None else torch.zeros((), device=scale.device)
        amax = step_amax / scale
        self._last_amax = amax
        measured = torch.isfinite(amax) & (amax > 0)  # an overflowing step's amax is inf/NaN
        torch.where(measured, torch.cat([amax.view(1), history[:-1]]), history, out=history)
        window_amax = history.max()

        # Largest k with window_amax * 2**k * headroom <= fmax, exactly: with window_amax = m * 2**e and
        # fmax / headroom = M * 2**E (mantissas in [0.5, 1)), k = E - e, less one when m > M.
        limit_mantissa, limit_exponent = math.frexp(fmax / self.headroom)
        mantissa, exponent = torch.frexp(window_amax)
        k = limit_exponent - exponent - (mantissa > limit_mantissa).int()
        target = torch.exp2(k.clamp(-126, 126).float())

        # The first clean step after an overflow: gradients that would have fit at the overflowing scale mean the
        # overflow came from something the amax does not see; keep the rule below that scale from now on.
        unexplained = measured & (last_overflow > 0) & (amax * last_overflow <= fmax)
        needed = target / (last_overflow * self._backoff_factor)
        new_extra = torch.where(unexplained, torch.maximum(extra, needed), extra)
        tracker = torch.where(found, 0, growth_tracker + 1)
        relax = tracker >= self._growth_interval
        torch.where(relax, (new_extra / self._growth_factor).clamp_min(1.0), new_extra, out=extra)

        # The k-th consecutive overflow backs off by backoff_factor ** 2**(k-1) (streak counts the earlier ones).
        backed_off = scale * self._backoff_factor ** torch.exp2(streak.clamp(max=_MAX_BACKOFF_DOUBLINGS).float())
        adaptive = torch.where(window_amax > 0, target / extra * self.underflow_boost, scale)
        self._min_scale_hits += (found & (scale <= self.floor)).long()
        last_overflow.copy_(torch.where(found, scale, 0.0))
        torch.where(found, backed_off, adaptive, out=scale)
        scale.clamp_(min=max(self.min_scale or 0.0, SCALE_FLOOR), max=self.max_scale)
        growth_tracker.copy_(torch.where(relax, 0, tracker))
        streak.copy_(torch.where(found, streak + 1, 0))
        self._overflow_count += found.long()

    # --------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """DynamicLossScaler's keys plus ``target_format``, ``headroom``, ``amax_history_len``, ``underflow_boost``,
        ``overflowed_since_note``, ``raise_blocked_until`` and the device state: ``_amax_history`` (list of floats,
        newest first, 0 = empty), ``_extra_headroom`` (float >= 1), ``_last_overflow_scale`` (float, 0 = none) and
        ``_overflow_streak`` (int).

        Python scalars and lists only (``weights_only=True`` loads it). Empty when disabled.
        """
        state = super().state_dict()
        if state:
            state.update(
                target_format=self.target_format,
                headroom=self.headroom,
                amax_history_len=self.amax_history_len,
                underflow_boost=self.underflow_boost,
                overflowed_since_note=self.overflowed_since_note,
                raise_blocked_until=self.raise_blocked_until,
                **self._read_state(),
            )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (strict), or from a plain ``torch.amp.GradScaler`` state dict.

        Raises:
            RuntimeError: the dict is empty (saved with scaling disabled?).
            KeyError: a key is missing or unknown.
            ValueError: ``_amax_history`` does not hold ``amax_history_len`` values.
        """
        if self._enabled and isinstance(state_dict, dict) and set(state_dict) != GRADSCALER_KEYS and set(
                state_dict) == set(self.state_dict()):
            self._check_adaptive(state_dict)
        super().load_state_dict(state_dict)
        if not self._enabled or set(state_dict) == GRADSCALER_KEYS:
            return  # a GradScaler checkpoint carries no amax state: keep ours as constructed
        history = [float(v) for v in state_dict["_amax_history"]]
        self.target_format = get_format(state_dict["target_format"]).name
        self.headroom = float(state_dict["headroom"])
        self.amax_history_len = len(history)
        self.underflow_boost = float(state_dict["underflow_boost"])
        self.overflowed_since_note = bool(state_dict["overflowed_since_note"])
        self.raise_blocked_until = int(state_dict["raise_blocked_until"])
        self._init_state = {key: state_dict[key] for key in _ADAPTIVE_STATE}
        if self._state is not None:
            self._lazy_init_adaptive_state(self._state["_amax_history"].device)

    def _check_adaptive(self, state: dict[str, Any]) -> None:
        call = f"{type(self).__name__}.load_state_dict"
        choice_arg(call, "target_format", state["target_format"], get_args(FormatName))
        headroom = real_arg(call, "headroom", state["headroom"], low=1.0)
        length = int_arg(call, "amax_history_len", state["amax_history_len"], low=1, high=_MAX_AMAX_HISTORY)
        real_arg(call, "underflow_boost", state["underflow_boost"], low=1.0, high=headroom,
                 unit="a power of growth_factor in [1, headroom]")
        bool_arg(call, "overflowed_since_note", state["overflowed_since_note"])
        int_arg(call, "raise_blocked_until", state["raise_blocked_until"], low=0, high=None)
        history = state["_amax_history"]
        if not isinstance(history, (list, tuple)) or len(history) != length:
            raise ValueError(
                f"{call}(_amax_history={history!r}): must be a list of amax_history_len={length!r} values; the"
                " checkpoint is corrupt."
            )
        for value in history:
            real_arg(call, "_amax_history", value, low=0.0, unit="unscaled amaxes, 0 for an empty slot")
        real_arg(call, "_extra_headroom", state["_extra_headroom"], low=1.0)
        real_arg(call, "_last_overflow_scale", state["_last_overflow_scale"], low=0.0, unit="0 when none")
        int_arg(call, "_overflow_streak", state["_overflow_streak"], low=0)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:
            state.update(_init_state=self._read_state(), _state=None, _step_amax=None, _last_amax=None)
        return state

"""Loss scalers: drop-in replacements for ``torch.amp.GradScaler`` on any device."""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from typing import Any, get_args

import torch
from torch.amp.grad_scaler import OptState

from lit_mpstable.core.validate import bool_arg, choice_arg, int_arg, real_arg
from lit_mpstable.core.formats import FormatName, get_format
from lit_mpstable.core.telemetry import amax_per_tensor

__all__ = ["AdaptiveLossScaler", "DynamicLossScaler", "ForeignScaler", "StateKeyError", "StaticLossScaler"]

# The keys torch.amp.GradScaler.state_dict() writes; a dict with exactly these loads as a legacy checkpoint.
_GRADSCALER_KEYS = frozenset({"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})


_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps")
_DEVICE_TENSORS = ("_scale", "_growth_tracker", "_hysteresis_tracker", "_overflow_count", "_min_scale_hits")


def resolve_device(call: str, device: str | None) -> str:
    """The device type a scaler is built for: ``device``, or for None CUDA when available, else the CPU.

    Raises:
        ValueError: not a device type a loss scaler runs on.
    """
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice_arg(call, "device", device, _DEVICE_TYPES)


class StateKeyError(KeyError, ValueError):
    """A loaded state dict's keys differ from the expected ones (a ``KeyError``, and a ``ValueError`` like every other
    refused loaded value)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _check_loaded(call: str, state: dict[str, Any], *, floor: float) -> None:
    """Validate a DynamicLossScaler (or plain GradScaler) state dict field by field, as the constructor does.

    Raises:
        TypeError: a field has the wrong type (``"False"`` is not a bool, ``3.0`` is not an int).
        ValueError: a field is out of range, or two fields disagree (each message names them).
    """
    real_arg(call, "scale", state["scale"], low=floor, unit="the scale must be finite and >= 2**-126 (or min_scale)"
             " so that 1/scale is finite; the checkpoint is corrupt")
    real_arg(call, "growth_factor", state["growth_factor"], low=1.0, low_open=True, unit="clean steps grow the scale"
             " by it")
    real_arg(call, "backoff_factor", state["backoff_factor"], low=0.0, high=1.0, low_open=True, high_open=True,
             unit="an overflow shrinks the scale by it")
    int_arg(call, "growth_interval", state["growth_interval"], low=1)
    int_arg(call, "_growth_tracker", state["_growth_tracker"], low=0, unit="clean steps since the last growth")
    if "hysteresis" not in state:
        return
    int_arg(call, "hysteresis", state["hysteresis"], low=1)
    int_arg(call, "_hysteresis_tracker", state["_hysteresis_tracker"], low=0, high=state["hysteresis"],
            unit="overflows still tolerated, at most hysteresis")
    real_arg(call, "min_scale", state["min_scale"], low=0.0, low_open=True, none=True)
    real_arg(call, "max_scale", state["max_scale"], low=0.0, low_open=True, none=True)
    if state["min_scale"] is not None and state["max_scale"] is not None and state["min_scale"] > state["max_scale"]:
        raise ValueError(f"{call}(min_scale={state['min_scale']!r}, max_scale={state['max_scale']!r}): min_scale must"
                         " be <= max_scale; the checkpoint is corrupt.")
    if state["min_scale"] is not None and state["scale"] < state["min_scale"]:
        raise ValueError(f"{call}(scale={state['scale']!r}, min_scale={state['min_scale']!r}): the scale must be >="
                         " min_scale; the checkpoint is corrupt.")
    for key in ("overflow_count", "min_scale_hits", "step_count"):
        int_arg(call, key, state[key], low=0, high=None, unit="a counter")


def _check_new_scale(call: str, new_scale: Any) -> None:
    """``update(new_scale=...)``: a finite scale >= 2**-126, as a float or a one-element tensor (read: one sync)."""
    if isinstance(new_scale, torch.Tensor):
        if new_scale.numel() != 1 or not new_scale.is_floating_point():
            raise ValueError(f"{call}(new_scale={new_scale!r}): a one-element floating tensor or a float is needed.")
        value = float(new_scale.detach().reshape(()).item())
    else:
        value = new_scale
    real_arg(call, "new_scale", value, low=_SCALE_FLOOR, unit="a finite scale >= 2**-126, so that 1/scale is finite")


class DynamicLossScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` plus hysteresis, scale bounds, overflow counters and a host-side skip flag.

    With default arguments it follows GradScaler step for step (same scale trajectory, same skipped steps)
    until the scale would pass ``max_scale`` (2**24, reached only after 8 growth intervals of clean steps).

    - ``hysteresis=k`` backs off only on the k-th overflowing step since the scale last grew (DeepSpeed and
      Megatron-LM semantics): every overflow still skips its step and resets the growth tracker, but isolated
      overflows no longer halve the scale. Once used up, each further overflow backs off until the scale grows.
    - ``min_scale``/``max_scale`` bound the scale. An overflow while already at ``min_scale`` is counted in
      ``min_scale_hits`` and warned about from the second such step on: the model overflows even at the
      smallest allowed scale, which scaling alone cannot fix.
    - ``last_step_skipped`` is a Python bool set from the one host synchronisation GradScaler's ``step``
      already makes; ``overflow_count`` stays on the device until read.
    - Distributed: :meth:`sync_found_inf_` between ``unscale_`` and ``step`` makes every rank skip together.

    Raises:
        ValueError: an argument is out of range (each message names the argument and the rule).
    """

    def __init__(
        self,
        device: str | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = 2.0**24,
        enabled: bool = True,
    ) -> None:
        name = type(self).__name__
        device = resolve_device(name, device)
        real_arg(name, "init_scale", init_scale, low=_SCALE_FLOOR, unit="the scale stays >= 2**-126, the smallest"
                 " normal float32, so that 1/scale is finite; 2.**16 is usual")
        real_arg(name, "growth_factor", growth_factor, low=1.0, low_open=True,
                 unit="clean steps grow the scale by it; 2.0 is usual")
        real_arg(name, "backoff_factor", backoff_factor, low=0.0, high=1.0, low_open=True, high_open=True,
                 unit="an overflow shrinks the scale by it; 0.5 is usual")
        int_arg(name, "growth_interval", growth_interval, low=1, unit="clean steps between growths; torch keeps the"
                " tracker in int32")
        int_arg(name, "hysteresis", hysteresis, low=1, unit="overflowing steps tolerated before a backoff; 1 backs"
                " off on every overflow, as GradScaler does")
        real_arg(name, "min_scale", min_scale, low=0.0, low_open=True, none=True)
        real_arg(name, "max_scale", max_scale, low=0.0, low_open=True, none=True)
        bool_arg(name, "enabled", enabled)
        if min_scale is not None and max_scale is not None and min_scale > max_scale:
            raise ValueError(f"{name}(min_scale={min_scale!r}, max_scale={max_scale!r}): min_scale must be <= max_scale.")
        if min_scale is not None and init_scale < min_scale:
            raise ValueError(f"{name}(init_scale={init_scale!r}): init_scale must be >= min_scale={min_scale!r}.")
        # An init_scale above max_scale is accepted, as GradScaler accepts any: the cap applies to growth.
        # torch disables a "cuda" GradScaler on a machine without CUDA (FP16 would then train unscaled); ours stays
        # enabled and is adopted onto the run's device by the plugin (adopt_device_), or works on whatever device
        # the loss lives on in a plain loop: the scale tensor is created next to the first scaled output.
        super().__init__("cpu" if device == "cuda" and not torch.cuda.is_available() else device, init_scale,
                         growth_factor, backoff_factor, growth_interval, enabled)
        self._device = device
        self.allow_fp16_grads = False
        """Unscale FP16 gradients in place (GradScaler refuses them: small values flush). Set by the precision
        core for ``"16-true"`` without master weights, where the gradients themselves are FP16."""
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.last_step_skipped = False
        self.last_data_fault = False
        """Whether the last iteration was ended by :meth:`skip_update_` (an overflow blamed on the data)."""
        self.step_count = 0
        """Calls of ``update()`` that consumed inf checks, i.e. iterations; a host int, no sync."""
        # Device-side state, created lazily next to the scale (same device), like GradScaler's own.
        self._hysteresis_tracker: torch.Tensor | None = None
        self._overflow_count: torch.Tensor | None = None
        self._min_scale_hits: torch.Tensor | None = None
        self._init_hysteresis_tracker = hysteresis
        self._init_overflow_count = 0
        self._init_min_scale_hits = 0
        self._min_scale_warned = False
        # Host mirror of the iteration's overflow and of the growth tracker, fed by step()'s sync (see update()).
        self._host_found: bool | None = None
        self._host_overflows = 0
        self._host_tracker: int | None = 0

    # ----------------------------------------------------------------------------------------- lazy state
    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=dev)
        self._overflow_count = torch.full((), self._init_overflow_count, dtype=torch.int64, device=dev)
        self._min_scale_hits = torch.full((), self._init_min_scale_hits, dtype=torch.int64, device=dev)

    def get_scale_tensor(self) -> torch.Tensor:
        """The scale as the 0-dim device tensor the scaler updates in place (``get_scale()`` reads it to the host,
        which syncs; this does not). Valid after the first ``scale()``.

        Raises:
            RuntimeError: the scaler is disabled, or has no scale yet.
        """
        if not self._enabled or self._scale is None:
            raise RuntimeError(f"{type(self).__name__}.get_scale_tensor(): no scale yet (disabled, or before scale()).")
        return self._scale

    def ensure_state_(self, device: torch.device | str) -> None:
        """Create the scale and tracker tensors on ``device`` if ``scale()`` has not yet (a scaler used only to check
        gradients, at scale 1, never scales a loss)."""
        if self._enabled and self._scale is None:
            self._lazy_init_scale_growth_tracker(torch.device(device))

    def adopt_device_(self, device_type: str) -> str | None:
        """Follow the run's device type (a plugin calls it with its own); returns the type the scaler was built for
        when that differs (for the caller to say so), else None. State tensors already created move along."""
        if device_type == self._device:
            return None
        previous, self._device = self._device, device_type
        for attr in _DEVICE_TENSORS:
            tensor = getattr(self, attr, None)
            if isinstance(tensor, torch.Tensor):
                setattr(self, attr, tensor.to(device_type))
        return previous

    # ---------------------------------------------------------------------------------------- stepping
    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any):
        # The one host sync GradScaler makes per step lives here; record its answer for free.
        found_inf = sum(v.item() for v in optimizer_state["found_inf_per_device"].values())
        self._note_skip(bool(found_inf))
        if found_inf:
            return None
        return optimizer.step(*args, **kwargs)

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16 or self.allow_fp16_grads)

    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this iteration's gradients of ``optimizer`` hold inf/NaN (after ``unscale_``). Reads the device
        flag (a host sync; ``step`` reads the same flag, so calling both costs one device round trip)."""
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.READY:
            raise RuntimeError(f"{type(self).__name__}.found_inf() needs unscale_() first.")
        return bool(sum(v.item() for v in state["found_inf_per_device"].values()))

    def check_(self, optimizer: torch.optim.Optimizer) -> None:
        """Record whether ``optimizer``'s gradients hold inf/NaN without unscaling them (they stay scaled, in their own
        dtype): for a caller that unscales itself, in FP32, as compact 16-bit weights do. Then
        :meth:`sync_found_inf_`, :meth:`found_inf`, :meth:`step_with` and :meth:`update` work as after ``unscale_``.
        No host sync.

        Raises:
            RuntimeError: ``unscale_`` or ``check_`` already ran for this optimizer in this iteration.
        """
        if not self._enabled:
            return
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is not OptState.READY:
            raise RuntimeError(f"{type(self).__name__}.check_() after unscale_()/check_() in the same iteration.")
        scale, _ = self._check_scale_growth_tracker("check_")
        one = torch.ones((), dtype=torch.float32, device=scale.device)
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        state["found_inf_per_device"] = super()._unscale_grads_(optimizer, one, found_inf, True)
        state["stage"] = OptState.UNSCALED

    def step_with(self, optimizer: torch.optim.Optimizer, update: Any) -> Any:
        """``step`` with the caller's own update: ``update()`` runs unless this iteration's gradients of ``optimizer``
        hold inf/NaN (checked by ``unscale_`` or :meth:`check_`; one host sync, as ``step``'s), and its result is
        returned; ``last_step_skipped`` is set either way. Call :meth:`update` after, as after ``step``."""
        if not self._enabled:
            self.last_step_skipped = False
            return update()
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.READY:
            self.check_(optimizer)
        found = bool(sum(v.item() for v in state["found_inf_per_device"].values()))
        self._note_skip(found)
        state["stage"] = OptState.STEPPED
        return None if found else update()

    def forget_(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop this iteration's record for ``optimizer`` (unscaled, inf checks) without touching the scale: the
        iteration was discarded, so the next one starts fresh."""
        self._per_optimizer_states.pop(id(optimizer), None)

    def fold_found_inf_(self, optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> torch.Tensor | None:
        """Add a device flag (inf/NaN found elsewhere: what the step is about to read) into ``optimizer``'s inf check
        after ``unscale_``/``check_``, so ``step`` skips on it with its one host sync; returns the check as it was
        (a device tensor; None before ``unscale_``). No host sync."""
        return _fold_found_inf(self, optimizer, flag) if self._enabled else None

    def sync_found_inf_(self, optimizer: torch.optim.Optimizer, *, group: Any = None) -> None:
        """Agree across ranks on whether this step's gradients hold inf/NaN, so every rank skips it or none does.

        Unscales first if ``unscale_`` has not run, then makes one all-reduce (MAX) of this optimizer's found-inf
        flags, on the scale's device (no host sync); ``AdaptiveLossScaler`` puts its gradient amax into the same
        all-reduce. Call it on every rank after ``unscale_`` and before ``step``; the skip, the scale, the counters
        and the adaptive statistics then stay identical on every rank. A no-op without an initialised
        ``torch.distributed`` or with one process.

        DDP all-reduces gradients during backward, so an inf produced there reaches every rank anyway. This covers
        what DDP does not: an inf written after backward on some ranks (a hook, gradient surgery) and sharded
        gradients, where each rank checks only its shard (DTensor gradients are already reduced inside ``unscale_``;
        a second MAX costs one scalar all-reduce and changes nothing).

        Args:
            group: the process group to agree in; default: the world.

        Raises:
            RuntimeError: called after ``step()`` for this optimizer.
        """
        if not self._enabled:
            return
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(
                f"{type(self).__name__}.sync_found_inf_() is being called after step(); call it between unscale_() and"
                " step()."
            )
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if _world_size(group) == 1:
            return
        scale, _ = self._check_scale_growth_tracker("sync_found_inf_")
        found = state["found_inf_per_device"]
        # A rank without gradients for this optimizer still takes part in the collective, with 0.
        local = sum((flag.to(scale.device) for flag in found.values()), torch.zeros((), device=scale.device))
        values = torch.stack([local.float(), *self._sync_values(scale.device)])
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX, group=group)
        for flag in found.values():
            flag.copy_(values[0])
        self._load_synced_values(values[1:])

    def _sync_values(self, device: torch.device) -> list[torch.Tensor]:
        """0-dim float32 tensors that :meth:`sync_found_inf_` reduces with MAX next to the found-inf flag."""
        return []

    def _load_synced_values(self, values: torch.Tensor) -> None:
        """Take back the reduced :meth:`_sync_values`."""

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (if not done yet), then step unless the gradients hold inf/NaN; see ``GradScaler.step``.

        For optimizers that skip inside their own fused ``step`` (``fused=True``), reading whether the step was
        skipped costs one host synchronisation, the same one an unfused optimizer pays in GradScaler.
        """
        if not self._enabled:
            self.last_step_skipped = False
            return optimizer.step(*args, **kwargs)
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            result = super().step(optimizer, *args, **kwargs)
            found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()
            self._note_skip(bool(sum(v.item() for v in found)))
            return result
        return super().step(optimizer, *args, **kwargs)

    def _note_skip(self, skipped: bool) -> None:
        # What the step's host sync found, kept for update(): an iteration overflowed if any optimizer's step did.
        self.last_step_skipped = skipped
        self._host_found = skipped or bool(self._host_found)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale from this iteration's inf checks; all on the device, no host sync.

        The GradScaler rule (backoff on overflow, growth after ``growth_interval`` clean steps) with hysteresis
        and bounds added. Passing ``new_scale`` sets the scale by hand (clamped to the bounds).
        """
        if not self._enabled:
            return
        self.last_data_fault = False
        scale, growth_tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            _check_new_scale(f"{type(self).__name__}.update", new_scale)
            super().update(float(new_scale) if not isinstance(new_scale, torch.Tensor) else new_scale)
            self._clamp_(scale, self.max_scale)
            self._host_found = None  # this iteration's outcome is consumed; the device tracker is untouched
            return
        found_infs = [
            found_inf.to(device=scale.device, non_blocking=True)
            for state in self._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        if not found_infs:
            raise AssertionError("No inf checks were recorded prior to update.")
        found_inf = found_infs[0] if len(found_infs) == 1 else torch.stack(found_infs).sum()
        self._update_scale_(scale, growth_tracker, found_inf)
        self._host_found = None
        self._per_optimizer_states.clear()
        self.step_count += 1
        if self.last_step_skipped and not self._min_scale_warned:
            # Host already knows this step overflowed; one extra read on overflow steps only.
            if int(self._min_scale_hits.item()) >= 2:
                self._min_scale_warned = True
                where = (f"min_scale={self.min_scale!r}" if self.min_scale is not None and self.min_scale >= _SCALE_FLOOR
                         else "the lowest scale 2**-126 (below it 1/scale is no longer finite)")
                warnings.warn(
                    f"{type(self).__name__}: gradients overflowed again at {where}; loss scaling cannot fix this. Look"
                    " for the module producing inf/NaN or fall back to a wider format.",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def skip_update_(self, *, overflow: bool = True) -> None:
        """End this iteration without updating the scale: its overflow came from the data (an inf/NaN batch), or
        entered after the gradient check, which says nothing about the scale. The step stays skipped (and counted as
        an overflow if ``overflow``); the scale, the growth and hysteresis trackers are left as they were, as if the
        batch had never come. No host sync."""
        if not self._enabled:
            return
        self._per_optimizer_states.clear()
        if self._scale is not None:
            # A scale that is itself inf/NaN/0 (written into the scaler at run time) is what made the step fail:
            # start again from init_scale rather than skip every later step.
            usable = torch.isfinite(self._scale) & (self._scale >= self.floor)
            self._scale.copy_(torch.where(usable, self._scale, torch.full_like(self._scale, self._init_scale)))
        self._host_overflows += int(bool(self._host_found) and overflow)
        self._host_found = None
        self.step_count += 1
        self.last_data_fault = True

    def _update_scale_(self, scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor) -> None:
        assert self._hysteresis_tracker is not None and self._overflow_count is not None
        assert self._min_scale_hits is not None
        host_found = self._host_found
        if self.hysteresis == 1 and host_found is not None:
            # The host already knows (from step()'s sync) whether this iteration overflowed, and so whether the
            # scale can grow now: a clean step costs GradScaler's one fused kernel, nothing more.
            if host_found:
                self._min_scale_hits += scale <= self.floor
            self._host_overflows += int(host_found)
            # None: the mirror lost track (an update without step()); an overflow puts it back in step (0).
            tracker = 0 if host_found else None if self._host_tracker is None else self._host_tracker + 1
            grew = tracker is None or tracker >= self._growth_interval
            self._host_tracker = 0 if tracker is not None and grew else tracker
            cap = self._growth_cap(scale) if grew else None
            torch._amp_update_scale_(
                scale, growth_tracker, found_inf.float(), self._growth_factor, self._backoff_factor, self._growth_interval
            )
            if cap is not None or host_found:
                self._clamp_(scale, cap)
            return
        found = found_inf > 0
        self._host_tracker = None  # the device decides here; the host mirror no longer knows the tracker
        self._min_scale_hits += found & (scale <= self.floor)
        self._overflow_count += found
        cap = self._growth_cap(scale)
        if self.hysteresis == 1:
            torch._amp_update_scale_(
                scale, growth_tracker, found_inf.float(), self._growth_factor, self._backoff_factor, self._growth_interval
            )
            self._clamp_(scale, cap)
            return
        # The same arithmetic as torch._amp_update_scale_ (float32 scale, int32 tracker, growth only to a finite
        # value), written with tensor ops so hysteresis fits in without a host sync.
        hysteresis_left = self._hysteresis_tracker - found.int()
        backoff = found & (hysteresis_left <= 0)
        tracker = torch.where(found, 0, growth_tracker + 1)
        grow = tracker >= self._growth_interval
        grown = scale * self._growth_factor
        grow = grow & torch.isfinite(grown)
        new_scale = torch.where(backoff, scale * self._backoff_factor, torch.where(grow, grown, scale))
        scale.copy_(new_scale)
        self._clamp_(scale, cap)
        growth_tracker.copy_(torch.where(tracker >= self._growth_interval, 0, tracker))
        self._hysteresis_tracker.copy_(torch.where(grow, self.hysteresis, hysteresis_left.clamp_min(0)))

    def _growth_cap(self, scale: torch.Tensor) -> torch.Tensor | None:
        # Growth may not pass max_scale, but a scale already above it (init_scale > max_scale, as GradScaler
        # accepts) is not pulled down either: the cap is max(scale before the update, max_scale).
        return None if self.max_scale is None else scale.clamp(min=self.max_scale)

    def _clamp_(self, scale: torch.Tensor, cap: torch.Tensor | float | None) -> None:
        """Bound the scale: below by ``min_scale``, above by ``cap`` (a growth cap, or ``max_scale``) if given."""
        if isinstance(cap, torch.Tensor):
            torch.minimum(scale, cap, out=scale)
        elif cap is not None:
            scale.clamp_(max=cap)
        scale.clamp_(min=self.floor)

    @property
    def floor(self) -> float:
        """The lowest scale: ``min_scale``, and never below 2**-126 (the smallest normal float32), where 1/scale is
        still finite (below it the unscaled gradients would be inf, and a scale of 0 writes NaN)."""
        return max(self.min_scale or 0.0, _SCALE_FLOOR)

    # ------------------------------------------------------------------------------------------ reading
    @property
    def overflow_count(self) -> int:
        """Iterations whose gradients held inf/NaN. Reading it synchronises with the device."""
        device = self._init_overflow_count if self._overflow_count is None else int(self._overflow_count.item())
        return device + self._host_overflows

    @property
    def min_scale_hits(self) -> int:
        """Overflowing iterations that happened while the scale was already at ``min_scale`` (syncs)."""
        return self._init_min_scale_hits if self._min_scale_hits is None else int(self._min_scale_hits.item())

    def _get_hysteresis_tracker(self) -> int:
        if self._hysteresis_tracker is None:
            return self._init_hysteresis_tracker
        return int(self._hysteresis_tracker.item())

    # --------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys plus ``hysteresis``, ``min_scale``, ``max_scale`` and the counters.

        Keys: ``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``_growth_tracker`` (as
        GradScaler), ``hysteresis``, ``_hysteresis_tracker``, ``min_scale``, ``max_scale``, ``overflow_count``,
        ``min_scale_hits``, ``step_count``. Python scalars only (``weights_only=True`` loads it). Empty when disabled.
        """
        if not self._enabled:
            return {}
        state = super().state_dict()
        state.update(
            hysteresis=self.hysteresis,
            _hysteresis_tracker=self._get_hysteresis_tracker(),
            min_scale=self.min_scale,
            max_scale=self.max_scale,
            overflow_count=self.overflow_count,
            min_scale_hits=self.min_scale_hits,
            step_count=self.step_count,
        )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`, or from a plain ``torch.amp.GradScaler`` state dict.

        Raises:
            RuntimeError: the dict is empty (saved with scaling disabled?).
            KeyError: a key is missing or unknown.
        """
        if not self._enabled:
            return
        call = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state_dict, dict):
            raise TypeError(f"{call}({state_dict!r}): expected the dict state_dict() returns.")
        if not state_dict:
            raise RuntimeError(f"{call}: the state dict is empty; was it saved with scaling disabled?")
        keys = set(state_dict)
        if keys == _GRADSCALER_KEYS:
            # Written by torch.amp.GradScaler (e.g. Lightning's own "16-mixed"): keep our extra state as constructed.
            _check_loaded(call, state_dict, floor=self.floor)
            self._host_found, self._host_tracker = None, state_dict["_growth_tracker"]
            super().load_state_dict(state_dict)
            return
        expected = set(self.state_dict())
        if keys != expected:
            missing, unknown = sorted(expected - keys), sorted(keys - expected)
            raise StateKeyError(
                f"{call}: missing keys {missing}, unknown keys {unknown}; was it saved by a different scaler class or"
                " version?"
            )
        min_scale = state_dict["min_scale"]
        _check_loaded(call, state_dict, floor=max(min_scale or 0.0, _SCALE_FLOOR) if isinstance(
            min_scale, (int, float)) and not isinstance(min_scale, bool) else _SCALE_FLOOR)
        self._host_found, self._host_tracker = None, state_dict["_growth_tracker"]
        super().load_state_dict(state_dict)
        self.hysteresis = int(state_dict["hysteresis"])
        self.min_scale = state_dict["min_scale"]
        self.max_scale = state_dict["max_scale"]
        self.step_count = int(state_dict["step_count"])
        self._init_hysteresis_tracker = int(state_dict["_hysteresis_tracker"])
        self._init_overflow_count, self._host_overflows = int(state_dict["overflow_count"]), 0
        self._init_min_scale_hits = int(state_dict["min_scale_hits"])
        for tensor, value in (
            (self._hysteresis_tracker, self._init_hysteresis_tracker),
            (self._overflow_count, self._init_overflow_count),
            (self._min_scale_hits, self._init_min_scale_hits),
        ):
            if tensor is not None:
                tensor.fill_(value)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:
            state.update(
                _init_hysteresis_tracker=self._get_hysteresis_tracker(),
                _init_overflow_count=self.overflow_count,
                _host_overflows=0,
                _init_min_scale_hits=self.min_scale_hits,
                _hysteresis_tracker=None,
                _overflow_count=None,
                _min_scale_hits=None,
            )
        return state


class StaticLossScaler(DynamicLossScaler):
    """A fixed loss scale: overflowing steps are still skipped and counted, but the scale never changes."""

    def __init__(self, device: str | None = None, init_scale: float = 2.0**16, enabled: bool = True) -> None:
        super().__init__(device, init_scale=init_scale, max_scale=None, enabled=enabled)

    def _update_scale_(self, scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor) -> None:
        assert self._overflow_count is not None
        self._overflow_count += found_inf > 0


class ForeignScaler:
    """A scaler that is not one of ours (a ``torch.amp.GradScaler`` subclass, or any object with GradScaler's
    methods), seen through the protocol the stepper uses: ``last_step_skipped`` after each ``step``, ``found_inf``,
    ``forget_``, ``ensure_state_``, ``skip_update_`` and a floored scale.

    Which way the outcome is read is decided once, here: a GradScaler (subclass) keeps each optimizer's inf checks in
    ``_per_optimizer_states`` until ``update()``, and its own step reads them; anything else is asked whether it
    called ``optimizer.step()`` (a step post-hook), which is how GradScaler skips an unfused optimizer.
    """

    def __init__(self, scaler: Any) -> None:
        self.inner = scaler
        self.gradscaler = isinstance(scaler, torch.amp.GradScaler)
        self.last_step_skipped = False

    def is_enabled(self) -> bool:
        return bool(self.inner.is_enabled())

    def scale(self, outputs: Any) -> Any:
        return self.inner.scale(outputs)

    def get_scale(self) -> float:
        return self.inner.get_scale()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.inner.unscale_(optimizer)

    def ensure_state_(self, device: torch.device | str) -> None:
        """Nothing to create: only a scaler that scaled a loss unscales."""

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
        scale = getattr(self.inner, "_scale", None) if self.gradscaler else None
        if isinstance(scale, torch.Tensor):
            scale.clamp_(min=_SCALE_FLOOR)  # 1/scale stays finite (GradScaler's own rule would reach 0)

    def skip_update_(self, *, overflow: bool = True) -> None:
        """End the iteration without an update (its overflow was the data's): a GradScaler's checks are dropped, its
        scale and growth tracker untouched; another scaler is updated (it cannot be told otherwise)."""
        if self.gradscaler:
            self.inner._per_optimizer_states.clear()
        else:
            self.update()

    def fold_found_inf_(self, optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> torch.Tensor | None:
        """:meth:`DynamicLossScaler.fold_found_inf_` for a GradScaler; None (nothing folded) for any other scaler."""
        return _fold_found_inf(self.inner, optimizer, flag) if self.gradscaler else None

    def forget_(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop this iteration's record for ``optimizer`` (a GradScaler's per-optimizer state)."""
        if self.gradscaler:
            self.inner._per_optimizer_states.pop(id(optimizer), None)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)


def _fold_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, flag: torch.Tensor
                    ) -> torch.Tensor | None:
    """Add ``flag`` (a 0-dim device bool) into ``optimizer``'s inf check of this iteration, which ``step`` reads in its
    one host sync; returns the check as it was before (a device tensor), or None when there is none yet."""
    state = scaler._per_optimizer_states.get(id(optimizer))
    flags = list(state["found_inf_per_device"].values()) if state else []
    if not flags:
        return None
    before = torch.stack([f.to(flags[0].device) for f in flags]).sum()
    # A maximum, not a sum: fused optimizers skip only on found_inf == 1 exactly.
    torch.maximum(flags[0], flag.to(device=flags[0].device, dtype=flags[0].dtype), out=flags[0])
    return before


def _world_size(group: Any) -> int:
    dist = torch.distributed
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


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
# Lowest scale when min_scale is None: the smallest normal float32, so 1/scale stays finite.
_SCALE_FLOOR = torch.finfo(torch.float32).tiny
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

    The amax costs one extra read of the gradients (a single multi-tensor kernel on CUDA) and stays on the device;
    the only host synchronisation is the skip decision GradScaler makes. With sharded (DTensor) gradients it is this
    rank's until :meth:`sync_found_inf_` takes the MAX over the ranks: call it in distributed runs (the plugin does).

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
        # The amax of the still-scaled gradients (GradScaler's fused-optimizer path passes inv_scale=1 and leaves them
        # scaled, so measuring before unscaling is the same on both paths). One extra read of the gradients; folding
        # it into the inf check would save nothing, as GradScaler's kernel checks in the pass that unscales in place.
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    grad = param.grad._values() if param.grad.is_sparse else param.grad
                    by_device[grad.device].append(grad)
        for grads in by_device.values():
            # Sharded (DTensor) gradients: this rank's shard; sync_found_inf_ takes the MAX across ranks.
            grads = [_local(grad) for grad in grads]
            amax = amax_per_tensor(grads).max().to(found_inf.device, non_blocking=True)
            self._step_amax = amax if self._step_amax is None else torch.maximum(self._step_amax, amax)
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

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
        scale.clamp_(min=max(self.min_scale or 0.0, _SCALE_FLOOR), max=self.max_scale)
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
        if self._enabled and isinstance(state_dict, dict) and set(state_dict) != _GRADSCALER_KEYS and set(
                state_dict) == set(self.state_dict()):
            self._check_adaptive(state_dict)
        super().load_state_dict(state_dict)
        if not self._enabled or set(state_dict) == _GRADSCALER_KEYS:
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

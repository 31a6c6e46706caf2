"""The GradScaler-compatible loss scalers: ``DynamicLossScaler`` (GradScaler plus hysteresis, bounds and counters,
and the per-iteration inf/NaN checks the stepper reads) and ``StaticLossScaler`` (a fixed scale)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from operator import attrgetter
from typing import Any

import torch
from torch.amp.grad_scaler import OptState
from torch.distributed import ProcessGroup

from lit_mpstable.core.scaling.scaler_state import (
    GRADSCALER_KEYS,
    SCALE_FLOOR,
    check_init_args,
    check_loaded,
    check_new_scale,
    check_state_keys,
    resolve_device,
)
from lit_mpstable.core.tensors import GradOff, GradPass, first_grad_device, grad_pass, one_on

_DEVICE_TENSORS = ("_scale", "_growth_tracker", "_hysteresis_tracker", "_overflow_count", "_min_scale_hits")


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

    checks_without_unscaling = True
    """:meth:`check_` (``check_grads_(unscale=False)``) and :meth:`step_with` work here (the ``LossScaler``
    protocol's capability flag)."""

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
        check_init_args(name, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
                        max_scale, enabled)
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
        self.checks_only = False
        """Set by the stepper on the scale-1 check it builds without a scaler (``scaler=None``/``"auto"`` outside FP16):
        no loss is ever scaled by it and a static scale never moves, so :meth:`check_grads_` runs GradScaler's unscale
        kernel at exactly 1 without computing ``1 / scale`` every step (the same kernel, flags and gradients)."""
        self.measures_norm = False
        """Set by the stepper when the step reads the gradients' L2 norm (a SpikeGuard, a clip by norm): the gradient
        check then makes the step's one pass over them (:meth:`grad_pass`)."""
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
        # Whether this iteration overflowed, as step()'s one host sync found it (None: no step read it yet). The
        # counters and the growth tracker live on the device only, read when asked (logging steps).
        self._host_found: bool | None = None
        # Where the scale stood before the last update that may have backed off (see undo_backoff_); None when the
        # last update was clean, set by hand, or a skip_update_.
        self._before_backoff: tuple[list[torch.Tensor], dict[str, Any]] | None = None
        # The scale-1 check's found-inf flag of the last iteration, which its step read as 0.0 and nothing wrote since
        # (StaticLossScaler.update keeps it): the next check starts from it instead of allocating a zero.
        self._spare_flag: torch.Tensor | None = None

    # ----------------------------------------------------------------------------------------- lazy state
    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        # GradScaler's check, with a RuntimeError naming the call and the order where it raises AssertionError.
        if self._scale is None or self._growth_tracker is None:
            raise RuntimeError(
                f"{type(self).__name__}.{funcname}() before scale(): the scale is made by the first scale(loss); each"
                " iteration calls scale(loss), backward, then unscale_/step(optimizer), then update()."
            )
        return self._scale, self._growth_tracker

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
    def _maybe_opt_step(
        self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any
    ):
        # The one host sync GradScaler makes per step lives here; record its answer for free.
        flags = optimizer_state["found_inf_per_device"]
        found_inf = (next(iter(flags.values())).item() if len(flags) == 1  # one device: the usual case
                     else sum(v.item() for v in flags.values()))
        self._note_skip(bool(found_inf))
        if found_inf:
            return None
        return optimizer.step(*args, **kwargs)

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16 or self.allow_fp16_grads)

    # ------------------------------------------------------------------------------------------ inf checks
    # The per-iteration inf/NaN checks GradScaler keeps per optimizer (``_per_optimizer_states``), as the stepper
    # reads them: look without unscaling, read, fold in a flag found elsewhere, agree across ranks, forget.
    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this iteration's gradients of ``optimizer`` hold inf/NaN (after ``unscale_``). Reads the device
        flag (a host sync; ``step`` reads the same flag, so calling both costs one device round trip)."""
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.READY:
            raise RuntimeError(f"{type(self).__name__}.found_inf() needs unscale_() first.")
        return bool(sum(v.item() for v in state["found_inf_per_device"].values()))

    def check_grads_(self, optimizer: torch.optim.Optimizer, device: torch.device | str, *,
                     unscale: bool = True) -> None:
        """The step's gradient check of ``optimizer``, agreed across ranks: the scale's state where the gradients are
        (else on ``device``) if no loss was scaled (the scale-1 check), ``unscale_`` (or, with ``unscale=False``,
        :meth:`check_`, which leaves the gradients scaled), then :meth:`sync_found_inf_` (in a multi-process run). No
        host sync."""
        if self._scale is None:
            self.ensure_state_(first_grad_device(optimizer) or device)
        measured = None
        if self.measures_norm and self._enabled and (self.checks_only or not unscale):
            measured = self._check_by_pass_(optimizer, unscale=unscale)  # the check is the norm's pass
        if measured is None:
            if not unscale:
                self.check_(optimizer)
            elif self.checks_only:
                self._unscale_at_one_(optimizer)
            else:
                self.unscale_(optimizer)
            if self.measures_norm and self._enabled:  # the unscale kernel checked: one pass more, for the norm
                measured = grad_pass(_grads(optimizer), check=False)  # the kernel's flag is the check
        if measured is not None:
            self._per_optimizer_states[id(optimizer)]["grad_pass"] = measured
        if _DIST and torch.distributed.is_initialized():  # one process: nothing to agree (sync_found_inf_'s no-op)
            self.sync_found_inf_(optimizer)

    def grad_pass(self, optimizer: torch.optim.Optimizer) -> GradPass | None:
        """The pass over ``optimizer``'s gradients that this iteration's :meth:`check_grads_` made (their L2 norm as
        it left them, and its finite flag), for the step to read instead of reading the gradients again; None where it
        made none (:attr:`measures_norm` off, sharded gradients)."""
        state = self._per_optimizer_states.get(id(optimizer))
        return state.get("grad_pass") if state else None

    def _check_by_pass_(self, optimizer: torch.optim.Optimizer, *, unscale: bool) -> GradPass | None:
        """The inf/NaN check at scale 1 (``unscale``, the check of a run without a scaler) or without unscaling
        (:meth:`check_`) read off one :func:`~lit_mpstable.core.tensors.grad_pass`: the gradients are read once, for
        the check and the norm together, and written never. None (nothing done) where the pass does not apply."""
        spare = self._spare_flag  # 0.0 as the last step read it: the pass's flag starts from it, no zero to allocate
        measured = grad_pass(grads := _grads(optimizer), spare)
        if measured is None or measured.found is None:
            return None
        if measured.found is spare:
            self._spare_flag = None
        state = self._per_optimizer_states[id(optimizer)]
        call = "unscale_" if unscale else "check_"
        self._check_scale_growth_tracker(call)
        if state["stage"] is not OptState.READY:  # the refusals of _unscale_at_one_ and check_, word for word
            raise RuntimeError(
                f"{type(self).__name__}.check_() after unscale_()/check_() in the same iteration." if not unscale
                else "unscale_() has already been called on this optimizer since the last update()."
                if state["stage"] is OptState.UNSCALED else "unscale_() is being called after step().")
        if unscale and not self.allow_fp16_grads and not measured.fp32 and torch.float16 in set(map(_DTYPE, grads)):
            raise ValueError("Attempting to unscale FP16 gradients.")  # GradScaler's refusal, as the kernel's path
        state["found_inf_per_device"] = {measured.found.device: measured.found}  # the pass's flag is the check's
        state["stage"] = OptState.UNSCALED
        return measured

    def _unscale_at_one_(self, optimizer: torch.optim.Optimizer) -> None:
        # GradScaler.unscale_ with its inverse scale known to be 1 (checks_only): the same stage rules and kernel.
        if not self._enabled:
            return
        scale = self._scale
        if scale is None or self._growth_tracker is None:
            scale, _ = self._check_scale_growth_tracker("unscale_")  # raises, naming the call
        state = self._per_optimizer_states[id(optimizer)]
        stage = state["stage"]
        if stage is not OptState.READY:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update()."
                               if stage is OptState.UNSCALED else "unscale_() is being called after step().")
        found_inf, self._spare_flag = self._spare_flag, None  # 0.0 as the last step read it: no zero to allocate
        if found_inf is None or found_inf.device != scale.device:
            found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        found = _checked_at_one(optimizer, found_inf, allow_fp16=self.allow_fp16_grads)
        state["found_inf_per_device"] = (found if found is not None
                                         else self._unscale_grads_(optimizer, one_on(scale.device), found_inf, False))
        state["stage"] = OptState.UNSCALED

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
        found = nonfinite_on_cpu(optimizer) if scale.device.type == "cpu" else None
        if found is None:  # GradScaler's multi-tensor kernel at an inverse scale of 1 (it writes x * 1 back)
            found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
            found = super()._unscale_grads_(optimizer, one_on(scale.device), found_inf, True)
        state["found_inf_per_device"] = found
        state["stage"] = OptState.UNSCALED

    def step_with(self, optimizer: torch.optim.Optimizer, update: Callable[[], Any]) -> Any:
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

    def check_also_(self, optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor]) -> bool:
        """Check ``tensors`` (what the step reads besides the gradients: parameters, optimizer state) for inf/NaN into
        this iteration's gradient check of ``optimizer``: GradScaler's kernel at an inverse scale of 1 (it writes each
        tensor back unchanged, exactly) into the check's own flag, which the step then reads, so no flag of their own
        is made and folded (two kernels fewer). Returns whether it did; False, nothing done, where the check is not one
        flag on their device (several devices, a gradient pass's flag, no check yet, a tensor elsewhere or sparse):
        the caller checks them apart. No host sync. One process only: the check's flag was agreed across ranks before
        this adds to it."""
        state = self._per_optimizer_states.get(id(optimizer)) if self._enabled else None
        flags = state["found_inf_per_device"] if state else None
        if not flags or len(flags) != 1:
            return False
        ((device, flag),) = flags.items()
        measured = state.get("grad_pass")  # type: ignore[union-attr]
        if (measured is not None and measured.found is flag) or set(map(_DEVICE, tensors)) != {device} or any(
                map(_IS_SPARSE, tensors)):
            return False
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in tensors:
            groups.setdefault(tensor.dtype, []).append(tensor)
        one = one_on(device)
        with _NO_GRAD:
            for group in groups.values():
                torch._amp_foreach_non_finite_check_and_unscale_(group, flag, one)
        return True

    def fold_found_inf_(self, optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> torch.Tensor | None:
        """Add a device flag (inf/NaN found elsewhere: what the step is about to read) into ``optimizer``'s inf check
        after ``unscale_``/``check_``, so ``step`` skips on it with its one host sync; returns the check as it was
        (a device tensor; None before ``unscale_``). No host sync."""
        return fold_found_inf(self, optimizer, flag) if self._enabled else None

    def sync_found_inf_(self, optimizer: torch.optim.Optimizer, *, group: ProcessGroup | None = None) -> None:
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
        # GradScaler.step's unfused path, its checks and refusals word for word, in one frame (every step runs it).
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        if self._scale is None or self._growth_tracker is None:
            self._check_scale_growth_tracker("step")  # raises, naming the call
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if not state["found_inf_per_device"]:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        result = self._maybe_opt_step(optimizer, state, *args, **kwargs)
        state["stage"] = OptState.STEPPED
        return result

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
        # An update that may back off keeps where the scale stood (0-dim device copies, no sync; on the host-known
        # path of GradScaler's rule, overflowing iterations only): undo_backoff_ puts it back.
        self._before_backoff = self._scale_state() if new_scale is None and self._host_found is not False else None
        if new_scale is not None:
            check_new_scale(f"{type(self).__name__}.update", new_scale)
            super().update(float(new_scale) if not isinstance(new_scale, torch.Tensor) else new_scale)
            self._clamp_(scale, self.max_scale)
            self._host_found = None  # this iteration's outcome is consumed; the device tracker is untouched
            return
        found_infs = [
            found_inf if found_inf.device == scale.device else found_inf.to(device=scale.device, non_blocking=True)
            for state in self._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        if not found_infs:
            raise RuntimeError(
                f"{type(self).__name__}.update(): no optimizer was stepped or unscaled in this iteration; call"
                " step(optimizer) (or unscale_/check_) after scale(loss) and backward, then update()."
            )
        found_inf = found_infs[0] if len(found_infs) == 1 else torch.stack(found_infs).sum()
        self._update_scale_(scale, growth_tracker, found_inf)
        self._host_found = None
        self._per_optimizer_states.clear()
        self.step_count += 1
        if self.last_step_skipped and not self._min_scale_warned:
            # Host already knows this step overflowed; one extra read on overflow steps only.
            assert self._min_scale_hits is not None  # made with the scale, before the first step
            if int(self._min_scale_hits.item()) >= 2:
                self._min_scale_warned = True
                where = (f"min_scale={self.min_scale!r}" if self.min_scale is not None and self.min_scale >= SCALE_FLOOR
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
        self._before_backoff = None  # nothing backed off
        if self._scale is not None:
            # A scale that is itself inf/NaN/0 (written into the scaler at run time) is what made the step fail:
            # start again from init_scale rather than skip every later step.
            usable = torch.isfinite(self._scale) & (self._scale >= self.floor)
            self._scale.copy_(torch.where(usable, self._scale, torch.full_like(self._scale, self._init_scale)))
        if self._host_found and overflow:
            assert self._overflow_count is not None
            self._overflow_count += 1  # step() read the flag, so the device state exists; no host sync
        self._host_found = None
        self.step_count += 1
        self.last_data_fault = True

    def undo_backoff_(self) -> bool:
        """Put the scale, and what decides its next moves (the growth and hysteresis trackers), back where they stood
        before the last ``update()``, when that update consumed an overflow that was not the scale's doing: the
        rejected execution of a step that ``FaultTriage`` replayed clean (a transient fault) or blamed on its batch.
        The overflow stays counted (``overflow_count``). No host sync. Every rank of a distributed run calls it
        alike (triage decides on every rank), so the scales stay equal.

        Returns:
            Whether there was a backoff to undo: False after a clean update (as the step's host sync found it), an
            update by hand (``new_scale``), a :meth:`skip_update_`, or a second call.
        """
        saved, self._before_backoff = self._before_backoff, None
        if saved is None:
            return False
        tensors, host = saved
        for tensor, value in zip(self._scale_tensors(), tensors, strict=True):
            tensor.copy_(value)
        for name, value in host.items():
            setattr(self, name, value)
        return True

    def _scale_tensors(self) -> list[torch.Tensor]:
        """The device tensors an update moves the scale with (the counters are not among them)."""
        return [t for t in (self._scale, self._growth_tracker, self._hysteresis_tracker) if t is not None]

    def _scale_host_state(self) -> dict[str, Any]:
        """Host attributes an update changes with the scale (none here; subclasses add theirs)."""
        return {}

    def _scale_state(self) -> tuple[list[torch.Tensor], dict[str, Any]]:
        return [t.clone() for t in self._scale_tensors()], self._scale_host_state()

    def _update_scale_(self, scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor) -> None:
        assert self._hysteresis_tracker is not None and self._overflow_count is not None
        assert self._min_scale_hits is not None
        host_found = self._host_found
        if self.hysteresis == 1 and host_found is not None:
            # The host already knows (from step()'s sync) whether this iteration overflowed: a clean step costs
            # GradScaler's fused kernel and the growth cap, the counters move only on an overflow.
            if host_found:
                self._min_scale_hits += scale <= self.floor
                self._overflow_count += 1
            cap = self._growth_cap(scale)
            torch._amp_update_scale_(
                scale, growth_tracker, found_inf.float(),
                self._growth_factor, self._backoff_factor, self._growth_interval,
            )
            if cap is not None or host_found:
                self._clamp_(scale, cap)
            return
        found = found_inf > 0
        self._min_scale_hits += found & (scale <= self.floor)
        self._overflow_count += found
        cap = self._growth_cap(scale)
        if self.hysteresis == 1:
            torch._amp_update_scale_(
                scale, growth_tracker, found_inf.float(),
                self._growth_factor, self._backoff_factor, self._growth_interval,
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
        return max(self.min_scale or 0.0, SCALE_FLOOR)

    # ------------------------------------------------------------------------------------------ reading
    @property
    def overflow_count(self) -> int:
        """Iterations whose gradients held inf/NaN. Reading it synchronises with the device."""
        return self._init_overflow_count if self._overflow_count is None else int(self._overflow_count.item())

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
        self._before_backoff = None  # a loaded scale has no backoff of this process to undo
        call = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state_dict, dict):
            raise TypeError(f"{call}({state_dict!r}): expected the dict state_dict() returns.")
        if not state_dict:
            raise RuntimeError(f"{call}: the state dict is empty; was it saved with scaling disabled?")
        keys = set(state_dict)
        if keys == GRADSCALER_KEYS:
            # Written by torch.amp.GradScaler (e.g. Lightning's own "16-mixed"): keep our extra state as constructed.
            check_loaded(call, state_dict, floor=self.floor)
            self._host_found = None
            super().load_state_dict(state_dict)
            return
        check_state_keys(call, keys, set(self.state_dict()))
        min_scale = state_dict["min_scale"]
        check_loaded(call, state_dict, floor=max(min_scale or 0.0, SCALE_FLOOR) if isinstance(
            min_scale, (int, float)) and not isinstance(min_scale, bool) else SCALE_FLOOR)
        self._host_found = None
        super().load_state_dict(state_dict)
        self.hysteresis = int(state_dict["hysteresis"])
        self.min_scale = state_dict["min_scale"]
        self.max_scale = state_dict["max_scale"]
        self.step_count = int(state_dict["step_count"])
        self._init_hysteresis_tracker = int(state_dict["_hysteresis_tracker"])
        self._init_overflow_count = int(state_dict["overflow_count"])
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
                _init_min_scale_hits=self.min_scale_hits,
                _hysteresis_tracker=None,
                _overflow_count=None,
                _min_scale_hits=None,
                _before_backoff=None,
                _spare_flag=None,
            )
        return state


class StaticLossScaler(DynamicLossScaler):
    """A fixed loss scale: overflowing steps are still skipped and counted, but the scale never changes."""

    def __init__(self, device: str | None = None, init_scale: float = 2.0**16, enabled: bool = True) -> None:
        super().__init__(device, init_scale=init_scale, max_scale=None, enabled=enabled)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """:meth:`DynamicLossScaler.update`; an iteration whose steps the host saw clean moves nothing on the device
        (the scale is fixed, the overflow counter unchanged), so it only ends the iteration, without a kernel."""
        states = self._per_optimizer_states
        if (new_scale is None and self._host_found is False and self._enabled and self._scale is not None
                and any(state["found_inf_per_device"] for state in states.values())):
            if self.checks_only and len(states) == 1:
                # One optimizer, stepped, its flag read 0.0 by that step's host sync and written by nothing since:
                # the next scale-1 check takes it as its zero.
                (state,) = states.values()
                flags = state["found_inf_per_device"]
                if state["stage"] is OptState.STEPPED and len(flags) == 1:
                    (self._spare_flag,) = flags.values()
            self.last_data_fault = False
            self._before_backoff = None
            self._host_found = None
            states.clear()
            self.step_count += 1
            return
        super().update(new_scale)

    def _update_scale_(self, scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor) -> None:
        assert self._overflow_count is not None
        if self._host_found is None:  # no step read the flag (an iteration checked but not stepped): on the device
            self._overflow_count += found_inf > 0
        elif self._host_found:  # step()'s host sync saw the overflow: a clean step moves nothing
            self._overflow_count += 1


# ---------------------------------------------------------------------------------------- inf-check helpers

_SUMMED = (torch.bfloat16, torch.float32, torch.float64)  # dtypes whose sum overflows only beyond FP32's range

READ_ONLY_MIN = 2**17
"""Gradients of at least this many elements are checked by :func:`nonfinite_on_cpu`'s read-only reduction; smaller
ones together by GradScaler's multi-tensor kernel. A reduction call costs ~4 us more than the kernel's per-tensor
step and saves ~0.03 ns per element (no write-back): even at ~1.5e5 elements."""


def nonfinite_on_cpu(optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor] | None:
    """Whether ``optimizer``'s gradients hold inf/NaN, as ``{cpu: 0-dim FP32 flag}`` (1.0: found). Each gradient of
    :data:`READ_ONLY_MIN` elements or more is read once and written never: BF16/FP32/FP64 ones by their sum (an inf
    or NaN element makes it inf or NaN; the bench MLP's four BF16 weight gradients: 0.52 instead of 1.19 ms), FP16
    ones by their minimum and maximum (``torch.aminmax``: a NaN makes both NaN, an infinity is one of them; their
    sum would overflow FP16 at 65504). The small ones go through GradScaler's check-and-unscale kernel at scale 1 in
    one call per dtype (it writes each element back unchanged). None where a gradient is not a dense floating-point
    CPU tensor (sparse, a DTensor shard, on a device): GradScaler's kernel checks them all.

    A sum also overflows, and flags the step, when finite elements add up past FP32's range (3.4e38): only with
    elements of ~3e38 / numel and more, far beyond the 1.8e19 whose square is already inf in Adam's second moment."""
    bounds: list[torch.Tensor] = []
    small: dict[torch.dtype, list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if (type(grad) is not torch.Tensor or grad.layout != torch.strided or grad.device.type != "cpu"
                    or not grad.is_floating_point()):
                return None
            if grad.numel() >= READ_ONLY_MIN:
                bounds.extend([grad.sum()] if grad.dtype in _SUMMED else torch.aminmax(grad))
            elif grad.numel():
                small.setdefault(grad.dtype, []).append(grad)
    found = torch.zeros((), dtype=torch.float32)
    with torch.no_grad():
        if small:
            for grads in small.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one_on(found.device))
        if bounds:  # stack promotes mixed dtypes
            found = torch.maximum(found, torch.stack(bounds).isfinite().all().logical_not().float())
    return {torch.device("cpu"): found}


def fold_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, flag: torch.Tensor
                    ) -> torch.Tensor | None:
    """Add ``flag`` (a 0-dim device bool, or an FP32 0.0/1.0 flag) into ``optimizer``'s inf check of this iteration,
    which ``step`` reads in its one host sync: one kernel, its result put in the check's place (the check's own flag
    is not written); returns the check as it was before (a device tensor), or None when there is none yet."""
    state = scaler._per_optimizer_states.get(id(optimizer))
    found = state["found_inf_per_device"] if state else None
    if not found:
        return None
    (device, first), *more = found.items()
    # The check as it was: its own flag, which the fold below does not write (it puts a new tensor in its place; the
    # check's flag may be the pass's, which the step reads as the check); several flags (devices) summed.
    before = first if not more else torch.stack([f.to(first.device) for f in found.values()]).sum()
    if flag.device != first.device:
        flag = flag.to(first.device)
    # A maximum, not a sum: fused optimizers skip only on found_inf == 1 exactly. One kernel either way: a bool flag
    # selects 1.0, a float one (0.0/1.0, as the flag's dtype) is maxed in.
    found[device] = (torch.where(flag, one_on(first.device), first) if flag.dtype == torch.bool
                     else torch.maximum(first, flag if flag.dtype == first.dtype else flag.to(first.dtype)))
    return before


_PLAIN = {torch.Tensor}
_IS_SPARSE, _DEVICE, _DTYPE = attrgetter("is_sparse"), attrgetter("device"), attrgetter("dtype")


def _checked_at_one(optimizer: torch.optim.Optimizer, found: torch.Tensor, *, allow_fp16: bool
                    ) -> dict[torch.device, torch.Tensor] | None:
    """GradScaler's ``_unscale_grads_`` at an inverse scale of 1 for plain dense gradients on ``found``'s device: the
    same kernel, once per dtype, into ``found``, without the per-call copies of the flag and the scale GradScaler's
    replicas make (a third of a small model's check). None where a gradient is sparse, a subclass (a DTensor shard) or
    elsewhere: GradScaler's own loop checks them.

    Raises:
        ValueError: an FP16 gradient without ``allow_fp16`` (GradScaler's refusal, word for word).
    """
    device = found.device
    grads = [g for group in optimizer.param_groups for p in group["params"] if (g := p.grad) is not None]
    if not grads:
        return {}  # as GradScaler: no gradients, no flag
    # Plain dense tensors on the flag's device (C-level maps: no Python call per gradient).
    if set(map(type, grads)) != _PLAIN or any(map(_IS_SPARSE, grads)) or set(map(_DEVICE, grads)) != {device}:
        return None
    dtypes = set(map(_DTYPE, grads))
    if torch.float16 in dtypes and not allow_fp16:
        raise ValueError("Attempting to unscale FP16 gradients.")
    one = one_on(device)
    with _NO_GRAD:
        if len(dtypes) == 1:  # one call for all (the usual case), else one per dtype as GradScaler groups them
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
        else:
            for dtype in dtypes:
                torch._amp_foreach_non_finite_check_and_unscale_([g for g in grads if g.dtype == dtype], found, one)
    return {device: found}


def _grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


_NO_GRAD = GradOff()  # the check kernels' torch.no_grad() (the step path runs them every step)

_DIST = torch.distributed.is_available()  # a property of the build: asked once


def distributed_ready() -> bool:
    """``torch.distributed.is_available() and torch.distributed.is_initialized()``, the build's half asked once."""
    return _DIST and torch.distributed.is_initialized()


def _world_size(group: ProcessGroup | None) -> int:
    return torch.distributed.get_world_size(group) if distributed_ready() else 1

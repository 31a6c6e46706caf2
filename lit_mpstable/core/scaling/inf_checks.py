"""The per-iteration inf/NaN checks a ``torch.amp.GradScaler`` keeps per optimizer, as the stepper reads them: look
without unscaling, read, fold in a flag found elsewhere, agree across ranks, forget."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.amp.grad_scaler import OptState
from torch.distributed import ProcessGroup

# Seen by a type checker as the GradScaler it is mixed into; at run time a plain mixin (GradScaler follows in the MRO).
_Base = torch.amp.GradScaler if TYPE_CHECKING else object


class InfChecks(_Base):  # type: ignore[valid-type,misc]
    """The inf-check methods of :class:`~lit_mpstable.core.scaling.loss_scaler.DynamicLossScaler`, on the state its
    ``torch.amp.GradScaler`` base keeps (``_per_optimizer_states``, the scale); mixed in before GradScaler.

    ``step_with`` records the outcome through ``_note_skip`` and ``last_step_skipped``, which the scaler defines.
    """

    last_step_skipped: bool
    checks_without_unscaling = True
    """:meth:`check_` and :meth:`step_with` work here (the ``LossScaler`` protocol's capability flag)."""

    if TYPE_CHECKING:
        def _note_skip(self, skipped: bool) -> None: ...

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
        found = nonfinite_on_cpu(optimizer) if scale.device.type == "cpu" else None
        if found is None:  # GradScaler's multi-tensor kernel at an inverse scale of 1 (it writes x * 1 back)
            one = torch.ones((), dtype=torch.float32, device=scale.device)
            found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
            found = super()._unscale_grads_(optimizer, one, found_inf, True)
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
            one = torch.ones((), dtype=torch.float32)
            for grads in small.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
        if bounds:  # stack promotes mixed dtypes
            found = torch.maximum(found, torch.stack(bounds).isfinite().all().logical_not().float())
    return {torch.device("cpu"): found}


def fold_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, flag: torch.Tensor
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


def _world_size(group: ProcessGroup | None) -> int:
    dist = torch.distributed
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1

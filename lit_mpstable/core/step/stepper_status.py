"""What a PrecisionStepper shows of the run (a mixin): dtypes, the loss scale, the run's counters, the fallback state,
the gradients as the keeper holds them, memory; and the fallback actions, which only move the layout."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from lit_mpstable.core.counters import RunCounters
from lit_mpstable.core.formats import PRECISION_DTYPES
from lit_mpstable.core.layout.fp8_budget import LossFn, ProbeBudget
from lit_mpstable.core.layout.fsdp import fsdp2_fallback_refusal
from lit_mpstable.core.layout.islands import FP32Islands
from lit_mpstable.core.layout.layout import PrecisionLayout
from lit_mpstable.core.observer import shard_view
from lit_mpstable.core.scaling.scalers import LossScaler
from lit_mpstable.core.weights.memory import training_memory
from lit_mpstable.core.weights.weights import WeightKeeper


class StepperStatus:
    """Read-only views of a :class:`~lit_mpstable.core.step.stepper.PrecisionStepper`'s run (the stepper owns the
    attributes they read: ``precision``, ``layout``, ``scaler``, ``counters``, ``keeper``, ...)."""

    precision: str
    layout: PrecisionLayout
    scaler: Any  # GradScaler-like (ours, or a user's), or None
    counters: RunCounters
    keeper: WeightKeeper
    fsdp2: bool
    owner: str
    optimizers: list[Optimizer]
    _checker: LossScaler | None
    _input_nonfinite: torch.Tensor | None
    _skip_requested: bool
    fp8_budget: ProbeBudget

    @property
    def dtype(self) -> torch.dtype:
        """The 16-bit compute dtype, or ``torch.float32`` for ``"32-true"``."""
        return PRECISION_DTYPES.get(self.precision, torch.float32)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model computes in now: :attr:`dtype`, or FP32 while a global fallback is active."""
        return self.layout.compute_dtype

    @property
    def true_16bit(self) -> bool:
        """Whether parameters themselves live in 16 bits (``*-true`` modes)."""
        return self.precision in ("16-true", "bf16-true")

    def applied_steps(self, optimizer: Optimizer | None = None) -> int:
        """Optimizer steps applied (not skipped): what held LR schedulers follow; of ``optimizer`` alone if given
        (counted in this process: a resume restores where each scheduler stands relative to it)."""
        return self.counters.applied(optimizer)

    step_count = RunCounters.view("step_count", "Optimizer steps taken or skipped (one per optimizer per iteration).")
    overflow_count = RunCounters.view("overflow_count", "Steps skipped because their gradients held inf/NaN.")
    skipped_steps = RunCounters.view("skipped_steps", "Steps not applied: overflows plus those of :meth:`skip_step`.")
    last_step_skipped = RunCounters.view("last_step_skipped", "Whether the latest step was skipped.")

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without scaling). Reading it synchronises with the device."""
        if self.scaler is None or not self.scaler.is_enabled():
            return 1.0
        return float(self.scaler.get_scale())

    @property
    def fallback_active(self) -> bool:
        return self.layout.fallback_active

    @property
    def islands(self) -> FP32Islands:
        return self.layout.islands

    @property
    def can_fallback(self) -> bool:
        """Whether :meth:`fallback` can widen the precision: always, except where FSDP2 fixed it at ``fully_shard``
        (each unit's ``param_dtype`` in ``*-true`` modes; FP8 layers, bound to the layer objects it sharded)."""
        return not (self.fsdp2 and (self.true_16bit or bool(self.layout.fp8_layers)))

    @property
    def checks_nonfinite(self) -> bool:
        """Whether a step whose gradients hold inf/NaN is skipped (a scaler, or ``skip_nonfinite``)."""
        return self._checker is not None

    @property
    def input_nonfinite(self) -> torch.Tensor | None:
        """Whether a batch of the step in progress held inf/NaN, as a 0-dim device bool (None: no floating inputs
        seen). Reading its value syncs."""
        return self._input_nonfinite

    @property
    def skip_requested(self) -> bool:
        """Whether :meth:`skip_step` was called for the step in progress."""
        return self._skip_requested

    def state_tensors(self) -> list[torch.Tensor]:
        """Resident tensors of the precision itself that neither the model nor the optimizers hold (compensation
        buffers), for memory accounting."""
        return self.keeper.state_tensors()

    def memory_report(self) -> dict[str, int]:
        """Bytes of training state by kind (``lit_mpstable.core.weights.memory.training_memory``): ``weights``,
        ``masters`` (FP32
        masters), ``gradients``, ``optimizer_state``, ``compensation`` (``"kahan"``), ``total``. Reads no device data.

        Raises:
            RuntimeError: no model or optimizer has been set up yet.
        """
        module = self.layout.module
        if module is None or not self.optimizers:
            raise RuntimeError(
                f"{self.owner}.memory_report(): available once training has set up model and optimizers.")
        return training_memory(module, self.optimizers, extra={"compensation": self.state_tensors()})

    def named_grads(self) -> list[tuple[str, Any]]:
        """``(name, parameter)`` of the model, the FP32 master standing in where there is one (it holds the true
        gradient); FSDP2 parameters as this rank's gradient shard."""
        module = self.layout.module
        if module is None:
            return []
        return [(name, shard_view(grad)) for name, grad in self.keeper.named_grads(module)]

    def fallback(self, modules: Iterable[str] | None = None) -> str:
        """One rung up the precision ladder, globally or for the named modules; returns what was done.

        Raises:
            RuntimeError: under FSDP2, a rung it cannot climb (see :attr:`can_fallback`).
        """
        if self.fsdp2 and (why := fsdp2_fallback_refusal(modules, true_16bit=self.true_16bit, dtype=self.dtype,
                                                        fp8_layers=self.layout.fp8_layers)):
            raise RuntimeError(f"{self.owner}({self.precision!r}).fallback({modules!r}) with FSDP2: {why}.")
        return self.layout.fallback(modules)

    def restore_precision(self) -> bool:
        """Undo every fallback; returns whether there was one."""
        if not self.fallback_active:
            return False
        self.layout.restore()
        return True

    def choose_high_precision_(self, loss_fn: LossFn, batch: object) -> list[str]:
        """``FP8Config(keep_high_precision=HighPrecisionBudget(by="probe"))``: measure each FP8 layer's weight-gradient
        error in the low format on ``batch`` (``loss_fn(module, batch) -> loss``, run in the base precision, two extra
        forward/backward passes; the mean over data-parallel ranks) and move the costliest back to the base
        precision within the budget, once; returns them. Call it at the first step, before its forward (the Trainer
        plugin does). Later calls return the choice; it is saved in :meth:`state_dict` and re-applied on load."""
        return self.fp8_budget.choose_(self, loss_fn, batch)

    @property
    def fp8_high_precision_layers(self) -> list[str] | None:
        """The layers the probe's budget moved back to the base precision (None: not chosen yet, or no such budget)."""
        return None if self.fp8_budget.layers is None else list(self.fp8_budget.layers)

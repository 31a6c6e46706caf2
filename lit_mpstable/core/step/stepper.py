"""PrecisionStepper: the mixed-precision training step in pure PyTorch, which every front end drives.

One iteration, in this order (a plain loop calls the same methods the Trainer and Fabric adapters call)::

    with stepper.forward_context():
        loss = model(stepper.convert_input(x))
    stepper.scale_loss(loss).backward()
    stepper.unscale_(optimizer)             # optional: before reading or clipping gradients
    stepper.clip_grad_norm_(optimizer, 1.0)  # optional
    stepper.step(optimizer)                 # skips (and counts) a step whose gradients hold inf/NaN
    optimizer.zero_grad()
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, get_args

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lit_mpstable.base.notes import Notes
from lit_mpstable.base.validate import bool_arg, choice_arg, int_arg
from lit_mpstable.core.counters import RunCounters
from lit_mpstable.core.formats import PRECISION_FORMATS
from lit_mpstable.core.guards.growth import GrowthMonitor
from lit_mpstable.core.guards.spike import SpikeGuard
from lit_mpstable.core.layout.fp8_budget import ProbeBudget
from lit_mpstable.core.layout.layout import PrecisionLayout
from lit_mpstable.core.layout.policy import OpPolicy
from lit_mpstable.core.observer import GradObserver
from lit_mpstable.core.scaling.scalers import LossScaler, ScalerName, build_scaler
from lit_mpstable.core.schedulers import ScheduleHold
from lit_mpstable.core.step.iteration import Iteration
from lit_mpstable.core.step.step_buffers import StepBuffers
from lit_mpstable.core.step.step_guard import check_step_inputs_, held_nonfinite, stale_grads_note
from lit_mpstable.core.step.step_report import blame, blame_late, observe
from lit_mpstable.core.step.step_spike import (
    check_spike_guard,
    clip_grad_norm,
    level_shift_note,
    observe_loss,
    true_grad_norm,
)
from lit_mpstable.core.step.stepper_args import (
    MasterMode,
    OpPolicyName,
    PrecisionName,
    check_arguments,
    check_clip,
    check_module,
    check_norm_type,
    check_optimizer,
    check_optimizers,
)
from lit_mpstable.core.step.stepper_forward import StepperForward
from lit_mpstable.core.step.stepper_setup import adopt_device, setup_module, setup_optimizers
from lit_mpstable.core.step.stepper_state import StepperState, adopt_recast_state_
from lit_mpstable.core.step.stepper_status import StepperStatus
from lit_mpstable.core.tensors import default_dtype as default_dtype  # re-exported: the stepper's argument helpers
from lit_mpstable.core.tensors import tensor_init_context as tensor_init_context
from lit_mpstable.core.weights.moment_keeper import StateKind, check_optimizer_state
from lit_mpstable.core.weights.weights import PlainKeeper, WeightKeeper
from lit_mpstable.fp8 import FP8Config, fp8_config


class PrecisionStepper(StepperForward, StepperStatus, StepperState):
    """The precision of one training run and its step protocol: loss scaling, the non-finite check, FP32 master
    weights, clipping on true gradients, skip-and-count, FP32 islands, FP8 layers, the per-op policy, telemetry.

    Arguments are :class:`~lit_mpstable.StablePrecision`'s (the adapters pass them through); ``owner`` is the class
    name error messages use (a front end passes its own). The step order is the
    one GradScaler documents, plus what it leaves to the caller: the gradients are unscaled (and, with masters,
    moved into FP32) before anyone reads or clips them; a step whose gradients hold inf/NaN is skipped in every mode
    (``skip_nonfinite``), its LR schedule held, and counted.

    Raises:
        ValueError, TypeError: an argument is not one of the allowed values (each message names it).
    """

    def __init__(
        self,
        precision: PrecisionName = "bf16-mixed",
        *,
        scaler: ScalerName | torch.amp.GradScaler | None = "auto",
        master_weights: bool | MasterMode = True,
        skip_nonfinite: bool = True,
        fp8: str | FP8Config | None = None,
        fp32_modules: Iterable[type[nn.Module] | str] = (),
        op_policy: OpPolicyName | dict[str, str] = "autocast",
        device: str | None = None,
        telemetry_every_n_steps: int | None = 50,
        diagnose: bool = False,
        spike_guard: SpikeGuard | None = None,
        owner: str | None = None,
        optimizer_state: StateKind = "fp32",
        growth_every_n_steps: int | None = None,
    ) -> None:
        self.owner = call = owner or type(self).__name__
        self.warnings = Notes()
        """Messages the front end shows once per key (the cause's), e.g. a scaler adopted onto the device."""
        choice_arg(call, "precision", precision, get_args(PrecisionName))
        if device is not None:
            choice_arg(call, "device", device, ("cpu", "cuda"))
        if not isinstance(master_weights, bool):
            choice_arg(call, "master_weights", master_weights, (True, False, *get_args(MasterMode)))
        bool_arg(call, "skip_nonfinite", skip_nonfinite)
        bool_arg(call, "diagnose", diagnose)
        int_arg(call, "telemetry_every_n_steps", telemetry_every_n_steps, low=1, none=True,
                unit="optimizer steps between computations; 50 keeps the cost under 1% of a step")
        check_arguments(call, precision, scaler, fp32_modules)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if precision == "auto":
            bf16_ok = self.device == "cpu" or torch.cuda.is_bf16_supported()
            precision = "bf16-mixed" if bf16_ok else "16-mixed"
        self.precision: str = precision
        self.master_mode: str | None = ("fp32" if master_weights is True else master_weights or None)
        if not self.true_16bit:
            self.master_mode = None  # the *-mixed modes keep FP32 weights: nothing to master
        self.optimizer_state: str = check_optimizer_state(call, optimizer_state, self.precision, self.master_mode)
        int_arg(call, "growth_every_n_steps", growth_every_n_steps, low=1, none=True,
                unit="optimizer steps between activation-growth samples; 10 costs about 1% of a step")
        self.growth = None if growth_every_n_steps is None else GrowthMonitor(
            growth_every_n_steps, clock=self.applied_steps)  # a bound method: spawned ranks unpickle it
        """The per-layer activation growth monitor (early warning of FP8 overflow), attached at setup_module."""
        # The scaler the run scales with, and the LossScaler the step calls (the same object unless foreign).
        self._checker: LossScaler | None
        self.scaler, self._checker = build_scaler(call, precision, scaler, self.device, skip_nonfinite=skip_nonfinite,
                                                  warnings=self.warnings)
        self.skip_nonfinite = skip_nonfinite
        self.spike_guard = check_spike_guard(call, spike_guard, self._checker)
        """Skips loss and gradient-norm spikes through the step's inf/NaN flag (None: off)."""
        self._spike: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # per optimizer: the guard's decision
        # and the gradient norm it judged, this iteration (device tensors)
        self.last_step_spiked = False
        """The last step was skipped as a spike (read on skipped steps only)."""
        self.fp8 = fp8_config(fp8)
        self.fp8_budget = ProbeBudget(self.fp8, call)  # the probe's high-precision layers (inert without by="probe")
        self.op_policy = op_policy
        self.policy = OpPolicy(op_policy, dtype=self.dtype)
        if not self.policy.is_default and self.precision not in ("16-mixed", "bf16-mixed"):
            raise ValueError(
                f"{call}({self.precision!r}, op_policy={op_policy!r}): a per-op policy steers autocast, which only the"
                " '*-mixed' precisions use; use 'bf16-mixed' or '16-mixed', or op_policy='autocast'."
            )
        self.layout = PrecisionLayout(self.dtype, cast_parameters=self.true_16bit, fp32_modules=fp32_modules,
                                      fp8=self.fp8)
        self.diagnose = diagnose
        formats = [PRECISION_FORMATS.get(self.precision, "fp32")] + (["fp8_e5m2"] if self.fp8 is not None else [])
        self.observer = GradObserver(telemetry_every_n_steps, formats, diagnose=diagnose)
        fp16_state = self.precision == "16-true" and self.master_mode is None  # the optimizer state is FP16
        self.keeper: WeightKeeper = PlainKeeper(call, fp16_state=fp16_state)
        """How the weights are kept through a step (plain, FP32 masters, compact); bound at :meth:`setup_optimizers`."""
        self.fsdp2 = False
        """The model is (or will be) sharded by FSDP2: its FP32 sharded parameters are the masters, nothing is cast."""
        self._fsdp_checked = False  # a sharded model's policies were checked (the strategy's call after fully_shard)
        self.optimizers: list[Optimizer] = []
        """The optimizers this run steps (given at setup, or met at their first step)."""
        self.schedules = ScheduleHold(self.applied_steps)  # a bound method, not a lambda: spawned ranks unpickle it
        self.counters = RunCounters()
        """The run's event counters (the properties below are views of it)."""
        self.stats: dict[str, Any] = {}
        self.last_loss: torch.Tensor | None = None
        """The latest loss before scaling, detached, on the device (reading it syncs)."""
        self._initial: dict[str, torch.Tensor] = {}  # FP32 weights before the 16-bit cast, for the masters
        self._pending: dict[str, Any] = {}  # state loaded before the model or optimizers arrived
        self.iteration = Iteration()  # what the iteration in progress did (host state)
        self._skip_requested = False
        self._zclipped: set[int] = set()  # optimizers clipped (with the adaptive threshold) in this iteration
        self._input_nonfinite: torch.Tensor | None = None
        self._layout_seen: tuple | None = None  # the fallbacks in force at the last forward
        self._loss_scaled = False  # scale_loss ran in this process (the scaler has a scale to unscale by)
        self.step_buffers = StepBuffers()
        """The module's persistent buffers as the step in progress found them: written back when it is skipped."""

    # ------------------------------------------------------------------------------------------------ setup
    def setup_module(self, module: nn.Module, *, fsdp2: bool = False) -> nn.Module:
        """Apply the layout (16-bit cast of ``*-true`` modes, FP8 swap, FP32 islands) in place; returns ``module``.

        FSDP2 (``fsdp2=True``: the strategy shards the model, now or later; detected anyway once ``fully_shard`` ran):
        FSDP2's FP32 sharded parameters are the master weights, so none are built and no parameter is cast (without
        masters, only before sharding). Called before ``fully_shard`` it swaps the FP8 layers and hooks the islands
        (FSDP2 binds parameters to the layer objects it shards); called after, it changes nothing and checks every
        unit's ``MixedPrecisionPolicy`` against the precision
        (:func:`~lit_mpstable.core.layout.fsdp.check_fsdp_policies`).

        Raises:
            ValueError: FSDP2 with a sharded model whose policies do not match, FP8 layers not swapped before
                sharding, or ``master_weights="kahan"``/``"stochastic"`` (FSDP2 keeps FP32 shards instead).
        """
        check_module(f"{self.owner}.setup_module", module)
        bool_arg(f"{self.owner}.setup_module", "fsdp2", fsdp2)
        return setup_module(self, module, fsdp2=fsdp2)

    def setup_optimizers(self, module: nn.Module, optimizers: list[Optimizer], schedulers: Sequence[Any] = ()) -> None:
        """Bind the weight keeper (FP32 masters, compact weights) to ``module`` and ``optimizers``, and hold
        ``schedulers`` on skipped steps."""
        check_module(f"{self.owner}.setup_optimizers", module)
        setup_optimizers(self, module, check_optimizers(f"{self.owner}.setup_optimizers", optimizers), list(schedulers))

    def check_eps(self, optimizers: Iterable[Optimizer]) -> None:
        """In ``'16-true'`` without masters, refuse an ``eps`` FP16 cannot hold (``core.weights.check_eps``)."""
        self.keeper.check_eps(optimizers)

    def adopt_device_(self, module: nn.Module) -> None:
        """Run where ``module``'s first parameter lives (autocast, FP32 islands, loss scalers follow). Called by
        :meth:`setup_optimizers`, and again before the first forward by a front end that moves the model later."""
        adopt_device(self, module)

    @torch.no_grad()
    def follow_model_weights_(self, replicas: ProcessGroup | None = None) -> list[str]:
        """Restart from its 16-bit weight every FP32 master whose rounding that weight no longer is, and return their
        names: weights loaded into the model after the masters were bound (a pretrained checkpoint loaded after
        ``fabric.setup``) would otherwise be overwritten from the stale master by the next applied step. One host
        sync; a front end calls it once per optimizer, before its first step.

        ``replicas``: under ``DistributedDataParallel``, its process group (``ddp.process_group``). DDP broadcast the
        16-bit weights of the group's first rank when it wrapped the model, but the keeper's own state was built on
        each rank: FP32 masters from that rank's own initialisation, the seed of stochastic rounding from its torch
        seed. They are broadcast from the same first rank first, so the replicas step alike. A collective: every
        rank calls it, after the model was wrapped, before the first step (a plain loop too: ``ddp =
        DistributedDataParallel(model)``, then ``stepper.follow_model_weights_(ddp.process_group)``)."""
        return self.keeper.follow_model_weights_(replicas)

    # -------------------------------------------------------------------------------------------- backward
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward`` on: multiplied by the loss scale when scaling.

        A new backward also closes what the last one left open: an optimizer unscaled (or clipped) without a step
        belongs to a dropped batch (``zero_grad()`` without ``step()``), so its unscaled gradients and inf/NaN check
        are dropped too (GradScaler would refuse the next ``unscale_``; stepping on them would apply gradients
        ``scale`` times too large, or the old check); a scale update still owed is made now."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"{self.owner}.scale_loss(loss={loss!r:.80}): must be a tensor (the loss to call backward"
                            " on).")
        for optimizer in [o for o in self.optimizers if id(o) in self.iteration.unscaled]:
            if (note := stale_grads_note(optimizer)) is not None:
                self.warnings.add_once(f"stale-grads:{type(optimizer).__name__}", note)
            self.drop_grads_(optimizer)
        if self.iteration.stepped:
            self._update_scale_()
        self.last_loss = loss.detach()
        if self.spike_guard is not None:
            observe_loss(self.spike_guard, loss)
        self._loss_scaled = True
        return self.scaler.scale(loss) if self.scaler is not None else loss

    # ------------------------------------------------------------------------------------------------- step
    def unscale_(self, optimizer: Optimizer) -> None:
        """Make ``optimizer``'s gradients true values (once per iteration): into the FP32 masters, unscaled there,
        checked for inf/NaN (agreed across ranks), and shown on the model's 16-bit parameters for hooks and a user's
        own clipping. No host sync."""
        check_optimizer(f"{self.owner}.unscale_", optimizer)
        if id(optimizer) in self.iteration.unscaled:
            return
        if self.scaler is not None and not self._loss_scaled:
            raise RuntimeError(
                f"{self.owner}: the gradients of {type(optimizer).__name__} were unscaled (clip_grad_norm_,"
                " clip_grad_value_, unscale_ or step) before any loss was scaled: with a loss scaler the order is"
                " scale_loss(loss).backward() (Fabric: fabric.backward(loss); Trainer: the training step's backward),"
                " then clipping, then the optimizer step.")
        self.iteration.unscaled.add(id(optimizer))
        if all(optimizer is not known for known in self.optimizers):
            self.optimizers.append(optimizer)
            adopt_recast_state_(self, [optimizer])  # a resumed fallback's FP32 optimizer state waiting for it
        self.keeper.unscale_(optimizer, self._checker, self.scaler, self.device)
        self.iteration.note_checked(optimizer)
        if self.spike_guard is not None:
            # The true gradients' norm before any clipping (times a deferring keeper's pending unscale factor).
            norm = true_grad_norm(optimizer, self.keeper.grad_multiplier(optimizer))
            self._spike[id(optimizer)] = (self.spike_guard.decide(norm), norm)
        observe(self)

    def main_params(self, optimizer: Optimizer) -> Iterator[torch.Tensor]:
        """The parameters the optimizer updates (the FP32 masters with ``master_weights``), after :meth:`unscale_`.
        Empty when the gradients hold inf/NaN (the step will be skipped; clipping them would only raise)."""
        self.unscale_(optimizer)
        self.keeper.absorb_grads_(optimizer)
        if self._checker is not None and self._checker.found_inf(optimizer):
            return iter(())
        return (p for group in optimizer.param_groups for p in group["params"])

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip ``optimizer``'s true gradients to a total norm (on the masters with ``master_weights``; with compact
        weights the clip factor joins the FP32 unscale of the step: the 16-bit gradients are not rounded twice)."""
        check_clip(f"{self.owner}.clip_grad_norm_", "max_norm", max_norm)
        check_norm_type(f"{self.owner}.clip_grad_norm_", norm_type)
        self.unscale_(optimizer)
        return clip_grad_norm(self, optimizer, max_norm, norm_type)

    def clip_grad_value_(self, optimizer: Optimizer, clip_value: float) -> None:
        """Clamp ``optimizer``'s true gradients to ``±clip_value`` (on the masters with ``master_weights``; with
        compact weights in the step's FP32 chunks, after unscaling)."""
        check_clip(f"{self.owner}.clip_grad_value_", "clip_value", clip_value)
        self.unscale_(optimizer)
        self.keeper.clip_grad_value_(optimizer, clip_value)

    def skip_step(self) -> None:
        """Discard the gradients of the step in progress: no update, LR schedule held, scale unchanged."""
        self._skip_requested = True

    def undo_backoff_(self) -> bool:
        """Undo the scale backoff of the last iteration, whose overflow was not the scale's doing (``FaultTriage``
        calls it before replaying a rejected step: a clean replay runs, and the run goes on, at the scale the rejected
        execution ran at). The overflow and the skipped step stay counted. No host sync; returns whether a backoff
        was undone (see :meth:`DynamicLossScaler.undo_backoff_`; a foreign scaler's is not)."""
        return self._checker.undo_backoff_() if self._checker is not None else False

    def count_unchecked_step(self, optimizer: Optimizer | None = None) -> None:
        """Count a step the front end took itself, unchecked (LBFGS evaluates its closure inside ``step``)."""
        if self.spike_guard is not None:
            self.spike_guard.forget_()  # an unchecked step is not judged: its losses must not pile up as pending
        self._record(skipped=False, overflow=False, optimizer=optimizer)

    def step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Step ``optimizer`` unless its gradients hold inf/NaN (or :meth:`skip_step` was called); then update the
        scale, refresh the 16-bit weights from the masters, and count. One host sync: the skip decision."""
        check_optimizer(f"{self.owner}.step", optimizer)
        if self._skip_requested:
            return self.discard_(optimizer)
        self.unscale_(optimizer)
        guard = self.spike_guard
        if guard is not None and guard.clip_zscore is not None and id(optimizer) not in self._zclipped:
            self.clip_grad_norm_(optimizer, math.inf)  # clip_zscore without the user's clip: ZClip alone
        self._zclipped.discard(id(optimizer))
        self.keeper.absorb_grads_(optimizer)
        checker = self._checker
        spike = self._spike.pop(id(optimizer), (None, None))[0]
        early, spike = (check_step_inputs_(checker, optimizer, scaled=self.scaler is not None, device=self.device,
                                           spike=spike, share=self.counters.applied_by.get(id(optimizer), 0),
                                           checked=self.iteration.checked.pop(id(optimizer), None),
                                           factor=self.keeper.grad_multiplier(optimizer))
                        if checker is not None and self.skip_nonfinite else (None, None))
        output, skipped = self.keeper.step_(optimizer, checker, **kwargs)
        late = None
        now = self.iteration
        self.last_step_spiked = False
        if checker is not None:
            # Why it skipped, read on skipped steps only: a spike (SpikeGuard; a loss spike also explains the overflow
            # of its scaled gradients), inf/NaN that entered after the gradient check (or parameters/state holding it),
            # or a batch holding inf/NaN (the input check). None says anything about the scale: no backoff, no
            # overflow counted, nothing blamed.
            if skipped and spike is not None and bool(spike):
                self.last_step_spiked = now.data_fault = True
            elif skipped and ((early is not None and not bool(early)) or held_nonfinite(optimizer)):
                late = now.data_fault = True
            elif skipped and self._input_nonfinite is not None and bool(self._input_nonfinite):
                now.data_fault = True
            now.overflowed |= skipped and not late and not self.last_step_spiked
            now.stepped.add(id(optimizer))
        now.unscaled.discard(id(optimizer))
        if guard is not None:
            guard.commit_(skipped, spiked=spike)  # folds the loss and norm of applied steps only
            if guard.count_run_(self.last_step_spiked, applied=not skipped):
                self.warnings.add(f"spike-level-shift:{self.step_count}", level_shift_note(guard, self.step_count))
        if late:
            blame_late(self, optimizer)
        elif skipped and not self.last_step_spiked:
            blame(self)
        # inf/NaN that entered late, or a spike, is no overflow (a wider precision would not help): skipped only.
        overflow = skipped and not late and not self.last_step_spiked
        self._record(skipped=skipped, overflow=overflow, optimizer=optimizer)
        now.note_stepped_on(self.optimizers, optimizer, self.keeper)
        if not now.awaited(self.optimizers, optimizer, self.keeper):
            self._update_scale_()
        return output

    def _update_scale_(self) -> None:
        self.iteration.update_scale_(self._checker)

    def discard_(self, optimizer: Optimizer) -> None:
        """End the iteration for ``optimizer`` without stepping (a requested skip): gradients dropped, counted."""
        self._skip_requested = False
        self.drop_grads_(optimizer)
        self._record(skipped=True, overflow=False, optimizer=optimizer)
        if not self.iteration.awaited(self.optimizers, optimizer, self.keeper):
            self._update_scale_()

    def restore_buffers_(self) -> bool:
        """Write the module's persistent buffers (BatchNorm's statistics) back to what they were before the step in
        progress began (its first training forward), as a skipped step does; for a replay that is rejected, so the
        next one starts where the step did. Returns whether there was a copy to write back. No host read."""
        return self.step_buffers.restore_()

    def drop_grads_(self, optimizer: Optimizer) -> None:
        """Forget this iteration's gradients of ``optimizer`` without counting a step (nothing ran backward)."""
        check_optimizer(f"{self.owner}.drop_grads_", optimizer)
        optimizer.zero_grad(set_to_none=True)
        self.keeper.drop_(optimizer)
        if self._checker is not None:
            self._checker.forget_(optimizer)
        self._spike.pop(id(optimizer), None)
        self._zclipped.discard(id(optimizer))
        if self.spike_guard is not None:
            self.spike_guard.forget_()  # a dropped batch's loss and norm never enter the statistics
        self.iteration.unscaled.discard(id(optimizer))

    def _record(self, *, skipped: bool, overflow: bool, optimizer: Optimizer | None = None) -> None:
        # Every rank, every step (applied or skipped): delayed-scaling FP8 amax histories agreed across ranks (one
        # all-reduce; nothing on one process).
        self.layout.sync_fp8_()
        self.counters.record(skipped=skipped, overflow=overflow, optimizer=optimizer)
        self.step_buffers.end_(skipped=skipped)  # a skipped step's forward leaves no trace in the buffers either
        self._input_nonfinite = None
        if self.growth is not None:
            self.growth.due()  # follows the step count now: a due step that went unsampled is warned of

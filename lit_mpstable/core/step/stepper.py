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
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter, is_, is_not
from typing import Any, Literal, cast, get_args

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.modules.batchnorm import _NormBase
from torch.optim import Optimizer

from lit_mpstable.base.notes import Notes
from lit_mpstable.base.validate import bool_arg, choice_arg, int_arg
from lit_mpstable.core.attribution import RngState
from lit_mpstable.core.compiled import eager, is_compiled, recompile_note
from lit_mpstable.core.fingerprint import manifest
from lit_mpstable.core.formats import PRECISION_DTYPES, PRECISION_FORMATS
from lit_mpstable.core.guards.growth import GrowthMonitor
from lit_mpstable.core.guards.spike import SpikeGuard
from lit_mpstable.core.layout.fp8_budget import LossFn, ProbeBudget
from lit_mpstable.core.layout.fsdp import (
    check_fsdp2_setup,
    check_fsdp_policies,
    fsdp2_fallback_refusal,
    fsdp_units,
    setup_fsdp2,
    unsharded_message,
)
from lit_mpstable.core.layout.islands import FP32Islands
from lit_mpstable.core.layout.layout import PrecisionLayout
from lit_mpstable.core.layout.policy import OpPolicy
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler
from lit_mpstable.core.scaling.scalers import LossScaler, ScalerName, build_scaler
from lit_mpstable.core.schedulers import ScheduleHold
from lit_mpstable.core.step import probe
from lit_mpstable.core.step.step_guard import (
    batch_ends,
    check_step_inputs_,
    ends_nonfinite,
    held_nonfinite,
    late_nonfinite_note,
    stale_grads_note,
)
from lit_mpstable.core.step.step_spike import check_spike_guard, level_shift_note, observe_loss, true_grad_norm
from lit_mpstable.core.step.stepper_state import (
    check_plugin_state,
    check_weights_state,
    keep_live_counters,
    load_scaler_state_,
    load_weights_state_,
    weights_state,
)
from lit_mpstable.core.telemetry import GradObserver, shard_view
from lit_mpstable.core.tensors import default_dtype as default_dtype  # re-exported: the stepper's argument helpers
from lit_mpstable.core.tensors import floating_tensors, map_tensors
from lit_mpstable.core.weights.keeper import check_eps
from lit_mpstable.core.weights.memory import training_memory
from lit_mpstable.core.weights.moment_keeper import StateKind, check_optimizer_state
from lit_mpstable.core.weights.recast_state import KEY as RECAST
from lit_mpstable.core.weights.recast_state import apply_recast_state_, recast_state
from lit_mpstable.core.weights.weights import PlainKeeper, WeightKeeper, make_keeper
from lit_mpstable.fp8 import FP8Config, fp8_config

_FLUSH_LIMIT = 0.05
"""Above this fraction of the nonzero gradient elements flushing to zero in FP16, the loss scale is named (once)."""
_FLUSH_PREFIX = "The loss scale flushes the FP16 gradients"

PrecisionName = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "auto"]
MasterMode = Literal["fp32", "kahan", "stochastic"]
OpPolicyName = Literal["autocast", "auto"]



def _counter(name: str, doc: str) -> property:
    """A property of the stepper's ``counters.<name>``: the stepper shows the counters, :class:`RunCounters` owns
    them (written here, in the stepper's file, so reading a counter on the step stays in it)."""
    return property(lambda stepper: getattr(stepper.counters, name),
                    lambda stepper, value: setattr(stepper.counters, name, value), doc=doc)


class PrecisionStepper:
    """The precision of one training run and its step protocol: loss scaling, the non-finite check, FP32 master
    weights, clipping on true gradients, skip-and-count, FP32 islands, FP8 layers, the per-op policy, telemetry.

    Arguments are :class:`~lit_mpstable.StablePrecision`'s (the adapters pass them through); ``owner`` is the class
    name error messages use (a front end passes its own). The step order is the
    one GradScaler documents, plus what it leaves to the caller: the gradients are unscaled (and, with masters,
    moved into FP32) before anyone reads or clips them; a step whose gradients hold inf/NaN is skipped in every mode
    (``skip_nonfinite``), its LR schedule held, and counted.

    The class reads top to bottom in the order of a run: setup (model, optimizers, device), the forward, the backward's
    :meth:`scale_loss`, :meth:`unscale_` and clipping, :meth:`step` or a skip and the scale update; then
    :meth:`state_dict`/:meth:`load_state_dict`; then what it shows of the run (dtypes, counters, fallbacks, memory).

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
        self.scaler: Any  # GradScaler-like (ours, or a user's), or None
        self._checker: LossScaler | None
        self.scaler, self._checker = build_scaler(call, precision, scaler, self.device, skip_nonfinite=skip_nonfinite,
                                                  warnings=self.warnings)
        self.skip_nonfinite = skip_nonfinite
        self.spike_guard = check_spike_guard(call, spike_guard, self._checker)
        """Skips loss and gradient-norm spikes through the step's inf/NaN flag (None: off)."""
        if self.spike_guard is not None and self._checker is not None:
            self._checker.measures_norm = True  # the guard's norm is read off the gradient check's one pass
        self._spike: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # per optimizer: the guard's decision
        # and the gradient norm it judged, this iteration (device tensors)
        self._norms: dict[int, torch.Tensor | None] | None = None  # per optimizer: this iteration's true gradient norm,
        # kept for a monitor once one asks (want_grad_norm_)
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
        self._input_ends: list[torch.Tensor] = []  # the step's batches' minima and maxima (batch_ends), on the device
        self._input_flag: tuple[int, torch.Tensor] | None = None  # input_nonfinite as computed, over that many ends
        self._layout_seen: tuple | None = None  # the fallbacks in force at the last forward
        self._autocast: torch.autocast | None = None  # the plain forward's autocast, entered again each forward
        self._loss_scaled = False  # scale_loss ran in this process (the scaler has a scale to unscale by)
        self.step_buffers = StepBuffers()
        """The module's persistent buffers as the step in progress found them: written back when it is skipped."""
        self._converted_to: torch.dtype | None = None  # the dtype convert_input cast the latest batch to (*-true)

    # ------------------------------------------------------------------------------------------------ setup
    def tensor_init_context(self) -> AbstractContextManager:
        """Where new tensors and modules are made: in the 16-bit dtype for ``*-true`` modes without FP32 masters, else
        unchanged. With FP32 masters the model is built in FP32: the masters start from exact values (setup casts the
        model), and under FSDP2 the FP32 parameters are the masters (its policy computes in 16 bits)."""
        return default_dtype(self.dtype) if self.true_16bit and self.master_mode != "fp32" else nullcontext()

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
        if self._skip_requested:  # no step is in progress between fits: the request must not eat the next first batch
            self._skip_requested = False
            self.warnings.add("skip-step-outside", f"{self.owner}.skip_step() was called outside a step (between"
                              " fits): ignored; call it during a step (before optimizer_step), e.g. from"
                              " on_before_backward.")
        self.fsdp2, sharded, self.layout.cast_parameters = setup_fsdp2(
            self.owner, self.precision, module, requested=fsdp2, master_mode=self.master_mode, fp8=self.fp8,
            swapped_elsewhere=self.layout.module is not module, true_16bit=self.true_16bit,
        )
        if not self.fsdp2 and self.master_mode == "fp32" and (self.keeper.mode != "fp32"
                                                              or module is not self.layout.module):
            # Masters start from these FP32 values, not from their 16-bit rounding (kept until the optimizers come:
            # a validate or lr_find before the fit sets the same module up, cast already, and binds none).
            initial = {name: p.detach().clone() for name, p in module.named_parameters()
                       if p.requires_grad and p.dtype == torch.float32}
            if initial or module is not self.layout.module:
                self._initial = initial
        if self.fsdp2 and self.fp8_budget.budget is not None:
            raise ValueError(
                f"{self.owner}(fp8=FP8Config(keep_high_precision={self.fp8_budget.budget!r})) with FSDP2: the probe's"
                " choice moves layers out of FP8 after the first step, when fully_shard has already bound them; use"
                f" HighPrecisionBudget(fraction={self.fp8_budget.budget.fraction}, by='last') (decided before"
                " sharding).")
        self.layout.attach(module, self.device)
        self.fp8_budget.attach_(self.layout)  # a probe choice loaded before the model: before the layout's state
        if "layout" in self._pending:
            self.layout.load_state_dict(self._pending.pop("layout"))
        self._adopt_recast_state_(self.optimizers, weights=True)  # a resumed fallback's FP32 values, loaded before
        self.observer.attach(module)
        if self.growth is not None:  # after the FP8 swap: the hooks go on the layers that run
            self.growth.detach()
            self.growth.attach(module, hooks="on_demand")  # hooked in forward_context on sampling steps only
        if sharded:
            check_fsdp_policies(module, self.precision, master_weights=self.master_mode is not None,
                                islands=self.layout.islands.names, owner=self.owner)
        self._fsdp_checked = sharded
        return module

    def setup_optimizers(self, module: nn.Module, optimizers: list[Optimizer], schedulers: Sequence[Any] = ()) -> None:
        """Bind the weight keeper (FP32 masters, compact weights) to ``module`` and ``optimizers``, and hold
        ``schedulers`` on skipped steps."""
        check_module(f"{self.owner}.setup_optimizers", module)
        optimizers = check_optimizers(f"{self.owner}.setup_optimizers", optimizers)
        if self.layout.module is None:
            raise RuntimeError(
                f"{self.owner}.setup_optimizers: call setup_module(module) first; without it the model keeps its"
                f" FP32 weights and no precision layout ({self.precision!r}, FP32 islands, FP8), and trains in FP32.")
        # Lightning connects the plugin again for validate/test/predict after fit, with the fit's optimizers, whose
        # groups hold the keeper's FP32 weights by then: that keeper stays (a new one would find no model parameter).
        bound = (self.master_mode is not None and bool(optimizers) and self.keeper.mode == self.master_mode
                 and list(map(id, optimizers)) == list(map(id, self.optimizers)))
        self.optimizers = list(optimizers)
        self.adopt_device_(module)
        for scaler in (self.scaler, self._checker):  # the scale-1 check of scaler=None unscales FP16 gradients too
            if isinstance(scaler, DynamicLossScaler):
                scaler.allow_fp16_grads = self.precision == "16-true" and self.master_mode is None
        if self.fsdp2 and self.true_16bit and not self._fsdp_checked:
            raise ValueError(unsharded_message(self.owner, self.precision, module))
        self.check_eps(optimizers)
        if self.master_mode in ("kahan", "stochastic") and not self.fsdp2 and fsdp_units(module):
            # Sharded after its setup (Fabric converts the model before its strategy shards it): refused as the
            # Trainer's FSDP2 refuses it at setup (compact weights step whole tensors, not DTensor shards).
            check_fsdp2_setup(self.owner, self.precision, master_mode=self.master_mode, fp8=None,
                              sharded_before_fp8=False)
        if self.master_mode == "fp32" and not self.fsdp2 and fsdp_units(module):
            self.warnings.add_once("fsdp2-masters-save", (
                f"{self.owner}({self.precision!r}) keeps FP32 masters beside FSDP2's 16-bit shards (the model was"
                " sharded after its conversion): it trains, but a sharded save of this optimizer fails (torch's sharded"
                " optimizer state dict knows only the model's parameters). To checkpoint, train in"
                f" {self.precision.replace('-true', '-mixed')!r} with fully_shard(..., mp_policy=plugin.mp_policy):"
                " FSDP2 then keeps FP32 shards and computes in 16 bits."))
        if self.master_mode is None:
            # The plain keeper of __init__: their state follows a fallback's recast of the parameters.
            cast(PlainKeeper, self.keeper).optimizers = list(optimizers)
        elif not bound:
            self.keeper = make_keeper(
                self.master_mode, module, optimizers, owner=self.owner, precision=self.precision,
                dtype=self.dtype, checker=self._checker, fsdp2=self.fsdp2, initial=self._initial,
                warnings=self.warnings, optimizer_state=self.optimizer_state,
            )
            if optimizers:  # the masters took their start values
                self._initial = {}
        keeper = self.keeper  # a fallback's recast carries what the keeper holds
        self.layout.after_recast = lambda changed: keeper.follow_model_weights_(recast=changed)
        key = self.keeper.state_key
        if key is not None and key in self._pending:
            self.keeper.load_state_dict(self._pending.pop(key))
        self._adopt_recast_state_(list(optimizers))  # a resumed fallback's FP32 optimizer state, loaded before
        self.schedules.hold(list(schedulers))

    def forget_pending_weights_(self) -> None:
        """Drop the FP32 masters or compensation a load keeps until optimizers are bound (an evaluation's load: no
        optimizer comes, and a later fit must start from its own model)."""
        for key in ("masters", "compact"):
            self._pending.pop(key, None)

    def check_eps(self, optimizers: Iterable[Optimizer]) -> None:
        """In ``'16-true'`` without FP32 masters, refuse an ``eps`` FP16 cannot hold (``core.weights.check_eps``):
        the plain keeper's optimizer state is FP16, and so is compact weights' (Kahan, stochastic)."""
        if self.precision == "16-true" and self.master_mode in ("kahan", "stochastic"):
            check_eps(self.owner, optimizers, self.master_mode)
        elif isinstance(self.keeper, PlainKeeper):  # FP32 masters keep FP32 optimizer state: any eps fits
            self.keeper.check_eps(optimizers)

    def adopt_device_(self, module: nn.Module) -> None:
        """Run where ``module``'s first parameter lives (autocast, FP32 islands, loss scalers follow). Called by
        :meth:`setup_optimizers`, and again before the first forward by a front end that moves the model later."""
        device_type = next((p.device.type for p in module.parameters()), self.device)
        if device_type in ("cpu", "cuda"):
            self.device = self.layout.islands.device_type = self.layout.device_type = device_type
        scaler = self._checker  # a foreign scaler's wrapper adopts nothing; ours is self.scaler itself
        previous = scaler.adopt_device_(self.device) if scaler is not None else None
        if previous is not None and scaler is self.scaler:
            self.warnings.add(
                f"scaler-adopted:{type(scaler).__name__}:{previous}:{self.device}",
                f"{type(scaler).__name__} built for {previous!r} adopted onto the run's device {self.device!r}."
            )

    def _adopt_recast_state_(self, optimizers: Sequence[Optimizer], *, weights: bool = False) -> None:
        """Hand a recasting fallback's FP32 values loaded before the model or ``optimizers`` arrived to them
        (:mod:`~lit_mpstable.core.weights.recast_state`); what no optimizer holds yet keeps waiting."""
        module, waiting = self.layout.module, self._pending.pop(RECAST, None)
        if waiting and module is not None:
            waiting = apply_recast_state_(module, optimizers, waiting, weights=weights)
        if waiting:
            self._pending[RECAST] = waiting

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

    # --------------------------------------------------------------------------------------------- forward
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Autocast (``*-mixed``), the 16-bit default dtype (``*-true``), the op policy and FP8's own context.

        With ``torch.compile``: none of this adds a graph break (autocast and the policy's mode are traced into the
        graph, or guarded on from outside it). The forward that traces an overflow (the step after one, or every step
        with ``diagnose``) and a growth monitor's sampled forward run eagerly: their hooks would break the graph and
        recompile it.
        """
        self._note_recompile()
        layout, policy = self.layout, self.policy
        self.step_buffers.begin_(layout.module)  # the buffers before the step's first training forward
        extras = self._forward_extras(layout)
        if extras:
            with ExitStack() as stack:
                for context in extras:
                    stack.enter_context(context)
                yield from self._compute_context(layout, policy)
            return
        dtype = self.dtype
        if policy.steers or layout.fp32 or dtype == torch.float32 or self.true_16bit:
            yield from self._compute_context(layout, policy)
            return
        # The plain *-mixed step, entered every step: autocast alone, as _compute_context enters it, without a
        # generator delegated to, and one autocast object entered again forward after forward (building one costs
        # half as much as entering it). Taken while in use: a forward inside this one builds its own. Under dynamo
        # each traced forward builds its own (the construction is what it traces).
        autocast = self._autocast if not torch.compiler.is_compiling() else None
        self._autocast = None
        if autocast is None or autocast.device != self.device or autocast.fast_dtype != dtype:
            autocast = torch.autocast(self.device, dtype=dtype, cache_enabled=False)
        with autocast:
            yield
        if not torch.compiler.is_compiling():
            self._autocast = autocast
        self._record_policy(policy)

    def _forward_extras(self, layout: PrecisionLayout) -> list[AbstractContextManager[Any]]:
        """The contexts a forward enters around the compute dtype's own; none on a plain step. The FP8 backend's only
        where FP8 is configured (its layers exist only then), the input recast only in ``*-true`` modes."""
        growth = self.growth
        traced = self.observer.tracer is not None
        if growth is None and not traced and layout.fp8_backend is None and not self.true_16bit:
            return []
        # A growth sample hooks the layers for this forward only; a compiled model runs it eagerly (its graph
        # holds no hook, so it neither breaks nor recompiles).
        growth = growth if growth is not None and growth.due() else None
        module = layout.module
        eagerly = traced or (growth is not None and module is not None and is_compiled(module))
        return [context for context in (
            eager() if eagerly else None,
            growth.sampling() if growth is not None else None,
            layout.forward_context() if layout.fp8_backend is not None else None,
            self._recast_inputs() if self.true_16bit else None,
        ) if context is not None]

    def _compute_context(self, layout: PrecisionLayout, policy: OpPolicy) -> Generator[None, None, None]:
        """The body of :meth:`forward_context` inside its extra contexts: the compute dtype's own context."""
        dtype = self.dtype
        if layout.fp32 or dtype == torch.float32:  # "32-true", or a global fallback (the compute dtype)
            yield
        elif self.true_16bit:
            with default_dtype(dtype):  # tensors created inside forward default to the 16-bit dtype
                yield
        else:
            # cache_enabled=False as Lightning's MixedPrecision: the weight-cast cache leaks across no_grad
            # regions. The op policy runs inside autocast: it overrides it for whole families, never in islands.
            autocast = torch.autocast(self.device, dtype=dtype, cache_enabled=False)
            if policy.steers:
                with autocast, policy.context(self.device):
                    yield
            else:
                with autocast:
                    yield
            self._record_policy(policy)

    def _record_policy(self, policy: OpPolicy) -> None:
        """After an autocast forward: the policy's choices into :attr:`stats` once made (a policy that never steers has
        nothing pending: its choices, all autocast, are recorded once)."""
        if not (policy.steers and policy.pending) and self.stats.get("op_policy") != policy.choices:
            self.stats["op_policy"] = dict(policy.choices)  # decided (second forward), forced or resumed
            self.stats["op_policy_ms"] = {f: {"autocast": m.autocast_ms, "fp32": m.fp32_ms}
                                          for f, m in policy.measurements.items()}

    @contextmanager
    def _recast_inputs(self) -> Generator[None, None, None]:
        """``*-true``: a batch converted before a fallback (or a restore) changed the compute dtype, e.g. by
        ``plugin.fallback(None)`` from ``on_train_batch_start`` (Lightning converts the batch before that hook): its
        16-bit tensors would meet FP32 weights ("mat1 and mat2 must have the same dtype"). For the forwards of that
        batch every module of the model casts its floating inputs of the converted dtype to the compute dtype (as
        AMPPreflight casts the batch it falls back for). Hooks for those forwards only; none otherwise."""
        stale, now, module = self._converted_to, self.compute_dtype, self.layout.module
        if not self.true_16bit or stale is None or stale == now or module is None:
            yield
            return

        def cast(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(now) if tensor.is_floating_point() and tensor.dtype == stale else tensor

        def hook(_: object, args: object, kwargs: object) -> tuple[Any, Any]:
            return map_tensors(args, cast), map_tensors(kwargs, cast)

        handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in module.modules()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _note_recompile(self) -> None:
        layout = self.layout
        seen = (layout.fp32, layout.fp8_off, tuple(layout.fp8_removed), tuple(layout.fp32_modules))
        changed, self._layout_seen = self._layout_seen not in (None, seen), seen
        if changed and layout.module is not None and is_compiled(layout.module):
            recompile_note(self.step_count, self.warnings)

    @contextmanager
    def _base_precision(self) -> Generator[None, None, None]:
        """The base precision alone (autocast or the 16-bit default dtype), without the forward context's bookkeeping
        (op-policy recording, recompile notes): for a measurement, not a training forward."""
        if self.compute_dtype == torch.float32:
            context: AbstractContextManager[Any] = nullcontext()
        elif self.true_16bit:
            context = default_dtype(self.dtype)
        else:
            context = torch.autocast(self.device, dtype=self.dtype, cache_enabled=False)
        with context:
            yield

    def convert_input(self, data: object) -> Any:
        """``*-true`` modes: floating tensors of ``data`` cast to the compute dtype. In every mode it notes, on the
        device, each floating tensor's minimum and maximum, whether the batch held inf/NaN being read off them only
        after an overflow (to blame the data and not a layer) or when :attr:`input_nonfinite` is asked."""
        tensors = floating_tensors(data)
        if tensors:  # their minima and maxima, checked only when asked (input_nonfinite): one kernel per tensor
            self._input_ends += batch_ends(tensors)
        if not self.true_16bit:
            return data
        self._converted_to = self.compute_dtype
        return map_tensors(data, lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t)

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
        now = self.iteration
        for optimizer in [o for o in self.optimizers if id(o) in now.unscaled] if now.unscaled else ():
            if (note := stale_grads_note(optimizer)) is not None:
                self.warnings.add_once(f"stale-grads:{type(optimizer).__name__}", note)
            self.drop_grads_(optimizer)
        if now.stepped:
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
        if not isinstance(optimizer, Optimizer):
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
        if all(map(is_not, self.optimizers, repeat(optimizer))):  # by identity, as `optimizer is not known` each
            self.optimizers.append(optimizer)
            self._adopt_recast_state_([optimizer])  # a resumed fallback's FP32 optimizer state waiting for it
        self.keeper.unscale_(optimizer, self._checker, self.scaler, self.device)
        self.iteration.note_checked(optimizer)
        if self.spike_guard is not None or self._norms is not None:
            norm = self._true_norm(optimizer)  # before any clipping
            if self.spike_guard is not None:
                self._spike[id(optimizer)] = (self.spike_guard.decide(norm), norm)
            if self._norms is not None:
                self._norms[id(optimizer)] = norm
        observer = self.observer
        if observer.tracer is not None or self.counters.step_count not in observer.quiet:  # else nothing is due
            self._observe()

    def want_grad_norm_(self) -> None:
        """A monitor (the indicators' SpikeScore) needs each step's gradient norm: from now on the gradient check is
        the one pass that measures it (:meth:`take_grad_norm`), instead of the monitor reading the gradients again."""
        if self._norms is None:
            self._norms = {}
        if self._checker is not None:
            self._checker.measures_norm = True

    def take_grad_norm(self, optimizer: Optimizer) -> torch.Tensor | None:
        """The L2 norm of ``optimizer``'s true gradients this iteration, before any clipping (a device tensor; inf/NaN
        on a non-finite step), once: None before :meth:`want_grad_norm_`, or where the iteration unscaled none."""
        return self._norms.pop(id(optimizer), None) if self._norms is not None else None

    def _true_norm(self, optimizer: Optimizer) -> torch.Tensor | None:
        """The L2 norm of ``optimizer``'s true gradients as the check left them (times a deferring keeper's pending
        unscale factor), on the device: read off the gradient check's one pass over them, or, where it made none (a
        foreign scaler, sharded gradients), one pass of its own."""
        multiplier = self.keeper.grads(optimizer).multiplier
        measured = self._checker.grad_pass(optimizer) if self._checker is not None else None
        if measured is None:
            return true_grad_norm(optimizer, multiplier)
        return measured.norm * multiplier.to(measured.norm.device) if multiplier is not None else measured.norm

    def _observe(self) -> None:
        """Gradient telemetry into :attr:`stats` (the observer computes it on due steps only; :meth:`unscale_` does not
        even ask it on the steps it said are quiet)."""
        module, observer = self.layout.module, self.observer
        if module is None:
            return
        scaler = self.scaler
        scale = scaler.get_scale if scaler is not None else lambda: 1.0  # called on due steps only
        fp8 = self.fp8 is not None and bool(self.layout.fp8_layers)
        updates, warning = observer.observe(module, self.named_grads, self.step_count, scale, fp8=fp8,
                                            owed=self._owed_factors)
        self.stats.update(updates)
        if warning is not None:
            self.warnings.add_once(*warning, per=self.step_count)
        if "grad_underflow_frac" in updates and (flush := self._flush_note(updates)) is not None:  # telemetry steps
            self.warnings.add_once("flush", flush)

    def _flush_note(self, updates: dict[str, Any]) -> str | None:
        """On a telemetry step of an FP16 run with a loss scaler: a warning when the scale flushes the gradients, else
        None. Flushing: more than 5% of the nonzero elements would flush to zero at the scale (the telemetry's
        forecast), or, at a scale below 1, more than 5% of the elements are zero already (the FP16 backward flushed
        them; above 1 a zero is as likely the model's own: a dead ReLU, an unused embedding row). Host reads on
        telemetry steps only (they have synchronised already)."""
        if self.scaler is None or self.compute_dtype != torch.float16 or "grad_underflow_frac" not in updates:
            return None
        scale = self.loss_scale
        forecast, zero = float(updates["grad_underflow_frac"]), float(updates.get("grad_zero_frac") or 0.0)
        flushed = max(forecast, zero if scale < 1.0 else 0.0)
        if flushed <= _FLUSH_LIMIT:
            return None
        return (f"{_FLUSH_PREFIX}: at loss scale {scale:g} (step {updates.get('stats_step')}) {flushed:.1%} of the"
                " gradient elements are zero or flush to zero in FP16. The scale grows back only after growth_interval"
                " clean steps in a row, so overflows more frequent than that ratchet it down (a FaultTriage verdict"
                " undoes the backoffs it explains). Use scaler='adaptive' (the scale follows the gradients' amax), a"
                " DynamicLossScaler with hysteresis or min_scale, or PrecisionFallback.")

    def main_params(self, optimizer: Optimizer) -> Iterator[torch.Tensor]:
        """The parameters the optimizer updates (the FP32 masters with ``master_weights``), after :meth:`unscale_`.
        Empty when the gradients hold inf/NaN (the step will be skipped; clipping them would only raise)."""
        self.unscale_(optimizer)
        self.keeper.grads(optimizer, absorb=True)
        if self._checker is not None and self._checker.found_inf(optimizer):
            return iter(())
        return (p for group in optimizer.param_groups for p in group["params"])

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip ``optimizer``'s true gradients to a total norm (on the masters with ``master_weights``; with compact
        weights the clip factor joins the FP32 unscale of the step: the 16-bit gradients are not rounded twice).

        After the unscale: clipped to ``min(max_norm, the guard's ZClip threshold)``, with the guard's norm when it
        still holds (one read of the gradients, not two), and the clipped gradients noted as checked."""
        check_clip(f"{self.owner}.clip_grad_norm_", "max_norm", max_norm)
        check_norm_type(f"{self.owner}.clip_grad_norm_", norm_type)
        self.unscale_(optimizer)
        now, guard = self.iteration, self.spike_guard
        # Finite gradients times a factor max_norm / (norm + 1e-6) <= 1 stay finite when max_norm is a finite number
        # (an inf norm gives 0; a NaN one means inf/NaN gradients, flagged already): the step-input check need not read
        # them again. Not with an infinite limit (ZClip alone, in its warmup): inf / inf is NaN.
        finite_limit = isinstance(max_norm, (int, float)) and math.isfinite(max_norm)
        self.keeper.grads(optimizer, absorb=True)  # a hook's write reaches the keeper first: the norm below is fresh
        threshold = guard.clip_threshold() if guard is not None else None
        if threshold is not None and norm_type == 2.0:
            # ZClip: the adaptive threshold when lower. A tensor limit: clip_grad_norm_ computes max_norm / norm on the
            # device, so no host read.
            max_norm = torch.clamp(threshold, max=float(max_norm))  # type: ignore[assignment]
        first = id(optimizer) not in self._zclipped  # a second clip sees the first one's result (or factor)
        norm = self._spike.get(id(optimizer), (None, None))[1]
        checker = self._checker
        if norm is None and first and norm_type == 2.0 and checker is not None:
            # Without a guard, the check's pass gives the norm where it is the number the clip would compute (FP32
            # gradients: torch's clip_grad_norm_'s; a deferring keeper: its own FP32 norms times the factor). The
            # first clip by norm computes its own and asks the check for that pass from the next step on.
            measured = checker.grad_pass(optimizer)
            if measured is not None and (measured.fp32 or self.keeper.defers_unscale):
                norm = self._true_norm(optimizer)
            elif measured is None and not checker.measures_norm:
                checker.measures_norm = self.keeper.defers_unscale or all(
                    g.dtype == torch.float32 for g in _grads(self.keeper, optimizer) if g is not None)
        # The norm holds if every gradient is still the tensor, at the version, that the check saw (a hook that wrote
        # one, or replaced one, needs a fresh norm), none sharded (a DTensor norm is a DTensor), and the norm is L2.
        known = norm if first and norm_type == 2.0 and now.unchanged_since_check(optimizer) else None
        self._zclipped.add(id(optimizer))
        result = cast(torch.Tensor, self.keeper.clip_(optimizer, max_norm=max_norm, norm_type=norm_type,
                                                      total_norm=known))
        if finite_limit and id(optimizer) in now.checked:
            now.note_checked(optimizer)
        return result

    def clip_grad_value_(self, optimizer: Optimizer, clip_value: float) -> None:
        """Clamp ``optimizer``'s true gradients to ``±clip_value`` (on the masters with ``master_weights``; with
        compact weights in the step's FP32 chunks, after unscaling)."""
        check_clip(f"{self.owner}.clip_grad_value_", "clip_value", clip_value)
        self.unscale_(optimizer)
        self.keeper.clip_(optimizer, clip_value=clip_value)

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
        if not isinstance(optimizer, Optimizer):
            check_optimizer(f"{self.owner}.step", optimizer)
        if self._skip_requested:
            return self.discard_(optimizer)
        self.unscale_(optimizer)
        key, guard = id(optimizer), self.spike_guard
        if guard is not None and guard.clip_zscore is not None and key not in self._zclipped:
            self.clip_grad_norm_(optimizer, math.inf)  # clip_zscore without the user's clip: ZClip alone
        self._zclipped.discard(key)
        # A hook's write reaches the keeper again; the plain keeper (mode None) holds the model's own gradients, with
        # nothing to absorb and no factor owed: its view is not built.
        keeper, checker, now = self.keeper, self._checker, self.iteration
        factor = keeper.grads(optimizer, absorb=True).multiplier if keeper.mode is not None else None
        spike = self._spike.pop(key)[0] if key in self._spike else None
        early, spike = (check_step_inputs_(checker, optimizer, scaled=self.scaler is not None, device=self.device,
                                           spike=spike, share=self.counters.applied_by.get(key, 0),
                                           grads=now.changed_since_check(optimizer), factor=factor)
                        if checker is not None and self.skip_nonfinite else (None, None))
        output, skipped = keeper.end_step_(optimizer, checker, kwargs)
        late = spiked = False
        if checker is not None:
            if skipped:
                # Why it skipped, read on skipped steps only: a spike (SpikeGuard; a loss spike also explains the
                # overflow of its scaled gradients), inf/NaN that entered after the gradient check (or parameters/state
                # holding it), or a batch holding inf/NaN (the input check). None says anything about the scale: no
                # backoff, no overflow counted, nothing blamed.
                if spike is not None and bool(spike):
                    spiked = now.data_fault = True
                elif (early is not None and not bool(early)) or held_nonfinite(optimizer):
                    late = now.data_fault = True
                elif (flag := self.input_nonfinite) is not None and bool(flag):
                    now.data_fault = True
                now.overflowed |= not late and not spiked
            now.stepped.add(key)
        self.last_step_spiked = spiked
        now.unscaled.discard(key)
        if guard is not None:
            guard.commit_(skipped, spiked=spike)  # folds the loss and norm of applied steps only
            if guard.count_run_(spiked, applied=not skipped):
                self.warnings.add(f"spike-level-shift:{self.step_count}", level_shift_note(guard, self.step_count))
        if late:
            self._blame_late(optimizer)
        elif skipped and not spiked:
            self._blame()
        # inf/NaN that entered late, or a spike, is no overflow (a wider precision would not help): skipped only.
        self._record(skipped=skipped, overflow=skipped and not late and not spiked, optimizer=optimizer)
        now.note_stepped_on(self.optimizers, optimizer, keeper)
        if not now.awaited(self.optimizers, optimizer, keeper):
            now.update_scale_(checker)
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

    def steps_without_backward(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` steps though this batch ran no backward (``training_step`` returned None), as
        Lightning's own plugin of the precision would: without a loss scaler it steps on the gradients the window's
        earlier micro-batches accumulated (its 32-true and bf16 step whatever the closure returned), hooks and
        clipping first as for any step; with one (its 16-mixed skips GradScaler's step), or with no gradients, the
        batch is dropped (:meth:`drop_batch_`)."""
        return self.scaler is None and any(g is not None for g in _grads(self.keeper, optimizer))

    def drop_batch_(self, optimizer: Optimizer) -> None:
        """The user skipped the batch (``training_step`` returned None) and nothing steps
        (:meth:`steps_without_backward`): its gradients forgotten, nothing counted, and ``optimizer``'s LR schedule
        moves on as in Lightning's own run (it holds on the steps this plugin skips)."""
        self.drop_grads_(optimizer)
        self.schedules.release_(optimizer)

    def drop_grads_(self, optimizer: Optimizer) -> None:
        """Forget this iteration's gradients of ``optimizer`` without counting a step (nothing ran backward)."""
        if not isinstance(optimizer, Optimizer):
            check_optimizer(f"{self.owner}.drop_grads_", optimizer)
        optimizer.zero_grad(set_to_none=True)
        self.keeper.end_step_(optimizer, self._checker, None)
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
        if self.layout.fp8_backend is not None:  # only an FP8 run has FP8 layers
            self.layout.sync_fp8_()
        self.counters.record(skipped=skipped, overflow=overflow, optimizer=optimizer)
        self.step_buffers.end_(skipped=skipped)  # a skipped step's forward leaves no trace in the buffers either
        self._input_ends, self._input_flag = [], None
        if self.growth is not None:
            self.growth.due()  # follows the step count now: a due step that went unsampled is warned of

    def _blame(self) -> None:
        """After an overflow: the data if the batch held inf/NaN, else the parameters with inf/NaN gradients and
        (traced on the next step) the first module whose inputs were finite and outputs were not."""
        module = self.layout.module
        if module is None:
            return
        flag = self.input_nonfinite
        self.stats.pop("nonfinite_after_check", None)
        self.stats.update(self.observer.blame(module, self.named_grads(),
                                              nonfinite_input=flag is not None and bool(flag)))

    def _blame_late(self, optimizer: Optimizer) -> None:
        """The gradient check found nothing: inf/NaN entered after it, which no precision setting explains. Nothing is
        blamed on a module (a fallback would island healthy layers)."""
        self.stats.update(blamed_params=[], blamed_modules=[], nonfinite_input=False, nonfinite_after_check=True)
        self.warnings.add_once(f"late-nonfinite:{type(optimizer).__name__}", late_nonfinite_note(optimizer))

    def trace_skipped_step(self, forward: Callable[[], torch.Tensor], *, rng: RngState | None = None) -> str | None:
        """In a plain loop, after :meth:`step` skipped a step (:attr:`last_step_skipped`): replay its forward
        (``forward`` returns the loss of the same batch, inside :meth:`forward_context`; call no :meth:`scale_loss`)
        and its backward traced, at the step's loss scale, with ``rng``
        (:func:`~lit_mpstable.core.attribution.rng_state` taken before the step) restored. Puts the module where
        inf/NaN first appeared in ``stats`` (``blamed_modules``, and ``nan_origin``: ``{"module", "where"}`` or None
        when the replay was finite) and its warning in ``warnings``; returns the module's name (``""``: the model
        itself), or None (no module: a finite replay, or a non-finite batch). Clean steps cost nothing: only a
        skipped step is replayed.

        Raises:
            ValueError: the stepper has no model yet (``setup_module`` not called).
        """
        module = self.layout.module
        if module is None:
            raise ValueError(f"{self.owner}.trace_skipped_step(): the stepper has no model; call setup_module first.")
        step = max(self.step_count - 1, 0)  # the skipped step (counted already)
        updates, warning = self.observer.replay(module, forward, step, self.loss_scale, rng)
        self.stats.update(updates)
        if warning is not None:
            self.warnings.add_once(*warning, per=step)
        origin = updates["nan_origin"]
        return None if origin is None or origin["where"] == "input" else origin["module"]

    # ----------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly; tensors and plain Python values (``weights_only=True`` loads it).

        Keys: ``precision``, ``scaler`` (its own state dict, ``{}`` without scaling), ``step_count``,
        ``overflow_count``, ``skipped_steps``, ``last_step_skipped``, ``layout`` (fallbacks, FP8 amax histories),
        ``masters`` (FP32 masters by parameter name, ``{}`` without), ``op_policy`` (the choice per op family),
        ``schedules`` (where each held LR scheduler last stepped, in applied steps), ``compact`` (the compact weights'
        compensation buffers and rounding seed, ``{}`` without), ``spike_guard`` (the SpikeGuard's statistics,
        ``{}`` without), ``fp8_budget`` (the layers ``HighPrecisionBudget(by="probe")`` moved to the base precision,
        their measured errors and the step: ``{}`` before the choice or without that budget), ``growth`` (the
        growth monitor's samples, which its trend fit resumes from, ``{}`` without ``growth_every_n_steps``), and,
        only while a fallback holds ``*-true`` parameters in FP32 without FP32 masters, ``recast`` (their FP32 values
        and optimizer state by parameter name: :mod:`~lit_mpstable.core.weights.recast_state`).
        """
        if self.iteration.stepped:
            # A scale update still owed is part of the state (a checkpoint comes after the iteration's steps; with
            # gradients left for another optimizer that is only zeroed later, the update waits for its backward).
            self._update_scale_()
        return {
            **weights_state(self.keeper, self._pending),
            "precision": self.precision,
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            **self.counters.state_dict(),
            "layout": self.layout.state_dict(),
            "op_policy": self.policy.state_dict(),
            "schedules": self.schedules.state_dict(),
            "spike_guard": self.spike_guard.state_dict() if self.spike_guard is not None else {},
            "fp8_budget": self.fp8_budget.state_dict(),
            "growth": self.growth.state_dict() if self.growth is not None else {},
            **self._recast_state(),
        }

    def _recast_state(self) -> dict[str, Any]:
        module, waiting = self.layout.module, self._pending.get(RECAST)
        if module is None:
            return {RECAST: waiting} if waiting else {}
        names = self.layout.recast_names() if self.master_mode != "fp32" else []  # masters carry their own values
        state = recast_state(module, names, self.optimizers, waiting)
        return {RECAST: state} if state else {}

    def load_state_dict(self, state: dict[str, Any], *, keep_counters: bool = False) -> list[str]:
        """Restore :meth:`state_dict` (strict). ``keep_counters``: numeric state only, the event counters (the
        run's and the scaler's) keep their live values (a rollback undoes the weights, not the history).

        Returns notes for the front end to show (a precision switch on resume, say). The growth monitor's samples
        are history too: a rollback (``keep_counters``) keeps the live ones.

        Raises:
            KeyError: keys differ from :meth:`state_dict`'s (each is named).
            TypeError: ``state`` is not a dict, or a field has the wrong type (``"False"`` for a bool, ``None``).
            ValueError: a field is out of range (a NaN/inf scale, a negative counter, NaN masters or compensation).
        """
        # Every field is checked before anything is loaded: a refused state changes nothing.
        bool_arg(f"{self.owner}.load_state_dict", "keep_counters", keep_counters)
        if isinstance(state, dict) and "spike_guard" not in state:
            state = {**state, "spike_guard": {}}  # saved before SpikeGuard existed: no statistics to restore
        if isinstance(state, dict) and "fp8_budget" not in state:
            state = {**state, "fp8_budget": {}}  # saved before the probe's budget was part of the state
        if keep_counters and isinstance(state, dict) and not state["fp8_budget"] and self.fp8_budget.layers:
            state = self._with_budget_choice(state)
        if isinstance(state, dict) and "growth" not in state:
            state = {**state, "growth": {}}  # saved before the growth samples were checkpointed: the fit restarts
        if isinstance(state, dict) and RECAST not in state:
            state = {**state, RECAST: {}}  # no recasting fallback at the save (or saved before this key existed)
        call = f"{self.owner}.load_state_dict"
        check_plugin_state(call, state, set(self.state_dict()) | {RECAST}, get_args(PrecisionName))
        self.fp8_budget.check_state(call, state["fp8_budget"], self.layout)
        check_weights_state(call, self.keeper, state["masters"], state["compact"], mode=self.master_mode,
                            fsdp2=self.fsdp2, module=self.layout.module, bound=bool(self.optimizers))
        growth, saved_growth = self.growth, state["growth"]
        if growth is not None and saved_growth:
            growth.check_state(saved_growth, call=call, name="growth")
        guard, saved_guard = self.spike_guard, state["spike_guard"]
        if guard is not None and saved_guard:
            # Checked on a throwaway guard first (it refuses a bad state whole), so nothing is half loaded.
            SpikeGuard(guard.zscore, guard.window, guard.warmup, guard.watch,  # type: ignore[arg-type]
                       guard.clip_zscore).load_state_dict(dict(saved_guard))
        notes = load_scaler_state_(self.scaler, state, precision=self.precision, keep_counters=keep_counters)
        if not keep_counters:
            self.counters.load_state_dict(state)
            self.schedules.load_state_dict(list(state["schedules"]))
        notes += self.fp8_budget.load_state_dict(state["fp8_budget"], self.layout)  # before the layout's FP8 state
        if self.layout.module is None:
            self._pending["layout"] = state["layout"]
        else:
            self.layout.load_state_dict(state["layout"])
        warning = load_weights_state_(self.keeper, state["masters"], state["compact"], mode=self.master_mode,
                                      fsdp2=self.fsdp2, pending=self._pending, module=self.layout.module,
                                      precision=self.precision, bound=bool(self.optimizers))
        if warning is not None:
            self.warnings.add(*warning)
        # After the fallback was re-applied: the recast parameters and their optimizer state take the FP32 values.
        self._pending.pop(RECAST, None)
        if state[RECAST]:
            self._pending[RECAST] = state[RECAST]
            self._adopt_recast_state_(self.optimizers, weights=True)
        self.policy.load_state_dict(state["op_policy"])
        if guard is not None and saved_guard:
            live = guard.spikes_skipped.clone()
            guard.load_state_dict(dict(saved_guard))
            if keep_counters:  # a rollback keeps the count of skipped spikes (history), restores the statistics
                guard.spikes_skipped.copy_(live.to(guard.spikes_skipped.device))
        elif saved_guard:
            notes.append(f"{self.owner}.load_state_dict: the checkpoint holds SpikeGuard statistics but this run has"
                         " no spike_guard; they were not loaded.")
        if growth is not None and saved_growth and not keep_counters:
            growth.load_state_dict(dict(saved_growth))
        elif saved_growth and growth is None:
            notes.append(f"{call}: the checkpoint holds growth-monitor samples but this run has no"
                         " growth_every_n_steps; they were not loaded.")
        return notes

    # ---------------------------------------------------------------------------------------------- status
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

    step_count = _counter("step_count", "Optimizer steps taken or skipped (one per optimizer per iteration).")
    overflow_count = _counter("overflow_count", "Steps skipped because their gradients held inf/NaN.")
    skipped_steps = _counter("skipped_steps", "Steps not applied: overflows plus those of :meth:`skip_step`.")
    last_step_skipped = _counter("last_step_skipped", "Whether the latest step was skipped.")

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
        ends, known = self._input_ends, self._input_flag
        if not ends:
            return None
        if known is None or known[0] != len(ends):  # computed when first asked, again once another batch came
            known = self._input_flag = (len(ends), ends_nonfinite(ends))
        return known[1]

    @property
    def input_ends(self) -> list[torch.Tensor]:
        """The minima and maxima (``batch_ends``) of the floating inputs of the step in progress, on the device: the
        list each batch extends and the step's end replaces, so a caller that keeps it with its length can ask
        ``ends_nonfinite`` about those batches later, only when the answer is needed. Reads nothing."""
        return self._input_ends

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
        # The keeper's FP32 weights hold the gradients where the model's show a copy of them (exposes_grads).
        held = self.keeper.fp32_weights() if self.keeper.exposes_grads else {}
        return [(name, shard_view(held.get(name, param))) for name, param in module.named_parameters()]

    def _owed_factors(self) -> dict[str, torch.Tensor]:
        """Parameter name -> the factor a deferring keeper's step still owes its gradient (compact weights: the
        unscale, times a clip's factor, applied in the step's FP32 chunks), for :meth:`named_grads`' readers that
        take the gradients as true values (the telemetry, the probe); empty where the gradients are true already. Device
        tensors, nothing read."""
        module, keeper = self.layout.module, self.keeper
        if module is None or not keeper.defers_unscale:
            return {}
        owed: dict[int, torch.Tensor] = {}
        for optimizer in self.optimizers:
            view = keeper.grads(optimizer)
            if view.multiplier is not None:
                owed.update((id(holder), view.multiplier) for holder in view.holders)
        return {name: owed[id(param)] for name, param in module.named_parameters() if id(param) in owed}

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

    @contextmanager
    def full_precision(self) -> Generator[None, None, None]:
        """Inside the block the whole model computes in FP32 (FP8 layers off, no autocast, ``*-true`` parameters
        widened); after it exactly the fallbacks in force before are back. Logs nothing and counts nothing.

        Raises:
            RuntimeError: under FSDP2 where the precision was fixed at ``fully_shard`` (see :attr:`can_fallback`).
        """
        layout = self.layout
        saved = layout.state_dict()
        try:
            while self.compute_dtype != torch.float32:
                self.fallback(None)  # one rung at a time: FP8 -> base precision -> FP32
            yield
        finally:
            layout.load_state_dict(saved)

    def _with_budget_choice(self, state: dict[str, Any]) -> dict[str, Any]:
        """A rollback's snapshot taken before the probe's choice (the train start's) with the run's choice in it: the
        choice is made once a run and stays (loaded as a resume loads it), and the snapshot's FP8 state of the layers
        it moved back to the base precision is left out (they have none now)."""
        kept = [f"{name}." for name in self.fp8_budget.layers or ()]
        layout = state.get("layout")
        if isinstance(layout, dict) and isinstance(layout.get("fp8"), dict):
            fp8 = {key: value for key, value in layout["fp8"].items() if not key.startswith(tuple(kept))}
            layout = {**layout, "fp8": fp8}
        return {**state, "fp8_budget": self.fp8_budget.state_dict(), "layout": layout}

    def choose_high_precision_(self, loss_fn: LossFn, batch: object) -> list[str]:
        """``FP8Config(keep_high_precision=HighPrecisionBudget(by="probe"))``: measure each FP8 layer's weight-gradient
        error in the low format on ``batch`` (``loss_fn(module, batch) -> loss``, run in the base precision, two extra
        forward/backward passes; the mean over data-parallel ranks) and move the costliest back to the base
        precision within the budget, once; returns them. Call it at the first step, before its forward (the Trainer
        plugin does). Later calls return the choice; it is saved in :meth:`state_dict` and re-applied on load."""
        return self.fp8_budget.choose_(self.layout, loss_fn, batch, base_precision=self._base_precision,
                                       step=self.step_count, stats=self.stats)

    @property
    def fp8_high_precision_layers(self) -> list[str] | None:
        """The layers the probe's budget moved back to the base precision (None: not chosen yet, or no such budget)."""
        return None if self.fp8_budget.layers is None else list(self.fp8_budget.layers)

    def manifest(self) -> dict[str, Any]:
        """The precision this run trains in, as plain values (what a checkpoint's fingerprint records and a load
        compares): :func:`~lit_mpstable.core.fingerprint.manifest` of the layout and this stepper's settings."""
        return manifest(self.layout, precision=self.precision, master_weights=self.master_mode,
                        optimizer_state=self.optimizer_state, high_precision=self.fp8_high_precision_layers or ())

    # ----------------------------------------------------------------------------------------------- probe
    def forward_state(self) -> dict[str, Any]:
        """What a step's forward starts from, so :meth:`measure` can replay it: the RNG states (dropout masks) and the
        FP8 layers' scaling state (the delayed recipe moves it in every forward). Take it right before the forward of
        the (last micro-)batch to probe; copies, plain tensors."""
        return probe.forward_state(self.layout, self.device)

    def measure(
        self,
        module: nn.Module,
        loss_fn: LossFn,
        batch: object,
        *,
        recompute: bool = False,
        start: dict[str, Any] | None = None,
        step: int | None = None,
    ) -> dict[str, Any]:
        """Recompute a step's gradients in FP32 on the same batch and weights and measure what the run's precision cost.

        Call it after the backward and the stepper's ``unscale_``, before ``step``: the run's gradients are then the
        true ones (scaled backward, unscaled; the FP32 masters where there are any: :meth:`named_grads`; compact
        weights' still-scaled ones measured times the factor their step owes them, in FP32).
        The FP32 reference runs on a deep copy of ``module`` (tensor attributes that are not graph leaves, such as a
        metric updated with the loss, copied detached): FP8 layers back to ``nn.Linear``, everything cast to FP32,
        the FP32 masters as weights where they exist (with master_weights="kahan" the 16-bit weights plus their
        compensation; else the weights upcast), floating inputs upcast, autocast off.
        Nothing of the run is touched: not ``.grad``, the optimizer, the module's state (BatchNorm statistics, Python
        attributes a ``loss_fn`` changes: they change on the copy), the FP8 scaling state, nor the RNG stream (forked;
        each pass starts from ``start``'s RNG state, so dropout draws the step's masks).

        ``recompute=True``: the run's gradient is recomputed too, on a copy in the run's precision (forward context,
        FP8 layers from ``start``'s scaling state, loss scale, unscaled as the step unscales). Needed when ``.grad``
        holds more than this batch's gradient: gradient accumulation (pass the last micro-batch) or a data-parallel
        all-reduce (each rank measures its own batch). With FP8 layers a third pass, the run's precision with FP8 layers
        back in the base precision, splits each FP8 layer's error into what FP8 and what the base precision cost.

        Args:
            module: the module whose parameters the stepper trains (the one given to :meth:`setup_module`).
            loss_fn: ``(module, batch) -> loss``; called on the copies, so it must use the module it is given.
            batch: the (last micro-)batch of the step, as the step's forward saw it.
            start: the :meth:`forward_state` taken before the step's forward; ``None``: the current RNG and FP8 state.
            step: the optimizer step, recorded in the result.

        Returns:
            Plain values: ``step``, ``loss_scale``, ``recomputed``, ``finite`` (the run's gradients hold no inf/NaN),
            and overall and per owning module (``modules``: qualified name -> the same keys plus ``numel``):
            ``underflow_frac`` (elements nonzero in FP32 that are zero in the run's gradient, over the elements nonzero
            in FP32), ``rel_error`` (``||g - g32|| / ||g32||``), ``cosine`` (of ``g`` and ``g32``); ``fp8``: per FP8
            layer, ``fp8_rel_error`` (``||g - g_base|| / ||g32||``) and ``base_rel_error`` (``||g_base - g32|| /
            ||g32||``), ``g_base`` being its gradient with FP8 off. One host sync (plus the loss scale's).

        Raises:
            ValueError: ``module`` is not the stepper's.
            RuntimeError: ``module`` holds sharded (DTensor) parameters, or ``loss_fn`` returned no differentiable loss.
        """
        return probe.measure(module, loss_fn, batch, layout=self.layout, keeper=self.keeper,
                             named_grads=self.named_grads, owed=self._owed_factors(), scale=lambda: self.loss_scale,
                             forward_context=self.forward_context, device=self.device, recompute=recompute,
                             start=start, step=step)


# ------------------------------------------------------------------------------------ the step's own bookkeeping
class Iteration:
    """What the iteration in progress has done, per optimizer (by id)."""

    def __init__(self) -> None:
        self.unscaled: set[int] = set()  # optimizers unscaled (and checked) in this iteration, not yet stepped
        self.stepped: set[int] = set()  # optimizers stepped since the last scale update
        self.data_fault = False  # a skip of this iteration is not the scale's fault (an inf/NaN batch, or a late one)
        self.overflowed = False  # a skip of this iteration counts as an overflow (not inf/NaN entering late)
        self.stepped_on: dict[int, GradSet] = {}  # per optimizer: the gradients (and versions) it last stepped on
        self.checked: dict[int, GradSet] = {}  # per optimizer: its gradients (and versions) as the check saw them

    def awaited(self, optimizers: Sequence[Optimizer], done: Optimizer, keeper: WeightKeeper) -> bool:
        """Whether another optimizer still has to step on this iteration's gradients (one loss, several optimizers):
        unscaled and not stepped, or holding gradients. The scale changes only after the last one, as GradScaler
        documents (one ``update()`` per iteration), so every optimizer unscales with the scale its loss was scaled by.
        Host state only."""
        for optimizer in optimizers:
            if optimizer is done or id(optimizer) in self.stepped:
                continue
            if id(optimizer) in self.unscaled:
                return True
            # Gradients it already stepped on (a loop that zeroes before backward) are not this iteration's.
            if any(g is not None and (g, g._version) not in self.stepped_on.get(id(optimizer), ())
                   for g in _grads(keeper, optimizer)):
                return True
        return False

    def note_checked(self, optimizer: Optimizer) -> None:
        """``optimizer``'s gradients as the gradient check left them: the step-input check reads again only those
        written since (by a hook or clipping)."""
        self.checked[id(optimizer)] = GradSet([grad for g in optimizer.param_groups for p in g["params"]
                                               if (grad := p.grad) is not None])

    def changed_since_check(self, optimizer: Optimizer) -> list[torch.Tensor] | None:
        """``optimizer``'s gradients written since the check noted them (by a hook or clipping), which the step-input
        check reads again; None: no check was noted (read them all). Ends the record: one call a step."""
        checked = self.checked.pop(id(optimizer), None)
        if checked is None:
            return None
        return checked.changed([p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None])

    def unchanged_since_check(self, optimizer: Optimizer) -> bool:
        """Whether every gradient of ``optimizer`` is still the plain tensor, at the version, that the check saw."""
        checked = self.checked.get(id(optimizer))
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return checked is not None and len(grads) == len(checked) and all(
            type(g) is torch.Tensor and (g, g._version) in checked for g in grads)

    def note_stepped_on(self, optimizers: Sequence[Optimizer], optimizer: Optimizer, keeper: WeightKeeper) -> None:
        if len(optimizers) > 1:  # only awaited reads it
            self.stepped_on[id(optimizer)] = GradSet(g for g in _grads(keeper, optimizer) if g is not None)

    def update_scale_(self, checker: LossScaler | None) -> None:
        """The iteration's one scale update, once every optimizer that had gradients stepped (or at the next
        backward, or a checkpoint, for one that never stepped): skipped without a backoff when the data was at
        fault."""
        if checker is not None and self.stepped:
            checker.skip_update_(overflow=self.overflowed) if self.data_fault else checker.update()
        self.stepped.clear()
        self.data_fault = self.overflowed = False


def _grads(keeper: WeightKeeper, optimizer: Optimizer) -> list[torch.Tensor | None]:
    return [p.grad for p in keeper.grads(optimizer).holders]


_VERSION = attrgetter("_version")
_DEREF = weakref.ref.__call__


class GradSet:
    """Gradient tensors with their version counters at one moment, by identity (tensors do not hash by value); held
    weakly, so gradients dropped by ``zero_grad()`` are freed. Kept in order: the step asks about the same gradients in
    the same order, which one pass of C-level maps answers (no Python call per gradient); the index by identity is
    built only when asked otherwise."""

    def __init__(self, grads: Iterable[torch.Tensor]) -> None:
        grads = list(grads)
        self._refs = list(map(weakref.ref, grads))
        self._versions = list(map(_VERSION, grads))
        self._by_id: dict[int, tuple[weakref.ref, int]] | None = None

    def __len__(self) -> int:
        return len(self._refs)

    def _seen(self) -> dict[int, tuple[weakref.ref, int]]:
        if self._by_id is None:
            self._by_id = {id(g): (ref, version) for ref, version in zip(self._refs, self._versions)
                           if (g := ref()) is not None}
        return self._by_id

    def __contains__(self, item: tuple[torch.Tensor, int]) -> bool:
        grad, version = item
        seen = self._seen().get(id(grad))
        return seen is not None and seen[0]() is grad and seen[1] == version

    def same(self, grads: list[torch.Tensor]) -> bool:
        """Whether ``grads`` are the set's gradients, in its order, each at its version (nothing written since)."""
        return (len(grads) == len(self._refs) and all(map(is_, map(_DEREF, self._refs), grads))
                and list(map(_VERSION, grads)) == self._versions)

    def changed(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients of ``grads`` not in the set as they are now (written since, or new): one call a step. The
        quick test (:meth:`same`, C-level maps) is left to eager runs: dynamo cannot trace ``weakref.ref.__call__``
        through ``map`` (a step compiled whole)."""
        if not torch.compiler.is_compiling() and self.same(grads):
            return []
        seen = self._seen()
        return [g for g in grads if (s := seen.get(id(g))) is None or s[0]() is not g or s[1] != g._version]


@dataclass
class RunCounters:
    """The run's history, owned here and read by everyone else (the stepper's properties are views of it). A rollback
    keeps it (it undoes the weights, not the history); a resume restores it."""

    step_count: int = 0
    """Optimizer steps taken or skipped (one per optimizer per iteration)."""
    overflow_count: int = 0
    """Steps skipped because their gradients held inf/NaN."""
    skipped_steps: int = 0
    """Steps not applied: overflows plus steps discarded by ``skip_step``."""
    last_step_skipped: bool = False
    applied_by: dict[int, int] = field(default_factory=dict)
    """Applied steps per optimizer (by id, in this process), for the LR hold; not part of the state."""

    def record(self, *, skipped: bool, overflow: bool, optimizer: Optimizer | None = None) -> None:
        """Count one step of ``optimizer`` (None: a step no optimizer is known for)."""
        self.last_step_skipped = skipped
        self.step_count += 1
        if skipped:
            self.skipped_steps += 1
        elif optimizer is not None:
            applied = self.applied_by
            applied[id(optimizer)] = applied.get(id(optimizer), 0) + 1
        if overflow:
            self.overflow_count += 1

    def applied(self, optimizer: Optimizer | None = None) -> int:
        """Steps applied (not skipped), of ``optimizer`` alone if given (seen through a front end's wrapper)."""
        if optimizer is None:
            return self.step_count - self.skipped_steps
        for _ in range(3):  # a front end's wrapper (Fabric's, Lightning's) around the optimizer that steps
            inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
            if not isinstance(inner, Optimizer) or inner is optimizer:
                break
            optimizer = inner
        return self.applied_by.get(id(optimizer), 0)

    def state_dict(self) -> dict[str, Any]:
        """``step_count``, ``overflow_count``, ``last_step_skipped``, ``skipped_steps`` (plain Python values)."""
        return {"step_count": self.step_count, "overflow_count": self.overflow_count,
                "last_step_skipped": self.last_step_skipped, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count, self.overflow_count = int(state["step_count"]), int(state["overflow_count"])
        self.skipped_steps, self.last_step_skipped = int(state["skipped_steps"]), bool(state["last_step_skipped"])

    keep_live_ = staticmethod(keep_live_counters)
    """A scaler's saved state with its event counters at their live values (a rollback keeps history)."""


class StepBuffers:
    """Copies of a module's persistent buffers taken before a step's first training forward, written back when the
    step is skipped.

    Which buffers: the persistent ones (the module's ``state_dict``: BatchNorm's ``running_mean``, ``running_var``
    and ``num_batches_tracked``, any running average a model keeps). Non-persistent buffers are caches (masks,
    rotary tables) or precision state with rules of their own (an FP8 layer's amax history must keep the amax of an
    overflowing step to back its scale off), and are left alone.

    Which are copied: on the first step all of them; afterwards those of torch's norm layers with running statistics
    (BatchNorm, SyncBatchNorm, InstanceNorm: their kernel writes the statistics without moving the tensors' version
    counters) and those a step has been seen to change (their version counter moved between the first forward and
    the step's end: a host-side integer, no device read). A model whose forward writes no buffer then copies nothing;
    BatchNorm's statistics cost one small copy a step. A buffer of another module that changes for the first time on
    a later step is watched from then on (that step's change is not undone if it is skipped).

    The restore is a host-side decision on the path that already knows the step was skipped (the step's one host
    read), a ``copy_`` on the device: a clean step adds no host read.
    """

    def __init__(self) -> None:
        self._module: nn.Module | None = None
        self._slots: list[tuple[nn.Module, str]] = []  # (owning module, buffer name) of each persistent buffer
        self._norms: set[int] = set()  # slots of norm layers, whose statistics change without a version bump
        self._watched: set[int] | None = None  # slots a step was seen to change; None: nothing learned yet (all)
        self._versions: list[int] = []  # each slot's version counter when the copies were taken
        self._saved: dict[int, torch.Tensor] | None = None  # the copies of the step in progress; None: none taken
        self.copied = 0
        """Buffers copied at the start of the latest step (0 once the model is known to change none)."""

    def begin_(self, module: nn.Module | None) -> None:
        """Before a forward: copy the buffers if this is the step's first training forward (gradients enabled, not
        inference mode: validation forwards change no statistics and take no copy). Later forwards of the same step
        (micro-batches, a replay) keep the first copy."""
        if self._saved is not None or module is None:
            return
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return
        if module is not self._module:
            self._module, self._watched = module, None
            self._slots = [(owner, name) for owner in module.modules() for name, buffer in owner._buffers.items()
                           if buffer is not None and name not in owner._non_persistent_buffers_set]
            self._norms = {i for i, (owner, _) in enumerate(self._slots) if isinstance(owner, _NormBase)}
        if not self._slots:
            return
        buffers = self._buffers()
        self._versions = [_version(b) for b in buffers]
        watched = range(len(buffers)) if self._watched is None else self._watched
        with torch.no_grad():
            self._saved = {i: b.detach().clone() for i in watched if (b := buffers[i]) is not None}
        self.copied = len(self._saved)

    def end_(self, *, skipped: bool) -> None:
        """At the step's end: learn which buffers it changed and, if it was ``skipped``, write the copies back. The
        next training forward takes new copies."""
        saved, self._saved = self._saved, None
        if saved is None:
            return
        buffers = self._buffers()
        changed = {i for i, b in enumerate(buffers) if b is not None and _version(b) != self._versions[i]}
        changed |= self._norms
        self._watched = changed if self._watched is None else self._watched | changed
        if skipped:
            _write_back(buffers, saved)

    def restore_(self) -> bool:
        """Write the copies back now (a replay of the step was rejected, or the step is dropped), keeping none: the
        next training forward copies again. Returns whether there were copies."""
        saved, self._saved = self._saved, None
        if not saved:
            return False
        _write_back(self._buffers(), saved)
        return True

    def _buffers(self) -> list[torch.Tensor | None]:
        # By name each time: a cast (a fallback's) replaces the tensor a module holds under it.
        return [owner._buffers.get(name) for owner, name in self._slots]


def _version(tensor: torch.Tensor | None) -> int:
    # An inference tensor has no version counter (nor can it be written outside inference mode).
    return -1 if tensor is None or tensor.is_inference() else tensor._version


def _write_back(buffers: list[torch.Tensor | None], saved: dict[int, torch.Tensor]) -> None:
    with torch.no_grad():
        for i, copy in saved.items():
            buffer = buffers[i]
            if buffer is not None:
                buffer.copy_(copy)


# ------------------------------------------------------------------------------------------- argument checks
def check_arguments(call: str, precision: str, scaler: object, fp32_modules: object) -> None:
    """What the per-argument checks cannot see: containers that are not lists, a class for an instance, an adaptive
    scaler sized for another format than the run's FP16, a scale whose reciprocal is not a finite FP32 number."""
    if isinstance(fp32_modules, (str, type)):
        fp32_modules = [fp32_modules]  # one name or one module type
    elif fp32_modules is None or isinstance(fp32_modules, (bytes, dict)) or not isinstance(fp32_modules, Iterable):
        raise TypeError(f"{call}(fp32_modules={fp32_modules!r}): must be a list of module names or nn.Module types;"
                        " () for none.")
    if any(spec == "" for spec in fp32_modules):
        raise ValueError(f"{call}(fp32_modules={list(fp32_modules)!r}): '' names the root, the whole model in FP32;"
                         " use precision='32-true' for that, or name the submodules to keep in FP32.")
    if isinstance(scaler, type):
        raise TypeError(f"{call}(scaler={scaler.__name__} (the class)): pass an instance, {scaler.__name__}(), or a"
                        " name ('dynamic', 'static', 'adaptive').")
    if isinstance(scaler, DynamicLossScaler) and scaler.is_enabled() and precision in ("16-mixed", "16-true"):
        target = getattr(scaler, "target_format", "fp16")
        if target in ("bf16", "fp32"):
            raise ValueError(
                f"{call}({precision!r}, scaler={type(scaler).__name__}(target_format={target!r})): the scale would be"
                f" sized for {target.upper()}'s range while this run's gradients are FP16 (max 65504), so every step"
                " would overflow; use target_format='fp16' (the default).")
    scale = scaler.get_scale() if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() else None
    if scale is not None and not (_MIN_SCALE <= scale <= _MAX_SCALE):
        raise ValueError(
            f"{call}(scaler={type(scaler).__name__}(init_scale={scale!r})): 1/scale must be a finite FP32 number"
            f" (unscaling multiplies by it): use a scale in [{_MIN_SCALE:.3g}, {_MAX_SCALE:.3g}]; 2.**16 is usual.")


_MIN_SCALE = 1.0 / torch.finfo(torch.float32).max
_MAX_SCALE = float(torch.finfo(torch.float32).max)


# ------------------------------------------------------------------------------------------------ method arguments
# Checks of the stepper's per-call arguments: isinstance and float comparisons only (no tensor is read).
def check_optimizer(call: str, value: object, name: str = "optimizer") -> Optimizer:
    """``value`` if it is a torch optimizer (Fabric's wrapper is one).

    Raises:
        TypeError: anything else (a name, None, a LightningOptimizer's ``.optimizer`` forgotten).
    """
    if not isinstance(value, Optimizer):
        raise TypeError(f"{call}({name}={_short(value)}): must be a torch.optim.Optimizer (the one the model's"
                        " parameters are stepped by).")
    return value


def check_optimizers(call: str, value: object) -> list[Optimizer]:
    """``value`` as a list if it is a list or tuple of torch optimizers.

    Raises:
        TypeError: not a list or tuple, or an entry is not an optimizer.
    """
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{call}(optimizers={_short(value)}): must be a list of torch.optim.Optimizer.")
    return [check_optimizer(call, optimizer, f"optimizers[{index}]") for index, optimizer in enumerate(value)]


def check_module(call: str, value: object, name: str = "module") -> nn.Module:
    """``value`` if it is an ``nn.Module``.

    Raises:
        TypeError: anything else.
    """
    if not isinstance(value, nn.Module):
        raise TypeError(f"{call}({name}={_short(value)}): must be a torch.nn.Module (the model).")
    return value


def check_clip(call: str, name: str, value: object) -> None:
    """A clip threshold: a real number >= 0 (inf: no clipping). NaN passes: as in torch, it makes the gradients NaN,
    and the step is skipped like any non-finite step (the weights are left alone).

    Raises:
        TypeError: not a real number.
        ValueError: negative.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{call}({name}={_short(value)}): must be a number >= 0 (inf: no clipping).")
    if value < 0:
        raise ValueError(f"{call}({name}={value!r}): must be a number >= 0 (inf: no clipping); a negative threshold"
                         " would flip the gradients' signs.")


def check_norm_type(call: str, value: Any) -> None:
    """A p-norm's order: a number, or ``"inf"`` (what ``torch.nn.utils.clip_grad_norm_`` takes).

    Raises:
        TypeError: neither (``"x"``, None, a bool).
    """
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or math.isnan(number):
        raise TypeError(f"{call}(norm_type={_short(value)}): must be a number (2.0: the Euclidean norm) or 'inf'.")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

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

from collections.abc import Generator, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.optim import Optimizer

from lit_mpstable.core.validate import bool_arg, choice_arg, int_arg
from lit_mpstable.core.attribution import any_nonfinite
from lit_mpstable.fp8 import FP8Config, fp8_config
from lit_mpstable.core.compiled import eager, is_compiled, recompile_note
from lit_mpstable.core.counters import RunCounters
from lit_mpstable.core.islands import FP32Islands
from lit_mpstable.core.iteration import Iteration
from lit_mpstable.core.layout import PrecisionLayout
from lit_mpstable.core.fsdp import fsdp2_fallback_refusal
from lit_mpstable.core.memory import training_memory
from lit_mpstable.core.observer import GradObserver, shard_view
from lit_mpstable.core.policy import OpPolicy
from lit_mpstable.core.scalers import LossScaler, ScalerName, build_scaler
from lit_mpstable.core.schedulers import ScheduleHold
from lit_mpstable.core.step_guard import check_step_inputs_, stale_grads_note
from lit_mpstable.core.step_report import blame, blame_late, observe
from lit_mpstable.core.stepper_setup import adopt_device, setup_module, setup_optimizers
from lit_mpstable.core.stepper_state import load_scaler_state_, load_weights_state_, weights_state
from lit_mpstable.core.tensors import default_dtype, floating_tensors, map_tensors, tensor_init_context
from lit_mpstable.core.weights import PlainKeeper, WeightKeeper

__all__ = ["MasterMode", "OpPolicyName", "PrecisionName", "PrecisionStepper", "ScalerName", "default_dtype",
           "tensor_init_context"]

PrecisionName = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "auto"]
MasterMode = Literal["fp32", "kahan", "stochastic"]
OpPolicyName = Literal["autocast", "auto"]

_FORMAT_IDS = {"16-mixed": "fp16", "16-true": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16"}
_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, "16-true": torch.float16, "bf16-true": torch.bfloat16}


class PrecisionStepper:
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
        owner: str | None = None,
    ) -> None:
        self.owner = call = owner or type(self).__name__
        self.warnings: list[str] = []
        """Messages the front end should show once (each is appended once), e.g. a scaler adopted onto the device."""
        choice_arg(call, "precision", precision, get_args(PrecisionName))
        if device is not None:
            choice_arg(call, "device", device, ("cpu", "cuda"))
        if not isinstance(master_weights, bool):
            choice_arg(call, "master_weights", master_weights, (True, False, *get_args(MasterMode)))
        bool_arg(call, "skip_nonfinite", skip_nonfinite)
        bool_arg(call, "diagnose", diagnose)
        int_arg(call, "telemetry_every_n_steps", telemetry_every_n_steps, low=1, none=True,
                unit="optimizer steps between computations; 50 keeps the cost under 1% of a step")
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if precision == "auto":
            bf16_ok = self.device == "cpu" or torch.cuda.is_bf16_supported()
            precision = "bf16-mixed" if bf16_ok else "16-mixed"
        self.precision: str = precision
        self.master_mode: str | None = ("fp32" if master_weights is True else master_weights or None)
        if not self.true_16bit:
            self.master_mode = None  # the *-mixed modes keep FP32 weights: nothing to master
        # The scaler the run scales with, and the LossScaler the step calls (the same object unless foreign).
        self._checker: LossScaler | None
        self.scaler, self._checker = build_scaler(call, precision, scaler, self.device, skip_nonfinite=skip_nonfinite,
                                                  warnings=self.warnings)
        self.skip_nonfinite = skip_nonfinite
        self.fp8 = fp8_config(fp8)
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
        formats = [_FORMAT_IDS.get(self.precision, "fp32")] + (["fp8_e5m2"] if self.fp8 is not None else [])
        self.observer = GradObserver(telemetry_every_n_steps, formats, diagnose=diagnose)
        self.keeper: WeightKeeper = PlainKeeper(call, fp16_state=self.precision == "16-true" and self.master_mode is None)
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
        self._input_nonfinite: torch.Tensor | None = None
        self._layout_seen: tuple | None = None  # the fallbacks in force at the last forward

    # ------------------------------------------------------------------------------------------- live state
    @property
    def dtype(self) -> torch.dtype:
        """The 16-bit compute dtype, or ``torch.float32`` for ``"32-true"``."""
        return _DTYPES.get(self.precision, torch.float32)

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

    # ------------------------------------------------------------------------------------------------ setup
    def setup_module(self, module: nn.Module, *, fsdp2: bool = False) -> nn.Module:
        """Apply the layout (16-bit cast of ``*-true`` modes, FP8 swap, FP32 islands) in place; returns ``module``.

        FSDP2 (``fsdp2=True``: the strategy shards the model, now or later; detected anyway once ``fully_shard`` ran):
        FSDP2's FP32 sharded parameters are the master weights, so none are built and no parameter is cast (without
        masters, only before sharding). Called before ``fully_shard`` it swaps the FP8 layers and hooks the islands
        (FSDP2 binds parameters to the layer objects it shards); called after, it changes nothing and checks every
        unit's ``MixedPrecisionPolicy`` against the precision (:func:`~lit_mpstable.core.fsdp.check_fsdp_policies`).

        Raises:
            ValueError: FSDP2 with a sharded model whose policies do not match, FP8 layers not swapped before
                sharding, or ``master_weights="kahan"``/``"stochastic"`` (FSDP2 keeps FP32 shards instead).
        """
        return setup_module(self, module, fsdp2=fsdp2)

    def setup_optimizers(self, module: nn.Module, optimizers: list[Optimizer], schedulers: list[Any] = ()) -> None:
        """Bind the weight keeper (FP32 masters, compact weights) to ``module`` and ``optimizers``, and hold
        ``schedulers`` on skipped steps."""
        setup_optimizers(self, module, optimizers, list(schedulers))

    def check_eps(self, optimizers: Iterable[Optimizer]) -> None:
        """Refuse, in ``'16-true'`` without masters, an ``eps`` FP16 cannot hold (see
        :func:`~lit_mpstable.core.weights.check_eps`)."""
        self.keeper.check_eps(optimizers)

    def adopt_device_(self, module: nn.Module) -> None:
        """Run where ``module`` lives (its first parameter's device): autocast, the FP32 islands and the loss scalers
        follow it. :meth:`setup_optimizers` calls it; a front end that meets the model before it is moved (Fabric
        converts it first) calls it again before the first forward."""
        adopt_device(self, module)

    @torch.no_grad()
    def follow_model_weights_(self) -> list[str]:
        """Restart from its 16-bit weight every FP32 master whose rounding that weight no longer is, and return their
        names: weights loaded into the model after the masters were bound (a pretrained checkpoint loaded after
        ``fabric.setup``) would otherwise be overwritten from the stale master by the next applied step. One host
        sync; a front end calls it once per optimizer, before its first step."""
        return self.keeper.follow_model_weights_()

    # -------------------------------------------------------------------------------------- forward, backward
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Autocast (``*-mixed``), the 16-bit default dtype (``*-true``), the op policy and FP8's own context.

        With ``torch.compile``: none of this adds a graph break (autocast and the policy's mode are traced into the
        graph, or guarded on from outside it). The forward that traces an overflow (the step after one, or every step
        with ``diagnose``) runs eagerly: its hooks would break the graph and recompile it for one step.
        """
        self._note_recompile()
        traced = self.observer.tracer is not None
        with eager() if traced else nullcontext(), self.layout.forward_context():
            if self.compute_dtype == torch.float32:
                yield
            elif self.true_16bit:
                with default_dtype(self.dtype):  # tensors created inside forward default to the 16-bit dtype
                    yield
            else:
                # cache_enabled=False as Lightning's MixedPrecision: the weight-cast cache leaks across no_grad
                # regions. The op policy runs inside autocast: it overrides it for whole families, never in islands.
                with torch.autocast(self.device, dtype=self.dtype, cache_enabled=False), self.policy.context(self.device):
                    yield
                if not self.policy.pending and self.stats.get("op_policy") != self.policy.choices:
                    self.stats["op_policy"] = dict(self.policy.choices)  # decided (second forward), forced or resumed
                    self.stats["op_policy_ms"] = {f: {"autocast": m.autocast_ms, "fp32": m.fp32_ms}
                                                  for f, m in self.policy.measurements.items()}

    def _note_recompile(self) -> None:
        layout = self.layout
        seen = (layout.fp32, layout.fp8_off, tuple(layout.fp8_removed), tuple(layout.fp32_modules))
        changed, self._layout_seen = self._layout_seen not in (None, seen), seen
        if changed and layout.module is not None and is_compiled(layout.module):
            recompile_note(self.step_count, self.warnings)

    def convert_input(self, data: Any) -> Any:
        """``*-true`` modes: floating tensors of ``data`` cast to the compute dtype. In every mode it notes, on the
        device, whether the batch holds inf/NaN (read only after an overflow, to blame the data and not a layer)."""
        tensors = floating_tensors(data)
        if tensors:
            flag = any_nonfinite(tensors)
            self._input_nonfinite = flag if self._input_nonfinite is None else self._input_nonfinite | flag
        if not self.true_16bit:
            return data
        return map_tensors(data, lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward`` on: multiplied by the loss scale when scaling.

        A new backward also closes what the last one left open: an optimizer unscaled (or clipped) without a step
        belongs to a dropped batch (``zero_grad()`` without ``step()``), so its unscaled gradients and inf/NaN check
        are dropped too (GradScaler would refuse the next ``unscale_``; stepping on them would apply gradients
        ``scale`` times too large, or the old check); a scale update still owed is made now."""
        for optimizer in [o for o in self.optimizers if id(o) in self.iteration.unscaled]:
            if (note := stale_grads_note(optimizer)) is not None and note not in self.warnings:
                self.warnings.append(note)
            self.drop_grads_(optimizer)
        if self.iteration.stepped:
            self._update_scale_()
        self.last_loss = loss.detach()
        return self.scaler.scale(loss) if self.scaler is not None else loss

    # ------------------------------------------------------------------------------------------------- step
    def unscale_(self, optimizer: Optimizer) -> None:
        """Make ``optimizer``'s gradients true values (once per iteration): into the FP32 masters, unscaled there,
        checked for inf/NaN (agreed across ranks), and shown on the model's 16-bit parameters for hooks and a user's
        own clipping. No host sync."""
        if id(optimizer) in self.iteration.unscaled:
            return
        self.iteration.unscaled.add(id(optimizer))
        if all(optimizer is not known for known in self.optimizers):
            self.optimizers.append(optimizer)
        self.keeper.unscale_(optimizer, self._checker, self.scaler, self.device)
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
        self.unscale_(optimizer)
        return self.keeper.clip_grad_norm_(optimizer, max_norm, norm_type)

    def clip_grad_value_(self, optimizer: Optimizer, clip_value: float) -> None:
        """Clamp ``optimizer``'s true gradients to ``±clip_value`` (on the masters with ``master_weights``; with
        compact weights in the step's FP32 chunks, after unscaling)."""
        self.unscale_(optimizer)
        self.keeper.clip_grad_value_(optimizer, clip_value)

    def skip_step(self) -> None:
        """Discard the gradients of the step in progress: no update, LR schedule held, scale unchanged."""
        self._skip_requested = True

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

    def count_unchecked_step(self, optimizer: Optimizer | None = None) -> None:
        """Count a step the front end took itself, unchecked (LBFGS evaluates its closure inside ``step``)."""
        self._record(skipped=False, overflow=False, optimizer=optimizer)

    def step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Step ``optimizer`` unless its gradients hold inf/NaN (or :meth:`skip_step` was called); then update the
        scale, refresh the 16-bit weights from the masters, and count. One host sync: the skip decision."""
        if self._skip_requested:
            return self.discard_(optimizer)
        self.unscale_(optimizer)
        self.keeper.absorb_grads_(optimizer)
        checker = self._checker
        early = (check_step_inputs_(checker, optimizer, scaled=self.scaler is not None, device=self.device)
                 if checker is not None and self.skip_nonfinite else None)
        output, skipped = self.keeper.step_(optimizer, checker, **kwargs)
        late = None
        now = self.iteration
        if checker is not None:
            # Why it skipped, read on skipped steps only: inf/NaN that entered after the gradient check, or a batch
            # that itself held inf/NaN (the input check). Neither says anything about the scale: no backoff.
            if skipped and early is not None and not bool(early):
                late = now.data_fault = True
            elif skipped and self._input_nonfinite is not None and bool(self._input_nonfinite):
                now.data_fault = True
            now.overflowed |= skipped and not late
            now.stepped.add(id(optimizer))
        now.unscaled.discard(id(optimizer))
        if late:
            blame_late(self, optimizer)
        elif skipped:
            blame(self)
        # inf/NaN that entered late is no overflow (a fallback to a wider precision would not help): skipped only.
        self._record(skipped=skipped, overflow=skipped and not late, optimizer=optimizer)
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

    def drop_grads_(self, optimizer: Optimizer) -> None:
        """Forget this iteration's gradients of ``optimizer`` without counting a step (nothing ran backward)."""
        optimizer.zero_grad(set_to_none=True)
        self.keeper.drop_(optimizer)
        if self._checker is not None:
            self._checker.forget_(optimizer)
        self.iteration.unscaled.discard(id(optimizer))

    def _record(self, *, skipped: bool, overflow: bool, optimizer: Optimizer | None = None) -> None:
        # Every rank, every step (applied or skipped): delayed-scaling FP8 amax histories agreed across ranks (one
        # all-reduce; nothing on one process).
        self.layout.sync_fp8_()
        self.counters.record(skipped=skipped, overflow=overflow, optimizer=optimizer)
        self._input_nonfinite = None

    def state_tensors(self) -> list[torch.Tensor]:
        """Resident tensors of the precision itself that neither the model nor the optimizers hold (compensation
        buffers), for memory accounting."""
        return self.keeper.state_tensors()

    def memory_report(self) -> dict[str, int]:
        """Bytes of training state by kind (``lit_mpstable.core.memory.training_memory``): ``weights``, ``masters`` (FP32
        masters), ``gradients``, ``optimizer_state``, ``compensation`` (``"kahan"``), ``total``. Reads no device data.

        Raises:
            RuntimeError: no model or optimizer has been set up yet.
        """
        module = self.layout.module
        if module is None or not self.optimizers:
            raise RuntimeError(f"{self.owner}.memory_report(): available once training has set up model and optimizers.")
        return training_memory(module, self.optimizers, extra={"compensation": self.state_tensors()})

    # ----------------------------------------------------------------------------------- telemetry, blame
    def named_grads(self) -> list[tuple[str, Any]]:
        """``(name, parameter)`` of the model, the FP32 master standing in where there is one (it holds the true
        gradient); FSDP2 parameters as this rank's gradient shard."""
        module = self.layout.module
        if module is None:
            return []
        return [(name, shard_view(grad)) for name, grad in self.keeper.named_grads(module)]

    # --------------------------------------------------------------------------------------------- fallback
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

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly; tensors and plain Python values (``weights_only=True`` loads it).

        Keys: ``precision``, ``scaler`` (its own state dict, ``{}`` without scaling), ``step_count``,
        ``overflow_count``, ``skipped_steps``, ``last_step_skipped``, ``layout`` (fallbacks, FP8 amax histories),
        ``masters`` (FP32 masters by parameter name, ``{}`` without), ``op_policy`` (the choice per op family),
        ``schedules`` (where each held LR scheduler last stepped, in applied steps), ``compact`` (the compact weights'
        compensation buffers and rounding seed, ``{}`` without).
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
        }

    def load_state_dict(self, state: dict[str, Any], *, keep_counters: bool = False) -> list[str]:
        """Restore :meth:`state_dict` (strict). ``keep_counters``: numeric state only, the event counters (the
        run's and the scaler's) keep their live values (a rollback undoes the weights, not the history).

        Returns notes for the front end to show (a precision switch on resume, say).

        Raises:
            KeyError: keys differ from :meth:`state_dict`'s (each is named).
        """
        expected = set(self.state_dict())
        if set(state) != expected:
            missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
            raise KeyError(
                f"{self.owner}.load_state_dict: missing keys {missing}, unknown keys {unknown}; was the checkpoint"
                " written by another version of lit_mpstable?"
            )
        notes = load_scaler_state_(self.scaler, state, precision=self.precision, keep_counters=keep_counters)
        if not keep_counters:
            self.counters.load_state_dict(state)
            self.schedules.load_state_dict(list(state["schedules"]))
        if self.layout.module is None:
            self._pending["layout"] = state["layout"]
        else:
            self.layout.load_state_dict(state["layout"])
        warning = load_weights_state_(self.keeper, state["masters"], state["compact"], mode=self.master_mode,
                                      fsdp2=self.fsdp2, pending=self._pending, module=self.layout.module,
                                      precision=self.precision)
        if warning:
            self.warnings.append(warning)
        self.policy.load_state_dict(state["op_policy"])
        return notes


"""StablePrecision for Lightning Fabric: Fabric's precision-plugin hooks mapped onto the PrecisionStepper."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, _GeneratorContextManager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.wrappers import _FabricModule, _FabricOptimizer
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.optim import LBFGS, Optimizer

from lit_mpstable.core.checkpoints import (
    SHARD_INDEX,
    SHARDED_META,
    earlier_sharded_checkpoints,
    flat_optimizer_state,
    holds_flat_state,
    is_sharded_checkpoint,
    read_sharded_meta,
    rebuilt_optimizer_state,
)
from lit_mpstable.core.fingerprint import KEY as FINGERPRINT
from lit_mpstable.core.fingerprint import (
    FingerprintMismatch,
    compare_checksums,
    compare_shard_checksums,
    earlier_checkpoint,
    every_rank,
    pinned_pass,
    shard_checksums,
)
from lit_mpstable.core.guards.ladder import REASONS, Ladder, Rung, classify, ladder_of
from lit_mpstable.core.guards.triage import any_rank, needs_triage, state_finite
from lit_mpstable.core.layout.fsdp import fsdp_units
from lit_mpstable.core.replicas import default_replicas
from lit_mpstable.core.step.stepper import check_optimizer
from lit_mpstable.core.weights.master import zero_grad_reaches_model
from lit_mpstable.core.weights.moment_keeper import pop_saved_mark
from lit_mpstable.frontends.clip_targets import clip_targets
from lit_mpstable.frontends.common import ARGS_DOC, StableFrontEnd

if TYPE_CHECKING:
    from torch.optim.optimizer import StateDict

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class StablePrecision(StableFrontEnd, Precision):
    __doc__ = (
        """Mixed precision that is stable by default, for Lightning Fabric: ``Fabric(plugins=[StablePrecision(...)])``
    instead of ``precision=``. The arguments, live state (``loss_scale``, ``last_step_skipped``, ``overflow_count``,
    ``stats``, ...), actions and state dict are those of :class:`lit_mpstable.StablePrecision`, the Trainer plugin.

    In the loop, ``fabric.backward(loss)`` scales the loss; ``optimizer.step()`` unscales, checks the gradients for
    inf/NaN (agreed across ranks), steps or skips and counts, updates the scale and refreshes the 16-bit weights from
    the FP32 masters; ``fabric.clip_gradients`` (by norm or value) clips the true gradients, and on a step whose
    gradients hold inf/NaN clips nothing and returns a norm of 0 instead of raising (the step is skipped; in FP16 a
    loss spike that takes the scaled gradients past 65504 is such a step: its norm is lost with them). A finite spike
    that SpikeGuard skips returns its real norm, in every mode. Fabric refuses a plain ``loss.backward()`` with this
    plugin, in every mode.

    Fabric shows a precision plugin each optimizer only at its step, so some things are the loop's to say
    (``docs/plugin.md``, "Lightning Fabric"):

    - LR schedulers: :meth:`hold_schedulers` makes ``scheduler.step()`` a no-op after a skipped step.
    - Exact resume: :meth:`setup_optimizers` after ``fabric.setup`` and before ``fabric.load``, so the checkpoint's
      FP32 optimizer state loads into the masters, and the plugin in the saved state (litgpt's own leaves it out; an
      optimizer resumed without it warns)::

        model, optimizer = fabric.setup(model, optimizer)
        plugin.setup_optimizers(optimizer)
        plugin.hold_schedulers(scheduler)
        fabric.load(path, {"model": model, "optimizer": optimizer, "precision": plugin})

    - The numeric fingerprint every ``fabric.save`` of the plugin carries (``docs/fingerprints.md``): :meth:`pin`
      adds the pinned micro-batch's loss; ``fabric.load`` checks the plugin's part as it loads and the rest at the
      first forward after it. :meth:`load` checks it all before it returns, falls back to an earlier file, loads
      sharded (FSDP2) checkpoints and arms the remedy ladder's restored-state rung.

    Weights loaded into the model after ``fabric.setup`` (a pretrained checkpoint) are where the masters start; under
    DDP the masters, Kahan compensation and rounding seeds are rank 0's, as the weights DDP broadcast are. As
    with Fabric's own plugins, outputs come back in the default dtype (FP32); unlike ``MixedPrecision``, ``*-mixed``
    inputs stay FP32 (autocast casts them per op, and FP32 islands see them unrounded). One model per plugin.

    What differs from the Trainer plugin's arguments: ``"16-mixed"`` on the CPU is real FP16 (Fabric's own turns it
    into BF16), said once; ``master_weights=False`` is Fabric's plain ``HalfPrecision`` (in ``"16-true"`` a torch
    optimizer's ``eps`` below 2**-14, AdamW's default 1e-8 included, is refused at ``fabric.setup(model,
    optimizer)``: FP16 state holds it as 0 or subnormal; use ``eps=1e-4``); ``fp8`` layers are swapped when
    ``fabric.setup`` converts the model, and with ``HighPrecisionBudget(by="probe")`` the loop calls
    :meth:`choose_high_precision_` once at the first step, before its forward (the plugin sees no loss); the model's
    device wins from the first forward on.
""" + ARGS_DOC)

    _placed = False  # the first forward has moved autocast, islands and scalers to the model's device
    _bound: tuple[Optimizer, ...] = ()  # optimizers set up (FP32 masters bound), in the order met
    _bound_names: tuple[str, ...] = ()  # each one's name in the fingerprint (_optimizer_name), in the same order
    _rounded = False  # an optimizer's state was loaded before its FP32 masters were bound: rounded to 16 bits
    _started: tuple[Optimizer, ...] = ()  # optimizers that reached their first step
    _schedulers: tuple[Any, ...] = ()
    _pin_loss: Callable[[nn.Module, Any], torch.Tensor] | None = None  # pin(): the pinned micro-batch's loss
    _loaded: _Loaded | None = None  # load(): the file, the state it went into, the restored-state rung's knobs
    _model_checked = False  # after fabric.load: the model's part of the fingerprint checked (at the first forward)
    _model_notes: tuple[str, ...] = ()  # what that part noted (a pinned loss not compared): recorded with the rest
    _checked: tuple[dict[str, Any] | None, int] = (None, -1)  # the plugin state loaded last: fingerprint, step_count

    # ----------------------------------------------------------------------------------------------- model
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.layout.module is not None and module is not self.layout.module:
            raise RuntimeError(
                f"{self!r}: a second model was set up ({type(module).__name__}); one plugin drives one model's"
                " precision (its islands, masters and FP8 layers). Give each model a Fabric of its own."
            )
        self.stepper.setup_module(module)
        self.stepper.check_eps(_optimizers_given_to_setup(sys._getframe(1)))  # '16-true' without masters
        if self.stepper.fp8_budget.pending:
            self._warn_once("budget-call", f"{self!r}: {_BUDGET_CALL}")
        return module

    def tensor_init_context(self) -> AbstractContextManager:
        return self.stepper.tensor_init_context()

    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    def convert_input(self, data: Any) -> Any:
        return self.stepper.convert_input(data)

    def forward_context(self) -> _GeneratorContextManager[None]:
        if self.fingerprint.pending is not None and not torch.is_inference_mode_enabled():
            # The first forward after fabric.load, before it runs (it would move BatchNorm statistics and FP8
            # histories): the loaded model's and optimizers' checksums, and the pinned micro-batch recomputed.
            self._check_fingerprint(self.fingerprint.pending, {}, loaded=True, step=False)
        if not self._placed and self.layout.module is not None:
            # Fabric converts the model before moving it: its device is known from the first forward on.
            self._placed = True
            self.stepper.adopt_device_(self.layout.module)
            self._warn_fp16_cpu()
            self._show_notes()
        if self.precision_schedule and self.layout.module is not None and self.layout.module.training:
            self._schedule_step_(self._schedulers, None, None)  # Fabric knows no run length: lr_decay simulated
        return super().forward_context()  # autocast, the op policy and its one-time report

    def convert_output(self, data: Any) -> Any:
        if self.dtype == torch.float32:
            return data
        dtype = torch.get_default_dtype()  # as Fabric's own plugins: a loss computed outside the model is FP32
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)

    # ------------------------------------------------------------------------------------------------ step
    def backward(self, tensor: torch.Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        self.stepper.scale_loss(tensor).backward(*args, **kwargs)

    # Fabric's clip_gradients calls unscale_gradients, then clips what main_params returns with torch's
    # clip_grad_norm_ (error_if_nonfinite=True) or clip_grad_value_.
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        check_optimizer(f"{type(self).__name__}.unscale_gradients", optimizer)
        self.stepper.unscale_(self._start(optimizer))

    # A list where Fabric's signature says Iterator[Parameter]: FP32 masters and placeholders are plain tensors,
    # and a list can be read more than once.
    def main_params(self, optimizer: Optimizer) -> list[Any]:  # type: ignore[override]
        """What ``fabric.clip_gradients`` clips: the parameters the optimizer updates (the FP32 masters with
        ``master_weights``), their gradients unscaled. On a step that will be skipped (inf/NaN) nothing is clipped:
        one empty placeholder stands in (torch's ``clip_grad_value_`` refuses an empty list; the norm is 0). With FP32
        masters the model's 16-bit gradients show the clipped values once Fabric has clipped (when it lets go of the
        returned list), as after the Trainer's clipping."""
        check_optimizer(f"{type(self).__name__}.main_params", optimizer)
        optimizer = self._start(optimizer)
        stepper = self.stepper
        return clip_targets(optimizer, list(stepper.main_params(optimizer)), stepper.keeper, stepper.scaler,
                            stepper.device)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"{self!r}: Fabric stepped a {type(optimizer).__name__}, not a torch optimizer. DeepSpeed brings its"
                " own loss scaler and FP32 masters; use Fabric(strategy='deepspeed', precision=...) without this"
                " plugin."
            )
        optimizer = self._start(optimizer)
        if self.fingerprint.pending is not None:  # after fabric.load: the loaded weights and optimizer state
            self._check_fingerprint(self.fingerprint.pending, {}, loaded=True)
        if self.stepper.fp8_budget.pending:
            raise RuntimeError(f"{self!r}: the first optimizer step came without the probe's choice. {_BUDGET_CALL}")
        if isinstance(optimizer, LBFGS) or "closure" in kwargs:
            return self._closure_step(optimizer, **kwargs)
        overflows = self.stepper.overflow_count
        output = self.stepper.step(optimizer, **kwargs)
        self._show_notes()
        if self._loaded is not None and self.stepper.last_step_skipped:  # the step's own skip decision: no read
            self._watch_restored(self.stepper.overflow_count > overflows)
        return output

    def _closure_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        self._check_closure_step(optimizer)
        output = optimizer.step(**kwargs)
        self.stepper.count_unchecked_step()
        return output

    # ------------------------------------------------------------------------------------------ optimizers
    def setup_optimizers(self, *optimizers: Optimizer) -> None:
        """Set up ``optimizers`` now rather than at their first step: FP32 masters bound (``*-true`` modes), so that
        ``fabric.load`` of their state afterwards resumes exactly. Call it after ``fabric.setup``; Fabric's wrapped
        optimizers are accepted, and an optimizer already set up is left as it is."""
        for index, given in enumerate(optimizers):
            optimizer = given.optimizer if isinstance(given, _FabricOptimizer) else given
            check_optimizer(f"{type(self).__name__}.setup_optimizers", optimizer, f"optimizers[{index}]")
            if optimizer not in self._bound:
                self._bind(optimizer)
            if given is not optimizer and self.stepper.master_mode == "fp32":
                # Fabric's wrapper was made before the masters were bound: its zero_grad must reach the model too.
                zero_grad_reaches_model(given)

    def hold_schedulers(self, *schedulers: Any) -> None:
        """Make each ``scheduler.step()`` a no-op unless an optimizer step was applied since it last stepped, so
        skipped steps (inf/NaN gradients) do not move the LR schedule. A call replaces the schedulers held before;
        where each stands is part of :meth:`state_dict`."""
        for index, scheduler in enumerate(schedulers):
            if not callable(getattr(scheduler, "step", None)):
                raise TypeError(f"{type(self).__name__}.hold_schedulers(schedulers[{index}]={scheduler!r:.80}): must be"
                                " an LR scheduler (with step(), e.g. torch.optim.lr_scheduler.LambdaLR).")
        self._schedulers = schedulers
        if self._bound:  # else the first optimizer's setup holds them, with any positions loaded before it
            self.stepper.schedules.hold(list(schedulers))

    def _module(self) -> nn.Module:
        if self.layout.module is None:
            raise RuntimeError(f"{self!r}: no model was set up; call fabric.setup(model, optimizer) first.")
        return self.layout.module

    def _bind(self, optimizer: Optimizer) -> None:
        stepper = self.stepper
        if any(holds_flat_state(s) for s in optimizer.state.values()):
            raise RuntimeError(
                f"{self!r}: {type(optimizer).__name__}'s state was loaded (fabric.load) before the plugin set the"
                " optimizer up: the checkpoint stores torchao's quantized states flat, and only an optimizer set up"
                " first rebuilds them. Call plugin.setup_optimizers(optimizer) after fabric.setup, before fabric.load.")
        # Lightning loads with a callable map_location, which torch.load refuses for tensor subclasses: torchao's
        # 8-bit/4-bit/FP8 states are saved flat (plain tensors) and rebuilt before load_state_dict casts them.
        optimizer.register_state_dict_post_hook(_flat_states)
        optimizer.register_load_state_dict_pre_hook(_rebuilt_states)
        name = self._optimizer_name(optimizer)  # before the masters take the model's parameters' place in it
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        if stepper.master_mode == "fp32" and any(v.dtype in _LOW_PRECISION for v in state):
            self._rounded = True
            self._warn_once(
                "rounded-state",
                f"{self!r}: {type(optimizer).__name__} held 16-bit state before its FP32 master weights were bound"
                " (loaded by fabric.load before the first step?): it was rounded to 16 bits, so the run does not"
                " resume exactly. Call plugin.setup_optimizers(optimizer) after fabric.setup, before fabric.load.",
            )
        if not self._bound:
            try:
                stepper.setup_optimizers(self._module(), [optimizer], list(self._schedulers))
            except KeyError as error:
                if not self._rounded:
                    raise
                # The checkpoint's masters cover every optimizer's parameters, and only this one is bound: the
                # others were not set up before fabric.load either. The file is right; the load order is not.
                raise RuntimeError(
                    f"{self!r}: fabric.load ran before the optimizers were set up: the checkpoint's FP32 master"
                    f" weights cover parameters that {type(optimizer).__name__}, the first optimizer to step, does"
                    " not update, and the optimizers' state was loaded in 16 bits. Call"
                    " plugin.setup_optimizers(*optimizers) with every optimizer, after fabric.setup and before"
                    " fabric.load."
                ) from error
        else:
            stepper.check_eps([optimizer])
            stepper.keeper.adopt_optimizer_(optimizer)
        if stepper.master_mode == "fp32" and not stepper.fsdp2 and fsdp_units(self._module()):
            optimizer.register_state_dict_pre_hook(self._refuse_sharded_save)
        self._bound, self._bound_names = (*self._bound, optimizer), (*self._bound_names, name)
        self._show_notes()

    def _refuse_sharded_save(self, optimizer: Optimizer) -> None:
        """Refuse ``fabric.save`` of an optimizer that updates FP32 masters beside FSDP2's 16-bit shards, by name:
        torch's sharded optimizer state dict (``torch.distributed.checkpoint``), which the strategy's save calls in
        whatever order the state lists it, knows only the model's parameters and would fail with a bare
        ``KeyError: 0``. Any other ``optimizer.state_dict()`` (the plugin's fingerprint, a loop's own) goes on."""
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__") != "torch.distributed.checkpoint.state_dict":
            frame = frame.f_back
        if frame is None:
            return
        raise NotImplementedError(
            f"{self!r}: fabric.save of {type(optimizer).__name__}, which updates FP32 master weights kept beside"
            " FSDP2's 16-bit shards (the model was sharded after its conversion), is not supported: torch's sharded"
            " optimizer state dict knows only the model's parameters. To checkpoint, train in"
            f" {self.precision.replace('-true', '-mixed')!r} with fully_shard(..., mp_policy=plugin.mp_policy): FSDP2"
            " then keeps FP32 shards and computes in 16 bits. The model and the plugin save without the optimizer.")

    def _optimizer_name(self, optimizer: Optimizer) -> str:
        """What names ``optimizer`` in the fingerprint: the model's name of the first parameter it updates (a GAN's
        ``G.0.weight`` and ``D.0.weight``), the same whatever order the loop binds its optimizers in (at
        :meth:`setup_optimizers` or at their first step); ``#i`` (binding position) for one whose parameters the model
        does not name, or that begins at a parameter another bound optimizer begins at."""
        names = {id(p): n for n, p in self._module().named_parameters()}
        first = next((names[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in names), None)
        return first if first is not None and first not in self._bound_names else f"#{len(self._bound)}"

    def _optimizer_trees(self, fingerprint: Mapping[str, Any] | None, states: list[Any]) -> dict[str, Any]:
        """The bound optimizers' ``states`` (in binding order) as the fingerprint's trees: each a root of its own,
        ``optimizer['G.0.weight']`` (:meth:`_optimizer_name`), so the order they were bound in does not matter and
        one not bound yet is not compared (:func:`compare_checksums` compares the roots given). A ``fingerprint``
        written before the names (``optimizer[0]``, ...) is compared by binding order, as it was written."""
        sums = fingerprint.get("checksums") if fingerprint is not None else None
        if isinstance(sums, Mapping) and any(p.startswith("optimizer[") and p[10:11].isdigit() for p in sums):
            return {"optimizer": states}
        return {f"optimizer[{name!r}]": state for name, state in zip(self._bound_names, states, strict=True)}

    def _start(self, optimizer: Optimizer) -> Optimizer:
        """``optimizer``, set up if Fabric hands it over for the first time, its masters following any weights loaded
        into the model since they were bound."""
        if optimizer in self._started:
            return optimizer
        if optimizer not in self._bound:
            self._bind(optimizer)
        self._check_resume(optimizer)
        # After fabric.setup: under DDP the masters, compensation and rounding seeds are rank 0's, as the weights are.
        self.stepper.follow_model_weights_(default_replicas(self._module().parameters()))
        self._started = (*self._started, optimizer)
        return optimizer

    # ----------------------------------------------------------------------------------- the fingerprint
    def state_dict(self) -> dict[str, Any]:
        """:meth:`StableFrontEnd.state_dict` and the numeric fingerprint (``docs/fingerprints.md``): checksums of the
        model's weights, the optimizers' state and the plugin's tensors, the precision manifest and, after
        :meth:`pin`, the pinned micro-batch's loss and gradient norm (one forward and backward of it). With a sharded
        model (FSDP2: DTensor weights and optimizer states) each rank's local shards are checksummed and gathered, so
        every rank calls it, as ``fabric.save`` does."""
        state = super().state_dict()
        module = self.layout.module
        trees = {"model": module.state_dict() if module is not None else {},
                 **self._optimizer_trees(None, [optimizer.state_dict() for optimizer in self._bound]),
                 "plugin": dict(state)}
        loss = self._pinned_loss if self._pin_loss is not None and module is not None else None
        fingerprint = self.fingerprint.capture(trees, self.stepper.manifest(), loss)
        fingerprint["checksums"].update(shard_checksums(trees))  # FSDP2's DTensor shards: every rank's (collective)
        return {**state, FINGERPRINT: fingerprint}

    def pin(self, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any) -> None:
        """Give the fingerprint its pinned micro-batch: ``batch`` (its first rows, a CPU copy:
        :func:`~lit_mpstable.core.fingerprint.pin_batch`) and ``loss_fn(module, batch) -> loss`` (the module given,
        not Fabric's wrapper; the batch on the module's device). Every ``fabric.save`` of the plugin then carries the
        loss and gradient norm of that batch, and a load recomputes them at the first forward after it (or the next
        ``optimizer.step()``) and compares them, bitwise on the CPU, as the Trainer's ``training_step`` pass.

        Call it after ``fabric.setup``, before the first forward, e.g. with the first batch. The first batch pinned
        stays (a later call changes only ``loss_fn``); after a load the checkpoint's batch is the one pinned. Where
        several processes run (DDP, FSDP2), every rank pins rank 0's rows, whatever batch each rank passes: the first
        call is collective (one ``broadcast_object_list`` of the cut rows), so every rank makes it. The checkpoint
        keeps rank 0's rows, and under FSDP2 the pinned gradient norm spans the ranks: the save and the load then run
        the same pass on every rank.

        Raises:
            ValueError: ``loss_fn`` is not callable, or ``batch`` (rank 0's) holds no tensor or more than 1 MiB in its
                first rows.
        """
        call = f"{type(self).__name__}.pin"
        if not callable(loss_fn):
            raise ValueError(f"{call}(loss_fn={loss_fn!r:.80}): must be a callable (module, batch) -> loss tensor.")
        if self.fingerprint.pinning:  # none yet, or a loaded one to retype as this batch (its namedtuples)
            self.fingerprint.pin(batch, rank_zero=True)  # every rank decides on rank 0's rows alike
            if self.fingerprint.batch is None:
                raise ValueError(f"{call}(batch={batch!r:.80}): must hold a tensor (in a tuple, list or dict), and"
                                 " its first rows at most 1 MiB (lit_mpstable.core.fingerprint.PIN_MAX_BYTES); on"
                                 " several ranks, rank 0's.")
        self._pin_loss = loss_fn

    def _pinned_loss(self, batch: Any) -> torch.Tensor:
        assert self._pin_loss is not None  # callers check
        dtype = self.stepper.compute_dtype if self.stepper.true_16bit else None  # as convert_input casts a batch
        with torch.enable_grad():
            return pinned_pass(self._module(), self._pin_loss, batch, forward_context=super().forward_context,
                               dtype=dtype)

    def _check_fingerprint(self, fingerprint: dict[str, Any] | None, state: dict[str, Any], *, loaded: bool,
                           step: bool = True) -> None:
        # Before loading: the plugin's own tensors and the manifest. After (fabric.load restores the rest in the order
        # of the user's dict): at the first forward, before it moves BatchNorm statistics or FP8 histories, the model's
        # checksums and the pinned micro-batch, and the optimizers' checksums where they are set up already; else
        # those at the next optimizer step (``step``), once it has set them up. One host read each.
        if not loaded:  # what a "previous" fallback from this file compares its candidates with
            count = state.get("step_count") if isinstance(state, dict) else None
            self._checked = fingerprint, count if isinstance(count, int) and not isinstance(count, bool) else -1
            self._rounded = False  # an optimizer bound before this load holds FP32 state: only a later bind rounds
        if fingerprint is None:
            return
        if not loaded:
            differences, notes = self.fingerprint.check(fingerprint, {"plugin": state}, self.stepper.manifest())
        elif state:  # load_state_dict just finished: the rest waits for the first forward or optimizer step
            self.fingerprint.pending, self._model_checked = fingerprint, False
            self.fingerprint.adopt(fingerprint)  # later saves pin the checkpoint's micro-batch
            return
        else:
            module, model = self._module(), not self._model_checked
            optimizers = step or bool(self._bound)
            self._model_checked = not optimizers
            if optimizers:
                self.fingerprint.pending = None
            trees = {**({"model": module.state_dict()} if model else {}),
                     **(self._optimizer_trees(fingerprint, [o.state_dict() for o in self._bound]) if optimizers
                        else {})}
            differences, notes = self._checksum_differences(fingerprint, trees)
            if differences and self._rounded:  # the likely cause first: FingerprintMismatch shows eight lines
                differences.insert(0, "the optimizer state was loaded before its FP32 master weights were bound,"
                                      " which rounds it to 16 bits, so what follows may be the load order's, not the"
                                      " file's: call plugin.setup_optimizers(*optimizers) after fabric.setup, before"
                                      " fabric.load")
            if model and self._pin_loss is not None:
                pinned, unchecked = self.fingerprint.check_pinned(fingerprint, self._pinned_loss,
                                                                  self.stepper.manifest())
                differences, notes = differences + pinned, notes + unchecked
            elif model and fingerprint["pinned"]:
                notes.append("the pinned micro-batch's loss was not recomputed: no loss function was given"
                             " (plugin.pin(loss_fn, batch) before the first forward)")
            notes, self._model_notes = [*self._model_notes, *notes], ()
            if not optimizers and not differences:
                self._model_notes = tuple(notes)
                return  # the optimizers' part, and the record, at the next optimizer step
        if self.fingerprint.react("fabric.load", differences, notes):
            raise FingerprintMismatch("fabric.load", [*differences, "on_fingerprint_mismatch='previous' needs the"
                                      " checkpoint's directory, which fabric.load does not give the plugin: load with"
                                      " plugin.load(fabric, path, state), which falls back to the earlier one"])

    # ------------------------------------------------------------------------------- the restored-state rung
    def load(self, fabric: Any, path: str | Path, state: dict[str, Any], *, restored_window: int = 10,
             max_restores: int = 3, strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        """``fabric.load(path, state, strict=strict, weights_only=weights_only)``, the whole numeric fingerprint
        compared before it returns (with ``on_fingerprint_mismatch="previous"`` a checkpoint that fails is replaced by
        the newest earlier one of its directory that passes), and the remedy ladder's restored-state rung
        (:attr:`~lit_mpstable.core.guards.ladder.Rung.RESTORE`) watching the steps after it
        (``docs/fingerprints.md``, "With Fabric").

        ``path`` is a checkpoint file or a sharded checkpoint's directory (``fabric.save`` under FSDP2's
        ``ModelParallelStrategy``); the plugin loads its own saved dict from one, which Lightning's sharded load does
        not, and each rank compares its own shards with the checksums it took at the save.

        A non-finite step or a spike within ``restored_window`` optimizer steps of the load (the ladder's
        ``"restored"`` fault) loads, inside that ``optimizer.step()``, the newest earlier checkpoint of ``path``'s
        directory that holds every key of ``state`` and passes its fingerprint, into ``state`` (the loop's own
        entries too); each attempt is warned and recorded in :attr:`ladder_events`. After ``max_restores`` attempts,
        or when none passes, that ``optimizer.step()`` raises ``RuntimeError`` naming why. Decided alike on every
        rank. Returns what ``fabric.load`` returns (without the plugin's state).

        Raises:
            FingerprintMismatch: the checkpoint fails its fingerprint (``"raise"``), or no earlier one passes
                (``"previous"``).
            KeyError: a sharded checkpoint holds no state of this plugin (``strict``).
            ValueError: ``fabric`` is not the Fabric this plugin is the precision of, ``state`` does not hold this
                plugin, ``path`` is a directory that is not a sharded checkpoint, or a knob is out of range.
        """
        from lightning.fabric import Fabric

        call = f"{type(self).__name__}.load"
        if not isinstance(fabric, Fabric) or fabric.strategy.precision is not self:
            raise ValueError(f"{call}(fabric={fabric!r:.80}): must be the lightning.fabric.Fabric whose precision"
                             " plugin this is (Fabric(plugins=[plugin])).")
        if not isinstance(path, (str, Path)) or (Path(path).is_dir() and not is_sharded_checkpoint(path)):
            shown = repr(path) if isinstance(path, (str, Path)) else f"{path!r:.80}"  # a path in full
            raise ValueError(f"{call}(path={shown}): must be the path of a checkpoint file fabric.save wrote, or of a"
                             f" sharded checkpoint's directory (the shards and {SHARDED_META}, as fabric.save writes"
                             " under ModelParallelStrategy)"
                             + (f"; this directory holds no {SHARDED_META}." if isinstance(path, (str, Path)) else "."))
        key = next((k for k, v in state.items() if v is self), None) if isinstance(state, dict) else None
        if key is None:
            given = f"a dict with keys {list(state)}" if isinstance(state, dict) else f"{state!r:.80}"
            raise ValueError(f"{call}(state={given}): must be a dict holding this plugin (e.g."
                             " state['precision'] = plugin), as fabric.save saved it: its fingerprint picks the"
                             " earlier checkpoint.")
        for name, value in (("restored_window", restored_window), ("max_restores", max_restores)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{call}({name}={value!r:.80}): must be an int >= 0"
                                 + (" (optimizer steps after the load in which a non-finite step or a spike loads"
                                    " the checkpoint before; 0: off)." if name == "restored_window" else
                                    " (checkpoints tried before the run stops)."))
        loaded = _Loaded(fabric, state, key, strict, weights_only, restored_window, max_restores)
        self._loaded, current = None, Path(path)  # the rung of an earlier load is off while this one loads
        tried = {current}
        while True:
            try:
                remainder = self._fabric_load(loaded, current, earlier=current != Path(path))
                if self.fingerprint.pending is not None:  # all of it is loaded: the rest of the fingerprint now
                    self._check_fingerprint(self.fingerprint.pending, {}, loaded=True, step=False)
                break
            except FingerprintMismatch as error:
                if self.fingerprint.on_mismatch != "previous":
                    raise
                if isinstance(error, _Unreadable):  # recorded as a check that failed
                    self.fingerprint.react(error.source, error.differences)
                current = self._previous(loaded, current, error, tried)
                tried.add(current)
        if restored_window:
            self._loaded, loaded.load = loaded, {"step": self.stepper.step_count, "path": str(current)}
            self._arm()
        return remainder

    def _fabric_load(self, loaded: _Loaded, path: Path, *, earlier: bool = False) -> dict[str, Any]:
        """``fabric.load(path, state)`` for :meth:`load`. A sharded checkpoint's directory: Lightning loads the model
        and optimizers from the shards and assigns the rest of ``meta.pt`` to ``state``'s keys, the plugin's dict in
        place of the plugin, unloaded; so the plugin is left out of what Fabric loads and loads its dict itself.

        ``earlier``: a directory a fallback picked. Its read errors (DCP's on every rank, another one on its rank) are
        gathered from every rank before anyone goes on, so all ranks agree, and raised as ``_Unreadable``: it fails
        as a mismatch does, and the fallback goes on to the next."""
        fabric, state, key = loaded.fabric, loaded.state, loaded.key
        if not path.is_dir():
            return fabric.load(path, state, strict=loaded.strict, weights_only=loaded.weights_only)
        rest = {k: v for k, v in state.items() if k != key}
        failed: list[str] = []
        try:
            remainder = fabric.load(path, rest, strict=loaded.strict, weights_only=loaded.weights_only)
        except BaseException as error:  # DCP's CheckpointException is a BaseException
            if not earlier or isinstance(error, (KeyboardInterrupt, SystemExit)):
                raise
            failed = _read_errors(error, fabric.global_rank)
        if earlier and (failed := every_rank(failed)):
            raise _Unreadable(str(path), [f"unreadable ({'; '.join(failed)})"])
        state.update(rest)  # the loop's own entries, as fabric.load sets them in the dict it is given
        if key in remainder:
            self.load_state_dict(remainder.pop(key))
        elif loaded.strict:
            raise KeyError(f"{type(self).__name__}.load(path={str(path)!r}): the sharded checkpoint holds no {key!r}"
                           f" (its {SHARDED_META} has {sorted(remainder)}): saved without the plugin? Pass"
                           " strict=False to load it without the plugin's state.")
        return remainder

    def _previous(self, loaded: _Loaded, failed: Path, error: FingerprintMismatch, tried: set[Path]) -> Path:
        """``on_fingerprint_mismatch="previous"`` in :meth:`load`: the newest checkpoint of ``failed``'s directory
        written before it, not ``tried`` yet, that holds every key of the state and passes what can be checked before
        it loads (its pinned loss, and a directory's shards, once it is loaded: one that fails there is the next
        ``failed``). Raises ``FingerprintMismatch`` when none passes."""
        why = list(self.fingerprint.events[-1]["differences"]) if self.fingerprint.events else list(error.differences)
        pattern = f"*{failed.suffix}"
        if failed.is_dir():
            tried_here = [c for c in earlier_sharded_checkpoints(failed) if c not in tried]
            rejected: dict[str, list[str]] = {}
            previous = None
            for candidate in tried_here:
                _, differences = self._directory_differences(loaded, candidate)
                if not differences:
                    previous = candidate
                    break
                rejected[str(candidate)] = differences
            none_passes = f" found no earlier checkpoint that passes among {len(tried_here)} in {failed.parent}"
        else:  # earlier as the restored-state rung's: a lower step_count, and the same run's (pinned micro-batch)
            saved, step = self._checked
            found = earlier_checkpoint(failed, step, lambda c: self._earlier_differences(loaded, c, required=True,
                                                                                         run_of=saved),
                                       step_of=lambda c: _step_of(loaded, c), required=list(loaded.state),
                                       pattern=pattern)
            previous, rejected, none_passes = (None, {}, f": {found[2]}") if found[0] is None else (
                found[0], found[2], "")
        if previous is None:
            raise FingerprintMismatch(str(failed), [*why, f"on_fingerprint_mismatch='previous'{none_passes}"]
                                      ) from error
        if self.fingerprint.events:
            self.fingerprint.events[-1]["fallback"] = str(previous)
        fails = "cannot be read" if isinstance(error, _Unreadable) else "fails its numeric fingerprint"
        rank_zero_warn(f"{type(self).__name__}: {failed} {fails} ({'; '.join(why[:3])}); loaded"
                       f" {previous} instead" + "".join(f"; {p} failed too ({d[0]})" for p, d in rejected.items())
                       + " (on_fingerprint_mismatch='previous').")
        return previous

    def _directory_differences(self, loaded: _Loaded, directory: Path) -> tuple[dict[str, Any], list[str]]:
        """A sharded checkpoint's ``meta.pt`` and what it shows before its shards are loaded: every entry of the state
        that is not a model or an optimizer present, DCP's index of the shards present, a fingerprint whose plugin
        checksums and manifest pass; ``({}, [why])`` when it cannot be read."""
        try:
            meta = read_sharded_meta(directory)
        except Exception as error:  # unreadable: not a candidate  # noqa: BLE001
            return {}, [f"unreadable ({type(error).__name__}: {str(error)[:120]})"]
        entries = [k for k, v in loaded.state.items() if not isinstance(_unwrapped(v), (nn.Module, Optimizer))]
        if missing := [k for k in entries if k not in meta]:
            return meta, [f"holds no {', '.join(missing)} (saved without them)"]
        if not (directory / SHARD_INDEX).is_file():
            return meta, [f"holds no {SHARD_INDEX} (torch.distributed.checkpoint's index of the shards)"]
        return meta, self.fingerprint.candidate_differences(meta.get(loaded.key), lambda plugin: {"plugin": plugin},
                                                            self.stepper.manifest, call=loaded.key)

    @property
    def ladder_events(self) -> list[dict[str, Any]]:
        """The remedy ladder's decisions in this loop (shared with ``StepTriage``): one per bad step it decided
        (``step``, ``fault``, ``rung``, ``action``, ``reason``, ``remaining``; a restore adds ``checkpoint``,
        ``failed``, ``restored_step``)."""
        return ladder_of(self.stepper).events

    def _arm(self) -> Ladder:
        """The ladder (the stepper's, which ``StepTriage`` shares) with the restore rung on and the last load known;
        again after a face that started the ladder anew (``StepTriage``'s construction)."""
        loaded, ladder = self._loaded, ladder_of(self.stepper)
        assert loaded is not None  # callers check
        face = f"{type(self).__name__}.load(restored_window={loaded.window})"
        ladder.switch_on(Rung.RESTORE, face)
        ladder.claim("restored_window", loaded.window, face)
        if ladder.load != loaded.load:
            ladder.loaded(**loaded.load)
        return ladder

    def _watch_restored(self, overflowed: bool) -> None:
        """A rejected step after :meth:`load`: within the window, classified as the Trainer's faces classify (flags
        agreed across ranks: host reads on rejected steps only); a ``"restored"`` fault goes to the restore rung."""
        ladder, step = self._arm(), self.stepper.step_count - 1
        window, load = ladder.cooldowns.restored_window, ladder.load
        if load is None or not 0 <= step - load["step"] < window:
            return
        module, stepper = self._module(), self.stepper
        flags = needs_triage(stepper, overflowed)
        state_bad = (flags[0] or flags[3]) and not state_finite(module, list(self._bound))
        device = next(module.parameters()).device
        agreed = any_rank([*flags, state_bad, stepper.last_step_spiked], device)
        fault, _ = classify(nonfinite_loss=agreed[0], nonfinite_input=agreed[1], unscaled_overflow=agreed[2],
                            late=agreed[3], spike=agreed[4], state_bad=agreed[5], spiked=agreed[6])
        if not ladder.restored(step, fault):
            return  # the batch's fault, or the scaler's: the rungs below act as without a load
        face = f"{type(self).__name__}.load"
        if ladder.decide(step, "restored", REASONS["restored"], by=face, replayable=False) is Rung.RESTORE:
            self._restore_previous(ladder, step)

    def _restore_previous(self, ladder: Ladder, step: int) -> None:
        """The restore rung: the earlier passing checkpoint loaded into the state of :meth:`load`; the stop rung
        (``RuntimeError``) when the attempts are spent or none passes."""
        loaded = self._loaded
        assert loaded is not None and ladder.load is not None  # _watch_restored checks
        path, loaded_step = ladder.load["path"], ladder.load["step"]
        where = (f"{type(self).__name__} at step {step}: a non-finite step or a spike {step - loaded_step + 1} steps"
                 f" after loading {path}")
        if loaded.restores >= loaded.max_restores:
            why = (f"{loaded.restores} restores done (max_restores={loaded.max_restores}); the last state loaded,"
                   f" from {path}, went bad again")
        else:
            if Path(path).is_dir():
                previous, rejected = self._restore_directory(loaded, Path(path), loaded_step)
            else:
                previous, _, rejected = earlier_checkpoint(path, loaded_step,
                                                           lambda c: self._earlier_differences(loaded, c),
                                                           step_of=lambda c: _step_of(loaded, c),
                                                           required=list(loaded.state),
                                                           pattern=f"*{Path(path).suffix}")
                if previous is not None:
                    self._fabric_load(loaded, previous)
            if previous is not None:
                loaded.restores += 1
                resumed = self.stepper.step_count
                skipped = [f"{p} ({d[0]})" for p, d in rejected.items()] if isinstance(rejected, dict) else []
                ladder.done(step, checkpoint=str(previous), failed=path, restored_step=resumed, skipped=skipped)
                ladder.rewind(resumed)
                loaded.load = {"step": resumed, "path": str(previous)}
                ladder.loaded(**loaded.load)
                rank_zero_warn(f"{where}: the restored state is suspect; loaded {previous} instead (step {resumed};"
                               f" attempt {loaded.restores} of max_restores={loaded.max_restores})"
                               + "".join(f"; skipped {s}" for s in skipped) + ".")
                return
            why = f"{path} was loaded at step {loaded_step}; {rejected}"
        ladder.give_up(step, why)
        raise RuntimeError(f"{where}, and no earlier checkpoint to load: {why}. The run stops; resume from an"
                           " earlier checkpoint, or check how the loaded one was written.")

    def _restore_directory(self, loaded: _Loaded, failed: Path, loaded_step: int
                           ) -> tuple[Path, dict[str, list[str]]] | tuple[None, str]:
        """The restore rung's search among sharded checkpoints: the newest directory of ``failed``'s parent written
        before it whose ``meta.pt`` holds a step count below ``loaded_step`` and passes
        :meth:`_directory_differences`, loaded into the state, then its checksums compared; one that fails gives way
        to the next. ``(its path, {rejected: differences})``, else ``(None, why)``."""
        tried = earlier_sharded_checkpoints(failed)
        rejected: dict[str, list[str]] = {}
        for candidate in tried:
            meta, differences = self._directory_differences(loaded, candidate)
            step = _step_of(loaded, meta)
            if not differences and not 0 <= step < loaded_step:
                differences = [f"written at step {step}, not before the loaded checkpoint's {loaded_step}"]
            if not differences:
                try:
                    self._fabric_load(loaded, candidate, earlier=True)
                except FingerprintMismatch as error:  # its plugin state as it loads ("raise"/"previous"), or unreadable
                    differences = list(error.differences)
                else:
                    differences = self._loaded_differences()
            if not differences:
                return candidate, rejected
            rejected[str(candidate)] = differences
        reasons = "; ".join(d[0] for d in rejected.values())
        return None, (f"no earlier checkpoint passes among {len(tried)} in {failed.parent}"
                      + (f" ({reasons})" if reasons else ""))

    def _loaded_differences(self) -> list[str]:
        """The loaded model's and set-up optimizers' checksums against the fingerprint the plugin's state was loaded
        with; no reaction."""
        fingerprint = self.fingerprint.pending
        if fingerprint is None:
            return []
        trees = {"model": self._module().state_dict(),
                 **self._optimizer_trees(fingerprint, [o.state_dict() for o in self._bound])}
        return self._checksum_differences(fingerprint, trees)[0]

    def _checksum_differences(self, fingerprint: dict[str, Any], trees: Mapping[str, object]
                              ) -> tuple[list[str], list[str]]:
        """``(differences, notes)``: ``trees``' plain tensors and this rank's shards (every rank's differences
        gathered) against the fingerprint's checksums; none where the checkpoint was written in another precision or
        weight mode (the weights were carried across: not comparable)."""
        saved = fingerprint["manifest"]
        if (saved["precision"], saved["master_weights"]) != (self.stepper.precision, self.stepper.master_mode):
            trees = {}
        differences = compare_checksums(fingerprint["checksums"], trees)
        sharded, notes = compare_shard_checksums(fingerprint["checksums"], trees)
        return differences + sharded, notes

    def _earlier_differences(self, loaded: _Loaded, checkpoint: dict[str, Any], *, required: bool = False,
                             run_of: dict[str, Any] | None = None) -> list[str]:
        """A candidate checkpoint's numbers against its fingerprint (checksums, manifest); none: it passes. With
        ``required`` it must hold every key of the state and a fingerprint; ``run_of``: the failed file's fingerprint,
        whose pinned micro-batch a candidate of the same run has too."""
        if required and (missing := [key for key in loaded.state if key not in checkpoint]):
            return [f"holds no {', '.join(missing)} (a weights-only checkpoint)"]
        keys = {id(_unwrapped(value)): key for key, value in loaded.state.items()}
        model = keys.get(id(self.layout.module))
        plugin_state = checkpoint.get(loaded.key)
        saved = plugin_state.get(FINGERPRINT) if isinstance(plugin_state, dict) else None
        optimizers = [checkpoint.get(keys.get(id(o), ""), {}) for o in self._bound]
        return self.fingerprint.candidate_differences(
            plugin_state, lambda plugin: {
                "model": checkpoint.get(model, {}) if model is not None else {},
                **self._optimizer_trees(saved if isinstance(saved, dict) else None, optimizers), "plugin": plugin},
            self.stepper.manifest, call=loaded.key, required=required, run_of=run_of)

    # What a resume without the plugin's state loses, by master_weights mode.
    _LOST: ClassVar[dict[str, str]] = {
        "fp32": "the FP32 master weights restart from the 16-bit weights (the bits below 16-bit resolution they had"
                " gathered are lost)",
        "kahan": "the Kahan compensation buffers (the low bits of every weight) restart at 0",
        "stochastic": "the stochastic-rounding random stream restarts from a new seed",
    }

    # What a resume without the plugin's state loses, by the FP8 state it holds (FP8Linear.fp8_state_dict's keys).
    _LOST_FP8: ClassVar[dict[str, str]] = {
        "amax_history": "the FP8 layers' amax histories and scales (delayed scaling) restart from none, so the first"
                        " steps scale by other amaxes",
        "sr_counter": "the FP8 layers' stochastic-rounding step counters restart at 0, so the first steps' rounding"
                      " noise repeats",
    }

    def _check_resume(self, optimizer: Optimizer) -> None:
        """Warn when ``optimizer`` meets its first step with state (loaded from a checkpoint) while the plugin's own
        state was never loaded: a resume that left the plugin out of ``fabric.load``, as litgpt's state dict does.
        With BF16/FP8 moments the optimizer's saved state holds none, only their mark in its param groups."""
        moments = pop_saved_mark(optimizer)
        if self._state_loaded or not (optimizer.state or moments):
            return
        fp8_state = {key.rpartition(".")[2] for key in self.layout.state_dict()["fp8"]}
        lost = "; ".join(text for text in (
            self._LOST.get(self.stepper.master_mode or ""),
            moments and f"the {moments!r} Adam moments (exp_avg, exp_avg_sq), which the plugin's state keeps and the"
                        " optimizer's does not, restart at 0",
            *(text for key, text in self._LOST_FP8.items() if key in fp8_state),
        ) if text)
        if not lost:
            return
        self._warn_once(
            "resume-without-plugin",
            f"{self!r}: {type(optimizer).__name__} starts with loaded state, but the plugin's own state was not"
            f" loaded: {lost}, so the run does not resume exactly. Save and load the plugin with the rest:"
            " fabric.save(path, {..., 'precision': plugin}) and fabric.load(path, {..., 'precision': plugin})"
            " (litgpt's own state dict leaves it out: add it there).",
        )


class _Unreadable(FingerprintMismatch):
    """An earlier sharded checkpoint whose shards could not be read (on some rank): a fallback passes over it as over
    one that fails its fingerprint."""


def _read_errors(error: BaseException, rank: int) -> list[str]:
    """What a failed load says, by rank: DCP's ``CheckpointException`` holds each failing rank's error; any other is
    this rank's."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException) and error.failures:
        return [f"rank {r}: {_error_line(e[0])}" for r, e in sorted(error.failures.items())]
    return [f"rank {rank}: {_error_line(error)}"]


def _error_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return type(error).__name__ + (f": {text[0][:120]}" if text else "")


@dataclasses.dataclass
class _Loaded:
    """What :meth:`StablePrecision.load` loaded and how its restored-state rung is set: the Fabric and the user's
    ``state`` dict (the objects a restore loads into, the plugin under ``key``), ``fabric.load``'s arguments, the
    window and the cap, the attempts made, and the last load (``step``, ``path``)."""

    fabric: Any
    state: dict[str, Any]
    key: str
    strict: bool
    weights_only: bool | None
    window: int
    max_restores: int
    restores: int = 0
    load: dict[str, Any] = dataclasses.field(default_factory=dict)


def _step_of(loaded: _Loaded, checkpoint: Mapping[str, Any]) -> int:
    """The optimizer steps a checkpoint of :meth:`StablePrecision.load`'s kind holds: its plugin state's
    ``step_count``."""
    step = dict(checkpoint.get(loaded.key) or {}).get("step_count")
    return step if isinstance(step, int) and not isinstance(step, bool) else -1


def _unwrapped(value: Any) -> Any:
    """The module or optimizer behind Fabric's wrapper (what the plugin set up)."""
    if isinstance(value, _FabricModule):
        return value.module
    return value.optimizer if isinstance(value, _FabricOptimizer) else value


def _flat_states(optimizer: Optimizer, state: StateDict) -> StateDict | None:
    return flat_optimizer_state(state)


def _rebuilt_states(optimizer: Optimizer, state: StateDict) -> StateDict | None:
    return rebuilt_optimizer_state(state)


def _optimizers_given_to_setup(frame: FrameType | None) -> list[Optimizer]:
    """The optimizers ``fabric.setup(model, *optimizers)`` was given, read from its frame (``frame``: the caller of
    ``convert_module``; empty where that is not ``Fabric.setup``). Fabric shows a precision plugin no optimizer before
    its first clip or step: this way an optimizer the precision refuses (``'16-true'`` without masters: an ``eps``
    FP16 cannot hold) is refused at ``fabric.setup``, not after the first forward and backward."""
    if frame is None or frame.f_code.co_name != "setup" or frame.f_globals.get("__name__") != "lightning.fabric.fabric":
        return []
    given = frame.f_locals.get("optimizers", ())
    return [o.optimizer if isinstance(o, _FabricOptimizer) else o for o in given if isinstance(o, Optimizer)]


_BUDGET_CALL = (
    "FP8Config(keep_high_precision=HighPrecisionBudget(by='probe')) under Fabric: the plugin sees no loss, so call"
    " plugin.choose_high_precision_(loss_fn, batch) once at the first step, before its forward (loss_fn: (module,"
    " batch) -> loss on the module given); until then every selected layer runs in the low format, and the first"
    " optimizer step without it raises.")

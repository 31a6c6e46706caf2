"""The Trainer adapter: Lightning's precision-plugin hooks mapped onto the PrecisionStepper, and ``StablePrecision``,
the Trainer's precision plugin.

Written once for both Trainer packages: ``lit_mpstable.StablePrecision`` mixes it into
``lightning.pytorch``'s ``Precision``, ``lit_mpstable.pytorch_lightning.StablePrecision`` into
``pytorch_lightning``'s; ``_pl`` names the package whose classes (LightningModule, strategies) it checks against.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, _GeneratorContextManager, contextmanager
from functools import partial
from types import ModuleType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import nn
from torch.optim import LBFGS, Optimizer

from lit_mpstable.core.checkpoints import flatten_optimizer_states_, unflatten_optimizer_states_
from lit_mpstable.core.fingerprint import KEY as FINGERPRINT
from lit_mpstable.core.fingerprint import CheckpointCheck, checkpoint_trees, pinned_pass
from lit_mpstable.core.guards.ladder import ladder_of
from lit_mpstable.frontends.common import ARGS_DOC, StableFrontEnd
from lit_mpstable.frontends.live_state import recast_from
from lit_mpstable.frontends.strategies import check_strategy, lightning_module, shards_with_fsdp2


class TrainerPrecision(StableFrontEnd):
    """Hooks of a Trainer precision plugin; the numerics live in ``self.stepper``."""

    _pl: ModuleType  # the Trainer package (set by the concrete class)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """The FP8 swap, FP32 islands and (``*-true``) 16-bit cast, in place. With ModelParallelStrategy (FSDP2) call
        it yourself at the top of ``configure_model``, before ``fully_shard`` (FP8 layers must exist before sharding);
        the strategy's own call after ``configure_model`` then only checks the units' policies (``mp_policy``)."""
        # The first hook every strategy's setup calls: refuse before converting.
        if warning := check_strategy(self, module, self._pl):
            self._warn_once("strategy", warning)
        self.stepper.setup_module(module, fsdp2=shards_with_fsdp2(module, self._pl))
        self.stepper.layout.find_ddp = self._ddp_wrapper  # a bound method: the plugin still pickles (ddp_spawn)
        return module

    def _ddp_wrapper(self) -> nn.parallel.DistributedDataParallel | None:
        """The strategy's DDP wrapper of the model (a ``*-true`` fallback rebuilds its reducer), else ``None``."""
        trainer = getattr(self.stepper.layout.module, "_trainer", None)
        wrapper = getattr(getattr(trainer, "strategy", None), "model", None)
        return wrapper if isinstance(wrapper, nn.parallel.DistributedDataParallel) else None

    def convert_input(self, data: Any) -> Any:
        if self.fingerprint.pinning and getattr(trainer := self._trainer(), "training", False):
            # The first training batch, as loaded: the fingerprint's pinned micro-batch. On several ranks rank 0's
            # rows on every rank, one broadcast at the first training batch (each rank's own rows would make an FSDP2
            # save's gradient norm span other rows than the load recomputes); in one process until a batch pins.
            # After a load the checkpoint's rows stay, retyped as this batch (its namedtuples): no broadcast.
            if getattr(trainer, "world_size", 1) < 2 or self.fingerprint.batch is not None:
                self.fingerprint.pin(data)
            elif not self.fingerprint.shared:
                self.fingerprint.pin(data, rank_zero=True)
        data = self.stepper.convert_input(data)
        if self.stepper.fp8_budget.pending:
            self._budget_batch = data  # the probe's budget measures the first training batch (before its step)
        return data

    def tensor_init_context(self) -> AbstractContextManager:
        return self.stepper.tensor_init_context()

    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        module = lightning_module(model, self._pl)
        self._fingerprint_saves(getattr(module, "_trainer", None))
        if self._fitting():  # before a resume's state loads: a plugin reused for another fit pins that fit's rows
            self.fingerprint.start_run()
        self._check_finetuning(module)
        self.stepper.setup_optimizers(module, optimizers, [config.scheduler for config in lr_schedulers])
        # The strategy has wrapped the model (DDP broadcast the first rank's weights): the masters, compensation and
        # rounding seeds follow them on every rank before the first step.
        ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None
        self.stepper.follow_model_weights_(ddp.process_group if ddp is not None else None)
        if self.stepper.fp8_budget.pending and not getattr(module, "automatic_optimization", True):
            self._warn_once("budget-manual", _BUDGET_MANUAL)
        self._warn_fp16_cpu()
        self._show_notes()
        return model, optimizers, lr_schedulers

    def _check_finetuning(self, module: Any) -> None:
        """Refuse Lightning's ``BaseFinetuning`` callbacks (``BackboneFinetuning``) with FP32 masters: they map the
        optimizer's parameters to the model's by identity (at every epoch start, and on resume they put the model's
        parameters back into the optimizer), and the masters stand in the optimizer for the model's parameters."""
        callbacks = getattr(getattr(module, "_trainer", None), "callbacks", None) or []
        finetuning = [c for c in callbacks if isinstance(c, self._pl.callbacks.BaseFinetuning)]
        if finetuning and self.stepper.master_mode == "fp32":
            raise ValueError(
                f"StablePrecision({self.precision!r}, master_weights=True) with {type(finetuning[0]).__name__} (a"
                " BaseFinetuning): it looks the optimizer's parameters up among the model's, and FP32 masters replace"
                " them in the optimizer. Use master_weights='kahan' or 'stochastic' (the optimizer keeps the model's"
                f" parameters), or {self.precision.replace('-true', '-mixed')!r} (FP32 weights).")

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        if not isinstance(module, self._pl.LightningModule):  # Fabric takes any Precision, this one included
            raise TypeError(f"{self!r}: this is the Trainer plugin, and this backward came from outside a"
                            f" {self._pl.__name__}.Trainer (module={type(module).__name__}); under Lightning Fabric"
                            " use `from lit_mpstable.fabric import StablePrecision`.")
        return super().pre_backward(self.stepper.scale_loss(tensor), module)  # type: ignore[misc]

    def optimizer_step(
        self, optimizer: Optimizer, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.stepper.fp8_budget.pending:
            self._choose_budget(lightning_module(model, self._pl))
        if isinstance(optimizer, LBFGS):
            return self._lbfgs_step(optimizer, model, closure, **kwargs)
        closure_result = closure()
        stepper = self.stepper
        if closure_result is None and model.automatic_optimization and not stepper.steps_without_backward(optimizer):
            stepper.drop_batch_(optimizer)  # training_step returned None: no backward ran, nothing to step
            return closure_result
        if stepper.skip_requested:  # a callback discarded this batch before backward
            return stepper.discard_(optimizer)
        # Order matters: unscale before on_before_optimizer_step and clipping, so both see true gradient values and
        # the clip threshold means what the user wrote (fused optimizers too: after unscale_ GradScaler hands them
        # found_inf and no grad_scale). With FP32 masters the hooks see them on the 16-bit parameters; whatever a
        # hook changes there goes back into the masters before the step.
        stepper.unscale_(optimizer)
        self._after_closure(model, optimizer)  # type: ignore[attr-defined]
        output = stepper.step(optimizer, **kwargs)
        self._show_notes()
        return output

    def train_step_context(self) -> _GeneratorContextManager[None]:
        """Every ``training_step`` call (each micro-batch): the probe's budget first, before the first one's forward.
        With gradient accumulation the first micro-batches run outside ``optimizer_step``: choosing there measured
        the last micro-batch, after the earlier ones had run the chosen layers in the low format. Then the forward
        context itself (Lightning enters what this returns at once)."""
        if self.stepper.fp8_budget.pending and (module := self.stepper.layout.module) is not None:
            module = lightning_module(module, self._pl)
            if getattr(module, "automatic_optimization", True):  # manual: the user's call (optimizer_step checks)
                self._choose_budget(module)
        if self.precision_schedule.milestones and (module := self.stepper.layout.module) is not None:
            trainer = lightning_module(module, self._pl).trainer
            batches, total = trainer.num_training_batches, trainer.max_steps
            total = total if total > 0 else trainer.estimated_stepping_batches
            per_epoch = max(1, int(batches) // trainer.accumulate_grad_batches) if batches < float("inf") else None
            self._schedule_step_(trainer.lr_scheduler_configs, int(total) if total < float("inf") else None, per_epoch)
        return self.forward_context()

    def _choose_budget(self, module: Any) -> None:
        """The probe's budget at the first training batch, before its forward (:meth:`train_step_context`; else the
        first optimizer step): the batch ``convert_input`` saw, moved by the strategy, and ``training_step``'s loss
        on it (``self.log`` muted)."""
        batch, self._budget_batch = getattr(self, "_budget_batch", None), None
        if not module.automatic_optimization:
            raise RuntimeError(_BUDGET_MANUAL)
        if batch is None:
            raise RuntimeError(f"{type(self).__name__}: HighPrecisionBudget(by='probe') found no training batch to"
                               " measure (convert_input was not called); call plugin.choose_high_precision_(loss_fn,"
                               " batch) in training_step at the first step.")
        trainer = module.trainer
        batch = trainer.strategy.batch_to_device(batch)
        self.choose_high_precision_(_training_step_loss, batch)

    def _lbfgs_step(self, optimizer: Optimizer, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        self._check_closure_step(optimizer)
        output = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)  # type: ignore[misc]
        self.stepper.count_unchecked_step()
        return output

    @contextmanager
    def full_precision(self) -> Generator[None, None, None]:
        """Inside the block the whole model computes in FP32 (FP8 layers off, no autocast, ``*-true`` parameters
        widened); after it exactly the fallbacks in force before are back. For replaying a step at full precision
        (``FaultTriage``): logs nothing and counts nothing, unlike :meth:`fallback`.

        Raises:
            RuntimeError: under FSDP2 where the precision was fixed at ``fully_shard`` (see :attr:`can_fallback`).
        """
        with self.stepper.full_precision():
            yield

    def replay_backward(self, loss: torch.Tensor, module: Any) -> torch.Tensor:
        """The backward of a replayed step (``FaultTriage``): the loss scaled as :meth:`pre_backward` scales it, and
        the LightningModule's own ``on_before_backward``, ``backward`` and ``on_after_backward`` (part of the user's
        step). The callbacks' backward hooks are not called: a replay must not count twice in their statistics.
        Returns the scaled loss."""
        module.on_before_backward(loss)
        scaled = self.stepper.scale_loss(loss)
        module.backward(scaled)
        module.on_after_backward()
        return scaled

    # LightningModule.clip_gradients passes the LightningOptimizer wrapper; the step gets the optimizer itself.
    def main_params(self, optimizer: Optimizer) -> Any:
        return self.stepper.main_params(self._unwrap(optimizer))

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        self.stepper.clip_grad_norm_(self._unwrap(optimizer), clip_val)

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: float) -> None:
        self.stepper.clip_grad_value_(self._unwrap(optimizer), clip_val)

    def _unwrap(self, optimizer: Any) -> Optimizer:
        return optimizer.optimizer if isinstance(optimizer, self._pl.core.optimizer.LightningOptimizer) else optimizer

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning loads checkpoints with a callable map_location, which torch.load refuses for tensor subclasses:
        # torchao's 8-bit/4-bit/FP8 optimizer states go in flat (plain tensors) and are rebuilt on load.
        flatten_optimizer_states_(checkpoint.get("optimizer_states", []))

    def _fingerprint_(self, checkpoint: dict[str, Any]) -> None:
        """The numeric fingerprint of ``checkpoint`` as it goes to the file (:class:`_FingerprintedDump`)."""
        if type(self).__qualname__ in checkpoint:
            checkpoint[type(self).__qualname__][FINGERPRINT] = self.fingerprint.capture(
                checkpoint_trees(checkpoint, type(self).__qualname__), self.stepper.manifest(), self._pinned_pass())

    def _fingerprint_saves(self, trainer: Any | None) -> None:
        """Have ``trainer``'s checkpoints fingerprinted once every ``on_save_checkpoint`` hook edited them (once a
        Trainer)."""
        connector = getattr(trainer, "_checkpoint_connector", None)
        if connector is not None and not isinstance(connector.__dict__.get("dump_checkpoint"), _FingerprintedDump):
            connector.dump_checkpoint = _FingerprintedDump(connector, self)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Runs before load_state_dict. A checkpoint of Lightning's own "16-mixed" keeps GradScaler state under
        # "MixedPrecision": carry it over. (A checkpoint without FP32 masters needs nothing: its weights were loaded
        # into the FP32 model before setup, and the masters start from them.) Runs before the optimizers are restored.
        self._preload_schedule_(checkpoint.get(type(self).__qualname__))  # layers switched as the checkpoint's were
        trainer = self._trainer()
        self._checkpoint_check().verify_(checkpoint, getattr(trainer, "ckpt_path", None),  # may swap it
                                         self._loaded_in_place(trainer, checkpoint))
        unflatten_optimizer_states_(checkpoint.get("optimizer_states", []))
        self._loaded_weights = checkpoint.get("state_dict")
        if type(self).__qualname__ not in checkpoint and "MixedPrecision" in checkpoint and self.scaler is not None:
            self.scaler.load_state_dict(checkpoint["MixedPrecision"])
            rank_zero_info("StablePrecision: loss-scaler state taken from a Lightning MixedPrecision checkpoint.")

    def _loaded_in_place(self, trainer: Any, checkpoint: dict[str, Any]) -> dict[str, object] | None:
        """What FSDP2's sharded load (ModelParallelStrategy) wrote into the model and the optimizers in place, as the
        save's trees: the checkpoint dict it returns holds neither (collective: every rank checks)."""
        module = self.stepper.layout.module
        if trainer is None or module is None or "state_dict" in checkpoint or not shards_with_fsdp2(module, self._pl):
            return None
        strategy = trainer.strategy
        return {"state_dict": strategy.lightning_module_state_dict(),
                "optimizer_states": [strategy.optimizer_state(optimizer) for optimizer in trainer.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning loaded the model's weights before this, into parameters of the configured dtype: those a fallback
        # re-applied here recasts are taken again from the checkpoint (recast_from).
        weights, self._loaded_weights = getattr(self, "_loaded_weights", None), None
        with recast_from(self.stepper.layout.module, weights):
            super().load_state_dict(state_dict)
        if not self._fitting():
            # validate/test/predict run on the checkpoint's 16-bit weights: its masters (or compensation), waiting for
            # optimizers no evaluation binds, must not reach a later fit of another model on this Trainer.
            self.stepper.forget_pending_weights_()

    def _fitting(self) -> bool:
        """Whether the Trainer runs ``fit`` (or none is attached: a direct call)."""
        state = getattr(self._trainer(), "state", None)
        return getattr(getattr(state, "fn", None), "value", "fit") == "fit"

    # ------------------------------------------------------------------------------------- the fingerprint
    def _check_fingerprint(self, fingerprint: dict[str, Any] | None, state: dict[str, Any], *, loaded: bool) -> None:
        # Checksums and manifest were checked in on_load_checkpoint; the pinned pass once the plugin's state is in. Not
        # under manual optimization (no pass to recompute), nor in validate/test/predict: the pass measures a training
        # step, which evaluation never runs (its training_step may read self.optimizers(), which it has not).
        if not loaded:
            return
        loss = self._pinned_pass() if self._fitting() else None
        if loss is None:
            self.fingerprint.pending = None  # checksums and manifest only
            return
        pending = self.fingerprint.pending
        with self._step_and_epoch_of(pending["checkpoint"] if pending is not None else {}):
            self._checkpoint_check().verify_pinned_(loss, self.load_state_dict)

    @contextmanager
    def _step_and_epoch_of(self, checkpoint: dict[str, Any]) -> Generator[None, None, None]:
        """Within the block the Trainer's ``global_step`` and ``current_epoch`` are ``checkpoint``'s, as at its save (a
        ``training_step`` may weigh its loss by them); afterwards the fit loop's counters are what they were. Lightning
        restores the plugin's state before the loops (at a resume, from step 0; in ``ScaleCheckpoint``'s restored-state
        rung, mid-fit, which takes only some counters from the file afterwards), so the load's pinned pass would run
        at another step than the save's."""
        trainer = self._trainer()
        saved = ((checkpoint.get("loops") or {}).get("fit_loop") or {}) if trainer is not None else {}
        counters = {} if not saved else {
            "epoch_progress": trainer.fit_loop.epoch_progress,
            "epoch_loop.automatic_optimization.optim_progress":
                trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress}
        live = {key: counter.state_dict() for key, counter in counters.items() if key in saved}
        for key in live:
            counters[key].load_state_dict(saved[key])
        try:
            yield
        finally:
            for key, state in live.items():
                counters[key].load_state_dict(state)

    def _pinned_pass(self) -> Callable[[Any], torch.Tensor] | None:
        """The pinned micro-batch's measurement: ``training_step``'s loss, or ``None`` under manual optimization,
        whose ``training_step`` runs its own backward and optimizer steps (not a measurement the plugin may repeat):
        its checkpoints carry checksums and the manifest only."""
        module = self.stepper.layout.module
        if module is not None and not getattr(lightning_module(module, self._pl), "automatic_optimization", True):
            return None
        return self._pinned_loss

    def _pinned_loss(self, batch: Any) -> torch.Tensor:
        module = self.stepper.layout.module
        if module is None:
            raise RuntimeError(f"{self!r}: the pinned micro-batch needs the model; no model was set up.")
        module = lightning_module(module, self._pl)
        dtype = self.stepper.compute_dtype if self.stepper.true_16bit else None  # as convert_input casts a batch
        return pinned_pass(module, _training_step_loss, batch, forward_context=self.forward_context,
                           dtype=dtype)

    @property
    def ladder_events(self) -> list[dict[str, Any]]:
        """The remedy ladder's decisions in this run, one per bad step a face decided (``step``, ``fault``, ``rung``,
        ``action``, ``reason``, ``remaining``, ``by``; after a replay ``verdict``, ``replays``): the events of the
        ladder the faces share, kept on this plugin; empty with no face."""
        return ladder_of(self).events

    def _trainer(self) -> Any:
        return getattr(self.stepper.layout.module, "_trainer", None)

    def _checkpoint_check(self) -> CheckpointCheck:
        def reload(checkpoint: dict[str, Any]) -> None:  # "previous": what Lightning restored from the failed one
            trainer = self._trainer()
            trainer.strategy.load_model_state_dict(checkpoint, strict=trainer.lightning_module.strict_loading)
            trainer._checkpoint_connector.restore_callbacks()
            unflatten_optimizer_states_(checkpoint.get("optimizer_states", []))
            self._loaded_weights = checkpoint.get("state_dict")

        return CheckpointCheck(self.fingerprint, type(self).__qualname__, self.stepper.manifest, reload,
                               self.manifest_as_of)


class _FingerprintedDump:
    """A Trainer's ``dump_checkpoint`` that adds the plugin's numeric fingerprint to the dict it returns. Lightning
    calls the plugin's ``on_save_checkpoint`` first, then the callbacks' and the LightningModule's, which may rewrite
    the dict (``EMAWeightAveraging`` puts the averaged weights in ``state_dict``; a fine-tuning module leaves its
    frozen layers out): the checksums must describe the tensors the file gets. Every strategy writes (or shards) the
    dict this returns, on every rank; a ``CheckpointIO`` is called on rank zero only and not by the sharded
    strategies. A class, not a closure: the Trainer pickles (``ddp_spawn``)."""

    def __init__(self, connector: Any, plugin: TrainerPrecision) -> None:
        self.connector, self.plugin = connector, plugin

    def __call__(self, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = type(self.connector).dump_checkpoint(self.connector, weights_only)
        self.plugin._fingerprint_(checkpoint)
        return checkpoint


def _training_step_loss(net: Any, data: Any) -> torch.Tensor:
    """``training_step``'s loss on ``data`` (its ``self.log`` calls held and dropped: a measurement is not a step)."""
    with held_logs(net):
        output = net.training_step(*training_step_args(net, data, 0))
    return output["loss"] if isinstance(output, dict) else output


def training_step_args(module: Any, batch: Any, batch_idx: int) -> tuple[Any, ...]:
    """The arguments Lightning's training loop gives ``module.training_step``: ``(batch, batch_idx)``, or ``(batch,)``
    where its signature has no second parameter (``def training_step(self, batch)``, which Lightning accepts)."""
    with_idx = is_param_in_hook_signature(module.training_step, "batch_idx", min_args=2)
    return (batch, batch_idx) if with_idx else (batch,)


@contextmanager
def held_logs(module: Any) -> Generator[list[Callable[[], None]], None, None]:
    """A LightningModule's ``log`` and ``log_dict`` held within the block: each call is kept, as a callable that makes
    it, instead of logged. A pass that is no step of the run (the pinned micro-batch's measurement, a FaultTriage
    replay) must not log: Lightning would file its values under the hook it runs in, as a second result of the same
    name beside the step's, and count them in the epoch aggregates. A replay applied in its step's place makes the
    calls it held."""
    held: list[Callable[[], None]] = []
    log, log_dict = module.log, module.log_dict
    module.log = lambda *args, **kwargs: held.append(partial(log, *args, **kwargs))
    module.log_dict = lambda *args, **kwargs: held.append(partial(log_dict, *args, **kwargs))
    try:
        yield held
    finally:
        del module.log, module.log_dict


_BUDGET_MANUAL = (
    "StablePrecision: FP8Config(keep_high_precision=HighPrecisionBudget(by='probe')) with manual optimization: the"
    " plugin cannot compute a loss itself (training_step steps the optimizers), so call"
    " self.trainer.precision_plugin.choose_high_precision_(loss_fn, batch) at the top of the first training_step,"
    " before the forward (loss_fn: (module, batch) -> loss); until then every selected layer runs in the low format,"
    " and the first optimizer step without the choice raises.")


# TrainerPrecision's optimizer_step takes the optimizer and model Lightning's Precision calls it with, narrower than
# Precision's signature (Optimizable, a LightningModule): a deliberate mismatch of the two bases.
class StablePrecision(TrainerPrecision, Precision):  # type: ignore[misc]
    __doc__ = (
        """Mixed precision that is stable by default: loss scaling done right, FP32 masters or compact weights, FP32
    islands, FP8 and FP4 recipes and live telemetry. ``Trainer(plugins=[StablePrecision(...)])``, instead of
    ``precision=``. With ``HighPrecisionBudget(by="probe")`` the plugin measures the first training batch itself
    (two extra passes of ``training_step``, once).
""" + ARGS_DOC)

    _pl = pl

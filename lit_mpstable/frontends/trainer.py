"""The Trainer adapter: Lightning's precision-plugin hooks mapped onto the PrecisionStepper.

Written once for both Trainer packages: ``lit_mpstable.StablePrecision`` mixes it into
``lightning.pytorch``'s ``Precision``, ``lit_mpstable.pytorch_lightning.StablePrecision`` into
``pytorch_lightning``'s; ``_pl`` names the package whose classes (LightningModule, strategies) it checks against.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from types import ModuleType
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import LBFGS, Optimizer

from lit_mpstable.frontends.common import StableFrontEnd
from lit_mpstable.core.checkpoints import flatten_optimizer_states_, unflatten_optimizer_states_
from lit_mpstable.core.policy import describe
from lit_mpstable.core.stepper import tensor_init_context
from lit_mpstable.frontends.strategies import check_strategy, lightning_module, shards_with_fsdp2

__all__ = ["TrainerPrecision"]


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
        return self.stepper.convert_input(data)

    def tensor_init_context(self) -> AbstractContextManager:
        return tensor_init_context(self.stepper)

    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        module = lightning_module(model, self._pl)
        self.stepper.setup_optimizers(module, optimizers, [config.scheduler for config in lr_schedulers])
        if self.precision == "16-mixed" and self.device == "cpu":
            self._warn_once(
                "fp16-cpu",
                "StablePrecision('16-mixed') on the CPU: FP16 arithmetic is emulated there and runs ~100x slower than"
                " BF16. Running real FP16 autocast with loss scaling, as asked; use 'bf16-mixed' for speed.",
            )
        self._show_notes()
        return model, optimizers, lr_schedulers

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        choices = self.stepper.stats.get("op_policy")
        with self.stepper.forward_context():
            yield
        if self.stepper.stats.get("op_policy") != choices and not self.policy.is_default:
            policy, measured = self.policy, self.policy.measurements
            parts = [describe(f, c, measured[f], policy.margin, policy.step_cost) if f in measured else f"{f}={c}"
                     for f, c in policy.choices.items()]
            rank_zero_info(f"StablePrecision op_policy={self.stepper.op_policy!r} on {self.device}: {', '.join(parts)}.")

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        return super().pre_backward(self.stepper.scale_loss(tensor), module)  # type: ignore[misc]

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if isinstance(optimizer, LBFGS):
            return self._lbfgs_step(optimizer, model, closure, **kwargs)
        closure_result = closure()
        stepper = self.stepper
        if closure_result is None and model.automatic_optimization:
            stepper.drop_grads_(optimizer)  # training_step returned None: no backward ran, nothing to step
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

    def _lbfgs_step(self, optimizer: Optimizer, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if self.scaler is not None or self.master is not None:
            raise ValueError(
                "StablePrecision: LBFGS re-evaluates the loss inside step(), which loss scaling and master weights"
                " cannot follow; use scaler=None with a '*-mixed' or '32-true' precision."
            )
        self._warn_once("lbfgs", "StablePrecision: LBFGS re-evaluates the loss inside step(), so its gradients are"
                        " not checked for inf/NaN (skip_nonfinite does not apply to it).")
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
        layout = self.stepper.layout
        saved = layout.state_dict()
        try:
            while self.stepper.compute_dtype != torch.float32:
                self.stepper.fallback(None)  # one rung at a time: FP8 -> base precision -> FP32
            yield
        finally:
            layout.load_state_dict(saved)

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

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Runs before load_state_dict. A checkpoint of Lightning's own "16-mixed" keeps GradScaler state under
        # "MixedPrecision": carry it over. (A checkpoint without FP32 masters needs nothing: its weights were loaded
        # into the FP32 model before setup, and the masters start from them.) Runs before the optimizers are restored.
        unflatten_optimizer_states_(checkpoint.get("optimizer_states", []))
        if type(self).__qualname__ not in checkpoint and "MixedPrecision" in checkpoint and self.scaler is not None:
            self.scaler.load_state_dict(checkpoint["MixedPrecision"])
            rank_zero_info("StablePrecision: loss-scaler state taken from a Lightning MixedPrecision checkpoint.")

"""AMPPreflight: before training, compares the low-precision forward with FP32 on the first real batch."""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import cached_property
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from lit_mpstable.callbacks._common import PluginCallback, check, is_number, run_ladder, strict_keys, watch_step
from lit_mpstable.callbacks._rules import compare_outputs, default_forward, first_tensor
from lit_mpstable.callbacks.views import PrecisionView
from lit_mpstable.core.guards.ladder import Ladder, Rung
from lit_mpstable.fp8 import convert_from_fp8
from lit_mpstable.fp8.backends import find_fp8_layers
from lit_mpstable.frontends.trainer import held_logs, training_step_args

PreflightAction = Literal["fallback", "warn", "raise"]
# Guessed: unit roundoffs (bf16 2**-9, fp16 2**-12, fp8 e4m3 2**-4) times the few-fold that some layers of rounding
# add up to, with margin over what healthy models show (bf16 0.3-0.5%, fp16 0.06%, fp8 2.5-4.5% measured on TinyMLP,
# bf16 ~1% on the demo Transformer). Relative to the FP32 output's max abs, so the tolerance follows its scale.
DEFAULT_RTOL = {torch.float16: 1e-2, torch.bfloat16: 5e-2}
FP8_RTOL = 0.15


def _has_fp8(module: nn.Module) -> bool:
    return bool(find_fp8_layers(module))  # any backend's FP8 layers (native, torchao, TransformerEngine)


def _fp32_copy(module: pl.LightningModule) -> pl.LightningModule:
    # 16-bit weights and FP8 layers compute in low precision whatever autocast says: a copy can leave both. Every
    # backend's layers go back to nn.Linear (a TE layer would need its autocast; torchao's would still quantise).
    fp32 = copy.deepcopy(module)  # LightningModule.__getstate__ leaves the trainer out
    convert_from_fp8(fp32)
    return fp32.float()


def _defines_forward(module: nn.Module) -> bool:
    """Whether a class of the user's defines ``forward`` (LightningModule's own, in either Trainer package, only
    calls nn.Module's, which raises)."""
    qualname = getattr(type(module).forward, "__qualname__", "")
    return qualname not in ("LightningModule.forward", "_forward_unimplemented")


def _training_step_loss(module: pl.LightningModule, batch: Any) -> Any:
    """The loss ``training_step`` returns on ``batch``, its own ``self.log`` calls muted (a check is not a step)."""
    with held_logs(module):  # the held calls are dropped
        return module.training_step(*training_step_args(module, batch, 0))


def _recast_batch_(batch: Any, old: torch.dtype, new: torch.dtype) -> None:
    """Cast, in place, the ``old``-dtype tensors of a batch Lightning already converted for the training step to the
    compute dtype a fallback just set (the batch cannot be replaced from a callback hook; a FP32 model would meet
    16-bit inputs: "mat1 and mat2 must have the same dtype"). They are the converted copies (``.to`` made them), unless
    the loader already yields tensors of the 16-bit dtype."""
    def recast(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype == old:
            tensor.data = tensor.data.to(new)
        return tensor

    apply_to_collection(batch, torch.Tensor, recast)


def _upcast(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.is_floating_point() else tensor


class AMPPreflight(PluginCallback):
    """Runs the LightningModule's forward on the first training batch in FP32 and in the plugin's low-precision
    forward context, compares the outputs (the first floating tensor) and acts when they disagree.

    - FP32 reference: autocast off for ``*-mixed``; for ``*-true`` or with FP8 layers a deep copy of the module,
      FP8 layers turned back into ``nn.Linear`` and cast to FP32 (costs one FP32 copy of the model, once).
      In ``*-true`` modes the copy's FP32 islands still round their outputs to the 16-bit dtype, as in training.
    - Both forwards run in eval mode under ``no_grad`` with the RNG state forked, so training is unaffected.
    - ``action``: ``"fallback"`` calls ``plugin.fallback(None, reason=...)`` (effective from this batch's forward)
      and checks again, one rung of the plugin's ladder (FP8 -> base precision -> FP32) at a time, until the outputs
      agree; ``"warn"`` warns; ``"raise"`` raises ``RuntimeError``. Each message holds the measured errors.
    - Nothing to compare while the model computes in FP32 (``"32-true"``, a fallback already active). A check that
      passes says so (rank-zero info, with the measured error); one that cannot run warns why.

    Args:
        atol: absolute tolerance; default 0.
        rtol: tolerance relative to the FP32 output's max abs; default per format: fp16 1e-2, bf16 5e-2, with FP8
            layers 0.15.
        forward_fn: ``(module, batch) -> output``; default: :func:`default_forward` on the module's ``forward``, or,
            for a LightningModule without one, the loss its ``training_step`` returns (its ``self.log`` calls muted;
            manual optimization is skipped with a warning: its training step steps optimizers).

    Raises:
        ValueError: an argument is out of range.
    """

    foreign_note = ("it compares the first batch and warns on disagreement (raises with action='raise'); falling back"
                    " needs StablePrecision.")

    def __init__(
        self, atol: float | None = None, rtol: float | None = None, *, action: PreflightAction = "fallback",
        forward_fn: Callable[[pl.LightningModule, Any], Any] | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        for arg, value in (("atol", atol), ("rtol", rtol)):
            check(value is None or (is_number(value) and value >= 0), f"{name}({arg}={value!r})",
                  "must be a number >= 0, or None for the per-format default.")
        check(action in get_args(PreflightAction), f"{name}(action={action!r})",
              f"allowed values are {list(get_args(PreflightAction))}.")
        check(forward_fn is None or callable(forward_fn), f"{name}(forward_fn={forward_fn!r})",
              "must be a callable (module, batch) -> output, or None.")
        self.atol, self.rtol, self.action, self.forward_fn = atol, rtol, action, forward_fn
        self.result: dict[str, Any] = {}
        """The last check: ``compare_outputs``' keys plus ``precision``, ``atol``, ``rtol``, ``step``."""
        self._pending = False
        self._ladder: Ladder | None = None

    @cached_property  # the constructor's arguments: Lightning reads the key at every hook of every step
    def state_key(self) -> str:
        return type(self).__qualname__ + repr(dict(atol=self.atol, rtol=self.rtol, action=self.action))

    @property
    def pending(self) -> bool:
        """Whether the check still waits for the run's first training batch."""
        return self._pending

    def mark_checked(self) -> None:
        """Skip the pending check: the run's first batch was checked already (a run resumed after preemption)."""
        self._owe(False)

    def _owe(self, pending: bool) -> None:
        """Whether the check is owed. Lightning dispatches the batch-start hook, which only runs it, while it is."""
        self._pending = pending
        self._dispatch("on_train_batch_start", pending, AMPPreflight)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        # The ladder's fallback rung, at the start of the run (with action="fallback"); it watches the steps too, so a
        # run whose only face this is still logs each bad step's decision.
        rungs = [Rung.FALLBACK] if self.action == "fallback" else []
        self._ladder = run_ladder(trainer, self._plugin, "AMPPreflight", *rungs)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._ladder is not None and self._plugin is not None:
            watch_step(self._ladder, trainer, pl_module, self._plugin, "AMPPreflight", self._global_step.completed)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._owe(self._plugin is not None and self._plugin.compute_dtype != torch.float32)
        # The batch-end hook only watches the steps for the ladder: Lightning calls it only when no other face surely
        # watches them (ScaleCheckpoint, PrecisionFallback, FaultTriage: each step's decision is the same whoever asks
        # first, and is named after the first face that watches, this one included).
        ladder = self._ladder
        others = ladder is not None and any(watching for face, watching in ladder.watchers.items()
                                            if face != "AMPPreflight")
        self._dispatch("on_train_batch_end", ladder is not None and self._plugin is not None and not others,
                       AMPPreflight)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._pending:
            return
        self._owe(False)
        plugin = self._plugin
        assert plugin is not None
        cast_to = plugin.compute_dtype  # *-true: Lightning cast this batch to it before this hook
        # A global fallback climbs one rung (FP8 -> base precision -> FP32): check again after each, until they agree.
        for _ in range(3):
            if plugin.compute_dtype == torch.float32 or (message := self._check(trainer, pl_module, batch)) is None:
                break
            if self.action == "raise":
                raise RuntimeError(message + ". Use action='fallback' to train in FP32, or fp32_modules=[...].")
            if self.action == "warn" or not plugin.can_fallback:
                rank_zero_warn(message + ("." if plugin.can_fallback else
                                          "; falling back needs StablePrecision (action='fallback')."))
                break
            if self._ladder is not None:  # a decision before the first step: not keyed by a step
                self._ladder.decide(trainer.global_step, "preflight", message, by="AMPPreflight", keyed=False,
                                    done=True)
            plugin.fallback(None, reason=message)
        if getattr(plugin, "true_16bit", False) and plugin.compute_dtype != cast_to:
            _recast_batch_(batch, cast_to, plugin.compute_dtype)

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> str | None:
        """Compare once; the disagreement message, or ``None`` when the outputs agree (on every rank)."""
        plugin = self._plugin
        assert plugin is not None
        rtol = self.rtol if self.rtol is not None else FP8_RTOL if _has_fp8(pl_module) else DEFAULT_RTOL[plugin.dtype]
        atol = self.atol if self.atol is not None else 0.0
        forward, how = self._forward_fn(pl_module)
        try:
            if forward is None:
                raise TypeError(how)
            # Eagerly: a compiled model would compile a graph for each forward of the check (FP32, the copy) that
            # training never runs again.
            with torch.compiler.set_stance("force_eager"):
                reference, low = self._forwards(pl_module, plugin, batch, forward)
            result = compare_outputs(reference, low, atol=atol, rtol=rtol)
        except Exception as error:  # a failed check must not stop training: say why and go on
            rank_zero_warn(f"AMPPreflight skipped: the check on the first batch ({how}) failed ({error!r}); pass"
                           " forward_fn=(module, batch) -> output.")
            result = None
        if result is not None:
            self.result = {**result, "precision": plugin.precision, "atol": atol, "rtol": rtol,
                           "step": trainer.global_step}
        # Every rank reaches the reduction, whatever its own check did: any rank's disagreement decides for all.
        if not trainer.strategy.reduce_boolean_decision(result is not None and not result["passed"], all=False):
            if result is not None:
                rank_zero_info(
                    f"AMPPreflight: the {plugin.precision} {how} agrees with FP32 on the first batch (max rel error"
                    f" {result['max_rel_error']:.3g}, allowed {atol:g} + {rtol:g} * max abs)."
                )
            return None
        if result is None or result["passed"]:
            return f"AMPPreflight: the {plugin.precision} forward disagrees with FP32 on another rank's first batch"
        return (
            f"AMPPreflight: the {plugin.precision} forward disagrees with FP32 on the first batch: max abs error"
            f" {result['max_abs_error']:.3g}, max rel error {result['max_rel_error']:.3g} (of the FP32 output's max abs"
            f" {result['ref_max_abs']:.3g}), {result['nonfinite']} values non-finite in low precision only; allowed:"
            f" atol={atol:g} + rtol={rtol:g} * max abs"
        )

    def _forward_fn(self, pl_module: pl.LightningModule) -> tuple[Callable[[Any, Any], Any] | None, str]:
        """What to compare and how it is called: ``forward_fn``; else ``forward``; else, for a LightningModule that
        defines none (it computes everything in ``training_step``), the training step's loss."""
        if self.forward_fn is not None:
            return self.forward_fn, "forward_fn"
        if _defines_forward(pl_module):
            return default_forward, "forward"
        if not pl_module.automatic_optimization:
            return None, "training_step, which steps optimizers itself in manual optimization"
        return _training_step_loss, "training_step loss"

    def _forwards(
        self, pl_module: pl.LightningModule, plugin: PrecisionView, batch: Any, forward: Callable[[Any, Any], Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        modes = {module: module.training for module in pl_module.modules()}
        device = pl_module.device
        pl_module.eval()  # no dropout, no BatchNorm statistics update
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                with plugin.forward_context():
                    low = first_tensor(forward(pl_module, batch))
                with torch.autocast(device.type, enabled=False):
                    if plugin.precision.endswith("-true") or _has_fp8(pl_module):
                        as_fp32 = apply_to_collection(batch, torch.Tensor, _upcast)
                        reference = first_tensor(forward(_fp32_copy(pl_module), as_fp32))
                    else:
                        reference = first_tensor(forward(pl_module, batch))
        finally:
            for module, training in modes.items():
                module.training = training
        return reference, low

    def state_dict(self) -> dict[str, Any]:
        """Keys: ``result`` (the last check, plain values; ``{}`` before the first)."""
        return {"result": dict(self.result)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        strict_keys(type(self).__name__, state_dict, set(self.state_dict()))
        self.result = dict(state_dict["result"])

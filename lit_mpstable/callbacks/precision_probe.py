"""PrecisionProbe: every N steps, measures per module what low precision cost the gradients, against FP32."""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import cached_property
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.tensor import DTensor

from lit_mpstable.callbacks._common import PluginCallback, any_rank, check, is_int, log_measured, strict_keys
from lit_mpstable.core.step.probe import ProbeCopyError, metric_vector, with_metric_vector
from lit_mpstable.frontends.trainer import TrainerPrecision, training_step_args

_LOGGED = {"underflow_frac": "mp/grad_underflow_frac", "rel_error": "mp/grad_rel_error", "cosine": "mp/grad_cosine"}


class PrecisionProbe(PluginCallback):
    """On step 0 and every ``every_n_steps``-th optimizer step, recomputes the step's gradients in FP32 on the same
    (last micro-)batch and weights (:meth:`~lit_mpstable.core.step.stepper.PrecisionStepper.measure`) and measures,
    overall and per module, the fraction of gradient elements that flushed to zero, the relative error and the
    cosine to FP32.

    It runs in ``on_before_optimizer_step``, where the plugin has unscaled the gradients, so it sees the run's real
    precision path (loss scale, FP8, FP32 islands, op policy, masters). The result goes to ``plugin.stats["probe"]``,
    to :attr:`history`, to the loggers as ``mp/grad_underflow_frac``, ``mp/grad_rel_error`` and ``mp/grad_cosine``
    (on the step measured, never repeated), to ``PrecisionFallback(max_grad_error=...)``, and, with ``raise_scale``,
    to the scaler's ``note_underflow_`` (``AdaptiveLossScaler``: a higher scale when gradients flush and nothing
    overflows). A probe step whose gradients hold inf/NaN (the step is skipped) is measured on the next step instead.
    A recompute that fails (a ``training_step`` that cannot run on a copy) stops the probe with a warning, never
    the training.

    The recompute calls the LightningModule's ``training_step`` (its ``self.log`` muted, divided by
    ``accumulate_grad_batches`` as Lightning divides the loss) on deep copies of the module (non-leaf tensor attributes,
    such as torchmetrics states updated with the loss, copied detached), with the trainer attached, the RNG forked and
    set back to its state at the batch's start (same dropout masks): training, the data order and the module itself are
    untouched. With gradient accumulation or several processes, the run's gradient of the last micro-batch is recomputed
    too (each rank probes its own batch; the metrics are averaged across ranks, so every rank logs and decides the
    same). Cost per probe: about one FP32 forward and backward (two more with accumulation, DDP or FP8), and a temporary
    copy of the module.

    Args:
        every_n_steps: optimizer steps between probes (0-based steps 0, N-1, 2N-1, ...: Lightning's logging steps
            for ``log_every_n_steps=N``).
        raise_scale: pass the measured underflow to the scaler's ``note_underflow_`` where it has one.
        loss_fn: ``(module, batch) -> loss`` instead of ``training_step``: it gets a copy of the LightningModule
            and returns the loss as backpropagated (divided by ``accumulate_grad_batches``).

    Raises:
        ValueError: an argument is out of range.
    """

    def __init__(
        self, every_n_steps: int = 100, *, raise_scale: bool = True,
        loss_fn: Callable[[pl.LightningModule, Any], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        check(is_int(every_n_steps, 1), f"{name}(every_n_steps={every_n_steps!r})",
              "must be an int >= 1 (optimizer steps between probes); 100 keeps the cost near 1% of a run.")
        check(isinstance(raise_scale, bool), f"{name}(raise_scale={raise_scale!r})", "must be True or False.")
        check(loss_fn is None or callable(loss_fn), f"{name}(loss_fn={loss_fn!r})",
              "must be a callable (module, batch) -> loss, or None for training_step.")
        self.every_n_steps, self.raise_scale, self.loss_fn = every_n_steps, raise_scale, loss_fn
        self.history: list[dict[str, Any]] = []
        """One record per probe, plain values (a run summary serialises it as it is): :func:`measure`'s result
        (``step``, ``loss_scale``, overall ``underflow_frac``/``rel_error``/``cosine``, ``modules``, ``fp8``),
        averaged across ranks."""
        self.pending = False
        """Whether a probe is owed: its step overflowed (or was discarded), so the next step is measured."""
        self._capture: tuple[int, Any, int, dict[str, Any]] | None = None  # (step, batch, batch_idx, forward state)
        self._inert = False
        self._warned = False

    @cached_property  # the constructor's arguments: Lightning reads the key at every hook of every step
    def state_key(self) -> str:
        return type(self).__qualname__ + repr(dict(every_n_steps=self.every_n_steps))

    def is_due(self, step: int) -> bool:
        """Whether 0-based optimizer step ``step`` is probed (a postponed probe aside)."""
        return step == 0 or (step + 1) % self.every_n_steps == 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._capture, self._inert = None, False
        why = None
        if self._plugin is not None and not pl_module.automatic_optimization:
            why = "manual optimization: training_step steps the optimizers itself, so it cannot be replayed"
        elif self._plugin is not None and any(isinstance(p, DTensor) for p in pl_module.parameters()):
            why = "the parameters are sharded (DTensor, FSDP2): the FP32 recompute needs whole parameters"
        if why is not None:
            self._inert = True
            if not self._warned:
                self._warned = True
                rank_zero_warn(f"PrecisionProbe does nothing in this run: {why}.")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        plugin = cast("TrainerPrecision | None", self._plugin)  # StablePrecision only (no foreign_note)
        if plugin is None or self._inert:
            return
        step = plugin.step_count  # the optimizer step this batch belongs to
        if self._capture is not None and self._capture[0] != step:
            self.pending = True  # captured for an earlier step that never reached the optimizer (discarded)
        # Every micro-batch of a probed step: the last one's stays, with the RNG and FP8 state its forward starts from.
        due = self.pending or self.is_due(step)
        self._capture = (step, batch, batch_idx, plugin.stepper.forward_state()) if due else None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        plugin, capture = cast("TrainerPrecision | None", self._plugin), self._capture
        if plugin is None or capture is None:
            return
        self._capture = None
        step, batch, batch_idx, start = capture
        failure: Exception | None = None
        recompute = trainer.accumulate_grad_batches > 1 or trainer.world_size > 1
        # measure() hands the loss function a copy of pl_module: a LightningModule, as the user's loss_fn expects.
        loss_fn = (_training_step_loss(trainer, batch_idx) if self.loss_fn is None
                   else cast(Callable[[nn.Module, Any], torch.Tensor], self.loss_fn))
        try:
            result: dict[str, Any] | None = plugin.stepper.measure(
                pl_module, loss_fn, batch, recompute=recompute, start=start, step=step)
        except Exception as error:  # a diagnostic must not stop training: say why (once) and stop probing
            result, failure = None, error
        # Every rank agrees: one rank's inf/NaN gradient skips the step everywhere, and the probe waits for the next.
        failed, nonfinite = any_rank(trainer, [result is None, result is not None and not result["finite"]],
                                     pl_module.device)
        if failed:
            self._inert = True
            cause = f"{failure!r}" if result is None else "an error on another rank"
            advice = ("" if isinstance(failure, ProbeCopyError) else "; pass loss_fn=(module, batch) -> loss if"
                      " training_step cannot be replayed on a copy")
            rank_zero_warn(f"PrecisionProbe stops probing at step {step}: the recompute failed ({cause}){advice}.")
            return
        if nonfinite:
            self.pending = True
            return
        assert result is not None
        self.pending = False
        if trainer.world_size > 1:
            values = torch.tensor(metric_vector(result), dtype=torch.float64, device=pl_module.device)
            result = with_metric_vector(result, trainer.strategy.reduce(values, reduce_op="mean").tolist())
        plugin.findings.probe = result
        plugin.stats["probe"] = result  # shown with the telemetry (DESIGN)
        self.history.append(result)
        if self.raise_scale and callable(note := getattr(plugin.scaler, "note_underflow_", None)):
            note(result["underflow_frac"])
        log_measured(trainer, {name: float(result[key]) for key, name in _LOGGED.items()})

    def state_dict(self) -> dict[str, Any]:
        """Keys: ``history`` (the probe records, plain values), ``pending`` (a probe owed to the next step)."""
        return {"history": copy.deepcopy(self.history), "pending": self.pending}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        strict_keys(type(self).__name__, state_dict, set(self.state_dict()))
        self.history = copy.deepcopy(list(state_dict["history"]))
        self.pending = bool(state_dict["pending"])


def _training_step_loss(trainer: pl.Trainer, batch_idx: int) -> Callable[[nn.Module, Any], torch.Tensor]:
    """The loss Lightning backpropagates for a batch: ``training_step``'s, divided by ``accumulate_grad_batches``,
    computed on the module given (a copy, with the trainer attached so ``global_step`` and ranks read true) with its
    ``self.log`` calls muted (a replay is not a step)."""

    def loss_fn(copy: nn.Module, batch: Any) -> torch.Tensor:
        module = cast(pl.LightningModule, copy)  # measure() hands back the module it was given: a copy of ours
        module.trainer = trainer
        module.log = module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign, assignment]
        output = module.training_step(*training_step_args(module, batch, batch_idx))
        loss = cast(torch.Tensor, output["loss"] if isinstance(output, dict) else output)  # else measure() says
        return loss / trainer.accumulate_grad_batches

    return loss_fn

"""A preemption scenario: a small regression trained with StablePrecision('16-mixed') and every stability callback
on 1 or 2 CPU processes (gloo DDP), with scripted faults that make the run's stability state non-trivial (overflow
skips, a PrecisionFallback fallback and restore, a ScaleCheckpoint rollback); preempted by a signal at a chosen step,
resumed from PreemptionCheckpoint's checkpoint, and compared with the uninterrupted run.

    full = run(tmp / "full", 16)
    first, resumed, path = preempted_and_resumed(tmp, 16, step=8, signum=signal.SIGTERM)
    max_delta(full, first, resumed)  # {"loss": 0.0, "weights": 0.0, "steps_compared": 32, "state_equal": True}

``tests/adapter/test_preemption.py`` checks it; ``bench/preemption_continuation.py`` runs it at length.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lit_mpstable.app.fault_demos import TinyMLP, regression_data
from lit_mpstable.callbacks import AMPPreflight, OverflowMonitor, PrecisionFallback, PrecisionProbe, ScaleCheckpoint
from lit_mpstable.callbacks.preemption import PreemptionCheckpoint
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler
from lit_mpstable.frontends.trainer import StablePrecision

WORLD_SIZE = 2  # the default number of processes
# A collective that one rank never joins (ranks deciding differently) fails after this instead of hanging for 30 min.
TIMEOUT = timedelta(seconds=60)

# Faults keyed on the optimizer step (a resumed run meets them at the same steps). Overflows on rank 1 in steps 3 and 4
# make PrecisionFallback go global (decided at global_step 5; cooldown: restored at 9); ScaleCheckpoint snapshots at
# each layout change and every 4 steps, and rolls back to its snapshot of 9 on the NaN weight of step 10; another
# overflow in step 13 lands in OverflowMonitor's window.
FAULTS = {"inf_grad_steps": (3, 4, 13), "spike_steps": (10,)}


class PreemptModule(pl.LightningModule):
    """TinyMLP regression with dropout (the RNG matters), shuffled data (the sampler position matters), AdamW and a
    step LR schedule; fc2's gradient turns inf on ``fault_rank`` at ``inf_grad_steps``; fc1's weight gets a NaN (a bit
    flip: ScaleCheckpoint's rollback) on rank 0 at ``spike_steps``."""

    def __init__(self, inf_grad_steps=(), spike_steps=(), fault_rank: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyMLP()
        self.drop = nn.Dropout(0.2)
        self.inf_grad_steps, self.spike_steps, self.fault_rank = set(inf_grad_steps), set(spike_steps), fault_rank
        self.x, self.y = regression_data(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        return m.fc3(m.act(m.fc2(self.drop(m.act(m.fc1(x))))))

    def on_train_batch_start(self, batch, batch_idx) -> None:
        # Here, not in training_step: a checkpoint's pinned pass (the numeric fingerprint) runs training_step too.
        if self.global_rank == 0 and self.global_step in self.spike_steps:
            with torch.no_grad():
                self.model.fc1.weight.view(-1)[0] = float("nan")

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def on_after_backward(self) -> None:
        if self.global_rank == self.fault_rank and self.global_step in self.inf_grad_steps:
            grad = self.model.fc2.weight.grad
            assert grad is not None  # after a backward through fc2
            grad.view(-1)[0] = float("inf")

    def train_dataloader(self):
        dataset = torch.utils.data.TensorDataset(self.x, self.y)
        return torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True)  # DistributedSampler under DDP

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ValidatedModule(PreemptModule):
    """:class:`PreemptModule` with a validation loop (creating its iterator draws from the global RNG)."""

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nn.functional.mse_loss(self(batch[0]).float(), batch[1]))

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x[:16], self.y[:16]), batch_size=8)


def plugin() -> StablePrecision:
    return StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**10, growth_interval=3),
                           telemetry_every_n_steps=5)


def callbacks() -> list[pl.Callback]:
    """Every callback of lit_mpstable.callbacks."""
    return [OverflowMonitor(window=5, log_every_n_steps=1), PrecisionFallback(patience=2, cooldown=4),
            ScaleCheckpoint(every_n_steps=4, max_rollbacks=10),
            AMPPreflight(), PrecisionProbe(every_n_steps=6)]


class SignalAt(pl.Callback):
    """Sends ``signum`` to its own process on ``rank`` at the start of optimizer step ``step``."""

    def __init__(self, step: int, signum: int, rank: int = 1) -> None:
        self.step, self.signum, self.rank = step, signum, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), self.signum)


class Report(pl.Callback):
    """Per optimizer step its loss; at the end weights, plugin and callback states, to ``out/rank{r}.pt``."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = str(out_dir)
        self.losses: dict[int, float] = {}

    def setup(self, trainer, pl_module, stage) -> None:
        torch.set_num_threads(1)
        torch.manual_seed(100 + trainer.global_rank)  # the RNG a fresh run starts from (a resume restores its own)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses[self._step] = outputs["loss"].detach().float().item()

    def on_train_end(self, trainer, pl_module) -> None:
        states = {cb.state_key: cb.state_dict() for cb in trainer.callbacks
                  if not isinstance(cb, (Report, PreemptionCheckpoint, SignalAt)) and hasattr(cb, "state_dict")}
        torch.save({"losses": self.losses, "step": trainer.global_step,
                    "params": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                    "plugin": trainer.precision_plugin.state_dict(), "callbacks": states},
                   Path(self.out_dir) / f"rank{trainer.global_rank}.pt")


def run(out_dir: Path, max_steps: int, extra: Sequence[pl.Callback] = (), ckpt_path: Path | None = None,
        faults: dict[str, Any] = FAULTS, devices: int = WORLD_SIZE, validate_every: int | None = None,
        **trainer_kwargs: Any) -> list[dict[str, Any]]:
    """Fit on ``devices`` CPU processes (2: gloo DDP, forked), validating every ``validate_every`` steps; each rank's
    report."""
    from lightning.pytorch.strategies import DDPStrategy

    out_dir.mkdir(parents=True, exist_ok=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, max_steps=max_steps,
        strategy=DDPStrategy(start_method="fork", timeout=TIMEOUT) if devices > 1 else "auto",
        plugins=[plugin()], callbacks=[*callbacks(), *extra, Report(out_dir)], num_sanity_val_steps=0,
        val_check_interval=validate_every, check_val_every_n_epoch=None if validate_every else 1,
        limit_val_batches=None if validate_every else 0,
        enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False,
        **trainer_kwargs,
    )
    trainer.fit((ValidatedModule if validate_every else PreemptModule)(**faults), ckpt_path=ckpt_path)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(devices)]


def preempted_and_resumed(tmp: Path, max_steps: int, step: int, signum: int, rank: int = 1,
                          faults: dict[str, Any] = FAULTS, **kwargs: Any) -> tuple[list, list, Path]:
    ckpt_dir = tmp / "ckpt"
    first = run(tmp / "first", max_steps, [PreemptionCheckpoint(ckpt_dir, exit=False), SignalAt(step, signum, rank)],
                faults=faults, **kwargs)
    path = ckpt_dir / "preemption.ckpt"
    resumed = run(tmp / "resumed", max_steps, [PreemptionCheckpoint(ckpt_dir, exit=False)], ckpt_path=path,
                  faults=faults, **kwargs)
    return first, resumed, path


def max_delta(full: list[dict], first: list[dict], resumed: list[dict]) -> dict[str, float]:
    """Max |difference| of per-step losses (the preempted run's steps, then the resumed run's) and final weights,
    over both ranks; also whether the plugin and callback states are equal."""
    out = {"loss": 0.0, "weights": 0.0, "steps_compared": 0, "state_equal": True}
    for f, a, b in zip(full, first, resumed):
        stitched = {**a["losses"], **b["losses"]}
        assert sorted(stitched) == sorted(f["losses"]), (sorted(stitched), sorted(f["losses"]))
        out["steps_compared"] += len(stitched)
        for s, loss in f["losses"].items():
            out["loss"] = max(out["loss"], abs(stitched[s] - loss))
        for k, v in f["params"].items():
            out["weights"] = max(out["weights"], (b["params"][k].float() - v.float()).abs().max().item())
        out["state_equal"] &= b["plugin"] == f["plugin"] and b["callbacks"] == f["callbacks"]
    return out

"""FaultTriage and SpikeGuard's restart after ``max_consecutive`` spikes in a row: the steps before it are replayed
and recorded as data, the step that completes the run is a new level, not a fault (no replay, no 'transient')."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_mpstable import SpikeGuard, StablePrecision
from lit_mpstable.callbacks import FaultTriage


class _Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.net(x).float() - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_the_step_that_restarts_the_guard_is_not_triaged():
    torch.manual_seed(0)
    x = torch.randn(32 * 90, 8)
    y = x @ torch.randn(8, 1)
    y[32 * 60:] += 3.0  # the data moves to a new level at batch 60, for good
    plugin = StablePrecision("bf16-mixed", spike_guard=SpikeGuard(warmup=10, window=32, max_consecutive=4))
    triage = FaultTriage()
    pl.Trainer(max_epochs=1, plugins=[plugin], callbacks=[triage], logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(
        _Regression(), DataLoader(TensorDataset(x, y), batch_size=32))
    assert [(e["step"], e["kind"], e["action"]) for e in triage.events] == [(s, "data", "skip") for s in (60, 61, 62)]
    assert plugin.stepper.skipped_steps == 4 and plugin.stepper.spike_guard.level_shifts == 1

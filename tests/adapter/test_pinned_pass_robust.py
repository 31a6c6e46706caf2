"""The fingerprint's pinned pass on the training steps Lightning accepts: a fit saves and resumes whatever
``training_step`` does with the pinned rows; a pass that cannot run leaves the checkpoint without a pinned loss."""

from __future__ import annotations

import collections
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_trainer
from torch import nn
from torch.utils.checkpoint import checkpoint
from trainer_pkg import NAME, FaultTriage, StablePrecision, pl

from lit_mpstable.app.fault_demos import TinyMLP, regression_data
from lit_mpstable.core.fingerprint import KEY

Batch = collections.namedtuple("Batch", "x y")


class Net(pl.LightningModule):
    """TinyMLP regression, AdamW, batches of 16."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyMLP()
        self.x, self.y = regression_data(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def collate(self, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        return tuple(torch.stack(column) for column in zip(*rows, strict=True))

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.utils.data.TensorDataset(self.x, self.y)
        return torch.utils.data.DataLoader(data, batch_size=16, collate_fn=self.collate)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class NamedBatch(Net):
    def collate(self, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> Batch:
        return Batch(*super().collate(rows))

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self(batch.x).float(), batch.y)


class SkipsEveryFourth(Net):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        return None if batch_idx % 4 == 0 else super().training_step(batch, batch_idx)  # Lightning: skip the batch


class LossOnlyInTraining(Net):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if not self.training:  # torchvision's detection models return detections, not losses, in eval mode
            raise AttributeError("'list' object has no attribute 'values'")
        return super().training_step(batch, batch_idx)


class ReentrantCheckpointing(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.model.fc1(x)  # the checkpointed block's input requires grad
        return checkpoint(lambda h: self.model.fc3(self.model.fc2(torch.relu(h))), hidden, use_reentrant=True)


class NoBatchIdx(Net):
    def training_step(self, batch: Any) -> torch.Tensor:  # type: ignore[override]
        return super().training_step(batch, -1)


def _fit(model: Net, directory: Path, max_steps: int, ckpt_path: Path | None = None,
         callbacks: list[Any] = ()) -> tuple[Any, list[str]]:  # type: ignore[assignment]
    plugin = StablePrecision("bf16-mixed")
    saving = pl.callbacks.ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(plugin, max_steps=max_steps, enable_checkpointing=True, callbacks=[saving, *callbacks])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, ckpt_path=ckpt_path)
    return plugin, [str(w.message) for w in caught if "pinned" in str(w.message)]


def _pinned(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)["StablePrecision"][KEY]["pinned"]


@pytest.mark.parametrize("make", [NamedBatch, NoBatchIdx])
def test_a_fit_saves_the_pinned_loss_and_resumes_with_it(tmp_path, make) -> None:
    _, said = _fit(make(), tmp_path, 4)
    last = tmp_path / "epoch=0-step=4.ckpt"
    assert not said and _pinned(last)["grad_norm"] > 0  # before: AttributeError / TypeError at the first save
    plugin, said = _fit(make(), tmp_path, 6, ckpt_path=last)
    assert {event["action"] for event in plugin.fingerprint.events} == {"passed"}
    assert _pinned(tmp_path / "epoch=1-step=6.ckpt")  # the resumed run's saves carry it on


@pytest.mark.parametrize("make", [SkipsEveryFourth, LossOnlyInTraining, ReentrantCheckpointing])
def test_a_pinned_pass_that_cannot_run_saves_checksums_only_and_resumes(tmp_path, make) -> None:
    _, said = _fit(make(), tmp_path, 4)  # before: the first save raised and killed the fit
    last = tmp_path / "epoch=0-step=4.ckpt"
    assert len(said) == 1 and "no pinned loss" in said[0]  # once a run, though both saves skip it
    assert _pinned(last) == {} and torch.load(last, weights_only=True)["StablePrecision"][KEY]["checksums"]
    plugin, _ = _fit(make(), tmp_path, 6, ckpt_path=last)
    assert {event["action"] for event in plugin.fingerprint.events} == {"passed"}


def test_a_load_whose_pinned_pass_fails_says_it_was_not_compared(tmp_path) -> None:
    _fit(Net(), tmp_path, 2)  # pins and saves a loss; a training_step changed since cannot run the rows in eval mode
    plugin, _ = _fit(LossOnlyInTraining(), tmp_path, 4, ckpt_path=tmp_path / "epoch=0-step=2.ckpt")
    (event,) = plugin.fingerprint.events[-1:]
    assert event["action"] == "passed" and any("not compared (AttributeError" in note for note in event["notes"])


@pytest.mark.skipif(NAME != "lightning.pytorch", reason="FaultInjector is a lightning.pytorch callback")
def test_a_training_step_without_batch_idx_is_replayed_by_fault_triage(tmp_path) -> None:
    from lit_mpstable.faults import FaultInjector

    triage = FaultTriage()
    _fit(NoBatchIdx(), tmp_path, 4, callbacks=[triage, FaultInjector({1: "transient"}, module="model.fc1")])
    assert [(event["step"], event["kind"]) for event in triage.events] == [(1, "transient")]

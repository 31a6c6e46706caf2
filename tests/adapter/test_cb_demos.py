"""All four callbacks together on Lightning's own demo models, beside ModelCheckpoint, EarlyStopping, gradient
clipping and accumulation, in bf16-mixed: a healthy run stays untouched and every checkpoint loads weights-only."""

from __future__ import annotations

import pytest
import torch
from helpers import make_trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.demos import LightningTransformer
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader, TensorDataset

from lit_mpstable import StablePrecision
from lit_mpstable.callbacks import AMPPreflight, OverflowMonitor, PrecisionFallback, ScaleCheckpoint


class _Transformer(LightningTransformer):
    """The demo Transformer (vocab 64) on a synthetic token walk instead of WikiText2 (which downloads)."""

    def __init__(self) -> None:
        super().__init__(vocab_size=64)
        g = torch.Generator().manual_seed(0)
        stream = torch.randint(1, 4, (8 * 16 + 1,), generator=g).cumsum(0) % 64
        windows = stream.unfold(0, 17, 16)
        self.data = TensorDataset(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())

    def prepare_data(self) -> None:  # the demo's downloads WikiText2
        pass

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=2)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=4)

    def validation_step(self, batch, batch_idx):
        inputs, target = batch
        self.log("val_loss", torch.nn.functional.nll_loss(self(inputs, target), target.view(-1)))


class _Boring(BoringModel):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.step(batch))


@pytest.mark.parametrize("model", [_Transformer, _Boring])
def test_all_callbacks_on_lightning_demos(model, tmp_path) -> None:
    torch.manual_seed(0)
    module = model()
    callbacks = [
        OverflowMonitor(window=4), PrecisionFallback(), ScaleCheckpoint(every_n_steps=2), AMPPreflight(),
        ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, save_last=True),
        EarlyStopping(monitor="val_loss", patience=3),
    ]
    trainer = make_trainer(
        StablePrecision("bf16-mixed"), max_steps=4, max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=0.5,
        log_every_n_steps=1, callbacks=callbacks, enable_checkpointing=True, limit_train_batches=4, limit_val_batches=1,
    )
    trainer.fit(module)
    monitor, fallback, checkpoint, preflight = callbacks[:4]
    assert trainer.global_step == 4  # 2 epochs of 4 batches, accumulating 2
    assert preflight.result["passed"] and preflight.result["max_rel_error"] < 0.05
    assert fallback.decisions == [] and checkpoint.rollbacks == 0 and not trainer.precision_plugin.fallback_active
    assert checkpoint.snapshot_step == 4 and trainer.precision_plugin.ladder_events == []  # no bad step decided
    assert {"mp/overflow_rate", "mp/rollbacks", "mp/fallback_active"} <= set(trainer.callback_metrics)
    assert "mp/loss_scale" not in trainer.callback_metrics  # BF16 has no scaler: nothing to show
    assert not trainer.progress_bar_metrics.keys() & {"mp/loss_scale", "mp/overflow_rate"}
    files = sorted(tmp_path.glob("*.ckpt"))
    assert files
    for path in files:
        saved = torch.load(path, weights_only=True)
        assert "StablePrecision" in saved
        names = {key.split("{")[0] for key in saved["callbacks"]}
        assert names >= {"OverflowMonitor", "PrecisionFallback", "ScaleCheckpoint", "AMPPreflight"}
    assert all(torch.isfinite(p).all() for p in module.parameters())

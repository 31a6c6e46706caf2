"""The Trainer's numeric fingerprint beside the user's hooks: a callback or module ``on_save_checkpoint`` that edits
the state dict, a ``training_step`` that reads the loop's step and epoch, metrics updated in ``training_step``, and
one plugin reused for a second Trainer."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_trainer
from torch import nn
from trainer_pkg import StablePrecision, pl

from lit_mpstable.app.fault_demos import TinyMLP, regression_data
from lit_mpstable.core.fingerprint import KEY, FingerprintMismatch


class Net(pl.LightningModule):
    """TinyMLP regression, AdamW, four batches of 16 an epoch."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyMLP()
        self.x, self.y = regression_data(64, seed=seed)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.model(x).float(), y)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=16)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(model: Net, directory: Path, max_steps: int, ckpt_path: Path | None = None, callbacks: list[Any] = (),
         plugin: Any = None) -> Any:  # type: ignore[assignment]
    plugin = plugin or StablePrecision("bf16-mixed")
    saving = pl.callbacks.ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(plugin, max_steps=max_steps, enable_checkpointing=True, callbacks=[saving, *callbacks])
    trainer.fit(model, ckpt_path=ckpt_path)
    return plugin


def _actions(plugin: Any) -> list[str]:
    return [event["action"] for event in plugin.fingerprint.events]


# ------------------------------------------------------------------ on_save_checkpoint edits the state dict
class DropsFrozen(Net):
    """A frozen first layer left out of the file (a slim fine-tuning checkpoint), loaded non-strictly."""

    def __init__(self) -> None:
        super().__init__()
        self.model.fc1.requires_grad_(False)
        self.strict_loading = False

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        for key in [key for key in checkpoint["state_dict"] if key.startswith("model.fc1.")]:
            del checkpoint["state_dict"][key]


class PutsFrozenBack(DropsFrozen):
    """... and puts the model's own frozen layer back into the loaded dict (so it loads strictly)."""

    def __init__(self) -> None:
        super().__init__()
        self.strict_loading = True

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["state_dict"].update({k: v for k, v in self.state_dict().items() if k.startswith("model.fc1.")})


def _ema() -> list[Any]:
    ema = getattr(pl.callbacks, "EMAWeightAveraging", None)
    if ema is None:
        pytest.skip("this Lightning has no EMAWeightAveraging")
    return [ema(decay=0.9)]


@pytest.mark.parametrize("edit", ["ema", "drops_frozen"])
def test_a_checkpoint_edited_by_on_save_checkpoint_hooks_resumes(tmp_path, edit) -> None:
    make, callbacks = (Net, _ema) if edit == "ema" else (DropsFrozen, list)
    _fit(make(), tmp_path, 4, callbacks=callbacks())
    saved = torch.load(tmp_path / "epoch=0-step=4.ckpt", weights_only=True)
    assert ("current_model_state" in saved) == (edit == "ema")  # the hook ran: the file holds what it wrote
    assert not any("fc1" in path for path in saved["StablePrecision"][KEY]["checksums"]) or edit == "ema"
    # Before: FingerprintMismatch (the checksums were of the dict before the hooks edited it: EMA's averaged weights
    # replace the model's; the dropped keys "missing from the loaded checkpoint").
    plugin = _fit(make(), tmp_path, 6, ckpt_path=tmp_path / "epoch=0-step=4.ckpt", callbacks=callbacks())
    assert _actions(plugin) == ["passed", "passed"]  # checksums and manifest, then the pinned micro-batch


def test_weights_a_load_hook_puts_into_the_dict_are_noted_not_refused(tmp_path) -> None:
    _fit(PutsFrozenBack(), tmp_path, 4)
    # Before: FingerprintMismatch ("weight `state_dict['model.fc1.weight']` was not in the saved checkpoint").
    plugin = _fit(PutsFrozenBack(), tmp_path, 6, ckpt_path=tmp_path / "epoch=0-step=4.ckpt")
    assert _actions(plugin) == ["passed", "passed"]
    (note,) = plugin.fingerprint.events[0]["notes"]
    assert "`state_dict['model.fc1.weight']`, `state_dict['model.fc1.bias']`" in note and "not compared" in note


@pytest.mark.parametrize("edit", ["ema", "drops_frozen", "puts_frozen_back"])
def test_a_corrupted_checkpoint_edited_by_hooks_is_still_refused(tmp_path, edit) -> None:
    make, callbacks = {"ema": (Net, _ema), "drops_frozen": (DropsFrozen, list),
                       "puts_frozen_back": (PutsFrozenBack, list)}[edit]
    _fit(make(), tmp_path, 4, callbacks=callbacks())
    path = tmp_path / "epoch=0-step=4.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["state_dict"]["model.fc2.weight"][0, 0] += 1.0
    torch.save(checkpoint, path)
    with pytest.raises(FingerprintMismatch, match=r"checksum of weight `state_dict\['model.fc2.weight'\]` differs"):
        _fit(make(), tmp_path, 6, ckpt_path=path, callbacks=callbacks())


# ------------------------------------------------------------------ the loop's step and epoch; outside fit
class WarmsUp(Net):
    """A loss weight warmed up over the steps and raised each epoch (KL annealing, an auxiliary-loss warmup)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        weight = min(1.0, (self.global_step + 1) / 10) * (1 + self.current_epoch)
        return super().training_step(batch, batch_idx) * weight


def test_a_training_step_that_reads_the_step_and_epoch_resumes(tmp_path) -> None:
    _fit(WarmsUp(), tmp_path, 6)
    # Before: FingerprintMismatch (the load's pinned pass ran at global_step 0, epoch 0: another loss weight).
    plugin = _fit(WarmsUp(), tmp_path, 8, ckpt_path=tmp_path / "epoch=1-step=6.ckpt")
    assert _actions(plugin) == ["passed", "passed"]
    assert not any(event["notes"] for event in plugin.fingerprint.events)


class LogsTheLR(Net):
    """``training_step`` reads the optimizer (there is none outside fit) and counts its calls."""

    calls = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        LogsTheLR.calls += 1
        self.log("lr", self.optimizers().param_groups[0]["lr"])
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", super().training_step(batch, batch_idx))

    test_step = validation_step

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0])

    val_dataloader = test_dataloader = predict_dataloader = Net.train_dataloader


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_evaluation_from_a_checkpoint_runs_no_pinned_pass(tmp_path, stage) -> None:
    _fit(LogsTheLR(), tmp_path, 2)
    plugin = StablePrecision("bf16-mixed")
    LogsTheLR.calls = 0
    getattr(make_trainer(plugin), stage)(LogsTheLR(), ckpt_path=tmp_path / "epoch=0-step=2.ckpt")
    assert LogsTheLR.calls == 0  # before: the load's pinned pass ran training_step (and failed on self.optimizers())
    assert _actions(plugin) == ["passed"] and not plugin.fingerprint.events[0]["notes"]


# ------------------------------------------------------------------ metrics updated in training_step
class CountsRows(Net):
    """torchmetrics updated in ``training_step``, Lightning's usual pattern."""

    def __init__(self) -> None:
        super().__init__()
        torchmetrics = pytest.importorskip("torchmetrics")
        self.rows = torchmetrics.SumMetric()
        self.accuracy = torchmetrics.classification.BinaryAccuracy()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.model(x).float()
        self.rows.update(torch.tensor(float(len(x))))
        self.accuracy.update(out[:, 0], (y[:, 0] > 0).long())
        return nn.functional.mse_loss(out, y)


def test_saves_leave_the_metrics_updated_in_training_step_as_without_them(tmp_path) -> None:
    without = CountsRows()
    make_trainer(StablePrecision("bf16-mixed"), max_steps=4).fit(without)
    saving = CountsRows()
    _fit(saving, tmp_path, 4)  # two saves, each with a pinned pass through training_step
    assert float(without.rows.compute()) == 64.0
    # Before: 72 rows (the pinned pass's 4 rows at each save counted) and another accuracy.
    assert float(saving.rows.compute()) == 64.0 and saving.rows._update_count == without.rows._update_count == 4
    assert torch.equal(saving.accuracy.compute(), without.accuracy.compute())


# ------------------------------------------------------------------ one plugin, two Trainers
def test_a_plugin_reused_for_a_second_trainer_pins_that_fits_rows(tmp_path) -> None:
    plugin = StablePrecision("bf16-mixed")
    _fit(Net(), tmp_path / "one", 2, plugin=plugin)
    second = Net(seed=1)  # other data: a sweep over data sets with one plugin
    _fit(second, tmp_path / "two", 2, plugin=plugin)
    pinned = torch.load(tmp_path / "two" / "epoch=0-step=2.ckpt", weights_only=True)["StablePrecision"][KEY]["pinned"]
    assert torch.equal(pinned["batch"][0], second.x[:4])  # before: the first run's rows
    assert torch.equal(plugin.fingerprint.batch[0], second.x[:4])


class _LoadsEarlierFileAt(pl.Callback):
    """At one step, the restored-state rung's in-process load of an earlier file (mid-fit, as ScaleCheckpoint does)."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path, self.seen = step, path, None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == self.step and self.seen is None:  # once: the run passes the step again after it
            from lit_mpstable.callbacks._restored import load_in_process

            batches = trainer.fit_loop.epoch_loop.batch_progress
            before = batches.state_dict()
            restored = load_in_process(trainer, torch.load(self.path, weights_only=True), self.path)
            self.seen = (restored, trainer.current_epoch, batches.state_dict() == before)


def test_a_mid_fit_load_runs_the_pinned_pass_at_the_files_step(tmp_path) -> None:
    loads = _LoadsEarlierFileAt(5, tmp_path / "epoch=0-step=2.ckpt")
    plugin = _fit(WarmsUp(), tmp_path, 6, callbacks=[loads])
    # Before: FingerprintMismatch (the pass ran at global_step 5, epoch 1; the file was saved at step 2, epoch 0).
    assert _actions(plugin) == ["passed"] * 2
    # The file's step is taken by the rung itself; the pass leaves the loop's epoch and batch position as they were.
    assert loads.seen == (2, 1, True)


# ------------------------------------------------------------------ a checkpoint saved from the validation loop
class Validated(Net):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.model(x).float(), y))

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self.train_dataloader()


@pytest.mark.parametrize("inference_mode", [True, False])
def test_a_checkpoint_saved_after_mid_epoch_validation_carries_the_pinned_loss(inference_mode: bool,
                                                                               tmp_path: Path) -> None:
    # ModelCheckpoint saves in on_validation_end when validation runs within the epoch, under no_grad or
    # inference_mode: the pinned pass had no graph there and the file went without its pinned loss.
    saving = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)
    trainer = make_trainer(StablePrecision("bf16-mixed"), max_steps=4, enable_checkpointing=True, callbacks=[saving],
                           val_check_interval=2, inference_mode=inference_mode)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no pinned loss")
        trainer.fit(Validated())
    paths = sorted(tmp_path.glob("*.ckpt"))
    assert len(paths) == 2
    for path in paths:
        pinned = torch.load(path, weights_only=True)["StablePrecision"][KEY]["pinned"]
        assert pinned and torch.isfinite(torch.tensor(pinned["loss"])), pinned
    plugin = StablePrecision("bf16-mixed")
    make_trainer(plugin, max_steps=6, val_check_interval=2).fit(Validated(), ckpt_path=paths[-1])
    assert _actions(plugin) == ["passed", "passed"]  # checksums and manifest, then the pinned pass

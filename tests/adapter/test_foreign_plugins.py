"""The callbacks in a project that keeps Lightning's own precision plugin: they read its GradScaler and act where
they can (monitoring, rollback, preflight); what needs StablePrecision says so once."""

from __future__ import annotations

import warnings

import pytest
import torch
from cb_helpers import ListLogger, PoisonModule, quiet
from helpers import make_trainer
from trainer_pkg import AMPPreflight, HalfPrecision, MixedPrecision, OverflowMonitor, ScaleCheckpoint, pl


class _CountingScaler(torch.amp.GradScaler):
    reads = 0

    def get_scale(self) -> float:
        type(self).reads += 1
        return super().get_scale()


def _mixed(init_scale: float = 2.0**10) -> MixedPrecision:
    # Real FP16 autocast and GradScaler on the CPU (precision="16-mixed" would become BF16 there).
    return MixedPrecision("16-mixed", "cpu", scaler=_CountingScaler("cpu", init_scale=init_scale))


def test_overflow_monitor_reads_lightnings_gradscaler_without_a_sync_per_step() -> None:
    _CountingScaler.reads = 0
    logger, plugin = ListLogger(), _mixed()
    trainer = make_trainer(plugin, max_steps=8, log_every_n_steps=2, logger=logger,
                           callbacks=[OverflowMonitor(window=4)])
    with pytest.warns(UserWarning, match="OverflowMonitor with MixedPrecision: it logs the GradScaler's scale"):
        trainer.fit(PoisonModule(inf_grad_steps={1, 5}, n=128))
    assert _CountingScaler.reads == 4  # the scale is read on the 4 logging steps only
    assert logger.values("mp/skipped_steps") == [1.0, 1.0, 2.0, 2.0]
    assert logger.values("mp/loss_scale") == [2.0**9, 2.0**9, 2.0**8, 2.0**8]  # GradScaler backed off twice
    assert logger.values("mp/overflow_rate")[-1] == pytest.approx(0.25)  # one of the last 4 steps
    assert plugin.scaler.get_scale() == 2.0**8


def test_overflow_monitor_with_half_precision_reports_no_skips() -> None:
    logger = ListLogger()
    trainer = make_trainer(HalfPrecision("bf16-true"), max_steps=4, log_every_n_steps=2, logger=logger,
                           callbacks=[OverflowMonitor()])
    with quiet():
        trainer.fit(PoisonModule())
    assert logger.values("mp/skipped_steps") == [0.0, 0.0] and not logger.steps_with("mp/loss_scale")


def test_scale_checkpoint_rolls_back_with_lightnings_plugin() -> None:
    weights = []

    class Record(ScaleCheckpoint):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            super().on_train_batch_end(trainer, pl_module, *args)
            weights.append(pl_module.model.fc2.weight.detach().clone())

    class NanWeightAt5(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step == 5:
                with torch.no_grad():
                    pl_module.model.fc2.weight.view(-1)[0] = float("nan")

    checkpoint, plugin = Record(every_n_steps=2), _mixed()
    with pytest.warns(UserWarning, match="rolls back non-finite weights or optimizer state"):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="ScaleCheckpoint at step")
            make_trainer(plugin, max_steps=7, callbacks=[NanWeightAt5(), checkpoint]).fit(PoisonModule())
    # Found by the snapshot check at step 6 (Lightning's plugin skipped step 5; the NaN stayed in the weights).
    assert [(e["step"], e["action"], e["restored_step"]) for e in checkpoint.events] == [(6, "rollback", 4)]
    assert torch.equal(weights[5], weights[3])  # the state after the rollback is the snapshot's


def test_preflight_warns_with_lightnings_plugin_and_raises_when_asked() -> None:
    with pytest.warns(UserWarning, match="disagrees with FP32.*falling back needs StablePrecision"):
        make_trainer(_mixed(), max_steps=1, callbacks=[AMPPreflight()]).fit(PoisonModule(amplify=True))
    with quiet(), pytest.raises(RuntimeError, match="disagrees with FP32"):
        make_trainer(_mixed(), max_steps=1, callbacks=[AMPPreflight(action="raise")]).fit(PoisonModule(amplify=True))
    preflight = AMPPreflight()
    with quiet():
        make_trainer(HalfPrecision("bf16-true"), max_steps=1, callbacks=[preflight]).fit(PoisonModule())
    assert preflight.result["passed"] and preflight.result["precision"] == "bf16-true"


def test_stableprecision_and_both_views_satisfy_precision_view_and_the_views_refuse_what_needs_ours() -> None:
    from types import SimpleNamespace

    from trainer_pkg import StablePrecision

    from lit_mpstable.callbacks.views import DeepSpeedView, ForeignPrecision, PrecisionView
    from lit_mpstable.fabric import StablePrecision as FabricStablePrecision

    trainer = SimpleNamespace(global_step=0, optimizers=[], strategy=SimpleNamespace(model=SimpleNamespace()))
    foreign = ForeignPrecision(_mixed(), trainer)
    deepspeed = DeepSpeedView(MixedPrecision("bf16-mixed", "cpu"), trainer)
    for plugin in (StablePrecision("bf16-mixed"), FabricStablePrecision("bf16-mixed"), foreign, deepspeed):
        assert isinstance(plugin, PrecisionView), type(plugin).__name__
    for view in (foreign, deepspeed):
        assert not view.can_skip and not view.can_fallback
        for call in (view.skip_step, view.restore_precision, lambda: view.fallback(None, reason="test")):
            with pytest.raises(RuntimeError, match=r"needs StablePrecision; the trainer's precision plugin is"):
                call()

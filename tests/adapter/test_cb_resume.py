"""Every callback's state and the plugin's fallback state survive a checkpoint resume; checkpoints load with
``torch.load(weights_only=True)``."""

from __future__ import annotations

import torch
from cb_helpers import PoisonModule, quiet
from helpers import make_trainer
from trainer_pkg import AMPPreflight, OverflowMonitor, PrecisionFallback, ScaleCheckpoint, StablePrecision, pl

from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler

ModelCheckpoint = pl.callbacks.ModelCheckpoint

# One epoch is 8 steps (checkpoints at epoch ends: Lightning replays a cut epoch). Overflows at 1-3 make
# PrecisionFallback go global at step 4 with a cooldown that ends at step 10, after the checkpoint; a NaN weight at
# 6 rolls back to the snapshot of step 4; the overflow at 9 lands in OverflowMonitor's window after the resume.
FAULTS = dict(inf_grad_steps={1, 2, 3, 9}, n=128, scheduler=True, optimizer="adamw", lr=1e-2)


class _NanWeightAt6(pl.Callback):
    """inf/NaN in the weights at step 6 (a bit flip in memory): ScaleCheckpoint's rollback (it had a loss spike roll
    back, a detector that is gone)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 6:
            with torch.no_grad():
                pl_module.model.fc1.weight.view(-1)[0] = float("nan")


def _plugin() -> StablePrecision:
    return StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**8, growth_interval=2))


def _callbacks() -> list:
    return [
        OverflowMonitor(window=5, log_every_n_steps=1),
        PrecisionFallback(patience=3, cooldown=6),
        ScaleCheckpoint(every_n_steps=4),
        AMPPreflight(),
        _NanWeightAt6(),
    ]


class _StartDtype(pl.Callback):
    """The dtype the model computes in when training (re)starts: after a checkpoint restored the plugin."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.dtype = trainer.precision_plugin.compute_dtype


def _fit(epochs: int, ckpt_path=None, **trainer_kwargs):
    torch.manual_seed(0)
    module, plugin, callbacks = PoisonModule(**FAULTS), _plugin(), _callbacks()
    trainer = make_trainer(plugin, max_steps=-1, max_epochs=epochs, callbacks=[*callbacks, _StartDtype()],
                           log_every_n_steps=1, **trainer_kwargs)
    with quiet():
        trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, module, plugin, callbacks


def test_resume_restores_every_callback_and_the_plugin_exactly(tmp_path) -> None:
    _, full, full_plugin, full_callbacks = _fit(2)
    decisions = full_callbacks[1].decisions
    assert [(d["step"], d["action"]) for d in decisions] == [(4, "fallback"), (10, "restore")]
    assert full_callbacks[2].rollbacks == 1 and full_callbacks[3].result["passed"]

    trainer, _, first_plugin, _ = _fit(1)
    path = tmp_path / "epoch1.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)  # plain values only
    assert first_plugin.compute_dtype == torch.float32  # mid-cooldown at the checkpoint
    states = checkpoint["callbacks"]
    assert {key.split("{")[0] for key in states} == {
        "OverflowMonitor", "PrecisionFallback", "ScaleCheckpoint", "AMPPreflight",
    }
    assert states["PrecisionFallback{'mode': 'global', 'patience': 3}"]["cooldown_end"] == 10
    assert states["ScaleCheckpoint"]["rollbacks"] == 1

    resumed_trainer, resumed, resumed_plugin, resumed_callbacks = _fit(2, ckpt_path=path)
    start = next(cb for cb in resumed_trainer.callbacks if isinstance(cb, _StartDtype))
    assert start.dtype == torch.float32  # the plugin's fallback came back with the checkpoint
    assert resumed_plugin.state_dict() == full_plugin.state_dict()
    assert not resumed_plugin.fallback_active  # the cooldown ended at step 10 in the resumed run too
    for ours, theirs in zip(resumed_callbacks, full_callbacks):
        assert ours.state_dict() == theirs.state_dict(), type(ours).__name__
    for a, b in zip(resumed.parameters(), full.parameters()):
        assert torch.equal(a, b)


def test_model_checkpoint_files_load_weights_only_and_hold_plugin_state(tmp_path) -> None:
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, filename="{step}")
    trainer = make_trainer(_plugin(), max_steps=8, callbacks=[*_callbacks(), saver], enable_checkpointing=True)
    with quiet():
        trainer.fit(PoisonModule(**FAULTS))
    files = sorted(p.name for p in tmp_path.glob("*.ckpt"))
    assert files == ["step=4.ckpt", "step=8.ckpt"]
    for name in files:
        checkpoint = torch.load(tmp_path / name, weights_only=True)
        assert checkpoint["StablePrecision"]["step_count"] == int(name[5])
        assert len(checkpoint["callbacks"]) == 5  # ours and the ModelCheckpoint's
    # Saved after PrecisionFallback's decision at step 4, before its cooldown ended at 10.
    assert torch.load(tmp_path / "step=4.ckpt", weights_only=True)["callbacks"][
        "PrecisionFallback{'mode': 'global', 'patience': 3}"]["cooldown_end"] == 10

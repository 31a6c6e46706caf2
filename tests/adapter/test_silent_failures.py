"""Paths where the plugin used to degrade silently: each test failed before its fix."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import TinyMLP, make_module, make_trainer, regression_data
from torch import nn
from trainer_pkg import StablePrecision, pl

from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler


# ------------------------------------------------------------------------- a scaler built for another device
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_cuda_scaler_is_adopted_onto_the_cpu_run() -> None:
    # The README's old example: DynamicLossScaler("cuda") on a CPU machine. torch would disable it (no scaling).
    plugin = StablePrecision("16-mixed", scaler=DynamicLossScaler("cuda", init_scale=2.0**10))
    module = make_module(poison_steps={1})
    make_trainer(plugin, max_steps=3).fit(module)
    assert plugin.scaler.is_enabled() and plugin.scaler._device == "cpu"
    assert plugin.loss_scale == 2.0**9 and plugin.overflow_count == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_disabled_gradscaler_is_refused_or_taken_as_no_scaling() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own "CUDA is not available. Disabling."
        disabled_by_torch = torch.amp.GradScaler("cuda")
    with pytest.raises(ValueError, match="GradScaler.*CUDA"):
        StablePrecision("16-mixed", scaler=disabled_by_torch)
    with pytest.warns(UserWarning, match="enabled=False"):
        plugin = StablePrecision("16-mixed", scaler=torch.amp.GradScaler("cpu", enabled=False))
    assert plugin.scaler is None and plugin.loss_scale == 1.0


# ---------------------------------------------------------------------- non-finite gradients in BF16 / FP32
class _PoisonBatch(pl.LightningModule):
    """TinyMLP whose training batch at the given optimizer steps holds an inf: every gradient becomes inf/NaN."""

    def __init__(self, poison: set[int], accumulate: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyMLP()
        self.poison, self.x, self.y = poison, *regression_data(64)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.trainer.global_step in self.poison:
            x = x.clone()
            x[0, 0] = float("inf")
        return nn.functional.mse_loss(self.model(x).float(), y)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=8)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true", "bf16-true"])
def test_nan_never_reaches_the_weights_without_a_scaler(precision: str) -> None:
    module = _PoisonBatch({2})
    plugin = StablePrecision(precision)
    assert plugin.scaler is None
    make_trainer(plugin, max_steps=4).fit(module)
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert plugin.overflow_count == 1 and plugin.skipped_steps == 1 and plugin.step_count == 4
    assert module.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**3)  # held once


def test_skip_nonfinite_false_is_lightnings_behaviour() -> None:
    module = _PoisonBatch({2})
    plugin = StablePrecision("bf16-mixed", skip_nonfinite=False)
    make_trainer(plugin, max_steps=3).fit(module)
    assert not all(torch.isfinite(p).all() for p in module.parameters())
    with pytest.raises(ValueError, match="skip_nonfinite"):
        StablePrecision("16-mixed", skip_nonfinite=False)  # a loss scaler always skips


# --------------------------------------------------------------------------- resume with an overflow first
@pytest.mark.parametrize("accumulate", [1, 2])
def test_resume_exact_when_the_first_step_after_resume_overflows(tmp_path, accumulate: int) -> None:
    steps_per_epoch = 4 // accumulate  # 8 batches of 8 samples per epoch
    poison = {steps_per_epoch}  # the first optimizer step of epoch 2

    def fit(module, epochs, ckpt_path=None):
        plugin = StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**8))
        trainer = make_trainer(plugin, max_steps=-1, max_epochs=epochs, accumulate_grad_batches=accumulate)
        trainer.fit(module, ckpt_path=ckpt_path)
        return trainer, plugin

    torch.manual_seed(0)
    full = make_module(scheduler=True, poison_steps=poison, optimizer="adamw", lr=1e-2)
    fit(full, 2)
    torch.manual_seed(0)
    first = make_module(scheduler=True, poison_steps=poison, optimizer="adamw", lr=1e-2)
    trainer, _ = fit(first, 1)
    trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed = make_module(scheduler=True, poison_steps=poison, optimizer="adamw", lr=1e-2)
    _, plugin = fit(resumed, 2, ckpt_path=tmp_path / "epoch1.ckpt")
    assert plugin.overflow_count == 1
    lr = lambda m: m.trainer.optimizers[0].param_groups[0]["lr"]  # noqa: E731
    assert lr(resumed) == lr(full)
    for a, b in zip(resumed.parameters(), full.parameters()):
        assert torch.equal(a, b)


# --------------------------------------------------------------- masters start from the FP32 initial weights
def test_masters_start_from_the_fp32_initial_weights() -> None:
    module = make_module()
    initial = {name: p.detach().clone() for name, p in module.named_parameters()}
    assert any(not torch.equal(p, p.bfloat16().float()) for p in initial.values())  # not representable in BF16
    plugin = StablePrecision("bf16-true")
    masters = {}

    class Grab(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            masters.update({name: m.detach().clone() for name, m, _ in plugin.master.named_pairs()})

    make_trainer(plugin, max_steps=1, callbacks=[Grab()]).fit(module)
    assert set(masters) == set(initial)
    for name, value in initial.items():
        assert torch.equal(masters[name], value), name


# -------------------------------------------------------------------- hooks and clipping see the gradients
class _Hooked(pl.LightningModule):
    """TinyMLP on a fixed batch; records the gradients `on_before_optimizer_step` sees, optionally clips them
    itself (`user_clip`), or in manual optimization calls `self.clip_gradients` before `opt.step()`."""

    def __init__(self, *, user_clip: float | None = None, manual: str | None = None, clip: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyMLP()
        self.user_clip, self.manual, self.clip = user_clip, manual, clip
        self.automatic_optimization = manual is None
        self.x, self.y = regression_data(32)
        self.seen: list[dict[str, torch.Tensor | None]] = []

    def training_step(self, batch, batch_idx):
        loss = nn.functional.mse_loss(self.model(batch[0]).float(), batch[1])
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm=self.manual)
        opt.step()

    def on_before_optimizer_step(self, optimizer) -> None:
        self.seen.append({n: None if p.grad is None else p.grad.detach().float().clone()
                          for n, p in self.named_parameters()})
        if self.user_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.parameters(), self.user_clip)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit(plugin_or_precision, module, **kwargs):
    if isinstance(plugin_or_precision, str):
        trainer = make_trainer(None, precision=plugin_or_precision, **kwargs)
    else:
        trainer = make_trainer(plugin_or_precision, **kwargs)
    trainer.fit(module)
    return module


def test_hooks_see_gradients_with_masters() -> None:
    ours = _fit(StablePrecision("bf16-true"), _Hooked(), max_steps=2)
    theirs = _fit("bf16-true", _Hooked(), max_steps=2)
    assert all(g is not None for g in ours.seen[0].values())
    # The first step's gradients are the same computation in both (same BF16 weights): equal.
    for name, grad in theirs.seen[0].items():
        torch.testing.assert_close(ours.seen[0][name], grad, rtol=0, atol=0)


def test_a_users_own_clip_in_the_hook_takes_effect_with_masters() -> None:
    clipped_by_user = _fit(StablePrecision("bf16-true"), _Hooked(user_clip=0.05), max_steps=3)
    clipped_by_trainer = _fit(StablePrecision("bf16-true"), _Hooked(), max_steps=3, gradient_clip_val=0.05)
    unclipped = _fit(StablePrecision("bf16-true"), _Hooked(), max_steps=3)
    w = lambda m: m.model.fc2.weight.detach().float()  # noqa: E731
    assert not torch.allclose(w(clipped_by_user), w(unclipped))
    # The user's clip acts on 16-bit grads, the trainer's on FP32 master grads: the same within BF16 rounding.
    torch.testing.assert_close(w(clipped_by_user), w(clipped_by_trainer), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize("precision", ["bf16-true", "16-mixed"])
def test_manual_clip_gradients_before_step_is_applied(precision: str, algorithm: str) -> None:
    clip = 0.05 if algorithm == "norm" else 0.002
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FP16 on the CPU is emulated: warned
        manual = _fit(StablePrecision(precision), _Hooked(manual=algorithm, clip=clip), max_steps=2)
        auto = _fit(StablePrecision(precision), _Hooked(), max_steps=2, gradient_clip_val=clip,
                    gradient_clip_algorithm=algorithm)
        unclipped = _fit(StablePrecision(precision), _Hooked(), max_steps=2)
    w = lambda m: m.model.fc2.weight.detach().float()  # noqa: E731
    assert not torch.allclose(w(auto), w(unclipped))
    torch.testing.assert_close(w(manual), w(auto), rtol=0, atol=0)


# ------------------------------------------------------------------------- blame: a poisoned batch is data
def test_a_nonfinite_batch_is_blamed_on_the_data_not_on_a_layer() -> None:
    from trainer_pkg import PrecisionFallback

    module = _PoisonBatch(set())
    module.x[8:32:8, 0] = float("inf")  # the data itself: the first sample of batches 1, 2 and 3
    plugin = StablePrecision("bf16-mixed")
    fallback = PrecisionFallback(patience=2, mode="module")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(plugin, max_steps=5, callbacks=[fallback]).fit(module)
    assert plugin.overflow_count == 3
    assert plugin.stats["nonfinite_input"] is True and plugin.stats["blamed_modules"] == []
    assert not plugin.fallback_active and fallback.decisions == []  # no layer moved to FP32 for bad data


# ------------------------------------------------------------------------- FP8 that would do nothing is refused
def test_fp8_on_a_model_without_an_eligible_layer_is_refused() -> None:
    class TwoLinears(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)  # first and last: the default filter skips both

        def training_step(self, batch, batch_idx):
            return self.b(self.a(batch[0])).float().pow(2).mean()

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 16)), batch_size=8)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    plugin = StablePrecision("bf16-mixed", fp8="delayed")
    with pytest.raises(ValueError, match="no nn.Linear layer of TwoLinears is eligible"):
        plugin.validate(TwoLinears())
    with pytest.raises(ValueError, match="eligible"):
        make_trainer(plugin, max_steps=1).fit(TwoLinears())


# ------------------------------------------------------------------------------------------------ small things
def test_the_plugin_reads_like_its_call() -> None:
    assert repr(StablePrecision()) == "StablePrecision('bf16-mixed')"
    assert repr(StablePrecision("16-mixed", scaler="adaptive", fp32_modules=["head"])) == (
        "StablePrecision('16-mixed', scaler='adaptive', fp32_modules=['head'])")
    with pytest.raises(Exception, match=r"StablePrecision\('bf16-mixed'\)"):  # Lightning's own refusal shows it
        pl.Trainer(precision="16-mixed", plugins=[StablePrecision()])

"""StablePrecision("bf16-true" | "16-true") with FP32 master weights, in real Lightning runs on the CPU: the masters
start from the FP32 initial weights; hooks and clipping (the user's own, manual) see the gradients."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import TinyMLP, make_module, make_trainer, regression_data, stall_task
from torch import nn
from trainer_pkg import StablePrecision, pl


class _Stall(pl.LightningModule):
    """Full-batch linear regression whose SGD updates are below half a BF16 ulp (see helpers.stall_task)."""

    def __init__(self, lr: float = 0.005) -> None:
        super().__init__()
        self.x, self.y, w0 = stall_task()
        self.lin = nn.Linear(16, 16, bias=False)
        with torch.no_grad():
            self.lin.weight.copy_(w0)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.lin(x).float() - y) ** 2).sum(1).mean()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=64)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    @torch.no_grad()
    def fp32_loss(self) -> float:
        return ((self.x @ self.lin.weight.float().T - self.y) ** 2).sum(1).mean().item()


def _fit_stall(plugin: StablePrecision | None, precision: str | None = None, steps: int = 60) -> tuple[float, _Stall]:
    module = _Stall()
    kwargs = dict(max_steps=steps, max_epochs=-1)
    if precision is not None:
        kwargs["precision"] = precision
    make_trainer(plugin, **kwargs).fit(module)
    return module.fp32_loss(), module


def test_bf16_true_stalls_without_masters_and_matches_fp32_with_them() -> None:
    start = _Stall().fp32_loss()
    fp32, _ = _fit_stall(StablePrecision("32-true"))
    plain, plain_module = _fit_stall(StablePrecision("bf16-true", master_weights=False))
    lightning_plain, _ = _fit_stall(None, precision="bf16-true")
    mastered, mastered_module = _fit_stall(StablePrecision("bf16-true"))
    print(f"\n[bf16-true stall] start {start:.4f} fp32 {fp32:.4f} plain {plain:.4f} lightning {lightning_plain:.4f} "
          f"masters {mastered:.4f}")
    assert plain == pytest.approx(start, rel=1e-6)  # not a single weight moved
    assert lightning_plain == plain  # master_weights=False is Lightning's own bf16-true
    assert plain_module.lin.weight.dtype == mastered_module.lin.weight.dtype == torch.bfloat16
    assert fp32 < 0.5 * start
    assert mastered == pytest.approx(fp32, rel=0.01)


class _Groups(pl.LightningModule):
    """Two param groups, a frozen layer, an FP32 island, AdamW + a step scheduler, optional poisoned steps."""

    def __init__(self, poison: set[int] = frozenset()) -> None:
        super().__init__()
        self.net = TinyMLP()
        self.norm = nn.LayerNorm(16)
        self.net.fc1.requires_grad_(False)
        self.poison = poison
        self.x, self.y = regression_data(64)
        self.grad_dtypes: list[torch.dtype] = []

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.norm(self.net(batch[0])).float(), batch[1])

    def on_after_backward(self) -> None:
        if self.trainer.global_step in self.poison:
            self.net.fc2.weight.grad.view(-1)[0] = float("inf")

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=16)

    def configure_optimizers(self):
        groups = [
            {"params": [p for n, p in self.net.named_parameters() if p.requires_grad], "lr": 1e-2},
            {"params": self.norm.parameters(), "lr": 1e-3, "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return [opt], [{"scheduler": sched, "interval": "step"}]


def test_groups_frozen_islands_clipping_and_fp32_state() -> None:
    module = _Groups()
    plugin = StablePrecision("bf16-true", fp32_modules=[nn.LayerNorm])
    seen = []

    class Probe(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            seen.append({p.grad.dtype for g in optimizer.param_groups for p in g["params"] if p.grad is not None})

    make_trainer(plugin, max_steps=4, gradient_clip_val=0.5, callbacks=[Probe()]).fit(module)
    opt = module.trainer.optimizers[0]
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-2 * 0.25, 1e-3 * 0.25])
    assert module.net.fc2.weight.dtype == torch.bfloat16 and module.net.fc1.weight.dtype == torch.bfloat16
    assert module.norm.weight.dtype == torch.float32  # island stays FP32 and is optimized directly
    assert seen == [{torch.float32}] * 4  # hooks and clipping see FP32 (master) gradients
    for state in opt.state.values():
        assert state["exp_avg"].dtype == torch.float32
    names = set(plugin.state_dict()["masters"])
    assert names == {"net.fc2.weight", "net.fc2.bias", "net.fc3.weight", "net.fc3.bias"}  # frozen fc1: no master
    report = plugin.memory_report()
    assert report["masters"] == sum(4 * module.get_parameter(n).numel() for n in names)
    params = list(module.parameters())
    assert report["weights"] == sum(p.numel() * p.element_size() for p in params)
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    assert report["optimizer_state"] == sum(v.numel() * v.element_size() for v in states)
    assert report["compensation"] == 0 and report["total"] == sum(v for k, v in report.items() if k != "total")


def test_16_true_skips_on_overflow_and_masters_unchanged() -> None:
    module = _Groups(poison={1})
    plugin = StablePrecision("16-true", fp32_modules=[nn.LayerNorm])
    masters = []

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            masters.append(plugin.state_dict()["masters"]["net.fc2.weight"].clone())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(plugin, max_steps=3, callbacks=[Probe()]).fit(module)
    assert plugin.overflow_count == 1 and plugin.loss_scale == 2.0**14  # 16-true starts at 2**15, one backoff
    assert torch.equal(masters[0], masters[1]) and not torch.equal(masters[1], masters[2])
    assert torch.equal(module.net.fc2.weight, masters[2].half())  # 16-bit weights follow the masters


def test_resume_is_bit_exact_and_checkpoint_holds_fp32_masters(tmp_path) -> None:
    def fit(module, epochs, ckpt=None):
        plugin = StablePrecision("bf16-true")
        trainer = make_trainer(plugin, max_steps=-1, max_epochs=epochs)
        trainer.fit(module, ckpt_path=ckpt)
        return trainer, plugin

    torch.manual_seed(0)
    full = make_module(optimizer="adamw", scheduler=True, lr=1e-2)
    _, full_plugin = fit(full, 2)
    torch.manual_seed(0)
    first = make_module(optimizer="adamw", scheduler=True, lr=1e-2)
    trainer, first_plugin = fit(first, 1)
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    checkpoint = torch.load(tmp_path / "mid.ckpt", weights_only=True)
    saved = checkpoint["StablePrecision"]["masters"]["model.fc2.weight"]
    assert saved.dtype == torch.float32 and not torch.equal(saved, saved.bfloat16().float())  # not rounded
    opt_state = checkpoint["optimizer_states"][0]["state"][0]
    assert opt_state["exp_avg"].dtype == torch.float32

    resumed = make_module(optimizer="adamw", scheduler=True, lr=1e-2)
    _, resumed_plugin = fit(resumed, 2, tmp_path / "mid.ckpt")
    for name, master in full_plugin.state_dict()["masters"].items():
        assert torch.equal(master, resumed_plugin.state_dict()["masters"][name]), name
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)



@pytest.mark.parametrize("weights", [dict(), dict(optimizer_state="bf16"), dict(master_weights="kahan"),
                                     dict(master_weights="kahan", optimizer_state="bf16")])
def test_validate_test_and_predict_load_a_checkpoint_written_with_master_weights(tmp_path, weights: dict) -> None:
    """Lightning restores the plugin's state for every stage, not only ``fit``: outside fit no optimizer is bound, and
    the masters (or compensation) wait for one instead of being refused as another model's. The evaluation runs on the
    checkpoint's 16-bit weights, as Lightning's own bf16-true does."""

    class Evaluated(type(make_module())):  # type: ignore[misc]
        def validation_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self(x).float(), y)
            self.log("val_loss", loss)
            return loss

        def test_step(self, batch, batch_idx):
            return self.validation_step(batch, batch_idx)

        def predict_step(self, batch, batch_idx):
            return self(batch[0])

    torch.manual_seed(0)
    module = Evaluated(optimizer="adamw", lr=1e-2)
    loader = module.train_dataloader()
    trainer = make_trainer(StablePrecision("bf16-true", **weights), max_steps=4)
    trainer.fit(module)
    trainer.save_checkpoint(tmp_path / "fit.ckpt")
    (expected,) = trainer.validate(module, loader, verbose=False)
    (same_trainer,) = trainer.test(module, loader, ckpt_path=tmp_path / "fit.ckpt", verbose=False)
    assert same_trainer["val_loss"] == expected["val_loss"]
    fresh = make_trainer(StablePrecision("bf16-true", **weights))
    (validated,) = fresh.validate(Evaluated(), loader, ckpt_path=tmp_path / "fit.ckpt", verbose=False)
    assert validated["val_loss"] == expected["val_loss"]
    predicted = make_trainer(StablePrecision("bf16-true", **weights)).predict(
        Evaluated(), loader, ckpt_path=tmp_path / "fit.ckpt")
    assert torch.equal(torch.cat(predicted), torch.cat(trainer.predict(module, loader)))

def test_loading_a_plain_fp32_checkpoint_keeps_its_fp32_values(tmp_path) -> None:
    torch.manual_seed(0)
    source = make_module(optimizer="adamw", lr=1e-2)
    trainer = make_trainer(StablePrecision("32-true"), max_steps=-1, max_epochs=1)
    trainer.fit(source)
    trainer.save_checkpoint(tmp_path / "fp32.ckpt")
    fp32_weight = source.model.fc2.weight.detach().clone()

    target = make_module(optimizer="adamw", lr=1e-2)
    plugin = StablePrecision("bf16-true")
    masters_at_start = []

    class Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            masters_at_start.append(plugin.state_dict()["masters"]["model.fc2.weight"].clone())

    make_trainer(plugin, max_steps=-1, max_epochs=2, callbacks=[Probe()]).fit(target, ckpt_path=tmp_path / "fp32.ckpt")
    assert torch.equal(masters_at_start[0], fp32_weight)  # the FP32 values, not their BF16 rounding


def test_plain_true_mode_matches_lightning() -> None:
    torch.manual_seed(0)
    ours = make_module(optimizer="adamw", lr=1e-2)
    make_trainer(StablePrecision("bf16-true", master_weights=False), max_steps=4).fit(ours)
    torch.manual_seed(0)
    theirs = make_module(optimizer="adamw", lr=1e-2)
    make_trainer(None, precision="bf16-true", max_steps=4).fit(theirs)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


class _Unfreeze(pl.LightningModule):
    """fc1 starts frozen; at step 2 it is unfrozen, in the optimizer already or through add_param_group."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.net, self.how = TinyMLP(), how
        self.net.fc1.requires_grad_(False)
        self.x, self.y = regression_data(64)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]).float(), batch[1])

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self.trainer.global_step == 2 and not self.net.fc1.weight.requires_grad:
            self.net.fc1.requires_grad_(True)
            if self.how == "add_param_group":
                self.trainer.optimizers[0].add_param_group({"params": list(self.net.fc1.parameters()), "lr": 1e-2})

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=16)

    def configure_optimizers(self):
        params = self.parameters() if self.how == "in_optimizer" else [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=1e-2)


@pytest.mark.parametrize("how", ["in_optimizer", "add_param_group"])
@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_parameters_unfrozen_later_get_masters(precision: str, how: str) -> None:
    module = _Unfreeze(how)
    plugin = StablePrecision(precision)
    before = module.net.fc1.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(plugin, max_steps=4).fit(module)
    masters = plugin.state_dict()["masters"]
    assert "net.fc1.weight" in masters and masters["net.fc1.weight"].dtype == torch.float32
    assert not torch.equal(before.to(module.net.fc1.weight.dtype), module.net.fc1.weight)  # it trains after unfreezing


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


class _Discards(pl.LightningModule):
    """Manual optimization that runs a backward it then discards with ``opt.zero_grad()`` (a GAN's generator loss
    reaching the discriminator, a batch judged bad after its backward) before the backward it steps on."""

    def __init__(self, discard: bool, set_to_none: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyMLP()
        self.discard, self.set_to_none = discard, set_to_none
        self.automatic_optimization = False
        self.x, self.y = regression_data(48)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        if self.discard:
            self.manual_backward(nn.functional.mse_loss(self.model(x).float() * 3, y))
            opt.zero_grad(set_to_none=self.set_to_none)
        self.manual_backward(nn.functional.mse_loss(self.model(x).float(), y))
        opt.step()
        opt.zero_grad(set_to_none=self.set_to_none)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=16)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_optimizer_zero_grad_drops_the_model_gradients_a_discarded_backward_left(set_to_none: bool) -> None:
    """The optimizer steps the FP32 masters, yet ``optimizer.zero_grad()`` clears the model's 16-bit gradients too, as
    with Lightning's own bf16-true: a backward discarded by it does not leak into the next step."""
    weights = []
    for discard in (False, True):
        module = _Discards(discard, set_to_none)
        make_trainer(StablePrecision("bf16-true"), max_steps=3).fit(module)
        weights.append(torch.cat([p.detach().float().flatten() for p in module.parameters()]))
    assert torch.equal(weights[0], weights[1])


class _Backbone(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Linear(16, 16)
        self.x, self.y = regression_data(32)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.backbone(x)).float(), y)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=16)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _unfreezing():
    class Unfreeze(pl.callbacks.BaseFinetuning):
        def freeze_before_training(self, pl_module) -> None:
            self.freeze(pl_module.backbone)

        def finetune_function(self, pl_module, current_epoch, optimizer) -> None:
            if current_epoch == 1:
                self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=1e-2)

    return Unfreeze()


def test_lightnings_finetuning_callbacks_are_refused_with_fp32_masters_and_train_with_kahan_weights() -> None:
    """BaseFinetuning (BackboneFinetuning) maps the optimizer's parameters to the model's by identity, and FP32 masters
    stand in the optimizer for the model's parameters: refused at setup, naming the modes that work, rather than a
    KeyError from inside Lightning at the first epoch. With Kahan weights the optimizer holds the model's parameters."""
    with pytest.raises(ValueError, match="BaseFinetuning.*master_weights='kahan'"):
        make_trainer(StablePrecision("bf16-true"), max_epochs=3, max_steps=-1, callbacks=[_unfreezing()]).fit(
            _Backbone())
    module = _Backbone()
    before = module.backbone[0].weight.detach().float().clone()
    make_trainer(StablePrecision("bf16-true", master_weights="kahan"), max_epochs=3, max_steps=-1,
                 callbacks=[_unfreezing()]).fit(module)
    assert not torch.equal(module.backbone[0].weight.float(), before)  # unfrozen at epoch 1, then trained


class _ToggledGAN(pl.LightningModule):
    """Lightning's GAN loop (manual optimization, ``toggle_optimizer``): the generator's loss runs through the
    discriminator, whose parameters the toggle freezes. ``clear``: the discriminator's gradients cleared by hand before
    its backward as well (the reference: nothing may be left there)."""

    def __init__(self, clear: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.G = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
        self.D = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        self.clear, self.automatic_optimization = clear, False
        self.real = torch.randn(12, 8)

    def training_step(self, batch, batch_idx):
        (real,) = batch
        real = real.to(self.G[0].weight.dtype)
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], 4, dtype=real.dtype, generator=torch.Generator().manual_seed(batch_idx))
        self.toggle_optimizer(opt_d)
        if self.clear:
            self.D.zero_grad()
        loss_d = (nn.functional.softplus(-self.D(real)).mean()
                  + nn.functional.softplus(self.D(self.G(z).detach())).mean())
        self.manual_backward(loss_d.float())
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.toggle_optimizer(opt_g)
        self.manual_backward(nn.functional.softplus(-self.D(self.G(z))).mean().float())
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.real), batch_size=3)

    def configure_optimizers(self):
        return [torch.optim.Adam(self.G.parameters(), lr=1e-3), torch.optim.Adam(self.D.parameters(), lr=1e-3)]


def test_toggle_optimizer_keeps_the_generators_loss_out_of_the_discriminators_step() -> None:
    """``toggle_optimizer`` freezes what the other optimizers hold, the masters here: the generator's backward still
    writes the discriminator's 16-bit gradients, which must not reach its next step."""
    weights = []
    for clear in (False, True):
        module = _ToggledGAN(clear)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            make_trainer(StablePrecision("bf16-true"), max_steps=4).fit(module)
        weights.append(torch.cat([p.detach().float().flatten() for p in module.D.parameters()]))
    assert torch.equal(weights[0], weights[1])


def test_masters_start_from_the_fp32_weights_after_a_validate_before_the_fit() -> None:
    """``trainer.validate(model)`` (or ``lr_find``) before ``fit`` sets the model up in 16 bits first and binds no
    optimizer: the fit's masters still start from the FP32 initialisation, so the fit equals one without it."""

    class Validated(type(make_module())):  # type: ignore[misc]
        def validation_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self(x).float(), y)

    results = []
    for validate_first in (False, True):
        torch.manual_seed(0)
        module = Validated(optimizer="adamw", lr=1e-2)
        trainer = make_trainer(StablePrecision("bf16-true"), max_steps=3)
        if validate_first:
            trainer.validate(module, module.train_dataloader(), verbose=False)
        trainer.fit(module)
        results.append({k: v.clone() for k, v in trainer.precision_plugin.state_dict()["masters"].items()})
    for name, master in results[0].items():
        assert torch.equal(master, results[1][name]), name


@pytest.mark.parametrize("weights", [dict(), dict(master_weights="kahan")])
def test_a_fit_after_a_validate_of_a_checkpoint_starts_from_its_own_model(tmp_path, weights: dict) -> None:
    """``trainer.validate(ckpt_path=X)`` and then ``trainer.fit(new_model)`` on the same Trainer: the checkpoint's
    masters (or compensation), which the validate did not need, do not reach the new model's fit."""

    class Validated(type(make_module())):  # type: ignore[misc]
        def validation_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self(x).float(), y)

    torch.manual_seed(1)
    first = Validated(optimizer="adamw", lr=1e-2)
    trainer = make_trainer(StablePrecision("bf16-true", **weights), max_steps=3)
    trainer.fit(first)
    trainer.save_checkpoint(tmp_path / "x.ckpt")
    results = []
    for validate_first in (False, True):
        torch.manual_seed(0)
        module = Validated(optimizer="adamw", lr=1e-2)
        trainer = make_trainer(StablePrecision("bf16-true", **weights), max_steps=3)
        if validate_first:
            trainer.validate(Validated(), module.train_dataloader(), ckpt_path=tmp_path / "x.ckpt", verbose=False)
        trainer.fit(module)
        results.append(torch.cat([p.detach().float().flatten() for p in module.parameters()]))
    assert torch.equal(results[0], results[1])

"""StablePrecision in real Lightning runs on the CPU: hook order, skips, LR hold, islands, resume; paths where the
plugin used to degrade silently (a scaler built for another device, non-finite gradients without a scaler, a
poisoned batch blamed on the data, resume when the first step overflows, FP8 that would do nothing)."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import TinyMLP, make_module, make_trainer, regression_data
from torch import nn
from trainer_pkg import StablePrecision, pl

from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler


# ----------------------------------------------------------------------------------------------- construction
@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(precision="fp16"), "precision"),
        (dict(precision="16-mixed", scaler="magic"), "scaler"),
        (dict(precision="bf16-mixed", scaler="dynamic"), "scaler"),
        (dict(op_policy="fastest"), "op_policy"),
        (dict(device="tpu"), "device"),
        (dict(scaler=object()), "scaler"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        StablePrecision(**kwargs)


def test_the_docstring_is_written_once_and_names_every_argument_and_mode() -> None:
    import inspect
    from typing import get_args

    import lit_mpstable.fabric
    import lit_mpstable.plugin
    from lit_mpstable.core.step.stepper import MasterMode
    from lit_mpstable.fp8.config import FP8Recipe

    trainer_doc, fabric_doc = lit_mpstable.plugin.StablePrecision.__doc__, lit_mpstable.fabric.StablePrecision.__doc__
    assert trainer_doc and fabric_doc
    args = trainer_doc[trainer_doc.index("    Args:"):]
    assert fabric_doc.endswith(args)  # one Args section, shared; the Fabric class adds only its loop notes before it
    assert fabric_doc.count("    Args:") == 1
    for name in inspect.signature(StablePrecision.__init__).parameters:
        assert name == "self" or f"        {name}: " in args, name
    for value in (*get_args(MasterMode), *get_args(FP8Recipe)):
        assert f"``\"{value}\"``" in args, value


def test_defaults_per_precision() -> None:
    assert StablePrecision("16-mixed").scaler is not None
    assert StablePrecision("bf16-mixed").scaler is None
    assert StablePrecision("32-true").loss_scale == 1.0
    assert StablePrecision("auto", device="cpu").precision == "bf16-mixed"
    assert isinstance(StablePrecision("16-mixed", scaler="static").scaler, DynamicLossScaler)
    assert StablePrecision("16-mixed", scaler=None).scaler is None


# ------------------------------------------------------------------------------- equivalence with a raw loop
class _Exact(pl.LightningModule):
    """TinyMLP in 16-mixed with an explicit scaler: results must equal a hand-written AMP loop (autocast+GradScaler)."""

    def __init__(self, accumulate: int = 1, poison: set[int] = frozenset()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyMLP()
        self.poison = poison
        self.x, self.y = regression_data(64)
        self.seen_grad_norms: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def on_after_backward(self) -> None:
        if self.trainer.global_step in self.poison:
            self.model.fc2.weight.grad.view(-1)[0] = float("inf")

    def on_before_optimizer_step(self, optimizer) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.seen_grad_norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=8)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _raw_loop(steps: int, accumulate: int, poison: set[int], clip: float | None):
    """The reference: the PyTorch AMP recipe written by hand (unscale, clip, step, update, scheduler if applied)."""
    torch.manual_seed(0)
    model = TinyMLP()
    x, y = regression_data(64)
    loader = list(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    norms, lrs = [], []
    batches = iter(loader)
    for step in range(steps):
        for _ in range(accumulate):
            bx, by = next(batches)
            with torch.autocast("cpu", dtype=torch.float16):  # "16-mixed" (a loss scaler is for FP16 only)
                loss = nn.functional.mse_loss(model(bx), by) / accumulate
            scaler.scale(loss).backward()
        if step in poison:
            model.fc2.weight.grad.view(-1)[0] = float("inf")
        scaler.unscale_(opt)
        norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        lrs.append(opt.param_groups[0]["lr"])  # the lr this step uses
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if not (scaler.get_scale() < before):  # held on skipped steps, as StablePrecision does
            sched.step()
        opt.zero_grad()
    return model, scaler, norms, lrs


@pytest.mark.parametrize("accumulate, clip", [(1, None), (2, 0.05)])
def test_matches_hand_written_amp_loop(accumulate: int, clip: float | None) -> None:
    steps, poison = 4, {1}
    module = _Exact(poison=poison)
    plugin = StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**10, growth_interval=3))
    lrs = []

    class RecordLR(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            lrs.append(optimizer.param_groups[0]["lr"])  # the lr this step uses

    trainer = make_trainer(
        plugin, max_steps=steps, accumulate_grad_batches=accumulate, gradient_clip_val=clip, callbacks=[RecordLR()]
    )
    trainer.fit(module)
    ref_model, ref_scaler, ref_norms, ref_lrs = _raw_loop(steps, accumulate, poison, clip)

    # on_before_optimizer_step saw the unscaled gradients (scaled ones would be 2**10 times larger).
    assert module.seen_grad_norms == pytest.approx(ref_norms, rel=1e-6)
    for ours, ref in zip(module.model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
    assert plugin.loss_scale == ref_scaler.get_scale()
    assert plugin.overflow_count == 1 and plugin.step_count == steps
    assert lrs == pytest.approx(ref_lrs)


# ------------------------------------------------------------------------------------------- skip behaviour
def test_lr_schedule_held_on_skipped_steps() -> None:
    module = make_module(scheduler=True, poison_steps={1, 2})
    plugin = StablePrecision("16-mixed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(plugin, max_steps=4).fit(module)
    # StepLR halves the lr on every *applied* step: 4 steps, 2 skipped -> 2 halvings (Lightning's plugin: 4).
    assert plugin.overflow_count == 2
    assert module.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**2)
    assert plugin.loss_scale == 2.0**14


class _SkipsBatches(_Exact):
    """``training_step`` returns None on every fourth batch (Lightning's way to skip a batch)."""

    def training_step(self, batch, batch_idx):
        return None if batch_idx % 4 == 1 else super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer) -> None:
        pass  # Lightning calls it after a skipped batch too, with no gradients


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_a_batch_the_user_skips_moves_the_lr_schedule_as_lightning_does(precision: str) -> None:
    """The schedule holds on the steps the plugin skips (inf/NaN, spikes), not on those the user skips: a None from
    ``training_step`` steps the scheduler in Lightning's own run, so it does here (32-true: the same weights too)."""

    def fit(plugin=None, **kwargs):
        module = _SkipsBatches()
        trainer = make_trainer(plugin, max_steps=8, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module)
        return module, trainer.lr_scheduler_configs[0].scheduler

    builtin, builtin_schedule = fit(precision="32-true")
    ours, schedule = fit(StablePrecision(precision))
    assert schedule.last_epoch == builtin_schedule.last_epoch == 8
    assert ours.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.9**8)
    if precision == "32-true":
        for mine, theirs in zip(ours.parameters(), builtin.parameters()):
            assert torch.equal(mine, theirs)


class _SkipsWindowEnds(_Exact):
    """``training_step`` returns None on the last micro-batch of every second window (accumulating two)."""

    def training_step(self, batch, batch_idx):
        return None if batch_idx % 4 == 1 else super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer) -> None:
        pass


@pytest.mark.parametrize("precision, clip", [("32-true", None), ("bf16-mixed", None), ("16-mixed", None),
                                             ("32-true", 1e-3), ("bf16-mixed", 1e-3), ("16-mixed", 1e-3)])
def test_a_none_that_ends_an_accumulation_window_steps_on_its_gradients_as_lightning_does(precision: str,
                                                                                          clip: float | None) -> None:
    """Lightning steps the optimizer after a None from a window's last micro-batch, on the gradients the earlier ones
    accumulated, clipped as any step's (``gradient_clip_val``); its 16-mixed drops them (GradScaler's step is
    skipped). The same weights after every batch, and the same schedule."""

    def fit(plugin=None, **kwargs):
        module, weights = _SkipsWindowEnds(), []

        class Record(pl.Callback):
            def on_train_batch_end(self, trainer, pl_module, *args) -> None:
                weights.append(pl_module.model.fc2.weight.detach().clone())

        trainer = make_trainer(plugin, max_steps=4, accumulate_grad_batches=2, callbacks=[Record()],
                               gradient_clip_val=clip, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module)
        return weights, trainer.lr_scheduler_configs[0].scheduler

    ours, schedule = fit(StablePrecision(precision))
    if precision == "16-mixed":  # Lightning's 16-mixed autocasts to BF16 on the CPU: nothing to compare with
        assert torch.equal(ours[1], ours[0]) and not torch.equal(ours[3], ours[1])  # window 0 dropped, window 1 not
        assert schedule.last_epoch == 4
        return
    builtin, builtin_schedule = fit(precision=precision)
    assert schedule.last_epoch == builtin_schedule.last_epoch == 4
    assert not torch.equal(builtin[1], builtin[0])  # Lightning stepped on window 0's first micro-batch
    for mine, theirs in zip(ours, builtin, strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_fused_optimizer_skips_are_detected(optimizer: str) -> None:
    module = make_module(optimizer=optimizer, scheduler=True, poison_steps={2}, lr=1e-3)
    plugin = StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=256.0))
    skipped, weights = [], []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            skipped.append(plugin.last_step_skipped)
            weights.append(pl_module.model.fc2.weight.detach().clone())

    make_trainer(plugin, max_steps=4, gradient_clip_val=1.0, callbacks=[Record()]).fit(module)
    assert skipped == [False, False, True, False]
    assert torch.equal(weights[1], weights[2])  # the poisoned step changed nothing
    assert module.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5**3)


def test_real_fp16_autocast_on_cpu_warns_once() -> None:
    dtypes = []

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            with trainer.precision_plugin.forward_context():
                dtypes.append(pl_module(batch[0]).dtype)

    plugin = StablePrecision("16-mixed")
    with pytest.warns(UserWarning, match="FP16 arithmetic is emulated") as record:
        make_trainer(plugin, max_steps=2, callbacks=[Probe()]).fit(make_module())
    assert dtypes == [torch.float16, torch.float16]  # not silently BF16 as Lightning's "16-mixed" on CPU
    (message,) = [str(w.message) for w in record if "emulated" in str(w.message)]
    # A figure we measured, and where (not an unmeasured "~100x").
    assert "~100x" not in message and "12.6x" in message and "nanoGPT" in message


class _TwoOptimizers(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a, self.b = TinyMLP(), TinyMLP()
        self.x, self.y = regression_data(32)

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        for net, opt in ((self.a, opt_a), (self.b, opt_b)):
            loss = nn.functional.mse_loss(net(batch[0]).float(), batch[1])
            opt.zero_grad()
            self.manual_backward(loss)
            if net is self.b and self.global_step in (1, 2):  # global_step counts both optimizers' steps
                self.b.fc1.weight.grad.view(-1)[0] = float("nan")
            opt.step()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)


def test_manual_optimization_with_two_optimizers() -> None:
    module = _TwoOptimizers()
    b_before = module.b.fc1.weight.detach().clone()
    plugin = StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=64.0))
    make_trainer(plugin, max_steps=4).fit(module)  # max_steps counts both optimizers: 2 batches
    assert plugin.step_count == 4
    assert plugin.overflow_count == 1  # b's step in the first batch saw global_step 1
    assert plugin.loss_scale == 32.0
    assert not torch.equal(b_before, module.b.fc1.weight)  # b still trained on its clean step


# ----------------------------------------------------------------------------------------------- islands
class _WithNorm(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = TinyMLP()
        self.norm = nn.LayerNorm(16)
        self.seen: dict[str, torch.dtype] = {}
        self.body.fc2.register_forward_hook(lambda m, i, o: self.seen.__setitem__("fc2", o.dtype))
        self.norm.register_forward_hook(lambda m, i, o: self.seen.__setitem__("norm_in", i[0].dtype))
        self.x, self.y = regression_data(16)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.norm(self.body(batch[0])).float(), batch[1])

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("spec", [nn.LayerNorm, "norm", "body.fc2"])
def test_fp32_islands(spec) -> None:
    module = _WithNorm()
    make_trainer(StablePrecision("bf16-mixed", fp32_modules=[spec]), max_steps=1).fit(module)
    if spec == "body.fc2":
        assert module.seen["fc2"] == torch.float32  # autocast off inside the island
    else:
        assert module.seen["fc2"] == torch.bfloat16
        # The island's hook sees the input after the pre-hook cast it up.
        assert module.seen["norm_in"] == torch.float32


def test_fp32_islands_stale_pattern_is_an_error() -> None:
    with pytest.raises(ValueError, match="match no module"):
        make_trainer(StablePrecision("bf16-mixed", fp32_modules=["encoder.*"]), max_steps=1).fit(_WithNorm())


# ------------------------------------------------------------------------------------------------ resume
@pytest.mark.parametrize("saved, resumed", [("dynamic", "adaptive"), ("adaptive", "dynamic"), ("adaptive", "static")])
def test_a_resume_with_another_kind_of_loss_scaler_carries_the_scale(tmp_path, saved: str, resumed: str) -> None:
    """A run that keeps overflowing is resumed with ``scaler="adaptive"`` (or back): the scale and the counters carry
    over, the new scaler's own settings and state start fresh, and it is said (a StateKeyError naming private keys
    before)."""
    first = make_trainer(StablePrecision("16-mixed", scaler=saved), max_steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first.fit(make_module(optimizer="adamw"))
    first.save_checkpoint(tmp_path / "saved.ckpt")
    seen = []

    class Scale(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            seen.append(trainer.precision_plugin.loss_scale)

    plugin = StablePrecision("16-mixed", scaler=resumed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(plugin, max_steps=6, callbacks=[Scale()]).fit(make_module(optimizer="adamw"),
                                                                   ckpt_path=tmp_path / "saved.ckpt")
    assert seen == [first.precision_plugin.loss_scale]
    assert plugin.step_count == 6 and plugin.scaler.state_dict()["step_count"] == 6


def test_resume_reproduces_the_uninterrupted_run(tmp_path) -> None:
    poison = {1, 5}  # one epoch is 4 steps: checkpoint after a whole epoch (Lightning replays a cut epoch)

    def plugin():
        scaler = DynamicLossScaler("cpu", init_scale=2.0**8, growth_interval=2, hysteresis=2)
        return StablePrecision("16-mixed", scaler=scaler)

    full_plugin = plugin()
    torch.manual_seed(0)
    full = make_module(scheduler=True, poison_steps=poison)
    make_trainer(full_plugin, max_steps=-1, max_epochs=2).fit(full)

    first_plugin = plugin()
    torch.manual_seed(0)
    first = make_module(scheduler=True, poison_steps=poison)
    trainer = make_trainer(first_plugin, max_steps=-1, max_epochs=1)
    trainer.fit(first)
    path = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)  # plain tensors and scalars only
    saved = checkpoint["StablePrecision"]["scaler"]["_hysteresis_tracker"]
    assert saved == first_plugin.scaler.state_dict()["_hysteresis_tracker"]

    resumed_plugin = plugin()
    resumed = make_module(scheduler=True, poison_steps=poison)
    make_trainer(resumed_plugin, max_steps=-1, max_epochs=2).fit(resumed, ckpt_path=path)
    assert resumed_plugin.state_dict() == full_plugin.state_dict()
    for a, b in zip(resumed.parameters(), full.parameters()):
        assert torch.equal(a, b)


def test_load_state_dict_is_strict() -> None:
    plugin = StablePrecision("16-mixed")
    state = plugin.state_dict()
    with pytest.raises(KeyError, match="step_count"):
        plugin.load_state_dict({k: v for k, v in state.items() if k != "step_count"})
    # A precision switch on resume loads: counters come over, the FP16 scaler keeps its fresh state.
    bf16 = StablePrecision("bf16-mixed")
    bf16.stepper.step_count = 7
    plugin.load_state_dict(bf16.state_dict())
    assert plugin.step_count == 7 and plugin.loss_scale == 2.0**16


def test_a_plain_gradscaler_instance_is_adopted_with_its_state() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    plugin = StablePrecision("16-mixed", scaler=scaler)
    assert isinstance(plugin.scaler, DynamicLossScaler)
    assert plugin.loss_scale == 512.0 and plugin.scaler.get_growth_interval() == 7
    module = make_module(scheduler=True, poison_steps={1})
    make_trainer(plugin, max_steps=3).fit(module)
    assert plugin.overflow_count == 1  # a plain GradScaler would keep the skip to itself
    assert module.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**2)  # held once


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


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_clipping_with_a_fused_optimizer_steps_like_the_unfused_one(precision: str) -> None:
    # Lightning's MixedPrecision refuses to clip when a GradScaler meets a fused optimizer (it unscales inside its
    # step); ours unscales before the clip, so the fused step sees unscaled gradients and clips like the unfused one.
    weights = {}
    for name, clip in (("adamw", 0.05), ("adamw_fused", 0.05), ("adamw", None)):
        torch.manual_seed(0)
        module = make_module(optimizer=name, lr=0.05)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            make_trainer(StablePrecision(precision), max_steps=5, gradient_clip_val=clip).fit(module)
        weights[name, clip] = [p.detach().clone() for p in module.parameters()]
    fused, plain, unclipped = weights["adamw_fused", 0.05], weights["adamw", 0.05], weights["adamw", None]
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(plain, unclipped))  # the clip acted
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

"""master_weights="kahan" | "stochastic" in real Lightning runs: FP32-master quality at 16-bit memory, with any
optimizer (8-bit ones included), skips, clipping, islands, rollback and exact resume."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from cb_helpers import NanWeight, PoisonModule, quiet
from helpers import TinyMLP, make_trainer, regression_data
from test_master_plugin import _fit_stall, _Groups, _Stall
from torch import nn
from trainer_pkg import ScaleCheckpoint, StablePrecision, pl

MODES = ["kahan", "stochastic"]


@pytest.mark.parametrize("mode", MODES)
def test_sub_ulp_updates_follow_fp32_where_plain_bf16_stalls(mode: str) -> None:
    start = _Stall().fp32_loss()
    fp32, _ = _fit_stall(StablePrecision("32-true"), steps=60)
    plain, _ = _fit_stall(StablePrecision("bf16-true", master_weights=False), steps=60)
    compact, module = _fit_stall(StablePrecision("bf16-true", master_weights=mode), steps=60)
    assert plain == pytest.approx(start, rel=1e-6)  # every update rounded away
    assert module.lin.weight.dtype == torch.bfloat16
    # kahan carries what rounding drops; stochastic rounding follows FP32 in expectation (its noise: a few %)
    assert compact == pytest.approx(fp32, rel=0.005 if mode == "kahan" else 0.1)
    assert compact < 0.6 * start


@pytest.mark.parametrize("mode", MODES)
def test_groups_frozen_islands_clipping_and_a_skipped_step(mode: str) -> None:
    module = _Groups(poison={1})
    plugin = StablePrecision("bf16-true", master_weights=mode, fp32_modules=[nn.LayerNorm])
    weights = []

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            weights.append(pl_module.net.fc2.weight.detach().clone())

    make_trainer(plugin, max_steps=4, gradient_clip_val=0.5, callbacks=[Probe()]).fit(module)
    opt = module.trainer.optimizers[0]
    assert plugin.overflow_count == 1 and torch.equal(weights[0], weights[1])  # the poisoned step changed nothing
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-2 * 0.5, 1e-3 * 0.5])  # held once: 3 applied
    assert module.net.fc2.weight.dtype == torch.bfloat16 and module.norm.weight.dtype == torch.float32
    for param, state in opt.state.items():
        assert state["exp_avg"].dtype == param.dtype  # 16-bit state for 16-bit weights, FP32 for the island
    assert plugin.master is None
    report = plugin.memory_report()
    expected_comp = sum(2 * p.numel() for p in (module.net.fc2.weight, module.net.fc2.bias,
                                                module.net.fc3.weight, module.net.fc3.bias))
    assert report["compensation"] == (expected_comp if mode == "kahan" else 0)  # frozen fc1 and the island: none


class _NanClip(_Groups):
    """``self.clip_gradients`` with a NaN ``max_norm`` (or ``clip_value``) at step 1; after each step fc2's weight."""

    def __init__(self, algorithm: str) -> None:
        super().__init__()
        self.algorithm = algorithm
        self.after: list[torch.Tensor] = []

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        limit = float("nan") if self.trainer.global_step == 1 else 1.0
        self.clip_gradients(optimizer, gradient_clip_val=limit, gradient_clip_algorithm=self.algorithm)

    def on_train_batch_end(self, *args) -> None:
        self.after.append(self.net.fc2.weight.detach().clone())


@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize("mode", [*MODES, True])
def test_a_nan_clip_in_clip_gradients_skips_the_step_and_keeps_the_weights(mode, algorithm: str) -> None:
    # The Trainer's path of a NaN clip limit: the step was applied with a NaN clip factor (compact weights) and every
    # weight became NaN (clip_val=nan by value raised inside the step).
    module = _NanClip(algorithm)
    plugin = StablePrecision("bf16-true", master_weights=mode)
    make_trainer(plugin, max_steps=3).fit(module)
    assert plugin.skipped_steps == 1 and plugin.step_count == 3
    assert torch.equal(module.after[0], module.after[1]) and not torch.equal(module.after[1], module.after[2])
    assert all(torch.isfinite(p).all() for p in module.parameters())


class _Accumulating(pl.LightningModule):
    """TinyMLP regression, AdamW, unshuffled batches; ``poison``: the batch index whose fc2 gradient gets an inf."""

    def __init__(self, batch_size: int, poison: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, (self.x, self.y) = TinyMLP(), regression_data(64)
        self.batch_size, self.poison = batch_size, poison
        self.after: dict[int, torch.Tensor] = {}  # fc2's weight after each batch
        self.start: dict[str, torch.Tensor] = {}

    def on_train_start(self) -> None:
        self.start = {name: p.detach().clone() for name, p in self.net.named_parameters()}  # 16-bit by now

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]).float(), batch[1])

    def on_after_backward(self) -> None:
        if self.trainer.fit_loop.epoch_loop.batch_idx == self.poison:
            self.net.fc2.weight.grad.view(-1)[0] = float("inf")

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.after[batch_idx] = self.net.fc2.weight.detach().clone()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=self.batch_size)

    def configure_optimizers(self):  # SGD: the update is linear in the gradient (Adam's first step is its sign)
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_accumulation_steps_once_per_window_and_skips_a_poisoned_window(mode: str) -> None:
    def fit(module, accumulate):
        plugin = StablePrecision("bf16-true", master_weights=mode)
        make_trainer(plugin, max_epochs=1, max_steps=-1, accumulate_grad_batches=accumulate).fit(module)
        return plugin

    full, accumulated = _Accumulating(32), _Accumulating(16)
    full_plugin, accumulated_plugin = fit(full, 1), fit(accumulated, 2)
    # Two micro-batches of 16 (their 16-bit gradients summed) against one batch of 32: one update per window, the
    # same random keys (the step count), values apart by the BF16 rounding of the summed gradients.
    assert full_plugin.stepper.keeper.steps == accumulated_plugin.stepper.keeper.steps == 2
    assert torch.equal(accumulated.after[0], accumulated.start["fc2.weight"])  # nothing moves inside a window
    differ: list[torch.Tensor] = []
    for (name, a), b in zip(accumulated.net.named_parameters(), full.net.parameters()):
        got, expected = a.detach().double(), b.detach().double()
        if mode == "kahan":
            comp = dict((n, c) for n, _, c in accumulated_plugin.stepper.keeper.named_buffers())
            ref = dict((n, c) for n, _, c in full_plugin.stepper.keeper.named_buffers())
            got, expected = got + comp[f"net.{name}"].double(), expected + ref[f"net.{name}"].double()
        moved = expected - accumulated.start[name].double()
        if mode == "kahan":  # the BF16 rounding of a few gradient sums, relative to what training moved (~2^-8.5)
            assert (got - expected).norm() < 2**-6 * moved.norm(), name
        else:  # the same random bits round nearly equal values to the same neighbour, nearly always
            larger = torch.maximum(got.abs(), expected.abs()).clamp_min(2.0**-120)
            ulp = torch.ldexp(torch.ones_like(larger), torch.frexp(larger).exponent - 8)  # BF16's spacing there
            apart = (got - expected).abs()
            # Beyond an ulp per rounding (two steps), the gap is the update's own (the gradients' BF16 rounding, as for
            # kahan; elementwise it can be large where two micro-batches' gradients cancel). Under 1% of the elements
            # end apart (measured, over all parameters).
            beyond = (apart - 2 * ulp).clamp_min(0)
            assert beyond.norm() < 2**-6 * moved.norm(), name
            differ.append((apart > 0).double())
    assert not differ or torch.cat([d.reshape(-1) for d in differ]).mean() < 0.05
    poisoned = _Accumulating(16, poison=1)  # the second micro-batch of the first window
    plugin = fit(poisoned, 2)
    assert plugin.overflow_count == 1 and plugin.stepper.keeper.steps == 1
    assert torch.equal(poisoned.after[1], poisoned.start["fc2.weight"])  # the whole window skipped
    assert not torch.equal(poisoned.after[3], poisoned.after[1])  # the next window stepped


def _clip_run(master_weights, clip) -> torch.Tensor:
    torch.manual_seed(0)
    module = _Groups()
    make_trainer(StablePrecision("bf16-true", master_weights=master_weights), max_steps=3,
                 gradient_clip_val=clip).fit(module)
    return module.net.fc3.weight.detach().float()


def test_clipping_acts_like_on_fp32_masters() -> None:
    with_masters, kahan = _clip_run(True, 0.05), _clip_run("kahan", 0.05)
    assert not torch.allclose(kahan, _clip_run("kahan", None))  # the clip did something
    torch.testing.assert_close(kahan, with_masters, rtol=0, atol=2**-7)  # within a BF16 ulp of the FP32-master run


@pytest.mark.parametrize("mode", MODES)
def test_resume_is_bit_exact_with_an_overflow_after_it(tmp_path, mode: str) -> None:
    poison = {5}  # one epoch is 4 steps; the second epoch's second step overflows

    def fit(module, epochs, ckpt=None):
        plugin = StablePrecision("bf16-true", master_weights=mode)
        trainer = make_trainer(plugin, max_steps=-1, max_epochs=epochs)
        with quiet():
            trainer.fit(module, ckpt_path=ckpt)
        return trainer, plugin

    torch.manual_seed(0)
    full = PoisonModule(optimizer="adamw", lr=1e-2, inf_grad_steps=poison)
    _, full_plugin = fit(full, 2)
    torch.manual_seed(0)
    first = PoisonModule(optimizer="adamw", lr=1e-2, inf_grad_steps=poison)
    trainer, _ = fit(first, 1)
    trainer.save_checkpoint(tmp_path / "e1.ckpt")
    saved = torch.load(tmp_path / "e1.ckpt", weights_only=True)["StablePrecision"]["compact"]
    assert saved["mode"] == mode and bool(saved["compensation"]) == (mode == "kahan")
    resumed = PoisonModule(optimizer="adamw", lr=1e-2, inf_grad_steps=poison)
    _, plugin = fit(resumed, 2, tmp_path / "e1.ckpt")
    assert plugin.overflow_count == 1
    for a, b in zip(resumed.parameters(), full.parameters()):
        assert torch.equal(a, b)
    full_state, resumed_state = full.trainer.optimizers[0].state_dict(), resumed.trainer.optimizers[0].state_dict()
    for key in full_state["state"]:
        for name, value in full_state["state"][key].items():
            assert torch.equal(value, resumed_state["state"][key][name])


@pytest.mark.parametrize("mode", MODES)
def test_a_rollback_restores_compensation_and_rounding_stream(mode: str) -> None:
    snapshots = []

    class Keep(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            snapshots.append((copy.deepcopy(trainer.precision_plugin.state_dict()["compact"]),
                              pl_module.model.fc2.weight.detach().clone()))

    checkpoint = ScaleCheckpoint(every_n_steps=4)
    with quiet():
        make_trainer(StablePrecision("bf16-true", master_weights=mode), max_steps=7,
                     callbacks=[NanWeight(6), checkpoint, Keep()]).fit(PoisonModule(optimizer="adamw", lr=1e-2))
    assert [(e["step"], e["restored_step"]) for e in checkpoint.events] == [(6, 4)]
    restored, at_snapshot = snapshots[6], snapshots[3]
    assert restored[0]["steps"] == at_snapshot[0]["steps"]  # the rounding stream is where it was
    for name, value in at_snapshot[0]["compensation"].items():
        assert torch.equal(restored[0]["compensation"][name], value)
    assert torch.equal(restored[1], at_snapshot[1])


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "mode"), [
    *(("bf16-true", m) for m in (*MODES, True, False)), ("16-true", True), ("16-true", False), ("bf16-mixed", None),
    ("16-mixed", None),
])
@pytest.mark.parametrize("library", ["torchao", "bitsandbytes"])
def test_8bit_optimizer_states_skip_checkpoint_and_resume(tmp_path, precision: str, mode, library: str) -> None:
    # Every *-true mode with and without masters (16-bit or FP32) and the *-mixed modes (FP32 parameters):
    # a skipped step leaves the 8-bit states alone, and a resume from a Lightning checkpoint is bit-exact.
    def optimizer(params):
        if library == "torchao":
            from torchao.optim import AdamW8bit

            return AdamW8bit(params, lr=1e-3, block_size=256)
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=1e-3)

    class Big(PoisonModule):  # 8-bit states only for tensors of >= 4096 elements (both libraries' default)
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.model.fc1, self.model.fc2, self.model.fc3 = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 16)

        def configure_optimizers(self):
            return optimizer(self.parameters())

    def fit(module, epochs, ckpt=None):
        plugin = StablePrecision(precision, **({} if mode is None else {"master_weights": mode}))
        trainer = make_trainer(plugin, max_steps=-1, max_epochs=epochs)  # epoch ends: Lightning replays a cut one
        with quiet():
            trainer.fit(module, ckpt_path=ckpt)
        return trainer

    torch.manual_seed(0)
    full = Big(inf_grad_steps={5})
    overflows = fit(full, 2).precision_plugin.overflow_count  # 16-true without masters: the scale's first back-offs too
    torch.manual_seed(0)
    first = Big(inf_grad_steps={5})
    trainer = fit(first, 1)
    big = next(p for p in trainer.optimizers[0].param_groups[0]["params"] if p.numel() >= 4096)
    states = trainer.optimizers[0].state[big].values()
    assert any(v.dtype == torch.uint8 or "8bit" in type(v).__name__ for v in states if torch.is_tensor(v))
    trainer.save_checkpoint(tmp_path / "e1.ckpt")
    torch.load(tmp_path / "e1.ckpt", weights_only=True)  # plain tensors and values only
    resumed = Big(inf_grad_steps={5})
    resumed_trainer = fit(resumed, 2, tmp_path / "e1.ckpt")
    # The injected overflow comes after the resume: its skip left the states alone (the counts include the
    # checkpoint's).
    assert resumed_trainer.precision_plugin.overflow_count == overflows >= 1
    assert trainer.precision_plugin.overflow_count < overflows
    for a, b in zip(resumed.parameters(), full.parameters()):
        assert torch.equal(a, b)


class _Widened(PoisonModule):
    """PoisonModule with layers 16-h1-h2-16 and the optimizer ``make(params, lr=lr)``."""

    def __init__(self, h1: int, h2: int, make, lr: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model.fc1, self.model.fc2, self.model.fc3 = nn.Linear(16, h1), nn.Linear(h1, h2), nn.Linear(h2, 16)
        self.make_optimizer, self.optimizer_lr = make, lr

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters(), lr=self.optimizer_lr)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("library", ["torchao", "bitsandbytes"])
def test_8bit_states_stepped_in_slices_skip_checkpoint_and_resume(
    tmp_path, mode: str, library: str, monkeypatch
) -> None:
    # A 512x256 weight (131072 elements) is stepped in two slices of the quantization blocks at the default CPU
    # budget: the skip, the checkpoint and the resume are as exact as whole-parameter steps.
    if library == "torchao":
        from torchao.optim import AdamW8bit
    else:
        from bitsandbytes.optim import AdamW8bit

    from lit_mpstable.core.weights.compact import CompactWeights

    sliced: list[str] = []
    enter = CompactWeights._enter

    def spy(self, optimizer, piece, *args):
        if not piece.whole:
            sliced.append(piece.name)
        return enter(self, optimizer, piece, *args)

    monkeypatch.setattr(CompactWeights, "_enter", spy)

    Wide = functools.partial(_Widened, 512, 256, AdamW8bit, 1e-3)  # noqa: N806

    def fit(module, epochs, ckpt=None):
        trainer = make_trainer(StablePrecision("bf16-true", master_weights=mode), max_steps=-1, max_epochs=epochs)
        with quiet():
            trainer.fit(module, ckpt_path=ckpt)
        return trainer

    torch.manual_seed(0)
    full = Wide(inf_grad_steps={5})
    full_trainer = fit(full, 2)
    assert "model.fc2.weight" in sliced and full_trainer.precision_plugin.overflow_count == 1
    state = full_trainer.optimizers[0].state[full.model.fc2.weight]
    codes = ("exp_avg", "exp_avg_sq") if library == "torchao" else ("state1", "state2")
    assert all((type(state[k]).__name__ == "OptimState8bit" or state[k].dtype == torch.uint8)
               and state[k].shape == (256, 512) for k in codes)
    torch.manual_seed(0)
    first = Wide(inf_grad_steps={5})
    fit(first, 1).save_checkpoint(tmp_path / "e1.ckpt")
    resumed = Wide(inf_grad_steps={5})
    assert fit(resumed, 2, tmp_path / "e1.ckpt").precision_plugin.overflow_count == 1
    for a, b in zip(resumed.parameters(), full.parameters()):
        assert torch.equal(a, b)


def _state_tensors(value) -> list[torch.Tensor]:
    if type(value) is torch.Tensor:
        return [value.detach().clone()]
    names, _ = value.__tensor_flatten__()
    return [getattr(value, name).detach().clone() for name in names]


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "mode"), [("bf16-true", "kahan"), ("bf16-true", "stochastic"),
                                                 ("bf16-true", False), ("32-true", None)])
def test_a_rollback_restores_torchao_8bit_states_exactly(precision: str, mode) -> None:
    # ScaleCheckpoint snapshots and restores torchao's quantized states (their clone is unimplemented and their
    # .to() keeps the inner tensors): the restored states equal the snapshot's, bit for bit, and the snapshot did
    # not follow the steps after it.
    from torchao.optim import AdamW8bit

    states, kinds = [], set()

    Wide = functools.partial(_Widened, 64, 64, AdamW8bit, 1e-2)  # noqa: N806

    class Keep(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            state = trainer.optimizers[0].state[pl_module.model.fc2.weight]
            states.append({k: _state_tensors(v) for k, v in state.items() if k != "step"})
            kinds.update(type(v).__name__ for k, v in state.items() if k != "step")

    checkpoint = ScaleCheckpoint(every_n_steps=4)
    plugin = StablePrecision(precision, **({} if mode is None else {"master_weights": mode}))
    with quiet():
        make_trainer(plugin, max_steps=7, callbacks=[NanWeight(6), checkpoint, Keep()]).fit(Wide())
    assert [(e["step"], e["restored_step"]) for e in checkpoint.events] == [(6, 4)]
    restored, at_snapshot, after = states[6], states[3], states[5]
    assert kinds == {"OptimState8bit"}  # fc2's 4096 elements: quantized
    for key, tensors in at_snapshot.items():
        assert all(torch.equal(a, b) for a, b in zip(restored[key], tensors)), key
        assert not all(torch.equal(a, b) for a, b in zip(after[key], tensors)), key  # the steps between moved it


"""StablePrecision(optimizer_state="bf16" | "fp8"): Adam/AdamW moments kept by the FP32 masters or the compact weights,
through real Lightning runs on the CPU: training, exact resume, rollback, memory, refusals, and the default path."""

from __future__ import annotations

import copy

import pytest
import torch
from cb_helpers import PoisonModule, quiet
from helpers import make_module, make_trainer
from torch import nn
from trainer_pkg import ScaleCheckpoint, StablePrecision, pl


class _Wide(pl.LightningModule):
    """A 64-128-64 MLP (weights a multiple of FP8's 128-element blocks) on a fixed regression; AdamW."""

    def __init__(self, lr: float = 3e-3, optimizer: str = "adamw", **opt_kwargs) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
        self.x, self.y = torch.randn(64, 64), torch.randn(64, 64)
        self.lr, self.optimizer_name, self.opt_kwargs = lr, optimizer, opt_kwargs
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = nn.functional.mse_loss(self.model(batch[0]).float(), batch[1])
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=16)

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        cls = torch.optim.Adam if self.optimizer_name == "adam" else torch.optim.AdamW
        return cls(self.parameters(), lr=self.lr, **self.opt_kwargs)


def _fit(kind: str, master_weights="fp32", steps: int = 24, **kwargs) -> tuple[_Wide, StablePrecision]:
    module = _Wide(**kwargs)
    plugin = StablePrecision("bf16-true", master_weights=master_weights, optimizer_state=kind)
    with quiet():
        make_trainer(plugin, max_steps=steps, max_epochs=-1).fit(module)
    return module, plugin


@pytest.mark.parametrize("master_weights", [True, "kahan"])
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_low_precision_moments_train_like_fp32_moments(master_weights, kind: str) -> None:
    reference, _ = _fit("fp32", master_weights)
    module, plugin = _fit(kind, master_weights)
    optimizer = module.trainer.optimizers[0]
    # The moments live in the keeper, not in the optimizer.
    assert not any("exp_avg" in state for state in optimizer.state.values())
    assert any("exp_avg" in state for state in reference.trainer.optimizers[0].state.values())
    assert module.losses[-1] < 0.7 * module.losses[0]
    assert module.losses[-1] == pytest.approx(reference.losses[-1], rel=0.02)
    saved = plugin.state_dict()["masters" if master_weights is True else "compact"]["optimizer_state"]
    assert saved["kind"] == kind and set(saved["steps"].values()) == {24}


def test_memory_report_counts_the_moment_stores() -> None:
    # FP32 moments: 2 x 4 bytes per element (+ a step tensor per parameter); BF16 2 x 2; FP8 2 x (1 + 8/64).
    _, fp32 = _fit("fp32", steps=2)
    _, bf16 = _fit("bf16", steps=2)
    _, fp8 = _fit("fp8", steps=2)
    numel = 64 * 128 + 128 + 128 * 64 + 64
    state = {kind: p.memory_report()["optimizer_state"] for kind, p in (("fp32", fp32), ("bf16", bf16), ("fp8", fp8))}
    assert state["fp32"] >= 8 * numel and state["bf16"] == 4 * numel
    assert state["bf16"] <= 0.5 * state["fp32"] and state["fp8"] <= 0.3 * state["fp32"]
    assert bf16.memory_report()["compensation"] == 0  # counted as optimizer state, not as compensation


@pytest.mark.parametrize("master_weights", [True, "kahan"])
def test_resume_mid_way_is_exact(master_weights, tmp_path) -> None:
    def run(epochs: int, ckpt=None, save=None):  # 4 batches an epoch; Lightning resumes whole epochs exactly
        module = _Wide()
        plugin = StablePrecision("bf16-true", master_weights=master_weights, optimizer_state="fp8")
        with quiet():
            trainer = make_trainer(plugin, max_steps=-1, max_epochs=epochs)
            trainer.fit(module, ckpt_path=ckpt)
            if save is not None:
                trainer.save_checkpoint(save)
        return module, plugin

    whole, whole_plugin = run(3)
    run(2, save=tmp_path / "half.ckpt")
    resumed, resumed_plugin = run(3, ckpt=tmp_path / "half.ckpt")
    saved = torch.load(tmp_path / "half.ckpt", weights_only=True)["StablePrecision"]
    assert saved["masters" if master_weights is True else "compact"]["optimizer_state"]["steps"]["model.0.weight"] == 8
    for a, b in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    key = "masters" if master_weights is True else "compact"
    a, b = whole_plugin.state_dict()[key], resumed_plugin.state_dict()[key]
    _assert_same(a, b)
    assert a["optimizer_state"]["steps"]["model.0.weight"] == 12


@pytest.mark.parametrize("kind", ["bf16", "fp8"])  # FP8 moments: the snapshot's finite check read E4M3 codes
def test_rollback_restores_the_moments(kind: str) -> None:
    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self.states: list[dict] = []

        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            self.states.append(copy.deepcopy(trainer.precision_plugin.state_dict()["masters"]))

    class NanWeightAt5(pl.Callback):  # inf/NaN in the weights: the ladder's rollback
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step == 5:
                with torch.no_grad():
                    pl_module.model.fc1.weight.view(-1)[0] = float("nan")

    module = PoisonModule(optimizer="adamw", lr=1e-2)
    recorder = Recorder()
    checkpoint = ScaleCheckpoint(every_n_steps=4)
    with quiet():
        make_trainer(StablePrecision("bf16-true", optimizer_state=kind), max_steps=7,
                     callbacks=[NanWeightAt5(), checkpoint, recorder]).fit(module)
    assert [e["restored_step"] for e in checkpoint.events] == [4]
    moments = [s["optimizer_state"] for s in recorder.states]
    assert moments[4]["steps"]["model.fc2.weight"] == 5
    _assert_same(moments[5], moments[3])  # after the rollback at step 5: the snapshot of step 4, moments included
    assert moments[6]["steps"]["model.fc2.weight"] == 5


def test_default_path_is_the_optimizers_own() -> None:
    # optimizer_state="fp32" (the default) is torch's AdamW on the masters: the same bits as an explicit "fp32", and
    # the moments in optimizer.state, as before this argument existed.
    default, _ = _fit("fp32", steps=6)
    module = _Wide()
    with quiet():
        make_trainer(StablePrecision("bf16-true"), max_steps=6, max_epochs=-1).fit(module)
    for a, b in zip(default.parameters(), module.parameters()):
        assert torch.equal(a, b)
    assert "optimizer_state" not in StablePrecision("bf16-true").state_dict()["masters"]
    assert all("exp_avg" in s for s in module.trainer.optimizers[0].state.values())


@pytest.mark.parametrize("precision, master_weights, match", [
    ("bf16-mixed", True, "'\\*-mixed' and '32-true'"),
    ("32-true", True, "'\\*-mixed' and '32-true'"),
    ("bf16-true", False, "master_weights=False"),
])
def test_refused_without_masters_or_compact_weights(precision, master_weights, match) -> None:
    with pytest.raises(ValueError, match=match):
        StablePrecision(precision, master_weights=master_weights, optimizer_state="bf16")


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="optimizer_state"):
        StablePrecision("bf16-true", optimizer_state="int8")


@pytest.mark.parametrize("optimizer, kwargs, match", [
    ("sgd", {}, "SGD is not torch.optim.Adam or AdamW"),
    ("adamw", {"amsgrad": True}, "uses amsgrad"),
    ("adam", {"lr": torch.tensor(1e-3)}, "tensor lr"),
])
def test_other_optimizers_are_refused_at_setup(optimizer, kwargs, match) -> None:
    lr = kwargs.pop("lr", 1e-3)
    module = _Wide(lr=lr, optimizer=optimizer, **kwargs)
    with quiet(), pytest.raises(ValueError, match=match):
        make_trainer(StablePrecision("bf16-true", optimizer_state="fp8"), max_steps=1).fit(module)


def test_skipped_steps_do_not_advance_the_moments() -> None:
    module = make_module(optimizer="adamw", lr=1e-2, poison_steps={2})
    plugin = StablePrecision("bf16-true", optimizer_state="bf16")
    with quiet():
        make_trainer(plugin, max_steps=5).fit(module)
    assert plugin.skipped_steps == 1
    assert set(plugin.state_dict()["masters"]["optimizer_state"]["steps"].values()) == {4}


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_fabric_steps_the_masters_with_low_precision_moments(kind: str) -> None:
    # Fabric shares the constructor: the hand-written FP32-master loop (torch AdamW, FP32 moments) is the reference.
    from test_fabric import hand_master_loop, train

    from lit_mpstable.frontends.fabric import StablePrecision as FabricPrecision

    reference = hand_master_loop("bf16-true", 8)
    out = train(FabricPrecision("bf16-true", optimizer_state=kind), steps=8)
    assert not out["optimizer"].state  # the moments live in the keeper
    for name, value in reference["params"].items():
        torch.testing.assert_close(out["params"][name].float(), value.float(), rtol=0, atol=2e-2)
    assert any(not torch.equal(out["params"][n], v) for n, v in reference["params"].items())  # not FP32 moments


def _stepped(master_weights, kind: str, *, seed: int = 0, steps: int = 0):
    """StablePrecision on TinyMLP driven by hand (bf16-true, AdamW): the plugin, the model and the optimizer."""
    from helpers import TinyMLP

    torch.manual_seed(seed)
    plugin = StablePrecision("bf16-true", master_weights=master_weights, optimizer_state=kind)
    model = plugin.convert_module(TinyMLP())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plugin.stepper.setup_optimizers(model, [optimizer])
    for _ in range(steps):
        loss = model(torch.randn(8, 16, dtype=torch.bfloat16)).float().square().mean()
        plugin.stepper.scale_loss(loss).backward()
        plugin.stepper.step(optimizer)
        optimizer.zero_grad()
    return plugin, model, optimizer


@pytest.mark.parametrize("source, target", [
    ((True, "fp8"), ("kahan", "fp8")), (("kahan", "bf16"), (True, "bf16")),
    ((True, "fp8"), ("kahan", "bf16")), ((True, "bf16"), ("stochastic", "fp8")),
])
def test_moments_carry_into_another_weight_mode(source, target) -> None:
    # FP8 moments with masters resumed into Kahan + FP8 moments raised AttributeError: 'dict' object has no attribute
    # 'float' (the moments went through the masters' carry). They are by parameter name in both keepers: carried
    # exactly into the same kind, stored again (one more rounding, said) into another.
    plugin, model, _ = _stepped(*source, steps=3)
    state = copy.deepcopy(plugin.state_dict())
    saved = state["masters" if source[0] is True else "compact"]["optimizer_state"]
    resumed, resumed_model, optimizer = _stepped(*target, seed=1)
    resumed_model.load_state_dict(model.state_dict())  # Lightning loads the model before the plugin's state
    resumed.load_state_dict(state)
    moments = resumed.stepper.keeper.moments
    assert moments.steps == saved["steps"] == dict.fromkeys(saved["steps"], 3)
    old = type(moments)(source[1], seed=0)
    old.load_state_dict(saved)
    for name, (m, v) in moments.stores.items():
        for store, before in zip((m, v), old.stores[name]):
            if source[1] == target[1]:
                assert torch.equal(store.read(), before.read())
            else:
                # One rounding into the new kind: < one spacing (BF16 2**-8, E4M3 1/8, stochastically rounded).
                torch.testing.assert_close(store.read(), before.read(), rtol=0.13, atol=1e-12)
    converted = [w for w in resumed.stepper.warnings if "stored again as" in w]
    assert bool(converted) == (source[1] != target[1])
    loss = resumed_model(torch.randn(8, 16, dtype=torch.bfloat16)).float().square().mean()
    resumed.stepper.scale_loss(loss).backward()
    resumed.stepper.step(optimizer)
    assert all(p.isfinite().all() for p in resumed_model.parameters()) and not resumed.last_step_skipped


def test_moments_into_a_run_without_moment_stores_are_said_to_restart() -> None:
    plugin, model, _ = _stepped(True, "fp8", steps=2)
    resumed, resumed_model, _ = _stepped("kahan", "fp32", seed=1)
    resumed_model.load_state_dict(model.state_dict())
    resumed.load_state_dict(copy.deepcopy(plugin.state_dict()))
    assert any("'fp8' Adam moments were not carried" in w and "restart at 0" in w for w in resumed.stepper.warnings)


@pytest.mark.slow  # torchao compiles its step: seconds on the CPU
@pytest.mark.parametrize(("precision", "master_weights"), [("bf16-true", True), ("bf16-mixed", None)])
def test_torchao_8bit_states_step_on_after_a_checkpoint_saved_mid_fit(tmp_path, precision, master_weights) -> None:
    # The plugin's save hook flattened torchao's quantized states inside the dicts optimizer.state_dict() hands out,
    # which are the running optimizer's own: the next step met a flat dict for exp_avg and torchao's step failed.
    # A checkpoint saved mid-fit changes nothing: the same weights as the run that saved none.
    pytest.importorskip("torchao.optim")
    from torchao.optim import AdamW8bit

    class Wide8bit(_Wide):  # 64x128 weights: 8-bit states (torchao quantizes tensors of >= 4096 elements)
        def configure_optimizers(self):
            return AdamW8bit(self.parameters(), lr=1e-3)

    def fit(**kwargs) -> _Wide:
        module = Wide8bit()
        plugin = StablePrecision(precision, **({} if master_weights is None else {"master_weights": master_weights}))
        with quiet():
            make_trainer(plugin, max_steps=4, max_epochs=-1, default_root_dir=tmp_path, **kwargs).fit(module)
        return module

    saved = fit(enable_checkpointing=True, callbacks=[pl.callbacks.ModelCheckpoint(tmp_path, every_n_train_steps=2,
                                                                              save_top_k=-1)])
    assert (tmp_path / "epoch=0-step=2.ckpt").is_file()
    kinds = {type(v).__name__ for s in saved.trainer.optimizers[0].state.values() for v in s.values()}
    assert "OptimState8bit" in kinds and "dict" not in kinds
    for a, b in zip(saved.parameters(), fit().parameters()):
        assert torch.equal(a, b)

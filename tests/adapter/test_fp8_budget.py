"""HighPrecisionBudget(by="probe") inside a run: the Trainer plugin measures the first training batch and moves the
costliest FP8 layers back to the base precision, once, before that step's forward; Fabric and manual optimization
make the documented call; the choice is saved, re-applied and validated on resume."""

from __future__ import annotations

import logging

import pytest
import torch
from cb_helpers import NanWeight
from helpers import make_trainer
from lightning.fabric import Fabric
from torch import nn
from trainer_pkg import pl

from lit_mpstable.core.step.stepper import PrecisionStepper
from lit_mpstable.fp8 import FP8Config, HighPrecisionBudget, choose_high_precision, convert_to_fp8
from lit_mpstable.fp8.backends import backend_of
from lit_mpstable.fp8.budget import linear_weight_numel
from lit_mpstable.frontends.fabric import StablePrecision as FabricStablePrecision
from lit_mpstable.frontends.trainer import StablePrecision

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers", "ignore:FP8Linear. torch._scaled_mm")

FRACTION = 0.3
WIDTHS = (16, 32, 64, 64, 32, 16)  # five linear layers, every one divisible by the NVFP4 block


def budget_config(recipe: str, by: str = "probe") -> FP8Config:
    return FP8Config(recipe=recipe, keep_high_precision=HighPrecisionBudget(FRACTION, by=by))  # type: ignore[arg-type]


def stack() -> nn.Sequential:
    layers: list[nn.Module] = []
    for d_in, d_out in zip(WIDTHS, WIDTHS[1:]):
        layers += [nn.Linear(d_in, d_out), nn.GELU()]
    return nn.Sequential(*layers[:-1])


def data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, WIDTHS[0], generator=g)
    return x, torch.sin(x @ torch.randn(WIDTHS[0], WIDTHS[-1], generator=g))


class Stack(pl.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.net = stack()
        self.automatic_optimization = not manual
        self.calls: list[dict[str, bool]] = []  # per training_step call: which layers were FP8
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        self.calls.append({name: backend_of(m) is not None for name, m in self.named_modules() if name})
        if not self.automatic_optimization and self.trainer.global_step == 0:
            self.trainer.precision_plugin.choose_high_precision_(lambda m, b: m.loss(b), batch)
        loss = self.loss(batch)
        self.log("loss", loss)  # muted during the measurement
        if self.automatic_optimization:
            self.losses.append(loss.item())
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def loss(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()), batch_size=16)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def expected_choice(recipe: str) -> list[str]:
    """The probe's choice computed outside the plugin, on the same initial weights and first batch."""
    torch.manual_seed(0)
    module = Stack()
    low = convert_to_fp8(module, budget_config(recipe))
    x, y = data()

    def loss_fn(m, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            return m.loss(batch)

    return choose_high_precision(module, low, loss_fn, (x[:16], y[:16]), HighPrecisionBudget(FRACTION))


def fit(recipe: str, *, epochs: int = 1, ckpt=None, manual: bool = False):
    torch.manual_seed(0)
    module = Stack(manual=manual)
    plugin = StablePrecision("bf16-mixed", fp8=budget_config(recipe))
    trainer = make_trainer(plugin, max_steps=-1, max_epochs=epochs)
    trainer.fit(module, ckpt_path=ckpt)
    return trainer, module, plugin


@pytest.mark.parametrize("recipe", ["nvfp4", "current"])
def test_the_trainer_chooses_once_at_the_first_batch_within_the_budget(recipe: str, caplog) -> None:
    with caplog.at_level(logging.INFO):
        _, module, plugin = fit(recipe)
    kept = plugin.fp8_high_precision_layers
    assert kept == expected_choice(recipe) and kept  # the same layers the public function picks
    sizes = linear_weight_numel(module)
    assert sum(sizes[name] for name in kept) <= FRACTION * sum(sizes.values())
    # Two measurement passes, then the 4 real steps; the first real forward already runs the choice.
    assert len(module.calls) == 4 + 2
    for call in module.calls[2:]:
        assert {name for name, fp8 in call.items() if fp8} == set(sizes) - set(kept)
    report = plugin.stats["fp8_high_precision"]
    assert report["step"] == 0 and report["layers"] == kept and set(report["errors"]) == set(sizes)
    assert report["errors"][kept[0]] == max(report["errors"].values()) or len(kept) > 1
    assert plugin.layout.fp8_layers == [name for name in sizes if name not in kept]
    line = next(r.getMessage() for r in caplog.records if "by='probe'" in r.getMessage())
    assert all(name in line for name in kept) and recipe in line


def test_with_gradient_accumulation_the_choice_comes_before_the_first_micro_batch() -> None:
    # Issue 42 item 14: with accumulate_grad_batches=k the plugin measured at the first optimizer step, after k-1
    # micro-batches had run the chosen layers in the low format, and on the k-th micro-batch.
    torch.manual_seed(0)
    module = Stack()
    plugin = StablePrecision("bf16-mixed", fp8=budget_config("nvfp4"))
    make_trainer(plugin, max_steps=2, accumulate_grad_batches=2).fit(module)
    kept = plugin.fp8_high_precision_layers
    assert kept == expected_choice("nvfp4") and kept  # measured on the first micro-batch, from the initial weights
    sizes = linear_weight_numel(module)
    assert len(module.calls) == 2 + 4  # two measurement passes first, then the 2 x 2 micro-batches
    for call in module.calls[2:]:
        assert {name for name, fp8 in call.items() if fp8} == set(sizes) - set(kept)


def test_resume_reapplies_the_choice_without_measuring_again_and_is_exact(tmp_path) -> None:
    _, full, full_plugin = fit("nvfp4", epochs=2)
    trainer, _, _ = fit("nvfp4", epochs=1)
    trainer.save_checkpoint(tmp_path / "budget.ckpt")
    saved = torch.load(tmp_path / "budget.ckpt", weights_only=True)["StablePrecision"]["fp8_budget"]
    assert saved["layers"] == full_plugin.fp8_high_precision_layers and saved["step"] == 0
    _, resumed, plugin = fit("nvfp4", epochs=2, ckpt=tmp_path / "budget.ckpt")
    assert plugin.fp8_high_precision_layers == full_plugin.fp8_high_precision_layers
    assert len(resumed.calls) == 4  # the second epoch's batches: nothing measured
    assert plugin.layout.fp8_layers == full_plugin.layout.fp8_layers
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_a_saved_choice_naming_other_layers_is_refused_before_anything_loads() -> None:
    _, _, plugin = fit("current")
    state = plugin.state_dict()
    other = StablePrecision("bf16-mixed", fp8=budget_config("current"))
    other.stepper.setup_module(Stack())
    before = other.state_dict()
    with pytest.raises(ValueError, match=r"fp8_budget\['layers'\].*'net.1'.*not FP8 layers"):
        other.load_state_dict({**state, "fp8_budget": {**state["fp8_budget"], "layers": ["net.1"]}})  # the GELU
    with pytest.raises(ValueError, match=r"fp8_budget\['errors'\]"):
        other.load_state_dict({**state, "fp8_budget": {**state["fp8_budget"], "errors": {"net.2": float("nan")}}})
    assert other.state_dict()["step_count"] == before["step_count"] and other.fp8_high_precision_layers is None
    old = {key: value for key, value in state.items() if key != "fp8_budget"}  # written before the key existed
    other.load_state_dict(old)
    assert other.stepper.fp8_budget.pending


def test_a_choice_loaded_before_the_model_is_applied_at_setup() -> None:
    _, _, plugin = fit("current")
    fresh = StablePrecision("bf16-mixed", fp8=budget_config("current"))
    fresh.load_state_dict(plugin.state_dict())
    model = Stack()
    fresh.stepper.setup_module(model)
    kept = plugin.fp8_high_precision_layers
    assert fresh.fp8_high_precision_layers == kept and kept
    assert all(type(model.get_submodule(name)) is nn.Linear for name in kept)
    assert fresh.layout.fp8_layers == [name for name in linear_weight_numel(model) if name not in kept]


def test_manual_optimization_warns_at_setup_and_the_users_call_chooses() -> None:
    with pytest.warns(UserWarning, match="manual optimization.*choose_high_precision_"):
        _, module, plugin = fit("current", manual=True)
    assert plugin.fp8_high_precision_layers == expected_choice("current")


def test_manual_optimization_without_the_call_raises_at_the_first_step() -> None:
    class Forgetful(Stack):
        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(self.loss(batch))
            opt.step()

    module = Forgetful(manual=True)
    plugin = StablePrecision("bf16-mixed", fp8=budget_config("current"))
    with pytest.warns(UserWarning, match="manual optimization"), pytest.raises(RuntimeError, match="manual"):
        make_trainer(plugin, max_steps=2).fit(module)


def test_fabric_takes_the_documented_call_and_refuses_a_step_without_it() -> None:
    def run(call: bool) -> FabricStablePrecision:
        torch.manual_seed(0)
        plugin = FabricStablePrecision("bf16-mixed", fp8=budget_config("nvfp4"))
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        module = Stack()
        with pytest.warns(UserWarning, match="choose_high_precision_"):
            model, opt = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
        x, y = data()
        for step in range(3):
            batch = (x[16 * step:][:16], y[16 * step:][:16])
            if call and step == 0:
                plugin.choose_high_precision_(lambda m, b: m.loss(b), batch)
            fabric.backward(model.loss(batch))
            opt.step()
            opt.zero_grad()
        return plugin

    assert run(call=True).fp8_high_precision_layers == expected_choice("nvfp4")
    with pytest.raises(RuntimeError, match="without the probe's choice"):
        run(call=False)


def test_the_plain_stepper_chooses_once_and_refuses_without_a_probe_budget() -> None:
    torch.manual_seed(0)
    model = stack()
    stepper = PrecisionStepper("bf16-mixed", fp8=budget_config("current"))
    stepper.setup_module(model)
    x, y = data()

    def loss_fn(m, batch):
        return nn.functional.mse_loss(m(batch[0]).float(), batch[1])

    first = stepper.choose_high_precision_(loss_fn, (x[:16], y[:16]))
    assert first and stepper.choose_high_precision_(loss_fn, (x[16:32], y[16:32])) == first  # once
    assert stepper.state_dict()["fp8_budget"]["layers"] == first
    fixed = PrecisionStepper("bf16-mixed", fp8=budget_config("current", by="last"))
    fixed.setup_module(stack())
    with pytest.raises(RuntimeError, match="no HighPrecisionBudget\\(by='probe'\\)"):
        fixed.choose_high_precision_(loss_fn, (x, y))
    assert fixed.state_dict()["fp8_budget"] == {}


@pytest.mark.slow
def test_data_parallel_ranks_choose_the_same_layers_from_their_own_batches(tmp_path) -> None:
    from dist_helpers import RankFaultModule, fit_ddp

    # Each rank's training_step picks its own rows (batch_by_step), so the two measure different batches.
    config = FP8Config(recipe="current", keep_high_precision=HighPrecisionBudget(0.4))
    ranks = fit_ddp(RankFaultModule(batch_by_step=True), StablePrecision("bf16-mixed", fp8=config, device="cpu"), [],
                    tmp_path, 2)
    low = ranks[0]["fp8_layers"]
    assert low == ranks[1]["fp8_layers"] and len(low) == 2  # one of the three moved back, the same on both ranks
    for key, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][key]), key


def test_a_rollback_to_the_snapshot_before_the_choice_keeps_the_choice() -> None:
    """ScaleCheckpoint's train-start snapshot holds every layer in NVFP4, taken before the probe moved some back at
    the first batch: a rollback to it keeps the run's choice, and the state of the layers it moved is not loaded."""
    from trainer_pkg import ScaleCheckpoint

    torch.manual_seed(0)
    module, checkpoint = Stack(), ScaleCheckpoint()
    plugin = StablePrecision("bf16-mixed", fp8=budget_config("nvfp4"))
    trainer = make_trainer(plugin, max_steps=4, callbacks=[checkpoint, NanWeight(2)])
    trainer.fit(module)
    kept = plugin.fp8_high_precision_layers
    assert kept and checkpoint.rollbacks == 1 and trainer.global_step == 4
    assert all(p.isfinite().all() for p in module.parameters())
    assert {name for name, fp8 in module.calls[-1].items() if name.startswith("net.") and not fp8
            and isinstance(module.get_submodule(name), nn.Linear)} == set(kept)

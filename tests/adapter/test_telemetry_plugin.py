"""plugin.stats: gradient telemetry on unscaled gradients, overflow attribution (and what its warnings tell the user:
no FP32-island advice for the overflows the loss scale explains, "first seen in" where the tracer cannot tell who
wrote the inf, no fp32_modules=[''] for a one-layer model), and scaler="adaptive"."""

from __future__ import annotations

import warnings

import pytest
import torch
from cb_helpers import PoisonModule, quiet
from helpers import make_module, make_trainer
from torch import nn
from trainer_pkg import StablePrecision, pl

from lit_mpstable.core.scaling.adaptive_scaler import AdaptiveLossScaler
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler


class _Probe(pl.Callback):
    """At on_before_optimizer_step (after telemetry ran): the true gradient norm and the plugin's stats."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, float, dict]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in pl_module.parameters()])).item()
        self.rows.append((trainer.precision_plugin.step_count, norm, dict(trainer.precision_plugin.stats)))


def test_telemetry_every_n_steps_on_unscaled_gradients() -> None:
    probe = _Probe()
    plugin = StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**10), telemetry_every_n_steps=3)
    make_trainer(plugin, max_steps=7, max_epochs=-1, callbacks=[probe]).fit(make_module())
    due = [(step, norm, stats) for step, norm, stats in probe.rows if stats.get("stats_step") == step]
    assert [step for step, _, _ in due] == [0, 2, 5]
    for _, norm, stats in due:
        assert stats["grad_norm"] == pytest.approx(norm, rel=1e-5)  # unscaled: not 2**10 times larger
        assert set(stats["grad_underflow_per_module"]) == {"model.fc1", "model.fc2", "model.fc3"}
        assert 0.0 <= stats["grad_underflow_frac"] <= 1.0


def test_overflow_in_one_layer_is_attributed_to_it() -> None:
    module = make_module(poison_steps={1})  # an inf in model.fc2.weight's gradient on step 1
    plugin = StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(plugin, max_steps=3).fit(module)
    assert plugin.stats["blamed_params"] == ["model.fc2.weight"]
    assert plugin.stats["blamed_modules"] == ["model.fc2"]


def test_forward_overflow_is_traced_to_the_module_that_made_it() -> None:
    class Amplify(torch.nn.Module):
        def forward(self, x):
            return x * 1e5 / 1e5  # inf in FP16, harmless in FP32

    module = make_module()
    module.model.fc2 = torch.nn.Sequential(module.model.fc2, Amplify())
    plugin = StablePrecision("16-mixed", diagnose=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(plugin, max_steps=2).fit(module)
    assert plugin.overflow_count == 2
    assert plugin.stats["blamed_modules"] == ["model.fc2.1"]
    assert any("inf/NaN appeared in the forward output of 'model.fc2.1'" in str(w.message) for w in caught)


def test_adaptive_scaler_settles_in_a_few_steps() -> None:
    scales = {}
    for name in ("dynamic", "adaptive"):
        plugin = StablePrecision("16-mixed", scaler=name)
        seen = []

        class Record(pl.Callback):
            def on_train_batch_end(self, trainer, *args) -> None:
                seen.append(trainer.precision_plugin.loss_scale)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            make_trainer(plugin, max_steps=6, max_epochs=-1, callbacks=[Record()]).fit(make_module(n=32))
        scales[name] = seen
    assert isinstance(StablePrecision("16-mixed", scaler="adaptive").scaler, AdaptiveLossScaler)
    assert scales["dynamic"] == [2.0**16] * 6  # GradScaler's rule: thousands of steps to move
    # The adaptive rule jumps to the largest power of two with headroom below FP16's max (far above 2**16 for
    # these small gradients, up to max_scale) and stays there.
    assert scales["adaptive"][0] > 2.0**16 and len(set(scales["adaptive"][1:])) == 1


def test_bad_telemetry_argument() -> None:
    with pytest.raises(ValueError, match="telemetry_every_n_steps=0"):
        StablePrecision(telemetry_every_n_steps=0)


# ------------------------------------------- what the plugin tells the user after an overflow (the attribution's words)
def _warnings(plugin) -> list[str]:
    return [w for w in plugin.stepper.warnings if "inf/NaN" in w]


def test_the_settling_scale_overflows_are_not_blamed_on_a_layer() -> None:
    # Gradients ~30x larger than usual: at 2**16 (and 2**15) the scaled gradients overflow FP16 in the backward, as
    # every FP16 run's first steps do while the scale settles.
    plugin = StablePrecision("16-mixed", diagnose=True)
    with quiet():
        make_trainer(plugin, max_steps=4).fit(PoisonModule(loss_factor={0: 3e4, 1: 3e4, 2: 3e4, 3: 3e4}))
    messages = _warnings(plugin)
    assert messages and plugin.overflow_count >= 2
    assert all("fp32_modules" not in m and "first seen in the backward gradient" in m and "loss scale" in m
               for m in messages), messages


class OneLayer(PoisonModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(16, 16)
        with torch.no_grad():
            self.model.weight.fill_(1e4)  # FP16 forward output overflows (16 * 1e4 * ~1e1 > 65504)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.model(batch[0] * 10).float(), batch[1])


def test_a_one_layer_model_is_not_told_fp32_modules_of_the_empty_name() -> None:
    from lit_mpstable.core.attribution import overflow_warning

    message = overflow_warning("", forward=True, step=3, scale=1.0)
    assert "fp32_modules=['']" not in message and "the model itself" in message and "'32-true'" in message
    assert "fp32_modules=['net.0']" in overflow_warning("net.0", forward=True, step=3, scale=65536.0)
    assert "first seen in" in overflow_warning("net.0", forward=False, step=3, scale=1.0)
    plugin = StablePrecision("16-mixed", diagnose=True, fp32_modules=())
    with quiet():
        make_trainer(plugin, max_steps=2).fit(OneLayer())
    messages = _warnings(plugin)
    assert messages and all("fp32_modules=['']" not in m for m in messages), messages


def test_the_stepper_notes_are_shown_once_per_key_not_per_text() -> None:
    # The key is the cause the core names when it adds a note; the message's words and step never decide.
    plugin = StablePrecision("bf16-mixed", device="cpu")
    notes = plugin.stepper.warnings
    notes.add("overflow:forward:net.0", "inf/NaN appeared in net.0 (step 3)")
    notes.add("overflow:forward:net.0", "inf/NaN appeared in net.0 (step 9), in other words")
    notes.add("replay-finite:3", "inf/NaN appeared in net.0 (step 3)")
    assert notes.add_once("flush", "a") and not notes.add_once("flush", "b") and list(notes)[-1] == "a"
    with pytest.warns(UserWarning) as caught:
        plugin._show_notes()
    shown = [str(w.message) for w in caught]
    assert shown == ["StablePrecision: inf/NaN appeared in net.0 (step 3)"] * 2 + ["StablePrecision: a"], shown
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        notes.add("flush", "c")
        plugin._show_notes()  # a key already shown stays quiet

"""What the plugin tells the user after an overflow: no FP32-island advice for the overflows the loss scale explains,
"first seen in" where the tracer cannot tell who wrote the inf, and no fp32_modules=[''] for a one-layer model."""

from __future__ import annotations

import warnings

import pytest
import torch
from cb_helpers import PoisonModule, quiet
from helpers import make_trainer
from torch import nn

from lit_mpstable import StablePrecision


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


def test_the_op_policy_log_says_why_the_slower_choice_was_kept() -> None:
    from lit_mpstable.core.policy import Measurement, StepCost, choose, describe

    step = StepCost(ms=10.0, peak_bytes=100 * 2**20)
    memory = Measurement(autocast_ms=3.9, fp32_ms=2.8, autocast_err=1e-3, fp32_err=1e-6, fp32_extra_bytes=40 * 2**20)
    assert choose(memory, 0.2, step) == "autocast"  # 28 % faster, but 40 % more peak memory for 11 % of the step
    text = describe("attention", "autocast", memory, 0.2, step)
    assert text.startswith("attention=autocast (2.8 ms fp32 vs 3.9 ms autocast; kept:")
    assert "peak memory by 40.0 MiB (40%)" in text
    noisy = Measurement(autocast_ms=3.0, fp32_ms=2.8, autocast_err=1e-3, fp32_err=1e-6)
    assert "under the 20% margin" in describe("matmul", "autocast", noisy, 0.2, step)
    worse = Measurement(autocast_ms=3.9, fp32_ms=2.0, autocast_err=1e-6, fp32_err=1e-3)
    assert "error" in describe("norm", "autocast", worse, 0.2, step)


def test_the_fused_adam_compile_notice_is_said_once_per_cache(tmp_path, monkeypatch) -> None:
    import lit_mpstable.core.compact_fused as fused

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert fused._first_to_say("probe_marker") is True  # the sweep's first job
    assert fused._first_to_say("probe_marker") is False  # every later job or process sharing the cache
    assert (tmp_path / "probe_marker").exists()
    source = open(fused.__file__).read()
    assert "in seconds" not in source and "13-28 s" in source


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

"""StablePrecision(fp8=...): the swap in convert_module, the fallback ladder, FP8 state in checkpoints."""

from __future__ import annotations

import pytest
import torch
from helpers import make_module, make_trainer

from lit_mpstable import StablePrecision
from lit_mpstable.fp8 import FP8Config, FP8Linear


def test_bad_fp8_argument_names_it() -> None:
    with pytest.raises(ValueError, match="recipe"):
        StablePrecision("bf16-mixed", fp8="fp4")
    with pytest.raises(ValueError, match="margin"):
        StablePrecision("bf16-mixed", fp8=FP8Config(margin=-1))


@pytest.mark.parametrize("recipe", ["delayed", "current", "mxfp8"])
def test_middle_layer_runs_in_fp8_and_trains(recipe: str) -> None:
    torch.manual_seed(0)
    module = make_module(optimizer="adamw", lr=1e-2)
    plugin = StablePrecision("bf16-mixed", fp8=recipe)
    make_trainer(plugin, max_steps=12, max_epochs=-1).fit(module)
    assert isinstance(module.model.fc2, FP8Linear) and type(module.model.fc1) is torch.nn.Linear
    assert plugin.layout.fp8_layers == ["model.fc2"]
    assert sum(module.losses[-4:]) < sum(module.losses[:4])  # it learns
    assert module.model.fc2.weight.dtype == torch.float32  # parameters untouched: only GEMM operands are FP8


def test_global_ladder_fp8_then_base_then_fp32() -> None:
    module = make_module(optimizer="adamw", lr=1e-2)
    plugin = StablePrecision("bf16-mixed", fp8="current")
    trainer = make_trainer(plugin, max_steps=1)
    trainer.fit(module)
    assert plugin.layout.fp8_layers == ["model.fc2"]
    plugin.fallback(None, reason="test")
    assert plugin.layout.fp8_layers == [] and plugin.compute_dtype == torch.bfloat16
    plugin.fallback(None, reason="test")
    assert plugin.compute_dtype == torch.float32
    plugin.restore_precision()
    assert plugin.layout.fp8_layers == ["model.fc2"] and not plugin.fallback_active


def test_module_fallback_takes_a_layer_out_of_fp8() -> None:
    module = make_module(optimizer="adamw", lr=1e-2)
    plugin = StablePrecision("bf16-mixed", fp8="current")
    make_trainer(plugin, max_steps=1).fit(module)
    assert "left FP8" in plugin.fallback(["model.fc2"], reason="test")
    assert type(module.model.fc2) is torch.nn.Linear and plugin.islands.names == []
    assert "FP32" in plugin.fallback(["model.fc2"], reason="again")  # next rung: an FP32 island


def test_delayed_amax_history_resumes_exactly(tmp_path) -> None:
    def fit(epochs, ckpt=None):
        torch.manual_seed(0)
        module = make_module(optimizer="adamw", lr=1e-2)
        plugin = StablePrecision("bf16-mixed", fp8=FP8Config(recipe="delayed", amax_history_len=4))
        trainer = make_trainer(plugin, max_steps=-1, max_epochs=epochs)
        trainer.fit(module, ckpt_path=ckpt)
        return trainer, module, plugin

    _, full, full_plugin = fit(2)
    trainer, _, _ = fit(1)
    trainer.save_checkpoint(tmp_path / "fp8.ckpt")
    state = torch.load(tmp_path / "fp8.ckpt", weights_only=True)["StablePrecision"]["layout"]["fp8"]
    assert set(state) == {"model.fc2.amax_history", "model.fc2.scale"}
    _, resumed, resumed_plugin = fit(2, tmp_path / "fp8.ckpt")
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    for key, value in full_plugin.state_dict()["layout"]["fp8"].items():
        assert torch.equal(value, resumed_plugin.state_dict()["layout"]["fp8"][key])

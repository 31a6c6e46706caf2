"""StablePrecision(fp8=...) with each FP8 backend (native, torchao for real on the CPU, TransformerEngine as a
stand-in): the swap in convert_module, TE's autocast, the fallback ladder, restore, rollback-style state loads, a
second fit and checkpoint resume, with the default and an explicit filter."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fp8_stand_ins import install_transformer_engine
from helpers import make_module, make_trainer
from torch import nn

from lit_mpstable import StablePrecision
from lit_mpstable.callbacks import AMPPreflight
from lit_mpstable.fp8 import BACKENDS, FP8Config, FP8Linear
from lit_mpstable.fp8 import recipe as fp8_recipe
from lit_mpstable.fp8.backends import backend_of

pytestmark = pytest.mark.filterwarnings("ignore:FP8Linear. torch._scaled_mm", "ignore:.*does not have many workers")

FILTERS = {"default": None, "explicit": ["model.fc2"]}


@pytest.fixture(params=list(BACKENDS))
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """One backend: ``config(**overrides)`` builds its FP8Config; ``te`` is the TransformerEngine stand-in's record."""
    name, te = request.param, None
    if name == "torchao":
        pytest.importorskip("torchao.float8")
        fields = dict(recipe="current", backend="torchao", emulate=True)  # torchao emulates FP8 on the CPU
    elif name == "transformer_engine":
        te = install_transformer_engine(monkeypatch)
        fields = dict(recipe="delayed", backend="transformer_engine", amax_history_len=4, margin=1)
    else:
        fields = dict(recipe="delayed", amax_history_len=4)
    return SimpleNamespace(
        name=name, te=te, config=lambda **overrides: FP8Config(**{**fields, **overrides}),
        is_fp8=lambda module: backend_of(module) is BACKENDS[name],
    )  # fmt: skip


def test_bad_fp8_argument_names_it() -> None:
    with pytest.raises(ValueError, match="recipe"):
        StablePrecision("bf16-mixed", fp8="fp4")
    with pytest.raises(ValueError, match="margin"):
        StablePrecision("bf16-mixed", fp8=FP8Config(margin=-1))


def test_a_backend_refuses_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    install_transformer_engine(monkeypatch, recipes=("DelayedScaling",))  # a TE without current scaling
    with pytest.raises(ValueError, match="Float8CurrentScaling"):
        StablePrecision("bf16-mixed", fp8=FP8Config(recipe="current", backend="transformer_engine"))


@pytest.mark.parametrize("recipe", [
    "delayed", "current", "mxfp8",
    fp8_recipe("mxfp8", name="mx_fwd_nv_bwd", dgrad="nvfp4", wgrad="bf16"),  # per role
    {"*.fc2": "nvfp4"},  # per module
], ids=["delayed", "current", "mxfp8", "per_role", "map"])
def test_middle_layer_runs_in_fp8_and_trains(recipe: Any) -> None:
    torch.manual_seed(0)
    module = make_module(optimizer="adamw", lr=1e-2)
    plugin = StablePrecision("bf16-mixed", fp8=FP8Config(recipe=recipe))
    make_trainer(plugin, max_steps=12, max_epochs=-1).fit(module)
    assert isinstance(module.model.fc2, FP8Linear) and type(module.model.fc1) is torch.nn.Linear
    assert plugin.layout.fp8_layers == ["model.fc2"]
    assert sum(module.losses[-4:]) < sum(module.losses[:4])  # it learns
    assert module.model.fc2.weight.dtype == torch.float32  # parameters untouched: only GEMM operands are FP8


def _optimized(trainer, param: torch.Tensor) -> bool:
    return any(p is param for group in trainer.optimizers[0].param_groups for p in group["params"])


@pytest.mark.parametrize("filter_name", list(FILTERS))
def test_fallbacks_restore_rollback_and_a_second_fit(backend: SimpleNamespace, filter_name: str) -> None:
    torch.manual_seed(0)
    module = make_module(optimizer="adamw", lr=1e-2)
    initial = module.model.fc2.weight.detach().clone()
    plugin = StablePrecision("bf16-mixed", fp8=backend.config(filter=FILTERS[filter_name]))
    trainer = make_trainer(plugin, max_steps=2)
    trainer.fit(module)
    model = module.model
    assert backend.is_fp8(model.fc2) and plugin.layout.fp8_layers == ["model.fc2"]
    assert type(model.fc1) is type(model.fc3) is nn.Linear
    weight = model.fc2.weight
    assert _optimized(trainer, weight) and not torch.equal(weight, initial)  # the optimizer trains this object
    if backend.te is not None:  # TE's autocast around every forward, with the configured recipe
        assert len(backend.te.forwards) == 2
        assert all(type(r).__name__ == "DelayedScaling" for r in backend.te.forwards)
        assert backend.te.forwards[0].kwargs == dict(margin=1, fp8_format="HYBRID", amax_history_len=4,
                                                     amax_compute_algo="max")  # fmt: skip
        assert all(call["enabled"] is True for call in backend.te.autocast)

    snapshot = plugin.state_dict()
    plugin.fallback(None, reason="test")  # global: FP8 layers back to nn.Linear with the trained weights
    assert type(model.fc2) is nn.Linear and model.fc2.weight is weight and plugin.layout.fp8_layers == []
    plugin.fallback(None, reason="test")
    assert plugin.compute_dtype == torch.float32 and type(model.fc2) is nn.Linear
    plugin.restore_precision()
    assert backend.is_fp8(model.fc2) and model.fc2.weight is weight and not plugin.fallback_active

    assert "left FP8" in plugin.fallback(["model.fc2"], reason="test")  # module fallback
    assert type(model.fc2) is nn.Linear and model.fc2.weight is weight
    plugin.load_state_dict(snapshot)  # a rollback to before the fallback
    assert backend.is_fp8(model.fc2) and model.fc2.weight is weight and not plugin.fallback_active
    plugin.load_state_dict(plugin.state_dict())

    before = weight.detach().clone()
    forwards = len(backend.te.forwards) if backend.te is not None else 0
    trainer = make_trainer(plugin, max_steps=2)
    trainer.fit(module)  # a second fit re-applies the same selection
    assert backend.is_fp8(model.fc2) and model.fc2.weight is weight and _optimized(trainer, weight)
    assert not torch.equal(weight, before)
    if backend.te is not None:
        assert len(backend.te.forwards) == forwards + 2


def test_a_stale_filter_is_still_refused_on_the_first_selection(backend: SimpleNamespace) -> None:
    plugin = StablePrecision("bf16-mixed", fp8=backend.config(filter=["model.fc9"]))
    with pytest.raises(ValueError, match="fc9"):
        make_trainer(plugin, max_steps=1).fit(make_module())


@pytest.mark.parametrize("filter_name", list(FILTERS))
def test_resume_from_a_lightning_checkpoint_is_exact(backend: SimpleNamespace, filter_name: str, tmp_path) -> None:
    def fit(epochs, ckpt=None):
        torch.manual_seed(0)
        module = make_module(optimizer="adamw", lr=1e-2)
        plugin = StablePrecision("bf16-mixed", fp8=backend.config(filter=FILTERS[filter_name]))
        trainer = make_trainer(plugin, max_steps=-1, max_epochs=epochs)
        trainer.fit(module, ckpt_path=ckpt)
        return trainer, module, plugin

    _, full, full_plugin = fit(2)
    trainer, _, _ = fit(1)
    trainer.save_checkpoint(tmp_path / "fp8.ckpt")
    checkpoint = torch.load(tmp_path / "fp8.ckpt", weights_only=True)
    state = checkpoint["StablePrecision"]["layout"]["fp8"]
    assert not any("_extra_state" in key for key in checkpoint["state_dict"])  # the model's own dict stays plain
    expected_keys = {
        "native": {"model.fc2.amax_history", "model.fc2.scale"},
        "torchao": set(),  # current scaling: stateless
        "transformer_engine": {"model.fc2.extra_state"},
    }[backend.name]
    assert set(state) == expected_keys and all(value.numel() > 0 for value in state.values())
    _, resumed, resumed_plugin = fit(2, tmp_path / "fp8.ckpt")
    assert backend.is_fp8(resumed.model.fc2)
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    full_state, resumed_state = full_plugin.state_dict()["layout"]["fp8"], resumed_plugin.state_dict()["layout"]["fp8"]
    assert full_state.keys() == resumed_state.keys()
    for key, value in full_state.items():
        assert torch.equal(value, resumed_state[key])
    if backend.te is not None:  # TE's own state came back (not restarted): 4 steps of history after 8 steps
        assert torch.equal(resumed.model.fc2.amax_history, full.model.fc2.amax_history)
        assert resumed.model.fc2.amax_history.all()


def test_preflight_compares_with_an_fp32_copy_free_of_every_backends_fp8(backend: SimpleNamespace) -> None:
    # The stand-in TE layer refuses to run outside TE's autocast, so a copy that kept it would fail the reference.
    preflight = AMPPreflight(action="raise")
    plugin = StablePrecision("bf16-mixed", fp8=backend.config())
    module = make_module()
    make_trainer(plugin, max_steps=1, callbacks=[preflight]).fit(module)
    assert preflight.result["passed"] and preflight.result["rtol"] == 0.15  # the FP8 tolerance: FP8 layers seen
    assert backend.is_fp8(module.model.fc2)

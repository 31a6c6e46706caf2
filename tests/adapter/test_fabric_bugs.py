"""Fabric loops that once went wrong: value clipping on a skipped step, the model's gradients after clipping with
FP32 masters, AdamW's eps in 16-true without masters, resuming compensated masters without the plugin's state."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import TinyMLP, inject_overflow, regression_data
from lightning.fabric import Fabric

from lit_mpstable.frontends.fabric import StablePrecision

_MODES = [  # (precision, master_weights)
    ("16-mixed", True), ("bf16-mixed", True), ("bf16-true", True), ("16-true", True), ("16-true", False),
    ("bf16-true", False), ("32-true", True),
]


def _fabric(plugin: StablePrecision) -> Fabric:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FP16 on the CPU, said once
        return Fabric(accelerator="cpu", devices=1, plugins=[plugin])


def _setup(precision: str, master_weights: bool | str = True, **kwargs):
    plugin = StablePrecision(precision, master_weights=master_weights, **kwargs)
    fabric = _fabric(plugin)
    torch.manual_seed(0)
    model = TinyMLP()
    eps = 1e-4 if precision == "16-true" and not master_weights else 1e-8  # FP16 state: see the eps tests below
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=eps)
    model, opt = fabric.setup(model, opt)
    return plugin, fabric, model, opt


def _backward(fabric: Fabric, model: torch.nn.Module, step: int = 0, scale: float = 1.0) -> None:
    x, y = regression_data(64)
    batch = slice(16 * (step % 4), 16 * (step % 4 + 1))
    fabric.backward(scale * F.mse_loss(model(x[batch]), y[batch]))


@pytest.mark.parametrize(("precision", "master_weights"), _MODES)
@pytest.mark.parametrize("clip", ["value", "norm"])
def test_clipping_a_step_that_will_be_skipped_clips_nothing_and_does_not_raise(
    precision: str, master_weights: bool, clip: str
) -> None:
    # Value clipping of a skipped step once raised torch's "Expected !nested_tensorlist[0].empty()" in every mode.
    plugin, fabric, model, opt = _setup(precision, master_weights)
    inject_overflow(model.fc2, {0, 2})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    skipped, norms = [], []
    for step in range(4):
        opt.zero_grad()
        _backward(fabric, model, step)
        if clip == "value":
            assert fabric.clip_gradients(model, opt, clip_val=0.5) is None
        else:
            norms.append(float(fabric.clip_gradients(model, opt, max_norm=0.5)))
        opt.step()
        skipped.append(plugin.last_step_skipped)
        if step == 0:  # the skipped step left the weights as they were
            assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert skipped == [True, False, True, False]
    assert plugin.overflow_count == 2
    if clip == "norm":
        assert norms[0] == norms[2] == 0.0 and norms[1] > 0.0 and norms[3] > 0.0
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())


def _pairs(model: torch.nn.Module, opt) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(model parameter, the parameter its optimizer updates): masters with FP32 master weights."""
    stepped = [p for group in opt.optimizer.param_groups for p in group["params"]]
    params = list(model.parameters())
    assert len(stepped) == len(params)
    return list(zip(params, stepped))


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
@pytest.mark.parametrize("clip", ["value", "norm"])
def test_after_clipping_the_models_gradients_are_those_the_optimizer_applies(precision: str, clip: str) -> None:
    plugin, fabric, model, opt = _setup(precision, True, scaler=None)
    opt.zero_grad()
    _backward(fabric, model, scale=50.0)  # a gradient norm well above the clip
    if clip == "value":
        fabric.clip_gradients(model, opt, clip_val=0.01)
    else:
        norm = fabric.clip_gradients(model, opt, max_norm=0.5)
        assert float(norm) > 1.0
    pairs = _pairs(model, opt)
    assert all(p.dtype != m.dtype for p, m in pairs)  # the optimizer steps FP32 masters
    for param, master in pairs:
        assert param.grad is not None and master.grad is not None
        # What the model shows is what the optimizer applies, rounded to the model's 16 bits.
        assert torch.equal(param.grad, master.grad.to(param.dtype))
    shown = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p, _ in pairs]))
    if clip == "value":
        assert max(float(p.grad.abs().max()) for p, _ in pairs) <= 0.01 * (1 + 2**-7)
    else:
        assert abs(float(shown) - 0.5) < 0.5 * 2**-6
    opt.step()
    assert not plugin.last_step_skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _dead_relus(model: torch.nn.Module) -> None:
    """Half of fc1's units never fire: their gradients are exactly 0, so Adam's moments for them stay 0."""
    with torch.no_grad():
        model.fc1.bias[:16] = -1e3


def _fabric_16_true(eps: float, steps: int = 3) -> tuple[StablePrecision, torch.nn.Module]:
    plugin = StablePrecision("16-true", master_weights=False, scaler=None)
    fabric = _fabric(plugin)
    torch.manual_seed(0)
    model = TinyMLP()
    _dead_relus(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps)
    model, opt = fabric.setup(model, opt)
    for step in range(steps):
        opt.zero_grad()
        _backward(fabric, model, step)
        opt.step()
    return plugin, model


def test_16_true_without_masters_refuses_an_eps_that_fp16_flushes_to_zero() -> None:
    # AdamW's default eps=1e-8 is 0 in FP16: 0/0 put NaN in the dead units' weights at the first step, and every
    # later step was skipped (the run stalled silently).
    with pytest.raises(ValueError, match=r"eps=1e-08.*holds as 0\.0.*6\.1e-05.*eps=1e-4.*master_weights=True"):
        _fabric_16_true(1e-8)


def test_16_true_without_masters_refuses_the_eps_at_fabric_setup() -> None:
    # Fabric shows a precision plugin no optimizer at setup: the refusal came at the first clip or step, after a
    # forward and backward, from inside Fabric's strategy. It comes from fabric.setup now, with the same message.
    fabric = _fabric(StablePrecision("16-true", master_weights=False, scaler=None))
    model = TinyMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    refusal = r"eps=1e-08.*holds as 0\.0.*6\.1e-05.*eps=1e-4.*master_weights=True"
    with pytest.raises(ValueError, match=refusal) as caught:
        fabric.setup(model, opt)
    assert caught.traceback[-1].name == "check_eps" and any(e.name == "setup" for e in caught.traceback)
    assert not any(e.name in ("optimizer_step", "clip_gradients") for e in caught.traceback)


def test_16_true_without_masters_refuses_a_subnormal_eps_and_trains_with_the_one_it_advises() -> None:
    # eps=2**-24 (subnormal in FP16) kept NaN out but the dead ReLUs' neighbours took steps of lr * m / eps that
    # overflowed the next forward: steps 1-3 were skipped.
    with pytest.raises(ValueError, match=r"eps=5\.96.*holds as 5\.96"):
        _fabric_16_true(2.0**-24)
    plugin, model = _fabric_16_true(1e-4, steps=4)
    assert plugin.skipped_steps == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model.fc1.weight.dtype == torch.float16


def test_the_trainer_refuses_the_same_eps() -> None:
    from helpers import make_module, make_trainer

    from lit_mpstable import StablePrecision as TrainerStablePrecision

    module = make_module(optimizer="adamw", lr=1e-3)
    _dead_relus(module.model)
    with pytest.raises(ValueError, match=r"eps=1e-08.*holds as 0\.0.*6\.1e-05.*eps=1e-4.*master_weights=True"):
        make_trainer(TrainerStablePrecision("16-true", master_weights=False, scaler=None), max_steps=2).fit(module)


def _resumable(mode: bool | str, steps: range, *, load: Path | None = None, save: Path | None = None,
               with_plugin: bool = False, optimizer_state: str = "fp32", order: str = "setup, load") -> dict:
    """AdamW on TinyMLP in bf16-true; the saved state is litgpt's ({"model", "optimizer"}) unless ``with_plugin``;
    ``order``: plugin.setup_optimizers before fabric.load (the documented order) or after it."""
    plugin = StablePrecision("bf16-true", master_weights=mode, optimizer_state=optimizer_state)
    fabric = _fabric(plugin)
    torch.manual_seed(0 if load is None else 123)
    model = TinyMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    if order == "setup, load":
        plugin.setup_optimizers(opt)
    state = {"model": model, "optimizer": opt, **({"precision": plugin} if with_plugin else {})}
    if load is not None:
        fabric.load(load, state)
    if order == "load, setup":
        plugin.setup_optimizers(opt)
    for step in steps:
        opt.zero_grad()
        _backward(fabric, model, step)
        opt.step()
    if save is not None:
        fabric.save(save, state)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("mode", [True, "kahan", "stochastic"])
def test_resuming_without_the_plugins_state_warns_and_with_it_is_exact(mode: bool | str, tmp_path: Path) -> None:
    # litgpt saves {"model", "optimizer"} only: kahan/stochastic (and FP32 masters) then resumed inexactly, silently.
    whole = _resumable(mode, range(4))
    _resumable(mode, range(2), save=tmp_path / "litgpt.pt")
    with pytest.warns(UserWarning, match=r"plugin's own state was not loaded.*'precision': plugin"):
        inexact = _resumable(mode, range(2, 4), load=tmp_path / "litgpt.pt")
    assert not all(torch.equal(inexact[k], v) for k, v in whole.items())  # what the warning says
    _resumable(mode, range(2), save=tmp_path / "ours.pt", with_plugin=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*plugin's own state")
        exact = _resumable(mode, range(2, 4), load=tmp_path / "ours.pt", with_plugin=True)
    assert all(torch.equal(exact[k], v) for k, v in whole.items())


@pytest.mark.parametrize("mode, kind, order", [(True, "bf16", "setup, load"), ("kahan", "fp8", "setup, load"),
                                               (True, "fp8", "load, setup")])
def test_resuming_moments_without_the_plugins_state_warns(mode: bool | str, kind: str, order: str,
                                                          tmp_path: Path) -> None:
    # BF16/FP8 moments live in the plugin's state, not the optimizer's: a litgpt-style resume restarted them at 0
    # without the warning FP32 masters get (the optimizer comes back with no state to notice).
    _resumable(mode, range(2), save=tmp_path / "litgpt.pt", optimizer_state=kind)
    with pytest.warns(UserWarning, match=r"plugin's own state was not loaded.*Adam moments.*restart at 0"):
        _resumable(mode, range(2, 4), load=tmp_path / "litgpt.pt", optimizer_state=kind, order=order)
    _resumable(mode, range(2), save=tmp_path / "ours.pt", with_plugin=True, optimizer_state=kind)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*plugin's own state")
        _resumable(mode, range(2, 4), load=tmp_path / "ours.pt", with_plugin=True, optimizer_state=kind, order=order)
        _resumable(mode, range(2), optimizer_state=kind)  # a fresh run: nothing was lost


def _compact_run(mode: str, clip: str, *, ours: bool, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    """16-true with compact weights and the dynamic scaler: clipped by fabric.clip_gradients (``ours``) or by the
    stepper's own compact-aware clipping (the Trainer's path: the clip folds into the step's FP32 unscale)."""
    plugin = StablePrecision("16-true", master_weights=mode, scaler="dynamic")
    fabric = _fabric(plugin)
    torch.manual_seed(0)
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = fabric.setup(model, opt)
    plugin.setup_optimizers(opt)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        _backward(fabric, model, step)
        if ours:
            out = fabric.clip_gradients(model, opt, **({"max_norm": 0.05} if clip == "norm" else {"clip_val": 2e-3}))
        elif clip == "norm":
            out = plugin.stepper.clip_grad_norm_(opt.optimizer, 0.05)
        else:
            out = plugin.stepper.clip_grad_value_(opt.optimizer, 2e-3)
        if out is not None:
            norms.append(float(out))
        opt.step()
        assert not plugin.last_step_skipped
    return norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
@pytest.mark.parametrize("clip", ["norm", "value"])
def test_fabric_clips_compact_weights_true_gradients_not_the_scaled_ones(mode: str, clip: str) -> None:
    # Compact weights keep FP16 gradients scaled (x65536) until the step: fabric.clip_gradients clipped those,
    # returning norms 65536x too large and clipping to 1/65536 of the limit.
    norms, weights = _compact_run(mode, clip, ours=True)
    ref_norms, ref_weights = _compact_run(mode, clip, ours=False)
    assert norms == pytest.approx(ref_norms, rel=1e-3)
    if clip == "norm":
        assert all(n > 0.05 for n in norms)  # the clip acted
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, atol=2e-3, rtol=0), name



def test_clipping_before_fabric_backward_names_the_call_order() -> None:
    plugin, fabric, model, opt = _setup("16-mixed")
    for param in model.parameters():  # gradients from elsewhere: no fabric.backward, no loss was scaled
        param.grad = torch.ones_like(param)
    with pytest.raises(RuntimeError, match=r"before any loss was scaled.*fabric\.backward\(loss\)"):
        fabric.clip_gradients(model, opt, max_norm=1.0)

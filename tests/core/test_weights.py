"""The WeightKeeper protocol: each weight mode satisfies it, and the stepper's step path goes through the keeper."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from helpers import TinyMLP, regression_data

from lit_mpstable.core.step.stepper import PrecisionStepper
from lit_mpstable.core.weights.compact import CompactWeights
from lit_mpstable.core.weights.keeper import Keeper
from lit_mpstable.core.weights.master import MasterWeights
from lit_mpstable.core.weights.weights import PlainKeeper, WeightKeeper, make_keeper

MODES = [("bf16-mixed", True, PlainKeeper), ("bf16-true", False, PlainKeeper), ("bf16-true", True, MasterWeights),
         ("bf16-true", "kahan", CompactWeights), ("bf16-true", "stochastic", CompactWeights)]


def _stepper(precision, master_weights):
    torch.manual_seed(0)
    model = TinyMLP()
    stepper = PrecisionStepper(precision, master_weights=master_weights, device="cpu")
    stepper.setup_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper.setup_optimizers(model, [opt])
    return stepper, model, opt


@pytest.mark.parametrize("precision, master_weights, kind", MODES)
def test_each_weight_mode_is_a_keeper_behind_the_protocol(precision, master_weights, kind):
    stepper, _, _ = _stepper(precision, master_weights)
    assert type(stepper.keeper) is kind
    assert isinstance(stepper.keeper, WeightKeeper)


def test_make_keeper_builds_each_mode_and_fsdp2_keeps_plain():
    model = TinyMLP().bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    common = dict(owner="T", precision="bf16-true", dtype=torch.bfloat16, checker=None)
    assert isinstance(make_keeper("fp32", model, [opt], **common), MasterWeights)
    assert isinstance(make_keeper("fp32", TinyMLP().bfloat16(), [], fsdp2=True, **common), PlainKeeper)
    assert isinstance(make_keeper(None, model, [opt], **common), PlainKeeper)
    kahan = make_keeper("kahan", TinyMLP().bfloat16(), [], **common)
    assert isinstance(kahan, CompactWeights) and kahan.mode == "kahan"
    assert not isinstance(object(), WeightKeeper)  # the check can fail


class _Recording:
    """A keeper that records the protocol calls the stepper makes (delegating to a real one)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        value = getattr(self.inner, name)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            self.calls.append(f"{name}(absorb)" if kwargs.get("absorb") else name)
            return value(*args, **kwargs)
        return call


@pytest.mark.parametrize("master_weights", [True, "kahan"])
def test_the_step_path_asks_the_keeper_for_everything_mode_specific(master_weights):
    stepper, model, opt = _stepper("bf16-true", master_weights)
    recording = _Recording(stepper.keeper)
    stepper.keeper = recording
    x, y = regression_data()
    with stepper.forward_context():
        loss = torch.nn.functional.mse_loss(model(stepper.convert_input(x)).float(), y)
    stepper.scale_loss(loss).backward()
    stepper.clip_grad_norm_(opt, 1.0)
    before = model.fc1.weight.detach().clone()
    stepper.step(opt)
    order = ["unscale_", "clip_", "grads(absorb)", "end_step_"]
    # Gradients written on the model's side reach the keeper (a read that absorbs them) before the clip (whose norm
    # may be the guard's, if they are unchanged) and again before the step.
    assert [c for c in recording.calls if c in order] == ["unscale_", "grads(absorb)", *order[1:]]
    assert stepper.step_count == 1 and not stepper.last_step_skipped
    assert not torch.equal(model.fc1.weight, before)  # the keeper's step moved the 16-bit weights


def test_the_keeper_protocol_is_narrow():
    # issue 43: absorb/expose/clip/drop live inside the keepers; the stepper sees one clip, one gradient read and one
    # end of step; a recast is one more thing the model's weights do (follow_model_weights_(recast=...)), carrying a
    # checkpoint of another mode one more way to load a state (load_state_dict(..., carry_into=module)).
    members = {name for name in vars(WeightKeeper) if not name.startswith("_")} - {"state_key", "defers_unscale",
                                                                                    "exposes_grads"}
    assert members == {"mode", "adopt_optimizer_", "follow_model_weights_", "unscale_", "clip_", "end_step_", "grads",
                       "fp32_weights", "state_tensors", "state_dict", "load_state_dict"}
    methods = members - {"mode"}
    assert len(methods) <= 10
    # The step's methods are written once, in the base every keeper subclasses; the weight modes override private
    # hooks (and say where their gradients live: grads).
    for kind in (PlainKeeper, MasterWeights, CompactWeights):
        assert issubclass(kind, Keeper)
        assert {"clip_", "end_step_", "load_state_dict", "follow_model_weights_"}.isdisjoint(vars(kind))


def test_the_step_path_has_no_weight_mode_branch():
    step_path = ("unscale_", "main_params", "clip_grad_norm_", "clip_grad_value_", "step", "discard_", "drop_grads_",
                 "_record", "scale_loss", "named_grads", "state_tensors")
    for name in step_path:
        source = inspect.getsource(getattr(PrecisionStepper, name))
        code = source.split('"""')[-1]
        assert not re.search(r"\bmaster\b|\bcompact\b|master_mode", code), name
        assert not re.search(r"\b(getattr|hasattr)\(", code), name  # capabilities are the protocols', not sniffed


WEIGHT_MODES = [(False, "fp32"), (True, "fp32"), (True, "bf16"), ("kahan", "fp32"), ("kahan", "bf16"),
                ("stochastic", "fp32"), ("stochastic", "fp8")]


def _adamw_stepper(master_weights, optimizer_state):
    """TinyMLP in bf16-true through a stepper with the given weight and moment modes, and its AdamW."""
    torch.manual_seed(0)
    model = TinyMLP()
    stepper = PrecisionStepper("bf16-true", master_weights=master_weights, device="cpu",
                               optimizer_state=optimizer_state)
    stepper.setup_module(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepper.setup_optimizers(model, [opt])
    return model, stepper, opt


@pytest.mark.parametrize("clip", ["clip_grad_norm_", "clip_grad_value_"])
@pytest.mark.parametrize("master_weights, optimizer_state", WEIGHT_MODES)
def test_a_nan_clip_skips_the_step_and_leaves_the_weights_alone(master_weights, optimizer_state, clip):
    # clip_grad_norm_(max_norm=nan) makes torch's clip factor NaN. The compact keepers fold it into the step's FP32
    # unscale, where no check saw it: the step was applied and wrote NaN into every weight (clip_grad_value_(nan)
    # raised inside the step). Every mode skips it now, as the NaN gradients of the other modes are skipped.
    model, stepper, opt = _adamw_stepper(master_weights, optimizer_state)
    x, y = regression_data(16)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    keeper_before = {name: value.clone() for name, value in stepper.keeper.fp32_weights().items()}
    for limit in (float("nan"), 1.0):  # the skipped step, then a clean one
        with stepper.forward_context():
            loss = torch.nn.functional.mse_loss(model(stepper.convert_input(x)).float(), y)
        stepper.scale_loss(loss).backward()
        getattr(stepper, clip)(opt, limit)
        stepper.step(opt)
        opt.zero_grad()
        if limit != limit:
            assert stepper.last_step_skipped and stepper.skipped_steps == 1
            assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
            assert all(torch.equal(keeper_before[name], value)
                       for name, value in stepper.keeper.fp32_weights().items())
    assert not stepper.last_step_skipped and stepper.step_count == 2  # the next step trains again
    assert all(torch.isfinite(value).all() for value in model.state_dict().values())
    assert not torch.equal(before["fc1.weight"], model.fc1.weight)


@pytest.mark.parametrize("master_weights, optimizer_state", WEIGHT_MODES)
def test_an_unknown_step_keyword_is_refused_in_every_optimizer_state(master_weights, optimizer_state):
    # torch's AdamW.step takes a closure only: with FP32 moments an unknown keyword reached it and raised; the BF16 and
    # FP8 moments stepped the parameters themselves and dropped it without a word.
    model, stepper, opt = _adamw_stepper(master_weights, optimizer_state)
    x, y = regression_data(16)
    with stepper.forward_context():
        loss = torch.nn.functional.mse_loss(model(stepper.convert_input(x)).float(), y)
    stepper.scale_loss(loss).backward()
    with pytest.raises(TypeError, match="grad_scale_hint"):
        stepper.step(opt, grad_scale_hint=2.0)

"""The LossScaler protocol: checked once, when the stepper is built."""

from __future__ import annotations

import pytest
import torch

from lit_mpstable.base.notes import Notes
from lit_mpstable.core.loss_scaler import DynamicLossScaler
from lit_mpstable.core.scalers import ForeignScaler, LossScaler, build_scaler
from lit_mpstable.core.stepper import PrecisionStepper


class NoSyncScaler(DynamicLossScaler):
    """Ours, but with the cross-rank agreement taken away."""

    sync_found_inf_ = None


class SubclassedScaler(torch.amp.GradScaler):
    """A user's GradScaler subclass: nothing overridden."""


def test_a_scaler_missing_a_protocol_method_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"missing \['sync_found_inf_'\]"):
        PrecisionStepper("16-mixed", scaler=NoSyncScaler("cpu"), device="cpu")


def test_a_scaler_without_gradscalers_methods_is_refused_naming_them() -> None:
    class NoUnscale:
        def __getattr__(self, name: str):
            if name == "unscale_":
                raise AttributeError(name)
            return getattr(torch.amp.GradScaler("cpu"), name)

    with pytest.raises(ValueError, match=r"missing \['unscale_'\]"):
        PrecisionStepper("16-mixed", scaler=NoUnscale(), device="cpu")


def test_a_gradscaler_subclass_passes_the_protocol_check() -> None:
    user = SubclassedScaler("cpu", init_scale=256.0)
    warnings = Notes()
    scaler, checker = build_scaler("T", "16-mixed", user, "cpu", skip_nonfinite=True, warnings=warnings)
    assert scaler is user  # the run scales with the user's own object
    assert isinstance(checker, ForeignScaler) and checker.inner is user
    assert isinstance(checker, LossScaler)
    assert not checker.checks_without_unscaling and list(warnings) == []


def test_a_plain_gradscaler_is_adopted_with_its_state() -> None:
    plain = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    scaler, checker = build_scaler("T", "16-mixed", plain, "cpu", skip_nonfinite=True, warnings=Notes())
    assert type(scaler) is DynamicLossScaler and checker is scaler
    assert scaler.get_scale() == 512.0 and scaler.get_growth_interval() == 7


@pytest.mark.parametrize("scaler", ["auto", "dynamic", "adaptive", "static"])
def test_16_true_starts_at_a_scale_whose_seed_gradient_fp16_holds(scaler: str) -> None:
    # The loss computed in the model's own FP16 (no .float()): backward's seed gradient is the scale itself, which
    # must be finite in FP16 (max 65504), or step 0 always overflows and is thrown away.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    stepper = PrecisionStepper("16-true", scaler=scaler, device="cpu")
    stepper.setup_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper.setup_optimizers(model, [optimizer])
    assert stepper.loss_scale == 2.0**15
    loss = model(torch.randn(8, 4, dtype=torch.float16)).square().mean()
    assert loss.dtype == torch.float16
    stepper.scale_loss(loss).backward()
    stepper.step(optimizer)
    assert stepper.skipped_steps == 0


def test_16_true_keeps_a_scale_the_user_gave_and_16_mixed_keeps_gradscalers_default() -> None:
    given = PrecisionStepper("16-true", scaler=DynamicLossScaler("cpu", init_scale=2.0**16), device="cpu")
    assert given.loss_scale == 2.0**16
    assert PrecisionStepper("16-mixed", device="cpu").loss_scale == 2.0**16  # GradScaler's default, unchanged


@pytest.mark.parametrize("call", ["update", "unscale_", "step"])
def test_a_call_before_scale_raises_runtime_error_naming_the_order(call: str) -> None:
    scaler = DynamicLossScaler("cpu")
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.ones(2)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    args = {"update": (), "unscale_": (optimizer,), "step": (optimizer,)}[call]
    with pytest.raises(RuntimeError, match=rf"DynamicLossScaler\.{call}\(\) before scale\(\)"):
        getattr(scaler, call)(*args)


def test_update_without_a_step_raises_runtime_error_naming_the_order() -> None:
    scaler = DynamicLossScaler("cpu")
    scaler.scale(torch.ones(()))
    with pytest.raises(RuntimeError, match=r"DynamicLossScaler\.update\(\): no optimizer was stepped or unscaled"):
        scaler.update()

"""The LossScaler protocol: checked once, when the stepper is built; foreign and adopted scalers count skipped steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import TinyMLP, regression_data

from lit_mpstable.base.notes import Notes
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler
from lit_mpstable.core.scaling.scalers import ForeignScaler, LossScaler, build_scaler
from lit_mpstable.core.step.stepper import PrecisionStepper


class NoSyncScaler(DynamicLossScaler):
    """Ours, but with the checked unscale (and its cross-rank agreement) taken away."""

    check_grads_ = None


class SubclassedScaler(torch.amp.GradScaler):
    """A user's GradScaler subclass: nothing overridden."""


def test_a_scaler_missing_a_protocol_method_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"missing \['check_grads_'\]"):
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


# ---------------------------------------------- foreign and adopted scalers through the stepper: skipped steps counted
TINY = torch.finfo(torch.float32).tiny  # 2**-126
INF = float("inf")


class DuckScaler:
    """A scaler that is no GradScaler: GradScaler's methods, delegated to one it owns."""

    def __init__(self, **kwargs: Any) -> None:
        self._inner = torch.amp.GradScaler("cpu", **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("scale", "unscale_", "step", "update", "get_scale", "state_dict", "load_state_dict", "is_enabled"):
            return getattr(self._inner, name)
        raise AttributeError(name)


def _loop(stepper: PrecisionStepper, steps: int, bad: set[int], *, scheduler: bool = True, clip: bool = False):
    torch.manual_seed(0)
    model = TinyMLP()
    stepper.setup_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler else None
    stepper.setup_optimizers(model, [opt], [sched] if sched else [])
    x, y = regression_data(32)
    for step in range(steps):
        with stepper.forward_context():
            loss = torch.nn.functional.mse_loss(model(stepper.convert_input(x)).float(), y)
        stepper.scale_loss(loss).backward()
        if step in bad:
            model.fc2.weight.grad.view(-1)[0] = INF
        if clip:
            stepper.clip_grad_norm_(opt, 1.0)
        stepper.step(opt)
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return model, opt


@pytest.mark.parametrize("make", [lambda: SubclassedScaler("cpu", init_scale=256.0),
                                  lambda: DuckScaler(init_scale=256.0)], ids=["subclass", "duck"])
@pytest.mark.parametrize("clip", [False, True])
def test_a_foreign_scaler_reports_its_skipped_steps(make, clip: bool) -> None:
    scaler = make()
    stepper = PrecisionStepper("16-mixed", scaler=scaler)
    _, opt = _loop(stepper, 4, {1, 2}, clip=clip)
    assert scaler.get_scale() == 64.0  # it did skip twice (256 -> 128 -> 64)
    assert stepper.overflow_count == stepper.skipped_steps == 2
    assert stepper.applied_steps() == 2
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)  # the LR held on both skipped steps
    assert stepper.scaler is scaler  # the user's object is what the run shows


@pytest.mark.parametrize("precision, make", [
    ("16-mixed", lambda: torch.amp.GradScaler("cpu", init_scale=2.0**-120)),  # adopted
    ("16-true", lambda: "auto"),
], ids=["adopted-gradscaler", "16-true-default"])
def test_after_an_overflow_storm_a_clean_step_writes_finite_weights(precision: str, make) -> None:
    stepper = PrecisionStepper(precision, scaler=make(), master_weights=False)
    if precision == "16-true":
        stepper.scaler.load_state_dict({**stepper.scaler.state_dict(), "scale": 2.0**-120})
    model, _ = _loop(stepper, 14, set(range(12)), scheduler=False)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert stepper.overflow_count == 12
    assert stepper.loss_scale >= TINY
    assert stepper.applied_steps() == 2


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


def _check_at_one(grads: list[torch.Tensor], *, measures_norm: bool = False) -> tuple[float, Any]:
    """The scale-1 check of a run without a scaler over ``grads`` (one parameter each): (found flag, its grad_pass)."""
    _, checker = build_scaler("t", "bf16-mixed", "auto", "cpu", skip_nonfinite=True, warnings=Notes())
    checker.measures_norm = measures_norm
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, grads):
        param.grad = grad
    optimizer = torch.optim.SGD(params, lr=0.1)
    checker.check_grads_(optimizer, "cpu")
    found = sum(float(v) for v in checker._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
    return found, checker.grad_pass(optimizer)


@pytest.mark.parametrize("measures_norm", [False, True], ids=["kernel", "one-pass"])
def test_the_scale_1_check_flags_inf_nan_in_any_dtype_and_leaves_the_gradients_bit_identical(measures_norm):
    """The check of a run without a scaler (GradScaler's kernel once per dtype, or the one pass when the step reads
    the norm): an inf/NaN in any dtype group flags, a clean set does not, and no gradient changes."""
    clean = [torch.randn(4, 3), torch.randn(5, dtype=torch.bfloat16), torch.randn(2, 2)]
    copies = [g.clone() for g in clean]
    found, measured = _check_at_one(clean, measures_norm=measures_norm)
    assert found == 0.0 and all(torch.equal(a, b) for a, b in zip(clean, copies))
    assert (measured is not None) == measures_norm
    if measured is not None:
        torch.testing.assert_close(measured.norm, torch.linalg.vector_norm(torch.cat([g.float().flatten()
                                                                                      for g in clean])))
    for bad in (float("inf"), float("nan")):
        grads = [torch.randn(4, 3), torch.tensor([1.0, bad], dtype=torch.bfloat16)]
        assert _check_at_one(grads, measures_norm=measures_norm)[0] == 1.0
    # A sparse gradient goes through GradScaler's own loop, an FP16 one is refused as GradScaler refuses it.
    sparse = torch.tensor([[0.0, float("inf")], [1.0, 0.0]]).to_sparse()
    assert _check_at_one([torch.randn(3), sparse], measures_norm=measures_norm)[0] == 1.0
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        _check_at_one([torch.randn(3, dtype=torch.float16)], measures_norm=measures_norm)

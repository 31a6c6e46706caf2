"""Loss-scaler bugs found from outside: foreign scalers, the scale floor, data faults, loaded state."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers import TinyMLP, regression_data

from lit_mpstable.scaling import AdaptiveLossScaler, DynamicLossScaler, StaticLossScaler
from lit_mpstable.stepper import PrecisionStepper

INF, NAN = float("inf"), float("nan")


class SubclassedScaler(torch.amp.GradScaler):
    """A user's GradScaler subclass: nothing overridden."""


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
    stepper = PrecisionStepper("32-true", scaler=scaler)
    _, opt = _loop(stepper, 4, {1, 2}, clip=clip)
    assert scaler.get_scale() == 64.0  # it did skip twice (256 -> 128 -> 64)
    assert stepper.overflow_count == stepper.skipped_steps == 2
    assert stepper.applied_steps() == 2
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)  # the LR held on both skipped steps
    assert stepper.scaler is scaler  # the user's object is what the run shows

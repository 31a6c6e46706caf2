"""What reads compact weights' gradients in 16-true, where they stay scaled until the step unscales them in FP32: the
probe measures the true values, as it does on FP32 masters."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import TinyMLP, regression_data
from torch.nn import functional as F

from lit_mpstable.core.step.stepper import PrecisionStepper

X, Y = regression_data(16)
WEIGHT = 2.0**-12  # true gradients that FP16 holds as subnormals; scaled by 2**15 they are normal


def _loss(module: torch.nn.Module, batch) -> torch.Tensor:
    return F.mse_loss(module(batch[0]).float(), batch[1]) * WEIGHT


def _probed(master) -> tuple[PrecisionStepper, TinyMLP]:
    """A 16-true stepper after one scaled backward and its unscale_: where a probe runs."""
    torch.manual_seed(0)
    model = TinyMLP().half().float()  # FP16 values: the masters start where the compact weights do
    stepper = PrecisionStepper("16-true", master_weights=master, device="cpu")
    stepper.setup_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stepper.setup_optimizers(model, [optimizer])
    with stepper.forward_context():
        loss = _loss(model, (stepper.convert_input(X), Y))
    stepper.scale_loss(loss).backward()
    stepper.unscale_(optimizer)
    return stepper, model


@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
def test_the_probe_measures_the_true_gradients_as_on_fp32_masters(mode: str) -> None:
    stepper, model = _probed(mode)
    batch = (stepper.convert_input(X), Y)
    result = stepper.measure(model, _loss, batch)
    # Independently: the scaled FP16 gradients unscaled in FP32, against FP32 gradients of an FP32 copy.
    run = torch.cat([p.grad.double().flatten() / stepper.loss_scale for p in model.parameters()])
    reference = copy.deepcopy(model).float()
    loss = _loss(reference, (batch[0].float(), Y))
    fp32 = torch.cat([g.double().flatten() for g in torch.autograd.grad(loss, list(reference.parameters()))])
    expected = (torch.linalg.vector_norm(run - fp32) / torch.linalg.vector_norm(fp32)).item()
    assert result["rel_error"] == pytest.approx(expected, rel=1e-6) and result["rel_error"] < 0.01
    masters, masters_model = _probed(True)
    assert result["rel_error"] == pytest.approx(masters.measure(masters_model, _loss, batch)["rel_error"], rel=1e-6)
    # The recompute unscales as the step does, in FP32: no FP16 subnormal rounding the step never makes.
    assert stepper.measure(model, _loss, batch, recompute=True)["rel_error"] == pytest.approx(result["rel_error"],
                                                                                               rel=1e-6)

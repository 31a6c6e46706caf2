"""NaN origin in a plain loop: a skipped step replayed traced (``trace_skipped_step``) names the module where inf/NaN
first appeared, in the forward or the backward, where the stepper's own blame at the skip (a guess from the
parameters' gradients) names another; clean steps are not traced."""

from __future__ import annotations

import pytest
import torch
from helpers import TinyMLP, regression_data
from torch import nn

from lit_mpstable.core.attribution import locate_nonfinite, rng_state
from lit_mpstable.core.step.stepper import PrecisionStepper


class _Inject:
    """One NaN written, when armed, into a module's output (forward) or into the gradient its backward passes on."""

    def __init__(self, module: nn.Module, kind: str) -> None:
        self.armed = False
        if kind == "forward":
            module.register_forward_hook(self._forward)
        else:
            module.register_full_backward_hook(self._backward)

    def _forward(self, module, args, output):
        if self.armed:
            output = output.clone()
            output.view(-1)[3] = float("nan")
            return output
        return None

    def _backward(self, module, grad_input, grad_output):
        if self.armed:
            # the whole gradient: a single NaN could fall where the ReLU before the module passes nothing back
            return (torch.full_like(grad_input[0], float("nan")), *grad_input[1:])
        return None


def _loop(kind: str, layer: str, *, dropout: bool = False):
    torch.manual_seed(0)
    model = TinyMLP()
    if dropout:
        model.act = nn.Sequential(nn.ReLU(), nn.Dropout(0.5))
    inject = _Inject(getattr(model, layer), kind)
    stepper = PrecisionStepper("32-true", device="cpu", telemetry_every_n_steps=None)
    stepper.setup_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stepper.setup_optimizers(model, [opt])
    x, y = regression_data(8)

    def forward() -> torch.Tensor:
        with stepper.forward_context():
            return nn.functional.mse_loss(model(x), y)

    def step(armed: bool):
        inject.armed = armed
        rng = rng_state()
        stepper.scale_loss(forward()).backward()
        stepper.step(opt)
        opt.zero_grad(set_to_none=True)
        return rng

    return model, stepper, forward, step, inject


@pytest.mark.parametrize(("kind", "layer"), [("forward", "fc1"), ("forward", "fc2"), ("backward", "fc2"),
                                             ("backward", "fc3")])
def test_a_skipped_step_replayed_names_the_injected_module(kind, layer):
    model, stepper, forward, step, _ = _loop(kind, layer)
    step(False)
    rng = step(True)
    assert stepper.last_step_skipped
    guess = stepper.stats["blamed_modules"]
    assert guess != [layer]  # the guess from the parameters' gradients alone names a neighbour
    assert stepper.trace_skipped_step(forward, rng=rng) == layer
    assert stepper.stats["blamed_modules"] == [layer]
    assert stepper.stats["nan_origin"] == {"module": layer, "where": kind}
    assert any(repr(layer) in w for w in stepper.warnings)
    assert all(p.grad is None for p in model.parameters())  # the replay's gradients are dropped


def test_the_next_step_is_not_traced_and_a_finite_replay_blames_nobody():
    model, stepper, forward, step, inject = _loop("forward", "fc2")
    rng = step(True)
    inject.armed = False  # the fault came and went
    assert stepper.trace_skipped_step(forward, rng=rng) is None
    assert stepper.stats["nan_origin"] is None and "came and went" in stepper.warnings[-1]
    assert stepper.observer.tracer is None  # the blame armed it; the replay found the origin, so it is dropped
    step(False)
    assert not stepper.last_step_skipped


def test_the_replay_restores_the_step_rng_and_leaves_the_stream_where_it_was():
    _, stepper, forward, step, _ = _loop("forward", "fc2", dropout=True)
    rng = step(True)
    after = torch.get_rng_state()
    losses = []
    for _ in range(2):
        locate_nonfinite(stepper.layout.module, lambda: losses.append(forward()) or losses[-1], rng=rng)
    assert torch.equal(torch.get_rng_state(), after)
    torch.set_rng_state(rng[0])
    assert torch.isnan(forward())  # the same dropout masks: the same NaN loss as the step and both replays
    assert all(torch.isnan(loss) for loss in losses)


def test_a_compiled_submodule_is_traced_inside():
    torch.manual_seed(0)
    model = TinyMLP()
    inject = _Inject(model.fc2, "forward")
    model.fc2.compile(backend="eager")
    x, y = regression_data(8)
    for armed in (False, True):
        inject.armed = armed
        nn.functional.mse_loss(model(x), y).backward()  # compiled, hook included
        model.zero_grad(set_to_none=True)
    origin = locate_nonfinite(model, lambda: nn.functional.mse_loss(model(x), y))
    assert origin is not None and origin.module == "fc2" and origin.where == "forward"


def test_a_nonfinite_batch_blames_no_module():
    model = TinyMLP()
    x, y = regression_data(8)
    x[0, 0] = float("nan")
    origin = locate_nonfinite(model, lambda: nn.functional.mse_loss(model(x), y))
    assert origin is not None and origin.where == "input" and origin.module == ""


@pytest.mark.parametrize(("kwargs", "error", "name"), [
    ({"model": "net"}, TypeError, "model="), ({"forward": 3}, TypeError, "forward="),
    ({"scale": 0.0}, ValueError, "scale=0.0"), ({"scale": float("inf")}, ValueError, "scale=inf"),
    ({"scale": True}, ValueError, "scale=True"), ({"forward": lambda: 1.0}, TypeError, "returned float"),
])
def test_bad_arguments_are_named(kwargs, error, name):
    model = TinyMLP()
    x, y = regression_data(8)
    args = {"model": model, "forward": lambda: nn.functional.mse_loss(model(x), y), **kwargs}
    with pytest.raises(error, match=name):
        locate_nonfinite(args.pop("model"), args.pop("forward"), **args)


def test_trace_skipped_step_needs_a_model():
    with pytest.raises(ValueError, match="setup_module"):
        PrecisionStepper("32-true", device="cpu").trace_skipped_step(lambda: torch.zeros(()))

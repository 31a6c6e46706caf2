"""GrowthMonitor's on-demand hooks: the stepper hooks the layers only for a sampled forward, so the steps between
samples run unhooked and a compiled model's graph never holds a hook (it neither breaks nor recompiles)."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import OpNames, TinyMLP, regression_data
from torch import nn

from lit_mpstable.core.guards.growth import GrowthMonitor
from lit_mpstable.core.step.stepper import PrecisionStepper


def _train(steps: int, *, hooks: str = "on_demand", compile_model: bool = False, inside: bool = True,
           seen: list | None = None) -> PrecisionStepper:
    torch.manual_seed(0)
    model = TinyMLP()
    stepper = PrecisionStepper("bf16-mixed", device="cpu", growth_every_n_steps=2)
    stepper.setup_module(model)
    if hooks == "always":  # the same monitor hooked for good, as a standalone user attaches it
        stepper.growth.detach()
        stepper.growth.attach(model)
    if compile_model:
        model.compile(backend="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepper.setup_optimizers(model, [opt])
    x, y = regression_data(32)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for _ in range(steps):
        if inside:
            with stepper.forward_context():
                if seen is not None:  # the hooks the layers carry during this forward
                    seen.append(sum(len(m._forward_hooks) for m in linears))
                out = model(x)
        else:
            out = model(x)
        stepper.scale_loss(nn.functional.mse_loss(out.float(), y)).backward()
        stepper.step(opt)
        opt.zero_grad()
    if seen is not None:
        seen.append(sum(len(m._forward_hooks) for m in linears))  # after the run
    return stepper


def test_layers_are_hooked_for_sampled_forwards_only_and_sample_as_permanent_hooks_do() -> None:
    seen: list[int] = []
    on_demand = _train(7, seen=seen)
    layers = len(on_demand.growth._history)
    assert layers >= 2
    assert seen == [layers, 0, layers, 0, layers, 0, layers, 0]  # steps 0, 2, 4, 6 sampled; unhooked after
    always = _train(7, hooks="always")
    assert on_demand.growth.samples == always.growth.samples == 4 * layers
    for name, history in always.growth._history.items():
        assert on_demand.growth._history[name].steps == history.steps == [0, 2, 4, 6]
        torch.testing.assert_close(on_demand.growth._history[name].rows, history.rows, rtol=0, atol=0)


def test_a_compiled_model_samples_without_recompiling() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    stepper = _train(12, compile_model=True)
    graphs = counters["stats"]["unique_graphs"]
    # Permanent hooks read the step count inside the traced hook: each new count recompiled it until torch.compile's
    # recompile limit (8 graphs of the hook alone). On-demand hooks: the sampled forwards run eagerly.
    assert graphs <= 2, f"{graphs} graphs compiled"
    assert stepper.growth.samples == 6 * len(stepper.growth._history)
    torch._dynamo.reset()


def test_a_forward_outside_the_forward_context_is_warned_once() -> None:
    with pytest.warns(UserWarning, match="no training forward ran inside the precision's forward context") as record:
        stepper = _train(6, inside=False)
    assert sum("growth sample" in str(w.message) for w in record) == 1
    assert stepper.growth.samples == 0


def test_a_count_that_jumps_is_no_missed_sample() -> None:
    """A resume from a checkpoint without the monitor's state moves its count from 0 to the run's: no forward was
    due in between, so nothing is warned; one unsampled due step followed as it happened is."""
    count = [0]
    monitor = GrowthMonitor(every_n_steps=2, clock=lambda: count[0]).attach(TinyMLP(), hooks="on_demand")
    count[0] = 60
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert monitor.due()
        count[0] = 61
        with pytest.warns(UserWarning, match="step 60 was due"):
            assert not monitor.due()


def test_an_unknown_hooks_choice_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"attach\(hooks='sometimes'\).*'always', 'on_demand'"):
        GrowthMonitor().attach(TinyMLP(), hooks="sometimes")  # type: ignore[arg-type]


def test_the_warnings_read_after_a_sample_is_one_read_of_the_ring_buffer() -> None:
    """``runaway_layers()`` after a new sample: the flush of the queued samples (~25 ops for all layers) and one read;
    the fit runs on the host. It used to build the latest rows and the fit on the device twice (stats, then runaway
    read the stats again): 50 ops on this model."""
    from lit_mpstable import StablePrecision

    plugin = StablePrecision("bf16-mixed", growth_every_n_steps=2)
    module = plugin.convert_module(TinyMLP())
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    plugin.stepper.setup_optimizers(module, [opt])
    x, y = regression_data(16)
    for _ in range(5):
        with plugin.forward_context():
            loss = nn.functional.mse_loss(module(x).float(), y)
        plugin.stepper.scale_loss(loss).backward()
        plugin.stepper.step(opt)
        opt.zero_grad()
    with OpNames() as ops:
        named = plugin.runaway_layers()
    assert named == [] and plugin.stepper.stats["growth"]
    assert len(ops.names) <= 30, (len(ops.names), ops.names)
    assert ops.names.count("aten.index_put_.default") == 1  # the flush's write; nothing more is built
    stats = plugin.stepper.stats["growth"]
    assert plugin.stepper.growth.runaway(stats=stats) == plugin.stepper.growth.runaway()

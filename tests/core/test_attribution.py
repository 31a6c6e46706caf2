"""Overflow attribution: an inf injected into one named layer is blamed on that layer and no other."""

from __future__ import annotations

import pytest
import torch
from helpers import TinyMLP, inject_overflow, regression_data
from torch import nn

from lit_mpstable.core.attribution import OverflowTracer, _ends, _finite, nonfinite_grad_params, trace_nonfinite


def _backward(model: nn.Module, scale: float = 1.0) -> None:
    x, y = regression_data(8)
    (nn.functional.mse_loss(model(x), y) * scale).backward()


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("layer", ["fc1", "fc2", "fc3"])
def test_injected_overflow_is_attributed_to_its_layer_only(layer, value):
    model = TinyMLP()
    seen = inject_overflow(getattr(model, layer), steps=[0], value=value)
    with trace_nonfinite(model) as tracer:
        _backward(model)
    assert seen == [0]
    assert nonfinite_grad_params(model) == [f"{layer}.weight"]
    assert tracer.first_backward == layer and tracer.backward_modules == [layer]
    assert tracer.first_forward is None and tracer.forward_modules == []


def test_clean_step_blames_nothing():
    model = TinyMLP()
    with trace_nonfinite(model) as tracer:
        _backward(model)
    assert nonfinite_grad_params(model.named_parameters()) == []
    assert tracer.first_forward is None and tracer.first_backward is None


def test_forward_overflow_names_the_first_module_in_execution_order():
    model = TinyMLP()
    with torch.no_grad():
        model.fc2.bias[3] = float("inf")
    with trace_nonfinite(model) as tracer:
        _backward(model)
    assert tracer.first_forward == "fc2"
    # Only modules whose inputs were finite made the inf: fc2, and the root that contains it (act and fc3 passed
    # fc2's inf along). The root ("") finishes last.
    assert tracer.forward_modules == ["fc2", ""]
    assert tracer.first_backward == "fc3"  # the NaN loss gradient first arrives at fc3's output (grad_output)


def test_activation_gradient_overflow_is_blamed_on_the_module_whose_backward_made_it():
    # fc3's weight is finite but huge: fc3's gradient with respect to its input (grad_input) overflows, fc3's own
    # weight gradient does not, and everything upstream inherits the inf.
    model = TinyMLP()
    with torch.no_grad():
        model.fc3.weight[0].fill_(1e30)
    with trace_nonfinite(model) as tracer:
        out = model(regression_data(8)[0] * 1e-3)
        (out[:, 0] * 1e15).sum().backward()
    assert tracer.first_forward is None
    assert nonfinite_grad_params(model) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]  # not fc3
    assert tracer.first_backward == "fc3"
    assert tracer.backward_modules == ["fc3", "act", "fc2", "fc1"]


def test_nested_transformer_layer_blames_the_leaf():
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2)
    inject_overflow(model.layers[1].linear1, steps=[0])
    with trace_nonfinite(model) as tracer:
        model(torch.randn(2, 5, 16)).square().mean().backward()
    assert tracer.first_backward == "layers.1.linear1" and tracer.backward_modules == ["layers.1.linear1"]
    assert nonfinite_grad_params(model) == ["layers.1.linear1.weight"]


def test_in_place_activation_is_supported():
    # Full module backward hooks would raise here ("a view ... is being modified inplace").
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    inject_overflow(model[0], steps=[0])
    with trace_nonfinite(model) as tracer:
        model(torch.randn(3, 4)).sum().backward()
    assert tracer.first_backward == "0"


def test_hooks_are_removed_on_exit_and_events_can_be_reset():
    model = TinyMLP()
    inject_overflow(model.fc1, steps=[0])
    tracer = OverflowTracer(model)
    with tracer:
        _backward(model)
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    for param in model.parameters():
        assert not getattr(param, "_post_accumulate_grad_hooks", None)
    assert tracer.first_backward == "fc1"  # still readable after exit
    tracer.reset()
    assert tracer.first_backward is None
    model.zero_grad()
    tracer.attach()
    _backward(model)  # inject_overflow fires on the first backward only
    tracer.detach()
    assert tracer.first_backward is None


def test_rejects_a_non_module():
    with pytest.raises(TypeError, match="model"):
        OverflowTracer([nn.Linear(2, 2)])


def test_a_nonfinite_input_batch_is_reported_as_such_and_no_layer_is_blamed():
    # A NaN in the data passes through every layer; blaming the first (or last) layer would move the wrong module.
    model = TinyMLP()
    x = torch.randn(4, 16)
    x[1, 2] = float("nan")
    with trace_nonfinite(model) as tracer:
        model(x).sum().backward()
    assert tracer.nonfinite_input
    assert tracer.first_forward is None and tracer.forward_modules == []
    with trace_nonfinite(model) as clean:
        model(torch.randn(4, 16)).sum()
    assert not clean.nonfinite_input


def _any_nonfinite(tensors: list[torch.Tensor]) -> bool:
    return not all(_finite(_ends(tensors)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_tensors_ends_find_one_bad_element_anywhere_as_isfinite_does(dtype):
    # The tracer judges a tensor by its minimum and maximum (_ends), read together (_finite).
    g = torch.Generator().manual_seed(0)
    for shape in [(), (1,), (7, 13), (3, 5, 4)]:
        clean = torch.randn(shape, generator=g).to(dtype)
        assert not _any_nonfinite([clean, torch.empty(0, dtype=dtype)])
        for bad in (float("nan"), float("inf"), -float("inf")):
            for index in range(clean.numel()):
                t = clean.clone()
                t.view(-1)[index] = bad
                assert _any_nonfinite([clean, t]) == bool((~torch.isfinite(t)).any()), (shape, bad, index)
    assert not _any_nonfinite([]) and not _any_nonfinite([torch.empty(0, 3, dtype=dtype)])


def test_a_traced_step_reads_the_host_once_however_often_and_whatever_dtypes_it_saw():
    # The hooks keep each tensor's ends on the device; the first reading decides every event at once (FP32, BF16 and
    # FP16 ends side by side), and the readings after it reuse that answer.
    from helpers import HostReads

    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 4).to(torch.float16))
    with torch.no_grad():
        model[1].bias[2] = float("inf")
    tracer = OverflowTracer(model).attach()
    with HostReads() as traced:
        out = model[2](model[1](model[0](torch.randn(3, 6)).bfloat16()).half())  # the three layers, and not the root
        out.float().sum().backward()
    with HostReads() as reads:
        verdict = (tracer.first_forward, tracer.forward_modules, tracer.first_backward, tracer.backward_modules,
                   tracer.nonfinite_input)
    tracer.detach()
    assert traced.ops == [] and reads.ops == ["tolist"]
    # Layer 1 made the inf; in backward only layer 2's weight gradient (its input held the inf) is not finite.
    assert verdict == ("1", ["1"], "2", ["2"], False)


def test_a_tracer_attached_again_reports_each_step_as_a_fresh_tracer_does():
    # An overflow storm arms the same tracer step after step (GradObserver): after reset, nothing of the last step
    # shows, whichever layer overflows now, in the forward, the backward or the batch.
    model, x = TinyMLP(), regression_data(8)[0]
    now = {"fault": ""}
    column = torch.tensor([0])
    model.fc2.register_forward_hook(
        lambda m, a, out: out.index_fill(1, column, float("nan")) if now["fault"] == "forward" else None)
    model.fc1.weight.register_hook(
        lambda g: g.index_fill(1, column, float("inf")) if now["fault"] == "backward" else None)

    def step(tracer: OverflowTracer) -> tuple[object, ...]:
        batch = x.index_fill(1, column, float("inf")) if now["fault"] == "input" else x
        with tracer:
            model(batch).sum().backward()
        model.zero_grad(set_to_none=True)
        return (tracer.nonfinite_input, tracer.first_forward, tracer.forward_modules, tracer.first_backward,
                tracer.backward_modules)

    reused, seen = OverflowTracer(model), []
    for fault in ["backward", "", "forward", "input", "", "backward", "forward"]:
        now["fault"] = fault
        fresh = step(OverflowTracer(model))
        reused.reset()
        assert step(reused) == fresh, fault
        seen.append(fresh)
    assert seen[0][3] == "fc1" and seen[2][1] == "fc2" and seen[3][0] and seen[1] == (False, None, [], None, [])

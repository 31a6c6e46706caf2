"""The inf/NaN check of compact weights' step (DynamicLossScaler.check_ on the CPU): it reads each large gradient once
and writes none, and a non-finite gradient still skips the step with nothing written."""

from __future__ import annotations

import pytest
import torch
from helpers import mse_backward, regression_data, tiny_stepper
from torch.utils._python_dispatch import TorchDispatchMode

from lit_mpstable.core.scaling import loss_scaler
from lit_mpstable.core.scaling.loss_scaler import READ_ONLY_MIN, StaticLossScaler, nonfinite_on_cpu

INF, NAN = float("inf"), float("nan")


class _Calls(TorchDispatchMode):
    """Records every ATen operation with the tensors it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[torch.Tensor]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else [arg])]
        self.calls.append((func.__name__, [a for a in flat if isinstance(a, torch.Tensor)]))
        return func(*args, **(kwargs or {}))


def _grads(dtype: torch.dtype = torch.bfloat16) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    # Two gradients the read-only reduction takes (READ_ONLY_MIN elements and more), two small ones, an empty one.
    g = torch.Generator().manual_seed(0)
    shapes = [(READ_ONLY_MIN // 256, 256), (16,), (READ_ONLY_MIN + 3,), (3, 5), (0,)]
    params = [torch.nn.Parameter(torch.randn(*shape, generator=g).to(dtype)) for shape in shapes]
    params.append(torch.nn.Parameter(torch.zeros(4, dtype=dtype)))  # no gradient
    for p in params[:5]:
        p.grad = torch.randn(p.shape, generator=g).to(dtype)
    return torch.optim.AdamW(params), [p.grad for p in params[:5]]


@pytest.mark.parametrize(("dtype", "reduction"), [(torch.bfloat16, "sum"), (torch.float32, "sum"),
                                                  (torch.float16, "aminmax")])
def test_the_check_reads_each_large_gradient_once_and_writes_none(dtype: torch.dtype, reduction: str) -> None:
    # GradScaler's check-and-unscale kernel at scale 1 wrote every element back (x * 1) and bumped every gradient's
    # version; now a large gradient is read once (its sum; FP16: its minimum and maximum), and only the small ones go
    # through the kernel, in one call.
    optimizer, grads = _grads(dtype)
    large, small = [grads[0], grads[2]], [grads[1], grads[3]]
    scaler = StaticLossScaler("cpu", init_scale=1.0)
    scaler.ensure_state_("cpu")
    versions = [g._version for g in large]
    with _Calls() as seen:
        scaler.check_(optimizer)
    names = [name for name, _ in seen.calls]
    reads = [tensors[0] for name, tensors in seen.calls if name.split(".")[0] in ("sum", "aminmax")]
    assert {name.split(".")[0] for name in names} & {"sum", "aminmax"} == {reduction}, names
    assert [id(t) for t in reads] == [id(g) for g in large], names  # each once
    kernel = [tensors for name, tensors in seen.calls if name.startswith("_amp_foreach_non_finite_check_and_unscale_")]
    assert len(kernel) == 1 and [id(t) for t in kernel[0][: len(small)]] == [id(g) for g in small], names
    assert all(id(t) not in {id(g) for g in large} for t in kernel[0])
    assert [g._version for g in large] == versions
    assert not scaler.found_inf(optimizer)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_the_check_finds_any_nonfinite_element(dtype: torch.dtype, bad: float) -> None:
    optimizer, grads = _grads(dtype)
    # Vector lanes and the tail of the reduction in a large gradient; a small one.
    for grad, index in [(grads[0], 0), (grads[0], 17), (grads[0], READ_ONLY_MIN - 1), (grads[2], READ_ONLY_MIN + 2),
                        (grads[1], 5), (grads[3], 14)]:
        g = grad.view(-1)
        before = g[index].clone()
        g[index] = bad
        found = nonfinite_on_cpu(optimizer)
        assert found is not None and float(found[torch.device("cpu")]) == 1.0, (grad.shape, index, bad)
        g[index] = before
    found = nonfinite_on_cpu(optimizer)
    assert found is not None and float(found[torch.device("cpu")]) == 0.0


def test_large_fp16_gradients_that_add_up_past_65504_are_finite() -> None:
    # Scaled FP16 gradients are large by design: their FP16 sum would be inf. They are read by aminmax instead.
    optimizer, grads = _grads(torch.float16)
    grads[0].fill_(60000.0)
    grads[2].fill_(-60000.0)
    found = nonfinite_on_cpu(optimizer)
    assert found is not None and float(found[torch.device("cpu")]) == 0.0


def test_a_bf16_gradient_whose_sum_leaves_fp32s_range_flags_the_step() -> None:
    # The documented edge of the sum: finite elements of 1e34 (their square, 1e68, is inf in Adam's second moment)
    # adding up past 3.4e38; one element that large alone is not flagged.
    optimizer, grads = _grads(torch.bfloat16)
    grads[0].view(-1)[0] = 1e34
    found = nonfinite_on_cpu(optimizer)
    assert found is not None and float(found[torch.device("cpu")]) == 0.0
    grads[0].fill_(1e34)
    found = nonfinite_on_cpu(optimizer)
    assert found is not None and float(found[torch.device("cpu")]) == 1.0


def test_sparse_gradients_take_gradscalers_kernel() -> None:
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    embedding(torch.tensor([1, 2])).sum().backward()
    optimizer = torch.optim.SGD(embedding.parameters(), lr=0.1)
    assert nonfinite_on_cpu(optimizer) is None
    embedding.weight.grad._values()[0, 0] = INF
    scaler = StaticLossScaler("cpu", init_scale=1.0)
    scaler.ensure_state_("cpu")
    scaler.check_(optimizer)
    assert scaler.found_inf(optimizer)


@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
@pytest.mark.parametrize("read_only", [True, False], ids=["read-only", "kernel"])
def test_a_nonfinite_gradient_skips_the_compact_step_and_writes_nothing(mode: str, bad: float, read_only: bool,
                                                                        monkeypatch) -> None:
    # TinyMLP's gradients are small: READ_ONLY_MIN = 1 sends them all through the read-only reduction.
    monkeypatch.setattr(loss_scaler, "READ_ONLY_MIN", 1 if read_only else loss_scaler.READ_ONLY_MIN)
    model, stepper, optimizer = tiny_stepper(master_weights=mode)
    x, y = regression_data(16)

    def backward(bad: float | None = None) -> None:
        mse_backward(stepper, model, x, y)
        if bad is not None:
            model.fc2.weight.grad.view(-1)[1] = bad

    backward()
    stepper.step(optimizer)  # a clean step first: moments and compensations exist
    optimizer.zero_grad()
    before = [t.clone() for t in [*model.parameters(), *stepper.keeper.state_tensors()]]
    moments = [t.clone() for s in optimizer.state.values() for t in s.values()]
    backward(bad)
    grad_version = model.fc2.weight.grad._version
    stepper.step(optimizer)
    assert stepper.skipped_steps == 1 and stepper.applied_steps() == 1
    after = [*model.parameters(), *stepper.keeper.state_tensors()]
    for a, b in zip(after, before):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        assert bool(torch.isfinite(a).all())
    for a, b in zip([t for s in optimizer.state.values() for t in s.values()], moments):
        assert torch.equal(a, b)
    if read_only:
        assert model.fc2.weight.grad is not None and model.fc2.weight.grad._version == grad_version  # only read
    optimizer.zero_grad()
    backward()
    stepper.step(optimizer)  # and the next clean step applies
    assert stepper.skipped_steps == 1 and stepper.applied_steps() == 2

"""The probe's measurement (plain PyTorch loops through the stepper), the scaler it feeds, and its figure.

Expectations are computed independently: FP32 gradients by hand on a copy of the model, the run's gradients read off
``.grad``, counts and norms with torch's own reductions.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch._dynamo  # noqa: F401  (the first Optimizer() imports it: pay it at collection, not in a test)
from helpers import TinyMLP, regression_data
from torch import nn
from torch.nn import functional as F

from lit_mpstable.app.report_probe import probe_matrix, write_probe_figure
from lit_mpstable.core.scaling.adaptive_scaler import AdaptiveLossScaler
from lit_mpstable.core.step.probe import (
    _BLOCK,
    _CHUNK,
    _chunks,
    _metrics,
    _module_sums,
    metric_vector,
    with_metric_vector,
)
from lit_mpstable.core.step.stepper import PrecisionStepper
from lit_mpstable.fp8 import convert_from_fp8

X, Y = regression_data(16)


def _mse(weight: float = 1.0):
    def loss_fn(module: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(module(x).float(), y) * weight

    return loss_fn


def _backward(stepper: PrecisionStepper, model: nn.Module, loss_fn, batch=(X, Y)) -> torch.optim.Optimizer:
    """One forward and scaled backward through the stepper, gradients unscaled: where a probe runs."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stepper.setup_optimizers(model, [optimizer])
    with stepper.forward_context():
        loss = loss_fn(model, (stepper.convert_input(batch[0]), batch[1]))
    stepper.scale_loss(loss).backward()
    stepper.unscale_(optimizer)
    return optimizer


def _setup(precision: str, model: nn.Module | None = None, **kwargs) -> tuple[PrecisionStepper, nn.Module]:
    stepper = PrecisionStepper(precision, device="cpu", **kwargs)
    model = model if model is not None else TinyMLP()
    stepper.setup_module(model)
    return stepper, model


def _fp32_grads(model: nn.Module, loss_fn, batch=(X, Y)) -> dict[str, torch.Tensor]:
    """FP32 gradients by hand: a plain FP32 copy, plain autograd."""
    reference = copy.deepcopy(model).float()
    loss = loss_fn(reference, tuple(t.float() for t in batch))
    names, params = zip(*reference.named_parameters())
    return dict(zip(names, torch.autograd.grad(loss, params)))


def _expected(run: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    g = torch.cat([run[n].double().flatten() for n in ref])
    r = torch.cat([ref[n].double().flatten() for n in ref])
    nonzero = r != 0
    return {
        "underflow_frac": ((g == 0) & nonzero).sum().item() / nonzero.sum().item(),
        "rel_error": (torch.linalg.vector_norm(g - r) / torch.linalg.vector_norm(r)).item(),
        "cosine": F.cosine_similarity(g, r, dim=0).item(),
    }


# ------------------------------------------------------------------------------------------------ accuracy
@pytest.mark.parametrize(("scaler", "weight"), [(None, 2.0**-24), (None, 2.0**-30), ("dynamic", 2.0**-24)])
def test_measured_underflow_and_errors_match_an_independent_count(scaler, weight) -> None:
    # FP16 without a scaler flushes gradients below 6e-8: most of them at a 2**-24 loss weight, all at 2**-30.
    stepper, model = _setup("16-mixed", scaler=scaler)
    loss_fn = _mse(weight)
    _backward(stepper, model, loss_fn)
    run = {n: p.grad for n, p in model.named_parameters()}
    ref = _fp32_grads(model, loss_fn)
    result = stepper.measure(model, loss_fn, (X, Y), step=0)
    expected = _expected(run, ref)
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    for module in ("fc1", "fc2", "fc3"):
        own = [n for n in ref if n.startswith(module + ".")]
        assert result["modules"][module]["underflow_frac"] == pytest.approx(
            _expected({n: run[n] for n in own}, {n: ref[n] for n in own})["underflow_frac"])
        assert result["modules"][module]["numel"] == sum(ref[n].numel() for n in own)
    assert result["finite"] and result["step"] == 0 and not result["recomputed"]
    if scaler is None and weight == 2.0**-30:
        assert result["underflow_frac"] == 1.0 and result["rel_error"] == 1.0  # every gradient flushed
    if scaler == "dynamic":
        assert result["underflow_frac"] < 0.01 and result["loss_scale"] == 2.0**16


def test_an_fp32_run_measures_exactly_no_error() -> None:
    stepper, model = _setup("32-true")
    _backward(stepper, model, _mse())
    result = stepper.measure(model, _mse(), (X, Y))
    assert result["underflow_frac"] == 0.0 and result["rel_error"] == 0.0 and result["cosine"] == pytest.approx(1.0)
    assert all(m["rel_error"] == 0.0 for m in result["modules"].values())


def test_the_reference_weights_are_the_fp32_masters() -> None:
    # bf16-true: the model computes with BF16 weights, the masters hold FP32 values below BF16's resolution. The
    # reference must run with the masters (the more precise weights), not the BF16 ones upcast.
    stepper, model = _setup("bf16-true")
    loss_fn = _mse()
    optimizer = _backward(stepper, model, loss_fn)
    masters = {name: master for name, master, _ in stepper.keeper.named_pairs()}
    with torch.no_grad():
        for master in masters.values():
            master.add_(2.0**-12)  # invisible in BF16 around 0.1-1 (ulp 2**-10 .. 2**-7)
    run = {n: masters[n].grad for n in masters}
    fp32 = TinyMLP()
    fp32.load_state_dict({n: m.detach() for n, m in masters.items()})
    batch = (stepper.convert_input(X), Y)  # the BF16 batch the step saw; the reference upcasts it
    expected = _expected(run, _fp32_grads(fp32, loss_fn, batch))
    result = stepper.measure(model, loss_fn, batch)
    assert result["rel_error"] == pytest.approx(expected["rel_error"], rel=1e-9)
    upcast = _expected(run, _fp32_grads(model, loss_fn, batch))
    assert abs(upcast["rel_error"] - expected["rel_error"]) > 1e-4  # the test can tell the two apart
    assert optimizer.state == {}


@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
def test_with_compact_weights_the_reference_weights_are_the_compensated_values(mode: str) -> None:
    # master_weights='kahan': a weight's value is its BF16 part plus its compensation, which the FP32 reference must
    # use; 'stochastic': the BF16 weights are the values. The run's gradients are the BF16 parameters' own.
    stepper, model = _setup("bf16-true", master_weights=mode)
    loss_fn = _mse()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stepper.setup_optimizers(model, [optimizer])
    for _ in range(3):  # a few steps, so compensation holds something
        with stepper.forward_context():
            loss = loss_fn(model, (stepper.convert_input(X), Y))
        stepper.scale_loss(loss).backward()
        stepper.unscale_(optimizer)
        stepper.step(optimizer)
    comp = stepper.keeper.state_dict()["compensation"]
    assert (mode == "kahan") == bool(comp) and all(bool(c.any()) for c in comp.values())
    with stepper.forward_context():
        loss = loss_fn(model, (stepper.convert_input(X), Y))
    stepper.scale_loss(loss).backward()
    stepper.unscale_(optimizer)
    run = {n: p.grad for n, p in model.named_parameters()}
    fp32 = TinyMLP()
    fp32.load_state_dict({n: p.detach().float() + (comp[n].float() if n in comp else 0)
                          for n, p in model.named_parameters()})
    batch = (stepper.convert_input(X), Y)
    expected = _expected(run, _fp32_grads(fp32, loss_fn, batch))
    result = stepper.measure(model, loss_fn, batch)
    assert result["rel_error"] == pytest.approx(expected["rel_error"], rel=1e-9)
    if mode == "kahan":
        upcast = _expected(run, _fp32_grads(model, loss_fn, batch))
        assert abs(upcast["rel_error"] - expected["rel_error"]) > 1e-6  # the test can tell the two apart


def test_recompute_runs_the_op_policy_the_step_ran() -> None:
    # op_policy={'matmul': 'fp32'}: the step's linears compute in FP32 under bf16-mixed. The recomputed run gradient
    # follows the policy, so it reads what the step's own gradient reads; without the policy (plain autocast) the
    # error would be BF16's, orders of magnitude larger.
    stepper, model = _setup("bf16-mixed", op_policy={"matmul": "fp32"})
    loss_fn = _mse()
    _backward(stepper, model, loss_fn)
    own = stepper.measure(model, loss_fn, (X, Y))
    recomputed = stepper.measure(model, loss_fn, (X, Y), recompute=True)
    assert recomputed["rel_error"] == pytest.approx(own["rel_error"], rel=1e-6, abs=1e-12)
    plain, plain_model = _setup("bf16-mixed")
    plain_model.load_state_dict(model.state_dict())
    _backward(plain, plain_model, loss_fn)
    assert plain.measure(plain_model, loss_fn, (X, Y))["rel_error"] > 100 * own["rel_error"]


def test_fp32_islands_of_a_true_16bit_run_stay_fp32_in_the_reference() -> None:
    # In bf16-true an FP32 island's output goes back to BF16 for the next layer; the FP32 reference must not do that.
    stepper, model = _setup("bf16-true", fp32_modules=["fc2"])
    loss_fn = _mse()
    _backward(stepper, model, loss_fn)
    named = dict(stepper.named_grads())  # masters, and fc2's own FP32 parameters
    weights = {n: p.detach() for n, p in named.items()}
    fp32 = TinyMLP()  # a fresh model: no island hooks at all
    fp32.load_state_dict(weights)
    batch = (stepper.convert_input(X), Y)
    expected = _expected({n: p.grad for n, p in named.items()}, _fp32_grads(fp32, loss_fn, batch))
    assert stepper.measure(model, loss_fn, batch)["rel_error"] == pytest.approx(expected["rel_error"], rel=1e-9)


# ------------------------------------------------------------------------------------------------ side effects
class _Noisy(nn.Module):
    """Dropout, BatchNorm and a Python counter: everything a replay could disturb."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 16)
        self.drop = nn.Dropout(0.5)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc2(self.drop(torch.relu(self.norm(self.fc1(x)))))


def test_probing_leaves_training_bit_identical_and_replays_dropout() -> None:
    def train(probe: bool) -> tuple[dict, list[dict], int]:
        torch.manual_seed(0)
        stepper, model = _setup("32-true", model=_Noisy())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        stepper.setup_optimizers(model, [optimizer])
        results = []
        for step in range(3):
            start = stepper.forward_state()
            with stepper.forward_context():
                loss = _mse()(model, (X, Y))
            stepper.scale_loss(loss).backward()
            stepper.unscale_(optimizer)
            if probe:
                grads = [p.grad.clone() for p in model.parameters()]
                results.append(stepper.measure(model, _mse(), (X, Y), start=start, step=step))
                results.append(stepper.measure(model, _mse(), (X, Y), step=step))  # RNG as it is now: other masks
                assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
            stepper.step(optimizer)
            optimizer.zero_grad()
        state = {k: v.clone() for k, v in model.state_dict().items()}  # weights and BatchNorm statistics
        state["rng"] = torch.get_rng_state()
        state["adam"] = [s["exp_avg"].clone() for s in optimizer.state.values()]
        return state, results, model.calls

    reference, _, calls = train(False)
    probed, results, probed_calls = train(True)
    for key in reference:
        same = all(torch.equal(a, b) for a, b in zip(reference[key], probed[key])) if key == "adam" else \
            torch.equal(reference[key], probed[key])
        assert same, key
    assert probed_calls == calls == 3  # the replays ran on copies
    replayed, unreplayed = results[0::2], results[1::2]
    assert all(r["rel_error"] == 0.0 for r in replayed)  # FP32 with the step's own dropout masks: identical
    assert all(r["rel_error"] > 0.1 for r in unreplayed)  # other masks: another gradient


# ------------------------------------------------------------------------------------------------ recompute
def test_recompute_measures_the_last_micro_batch_alone() -> None:
    # Two micro-batches accumulate in .grad; the probe recomputes the run's FP16 gradient of the last one.
    stepper, model = _setup("16-mixed", scaler=None)
    loss_fn = _mse(2.0**-18)
    first, last = (X[:8], Y[:8]), (X[8:], Y[8:])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stepper.setup_optimizers(model, [optimizer])
    for batch in (first, last):
        if batch is last:
            start = stepper.forward_state()
        with stepper.forward_context():
            stepper.scale_loss(loss_fn(model, batch)).backward()
    stepper.unscale_(optimizer)
    result = stepper.measure(model, loss_fn, last, recompute=True, start=start)
    # By hand: the last micro-batch's FP16 gradient alone, on a fresh copy under FP16 autocast.
    alone = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_fn(alone, last)
    names, params = zip(*alone.named_parameters())
    run = dict(zip(names, torch.autograd.grad(loss, params)))
    expected = _expected(run, _fp32_grads(model, loss_fn, last))
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert result["recomputed"] and 0.05 < result["underflow_frac"] < 0.95, result["underflow_frac"]
    # The accumulated .grad against the last micro-batch alone would be another measurement.
    assert stepper.measure(model, loss_fn, last, start=start)["rel_error"] > result["rel_error"] + 0.1


def test_fp8_layers_state_untouched_and_error_split() -> None:
    stepper, model = _setup("bf16-mixed", fp8="delayed")
    assert stepper.layout.fp8_layers == ["fc2"]
    loss_fn = _mse()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    stepper.setup_optimizers(model, [optimizer])
    for step in range(2):  # a second step: the delayed scales have moved, so replaying them matters
        start = stepper.forward_state()
        with stepper.forward_context():
            loss = loss_fn(model, (X, Y))
        stepper.scale_loss(loss).backward()
        stepper.unscale_(optimizer)
        before = stepper.layout.fp8_backend.state_dict(model, ["fc2"])
        actual = stepper.measure(model, loss_fn, (X, Y), start=start)
        replayed = stepper.measure(model, loss_fn, (X, Y), recompute=True, start=start)
        after = stepper.layout.fp8_backend.state_dict(model, ["fc2"])
        assert all(torch.equal(before[k], after[k]) for k in before)
        if step == 0:
            stepper.step(optimizer)
            optimizer.zero_grad()
    assert replayed["rel_error"] == actual["rel_error"]  # the replay with the step's FP8 scales is the run, exactly
    # The split by hand: FP8 off (back to nn.Linear) under the same BF16 autocast.
    base = copy.deepcopy(model)
    convert_from_fp8(base)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        base_loss = loss_fn(base, (X, Y))
    base_grads = torch.autograd.grad(base_loss, [base.fc2.weight, base.fc2.bias])
    ref = _fp32_grads(base, loss_fn)
    run = [model.fc2.weight.grad, model.fc2.bias.grad]
    ref_norm = math.sqrt(sum((ref[n].double() ** 2).sum().item() for n in ("fc2.weight", "fc2.bias")))
    fp8_part = math.sqrt(sum(((g.double() - b.double()) ** 2).sum().item() for g, b in zip(run, base_grads)))
    base_part = math.sqrt(sum(((b.double() - ref[n].double()) ** 2).sum().item()
                              for b, n in zip(base_grads, ("fc2.weight", "fc2.bias"))))
    assert actual["fp8"]["fc2"]["fp8_rel_error"] == pytest.approx(fp8_part / ref_norm, rel=1e-9)
    assert actual["fp8"]["fc2"]["base_rel_error"] == pytest.approx(base_part / ref_norm, rel=1e-9)
    assert actual["fp8"]["fc2"]["fp8_rel_error"] > actual["fp8"]["fc2"]["base_rel_error"]  # E4M3 costs more than BF16
    assert set(actual["fp8"]) == {"fc2"}


# ------------------------------------------------------------------------------------------------ the sums
def _per_parameter_sums(run: torch.Tensor | None, ref: torch.Tensor | None, like: torch.Tensor) -> list[float]:
    """One parameter's sums as the probe first computed them, a parameter at a time (float64, zeros for None)."""
    shape = (ref if ref is not None else run if run is not None else like).shape
    g = run.double() if run is not None else torch.zeros(shape, dtype=torch.float64)
    r = ref.double() if ref is not None else torch.zeros(shape, dtype=torch.float64)
    nonzero, diff = r != 0, g - r
    return [float(((g == 0) & nonzero).sum()), float(nonzero.sum()), float((diff * diff).sum()),
            float((r * r).sum()), float((g * g).sum()), float((g * r).sum()), float((~torch.isfinite(g)).sum())]


def _mixed_gradients() -> tuple[list, list, list, list[int]]:
    """(run, reference, parameters, module of each): FP16/BF16/FP32 run gradients against FP32 ones, some flushed,
    some None, one non-finite, a non-contiguous one, an empty parameter; a module's parameters not side by side."""
    gen = torch.Generator().manual_seed(0)

    def ref(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * torch.logspace(-9, 0, shape[-1])  # FP16 flushes the smallest

    r0, r1, r2, r3, r4, r6 = ref(30), ref(5, 4).t(), ref(3, 7), ref(11), ref(6), ref(100)
    g2 = r2.clone()
    g2[0, 1], g2[2, 3] = math.inf, math.nan
    run = [r0.half(), r1.bfloat16(), g2, None, r4.half() * 2, None, r6.half(), torch.zeros(0, dtype=torch.half)]
    reference = [r0, r1, r2, r3, None, None, r6, torch.zeros(0)]
    params = [torch.zeros(t.shape) for t in (r0, r1, r2, r3, r4)] + [torch.zeros(3), torch.zeros(100), torch.zeros(0)]
    owners = [0, 1, 0, 2, 1, 2, 3, 3]
    return run, reference, params, owners


@pytest.mark.parametrize(("chunk", "block"), [(1, 1), (7, 1), (12, 4), (64, 16), (_CHUNK, _BLOCK)])
def test_module_sums_are_the_per_parameter_sums_added(chunk: int, block: int) -> None:
    # However the gradients are cut into chunks and blocks (a parameter and a module split between chunks, blocks
    # padded), each module's sums are its parameters' sums: the same float64 terms, added in another order.
    run, reference, params, owners = _mixed_gradients()
    numels = [(r if r is not None else g if g is not None else p).numel() for g, r, p in zip(run, reference, params)]
    sums = _module_sums(run, reference, numels, owners, 4, device=torch.device("cpu"), chunk=chunk, block=block)
    expected = torch.zeros(4, 7, dtype=torch.float64)
    for g, r, p, m in zip(run, reference, params, owners):
        expected[m] += torch.tensor(_per_parameter_sums(g, r, p), dtype=torch.float64)
    assert sums.dtype == torch.float64 and sums.shape == (4, 7)
    counts = [0, 1, 6]  # flushed, nonzero, non-finite: exact
    assert torch.equal(sums[:, counts], expected[:, counts])
    torch.testing.assert_close(sums, expected, rtol=1e-12, atol=0, equal_nan=True)
    assert expected[0, 0] > 0 and expected[0, 6] == 2 and expected[2, 1] == 11  # flushed, non-finite, None run
    assert torch.isnan(sums[0, 2]) and torch.isfinite(sums[[1, 2, 3]]).all()
    for row, want in zip(sums.tolist(), expected.tolist()):
        assert _metrics([*row, 1.0]) == pytest.approx(_metrics([*want, 1.0]), rel=1e-12, nan_ok=True)


@pytest.mark.parametrize(("size", "block"), [(4, 4), (12, 4), (64, 16), (4096, 128)])
def test_chunks_hold_at_most_their_size_in_whole_blocks_and_cover_every_parameter(size: int, block: int) -> None:
    sizes = [30, 1, 0, 100, 5, 64, 3]
    flat = [(i % 3, torch.randn(n), torch.randn(n)) for i, n in enumerate(sizes)]
    chunks = list(_chunks(flat, size, block))
    for pieces in chunks:  # the bound on a pass's buffers: padding included
        held = [g.numel() + pad for _, g, _, pad in pieces]
        assert sum(held) <= size and all(h % block == 0 and h - block < g.numel() for h, (_, g, _, _) in
                                         zip(held, pieces))
    pieces = [piece for chunk in chunks for piece in chunk]
    for k in (1, 2):  # the parameters' gradients in order, end to end, each element once, with its module
        assert torch.equal(torch.cat([p[k] for p in pieces]), torch.cat([f[k] for f in flat]))
    labels = [m for m, g, _, _ in pieces for _ in range(g.numel())]
    assert labels == [m for m, g, _ in flat for _ in range(g.numel())]
    assert len(chunks) == -(-sum(-(-n // block) * block for n in sizes) // size)  # full but the last


def test_module_sums_of_no_parameters_or_empty_ones_are_zeros() -> None:
    cpu = torch.device("cpu")
    sums = _module_sums([], [], [], [], 0, device=cpu)
    assert sums.shape == (0, 7) and sums.dtype == torch.float64
    empty = torch.zeros(0)
    assert torch.equal(_module_sums([empty, None], [empty, empty], [0, 0], [0, 1], 2, device=cpu),
                       torch.zeros(2, 7, dtype=torch.float64))


def test_a_parameter_without_gradients_reads_as_no_error_and_counts_its_elements() -> None:
    # recompute=True measures every trainable parameter: one the loss never reaches has no gradient in either pass.
    model = nn.Sequential()
    model.add_module("net", TinyMLP())
    model.add_module("unused", nn.Linear(3, 2))
    stepper, model = _setup("16-mixed", model=model, scaler=None)
    loss_fn = _mse(2.0**-18)

    def through_net(module: nn.Module, batch) -> torch.Tensor:
        return loss_fn(module.net, batch)

    _backward(stepper, model, through_net)
    result = stepper.measure(model, through_net, (X, Y), recompute=True)
    assert result["modules"]["unused"] == {"underflow_frac": 0.0, "rel_error": 0.0, "cosine": 1.0, "numel": 8}
    run = {n: p.grad for n, p in model.net.named_parameters()}
    expected = _expected(run, _fp32_grads(model.net, loss_fn))
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert result["numel"] == sum(p.numel() for p in model.parameters()) and 0 < result["underflow_frac"] < 1


# ------------------------------------------------------------------------------------------------ errors, ranks
def test_measure_refuses_another_module_and_a_detached_loss() -> None:
    stepper, model = _setup("bf16-mixed")
    _backward(stepper, model, _mse())
    with pytest.raises(ValueError, match=r"measure\(module=TinyMLP\): the stepper was set up with another module"):
        stepper.measure(TinyMLP(), _mse(), (X, Y))
    with pytest.raises(RuntimeError, match="loss_fn returned Tensor"):
        stepper.measure(model, lambda m, b: _mse()(m, b).detach(), (X, Y))


def test_metric_vector_round_trip_and_averaging() -> None:
    stepper, model = _setup("16-mixed", scaler=None)
    _backward(stepper, model, _mse(2.0**-24))
    result = stepper.measure(model, _mse(2.0**-24), (X, Y))
    values = metric_vector(result)
    assert len(values) == 3 * (1 + 3) and with_metric_vector(result, values) == result
    halved = with_metric_vector(result, [v / 2 for v in values])
    assert halved["modules"]["fc2"]["rel_error"] == result["modules"]["fc2"]["rel_error"] / 2
    assert halved["modules"]["fc2"]["numel"] == result["modules"]["fc2"]["numel"]


# ------------------------------------------------------------------------------------------------ the scaler
class _OneParam:
    """A parameter whose gradient is exactly ``values``: loss = sum(p * values)."""

    def __init__(self, scaler: AdaptiveLossScaler) -> None:
        self.p = nn.Parameter(torch.zeros(2))
        self.opt = torch.optim.SGD([self.p], lr=0.0)
        self.scaler = scaler

    def step(self, *values: float) -> float:
        self.opt.zero_grad()
        self.scaler.scale((self.p * torch.tensor(values)).sum()).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        return self.scaler.get_scale()


def test_measured_underflow_gives_up_headroom_until_an_overflow() -> None:
    run = _OneParam(AdaptiveLossScaler("cpu", max_scale=None, growth_interval=2))
    assert run.step(2.0**-10, 0.0) == 2.0**24  # amax * s * headroom(2) <= 65504
    assert not run.scaler.note_underflow_(0.005)  # under the 1% threshold
    assert run.scaler.note_underflow_(0.3)
    assert run.step(2.0**-10, 0.0) == 2.0**25  # no headroom left: 2**-10 * 2**25 = 32768 <= 65504
    assert not run.scaler.note_underflow_(0.3)  # headroom 2 allows one doubling only
    assert run.step(2.0**-10, 0.0) == 2.0**25
    assert run.step(float("inf"), 0.0) == 2.0**24  # an overflow: backoff, and the headroom comes back
    assert run.scaler.underflow_boost == 1.0 and run.scaler.raise_blocked_until == 4 + 2  # 4 updates, interval 2
    assert run.step(2.0**-10, 0.0) == 2.0**24
    assert not run.scaler.note_underflow_(0.3)  # a step overflowed since the last report
    assert not run.scaler.note_underflow_(0.3)  # and the raise it followed is refused for growth_interval steps
    state = run.scaler.state_dict()
    assert state["underflow_boost"] == 1.0 and state["raise_blocked_until"] == 6 and not state["overflowed_since_note"]
    assert run.step(2.0**-10, 0.0) == 2.0**24
    assert run.scaler.note_underflow_(0.3)  # step_count 6: allowed again
    assert run.step(2.0**-10, 0.0) == 2.0**25
    clone = AdaptiveLossScaler("cpu", max_scale=None, growth_interval=2)
    clone.load_state_dict(run.scaler.state_dict())
    assert clone.state_dict() == run.scaler.state_dict()
    assert _OneParam(clone).step(2.0**-10, 0.0) == 2.0**25  # the resumed rule still has the headroom given up
    restarted = AdaptiveLossScaler("cpu", max_scale=None, growth_interval=2)
    restarted.load_state_dict(state)
    assert _OneParam(restarted).step(2.0**-10, 0.0) == 2.0**24


def test_note_underflow_validates_and_is_inert_when_disabled() -> None:
    scaler = AdaptiveLossScaler("cpu")
    assert not AdaptiveLossScaler("cpu", enabled=False).note_underflow_(0.5)
    with pytest.raises(ValueError, match=r"note_underflow_\(underflow_frac=1.5\)"):
        scaler.note_underflow_(1.5)
    with pytest.raises(ValueError, match=r"note_underflow_\(threshold=1.0\)"):
        scaler.note_underflow_(0.5, threshold=1.0)


# ------------------------------------------------------------------------------------------------ the figure
HISTORY = [
    {"step": 0, "modules": {"a": {"underflow_frac": 0.0, "rel_error": 0.01, "cosine": 1.0}}},
    {"step": 9, "modules": {"a": {"underflow_frac": 0.5, "rel_error": 0.7, "cosine": 0.6},
                            "b": {"underflow_frac": 1.0, "rel_error": math.inf, "cosine": 0.0}}},
]


def test_probe_matrix_rows_are_modules_and_columns_probes() -> None:
    modules, steps, values = probe_matrix(HISTORY, "underflow_frac")
    assert modules == ["a", "b"] and steps == [0, 9]
    assert values[0] == [0.0, 0.5] and math.isnan(values[1][0]) and values[1][1] == 1.0


def test_probe_figure_is_drawn_only_with_data(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    assert write_probe_figure([], tmp_path) is None
    assert write_probe_figure([{"step": 0, "modules": {}}], tmp_path) is None
    title, name = write_probe_figure(HISTORY, tmp_path)
    assert (tmp_path / name).stat().st_size > 10_000 and "PrecisionProbe" in title


# ------------------------------------------------------------------------------------------------ CUDA
@pytest.mark.gpu
def test_on_cuda_the_reading_matches_the_count_and_dropout_is_replayed() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.3), nn.ReLU(), nn.Linear(64, 16)).cuda()
    stepper = PrecisionStepper("16-mixed", scaler=None, device="cuda")
    stepper.setup_module(model)
    batch = (X.cuda(), Y.cuda())
    loss_fn = _mse(2.0**-20)
    start = stepper.forward_state()
    _backward(stepper, model, loss_fn, batch)
    run = {n: p.grad for n, p in model.named_parameters()}
    # The FP32 count by hand, with the step's dropout masks (CUDA RNG state from before the forward).
    reference = copy.deepcopy(model).float()
    with torch.random.fork_rng(devices=[0]):
        torch.cuda.set_rng_state(start["rng"]["cuda"])
        loss = loss_fn(reference, batch)
        names, params = zip(*reference.named_parameters())
        ref = dict(zip(names, torch.autograd.grad(loss, params)))
    result = stepper.measure(model, loss_fn, batch, start=start)
    expected = _expected(run, ref)
    assert 0.0 < expected["underflow_frac"] < 1.0
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    # At loss weight 1 nothing flushes: a small error means the FP16 run and the FP32 replay drew the same masks
    # (on the CPU they do, measured ~1e-3; another mask would read ~0.5).
    model.zero_grad(set_to_none=True)
    start = stepper.forward_state()
    _backward(stepper, model, _mse(), batch)
    assert stepper.measure(model, _mse(), batch, start=start)["rel_error"] < 0.05


def test_a_sparse_embedding_gradient_is_measured_as_its_dense_values() -> None:
    # nn.Embedding(sparse=True) gives sparse COO gradients, in the run and in the FP32 recompute: the probe measures
    # their dense values (it raised "reshape is not implemented for sparse tensors", and "aten::ne.Scalar" before).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8, sparse=True), nn.Flatten(), nn.Linear(32, 4))
    tokens, targets = torch.randint(0, 50, (6, 4)), torch.randn(6, 4)

    def loss_fn(module: nn.Module, batch) -> torch.Tensor:
        return F.mse_loss(module(batch[0]).float(), batch[1])

    stepper, model = _setup("bf16-mixed", model)
    _backward(stepper, model, loss_fn, (tokens, targets))
    assert model[0].weight.grad.is_sparse
    run = {n: p.grad.to_dense() for n, p in model.named_parameters()}
    reference = copy.deepcopy(model).float()  # the integer tokens stay integers
    names, params = zip(*reference.named_parameters())
    grads = torch.autograd.grad(loss_fn(reference, (tokens, targets)), params)
    ref = {n: g.to_dense() for n, g in zip(names, grads)}
    result = stepper.measure(model, loss_fn, (tokens, targets))
    for key, value in _expected(run, ref).items():
        assert result[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert result["modules"]["0"]["numel"] == 50 * 8 and 0 < result["modules"]["0"]["rel_error"] < 0.05

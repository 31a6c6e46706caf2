"""SpikeGuard's C loops (the CPU default) against its torch ops, side by side over random series: the same spikes
flagged, the same statistics within FP32 rounding (torch's CPU sqrt is not always correctly rounded: an ulp of the
standard deviation), the same counts and state; and when each path runs."""

from __future__ import annotations

import copy
import math
import pickle
import random

import pytest
import torch
from helpers import OpNames, regression_data, tiny_stepper
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_mpstable.core.guards import spike as spike_module
from lit_mpstable.core.guards.spike import SpikeGuard, spike_kernel

INF, NAN = math.inf, math.nan


def _guard(monkeypatch: pytest.MonkeyPatch, native: bool, **kwargs) -> SpikeGuard:
    monkeypatch.setenv("LIT_MPSTABLE_NATIVE", "1" if native else "0")
    guard = SpikeGuard(**kwargs).bind("cpu")
    assert (guard._native() is not None) == native
    return guard


def _close(a: float, b: float) -> bool:
    # A z-score divides by the window's standard deviation, which the two paths sum in another order: in a short
    # window of near-equal values (window=2, two norms 1% apart) the variance is a small difference of FP32 sums, and
    # an ulp of those sums moves the z-score by ~1e-5 relative (seen: 0.2484321 vs 0.2484346). 1e-4 keeps every
    # planted bug (they move the statistics by percents) and that rounding apart.
    return (math.isnan(a) and math.isnan(b)) or a == b or math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)


def _same_state(a: SpikeGuard, b: SpikeGuard) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        x, y = torch.as_tensor(sa[key]), torch.as_tensor(sb[key])
        if x.is_floating_point():
            assert torch.allclose(x, y, rtol=1e-5, atol=1e-6), (key, x, y)
        else:
            assert torch.equal(x, y), (key, x, y)
    # Unreached slots (NaN in the buffers, 0 in the state) in the same places: the counts say so, equal above.


def _value(kind: str, level: float, noise: float) -> float:
    return {"clean": level * (1.0 + 0.05 * noise), "spike": level * (3.0 + 1000.0 * abs(noise) ** 3),
            "low": level * 0.1, "nan": NAN, "inf": INF, "-inf": -INF}[kind]


def _steps(seed: int, count: int) -> list[tuple]:
    """A random run: per step the loss and norm (clean around their levels, spikes, drops, inf/NaN), how many
    micro-batches observe the loss (0: none), a skip for another reason, how the skip flag is passed, and an action."""
    rng = random.Random(seed)
    kinds = ["clean"] * 10 + ["spike", "low", "nan", "inf", "-inf"]
    actions = ["step"] * 24 + ["round_trip", "forget", "no_norm", "applied_anyway"]
    return [(rng.choice(kinds), rng.uniform(-1, 1), rng.choice(kinds), rng.uniform(-1, 1), rng.choice([1, 1, 1, 2, 0]),
             rng.random() < 0.05, rng.choice(["bool", "tensor", "float"]), rng.choice(actions))
            for _ in range(count)]


_CONFIG = st.fixed_dictionaries({
    "window": st.integers(2, 24), "warmup": st.integers(2, 30), "zscore": st.sampled_from([0.5, 1.5, 3.0, 6.0]),
    "watch": st.sampled_from([("loss",), ("grad_norm",), ("loss", "grad_norm")]),
    "clip_zscore": st.none() | st.sampled_from([0.5, 1.0, 2.5]), "max_consecutive": st.none() | st.integers(1, 5),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=_CONFIG, seed=st.integers(0, 2**32 - 1), count=st.integers(1, 150), levels=st.tuples(
    st.sampled_from([2.0, -0.5, 1e-3, 300.0]), st.sampled_from([1.0, 1e-4, 50.0])))
def test_the_c_loops_decide_as_the_torch_ops(monkeypatch, config, seed, count, levels) -> None:
    # Warmup, window wrap, ZClip, both watch settings, restarts after max_consecutive spikes, inf/NaN, missing values,
    # micro-batches, skipped steps, replays (forget_) and state round trips (each path's state into the other's guard).
    pair = [_guard(monkeypatch, True, **config), _guard(monkeypatch, False, **config)]
    norm_needed = "grad_norm" in config["watch"] or config["clip_zscore"] is not None
    for i, (lk, ln, nk, nn_, micro, extra, flag_as, action) in enumerate(_steps(seed, count)):
        loss, norm = _value(lk, levels[0], ln), _value(nk, levels[1], nn_)
        rows = []
        for guard in pair:
            for _ in range(micro):
                guard.observe_loss_(torch.tensor(loss / max(micro, 1)))
            flag = guard.decide(None if action == "no_norm" and not norm_needed else torch.tensor(norm))
            threshold = guard.clip_threshold()
            rows.append((bool(flag), guard.loss_zscore.item(), guard.grad_norm_zscore.item(),
                         None if threshold is None else threshold.item()))
            if action == "forget":
                guard.forget_()
                continue
            skipped = extra if action == "applied_anyway" else bool(flag) or extra  # a spike the caller applied
            as_passed = {"bool": skipped, "tensor": torch.tensor(skipped), "float": torch.tensor(float(skipped))}
            guard.commit_(as_passed[flag_as], spiked=flag if flag_as != "bool" or i % 2 else None)
            guard.count_run_(bool(flag), applied=not skipped)
        (fa, *ra), (fb, *rb) = rows
        if fa != fb:  # only a value at the gate itself, within an ulp of the standard deviation, may be judged apart
            z = rb[0] if abs(rb[0] - config["zscore"]) < abs(rb[1] - config["zscore"]) else rb[1]
            assert math.isclose(z, config["zscore"], rel_tol=1e-5), (i, rows)
            return  # the two windows differ from here on
        assert all(_close(a, b) if a is not None and b is not None else a is b for a, b in zip(ra, rb)), (i, rows)
        _same_state(*pair)
        assert pair[0].level_shifts == pair[1].level_shifts
        if action == "round_trip":
            states = [guard.state_dict() for guard in pair]
            pair = [_guard(monkeypatch, True, **config), _guard(monkeypatch, False, **config)]
            pair[0].load_state_dict(states[1])
            pair[1].load_state_dict(states[0])
            assert pair[0]._native() is not None  # a loaded state still takes the C loops


def test_the_cpu_default_takes_the_c_loops(monkeypatch) -> None:
    # The torch path makes its window statistics once per fold (_prepared); the C loops never do. Every call of a step
    # went through C: the statistics stay unmade, and the flags, counts and buffers are the step's.
    guard = _guard(monkeypatch, True, window=4, warmup=2)
    for loss in (1.0, 1.1, 0.9, 50.0):
        guard.observe_loss_(torch.tensor(loss))
        flag = guard.decide(torch.tensor(1.0))
        guard.commit_(bool(flag), spiked=flag)
        assert guard._prepared is None
    assert guard.state_dict()["loss"].tolist() == [1.0, 1.100000023841858, 0.8999999761581421, 0]
    assert int(guard.spikes_skipped) == 1 and bool(guard.last_spike)


def test_an_op_counter_sees_the_torch_ops_and_the_same_numbers(monkeypatch) -> None:
    # Under a TorchDispatchMode (a FLOP counter, a tracer, the tests' HostReads) the torch path runs, so the mode sees
    # every operation; outside it the C loops. The two halves of one run agree.
    native, reference = _guard(monkeypatch, True, window=8, warmup=3), _guard(monkeypatch, False, window=8, warmup=3)
    for i in range(12):
        for guard in (native, reference):
            counter = OpNames() if i % 2 else None
            if counter is not None:
                counter.__enter__()
            guard.observe_loss_(torch.tensor(2.0 + 0.1 * (i % 3)))
            flag = guard.decide(torch.tensor(1.0 + 0.05 * (i % 4)))
            guard.commit_(bool(flag))
            if counter is not None:
                counter.__exit__(None, None, None)
                assert len(counter.names) > 5
    _same_state(native, reference)


def test_copies_and_pickles_work_on_their_own_buffers(monkeypatch) -> None:
    guard = _guard(monkeypatch, True, window=4, warmup=2)
    for v in (1.0, 2.0):
        guard.observe_loss_(torch.tensor(v))
        guard.commit_(guard.decide(torch.tensor(v)))
    for twin in (copy.deepcopy(guard), pickle.loads(pickle.dumps(guard))):
        assert twin._native() is not None
        twin.observe_loss_(torch.tensor(3.0))
        twin.commit_(twin.decide(torch.tensor(3.0)))
        assert twin.state_dict()["loss"].tolist() == [1.0, 2.0, 3.0, 0.0]
    assert guard.state_dict()["loss"].tolist() == [1.0, 2.0, 0.0, 0.0]  # the original untouched
    monkeypatch.setenv("LIT_MPSTABLE_NATIVE", "0")  # unpickled where there are no C loops: the torch ops
    twin = pickle.loads(pickle.dumps(guard))
    assert twin._native() is None
    twin.observe_loss_(torch.tensor(3.0))
    twin.commit_(twin.decide(torch.tensor(3.0)))
    assert twin.state_dict()["loss"].tolist() == [1.0, 2.0, 3.0, 0.0]


def test_inputs_of_other_dtypes_and_layouts_still_take_the_c_loops(monkeypatch) -> None:
    # A BF16 loss, an FP64 norm, a one-element view at an offset: converted to the guard's 0-dim FP32 first.
    native, reference = _guard(monkeypatch, True, window=8, warmup=2), _guard(monkeypatch, False, window=8, warmup=2)
    values = torch.arange(12, dtype=torch.float64).reshape(3, 4) / 7 + 1
    for i in range(6):
        for guard in (native, reference):
            guard.observe_loss_(torch.tensor(1.5 + 0.1 * i, dtype=torch.bfloat16))
            flag = guard.decide(values[:, 1:][i % 3, i % 2:i % 2 + 1])
            guard.commit_(flag)
    _same_state(native, reference)


def test_without_a_compiler_or_when_turned_off_the_torch_ops_run(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("LIT_MPSTABLE_NATIVE", "0")
    assert spike_kernel() is None
    monkeypatch.delenv("LIT_MPSTABLE_NATIVE")
    monkeypatch.setattr(spike_module.native, "compiler", lambda: None)
    spike_module._load_kernel.cache_clear()
    try:
        assert spike_kernel() is None
        guard = SpikeGuard(window=4, warmup=2).bind("cpu")
        assert guard._native() is None
        guard.observe_loss_(torch.tensor(1.0))
        guard.commit_(guard.decide(torch.tensor(1.0)))
        assert guard.state_dict()["loss_count"] == 1
        monkeypatch.undo()  # a compiler that fails: no library, no exception
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
        monkeypatch.setattr(spike_module, "SOURCE", "this is not C")
        spike_module._load_kernel.cache_clear()
        assert spike_kernel() is None
        assert not list(tmp_path.rglob("*.so"))
    finally:
        monkeypatch.undo()
        spike_module._load_kernel.cache_clear()
    assert spike_kernel() is not None


def test_a_guard_on_another_device_never_binds_the_c_loops() -> None:
    guard = SpikeGuard().bind("meta")  # any device but the CPU: the torch ops, which queue on it
    assert guard._native() is None and guard._consts["native"] is None


@pytest.mark.parametrize("precision, kwargs", [("bf16-mixed", {}), ("16-mixed", {"clip_zscore": 2.5}),
                                               ("bf16-true", {"watch": ("grad_norm",), "max_consecutive": 2})])
def test_a_stepper_trains_alike_on_both_paths(monkeypatch, precision, kwargs) -> None:
    # The whole step (loss across micro-batches, the norm from the gradient check, ZClip's threshold into the clip,
    # the stepper's host flags into commit_ and count_run_): the same steps skipped, and the same weights (within an
    # ulp of ZClip's threshold) and statistics, with loss spikes, gradient spikes and a run of them.
    def train(native: bool) -> tuple[list[bool], list[torch.Tensor], SpikeGuard]:
        guard = _guard(monkeypatch, native, window=16, warmup=5, **kwargs)
        model, stepper, optimizer = tiny_stepper(precision, device="cpu", spike_guard=guard)
        x, y = regression_data(64)
        skipped = []
        for i in range(40):
            for half in (0, 8):  # two micro-batches
                j = (i % 4) * 16 + half
                with stepper.forward_context():
                    loss = torch.nn.functional.mse_loss(model(stepper.convert_input(x[j:j + 8])).float(), y[j:j + 8])
                stepper.scale_loss(loss * (1e4 if i in (12, 30) else 1.0) / 2).backward()
            if i in (20, 31, 32, 33):
                model.fc1.weight.grad.view(-1)[::100] *= 1e3
            stepper.clip_grad_norm_(optimizer, 1.0)
            stepper.step(optimizer)
            optimizer.zero_grad()
            skipped.append(stepper.last_step_skipped)
        return skipped, [p.detach().clone() for p in model.parameters()], guard

    (skip_c, weights_c, guard_c), (skip_t, weights_t, guard_t) = train(True), train(False)
    assert skip_c == skip_t and sum(skip_c) >= 3
    assert all(torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6) for a, b in zip(weights_c, weights_t))
    _same_state(guard_c, guard_t)


class _Opaque(torch.Tensor):
    """A tensor subclass whose memory the C loops must not read (as a DTensor's or a fake tensor's pointer)."""

    def data_ptr(self) -> int:  # type: ignore[override]
        raise AssertionError("the C loops read a tensor subclass")


@pytest.mark.parametrize("clip_zscore", [None, 2.5])
def test_a_step_given_a_tensor_subclass_takes_the_torch_ops_and_the_next_plain_one_the_c_loops(
        monkeypatch, clip_zscore) -> None:
    # Whether a step's values are plain is noted where they are given (a loss of each micro-batch, the norm): a
    # subclass anywhere in the step sends its decide() and commit_() to the torch ops; the step after starts afresh.
    native = _guard(monkeypatch, True, window=6, warmup=2, clip_zscore=clip_zscore)
    reference = _guard(monkeypatch, False, window=6, warmup=2, clip_zscore=clip_zscore)
    calls = []
    kernel = native._consts["native"].kernel
    spy = type("Spy", (), {"decide": lambda self, *a: calls.append("decide") or kernel.decide(*a),
                           "commit": lambda self, *a: calls.append("commit") or kernel.commit(*a)})()
    native._consts["native"] = native._consts["native"]._replace(kernel=spy)
    for i in range(8):
        opaque = i % 3  # 0: plain; 1: the second micro-batch's loss a subclass; 2: the norm a subclass
        for guard in (native, reference):
            for micro in range(2):
                loss = torch.tensor(2.0 + 0.1 * (i % 4) + micro)
                guard.observe_loss_(loss.as_subclass(_Opaque) if opaque == 1 and micro == 1 else loss)
            norm = torch.tensor(1.0 + 0.2 * (i % 5))
            flag = guard.decide(norm.as_subclass(_Opaque) if opaque == 2 else norm)
            guard.clip_threshold()
            guard.commit_(bool(flag), spiked=flag)
        assert calls == (["decide", "commit"] if opaque == 0 else []), (i, calls)
        calls.clear()
        _same_state(native, reference)


@pytest.mark.parametrize("clip_zscore", [None, 2.5])
def test_every_decision_is_a_tensor_of_its_own_that_a_caller_may_keep(monkeypatch, clip_zscore) -> None:
    # The C loops write each step's flag (and ZClip's threshold) into a tensor never handed out before: flags and
    # thresholds kept over many steps (past a batch of new tensors) still read their own step's values.
    native = _guard(monkeypatch, True, window=8, warmup=3, clip_zscore=clip_zscore)
    reference = _guard(monkeypatch, False, window=8, warmup=3, clip_zscore=clip_zscore)
    kept: list[list[tuple[torch.Tensor, torch.Tensor | None]]] = [[], []]
    for i in range(150):
        norm = torch.tensor(50.0 if i % 7 == 6 else 1.0 + 0.01 * (i % 5))  # a spike every 7th step, once warm
        for guard, store in zip((native, reference), kept):
            guard.observe_loss_(torch.tensor(2.0))
            flag = guard.decide(norm)
            store.append((flag, guard.clip_threshold()))
            guard.commit_(bool(flag), spiked=flag)
    flags = [[bool(f) for f, _ in store] for store in kept]
    assert flags[0] == flags[1] and sum(flags[0]) > 10
    assert len({id(f) for f, _ in kept[0]}) == len({f.data_ptr() for f, _ in kept[0]}) == 150
    if clip_zscore is not None:
        assert all(_close(float(a), float(b)) for (_, a), (_, b) in zip(*kept))

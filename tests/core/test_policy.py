"""OpPolicy: the decision rule (on injected timings), the mechanism (dtypes seen by the kernels), validation, state."""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from lit_mpstable.core.layout.islands import FP32Islands
from lit_mpstable.core.layout.policy import FAMILIES, Measurement, OpCall, OpPolicy, StepCost, choose, measure_calls
from lit_mpstable.core.weights.memory import MemoryProbe

BF16 = torch.bfloat16


class TinyAttention(nn.Module):
    """Pre-norm self-attention through F.scaled_dot_product_attention, twice (two blocks, one shape)."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = self.attention_out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.block(x))


def kernel_input_dtype(out: torch.Tensor) -> torch.dtype:
    """The dtype of the input the op's kernel really ran on (and its backward will run on): the tensor autograd
    saved for the backward, below autocast's casts."""
    node = out.grad_fn
    saved = getattr(node, "_saved_query", None)
    return (saved if saved is not None else node._saved_input).dtype


def fake_measure(times: dict[str, tuple[float, float]], calls_seen: dict[str, list[OpCall]] | None = None):
    """A measure function with injected timings (autocast_ms, fp32_ms) per family; FP32 error always smaller."""

    def measure(calls, device_type, dtype, budget_s):
        family = calls[0].family
        if calls_seen is not None:
            calls_seen[family] = calls
        autocast_ms, fp32_ms = times.get(family, (1.0, 1.0))
        return Measurement(autocast_ms, fp32_ms, autocast_err=1e-3, fp32_err=1e-7)

    return measure


def forward(model: nn.Module, policy: OpPolicy, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=BF16, cache_enabled=False), policy.context("cpu"):
        return model(x)


def decide(policy: OpPolicy, device_type: str = "cpu") -> None:
    """The start of the next forward, where "auto" measures what the first one recorded."""
    with policy.context(device_type):
        pass


# -------------------------------------------------------------------------------------------- decision rule
@pytest.mark.parametrize(
    "m, expected",
    [
        (Measurement(10.0, 5.0, 1e-3, 1e-7), "fp32"),  # faster and more accurate
        (Measurement(10.0, 8.5, 1e-3, 1e-7), "autocast"),  # within the 20 % margin: not worth switching
        (Measurement(5.0, 10.0, 1e-3, 1e-7), "autocast"),  # slower
        (Measurement(10.0, 5.0, 1e-7, 1e-3), "autocast"),  # faster but numerically worse
        (Measurement(10.0, 5.0, math.inf, 1e-7), "fp32"),  # the 16-bit run overflowed
    ],
)
def test_choose_keeps_fp32_only_when_faster_and_no_worse(m: Measurement, expected: str) -> None:
    assert choose(m) == expected


@pytest.mark.parametrize("extra_bytes, expected", [(40.0, "fp32"), (100.0, "autocast"), (-10.0, "fp32")])
def test_fp32_must_pay_for_its_memory_with_speed(extra_bytes: float, expected: str) -> None:
    # A 100 ms step peaking at 1000 bytes; FP32 saves 5 ms (5 %). For 4 % more memory time x memory falls
    # (95 x 1040 = 98800 < 100000): worth it. For 10 % more it rises (95 x 1100 = 104500): not worth it.
    m = Measurement(10.0, 5.0, 1e-3, 1e-7, fp32_extra_bytes=extra_bytes)
    assert choose(m, step=StepCost(ms=100.0, peak_bytes=1000.0)) == expected
    assert choose(m) == "fp32"  # without a step to weigh against: speed and numerics only


def test_auto_records_the_model_shapes_and_decides_per_family_from_injected_timings() -> None:
    seen: dict[str, list[OpCall]] = {}
    policy = OpPolicy("auto", dtype=BF16, measure=fake_measure({"attention": (53.0, 29.0), "matmul": (10, 21)}, seen))
    assert policy.pending
    forward(TinyAttention(), policy, torch.randn(2, 8, 16))
    assert policy.pending and not seen  # recorded; measured when the next forward starts (after this step)
    decide(policy)
    assert not policy.pending
    assert policy.choices == {"matmul": "autocast", "conv": "autocast", "attention": "fp32", "norm": "autocast",
                              "softmax": "autocast"}
    # Measured on what the model ran: one SDPA shape, called twice; conv and softmax never ran, so nothing to measure.
    assert set(seen) == {"matmul", "attention", "norm"}
    (sdpa,) = seen["attention"]
    assert sdpa.count == 2 and sdpa.args[0].shape == (2, 2, 8, 8) and sdpa.args[0].dtype == BF16
    assert sdpa.kwargs == {"is_causal": True}
    assert {c.args[0].shape for c in seen["matmul"]} == {(2, 8, 16)} and sum(c.count for c in seen["matmul"]) == 4


def test_auto_waits_for_a_forward_with_gradients() -> None:
    # Lightning's sanity-check validation runs under no_grad first: the decision must come from a training forward.
    policy = OpPolicy("auto", dtype=BF16, measure=fake_measure({"attention": (53.0, 29.0)}, {}))
    with torch.no_grad():
        forward(TinyAttention(), policy, torch.randn(2, 8, 16))
    assert policy.pending
    forward(TinyAttention(), policy, torch.randn(2, 8, 16))
    decide(policy)
    assert not policy.pending and policy.choices["attention"] == "fp32"


def test_a_tensor_passed_twice_is_remembered_as_one() -> None:
    # nn.MultiheadAttention takes its fused in-projection only when query is key is value: measure it that way.
    seen: dict[str, list[OpCall]] = {}
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    x, memory = torch.randn(2, 8, 16), torch.randn(2, 4, 16)
    policy = OpPolicy({"attention": "auto"}, dtype=BF16, measure=fake_measure({}, seen))
    with torch.autocast("cpu", dtype=BF16, cache_enabled=False), policy.context("cpu"):
        mha(x, x, x, need_weights=False)
        mha(x, memory, memory, need_weights=False)
    decide(policy)
    self_attention, cross_attention = seen["attention"]
    assert len({spec.slot for spec in self_attention.args[:3]}) == 1
    assert [spec.slot for spec in cross_attention.args[:3]] == [0, 1, 1]
    m = measure_calls([self_attention], "cpu", BF16, budget_s=0.0)
    assert m.autocast_ms > 0 and m.fp32_err < m.autocast_err


def test_auto_on_cuda_leaves_families_autocast_already_runs_in_fp32() -> None:
    # CUDA's autocast lists put layer_norm and softmax in FP32 already: nothing to measure (recording only, no GPU).
    seen: dict[str, list[OpCall]] = {}
    policy = OpPolicy({"norm": "auto"}, dtype=BF16, measure=fake_measure({}, seen))
    with policy.context("cuda"):
        pass
    decide(policy, "cuda")
    assert policy.choices["norm"] == "autocast" and not seen


# ------------------------------------------------------------------------------------------------ mechanism
def test_fp32_attention_really_runs_in_fp32_inside_autocast() -> None:
    model, x, projections = TinyAttention(), torch.randn(2, 8, 16, requires_grad=True), []
    model.proj.register_forward_hook(lambda module, args, out: projections.append(out.dtype))
    for policy, attention_dtype in ((OpPolicy("autocast", dtype=BF16), BF16),
                                    (OpPolicy({"attention": "fp32"}, dtype=BF16), torch.float32)):
        out = forward(model, policy, x)
        assert kernel_input_dtype(model.attention_out) == attention_dtype  # forward and backward kernels
        assert model.attention_out.dtype == attention_dtype  # like an FP32 island: the next linear casts it down
        assert projections == [BF16, BF16]  # the other families stay autocast's
        projections.clear()
        out.float().sum().backward()
        assert torch.isfinite(x.grad).all() and x.grad.dtype == torch.float32
        x.grad = None


def test_forced_fp32_norm_updates_batchnorm_statistics_in_place() -> None:
    bn = nn.BatchNorm1d(4)
    x = torch.randn(8, 4).bfloat16() + 3.0
    out = forward(bn, OpPolicy({"norm": "fp32"}, dtype=BF16), x)
    assert kernel_input_dtype(out) == torch.float32 and out.dtype == torch.float32
    assert bn.running_mean.dtype == torch.float32 and (bn.running_mean > 0.2).all()  # moved toward the mean, 3


def test_nothing_is_intercepted_when_the_policy_changes_nothing() -> None:
    # Zero per-op cost: no TorchFunctionMode at all for "autocast" or for forcing what autocast does anyway.
    assert isinstance(OpPolicy("autocast", dtype=BF16).context("cpu"), nullcontext)
    assert isinstance(OpPolicy({"attention": "bf16", "matmul": "bf16"}, dtype=BF16).context("cpu"), nullcontext)
    assert not isinstance(OpPolicy({"norm": "bf16"}, dtype=BF16).context("cpu"), nullcontext)


def test_fp32_islands_win_over_the_policy() -> None:
    # Forced BF16 layer norms, but the module is an FP32 island: autocast is off inside, so the policy steps aside.
    model, outputs = TinyAttention(), []
    model.ln.register_forward_hook(lambda module, args, out: outputs.append(out))
    islands = FP32Islands(["ln"])
    islands.attach(model, device_type="cpu", output_dtype=None)
    seen: dict[str, list[OpCall]] = {}
    forward(model, OpPolicy({"norm": "bf16"}, dtype=BF16), torch.randn(2, 8, 16))
    auto = OpPolicy({"norm": "auto"}, dtype=BF16, measure=fake_measure({"norm": (10, 1)}, seen))
    forward(model, auto, torch.randn(2, 8, 16))
    decide(auto)
    assert len(outputs) == 4 and all(kernel_input_dtype(out) == torch.float32 for out in outputs)
    assert not seen and auto.choices["norm"] == "autocast"  # calls inside islands are not even measured
    islands.detach()
    outputs.clear()
    forward(model, OpPolicy({"norm": "bf16"}, dtype=BF16), torch.randn(2, 8, 16))
    assert len(outputs) == 2 and all(kernel_input_dtype(out) == BF16 for out in outputs)  # outside islands: forced


def test_the_first_step_is_weighed_by_its_time_and_memory_measured_before_the_next_forward() -> None:
    # One linear layer whose input needs no gradient: autocast saves only the input's BF16 copy for the weight's
    # gradient (4 x 16 x 2 bytes); the parameters hold 32 x 16 + 32 FP32 values.
    layer, seen = nn.Linear(16, 32), {}
    policy = OpPolicy({"matmul": "auto"}, dtype=BF16, measure=fake_measure({"matmul": (2.0, 1.0)}, seen))
    forward(layer, policy, torch.randn(4, 16)).float().sum().backward()
    assert not seen and policy.step_cost is None  # nothing measured while the step's activations are alive
    decide(policy)
    activations, parameters = 4 * 16 * 2, (32 * 16 + 32) * 4
    assert policy.step_cost.peak_bytes == activations + 4 * parameters  # weights, grads, two optimizer moments
    assert policy.step_cost.ms > 0 and policy.choices["matmul"] == "fp32"


def test_a_call_too_big_to_measure_is_cut_along_its_batch_and_counts_for_the_whole() -> None:
    # BatchNorm on 64 samples of 64 channels: the running statistics have 64 entries too, and are not the batch.
    x = torch.randn(64, 64, 8, 8, dtype=BF16)
    stats, weight = torch.zeros(64), nn.Parameter(torch.ones(64))
    policy = OpPolicy({"norm": "auto"}, dtype=BF16)
    with torch.autocast("cpu", dtype=BF16), policy.context("cpu"):
        F.batch_norm(x, stats, stats.clone(), weight, training=True)
    (call,) = policy._recording.calls.values()
    full = call.measure_bytes
    assert full == 18 * 2 * x.numel() + 18 * (64 + 64 + 64)  # input and output; stats and weight once each
    cut = call.fitted(full / 4)
    keep = int(64 * (full / 4 / 18 - 3 * 64) / (2 * x.numel()))  # what fits after the 64-entry tensors: 15 samples
    assert keep == 15 and cut.args[0].shape == (15, 64, 8, 8) and cut.measure_bytes <= full / 4
    assert [a.shape for a in (*cut.args[1:], cut.kwargs["weight"])] == [(64,)] * 3
    assert cut.count == pytest.approx(64 / 15)
    assert call.fitted(full) is call and call.fitted(10.0) is None
    m = measure_calls([cut], "cpu", BF16, budget_s=0.0)
    assert m.autocast_ms > 0 and m.fp32_err < m.autocast_err


def test_auto_measures_within_the_memory_of_a_training_step() -> None:
    # A CNN whose FP32 batch-norm measurement at full batch would hold more than the whole BF16 step: the peak of the
    # step that measures stays that of a plain autocast step. margin=1.0 keeps every family autocast whatever the
    # timings say, so the peak compared is the measuring's alone (on a busy machine FP32 conv can time 20 % faster,
    # and its FP32 output then flows into the BatchNorm and ReLU after it: a different step, not the measuring).
    def steps(policy: OpPolicy | None) -> int:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(),
                            nn.Linear(16 * 16 * 16, 10))
        x, peaks = torch.randn(64, 3, 16, 16), []
        for _ in range(2):  # the first step records, the second measures first
            probe = MemoryProbe()
            probe.start(net, [])
            with torch.autocast("cpu", dtype=BF16, cache_enabled=False), (
                    policy.context("cpu") if policy is not None else nullcontext()):
                net(x).float().square().mean().backward()
            probe.stop()
            peaks.append(probe.peak_bytes)
        return max(peaks)

    plain = steps(None)
    policy = OpPolicy("auto", dtype=BF16, margin=1.0)
    auto = steps(policy)
    assert not policy.pending and set(policy.measurements) == {"conv", "norm", "matmul"}
    assert auto <= 1.05 * plain


def test_fp32_compute_holds_the_16_bit_inputs_for_the_backward_and_gives_the_same_gradients() -> None:
    # Forced FP32 attention keeps its inputs' BF16 sources for the backward (cast up again there, exactly): FP32
    # attention then holds only its FP32 output more than BF16 attention does (2 more bytes per element).
    model = TinyAttention()
    calls: dict[str, list[OpCall]] = {}
    policy = OpPolicy({"attention": "auto"}, dtype=BF16, measure=fake_measure({}, calls))
    forward(model, policy, torch.randn(2, 8, 16))
    decide(policy)
    m = measure_calls(calls["attention"], "cpu", BF16, budget_s=0.0)
    assert m.fp32_extra_bytes == calls["attention"][0].count * 2 * 2 * 8 * 8 * 2
    x = torch.randn(2, 8, 16, requires_grad=True)
    forward(model, OpPolicy({"attention": "fp32"}, dtype=BF16), x).float().sum().backward()
    grads = [p.grad.clone() for p in (x, *model.parameters())]
    for p in (x, *model.parameters()):
        p.grad = None
    with torch.autocast("cpu", dtype=BF16, cache_enabled=False), _PlainFP32Attention():
        model(x).float().sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, (x, *model.parameters())))


class _PlainFP32Attention(TorchFunctionMode):
    """The reference: SDPA on FP32 copies of its inputs, autocast off, autograd keeping what it keeps."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        with torch.autocast("cpu", enabled=False):
            return func(*(a.float() for a in args), **kwargs)


def test_measure_calls_runs_both_variants_on_fresh_tensors_of_the_recorded_shapes() -> None:
    calls: dict[str, list[OpCall]] = {}
    policy = OpPolicy("auto", dtype=BF16, measure=fake_measure({}, calls))
    forward(TinyAttention(), policy, torch.randn(2, 8, 16))
    decide(policy)
    rng = torch.get_rng_state()
    m = measure_calls(calls["attention"], "cpu", BF16, budget_s=0.05)
    assert torch.equal(rng, torch.get_rng_state())  # the training run's random stream is untouched
    assert m.autocast_ms > 0 and m.fp32_ms > 0 and math.isfinite(m.autocast_ms + m.fp32_ms)
    assert m.fp32_err < m.autocast_err < 0.05  # the accuracy half of the rule: FP32 is closer to FP64


# ------------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "spec, error, words",
    [
        ("fastest", ValueError, ["'fastest'", "autocast", "auto"]),
        ({"atention": "fp32"}, ValueError, ["atention", "attention"]),
        ({"attention": "fp64"}, ValueError, ["fp64", "fp32"]),
        ({"attention": "fp16"}, ValueError, ["fp16", "bf16"]),  # a BF16 run does not compute in FP16
        (["attention"], TypeError, ["mapping"]),
    ],
)
def test_bad_policies_name_the_offending_keys_and_values(spec, error, words) -> None:
    with pytest.raises(error) as info:
        OpPolicy(spec, dtype=BF16)
    assert all(word in str(info.value) for word in words), str(info.value)


def test_a_mapping_fills_unnamed_families_with_autocast() -> None:
    policy = OpPolicy({"attention": "fp32", "norm": "auto"}, dtype=BF16)
    assert policy.choices == {**dict.fromkeys(FAMILIES, "autocast"), "attention": "fp32", "norm": "auto"}


# ----------------------------------------------------------------------------------------------------- state
def test_state_round_trip_resumes_the_decision_without_measuring_again() -> None:
    first = OpPolicy("auto", dtype=BF16, measure=fake_measure({"attention": (53.0, 29.0)}))
    forward(TinyAttention(), first, torch.randn(2, 8, 16))
    decide(first)
    state = first.state_dict()
    assert all(isinstance(v, str) for v in state.values())  # plain strings: weights_only checkpoints load it

    def never(*args, **kwargs):
        raise AssertionError("a resumed policy must not measure again")

    resumed = OpPolicy("auto", dtype=BF16, measure=never)
    resumed.load_state_dict(state)
    assert resumed.choices == first.choices and not resumed.pending
    forward(TinyAttention(), resumed, torch.randn(2, 8, 16))  # no measurement


def test_load_keeps_forced_choices_and_is_strict() -> None:
    forced = OpPolicy({"attention": "bf16"}, dtype=BF16)
    forced.load_state_dict({**dict.fromkeys(FAMILIES, "autocast"), "attention": "fp32"})
    assert forced.choices["attention"] == "bf16"  # the user's explicit choice wins over the checkpoint's
    with pytest.raises(KeyError, match="families"):
        forced.load_state_dict({"attention": "fp32"})
    with pytest.raises(ValueError, match="bogus"):
        forced.load_state_dict({**dict.fromkeys(FAMILIES, "autocast"), "norm": "bogus"})


def _rank_decides(rank: int, port: int, out_dir: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # Timings differ per rank (as noise would make them): rank 0 finds FP32 attention faster, rank 1 slower.
        times = {"attention": (53.0, 29.0) if rank == 0 else (29.0, 53.0)}
        policy = OpPolicy({"attention": "auto"}, dtype=BF16, measure=fake_measure(times))
        forward(TinyAttention(), policy, torch.randn(2, 8, 16))
        decide(policy)
        torch.save(policy.choices, f"{out_dir}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_every_rank_adopts_rank_zeros_decision(tmp_path) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_rank_decides, args=(port, str(tmp_path)), nprocs=2, start_method="fork")
    choices = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert choices[0] == choices[1] and choices[0]["attention"] == "fp32"


# ------------------------------------------------------------------------- the log says why the slower choice was kept
def test_the_op_policy_log_says_why_the_slower_choice_was_kept() -> None:
    from lit_mpstable.core.layout.policy import Measurement, StepCost, choose, describe

    step = StepCost(ms=10.0, peak_bytes=100 * 2**20)
    memory = Measurement(autocast_ms=3.9, fp32_ms=2.8, autocast_err=1e-3, fp32_err=1e-6, fp32_extra_bytes=40 * 2**20)
    assert choose(memory, 0.2, step) == "autocast"  # 28 % faster, but 40 % more peak memory for 11 % of the step
    text = describe("attention", "autocast", memory, 0.2, step)
    assert text.startswith("attention=autocast (2.8 ms fp32 vs 3.9 ms autocast; kept:")
    assert "peak memory by 40.0 MiB (40%)" in text
    noisy = Measurement(autocast_ms=3.0, fp32_ms=2.8, autocast_err=1e-3, fp32_err=1e-6)
    assert "under the 20% margin" in describe("matmul", "autocast", noisy, 0.2, step)
    worse = Measurement(autocast_ms=3.9, fp32_ms=2.0, autocast_err=1e-6, fp32_err=1e-3)
    assert "error" in describe("norm", "autocast", worse, 0.2, step)

"""OpPolicy: the decision rule (on injected timings), the mechanism (dtypes seen by the kernels), validation, state."""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lit_mpstable.islands import FP32Islands
from lit_mpstable.policy import FAMILIES, Measurement, OpCall, OpPolicy, choose, measure_calls

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


def test_auto_records_the_model_shapes_and_decides_per_family_from_injected_timings() -> None:
    seen: dict[str, list[OpCall]] = {}
    policy = OpPolicy("auto", dtype=BF16, measure=fake_measure({"attention": (53.0, 29.0), "matmul": (10, 21)}, seen))
    assert policy.pending
    forward(TinyAttention(), policy, torch.randn(2, 8, 16))
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
    assert len(outputs) == 4 and all(kernel_input_dtype(out) == torch.float32 for out in outputs)
    assert not seen and auto.choices["norm"] == "autocast"  # calls inside islands are not even measured
    islands.detach()
    outputs.clear()
    forward(model, OpPolicy({"norm": "bf16"}, dtype=BF16), torch.randn(2, 8, 16))
    assert len(outputs) == 2 and all(kernel_input_dtype(out) == BF16 for out in outputs)  # outside islands: forced


def test_measure_calls_runs_both_variants_on_fresh_tensors_of_the_recorded_shapes() -> None:
    calls: dict[str, list[OpCall]] = {}
    policy = OpPolicy("auto", dtype=BF16, measure=fake_measure({}, calls))
    forward(TinyAttention(), policy, torch.randn(2, 8, 16))
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

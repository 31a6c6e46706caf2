"""The leading indicators (core/guards/indicators.py): each statistic against a plain re-computation, the warning
rule, resume, and argument checks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lit_mpstable.core.guards.indicators import AttentionLogits, Indicators, SpikeScore, parameter_names


def _olmo_spike_score(losses, norms, window=4, rolling=6, threshold=2.0):
    """OLMo-core's SpikeScore written plainly on the host (the definition, not its code)."""
    def spike(value, history):
        if len(history) < window:
            return False
        mean = sum(history) / len(history)
        std = math.sqrt(sum((x - mean) ** 2 for x in history) / len(history))
        return std >= 1e-10 and value > mean + threshold * std

    hl, hn, flags, scores = [], [], [], []
    for loss, norm in zip(losses, norms):
        flags.append(spike(loss, hl[-window:]) or spike(norm, hn[-window:]))
        hl.append(loss)
        hn.append(norm)
        steps = len(flags)
        scores.append(sum(flags[-rolling:]) / rolling if steps >= rolling else
                      sum(flags) / steps if steps >= window else 0.0)
    return scores


def test_spike_score_is_olmo_cores_definition():
    gen = torch.Generator().manual_seed(0)
    losses = (torch.rand(30, generator=gen) + 2).tolist()
    norms = (torch.rand(30, generator=gen) + 1).tolist()
    losses[9], norms[17], losses[25] = 50.0, 40.0, 60.0
    score = SpikeScore(window_size=4, rolling_window=6, threshold_std=2.0)
    got = []
    for loss, norm in zip(losses, norms):
        score.update(torch.tensor(loss), torch.tensor(norm))
        got.append(float(score.score()))
    want = _olmo_spike_score(losses, norms)
    assert got == pytest.approx(want, abs=1e-6)
    assert max(want) > 0  # the spikes were seen


def test_spike_score_takes_a_one_element_loss_and_a_half_precision_norm():
    gen = torch.Generator().manual_seed(2)
    losses, norms = (torch.rand(20, generator=gen) + 2).tolist(), (torch.rand(20, generator=gen) + 1).tolist()
    losses[14] = 50.0
    score = SpikeScore(window_size=4, rolling_window=6, threshold_std=2.0)
    for loss, norm in zip(losses, norms):
        score.update(torch.tensor([loss]), torch.tensor(norm, dtype=torch.bfloat16))
    rounded = [float(torch.tensor(n, dtype=torch.bfloat16)) for n in norms]
    want = _olmo_spike_score(losses, rounded)[-1]
    assert want > 0 and float(score.score()) == pytest.approx(want)


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The arithmetic (not view or copy) operations run inside it, by name."""

    _VIEWS = {"detach", "view", "alias", "_reshape_alias", "unsqueeze", "select", "unbind", "as_strided", "t",
              "reshape", "_to_copy", "lift_fresh", "clone", "slice", "unfold", "expand"}

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self._VIEWS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_spike_score_update_only_queues_and_judges_the_same_whenever_read():
    gen = torch.Generator().manual_seed(1)
    losses, norms = (torch.rand(40, generator=gen) + 2).tolist(), (torch.rand(40, generator=gen) + 1).tolist()
    losses[12], norms[23], losses[31] = 50.0, 40.0, 60.0
    every, sparse = SpikeScore(4, 6, 2.0), SpikeScore(4, 6, 2.0)
    busy = 0
    for i, (loss, norm) in enumerate(zip(losses, norms)):
        every.update(torch.tensor(loss), torch.tensor(norm))
        every.score()
        with _Ops() as seen:
            sparse.update(torch.tensor(loss), torch.tensor(norm))
        busy += bool(seen.ops)
        if i == 17:  # a resume mid-way, with steps still queued
            resumed = SpikeScore(4, 6, 2.0)
            resumed.load_state_dict(sparse.state_dict())
            sparse = resumed
        if i % 7 == 6:
            assert torch.equal(every.score(), sparse.score())
    assert busy <= len(losses) // 4  # a step is queued, judged with others when 4 (the window) are queued
    want = _olmo_spike_score(losses, norms)[-1]
    assert torch.equal(every.score(), sparse.score()) and float(sparse.score()) == pytest.approx(want) and want > 0
    assert torch.equal(every.history, sparse.history) and torch.equal(every.flags, sparse.flags)


def test_without_a_spike_score_a_step_does_nothing_and_the_state_says_so():
    opt = _layered_adam(2)
    ind = Indicators(spike_score=False)
    with _Ops() as seen:
        ind.update_spike_score(torch.tensor(1.0), opt)
    assert ind.spike_score is None and seen.ops == []
    state = ind.state_dict()
    assert state["spike_score"] is None
    Indicators(spike_score=False).load_state_dict(state)
    with pytest.raises(ValueError, match="spike_score"):
        Indicators().load_state_dict(state)
    with pytest.raises(ValueError, match="spike_score"):
        Indicators(spike_score=1)  # type: ignore[arg-type]


def test_spike_score_judges_a_batch_in_a_few_operations_whatever_its_size():
    """A batch of queued steps is judged in one short, fixed list of tensor operations: no padding, no re-ordering of
    the window, no per-step index arithmetic (each is a kernel launch on a GPU, a few microseconds on a CPU)."""
    lists = []
    for queued in (1, 5):
        score = SpikeScore(8, 20, 2.0)
        for i in range(30 + queued):
            score.update(torch.tensor(1.0 + i % 3), torch.tensor(2.0))
        with _Ops() as seen:
            score.flush()
        lists.append(seen.ops)
    assert lists[0] == lists[1] and len(lists[0]) <= 16, lists


def _layered_adam(layers: int):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
    return opt


def test_measure_runs_as_many_operations_for_many_parameters_as_for_few():
    ops = []
    for layers in (2, 6):
        opt = _layered_adam(layers)
        ind = Indicators()
        ind.snapshot_(opt)
        opt.step()
        with _Ops() as seen:
            ind.measure(opt)
        ops.append(seen.ops)
    assert ops[0] == ops[1], ops  # multi-tensor ops, not one set of ops a parameter


def test_measure_makes_few_passes_over_the_parameters():
    """The update ratio reads the parameters in three multi-tensor passes (norm, difference, norm), the Adam lag in
    four (v - g * g * (1 - beta2^t) / threshold in one, the factors on the CPU, then clamp, sign, norm)."""
    opt = _layered_adam(3)
    ind = Indicators()
    ind.snapshot_(opt)
    opt.step()
    with _Ops() as seen:
        ind.measure(opt)
    passes = [op for op in seen.ops if op.startswith("_foreach")]
    assert len(passes) <= 7 and len(seen.ops) <= 22, seen.ops


def _adam_run(steps=3, lr=0.1):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.99))
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt, x, y


def test_update_ratio_and_adam_lag_match_a_plain_computation():
    model, opt, x, y = _adam_run()
    ind = Indicators(lag_threshold=0.5)
    ind.snapshot_(opt)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()
    ratios, lags, total = ind.measure(opt)
    want = [((p - b).norm() / b.norm()).item() for p, b in zip(model.parameters(), before)]
    assert ratios.tolist() == pytest.approx(want, rel=1e-5)
    lagging, sizes = [], []
    for p in model.parameters():
        state = opt.state[p]
        v_hat = state["exp_avg_sq"] / (1 - 0.99 ** float(state["step"]))
        lagging.append(float((p.grad.square() < 0.5 * v_hat).sum()))
        sizes.append(p.numel())
    assert lags.tolist() == pytest.approx([a / b for a, b in zip(lagging, sizes)])
    assert float(total) == pytest.approx(sum(lagging) / sum(sizes))
    assert 0 < float(total) < 1
    assert parameter_names(model, opt) == ["0.weight", "0.bias", "2.weight", "2.bias"]


@pytest.mark.gpu
def test_adam_lag_with_the_step_counts_on_the_gpu_matches_a_plain_computation():
    torch.manual_seed(0)
    model = nn.Linear(8, 4).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.9, 0.99), capturable=True)
    x = torch.randn(16, 8, device="cuda")
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    _, lags, _ = Indicators(lag_threshold=0.5).measure(opt)
    want = []
    for p in model.parameters():
        v_hat = opt.state[p]["exp_avg_sq"] / (1 - 0.99 ** float(opt.state[p]["step"]))
        want.append(float((p.grad.square() < 0.5 * v_hat).float().mean()))
    assert opt.state[model.weight]["step"].is_cuda and lags.tolist() == pytest.approx(want)


def test_adam_lag_reads_torchaos_quantized_second_moments():
    """torchao's 8-bit Adams keep exp_avg_sq as an OptimState8bit (codes and scales, which the multi-tensor ops do not
    take: measure raised NotImplementedError); its lag is read from the dequantized moment."""
    subclass_8bit = pytest.importorskip("torchao.optim.subclass_8bit")
    model, opt, _, _ = _adam_run()
    state = opt.state[model[0].weight]
    quantized = subclass_8bit.OptimState8bit.zeros(state["exp_avg_sq"].shape, signed=False, block_size=32)
    quantized.copy_(state["exp_avg_sq"])  # as torchao's AdamW8bit keeps it (its step compiles: seconds on a CPU)
    state["exp_avg_sq"] = quantized
    _, lags, _ = Indicators(lag_threshold=0.5).measure(opt)
    want = []
    for p in model.parameters():
        v = opt.state[p]["exp_avg_sq"]
        v_hat = (v.dequantize() if v is quantized else v) / (1 - 0.99 ** float(opt.state[p]["step"]))
        want.append(float((p.grad.square() < 0.5 * v_hat).float().mean()))
    assert lags.tolist() == pytest.approx(want) and lags[0] > 0


def test_adam_lag_reads_second_moments_kept_outside_the_optimizer():
    """BF16/FP8 moments live in the weight keeper, not in optimizer.state: given as ``moments`` (by parameter id, each
    with its step count), they are measured as the optimizer's own would be."""
    model, opt, _, _ = _adam_run()
    indicators = Indicators(lag_threshold=0.5)
    _, want, want_total = indicators.measure(opt)
    kept = {id(p): (opt.state[p].pop("exp_avg_sq"), int(opt.state[p].pop("step"))) for p in model.parameters()}
    _, lags, total = indicators.measure(opt)
    assert float(total) == 0.0 and indicators.lag_unmeasured is not None  # none in the optimizer's state
    _, lags, total = indicators.measure(opt, moments=kept)
    assert lags.tolist() == pytest.approx(want.tolist()) and float(total) == pytest.approx(float(want_total))
    assert float(total) > 0
    assert indicators.lag_unmeasured is None


def test_adam_lag_reads_the_gradients_a_step_kept_after_freeing_them():
    """Compact weights free each gradient as they step it; given as ``grads`` (by parameter id: what the step stepped
    with), they are measured as gradients the parameters still hold, and win over one a parameter holds."""
    model, opt, _, _ = _adam_run()
    indicators = Indicators(lag_threshold=0.5)
    _, want, want_total = indicators.measure(opt)
    stepped = {id(p): p.grad for p in model.parameters()}
    opt.zero_grad()
    _, lags, total = indicators.measure(opt, grads=stepped)
    assert lags.tolist() == pytest.approx(want.tolist()) and float(total) == pytest.approx(float(want_total))
    assert float(total) > 0 and indicators.lag_unmeasured is None
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e6)  # lags nowhere
    _, lags, _ = indicators.measure(opt, grads=stepped)
    assert lags.tolist() == pytest.approx(want.tolist())


def test_measure_says_why_it_measured_no_adam_lag():
    """An optimizer without Adam's second moment (SGD), or parameters that hold no gradient after the step (compact
    weights free each one as they step it), measure no lag: ``lag_unmeasured`` says why (a logged 0 read as 'no
    lag')."""
    model, opt, _, _ = _adam_run()
    indicators = Indicators()
    indicators.measure(opt)
    assert indicators.lag_unmeasured is None
    opt.zero_grad()
    indicators.measure(opt)
    assert "holds a gradient" in indicators.lag_unmeasured
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    sgd.step()
    indicators.measure(sgd)
    assert "exp_avg_sq" in indicators.lag_unmeasured


def test_measure_without_snapshot_or_adam_state_gives_zeros():
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ratios, lags, total = Indicators().measure(opt)
    assert ratios.tolist() == [0.0, 0.0] and lags.tolist() == [0.0, 0.0] and float(total) == 0.0


def test_judge_warns_on_a_doubled_update_ratio_once_per_crossing_naming_the_layer():
    ind = Indicators(ratio_factor=2.0, baseline=3, lag_limit=0.9)
    names = ["a.weight", "b.weight"]
    assert ind.judge([0.01, 0.02], [0.1, 0.1], 0.1, names, 1) == []
    assert ind.judge([0.01, 0.02], [0.1, 0.1], 0.1, names, 2) == []
    assert ind.judge([0.01, 0.021], [0.1, 0.1], 0.1, names, 3) == []
    warned = ind.judge([0.01, 0.05], [0.1, 0.1], 0.1, names, 4)
    assert len(warned) == 1 and "'b.weight'" in warned[0] and "update ratio" in warned[0]
    assert ind.judge([0.01, 0.06], [0.1, 0.1], 0.1, names, 5) == []  # still above: no repeat
    assert ind.judge([0.01, 0.02], [0.1, 0.1], 0.1, names, 6) == []
    lag = ind.judge([0.01, 0.02], [0.2, 0.95], 0.92, names, 7)
    assert len(lag) == 1 and "Adam lag" in lag[0] and "'b.weight'" in lag[0]


def test_indicator_state_round_trips_and_later_judgements_match():
    a, b = Indicators(baseline=2, spike_window=2, spike_rolling_window=3), None
    for i in range(5):
        a.spike_score.update(torch.tensor(1.0 + i % 2), torch.tensor(2.0))
        a.judge([0.01 * (i + 1)], [0.1], 0.1, ["w"], i)
    b = Indicators(baseline=2, spike_window=2, spike_rolling_window=3)
    b.load_state_dict(a.state_dict())
    for ind in (a, b):
        ind.spike_score.update(torch.tensor(30.0), torch.tensor(2.0))
    assert float(a.spike_score.score()) == float(b.spike_score.score()) > 0
    assert a.judge([1.0], [0.1], 0.1, ["w"], 9) == b.judge([1.0], [0.1], 0.1, ["w"], 9) != []


@pytest.mark.parametrize("kwargs", [dict(ratio_factor=1.0), dict(ratio_factor=float("nan")), dict(baseline=0),
                                    dict(lag_threshold=-1.0), dict(lag_limit=1.5), dict(spike_window=1),
                                    dict(spike_threshold_std=True)])
def test_bad_arguments_name_the_argument(kwargs):
    name = next(iter(kwargs)).replace("spike_", "")
    with pytest.raises(ValueError, match=name.split("_")[0]):
        Indicators(**kwargs)


def _reference_logits(q, k, mask=None):
    logits = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return logits


@pytest.mark.parametrize("batch_first", [False, True])
def test_attention_logits_of_multihead_attention(batch_first):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=batch_first)
    model = nn.Sequential(mha)
    rec = AttentionLogits(model)
    seq = torch.randn(3, 5, 8)  # (N, L, E)
    x = seq if batch_first else seq.transpose(0, 1)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)  # MHA: True = not allowed
    mha(x, x, x, attn_mask=causal)
    assert rec.take() == {}  # not armed: nothing measured
    rec.armed = True
    mha(x, x, x, attn_mask=causal)
    got = rec.take()["0"]
    w_q, w_k, _ = mha.in_proj_weight.chunk(3)
    b_q, b_k, _ = mha.in_proj_bias.chunk(3)
    q = (seq @ w_q.T + b_q).view(3, 5, 2, 4).transpose(1, 2)
    k = (seq @ w_k.T + b_k).view(3, 5, 2, 4).transpose(1, 2)
    want = _reference_logits(q, k, ~causal).amax(dim=(0, 2, 3))
    assert torch.allclose(got, want, atol=1e-5)
    rec.remove()


class _SdpaAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 6, 3, 2, 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_attention_logits_of_an_sdpa_caller_and_the_function_is_restored():
    torch.manual_seed(0)
    model = nn.Sequential(_SdpaAttention())
    rec = AttentionLogits(model)
    assert rec.names == ["0"]
    x = torch.randn(2, 6, 8)
    original = F.scaled_dot_product_attention
    rec.armed = True
    out = model(x)
    assert F.scaled_dot_product_attention is original
    q, k, v = model[0].qkv(x).view(2, 6, 3, 2, 4).permute(2, 0, 3, 1, 4)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    want = _reference_logits(q, k, causal).amax(dim=(0, 2, 3))
    assert torch.allclose(rec.take()["0"], want, atol=1e-5)
    assert torch.allclose(out, original(q, k, v, is_causal=True))


def test_an_unarmed_recorder_leaves_no_hook_on_the_model():
    model = nn.Sequential(_SdpaAttention(), nn.MultiheadAttention(8, 2))
    hooks = lambda: sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())  # noqa: E731
    rec = AttentionLogits(model)
    assert rec.names == ["1", "0"] and hooks() == 0
    rec.armed = True
    assert hooks() == 3
    model[0](torch.randn(2, 6, 8))
    rec.armed = False
    assert hooks() == 0 and list(rec.take()) == ["0"]
    rec.armed = True
    rec.remove()
    assert hooks() == 0 and not rec.armed


@pytest.mark.parametrize("module", ["mha", "sdpa"])
def test_attention_logits_are_measured_in_fp32_under_fp16_autocast(module):
    """A logit of ~1e5 under FP16 autocast is recorded as ~1e5, not as the inf an FP16 product gives."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True) if module == "mha" else _SdpaAttention())
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(250.0)
    rec = AttentionLogits(model)
    rec.armed = True
    x = torch.randn(2, 6, 8)
    with torch.autocast("cpu", dtype=torch.float16):
        model[0](x, x, x) if module == "mha" else model(x)
    got = rec.take()["0"]
    assert torch.isfinite(got).all() and got.max() > 65504, got


def test_attention_logits_rejects_unknown_module_names():
    with pytest.raises(ValueError, match="sdpa_modules"):
        AttentionLogits(nn.Sequential(nn.Linear(2, 2)), sdpa_modules=["blocks.0"])


def test_two_recorders_on_one_model_both_record_and_the_function_is_restored():
    torch.manual_seed(0)
    model = nn.Sequential(_SdpaAttention())
    original = F.scaled_dot_product_attention
    first, second = AttentionLogits(model), AttentionLogits(model)  # OverflowMonitor's and QKClip's
    first.armed = second.armed = True
    x = torch.randn(2, 6, 8)
    for _ in range(2):
        model(x)
        assert F.scaled_dot_product_attention is original
    assert torch.equal(first.take()["0"], second.take()["0"])


class _GroupedQueryAttention(nn.Module):
    """Llama's layout: 4 query heads share 2 key/value heads (``enable_gqa``)."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)

    def qkv(self, x):
        return (self.q_proj(x).view(2, 6, 4, 2).transpose(1, 2), self.k_proj(x).view(2, 6, 2, 2).transpose(1, 2),
                self.v_proj(x).view(2, 6, 2, 2).transpose(1, 2))

    def forward(self, x):
        return F.scaled_dot_product_attention(*self.qkv(x), is_causal=True, enable_gqa=True)


def test_attention_logits_of_grouped_query_attention_are_per_query_head():
    torch.manual_seed(0)
    model = nn.Sequential(_GroupedQueryAttention())
    rec = AttentionLogits(model)
    rec.armed = True
    x = torch.randn(2, 6, 8)
    model(x)
    q, k, _ = model[0].qkv(x)
    k = k.repeat_interleave(2, dim=1)  # query heads 0, 1 read key head 0; 2, 3 read key head 1 (as SDPA does)
    want = _reference_logits(q, k, torch.ones(6, 6, dtype=torch.bool).tril()).amax(dim=(0, 2, 3))
    assert torch.allclose(rec.take()["0"], want, atol=1e-5)


class _Failing(_SdpaAttention):
    def __init__(self, error):
        super().__init__()
        self.error = error

    def forward(self, x):
        super().forward(x)
        raise self.error


def test_a_forward_that_raises_leaves_the_function_restored():
    """An exception restores torch's function at once (the leaving hook always runs); a KeyboardInterrupt, which
    skips torch's hooks, when the recorder is disarmed (the callbacks do it in on_exception)."""
    original = torch._C._nn.scaled_dot_product_attention  # torch's own, whatever F holds
    for error in (RuntimeError("out of memory"), KeyboardInterrupt()):
        model = nn.Sequential(_Failing(error))
        rec = AttentionLogits(model)
        rec.armed = True
        with pytest.raises(type(error)):
            model(torch.randn(2, 6, 8))
        if isinstance(error, KeyboardInterrupt):
            rec.armed = False
        assert F.scaled_dot_product_attention is original
        rec.remove()

"""CompactWeights' fused Adam/AdamW step (lit_mpstable.core.weights.compact_fused) against the generic path through FP32
copies, and its C loop on the CPU against the compiled kernel and the eager rounding."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

import lit_mpstable.core.weights.compact_fused as fused_module
from lit_mpstable.core.weights.compact import CompactWeights
from lit_mpstable.core.weights.compact_fused import FusedAdam, _adam_kernel
from lit_mpstable.core.weights.compact_rounding import hash32, noise_bits, round_stochastic_, step_keys

MODES = ["kahan", "stochastic"]


@pytest.fixture(params=["native", "compiled"])
def path(request, monkeypatch) -> str:
    """Each test that takes it runs twice: through the C loop (lit_mpstable.core.weights.compact_fused.native_kernel,
    the CPU default where a C compiler builds it) and through inductor's compiled kernel (a CPU without one, and every
    GPU)."""
    if request.param == "native":
        assert fused_module.native_kernel() is not None  # CI and development machines have a C compiler
    else:
        monkeypatch.setattr(fused_module, "native_kernel", lambda: None)
    return request.param


@pytest.fixture
def compiled_only(monkeypatch) -> None:
    # Tests of torch.compile's side (its failures, its first-call time): the C loop stands aside.
    monkeypatch.setattr(fused_module, "native_kernel", lambda: None)


def _lowbias32(x: int) -> int:
    # The reference, on Python integers (unbounded, masked to 32 bits): Chris Wellons' lowbias32.
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_the_hash_is_lowbias32_eagerly_and_compiled() -> None:
    offsets = [0, 12345, 2**31 - 5, 2**32 - 3]  # wrapping past int32's top and past 2**32
    n = 37  # not a multiple of any vector width: the compiled loop's tail too
    for offset in offsets:
        expected = [(_lowbias32(offset + i) >> 16) & 0xFFFF for i in range(n)]
        assert noise_bits(n, offset, torch.device("cpu"), torch.bfloat16).tolist() == expected
        fp16 = noise_bits(n, offset, torch.device("cpu"), torch.float16)
        assert fp16.tolist() == [((_lowbias32(offset + i) >> 8) & 0xFFFFFF) * 2.0**-24 for i in range(n)]
    signed = torch.tensor([v - 2**32 if v >= 2**31 else v for v in (0, 1, 2**31 - 1, 2**31, 2**32 - 1)],
                          dtype=torch.int32)
    compiled = torch.compile(hash32, dynamic=True)(signed)
    assert [w & 0xFFFFFFFF for w in compiled.tolist()] == [_lowbias32(v) for v in (0, 1, 2**31 - 1, 2**31, 2**32 - 1)]
    # The bits are uniform: each of the 16 is set in half of 2**16 consecutive keys (a chi-square-free check).
    bits = noise_bits(2**16, 99, torch.device("cpu"), torch.bfloat16)
    ones = torch.stack([(bits >> b) & 1 for b in range(16)]).sum(1).double() / 2**16
    assert bool(((ones - 0.5).abs() < 0.01).all()), ones


def test_the_random_keys_are_splitmix64_of_seed_step_and_stream() -> None:
    # The reference on Python integers: splitmix64's mixing of seed, step and stream (a parameter's CRC-32) in turn,
    # folded to 32 bits, as a signed int32. Computed once a step for what the streams share, the same numbers.
    def reference(*values: int) -> int:
        h, mask = 0x9E3779B97F4A7C15, 2**64 - 1
        for v in values:
            h = ((h ^ (v & mask)) * 0xBF58476D1CE4E5B9) & mask
            h = ((h ^ (h >> 31)) * 0x94D049BB133111EB) & mask
            h ^= h >> 29
        k = (h ^ (h >> 32)) & 0xFFFFFFFF
        return k - 2**32 if k >= 2**31 else k

    for seed, step in [(0, 0), (3, 1), (2**64 - 1, 12345), (2**31, 2**40 + 7)]:
        streams = [0, 1, 0xDEADBEEF, 2**32 - 1]
        assert step_keys(seed, step, streams) == [reference(seed, step, s) for s in streams]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 300)  # 19200 weights: several slices at chunk_bytes=2**16
        self.b = nn.Linear(300, 8)
        self.scale = nn.Parameter(torch.ones(1))  # a one-element parameter: its own compiled variant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) * self.scale


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1),
    "adam_l2": lambda params: torch.optim.Adam(params, lr=3e-3, weight_decay=0.05),
    "adam_maximize": lambda params: torch.optim.Adam(params, lr=3e-3, betas=(0.8, 0.99), maximize=True),
    "adamw_tensor_lr": lambda params: torch.optim.AdamW(params, lr=torch.tensor(2e-3), fused=True),
}


def _run(mode: str, name: str, fused: bool | None, steps: int = 4, chunk_bytes: int | None = None):
    torch.manual_seed(0)
    model = _Net().bfloat16()
    opt = OPTIMIZERS[name](model.parameters())
    cw = CompactWeights(model, [opt], mode, seed=3, fused=fused, chunk_bytes=chunk_bytes)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(16, 64, generator=g).bfloat16()
        (model(x).float().square().mean()).backward()
        cw.step_(opt, grad_multiplier=torch.tensor(0.5), clip_value=0.02 if step == 1 else None)
    return model, opt, cw


def _values(model: nn.Module, cw: CompactWeights) -> dict[str, torch.Tensor]:
    comp = cw.state_dict()["compensation"]
    return {n: p.detach().double() + (comp[n].double() if n in comp else 0) for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_matches_the_fp32_copies(mode: str, name: str, path: str) -> None:
    model, opt, cw = _run(mode, name, fused=None)
    ref_model, ref_opt, ref_cw = _run(mode, name, fused=False)
    assert cw._fused is not None and ref_cw._fused is None  # each took its own path
    # Eager torch computes lerp with a fused multiply-add, the kernel with two roundings: FP32 moments an ulp apart
    # now and then; a rounding tie goes to even in the kernel (one draw in 65536). Either shows in a Kahan
    # compensation (8 more bits) or flips a stochastic rounding, and a flipped moment changes that element's later
    # updates by 2**-8 of themselves. So: nearly all bits equal, and the rest within a small fraction of the distance
    # the weights moved (4 steps of at most ~lr each), or a BF16 ulp or two for stochastically rounded weights.
    got, expected = _values(model, cw), _values(ref_model, ref_cw)
    for pname, value in expected.items():
        diff = (got[pname] - value).abs()
        assert (diff == 0).double().mean() >= 0.98, pname
        bound = 2.0**-10 * 4 * 3e-3 + (2.0**-6 if mode == "stochastic" else 2.0**-20) * value.abs()
        assert bool((diff <= bound).all()), (pname, diff.max())
    for p, ref_p in zip(model.parameters(), ref_model.parameters()):
        state, ref_state = opt.state[p], ref_opt.state[ref_p]
        assert state.keys() == ref_state.keys() and torch.equal(state["step"], ref_state["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].dtype == torch.bfloat16
            a, b = state[key].double(), ref_state[key].double()
            assert (a == b).double().mean() >= 0.98, key
            # The gradients come from the weights, so a moment near zero may move more than an ulp: bound by the scale.
            assert (a - b).abs().max() <= 2.0**-6 * b.abs().max(), key
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("mode", MODES)
def test_fused_slices_resume_and_recompile_nothing(mode: str, path: str) -> None:
    # Slicing changes nothing bit for bit (an elementwise kernel; random numbers keyed by element).
    sliced, _, sliced_cw = _run(mode, "adamw", fused=None, chunk_bytes=2**16)
    whole, _, whole_cw = _run(mode, "adamw", fused=None)
    for (n, a), b in zip(sliced.named_parameters(), whole.parameters()):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), n
    # Learning rates, steps, multipliers and slice lengths are tensors or dynamic sizes: no graph after the first.
    torch.manual_seed(0)
    model = _Net().bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    cw = CompactWeights(model, [opt], mode, chunk_bytes=2**16)
    compiled = []
    for step in range(5):
        model(torch.randn(4, 64).bfloat16()).float().sum().backward()
        cw.step_(opt, grad_multiplier=1.0 / (step + 1))
        schedule.step()  # would warn if optimizer.step had not been called
        compiled.append(counters["stats"]["unique_graphs"])
    assert compiled[1:] == [compiled[0]] * 4, compiled


def test_a_kernel_that_cannot_compile_falls_back_with_a_warning(monkeypatch, compiled_only) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(fused_module.torch, "compile", lambda fn, **kwargs: broken)
    with pytest.warns(UserWarning, match="did not compile .*no C\\+\\+ compiler.*fused=False"):
        model, _, cw = _run("kahan", "adamw", fused=None)
    ref_model, _, _ = _run("kahan", "adamw", fused=False)
    assert cw._fused_failed
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    with pytest.raises(RuntimeError, match=r"fused=True.*'scale'.*no C\+\+ compiler"):
        _run("kahan", "adamw", fused=True)


class _Ops(TorchDispatchMode):
    """Records the name of every ATen operation run under it (as a FLOP counter or a host-read recorder would)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_a_step_under_a_dispatch_mode_leaves_later_fused_steps_alone(path: str) -> None:
    # torch.compile skips a frame entered under a TorchDispatchMode and marks its code skipped for the whole process:
    # had the step under the mode called the compiled kernel, every later CompactWeights in the process would have
    # stepped through FP32 copies (other numbers). The kernel runs eagerly there, seen by the mode.
    before, _, before_cw = _run("kahan", "adamw", fused=None)
    model, opt, cw = _run("kahan", "adamw", fused=None, steps=1)
    (model(torch.randn(16, 64).bfloat16()).float().square().mean()).backward()
    try:
        with _Ops() as seen:
            cw.step_(opt)
        assert not cw._fused_failed and "lerp.Tensor" in seen.ops  # the fused step, eager, under the mode
        after, _, after_cw = _run("kahan", "adamw", fused=None)
        assert not before_cw._fused_failed and not after_cw._fused_failed
        for (n, a), b in zip(after.named_parameters(), before.parameters()):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), n
    except AssertionError:
        torch._dynamo.reset()  # the skipped kernel stays with this test, not the ones after it
        raise


def test_a_slow_first_call_is_explained_once(monkeypatch, compiled_only) -> None:
    # A call longer than SLOW_S compiled: said once per object, with the way out (a negative limit makes each slow).
    monkeypatch.setattr(FusedAdam, "SLOW_S", -1.0)
    # The notice is also said once per inductor cache (the test at the end of this file); here: once per object, as if
    # this process were the cache's first.
    import lit_mpstable.core.weights.compact_fused as fused_module

    monkeypatch.setattr(fused_module, "_first_to_say", lambda marker: True)
    with pytest.warns(UserWarning, match="first fused Adam step.*compiled its kernel.*fused=False") as record:
        _run("stochastic", "adamw", fused=None)
    assert sum("first fused Adam step" in str(w.message) for w in record) == 1


def test_what_the_kernel_does_not_take_goes_through_fp32_copies() -> None:
    torch.manual_seed(0)
    model = _Net().bfloat16()
    model.b.float()  # an FP32 island: stepped as it is
    amsgrad = torch.optim.AdamW([model.a.weight], lr=1e-3, amsgrad=True)
    plain = torch.optim.AdamW([model.a.bias, model.b.weight, model.b.bias, model.scale], lr=1e-3)
    cw = CompactWeights(model, [amsgrad, plain], "kahan")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    island = model.b.weight.detach().clone()
    cw.step_(amsgrad)
    cw.step_(plain)
    assert set(amsgrad.state[model.a.weight]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert amsgrad.state[model.a.weight]["max_exp_avg_sq"].dtype == torch.bfloat16
    assert plain.state[model.b.weight]["exp_avg"].dtype == torch.float32 and not torch.equal(model.b.weight, island)
    assert cw._fused is not None  # a.bias and scale took the kernel


def _bit_trick(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # The generic path's rounding, written out: 16 random bits added to the low half of FP32's bits, then truncated.
    return ((x.clone().view(torch.int32) + k) & -65536).view(torch.float32).to(torch.bfloat16)


def test_the_kernels_rounding_is_the_bit_trick_but_for_ties() -> None:
    g = torch.Generator().manual_seed(0)
    n = 400_000
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-149, 103, (n,), generator=g).float())
    # Binade edges (a power of two and its FP32 neighbours), subnormals, zeros, infinities, NaN.
    edges = torch.exp2(torch.randint(-149, 103, (50_000,), generator=g).float())
    x[:50_000] = edges * (1 + torch.randint(-3, 4, (50_000,), generator=g).float() * 2.0**-23)
    x[50_000:50_010] = torch.tensor([0.0, -0.0, 1e-45, -3e-39, 2.0**-126, float("inf"), -float("inf"),
                                     float("nan"), 3.3e30, -1.9960938])
    x[50_010:60_000] = -x[50_010:60_000]
    k = torch.randint(0, 65536, (n,), dtype=torch.int32, generator=g)
    expected = _bit_trick(x, k)
    tie = ((x.view(torch.int32) & 0xFFFF) + k) == 0xFFFF  # x + (k - 32767) ulps is halfway: round half to even
    assert 0 < int(tie.sum()) < 20
    for got in (fused_module._round_stochastic_bf16(x, k.float() - 32767.0),
                torch.compile(fused_module._round_stochastic_bf16, dynamic=True)(x, k.float() - 32767.0)):
        same = (got.view(torch.int16) == expected.view(torch.int16)) | (got.isnan() & expected.isnan())
        assert bool(same[~tie].all()), x[~same & ~tie][:5]
        assert bool(((got.float() - expected.float()).abs()[tie] <= expected.float().abs()[tie] * 2.0**-7).all())


@pytest.mark.parametrize("mode", MODES)
def test_the_compiled_kernel_computes_what_the_eager_one_does(mode: str) -> None:
    # The kernel's torch code run eagerly (every cast rounding for real) against inductor's C++: the same bits but
    # where eager lerp's fused multiply-add differs by an FP32 ulp (and a compensation or rounding with it), so the
    # compiler kept every rounding (emulate_precision_casts) and reordered nothing that matters.
    g = torch.Generator().manual_seed(2)
    n = 10_007
    def tensors():
        w = torch.randn(n, generator=g).bfloat16()
        return [w, (w.float() * 2.0**-9).bfloat16() if mode == "kahan" else None,
                torch.randn(n, generator=g).bfloat16(), (torch.randn(n, generator=g) * 0.1).bfloat16(),
                (torch.rand(n, generator=g) * 0.01).bfloat16()]
    eager = tensors()
    g.manual_seed(2)
    compiled = tensors()
    group = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "decoupled_weight_decay": True}
    scalars = FusedAdam.scalars(group, 3.0, torch.tensor(0.5), 1.0)
    key = torch.tensor(-12345, dtype=torch.int32)
    _adam_kernel(*eager, scalars, key)
    FusedAdam()._kernel(*compiled, scalars, key)
    weight = eager[0].double().abs()
    for a, b in zip(eager, compiled):
        if a is None:
            continue
        assert (a == b).double().mean() > 0.999
        # An ulp of itself, or (a compensation near zero) an FP32 ulp of the weight it completes.
        assert bool(((a.double() - b.double()).abs() <= 2.0**-7 * a.double().abs() + 2.0**-22 * weight).all())
    assert not torch.equal(eager[0], tensors()[0])  # it did step


def test_bad_fused_argument_is_named() -> None:
    model = _Net().bfloat16()
    with pytest.raises(ValueError, match=r"fused='yes'.*True .*False .*None"):
        CompactWeights(model, [torch.optim.AdamW(model.parameters())], "kahan", fused="yes")


def test_an_optimizer_with_step_hooks_is_stepped_inside_optimizer_step() -> None:
    # A pre-hook that sets lr to 0 must stop the update, and a post-hook must see the parameters stepped: the fused
    # kernel would run before optimizer.step() and out of its groups, so hooked optimizers take the FP32 stand-ins.
    seen: list[int] = []

    def zero_lr(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            group["lr"] = 0.0

    torch.manual_seed(0)
    model = _Net().bfloat16()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    opt.register_step_pre_hook(zero_lr)
    opt.register_step_post_hook(lambda o, a, k: seen.append(sum(len(g["params"]) for g in o.param_groups)))
    cw = CompactWeights(model, [opt], "kahan")
    model(torch.randn(4, 64).bfloat16()).float().sum().backward()
    cw.step_(opt)
    assert cw._fused is None and seen == [5]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(lambda o, a, k: None)  # a global hook too
    try:
        plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cw = CompactWeights(model, [plain], "kahan")
        model(torch.randn(4, 64).bfloat16()).float().sum().backward()
        cw.step_(plain)
        assert cw._fused is None
    finally:
        handle.remove()


def test_an_infinite_weight_without_weight_decay_keeps_finite_moments_as_torch_does(path: str) -> None:
    # Adam without weight decay adds no L2 term: an inf weight times a zero decay must not turn the moments NaN.
    results = {}
    for fused in (None, False):
        torch.manual_seed(0)
        model = _Net().bfloat16()
        with torch.no_grad():
            model.a.weight[0, 0] = float("inf")
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        cw = CompactWeights(model, [opt], "stochastic", fused=fused)
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.01)
        cw.step_(opt)
        results[fused] = (opt.state[model.a.weight]["exp_avg"][0, 0], opt.state[model.a.weight]["exp_avg_sq"][0, 0])
        assert (cw._fused is not None) is (fused is None)
    assert all(bool(torch.isfinite(t)) for t in results[None]), results
    assert [float(t) for t in results[None]] == [float(t) for t in results[False]]


class _Many(nn.Module):
    # Parameters of many sizes (vector tails of every length, 2-d and 1-d) for one step with several groups.
    def __init__(self) -> None:
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(*shape)) for shape in
                                   [(3,), (17,), (5, 13), (64,), (16, 16), (1000,), (7, 9)])


@pytest.mark.parametrize("mode", MODES)
def test_many_parameters_in_mixed_groups_step_as_each_alone(mode: str, path: str) -> None:
    # One step over every fused parameter of several groups (keys, scalars and step counters made per step, not per
    # parameter) gives, bit for bit, what each parameter stepped alone gives: its own optimizer and CompactWeights,
    # same name, seed and step count, so the same random keys. Some parameters miss a gradient on some steps (their
    # own step counts), the learning rate follows a schedule; no graph is compiled after the first step.
    def build(together: bool):
        torch.manual_seed(0)
        model = _Many().bfloat16()
        ps = list(model.ps)
        groups = [{"params": ps[:3], "lr": 3e-3, "weight_decay": 0.1}, {"params": ps[3:], "lr": 1e-3}]
        if together:
            opts = [torch.optim.AdamW(groups, betas=(0.8, 0.99))]
        else:
            opts = [torch.optim.AdamW([{**g, "params": [p]}], betas=(0.8, 0.99)) for g in groups for p in g["params"]]
        schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in opts]
        return model, opts, schedules, [CompactWeights(model, [o], mode, seed=5) for o in opts]

    results, graphs = [], []
    for together in (True, False):
        model, opts, schedules, cws = build(together)
        g = torch.Generator().manual_seed(1)
        for step in range(4):
            for i, p in enumerate(model.ps):
                if (i + step) % 3 != 0:  # a different set of parameters has a gradient at each step
                    p.grad = (torch.randn(p.shape, generator=g) * 1e-2).bfloat16()
                else:
                    torch.randn(p.shape, generator=g)
            for opt, cw, schedule in zip(opts, cws, schedules):
                if any(p.grad is not None for group in opt.param_groups for p in group["params"]):
                    cw.step_(opt, grad_multiplier=torch.tensor(0.5))
                else:
                    cw.steps += 1  # stepped alone: the together run's step count (the random keys) goes on
                schedule.step()
            if together:
                graphs.append(counters["stats"]["unique_graphs"])
        assert all(not cw._fused_failed and cw._fused is not None for cw in cws)
        comps = {n: c for cw in cws for n, c in cw.state_dict()["compensation"].items()}
        state = {id(p): s for opt in opts for p, s in opt.state.items()}
        results.append([(p.detach().clone(), comps.get(f"ps.{i}"), state[id(p)]) for i, p in enumerate(model.ps)])
    assert graphs[1:] == [graphs[0]] * 3, graphs
    for i, ((w, c, s), (w_ref, c_ref, s_ref)) in enumerate(zip(*results)):
        assert torch.equal(w.view(torch.int16), w_ref.view(torch.int16)), i
        assert (c is None) == (mode == "stochastic") and (c is None or torch.equal(c, c_ref)), i
        assert torch.equal(s["step"], s_ref["step"]) and float(s["step"]) == sum((i + k) % 3 != 0 for k in range(4))
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(s[key].view(torch.int16), s_ref[key].view(torch.int16)), (i, key)


@pytest.mark.parametrize("mode", MODES)
def test_the_plain_kernel_is_the_full_one_without_clip_or_l2(mode: str, path: str) -> None:
    # AdamW without a clip value takes the graph that leaves the clamp and the L2 where out: bit for bit the full
    # graph's words, NaN and infinities included (a clamp to +-inf returns its input, the where picks the gradient).
    group = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "decoupled_weight_decay": True}
    assert FusedAdam.plain(group, None) and not FusedAdam.plain(group, 1.0)
    assert not FusedAdam.plain({**group, "decoupled_weight_decay": False}, None)
    assert FusedAdam.plain({**group, "decoupled_weight_decay": False, "weight_decay": 0.0}, None)
    g = torch.Generator().manual_seed(4)
    n = 4_099
    base = [torch.randn(n, generator=g).bfloat16() for _ in range(3)] + [(torch.rand(n, generator=g) * 0.01).bfloat16()]
    base[0][:3] = torch.tensor([float("inf"), -float("inf"), float("nan")])  # non-finite weights pass through alike
    base[1][3:6] = torch.tensor([float("inf"), -float("inf"), float("nan")])  # and non-finite gradients
    fused = FusedAdam()
    words = []
    for plain in (True, False):
        w, g16, m, v = (t.clone() for t in base)
        comp = (w.float() * 2.0**-9).bfloat16() if mode == "kahan" else None
        scalars = FusedAdam.scalars(group, 2.0, torch.tensor(0.5), None)
        fused.run_(w, comp, g16, m, v, scalars, torch.tensor(77, dtype=torch.int32), eager=False, plain=plain)
        words.append([t.view(torch.int16) for t in (w, m, v, comp) if t is not None])
    assert not torch.equal(words[0][0], base[0].view(torch.int16))  # it stepped
    for a, b in zip(*words):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", MODES)
def test_new_tensors_behind_a_parameter_or_its_moments_are_the_ones_stepped(mode: str) -> None:
    # The kernel's flat views and key tensors are kept from step to step: a parameter given new data and moments
    # replaced by a loaded optimizer state must be stepped there, bit for bit as a run that never replaced them,
    # and the old tensors left alone.
    def run(replace: bool) -> tuple[nn.Module, torch.optim.Optimizer, list[tuple[torch.Tensor, torch.Tensor]]]:
        torch.manual_seed(0)
        model = _Net().bfloat16()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        cw = CompactWeights(model, [opt], mode, seed=3)
        g = torch.Generator().manual_seed(1)
        old: list[tuple[torch.Tensor, torch.Tensor]] = []
        for step in range(4):
            if replace and step == 2:  # new data behind each parameter (the moments stay)
                old += [(p.data, p.data.clone()) for p in model.parameters()]
                for p in model.parameters():
                    p.data = p.data.clone()
            if replace and step == 3:  # new moments (the parameters' data stays)
                old += [(s[k], s[k].clone()) for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            model(torch.randn(16, 64, generator=g).bfloat16()).float().square().mean().backward()
            cw.step_(opt, grad_multiplier=torch.tensor(0.5))
        assert cw._fused is not None
        return model, opt, old

    model, opt, old = run(replace=True)
    ref_model, ref_opt, _ = run(replace=False)
    for (name, p), ref_p in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p.view(torch.int16), ref_p.view(torch.int16)), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key].view(torch.int16), ref_opt.state[ref_p][key].view(torch.int16)), key
    assert old and all(torch.equal(t, before) for t, before in old)  # what was replaced kept its values


@pytest.mark.parametrize("recast", [True, False])
def test_a_parameter_that_leaves_the_kernel_lets_go_of_its_old_tensors(recast: bool) -> None:
    # A precision fallback casts a parameter to FP32 (its BF16 data and moments are replaced): the kernel's kept views
    # of them must not hold the old tensors alive, whether the cast is announced (follow_model_weights_ with recast) or
    # only seen at the next step.
    torch.manual_seed(0)
    model = _Net().bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cw = CompactWeights(model, [opt], "stochastic", seed=3)
    model(torch.randn(4, 64).bfloat16()).float().sum().backward()
    cw.step_(opt)
    p = model.a.weight
    old_data = weakref.ref(p.data.untyped_storage())
    old_moment = weakref.ref(opt.state[p]["exp_avg"].untyped_storage())
    assert old_data() is not None and old_moment() is not None
    before = p.data
    p.data = p.data.float()
    if recast:
        cw.follow_model_weights_(recast=[(p, before)])
    del before
    with torch.no_grad():
        p.grad = torch.full_like(p, 1e-3)
        for q in model.parameters():
            if q is not p:
                q.grad = torch.full_like(q, 1e-3)
    cw.step_(opt)
    gc.collect()
    assert opt.state[p]["exp_avg"].dtype == torch.float32  # stepped through FP32 copies now
    data_freed, moment_freed = old_data() is None, old_moment() is None
    assert data_freed and moment_freed


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_in_an_accumulated_gradient_skips_the_fused_step_and_the_next_step_is_as_without_it(
    mode: str, path: str
) -> None:
    # Through the stepper, gradients accumulated over two backwards, a NaN written into the second one's: the step is
    # skipped (nothing written, the kernel's kept views and random keys untouched), and the next step gives the very
    # words of a run that never saw that batch (a power-of-two scale backoff changes no unscaled gradient).
    from helpers import mse_backward, regression_data, tiny_stepper

    def run(bad_batch: bool) -> tuple[nn.Module, torch.optim.Optimizer, list[bool], list[torch.Tensor]]:
        model, stepper, opt = tiny_stepper(master_weights=mode)
        x, y = regression_data(32)
        skipped, held = [], []
        for step in range(4):
            if step == 2 and not bad_batch:
                continue
            for half in (slice(0, 16), slice(16, 32)):
                mse_backward(stepper, model, x[half] * (1 + step), y[half])
            if step == 2:
                model.fc2.weight.grad.view(-1)[3] = float("nan")
                held = [t.clone() for t in [*model.parameters(), *(s[k] for s in opt.state.values()
                                                                    for k in ("exp_avg", "exp_avg_sq"))]]
            stepper.step(opt)
            opt.zero_grad()
            skipped.append(stepper.counters.last_step_skipped)
            if step == 2:  # nothing was written
                after = [*model.parameters(), *(s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))]
                assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(after, held))
        assert stepper.keeper._fused is not None  # the fused kernel stepped
        return model, opt, skipped, held

    model, opt, skipped, held = run(bad_batch=True)
    ref_model, ref_opt, ref_skipped, _ = run(bad_batch=False)
    assert skipped == [False, False, True, False] and ref_skipped == [False, False, False] and held
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for (name, p), ref_p in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p.view(torch.int16), ref_p.view(torch.int16)), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key].view(torch.int16), ref_opt.state[ref_p][key].view(torch.int16)), key


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_train_step_compiled_whole_steps_the_compact_weights_eagerly(mode: str) -> None:
    # torch.compile over forward, backward and the optimizer step in one function: the compact step is not traced
    # (traced, its random keys' 64-bit hash became constants inductor could not index with: an InductorError at the
    # first call). The graph breaks there and the step runs as in an eager loop: the same skip decisions and step
    # counts, the weights within BF16 rounding of the eager run's (inductor's forward and backward may round apart).
    from helpers import regression_data, tiny_stepper

    def run(compiled: bool) -> tuple[nn.Module, Any]:
        model, stepper, opt = tiny_stepper(master_weights=mode)
        x, y = regression_data(32)

        def train_step() -> torch.Tensor:
            with stepper.forward_context():
                loss = nn.functional.mse_loss(model(stepper.convert_input(x)).float(), y)
            stepper.scale_loss(loss).backward()
            stepper.step(opt)
            opt.zero_grad()
            return loss.detach()

        step = torch.compile(train_step) if compiled else train_step
        losses = [float(step()) for _ in range(4)]
        assert losses[-1] < losses[0], losses
        return model, stepper

    (model, stepper), (ref, ref_stepper) = run(True), run(False)
    assert stepper.keeper._fused is not None  # the fused step ran, under the compiled function
    assert (stepper.step_count, stepper.skipped_steps) == (ref_stepper.step_count, ref_stepper.skipped_steps) == (4, 0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p.float(), q.float(), rtol=2**-6, atol=1e-3, msg=name)


# -------------------------------------------------------------------- the compile notice is said once per cache
def test_the_fused_adam_compile_notice_is_said_once_per_cache(tmp_path, monkeypatch) -> None:
    import lit_mpstable.core.weights.compact_fused as fused

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert fused._first_to_say("probe_marker") is True  # the sweep's first job
    assert fused._first_to_say("probe_marker") is False  # every later job or process sharing the cache
    assert (tmp_path / "probe_marker").exists()
    source = open(fused.__file__).read()
    assert "in seconds" not in source and "13-28 s" in source


# --------------------------------------------------------------------------------------------------------------
# The C loop (native_kernel) against the compiled kernel and the eager rounding.
GROUP = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "decoupled_weight_decay": True}
N = 3 * 16384 + 37  # several of the loop's chunks, and a tail of no vector width


def _tensors(mode: str, n: int = N, seed: int = 0) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g).bfloat16()
    grad = torch.randn(n, generator=g).bfloat16()
    w[:3] = torch.tensor([float("inf"), -float("inf"), float("nan")])  # non-finite values pass through as compiled
    grad[3:6] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    return [w, (w.float() * 2.0**-9).bfloat16() if mode == "kahan" else None, grad,
            (torch.randn(n, generator=g) * 0.1).bfloat16(), (torch.rand(n, generator=g) * 0.01).bfloat16()]


def _native() -> fused_module.NativeKernel:
    native = fused_module.native_kernel()
    assert native is not None  # CI and development machines have a C compiler
    return native


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int16) == b.view(torch.int16)) | (a.isnan() & b.isnan())


@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
@pytest.mark.parametrize("plain", [True, False])
def test_the_c_loop_writes_the_compiled_kernels_words_but_for_ties(mode: str, plain: bool) -> None:
    # The same arithmetic in the same order (no fused multiply-add on either side); where the compiled kernel's float
    # formulation rounds a tie to even (one draw in 65536 per value), the C loop adds and truncates: an ulp apart.
    scalars = FusedAdam.scalars({**GROUP, "decoupled_weight_decay": plain}, 3.0, torch.tensor(0.5), None if plain
                                else 0.5)
    key = torch.tensor(-12345, dtype=torch.int32)
    native, compiled = _tensors(mode), _tensors(mode)
    assert fused_module.native_takes(*native, scalars, key)  # type: ignore[arg-type]
    _native()(*native, scalars, key, plain)
    kernel = FusedAdam()
    (kernel._plain_kernel if plain else kernel._kernel)(*compiled, scalars, key)
    assert not torch.equal(native[0], _tensors(mode)[0])  # it stepped
    for a, b in zip(native, compiled):
        if a is None or b is None:
            continue
        same = _same(a, b)
        assert int((~same).sum()) <= max(4, N // 8192), int((~same).sum())
        ulp = torch.finfo(torch.bfloat16).eps * b.float().abs()
        assert bool(((a.float() - b.float()).abs()[~same] <= ulp[~same] + 2.0**-133).all())


def test_the_c_loop_rounds_a_moment_exactly_as_the_eager_bit_trick() -> None:
    # exp_avg_sq = v * beta2 + (1 - beta2) * g * g has no lerp: eager FP32 arithmetic gives its very value, and its
    # stochastic rounding with the element keys' bits (noise_bits) must be the C loop's, every bit, ties included.
    w, _, grad, m, v = _tensors("stochastic", seed=1)
    assert w is not None and grad is not None and m is not None and v is not None
    scalars = FusedAdam.scalars(GROUP, 5.0, torch.tensor(1.0), None)
    value = v.float() * scalars[5] + scalars[6] * grad.float() * scalars[0] * grad.float() * scalars[0]
    expected = round_stochastic_(torch.empty_like(v), value, noise_bits(N, 777, v.device, torch.bfloat16))
    _native()(w, None, grad, m, v, scalars, torch.tensor(777, dtype=torch.int32), True)
    assert bool(_same(v, expected).all())


def test_threads_change_no_bit() -> None:
    # The loop splits into chunks over OpenMP threads; each element's words depend on its own key only.
    words = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            tensors = _tensors("stochastic", n=8 * 16384 + 5)
            scalars = FusedAdam.scalars(GROUP, 2.0, torch.tensor(1.0), None)
            _native()(*tensors, scalars, torch.tensor(5, dtype=torch.int32), True)
            words.append([t.view(torch.int16).clone() for t in tensors if t is not None])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*words))


def test_what_the_c_loop_does_not_take() -> None:
    w, comp, g, m, v = _tensors("kahan", n=64)
    assert w is not None and g is not None and m is not None and v is not None
    scalars = FusedAdam.scalars(GROUP, 1.0, torch.tensor(1.0), None)
    key = torch.tensor(0, dtype=torch.int32)
    assert fused_module.native_takes(w, comp, g, m, v, scalars, key)
    assert not fused_module.native_takes(w.half(), comp, g, m, v, scalars, key)
    assert not fused_module.native_takes(w, comp, g[:32], m, v, scalars, key)
    assert not fused_module.native_takes(w, comp, g.view(8, 8).t(), m, v, scalars, key)
    assert not fused_module.native_takes(w, comp, g, m, v, scalars.double(), key)
    assert not fused_module.native_takes(w, comp, g, m, v, scalars, key.long())

    class Wrapped(torch.Tensor):  # a subclass (a DTensor, say): its pointer need not be its data
        pass

    assert not fused_module.native_takes(w.as_subclass(Wrapped), comp, g, m, v, scalars, key)


def test_without_a_compiler_or_when_turned_off_there_is_no_c_loop(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("LIT_MPSTABLE_NATIVE", "0")
    assert fused_module.native_kernel() is None
    monkeypatch.delenv("LIT_MPSTABLE_NATIVE")
    monkeypatch.setattr(fused_module, "_compiler", lambda: None)
    fused_module._load_native.cache_clear()
    try:
        assert fused_module.native_kernel() is None
        monkeypatch.undo()  # a compiler that fails: no library, no exception
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
        monkeypatch.setattr(fused_module, "SOURCE", "this is not C")
        fused_module._load_native.cache_clear()
        assert fused_module.native_kernel() is None
        assert not list(tmp_path.rglob("*.so"))
    finally:
        monkeypatch.undo()
        fused_module._load_native.cache_clear()
    assert fused_module.native_kernel() is not None


def test_a_compiler_without_openmp_or_march_native_still_builds_the_loop(monkeypatch, tmp_path) -> None:
    # The build tries -fopenmp, then without it (Apple's clang), then without -march=native: a compiler that refuses
    # both still gives a loop, and its words are the OpenMP build's.
    real = fused_module._compiler()
    assert real is not None
    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\ncase "$*" in *-fopenmp*|*-march=native*) exit 1;; esac\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    expected = _tensors("stochastic")
    scalars = FusedAdam.scalars(GROUP, 2.0, torch.tensor(1.0), None)
    key = torch.tensor(9, dtype=torch.int32)
    _native()(*expected, scalars, key, True)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    fused_module._load_native.cache_clear()
    try:
        built = fused_module.native_kernel()
        assert built is not None
        assert [p.name.startswith("adam_bf16_") for p in (tmp_path / "cache").rglob("*.so")] == [True]
        got = _tensors("stochastic")
        built(*got, scalars, key, True)
    finally:
        monkeypatch.undo()
        fused_module._load_native.cache_clear()
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got, expected) if a is not None)


@pytest.mark.parametrize("mode", MODES)
def test_one_call_for_all_parameters_writes_the_words_of_one_call_each(mode: str, monkeypatch) -> None:
    # From the second step on, an optimizer whose parameters the C loop all took is stepped in one call of it
    # (ManyArgs, kept from step to step): bit for bit what one call per parameter writes (the baseline path, kept
    # here by never making the one call's arguments). Two groups (Adam's L2 with maximize, AdamW), a frozen
    # parameter, a learning-rate schedule, multipliers of every kind, a clip value, a step where a parameter has no
    # gradient (one by one again), new data behind a parameter and a loaded optimizer state (new arguments).
    def run(many: bool) -> tuple[list[torch.Tensor], int]:
        torch.manual_seed(0)
        model = _Many().bfloat16()
        ps = list(model.ps)
        ps[6].requires_grad_(False)
        opt = torch.optim.Adam([{"params": ps[:3], "weight_decay": 0.1, "maximize": True},
                                {"params": ps[3:], "lr": 2e-3}], lr=3e-3, betas=(0.8, 0.99))
        opt.param_groups[1]["decoupled_weight_decay"] = True
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        cw = CompactWeights(model, [opt], mode, seed=5)
        calls = 0
        if many:
            run_ = fused_module.ManyArgs.run_

            def counted(self, *args):
                nonlocal calls
                done = run_(self, *args)
                calls += done
                return done

            monkeypatch.setattr(fused_module.ManyArgs, "run_", counted)
        else:
            monkeypatch.setattr(CompactWeights, "_keep_many_", lambda self, optimizer, pieces: None)
        g = torch.Generator().manual_seed(1)
        multipliers = [None, torch.tensor(0.5), 0.25, torch.tensor(0.125, dtype=torch.float64), torch.tensor([2.0]),
                       None, torch.tensor(0.5), None, None, torch.tensor(1.0)]
        for step, multiplier in enumerate(multipliers):
            if step == 6:
                ps[0].data = ps[0].data.clone()
            if step == 8:
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            for i, p in enumerate(ps[:6]):
                grad = (torch.randn(p.shape, generator=g) * 1e-2).bfloat16()
                p.grad = None if (step == 4 and i == 2) else grad
            cw.step_(opt, grad_multiplier=multiplier, clip_value=5e-3 if step == 3 else None)
            schedule.step()
        comp = cw.state_dict()["compensation"]
        out = [t.view(torch.int16) if t.dtype == torch.bfloat16 else t for i, p in enumerate(ps)
               for t in (p.detach(), comp.get(f"ps.{i}"), *opt.state.get(p, {}).values()) if t is not None]
        monkeypatch.undo()
        return out, calls

    (many, calls), (each, none) = run(True), run(False)
    # In one call: steps 1-3 (made after step 0), 7 and 9; one by one: 0, 4 (a gradient missing), 5 (it is back),
    # 6 (new data) and 8 (a loaded state), each making the arguments of the next.
    assert calls == 5 and none == 0
    assert len(many) == len(each) and all(torch.equal(a, b) for a, b in zip(many, each))


def test_one_call_still_shows_the_optimizer_its_step_keywords_and_its_wrappers() -> None:
    # The one call for all parameters skips the optimizer's step with empty groups only where nothing would see it:
    # an LR scheduler's wrapper of step still counts it (no "lr_scheduler.step() before optimizer.step()" warning),
    # and an unknown keyword still reaches torch's AdamW.step, which refuses it.
    import warnings

    torch.manual_seed(0)
    model = _Many().bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s)
    cw = CompactWeights(model, [opt], "kahan", seed=1)
    assert "step" in vars(opt)  # the scheduler's wrapper
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.full_like(p, 1e-3)
            opt._opt_called = False  # type: ignore[attr-defined]
            cw.step_(opt)
            assert opt._opt_called  # type: ignore[attr-defined]
            schedule.step()
    assert id(opt) in cw._many  # the last steps took the one call
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    with pytest.raises(TypeError, match="grad_scale_hint"):
        cw.step_(opt, grad_scale_hint=2.0)

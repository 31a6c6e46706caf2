"""CompactWeights: 16-bit weights that train like FP32 (Kahan, stochastic rounding); 16-bit and 8-bit state."""

from __future__ import annotations

import io
import math

import pytest
import torch
from helpers import TinyMLP, regression_data, stall_task
from torch import nn
from torch.nn import functional as F

from lit_mpstable.core.weights.compact import CompactWeights, quantized_state_classes
from lit_mpstable.core.weights.compact_rounding import stochastic_round
from lit_mpstable.core.weights.master import MasterWeights

LOW = [torch.bfloat16, torch.float16]
MODES = ["kahan", "stochastic"]


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# ------------------------------------------------------------------------------------------- the stall
def _train_stall(dtype: torch.dtype, mode: str | None, *, lr: float, steps: int, seed: int = 0) -> dict:
    """SGD on helpers.stall_task; mode None (plain), "masters" (FP32 masters: the reference with the same 16-bit
    forward), "kahan" or "stochastic". The loss of the final weights is evaluated in FP32."""
    x, y, w0 = stall_task()
    model = nn.Linear(16, 16, bias=False)
    with torch.no_grad():
        model.weight.copy_(w0)
    model.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    cw = CompactWeights(model, [opt], mode, seed=seed) if mode in MODES else None
    mw = MasterWeights(model, [opt]) if mode == "masters" else None
    x_in, before = x.to(dtype), model.weight.detach().clone()
    for _ in range(steps):
        ((model(x_in).float() - y) ** 2).sum(1).mean().backward()
        if cw is not None:
            cw.step_(opt)
        elif mw is not None:
            mw.copy_grads_to_master_()
            mw.zero_model_grads_()
            opt.step()
            mw.refresh_model_()
        else:
            opt.step()
        opt.zero_grad()
    w = mw.masters[0].detach() if mw is not None else model.weight.detach().float()
    if cw is not None and mode == "kahan":
        w = w + next(cw.named_buffers())[2].float()
    loss = lambda weight: ((x @ weight.T - y) ** 2).sum(1).mean().item()  # noqa: E731
    return dict(first=loss(w0), last=loss(model.weight.detach().float()), value=w,
                unchanged=torch.equal(before, model.weight.detach()))


@pytest.mark.parametrize(("dtype", "lr", "steps"), [(torch.bfloat16, 0.005, 60), (torch.float16, 0.0005, 400)])
def test_sub_ulp_updates_stall_plain_and_follow_fp32_compact(dtype: torch.dtype, lr: float, steps: int) -> None:
    fp32 = _train_stall(torch.float32, None, lr=lr, steps=steps)
    plain = _train_stall(dtype, None, lr=lr, steps=steps)
    masters = _train_stall(dtype, "masters", lr=lr, steps=steps)
    kahan = _train_stall(dtype, "kahan", lr=lr, steps=steps)
    seeds = [_train_stall(dtype, "stochastic", lr=lr, steps=steps, seed=s) for s in range(8)]
    rel = lambda run: run["last"] / fp32["last"] - 1  # noqa: E731
    print(
        f"\n[stall {dtype}] loss {fp32['first']:.4f} -> fp32 {fp32['last']:.5f}, plain {rel(plain):+.2%},"
        f" masters {rel(masters):+.3%}, kahan {rel(kahan):+.3%}, stochastic (8 seeds)"
        f" {min(map(rel, seeds)):+.2%} .. {max(map(rel, seeds)):+.2%}"
    )
    # The task is what it claims: FP32 follows the closed form and halves the loss at least.
    assert fp32["last"] == pytest.approx((1 - 2 * lr) ** (2 * steps) * fp32["first"], rel=1e-3)
    assert fp32["last"] < 0.5 * fp32["first"]
    # Plain 16-bit SGD rounds every update away: not one weight bit moves.
    assert plain["unchanged"]
    # Kahan follows FP32 masters run on the same 16-bit forward (0.1%), and so FP32 within what that forward costs.
    assert kahan["last"] == pytest.approx(masters["last"], rel=1e-3)
    assert kahan["last"] == pytest.approx(fp32["last"], rel=5e-3)
    # Stochastic rounding is unbiased: averaged over seeds, the weights are the masters' (5 standard errors).
    # Single runs carry its noise: updates of ~5% of an ulp become whole ulps 5% of the time, a random walk that
    # the small learning rate damps slowly; every run still trains (>= 90% of FP32's loss drop, plain: 0%).
    stack = torch.stack([run["value"] for run in seeds]).double()
    bias = (stack.mean(0) - masters["value"].double()).mean()
    stderr = (stack.mean(1) - stack.mean(1).mean()).square().sum().div(len(seeds) - 1).sqrt() / len(seeds) ** 0.5
    assert abs(bias.item()) <= 5 * stderr.item() + 1e-6
    drop = fp32["first"] - fp32["last"]
    assert all(run["first"] - run["last"] >= 0.9 * drop for run in seeds)


@pytest.mark.parametrize(("dtype", "scale"), [(torch.bfloat16, 1.0), (torch.float16, 1.0), (torch.float16, 2.0**-12)])
def test_kahan_value_tracks_the_fp32_trajectory_to_16_plus_8_bits(dtype: torch.dtype, scale: float) -> None:
    # The same gradient sequence for both runs (independent of the weights): the only difference is storage.
    # scale 2**-12: small FP16 weights, whose residuals an FP16 compensation could hold to 1 bit only (subnormal).
    steps, lr = 200, 2.5e-3
    g = torch.Generator().manual_seed(1)
    w0 = ((1.5 + 0.5 * torch.rand(64, 64, generator=g)) * scale).to(dtype)  # stays in [0.75, 2) * scale
    grads = [(0.5 + torch.rand(64, 64, generator=g)) * scale for _ in range(steps)]  # BF16: below half an ulp
    ref = nn.Parameter(w0.float())
    model = nn.Linear(64, 64, bias=False).to(dtype)
    with torch.no_grad():
        model.weight.copy_(w0)
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD([ref], lr=lr)
    cw = CompactWeights(model, [opt], "kahan")
    for grad in grads:
        ref.grad, model.weight.grad = grad, grad.to(dtype)
        opt_ref.step()
        cw.step_(opt)
    (_, w, comp), = cw.named_buffers()
    assert comp.dtype == torch.bfloat16
    value = w.double() + comp.double()
    # Each step loses at most half an ulp of the BF16 compensation (|comp| <= half an ulp of w, so 2**-9 ulp(w)),
    # plus half an FP32 ulp of the sum in either run: a bound that adds up linearly.
    ulp16, ulp32 = torch.finfo(dtype).eps * scale, torch.finfo(torch.float32).eps * scale  # spacings below 2 scale
    bound = steps * (ulp16 * 2.0**-9 + ulp32)
    error = (value - ref.detach().double()).abs().max().item()
    moved = (ref.detach().double() - w0.double()).abs().min().item()
    print(f"\n[kahan {dtype} x{scale}] max |w + comp - fp32| {error:.2e} (bound {bound:.2e}); moved >= {moved:.2e}")
    assert moved > 25 * bound  # the updates are there to lose: plain BF16 would lose all of them
    assert error <= bound
    assert not torch.equal(w, w0)


# ------------------------------------------------------------------------------------- stochastic rounding
@pytest.mark.parametrize("dtype", LOW)
def test_stochastic_round_is_unbiased_and_picks_a_neighbour(dtype: torch.dtype) -> None:
    # Pairs of neighbours (lo, hi) of dtype at several magnitudes and signs, subnormals included; x between them.
    tiny = torch.finfo(dtype).tiny
    big = 1e4 if dtype == torch.float16 else 3e30
    lo = torch.tensor([1.0, -1.0, 3.0e-3, -7.5e2, 1.7, tiny * 0.3, -tiny * 5.0, big]).to(dtype)
    hi = torch.nextafter(lo, torch.full_like(lo, math.inf))
    fractions = torch.tensor([0.5, 0.01, 0.25, 0.9, 0.37, 0.63, 0.1, 0.77], dtype=torch.float64)
    x = (lo.double() + fractions * (hi.double() - lo.double())).float()
    p = (x.double() - lo.double()) / (hi.double() - lo.double())  # of x as FP32 holds it
    n = 20000
    rounded = stochastic_round(x.repeat(n, 1), dtype, generator=torch.Generator().manual_seed(0))
    assert rounded.dtype == dtype
    assert bool(((rounded == lo) | (rounded == hi)).all())
    # Binomial: the fraction rounded up is p within 5 standard deviations (plus the 2**-16 resolution).
    frac_up = (rounded == hi).double().mean(0)
    sigma = (p * (1 - p) / n).sqrt()
    assert bool(((frac_up - p).abs() <= 5 * sigma + 2.0**-16).all()), (frac_up, p)
    mean = rounded.double().mean(0)
    spacing = (hi - lo).double()
    assert bool(((mean - x.double()).abs() <= (5 * sigma + 2.0**-16) * spacing).all())


def test_stochastic_round_keeps_exact_values_and_is_seeded() -> None:
    x = torch.tensor([1.0, -2.5, 0.0, 256.0, 2.0**-20, math.inf, -math.inf])  # exact in both formats
    for dtype in LOW:
        assert torch.equal(stochastic_round(x, dtype), x.to(dtype))
    y = torch.rand(1000) + 1
    same = [stochastic_round(y, torch.bfloat16, generator=torch.Generator().manual_seed(s)) for s in (3, 3, 4)]
    assert torch.equal(same[0], same[1]) and not torch.equal(same[0], same[2])
    with pytest.raises(ValueError, match="dtype"):
        stochastic_round(y, torch.float32)


# ------------------------------------------------------------------------------------- any optimizer, groups
class _IslandMLP(TinyMLP):
    """TinyMLP whose last layer is an FP32 island, and a 16-bit parameter that gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act(self.fc2(self.act(self.fc1(x)))).float())


def _mixed_model(dtype: torch.dtype = torch.bfloat16) -> _IslandMLP:
    torch.manual_seed(0)
    model = _IslandMLP().to(dtype)
    model.fc3.float()
    model.fc1.bias.requires_grad_(False)  # frozen
    return model


OPTIMIZERS = {
    "sgd_momentum": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2),
    "adamw_foreach": lambda groups: torch.optim.AdamW(groups, lr=1e-2, foreach=True),
    "adamw_fused": lambda groups: torch.optim.AdamW(groups, lr=1e-2, fused=True),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=1e-3),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.05),
}


def _groups(model: _IslandMLP) -> list[dict]:
    # Three groups, three learning rates; the FP32 island and the frozen bias sit among 16-bit parameters.
    return [
        {"params": [model.fc1.weight, model.fc1.bias, model.unused]},
        {"params": [model.fc2.weight, model.fc2.bias], "lr_factor": 0.5},
        {"params": [model.fc3.weight, model.fc3.bias], "lr_factor": 2.0},
    ]


def _make_opt(name: str, model: _IslandMLP) -> torch.optim.Optimizer:
    opt = OPTIMIZERS[name](_groups(model))
    for group in opt.param_groups:
        group["lr"] *= group.pop("lr_factor", 1.0)
    return opt


def _run(model: nn.Module, opt: torch.optim.Optimizer, steps: int, stepper, dtype: torch.dtype) -> None:
    x, y = regression_data(32)
    for _ in range(steps):
        nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
        stepper()
        opt.zero_grad()


def _feed(model: nn.Module, step: int) -> None:
    # Fixed gradients (not the weights' own): both runs see the same ones, so only storage and rounding differ.
    g = torch.Generator().manual_seed(step)
    for name, p in model.named_parameters():
        if p.requires_grad and name != "unused":
            p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(p.dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_any_optimizer_matches_fp32_masters(name: str, mode: str) -> None:
    # The independent expectation: the same 16-bit model with FP32 masters and FP32 state (MasterWeights).
    steps = 5
    ref_model = _mixed_model()
    ref_opt = _make_opt(name, ref_model)
    mw = MasterWeights(ref_model, [ref_opt])
    masters = {n: m for n, m, _ in mw.named_pairs()}
    path = {n: torch.zeros_like(m) for n, m in masters.items()}  # sum over steps of |update|, per element
    model = _mixed_model()
    frozen, unused = model.fc1.bias.detach().clone(), model.unused.detach().clone()
    opt = _make_opt(name, model)
    cw = CompactWeights(model, [opt], mode)
    for step in range(steps):
        _feed(ref_model, step)
        before = {n: m.detach().clone() for n, m in masters.items()}
        mw.copy_grads_to_master_()
        mw.zero_model_grads_()
        ref_opt.step()
        for n, m in masters.items():
            path[n] += (m.detach() - before[n]).abs()
        _feed(model, step)
        cw.step_(opt)
    assert torch.equal(model.fc1.bias, frozen) and torch.equal(model.unused, unused)
    assert {n for n, _, _ in cw.named_buffers()} == {"fc1.weight", "fc2.weight", "fc2.bias", "unused"}
    # The FP32 island is stepped as it is, in FP32, with FP32 state: exactly as in the reference.
    assert torch.equal(model.fc3.weight, ref_model.fc3.weight) and torch.equal(model.fc3.bias, ref_model.fc3.bias)
    params = dict(model.named_parameters())
    for pname, master in masters.items():
        if pname == "unused":
            continue
        expected, got = master.detach().double(), params[pname].detach().double()
        if mode == "kahan":
            got = got + cw.state_dict()["compensation"][pname].double()
        # The 16-bit state is stochastically rounded (relative error 2**-8 per element, m/sqrt(v): < 2**-6), so each
        # update is off by < 2**-6 of itself; stochastic weights add less than one ulp of error per step.
        ulp = torch.finfo(torch.bfloat16).eps * (expected.abs() + path[pname].double())  # >= the spacing on the way
        bound = 2**-6 * path[pname].double() + (steps * ulp if mode == "stochastic" else 1e-7)
        assert bool(((got - expected).abs() <= bound).all()), (pname, ((got - expected).abs() / bound).max())
        assert bound.mean() < 0.5 * path[pname].mean()  # the bound is tight enough to catch a lost or wrong update
    # State between steps: 16-bit per element; FP32 for the island; step counters as the optimizer keeps them.
    for p in (model.fc1.weight, model.fc2.bias):
        assert all(v.dtype == torch.bfloat16 for k, v in opt.state[p].items() if k != "step"), opt.state[p]
    assert all(v.dtype == torch.float32 for k, v in opt.state[model.fc3.weight].items() if torch.is_tensor(v))


def test_bitsandbytes_per_parameter_overrides_are_refused_not_dropped() -> None:
    # bitsandbytes finds an override by the parameter's identity: the FP32 stand-ins would step without it (an lr
    # override of 0 was ignored before this check).
    bnb = pytest.importorskip("bitsandbytes")
    model = nn.Linear(64, 64).bfloat16()
    manager = bnb.optim.GlobalOptimManager.get_instance()
    try:
        manager.register_parameters(model.parameters())
        opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
        cw = CompactWeights(model, [opt], "kahan")  # no override yet: fine
        manager.override_config(model.weight, "lr", 0.0)
        with pytest.raises(ValueError, match=r"AdamW8bit has bitsandbytes per-parameter overrides"):
            cw.bind_new_(opt)  # the stepper calls it every step: an override added later is caught too
        with pytest.raises(ValueError, match=r"param group of their own"):
            CompactWeights(model, [bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)], "stochastic")
    finally:
        manager.pid2config.clear()
        manager.index2config.clear()


def test_lbfgs_and_closures_are_refused() -> None:
    model = TinyMLP().bfloat16()
    with pytest.raises(ValueError, match="LBFGS"):
        CompactWeights(model, [torch.optim.LBFGS(model.parameters())], "kahan")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cw = CompactWeights(model, [opt], "kahan")
    with pytest.raises(ValueError, match="closure"):
        cw.step_(opt, closure=lambda: 0.0)
    with pytest.raises(ValueError, match="not bound"):
        cw.step_(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="clip_value"):
        cw.step_(opt, clip_value=0.0)


def test_params_added_or_unfrozen_later_are_bound() -> None:
    model = TinyMLP().bfloat16()
    model.fc1.weight.requires_grad_(False)
    opt = torch.optim.AdamW([model.fc2.weight], lr=1e-3)
    cw = CompactWeights(model, [opt], "kahan")
    assert [n for n, _, _ in cw.named_buffers()] == ["fc2.weight"]
    opt.add_param_group({"params": [model.fc1.weight, model.fc3.weight, model.fc3.bias], "lr": 1e-2})
    model.fc1.weight.requires_grad_(True)
    x, y = regression_data(16)
    nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
    with pytest.raises(RuntimeError, match="bind_new_"):
        cw.step_(opt)
    assert cw.bind_new_(opt) == ["fc1.weight", "fc3.weight", "fc3.bias"]
    assert cw.bind_new_(opt) == []
    before = model.fc1.weight.detach().clone()
    cw.step_(opt)
    assert not torch.equal(model.fc1.weight, before)
    assert cw.state_dict()["compensation"].keys() == {"fc2.weight", "fc1.weight", "fc3.weight", "fc3.bias"}
    assert all(p.grad is None for group in opt.param_groups for p in group["params"])
    assert model.fc1.bias.grad is not None  # not the optimizer's: not stepped, its gradient left alone


@pytest.mark.parametrize("mode", MODES)
def test_grad_multiplier_and_clip_value_are_applied_in_fp32(mode: str) -> None:
    # SGD, one step: the FP32 value must be w - lr * clamp(g * m, -c, c), computed independently in FP64.
    model = nn.Linear(8, 8, bias=False).bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    cw = CompactWeights(model, [opt], mode)
    grad = torch.linspace(-4, 4, 64).view(8, 8)
    model.weight.grad = grad.bfloat16()
    w0 = model.weight.detach().double()
    cw.step_(opt, grad_multiplier=torch.tensor(0.25), clip_value=0.5)
    expected = w0 - 0.5 * (grad.bfloat16().double() * 0.25).clamp(-0.5, 0.5)
    (_, w, comp), = cw.named_buffers()
    got = w.double() + (comp.double() if comp is not None else 0)
    ulp = expected.abs() * 2.0**-7
    assert bool(((got - expected).abs() <= (ulp * 2.0**-8 if mode == "kahan" else ulp)).all())
    assert model.weight.grad is None


# ----------------------------------------------------------------------------------- chunking, resume
class _Wide(nn.Module):
    """A parameter of 48 slices of 2**12 elements (the smallest) beside small ones."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(256, 768)
        self.small = nn.Linear(768, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(torch.tanh(self.big(x)))


class _AdamWSubclass(torch.optim.AdamW):
    """Not an exact torch.optim type: stepped in whole parameters."""


def _wide_run(
    mode: str, chunk_bytes: int, opt_cls=torch.optim.AdamW, steps: int = 3, fused: bool | None = False
) -> tuple[nn.Module, int]:
    torch.manual_seed(0)
    model = _Wide().bfloat16()
    opt = opt_cls(model.parameters(), lr=1e-3)
    calls, step = [0], opt.step

    def counted(*args, **kwargs):  # as an LR scheduler counts: a step hook would turn the fused path off
        calls[0] += 1
        return step(*args, **kwargs)

    opt.step = counted
    cw = CompactWeights(model, [opt], mode, chunk_bytes=chunk_bytes, fused=fused)
    x, y = torch.randn(8, 256).bfloat16(), torch.randn(8, 4)
    for _ in range(steps):
        nn.functional.mse_loss(model(x).float(), y).backward()
        cw.step_(opt)
    return model, calls[0], opt, cw


@pytest.mark.parametrize("fused", [False, None])
@pytest.mark.parametrize("mode", MODES)
def test_chunking_changes_nothing_bit_for_bit(mode: str, fused: bool | None) -> None:
    tiny, calls_tiny, opt_tiny, cw_tiny = _wide_run(mode, 1, fused=fused)
    huge, calls_huge, opt_huge, cw_huge = _wide_run(mode, 2**40, fused=fused)
    # One optimizer call per step, against one per slice or parameter; fused: one per step (for its hooks) either way.
    assert calls_huge == 3 and calls_tiny == 3 * (1 if fused is None else 768 * 256 // 2**12 + 3)
    assert (cw_tiny._fused is not None) is (fused is None)
    for (name, a), (_, b) in zip(tiny.named_parameters(), huge.named_parameters()):
        assert _bitwise_equal(a.detach(), b.detach()), name
    for a, b in zip(opt_tiny.state.values(), opt_huge.state.values()):
        assert all(_bitwise_equal(a[k], b[k]) for k in a)
    for (_, _, a), (_, _, b) in zip(cw_tiny.named_buffers(), cw_huge.named_buffers()):
        assert a is None and b is None or _bitwise_equal(a, b)
    whole, calls_whole, _, _ = _wide_run(mode, 1, _AdamWSubclass)
    assert calls_whole == 3 * 4  # one parameter per call
    if fused is False:  # the generic path both ways (fused: tests/core/test_compact_fused.py compares the two)
        assert all(_bitwise_equal(a.detach(), b.detach()) for a, b in zip(whole.parameters(), huge.parameters()))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta",
                                  "Rprop", "ASGD"])
def test_every_elementwise_optimizer_steps_in_slices_bit_for_bit(mode: str, name: str) -> None:
    # Per-element state is sliced, per-parameter scalars (step, NAdam's mu_product, ASGD's eta and mu) come from the
    # first slice: the result is the whole-parameter step's, bit for bit.
    kwargs = {"SGD": {"momentum": 0.9}}.get(name, {})

    def factory(params, lr):
        return getattr(torch.optim, name)(params, lr=lr, **kwargs)

    tiny, calls_tiny, opt_tiny, cw_tiny = _wide_run(mode, 1, factory)
    huge, calls_huge, opt_huge, cw_huge = _wide_run(mode, 2**40, factory)
    assert calls_tiny == 3 * (768 * 256 // 2**12 + 3) and calls_huge == 3
    for (pname, a), (_, b) in zip(tiny.named_parameters(), huge.named_parameters()):
        assert _bitwise_equal(a.detach(), b.detach()), pname
        sa, sb = opt_tiny.state[a], opt_huge.state[b]
        assert set(sa) == set(sb) and all(
            _bitwise_equal(sa[k], sb[k]) if torch.is_tensor(sa[k]) else sa[k] == sb[k] for k in sa), pname
    for (_, _, a), (_, _, b) in zip(cw_tiny.named_buffers(), cw_huge.named_buffers()):
        assert a is None and b is None or _bitwise_equal(a, b)


def _resume_setup(mode: str, opt_factory, dtype: torch.dtype = torch.bfloat16, d: int = 16, chunk_bytes=None):
    torch.manual_seed(0)
    model = TinyMLP(d, 2 * d, d).to(dtype)
    opt = opt_factory(model.parameters())
    return model, opt, CompactWeights(model, [opt], mode, seed=7, chunk_bytes=chunk_bytes)


def _resume_steps(model, opt, cw, steps: int, start: int, dtype: torch.dtype = torch.bfloat16, d: int = 16) -> None:
    x, y = regression_data(32, d, d, seed=3)
    for i in range(start, start + steps):
        nn.functional.mse_loss(model(x[i % 2 :: 2].to(dtype)).float(), y[i % 2 :: 2]).backward()
        cw.step_(opt) if cw is not None else opt.step()
        opt.zero_grad()


def _check_resume(
    mode: str, opt_factory, dtype: torch.dtype = torch.bfloat16, d: int = 16, steps: int = 3, chunk_bytes=None
) -> None:
    model, opt, cw = _resume_setup(mode, opt_factory, dtype, d, chunk_bytes)
    _resume_steps(model, opt, cw, 2 * steps, 0, dtype, d)
    model2, opt2, cw2 = _resume_setup(mode, opt_factory, dtype, d, chunk_bytes)
    _resume_steps(model2, opt2, cw2, steps, 0, dtype, d)
    buf = io.BytesIO()
    torch.save({"model": model2.state_dict(), "opt": opt2.state_dict(), "compact": cw2.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model3, opt3, cw3 = _resume_setup(mode, opt_factory, dtype, d, chunk_bytes)
    model3.load_state_dict(ckpt["model"])
    opt3.load_state_dict(ckpt["opt"])
    cw3.load_state_dict(ckpt["compact"])
    _resume_steps(model3, opt3, cw3, steps, steps, dtype, d)
    for (name, a), b in zip(model.named_parameters(), model3.parameters()):
        assert _bitwise_equal(a.detach(), b.detach()), name
    for p, p3 in zip(model.parameters(), model3.parameters()):
        for key, value in opt.state[p].items():
            other = opt3.state[p3][key]
            if hasattr(value, "__tensor_flatten__") and type(value) is not torch.Tensor:
                value, other = value.dequantize(), other.dequantize()
            assert _bitwise_equal(value, other) if torch.is_tensor(value) else value == other, key
    for (_, _, a), (_, _, b) in zip(cw.named_buffers(), cw3.named_buffers()):
        assert a is None and b is None or _bitwise_equal(a, b)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", LOW)
def test_resume_through_torch_save_is_bit_identical(mode: str, dtype: torch.dtype) -> None:
    _check_resume(mode, lambda params: torch.optim.AdamW(params, lr=1e-3), dtype)


def test_adam_second_moment_decays_like_fp32_when_gradients_shrink() -> None:
    # Nearest-rounded BF16 exp_avg_sq can never decrease (0.1% of itself per step is below half an ulp); the
    # stochastically rounded one follows FP32 Adam fed the same gradients.
    g = torch.Generator().manual_seed(0)
    p, ref = nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16)), nn.Parameter(torch.zeros(4096))
    opt, opt_ref = torch.optim.Adam([p], lr=1e-6), torch.optim.Adam([ref], lr=1e-6)
    cw = CompactWeights(nn.ParameterList([p]), [opt], "kahan")
    nearest = torch.zeros(4096, dtype=torch.bfloat16)
    for step in range(1500):
        grad = torch.randn(4096, generator=g) * (1.0 if step < 600 else 0.3)
        p.grad, ref.grad = grad.bfloat16(), grad.bfloat16().float()
        cw.step_(opt)
        opt_ref.step()
        nearest = nearest.float().lerp_(ref.grad.square(), 0.001).bfloat16()
    fp32, sr = opt_ref.state[ref]["exp_avg_sq"].mean().item(), opt.state[p]["exp_avg_sq"].float().mean().item()
    print(f"\n[exp_avg_sq] fp32 {fp32:.4f}, stochastic bf16 {sr:.4f}, nearest bf16 {nearest.float().mean():.4f}")
    assert sr == pytest.approx(fp32, rel=0.02)
    assert nearest.float().mean().item() > 1.5 * fp32  # what nearest rounding would have given


# --------------------------------------------------------------------------------------- 8-bit states
def _torchao(name: str):
    ao = pytest.importorskip("torchao.optim")
    return lambda params: getattr(ao, name)(params, lr=1e-3)


def _bnb():
    bnb = pytest.importorskip("bitsandbytes")
    return lambda params: bnb.optim.AdamW8bit(params, lr=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit", "AdamWFp8", "bnb.AdamW8bit"])
def test_quantized_optimizer_states(name: str) -> None:
    # d=64: the hidden weights hold 64 * 128 = 8192 elements, quantized (torchao and bitsandbytes quantize tensors
    # of >= 4096 elements; torchao also needs numel % block_size == 0: 256, 128 for 4-bit); biases stay FP32 / 16-bit.
    factory = _bnb() if name.startswith("bnb") else _torchao(name)
    for mode in [*MODES, None]:
        model, opt, cw = _resume_setup(mode or "kahan", factory, torch.bfloat16, 64)
        if mode is None:
            cw = None
        before = model.fc2.weight.detach().clone()
        _resume_steps(model, opt, cw, 2, 0, torch.bfloat16, 64)
        assert not torch.equal(model.fc2.weight, before)
        state = opt.state[model.fc2.weight]
        quantized = [k for k, v in state.items() if torch.is_tensor(v) and (type(v) is not torch.Tensor or v.dtype in
                                                                            (torch.uint8, torch.float8_e4m3fn))]
        assert quantized, state.keys()  # the test is about quantized state: make sure there is some
        assert model.fc2.weight.dtype == torch.bfloat16
    for mode in MODES:
        _check_resume(mode, factory, torch.bfloat16, 64, steps=2)
        _check_resume(mode, factory, torch.bfloat16, 64, steps=2, chunk_bytes=1)  # in slices (8192: 2 of 4096)


def _flat_state(value) -> list[torch.Tensor]:
    if type(value) is torch.Tensor or not torch.is_tensor(value):
        return [value]
    names, _ = value.__tensor_flatten__()
    return [getattr(value, n) for n in names]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit", "AdamWFp8", "Adam8bit", "bnb.AdamW8bit", "bnb.Adam8bit"])
def test_low_bit_adams_step_in_slices_bit_for_bit(mode: str, name: str) -> None:
    # Their states are quantized in blocks: a slice on block boundaries views its blocks (torchao's subclasses;
    # bitsandbytes' codes and per-block absmax) and is stepped in place, so the FP32 copies (and the optimizer's FP32
    # temporaries) stay within the chunk budget, with the whole-parameter result.
    if name.startswith("bnb."):
        cls = getattr(pytest.importorskip("bitsandbytes").optim, name[4:])
    else:
        cls = getattr(pytest.importorskip("torchao.optim"), name)
    tiny, calls_tiny, opt_tiny, cw_tiny = _wide_run(mode, 1, cls, fused=None)
    huge, calls_huge, opt_huge, cw_huge = _wide_run(mode, 2**40, cls, fused=None)
    assert calls_huge == 3 and calls_tiny == 3 * (768 * 256 // 2**12 + 3)  # sliced: 48 slices + 3 small parameters
    big = opt_tiny.state[tiny.big.weight]
    if name.startswith("bnb."):  # created whole before the slices: 8-bit codes and a scale per 256 elements
        assert big["state1"].dtype == big["state2"].dtype == torch.uint8 and big["step"] == 3
        assert big["state1"].shape == tiny.big.weight.shape and big["absmax1"].shape == (768 * 256 // 256,)
    else:
        keys = {"step", "exp_avg", "exp_avg_sq"}
        assert set(big) == keys and all(type(big[k]) is not torch.Tensor and big[k].shape == tiny.big.weight.shape
                                        for k in keys - {"step"}), big  # created whole, quantized, before the slices
        assert float(big["step"]) == 3
    for (pname, a), (_, b) in zip(tiny.named_parameters(), huge.named_parameters()):
        assert _bitwise_equal(a.detach(), b.detach()), pname
        sa, sb = opt_tiny.state[a], opt_huge.state[b]
        assert set(sa) == set(sb), pname
        for key in sa:
            assert type(sa[key]) is type(sb[key]), (pname, key)
            if not torch.is_tensor(sa[key]):  # bitsandbytes' step count
                assert sa[key] == sb[key], (pname, key)
                continue
            assert all(_bitwise_equal(x, y) for x, y in zip(_flat_state(sa[key]), _flat_state(sb[key]))), (pname, key)
    for (_, _, a), (_, _, b) in zip(cw_tiny.named_buffers(), cw_huge.named_buffers()):
        assert a is None and b is None or _bitwise_equal(a, b)


@pytest.mark.parametrize("cap", [2**19, 4 * 2**20])
def test_chunks_grow_with_the_gradients_freed_and_keep_the_first_calls_transient(cap: int) -> None:
    # torchao's low-bit Adams on the CPU: 512 KiB of FP32 copies per call at first, growing by half the gradient
    # bytes the calls before freed (the optimizer's temporaries match the copies), to 4 MiB.
    from lit_mpstable.core.weights.compact import Piece, split_pieces

    params = [nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)) for n in (2**18, 2**18, 2**18, 3000, 2**20 + 4096)]
    for p in params:
        p.grad = torch.zeros_like(p)
    pieces = [Piece(0, p, str(i), 0, p.numel(), 8 * p.numel(), per_element=8) for i, p in enumerate(params)]
    chunks = list(split_pieces(pieces, 2**19, cap, 0))
    covered: dict[int, list[tuple[int, int]]] = {}
    for chunk in chunks:
        for piece in chunk:
            covered.setdefault(id(piece.param), []).append((piece.start, piece.stop))
    for p in params:  # every element once, in order
        ranges = covered[id(p)]
        assert ranges[0][0] == 0 and ranges[-1][1] == p.numel()
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [[piece.stop - piece.start for piece in chunk] for chunk in chunks]
    if cap == 2**19:  # a fixed budget: 65536-element slices throughout (and the remainders)
        assert sizes == [[65536]] * 12 + [[3000]] + [[65536]] * 16 + [[4096]], sizes
    else:  # the third parameter's slices double once two parameters' gradients are freed
        assert sizes == [[65536]] * 8 + [[131072]] * 2 + [[3000]] + [[131072]] * 8 + [[4096]], sizes
    held = sum(p.grad.numel() * 2 for p in params)
    transients = []
    for chunk in chunks:  # held gradients plus copies and as much again in temporaries
        transients.append(held + 2 * sum(piece.nbytes for piece in chunk))
        held -= sum(piece.param.numel() * 2 for piece in chunk if piece.stop == piece.param.numel())
    assert max(transients) == transients[0]


def test_quantized_state_classes_are_torchao_subclasses() -> None:
    pytest.importorskip("torchao.optim")
    names = {cls.__name__ for cls in quantized_state_classes()}
    assert names == {"OptimState8bit", "OptimState4bit", "OptimStateFp8"}


# --------------------------------------------------------------------------------------- memory, errors
def test_memory_report_counts_bytes_by_hand() -> None:
    model = _mixed_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cw = CompactWeights(model, [opt], "kahan")
    n16 = {"fc1.weight": 512, "fc1.bias": 32, "fc2.weight": 1024, "fc2.bias": 32, "unused": 16}
    n32 = 32 * 16 + 16  # fc3, the FP32 island
    trainable16 = sum(n16.values()) - 32  # fc1.bias is frozen: no compensation
    report = cw.memory_report()
    assert report == {
        "params_16bit": 2 * sum(n16.values()), "compensation": 2 * trainable16, "grads": 0, "optimizer_state": 0,
        "params_fp32_other": 4 * n32, "total": 2 * sum(n16.values()) + 2 * trainable16 + 4 * n32,
    }
    x, y = regression_data(32)
    nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
    with_grad16 = sum(n16.values()) - 32 - 16  # not the frozen bias, not the unused parameter
    assert cw.memory_report()["grads"] == 2 * with_grad16 + 4 * n32
    cw.step_(opt)
    report = cw.memory_report()
    # AdamW: exp_avg and exp_avg_sq per element (16-bit or FP32 like the parameter) and a 4-byte step per tensor.
    assert report["optimizer_state"] == 2 * 2 * with_grad16 + 2 * 4 * n32 + 4 * 5
    assert report["grads"] == 0  # step_ consumed every gradient it stepped
    assert report["total"] == sum(v for k, v in report.items() if k != "total")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "fp32"}, r"mode='fp32'.*\('kahan', 'stochastic'\)"),
        ({"mode": None}, r"mode=None"),
        ({"seed": -1}, r"seed=-1.*\[0, 2\*\*64\)"),
        ({"seed": 1.5}, r"seed=1.5"),
        ({"seed": True}, r"seed=True"),
        ({"chunk_bytes": 0}, r"chunk_bytes=0.*positive int"),
        ({"chunk_bytes": 2.0**20}, r"chunk_bytes=1048576.0"),
    ],
)
def test_bad_arguments_name_the_argument_and_the_rule(kwargs: dict, match: str) -> None:
    model = TinyMLP().bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    args = {"mode": "kahan", **kwargs}
    mode = args.pop("mode")
    with pytest.raises(ValueError, match=match):
        CompactWeights(model, [opt], mode, **args)


def test_load_state_dict_is_strict() -> None:
    model = TinyMLP().bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cw = CompactWeights(model, [opt], "kahan")
    state = cw.state_dict()
    with pytest.raises(KeyError, match=r"missing keys \['steps'\]"):
        cw.load_state_dict({k: v for k, v in state.items() if k != "steps"})
    with pytest.raises(KeyError, match=r"missing compensation keys \['fc3.bias'\].*unknown compensation keys \['x'\]"):
        cw.load_state_dict({**state, "compensation": {**{k: v for k, v in state["compensation"].items()
                                                          if k != "fc3.bias"}, "x": torch.zeros(1)}})
    with pytest.raises(ValueError, match="mode='stochastic'"):
        cw.load_state_dict({**state, "mode": "stochastic"})
    with pytest.raises(ValueError, match="shape"):
        cw.load_state_dict({**state, "compensation": {**state["compensation"], "fc1.bias": torch.zeros(3)}})
    x, y = regression_data(16)
    nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
    cw.step_(opt)
    assert any(bool(comp.ne(0).any()) for _, _, comp in cw.named_buffers())
    cw.zero_compensation_()
    assert all(not bool(comp.ne(0).any()) for _, _, comp in cw.named_buffers())


def test_parameters_outside_the_model_are_stepped_as_they_are_with_a_warning() -> None:
    model = TinyMLP().bfloat16()
    extra = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = torch.optim.SGD([*model.parameters(), extra], lr=0.5)
    with pytest.warns(UserWarning, match="1 16-bit trainable parameters of SGD are not the model's"):
        cw = CompactWeights(model, [opt], "kahan")
    extra.grad = torch.full((4,), 0.25, dtype=torch.bfloat16)
    cw.step_(opt)
    assert torch.equal(extra.detach(), torch.full((4,), 0.875, dtype=torch.bfloat16))  # 1 - 0.5 * 0.25, in BF16
    assert "extra" not in cw.state_dict()["compensation"] and len(cw.state_dict()["compensation"]) == 6


# ------------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_cuda_step_has_no_host_sync_and_matches_the_cpu(mode: str) -> None:
    runs = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = _Wide().bfloat16().to(device)  # the big weight is sliced on the CPU, whole on CUDA (larger blocks)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        cw = CompactWeights(model, [opt], mode)
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(device, torch.bfloat16)
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            cw.step_(opt, grad_multiplier=torch.tensor(0.5, device=device))
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        runs[device] = (model, cw, opt)
    (cpu, cw_cpu, _), (cuda, cw_cuda, opt_cuda) = runs["cpu"], runs["cuda"]
    for (name, a), b in zip(cpu.named_parameters(), cuda.parameters()):
        got, expected = b.detach().cpu().double(), a.detach().double()
        if mode == "kahan":  # deterministic: the FP32 values agree but for FP32 kernel differences
            got = got + cw_cuda.state_dict()["compensation"][name].cpu().double()
            expected = expected + cw_cpu.state_dict()["compensation"][name].double()
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-7), name
        else:  # different generators: one BF16 ulp apart at most
            assert bool(((got - expected).abs() <= torch.finfo(torch.bfloat16).eps * expected.abs()).all()), name
    assert all(v.dtype == torch.bfloat16 for s in opt_cuda.state.values() for k, v in s.items() if k != "step")


@pytest.mark.parametrize("precision", ["16-true", "bf16-true"])  # BF16: the fused Adam kernel (without BF16 moments)
@pytest.mark.parametrize("state", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
def test_a_step_asked_to_keep_its_gradients_hands_over_the_true_ones(mode: str, state: str, precision: str) -> None:
    """The step frees each gradient; where ``keeps_stepped_grads`` was set, it hands over what it stepped with (Adam's
    lag compares them with the second moment after the step): the scaled 16-bit gradients unscaled and clipped in FP32,
    once. Checked against that computation written out, with a clip by value (16-true: scaled gradients)."""
    from lit_mpstable.core.step.stepper import PrecisionStepper

    torch.manual_seed(0)
    model = TinyMLP()
    stepper = PrecisionStepper(precision, master_weights=mode, optimizer_state=state, device="cpu")
    stepper.setup_module(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
    stepper.setup_optimizers(model, [optimizer])
    keeper = stepper.keeper
    assert isinstance(keeper, CompactWeights)
    x, y = regression_data(16)
    for keep in (False, True):
        with stepper.forward_context():
            loss = F.mse_loss(model(stepper.convert_input(x)).float(), y)
        stepper.scale_loss(loss).backward()
        stepper.unscale_(optimizer)
        stepper.clip_grad_value_(optimizer, 1e-3)
        want = {id(p): (p.grad.float() / stepper.loss_scale).clamp(-1e-3, 1e-3) for p in model.parameters()}
        keeper.keeps_stepped_grads = keep
        stepper.step(optimizer)
        assert all(p.grad is None for p in model.parameters())
        kept = keeper.take_stepped_grads()
        if not keep:
            assert kept == {}
            continue
        assert kept.keys() == want.keys() and not keeper.keeps_stepped_grads and keeper.take_stepped_grads() == {}
        for key, grad in kept.items():
            assert grad.dtype == torch.float32 and torch.equal(grad, want[key])
        assert 0 < sum(int((g.abs() == 1e-3).sum()) for g in kept.values()) < sum(g.numel() for g in kept.values())

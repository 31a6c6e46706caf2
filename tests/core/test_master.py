"""MasterWeights: sub-ulp updates survive, optimizers are rebound correctly, state round-trips, memory adds up."""

from __future__ import annotations

import io

import pytest
import torch
from helpers import TinyMLP, regression_data, stall_task
from torch import nn

from lit_mpstable.core.weights.master import MasterWeights

LOW = [torch.bfloat16, torch.float16]


# ------------------------------------------------------------------------------------------- the stall
def _train_stall(dtype: torch.dtype, *, masters: bool, lr: float, steps: int) -> dict[str, float | bool]:
    x, y, w0 = stall_task()
    model = nn.Linear(16, 16, bias=False)
    with torch.no_grad():
        model.weight.copy_(w0)
    model.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    mw = MasterWeights(model, [opt]) if masters else None
    x_in, before, max_update = x.to(dtype), model.weight.detach().clone(), 0.0

    def loss_fn() -> torch.Tensor:
        return ((model(x_in).float() - y) ** 2).sum(1).mean()

    first = loss_fn().item()
    for _ in range(steps):
        loss_fn().backward()
        max_update = max(max_update, lr * model.weight.grad.float().abs().max().item())
        if mw is not None:
            mw.copy_grads_to_master_()
            mw.zero_model_grads_()
        opt.step()
        opt.zero_grad()
        if mw is not None:
            mw.refresh_model_()
    with torch.no_grad():
        last = loss_fn().item()
    return dict(first=first, last=last, unchanged=torch.equal(before, model.weight.detach()), max_update=max_update)


@pytest.mark.parametrize(("dtype", "lr", "steps"), [(torch.bfloat16, 0.005, 60), (torch.float16, 0.0005, 400)])
def test_sub_ulp_updates_stall_without_masters_and_match_fp32_with_them(
    dtype: torch.dtype, lr: float, steps: int
) -> None:
    half_ulp = torch.finfo(dtype).eps / 2  # eps is the ulp in [1, 2), where all weights stay
    fp32 = _train_stall(torch.float32, masters=False, lr=lr, steps=steps)
    plain = _train_stall(dtype, masters=False, lr=lr, steps=steps)
    mastered = _train_stall(dtype, masters=True, lr=lr, steps=steps)
    print(
        f"\n[stall {dtype}] lr={lr} steps={steps} max|update|={plain['max_update']:.2e} (half ulp {half_ulp:.2e});"
        f" loss first {fp32['first']:.4f} -> fp32 {fp32['last']:.4f}, {dtype} {plain['last']:.4f},"
        f" {dtype}+masters {mastered['last']:.4f}"
    )
    # The task is what it claims: every update is below half an ulp, and FP32 follows the closed form.
    assert plain["max_update"] < half_ulp
    assert fp32["last"] == pytest.approx((1 - 2 * lr) ** (2 * steps) * fp32["first"], rel=1e-3)
    assert fp32["last"] < 0.5 * fp32["first"]
    # Plain 16-bit SGD rounds every update away: not one weight bit moves, the loss stays where it was.
    assert plain["unchanged"]
    assert plain["last"] == plain["first"]
    # With FP32 masters the same 16-bit model trains like FP32.
    assert not mastered["unchanged"]
    assert mastered["last"] == pytest.approx(fp32["last"], rel=0.01)


# ---------------------------------------------------------------------------------- optimizer rebinding
class _IslandMLP(TinyMLP):
    """TinyMLP whose last layer is an FP32 island: its input is cast up, as an FP32-module guard would do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act(self.fc2(self.act(self.fc1(x)))).float())


def _mixed_model() -> TinyMLP:
    """TinyMLP in BF16 with fc1.bias frozen and fc3 kept in FP32."""
    model = _IslandMLP().to(torch.bfloat16)
    model.fc3.float()
    model.fc1.bias.requires_grad_(False)
    return model


def _backward(model: nn.Module, n: int = 16) -> None:
    x, y = regression_data(n)
    nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y).backward()


def test_rebinding_keeps_groups_and_skips_frozen_and_fp32_params() -> None:
    model = _mixed_model()
    old = dict(model.named_parameters())
    sgd = torch.optim.SGD(
        [
            {"params": model.fc1.parameters(), "lr": 0.1},
            {"params": model.fc2.parameters(), "lr": 0.05, "weight_decay": 0.01},
        ],
        lr=0.2,
        momentum=0.9,
    )
    adamw = torch.optim.AdamW(model.fc3.parameters(), lr=1e-3, weight_decay=0.1)
    mw = MasterWeights(model, [sgd, adamw])

    assert [(g["lr"], g["weight_decay"], g["momentum"]) for g in sgd.param_groups] == [(0.1, 0, 0.9), (0.05, 0.01, 0.9)]
    w1, b1 = sgd.param_groups[0]["params"]
    w2, b2 = sgd.param_groups[1]["params"]
    assert b1 is old["fc1.bias"] and b1.dtype == torch.bfloat16  # frozen: left in place, no master
    for master, name in ((w1, "fc1.weight"), (w2, "fc2.weight"), (b2, "fc2.bias")):
        assert isinstance(master, nn.Parameter) and master is not old[name]
        assert master.dtype == torch.float32 and torch.equal(master, old[name].float())
    assert adamw.param_groups[0]["params"] == [old["fc3.weight"], old["fc3.bias"]]  # FP32: left in place
    assert [name for name, _, _ in mw.named_pairs()] == ["fc1.weight", "fc2.weight", "fc2.bias"]
    assert all(p is old[n] for n, _, p in mw.named_pairs())
    assert [id(m) for m in mw.masters] == [id(w1), id(w2), id(b2)]

    fc3_before, b1_before = old["fc3.weight"].detach().clone(), old["fc1.bias"].detach().clone()
    _backward(model)
    mw.copy_grads_to_master_()
    mw.zero_model_grads_()
    sgd.step()
    adamw.step()
    mw.refresh_model_()
    assert not torch.equal(old["fc3.weight"], fc3_before)  # the FP32 island is still optimized
    assert torch.equal(old["fc1.bias"], b1_before) and old["fc1.bias"].dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, m.bfloat16()) for _, m, p in mw.named_pairs())
    assert set(sgd.state) == {w1, w2, b2}
    assert all(sgd.state[m]["momentum_buffer"].dtype == torch.float32 for m in (w1, w2, b2))


def test_two_optimizers_over_disjoint_params_step_separately() -> None:
    model = TinyMLP().to(torch.bfloat16)
    opt_a = torch.optim.AdamW(model.fc1.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW([*model.fc2.parameters(), *model.fc3.parameters()], lr=1e-2)
    mw = MasterWeights(model, [opt_a, opt_b])
    fc1_before = model.fc1.weight.detach().clone()
    fc2_before = model.fc2.weight.detach().clone()

    _backward(model)
    mw.copy_grads_to_master_(opt_b)
    opt_b.step()
    mw.refresh_model_(opt_b)
    assert torch.equal(model.fc1.weight, fc1_before)  # opt_a's masters were neither given grads nor refreshed
    assert all(m.grad is None for m in opt_a.param_groups[0]["params"])
    assert not torch.equal(model.fc2.weight, fc2_before)
    for state in opt_b.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    with pytest.raises(ValueError, match="not given at construction"):
        mw.refresh_model_(torch.optim.SGD(model.parameters(), lr=0.1))


def test_existing_optimizer_state_moves_to_the_master_in_fp32() -> None:
    model = nn.Linear(16, 16).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _backward(model)
    opt.step()  # state created for the bf16 params, in bf16
    old_state = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}
    assert old_state[model.weight]["exp_avg"].dtype == torch.bfloat16

    mw = MasterWeights(model, [opt])
    assert set(opt.state) == set(mw.masters)
    for _, master, param in mw.named_pairs():
        for key, value in old_state[param].items():
            new = opt.state[master][key]
            assert new.dtype == (torch.float32 if value.is_floating_point() else value.dtype)
            assert torch.equal(new, value.to(new.dtype))


# ------------------------------------------------------------------------------------ one step by hand
@pytest.mark.parametrize("dtype", LOW)
def test_copy_step_refresh_equals_fp32_update_rounded(dtype: torch.dtype) -> None:
    lr, momentum, wd = 0.01, 0.9, 0.1
    g = torch.Generator().manual_seed(1)
    w0 = (1.0 + torch.rand(8, 4, generator=g)).to(dtype)
    grads = [torch.randn(8, 4, generator=g).to(dtype) for _ in range(2)]
    model = nn.Linear(4, 8, bias=False).to(dtype)
    with torch.no_grad():
        model.weight.copy_(w0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=wd)
    mw = MasterWeights(model, [opt])

    # SGD with momentum and L2 weight decay, written out in FP32 (torch.optim.SGD's documented rule).
    w, buf = w0.float(), None
    for grad in grads:
        d = grad.float() + wd * w
        buf = d if buf is None else momentum * buf + d
        w = w - lr * buf
        model.weight.grad = grad.clone()
        mw.copy_grads_to_master_()
        opt.step()
        mw.refresh_model_()
    master = mw.masters[0]
    torch.testing.assert_close(master, w, rtol=0, atol=1e-6)
    assert torch.equal(model.weight, w.to(dtype))  # 16-bit weight = nearest to the FP32 update
    assert torch.equal(model.weight, master.to(dtype))


def test_grads_copy_in_place_and_none_stays_none() -> None:
    model = nn.Linear(4, 4).to(torch.bfloat16)
    mw = MasterWeights(model, [torch.optim.SGD(model.parameters(), lr=0.1)])
    weight_master, bias_master = mw.masters
    model.weight.grad = torch.full((4, 4), 0.5, dtype=torch.bfloat16)
    mw.copy_grads_to_master_()
    assert bias_master.grad is None
    buffer = weight_master.grad
    assert buffer.dtype == torch.float32 and torch.equal(buffer, torch.full((4, 4), 0.5))

    model.weight.grad = torch.full((4, 4), float("inf"), dtype=torch.bfloat16)
    mw.copy_grads_to_master_()
    assert weight_master.grad is buffer and torch.isinf(buffer).all()  # copied into the same buffer, inf kept
    mw.zero_model_grads_()
    assert model.weight.grad is None and weight_master.grad is buffer
    mw.copy_grads_to_master_()
    assert weight_master.grad is None  # a 16-bit param without grad leaves its master without one


def test_fp16_with_grad_scaler_unscales_the_masters() -> None:
    # GradScaler refuses to unscale FP16 grads; with masters it unscales FP32 copies and skips on inf.
    model = TinyMLP().to(torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mw = MasterWeights(model, [opt])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = regression_data(16)
    before = model.fc1.weight.detach().clone()
    loss = nn.functional.mse_loss(model(x.half()).float(), y)
    scaler.scale(loss).backward()
    mw.copy_grads_to_master_()
    mw.zero_model_grads_()
    scaled = mw.masters[0].grad.clone()
    scaler.unscale_(opt)
    assert torch.equal(mw.masters[0].grad, scaled / 2.0**10)  # a power of two: exact in FP32
    scaler.step(opt)
    scaler.update()
    mw.refresh_model_()
    assert scaler.get_scale() == 2.0**10 and not torch.equal(model.fc1.weight, before)
    assert model.fc1.weight.dtype == torch.float16


# --------------------------------------------------------------------------------------------- state
def test_state_dict_round_trip_and_strict_keys() -> None:
    model = _mixed_model()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    mw = MasterWeights(model, [opt])
    state = mw.state_dict()
    assert list(state) == ["fc1.weight", "fc2.weight", "fc2.bias"]
    assert all(t.dtype == torch.float32 and not t.requires_grad for t in state.values())
    buffer = io.BytesIO()
    torch.save(state, buffer)  # written out now, so later steps cannot change `saved`
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    _backward(model)
    mw.copy_grads_to_master_()
    opt.step()
    mw.refresh_model_()
    assert not torch.equal(mw.masters[0], saved["fc1.weight"])
    mw.load_state_dict(saved)
    for name, master, param in mw.named_pairs():
        assert torch.equal(master, saved[name]) and torch.equal(param, saved[name].bfloat16())

    missing = dict(saved)
    del missing["fc2.bias"]
    with pytest.raises(KeyError, match="fc2.bias"):
        mw.load_state_dict(missing)
    with pytest.raises(KeyError, match="fc9.weight"):
        mw.load_state_dict({**saved, "fc9.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="fc2.bias"):
        mw.load_state_dict({**saved, "fc2.bias": torch.zeros(3)})


def test_rebuild_from_model() -> None:
    model = nn.Linear(4, 4).to(torch.bfloat16)
    mw = MasterWeights(model, [torch.optim.SGD(model.parameters(), lr=0.1)])
    with torch.no_grad():
        mw.masters[0].add_(1e-3)  # a sub-ulp difference the rebuild must drop
        model.weight.copy_(torch.arange(16.0).view(4, 4))
    mw.rebuild_from_model_()
    assert torch.equal(mw.masters[0], torch.arange(16.0).view(4, 4))
    assert torch.equal(mw.masters[1], model.bias.float())


# -------------------------------------------------------------------------------------------- memory
def test_memory_report_matches_hand_count() -> None:
    model = _mixed_model()  # fc1 16->32 (bias frozen), fc2 32->32 in BF16; fc3 32->16 in FP32
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    mw = MasterWeights(model, [opt])
    _backward(model)
    mw.copy_grads_to_master_()
    opt.step()

    mastered = 32 * 16 + 32 * 32 + 32  # fc1.weight, fc2.weight, fc2.bias
    fp32 = 16 * 32 + 16  # fc3
    expected = {
        "params_16bit": 2 * (mastered + 32),  # + the frozen fc1.bias
        "grads_16bit": 2 * mastered,  # the frozen bias has no grad
        "masters": 4 * mastered,
        "master_grads": 4 * mastered,
        # AdamW: exp_avg and exp_avg_sq in FP32 per element, plus one FP32 scalar step per parameter (5 of them).
        "optimizer_state": 8 * (mastered + fp32) + 5 * 4,
        "params_fp32_other": 4 * fp32,
    }
    expected["total"] = sum(expected.values())
    assert mw.memory_report() == expected
    mw.zero_model_grads_()
    assert mw.memory_report()["grads_16bit"] == 0

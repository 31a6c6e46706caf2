"""FP8 regressions: the ``_scaled_mm`` probe in the ``*-true`` modes, activation checkpointing with delayed
scaling, compiled FP8 on 16-bit inputs, and the refusal message for models without eligible ``nn.Linear`` layers."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import TinyMLP
from torch import nn
from torch.utils.checkpoint import checkpoint

import lit_mpstable.fp8.gemm as gemm_module
from lit_mpstable.core.step.stepper import PrecisionName, PrecisionStepper, default_dtype
from lit_mpstable.fp8 import FP8Config, FP8Linear, convert_to_fp8


def _cpu_runs_scaled_mm() -> bool:
    a = torch.eye(16).to(torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32)
    try:
        return torch.equal(torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32), torch.eye(16))
    except Exception:  # noqa: BLE001 - an older build without the CPU kernel
        return False


needs_cpu_scaled_mm = pytest.mark.skipif(not _cpu_runs_scaled_mm(), reason="this torch has no CPU torch._scaled_mm")


class _CountScaledMM:
    def __init__(self) -> None:
        self.calls = 0
        self.real = torch._scaled_mm

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)


# ------------------------------------------------------------------------------------ item 6: the probe
@needs_cpu_scaled_mm
@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_true_16bit_fp8_still_uses_scaled_mm_after_the_first_forward(
    precision: PrecisionName, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh process: nothing probed, nothing warned.
    gemm_module._PROBED.clear()
    monkeypatch.setattr(gemm_module, "_WARNED_EMULATION", set())
    # emulate=False: the CPU's own choice is emulation (below); forcing _scaled_mm makes a spoiled probe raise.
    stepper = PrecisionStepper(precision, fp8=FP8Config(recipe="current", emulate=False), device="cpu")
    model = stepper.setup_module(TinyMLP())
    x = torch.randn(16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "does not run FP8 GEMMs on cpu" blaming the hardware
        with stepper.forward_context():
            model(stepper.convert_input(x))
    assert gemm_module.scaled_mm_supported("cpu")
    counter = _CountScaledMM()
    monkeypatch.setattr(torch, "_scaled_mm", counter)
    with stepper.forward_context():
        model(stepper.convert_input(x))
    assert counter.calls == 1  # fc2's forward GEMM


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_the_cpu_emulates_by_default_with_the_scaled_mm_product(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's CPU _scaled_mm is a reference loop for two operands of one format (bench/bench_fp8_cpu_gemm.py): on a
    # CPU, emulate=None emulates, silently, and gets the product emulate=False gets from _scaled_mm (up to fp32
    # rounding: the kernel applies the scales after its sum, the emulation before).
    monkeypatch.setattr(gemm_module, "_WARNED_EMULATION", set())
    gemm_module.scaled_mm_supported("cpu")  # probed here, not counted below
    torch.manual_seed(0)
    w, bias, x = torch.randn(32, 32), torch.randn(32), torch.randn(48, 32, requires_grad=True)
    outputs = []
    for emulate in (None, False):
        if emulate is False and not _cpu_runs_scaled_mm():
            continue
        layer = FP8Linear(32, 32, config=FP8Config(recipe="current", format=fmt, emulate=emulate))
        with torch.no_grad():
            layer.weight.copy_(w), layer.bias.copy_(bias)
        counter = _CountScaledMM()
        monkeypatch.setattr(torch, "_scaled_mm", counter)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            y = layer(x)
            (grad_x,) = torch.autograd.grad(y.square().sum(), x)
        monkeypatch.setattr(torch, "_scaled_mm", counter.real)
        assert counter.calls == (0 if emulate is None else 3)  # forward, grad_x, grad_W
        outputs.append((y.detach(), grad_x))
    if len(outputs) == 2:  # a torch without the CPU kernel has nothing to compare with
        for a, b in zip(*outputs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _delayed_weight_grads(emulate: bool | None) -> list[torch.Tensor]:
    """grad_W of one delayed-scaling FP8Linear step, eager and compiled with aot_eager, from the same start."""
    grads = []
    for compiled in (False, True):
        torch.manual_seed(0)
        layer = FP8Linear(16, 16, bias=False, config=FP8Config(recipe="delayed", emulate=emulate))
        torch._dynamo.reset()
        forward = torch.compile(layer, backend="aot_eager") if compiled else layer
        forward(torch.randn(32, 16)).square().sum().backward()
        grads.append(layer.weight.grad)
    torch._dynamo.reset()
    return grads


def test_emulated_delayed_backward_under_aot_eager_reads_the_scale_it_cast_with() -> None:
    # torch 2.13's partitioner recomputed the input's inverse scale as reciprocal(clone(scale[0])) in the backward,
    # from the buffer the forward had already updated (an xfail until the scale was copied by an opaque op).
    eager, compiled = _delayed_weight_grads(emulate=True)
    torch.testing.assert_close(compiled, eager)


@needs_cpu_scaled_mm
def test_auto_mode_keeps_scaled_mm_for_the_delayed_recipe_on_a_cpu() -> None:
    eager, compiled = _delayed_weight_grads(emulate=None)
    assert torch.equal(compiled, eager)


def test_the_probe_answers_alike_inside_a_16bit_forward_under_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    # Whatever context the first call runs in (a 16-bit default dtype, autocast), the probe builds fp32 operands.
    gemm_module._PROBED.clear()
    with default_dtype(torch.bfloat16), torch.autocast("cpu", dtype=torch.bfloat16):
        inside = gemm_module.scaled_mm_supported("cpu")
    gemm_module._PROBED.clear()
    outside = gemm_module.scaled_mm_supported("cpu")
    assert inside == outside == _cpu_runs_scaled_mm()


# -------------------------------------------------------------- item 7: delayed scaling + checkpointing
class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class _Net(nn.Module):
    def __init__(self, checkpointing: str | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpointing is None:
                x = x + block(x)
            else:
                x = x + checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")
        return x


def _train_delayed(checkpointing: str | None, steps: int = 8) -> tuple[list[float], dict[str, dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    model = _Net(checkpointing)
    config = FP8Config(recipe="delayed", amax_history_len=16, filter=["blocks"], emulate=True)
    convert_to_fp8(model, config)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 16, generator=gen).requires_grad_(checkpointing == "reentrant")
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    layers = {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert all(not m._forward_scales for m in layers.values())  # every stored forward was consumed or dropped
    return losses, {name: m.fp8_state_dict() for name, m in layers.items()}


@pytest.mark.parametrize("checkpointing", ["non_reentrant", "reentrant"])
def test_checkpoint_recompute_records_no_amax_and_reuses_the_forward_scales(checkpointing: str) -> None:
    steps = 8
    plain_losses, plain_state = _train_delayed(None, steps)
    losses, state = _train_delayed(checkpointing, steps)
    for name, layer_state in state.items():
        recorded = (layer_state["amax_history"] != 0).sum(dim=1).tolist()
        assert recorded == [steps, steps, steps], f"{name}: amaxes recorded per operand"
        assert torch.equal(layer_state["amax_history"], plain_state[name]["amax_history"]), name
        assert torch.equal(layer_state["scale"], plain_state[name]["scale"]), name
    assert losses == plain_losses


# ------------------------------------------------------------- item 11: one rounding of GEMM + bias
def _exact_operands(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Values whose FP8 casts are exact (at most 3 significant bits; the amaxes 3.5 and 7/16 give power-of-two
    # scales 128 and 1024), so the FP8 GEMM is exact in fp32 and only the bf16 output rounds.
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-7, 8, (32, 32), generator=gen) / 2
    w = torch.randint(-7, 8, (32, 32), generator=gen) / 16
    x[0, 0], w[0, 0] = 3.5, 7 / 16
    bias = torch.randn(32, generator=gen).bfloat16()
    return x.bfloat16(), w, bias


def _layer(emulate: bool | None, w: torch.Tensor, bias: torch.Tensor) -> FP8Linear:
    layer = FP8Linear(32, 32, config=FP8Config(recipe="current", emulate=emulate))
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(bias.float())
    return layer


@pytest.mark.parametrize("emulate", [True, pytest.param(None, marks=needs_cpu_scaled_mm)])
def test_bf16_output_rounds_gemm_plus_bias_once(emulate: bool | None) -> None:
    x, w, bias = _exact_operands()
    expected = (x.float() @ w.T + bias.float()).bfloat16()  # exact fp32 GEMM, one rounding (as nn.Linear's epilogue)
    y = _layer(emulate, w, bias)(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, expected), f"{(y != expected).sum().item()} of {y.numel()} outputs rounded twice"


@pytest.mark.slow
def test_compiled_fp8_on_bf16_inputs_equals_eager() -> None:
    x, w, bias = _exact_operands(1)
    x = x + torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).bfloat16() / 64  # inexact FP8 casts too
    layer = _layer(True, w, bias)
    eager = layer(x)
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)(x)
    assert torch.equal(compiled, eager), (compiled.float() - eager.float()).abs().max()


# ------------------------------------------------------ message: GPT-2's Conv1D projections are not nn.Linear
class Conv1D(nn.Module):
    """Stand-in for transformers.pytorch_utils.Conv1D: a linear layer with its weight stored (in, out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)


class _GPT2Like(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(64, 32)
        blocks = [{"c_attn": Conv1D(96, 32), "c_proj": Conv1D(32, 32), "c_fc": Conv1D(64, 32)} for _ in range(2)]
        self.h = nn.ModuleList(nn.ModuleDict(block) for block in blocks)
        self.lm_head = nn.Linear(32, 64, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.wte(idx)
        for block in self.h:
            assert isinstance(block, nn.ModuleDict)  # built from dicts in __init__
            h = h + block["c_proj"](block["c_attn"](h)[..., :32])
        return self.lm_head(h)


def test_no_eligible_linear_names_the_linear_like_types_and_a_filter_that_works() -> None:
    with pytest.raises(ValueError) as raised:
        PrecisionStepper("bf16-mixed", fp8="delayed", device="cpu").setup_module(_GPT2Like())
    message = str(raised.value)
    assert "Conv1D" in message and "h.0.c_attn" in message  # the Linear-like type, and where
    assert "Embedding" not in message  # a lookup table, not a GEMM
    assert "filter=['lm_head']" in message
    stepper = PrecisionStepper("bf16-mixed", fp8=FP8Config(filter=["lm_head"]), device="cpu")
    model = stepper.setup_module(_GPT2Like())  # the advice works
    assert isinstance(model.lm_head, FP8Linear)


def test_a_filter_naming_only_linear_like_layers_says_they_are_not_nn_linear() -> None:
    with pytest.raises(ValueError) as raised:
        convert_to_fp8(_GPT2Like(), FP8Config(filter=["h.*.c_fc"]))
    message = str(raised.value)
    assert "Conv1D" in message and "h.0.c_fc" in message and "['lm_head']" in message


def _train_with_a_no_grad_forward(checkpointing: str | None) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = _Net(checkpointing)
    convert_to_fp8(model, FP8Config(recipe="delayed", amax_history_len=16, filter=["blocks"], emulate=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(3):
        x = torch.randn(16, 16, generator=gen)
        if step == 1:
            with torch.no_grad():
                model(x)  # training mode: records amaxes and moves the scales, as any training forward
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert all(not m._forward_scales for m in layers)
    return losses, [p.detach().clone() for p in model.parameters()]


def test_a_no_grad_forward_does_not_hand_its_scales_to_a_later_recompute() -> None:
    plain_losses, plain_params = _train_with_a_no_grad_forward(None)
    losses, params = _train_with_a_no_grad_forward("non_reentrant")
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))


def test_a_frozen_layer_does_not_pile_up_stored_forwards() -> None:
    frozen = FP8Linear(16, 16, config=FP8Config(recipe="delayed", emulate=True)).requires_grad_(False)
    for _ in range(100):
        frozen(torch.randn(4, 16))
    assert not frozen._forward_scales


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_checkpointing_through_the_stepper_records_one_amax_per_step(precision: PrecisionName) -> None:
    def run(checkpointing: str | None) -> tuple[list[float], torch.Tensor]:
        torch.manual_seed(0)
        fp8 = FP8Config(recipe="delayed", amax_history_len=8, filter=["blocks"], emulate=True)
        stepper = PrecisionStepper(precision, fp8=fp8, device="cpu")
        model = stepper.setup_module(_Net(checkpointing))
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            x = stepper.convert_input(torch.randn(16, 16, generator=gen))
            with stepper.forward_context():
                loss = model(x).float().square().mean()
            loss.backward()
            losses.append(loss.item())
        layer = model.get_submodule("blocks.1.fc2")
        assert isinstance(layer, FP8Linear)  # the delayed recipe swapped it
        return losses, layer.amax_history.clone()

    plain_losses, plain_history = run(None)
    losses, history = run("non_reentrant")
    assert (history != 0).sum(dim=1).tolist() == [3, 3, 3]
    assert losses == plain_losses and torch.equal(history, plain_history)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_compiled_delayed_fp8_through_the_stepper_equals_eager(precision: PrecisionName) -> None:
    def run(compiled: bool) -> tuple[list[float], torch.Tensor]:
        torch.manual_seed(0)
        torch._dynamo.reset()
        fp8 = FP8Config(recipe="delayed", amax_history_len=4, filter=["0"], emulate=True)
        stepper = PrecisionStepper(precision, fp8=fp8, device="cpu")
        model = stepper.setup_module(nn.Sequential(nn.Linear(32, 32)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        stepper.setup_optimizers(model, [optimizer])
        forward = torch.compile(model, backend="inductor") if compiled else model
        gen, losses = torch.Generator().manual_seed(1), []
        for _ in range(3):
            x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)
            with stepper.forward_context():
                loss = (forward(stepper.convert_input(x)).float() - y).square().mean()
            stepper.scale_loss(loss).backward()
            stepper.step(optimizer)
            optimizer.zero_grad()
            losses.append(loss.item())
        layer = model.get_submodule("0")
        assert isinstance(layer, FP8Linear)  # the delayed recipe swapped it
        return losses, layer.amax_history.clone()

    eager_losses, eager_history = run(False)
    losses, history = run(True)
    torch._dynamo.reset()
    assert losses == eager_losses
    assert torch.equal(history, eager_history)


# ------------------------------------ issue 41 item 2: compiled FP8 between 16-bit producers equals eager
def _gelu_sandwich_run(recipe: str, compiled: bool, emulate: bool | None, bias: bool = True) -> dict[str, object]:
    """Linear-GELU-FP8Linear-GELU-Linear under bf16 autocast, AdamW, 3 steps: losses, parameters, FP8 state."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    stepper = PrecisionStepper("bf16-mixed", fp8=FP8Config(recipe=recipe, filter=["2"], emulate=emulate), device="cpu")
    model = stepper.setup_module(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64, bias=bias), nn.GELU(),
                                               nn.Linear(64, 32)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepper.setup_optimizers(model, [optimizer])
    forward = torch.compile(model, backend="inductor") if compiled else model
    gen, losses = torch.Generator().manual_seed(1), []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FP8 emulation on the CPU: said elsewhere
        for _ in range(3):
            x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)
            with stepper.forward_context():
                loss = (forward(stepper.convert_input(x)).float() - y).square().mean()
            stepper.scale_loss(loss).backward()
            stepper.step(optimizer)
            optimizer.zero_grad()
            losses.append(loss.item())
    torch._dynamo.reset()
    layer = model.get_submodule("2")
    assert isinstance(layer, FP8Linear)
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
            "fp8": layer.fp8_state_dict()}


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "emulate", "bias"), [
    ("delayed", None, True), ("delayed", True, True), ("current", None, True), ("current", None, False),
    ("mxfp8", None, True), ("mxfp8", None, False), ("blockwise", None, True), ("mxfp4", None, True),
    ("nvfp4", None, True),
])
def test_compiled_fp8_between_bf16_producers_equals_eager(recipe: str, emulate: bool | None, bias: bool) -> None:
    # Inductor fuses the FP8 cast with the GELU that makes its bf16 input (and the GELU backward that makes its
    # gradient, and the GELU that reads its output), and computes the fused values in fp32 without the rounding to
    # bf16 that eager makes. The delayed recipe's backward also read the scale buffer its forward had updated.
    eager = _gelu_sandwich_run(recipe, compiled=False, emulate=emulate, bias=bias)
    compiled = _gelu_sandwich_run(recipe, compiled=True, emulate=emulate, bias=bias)
    assert compiled["losses"] == eager["losses"]
    assert all(torch.equal(a, b) for a, b in zip(compiled["params"], eager["params"]))  # type: ignore[call-overload]
    for key, value in eager["fp8"].items():  # type: ignore[attr-defined]
        assert torch.equal(compiled["fp8"][key], value), key  # type: ignore[index]

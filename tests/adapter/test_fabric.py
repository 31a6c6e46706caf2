"""lit_mpstable.frontends.fabric.StablePrecision in real Fabric runs on the CPU: parity with Fabric's own plugins,
skips, clipping (a skipped step, FP32 masters', compact weights'), islands, FP8, conversions, refusals (AdamW's eps
in 16-true without masters) and torch.compile."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import TinyMLP, fabric_backward, inject_overflow, quiet_fabric, regression_data
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import nn

from lit_mpstable import SpikeGuard
from lit_mpstable.core.fingerprint import KEY as FINGERPRINT
from lit_mpstable.core.fingerprint import FingerprintMismatch
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler
from lit_mpstable.core.step.stepper import PrecisionStepper
from lit_mpstable.frontends.fabric import StablePrecision

INF, NAN = float("inf"), float("nan")
_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}


def fabric_of(plugin: Precision, accelerator: str = "cpu") -> Fabric:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FP16 on the CPU, said once: tested on its own below
        return Fabric(accelerator=accelerator, devices=1, plugins=[plugin])


def train(
    plugin: Precision, steps: int = 4, *, poison: Iterable[int] = (), value: float = INF, skip: Iterable[int] = (),
    max_norm: float | None = None, clip_val: float | None = None, model: nn.Module | None = None,
    optimizer: str = "adamw", accelerator: str = "cpu",
) -> dict[str, Any]:
    """A Fabric loop on TinyMLP (seed 0), batches of 16; fc2's weight gradient gets ``value`` on the ``poison`` steps;
    the loop itself leaves out ``optimizer.step()`` on the ``skip`` steps (a reference that skips by hand)."""
    fabric = fabric_of(plugin, accelerator)
    torch.manual_seed(0)
    model = model if model is not None else TinyMLP()
    inject_overflow(model.fc2, poison, value)
    params = model.parameters()
    opt = torch.optim.AdamW(params, lr=1e-2) if optimizer == "adamw" else torch.optim.SGD(params, lr=0.1)
    model, opt = fabric.setup(model, opt)
    x, y = (t.to(fabric.device) for t in regression_data(64))
    out: dict[str, Any] = {"scales": [], "skipped": [], "norms": [], "losses": []}
    for step in range(steps):
        batch = slice(16 * (step % 4), 16 * (step % 4 + 1))
        opt.zero_grad()
        loss = F.mse_loss(model(x[batch]), y[batch])
        fabric.backward(loss)
        if max_norm is not None:
            out["norms"].append(fabric.clip_gradients(model, opt, max_norm=max_norm))
        if clip_val is not None:
            fabric.clip_gradients(model, opt, clip_val=clip_val)
        if step not in skip:
            opt.step()
        scaler = getattr(plugin, "scaler", None)
        out["scales"].append(float(scaler.get_scale()) if scaler is not None else 1.0)
        out["skipped"].append(getattr(plugin, "last_step_skipped", step in skip))
        out["losses"].append(loss.item())
    out["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["model"], out["optimizer"] = model, opt
    return out


def assert_same_weights(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name


def hand_master_loop(
    precision: str, steps: int, *, poison: Iterable[int] = (), value: float = INF, max_norm: float | None = None
) -> dict[str, Any]:
    """The FP32-master recipe written out (apex O2 style): 16-bit model, FP32 copies in the optimizer, gradients
    copied up, unscaled (FP16: torch's GradScaler), checked and clipped there, step, weights copied back down."""
    dtype = _DTYPES[precision]
    torch.manual_seed(0)
    model = TinyMLP()
    inject_overflow(model.fc2, poison, value)
    masters = [p.detach().clone().requires_grad_() for p in model.parameters()]  # from the FP32 initialisation
    model.to(dtype)
    opt = torch.optim.AdamW(masters, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    x, y = regression_data(64)
    for step in range(steps):
        batch = slice(16 * (step % 4), 16 * (step % 4 + 1))
        opt.zero_grad()
        loss = F.mse_loss(model(x[batch].to(dtype)).float(), y[batch])
        (scaler.scale(loss) if scaler is not None else loss).backward()
        for master, param in zip(masters, model.parameters()):
            master.grad, param.grad = param.grad.float(), None
        if scaler is not None:
            scaler.unscale_(opt)
        finite = all(torch.isfinite(m.grad).all() for m in masters)
        if max_norm is not None and finite:
            torch.nn.utils.clip_grad_norm_(masters, max_norm)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        elif finite:
            opt.step()
        with torch.no_grad():
            for master, param in zip(masters, model.parameters()):
                param.copy_(master)
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "masters": masters}


# ------------------------------------------------------------------------------------------------ wiring
def test_the_trainer_plugin_fails_in_fabric_and_ours_is_a_fabric_precision_plugin() -> None:
    # The reported bug: Lightning accepts the Trainer plugin in Fabric (it subclasses Fabric's Precision), then its
    # hooks reached for a trainer ("'NoneType' object has no attribute 'trainer'"); the first backward now names the
    # plugin to use.
    from lit_mpstable import StablePrecision as TrainerStablePrecision

    with pytest.raises(TypeError, match=r"Trainer plugin.*from lit_mpstable\.fabric import StablePrecision"):
        train(TrainerStablePrecision("bf16-mixed"), steps=1)
    plugin = StablePrecision("bf16-mixed")
    assert isinstance(plugin, Precision) and plugin.precision == "bf16-mixed"
    assert repr(StablePrecision("16-mixed", scaler="adaptive")) == "StablePrecision('16-mixed', scaler='adaptive')"
    with pytest.raises(ValueError, match="scaler"):
        StablePrecision("bf16-mixed", scaler="dynamic")


def test_the_plugin_pickles_for_ddp_spawn_and_the_copy_trains_alike() -> None:
    # strategy="ddp_spawn" pickles the Fabric, plugin included, into every rank.
    import pickle

    copy = pickle.loads(pickle.dumps(StablePrecision("16-mixed", fp32_modules=["fc3"])))
    assert_same_weights(train(copy, 2), train(StablePrecision("16-mixed", fp32_modules=["fc3"]), 2))


# ----------------------------------------------------------------------------------- parity with Fabric's own
PARITY = {
    "32-true": ({}, lambda: Precision()),
    "bf16-mixed": ({}, lambda: MixedPrecision("bf16-mixed", "cpu")),
    "16-mixed": ({}, lambda: MixedPrecision("16-mixed", "cpu")),
    "bf16-true": (dict(master_weights=False), lambda: HalfPrecision("bf16-true")),
    "16-true": (dict(master_weights=False, scaler=None), lambda: HalfPrecision("16-true")),
}
# AdamW's eps=1e-8 is 0 in FP16: pure FP16 weights and state diverge on the first step, so 16-true uses SGD.
OPTIMIZER = {"16-true": "sgd"}


@pytest.mark.parametrize("precision", list(PARITY))
def test_clean_steps_are_bit_identical_to_fabrics_own_plugin(precision: str) -> None:
    kwargs, builtin = PARITY[precision]
    plugin = StablePrecision(precision, **kwargs)
    optimizer = OPTIMIZER.get(precision, "adamw")
    ours, theirs = train(plugin, optimizer=optimizer), train(builtin(), optimizer=optimizer)
    assert_same_weights(ours, theirs)
    assert ours["scales"] == theirs["scales"] and not any(ours["skipped"])
    assert plugin.step_count == 4 and plugin.overflow_count == 0
    assert ours["params"]["fc1.weight"].dtype == _DTYPES.get(precision, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "bf16-true"])
def test_on_cuda_parity_holds_and_the_plugin_follows_the_model_there(precision: str) -> None:
    # Fabric converts the model on the CPU and moves it afterwards: autocast, scaler and masters must follow it.
    kwargs, builtin = PARITY[precision]
    builtin_plugin = MixedPrecision(precision, "cuda") if precision.endswith("mixed") else builtin()
    plugin = StablePrecision(precision, device="cpu", **kwargs)
    ours = train(plugin, accelerator="cuda", poison={2})
    theirs = train(builtin_plugin, accelerator="cuda", poison={2}, skip=() if precision == "16-mixed" else {2})
    assert plugin.device == "cuda" and ours["params"]["fc1.weight"].is_cuda
    assert ours["skipped"] == [False, False, True, False]
    assert_same_weights(ours, theirs)


def test_16_mixed_skips_and_rescales_as_gradscaler_does() -> None:
    # growth_interval=2 so the trajectory both grows and backs off within 6 steps; infs on steps 1 and 4.
    def scaler() -> torch.amp.GradScaler:
        return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)

    plugin = StablePrecision("16-mixed", scaler=scaler())
    ours = train(plugin, 6, poison={1, 4}, max_norm=1.0)
    theirs = train(MixedPrecision("16-mixed", "cpu", scaler()), 6, poison={1, 4})
    # Fabric's own plugin cannot clip an overflowing step (clip_grad_norm_ raises on the inf): a clean reference
    # clips only the clean steps, by hand through fabric.clip_gradients, as ours does.
    reference = _clip_clean_steps(MixedPrecision("16-mixed", "cpu", scaler()), 6, poison={1, 4}, max_norm=1.0)
    assert ours["scales"] == theirs["scales"] == [2.0**10, 2.0**9, 2.0**9, 2.0**10, 2.0**9, 2.0**9]
    assert ours["skipped"] == [False, True, False, False, True, False]
    assert plugin.overflow_count == plugin.skipped_steps == 2 and plugin.step_count == 6
    assert_same_weights(ours, reference)
    assert [float(n) for n in ours["norms"]][1] == 0.0  # an overflowing step clips nothing and does not raise


def _spike_clip_norm(precision: str, **kwargs: Any) -> tuple[StablePrecision, float]:
    """What fabric.clip_gradients returns on step 6, whose loss is x100 (SpikeGuard: warmup 4, skips it)."""
    plugin = StablePrecision(precision, spike_guard=SpikeGuard(warmup=4, window=16, zscore=3.0), **kwargs)
    fabric = fabric_of(plugin)
    torch.manual_seed(0)
    model = TinyMLP()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(7):
        fabric_backward(fabric, model, step, scale=100.0 if step == 6 else 1.0)
        norm = float(fabric.clip_gradients(model, opt, max_norm=0.5))
        opt.step()
        opt.zero_grad()
    assert plugin.last_step_skipped and plugin.stepper.last_step_spiked and plugin.overflow_count == 0
    return plugin, norm


def test_a_spike_skipped_by_spike_guard_returns_its_real_clip_norm_in_every_mode() -> None:
    # A finite spike's norm is returned as in FP32 (within 16-bit rounding over 6 steps), FP16 included while its
    # scaled gradients stay finite (a scale of 4). At 2**16 the x100 loss takes FP16's scaled gradients past 65504:
    # inf gradients, whose norm no mode could measure, so that step is an overflowing one (nothing clipped, 0),
    # skipped as the spike that caused it.
    _, fp32 = _spike_clip_norm("32-true")
    assert fp32 > 10
    for precision, kwargs in (("bf16-mixed", {}), ("16-mixed", {"scaler": DynamicLossScaler(init_scale=4.0)}),
                              ("16-true", {"scaler": DynamicLossScaler(init_scale=4.0)})):
        assert _spike_clip_norm(precision, **kwargs)[1] == pytest.approx(fp32, rel=0.05), precision
    assert _spike_clip_norm("16-mixed")[1] == 0.0


def _clip_clean_steps(plugin: Precision, steps: int, *, poison: set[int], max_norm: float) -> dict[str, Any]:
    fabric = fabric_of(plugin)
    torch.manual_seed(0)
    model = TinyMLP()
    inject_overflow(model.fc2, poison, INF)
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = regression_data(64)
    for step in range(steps):
        batch = slice(16 * (step % 4), 16 * (step % 4 + 1))
        opt.zero_grad()
        fabric.backward(F.mse_loss(model(x[batch]), y[batch]))
        if step not in poison:
            fabric.clip_gradients(model, opt, max_norm=max_norm)
        opt.step()
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def test_clipping_by_norm_and_value_matches_fabrics_own_on_unscaled_gradients() -> None:
    ours = train(StablePrecision("16-mixed"), 3, max_norm=0.05)
    theirs = train(MixedPrecision("16-mixed", "cpu"), 3, max_norm=0.05)
    assert_same_weights(ours, theirs)
    assert all(0.05 < float(n) < 10 for n in ours["norms"])  # true norms, not scaled by 2**16
    assert [float(n) for n in ours["norms"]] == [float(n) for n in theirs["norms"]]
    assert_same_weights(train(StablePrecision("bf16-mixed"), 3, clip_val=1e-3),
                        train(MixedPrecision("bf16-mixed", "cpu"), 3, clip_val=1e-3))


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_masters_match_the_hand_written_master_loop_with_clipping_and_a_skip(precision: str) -> None:
    plugin = StablePrecision(precision)
    ours = train(plugin, 4, poison={2}, max_norm=0.05)
    reference = hand_master_loop(precision, 4, poison={2}, max_norm=0.05)
    assert_same_weights(ours, reference)
    assert ours["skipped"] == [False, False, True, False] and plugin.overflow_count == 1
    masters = plugin.state_dict()["masters"]
    assert all(torch.equal(masters[name], m) for name, m in zip(ours["params"], reference["masters"]))
    assert all(s["exp_avg"].dtype == torch.float32 for s in ours["optimizer"].state.values())


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_nan_never_reaches_the_weights_without_a_scaler(precision: str) -> None:
    plugin = StablePrecision(precision)
    assert plugin.scaler is None
    ours = train(plugin, 4, poison={1}, value=NAN)
    assert ours["skipped"] == [False, True, False, False] and plugin.overflow_count == 1
    if precision == "bf16-true":
        reference = hand_master_loop(precision, 4, poison={1}, value=NAN)
    else:  # Fabric's own plugin steps the NaN into the weights; the reference leaves that step out by hand
        reference = train(PARITY[precision][1](), 4, skip={1})
    assert_same_weights(ours, reference)
    assert all(torch.isfinite(p).all() for p in ours["params"].values())


def test_16_mixed_on_the_cpu_is_real_fp16_warned_once() -> None:
    plugin = StablePrecision("16-mixed")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, opt = fabric.setup(TinyMLP(), torch.optim.SGD(TinyMLP().parameters(), lr=0.1))
    seen = []
    model.fc1.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    x, y = regression_data(16)
    with pytest.warns(UserWarning, match="emulated") as record:
        for _ in range(2):
            fabric.backward(F.mse_loss(model(x), y))
    assert sum("emulated" in str(w.message) for w in record) == 1
    assert seen == [torch.float16, torch.float16]


# ------------------------------------------------------------------------------------------ islands, FP8
def test_fp32_islands_compute_in_fp32_inside_autocast_and_keep_fp32_weights_in_true_modes() -> None:
    def forward(plugin: Precision) -> tuple[nn.Module, dict[str, Any]]:
        model = fabric_of(plugin).setup(TinyMLP())
        seen: dict[str, Any] = {}
        for name in ("fc1", "fc2"):
            getattr(model, name).register_forward_hook(lambda m, i, o, name=name: seen.update({name: (i[0], o)}))
        model(regression_data(16)[0])
        return model, seen

    _, theirs = forward(MixedPrecision("bf16-mixed", "cpu"))
    assert [o.dtype for _, o in theirs.values()] == [torch.bfloat16, torch.bfloat16]
    model, ours = forward(StablePrecision("bf16-mixed", fp32_modules=["fc2"]))
    assert [o.dtype for _, o in ours.values()] == [torch.bfloat16, torch.float32]
    inp, out = ours["fc2"]  # the island's input is cast up and its product is FP32's, bit for bit
    assert inp.dtype == torch.float32 and torch.equal(out, F.linear(inp, model.fc2.weight, model.fc2.bias))
    fabric_of(StablePrecision("bf16-true", fp32_modules=["fc2"])).setup(model := TinyMLP())
    assert (model.fc1.weight.dtype, model.fc2.weight.dtype) == (torch.bfloat16, torch.float32)


def test_fp8_native_runs_fc2_in_fp8_as_the_plain_stepper_loop_does() -> None:
    plugin = StablePrecision("bf16-mixed", fp8="current")
    ours = train(plugin, 3, poison={1})
    assert plugin.layout.fp8_layers == ["fc2"]  # first and last layers stay in BF16 by default
    assert ours["skipped"] == [False, True, False]
    # The reference: the documented plain-PyTorch loop over the core, with the same arguments.
    stepper = PrecisionStepper("bf16-mixed", fp8="current")
    torch.manual_seed(0)
    model = TinyMLP()
    inject_overflow(model.fc2, {1}, INF)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepper.setup_module(model)
    stepper.setup_optimizers(model, [opt])
    x, y = regression_data(64)
    for step in range(3):
        batch = slice(16 * step, 16 * (step + 1))
        opt.zero_grad()
        with stepper.forward_context():
            out = model(stepper.convert_input(x[batch]))
        stepper.scale_loss(F.mse_loss(out.float(), y[batch])).backward()
        stepper.step(opt)
    assert_same_weights(ours, {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}})
    without_fp8 = train(StablePrecision("bf16-mixed"), 3, poison={1})
    assert not torch.equal(ours["params"]["fc2.weight"], without_fp8["params"]["fc2.weight"])


# ---------------------------------------------------------------------------------------------- conversions
def test_inputs_outputs_and_init_contexts() -> None:
    x = torch.randn(2, 16)
    mixed, true = StablePrecision("bf16-mixed"), StablePrecision("bf16-true")
    assert mixed.convert_input(x).dtype == torch.float32  # autocast casts per op; islands see the FP32 values
    assert true.convert_input(x).dtype == torch.bfloat16
    for plugin in (mixed, true):
        out = plugin.convert_output({"y": x.bfloat16(), "ids": torch.ones(2, dtype=torch.long)})
        assert (out["y"].dtype, out["ids"].dtype) == (torch.float32, torch.long)
    assert StablePrecision("32-true").convert_output(x.bfloat16()).dtype == torch.bfloat16  # as Fabric's Precision()
    # With FP32 masters a model is built in FP32 (the masters start from exact values; setup casts it), without
    # them in the 16-bit dtype, as Fabric's own HalfPrecision does.
    with fabric_of(true).init_module():
        assert nn.Linear(2, 2).weight.dtype == torch.float32
    with fabric_of(StablePrecision("bf16-true", master_weights=False)).init_module():
        assert nn.Linear(2, 2).weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32


# ------------------------------------------------------------------------------------------------ refusals
def test_a_second_model_a_non_optimizer_and_closures_with_scaling_are_refused() -> None:
    fabric = fabric_of(plugin := StablePrecision("16-mixed"))
    fabric.setup(TinyMLP())
    with pytest.raises(RuntimeError, match="second model"):
        fabric.setup(TinyMLP())
    with pytest.raises(TypeError, match="DeepSpeed"):
        plugin.optimizer_step(object())
    model = TinyMLP()
    lbfgs = torch.optim.LBFGS(model.parameters())
    fabric_of(plugin := StablePrecision("16-mixed")).setup(model)
    with pytest.raises(ValueError, match="closure"):
        plugin.optimizer_step(lbfgs, closure=lambda: None)
    with pytest.raises(RuntimeError, match="fabric.setup"):
        StablePrecision("bf16-true").setup_optimizers(lbfgs)


def test_lbfgs_without_scaling_steps_unchecked_said_once() -> None:
    plugin = StablePrecision("bf16-mixed")
    fabric = fabric_of(plugin)
    torch.manual_seed(0)
    net = TinyMLP()
    model, opt = fabric.setup(net, torch.optim.LBFGS(net.parameters(), max_iter=2))
    x, y = regression_data(16)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        fabric.backward(loss)
        return loss

    before = model.fc1.weight.detach().clone()
    with pytest.warns(UserWarning, match="not checked"):
        opt.step(closure)
    assert plugin.step_count == 1 and not torch.equal(before, model.fc1.weight)


# ------------------------------------------------------------------------------------------ torch.compile
def _compiled(how: str) -> nn.Module:
    # aot_eager traces the forward and backward graphs without a C++ toolchain. Fabric unwraps torch.compile's
    # wrapper, converts the module and compiles it again; Module.compile() compiles in place.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyMLP()
    if how == "wrapped":
        return torch.compile(model, backend="aot_eager")
    model.compile(backend="aot_eager")
    return model


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("how", ["wrapped", "in_place"])
def test_compiled_models_train_and_skip(how: str, precision: str) -> None:
    compiled = train(StablePrecision(precision), 3, poison={1}, model=_compiled(how))
    eager = train(StablePrecision(precision), 3, poison={1})
    assert compiled["skipped"] == [False, True, False]
    for name, value in eager["params"].items():
        torch.testing.assert_close(compiled["params"][name], value, rtol=1e-2, atol=1e-3)


def test_compiled_model_with_fp32_islands() -> None:
    train(StablePrecision("bf16-mixed", fp32_modules=["fc3"]), 1, model=_compiled("wrapped"))


# ------------------------------------------------------------------------ clipping a skipped step, masters' gradients
_MODES = [  # (precision, master_weights)
    ("16-mixed", True), ("bf16-mixed", True), ("bf16-true", True), ("16-true", True), ("16-true", False),
    ("bf16-true", False), ("32-true", True),
]


def _setup(precision: str, master_weights: bool | str = True, **kwargs):
    plugin = StablePrecision(precision, master_weights=master_weights, **kwargs)
    fabric = quiet_fabric(plugin)
    torch.manual_seed(0)
    model = TinyMLP()
    eps = 1e-4 if precision == "16-true" and not master_weights else 1e-8  # FP16 state: see the eps tests below
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=eps)
    model, opt = fabric.setup(model, opt)
    return plugin, fabric, model, opt


@pytest.mark.parametrize(("precision", "master_weights"), _MODES)
@pytest.mark.parametrize("clip", ["value", "norm"])
def test_clipping_a_step_that_will_be_skipped_clips_nothing_and_does_not_raise(
    precision: str, master_weights: bool, clip: str
) -> None:
    # Value clipping of a skipped step once raised torch's "Expected !nested_tensorlist[0].empty()" in every mode.
    plugin, fabric, model, opt = _setup(precision, master_weights)
    inject_overflow(model.fc2, {0, 2})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    skipped, norms = [], []
    for step in range(4):
        opt.zero_grad()
        fabric_backward(fabric, model, step)
        if clip == "value":
            assert fabric.clip_gradients(model, opt, clip_val=0.5) is None
        else:
            norms.append(float(fabric.clip_gradients(model, opt, max_norm=0.5)))
        opt.step()
        skipped.append(plugin.last_step_skipped)
        if step == 0:  # the skipped step left the weights as they were
            assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert skipped == [True, False, True, False]
    assert plugin.overflow_count == 2
    if clip == "norm":
        assert norms[0] == norms[2] == 0.0 and norms[1] > 0.0 and norms[3] > 0.0
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())


def _pairs(model: torch.nn.Module, opt) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(model parameter, the parameter its optimizer updates): masters with FP32 master weights."""
    stepped = [p for group in opt.optimizer.param_groups for p in group["params"]]
    params = list(model.parameters())
    assert len(stepped) == len(params)
    return list(zip(params, stepped))


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
@pytest.mark.parametrize("clip", ["value", "norm"])
def test_after_clipping_the_models_gradients_are_those_the_optimizer_applies(precision: str, clip: str) -> None:
    plugin, fabric, model, opt = _setup(precision, True, scaler=None)
    opt.zero_grad()
    fabric_backward(fabric, model, scale=50.0)  # a gradient norm well above the clip
    if clip == "value":
        fabric.clip_gradients(model, opt, clip_val=0.01)
    else:
        norm = fabric.clip_gradients(model, opt, max_norm=0.5)
        assert float(norm) > 1.0
    pairs = _pairs(model, opt)
    assert all(p.dtype != m.dtype for p, m in pairs)  # the optimizer steps FP32 masters
    for param, master in pairs:
        assert param.grad is not None and master.grad is not None
        # What the model shows is what the optimizer applies, rounded to the model's 16 bits.
        assert torch.equal(param.grad, master.grad.to(param.dtype))
    shown = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p, _ in pairs]))
    if clip == "value":
        assert max(float(p.grad.abs().max()) for p, _ in pairs) <= 0.01 * (1 + 2**-7)
    else:
        assert abs(float(shown) - 0.5) < 0.5 * 2**-6
    opt.step()
    assert not plugin.last_step_skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ------------------------------------------------------------------------------ AdamW's eps in 16-true without masters
def _dead_relus(model: torch.nn.Module) -> None:
    """Half of fc1's units never fire: their gradients are exactly 0, so Adam's moments for them stay 0."""
    with torch.no_grad():
        model.fc1.bias[:16] = -1e3


def _fabric_16_true(eps: float, steps: int = 3) -> tuple[StablePrecision, torch.nn.Module]:
    plugin = StablePrecision("16-true", master_weights=False, scaler=None)
    fabric = quiet_fabric(plugin)
    torch.manual_seed(0)
    model = TinyMLP()
    _dead_relus(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps)
    model, opt = fabric.setup(model, opt)
    for step in range(steps):
        opt.zero_grad()
        fabric_backward(fabric, model, step)
        opt.step()
    return plugin, model


def test_16_true_without_masters_refuses_an_eps_that_fp16_flushes_to_zero() -> None:
    # AdamW's default eps=1e-8 is 0 in FP16: 0/0 put NaN in the dead units' weights at the first step, and every
    # later step was skipped (the run stalled silently).
    with pytest.raises(ValueError, match=r"eps=1e-08.*holds as 0\.0.*6\.1e-05.*eps=1e-4.*master_weights=True"):
        _fabric_16_true(1e-8)


def test_16_true_without_masters_refuses_the_eps_at_fabric_setup() -> None:
    # Fabric shows a precision plugin no optimizer at setup: the refusal came at the first clip or step, after a
    # forward and backward, from inside Fabric's strategy. It comes from fabric.setup now, with the same message.
    fabric = quiet_fabric(StablePrecision("16-true", master_weights=False, scaler=None))
    model = TinyMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    refusal = r"eps=1e-08.*holds as 0\.0.*6\.1e-05.*eps=1e-4.*master_weights=True"
    with pytest.raises(ValueError, match=refusal) as caught:
        fabric.setup(model, opt)
    assert caught.traceback[-1].name == "check_eps" and any(e.name == "setup" for e in caught.traceback)
    assert not any(e.name in ("optimizer_step", "clip_gradients") for e in caught.traceback)


def test_16_true_without_masters_refuses_a_subnormal_eps_and_trains_with_the_one_it_advises() -> None:
    # eps=2**-24 (subnormal in FP16) kept NaN out but the dead ReLUs' neighbours took steps of lr * m / eps that
    # overflowed the next forward: steps 1-3 were skipped.
    with pytest.raises(ValueError, match=r"eps=5\.96.*holds as 5\.96"):
        _fabric_16_true(2.0**-24)
    plugin, model = _fabric_16_true(1e-4, steps=4)
    assert plugin.skipped_steps == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model.fc1.weight.dtype == torch.float16


def test_the_trainer_refuses_the_same_eps() -> None:
    from helpers import make_module, make_trainer

    from lit_mpstable import StablePrecision as TrainerStablePrecision

    module = make_module(optimizer="adamw", lr=1e-3)
    _dead_relus(module.model)
    with pytest.raises(ValueError, match=r"eps=1e-08.*holds as 0\.0.*6\.1e-05.*eps=1e-4.*master_weights=True"):
        make_trainer(TrainerStablePrecision("16-true", master_weights=False, scaler=None), max_steps=2).fit(module)


@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
def test_compact_weights_in_16_true_refuse_the_same_eps_and_train_with_the_one_advised(mode: str) -> None:
    # Their Adam state is FP16 too: with eps=1e-8 (0 in FP16) the loss went 0.7 -> 188 at step 2 and 6 of 8 steps were
    # skipped, where master_weights=False was refused; refused alike now.
    from helpers import make_module, make_trainer

    from lit_mpstable import StablePrecision as TrainerStablePrecision

    with pytest.raises(ValueError, match=rf"master_weights='{mode}'.*eps=1e-08.*holds as 0\.0.*eps=1e-4"):
        make_trainer(TrainerStablePrecision("16-true", master_weights=mode), max_steps=2).fit(
            make_module(optimizer="adamw", lr=1e-3))
    plugin = StablePrecision("16-true", master_weights=mode)
    fabric = quiet_fabric(plugin)
    model = TinyMLP()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4))
    for step in range(4):
        fabric_backward(fabric, model, step)
        opt.step()
        opt.zero_grad()
    assert plugin.skipped_steps == 0 and all(torch.isfinite(p).all() for p in model.parameters())


# ----------------------------------------------------------- clipping compact weights; clipping before fabric.backward
def _compact_run(mode: str, clip: str, *, ours: bool, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    """16-true with compact weights and the dynamic scaler: clipped by fabric.clip_gradients (``ours``) or by the
    stepper's own compact-aware clipping (the Trainer's path: the clip folds into the step's FP32 unscale)."""
    plugin = StablePrecision("16-true", master_weights=mode, scaler="dynamic")
    fabric = quiet_fabric(plugin)
    torch.manual_seed(0)
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = fabric.setup(model, opt)
    plugin.setup_optimizers(opt)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        fabric_backward(fabric, model, step)
        if ours:
            out = fabric.clip_gradients(model, opt, **({"max_norm": 0.05} if clip == "norm" else {"clip_val": 2e-3}))
        elif clip == "norm":
            out = plugin.stepper.clip_grad_norm_(opt.optimizer, 0.05)
        else:
            out = plugin.stepper.clip_grad_value_(opt.optimizer, 2e-3)
        if out is not None:
            norms.append(float(out))
        opt.step()
        assert not plugin.last_step_skipped
    return norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
@pytest.mark.parametrize("clip", ["norm", "value"])
def test_fabric_clips_compact_weights_true_gradients_not_the_scaled_ones(mode: str, clip: str) -> None:
    # Compact weights keep FP16 gradients scaled (x65536) until the step: fabric.clip_gradients clipped those,
    # returning norms 65536x too large and clipping to 1/65536 of the limit.
    norms, weights = _compact_run(mode, clip, ours=True)
    ref_norms, ref_weights = _compact_run(mode, clip, ours=False)
    assert norms == pytest.approx(ref_norms, rel=1e-3)
    if clip == "norm":
        assert all(n > 0.05 for n in norms)  # the clip acted
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, atol=2e-3, rtol=0), name


def test_clipping_before_fabric_backward_names_the_call_order() -> None:
    plugin, fabric, model, opt = _setup("16-mixed")
    for param in model.parameters():  # gradients from elsewhere: no fabric.backward, no loss was scaled
        param.grad = torch.ones_like(param)
    with pytest.raises(RuntimeError, match=r"before any loss was scaled.*fabric\.backward\(loss\)"):
        fabric.clip_gradients(model, opt, max_norm=1.0)


# ---------------------------------------------------------------------- the fingerprint of several optimizers
class _GAN(nn.Module):
    """A generator and a discriminator in one module, each with its own optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
        self.D = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor, part: str) -> torch.Tensor:
        return self.D(self.G(x)) if part == "GD" else getattr(self, part)(x)


def _gan(precision: str, bind: str, **kwargs: Any) -> tuple[StablePrecision, Fabric, dict[str, Any]]:
    """The GAN set up with Adam for each half; ``bind``: the optimizers given to ``setup_optimizers``, in that order
    ("" leaves the plugin to bind them at their first step: D's first). Returns the state ``fabric.save`` takes."""
    plugin = StablePrecision(precision, **kwargs)
    fabric = fabric_of(plugin)
    torch.manual_seed(0)
    gan = _GAN()
    model, opt_g, opt_d = fabric.setup(gan, torch.optim.Adam(gan.G.parameters(), lr=1e-3),
                                       torch.optim.Adam(gan.D.parameters(), lr=1e-3))
    state = {"model": model, "opt_g": opt_g, "opt_d": opt_d, "precision": plugin}
    if bind:
        plugin.setup_optimizers(*(state[f"opt_{half}"] for half in bind.split(",")))
    return plugin, fabric, state


def _gan_steps(fabric: Fabric, state: dict[str, Any], steps: int) -> None:
    model, opt_g, opt_d = state["model"], state["opt_g"], state["opt_d"]
    g = torch.Generator().manual_seed(len(state["opt_d"].state))
    for _ in range(steps):
        real, z = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        fake = model(z, "G").detach()
        fabric.backward(F.softplus(-model(real, "D")).mean() + F.softplus(model(fake, "D")).mean())
        opt_d.step()
        opt_d.zero_grad()
        fabric.backward(F.softplus(-model(z, "GD")).mean())
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()


@pytest.mark.parametrize(("precision", "saved", "loaded"), [
    ("32-true", "", "g,d"), ("32-true", "g,d", "d,g"), ("32-true", "", ""), ("bf16-true", "g,d", "d,g")])
def test_two_optimizers_resume_whatever_order_they_are_bound_in(tmp_path, precision, saved, loaded) -> None:
    # The fingerprint names each optimizer by its first parameter, not by the order the plugin bound them in; one not
    # bound yet when the check runs (at D's first step, without setup_optimizers) is not called missing.
    plugin, fabric, state = _gan(precision, saved)
    _gan_steps(fabric, state, 2)
    fabric.save(tmp_path / "gan.pt", state)
    plugin, fabric, state = _gan(precision, loaded)
    fabric.load(tmp_path / "gan.pt", state)
    _gan_steps(fabric, state, 1)
    assert [event["action"] for event in plugin.fingerprint.events] == ["passed", "passed"]
    assert {path.split("]")[0] for path in plugin.state_dict()[FINGERPRINT]["checksums"]
            if path.startswith("optimizer")} == {"optimizer['G.0.weight'", "optimizer['D.0.weight'"}


def test_a_checkpoint_that_names_optimizers_by_binding_order_is_still_checked(tmp_path) -> None:
    # The previous release's fingerprint wrote optimizer[0], optimizer[1] (binding order): compared as written.
    plugin, fabric, state = _gan("32-true", "g,d")
    _gan_steps(fabric, state, 2)
    fabric.save(tmp_path / "gan.pt", state)
    checkpoint = torch.load(tmp_path / "gan.pt", weights_only=True)
    sums = checkpoint["precision"][FINGERPRINT]["checksums"]
    for index, name in enumerate(("optimizer['G.0.weight']", "optimizer['D.0.weight']")):
        for path in [p for p in sums if p.startswith(name)]:
            sums[f"optimizer[{index}]{path.removeprefix(name)}"] = sums.pop(path)
    torch.save(checkpoint, tmp_path / "gan.pt")
    plugin, fabric, state = _gan("32-true", "g,d")
    fabric.load(tmp_path / "gan.pt", state)
    _gan_steps(fabric, state, 1)
    assert [event["action"] for event in plugin.fingerprint.events] == ["passed", "passed"]
    checkpoint["opt_d"]["state"][0]["exp_avg"].view(-1)[0] += 1.0
    torch.save(checkpoint, tmp_path / "gan.pt")
    plugin, fabric, state = _gan("32-true", "g,d")
    fabric.load(tmp_path / "gan.pt", state)
    with pytest.raises(FingerprintMismatch, match=r"optimizer state `optimizer\[1\]\['state'\]\[0\]\['exp_avg'\]`"):
        _gan_steps(fabric, state, 1)


def test_state_loaded_before_the_masters_are_bound_is_named_as_the_likely_cause(tmp_path) -> None:
    # fabric.load before setup_optimizers rounds Adam's state to BF16 (the model's dtype): the file is intact, and the
    # mismatch says what to change first, not only what the numbers look like.
    def setup(bind: bool) -> tuple[Fabric, dict[str, Any]]:
        plugin = StablePrecision("bf16-true")
        fabric = fabric_of(plugin)
        torch.manual_seed(0)
        model = TinyMLP()
        model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        if bind:
            plugin.setup_optimizers(opt)
        return fabric, {"model": model, "optimizer": opt, "precision": plugin}

    fabric, state = setup(bind=True)
    for step in range(2):
        fabric_backward(fabric, state["model"], step)
        state["optimizer"].step()
    fabric.save(tmp_path / "ckpt.pt", state)
    fabric, state = setup(bind=False)
    fabric.load(tmp_path / "ckpt.pt", state)
    fabric_backward(fabric, state["model"], 2)
    with pytest.warns(UserWarning, match="before its FP32 master weights were bound"), pytest.raises(
            FingerprintMismatch, match=r"fingerprint: the optimizer state was loaded before its FP32 master weights"
                                       r" were bound.*plugin\.setup_optimizers.*round-tripped through BF16"):
        state["optimizer"].step()


def test_two_optimizers_loaded_before_their_masters_are_bound_name_the_missing_call(tmp_path) -> None:
    # FP32 masters saved for G and D; resumed without setup_optimizers, D's first step binds D alone, and the masters
    # loaded for G have no optimizer yet: that is the load order, not a file "from a different model".
    plugin, fabric, state = _gan("bf16-true", "g,d")
    _gan_steps(fabric, state, 2)
    fabric.save(tmp_path / "gan.pt", state)
    plugin, fabric, state = _gan("bf16-true", "")
    fabric.load(tmp_path / "gan.pt", state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the rounded-state warning: tested above
        with pytest.raises(RuntimeError, match=r"fabric\.load ran before.*plugin\.setup_optimizers\(\*optimizers\)"
                                               r" with every optimizer, after fabric\.setup and before fabric\.load"):
            _gan_steps(fabric, state, 1)


def _saved_run(directory: Any, prefix: str, steps: int, rows: slice) -> list[Any]:
    """``prefix-step=N.pt`` for N in 1..steps: a 32-true AdamW loop on TinyMLP that pins the batch ``rows`` (which
    rows a run pins is what tells runs apart)."""
    plugin = StablePrecision("32-true")
    fabric = fabric_of(plugin)
    torch.manual_seed(0)
    model = TinyMLP()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    plugin.setup_optimizers(opt)
    x, y = regression_data(64)
    plugin.pin(lambda module, batch: F.mse_loss(module(batch[0]), batch[1]), (x[rows], y[rows]))
    paths = []
    for step in range(1, steps + 1):
        fabric_backward(fabric, model, step)
        opt.step()
        opt.zero_grad()
        paths.append(directory / f"{prefix}-step={step}.pt")
        fabric.save(paths[-1], {"model": model, "optimizer": opt, "precision": plugin})
    return paths


@pytest.mark.parametrize(("failing", "removed", "outcome"), [
    ("b-step=1.pt", None, r"among 3 .*written at step 3, not before the loaded checkpoint's 1"),
    ("b-step=2.pt", "b-step=1.pt", r"among 3 .*step 2, not before .*; it pinned another micro-batch than the failed"),
    ("b-step=2.pt", None, "b-step=1.pt"),
], ids=["later-step", "other-run", "same-run"])
def test_plugin_load_previous_keeps_to_earlier_steps_of_the_same_run(tmp_path, failing, removed, outcome) -> None:
    # Run B (another pinned micro-batch) saves into run A's directory after it: A's files are earlier by modification
    # time, but A's steps 2-3 are later than B's and A's step 1 is another run's.
    paths = _saved_run(tmp_path, "a", 3, slice(0, 4)) + _saved_run(tmp_path, "b", 2, slice(4, 8))
    for order, path in enumerate(paths):
        os.utime(path, ns=(1_000_000_000 * (order + 1),) * 2)
    checkpoint = torch.load(tmp_path / failing, weights_only=True)
    checkpoint["model"]["fc1.weight"][3].mul_(2)
    torch.save(checkpoint, tmp_path / failing)
    os.utime(tmp_path / failing, ns=(paths.index(tmp_path / failing) * 1_000_000_000 + 1_000_000_000,) * 2)
    if removed:
        (tmp_path / removed).unlink()
    plugin = StablePrecision("32-true", on_fingerprint_mismatch="previous")
    fabric = fabric_of(plugin)
    model = TinyMLP()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    plugin.setup_optimizers(opt)
    state = {"model": model, "optimizer": opt, "precision": plugin}
    if outcome.endswith(".pt"):
        with pytest.warns(UserWarning, match=rf"{failing} fails its numeric fingerprint .* loaded .*{outcome} instead"):
            plugin.load(fabric, tmp_path / failing, state, restored_window=0)
        assert plugin.step_count == 1
        return
    with pytest.raises(FingerprintMismatch, match=rf"'previous': no earlier checkpoint passes {outcome}"):
        plugin.load(fabric, tmp_path / failing, state, restored_window=0)


def _ao8_loop(precision: str, *, bind: bool = True) -> tuple[StablePrecision, Fabric, dict[str, Any]]:
    """A 16-64-16 MLP (fc2's 4096-element weight: 8-bit states) with torchao's AdamW8bit, set up for a resume
    (``bind``: ``plugin.setup_optimizers`` called)."""
    from torchao.optim import AdamW8bit

    plugin = StablePrecision(precision)
    fabric = fabric_of(plugin)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
    model, optimizer = fabric.setup(net, AdamW8bit(net.parameters(), lr=1e-3))
    if bind:
        plugin.setup_optimizers(optimizer)
    return plugin, fabric, {"model": model, "optimizer": optimizer, "precision": plugin}


def _ao8_steps(fabric: Fabric, state: dict[str, Any], steps: range) -> None:
    x, y = regression_data(64)
    for step in steps:
        batch = slice(16 * (step % 4), 16 * (step % 4 + 1))
        fabric.backward(F.mse_loss(state["model"](x[batch]).float(), y[batch]))
        state["optimizer"].step()
        state["optimizer"].zero_grad()


@pytest.mark.slow  # torchao compiles its step: seconds on the CPU
@pytest.mark.parametrize("load", ["fabric.load", "plugin.load"])
@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_torchao_8bit_states_resume_exactly_from_fabric_save(tmp_path, precision: str, load: str) -> None:
    # Lightning loads with a callable map_location, which torch.load refuses for torchao's tensor-subclass states
    # ("Callable map_location not supported with _rebuild_wrapper_subclass"): the run could save, never resume.
    pytest.importorskip("torchao.optim")
    _, fabric, state = _ao8_loop(precision)
    _ao8_steps(fabric, state, range(3))
    fabric.save(tmp_path / "ao8.ckpt", state)
    _ao8_steps(fabric, state, range(3, 6))
    kinds = {type(v).__name__ for s in state["optimizer"].state.values() for v in s.values()}
    assert "OptimState8bit" in kinds and "dict" not in kinds  # the save left the running states alone
    plugin, fabric, resumed = _ao8_loop(precision)
    if load == "fabric.load":
        fabric.load(tmp_path / "ao8.ckpt", resumed)
    else:
        plugin.load(fabric, tmp_path / "ao8.ckpt", resumed)
    _ao8_steps(fabric, resumed, range(3, 6))
    for a, b in zip(state["model"].parameters(), resumed["model"].parameters(), strict=True):
        assert torch.equal(a, b)
    actions = [event["action"] for event in plugin.fingerprint.events]
    assert actions and set(actions) == {"passed"}  # the flat states checksummed at the save are those loaded


@pytest.mark.slow  # torchao compiles its step: seconds on the CPU
def test_torchao_8bit_states_loaded_before_setup_optimizers_are_refused_by_name(tmp_path) -> None:
    # Loaded before the plugin sets the optimizer up, the flat states reach load_state_dict unrebuilt, which casts
    # their integer codes to the parameters' dtype: the first step refuses them and names the call order.
    pytest.importorskip("torchao.optim")
    _, fabric, state = _ao8_loop("bf16-mixed")
    _ao8_steps(fabric, state, range(2))
    fabric.save(tmp_path / "ao8.ckpt", state)
    _, fabric, resumed = _ao8_loop("bf16-mixed", bind=False)
    fabric.load(tmp_path / "ao8.ckpt", resumed)
    with pytest.raises(RuntimeError, match=r"Call plugin.setup_optimizers\(optimizer\) after fabric.setup, before"):
        _ao8_steps(fabric, resumed, range(2, 3))

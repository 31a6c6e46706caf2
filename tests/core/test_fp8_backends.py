"""The FP8 backend seam: native, torchao (for real on the CPU and wired with a mock) and TransformerEngine (a
stand-in); the same numbers as torchao for the current recipe and as TE's DelayedScaling formulas for delayed.

The bound against torchao (current recipe, per-tensor scales). Both libraries compute the scale as the correctly
rounded fp32 quotient ``fp8_max / amax`` and cast ``x * scale`` (fp32) with saturation, so the FP8 bytes and scales
are identical (checked bit for bit). What differs is the dequantisation of the emulated GEMM: ours multiplies by the
inverse scale, as ``torch._scaled_mm`` takes it (two roundings: the reciprocal, the product), torchao divides by the
scale (one rounding); and the fp32 products may be accumulated in another order (other layouts). With u = 2**-24
and A the exact dequantised operand, ours is within (1 + u)**2 - 1 of A per element, torchao within u, so for a
K-term dot product, Higham's gamma_K = K u / (1 - K u) per accumulation:

    |ours - torchao| <= (e_o + e_t + gamma_K (2 + e_o + e_t)) * (|A| @ |B|),  e_o = (1 + u)**4 - 1, e_t = (1 + u)**2 - 1

plus, for the forward, the bias addition's rounding on each side (u times each output). Measured, the difference is
~1e-7 relative (in norm): a few u, since random rounding errors do not add up to the worst case.
"""

from __future__ import annotations

import copy
import io
import sys
import types
import warnings

import pytest
import torch
from fp8_stand_ins import install_transformer_engine
from helpers import TinyMLP
from torch import nn

import lit_mpstable.fp8.backend as backend_module
from lit_mpstable.fp8 import (
    BACKENDS,
    FP8Config,
    FP8Linear,
    convert_from_fp8,
    convert_to_fp8,
    fp8_backend,
    fp8_state_dict,
    fp8_stats,
    load_fp8_state_dict,
)
from lit_mpstable.fp8.backends import backend_of, find_fp8_layers, fp8_autocast_context
from lit_mpstable.fp8.config import AmaxComputeAlgo, FP8BackendName, FP8Format, FP8Recipe
from lit_mpstable.fp8.quant import compute_scale
from lit_mpstable.fp8.swap import collect_fp8_stats_
from lit_mpstable.fp8.te_backend import TransformerEngineBackend
from lit_mpstable.fp8.torchao_backend import TorchaoBackend

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
U = 2.0**-24  # fp32 unit roundoff
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}  # OCP FP8 spec, written out by hand


def never_zero(*shape: int, low: float = -6.0, high: float = 1.0) -> torch.Tensor:
    magnitude = torch.empty(shape).uniform_(low, high).exp()
    return (torch.randint(0, 2, shape) * 2 - 1) * magnitude


def _grad(t: torch.Tensor) -> torch.Tensor:
    assert t.grad is not None, "no gradient reached this tensor"
    return t.grad


@pytest.fixture
def te(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    return install_transformer_engine(monkeypatch)


def _config(name: FP8BackendName) -> FP8Config:
    if name == "torchao":
        pytest.importorskip("torchao.float8")
        return FP8Config(recipe="current", backend="torchao", emulate=True)
    return FP8Config(recipe="delayed", backend=name, amax_history_len=4)


# ------------------------------------------------------------------------------------------- the seam itself
@pytest.mark.parametrize("name", list(BACKENDS))
def test_every_backend_swaps_in_and_out_on_the_same_parameters_and_hooks(name: FP8BackendName, monkeypatch) -> None:
    if name == "transformer_engine":
        install_transformer_engine(monkeypatch)
    backend = fp8_backend(_config(name))
    model = TinyMLP()
    weight, bias = model.fc2.weight, model.fc2.bias
    calls = []
    model.fc2.register_forward_hook(lambda *args: calls.append(1))
    backend.convert_(model, ["fc2"])
    assert backend.is_fp8_layer(model.fc2) and not backend.is_fp8_layer(model.fc1)
    assert backend_of(model.fc2) is type(backend) and backend_of(model.fc1) is None
    assert model.fc2.weight is weight and model.fc2.bias is bias  # optimizers stay bound
    assert find_fp8_layers(model) == {"fc2": type(backend)}
    with backend.forward_context():
        model(torch.randn(16, 16)).sum().backward()
    assert weight.grad is not None and calls == [1]
    backend.revert_(model, ["fc2"])
    assert type(model.fc2) is nn.Linear and model.fc2.weight is weight and model.fc2.bias is bias
    model(torch.randn(16, 16))
    assert calls == [1, 1] and find_fp8_layers(model) == {}


def test_model_level_helpers_reach_every_backends_layers(te) -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    fp8_backend(FP8Config(recipe="delayed", amax_history_len=4)).convert_(model, ["1"])
    fp8_backend(FP8Config(recipe="delayed", backend="transformer_engine")).convert_(model, ["2"])
    layers = find_fp8_layers(model)
    assert {name: cls.name for name, cls in layers.items()} == {"1": "native", "2": "transformer_engine"}
    with fp8_autocast_context(FP8Config(backend="transformer_engine")):
        model(torch.randn(16, 16)).sum().backward()
    state = fp8_state_dict(model)
    assert set(state) == {"1.amax_history", "1.scale", "2.extra_state"}
    load_fp8_state_dict(model, state)
    with pytest.raises(KeyError, match="2.extra_state"):
        load_fp8_state_dict(model, {k: v for k, v in state.items() if k != "2.extra_state"})
    assert sorted(convert_from_fp8(model)) == ["1", "2"] and find_fp8_layers(model) == {}


def test_backends_without_telemetry_say_so_once(te, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend_module, "_WARNED", set())
    model = TinyMLP()
    convert_to_fp8(model, FP8Config(recipe="delayed", backend="transformer_engine"))
    with pytest.warns(RuntimeWarning, match="'transformer_engine' records no saturation/underflow statistics"):
        collect_fp8_stats_(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        collect_fp8_stats_(model)  # once per backend
    assert fp8_stats(model) == {}


# ---------------------------------------------------------------------------------------- TransformerEngine
def test_transformer_engine_layer_is_built_like_the_linear(te) -> None:
    model = TinyMLP().to(torch.bfloat16)
    assert convert_to_fp8(model, FP8Config(backend="transformer_engine")) == ["fc2"]
    assert te.linear == [(32, 32, True, torch.bfloat16, torch.device("cpu"))]
    no_bias = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32, bias=False), nn.Linear(32, 16))
    convert_to_fp8(no_bias, FP8Config(backend="transformer_engine"))
    assert te.linear[-1][2] is False and convert_from_fp8(no_bias) == ["1"] and no_bias[1].bias is None


@pytest.mark.parametrize(
    ("config", "recipe", "kwargs"),
    [
        (
            FP8Config(margin=2, amax_history_len=16, amax_compute_algo="most_recent", backend="transformer_engine"),
            "DelayedScaling",
            dict(margin=2, fp8_format="HYBRID", amax_history_len=16, amax_compute_algo="most_recent"),
        ),
        (
            FP8Config(recipe="current", format="e4m3", backend="transformer_engine"),
            "Float8CurrentScaling",
            dict(fp8_format="E4M3"),
        ),
        (FP8Config(recipe="mxfp8", backend="transformer_engine"), "MXFP8BlockScaling", dict(fp8_format="HYBRID")),
    ],
)
@pytest.mark.parametrize(("api", "recipe_kwarg"), [("fp8_autocast", "fp8_recipe"), ("autocast", "recipe")])
def test_transformer_engine_autocast_gets_the_recipe(monkeypatch, config, recipe, kwargs, api, recipe_kwarg) -> None:
    calls = install_transformer_engine(monkeypatch, api=api)  # TE 1.x has fp8_autocast, TE 2.x autocast
    backend = fp8_backend(config)
    assert isinstance(backend, TransformerEngineBackend)
    for _ in range(2):
        with backend.forward_context():
            pass
    assert len(calls.autocast) == 2
    for call in calls.autocast:
        assert call["enabled"] is True and call[recipe_kwarg] is backend.recipe  # built once, passed every time
    assert type(backend.recipe).__name__ == recipe and backend.recipe.kwargs == kwargs


def test_transformer_engine_state_stays_out_of_the_model_state_dict(te) -> None:
    model = TinyMLP()
    convert_to_fp8(model, FP8Config(backend="transformer_engine"))
    with fp8_autocast_context(FP8Config(backend="transformer_engine")):
        model(torch.randn(8, 16))
    history = model.fc2.amax_history
    assert isinstance(history, torch.Tensor)  # the stand-in TE layer keeps it as a plain attribute
    history = history.clone()
    saved = fp8_state_dict(model)["fc2.extra_state"]
    assert history.any() and saved.dtype == torch.uint8 and saved.numel() > 0
    weights = model.state_dict()
    assert set(weights) == set(TinyMLP().state_dict())  # no "_extra_state": a plain model loads it strictly
    TinyMLP().load_state_dict(weights)
    model.fc2.amax_history = torch.zeros(4)
    model.load_state_dict(weights)  # strict, without TE's extra state: TE's FP8 state is left alone
    assert not model.fc2.amax_history.any()
    model.load_state_dict({**weights, "fc2._extra_state": saved})  # a checkpoint written by TE itself
    assert torch.equal(model.fc2.amax_history, history)


def test_missing_recipe_or_emulation_is_refused_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    install_transformer_engine(monkeypatch, recipes=("DelayedScaling",))
    with pytest.raises(ValueError, match=r"recipe.MXFP8BlockScaling"):
        fp8_backend(FP8Config(recipe="mxfp8", backend="transformer_engine"))
    with pytest.raises(ValueError, match="emulation"):
        FP8Config(backend="transformer_engine", emulate=True)


# ------------------------------------------------------------------------------------------- missing packages
@pytest.mark.parametrize(
    ("backend", "recipe", "pip"),
    [
        ("transformer_engine", "delayed", 'pip install "transformer-engine[pytorch]"'),
        ("torchao", "current", "pip install torchao"),
        ("torchao", "mxfp8", "pip install torchao"),
    ],
)
def test_missing_backend_names_the_pip_line(
    monkeypatch: pytest.MonkeyPatch, backend: FP8BackendName, recipe: FP8Recipe, pip: str
) -> None:
    for name in (backend, f"{backend}.pytorch", f"{backend}.float8"):
        monkeypatch.setitem(sys.modules, name, None)
    fmt: FP8Format = "e4m3" if recipe == "mxfp8" else "hybrid"
    with pytest.raises(ModuleNotFoundError, match=pip.replace("[", r"\[").replace("]", r"\]")):
        fp8_backend(FP8Config(recipe=recipe, backend=backend, format=fmt))


# ----------------------------------------------------------------------------------------------------- torchao
def fake_module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def test_torchao_wiring(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    class Float8LinearConfig:
        def __init__(self, **kwargs) -> None:
            self.kwargs = kwargs

    def convert_to_float8_training(module, *, module_filter_fn, config):
        calls.append((module, module_filter_fn, config))

    float8 = fake_module(
        "torchao.float8", Float8LinearConfig=Float8LinearConfig, CastConfig=lambda **kw: kw,
        convert_to_float8_training=convert_to_float8_training,
    )  # fmt: skip
    monkeypatch.setitem(sys.modules, "torchao", fake_module("torchao", float8=float8))
    monkeypatch.setitem(sys.modules, "torchao.float8", float8)
    model = TinyMLP()
    # conformance="off": the stand-in converts nothing, and the check's probe layer would be one more call here.
    config = FP8Config(recipe="current", format="e4m3", backend="torchao", emulate=True, conformance="off")
    assert convert_to_fp8(model, config) == ["fc2"]
    ((module, module_filter_fn, config),) = calls
    assert module is model
    assert [name for name, m in model.named_modules() if module_filter_fn(m, name)] == ["fc2"]
    assert config.kwargs == {"emulate": True, "cast_config_grad_output": {"target_dtype": E4M3}}


def test_torchao_mx_without_its_config_class_is_refused_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchao")
    monkeypatch.setitem(sys.modules, "torchao.prototype.moe_training.config", None)
    with pytest.raises(ValueError, match="no MXFP8 training config"):
        fp8_backend(FP8Config(recipe="mxfp8", backend="torchao", format="e4m3"))


def test_torchao_real_run_on_cpu() -> None:
    pytest.importorskip("torchao.float8")
    model = TinyMLP(32, 32, 32)
    reference = copy.deepcopy(model)
    convert_to_fp8(model, FP8Config(recipe="current", backend="torchao"))
    assert type(model.fc2).__name__ == "Float8Linear"
    x = torch.randn(16, 32)
    y = model(x)
    y.square().sum().backward()
    assert model.fc2.weight.grad is not None and model.fc2.bias.grad is not None
    torch.testing.assert_close(y, reference(x), rtol=0.1, atol=0.05)


def test_torchao_mxfp8_keeps_the_parameters_an_optimizer_holds() -> None:
    pytest.importorskip("torchao.prototype.moe_training.config")
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32, bias=False), nn.Linear(32, 32))
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    x = torch.randn(32, 32)

    def step() -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    step()
    backend = fp8_backend(FP8Config(recipe="mxfp8", backend="torchao", format="e4m3"))
    backend.convert_(model, ["1"])
    assert backend.is_fp8_layer(model[1]) and type(model[1]) is nn.Linear  # torchao wraps the weight, not the layer
    assert all(a is b for a, b in zip(model.parameters(), params))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)  # plain tensors: a checkpoint loads safely, into a plain model too
    buffer.seek(0)
    nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32, bias=False), nn.Linear(32, 32)).load_state_dict(
        torch.load(buffer, weights_only=True)
    )
    before = model[1].weight.detach().clone()
    step()  # the optimizer built before the swap still updates the layer that computes
    assert not torch.equal(model[1].weight.detach(), before)
    backend.revert_(model, ["1"])
    assert not backend.is_fp8_layer(model[1]) and all(a is b for a, b in zip(model.parameters(), params))
    assert type(model[1].weight) is nn.Parameter and type(model[1].weight.data) is torch.Tensor
    step()


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_torchao_mxfp8_emulated_under_autocast_is_refused_naming_what_runs(autocast_dtype: torch.dtype) -> None:
    """torchao's MXFP8 linear runs above autocast, so a 16-bit activation meets the FP32 weight, and its emulated
    matmul (any device but a Blackwell GPU) multiplies operands of two dtypes: torch's own error, from inside
    torchao, at the first forward of a ``*-mixed`` run. The layer refuses before torchao's code runs."""
    pytest.importorskip("torchao.prototype.moe_training.config")
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32, bias=False))
    convert_to_fp8(model, FP8Config(recipe="mxfp8", backend="torchao", format="e4m3", filter=["1"]))
    x = torch.randn(32, 32)
    with torch.autocast("cpu", dtype=autocast_dtype):
        with pytest.raises(RuntimeError, match=r"backend='torchao'.*'1'.*backend='native'") as refused:
            model(x)
    assert str(autocast_dtype) in str(refused.value)
    model(x).square().mean().backward()  # one dtype (32-true, or *-true): torchao's emulation runs
    assert model[1].weight.grad is not None


def test_torchao_mxfp8_refuses_rows_its_weight_gradient_cannot_block() -> None:
    """torchao casts the weight gradient's operands in 32-row blocks along the tokens and does not pad: an assertion
    from inside its backward, on a batch of 16. The layer refuses at the forward that would need it."""
    pytest.importorskip("torchao.prototype.moe_training.config")
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32, bias=False))
    convert_to_fp8(model, FP8Config(recipe="mxfp8", backend="torchao", format="e4m3", filter=["1"]))
    with pytest.raises(RuntimeError, match=r"'1' gets a torch.float32 input of 16 rows.*32-row multiples"):
        model(torch.randn(16, 32))
    with torch.no_grad():
        assert model(torch.randn(16, 32)).shape == (16, 32)  # no weight gradient: any rows
    model(torch.randn(2, 16, 32)).square().mean().backward()


def test_torchao_mxfp8_refuses_a_layer_with_a_bias_it_would_leave_out() -> None:
    """torchao 0.18's MXFP8 linear multiplies input and weight and returns that: the bias is neither added nor given
    a gradient, silently. The conversion refuses such a layer, naming it."""
    pytest.importorskip("torchao.prototype.moe_training.config")
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32, bias=False))
    params = list(model.parameters())
    with pytest.raises(ValueError, match=r"\['1'\] have a bias.*backend='native'"):
        convert_to_fp8(model, FP8Config(recipe="mxfp8", backend="torchao", format="e4m3", filter=["1", "2"]))
    assert all(type(p) is nn.Parameter for p in params)  # refused before torchao wrapped anything
    convert_to_fp8(model, FP8Config(recipe="mxfp8", backend="torchao", format="e4m3", filter=["2"]))
    assert TorchaoBackend.is_fp8_layer(model[2])


# ---------------------------------------------------------------------------- the same numbers as torchao
def _exact_operand(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The FP8 operand both libraries use, dequantised exactly (float64): the correctly rounded fp32 scale
    ``fp8_max / amax``, the fp32 product cast with saturation."""
    scale = torch.tensor(FP8_MAX[dtype] / t.abs().max().item(), dtype=torch.float32)
    data = (t.float() * scale).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return data.double() / scale.double()


def _bound(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    k = a.shape[1]
    gamma = k * U / (1 - k * U)
    e_ours, e_torchao = (1 + U) ** 4 - 1, (1 + U) ** 2 - 1
    return (e_ours + e_torchao + gamma * (2 + e_ours + e_torchao)) * (a.abs() @ b_t.abs().T)


@pytest.mark.parametrize("emulate", [True, None])  # None: torch._scaled_mm where the CPU build runs it
@pytest.mark.parametrize("grad_format", ["hybrid", "e4m3"])  # e4m3: another recipe than torchao's, the control
def test_current_recipe_matches_torchao_within_the_dequantisation_rounding(emulate, grad_format) -> None:
    float8 = pytest.importorskip("torchao.float8")
    from torchao.float8.float8_utils import tensor_to_scale

    linear = nn.Linear(64, 32)
    config = FP8Config(recipe="current", format=grad_format, emulate=emulate)
    ours = FP8Linear.from_linear(copy.deepcopy(linear), config)
    root = nn.Sequential(copy.deepcopy(linear))
    float8.convert_to_float8_training(root, config=float8.Float8LinearConfig(emulate=True))
    x, grad_out = never_zero(48, 64), never_zero(48, 32, low=-4, high=2)
    results = []
    for layer in (ours, root[0]):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(grad_out)
        weight, bias = layer.weight, layer.bias
        assert isinstance(weight, torch.Tensor) and isinstance(bias, torch.Tensor)  # both layers have a bias
        grads = [_grad(t).double() for t in (xi, weight, bias)]
        results.append((y.detach().double(), *grads))
    (y_o, gx_o, gw_o, gb_o), (y_t, gx_t, gw_t, gb_t) = results
    for t, dtype in ((x, E4M3), (linear.weight.detach(), E4M3), (grad_out, E5M2)):
        assert torch.equal(compute_scale(t.abs().max(), dtype), tensor_to_scale(t, dtype))  # same scales, bitwise
    xa, wa, ga = _exact_operand(x, E4M3), _exact_operand(linear.weight.detach(), E4M3), _exact_operand(grad_out, E5M2)
    assert (y_o - y_t).abs().le(_bound(xa, wa) + U * (y_o.abs() + y_t.abs())).all()
    same_recipe = grad_format == "hybrid"
    assert bool((gw_o - gw_t).abs().le(_bound(ga.T, xa.T)).all()) is same_recipe
    assert bool((gx_o - gx_t).abs().le(_bound(ga, wa.T)).all()) is same_recipe
    gamma = 48 * U / (1 - 48 * U)
    assert (gb_o - gb_t).abs().le(2 * gamma * grad_out.double().abs().sum(0)).all()
    assert not torch.equal(y_o, y_t) or not torch.equal(gw_o, gw_t)  # something rounded: the bound is exercised


def test_scales_are_correctly_rounded_like_torchaos() -> None:
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_utils import amax_to_scale

    amax = torch.empty(20000).uniform_(-30, 30).exp2() * torch.rand(20000)
    for dtype in (E4M3, E5M2):
        exact = (FP8_MAX[dtype] / amax.double()).float()  # one rounding of the float64 quotient
        assert torch.equal(compute_scale(amax, dtype), exact)
        assert torch.equal(compute_scale(amax, dtype), amax_to_scale(amax, dtype))


# ------------------------------------------------------------------------ delayed: TransformerEngine's formulas
class TEDelayedScaling:
    """TE's DelayedScaling update, written from its documentation and update code, in float64 with TE's layout: the
    history is (len, tensors) with the current amax written into row 0 by the cast; at the update,
    ``amax = max over rows`` (or row 0 for "most_recent"), ``scale = (fp8_max / amax) / 2**margin`` where amax is
    positive and finite (else the old scale), then the history rolls by -1 and row 0 is zeroed."""

    def __init__(self, fp8_max: list[float], length: int, margin: int, algo: str) -> None:
        self.fp8_max, self.margin, self.algo = fp8_max, margin, algo
        self.history = [[0.0] * len(fp8_max) for _ in range(length)]
        self.scale = [1.0] * len(fp8_max)

    def record(self, index: int, amax: float) -> None:
        self.history[0][index] = amax

    def update(self) -> None:
        for i, fp8_max in enumerate(self.fp8_max):
            amax = max(row[i] for row in self.history) if self.algo == "max" else self.history[0][i]
            if amax > 0 and amax != float("inf"):
                self.scale[i] = (fp8_max / amax) / 2**self.margin
        self.history = [[0.0] * len(self.fp8_max)] + self.history[2:] + [self.history[0]]


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scales_follow_transformer_engines_formulas(algo: AmaxComputeAlgo) -> None:
    layer = FP8Linear(32, 16, config=FP8Config(recipe="delayed", amax_history_len=3, margin=1, amax_compute_algo=algo))
    reference = TEDelayedScaling([448.0, 448.0, 57344.0], length=3, margin=1, algo=algo)
    x0, g0 = torch.rand(16, 32), torch.rand(16, 16)
    x0[0, 0] = g0[0, 0] = 1.0  # amax exactly 1 before the factors below
    w_amax = layer.weight.detach().abs().max().item()
    for x_factor, g_factor in ((1.0, 1.0), (8.0, 0.5), (0.5, 4.0), (0.25, 0.125), (0.0, 1.0), (3.0, 2.0), (1.0, 1.0)):
        layer.zero_grad()
        layer(x0 * x_factor).backward(g0 * g_factor)
        for index, amax in enumerate((x_factor, w_amax, g_factor)):
            reference.record(index, amax)
        reference.update()
        assert torch.equal(layer.scale, torch.tensor(reference.scale, dtype=torch.float32))
        # The same window: ours newest first, TE's oldest first after its roll (row 0 waits for the next amax).
        te_window = torch.tensor(reference.history[1:][::-1], dtype=torch.float32).T
        assert torch.equal(layer.amax_history[:, :2], te_window)

"""PrecisionLayout: casts never round the FP32 islands' own values; FP8 through the backend seam, selected once."""

from __future__ import annotations

import contextlib

import pytest
import torch
from fp8_stand_ins import install_transformer_engine
from torch import nn

from lit_mpstable.core.layout.layout import PrecisionLayout
from lit_mpstable.fp8 import FP8Config, FP8Linear


def test_islands_keep_their_fp32_values_through_casts_fallbacks_and_restores() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
    with torch.no_grad():
        model[1].running_var.fill_(1e5)  # above FP16's max
        model[1].weight.fill_(1 + 1e-5)  # below FP16's resolution at 1.0
    expected_var, expected_weight = model[1].running_var.clone(), model[1].weight.detach().clone()
    layout = PrecisionLayout(torch.float16, cast_parameters=True, fp32_modules=[nn.BatchNorm1d])
    layout.attach(model, "cpu")
    assert model[0].weight.dtype == torch.float16 and model[2].weight.dtype == torch.float16
    for action in (lambda: layout.fallback(["2"]), layout.restore, lambda: layout.fallback(None), layout.restore):
        action()
        assert torch.equal(model[1].running_var, expected_var) and torch.equal(model[1].weight, expected_weight)
    assert model[2].weight.dtype == torch.float16  # the module fallback was undone


# ---------------------------------------------------------------------------------------------------------- FP8
def _tiny_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))


def test_the_fp8_selection_is_made_once_and_reapplied() -> None:
    # An explicit filter names layers that are FP8Linear after the first swap: selecting again among exact nn.Linear
    # layers would call the filter stale. The layout keeps the names and re-applies them.
    model = _tiny_mlp()
    layout = PrecisionLayout(torch.bfloat16, cast_parameters=False, fp8=FP8Config(recipe="delayed", filter=["2"]))
    layout.attach(model, "cpu")
    assert layout.fp8_selected == layout.fp8_layers == ["2"] and isinstance(model[2], FP8Linear)
    state = layout.state_dict()
    for action in (
        lambda: layout.fallback(None), layout.restore,  # global fallback, restore
        lambda: layout.fallback(["2"]), lambda: layout.load_state_dict(state),  # module fallback, rollback
        lambda: layout.attach(model, "cpu"),  # a second fit
    ):
        action()
    assert layout.fp8_layers == ["2"] and isinstance(model[2], FP8Linear) and type(model[0]) is nn.Linear
    other = _tiny_mlp()  # another model: selected afresh
    layout.attach(other, "cpu")
    assert isinstance(other[2], FP8Linear)
    with pytest.raises(ValueError, match=r"\['9'\] match no nn.Linear"):  # stale at the first selection
        PrecisionLayout(torch.bfloat16, cast_parameters=False, fp8=FP8Config(filter=["9"])).attach(_tiny_mlp(), "cpu")


def test_whole_model_fp32_leaves_fp8_for_every_backend() -> None:
    pytest.importorskip("torchao.float8")
    model = _tiny_mlp()
    fp8 = FP8Config(recipe="current", backend="torchao", emulate=True)
    layout = PrecisionLayout(torch.bfloat16, cast_parameters=False, fp8=fp8)
    layout.attach(model, "cpu")
    assert type(model[2]).__name__ == "Float8Linear" and layout.fp8_layers == ["2"]
    assert "FP8" in layout.fallback(None)  # the first rung reaches torchao's layers too
    assert type(model[2]) is nn.Linear and not layout.fp32
    layout.restore()
    layout.load_state_dict({**layout.state_dict(), "fp32": True})  # FP32 without the FP8 rung (e.g. a checkpoint)
    assert type(model[2]) is nn.Linear and layout.fp8_layers == []


def test_forward_context_enters_the_backends_only_while_fp8_layers_run(monkeypatch: pytest.MonkeyPatch) -> None:
    te = install_transformer_engine(monkeypatch)
    layout = PrecisionLayout(torch.bfloat16, cast_parameters=False, fp8=FP8Config(backend="transformer_engine"))
    model = _tiny_mlp()
    layout.attach(model, "cpu")
    with layout.forward_context():
        model(torch.randn(4, 16))
    assert len(te.autocast) == 1 and te.forwards == [layout.fp8_backend.recipe]
    layout.fallback(None)
    with layout.forward_context():
        model(torch.randn(4, 16))  # the stand-in would raise outside TE's autocast: it is gone
    assert len(te.autocast) == 1 and type(model[2]) is nn.Linear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_scaling_state_stays_fp32_through_fallback_restore_and_load(dtype: torch.dtype) -> None:
    # *-true: re-applying the layout casts the model's parameters and buffers, but the FP8 layers' amax histories
    # and scales are the backend's state, FP32 (rounded to 16 bits the scales drift; _scaled_mm refuses them).
    model = _tiny_mlp()
    layout = PrecisionLayout(dtype, cast_parameters=True, fp8=FP8Config(recipe="delayed", filter=["2"]))
    layout.attach(model, "cpu")
    with torch.no_grad():
        model[2].amax_history.fill_(1 + 2**-20)  # not a 16-bit value: a round trip would show
        model[2].scale.fill_(3 + 2**-20)
    history, scale = model[2].amax_history.clone(), model[2].scale.clone()

    def check(when: str) -> None:
        if isinstance(model[2], FP8Linear):
            assert model[2].amax_history.dtype == model[2].scale.dtype == torch.float32, when
            assert torch.equal(model[2].amax_history, history) and torch.equal(model[2].scale, scale), when

    saved = layout.state_dict()
    for when, action in (("module fallback", lambda: layout.fallback(["0"])), ("restore", layout.restore),
                         ("load_state_dict", lambda: layout.load_state_dict(saved)),
                         ("attach again", lambda: layout.attach(model, "cpu"))):
        action()
        check(when)
    assert model[0].weight.dtype == dtype and model[2].weight.dtype == dtype  # parameters are the layout's


def test_a_refused_fallback_changes_nothing() -> None:
    model = _tiny_mlp()
    layout = PrecisionLayout(torch.bfloat16, cast_parameters=True)
    layout.attach(model, "cpu")
    before = layout.state_dict()
    with pytest.raises(ValueError, match=r"fallback\(modules=\['0', 'typo'\]\).*\['typo'\] match no module"):
        layout.fallback(["0", "typo"])  # one good name, one typo: neither moves
    with pytest.raises(TypeError, match=r"a list of qualified module names"):
        layout.fallback("0")  # a string would be read as the names '0'
    assert layout.state_dict() == before and layout.islands.names == []
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}



# The orders a resume may load the checkpoint's parts in: the stepper's state carries the FP32 values a recasting
# fallback holds, so a model or optimizer loaded before it (into the configured BF16 parameters: rounded) is corrected.
_ORDERS = ["stepper,model,opt", "model,opt,stepper", "opt,stepper,model", "model,stepper,opt"]


def _steps_with_a_fallback_at_1(model, stepper, opt, steps, x, y, modules) -> None:
    """Train ``steps`` on (x, y); after step 1 ``stepper.fallback(modules)``."""
    from helpers import mse_backward

    for i in steps:
        mse_backward(stepper, model, x, y)
        stepper.step(opt)
        opt.zero_grad()
        if i == 1:
            stepper.fallback(modules)


@pytest.mark.parametrize("order", _ORDERS)
@pytest.mark.parametrize("master_weights", ["kahan", "stochastic", False])
@pytest.mark.parametrize("modules", [None, ["fc2"]])  # global fallback, per-module fallback
def test_resume_with_a_recasting_fallback_is_exact(master_weights, modules, order) -> None:
    # bf16-true: a fallback holds some parameters in FP32 and the checkpoint holds those FP32 values (FP32 masters,
    # which resume exactly in any order, are left out: they carry the values themselves).
    import io

    from helpers import regression_data, tiny_stepper

    x, y = regression_data(16)

    def build(seed):
        return tiny_stepper(seed=seed, master_weights=master_weights, device="cpu")

    def run(model, stepper, opt, steps):
        _steps_with_a_fallback_at_1(model, stepper, opt, steps, x, y, modules)

    whole = build(0)
    run(*whole, range(6))
    first = build(0)
    run(*first, range(4))
    buf = io.BytesIO()
    torch.save({"model": first[0].state_dict(), "opt": first[2].state_dict(), "stepper": first[1].state_dict()}, buf)
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert sorted(state["stepper"]["recast"]["weights"]) == sorted(
        n for n, p in first[0].named_parameters() if p.dtype == torch.float32)
    model, stepper, opt = build(1)
    for part in order.split(","):
        {"stepper": stepper, "model": model, "opt": opt}[part].load_state_dict(state[part])
    run(model, stepper, opt, range(4, 6))
    for (name, a), b in zip(whole[0].named_parameters(), model.parameters()):
        assert a.dtype == b.dtype
        assert torch.equal(a, b), f"{name}: max |diff| {(a.float() - b.float()).abs().max():.3g}"


def test_the_recast_values_are_saved_only_while_a_fallback_recasts() -> None:
    from helpers import mse_backward, regression_data, tiny_stepper

    x, y = regression_data(16)
    model, stepper, opt = tiny_stepper(master_weights=False, device="cpu")
    mse_backward(stepper, model, x, y)
    stepper.step(opt)
    assert "recast" not in stepper.state_dict()  # no fallback: the checkpoint is as before
    stepper.fallback(["fc2"])
    state = stepper.state_dict()
    assert sorted(state["recast"]["weights"]) == ["fc2.bias", "fc2.weight"]
    assert sorted(state["recast"]["optimizer_state"]["fc2.weight"]) == ["exp_avg", "exp_avg_sq"]
    old = {k: v for k, v in state.items() if k != "recast"}  # written before the key existed: still loads
    assert stepper.load_state_dict(old) == []
    bad = {**state, "recast": {**state["recast"], "weights": {"fc2.bias": torch.full((4,), float("nan"))}}}
    with pytest.raises(ValueError, match=r"recast\['weights'\].*inf/NaN"):
        stepper.load_state_dict(bad)
    stepper.restore_precision()
    assert "recast" not in stepper.state_dict()
    _, masters, _ = tiny_stepper(master_weights=True, device="cpu")
    masters.fallback(None)
    assert "recast" not in masters.state_dict()  # FP32 masters carry the values themselves


@pytest.mark.parametrize("modules", [None, ["fc2"]])
def test_a_recasting_fallback_loaded_before_setup_resumes_exactly(modules) -> None:
    # The stepper's state loaded before setup_module waits; the FP32 model loaded meanwhile is cast to BF16 by the
    # layout and recast by the waiting fallback (rounded), then takes the waiting FP32 values. Before the stepper's
    # state carried them this resumed 9e-4..2e-3 off.
    import io

    from helpers import TinyMLP, regression_data, tiny_stepper

    from lit_mpstable.core.step.stepper import PrecisionStepper

    x, y = regression_data(16)

    def run(model, stepper, opt, steps):
        _steps_with_a_fallback_at_1(model, stepper, opt, steps, x, y, modules)

    whole = tiny_stepper(master_weights=False, device="cpu")
    run(*whole, range(6))
    first = tiny_stepper(master_weights=False, device="cpu")
    run(*first, range(4))
    buf = io.BytesIO()
    torch.save({"model": first[0].state_dict(), "opt": first[2].state_dict(), "stepper": first[1].state_dict()}, buf)
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    torch.manual_seed(1)
    model, stepper = TinyMLP(), PrecisionStepper("bf16-true", master_weights=False, device="cpu")
    stepper.load_state_dict(state["stepper"])
    model.load_state_dict(state["model"])
    stepper.setup_module(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(state["opt"])  # before setup_optimizers: its moments wait for it too
    stepper.setup_optimizers(model, [opt])
    run(model, stepper, opt, range(4, 6))
    for (name, a), b in zip(whole[0].named_parameters(), model.parameters()):
        assert a.dtype == b.dtype
        assert torch.equal(a, b), f"{name}: max |diff| {(a.float() - b.float()).abs().max():.3g}"


def test_keep_high_precision_before_attach_raises_runtime_error_naming_the_order() -> None:
    layout = PrecisionLayout(torch.bfloat16, cast_parameters=False, fp8=FP8Config(recipe="delayed"))
    with pytest.raises(RuntimeError, match=r"keep_high_precision_\(\['0'\]\) before attach\(module\)"):
        layout.keep_high_precision_(["0"])


# ------------------------------------------------------------------------------------------------- tied weights
class _TiedLM(nn.Module):
    """GPT-2's tie: the head's weight is the embedding's ``Parameter``, one tensor in two modules."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(tokens)))


@pytest.mark.parametrize("island, other", [("head", "emb"), ("emb", "head")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_island_on_a_tied_weight_takes_the_modules_sharing_it_along(island, other, dtype) -> None:
    # A parameter has one dtype: with the island's weight FP32, the other user of it must run as an island too, or
    # its forward meets an FP32 weight with 16-bit inputs (the embedding emits FP32 into the 16-bit body).
    model = _TiedLM()
    layout = PrecisionLayout(dtype, cast_parameters=True, fp32_modules=[island])
    with pytest.warns(UserWarning, match=rf"\['{island}'\] takes '{other}' \(holds '{island}\.weight'\) into FP32 too"):
        layout.attach(model, "cpu")
    assert sorted(layout.islands.names) == ["emb", "head"] and model.head.weight is model.emb.weight
    assert model.emb.weight.dtype == torch.float32 and model.body.weight.dtype == dtype
    assert model(torch.tensor([[1, 2, 3]])).dtype == dtype  # the islands' outputs go back down


def test_a_module_fallback_on_a_tied_weight_moves_the_modules_sharing_it_and_restores_them() -> None:
    model = _TiedLM()
    layout = PrecisionLayout(torch.bfloat16, cast_parameters=True)
    layout.attach(model, "cpu")
    action = layout.fallback(["head"])
    assert action == "['head'] now run in FP32, with ['emb'] (they share 'head.weight', and a parameter has one dtype)"
    assert sorted(layout.islands.names) == ["emb", "head"] and layout.fp32_modules == ["head"]
    model(torch.tensor([[1, 2, 3]])).float().sum().backward()
    layout.restore()
    assert layout.islands.names == [] and {p.dtype for p in model.parameters()} == {torch.bfloat16}


class _RootTied(nn.Module):
    """The root holds the head's weight itself (an embedding table read with ``F.embedding``)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 32, bias=False)
        self.table = self.head.weight
        self.body = nn.Linear(16, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(nn.functional.embedding(tokens, self.table)))


def test_a_weight_tied_to_the_root_refuses_the_island_and_the_module_fallback_climbs_globally() -> None:
    # The root cannot be an island (its caller's code runs outside it): at setup that is an error naming the tie and
    # what works; mid-run the fallback takes the ladder's next rung instead of crashing the next forward.
    layout = PrecisionLayout(torch.bfloat16, cast_parameters=True, fp32_modules=["head"])
    with pytest.raises(ValueError, match=r"\['head'\]: 'head\.weight' is a parameter of the root module _RootTied"
                                         r" too.*'\*-mixed' precision.*untie"):
        layout.validate(_RootTied())
    PrecisionLayout(torch.bfloat16, cast_parameters=False, fp32_modules=["head"]).validate(_RootTied())  # mixed
    model = _RootTied()
    layout = PrecisionLayout(torch.bfloat16, cast_parameters=True)
    layout.attach(model, "cpu")
    action = layout.fallback(["head"])
    assert action.startswith("the whole model now computes in FP32 (['head'] cannot run in FP32 alone: 'head.weight'")
    assert layout.fp32_modules == [] and layout.compute_dtype == torch.float32
    assert model(torch.tensor([[1, 2, 3]])).dtype == torch.float32


@pytest.mark.parametrize("master_weights", [True, "kahan", "stochastic", False])
@pytest.mark.parametrize("when", ["setup", "fallback"])
def test_a_tied_head_trains_as_an_island_in_every_weight_mode(master_weights, when) -> None:
    from lit_mpstable.core.step.stepper import PrecisionStepper

    torch.manual_seed(0)
    model = _TiedLM()
    stepper = PrecisionStepper("bf16-true", master_weights=master_weights, device="cpu",
                               fp32_modules=["head"] if when == "setup" else ())
    with pytest.warns(UserWarning, match="into FP32 too") if when == "setup" else contextlib.nullcontext():
        stepper.setup_module(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepper.setup_optimizers(model, [opt])
    tokens = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(0))
    before = model.emb.weight.detach().clone()
    for step in range(3):
        with stepper.forward_context():
            logits = model(stepper.convert_input(tokens[:, :-1])).float()
        loss = nn.functional.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1))
        stepper.scale_loss(loss).backward()
        stepper.step(opt)
        opt.zero_grad()
        if step == 0 and when == "fallback":
            stepper.fallback(["head"])
    assert model.head.weight is model.emb.weight and model.emb.weight.dtype == torch.float32
    assert stepper.skipped_steps == 0 and not torch.equal(model.emb.weight, before.float())

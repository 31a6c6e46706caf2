"""The plugin's own repairs (preflight fallback, fallbacks with compact weights, FP8 state across a recast, a
second fit, a refused call, a resume in another precision) leave a consistent state: each case crashed or was
silently wrong before."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from helpers import make_module, make_trainer
from trainer_pkg import AMPPreflight, StablePrecision, pl

pytestmark = pytest.mark.filterwarnings("ignore")


def _off_in_low_precision(module, batch):
    """A forward whose 16-bit output is off by 1 (the FP32 reference is not): the check must disagree."""
    output = module(batch[0])
    return output + 1.0 if output.dtype != torch.float32 else output


# ------------------------------------------------------------------------------------- AMPPreflight, *-true
@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
@pytest.mark.parametrize("master_weights", [True, False])
def test_preflight_fallback_in_true_precisions_trains_on(precision: str, master_weights: bool) -> None:
    # The batch was cast to the 16-bit dtype before the check; after the check's global fallback the model is FP32.
    plugin = StablePrecision(precision, master_weights=master_weights, device="cpu")
    preflight = AMPPreflight(forward_fn=_off_in_low_precision)
    module = make_module()
    make_trainer(plugin, callbacks=[preflight], max_steps=2).fit(module)
    assert plugin.compute_dtype == torch.float32 and plugin.fallback_active
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    assert len(module.losses) == 2 and all(torch.isfinite(torch.tensor(module.losses)))


# ------------------------------------------------------------------------- compact weights across a fallback
class _Repairs(pl.Callback):
    """Calls ``plugin.fallback``/``restore_precision`` after the given optimizer steps and records, right after
    each, the compact parameters' FP32 values (``w + compensation``)."""

    def __init__(self, at: dict[int, Any]) -> None:
        self.at, self.seen = dict(at), []

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.precision_plugin.stepper.keeper.state_key == "compact":
            trainer.precision_plugin.stepper.keeper.fused = False  # the FP32 stand-ins: no 20 s compile

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step - 1 not in self.at:
            return
        action = self.at[trainer.global_step - 1]
        plugin = trainer.precision_plugin
        before = _effective(plugin, pl_module)
        if action == "restore":
            plugin.restore_precision()
        elif action == "rollback":
            self.rollback()
        else:
            plugin.fallback(action, reason="test")
        self.seen.append((before, _effective(plugin, pl_module)))


def _effective(plugin, module) -> dict[str, torch.Tensor]:
    """Each trainable weight's value as the run holds it: the parameter, plus its Kahan compensation."""
    values = {name: p.detach().double() for name, p in module.named_parameters()}
    if plugin.stepper.keeper.state_key == "compact":
        for name, _, comp in plugin.stepper.keeper.named_buffers():
            if comp is not None and plugin.stepper.keeper._params[name].dtype != torch.float32:
                values[name] = values[name] + comp.double()
    return values


@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
@pytest.mark.parametrize("changes", [{1: None}, {1: ["model.fc2"]}, {1: None, 3: "restore"}],
                         ids=["global", "module", "global-restore"])
def test_compact_weights_follow_a_fallback(mode: str, changes: dict) -> None:
    plugin = StablePrecision("bf16-true", master_weights=mode, device="cpu")
    repairs = _Repairs(changes)
    module = make_module(optimizer="adamw", lr=1e-3)
    make_trainer(plugin, callbacks=[repairs], max_steps=5).fit(module)
    assert len(module.losses) == 5 and all(torch.isfinite(torch.tensor(module.losses)))
    for action, (before, after) in zip(changes.values(), repairs.seen):
        for name in before:
            if action != "restore":  # into FP32: the value the run held is kept exactly (compensation included)
                torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=name)
            else:  # back to BF16: kahan's w + compensation holds the FP32 value to ~16 significant bits; stochastic
                # rounds to the nearest BF16 (half an ulp: up to 2**-8 relative)
                rtol = 2**-15 if mode == "kahan" else 2**-8
                torch.testing.assert_close(after[name], before[name], rtol=rtol, atol=0, msg=name)
    if mode == "kahan" and "restore" not in changes.values():
        # The optimizer's state follows its parameter into FP32.
        optimizer = module.trainer.optimizers[0]
        fp32 = [p for p in module.parameters() if p.dtype == torch.float32]
        assert fp32 and all(v.dtype == torch.float32 for p in fp32 for k, v in optimizer.state[p].items()
                            if k != "step")


# ---------------------------------------------------------------------------------------- FP8 scaling state
def test_fp8_scaling_state_stays_fp32_through_fallback_restore_and_rollback() -> None:
    from lit_mpstable.fp8 import FP8Linear

    plugin = StablePrecision("bf16-true", fp8="delayed", device="cpu")
    states: list[dict] = []

    class Snapshot(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            if trainer.global_step == 1:
                states.append(plugin.state_dict())

    repairs = _Repairs({1: ["model.fc1"], 2: "restore", 3: "rollback"})
    repairs.rollback = lambda: plugin.restore_state(states[0])
    module = make_module()
    make_trainer(plugin, callbacks=[Snapshot(), repairs], max_steps=5).fit(module)
    fc2 = module.model.fc2
    assert isinstance(fc2, FP8Linear) and len(repairs.seen) == 3
    assert fc2.amax_history.dtype == fc2.scale.dtype == torch.float32
    assert fc2.weight.dtype == torch.bfloat16 and bool((fc2.amax_history > 0).any())


# --------------------------------------------------------------------------------- state that outlives a fit
@pytest.mark.parametrize("filter_", [None, ["model.fc2"]])
def test_a_second_fit_with_a_new_plugin_and_fp8_trains(filter_) -> None:
    from lit_mpstable.fp8 import FP8Config, FP8Linear

    module = make_module()
    for _ in range(2):  # the first fit leaves FP8Linear layers in the model: the new plugin selects among them
        plugin = StablePrecision("bf16-mixed", fp8=FP8Config(recipe="delayed", filter=filter_), device="cpu")
        make_trainer(plugin, max_steps=2).fit(module)
        assert plugin.layout.fp8_layers == ["model.fc2"] and isinstance(module.model.fc2, FP8Linear)
    assert len(module.losses) == 4


def test_a_refused_fallback_changes_nothing() -> None:
    plugin = StablePrecision("bf16-true", device="cpu")
    module = make_module()
    errors = []

    class Typo(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            if trainer.global_step == 1:
                before = plugin.layout.state_dict()
                with pytest.raises(ValueError, match="typo") as caught:
                    plugin.fallback(["typo"], reason="test")
                errors.append(str(caught.value))
                assert plugin.layout.state_dict() == before and not plugin.fallback_active

    make_trainer(plugin, callbacks=[Typo()], max_steps=2).fit(module)
    make_trainer(plugin, max_steps=4).fit(module)  # a later fit is not broken by the refused name
    assert errors and len(module.losses) == 2 + 4 and plugin.layout.fp32_modules == []


# ------------------------------------------------------------------------- resuming in another master mode
class _AtStart(pl.Callback):
    """The run's FP32 values right after a resume (before the first step)."""

    def on_train_start(self, trainer, pl_module) -> None:
        plugin = trainer.precision_plugin
        self.values = _effective(plugin, pl_module)
        self.masters = ({name: m.detach().clone() for name, m, _ in plugin.master.named_pairs()}
                        if plugin.master is not None else {})


def _precise(plugin, module) -> dict[str, torch.Tensor]:
    values = _effective(plugin, module)
    if plugin.master is not None:
        values.update({name: master.detach().double() for name, master, _ in plugin.master.named_pairs()})
    return values


@pytest.mark.parametrize("source", ["fp32", "kahan"])
@pytest.mark.parametrize("target", [("bf16-mixed", True), ("32-true", True), ("bf16-true", True),
                                    ("bf16-true", "kahan"), ("bf16-true", "stochastic"), ("bf16-true", False)],
                         ids=lambda t: f"{t[0]}-{t[1]}")
def test_resume_in_another_master_mode_carries_the_fp32_values(tmp_path, source: str, target: tuple) -> None:
    precision, master_weights = target
    if (precision, master_weights) == ("bf16-true", True if source == "fp32" else source):
        pytest.skip("same mode: resumed exactly elsewhere")
    plugin = StablePrecision("bf16-true", master_weights=True if source == "fp32" else source, device="cpu")
    repairs = _Repairs({})  # turns the fused kernel off
    module = make_module(optimizer="adamw", lr=1e-4)  # updates below half a BF16 ulp: masters != weights
    trainer = make_trainer(plugin, callbacks=[repairs], max_steps=3)
    trainer.fit(module)
    saved = _precise(plugin, module)
    weights = {name: p.detach().double() for name, p in module.named_parameters()}
    assert any(not torch.equal(saved[n], weights[n]) for n in saved)  # there is something to carry
    trainer.save_checkpoint(tmp_path / "ckpt")

    resumed = StablePrecision(precision, master_weights=master_weights, device="cpu")
    start = _AtStart()
    fresh = make_module(optimizer="adamw", lr=1e-4)
    lossy = precision == "bf16-true" and master_weights in ("stochastic", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(resumed, callbacks=[_Repairs({}), start], max_steps=4).fit(fresh, ckpt_path=tmp_path / "ckpt")
    carried = [str(w.message) for w in caught if "could not all be carried" in str(w.message)]
    got = start.values if resumed.master is None else {
        **start.values, **{n: m.double() for n, m in start.masters.items()}}
    for name in saved:
        if lossy:  # the nearest 16-bit weight, and a warning saying how much was dropped
            torch.testing.assert_close(got[name], saved[name], rtol=2**-8, atol=0, msg=name)
        elif master_weights == "kahan":  # weight + compensation: ~16 significant bits
            torch.testing.assert_close(got[name], saved[name], rtol=2**-15, atol=0, msg=name)
        else:  # FP32 weights or masters: exactly
            assert torch.equal(got[name], saved[name]), name
    assert bool(carried) == lossy, carried


def test_a_fallback_to_fp32_computes_with_the_fp32_masters() -> None:
    # Into FP32 the parameters take the masters' values (they held the 16-bit rounding of them), and back.
    plugin = StablePrecision("bf16-true", device="cpu")
    repairs = _Repairs({2: None, 3: ["model.fc2"]})
    checks = []

    class Check(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            if trainer.global_step - 1 in (2, 3):
                checks.append(all(torch.equal(p, m.to(p.dtype)) for _, m, p in plugin.master.named_pairs())
                              and {p.dtype for p in pl_module.parameters()} == {torch.float32})

    module = make_module(optimizer="adamw", lr=1e-4)  # updates below half a BF16 ulp: masters != weights
    make_trainer(plugin, callbacks=[repairs, Check()], max_steps=5).fit(module)
    assert checks == [True, True]
    assert any(not torch.equal(before[n], after[n]) for before, after in repairs.seen[:1] for n in before)

"""PrecisionProbe in real Trainer runs: what it logs and when, the fallback it feeds, the scaler it raises,
gradient accumulation, and DDP on 2 gloo processes."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from cb_helpers import ListLogger, ManualPoisonModule, PoisonModule, quiet
from dist_helpers import RankFaultModule, fit_ddp
from helpers import make_trainer

from lit_mpstable import StablePrecision
from lit_mpstable.app.demos import FaultyMLP, GradientAttenuatedLinear
from lit_mpstable.callbacks import PrecisionFallback, PrecisionProbe
from lit_mpstable.core.scaling.adaptive_scaler import AdaptiveLossScaler
from lit_mpstable.faults import FaultInjector

PROBE_METRICS = ("mp/grad_underflow_frac", "mp/grad_rel_error", "mp/grad_cosine")


class Attenuated(PoisonModule):
    """PoisonModule whose first layer's gradients are scaled by ``factor`` inside backward: they flush in FP16 (the
    layer stops learning), the other layers' do not, and in FP32 nothing changes (a power of two)."""

    def __init__(self, factor: float = 2.0**-40, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model.fc1 = GradientAttenuatedLinear.from_linear(self.model.fc1, factor)


def _fit(plugin, callbacks, module=None, steps: int = 6, **kwargs):
    module = module if module is not None else PoisonModule()
    with quiet():
        make_trainer(plugin, max_steps=steps, callbacks=callbacks, log_every_n_steps=1, **kwargs).fit(module)
    return module


# ------------------------------------------------------------------------------------------------ the fault
def test_gradient_attenuated_linear_is_nn_linear_in_fp32_and_flushes_in_fp16() -> None:
    linear = torch.nn.Linear(16, 16)
    plain = copy.deepcopy(linear)
    attenuated = GradientAttenuatedLinear.from_linear(linear, 2.0**-40)
    assert attenuated.weight is linear.weight and attenuated.bias is linear.bias
    x = torch.randn(8, 16)
    for dtype, autocast in ((torch.float32, False), (torch.float16, True)):
        grads = []
        for module in (plain, attenuated):
            module.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                out = module(x)
            (out.float() ** 2).sum().backward()
            grads.append((module.weight.grad.clone(), module.bias.grad.clone()))
        (w_plain, b_plain), (w_att, b_att) = grads
        if dtype == torch.float32:
            assert torch.equal(w_att, w_plain) and torch.equal(b_att, b_plain)  # powers of two: bit for bit
        else:
            assert torch.count_nonzero(w_plain) > 0 and torch.count_nonzero(w_att) == torch.count_nonzero(b_att) == 0
    faulty = FaultyMLP(hidden=32, underflow_module="model.0")
    assert isinstance(faulty.model[0], GradientAttenuatedLinear) and type(faulty.model[2]) is torch.nn.Linear
    with pytest.raises(ValueError, match=r"underflow_module='model.1' is a GELU, not nn.Linear"):
        FaultyMLP(hidden=32, underflow_module="model.1")


# ------------------------------------------------------------------------------------------------ what and when
def test_probe_logs_on_the_steps_it_measured_and_postpones_an_overflowing_one() -> None:
    logger = ListLogger()
    probe = PrecisionProbe(every_n_steps=3)
    plugin = StablePrecision("bf16-mixed")
    # Steps 0, 2, 5 are due; step 2's gradients hold an inf (skipped), so step 3 is measured instead.
    _fit(plugin, [probe], PoisonModule(inf_grad_steps={2}, n=128), steps=7, logger=logger)
    assert [r["step"] for r in probe.history] == [0, 3, 5]
    for name in PROBE_METRICS:
        assert logger.steps_with(name) == [0, 3, 5], name  # Lightning's step labels: logged once, when measured
    assert logger.values("mp/grad_rel_error") == [r["rel_error"] for r in probe.history]
    assert plugin.stats["probe"] == probe.history[-1]
    assert 0 < probe.history[-1]["rel_error"] < 0.1 and probe.history[-1]["cosine"] > 0.99  # BF16 rounding
    assert set(probe.history[-1]["modules"]) == {"model.fc1", "model.fc2", "model.fc3"}
    assert not probe.pending


def test_underflow_reads_high_without_scaling_and_below_one_percent_with_it() -> None:
    # The loss x 2**-24: without a scaler FP16 flushes most gradients; the dynamic scaler (2**16) keeps them.
    weights = {step: 2.0**-24 for step in range(4)}
    unscaled, scaled = PrecisionProbe(every_n_steps=1), PrecisionProbe(every_n_steps=1)
    _fit(StablePrecision("16-mixed", scaler=None), [unscaled], PoisonModule(loss_factor=weights), steps=4)
    _fit(StablePrecision("16-mixed"), [scaled], PoisonModule(loss_factor=weights), steps=4)
    assert min(r["underflow_frac"] for r in unscaled.history) > 0.5
    assert max(r["underflow_frac"] for r in scaled.history) < 0.01


def test_accumulation_recomputes_the_last_micro_batch() -> None:
    # In FP32 the recomputed gradient of the last micro-batch equals its FP32 recompute exactly; comparing the
    # accumulated .grad (two micro-batches) with one micro-batch's would read a large error.
    probe = PrecisionProbe(every_n_steps=1)
    _fit(StablePrecision("32-true"), [probe], steps=3, accumulate_grad_batches=2)
    assert [r["step"] for r in probe.history] == [0, 1, 2]
    assert all(r["recomputed"] and r["rel_error"] == 0.0 and r["underflow_frac"] == 0.0 for r in probe.history)


def test_probe_leaves_the_run_identical() -> None:
    def run(callbacks):
        torch.manual_seed(0)
        module = _fit(StablePrecision("bf16-true"), callbacks, PoisonModule(optimizer="adamw", lr=1e-2), steps=4)
        return [p.detach().clone() for p in module.parameters()], module.losses, torch.get_rng_state()

    params, losses, rng = run([])
    probed_params, probed_losses, probed_rng = run([PrecisionProbe(every_n_steps=1)])
    assert all(torch.equal(a, b) for a, b in zip(params, probed_params))
    assert losses == probed_losses  # training_step replays ran on copies: no extra entries either
    assert torch.equal(rng, probed_rng)


def test_probe_replays_the_copy_when_a_fault_injector_wraps_training_step() -> None:
    # FaultInjector's 'loss_spike' wraps training_step as an instance attribute: the copy's must call the copy (its
    # gradients are the reference), not the original module (whose log would run and whose losses would grow).
    probe = PrecisionProbe(every_n_steps=1)
    module = _fit(StablePrecision("bf16-mixed"), [FaultInjector({5: "loss_spike"}), probe], steps=6)
    assert [r["step"] for r in probe.history] == [0, 1, 2, 3, 4, 5]
    # BF16 rounding (a replay of the original module would give no reference gradients: rel_error inf, cosine 0).
    assert all(0 < r["rel_error"] < 0.5 and r["cosine"] > 0.95 for r in probe.history)
    assert len(module.losses) == 6  # the replays did not run on the original module


def test_probe_is_inert_under_manual_optimization() -> None:
    probe = PrecisionProbe(every_n_steps=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make_trainer(StablePrecision("bf16-mixed"), max_steps=2, callbacks=[probe]).fit(ManualPoisonModule())
    assert any("PrecisionProbe does nothing in this run: manual optimization" in str(w.message) for w in record)
    assert probe.history == []


def test_a_replay_that_fails_stops_the_probe_not_the_training() -> None:
    def broken(module, batch):
        raise KeyError("no such input")

    probe = PrecisionProbe(every_n_steps=1, loss_fn=broken)
    plugin = StablePrecision("bf16-mixed")
    with pytest.warns(UserWarning, match=r"PrecisionProbe stops probing at step 0: .*KeyError.*no such input"):
        make_trainer(plugin, max_steps=3, callbacks=[probe]).fit(PoisonModule())
    assert probe.history == [] and plugin.step_count == 3


def test_state_dict_is_strict() -> None:
    probe = PrecisionProbe(every_n_steps=2)
    _fit(StablePrecision("bf16-mixed"), [probe], steps=3)
    state = probe.state_dict()
    assert [r["step"] for r in state["history"]] == [0, 1]
    with pytest.raises(KeyError, match=r"unknown keys \['extra'\]"):
        PrecisionProbe().load_state_dict({**state, "extra": 1})


# ------------------------------------------------------------------------------------------------ what it feeds
def test_fallback_lifts_the_layer_whose_gradients_underflow_and_only_it() -> None:
    probe = PrecisionProbe(every_n_steps=1)
    fallback = PrecisionFallback(max_grad_error=0.5, grad_error_patience=2)
    plugin = StablePrecision("16-mixed")
    module = Attenuated()
    frozen = module.model.fc1.weight.detach().clone()
    _fit(plugin, [probe, fallback], module, steps=6)
    first, second = probe.history[0]["modules"], probe.history[1]["modules"]
    assert first["model.fc1"]["underflow_frac"] == 1.0 and second["model.fc1"]["rel_error"] == 1.0
    assert max(first[m]["rel_error"] for m in ("model.fc2", "model.fc3")) < 0.01  # FP16 rounding only
    assert [d["modules"] for d in fallback.decisions] == [["model.fc1"]]
    assert fallback.decisions[0]["step"] == 2 and "error of 1 in 'model.fc1'" in fallback.decisions[0]["reason"]
    assert plugin.islands.names == ["model.fc1"]
    assert all(r["modules"]["model.fc1"]["rel_error"] < 0.01 for r in probe.history[2:])  # repaired in FP32
    assert not torch.equal(module.model.fc1.weight, frozen)  # it learns again (frozen for the first two steps)

    healthy = PrecisionFallback(max_grad_error=0.5, grad_error_patience=2)
    _fit(StablePrecision("16-mixed"), [PrecisionProbe(every_n_steps=1), healthy], PoisonModule(), steps=4)
    assert healthy.decisions == []


def test_fallback_lifts_the_most_downstream_layer_and_names_an_fp32_one_that_inherits_the_error() -> None:
    # Loss x 2**-40 without scaling: every FP16 gradient flushes, and fc1, an FP32 island, still gets nothing: the
    # gradient reaching it comes out of fc2's FP16 backward. fc3, the last of the others, climbs first.
    fallback = PrecisionFallback(max_grad_error=0.5, grad_error_patience=1)
    plugin = StablePrecision("16-mixed", scaler=None, fp32_modules=["model.fc1"])
    module = PoisonModule(loss_factor={step: 2.0**-40 for step in range(2)})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make_trainer(plugin, max_steps=2, callbacks=[PrecisionProbe(every_n_steps=1), fallback]).fit(module)
    assert [d["modules"] for d in fallback.decisions] == [["model.fc3"], ["model.fc2"]]
    assert "['model.fc2'] (before it" in fallback.decisions[0]["reason"]
    ours = [str(w.message) for w in record if "already computes in FP32" in str(w.message)]
    assert len(ours) == 1 and "'model.fc1'" in ours[0]  # once, however many probes flag it


def test_fallback_takes_an_fp8_layer_out_of_fp8_first() -> None:
    # E4M3 costs fc2 ~10% of its gradient, and fc1 (before it) inherits that through fc2's FP8 backward; BF16 alone
    # costs under 5%. So fc2, the most downstream of the two, climbs the first rung (FP8 -> BF16) alone, and that is
    # enough for both.
    probe = PrecisionProbe(every_n_steps=1)
    fallback = PrecisionFallback(max_grad_error=0.05, grad_error_patience=1)
    plugin = StablePrecision("bf16-mixed", fp8="delayed")
    _fit(plugin, [probe, fallback], PoisonModule(n=128), steps=3)
    first = probe.history[0]
    assert min(first["modules"][m]["rel_error"] for m in ("model.fc1", "model.fc2")) > 0.05
    assert set(first["fp8"]) == {"model.fc2"}
    assert first["fp8"]["model.fc2"]["fp8_rel_error"] > first["fp8"]["model.fc2"]["base_rel_error"]
    decision = fallback.decisions[0]
    assert decision["modules"] == ["model.fc2"] and "left FP8" in decision["effect"]
    assert "['model.fc1'] (before it" in decision["reason"]
    assert plugin.layout.fp8_layers == [] and plugin.islands.names == [] and len(fallback.decisions) == 1
    assert probe.history[1]["fp8"] == {}
    assert max(m["rel_error"] for m in probe.history[1]["modules"].values()) < 0.05


class _Scales(pl.Callback):
    def __init__(self) -> None:
        self.scales: list[float] = []
        self.skipped: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.scales.append(trainer.precision_plugin.loss_scale)
        self.skipped.append(trainer.precision_plugin.last_step_skipped)


def test_measured_underflow_raises_the_adaptive_scale_until_that_overflows() -> None:
    def run(raise_scale: bool) -> tuple[_Scales, AdaptiveLossScaler]:
        torch.manual_seed(0)
        recorder, scaler = _Scales(), AdaptiveLossScaler("cpu", max_scale=None)
        probe = PrecisionProbe(every_n_steps=2, raise_scale=raise_scale)
        _fit(StablePrecision("16-mixed", scaler=scaler), [probe, recorder], Attenuated(2.0**-60), steps=4)
        return recorder, scaler

    (plain, _), (raised, scaler) = run(False), run(True)
    # The probe of step 0 measured fc1 flushing (a quarter of all elements): the headroom (2) was given up before
    # step 0's update, so the scale after it is twice the plain run's ...
    assert raised.scales[0] == 2 * plain.scales[0] and not any(plain.skipped)
    # ... and the headroom was needed (gradients inside backward exceed the parameters'): step 1 overflowed, the
    # headroom came back and further raises wait growth_interval steps.
    assert raised.skipped == [False, True, False, False]
    assert scaler.underflow_boost == 1.0 and scaler.raise_blocked_until == 2 + scaler.get_growth_interval()


# ------------------------------------------------------------------------------------------------ DDP
class _RankWeighted(RankFaultModule):
    """Rank 1's loss x 2**-40 (its FP16 gradients all flush), rank 0's as it is."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * 2.0**-40 if self.global_rank == 1 else loss


class _LocalProbe(pl.Callback):
    """This rank's own measurement of its batch, on the probe's steps (what the probe averages), logging nothing."""

    def __init__(self, probe: PrecisionProbe) -> None:
        self.probe, self.history, self._start = probe, [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        stepper = trainer.precision_plugin.stepper
        self._start = (batch, batch_idx, stepper.forward_state()) if self.probe.is_due(stepper.step_count) else None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._start is None:
            return
        batch, batch_idx, start = self._start

        def loss_fn(module, batch):
            module.trainer = trainer  # the copy: global_rank reads true
            return module.training_step(batch, batch_idx)

        stepper = trainer.precision_plugin.stepper
        self.history.append(stepper.measure(pl_module, loss_fn, batch, recompute=True, start=start,
                                    step=stepper.step_count))


class _SaveHistories(pl.Callback):
    def __init__(self, out_dir: Path, **probes: PrecisionProbe) -> None:
        self.out_dir, self.probes = out_dir, probes

    def on_train_end(self, trainer, pl_module) -> None:
        histories = {name: probe.history for name, probe in self.probes.items()}
        torch.save(histories, self.out_dir / f"probe{trainer.global_rank}.pt")


def test_ddp_each_rank_probes_its_batch_and_the_metrics_are_averaged(tmp_path: Path) -> None:
    probe = PrecisionProbe(every_n_steps=2)
    local = _LocalProbe(probe)
    fallback = PrecisionFallback(max_grad_error=0.4, grad_error_patience=1)
    callbacks = [local, probe, fallback, _SaveHistories(tmp_path, local=local, probe=probe)]
    ranks = fit_ddp(_RankWeighted(), StablePrecision("16-mixed", scaler=None), callbacks, tmp_path, max_steps=6)
    histories = [torch.load(tmp_path / f"probe{r}.pt", weights_only=True) for r in range(2)]
    local0, local1 = histories[0]["local"][0], histories[1]["local"][0]
    assert local0["underflow_frac"] < 0.01 and local1["underflow_frac"] == 1.0  # each rank measured its own batch
    assert histories[0]["probe"] == histories[1]["probe"]  # averaged: the same on both ranks
    averaged = histories[0]["probe"][0]
    for key in ("underflow_frac", "rel_error", "cosine"):
        assert averaged[key] == pytest.approx((local0[key] + local1[key]) / 2, rel=1e-12), key
        for module in averaged["modules"]:
            expected = (local0["modules"][module][key] + local1["modules"][module][key]) / 2
            assert averaged["modules"][module][key] == pytest.approx(expected, rel=1e-12), (module, key)
    # Every layer's averaged error is ~0.5 > 0.4: both ranks lift the same layer per probe, the last first.
    decisions = [r["PrecisionFallback.decisions"] for r in ranks]
    assert decisions[0] == decisions[1]
    assert [d["modules"] for d in decisions[0]] == [["model.fc3"], ["model.fc2"], ["model.fc1"]]
    assert ranks[0]["islands"] == ranks[1]["islands"] == ["model.fc1", "model.fc2", "model.fc3"]
    assert histories[0]["probe"][-1]["rel_error"] < 0.01  # in FP32 rank 1's gradients survive


def test_probe_measures_a_module_holding_torchmetrics_updated_with_the_loss() -> None:
    """The Lightning-Hydra template's module: MeanMetric / Accuracy updated in training_step with the (attached)
    loss. The metric's state is then a non-leaf tensor, which a deep copy of the module refuses."""
    torchmetrics = pytest.importorskip("torchmetrics")

    class WithMetrics(PoisonModule):
        def __init__(self) -> None:
            super().__init__()
            self.train_loss = torchmetrics.MeanMetric()
            self.train_acc = torchmetrics.Accuracy(task="binary")

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.train_loss(loss)  # not detached, as in the template
            self.train_acc((self(batch[0])[:, 0] > 0).long(), (batch[1][:, 0] > 0).long())
            return loss

    module = WithMetrics()
    probe = PrecisionProbe(every_n_steps=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _fit(StablePrecision("bf16-mixed"), [probe], module, steps=3)
    assert not [str(w.message) for w in record if "PrecisionProbe" in str(w.message)]
    assert [r["step"] for r in probe.history] == [0, 1, 2]
    # one scalar update per step: the replays updated the copies' metrics, not the module's
    assert module.train_loss.weight.item() == 3


def test_a_module_that_cannot_be_copied_is_named_without_advising_loss_fn() -> None:
    import threading

    class Locked(PoisonModule):
        def __init__(self) -> None:
            super().__init__()
            self.lock = threading.Lock()  # deepcopy refuses it; a loss_fn gets a copy too, so it cannot help

    probe = PrecisionProbe(every_n_steps=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make_trainer(StablePrecision("bf16-mixed"), max_steps=2, callbacks=[probe]).fit(Locked())
    messages = [str(w.message) for w in record if "PrecisionProbe stops" in str(w.message)]
    assert len(messages) == 1 and "cannot be deep-copied" in messages[0] and "loss_fn" not in messages[0]


@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
def test_16_true_compact_weights_are_probed_on_their_true_gradients(mode: str) -> None:
    # Compact weights keep the gradients scaled until the step: read as true ones, the probe's error was ~ the loss
    # scale and the fallback moved every layer to FP32.
    from trainer_pkg import PrecisionFallback, PrecisionProbe, StablePrecision

    probe = PrecisionProbe(every_n_steps=1)
    fallback = PrecisionFallback(max_grad_error=0.5, grad_error_patience=2)
    module = _fit(StablePrecision("16-true", master_weights=mode), [probe, fallback], steps=4)
    assert len(probe.history) == 4 and all(r["loss_scale"] == 2.0**15 for r in probe.history)
    # FP16 rounding (a ReLU the 16-bit weights flip against the FP32 ones can make a few %), not ~32768
    assert max(r["rel_error"] for r in probe.history) < 0.1 and min(r["cosine"] for r in probe.history) > 0.99
    assert fallback.decisions == [] and {p.dtype for p in module.parameters()} == {torch.float16}

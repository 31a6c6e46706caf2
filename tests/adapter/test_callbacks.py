"""The callbacks: one shared conformance test each, then OverflowMonitor and AMPPreflight in real runs."""

from __future__ import annotations

import csv
import io
import os
import sys
import warnings

import pytest
import torch
from cb_helpers import ActionNames, ListLogger, ManualPoisonModule, PoisonModule, quiet
from helpers import make_trainer
from trainer_pkg import (
    AMPPreflight,
    FaultTriage,
    OverflowMonitor,
    PrecisionFallback,
    PrecisionProbe,
    ScaleCheckpoint,
    StablePrecision,
    pl,
)

import lit_mpstable
from lit_mpstable.callbacks.amp_preflight import compare_outputs
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler

FACTORIES = {
    "OverflowMonitor": lambda: OverflowMonitor(window=3, log_every_n_steps=1),
    "PrecisionFallback": lambda: PrecisionFallback(patience=2, cooldown=2),
    "ScaleCheckpoint": lambda: ScaleCheckpoint(every_n_steps=2),
    "AMPPreflight": lambda: AMPPreflight(),
    "PrecisionProbe": lambda: PrecisionProbe(every_n_steps=2),
    "FaultTriage": lambda: FaultTriage(max_replays=2),
}


def _plugin() -> StablePrecision:
    # BF16 autocast plus a loss scaler, so overflows (injected) exercise every code path quickly on the CPU.
    return StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**8))


# ------------------------------------------------------------------------------------------------ conformance
@pytest.mark.parametrize("name", list(FACTORIES))
def test_conformance_two_fits_and_state_round_trip(name: str) -> None:
    callback = FACTORIES[name]()
    module = PoisonModule(inf_grad_steps={1, 2}, loss_factor={5: 1e6})
    for _ in range(2):  # the same instance in two fits, each with a fresh trainer and plugin
        with quiet():
            make_trainer(_plugin(), max_steps=6, log_every_n_steps=1, callbacks=[callback]).fit(module)
    assert all(torch.isfinite(p).all() for p in module.parameters())

    buffer = io.BytesIO()
    torch.save(callback.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    fresh = FACTORIES[name]()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == callback.state_dict()
    assert fresh.state_key == callback.state_key
    with pytest.raises(KeyError, match="missing keys"):
        fresh.load_state_dict({})



@pytest.mark.parametrize("name", ["OverflowMonitor", "PrecisionFallback", "AMPPreflight", "PrecisionProbe"])
def test_a_callbacks_checkpoint_key_is_formed_once_though_lightning_reads_it_at_every_hook(name) -> None:
    callback = FACTORIES[name]()
    formed = []  # calls into the package's code that forms the key (it names the constructor's arguments)
    package = os.path.dirname(lit_mpstable.__file__)

    def profile(frame, event, arg) -> None:
        if event == "call" and frame.f_code.co_name == "state_key" and frame.f_code.co_filename.startswith(package):
            formed.append(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        with quiet():
            make_trainer(_plugin(), max_steps=4, callbacks=[callback]).fit(PoisonModule())
    finally:
        sys.setprofile(None)
    assert len(formed) == 1 and callback.state_key.startswith(name + "{")

BAD_ARGUMENTS = [
    (OverflowMonitor, dict(window=0), "window"),
    (OverflowMonitor, dict(warn_rate=1.5), "warn_rate"),
    (OverflowMonitor, dict(log_every_n_steps=0), "log_every_n_steps"),
    (PrecisionFallback, dict(patience=0), "patience"),
    (PrecisionFallback, dict(min_scale=-1.0), "min_scale"),
    (PrecisionFallback, dict(mode="layer"), "mode"),
    (PrecisionFallback, dict(cooldown=0), "cooldown"),
    (PrecisionFallback, dict(max_overflow_rate=1.0), "max_overflow_rate"),
    (PrecisionFallback, dict(nonfinite_loss_patience=0), "nonfinite_loss_patience"),
    (PrecisionFallback, dict(window=True), "window"),
    (PrecisionFallback, dict(max_grad_error=0.0), "max_grad_error"),
    (PrecisionFallback, dict(grad_error_patience=0), "grad_error_patience"),
    (PrecisionProbe, dict(every_n_steps=0), "every_n_steps"),
    (PrecisionProbe, dict(raise_scale=1), "raise_scale"),
    (PrecisionProbe, dict(loss_fn="training_step"), "loss_fn"),
    (ScaleCheckpoint, dict(every_n_steps=0), "every_n_steps"),
    (ScaleCheckpoint, dict(max_rollbacks=-1), "max_rollbacks"),
    (AMPPreflight, dict(atol=-1.0), "atol"),
    (AMPPreflight, dict(rtol=float("nan")), "rtol"),
    (AMPPreflight, dict(action="ignore"), "action"),
    (AMPPreflight, dict(forward_fn=3), "forward_fn"),
    (FaultTriage, dict(max_replays=4), "max_replays"),
]


@pytest.mark.parametrize("cls, kwargs, argument", BAD_ARGUMENTS, ids=[f"{c.__name__}-{a}" for c, _, a in BAD_ARGUMENTS])
def test_conformance_bad_arguments_raise_value_error_naming_them(cls, kwargs: dict, argument: str) -> None:
    value = next(iter(kwargs.values()))
    with pytest.raises(ValueError, match=rf"{cls.__name__}\({argument}={value!r}"):
        cls(**kwargs)


def test_precision_fallback_without_stable_precision_warns_once_and_does_nothing() -> None:
    callback = FACTORIES["PrecisionFallback"]()
    module = PoisonModule(loss_factor={3: 1e6})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            trainer = make_trainer(None, precision="bf16-mixed", max_steps=4, log_every_n_steps=1, callbacks=[callback])
            trainer.fit(module)
    ours = [w for w in record if "does nothing" in str(w.message)]
    assert len(ours) == 1 and "PrecisionFallback" in str(ours[0].message) and "StablePrecision" in str(ours[0].message)
    assert callback.state_dict() == FACTORIES["PrecisionFallback"]().state_dict()  # nothing recorded


# ------------------------------------------------------------------------------------------------ OverflowMonitor
class _CountingPlugin(StablePrecision):
    reads = 0

    @property
    def loss_scale(self) -> float:
        type(self).reads += 1
        return super().loss_scale


@pytest.mark.parametrize("with_fallback", [False, True])
def test_overflow_monitor_recommends_precision_fallback_only_when_it_is_not_installed(with_fallback: bool) -> None:
    callbacks = [OverflowMonitor(window=4)] + ([PrecisionFallback(mode="module")] if with_fallback else [])
    trainer = make_trainer(StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**10)),
                           max_steps=8, log_every_n_steps=2, callbacks=callbacks)
    with pytest.warns(UserWarning, match="OverflowMonitor at step 4") as record:
        trainer.fit(PoisonModule(inf_grad_steps={1, 5}, n=128))
    said = " ".join(str(w.message) for w in record if "OverflowMonitor at step" in str(w.message))
    assert ("consider PrecisionFallback" in said) is not with_fallback
    assert ("PrecisionFallback is installed" in said) is with_fallback


def test_overflow_monitor_logs_every_metric_to_loggers_and_progress_bar(tmp_path) -> None:
    CSVLogger = pl.loggers.CSVLogger

    plugin = _CountingPlugin("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**10))
    _CountingPlugin.reads = 0
    monitor = OverflowMonitor(window=4)
    trainer = make_trainer(
        plugin, max_steps=8, log_every_n_steps=2, callbacks=[monitor], logger=CSVLogger(tmp_path, name="run"),
    )
    with pytest.warns(UserWarning, match="OverflowMonitor at step 4: 25.0%"):  # warn_rate 1%
        trainer.fit(PoisonModule(inf_grad_steps={1, 5}, n=128))
    assert _CountingPlugin.reads == 4  # the syncing loss scale is read on logging steps only (8 steps / 2)
    assert set(trainer.progress_bar_metrics) == {"mp/loss_scale", "mp/overflow_rate"}
    # After step 8 the window holds steps 5..8, one of which (index 5) overflowed; the scale backed off twice.
    assert trainer.callback_metrics["mp/overflow_rate"] == pytest.approx(0.25)
    assert trainer.callback_metrics["mp/loss_scale"] == 2.0**8
    assert trainer.callback_metrics["mp/skipped_steps"] == 2
    with open(trainer.logger.log_dir + "/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = [row for row in rows if row.get("mp/loss_scale")]
    assert [int(row["step"]) for row in logged] == [1, 3, 5, 7]  # Lightning's 0-based logging steps
    assert {"mp/fallback_active", "mp/overflow_rate", "mp/skipped_steps"} <= set(rows[0])
    assert "mp/rollbacks" not in rows[0]  # ScaleCheckpoint's fact, and it is not installed: one writer per metric


def test_overflow_monitor_warns_once_per_crossing_naming_blamed_modules() -> None:
    class Blame(PoisonModule):
        def on_after_backward(self) -> None:
            super().on_after_backward()
            if self.global_step in self.inf_grad_steps:
                self.trainer.precision_plugin.stats["blamed_modules"] = ["model.fc2"]

    # Overflows at steps 1-2 (the rate over the first full window is 50%), a clean stretch (it falls to 0), then
    # at 8-9 (it rises again).
    module = Blame(inf_grad_steps={1, 2, 8, 9})
    plugin = StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu"))
    monitor = OverflowMonitor(window=4, warn_rate=0.25, log_every_n_steps=1)
    with pytest.warns(UserWarning) as record:
        make_trainer(plugin, max_steps=10, callbacks=[monitor]).fit(module)
    ours = [str(w.message) for w in record if "OverflowMonitor" in str(w.message)]
    assert len(ours) == 2
    assert "at step 4: 50.0% of the last 4" in ours[0] and "['model.fc2']" in ours[0]
    assert "at step 10: 50.0%" in ours[1]


def test_overflow_monitor_logs_telemetry_on_the_step_it_was_measured_and_rollbacks() -> None:
    class Telemetry(PoisonModule):
        def on_after_backward(self) -> None:
            plugin = self.trainer.precision_plugin
            measured = self.global_step == 2  # only this step's values are fresh (steps 0..3)
            plugin.stats.update(
                grad_norm=torch.tensor(2.5 if measured else 9.0), grad_underflow_frac={"fp16": 0.25, "bf16": 0.125},
                fp8_saturation_frac=0.01, fp8_underflow_frac=torch.tensor([0.02]), blamed_modules=[],
                stats_step=plugin.step_count if measured else -1,
            )

    class NanWeightAt3(pl.Callback):  # inf/NaN in the weights: the ladder's rollback
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step == 3:
                with torch.no_grad():
                    pl_module.model.fc1.weight.view(-1)[0] = float("nan")

    logger = ListLogger()
    callbacks = [NanWeightAt3(), ScaleCheckpoint(every_n_steps=2), OverflowMonitor(log_every_n_steps=1)]
    plugin = StablePrecision("bf16-mixed", telemetry_every_n_steps=None)  # only the stats written above
    trainer = make_trainer(plugin, max_steps=4, callbacks=callbacks, log_every_n_steps=1, logger=logger)
    with quiet():
        trainer.fit(Telemetry())
    assert logger.steps_with("mp/grad_norm") == [2] and logger.values("mp/grad_norm") == [2.5]  # never the stale 9.0
    assert not logger.steps_with("mp/grad_underflow_frac")  # the telemetry's is a forecast: PrecisionProbe measures it
    assert logger.values("mp/fp8_saturation_frac") == [pytest.approx(0.01)]
    assert logger.values("mp/fp8_underflow_frac") == [pytest.approx(0.02)]
    assert trainer.callback_metrics["mp/rollbacks"] == 1 and trainer.callback_metrics["mp/skipped_steps"] == 1


def test_grad_norm_reaches_the_logger_on_the_telemetry_steps_only() -> None:
    logger = ListLogger()
    plugin = StablePrecision("32-true", telemetry_every_n_steps=4)
    trainer = make_trainer(plugin, max_steps=8, log_every_n_steps=2, callbacks=[OverflowMonitor()], logger=logger)
    trainer.fit(PoisonModule(n=128))
    assert logger.steps_with("mp/grad_norm") == [0, 3, 7]  # measured on steps 1, 4 and 8, each logged once
    assert logger.steps_with("mp/skipped_steps") == [1, 3, 5, 7]


# ------------------------------------------------------------------------------------------------ AMPPreflight
def test_compare_outputs_by_hand() -> None:
    ref = torch.tensor([1.0, -4.0, 2.0])
    result = compare_outputs(ref, torch.tensor([1.0, -3.9, 2.0]), atol=0.0, rtol=0.05)
    assert result["max_abs_error"] == pytest.approx(0.1, rel=1e-5) and result["ref_max_abs"] == 4.0
    assert result["max_rel_error"] == pytest.approx(0.025, rel=1e-5) and result["passed"]
    assert not compare_outputs(ref, torch.tensor([1.0, -3.7, 2.0]), atol=0.0, rtol=0.05)["passed"]
    inf = compare_outputs(ref, torch.tensor([1.0, float("inf"), 2.0]), atol=1.0, rtol=1.0)
    assert inf["nonfinite"] == 1 and not inf["passed"]


def _fit_with(preflight, precision: str, module: PoisonModule, steps: int = 3):
    plugin = StablePrecision(precision)
    callbacks = [preflight] if preflight is not None else []
    make_trainer(plugin, max_steps=steps, callbacks=callbacks).fit(module)
    return plugin


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_preflight_passes_and_leaves_training_untouched(precision: str) -> None:
    torch.manual_seed(0)
    reference = PoisonModule(optimizer="adamw", lr=1e-2)
    _fit_with(None, precision, reference)
    rng_reference = torch.get_rng_state()
    torch.manual_seed(0)
    module = PoisonModule(optimizer="adamw", lr=1e-2)
    preflight = AMPPreflight()
    plugin = _fit_with(preflight, precision, module)
    assert preflight.result["passed"] and 0 < preflight.result["max_rel_error"] < 0.05
    assert not plugin.fallback_active
    assert torch.equal(torch.get_rng_state(), rng_reference)
    for ours, ref in zip(module.parameters(), reference.parameters()):
        assert ours.dtype == ref.dtype and torch.equal(ours, ref)


def test_a_passing_preflight_says_so(caplog) -> None:
    import logging

    with caplog.at_level(logging.INFO):
        _fit_with(AMPPreflight(), "bf16-mixed", PoisonModule(), steps=1)
    assert any("AMPPreflight: the bf16-mixed forward agrees with FP32" in r.message and "max rel error" in r.message
               for r in caplog.records)


class _NoForward(PoisonModule):
    """Everything in training_step, as many LightningModules are written: no forward() to call."""

    forward = pl.LightningModule.forward

    def training_step(self, batch, batch_idx):
        self.log("train_loss", 1.0)  # must not reach the logs from the check
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x).float(), y)


def test_preflight_runs_through_training_step_without_forward() -> None:
    preflight = AMPPreflight()
    _fit_with(preflight, "bf16-mixed", _NoForward(), steps=1)
    assert preflight.result["passed"] and 0 < preflight.result["max_rel_error"] < 0.05
    amplified = AMPPreflight()
    with quiet():
        plugin = _fit_with(amplified, "16-mixed", _NoForward(amplify=True), steps=1)
    assert not amplified.result["passed"] and plugin.compute_dtype == torch.float32  # FP16 overflow caught


class _NoBatchIdx(_NoForward):
    """``def training_step(self, batch)``: no ``batch_idx``, which Lightning accepts."""

    def training_step(self, batch):  # type: ignore[override]
        return super().training_step(batch, 0)


def test_preflight_and_probe_run_a_training_step_without_batch_idx() -> None:
    # Both replay training_step; with the two-argument call of Lightning's own loop they had failed with a TypeError
    # and warned that they skip (the preflight) or stop probing (the probe).
    preflight = AMPPreflight()
    _fit_with(preflight, "bf16-mixed", _NoBatchIdx(), steps=1)
    assert preflight.result["passed"] and 0 < preflight.result["max_rel_error"] < 0.05
    histories = []
    for module_class in (_NoForward, _NoBatchIdx):  # the probe measures alike with and without batch_idx
        torch.manual_seed(0)
        probe = PrecisionProbe(every_n_steps=2)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="PrecisionProbe")  # a probe that stops warns
            make_trainer(StablePrecision("bf16-mixed"), max_steps=4, callbacks=[probe]).fit(module_class())
        histories.append(probe.history)
    assert len(histories[1]) >= 2 and histories[1] == histories[0]


def test_preflight_falls_back_before_the_first_fp16_step() -> None:
    preflight = AMPPreflight()
    with quiet():
        plugin = _fit_with(preflight, "16-mixed", PoisonModule(amplify=True), steps=3)
    assert preflight.result["nonfinite"] > 0 and not preflight.result["passed"]
    assert plugin.compute_dtype == torch.float32
    assert plugin.overflow_count == 0  # even the first batch ran in FP32


def test_preflight_whose_forward_fails_warns_and_training_goes_on() -> None:
    def broken(module, batch):
        raise KeyError("no such input")

    preflight = AMPPreflight(forward_fn=broken)
    with pytest.warns(UserWarning, match=r"AMPPreflight skipped: .*KeyError.*no such input"):
        plugin = _fit_with(preflight, "bf16-mixed", PoisonModule(), steps=2)
    assert preflight.result == {} and not plugin.fallback_active and plugin.step_count == 2


def test_preflight_tight_tolerance_reports_the_measured_error() -> None:
    with quiet():
        plugin = _fit_with(AMPPreflight(rtol=1e-7), "bf16-mixed", PoisonModule(), steps=1)
    assert plugin.compute_dtype == torch.float32
    with pytest.warns(UserWarning, match=r"max abs error [0-9.e-]+, max rel error [0-9.e-]+ .*rtol=1e-07"):
        plugin = _fit_with(AMPPreflight(rtol=1e-7, action="warn"), "bf16-mixed", PoisonModule(), steps=1)
    assert not plugin.fallback_active
    with pytest.raises(RuntimeError, match="disagrees with FP32"):
        _fit_with(AMPPreflight(rtol=1e-7, action="raise"), "bf16-mixed", PoisonModule(), steps=1)


def test_preflight_climbs_out_of_fp8_and_stops_where_outputs_agree() -> None:
    # FP8 (E4M3, 3 mantissa bits) is off by ~3% on TinyMLP, BF16 alone by ~0.5%: with rtol=2% the first check
    # fails, the plugin leaves FP8, and the second check (against an FP32 copy without FP8 layers) passes.
    from lit_mpstable.fp8 import FP8Linear

    preflight = AMPPreflight(rtol=0.02)
    module = PoisonModule()
    plugin = StablePrecision("bf16-mixed", fp8="delayed")
    assert any(isinstance(m, FP8Linear) for m in plugin.convert_module(module).modules())
    with quiet():
        make_trainer(plugin, max_steps=2, callbacks=[preflight]).fit(module)
    assert preflight.result["passed"] and preflight.result["max_rel_error"] < 0.02
    assert plugin.compute_dtype == torch.bfloat16 and plugin.fallback_active
    assert not any(isinstance(m, FP8Linear) for m in module.modules())


def test_the_overflow_window_updates_on_the_host_and_shows_every_update_when_read():
    """WindowedCounts.update (every step) launches no tensor op; counts, compute and a load see every update."""
    from helpers import OpNames

    from lit_mpstable.callbacks._common import WindowedCounts

    window = WindowedCounts(3)
    with OpNames() as ops:
        for step in range(5):  # wraps around: slots 0 and 1 written twice
            window.update(int(step == 3), int(step == 3), 1)
    assert ops.names == []
    assert window.counts.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]
    assert window.compute().tolist() == [1.0, 1.0, 3.0] and window.position == 5
    window.update(0, 0, 1)  # slot 2, pending: a load overwrites it
    window.counts.copy_(torch.full((3, 3), 2.0))
    assert window.compute().tolist() == [6.0, 6.0, 6.0]
    window.reset()
    assert window.counts.sum().item() == 0 and window.position == 0


def test_the_overflow_windows_per_step_record_writes_no_module_attribute_and_is_seen_by_compute():
    """WindowedCounts.record (OverflowMonitor's per-step call) skips torchmetrics' update wrapper and nn.Module's
    __setattr__ (~2 us a write), yet a compute cached before it is not returned after it."""
    from lit_mpstable.callbacks._common import WindowedCounts

    window = WindowedCounts(3)
    window.record(1, 1, 1)
    assert window.compute().tolist() == [1.0, 1.0, 1.0]  # cached by torchmetrics
    writes = []
    original = type(window).__setattr__
    type(window).__setattr__ = lambda self, name, value: (writes.append(name), original(self, name, value))[1]
    try:
        for _ in range(4):
            window.record(0, 0, 1)
    finally:
        del type(window).__setattr__  # Metric's again
    assert writes == ["_computed", "_update_count"]  # once, after the cached compute; no per-step position write
    assert window.compute().tolist() == [0.0, 0.0, 3.0] and window.position == 5


def test_lightning_dispatches_only_the_per_step_hooks_a_callback_implements():
    """Lightning dispatches every hook of every callback each step (~12 Python calls each, in its profiler's
    context) but skips one that is not callable: the per-step hooks a callback leaves to pl.Callback are None on
    the instance, so only those it implements run. A subclass's own hook still runs. OverflowMonitor's batch start
    (it prepares the indicators' logging steps) is dispatched only with indicators or attention; AMPPreflight's batch
    end (it only watches the steps for the ladder) only where no other face surely watches them (here
    ScaleCheckpoint does: tests/adapter/test_spike_guard.py)."""
    class Watching(OverflowMonitor):
        backwards = 0

        def on_after_backward(self, trainer, pl_module) -> None:
            Watching.backwards += 1

    profiler = ActionNames()
    callbacks = [AMPPreflight(), OverflowMonitor(), PrecisionFallback(), ScaleCheckpoint(), Watching(window=7),
                 OverflowMonitor(window=9, indicators=True)]
    with quiet():
        make_trainer(StablePrecision("bf16-mixed"), max_steps=3, callbacks=callbacks, profiler=profiler).fit(
            PoisonModule())
    per_step = {"on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
                "on_before_zero_grad", "on_train_batch_end"}
    seen = {(cb.state_key, hook) for cb in callbacks for hook in per_step
            if f"[Callback]{cb.state_key}.{hook}" in profiler.names}
    assert seen == {
        (callbacks[0].state_key, "on_train_batch_start"),
        (callbacks[1].state_key, "on_train_batch_end"),
        (callbacks[2].state_key, "on_before_backward"), (callbacks[2].state_key, "on_train_batch_end"),
        (callbacks[3].state_key, "on_train_batch_end"),
        (callbacks[4].state_key, "on_train_batch_end"), (callbacks[4].state_key, "on_after_backward"),
        (callbacks[5].state_key, "on_train_batch_start"), (callbacks[5].state_key, "on_train_batch_end"),
    }
    assert Watching.backwards == 3
    assert f"[Callback]{callbacks[0].state_key}.on_train_epoch_start" in profiler.names  # not per step: as always


def test_amp_preflight_leaves_the_per_step_dispatch_once_its_check_is_done():
    """AMPPreflight's batch-start hook only runs the check owed at the run's first batch: Lightning dispatches it
    (~12 Python calls a step) until then, and again at the next fit's first batch, not at every step."""
    preflight = AMPPreflight()
    action = f"[Callback]{preflight.state_key}.on_train_batch_start"
    for steps in (3, 5):  # a second fit checks its first batch again
        profiler = ActionNames()
        with quiet():
            make_trainer(StablePrecision("bf16-mixed"), max_steps=steps, callbacks=[preflight],
                         profiler=profiler).fit(PoisonModule())
        assert profiler.names.count(action) == 1 and not preflight.pending
        assert preflight.result["step"] == 0 and preflight.result["passed"]


class _ReadsPerBatch(pl.Callback):
    """The host reads (``HostReads``) from one batch end to the next, Lightning's own work between them included."""

    def __init__(self, reads) -> None:
        self.reads, self.seen, self.per_batch = reads, 0, []

    def on_train_batch_end(self, *args) -> None:
        self.per_batch.append(len(self.reads.ops) - self.seen)
        self.seen = len(self.reads.ops)


def test_logged_metrics_are_not_read_again_on_the_batches_after_their_logging_step() -> None:
    """Lightning keeps a value logged on one step and reads it again at every later batch end of the epoch (an
    ``.item()`` a progress-bar metric): with a loss scaler, two host reads a step for mp/loss_scale and
    mp/overflow_rate. The callbacks take their values out of Lightning's step results at the batch after their logging
    step; what was shown stays."""
    from helpers import HostReads

    callbacks = [OverflowMonitor(window=4), ScaleCheckpoint(every_n_steps=100), FaultTriage()]
    with HostReads() as reads, quiet():
        counter = _ReadsPerBatch(reads)
        trainer = make_trainer(_plugin(), max_steps=12, log_every_n_steps=5, callbacks=[*callbacks, counter])
        trainer.fit(PoisonModule(n=16 * 12))
    # [i]: reads up to batch i's end since the end before it; Lightning reads what a logging step logged after
    # that step's callbacks (steps 5 and 10: indices 4 and 9), so in the next entry (5, 10)
    per_batch = counter.per_batch
    clean = per_batch[1]
    assert per_batch[6:9] == [clean] * 3 and per_batch[11] == clean, per_batch
    assert set(trainer.progress_bar_metrics) == {"mp/loss_scale", "mp/overflow_rate"}
    assert trainer.callback_metrics["mp/loss_scale"] == 2.0**8
    assert {"mp/rollbacks", "mp/triage_events", "mp/skipped_steps"} <= set(trainer.callback_metrics)


def test_a_monitor_with_its_own_period_is_not_logged_again_as_if_fresh() -> None:
    """OverflowMonitor(log_every_n_steps=4) under a trainer logging every 3 steps: its values reach the loggers on its
    own logging steps that are the trainer's too (12), never again at the trainer's later ones (6, 9) as if fresh."""
    logger = ListLogger()
    with quiet():
        make_trainer(_plugin(), max_steps=12, log_every_n_steps=3, logger=logger,
                     callbacks=[OverflowMonitor(window=4, log_every_n_steps=4)]).fit(PoisonModule(n=16 * 12))
    assert logger.steps_with("mp/overflow_rate") == [11]  # Lightning's 0-based step of global step 12


def test_a_metric_logged_again_skips_lightnings_log_and_ends_where_log_puts_it(monkeypatch) -> None:
    """After a name's first log from a hook, the callbacks put its value into Lightning's stored result themselves
    (``log``'s checks and device walk cost ~250 us a name): loggers, ``callback_metrics``, the progress bar and
    ``logged_metrics`` end exactly as through ``LightningModule.log``, over epochs (each epoch's first batch goes
    through ``log``, which resets the hook's results), with the module's own metrics beside ours."""
    import lit_mpstable.callbacks._common as common

    class Logs(PoisonModule):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("train/loss", loss.detach(), prog_bar=True)
            return loss

    def fit(fast: bool) -> tuple[pl.Trainer, list, int]:
        calls = []
        if not fast:
            monkeypatch.setattr(common, "_relogged", lambda *args, **kwargs: False)
        monkeypatch.setattr(pl.LightningModule, "log", lambda self, name, *a, _log=pl.LightningModule.log, **k: (
            calls.append(name), _log(self, name, *a, **k))[1])
        logger = ListLogger()
        callbacks = [OverflowMonitor(window=4, log_every_n_steps=1), ScaleCheckpoint(every_n_steps=3), FaultTriage()]
        trainer = make_trainer(_plugin(), max_steps=12, log_every_n_steps=2, logger=logger, callbacks=callbacks)
        torch.manual_seed(0)  # the same model and data in both fits
        with quiet():  # 4 batches an epoch: 3 epochs; overflows move the scale, a triage logs off a logging step
            trainer.fit(Logs(inf_grad_steps={1, 2, 6}, loss_factor={9: float("inf")}, n=64))
        monkeypatch.undo()
        return trainer, logger.rows, sum(name.startswith("mp/") for name in calls)

    fast, fast_rows, fast_calls = fit(True)
    slow, slow_rows, slow_calls = fit(False)
    assert fast_rows == slow_rows and any("mp/rollbacks" in row for _, row in fast_rows)
    for view in ("callback_metrics", "progress_bar_metrics", "logged_metrics"):
        assert {k: float(v) for k, v in getattr(fast, view).items()} == {
            k: float(v) for k, v in getattr(slow, view).items()}, view
    assert set(fast.progress_bar_metrics) == {"train/loss", "mp/loss_scale", "mp/overflow_rate"}
    # Through log: each name's first log, and every name on each epoch's first batch; the other logs skip it.
    assert slow_calls > 3 * fast_calls > 0


def test_a_lightning_without_the_stored_results_internals_logs_through_log() -> None:
    """Where Lightning's stored results lack what the shortcut reads (another release), the shortcut declines (the
    metric goes through ``LightningModule.log``) before it writes anything."""
    from types import SimpleNamespace

    from lit_mpstable.callbacks._common import _relogged

    written: list[str] = []

    def module(meta: object, connector: object) -> pl.LightningModule:
        item = SimpleNamespace(meta=meta, is_tensor=True, value=torch.zeros(()))
        results = SimpleNamespace(dataloader_idx=None, get=lambda key: item,
                                  update_metrics=lambda key, value, size: written.append(key))
        trainer = SimpleNamespace(_results=results, _logger_connector=connector)
        return SimpleNamespace(_trainer=trainer, _current_fx_name="on_train_batch_end",  # type: ignore[return-value]
                               device=torch.device("cpu"))

    full = dict(prog_bar=False, logger=True, on_step=True, on_epoch=False, enable_graph=False,
                is_mean_reduction=True, metric_attribute=None, sync=SimpleNamespace(should=False))
    connector = SimpleNamespace(should_reset_tensors=lambda fx: False, _current_fx=None)
    assert _relogged(module(SimpleNamespace(**full), connector), "mp/loss_scale", 2.0, prog_bar=False)
    assert written == ["on_train_batch_end.mp/loss_scale"] and connector._current_fx == "on_train_batch_end"
    written.clear()
    for missing in full:  # a field renamed in the metadata
        meta = SimpleNamespace(**{k: v for k, v in full.items() if k != missing})
        assert not _relogged(module(meta, connector), "mp/loss_scale", 2.0, prog_bar=False), missing
    assert not _relogged(module(SimpleNamespace(**full), SimpleNamespace()), "mp/loss_scale", 2.0, prog_bar=False)
    assert written == []


@pytest.mark.parametrize("automatic", [True, False])
def test_the_faces_read_the_global_step_off_lightnings_own_counter(tmp_path, automatic: bool) -> None:
    """``optimizer_steps(trainer).completed`` is ``trainer.global_step`` at every batch end (the faces read it there
    instead of the property's six calls), in automatic and manual optimization, and after a checkpoint load; where the
    loop holds no such counter, the property itself."""
    from types import SimpleNamespace

    from lit_mpstable.callbacks._common import optimizer_steps

    class Compare(pl.Callback):
        def __init__(self) -> None:
            self.pairs: list[tuple[int, int]] = []

        def on_fit_start(self, trainer, pl_module) -> None:
            self.counter = optimizer_steps(trainer)

        def on_train_batch_end(self, trainer, *args) -> None:
            self.pairs.append((self.counter.completed, trainer.global_step))

    path = str(tmp_path / "mid.ckpt")
    # (A checkpoint of a manual-optimization run fails in the plugin's fingerprint capture: resumed automatic only.)
    for ckpt_path, steps in ((None, 3), (path, 6))[:2 if automatic else 1]:
        compare = Compare()
        with quiet():
            plugin = _plugin() if automatic else StablePrecision("bf16-mixed")
            trainer = make_trainer(plugin, max_steps=steps, callbacks=[OverflowMonitor(), compare])
            trainer.fit(PoisonModule() if automatic else ManualPoisonModule(), ckpt_path=ckpt_path)
        if ckpt_path is None and automatic:
            trainer.save_checkpoint(path)
        assert [a for a, _ in compare.pairs] == [b for _, b in compare.pairs] == [steps - 2, steps - 1, steps]
    stub = SimpleNamespace(lightning_module=None, fit_loop=SimpleNamespace(), global_step=7)
    assert optimizer_steps(stub).completed == 7  # type: ignore[arg-type]

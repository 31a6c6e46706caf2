"""FaultTriage through a real Trainer on the CPU: each kind of fault classified and acted on, clean steps untouched."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from cb_helpers import PoisonModule, fp16_scaler_plugin, quiet
from helpers import HostReads, make_trainer
from trainer_pkg import NAME, ScaleCheckpoint, StablePrecision, pl

from lit_mpstable.callbacks import FaultTriage
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler
from lit_mpstable.core.step.step_guard import STATE_SHARES
from lit_mpstable.faults import FaultInjector

pytestmark = pytest.mark.skipif(NAME != "lightning.pytorch", reason="FaultInjector is a lightning.pytorch callback")


class Forwards(pl.Callback):
    """Counts the model's forward calls in training (one per batch without replays)."""

    def __init__(self) -> None:
        self.calls = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self._handle = pl_module.model.register_forward_hook(self._count)

    def _count(self, *args) -> None:
        self.calls += 1

    def on_train_end(self, trainer, pl_module) -> None:
        self._handle.remove()


class CorruptState(pl.Callback):
    """Writes a NaN into fc1's weight, or its momentum buffer, at the start of one step (as after a bit flip in
    memory)."""

    def __init__(self, step: int, where: str = "weight", rank: int | None = None) -> None:
        self.step, self.where, self.rank = step, where, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            weight = pl_module.model.fc1.weight
            target = weight if self.where == "weight" else trainer.optimizers[0].state[weight]["momentum_buffer"]
            with torch.no_grad():
                target.view(-1)[3] = float("nan")


def seeded(**kwargs) -> PoisonModule:
    torch.manual_seed(0)
    return PoisonModule(**kwargs)


def fit(module, callbacks, precision="32-true", max_steps=4, plugin=None):
    plugin = plugin or StablePrecision(precision)
    with quiet():
        make_trainer(plugin, callbacks=callbacks, max_steps=max_steps).fit(module)
    return plugin


def weights(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("bad", [0, 4, 1.5, True, "3"])
def test_max_replays_is_validated(bad):
    with pytest.raises(ValueError, match=r"FaultTriage\(max_replays=.*\): must be an int in \[1, 3\]"):
        FaultTriage(bad)


@pytest.mark.parametrize("kwargs, words", [
    (dict(replay_budget=0), "replay_budget=0"), (dict(replay_budget=2), "replay_budget=2"),
    (dict(replay_budget=1.5), "replay_budget=1.5"), (dict(replay_budget=True), "replay_budget=True"),
    (dict(max_replays=1, replay_budget=0), "replay_budget=0"), (dict(budget_window=0), "budget_window=0"),
    (dict(budget_window="100"), "budget_window='100'"),
])
def test_replay_budget_is_validated(kwargs, words):
    with pytest.raises(ValueError, match=r"FaultTriage\(") as info:
        FaultTriage(**kwargs)
    assert words in str(info.value)


def test_replay_budget_caps_replays_then_warns_once_and_skips():
    # A fault on every step: without a budget each was replayed up the ladder (2 replays here: no snapshot), 2-3x the
    # time. A full climb (max_replays=3) is started only while the last budget_window steps leave room for it.
    triage = FaultTriage(replay_budget=6, budget_window=10)
    plugin = StablePrecision("32-true")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(plugin, callbacks=[triage, FaultInjector({s: "nan_batch" for s in range(14)})],
                     max_steps=14).fit(seeded())
    said = [str(w.message) for w in caught if "replay budget" in str(w.message)]
    assert len(said) == 1 and "replay_budget=6" in said[0] and "budget_window=10" in said[0], said
    # Steps 0 and 1 spend 4 replays; 2-9 find no room for 3 more within (step - 10, step]; at step 10 step 0 has left
    # the window (2 spent), at 11 step 1 too (step 10's 2 spent); 12 and 13 again find 4 spent.
    assert [e["step"] for e in triage.events] == [0, 1, 10, 11] and triage.replays_run == 8
    assert triage.over_budget == 10 and plugin.skipped_steps == 14


def test_default_budget_bounds_a_fault_on_every_step():
    triage = FaultTriage()
    fit(seeded(), [triage, FaultInjector({s: "nan_batch" for s in range(30)})], max_steps=30)
    # 12 replays per 100 steps by default: 5 events of 2 replays (a 6th would have no room for a full climb of 3).
    assert triage.replays_run == 10 and [e["step"] for e in triage.events] == [0, 1, 2, 3, 4]


def test_clean_steps_run_no_replay():
    triage, forwards = FaultTriage(), Forwards()
    fit(seeded(), [triage, forwards])
    assert forwards.calls == 4 and triage.replays_run == 0 and triage.events == []


def test_clean_steps_add_no_host_read():
    def reads(callbacks) -> list[str]:
        with HostReads() as seen:
            fit(seeded(), callbacks)
        return seen.ops

    assert reads([FaultTriage()]) == reads([])


def test_events_survive_a_checkpoint_resume(tmp_path):
    triage, path = FaultTriage(), tmp_path / "mid.ckpt"
    injector = FaultInjector({1: "nan_batch"})  # the entries its 4 steps reach: one past them would be refused
    trainer = make_trainer(StablePrecision("32-true"), callbacks=[triage, injector], max_steps=4)
    with quiet():
        trainer.fit(seeded())
    trainer.save_checkpoint(path)
    resumed = FaultTriage()
    with quiet():
        make_trainer(StablePrecision("32-true"), callbacks=[resumed, FaultInjector({1: "nan_batch", 5: "transient"})],
                     max_steps=6).fit(seeded(), ckpt_path=path)
    assert [(e["step"], e["kind"]) for e in resumed.events] == [(1, "data"), (5, "transient")]
    assert resumed.events[0] == triage.events[0] and resumed.replays_run == triage.replays_run + 1


def test_transient_uses_the_replay_and_matches_a_fault_free_run():
    clean = seeded()
    fit(clean, [])
    module, triage, forwards = seeded(), FaultTriage(), Forwards()
    plugin = fit(module, [triage, FaultInjector({2: "transient"}), forwards])
    assert [(e["step"], e["kind"], e["action"]) for e in triage.events] == [(2, "transient", "use_replay")]
    assert triage.events[0]["replays"] == ["as_is:clean"] and forwards.calls == 5  # one replay, on the event only
    assert plugin.skipped_steps == 1 and plugin.step_count == 5  # the rejected execution, then the replay's step
    for name, value in weights(clean).items():
        torch.testing.assert_close(weights(module)[name], value, rtol=1e-6, atol=1e-7)


class _StepWeighted(PoisonModule):
    """A loss weighted by the step (a warmup of an auxiliary loss, KL annealing), and the steps its forward saw."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(self.global_step)
        return super().training_step(batch, batch_idx) * min(1.0, (self.global_step + 1) / 4)


def test_a_replay_runs_at_the_step_it_replays():
    # The replay runs from the batch end, after Lightning counted the rejected step: its training_step saw the next
    # global_step, and a step-weighted loss was replayed as another step's.
    torch.manual_seed(0)
    clean = _StepWeighted()
    fit(clean, [])
    torch.manual_seed(0)
    module, triage = _StepWeighted(), FaultTriage()
    fit(module, [triage, FaultInjector({2: "transient"})])
    assert [(e["step"], e["kind"]) for e in triage.events] == [(2, "transient")]
    assert module.seen == [0, 1, 2, 2, 3] and clean.seen == [0, 1, 2, 3]
    for name, value in weights(clean).items():
        torch.testing.assert_close(weights(module)[name], value, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("precision", ["16-mixed", "16-true"])
def test_a_transient_fault_leaves_the_loss_scale_of_a_fault_free_run(precision):
    # The rejected execution's overflow was the fault's, not the scale's: its backoff is undone (the loss scale once
    # only fell: every transient fault halved it for good), and the clean replay's step counts towards growth as the
    # fault-free step did. The overflow and the skip stay counted.
    clean_plugin = fit(seeded(), [], precision)
    module, triage = seeded(), FaultTriage()
    plugin = fit(module, [triage, FaultInjector({1: "transient", 2: "transient"})], precision)
    assert [e["kind"] for e in triage.events] == ["transient", "transient"]
    assert plugin.loss_scale == clean_plugin.loss_scale and plugin.overflow_count == 2
    assert plugin.scaler.state_dict()["_growth_tracker"] == clean_plugin.scaler.state_dict()["_growth_tracker"]


def test_a_transient_fault_on_a_step_that_overflows_anyway_is_transient_at_the_backed_off_scale():
    """Step 0 overflows at its loss scale (2**40) with or without the fault. The as-is replay, at the scale the undone
    backoff restored, overflows again: the scaler's business, not a precision fault (its FP32 replay came out clean
    and moved a layer to FP32 for good). The backoff stands, and the as-is replay at the backed-off scale decides."""

    def plugin():
        return StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-30))

    clean_plugin = fit(seeded(), [], plugin=plugin())
    assert clean_plugin.skipped_steps == 1  # the fault-free run overflows at step 0 too
    triage = FaultTriage()
    ours = fit(seeded(), [triage, FaultInjector({0: "transient"})], plugin=plugin())
    assert [(e["step"], e["kind"], e["action"]) for e in triage.events] == [(0, "transient", "use_replay")]
    assert triage.events[0]["replays"] == ["as_is:overflow", "as_is:clean"] and triage.replays_run == 2
    assert not ours.fallback_active and not ours.islands.names
    assert ours.loss_scale == clean_plugin.loss_scale == 2.0**10 and ours.overflow_count == 1


class _Metered(PoisonModule):
    """Counts its rows and averages its outputs in ``torchmetrics`` metrics updated by ``training_step`` (logged per
    epoch), as Lightning's docs show."""

    def __init__(self) -> None:
        super().__init__()
        torchmetrics = pytest.importorskip("torchmetrics")
        self.rows, self.mean_output = torchmetrics.SumMetric(), torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x).float()
        self.rows.update(torch.tensor(float(len(x))))
        self.mean_output(out)
        self.log("mean_output", self.mean_output, on_step=False, on_epoch=True)
        return torch.nn.functional.mse_loss(out, y)

    def on_train_epoch_end(self) -> None:  # before Lightning computes and resets the logged metric
        self.epoch_mean = self.mean_output.compute()


@pytest.mark.parametrize("schedule", [{2: "transient"}, {1: "nan_batch"}])
def test_torchmetrics_count_a_triaged_batch_once(schedule):
    """A replay runs ``training_step`` again: the metrics it updates start from their state at the step's start, so
    an applied replay counts its batch once (the clean run's values), and a batch left skipped counts as without
    FaultTriage (its rejected execution's update)."""
    torch.manual_seed(0)
    clean = _Metered()
    fit(clean, [FaultInjector(schedule)] if "nan_batch" in schedule.values() else [])
    torch.manual_seed(0)
    module, triage = _Metered(), FaultTriage()
    fit(module, [triage, FaultInjector(schedule)])
    assert triage.replays_run >= 1 and len(triage.events) == 1
    assert float(module.rows.compute()) == float(clean.rows.compute()) == 64.0
    torch.testing.assert_close(module.epoch_mean, clean.epoch_mean, equal_nan=True)


def test_clean_steps_add_no_host_read_with_torchmetrics():
    def reads(callbacks) -> list[str]:
        torch.manual_seed(0)
        with HostReads() as seen:
            fit(_Metered(), callbacks)
        return seen.ops

    assert reads([FaultTriage()]) == reads([])


def with_batchnorm(module: PoisonModule) -> PoisonModule:
    """``module`` with a BatchNorm after fc1: running statistics that every training forward changes."""
    module.model.fc1 = torch.nn.Sequential(module.model.fc1, torch.nn.BatchNorm1d(32))
    return module


def test_a_replayed_or_skipped_step_leaves_batchnorm_as_the_step_before_left_it():
    clean = with_batchnorm(seeded())
    fit(clean, [])
    module = with_batchnorm(seeded())
    fit(module, [FaultTriage(), FaultInjector({2: "transient"})])
    bn = module.model.fc1[1]
    assert int(bn.num_batches_tracked) == 4  # the replayed batch counted once
    for name, value in weights(clean).items():  # buffers included
        torch.testing.assert_close(weights(module)[name], value, rtol=1e-6, atol=1e-7)
    skipped = with_batchnorm(seeded())
    triage = FaultTriage()
    plugin = fit(skipped, [triage, FaultInjector({1: "nan_batch"})])
    assert [e["kind"] for e in triage.events] == ["data"] and plugin.skipped_steps == 1
    bn = skipped.model.fc1[1]
    assert int(bn.num_batches_tracked) == 3 and torch.isfinite(bn.running_mean).all()
    assert torch.isfinite(bn.running_var).all()


def test_transient_keeps_the_lr_schedule_of_a_fault_free_run():
    clean = seeded(scheduler=True)
    fit(clean, [], max_steps=6)
    module = seeded(scheduler=True)
    fit(module, [FaultTriage(), FaultInjector({1: "transient"})], max_steps=6)
    assert module.lr_schedulers().get_last_lr() == clean.lr_schedulers().get_last_lr()
    for name, value in weights(clean).items():
        torch.testing.assert_close(weights(module)[name], value, rtol=1e-6, atol=1e-7)


class _EveryOther(PoisonModule):
    """Its per-step scheduler steps every other batch (``frequency=2``), every step a decay."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 2}}


@pytest.mark.parametrize("fault_step", [0, 1, 2])
def test_transient_keeps_a_schedule_of_frequency_2_as_a_fault_free_run(fault_step):
    """An applied replay steps the schedulers the rejected step held, and only those: with ``frequency=2`` the step
    after an applied one is not held (the scheduler stepped once already), and stepping it again halved the LR twice."""
    torch.manual_seed(0)
    clean = _EveryOther()
    fit(clean, [], max_steps=6)
    torch.manual_seed(0)
    module = _EveryOther()
    fit(module, [FaultTriage(), FaultInjector({fault_step: "transient"})], max_steps=6)
    assert module.lr_schedulers().get_last_lr() == clean.lr_schedulers().get_last_lr()
    for name, value in weights(clean).items():
        torch.testing.assert_close(weights(module)[name], value, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("precision", ["16-mixed", "16-true"])  # '16-true': the FP32 replay casts the FP16 batch
def test_precision_fault_falls_back_the_blamed_module(precision):
    triage = FaultTriage()
    plugin = StablePrecision(precision)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(plugin, callbacks=[triage, FaultInjector({1: "fp16_overflow"}, module="model.fc2")],
                     max_steps=3).fit(seeded())
    # The step the fallback answers, not the plugin's count of executions (the rejected one and the replays).
    assert any("fallback at step 1: ['model.fc2']" in str(w.message) for w in caught)
    (event,) = triage.events
    assert (event["step"], event["kind"], event["action"]) == (1, "precision", "fallback")
    assert event["replays"] == ["as_is:nonfinite", "fp32:clean"] and event["blamed"] == ["model.fc2"]
    assert "model.fc2" in plugin.islands.names and plugin.compute_dtype == torch.float16  # only fc2 left FP16


def test_nan_batch_is_data_and_the_batch_stays_skipped():
    module, triage = seeded(), FaultTriage()
    start = weights(seeded())
    checkpoint = ScaleCheckpoint(every_n_steps=1)
    fit(module, [checkpoint, triage, FaultInjector({1: "nan_batch"})], max_steps=2)  # before the injector's undo
    (event,) = triage.events
    assert (event["step"], event["kind"], event["action"], event["batch_idx"]) == (1, "data", "skip", 1)
    assert event["replays"] == ["as_is:nonfinite", "fp32:nonfinite", "snapshot:nonfinite"]
    assert triage.skipped_batches == [1] and checkpoint.rollbacks == 0
    # Only step 0 applied: the trial from the snapshot (step 1's weights) was undone.
    expected = seeded()
    fit(expected, [], max_steps=1)
    assert all(torch.equal(weights(module)[k], v) for k, v in weights(expected).items())
    assert any(not torch.equal(weights(module)[k], v) for k, v in start.items())


def test_triage_never_reorders_the_callbacks_and_warns_when_listed_after_the_injector():
    # It once moved itself to the front of trainer.callbacks: no callback reorders them now (the ladder decides each
    # step once, whichever face sees it first); listed after FaultInjector, which restores its batch at batch end, it
    # says so.
    triage, injector = FaultTriage(), FaultInjector({1: "nan_batch"})
    trainer = make_trainer(StablePrecision("32-true"), callbacks=[injector, triage], max_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(seeded())
    assert trainer.callbacks.index(injector) < trainer.callbacks.index(triage)
    said = [str(w.message) for w in caught if "listed after FaultInjector" in str(w.message)]
    assert len(said) == 1 and "list FaultTriage first" in said[0]


def test_without_a_snapshot_a_persistent_fault_is_data():
    triage = FaultTriage()
    fit(seeded(), [triage, FaultInjector({1: "nan_batch"})], max_steps=2)
    assert triage.events[0]["kind"] == "data"
    assert triage.events[0]["replays"] == ["as_is:nonfinite", "fp32:nonfinite", "snapshot:none"]


def test_bad_state_is_state_and_rolls_back():
    # A NaN weight makes the loss non-finite: the step is rejected, and triage finds the snapshot's replay clean.
    # Listed last, triage still sees the step before ScaleCheckpoint's own check of the weights would roll it back.
    module, triage = seeded(), FaultTriage()
    checkpoint = ScaleCheckpoint(every_n_steps=1)
    fit(module, [checkpoint, CorruptState(2, "weight"), triage])
    (event,) = triage.events
    assert (event["step"], event["kind"], event["action"], event["restored_step"]) == (2, "state", "rollback", 2)
    assert event["replays"] == ["as_is:nonfinite", "fp32:nonfinite", "snapshot:clean"]
    assert checkpoint.rollbacks == 1
    assert checkpoint.events[-1]["step"] == 2  # the step it answers (trainer.global_step is past it by then)
    assert all(torch.isfinite(v).all() for v in weights(module).values())


def test_bad_state_without_a_snapshot_stops_the_fit_and_says_so():
    # The ladder's last rung: nothing to roll back to. The fit stopped silently, its one line saying "data, skip".
    module, triage = seeded(), FaultTriage()
    trainer = make_trainer(StablePrecision("32-true"), callbacks=[CorruptState(2, "weight"), triage], max_steps=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    assert trainer.global_step == 3  # stopped after the faulty step
    (event,) = triage.events
    assert (event["step"], event["action"]) == (2, "stop")
    assert any("The run stops" in str(w.message) for w in caught)


class RaisesInTheSnapshotReplay(PoisonModule):
    """Keeps the state at step ``step``'s first execution, and raises in its fourth (the replay from the snapshot,
    after the as-is and the FP32 replays). Replays run after the step counted, so they are told by the batch."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step, self.calls, self.state = step, 0, None

    def training_step(self, batch, batch_idx):
        if self.current_epoch == 0 and batch_idx == self.step:  # 4 batches an epoch: batch 2 is step 2
            self.calls += 1
            if self.calls == 1:
                optimizer = self.trainer.optimizers[0]
                self.state = (weights(self), {k: v["momentum_buffer"].clone() for k, v in optimizer.state.items()})
            if self.calls == 4:
                raise RuntimeError("fails in the snapshot's replay")
        return super().training_step(batch, batch_idx)


def test_an_exception_in_the_snapshot_replay_restores_the_state_before_it():
    torch.manual_seed(0)
    module, checkpoint = RaisesInTheSnapshotReplay(step=2), ScaleCheckpoint(every_n_steps=1)
    with quiet(), pytest.raises(RuntimeError, match="fails in the snapshot's replay"):
        make_trainer(StablePrecision("32-true"), callbacks=[checkpoint, CorruptState(2, "weight"), FaultTriage()],
                     max_steps=4).fit(module)
    # The weights and the momentum are those of step 2 as it failed (fc1 holding the NaN), not the snapshot's step 2
    # ones under counters that say step 3: nothing was rolled back.
    before, momentum = module.state
    for name, value in weights(module).items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, equal_nan=True)
    for param, value in module.trainer.optimizers[0].state.items():
        assert torch.equal(value["momentum_buffer"], momentum[param])
    assert checkpoint.rollbacks == 0 and torch.isnan(module.model.fc1.weight).any()


def test_a_bad_momentum_buffer_is_found_within_a_round_of_shares_and_rolled_back():
    # A NaN momentum buffer leaves loss and gradients finite. The step checks the optimizer state in shares (one per
    # step, STATE_SHARES steps a round): either its share rejects a step (triaged as "state", rolled back), or the
    # step writes the NaN into the weight first, and ScaleCheckpoint's check of its next snapshot rolls back.
    module, triage = seeded(), FaultTriage()
    checkpoint = ScaleCheckpoint(every_n_steps=1)
    fit(module, [checkpoint, CorruptState(2, "optimizer"), triage], max_steps=3 + STATE_SHARES)
    assert checkpoint.rollbacks == 1
    for event in triage.events:
        assert 2 <= event["step"] <= 2 + STATE_SHARES and (event["kind"], event["action"]) == ("state", "rollback")
    assert all(torch.isfinite(v).all() for v in weights(module).values())
    state = [v for s in module.trainer.optimizers[0].state.values() for v in s.values() if torch.is_tensor(v)]
    assert all(torch.isfinite(v).all() for v in state)


def test_max_replays_stops_the_ladder():
    triage = FaultTriage(max_replays=1)
    fit(seeded(), [triage, FaultInjector({1: "nan_batch"})], max_steps=2)
    assert triage.events[0]["kind"] == "data" and triage.events[0]["replays"] == ["as_is:nonfinite"]


def test_routine_overflow_is_not_replayed():
    # An inf gradient at a loss scale of 2**16 with a finite loss: the scaler's business.
    triage = FaultTriage()
    plugin = fit(seeded(inf_grad_steps=[1]), [triage], max_steps=3, plugin=fp16_scaler_plugin())
    assert plugin.overflow_count == 1 and triage.events == [] and triage.replays_run == 0


def test_state_dict_round_trips():
    triage = FaultTriage()
    fit(seeded(), [triage, FaultInjector({1: "nan_batch", 2: "transient"})])
    assert [e["kind"] for e in triage.events] == ["data", "transient"]
    buffer = io.BytesIO()
    torch.save(triage.state_dict(), buffer)
    buffer.seek(0)
    restored = FaultTriage()
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.events == triage.events and restored.replays_run == triage.replays_run
    with pytest.raises(KeyError, match="events"):
        FaultTriage().load_state_dict({"replays_run": 0})


class ManualModule(PoisonModule):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.manual_backward(loss)
        optimizer.step()
        return loss


def test_manual_optimization_says_so_once_and_classifies_nothing():
    triage = FaultTriage()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            plugin = StablePrecision("32-true")
            make_trainer(plugin, callbacks=[triage, FaultInjector({1: "nan_batch"})], max_steps=3).fit(ManualModule())
    said = [w for w in caught if "FaultTriage cannot replay" in str(w.message)]
    assert len(said) == 1 and "manual optimization" in str(said[0].message)
    assert plugin.skipped_steps >= 1 and triage.events == [] and triage.replays_run == 0


class GetBatch(torch.utils.data.IterableDataset):
    """nanoGPT's ``get_batch`` as a stream: every batch a fresh random draw of rows (from the torch RNG), endless."""

    def __init__(self, x, y, batch_size: int = 16) -> None:
        self.x, self.y, self.batch_size = x, y, batch_size

    def __iter__(self):
        while True:
            rows = torch.randint(len(self.x), (self.batch_size,))
            yield self.x[rows], self.y[rows]


class StreamModule(PoisonModule):
    def train_dataloader(self):
        return torch.utils.data.DataLoader(GetBatch(self.x, self.y), batch_size=None)


def test_iterable_dataset_is_replayed_from_the_batch_in_hand():
    # The replay uses the batch the step holds (no dataset access): a stream triages as a map-style dataset does.
    torch.manual_seed(0)
    clean = StreamModule()
    fit(clean, [], max_steps=5)
    torch.manual_seed(0)
    module, triage = StreamModule(), FaultTriage()
    fit(module, [triage, FaultInjector({1: "transient", 3: "nan_batch"})], max_steps=5)
    assert triage.cannot_replay is None
    assert [(e["step"], e["kind"], e["action"]) for e in triage.events] == [(1, "transient", "use_replay"),
                                                                          (3, "data", "skip")]
    # The transient step's replay (the same batch) was applied: up to step 3, skipped in the faulted run, every
    # finite loss (the replays' included) is the fault-free run's, and the stream went on drawing the same batches.
    finite = [loss for loss in module.losses if loss == loss]
    assert module.losses[1] != module.losses[1] and finite[:3] == clean.losses[:3]


@pytest.mark.slow
@pytest.mark.parametrize("schedule, precision, kinds", [
    ({2: "transient", 4: "nan_batch"}, "32-true", [(2, "transient"), (4, "data")]),
    ({1: "fp16_overflow"}, "16-mixed", [(1, "precision")]),
    ("weight", "32-true", [(3, "state")]),  # a NaN weight on rank 1 at step 3, snapshots every step
    # A NaN momentum buffer on rank 1, at the step whose share of the state check holds it (fc1's weight is in share 0:
    # the step after a round of shares). Loss and gradients stay finite: only rank 1's replays find it, and both
    # ranks must climb to the snapshot alike.
    ("optimizer", "32-true", [(STATE_SHARES, "state")]),
    # A loss spike on rank 1 on every execution (SpikeGuard judges the loss averaged over the ranks): data on both.
    ({5: "loss_spike"}, "bf16-mixed", [(5, "data")]),
])
def test_ddp_fault_on_one_rank_is_decided_alike_on_both(tmp_path, schedule, precision, kinds):
    from dist_helpers import RankFaultModule, fit_ddp

    from lit_mpstable import SpikeGuard

    triage = FaultTriage()
    if isinstance(schedule, dict):
        faults = [FaultInjector(schedule, module="model.fc2", ranks=[1])]
    else:
        faults = [ScaleCheckpoint(every_n_steps=1), CorruptState(kinds[0][0], schedule, rank=1)]
    spiking = isinstance(schedule, dict) and "loss_spike" in schedule.values()
    guard = SpikeGuard(zscore=4.0, window=16, warmup=4) if spiking else None
    with quiet():
        rank0, rank1 = fit_ddp(RankFaultModule(), StablePrecision(precision, spike_guard=guard), [triage, *faults],
                               tmp_path, max_steps=kinds[-1][0] + 2)
    events0, events1 = rank0["FaultTriage.events"], rank1["FaultTriage.events"]
    assert [(e["step"], e["kind"]) for e in events0] == kinds and events0 == events1
    if schedule == "optimizer":
        assert events0[0]["replays"] == ["as_is:nonfinite", "fp32:nonfinite", "snapshot:clean"]
    if guard is not None:
        assert events0[0]["replays"] == ["as_is:nonfinite", "fp32:nonfinite", "snapshot:none"]
    if precision == "16-mixed":  # only rank 1 saw fc2 overflow: the agreed name moves fc2 on both
        assert events0[0]["blamed"] == ["model.fc2"] and rank0["islands"] == rank1["islands"] == ["model.fc2"]
    assert rank0["skipped"] == rank1["skipped"] and rank0["counters"] == rank1["counters"]
    assert all(torch.equal(rank0["params"][k], rank1["params"][k]) for k in rank0["params"])
    assert all(torch.isfinite(v).all() for v in rank0["params"].values())


def test_ddp_transient_faults_on_one_rank_leave_the_loss_scale_of_a_fault_free_run(tmp_path):
    # Two transient NaNs on rank 1 only, under DDP: both ranks triage them alike (replayed clean), and each rejected
    # execution's backoff is undone on both, so the scale ends where the fault-free run's does (it once halved twice
    # although the weights were the fault-free run's).
    from dist_helpers import RankFaultModule, fit_ddp

    with quiet():
        clean0, clean1 = fit_ddp(RankFaultModule(), StablePrecision("16-mixed"), [], tmp_path / "clean", max_steps=8)
        faults = FaultInjector({2: "transient", 5: "transient"}, module="model.fc2", ranks=[1])
        rank0, rank1 = fit_ddp(RankFaultModule(), StablePrecision("16-mixed"), [FaultTriage(), faults],
                               tmp_path / "faulted", max_steps=8)
    events = rank0["FaultTriage.events"]
    assert [(e["step"], e["kind"], e["action"]) for e in events] == [(2, "transient", "use_replay"),
                                                                      (5, "transient", "use_replay")]
    assert rank1["FaultTriage.events"] == events
    assert rank0["skipped"] == rank1["skipped"] and rank0["counters"] == rank1["counters"]
    assert rank0["counters"][1:] == (2, 2)  # both overflows counted (and skipped) on both ranks
    assert rank0["scaler"] == rank1["scaler"] and rank0["scales"] == rank1["scales"]
    assert rank0["scaler"]["scale"] == clean0["scaler"]["scale"], (rank0["scales"], clean0["scales"])
    for key in ("_growth_tracker", "_hysteresis_tracker"):  # what decides the scale's next moves, too
        assert rank0["scaler"][key] == clean0["scaler"][key], key
    for report in (rank1, clean0, clean1):
        assert all(torch.equal(rank0["params"][k], report["params"][k]) for k in rank0["params"])


def test_events_are_logged_as_a_metric():
    from cb_helpers import ListLogger

    logger, triage = ListLogger(), FaultTriage()
    with quiet():
        make_trainer(StablePrecision("32-true"), callbacks=[triage, FaultInjector({2: "nan_batch"})], max_steps=4,
                     logger=logger, log_every_n_steps=1).fit(seeded())
    assert logger.values("mp/triage_events") == [0.0, 0.0, 1.0, 1.0]


class LogsItsLoss(PoisonModule):
    """PoisonModule whose ``training_step`` logs its loss per step, its epoch mean, and a count of its executions."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        self.log("mean_loss", loss, on_step=False, on_epoch=True)
        self.log("executions", 1.0, on_step=False, on_epoch=True, reduce_fx="sum")
        return loss


def logged_run(callbacks):
    """A seeded :class:`LogsItsLoss` fitted for one epoch (4 batches), every step logged: the module, the trainer, what
    reached the logger."""
    from cb_helpers import ListLogger

    torch.manual_seed(0)
    module, logger = LogsItsLoss(), ListLogger()
    trainer = make_trainer(StablePrecision("32-true"), callbacks=callbacks, max_steps=4, logger=logger,
                           log_every_n_steps=1)
    with quiet():
        trainer.fit(module)
    return module, trainer, logger


def user_results_of(trainer, hook: str) -> list[str]:
    """The results the module's own ``self.log`` left under ``hook`` (training_step's are 'training_step.<name>')."""
    results = trainer.fit_loop.epoch_loop._results  # trainer._results, once the fit is over
    return [key for key in results if key.startswith(f"{hook}.") and not key.startswith(f"{hook}.mp/")]


@pytest.mark.parametrize("step", [0, 2])  # 0: the results are first made by the rejected execution
def test_an_applied_replay_logs_for_its_step_as_if_the_step_had_run_once(step):
    # The replay ran training_step inside on_train_batch_end: its self.log made a second result,
    # 'on_train_batch_end.train_loss', that nothing updated again and that shadowed the live one in every logger and
    # in callback_metrics (ModelCheckpoint, EarlyStopping) for the rest of the run; the epoch aggregates counted it.
    clean, _, clean_logger = logged_run([])
    triage = FaultTriage()
    _, trainer, logger = logged_run([triage, FaultInjector({step: "transient"})])
    assert [e["kind"] for e in triage.events] == ["transient"]
    assert not user_results_of(trainer, "on_train_batch_end")
    # What the fault-free run logged: each step's own loss (the faulted step's the replay's, not the NaN), its mean.
    torch.testing.assert_close(logger.values("train_loss"), clean.losses, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(logger.values("train_loss"), clean_logger.values("train_loss"), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(float(trainer.callback_metrics["mean_loss"]), sum(clean.losses) / 4, rtol=1e-6,
                               atol=1e-7)
    assert float(trainer.callback_metrics["executions"]) == 4.0


def test_a_rejected_replay_logs_nothing():
    # A "data" step: both replays were rejected, so the rejected execution, the step Lightning ran, is what counts.
    triage = FaultTriage()
    module, trainer, logger = logged_run([triage, FaultInjector({1: "nan_batch"})])
    assert [(e["kind"], e["replays"][:2]) for e in triage.events] == [("data", ["as_is:nonfinite", "fp32:nonfinite"])]
    assert not user_results_of(trainer, "on_train_batch_end")
    executed = [module.losses[i] for i in (0, 1, 4, 5)]  # 2 and 3: the replays of step 1
    torch.testing.assert_close(logger.values("train_loss"), executed, rtol=0, atol=0, equal_nan=True)
    assert float(trainer.callback_metrics["executions"]) == 4.0


class PlainStep(PoisonModule):
    """PoisonModule with a training step Dynamo compiles as one graph (PoisonTask's reads the loss to the host and
    keys on the step: a graph break and a recompilation per step)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x).float(), y)


@pytest.mark.slow
def test_a_compiled_module_is_triaged_as_eagerly_without_recompiling_per_event():
    # torch.compile(module): each kind classified as the eager module's are (the events of the tests above). The traced
    # as-is replay runs eagerly (Dynamo cannot trace its hooks); the FP32 replay (autocast off) and the fallback (fc2's
    # forward wrapped) each compile once, and FaultInjector's hook, which Dynamo specializes on its armed kind, adds
    # one variant: 3 graphs over the same faulted run without triage (5 graphs), not one or more per event (6 here).
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    schedule = {1: "transient", 3: "nan_batch", 5: "fp16_overflow", 8: "transient", 9: "nan_batch"}

    def run(triage: FaultTriage | None) -> int:
        torch._dynamo.reset()
        backend = CompileCounterWithBackend("aot_eager")
        torch.manual_seed(0)
        callbacks = [FaultInjector(schedule, module="model.fc2"), ScaleCheckpoint(every_n_steps=1), CorruptState(7)]
        fit(torch.compile(PlainStep(), backend=backend), [triage] + callbacks if triage else callbacks, "16-mixed",
            max_steps=10)
        torch._dynamo.reset()
        return backend.frame_count

    triage = FaultTriage(replay_budget=20)  # 6 events in 10 steps: past the default budget (12 replays per 100)
    graphs, without = run(triage), run(None)
    assert [(e["step"], e["kind"], e["action"]) for e in triage.events] == [
        (1, "transient", "use_replay"), (3, "data", "skip"), (5, "precision", "fallback"), (7, "state", "rollback"),
        (8, "transient", "use_replay"), (9, "data", "skip")]
    assert triage.events[2]["blamed"] == ["model.fc2"] and triage.events[3]["replays"][-1] == "snapshot:clean"
    assert graphs - without <= 3, (graphs, without)


@pytest.mark.slow
def test_a_3000_step_faulted_soak_ends_with_a_usable_loss_scale():
    # Issue 42's soak (16-mixed, every stable callback, 79 faults of every kind, 27 of them transient faults triage
    # replays clean): the scale once ended at 2**-23 and PrecisionFallback moved the whole model to FP32 at step 985.
    import importlib
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[2] / "bench")
    sys.path.insert(0, bench)
    try:
        scale_soak = importlib.import_module("scale_soak")
    finally:
        sys.path.remove(bench)
    result = scale_soak.soak(3000, seed=0)
    assert result["faults"] == 79 and result["triage"].get("transient", 0) >= 20
    assert 2.0**8 <= result["final_scale"] <= 2.0**20 and result["min_scale"] >= 2.0**8
    assert result["flushed_frac"] < 0.05 and result["compute_dtype"] == "torch.float16"  # no whole-model fallback

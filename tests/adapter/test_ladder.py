"""The remedy ladder through a real Trainer: every combination of the five faces (PrecisionFallback, ScaleCheckpoint,
FaultTriage, AMPPreflight, SpikeGuard) against each fault, exactly one remedy per event, the one the ladder's table
names (lit_mpstable/core/guards/ladder.py), the weights and optimizer state finite at the end."""

from __future__ import annotations

import itertools

import pytest
import torch
from cb_helpers import PoisonModule, quiet
from helpers import make_trainer
from trainer_pkg import NAME, ScaleCheckpoint, StablePrecision, pl

from lit_mpstable import SpikeGuard
from lit_mpstable.callbacks import AMPPreflight, FaultTriage, PrecisionFallback
from lit_mpstable.core.guards.ladder import TABLE, Ladder, Rung, ladder_of, next_rung
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler
from lit_mpstable.faults import FaultInjector

pytestmark = pytest.mark.skipif(NAME != "lightning.pytorch", reason="FaultInjector is a lightning.pytorch callback")

FACES = ("PrecisionFallback", "ScaleCheckpoint", "FaultTriage", "AMPPreflight", "SpikeGuard")
COMBOS = [frozenset(c) for n in range(len(FACES) + 1) for c in itertools.combinations(FACES, n)]
EVENTS = ("storm", "nan_batch", "loss_spike", "transient", "corrupt_state")
MAX_STEPS = 8


class CorruptMomentum(pl.Callback):
    """A NaN in fc1's momentum buffer at the start of step ``step`` (a bit flip in the optimizer state in memory)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            state = trainer.optimizers[0].state[pl_module.model.fc1.weight]
            with torch.no_grad():
                state["momentum_buffer"].view(-1)[3] = float("nan")


def expected(combo: frozenset[str], event: str) -> str:
    """The remedy the ladder's table names for ``event`` with the faces of ``combo`` switched on."""
    if event == "storm":
        # The overflowing layer makes the loss inf: FaultTriage's FP32 replay is clean ("precision") at the first step;
        # PrecisionFallback falls back after `patience` overflows; one fallback either way, whoever comes first.
        return "fallback" if combo & {"PrecisionFallback", "FaultTriage"} else "skip"
    if event == "nan_batch":
        return "skip"
    if event == "loss_spike":
        return "skip" if "SpikeGuard" in combo else "none"  # SpikeGuard is the one spike detector
    if event == "transient":
        return "use_replay" if "FaultTriage" in combo else "skip"
    faces = combo - {"SpikeGuard"}
    return "rollback" if "ScaleCheckpoint" in combo else "stop" if faces else "skip"


def faults(event: str) -> list[pl.Callback]:
    if event == "storm":
        return [FaultInjector({s: "fp16_overflow" for s in (2, 3, 4)}, module="model.fc2")]
    if event == "nan_batch":
        return [FaultInjector({3: "nan_batch"})]
    if event == "loss_spike":
        return [FaultInjector({6: "loss_spike"}, loss_spike_factor=100.0)]
    if event == "transient":
        return [FaultInjector({3: "transient"}, module="model.fc2")]
    return [CorruptMomentum(3)]


def run_case(combo: frozenset[str], event: str) -> dict:
    torch.manual_seed(0)
    module = PoisonModule(lr=0.01)
    guard = SpikeGuard(zscore=4.0, window=16, warmup=4, watch=["loss"]) if "SpikeGuard" in combo else None
    plugin = StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**8), spike_guard=guard)
    fallbacks: list = []
    fall_back = plugin.fallback

    def counted(*args, **kwargs):
        fallbacks.append(args)
        return fall_back(*args, **kwargs)

    plugin.fallback = counted  # type: ignore[method-assign]
    faces: list[pl.Callback] = []
    if "FaultTriage" in combo:
        faces.append(FaultTriage())
    if "PrecisionFallback" in combo:
        faces.append(PrecisionFallback(patience=2, mode="module"))
    if "ScaleCheckpoint" in combo:
        faces.append(ScaleCheckpoint(every_n_steps=2))
    if "AMPPreflight" in combo:
        faces.append(AMPPreflight())
    trainer = make_trainer(plugin, callbacks=[*faces, *faults(event)], max_steps=MAX_STEPS)
    with quiet():
        trainer.fit(module)
    triage = next((f for f in faces if isinstance(f, FaultTriage)), None)
    checkpoint = next((f for f in faces if isinstance(f, ScaleCheckpoint)), None)
    remedies = {
        "use_replay": sum(e["action"] == "use_replay" for e in triage.events) if triage else 0,
        "fallback": len(fallbacks),
        "rollback": checkpoint.rollbacks if checkpoint else 0,
        "stop": int(trainer.global_step < MAX_STEPS),
    }
    optimizer = trainer.optimizers[0]
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return dict(remedies=remedies, skipped=plugin.skipped_steps, plugin=plugin,
                weights_finite=all(bool(torch.isfinite(p).all()) for p in module.parameters()),
                state_finite=all(bool(torch.isfinite(v).all()) for v in state))


def check_case(combo: frozenset[str], event: str) -> None:
    result = run_case(combo, event)
    want = expected(combo, event)
    acted = {k: v for k, v in result["remedies"].items() if v}
    if want in ("skip", "none"):
        assert acted == {}, (sorted(combo), event, acted)
        assert (result["skipped"] > 0) == (want == "skip"), (sorted(combo), event, result["skipped"])
    else:
        assert acted == {want: 1}, (sorted(combo), event, acted)
    if event != "corrupt_state" or want == "rollback":  # without a snapshot nothing can undo the NaN update
        assert result["weights_finite"] and result["state_finite"], (sorted(combo), event)
    events = result["plugin"].ladder_events
    if combo - {"SpikeGuard"} and want != "none":  # a face decides, and the ladder lists the decision
        assert events, (sorted(combo), event)
        assert sum(e["action"] == want for e in events) == (1 if want != "skip" else sum(
            e["action"] == "skip" for e in events)), (sorted(combo), event, events)
        assert all(e["action"] in ("skip", want) for e in events), (sorted(combo), event, events)


# ------------------------------------------------------------------------------------------------ the machine
def test_the_transition_follows_the_table():
    on = {Rung.REPLAY, Rung.FALLBACK, Rung.ROLLBACK}
    assert next_rung("overflow", on) is Rung.SKIP
    assert next_rung("nonfinite_state", on) is Rung.REPLAY
    assert next_rung("nonfinite_state", on, replayable=False) is Rung.ROLLBACK
    assert next_rung("nonfinite_state", set()) is Rung.STOP  # no snapshot owner: the last resort
    assert next_rung("spike", set()) is Rung.SKIP
    assert next_rung("preflight", {Rung.FALLBACK}) is Rung.FALLBACK
    verdicts = {v: next_rung("unexplained", on, verdict=v) for v in ("transient", "data", "precision", "state")}
    assert verdicts == {"transient": Rung.REPLAY, "data": Rung.SKIP, "precision": Rung.FALLBACK,
                        "state": Rung.ROLLBACK}
    assert next_rung("nonfinite_state", on, verdict="data") is Rung.STOP
    assert next_rung("restored", on, verdict="restored") is Rung.RESTORE  # the restored-state rung (issue 46)
    assert set(TABLE) >= {"overflow", "overflow_storm", "nonfinite_input", "spike", "unexplained", "nonfinite_state"}
    with pytest.raises(ValueError, match=r"next_rung\(fault='flood'\): allowed: \["):
        next_rung("flood", on)
    with pytest.raises(ValueError, match=r"next_rung\(verdict='cosmic'\)"):
        next_rung("unexplained", on, verdict="cosmic")


def test_one_decision_per_step_a_skip_escalates_once():
    ladder = Ladder()
    ladder.switch_on(Rung.FALLBACK, "PrecisionFallback")
    ladder.switch_on(Rung.REPLAY, "FaultTriage")
    assert ladder.decide(3, "overflow", "scaler", by="A") is Rung.SKIP
    assert ladder.decide(3, "overflow_storm", "2 overflows", by="PrecisionFallback",
                         exclude=[Rung.REPLAY]) is Rung.FALLBACK  # the skip escalated
    assert ladder.decide(3, "overflow_storm", "again", by="PrecisionFallback", exclude=[Rung.REPLAY]) is None
    assert ladder.decide(4, "unexplained", "NaN loss", by="A") is Rung.REPLAY
    assert ladder.conclude(4, "transient", replays=["as_is:clean"]) is Rung.REPLAY
    assert ladder.decide(4, "overflow_storm", "late", by="PrecisionFallback", exclude=[Rung.REPLAY]) is None
    assert [(e["step"], e["action"]) for e in ladder.events] == [(3, "fallback"), (4, "use_replay")]
    assert ladder.events[0]["escalated_from"] == "skip" and ladder.events[1]["verdict"] == "transient"


def test_the_watcher_is_the_first_face_watching_in_order_and_a_new_fit_starts_the_list_again():
    ladder = Ladder()
    assert ladder.watcher is None
    ladder.new_fit("fit 1", 0)
    ladder.watch("PrecisionFallback", False)  # may stand aside at the train start: in its place meanwhile
    ladder.watch("AMPPreflight")
    ladder.watch("ScaleCheckpoint")
    assert ladder.watcher == "PrecisionFallback"
    ladder.watch("PrecisionFallback", None)  # stood aside: the next face decides
    assert ladder.watcher == "AMPPreflight"
    ladder.new_fit("fit 1", 0)  # the same fit's token (a second face's call): nothing restarts
    ladder.watch("PrecisionFallback")  # back, in its own place
    assert list(ladder.watchers) == ["PrecisionFallback", "AMPPreflight", "ScaleCheckpoint"]
    assert ladder.watcher == "PrecisionFallback"
    ladder.new_fit("fit 2", 0)
    assert ladder.watchers == {} and ladder.watcher is None


def test_a_knob_set_twice_differently_is_refused_naming_both():
    ladder = Ladder()
    ladder.claim("snapshot_every", 50, "ScaleCheckpoint(every_n_steps=50)")
    ladder.claim("snapshot_every", 50, "ScaleCheckpoint(every_n_steps=50)")  # the same value: fine
    with pytest.raises(ValueError, match=r"every_n_steps=10\) sets the ladder's snapshot_every to 10, but "
                                         r"ScaleCheckpoint\(every_n_steps=50\) set it to 50"):
        ladder.claim("snapshot_every", 10, "ScaleCheckpoint(every_n_steps=10)")
    with pytest.raises(ValueError, match=r"Ladder.claim\(knob='patience'\): allowed: \["):
        ladder.claim("patience", 3, "X")


def test_two_snapshot_intervals_in_one_run_are_refused():
    class Another(ScaleCheckpoint):  # Lightning refuses two of one class itself (one state_key); a subclass passes it
        @property
        def state_key(self) -> str:
            return "Another"

    trainer = make_trainer(StablePrecision("32-true"), max_steps=1,
                           callbacks=[ScaleCheckpoint(every_n_steps=50), Another(every_n_steps=10)])
    with quiet(), pytest.raises(ValueError, match=r"ScaleCheckpoint\(every_n_steps=10\).*every_n_steps=50"):
        trainer.fit(PoisonModule())


def test_every_decision_is_logged_with_rung_reason_and_what_remained(caplog):
    plugin = StablePrecision("32-true")
    with caplog.at_level("INFO", logger="lit_mpstable.ladder"), quiet():
        make_trainer(plugin, callbacks=[FaultTriage(), ScaleCheckpoint(every_n_steps=1),
                                        FaultInjector({2: "transient"})], max_steps=4).fit(PoisonModule())
    (event,) = plugin.ladder_events
    assert (event["step"], event["fault"], event["rung"], event["verdict"]) == (2, "unexplained", "replay", "transient")
    assert event["remaining"] == [] and event["by"] == "FaultTriage"
    lines = [r.getMessage() for r in caplog.records if r.name == "lit_mpstable.ladder"]
    assert lines[-1].startswith("ladder at step 2: unexplained -> replay (use_replay, replay verdict 'transient';")


@pytest.mark.parametrize("event, then", [
    ("transient", "ladder at step 3: unexplained -> replay (use_replay, replay verdict 'transient';"),
    ("storm", "ladder at step 2: unexplained -> fallback (fallback, replay verdict 'precision';"),
])
def test_a_replayed_step_logs_the_replay_then_what_its_verdict_did(caplog, event, then):
    """The decision to replay is logged as a replay under way (not as its outcome, ``use_replay``, nor with rungs said
    to remain that the verdict may pass over); the verdict's line follows with the rung that acted."""
    plugin = StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**8))
    torch.manual_seed(0)
    with caplog.at_level("INFO", logger="lit_mpstable.ladder"), quiet():
        make_trainer(plugin, callbacks=[FaultTriage(), ScaleCheckpoint(every_n_steps=2), *faults(event)],
                     max_steps=5).fit(PoisonModule(lr=0.01))
    lines = [r.getMessage() for r in caplog.records if r.name == "lit_mpstable.ladder"]
    assert len(lines) == 2, lines
    assert lines[0].startswith(then[:then.index(" -> ")] + " -> replay (replaying the step;"), lines[0]
    assert "use_replay" not in lines[0] and lines[0].endswith("the replay's verdict decides what follows."), lines[0]
    assert lines[1].startswith(then), lines[1]


def test_the_plugin_lists_the_ladder_events_with_no_face():
    """``plugin.ladder_events`` is the plugin's on both Trainer packages' classes, not something the first face to
    decide a step adds: a run with no face lists none. Its skipped step is counted (``skipped_steps``), not listed: the
    list holds the faces' decisions (docs/spikes-and-triage.md)."""
    from lit_mpstable.pytorch_lightning import StablePrecision as StandaloneStablePrecision

    torch.manual_seed(0)
    plugin = StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**8))
    with quiet():
        make_trainer(plugin, callbacks=faults("nan_batch"), max_steps=4).fit(PoisonModule(lr=0.01))
    assert plugin.skipped_steps == 1 and plugin.ladder_events == []
    assert plugin.ladder_events is ladder_of(plugin).events  # one list: the ladder the faces share
    assert StandaloneStablePrecision("bf16-mixed").ladder_events == []


FAST = [(frozenset(), e) for e in EVENTS] + [(frozenset(FACES), e) for e in EVENTS] + [
    (frozenset({"PrecisionFallback", "FaultTriage"}), "storm"), (frozenset({"ScaleCheckpoint"}), "corrupt_state"),
    (frozenset({"FaultTriage"}), "corrupt_state"), (frozenset({"ScaleCheckpoint", "SpikeGuard"}), "loss_spike"),
    (frozenset({"FaultTriage", "SpikeGuard"}), "loss_spike"), (frozenset({"AMPPreflight"}), "transient"),
]


@pytest.mark.parametrize("combo, event", FAST, ids=[f"{'+'.join(sorted(c)) or 'none'}-{e}" for c, e in FAST])
def test_one_remedy_per_event(combo, event):
    check_case(combo, event)


FULL = [(c, e) for c in COMBOS for e in EVENTS if (c, e) not in FAST]


@pytest.mark.slow
@pytest.mark.parametrize("combo, event", FULL, ids=[f"{'+'.join(sorted(c)) or 'none'}-{e}" for c, e in FULL])
def test_one_remedy_per_event_every_combination(combo, event):
    check_case(combo, event)


# ------------------------------------------------------------------------------------------------ 2-process DDP
DDP_CASES = [(frozenset(FACES), "storm"), (frozenset(FACES), "transient"),
             (frozenset(FACES) - {"FaultTriage"}, "storm"), (frozenset(FACES) - {"FaultTriage"}, "transient")]


@pytest.mark.slow
@pytest.mark.parametrize("combo, event", DDP_CASES, ids=[f"{'+'.join(sorted(c))}-{e}" for c, e in DDP_CASES])
def test_ddp_one_remedy_decided_alike_on_both_ranks(tmp_path, combo, event):
    # The fault on rank 1 only: the ladder's flags are agreed across ranks, so both decide the same rung at the same
    # step, and the one remedy (a fallback of fc2, or the transient step's clean replay) happens on both.
    from dist_helpers import RankFaultModule, fit_ddp

    schedule = {s: "fp16_overflow" for s in (2, 3, 4)} if event == "storm" else {3: "transient"}
    guard = SpikeGuard(zscore=4.0, window=16, warmup=4, watch=["loss"]) if "SpikeGuard" in combo else None
    plugin = StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**8), spike_guard=guard)
    faces: list[pl.Callback] = [FaultTriage()] if "FaultTriage" in combo else []
    faces += [PrecisionFallback(patience=2, mode="module"), ScaleCheckpoint(every_n_steps=2), AMPPreflight()]
    with quiet():
        rank0, rank1 = fit_ddp(RankFaultModule(), plugin, [*faces, FaultInjector(schedule, module="model.fc2",
                                                                                 ranks=[1])], tmp_path, max_steps=7)
    want = expected(combo, event)
    assert rank0["ladder_events"] == rank1["ladder_events"]
    acted = [(e["step"], e["action"]) for e in rank0["ladder_events"] if e["action"] != "skip"]
    assert [a for _, a in acted] == ([] if want == "skip" else [want]), rank0["ladder_events"]
    if want == "fallback":
        assert rank0["islands"] == rank1["islands"] and len(rank0["islands"]) == 1  # the blamed layer, on both
    assert rank0["skipped"] == rank1["skipped"] and rank0["counters"] == rank1["counters"]
    assert all(torch.equal(rank0["params"][k], rank1["params"][k]) for k in rank0["params"])
    assert all(torch.isfinite(v).all() for v in rank0["params"].values())

"""The remedy ladder's restored-state rung, as a state machine (no Trainer): which bad steps after a checkpoint load
are the loaded state's fault, the rung that acts on them, and what a restore or a give-up leaves behind."""

from __future__ import annotations

import pytest

from lit_mpstable.core.guards.ladder import RESTORED_FAULTS, TABLE, Ladder, Rung, next_rung


def test_a_bad_step_within_the_window_after_a_load_is_the_restored_states() -> None:
    ladder = Ladder()
    assert not ladder.restored(5, "unexplained")  # no load, no window
    ladder.loaded(4, "run/epoch=0-step=4.ckpt")
    assert not ladder.restored(5, "unexplained")  # the window is off (0) until a face claims it
    ladder.claim("restored_window", 3, "ScaleCheckpoint(restored_window=3)")
    assert [ladder.restored(step, "unexplained") for step in (3, 4, 5, 6, 7)] == [False, True, True, True, False]
    assert RESTORED_FAULTS == {"spike", "unexplained", "nonfinite_state", "overflow_storm"}
    for fault in RESTORED_FAULTS:
        assert ladder.restored(6, fault)
    assert not ladder.restored(5, "nonfinite_input") and not ladder.restored(5, "overflow")  # the batch's, the scaler's
    with pytest.raises(ValueError, match="set it to 3"):
        ladder.claim("restored_window", 8, "another ScaleCheckpoint(restored_window=8)")


def test_the_restore_rung_acts_else_the_run_stops() -> None:
    assert TABLE["restored"] == (Rung.RESTORE, Rung.STOP)
    assert next_rung("restored", {Rung.ROLLBACK, Rung.RESTORE}) is Rung.RESTORE
    assert next_rung("restored", {Rung.ROLLBACK}) is Rung.STOP  # never the snapshot: it holds the loaded state
    assert list(Rung).index(Rung.ROLLBACK) < list(Rung).index(Rung.RESTORE) < list(Rung).index(Rung.STOP)
    ladder = Ladder()
    ladder.switch_on(Rung.ROLLBACK, "ScaleCheckpoint")
    ladder.switch_on(Rung.RESTORE, "ScaleCheckpoint")
    assert ladder.decide(6, "restored", "NaN 3 steps after the load", by="ScaleCheckpoint", replayable=False) is (
        Rung.RESTORE)
    assert ladder.pending(6, Rung.RESTORE) and ladder.events[-1]["action"] == "restore_previous"
    assert ladder.events[-1]["remaining"] == ["stop"]
    ladder.done(6, checkpoint="run/epoch=0-step=3.ckpt", restored_step=3)
    ladder.rewind(3)  # global_step went back: steps 3.. are decided again when they come
    assert ladder.decided(6) is None and ladder.events[-1]["checkpoint"] == "run/epoch=0-step=3.ckpt"
    assert ladder.decide(6, "restored", "again", by="ScaleCheckpoint", replayable=False) is Rung.RESTORE
    ladder.give_up(6, "max_rollbacks=1 spent")
    event = ladder.events[-1]
    assert (event["rung"], event["action"], event["remaining"]) == ("stop", "stop", [])
    assert event["reason"].endswith("; max_rollbacks=1 spent") and len(ladder.events) == 2

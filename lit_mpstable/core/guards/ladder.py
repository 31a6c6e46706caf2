"""The remedy ladder: for each bad step one decision, from one state machine, logged with the rung that acts, the
reason and the rungs that remained.

A bad step climbs the ladder from the bottom; the first rung that is switched on for its fault acts, and only that
one (one decision per step: a second face asking about the same step is told it is decided):

    skip -> replay and classify -> fall back -> roll back -> restore the checkpoint before -> stop

Each rung has one owner, and a callback is a face that switches its rung on and sets its knobs:

    rung       owner (who acts)                                  switched on by
    ---------  ------------------------------------------------  ---------------------------------------------
    skip       the step's own check: the scaler, the input        always on
               check, SpikeGuard (the batch never reaches the
               weights)
    replay     FaultTriage / StepTriage: replay the step and      FaultTriage, StepTriage
               classify it
    fallback   the plugin's fallback: the blamed layers, else     PrecisionFallback; AMPPreflight at the start
               the model one rung up                              of the run; a replay's "precision" verdict
    rollback   the snapshot owner (ScaleCheckpoint; StateSnapshot ScaleCheckpoint, StepTriage(snapshot=...)
               in a plain loop) restores the last good snapshot
    restore    ScaleCheckpoint loads, in process, the newest      ScaleCheckpoint(restored_window=N) (Trainer);
               checkpoint written before the loaded one that      Fabric's StablePrecision.load(...,
               passes its fingerprint (Fabric: the plugin)        restored_window=N)
    stop       the ladder: the run stops with the reason named    always on (the last resort)

OverflowMonitor only observes. The table (event -> the rung that acts; what acts if that rung is switched off):

    event (who detects it)               fault               acts                           else
    -----------------------------------  ------------------  -----------------------------  ---------------------
    overflow at a scale > 1 (scaler)     "overflow"          skip (the scale backs off)     -
    overflow storm in one layer          "overflow" (then    fallback of the blamed layer,  skip (each step)
      (PrecisionFallback's triggers;      escalated) or       once: PrecisionFallback after
      a non-finite loss: FaultTriage)     "overflow_storm"    patience, or a "precision"
                                                              verdict
    NaN batch (the input check)          "nonfinite_input"   replay -> "data" -> skip       skip
    loss/gradient spike (SpikeGuard)     "spike"             replay -> "data" -> skip       skip; without
                                                                                            SpikeGuard undetected
    transient NaN (non-finite loss)      "unexplained"       replay -> "transient": the     skip
                                                              clean replay is applied
    inf/NaN in weights or optimizer      "nonfinite_state"   replay -> "state" -> rollback  rollback; stop (no
      state                                                                                 snapshot)
    first batch disagrees with FP32      "preflight"         fallback (start of the run)    - (warned)
      (AMPPreflight)
    non-finite step or spike within N    "restored"          restore the checkpoint before  stop (attempts spent,
      steps after a checkpoint load                           the loaded one (each attempt   or none passes); when
      (restored_window=N; not an input                        logged with its path, counted  off: as the fault it
      NaN or a routine overflow)                              in max_rollbacks)              was (above)

A replay's verdict names the rung that follows it (:data:`VERDICT_RUNG`): ``"transient"`` applies the clean replay
(the replay rung is the remedy), ``"data"`` skips, ``"precision"`` falls back the layers where inf/NaN first
appeared, ``"state"`` rolls back, ``"restored"`` restores the checkpoint before the loaded one. ``"data"`` for a
fault in the weights or optimizer state (no snapshot to replay from) stops.

Cooldowns live here, in :class:`Cooldowns`: the replay budget (``FaultTriage``), the wait before low precision is
retried (``PrecisionFallback(cooldown=)``), the interval of snapshots (``ScaleCheckpoint(every_n_steps=)``) and the
steps after a checkpoint load in which a bad step is the restored state's (``ScaleCheckpoint(restored_window=)``). A
face sets its knob with :meth:`Ladder.claim`; two faces setting one knob to different values is refused, naming both.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from enum import Enum
from typing import Any, Literal

log = logging.getLogger("lit_mpstable.ladder")

Fault = Literal["overflow", "overflow_storm", "nonfinite_input", "spike", "unexplained", "nonfinite_state",
                "preflight", "restored"]
Verdict = Literal["transient", "data", "precision", "state", "restored"]


class Rung(Enum):
    """The rungs of the ladder, bottom to top; :func:`next_rung` is the one transition function."""

    SKIP = "skip"
    """The step is not applied: the scaler's check (inf/NaN gradients, the scale backs off), the step-input check (a
    batch holding inf/NaN) and ``SpikeGuard`` (a spike) each skip a step on the device. Always on: nothing a skip does
    outlives the step, so it is the rung every other one falls back to."""

    REPLAY = "replay"
    """The rejected step runs again with its RNG: as is, in FP32, from the last snapshot, until one run is clean; the
    first clean one names the fault (:data:`VERDICT_RUNG`) and, for ``"transient"``, its step is applied (the remedy
    is the replay itself). Owned by ``FaultTriage`` (Trainer) and ``StepTriage`` (Fabric, a plain loop), which share
    the climb; budgeted (:class:`Cooldowns`)."""

    FALLBACK = "fallback"
    """The blamed layers (or the model, one rung: FP8 -> base precision -> FP32) compute at a wider precision from now
    on. Owned by the plugin's ``fallback``; ``PrecisionFallback`` decides it from persistent overflow, ``AMPPreflight``
    at the start of the run, a replay's ``"precision"`` verdict for its step."""

    ROLLBACK = "rollback"
    """The weights, optimizer, schedulers and precision state go back to the last good snapshot. Owned by the snapshot
    owner (``ScaleCheckpoint``'s :class:`~lit_mpstable.callbacks.scale_checkpoint.Snapshots`; ``StateSnapshot`` in a
    plain loop), counted against its ``max_rollbacks``."""

    RESTORE = "restore"
    """The restored-state rung: the state loaded from a checkpoint is suspect (a non-finite step or a spike within
    ``restored_window`` optimizer steps of the load: fault ``"restored"``, Megatron-LM#5281's NaN three steps after a
    load), so the run falls back, in process, to the newest checkpoint of the loaded one's directory written before it
    that passes its numeric fingerprint (:func:`~lit_mpstable.core.fingerprint.previous_passing_checkpoint`): weights,
    plugin state, optimizers, LR schedulers and the loop's ``global_step`` come from that file, and the window starts
    again from it. Rolling back to the in-memory snapshot instead would restore the same loaded state and loop. Owned
    by ``ScaleCheckpoint(restored_window=N)`` (Trainer); each attempt is logged with the file's path and counted against
    ``max_rollbacks``; when none is left, or no earlier checkpoint passes, the run stops with the reason named. With
    Fabric, by the plugin's ``load(fabric, path, state, restored_window=N, max_restores=...)``, inside the bad step's
    ``optimizer.step()`` (the stop rung: a ``RuntimeError`` naming why)."""

    STOP = "stop"
    """Nothing switched on can cure the fault (inf/NaN in the weights or optimizer state and no snapshot): the run
    stops, the event naming why and what would have helped. Always on: the last resort."""


ALWAYS_ON = frozenset({Rung.SKIP, Rung.STOP})

TABLE: dict[str, tuple[Rung, ...]] = {
    "overflow": (Rung.SKIP,),
    "overflow_storm": (Rung.REPLAY, Rung.FALLBACK, Rung.SKIP),
    "nonfinite_input": (Rung.REPLAY, Rung.SKIP),
    "spike": (Rung.REPLAY, Rung.SKIP),
    "unexplained": (Rung.REPLAY, Rung.SKIP),
    "nonfinite_state": (Rung.REPLAY, Rung.ROLLBACK, Rung.STOP),
    "preflight": (Rung.FALLBACK,),
    "restored": (Rung.RESTORE, Rung.STOP),
}
"""Per fault, the rungs that may act on it, in the order they are tried; the first switched on acts. (An overflow
storm reaches the replay rung only where the scale no longer explains it: scale 1, or no scaler.)"""

VERDICT_RUNG: dict[str, Rung] = {
    "transient": Rung.REPLAY, "data": Rung.SKIP, "precision": Rung.FALLBACK, "state": Rung.ROLLBACK,
    "restored": Rung.RESTORE,
}
"""The rung a replay's verdict hands the step to (``"transient"``: the replay's own step is the remedy)."""

ACTION = {Rung.SKIP: "skip", Rung.REPLAY: "use_replay", Rung.FALLBACK: "fallback", Rung.ROLLBACK: "rollback",
          Rung.RESTORE: "restore_previous", Rung.STOP: "stop"}
"""What each rung does, as the events name it (``FaultTriage``'s actions are these)."""


REASONS = {
    "overflow": "inf/NaN gradients at a loss scale above 1: the scale backs off",
    "overflow_storm": "an overflow the loss scale does not explain (scale 1, or no scaler)",
    "nonfinite_input": "the batch held inf/NaN",
    "spike": "SpikeGuard judged the step a spike",
    "unexplained": "a non-finite loss or late inf/NaN, the weights and optimizer state finite",
    "nonfinite_state": "inf/NaN in the weights or optimizer state",
    "restored": "a non-finite step or a spike soon after a checkpoint load: the restored state is suspect",
}
"""What each fault of a rejected step means, for the decision's log line."""


RESTORED_FAULTS = frozenset({"spike", "unexplained", "nonfinite_state", "overflow_storm"})
"""The faults that, within ``restored_window`` steps of a checkpoint load, are the restored state's (``"restored"``):
a non-finite step or a spike. Not a batch holding inf/NaN (the batch's fault) nor a routine overflow at a scale above
1 (the scaler's)."""


def next_rung(fault: str, enabled: Iterable[Rung], *, verdict: str | None = None, replayable: bool = True) -> Rung:
    """The one transition: the rung that acts on ``fault`` given the rungs switched on (``enabled``), or, after a
    replay, its ``verdict``'s rung. ``"data"`` for a fault in the weights or optimizer state stops the run (the batch is
    not the cause, and no snapshot was there to replay from). ``replayable=False``: the step was applied (found by a
    check after it), so there is no rejected step to replay.

    Raises:
        ValueError: an unknown ``fault`` or ``verdict``, naming the allowed ones.
    """
    if fault not in TABLE:
        raise ValueError(f"next_rung(fault={fault!r}): allowed: {sorted(TABLE)}.")
    if verdict is not None:
        if verdict not in VERDICT_RUNG:
            raise ValueError(f"next_rung(verdict={verdict!r}): allowed: {sorted(VERDICT_RUNG)}.")
        if fault == "nonfinite_state" and verdict == "data":
            return Rung.STOP
        return VERDICT_RUNG[verdict]
    on = ALWAYS_ON | frozenset(enabled)
    if not replayable:
        on -= {Rung.REPLAY}
    return next((rung for rung in TABLE[fault] if rung in on), Rung.SKIP)


def classify(*, nonfinite_input: bool, spike: bool, nonfinite_loss: bool, late: bool, unscaled_overflow: bool,
             state_bad: bool, spiked: bool = False) -> tuple[str, bool]:
    """The fault of a rejected step, from the flags the step left (agreed across ranks), and whether it can be
    replayed (what :func:`~lit_mpstable.core.guards.triage.needs_triage` asks): a batch holding inf/NaN; a spike
    (``spiked`` alone: the spike that restarted SpikeGuard's statistics, a level shift, which no replay judges);
    inf/NaN in the weights or optimizer state (``state_bad``, checked only when the loss or what the step read after
    its gradient check was non-finite); another non-finite loss or late inf/NaN; an overflow the scale does not
    explain (scale 1, no scaler); else a routine overflow."""
    if nonfinite_input:
        return "nonfinite_input", True
    if spike:
        return "spike", True
    if state_bad and (nonfinite_loss or late):
        return "nonfinite_state", True
    if nonfinite_loss or late:
        return "unexplained", True
    if unscaled_overflow:
        return "overflow_storm", True
    if spiked:
        return "spike", False
    return "overflow", False


def remaining(fault: str, rung: Rung, enabled: Iterable[Rung]) -> list[str]:
    """The rungs above ``rung`` that could still act on ``fault`` (switched on), as names."""
    on = ALWAYS_ON | frozenset(enabled)
    order = list(Rung)
    return [r.value for r in TABLE.get(fault, ()) if r in on and order.index(r) > order.index(rung)]


@dataclasses.dataclass
class Cooldowns:
    """Every wait of the ladder, in one place (the faces set them; :meth:`Ladder.claim` refuses a conflict).

    Attributes:
        replay_budget: replays allowed within ``budget_window`` steps (``FaultTriage``/``StepTriage``).
        budget_window: the steps ``replay_budget`` counts over.
        fallback_retry: steps after a fallback before low precision is retried (``PrecisionFallback(cooldown=)``;
            None: never).
        snapshot_every: steps between snapshots (``ScaleCheckpoint(every_n_steps=)``; None: no snapshots).
        restored_window: optimizer steps after a checkpoint load in which a non-finite step or a spike is the restored
            state's fault (``ScaleCheckpoint(restored_window=)``; 0: off).
    """

    replay_budget: int = 12
    budget_window: int = 100
    fallback_retry: int | None = None
    snapshot_every: int | None = None
    restored_window: int = 0


class Ladder:
    """One run's ladder: which rungs are switched on (and by which face), the knobs, and :attr:`events`, one per bad
    step decided. Kept on the precision plugin (or stepper) by :func:`ladder_of`, so every face of a run shares it."""

    def __init__(self) -> None:
        self.faces: dict[Rung, list[str]] = {}
        self.cooldowns = Cooldowns()
        self.events: list[dict[str, Any]] = []
        """Per decision: ``step``, ``fault``, ``rung`` (the rung that acted), ``action`` (what it did: ``"skip"``,
        ``"use_replay"``, ``"fallback"``, ``"rollback"``, ``"stop"``), ``reason``, ``remaining`` (the rungs switched on
        above it), ``by`` (the face that decided) and, after a replay, ``verdict`` and ``replays``."""
        self._claims: dict[str, tuple[object, str]] = {}
        self._decided: dict[int, dict[str, Any]] = {}
        self._token: object = None
        self.watched = -1
        self.load: dict[str, Any] | None = None
        """The last checkpoint load of this fit: ``step`` (the ``global_step`` it resumed at) and ``path``."""
        """The last step a face watched (each step is watched once, by the first face at its end)."""
        self.overflows = 0
        """The host's ``overflow_count`` when :attr:`watched` was watched."""
        self.watchers: dict[str, bool | None] = {}
        """The faces that watch the ends of the steps, in the order they are called there (the order they switched
        their rungs on): True once sure to watch every step of this fit, False while a face may still stand aside
        (before the train start), None when it stood aside. The first that watches decides (:attr:`watcher`)."""

    # ------------------------------------------------------------------------------------------------ faces
    def switch_on(self, rung: Rung, face: str) -> None:
        """``face`` switches ``rung`` on for this run (idempotent)."""
        faces = self.faces.setdefault(rung, [])
        if face not in faces:
            faces.append(face)

    def watch(self, face: str, watching: bool | None = True) -> None:
        """``face`` watches the ends of the steps (True), may stand aside before the train start (False), or stood
        aside (None); a face keeps its place in :attr:`watchers`."""
        self.watchers[face] = watching

    @property
    def watcher(self) -> str | None:
        """The face that decides each bad step: the first one watching (the first called at a step's end). A face
        called later finds the step decided; one that knows this may stop watching, and the events keep this name."""
        return next((face for face, watching in self.watchers.items() if watching is not None), None)

    @property
    def enabled(self) -> frozenset[Rung]:
        return ALWAYS_ON | frozenset(self.faces)

    def claim(self, knob: str, value: object, face: str) -> None:
        """``face`` sets the cooldown ``knob`` to ``value``. A second face (or a second instance) setting it to another
        value is refused.

        Raises:
            ValueError: ``knob`` is not a field of :class:`Cooldowns`, or it was set to another value by another face.
        """
        fields = {f.name for f in dataclasses.fields(Cooldowns)}
        if knob not in fields:
            raise ValueError(f"Ladder.claim(knob={knob!r}): allowed: {sorted(fields)}.")
        held = self._claims.get(knob)
        if held is not None and held[0] != value:
            raise ValueError(f"{face} sets the ladder's {knob} to {value!r}, but {held[1]} set it to {held[0]!r}: one"
                             f" run has one {knob}; keep one of them (one instance per run).")
        self._claims[knob] = (value, face)
        setattr(self.cooldowns, knob, value)

    # ------------------------------------------------------------------------------------------------ decisions
    def decided(self, step: int) -> dict[str, Any] | None:
        """The decision already taken for ``step``, if any."""
        return self._decided.get(step)

    def decide(self, step: int, fault: str, reason: str, *, by: str, replayable: bool = True,
               exclude: Iterable[Rung] = (), keyed: bool = True, **extra: Any) -> Rung | None:
        """The one decision for bad step ``step``: the rung that acts on ``fault`` (of those switched on, less
        ``exclude``), recorded and logged. A step decided already keeps its decision (None: the face asking second does
        nothing), unless that decision was only a skip and this one is a rung above it: the skip is escalated (an
        overflow the scaler skipped that completes ``PrecisionFallback``'s storm; one remedy for the event).
        ``keyed=False``: a decision outside the steps (``AMPPreflight`` before the first step)."""
        rung = next_rung(fault, frozenset(self.faces) - frozenset(exclude), replayable=replayable)
        held = self._decided.get(step) if keyed else None
        if held is not None and (held["rung"] != Rung.SKIP.value or rung is Rung.SKIP):
            return None
        event = dict(step=step, fault=fault, rung=rung.value, action=ACTION[rung], reason=reason,
                     remaining=remaining(fault, rung, self.faces), by=by, **extra)
        if held is not None:  # escalated: the skip's event becomes this one
            held.clear()
            held.update(event, escalated_from="skip")
            event = held
        else:
            self.events.append(event)
        if keyed:
            self._decided[step] = event
        log.info(describe(event))
        return rung

    def pending(self, step: int, rung: Rung) -> bool:
        """Whether ``step`` was decided for ``rung`` and its owner has not acted yet (it calls :meth:`done`)."""
        held = self._decided.get(step)
        return held is not None and held["rung"] == rung.value and not held.get("done", False)

    def done(self, step: int, **extra: Any) -> None:
        """The owner of ``step``'s rung acted; ``extra`` goes into the event (``restored_step``, ``effect``)."""
        held = self._decided.get(step)
        if held is not None:
            held.update(done=True, **extra)

    def new_fit(self, token: object, overflow_count: int) -> None:
        """A fit starts (``token``: its trainer or loop; ``overflow_count``: the host's count now): the faces and knobs
        are set again, the steps restart; the events stay (the run's history)."""
        if token is not self._token:
            self.overflows = overflow_count
            self._token = token
            self.faces.clear()
            self._claims.clear()
            self.cooldowns = Cooldowns()
            self._decided.clear()
            self.watched = -1
            self.load = None
            self.watchers.clear()

    # ------------------------------------------------------------------------------------------ the restored state
    def loaded(self, step: int, path: str) -> None:
        """The run's state was loaded from the checkpoint ``path`` and resumes at optimizer step ``step``: for
        ``restored_window`` steps from here a non-finite step or a spike is the restored state's fault."""
        self.load = {"step": int(step), "path": str(path)}

    def restored(self, step: int, fault: str) -> bool:
        """Whether bad step ``step`` of ``fault`` (one of :data:`RESTORED_FAULTS`) falls within ``restored_window``
        steps of the last checkpoint load: the fault is then ``"restored"``."""
        window, load = self.cooldowns.restored_window, self.load
        return bool(window) and load is not None and fault in RESTORED_FAULTS and 0 <= step - load["step"] < window

    def rewind(self, step: int) -> None:
        """The loop's ``global_step`` went back to ``step`` (a checkpoint restored in process): decisions of the steps
        from ``step`` on are history (kept in :attr:`events`), so those steps are decided again when they come."""
        self._decided = {s: e for s, e in self._decided.items() if s < step}
        self.watched = step - 1

    def give_up(self, step: int, why: str) -> None:
        """``step``'s rung could not act (``why``: e.g. no earlier checkpoint passes, the attempts are spent): the last
        rung, stop, is the decision (the front end stops the run)."""
        event = self._decided.get(step)
        if event is not None:
            event.update(rung=Rung.STOP.value, action=ACTION[Rung.STOP], reason=f"{event['reason']}; {why}",
                         remaining=[], done=True)
            log.info(describe(event))

    def conclude(self, step: int, verdict: str, **extra: Any) -> Rung:
        """A replay of ``step`` named ``verdict``: the rung it hands the step to, recorded in the step's event (decided
        by :meth:`decide` first, else recorded now as an ``"unexplained"`` fault)."""
        event = self._decided.get(step)
        if event is None:
            self.decide(step, "unexplained", "replayed", by="replay")
            event = self._decided[step]
        rung = next_rung(event["fault"], self.faces, verdict=verdict)
        event.update(verdict=verdict, rung=rung.value, action=ACTION[rung],
                     remaining=remaining(event["fault"], rung, self.faces), done=True, **extra)
        log.info(describe(event))
        return rung

    def forget(self, step: int, why: str) -> None:
        """``step``'s rung was not taken after all (``why``: e.g. the replay budget was spent): it stays skipped."""
        event = self._decided.get(step)
        if event is not None:
            event.update(rung=Rung.SKIP.value, action=ACTION[Rung.SKIP], reason=f"{event['reason']}; {why}",
                         remaining=remaining(event["fault"], Rung.SKIP, self.faces), done=True)
            log.info(describe(event))

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Keys: ``events``."""
        return {"events": [dict(e) for e in self.events]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.events[:] = [dict(e) for e in state["events"]]
        self._decided = {int(e["step"]): e for e in self.events}


def describe(event: dict[str, Any]) -> str:
    """The decision's log line: the step, the fault, the rung that acted and why, and the rungs that remained. A
    replay not yet concluded is said to be under way: its verdict names the rung that acts (any of them, not only
    those left above the replay rung), in a line of its own when it concludes."""
    head = f"ladder at step {event['step']}: {event['fault']} -> {event['rung']}"
    why = f"{event['by']}: {event['reason']}"
    if event["rung"] == Rung.REPLAY.value and "verdict" not in event:
        return f"{head} (replaying the step; {why}); the replay's verdict decides what follows."
    verdict = f", replay verdict {event['verdict']!r}" if "verdict" in event else ""
    left = ", ".join(event["remaining"]) or "none"
    return f"{head} ({event['action']}{verdict}; {why}); remaining: {left}."


def ladder_of(host: Any) -> Ladder:
    """The run's ladder, kept on ``host`` (the precision plugin, or a stepper) as ``host.ladder``. Made on first use.
    Its events are ``host.ladder_events``: a front end's property, which reads them here, or else (a stepper in a
    loop) an attribute set now."""
    ladder = host.__dict__.get("ladder") if hasattr(host, "__dict__") else None
    if not isinstance(ladder, Ladder):
        ladder = Ladder()
        try:
            host.ladder = ladder
            if not hasattr(type(host), "ladder_events"):
                host.ladder_events = ladder.events
        except AttributeError:  # a host that takes no attributes (a view): the ladder lives with the caller
            pass
    return ladder

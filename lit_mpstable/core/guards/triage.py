"""Fault triage without a trainer: the replay ladder and its transition, the checks that decide whether a rejected
step needs triage and whether a replay is clean, and :func:`climb`, which runs the ladder over a front end's
:class:`ReplayHost`. ``FaultTriage`` (the Trainer callback) and :class:`~lit_mpstable.core.step.triage_loop.StepTriage`
(a plain loop, Fabric) are two hosts of the same climb."""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from enum import Enum
from typing import Any, Literal, Protocol, TypeVar

import torch
from torch import nn
from torch.optim import Optimizer

from lit_mpstable.core.attribution import OverflowTracer, trace_nonfinite
from lit_mpstable.core.compiled import eager
from lit_mpstable.core.tensors import local_view

TriageKind = Literal["transient", "precision", "data", "state"]


class ScalerState(Protocol):
    """What triage asks of a loss scaler besides its scale: GradScaler's state dict, to put a backoff back."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class TriagePlugin(Protocol):
    """What triage reads of, and calls on, the precision object whose step was rejected: a
    :class:`~lit_mpstable.core.step.stepper.PrecisionStepper`, or a front end showing its state. ``spike_guard``
    and ``last_step_spiked`` are read where present (a foreign plugin has neither)."""

    @property
    def last_loss(self) -> torch.Tensor | None: ...
    @property
    def stats(self) -> Mapping[str, object]: ...
    @property
    def scaler(self) -> ScalerState | None: ...
    @property
    def loss_scale(self) -> float: ...


class ReplayPlugin(TriagePlugin, Protocol):
    """What :func:`climb` asks of the precision object besides what :class:`TriagePlugin` reads."""

    def undo_backoff_(self) -> bool: ...


class Replay(Enum):
    """The replay ladder, climbed one rung per replay until one is clean; :func:`next_replay` is its transition.

    - ``AS_IS``: the same batch, RNG and precision. Clean: the fault came and went (a flipped bit): ``"transient"``.
      Overflowing at the loss scale (its gradients only): tried again at the scale the scaler backs off to.
    - ``FP32``: the same batch in FP32 (FP8 and autocast off). Clean, and the weights and optimizer state it started
      from finite: low precision made it: ``"precision"``.
    - ``SNAPSHOT``: the same batch from the last snapshot. Clean: the weights or the optimizer state had gone bad
      since: ``"state"``.

    Non-finite on every rung tried: the batch itself is bad, ``"data"``.
    """

    AS_IS = "transient"
    FP32 = "precision"
    SNAPSHOT = "state"


LADDER = (Replay.AS_IS, Replay.FP32, Replay.SNAPSHOT)
ACTIONS = {"transient": "use_replay", "precision": "fallback", "data": "skip", "state": "rollback"}
"""The action each kind takes: apply the clean replay, fall back the blamed modules, skip the batch, roll back."""


def next_replay(done: Replay, clean: bool, max_replays: int) -> Replay | TriageKind:
    """After replay ``done``: its kind when it was clean, else the next rung (within ``max_replays``), else ``"data"``
    (the batch stays skipped: of the four actions the one that changes nothing)."""
    if clean:
        return done.value
    position = LADDER.index(done) + 1
    return LADDER[position] if position < max_replays else "data"


REPLAY_BUDGET = 12
BUDGET_WINDOW = 100
"""The default replay budget: at most 12 replays in any 100 consecutive steps (a replay costs about a step's
forward and backward: at most ~12% more time), room for 4 full climbs of the ladder."""


def check_budget(call: str, max_replays: int, replay_budget: object, budget_window: object) -> None:
    """Validate a triage's ``replay_budget`` (an int >= ``max_replays``: room for one full climb) and
    ``budget_window`` (an int >= 1, steps).

    Raises:
        ValueError: naming the argument, its value and what is allowed.
    """
    def is_int(value: object, low: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and low <= value <= 2**31 - 1

    if not is_int(replay_budget, max(max_replays, 1)):
        raise ValueError(f"{call}(replay_budget={replay_budget!r}): must be an int >= max_replays={max_replays}"
                         " (replays allowed within budget_window steps, room for at least one full climb of the"
                         f" ladder); {REPLAY_BUDGET} by default.")
    if not is_int(budget_window, 1):
        raise ValueError(f"{call}(budget_window={budget_window!r}): must be an int >= 1 (the consecutive steps"
                         f" replay_budget counts over); {BUDGET_WINDOW} by default.")


def replays_spent(events: Sequence[dict[str, Any]], step: int, window: int) -> int:
    """Replays run by the events of the steps in ``(step - window, step]``: their rungs (an as-is rung tried again
    after an overflow counts twice), less those that ran nothing (``snapshot:none``, ``fp32:unavailable``). Computed
    from the events, so a resumed run keeps its budget."""
    return sum(1 for event in events if step - window < event["step"] <= step
               for outcome in event["replays"] if outcome.endswith((":clean", ":nonfinite", ":overflow")))


def budget_note(who: str, step: int, spent: int, max_replays: int, budget: int, window: int) -> str:
    """The warning (said once) when a rejected step goes untriaged because the budget has no room for a climb."""
    return (f"{who} at step {step}: the replay budget is spent ({spent} replays within the last {window} steps;"
            f" replay_budget={budget}, budget_window={window}, a climb takes up to max_replays={max_replays}):"
            " rejected steps are skipped without triage (nothing classified or replayed) until the window has room"
            " again. Faults this frequent are not transient: check the data, the learning rate or the precision"
            " (PrecisionFallback), or raise replay_budget if replaying them is worth the time.")


# ------------------------------------------------------------------------------------------------ checks
# ``plugin`` is a TriagePlugin, not so typed while the callbacks' PrecisionView (what they pass) lacks last_loss.
def needs_triage(plugin: Any, overflowed: bool) -> list[bool]:
    """Per-process reasons a rejected step needs triage (OR them across ranks with :func:`any_rank`): the loss scale
    does not explain it, or SpikeGuard made it. ``plugin`` is a stepper or a front end showing its ``last_loss``,
    ``stats``, ``scaler``, ``loss_scale`` and ``last_step_spiked``; ``overflowed``: the step counted an overflow.

    The flags: a non-finite loss (the scale only multiplies after it), a batch holding inf/NaN, an overflow with no
    scaler or at a scale of 1, inf/NaN that entered after the gradient check (weights, optimizer state), a spike
    (not the one that completed ``max_consecutive`` in a row: the guard took the level as new and restarted, so no
    replay is judged against the old statistics). Host reads on rejected steps only."""
    loss, stats = plugin.last_loss, plugin.stats
    guard = getattr(plugin, "spike_guard", None)
    level_shift = guard is not None and guard.consecutive_spikes == 0  # after a spike: the run ended in a restart
    return [
        loss is not None and not bool(torch.isfinite(loss).all()),
        bool(overflowed and stats.get("nonfinite_input")),
        bool(overflowed and (plugin.scaler is None or plugin.loss_scale <= 1.0)),
        bool(not overflowed and stats.get("nonfinite_after_check")),
        # A view without SpikeGuard (a foreign plugin) has no last_step_spiked.
        bool(getattr(plugin, "last_step_spiked", False)) and not level_shift,
    ]


def replay_finite(module: nn.Module, optimizer: Optimizer, loss: torch.Tensor | None) -> bool:
    """Whether the loss, the gradients, the weights and the optimizer state are all finite: what the step checks
    before it applies. One host read (events only)."""
    tensors = [] if loss is None else [loss.float().reshape(-1)]
    for param in module.parameters():
        tensors += [param.detach()] + ([param.grad] if param.grad is not None else [])
    tensors += [v for state in optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() and type(v) is torch.Tensor]
    tensors = [t for t in tensors if t.numel()]
    if loss is None or not tensors:
        return loss is not None
    return bool(all_finite([t.detach() for t in tensors], tensors[0].device))


def replay_overflowed(module: nn.Module, optimizer: Optimizer, loss: torch.Tensor | None) -> bool:
    """Whether a replay's inf/NaN is all in its gradients (its loss, the weights and the optimizer state finite): what
    an overflow of the scaled gradients looks like. One host read (events only)."""
    if loss is None or not bool(torch.isfinite(loss).all()):
        return False
    return state_finite(module, [optimizer])


def state_finite(module: nn.Module, optimizers: Sequence[Optimizer]) -> bool:
    """Whether every parameter and every floating optimizer-state tensor is finite: one reduction per tensor, one host
    read (rejected steps only: what tells inf/NaN in the state from a passing fault). This process's shards only
    (a DTensor's local view): the callers agree the answer across ranks."""
    tensors = [local_view(p.detach()) for p in module.parameters() if p.numel()]
    tensors += [local_view(v) for opt in optimizers for state in opt.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()]
    tensors = [t for t in tensors if t.numel() and type(t) is torch.Tensor]
    if not tensors:
        return True
    return bool(all_finite(tensors, tensors[0].device))


def all_finite(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Whether every element of ``tensors`` is finite (in FP32: a float64 beyond FP32's range counts as inf), as a
    0-dim bool on ``device``, by each tensor's minimum and maximum (``aminmax``: one pass, no temporary, NaN
    propagating; ``abs().amax()`` wrote a copy of each tensor first, 1.5x slower on small tensors, 5x on 1M-element
    ones on a CPU) or, complex, its largest magnitude. No host read.

    FP8 tensors (compact moments' E4M3 codes) are read as BF16, which holds every FP8 value, inf and NaN included:
    torch implements no reduction for one-byte floats ("aminmax_cpu" not implemented for 'Float8_e4m3fn')."""
    extremes = [e for t in tensors for e in ((t.abs().amax(),) if t.is_complex() else torch.aminmax(_reducible(t)))]
    return torch.stack([e.float().to(device) for e in extremes]).isfinite().all()


def _reducible(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.bfloat16) if tensor.is_floating_point() and tensor.itemsize == 1 else tensor


def replay_spikes(plugin: TriagePlugin, module: nn.Module, loss: torch.Tensor | None) -> bool:
    """Whether ``plugin``'s SpikeGuard (if any) judges the replay a spike by its current statistics: its loss (given
    by the replay's backward) and its gradients' norm (unscaled by the loss scale). Nothing is committed: a clean
    replay's step judges and folds again. One host read (events only)."""
    guard = getattr(plugin, "spike_guard", None)
    if guard is None or loss is None:
        return False
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return False
    norms = torch.stack([torch.linalg.vector_norm(g, 2, dtype=torch.float32) for g in grads])
    norm = torch.linalg.vector_norm(norms, 2) / (plugin.loss_scale if plugin.scaler is not None else 1.0)
    return bool(guard.decide(norm))


# ------------------------------------------------------------------------------------------------ helpers
RngState = tuple[torch.Tensor, list[torch.Tensor] | None]
"""What :func:`rng_state` returns."""


def rng_state() -> RngState:
    """The torch RNG states (CPU, and CUDA where initialised): small host copies, no device wait."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)


def restore_rng(state: RngState) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1


def any_rank(flags: Sequence[bool], device: torch.device) -> list[bool]:
    """Each flag OR-ed over the default process group's ranks (one all-reduce and one host read; as they are on one
    process). Every rank must call it at the same point."""
    if not _distributed():
        return [bool(flag) for flag in flags]
    reduced = torch.tensor([float(f) for f in flags], device=device)
    torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX)
    return [value > 0 for value in reduced.tolist()]


def agreed_names(names: Sequence[str]) -> list[str]:
    """The same names on every rank: rank 0's, or, when it has none, those of the first rank that has any."""
    if not _distributed():
        return list(names)
    gathered: list[list[str] | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, list(names))
    return next((list(g) for g in gathered if g), [])


def triage_event(step: int, kind: str, blamed: list[str], batch_idx: int, replays: list[str],
                 **extra: object) -> dict[str, object]:
    """The record of one triaged step, as every host writes it: ``step``, ``kind``, ``action``, ``blamed``,
    ``batch_idx``, ``replays`` (``"as_is:nonfinite"``, ...) and extras (``restored_step``, ``effect``)."""
    return dict(step=step, kind=kind, action=ACTIONS[kind], blamed=blamed, batch_idx=batch_idx, replays=replays,
                **extra)


def describe(event: dict[str, Any], who: str) -> str:
    """One line for the log: what ``who`` found and did."""
    return (f"{who} at step {event['step']} (batch {event['batch_idx']}): {event['kind']}, {event['action']}"
            f" (replays {', '.join(event['replays'])}; blamed {event['blamed']}).")


# ------------------------------------------------------------------------------------------------ the climb
Backup = TypeVar("Backup")  # what a host's enter_snapshot returns and its leave_snapshot takes back


class ReplayHost(Protocol[Backup]):
    """What a front end gives :func:`climb`: the model and optimizer the replays run on, the precision object whose
    SpikeGuard judges them, and the actions only it knows how to take."""

    @property
    def module(self) -> nn.Module: ...  # read only (a LightningModule is one)
    @property
    def optimizer(self) -> Optimizer: ...  # the torch optimizer (its state is checked)
    @property
    def plugin(self) -> ReplayPlugin: ...  # the stepper, or a front end showing its spike_guard, scaler, loss_scale
    can_fp32: bool  # False where the precision is fixed (FSDP2): the FP32 rung is skipped

    def full_precision(self) -> AbstractContextManager: ...
    def replay(self, *, trace: bool) -> tuple[torch.Tensor | None, list[str]]:
        """One forward and backward of the rejected step's batch with its RNG, grads zeroed first: the loss and,
        with ``trace``, where inf/NaN first appeared."""
    def apply(self, loss: torch.Tensor | None) -> None:
        """Apply the clean replay's step through the precision (counted as a step of its own)."""
    def discard(self) -> None:
        """Drop a non-clean replay's gradients (kept out of SpikeGuard's statistics)."""
    def has_snapshot(self) -> bool: ...
    def enter_snapshot(self) -> Backup:
        """Restore the last snapshot for a trial; returns what :meth:`leave_snapshot` needs to undo it."""
    def leave_snapshot(self, backup: Backup) -> None: ...
    def roll_back(self) -> int | None:
        """Keep the snapshot restored (a counted rollback); returns the step it was taken at."""
    def any_rank(self, flags: Sequence[bool]) -> list[bool]: ...


def climb(host: ReplayHost[Backup], max_replays: int) -> tuple[TriageKind, list[str], list[str], dict[str, object]]:
    """Replay up the ladder until a replay is clean (on every rank) or the rungs run out; a clean replay's step is
    applied (after a rollback for the snapshot's rung). The FP32 rung is clean only if the state it started from was
    finite too: inf/NaN in the weights or optimizer state is no precision's doing, so a fault there goes on to the
    snapshot's rung (``"state"``) in every weight mode. An as-is replay that overflows (inf/NaN in its gradients
    only, at a scale above 1, after the rejected execution's backoff was undone) is the scaler's: its backoff stands,
    and the as-is rung is tried once more at that scale (``"as_is:overflow"``), which decides; without this the FP32
    replay of a step that overflows routinely comes out clean and a layer falls back for good. Returns the kind, the
    outcome of each rung tried, where inf/NaN first appeared in the as-is replay, and extras for the event
    (``restored_step``). An exception in the snapshot's rung (the replay, its check or its step) restores the state it
    replaced before it propagates: the weights and the optimizer never stay at the snapshot's step while the counters
    say the current one."""
    outcomes: list[str] = []
    traced: list[str] = []
    extra: dict[str, object] = {}
    # What triage explains (a non-finite loss, an overflow at scale 1) was not the loss scale's doing: the backoff the
    # rejected execution caused is undone, so the replays run, and the run goes on, at the scale it ran at (a "state"
    # verdict's rollback then brings the snapshot's). Without this every transient fault halves the scale for good.
    # The backed-off scaler state is kept (a host read, events only): an as-is replay that overflows at the restored
    # scale shows the step would have overflowed without the fault too, and then the backoff goes back in place.
    scaler = host.plugin.scaler
    backed_off = scaler.state_dict() if scaler is not None else None
    if not host.plugin.undo_backoff_():
        backed_off = None
    replay: Replay | TriageKind = Replay.AS_IS
    while isinstance(replay, Replay):
        backup = None
        if replay is Replay.SNAPSHOT:
            if not host.has_snapshot():
                outcomes.append("snapshot:none")
                replay = "data"
                break
            backup = host.enter_snapshot()
        if replay is Replay.FP32 and not host.can_fp32:
            outcomes.append("fp32:unavailable")
            replay = next_replay(replay, False, max_replays)
            continue
        # Read before the widening: with FP32 masters full_precision() widens the parameters from the masters, so a
        # 16-bit working copy holding inf/NaN (a flipped bit) is out of the FP32 replay's sight, which would come out
        # clean and move the layer to FP32 for good. The replay still runs on every rank (its backward all-reduces
        # under DDP); this rank's state joins its verdict in the one reduction.
        state_bad = replay is Replay.FP32 and not state_finite(host.module, [host.optimizer])
        try:
            with host.full_precision() if replay is Replay.FP32 else nullcontext():
                loss, names = host.replay(trace=replay is Replay.AS_IS)
                finite = replay_finite(host.module, host.optimizer, loss)
                bad = state_bad or not finite or replay_spikes(host.plugin, host.module, loss)
                # After an undone backoff, an as-is replay whose inf/NaN is all in its gradients overflowed at the scale
                # the step ran at: the fault-free step would have overflowed too.
                may_overflow = backed_off is not None and replay is Replay.AS_IS
                scale_only = may_overflow and not finite and replay_overflowed(host.module, host.optimizer, loss)
                agreed = host.any_rank([bad, bad and not scale_only])
                clean = not agreed[0]
                overflowed = may_overflow and not clean and not agreed[1] and host.plugin.loss_scale > 1.0
                verdict = "clean" if clean else "overflow" if overflowed else "nonfinite"
                outcomes.append(f"{replay.name.lower()}:{verdict}")
                if replay is Replay.AS_IS:
                    traced = names
                if clean and replay is Replay.SNAPSHOT:
                    extra["restored_step"] = host.roll_back()
                if clean:  # the clean replay's step is applied, in the precision it ran in
                    host.apply(loss)
                else:
                    host.discard()
        except BaseException:
            if backup is not None:  # the weights and optimizer go back to the current step, as the counters say
                host.leave_snapshot(backup)
            raise
        if not clean and backup is not None:
            host.leave_snapshot(backup)  # the trial from the snapshot is undone
        if overflowed:  # the scaler's business: its backoff stands, and an as-is replay at that scale decides
            assert scaler is not None and backed_off is not None
            scaler.load_state_dict(backed_off)
            backed_off = None
            continue
        replay = next_replay(replay, clean, max_replays)
    return replay, outcomes, traced, extra


@contextmanager
def traced(module: nn.Module, trace: bool) -> Generator[OverflowTracer | None, None, None]:
    """The context of a replay's forward and backward: with ``trace``, an :class:`~lit_mpstable.core.attribution.
    OverflowTracer` on ``module``, run eagerly (``torch.compile``'d code too: Dynamo cannot trace the tracer's hooks,
    and hooks that came and went would recompile the graph on every event); else nothing (None), compiled as usual.
    """
    if not trace:
        yield None
        return
    with eager(), trace_nonfinite(module) as tracer:
        yield tracer


def traced_names(tracer: OverflowTracer | None) -> list[str]:
    """The module where a traced replay first met inf/NaN (forward first, then backward), as a list; none when the
    batch itself held it (no module made it) or nothing was traced."""
    if tracer is None or tracer.nonfinite_input:
        return []
    first = tracer.first_forward or tracer.first_backward
    return [first] if first else []

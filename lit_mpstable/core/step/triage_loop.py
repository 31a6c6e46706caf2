"""StepTriage: fault triage for a plain PyTorch loop or Lightning Fabric, the same ladder and classification as the
Trainer's ``FaultTriage`` (:mod:`lit_mpstable.core.guards.triage`), over a :class:`~lit_mpstable.core.step.stepper.
PrecisionStepper`; and StateSnapshot, an in-memory copy of the loop's state for the ladder's "state" rung."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypedDict

import torch
from torch import nn
from torch.optim import Optimizer

from lit_mpstable.core.checkpoints import copy_state
from lit_mpstable.core.guards.ladder import REASONS, Ladder, Rung, classify, describe, ladder_of
from lit_mpstable.core.guards.triage import (
    BUDGET_WINDOW,
    LADDER,
    REPLAY_BUDGET,
    RngState,
    _distributed,
    agreed_names,
    any_rank,
    budget_note,
    check_budget,
    climb,
    needs_triage,
    replays_spent,
    restore_rng,
    rng_state,
    state_finite,
    traced,
    traced_names,
    triage_event,
)
from lit_mpstable.core.step.stepper import PrecisionStepper


class ExposesStepper(Protocol):
    """A front end that exposes its stepper (Fabric's ``StablePrecision``)."""

    @property
    def stepper(self) -> PrecisionStepper: ...


class Stateful(Protocol):
    """What a snapshot copies and loads back besides the stepper, the model and the optimizers: an LR scheduler."""

    def state_dict(self) -> dict[str, object]: ...
    def load_state_dict(self, state_dict: dict[str, object]) -> None: ...


class Restorable(Protocol):
    """What the ``"state"`` rung restores: a :class:`StateSnapshot`, or any object with ``restore()`` (and ``step``,
    read where present: None while there is nothing to restore)."""

    def restore(self) -> None: ...


class _Copy(TypedDict):
    """What :meth:`StateSnapshot.take` holds: the state dicts, copied."""

    stepper: dict[str, object]
    model: dict[str, object]
    optimizers: list[dict[str, object]]
    schedulers: list[dict[str, object]]


def _stepper(call: str, value: object) -> PrecisionStepper:
    """``value`` if a PrecisionStepper, else the one a front end exposes (Fabric's ``StablePrecision.stepper``)."""
    found = value if isinstance(value, PrecisionStepper) else getattr(value, "stepper", None)
    if not isinstance(found, PrecisionStepper):
        raise ValueError(f"{call}(stepper={value!r}): must be a PrecisionStepper or a front end that exposes one as"
                         " .stepper (lit_mpstable.fabric.StablePrecision).")
    return found


def _optimizer(call: str, value: object, name: str = "optimizer") -> Optimizer:
    """The torch optimizer behind ``value``: Fabric's wrapper (itself an Optimizer subclass) keeps it as
    ``.optimizer``."""
    wrapped = getattr(value, "optimizer", None)
    inner = wrapped if isinstance(wrapped, Optimizer) else value
    if not isinstance(inner, Optimizer):
        raise ValueError(f"{call}({name}={value!r}): must be a torch.optim.Optimizer or Fabric's wrapper of one"
                         " (what fabric.setup returned).")
    return inner


class StateSnapshot:
    """An in-memory copy of a loop's training state: the stepper's (loss scale, FP32 masters, precision layout),
    the model's, the optimizers' and the LR schedulers' state dicts, on the device where they live. The
    :class:`StepTriage` rung ``"state"`` replays from it, and rolls back to it when that replay is clean.

    Call :meth:`take` after a step you trust (e.g. every 100 clean steps); until then there is nothing to restore
    (``step`` is None) and the rung is skipped.

    Args:
        stepper: the run's PrecisionStepper, or a front end exposing it (Fabric's ``StablePrecision``).
        model: the model (Fabric's wrapper is fine).
        optimizers: an optimizer or several (Fabric's wrappers are fine).
        schedulers: LR schedulers whose position rolls back with the weights.

    Raises:
        ValueError: an argument of the wrong kind (the message names it).
    """

    def __init__(self, stepper: PrecisionStepper | ExposesStepper, model: nn.Module,
                 optimizers: Optimizer | Sequence[Optimizer], schedulers: Iterable[Stateful] = ()) -> None:
        call = type(self).__name__
        self.stepper = _stepper(call, stepper)
        if not isinstance(model, nn.Module):
            raise ValueError(f"{call}(model={model!r}): must be the nn.Module being trained.")
        self.model = model
        listed = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        self.optimizers = [_optimizer(call, optimizer, "optimizers") for optimizer in listed]
        self.schedulers = list(schedulers)
        for scheduler in self.schedulers:
            if not callable(getattr(scheduler, "state_dict", None)):
                raise ValueError(f"{call}(schedulers=[..., {scheduler!r}, ...]): each must have state_dict() and"
                                 " load_state_dict() (a torch LR scheduler).")
        self.step: int | None = None
        """The stepper's ``step_count`` when :meth:`take` last ran (None: nothing taken yet)."""
        self._state: _Copy | None = None

    def take(self) -> None:
        """Copy the state now (replacing the last copy)."""
        self._state = {
            "stepper": copy_state(self.stepper.state_dict()),
            "model": copy_state(self.model.state_dict()),
            "optimizers": [copy_state(optimizer.state_dict()) for optimizer in self.optimizers],
            "schedulers": [copy.deepcopy(scheduler.state_dict()) for scheduler in self.schedulers],
        }
        self.step = self.stepper.step_count

    def current(self) -> StateSnapshot:
        """A new snapshot of the same objects, taken now (to undo a trial of this one)."""
        now = StateSnapshot(self.stepper, self.model, self.optimizers, self.schedulers)
        now.take()
        return now

    def restore(self) -> None:
        """Load the copy back; it stays intact for another restore. The stepper's event counters keep their live
        values (a rollback undoes the weights, not the history).

        Raises:
            RuntimeError: nothing was taken yet.
        """
        state = self._state
        if state is None:
            raise RuntimeError("StateSnapshot.restore(): nothing to restore; call take() first (step is None).")
        # The stepper first: it re-applies the precision layout (casts, FP8 swaps) the weights belong to.
        self.stepper.load_state_dict(copy_state(state["stepper"]), keep_counters=True)
        self.model.load_state_dict(state["model"])
        for optimizer, saved in zip(self.optimizers, state["optimizers"]):
            optimizer.load_state_dict(copy_state(saved))  # it keeps tensors of the right dtype and device: copies
        for scheduler, saved in zip(self.schedulers, state["schedulers"]):
            scheduler.load_state_dict(copy.deepcopy(saved))


class StepTriage:
    """Fault triage for a plain loop or Fabric: :meth:`run` runs one step; a rejected step that the loss scale does
    not explain (a non-finite loss, an inf/NaN batch, inf/NaN at scale 1 or in the weights or optimizer state, a
    SpikeGuard spike) is replayed with the RNG restored, up the ladder of the Trainer's ``FaultTriage`` (the same
    code): as is, in FP32, from ``snapshot``; and classified ``"transient"`` (the clean replay's step is applied),
    ``"precision"`` (applied in FP32; the modules where inf/NaN first appeared fall back), ``"state"`` (rolled back
    to the snapshot, the replay from it applied) or ``"data"`` (the batch stays skipped)::

        triage = StepTriage(stepper, snapshot=StateSnapshot(stepper, model, optimizer))
        for step, (x, y) in enumerate(loader):
            def closure():  # forward and backward of this batch, and nothing else
                with stepper.forward_context():
                    loss = loss_fn(model(stepper.convert_input(x)), y)
                stepper.scale_loss(loss).backward()
                return loss
            loss = triage.run(optimizer, closure)  # zero_grad, closure, step; on a rejected step, triage

    With Fabric pass the plugin (``StablePrecision`` exposes its stepper) and the optimizer ``fabric.setup``
    returned; the closure calls ``fabric.backward(loss)``. The closure must compute from a batch fixed outside it (a
    replay calls it again) and start from zero gradients (:meth:`run` zeroes them first).

    A clean step costs nothing more than the loop's own: one call of the closure, one step, no host read beyond
    the step's skip decision; the RNG states are small host copies. An event costs at most ``max_replays`` more
    calls of the closure. Distributed runs (the default process group) decide alike on every rank: the trigger and
    each replay's verdict are OR-ed over the ranks, the blamed names agreed. A ``torch.compile``'d model runs its
    as-is replay eagerly (it is traced for where inf/NaN first appeared); the other replays run compiled.

    Args:
        stepper: a PrecisionStepper, or a front end exposing it (``lit_mpstable.fabric.StablePrecision``).
        max_replays: rungs of the ladder to try, 1 to 3 (1: as is only; 2: and in FP32; 3: and from the snapshot).
        snapshot: what the ``"state"`` rung restores: a :class:`StateSnapshot`, or any object with ``restore()``
            (and ``step``: None while there is nothing to restore); None: the rung is skipped.
        replay_budget, budget_window: as ``FaultTriage``'s: a rejected step is triaged only while the events of the
            last ``budget_window`` steps ran at most ``replay_budget - max_replays`` replays (12 per 100 by default);
            beyond that it stays skipped untriaged (:attr:`over_budget`), and a warning says so once.

    Raises:
        ValueError: an argument of the wrong kind or out of range (the message names it).
    """

    def __init__(self, stepper: PrecisionStepper | ExposesStepper, *, max_replays: int = 3,
                 snapshot: Restorable | None = None,
                 replay_budget: int = REPLAY_BUDGET, budget_window: int = BUDGET_WINDOW) -> None:
        call = type(self).__name__
        self.stepper = _stepper(call, stepper)
        if isinstance(max_replays, bool) or not isinstance(max_replays, int) or not 1 <= max_replays <= len(LADDER):
            raise ValueError(f"{call}(max_replays={max_replays!r}): must be an int in [1, 3]: replays as is, then in"
                             " FP32, then from the snapshot; 3 tries them all.")
        check_budget(call, max_replays, replay_budget, budget_window)
        if snapshot is not None and not callable(getattr(snapshot, "restore", None)):
            raise ValueError(f"{call}(snapshot={snapshot!r}): must be None, a StateSnapshot or an object with a"
                             " restore() method.")
        self.max_replays, self.replay_budget, self.budget_window = max_replays, replay_budget, budget_window
        self.snapshot = snapshot
        self.events: list[dict[str, Any]] = []
        """Per triaged step, as ``FaultTriage.events``: ``step`` (the :meth:`run` call, from 0), ``kind``,
        ``action``, ``blamed``, ``batch_idx``, ``replays`` and, for ``"state"``, ``restored_step``."""
        self.steps_run = 0
        """Calls of :meth:`run` so far."""
        self.replays_run = 0
        """Closure calls made by replays (0 while every step is clean)."""
        self.rollbacks = 0
        """Steps classified ``"state"`` (each restored the snapshot)."""
        self.over_budget = 0
        """Rejected steps left untriaged because the replay budget had no room (not saved)."""
        self.stop_reason: str | None = None
        """Why the loop should stop (the ladder's stop rung: inf/NaN in the weights or optimizer state and no snapshot
        to roll back to), or None. A plain loop checks it; nothing else can cure such a run."""
        self.ladder: Ladder = ladder_of(self.stepper)
        """The remedy ladder this loop shares with the Trainer's faces (:mod:`lit_mpstable.core.guards.ladder`)."""
        self.ladder.new_fit(self, self.stepper.overflow_count)
        self.ladder.switch_on(Rung.REPLAY, call)
        face = f"{call}(replay_budget={replay_budget}, budget_window={budget_window})"
        self.ladder.claim("replay_budget", replay_budget, face)
        self.ladder.claim("budget_window", budget_window, face)
        if snapshot is not None:
            self.ladder.switch_on(Rung.ROLLBACK, call)

    @property
    def ladder_events(self) -> list[dict[str, Any]]:
        """Every decision of the ladder in this loop: one per rejected step (``step``, ``fault``, ``rung``,
        ``action``, ``reason``, ``remaining``, ...)."""
        return self.ladder.events

    def _step(self, optimizer: Optimizer, inner: Optimizer) -> None:
        """Step through Fabric's wrapper where there is one (its strategy and the plugin), else through the stepper."""
        if optimizer is inner:
            self.stepper.step(inner)
        else:
            optimizer.step()

    @property
    def skipped_batches(self) -> list[int]:
        """``batch_idx`` of the steps classified ``"data"`` (skipped)."""
        return [event["batch_idx"] for event in self.events if event["kind"] == "data"]

    def run(self, optimizer: Optimizer, closure: Callable[[], torch.Tensor], *,
            batch_idx: int | None = None) -> torch.Tensor:
        """Zero the gradients, call ``closure`` (forward and backward of one batch; returns the loss), step
        ``optimizer`` through the stepper; triage the step if it was rejected. Returns the loss of the step as it
        was applied (a clean replay's after an event), or the rejected one's.

        Args:
            optimizer: a torch optimizer set up with the stepper, or Fabric's wrapper (stepped as ``.step()``).
            closure: the step's forward and backward; called again by each replay.
            batch_idx: recorded in the event (default: the step's index, :attr:`steps_run`).

        Raises:
            ValueError: a bad argument, or a closure that did not return a loss tensor.
            RuntimeError: the stepper has no model yet (``setup_module``, or ``fabric.setup``).
        """
        call = f"{type(self).__name__}.run"
        inner = _optimizer(call, optimizer)
        if not callable(closure):
            raise ValueError(f"{call}(closure={closure!r}): must be a callable that runs the forward and backward of"
                             " the batch and returns the loss.")
        if batch_idx is not None and (isinstance(batch_idx, bool) or not isinstance(batch_idx, int) or batch_idx < 0):
            raise ValueError(f"{call}(batch_idx={batch_idx!r}): must be None or an int >= 0.")
        stepper = self.stepper
        module = stepper.layout.module
        if module is None:
            raise RuntimeError(f"{call}(): the stepper has no model; call stepper.setup_module(model) (or fabric.setup)"
                               " first.")
        step, self.steps_run = self.steps_run, self.steps_run + 1
        rng = rng_state()
        _zero_grads(inner, module, model_too=stepper.master_mode is not None)
        loss = closure()
        if not isinstance(loss, torch.Tensor):
            raise ValueError(f"{call}(closure={closure!r}): returned {type(loss).__name__}, not the loss tensor.")
        overflows = stepper.overflow_count
        self._step(optimizer, inner)
        if not stepper.last_step_skipped:  # the step's own skip decision: a host bool, no read
            return loss
        device = next(module.parameters()).device
        flags = needs_triage(stepper, stepper.overflow_count > overflows)
        state_bad = (flags[0] or flags[3]) and not state_finite(module, [inner])
        agreed = any_rank([*flags, state_bad, stepper.last_step_spiked], device)
        fault, replayable = classify(nonfinite_loss=agreed[0], nonfinite_input=agreed[1], unscaled_overflow=agreed[2],
                                     late=agreed[3], spike=agreed[4], state_bad=agreed[5], spiked=agreed[6])
        if self.ladder.decide(step, fault, REASONS[fault], by=call,
                              replayable=replayable) is not Rung.REPLAY:
            return loss  # a routine overflow at a scale above 1: the scaler's business
        spent = replays_spent(self.events, step, self.budget_window)  # alike on every rank, as the events are
        if spent + self.max_replays > self.replay_budget:
            self.ladder.forget(step, "the replay budget is spent")
            self.over_budget += 1
            if self.over_budget == 1 and (not _distributed() or torch.distributed.get_rank() == 0):
                warnings.warn(budget_note(type(self).__name__, step, spent, self.max_replays, self.replay_budget,
                                          self.budget_window), stacklevel=2)
            return loss
        after = rng_state()
        host = _LoopReplay(self, optimizer, inner, module, closure, rng, device)
        kind, outcomes, traced, extra = climb(host, self.max_replays)
        known = dict(module.named_modules())
        # Only a fault that reproduces has a place to blame: where inf/NaN first appeared in the as-is replay.
        blamed = [n for n in agreed_names(traced if kind == "precision" else []) if n in known and n]
        if kind == "precision":
            extra["effect"] = stepper.fallback(blamed or None)
        restore_rng(after)  # the RNG goes on from where the rejected step left it
        self.events.append(triage_event(step, kind, blamed, step if batch_idx is None else batch_idx, outcomes,
                                        **extra))
        if self.ladder.conclude(step, kind, replays=outcomes, blamed=blamed, **extra) is Rung.STOP:
            event = self.ladder.decided(step)
            assert event is not None
            self.stop_reason = describe(event)
            warnings.warn(f"{self.stop_reason} Stop the loop: inf/NaN in the weights or optimizer state and no"
                          " snapshot to roll back to (StepTriage(snapshot=StateSnapshot(...))).", stacklevel=2)
        return host.applied_loss if host.applied_loss is not None else loss

    def state_dict(self) -> dict[str, object]:
        """Keys: ``events``, ``steps_run``, ``replays_run``, ``rollbacks``."""
        return {"events": copy.deepcopy(self.events), "steps_run": self.steps_run, "replays_run": self.replays_run,
                "rollbacks": self.rollbacks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        keys = {"events", "steps_run", "replays_run", "rollbacks"}
        if set(state_dict) != keys:
            raise KeyError(f"{type(self).__name__}.load_state_dict: keys {sorted(state_dict)!r}, expected"
                           f" {sorted(keys)!r}.")
        self.events = copy.deepcopy(list(state_dict["events"]))
        self.steps_run, self.replays_run = int(state_dict["steps_run"]), int(state_dict["replays_run"])
        self.rollbacks = int(state_dict["rollbacks"])


def _zero_grads(optimizer: Optimizer, module: nn.Module, *, model_too: bool = True) -> None:
    optimizer.zero_grad(set_to_none=True)
    if model_too:  # with FP32 masters (or compact weights) the model's 16-bit gradients are not the optimizer's
        module.zero_grad(set_to_none=True)


class _LoopReplay:
    """A plain loop's side of a triage (:class:`~lit_mpstable.core.guards.triage.ReplayHost`): replays call the closure,
    steps go through the stepper (or Fabric's optimizer), snapshots come from the triage's ``snapshot``."""

    def __init__(self, triage: StepTriage, optimizer: Optimizer, inner: Optimizer, module: nn.Module,
                 closure: Callable[[], torch.Tensor], rng: RngState, device: torch.device) -> None:
        self.triage, self.wrapped, self.optimizer, self.module = triage, optimizer, inner, module
        self.closure, self.rng, self.device = closure, rng, device
        self.plugin = triage.stepper
        self.can_fp32 = triage.stepper.can_fallback
        self.applied_loss: torch.Tensor | None = None

    def full_precision(self) -> AbstractContextManager:
        return self.plugin.full_precision()

    def replay(self, *, trace: bool) -> tuple[torch.Tensor | None, list[str]]:
        self.triage.replays_run += 1
        restore_rng(self.rng)
        _zero_grads(self.optimizer, self.module)
        with traced(self.module, trace) as tracer:
            loss = self.closure()
        return (loss.detach() if isinstance(loss, torch.Tensor) else None), traced_names(tracer)

    def apply(self, loss: torch.Tensor | None) -> None:
        self.triage._step(self.wrapped, self.optimizer)
        self.applied_loss = loss

    def discard(self) -> None:
        self.plugin.drop_grads_(self.optimizer)  # and a rejected replay's loss and norm leave SpikeGuard's window
        self.plugin.restore_buffers_()  # the next replay starts from the buffers as the step did
        self.module.zero_grad(set_to_none=True)

    def has_snapshot(self) -> bool:
        snapshot = self.triage.snapshot
        return snapshot is not None and getattr(snapshot, "step", 0) is not None

    def enter_snapshot(self) -> StateSnapshot:
        snapshot = self.triage.snapshot
        assert snapshot is not None  # climb enters one only after has_snapshot()
        current = getattr(snapshot, "current", None)
        backup = current() if callable(current) else StateSnapshot(self.plugin, self.module, [self.optimizer])
        if backup.step is None:
            backup.take()
        try:
            snapshot.restore()
        except BaseException:  # a restore that failed half-way: the current step's state back
            backup.restore()
            raise
        return backup

    def leave_snapshot(self, backup: StateSnapshot) -> None:
        backup.restore()

    def roll_back(self) -> int | None:
        self.triage.rollbacks += 1
        return getattr(self.triage.snapshot, "step", None)

    def any_rank(self, flags: Sequence[bool]) -> list[bool]:
        return any_rank(flags, self.device)

"""A precision schedule: the formats of chosen FP8 layers and GEMM roles change in process, at a step, at the start
of learning-rate decay, or on a trigger (:class:`PrecisionSchedule`; :class:`ScheduleRunner` applies it).

NVIDIA's NVFP4 recipe (arXiv 2509.25149, App. D) switches the forward GEMM's inputs to BF16 shortly before the
learning rate decays; here that is ``PrecisionSchedule(at="lr_decay", fprop="bf16")`` without a restart. Each
milestone is decided from the optimizer step count, which every rank shares (a trigger's verdict is reduced across
ranks, any rank firing fires all), so the formats are the same on every rank at every step. The milestones applied
so far, and the steps they were applied at, are part of the precision plugin's checkpoint state: a resumed run gets
the switched formats back, and a checkpoint written under another schedule is refused, naming both.

A switch replaces each chosen layer's recipe (:meth:`~lit_mpstable.fp8.FP8Linear.set_recipe_`): ``torch.compile``
recompiles the layers' graphs once (the recipe is guarded), with no graph break.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Union

import torch
from torch import nn

from lit_mpstable.fp8.recipe import FORMATS, ROLES, Recipe, recipe, resolve

Trigger = Callable[[int, Mapping[str, Any]], bool]
"""``trigger(step, stats) -> bool``: decides on host data (the step count and the plugin's ``stats`` dict, whatever
is in it already); it must not read device tensors each step."""

_LR_DECAY = "lr_decay"
_SIMULATION_CAP = 200_000
"""Scheduler steps simulated at most when the run's length is unknown (``at="lr_decay"``)."""


@dataclass(frozen=True)
class PrecisionSchedule:
    """One milestone of a precision schedule: at ``at``, the layers matching ``layers`` switch the formats of the
    roles given (``fprop``, ``dgrad``, ``wgrad``: a format of :data:`~lit_mpstable.fp8.FORMATS`, e.g. ``"bf16"``),
    or switch to ``recipe`` (a name or a :class:`~lit_mpstable.fp8.Recipe`; role formats given too override it).

    ``at``: an optimizer step (the formats change before that step's forward; 0-based, the stepper's
    ``step_count``), ``"lr_decay"`` (the first step whose learning rate is below the scheduler's peak, found by
    stepping a copy of the LR scheduler on a dummy optimizer; Lightning's ``interval="epoch"`` counts whole epochs),
    or a trigger ``(step, stats) -> bool`` checked every ``every`` steps at the step's start (its verdict is
    all-reduced, so all ranks switch at the same step). Several milestones: pass a list, applied in order.

    ``layers``: fnmatch patterns on the FP8 layers' qualified names (default every FP8 layer).

    Stochastic rounding, the Hadamard transform and Four Over Six stay on the roles whose new format has them and
    are dropped where it has not (a BF16 dgrad rounds nothing stochastically).

    Raises:
        ValueError: an unknown role format or recipe, no change given, ``at`` neither a step >= 0, ``"lr_decay"``
            nor a callable, ``every`` < 1, an empty pattern (each message names the argument, its value and what is
            allowed). Patterns that match no FP8 layer, and milestones the run cannot reach, are refused when the
            schedule is bound to the model and its LR scheduler (:meth:`ScheduleRunner.bind`).
    """

    at: Union[int, str, Trigger]
    fprop: str | None = None
    dgrad: str | None = None
    wgrad: str | None = None
    recipe: Union[str, Recipe, None] = None
    layers: Union[str, Sequence[str]] = "*"
    every: int = 1

    def __post_init__(self) -> None:
        call = f"PrecisionSchedule(at={self.at!r}"
        at = self.at
        if isinstance(at, bool) or not (isinstance(at, int) and at >= 0 or at == _LR_DECAY or callable(at)):
            raise ValueError(f"{call}): at must be an optimizer step (an int >= 0), 'lr_decay' or a trigger"
                             " callable (step, stats) -> bool.")
        for role in ROLES:
            fmt = getattr(self, role)
            if fmt is not None and fmt not in FORMATS:
                raise ValueError(f"{call}, {role}={fmt!r}): a role's format must be one of {list(FORMATS)}.")
        if self.recipe is not None:
            resolve(self.recipe, f"{call}, recipe={self.recipe!r})")
        if self.recipe is None and all(getattr(self, role) is None for role in ROLES):
            raise ValueError(f"{call}): nothing to change; give a role's format (fprop=, dgrad=, wgrad=: one of"
                             f" {list(FORMATS)}) or recipe=.")
        layers = (self.layers,) if isinstance(self.layers, str) else tuple(self.layers)
        if not layers or not all(isinstance(p, str) and p.strip() for p in layers):
            raise ValueError(f"{call}, layers={self.layers!r}): layers must be fnmatch patterns of FP8 layers'"
                             " qualified names (non-empty strings); '*' is every FP8 layer.")
        object.__setattr__(self, "layers", layers)
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"{call}, every={self.every!r}): every must be an int >= 1 (steps between trigger"
                             " checks).")

    @property
    def changes(self) -> dict[str, str]:
        """The role formats this milestone sets (its recipe's roles first, then those given)."""
        out = resolve(self.recipe, "PrecisionSchedule").formats if self.recipe is not None else {}
        out.update({role: getattr(self, role) for role in ROLES if getattr(self, role) is not None})
        return out

    def describe(self) -> str:
        """A stable text of the milestone (what checkpoints compare)."""
        at = self.at if not callable(self.at) else f"trigger:{getattr(self.at, '__qualname__', type(self.at).__name__)}"
        base = f"recipe={resolve(self.recipe, '').name}," if self.recipe is not None else ""
        roles = ",".join(f"{r}={getattr(self, r)}" for r in ROLES if getattr(self, r) is not None)
        return f"at={at} layers={','.join(self.layers)} {base}{roles}".rstrip(",")

    def switched(self, spec: Recipe) -> Recipe:
        """``spec`` after this milestone.

        Raises:
            ValueError: the new formats make no valid recipe (e.g. ``"delayed"`` on one role only).
        """
        base = resolve(self.recipe, "PrecisionSchedule") if self.recipe is not None else spec
        given: dict[str, str] = {role: getattr(self, role) for role in ROLES if getattr(self, role) is not None}
        final = {role: given.get(role, getattr(base, role)) for role in ROLES}
        fields: dict[str, Any] = dict(given)
        fields["stochastic_rounding"] = tuple(r for r in base.stochastic_rounding if FORMATS[final[r]].stochastic)
        fields["hadamard"] = tuple(r for r in base.hadamard if FORMATS[final[r]].quantized)
        nvfp4 = any(FORMATS[f].fp4 and not FORMATS[f].mx for f in final.values())
        fields["four_over_six"] = base.four_over_six and nvfp4
        suffix = "+".join(f"{r}={f}" for r, f in given.items())
        fields["name"] = f"{base.name}+{suffix}" if suffix else base.name
        return recipe(base, **fields)


ScheduleArg = Union[PrecisionSchedule, Sequence[PrecisionSchedule], None]


def check_schedule(value: Any, call: str = "StablePrecision(schedule") -> tuple[PrecisionSchedule, ...]:
    """``schedule=`` as a tuple of milestones (None: empty).

    Raises:
        ValueError: neither None, a PrecisionSchedule nor a list of them.
    """
    if value is None:
        return ()
    items = (value,) if isinstance(value, PrecisionSchedule) else value
    if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Sequence) or not all(
            isinstance(m, PrecisionSchedule) for m in items):
        raise ValueError(f"{call}={value!r:.120}): must be None, a PrecisionSchedule or a list of them, e.g."
                         " PrecisionSchedule(at='lr_decay', fprop='bf16').")
    return tuple(items)


# ------------------------------------------------------------------------------------------- the LR scheduler
def _unpack(entry: Any) -> tuple[Any, str]:
    """``(scheduler, interval)`` of a scheduler, a ``(scheduler, interval)`` pair or Lightning's LRSchedulerConfig."""
    if isinstance(entry, tuple) and len(entry) == 2:
        return entry[0], str(entry[1])
    if hasattr(entry, "scheduler") and hasattr(entry, "interval"):
        return entry.scheduler, str(entry.interval)
    return entry, "step"


def lr_decay_step(scheduler: Any, *, max_steps: int | None = None, interval: str = "step",
                  steps_per_epoch: int | None = None) -> int:
    """The first optimizer step whose learning rate is below the peak of ``scheduler``'s schedule, from where the
    scheduler stands now: a copy of it is stepped on a dummy optimizer (the real one and its state are untouched).

    Raises:
        ValueError: the learning rate never falls within ``max_steps`` (or the simulation cap), or ``interval`` is
            ``"epoch"`` without ``steps_per_epoch``.
    """
    optimizer = scheduler.optimizer
    dummy = torch.optim.SGD([{**{k: v for k, v in group.items() if k != "params"},
                              "params": [torch.zeros(1, requires_grad=True)]} for group in optimizer.param_groups],
                            lr=optimizer.param_groups[0]["lr"])
    twin = copy.deepcopy(scheduler, memo={id(optimizer): dummy})
    if interval == "epoch" and not steps_per_epoch:
        raise ValueError(f"PrecisionSchedule(at='lr_decay') with an LR scheduler stepped per epoch needs the steps per"
                         f" epoch; got steps_per_epoch={steps_per_epoch!r}.")
    per = steps_per_epoch if interval == "epoch" and steps_per_epoch else 1
    horizon = max_steps if max_steps is not None and max_steps > 0 else _SIMULATION_CAP
    calls = -(-horizon // per)
    lrs = [dummy.param_groups[0]["lr"]]
    peak, falls = lrs[0], None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": the dummy never steps
        for call in range(1, calls + 1):  # stops at the first LR below the peak so far
            twin.step()
            lr = dummy.param_groups[0]["lr"]
            if lr < peak * (1 - 1e-9):
                falls = call
                break
            peak = max(peak, lr)
    name = type(scheduler).__name__
    if falls is None or falls * per >= horizon:
        within = f"max_steps={max_steps}" if max_steps else f"{_SIMULATION_CAP} steps"
        raise ValueError(f"PrecisionSchedule(at='lr_decay'): the learning rate of {name} never falls below its peak"
                         f" {peak:g} within {within}; give a step (at=<int>) or a scheduler that decays.")
    return falls * per


# ------------------------------------------------------------------------------------------------ the runner
class ScheduleRunner:
    """Applies a precision schedule to a model's FP8 layers: :meth:`bind` once the model and its LR scheduler are
    known, :meth:`on_step_start` at the start of each optimizer step (host ints only: no device read, except a
    trigger's cross-rank reduction on the steps it is checked), :meth:`state_dict` / :meth:`load_state_dict` in the
    precision plugin's checkpoint state."""

    def __init__(self, schedule: ScheduleArg) -> None:
        self.milestones = check_schedule(schedule)
        self.steps: list[int | None] = [m.at if isinstance(m.at, int) else None for m in self.milestones]
        """The resolved step of each milestone (None: a trigger, or ``"lr_decay"`` before :meth:`bind`)."""
        self.applied: list[int | None] = [None] * len(self.milestones)
        """The step each milestone was applied at (None: not yet)."""
        self.targets: list[list[str]] = [[] for _ in self.milestones]
        self.events: list[dict[str, Any]] = []
        """One entry per switch: ``{"step", "milestone", "layers", "formats"}`` (the report's timeline reads it)."""
        self.model: nn.Module | None = None
        self._live: set[int] = set()  # milestones whose switch is in the layers now
        self._base: dict[str, Any] = {}  # each target layer's FP8Config before any milestone (its recipe as given)

    def __bool__(self) -> bool:
        return bool(self.milestones)

    @property
    def bound(self) -> bool:
        return self.model is not None

    @property
    def signature(self) -> list[str]:
        return [m.describe() for m in self.milestones]

    def bind(self, model: nn.Module, schedulers: Sequence[Any] = (), *, max_steps: int | None = None,
             steps_per_epoch: int | None = None, step: int = 0) -> None:
        """Resolve the layers and ``"lr_decay"`` against ``model`` and the LR ``schedulers`` (the first one decides;
        each a scheduler, a ``(scheduler, interval)`` pair or Lightning's LRSchedulerConfig), and check each switch.
        ``step``: the optimizer steps taken so far (where the scheduler stands); a milestone resolved before (a loaded
        checkpoint's) keeps its step.

        Raises:
            ValueError: a pattern matches no FP8 layer (the FP8 layers are listed), a layer is not this package's
                FP8Linear, a milestone step >= ``max_steps``, ``"lr_decay"`` without a scheduler or with one that
                never decays, a switch that makes no valid recipe or that a layer's shape cannot take.
        """
        self._resolve_targets(model)
        for index, milestone in enumerate(self.milestones):
            call = f"PrecisionSchedule(at={milestone.at!r}, layers={list(milestone.layers)!r})"
            if milestone.at == _LR_DECAY and self.steps[index] is None:
                if not schedulers:
                    raise ValueError(f"{call}: at='lr_decay' needs an LR scheduler, and the run has none; give a step"
                                     " (at=<int>).")
                scheduler, interval = _unpack(schedulers[0])
                left = max_steps - step if max_steps is not None and max_steps > 0 else None
                self.steps[index] = step + lr_decay_step(scheduler, max_steps=left, interval=interval,
                                                         steps_per_epoch=steps_per_epoch)
            due = self.steps[index]
            if due is not None and max_steps is not None and max_steps > 0 and due >= max_steps:
                raise ValueError(f"{call}: the milestone's step {due} is never reached: the run has max_steps="
                                 f"{max_steps} (steps 0..{max_steps - 1}).")
        self.attach_(model)

    def attach_(self, model: nn.Module) -> None:
        """Use ``model`` and switch its layers to the milestones applied already (a loaded checkpoint's), without
        resolving ``"lr_decay"`` (:meth:`bind` does; a resume binds at its first step)."""
        if self.model is not model:
            self._resolve_targets(model)
            self._live.clear()
        self.model = model
        self._reapply()

    def _reapply(self) -> None:
        """Switch the layers to the milestones applied already (a checkpoint's)."""
        for index, applied in enumerate(self.applied):
            if applied is not None:
                self._apply(index, applied, record=False)

    def _resolve_targets(self, model: nn.Module) -> None:
        layers = {name: module for name, module in model.named_modules() if hasattr(module, "fp8_config")}
        planned = {name: module.fp8_config.spec for name, module in layers.items()}  # each layer's recipe, in order
        self._base = {name: module.fp8_config for name, module in layers.items()}
        for index, milestone in enumerate(self.milestones):
            call = f"PrecisionSchedule(at={milestone.at!r}, layers={list(milestone.layers)!r})"
            names = [n for n in layers if any(fnmatch.fnmatchcase(n, p) for p in milestone.layers)]
            unmatched = [p for p in milestone.layers if not any(fnmatch.fnmatchcase(n, p) for n in layers)]
            if unmatched:
                raise ValueError(f"{call}: the pattern(s) {unmatched} match no FP8 layer; the FP8 layers are"
                                 f" {list(layers) or 'none (is fp8 set?)'}.")
            for name in names:
                module = layers[name]
                if not callable(getattr(module, "set_recipe_", None)):  # FP8Linear's (no import: linear imports config)
                    raise ValueError(f"{call}: layer {name!r} is a {type(module).__name__}; a schedule switches"
                                     " backend='native' FP8 layers (FP8Linear) only.")
                spec = planned[name]
                try:
                    new = planned[name] = milestone.switched(spec)
                except ValueError as error:
                    raise ValueError(f"{call}: layer {name!r} ({spec.name}) cannot switch: {error}") from None
                if module.in_features % new.multiple or module.out_features % new.multiple:
                    raise ValueError(f"{call}: layer {name!r} is {module.in_features}->{module.out_features}; the"
                                     f" recipe {new.name} needs multiples of {new.multiple}.")
            self.targets[index] = names

    def on_step_start(self, step: int, stats: Mapping[str, Any] | None = None) -> list[str]:
        """Apply every milestone due at optimizer step ``step`` (a host int, the same on every rank). Returns one
        line per switch made (empty on most steps)."""
        if self.model is None:
            raise RuntimeError("ScheduleRunner.on_step_start: bind(model, schedulers) first.")
        done = []
        for index, milestone in enumerate(self.milestones):
            if self.applied[index] is not None:
                continue
            due = self.steps[index]
            if due is None and callable(milestone.at) and step % milestone.every == 0:
                fired = bool(milestone.at(step, stats if stats is not None else {}))
                if _agree(fired):
                    due = self.steps[index] = step
            if due is not None and step >= due:
                done.append(self._apply(index, step))
        return done

    def _apply(self, index: int, step: int, record: bool = True) -> str:
        if index not in self._live:
            self._live.add(index)
            self._switch(self.targets[index])
        self.applied[index] = step
        milestone = self.milestones[index]
        formats = milestone.changes
        event = {"step": step, "milestone": index, "layers": len(self.targets[index]), "formats": formats,
                 "at": milestone.describe()}
        if record or not any(e["milestone"] == index for e in self.events):
            self.events.append(event)
        roles = ", ".join(f"{r}->{f}" for r, f in formats.items())
        return f"precision schedule at step {step}: {roles} on {len(self.targets[index])} FP8 layer(s)"

    def sync_(self) -> None:
        """Switch every target layer that computes in FP8 now to the recipe the milestones in force give it: a layer
        a fallback had taken out of FP8 missed the switches made meanwhile, and comes back (``restore_precision``,
        a rollback across the fallback) in its configured recipe."""
        if self.model is not None:
            self._switch(list(self._base))

    @contextlib.contextmanager
    def rewound(self, state: Any) -> Iterator[None]:
        """The layers in the recipes of ``state`` (:meth:`state_dict` of an earlier point of this run: a rollback's
        snapshot) inside the block, where the snapshot's FP8 state is loaded (its keys follow the recipe it was
        taken in), then back in the recipes of the milestones in force: the schedule follows the step count, which
        a rollback keeps, and a milestone the snapshot predates switches the loaded state as it did the first time.
        Anything else (no model bound, another schedule's state) leaves the layers as they are."""
        if self.model is None or not isinstance(state, Mapping) or state.get("milestones") != self.signature:
            yield
            return
        live, self._live = self._live, {i for i, step in enumerate(state.get("applied", ())) if step is not None}
        try:
            self.sync_()
            yield
        finally:
            self._live = live
            self.sync_()

    def _switch(self, names: list[str]) -> None:
        """Put the named layers in their scheduled recipe; a layer that left FP8 (a fallback) is skipped, and
        :meth:`sync_` switches it when it returns."""
        assert self.model is not None  # every caller has a model
        for name in names:
            module: Any = self.model.get_submodule(name)
            if not callable(getattr(module, "set_recipe_", None)):
                continue  # an FP8Linear at bind, a plain nn.Linear while a fallback holds it out of FP8
            config = base = self._base[name]
            for index in sorted(self._live):
                if name in self.targets[index]:
                    config = replace(base, recipe=self.milestones[index].switched(config.spec))
            if module.fp8_config != config:
                module.set_recipe_(config)

    # ------------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """``{"milestones": [descriptions], "steps": resolved steps, "applied": steps applied at}`` (plain values)."""
        return {"milestones": self.signature, "steps": list(self.steps), "applied": list(self.applied)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output: the milestones applied in the checkpoint are applied again (now if
        bound, else at :meth:`bind`), so a resume past a milestone runs the switched formats; loaded in process
        (the restored-state rung's earlier file), the milestones applied since the file's save are undone first.

        Raises:
            ValueError: the checkpoint's schedule differs from this one (both named), or a field is malformed.
        """
        if not isinstance(state, Mapping) or set(state) != {"milestones", "steps", "applied"}:
            raise ValueError(f"precision schedule state {state!r:.200}: expected the keys 'milestones', 'steps' and"
                             " 'applied'.")
        if list(state["milestones"]) != self.signature:
            raise ValueError(f"precision schedule: the checkpoint was written under the schedule {state['milestones']}"
                             f" and this run has {self.signature}; resume with the same schedule=.")
        for key in ("steps", "applied"):
            values = state[key]
            if len(values) != len(self.milestones) or not all(
                    v is None or isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
                raise ValueError(f"precision schedule state[{key!r}]={values!r}: one step (int >= 0) or None per"
                                 " milestone.")
        self.steps = [s if s is not None else self.steps[i] for i, s in enumerate(state["steps"])]
        self.applied = list(state["applied"])
        if self.model is not None:
            # Loaded in process (an earlier file of the run): the layers take the file's milestones, those it
            # predates are undone, and they switch again when the run's step count reaches them.
            self._live = {i for i in self._live if self.applied[i] is not None}
            self.sync_()
            self._reapply()


def schedule_runner(schedule: Any, fp8: Any) -> ScheduleRunner:
    """The runner of ``StablePrecision(schedule=...)`` or ``FP8Config(schedule=...)`` (an empty one without either).

    Raises:
        ValueError: both given, a schedule without ``fp8``, or a malformed ``schedule``.
    """
    milestones = check_schedule(schedule)
    from_config = getattr(fp8, "schedule", None) or ()
    if milestones and from_config:
        raise ValueError(f"StablePrecision(schedule={schedule!r:.100}, fp8=FP8Config(schedule=...)): two schedules;"
                         " give it in one place.")
    if milestones and fp8 is None:
        raise ValueError(f"StablePrecision(schedule={schedule!r:.100}): a precision schedule switches FP8 layers, and"
                         " fp8 is None; set fp8= (e.g. 'nvfp4').")
    return ScheduleRunner(milestones or from_config)


def load_schedule_state(runner: ScheduleRunner, state: Any, model: nn.Module | None) -> Any:
    """``state`` without its ``precision_schedule`` entry, which is loaded into ``runner`` (and its applied milestones
    switched in ``model`` now, before the layers' own FP8 state is loaded, whose keys follow the recipe).

    Raises:
        ValueError: the checkpoint has a schedule and the run none, or the reverse, or another one (both named).
    """
    if not isinstance(state, Mapping) or not runner and "precision_schedule" not in state:
        return state  # junk is named by the stepper's own checks
    state = dict(state)
    saved = state.pop("precision_schedule", None)
    if saved is None and runner:
        raise ValueError(f"precision schedule: the checkpoint was written without one and this run has"
                         f" {runner.signature}; resume with schedule=None or from a checkpoint of this schedule.")
    if saved is not None and not runner:
        milestones = saved.get("milestones") if isinstance(saved, Mapping) else saved
        raise ValueError(f"precision schedule: the checkpoint was written under the schedule {milestones} and this"
                         " run has none; resume with the same schedule=.")
    if saved is not None:
        runner.load_state_dict(saved)
        if model is not None and not runner.bound and any(step is not None for step in runner.applied):
            runner.attach_(model)
    return state


def _agree(fired: bool) -> bool:
    """A trigger's verdict, the same on every rank: any rank firing fires all (a MAX all-reduce where a process
    group runs; one small collective on the steps the trigger is checked)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return fired
    if torch.distributed.get_world_size() < 2:
        return fired
    backend = torch.distributed.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    flag = torch.tensor([1 if fired else 0], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())

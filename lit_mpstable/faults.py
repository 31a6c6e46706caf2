"""FaultInjector: scripted numerical faults at chosen optimizer steps, a Lightning callback for a project's own CI;
and, re-exported from the core, StepTriage and StateSnapshot: fault triage for a plain loop or Fabric."""

from __future__ import annotations

import types
from collections.abc import Iterable, Mapping
from functools import cached_property
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
from torch import nn

from lit_mpstable.core.step.triage_loop import StateSnapshot, StepTriage

__all__ = ["FaultInjector", "FaultKind", "StateSnapshot", "StepTriage"]

FaultKind = Literal["transient", "nan_batch", "fp16_overflow", "loss_spike", "grad_spike"]
_KINDS: tuple[str, ...] = get_args(FaultKind)
_FP16_MAX = 65504.0
LOSS_SPIKE_FACTOR = 1e4
GRAD_SPIKE_FACTOR = 1e3
GRAD_SPIKE_STRIDE = 100
"""``"grad_spike"`` multiplies every 100th gradient coordinate (1%: SPAM's spikes hit a few coordinates hard)."""


class FaultInjector(pl.Callback):
    """Inject one numerical fault at each scheduled optimizer step (``trainer.global_step``), to check in CI that a
    run survives them (``StablePrecision``, ``SpikeGuard``, ``FaultTriage``).

    Kinds, all keyed by the step so a resumed run sees the same faults:

    - ``"transient"``: one activation element of ``module`` becomes NaN on the step's first forward only; a replay of
      the step (another forward in the same step) is clean, as after a flipped bit.
    - ``"nan_batch"``: the first element of the batch's first floating-point tensor is NaN, for every execution of the
      step (a corrupted record). Written into the batch ``training_step`` receives (after the precision plugin's
      input conversion, which is then shown the batch again: its input check sees the NaN as a data fault, and no
      layer is blamed) and restored after the batch, so the dataset is left as it was.
    - ``"fp16_overflow"``: ``module``'s output is multiplied and divided by a power of two that takes its largest
      value past FP16's range (65504): inf in FP16, the same values bit for bit in FP32 and BF16.
    - ``"loss_spike"``: the loss ``training_step`` returns is multiplied by ``loss_spike_factor`` (1e4), for every
      execution of the step (a corrupted batch: a replay spikes again).
    - ``"grad_spike"``: every 100th coordinate of ``module``'s parameter gradients is multiplied by 1e3 (hooks on the
      parameters, so each backward's contribution is scaled once, with gradient accumulation too).

    Args:
        schedule: ``{step: kind}``, steps are ``trainer.global_step`` values (optimizer steps, from 0).
        module: qualified name (as in ``named_modules()`` of the LightningModule) of the module that
            ``"transient"``, ``"fp16_overflow"`` and ``"grad_spike"`` act on; default: the first leaf module with
            parameters.
        ranks: the global ranks that inject; default: every rank.
        loss_spike_factor: what ``"loss_spike"`` multiplies the loss by, > 1 (1e4 by default; in FP16 a factor whose
            gradients stay under 65504, such as 100, makes a spike rather than an overflow).

    At setup a schedule that can never fire is refused (``ValueError`` naming the entry), so a CI test cannot pass
    vacuously: a step at or past ``max_steps``, a ``module`` that names nothing, ``ranks`` none of which exists,
    ``"fp16_overflow"`` under a precision without FP16 (it is exact in FP32 and BF16). A fault armed at its step
    that took no effect by the batch's end (its module never ran a training forward, or has no gradient) raises
    ``RuntimeError`` naming the entry. The hooks and the wrapped ``training_step`` are removed when the fit ends,
    by an exception too (``on_exception``), so no later fit is faulted.

    Attributes:
        injected: ``(step, kind)`` for each fault that took effect, once per step, in order.

    Raises:
        TypeError, ValueError: a bad schedule, module or ranks (the message names it); at setup, a schedule entry
            that can never fire.
        RuntimeError: a fault armed at its step took no effect.
    """

    def __init__(
        self, schedule: Mapping[int, FaultKind], *, module: str | None = None, ranks: Iterable[int] | None = None,
        loss_spike_factor: float = LOSS_SPIKE_FACTOR,
    ) -> None:
        call = type(self).__name__
        if not isinstance(schedule, Mapping):
            raise TypeError(f"{call}(schedule={schedule!r}): must be a dict {{step: kind}}, e.g. {{10: 'nan_batch'}}.")
        for step, kind in schedule.items():
            if isinstance(step, bool) or not isinstance(step, int):
                raise TypeError(f"{call}(schedule={schedule!r}): step {step!r} must be an int (a trainer.global_step).")
            if step < 0:
                raise ValueError(f"{call}(schedule={schedule!r}): step {step!r} must be >= 0 (optimizer steps count"
                                 " from 0).")
            if kind not in _KINDS:
                raise ValueError(f"{call}(schedule={schedule!r}): kind {kind!r} at step {step} is not one of"
                                 f" {_KINDS!r}.")
        if module is not None and not isinstance(module, str):
            raise TypeError(f"{call}(module={module!r}): must be a module's qualified name (a str) or None.")
        if ranks is not None:
            if not isinstance(ranks, (list, tuple, set, frozenset, range)):
                raise TypeError(f"{call}(ranks={ranks!r}): must be a collection of global ranks or None.")
            if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in tuple(ranks)):
                raise ValueError(f"{call}(ranks={ranks!r}): each rank must be an int >= 0.")
        if isinstance(loss_spike_factor, bool) or not isinstance(loss_spike_factor, (int, float)):
            raise TypeError(f"{call}(loss_spike_factor={loss_spike_factor!r}): must be a number > 1.")
        if not 1 < loss_spike_factor < float("inf"):
            raise ValueError(f"{call}(loss_spike_factor={loss_spike_factor!r}): must be a finite number > 1 (what a"
                             " 'loss_spike' multiplies the loss by; 1e4 by default).")
        self.loss_spike_factor = float(loss_spike_factor)
        self.schedule: dict[int, str] = dict(schedule)
        self.module = module
        self.ranks = None if ranks is None else frozenset(ranks)
        self.injected: list[tuple[int, str]] = []
        self._target: nn.Module | None = None
        self._handles: list[Any] = []
        self._wrapped: pl.LightningModule | None = None
        self._armed: str | None = None  # the kind armed for the batch in progress
        self._step = -1
        self._transient_done: set[int] = set()
        self._restore: list[tuple[torch.Tensor, torch.Tensor]] = []  # (batch tensor, its first element)

    @cached_property  # the constructor's arguments: Lightning reads the key at every hook of every step
    def state_key(self) -> str:
        # Two injectors coexist (faults on different ranks need one each): the arguments tell them apart, so a
        # resumed run's injectors find their own entries.
        return type(self).__qualname__ + repr(dict(
            schedule=dict(sorted(self.schedule.items())), module=self.module,
            ranks=None if self.ranks is None else sorted(self.ranks), loss_spike_factor=self.loss_spike_factor))

    # ------------------------------------------------------------------------------------------------ hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._remove()  # what a fit before may have left
        self._refuse_unfirable(trainer, pl_module)
        kinds = set(self.schedule.values())
        if kinds & {"transient", "fp16_overflow", "grad_spike"}:
            self._target = _find_module(pl_module, self.module)
            if kinds & {"transient", "fp16_overflow"}:
                self._handles.append(self._target.register_forward_hook(self._forward_hook))
            if "grad_spike" in kinds:
                for param in self._target.parameters():
                    if param.requires_grad:
                        self._handles.append(param.register_hook(self._grad_hook))
        if "loss_spike" in kinds:
            original = pl_module.training_step
            # Bound to the module, so a deep copy of it (PrecisionProbe's replay) calls the copy's training_step.
            step_fn = (original.__func__ if isinstance(original, types.MethodType) and original.__self__ is pl_module
                       else None)

            def training_step(module: pl.LightningModule, *args: Any, **kwargs: Any) -> Any:
                output = original(*args, **kwargs) if step_fn is None else step_fn(module, *args, **kwargs)
                return self._spike_loss(output)

            training_step.__wrapped__ = original  # type: ignore[attr-defined]
            # An instance attribute, removed at teardown.
            pl_module.training_step = types.MethodType(training_step, pl_module)  # type: ignore[method-assign]
            self._wrapped = pl_module

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._remove()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning calls no teardown hook after an exception: without this the hooks, the wrapped training_step and
        # the armed fault would outlive the fit and fault every later one.
        self._remove()

    def _remove(self) -> None:
        self._undo_batch()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._wrapped is not None:
            self._wrapped.__dict__.pop("training_step", None)
            self._wrapped = None
        self._armed, self._target = None, None

    def _refuse_unfirable(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Refuse, naming the entry, a schedule that can never fire in this fit."""
        call = f"FaultInjector(schedule={self.schedule!r})"
        max_steps = trainer.max_steps
        if max_steps is not None and max_steps >= 0:
            for step, kind in self.schedule.items():
                if step >= max_steps:
                    raise ValueError(f"{call}: schedule entry {step}: {kind!r} can never fire: max_steps={max_steps}"
                                     f" runs steps 0 to {max_steps - 1}; schedule it below {max_steps}.")
        precision = getattr(trainer.precision_plugin, "precision", None)
        if isinstance(precision, str) and not precision.startswith("16"):
            for step, kind in self.schedule.items():
                if kind == "fp16_overflow":
                    raise ValueError(f"{call}: schedule entry {step}: {kind!r} can never fire: the precision is"
                                     f" {precision!r}, and the fault exists only in FP16's range ('16-mixed',"
                                     " '16-true'); it is exact in FP32 and BF16. Schedule 'transient' or"
                                     " 'nan_batch' for a non-finite step in this precision.")
        if self.module is not None:
            _find_module(pl_module, self.module)  # a name that matches nothing is refused, whatever the kinds
        if self.ranks is not None and not any(rank < trainer.world_size for rank in self.ranks):
            raise ValueError(f"FaultInjector(ranks={sorted(self.ranks)!r}): no such rank in this run (world size"
                             f" {trainer.world_size}, ranks 0 to {trainer.world_size - 1}): no fault would fire.")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._undo_batch()  # a batch that never reached on_train_batch_end (skipped by a callback)
        step = trainer.global_step
        kind = self.schedule.get(step)
        if self.ranks is not None and trainer.global_rank not in self.ranks:
            kind = None
        if kind == "transient" and step in self._transient_done:
            kind = None  # the step's first execution has passed (e.g. this is another micro-batch of it)
        self._armed, self._step = kind, step
        if kind == "nan_batch":
            tensor = _first_floating(batch)
            if tensor is None:
                raise RuntimeError(f"FaultInjector: the batch of step {step} holds no floating-point tensor to put a"
                                   " NaN in; schedule another kind for this model.")
            first = (0,) * tensor.dim()  # indexing, not a flattened copy: any layout is written in place
            self._restore.append((tensor, tensor[first].clone()))
            with torch.no_grad():
                tensor[first] = float("nan")
            # Lightning converted the batch before this hook: show the precision plugin the record as it would have
            # come from the data pipeline, so its input check sees a data fault (no layer is blamed for it). On an
            # already converted batch the conversion changes nothing; its result is not needed.
            trainer.precision_plugin.convert_input(batch)
            self._record("nan_batch")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._undo_batch()
        armed, self._armed = self._armed, None
        if armed is not None and armed != "transient" and (self._step, armed) not in self.injected:
            raise RuntimeError(self._no_effect(armed))
        if armed == "transient" and self._step not in self._transient_done:
            raise RuntimeError(self._no_effect(armed))

    def _no_effect(self, kind: str) -> str:
        where = {"transient": f"module {self.module or '(the first leaf with parameters)'} ran no training forward",
                 "fp16_overflow": f"module {self.module or '(the first leaf with parameters)'} ran no training"
                                  " forward",
                 "grad_spike": f"module {self.module or '(the first leaf with parameters)'}'s parameters got no"
                               " gradient",
                 "loss_spike": "training_step returned no loss"}.get(kind, "")
        return (f"FaultInjector: schedule entry {self._step}: {kind!r} took no effect in its step ({where}); the"
                " test would pass without the fault. Choose a module that runs in training_step.")

    def state_dict(self) -> dict[str, Any]:
        """``injected`` (lists ``[step, kind]``) and ``transient_done`` (steps whose transient fault has fired)."""
        return {"injected": [[step, kind] for step, kind in self.injected],
                "transient_done": sorted(self._transient_done)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != {"injected", "transient_done"}:
            raise KeyError(f"FaultInjector.load_state_dict: keys {sorted(state_dict)!r}, expected ['injected',"
                           " 'transient_done']; was it written by another version of lit_mpstable?")
        self.injected = [(int(step), str(kind)) for step, kind in state_dict["injected"]]
        self._transient_done = {int(step) for step in state_dict["transient_done"]}

    # ------------------------------------------------------------------------------------------------ faults
    def _record(self, kind: str) -> None:
        if (self._step, kind) not in self.injected:
            self.injected.append((self._step, kind))

    def _forward_hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        kind = self._armed
        if kind not in ("transient", "fp16_overflow") or not module.training:  # not a validation forward
            return None
        if not isinstance(output, torch.Tensor) or not output.is_floating_point():
            raise TypeError(f"FaultInjector(module={self.module!r}): {type(module).__name__} returned"
                            f" {type(output).__name__}, not a floating-point tensor; choose a module whose output is"
                            " one (e.g. an nn.Linear).")
        if kind == "transient":
            self._armed = None
            self._transient_done.add(self._step)
            self._record(kind)
            output = output.clone()
            output.view(-1)[0] = float("nan")
            return output
        self._record(kind)
        # A power of two: exact in FP32 and BF16 (an exponent shift), past 65504 for the largest value in FP16.
        # Computed on the device (no host read); in FP16 the factor itself may be inf, which is the point.
        amax = output.detach().abs().amax().float().clamp(min=2.0**-100)
        factor = torch.exp2(torch.ceil(torch.log2(2 * _FP16_MAX / amax)))
        return output * factor / factor

    def _spike_loss(self, output: Any) -> Any:
        if self._armed != "loss_spike":
            return output
        self._record("loss_spike")
        if isinstance(output, torch.Tensor):
            return output * self.loss_spike_factor
        if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
            return {**output, "loss": output["loss"] * self.loss_spike_factor}
        raise RuntimeError(f"FaultInjector: 'loss_spike' at step {self._step} needs training_step to return the loss"
                           f" (a tensor or a dict with 'loss'), got {type(output).__name__}.")

    def _grad_hook(self, grad: torch.Tensor) -> torch.Tensor | None:
        if self._armed != "grad_spike":
            return None
        self._record("grad_spike")
        mask = torch.ones(grad.numel(), dtype=grad.dtype, device=grad.device)
        mask[::GRAD_SPIKE_STRIDE] = GRAD_SPIKE_FACTOR
        return grad * mask.view_as(grad)

    def _undo_batch(self) -> None:
        with torch.no_grad():
            for tensor, value in self._restore:
                tensor[(0,) * tensor.dim()] = value
        self._restore = []


def _find_module(pl_module: nn.Module, name: str | None) -> nn.Module:
    if name is None:
        for _, module in pl_module.named_modules():
            if not list(module.children()) and any(True for _ in module.parameters(recurse=False)):
                return module
        raise ValueError(f"FaultInjector(module=None): {type(pl_module).__name__} has no leaf module with parameters;"
                         " name the module to fault with module=...")
    names = dict(pl_module.named_modules())
    if name not in names:
        listed = [n for n in names if n][:8]
        raise ValueError(f"FaultInjector(module={name!r}): {type(pl_module).__name__} has no such module; some of its"
                         f" modules: {listed!r}.")
    return names[name]


def _first_floating(data: Any) -> torch.Tensor | None:
    if isinstance(data, torch.Tensor):
        return data if data.is_floating_point() and data.numel() else None
    values = data.values() if isinstance(data, Mapping) else data if isinstance(data, (list, tuple)) else ()
    for value in values:
        if (found := _first_floating(value)) is not None:
            return found
    return None

"""What a training step's gradients say: telemetry every N steps, and who is to blame after an overflow."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from lit_mpstable.core.attribution import (
    OverflowTracer,
    RngState,
    locate_nonfinite,
    nonfinite_grad_params,
    overflow_key,
    overflow_warning,
)
from lit_mpstable.core.telemetry import GradTelemetry
from lit_mpstable.fp8 import fp8_stats
from lit_mpstable.fp8.swap import collect_fp8_stats_

try:
    from torch.distributed.tensor import DTensor as _DTENSOR
except ImportError:  # a torch build without torch.distributed
    _DTENSOR = ()  # type: ignore[assignment,misc]

NamedGrads = list[tuple[str, Any]]


def shard_view(param: torch.Tensor) -> Any:
    """A parameter whose gradient is a DTensor (FSDP2) as this rank's gradient shard (read as ``.grad``), so telemetry
    and blame work on sharded models; rank-local there. Any other parameter as it is."""
    return SimpleNamespace(grad=param.grad.to_local()) if isinstance(param.grad, _DTENSOR) else param


class GradObserver:
    """Gradient telemetry on unscaled gradients every ``every_n_steps`` steps, and overflow attribution.

    Results are plain dicts for ``StablePrecision.stats``. After an overflowing step :meth:`blame` names the
    parameters whose gradients hold inf/NaN and arms an :class:`OverflowTracer` for the next step, whose verdict
    (the first module producing inf/NaN) :meth:`observe` reports. ``diagnose=True`` traces every step.

    Args:
        every_n_steps: telemetry period in optimizer steps; ``None`` turns telemetry off.
        formats: format ids; the first is the one whose underflow/overflow fractions are reported.
        diagnose: keep the tracer attached on every step (costly: it checks every module output and gradient).
    """

    def __init__(self, every_n_steps: int | None, formats: Sequence[str], *, diagnose: bool = False) -> None:
        self.telemetry = GradTelemetry(every_n_steps, formats=formats, per_module=True) if every_n_steps else None
        self.diagnose = diagnose
        self.tracer: OverflowTracer | None = None
        self._traced = False

    def attach(self, module: nn.Module) -> None:
        """A new model (each ``fit``): drop the old tracer, and trace from the start with ``diagnose=True``."""
        if self.tracer is not None:
            self.tracer.detach()
        self.tracer = OverflowTracer(module).attach() if self.diagnose else None

    def observe(
        self, module: nn.Module, named_grads: Callable[[], NamedGrads], step: int, scale: Callable[[], float],
        *, fp8: bool = False,
    ) -> tuple[dict[str, Any], tuple[str, str] | None]:
        """Call on unscaled gradients, before hooks and clipping. Returns ``(stats updates, warning or None)``, a
        warning as ``(key, message)``: the key names its cause (the same module and direction: the same key).

        ``scale`` is called (and may sync) only on due steps; ``fp8`` adds the FP8 layers' saturation/underflow,
        through the FP8 backend seam (any backend's layers; one that records none says so once).
        """
        updates: dict[str, Any] = {}
        warning: tuple[str, str] | None = None
        self._traced = False
        if self.tracer is not None:
            forward = self.tracer.first_forward is not None  # "" (the model itself) is a name too
            first = self.tracer.first_forward if forward else self.tracer.first_backward
            if self.tracer.nonfinite_input:
                updates["nonfinite_input"], updates["blamed_modules"], self._traced = True, [], True
                warning = ("nonfinite-input",
                           f"the input batch held inf/NaN (step {step}); no module is to blame, check the data.")
            elif first is not None:
                updates["blamed_modules"], self._traced = [first], True
                warning = (overflow_key(first, forward=forward), overflow_warning(first, forward=forward, step=step,
                                                                                  scale=float(scale())))
            if self.diagnose:
                self.tracer.reset()
            else:
                self.tracer.detach()
                self.tracer = None
        telemetry = self.telemetry
        if telemetry is None:
            return updates, warning
        if telemetry.is_due(step):
            stats = telemetry.maybe_compute(named_grads(), step, scale=scale())
            assert stats is not None  # is_due(step) just held
            values = stats.to_floats()
            fmt = telemetry.formats[0]
            updates.update(
                stats_step=step, grad_norm=values["norm"], grad_amax=values["amax"],
                grad_underflow_frac=values["underflow_frac"][fmt], grad_overflow_frac=values["overflow_frac"][fmt],
                grad_zero_frac=values["zero_frac"],
                grad_underflow_per_module={k: v["underflow_frac"][fmt] for k, v in values["modules"].items()},
            )
            if fp8 and (totals := fp8_stats(module).get("total")):
                updates.update({k: float(v) for k, v in totals.items()})
        if fp8:
            # FP8 layers record saturation/underflow in the forward and backward of the step before a due one.
            collect_fp8_stats_(module, telemetry.is_due(step + 1))
        return updates, warning

    def blame(self, module: nn.Module, named_grads: NamedGrads, *, nonfinite_input: bool = False) -> dict[str, Any]:
        """After an overflow (syncs once): the parameters with inf/NaN gradients, the module guessed or traced.

        ``nonfinite_input``: the step's batch held inf/NaN; then no module is blamed (``blamed_modules`` is empty and
        ``nonfinite_input`` True in the result): every layer it passed through went non-finite, none made it so.
        """
        params = nonfinite_grad_params(named_grads)
        updates: dict[str, Any] = {"blamed_params": params, "nonfinite_input": nonfinite_input}
        if nonfinite_input:
            updates["blamed_modules"] = []
            return updates
        # Parameters are registered in forward order, and inf spreads backward to every earlier layer: the last one
        # is the nearest guess, unless this step was traced and the tracer named the module.
        if not self._traced:
            updates["blamed_modules"] = [params[-1].rpartition(".")[0]] if params else []
        if self.tracer is None:  # FSDP2's DTensor gradients included: the tracer reads this rank's shard
            self.tracer = OverflowTracer(module).attach()
        return updates

    def replay(self, module: nn.Module, forward: Callable[[], torch.Tensor], step: int, scale: float,
               rng: RngState | None = None) -> tuple[dict[str, Any], tuple[str, str] | None]:
        """After a skipped step: replay it traced (:func:`~lit_mpstable.core.attribution.locate_nonfinite`) and
        return ``(stats updates, (key, warning) or None)`` naming the module where inf/NaN first appeared. The origin is
        known, so the next step is not traced (the armed tracer is dropped; with ``diagnose`` it is only reset)."""
        if self.tracer is not None:  # the replay's events must not count as the next step's
            self.tracer.detach()
            if not self.diagnose:
                self.tracer = None  # with diagnose it is re-attached below, to trace every step
        try:
            origin = locate_nonfinite(module, forward, scale=scale, rng=rng)
        finally:
            if self.tracer is not None:
                self.tracer.reset()
                self.tracer.attach()
        if origin is None:
            return {"nan_origin": None}, (f"replay-finite:{step}", f"the skipped step {step} was finite when replayed"
                                          f" at loss scale {scale:g}: the inf/NaN came and went (a transient fault,"
                                          " or an overflow of the scale since backed off); no module is to blame.")
        updates: dict[str, Any] = {"nan_origin": origin._asdict()}
        if origin.where == "input":
            updates.update(blamed_modules=[], nonfinite_input=True)
            return updates, ("nonfinite-input",
                             f"the input batch held inf/NaN (step {step}); no module is to blame, check the data.")
        updates["blamed_modules"] = [origin.module]
        in_forward = origin.where == "forward"
        return updates, (overflow_key(origin.module, forward=in_forward),
                         overflow_warning(origin.module, forward=in_forward, step=step, scale=scale))

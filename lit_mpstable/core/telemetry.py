"""What a step's gradients say: telemetry every N steps (global norm, amax, per-format underflow/overflow fractions, as
device tensors), and who is to blame after an overflow."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Union

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
from lit_mpstable.core.formats import FORMATS, get_format
from lit_mpstable.fp8 import fp8_stats
from lit_mpstable.fp8.swap import collect_fp8_stats_

# ----------------------------------------------------------------------------------------------- gradient telemetry
DEFAULT_FORMATS: tuple[str, ...] = ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")

NamedParams = Union[nn.Module, Iterable[tuple[str, torch.Tensor]]]

_FP32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class GradStats:
    """Gradient statistics as 0-dim device tensors; nothing here has synchronised with the device."""

    norm: torch.Tensor
    """Global L2 norm of the gradients."""
    amax: torch.Tensor
    """Largest absolute gradient value (inf/NaN when a gradient holds inf/NaN)."""
    underflow_frac: dict[str, torch.Tensor]
    """Format -> fraction of the nonzero elements that flush to zero when ``grad * scale`` is cast to it."""
    overflow_frac: dict[str, torch.Tensor]
    """Format -> fraction of the nonzero elements whose ``|grad * scale|`` exceeds its largest finite value."""
    modules: dict[str, GradStats] = field(default_factory=dict)
    """Owning module's qualified name (``""`` for the root) -> the same statistics over its own parameters."""
    zero_frac: torch.Tensor | None = None
    """Fraction of all gradient elements that are exactly zero. In FP16 the backward has already flushed what
    underflowed: compare with an FP32 run (``underflow_frac`` only forecasts the next cast of the nonzero ones)."""

    def to_floats(self) -> dict[str, Any]:
        """The same statistics as nested plain dicts of Python floats, read with one host synchronisation.

        Keys: ``norm``, ``amax``, ``underflow_frac`` and ``overflow_frac`` (format -> float) and, when computed per
        module, ``modules`` (name -> a dict with the first four keys).
        """
        tensors: list[torch.Tensor] = []
        _collect(self, tensors)
        device = tensors[0].device
        values = iter(torch.stack([t.to(device, torch.float32) for t in tensors]).tolist())
        return _rebuild(self, values)


def _collect(stats: GradStats, out: list[torch.Tensor]) -> None:
    out += [stats.norm, stats.amax, *stats.underflow_frac.values(), *stats.overflow_frac.values()]
    out += [stats.zero_frac] if stats.zero_frac is not None else []
    for sub in stats.modules.values():
        _collect(sub, out)


def _rebuild(stats: GradStats, values: Iterator[float]) -> dict[str, Any]:
    result: dict[str, Any] = {"norm": next(values), "amax": next(values)}
    result["underflow_frac"] = {name: next(values) for name in stats.underflow_frac}
    result["overflow_frac"] = {name: next(values) for name in stats.overflow_frac}
    if stats.zero_frac is not None:
        result["zero_frac"] = next(values)
    if stats.modules:
        result["modules"] = {name: _rebuild(sub, values) for name, sub in stats.modules.items()}
    return result


def _check_formats(formats: Sequence[str], caller: str) -> tuple[str, ...]:
    formats = tuple(formats)
    for name in formats:
        try:
            get_format(name)
        except ValueError:
            raise ValueError(
                f"{caller}(formats={formats!r}): unknown format {name!r}; allowed: {list(FORMATS)}."
            ) from None
    return formats


def _named_grads(params: NamedParams) -> list[tuple[str, torch.Tensor]]:
    named = params.named_parameters() if isinstance(params, nn.Module) else params
    grads = []
    for name, param in named:
        grad = param.grad
        if grad is None:
            continue
        grads.append((name, grad._values() if grad.is_sparse else grad))
    return grads


def grad_stats(
    params: NamedParams,
    *,
    scale: float | torch.Tensor = 1.0,
    formats: Sequence[str] = DEFAULT_FORMATS,
    per_module: bool = False,
    owed: Mapping[str, torch.Tensor] | None = None,
) -> GradStats:
    """Norm, amax and the fraction of gradient elements that would underflow or overflow in each format.

    The gradients are taken as they are (unscaled), or times the factor ``owed`` names for them; ``scale`` is the
    factor they would be multiplied by before the cast, e.g. the current loss scale. An element flushes to zero in a
    format when ``|g * scale|`` is at most half its smallest subnormal, and overflows when ``|g * scale|`` exceeds its
    largest finite value (the rules of :mod:`lit_mpstable.core.formats`); the comparison is ``|g| > threshold /
    scale`` in float32, exact for power-of-two scales. Fractions count the nonzero elements (inf included, NaN
    excluded); with none they are 0.

    Args:
        params: a module, or ``(name, parameter)`` pairs such as ``module.named_parameters()``. Parameters without a
            gradient are left out.
        scale: a Python float or a device tensor (no host sync either way).
        formats: format ids from :data:`lit_mpstable.core.formats.FORMATS`.
        per_module: also compute the statistics per owning module (grouped by qualified name), at no extra pass.
        owed: parameter name -> the factor its gradient still owes (0-dim tensors: compact weights keep the gradients
            scaled until the step unscales them in FP32): the gradient is measured times it, in FP32, as the step will
            apply it.

    Raises:
        ValueError: a format id is unknown.
    """
    formats = _check_formats(formats, "grad_stats")
    grads = _named_grads(params)
    if not grads:
        zero = torch.zeros((), dtype=torch.float32)
        return GradStats(zero, zero, {f: zero for f in formats}, {f: zero for f in formats}, zero_frac=zero)
    device = grads[0][1].device
    # Column 0 counts |g| > 0 (the nonzero, non-NaN elements); then |g| > underflow threshold and |g| > max per format.
    bounds = [0.0]
    for name in formats:
        fmt = get_format(name)
        bounds += [fmt.smallest_subnormal / 2, fmt.max]
    divisor = scale.to(device, torch.float32) if isinstance(scale, torch.Tensor) else scale
    # Clamped so an inf gradient still counts as overflowing when max / scale rounds to inf (scale < 1).
    thresholds = (torch.tensor(bounds, dtype=torch.float32, device=device) / divisor).clamp(max=_FP32_MAX).unbind()

    owed = owed or {}
    norms, amaxes, counts = [], [], []
    for name, grad in grads:
        # float32 before comparing: a 0-dim float32 threshold would otherwise be rounded to the grad's 16-bit dtype.
        absolute = grad.detach().to(device, torch.float32).abs()
        if (factor := owed.get(name)) is not None:
            absolute.mul_(factor.to(device))  # abs() made it a copy of its own
        if absolute.numel() == 0:
            absolute = absolute.new_zeros(1)
        norms.append(torch.linalg.vector_norm(absolute))
        amaxes.append(absolute.amax())
        counts.append(torch.stack([torch.count_nonzero(absolute > t) for t in thresholds]))
    norms_t, amaxes_t, counts_t = torch.stack(norms), torch.stack(amaxes), torch.stack(counts)
    numels = torch.tensor([max(grad.numel(), 1) for _, grad in grads], device=device)  # host sizes: no sync

    total = _summarise(norms_t, amaxes_t, counts_t, formats, numels)
    if not per_module:
        return total
    owners = [name.rpartition(".")[0] for name, _ in grads]
    modules = {}
    for owner in dict.fromkeys(owners):
        rows = torch.tensor([i for i, o in enumerate(owners) if o == owner], device=device)
        modules[owner] = _summarise(norms_t[rows], amaxes_t[rows], counts_t[rows], formats, numels[rows])
    return GradStats(total.norm, total.amax, total.underflow_frac, total.overflow_frac, modules, total.zero_frac)


def _summarise(
    norms: torch.Tensor, amaxes: torch.Tensor, counts: torch.Tensor, formats: tuple[str, ...], numels: torch.Tensor
) -> GradStats:
    counts = counts.sum(0)
    nonzero = counts[0]
    denominator = nonzero.clamp_min(1).float()
    underflow = {name: (nonzero - counts[1 + 2 * i]).float() / denominator for i, name in enumerate(formats)}
    overflow = {name: counts[2 + 2 * i].float() / denominator for i, name in enumerate(formats)}
    zero = 1.0 - nonzero.float() / numels.sum().float()
    return GradStats(torch.linalg.vector_norm(norms), amaxes.max(), underflow, overflow, zero_frac=zero)


class GradTelemetry:
    """Decides when to compute :func:`grad_stats` (every ``every_n_steps`` optimizer steps) and keeps the latest.

    The default of 50 matches Lightning's ``log_every_n_steps``. Measured on a small GPT (0.66M parameters, batch
    8x64, one CPU thread): one computation over the four default formats costs 6-10 ms (~10 ns per gradient
    element), 13-25% of a training step, so every 50 steps it adds 0.3-0.5% (``experiments/scaler_comparison.py``).

    Raises:
        ValueError: ``every_n_steps`` is not an int >= 1, or a format id is unknown.
    """

    def __init__(
        self, every_n_steps: int = 50, *, formats: Sequence[str] = DEFAULT_FORMATS, per_module: bool = False
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(
                f"GradTelemetry(every_n_steps={every_n_steps!r}): every_n_steps must be an int >= 1 (optimizer steps"
                " between computations); 50 keeps the cost under 1% of a step."
            )
        self.every_n_steps = every_n_steps
        self.formats = _check_formats(formats, "GradTelemetry")
        self.per_module = per_module
        self.latest: GradStats | None = None
        """The statistics of the last computation, or None before the first."""

    def is_due(self, step: int) -> bool:
        """Whether ``step`` (0-based optimizer steps) is one to compute on: 0, then N-1, 2N-1, ... (the steps after
        which Lightning's ``log_every_n_steps=N`` logs, so a value is logged on the step it was measured)."""
        return step == 0 or (step + 1) % self.every_n_steps == 0

    def next_due(self, step: int) -> int:
        """The first step after ``step`` that :meth:`is_due`."""
        return ((step + 1) // self.every_n_steps + 1) * self.every_n_steps - 1

    def maybe_compute(self, params: NamedParams, step: int, *, scale: float | torch.Tensor = 1.0,
                      owed: Mapping[str, torch.Tensor] | None = None) -> GradStats | None:
        """Compute, store in ``latest`` and return :func:`grad_stats` when ``step`` is due; else return None."""
        if not self.is_due(step):
            return None
        self.latest = grad_stats(params, scale=scale, formats=self.formats, per_module=self.per_module, owed=owed)
        return self.latest


# -------------------------------------------------------------------- the observer: telemetry and blame at the step
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
        self._idle: OverflowTracer | None = None  # the last tracer, detached: armed again at the next overflow
        self._traced = False
        self.quiet = range(0)
        """Steps on which :meth:`observe` has nothing to do while no tracer is armed (no telemetry due, no FP8
        statistics to switch): the stepper skips the call. A range, so asking costs no Python call."""

    def attach(self, module: nn.Module) -> None:
        """A new model (each ``fit``): drop the old tracer, and trace from the start with ``diagnose=True``."""
        if self.tracer is not None:
            self.tracer.detach()
        self.tracer = OverflowTracer(module).attach() if self.diagnose else None
        self._idle = None

    def observe(
        self, module: nn.Module, named_grads: Callable[[], NamedGrads], step: int, scale: Callable[[], float],
        *, fp8: bool = False, owed: Callable[[], Mapping[str, torch.Tensor]] | None = None,
    ) -> tuple[dict[str, Any], tuple[str, str] | None]:
        """Call on unscaled gradients, before hooks and clipping. Returns ``(stats updates, warning or None)``, a
        warning as ``(key, message)``: the key names its cause (the same module and direction: the same key).

        ``scale`` is called (and may sync) only on due steps, as is ``owed``: the factors gradients still owe
        (:func:`grad_stats`; compact weights defer the unscale to the step); ``fp8`` adds the FP8 layers'
        saturation/underflow, through the FP8 backend seam (any backend's layers; one that records none says so once).
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
                self.tracer.reset()
                self._idle, self.tracer = self.tracer, None
        telemetry = self.telemetry
        # Quiet from the next step to the next due one; never after a traced step (the next call clears _traced,
        # which blame reads) nor with FP8 layers (whose statistics are switched every step).
        until = sys.maxsize if telemetry is None else telemetry.next_due(step)
        self.quiet = range(0) if fp8 or self._traced else range(step + 1, until)
        if telemetry is None:
            return updates, warning
        if telemetry.is_due(step):
            stats = telemetry.maybe_compute(named_grads(), step, scale=scale(), owed=owed() if owed else None)
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
            # An overflow storm arms the tracer step after step: the same one, its hooks built once.
            idle, self._idle = self._idle, None
            self.tracer = (idle if idle is not None and idle.model is module else OverflowTracer(module)).attach()
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

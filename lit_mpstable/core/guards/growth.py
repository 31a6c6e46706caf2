"""Per-layer growth statistics of linear-layer activations, sampled every n steps, as an early warning of FP8 overflow.

FP8 runs that diverge late usually do so through growth, not a single bad batch: outlier features grow step after
step (SwiGLU's gate and up projections align and square them: Smooth-SwiGLU, ICLR 2025) until a GEMM operand leaves
E4M3's range. FOG (2025) reads activation kurtosis as an early predictor; TransformerEngine's debug tools count FP8
under- and overflows. :class:`GrowthMonitor` keeps, per ``nn.Linear`` (FP8Linear included, a subclass), a short
history of its input's (or output's) amax, kurtosis and FP8 saturation/underflow fractions, fits the trend of
``log2 amax``, and names the layers that are heading out of range (:meth:`GrowthMonitor.runaway`) while there is
still time to act: ``OverflowMonitor`` warns naming them, ``PrecisionFallback`` moves them out of FP8.

All statistics are computed on the device in FP32 on sampling steps only, and stay there: each layer's forward hook
makes the passes over its activation (:mod:`~lit_mpstable.core.guards.growth_stats`) and queues the sums (0-dim device
tensors); the arithmetic that finishes the rows runs for all the queued samples together, with one write into a ring
buffer shared by all layers, when the samples are read (or saved) or once a layer has ``window`` samples queued.
Nothing reads a tensor on the host until :meth:`GrowthMonitor.stats` or :meth:`GrowthMonitor.runaway` is called.
The samples are part of the plugin's checkpoint (:meth:`GrowthMonitor.state_dict`, under ``"growth"``): a resumed
run continues the trend fit where it stopped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal, get_args

import torch
from torch import nn

from lit_mpstable.core.guards.growth_state import restore_state, saved_state
from lit_mpstable.core.guards.growth_stats import (
    FIELDS,
    History,
    WeightCheck,
    cast_limits,
    check_saved,
    finish_rows,
    format_range,
    host_rows,
    is_runaway,
    place_rows,
    reduce_activation,
    trend_weights,
    warn_unsampled,
)

GrowthSource = Literal["input", "output"]
_SOURCES: tuple[str, ...] = get_args(GrowthSource)
GrowthHooks = Literal["always", "on_demand"]
_HOOKS: tuple[str, ...] = get_args(GrowthHooks)


class GrowthMonitor:
    """Samples every ``nn.Linear``'s input (or output) statistics every ``every_n_steps`` steps and flags runaways.

    Use: ``monitor.attach(model)``; after each optimizer step ``monitor.step()`` (the forward passes of a step whose
    count is a multiple of ``every_n_steps`` are sampled, once per layer, in training mode only); on logging steps
    :meth:`stats` / :meth:`runaway` (one host read each) or :meth:`metrics` (device tensors, no read).

    Defaults (their reasons: ``docs/spikes-and-triage.md``, "Slow growth"): ``source="input"`` (what an FP8 linear
    quantizes), a trend fitted over ``window=8`` samples taken ``every_n_steps=10`` apart and only once the window is
    full, ``runaway(horizon=200)`` steps ahead and ``runaway(kurtosis=100)``; a layer already saturating, or with a
    non-finite amax, is always named. An FP8 layer's input is measured at the scale the layer casts it with
    (``growth_input_scale``); that scale follows the amax, so its trend is projected to its activation dtype's range.

    Args:
        scale: multiplies the activations before the range checks (the fixed FP8 scale).
        clock: returns the optimizer steps taken so far; when given, the hooks follow it (no :meth:`step` calls
            needed: a precision plugin passes its applied-step count, read on the host).

    Raises:
        ValueError: an argument is out of range or an unknown choice.
    """

    def __init__(
        self, every_n_steps: int = 10, window: int = 8, *, source: GrowthSource = "input", fmt: str = "fp8_e4m3",
        scale: float = 1.0, clock: Callable[[], int] | None = None,
    ) -> None:
        for name, value, low in (("every_n_steps", every_n_steps, 1), ("window", window, 3)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"GrowthMonitor({name}={value!r}): must be an int >= {low} (window: samples the"
                                 " trend is fitted over).")
        if source not in _SOURCES:
            raise ValueError(f"GrowthMonitor(source={source!r}): must be one of {list(_SOURCES)}; 'input' is what an"
                             " FP8 linear quantizes.")
        fmt_max, _ = format_range(fmt, "GrowthMonitor")
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"GrowthMonitor(scale={scale!r}): must be a finite number > 0.")
        self.every_n_steps, self.window = every_n_steps, window
        self.source, self.fmt, self.scale = source, fmt, float(scale)
        self._log2_max = math.log2(fmt_max)
        self.steps = 0
        """Optimizer steps counted by :meth:`step`; the forward passes after step n are sampled when n is due."""
        self._history: dict[str, History] = {}
        self._rows: torch.Tensor | None = None  # all layers' ring buffers, layers x window x 4 (device)
        self._slopes: torch.Tensor | None = None  # every layer's fitted trend (None: a sample came since the fit)
        self._queue: tuple[list[torch.Tensor], list[int], list[tuple[int, int]]] = ([], [], [])  # unfinished
        self._handles: list[Any] = []
        self._layers: dict[str, nn.Module] = {}  # the attached layers, hooked or not (and in _captures: those whose
        self._captures: set[str] = set()  # delayed FP8 scale is read before their forward)
        self.hooks: GrowthHooks = "always"
        self._warned = False  # a due step passed unsampled (on-demand hooks: the forward ran outside the context)
        """When the layers carry hooks: ``"always"``, or ``"on_demand"`` (inside :meth:`sampling` on a due step)."""
        self._sampled: set[str] = set()
        self.clock = clock
        self.samples = 0
        """Layer samples recorded so far (a reader caches :meth:`runaway` until it changes)."""
        self._pending: dict[str, Any] | None = None  # a state loaded before attach, restored by it
        self._weight_check = WeightCheck()  # FP8 weights' flush fractions, refreshed every window x n steps

    # ------------------------------------------------------------------------------------------ hooks
    def attach(self, module: nn.Module, *, names: Iterable[str] | None = None,
               hooks: GrowthHooks = "always") -> GrowthMonitor:
        """Watch every ``nn.Linear`` in ``module`` (or only those named, qualified names); returns self.

        ``hooks="always"`` hooks the layers now, for good: nothing else is needed. ``hooks="on_demand"`` (what
        :class:`~lit_mpstable.core.step.stepper.PrecisionStepper` uses) hooks them only inside :meth:`sampling` on a
        step that is due, so the steps between samples run with no hook at all (a hooked module takes
        ``nn.Module``'s slow call path: ~1% of a small MLP's step at three layers) and a compiled model's graph
        never holds one.

        Raises:
            ValueError: a name in ``names`` is not a linear layer of ``module``, or ``hooks`` is unknown.
        """
        if hooks not in _HOOKS:
            raise ValueError(f"GrowthMonitor.attach(hooks={hooks!r}): must be one of {list(_HOOKS)}.")
        self._flush()  # queued samples (on the device they were taken on) before the layers change
        linears = {name: m for name, m in module.named_modules() if isinstance(m, nn.Linear)}
        if names is not None:
            names = list(names)
            missing = [n for n in names if n not in linears]
            if missing:
                raise ValueError(f"GrowthMonitor.attach(names={missing!r}): not nn.Linear layers of the module; its"
                                 f" linear layers are {sorted(linears)}.")
            linears = {n: linears[n] for n in names}
        for name, layer in linears.items():
            if name not in self._history:
                self._history[name] = History(len(self._history), scale=self.scale,
                                               limits=cast_limits(self.fmt, None, self.scale)[:2])
            self._layers[name] = layer
            getter = getattr(layer, "growth_input_scale", None)
            if self.source == "input" and getter is not None:  # an FP8 layer: known before its first sample
                scale = getter()
                self._history[name].cast = "own" if scale is None else scale.detach().clone()
                if scale is not None:  # updated in the forward: read before it
                    self._captures.add(name)
        self.hooks = hooks
        if hooks == "always":
            self._hook_layers(linears)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.load_state_dict(pending)
        return self

    @torch.compiler.disable  # hooking runs eagerly even where a compiled region encloses the forward (see _hook)
    def _hook_layers(self, layers: Mapping[str, nn.Module]) -> None:
        for name, layer in layers.items():
            self._handles.append(layer.register_forward_hook(self._hook(name)))
            if name in self._captures:
                self._handles.append(layer.register_forward_pre_hook(self._capture(name)))

    @torch.compiler.disable
    def _unhook(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def detach(self) -> None:
        """Remove the hooks and forget the layers (the histories stay readable)."""
        self._flush()
        self._unhook()
        self._layers, self._captures = {}, set()

    def due(self) -> bool:
        """Whether a forward now would be sampled: the step count is due and a layer in training mode has no
        sample at it yet (Python only: no tensor is touched)."""
        return self._tick() and any(
            layer.training and name not in self._sampled for name, layer in self._layers.items())

    @contextmanager
    def sampling(self) -> Iterator[bool]:
        """With ``attach(hooks="on_demand")``: the block's forward is sampled when :meth:`due` (the layers are
        hooked for the block only); yields whether they are. With ``"always"`` a no-op (yields False)."""
        if self.hooks != "on_demand" or self._handles or not self.due():
            yield False
            return
        self._hook_layers(self._layers)
        try:
            yield True
        finally:
            self._unhook()

    def is_due(self, step: int) -> bool:
        """Whether the forward passes after ``step`` optimizer steps are sampled (0, n, 2n, ...)."""
        return step % self.every_n_steps == 0

    def step(self, steps: int | None = None) -> None:
        """Count one optimizer step (or set the count to ``steps``, e.g. the trainer's global step)."""
        missed = self.hooks == "on_demand" and self._layers and not self._sampled  # followed step by step:
        if missed and steps in (None, self.steps + 1) and not (self._warned or self.steps % self.every_n_steps):
            self._warned = warn_unsampled(self.steps)
        self.steps = self.steps + 1 if steps is None else int(steps)
        self._sampled.clear()

    def _due(self, name: str, module: nn.Module) -> bool:  # Python only: no tensor is touched
        return self._tick() and module.training and name not in self._sampled

    def _tick(self) -> bool:  # follow the clock; whether the step count is due
        if self.clock is not None and (now := self.clock()) != self.steps:
            self.step(now)
        return self.steps % self.every_n_steps == 0

    def _capture(self, name: str):
        history = self._history[name]

        @torch.compiler.disable  # as the sampling hook below
        def pre_hook(module: nn.Module, inputs: tuple[Any, ...]) -> None:
            getter = getattr(module, "growth_input_scale", None)  # gone once a fallback swapped the layer
            if getter is not None and self._due(name, module) and (scale := getter()) is not None:
                history.captured = scale.detach().clone()

        return pre_hook

    def _limits(self, history: History, module: nn.Module) -> tuple[Any, Any, bool]:
        """(saturation, flush) thresholds on ``|x|``, and whether they are fractions of the activation's amax."""
        getter = getattr(module, "growth_input_scale", None) if self.source == "input" else None
        captured, history.captured = history.captured, None
        scale = None if getter is None else captured if captured is not None else getter()
        history.cast = None if getter is None else "own" if scale is None else scale
        return cast_limits(self.fmt, history.cast, history.limits)

    def _hook(self, name: str):
        history = self._history[name]
        sums, numels, slots = self._queue

        # Outside torch.compile: a sampled forward runs eagerly (``compiled.eager``), unless the compiled region
        # encloses the forward context (``torch.compile`` of Fabric's wrapped module), where a traced hook would guard
        # on the monitor's counters and recompile at each sample, up to Dynamo's limit.
        @torch.compiler.disable
        def hook(module: nn.Module, inputs: tuple[Any, ...], output: object) -> None:
            if not self._due(name, module):
                return
            x = inputs[0] if self.source == "input" else output
            if not isinstance(x, torch.Tensor):
                return
            self._sampled.add(name)
            above, flush, relative = self._limits(history, module)
            history.ceiling = math.log2(torch.finfo(x.dtype).max) if x.is_floating_point() else 128.0
            layer_sums, n = reduce_activation(x, above, flush, relative=relative)
            sums.extend(layer_sums)
            numels.append(n)
            slots.append((history.index, history.next))
            if len(history.steps) < self.window:
                history.steps.append(self.steps)
            else:
                history.steps[history.next] = self.steps
            history.next = (history.next + 1) % self.window
            self.samples += 1
            history.queued += 1
            if history.queued == self.window:  # before its ring wraps within the queue
                self._flush()

        return hook

    def _flush(self) -> None:
        """Finish the queued samples' rows (all at once: ~20 ops for any number, so a sample costs its hook's
        passes and a share of one flush) and write them into the ring buffer in one op."""
        sums, numels, slots = self._queue
        if not numels:
            return
        rows = finish_rows(sums, numels)
        buffer = self._place(rows.device)
        layer, slot = torch.tensor(slots, device=rows.device).unbind(1)
        buffer.index_put_((layer, slot), rows)
        histories = list(self._history.values())
        for index, _ in slots:
            history = histories[index]
            history.queued = 0
            if history.rows is None:  # the others are views of the buffer already (_place)
                history.rows = buffer[index]
        for queued in self._queue:
            queued.clear()
        self._slopes = None

    def _place(self, device: torch.device) -> torch.Tensor:
        """The ring buffer on ``device`` (:func:`place_rows`), made again after a load, a move or an attach."""
        if self._rows is None or self._rows.device != device or len(self._rows) != len(self._history):
            self._rows, self._slopes = place_rows(self._history.values(), self.window, len(FIELDS), device), None
        return self._rows

    def _fit(self, buffer: torch.Tensor) -> torch.Tensor:
        """Every layer's slope of log2 amax per step (:func:`trend_weights`), cached until the next sample."""
        if self._slopes is None:
            w, mask = torch.tensor(trend_weights(self._history.values(), self.window), device=buffer.device).unbind(0)
            self._slopes = (torch.where(mask > 0, buffer[:, :, 0], 0.0) * w).sum(1)
        return self._slopes

    # ------------------------------------------------------------------------------------------ reading
    def _read(self) -> tuple[list[tuple[str, History]], torch.Tensor | None]:
        """The sampled layers, and the ring buffer holding their rows, flushed (None before a sample)."""
        self._flush()
        sampled = [(name, h) for name, h in self._history.items() if h.rows is not None]
        return sampled, self._place(sampled[0][1].rows.device) if sampled else None  # type: ignore[union-attr]

    def metrics(self) -> dict[str, torch.Tensor]:
        """``mp/amax_growth`` (the fastest per-layer trend, log2 amax per step) and ``mp/kurtosis_max`` (the largest
        latest per-layer kurtosis) as 0-dim device tensors; empty before the first sample. No host read."""
        sampled, buffer = self._read()
        if buffer is None:
            return {}
        at = torch.tensor([[h.index for _, h in sampled], [(h.next - 1) % self.window for _, h in sampled]],
                          device=buffer.device)
        return {"mp/amax_growth": self._fit(buffer)[at[0]].max(), "mp/kurtosis_max": buffer[at[0], at[1], 1].max()}

    def stats(self) -> dict[str, dict[str, float]]:
        """Per sampled layer: ``amax``, ``kurtosis``, ``saturation``, ``underflow`` (the latest sample),
        ``amax_growth`` (log2 amax per step, fitted over the window), ``samples`` and ``step`` (of the latest
        sample); an FP8 layer with a per-tensor scale adds ``weight_underflow`` (the fraction of its weight its
        cast flushes now). One host read (it syncs with the device); the fit runs on the host."""
        sampled, buffer = self._read()
        weights = None if buffer is None else self._weight_check.read(
            {name: self._layers.get(name) for name, _ in sampled}, self.steps, self.every_n_steps * self.window)
        rows = [] if buffer is None else host_rows(buffer, [h for _, h in sampled], self.window, weights)
        out = {}
        for (name, history), values in zip(sampled, rows):
            log2_amax, kurtosis, saturation, underflow, slope, weight = values
            out[name] = {
                "amax": 2.0**log2_amax if math.isfinite(log2_amax) else log2_amax, "kurtosis": kurtosis,
                "saturation": saturation, "underflow": underflow, "amax_growth": slope,
                "samples": len(history.steps), "step": history.steps[(history.next - 1) % self.window],
            } | ({} if math.isnan(weight) else {"weight_underflow": weight})
        return out

    def runaway(self, *, horizon: float = 200.0, kurtosis: float = 100.0,
                stats: dict[str, dict[str, float]] | None = None) -> list[str]:
        """The layers heading out of range (see the class docstring for the defaults), in attach order: those whose
        fitted ``log2 amax`` trend (over a full window) crosses ``log2(fmt max / scale)`` within
        ``horizon`` steps of the latest sample, whose latest kurtosis exceeds ``kurtosis``, that already
        saturate or hold a non-finite value, or whose FP8 weight cast flushes over 5% of the weight. One host
        read (none given ``stats``, this sample's :meth:`stats`).

        Raises:
            ValueError: ``horizon`` or ``kurtosis`` is not a positive number.
        """
        for label, value in (("horizon", horizon), ("kurtosis", kurtosis)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"GrowthMonitor.runaway({label}={value!r}): must be a number > 0.")
        return [name for name, row in (self.stats() if stats is None else stats).items()
                if is_runaway(row, self._history[name], self._log2_max, self.window, horizon, kurtosis)]

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything the trend fit resumes from; plain values and tensors only. Keys: ``steps`` (the step count
        the hooks last saw), ``samples`` (layer samples recorded), ``sampled`` (the layers already sampled at
        ``steps``: a skipped step repeats the count, and a layer is sampled once per count), ``layers``: per layer
        ``rows`` (the ring buffer of :func:`layer_stats` rows, ``window`` x 4, or None before a sample), ``steps``
        (the step of each filled slot) and ``next`` (the slot written next). Before :meth:`attach`, a state loaded
        and waiting for it."""
        return saved_state(self)

    def check_state(self, state: object, *, call: str = "GrowthMonitor.load_state_dict", name: str = "state_dict",
                    layers: Iterable[str] | None = None) -> None:
        """Refuse a :meth:`state_dict` that this monitor (its ``window``, and the attached layers or ``layers``)
        cannot resume from, naming the field (TypeError, ValueError or KeyError: :func:`check_saved`); changes
        nothing."""
        check_saved(call, state, self.window, set(self._history) if layers is None else set(layers), name)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: the trend fit continues where it stopped. Before :meth:`attach` the state
        waits for it (checked against the layers then). Checked whole first (:meth:`check_state`): a refused state
        changes nothing."""
        self.check_state(state)
        restore_state(self, state)

"""Per-layer growth statistics of linear-layer activations, sampled every n steps, as an early warning of FP8 overflow.

FP8 runs that diverge late usually do so through growth, not a single bad batch: outlier features grow step after
step (SwiGLU's gate and up projections align and square them: Smooth-SwiGLU, ICLR 2025) until a GEMM operand leaves
E4M3's range. FOG (2025) reads activation kurtosis as an early predictor; TransformerEngine's debug tools count FP8
under- and overflows. :class:`GrowthMonitor` keeps, per ``nn.Linear`` (FP8Linear included, a subclass), a short
history of its input's (or output's) amax, kurtosis and FP8 saturation/underflow fractions, fits the trend of
``log2 amax``, and names the layers that are heading out of range (:meth:`GrowthMonitor.runaway`) while there is
still time to act: ``OverflowMonitor`` warns naming them, ``PrecisionFallback`` moves them out of FP8.

All statistics are computed on the device in FP32 inside forward hooks on sampling steps only, and stay there:
nothing reads a tensor on the host until :meth:`GrowthMonitor.stats` or :meth:`GrowthMonitor.runaway` is called.
The samples are part of the plugin's checkpoint (:meth:`GrowthMonitor.state_dict`, under ``"growth"``): a resumed
run continues the trend fit where it stopped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import nn

from lit_mpstable.base.validate import check_keys, int_arg
from lit_mpstable.core.loaded_state import check_fields, check_mapping, count, count_list, name_list

__all__ = ["GrowthMonitor", "GrowthSource", "layer_stats"]

GrowthSource = Literal["input", "output"]
_SOURCES: tuple[str, ...] = get_args(GrowthSource)
_FIELDS = ("log2_amax", "kurtosis", "saturation", "underflow")
_TINY = 2.0**-126  # amax of an all-zero tensor: log2 stays finite
_STATE_KEYS = {"steps", "samples", "sampled", "layers"}
# The format ids of lit_mpstable.core.formats, their ranges read from torch.finfo here.
_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "fp16": torch.float16,
           "bf16": torch.bfloat16}


def _range(fmt: str, caller: str) -> tuple[float, float]:
    """(largest finite value, smallest subnormal) of format ``fmt``."""
    if fmt not in _DTYPES:
        raise ValueError(f"{caller}(fmt={fmt!r}): unknown format; allowed: {sorted(_DTYPES)}.")
    info = torch.finfo(_DTYPES[fmt])
    return float(info.max), float(info.tiny) * float(info.eps)


def layer_stats(x: torch.Tensor, fmt: str = "fp8_e4m3", scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``[log2 amax, kurtosis, saturation, underflow]`` of ``x`` as one FP32 device tensor; no host read.

    - kurtosis: the fourth standardized moment ``E[(x - mean)**4] / var**2`` of all elements (3 for a Gaussian,
      up to the element count when one element dominates; 0 for a tensor whose standard deviation is below 1e-6
      of its amax), in FP32 on ``x / amax``, so no power overflows;
    - saturation: the fraction of elements with ``|x| * scale`` above ``fmt``'s largest finite value (inf counts);
    - underflow: the fraction of the nonzero elements that ``* scale`` flushes to zero in ``fmt``.

    A NaN in ``x`` makes amax and kurtosis NaN.
    """
    fmt_max, smallest_subnormal = _range(fmt, "layer_stats")
    x = x.detach().reshape(-1).float()
    n = max(x.numel(), 1)
    a = x.abs()
    amax = a.amax() if x.numel() else torch.zeros((), device=x.device)
    # Kurtosis is scale-free: x / amax keeps the squares in range (1e30 squared overflows FP32). Few passes over x
    # (sampling cost): centred = x / amax - mean in one addcmul, the sums as dot products.
    inv = torch.where(torch.isfinite(amax) & (amax > 0), amax, torch.ones_like(amax)).reciprocal()
    centred = torch.addcmul(-(x.sum() / n) * inv, x, inv)
    square = centred * centred
    var = square.sum() / n
    kurtosis = torch.dot(square, square) / n / (var * var)
    # A spread below 1e-6 of amax is rounding noise (x * (1 / amax) is inexact): the tensor counts as constant.
    kurtosis = torch.where(var > 1e-12, kurtosis, torch.zeros_like(kurtosis))
    kurtosis = torch.where(torch.isnan(amax), amax, kurtosis)
    # The thresholds are divided by the scale (a 0-dim operation) instead of the activations multiplied by it.
    saturation = torch.count_nonzero(a > fmt_max / scale) / n
    zeros = n - torch.count_nonzero(a)
    underflow = (torch.count_nonzero(a <= smallest_subnormal / 2 / scale) - zeros) / (n - zeros).clamp_min(1)
    return torch.stack([amax.clamp_min(_TINY).log2(), kurtosis, saturation, underflow.float()])


@dataclass
class _History:
    """One layer's samples: rows of :func:`layer_stats` in a ring buffer (device), their steps (host)."""

    rows: torch.Tensor | None = None
    steps: list[int] = field(default_factory=list)  # the step of each filled slot, slot order
    next: int = 0
    slope: torch.Tensor | None = None  # least-squares slope of log2 amax per step over the filled slots (None: not
    # fitted since the last sample; fitted when read, so a sample costs no fit)
    scale: float | torch.Tensor = 1.0


class GrowthMonitor:
    """Samples every ``nn.Linear``'s input (or output) statistics every ``every_n_steps`` steps and flags runaways.

    Use: ``monitor.attach(model)``; after each optimizer step ``monitor.step()`` (the forward passes of a step whose
    count is a multiple of ``every_n_steps`` are sampled, once per layer, in training mode only); on logging steps
    :meth:`stats` / :meth:`runaway` (one host read each) or :meth:`metrics` (device tensors, no read).

    Defaults, and why:

    - ``source="input"``: an FP8 linear quantizes its input and weight (its output is BF16/FP32), so the input's
      range is what overflows E4M3, and the layer whose input runs away is the one to take out of FP8.
    - ``every_n_steps=10``, ``window=8``: the trend is fitted over the last 8 samples (70 steps) and only once
      the window is full: the amax's rise from initialisation decelerates, and a fit over its first samples
      projected one clean SwiGLU run (of 5) into overflow at step 30. A sample costs ~10 passes over each watched
      activation: measured on the CPU (one thread; 8 linears 256<->1024, batch 64) 1.25 ms against a 13.8 ms
      step, 0.9% of the run at one step in ten.
    - ``runaway(horizon=200)``: a layer whose fitted ``log2 amax`` trend reaches ``fmt``'s max (after ``scale``)
      within 200 steps. A steady exponential growth is then named about 200 steps before it saturates (less the
      fit's lag behind a growth that starts or accelerates), well over the 50 steps a fallback needs; a clean
      run's amax settles (its slope decays), so its projected crossing recedes beyond any horizon.
    - ``runaway(kurtosis=100)``: a Gaussian has 3, a Laplace 6, a Student-t with 5 degrees of freedom 9; 100 means
      a few elements dominate the fourth moment: outlier features, the signature that FOG tracks before the amax
      itself moves. Measured in this package's tests: clean layers stay below 15.
    - a layer already saturating, or with a non-finite amax, is always named.

    Args:
        scale: multiplies the activations before the range checks (the fixed FP8 scale; per layer:
            :meth:`set_scale`, a device tensor for a scale that changes).
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
        fmt_max, _ = _range(fmt, "GrowthMonitor")
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"GrowthMonitor(scale={scale!r}): must be a finite number > 0.")
        self.every_n_steps, self.window = every_n_steps, window
        self.source, self.fmt, self.scale = source, fmt, float(scale)
        self._log2_max = math.log2(fmt_max)
        self.steps = 0
        """Optimizer steps counted by :meth:`step`; the forward passes after step n are sampled when n is due."""
        self._history: dict[str, _History] = {}
        self._handles: list[Any] = []
        self._sampled: set[str] = set()
        self.clock = clock
        self.samples = 0
        """Layer samples recorded so far (a reader caches :meth:`runaway` until it changes)."""
        self._pending: dict[str, Any] | None = None  # a state loaded before attach, restored by it

    # ------------------------------------------------------------------------------------------ hooks
    def attach(self, module: nn.Module, *, names: Iterable[str] | None = None) -> GrowthMonitor:
        """Hook every ``nn.Linear`` in ``module`` (or only those named, qualified names); returns self.

        Raises:
            ValueError: a name in ``names`` is not a linear layer of ``module``.
        """
        linears = {name: m for name, m in module.named_modules() if isinstance(m, nn.Linear)}
        if names is not None:
            names = list(names)
            missing = [n for n in names if n not in linears]
            if missing:
                raise ValueError(f"GrowthMonitor.attach(names={missing!r}): not nn.Linear layers of the module; its"
                                 f" linear layers are {sorted(linears)}.")
            linears = {n: linears[n] for n in names}
        for name, layer in linears.items():
            self._history.setdefault(name, _History(scale=self.scale))
            self._handles.append(layer.register_forward_hook(self._hook(name)))
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.load_state_dict(pending)
        return self

    def detach(self) -> None:
        """Remove the hooks (the histories stay readable)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def set_scale(self, name: str, scale: float | torch.Tensor) -> None:
        """The scale layer ``name``'s activations are multiplied by before the range checks (a device tensor is
        read on the device, so a delayed-scaling amax history can be passed as it changes)."""
        if name not in self._history:
            raise ValueError(f"GrowthMonitor.set_scale(name={name!r}): not an attached layer; attached:"
                             f" {sorted(self._history)}.")
        self._history[name].scale = scale

    def is_due(self, step: int) -> bool:
        """Whether the forward passes after ``step`` optimizer steps are sampled (0, n, 2n, ...)."""
        return step % self.every_n_steps == 0

    def step(self, steps: int | None = None) -> None:
        """Count one optimizer step (or set the count to ``steps``, e.g. the trainer's global step)."""
        self.steps = self.steps + 1 if steps is None else int(steps)
        self._sampled.clear()

    def _hook(self, name: str):
        def hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            # A Python check only on the steps between samples: no tensor is touched.
            if self.clock is not None and (now := self.clock()) != self.steps:
                self.step(now)
            if not module.training or name in self._sampled or not self.is_due(self.steps):
                return
            x = inputs[0] if self.source == "input" else output
            if not isinstance(x, torch.Tensor):
                return
            self._sampled.add(name)
            self._record(name, layer_stats(x, self.fmt, self._history[name].scale))

        return hook

    def _record(self, name: str, row: torch.Tensor) -> None:
        history = self._history[name]
        if history.rows is None:
            history.rows = torch.zeros(self.window, len(_FIELDS), device=row.device)
        elif history.rows.device != row.device:  # loaded from a checkpoint onto another device
            history.rows = history.rows.to(row.device)
        history.rows[history.next].copy_(row)
        if len(history.steps) < self.window:
            history.steps.append(self.steps)
        else:
            history.steps[history.next] = self.steps
        history.next = (history.next + 1) % self.window
        history.slope = None
        self.samples += 1

    def _slope(self, history: _History) -> torch.Tensor:
        if history.slope is None:
            history.slope = self._fit(history)
        return history.slope

    def _fit(self, history: _History) -> torch.Tensor:
        # Least squares of log2 amax against the step: slope = sum(w_i y_i) with w_i = (t_i - mean t) / sum (t - mean
        # t)**2, computed on the host from the known steps, so the device does one small dot product.
        assert history.rows is not None
        ts = history.steps
        filled = history.rows[: len(ts), 0]
        mean = sum(ts) / len(ts)
        denominator = sum((t - mean) ** 2 for t in ts)
        if denominator == 0:
            return torch.zeros((), device=filled.device)
        weights = torch.tensor([(t - mean) / denominator for t in ts], device=filled.device)
        return (weights * filled).sum()

    # ------------------------------------------------------------------------------------------ reading
    def _latest(self, history: _History) -> torch.Tensor:
        assert history.rows is not None
        return history.rows[(history.next - 1) % self.window]

    def metrics(self) -> dict[str, torch.Tensor]:
        """``mp/amax_growth`` (the fastest per-layer trend, log2 amax per step) and ``mp/kurtosis_max`` (the largest
        latest per-layer kurtosis) as 0-dim device tensors; empty before the first sample. No host read."""
        sampled = [h for h in self._history.values() if h.rows is not None]
        if not sampled:
            return {}
        slopes = torch.stack([self._slope(h) for h in sampled])
        kurtosis = torch.stack([self._latest(h)[1] for h in sampled])
        return {"mp/amax_growth": slopes.max(), "mp/kurtosis_max": kurtosis.max()}

    def stats(self) -> dict[str, dict[str, float]]:
        """Per sampled layer: ``amax``, ``kurtosis``, ``saturation``, ``underflow`` (the latest sample),
        ``amax_growth`` (log2 amax per step, fitted over the window), ``samples`` and ``step`` (of the latest
        sample). One host read (it syncs with the device)."""
        sampled = {n: h for n, h in self._history.items() if h.rows is not None}
        if not sampled:
            return {}
        table = torch.stack([torch.cat([self._latest(h), self._slope(h).reshape(1)]) for h in sampled.values()])
        out = {}
        for (name, history), values in zip(sampled.items(), table.tolist()):
            log2_amax, kurtosis, saturation, underflow, slope = values
            out[name] = {
                "amax": 2.0**log2_amax if math.isfinite(log2_amax) else log2_amax, "kurtosis": kurtosis,
                "saturation": saturation, "underflow": underflow, "amax_growth": slope,
                "samples": len(history.steps), "step": history.steps[(history.next - 1) % self.window],
            }
        return out

    def runaway(self, *, horizon: float = 200.0, kurtosis: float = 100.0) -> list[str]:
        """The layers heading out of range (see the class docstring for the defaults), in attach order: those whose
        fitted ``log2 amax`` trend (over a full window) crosses ``log2(fmt max / scale)`` within
        ``horizon`` steps of the latest sample, whose latest kurtosis exceeds ``kurtosis``, or that already
        saturate or hold a non-finite value. One host read.

        Raises:
            ValueError: ``horizon`` or ``kurtosis`` is not a positive number.
        """
        for label, value in (("horizon", horizon), ("kurtosis", kurtosis)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"GrowthMonitor.runaway({label}={value!r}): must be a number > 0.")
        named = []
        for name, row in self.stats().items():
            scale = self._history[name].scale
            scale = float(scale) if not isinstance(scale, torch.Tensor) else float(scale.detach().float().max())
            bad = not math.isfinite(row["amax"]) or math.isnan(row["kurtosis"])
            headroom = self._log2_max - math.log2(scale) - (math.inf if bad else math.log2(row["amax"]))
            slope = row["amax_growth"]
            projected = row["samples"] >= self.window and slope > 0 and headroom < slope * horizon
            if bad or row["saturation"] > 0 or row["kurtosis"] > kurtosis or projected:
                named.append(name)
        return named

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything the trend fit resumes from; plain values and tensors only. Keys: ``steps`` (the step count
        the hooks last saw), ``samples`` (layer samples recorded), ``sampled`` (the layers already sampled at
        ``steps``: a skipped step repeats the count, and a layer is sampled once per count), ``layers``: per layer
        ``rows`` (the ring buffer of :func:`layer_stats` rows, ``window`` x 4, or None before a sample), ``steps``
        (the step of each filled slot) and ``next`` (the slot written next). Before :meth:`attach`, a state loaded
        and waiting for it."""
        if self._pending is not None:
            return self._pending
        return {"steps": self.steps, "samples": self.samples, "sampled": sorted(self._sampled), "layers": {
            name: {"rows": None if h.rows is None else h.rows.clone(), "steps": list(h.steps), "next": h.next}
            for name, h in self._history.items()}}

    def check_state(self, state: Any, *, call: str = "GrowthMonitor.load_state_dict", name: str = "state_dict",
                    layers: Iterable[str] | None = None) -> None:
        """Refuse a :meth:`state_dict` that this monitor (its ``window``, and the attached layers or ``layers``)
        cannot resume from, naming the field; changes nothing.

        Raises:
            TypeError: a field has the wrong type (``None`` rows count as "no sample yet").
            ValueError: a value is out of range or disagrees with another (a slot step after ``steps``, a ring
                position past the filled slots, a fraction outside [0, 1]).
            KeyError: keys differ from :meth:`state_dict`'s, or the saved layers from the attached ones.
        """
        state = check_mapping(call, state, _STATE_KEYS, name=name)
        check_fields(call, state, {"steps": count, "samples": count, "sampled": name_list}, prefix=name)
        saved = check_mapping(call, state["layers"], name=f"{name}['layers']")
        attached = set(self._history) if layers is None else set(layers)
        if attached and saved and set(saved) != attached:  # none saved: a monitor that never attached
            check_keys(call, saved, attached, name=f"{name}['layers']", suffix="; attach the same model first.")
        stray = sorted(set(state["sampled"]) - set(saved))
        if stray:
            raise ValueError(f"{call}({name}['sampled']={stray!r}): not among the saved layers {sorted(saved)}.")
        filled = 0
        for layer, entry in saved.items():
            where = f"{name}['layers'][{layer!r}]"
            entry = check_mapping(call, entry, {"rows", "steps", "next"}, name=where)
            count_list(call, f"{where}['steps']", entry["steps"])
            int_arg(call, f"{where}['next']", entry["next"], low=0, high=self.window - 1)
            steps, rows = list(entry["steps"]), entry["rows"]
            if rows is not None:  # first: a state saved with another window fails here, saying so
                _check_rows(call, f"{where}['rows']", rows, self.window)
            filled += len(steps)
            late = [t for t in steps if t > state["steps"]]
            if len(steps) > self.window or late or (rows is None and steps):
                rule = (f"at most window={self.window} steps" if len(steps) > self.window else
                        f"no step after steps={state['steps']}" if late else "no steps without rows (None)")
                raise ValueError(f"{call}({where}['steps']={steps!r}): must hold {rule}.")
            if len(steps) < self.window and entry["next"] != len(steps):
                raise ValueError(f"{call}({where}['next']={entry['next']!r}): the ring is not full yet, so the next"
                                 f" slot must be the first unfilled one, {len(steps)}.")
        if state["samples"] < filled:
            raise ValueError(f"{call}({name}['samples']={state['samples']!r}): fewer than the {filled} filled slots.")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: the trend fit continues where it stopped. Before :meth:`attach` the state
        waits for it (checked against the layers then). Checked whole first (:meth:`check_state`): a refused state
        changes nothing."""
        self.check_state(state)
        if not self._history:
            self._pending = {**state, "layers": dict(state["layers"]), "sampled": list(state["sampled"])}
            return
        self.steps, self.samples = int(state["steps"]), int(state["samples"])
        self._sampled = set(state["sampled"])
        for name, saved in state["layers"].items():
            history = self._history[name]
            history.rows = None if saved["rows"] is None else saved["rows"].detach().float().clone()
            history.steps, history.next = list(saved["steps"]), int(saved["next"])
            history.slope = None  # fitted when read


def _check_rows(call: str, name: str, rows: Any, window: int) -> None:
    """A ``window`` x 4 floating tensor of :func:`layer_stats` rows: log2 amax >= -126 and kurtosis >= 0 (either may
    be NaN or inf: a sample of non-finite activations), the saturation and underflow fractions within [0, 1]."""
    if not isinstance(rows, torch.Tensor) or not rows.is_floating_point():
        raise TypeError(f"{call}({name}={type(rows).__name__}): must be a floating tensor (or None before a sample).")
    if tuple(rows.shape) != (window, len(_FIELDS)):
        raise ValueError(f"{call}({name} of shape {tuple(rows.shape)}): must be ({window}, {len(_FIELDS)}): window x"
                         f" {list(_FIELDS)}; saved with another window?")
    r = rows.detach().float()
    low = torch.tensor([math.log2(_TINY), 0.0, 0.0, 0.0], device=r.device)
    ok = torch.cat([(r[:, :2] >= low[:2]) | r[:, :2].isnan(), (r[:, 2:] >= 0) & (r[:, 2:] <= 1)], dim=1)
    if not bool(ok.all()):
        column = _FIELDS[int((~ok).any(dim=0).float().argmax())]
        raise ValueError(f"{call}({name}): column {column!r} out of range (log2_amax >= -126, kurtosis >= 0, fractions"
                         " within [0, 1]); the checkpoint is corrupted.")

"""The statistics behind :class:`~lit_mpstable.core.guards.growth.GrowthMonitor`, computed in two halves to keep a
sampled step cheap.

A sample is launch-bound on small activations (a 64 x 256 input is a few microseconds of arithmetic per pass, the
dispatch of each op several), so the work is split by what needs the activation:

- :func:`reduce_activation`, in the layer's forward hook: the passes over the activation, 15 ops (amax, the two
  centred power sums, three counts) returning 0-dim device tensors; the activation is not kept (no memory held
  past the hook);
- :func:`finish_rows`, once for all the layers sampled in a step: the scalar arithmetic that turns those sums into
  ``[log2 amax, kurtosis, saturation, underflow]`` rows, ~20 ops whatever the number of layers.

Nothing is read on the host in either half.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from lit_mpstable.base.validate import check_keys, int_arg
from lit_mpstable.core.loaded_state import check_fields, check_mapping, count, count_list, name_list

FIELDS = ("log2_amax", "kurtosis", "saturation", "underflow")
_STATE_KEYS = {"steps", "samples", "sampled", "layers"}

WEIGHT_FLUSH_LIMIT = 0.05
"""An FP8 layer whose weight cast flushes more than this fraction of its nonzero elements is named runaway. E4M3 with
a per-tensor scale flushes what lies ~2**17.8 below the weight's amax: nothing in this package's clean runs, 1.4-3%
where one row has grown ~1e4x (the SwiGLU dead-channel task's gate and up at the end of its FP8 runs; over 5% near
the end of 2 of its 5 fallback runs), 98% where it has grown 1e5x (the alignment task)."""

TINY = 2.0**-126  # amax of an all-zero tensor: log2 stays finite
# The format ids of lit_mpstable.core.formats, their ranges read from torch.finfo here.
DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "fp16": torch.float16,
          "bf16": torch.bfloat16}

Sums = tuple[torch.Tensor, ...]  # amax, sum of centred**2, sum of centred**4, and the counts above the saturation
# threshold, nonzero, at or below the flush threshold (FP32, 0-dim; the counts exact up to 2**24 elements)
WIDTH = 6  # values per sample in Sums


def format_range(fmt: str, caller: str) -> tuple[float, float]:
    """(largest finite value, smallest subnormal) of format ``fmt``."""
    if fmt not in DTYPES:
        raise ValueError(f"{caller}(fmt={fmt!r}): unknown format; allowed: {sorted(DTYPES)}.")
    info = torch.finfo(DTYPES[fmt])
    return float(info.max), float(info.tiny) * float(info.eps)


def thresholds(fmt: str, scale: float | torch.Tensor, caller: str = "layer_stats") -> tuple[Any, Any]:
    """(saturation, flush) thresholds on ``|x|`` for activations multiplied by ``scale`` before a cast to ``fmt``:
    the thresholds are divided by the scale (a 0-dim operation) instead of the activations multiplied by it."""
    fmt_max, smallest_subnormal = format_range(fmt, caller)
    return fmt_max / scale, smallest_subnormal / 2 / scale  # at or below half the smallest subnormal: flushed


def cast_limits(fmt: str, cast: Any, fixed: Any) -> tuple[Any, Any, bool]:
    """``(saturate_above, flush_at, relative)`` for :func:`reduce_activation`: for a layer cast at ``cast`` (a delayed
    FP8 scale, a tensor), from its own amax (``"own"``: current scaling, the block recipes: nothing saturates, what
    lies below amax x smallest subnormal / 2 / fmt max flushes), or, ``cast`` None (not FP8), at ``fixed`` (a scale,
    or thresholds already made for it)."""
    if isinstance(cast, str):
        return *thresholds(fmt, format_range(fmt, "GrowthMonitor")[0]), True
    if cast is None:
        return *(fixed if isinstance(fixed, tuple) else thresholds(fmt, fixed)), False
    return *thresholds(fmt, cast), False


def reduce_activation(x: torch.Tensor, saturate_above: torch.Tensor | float, flush_at: torch.Tensor | float, *,
                      relative: bool = False
                      ) -> tuple[Sums, int]:
    """The passes over one activation: its :data:`Sums` and element count (see :func:`finish_rows`).

    ``relative``: the thresholds are fractions of the activation's own amax (a tensor cast at ``fmt max / amax``,
    FP8's current scaling: ``thresholds(fmt, fmt max)`` gives them).

    The power sums are of ``(x - mean) / amax``: kurtosis is scale-free, and dividing by amax keeps the fourth
    powers in range (``1e30**4`` overflows FP32); a NaN or inf, or an amax of 0, makes them NaN. Two counts are
    summed from FP32 comparisons written into buffers already made (a bool comparison costs twice as much on the
    CPU): exact up to 2**24 elements, within a few counts of 1e8 beyond.
    """
    x = x.detach().reshape(-1)
    if x.dtype != torch.float32:
        x = x.float()
    n = x.numel()
    if n == 0:
        return (torch.zeros((), device=x.device),) * WIDTH, 0
    a = x.abs()
    amax = a.amax()
    if relative:
        saturate_above, flush_at = amax * saturate_above, amax * flush_at
    square = torch.sub(x, x.sum(), alpha=1.0 / n).div_(amax).square_()
    square_sum, fourth_sum = square.sum(), torch.dot(square, square)
    above = torch.gt(a, saturate_above, out=square).sum()  # square's sums are taken: its memory is free
    nonzero = torch.count_nonzero(a)  # int64: stacked with the others as FP32
    low = torch.le(a, flush_at, out=a).sum()  # a's last use
    return (amax, square_sum, fourth_sum, above, nonzero, low), n


def finish_rows(sums: list[torch.Tensor], numels: list[int]) -> torch.Tensor:
    """``[log2 amax, kurtosis, saturation, underflow]`` (FP32, one row per layer) from the concatenated
    :func:`reduce_activation` results of the layers, in ~20 ops for all of them:

    - kurtosis: ``E[(x - mean)**4] / var**2`` (3 for a Gaussian, up to the element count when one element
      dominates; 0 for a tensor whose standard deviation is below 1e-6 of its amax, or holding an inf; NaN, as
      amax, if it holds a NaN);
    - saturation: the fraction of elements above the saturation threshold (inf counts, NaN does not);
    - underflow: the fraction of the nonzero elements at or below the flush threshold (0 without nonzero ones).
    """
    amax, square_sum, fourth_sum, above, nonzero, low = torch.stack(sums).view(-1, WIDTH).unbind(1)
    n = torch.tensor(numels, dtype=torch.float32, device=amax.device).clamp_min(1)
    var = square_sum / n
    kurtosis = fourth_sum / n / (var * var)
    # A spread below 1e-6 of amax is rounding noise (x / amax is inexact): the tensor counts as constant. So does
    # an all-zero one (its sums are 0 / 0: NaN, which fails the comparison), and one holding an inf (NaN too).
    kurtosis = torch.where(var > 1e-12, kurtosis, 0.0)
    kurtosis = torch.where(amax.isnan(), amax, kurtosis)
    underflow = ((low + nonzero - n) / nonzero.clamp_min(1)).clamp_min(0.0)  # low counts the zeros too
    return torch.stack([amax.clamp_min(TINY).log2(), kurtosis, above / n, underflow], dim=1)


def layer_stats(x: torch.Tensor, fmt: str = "fp8_e4m3", scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``[log2 amax, kurtosis, saturation, underflow]`` of ``x`` (:func:`finish_rows`'s row, saturation and
    underflow those of ``x * scale`` cast to ``fmt``) as one FP32 device tensor; no host read."""
    sums, n = reduce_activation(x, *thresholds(fmt, scale))
    return finish_rows(list(sums), [n])[0]


def check_rows(call: str, name: str, rows: object, window: int) -> None:
    """A ``window`` x 4 floating tensor of :func:`layer_stats` rows: log2 amax >= -126 and kurtosis >= 0 (either may
    be NaN or inf: a sample of non-finite activations), the saturation and underflow fractions within [0, 1]."""
    if not isinstance(rows, torch.Tensor) or not rows.is_floating_point():
        raise TypeError(f"{call}({name}={type(rows).__name__}): must be a floating tensor (or None before a sample).")
    if tuple(rows.shape) != (window, len(FIELDS)):
        raise ValueError(f"{call}({name} of shape {tuple(rows.shape)}): must be ({window}, {len(FIELDS)}): window x"
                         f" {list(FIELDS)}; saved with another window?")
    r = rows.detach().float()
    low = torch.tensor([math.log2(TINY), 0.0, 0.0, 0.0], device=r.device)
    ok = torch.cat([(r[:, :2] >= low[:2]) | r[:, :2].isnan(), (r[:, 2:] >= 0) & (r[:, 2:] <= 1)], dim=1)
    if not bool(ok.all()):
        column = FIELDS[int((~ok).any(dim=0).float().argmax())]
        raise ValueError(f"{call}({name}): column {column!r} out of range (log2_amax >= -126, kurtosis >= 0, fractions"
                         " within [0, 1]); the checkpoint is corrupted.")


def check_saved(call: str, state: object, window: int, attached: set[str], name: str) -> None:
    """:meth:`GrowthMonitor.check_state <lit_mpstable.core.guards.growth.GrowthMonitor.check_state>`'s checks, for a
    monitor of ``window`` samples attached to the layers ``attached`` (empty: not attached yet).

    Raises:
        TypeError: a field has the wrong type (``None`` rows count as "no sample yet").
        ValueError: a value is out of range or disagrees with another (a slot step after ``steps``, a ring position
            past the filled slots, a fraction outside [0, 1]).
        KeyError: keys differ from ``state_dict``'s, or the saved layers from the attached ones.
    """
    state = check_mapping(call, state, _STATE_KEYS, name=name)
    check_fields(call, state, {"steps": count, "samples": count, "sampled": name_list}, prefix=name)
    saved = check_mapping(call, state["layers"], name=f"{name}['layers']")
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
        int_arg(call, f"{where}['next']", entry["next"], low=0, high=window - 1)
        steps, rows = list(entry["steps"]), entry["rows"]
        if rows is not None:  # first: a state saved with another window fails here, saying so
            check_rows(call, f"{where}['rows']", rows, window)
        filled += len(steps)
        late = [t for t in steps if t > state["steps"]]
        if len(steps) > window or late or (rows is None and steps):
            rule = (f"at most window={window} steps" if len(steps) > window else
                    f"no step after steps={state['steps']}" if late else "no steps without rows (None)")
            raise ValueError(f"{call}({where}['steps']={steps!r}): must hold {rule}.")
        if len(steps) < window and entry["next"] != len(steps):
            raise ValueError(f"{call}({where}['next']={entry['next']!r}): the ring is not full yet, so the next"
                             f" slot must be the first unfilled one, {len(steps)}.")
    if state["samples"] < filled:
        raise ValueError(f"{call}({name}['samples']={state['samples']!r}): fewer than the {filled} filled slots.")


@dataclass
class History:
    """One layer's samples: rows of :func:`layer_stats` in a ring buffer (device), their steps (host)."""

    index: int  # its block of the monitor's ring buffer (attach order)
    rows: torch.Tensor | None = None  # window x 4, a view of the monitor's buffer (None: no sample yet)
    steps: list[int] = field(default_factory=list)  # the step of each filled slot, slot order
    next: int = 0
    scale: float = 1.0
    queued: int = 0  # samples waiting in the monitor's queue
    limits: tuple[float, float] = (math.inf, 0.0)  # thresholds(fmt, scale)
    # An FP8 layer's input is checked at the scale the layer casts it with (its growth_input_scale), not `scale`:
    cast: Any = None  # at the last sample: None (not FP8: `scale`), "own" (each tensor from its amax), or a tensor
    captured: torch.Tensor | None = None  # a delayed scale as the forward about to be sampled uses it
    ceiling: float = 128.0  # log2 of the largest value of the activation's own dtype (FP32/BF16 until sampled)


def slope_weights(steps: list[int]) -> list[float]:
    """The least-squares slope of samples ``y_i`` taken at ``steps`` (slot order) is ``sum(w_i y_i)`` with
    ``w_i = (t_i - mean t) / sum (t - mean t)**2`` (all 0 with fewer than two distinct steps)."""
    mean = sum(steps) / max(len(steps), 1)
    denominator = sum((t - mean) ** 2 for t in steps)
    return [(t - mean) / denominator if denominator else 0.0 for t in steps]


def trend_weights(histories: Iterable[History], window: int) -> list[list[list[float]]]:
    """[weights, mask], each layers x ``window`` (:func:`slope_weights` of each layer's filled slots), for the fit
    of every layer on the device at once."""
    histories = list(histories)
    weights = [[[0.0] * window for _ in histories] for _ in range(2)]
    for history in histories:
        for slot, w in enumerate(slope_weights(history.steps)):
            weights[0][history.index][slot], weights[1][history.index][slot] = w, 1.0
    return weights


def host_rows(buffer: torch.Tensor, histories: list[History], window: int,
              weights: torch.Tensor | None = None) -> list[list[float]]:
    """Each of ``histories``' latest row with its fitted slope of log2 amax and its weight's FP8 flush fraction
    appended (``[log2 amax, kurtosis, saturation, underflow, slope, weight flush]``; NaN without ``weights``, one
    per history: :func:`weight_flushes`), from one host read of the ring buffer (and ``weights`` with it): the fit
    runs on the host."""
    if weights is None:
        values, flushes = buffer.tolist(), [math.nan] * len(histories)
    else:
        flat = torch.cat([buffer.flatten(), weights.to(buffer)]).tolist()
        _, window_, width = buffer.shape
        values = [[flat[(layer * window_ + slot) * width:(layer * window_ + slot + 1) * width]
                   for slot in range(window_)] for layer in range(len(buffer))]
        flushes = flat[buffer.numel():]
    out = []
    for history, flush in zip(histories, flushes):
        rows = values[history.index]
        slope = sum(w * row[0] for w, row in zip(slope_weights(history.steps), rows))
        out.append([*rows[(history.next - 1) % window], slope, flush])
    return out


class WeightCheck:
    """:func:`weight_flushes` of the sampled layers, refreshed once per ``period`` optimizer steps and reused in
    between: a weight changes slowly (a row needs ~1e4x to flush 5% of the rest), and each refresh is a few passes over
    every FP8 weight (0.7 ms for the digits MLP's one 256 x 256 FP8 layer on a CPU: 7% of its step)."""

    def __init__(self) -> None:
        self.key: tuple[Any, ...] | None = None  # (the layers' names, the step of the refresh)
        self.values: torch.Tensor | None = None

    def read(self, layers: dict[str, Any], step: int, period: int) -> torch.Tensor | None:
        names = tuple(layers)
        if self.key is None or self.key[0] != names or not 0 <= step - self.key[1] < period:
            self.key, self.values = (names, step), weight_flushes(layers.values())
        return self.values


def weight_flushes(layers: Iterable[Any]) -> torch.Tensor | None:
    """Per layer, the fraction of its weight's nonzero elements that its FP8 cast flushes (an FP8 layer's
    ``growth_weight_flush()``, on the device), NaN for a layer without one (not FP8, a block recipe, detached);
    None when no layer has one."""
    values = []
    for layer in layers:
        getter = getattr(layer, "growth_weight_flush", None)
        values.append(None if getter is None else getter())
    known = [v for v in values if v is not None]
    if not known:
        return None
    nan = torch.full((), math.nan, device=known[0].device)
    return torch.stack([nan if v is None else v.float().to(nan.device) for v in values])


def is_runaway(row: dict[str, float], history: History, log2_max: float, window: int, horizon: float,
               kurtosis: float) -> bool:
    """Whether one layer's :meth:`GrowthMonitor.stats` row names it (see :meth:`GrowthMonitor.runaway`)."""
    bad = not math.isfinite(row["amax"]) or math.isnan(row["kurtosis"])
    # An FP8 layer's own scale follows its amax (delayed: the history's max, a step behind; current: the tensor's):
    # a few elements clipped while the history catches up are no runaway, and its trend heads for the activation
    # dtype's range, not FP8's. A fixed scale: FP8's range, and any saturation.
    fixed = history.cast is None
    top = log2_max - math.log2(history.scale) if fixed else history.ceiling
    headroom = math.inf if bad else top - math.log2(row["amax"])
    slope = row["amax_growth"]
    projected = row["samples"] >= window and slope > 0 and headroom < slope * horizon
    flushed = row.get("weight_underflow", 0.0) > WEIGHT_FLUSH_LIMIT  # NaN compares False
    return bad or (fixed and row["saturation"] > 0) or row["kurtosis"] > kurtosis or projected or flushed


def place_rows(histories: Iterable[History], window: int, width: int, device: torch.device) -> torch.Tensor:
    """A ring buffer (layers x ``window`` x ``width``) on ``device`` holding every layer's samples so far; each
    sampled layer's ``rows`` becomes a view of it."""
    histories = list(histories)
    buffer = torch.zeros(len(histories), window, width, device=device)
    for history in histories:
        if history.rows is not None:
            buffer[history.index].copy_(history.rows)
            history.rows = buffer[history.index]
    return buffer


def warn_unsampled(step: int) -> bool:
    """Warn that a due step passed with no sample (on-demand hooks: its forward ran outside the forward context)."""
    warnings.warn(f"GrowthMonitor: step {step} was due for a growth sample, but no training forward ran inside the"
                  " precision's forward context (PrecisionStepper.forward_context, or the plugin's), where the layers"
                  " are hooked: nothing was sampled. Run the forward inside it.", stacklevel=3)
    return True

"""SpikeGuard: rolling loss and gradient-norm statistics on the device, a spike flag that joins the non-finite flag.

A step whose loss or total (unscaled) gradient norm lies more than ``zscore`` standard deviations above the mean of
the last ``window`` applied steps is skipped like an overflow (OLMo-core's ``SkipStepAdamW`` rule, 6 sigma over 128
steps), and optionally the gradient norm is clipped to ``mean + clip_zscore * std`` (ZClip). Everything stays on the
device: the decision is a 0-dim bool tensor that the stepper ORs into its found-inf flag, so the one host read the
skip already costs decides both. Skipped steps (spikes and non-finite steps alike) never enter the statistics.

The stepper calls it at two points of a step::

    guard.observe_loss_(loss)                      # with the unscaled loss, before backward (each micro-batch)
    ...backward, unscale_, non-finite check...
    norm = torch.nn.utils.get_total_norm(grads)    # the true gradients' total norm, before any clipping
    spike = guard.decide(norm)                     # 0-dim bool on the device, OR-ed into found_inf
    threshold = guard.clip_threshold()             # None, or a device tensor: clip to min(max_norm, threshold)
    ...step or skip on (found_inf | spike)...
    guard.commit_(skipped)                         # the step's final 0-dim skip flag: fold only applied steps

Skipping means not calling ``optimizer.step()``: Adam's step counter, its bias correction and its moments then stay
exactly those of an optimizer that never saw the batch (OLMo-core's first ``SkipStepAdamW`` zeroed the update
inside ``step`` while the counter advanced, so the bias correction ran ahead). Any optimizer works, because the guard
only contributes to the skip flag.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Literal, get_args

import torch

from lit_mpstable.base.validate import int_arg, real_arg

__all__ = ["SpikeGuard", "Watched"]

Watched = Literal["loss", "grad_norm"]

# Floors on the standard deviation, relative to the mean's magnitude. The statistics (the clip threshold) use 1%:
# on a nearly flat series (a plateaued loss, a steady norm) a change of a few percent is then not "6 sigma".
# ScaleCheckpoint's rollback rule floors at 5%; a skip is cheaper than a rollback, so the guard may be more sensitive.
_MIN_REL_STD = 0.01
# The skip decision on the gradient norm floors at 50%, i.e. a norm is a spike only when it is both 6 sigma above the
# rolling mean and at least 1 + 6 * 0.5 = 4x that mean. Measured on the CPU GPT (bench/spike_guard.py, batch 16 x 64
# tokens, bf16, AdamW, clip 1.0; 3 seeds x 1000 clean steps): the per-batch norm is heavy-tailed, not Gaussian, so
# the window's std understates its tail. At the 1% floor the benchmark skipped 7/3000 clean steps (steps 149-834,
# none in the warmup); replayed on the three seeds' recorded series, every flag was the gradient norm (z 6-15),
# none the loss: healthy batches at 2.0-3.0x the rolling mean, in a quiet window (relative std 9-23%). The largest
# clean norm seen was 3.0x its rolling mean; the injected gradient spikes (x1e3 on 1% of one layer's gradient
# coordinates, as SPAM's) are 7-12x. With this floor: 0/3000 false skips, 20/20 caught (the spiked run still
# skipped one clean step, a norm just over 4x). A longer warmup or a log scale (log-z 4.6-9.4 on those steps) do
# not separate the two; the ratio does. Norms between
# the clean tail and 4x are left to clipping (fixed, or clip_zscore), which bounds their update anyway.
_SKIP_REL_STD = {"loss": _MIN_REL_STD, "grad_norm": 0.5}
_TINY = 1e-12
_NAMES: tuple[str, ...] = get_args(Watched)


class SpikeGuard:
    """Skip loss and gradient-norm spikes on the device, and optionally clip the norm adaptively (ZClip).

    Keeps the last ``window`` losses and total gradient norms of applied steps in ring buffers (device tensors, with
    their counts), created on the CPU and moved to the device of the first value it sees (or :meth:`bind`). After
    ``warmup`` applied values, a step whose watched value lies more than ``zscore`` standard deviations above the
    rolling mean is flagged. No method reads a tensor's value on the host.

    Args:
        zscore: how many standard deviations above the rolling mean make a spike (OLMo-core: 6).
        window: how many applied steps the statistics cover (OLMo-core: 128).
        warmup: applied values needed before anything is flagged or clipped.
        watch: which values can flag a spike: ``"loss"``, ``"grad_norm"`` or both. The statistics of both are kept
            either way (the z-scores are metrics).
        clip_zscore: clip the gradient norm to ``mean + clip_zscore * std`` of the recent norms (ZClip uses 2.5);
            ``None``: no adaptive clipping.

    Raises:
        TypeError, ValueError: an argument has the wrong type or value (the message names it).
    """

    def __init__(
        self,
        zscore: float = 6.0,
        window: int = 128,
        warmup: int = 20,
        watch: Iterable[Watched] = ("loss", "grad_norm"),
        clip_zscore: float | None = None,
    ) -> None:
        call = type(self).__name__
        self.zscore = real_arg(call, "zscore", zscore, low=0.0, low_open=True,
                               unit="standard deviations above the rolling mean; 6 is OLMo-core's")
        self.window = int_arg(call, "window", window, low=2, high=1 << 20,
                              unit="applied steps in the statistics; a standard deviation needs 2; 128 is usual")
        self.warmup = int_arg(call, "warmup", warmup, low=2,
                              unit="applied steps before the guard judges; a standard deviation needs 2")
        self.watch = _watch_arg(call, watch)
        self.clip_zscore = real_arg(call, "clip_zscore", clip_zscore, low=0.0, low_open=True, none=True,
                                    unit="standard deviations for adaptive clipping; ZClip uses 2.5; None turns it off")
        self.device: torch.device | None = None
        """Where the statistics live; None until the first value (or :meth:`bind`)."""
        # Both watched series side by side (row 0 the loss, row 1 the gradient norm), so that a step's statistics,
        # judgement and fold are one short run of small kernels for both, not one per series.
        self._values = torch.zeros(len(_NAMES), self.window)  # ring buffers, slot = count % window
        self._counts = torch.zeros(len(_NAMES), dtype=torch.int64)  # applied values ever folded, per series
        self._spikes = torch.zeros((), dtype=torch.int64)
        self._zscores = torch.full((len(_NAMES),), math.nan)
        self._pending = torch.zeros(len(_NAMES))  # this step's loss (summed over micro-batches) and norm
        self._has = [False] * len(_NAMES)  # whether this step's value was given (host-side facts)
        self._decided = False  # whether decide() ran this step (host-side)
        self._last_spike = torch.zeros((), dtype=torch.bool)
        self._caps = torch.full((len(_NAMES),), math.inf)  # what a folded value is capped at: the norm's clip threshold
        self._consts: dict[str, Any] = {}  # per-device constants: slot indices, floors, the watched rows' mask

    # ------------------------------------------------------------------------------------------- live state
    @property
    def loss_zscore(self) -> torch.Tensor:
        """The last judged loss's z-score, a 0-dim float32 device tensor (NaN before two applied losses, or when the
        step had no loss). Reading its value syncs."""
        return self._zscores[0]

    @property
    def grad_norm_zscore(self) -> torch.Tensor:
        """The last judged gradient norm's z-score (as :attr:`loss_zscore`), against a standard deviation of at least
        half the rolling mean: above ``zscore`` means skipped (see ``_SKIP_REL_STD``)."""
        return self._zscores[1]

    @property
    def spikes_skipped(self) -> torch.Tensor:
        """Steps skipped because this guard flagged them, a 0-dim int64 device tensor. Reading its value syncs."""
        return self._spikes

    @property
    def last_spike(self) -> torch.Tensor:
        """The last :meth:`decide`'s flag, a 0-dim bool device tensor."""
        return self._last_spike

    # ---------------------------------------------------------------------------------------------- binding
    def bind(self, device: torch.device | str) -> SpikeGuard:
        """Keep the statistics on ``device`` (moving them there if they live elsewhere); returns the guard."""
        device = torch.device(device)
        if self.device != device:
            self._values, self._counts, self._zscores, self._pending, self._spikes, self._last_spike, self._caps = (
                t.to(device) for t in (self._values, self._counts, self._zscores, self._pending, self._spikes,
                                       self._last_spike, self._caps))
            self._consts = {
                "slots": torch.arange(self.window, device=device),
                "skip_floor": torch.tensor([_SKIP_REL_STD[name] for name in _NAMES], device=device),
                "watched": torch.tensor([name in self.watch for name in _NAMES], device=device),
                "pending": (self._pending[0], self._pending[1]),  # views, made once
                "non_blocking": device.type != "cpu",
                "given": {has: torch.tensor(has, device=device)
                          for has in ((a, b) for a in (False, True) for b in (False, True))},
            }
            self.device = device
        return self

    def _value(self, value: torch.Tensor, what: str) -> torch.Tensor:
        """``value`` detached, as a 0-dim tensor (binding the guard to its device on first use)."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"SpikeGuard.{what}: expected a tensor, got {type(value).__name__} {value!r}; pass the"
                            " tensor itself (a Python number would need a host read to produce).")
        if value.numel() != 1:
            raise ValueError(f"SpikeGuard.{what}: expected one value, got a tensor of shape {tuple(value.shape)};"
                             " pass the reduced (scalar) loss or the total gradient norm.")
        if self.device is None:
            self.bind(value.device)
        return value.detach().reshape(())

    # ------------------------------------------------------------------------------------------------- step
    def observe_loss_(self, loss: torch.Tensor) -> None:
        """Record the step's (unscaled) loss; micro-batches of one step add up, as their gradients do."""
        value = self._value(loss, "observe_loss_(loss)")
        pending, early = self._consts["pending"][0], self._consts["non_blocking"]
        # copy_ converts dtype and device; non-blocking only towards an accelerator (host memory might be read before
        # a non-blocking copy lands).
        if self._has[0]:
            pending.add_(value.to(pending.device, non_blocking=early))
        else:
            pending.copy_(value, early)
        self._has[0] = True

    def decide(self, grad_norm: torch.Tensor | None = None) -> torch.Tensor:
        """Whether this step is a spike: a 0-dim bool tensor on the device, to OR into the non-finite flag.

        Judges the loss given to :meth:`observe_loss_` and ``grad_norm`` (the total norm of the true, unscaled
        gradients before any clipping) against the statistics of the applied steps before this one. A non-finite
        value is not a spike (the non-finite check owns it). Also sets :attr:`loss_zscore`/:attr:`grad_norm_zscore`.

        Raises:
            ValueError: ``grad_norm`` is None although it is watched or clipped.
        """
        if grad_norm is None:
            if "grad_norm" in self.watch or self.clip_zscore is not None:
                raise ValueError(
                    f"SpikeGuard(watch={self.watch!r}, clip_zscore={self.clip_zscore!r}).decide(grad_norm=None): the"
                    " gradient norm is watched or clipped, so pass the step's total unscaled gradient norm.")
        else:
            self._consts["pending"][1].copy_(self._value(grad_norm, "decide(grad_norm)"), self._consts["non_blocking"])
            self._has[1] = True
        if self.device is None:  # nothing seen yet, nothing to judge
            return self._last_spike.clone()
        consts = self._consts
        value = self._pending
        mean, std, count = self._stats()
        judged = torch.maximum(std, consts["skip_floor"] * mean.abs())  # the judged z: see _SKIP_REL_STD
        given = consts["given"][tuple(self._has)]
        # A series not measured this step reads NaN: no stale value passed off as fresh.
        z = torch.where(given & (count >= 2), (value - mean) / judged, math.nan)
        self._zscores.copy_(z)
        # NaN z (non-finite value) compares False; +inf value gives an inf z, excluded by isfinite.
        spike = (consts["watched"] & (count >= self.warmup) & torch.isfinite(value) & (z > self.zscore)).any()
        if self.clip_zscore is not None:
            self._caps[1].copy_(self._clip_threshold(mean[1], std[1], count[1]))
        self._last_spike.copy_(spike)
        self._decided = True
        return spike

    def clip_threshold(self, grad_norm: torch.Tensor | None = None) -> torch.Tensor | None:
        """The adaptive clip norm ``mean + clip_zscore * std`` of the recent applied norms, as a 0-dim float32
        device tensor (``inf`` during warmup), or None without ``clip_zscore``. Clip to ``min(max_norm, threshold)``
        (``torch.nn.utils.clip_grads_with_norm_`` takes it as is); no host read.

        Args:
            grad_norm: this step's norm, only to bind the guard to its device when nothing was seen yet.

        Raises:
            RuntimeError: the guard has no device yet and no ``grad_norm`` was given.
        """
        if self.clip_zscore is None:
            return None
        if self.device is None:
            if grad_norm is None:
                raise RuntimeError("SpikeGuard.clip_threshold(): the guard has seen no value yet, so it has no device;"
                                   " pass grad_norm=... or call bind(device) first.")
            self.bind(grad_norm.device)
        mean, std, count = self._stats()
        return self._clip_threshold(mean[1], std[1], count[1])

    def _clip_threshold(self, mean: torch.Tensor, std: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        assert self.clip_zscore is not None
        return torch.where(count >= self.warmup, mean + self.clip_zscore * std, math.inf)

    def commit_(self, skipped: torch.Tensor | bool, *, spiked: torch.Tensor | None = None) -> None:
        """End the step: fold its loss and norm into the statistics unless ``skipped`` (the step's final flag: a
        spike, a non-finite gradient or any other skip), count a skipped spike, and clear the pending values.

        With ``clip_zscore`` the norm enters the statistics clipped to its threshold (ZClip: an outlier that was
        clipped does not widen the band for the next one).

        Args:
            skipped: 0-dim tensor (bool, or the scaler's float found-inf flag) or a Python bool.
            spiked: the spike flag to count, when it differs from this guard's own :meth:`decide` (e.g. agreed across
                ranks); default: the last :meth:`decide`'s.
        """
        if self.device is None:  # no value was ever given: nothing to fold or count
            self._clear()
            return
        if isinstance(skipped, bool):  # the stepper's own flag, read on the host already: no tensor work for it
            if not skipped and any(self._has):
                self._fold(None)
            elif skipped:
                self._count_spike(True, spiked)
        else:
            skipped_t = skipped.detach().to(self.device).reshape(()) != 0
            if any(self._has):
                self._fold(skipped_t)
            self._count_spike(skipped_t, spiked)
        self._clear()

    def _fold(self, skipped: torch.Tensor | None) -> None:
        # ZClip: a clipped norm enters capped at its threshold (the loss's cap is inf).
        value = torch.minimum(self._pending, self._caps) if self.clip_zscore is not None else self._pending
        take = self._consts["given"][tuple(self._has)] & torch.isfinite(value)
        take = take & ~skipped if skipped is not None else take
        # torch.where on a one-hot slot instead of indexing by a Python int: no host read, no graph break.
        slot = (self._consts["slots"] == (self._counts % self.window).unsqueeze(1)) & take.unsqueeze(1)
        self._values.copy_(torch.where(slot, value.unsqueeze(1), self._values))
        self._counts.add_(take)

    def _count_spike(self, skipped: torch.Tensor | bool, spiked: torch.Tensor | None) -> None:
        if spiked is not None:
            self._spikes.add_((spiked.to(self.device).reshape(()) != 0) & skipped)
        elif self._decided:
            self._spikes.add_(self._last_spike & skipped)

    def forget_(self) -> None:
        """Drop the step's pending values without folding them (the step will be run again, e.g. replayed)."""
        self._clear()

    def _clear(self) -> None:
        self._has = [False] * len(_NAMES)
        self._decided = False

    def _stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mean, floored standard deviation (unbiased) and count of the applied values in the window, per series."""
        values, count = self._values, self._counts
        valid = self._consts["slots"] < count.unsqueeze(1)
        n = count.clamp(max=self.window).to(torch.float32)
        mean = torch.where(valid, values, 0.0).sum(1) / n.clamp(min=1.0)
        var = torch.where(valid, values - mean.unsqueeze(1), 0.0).square().sum(1) / (n - 1.0).clamp(min=1.0)
        std = torch.maximum(var.sqrt(), _MIN_REL_STD * mean.abs()).clamp(min=_TINY)
        return mean, std, count

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The statistics, for an exact resume mid-window; tensors and ints only (``weights_only=True`` loads it).

        Keys: ``window`` (int), ``loss`` and ``grad_norm`` (the ring buffers, float32 of length ``window``),
        ``loss_count`` and ``grad_norm_count`` (int64 0-dim: applied values folded so far), ``spikes_skipped``.
        A step's pending values are not saved: checkpoints are written between steps.
        """
        state: dict[str, Any] = {"window": self.window}
        for row, name in enumerate(_NAMES):
            state[name] = self._values[row].detach().clone()
            state[f"{name}_count"] = self._counts[row].detach().clone()
        state["spikes_skipped"] = self._spikes.detach().clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (strict), onto the guard's device if it has one.

        Raises:
            KeyError: keys differ from :meth:`state_dict`'s (each is named).
            TypeError: a value has the wrong type.
            ValueError: another ``window``, a buffer of the wrong shape or holding inf/NaN, a negative count.
        """
        call = "SpikeGuard.load_state_dict"
        if not isinstance(state, dict):
            raise TypeError(f"{call}(state={type(state).__name__}): expected the dict from SpikeGuard.state_dict().")
        expected = set(self.state_dict())
        if set(state) != expected:
            missing, unknown = sorted(expected - set(state)), sorted(set(state) - set(expected))
            raise KeyError(f"{call}: missing keys {missing}, unknown keys {unknown}; was it saved by another version"
                           " of lit_mpstable, or is it not a SpikeGuard's state?")
        if state["window"] != self.window or isinstance(state["window"], bool):
            raise ValueError(f"{call}: state['window']={state['window']!r} but this guard has window={self.window!r};"
                             " the ring buffers cannot be resized exactly: build the guard with the saved window.")
        values, counts = {}, {}
        for name in _NAMES:
            buf = state[name]
            if not isinstance(buf, torch.Tensor) or not buf.is_floating_point():
                raise TypeError(f"{call}: state[{name!r}] must be a floating-point tensor, got {buf!r}.")
            if tuple(buf.shape) != (self.window,):
                raise ValueError(f"{call}: state[{name!r}] has shape {tuple(buf.shape)}, expected ({self.window},)"
                                 " (one value per step of the window).")
            if not bool(torch.isfinite(buf).all()):  # a host read, at load time only
                raise ValueError(f"{call}: state[{name!r}] holds inf/NaN; only finite values of applied steps enter"
                                 " the statistics, so this state is corrupt.")
            values[name] = buf.detach().to(torch.float32)
            counts[name] = _count(call, f"{name}_count", state[f"{name}_count"])
        spikes = _count(call, "spikes_skipped", state["spikes_skipped"])
        device = self.device or torch.device("cpu")
        self._values = torch.stack([values[name] for name in _NAMES]).to(device)
        self._counts = torch.stack([counts[name] for name in _NAMES]).to(device)
        self._spikes = spikes.to(device)
        self._clear()


def _watch_arg(call: str, watch: Any) -> tuple[str, ...]:
    # Any sequence or set of names (a Hydra ListConfig too), never a bare string (its letters are no names).
    if isinstance(watch, (str, bytes)) or not isinstance(watch, (Sequence, AbstractSet)):
        raise TypeError(f"{call}(watch={watch!r}): must be a tuple of names from {_NAMES!r}, e.g. ('loss',).")
    names = tuple(watch)
    bad = [name for name in names if name not in _NAMES]
    if bad:
        raise ValueError(f"{call}(watch={watch!r}): {bad[0]!r} is not one of {_NAMES!r}.")
    if not names:
        raise ValueError(f"{call}(watch={watch!r}): must name at least one of {_NAMES!r}; to turn spike skipping"
                         " off, leave spike_guard=None.")
    if len(set(names)) != len(names):
        raise ValueError(f"{call}(watch={watch!r}): each name at most once.")
    return tuple(name for name in _NAMES if name in names)


def _count(call: str, key: str, value: Any) -> torch.Tensor:
    """A saved count as a 0-dim int64 tensor; refused if negative or not an integer."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point() or value.dtype == torch.bool:
            raise TypeError(f"{call}: state[{key!r}]={value!r} must be an integer 0-dim tensor or an int.")
        tensor = value.detach().reshape(()).to(torch.int64)
    elif isinstance(value, int) and not isinstance(value, bool):
        tensor = torch.tensor(value, dtype=torch.int64)
    else:
        raise TypeError(f"{call}: state[{key!r}]={value!r} must be an integer 0-dim tensor or an int.")
    if int(tensor) < 0:
        raise ValueError(f"{call}: state[{key!r}]={int(tensor)} is negative; a count of applied steps cannot be.")
    return tensor.clone()

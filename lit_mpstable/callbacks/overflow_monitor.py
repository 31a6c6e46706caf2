"""OverflowMonitor: logs the ``mp/*`` metrics and warns when the windowed overflow rate gets high."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit_mpstable.callbacks._common import (
    MAX_WINDOW,
    PluginCallback,
    StepCounter,
    StepMetrics,
    WindowedCounts,
    agreed_names,
    check,
    is_int,
    is_number,
    log_measured,
    measured_metrics,
    plugin_metrics,
    run_trainer,
    strict_keys,
)
from lit_mpstable.callbacks.precision_fallback import PrecisionFallback
from lit_mpstable.core.guards.growth_stats import WEIGHT_FLUSH_LIMIT
from lit_mpstable.core.guards.indicators import AttentionLogits, Indicators, parameter_names
from lit_mpstable.core.weights.compact import CompactWeights
from lit_mpstable.core.weights.moment_keeper import AdamMoments
from lit_mpstable.frontends.common import StableFrontEnd

ATTENTION_WARN = 100.0
"""A head whose max attention logit passes it is named in a warning (QKClip's default threshold)."""


class OverflowMonitor(PluginCallback):
    """Logs ``mp/loss_scale`` (when a scaler runs: also in the progress bar, with the rate), ``mp/overflow_rate``,
    ``mp/skipped_steps``, ``mp/fallback_active``, with a SpikeGuard ``mp/spikes_skipped``, ``mp/grad_norm_zscore``
    and ``mp/loss_zscore`` (read on logging steps only), and, on the steps the plugin's telemetry measured them,
    ``mp/grad_norm`` and ``mp/fp8_*``, through ``LightningModule.log`` (every logger sees them); warns, naming the
    modules blamed for the last overflow, each time the overflow rate over a full window rises above ``warn_rate``.
    (``mp/rollbacks`` is ScaleCheckpoint's to log, ``mp/grad_underflow_frac`` PrecisionProbe's.)

    With ``indicators`` it also logs the leading indicators of :mod:`lit_mpstable.core.guards.indicators`:
    ``mp/update_ratio_max``, ``mp/adam_lag_frac`` and ``mp/spike_score``, plus ``mp/attn_logit_max`` with
    ``attention`` (the attention modules opt in: ``True`` watches every ``nn.MultiheadAttention`` and every module
    with ``qkv`` or ``q_proj``/``k_proj`` children that calls ``F.scaled_dot_product_attention``; a list of module
    names picks the SDPA callers). They are device-side statistics measured on logging steps (the parameters are
    copied before a logging step's optimizer step for the update ratio; the SpikeScore's windows advance each step
    without a host read) and read in one host read per logging step, after a MAX all-reduce (the same values, so the
    same warnings, on every rank). A warning names the layer and the indicator. ``mp/adam_lag_frac`` reads the moments
    wherever they are (the optimizer's state, torchao's quantized states, StablePrecision's BF16/FP8 moments), and
    with ``master_weights="kahan"``/``"stochastic"``, whose step frees each gradient, the gradients that step kept
    for a logging step; where no parameter's lag can be measured (SGD) it is not logged, and one warning says why.

    The window lives in a torchmetrics ring buffer (:class:`WindowedCounts`: overflows, skipped steps and steps
    per stepping batch, summed across processes); per step the callback only writes three scalars into it. The
    loss scale and the rate are read (one host sync) on logging steps only, where the warning is also decided.
    ``mp/overflow_rate`` is the window's rate; ``mp/skipped_steps`` the run's total (``plugin.skipped_steps``:
    overflows plus steps discarded by ``skip_step``, restored on resume).

    Args:
        window: optimizer steps the overflow rate is measured over.
        warn_rate: warn when the windowed rate exceeds it (once per crossing).
        log_every_n_steps: logging period in optimizer steps; ``None``: the trainer's ``log_every_n_steps``
            (loggers write only on the trainer's logging steps, so keep them aligned).
        indicators: ``True`` (the default thresholds) or an :class:`Indicators` with its own; ``False``: none.
        attention: also log the per-head max attention logit (``True``, or the names of the SDPA-calling modules).

    Raises:
        ValueError: an argument is out of range.
    """

    foreign_note = ("it logs the GradScaler's scale and skipped steps (counted without a host sync); blamed modules"
                    " and gradient telemetry need StablePrecision.")

    def __init__(self, window: int = 100, warn_rate: float = 0.01, log_every_n_steps: int | None = None,
                 indicators: bool | Indicators = False, attention: bool | Sequence[str] = False) -> None:
        super().__init__()
        name = type(self).__name__
        check(is_int(window, 1, MAX_WINDOW), f"{name}(window={window!r})",
              f"must be an int in [1, {MAX_WINDOW}] (optimizer steps).")
        check(
            is_number(warn_rate) and 0 <= warn_rate <= 1, f"{name}(warn_rate={warn_rate!r})",
            "must be a fraction in [0, 1]; 0.01 (1% of steps overflowing) is usual.",
        )
        check(
            log_every_n_steps is None or is_int(log_every_n_steps, 1),
            f"{name}(log_every_n_steps={log_every_n_steps!r})", "must be an int >= 1, or None for the trainer's own.",
        )
        check(isinstance(indicators, (bool, Indicators)), f"{name}(indicators={indicators!r})",
              "must be True, False or an Indicators(...).")
        check(isinstance(attention, bool) or (isinstance(attention, (list, tuple))
                                              and all(isinstance(a, str) for a in attention)),
              f"{name}(attention={attention!r})", "must be True, False or a list of module names.")
        self.window, self.warn_rate, self.log_every_n_steps = window, warn_rate, log_every_n_steps
        self.indicators = Indicators() if indicators is True else (indicators or None)
        """The leading indicators and their warning rule (None: not measured)."""
        self.attention = attention
        self.attention_logits: AttentionLogits | None = None
        """The recorder of the attention modules, built at fit start when ``attention`` asks for it."""
        self.latest_attention: dict[str, list[float]] = {}
        """Per watched module, its per-head max logits at the last logging step."""
        self.attention_warned: set[str] = set()
        """Modules whose max attention logit passed ``ATTENTION_WARN`` (warned once each)."""
        self.windowed = WindowedCounts(window)
        self.above = False
        """Whether the rate was above ``warn_rate`` at the last logging step (a warning fires on each crossing)."""
        self.latest_measured: dict[str, float] = {}
        """The telemetry logged at the last logging step that had fresh values (``mp/grad_norm``, ``mp/fp8_*``)."""
        self.blamed: list[str] = []
        """Modules blamed for the latest overflow (from ``plugin.stats["blamed_modules"]``)."""
        self._steps = StepCounter()
        self._logged = StepMetrics()
        self._stats_step: Any = None  # the plugin's stats_step at the last batch end: telemetry is looked at once
        self.growth_warned: set[str] = set()
        """Layers already named by a growth warning (the plugin's ``runaway_layers()``)."""
        self.lag_warned = False
        """Whether the warning that ``mp/adam_lag_frac`` cannot be measured (and is not logged) was given."""

    @cached_property  # the constructor's arguments: Lightning reads the key at every hook of every step
    def state_key(self) -> str:
        return type(self).__qualname__ + repr(dict(window=self.window, warn_rate=self.warn_rate))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self.windowed.to(pl_module.device)
        if self.indicators is not None and self.indicators.spike_score is not None:
            self.indicators.spike_score.to(pl_module.device)
            want = getattr(self._plugin, "want_grad_norm_", None)  # ours: the step's one pass measures the norm
            if callable(want):
                want()
        if self.attention is not False and self.attention_logits is None:
            self.attention_logits = AttentionLogits(
                pl_module, None if self.attention is True else list(self.attention))
        # The batch-start hook only prepares the indicators' and the attention's logging steps.
        self._dispatch("on_train_batch_start", self._plugin is not None and (
            self.indicators is not None or self.attention_logits is not None), OverflowMonitor)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_end(trainer, pl_module)
        if self.attention_logits is not None:
            self.attention_logits.remove()
            self.attention_logits = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Disarm the attention recorder: an exception that passed torch's forward hooks (a KeyboardInterrupt) left
        ``F.scaled_dot_product_attention`` wrapped, for every later call in the process."""
        if self.attention_logits is not None:
            self.attention_logits.remove()
            self.attention_logits = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        """Before a logging step's optimizer step: copy the parameters (update ratio), have compact weights keep the
        gradients they step with (Adam lag), arm the attention hooks."""
        if self.indicators is None and self.attention_logits is None:  # nothing to prepare: no per-step work
            return
        every = self.log_every_n_steps or self._log_every
        if not every or (self._global_step.completed + 1) % every != 0 or self._plugin is None:
            return
        if self.indicators is not None and self.indicators._before is None:
            self.indicators.snapshot_(trainer.optimizers)
        if self.indicators is not None and (compact := self._compact()) is not None:
            compact.keeps_stepped_grads = True
        if self.attention_logits is not None:
            self.attention_logits.armed = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._plugin is not None:
            self._steps.reset(self._plugin)  # after a checkpoint restored the plugin's counters

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._logged.names:  # the batch after a logging step
            self._logged.retire(trainer)
        plugin = self._plugin
        if plugin is None:
            return
        steps, overflows, skipped = self._steps.delta(plugin)
        if steps == 0:
            return
        if self.indicators is not None:  # the SpikeScore's windows advance on the device, every step
            outputs = args[0] if args else None
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if isinstance(loss, torch.Tensor):
                take = getattr(plugin, "take_grad_norm", None)
                norms = [take(opt) for opt in trainer.optimizers] if callable(take) else None
                # A step skipped for inf/NaN is no spike (the overflow rate counts it), and its inf norm would leave
                # the windows' mean inf, blind to real spikes for window_size steps; a spike SpikeGuard skipped is one.
                if not skipped or getattr(plugin, "last_step_spiked", False):
                    self.indicators.update_spike_score(loss, trainer.optimizers, norms)
        self.windowed.record(overflows, skipped, steps)
        if overflows:
            self.blamed = list(plugin.stats.get("blamed_modules") or self.blamed)
        stats_step = plugin.stats.get("stats_step")
        if stats_step != self._stats_step:  # measured since the last batch end: logged on its step, whatever the period
            self._stats_step = stats_step
            if measured := measured_metrics(plugin):
                self.latest_measured = measured
                log_measured(trainer, measured)
        every = self.log_every_n_steps or self._log_every
        if every and self._global_step.completed % every == 0:
            self._log(trainer, pl_module)

    def overflow_rate(self) -> tuple[float, bool]:
        """Overflowing steps / steps over the window, across processes, and whether the window is full
        (synchronises)."""
        overflows, _, steps = self.windowed.compute().tolist()
        return (overflows / steps if steps else 0.0), self.windowed.position >= self.window

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._plugin is not None
        rate, full = self.overflow_rate()
        self._logged.log(pl_module, plugin_metrics(self._plugin, overflow_rate=rate),
                         prog_bar=self._plugin.scaler is not None)
        above = full and rate > self.warn_rate  # a partial window would make the first overflow look like 50%
        if above and not self.above:  # the rate is summed over ranks: every rank gets here together
            blamed = agreed_names(trainer, self.blamed) or "unknown (plugin.stats holds no 'blamed_modules')"
            rank_zero_warn(
                f"OverflowMonitor at step {trainer.global_step}: {rate:.1%} of the last {self.window} optimizer steps"
                f" overflowed (warn_rate={self.warn_rate:.1%}); modules blamed for the last overflow: {blamed}. Each"
                f" overflow skips a step; {self._advice(trainer)}"
            )
        self.above = above
        self._warn_growth(trainer)
        self._log_indicators(trainer, pl_module)

    def _log_indicators(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The leading indicators of this logging step: measured on the device, MAX-reduced across ranks, read once;
        logged, then judged (a warning names the layer and the indicator)."""
        if self.indicators is None and self.attention_logits is None:
            return
        device = pl_module.device
        parts, names = [], []
        if self.indicators is not None:
            optimizers = trainer.optimizers
            compact = self._compact()
            stepped = compact.take_stepped_grads() if compact is not None else None
            ratios, lags, lag_total = self.indicators.measure(optimizers, self._kept_moments(pl_module), stepped)
            del stepped  # the FP32 copies of the gradients, before the host read
            names = parameter_names(pl_module, optimizers)
            parts += [ratios.float(), lags.float(), lag_total.float().reshape(1)]
            if self.indicators.spike_score is not None:
                parts.append(self.indicators.spike_score.score().float().reshape(1))
        heads: list[tuple[str, int]] = []
        if self.attention_logits is not None:
            self.attention_logits.armed = False
            for module, per_head in self.attention_logits.take().items():
                heads.append((module, per_head.numel()))
                parts.append(per_head.float().to(device))
        flat = torch.cat([p.to(device) for p in parts]) if parts else torch.zeros(0, device=device)
        if trainer.world_size > 1:  # the same values, hence the same warnings, on every rank
            flat = trainer.strategy.reduce(flat, reduce_op="max")
        values = flat.tolist()  # the one host read of the indicators
        metrics: dict[str, float] = {}
        warnings: list[str] = []
        if self.indicators is not None:
            n = len(names)
            ratio_v, lag_v, lag_total_v = values[:n], values[n:2 * n], values[2 * n]
            values = values[2 * n + 1:]
            if n:
                metrics["mp/update_ratio_max"] = max(ratio_v)
                if self.indicators.lag_unmeasured is None:  # else its 0 would read as 'no lag'
                    metrics["mp/adam_lag_frac"] = lag_total_v
                elif not self.lag_warned:
                    self.lag_warned = True
                    rank_zero_warn("OverflowMonitor: mp/adam_lag_frac is not logged:"
                                   f" {self.indicators.lag_unmeasured}.")
            if self.indicators.spike_score is not None:
                metrics["mp/spike_score"], values = values[0], values[1:]
            warnings += self.indicators.judge(ratio_v, lag_v, lag_total_v, names, trainer.global_step)
        if heads:
            metrics["mp/attn_logit_max"] = max(values)
            for module, size in heads:
                self.latest_attention[module], values = values[:size], values[size:]
                top = max(self.latest_attention[module])
                if top > ATTENTION_WARN and module not in self.attention_warned:
                    self.attention_warned.add(module)
                    head = self.latest_attention[module].index(top)
                    warnings.append(f"attention logit of {module!r} head {head}: max q.k/sqrt(d) {top:.3g} >"
                                    f" {ATTENTION_WARN:g} (QKClip(threshold={ATTENTION_WARN:g}) would rescale its W_q,"
                                    " W_k)")
        self._logged.log(pl_module, metrics)
        for text in warnings:
            rank_zero_warn(f"OverflowMonitor at step {trainer.global_step}, leading indicator: {text}. A loss spike may"
                           " follow: consider a lower learning rate or QKClip (docs/spikes-and-triage.md).")

    def _kept_moments(self, pl_module: pl.LightningModule) -> dict[int, tuple[torch.Tensor, int]] | None:
        """Adam's second moments (FP32 values) and step counts that StablePrecision's weight keeper holds outside the
        optimizer (``optimizer_state="bf16"``/``"fp8"``), by the id of the parameter the optimizer steps (the FP32
        master, or the model's own); None where the optimizer's state holds them."""
        if not isinstance(self._plugin, StableFrontEnd):
            return None
        keeper = self._plugin.stepper.keeper
        moments = getattr(keeper, "moments", None)  # FP32 masters' and compact weights' (not the protocol's)
        if not isinstance(moments, AdamMoments):
            return None
        stepped: dict[str, torch.Tensor] = dict(pl_module.named_parameters())
        if self._plugin.master is not None:
            stepped.update(self._plugin.master.fp32_weights())
        return {id(stepped[name]): (v.read().view(stepped[name].shape), moments.steps[name])  # stores are flat
                for name, (_, v) in moments.stores.items() if name in stepped}

    def _compact(self) -> CompactWeights | None:
        """StablePrecision's compact weights (``master_weights="kahan"``/``"stochastic"``), else None."""
        keeper = self._plugin.stepper.keeper if isinstance(self._plugin, StableFrontEnd) else None
        return keeper if isinstance(keeper, CompactWeights) else None

    def _warn_growth(self, trainer: pl.Trainer) -> None:
        """Warn once per new set of layers the plugin's growth monitor names (``runaway_layers``)."""
        runaway = getattr(self._plugin, "runaway_layers", None)
        if runaway is None:
            return
        layers = agreed_names(trainer, runaway())  # the same names, and the same warning, on every rank
        if layers and not set(layers) <= self.growth_warned:
            self.growth_warned.update(layers)
            stats = self._plugin.stats.get("growth", {}) if self._plugin is not None else {}
            shown = ", ".join(f"{n!r} (amax {stats[n]['amax']:.3g}, x{2 ** stats[n]['amax_growth']:.3f}/step,"
                              f" kurtosis {stats[n]['kurtosis']:.3g}{_weight_note(stats[n])})" if n in stats
                              else repr(n) for n in layers)
            rank_zero_warn(
                f"OverflowMonitor at step {trainer.global_step}: activations growing towards FP8's range in {shown};"
                f" an overflow is likely ahead. {self._growth_advice(trainer)}"
            )

    @staticmethod
    def _growth_advice(trainer: pl.Trainer) -> str:
        if any(isinstance(cb, PrecisionFallback) and cb.on_growth for cb in run_trainer(trainer).callbacks):
            return "PrecisionFallback(on_growth=True) moves these layers out of FP8."
        return "PrecisionFallback(on_growth=True) would move them out of FP8 before it happens."

    @staticmethod
    def _advice(trainer: pl.Trainer) -> str:
        if any(isinstance(cb, PrecisionFallback) for cb in run_trainer(trainer).callbacks):
            return "PrecisionFallback is installed and decides when to widen the precision."
        return "consider PrecisionFallback(mode='module') or StablePrecision(fp32_modules=...)."

    def state_dict(self) -> dict[str, Any]:
        """Keys: ``counts`` (the window: rows of ``[overflows, skipped, steps]``), ``position``, ``above``,
        ``blamed``; with indicators ``indicators`` (their warning baseline and SpikeScore windows) and
        ``attention_warned``."""
        state = {"counts": self.windowed.counts.tolist(), "position": self.windowed.position, "above": self.above,
                 "blamed": list(self.blamed)}
        if self.indicators is not None:
            state["indicators"] = self.indicators.state_dict()
        if self.attention is not False:
            state["attention_warned"] = sorted(self.attention_warned)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        strict_keys(type(self).__name__, state_dict, set(self.state_dict()))
        counts = self.windowed.counts.new_tensor(state_dict["counts"])
        check(counts.shape == self.windowed.counts.shape, f"{type(self).__name__}.load_state_dict(counts of shape"
              f" {tuple(counts.shape)})", f"this monitor's window is {self.window}; the checkpoint's differs.")
        self.windowed.counts.copy_(counts)
        self.windowed.position = int(state_dict["position"])
        self.above, self.blamed = bool(state_dict["above"]), list(state_dict["blamed"])
        if self.indicators is not None:
            self.indicators.load_state_dict(state_dict["indicators"])
        if self.attention is not False:
            self.attention_warned = set(state_dict["attention_warned"])


def _weight_note(row: dict[str, float]) -> str:
    """A layer named for its weight (an FP8 cast that flushes most of it), said so in the growth warning."""
    flushed = row.get("weight_underflow", 0.0)
    return f"; its FP8 weight cast flushes {flushed:.1%} of the weight" if flushed > WEIGHT_FLUSH_LIMIT else ""

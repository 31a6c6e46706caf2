"""PrecisionFallback: moves the blamed modules, or the whole model, to FP32 when overflow persists, and the modules
whose gradients PrecisionProbe measures too far from FP32 one rung up."""

from __future__ import annotations

import copy
import enum
from collections import deque
from functools import cached_property
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit_mpstable.callbacks._common import (
    MAX_WINDOW,
    LaggedFlag,
    PluginCallback,
    StepCounter,
    agreed_names,
    check,
    is_int,
    is_number,
    run_ladder,
    strict_keys,
    watch_step,
)
from lit_mpstable.callbacks._rules import fallback_reason
from lit_mpstable.core.guards.ladder import Ladder, Rung

FallbackMode = Literal["global", "module"]


class FallbackState(enum.Enum):
    """Where a :class:`PrecisionFallback` stands; :func:`_next_state` is the one transition function."""

    NORMAL = "normal"
    """The configured precision, no fallback decided yet. Every trigger is watched; a decision falls back."""

    FALLEN_BACK = "fallen_back"
    """Part or all of the run computes at a wider precision for good (no ``cooldown``). Triggers are still watched:
    each further decision climbs one more rung."""

    COOLING = "cooling"
    """Fallen back, with low precision to be retried at ``retry_step`` (``cooldown`` steps after the latest
    fallback). A further decision before then climbs one more rung and restarts the wait."""

    RESTORED = "restored"
    """Low precision restored after a cooldown; behaves as :attr:`NORMAL`, with a fallback behind it."""


def _next_state(action: Literal["fallback", "restore"], *, step: int, cooldown: int | None
               ) -> tuple[FallbackState, int | None]:
    """The state after ``action`` at ``step``, and the step at which low precision is retried (None: no retry)."""
    if action == "restore":
        return FallbackState.RESTORED, None
    if cooldown is None:
        return FallbackState.FALLEN_BACK, None
    return FallbackState.COOLING, step + cooldown


class PrecisionFallback(PluginCallback):
    """Widens the precision after persistent overflow, logs why, and optionally retries low precision after a cooldown.

    Triggers (checked after every optimizer step, all on host values): ``patience`` consecutive overflowing steps;
    the loss scale at or below ``min_scale`` (read only after an overflow, the only time it drops); a non-finite
    loss on ``nonfinite_loss_patience`` consecutive steps (flags reduced across ranks on the device and read one
    step late, so no step waits for the device); more than ``max_overflow_rate`` of the last ``window`` steps
    overflowing; and, with ``max_grad_error``, a module whose gradient error measured by ``PrecisionProbe``
    (``plugin.findings.probe``: ``||g - g32|| / ||g32||``) exceeds it on ``grad_error_patience`` probes in a row
    (default: ``patience``) climbs one rung (an FP8 layer leaves FP8, any other module becomes an FP32 island),
    whatever ``mode`` says, since the probe names it. Errors flow backward (a module's gradient carries the errors of
    the modules after it), so of several such modules only the last in registration order (the forward order,
    as overflow blame assumes) climbs per decision, and the others are measured again first; one whose error persists
    in FP32 is told about once (its error comes from elsewhere). Each overflow decision climbs one rung of the
    plugin's ladder: ``mode="global"`` calls
    ``plugin.fallback(None)`` (FP8 layers -> base precision -> FP32); ``mode="module"`` passes the names in
    ``plugin.stats["blamed_modules"]`` (FP8 layers leave FP8, other modules become FP32 islands), and without such
    names, or once they all run in FP32, falls back globally and says why. After ``cooldown`` steps
    ``plugin.restore_precision()`` tries low precision again (undoing every fallback: the plugin has no finer
    undo). With ``on_growth=True`` the layers the plugin's growth monitor names runaway (``plugin.runaway_layers()``,
    ``StablePrecision(growth_every_n_steps=...)``: activations heading out of FP8's range) each climb one rung, once,
    before they overflow (an FP8 layer leaves FP8). Decisions:
    logged once on rank zero by the plugin, kept in :attr:`decisions`, shown in ``mp/fallback_active``.

    Distributed runs decide alike on every rank: overflow counts and the scale come from the plugin, whose scaler
    all-reduces the found-inf flag before every skip (``sync_found_inf_``), the non-finite-loss flag is reduced, and
    the blamed names are agreed (rank 0's, else the first rank's that has any), so every rank moves the same modules;
    the probe's measurements are averaged across ranks, so its decisions agree too.

    Raises:
        ValueError: an argument is out of range.
    """

    def __init__(
        self, patience: int = 10, *, min_scale: float | None = 1.0, mode: FallbackMode = "global",
        cooldown: int | None = None, max_overflow_rate: float | None = 0.2, nonfinite_loss_patience: int | None = 3,
        window: int = 100, max_grad_error: float | None = None, grad_error_patience: int | None = None,
        on_growth: bool = False,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        check(is_int(patience, 1), f"{name}(patience={patience!r})", "must be an int >= 1 (consecutive overflows).")
        check(min_scale is None or (is_number(min_scale) and min_scale > 0), f"{name}(min_scale={min_scale!r})",
              "must be a number > 0 or None (no scale trigger).")
        check(mode in get_args(FallbackMode), f"{name}(mode={mode!r})", f"allowed: {list(get_args(FallbackMode))}.")
        check(cooldown is None or is_int(cooldown, 1), f"{name}(cooldown={cooldown!r})", "must be an int >= 1 or None.")
        check(max_overflow_rate is None or (is_number(max_overflow_rate) and 0 <= max_overflow_rate < 1),
              f"{name}(max_overflow_rate={max_overflow_rate!r})", "must be a fraction in [0, 1) or None.")
        check(nonfinite_loss_patience is None or is_int(nonfinite_loss_patience, 1),
              f"{name}(nonfinite_loss_patience={nonfinite_loss_patience!r})", "must be an int >= 1 or None.")
        check(is_int(window, 1, MAX_WINDOW), f"{name}(window={window!r})",
              f"must be an int in [1, {MAX_WINDOW}] (optimizer steps).")
        check(max_grad_error is None or (is_number(max_grad_error) and max_grad_error > 0),
              f"{name}(max_grad_error={max_grad_error!r})",
              "must be a number > 0 (a relative error: 0.5 flags a module whose gradient is half lost) or None.")
        check(grad_error_patience is None or is_int(grad_error_patience, 1),
              f"{name}(grad_error_patience={grad_error_patience!r})", "must be an int >= 1 (probes) or None.")
        check(isinstance(on_growth, bool), f"{name}(on_growth={on_growth!r})",
              "must be True (move layers the plugin's growth monitor names out of FP8) or False.")
        self.on_growth = on_growth
        self.patience, self.min_scale, self.mode, self.cooldown = patience, min_scale, mode, cooldown
        self.max_overflow_rate, self.nonfinite_loss_patience = max_overflow_rate, nonfinite_loss_patience
        self.window = window
        self.max_grad_error = max_grad_error
        self.grad_error_patience = grad_error_patience if grad_error_patience is not None else patience
        self.grad_error_runs: dict[str, int] = {}
        """Module -> consecutive probes whose measured gradient error exceeded ``max_grad_error``."""
        self.last_probe_step = -1
        """The step of the last probe result read (each is counted once)."""
        self.overflow_run = 0
        self.nonfinite_run = 0
        self.recent: deque[tuple[int, int]] = deque(maxlen=window)  # (overflows, steps) per stepping batch
        self._recent_sums = [0, 0]  # recent's overflows and steps, kept as it changes (not summed every step)
        self.state = FallbackState.NORMAL
        self.retry_step: int | None = None
        """Global step at which low precision is retried (:attr:`FallbackState.COOLING` only)."""
        self.decisions: list[dict[str, Any]] = []
        """Per decision: ``step``, ``action`` (``"fallback"``/``"restore"``), ``modules`` (None: global), ``reason``
        and ``effect`` (what the plugin did: a global fallback climbs one rung, FP8 -> base precision -> FP32)."""
        self.blamed: list[str] = []
        self._steps = StepCounter()
        self._nonfinite = LaggedFlag()  # a non-finite loss in the step
        self._warned_fp32 = False
        self._warned_data = False
        self._warned_fp32_modules: set[str] = set()
        self._growth_moved: set[str] = set()  # layers a growth decision moved (each moves once)
        self._ladder: Ladder | None = None

    @property
    def cooldown_end(self) -> int:
        """:attr:`retry_step` as the checkpoint holds it: -1 when no retry is pending."""
        return self.retry_step if self.state is FallbackState.COOLING and self.retry_step is not None else -1

    @cached_property  # the constructor's arguments: Lightning reads the key at every hook of every step
    def state_key(self) -> str:
        return type(self).__qualname__ + repr(dict(mode=self.mode, patience=self.patience))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        # Whether it watches the steps' ends is settled at the train start (it may stand aside there).
        self._ladder = run_ladder(trainer, self._plugin, "PrecisionFallback", Rung.FALLBACK, watching=False)
        if self._ladder is not None:
            self._ladder.claim("fallback_retry", self.cooldown, f"PrecisionFallback(cooldown={self.cooldown})")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._plugin is not None and not self._plugin.can_fallback:
            # FSDP2 fixed the compute dtype of each unit at fully_shard (*-true modes, FP8 layers): say so once and
            # stay out of the way rather than fail the run at its first decision.
            rank_zero_warn(f"PrecisionFallback does nothing in this run: {self._plugin!r} cannot widen its precision"
                           " after fully_shard (FSDP2 with a '*-true' precision or FP8 layers); use a '*-mixed'"
                           " precision for fallbacks under FSDP2.")
            self._plugin = None
            if self._ladder is not None:
                self._ladder.watch("PrecisionFallback", None)
            return
        if self._plugin is not None:
            self._steps.reset(self._plugin)
            if self._ladder is not None:
                self._ladder.watch("PrecisionFallback")
        self._nonfinite.clear()  # the previous step's flag stays: it may come from a checkpoint

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._plugin is not None and self.nonfinite_loss_patience is not None:
            # The loss on the device; the batch (a poisoned batch is a data problem, not a precision one) is asked
            # only after a non-finite loss was read.
            self._nonfinite.mark(loss, self._plugin)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        plugin = self._plugin
        if plugin is None:
            return
        step = self._global_step.completed
        if self._ladder is not None:
            watch_step(self._ladder, trainer, pl_module, plugin, "PrecisionFallback", step)
        steps, overflows, _ = self._steps.delta(plugin)
        if steps == 0:
            return
        self._observe(trainer, overflows, steps)
        drifting = self._probed(pl_module) if self.max_grad_error is not None else []
        # A trigger needs an overflow now or in the window, or a non-finite loss (a clean step stops a run of them).
        suspect = overflows or self.nonfinite_run or self._recent_sums[0]
        if self.state is FallbackState.COOLING and self.retry_step is not None and self.retry_step <= step:
            plugin.restore_precision()
            self._record(step, "restore", None, f"cooldown of {self.cooldown} steps over", "low precision restored")
        elif suspect and (reason := self._reason(overflows)) is not None:
            self._fall_back(trainer, pl_module, reason)
        elif drifting:
            self._lift(trainer, drifting)
        elif self.on_growth and (grown := self._grown(trainer)):
            self._lift_grown(trainer, grown)

    # ------------------------------------------------------------------- decision input: activation growth
    def _grown(self, trainer: pl.Trainer) -> list[str]:
        """With ``on_growth``: the layers the plugin's growth monitor names runaway (``runaway_layers()``, agreed
        across ranks) that no growth decision has moved yet."""
        runaway = getattr(self._plugin, "runaway_layers", None) if self.on_growth else None
        if runaway is None:
            return []
        return [n for n in agreed_names(trainer, runaway()) if n not in self._growth_moved]

    def _lift_grown(self, trainer: pl.Trainer, names: list[str]) -> None:
        plugin = self._plugin
        assert plugin is not None
        self._growth_moved.update(names)
        reason = (f"the activations of {names} are growing towards FP8's range (the plugin's growth monitor:"
                  " amax trend, kurtosis or saturation)")
        effect = plugin.fallback(list(names), reason=f"PrecisionFallback: {reason}")
        self._record(trainer.global_step, "fallback", list(names), reason, effect)

    def _observe(self, trainer: pl.Trainer, overflows: int, steps: int) -> None:
        assert self._plugin is not None
        if overflows and self._plugin.stats.get("nonfinite_input"):
            # The batch itself held inf/NaN: a data problem no precision can fix; it does not count as overflow.
            overflows = 0
            if not self._warned_data:
                self._warned_data = True
                rank_zero_warn(f"PrecisionFallback at step {trainer.global_step}: the batch held inf/NaN, so the"
                               " skipped step is not counted towards a precision fallback; check the data.")
        self.overflow_run = self.overflow_run + overflows if overflows else 0
        self._remember(overflows, steps)
        self.blamed = list(self._plugin.stats.get("blamed_modules") or self.blamed)
        seen = self._nonfinite.end_step(trainer)  # the previous step's: no stall
        if seen is not None:
            self.nonfinite_run = self.nonfinite_run + 1 if seen else 0

    def _remember(self, overflows: int, steps: int) -> None:
        """Append a stepping batch to :attr:`recent` (the oldest leaves a full window), its sums kept along."""
        sums = self._recent_sums
        if len(self.recent) == self.window:
            old_overflows, old_steps = self.recent[0]
            sums[0] -= old_overflows
            sums[1] -= old_steps
        self.recent.append((overflows, steps))
        sums[0] += overflows
        sums[1] += steps

    def _forget_recent(self) -> None:
        self.recent.clear()
        self._recent_sums = [0, 0]

    def _reason(self, overflows: int) -> str | None:
        assert self._plugin is not None
        scaled = overflows and self.min_scale is not None and self._plugin.scaler is not None
        recent_overflows, recent_steps = self._recent_sums
        full = recent_steps >= self.window
        return fallback_reason(
            overflow_run=self.overflow_run, patience=self.patience, min_scale=self.min_scale,
            loss_scale=self._plugin.loss_scale if scaled else None, nonfinite_run=self.nonfinite_run,
            nonfinite_patience=self.nonfinite_loss_patience, max_overflow_rate=self.max_overflow_rate,
            overflow_rate=recent_overflows / recent_steps if full else None,
            window=self.window,
        )

    def _probed(self, pl_module: pl.LightningModule) -> list[str]:
        """Count a new probe result; the modules over ``max_grad_error`` for ``grad_error_patience`` probes."""
        assert self._plugin is not None
        if self.max_grad_error is None:
            return []
        probe = self._plugin.findings.probe
        if not probe or probe.get("step") == self.last_probe_step:
            return []
        self.last_probe_step = int(probe["step"])
        for name, measured in probe["modules"].items():
            over = not measured["rel_error"] <= self.max_grad_error  # NaN counts as over
            self.grad_error_runs[name] = self.grad_error_runs.get(name, 0) + 1 if over else 0
        known = dict(pl_module.named_modules())
        return [n for n, run in self.grad_error_runs.items() if run >= self.grad_error_patience and n in known]

    def _lift(self, trainer: pl.Trainer, names: list[str]) -> None:
        plugin, step = self._plugin, trainer.global_step
        assert plugin is not None
        assert plugin.findings.probe is not None
        errors = {n: plugin.findings.probe["modules"][n]["rel_error"] for n in names}
        fp32 = [n for n in names if plugin.compute_dtype == torch.float32 or any(
            n == i or n.startswith(i + ".") for i in plugin.islands.names if i)]
        for name in fp32:
            self.grad_error_runs[name] = 0
            if name not in self._warned_fp32_modules:
                self._warned_fp32_modules.add(name)
                rank_zero_warn(f"PrecisionFallback at step {step}: {name!r} already computes in FP32 and its gradient"
                               f" is still {errors[name]:.3g} away from FP32's"
                               f" (max_grad_error={self.max_grad_error:g}): the error reaches it from the layers it"
                               " feeds; look at their probe numbers.")
        names = [n for n in names if n not in fp32]
        if not names:
            return
        source, others = names[-1], names[:-1]  # the most downstream: the others may only inherit its error
        reason = (f"PrecisionProbe measured a gradient error of {errors[source]:.3g} in {source or '(root)'!r} above"
                  f" max_grad_error={self.max_grad_error:g} on {self.grad_error_patience} probes in a row")
        if others:
            reason += f"; {others} (before it, so possibly its error flowing back) are measured again first"
        modules = None if source == "" else [source]  # parameters of the root module: the whole model climbs
        effect = plugin.fallback(modules, reason=f"PrecisionFallback: {reason}")
        for name in names:
            self.grad_error_runs[name] = 0  # the next rung needs fresh evidence
        self._record(step, "fallback", modules, reason, effect)

    def _fall_back(self, trainer: pl.Trainer, pl_module: pl.LightningModule, reason: str) -> None:
        plugin, step = self._plugin, trainer.global_step
        assert plugin is not None
        if plugin.compute_dtype == torch.float32:  # nothing left to widen
            if not self._warned_fp32:
                self._warned_fp32 = True
                rank_zero_warn(f"PrecisionFallback at step {step}: {reason}, but the model already computes in FP32;"
                               " this is not a precision problem (check the learning rate and the data).")
            return
        # One remedy per step: a step the ladder gave to another rung (a replay, whose "precision" verdict falls back
        # itself; a rollback) is not fallen back again; the evidence starts afresh.
        if self._ladder is not None and self._ladder.decide(step - 1, "overflow_storm", reason, by="PrecisionFallback",
                                                            exclude=[Rung.REPLAY]) is not Rung.FALLBACK:
            self.overflow_run = self.nonfinite_run = 0
            self._forget_recent()
            return
        known = dict(pl_module.named_modules())
        blamed = [n for n in agreed_names(trainer, self.blamed) if n in known]  # the same names on every rank
        new = [n for n in blamed if n not in plugin.islands.names]
        modules: list[str] | None = new if self.mode == "module" and new and "" not in new else None
        if self.mode == "module" and modules is None:
            why = ("the root module is blamed" if "" in new else "the blamed modules already run in FP32" if blamed
                   else "plugin.stats names no blamed modules (overflow attribution off?)")
            reason += f"; {why}, so globally"
        effect = plugin.fallback(modules, reason=f"PrecisionFallback: {reason}")
        if self._ladder is not None:
            self._ladder.done(step - 1, effect=effect)
        self._record(step, "fallback", modules, reason, effect)

    def _record(self, step: int, action: str, modules: list[str] | None, reason: str, effect: str) -> None:
        self.decisions.append(dict(step=step, action=action, modules=modules, reason=reason, effect=effect))
        self.overflow_run = self.nonfinite_run = 0  # the next decision needs fresh evidence
        self._forget_recent()
        self.state, self.retry_step = _next_state(action, step=step, cooldown=self.cooldown)  # type: ignore[arg-type]
        # Logged by the plugin (plugin.fallback, plugin.restore_precision): one line per decision.

    def state_dict(self) -> dict[str, Any]:
        """Keys: ``overflow_run``, ``nonfinite_run``, ``previous_nonfinite`` (the unread flag of the last step, None
        if none), ``recent``, ``cooldown_end``, ``decisions``, ``blamed``, ``grad_error_runs``, ``last_probe_step``."""
        return {
            "overflow_run": self.overflow_run, "nonfinite_run": self.nonfinite_run,
            "previous_nonfinite": self._nonfinite.unread(),
            "recent": [list(pair) for pair in self.recent], "cooldown_end": self.cooldown_end,
            "decisions": copy.deepcopy(self.decisions), "blamed": list(self.blamed),
            "grad_error_runs": dict(self.grad_error_runs), "last_probe_step": self.last_probe_step,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        strict_keys(type(self).__name__, state_dict, set(self.state_dict()))
        self.overflow_run, self.nonfinite_run = int(state_dict["overflow_run"]), int(state_dict["nonfinite_run"])
        self._forget_recent()
        for overflows, steps in state_dict["recent"]:
            self._remember(int(overflows), int(steps))
        self.blamed = list(state_dict["blamed"])
        self.decisions = copy.deepcopy(list(state_dict["decisions"]))
        # The state is not stored (the format predates it): a pending retry means cooling, else the last decision says.
        retry, last = int(state_dict["cooldown_end"]), self.decisions[-1].get("action") if self.decisions else None
        self.state = (FallbackState.COOLING if retry >= 0 else FallbackState.FALLEN_BACK if last == "fallback"
                      else FallbackState.RESTORED if last == "restore" else FallbackState.NORMAL)
        self.retry_step = retry if retry >= 0 else None
        self._nonfinite.load(state_dict["previous_nonfinite"])
        self.grad_error_runs = {str(k): int(v) for k, v in state_dict["grad_error_runs"].items()}
        self.last_probe_step = int(state_dict["last_probe_step"])

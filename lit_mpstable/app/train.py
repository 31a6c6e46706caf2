"""Hydra entry point: ``python -m lit_mpstable.train [group=option ...]``. Trains, then writes ``summary.json``."""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from lit_mpstable.app.config import register_configs
from lit_mpstable.app.report import schedule_timeline, write_report
from lit_mpstable.app.report_formats import layer_formats
from lit_mpstable.app.showcase import compare, print_comparison
from lit_mpstable.base.validate import int_arg, real_arg
from lit_mpstable.callbacks import FaultTriage, PrecisionProbe
from lit_mpstable.callbacks.views import ForeignPrecision, view_of
from lit_mpstable.core.scaling.scalers import ScalerName
from lit_mpstable.core.step.stepper import PrecisionStepper
from lit_mpstable.core.weights.memory import MemoryProbe, training_memory
from lit_mpstable.frontends.common import StableFrontEnd


class _StepRecorder(pl.Callback):
    """Records, per optimizer step, the loss scale and whether the step was skipped; reads the plugin's public state,
    or, for Lightning's own precision plugins, the callbacks' view of their GradScaler."""

    def __init__(self) -> None:
        self.loss_scale: list[float] = []
        self.skipped: list[bool] = []
        self.train_loss: list[float] = []
        self.val_loss: list[tuple[int, float]] = []
        self.val_acc: list[tuple[int, float]] = []
        self.started = self.stopped = 0.0
        self.step_seconds: list[float] = []
        self._batch_started = 0.0
        self.peak_bytes: int | None = None
        self.resident_bytes: int | None = None
        self.memory: dict[str, int] = {}
        self._probe: MemoryProbe | None = None
        self.live: Any = None
        self._skipped_before = 0

    # Peak tensor memory of one step after warm-up (step 2): the CUDA allocator's counter on a GPU, the profiler's
    # allocation events on the CPU.
    _PROBE_STEP = 2

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plugin = trainer.precision_plugin
        self.live = plugin if isinstance(plugin, StableFrontEnd) else view_of(plugin, trainer)
        self._skipped_before = self.live.skipped_steps

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if isinstance(self.live, ForeignPrecision):
            self.live.remove()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch_started = time.perf_counter()
        if trainer.global_step != self._PROBE_STEP or self.peak_bytes is not None:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        else:
            self._probe = MemoryProbe()
            self._probe.start(pl_module, trainer.optimizers, getattr(self.live, "state_tensors", list)())

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.step_seconds.append(time.perf_counter() - self._batch_started)  # validation and logging excluded
        self.loss_scale.append(self.live.loss_scale)
        skipped = self.live.skipped_steps
        self.skipped.append(skipped > self._skipped_before)
        self._skipped_before = skipped
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.train_loss.append(float(loss))
        if self._probe is not None:
            self._probe.stop()
            self.peak_bytes, self.resident_bytes, self._probe = self._probe.peak_bytes, self._probe.resident, None
            report = getattr(self.live, "memory_report", None)  # Lightning's own plugins have none: count it here
            self.memory = report() if callable(report) else training_memory(pl_module, trainer.optimizers)
        elif trainer.global_step == self._PROBE_STEP + 1 and pl_module.device.type == "cuda":
            self.peak_bytes = torch.cuda.max_memory_allocated(pl_module.device)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics = trainer.callback_metrics
        if not trainer.sanity_checking and "val/loss" in metrics:
            self.val_loss.append((trainer.global_step, float(metrics["val/loss"])))
            if "val/acc" in metrics:
                self.val_acc.append((trainer.global_step, float(metrics["val/acc"])))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stopped = time.perf_counter()


class _BadConfig(ValueError):
    """A value of the config that the run refuses before training (a setting out of range, a module name or pattern
    that matches nothing in the model): named, with what is allowed."""


def _check_names(plugin: Any, model: pl.LightningModule) -> None:
    # The plugin matches these names only when the trainer hands it the model (fit start, after data setup): checked
    # here, right after the model is built, so a typo fails before training with the names the model does have.
    # Patterns are relative to the LightningModule, as the plugin sees them.
    try:
        plugin.validate(model)
    except ValueError as error:
        raise _BadConfig(str(error)) from error


def _check_run_settings(cfg: DictConfig) -> None:
    # What the constructors downstream would refuse with a bare traceback (int('abc'), torch's set_num_threads, the
    # optimizer's "Invalid learning rate" at the first step): named here, before anything is built.
    try:
        int_arg("lit_mpstable.app.train", "seed", cfg.get("seed"), low=0, high=2**32 - 1, unit="the random seed")
        int_arg("lit_mpstable.app.train", "threads", cfg.get("threads"), low=1, high=4096, unit="torch CPU threads")
        lr = (cfg.get("model") or {}).get("lr")
        if lr is not None:
            real_arg("lit_mpstable.app.train", "model.lr", lr, low=0.0, low_open=True, unit="the learning rate, > 0")
    except (TypeError, ValueError) as error:
        raise _BadConfig(str(error)) from error


def _check_fault_schedule(cfg: DictConfig) -> None:
    # The showcase's faults sit at fixed steps on purpose: after SpikeGuard's warmup, after the storm and the bad batch,
    # each meeting the remedy it shows. Scaled to a shorter run they would land in the warmup or the storm and show
    # something else, so a run too short for them is refused, before the first of its two fits rather than at the
    # FaultInjector's setup, with the overrides that work (Hydra refuses compare.faults.schedule={...}: not in struct).
    faults = cfg.compare.get("faults")
    max_steps = cfg.trainer.get("max_steps")
    schedule = {} if faults is None else dict(faults.get("schedule") or {})
    late = sorted(step for step in schedule if isinstance(max_steps, int) and 0 <= max_steps <= step)
    if not late:
        return
    steps = sorted(schedule)
    moved = {step * max_steps // (steps[-1] + 1): schedule[step] for step in steps}  # the same order, in the run
    fixes = [f"run trainer.max_steps={steps[-1] + 1} or more", "drop the faults ('~compare.faults')"]
    if len(moved) == len(schedule):
        fixes.append("schedule them within the run: '~compare.faults.schedule' '+compare.faults.schedule={"
                     + ", ".join(f"{step}: {kind}" for step, kind in moved.items()) + "}'")
    raise _BadConfig(f"trainer.max_steps={max_steps}: the experiment's faults (compare.faults.schedule="
                     f"{schedule!r}) include steps {late} that a run of {max_steps} steps never reaches; "
                     + ", or ".join(fixes) + ".")


def _check_scaler_choice(node: DictConfig) -> None:
    # The scaler group chooses a scaler by name (scaler=adaptive), as StablePrecision(scaler="adaptive") does: the same
    # rule holds (refused outside FP16; the constructor refuses the node's instance too), said here before anything
    # is built and under the group's name.
    scaler = node.get("scaler")
    target = scaler.get("_target_") if isinstance(scaler, DictConfig) else None
    names: dict[str, ScalerName] = {"lit_mpstable.core.scaling.loss_scaler.DynamicLossScaler": "dynamic",
                                    "lit_mpstable.core.scaling.loss_scaler.StaticLossScaler": "static",
                                    "lit_mpstable.core.scaling.adaptive_scaler.AdaptiveLossScaler": "adaptive"}
    name = names.get(str(target))
    if name is not None:
        try:  # the constructor's own rule and message, for the name
            PrecisionStepper(node.get("precision", "bf16-mixed"), scaler=name, device="cpu", owner="StablePrecision")
        except ValueError as error:
            raise _BadConfig(f"scaler={name}: {error}") from error


@dataclass
class Built:
    """A run composed from a config.

    What :func:`build` instantiated, ready for ``trainer.fit(model, datamodule=data)``.
    """

    data: pl.LightningDataModule
    model: pl.LightningModule
    plugin: Any
    callbacks: list[pl.Callback]
    """The config's callbacks (``cfg.callbacks``), in order."""
    trainer: pl.Trainer


def build(
    cfg: DictConfig, *, extra_callbacks: Sequence[pl.Callback] = (), plugin: Any = None, config_callbacks: bool = True,
    **trainer_kwargs: Any,
) -> Built:
    """Seed, then instantiate data, model (vocabulary from the data), plugin, callbacks and trainer from ``cfg``;
    ``extra_callbacks`` run after the config's own. ``plugin`` replaces ``cfg.plugin`` (another precision plugin, such
    as Lightning's own); ``config_callbacks=False`` leaves ``cfg.callbacks`` out."""
    _check_run_settings(cfg)
    torch.set_num_threads(cfg.threads)
    pl.seed_everything(cfg.seed, verbose=False)
    data = instantiate(cfg.data)
    extra = {"vocab_size": data.vocab_size, "seq_len": data.seq_len} if hasattr(data, "vocab_size") else {}
    model = instantiate(cfg.model, **extra)
    if plugin is None:
        _check_scaler_choice(cfg.plugin)
        plugin = instantiate(cfg.plugin)
        _check_names(plugin, model)
    nodes = (cfg.get("callbacks") or {}).values() if config_callbacks else ()
    callbacks = [instantiate(node) for node in nodes if node is not None]
    trainer = instantiate(cfg.trainer, plugins=[plugin], callbacks=[*callbacks, *extra_callbacks], **trainer_kwargs)
    return Built(data, model, plugin, callbacks, trainer)


_TRIAGE_WHY = {"transient": "clean when replayed as is", "precision": "clean only in FP32",
               "state": "clean only from the snapshot", "data": "not clean on any replay"}
_RUNGS = {"as_is": "as is", "fp32": "in FP32", "snapshot": "from the snapshot"}


def _done(action: str, event: dict[str, Any]) -> str:
    """What an event's action did, as a verb phrase."""
    if action == "rollback":
        return f"rolled back to step {event.get('restored_step')}"
    if action == "fallback":
        return str(event.get("effect") or f"fell back {event.get('blamed') or 'the whole model'}")
    return {"skip": "skipped the batch", "use_replay": "applied the clean replay"}.get(action, action)


def _why(who: str, event: dict[str, Any]) -> str | None:
    """Why ``who`` acted: FaultTriage's verdict and the replays it rests on, ScaleCheckpoint's trigger (None for the
    rollback FaultTriage asked it for: the triage event says why)."""
    if "replays" in event:  # a FaultTriage event
        kind, outcomes = event.get("kind"), [str(o).partition(":") for o in event.get("replays", [])]
        tried = [_RUNGS.get(rung, rung) for rung, _, result in outcomes if result in ("clean", "nonfinite")]
        missing = [f"no {'snapshot' if rung == 'snapshot' else rung}" for rung, _, result in outcomes
                   if result not in ("clean", "nonfinite")]
        basis = f"replayed {', '.join(tried)}" + "".join(f"; {m}" for m in missing) if tried else "; ".join(missing)
        blamed = f"; blamed {', '.join(event['blamed'])}" if event.get("blamed") else ""
        return f"{who}: {kind}, {_TRIAGE_WHY.get(str(kind), str(kind))} ({basis}{blamed})"
    kind = str(event.get("kind"))
    if kind.startswith("fault triage"):
        return None
    loss, zscore = event.get("loss"), event.get("zscore")
    numbers = ("" if loss is None else f", loss {loss:.4g}") + ("" if zscore is None else f", z-score {zscore:.1f}")
    return f"{who}: {kind}{numbers}"


def _events(callbacks: Sequence[pl.Callback], ladder: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """What the callbacks decided, one entry per decision in step order: ``{"step", "kind", "what", "why"}``, kind the
    action (fallback, restore, skip, rollback, use_replay), what was done and why. One event several callbacks acted
    on (a spike SpikeGuard flagged and FaultTriage classified; the rollback FaultTriage asked ScaleCheckpoint for) is
    one entry with each one's reason, FaultTriage's verdict last. ``ladder``: the plugin's ``ladder_events``, for the
    spikes SpikeGuard flagged (no callback records the detector's reason)."""
    found: list[tuple[int, str, str | None, str | None, bool]] = []  # step, kind, what, why, is FaultTriage's
    for e in ladder:
        if e.get("fault") == "spike":
            action = str(e.get("action"))
            found.append((int(e["step"]), action, _done(action, e), str(e.get("reason")), False))
    for cb in callbacks:
        who = type(cb).__name__
        for d in getattr(cb, "decisions", []):
            found.append((d.get("step"), d.get("action"), str(d.get("effect")), f"{who}: {d.get('reason')}", False))
        for e in getattr(cb, "events", []):
            action = e.get("action", "rollback")
            found.append((e.get("step"), action, _done(action, e), _why(who, e), "replays" in e))
    merged: dict[tuple[Any, str], dict[str, Any]] = {}
    for step, kind, what, why, _triage in sorted(found, key=lambda f: f[4]):
        entry = merged.setdefault((step, kind), {"step": step, "kind": kind, "what": [], "why": []})
        for key, value in (("what", what), ("why", why)):
            if value is not None and value not in entry[key]:
                entry[key].append(value)
    events = [{**e, "what": " and ".join(e["what"]), "why": "; ".join(e["why"])} for e in merged.values()]
    return sorted(events, key=lambda e: e["step"] or 0)


def run(
    cfg: DictConfig, out_dir: Path, *, callbacks: Sequence[pl.Callback] = (), plugin: Any = None,
    config_callbacks: bool = True, label: str | None = None,
) -> dict[str, Any]:
    """Train one configuration (plus any extra ``callbacks``) and return (and write) its summary. ``plugin`` and
    ``config_callbacks`` as in :func:`build`; ``label`` names the run in reports (default: the plugin)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    recorder = _StepRecorder()
    built = build(cfg, extra_callbacks=[*callbacks, recorder], plugin=plugin, config_callbacks=config_callbacks,
                  default_root_dir=str(out_dir))
    model, trainer = built.model, built.trainer
    callbacks = [*built.callbacks, *callbacks]
    trainer.fit(model, datamodule=built.data)
    live = recorder.live
    events = sorted(_events(callbacks, getattr(live, "ladder_events", ())) + schedule_timeline(live),
                    key=lambda e: e["step"] or 0)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    stats = live.stats
    telemetry = getattr(getattr(live, "observer", None), "telemetry", None)
    summary = {
        "label": label or repr(built.plugin),
        "precision": live.precision,
        "model": type(model).__name__,
        "callbacks": [type(cb).__name__ for cb in built.callbacks],
        "steps": len(recorder.skipped),
        "steps_per_s": 1.0 / statistics.median(recorder.step_seconds) if recorder.step_seconds else None,
        "wall_s": recorder.stopped - recorder.started,
        "peak_memory_mib": recorder.peak_bytes / 2**20 if recorder.peak_bytes is not None else None,
        # Resident training state by kind at the probed step, and what the step allocated on top (activations,
        # gradients being made, the optimizer's temporaries): the peak is their sum.
        "memory_mib": {**{k: v / 2**20 for k, v in recorder.memory.items() if k != "total"},
                       **({"step_peak_on_top": (recorder.peak_bytes - recorder.resident_bytes) / 2**20}
                          if recorder.peak_bytes is not None and recorder.resident_bytes is not None else {})},
        "final_train_loss": recorder.train_loss[-1] if recorder.train_loss else None,
        "val_loss": metrics.get("val/loss"),
        "val_acc": metrics.get("val/acc"),
        "loss_scale": live.loss_scale,
        "skipped_steps": int(sum(recorder.skipped)),
        "overflow_rate": live.overflow_count / max(live.step_count, 1),
        "fallbacks": sum(e["kind"] == "fallback" for e in events),
        "op_policy": stats.get("op_policy"),
        "rollbacks": sum(getattr(cb, "rollbacks", 0) for cb in callbacks),
        # SpikeGuard's skips (None without a guard: the built-in plugin has none) and FaultTriage's classified events.
        "spikes_skipped": _spikes_skipped(live),
        "faults_triaged": next((len(cb.events) for cb in callbacks if isinstance(cb, FaultTriage)), None),
        "injected_faults": [list(f) for cb in callbacks for f in getattr(cb, "injected", [])],
        "grad_underflow_per_layer": stats.get("grad_underflow_per_module", {}),
        "underflow_format": telemetry.formats[0] if telemetry is not None else None,
        "fp8_saturation_frac": stats.get("fp8_saturation_frac"),
        "fp8_underflow_frac": stats.get("fp8_underflow_frac"),
        "layer_formats": layer_formats(live),
        "probe_history": next((cb.history for cb in callbacks if isinstance(cb, PrecisionProbe)), []),
        "events": events,
        "loss_scale_trajectory": recorder.loss_scale,
        "skipped_trajectory": recorder.skipped,
        "train_loss_curve": recorder.train_loss,
        "val_loss_curve": recorder.val_loss,
        "val_acc_curve": recorder.val_acc,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    write_report(summary, out_dir)
    return summary


def _spikes_skipped(live: Any) -> int | None:
    guard = getattr(live, "spike_guard", None)
    return None if guard is None else int(guard.spikes_skipped)


def _print_summary(summary: dict[str, Any], out_dir: Path) -> None:
    keys = ("steps", "steps_per_s", "final_train_loss", "val_loss", "val_acc", "peak_memory_mib", "loss_scale",
            "skipped_steps", "fallbacks", "rollbacks")
    rows = [(key, f"{summary[key]:.4g}" if isinstance(summary[key], float) else str(summary[key])) for key in keys]
    title = f"lit_mpstable run: {summary['model']} in {summary['precision']}"
    paths = f"summary: {out_dir / 'summary.json'}\nstability report: {out_dir / 'report.md'}"
    try:
        from rich.console import Console
        from rich.table import Table
    except ModuleNotFoundError:
        width = max(len(key) for key in keys)
        print("\n".join([title, *(f"  {key:<{width}}  {value}" for key, value in rows), paths]))
        print('(a plain table: rich is not installed; pip install "lit_mpstable[report]" for a formatted one)')
        return
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in rows:
        table.add_row(key, value)
    console = Console()
    console.print(table)
    console.print(paths)


register_configs()

_SCALER_KEY = re.compile(r"^[+~]{0,2}scaler\.")  # the group's name used as a key: scaler.init_scale=...
_PLUGIN_SCALER_KEY = re.compile(r"^[+~]{0,2}plugin\.scaler\.")
_SCALER_OPTIONS = (
    "scaler options live in the plugin's scaler node, plugin.scaler.<option>, which exists once a scaler node is"
    " chosen: scaler=dynamic (or static, adaptive) plugin.scaler.init_scale=1024. The default (scaler=default) is"
    " the name 'auto' (the plugin picks), which has no options."
)


@hydra.main(version_base="1.3", config_path="pkg://lit_mpstable.conf", config_name="train")
def _app(cfg: DictConfig) -> None:
    # Lightning's own deprecation notice about torch's pytree API, printed once per fit: not the user's to act on.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        if cfg.get("compare"):
            _check_fault_schedule(cfg)
            summary = compare(cfg, out_dir, run)
        else:
            summary = run(cfg, out_dir)
    except (InstantiationException, _BadConfig) as error:
        # A bad value in a config: the constructor's (or the name check's) message names the argument, the value and
        # what is allowed; a traceback would bury it.
        cause = error.__cause__ or error
        kind = "" if isinstance(cause, _BadConfig) else f"{type(cause).__name__}: "  # ours: the message says it all
        print(f"lit_mpstable.app.train: invalid configuration: {kind}{cause}", file=sys.stderr)
        sys.exit(2)
    if cfg.get("compare"):
        print_comparison(summary, out_dir)
    else:
        _print_summary(summary, out_dir)


def main() -> None:
    """``lit-mpstable-train`` and ``python -m lit_mpstable.train``: the Hydra app over ``pkg://lit_mpstable.conf``.

    ``scaler.<option>=...`` (the group's name used as a key) is refused up front with the path that works; an
    override of ``plugin.scaler.<option>`` that Hydra rejects (the scaler is a name, not a node) gets the same hint.
    """
    overrides = [arg for arg in sys.argv[1:] if not arg.startswith("-")]
    misplaced = [arg for arg in overrides if _SCALER_KEY.match(arg)]
    if misplaced:
        print(f"lit_mpstable.app.train: {misplaced[0]!r}: there is no key 'scaler'; {_SCALER_OPTIONS}", file=sys.stderr)
        sys.exit(2)
    try:
        _app()
    except SystemExit as exit_:
        # Hydra has printed its own message ("Key 'init_scale' is not in struct"); add how to get there.
        if exit_.code == 1 and any(_PLUGIN_SCALER_KEY.match(arg) for arg in overrides):
            print(f"lit_mpstable.app.train: {_SCALER_OPTIONS}", file=sys.stderr)
        raise


if __name__ == "__main__":
    main()

"""The stability report of one run: ``report.md`` plus PNG figures (with the ``report`` extra), written from a run
summary (a plain dict)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lit_mpstable.app.report_formats import format_lines
from lit_mpstable.app.report_probe import write_probe_figure


def settle_step(scales: Sequence[float], factor: float = 2.0) -> int | None:
    """The first step from which the loss scale stays within ``factor`` of its final value; ``None`` if empty."""
    if not scales:
        return None
    final = scales[-1]
    step = len(scales)
    for i in range(len(scales) - 1, -1, -1):
        if not final / factor <= scales[i] <= final * factor:
            break
        step = i
    return step


def decision_line(event: dict[str, Any]) -> str:
    """One decision of a run's callbacks, one line: ``step N: what was done: why``."""
    why = event.get("why")
    return f"step {event.get('step')}: {event.get('what')}" + (f": {why}" if why else "")


def cell(value: Any, spec: str) -> str:
    """A table cell: ``value`` formatted with ``spec`` (``"d"``: as an int), ``"-"`` for None."""
    if value is None:
        return "-"
    return str(int(value)) if spec == "d" else format(value, spec)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return "-" if value is None else str(value)


_NO_FIGURES = 'Figures not drawn: matplotlib is not installed (pip install "lit_mpstable[report]").'


def _pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend; ModuleNotFoundError without matplotlib (the ``report``
    extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _matplotlib_missing(error: ModuleNotFoundError) -> bool:
    return error.name is not None and error.name.partition(".")[0] == "matplotlib"


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def _figures(summary: dict[str, Any], out_dir: Path) -> list[tuple[str, str]]:
    """Draws the figures; raises ModuleNotFoundError without matplotlib (the ``report`` extra)."""
    plt = _pyplot()
    figures = []
    scales, skipped = summary.get("loss_scale_trajectory") or [], summary.get("skipped_trajectory") or []
    # Without a scaler (BF16, FP32) the scale is a flat line at 1: drawn only if steps were skipped or decided.
    if scales and (any(s != 1.0 for s in scales) or any(skipped) or summary.get("events")):
        fig, ax = plt.subplots(figsize=(7, 3.2))
        ax.plot(range(len(scales)), scales, lw=1.5, label="loss scale")
        bad = [i for i, s in enumerate(skipped) if s]
        if bad:
            ax.scatter(bad, [scales[i] for i in bad], color="crimson", marker="v", zorder=3, label="skipped step")
        _mark_events(ax, summary.get("events") or [])
        ax.set_yscale("log", base=2)
        ax.set(xlabel="optimizer step", ylabel="loss scale", title="Loss scale (skipped steps and decisions marked)")
        ax.legend(loc="best")
        _save(fig, out_dir / "loss_scale.png")
        figures.append(("Loss scale over steps", "loss_scale.png"))
    losses = summary.get("train_loss_curve") or []
    if losses:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        ax.plot(range(len(losses)), losses, lw=1, alpha=0.8, label="train loss")
        val = summary.get("val_loss_curve") or []
        if val:
            ax.plot([p[0] for p in val], [p[1] for p in val], "o-", color="darkorange", label="val loss")
        ax.set(xlabel="optimizer step", ylabel="loss", title="Loss curves")
        ax.legend(loc="best")
        _save(fig, out_dir / "loss.png")
        figures.append(("Loss curves", "loss.png"))
    if (drawn := write_probe_figure(summary.get("probe_history") or [], out_dir)) is not None:
        figures.append(drawn)
    underflow = summary.get("grad_underflow_per_layer") or {}
    if not summary.get("probe_history") and any(value > 0 for value in underflow.values()):
        # The telemetry's forecast, only where no probe measured (and never an all-zero chart).
        names = list(underflow)
        fig, ax = plt.subplots(figsize=(7, 0.3 * len(names) + 1.2))
        ax.barh(names, [underflow[n] for n in names], color="steelblue")
        ax.invert_yaxis()
        ax.set(xlabel="fraction of nonzero gradient elements that flush to zero",
               title=f"Gradient underflow per layer ({summary.get('underflow_format', 'fp16')}, at the run's scale)")
        _save(fig, out_dir / "underflow.png")
        figures.append(("Gradient underflow per layer", "underflow.png"))
    return figures


_EVENT_COLOURS = {"fallback": "darkorange", "restore": "seagreen", "skip": "purple", "rollback": "crimson",
                  "precision": "royalblue"}


def schedule_timeline(plugin: Any) -> list[dict[str, Any]]:
    """The precision schedule's switches (``StablePrecision(schedule=...)``) as timeline events: ``{"step", "kind":
    "precision", "what", "why"}``; empty without a schedule."""
    runner = getattr(plugin, "precision_schedule", None)
    return [{"step": e["step"], "kind": "precision",
             "what": "switched " + ", ".join(f"{role} to {fmt}" for role, fmt in e["formats"].items())
             + f" on {e['layers']} FP8 layer(s)", "why": f"PrecisionSchedule({e['at']})"}
            for e in getattr(runner, "events", [])]


def _mark_events(ax: Any, events: Sequence[dict[str, Any]]) -> None:
    """A dashed vertical line per decision, coloured by kind, named once in the legend."""
    named: set[str] = set()
    for event in events:
        kind = str(event.get("kind") or str(event.get("what", "")).split(":")[0])
        ax.axvline(event.get("step") or 0, color=_EVENT_COLOURS.get(kind, "gray"), ls="--", lw=1,
                   label=kind if kind not in named else None)
        named.add(kind)


def _running_median(values: Sequence[float], window: int = 15) -> list[float]:
    """Running median over the last ``window`` finite values: follows the trend, ignores a one-batch spike."""
    out: list[float] = []
    recent: list[float] = []
    for value in values:
        if math.isfinite(value):
            recent = (recent + [value])[-window:]
        out.append(sorted(recent)[len(recent) // 2] if recent else math.nan)
    return out


def _comparison_figure(runs: dict[str, dict[str, Any]], out_dir: Path) -> str:
    """Loss, validation accuracy and loss scale of both runs on the same axes; returns the file name."""
    plt = _pyplot()
    styles = {"builtin": dict(color="tab:gray", ls="-"), "stable": dict(color="tab:blue", ls="-")}
    fig, (loss_ax, acc_ax, scale_ax) = plt.subplots(3, 1, figsize=(8, 8.2), sharex=True,
                                                    gridspec_kw=dict(height_ratios=[1.2, 1, 1]))
    for key, summary in runs.items():
        label, style = summary["label"], styles.get(key, {})
        losses = summary.get("train_loss_curve") or []
        loss_ax.plot(range(len(losses)), _running_median(losses), lw=1, alpha=0.45, **style)
        val = summary.get("val_loss_curve") or []
        if val:
            loss_ax.plot([p[0] for p in val], [p[1] for p in val], marker="o", ms=3, lw=1.5, label=label, **style)
        acc = summary.get("val_acc_curve") or []
        if acc:
            acc_ax.plot([p[0] for p in acc], [100 * p[1] for p in acc], marker="o", ms=3, lw=1.2, label=label, **style)
        scales = summary.get("loss_scale_trajectory") or []
        scale_ax.plot(range(len(scales)), scales, lw=1.5, label=label, **style)
        bad = [i for i, s in enumerate(summary.get("skipped_trajectory") or []) if s]
        if bad:
            scale_ax.scatter(bad, [scales[i] for i in bad], s=12, marker="v", color=style.get("color"), zorder=3)
    for ax in (loss_ax, acc_ax, scale_ax):
        _mark_events(ax, runs.get("stable", {}).get("events") or [])
    loss_ax.set_yscale("log")
    loss_ax.set(ylabel="loss (log)", title="The same faulty FP16 run: Lightning's built-in precision vs lit_mpstable")
    acc_ax.set(ylabel="val accuracy (%)")
    scale_ax.set_yscale("log", base=2)
    scale_ax.set(ylabel="loss scale (log2)", xlabel="optimizer step")
    loss_ax.legend(loc="upper right", fontsize=8)
    handles, labels = scale_ax.get_legend_handles_labels()
    scale_ax.legend(handles, labels, loc="center right", fontsize=7)
    fig.text(0.01, 0.005, "dots: validation loss; thin: running median of the training loss; triangles: skipped steps;"
             " dashed: lit_mpstable's callbacks deciding", fontsize=7, color="dimgray")
    _save(fig, out_dir / "comparison.png")
    return "comparison.png"


def write_comparison_report(summary: dict[str, Any], out_dir: str | Path) -> Path:
    """Write ``report.md`` for a side-by-side run (``{"runs": {"builtin": ..., "stable": ...}, "rows": [...]}``): the
    figure with both runs, the two-column table, and what StablePrecision's callbacks did, with each run's own report
    linked."""
    out_dir = Path(out_dir)
    runs, rows = summary["runs"], summary["rows"]
    base, ours = runs["builtin"], runs["stable"]
    lines = [f"# Stability report: {ours['model']} in {ours['precision']}, side by side", ""]
    try:
        lines += [f"![both runs]({_comparison_figure(runs, out_dir)})", ""]
    except ModuleNotFoundError as error:
        if not _matplotlib_missing(error):
            raise
        lines += [_NO_FIGURES, ""]
    lines += [f"| | {base['label']} | {ours['label']} |", "| --- | ---: | ---: |"]
    for label, key, spec in rows:
        lines.append(f"| {label} | {cell(base.get(key), spec)} | {cell(ours.get(key), spec)} |")
    if (out_dir / "stable" / "probe.png").exists():
        lines += ["", f"## Per layer, what {ours['precision']} cost {ours['label']}'s gradients (PrecisionProbe)", "",
                  "![probe](stable/probe.png)"]
    lines += ["", f"## What {ours['label']} did", ""]
    lines += [f"- {decision_line(e)}" for e in ours.get("events") or []] or ["- nothing"]
    lines += ["", "Each run's own report: [built-in](builtin/report.md), [StablePrecision](stable/report.md).", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def write_report(summary: dict[str, Any], out_dir: str | Path) -> Path:
    """Write ``report.md`` and its figures into ``out_dir``; returns the report's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        figures, no_figures = _figures(summary, out_dir), None
    except ModuleNotFoundError as error:
        if not _matplotlib_missing(error):
            raise
        figures, no_figures = [], _NO_FIGURES
        warnings.warn(f"write_report: {no_figures}", stacklevel=2)
    scales = summary.get("loss_scale_trajectory") or []
    overflow_rate = summary.get("overflow_rate") or 0.0
    rows = [
        ("precision", summary.get("precision")),
        ("model", summary.get("model")),
        ("optimizer steps", summary.get("steps")),
        ("steps/s", summary.get("steps_per_s")),
        ("final train loss", summary.get("final_train_loss")),
        ("val loss", summary.get("val_loss")),
        ("val accuracy", summary.get("val_acc")),
        ("peak tensor memory (MiB)", summary.get("peak_memory_mib")),
        ("final loss scale", summary.get("loss_scale")),
        ("steps for the scale to settle (within 2x)", settle_step(scales)),
        ("skipped steps", summary.get("skipped_steps")),
        ("overflow rate", overflow_rate),
        ("fallbacks", summary.get("fallbacks")),
        ("rollbacks", summary.get("rollbacks")),
    ]
    checks = []
    final = summary.get("final_train_loss")
    checks.append(("finite final loss", final is not None and math.isfinite(final)))
    checks.append(("overflow rate below 1%", overflow_rate < 0.01))
    checks.append(("no rollback needed", not summary.get("rollbacks")))
    lines = [f"# Stability report: {summary.get('model')} in {summary.get('precision')}", ""]
    lines += ["| metric | value |", "| --- | ---: |"] + [f"| {k} | {_fmt(v)} |" for k, v in rows] + [""]
    lines += ["## Checks", ""] + [f"- {'PASS' if ok else 'FAIL'}: {name}" for name, ok in checks] + [""]
    for event in summary.get("events") or []:
        lines.append(f"- {decision_line(event)}")
    if memory := {k: v for k, v in (summary.get("memory_mib") or {}).items() if v}:
        lines += ["", "## Memory at the measured step (MiB)", "", "| kind | MiB |", "| --- | ---: |"]
        lines += [f"| {kind.replace('_', ' ')} | {mib:.2f} |" for kind, mib in memory.items()] + [""]
    lines += format_lines(summary)
    if no_figures:
        lines += [no_figures, ""]
    for title, name in figures:
        lines += [f"## {title}", "", f"![{title}]({name})", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path

"""The stability report of one run: ``report.md`` plus PNG figures (with the ``report`` extra), written from a run
summary (a plain dict)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["settle_step", "write_report"]


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


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return "-" if value is None else str(value)


def _figures(summary: dict[str, Any], out_dir: Path) -> list[tuple[str, str]]:
    """Draws the figures; raises ModuleNotFoundError without matplotlib (the ``report`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    scales, skipped = summary.get("loss_scale_trajectory") or [], summary.get("skipped_trajectory") or []
    if scales:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        ax.plot(range(len(scales)), scales, lw=1.5, label="loss scale")
        bad = [i for i, s in enumerate(skipped) if s]
        if bad:
            ax.scatter(bad, [scales[i] for i in bad], color="crimson", marker="v", zorder=3, label="skipped step")
        for i, event in enumerate(summary.get("events") or []):
            kind = str(event.get("what", "")).split(":")[0]
            ax.axvline(event.get("step") or 0, color="gray", ls="--", lw=1, label="fallback / restore / rollback" if i == 0 else None)
            ax.annotate(kind, (event.get("step") or 0, 1), xycoords=("data", "axes fraction"), rotation=90,
                        va="top", ha="right", fontsize=7, color="dimgray")
        ax.set_yscale("log", base=2)
        ax.set(xlabel="optimizer step", ylabel="loss scale", title="Loss scale (skipped steps and decisions marked)")
        ax.legend(loc="best")
        fig.tight_layout()
        fig.savefig(out_dir / "loss_scale.png", dpi=110)
        plt.close(fig)
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
        fig.tight_layout()
        fig.savefig(out_dir / "loss.png", dpi=110)
        plt.close(fig)
        figures.append(("Loss curves", "loss.png"))
    underflow = summary.get("grad_underflow_per_layer") or {}
    if underflow:
        names = list(underflow)
        fig, ax = plt.subplots(figsize=(7, 0.3 * len(names) + 1.2))
        ax.barh(names, [underflow[n] for n in names], color="steelblue")
        ax.invert_yaxis()
        ax.set(xlabel="fraction of nonzero gradient elements that flush to zero",
               title=f"Gradient underflow per layer ({summary.get('underflow_format', 'fp16')}, at the run's scale)")
        fig.tight_layout()
        fig.savefig(out_dir / "underflow.png", dpi=110)
        plt.close(fig)
        figures.append(("Gradient underflow per layer", "underflow.png"))
    return figures


def write_report(summary: dict[str, Any], out_dir: str | Path) -> Path:
    """Write ``report.md`` and its figures into ``out_dir``; returns the report's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        figures, no_figures = _figures(summary, out_dir), None
    except ModuleNotFoundError as error:
        if error.name is None or error.name.partition(".")[0] != "matplotlib":
            raise
        figures, no_figures = [], 'Figures not drawn: matplotlib is not installed (pip install "lit_mpstable[report]").'
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
        lines.append(f"- step {event.get('step')}: {event.get('what')}")
    if no_figures:
        lines += [no_figures, ""]
    for title, name in figures:
        lines += [f"## {title}", "", f"![{title}]({name})", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path

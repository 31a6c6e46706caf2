"""The stability report's per-layer figure: PrecisionProbe's numbers as heatmaps, layers x probe steps."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Relative errors below this are shown as this (BF16 rounding alone costs ~0.4%, FP16's ~0.05%); above 1 the
# gradient is more error than signal.
_REL_ERROR_RANGE = (1e-4, 1.0)


def probe_matrix(
    history: Sequence[Mapping[str, Any]], metric: str = "rel_error"
) -> tuple[list[str], list[int], list[list[float]]]:
    """``(modules, steps, values)`` of ``metric`` (``"underflow_frac"``, ``"rel_error"`` or ``"cosine"``) from the
    probe's records (``PrecisionProbe.history``): one row per module in the order they first appear, one column per
    probe, NaN where a probe did not measure that module (a module added later, say)."""
    modules = list(dict.fromkeys(name for record in history for name in record["modules"]))
    steps = [int(record["step"]) for record in history]
    values = [[float(record["modules"][name][metric]) if name in record["modules"] else math.nan for record in history]
              for name in modules]
    return modules, steps, values


def write_probe_figure(
    history: Sequence[Mapping[str, Any]], out_dir: str | Path, *, name: str = "probe.png",
    title: str = "What low precision cost each layer's gradients (PrecisionProbe)",
) -> tuple[str, str] | None:
    """Draw the probe's history as two heatmaps, one above the other, layers (rows) x probe steps (columns): the
    fraction of gradient elements flushed to zero, and the relative error to FP32 (log colour scale). Returns
    ``(title, file name)`` for the report, or ``None`` (nothing drawn) without probe records.

    Raises:
        ModuleNotFoundError: matplotlib is missing (the ``report`` extra).
    """
    if not history or not any(record["modules"] for record in history):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    modules, steps, underflow = probe_matrix(history, "underflow_frac")
    _, _, error = probe_matrix(history, "rel_error")
    low, high = _REL_ERROR_RANGE
    error = [[min(max(v, low), high) if math.isfinite(v) else (high if v == math.inf else math.nan) for v in row]
             for row in error]
    width = min(max(6.0, 2.5 + 0.55 * len(steps)), 14.0)
    panel = max(1.8, 0.8 + 0.3 * len(modules))
    fig, axes = plt.subplots(2, 1, figsize=(width, 2 * panel + 0.9), squeeze=False)
    panels: tuple[tuple[Any, Any, dict[str, Any], str, str], ...] = (
        (axes[0][0], underflow, dict(cmap="magma", vmin=0.0, vmax=1.0), "flushed (fraction)", "{:.0%}"),
        (axes[1][0], error, dict(cmap="viridis", norm=LogNorm(vmin=low, vmax=high)), "||g - g32|| / ||g32||",
         "{:.1g}"),
    )
    for ax, values, style, label, fmt in panels:
        image = ax.imshow(values, aspect="auto", interpolation="nearest", **style)
        colorbar = fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02)
        colorbar.set_label(label)
        ax.set_yticks(range(len(modules)), labels=[m or "(root)" for m in modules], fontsize=8)
        every = max(1, math.ceil(len(steps) / 12))
        ax.set_xticks(range(0, len(steps), every), labels=[str(s) for s in steps[::every]], fontsize=8)
        ax.set(xlabel="optimizer step (probe)", ylabel="module")
        if len(steps) * len(modules) <= 120:  # small enough to print each value
            for row, line in enumerate(values):
                for col, value in enumerate(line):
                    if math.isfinite(value):
                        shade = value if style.get("norm") is None else style["norm"](value)
                        ax.text(col, row, fmt.format(value), ha="center", va="center", fontsize=6.5,
                                color="black" if shade > 0.6 else "white")
    axes[0][0].set_title("Gradient elements flushed to zero (of those nonzero in FP32)", fontsize=10)
    axes[1][0].set_title("Gradient relative error to FP32", fontsize=10)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    fig.savefig(path / name, dpi=110)
    plt.close(fig)
    return title, name

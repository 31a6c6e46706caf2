"""The side-by-side run: one configuration trained twice on the same seed and data, with another precision plugin
(Lightning's built-in, ``cfg.compare.baseline``, no callbacks) and with StablePrecision and the configured callbacks;
one summary, one two-column table, one report with both runs on the same axes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig

from lit_mpstable.app.report import cell, decision_line, write_comparison_report

# (label, summary key, format): what the terminal table and the report's table show, in this order.
ROWS = (
    ("final train loss", "final_train_loss", ".4f"),
    ("val loss", "val_loss", ".4f"),
    ("val accuracy", "val_acc", ".1%"),
    ("skipped steps", "skipped_steps", "d"),
    ("spikes skipped", "spikes_skipped", "d"),
    ("faults triaged", "faults_triaged", "d"),
    ("fallbacks", "fallbacks", "d"),
    ("rollbacks", "rollbacks", "d"),
    ("final loss scale", "loss_scale", ".4g"),
    ("peak tensor memory (MiB)", "peak_memory_mib", ".2f"),
    ("time (s)", "wall_s", ".1f"),
)


def compare(cfg: DictConfig, out_dir: Path, run: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """Train the baseline, then ours, each with ``run`` (``lit_mpstable.app.train.run``); write ``summary.json`` (both
    runs) and ``report.md``; return the summary. ``cfg.compare.faults`` (optional): a callback both runs get, each its
    own instance (a ``FaultInjector``: the same faults at the same steps)."""
    faults = cfg.compare.get("faults")

    def injected() -> list[Any]:
        return [instantiate(faults)] if faults is not None else []

    baseline = run(cfg, out_dir / "builtin", plugin=instantiate(cfg.compare.baseline), config_callbacks=False,
                   label=str(cfg.compare.baseline_label), callbacks=injected())
    ours = run(cfg, out_dir / "stable", label=str(cfg.compare.label), callbacks=injected())
    summary = {"runs": {"builtin": baseline, "stable": ours}, "rows": [list(row) for row in ROWS]}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    write_comparison_report(summary, out_dir)
    return summary


def print_comparison(summary: dict[str, Any], out_dir: Path) -> None:
    """The two-column table in the terminal (rich when installed), then where the files are."""
    base, ours = summary["runs"]["builtin"], summary["runs"]["stable"]
    title = f"{ours['model']} in {ours['precision']}: the same faults, the same seed and data"
    rows = [(label, cell(base.get(key), spec), cell(ours.get(key), spec)) for label, key, spec in ROWS]
    paths = f"summary: {out_dir / 'summary.json'}\nstability report: {out_dir / 'report.md'}"
    try:
        from rich.console import Console
        from rich.table import Table
    except ModuleNotFoundError:
        width = max(len(label) for label, *_ in rows)
        lines = [title, f"  {'':<{width}}  {base['label']:>36}  {ours['label']:>40}"]
        lines += [f"  {label:<{width}}  {a:>36}  {b:>40}" for label, a, b in rows]
        lines += [f"  {decision_line(event)}" for event in ours.get("events") or []]
        print("\n".join([*lines, paths]))
        print('(a plain table: rich is not installed; pip install "lit_mpstable[report]" for a formatted one)')
        return
    table = Table(title=title)
    table.add_column("")
    table.add_column(base["label"], justify="right")
    table.add_column(ours["label"], justify="right")
    for row in rows:
        table.add_row(*row)
    console = Console()
    console.print(table)
    for event in ours.get("events") or []:
        console.print(f"  {decision_line(event)}", highlight=False)
    console.print(paths)

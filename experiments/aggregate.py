"""One comparison table (Markdown and CSV) and figures from a Hydra multirun sweep of ``lit_mpstable.train``.

    .venv/bin/python experiments/aggregate.py multirun/<date>/<time>              # writes into the sweep dir
    .venv/bin/python experiments/aggregate.py multirun/<date>/<time> --out DIR

A sweep directory holds one sub-directory per job (``0``, ``1``, ...), each with the run's ``summary.json`` and
``.hydra/overrides.yaml``; ``multirun.yaml`` (optional) gives the sweep command. Writes ``comparison.md``,
``comparison.csv``, ``loss_curves.png`` (train loss, 10-step mean, and validation loss per run) and
``loss_scale.png`` (loss-scale trajectories, skipped steps marked). A job without ``summary.json`` (failed or still
running) is listed with that status. Runs are labelled by the overrides that differ between them; the overrides
they share head the table.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the package without installing

from lit_mpstable.app.report import settle_step  # noqa: E402

__all__ = ["COLUMNS", "comparison_rows", "label_runs", "load_runs", "main", "sweep_command", "write_comparison"]

COLUMNS: tuple[tuple[str, str], ...] = (
    # (key, Markdown header); every key is also a CSV column
    ("job", "job"),
    ("label", "overrides"),
    ("status", "status"),
    ("precision", "precision"),
    ("model", "model"),
    ("steps", "steps"),
    ("steps_per_s", "steps/s"),
    ("effective_steps_per_s", "effective steps/s"),
    ("peak_memory_mib", "peak MiB"),
    ("final_train_loss", "final train loss"),
    ("val_loss", "val loss"),
    ("val_acc", "val acc"),
    ("loss_scale", "final scale"),
    ("settle_step", "settle step"),
    ("skipped_steps", "skipped"),
    ("overflow_rate", "overflow rate"),
    ("fallbacks", "fallbacks"),
    ("rollbacks", "rollbacks"),
)


def _job_order(path: Path) -> tuple[int, str]:
    return (int(path.name), "") if path.name.isdigit() else (sys.maxsize, path.name)


def load_runs(sweep_dir: Path) -> list[dict[str, Any]]:
    """One dict per job directory: ``job``, ``dir``, ``overrides`` (list of ``key=value``), ``summary`` (None when
    the job wrote none).

    Raises:
        FileNotFoundError: ``sweep_dir`` holds no job directory (no ``.hydra/overrides.yaml`` or ``summary.json``).
    """
    runs = []
    for path in sorted((p for p in Path(sweep_dir).iterdir() if p.is_dir()), key=_job_order):
        overrides_file, summary_file = path / ".hydra" / "overrides.yaml", path / "summary.json"
        if not overrides_file.exists() and not summary_file.exists():
            continue  # not a job (e.g. an --out directory inside the sweep)
        overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.exists() else []
        summary = json.loads(summary_file.read_text()) if summary_file.exists() else None
        runs.append({"job": path.name, "dir": path, "overrides": [str(o) for o in overrides or []], "summary": summary})
    if not runs:
        raise FileNotFoundError(
            f"aggregate: {sweep_dir} holds no job directories (sub-directories with summary.json or"
            " .hydra/overrides.yaml); pass the directory of a multirun, e.g. multirun/<date>/<time>."
        )
    return runs


def label_runs(runs: Sequence[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """Per run, its overrides that not every run shares (``" "``-joined, in the run's order); and the shared ones."""
    shared = [o for o in runs[0]["overrides"] if all(o in r["overrides"] for r in runs)]
    labels = [" ".join(o for o in r["overrides"] if o not in shared) or f"job {r['job']}" for r in runs]
    return labels, shared


def comparison_rows(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table's rows as plain values (None where a run did not measure something), one per run."""
    labels, _ = label_runs(runs)
    rows = []
    for run, label in zip(runs, labels):
        s = run["summary"]
        row: dict[str, Any] = {key: None for key, _ in COLUMNS}
        row.update(job=run["job"], label=label, overrides=" ".join(run["overrides"]))
        if s is None:
            row["status"] = "no summary.json"
            rows.append(row)
            continue
        row.update({key: s.get(key) for key, _ in COLUMNS if key in s and key not in ("label", "overrides")})
        steps = s.get("steps") or 0
        skipped = s.get("skipped_steps") or 0
        final = s.get("final_train_loss")
        row["status"] = "ok" if final is not None and math.isfinite(final) else "non-finite loss"
        if s.get("steps_per_s") is not None and steps:
            row["effective_steps_per_s"] = s["steps_per_s"] * (steps - skipped) / steps
        row["settle_step"] = settle_step(s.get("loss_scale_trajectory") or [])
        rows.append(row)
    return rows


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.3g}" if abs(value) >= 1e4 or (value != 0 and abs(value) < 1e-3) else f"{value:.4g}"
    return str(value)


def sweep_command(sweep_dir: Path) -> str | None:
    """The ``python -m lit_mpstable.train -m ...`` command of the sweep, from its ``multirun.yaml``."""
    path = Path(sweep_dir) / "multirun.yaml"
    if not path.exists():
        return None
    overrides = (yaml.safe_load(path.read_text()) or {}).get("hydra", {}).get("overrides", {})
    # hydra.mode is implied by -m; an absolute sweep dir is this machine's own (a relative one is kept).
    hydra = [o for o in overrides.get("hydra", [])
             if not o.startswith("hydra.mode=") and not o.startswith("hydra.sweep.dir=/")]
    return " ".join(["python -m lit_mpstable.train -m", *hydra, *overrides.get("task", [])])


def write_comparison(runs: Sequence[dict[str, Any]], out_dir: Path, *, sweep_dir: Path | None = None,
                     command: str | None = None) -> dict[str, Path]:
    """``comparison.md``, ``comparison.csv``, ``loss_curves.png`` and ``loss_scale.png`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = comparison_rows(runs)
    _, shared = label_runs(runs)
    with (out_dir / "comparison.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[key for key, _ in COLUMNS] + ["overrides"])
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in row.items()} for row in rows)
    header = [title for _, title in COLUMNS]
    table = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    table += ["| " + " | ".join(_cell(row[key]) for key, _ in COLUMNS) + " |" for row in rows]
    figures = {"loss_curves.png": _plot_losses(runs, out_dir / "loss_curves.png"),
               "loss_scale.png": _plot_scales(runs, out_dir / "loss_scale.png")}
    lines = [f"# Sweep comparison: {len(runs)} runs", ""]
    if sweep_dir is not None:
        lines += [f"Sweep: `{_shown(sweep_dir)}`", ""]
    if sweep := (sweep_command(sweep_dir) if sweep_dir is not None else None):
        lines += [f"Sweep command: `{sweep}`", ""]
    if shared:
        lines += ["Shared overrides: " + " ".join(f"`{o}`" for o in shared), ""]
    lines += table + [""]
    lines += [
        "steps/s: optimizer steps per second of the whole fit (validation included; parallel jobs share the",
        "machine, so compare speed only between runs made alike). effective steps/s: steps/s x applied / all",
        "steps. settle step: first step from which the loss scale stays within 2x of its final value",
        "(`lit_mpstable.app.report.settle_step`). overflow rate: overflowing / all optimizer steps.", "",
    ]
    lines += [f"![{name}]({name})" for name, made in figures.items() if made] + [""]
    if command:
        lines += [f"Reproduce this table: `{command}`", ""]
    (out_dir / "comparison.md").write_text("\n".join(lines))
    return {"md": out_dir / "comparison.md", "csv": out_dir / "comparison.csv",
            **{name: out_dir / name for name, made in figures.items() if made}}


def _shown(path: Path) -> Path:
    """``path`` relative to the repository root when it lies inside it (no absolute paths in shared results)."""
    path = Path(path).resolve()
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _smooth(values: Sequence[float], n: int = 10) -> list[float]:
    """Trailing mean over the finite values among the last ``n`` (NaN where there are none)."""
    out = []
    for i in range(len(values)):
        window = [v for v in values[max(0, i - n + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(window) / len(window) if window else math.nan)
    return out


def _plot_losses(runs: Sequence[dict[str, Any]], path: Path) -> bool:
    plt = _pyplot()
    labels, _ = label_runs(runs)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    drawn, values = False, []
    for run, label in zip(runs, labels):
        s = run["summary"] or {}
        curve = [v if v is not None and math.isfinite(v) else math.nan for v in s.get("train_loss_curve") or []]
        if not curve:
            continue
        (line,) = ax.plot(range(1, len(curve) + 1), _smooth(curve), lw=1.3, label=label)
        val = s.get("val_loss_curve") or []
        if val:
            ax.plot([p[0] for p in val], [p[1] for p in val], "o--", ms=3, lw=0.8, color=line.get_color())
        values += [v for v in curve + [p[1] for p in val] if math.isfinite(v)]
        drawn = True
    if drawn:
        if values and min(values) > 0 and max(values) / min(values) > 50:  # orders of magnitude apart
            ax.set_yscale("log")
        ax.set(xlabel="optimizer step", ylabel="loss", title="Train loss (10-step mean, lines) and val loss (dots)")
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def _plot_scales(runs: Sequence[dict[str, Any]], path: Path) -> bool:
    plt = _pyplot()
    labels, _ = label_runs(runs)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    drawn = False
    for run, label in zip(runs, labels):
        s = run["summary"] or {}
        scales = [math.log2(v) if v and v > 0 else math.nan for v in s.get("loss_scale_trajectory") or []]
        if not scales:
            continue
        (line,) = ax.plot(range(1, len(scales) + 1), scales, lw=1.3, label=label)
        bad = [i for i, flag in enumerate(s.get("skipped_trajectory") or []) if flag]
        if bad:
            ax.scatter([i + 1 for i in bad], [scales[i] for i in bad], marker="v", s=14, color=line.get_color())
        drawn = True
    if drawn:
        ax.set(xlabel="optimizer step", ylabel="log2(loss scale)", title="Loss scale (skipped steps marked)")
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def main(argv: Sequence[str] | None = None) -> dict[str, Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a multirun directory, e.g. multirun/<date>/<time>")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: the sweep directory)")
    args = parser.parse_args(argv)
    runs = load_runs(args.sweep_dir)
    command = f"python experiments/aggregate.py {_shown(args.sweep_dir)}"
    command += f" --out {_shown(args.out)}" if args.out else ""
    paths = write_comparison(runs, args.out or args.sweep_dir, sweep_dir=args.sweep_dir, command=command)
    print(paths["md"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return paths


if __name__ == "__main__":
    main()

"""Paired per-round ratios from bench_precision.py's JSON that its tables do not show: StablePrecision over Lightning on
the GPT and the tiny MLP (bf16-mixed), and Kahan weights over Lightning's bf16-true on the MLP, with the extra time per
step (the fixed cost). Each run's time is the median of its kept steps; ratios and deltas are medians over rounds.

    .venv/bin/python bench/precision_pairs.py bench/results [more result folders...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def _runs(config: dict, key: str, drop: int) -> list[float]:
    return [statistics.median(run[drop:]) for run in config[key]]


def summary(folder: Path) -> str:
    data = json.loads((folder / "precision.json").read_text())
    mlp, gpt = data["suites"]["policy-mlp"], data["suites"]["gpt"]
    base, ours, base_true, kahan = (_runs(mlp[name], "run_step_us", 10) for name in (
        "mlp/L-bf16-mixed", "mlp/SP-bf16-mixed", "mlp/L-bf16-true", "mlp/SP-bf16-true-kahan"))
    gpt_base, gpt_ours = (_runs(gpt[name], "run_step_ms", 2) for name in ("L-bf16-mixed", "SP-bf16-mixed"))

    def ratio(a: list[float], b: list[float]) -> float:
        return statistics.median(x / y for x, y in zip(a, b))

    def extra(a: list[float], b: list[float]) -> float:
        return statistics.median(y - x for x, y in zip(a, b))

    return (f"{folder}: GPT SP/L {ratio(gpt_base, gpt_ours):.3f} | MLP SP/L {ratio(base, ours):.3f}"
            f" (+{extra(base, ours):.0f} us on {statistics.median(base):.0f} us) | Kahan/L-bf16-true"
            f" {ratio(base_true, kahan):.3f} (+{extra(base_true, kahan):.0f} us on"
            f" {statistics.median(base_true):.0f} us)")


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["bench/results"]:
        print(summary(Path(arg)))

"""bench/bench_callbacks.py runs end to end on a few steps and writes its table and JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_callbacks.py"


@pytest.mark.slow  # ~3.5 s: two short GPT fits
def test_bench_callbacks_smoke(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_callbacks", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.CONFIGS = {name: bench.CONFIGS[name] for name in ("none", "all four")}  # this module's copy only
    result = bench.main(["--repeats", "1", "--steps", "3", "--warmup", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "callbacks.json").read_text())
    assert [row["config"] for row in saved["rows"]] == ["none", "all four"] == [r["config"] for r in result["rows"]]
    assert saved["rows"][1]["hook_ms_per_step"] > 0 and len(saved["preflight_s"]) == 1
    assert (tmp_path / "callbacks.md").read_text().startswith("# bench_callbacks results")


@pytest.mark.slow  # ~3 s: three short MLP fits
def test_bench_callbacks_mlp_smoke(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_callbacks", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--workload", "mlp", "--rounds", "1", "--repeats", "1", "--steps", "60", "--warmup", "5",
                         "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "mlp_stack.json").read_text())
    assert [row["tree"] for row in saved["rows"]] == ["this"] == [row["tree"] for row in result["rows"]]
    assert saved["rows"][0]["runs"] == 1 and saved["rows"][0]["lightning_us"] > 0
    assert len(saved["rounds"]["this"][0]["median_us"]["mlp/SP-bf16-mixed+cb"]) == 1
    assert (tmp_path / "mlp_stack.md").read_text().startswith("# The callbacks' per-step cost")

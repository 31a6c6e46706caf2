"""bench/bench_precision.py runs end to end on tiny sizes and writes the JSON it promises."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        module = importlib.import_module("bench_precision")
    finally:
        sys.path.remove(str(BENCH))
    common = importlib.import_module("common")
    tiny = common.GPTSize(vocab=64, d_model=32, nhead=2, nlayers=1, ffn=64, seq=16, batch=2)
    # Shrink the gpt suite for the test only; the registry itself is what the benchmark runs.
    original = module.SUITES["gpt"]
    module.SUITES["gpt"] = dataclasses.replace(original, workload=lambda steps: common.gpt_workload(tiny, steps))
    yield module
    module.SUITES["gpt"] = original


def test_one_lightning_and_one_raw_config_give_finite_timings_and_json(bench, tmp_path: Path) -> None:
    names = ["raw-fp32", "SP-bf16-mixed"]
    results = bench.run_benchmark(
        names, repeats=1, steps={"gpt": 2}, warmup={"gpt": 0}, memory=True, out=tmp_path, stem="smoke",
        log=lambda _: None,
    )
    saved = json.loads((tmp_path / "smoke.json").read_text())
    assert set(saved) == {"meta", "suites", "checks"}
    assert (tmp_path / "smoke.md").read_text().startswith("# bench_precision results")
    configs = saved["suites"]["gpt"]
    assert list(configs) == names
    for name in names:
        entry = configs[name]
        assert {"step_ms", "steps_per_s", "tokens_per_s", "final_loss", "vs", "peak_mib", "run_step_ms"} <= set(entry)
        assert len(entry["run_step_ms"]) == 1 and len(entry["run_step_ms"][0]) == 2
        assert all(math.isfinite(t) and t > 0 for t in entry["run_step_ms"][0])
        assert math.isfinite(entry["final_loss"]["median"])
        assert entry["peak_mib"] > 0
        assert entry["threads"] == [1]  # conftest pins one thread; Lightning must not change it
    ratio = configs["SP-bf16-mixed"]["vs"]["raw-fp32"]["throughput_ratio"]["median"]
    assert math.isfinite(ratio) and ratio > 0
    assert results["suites"]["gpt"]["raw-fp32"]["final_loss"] == saved["suites"]["gpt"]["raw-fp32"]["final_loss"]


def test_registry_names_each_config_once_with_a_known_suite(bench) -> None:
    assert {"raw-fp32", "raw-bf16-autocast", "L-32-true", "L-bf16-mixed", "SP-bf16-mixed", "SP-bf16-mixed+cb"} <= set(
        bench.CONFIGS
    )
    assert all(config.suite in bench.SUITES for config in bench.CONFIGS.values())
    with pytest.raises(ValueError, match="exists already"):
        bench.register(bench.CONFIGS["raw-fp32"])

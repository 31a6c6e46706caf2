"""bench/bench_fabric.py runs end to end on a tiny GPT and writes the table and JSON it promises."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_fabric.py"


def test_bench_fabric_smoke(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_fabric", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tiny = bench.SDPAGPTSize(vocab=32, d_model=32, n_layers=1, n_heads=2, seq=16, batch=2)
    names = ["fabric-bf16-mixed", "SP-bf16-mixed"]
    result = bench.run_benchmark(names, repeats=2, steps=3, warmup=1, baseline=names[0], size=tiny,
                                 log=lambda _: None)
    bench.write(result, tmp_path, "smoke")
    saved = json.loads((tmp_path / "smoke.json").read_text())
    assert list(saved["rows"]) == names and saved["meta"]["size"]["d_model"] == 32
    for row in saved["rows"].values():
        assert len(row["runs"]) == 2 and row["cpu_ms"]["median"] > 0
    check = saved["checks"]["SP-bf16-mixed"]
    assert check["vs"] == "fabric-bf16-mixed" and check["ratio_cpu"] > 0
    assert check["same_losses"]  # clean bf16-mixed steps are bit-identical to Fabric's own plugin
    assert (tmp_path / "smoke.md").read_text().startswith("# bench_fabric results")

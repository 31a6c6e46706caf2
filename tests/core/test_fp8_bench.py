"""bench/gpu_fp8.py imports and parses its arguments without a GPU, and swaps each backend in through the seam."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from fp8_stand_ins import install_transformer_engine

from lit_mpstable.fp8.backends import backend_of

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_fp8.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_fp8", BENCH)
    assert spec is not None and spec.loader is not None  # BENCH is a .py file path: a source loader finds it
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_it_says_why_and_exits_0(bench, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu_fp8.json"
    assert bench.main(["--quick", "--parts", "gemm", "model", "--out", str(out)]) == 0
    assert "skipped: CUDA is not available" in capsys.readouterr().out and not out.exists()


def test_run_names_and_parts_are_checked(bench) -> None:
    parser = bench.build_parser()
    args = parser.parse_args(["--runs", "bf16", "delayed", "native:current", "torchao:mxfp8", "te:current"])
    assert [bench._config(run) is None for run in args.runs] == [True, False, False, False, False]
    assert args.parts == bench.PARTS and set(bench.PARTS) == {"gemm", "linear", "check", "model"}
    assert bench._config("torchao:mxfp8").format == "e4m3"
    assert bench._config("te:current").backend == "transformer_engine"
    for bad in (["--runs", "te:fp4"], ["--runs", "apex:delayed"], ["--parts", "everything"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


@pytest.mark.parametrize("run", ["delayed", "te:delayed", "torchao:current"])
def test_each_backend_is_swapped_in_through_the_seam(bench, run: str, monkeypatch) -> None:
    if run.startswith("torchao"):
        pytest.importorskip("torchao.float8")
    te = install_transformer_engine(monkeypatch)
    model = bench.GPT(vocab=64, d=32, layers=1, heads=2, context=8)
    names, context = bench.swap(model, run)
    assert names == ["blocks.0.proj", "blocks.0.fc", "blocks.0.out"]  # not the first (qkv) nor the last (head)
    expected = {"delayed": "native", "te:delayed": "transformer_engine", "torchao:current": "torchao"}[run]
    backends = [backend_of(model.get_submodule(name)) for name in names]
    assert all(backend is not None and backend.name == expected for backend in backends)
    if run == "te:delayed":
        with context():
            model(torch.randint(64, (2, 8)))
        assert len(te.forwards) == 3
    with pytest.raises(ValueError, match="torchao removed delayed scaling"):
        bench.swap(bench.GPT(vocab=64, d=32, layers=1, heads=2, context=8), "torchao:delayed")

"""FP8 GEMMs on the CPU: ``torch._scaled_mm`` against the emulation ``fp8_mm`` takes when ``use_scaled_mm=False``.

    PYTHONPATH=. .venv/bin/python bench/bench_fp8_cpu_gemm.py [--rounds 5]

Both compute ``(a * sa) @ (b * sb).T`` from the same FP8 operands (the FP8 x scale products are exact, the sum is
fp32); this prints their largest difference and times them alternately (CPU time, one thread), per operand pair,
shape and output dtype. ``FP8Config(emulate=None)`` picks the emulation on a CPU (``scaled_mm_preferred``) from these
numbers: on an Intel Xeon with AMX, torch 2.13's CPU kernel is as fast as the emulation for an E5M2 x E4M3 pair and
hundreds to thousands of times slower for two operands of one format (``results/fp8_cpu_gemm.md``; the CPU's flags are
printed: other CPUs may differ).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import cpu_flags  # noqa: E402
from lit_mpstable.fp8.gemm import fp8_mm  # noqa: E402

SHAPES = [(64, 64, 64), (256, 16, 64), (4096, 32, 128), (1024, 256, 256)]
# The forward GEMM (and every GEMM of format="e4m3") pairs two E4M3 operands; the hybrid backward pairs E5M2 x E4M3.
PAIRS = [
    (torch.float8_e4m3fn, torch.float8_e4m3fn),
    (torch.float8_e5m2, torch.float8_e4m3fn),
    (torch.float8_e5m2, torch.float8_e5m2),
]


def _time(fn, rounds: int) -> float:
    start = time.process_time()
    for _ in range(rounds):
        fn()
    return (time.process_time() - start) / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; CPU flags: {cpu_flags()}")
    print("| operands | M x K x N | out | _scaled_mm (ms) | emulated (ms) | ratio (median of rounds) | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for (a_dtype, b_dtype), (m, k, n), out in itertools.product(PAIRS, SHAPES, (torch.float32, torch.bfloat16)):
        a = torch.randn(m, k, generator=gen).to(a_dtype)
        b_t = torch.randn(n, k, generator=gen).to(b_dtype)
        sa, sb = torch.tensor(0.5), torch.tensor(0.25)
        fast = fp8_mm(a, b_t, sa, sb, out_dtype=out, use_scaled_mm=True)
        emul = fp8_mm(a, b_t, sa, sb, out_dtype=out, use_scaled_mm=False)
        diff = float((fast.float() - emul.float()).abs().max())
        pairs = []
        for _ in range(args.rounds):  # alternate the two in each round
            t_fast = _time(lambda: fp8_mm(a, b_t, sa, sb, out_dtype=out, use_scaled_mm=True), 1)
            t_emul = _time(lambda: fp8_mm(a, b_t, sa, sb, out_dtype=out, use_scaled_mm=False), 3)
            pairs.append((t_fast, t_emul))
        t_fast = statistics.median(p[0] for p in pairs)
        t_emul = statistics.median(p[1] for p in pairs)
        ratio = statistics.median(p[0] / p[1] for p in pairs)
        pair = " x ".join(str(d).removeprefix("torch.float8_") for d in (a_dtype, b_dtype))
        print(
            f"| {pair} | {m} x {k} x {n} | {str(out).removeprefix('torch.')} | {t_fast * 1e3:.2f} |"
            f" {t_emul * 1e3:.3f} | {ratio:.0f}x | {diff:.3g} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

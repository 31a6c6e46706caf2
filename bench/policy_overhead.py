"""What the op policy's TorchFunctionMode costs, and what "auto" costs once: writes results/op_policy/overhead.md.

    .venv/bin/python bench/policy_overhead.py

Per intercepted torch call: a trivial op (torch.add on 4x4) with and without the mode (best of 5 x 50,000 calls).
Per forward: how many torch calls of a zoo.GPT forward pass through the mode. Once per run: the recorded first
step, and the micro-benchmark of ``op_policy="auto"`` at the start of the next forward, cold (nothing cached) and
cached (a later run).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from policy_workloads import SDPAGPTSize, sdpa_gpt_workload  # noqa: E402

from lit_mpstable.core.layout.policy import OpPolicy, _PolicyMode  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "op_policy" / "overhead.md"


class _Counting(_PolicyMode):
    calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        _Counting.calls += 1
        return super().__torch_function__(func, types, args, kwargs)


def main() -> None:
    torch.set_num_threads(1)
    a = torch.randn(4, 4)

    def per_call_us(n: int = 50_000) -> float:
        start = time.perf_counter()
        for _ in range(n):
            torch.add(a, a)
        return (time.perf_counter() - start) / n * 1e6

    plain = min(per_call_us() for _ in range(5))
    with _PolicyMode("cpu", {"attention": torch.float32}):
        moded = min(per_call_us() for _ in range(5))

    work = sdpa_gpt_workload(SDPAGPTSize(), 3)
    batch = next(iter(work.loader))
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), _Counting("cpu", {}):
        work.module.loss(batch)
    recorded, measured = [], []
    for _ in range(2):  # cold, then cached
        policy = OpPolicy("auto", dtype=torch.bfloat16)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), policy.context("cpu"):
            work.module.loss(batch).backward()
        recorded.append(time.perf_counter() - start)
        start = time.perf_counter()
        context = policy.context("cpu")  # the next forward starts by measuring and deciding
        measured.append(time.perf_counter() - start)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), context:
        start = time.perf_counter()
        work.module.loss(batch)
        later = time.perf_counter() - start
    overhead_ms = _Counting.calls * (moded - plain) / 1e3
    text = "\n".join([
        "# op_policy overhead (zoo.GPT, " + ", ".join(f"{k} {v}" for k, v in vars(SDPAGPTSize()).items()) + ")",
        "",
        f"- per intercepted torch call: {moded - plain:.2f} us ({plain:.2f} us -> {moded:.2f} us for torch.add 4x4)",
        f"- torch calls per forward through the mode: {_Counting.calls}, so {overhead_ms:.3f} ms per forward",
        f"- a forward under the decided policy: {later * 1e3:.1f} ms, of which the mode {overhead_ms:.3f} ms"
        f" ({100 * overhead_ms / 1e3 / later:.2f} %)",
        f"- op_policy='auto', once per run: the first step (forward recorded + backward) {recorded[0] * 1e3:.0f} ms;"
        f" measuring and deciding at the start of the next forward {measured[0] * 1e3:.0f} ms cold,"
        f" {measured[1] * 1e3:.0f} ms cached (a later run in the same process)",
        f"- decided: {policy.choices}",
        "- measured per forward (ms): " + ", ".join(
            f"{f} autocast {m.autocast_ms:.1f} / fp32 {m.fp32_ms:.1f}" for f, m in policy.measurements.items()),
        "",
        f"Command: `{' '.join(sys.argv)}`; torch {torch.__version__}, 1 thread,"
        f" {torch.backends.cpu.get_cpu_capability()}.",
    ])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

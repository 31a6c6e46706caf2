"""What op_policy="auto" buys against what it could, and what it costs in memory: results/op_policy/checks.{md,json}.

    .venv/bin/python bench/policy_checks.py            # ~5 min on 2 shared cores
    .venv/bin/python bench/policy_checks.py --quick    # smoke run

**Amdahl bound** (zoo.GPT, eager, Lightning): the step's time if every compute op (GEMM, attention) ran in its
faster precision and everything else stayed as in FP32::

    T_bound = T_fp32 - C_fp32 + C_best,   C_best = sum over compute ops of min(t_fp32, t_bf16)

``T_fp32`` is the median process CPU time of a ``Trainer(precision="32-true")`` step (runs alternating with the
others, warmup dropped). ``t_fp32`` and ``t_bf16`` are each compute op's own time (torch.profiler self time of
``aten::mm``/``addmm``/``bmm``/the SDPA forward and backward kernels, forward and backward), matched op by op in
execution order between an FP32 step and a BF16-autocast step of the same model and batch, medians over profiled
steps that alternate the two. The profiler's clock is wall time and it slows the small ops, so only ratios are
taken from it: the compute share ``s`` (compute ops' FP32 time over the profiled FP32 step's wall time) and the
best-per-op ratio ``r = sum t_fp32 / sum min(t_fp32, t_bf16)``; then ``C_fp32 = s * T_fp32``,
``C_best = C_fp32 / r``. ``op_policy="auto"``'s speed-up over FP32 is set against the bound's:
attainment = (T_fp32 / T_auto) / (T_fp32 / T_bound) = T_bound / T_auto, paired per round.

**Peak memory of the run**: the peak tensor memory (lit_mpstable.core.weights.memory.MemoryProbe) of every step of a
short run, the largest taken, for ``op_policy="auto"`` against Lightning's bf16-mixed: the measuring happens in the run
(its second step), so a measurement that needed more memory than a training step would show here.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from common import TRAINER_DEFAULTS, MemoryProbe, StepTimer, environment, fmt_iqr, markdown_table, summary  # noqa: E402
from policy_workloads import CNNSize, SDPAGPTSize, cnn_workload, sdpa_gpt_workload  # noqa: E402

from lit_mpstable import StablePrecision  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "op_policy"
COMPUTE_OPS = (
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::convolution_backward",
    "aten::mkldnn_convolution", "aten::_scaled_dot_product_attention_math",
)
CNN = CNNSize(channels=(16, 32, 64), batch=64)
CONFIGS = {
    "L-32-true": lambda: {"precision": "32-true"},
    "L-bf16-mixed": lambda: {"precision": "bf16-mixed"},
    "SP-bf16-mixed-auto": lambda: {"plugins": [StablePrecision("bf16-mixed", op_policy="auto")]},
}


def step_times(repeats: int, steps: int, warmup: int) -> dict[str, list[float]]:
    """Per config, the median CPU time of each run's kept steps; configs alternate (round r starts at config r)."""
    names, out = list(CONFIGS), {name: [] for name in CONFIGS}
    for r in range(repeats):
        for name in names[r % 3:] + names[:r % 3]:
            gc.collect()
            work, timer = sdpa_gpt_workload(SDPAGPTSize(), steps), StepTimer()
            pl.Trainer(max_steps=steps, callbacks=[timer], **TRAINER_DEFAULTS, **CONFIGS[name]()).fit(
                work.module, work.loader)
            out[name].append(statistics.median(timer.clock.cpu_s[warmup:]))
    return out


def compute_op_times(rounds: int) -> tuple[list[str], list[float], list[float], float]:
    """(op names, FP32 times, BF16 times, profiled FP32 step's wall time), seconds, per compute op instance."""
    work = sdpa_gpt_workload(SDPAGPTSize(), 2)
    module, batch = work.module, next(iter(work.loader))
    optimizer = module.configure_optimizers()

    def step(dtype: torch.dtype | None) -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype, cache_enabled=False) if dtype else nullcontext():
            loss = module.loss(batch)
        loss.backward()
        optimizer.step()

    per: dict[str, list[list[float]]] = {"fp32": [], "bf16": []}
    names: dict[str, list[str]] = {}
    totals: list[float] = []
    for _ in range(rounds):
        for key, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
            step(dtype)  # warm
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                started = time.perf_counter()
                step(dtype)
                wall = time.perf_counter() - started
            events = [e for e in prof.events() if e.name in COMPUTE_OPS]
            names[key] = [e.name for e in events]
            per[key].append([e.self_cpu_time_total / 1e6 for e in events])
            if key == "fp32":
                totals.append(wall)
    assert names["fp32"] == names["bf16"], "FP32 and BF16 steps ran different compute ops; cannot match them"
    fp32 = [statistics.median(run[i] for run in per["fp32"]) for i in range(len(names["fp32"]))]
    bf16 = [statistics.median(run[i] for run in per["bf16"]) for i in range(len(names["bf16"]))]
    return names["fp32"], fp32, bf16, statistics.median(totals)


class _PeakOverSteps(pl.Callback):
    def __init__(self) -> None:
        self.peaks: list[int] = []
        self._probe = MemoryProbe()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._probe.start(pl_module, trainer.optimizers)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._probe.stop()
        self.peaks.append(self._probe.peak_bytes)


def run_peaks(workload, steps: int = 4) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("L-bf16-mixed", "SP-bf16-mixed-auto"):
        work, probe = workload(steps), _PeakOverSteps()
        kwargs = CONFIGS[name]()
        pl.Trainer(max_steps=steps, callbacks=[probe], **TRAINER_DEFAULTS, **kwargs).fit(work.module, work.loader)
        out[name] = {"peak_mib_per_step": [p / 2**20 for p in probe.peaks], "peak_mib": max(probe.peaks) / 2**20}
        if "plugins" in kwargs:
            out[name]["choices"] = dict(kwargs["plugins"][0].policy.choices)
    out["ratio"] = out["SP-bf16-mixed-auto"]["peak_mib"] / out["L-bf16-mixed"]["peak_mib"]
    return out


def _rounded(values: list[float]) -> list[float]:
    return [round(x, 1) for x in values]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import logging
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    repeats, steps, warmup, rounds = (3, 6, 3, 2) if args.quick else (12, 10, 3, 5)
    meta = environment()
    times = step_times(repeats, steps, warmup)
    ops, fp32, bf16, profiled_total = compute_op_times(rounds)
    share = sum(fp32) / profiled_total
    best_ratio = sum(fp32) / sum(min(a, b) for a, b in zip(fp32, bf16))

    def bound_of(t32: float) -> float:
        return t32 * (1 - share + share / best_ratio)

    t32 = statistics.median(times["L-32-true"])
    c32, best, bound = share * t32, share * t32 / best_ratio, bound_of(t32)
    auto_ratio = summary([a / b for a, b in zip(times["L-32-true"], times["SP-bf16-mixed-auto"])])  # paired per round
    lightning_ratio = summary([a / b for a, b in zip(times["L-32-true"], times["L-bf16-mixed"])])
    attainment = summary([bound_of(a) / b for a, b in zip(times["L-32-true"], times["SP-bf16-mixed-auto"])])
    per_kind: dict[str, list[float]] = {}
    for name, a, b in zip(ops, fp32, bf16):
        per_kind.setdefault(name, [0.0, 0.0, 0.0])
        per_kind[name][0] += a
        per_kind[name][1] += b
        per_kind[name][2] += min(a, b)
    peaks = {"cnn": run_peaks(lambda s: cnn_workload(CNN, s)),
             "gpt": run_peaks(lambda s: sdpa_gpt_workload(SDPAGPTSize(), s))}
    results = {
        "meta": {**meta, "loadavg_end": environment()["loadavg"], "repeats": repeats, "steps": steps, "warmup": warmup,
                 "profiled_rounds": rounds, "gpt": vars(SDPAGPTSize()), "cnn": vars(CNN)},
        "step_cpu_ms": {name: summary([t * 1e3 for t in v]) for name, v in times.items()},
        "bound": {"T_fp32_ms": t32 * 1e3, "C_fp32_ms": c32 * 1e3, "C_best_ms": best * 1e3,
                  "compute_share_of_fp32_step": share, "best_per_op_ratio": best_ratio,
                  "bound_speedup_over_fp32": t32 / bound, "profiled_fp32_step_ms": profiled_total * 1e3,
                  "per_op_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in per_kind.items()}},
        "auto_speedup_over_fp32": auto_ratio,
        "lightning_bf16_speedup_over_fp32": lightning_ratio,
        "attainment": attainment,
        "peaks": peaks,
        "checks": {
            "auto_reaches_0.98_of_bound": attainment["median"] >= 0.98,
            "cnn_auto_all_autocast": all(
                c == "autocast" for c in peaks["cnn"]["SP-bf16-mixed-auto"]["choices"].values()),
            "cnn_peak_ratio": peaks["cnn"]["ratio"],
            "gpt_peak_ratio": peaks["gpt"]["ratio"],
        },
    }
    b = results["bound"]
    lines = [
        "# op_policy='auto': the Amdahl bound and the run's peak memory",
        "",
        f"{meta['time']}: torch {meta['torch']}, {meta['cpu']} ({meta['cpu_count']} cores), 1 thread, load"
        f" {meta['loadavg']} -> {results['meta']['loadavg_end']}. Command: `{' '.join(sys.argv)}`. Method: the module"
        " docstring of bench/policy_checks.py.",
        "",
        f"## Amdahl bound (zoo.GPT {vars(SDPAGPTSize())}, eager, Lightning)",
        "",
        markdown_table(["config", "CPU ms/step (median [q1, q3] over runs)"],
                       [[k, fmt_iqr(v, 1)] for k, v in results["step_cpu_ms"].items()]),
        "",
        "Profiled compute ops (wall ms in a profiled step, summed per kind):",
        "",
        markdown_table(["compute op", "FP32 ms", "BF16 ms", "best ms"],
                       [[k, f"{v[0]:.1f}", f"{v[1]:.1f}", f"{v[2]:.1f}"] for k, v in b["per_op_ms"].items()]),
        "",
        f"- compute ops: {b['C_fp32_ms']:.1f} ms of a {b['T_fp32_ms']:.1f} ms FP32 step"
        f" ({100 * b['compute_share_of_fp32_step']:.0f} %); best per op {b['C_best_ms']:.1f} ms"
        f" (ratio {b['best_per_op_ratio']:.2f}x); bound {b['bound_speedup_over_fp32']:.2f}x FP32",
        f"- op_policy='auto': {fmt_iqr(auto_ratio, 3)}x FP32 (Lightning bf16-mixed: {fmt_iqr(lightning_ratio, 3)}x)",
        f"- attainment T_bound / T_auto: {fmt_iqr(attainment, 3)} (goal >= 0.98:"
        f" {'met' if results['checks']['auto_reaches_0.98_of_bound'] else 'NOT met'})",
        "",
        "## Peak tensor memory of the run (largest over its steps)",
        "",
        markdown_table(
            ["workload", "Lightning bf16-mixed MiB", "auto MiB", "auto / Lightning", "auto's choices"],
            [[k, f"{v['L-bf16-mixed']['peak_mib']:.1f}", f"{v['SP-bf16-mixed-auto']['peak_mib']:.1f}",
              f"{v['ratio']:.3f}", v["SP-bf16-mixed-auto"]["choices"]] for k, v in peaks.items()]),
        "",
        f"CNN: {vars(CNN)}; per step (MiB): Lightning {_rounded(peaks['cnn']['L-bf16-mixed']['peak_mib_per_step'])},"
        f" auto {_rounded(peaks['cnn']['SP-bf16-mixed-auto']['peak_mib_per_step'])} (step 1 measures).",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "checks_quick" if args.quick else "checks"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()

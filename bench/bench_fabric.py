"""What lit_mpstable.fabric.StablePrecision costs in a Fabric loop next to Fabric's own plugin in the same mode.

    .venv/bin/python bench/bench_fabric.py                   # ~3-4 min on 2 shared cores -> results/fabric/fabric.*
    .venv/bin/python bench/bench_fabric.py --quick           # smoke run, < 30 s -> results/fabric/fabric_quick.*
    .venv/bin/python bench/bench_fabric.py --configs fabric-bf16-true,SP-bf16-true --repeats 12

Workload: ``lit_mpstable.app.zoo.GPT`` (vocab 256, d_model 256, 4 layers, 4 heads, seq 128, batch 8; the gpt-sdpa
suite of bench_precision.py) on the harness's synthetic token stream, AdamW, a plain Fabric loop (forward,
cross-entropy in FP32, ``fabric.backward``, ``optimizer.step()``, ``zero_grad``) on the CPU, 1 thread.

Configs run round-robin (round r starts at config r), each run a freshly seeded model trained for ``steps``
steps; the first ``warmup`` steps are dropped. Per step: process CPU time (``time.process_time``, which leaves
out time spent waiting for a core) and wall time, from the end of one step to the end of the next. A run's
time is the median of its kept steps; the ratio to the baseline (``--baseline``) is paired per round, and the
table gives its median over rounds, with [first, third quartile]. Clean steps of ours and Fabric's own plugin
are bit-identical, so the final losses must agree: a check that both did the same work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, fmt_iqr, markdown_table, summary, token_windows  # noqa: E402
from policy_workloads import SDPAGPTSize  # noqa: E402

from lit_mpstable.app.zoo import GPT  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results" / "fabric"
GOAL = 1.02  # ours may take at most 2% more CPU time per step than Fabric's own plugin


def _fabric(precision: str, ours: bool) -> Any:
    from lightning.fabric import Fabric

    if not ours:
        return Fabric(accelerator="cpu", devices=1, precision=precision)
    from lit_mpstable.frontends.fabric import StablePrecision

    return Fabric(accelerator="cpu", devices=1, plugins=[StablePrecision(precision)])


CONFIGS: dict[str, Callable[[], Any]] = {
    "fabric-bf16-mixed": lambda: _fabric("bf16-mixed", ours=False),
    "SP-bf16-mixed": lambda: _fabric("bf16-mixed", ours=True),
    "fabric-bf16-true": lambda: _fabric("bf16-true", ours=False),
    "SP-bf16-true": lambda: _fabric("bf16-true", ours=True),  # FP32 master weights: more work, on purpose
    "fabric-32-true": lambda: _fabric("32-true", ours=False),
}
DEFAULT = ["fabric-bf16-mixed", "SP-bf16-mixed"]


def run_once(name: str, size: SDPAGPTSize, steps: int, warmup: int) -> dict[str, Any]:
    """One freshly seeded run; per-step CPU and wall times of the steps after ``warmup``, and the last loss."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric = CONFIGS[name]()
    x, y = token_windows(size.vocab, size.seq, steps * size.batch, seed=0)
    torch.manual_seed(0)
    model = GPT(size.vocab, size.d_model, size.n_layers, size.n_heads, size.seq)
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    cpu, wall = [], []
    last_cpu, last_wall = time.process_time(), time.perf_counter()
    for step in range(steps):
        batch = slice(step * size.batch, (step + 1) * size.batch)
        logits = model(x[batch])
        loss = F.cross_entropy(logits.float().reshape(-1, size.vocab), y[batch].reshape(-1))
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        now_cpu, now_wall = time.process_time(), time.perf_counter()
        if step >= warmup:
            cpu.append(now_cpu - last_cpu)
            wall.append(now_wall - last_wall)
        last_cpu, last_wall = now_cpu, now_wall
    return {"cpu_ms": 1e3 * statistics.median(cpu), "wall_ms": 1e3 * statistics.median(wall), "loss": loss.item()}


def run_benchmark(
    names: list[str], *, repeats: int, steps: int, warmup: int, baseline: str, size: SDPAGPTSize = SDPAGPTSize(),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            runs[name].append(run_once(name, size, steps, warmup))
        log(f"round {r + 1}/{repeats}: " + ", ".join(f"{n} {runs[n][-1]['cpu_ms']:.1f} ms" for n in names))
    rows = {}
    for name in names:
        rows[name] = {
            "cpu_ms": summary([run["cpu_ms"] for run in runs[name]]),
            "wall_ms": summary([run["wall_ms"] for run in runs[name]]),
            "losses": sorted({run["loss"] for run in runs[name]}),
            "runs": runs[name],
        }
        if baseline in runs:  # paired per round: both configs of a round saw the same machine load
            rows[name]["ratio_cpu"] = summary([a["cpu_ms"] / b["cpu_ms"] for a, b in zip(runs[name], runs[baseline])])
            rows[name]["best_run_ratio_cpu"] = rows[name]["cpu_ms"]["min"] / rows[baseline]["cpu_ms"]["min"]
    checks = {}
    ours = [n for n in names if n.startswith("SP-")]
    for name in ours:
        theirs = "fabric-" + name[3:]
        if theirs in rows:
            ratio = statistics.median(a["cpu_ms"] / b["cpu_ms"] for a, b in zip(runs[name], runs[theirs]))
            checks[name] = {"vs": theirs, "ratio_cpu": ratio, "goal": GOAL, "meets_goal": ratio <= GOAL,
                            "same_losses": rows[name]["losses"] == rows[theirs]["losses"]}
    return {"meta": {**environment(), "repeats": repeats, "steps": steps, "warmup": warmup, "baseline": baseline,
                     "size": vars(size) if hasattr(size, "__dict__") else size.__dict__},
            "rows": rows, "checks": checks}


def write(result: dict[str, Any], out: Path, stem: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    meta, baseline = result["meta"], result["meta"]["baseline"]
    table = markdown_table(
        ["config", "CPU ms/step", "wall ms/step", f"CPU time / {baseline}", "fastest-run ratio", "final loss"],
        [[name, fmt_iqr(row["cpu_ms"], 1), fmt_iqr(row["wall_ms"], 1),
          fmt_iqr(row.get("ratio_cpu"), 3), f"{row.get('best_run_ratio_cpu', float('nan')):.3f}",
          ", ".join(f"{loss:.6f}" for loss in row["losses"])] for name, row in result["rows"].items()],
    )
    checks = [f"- `{name}` vs `{c['vs']}`: {c['ratio_cpu']:.3f}x the CPU time per step (goal <= {c['goal']}x:"
              f" {'met' if c['meets_goal'] else 'NOT met'}); final losses"
              f" {'identical' if c['same_losses'] else 'DIFFER'}" for name, c in result["checks"].items()]
    text = "\n".join([
        "# bench_fabric results", "",
        f"`lit_mpstable.app.zoo.GPT` {meta['size']}, AdamW, a plain Fabric loop on the CPU ({meta['cpu']},"
        f" {meta['torch_threads']} thread); {meta['repeats']} rounds x {meta['steps']} steps ({meta['warmup']} warmup"
        f" dropped), configs round-robin. Medians [first, third quartile] over runs; ratios paired per round.",
        f"torch {meta['torch']}, lightning {meta['lightning']}, load average {meta['loadavg']}, {meta['time']}.", "",
        table, "", *checks, "",
        f"Reproduce: `{' '.join(['python', *meta['argv']])}`", "",
    ])
    (out / f"{stem}.md").write_text(text)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(DEFAULT), help=f"comma-separated, from {list(CONFIGS)}")
    parser.add_argument("--baseline", default="fabric-bf16-mixed")
    parser.add_argument("--repeats", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads; 0 keeps torch's default")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 4 steps -> fabric_quick.*")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; allowed: {list(CONFIGS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats, steps, warmup = (2, 4, 1) if args.quick else (args.repeats, args.steps, args.warmup)
    result = run_benchmark(names, repeats=repeats, steps=steps, warmup=warmup, baseline=args.baseline)
    write(result, args.out, "fabric_quick" if args.quick else "fabric")
    for name, check in result["checks"].items():
        print(f"{name}: {check['ratio_cpu']:.3f}x {check['vs']} (goal <= {GOAL}); same losses: {check['same_losses']}")
    return result


if __name__ == "__main__":
    main()

"""The per-step cost of Kahan weights (``master_weights="kahan"``) on the tiny MLP, where fixed costs dominate.

Two measurements:

- ``micro``: the weights' own step alone, on the BF16 parameters of bench_precision.py's tiny MLP (16-32-32-16, six
  tensors, AdamW): torch's AdamW step (what Lightning's ``bf16-true`` runs; ``foreach=False``, the CPU default)
  against ``CompactWeights.step_`` (``"kahan"``) and the keeper's whole part of a step (``unscale_`` ... ``end_step_``,
  no checker). Thread CPU time per step, alternating rounds, median and paired ratio; then, per step, the torch ops
  (``torch.profiler``'s ``aten::`` events; the fused C loop is no torch op) and the Python calls (``cProfile``).
- ``pair``: ``mlp/SP-bf16-true-kahan`` against ``mlp/L-bf16-true`` of bench_precision.py, process CPU time per step,
  for each source tree given (``--trees``, e.g. the baseline checkout and this one): each round runs one worker
  process per tree (the order alternating), and each worker runs both configs ``--runs`` times, alternating. The
  ratio is paired per run; the fixed cost is the difference of the medians.

    PYTHONPATH=. .venv/bin/python bench/bench_kahan_step.py micro --rounds 30
    PYTHONPATH=. .venv/bin/python bench/bench_kahan_step.py pair --trees /work/main,. --rounds 4
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import MLPSize, cpu_flags, environment, fmt_iqr, markdown_table, summary  # noqa: E402

PAIR = ("mlp/L-bf16-true", "mlp/SP-bf16-true-kahan")
OUT = Path(__file__).parent / "results"


# ------------------------------------------------------------------------------------------------------ micro
def _model(seed: int = 0) -> nn.Module:
    size = MLPSize()
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(size.d_in, size.hidden), nn.ReLU(), nn.Linear(size.hidden, size.hidden), nn.ReLU(),
        nn.Linear(size.hidden, size.d_out),
    ).bfloat16()


def _grads(model: nn.Module, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(p.shape, generator=g) * 1e-2).bfloat16() for p in model.parameters()]


def micro_steps() -> dict[str, tuple[Callable[[], None], Callable[[], object]]]:
    """Per config: (set the gradients, one step)."""
    from lit_mpstable.core.weights.compact import CompactWeights

    out: dict[str, tuple[Callable[[], None], Callable[[], object]]] = {}

    def setter(model: nn.Module, grads: list[torch.Tensor]) -> Callable[[], None]:
        params = list(model.parameters())

        def set_grads() -> None:
            for p, g in zip(params, grads):
                p.grad = g

        return set_grads

    model = _model()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    out["torch AdamW (bf16)"] = (setter(model, _grads(model)), adamw.step)

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compact = CompactWeights(model, [opt], "kahan", seed=1)
    out["CompactWeights.step_ kahan"] = (setter(model, _grads(model)), lambda: compact.step_(opt))

    model = _model()
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    keeper = CompactWeights(model, [opt2], "kahan", seed=1)

    def keeper_step() -> object:
        keeper.unscale_(opt2, None, None, "cpu")
        keeper.grads(opt2, absorb=True)
        return keeper.end_step_(opt2, None, {})

    out["keeper unscale_..end_step_ kahan"] = (setter(model, _grads(model)), keeper_step)
    return out


def micro(rounds: int, steps: int) -> dict[str, Any]:
    configs = micro_steps()
    names = list(configs)
    for set_grads, step in configs.values():  # build the C loop, first touch
        for _ in range(5):
            set_grads()
            step()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            set_grads, step = configs[name]
            total = 0.0
            for _ in range(steps):
                set_grads()
                start = time.thread_time()
                step()
                total += time.thread_time() - start
            times[name].append(total / steps)
    base = names[0]
    result: dict[str, Any] = {"rounds": rounds, "steps": steps, "configs": {}}
    for name in names:
        set_grads, step = configs[name]
        result["configs"][name] = {
            "us": summary([t * 1e6 for t in times[name]]),
            "x_adamw": summary([a / b for a, b in zip(times[name], times[base])]),
            "minus_adamw_us": summary([(a - b) * 1e6 for a, b in zip(times[name], times[base])]),
            "torch_ops": torch_ops(set_grads, step),
            "python_calls": python_calls(set_grads, step),
        }
    return result


def torch_ops(set_grads: Callable[[], None], step: Callable[[], object], n: int = 10) -> dict[str, float]:
    """``aten::`` operator calls per step (top-level and nested), by name, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            set_grads()
            step()
    counts: dict[str, float] = {}
    for event in prof.events():
        if event.name.startswith("aten::"):
            counts[event.name] = counts.get(event.name, 0) + 1 / n
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def python_calls(set_grads: Callable[[], None], step: Callable[[], object], n: int = 20) -> float:
    """Python function calls (cProfile's, C functions included) per step."""
    profiler = cProfile.Profile()
    for _ in range(n):
        set_grads()
        profiler.enable()
        step()
        profiler.disable()
    return pstats.Stats(profiler).total_calls / n  # type: ignore[attr-defined]


def micro_markdown(result: dict[str, Any]) -> str:
    rows = []
    for name, entry in result["configs"].items():
        ops = entry["torch_ops"]
        top = ", ".join(f"{k[6:]} {v:g}" for k, v in list(ops.items())[:6])
        rows.append([name, fmt_iqr(entry["us"], 1), fmt_iqr(entry["x_adamw"]), fmt_iqr(entry["minus_adamw_us"], 1),
                     f"{sum(ops.values()):g}", f"{entry['python_calls']:g}", top])
    header = ["config", "us per step", "time x torch AdamW", "- torch AdamW (us)", "torch ops", "Python calls",
              "most frequent ops"]
    return markdown_table(header, rows)


# ------------------------------------------------------------------------------------------------------- pair
def worker(runs: int, steps: int, warmup: int) -> dict[str, Any]:
    """Both configs of :data:`PAIR`, ``runs`` times each, alternating; per run the median process CPU time of the
    kept steps (seconds)."""
    import logging
    import warnings

    import bench_precision as bp

    import lit_mpstable

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    suite = bp.SUITES[bp.CONFIGS[PAIR[0]].suite]
    for name in PAIR:  # imports, the C loop's build, first-run caches
        bp.run_once(bp.CONFIGS[name], suite, warmup + 2)
    cpu: dict[str, list[float]] = {name: [] for name in PAIR}
    for r in range(runs):
        for name in PAIR if r % 2 == 0 else PAIR[::-1]:
            run = bp.run_once(bp.CONFIGS[name], suite, steps)
            cpu[name].append(statistics.median(run.cpu_s[warmup:]))
    return {"package": lit_mpstable.__file__, "cpu_s": cpu}


def pair(trees: list[str], rounds: int, runs: int, steps: int, warmup: int) -> dict[str, Any]:
    per_tree: dict[str, dict[str, list[float]]] = {t: {name: [] for name in PAIR} for t in trees}
    packages: dict[str, str] = {}
    for r in range(rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()), PYTHONDONTWRITEBYTECODE="1")
            done = subprocess.run(
                [sys.executable, __file__, "worker", "--runs", str(runs), "--steps", str(steps), "--warmup",
                 str(warmup)], env=env, capture_output=True, text=True, check=True,
            )
            answer = json.loads(done.stdout.strip().splitlines()[-1])
            packages[tree] = answer["package"]
            for name in PAIR:
                per_tree[tree][name] += answer["cpu_s"][name]
        print(f"  round {r + 1}/{rounds} done", file=sys.stderr)
    out: dict[str, Any] = {"rounds": rounds, "runs": runs, "steps": steps, "warmup": warmup, "trees": {}}
    base, kahan = PAIR
    for tree in trees:
        a, b = per_tree[tree][base], per_tree[tree][kahan]
        out["trees"][tree] = {
            "package": packages[tree],
            base: summary([t * 1e6 for t in a]),
            kahan: summary([t * 1e6 for t in b]),
            "throughput_ratio": summary([x / y for x, y in zip(a, b)]),
            "extra_us": summary([(y - x) * 1e6 for x, y in zip(a, b)]),
            "cpu_s": per_tree[tree],
        }
    if len(trees) == 2:
        first, second = (per_tree[t][kahan] for t in trees)
        out["kahan_second_vs_first"] = summary([x / y for x, y in zip(first, second)])
    return out


def pair_markdown(result: dict[str, Any]) -> str:
    base, kahan = PAIR
    rows = [[tree, f"`{entry['package']}`", fmt_iqr(entry[base], 1), fmt_iqr(entry[kahan], 1),
             fmt_iqr(entry["throughput_ratio"]), fmt_iqr(entry["extra_us"], 1)]
            for tree, entry in result["trees"].items()]
    return markdown_table(["tree", "package", f"{base} us", f"{kahan} us", "Kahan throughput x L-bf16-true",
                           "Kahan extra us/step"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("micro", "pair", "worker"))
    parser.add_argument("--rounds", type=int, default=None, help="micro: 30; pair: 4")
    parser.add_argument("--steps", type=int, default=None, help="micro: steps per round (50); pair: per run (80)")
    parser.add_argument("--runs", type=int, default=3, help="pair: runs of each config per worker")
    parser.add_argument("--warmup", type=int, default=10, help="pair: steps dropped per run")
    parser.add_argument("--trees", default=".", help="pair: comma-separated source trees (PYTHONPATH of the workers)")
    parser.add_argument("--out", type=Path, default=None, help="write <out>.md and <out>.json")
    args = parser.parse_args()
    if args.what == "worker":
        print(json.dumps(worker(args.runs, args.steps or 80, args.warmup)))
        return
    env = environment()
    head = (f"torch {env['torch']}, CPU: {env['cpu']}; flags: {cpu_flags()}; load average: {env['loadavg']}; "
            f"command: `{' '.join(sys.argv)}`")
    if args.what == "micro":
        torch.set_num_threads(1)
        result = micro(args.rounds or 30, args.steps or 50)
        text = micro_markdown(result)
    else:
        result = pair(args.trees.split(","), args.rounds or 4, args.runs, args.steps or 80, args.warmup)
        text = pair_markdown(result)
        if "kahan_second_vs_first" in result:
            ratio = fmt_iqr(result["kahan_second_vs_first"])
            text += f"\n\nKahan throughput, second tree x first (paired per run): {ratio}"
    text = f"{head}\n\n{text}\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"env": env, "flags": cpu_flags(), **result}, indent=1))


if __name__ == "__main__":
    main()

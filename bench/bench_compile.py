"""StablePrecision on a compiled model: what it costs next to Lightning's bf16-mixed, both compiled, what
op_policy="auto" buys there, and FP8 compiled against eager (on the CPU: numbers only). One run, configs alternating.

    .venv/bin/python bench/bench_compile.py                    # ~10-15 min on 2 shared cores, inductor compiles
    .venv/bin/python bench/bench_compile.py --quick            # smoke run -> results/compile/compile_quick.*
    .venv/bin/python bench/bench_compile.py --configs compiled/L-bf16-mixed,compiled/SP-bf16-mixed --repeats 12

The model is ``lit_mpstable.app.zoo.GPT`` (the ``gpt-sdpa`` workload of ``bench_precision.py``). "Compiled" is what
``Trainer.fit(torch.compile(module))`` does (Lightning unwraps the OptimizedModule and compiles ``forward`` and
``training_step``), applied by a callback so that compiling is part of the config; each config compiles once per
process (inductor, default options) and later runs reuse the graphs. The first steps of a run (compilation, the
recording step of ``op_policy="auto"``) are warmup and dropped. The harness, statistics and tables are
``bench_precision.py``'s: round-robin rounds, medians and quartiles over runs, ratios paired per round, wall and
process CPU time (the checks read CPU time, which other processes on a shared machine do not inflate).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from bench_precision import CONFIGS, SUITES, Config, Suite, _compact, _jsonable, _quiet, register, report, run_benchmark  # noqa: E402
from lightning.pytorch.utilities.compile import from_compiled  # noqa: E402
from policy_workloads import SDPAGPTSize, sdpa_gpt_workload  # noqa: E402

from lit_mpstable import StablePrecision  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "compile"


class Compile(pl.Callback):
    """``Trainer.fit(torch.compile(module))``, as a config: Lightning's own unwrapping (``from_compiled``) at setup,
    before the precision plugin converts the module, as ``fit`` does with an OptimizedModule."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from_compiled(torch.compile(pl_module))


def _trainer(plugin: StablePrecision | None, *, compiled: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"plugins": [plugin]} if plugin is not None else {"precision": "bf16-mixed"}
    return {**kwargs, "callbacks": [Compile()] if compiled else []}


SIZE = SDPAGPTSize()
SUITES["gpt-compile"] = Suite(
    name="gpt-compile",
    title="zoo.GPT compiled (torch.compile, inductor): StablePrecision and op_policy='auto' against Lightning's"
          " bf16-mixed",
    workload=lambda steps: sdpa_gpt_workload(SIZE, steps),
    steps=10,
    warmup=3,  # step 0 compiles (first run) or records (auto); step 1 decides and compiles for auto
    unit="ms",
    columns=("ratio:compiled/L-bf16-mixed", "ratio:eager/L-bf16-mixed"),
    size=vars(SIZE),
)
SUITES["fp8-compile"] = Suite(
    name="fp8-compile",
    title="zoo.GPT, StablePrecision('bf16-mixed', fp8=...), native FP8 layers: compiled against eager (CPU: emulated"
          " or torch._scaled_mm's CPU kernel, numbers only)",
    workload=lambda steps: sdpa_gpt_workload(SIZE, steps),
    steps=6,
    warmup=2,
    unit="ms",
    columns=("ratio:fp8/eager-delayed", "ratio:fp8/compiled-delayed"),
    size=vars(SIZE),
)

register(Config("eager/L-bf16-mixed", "gpt-compile", 'Trainer(precision="bf16-mixed"), eager',
                trainer=lambda: _trainer(None, compiled=False)))
register(Config("compiled/L-bf16-mixed", "gpt-compile", 'Trainer(precision="bf16-mixed"), compiled',
                trainer=lambda: _trainer(None, compiled=True)))
register(Config("compiled/SP-bf16-mixed", "gpt-compile", 'StablePrecision("bf16-mixed"), compiled',
                trainer=lambda: _trainer(StablePrecision("bf16-mixed"), compiled=True)))
register(Config("compiled/SP-bf16-mixed-auto", "gpt-compile",
                'StablePrecision("bf16-mixed", op_policy="auto"), compiled',
                trainer=lambda: _trainer(StablePrecision("bf16-mixed", op_policy="auto"), compiled=True)))
RECIPES = ("delayed", "current", "mxfp8")
for _recipe in RECIPES:
    for _compiled in (False, True):
        _name = f"fp8/{'compiled' if _compiled else 'eager'}-{_recipe}"
        _what = f'StablePrecision("bf16-mixed", fp8="{_recipe}"), {"compiled" if _compiled else "eager"}'
        register(Config(_name, "fp8-compile", _what, trainer=lambda r=_recipe, c=_compiled: _trainer(
            StablePrecision("bf16-mixed", fp8=r), compiled=c)))
NAMES = [name for name, config in CONFIGS.items() if config.suite in ("gpt-compile", "fp8-compile")]


def checks(suites: dict[str, Any]) -> dict[str, Any]:
    """The goals, on CPU time (and wall time for the record)."""
    out: dict[str, Any] = {}
    gpt = suites.get("gpt-compile", {})
    for clock in ("cpu", "wall"):
        def ratio(name: str, base: str) -> dict[str, float] | None:
            entry = gpt.get(name, {})
            v = (entry.get("cpu", {}) if clock == "cpu" else entry).get("vs", {}).get(base)
            return v["throughput_ratio"] if v else None

        if (r := ratio("compiled/SP-bf16-mixed", "compiled/L-bf16-mixed")) is not None:
            # time ratio = 1 / throughput ratio: StablePrecision's step at most 2 % longer than Lightning's
            out[f"compiled_stable_bf16_time_vs_lightning ({clock})"] = {
                "time_ratio": 1 / r["median"], "throughput_ratio": r, "goal": "time <= 1.02x",
                "met": 1 / r["median"] <= 1.02,
            }
        if (r := ratio("compiled/SP-bf16-mixed-auto", "compiled/L-bf16-mixed")) is not None:
            out[f"compiled_auto_speedup_vs_lightning_bf16 ({clock})"] = {
                "throughput_ratio": r, "goal": ">= 1.10", "met": r["median"] >= 1.10,
            }
        fp8 = suites.get("fp8-compile", {})
        for recipe in RECIPES:
            eager, compiled = fp8.get(f"fp8/eager-{recipe}"), fp8.get(f"fp8/compiled-{recipe}")
            if eager and compiled:
                e, c = (x["cpu"] if clock == "cpu" else x for x in (eager, compiled))
                out[f"fp8_{recipe}_compiled_speedup_over_eager ({clock})"] = {
                    "speedup": e["step_ms"]["median"] / c["step_ms"]["median"], "goal": "numbers only (CPU)",
                }
    return out


QUICK = {"repeats": 2, "steps": {"gpt-compile": 5, "fp8-compile": 4}, "warmup": {"gpt-compile": 3, "fp8-compile": 2}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 rounds of very short runs: a smoke test")
    parser.add_argument("--repeats", type=int, help="rounds over all configs (default 8; --quick: 2)")
    parser.add_argument("--configs", help=f"comma-separated config names (default all): {','.join(NAMES)}")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    _quiet()
    names = [name.strip() for name in args.configs.split(",")] if args.configs else NAMES
    quick = QUICK if args.quick else {}
    results = run_benchmark(
        names, repeats=args.repeats or (QUICK["repeats"] if args.quick else 8), steps=quick.get("steps"),
        warmup=quick.get("warmup"), memory=False, log=lambda msg: print(msg, flush=True),
    )
    results["checks"] = checks(results["suites"])
    stem = "compile_quick" if args.quick else "compile"
    text = report(results).replace("# bench_precision results", "# bench_compile results", 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(_compact(json.dumps(results, indent=1, default=_jsonable)) + "\n")
    (args.out / f"{stem}.md").write_text(text + "\n")
    print(text)
    print(f"\nwritten: {args.out}/{stem}.{{json,md}}")
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)

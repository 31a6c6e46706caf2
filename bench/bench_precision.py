"""Throughput of StablePrecision against Lightning's built-in precisions and raw PyTorch loops, in one run.

    .venv/bin/python bench/bench_precision.py            # full run, ~4-6 min on 2 shared cores
    .venv/bin/python bench/bench_precision.py --quick    # smoke run, < 60 s
    .venv/bin/python bench/bench_precision.py --list     # the registered configs

Configs run round-robin (A, B, C, ... then again, each round starting one config later), so slow drift of the
machine hits every config alike; each run is a short fit of ``steps`` steps whose first ``warmup`` steps are
dropped; a run's time is the median of its kept steps; tables show medians and quartiles over runs, and ratios
are paired per round. A new config (``bf16-true``, ``op_policy="auto"``, ...) is one ``register(...)`` call.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import re
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # `common` sits next to this file; bench/ is no package
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from common import (  # noqa: E402
    TRAINER_DEFAULTS,
    BenchModule,
    GPTSize,
    MemoryCallback,
    MemoryProbe,
    MLPSize,
    StepClock,
    StepFn,
    StepTimer,
    Workload,
    environment,
    fmt_iqr,
    gpt_workload,
    markdown_table,
    mlp_workload,
    summary,
)
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from policy_workloads import CNNSize, SDPAGPTSize, cnn_workload, sdpa_gpt_workload  # noqa: E402

from lit_mpstable import SpikeGuard, StablePrecision  # noqa: E402
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler  # noqa: E402

__all__ = ["Config", "Suite", "CONFIGS", "SUITES", "register", "run_benchmark", "stable_callbacks", "main"]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# -------------------------------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class Config:
    """One benchmarked configuration: a Lightning fit (``trainer``) or a raw PyTorch loop (``step``).

    Attributes:
        trainer: returns the Trainer keyword arguments that make this config (``precision``, ``plugins``,
            ``callbacks``); the shared settings in ``TRAINER_DEFAULTS`` are added.
        step: builds one raw training step from the module and its optimizer (same model, data, optimizer).
    """

    name: str
    suite: str
    description: str
    trainer: Callable[[], dict[str, Any]] | None = None
    step: Callable[[BenchModule, torch.optim.Optimizer], StepFn] | None = None

    def __post_init__(self) -> None:
        assert (self.trainer is None) != (self.step is None), f"{self.name}: give exactly one of trainer/step"


@dataclass(frozen=True)
class Suite:
    """Configs that share a workload; ``columns`` are ``"ratio:<config>"`` (throughput x) or ``"delta:<config>"``."""

    name: str
    title: str
    workload: Callable[[int], Workload]
    steps: int
    warmup: int
    unit: str  # "ms" or "us" per step
    columns: tuple[str, ...]
    memory: bool = False
    size: dict[str, Any] = field(default_factory=dict)


CONFIGS: dict[str, Config] = {}
SUITES: dict[str, Suite] = {}


def register(config: Config) -> Config:
    """Add a config; later issues add theirs here (``"SP-bf16-true+masters"``, ``"SP-op_policy=auto"``, ...)."""
    if config.name in CONFIGS:
        raise ValueError(f"register({config.name!r}): a config of that name exists already.")
    if config.suite not in SUITES:
        raise ValueError(f"register({config.name!r}): unknown suite {config.suite!r}; known: {sorted(SUITES)}.")
    CONFIGS[config.name] = config
    return config


# The DESIGN.md callbacks, in the order they would be stacked; whichever exist are used with default arguments.
STABLE_CALLBACK_NAMES = ("AMPPreflight", "OverflowMonitor", "PrecisionFallback", "ScaleCheckpoint")


def stable_callbacks() -> list[pl.Callback]:
    """The lit_mpstable callbacks that exist in this version, default-constructed (empty before any exists)."""
    try:
        import lit_mpstable.callbacks as module
    except ImportError:
        return []
    return [getattr(module, name)() for name in STABLE_CALLBACK_NAMES if hasattr(module, name)]


def _raw(dtype: torch.dtype | None = None, scaler: Callable[[], Any] | None = None) -> Callable[..., StepFn]:
    """A raw training step: zero_grad, forward (+ autocast), backward (+ scaler), optimizer step."""

    def build(module: BenchModule, optimizer: torch.optim.Optimizer) -> StepFn:
        grad_scaler = scaler() if scaler is not None else None

        def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)  # Lightning's default too
            with torch.autocast("cpu", dtype=dtype) if dtype is not None else nullcontext():
                loss = module.loss(batch)
            if grad_scaler is None:
                loss.backward()
                optimizer.step()
            else:
                grad_scaler.scale(loss).backward()
                grad_scaler.step(optimizer)
                grad_scaler.update()
            return loss

        return step

    return build


SUITES["gpt"] = Suite(
    name="gpt",
    title="GPT-style model (lightning demos.Transformer), throughput",
    workload=lambda steps: gpt_workload(GPTSize(), steps),
    steps=10,
    warmup=2,  # only the first step is measurably slower (~10 %); see README
    unit="ms",
    columns=("ratio:L-bf16-mixed", "ratio:raw-fp32", "delta:SP-bf16-mixed-noskip"),
    memory=True,
    size=asdict(GPTSize()),
)
SUITES["scaler-raw"] = Suite(
    name="scaler-raw",
    title="Loss-scaler cost per step, raw loop, tiny FP32 MLP (no autocast: the scaler's own work is measured)",
    workload=lambda steps: mlp_workload(MLPSize(), steps),
    steps=400,
    warmup=50,
    unit="us",
    columns=("delta:raw-mlp-none", "delta:raw-mlp-GradScaler"),
    size=asdict(MLPSize()),
)
SUITES["scaler-lightning"] = Suite(
    name="scaler-lightning",
    title="Lightning '16-mixed' on the CPU (real, emulated FP16), tiny MLP",
    workload=lambda steps: mlp_workload(MLPSize(), steps),
    steps=80,
    warmup=10,
    unit="us",
    columns=("ratio:L-mlp-16-mixed", "delta:L-mlp-16-mixed", "delta:L-mlp-32-true"),
    size=asdict(MLPSize()),
)

register(Config("raw-fp32", "gpt", "raw PyTorch loop, FP32", step=_raw()))
register(Config("raw-bf16-autocast", "gpt", 'raw loop, torch.autocast("cpu", bfloat16)', step=_raw(torch.bfloat16)))
register(Config("L-32-true", "gpt", 'Trainer(precision="32-true")', trainer=lambda: {"precision": "32-true"}))
register(Config("L-bf16-mixed", "gpt", 'Trainer(precision="bf16-mixed")', trainer=lambda: {"precision": "bf16-mixed"}))
register(
    Config(
        "SP-bf16-mixed", "gpt", 'Trainer(plugins=[StablePrecision("bf16-mixed")])',
        trainer=lambda: {"plugins": [StablePrecision("bf16-mixed")]},
    )
)
register(
    Config(
        "SP-bf16-mixed-noskip", "gpt", 'StablePrecision("bf16-mixed", skip_nonfinite=False): no inf/NaN check',
        trainer=lambda: {"plugins": [StablePrecision("bf16-mixed", skip_nonfinite=False)]},
    )
)
register(
    Config(
        "SP-bf16-mixed+cb", "gpt", "StablePrecision(\"bf16-mixed\", spike_guard=SpikeGuard()) + stable_callbacks()",
        trainer=lambda: {"plugins": [StablePrecision("bf16-mixed", spike_guard=SpikeGuard())],
                         "callbacks": stable_callbacks()},
    )
)
register(Config("raw-mlp-none", "scaler-raw", "no scaler", step=_raw()))
register(
    Config(
        "raw-mlp-GradScaler", "scaler-raw", 'torch.amp.GradScaler("cpu")',
        step=_raw(scaler=lambda: torch.amp.GradScaler("cpu")),
    )
)
register(
    Config(
        "raw-mlp-DynamicLossScaler", "scaler-raw", 'lit_mpstable DynamicLossScaler("cpu")',
        step=_raw(scaler=lambda: DynamicLossScaler("cpu")),
    )
)
register(
    Config(
        "L-mlp-32-true", "scaler-lightning", 'precision="32-true" (reference)', trainer=lambda: {"precision": "32-true"}
    )
)
register(
    Config(
        "L-mlp-16-mixed", "scaler-lightning", 'plugins=[MixedPrecision("16-mixed", "cpu")] (GradScaler)',
        trainer=lambda: {"plugins": [MixedPrecision("16-mixed", "cpu")]},
    )
)
register(
    Config(
        "SP-mlp-16-mixed", "scaler-lightning", 'plugins=[StablePrecision("16-mixed")] (DynamicLossScaler)',
        trainer=lambda: {"plugins": [StablePrecision("16-mixed")]},
    )
)

# bf16-true with and without FP32 master weights, against Lightning's own.
register(Config("L-bf16-true", "gpt", 'Trainer(precision="bf16-true")', trainer=lambda: {"precision": "bf16-true"}))
register(
    Config(
        "SP-bf16-true", "gpt", 'StablePrecision("bf16-true") (FP32 master weights)',
        trainer=lambda: {"plugins": [StablePrecision("bf16-true")]},
    )
)
register(
    Config(
        "SP-bf16-true-nomaster", "gpt", 'StablePrecision("bf16-true", master_weights=False)',
        trainer=lambda: {"plugins": [StablePrecision("bf16-true", master_weights=False)]},
    )
)
register(
    Config(
        "SP-bf16-true-kahan", "gpt", 'StablePrecision("bf16-true", master_weights="kahan") (compact weights)',
        trainer=lambda: {"plugins": [StablePrecision("bf16-true", master_weights="kahan")]},
    )
)

# The per-op precision policy: the faster of FP32 and BF16 per op family. The demo Transformer's attention is
# nn.MultiheadAttention (one op for the policy, projections included); zoo.GPT calls SDPA itself.
register(
    Config(
        "SP-bf16-mixed-auto", "gpt", 'StablePrecision("bf16-mixed", op_policy="auto")',
        trainer=lambda: {"plugins": [StablePrecision("bf16-mixed", op_policy="auto")]},
    )
)
_POLICY_SUITES = {"sdpa": "gpt-sdpa", "mlp": "policy-mlp", "cnn": "policy-cnn"}
SUITES["gpt-sdpa"] = Suite(
    name="gpt-sdpa",
    title="GPT with F.scaled_dot_product_attention (lit_mpstable.app.zoo.GPT), per-op precision policy",
    workload=lambda steps: sdpa_gpt_workload(SDPAGPTSize(), steps),
    steps=10,
    warmup=2,  # an op_policy="auto" run records in step 0 and measures at the start of step 1 (cached in later runs)
    unit="ms",
    columns=("ratio:sdpa/L-32-true", "ratio:sdpa/L-bf16-mixed"),
    size=asdict(SDPAGPTSize()),
)
SUITES["policy-mlp"] = Suite(
    name="policy-mlp",
    title="Per-op precision policy on the tiny MLP (per-op overhead dominates)",
    workload=lambda steps: mlp_workload(MLPSize(), steps),
    steps=80,
    warmup=10,
    unit="us",
    columns=("ratio:mlp/L-bf16-mixed", "ratio:mlp/L-32-true"),
    size=asdict(MLPSize()),
)
SUITES["policy-cnn"] = Suite(
    name="policy-cnn",
    title="Per-op precision policy on a small CNN (conv + batch norm)",
    workload=lambda steps: cnn_workload(CNNSize(), steps),
    steps=30,
    warmup=5,
    unit="ms",
    columns=("ratio:cnn/L-bf16-mixed", "ratio:cnn/L-32-true"),
    size=asdict(CNNSize()),
)
for _prefix, _suite in _POLICY_SUITES.items():
    register(Config(f"{_prefix}/L-32-true", _suite, 'Trainer(precision="32-true")',
                    trainer=lambda: {"precision": "32-true"}))
    register(Config(f"{_prefix}/L-bf16-mixed", _suite, 'Trainer(precision="bf16-mixed")',
                    trainer=lambda: {"precision": "bf16-mixed"}))
    register(Config(f"{_prefix}/SP-bf16-mixed", _suite, 'StablePrecision("bf16-mixed") (op_policy="autocast")',
                    trainer=lambda: {"plugins": [StablePrecision("bf16-mixed")]}))
    register(Config(f"{_prefix}/SP-bf16-mixed-auto", _suite, 'StablePrecision("bf16-mixed", op_policy="auto")',
                    trainer=lambda: {"plugins": [StablePrecision("bf16-mixed", op_policy="auto")]}))
# The whole stack on the tiny MLP, where the per-step fixed cost of every monitor shows (issue #44: >= 0.90x).
register(Config("mlp/SP-bf16-mixed+cb", "policy-mlp",
                "StablePrecision(\"bf16-mixed\", spike_guard=SpikeGuard()) + stable_callbacks()",
                trainer=lambda: {"plugins": [StablePrecision("bf16-mixed", spike_guard=SpikeGuard())],
                                 "callbacks": stable_callbacks()}))
# Lightning's own cost of four callbacks that do nothing (every hook of every callback is dispatched, profiled, each
# step): the floor under the whole stack's four callbacks.
register(Config("mlp/L-bf16-mixed+4empty", "policy-mlp", 'Trainer(precision="bf16-mixed") + 4 empty Callbacks',
                trainer=lambda: {"precision": "bf16-mixed",
                                 "callbacks": [type(f"Empty{i}", (pl.Callback,), {})() for i in range(4)]}))
# Compact weights (bf16-true, Kahan-compensated) against Lightning's bf16-true on the tiny MLP (per-step overhead).
register(Config("mlp/L-bf16-true", "policy-mlp", 'Trainer(precision="bf16-true")',
                trainer=lambda: {"precision": "bf16-true"}))
register(Config("mlp/SP-bf16-true-kahan", "policy-mlp",
                'StablePrecision("bf16-true", master_weights="kahan") (compact weights)',
                trainer=lambda: {"plugins": [StablePrecision("bf16-true", master_weights="kahan")]}))


# ---------------------------------------------------------------------------------------------------- running
@dataclass
class Run:
    wall_s: list[float]  # every step, warmup included
    cpu_s: list[float]  # process CPU time of the same steps
    final_loss: float
    threads: int
    callbacks: list[str] = field(default_factory=list)
    peak_bytes: int | None = None


def run_once(config: Config, suite: Suite, steps: int, *, memory_step: int | None = None) -> Run:
    """One short training run of ``config``; with ``memory_step`` that step is profiled (its time is then void)."""
    work = suite.workload(steps)
    module = work.module
    if config.step is not None:
        optimizer = module.configure_optimizers()
        step = config.step(module, optimizer)
        probe, clock, loss = MemoryProbe(), StepClock(), None
        clock.start()
        for i, batch in enumerate(work.loader):  # the batch fetch is part of the step, as in Lightning
            if i == memory_step:
                probe.start(module, [optimizer])
            loss = step(batch)
            if i == memory_step:
                probe.stop()
            clock.tick()
        loss_value, threads = float(loss.detach()), torch.get_num_threads()
        return Run(clock.wall_s, clock.cpu_s, loss_value, threads, peak_bytes=probe.peak_bytes)

    kwargs = config.trainer()
    timer = StepTimer()
    extra = list(kwargs.pop("callbacks", []))
    memory = MemoryCallback(memory_step) if memory_step is not None else None
    trainer = pl.Trainer(
        **TRAINER_DEFAULTS, max_steps=steps, callbacks=extra + [timer] + ([memory] if memory else []), **kwargs
    )
    trainer.fit(module, train_dataloaders=work.loader)
    clock = timer.clock
    assert len(clock.wall_s) == steps, f"{config.name}: {len(clock.wall_s)} steps timed, expected {steps}"
    return Run(
        clock.wall_s,
        clock.cpu_s,
        float(module.last_loss),
        timer.threads or -1,
        callbacks=[type(cb).__name__ for cb in extra],
        peak_bytes=memory.probe.peak_bytes if memory else None,
    )


def _paired(a: list[float], b: list[float], fn: Callable[[float, float], float]) -> dict[str, float]:
    return summary([fn(x, y) for x, y in zip(a, b)])


def run_suite(
    suite: Suite, names: list[str], *, repeats: int, steps: int, warmup: int, memory: bool, log: Callable[[str], None]
) -> dict[str, Any]:
    """Round-robin timing of ``names`` (all in ``suite``), then one profiled run each for peak memory."""
    if steps <= warmup:
        raise ValueError(f"{suite.name}: steps={steps} must exceed warmup={warmup} (warmup steps are dropped).")
    per_run: dict[str, list[Run]] = {name: [] for name in names}
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            per_run[name].append(run_once(CONFIGS[name], suite, steps))
        log(f"  [{suite.name}] round {r + 1}/{repeats} done")
    wall = _timings(suite, {name: [run.wall_s for run in runs] for name, runs in per_run.items()}, warmup)
    cpu_s = {name: [run.cpu_s for run in runs] for name, runs in per_run.items()}
    cpu = _timings(suite, cpu_s, warmup, keep_steps=False)
    out: dict[str, Any] = {}
    for name in names:
        runs = per_run[name]
        out[name] = {
            "description": CONFIGS[name].description,
            "kind": "lightning" if CONFIGS[name].trainer else "raw",
            "final_loss": summary([run.final_loss for run in runs]),
            "threads": sorted({run.threads for run in runs}),
            "callbacks": runs[0].callbacks,
            **wall[name],
            "cpu": cpu[name],
        }
    if memory and suite.memory:
        for name in names:
            gc.collect()
            run = run_once(CONFIGS[name], suite, 3, memory_step=2)  # step 2: optimizer state exists by then
            out[name]["peak_mib"] = run.peak_bytes / 2**20 if run.peak_bytes is not None else None
        log(f"  [{suite.name}] peak memory measured")
    return out


def _timings(
    suite: Suite, step_s: dict[str, list[list[float]]], warmup: int, *, keep_steps: bool = True
) -> dict[str, dict[str, Any]]:
    """Per config: step time and throughput over runs, paired ratios and deltas against the suite's baselines, and
    (``keep_steps``) every step's time, warmup included (ms to 0.1 us, us to 1 us)."""
    scale, unit = (1e3, "ms") if suite.unit == "ms" else (1e6, "us")
    run_time = {name: [_median(steps[warmup:]) for steps in runs] for name, runs in step_s.items()}
    tokens_per_step = suite.workload(1).tokens_per_step if suite.name == "gpt" else None
    out = {}
    for name, times in run_time.items():
        entry: dict[str, Any] = {
            f"step_{unit}": summary([t * scale for t in times]),
            "steps_per_s": summary([1 / t for t in times]),
            "vs": {},
        }
        if keep_steps:
            digits = 4 if unit == "ms" else None
            entry[f"run_step_{unit}"] = [[round(t * scale, digits) for t in steps] for steps in step_s[name]]
        if tokens_per_step is not None:
            entry["tokens_per_s"] = summary([tokens_per_step / t for t in times])
        for base in {column.split(":", 1)[1] for column in suite.columns}:
            if base in run_time and base != name:
                entry["vs"][base] = {
                    "throughput_ratio": _paired(run_time[base], times, lambda b, x: b / x),
                    f"delta_{unit}": _paired(times, run_time[base], lambda x, b: (x - b) * scale),
                }
        out[name] = entry
    return out


def _median(values: list[float]) -> float:
    return summary(values)["median"]


def run_benchmark(
    names: list[str] | None = None,
    *,
    repeats: int = 16,
    steps: dict[str, int] | None = None,
    warmup: dict[str, int] | None = None,
    memory: bool = True,
    out: Path | None = None,
    stem: str = "precision",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the named configs (default: all), grouped by suite; write ``<stem>.json`` and ``<stem>.md`` to ``out``."""
    names = list(CONFIGS) if names is None else names
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configs {unknown}; registered: {list(CONFIGS)}")
    steps, warmup = steps or {}, warmup or {}
    meta = environment()
    meta.update(repeats=repeats, memory=memory, suites={})
    results: dict[str, Any] = {"meta": meta, "suites": {}, "checks": {}}
    started = time.perf_counter()
    for suite in SUITES.values():
        chosen = [name for name in names if CONFIGS[name].suite == suite.name]
        if not chosen:
            continue
        n_steps, n_warm = steps.get(suite.name, suite.steps), warmup.get(suite.name, suite.warmup)
        log(f"{suite.name}: {chosen}, {repeats} rounds x {n_steps} steps ({n_warm} warmup dropped)")
        meta["suites"][suite.name] = {
            "title": suite.title, "steps": n_steps, "warmup": n_warm, "unit": suite.unit, "size": suite.size
        }
        results["suites"][suite.name] = run_suite(
            suite, chosen, repeats=repeats, steps=n_steps, warmup=n_warm, memory=memory, log=log
        )
    meta["wall_s"] = time.perf_counter() - started
    meta["loadavg_end"] = environment()["loadavg"]
    results["checks"] = _checks(results["suites"])
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(_compact(json.dumps(results, indent=1, default=_jsonable)) + "\n")
        (out / f"{stem}.md").write_text(report(results) + "\n")
    return results


def _compact(text: str) -> str:
    """One line per list of numbers (the per-step times), so the JSON stays readable and small."""
    return re.sub(r"\[\s+([-+0-9.eE,\s]+?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)


def _jsonable(value: Any) -> Any:
    return float(value) if isinstance(value, (int, float)) else str(value)


def _checks(suites: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals, read off the tables for both clocks (missing configs give no entry)."""

    def vs(suite: str, name: str, base: str, clock: str) -> dict[str, Any] | None:
        entry = suites.get(suite, {}).get(name, {})
        return (entry.get("cpu", {}) if clock == "cpu" else entry).get("vs", {}).get(base)

    checks: dict[str, Any] = {}
    for clock in ("wall", "cpu"):
        if (v := vs("gpt", "SP-bf16-mixed", "L-bf16-mixed", clock)) is not None:
            ratio = v["throughput_ratio"]
            lightning, stable = (suites["gpt"][n] for n in ("L-bf16-mixed", "SP-bf16-mixed"))
            if clock == "cpu":
                lightning, stable = lightning["cpu"], stable["cpu"]
            # Other processes only ever add time, so the fastest runs' ratio is a second, burst-free view.
            best = lightning["step_ms"]["min"] / stable["step_ms"]["min"]
            checks[f"stable_bf16_vs_lightning_bf16 ({clock})"] = {
                "throughput_ratio": ratio, "best_run_ratio": best, "goal": ">= 0.97", "met": ratio["median"] >= 0.97
            }
        for name in ("raw-mlp-GradScaler", "raw-mlp-DynamicLossScaler"):
            if (v := vs("scaler-raw", name, "raw-mlp-none", clock)) is not None:
                checks[f"{name.removeprefix('raw-mlp-')}_overhead_us ({clock})"] = v["delta_us"]
        if (v := vs("scaler-raw", "raw-mlp-DynamicLossScaler", "raw-mlp-GradScaler", clock)) is not None:
            checks[f"DynamicLossScaler_minus_GradScaler_us ({clock})"] = v["delta_us"]
        if (v := vs("scaler-lightning", "SP-mlp-16-mixed", "L-mlp-16-mixed", clock)) is not None:
            checks[f"stable_16_vs_lightning_16 ({clock})"] = {
                "throughput_ratio": v["throughput_ratio"],
                "delta_us": v["delta_us"],
                "goal": "costs no more than GradScaler: ratio ~1, delta ~0",
            }
        checks.update(_policy_checks(suites, clock, vs))
    return checks


def _policy_checks(suites: dict[str, Any], clock: str, vs: Callable[..., Any]) -> dict[str, Any]:
    """op_policy="auto": >= 1.65x FP32 on the SDPA GPT with the final loss within 0.5 % of FP32's; never slower
    than Lightning's bf16-mixed (>= 0.98) on the MLP and the CNN."""
    checks: dict[str, Any] = {}
    if (v := vs("gpt-sdpa", "sdpa/SP-bf16-mixed-auto", "sdpa/L-32-true", clock)) is not None:
        losses = {name: suites["gpt-sdpa"][name]["final_loss"]["median"] for name in ("sdpa/SP-bf16-mixed-auto",
                                                                                      "sdpa/L-32-true")}
        gap = abs(losses["sdpa/SP-bf16-mixed-auto"] / losses["sdpa/L-32-true"] - 1)
        lightning = vs("gpt-sdpa", "sdpa/L-bf16-mixed", "sdpa/L-32-true", clock)
        checks[f"op_policy_auto_speedup_over_fp32 ({clock})"] = {
            "throughput_ratio": v["throughput_ratio"],
            "lightning_bf16_mixed_ratio": lightning["throughput_ratio"] if lightning else None,
            "final_loss_gap_pct": 100 * gap,
            "goal": ">= 1.65 and final_loss_gap_pct <= 0.5",
            "met": v["throughput_ratio"]["median"] >= 1.65 and gap <= 0.005,
        }
    for prefix in ("mlp", "cnn"):
        if (v := vs(f"policy-{prefix}", f"{prefix}/SP-bf16-mixed-auto", f"{prefix}/L-bf16-mixed", clock)) is not None:
            ratio = v["throughput_ratio"]
            checks[f"op_policy_auto_vs_lightning_bf16_{prefix} ({clock})"] = {
                "throughput_ratio": ratio, "goal": ">= 0.98", "met": ratio["median"] >= 0.98
            }
    return checks


# ---------------------------------------------------------------------------------------------------- report
def report(results: dict[str, Any]) -> str:
    meta = results["meta"]
    parts = [
        "# bench_precision results",
        "",
        f"{meta['time']}: torch {meta['torch']}, lightning {meta['lightning']}, python {meta['python']}, "
        f"{meta['cpu']} ({meta['cpu_count']} cores, {meta['cpu_capability']}), torch threads {meta['torch_threads']}, "
        f"load average {_load(meta['loadavg'])} at start, {_load(meta.get('loadavg_end'))} at end; "
        f"{meta['repeats']} rounds, {meta.get('wall_s', 0):.0f} s. Command: `{' '.join(meta['argv'])}`",
        "",
        "Wall time per step: medians over runs, [first, third quartile]. Ratios are throughput ratios (>1 = faster"
        " than the baseline), deltas are extra time per step; both paired per round. The JSON holds the same"
        " statistics for process CPU time under `cpu`, and every step's time.",
    ]
    for suite_name, configs in results["suites"].items():
        info = meta["suites"][suite_name]
        parts += [
            "",
            f"## {info['title']}",
            "",
            f"{info['steps']} steps per run, first {info['warmup']} dropped; size {info['size']}",
            "",
            _table(suite_name, configs, info["unit"]),
            "",
            _cpu_line(configs, info["unit"]),
        ]
    if results["checks"]:
        parts += ["", "## Checks", ""]
        for key, value in results["checks"].items():
            parts.append(f"- `{key}`: {_check_text(value)}")
    return "\n".join(parts)


def _cpu_line(configs: dict[str, Any], unit: str) -> str:
    share = summary([e["cpu"][f"step_{unit}"]["median"] / e[f"step_{unit}"]["median"] for e in configs.values()])
    why = (
        "the process kept its core; spread comes from contention for the core's shared resources"
        if share["median"] > 0.95
        else "the process waited for a core; the CPU-time statistics in the JSON are the steadier view"
    )
    return f"CPU time / wall time per step: {fmt_iqr(share, 3)} over configs ({why})."


def _table(suite_name: str, configs: dict[str, Any], unit: str) -> str:
    suite = SUITES[suite_name]
    header = ["config", f"{unit}/step"] + (["tokens/s"] if suite_name == "gpt" else [])
    for column in suite.columns:
        kind, base = column.split(":", 1)
        header.append(f"x {base}" if kind == "ratio" else f"delta {unit} vs {base}")
    header += (["peak MiB"] if any("peak_mib" in c for c in configs.values()) else []) + ["final loss", "what"]
    rows = []
    for name, entry in configs.items():
        row = [name, fmt_iqr(entry[f"step_{unit}"], 1)]
        if suite_name == "gpt":
            row.append(f"{entry['tokens_per_s']['median']:.0f}")
        for column in suite.columns:
            kind, base = column.split(":", 1)
            v = entry["vs"].get(base)
            if base == name:
                row.append("1" if kind == "ratio" else "0")
            elif v is None:
                row.append("n/a")
            else:
                row.append(fmt_iqr(v["throughput_ratio"], 3) if kind == "ratio" else fmt_iqr(v[f"delta_{unit}"], 1))
        if "peak MiB" in header:
            row.append(f"{entry['peak_mib']:.1f}" if entry.get("peak_mib") is not None else "n/a")
        row += [f"{entry['final_loss']['median']:.4g}", entry["description"] + _cb(entry)]
        rows.append(row)
    return markdown_table(header, rows)


def _cb(entry: dict[str, Any]) -> str:
    if entry["description"].endswith("stable_callbacks()"):
        return f" = {entry['callbacks'] or 'none yet'}"
    return ""


def _load(load: list[float] | None) -> str:
    return "n/a" if not load else "/".join(f"{x:.1f}" for x in load)


def _check_text(value: dict[str, Any]) -> str:
    if "median" in value:
        return fmt_iqr(value, 1)
    text = ", ".join(
        f"{k} {fmt_iqr(v, 3 if k.endswith('ratio') else 1)}" if isinstance(v, dict) else f"{k} {v:.3f}"
        for k, v in value.items()
        if isinstance(v, (dict, float))
    )
    if "met" in value:
        text += f" (goal {value['goal']}: {'met' if value['met'] else 'NOT met'})"
    elif "goal" in value:
        text += f" (goal: {value['goal']})"
    return text


# ------------------------------------------------------------------------------------------------------- CLI
QUICK = {
    "repeats": 3,
    "steps": {"gpt": 6, "scaler-raw": 60, "scaler-lightning": 20, "gpt-sdpa": 6, "policy-mlp": 20, "policy-cnn": 8},
    "warmup": {"gpt": 2, "scaler-raw": 10, "scaler-lightning": 5, "gpt-sdpa": 2, "policy-mlp": 5, "policy-cnn": 2},
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds of very short runs: a smoke test (< 60 s)")
    parser.add_argument("--repeats", type=int, help="rounds over all configs (default 16; --quick: 3)")
    parser.add_argument("--steps", type=int, help="steps per run of the gpt suite, warmup included (default 10)")
    parser.add_argument("--warmup", type=int, help="steps dropped at the start of each gpt run (default 2)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch.set_num_threads (default 1; 0 leaves torch's default)"
    )
    parser.add_argument("--configs", help=f"comma-separated config names (default all): {','.join(CONFIGS)}")
    parser.add_argument("--no-memory", action="store_true", help="skip the profiled peak-memory runs")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="where to write the JSON and Markdown results")
    parser.add_argument("--list", action="store_true", help="print the registered configs and exit")
    args = parser.parse_args(argv)
    if args.list:
        for config in CONFIGS.values():
            print(f"{config.name:28s} {config.suite:17s} {config.description}")
        return {}
    if args.threads:
        torch.set_num_threads(args.threads)
    _quiet()
    steps, warmup = (dict(QUICK["steps"]), dict(QUICK["warmup"])) if args.quick else ({}, {})
    if args.steps is not None:
        steps["gpt"] = args.steps
    if args.warmup is not None:
        warmup["gpt"] = args.warmup
    repeats = args.repeats or (QUICK["repeats"] if args.quick else 16)
    names = [name.strip() for name in args.configs.split(",")] if args.configs else None
    results = run_benchmark(
        names, repeats=repeats, steps=steps, warmup=warmup, memory=not args.no_memory, out=args.out,
        stem="precision_quick" if args.quick else "precision", log=lambda msg: print(msg, flush=True),
    )
    print()
    print(report(results))
    print(f"\nwritten: {args.out}/{'precision_quick' if args.quick else 'precision'}.{{json,md}}")
    return results


def _quiet() -> None:
    """Keep the output to the tables: Lightning's per-Trainer banners and the expected CPU warnings go."""
    for logger in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(logger).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*StablePrecision\('16-mixed'\) on the CPU.*")
    warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")


if __name__ == "__main__":
    main()
    sys.exit(0)

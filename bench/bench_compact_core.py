"""Compact 16-bit weights (lit_mpstable.core.weights.compact.CompactWeights) in a plain PyTorch loop, against FP32,
plain BF16 and BF16 + FP32 masters: peak tensor memory of one training step and where it goes, CPU time per step, and
the losses after 300 steps on the stall case and on a GPT. Writes results/compact_core/results.{json,md}.

    .venv/bin/python bench/bench_compact_core.py                 # everything, ~10 min on 2 shared cores
    .venv/bin/python bench/bench_compact_core.py --skip-loss --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from lit_mpstable.app.demos import stall_task  # noqa: E402
from lit_mpstable.core.weights.compact import CompactWeights  # noqa: E402
from lit_mpstable.core.weights.master import MasterWeights  # noqa: E402
from lit_mpstable.core.weights.memory import MemoryProbe, quiet_fd2  # noqa: E402

MiB = 2**20


# ------------------------------------------------------------------------------------------------ workloads
@dataclass
class Workload:
    name: str
    what: str
    build: Callable[[], nn.Module]
    batches: Callable[[torch.dtype], list[tuple[torch.Tensor, torch.Tensor]]]
    loss: Callable[[nn.Module, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    dims = [784, 1024, 1024, 1024, 10]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(dims) - 2 else [])
    return nn.Sequential(*layers)


def _mlp_batches(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(256, 784, generator=g).to(dtype), torch.randint(0, 10, (256,), generator=g)) for _ in range(4)]


def _gpt() -> nn.Module:
    from lit_mpstable.app.zoo import GPT  # imports Lightning: only here

    torch.manual_seed(0)
    return GPT(256, d_model=256, n_layers=4, n_heads=4, seq_len=128)


def _gpt_batches(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(4):
        tokens = torch.randint(0, 256, (8, 129), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _xent(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = model(x).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


WORKLOADS = {
    "mlp": Workload("mlp", "MLP 784-1024-1024-1024-10, batch 256 (parameter-dominated)", _mlp, _mlp_batches, _xent),
    "gpt": Workload("gpt", "lit_mpstable.app.zoo.GPT d_model 256, 4 layers, 4 heads, seq 128, batch 8, vocab 256", _gpt,
                    _gpt_batches, _xent),
}


# -------------------------------------------------------------------------------------------------- configs
@dataclass
class Run:
    """A model, its optimizer and one training step, ready to call."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[], None]  # after backward: update and free the gradients
    compact: CompactWeights | None = None
    masters: MasterWeights | None = None


@dataclass(frozen=True)
class Config:
    name: str
    what: str
    dtype: torch.dtype = torch.bfloat16
    mode: str | None = None  # None, "masters", "kahan", "stochastic"
    optimizer: str = "adamw"  # "adamw" or "adamw8bit" (torchao)
    chunk_mib: float | None = None  # CompactWeights(chunk_bytes=...); None: the default


CONFIGS = [
    Config("fp32", "FP32 weights, AdamW", torch.float32),
    Config("bf16", "plain BF16 weights, AdamW (BF16 state)"),
    Config("bf16+masters", "BF16 weights + FP32 masters and state (MasterWeights)", mode="masters"),
    Config("bf16+kahan", "CompactWeights('kahan'), AdamW (BF16 state)", mode="kahan"),
    Config("bf16+stochastic", "CompactWeights('stochastic'), AdamW (BF16 state)", mode="stochastic"),
    Config("fp32+AdamW8bit", "FP32 weights, torchao AdamW8bit", torch.float32, optimizer="adamw8bit"),
    Config("bf16+AdamW8bit", "plain BF16 weights, torchao AdamW8bit", optimizer="adamw8bit"),
    Config("bf16+kahan+AdamW8bit", "CompactWeights('kahan'), torchao AdamW8bit", mode="kahan", optimizer="adamw8bit"),
    Config("bf16+stochastic+AdamW8bit", "CompactWeights('stochastic'), torchao AdamW8bit", mode="stochastic",
           optimizer="adamw8bit"),
]


def sweep_configs(mibs: list[float]) -> list[Config]:
    return [Config(f"{mode}@{mib:g}MiB", f"CompactWeights('{mode}', chunk_bytes={mib:g} MiB)", mode=mode, chunk_mib=mib)
            for mode in ("kahan", "stochastic") for mib in mibs]


def _optimizer(config: Config, params: Any, lr: float, weight_decay: float = 0.01) -> torch.optim.Optimizer:
    if config.optimizer == "adamw8bit":
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def make_run(config: Config, model: nn.Module, lr: float = 1e-3) -> Run:
    model = model.to(config.dtype)
    opt = _optimizer(config, model.parameters(), lr)
    if config.mode == "masters":
        mw = MasterWeights(model, [opt])

        def step() -> None:
            mw.copy_grads_to_master_()
            mw.zero_model_grads_()
            opt.step()
            opt.zero_grad(set_to_none=True)
            mw.refresh_model_()

        return Run(model, opt, step, masters=mw)
    if config.mode in ("kahan", "stochastic"):
        kwargs = {} if config.chunk_mib is None else {"chunk_bytes": int(config.chunk_mib * MiB)}
        cw = CompactWeights(model, [opt], config.mode, **kwargs)
        return Run(model, opt, lambda: cw.step_(opt), compact=cw)

    def plain() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Run(model, opt, plain)


# --------------------------------------------------------------------------------------------------- memory
def _allocation_peak(fn: Callable[[], Any]) -> tuple[int, int]:
    """(highest running sum of allocations minus frees, the sum at the end) while ``fn`` runs."""
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with quiet_fd2():
        prof.__enter__()
    fn()
    with quiet_fd2():
        prof.__exit__(None, None, None)
    running = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for event in sorted(events, key=lambda e: e.start_ns()):
        running += event.nbytes()
        peak = max(peak, running)
    return peak, running


def _tensors(value: Any) -> list[torch.Tensor]:
    # Plain tensors, or the inner tensors of a wrapper subclass (torchao's quantized states have no storage).
    if not isinstance(value, torch.Tensor):
        return []
    if type(value) is torch.Tensor or isinstance(value, nn.Parameter) or not hasattr(value, "__tensor_flatten__"):
        return [value]
    return [t for name in value.__tensor_flatten__()[0] for t in _tensors(getattr(value, name))]


def _bytes(tensors: list[torch.Tensor], seen: dict[int, int]) -> int:
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage.nbytes()
            total += storage.nbytes()
    return total


def resident(run: Run) -> dict[str, int]:
    """Bytes held between steps, by kind, each storage once: weights, FP32 masters, compensation, optimizer state."""
    seen: dict[int, int] = {}
    model_params = list(run.model.parameters())
    opt_params = [p for g in run.optimizer.param_groups for p in g["params"]]
    state = [t for s in run.optimizer.state.values() for v in s.values() for t in _tensors(v)]
    comp = [c for _, _, c in run.compact.named_buffers() if c is not None] if run.compact is not None else []
    return {
        "weights": _bytes(model_params, seen),
        "masters": _bytes(opt_params, seen),
        "compensation": _bytes(comp, seen),
        "optimizer_state": _bytes(state, seen),
    }


def measure_memory(run: Run, workload: Workload, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """One profiled step, in two phases: forward + backward, then the optimizer step."""
    for p in run.model.parameters():
        p.grad = None
    held = resident(run)
    loss: list[torch.Tensor] = []
    fb_peak, fb_end = _allocation_peak(lambda: loss.append(workload.loss(run.model, batch)) or loss[0].backward())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in run.model.parameters() if p.grad is not None)
    loss.clear()
    opt_peak, _ = _allocation_peak(run.step)
    held_total = sum(held.values())
    peak = held_total + max(fb_peak, fb_end + opt_peak)
    out = {**held, "grads": grads, "forward_backward_peak": fb_peak, "after_backward": fb_end,
           "optimizer_transient": opt_peak, "peak": peak,
           "peak_phase": "forward/backward" if fb_peak >= fb_end + opt_peak else "optimizer step"}
    if run.optimizer.__class__.__module__.startswith("torch.optim"):
        # Cross-check with the package's probe (whole step at once); it does not see the compensation buffers.
        probe = MemoryProbe()
        probe.start(run.model, [run.optimizer])
        workload.loss(run.model, batch).backward()
        run.step()
        probe.stop()
        out["memory_probe_peak_plus_compensation"] = probe.peak_bytes + held["compensation"]
    return out


# ----------------------------------------------------------------------------------------------------- time
def time_steps(runs: dict[str, Run], workload: Workload, batches: dict[str, list], repeats: int, steps: int
               ) -> dict[str, dict[str, Any]]:
    """Round-robin: each round runs ``steps`` steps of every config, rotating the order; CPU (process) time."""
    names = list(runs)
    per_round: dict[str, list[float]] = {n: [] for n in names}
    all_steps: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            run, times = runs[name], []
            for i in range(steps):
                batch = batches[name][i % len(batches[name])]
                t0 = time.process_time()
                workload.loss(run.model, batch).backward()
                run.step()
                times.append(time.process_time() - t0)
            per_round[name].append(statistics.median(times))
            all_steps[name] += times
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        ratios = [a / b for a, b in zip(per_round[name], per_round["bf16"])] if "bf16" in per_round else []
        out[name] = {"cpu_ms": 1e3 * statistics.median(all_steps[name]),
                     "x_bf16": statistics.median(ratios) if ratios else None,
                     "x_bf16_range": [min(ratios), max(ratios)] if ratios else None,
                     "steps_ms": [1e3 * t for t in all_steps[name]]}
    return out


def perf(workload: Workload, configs: list[Config], repeats: int, steps: int) -> dict[str, Any]:
    runs: dict[str, Run] = {}
    batches: dict[str, list] = {}
    memory: dict[str, Any] = {}
    for config in configs:
        run = make_run(config, workload.build())
        batches[config.name] = workload.batches(config.dtype)
        for i in range(3):  # state exists, torchao has compiled its step
            workload.loss(run.model, batches[config.name][i]).backward()
            run.step()
        memory[config.name] = measure_memory(run, workload, batches[config.name][0])
        runs[config.name] = run
        print(f"  {workload.name} {config.name}: peak {memory[config.name]['peak'] / MiB:.1f} MiB", flush=True)
    timing = time_steps(runs, workload, batches, repeats, steps)
    return {"memory": memory, "time": timing}


# ---------------------------------------------------------------------------------------------------- losses
def stall_losses(steps: int, lr: float, seeds: int) -> dict[str, Any]:
    """demos.stall_task with SGD (every update below half a BF16 ulp); the loss of the final weights in FP32."""
    x, y, w0 = stall_task()

    def train(dtype: torch.dtype, mode: str | None, seed: int = 0) -> float:
        model = nn.Linear(16, 16, bias=False)
        with torch.no_grad():
            model.weight.copy_(w0)
        model.to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        mw = MasterWeights(model, [opt]) if mode == "masters" else None
        cw = CompactWeights(model, [opt], mode, seed=seed) if mode in ("kahan", "stochastic") else None
        for _ in range(steps):
            ((model(x.to(dtype)).float() - y) ** 2).sum(1).mean().backward()
            if cw is not None:
                cw.step_(opt)
                continue
            if mw is not None:
                mw.copy_grads_to_master_()
                mw.zero_model_grads_()
            opt.step()
            opt.zero_grad()
            if mw is not None:
                mw.refresh_model_()
        w = model.weight.detach().float()
        return ((x @ w.T - y) ** 2).sum(1).mean().item()

    out: dict[str, Any] = {"steps": steps, "lr": lr, "first": ((x @ w0.T - y) ** 2).sum(1).mean().item()}
    out["fp32"] = train(torch.float32, None)
    for name, mode in [("bf16", None), ("bf16+masters", "masters"), ("bf16+kahan", "kahan")]:
        out[name] = train(torch.bfloat16, mode)
    out["bf16+stochastic"] = [train(torch.bfloat16, "stochastic", seed=s) for s in range(seeds)]
    return out


def _schedule(step: int, warmup: int, total: int) -> float:
    # lit_mpstable.app.zoo's GPTLM schedule: linear warm-up, cosine to 10%.
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def gpt_losses(configs: list[Config], steps: int, lr: float) -> dict[str, Any]:
    """experiment=bf16_small_lr in a plain loop: zoo.GPT (d 128, 2 layers, seq 64) on stdlib text, batch 16, AdamW
    lr 1e-4 (below half a BF16 ulp of most weights), weight decay 0.01, warm-up 20 + cosine; val loss (20 batches)."""
    from lit_mpstable.app.zoo import GPT, CharLMData

    data = CharLMData(seq_len=64, batch_size=16)
    data.setup()
    train = [b for _, b in zip(range(steps), data.train_dataloader())]
    val = [b for _, b in zip(range(20), data.val_dataloader())]
    out: dict[str, Any] = {"steps": steps, "lr": lr}
    for config in configs:
        torch.manual_seed(0)
        run = make_run(config, GPT(data.vocab_size, 128, 2, 4, 64), lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(run.optimizer, lambda s: _schedule(s, 20, steps))
        t0 = time.process_time()
        for batch in train:
            _xent(run.model, batch).backward()
            run.step()
            sched.step()
        with torch.no_grad():
            loss = sum(_xent(run.model, b).item() for b in val) / len(val)
        out[config.name] = {"val_loss": loss, "cpu_s": time.process_time() - t0}
        print(f"  gpt loss {config.name}: {loss:.4f}", flush=True)
    return out


# ---------------------------------------------------------------------------------------------------- report
def _mib(b: float) -> str:
    return f"{b / MiB:.1f}"


def markdown(results: dict[str, Any]) -> str:
    lines = ["# CompactWeights core: memory, time and loss in a plain PyTorch loop", "", results["environment"], "",
             f"Command: `{results['command']}`", ""]
    for wname, res in results.get("perf", {}).items():
        fp32 = res["memory"]["fp32"]["peak"]
        bf16 = res["memory"]["bf16"]["peak"]
        lines += [f"## {WORKLOADS[wname].what}", "",
                  "Peak tensor memory of one step (MiB) = held between steps (weights + masters + compensation + "
                  "state) + the larger of forward/backward's peak and (what backward leaves: the gradients) + the "
                  "optimizer step's transient. CPU time per step: median over round-robin rounds, x bf16 paired per "
                  "round (> 1: slower).", "",
                  "| config | peak | x fp32 | x bf16 | weights | masters | comp | state | grads | fwd/bwd peak | "
                  "opt transient | peak in | CPU ms/step | time x bf16 |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, m in res["memory"].items():
            t = res["time"][name]
            ratio = f"{t['x_bf16']:.3f} [{t['x_bf16_range'][0]:.2f}, {t['x_bf16_range'][1]:.2f}]" if t["x_bf16"] else ""
            lines.append(
                f"| {name} | {_mib(m['peak'])} | {m['peak'] / fp32:.3f} | {m['peak'] / bf16:.3f} "
                f"| {_mib(m['weights'])} | {_mib(m['masters'])} | {_mib(m['compensation'])} "
                f"| {_mib(m['optimizer_state'])} | {_mib(m['grads'])} "
                f"| {_mib(m['forward_backward_peak'])} | {_mib(m['optimizer_transient'])} | {m['peak_phase']} "
                f"| {t['cpu_ms']:.1f} | {ratio} |")
        checks = [(n, m.get("memory_probe_peak_plus_compensation"), m["peak"]) for n, m in res["memory"].items()]
        lines += ["", "MemoryProbe (whole step) + compensation against the two-phase sum: " + ", ".join(
            f"{n} {_mib(p)}/{_mib(q)}" for n, p, q in checks if p is not None), ""]
    for s in results.get("stall", []):
        fp32, first = s["fp32"], s["first"]
        sr = s["bf16+stochastic"]
        drop = lambda loss: (first - loss) / (first - fp32)  # noqa: E731
        lines += [f"## Stall case, {s['steps']} steps (helpers.stall_task, SGD lr {s['lr']}, every update below half "
                  "a BF16 ulp)", "", f"Loss of the final weights evaluated in FP32; first {first:.4f}. Near zero "
                  "loss, ratios to FP32 measure the floor of each representation (BF16 rounding of the weights: "
                  "~1e-3 here; stochastic rounding's noise: ~1e-2); the share of FP32's loss drop measures training.",
                  "", "| config | loss | x fp32 - 1 | share of FP32's drop |", "|---|---|---|---|"]
        for name in ("fp32", "bf16", "bf16+masters", "bf16+kahan"):
            lines.append(f"| {name} | {s[name]:.5f} | {s[name] / fp32 - 1:+.2%} | {drop(s[name]):.2%} |")
        lines.append(f"| bf16+stochastic ({len(sr)} seeds: mean, min .. max) | {statistics.mean(sr):.5f} "
                     f"({min(sr):.5f} .. {max(sr):.5f}) | {statistics.mean(sr) / fp32 - 1:+.2%} "
                     f"({min(sr) / fp32 - 1:+.2%} .. {max(sr) / fp32 - 1:+.2%}) | {drop(statistics.mean(sr)):.2%} |")
        lines.append("")
    if "gpt_loss" in results:
        g = results["gpt_loss"]
        lines += [f"## GPT loss ({g['steps']} steps, AdamW lr {g['lr']}: experiment=bf16_small_lr in a plain loop)", "",
                  "zoo.GPT d_model 128, 2 layers, seq 64, batch 16 on stdlib text; validation loss over 20 batches. "
                  "8-bit rows compare with fp32+AdamW8bit (the same optimizer in FP32).", "",
                  "| config | val loss | x fp32 - 1 | x fp32+AdamW8bit - 1 | CPU s |", "|---|---|---|---|---|"]
        base, base8 = g["fp32"]["val_loss"], g.get("fp32+AdamW8bit", {}).get("val_loss")
        for name, v in g.items():
            if isinstance(v, dict):
                vs8 = f"{v['val_loss'] / base8 - 1:+.2%}" if base8 and "8bit" in name else ""
                lines.append(f"| {name} | {v['val_loss']:.4f} | {v['val_loss'] / base - 1:+.2%} | {vs8} "
                             f"| {v['cpu_s']:.1f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="round-robin rounds")
    parser.add_argument("--steps", type=int, default=4, help="steps per config per round")
    parser.add_argument("--workloads", default="mlp,gpt")
    parser.add_argument("--configs", default=",".join(c.name for c in CONFIGS))
    parser.add_argument("--sweep-mib", default="1,4,16,64", help="chunk_bytes sweep (MiB) for both modes; '' skips")
    parser.add_argument("--loss-steps", type=int, default=300)
    parser.add_argument("--skip-loss", action="store_true")
    parser.add_argument("--skip-perf", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "compact_core"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()
    results: dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "environment": f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}: torch {torch.__version__}, python "
                       f"{platform.python_version()}, {os.cpu_count()} cores, torch threads 1, load average "
                       f"{load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} at start",
    }
    chosen = [c for c in CONFIGS if c.name in args.configs.split(",")]
    sweep = sweep_configs([float(v) for v in args.sweep_mib.split(",") if v]) if args.sweep_mib else []
    t0 = time.perf_counter()
    if not args.skip_perf:
        results["perf"] = {}
        for wname in args.workloads.split(","):
            print(f"{wname}: memory and time", flush=True)
            results["perf"][wname] = perf(WORKLOADS[wname], chosen + sweep, args.repeats, args.steps)
    if not args.skip_loss:
        print("losses", flush=True)
        results["stall"] = [stall_losses(steps, 0.005, seeds=3) for steps in sorted({60, args.loss_steps})]
        results["gpt_loss"] = gpt_losses(chosen, args.loss_steps, 1e-4)
    results["seconds"] = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()

"""FP8 against BF16 on one GPU, for each FP8 backend (native FP8Linear, torchao, TransformerEngine): raw GEMMs, one
linear layer, and a GPT training step.

    .venv/bin/python bench/gpu_fp8.py                    # a few minutes on an H100/H200
    .venv/bin/python bench/gpu_fp8.py --quick            # smaller sizes, fewer steps (< 1 min)
    .venv/bin/python bench/gpu_fp8.py --runs bf16 native:delayed te:delayed --parts model

Without CUDA, or on a GPU below compute capability 8.9, it prints why and exits 0 (nothing to measure). A backend
whose package is not installed, or that cannot run a recipe here (MXFP8 needs Blackwell), gives a row marked
"skipped" with the reason. Writes Markdown tables to stdout and JSON to ``--out`` (default
``bench/results/gpu_fp8.json``). Parts:

1. ``gemm``: an n x n x n product for n = 1024 .. 8192: BF16 ``mm``, FP8 ``_scaled_mm`` on pre-quantised E4M3
   operands (the kernel alone; fast accumulation off and on), and FP8 including this package's per-tensor
   quantisation of both operands (what FP8Linear pays per GEMM).
2. ``linear``: one n x n linear layer on n tokens, forward and backward (three GEMMs) under BF16 autocast, for each
   run (BF16 ``nn.Linear``, or the layer each backend swaps in through ``lit_mpstable.fp8.fp8_backend``).
3. ``check``: FP8Linear through ``_scaled_mm`` against its exact emulation (same inputs): the relative difference
   of output and gradients, which must be at fp32-accumulation level. It validates the CUDA operand layouts.
4. ``model``: a GPT-style decoder (pre-LN, d=2048, 4 layers) training step under BF16 autocast, for each run.

Runs: ``bf16``; ``<recipe>`` or ``native:<recipe>`` (recipes: delayed, current, mxfp8; native mxfp8 is emulated:
slow by design); ``torchao:<recipe>`` (current, mxfp8); ``te:<recipe>`` (delayed, current, mxfp8). Any run with
``+compile`` appended (``bf16+compile``, ``delayed+compile``) is the same model under ``torch.compile`` (inductor,
default options; the FP8 layers swapped in first, as StablePrecision does), timed after its compilation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from lit_mpstable.fp8 import FP8Config, FP8Linear, fp8_backend  # noqa: E402
from lit_mpstable.fp8.config import FP8Recipe  # noqa: E402
from lit_mpstable.fp8.quant import quantize  # noqa: E402
from lit_mpstable.fp8.swap import select_fp8_modules  # noqa: E402

E4M3 = torch.float8_e4m3fn


def cuda_time(fn, *, warmup: int, min_seconds: float) -> float:
    """Median seconds per call of ``fn`` over CUDA-event-timed batches lasting at least ``min_seconds`` in all."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times: list[float] = []
    start_all = time.perf_counter()
    while time.perf_counter() - start_all < min_seconds or len(times) < 5:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


# ---------------------------------------------------------------------------------------------------- GEMMs
def bench_gemm(sizes: list[int], min_seconds: float) -> list[dict]:
    rows = []
    one = torch.ones((), device="cuda")
    for n in sizes:
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        a8, b8 = a.to(E4M3), b.to(E4M3)
        flops = 2 * n**3

        def quantised():
            sa, sb = 448 / a.abs().amax().float(), 448 / b.abs().amax().float()
            qa, qb = quantize(a, sa, E4M3), quantize(b, sb, E4M3)
            return torch._scaled_mm(qa, qb.t(), scale_a=1 / sa, scale_b=1 / sb, out_dtype=torch.bfloat16)

        cases = {
            "bf16 mm": lambda: torch.mm(a, b.t()),
            "fp8 _scaled_mm": lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
            "fp8 _scaled_mm fast_accum": lambda: torch._scaled_mm(
                a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True
            ),
            "fp8 incl. quantisation": quantised,
        }
        for name, fn in cases.items():
            seconds = cuda_time(fn, warmup=5, min_seconds=min_seconds)
            rows.append({"n": n, "case": name, "ms": seconds * 1e3, "tflops": flops / seconds / 1e12})
        a = b = a8 = b8 = None  # free the GPU memory now (the closures above read these names, so no del)
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------- _scaled_mm vs emulation
def check_scaled_mm(recipe: str) -> dict:
    torch.manual_seed(0)
    layers = [FP8Linear(256, 512, config=FP8Config(recipe=recipe, emulate=e), device="cuda") for e in (False, True)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(1024, 256, device="cuda")
    grad_out = torch.randn(1024, 512, device="cuda")
    results = []
    for layer in layers:
        for _ in range(2):  # delayed: the second step uses the history of the first
            layer.zero_grad()
            xi = x.clone().requires_grad_()
            y = layer(xi)
            y.backward(grad_out)
        results.append((y.detach(), xi.grad, layer.weight.grad))

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    (y0, gx0, gw0), (y1, gx1, gw1) = results
    return {"recipe": recipe, "y": rel(y0, y1), "grad_x": rel(gx0, gx1), "grad_w": rel(gw0, gw1)}


# ---------------------------------------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def bench_model(runs: list[str], args: argparse.Namespace) -> list[dict]:
    rows = []
    vocab, d, layers, heads, context, batch = 32000, args.d_model, args.layers, 16, args.seq_len, args.batch
    tokens = torch.randint(vocab, (batch, context + 1), device="cuda")
    for run in runs:
        torch.manual_seed(0)
        model = GPT(vocab, d, layers, heads, context).cuda()
        try:
            swapped, fp8_context = swap(model, run)
        except (ModuleNotFoundError, ValueError) as err:
            rows.append({"run": run, "skipped": str(err)})
            continue
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        model = _compiled(model, run)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16), fp8_context():
                logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss

        try:
            seconds = cuda_time(step, warmup=3, min_seconds=args.model_seconds)
            loss = step().item()
        except Exception as err:  # noqa: BLE001 - a backend failing on this GPU is a result, not a crash
            rows.append({"run": run, "skipped": f"{type(err).__name__}: {err}"[:300]})
            continue
        tokens_per_s = batch * context / seconds
        rows.append({"run": run, "swapped": len(swapped), "ms_per_step": seconds * 1e3, "tokens_per_s": tokens_per_s,
                     "loss_after": loss, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30})  # fmt: skip
        model = opt = None  # free the GPU memory now (step() reads these names, so no del)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return rows


_BACKENDS = {"native": "native", "torchao": "torchao", "te": "transformer_engine"}


_COMPILE = "+compile"


def run_name(text: str) -> str:
    """``--runs`` entries: ``bf16``, ``<recipe>``, ``native:<recipe>``, ``torchao:<recipe>`` or ``te:<recipe>``, each
    optionally followed by ``+compile``."""
    base = text.removesuffix(_COMPILE)
    backend, _, recipe = base.rpartition(":")
    if base != "bf16" and (backend not in ("", *_BACKENDS) or recipe not in get_args(FP8Recipe)):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected 'bf16', a recipe {list(get_args(FP8Recipe))} or '<backend>:<recipe>' with a backend"
            f" of {list(_BACKENDS)}, optionally followed by {_COMPILE!r}"
        )
    return text


def _compiled(model: nn.Module, run: str) -> nn.Module:
    """``torch.compile(model)`` for a ``+compile`` run (after the FP8 swap), else ``model``."""
    return torch.compile(model) if run.endswith(_COMPILE) else model


def _config(run: str) -> FP8Config | None:
    run = run.removesuffix(_COMPILE)
    if run == "bf16":
        return None
    backend, _, recipe = run.rpartition(":")
    backend = _BACKENDS[backend or "native"]
    fmt = "e4m3" if backend == "torchao" and recipe == "mxfp8" else "hybrid"  # torchao's MX casts gradients to E4M3
    return FP8Config(recipe=recipe, backend=backend, format=fmt)


def swap(model: nn.Module, run: str) -> tuple[list[str], Callable[[], contextlib.AbstractContextManager]]:
    """Swap ``model``'s selected linear layers for ``run``'s FP8 layers through the backend seam; returns their names
    and the forward context factory. Raises what the backend raises (ModuleNotFoundError, ValueError)."""
    config = _config(run)
    if config is None:
        return [], contextlib.nullcontext
    backend = fp8_backend(config)  # a missing package or an impossible recipe is refused here
    names = select_fp8_modules(model, config)
    backend.convert_(model, names)
    return names, backend.forward_context


# ---------------------------------------------------------------------------------------------------- linear
class _Single(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.layer = nn.Linear(n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def bench_linear(sizes: list[int], runs: list[str], min_seconds: float) -> list[dict]:
    """One n x n linear layer on n tokens, forward + backward under BF16 autocast, per run."""
    rows = []
    for n in sizes:
        x = torch.randn(n, n, device="cuda", requires_grad=True)
        grad = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        for run in runs:
            model = _Single(n).cuda()
            config = _config(run)
            try:
                if config is None:
                    context = contextlib.nullcontext
                else:
                    backend = fp8_backend(config)
                    backend.convert_(model, ["layer"])  # by name: the default rule skips a model's only layer
                    context = backend.forward_context
                model = _compiled(model, run)

                def step():
                    with torch.autocast("cuda", dtype=torch.bfloat16), context():
                        y = model(x)
                    y.backward(grad.to(y.dtype))

                seconds = cuda_time(step, warmup=3, min_seconds=min_seconds)
            except Exception as err:  # noqa: BLE001 - a backend missing or failing on this GPU is a result
                rows.append({"n": n, "run": run, "skipped": f"{type(err).__name__}: {err}"[:300]})
                continue
            rows.append({"n": n, "run": run, "ms": seconds * 1e3, "tflops": 3 * 2 * n**3 / seconds / 1e12})
            model = None  # free the GPU memory now (step() reads this name, so no del)
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------------- main
RUNS = ["bf16", "delayed", "current", "mxfp8", "torchao:current", "torchao:mxfp8", "te:delayed", "te:current",
        "te:mxfp8", "bf16+compile", "delayed+compile", "current+compile", "torchao:current+compile"]  # fmt: skip
PARTS = ["gemm", "linear", "check", "model"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sizes up to 4096, a smaller model, shorter timing")
    parser.add_argument("--runs", nargs="+", type=run_name, default=RUNS,
                        help="bf16, <recipe>, native:<recipe>, torchao:<recipe> or te:<recipe>")  # fmt: skip
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS, help="which parts to run")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "gpu_fp8.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_fp8: skipped: CUDA is not available; this benchmark needs a GPU of compute capability >= 8.9.")
        return 0
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        name = torch.cuda.get_device_name()
        print(f"gpu_fp8: skipped: {name} has compute capability {capability}; FP8 GEMMs need >= 8.9.")
        return 0
    args.d_model, args.layers, args.seq_len, args.batch = (1024, 2, 512, 8) if args.quick else (2048, 4, 1024, 8)
    args.model_seconds = 1.0 if args.quick else 3.0
    sizes = [1024, 2048, 4096] if args.quick else [1024, 2048, 4096, 8192]

    started = time.perf_counter()
    timing = 0.2 if args.quick else 0.5
    parts = set(args.parts)
    gemm = bench_gemm(sizes, min_seconds=timing) if "gemm" in parts else []
    linear = bench_linear(sizes, args.runs, min_seconds=timing) if "linear" in parts else []
    check = [check_scaled_mm(recipe) for recipe in ("delayed", "current")] if "check" in parts else []
    model = bench_model(args.runs, args) if "model" in parts else []
    report = {
        "device": torch.cuda.get_device_name(), "capability": list(capability), "torch": torch.__version__,
        "python": platform.python_version(), "quick": args.quick, "seconds": time.perf_counter() - started,
        "model_shape": {"d_model": args.d_model, "layers": args.layers, "seq_len": args.seq_len, "batch": args.batch},
        "gemm": gemm, "linear": linear, "check": check, "model": model,
    }  # fmt: skip
    print(_tables(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    worst = max((max(row["y"], row["grad_x"], row["grad_w"]) for row in check), default=0.0)
    return 0 if worst < 1e-3 else 1  # NaN fails too


def _tables(report: dict) -> str:
    lines = [f"## {report['device']} (cc {report['capability']}), torch {report['torch']}", "",
             "| n | case | ms | TFLOP/s |", "| ---: | --- | ---: | ---: |"]  # fmt: skip
    lines += [f"| {r['n']} | {r['case']} | {r['ms']:.3f} | {r['tflops']:.0f} |" for r in report["gemm"]]
    lines += ["", "| n | run | ms (fwd+bwd) | TFLOP/s | speedup vs bf16 |", "| ---: | --- | ---: | ---: | ---: |"]
    bf16 = {r["n"]: r["ms"] for r in report["linear"] if r["run"] == "bf16" and "ms" in r}
    for r in report["linear"]:
        if "skipped" in r:
            lines.append(f"| {r['n']} | {r['run']} | skipped: {r['skipped']} | | |")
            continue
        speedup = f"{bf16[r['n']] / r['ms']:.2f}x" if r["n"] in bf16 else "-"
        lines.append(f"| {r['n']} | {r['run']} | {r['ms']:.3f} | {r['tflops']:.0f} | {speedup} |")
    lines += ["", "_scaled_mm against emulation (relative difference):", "",
              "| recipe | y | grad_x | grad_w |", "| --- | ---: | ---: | ---: |"]  # fmt: skip
    lines += [f"| {r['recipe']} | {r['y']:.2e} | {r['grad_x']:.2e} | {r['grad_w']:.2e} |" for r in report["check"]]
    lines += ["", "| run | FP8 layers | ms/step | tokens/s | speedup vs bf16 | peak GiB |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    base = next((r["ms_per_step"] for r in report["model"] if r["run"] == "bf16" and "ms_per_step" in r), None)
    for r in report["model"]:
        if "skipped" in r:
            lines.append(f"| {r['run']} | skipped: {r['skipped']} | | | | |")
            continue
        speedup = f"{base / r['ms_per_step']:.2f}x" if base else "-"
        lines.append(f"| {r['run']} | {r['swapped']} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:.0f} | {speedup} |"
                     f" {r['peak_mem_gib']:.1f} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

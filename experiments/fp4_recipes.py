"""Frontier formats on a CPU GPT: blockwise FP8 and NVFP4 (all layers, a measured budget, the fixed rule) vs BF16.

    .venv/bin/python experiments/fp4_recipes.py                 # 300 steps per run, minutes on 1 thread
    .venv/bin/python experiments/fp4_recipes.py --steps 30      # smoke run

The GPT of ``lit_mpstable.app.zoo`` (pre-LN, causal SDPA, d=128, 2 blocks, context 64, vocab 64) learns the
generated Markov-with-copy language of ``experiments/fp8_recipes.py`` (no downloads). Every run starts from the same
weights and sees the same batches; the base precision is ``torch.autocast("cpu", bfloat16)`` and the low-precision
runs add ``convert_to_fp8(model, FP8Config(...))`` on top, every format emulated exactly (native backend):

- ``blockwise``: DeepSeek-V3's blockwise FP8 (1x128 / 128x128 E4M3), first and last linear layers in BF16;
- ``nvfp4 all``: NVFP4 on every linear layer, the head included (the NVFP4 paper's divergence-prone case);
- ``nvfp4 probe``: NVFP4 everywhere, then at step ``max(1, steps // 100)`` (within the first 2%) the per-layer
  weight-gradient error is measured on that step's batch (``choose_high_precision``, one extra plain and one
  extra NVFP4 pass) and the costliest layers go back to BF16, at most 15% of the linear parameters;
- ``nvfp4 last``: NVFP4 with the fixed rule, the last layers holding up to 15% of the linear parameters in BF16;
- ``current first_last`` / ``current probe``: per-tensor FP8 with the default rule vs the probe's choice at the
  same parameter budget as first/last.

The gap is ``(held-out loss - bf16) / bf16``. Writes ``experiments/results/fp4_recipes/{table.md,curves.png,
results.json}``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_recipes import loss_of, markov_language  # noqa: E402

from lit_mpstable.app.zoo import GPT  # noqa: E402
from lit_mpstable.fp8 import (  # noqa: E402
    FP8Config,
    HighPrecisionBudget,
    choose_high_precision,
    convert_to_fp8,
    keep_high_precision_,
    layer_gradient_errors,
)
from lit_mpstable.fp8.budget import linear_weight_numel  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "fp4_recipes"


def runs(fraction: float) -> dict[str, tuple[FP8Config | None, bool]]:
    """name -> (config, probe at the early step)."""
    return {
        "bf16": (None, False),
        "blockwise": (FP8Config(recipe="blockwise"), False),
        "nvfp4 all": (FP8Config(recipe="nvfp4", keep_high_precision=[]), False),
        "nvfp4 probe": (FP8Config(recipe="nvfp4", keep_high_precision=HighPrecisionBudget(fraction)), True),
        "nvfp4 last": (FP8Config(recipe="nvfp4", keep_high_precision=HighPrecisionBudget(fraction, by="last")), False),
        "current first_last": (FP8Config(recipe="current"), False),
        "current probe": (FP8Config(recipe="current", keep_high_precision=HighPrecisionBudget(0.5)), True),
    }


def run(name: str, config: FP8Config | None, probe: bool, args, train, held_out) -> dict:
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.d_model, args.layers, args.heads, args.seq_len)
    sizes = linear_weight_numel(model)
    low = convert_to_fp8(model, config) if config else []
    budget = config.keep_high_precision if config is not None else None
    if name == "current probe":  # the same parameter budget the first/last rule spends
        first_last = [n for n in sizes if n not in convert_to_fp8(GPT(args.vocab, args.d_model, args.layers,
                                                                       args.heads, args.seq_len), "current")]
        budget = HighPrecisionBudget(sum(sizes[n] for n in first_last) / sum(sizes.values()) + 1e-9)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    )
    probe_step, probe_seconds, errors = max(1, args.steps // 100), 0.0, {}
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        batch = train[(step * args.batch) % len(train) :][: args.batch]
        if probe and step == probe_step:
            t0 = time.perf_counter()
            kept = choose_high_precision(model, low, loss_of, batch, budget, mode=args.probe_mode)
            probe_seconds = time.perf_counter() - t0
            # For the report (measured again, untimed).
            errors = layer_gradient_errors(model, low, loss_of, batch, mode=args.probe_mode)
            low = keep_high_precision_(model, low, kept)
        loss = loss_of(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        chunks = held_out.split(args.batch)
        held = sum(loss_of(model, chunk).item() for chunk in chunks) / len(chunks)
    high = [n for n in sizes if n not in low]
    return {
        "run": name,
        "low_layers": len(low),
        "high_precision": high if config else ["(all)"],
        "high_fraction": sum(sizes[n] for n in high) / sum(sizes.values()) if config else 1.0,
        "train_loss": sum(losses[-20:]) / len(losses[-20:]),
        "held_out_loss": held,
        "seconds": seconds,
        "probe_seconds": probe_seconds,
        "errors": errors,
        "curve": losses,
    }


def table(results: list[dict]) -> str:
    base = results[0]["held_out_loss"]
    lines = [
        "| run | low-precision layers | kept in BF16 (share of linear params) | train loss (last 20) | held-out loss"
        " | gap vs bf16 | s/step | probe s (share of run) |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        gap = (r["held_out_loss"] - base) / base
        kept = ", ".join(r["high_precision"]) or "none"
        probe = f"{r['probe_seconds']:.2f} ({r['probe_seconds'] / r['seconds']:.1%})" if r["probe_seconds"] else "-"
        lines.append(
            f"| {r['run']} | {r['low_layers']} | {kept} ({r['high_fraction']:.1%}) | {r['train_loss']:.4f} |"
            f" {r['held_out_loss']:.4f} | {gap:+.2%} | {r['seconds'] / len(r['curve']):.3f} | {probe} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--runs", nargs="+", default=None, help="subset of run names (default: all)")
    parser.add_argument("--fraction", type=float, default=0.15)
    parser.add_argument("--probe-mode", choices=["all", "each"], default="all",
                        help="choose_high_precision's mode: one pass with every layer low, or one pass per layer")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    train = markov_language(args.vocab, args.seq_len, args.steps * args.batch, seed=args.seed + 1)
    held_out = markov_language(args.vocab, args.seq_len, 8 * args.batch, seed=args.seed + 2)
    plan = runs(args.fraction)
    names = ["bf16", *[n for n in (args.runs or plan) if n != "bf16"]]
    results = []
    for name in names:
        config, probe = plan[name]
        results.append(run(name, config, probe, args, train, held_out))
        last = results[-1]
        print(f"{name}: held-out {last['held_out_loss']:.4f}, kept {last['high_precision']} ({last['seconds']:.0f} s)",
              flush=True)
    text = table(results)
    print(text)

    args.out.mkdir(parents=True, exist_ok=True)
    command = "python experiments/fp4_recipes.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    setup = (
        f"lit_mpstable.app.zoo.GPT d={args.d_model}, {args.layers} blocks, {args.heads} heads, context"
        f" {args.seq_len}, vocab {args.vocab}; {args.steps} steps of {args.batch} sequences, AdamW lr {args.lr}"
        f" (warmup 20, cosine), clip 1.0; base bf16 autocast on CPU, {args.threads} thread(s); torch"
        f" {torch.__version__}. Every low-precision format emulated exactly (native backend: quantise, dequantise,"
        f" fp32 matmul). Budget runs keep at most {args.fraction:.0%} of the linear parameters in BF16 (current"
        f" probe: the share first/last keeps). The probe (mode {args.probe_mode!r}) measures at step"
        f" {max(1, args.steps // 100)}, on that step's batch. One seed: differences of a few tenths of a percent are"
        " within run-to-run noise."
    )
    probed = [r for r in results if r["errors"]]
    errors = ""
    for r in probed:
        ranked = sorted(r["errors"].items(), key=lambda kv: kv[1], reverse=True)
        errors += f"\n\n{r['run']}: the probe's per-layer error (mode {args.probe_mode!r}): " + ", ".join(
            f"{n} {e:.3f}" for n, e in ranked)
    (args.out / "table.md").write_text(
        f"# Frontier formats (blockwise FP8, NVFP4) and the high-precision budget, against BF16\n\n{setup}\n\n{text}"
        f"{errors}\n\nReproduce: `{command.strip()}`\n"
    )
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    _plot(results, args.out / "curves.png")
    print(f"wrote {args.out}")


def _plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        return
    fig, (ax, bar) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        curve = torch.tensor(r["curve"])
        smooth = curve.unfold(0, 10, 1).mean(1) if len(curve) >= 10 else curve
        ax.plot(range(len(curve) - len(smooth), len(curve)), smooth, label=r["run"])
    ax.set(xlabel="step", ylabel="train loss (10-step mean)", title="training loss", yscale="log")
    ax.legend(fontsize=8)
    base = results[0]["held_out_loss"]
    gaps = [100 * (r["held_out_loss"] - base) / base for r in results]
    bar.barh([r["run"] for r in results], gaps, color=["grey" if g <= 0 else "tab:red" for g in gaps])
    bar.axvline(1.5, ls="--", c="k", lw=0.8)
    bar.set(xlabel="held-out loss gap vs bf16 (%)", title="final gap (dashed: NVFP4 target 1.5%)")
    bar.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()

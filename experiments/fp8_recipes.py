"""Does FP8 training keep up with BF16? Final loss of each FP8 recipe (delayed, current, mxfp8) against BF16.

    .venv/bin/python experiments/fp8_recipes.py                 # 300 steps per run, a few minutes on 1 thread
    .venv/bin/python experiments/fp8_recipes.py --steps 30      # smoke run

A small GPT (pre-LN, causal attention, d=128, 2 layers, context 64) learns a generated language in plain PyTorch:
each sequence is a walk of a sparse random Markov chain (every token has 4 likely successors) whose second half
repeats its first half, so both bigram statistics and attention (copying) pay off. No downloads: the data comes
from a seeded generator. Every run starts from the same weights and sees the same batches; the base precision is
``torch.autocast("cpu", bfloat16)`` and the FP8 runs add ``convert_to_fp8(model, recipe)`` on top (the first and
last linear layers stay in BF16, the default filter). Writes a Markdown table and a loss-curve figure to
``experiments/results/``; the gap is ``(loss - bf16) / bf16`` on held-out sequences, the goal is within 2%.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from lit_mpstable.fp8 import convert_to_fp8, fp8_stats  # noqa: E402
from lit_mpstable.fp8.gemm import _scaled_mm_decision  # noqa: E402
from lit_mpstable.fp8.swap import collect_fp8_stats_  # noqa: E402


def _gemm_path(recipe: str) -> str:
    """How FP8Config(emulate=None) runs this recipe's GEMMs on the CPU (emulated, except delayed scaling)."""
    return "torch._scaled_mm" if _scaled_mm_decision(None, "cpu", recipe == "delayed") else "emulated"

GOAL = 0.02


# ---------------------------------------------------------------------------------------------------- data
def markov_language(vocab: int, seq_len: int, n: int, *, seed: int) -> torch.Tensor:
    """``n`` sequences of ``seq_len + 1`` tokens: a Markov walk of length ``(seq_len + 1) // 2``, then its copy."""
    gen = torch.Generator().manual_seed(1234)  # the language is fixed; `seed` only picks the sequences
    successors = torch.stack([torch.randperm(vocab, generator=gen)[:4] for _ in range(vocab)])
    weights = torch.tensor([0.55, 0.25, 0.15, 0.05])
    gen.manual_seed(seed)
    half = (seq_len + 2) // 2
    walk = torch.empty(n, half, dtype=torch.long)
    walk[:, 0] = torch.randint(vocab, (n,), generator=gen)
    for t in range(1, half):
        choice = torch.multinomial(weights.expand(n, 4), 1, generator=gen).squeeze(1)
        walk[:, t] = successors[walk[:, t - 1], choice]
    return torch.cat([walk, walk], dim=1)[:, : seq_len + 1]


# --------------------------------------------------------------------------------------------------- model
class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


# ---------------------------------------------------------------------------------------------------- runs
def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def run(recipe: str | None, args: argparse.Namespace, train: torch.Tensor, held_out: torch.Tensor) -> dict:
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.d_model, args.layers, args.heads, args.seq_len)
    swapped = convert_to_fp8(model, recipe) if recipe else []
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    )
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        if step == args.steps - 1:
            collect_fp8_stats_(model)  # telemetry costs a few passes per tensor: the last step only
        batch = train[(step * args.batch) % len(train) :][: args.batch]
        loss = loss_of(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    stats = fp8_stats(model).get("total", {})
    model.eval()
    with torch.no_grad():
        chunks = held_out.split(args.batch)
        held = sum(loss_of(model, chunk).item() for chunk in chunks) / len(chunks)
    return {
        "run": recipe or "bf16",
        "swapped": len(swapped),
        "train_loss": sum(losses[-20:]) / len(losses[-20:]),
        "held_out_loss": held,
        "seconds": seconds,
        "saturation": float(stats.get("fp8_saturation_frac", 0.0)),
        "underflow": float(stats.get("fp8_underflow_frac", 0.0)),
        "curve": losses,
    }


def table(results: list[dict]) -> str:
    base = results[0]["held_out_loss"]
    lines = [
        "| run | FP8 layers | train loss (last 20) | held-out loss | gap vs bf16 | within 2% | FP8 saturation"
        " | FP8 underflow | s/step |",
        "| --- | ---: | ---: | ---: | ---: | :---: | ---: | ---: | ---: |",
    ]
    for r in results:
        gap = (r["held_out_loss"] - base) / base
        fp8 = r["run"] != "bf16"
        within = ("yes" if abs(gap) <= GOAL else "no") if fp8 else "-"
        saturation = f"{r['saturation']:.2e}" if fp8 else "-"
        underflow = f"{r['underflow']:.2e}" if fp8 else "-"
        lines.append(
            f"| {r['run']} | {r['swapped']} | {r['train_loss']:.4f} | {r['held_out_loss']:.4f} | {gap:+.2%} |"
            f" {within} | {saturation} | {underflow} | {r['seconds'] / len(r['curve']):.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--recipes", nargs="+", default=["delayed", "current", "mxfp8"])
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "fp8_recipes.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    train = markov_language(args.vocab, args.seq_len, args.steps * args.batch, seed=args.seed + 1)
    held_out = markov_language(args.vocab, args.seq_len, 8 * args.batch, seed=args.seed + 2)
    results = []
    for recipe in [None, *args.recipes]:
        results.append(run(recipe, args, train, held_out))
        last = results[-1]
        print(f"{last['run']}: held-out loss {last['held_out_loss']:.4f} ({last['seconds']:.0f} s)")
    text = table(results)
    print(text)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = "python experiments/fp8_recipes.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    setup = (
        f"GPT d={args.d_model}, {args.layers} layers, {args.heads} heads, context {args.seq_len}, vocab {args.vocab};"
        f" {args.steps} steps of {args.batch} sequences, AdamW lr {args.lr} (warmup 20, cosine), clip 1.0; base"
        f" bf16 autocast on CPU, {args.threads} thread(s); torch {torch.__version__}. FP8 GEMMs of delayed/current:"
        f" {_gemm_path('delayed')}/{_gemm_path('current')}; mxfp8: emulated (quantise, dequantise,"
        " fp32 matmul). FP8 saturation/underflow: element-weighted fractions over all FP8 operands on the last"
        " training step. s/step is wall time on a shared machine: FP8 on a CPU is slower than BF16 by design."
    )
    args.out.write_text(f"# FP8 recipes against BF16\n\n{setup}\n\n{text}\n\nReproduce: `{command.strip()}`\n")
    figure = _plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out}" + (f" and {figure}" if figure else ""))


def _plot(results: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        curve = torch.tensor(r["curve"])
        smooth = curve.unfold(0, 10, 1).mean(1) if len(curve) >= 10 else curve
        ax.plot(range(len(curve) - len(smooth), len(curve)), smooth, label=r["run"])
    ax.set(xlabel="step", ylabel="train loss (10-step mean)", title="FP8 recipes vs BF16", yscale="log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()

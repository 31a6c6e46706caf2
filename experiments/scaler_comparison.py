"""Which loss scaler reaches a good FP16 scale fastest and keeps underflow low, and what does it cost per step?

Compares DynamicLossScaler() (GradScaler's defaults), DynamicLossScaler(hysteresis=2) and AdaptiveLossScaler on a
small causal GPT (pre-norm transformer blocks from torch.nn) learning a random bigram language, in two regimes: the
loss multiplied by 2**12 (huge gradients, ideal FP16 scale far below 2**16) and by 2**-14 (tiny gradients, ideal
scale far above 2**16).

FP16 gradients are *simulated*: FP16 arithmetic is emulated and ~100x slower on the CPU, so the model runs in FP32
and the scaled gradients are cast to FP16 and back before unscaling. That reproduces exactly what FP16 storage does to
the final parameter gradients (overflow to inf, flush to zero), but not overflow or underflow inside the backward
pass of a real FP16 model. The overhead and telemetry measurements run the GPT-like model in FP32 with a scaler.

Reproduce (one CPU thread, ~10 minutes):  python experiments/scaler_comparison.py
Writes experiments/results/scaler_comparison.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from lit_mpstable.core.scaling.adaptive_scaler import AdaptiveLossScaler  # noqa: E402
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler  # noqa: E402
from lit_mpstable.core.telemetry import GradTelemetry, grad_stats  # noqa: E402

RESULTS = Path(__file__).parent / "results"
VOCAB = 1000
SCALERS = {
    "DynamicLossScaler() (GradScaler defaults)": lambda: DynamicLossScaler("cpu"),
    "DynamicLossScaler(hysteresis=2)": lambda: DynamicLossScaler("cpu", hysteresis=2),
    "AdaptiveLossScaler()": lambda: AdaptiveLossScaler("cpu"),
    "AdaptiveLossScaler(headroom=1)": lambda: AdaptiveLossScaler("cpu", headroom=1.0),
    "AdaptiveLossScaler(max_scale=None)": lambda: AdaptiveLossScaler("cpu", max_scale=None),
}
REFERENCE = "DynamicLossScaler() (GradScaler defaults)"
CASES = {"huge gradients (loss x 2**12)": 2.0**12, "tiny gradients (loss x 2**-14)": 2.0**-14}
FP16_MAX = torch.finfo(torch.float16).max


def markov_batches(steps: int, batch: int, seq: int, seed: int = 0) -> list[torch.Tensor]:
    """Token sequences from a fixed random bigram chain: real structure for the model to learn, no download."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)  # each token has 4 likely successors
    batches = []
    for _ in range(steps):
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB, (batch,), generator=g)
        for t in range(seq):
            choice = torch.randint(0, 4, (batch,), generator=g)
            tokens[:, t + 1] = successors[tokens[:, t], choice]
        batches.append(tokens)
    return batches


class MiniGPT(nn.Module):
    """Decoder-only transformer: token and position embeddings, pre-norm causal self-attention blocks, LM head."""

    def __init__(self, d: int = 64, heads: int = 2, ffn: int = 128, layers: int = 2, max_len: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(max_len, d)
        block = nn.TransformerEncoderLayer(d, heads, ffn, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t))
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))


def small_gpt(seed: int = 0, **kwargs: int) -> MiniGPT:
    torch.manual_seed(seed)
    return MiniGPT(**kwargs)


def lm_loss(model: MiniGPT, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def run(make_scaler, loss_mult: float, batches: list[torch.Tensor]) -> dict[str, list[float]]:
    """Train with one scaler; per step: the scale used, skipped, FP16 underflow fraction and the ideal scale."""
    model = small_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = make_scaler()
    log: dict[str, list[float]] = {"scale": [], "skipped": [], "underflow": [], "ideal": [], "loss": []}
    for tokens in batches:
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model, tokens)
        scale = scaler.get_scale()
        scaler.scale(loss * loss_mult).backward()
        # What FP16 would store: measure the flush-to-zero fraction of the scaled gradients, then cast them.
        log["underflow"].append(grad_stats(model, formats=["fp16"]).underflow_frac["fp16"].item())
        amax = max(p.grad.abs().max().item() for p in model.parameters()) / scale  # true (unscaled) amax
        log["ideal"].append(2.0 ** math.floor(math.log2(FP16_MAX / amax)) if 0 < amax < math.inf else math.nan)
        for p in model.parameters():
            p.grad = p.grad.half().float()
        scaler.step(opt)
        scaler.update()
        log["scale"].append(scale)
        log["skipped"].append(float(scaler.last_step_skipped))
        log["loss"].append(loss.item())
    return log


def summarise(log: dict[str, list[float]], reference: dict[str, list[float]]) -> dict[str, float]:
    n = len(log["scale"])
    tail = slice(n // 3, n)  # steady state: the last two thirds
    steady = 2.0 ** statistics.median(math.log2(s) for s in log["scale"][tail])
    settle = n
    for k in range(n - 1, -1, -1):
        if not steady / 2 <= log["scale"][k] <= steady * 2:
            break
        settle = k
    # Underflow compared where both scalers applied their step; "lost" counts a skipped step as all of it lost.
    both_applied = [
        (a, r) for a, r, sa, sr in zip(log["underflow"], reference["underflow"], log["skipped"], reference["skipped"])
        if not sa and not sr
    ]
    above = [a - r for a, r in both_applied if a > r]
    lost = [1.0 if sk else u for u, sk in zip(log["underflow"], log["skipped"])]
    lost_ref = [1.0 if sk else u for u, sk in zip(reference["underflow"], reference["skipped"])]
    ideal = [v for v in log["ideal"][tail] if not math.isnan(v)]
    return {
        "steady_scale": steady,
        "ideal_scale": 2.0 ** statistics.median(math.log2(v) for v in ideal),
        "steps_to_2x": settle,
        "overflow_rate_steady": sum(log["skipped"][tail]) / len(log["skipped"][tail]),
        "overflow_steps_total": sum(log["skipped"]),
        "underflow_mean": statistics.fmean(log["underflow"]),
        "underflow_steady": statistics.fmean(log["underflow"][tail]),
        "steps_underflow_above_ref": len(above),
        "max_underflow_excess": max(above, default=0.0),
        "steps_lost_above_ref": sum(a > r for a, r in zip(lost, lost_ref)),
        "steps_raw_underflow_above_ref": sum(a > r for a, r in zip(log["underflow"], reference["underflow"])),
        "final_loss": statistics.fmean(log["loss"][-20:]),
    }


# ------------------------------------------------------------------------------------------------ cost
def overhead(pairs: int) -> dict[str, float]:
    """Per-step time of a GPT-like FP32 step with DynamicLossScaler vs AdaptiveLossScaler.

    The two alternate step by step, swapping which goes first in every pair; the whole-step overhead is the
    geometric mean of the median per-pair time ratio for each order (which cancels both the slow drift of a shared
    machine's load and any first/second position effect).
    """
    data = markov_batches(8, 8, 64, seed=1)
    setups = {}
    for name, make in (("dynamic", lambda: DynamicLossScaler("cpu")), ("adaptive", lambda: AdaptiveLossScaler("cpu"))):
        model = small_gpt(d=128, heads=4, ffn=512)
        setups[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), make())
    step_times: dict[str, list[float]] = {name: [] for name in setups}
    scaler_times: dict[str, list[float]] = {name: [] for name in setups}

    def step(name: str, tokens: torch.Tensor) -> None:
        model, opt, scaler = setups[name]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        scaler.scale(lm_loss(model, tokens)).backward()
        t1 = time.perf_counter()
        scaler.unscale_(opt)
        t2 = time.perf_counter()
        scaler.step(opt)
        t3 = time.perf_counter()
        scaler.update()
        t4 = time.perf_counter()
        step_times[name].append(t4 - t0)
        scaler_times[name].append((t2 - t1) + (t4 - t3))  # unscale_ + update; step() is the optimizer's work

    for i in range(pairs + 3):
        if i == 3:  # warm-up done
            for times in (*step_times.values(), *scaler_times.values()):
                times.clear()
        for name in list(setups) if i % 2 == 0 else list(reversed(setups)):
            step(name, data[i % len(data)])
    ratios = [a / d for a, d in zip(step_times["adaptive"], step_times["dynamic"])]
    paired = math.sqrt(statistics.median(ratios[0::2]) * statistics.median(ratios[1::2]))
    med = {name: statistics.median(times) for name, times in step_times.items()}
    scaler_med = {name: statistics.median(times) for name, times in scaler_times.items()}

    # Telemetry on the same model's gradients, every format, total and per module.
    model, _, _ = setups["dynamic"]
    telemetry_times: dict[str, list[float]] = {"total": [], "per_module": []}
    for _ in range(10):
        for key in telemetry_times:
            t0 = time.perf_counter()
            grad_stats(model, scale=2.0**16, per_module=key == "per_module").to_floats()
            telemetry_times[key].append(time.perf_counter() - t0)
    telemetry = {key: statistics.median(times) for key, times in telemetry_times.items()}
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "step_ms_dynamic": med["dynamic"] * 1e3,
        "step_ms_adaptive": med["adaptive"] * 1e3,
        "step_overhead_pct": (paired - 1) * 100,
        "scaler_ms_dynamic": scaler_med["dynamic"] * 1e3,
        "scaler_ms_adaptive": scaler_med["adaptive"] * 1e3,
        "scaler_overhead_pct_of_step": (scaler_med["adaptive"] - scaler_med["dynamic"]) / med["dynamic"] * 100,
        "telemetry_ms": telemetry["total"] * 1e3,
        "telemetry_per_module_ms": telemetry["per_module"] * 1e3,
        "telemetry_pct_of_step": telemetry["total"] / med["dynamic"] * 100,
        "telemetry_default_n": GradTelemetry().every_n_steps,
        "samples": len(step_times["dynamic"]),
    }


# ------------------------------------------------------------------------------------------------ output
def figure(logs: dict[str, dict[str, dict[str, list[float]]]], path: Path) -> None:
    fig, axes = plt.subplots(1, len(logs), figsize=(6 * len(logs), 4.2), sharey=False)
    for ax, (case, per_scaler) in zip(axes, logs.items()):
        for (name, log), style in zip(per_scaler.items(), ["-", "--", "-", "-.", ":"]):
            steps = range(1, len(log["scale"]) + 1)
            ax.plot(steps, [math.log2(s) for s in log["scale"]], style, label=name, lw=2.5 if style == "-" else 1.5)
        ideal = per_scaler[REFERENCE]["ideal"]
        ax.plot(range(1, len(ideal) + 1), [math.log2(v) for v in ideal], "k", lw=0.6, alpha=0.5,
                label="ideal (no headroom)")
        ax.set_xscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("log2(loss scale)")
        ax.set_title(case)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Loss-scale trajectories, FP16 gradients simulated by casting (FP32 model)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown(summary: dict, cost: dict | None, args: argparse.Namespace) -> str:
    lines = [
        "# Loss scalers on a small GPT-like model with (simulated) FP16 gradients",
        "",
        f"Command: `python experiments/scaler_comparison.py --steps {args.steps}`"
        f" (torch {torch.__version__}, one CPU thread).",
        "",
        f"Model: a causal GPT (vocab {VOCAB}, d=64, 2 heads, FFN 128, 2 pre-norm blocks, no dropout; the script's",
        "MiniGPT), AdamW lr 1e-3, batch 8x32 tokens from a fixed random bigram chain (4 successors per token, so the",
        f"loss plateaus near ln 4 = 1.39), {args.steps} steps, same init and data for every scaler.",
        "**FP16 gradients are simulated**: the model runs in FP32 and the scaled parameter gradients are",
        "cast to FP16 and back before unscaling (exactly FP16's overflow-to-inf and flush-to-zero for the stored",
        "gradients; overflow inside a real FP16 backward is not modelled).",
        "",
        "- *steady scale*: median (geometric) scale over the last two thirds of the run; *ideal*: median largest power",
        "  of two with amax x scale <= 65504 (no headroom) over the same steps.",
        "- *steps to 2x*: first step from which the scale stays within 2x of the steady scale.",
        "- *overflow (steady)*: skipped steps / steps in the last two thirds.",
        "- *underflow*: fraction of nonzero scaled gradient elements that flush to zero in FP16, mean over all steps",
        "  and over the steady part. Compared with the reference, " + REFERENCE + ", at the same step (each scaler",
        "  trains its own copy from the same start): *underflow > ref* counts steps where both applied their update",
        "  and this scaler flushed a larger fraction (max excess in brackets); *lost > ref* counts steps where it lost",
        "  more of the gradient, a skipped step losing all of it; *raw > ref* compares the flush fraction on every",
        "  step, skipped or not.",
        "",
    ]
    for case, rows in summary.items():
        lines += [
            f"## {case}",
            "",
            "| scaler | steady scale | ideal | steps to 2x | overflow (steady) | skipped (all) | underflow mean"
            " | underflow steady | underflow > ref (max excess) | lost > ref | raw > ref | final loss |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, s in rows.items():
            lines.append(
                f"| {name} | 2^{math.log2(s['steady_scale']):.0f} | 2^{math.log2(s['ideal_scale']):.0f}"
                f" | {s['steps_to_2x']} | {s['overflow_rate_steady']:.2%} | {s['overflow_steps_total']:.0f}"
                f" | {s['underflow_mean']:.2e} | {s['underflow_steady']:.2e}"
                f" | {s['steps_underflow_above_ref']} ({s['max_underflow_excess']:.1e}) | {s['steps_lost_above_ref']}"
                f" | {s['steps_raw_underflow_above_ref']} | {s['final_loss']:.3f} |"
            )
        lines.append("")
    if cost:
        lines += [
            "## Cost per step (GPT-like model, FP32, one CPU thread)",
            "",
            f"MiniGPT, vocab {VOCAB}, d=128, 4 heads, FFN 512, 2 blocks"
            f" ({cost['params'] / 1e6:.2f}M parameters), batch 8x64, AdamW; medians over {cost['samples']} steps per"
            " scaler, alternating step by step; the paired overhead is the geometric mean, over both orders, of the"
            " median per-pair time ratio.",
            "",
            "| measurement | value |",
            "|---|---|",
            f"| step with DynamicLossScaler | {cost['step_ms_dynamic']:.1f} ms |",
            f"| step with AdaptiveLossScaler | {cost['step_ms_adaptive']:.1f} ms"
            f" (paired: {cost['step_overhead_pct']:+.2f}%) |",
            f"| unscale_ + update, DynamicLossScaler | {cost['scaler_ms_dynamic']:.3f} ms |",
            f"| unscale_ + update, AdaptiveLossScaler | {cost['scaler_ms_adaptive']:.3f} ms"
            f" ({cost['scaler_overhead_pct_of_step']:+.2f}% of a step) |",
            f"| grad_stats, 4 formats, total | {cost['telemetry_ms']:.1f} ms ({cost['telemetry_pct_of_step']:.1f}% of a"
            " step) |",
            f"| grad_stats, 4 formats, per module | {cost['telemetry_per_module_ms']:.1f} ms |",
            f"| GradTelemetry() every {cost['telemetry_default_n']} steps | "
            f"{cost['telemetry_pct_of_step'] / cost['telemetry_default_n']:.2f}% of a step on average |",
            "",
            "Whole-step times on a shared machine carry a few percent of noise; the unscale_ + update row isolates",
            "the scaler's own work.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--overhead-pairs", type=int, default=200)
    parser.add_argument("--skip-cost", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    RESULTS.mkdir(parents=True, exist_ok=True)

    batches = markov_batches(args.steps, 8, 32)
    logs: dict[str, dict[str, dict[str, list[float]]]] = {}
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for case, mult in CASES.items():
        logs[case] = {}
        for name, make in SCALERS.items():
            t0 = time.perf_counter()
            logs[case][name] = run(make, mult, batches)
            print(f"{case} | {name}: {time.perf_counter() - t0:.0f}s", flush=True)
        summary[case] = {name: summarise(log, logs[case][REFERENCE]) for name, log in logs[case].items()}
    cost = None if args.skip_cost else overhead(args.overhead_pairs)

    figure(logs, RESULTS / "scaler_comparison.png")
    (RESULTS / "scaler_comparison.json").write_text(json.dumps({"summary": summary, "cost": cost}, indent=1))
    text = markdown(summary, cost, args)
    (RESULTS / "scaler_comparison.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

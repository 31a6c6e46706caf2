"""Does QKClip keep an attention-logit growth run finite where it diverges without? (issue #46)

    .venv/bin/python experiments/indicators/qk_clip.py                        # 2 seeds x {off, on}
    .venv/bin/python experiments/indicators/qk_clip.py --seeds 1 --steps 40   # smoke run

``make run``'s GPT (``lit_mpstable.app.zoo.GPTLM``: d 128, 2 blocks, 4 heads, no QK norm) on the standard-library
characters, through the Trainer with ``StablePrecision(--precision)`` (bf16-mixed) and AdamW, at a high LR
(``--lr``, warmup
``--warmup`` then cosine, as ``GPTLM`` schedules it; ``--qkv-lr`` gives the attention's qkv projections their own
LR, so that only the attention logits are pushed), with and without ``QKClip(threshold=--threshold)``.
``OverflowMonitor(attention=True, log_every_n_steps=1)`` reads the per-head max attention logit every step (the
logits of the step's forward, before QKClip's rescale). A run **diverges** when its training loss is not finite or
above its first loss (5.3: nothing learnt) for the last 10 steps. Writes ``qk_clip.json``, ``qk_clip.md`` and
``qk_clip.png`` under ``experiments/results/indicators/``.

``--block mha`` builds the same GPT from ``nn.MultiheadAttention`` blocks called as most code calls them
(``attn(x, x, x, attn_mask=causal)``: ``need_weights`` left at its default, True, so PyTorch computes the logits with an
explicit ``bmm``, not the fused SDPA kernel). Under ``--precision 16-mixed`` that product runs in FP16, so a logit
above 65504 becomes inf and the softmax NaN: there the attention logits are what kills the run. ``--qkv-lr`` then
applies to ``in_proj_weight``/``in_proj_bias`` (W_q, W_k, W_v).

    .venv/bin/python experiments/indicators/qk_clip.py --block mha --precision 16-mixed --seeds 3 \
        --out experiments/results/indicators/qk_clip_fp16_mha
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import lightning.pytorch as pl  # noqa: E402
from torch import nn  # noqa: E402

from lit_mpstable import StablePrecision  # noqa: E402
from lit_mpstable.app.zoo import GPTLM, CharLMData  # noqa: E402
from lit_mpstable.callbacks import OverflowMonitor, QKClip  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "results" / "indicators"


class Trace(pl.Callback):
    def __init__(self, monitor: OverflowMonitor) -> None:
        self.monitor, self.losses, self.logits = monitor, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, *args) -> None:
        self.losses.append(float(outputs["loss"]))
        self.logits.append(max((max(v) for v in self.monitor.latest_attention.values()), default=float("nan")))


class AttentionLR(GPTLM):
    """GPTLM whose attention input projections (``qkv``) train at ``qkv_lr``, the rest at ``lr``: a run whose only
    unstable part is the attention logits."""

    def __init__(self, *args, qkv_lr: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.qkv_lr = qkv_lr

    def configure_optimizers(self):
        config = super().configure_optimizers()
        opt = config["optimizer"]
        qkv = {id(p) for name, p in self.named_parameters() if ".qkv." in name or ".in_proj_" in name}
        group = opt.param_groups[0]
        params = group["params"]
        group["params"] = [p for p in params if id(p) not in qkv]
        opt.add_param_group({"params": [p for p in params if id(p) in qkv], "lr": self.qkv_lr})
        config["lr_scheduler"]["scheduler"] = type(config["lr_scheduler"]["scheduler"])(
            opt, config["lr_scheduler"]["scheduler"].lr_lambdas[0])
        return config


class MHABlock(nn.Module):
    """The zoo GPT's block with ``nn.MultiheadAttention`` (pre-norm, causal, no QK norm)."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_heads, batch_first=True)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)  # True: masked
        x = x + self.attn(h, h, h, attn_mask=causal)[0]  # need_weights' default (True): an explicit q.k^T product
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


def run(clip: bool, seed: int, args: argparse.Namespace) -> dict:
    pl.seed_everything(seed, verbose=False)
    data = CharLMData(seq_len=64, batch_size=16)
    model = AttentionLR(len(stdlib_vocab(data)), lr=args.lr, warmup_steps=args.warmup, total_steps=args.steps,
                        qkv_lr=args.qkv_lr if args.qkv_lr is not None else args.lr)
    if args.block == "mha":
        gpt = model.model
        gpt.blocks = nn.ModuleList(MHABlock(gpt.ln_f.normalized_shape[0], 4) for _ in gpt.blocks)
    monitor = OverflowMonitor(log_every_n_steps=1, attention=True)
    trace = Trace(monitor)
    callbacks = [monitor, trace] + ([QKClip(threshold=args.threshold)] if clip else [])
    plugin = StablePrecision(args.precision)
    trainer = pl.Trainer(accelerator="cpu", max_steps=args.steps, plugins=[plugin],
                         callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False, logger=False,
                         enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=data)
    tail = trace.losses[-10:]
    diverged = any(not math.isfinite(x) or x > trace.losses[0] for x in tail)
    clipped = int(callbacks[-1].heads_clipped) if clip else 0
    bad = [i for i, x in enumerate(trace.losses) if not math.isfinite(x)]
    return {"clip": clip, "seed": seed, "losses": trace.losses, "logits": trace.logits, "diverged": diverged,
            "nonfinite_steps": len(bad), "first_nonfinite_step": bad[0] + 1 if bad else None,
            "skipped_steps": int(plugin.skipped_steps), "block": args.block, "precision": args.precision,
            "max_logit": max(x for x in trace.logits if math.isfinite(x)), "final_loss": tail[-1],
            "heads_clipped": clipped}


def stdlib_vocab(data: CharLMData) -> list[str]:
    return data.vocab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threshold", type=float, default=100.0)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--qkv-lr", type=float, default=1.0, help="LR of the qkv projections")
    parser.add_argument("--block", choices=("zoo", "mha"), default="zoo",
                        help="zoo: the zoo GPT's SDPA block; mha: nn.MultiheadAttention blocks")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    for seed in range(args.seeds):
        for clip in (False, True):
            r = run(clip, seed, args)
            results.append(r)
            print(f"seed {seed} clip={clip}: diverged={r['diverged']} final loss {r['final_loss']:.3g} max logit"
                  f" {r['max_logit']:.3g} heads clipped {r['heads_clipped']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    cpu = f"{platform.processor() or platform.machine()}, torch {torch.__version__}, threads 1, {os.cpu_count()} cpus"
    (args.out / "qk_clip.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "cpu": cpu, "runs": results}, indent=1))
    lines = ["| seed | QKClip | diverged | final loss | non-finite losses (first step) | steps skipped |"
             " max attention logit | head-steps clipped |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['seed']} | {'on' if r['clip'] else 'off'} | {r['diverged']} | {r['final_loss']:.3g} |"
              f" {r['nonfinite_steps']} ({r['first_nonfinite_step'] or '-'}) | {r['skipped_steps']} |"
              f" {r['max_logit']:.3g} | {r['heads_clipped']} |" for r in results]
    lines += ["", f"CPU: {cpu}", "", "Command: `" + " ".join(["python", *sys.argv]) + "`"]
    (args.out / "qk_clip.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        style = "-" if r["clip"] else "--"
        label = f"seed {r['seed']} QKClip {'on' if r['clip'] else 'off'}"
        line, = a.plot(r["losses"], style, lw=0.8, label=label)
        bad = [i for i, x in enumerate(r["losses"]) if not math.isfinite(x)]
        if bad:  # a NaN loss draws nothing: marked at the top
            a.plot(bad, [9.6] * len(bad), "|", color=line.get_color(), ms=4)
        b.plot(r["logits"], style, lw=0.8, label=label)
    a.set(xlabel="step", ylabel="train loss", ylim=(0, 10),
          title=f"GPT ({args.block} attention, {args.precision}), LR {args.lr:g}, attention LR {args.qkv_lr:g}"
                "\n(| at the top: a non-finite loss)")
    if args.precision.startswith("16"):
        b.axhline(65504, color="k", lw=0.6, ls=":", label="FP16 max (65504)")
    b.set(xlabel="step", ylabel="max attention logit", yscale="log",
          title=f"per-step max q.k/sqrt(d) (threshold {args.threshold:g})")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out / "qk_clip.png", dpi=120)


if __name__ == "__main__":
    main()

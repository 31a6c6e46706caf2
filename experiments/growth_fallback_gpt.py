"""The growth fallback on the CPU GPT: a massive activation in each MLP, FP8 current scaling, 5 seeds.

    PYTHONPATH=. .venv/bin/python experiments/growth_fallback_gpt.py [--seeds 5 --steps 300 --workers 2]

#29's target: with ``PrecisionFallback(on_growth=True)``, only the affected layers leave FP8 and the run ends within
0.5% of BF16's loss. The model and data are ``make run``'s: ``lit_mpstable.app.zoo.GPTLM`` (d 128, 2 blocks, AdamW
lr 3e-3, warmup 20, cosine over the run) on ``CharLMData``, through the Trainer with ``StablePrecision("bf16-mixed",
fp8=..., growth_every_n_steps=10)`` and ``OverflowMonitor``. Every variant of a seed starts from the same weights and
sees the same batches.

The injection (``DeadChannelGPT``). In every block, hidden unit 0 of the MLP turns into a massive activation (Sun et
al. 2024: a few units 1e3-1e4x the rest, nearly constant over tokens, acting as biases): from step ``GROW_FROM`` its
bias in ``fc`` grows 20% a step until unit 0's amax on a fixed probe batch is ``--cap`` (1e8) x every other unit's.
Its column of ``out`` (the MLP's down projection) is zero and receives no gradient (a hook), so in exact arithmetic
and in BF16 the network never sees unit 0: the BF16 run with the growth ends bit for bit where the clean BF16 run
ends (checked per seed). In FP8, ``out``'s per-tensor input scale is 448 / amax: once unit 0 is ~2**17x the rest,
E4M3 flushes every other unit and both MLPs go silent, with no NaN and no overflow. Only the bias grows, so ``fc``'s
FP8 weight keeps its range. ``--grow weight`` also grows unit 0's ``fc`` weight row: ``fc``'s own per-tensor weight
cast then flushes its other rows, which the growth monitor names from the FP8 weight (``weight_underflow``), not
from ``fc``'s input (results ``gpt_weight.*``).

Why a second task beside ``growth_fallback.py --mode dead_channel`` (the 16-wide SwiGLU regression). There, clean FP8
alone ends +0.34% to +1.05% from BF16, so 0.5% lies inside FP8's own noise and cannot separate the fallback from
FP8. The GPT's clean-FP8 floor is ~0.2% (``experiments/results/fp8_recipes.md``), and its held-out loss is a
cross-entropy over 600 sequences rather than an MSE near zero. One dead unit in one block is not enough: the other
block's MLP takes over and FP8 without the fallback ends within 0.1% of BF16 (seed 0, 300 steps), so the task puts
one in each block, as massive activations appear in several layers of a real model.

Variants per seed: ``bf16`` (the reference), ``fp8`` (no fallback), ``fp8+fallback``; and without the growth:
``bf16 clean``, ``fp8 clean`` (FP8's floor) and ``fp8 clean, out bf16`` (the fallback's end configuration from the
start: both ``out`` layers in BF16). "Ends": the mean cross-entropy over ``CharLMData``'s held-out set after the last
step, in the run's own precision (the plugin's forward context) and, in brackets, in FP32. Writes
``experiments/results/growth_fallback/gpt[_weight].{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.nn import functional as F

sys.path[:0] = [str(Path(__file__).resolve().parent)]
from growth_fallback import e4m3_flushed, gap, loss_curves  # noqa: E402

from lit_mpstable import FP8Config, StablePrecision  # noqa: E402
from lit_mpstable.app.zoo import GPTLM, CharLMData  # noqa: E402
from lit_mpstable.callbacks import OverflowMonitor, PrecisionFallback  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "results" / "growth_fallback"
GROW_FROM, RATE, DEAD_CAP = 80, 1.2, 1e8
GROWN = dict(grow=True, fp8=False, fallback=False)
VARIANTS = {
    "bf16": GROWN, "fp8": {**GROWN, "fp8": True}, "fp8+fallback": {**GROWN, "fp8": True, "fallback": True},
    "bf16 clean": dict(grow=False, fp8=False, fallback=False), "fp8 clean": dict(grow=False, fp8=True, fallback=False),
    "fp8 clean, out bf16": dict(grow=False, fp8="keep out", fallback=False),
}
# The FP8 layers of the GPT under the default rule (the first and last linear layers stay in BF16).
FP8_LAYERS = sorted(f"model.blocks.{b}.{n}" for b in range(2) for n in ("qkv", "proj", "fc", "out"))
FP8_LAYERS.remove("model.blocks.0.qkv")


class DeadChannelGPT(GPTLM):
    """:class:`GPTLM` with a massive, dead hidden unit 0 in every block's MLP (see the module docstring).

    ``probe``: the token batch on which unit 0's amax ratio is measured (functionally: calling the layers would feed
    the growth monitor's hooks and the FP8 layers' amax records)."""

    def __init__(self, vocab_size: int, probe: torch.Tensor, *, seed: int, grow: bool, total_steps: int,
                 cap: float = DEAD_CAP, grow_from: int = GROW_FROM, weight: bool = False) -> None:
        if not 1 < cap < 1e30:
            raise ValueError(f"DeadChannelGPT(cap={cap!r}): must be in (1, 1e30) (an amax ratio BF16 holds).")
        torch.manual_seed(seed)
        super().__init__(vocab_size, total_steps=total_steps)
        self.probe, self.grow, self.cap, self.grow_from = probe, grow, float(cap), grow_from
        self.weight = weight  # also grow unit 0's fc weight row: fc's own FP8 weight cast then flushes its rest
        self.saturated_at: int | None = None
        self.losses: list[float] = []
        with torch.no_grad():
            for block in self.model.blocks:
                block.out.weight[:, 0] = 0
                block.out.weight.register_hook(_without_column_0)

    @torch.no_grad()
    def hidden(self) -> list[torch.Tensor]:
        """Each block's MLP hidden activations (``out``'s input) on the probe batch, in FP32."""
        gpt, found = self.model, []
        x = gpt.embed.weight[self.probe] + gpt.pos[: self.probe.shape[1]]
        for block in gpt.blocks:
            a = F.layer_norm(x, x.shape[-1:], block.ln1.weight, block.ln1.bias)
            b, t, d = a.shape
            q, k, v = F.linear(a, block.qkv.weight, block.qkv.bias).view(b, t, 3, block.n_heads, -1).permute(
                2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + F.linear(y, block.proj.weight, block.proj.bias)
            h = F.gelu(F.linear(F.layer_norm(x, (d,), block.ln2.weight, block.ln2.bias), block.fc.weight,
                                block.fc.bias))
            found.append(h)
            x = x + F.linear(h, block.out.weight, block.out.bias)
        return found

    def unit_ratio(self) -> float:
        """The smallest over blocks of unit 0's amax / the largest amax of the other hidden units."""
        ratios = []
        for h in self.hidden():
            amax = h.abs().flatten(0, -2).amax(0)
            ratios.append(float(amax[0] / amax[1:].amax()))
        return min(ratios)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss

    def on_train_batch_end(self, *args) -> None:
        step = self.trainer.global_step
        if not self.grow or step < self.grow_from or self.saturated_at is not None:
            return
        if self.unit_ratio() >= self.cap:
            self.saturated_at = step
            return
        with torch.no_grad():
            for block in self.model.blocks:
                if step == self.grow_from:
                    block.fc.bias[0] = block.fc.bias[0].abs() + 1
                block.fc.bias[0] *= RATE
                if self.weight:
                    block.fc.weight[0] *= RATE


def _without_column_0(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad[:, 0] = 0
    return grad


@torch.no_grad()
def held_out(module: DeadChannelGPT, data: CharLMData, plugin: StablePrecision) -> dict[str, float]:
    module.eval()
    totals = {"own": 0.0, "fp32": 0.0}
    count = 0
    for x, y in data.val_dataloader():
        with plugin.forward_context():
            own = module(x).float()
        fp32 = module.float()(x)
        for key, logits in (("own", own), ("fp32", fp32)):
            totals[key] += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
        count += y.numel()
    return {k: v / count for k, v in totals.items()}


def run(seed: int, variant: str, steps: int, cap: float = DEAD_CAP, grow_from: int = GROW_FROM,
        grow: str = "bias") -> dict:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    start = time.process_time()
    spec = VARIANTS[variant]
    data = CharLMData()
    data.setup()
    module = DeadChannelGPT(data.vocab_size, data.train_set.tensors[0][:32], seed=seed, grow=spec["grow"],
                            total_steps=steps, cap=cap, grow_from=grow_from, weight=grow == "weight")
    fp8 = None if not spec["fp8"] else "current" if spec["fp8"] is True else FP8Config(
        recipe="current", filter=[n for n in FP8_LAYERS if not n.endswith(".out")])
    plugin = StablePrecision("bf16-mixed", fp8=fp8, growth_every_n_steps=10)
    fallback = PrecisionFallback(on_growth=True, patience=10**6, max_overflow_rate=None, nonfinite_loss_patience=None)
    callbacks = [OverflowMonitor(log_every_n_steps=10), *([fallback] if spec["fallback"] else [])]
    trainer = pl.Trainer(plugins=[plugin], accelerator="cpu", devices=1, max_steps=steps, max_epochs=-1,
                         callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False, logger=False,
                         enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=data)
    warned = [str(w.message) for w in caught if "activations growing" in str(w.message)]
    hidden = module.hidden()
    out = {
        "seed": seed, "variant": variant, "steps": steps, "saturated_at": module.saturated_at,
        "unit_ratio_at_end": module.unit_ratio(),
        "first_warning": int(re.search(r"at step (\d+)", warned[0]).group(1)) if warned else None,
        "fallbacks": [{"step": d.get("step"), "modules": d["modules"]} for d in fallback.decisions
                      if d["action"] == "fallback"],
        "fp8_layers_at_end": sorted(n for n, m in module.named_modules() if type(m).__name__ == "FP8Linear"),
        "runaway_layers": plugin.runaway_layers(),
        "column_0_zero": all(bool((b.out.weight[:, 0] == 0).all()) for b in module.model.blocks),
        "e4m3_flushed_at_end": [e4m3_flushed(h) for h in hidden],
        "loss": held_out(module, data, plugin), "cpu_s": time.process_time() - start,
    }
    print(json.dumps(out), flush=True)
    return out | {"train_loss": module.losses}


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    by = {(r["seed"], r["variant"]): r for r in rows}
    lines = [f"# The growth fallback on the CPU GPT (FP8 current scaling; a massive, dead unit 0 in each MLP grows from"
             f" step {GROW_FROM} to {args.cap:.0e}x the other units)", "",
             f"`{command(args)}` (CPU, one thread a run). Loss: mean cross-entropy over CharLMData's held-out set after"
             " the last step, in the run's own precision (FP32 evaluation in brackets); gaps against the same seed's"
             " BF16 run. Clean: no growth (unit 0 dead, not growing). bf16 = clean: the BF16 run with the growth ends"
             " bit for bit where the clean one ends. Flushed: the fraction of the nonzero elements of each block's"
             " `out` input (the probe batch) that E4M3 at 448 / amax flushes, at the end.", "",
             "| seed | bf16 loss; = clean | growth stops (step) | fp8 loss, gap; flushed (block 0, 1) |"
             " fp8+fallback: moved (step: layers); FP8 layers at the end | fp8+fallback loss, gap |"
             " clean fp8 gap (floor); clean with both out in BF16 |", "|---|---|---|---|---|---|---|"]
    fallback_gaps, fp8_gaps, floors, only = [], [], [], True
    for seed in sorted({r["seed"] for r in rows}):
        b, f, fb = by[(seed, "bf16")], by[(seed, "fp8")], by[(seed, "fp8+fallback")]
        cb, cf, cd = by[(seed, "bf16 clean")], by[(seed, "fp8 clean")], by[(seed, "fp8 clean, out bf16")]
        g_f, g_fb = gap(f["loss"]["own"], b["loss"]["own"]), gap(fb["loss"]["own"], b["loss"]["own"])
        floor, floor_out = gap(cf["loss"]["own"], cb["loss"]["own"]), gap(cd["loss"]["own"], cb["loss"]["own"])
        fallback_gaps.append(g_fb), fp8_gaps.append(g_f), floors.append(floor)
        moved = sorted(n for m in fb["fallbacks"] for n in m["modules"])
        decisions = "; ".join(f"{m['step']}: " + "+".join(m["modules"]) for m in fb["fallbacks"]) or "none"
        only &= moved == affected(args.grow) and fb["fp8_layers_at_end"] == [n for n in FP8_LAYERS
                                                                           if n not in affected(args.grow)]
        flushed = ", ".join(f"{x:.1%}" for x in f["e4m3_flushed_at_end"])
        lines.append(
            f"| {seed} | {b['loss']['own']:.4f} ({b['loss']['fp32']:.4f}); {'yes' if b['loss'] == cb['loss'] else 'no'}"
            f" | {b['saturated_at']} | {f['loss']['own']:.4f}, {g_f:+.2%}; {flushed} |"
            f" {decisions};"
            f" {len(fb['fp8_layers_at_end'])} of {len(FP8_LAYERS)} | {fb['loss']['own']:.4f}"
            f" ({fb['loss']['fp32']:.4f}), {g_fb:+.2%} | {floor:+.2%}; {floor_out:+.2%} |")
    within = sum(abs(g) <= 0.005 for g in fallback_gaps)
    lines += ["", f"Gap vs BF16 (mean; worst): FP8 {statistics.mean(fp8_gaps):+.2%}; {max(fp8_gaps, key=abs):+.2%},"
              f" FP8+fallback {statistics.mean(fallback_gaps):+.2%}; {max(fallback_gaps, key=abs):+.2%}"
              f" (**{within}/{len(fallback_gaps)} seeds within 0.5%**), clean FP8 (floor)"
              f" {statistics.mean(floors):+.2%}; {max(floors, key=abs):+.2%}. Only the two `out` layers left FP8 in"
              f" every seed: {'yes' if only else 'no'}."]
    if args.grow == "weight":
        lines[-1] = lines[-1].replace("the two `out` layers", "the affected layers (both `out`, both `fc`)")
    return "\n".join(lines) + "\n"


def figure(rows: list[dict], path: Path, seed: int = 0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in loss_curves(ax, rows, seed):
        for m in r["fallbacks"]:
            ax.axvline(m["step"], color="grey", ls=":", lw=1)
            ax.annotate(f"{'+'.join(m['modules'])} leaves FP8", (m["step"], 0.98), xycoords=("data", "axes fraction"),
                        fontsize=7, va="top", ha="right", rotation=90)
        if r["variant"] == "bf16" and r["saturated_at"] is not None:
            ax.axvline(r["saturated_at"], color="purple", ls="--", lw=1,
                       label=f"growth stops (step {r['saturated_at']})")
    ax.axvline(GROW_FROM, color="red", ls="--", lw=1, label=f"growth starts (step {GROW_FROM})")
    ax.set(xlabel="step", ylabel="train loss (10-step mean)", ylim=(1.9, 3.2),
           title=f"CPU GPT, a massive dead unit in each MLP, seed {seed}, FP8 current scaling")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def command(args: argparse.Namespace) -> str:
    cap = "" if args.cap == DEAD_CAP else f" --cap {args.cap:g}"
    cap += "" if args.grow == "bias" else f" --grow {args.grow}"
    script = "PYTHONPATH=. .venv/bin/python experiments/growth_fallback_gpt.py"
    return f"{script} --seeds {args.seeds} --steps {args.steps}{cap}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--cap", type=float, default=DEAD_CAP, help="unit 0's amax / the others' where it stops")
    parser.add_argument("--grow", choices=("bias", "weight"), default="bias",
                        help="what grows unit 0: its fc bias, or its fc bias and weight row (fc's FP8 weight then"
                             " flushes its other rows too)")
    parser.add_argument("--workers", type=int, default=1, help="runs at once, one process (and thread) each")
    parser.add_argument("--out", default=str(OUT), help="the results folder")
    parser.add_argument("--replot", action="store_true", help="rewrite table and figure from the saved JSON")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.replot:
        saved = json.loads((out / f"{tag(args)}.json").read_text())
        args = argparse.Namespace(**{"grow": "bias", **saved["args"], "out": args.out, "replot": True})
        write(saved["rows"], args, out)
        return
    for name in ("seeds", "steps", "workers"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}={getattr(args, name)!r}: must be >= 1.")
    if not 1 < args.cap < 1e30:
        raise ValueError(f"--cap={args.cap!r}: must be in (1, 1e30) (an amax ratio BF16 holds).")
    from bench.common import cpu_flags

    cpu, load = f"{platform.processor() or platform.machine()}; flags: {cpu_flags()}", os.getloadavg()
    print(cpu, f"load average at start: {load}", sep="\n", flush=True)
    jobs = [(seed, variant, args.steps, args.cap, GROW_FROM, args.grow) for seed in range(args.seeds)
            for variant in VARIANTS]
    if args.workers == 1:
        rows = [run(*job) for job in jobs]
    else:
        with ProcessPoolExecutor(args.workers) as pool:
            rows = list(pool.map(run, *zip(*jobs)))
    out.mkdir(parents=True, exist_ok=True)
    head = json.dumps({"cpu": cpu, "args": vars(args), "load_at_start": load}, indent=2)
    body = ",\n".join(json.dumps(r) for r in rows)
    (out / f"{tag(args)}.json").write_text(head[:-2] + ',\n  "rows": [\n' + body + "\n]}\n")
    write(rows, args, out)


def tag(args: argparse.Namespace) -> str:
    """The results' file stem: ``gpt``, or ``gpt_weight`` for ``--grow weight``."""
    return "gpt" if getattr(args, "grow", "bias") == "bias" else "gpt_weight"


def affected(grow: str) -> list[str]:
    """The layers the injection harms in FP8: both ``out`` (their input), and with ``--grow weight`` both ``fc``."""
    return sorted(n for n in FP8_LAYERS if n.endswith(".out") or (grow == "weight" and n.endswith(".fc")))


def write(rows: list[dict], args: argparse.Namespace, out: Path) -> None:
    """The table (``<tag>.md``, also printed) and the figure (``<tag>.png``) of ``rows``."""
    table = markdown(rows, args)
    figure(rows, out / f"{tag(args)}.png")
    (out / f"{tag(args)}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()

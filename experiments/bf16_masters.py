"""BF16 weights without FP32 master weights stall; with them, training matches FP32.

    .venv/bin/python experiments/bf16_masters.py                          # ~1.5 min on 1 thread
    .venv/bin/python experiments/bf16_masters.py trainer.max_steps=40     # extra overrides go to every run

``experiment=bf16_small_lr``: the GPT on stdlib text, 300 steps, AdamW with lr 1e-4. An Adam update is at most about
lr in size, and a BF16 weight keeps 8 significant bits: for ``|w| >= 2**-5`` (most weights: the linear layers start
within +-0.088, embeddings and LayerNorm weights near 1) half an ulp is 1.2e-4 or more, so the update rounds to
nothing unless an FP32 master copy receives it. Runs: ``precision=fp32``,
``StablePrecision("bf16-true")`` (FP32 masters, the default) and ``StablePrecision("bf16-true",
master_weights=False)`` (Lightning's plain bf16-true). Writes ``experiments/results/bf16_masters.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS, command_line, compose, fit, markdown_table, pyplot, quiet, smooth, tail_mean, write_result  # noqa: E402

_ADAMW8BIT = ("+model.optimizer._target_=torchao.optim.AdamW8bit", "+model.optimizer._partial_=true")
RUNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("32-true", ("experiment=bf16_small_lr", "precision=fp32")),
    ("bf16-true, FP32 masters", ("experiment=bf16_small_lr", "plugin.master_weights=true")),
    ("bf16-true, no masters", ("experiment=bf16_small_lr", "plugin.master_weights=false")),
    ("bf16-true, kahan", ("experiment=bf16_small_lr", "plugin.master_weights=kahan")),
    ("bf16-true, stochastic", ("experiment=bf16_small_lr", "plugin.master_weights=stochastic")),
    ("32-true, AdamW8bit", ("experiment=bf16_small_lr", "precision=fp32", *_ADAMW8BIT)),
    ("bf16-true, kahan, AdamW8bit", ("experiment=bf16_small_lr", "plugin.master_weights=kahan", *_ADAMW8BIT)),
    ("bf16-true, stochastic, AdamW8bit", ("experiment=bf16_small_lr", "plugin.master_weights=stochastic",
                                          *_ADAMW8BIT)),
)


class UpdateMeter(pl.Callback):
    """Every ``every`` steps, the fraction of the optimizer's parameter elements an applied step changed (the FP32
    masters when the plugin keeps them, else the model's own weights); at the end, the fraction of the model's
    weights that differ from their initial values."""

    def __init__(self, every: int = 10) -> None:
        self.every = every
        self.changed: list[tuple[int, float]] = []
        self.moved_from_init: float | None = None
        self._before: list[torch.Tensor] | None = None
        self._init: list[torch.Tensor] = []

    @staticmethod
    def _params(trainer: pl.Trainer) -> list[torch.Tensor]:
        return [p for opt in trainer.optimizers for group in opt.param_groups for p in group["params"]]

    def on_train_start(self, trainer, pl_module) -> None:
        self._init = [p.detach().clone() for p in pl_module.parameters()]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step % self.every == 0:
            self._before = [p.detach().clone() for p in self._params(trainer)]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._before is None:
            return
        after = self._params(trainer)
        if not trainer.precision_plugin.last_step_skipped:
            changed = sum(int((a.detach() != b).sum()) for a, b in zip(after, self._before))
            self.changed.append((trainer.global_step, changed / sum(b.numel() for b in self._before)))
        self._before = None

    def on_train_end(self, trainer, pl_module) -> None:
        moved = sum(int((p.detach() != p0).sum()) for p, p0 in zip(pl_module.parameters(), self._init))
        self.moved_from_init = moved / sum(p0.numel() for p0 in self._init)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (e.g. trainer.max_steps=40)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    quiet()
    results = []
    for label, overrides in RUNS:
        meter = UpdateMeter()
        run = fit(compose([*overrides, *args.overrides]), extra_callbacks=[meter])
        rec = run.recorder
        results.append({
            "run": label, "overrides": list(overrides), "lr": float(run.cfg.model.lr),
            "final_train_loss": tail_mean(rec.loss), "val_loss": run.val_loss, "val_acc": run.val_acc,
            "updated_per_step": sum(f for _, f in meter.changed) / max(len(meter.changed), 1),
            "moved_from_init": meter.moved_from_init, "peak_mib": (rec.peak_bytes or 0) / 2**20,
            "step_ms": rec.median_step_s() * 1e3, "loss_curve": rec.loss, "val_curve": rec.val,
            "updated_curve": meter.changed,
        })
        print(f"{label}: val loss {run.val_loss:.4f}, {run.seconds:.0f} s", flush=True)

    def reference(r: dict) -> dict:  # the FP32 run with the same optimizer
        eight = any("AdamW8bit" in o for o in r["overrides"])
        return next(x for x in results if "precision=fp32" in x["overrides"]
                    and any("AdamW8bit" in o for o in x["overrides"]) == eight)

    base = results[0]
    header = ["run", "final train loss (last 20)", "val loss", "val loss vs FP32 (same optimizer)", "val acc",
              "optimizer's weights changed per step", "model weights moved from init", "peak tensor MiB",
              "median ms/step"]
    rows = [[r["run"], f"{r['final_train_loss']:.4f}", f"{r['val_loss']:.4f}",
             f"{(r['val_loss'] - reference(r)['val_loss']) / reference(r)['val_loss']:+.2%}", f"{r['val_acc']:.2%}",
             f"{r['updated_per_step']:.1%}", f"{r['moved_from_init']:.1%}", f"{r['peak_mib']:.1f}",
             f"{r['step_ms']:.0f}"] for r in results]
    text = markdown_table(header, rows)
    print(text)
    intro = (
        f"`experiment=bf16_small_lr`: the GPT on stdlib text (d=128, 2 layers, 445k parameters), 300 steps of 16x64\n"
        f"characters, AdamW lr {base['lr']:g} (warmup 20, cosine), no callbacks; same seed and batches for every run.\n"
        "*optimizer's weights changed per step*: fraction of the elements the optimizer updates (FP32 masters when\n"
        "kept, else the BF16 weights) that an applied step changed, every 10th step, averaged; *model weights moved\n"
        "from init*: fraction of the model's own weights that differ from their initial value at the end. Peak\n"
        "tensor memory of one step (`lit_mpstable.core.weights.memory.MemoryProbe`, compensation buffers included)."
        " kahan and\n"
        "stochastic keep 16-bit weights (and 16-bit optimizer state), updated through FP32 views; AdamW8bit is\n"
        "torchao's, compared with FP32 + AdamW8bit. ms/step is wall time on a shared machine."
    )
    write_result("bf16_masters", title="BF16 without master weights vs with, against FP32", intro=intro, tables=text,
                 command=command_line("bf16_masters.py", argv), data={"runs": results}, out_dir=args.out)
    figure(results, args.out / "bf16_masters.png")
    print(f"wrote {args.out / 'bf16_masters.md'}")


def figure(results: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, r in enumerate(results):
        style = dict(color=f"C{i}", lw=1.4, ls="--" if i == 1 else "-")
        ax.plot(range(1, len(r["loss_curve"]) + 1), smooth(r["loss_curve"]), label=r["run"], **style)
        if r["val_curve"]:
            ax.plot([v[0] for v in r["val_curve"]], [v[1] for v in r["val_curve"]], "o", color=f"C{i}", ms=4)
        ax2.plot([s for s, _ in r["updated_curve"]], [f for _, f in r["updated_curve"]], label=r["run"], **style)
    ax.set(xlabel="optimizer step", ylabel="loss", title="Train loss (10-step mean) and val loss (dots), lr 1e-4")
    ax2.set(xlabel="optimizer step", ylabel="fraction of elements changed",
            title="Weights an optimizer step actually changed", ylim=(0, 1.05))
    ax.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()

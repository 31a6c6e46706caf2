"""FP16 without loss scaling vs dynamic vs adaptive scaling, where small gradients underflow.

    .venv/bin/python experiments/fp16_scaling.py                          # ~1.5 min on 1 thread
    .venv/bin/python experiments/fp16_scaling.py --weights 1 2**-24      # loss weights to compare
    .venv/bin/python experiments/fp16_scaling.py trainer.max_steps=40     # extra overrides go to every run
    .venv/bin/python experiments/fp16_scaling.py trainer.max_steps=40 --weights 1 2**-24   # overrides first

``experiment=fp16_underflow``: the digits MLP in 16-mixed, its training loss multiplied by a weight ``w`` (a loss
averaged over a large global batch, or a down-weighted term). AdamW's eps is multiplied alike, so in FP32 every
weight trains bit for bit as ``w = 1`` does (the FP32 row of each block proves it): only the gradients' magnitude
changes. In FP16 the backward runs through FP16 activations, whose smallest subnormal is 6e-8; without a loss scale,
gradients below it flush to zero. Per weight: FP32, then 16-mixed with ``scaler=none``, ``dynamic`` and
``adaptive``. Writes ``experiments/results/fp16_scaling.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import lightning.pytorch as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS, command_line, compose, fit, markdown_table, pyplot, quiet, smooth, tail_mean, write_result  # noqa: E402

SCALERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("FP32 (reference)", ("precision=fp32", "scaler=default")),
    ("FP16, no scaling", ("scaler=none",)),
    ("FP16, dynamic", ("scaler=dynamic",)),
    ("FP16, adaptive", ("scaler=adaptive",)),
)


class GradMeter(pl.Callback):
    """Per applied step, the fraction of gradient elements that are exactly zero (on the unscaled gradients the
    optimizer is about to use); and ``plugin.stats["grad_underflow_frac"]`` each time telemetry refreshes it."""

    def __init__(self) -> None:
        self.zero: list[float] = []
        self.telemetry: list[tuple[int, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        total = sum(g.numel() for g in grads)
        if total and all(bool(g.isfinite().all()) for g in grads):
            self.zero.append(sum(int((g == 0).sum()) for g in grads) / total)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stats = trainer.precision_plugin.stats
        step = stats.get("stats_step")
        if step is not None and (not self.telemetry or self.telemetry[-1][0] != step):
            self.telemetry.append((step, float(stats.get("grad_underflow_frac", math.nan))))


def _weight(text: str) -> float:
    """``"2**-24"``, ``"1e-6"`` or ``"1"``."""
    if "**" in text:
        base, exp = text.split("**")
        return float(base) ** float(exp)
    return float(text)


def _weight_name(w: float) -> str:
    return f"2^{math.log2(w):.0f}" if w > 0 and math.log2(w).is_integer() else f"{w:g}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (e.g. trainer.max_steps=40)")
    parser.add_argument("--weights", nargs="+", default=["1", "2**-16", "2**-24", "2**-30"], help="loss weights")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    quiet()
    results = []
    for w in map(_weight, args.weights):
        for label, overrides in SCALERS:
            meter = GradMeter()
            cfg = compose(["experiment=fp16_underflow", f"model.loss_weight={w!r}", *overrides, *args.overrides])
            run = fit(cfg, extra_callbacks=[meter], probe_step=None)
            rec = run.recorder
            results.append({
                "weight": w, "run": label, "final_train_loss": tail_mean([v / w for v in rec.loss]),
                "val_loss": run.val_loss, "val_acc": run.val_acc, "skipped": sum(rec.skipped),
                "first_scale": rec.scale[0], "final_scale": rec.scale[-1],
                "zero_grad_frac": sum(meter.zero) / max(len(meter.zero), 1),
                "telemetry_underflow": [v for _, v in meter.telemetry],
                "loss_curve": [v / w for v in rec.loss], "zero_curve": meter.zero, "scale_curve": rec.scale,
            })
            r = results[-1]
            print(f"w={_weight_name(w)} | {label}: val acc {r['val_acc']:.3f}, zeros {r['zero_grad_frac']:.3f},"
                  f" {run.seconds:.0f} s", flush=True)

    header = ["loss weight", "run", "loss scale (after step 1 -> final)", "skipped", "zero grads (mean)",
              "grad_underflow_frac (telemetry, mean)", "final train loss (last 20)", "val loss", "val acc"]
    rows = []
    for r in results:
        telemetry = r["telemetry_underflow"]
        scale = "-" if r["run"].startswith(("FP32", "FP16, no")) else \
            f"2^{math.log2(r['first_scale']):.0f} -> 2^{math.log2(r['final_scale']):.0f}"
        rows.append([_weight_name(r["weight"]), r["run"], scale, r["skipped"], f"{r['zero_grad_frac']:.1%}",
                     f"{sum(telemetry) / len(telemetry):.2e}" if telemetry else "-", f"{r['final_train_loss']:.4f}",
                     f"{r['val_loss']:.4f}", f"{r['val_acc']:.2%}"])
    text = markdown_table(header, rows)
    print(text)
    intro = (
        "`experiment=fp16_underflow model.loss_weight=<w>`: the digits MLP (64-256-256-10, AdamW lr 3e-3, batch 64,\n"
        "300 steps, no callbacks) in 16-mixed; training loss x w, AdamW eps x w (so FP32 is identical for every w).\n"
        "*zero grads*: fraction of gradient elements exactly zero at the optimizer step (FP32 has a few percent:\n"
        "digit pixels that are always blank), mean over applied steps; what FP16 flushed is the excess over FP32.\n"
        "*grad_underflow_frac*: the plugin's telemetry (`plugin.stats`, every 10 steps): the fraction of the\n"
        "*nonzero* gradient elements that would flush at the current scale. It is measured on gradients the FP16\n"
        "backward has already produced, so the elements that underflowed are zeros by then and not counted: it reads\n"
        "~0 in every row, even where FP16 zeroed almost every gradient (see the zero-grads column). Final train loss\n"
        "is unweighted; val = the last validation (the whole held-out fifth)."
    )
    write_result("fp16_scaling", title="FP16 without loss scaling vs dynamic vs adaptive", intro=intro, tables=text,
                 command=command_line("fp16_scaling.py", argv), data={"runs": results}, out_dir=args.out)
    figure(results, args.out / "fp16_scaling.png")
    print(f"wrote {args.out / 'fp16_scaling.md'}")


def figure(results: list[dict], path: Path) -> None:
    plt = pyplot()
    weights = sorted({r["weight"] for r in results}, reverse=True)
    fig, axes = plt.subplots(3, len(weights), figsize=(4.2 * len(weights), 9), squeeze=False, sharey="row")
    for col, w in enumerate(weights):
        for i, r in enumerate(r for r in results if r["weight"] == w):
            style = dict(color=f"C{i}", lw=1.3, ls="--" if i == 0 else "-", label=r["run"])
            axes[0][col].plot(range(1, len(r["loss_curve"]) + 1), smooth(r["loss_curve"]), **style)
            axes[1][col].plot(range(1, len(r["zero_curve"]) + 1), r["zero_curve"], **style)
            if not r["run"].startswith(("FP32", "FP16, no")):
                axes[2][col].plot([math.log2(s) for s in r["scale_curve"]], **style)
        axes[0][col].set(title=f"loss weight {_weight_name(w)}", yscale="log")
        axes[2][col].set(xlabel="optimizer step")
    axes[0][0].set(ylabel="train loss, unweighted (10-step mean)")
    axes[1][0].set(ylabel="fraction of zero gradient elements")
    axes[2][0].set(ylabel="log2(loss scale)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()

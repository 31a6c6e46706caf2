"""Fault injection: an overflow storm handled by PrecisionFallback, a loss spike handled by ScaleCheckpoint's rollback,
a silent underflow caught by PrecisionProbe and repaired by PrecisionFallback, each against the same run without the
callback and without the fault.

    .venv/bin/python experiments/fault_injection.py                          # ~2 min on 1 thread
    .venv/bin/python experiments/fault_injection.py trainer.max_steps=40     # extra overrides go to every run
    .venv/bin/python experiments/fault_injection.py --cases underflow        # one case only

- Overflow storm (``experiment=fault_storm``): the digits MLP in 16-mixed with dynamic loss scaling; on training
  batches 30-89 the first layer's output ``y`` becomes ``y * 2**20 / 2**20`` (inf in FP16, ``y`` in FP32: an
  activation past FP16's range). ``experiment=fault_storm_fallback`` adds ``PrecisionFallback(cooldown=50)``.
- Loss spike (``experiment=fault_spike``): the GPT on stdlib text in bf16-mixed; training batch 175 has its loss
  multiplied by 1e6. ``experiment=fault_spike_rollback`` adds ``ScaleCheckpoint()`` (snapshots every 50 steps).
- Silent underflow (``experiment=fault_underflow``): the digits MLP in 16-mixed with dynamic loss scaling whose first
  layer's gradients are 2**-40 times smaller inside backward (``demos.GradientAttenuatedLinear``: exact in FP32): in
  FP16 they flush to zero, the layer stops learning, nothing overflows. ``PrecisionProbe(every_n_steps=20)`` measures
  it; ``experiment=fault_underflow_fallback`` adds ``PrecisionFallback(max_grad_error=0.5)``.

Writes ``experiments/results/fault_injection.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    RESULTS,
    Fit,
    command_line,
    compose,
    fit,
    markdown_table,
    pyplot,
    quiet,
    smooth,
    tail_mean,
    write_result,
)

from lit_mpstable.app.report_probe import write_probe_figure  # noqa: E402

RUNS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # (case, label, overrides)
    ("storm", "no fault", ("experiment=fault_storm", "model.storm_stop=0")),
    ("storm", "storm, no callbacks", ("experiment=fault_storm",)),
    ("storm", "storm + PrecisionFallback (global)", ("experiment=fault_storm_fallback",)),
    ("storm", "storm + PrecisionFallback (module)",
     ("experiment=fault_storm_fallback", "callbacks.precision_fallback.mode=module")),
    ("spike", "no fault", ("experiment=fault_spike", "model.spike_batch=null")),
    ("spike", "spike, no callbacks", ("experiment=fault_spike",)),
    ("spike", "spike + ScaleCheckpoint", ("experiment=fault_spike_rollback",)),
    ("underflow", "no fault", ("experiment=fault_underflow", "model.underflow_module=null")),
    ("underflow", "FP32, fault (exact there)", ("experiment=fault_underflow", "precision=fp32", "scaler=default")),
    ("underflow", "fault + PrecisionProbe", ("experiment=fault_underflow",)),
    ("underflow", "fault + PrecisionProbe + PrecisionFallback", ("experiment=fault_underflow_fallback",)),
)
CASES = ("storm", "spike", "underflow")
WATCHED = "model.0"
"""The module the silent underflow hits, whose learning the underflow case follows."""


class WeightDrift(pl.Callback):
    """Per optimizer step, ``||W - W_0|| / ||W_0||`` of ``WATCHED``'s weight: how far the layer has learned."""

    def __init__(self) -> None:
        self.drift: list[float] = []
        self._initial: torch.Tensor | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self._initial = pl_module.get_submodule(WATCHED).weight.detach().float().clone()

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        weight = pl_module.get_submodule(WATCHED).weight.detach().float()
        self.drift.append(float((weight - self._initial).norm() / self._initial.norm()))


def summarise(case: str, label: str, run: Fit, drift: WeightDrift | None = None) -> dict:
    rec = run.recorder
    probes = [r for cb in run.callbacks for r in getattr(cb, "history", [])]
    decisions = [d for cb in run.callbacks for d in getattr(cb, "decisions", [])]
    events = [e for cb in run.callbacks for e in getattr(cb, "events", [])]
    # ScaleCheckpoint skips a spiking batch by default (on_spike="skip") and rolls back only when spikes persist.
    rollbacks = [e for e in events if e.get("action") == "rollback"]
    skips = [e for e in events if e.get("action") == "skip"]
    finite = [v for v in rec.loss if math.isfinite(v)]
    redone = sum(e["step"] - e["restored_step"] for e in rollbacks)
    return {
        "case": case, "run": label, "model": type(run.model).__name__, "precision": run.plugin.precision,
        "final_train_loss": tail_mean(finite) if finite else math.nan,
        "val_loss": run.val_loss, "val_acc": run.val_acc,
        "skipped": sum(rec.skipped), "fallback_steps": sum(rec.fallback), "redone": redone,
        "min_scale": min(rec.scale), "final_scale": rec.scale[-1],
        "decisions": [{"step": d["step"], "action": d["action"], "effect": d["effect"], "reason": d["reason"]}
                      for d in decisions],
        "rollbacks": [{k: e[k] for k in ("step", "kind", "loss", "restored_step")} for e in rollbacks],
        "batch_skips": [{k: e[k] for k in ("step", "kind", "loss")} for e in skips],
        "storm": [run.cfg.model.get("storm_start", 0), run.cfg.model.get("storm_stop", 0)],
        "spike_batch": run.cfg.model.get("spike_batch"),
        "loss_curve": rec.loss, "scale_curve": rec.scale, "skipped_curve": rec.skipped, "fallback_curve": rec.fallback,
        "val_curve": rec.val, "seconds": run.seconds,
        "probe_steps": [r["step"] for r in probes],
        "watched_underflow": [r["modules"][WATCHED]["underflow_frac"] for r in probes],
        "watched_rel_error": [r["modules"][WATCHED]["rel_error"] for r in probes],
        "others_max_rel_error": [max(v["rel_error"] for k, v in r["modules"].items() if k != WATCHED) for r in probes],
        "probes": probes, "drift_curve": drift.drift if drift is not None else [],
    }


def _events(r: dict) -> str:
    parts = [f"{d['step']}: {d['action']}" + (f" ({d['effect']})" if d["action"] == "fallback" else "")
             for d in r["decisions"]]
    parts += [f"{e['step']}: {e['kind']} (loss {e['loss']:.3g}), rolled back to {e['restored_step']}"
              for e in r["rollbacks"]]
    parts += [f"{e['step']}: {e['kind']} (loss {e['loss']:.3g}), batch skipped" for e in r.get("batch_skips", [])]
    return "; ".join(parts) or "-"


def _scale(value: float) -> str:
    return f"2^{math.log2(value):.0f}" if value > 0 and value != 1.0 else f"{value:g}"


def _first_last(values: list[float], fmt: str = "{:.3g}") -> str:
    return "-" if not values else f"{fmt.format(values[0])} -> {fmt.format(values[-1])}"


def underflow_table(rows: list[dict]) -> str:
    header = ["run", "final train loss (last 20)", "val loss", "val acc", "skipped steps", "min / final loss scale",
              f"{WATCHED} flushed (probe: first -> last)", f"{WATCHED} rel. error (first -> last)",
              "other layers' max rel. error (max over probes)",
              f"{WATCHED} weight moved (norm of W - W0 / norm of W0, final)",
              "steps under fallback", "decisions (step: what)"]
    body = [[r["run"], f"{r['final_train_loss']:.4f}", f"{r['val_loss']:.4f}", f"{r['val_acc']:.2%}", r["skipped"],
             f"{_scale(r['min_scale'])} / {_scale(r['final_scale'])}",
             _first_last(r["watched_underflow"], "{:.1%}"), _first_last(r["watched_rel_error"]),
             f"{max(r['others_max_rel_error']):.2g}" if r["others_max_rel_error"] else "-",
             f"{r['drift_curve'][-1]:.3g}" if r["drift_curve"] else "-", r["fallback_steps"], _events(r)]
            for r in rows]
    return markdown_table(header, body)


def table(results: list[dict]) -> str:
    header = ["run", "final train loss (last 20)", "val loss", "val acc", "skipped steps", "steps redone",
              "steps under fallback", "min / final loss scale", "decisions, skips and rollbacks (step: what)"]
    blocks = []
    titles = {"storm": "Overflow storm: digits MLP, 16-mixed, dynamic scaling, batches {0}-{1} overflow",
              "spike": "Loss spike: GPT on stdlib text, bf16-mixed, batch {0} has a 1e6x loss"}
    for case in ("storm", "spike"):
        rows = [r for r in results if r["case"] == case]
        if not rows:
            continue
        faulty = next((r for r in rows if r["run"] != "no fault"), rows[0])
        title = titles[case].format(*(faulty["storm"][0], faulty["storm"][1] - 1) if case == "storm"
                                    else (faulty["spike_batch"],))
        body = [[r["run"], f"{r['final_train_loss']:.4f}", f"{r['val_loss']:.4f}", f"{r['val_acc']:.2%}",
                 r["skipped"], r["redone"], r["fallback_steps"],
                 f"{_scale(r['min_scale'])} / {_scale(r['final_scale'])}",
                 _events(r)] for r in rows]
        blocks.append(f"## {title}\n\n" + markdown_table(header, body))
    rows = [r for r in results if r["case"] == "underflow"]
    if rows:
        title = (f"Silent underflow: digits MLP, 16-mixed, dynamic scaling, {WATCHED}'s gradients x 2^-40 inside"
                 " backward")
        blocks.append(f"## {title}\n\n" + underflow_table(rows))
    return "\n\n".join(blocks)


def figure(results: list[dict], path: Path) -> None:
    plt = pyplot()
    cases = [case for case in CASES if any(r["case"] == case for r in results)]
    fig, axes = plt.subplots(2, len(cases), figsize=(6.5 * len(cases), 7.5), squeeze=False)
    colors = {"no fault": "0.55"}
    for col, case in enumerate(cases):
        if case == "underflow":
            _underflow_panels(axes[0][col], axes[1][col], [r for r in results if r["case"] == case], colors)
            continue
        rows = [r for r in results if r["case"] == case]
        top, bottom = axes[0][col], axes[1][col]
        for i, r in enumerate(rows):
            color = colors.get(r["run"], f"C{i}")
            steps = range(1, len(r["loss_curve"]) + 1)
            curve = [v if math.isfinite(v) else math.nan for v in r["loss_curve"]]
            top.plot(steps, curve if case == "spike" else smooth(curve), color=color, lw=1.2, label=r["run"])
            if case == "storm":
                bottom.plot(steps, [math.log2(s) for s in r["scale_curve"]], color=color, lw=1.4, label=r["run"])
                held = [s + 1 for s, flag in enumerate(r["fallback_curve"]) if flag]
                if held:
                    bottom.scatter(held, [math.log2(r["scale_curve"][s - 1]) for s in held], color=color, s=4)
            elif r["val_curve"]:
                bottom.plot([v[0] for v in r["val_curve"]], [v[1] for v in r["val_curve"]], "o-", color=color,
                            label=r["run"])
            for d in r["decisions"]:
                for ax in (top, bottom):
                    ax.axvline(d["step"], color=color, ls="--" if d["action"] == "fallback" else ":", lw=0.9)
            for e in r["rollbacks"]:
                for ax in (top, bottom):
                    ax.axvline(e["step"], color=color, ls="--", lw=0.9)
                    ax.axvspan(e["restored_step"], e["step"], color=color, alpha=0.12)
        faulty = next((r for r in rows if r["run"] != "no fault"), None)
        if faulty and case == "storm":
            for ax in (top, bottom):
                ax.axvspan(faulty["storm"][0], faulty["storm"][1], color="red", alpha=0.07)
        top.set_yscale("log")
        top.legend(fontsize=7)
        bottom.legend(fontsize=7)
        if case == "storm":
            top.set(title="Overflow storm (shaded), digits MLP in 16-mixed", ylabel="train loss (10-step mean)")
            bottom.set(xlabel="optimizer step", ylabel="log2(loss scale)",
                       title="Loss scale; dots: steps under fallback; dashed/dotted: fallback/restore")
        else:
            top.set(title="Loss spike (x1e6 at one batch), GPT in bf16-mixed", ylabel="train loss")
            bottom.set(xlabel="optimizer step", ylabel="val loss",
                       title="Validation loss; dashed: rollback, shaded: the steps it undid")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _underflow_panels(top, bottom, rows: list[dict], colors: dict[str, str]) -> None:
    for i, r in enumerate(rows):
        color = colors.get(r["run"], f"C{i}")
        style = dict(color=color, lw=1.2, ls=":" if r["run"].startswith("FP32") else "-")  # FP32 lies on "no fault"
        steps = range(1, len(r["loss_curve"]) + 1)
        top.plot(steps, smooth(r["loss_curve"]), label=r["run"], **style)
        if r["drift_curve"]:
            bottom.plot(steps, r["drift_curve"], label=r["run"], **style)
        for d in r["decisions"]:
            for ax in (top, bottom):
                ax.axvline(d["step"], color=color, ls="--", lw=0.9)
        if r["probe_steps"]:
            bottom.scatter([s + 1 for s in r["probe_steps"]], [min(e, 1.0) for e in r["watched_rel_error"]],
                           color=color, marker="x", s=22, label="probe: its gradient's rel. error" if i == 0 else None)
    top.set_yscale("log")
    top.set(title=f"Silent underflow in {WATCHED} (FP16, nothing overflows)", ylabel="train loss (10-step mean)")
    bottom.set(xlabel="optimizer step", ylabel=f"{WATCHED}: ||W - W0|| / ||W0||  (x: probe)",
               title=f"How far {WATCHED} learned; x: probe's error; dashed: fallback")
    top.legend(fontsize=7)
    bottom.legend(fontsize=7, loc="center right")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (e.g. trainer.max_steps=40)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="which faults to run")
    args = parser.parse_args(argv)
    quiet()
    results = []
    for case, label, overrides in RUNS:
        if case not in args.cases:
            continue
        drift = WeightDrift() if case == "underflow" else None
        run = fit(compose([*overrides, *args.overrides]), extra_callbacks=[drift] if drift else [], probe_step=None)
        results.append(summarise(case, label, run, drift))
        r = results[-1]
        print(f"{case} | {label}: val loss {r['val_loss']:.4f}, {run.seconds:.0f} s", flush=True)
    text = table(results)
    heatmaps = [r for r in results if r["case"] == "underflow" and r["probes"] and r["run"].startswith("fault +")]
    for r in heatmaps:  # the stability report's per-layer figure, for each faulty probed run
        name = f"fault_injection_probe_{'fallback' if r['decisions'] else 'no_fallback'}.png"
        drawn = write_probe_figure(r["probes"], args.out, name=name, title=f"Silent underflow, {r['run']}:"
                                   " PrecisionProbe per layer (lit_mpstable.app.report_probe)")
        if drawn is not None:
            text += f"\n\n{r['run']}, the probe's numbers per layer and probe step:\n\n![{drawn[0]}]({drawn[1]})"
    print(text)
    intro = (
        "Scripted faults on real models, each run against the same run without the fault and without the callback.\n"
        "Storm: `experiment=fault_storm` (the digits MLP, 16-mixed, dynamic scaler; the first layer's output y\n"
        "becomes y * 2^20 / 2^20 on the storm's training batches: inf in FP16, y itself in FP32) and\n"
        "`experiment=fault_storm_fallback` (+ `PrecisionFallback(cooldown=50)`; the module row adds\n"
        "`callbacks.precision_fallback.mode=module`). Spike: `experiment=fault_spike` (the GPT on stdlib text,\n"
        "bf16-mixed, one training batch's loss x 1e6) and `experiment=fault_spike_rollback` (+ `ScaleCheckpoint()`,\n"
        "snapshot every 50 steps). Faults are keyed on the optimizer step being taken, so a rollback does not replay"
        " them.\n"
        "300 optimizer steps per run; val = the last validation (20 batches). *steps redone*: steps a rollback\n"
        "undid; *steps under fallback*: steps with `plugin.fallback_active` (the whole model or the blamed module in\n"
        "FP32).\n"
        "Silent underflow: `experiment=fault_underflow` (the digits MLP, 16-mixed, dynamic scaler; model.0 is a\n"
        "`demos.GradientAttenuatedLinear`: the gradient reaching its output is multiplied by 2^-40 and its parameter\n"
        "gradients by 2^40, exact in FP32, flushed to zero in FP16: the layer stops learning, nothing overflows;\n"
        "`PrecisionProbe(every_n_steps=20)`) and `experiment=fault_underflow_fallback` (+\n"
        "`PrecisionFallback(max_grad_error=0.5, grad_error_patience=2)`). *flushed*: elements nonzero in the FP32\n"
        "recompute and zero in the run's gradient; *rel. error*: ||g - g32|| / ||g32||; *weight moved*: how far\n"
        "model.0's weight got from its initial value (AdamW's weight decay alone moves it ~5e-3 in 300 steps)."
    )
    write_result("fault_injection", title="Fault injection: overflow storm, loss spike and silent underflow",
                 intro=intro, tables=text,
                 command=command_line("fault_injection.py", argv), data={"runs": results}, out_dir=args.out)
    figure(results, args.out / "fault_injection.png")
    print(f"wrote {args.out / 'fault_injection.md'}")


if __name__ == "__main__":
    main()

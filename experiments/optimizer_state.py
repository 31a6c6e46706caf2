"""Optimizer state precision and the growth early warning, measured.

    PYTHONPATH=. .venv/bin/python experiments/optimizer_state.py                  # all parts
    PYTHONPATH=. .venv/bin/python experiments/optimizer_state.py --parts moments --gpt-steps 150

Parts:

- ``moments``: ``StablePrecision("bf16-true", master_weights=True|"kahan", optimizer_state="fp32"|"bf16"|"fp8")`` on
  the digits MLP and the small CPU GPT of ``lit_mpstable.app.zoo`` (AdamW + warmup/cosine), 3 seeds each: final
  validation loss against FP32 moments (same seed), and the optimizer state's bytes from ``memory_report()``.
- ``codec``: where FP8's error comes from, without the noise of diverging runs: one FP32 AdamW run of the GPT, and
  beside it, per codec variant, quantized moments fed the same gradients; per step the relative error of the
  update ``m_hat / (sqrt(v_hat) + eps)`` against FP32 moments, its component along the update (a bias shrinks or
  grows the step), the error of ``m`` and the mean ``log(v_q / v)`` (underflow or a biased EMA of ``v``).
  Written to ``codec.json``.
- ``rounding``: the noise floor of the paired statistic: BF16 and FP8 moments rerun with other random bits for
  their stochastic rounding (``--rounding-seeds``; same initial weights, same batches), so the spread of one
  format's own runs shows how far a difference from FP32 moments can come from the bits alone. Written to
  ``rounding.json`` (apart from ``results.json``, so it can run beside the ``moments`` part).
- ``warning``: the FP8 growth task of ``lit_mpstable.app.growth_demo`` (a SwiGLU block whose gate and up rows
  are driven into alignment; ``fp8="current"``, native emulated) with ``growth_every_n_steps=10``: the lead of
  OverflowMonitor's first growth warning over the first non-finite loss, 5 seeds; 5 clean runs for false alarms.
- ``overhead``: the digits MLP's step time with ``growth_every_n_steps=10`` against without (paired, alternating).

- ``figures``: no runs; the table and the figures again from ``results.json`` (every part writes them too).

Writes ``experiments/results/optimizer_state/results.md`` (and ``.json``), ``frontier.png`` (validation loss against
optimizer-state memory for the state formats) and ``lead_time.png`` (per seed: the step of the first growth warning
and of the first non-finite loss).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "results" / "optimizer_state"

from lit_mpstable import StablePrecision  # noqa: E402
from lit_mpstable.app.zoo import GPTLM, CharLMData, DigitsData, MLPClassifier  # noqa: E402


def _trainer(plugin, steps: int, **kwargs) -> pl.Trainer:
    options = dict(accelerator="cpu", devices=1, max_steps=steps, max_epochs=-1, plugins=[plugin], logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0, limit_val_batches=1.0, val_check_interval=None,
                   check_val_every_n_epoch=None)
    return pl.Trainer(**{**options, **kwargs})


def run_moments(model: str, master_weights, kind: str, seed: int, steps: int, rounding_seed: int = 0) -> dict:
    pl.seed_everything(seed, verbose=False)
    if model == "mlp":
        data, module = DigitsData(), MLPClassifier(total_steps=steps)
    else:
        data = CharLMData(max_chars=200_000)
        module = GPTLM(data.vocab_size, total_steps=steps)
    if rounding_seed:
        # The keepers seed stochastic rounding from torch.initial_seed() at setup; the weights are drawn already and
        # the batches come from a fixed generator, so only the rounding bits change (neither model has dropout).
        torch.manual_seed(seed + 7919 * rounding_seed)
    plugin = StablePrecision("bf16-true", master_weights=master_weights, optimizer_state=kind)
    trainer = _trainer(plugin, steps)
    start, cpu = time.perf_counter(), time.process_time()
    trainer.fit(module, datamodule=data)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    state_bytes = plugin.memory_report()["optimizer_state"]  # before validate() sets the model up again
    val = trainer.validate(module, datamodule=data, verbose=False)[0]["val/loss"]
    return {"model": model, "weights": str(master_weights), "kind": kind, "seed": seed, "val_loss": float(val),
            "state_bytes": state_bytes, "seconds": seconds, "cpu_seconds": cpu_seconds,
            "rounding_seed": rounding_seed}


# variant: (first moment, second moment); None keeps that moment in FP32; options: sr (stochastic rounding),
# block (elements per block), sqrt (store sqrt(v) instead of v).
CODEC_VARIANTS: dict[str, tuple[dict | None, dict | None]] = {
    "blocks of 128 (before)": (dict(sr=False, block=128), dict(sr=True, block=128)),
    "128, exp_avg exact": (None, dict(sr=True, block=128)),
    "128, exp_avg_sq exact": (dict(sr=False, block=128), None),
    "128, exp_avg stochastic": (dict(sr=True, block=128), dict(sr=True, block=128)),
    "128, exp_avg_sq nearest": (dict(sr=False, block=128), dict(sr=False, block=128)),
    "128, sqrt(exp_avg_sq) stored": (dict(sr=False, block=128), dict(sr=True, block=128, sqrt=True)),
    "blocks of 64 (now)": (dict(sr=False, block=64), dict(sr=True, block=64)),
    "blocks of 32": (dict(sr=False, block=32), dict(sr=True, block=32)),
}


def _fp8_round_trip(x: torch.Tensor, signed: bool, sr: bool, key: int, step: int, block: int,
                    sqrt: bool = False) -> torch.Tensor:
    import lit_mpstable.core.weights.optim_state as codec

    saved, codec.BLOCK_SIZE = codec.BLOCK_SIZE, block  # encode/decode read the module's block size
    try:
        y = x.sqrt() if sqrt else x
        uniform = None
        if sr:
            n = y.numel()
            uniform = torch.ones(-(-n // block) * block)
            uniform[:n] = ((codec.random_words(n, 0, 0, step, key, y.device) >> 8) & 0xFFFFFF).float() * 2.0**-24
        out = codec.decode_fp8(*codec.encode_fp8(y, signed, uniform))
    finally:
        codec.BLOCK_SIZE = saved
    return out.square() if sqrt else out


def run_codec(seed: int, steps: int) -> dict:
    import torch.nn.functional as F

    torch.manual_seed(seed)
    data = CharLMData(max_chars=200_000)
    data.setup()
    module = GPTLM(data.vocab_size, total_steps=steps)
    config = module.configure_optimizers()
    opt, sched = config["optimizer"], config["lr_scheduler"]["scheduler"]
    params = list(module.parameters())
    b1, b2, eps = 0.9, 0.999, 1e-8
    ref = [(torch.zeros(p.numel()), torch.zeros(p.numel())) for p in params]
    shadow = {n: [(torch.zeros(p.numel()), torch.zeros(p.numel())) for p in params] for n in CODEC_VARIANTS}
    sums = {n: {"update_err": 0.0, "update_proj": 0.0, "m_err": 0.0, "log_v_ratio": 0.0, "v_zero": 0.0}
            for n in CODEC_VARIANTS}
    batches = iter(data.train_dataloader())
    for step in range(1, steps + 1):
        x, y = next(batches)
        logits = module(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        c1, c2 = 1 - b1**step, 1 - b2**step
        acc = {n: [0.0, 0.0, 0.0, [], 0] for n in CODEC_VARIANTS}
        u_sq = m_sq = 0.0
        nonzero = 0
        for i, p in enumerate(params):
            g = p.grad.reshape(-1)
            m, v = ref[i]
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            u = (m / c1) / ((v / c2).sqrt() + eps)
            u_sq += float(u.square().sum())
            m_sq += float(m.square().sum())
            live = v > 0
            nonzero += int(live.sum())
            for j, (name, (first, second)) in enumerate(CODEC_VARIANTS.items()):
                mq, vq = shadow[name][i]
                mq.lerp_(g, 1 - b1)
                vq.mul_(b2).addcmul_(g, g, value=1 - b2)
                key = 1000 * i + 2 * j
                mq.copy_(m if first is None else _fp8_round_trip(mq, True, key=key, step=step, **first))
                vq.copy_(v if second is None else _fp8_round_trip(vq, False, key=key + 1, step=step, **second))
                du = (mq / c1) / ((vq / c2).sqrt() + eps) - u
                a = acc[name]
                a[0] += float(du.square().sum())
                a[1] += float((du * u).sum())
                a[2] += float((mq - m).square().sum())
                a[3].append(torch.log(vq[live].clamp_min(1e-45) / v[live]))
                a[4] += int((vq[live] == 0).sum())
        for name, a in acc.items():
            t = sums[name]
            t["update_err"] += (a[0] / u_sq) ** 0.5 / steps
            t["update_proj"] += a[1] / u_sq / steps
            t["m_err"] += (a[2] / m_sq) ** 0.5 / steps
            t["log_v_ratio"] += float(torch.cat(a[3]).mean()) / steps
            t["v_zero"] += a[4] / max(nonzero, 1) / steps
        opt.step()
        sched.step()
    return {"seed": seed, "steps": steps, "variants": sums}


def run_warning(seed: int, grow: bool, steps: int) -> dict:
    from lit_mpstable.app.growth_demo import run_growth_task as _run

    module, plugin, growth, _ = _run(seed, grow=grow, steps=steps)
    first = growth[0][0] if growth else None
    return {"seed": seed, "grow": grow, "warned_at": first, "nonfinite_at": module.first_nonfinite,
            "lead": (module.first_nonfinite - first) if (first is not None and module.first_nonfinite) else None,
            "named": growth[0][1].split(" in ", 1)[1].split(";")[0] if growth else ""}


class _Timer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._t = 0.0

    def on_train_batch_start(self, *args) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.times.append(time.perf_counter() - self._t)


def run_overhead(rounds: int, steps: int) -> dict:
    medians: dict[str, list[float]] = {"off": [], "every 10": []}
    for r in range(rounds):
        for label, every in (("off", None), ("every 10", 10)) if r % 2 == 0 else (("every 10", 10), ("off", None)):
            pl.seed_everything(0, verbose=False)
            timer = _Timer()
            plugin = StablePrecision("bf16-mixed", fp8="current", growth_every_n_steps=every)
            _trainer(plugin, steps, callbacks=[timer], limit_val_batches=0).fit(MLPClassifier(total_steps=steps),
                                                                              datamodule=DigitsData())
            medians[label].append(statistics.median(timer.times[10:]))
    ratios = [on / off for on, off in zip(medians["every 10"], medians["off"])]
    return {"median_step_s": {k: statistics.median(v) for k, v in medians.items()},
            "paired_ratio_median": statistics.median(ratios), "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["moments", "warning", "overhead"],
                        choices=["moments", "codec", "rounding", "warning", "overhead", "figures"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--mlp-steps", type=int, default=300)
    parser.add_argument("--gpt-steps", type=int, default=300)
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt"])
    parser.add_argument("--weights", nargs="+", default=["fp32", "kahan"])
    parser.add_argument("--codec-steps", type=int, default=150, help="codec part: GPT steps")
    parser.add_argument("--rounding-seeds", type=int, default=3,
                        help="rounding part: random-bit seeds per run (0 is the moments part's own run)")
    parser.add_argument("--rounding-data-seeds", type=int, default=1, help="rounding part: seeds 0.. of weights")
    parser.add_argument("--overhead-rounds", type=int, default=4)
    parser.add_argument("--overhead-steps", type=int, default=150)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: comparable CPU times)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import logging
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    if "moments" in args.parts:
        kept, rows = [r for r in results.get("moments", []) if r["model"] not in args.models], []
        for model in args.models:
            steps = args.mlp_steps if model == "mlp" else args.gpt_steps
            for weights in args.weights:
                mw = True if weights == "fp32" else weights
                for seed in range(args.seeds):
                    for kind in ("fp32", "bf16", "fp8"):
                        row = run_moments(model, mw, kind, seed, steps)
                        row["steps"] = steps
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        results["moments"] = kept + rows
                        path.write_text(json.dumps(results, indent=1))  # each run kept as soon as it is measured
    if "codec" in args.parts:
        cpath = OUT / "codec.json"
        rows = [run_codec(seed, args.codec_steps) for seed in range(args.seeds)]
        cpath.write_text(json.dumps({"command": " ".join(sys.argv[1:]), "rows": rows}, indent=1))
        print(json.dumps(rows, indent=1), flush=True)
        return  # the table is written by the other parts (and --parts figures), which read codec.json
    if "rounding" in args.parts:
        rpath = OUT / "rounding.json"
        rounding = json.loads(rpath.read_text()) if rpath.exists() else {"rows": [], "commands": {}}
        done = {(r["model"], r["seed"], r["kind"], r["rounding_seed"], r["steps"]) for r in rounding["rows"]}
        for model in args.models:
            steps = args.mlp_steps if model == "mlp" else args.gpt_steps
            for seed in range(args.rounding_data_seeds):
                for kind in ("bf16", "fp8"):
                    for r in range(1, args.rounding_seeds):
                        if (model, seed, kind, r, steps) in done:  # kept: a rerun adds seeds, not repeats
                            continue
                        row = run_moments(model, True, kind, seed, steps, rounding_seed=r)
                        row["steps"] = steps
                        rounding["rows"].append(row)
                        print(json.dumps(row), flush=True)
                        rpath.write_text(json.dumps(rounding, indent=1))
        rounding["commands"][" ".join(args.models)] = " ".join(sys.argv[1:])
        rpath.write_text(json.dumps(rounding, indent=1))
        return  # the table is written by the other parts (and --parts figures), which read rounding.json
    if "warning" in args.parts:
        rows = [run_warning(seed, True, 400) for seed in range(5)]
        rows += [run_warning(seed, False, 400) for seed in range(5)]
        for row in rows:
            print(json.dumps(row), flush=True)
        results["warning"] = rows
        path.write_text(json.dumps(results, indent=1))  # each part kept as soon as it is measured
    if "overhead" in args.parts:
        results["overhead"] = run_overhead(rounds=args.overhead_rounds, steps=args.overhead_steps)
        print(json.dumps(results["overhead"]), flush=True)
    for part in set(args.parts) - {"figures"}:
        label = f"{part} ({' '.join(args.models)})" if part == "moments" else part  # one run per model
        results.setdefault("commands", {})[label] = " ".join(sys.argv[1:])
    path.write_text(json.dumps(results, indent=1))
    for extra in ("rounding", "codec"):  # for the table only; not written into results.json
        if (OUT / f"{extra}.json").exists():
            results[extra] = json.loads((OUT / f"{extra}.json").read_text())
    (OUT / "results.md").write_text(markdown(results))
    figures(results, OUT)


_LABELS = {"True": "FP32 masters", "kahan": "kahan (compact)"}


def figures(results: dict, out: Path) -> None:
    """``frontier.png`` and ``lead_time.png`` from the measured rows (a part not measured yet: no figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results.get("moments", [])
    models = [m for m in ("mlp", "gpt") if any(r["model"] == m for r in rows)]
    if models:
        fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.0), squeeze=False)
        for ax, model in zip(axes[0], models):
            for weights, marker in (("True", "o"), ("kahan", "s")):
                sub = [r for r in rows if r["model"] == model and r["weights"] == weights]
                ref = {r["seed"]: r["val_loss"] for r in sub if r["kind"] == "fp32"}
                fp32_bytes = next((r["state_bytes"] for r in sub if r["kind"] == "fp32"), None)
                xs, ys, lo, hi, kinds = [], [], [], [], []
                for kind in ("fp32", "bf16", "fp8"):
                    gaps = [100 * (r["val_loss"] / ref[r["seed"]] - 1) for r in sub
                            if r["kind"] == kind and r["seed"] in ref]
                    if not gaps:
                        continue
                    state = next(r["state_bytes"] for r in sub if r["kind"] == kind)
                    mean = statistics.mean(gaps)
                    xs.append(state / 2**20)
                    ys.append(mean)
                    lo.append(mean - min(gaps))
                    hi.append(max(gaps) - mean)
                    kinds.append(f"{kind} ({state / fp32_bytes:.2f}x)" if fp32_bytes else kind)
                if not xs:
                    continue
                steps = sub[0]["steps"]
                seeds = len({r["seed"] for r in sub})
                ax.errorbar(xs, ys, yerr=[lo, hi], marker=marker, capsize=3,
                            label=f"{_LABELS.get(weights, weights)}, {steps} steps, {seeds} seeds")
                for x, y, kind in zip(xs, ys, kinds):
                    ax.annotate(kind, (x, y), textcoords="offset points", xytext=(4, 6 if marker == "o" else -12),
                                fontsize=8, color="tab:blue" if marker == "o" else "tab:orange")
            for level, style in ((0.3, ":"), (0.5, "--")):
                ax.axhline(level, color="grey", linestyle=style, linewidth=0.8)
            ax.axhline(0.0, color="black", linewidth=0.6)
            ax.set_xlabel("optimizer state (MiB, memory_report)")
            ax.set_ylabel("val loss vs FP32 moments (%; mean, seed range)")
            ax.set_title(f"{'digits MLP' if model == 'mlp' else 'CPU GPT'}: moments' format vs memory")
            ax.legend(fontsize=8, loc="best")
        fig.text(0.01, 0.01, "targets: bf16 within 0.3% (dotted) at <= 0.5x; fp8 within 0.5% (dashed) at <= 0.3x",
                 fontsize=8)
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        fig.savefig(out / "frontier.png", dpi=110)
        plt.close(fig)
    warned = [r for r in results.get("warning", []) if r["grow"]]
    if warned:
        clean = [r for r in results["warning"] if not r["grow"]]
        fig, ax = plt.subplots(figsize=(7.0, 3.2))
        for i, r in enumerate(warned):
            if r["warned_at"] is not None:
                end = r["nonfinite_at"] if r["nonfinite_at"] is not None else r["warned_at"]
                ax.plot([r["warned_at"], end], [i, i], color="tab:blue", linewidth=6, alpha=0.35)
                ax.plot(r["warned_at"], i, "o", color="tab:orange", label="first warning" if i == 0 else None)
            if r["nonfinite_at"] is not None:
                ax.plot(r["nonfinite_at"], i, "x", color="tab:red", markersize=9,
                        label="first non-finite loss" if i == 0 else None)
                if r["lead"] is not None:
                    ax.annotate(f"lead {r['lead']}", (r["nonfinite_at"], i), textcoords="offset points",
                                xytext=(8, -3), fontsize=8)
        ax.axvline(80, color="grey", linestyle=":", linewidth=0.8, label="growth injected (step 80)")
        ax.set_yticks(range(len(warned)), [f"seed {r['seed']}" for r in warned])
        ax.set_xlabel("optimizer step")
        alarms = sum(r["warned_at"] is not None for r in clean)
        ax.set_title(f"Growth warning lead (FP8, every 10 steps; goal >= 50 steps); clean runs: {alarms}/{len(clean)}"
                     " false alarms", fontsize=9)
        ax.set_xlim(0, max(r["nonfinite_at"] or r["warned_at"] or 0 for r in warned) + 60)
        ax.legend(fontsize=7, loc="center left")
        fig.tight_layout()
        fig.savefig(out / "lead_time.png", dpi=110)
        plt.close(fig)


def _codec_table(codec: dict) -> list[str]:
    """Where FP8's error comes from: the shadow moments of ``run_codec``, mean over steps and seeds."""
    rows = codec["rows"]
    lines = ["", "### Where FP8's error comes from (CPU GPT, quantized moments beside FP32 ones, same gradients)", "",
             f"`{codec['command']}`: {rows[0]['steps']} steps, seeds {', '.join(str(r['seed']) for r in rows)};"
             " per step, then the mean over steps and seeds.", "",
             "| FP8 variant | update error \\|du\\|/\\|u\\| | along the update <du,u>/\\|u\\|^2 |"
             " exp_avg error | mean log(v_q/v) | v flushed to 0 |", "|---|---|---|---|---|---|"]
    for name in rows[0]["variants"]:
        mean = {k: statistics.mean(r["variants"][name][k] for r in rows) for k in rows[0]["variants"][name]}
        lines.append(f"| {name} | {100 * mean['update_err']:.2f}% | {100 * mean['update_proj']:+.3f}% |"
                     f" {100 * mean['m_err']:.2f}% | {mean['log_v_ratio']:+.4f} | {mean['v_zero']:.1e} |")
    return lines


def _rounding_table(results: dict) -> list[str]:
    """The noise floor: one format's runs that differ only in the random bits of stochastic rounding."""
    extra = results["rounding"]["rows"]
    main = [r for r in results.get("moments", []) if r["weights"] == "True" and not r.get("rounding_seed", 0)]
    lines = ["", "### Noise floor: the same run with other random bits for stochastic rounding", "",
             "Same seed (initial weights), same batches, FP32 masters; only the rounding bits differ"
             f" (`{'`, `'.join(results['rounding']['commands'].values())}`).", "",
             "| model | seed | moments | val loss, rounding seeds 0, 1, ... | vs fp32 moments (%) | spread |",
             "|---|---|---|---|---|---|"]
    pooled: dict[tuple[str, str], list[list[float]]] = {}
    for model, seed, kind in sorted({(r["model"], r["seed"], r["kind"]) for r in extra}):
        ref = next((r["val_loss"] for r in main if (r["model"], r["seed"], r["kind"]) == (model, seed, "fp32")), None)
        runs = [r for r in main if (r["model"], r["seed"], r["kind"]) == (model, seed, kind)]
        runs += sorted((r for r in extra if (r["model"], r["seed"], r["kind"]) == (model, seed, kind)),
                       key=lambda r: r["rounding_seed"])
        vals = [r["val_loss"] for r in runs]
        gaps = ", ".join(f"{100 * (v / ref - 1):+.2f}" for v in vals) if ref else "-"
        lines.append(f"| {model} | {seed} | {kind} | {', '.join(f'{v:.4f}' for v in vals)} | {gaps} |"
                     f" {100 * (max(vals) - min(vals)) / min(vals):.2f}% |")
        if ref:
            pooled.setdefault((model, kind), []).append([100 * (v / ref - 1) for v in vals])
    for (model, kind), per_seed in sorted(pooled.items()):
        # Runs of one seed share its FP32 run: the standard error is taken over the seeds' means.
        means = [statistics.mean(gaps) for gaps in per_seed]
        sem = statistics.stdev(means) / len(means) ** 0.5 if len(means) > 1 else float("nan")
        worst = max((g for gaps in per_seed for g in gaps), key=abs)
        lines.append(f"\n{model} {kind}: {sum(map(len, per_seed))} paired runs ({len(means)} seeds), gap vs FP32"
                     f" moments {statistics.mean(means):+.2f}% (mean of the seeds' means; standard error over seeds"
                     f" {sem:.2f}%), worst run {worst:+.2f}%.")
    return lines


def markdown(results: dict) -> str:
    lines = ["# Optimizer state precision and the growth early warning", "",
             f"Commands (CPU, torch {torch.__version__}; `PYTHONPATH=. .venv/bin/python experiments/optimizer_state.py"
             " ARGS`, one part or model at a time):", ""]
    lines += [f"- {part}: `{argv}`" for part, argv in sorted(results.get("commands", {}).items())]
    lines += ["", "Figures: [frontier.png](frontier.png) (validation loss vs optimizer-state memory),"
              " [lead_time.png](lead_time.png) (the growth warning's lead).", ""]
    if "moments" in results:
        lines += ["## Moments: validation loss vs FP32 moments, and state memory", "",
                  "| model | weights | steps | moments | val loss (mean of seeds) |"
                  " vs fp32 moments (mean of per-seed %) |"
                  " worst seed | state bytes | vs fp32 moments |", "|---|---|---|---|---|---|---|---|---|"]
        rows = results["moments"]
        keys = sorted({(r["model"], r["weights"]) for r in rows}, key=lambda k: (k[0] != "mlp", k[1]))
        for model, weights in keys:
            sub = [r for r in rows if r["model"] == model and r["weights"] == weights]
            ref = {r["seed"]: r for r in sub if r["kind"] == "fp32"}
            for kind in ("fp32", "bf16", "fp8"):
                rs = [r for r in sub if r["kind"] == kind]
                if not rs:
                    continue
                deltas = [100 * (r["val_loss"] / ref[r["seed"]]["val_loss"] - 1) for r in rs if r["seed"] in ref]
                worst = max(deltas, key=abs) if deltas else float("nan")
                state = rs[0]["state_bytes"]
                ref_bytes = next(iter(ref.values()))["state_bytes"] if ref else state
                lines.append(
                    f"| {model} | {'FP32 masters' if weights == 'True' else weights} | {rs[0]['steps']} | {kind} |"
                    f" {statistics.mean(r['val_loss'] for r in rs):.4f} | {statistics.mean(deltas):+.2f}% |"
                    f" {worst:+.2f}% | {state:,} | {state / ref_bytes:.3f}x |")
        if "rounding" in results:
            lines += _rounding_table(results)
        if "codec" in results:
            lines += _codec_table(results["codec"])
        lines += ["", "With compact weights (`kahan`) the `fp32` row is today's compact path, whose optimizer state"
                  " is already kept in 16 bits by CompactWeights (so its ratio column compares against 16-bit"
                  " state).", ""]
    if "warning" in results:
        rows = results["warning"]
        grown = [r for r in rows if r["grow"]]
        clean = [r for r in rows if not r["grow"]]
        lines += ["## Early warning (FP8 current scaling, SwiGLU alignment injected from step 80)", "",
                  "| seed | first warning (step) | first non-finite loss (step) | lead (steps) | named |",
                  "|---|---|---|---|---|"]
        for r in grown:
            lines.append(f"| {r['seed']} | {r['warned_at']} | {r['nonfinite_at']} | {r['lead']} | {r['named']} |")
        alarms = sum(r["warned_at"] is not None for r in clean)
        lines += ["", f"Clean runs (400 steps, 5 seeds): {alarms} false alarms.", ""]
    if "overhead" in results:
        o = results["overhead"]
        lines += ["## Overhead of sampling every 10 steps (digits MLP, fp8='current', CPU)", "",
                  f"Median step: off {o['median_step_s']['off'] * 1e3:.2f} ms, every 10"
                  f" {o['median_step_s']['every 10'] * 1e3:.2f} ms; paired ratio (median of"
                  f" {len(o['ratios'])} rounds) {o['paired_ratio_median']:.3f}x.", ""]
    lines += [f"Note: {note}" for note in results.get("notes", [])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

"""The precision-schedule experiment (issue 45): does switching NVFP4's forward GEMM to BF16 at the start of the
learning-rate decay recover most of NVFP4's gap to BF16?

On ``make run``'s CPU GPT (``lit_mpstable.app.zoo.GPT`` on standard-library text, bf16 autocast), NVFP4 on every
eligible linear layer, AdamW with a short warmup, a constant LR and cosine decay over the last 30% of the steps:

- ``nvfp4``: NVFP4 throughout;
- ``nvfp4+fprop_bf16``: ``PrecisionSchedule(at="lr_decay", fprop="bf16")``;
- ``nvfp4+bf16``: ``PrecisionSchedule(at="lr_decay", fprop="bf16", dgrad="bf16", wgrad="bf16")``;
- ``bf16``: no FP4 at all.

The metric is the final validation loss; the recovered fraction is ``(L_nvfp4 - L_fprop) / (L_nvfp4 - L_bf16)`` on
the seed means. Each finished run is saved as JSON in ``experiments/results/schedule/runs/`` and skipped when the
script runs again, so it can be stopped and resumed (``--steps``, ``--seeds``, ``--configs``).

    PYTHONPATH=. python experiments/schedule.py --steps 600 --seeds 0 1 2 3
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from lit_mpstable.app.zoo import GPT, CharLMData  # noqa: E402
from lit_mpstable.fp8 import FP8Config, PrecisionSchedule, ScheduleRunner, convert_to_fp8  # noqa: E402

OUT = ROOT / "experiments" / "results" / "schedule"
CONFIGS = ("nvfp4", "nvfp4+fprop_bf16", "nvfp4+bf16", "bf16")
SCHEDULES = {
    "nvfp4+fprop_bf16": PrecisionSchedule(at="lr_decay", fprop="bf16"),
    "nvfp4+bf16": PrecisionSchedule(at="lr_decay", fprop="bf16", dgrad="bf16", wgrad="bf16"),
}


def lr_lambda(steps: int, warmup: int, decay_frac: float, floor: float):
    decay_start = int(round(steps * (1 - decay_frac)))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, steps - decay_start))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@torch.no_grad()
def val_loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        total += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").item()
        count += y.numel()
    model.train()
    return total / count


class Run:
    """One training run's state (model, optimizer, scheduler, data order); :meth:`branch` copies it."""

    def __init__(self, config: str, seed: int, args: argparse.Namespace, data: CharLMData) -> None:
        torch.manual_seed(seed)
        self.config, self.seed, self.args, self.data = config, seed, args, data
        self.model = GPT(data.vocab_size, d_model=args.d_model, n_layers=args.n_layers, n_heads=4, seq_len=64)
        self.layers: list[str] = []
        if config != "bf16":
            self.layers = convert_to_fp8(self.model, FP8Config(recipe="nvfp4", keep_high_precision=[]))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(args.steps, args.warmup, 0.3, args.lr_floor))
        self.generator = torch.Generator().manual_seed(1000 + seed)
        self.runner = ScheduleRunner(None)
        self.step, self.seconds = 0, 0.0
        self.curve: list[tuple[int, float]] = []
        self.train_curve: list[float] = []
        self.switches: list[tuple[int, str]] = []

    def branch(self, config: str, schedule: PrecisionSchedule | None, decay: int) -> Run:
        """A copy of this run from here on, under ``config`` with ``schedule`` (its lr_decay already resolved to
        ``decay``: the copy's runner takes it through its state, as a resume would)."""
        twin = copy.copy(self)
        twin.model, twin.optimizer, twin.scheduler = copy.deepcopy((self.model, self.optimizer, self.scheduler))
        twin.generator = torch.Generator().set_state(self.generator.get_state())
        twin.curve, twin.train_curve, twin.switches = list(self.curve), list(self.train_curve), list(self.switches)
        twin.config, twin.runner = config, ScheduleRunner(schedule)
        if schedule is not None:
            twin.runner.load_state_dict({**twin.runner.state_dict(), "steps": [decay]})
            twin.runner.bind(twin.model, [twin.scheduler], max_steps=self.args.steps, step=self.step)
        return twin

    def train_until(self, stop: int) -> None:
        args, data = self.args, self.data
        train = data.train_set.tensors
        start = time.perf_counter()
        while self.step < stop:
            step = self.step
            if self.runner:
                self.switches += [(step, line) for line in self.runner.on_step_start(step)]
            index = torch.randint(len(train[0]), (args.batch_size,), generator=self.generator)
            x, y = train[0][index], train[1][index]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = self.model(x)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.scheduler.step()
            self.train_curve.append(loss.item())
            self.step += 1
            if self.step % args.eval_every == 0 and self.step < args.steps:
                self.curve.append((self.step, val_loss(self.model, val_batches(data, args.curve_windows))))
        self.seconds += time.perf_counter() - start
        if self.step == args.steps:
            self.curve.append((self.step, val_loss(self.model, val_batches(data, args.val_windows))))

    def result(self, decay: int) -> dict[str, Any]:
        return {
            "config": self.config, "seed": self.seed, "steps": self.args.steps, "final_val_loss": self.curve[-1][1],
            "val_curve": self.curve, "train_curve": self.train_curve, "switches": self.switches,
            "fp8_layers": self.layers, "seconds": self.seconds, "decay_start": decay,
            "settings": {k: v for k, v in vars(self.args).items() if k not in ("seeds", "configs")},
        }


def val_batches(data: CharLMData, windows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = data.val_set.tensors
    n = min(len(x), windows)
    return [(x[i:min(i + 64, n)], y[i:min(i + 64, n)]) for i in range(0, n, 64)]


def run_seed(seed: int, configs: list[str], args: argparse.Namespace, save: Any) -> None:
    """bf16 alone; the NVFP4 configs share one trunk up to the LR decay (identical until the switch: the same
    initialisation, data order and stochastic-rounding keys), then branch."""
    data = CharLMData(seq_len=64, batch_size=args.batch_size)
    data.setup()
    if "bf16" in configs:
        run = Run("bf16", seed, args, data)
        run.train_until(args.steps)
        save(run.result(int(round(args.steps * 0.7))))
    fp4 = [c for c in configs if c != "bf16"]
    if not fp4:
        return
    trunk = Run("nvfp4", seed, args, data)
    probe = ScheduleRunner(PrecisionSchedule(at="lr_decay", fprop="bf16"))
    probe.bind(trunk.model, [trunk.scheduler], max_steps=args.steps)  # resolves the decay start, switches nothing
    decay = probe.steps[0]
    assert decay is not None
    trunk.train_until(decay)
    for config in fp4:
        branch = trunk.branch(config, SCHEDULES.get(config), decay)
        branch.train_until(args.steps)
        save(branch.result(decay))


def summarise(args: argparse.Namespace) -> None:
    runs = [json.loads(p.read_text()) for p in sorted((OUT / "runs").glob(f"*_s{args.steps}_*.json"))]
    if not runs:
        return
    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["config"], []).append(r)
    rows, means = [], {}
    for config in CONFIGS:
        losses = [r["final_val_loss"] for r in sorted(by.get(config, []), key=lambda r: r["seed"])]
        if not losses:
            continue
        means[config] = statistics.mean(losses)
        sd = statistics.stdev(losses) if len(losses) > 1 else float("nan")
        rows.append(f"| {config} | {len(losses)} | {means[config]:.4f} | {sd:.4f} | "
                    + ", ".join(f"{v:.4f}" for v in losses) + " |")
    fraction = {}
    if {"nvfp4", "bf16"} <= set(means):
        gap = means["nvfp4"] - means["bf16"]
        for config in ("nvfp4+fprop_bf16", "nvfp4+bf16"):
            if config in means and gap != 0:
                fraction[config] = (means["nvfp4"] - means[config]) / gap
    # Paired by seed where all three exist (the same data order and initialisation).
    paired = {}
    three = ("nvfp4", "bf16", "nvfp4+fprop_bf16")
    seeds = sorted(set.intersection(*[{r["seed"] for r in by[c]} for c in three])) if set(three) <= set(by) else []
    for seed in seeds:
        get = {c: next(r["final_val_loss"] for r in by[c] if r["seed"] == seed) for c in ("nvfp4", "bf16",
                                                                                        "nvfp4+fprop_bf16")}
        gap = get["nvfp4"] - get["bf16"]
        paired[seed] = (get["nvfp4"] - get["nvfp4+fprop_bf16"]) / gap if gap else float("nan")
    lines = [
        f"# Precision schedule on the CPU GPT ({args.steps} steps, cosine decay over the last 30%)",
        "",
        f"Torch {torch.__version__}, {platform.processor() or platform.machine()},"
        f" {torch.get_num_threads()} thread(s).",
        "Final validation loss (lower is better); NVFP4 on every eligible linear layer of the GPT.",
        "",
        "| config | seeds | mean | sd | per seed |",
        "| --- | --- | --- | --- | --- |",
        *rows,
        "",
    ]
    for config, value in fraction.items():
        lines.append(f"- {config}: recovers {value:.2f} of NVFP4's gap to BF16 (seed means; target >= 0.67 for the"
                     " fprop switch)")
    if paired:
        lines.append("- fprop switch, per seed: " + ", ".join(f"seed {s}: {v:.2f}" for s, v in paired.items()))
    (OUT / f"table_s{args.steps}.md").write_text("\n".join(lines) + "\n")
    (OUT / f"summary_s{args.steps}.json").write_text(json.dumps(
        {"steps": args.steps, "means": means, "recovered_fraction": fraction, "paired_fraction": paired,
         "seeds": {c: sorted(r["seed"] for r in by.get(c, [])) for c in CONFIGS}}, indent=2))
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for config in CONFIGS:
        group = by.get(config, [])
        if not group:
            continue
        steps = [s for s, _ in group[0]["val_curve"]]
        mean = [statistics.mean(r["val_curve"][i][1] for r in group) for i in range(len(steps))]
        ax.plot(steps, mean, label=f"{config} ({len(group)} seed(s))")
    decay = runs[0]["decay_start"]
    ax.axvline(decay, color="gray", linestyle=":", label=f"LR decay starts (step {decay})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss")
    ax.set_ylim(top=min(3.0, ax.get_ylim()[1]))
    ax.legend()
    ax.set_title("NVFP4 with a precision schedule at the LR decay (CPU GPT)")
    fig.tight_layout()
    fig.savefig(OUT / f"curves_s{args.steps}.png", dpi=120)
    if {"nvfp4", "bf16"} <= set(by):  # zoom on the decay
        ax.set_xlim(decay - args.eval_every, args.steps)
        lows = [v for c in by for r in by[c] for s, v in r["val_curve"] if s >= decay]
        ax.set_ylim(min(lows) - 0.02, max(lows) + 0.02)
        fig.savefig(OUT / f"curves_decay_s{args.steps}.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--lr-floor", type=float, default=0.0, help="final LR / peak LR")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=30)
    parser.add_argument("--curve-windows", type=int, default=128, help="validation windows for the curve points")
    parser.add_argument("--val-windows", type=int, default=100000, help="validation windows for the final loss")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--summary-only", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    (OUT / "runs").mkdir(parents=True, exist_ok=True)
    if not args.summary_only:
        for seed in args.seeds:
            def path(config: str, seed: int = seed) -> Path:
                return OUT / "runs" / f"{config}_s{args.steps}_seed{seed}.json"

            def save(result: dict[str, Any]) -> None:
                target = path(result["config"])
                tmp = target.with_suffix(".tmp")
                tmp.write_text(json.dumps(result))
                os.replace(tmp, target)
                print(f"{result['config']} seed {result['seed']}: val loss {result['final_val_loss']:.4f}"
                      f" ({result['seconds']:.0f} s)", flush=True)

            todo = [c for c in args.configs if not path(c).exists()]
            if todo:
                run_seed(seed, todo, args, save)
            else:
                print(f"seed {seed}: done")
    summarise(args)


if __name__ == "__main__":
    main()

"""What the leading indicators cost per GPT step (issue #46 target: <= 1% of a step, one host read per logging step).

    .venv/bin/python experiments/indicators/overhead.py                 # 15 rounds
    .venv/bin/python experiments/indicators/overhead.py --rounds 3      # smoke run

``make run``'s GPT (d 128, 2 blocks, batch 16 x 64 characters, AdamW) in a plain FP32 loop on one thread. Paired
rounds (thread CPU time, which other jobs on a shared machine disturb less than wall time): each round times
``--log-every`` (10, ``make run``'s logging period) steps without the indicators, then the
same number with them, as OverflowMonitor runs them: the SpikeScore update every step (with the gradient norm the step
measured, as StablePrecision's gradient check does for OverflowMonitor; ``--grad-norm read``: the indicators read the
gradients themselves, as a plain loop that measures no norm makes them), and on the round's one logging
step the parameter snapshot before the step, ``measure`` after it, the attention recorder armed for that forward
(``--attention``) and one ``tolist`` of everything. The overhead is the median over rounds of (with / without - 1);
on a shared machine its rounds spread by several %, so the time inside the indicators' own calls (and inside the
recorder's q.k products, which run in the forward) is also accumulated and given as a fraction of the step without
them: it misses any indirect cost (caches), and is far less noisy.
``--before FILE`` times a second implementation of the indicators module (e.g. ``git show
REV:lit_mpstable/core/guards/indicators.py > /tmp/before.py``) in the same rounds, on the same model, the arms in
a rotating order, so before and after are paired. Its recorder is built before and removed after its own arm (an
older recorder that hooks the model for good would otherwise slow the other arms).
Writes ``overhead.json`` and ``overhead.md`` under ``experiments/results/indicators/``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "bench"))

from common import cpu_flags, environment  # noqa: E402

from lit_mpstable.app.zoo import GPT, CharLMData  # noqa: E402

OUT = ROOT / "experiments" / "results" / "indicators"
GRAD_NORM = {"step": "measured by the step in every arm and passed in, as OverflowMonitor takes StablePrecision's",
             "read": "read off the gradients by the indicators, every step"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--attention", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--spike-score", action=argparse.BooleanOptionalAction, default=True,
                        help="--no-spike-score: Indicators(spike_score=False), nothing between logging steps")
    parser.add_argument("--before", type=Path, default=None, help="an earlier indicators.py, timed as a third arm")
    parser.add_argument("--grad-norm", choices=("step", "read"), default="step",
                        help="step: every arm's step measures the gradient norm (StablePrecision's gradient check, or"
                             " clip_grad_norm_) and the SpikeScore takes it, as in OverflowMonitor; read: the"
                             " SpikeScore reads the gradients itself (a plain loop that measures no norm)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = CharLMData(seq_len=64, batch_size=16)
    data.setup()
    torch.manual_seed(0)
    model = GPT(data.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    arms = {"without": None, "with": importlib.import_module("lit_mpstable.core.guards.indicators")}
    if args.before is not None:
        spec = importlib.util.spec_from_file_location("indicators_before", args.before)
        assert spec is not None and spec.loader is not None
        before = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before)
        arms["before"] = before
    state = {name: module.Indicators() for name, module in arms.items() if module is not None}
    if not args.spike_score:
        state["with"] = arms["with"].Indicators(spike_score=False)

    inside = {name: 0.0 for name in arms}
    """Thread CPU seconds spent inside the indicators' own calls (and the recorder's logit products), per arm."""

    per_call: dict[str, dict[str, float]] = {name: {} for name in arms}
    """The same, per call (summed over the run)."""

    def counted(arm: str, fn, *a):
        start = time.thread_time()
        out = fn(*a)
        spent = time.thread_time() - start
        inside[arm] += spent
        label = getattr(fn, "__name__", "call")
        per_call[arm][label] = per_call[arm].get(label, 0.0) + spent
        return out

    for name, module in arms.items():  # the recorder's q.k products, timed where they run (inside the forward)
        if module is not None:
            real = module._masked_logit_max
            module._masked_logit_max = lambda *a, _real=real, _name=name: counted(_name, _real, *a)

    def step(arm: str, recorder, logging: bool) -> None:
        idx = torch.randint(len(data.train_set), (data.batch_size,), generator=gen)
        x, y = data.train_set[idx]
        indicators = state.get(arm)
        if indicators is not None and logging:
            counted(arm, indicators.snapshot_, opt)
            if recorder is not None:
                counted(arm, setattr, recorder, "armed", True)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norms = None
        if args.grad_norm == "step":  # part of the step in every arm, as the gradient check is
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norms = [torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))]
        opt.step()
        if indicators is not None:
            counted(arm, indicators.update_spike_score, loss, opt, norms)
            if logging:
                counted(arm, read, indicators, recorder)

    def read(indicators, recorder) -> None:
        parts = [*indicators.measure(opt)]
        if indicators.spike_score is not None:
            parts.append(indicators.spike_score.score())
        if recorder is not None:
            recorder.armed = False
            parts += list(recorder.take().values())
        torch.cat([p.float().reshape(-1) for p in parts]).tolist()

    def timed(arm: str) -> tuple[float, float]:
        module = arms[arm]
        recorder = module.AttentionLogits(model) if module is not None and args.attention else None
        inside[arm] = 0.0
        start = time.thread_time()
        for i in range(args.log_every):
            step(arm, recorder, i == args.log_every - 1)
        elapsed = (time.thread_time() - start) / args.log_every
        if recorder is not None:
            recorder.remove()
        return elapsed, inside[arm] / args.log_every

    names = list(arms)
    for name in names:  # warm-up
        timed(name)
    for name in names:
        per_call[name].clear()
    rows, own = [], []
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        times = {name: timed(name) for name in order}
        rows.append({name: t for name, (t, _) in times.items()})
        own.append({name: i / times["without"][0] for name, (_, i) in times.items() if name != "without"})
    ratios = [r["with"] / r["without"] - 1 for r in rows]
    result = {"median_overhead": statistics.median(ratios), "ratios": ratios,
              "mean_overhead": statistics.fmean(ratios),
              "stderr_overhead": statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else None,
              "median_own_time": statistics.median(o["with"] for o in own),
              "median_step_ms_without": statistics.median(r["without"] for r in rows) * 1e3,
              "median_step_ms_with": statistics.median(r["with"] for r in rows) * 1e3,
              "own_ms_per_step": {arm: {label: spent / (args.rounds * args.log_every) * 1e3
                                        for label, spent in calls.items()} for arm, calls in per_call.items() if calls},
              "log_every": args.log_every, "attention": args.attention, "spike_score": args.spike_score,
              "grad_norm": args.grad_norm,
              "rounds": args.rounds,
              "flags": cpu_flags(), "env": environment()}
    before_text = ""
    if "before" in arms:
        before_ratios = [r["before"] / r["without"] - 1 for r in rows]
        result |= {"median_overhead_before": statistics.median(before_ratios), "ratios_before": before_ratios,
                   "mean_overhead_before": statistics.fmean(before_ratios),
                   "median_own_time_before": statistics.median(o["before"] for o in own),
                   "median_step_ms_before": statistics.median(r["before"] for r in rows) * 1e3,
                   "median_paired_after_vs_before": statistics.median(r["with"] / r["before"] - 1 for r in rows)}
        before_text = (f" The earlier implementation ({args.before.name}) in the same rounds:"
                       f" {result['median_step_ms_before']:.1f} ms, median paired overhead"
                       f" {result['median_overhead_before']:+.2%} (mean {result['mean_overhead_before']:+.2%}); its own"
                       f" calls {result['median_own_time_before']:.2%} of a step; after / before, paired:"
                       f" {result['median_paired_after_vs_before']:+.2%}.")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_text(json.dumps(result, indent=1, default=str))
    text = (f"GPT step (mean over {args.log_every} steps, one of them a logging step), median of {args.rounds} paired"
            f" rounds: {result['median_step_ms_without']:.1f} ms without, {result['median_step_ms_with']:.1f} ms with"
            f" the indicators{'' if args.spike_score else ' (no SpikeScore)'}"
            f"{' and the attention recorder' if args.attention else ''}"
            f" (SpikeScore's gradient norm: {GRAD_NORM[args.grad_norm]}); median paired overhead"
            f" {result['median_overhead']:+.2%} (mean {result['mean_overhead']:+.2%}"
            f" +- {result['stderr_overhead'] or 0:.2%} s.e.; rounds: {min(ratios):+.2%} .. {max(ratios):+.2%}); the"
            f" indicators' own calls (thread CPU time inside them and inside the recorder's q.k products):"
            f" {result['median_own_time']:.2%} of a step.{before_text}\n\nTheir own time, ms per step (averaged over"
            f" every step of the run; read = measure + score + the one tolist, on logging steps):\n\n"
            + "\n".join(f"- {arm}: " + ", ".join(f"{label} {ms:.3f}" for label, ms in calls.items())
                        for arm, calls in result["own_ms_per_step"].items())
            + "\n\nCPU flags:"
            f" {cpu_flags()}; torch {torch.__version__}; 1 thread; 2-core machine shared with other jobs.\n\nCommand: `"
            + " ".join(["python", *sys.argv]) + "`\n")
    (args.out / "overhead.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

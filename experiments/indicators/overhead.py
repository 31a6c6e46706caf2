"""What the leading indicators cost per GPT step (issue #46 target: <= 1% of a step, one host read per logging step).

    .venv/bin/python experiments/indicators/overhead.py                 # 15 rounds
    .venv/bin/python experiments/indicators/overhead.py --rounds 3      # smoke run

``make run``'s GPT (d 128, 2 blocks, batch 16 x 64 characters, AdamW) in a plain FP32 loop on one thread. Paired
rounds (thread CPU time, which other jobs on a shared machine disturb less than wall time): each round times
``--log-every`` (10, ``make run``'s logging period) steps without the indicators, then the
same number with them, as OverflowMonitor runs them: the SpikeScore update every step, and on the round's one logging
step the parameter snapshot before the step, ``measure`` after it, the attention recorder armed for that forward
(``--attention``) and one ``tolist`` of everything. The overhead is the median over rounds of (with / without - 1).
Writes ``overhead.json`` and ``overhead.md`` under ``experiments/results/indicators/``.
"""

from __future__ import annotations

import argparse
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
from lit_mpstable.core.guards.indicators import AttentionLogits, Indicators  # noqa: E402

OUT = ROOT / "experiments" / "results" / "indicators"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--attention", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = CharLMData(seq_len=64, batch_size=16)
    data.setup()
    torch.manual_seed(0)
    model = GPT(data.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    indicators = Indicators()
    recorder = AttentionLogits(model) if args.attention else None
    gen = torch.Generator().manual_seed(0)

    def step(with_indicators: bool, logging: bool) -> None:
        idx = torch.randint(len(data.train_set), (data.batch_size,), generator=gen)
        x, y = data.train_set[idx]
        if with_indicators and logging:
            indicators.snapshot_(opt)
            if recorder is not None:
                recorder.armed = True
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if with_indicators:
            indicators.update_spike_score(loss, opt)
            if logging:
                parts = [*indicators.measure(opt), indicators.spike_score.score()]
                if recorder is not None:
                    recorder.armed = False
                    parts += list(recorder.take().values())
                torch.cat([p.float().reshape(-1) for p in parts]).tolist()

    for _ in range(args.log_every):  # warm-up
        step(True, True)
    rows = []
    for _ in range(args.rounds):
        times = {}
        for on in (False, True):
            start = time.thread_time()
            for i in range(args.log_every):
                step(on, i == args.log_every - 1)
            times[on] = (time.thread_time() - start) / args.log_every
        rows.append(times)
    ratios = [r[True] / r[False] - 1 for r in rows]
    result = {"median_overhead": statistics.median(ratios), "ratios": ratios,
              "median_step_ms_without": statistics.median(r[False] for r in rows) * 1e3,
              "median_step_ms_with": statistics.median(r[True] for r in rows) * 1e3,
              "log_every": args.log_every, "attention": args.attention, "rounds": args.rounds,
              "flags": cpu_flags(), "env": environment()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_text(json.dumps(result, indent=1, default=str))
    text = (f"GPT step (mean over {args.log_every} steps, one of them a logging step), median of {args.rounds} paired"
            f" rounds: {result['median_step_ms_without']:.1f} ms without, {result['median_step_ms_with']:.1f} ms with"
            f" the indicators{' and the attention recorder' if args.attention else ''}; median paired overhead"
            f" {result['median_overhead']:+.2%} (rounds: {min(ratios):+.2%} .. {max(ratios):+.2%}).\n\nCPU flags:"
            f" {cpu_flags()}; torch {torch.__version__}; 1 thread; 2-core machine shared with other jobs.\n\nCommand: `"
            + " ".join(["python", *sys.argv]) + "`\n")
    (args.out / "overhead.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

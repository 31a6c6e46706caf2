"""SpikeGuard of this tree against another tree's (a baseline: ``git archive <commit> | tar -x -C DIR``), bit for bit:
the same long random series with injected spikes (x1.5 to x2000 on the loss or the norm, inf/NaN/-inf values), the
same extra skips, through the stepper's bool path (with ``count_run_``), the tensor path, with missing losses and
without a norm; per step the flag, both z-scores, the clip threshold and the skip count, and the final state_dict.

    PYTHONPATH=. .venv/bin/python bench/spike_guard_equivalence.py --base /tmp/base_tree [--steps 3000 --seeds 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from pathlib import Path
from typing import Any

import torch

from lit_mpstable.core.guards.spike import SpikeGuard

CONFIGS: list[dict[str, Any]] = [
    {}, {"clip_zscore": 2.5}, {"window": 16, "warmup": 5}, {"window": 8, "warmup": 20, "clip_zscore": 1.0},
    {"watch": ("loss",)}, {"watch": ("grad_norm",), "clip_zscore": 3.0, "zscore": 3.3},
    {"zscore": 2.1, "max_consecutive": 3}, {"zscore": 6.3, "window": 64, "max_consecutive": None},
]


def series(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(n, dtype=torch.float32)
    loss = 2.0 + 1.5 * torch.exp(-t / 300) + 0.05 * torch.randn(n, generator=g)
    norm = (1 + t / n) * torch.exp(0.3 * torch.randn(n, generator=g))
    for i in torch.randint(30, n, (n // 40,), generator=g).tolist():
        (loss if i % 2 else norm)[i] *= float(torch.empty(()).uniform_(1.5, 2000, generator=g))
    for i in torch.randint(0, n, (n // 200,), generator=g).tolist():
        (loss if i % 3 else norm)[i] = [math.inf, math.nan, -math.inf][i % 3]
    return loss, norm


def _bits(t: torch.Tensor) -> list[int]:
    return t.detach().reshape(-1).view(torch.int32).tolist() if t.dtype == torch.float32 else t.reshape(-1).tolist()


def drive(guard: Any, loss: torch.Tensor, norm: torch.Tensor, mode: str, seed: int) -> tuple[list, dict]:
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for i in range(len(loss)):
        if mode != "noloss" or i % 5:
            guard.observe_loss_(loss[i])
        flag = guard.decide(norm[i] if mode != "lossonly" else None)
        thr = guard.clip_threshold()
        extra = bool(torch.rand((), generator=g) < 0.03)
        if mode == "tensor":
            guard.commit_(flag | torch.tensor(extra))
        else:
            skipped = bool(flag) or extra
            guard.commit_(skipped, spiked=flag)
            guard.count_run_(bool(flag) and skipped, applied=not skipped)
        out.append((bool(flag), _bits(guard.loss_zscore), _bits(guard.grad_norm_zscore),
                    None if thr is None else _bits(thr), int(guard.spikes_skipped)))
    return out, {k: (_bits(v) if isinstance(v, torch.Tensor) else v) for k, v in guard.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True, help="the other tree's root (holds lit_mpstable/)")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("base_spike", args.base / "lit_mpstable/core/guards/spike.py")
    assert spec is not None and spec.loader is not None
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    total = flagged = 0
    for ci, kwargs in enumerate(CONFIGS):
        modes = ["bool", "tensor", "noloss"]
        if "grad_norm" not in kwargs.get("watch", ("grad_norm",)) and "clip_zscore" not in kwargs:
            modes.append("lossonly")
        for mode in modes:
            for seed in range(args.seeds):
                loss, norm = series(args.steps, seed + 10 * ci)
                a, state_a = drive(base.SpikeGuard(**kwargs), loss, norm, mode, seed)
                b, state_b = drive(SpikeGuard(**kwargs), loss, norm, mode, seed)
                if a != b or state_a != state_b:
                    first = next((i for i in range(len(a)) if a[i] != b[i]), None)
                    raise SystemExit(f"differ: {kwargs} {mode} seed {seed}, first at step {first}")
                total += len(a)
                flagged += sum(row[0] for row in a)
    print(f"bit for bit: {total} steps ({flagged} flagged), {len(CONFIGS)} configs, flags, z-scores, thresholds,"
          " skip counts and state_dicts")


if __name__ == "__main__":
    main()

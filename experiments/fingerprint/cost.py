"""What the numeric fingerprint costs a save and a load (issue #46): checksums against ``torch.save`` of the same
checkpoint, the pinned pass against one forward/backward of the pinned micro-batch, and the check at load.

A GPT-shaped MLP stack (``--width``, ``--layers``) with AdamW state, FP32; the checkpoint dict is what a Trainer
writes (weights, optimizer state, the plugin's state). Paired measurements, medians of ``--repeats``; the CPU model,
its flags and the thread count are printed and saved. Run: ``python experiments/fingerprint/cost.py [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from lit_mpstable.core.fingerprint import checksums, compare_checksums, pinned_pass


def _cpu() -> dict[str, object]:
    info = {"machine": platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = text.splitlines()
        info["model"] = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
        flags = next(line.split(":", 1)[1].split() for line in lines if line.startswith("flags"))
        info["flags"] = sorted(f for f in flags if f.startswith(("avx", "sse4", "fma", "amx")))
    except (OSError, StopIteration):
        pass
    return info


def _median(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4, help="rows of the pinned micro-batch (PIN_ROWS)")
    parser.add_argument("--batch", type=int, default=64, help="rows of a training batch, for the step's time")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on this shared 2-core machine, 2 threads make every reduction wait on"
                             " OpenMP barriers with the cores busy elsewhere, 10-45x slower)")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/fingerprint"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    width = args.width
    blocks = [nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
              for _ in range(args.layers)]
    model = nn.Sequential(*blocks, nn.Linear(width, width))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(args.batch, width), torch.randn(args.batch, width)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    plugin = {"masters": {}, "layout": {"fp8": {}}, "scaler": {}, "compact": {}}
    checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "plugin": plugin}
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(t.numel() * t.element_size() for t in [*model.state_dict().values()]) * 3
    loss_fn = lambda net, batch: nn.functional.mse_loss(net(batch[0]), batch[1])  # noqa: E731

    with tempfile.TemporaryDirectory(dir=os.environ.get("FINGERPRINT_TMP")) as tmp:
        path = Path(tmp) / "ckpt.pt"
        results: dict[str, float] = {}
        # Paired, interleaved: each repeat times a save and the checksums of the same dict.
        saves, sums, checks = [], [], []
        saved = checksums(checkpoint)
        for _ in range(args.repeats):
            start = time.perf_counter()
            torch.save(checkpoint, path)
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            checksums(checkpoint)
            sums.append(time.perf_counter() - start)
            start = time.perf_counter()
            assert compare_checksums(saved, checkpoint) == []
            checks.append(time.perf_counter() - start)
        results["save_s"] = statistics.median(saves)
        results["checksums_s"] = statistics.median(sums)
        results["load_check_s"] = statistics.median(checks)
        start = time.perf_counter()
        torch.load(path, weights_only=True)
        results["load_s"] = time.perf_counter() - start

    pinned = (x[: args.rows], y[: args.rows])

    def fwd_bwd() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model, pinned).backward()

    passes, plain = [], []  # paired, interleaved
    pinned_pass(model, loss_fn, pinned, forward_context=nullcontext)
    for _ in range(3 * args.repeats):
        start = time.perf_counter()
        pinned_pass(model, loss_fn, pinned, forward_context=nullcontext)
        passes.append(time.perf_counter() - start)
        start = time.perf_counter()
        fwd_bwd()
        plain.append(time.perf_counter() - start)
    results["pinned_pass_s"], results["pinned_fwd_bwd_s"] = statistics.median(passes), statistics.median(plain)
    results["train_step_fwd_bwd_s"] = _median(
        lambda: (model.zero_grad(set_to_none=True), loss_fn(model, (x, y)).backward()), args.repeats)
    report = {
        "cpu": _cpu(), "params": params, "checkpoint_bytes": nbytes, "repeats": args.repeats,
        **{k: round(v, 6) for k, v in results.items()},
        "checksums_over_save": round(results["checksums_s"] / results["save_s"], 4),
        "load_check_over_save": round(results["load_check_s"] / results["save_s"], 4),
        "pinned_pass_over_fwd_bwd": round(results["pinned_pass_s"] / results["pinned_fwd_bwd_s"], 3),
    }
    print(json.dumps(report, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"cost_threads{args.threads}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

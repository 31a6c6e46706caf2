"""What the numeric fingerprint costs a save and a load (issue #46): checksums against ``torch.save`` of the same
checkpoint, the pinned pass against one forward/backward of the pinned micro-batch, and the check at load.

A GPT-shaped MLP stack (``--width``, ``--layers``; ``--vocab N``: and an N-row embedding tied to the output head, as
GPTs tie them, listed under both names in the state dict) with AdamW state, FP32; the checkpoint dict is what a Trainer
writes (weights, optimizer state, the plugin's state). A save is timed two ways: ``torch.save`` to a file, and
Lightning's own ``_atomic_save`` (what ``TorchCheckpointIO`` does: ``torch.save`` into memory, then one write). The
checksums are timed as they are now and as version 1 computed them (one wrap-around sum a tensor). Paired, interleaved
repeats; per-repeat ratios and their medians; the CPU model, its flags and the thread count are printed and saved.
Run: ``python experiments/fingerprint/cost.py [--vocab 16384] [--out DIR]``.
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
from lightning.fabric.utilities.cloud_io import _atomic_save
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


class _Net(nn.Module):
    """The MLP stack; with ``vocab``, a GPT-style embedding tied to an output head (one tensor, two names)."""

    def __init__(self, body: nn.Module, vocab: int, width: int) -> None:
        super().__init__()
        self.body = body
        if vocab:
            self.embed = nn.Embedding(vocab, width)
            self.head = nn.Linear(width, vocab, bias=False)
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def checksums_before(trees: dict[str, object]) -> dict[str, int]:
    """The checksums of fingerprint version 1 (one wrap-around sum a tensor, ``checksums(version=1)``), to compare
    the cost of today's lanes and hash with."""
    return checksums(trees, version=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=0, help="rows of a tied embedding/output head (0: none)")
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
    model = _Net(nn.Sequential(*blocks, nn.Linear(width, width)), args.vocab, width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(args.batch, width), torch.randn(args.batch, width)
    nn.functional.mse_loss(model(x), y).backward()
    if args.vocab:
        model.head(model.embed(torch.arange(8))).square().mean().backward()
    optimizer.step()
    plugin = {"masters": {}, "layout": {"fp8": {}}, "scaler": {}, "compact": {}}
    checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "plugin": plugin}
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # weights, exp_avg, exp_avg_sq
    loss_fn = lambda net, batch: nn.functional.mse_loss(net(batch[0]), batch[1])  # noqa: E731

    with tempfile.TemporaryDirectory(dir=os.environ.get("FINGERPRINT_TMP")) as tmp:
        path = Path(tmp) / "ckpt.pt"
        results: dict[str, float] = {}
        # Paired, interleaved: each repeat times both saves, the checksums now and before, and the check at load.
        saves, io_saves, sums, before, checks = [], [], [], [], []
        saved = checksums(checkpoint)
        for _ in range(args.repeats):
            start = time.perf_counter()
            torch.save(checkpoint, path)
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            checksums(checkpoint)
            sums.append(time.perf_counter() - start)
            start = time.perf_counter()
            _atomic_save(checkpoint, path)
            io_saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            checksums_before(checkpoint)
            before.append(time.perf_counter() - start)
            start = time.perf_counter()
            assert compare_checksums(saved, checkpoint) == []
            checks.append(time.perf_counter() - start)
        results["save_s"] = statistics.median(saves)
        results["lightning_save_s"] = statistics.median(io_saves)
        results["checksums_s"] = statistics.median(sums)
        results["checksums_before_s"] = statistics.median(before)
        results["load_check_s"] = statistics.median(checks)
        paired = {
            "checksums_over_save": statistics.median(c / s for c, s in zip(sums, saves)),
            "checksums_over_lightning_save": statistics.median(c / s for c, s in zip(sums, io_saves)),
            "checksums_before_over_save": statistics.median(c / s for c, s in zip(before, saves)),
            "checksums_over_before": statistics.median(c / b for c, b in zip(sums, before)),
        }
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
        "cpu": _cpu(), "params": params, "checkpoint_bytes": nbytes, "repeats": args.repeats, "vocab": args.vocab,
        "load_average": [round(v, 2) for v in os.getloadavg()],
        **{k: round(v, 6) for k, v in results.items()},
        **{f"paired_median_{k}": round(v, 4) for k, v in paired.items()},
        "checksums_over_save": round(results["checksums_s"] / results["save_s"], 4),
        "load_check_over_save": round(results["load_check_s"] / results["save_s"], 4),
        "pinned_pass_over_fwd_bwd": round(results["pinned_pass_s"] / results["pinned_fwd_bwd_s"], 3),
    }
    print(json.dumps(report, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"cost_threads{args.threads}" + (f"_vocab{args.vocab}" if args.vocab else "")
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

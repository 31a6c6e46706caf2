"""What the numeric fingerprint's checksums cost a save (issue #46; target: at most 2% of the save): the checksums of
a Trainer checkpoint against ``torch.save`` of the same checkpoint to a file and against Lightning's own
``trainer.save_checkpoint`` (which computes them, with the pinned pass, inside), now and as the previous release
computed them (its ``core/fingerprint.py``, read from git: ``--before``), and where the time of the checksums goes.

States: ``mlp`` (the 64-256-256-10 MLP of ``model=mlp``), ``gpt`` (the ``make run`` GPT: d_model 128, 2 layers, on the
stdlib characters) and ``large`` (the same GPT at d_model 768, a ~170 MB checkpoint), each fitted one step with
``StablePrecision("bf16-mixed")`` and AdamW, so the checkpoint holds weights, AdamW state (step counters included) and
the plugin's state. Paired rounds, the four measurements in a rotating order within each round; per-round ratios, their
medians and quartiles (and the checksums alone, now against before, in 5x as many paired rounds); the CPU model, its
flags, the thread count and the load average printed and saved.
Run: ``python experiments/fingerprint/cost.py [--states mlp gpt large] [--threads 1] [--rounds 15] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from lit_mpstable import StablePrecision
from lit_mpstable.app.zoo import GPTLM, CharLMData, MLPClassifier
from lit_mpstable.core import fingerprint as now

KEY = "StablePrecision"


def cpu_report() -> dict[str, object]:
    info: dict[str, object] = {"machine": platform.machine(), "threads": torch.get_num_threads(),
                               "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                               "load_average": [round(v, 2) for v in os.getloadavg()]}
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        info["model"] = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
        flags = next(line.split(":", 1)[1].split() for line in lines if line.startswith("flags"))
        info["flags"] = sorted(f for f in flags if f.startswith(("avx", "sse4", "fma", "amx", "sha")))
        info["cores"] = os.cpu_count()
    except (OSError, StopIteration):
        pass
    return info


def previous_release(commit: str) -> types.ModuleType:
    """``lit_mpstable/core/fingerprint.py`` as it was at ``commit``, imported as its own module."""
    source = subprocess.run(["git", "show", f"{commit}:lit_mpstable/core/fingerprint.py"], check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "fingerprint_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("fingerprint_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fitted(state: str) -> pl.Trainer:
    """A Trainer fitted one step on ``state``'s model and data (see the module docstring)."""
    torch.manual_seed(0)
    if state == "mlp":
        model: pl.LightningModule = MLPClassifier(hidden=256)
        data = DataLoader(TensorDataset(torch.rand(64, 64), torch.randint(0, 10, (64,))), batch_size=64)
    else:
        chars = CharLMData(seq_len=64, batch_size=16 if state == "gpt" else 2, max_chars=200_000)
        chars.setup()
        width = 128 if state == "gpt" else 768
        model = GPTLM(chars.vocab_size, d_model=width, n_layers=2, n_heads=4 if state == "gpt" else 12, seq_len=64)
        data = chars.train_dataloader()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, plugins=[StablePrecision("bf16-mixed")],
                         enable_progress_bar=False, enable_model_summary=False, logger=False,
                         enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data)
    return trainer


def stages(trees: dict[str, object], repeats: int) -> dict[str, float]:
    """Median seconds of each stage of ``checksums(trees)`` on the CPU, run alone: the walk (paths and view keys),
    the tensors' byte views, the lanes of the tensors with a whole row of them, the hashes (a smaller tensor's bytes as
    they lie, a larger one's lanes)."""
    def timed(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    leaves = [t for _, tree in trees.items() for _, t in now.tensor_leaves(tree)]
    data = [now._host_array(t) for t in leaves]
    small = [d for d in data if d.nbytes < 8 * now.LANES]
    large = [d.reshape(-1).view(np.uint8) for d in data if d.nbytes >= 8 * now.LANES]
    lanes = [now._numpy_lanes(d) for d in large]
    return {
        "walk_s": timed(lambda: [(f"{r}{p}", now._view_key(t)) for r, tr in trees.items()
                                 for p, t in now.tensor_leaves(tr)]),
        "byte_views_s": timed(lambda: [now._host_array(t) for t in leaves]),
        "lanes_s": timed(lambda: [now._numpy_lanes(d) for d in large]),
        "hashes_s": timed(lambda: ([now._hash(d, d.nbytes) for d in small],
                                   [now._digest(lane, d.size) for lane, d in zip(lanes, large, strict=True)])),
    }


def quartiles(values: list[float]) -> list[float]:
    return [round(q, 4) for q in statistics.quantiles(values, n=4)] if len(values) > 1 else values


def measure(state: str, rounds: int, before: types.ModuleType, tmp: Path) -> dict[str, object]:
    trainer = fitted(state)
    path = tmp / f"{state}.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)  # what the save wrote, as a dict: torch.save writes it again
    trees = now.checkpoint_trees(checkpoint, KEY)
    leaves = [t for _, tree in trees.items() for _, t in now.tensor_leaves(tree)]
    runs: dict[str, Callable[[], object]] = {
        "torch_save": lambda: torch.save(checkpoint, tmp / "plain.pt"),
        "trainer_save": lambda: trainer.save_checkpoint(path),
        "checksums": lambda: now.checksums(trees),
        "checksums_before": lambda: before.checksums(trees),
    }
    for fn in runs.values():  # warm
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for index in range(rounds):
        for name in names[index % len(names):] + names[:index % len(names)]:  # the order rotates round by round
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    ratios = {
        "checksums_over_torch_save": [c / s for c, s in zip(times["checksums"], times["torch_save"], strict=True)],
        "checksums_over_trainer_save": [c / s for c, s in zip(times["checksums"], times["trainer_save"],
                                                              strict=True)],
        "before_over_torch_save": [c / s for c, s in zip(times["checksums_before"], times["torch_save"], strict=True)],
        "before_over_trainer_save": [c / s for c, s in zip(times["checksums_before"], times["trainer_save"],
                                                           strict=True)],
        "checksums_over_before": [c / b for c, b in zip(times["checksums"], times["checksums_before"], strict=True)],
    }
    assert now.checksums(trees, version=2) == before.checksums(trees)  # version 2 checkpoints still check
    alone: dict[str, list[float]] = {"now": [], "before": []}  # the checksums alone, paired: many cheap rounds
    for index in range(5 * rounds):
        for name in ("now", "before") if index % 2 == 0 else ("before", "now"):
            start = time.perf_counter()
            (now if name == "now" else before).checksums(trees)
            alone[name].append(time.perf_counter() - start)
    ratios["alone_checksums_over_before"] = [n / b for n, b in zip(alone["now"], alone["before"], strict=True)]
    return {
        "tensors": len(leaves), "checkpoint_bytes": sum(t.numel() * t.element_size() for t in leaves),
        "small_tensors": sum(t.numel() * t.element_size() < 8 * now.LANES for t in leaves),
        **{f"{name}_s": round(statistics.median(values), 6) for name, values in times.items()},
        "alone_checksums_s": round(statistics.median(alone["now"]), 6),
        "alone_checksums_before_s": round(statistics.median(alone["before"]), 6),
        **{f"median_{name}": round(statistics.median(values), 4) for name, values in ratios.items()},
        **{f"quartiles_{name}": quartiles(values) for name, values in ratios.items()},
        "stages": {k: round(v, 6) for k, v in stages(trees, max(rounds, 5)).items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--states", nargs="+", default=["mlp", "gpt", "large"], choices=["mlp", "gpt", "large"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own default)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--before", default="c7c5186", help="the git commit whose fingerprint.py is 'before'")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/fingerprint"))
    args = parser.parse_args(argv)
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    before = previous_release(args.before)
    report: dict[str, object] = {"cpu": cpu_report(), "rounds": args.rounds, "before": args.before,
                                 "command": " ".join(["python", *sys.argv])}
    with tempfile.TemporaryDirectory(dir=os.environ.get("FINGERPRINT_TMP")) as tmp:
        for state in args.states:
            report[state] = measure(state, args.rounds, before, Path(tmp))
            print(state, json.dumps(report[state]), flush=True)
    report["load_average_after"] = [round(v, 2) for v in os.getloadavg()]
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"cost_threads{'default' if args.threads is None else args.threads}.json"
    (args.out / name).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out / name}")


if __name__ == "__main__":
    main()

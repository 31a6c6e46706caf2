"""Exact checksum variants over the same bytes (issue #46: is there a cheaper exact checksum than the one the
fingerprint uses?): the fingerprint's wrap-around int64 word sum (numpy on the CPU), the same in torch, a
position-dependent mix (per-lane sums over 509 lanes, numpy and torch), an XOR reduction, zlib's CRC32 and Adler-32,
and a plain copy for scale. Paired, interleaved rounds, medians, GB/s; the CPU model, flags, thread count and load
average printed and saved. Run: ``python experiments/fingerprint/checksum_variants.py [--mb 128] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

_spec = importlib.util.spec_from_file_location("cost", Path(__file__).with_name("cost.py"))
assert _spec is not None and _spec.loader is not None
_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cost)  # a script, not a package module: the same CPU report as the cost measurement

LANES = 509  # prime: a row swap of a power-of-two-wide matrix moves words by a distance no multiple of it


def variants(tensor: torch.Tensor) -> dict[str, Callable[[], object]]:
    words = tensor.view(torch.uint8).numpy().view(np.int64)
    t_words = tensor.view(torch.int64)
    whole = words.size // LANES * LANES
    buffer = memoryview(tensor.view(torch.uint8).numpy())
    return {
        "int64 sum (numpy; the fingerprint's)": lambda: words.sum(dtype=np.int64),
        "int64 sum (torch)": lambda: t_words.sum(),
        "509-lane sums (numpy; position-dependent)": lambda: words[:whole].reshape(-1, LANES).sum(axis=0,
                                                                                                   dtype=np.int64),
        "509-lane sums (torch; position-dependent)": lambda: t_words[:whole].view(-1, LANES).sum(0),
        "xor reduce (numpy)": lambda: np.bitwise_xor.reduce(words),
        "crc32 (zlib)": lambda: zlib.crc32(buffer),
        "adler32 (zlib)": lambda: zlib.adler32(buffer),
        "copy (torch clone, for scale)": lambda: tensor.clone(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/fingerprint"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tensor = torch.randn(args.mb * (1 << 20) // 4)
    fns = variants(tensor)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm
    for _ in range(args.rounds):  # interleaved: each round times every variant once
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    nbytes = tensor.numel() * tensor.element_size()
    rows = {name: {"median_ms": round(1e3 * statistics.median(ts), 2),
                   "gb_per_s": round(nbytes / statistics.median(ts) / 1e9, 2),
                   "over_int64_sum": round(statistics.median(
                       t / s for t, s in zip(ts, times["int64 sum (numpy; the fingerprint's)"])), 3)}
            for name, ts in times.items()}
    report = {"cpu": _cost.cpu_report(), "bytes": nbytes, "rounds": args.rounds,
              "load_average": [round(v, 2) for v in os.getloadavg()], "variants": rows}
    print(json.dumps(report, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checksum_variants.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

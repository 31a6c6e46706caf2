"""The optimizer arithmetic of compact weights alone: the C loop vs inductor's compiled kernel vs torch's AdamW.

One "step" is AdamW over the parameters of bench_memory.py's MLP (784-1024x3-10, 2.9M BF16 weights, with biases):

- ``torch AdamW``: torch's single-tensor AdamW on the BF16 parameters and moments (what Lightning's ``bf16-true``
  runs on a CPU; round-to-nearest moments, no compensation);
- ``compiled kahan`` / ``compiled stochastic``: ``FusedAdam``'s inductor kernel (BF16 moments stochastically rounded;
  a Kahan compensation, or stochastically rounded weights);
- ``C kahan`` / ``C stochastic``: the same step through ``lit_mpstable.core.weights.compact_fused.native_kernel``.

Each round runs every config once, in an order that alternates; thread CPU time per step (wall time with
``--threads`` above 1); median over rounds and the per-round ratio to torch's AdamW (median [IQR]). Run::

    PYTHONPATH=. .venv/bin/python bench/bench_adam_kernel.py --rounds 40
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_flags, environment, fmt_iqr, markdown_table, summary  # noqa: E402

from lit_mpstable.core.weights import compact_fused  # noqa: E402
from lit_mpstable.core.weights.compact_fused import FusedAdam  # noqa: E402

SHAPES = [(1024, 784), (1024,), (1024, 1024), (1024,), (1024, 1024), (1024,), (10, 1024), (10,)]
GROUP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "decoupled_weight_decay": True}


def _configs() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)

    def tensors(mode: str) -> list[list[torch.Tensor | None]]:
        out = []
        for shape in SHAPES:
            w = (torch.randn(shape, generator=g) * 0.02).bfloat16().view(-1)
            out.append([w, torch.zeros_like(w) if mode == "kahan" else None,
                        (torch.randn(shape, generator=g) * 1e-3).bfloat16().view(-1),
                        torch.zeros_like(w), torch.zeros_like(w)])
        return out

    scalars = FusedAdam.scalars(GROUP, 10.0, torch.tensor(1.0), None)
    keys = [torch.tensor(i * 7919, dtype=torch.int32) for i in range(len(SHAPES))]
    kernel = FusedAdam()
    native = compact_fused.native_kernel()
    if native is None:
        raise SystemExit("no C compiler here: lit_mpstable.core.weights.compact_fused cannot build its loop")

    def compiled(sets: list[list[torch.Tensor | None]]):
        return lambda: [kernel._plain_kernel(*t, scalars, k) for t, k in zip(sets, keys)]

    def c_loop(sets: list[list[torch.Tensor | None]]):
        return lambda: [native(*t, scalars, k, True) for t, k in zip(sets, keys)]

    params = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).bfloat16()) for s in SHAPES]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).bfloat16()
    adamw = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=False)
    return {
        "torch AdamW": adamw.step,
        "compiled kahan": compiled(tensors("kahan")), "compiled stochastic": compiled(tensors("stochastic")),
        "C kahan": c_loop(tensors("kahan")), "C stochastic": c_loop(tensors("stochastic")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    configs = _configs()
    names = list(configs)
    for fn in configs.values():  # compile, load, first touch
        for _ in range(3):
            fn()  # type: ignore[operator]
    # One thread: this thread's CPU time (the stable figure on a shared machine). More: wall time, since the other
    # threads' work is not this thread's CPU time.
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = clock()
            configs[name]()  # type: ignore[operator]
            times[name].append(clock() - start)
    env = environment()
    rows = []
    for name in names:
        ratio = summary([a / b for a, b in zip(times[name], times["torch AdamW"])])
        rows.append([name, f"{summary(times[name])['median'] * 1e3:.2f}", fmt_iqr(ratio)])
    text = "\n".join([
        "# Compact weights' optimizer arithmetic alone (bench/bench_adam_kernel.py)",
        "",
        f"torch {env['torch']}, {args.threads} thread(s), {args.rounds} alternating rounds; CPU: {env['cpu']}; flags:"
        f" {cpu_flags()}; load average at the end: {env['loadavg']}. One step = AdamW over the memory bench MLP's"
        f" 8 parameters (2.9M BF16 weights); {'thread CPU time' if args.threads == 1 else 'wall time'}.",
        "",
        markdown_table(["config", "ms per step (median)", "x torch AdamW (paired per round)"], rows),
        "",
    ])
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "adam_kernel" if args.threads == 1 else f"adam_kernel_{args.threads}threads"
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps({"env": env, "flags": cpu_flags(), "times": times}, indent=1))


if __name__ == "__main__":
    main()

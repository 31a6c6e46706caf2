"""NaN origin: the module where inf/NaN first appears, named from the existing attribution (a traced replay of the
skipped step: ``trace_skipped_step``), against ``torch.autograd.detect_anomaly`` (what ``Trainer(detect_anomaly=True)``
turns on), on the CPU GPT (lit_mpstable.app.zoo.GPT, d_model 64, 2 layers, seq 32, batch 8) in a plain
PrecisionStepper loop ('bf16-mixed', AdamW):

- forward: 10 modules in turn get one NaN written into their output (a forward hook) at a chosen step;
- backward: 10 modules in turn have their backward make a NaN in the gradient they pass on (a full backward hook on
  the module writes one NaN into its grad_input) at a chosen step;
- compiled: the same, one forward and one backward case, inside a ``torch.compile``'d block (``block.compile()``);
- for each: the step is skipped; the stepper's own blame at the skip (a guess from the parameters' gradients), the
  traced replay's verdict, and detect_anomaly's (the op whose backward returned NaN, and the model source line of its
  forward, mapped to a module only where that line calls exactly one module);
- clean-step overhead, CPU time per step (one thread), paired alternating rounds, median: ``off`` (plain loop),
  ``on`` (the loop keeps what a replay needs: the RNG state and the batch), ``diagnose`` (the tracer on every step)
  and ``anomaly`` (every step under detect_anomaly).

Writes ``bench/results/nan_origin.json``. About two minutes on 2 CPU cores:

    PYTHONPATH=. .venv/bin/python bench/nan_origin.py [--rounds 30 --round-steps 20]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lit_mpstable.app.zoo import GPT
from lit_mpstable.core.attribution import rng_state
from lit_mpstable.core.step.stepper import PrecisionStepper

ROOT = Path(__file__).resolve().parents[1]
VOCAB, SEQ, BATCH = 64, 32, 8
FORWARD = ["embed", "blocks.0.ln1", "blocks.0.qkv", "blocks.0.proj", "blocks.0.fc", "blocks.0.out", "blocks.1.ln2",
           "blocks.1.qkv", "ln_f", "head"]
BACKWARD = ["blocks.0.ln1", "blocks.0.qkv", "blocks.0.proj", "blocks.0.fc", "blocks.0.out", "blocks.1.ln1",
            "blocks.1.fc", "blocks.1.out", "ln_f", "head"]
COMPILED = [("forward", "blocks.1.fc"), ("backward", "blocks.1.out")]


class Injector:
    """Hooks on the target modules that write one NaN when armed for them (``armed = (kind, name)``)."""

    def __init__(self, model: torch.nn.Module, forward: list[str], backward: list[str]) -> None:
        self.armed: tuple[str, str] | None = None
        for name in forward:
            model.get_submodule(name).register_forward_hook(self._forward(name))
        for name in backward:
            model.get_submodule(name).register_full_backward_hook(self._backward(name))

    def _forward(self, name: str):
        def hook(module, args, output):
            if self.armed == ("forward", name):
                output = output.clone()
                output.view(-1)[7] = float("nan")
                return output
            return None

        return hook

    def _backward(self, name: str):
        def hook(module, grad_input, grad_output):
            if self.armed == ("backward", name):
                grad = grad_input[0].clone()
                grad.view(-1)[7] = float("nan")
                return (grad, *grad_input[1:])
            return None

        return hook


class Run:
    def __init__(self, seed: int = 0, *, diagnose: bool = False, inject: bool = True, compiled: bool = False) -> None:
        torch.manual_seed(seed)
        self.model = GPT(VOCAB, d_model=64, n_layers=2, n_heads=4, seq_len=SEQ)
        forward, backward = (FORWARD, BACKWARD) if not compiled else ([COMPILED[0][1]], [COMPILED[1][1]])
        self.injector = Injector(self.model, forward, backward) if inject else None
        if compiled:
            self.model.blocks[1].compile()
        self.stepper = PrecisionStepper("bf16-mixed", device="cpu", diagnose=diagnose, telemetry_every_n_steps=None)
        self.stepper.setup_module(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.stepper.setup_optimizers(self.model, [self.opt])
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=self.gen)
        return tokens[:, :-1], tokens[:, 1:]

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.stepper.forward_context():
            logits = self.model(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def step(self, *, keep: bool = False) -> Any:
        """One training step; with ``keep``, what a replay needs (the RNG state, the batch) is kept, as a loop that
        uses trace_skipped_step does."""
        rng = rng_state() if keep else None
        x, y = self.batch()
        self.stepper.scale_loss(self.loss(x, y)).backward()
        self.stepper.step(self.opt)
        self.opt.zero_grad(set_to_none=True)
        return rng, x, y


def anomaly_verdict(run: Run, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """One forward and backward under detect_anomaly: the op it names, and the model line of that op's forward."""
    with warnings.catch_warnings(record=True) as caught, torch.autograd.detect_anomaly():
        warnings.simplefilter("always")
        try:
            run.stepper.scale_loss(run.loss(x, y)).backward()
            error = None
        except RuntimeError as exc:
            error = str(exc)
    run.opt.zero_grad(set_to_none=True)
    run.stepper.drop_grads_(run.opt)
    op = re.search(r"Function '(\w+)'", error or "")
    trace = "\n".join(str(w.message) for w in caught if "Traceback of forward call" in str(w.message))
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)\n\s+(.+)', trace)
    model_frames = [f for f in frames if f[0].endswith(("zoo.py", "nan_origin.py"))]
    line = model_frames[-1][3].strip() if model_frames else None
    calls = re.findall(r"self\.(\w+)\(", line or "")
    calls = [c for c in calls if c not in ("attention",)]
    return {"raised": error is not None, "op": op.group(1) if op else None, "line": line,
            "module_candidates": calls}


def accuracy(out: dict) -> None:
    cases = [("forward", n) for n in FORWARD] + [("backward", n) for n in BACKWARD]
    run = Run()
    for _ in range(3):
        run.step()
    rows = []
    for kind, name in cases:
        rows.append(one_case(run, kind, name))
        print(rows[-1], flush=True)
    compiled = Run(compiled=True)
    for _ in range(3):
        compiled.step()
    compiled_rows = []
    for kind, name in COMPILED:
        compiled_rows.append(one_case(compiled, kind, name))
        print("compiled", compiled_rows[-1], flush=True)
    score = {}
    for label, subset in (("forward", [r for r in rows if r["kind"] == "forward"]),
                          ("backward", [r for r in rows if r["kind"] == "backward"]), ("compiled", compiled_rows)):
        score[label] = {
            "of": len(subset), "skipped": sum(r["skipped"] for r in subset),
            "ours_named": sum(r["ours"] == r["injected"] and r["where"] == r["kind"] for r in subset),
            "stepper_guess_named": sum(r["guess"] == [r["injected"]] for r in subset),
            "anomaly_raised": sum(r["anomaly"]["raised"] for r in subset),
            "anomaly_named_uniquely": sum(r["anomaly_named"] for r in subset),
        }
    out["cases"], out["compiled_cases"], out["score"] = rows, compiled_rows, score
    print("score", json.dumps(score), flush=True)


def one_case(run: Run, kind: str, name: str) -> dict[str, Any]:
    assert run.injector is not None
    run.injector.armed = (kind, name)
    rng, x, y = run.step(keep=True)
    skipped = run.stepper.last_step_skipped
    guess = list(run.stepper.stats.get("blamed_modules", []))
    ours = run.stepper.trace_skipped_step(lambda: run.loss(x, y), rng=rng) if skipped else None
    origin = run.stepper.stats.get("nan_origin") or {}
    anomaly = anomaly_verdict(run, x, y)
    run.injector.armed = None
    run.step()  # a clean step after the event
    leaf = name.rpartition(".")[2]
    # detect_anomaly names an op; it names the module only when its forward line calls exactly that one module and
    # the module's name is unique in the model (a block's layers share one source line across blocks).
    unique = sum(n.endswith("." + leaf) or n == leaf for n, _ in run.model.named_modules()) == 1
    return {"kind": kind, "injected": name, "skipped": skipped, "guess": guess, "ours": ours,
            "where": origin.get("where"), "anomaly": anomaly,
            "anomaly_named": bool(unique and anomaly["module_candidates"] == [leaf])}


def overhead(args: argparse.Namespace, out: dict) -> None:
    configs = ("off", "on", "diagnose", "anomaly")
    runs = {c: Run(inject=False, diagnose=c == "diagnose") for c in configs}
    for run in runs.values():
        for _ in range(5):
            run.step()
    per_step: dict[str, list[float]] = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else tuple(reversed(configs))
        for c in order:
            start = time.process_time()
            with torch.autograd.detect_anomaly() if c == "anomaly" else _null():
                for _ in range(args.round_steps):
                    runs[c].step(keep=c == "on")
            per_step[c].append((time.process_time() - start) / args.round_steps)
    med = {c: statistics.median(v) for c, v in per_step.items()}
    # Paired per round against the same round's "off": the ratio of the medians and the median of the paired ratios.
    paired = {c: statistics.median(a / b for a, b in zip(per_step[c], per_step["off"])) for c in configs}
    out["overhead"] = {"ms_per_step": {c: v * 1e3 for c, v in med.items()},
                       "factor_vs_off": {c: med[c] / med["off"] for c in configs},
                       "paired_median_factor": paired, "rounds": args.rounds, "round_steps": args.round_steps}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        out["cpu"] = [line for line in lscpu.splitlines() if line.startswith(("Model name", "Flags"))]
    except OSError:
        out["cpu"] = []
    print("overhead", json.dumps(out["overhead"]), "\n" + "\n".join(out["cpu"]), flush=True)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--round-steps", type=int, default=20)
    parser.add_argument("--only-overhead", action="store_true")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    out: dict = {"model": f"GPT(vocab {VOCAB}, d_model 64, 2 layers, seq {SEQ}, batch {BATCH}), bf16-mixed, AdamW",
                 "torch": torch.__version__}
    if not args.only_overhead:
        accuracy(out)
    overhead(args, out)
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    name = "nan_origin_overhead.json" if args.only_overhead else "nan_origin.json"
    (ROOT / "bench" / "results" / name).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

"""StepTriage (plain PyTorch loop, PrecisionStepper) on 40 injected events, 10 per kind: how many are classified as
the kind injected; and what clean steps cost (closure calls beyond one per step, CPU time per step against the same
loop without triage).

- transient: a NaN in a random layer's output on the step's first execution only, at 10 random steps of one 40-step
  '32-true' run with dropout (the replay reproduces the step only with the RNG restored); the final weights against
  the same run without faults;
- precision: a layer's output pushed past FP16's range (exact in FP32), at a random step of one 8-step '16-mixed' run
  per event, in a random layer; the blamed module must be the injected one;
- data: a NaN in the batch at 10 random steps of one 40-step run, a StateSnapshot taken after every applied step;
- state: a NaN written into fc1's weight before 10 random steps of one 40-step run, snapshots as above;
- control: 10 routine overflows (an inf gradient at a loss scale of 2**16, finite loss): none may be replayed.

Writes ``bench/results/step_triage_events.json``. About a minute on 2 CPU cores:

    PYTHONPATH=. .venv/bin/python bench/step_triage_events.py [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from lit_mpstable.app.fault_demos import TinyMLP, regression_data  # noqa: E402
from lit_mpstable.faults import StateSnapshot, StepTriage  # noqa: E402
from lit_mpstable.stepper import PrecisionStepper  # noqa: E402

LAYERS = ("fc1", "fc2", "fc3")
FP16_MAX = 65504.0


class Net(TinyMLP):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__(hidden=hidden)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act(self.fc2(self.drop(self.act(self.fc1(x))))))


class Run:
    """One loop: faults {step: kind} ('transient', 'overflow', 'nan_batch', 'corrupt', 'inf_grad') in ``layer``."""

    def __init__(self, precision: str, faults: dict[int, str], layer: str = "fc2", *, triage: bool = True,
                 hidden: int = 32) -> None:
        torch.manual_seed(0)
        self.model = Net(hidden)
        self.stepper = PrecisionStepper(precision, device="cpu")
        self.stepper.setup_module(self.model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.stepper.setup_optimizers(self.model, [self.opt])
        self.snapshot = StateSnapshot(self.stepper, self.model, self.opt)
        # 10 events in 40 steps, up to 3 replays each: past the default budget (12 replays per 100 steps); the
        # benchmark measures the classification, so every event gets its replays.
        self.triage = StepTriage(self.stepper, snapshot=self.snapshot, replay_budget=40) if triage else None
        self.faults, self.x, self.y = faults, *regression_data(256)
        self.step = self.executions = self.calls = 0
        getattr(self.model, layer).register_forward_hook(self._hook)
        self.model.fc3.weight.register_hook(self._grad)

    def _hook(self, module, args, output):
        kind = self.faults.get(self.step)
        if kind == "transient" and self.executions == 0:
            output = output.clone()
            output.view(-1)[0] = float("nan")
            return output
        if kind == "overflow":
            amax = output.detach().abs().amax().float().clamp(min=2.0**-100)
            factor = torch.exp2(torch.ceil(torch.log2(2 * FP16_MAX / amax)))
            return output * factor / factor
        return None

    def _grad(self, grad):
        return grad.clone().fill_(float("inf")) if self.faults.get(self.step) == "inf_grad" else grad

    def train(self, steps: int, *, snapshots: bool = False) -> Run:
        for step in range(steps):
            self.step, self.executions = step, 0
            rows = slice(16 * (step % 16), 16 * (step % 16 + 1))
            x, y = self.x[rows].clone(), self.y[rows]
            if self.faults.get(step) == "nan_batch":
                x.view(-1)[0] = float("nan")
            if self.faults.get(step) == "corrupt":
                with torch.no_grad():
                    self.model.fc1.weight.view(-1)[3] = float("nan")

            def closure(x=x, y=y) -> torch.Tensor:
                self.calls += 1
                with self.stepper.forward_context():
                    loss = F.mse_loss(self.model(self.stepper.convert_input(x)).float(), y)
                self.stepper.scale_loss(loss).backward()
                self.executions += 1
                return loss

            if self.triage is not None:
                self.triage.run(self.opt, closure)
            else:
                self.opt.zero_grad(set_to_none=True)
                closure()
                self.stepper.step(self.opt)
            if snapshots and not self.stepper.last_step_skipped:
                self.snapshot.take()
        return self


def classified(run: Run, expected: str, steps: list[int]) -> int:
    events = {e["step"]: e for e in run.triage.events}
    return sum(events.get(step, {}).get("kind") == expected for step in steps)


def clean_cost(repeats: int, steps: int, hidden: int) -> dict[str, float]:
    """CPU seconds per step, triage and plain loops alternated; the median of the per-repeat ratios."""
    ratios, times = [], {"plain": [], "triage": []}
    for _ in range(repeats):
        for name in ("plain", "triage"):
            run = Run("bf16-mixed", {}, triage=name == "triage", hidden=hidden).train(2)  # setup, first step
            start = time.process_time()
            run.train(steps)
            times[name].append((time.process_time() - start) / steps)
        ratios.append(times["triage"][-1] / times["plain"][-1])
    return {"plain_s": statistics.median(times["plain"]), "triage_s": statistics.median(times["triage"]),
            "median_ratio": statistics.median(ratios), "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    rng = random.Random(args.seed)
    result: dict[str, object] = {"cpu": platform.processor() or platform.machine(), "threads": 1,
                                 "cpu_capability": torch.backends.cpu.get_cpu_capability(), "seed": args.seed}
    print(f"CPU: {result['cpu']}, torch CPU capability {result['cpu_capability']}, 1 thread")

    steps = sorted(rng.sample(range(2, 40), 10))
    clean = Run("32-true", {}).train(40)
    faulty = Run("32-true", dict.fromkeys(steps, "transient")).train(40)
    diff = max((a - b).abs().max().item() for a, b in zip(clean.model.parameters(), faulty.model.parameters()))
    result["transient"] = {"classified": classified(faulty, "transient", steps), "max_weight_diff": diff,
                           "clean_step_extra_calls": faulty.calls - 40 - faulty.triage.replays_run}

    hits = 0
    for _ in range(10):
        layer, step = rng.choice(LAYERS), rng.randrange(1, 7)
        run = Run("16-mixed", {step: "overflow"}, layer).train(8)
        event = next((e for e in run.triage.events if e["step"] == step), {})
        hits += event.get("kind") == "precision" and event.get("blamed") == [layer]
    result["precision"] = {"classified_and_blamed": hits}

    steps = sorted(rng.sample(range(2, 40), 10))
    run = Run("32-true", dict.fromkeys(steps, "nan_batch")).train(40, snapshots=True)
    result["data"] = {"classified": classified(run, "data", steps), "rollbacks": run.triage.rollbacks}

    steps = sorted(rng.sample(range(2, 40), 10))
    run = Run("32-true", dict.fromkeys(steps, "corrupt")).train(40, snapshots=True)
    result["state"] = {"classified": classified(run, "state", steps), "rollbacks": run.triage.rollbacks}

    steps = sorted(rng.sample(range(2, 40), 10))
    run = Run("16-mixed", dict.fromkeys(steps, "inf_grad")).train(40)
    result["control"] = {"overflows": run.stepper.overflow_count, "replays": run.triage.replays_run,
                         "events": len(run.triage.events)}

    result["clean_cost_hidden_32"] = clean_cost(args.repeats, 40, 32)
    result["clean_cost_hidden_512"] = clean_cost(args.repeats, 40, 512)
    total = (result["transient"]["classified"] + hits + result["data"]["classified"]  # type: ignore[index]
             + result["state"]["classified"])  # type: ignore[index]
    result["total_classified"] = f"{total}/40"
    print(json.dumps(result, indent=1))
    out = ROOT / "bench" / "results" / "step_triage_events.json"
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

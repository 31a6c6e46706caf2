"""StepTriage on 2 DDP ranks (gloo, CPU): a fault on rank 1 only is triaged alike on both ranks (the same trigger, the
same verdict per replay, the same blamed module, the same action), and the replicas stay identical."""

from __future__ import annotations

import gc
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import spawn_ranks
from torch import nn

from lit_mpstable.core.guards.spike import SpikeGuard
from lit_mpstable.core.step.step_guard import STATE_SHARES, held_tensors
from lit_mpstable.core.step.stepper import PrecisionStepper
from lit_mpstable.core.step.triage_loop import StateSnapshot, StepTriage

WORLD_SIZE, FAULT_RANK, STEPS = 2, 1, 23
# A collective one rank never joins fails after TIMEOUT_S instead of waiting 30 minutes; the whole job after RUN_S.
TIMEOUT_S, RUN_S = 60, 240
NAN = float("nan")

# The faults, all on rank 1 only, by step (StepTriage.run call):
TRANSIENT = 3  # fc2's output gets a NaN on the step's first execution only (a flipped bit)
LOSS_SPIKE = 7  # the loss x 1e4 on the step's first execution only (SpikeGuard rejects it)
PRECISION = 9  # fc2's output is inf while autocast is on, on every execution (an overflow of the low precision)
BAD_WEIGHT = 11  # a NaN written into fc1's weight before the step (a bit flip in memory)
NAN_BATCH = 13  # the batch holds a NaN
# From this step on, the first step whose share of the state check (STATE_SHARES) holds a momentum buffer: NaN
# written into those buffers before it. Loss and gradients stay finite: only rank 1's replays find it (the ranks must
# agree on every verdict, or rank 0 applies its as-is replay while rank 1 climbs on).
BAD_MOMENTUM_FROM = 15
PERSISTENT_SPIKE = 21  # the loss x 1e4 on every execution (SpikeGuard judges the loss averaged over the ranks)
EXPECTED = [
    (TRANSIENT, "transient", "use_replay", ["as_is:clean"]),
    (LOSS_SPIKE, "transient", "use_replay", ["as_is:clean"]),
    (PRECISION, "precision", "fallback", ["as_is:nonfinite", "fp32:clean"]),
    (BAD_WEIGHT, "state", "rollback", ["as_is:nonfinite", "fp32:nonfinite", "snapshot:clean"]),
    (NAN_BATCH, "data", "skip", ["as_is:nonfinite", "fp32:nonfinite", "snapshot:nonfinite"]),
    (None, "state", "rollback", ["as_is:nonfinite", "fp32:nonfinite", "snapshot:clean"]),  # the bad momentum
    (PERSISTENT_SPIKE, "data", "skip", ["as_is:nonfinite", "fp32:nonfinite", "snapshot:nonfinite"]),
]


class _MLP(nn.Module):
    """helpers.TinyMLP's shape (16 -> 32 -> 32 -> 16), defined here: the spawned ranks import this module, and
    helpers imports Lightning (about 6 s of CPU per rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    return x, x @ (torch.randn(16, 16, generator=g) / 4) + 0.01 * torch.randn(n, 16, generator=g)


class _RankLoop:
    """A plain DDP loop: TinyMLP in bf16-mixed through a PrecisionStepper with SpikeGuard, SGD with momentum, a
    StateSnapshot after every applied step, StepTriage; each rank trains on its own half of 4 batches (cycled)."""

    def __init__(self, rank: int) -> None:
        torch.manual_seed(0)
        self.rank = rank
        self.model = _MLP()
        self.stepper = PrecisionStepper("bf16-mixed", device="cpu",
                                        spike_guard=SpikeGuard(zscore=4.0, window=16, warmup=4))
        self.stepper.setup_module(self.model)
        self.ddp = nn.parallel.DistributedDataParallel(self.model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.stepper.setup_optimizers(self.model, [self.opt])
        self.snapshot = StateSnapshot(self.stepper, self.model, self.opt)
        # 7 events in a short run: past the default budget (12 replays per 100 steps)
        self.triage = StepTriage(self.stepper, snapshot=self.snapshot, replay_budget=40)
        x, y = _data()
        self.x, self.y = x[rank::WORLD_SIZE], y[rank::WORLD_SIZE]
        self.step = self.executions = 0
        self.bad_momentum_at: int | None = None
        self.model.fc2.register_forward_hook(self._fc2_fault)

    def _faulty(self, step: int) -> bool:
        return self.rank == FAULT_RANK and self.step == step

    def _fc2_fault(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        self.executions += 1
        if self._faulty(TRANSIENT) and self.executions == 1:
            output = output.clone()
            output.view(-1)[0] = NAN
            return output
        if self._faulty(PRECISION) and torch.is_autocast_enabled("cpu"):
            return output * float("inf")
        return None

    def _corrupt_checked_momentum(self, step: int) -> None:
        """NaN into the momentum buffers this step's state check reads, if it reads any."""
        share = self.stepper.applied_steps(self.opt) % STATE_SHARES
        momenta = {id(state["momentum_buffer"]) for state in self.opt.state.values()}
        checked = [t for t in held_tensors(self.opt, share, stepped=False) if id(t) in momenta]
        with torch.no_grad():
            for buffer in checked:
                buffer.view(-1)[0] = NAN
        self.bad_momentum_at = step if checked else None

    def closure(self, x: torch.Tensor, y: torch.Tensor):
        def run() -> torch.Tensor:
            with self.stepper.forward_context():
                loss = F.mse_loss(self.ddp(self.stepper.convert_input(x)).float(), y)
            if self._faulty(LOSS_SPIKE) and self.executions == 1 or self._faulty(PERSISTENT_SPIKE):
                loss = loss * 1e4
            self.stepper.scale_loss(loss).backward()
            return loss
        return run

    def train(self) -> dict[str, Any]:
        skipped = []
        for step in range(STEPS):
            self.step, self.executions = step, 0
            if self._faulty(BAD_WEIGHT):
                with torch.no_grad():
                    self.model.fc1.weight.view(-1)[3] = NAN
            if self.rank == FAULT_RANK and step >= BAD_MOMENTUM_FROM and self.bad_momentum_at is None:
                self._corrupt_checked_momentum(step)
            rows = slice(8 * (step % 4), 8 * (step % 4 + 1))
            x, y = self.x[rows].clone(), self.y[rows]
            if self._faulty(NAN_BATCH):
                x.view(-1)[0] = NAN
            self.triage.run(self.opt, self.closure(x, y))
            skipped.append(self.stepper.last_step_skipped)
            if not self.stepper.last_step_skipped:
                self.snapshot.take()
        return {
            "bad_momentum_at": self.bad_momentum_at, "events": self.triage.events, "skipped": skipped,
            "replays_run": self.triage.replays_run,
            "islands": list(self.stepper.islands.names), "rollbacks": self.triage.rollbacks,
            "counters": (self.stepper.step_count, self.stepper.skipped_steps, self.stepper.applied_steps()),
            "spikes": int(self.stepper.spike_guard.spikes_skipped),
            "weights": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "momentum": [s["momentum_buffer"].clone() for s in self.opt.state.values()],
        }


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    """One rank: the loop's results to ``rank{r}.pt``. The loop (and its DDP wrapper, which its closures and hooks
    reference in cycles) is collected before the process group is destroyed: a DDP reducer that outlives the group
    hangs the rank's exit (see tests/adapter/test_spike_guard.py)."""
    torch.set_num_threads(1)  # as conftest does: a spawned process starts with the machine's default
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE,
                            timeout=timedelta(seconds=TIMEOUT_S))
    try:
        loop = _RankLoop(rank)
        result = loop.train()
        del loop
        gc.collect()
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _run_two_ranks(tmp_path: Path) -> list[dict[str, Any]]:
    """:func:`_worker` on 2 spawned processes (a fork could copy a lock held by a thread an earlier test started),
    rendezvous through a file of this test's own; a rank still running after RUN_S is killed and the test fails."""
    spawn_ranks(_worker, str(tmp_path / "init"), str(tmp_path), nprocs=WORLD_SIZE, limit_s=RUN_S)
    return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]


@pytest.mark.slow
def test_a_fault_on_one_rank_is_triaged_alike_on_both(tmp_path):
    rank0, rank1 = _run_two_ranks(tmp_path)
    bad_momentum_at = rank1["bad_momentum_at"]
    assert bad_momentum_at is not None and BAD_MOMENTUM_FROM <= bad_momentum_at < PERSISTENT_SPIKE
    expected = [(bad_momentum_at if step is None else step, *rest) for step, *rest in EXPECTED]
    for rank in (rank0, rank1):
        assert [(e["step"], e["kind"], e["action"], e["replays"]) for e in rank["events"]] == expected
    assert rank0["events"] == rank1["events"]  # blamed names and restored steps too
    precision = next(e for e in rank0["events"] if e["kind"] == "precision")
    assert precision["blamed"] == ["fc2"]  # traced on rank 1 only (rank 0's own forward was finite), agreed on both
    assert rank0["islands"] == rank1["islands"] == ["fc2"]
    # A clean replay's step is applied; a "data" step stays skipped. Replays: 1 + 1 + 2 + 3 + 3 + 3 + 3.
    assert rank0["skipped"] == rank1["skipped"] == [s in (NAN_BATCH, PERSISTENT_SPIKE) for s in range(STEPS)]
    assert rank0["replays_run"] == rank1["replays_run"] == 16 and rank0["rollbacks"] == rank1["rollbacks"] == 2
    assert rank0["spikes"] == rank1["spikes"] == 2 and rank0["counters"] == rank1["counters"]
    for name, value in rank0["weights"].items():
        assert torch.isfinite(value).all(), name
        assert torch.equal(value, rank1["weights"][name]), name
    for a, b in zip(rank0["momentum"], rank1["momentum"]):
        assert torch.equal(a, b)

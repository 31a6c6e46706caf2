"""SpikeGuard and a lasting change of level: a loss (or gradient norm) that jumps to a new level and stays there
(new data, a schedule change) is not a spike. Skipped steps never enter the statistics, so without a limit every
later step would be skipped and training would stop, silently."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from lit_mpstable.core.guards.spike import SpikeGuard
from lit_mpstable.core.step.stepper import PrecisionStepper

pytestmark = pytest.mark.usefixtures("spike_guard_path")  # each test on the C loops and on the torch ops (conftest)


def _shifted_run(guard: SpikeGuard, steps: int = 140, shift_at: int = 60, precision: str = "32-true"):
    """A regression whose target moves by +3 at ``shift_at``, for good; returns the stepper, skipped steps and
    losses."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    stepper = PrecisionStepper(precision, device="cpu", spike_guard=guard)
    stepper.setup_module(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepper.setup_optimizers(model, [opt])
    gen, w = torch.Generator().manual_seed(1), torch.randn(8, 1, generator=torch.Generator().manual_seed(2))
    skipped, losses = [], []
    for step in range(steps):
        x = torch.randn(32, 8, generator=gen)
        y = x @ w + (3.0 if step >= shift_at else 0.0)
        with stepper.forward_context():
            out = model(x)
        loss = ((out.float() - y) ** 2).mean()
        stepper.scale_loss(loss).backward()
        stepper.step(opt)
        opt.zero_grad()
        if stepper.last_step_skipped:
            skipped.append(step)
        losses.append(float(loss))
    return stepper, skipped, losses


def test_a_lasting_shift_is_skipped_max_consecutive_times_then_trained_on():
    guard = SpikeGuard(warmup=10, window=32, max_consecutive=16)
    stepper, skipped, losses = _shifted_run(guard)
    assert skipped == list(range(60, 76))  # 16 in a row, then the statistics restart and the new level is trained
    assert guard.level_shifts == 1 and int(guard.spikes_skipped) == 16
    assert losses[-1] < 0.1 * losses[60]  # training went on at the new level
    notes = [w for w in stepper.warnings if "in a row" in w]
    assert len(notes) == 1 and "step 75" in notes[0] and "restart" in notes[0]


def test_without_a_limit_the_shift_is_skipped_for_ever():
    guard = SpikeGuard(warmup=10, window=32, max_consecutive=None)
    _, skipped, _ = _shifted_run(guard)
    assert skipped == list(range(60, 140)) and guard.level_shifts == 0


def test_the_run_of_skips_resumes_exactly():
    whole = SpikeGuard(warmup=10, window=32, max_consecutive=16)
    _shifted_run(whole, steps=70)  # 10 of the 16 skips done
    state = whole.state_dict()
    assert state["consecutive_spikes"] == 10
    buffer = io.BytesIO()
    torch.save(state, buffer)
    resumed = SpikeGuard(warmup=10, window=32, max_consecutive=16)
    resumed.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    for _ in range(6):
        resumed.count_run_(skipped_as_spike=True, applied=False)
    assert resumed.level_shifts == 1 and resumed.state_dict()["consecutive_spikes"] == 0
    assert int(resumed.state_dict()["loss_count"]) == 0  # the statistics restarted


def test_a_state_saved_before_the_limit_existed_loads():
    guard = SpikeGuard(window=8)
    state = guard.state_dict()
    del state["consecutive_spikes"]
    guard.load_state_dict(state)
    assert guard.state_dict()["consecutive_spikes"] == 0


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (1.5, TypeError), (True, TypeError)])
def test_max_consecutive_is_validated(value, error):
    with pytest.raises(error, match=f"max_consecutive={value!r}"):
        SpikeGuard(max_consecutive=value)


# ------------------------------------------------------------------------------------------------ DDP
def _ddp_shift_worker(rank: int, init_file: str, out_dir: str) -> None:
    """Two gloo ranks, a plain DDP loop; only rank 1's data moves to a new level at step 40, for good."""
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        guard = SpikeGuard(warmup=5, window=16, max_consecutive=6)
        stepper = PrecisionStepper("bf16-mixed", device="cpu", spike_guard=guard)
        stepper.setup_module(model)
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        stepper.setup_optimizers(model, [opt])
        gen, w = torch.Generator().manual_seed(10 + rank), torch.randn(8, 1, generator=torch.Generator().manual_seed(2))
        skipped = []
        for step in range(80):
            x = torch.randn(32, 8, generator=gen)
            y = x @ w + (3.0 if rank == 1 and step >= 40 else 0.0)
            with stepper.forward_context():
                loss = ((ddp(x).float() - y) ** 2).mean()
            stepper.scale_loss(loss).backward()
            stepper.step(opt)
            opt.zero_grad()
            skipped.append(stepper.last_step_skipped)
        del ddp  # before the group goes (see tests/adapter/test_spike_guard.py's DDP worker)
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        torch.save({"skipped": skipped, "shifts": guard.level_shifts, "spikes": int(guard.spikes_skipped),
                    "warnings": list(stepper.warnings), "weights": weights}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_shift_on_one_rank_restarts_both_at_the_same_step(tmp_path):
    from helpers import spawn_ranks

    spawn_ranks(_ddp_shift_worker, str(tmp_path / "init"), str(tmp_path), limit_s=240)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    skipped = [i for i, s in enumerate(ranks[0]["skipped"]) if s]
    assert skipped == list(range(40, 46)) and ranks[0]["skipped"] == ranks[1]["skipped"]
    assert ranks[0]["shifts"] == ranks[1]["shifts"] == 1 and ranks[0]["spikes"] == ranks[1]["spikes"] == 6
    assert any("6 steps in a row" in w for w in ranks[0]["warnings"])
    for k, v in ranks[0]["weights"].items():
        assert torch.equal(v, ranks[1]["weights"][k]), k

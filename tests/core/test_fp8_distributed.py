"""Distributed FP8 (delayed recipe): ``PrecisionLayout.sync_fp8_`` makes every rank's amax histories and scales
agree with one all-reduce per step and no host read, 2 CPU processes over gloo with different data per rank; without
it they part ways (the control). On one process it changes nothing."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import HostReads, TinyMLP, regression_data
from torch import nn

from lit_mpstable.core.layout.layout import PrecisionLayout
from lit_mpstable.fp8 import FP8Config, FP8Linear

WORLD_SIZE, STEPS, HISTORY = 2, 3, 4
FP8_MAX = (448.0, 448.0, 57344.0)  # x, w (E4M3), grad_out (E5M2): OCP FP8 spec, by hand


def _train(rank: int, *, sync: bool, ddp: bool) -> dict[str, list]:
    """TinyMLP with fc2 in FP8 (delayed), SGD; rank r's inputs are scaled by 1 + 3r. Records fc2's state after each
    step and, through hooks, the amaxes fc2 saw on this rank (its input, its output gradient)."""
    torch.manual_seed(0)
    model = TinyMLP()
    layout = PrecisionLayout(
        torch.float32, cast_parameters=False, fp8=FP8Config(recipe="delayed", amax_history_len=HISTORY, emulate=True)
    )
    layout.attach(model, "cpu")
    fc2 = model.fc2
    assert isinstance(fc2, FP8Linear)  # attach swapped it (the delayed recipe, native backend)
    local: dict[str, list[float]] = {"x": [], "grad_out": []}

    def record_grad_out(m: nn.Module, gin: tuple[torch.Tensor, ...], gout: tuple[torch.Tensor, ...]) -> None:
        local["grad_out"].append(gout[0].abs().max().item())

    fc2.register_forward_hook(lambda m, args, out: local["x"].append(args[0].abs().max().item()))
    fc2.register_full_backward_hook(record_grad_out)
    # broadcast_buffers=False: DDP's default copies rank 0's buffers (the histories too) into every rank at each
    # forward, which would align the ranks on rank 0's amaxes alone and hide the control.
    net = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False) if ddp else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = regression_data(16, seed=rank)
    x = x * (1 + 3 * rank)
    out: dict[str, list] = {
        "scale": [], "history": [], "w_amax": [], "outputs": [], "host_reads": [], "collectives": [],
    }
    calls: list[str] = []
    all_reduce = dist.all_reduce

    def counted(*args, **kwargs):
        calls.append("all_reduce")
        return all_reduce(*args, **kwargs)

    for _ in range(STEPS):
        out["w_amax"].append(model.fc2.weight.detach().abs().max().item())
        optimizer.zero_grad()
        prediction = net(x)
        nn.functional.mse_loss(prediction, y).backward()
        optimizer.step()
        if sync:
            calls.clear()
            dist.all_reduce = counted
            try:
                with HostReads() as reads:
                    layout.sync_fp8_()
            finally:
                dist.all_reduce = all_reduce
            out["host_reads"].append(reads.ops)
            out["collectives"].append(list(calls))
        out["outputs"].append(prediction.detach().clone())
        out["scale"].append(fc2.scale.clone())
        out["history"].append(fc2.amax_history.clone())
    return {**out, **local}


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=60)
    )
    try:
        results = {sync: _train(rank, sync=sync, ddp=True) for sync in (True, False)}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_synced_amax_histories_give_every_rank_the_same_scales(tmp_path: Path) -> None:
    mp.start_processes(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD_SIZE, start_method="fork")
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]
    synced = [r[True] for r in ranks]
    for r in synced:  # per step one MAX all-reduce of every history, and nothing read on the host
        assert r["collectives"] == [["all_reduce"]] * STEPS and r["host_reads"] == [[]] * STEPS
    for step in range(STEPS):
        assert torch.equal(synced[0]["scale"][step], synced[1]["scale"][step])
        assert torch.equal(synced[0]["history"][step], synced[1]["history"][step])
        # The expectation from what each rank saw: per step the max over ranks, the scale from the window's max.
        seen = [[max(r[key][s] for r in synced) for s in range(step + 1)] for key in ("x", "w_amax", "grad_out")]
        window = [values[-HISTORY:][::-1] + [0.0] * (HISTORY - len(values[-HISTORY:])) for values in seen]
        assert torch.equal(synced[0]["history"][step], torch.tensor(window, dtype=torch.float32))
        expected = [fp8_max / max(values) for fp8_max, values in zip(FP8_MAX, window)]
        assert torch.equal(synced[0]["scale"][step], torch.tensor(expected, dtype=torch.float32))
    assert synced[0]["x"][0] != synced[1]["x"][0]  # the ranks did see different data
    alone = [r[False] for r in ranks]  # the control: each rank keeps its own amaxes, and scales with them
    assert all(not torch.equal(alone[0]["scale"][step], alone[1]["scale"][step]) for step in range(STEPS))
    assert not torch.equal(alone[0]["history"][-1], alone[1]["history"][-1])


def test_sync_changes_nothing_on_one_process() -> None:
    assert not dist.is_initialized()
    with_sync, without = _train(0, sync=True, ddp=False), _train(0, sync=False, ddp=False)
    for key in ("scale", "history", "outputs"):
        assert all(torch.equal(a, b) for a, b in zip(with_sync[key], without[key]))

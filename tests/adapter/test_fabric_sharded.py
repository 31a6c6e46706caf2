"""plugin.load with sharded checkpoints (Fabric, FSDP2 through ModelParallelStrategy, 2 CPU processes on gloo): the
plugin's state loaded (Lightning's sharded load assigns its dict instead), each rank's shards checked against the
checksums it took at the save, a bit flipped in one rank's shard refused on both ranks or replaced by the newest
earlier directory that passes ("previous"), and the restored-state rung loading the directory before one that goes
NaN after the load; a save inside a no-sync accumulation window leaving the accumulating gradients as they were, an
earlier directory whose shards cannot be read passed over on both ranks, and ranks that pinned different rows saving
and loading the pinned pass on rank 0's.

The runs fork (the children inherit the imports) and write each rank's results to a file.
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_helpers import WORLD_SIZE, sharded_fabric, spawn_ranks
from helpers import TinyMLP, quiet_fabric, regression_data

from lit_mpstable.core.checkpoints import SHARDED_META, earlier_sharded_checkpoints
from lit_mpstable.core.fingerprint import (
    KEY,
    FingerprintMismatch,
    checksums,
    compare_shard_checksums,
    pin_batch,
    pinned_pass,
)
from lit_mpstable.frontends.fabric import StablePrecision

SAVED = 4  # checkpoints of steps 1..4; in the "wrong" set the one of step 4 holds a learning rate x1e7
LR = 1e-2


def _loss(module: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(module(batch[0]).float(), batch[1])


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s half of the batch of ``step`` (samples rank, rank + 2, ... of a 16-sample slice)."""
    x, y = regression_data(64)
    rows = slice(16 * (step % 4) + rank, 16 * (step % 4 + 1), 2)
    return x[rows], y[rows]


def _local(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shards of the model's weights (copies)."""
    return {name: p.detach().to_local().clone() for name, p in model.module.named_parameters()}


def _worker(rank: int, port: int, job: Callable[..., dict[str, Any]], out_dir: str, kwargs: dict[str, Any]) -> None:
    plugin = StablePrecision(kwargs.pop("precision", "32-true"), **kwargs.pop("plugin", {}),
                             on_fingerprint_mismatch=kwargs.pop("on_mismatch", "raise"))
    fabric = sharded_fabric(rank, port, plugin)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notices
        torch.manual_seed(kwargs.pop("seed", 0))
        model = fabric.setup_module(TinyMLP())
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
        plugin.setup_optimizers(optimizer)
        plugin.pin(_loss, _batch(0, fabric.global_rank if kwargs.pop("own_rows", False) else 0))
        state = {"model": model, "optimizer": optimizer, "precision": plugin, "step": 0}
        try:
            report = job(fabric, plugin, state, **kwargs)
        except Exception as error:  # noqa: BLE001  (the test reads it)
            report = {"error": (type(error).__name__, str(error))}
        report["events"] = [dict(e) for e in plugin.fingerprint.events]
        report["ladder"] = [dict(e) for e in plugin.ladder_events]
    torch.save(report, Path(out_dir) / f"rank{rank}.pt")


def _run(out_dir: Path, job: Callable[..., dict[str, Any]], **kwargs: Any) -> list[dict[str, Any]]:
    return spawn_ranks(_worker, out_dir, job, str(out_dir), kwargs)


def _save_job(fabric: Any, plugin: StablePrecision, state: dict[str, Any], directory: str) -> dict[str, Any]:
    """Steps 1..SAVED, a sharded checkpoint after each in ``good/step=k``, the same in ``wrong/step=k`` but that of
    step SAVED with the learning rate written x1e7 (every number finite, its fingerprint what was written); then two
    more steps unsaved (what a resume must reach)."""
    model, optimizer = state["model"], state["optimizer"]
    shards = {}
    while state["step"] < SAVED + 2:
        state["step"] += 1
        fabric.backward(_loss(model, _batch(state["step"], fabric.global_rank)))
        optimizer.step()
        optimizer.zero_grad()
        shards[state["step"]] = _local(model)
        for kind in ("good", "wrong") if state["step"] <= SAVED else ():
            scale = 1e7 if kind == "wrong" and state["step"] == SAVED else 1.0
            optimizer.param_groups[0]["lr"] = LR * scale
            fabric.save(Path(directory) / kind / f"step={state['step']}", state)
            optimizer.param_groups[0]["lr"] = LR
            if fabric.global_rank == 0:
                path = Path(directory) / kind / f"step={state['step']}"
                os.utime(path, ns=(10**9 * state["step"],) * 2)  # written in order, seconds apart
            fabric.barrier()
    # The pinned pass with gradients held (as between a backward and the step): every rank runs it (state_dict is
    # collective), and it leaves each `.grad` the same tensor with the same values.
    fabric.backward(_loss(model, _batch(0, fabric.global_rank)))
    held = [(p.grad, p.grad.to_local().clone()) for p in model.parameters()]
    pinned = plugin.state_dict()[KEY]["pinned"]
    kept = all(p.grad is grad and torch.equal(p.grad.to_local(), value)
               for p, (grad, value) in zip(model.parameters(), held, strict=True))
    optimizer.zero_grad()
    whole = TinyMLP()  # the same weights unsharded, in one process: the pinned pass's reference
    whole.load_state_dict({name: p.full_tensor() for name, p in model.module.named_parameters()})
    reference = pinned_pass(whole, _loss, plugin.fingerprint.batch, forward_context=nullcontext).tolist()
    return {"shards": shards, "pinned": {k: pinned[k] for k in ("loss", "grad_norm")}, "grads_kept": kept,
            "reference": reference}


def _load_job(fabric: Any, plugin: StablePrecision, state: dict[str, Any], path: str, steps: int = 0,
              **load: Any) -> dict[str, Any]:
    """``plugin.load(fabric, path, state, **load)`` into a fresh run (other weights), then train to ``steps``."""
    plugin.load(fabric, path, state, **load)
    report: dict[str, Any] = {"loaded_step": state["step"], "step_count": plugin.step_count, "shards": _local(
        state["model"]), "plugin_is_plugin": state["precision"] is plugin}
    model, optimizer = state["model"], state["optimizer"]
    rows = []
    while state["step"] < steps:
        rows.append(state["step"])
        state["step"] += 1
        loss = _loss(model, _batch(state["step"], fabric.global_rank))
        fabric.backward(loss)
        optimizer.step()  # a bad step soon after the load loads the directory before into `state`
        optimizer.zero_grad()
        rows[-1] = (rows[-1], loss.item())
    report.update(rows=rows, step=state["step"], lr=optimizer.param_groups[0]["lr"], final=_local(model),
                  finite=all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters()))
    return report


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("sharded")
    return directory, _run(directory / "save", _save_job, directory=str(directory))


def _copy(saved: tuple[Path, list[dict[str, Any]]], kind: str, tmp_path: Path) -> list[Path]:
    """The ``kind`` checkpoints copied for one test (modification times kept), oldest first."""
    target = tmp_path / kind
    shutil.copytree(saved[0] / kind, target)
    paths = [target / f"step={step}" for step in range(1, SAVED + 1)]
    for step, path in enumerate(paths, 1):
        os.utime(path, ns=(10**9 * step,) * 2)
    return paths


def _replace(path: Path, shard: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value`` over ``shard``'s bytes in ``path``'s shard files; the directory's modification time is kept."""
    data, new = (t.contiguous().view(-1).numpy().tobytes() for t in (shard, value))
    for file in sorted(path.glob("*.distcp")):
        raw = file.read_bytes()
        if data in raw:
            written = path.stat().st_mtime_ns
            file.write_bytes(raw.replace(data, new, 1))
            os.utime(path, ns=(written, written))
            return
    raise AssertionError(f"no shard file of {path} holds the shard's bytes")


def _flip_bit(path: Path, shard: torch.Tensor) -> str:
    """Flip one bit in the middle of ``shard``'s bytes where they are stored in ``path``'s shard files (as a disk or
    a copy would); the directory's modification time is kept. Returns the file changed."""
    data = shard.contiguous().view(-1).numpy().tobytes()
    for file in sorted(path.glob("*.distcp")):
        raw = bytearray(file.read_bytes())
        at = raw.find(data)
        if at >= 0:
            raw[at + len(data) // 2] ^= 0x10
            written = path.stat().st_mtime_ns
            file.write_bytes(bytes(raw))
            os.utime(path, ns=(written, written))
            return file.name
    raise AssertionError(f"no shard file of {path} holds the shard's bytes")


def test_each_rank_checksums_its_shards_at_the_save(saved) -> None:
    # Before: tensor_leaves skipped DTensors, so a sharded checkpoint's fingerprint held only AdamW's step counts.
    meta = torch.load(saved[0] / "good" / f"step={SAVED}" / SHARDED_META, weights_only=True)
    sums = meta["precision"][KEY]["checksums"]
    for rank in range(WORLD_SIZE):
        for name in ("fc1.weight", "fc3.bias"):
            assert f"shards[rank {rank} of 2]model[{name!r}]" in sums
        assert f"shards[rank {rank} of 2]optimizer['fc1.weight']['state'][0]['exp_avg_sq']" in sums
    assert sums["shards[rank 0 of 2]model['fc1.weight']"] != sums["shards[rank 1 of 2]model['fc1.weight']"]


def test_a_sharded_checkpoint_loads_the_plugins_state_and_passes_on_both_ranks(saved, tmp_path: Path) -> None:
    # Before: plugin.load refused a directory, and a plain fabric.load assigned the plugin's saved dict to
    # state["precision"] without loading it (the counters and scaler of a fresh run).
    # Two steps on, both ranks' shards are the uninterrupted run's, bit for bit (AdamW's state came back too).
    paths = _copy(saved, "good", tmp_path)
    ranks = _run(tmp_path / "out", _load_job, path=str(paths[-1]), seed=100, steps=SAVED + 2)
    for rank, report in enumerate(ranks):
        assert "error" not in report, report["error"]
        assert report["plugin_is_plugin"] and report["loaded_step"] == SAVED and report["step_count"] == SAVED
        assert [e["action"] for e in report["events"]] == ["passed", "passed"]  # the plugin's state; the rest
        for name, value in saved[1][rank]["shards"][SAVED].items():
            assert torch.equal(report["shards"][name], value), (rank, name)
        for name, value in saved[1][rank]["shards"][SAVED + 2].items():
            assert torch.equal(report["final"][name], value), (rank, name)


def test_the_pinned_gradient_norm_is_the_sharded_models_on_every_rank(saved) -> None:
    # Before: torch.autograd.grad with respect to the sharded parameters, which FSDP2's all-gathered ones are not
    # connected to: every gradient None, the norm 0 at the save and the load.
    meta = torch.load(saved[0] / "good" / f"step={SAVED}" / SHARDED_META, weights_only=False)
    assert meta["precision"][KEY]["pinned"]["grad_norm"] > 0
    assert saved[1][0]["pinned"] == saved[1][1]["pinned"] and saved[1][0]["pinned"]["grad_norm"] > 0
    assert saved[1][0]["grads_kept"] and saved[1][1]["grads_kept"]
    # Both ranks pinned the same rows, so FSDP2's averaged gradient is that of the unsharded model on them.
    loss, grad_norm = saved[1][0]["reference"]
    assert saved[1][0]["pinned"]["loss"] == loss
    assert math.isclose(saved[1][0]["pinned"]["grad_norm"], grad_norm, rel_tol=1e-5)


def test_a_weight_changed_with_its_checksum_rewritten_is_refused_by_the_pinned_pass(saved, tmp_path: Path) -> None:
    # Rank 1's shard of fc2.weight scaled x1.5 in its shard file, its checksum in meta.pt rewritten to match: only the
    # pinned pass can tell, and its loss and gradient norm both moved.
    paths = _copy(saved, "good", tmp_path)
    shard = saved[1][1]["shards"][SAVED]["fc2.weight"]
    _replace(paths[-1], shard, shard * 1.5)
    meta = torch.load(paths[-1] / SHARDED_META, weights_only=False)
    meta["precision"][KEY]["checksums"].update(checksums({"shards[rank 1 of 2]model": {"fc2.weight": shard * 1.5}}))
    torch.save(meta, paths[-1] / SHARDED_META)
    ranks = _run(tmp_path / "out", _load_job, path=str(paths[-1]), seed=100)
    for report in ranks:
        kind, message = report["error"]
        assert kind == FingerprintMismatch.__name__ and "checksum" not in message
        assert "the pinned micro-batch's loss is" in message and "the pinned micro-batch's grad norm is" in message
    assert ranks[0]["events"] == ranks[1]["events"]


def test_a_bit_flipped_in_one_ranks_shard_is_refused_on_both_ranks(saved, tmp_path: Path) -> None:
    paths = _copy(saved, "good", tmp_path)
    _flip_bit(paths[-1], saved[1][1]["shards"][SAVED]["fc2.weight"])
    ranks = _run(tmp_path / "out", _load_job, path=str(paths[-1]), seed=100)
    for report in ranks:
        kind, message = report["error"]
        assert kind == FingerprintMismatch.__name__
        assert "checksum of tensor `shards[rank 1 of 2]model['fc2.weight']` differs" in message
        assert "rank 0 of 2" not in message  # rank 0's shards are intact; rank 1's finding reached it
    assert ranks[0]["events"] == ranks[1]["events"]


def test_previous_loads_the_newest_earlier_sharded_checkpoint_that_passes(saved, tmp_path: Path) -> None:
    # The newest has a bit flipped in rank 1's fc2 shard, the one before in rank 0's fc1 shard: both ranks load the
    # third newest, after checking each one whole.
    paths = _copy(saved, "good", tmp_path)
    _flip_bit(paths[-1], saved[1][1]["shards"][SAVED]["fc2.weight"])
    _flip_bit(paths[-2], saved[1][0]["shards"][SAVED - 1]["fc1.weight"])
    ranks = _run(tmp_path / "out", _load_job, path=str(paths[-1]), seed=100, on_mismatch="previous",
                 restored_window=0)
    for rank, report in enumerate(ranks):
        assert "error" not in report, report["error"]
        assert report["loaded_step"] == SAVED - 2 == report["step_count"]
        assert [e.get("fallback") for e in report["events"] if e["action"] == "previous"] == [
            str(paths[-2]), str(paths[-3])]
        for name, value in saved[1][rank]["shards"][SAVED - 2].items():
            assert torch.equal(report["shards"][name], value), (rank, name)
    assert ranks[0]["events"] == ranks[1]["events"]
    assert "shards[rank 0 of 2]model['fc1.weight']" in str(ranks[0]["events"][3]["differences"])


def test_a_sharded_checkpoint_that_goes_nan_after_the_load_restores_the_one_before(saved, tmp_path: Path) -> None:
    # The learning rate written x1e7 (every number finite, the fingerprint matching): the third step after the load
    # is non-finite on both ranks; the rung loads step=3's directory in that step and the run finishes.
    paths = _copy(saved, "wrong", tmp_path)
    ranks = _run(tmp_path / "out", _load_job, path=str(paths[-1]), seed=100, steps=SAVED + 6, restored_window=5)
    for report in ranks:
        assert "error" not in report, report["error"]
        assert [step for step, loss in report["rows"] if not math.isfinite(loss)] == [SAVED + 2]
        assert [step for step, _ in report["rows"]] == [4, 5, 6, 3, 4, 5, 6, 7, 8, 9] and report["step"] == SAVED + 6
        (event,) = [e for e in report["ladder"] if e["action"] != "skip"]
        assert (event["fault"], event["rung"], event["action"]) == ("restored", "restore", "restore_previous")
        assert (event["checkpoint"], event["failed"], event["restored_step"]) == (str(paths[-2]), str(paths[-1]),
                                                                                  SAVED - 1)
        assert report["lr"] == LR and report["finite"]
    assert ranks[0]["ladder"] == ranks[1]["ladder"]


def test_the_rung_passes_over_an_earlier_directory_whose_shards_fail_once_loaded(saved, tmp_path: Path) -> None:
    # step=3's meta.pt passes (its plugin state and manifest), but a bit is flipped in rank 0's fc3 shard: loaded,
    # compared and given up on both ranks; step=2 is loaded instead, and the run finishes.
    paths = _copy(saved, "wrong", tmp_path)
    _flip_bit(paths[-2], saved[1][0]["shards"][SAVED - 1]["fc3.weight"])
    ranks = _run(tmp_path / "out", _load_job, path=str(paths[-1]), seed=100, steps=SAVED + 6, restored_window=5)
    for report in ranks:
        assert "error" not in report, report["error"]
        (event,) = [e for e in report["ladder"] if e["action"] != "skip"]
        assert (event["checkpoint"], event["restored_step"]) == (str(paths[-3]), SAVED - 2)
        assert len(event["skipped"]) == 1 and event["skipped"][0].startswith(
            f"{paths[-2]} (checksum of tensor `shards[rank 0 of 2]model['fc3.weight']` differs")
        assert [step for step, _ in report["rows"]][3:] == [2, 3, 4, 5, 6, 7, 8, 9] and report["finite"]
    assert ranks[0]["ladder"] == ranks[1]["ladder"]


def test_a_sharded_checkpoint_without_the_plugins_state_is_refused_naming_it(saved, tmp_path: Path) -> None:
    paths = _copy(saved, "good", tmp_path)
    meta = torch.load(paths[-1] / SHARDED_META, weights_only=True)
    torch.save({"step": meta["step"]}, paths[-1] / SHARDED_META)  # saved without the plugin
    ranks = _run(tmp_path / "out", _load_job, path=str(paths[-1]), seed=100)
    for report in ranks:
        kind, message = report["error"]
        assert kind == "KeyError" and "the sharded checkpoint holds no 'precision' (its meta.pt has [])" in message


def test_shards_saved_on_another_number_of_ranks_are_noted_not_compared() -> None:
    saved = {"shards[rank 0 of 4]model['fc1.weight']": 1, "shards[rank 3 of 4]model['fc1.weight']": 2}
    assert compare_shard_checksums(saved, {"model": {}}) == ([], [
        "the checkpoint's shards were checksummed on 4 ranks, this run has 1: resharded as they load, their local"
        " shards were not compared"])
    assert compare_shard_checksums(saved, {"optimizer": []}) == ([], [])  # none under this root
    assert compare_shard_checksums({"model['fc1.weight']": 3}, {"model": {}}) == ([], [])


def test_earlier_sharded_checkpoints_are_the_directories_written_before(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        (tmp_path / f"step={step}").mkdir()
        (tmp_path / f"step={step}" / SHARDED_META).write_bytes(b"")
        os.utime(tmp_path / f"step={step}", ns=(10**9 * step,) * 2)
    (tmp_path / "step=0").mkdir()  # no meta.pt: not a sharded checkpoint
    (tmp_path / "step=9.pt").write_bytes(b"")  # a file
    assert earlier_sharded_checkpoints(tmp_path / "step=3") == [tmp_path / "step=2", tmp_path / "step=1"]
    assert earlier_sharded_checkpoints(tmp_path / "step=1") == []


def test_plugin_load_refuses_a_directory_that_is_not_a_sharded_checkpoint(tmp_path: Path) -> None:
    plugin = StablePrecision("32-true")
    fabric = quiet_fabric(plugin)
    model, optimizer = fabric.setup(TinyMLP(), torch.optim.AdamW(TinyMLP().parameters()))
    state = {"model": model, "optimizer": optimizer, "precision": plugin}
    with pytest.raises(ValueError, match=r"load\(path=PosixPath\('.*'\)\): must be the path of a checkpoint file"
                                         r" fabric.save wrote, or of a sharded checkpoint's directory .*; this"
                                         r" directory holds no meta.pt"):
        plugin.load(fabric, tmp_path, state)


def _unsharded_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradients FSDP2 accumulates outside ``.grad`` while gradient sync is off (copies): the unsharded
    parameters' ``.grad``, or, where they are reduced in another dtype, ``unsharded_accumulated_grad``."""
    from torch.distributed.fsdp import FSDPModule

    found = {}
    for name, module in model.module.named_modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for index, param in enumerate(group.fsdp_params):
                    grad = param.unsharded_accumulated_grad
                    if grad is None and hasattr(param, "_unsharded_param"):
                        grad = param._unsharded_param.grad
                    if grad is not None:
                        found[f"{name}[{index}]"] = grad.detach().clone()
    return found


def _window_job(fabric: Any, plugin: StablePrecision, state: dict[str, Any], directory: str, save: bool
                ) -> dict[str, Any]:
    """A step, then two accumulation windows of two micro-batches, the gradient sync off for the first micro-batch:
    through ``fabric.no_backward_sync`` in the first window, ``set_requires_gradient_sync(False)`` in the second. With
    ``save``, a checkpoint before each window and one between its micro-batches."""
    model, optimizer, rank = state["model"], state["optimizer"], fabric.global_rank
    report: dict[str, Any] = {"accumulated": [], "grads": [], "shards": []}
    fabric.backward(_loss(model, _batch(1, rank)))
    optimizer.step()
    optimizer.zero_grad()
    for window in (1, 2):
        if save:
            fabric.save(Path(directory) / f"before={window}", state)
        first = _loss(model, _batch(2 * window, rank))
        if window == 1:
            with fabric.no_backward_sync(model):
                fabric.backward(first)
                if save:
                    fabric.save(Path(directory) / f"inside={window}", state)
        else:
            model.module.set_requires_gradient_sync(False)
            fabric.backward(first)
            if save:
                fabric.save(Path(directory) / f"inside={window}", state)
            model.module.set_requires_gradient_sync(True)
        report["accumulated"].append(_unsharded_grads(model))
        fabric.backward(_loss(model, _batch(2 * window + 1, rank)))
        report["grads"].append({name: p.grad.to_local().clone() for name, p in model.module.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        report["shards"].append(_local(model))
    return report


@pytest.mark.parametrize("plugin", [{"precision": "32-true"}, {"precision": "bf16-true", "plugin": {
    "master_weights": False}}], ids=["32-true", "bf16-true"])
def test_a_save_inside_a_no_sync_window_leaves_the_accumulating_gradients(plugin: dict[str, Any], tmp_path: Path
                                                                          ) -> None:
    # Before: the pinned pass's backward ran with the sync off, so FSDP2 added its gradients to the unsharded ones
    # it accumulates (outside `.grad`), and its gradient norm was 0 (nothing reduce-scattered into `.grad`). Now the
    # accumulating gradients (the unsharded parameters' `.grad` in 32-true, FSDP2's FP32 `unsharded_accumulated_grad`
    # in bf16-true without masters) are set aside and the sync is on for that one backward.
    plain = _run(tmp_path / "plain", _window_job, directory=str(tmp_path / "plain"), save=False, **plugin)
    saved = _run(tmp_path / "saved", _window_job, directory=str(tmp_path / "saved"), save=True, **plugin)
    for rank, (without, with_saves) in enumerate(zip(plain, saved, strict=True)):
        assert "error" not in with_saves, with_saves["error"]
        for window in range(2):
            accumulated = without["accumulated"][window]
            assert accumulated and accumulated.keys() == with_saves["accumulated"][window].keys(), (rank, window)
            assert {value.dtype for value in accumulated.values()} == {torch.float32}  # bf16: FSDP2's FP32 buffer
            for part in ("accumulated", "grads", "shards"):
                for name, value in without[part][window].items():
                    assert torch.equal(with_saves[part][window][name], value), (rank, window, part, name)
    for window in (1, 2):  # the weights do not move inside a window: the same pinned loss and gradient norm
        pinned = [torch.load(tmp_path / "saved" / f"{when}={window}" / SHARDED_META, weights_only=False)[
            "precision"][KEY]["pinned"] for when in ("before", "inside")]
        assert pinned[0]["grad_norm"] > 0 and (pinned[0]["loss"], pinned[0]["grad_norm"]) == (
            pinned[1]["loss"], pinned[1]["grad_norm"])


def _truncate(path: Path) -> str:
    """Cut ``path``'s first shard file to half its length (a copy or a write cut short); the directory's modification
    time is kept. Returns the file's name."""
    file = sorted(path.glob("*.distcp"))[0]
    written = path.stat().st_mtime_ns
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    os.utime(path, ns=(written, written))
    return file.name


def test_previous_passes_over_an_earlier_directory_whose_shards_cannot_be_read(saved, tmp_path: Path) -> None:
    # Before: the truncated shard file's read error surfaced as the load's own error. Now the directory counts as
    # failing on both ranks (only one of them reads the cut file), named with why, and the third newest loads.
    paths = _copy(saved, "good", tmp_path)
    _flip_bit(paths[-1], saved[1][1]["shards"][SAVED]["fc2.weight"])
    _truncate(paths[-2])
    ranks = _run(tmp_path / "out", _load_job, path=str(paths[-1]), seed=100, on_mismatch="previous",
                 restored_window=0)
    for rank, report in enumerate(ranks):
        assert "error" not in report, report["error"]
        assert report["loaded_step"] == SAVED - 2 == report["step_count"]
        fallbacks = [e for e in report["events"] if e["action"] == "previous"]
        assert [e.get("fallback") for e in fallbacks] == [str(paths[-2]), str(paths[-3])]
        assert fallbacks[1]["source"] == str(paths[-2]) and fallbacks[1]["differences"][0].startswith("unreadable (")
        for name, value in saved[1][rank]["shards"][SAVED - 2].items():
            assert torch.equal(report["shards"][name], value), (rank, name)
    assert ranks[0]["events"] == ranks[1]["events"]


def test_the_rung_passes_over_an_earlier_directory_whose_shards_cannot_be_read(saved, tmp_path: Path) -> None:
    paths = _copy(saved, "wrong", tmp_path)
    _truncate(paths[-2])
    ranks = _run(tmp_path / "out", _load_job, path=str(paths[-1]), seed=100, steps=SAVED + 6, restored_window=5)
    for report in ranks:
        assert "error" not in report, report["error"]
        (event,) = [e for e in report["ladder"] if e["action"] != "skip"]
        assert (event["checkpoint"], event["restored_step"]) == (str(paths[-3]), SAVED - 2)
        assert len(event["skipped"]) == 1 and event["skipped"][0].startswith(f"{paths[-2]} (unreadable (")
        assert report["finite"]
    assert ranks[0]["ladder"] == ranks[1]["ladder"]


def _own_rows_save_job(fabric: Any, plugin: StablePrecision, state: dict[str, Any], directory: str) -> dict[str, Any]:
    """Two steps, then a sharded checkpoint in ``directory``; what each rank pinned and its shards at the save."""
    model, optimizer = state["model"], state["optimizer"]
    while state["step"] < 2:
        state["step"] += 1
        fabric.backward(_loss(model, _batch(state["step"], fabric.global_rank)))
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(directory, state)
    return {"batch": plugin.fingerprint.batch, "shards": _local(model)}


def _own_rows_load_job(fabric: Any, plugin: StablePrecision, state: dict[str, Any], path: str) -> dict[str, Any]:
    """:func:`_load_job`, then the pinned pass recomputed by the plugin as a save computes it (every rank)."""
    report = _load_job(fabric, plugin, state, path)
    pinned = plugin.state_dict()[KEY]["pinned"]
    return {**report, "pinned": (pinned["loss"], pinned["grad_norm"]), "batch": pinned["batch"]}


def test_ranks_that_pinned_different_rows_save_and_load_the_pinned_pass_on_rank_zeros(tmp_path: Path) -> None:
    # Each rank pins its own first batch, as a data-parallel loop would. Before: the save's gradient norm covered
    # every rank's rows (each rank's backward on its own, the DTensor gradients' norm all-reduced) and the load
    # recomputed it with rank 0's rows on every rank (the checkpoint's batch): a good checkpoint refused. Now pin
    # takes rank 0's rows on every rank, so the save and the load run the same pass.
    path = tmp_path / "step=2"
    saved = _run(tmp_path / "save", _own_rows_save_job, directory=str(path), own_rows=True)
    assert "error" not in saved[0] and "error" not in saved[1], (saved[0].get("error"), saved[1].get("error"))
    pinned = torch.load(path / SHARDED_META, weights_only=False)["precision"][KEY]["pinned"]
    assert pinned["deterministic"] and pinned["grad_norm"] > 0
    ranks = _run(tmp_path / "load", _own_rows_load_job, path=str(path), seed=100, own_rows=True)
    for report in ranks:
        assert "error" not in report, report["error"]
        assert [e["action"] for e in report["events"]] == ["passed", "passed"]
        assert report["pinned"] == (pinned["loss"], pinned["grad_norm"])  # bitwise, as the load compares on the CPU
    rows = pin_batch(_batch(0, 0))  # rank 0's first rows, pinned on both ranks at the save and after the load
    for report in (*saved, *ranks):
        assert all(torch.equal(a, b) for a, b in zip(report["batch"], rows, strict=True))
    # The pinned check still bites: rank 1's fc2.weight shard scaled x1.5, its checksum rewritten to match.
    shard = saved[1]["shards"]["fc2.weight"]
    _replace(path, shard, shard * 1.5)
    meta = torch.load(path / SHARDED_META, weights_only=False)
    meta["precision"][KEY]["checksums"].update(checksums({"shards[rank 1 of 2]model": {"fc2.weight": shard * 1.5}}))
    torch.save(meta, path / SHARDED_META)
    ranks = _run(tmp_path / "tampered", _own_rows_load_job, path=str(path), seed=100, own_rows=True)
    for report in ranks:
        kind, message = report["error"]
        assert kind == FingerprintMismatch.__name__ and "checksum" not in message
        assert "the pinned micro-batch's loss is" in message and "the pinned micro-batch's grad norm is" in message
    assert ranks[0]["events"] == ranks[1]["events"]

"""lit_mpstable.frontends.fabric.StablePrecision in whole Fabric loops: exact resume through fabric.save/fabric.load
(a litgpt-style resume without the plugin's state warns), held LR schedulers, weights loaded after setup, a
litgpt-style loop (two optimizers, gradient accumulation) and 2-process DDP on gloo with an inf on one rank only."""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_helpers import MODE_IDS, WEIGHT_MODES, assert_same_state
from helpers import HostReads, TinyMLP, fabric_backward, quiet_fabric, regression_data
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision, Precision
from lightning.fabric.strategies import DDPStrategy

from lit_mpstable.core.fingerprint import FingerprintMismatch
from lit_mpstable.frontends.fabric import StablePrecision

INF = float("inf")
LR, GAMMA = 1e-2, 0.8


def fabric_of(plugin: Precision, **kwargs: Any) -> Fabric:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FP16 on the CPU, said once
        return Fabric(accelerator="cpu", devices=1, plugins=[plugin], **kwargs)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------ resume, schedulers
def resumable_run(
    precision: str, steps: range, *, poison: set[int], load: Path | None = None, save: Path | None = None,
    bind_before_load: bool = True, on_fingerprint_mismatch: str = "raise",
) -> dict[str, Any]:
    """AdamW + StepLR (held on skips) + clipping on TinyMLP; fc2's gradient gets an inf on the ``poison`` steps
    (global step numbers). A resumed run starts from other weights: the checkpoint must bring everything back."""
    plugin = StablePrecision(precision, on_fingerprint_mismatch=on_fingerprint_mismatch)  # type: ignore[arg-type]
    fabric = fabric_of(plugin)
    torch.manual_seed(0 if load is None else 123)
    model = TinyMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA)
    model, opt = fabric.setup(model, opt)
    if bind_before_load:
        plugin.setup_optimizers(opt)  # the documented exact-resume path
    plugin.hold_schedulers(sched)
    state = {"model": model, "optimizer": opt, "precision": plugin, "scheduler": sched}
    if load is not None:
        fabric.load(load, state, weights_only=True)
    x, y = regression_data(64)
    out: dict[str, Any] = {"lrs": [], "scales": [], "skipped": []}
    for step in steps:
        batch = slice(16 * (step % 4), 16 * (step % 4 + 1))
        opt.zero_grad()
        fabric.backward(F.mse_loss(model(x[batch]), y[batch]))
        if step in poison:
            model.fc2.weight.grad.view(-1)[0] = INF
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        sched.step()
        out["lrs"].append(opt.param_groups[0]["lr"])
        out["scales"].append(plugin.loss_scale)
        out["skipped"].append(plugin.last_step_skipped)
    if save is not None:
        fabric.save(save, state)
    out.update(params=snapshot(model), plugin=plugin.state_dict(), optimizer=opt.state_dict())
    return out


@pytest.mark.parametrize("precision", ["bf16-true", "16-mixed", "16-true"])
def test_save_and_load_resume_bit_exactly_with_an_overflow_after_the_resume(precision: str, tmp_path: Path) -> None:
    whole = resumable_run(precision, range(6), poison={1, 4})
    first = resumable_run(precision, range(3), poison={1, 4}, save=tmp_path / "ckpt.pt")
    resumed = resumable_run(precision, range(3, 6), poison={1, 4}, load=tmp_path / "ckpt.pt")
    assert whole["skipped"] == [False, True, False, False, True, False]
    assert first["skipped"] + resumed["skipped"] == whole["skipped"]
    assert first["scales"] + resumed["scales"] == whole["scales"]
    # The schedule holds on the skipped steps 1 and 4 (hand-computed), across the resume too.
    assert first["lrs"] + resumed["lrs"] == pytest.approx([LR * GAMMA**k for k in (1, 1, 2, 3, 3, 4)], rel=1e-12)
    for name, value in whole["params"].items():
        assert torch.equal(resumed["params"][name], value), name
    masters = whole["plugin"]["masters"]
    assert bool(masters) == precision.endswith("true")
    assert all(torch.equal(resumed["plugin"]["masters"][name], m) for name, m in masters.items())
    assert {k: v for k, v in resumed["plugin"].items() if k != "masters"} == {
        k: v for k, v in whole["plugin"].items() if k != "masters"}
    for index, state in whole["optimizer"]["state"].items():
        assert state["exp_avg"].dtype == torch.float32
        for key, value in state.items():
            assert torch.equal(resumed["optimizer"]["state"][index][key], value), (index, key)


def test_loading_optimizer_state_before_the_masters_are_bound_warns_and_is_inexact(tmp_path: Path) -> None:
    whole = resumable_run("bf16-true", range(4), poison=set())
    resumable_run("bf16-true", range(2), poison=set(), save=tmp_path / "ckpt.pt")
    # The checkpoint's numeric fingerprint sees the rounding at the first step and refuses it by default.
    with pytest.warns(UserWarning, match="setup_optimizers"), pytest.raises(ValueError, match="through BF16"):
        resumable_run("bf16-true", range(2, 4), poison=set(), load=tmp_path / "ckpt.pt", bind_before_load=False)
    with pytest.warns(UserWarning, match="setup_optimizers"):
        lazy = resumable_run("bf16-true", range(2, 4), poison=set(), load=tmp_path / "ckpt.pt",
                             bind_before_load=False, on_fingerprint_mismatch="warn")
    # Adam's second moments were rounded to BF16 on the way in: the masters drift off the uninterrupted run.
    assert not torch.equal(lazy["plugin"]["masters"]["fc1.weight"], whole["plugin"]["masters"]["fc1.weight"])


def fallback_run(master_weights: Any, modules: list[str] | None, steps: range, *, order: str = "",
                 load: Path | None = None, save: Path | None = None, bind: bool = True) -> torch.nn.Module:
    """bf16-true AdamW on TinyMLP with a fallback after step 1 (global step numbers); ``order``: the parts
    ``fabric.load`` restores, in that order. A resumed run starts from other weights."""
    plugin = StablePrecision("bf16-true", master_weights=master_weights)
    fabric = fabric_of(plugin)
    torch.manual_seed(0 if load is None else 1)
    model = TinyMLP()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    if bind:
        plugin.setup_optimizers(opt)
    parts = {"model": model, "optimizer": opt, "precision": plugin}
    if load is not None:
        fabric.load(load, {name: parts[name] for name in order.split(",")}, weights_only=True)
    x, y = regression_data(16)
    for step in steps:
        opt.zero_grad()
        fabric.backward(F.mse_loss(model(x), y))
        opt.step()
        if step == 1:
            plugin.fallback(modules, reason="test")
    if save is not None:
        fabric.save(save, parts)
    return model


@pytest.mark.parametrize("bind", [True, False])  # optimizers bound before fabric.load, or at their first step
@pytest.mark.parametrize("order", ["model,optimizer,precision", "optimizer,precision,model"])
@pytest.mark.parametrize(("master_weights", "modules"), [(False, ["fc2"]), ("stochastic", None)])
def test_a_fallback_active_at_the_save_resumes_exactly_whatever_the_load_order(
    master_weights: Any, modules: list[str] | None, order: str, bind: bool, tmp_path: Path,
) -> None:
    # The fallback holds parameters in FP32; loaded before the plugin, the model's weights and AdamW's moments land in
    # the fresh run's BF16 parameters (rounded). The plugin's state carries their FP32 values. Before it did, these
    # resumed 7e-5..5e-3 off the uninterrupted run, and with bind=False the first step raised (BF16 moments).
    whole = fallback_run(master_weights, modules, range(6))
    fallback_run(master_weights, modules, range(4), save=tmp_path / "ckpt.pt")
    resumed = fallback_run(master_weights, modules, range(4, 6), order=order, load=tmp_path / "ckpt.pt", bind=bind)
    for (name, a), b in zip(whole.named_parameters(), resumed.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: max |diff| {(a.float() - b.float()).abs().max():.3g}"


@pytest.mark.parametrize("bind_early", [False, True])
def test_weights_loaded_after_setup_are_where_the_masters_start(bind_early: bool) -> None:
    plugin = StablePrecision("bf16-true")
    fabric = fabric_of(plugin)
    torch.manual_seed(0)
    model = TinyMLP()
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
    if bind_early:
        plugin.setup_optimizers(opt)
    torch.manual_seed(1)
    pretrained = TinyMLP().to(torch.bfloat16).state_dict()
    model.load_state_dict(pretrained)  # as litgpt loads a checkpoint after fabric.setup
    x, y = regression_data(16)
    fabric.backward(F.mse_loss(model(x), y))
    opt.step()  # lr=0: the step must leave the loaded weights as they are, not restore the initial ones
    for name, value in pretrained.items():
        assert torch.equal(model.state_dict()[name], value), name
        assert torch.equal(plugin.state_dict()["masters"][name], value.float()), name


def test_held_schedulers_and_the_last_step_skipped_alternative_hold_on_skipped_steps() -> None:
    def run(hold: bool) -> list[float]:
        plugin = StablePrecision("bf16-mixed")
        fabric = fabric_of(plugin)
        torch.manual_seed(0)
        model = TinyMLP()
        model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA)
        if hold:
            plugin.hold_schedulers(sched)  # before the first step: held from the optimizer's setup on
        x, y = regression_data(16)
        lrs = []
        for step in range(5):
            opt.zero_grad()
            fabric.backward(F.mse_loss(model(x), y))
            if step in (1, 3):
                model.fc2.weight.grad.view(-1)[0] = INF
            opt.step()
            if hold or not plugin.last_step_skipped:
                sched.step()
            lrs.append(opt.param_groups[0]["lr"])
        return lrs

    expected = pytest.approx([LR * GAMMA**k for k in (1, 1, 2, 2, 3)], rel=1e-12)
    assert run(hold=True) == expected and run(hold=False) == expected


# --------------------------------------------------------------------------------------- litgpt-style loop
def litgpt_loop(
    fabric: Fabric, steps: int = 3, *, accumulate: int = 2, poison: Iterable[int] = (), poison_rank: int = 0,
    skip_second: Iterable[int] = (),
) -> dict[str, Any]:
    """Two optimizers (SGD with momentum on fc1, AdamW on fc2/fc3), ``accumulate`` micro-batches per step under
    ``fabric.no_backward_sync``, clipping per optimizer. fc2's gradient gets an inf on ``poison_rank`` at the
    ``poison`` steps, after the last micro-batch's backward (after DDP's all-reduce); the loop leaves the second
    optimizer's step out by hand on ``skip_second`` (a reference)."""
    torch.manual_seed(0)
    model = TinyMLP()
    first = torch.optim.SGD(model.fc1.parameters(), lr=0.05, momentum=0.9)
    second = torch.optim.AdamW([*model.fc2.parameters(), *model.fc3.parameters()], lr=LR)
    model, first, second = fabric.setup(model, first, second)
    x, y = regression_data(64)
    x, y = x[fabric.global_rank :: fabric.world_size], y[fabric.global_rank :: fabric.world_size]
    plugin = fabric.strategy.precision
    skipped = []
    for step in range(steps):
        for micro in range(accumulate):
            start = 4 * (step * accumulate + micro) % len(x)
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                loss = F.mse_loss(model(x[start : start + 4]), y[start : start + 4]) / accumulate
                fabric.backward(loss)
        if step in poison and fabric.global_rank == poison_rank:
            model.fc2.weight.grad.view(-1)[0] = INF
        for opt in (first, second):
            if opt is second and step in skip_second:
                opt.zero_grad()
                continue
            fabric.clip_gradients(model, opt, max_norm=1.0)
            opt.step()
            skipped.append(getattr(plugin, "last_step_skipped", False))
            opt.zero_grad()
    scaler = getattr(plugin, "scaler", None)
    return {"params": snapshot(model), "skipped": skipped, "world_size": fabric.world_size,
            "scale": float(scaler.get_scale()) if scaler is not None else 1.0,
            "counters": (getattr(plugin, "step_count", 0), getattr(plugin, "overflow_count", 0))}


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_litgpt_style_loop_matches_fabrics_own_and_skips_per_optimizer(precision: str) -> None:
    ours = litgpt_loop(fabric_of(plugin := StablePrecision(precision)), poison={1})
    assert ours["skipped"] == [False, False, False, True, False, False]  # the inf is in fc2: the second optimizer's
    assert plugin.step_count == 6 and plugin.overflow_count == 1
    if precision == "bf16-mixed":
        theirs = litgpt_loop(fabric_of(MixedPrecision("bf16-mixed", "cpu")), poison={1}, skip_second={1})
        for name, value in theirs["params"].items():
            assert torch.equal(ours["params"][name], value), name
    assert all(torch.isfinite(v).all() for v in ours["params"].values())


# ------------------------------------------------------------------------------------------- 2-process DDP
def _ddp_worker(fabric: Fabric, out_dir: str) -> None:
    torch.set_num_threads(1)
    result = litgpt_loop(fabric, poison={1}, poison_rank=1)
    torch.save(result, Path(out_dir) / f"rank{fabric.global_rank}.pt")


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-true"])
def test_ddp_an_inf_on_one_rank_makes_both_ranks_skip(precision: str, tmp_path: Path) -> None:
    strategy = DDPStrategy(start_method="fork", timeout=timedelta(seconds=60))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[StablePrecision(precision)])
    fabric.launch(_ddp_worker, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    for rank in ranks:  # rank 0 never saw the inf: it skips because rank 1 did
        assert rank["skipped"] == [False, False, False, True, False, False]
        assert rank["counters"] == (6, 1)
    assert ranks[0]["scale"] == ranks[1]["scale"] == (2.0**15 if precision == "16-mixed" else 1.0)
    for name, value in ranks[0]["params"].items():
        assert torch.equal(ranks[1]["params"][name], value), name


def _unseeded_worker(fabric: Fabric, out_dir: str, adam: bool) -> None:
    # Each rank builds its model from its own seed (no seed_everything) and trains on its own half of the data.
    torch.set_num_threads(1)
    torch.manual_seed(100 + fabric.global_rank)
    model = TinyMLP()
    opt = (torch.optim.AdamW(model.parameters(), lr=LR) if adam
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    model, opt = fabric.setup(model, opt)
    x, y = regression_data(32)
    x, y = x[fabric.global_rank :: fabric.world_size], y[fabric.global_rank :: fabric.world_size]
    for step in range(3):
        rows = slice(4 * step, 4 * step + 4)
        opt.zero_grad()
        fabric.backward(F.mse_loss(model(x[rows]), y[rows]))
        opt.step()
    plugin = fabric.strategy.precision
    torch.save({"params": snapshot(model), "keeper": plugin.stepper.keeper.state_dict(), "world_size":
                fabric.world_size, "counters": (plugin.step_count, plugin.skipped_steps)},
               Path(out_dir) / f"rank{fabric.global_rank}.pt")


@pytest.mark.parametrize(("master_weights", "optimizer_state", "adam"), WEIGHT_MODES, ids=MODE_IDS)
def test_ddp_replicas_initialised_and_seeded_apart_train_alike(tmp_path: Path, master_weights, optimizer_state,
                                                                adam: bool) -> None:
    # The Fabric side of test_distributed's test of the same name: the masters, compensation and rounding seeds are
    # rank 0's, as the weights DDP broadcast at fabric.setup are.
    plugin = StablePrecision("bf16-true", master_weights=master_weights, optimizer_state=optimizer_state)
    strategy = DDPStrategy(start_method="fork", timeout=timedelta(seconds=60))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
    fabric.launch(_unseeded_worker, str(tmp_path), adam)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert rank0["world_size"] == 2 and rank0["counters"] == rank1["counters"] == (3, 0)
    for name, value in rank0["params"].items():
        assert torch.equal(rank1["params"][name], value), name
    assert_same_state(rank0["keeper"], rank1["keeper"], "keeper")
    assert (rank0["keeper"] != {}) == (master_weights is not False)


# ------------------------------------------------------------------------------------ the probe
@pytest.mark.parametrize("recompute", [False, True])
def test_the_probe_measures_a_fabric_loop_through_its_stepper(recompute: bool) -> None:
    # lit_mpstable.core.step.probe.measure on the Fabric plugin's stepper: FP16 without scaling at a loss weight of
    # 2**-14 flushes part of the gradients; its reading equals a hand count against an FP32 copy, and training is left
    # as it was.

    plugin = StablePrecision("16-mixed", scaler=None)
    fabric = fabric_of(plugin)
    torch.manual_seed(0)
    raw = TinyMLP()
    model, optimizer = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=LR))
    batch = regression_data(16)

    def loss_fn(module: torch.nn.Module, b) -> torch.Tensor:
        return F.mse_loss(module(b[0]).float(), b[1]) * 2.0**-14

    start = plugin.stepper.forward_state()
    fabric.backward(loss_fn(model, batch))
    run = {n: p.grad.clone() for n, p in raw.named_parameters()}
    reference = TinyMLP()
    reference.load_state_dict(raw.state_dict())
    names, params = zip(*reference.float().named_parameters())
    expected = dict(zip(names, torch.autograd.grad(loss_fn(reference, batch), params)))
    result = plugin.stepper.measure(raw, loss_fn, batch, start=start, recompute=recompute, step=0)
    g = torch.cat([run[n].double().flatten() for n in names])
    r = torch.cat([expected[n].double().flatten() for n in names])
    assert result["underflow_frac"] == pytest.approx(((g == 0) & (r != 0)).sum().item() / (r != 0).sum().item())
    assert 0.05 < result["underflow_frac"] < 1.0 and result["recomputed"] is recompute
    assert all(torch.equal(p.grad, run[n]) for n, p in raw.named_parameters())  # the run's gradients untouched
    optimizer.step()


# ------------------------------------------------------------------------------------------- host syncs
@pytest.mark.parametrize(
    ("precision", "masters"),
    [("bf16-mixed", None), ("16-mixed", None), ("bf16-true", None), ("bf16-true", "kahan"),
     ("bf16-true", "stochastic"), ("16-true", None)],
)
def test_a_clean_step_reads_the_device_once_the_skip_decision(precision: str, masters: str | None) -> None:
    # Every operation that needs a tensor's value on the host (item, if tensor:, tolist, masked indexing...), from
    # forward to optimizer.step, on the steps that are neither the first (telemetry is due), an overflow (its blame)
    # nor the one after it (the attribution traces it). SGD: torch's Adam reads its CPU step counters, which on an
    # accelerator are no sync.
    plugin = StablePrecision(precision, **({"master_weights": masters} if masters else {}))
    fabric = fabric_of(plugin)
    torch.manual_seed(0)
    model = TinyMLP()
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    x, y = regression_data(64)
    reads = []
    for step in range(8):
        batch = slice(16 * (step % 4), 16 * (step % 4 + 1))
        opt.zero_grad()
        with HostReads() as step_reads:
            fabric.backward(F.mse_loss(model(x[batch]).float(), y[batch]))
            if step == 5:
                model.module.fc2.weight.grad.view(-1)[0] = INF
            opt.step()
        reads.append(step_reads.ops)
    assert plugin.stepper.skipped_steps == 1
    assert [reads[step] for step in (1, 2, 3, 4, 7)] == [["_local_scalar_dense"]] * 5, reads


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_a_skipped_step_leaves_batchnorm_as_the_step_before_left_it(precision: str) -> None:
    fabric = fabric_of(StablePrecision(precision))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 16))
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = regression_data(32)
    for step in range(3):
        batch = x[16 * (step % 2):][:16].clone()
        if step == 1:
            batch[0, 0] = float("nan")
        before = snapshot(model)
        loss = F.mse_loss(model(batch).float(), y[:16])
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        if step == 1:
            for name, value in snapshot(model).items():
                assert torch.equal(value, before[name]), name
    bn = model.module[1]
    assert int(bn.num_batches_tracked) == 2 and torch.isfinite(bn.running_var).all()


# --------------------------------------------------------- a litgpt-style resume without the plugin's state warns
def _resumable(mode: bool | str, steps: range, *, load: Path | None = None, save: Path | None = None,
               with_plugin: bool = False, optimizer_state: str = "fp32", order: str = "setup, load") -> dict:
    """AdamW on TinyMLP in bf16-true; the saved state is litgpt's ({"model", "optimizer"}) unless ``with_plugin``;
    ``order``: plugin.setup_optimizers before fabric.load (the documented order) or after it."""
    plugin = StablePrecision("bf16-true", master_weights=mode, optimizer_state=optimizer_state)
    fabric = quiet_fabric(plugin)
    torch.manual_seed(0 if load is None else 123)
    model = TinyMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    if order == "setup, load":
        plugin.setup_optimizers(opt)
    state = {"model": model, "optimizer": opt, **({"precision": plugin} if with_plugin else {})}
    if load is not None:
        fabric.load(load, state)
    if order == "load, setup":
        plugin.setup_optimizers(opt)
    for step in steps:
        opt.zero_grad()
        fabric_backward(fabric, model, step)
        opt.step()
    if save is not None:
        fabric.save(save, state)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("mode", [True, "kahan", "stochastic"])
def test_resuming_without_the_plugins_state_warns_and_with_it_is_exact(mode: bool | str, tmp_path: Path) -> None:
    # litgpt saves {"model", "optimizer"} only: kahan/stochastic (and FP32 masters) then resumed inexactly, silently.
    whole = _resumable(mode, range(4))
    _resumable(mode, range(2), save=tmp_path / "litgpt.pt")
    with pytest.warns(UserWarning, match=r"plugin's own state was not loaded.*'precision': plugin"):
        inexact = _resumable(mode, range(2, 4), load=tmp_path / "litgpt.pt")
    assert not all(torch.equal(inexact[k], v) for k, v in whole.items())  # what the warning says
    _resumable(mode, range(2), save=tmp_path / "ours.pt", with_plugin=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*plugin's own state")
        exact = _resumable(mode, range(2, 4), load=tmp_path / "ours.pt", with_plugin=True)
    assert all(torch.equal(exact[k], v) for k, v in whole.items())


@pytest.mark.parametrize("mode, kind, order", [(True, "bf16", "setup, load"), ("kahan", "fp8", "setup, load"),
                                               (True, "fp8", "load, setup")])
def test_resuming_moments_without_the_plugins_state_warns(mode: bool | str, kind: str, order: str,
                                                          tmp_path: Path) -> None:
    # BF16/FP8 moments live in the plugin's state, not the optimizer's: a litgpt-style resume restarted them at 0
    # without the warning FP32 masters get (the optimizer comes back with no state to notice).
    _resumable(mode, range(2), save=tmp_path / "litgpt.pt", optimizer_state=kind)
    with pytest.warns(UserWarning, match=r"plugin's own state was not loaded.*Adam moments.*restart at 0"):
        _resumable(mode, range(2, 4), load=tmp_path / "litgpt.pt", optimizer_state=kind, order=order)
    _resumable(mode, range(2), save=tmp_path / "ours.pt", with_plugin=True, optimizer_state=kind)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*plugin's own state")
        _resumable(mode, range(2, 4), load=tmp_path / "ours.pt", with_plugin=True, optimizer_state=kind, order=order)
        _resumable(mode, range(2), optimizer_state=kind)  # a fresh run: nothing was lost


# ------------------------------------------------------------------------------- the restored-state rung
LOADED = 4  # the checkpoint of step 4 is written wrong; steps 1-3 are good


def _wrong_lr_run(directory: Path, seed: int, *, wrong: Iterable[int] = (LOADED,), precision: str = "32-true",
                  ) -> list[Path]:
    """Checkpoints of steps 1..LOADED of a seeded Fabric loop (AdamW on TinyMLP), each saved with ``fabric.save``;
    those of the ``wrong`` steps with the learning rate written x1e7 (the run goes on with the right one): every number
    of such a file is finite and its fingerprint matches what was written, yet the third step after loading it is
    non-finite (Megatron-LM#5281's shape, built as tests/adapter/test_cb_rollback.py builds it for the Trainer)."""
    directory.mkdir(parents=True, exist_ok=True)
    plugin = StablePrecision(precision)
    fabric = quiet_fabric(plugin)
    torch.manual_seed(seed)
    model = TinyMLP()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    plugin.setup_optimizers(opt)
    state = {"model": model, "optimizer": opt, "precision": plugin, "step": 0}
    x, y = regression_data(64)
    paths = []
    while state["step"] < LOADED:
        batch = slice(16 * (state["step"] % 4), 16 * (state["step"] % 4 + 1))
        state["step"] += 1  # counted before the step, as litgpt counts iter_num
        fabric.backward(F.mse_loss(model(x[batch]).float(), y[batch]))
        opt.step()
        opt.zero_grad()
        right = opt.param_groups[0]["lr"]
        opt.param_groups[0]["lr"] = right * (1e7 if state["step"] in set(wrong) else 1.0)
        paths.append(directory / f"step={state['step']}.pt")
        fabric.save(paths[-1], state)
        opt.param_groups[0]["lr"] = right
        os.utime(paths[-1], ns=(10**9 * state["step"],) * 2)  # written in order, seconds apart
    return paths


def _resume_with_rung(path: Path, seed: int, *, steps: int = LOADED + 6, precision: str = "32-true",
                      **load: Any) -> tuple[StablePrecision, dict[str, Any], list[tuple[int, float]]]:
    """A fresh loop resumed from ``path`` by ``plugin.load(fabric, path, state, restored_window=5)``, trained to
    ``steps`` with its position in ``state["step"]``; the rows are ``(step before the step, loss)``."""
    plugin = StablePrecision(precision)
    fabric = quiet_fabric(plugin)
    torch.manual_seed(seed + 100)  # other weights: the checkpoint must bring everything back
    model = TinyMLP()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    plugin.setup_optimizers(opt)
    state = {"model": model, "optimizer": opt, "precision": plugin, "step": 0}
    plugin.load(fabric, path, state, **{"restored_window": 5, **load})
    x, y = regression_data(64)
    rows = []
    while state["step"] < steps:
        batch = slice(16 * (state["step"] % 4), 16 * (state["step"] % 4 + 1))
        rows.append((state["step"], 0.0))
        state["step"] += 1
        loss = F.mse_loss(model(x[batch]).float(), y[batch])
        fabric.backward(loss)
        opt.step()  # a bad step soon after the load loads the checkpoint before into `state`, in process
        opt.zero_grad()
        rows[-1] = (rows[-1][0], loss.item())
    return plugin, state, rows


@pytest.mark.parametrize("seed", range(5))
def test_a_checkpoint_that_goes_nan_three_steps_after_fabric_load_restores_the_one_before(seed: int,
                                                                                          tmp_path: Path) -> None:
    # Before: Fabric had no restored-state rung (the plugin never saw the path): the run skipped the NaN step and
    # trained on from the state written wrong.
    paths = _wrong_lr_run(tmp_path, seed)
    with pytest.warns(UserWarning, match=rf"loaded {re.escape(str(paths[-2]))} instead \(step 3; attempt 1 of"
                                         r" max_restores=3\)"):
        plugin, state, rows = _resume_with_rung(paths[-1], seed)
    assert [step for step, loss in rows if not math.isfinite(loss)] == [LOADED + 2]  # the third step after the load
    (event,) = [e for e in plugin.ladder_events if e["action"] != "skip"]
    assert (event["step"], event["fault"], event["rung"], event["action"]) == (
        LOADED + 2, "restored", "restore", "restore_previous")
    assert (event["checkpoint"], event["failed"], event["restored_step"]) == (str(paths[-2]), str(paths[-1]),
                                                                              LOADED - 1)
    # It went on from the earlier file's step (its `state["step"]` loaded with it) to the end, every loss finite.
    assert [step for step, _ in rows] == [4, 5, 6, 3, 4, 5, 6, 7, 8, 9] and state["step"] == LOADED + 6
    assert all(math.isfinite(loss) for _, loss in rows[3:]) and rows[-1][1] < rows[3][1] * 1.5
    optimizer = state["optimizer"]
    assert optimizer.param_groups[0]["lr"] == 1e-2  # the earlier file's learning rate, not the one written wrong
    assert int(optimizer.state[next(iter(optimizer.state))]["step"]) == LOADED + 6 == plugin.step_count
    assert all(torch.isfinite(p).all() for p in state["model"].parameters())
    assert [e["action"] for e in plugin.fingerprint.events] == ["passed"] * 4  # each file's plugin state and numbers


def test_a_fabric_restore_keeps_the_masters_equal_to_the_weights(tmp_path: Path) -> None:
    paths = _wrong_lr_run(tmp_path, 0, precision="bf16-true")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*the restored state is suspect")
        plugin, state, rows = _resume_with_rung(paths[-1], 0, precision="bf16-true")
    assert [e["checkpoint"] for e in plugin.ladder_events if e["action"] == "restore_previous"] == [str(paths[-2])]
    assert state["step"] == LOADED + 6 and all(math.isfinite(loss) for _, loss in rows[3:])
    masters = plugin.state_dict()["masters"]
    for name, param in state["model"].module.named_parameters():
        assert param.dtype == torch.bfloat16 and torch.equal(masters[name].bfloat16(), param.detach()), name


def test_fabric_restores_are_capped_then_the_step_raises_naming_why(tmp_path: Path) -> None:
    # Every earlier file is written wrong too: one attempt is allowed, the second bad step raises, no loop.
    paths = _wrong_lr_run(tmp_path, 0, wrong=range(1, LOADED + 1))
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match=r"1 restores done \(max_restores=1\); the"
                                                  rf" last state loaded, from {re.escape(str(paths[-2]))}, went bad"):
        warnings.filterwarnings("ignore", message=r".*the restored state is suspect")
        _resume_with_rung(paths[-1], 0, steps=20, max_restores=1)


def test_with_no_earlier_fabric_checkpoint_that_passes_the_step_raises_naming_why(tmp_path: Path) -> None:
    paths = _wrong_lr_run(tmp_path, 0)
    for index, path in enumerate(paths[:-1]):  # the earlier files hold the weights only (as old as they were)
        saved = torch.load(path, weights_only=True)
        torch.save({"model": saved["model"]}, path)
        os.utime(path, ns=(10**9 * (index + 1),) * 2)
    paths[1].write_bytes(paths[0].read_bytes()[:100])  # and one is cut short
    os.utime(paths[1], ns=(2 * 10**9,) * 2)
    with pytest.raises(RuntimeError, match=r"no earlier checkpoint passes among 3 in .*holds no optimizer, precision,"
                                           r" step \(a weights-only checkpoint\)"):
        _resume_with_rung(paths[-1], 0)


def test_fabric_load_refuses_bad_arguments_naming_them(tmp_path: Path) -> None:
    path = _wrong_lr_run(tmp_path, 0)[0]
    plugin = StablePrecision("32-true")
    fabric = quiet_fabric(plugin)
    model, opt = fabric.setup(TinyMLP(), torch.optim.AdamW(TinyMLP().parameters()))
    state = {"model": model, "optimizer": opt, "precision": plugin, "step": 0}
    other = quiet_fabric(StablePrecision("32-true"))
    for kwargs, match in [
        (dict(fabric=object()), r"load\(fabric=<object.*\): must be the lightning.fabric.Fabric whose precision"),
        (dict(fabric=other), r"load\(fabric=.*must be the lightning.fabric.Fabric whose precision plugin this is"),
        (dict(state={"model": model, "optimizer": opt}),
         r"load\(state=a dict with keys \['model', 'optimizer'\]\): must be a dict holding this plugin"),
        (dict(path=tmp_path), r"load\(path=.*\): must be the path of a checkpoint file"),
        (dict(restored_window=-1), r"load\(restored_window=-1\): must be an int >= 0 \(optimizer steps after"),
        (dict(restored_window=True), r"load\(restored_window=True\): must be an int >= 0"),
        (dict(max_restores="3"), r"load\(max_restores='3'\): must be an int >= 0 \(checkpoints tried"),
    ]:
        given = {"fabric": fabric, "path": path, "state": state, **kwargs}
        with pytest.raises(ValueError, match=match):
            plugin.load(given.pop("fabric"), given.pop("path"), given.pop("state"), **given)


def _restore_worker(fabric: Fabric, path: str, out_dir: str) -> None:
    # Each rank trains on its half of the batch; the state written wrong makes both ranks' third step non-finite.
    torch.set_num_threads(1)
    plugin = fabric.strategy.precision
    torch.manual_seed(100)
    model = TinyMLP()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    plugin.setup_optimizers(opt)
    state = {"model": model, "optimizer": opt, "precision": plugin, "step": 0}
    plugin.load(fabric, path, state, restored_window=5)
    x, y = regression_data(64)
    rows = []
    while state["step"] < LOADED + 6:
        batch = slice(16 * (state["step"] % 4) + fabric.global_rank, 16 * (state["step"] % 4 + 1), 2)
        rows.append(state["step"])
        state["step"] += 1
        fabric.backward(F.mse_loss(model(x[batch]).float(), y[batch]))
        opt.step()
        opt.zero_grad()
    torch.save({"rows": rows, "events": [dict(e) for e in plugin.ladder_events], "params": snapshot(model.module),
                "counters": (plugin.step_count, plugin.skipped_steps)}, Path(out_dir) / f"rank{fabric.global_rank}.pt")


@pytest.mark.slow
def test_ddp_both_ranks_restore_the_same_earlier_fabric_checkpoint(tmp_path: Path) -> None:
    paths = _wrong_lr_run(tmp_path / "ckpt", 0)
    strategy = DDPStrategy(start_method="fork", timeout=timedelta(seconds=60))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[StablePrecision("32-true")])
        fabric.launch(_restore_worker, str(paths[-1]), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank in ranks:
        restores = [e for e in rank["events"] if e["action"] == "restore_previous"]
        assert [(e["step"], e["checkpoint"], e["restored_step"]) for e in restores] == [
            (LOADED + 2, str(paths[-2]), LOADED - 1)]
        assert rank["rows"] == [4, 5, 6, 3, 4, 5, 6, 7, 8, 9]
        assert all(torch.isfinite(v).all() for v in rank["params"].values())
    assert ranks[0]["events"] == ranks[1]["events"] and ranks[0]["counters"] == ranks[1]["counters"]
    for name, value in ranks[0]["params"].items():
        assert torch.equal(ranks[1]["params"][name], value), name


def _loaded_state(**plugin: Any) -> tuple[StablePrecision, Fabric, dict[str, Any]]:
    stable = StablePrecision("32-true", **plugin)
    fabric = quiet_fabric(stable)
    torch.manual_seed(100)
    model = TinyMLP()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    stable.setup_optimizers(opt)
    return stable, fabric, {"model": model, "optimizer": opt, "precision": stable, "step": 0}


def _rewrite(path: Path, change: Any) -> None:
    written, saved = path.stat().st_mtime_ns, torch.load(path, weights_only=True)
    change(saved)
    torch.save(saved, path)
    os.utime(path, ns=(written, written))  # as old as it was


def test_previous_through_plugin_load_resumes_from_the_newest_earlier_file_that_passes(tmp_path: Path) -> None:
    # Before: with Fabric "previous" raised as "raise" did (the plugin did not know the file's directory).
    paths = _wrong_lr_run(tmp_path, 0, wrong=())
    _rewrite(paths[-1], lambda c: c["optimizer"]["state"][0]["exp_avg_sq"].view(-1)[5].mul_(1.5))
    _rewrite(paths[-2], lambda c: c["model"]["fc1.weight"][3].mul_(2))
    plugin, fabric, state = _loaded_state(on_fingerprint_mismatch="previous")
    with pytest.warns(UserWarning, match=rf"{re.escape(str(paths[-1]))} fails its numeric fingerprint \(checksum of"
                                         rf" optimizer state .*exp_avg_sq.*\); loaded {re.escape(str(paths[-3]))}"
                                         rf" instead; {re.escape(str(paths[-2]))} failed too \(checksum of weight"):
        plugin.load(fabric, paths[-1], state, restored_window=0)
    assert state["step"] == 2 and plugin.step_count == 2  # the third file's
    assert [e["action"] for e in plugin.fingerprint.events] == ["passed", "previous", "passed", "passed"]
    assert plugin.fingerprint.events[1]["fallback"] == str(paths[-3])
    expected = torch.load(paths[-3], weights_only=True)["model"]
    assert all(torch.equal(state["model"].module.state_dict()[k], v) for k, v in expected.items())


def test_plugin_load_checks_the_whole_fingerprint_before_it_returns(tmp_path: Path) -> None:
    # With plugin.load the model's and optimizers' numbers are compared as it returns (fabric.load: at the first
    # forward); "raise" refuses there, and "previous" without a passing earlier file says how many were tried.
    paths = _wrong_lr_run(tmp_path, 0, wrong=())
    for path in paths:
        _rewrite(path, lambda c: c["model"]["fc1.weight"][3].mul_(2))
    plugin, fabric, state = _loaded_state()
    with pytest.raises(FingerprintMismatch, match=r"checksum of weight `model\[.fc1.weight.\]` differs"):
        plugin.load(fabric, paths[-1], state)
    plugin, fabric, state = _loaded_state(on_fingerprint_mismatch="previous")
    with pytest.raises(FingerprintMismatch, match=r"fc1.weight.*; on_fingerprint_mismatch='previous': no earlier"
                                                  r" checkpoint passes among 3 in"):
        plugin.load(fabric, paths[-1], state)


@pytest.mark.parametrize("weights", [dict(), dict(optimizer_state="bf16"), dict(master_weights="kahan")])
def test_optimizer_zero_grad_drops_the_model_gradients_a_discarded_backward_left(weights: dict) -> None:
    """With FP32 masters the optimizer steps the masters, yet Fabric's ``optimizer.zero_grad()`` (its optimizer set up
    with ``plugin.setup_optimizers``) clears the model's 16-bit gradients too: 'backward, zero_grad, backward, step'
    equals 'backward, step', as with Lightning's own bf16-true."""
    results = []
    for discard in (False, True):
        torch.manual_seed(0)
        plugin = StablePrecision("bf16-true", **weights)
        fabric = fabric_of(plugin)
        net = TinyMLP()
        model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=LR))
        plugin.setup_optimizers(optimizer)
        for step in range(3):
            if discard and step:
                fabric_backward(fabric, model, step, scale=3.0)
                optimizer.zero_grad()
            fabric_backward(fabric, model, step)
            optimizer.step()
            optimizer.zero_grad()
        results.append(torch.cat([p.detach().float().flatten() for p in model.parameters()]))
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("recipe, lost", [("delayed", "amax histories"),
                                          ("nvfp4", "stochastic-rounding step counters")])
def test_resuming_fp8_without_the_plugins_state_warns_naming_the_fp8_state(recipe: str, lost: str,
                                                                           tmp_path: Path) -> None:
    # bf16-mixed holds no masters and Adam keeps its moments: only the FP8 layers' own state (delayed scaling's amax
    # histories, NVFP4's rounding counters) was lost by a litgpt-style resume, and nothing said so.
    from lit_mpstable.fp8 import FP8Config

    def run(load: Path | None = None, save: Path | None = None) -> None:
        plugin = StablePrecision("bf16-mixed", fp8=FP8Config(recipe=recipe))
        fabric = quiet_fabric(plugin)
        torch.manual_seed(0)
        model = fabric.setup(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                                 torch.nn.ReLU(), torch.nn.Linear(32, 1)))
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        plugin.setup_optimizers(opt)
        state = {"model": model, "optimizer": opt}
        if load is not None:
            fabric.load(load, state)
        for _ in range(2):
            opt.zero_grad()
            fabric.backward(F.mse_loss(model(torch.randn(32, 32)).float(), torch.randn(32, 1)))
            opt.step()
        if save is not None:
            fabric.save(save, state)

    run(save=tmp_path / "litgpt.pt")
    with pytest.warns(UserWarning, match=rf"plugin's own state was not loaded.*{lost}.*'precision': plugin"):
        run(load=tmp_path / "litgpt.pt")

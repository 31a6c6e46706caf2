"""lit_mpstable.frontends.fabric.StablePrecision in whole Fabric loops: exact resume through fabric.save/fabric.load
(a litgpt-style resume without the plugin's state warns), held LR schedulers, weights loaded after setup, a
litgpt-style loop (two optimizers, gradient accumulation) and 2-process DDP on gloo with an inf on one rank only."""

from __future__ import annotations

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

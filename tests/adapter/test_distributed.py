"""Distributed runs decide alike on every rank: 2 CPU processes over gloo (a plain PyTorch DDP loop, Lightning DDP
and FSDP2), refusals of strategies that bring their own numerics, and the multi-node trainer config."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from dist_helpers import (
    MODE_IDS,
    WEIGHT_MODES,
    RankFaultModule,
    ShardedFaultModule,
    fit_ddp,
    fit_fsdp2,
    forward_off_on_rank1,
    read_ranks,
    scaler_worker,
)
from helpers import TinyMLP, make_module
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

from lit_mpstable import StablePrecision
from lit_mpstable.callbacks import AMPPreflight, PrecisionFallback, ScaleCheckpoint
from lit_mpstable.core.scaling.adaptive_scaler import AdaptiveLossScaler
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler

pytestmark = pytest.mark.filterwarnings("ignore")  # Lightning's CPU/num_workers notices, the callbacks' reports


def _same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------- the scaler, plain PyTorch
def test_sync_found_inf_makes_every_rank_skip_in_a_plain_ddp_loop(tmp_path: Path) -> None:
    # Rank 1 alone gets an inf gradient at step 1 and a 1e3 gradient at step 2, written after DDP's all-reduce.
    # Forked: the children inherit the imports (spawn works too, ~5 s slower).
    mp.start_processes(scaler_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="fork")
    rank0, rank1 = read_ranks(tmp_path)
    for name in ("dynamic", "adaptive"):
        synced0, synced1 = rank0[name, True], rank1[name, True]
        assert synced0["skipped"] == synced1["skipped"] == [False, True, False, False], name
        assert synced0["scales"] == synced1["scales"], name
        assert synced0["overflow_count"] == synced1["overflow_count"] == 1
        # Without the sync the ranks part ways: rank 0 applies the step rank 1 skips.
        alone0, alone1 = rank0[name, False], rank1[name, False]
        assert alone0["skipped"] == [False, False, False, False] and alone1["skipped"][1], name
        assert not _same_params(alone0["params"], alone1["params"])
    assert _same_params(rank0["dynamic", True]["params"], rank1["dynamic", True]["params"])
    # Dynamic: 256 -> 128 on the overflow (hand-computed; growth_interval is 2000).
    assert rank0["dynamic", True]["scales"] == [256.0, 128.0, 128.0, 128.0]
    # Adaptive: after step 2 both ranks size the scale for rank 1's amax of 1e3: the largest power of two s with
    # 1e3 * s * headroom (2) <= 65504 is 32; without the sync rank 0 never sees it.
    assert rank0["adaptive", True]["scales"][2:] == [32.0, 32.0]
    assert rank0["adaptive", False]["scales"][2] > 1e3


def test_sync_found_inf_is_a_no_op_on_one_process_and_unscales_first() -> None:
    model = TinyMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.ones(2, 16)).sum()).backward()
    scaled = model.fc1.weight.grad.clone()
    scaler.sync_found_inf_(optimizer)  # unscales, as step() would
    torch.testing.assert_close(model.fc1.weight.grad, scaled / 4.0)
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.sync_found_inf_(optimizer)


# -------------------------------------------------------------------------------------- Lightning, DDP
@pytest.mark.parametrize("accumulate", [1, 2])
def test_inf_on_one_rank_skips_the_step_on_both(tmp_path: Path, accumulate: int) -> None:
    # With accumulation the first micro-batch runs under DDP's no_sync; the inf lands after the last one's all-reduce.
    plugin = StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**8))
    module = RankFaultModule(inf_grad_steps={2})
    rank0, rank1 = fit_ddp(module, plugin, [], tmp_path, max_steps=4, accumulate_grad_batches=accumulate)
    assert rank0["world_size"] == 2
    stepping = slice(accumulate - 1, None, accumulate)  # the batches that end with an optimizer step
    assert rank0["skipped"][stepping] == rank1["skipped"][stepping] == [False, False, True, False]
    assert rank0["scales"] == rank1["scales"] and rank0["scales"][stepping] == [256.0, 256.0, 128.0, 128.0]
    assert rank0["counters"] == rank1["counters"] == (4, 1, 1)
    assert rank0["scaler"] == rank1["scaler"]
    assert _same_params(rank0["params"], rank1["params"])


def test_adaptive_scales_stay_identical_when_one_rank_sees_larger_gradients(tmp_path: Path) -> None:
    plugin = StablePrecision("16-mixed", scaler=AdaptiveLossScaler("cpu", init_scale=2.0**8))
    module = RankFaultModule(inf_grad_steps={1}, big_grad_steps={2})
    rank0, rank1 = fit_ddp(module, plugin, [], tmp_path, max_steps=4)
    assert rank0["skipped"] == rank1["skipped"] == [False, True, False, False]
    assert rank0["scales"] == rank1["scales"]
    assert rank0["scaler"] == rank1["scaler"]  # amax history, extra headroom, counters
    assert rank0["scales"][2:] == [32.0, 32.0]  # sized for rank 1's amax of 1e3 (see the plain-PyTorch test)


def test_fallback_triggered_by_one_ranks_overflows_happens_on_both(tmp_path: Path) -> None:
    plugin = StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**8))
    fallback = PrecisionFallback(patience=2, mode="module", min_scale=None, max_overflow_rate=None)
    rank0, rank1 = fit_ddp(RankFaultModule(inf_grad_steps={1, 2}), plugin, [fallback], tmp_path, max_steps=4)
    decisions0, decisions1 = rank0["PrecisionFallback.decisions"], rank1["PrecisionFallback.decisions"]
    assert decisions0 == decisions1 and len(decisions0) == 1
    # Only rank 1 saw the inf, so only it could blame fc2: the agreed names move the same module on both ranks.
    assert decisions0[0]["modules"] == ["model.fc2"] and decisions0[0]["step"] == 3
    assert rank0["islands"] == rank1["islands"] and "model.fc2" in rank0["islands"]
    assert _same_params(rank0["params"], rank1["params"])


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_rollback_on_one_ranks_nan_weight_happens_on_both(tmp_path: Path, precision: str) -> None:
    from cb_helpers import NanWeight

    plugin = StablePrecision(precision)
    checkpoint = ScaleCheckpoint(every_n_steps=2)
    module = RankFaultModule()
    rank0, rank1 = fit_ddp(module, plugin, [NanWeight(5, rank=1), checkpoint], tmp_path, max_steps=7)
    assert rank0["ScaleCheckpoint.rollbacks"] == rank1["ScaleCheckpoint.rollbacks"] == 1
    events0, events1 = rank0["ScaleCheckpoint.events"], rank1["ScaleCheckpoint.events"]
    kind = "inf/NaN in the weights or optimizer state"  # flagged on rank 1 only, agreed by both
    assert [(e["step"], e["kind"], e["restored_step"]) for e in events0] == [(5, kind, 4)]
    assert [(e["step"], e["kind"], e["restored_step"]) for e in events1] == [(5, kind, 4)]
    assert rank0["skipped"] == rank1["skipped"] and rank0["skipped"][5]
    assert _same_params(rank0["params"], rank1["params"]) and _same_params(rank0["masters"], rank1["masters"])


def test_preflight_disagreement_on_one_rank_falls_back_on_both(tmp_path: Path) -> None:
    preflight = AMPPreflight(forward_fn=forward_off_on_rank1)
    module = RankFaultModule(batch_by_step=True)
    rank0, rank1 = fit_ddp(module, StablePrecision("bf16-mixed"), [preflight], tmp_path, max_steps=3)
    assert rank0["fallback_active"] and rank1["fallback_active"]
    assert _same_params(rank0["params"], rank1["params"])


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_preflight_fallback_in_true_precision_under_ddp_keeps_replicas_equal(tmp_path: Path, precision: str) -> None:
    # The global fallback recasts the parameters (the reducer is rebuilt) and this batch, cast already, goes to FP32.
    from dist_helpers import low_precision_off_on_rank1

    preflight = AMPPreflight(forward_fn=low_precision_off_on_rank1)
    module = RankFaultModule(batch_by_step=True)
    rank0, rank1 = fit_ddp(module, StablePrecision(precision), [preflight], tmp_path, max_steps=3)
    assert rank0["fallback_active"] and rank1["fallback_active"]
    assert rank0["param_dtypes"] == rank1["param_dtypes"] and set(rank0["param_dtypes"].values()) == {torch.float32}
    assert _same_params(rank0["params"], rank1["params"]) and _same_params(rank0["masters"], rank1["masters"])


# --------------------------------------------------------------------------- Lightning, FSDP2 (ModelParallel)
@pytest.mark.parametrize("scaler_cls", [DynamicLossScaler, AdaptiveLossScaler])
def test_fsdp2_sharded_gradients_skip_and_scale_alike(tmp_path: Path, scaler_cls: type) -> None:
    # Gradients are DTensor shards: GradScaler's unscale_ runs on them (DTensor reduces the found-inf flag across the
    # mesh itself); the adaptive amax is per shard until sync_found_inf_ takes the MAX. Lightning's own
    # MixedPrecision refuses '16-mixed' with this strategy; StablePrecision's scaler makes it work.
    plugin = StablePrecision("16-mixed", scaler=scaler_cls("cpu", init_scale=2.0**8), device="cpu")
    module = ShardedFaultModule(inf_grad_steps={1}, big_grad_steps={2})
    rank0, rank1 = fit_fsdp2(module, plugin, tmp_path, max_steps=4)
    assert rank0["world_size"] == 2
    assert rank0["skipped"] == rank1["skipped"] == [False, True, False, False]
    assert rank0["scales"] == rank1["scales"] and rank0["scaler"] == rank1["scaler"]
    assert rank0["counters"] == rank1["counters"] == (4, 1, 1)
    if scaler_cls is AdaptiveLossScaler:
        assert rank0["scales"][2:] == [32.0, 32.0]  # sized for the 1e3 in rank 1's shard


# ------------------------------------------------------------------------------------------------ refusals
def _bare(strategy_cls: type) -> object:
    strategy = strategy_cls.__new__(strategy_cls)
    strategy.cluster_environment = None  # world_size 1
    return strategy


def _attached(strategy: object) -> torch.nn.Module:
    module = make_module()
    module.trainer = SimpleNamespace(strategy=strategy)  # what convert_module reads: the strategy in use
    return module


@pytest.mark.parametrize(
    "strategy_cls, plugin_kwargs, match",
    [
        (DeepSpeedStrategy, dict(precision="16-mixed"), "scale the loss twice"),
        (DeepSpeedStrategy, dict(precision="bf16-mixed"), "DeepSpeed brings its own loss scaler"),
        (FSDPStrategy, dict(precision="bf16-mixed"), "FSDPPrecision"),
    ],
)
def test_strategies_with_their_own_numerics_are_refused_at_setup(strategy_cls, plugin_kwargs, match) -> None:
    # DeepSpeed and FSDP1 need CUDA (and DeepSpeed its package) to be built: an uninitialised instance stands in
    # for the type check, the only thing the plugin reads.
    strategy = _bare(strategy_cls)
    plugin = StablePrecision(device="cpu", **plugin_kwargs)
    with pytest.raises(ValueError, match=match):
        plugin.convert_module(_attached(strategy))


@pytest.mark.parametrize(
    "strategy, plugin_kwargs",
    [
        # FSDP2: the user's own call in configure_model, before fully_shard (tests/adapter/test_fsdp2.py trains them).
        (_bare(ModelParallelStrategy), dict(precision="bf16-true", master_weights=False)),
        (_bare(ModelParallelStrategy), dict(precision="bf16-true")),
        (_bare(ModelParallelStrategy), dict(precision="bf16-mixed", fp8="current")),
        (_bare(ModelParallelStrategy), dict(precision="16-mixed", diagnose=True)),
        (_bare(ModelParallelStrategy), dict(precision="16-mixed", fp32_modules=["model.fc2"])),
        (SimpleNamespace(world_size=2), dict(precision="bf16-true", fp8="current")),  # DDP or anything else
    ],
)
def test_other_combinations_are_accepted(strategy: object, plugin_kwargs: dict) -> None:
    plugin = StablePrecision(device="cpu", **plugin_kwargs)
    module = plugin.convert_module(_attached(strategy))
    assert plugin.layout.module is module  # converted: the plugin drives this model's precision
    assert plugin.stepper.fsdp2 == isinstance(strategy, ModelParallelStrategy)
    fp8_layers = [m for m in module.modules() if "FP8" in type(m).__name__]
    assert bool(fp8_layers) == ("fp8" in plugin_kwargs)  # the FP8 swap ran exactly where asked
    assert plugin.islands.names == plugin_kwargs.get("fp32_modules", [])
    if isinstance(strategy, ModelParallelStrategy) and plugin.master_weights:
        # FSDP2 keeps FP32 shards as the masters: nothing cast, no copy of ours will be built.
        assert plugin.stepper.fsdp2 and {p.dtype for p in module.parameters()} == {torch.float32}


class _OwnScaler(torch.amp.GradScaler):
    """A user's own GradScaler subclass: used as given (a plain GradScaler would be adopted as ours)."""


def test_a_scaler_without_sync_warns_in_multi_process_runs() -> None:
    plugin = StablePrecision("16-mixed", scaler=_OwnScaler("cpu"), device="cpu")
    assert type(plugin.scaler) is _OwnScaler
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin.convert_module(_attached(SimpleNamespace(world_size=2)))
    assert any("sync_found_inf_" in str(w.message) for w in caught)


# ------------------------------------------------------------------------------------------------ multi-node
def _compose(overrides: list[str], *, return_hydra_config: bool = False):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from lit_mpstable.app.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    conf = Path(__file__).resolve().parents[2] / "lit_mpstable" / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose(config_name="train", overrides=overrides, return_hydra_config=return_hydra_config)


def test_multi_node_trainer_config_composes() -> None:
    # What `python -m lit_mpstable.app.train --cfg job trainer=ddp trainer.num_nodes=2` prints.
    cfg = _compose(["trainer=ddp", "trainer.num_nodes=2"])
    assert cfg.trainer.num_nodes == 2 and cfg.trainer.strategy == "ddp"
    assert cfg.trainer._target_ == "lightning.pytorch.Trainer"


def test_submitit_launcher_asks_slurm_for_the_trainers_nodes() -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install hydra-submitit-launcher")
    cfg = _compose(["trainer=ddp", "trainer.num_nodes=2", "hydra/launcher=submitit"], return_hydra_config=True)
    assert cfg.hydra.launcher.nodes == 2


# ------------------------------------------------------------------ repairs under DDP keep the replicas equal
def _assert_replicas_equal(rank0: dict, rank1: dict) -> None:
    assert rank0["world_size"] == 2
    assert rank0["PrecisionChanges.events"] == rank1["PrecisionChanges.events"] != []
    assert _same_params(rank0["params"], rank1["params"]), {
        k: (rank0["params"][k].float() - rank1["params"][k].float()).abs().max().item() for k in rank0["params"]}
    assert _same_params(rank0["masters"], rank1["masters"])


@pytest.mark.slow
@pytest.mark.parametrize("master_weights", [True, False, "kahan"])
@pytest.mark.parametrize("changes", [
    {1: "global"},  # PrecisionFallback's default: the whole model to FP32
    {1: ["model.fc2"]},  # a module fallback: an FP32 island
    {1: ["model.fc2"], 3: "restore"},
    {1: "global", 3: "restore"},
    {0: "snapshot", 1: "global", 3: "rollback"},  # a rollback to before the fallback (ScaleCheckpoint's path)
], ids=["global", "module", "module-restore", "global-restore", "rollback"])
def test_ddp_true_precision_repairs_keep_replicas_equal(tmp_path: Path, master_weights, changes) -> None:
    # Each rank trains on its own half of the batch, so only DDP's gradient all-reduce keeps them equal: a repair that
    # recasts parameters must keep the reducer's hooks firing (or refuse). Rank files hold the final weights.
    from dist_helpers import PrecisionChanges

    plugin = StablePrecision("bf16-true", master_weights=master_weights)
    module = RankFaultModule(batch_by_step=True)
    rank0, rank1 = fit_ddp(module, plugin, [PrecisionChanges(changes)], tmp_path, max_steps=6)
    _assert_replicas_equal(rank0, rank1)


def test_a_plain_ddp_loop_keeps_unseeded_replicas_equal_in_every_weight_mode(tmp_path: Path) -> None:
    # The plain PyTorch loop's call: stepper.follow_model_weights_(ddp.process_group) after wrapping. One fork pair
    # runs every weight mode in turn.
    from dist_helpers import assert_same_state, replicas_worker

    mp.start_processes(replicas_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="fork")
    rank0, rank1 = read_ranks(tmp_path)
    for mode in WEIGHT_MODES:
        assert rank0[mode]["steps"] == rank1[mode]["steps"] == 3, mode
        assert _same_params(rank0[mode]["params"], rank1[mode]["params"]), mode
        assert_same_state(rank0[mode]["keeper"], rank1[mode]["keeper"], str(mode))


@pytest.mark.parametrize(("master_weights", "optimizer_state", "adam"), WEIGHT_MODES, ids=MODE_IDS)
def test_ddp_replicas_initialised_and_seeded_apart_train_alike(tmp_path: Path, master_weights, optimizer_state,
                                                                adam: bool) -> None:
    # Two ranks, each building its model from its own seed (no seed_everything). DDP broadcast rank 0's 16-bit
    # weights, but the FP32 masters were built from each rank's own FP32 init and the first step copied them back
    # over the broadcast (weights 0.48 apart after 8 steps); the rounding seeds came from each rank's torch seed.
    from dist_helpers import UnseededModule, assert_same_state

    plugin = StablePrecision("bf16-true", master_weights=master_weights, optimizer_state=optimizer_state)
    rank0, rank1 = fit_ddp(UnseededModule(adam), plugin, [], tmp_path, max_steps=3)
    assert rank0["world_size"] == 2 and rank0["counters"] == rank1["counters"] == (3, 0, 0)
    assert _same_params(rank0["params"], rank1["params"]), {
        k: (rank0["params"][k].float() - rank1["params"][k].float()).abs().max().item() for k in rank0["params"]}
    assert_same_state(rank0["keeper"], rank1["keeper"], "keeper")
    assert (rank0["keeper"] != {}) == (master_weights is not False)  # the state compared is there


def test_a_recast_under_ddp_rebuilds_the_reducer_or_is_refused(tmp_path: Path) -> None:
    # A plain PyTorch DDP loop: the layout cannot find the wrapper until told, and then keeps the replicas equal.
    from dist_helpers import layout_worker

    mp.start_processes(layout_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="fork")
    rank0, rank1 = read_ranks(tmp_path)
    for rank in (rank0, rank1):
        assert "no DistributedDataParallel wrapping the model" in rank["refused"]
        assert rank["after_refusal"] == (False, {torch.bfloat16})  # the refused call changed nothing
    assert _same_params(rank0["params"], rank1["params"])


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_precision_fallback_default_under_ddp_keeps_replicas_equal(tmp_path: Path, precision: str) -> None:
    # PrecisionFallback's default (a global fallback) on rank 1's overflows: the whole model goes to FP32 on both
    # ranks and the gradient all-reduce goes on (it silently stopped: replicas 0.0197 apart, rc=0).
    plugin = StablePrecision(precision)
    fallback = PrecisionFallback(patience=1)
    module = RankFaultModule(inf_grad_steps={1}, batch_by_step=True)
    rank0, rank1 = fit_ddp(module, plugin, [fallback], tmp_path, max_steps=5)
    decisions = rank0["PrecisionFallback.decisions"]
    assert decisions == rank1["PrecisionFallback.decisions"] and [d["modules"] for d in decisions] == [None]
    assert set(rank0["param_dtypes"].values()) == {torch.float32} and rank0["skipped"][1] and rank1["skipped"][1]
    assert _same_params(rank0["params"], rank1["params"]) and _same_params(rank0["masters"], rank1["masters"])


@pytest.mark.slow
@pytest.mark.parametrize("ddp_kwargs", [
    {"find_unused_parameters": True}, {"static_graph": True}, {"start_method": "spawn"}, "comm_hook",
], ids=["find_unused", "static_graph", "spawn", "comm_hook"])
def test_ddp_options_survive_the_reducer_rebuild(tmp_path: Path, ddp_kwargs) -> None:
    from dist_helpers import PrecisionChanges, allreduce_hook

    if ddp_kwargs == "comm_hook":
        ddp_kwargs = {"ddp_comm_hook": allreduce_hook, "ddp_comm_state": {}}
    plugin = StablePrecision("bf16-true")
    changes = PrecisionChanges({1: ["model.fc2"], 2: "global", 3: "restore"})
    rank0, rank1 = fit_ddp(RankFaultModule(batch_by_step=True), plugin, [changes], tmp_path, max_steps=5,
                           ddp_kwargs=ddp_kwargs)
    _assert_replicas_equal(rank0, rank1)

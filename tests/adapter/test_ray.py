"""Ray Train: StablePrecision and the callbacks on a local Ray cluster of 2 CPU workers (gloo), against the same
run under Lightning's own DDP; FSDP2 under Ray through ModelParallelStrategy; what Ray cannot carry refused.

The cluster runs take ~1 min on 2 cores: marked slow. ``LIT_MPSTABLE_RAY_STEPS`` lengthens the comparison (the
issue's 100 steps were run that way once; the test keeps 12).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from dist_helpers import RankFaultModule, RankReport, ShardedFaultModule, fit_ddp, fit_fsdp2, read_ranks

from lit_mpstable import StablePrecision
from lit_mpstable.callbacks import OverflowMonitor, ScaleCheckpoint
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler

ray = pytest.importorskip("ray", reason="pip install 'lit_mpstable[ray]'")
ray_lightning = pytest.importorskip("ray.train.lightning")
pytestmark = pytest.mark.filterwarnings("ignore")

STEPS = int(os.environ.get("LIT_MPSTABLE_RAY_STEPS", "12"))
INF_STEP = 3  # rank 1 only gets an inf gradient (after DDP's all-reduce): every rank must skip it
TESTS = Path(__file__).resolve().parents[1]


def _bare(cls: type) -> Any:
    return cls.__new__(cls)  # FSDP1/DeepSpeed need CUDA to be built; the type is all check_strategy reads


def _attached(strategy: object) -> torch.nn.Module:
    module = RankFaultModule()
    module.trainer = SimpleNamespace(strategy=strategy)
    return module


# ------------------------------------------------------------------------------------------- refusals, no cluster
def test_ray_fsdp1_is_refused_at_setup_naming_fsdp2_under_ray() -> None:
    plugin = StablePrecision("bf16-mixed", device="cpu")
    with pytest.raises(ValueError, match=r"RayFSDPStrategy is FSDP1.*ModelParallelStrategy.*RayLightningEnvironment"
                                         r".*do not call ray.train.lightning.prepare_trainer"):
        plugin.convert_module(_attached(_bare(ray_lightning.RayFSDPStrategy)))


def test_ray_deepspeed_is_refused_naming_ray_ddp() -> None:
    plugin = StablePrecision("16-mixed", device="cpu")
    with pytest.raises(ValueError, match=r"scale the loss twice.*OverflowMonitor.*under Ray: RayDDPStrategy"):
        plugin.convert_module(_attached(_bare(ray_lightning.RayDeepSpeedStrategy)))


def test_prepare_trainer_refuses_model_parallel_so_the_fsdp2_path_skips_it() -> None:
    # Why ray_fsdp2_strategy() is used without prepare_trainer: Ray's check is by strategy class.
    from lightning.pytorch.strategies import ModelParallelStrategy

    trainer = SimpleNamespace(strategy=_bare(ModelParallelStrategy))
    with pytest.raises(RuntimeError, match="RayDDPStrategy.*RayFSDPStrategy.*RayDeepSpeedStrategy"):
        ray_lightning.prepare_trainer(trainer)


def test_ray_fsdp2_strategy_needs_a_ray_worker() -> None:
    from lit_mpstable.frontends.strategies import ray_fsdp2_strategy

    with pytest.raises(RuntimeError):
        ray_fsdp2_strategy()


# ------------------------------------------------------------------------------------------- runs
class LossLog(pl.Callback):
    """Each optimizer step's loss (as training_step returned it), to ``out_dir/losses{rank}.pt`` at the end."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir, self.losses = str(out_dir), []

    def on_train_batch_end(self, trainer, pl_module, outputs, *args) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save(self.losses, os.path.join(self.out_dir, f"losses{trainer.global_rank}.pt"))


def _plugin() -> StablePrecision:
    return StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**8), device="cpu")


def _callbacks(out_dir: str | Path) -> list[pl.Callback]:
    return [OverflowMonitor(window=4, log_every_n_steps=1), ScaleCheckpoint(every_n_steps=4), LossLog(out_dir)]


def _module(kind: str) -> pl.LightningModule:
    if kind == "fsdp2":
        return ShardedFaultModule(batch_by_step=True, policy="plugin", inf_grad_steps={INF_STEP})
    return RankFaultModule(batch_by_step=True, inf_grad_steps={INF_STEP})


def ray_worker(config: dict[str, Any]) -> None:
    """Ray Train's train_loop_per_worker: the same module, plugin and callbacks, under Ray's strategies."""
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer

    from lit_mpstable.frontends.strategies import ray_fsdp2_strategy

    torch.set_num_threads(1)
    out_dir, kind = config["out_dir"], config["kind"]
    options = dict(enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False)
    if kind == "ddp":
        strategy: Any = RayDDPStrategy()
    else:
        strategy = ray_fsdp2_strategy()
    trainer = pl.Trainer(
        accelerator="cpu", devices="auto", strategy=strategy, plugins=[_plugin(), RayLightningEnvironment()],
        callbacks=[*_callbacks(out_dir), RankReport(out_dir)], max_steps=config["steps"], **options,
    )
    if kind == "ddp":
        trainer = prepare_trainer(trainer)
    trainer.fit(_module(kind))


def _fit_ray(kind: str, out_dir: Path, steps: int) -> list[dict[str, Any]]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out_dir.mkdir(parents=True, exist_ok=True)
    TorchTrainer(
        ray_worker, train_loop_config=dict(out_dir=str(out_dir), kind=kind, steps=steps),
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False), torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(name=f"ray-{kind}", storage_path=str(out_dir / "ray_results")),
    ).fit()
    return _with_losses(out_dir)


def _with_losses(out_dir: Path) -> list[dict[str, Any]]:
    ranks = read_ranks(out_dir)
    for rank, report in enumerate(ranks):
        report["losses"] = torch.load(out_dir / f"losses{rank}.pt")
    return ranks


@pytest.fixture(scope="module")
def local_ray():
    # Workers import the tests' helpers by name: give them this checkout's paths.
    path = os.pathsep.join([str(TESTS.parent), str(TESTS), str(TESTS / "adapter"), os.environ.get("PYTHONPATH", "")])
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()
    for sig, handler in handlers.items():  # ray.init's SIGTERM handler (it exits) outlives ray.shutdown()
        signal.signal(sig, handler)


def _max_delta(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == STEPS, (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.slow
def test_ray_ddp_matches_lightning_ddp_step_for_step_with_an_overflow(local_ray, tmp_path: Path) -> None:
    on_ray = _fit_ray("ddp", tmp_path / "ray", STEPS)
    spawned = fit_ddp(_module("ddp"), _plugin(), _callbacks(tmp_path / "ddp"), tmp_path / "ddp", STEPS,
                      ddp_kwargs={"start_method": "spawn"})
    spawned = _with_losses(tmp_path / "ddp")
    for rank in (0, 1):
        ray_run, ddp_run = on_ray[rank], spawned[rank]
        assert ray_run["world_size"] == ddp_run["world_size"] == 2
        # Measured: max |delta loss| = 0.0 over 12 steps here and over 100 (LIT_MPSTABLE_RAY_STEPS=100).
        assert _max_delta(ray_run["losses"], ddp_run["losses"]) == 0.0
        assert ray_run["skipped"] == ddp_run["skipped"] == [step == INF_STEP for step in range(STEPS)]
        assert ray_run["scales"] == ddp_run["scales"] and ray_run["scales"][INF_STEP] == 128.0
        assert ray_run["counters"] == ddp_run["counters"] == (STEPS, 1, 1)
        for name, value in ddp_run["params"].items():
            assert torch.equal(ray_run["params"][name], value), name


@pytest.mark.slow
def test_fsdp2_under_ray_matches_fsdp2_without_ray(local_ray, tmp_path: Path) -> None:
    steps = 6
    on_ray = _fit_ray("fsdp2", tmp_path / "ray", steps)
    plain = fit_fsdp2(_module("fsdp2"), _plugin(), tmp_path / "plain", steps, _callbacks(tmp_path / "plain"))
    plain = _with_losses(tmp_path / "plain")
    for rank in (0, 1):
        assert on_ray[rank]["world_size"] == 2 and on_ray[rank]["masters"] == {}  # FSDP2's shards are the masters
        assert on_ray[rank]["losses"] == plain[rank]["losses"]
        assert on_ray[rank]["counters"] == plain[rank]["counters"] == (steps, 1, 1)
        for name, value in plain[rank]["params"].items():
            assert torch.equal(on_ray[rank]["params"][name], value), name

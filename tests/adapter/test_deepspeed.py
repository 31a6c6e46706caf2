"""DeepSpeed observed: under ``DeepSpeedStrategy`` (DeepSpeed owns the scaler, the FP32 masters and the step)
OverflowMonitor logs DeepSpeed's loss scale and every step it skipped, in FP16 and BF16, and ScaleCheckpoint rolls
back; a ZeRO partitioned optimizer refuses the snapshot with the reason.

These run DeepSpeed's real engine on the CPU (``DS_ACCELERATOR=cpu``, gloo, one process: each test in a pytest
process of its own, which it starts). Two things are lifted for that, both outside the numerics: Lightning's
DeepSpeedStrategy refuses any accelerator but CUDA at setup
(``CPUDeepSpeedStrategy`` skips that check only), and DeepSpeed's CPU accelerator declares no FP16 although torch
computes FP16 on the CPU (the FP16 tests set the flag, so DeepSpeed's own FP16 optimizer and loss scaler run).
bench/gpu_deepspeed.py runs the same checks on a GPU, unmodified.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from dist_helpers import RankFaultModule
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from lit_mpstable.callbacks import OverflowMonitor, ScaleCheckpoint
from lit_mpstable.callbacks.views import DeepSpeedView, view_of

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytestmark = pytest.mark.filterwarnings("ignore")
# DeepSpeed's engine leaves process-wide state behind (its communication backend, a process group it caches), and a
# distributed test that runs later in the same pytest process then hangs: each real-engine test runs in a pytest
# process of its own (_in_own_process), where LIT_MPSTABLE_DEEPSPEED=1 says the engine may run.
real_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                    reason="DeepSpeed's real engine: pip install 'lit_mpstable[deepspeed]'")
OWN_PROCESS_S = 600  # every real-engine test in one process, imports included (15-35 s each when loaded)

STEPS = 8
INF_STEPS = {2, 5}


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy without its CUDA-only check (the rest of setup is Lightning's own)."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        # Its device check wants indexed (CUDA) devices; a CPU device carries no index.
        self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices))]
        super().setup_distributed()


class Recorder(pl.Callback):
    """Per step: what the engine says (skipped, scale) and what the view says; the weights at the end."""

    def __init__(self) -> None:
        self.engine_skipped: list[bool] = []
        self.engine_scales: list[float] = []
        self.view_skipped: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        engine = trainer.strategy.model
        self.engine_skipped.append(not engine.was_step_applied())
        self.engine_scales.append(float(getattr(engine.optimizer, "loss_scale", 1.0)))
        monitor = next(cb for cb in trainer.callbacks if isinstance(cb, OverflowMonitor))
        self.view_skipped.append(monitor._plugin.last_step_skipped)


# ------------------------------------------------------------------ the reading, on a stand-in engine (no DeepSpeed)
class _Scaler:
    def __init__(self, zero: bool) -> None:
        self.cur_scale, self.overflow = 256.0, False
        if not zero:  # FP16_Optimizer keeps it behind a loss_scale property; ZeRO has both (checked in the real runs)
            self.loss_scale = self.cur_scale


class _Engine:
    """What DeepSpeedEngine exposes: skipped_steps, was_step_applied(), optimizer.loss_scale / cur_scale, the
    precision flags and the ZeRO stage (names as in deepspeed/runtime/engine.py and fp16/loss_scaler.py)."""

    def __init__(self, *, fp16: bool, stage: int = 0, zero: bool = False) -> None:
        self.optimizer = _Scaler(zero) if fp16 else SimpleNamespace(overflow=False)
        self.skipped_steps, self.applied, self.fp16, self.stage = 3, True, fp16, stage

    def was_step_applied(self) -> bool:
        return self.applied

    def fp16_enabled(self) -> bool:
        return self.fp16

    def bfloat16_enabled(self) -> bool:
        return not self.fp16

    def zero_optimization_stage(self) -> int:
        return self.stage


class _StandInStrategy(DeepSpeedStrategy):
    def __init__(self, engine: _Engine) -> None:  # DeepSpeedStrategy.__init__ needs the package and CUDA
        self._engine = engine

    @property
    def model(self) -> _Engine:
        return self._engine


def _view(engine: _Engine, precision: str = "16-mixed") -> DeepSpeedView:
    trainer = SimpleNamespace(strategy=_StandInStrategy(engine), global_step=10, optimizers=[])
    plugin = type("DeepSpeedPrecision", (), {"precision": precision})()  # weak-referenceable, as Lightning's is
    view = view_of(plugin, trainer)
    assert type(view) is DeepSpeedView  # the foreign-plugin reader hands DeepSpeed runs to the engine reader
    return view


@pytest.mark.parametrize("zero", [False, True])
def test_the_view_reads_deepspeeds_scale_and_skips_from_the_engine(zero: bool) -> None:
    engine = _Engine(fp16=True, zero=zero)
    view = _view(engine)
    assert view.dtype == torch.float16 and view.checks_nonfinite and view.loss_scale == 256.0
    assert view.skipped_steps == 0 and not view.last_step_skipped  # counted from fit start, no step yet
    engine.skipped_steps, engine.applied, view._trainer.global_step = 4, False, 11
    engine.optimizer.cur_scale = 128.0
    if not zero:
        engine.optimizer.loss_scale = 128.0
    assert view.skipped_steps == view.overflow_count == 1 and view.last_step_skipped and view.loss_scale == 128.0
    assert view.step_count == 1 and view.hook_loss_scale == 1.0  # the hook's loss is unscaled under DeepSpeed


def test_the_view_of_a_bf16_engine_has_no_scale_but_counts_its_skips() -> None:
    engine = _Engine(fp16=False)
    view = _view(engine, "bf16-mixed")
    engine.skipped_steps = 5
    assert view.dtype == torch.bfloat16 and view.loss_scale == 1.0 and view.skipped_steps == 2


def test_a_zero_partitioned_engine_refuses_a_snapshot() -> None:
    with pytest.raises(ValueError, match=r"ZeRO stage 2.*stage=0"):
        _view(_Engine(fp16=True, stage=2)).state_dict()
    assert _view(_Engine(fp16=True)).state_dict() == {"global_steps": 0}


@pytest.fixture(autouse=True, scope="module")
def _leave_no_process_group() -> Iterator[None]:
    """DeepSpeed's engine (through Lightning's DDP setup) initializes a process group in this process and sets the
    rendezvous variables (MASTER_PORT, WORLD_SIZE, ...): the distributed tests after these would inherit both and
    hang. This module leaves the process as it found it (the group lives through the module: DeepSpeed caches it)."""
    environ = dict(os.environ)
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


# ------------------------------------------------------------------ DeepSpeed's real engine on the CPU
_OUTCOMES: dict[str, str] = {}  # node id -> "passed" / "skipped" / "failed", from the one child process
_CHILD_OUTPUT: list[str] = []


def _in_own_process(request: pytest.FixtureRequest) -> bool:
    """Whether this process runs the engine (LIT_MPSTABLE_DEEPSPEED=1). Otherwise every real-engine test of this file
    runs once, together, in one new pytest process (``DS_ACCELERATOR=cpu``; DeepSpeed imported once) and each test
    here takes its own outcome from it (passed, skipped, or failed with the child's output): the engine never shares a
    process with other tests, and this process imports nothing of DeepSpeed."""
    if os.environ.get("LIT_MPSTABLE_DEEPSPEED") == "1":
        return True
    if not _OUTCOMES:
        ids = [item.nodeid for item in request.session.items
               if item.path == request.node.path and "request" in getattr(item, "fixturenames", ())]
        command = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:randomly", "-p", "no:cacheprovider", *ids]
        env = {**os.environ, "LIT_MPSTABLE_DEEPSPEED": "1", "DS_ACCELERATOR": "cpu"}
        try:
            result = subprocess.run(command, cwd=request.config.rootpath, env=env, capture_output=True, text=True,
                                    timeout=OWN_PROCESS_S)
            output = result.stdout
        except subprocess.TimeoutExpired as error:
            partial = error.stdout or ""
            output = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
            output += f"\n(the child ran past {OWN_PROCESS_S} s and was killed)"
        _CHILD_OUTPUT.append(output[-6000:])
        for line in output.splitlines():  # -rA: "PASSED <node id>", "FAILED <node id> - ..."
            match = re.match(r"(PASSED|FAILED|ERROR) (\S+)", line)
            if match:
                _OUTCOMES[match.group(2)] = match.group(1).lower()
        for node in ids:
            _OUTCOMES.setdefault(node, "skipped" if "SKIPPED" in output else "missing")
    outcome = _OUTCOMES.get(request.node.nodeid, "missing")
    if outcome == "passed":
        return False
    if outcome == "skipped":
        pytest.skip(f"skipped in the real-engine process: {_CHILD_OUTPUT[0][-500:]}")
    pytest.fail(f"{request.node.nodeid}: {outcome} in the real-engine process:\n{_CHILD_OUTPUT[0]}")


@pytest.fixture(autouse=True)
def _no_shared_memory_allreduce(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the real-engine process: DeepSpeed's CPU communication backend JIT-compiles its shared-memory all-reduce
    kernel (deepspeed_shm_comm) when it starts, 60-75 s on 2 cores with a cold torch_extensions cache, as CI's
    always is. These engines run one rank, which never all-reduces through it: without it they start in ~1 s."""
    if os.environ.get("LIT_MPSTABLE_DEEPSPEED") == "1":
        backend = importlib.import_module("deepspeed.comm.torch")  # not deepspeed.comm.torch: that name is torch
        monkeypatch.setattr(backend, "build_shm_op", lambda: None)


def _fp16_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: True)


def _fit(tmp_path: Path, precision: str, callbacks: list[pl.Callback], *, stage: int = 0,
         module: pl.LightningModule | None = None, steps: int = STEPS) -> tuple[pl.Trainer, Recorder]:
    recorder = Recorder()
    strategy = CPUDeepSpeedStrategy(stage=stage, initial_scale_power=8, loss_scale_window=1000, hysteresis=1,
                                    process_group_backend="gloo")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_steps=steps,
        callbacks=[*callbacks, recorder], logger=CSVLogger(tmp_path, name="ds"), log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(module or RankFaultModule(fault_rank=0, batch_by_step=True, inf_grad_steps=INF_STEPS))
    return trainer, recorder


def _logged(trainer: pl.Trainer, name: str) -> dict[int, float]:
    import csv

    path = Path(trainer.logger.log_dir) / "metrics.csv"
    with open(path) as f:
        return {int(row["step"]): float(row[name]) for row in csv.DictReader(f) if row.get(name)}


@pytest.mark.slow
@real_deepspeed
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_overflow_monitor_logs_deepspeeds_scale_and_every_skipped_step(request, monkeypatch, tmp_path, precision):
    if not _in_own_process(request):
        return
    _fp16_on_cpu(monkeypatch)
    monitor = OverflowMonitor(window=4, log_every_n_steps=1)
    trainer, recorder = _fit(tmp_path, precision, [monitor])
    assert isinstance(monitor._plugin, DeepSpeedView)
    engine = trainer.strategy.model
    injected = [step in INF_STEPS for step in range(STEPS)]
    # DeepSpeed itself skipped exactly the injected steps (the independent record: the engine's own flag)...
    assert recorder.engine_skipped == injected and engine.skipped_steps == len(INF_STEPS)
    # ...and every one of them reached the log: 100% of the injected skips.
    assert recorder.view_skipped == injected
    skipped = _logged(trainer, "mp/skipped_steps")
    assert [skipped[step] for step in range(STEPS)] == [sum(injected[: step + 1]) for step in range(STEPS)]
    scales = _logged(trainer, "mp/loss_scale")
    if precision == "16-mixed":
        # DeepSpeed's FP16 scaler: 2**8, halved at each overflow (hysteresis=1), as the engine reports it.
        assert [scales[step] for step in range(STEPS)] == recorder.engine_scales
        assert recorder.engine_scales == [256.0, 256.0, 128.0, 128.0, 128.0, 64.0, 64.0, 64.0]
    else:
        assert set(scales.values()) == {1.0}  # BF16: no scaling, but the inf steps still skipped and logged


@pytest.mark.slow
@real_deepspeed
def test_scale_checkpoint_rolls_back_deepspeeds_masters_and_scaler(request, monkeypatch, tmp_path) -> None:
    if not _in_own_process(request):
        return
    _fp16_on_cpu(monkeypatch)
    # A NaN weight at step 5 (its loss non-finite) rolls back to the snapshot of step 4 (the ladder's rollback).
    class NaNLoss(RankFaultModule):
        def training_step(self, batch, batch_idx):
            if self.global_step == 5:
                with torch.no_grad():
                    next(self.parameters()).view(-1)[0] = math.nan
            return super().training_step(batch, batch_idx)

    checkpoint = ScaleCheckpoint(every_n_steps=2)  # DeepSpeed's own precision: found by the check at step 6
    snapshots: dict[str, Any] = {}

    class Grab(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            if trainer.global_step == 4:
                opt = trainer.optimizers[0]
                snapshots["params"] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
                snapshots["masters"] = [p.detach().clone() for g in opt.fp32_groups for p in g]
                snapshots["scale"] = opt.loss_scale

    module = NaNLoss(fault_rank=0, batch_by_step=True, inf_grad_steps={2})
    trainer, _ = _fit(tmp_path, "16-mixed", [checkpoint, Grab()], module=module, steps=6)
    assert checkpoint.rollbacks == 1 and checkpoint.events[0]["restored_step"] == 4
    opt = trainer.optimizers[0]
    for name, value in snapshots["params"].items():
        assert torch.equal(module.state_dict()[name], value), name
    for live, saved in zip([p for g in opt.fp32_groups for p in g], snapshots["masters"]):
        assert torch.equal(live, saved)
    assert opt.loss_scale == snapshots["scale"] == 128.0


@pytest.mark.slow
@real_deepspeed
def test_scale_checkpoint_under_zero_refuses_the_snapshot_with_the_reason(request, tmp_path) -> None:
    if not _in_own_process(request):
        return
    with pytest.raises(ValueError, match=r"ZeRO stage 1.*only DeepSpeed's own checkpoints restore.*stage=0"):
        _fit(tmp_path, "bf16-mixed", [ScaleCheckpoint(every_n_steps=2)], stage=1, steps=2)


@pytest.mark.slow
@real_deepspeed
def test_scale_checkpoint_sees_no_spike_when_deepspeed_halves_its_scale(request, monkeypatch, tmp_path) -> None:
    if not _in_own_process(request):
        return
    _fp16_on_cpu(monkeypatch)
    # DeepSpeed scales inside engine.backward: the loss ScaleCheckpoint reads is unscaled, so a halved scale must
    # not look like a doubled loss.
    checkpoint = ScaleCheckpoint(every_n_steps=100)
    _fit(tmp_path, "16-mixed", [checkpoint], module=RankFaultModule(fault_rank=0, batch_by_step=True,
                                                                    inf_grad_steps={4}), steps=8)
    assert checkpoint.events == [] and checkpoint.rollbacks == 0

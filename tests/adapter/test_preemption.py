"""PreemptionCheckpoint: a SIGTERM/SIGUSR1 stops every rank at one step boundary with one atomic checkpoint, the
resumed run continues bit-identically, and every piece of mutable stability state is in that checkpoint."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from dist_helpers import TIMEOUT, WORLD_SIZE
from helpers import TinyMLP, regression_data
from torch import nn

from lit_mpstable import StablePrecision
from lit_mpstable.callbacks import AMPPreflight, OverflowMonitor, PrecisionFallback, PrecisionProbe, ScaleCheckpoint
from lit_mpstable.callbacks.preemption import PreemptionCheckpoint, atomic_save
from lit_mpstable.scaling import DynamicLossScaler

# Faults keyed on the optimizer step (a resumed run meets them at the same steps). Overflows on rank 1 in steps 3 and 4
# make PrecisionFallback go global (decided at global_step 5; cooldown: restored at 9); ScaleCheckpoint snapshots at
# each layout change and every 4 steps, and rolls back to its snapshot of 9 on the loss spike of step 10; another
# overflow in step 13 lands in OverflowMonitor's window.
FAULTS = dict(inf_grad_steps=(3, 4, 13), spike_steps=(10,))


class PreemptModule(pl.LightningModule):
    """TinyMLP regression with dropout (the RNG matters), shuffled data (the sampler position matters), AdamW and a
    step LR schedule; fc2's gradient turns inf on ``fault_rank`` at ``inf_grad_steps``, the loss spikes (x1e6) on
    rank 0 at ``spike_steps``."""

    def __init__(self, inf_grad_steps=(), spike_steps=(), fault_rank: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyMLP()
        self.drop = nn.Dropout(0.2)
        self.inf_grad_steps, self.spike_steps, self.fault_rank = set(inf_grad_steps), set(spike_steps), fault_rank
        self.x, self.y = regression_data(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        return m.fc3(m.act(m.fc2(self.drop(m.act(m.fc1(x))))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y)
        if self.global_rank == 0 and self.global_step in self.spike_steps:
            loss = loss * 1e6
        return loss

    def on_after_backward(self) -> None:
        if self.global_rank == self.fault_rank and self.global_step in self.inf_grad_steps:
            self.model.fc2.weight.grad.view(-1)[0] = float("inf")

    def train_dataloader(self):
        dataset = torch.utils.data.TensorDataset(self.x, self.y)
        return torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True)  # DistributedSampler under DDP

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def plugin() -> StablePrecision:
    return StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**10, growth_interval=3),
                           telemetry_every_n_steps=5)


def callbacks() -> list[pl.Callback]:
    """Every callback of lit_mpstable.callbacks."""
    return [OverflowMonitor(window=5, log_every_n_steps=1), PrecisionFallback(patience=2, cooldown=4),
            ScaleCheckpoint(every_n_steps=4, min_history=3, on_spike="rollback", max_rollbacks=10),
            AMPPreflight(), PrecisionProbe(every_n_steps=6)]


class SignalAt(pl.Callback):
    """Sends ``signum`` to its own process on ``rank`` at the start of optimizer step ``step``."""

    def __init__(self, step: int, signum: int, rank: int = 1) -> None:
        self.step, self.signum, self.rank = step, signum, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), self.signum)


class Report(pl.Callback):
    """Per optimizer step its loss; at the end weights, plugin and callback states, to ``out/rank{r}.pt``."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir, self.losses = str(out_dir), {}

    def setup(self, trainer, pl_module, stage) -> None:
        torch.set_num_threads(1)
        torch.manual_seed(100 + trainer.global_rank)  # the RNG a fresh run starts from (a resume restores its own)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses[self._step] = outputs["loss"].detach().float().item()

    def on_train_end(self, trainer, pl_module) -> None:
        states = {cb.state_key: cb.state_dict() for cb in trainer.callbacks
                  if not isinstance(cb, (Report, PreemptionCheckpoint, SignalAt)) and hasattr(cb, "state_dict")}
        torch.save({"losses": self.losses, "step": trainer.global_step,
                    "params": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                    "plugin": trainer.precision_plugin.state_dict(), "callbacks": states},
                   Path(self.out_dir) / f"rank{trainer.global_rank}.pt")


def run(out_dir: Path, max_steps: int, extra: list[pl.Callback] = (), ckpt_path: Path | None = None,
        faults: dict[str, Any] = FAULTS) -> list[dict[str, Any]]:
    """Fit on 2 CPU processes (gloo, forked); each rank's report."""
    from lightning.pytorch.strategies import DDPStrategy

    out_dir.mkdir(parents=True, exist_ok=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD_SIZE, strategy=DDPStrategy(start_method="fork", timeout=TIMEOUT),
        plugins=[plugin()], callbacks=[*callbacks(), *extra, Report(out_dir)], max_steps=max_steps,
        enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False,
    )
    trainer.fit(PreemptModule(**faults), ckpt_path=ckpt_path)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


def preempted_and_resumed(tmp: Path, max_steps: int, step: int, signum: int, rank: int = 1,
                          faults: dict[str, Any] = FAULTS) -> tuple[list[dict], list[dict], Path]:
    ckpt_dir = tmp / "ckpt"
    first = run(tmp / "first", max_steps, [PreemptionCheckpoint(ckpt_dir, exit=False), SignalAt(step, signum, rank)],
                faults=faults)
    path = ckpt_dir / "preemption.ckpt"
    resumed = run(tmp / "resumed", max_steps, [PreemptionCheckpoint(ckpt_dir, exit=False)], ckpt_path=path,
                  faults=faults)
    return first, resumed, path


def max_delta(full: list[dict], first: list[dict], resumed: list[dict]) -> dict[str, float]:
    """Max |difference| of per-step losses (the preempted run's steps, then the resumed run's) and final weights,
    over both ranks; also whether the plugin and callback states are equal."""
    out = {"loss": 0.0, "weights": 0.0, "steps_compared": 0, "state_equal": True}
    for f, a, b in zip(full, first, resumed):
        stitched = {**a["losses"], **b["losses"]}
        assert sorted(stitched) == sorted(f["losses"]), (sorted(stitched), sorted(f["losses"]))
        out["steps_compared"] += len(stitched)
        for s, loss in f["losses"].items():
            out["loss"] = max(out["loss"], abs(stitched[s] - loss))
        for k, v in f["params"].items():
            out["weights"] = max(out["weights"], (b["params"][k].float() - v.float()).abs().max().item())
        out["state_equal"] &= b["plugin"] == f["plugin"] and b["callbacks"] == f["callbacks"]
    return out


# ------------------------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(signals=()), ValueError, "at least one signal"),
    (dict(signals=("SIGTERM", "SIGTERM")), ValueError, "each once"),
    (dict(signals=("SIGKILL",)), ValueError, "SIGKILL cannot be caught"),
    (dict(signals=("SIGNOPE",)), ValueError, "'SIGNOPE' is not a signal"),
    (dict(signals="SIGTERM"), TypeError, "sequence of signals"),
    (dict(signals=(1.5,)), TypeError, "got float"),
    (dict(exit="yes"), TypeError, "exit='yes'"),
    (dict(dirpath=3), TypeError, "dirpath=3"),
    (dict(filename="a/b.ckpt"), ValueError, "plain file name"),
])
def test_arguments_are_validated(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        PreemptionCheckpoint(**kwargs)


def test_handlers_chain_to_the_previous_one_and_are_restored() -> None:
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        cb = PreemptionCheckpoint(signals=("SIGUSR1",))
        trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, callbacks=[cb])
        cb.setup(trainer, None, "fit")
        os.kill(os.getpid(), signal.SIGUSR1)
        assert cb._received == signal.SIGUSR1 and seen == [signal.SIGUSR1]
        cb.teardown(trainer, None, "fit")
        assert signal.getsignal(signal.SIGUSR1) is not cb._handle
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] * 2
    finally:
        signal.signal(signal.SIGUSR1, previous)


# --------------------------------------------------------------------------------------------- continuation
@pytest.mark.slow
@pytest.mark.parametrize(("step", "signum"), [(8, signal.SIGTERM), (5, signal.SIGUSR1)])
def test_resumed_run_equals_the_uninterrupted_one(tmp_path, step, signum) -> None:
    max_steps = 16
    full = run(tmp_path / "full", max_steps)
    first, resumed, path = preempted_and_resumed(tmp_path, max_steps, step, signum)
    # Delivered to rank 1 only; both stop at the next boundary (the agreement is read one step later).
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["global_step"] == step + 2 == first[0]["step"] == first[1]["step"]
    assert checkpoint["callbacks"]["PreemptionCheckpoint"]["signal"] == signum
    # The window holds what the test is about: skips, a fallback (SIGUSR1: saved in its cooldown), and a rollback (SIGTERM:
    # the first after the resume, to a snapshot taken before it, which only the checkpoint holds).
    decisions = full[0]["callbacks"]["PrecisionFallback{'mode': 'global', 'patience': 2}"]["decisions"]
    assert [(d["step"], d["action"]) for d in decisions] == [(5, "fallback"), (9, "restore")]
    events = full[0]["callbacks"]["ScaleCheckpoint"]["events"]
    assert [(e["step"], e["action"], e["restored_step"]) for e in events] == [(10, "rollback", 9)]
    assert full[0]["plugin"]["overflow_count"] == 3
    delta = max_delta(full, first, resumed)
    assert delta == {"loss": 0.0, "weights": 0.0, "steps_compared": 2 * max_steps, "state_equal": True}


# ------------------------------------------------------------------------------------------- atomic writing
class KillDuringWrite(pl.plugins.io.TorchCheckpointIO):
    """Writes the first bytes of the checkpoint, then the process gets SIGKILL (a real kill in mid-write)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04 partial")
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)


def _single(ckpt_dir: Path, max_steps: int, extra: list, ckpt_path=None, io=None, exit=False) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, plugins=[plugin(), *([io] if io else [])],
        callbacks=[*callbacks(), PreemptionCheckpoint(ckpt_dir, exit=exit), *extra], max_steps=max_steps,
        enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False,
    )
    trainer.fit(PreemptModule(**FAULTS), ckpt_path=ckpt_path)
    return trainer


def _killed_mid_write(ckpt_dir: Path) -> None:
    torch.set_num_threads(1)
    _single(ckpt_dir, 12, [SignalAt(6, signal.SIGTERM, rank=0)], ckpt_path=ckpt_dir / "preemption.ckpt",
            io=KillDuringWrite())


def _exits(ckpt_dir: Path) -> None:
    torch.set_num_threads(1)
    _single(ckpt_dir, 8, [SignalAt(2, signal.SIGUSR1, rank=0)], exit=True)


def test_a_kill_while_writing_leaves_the_previous_checkpoint_loadable(tmp_path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    trainer = _single(ckpt_dir, 8, [SignalAt(3, signal.SIGTERM, rank=0)])
    path = ckpt_dir / "preemption.ckpt"
    assert trainer.global_step == 4 and torch.load(path, weights_only=True)["global_step"] == 4
    before = path.read_bytes()
    # The resumed run is preempted again and killed (SIGKILL) in the middle of writing the next checkpoint.
    child = multiprocessing.get_context("fork").Process(target=_killed_mid_write, args=(ckpt_dir,))
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL
    assert (ckpt_dir / ".preemption.ckpt.tmp").read_bytes() == b"PK\x03\x04 partial"  # it did die mid-write
    assert path.read_bytes() == before
    assert torch.load(path, weights_only=True)["global_step"] == 4
    resumed = _single(ckpt_dir, 6, [], ckpt_path=path)  # and it resumes
    assert resumed.global_step == 6


def test_a_failed_write_removes_its_temporary_file(tmp_path) -> None:
    path = tmp_path / "x.ckpt"
    atomic_save(lambda tmp: torch.save({"v": 1}, tmp), path)

    def fail(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_save(fail, path)
    assert torch.load(path, weights_only=True) == {"v": 1} and sorted(os.listdir(tmp_path)) == ["x.ckpt"]


def test_exit_leaves_with_the_signals_conventional_status(tmp_path) -> None:
    child = multiprocessing.get_context("fork").Process(target=_exits, args=(tmp_path,))
    child.start()
    child.join(120)
    assert child.exitcode == 128 + signal.SIGUSR1
    assert torch.load(tmp_path / "preemption.ckpt", weights_only=True)["global_step"] == 3

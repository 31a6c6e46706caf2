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

from lit_mpstable import StablePrecision
from lit_mpstable.app.preemption_demo import (
    FAULTS,
    PreemptModule,
    SignalAt,
    callbacks,
    max_delta,
    plugin,
    preempted_and_resumed,
    run,
)
from lit_mpstable.callbacks._common import STEP_HOOKS
from lit_mpstable.callbacks.preemption import PreemptionCheckpoint, atomic_save

# The scenario (a 16-mixed run with every callback and scripted faults, preempted and resumed) lives in
# lit_mpstable.app.preemption_demo, where bench/preemption_continuation.py runs it too.

# ------------------------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"signals": ()}, ValueError, "at least one signal"),
    ({"signals": ("SIGTERM", "SIGTERM")}, ValueError, "each once"),
    ({"signals": ("SIGKILL",)}, ValueError, "SIGKILL cannot be caught"),
    ({"signals": ("SIGNOPE",)}, ValueError, "'SIGNOPE' is not a signal"),
    ({"signals": "SIGTERM"}, TypeError, "sequence of signals"),
    ({"signals": (1.5,)}, TypeError, "got float"),
    ({"exit": "yes"}, TypeError, "exit='yes'"),
    ({"dirpath": 3}, TypeError, "dirpath=3"),
    ({"filename": "a/b.ckpt"}, ValueError, "plain file name"),
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
        os.kill(os.getpid(), signal.SIGUSR1)
        # Noted, and held for the handler before ours until the checkpoint (here: the end of the fit), once.
        assert cb._received == signal.SIGUSR1 and seen == []
        cb.teardown(trainer, None, "fit")
        assert seen == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGUSR1) is not cb._handle
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] * 2
        # A fit that ends by an exception: Lightning's teardown re-installs, after ours, the handler it found (ours).
        cb.setup(trainer, None, "fit")
        cb.on_exception(trainer, None, RuntimeError())
        signal.signal(signal.SIGUSR1, cb._handle)
        os.kill(os.getpid(), signal.SIGUSR1)  # handed on, and the previous handler is back
        assert seen == [signal.SIGUSR1] * 3 and signal.getsignal(signal.SIGUSR1) is not cb._handle
    finally:
        signal.signal(signal.SIGUSR1, previous)


# --------------------------------------------------------------------------------------------- continuation
@pytest.mark.slow
# SIGTERM: saved mid-epoch (4 batches an epoch per rank); SIGUSR1: saved at the end of an epoch, in a fallback's
# cooldown.
@pytest.mark.parametrize(("step", "signum"), [(8, signal.SIGTERM), (6, signal.SIGUSR1)])
def test_resumed_run_equals_the_uninterrupted_one(tmp_path, step, signum) -> None:
    max_steps = 16
    full = run(tmp_path / "full", max_steps)
    first, resumed, path = preempted_and_resumed(tmp_path, max_steps, step, signum)
    # Delivered to rank 1 only; both stop at the next boundary (the agreement is read one step later).
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["global_step"] == step + 2 == first[0]["step"] == first[1]["step"]
    assert checkpoint["callbacks"]["PreemptionCheckpoint"]["signal"] == signum
    # The window holds what the test is about: skips, a fallback (SIGUSR1: saved in its cooldown), and a rollback
    # (SIGTERM: the first after the resume, to a snapshot taken before it, which only the checkpoint holds).
    decisions = full[0]["callbacks"]["PrecisionFallback{'mode': 'global', 'patience': 2}"]["decisions"]
    assert [(d["step"], d["action"]) for d in decisions] == [(5, "fallback"), (9, "restore")]
    events = full[0]["callbacks"]["ScaleCheckpoint"]["events"]
    assert [(e["step"], e["action"], e["restored_step"]) for e in events] == [(10, "rollback", 9)]
    assert full[0]["plugin"]["overflow_count"] == 3
    delta = max_delta(full, first, resumed)
    assert delta == {"loss": 0.0, "weights": 0.0, "steps_compared": 2 * max_steps, "state_equal": True}


@pytest.mark.slow
@pytest.mark.parametrize(("step", "kwargs"), [(4, {}), (9, {}), (11, {"validate_every": 4}),
                                              (5, {"accumulate_grad_batches": 2})])
def test_one_process_with_a_shuffling_loader_resumes_exactly(tmp_path, step, kwargs) -> None:
    """shuffle=True without DDP is a RandomSampler: its order is drawn from the global RNG when the epoch's iterator
    starts. Saved mid-epoch in the process's first epoch (step 4: 8 batches an epoch), in a later one (step 9), at a
    step that also validates (12), and with gradient accumulation (2 batches a step: saved after batch 12)."""
    faults = {**FAULTS, "fault_rank": 0}
    full = run(tmp_path / "full", 14, faults=faults, devices=1, **kwargs)
    first, resumed, path = preempted_and_resumed(tmp_path, 14, step, signal.SIGTERM, 0, faults=faults, devices=1,
                                                 **kwargs)
    assert torch.load(path, weights_only=True)["global_step"] == step + 1
    assert max_delta(full, first, resumed) == {"loss": 0.0, "weights": 0.0, "steps_compared": 14, "state_equal": True}


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


def test_a_sharded_checkpoint_directory_replaces_the_previous_one(tmp_path) -> None:
    """FSDP2 writes a directory: it replaces the previous checkpoint (a directory, or a file) whole, nothing left beside
    it; a failed write leaves the previous one and removes its own (an IsADirectoryError and no checkpoint before)."""
    path = tmp_path / "preempted.ckpt"

    def shards(value: int, fail: bool = False):
        def write(tmp: Path) -> None:
            tmp.mkdir()
            for rank in (0, 1):
                torch.save({"v": value, "rank": rank}, tmp / f"__{rank}_0.distcp")
            if fail:
                raise OSError("disk full")
        return write

    atomic_save(lambda tmp: torch.save({"v": 0}, tmp), path)  # a file first
    atomic_save(shards(1), path)
    assert sorted(os.listdir(path)) == ["__0_0.distcp", "__1_0.distcp"]
    atomic_save(shards(2), path)
    assert torch.load(path / "__1_0.distcp", weights_only=True) == {"v": 2, "rank": 1}
    with pytest.raises(OSError, match="disk full"):
        atomic_save(shards(3, fail=True), path)
    assert torch.load(path / "__0_0.distcp", weights_only=True)["v"] == 2
    assert sorted(os.listdir(tmp_path)) == ["preempted.ckpt"]


def test_a_handler_left_by_an_earlier_fit_is_not_chained() -> None:
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
        first, second = PreemptionCheckpoint(signals=("SIGUSR1",)), PreemptionCheckpoint(signals=("SIGUSR1",))
        first.setup(trainer, None, "fit")
        first.on_exception(trainer, None, RuntimeError())
        signal.signal(signal.SIGUSR1, first._handle)  # what Lightning's teardown re-installs after an exception
        second.setup(trainer, None, "fit")
        assert second._previous[signal.SIGUSR1] is not first._handle  # the handler `first` had replaced instead
        os.kill(os.getpid(), signal.SIGUSR1)
        second.teardown(trainer, None, "fit")
        assert seen == [signal.SIGUSR1] and signal.getsignal(signal.SIGUSR1) is second._previous[signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_previous_handler_that_exits_runs_after_the_checkpoint(tmp_path) -> None:
    """A launcher's or library's SIGTERM handler that exits at once (Ray's driver installs one that persists after
    ray.shutdown) is handed the signal only after the checkpoint is written at the next step boundary."""
    path, seen = tmp_path / "ckpt" / "preemption.ckpt", []

    def exits(signum, frame):
        seen.append((signum, path.exists()))
        raise SystemExit(15)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    signal.signal(signal.SIGTERM, exits)
    try:
        with pytest.raises(SystemExit) as ended:
            _single(tmp_path / "ckpt", 8, [SignalAt(3, signal.SIGTERM, rank=0)])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert ended.value.code == 15 and seen == [(signal.SIGTERM, True)]
    assert torch.load(path, weights_only=True)["global_step"] == 4


def test_exit_leaves_with_the_signals_conventional_status(tmp_path) -> None:
    child = multiprocessing.get_context("fork").Process(target=_exits, args=(tmp_path,))
    child.start()
    child.join(120)
    assert child.exitcode == 128 + signal.SIGUSR1
    assert torch.load(tmp_path / "preemption.ckpt", weights_only=True)["global_step"] == 3


class SignalAtTrainEnd(pl.Callback):
    """Sends ``signum`` to its own process after the last step boundary (as during the final validation)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def on_train_end(self, trainer, pl_module) -> None:
        os.kill(os.getpid(), self.signum)


def _signalled_after_the_last_boundary(ckpt_dir: Path) -> None:
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what a fresh process has (pytest's may differ)
    _single(ckpt_dir, 3, [SignalAtTrainEnd(signal.SIGTERM)], exit=True)
    (ckpt_dir / "code_after_fit_ran").write_text("yes")


def _forks_two_ranks(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    run(tmp_path / "ranks", 8, [PreemptionCheckpoint(tmp_path / "ckpt"), SignalAt(2, signal.SIGTERM, rank=1)])


def test_a_forking_launcher_leaves_with_the_ranks_status(tmp_path) -> None:
    """Under ddp_fork (ddp_spawn alike) the ranks are child processes: the launching process, the one a scheduler
    waits on, exits with their 143 too, not 1 with torch's ProcessExitedException."""
    child = multiprocessing.get_context("fork").Process(target=_forks_two_ranks, args=(tmp_path,))
    child.start()
    child.join(120)
    assert child.exitcode == 128 + signal.SIGTERM
    assert torch.load(tmp_path / "ckpt" / "preemption.ckpt", weights_only=True)["global_step"] == 4


def test_a_signal_after_the_last_boundary_is_handed_on_not_swallowed(tmp_path) -> None:
    child = multiprocessing.get_context("fork").Process(target=_signalled_after_the_last_boundary, args=(tmp_path,))
    child.start()
    child.join(120)
    assert child.exitcode == 128 + signal.SIGTERM
    assert not (tmp_path / "code_after_fit_ran").exists()


# ------------------------------------------------------------------------------------------- state inventory
# Every attribute of the objects that make up the run's stability state, and where the preemption checkpoint holds
# it: ("plugin", key...) in checkpoint["StablePrecision"], ("callback", key) in the callback's own state, ("rank",
# key...) in PreemptionCheckpoint's per-rank entry, ("preempt", key...) in PreemptionCheckpoint's state; "walk": an
# object inventoried attribute by attribute itself. Anything else must be in NOT_STATE with the reason. A new
# attribute that is in neither fails the test: give it a checkpoint entry (its owner's state_dict) or a reason.
_CONFIG = "constructor argument or derived from one"
_SETUP = "bound or decided at setup from the model, strategy or trainer (rebuilt by the resumed run's setup)"
_ITER = "lives within one iteration; reset before the step boundary where the checkpoint is written"
_MSG = "a message shown once, or its count (no effect on the numerics or decisions)"
_LOGGED = "the names its last logging step logged, until Lightning's step results drop them (the next batch)"
_SEED = "the value a lazily created device tensor starts from; the tensor's value is in the checkpoint"
COVERED: dict[tuple[str, str], tuple] = {
    ("StablePrecision", "stepper"): ("walk",),
    ("PrecisionStepper", "precision"): ("plugin", "precision"),
    ("PrecisionStepper", "scaler"): ("walk",),
    ("PrecisionStepper", "policy"): ("walk",),
    ("PrecisionStepper", "layout"): ("walk",),
    ("PrecisionStepper", "observer"): ("walk",),
    ("PrecisionStepper", "master"): ("plugin", "masters"),
    ("PrecisionStepper", "compact"): ("plugin", "compact"),
    ("PrecisionStepper", "schedules"): ("plugin", "schedules"),
    ("PrecisionStepper", "step_count"): ("plugin", "step_count"),
    ("PrecisionStepper", "overflow_count"): ("plugin", "overflow_count"),
    ("PrecisionStepper", "skipped_steps"): ("plugin", "skipped_steps"),
    ("PrecisionStepper", "last_step_skipped"): ("plugin", "last_step_skipped"),
    ("PrecisionStepper", "stats"): ("rank", "plugin", "stats"),
    ("PrecisionStepper", "spike_guard"): ("plugin", "spike_guard"),  # SpikeGuard.state_dict(), {} without one
    ("PrecisionStepper", "fp8_budget"): ("plugin", "fp8_budget"),  # the probe's choice, {} before it or without
    ("PrecisionStepper", "growth"): ("plugin", "growth"),  # GrowthMonitor.state_dict(), {} without one
    ("PrecisionStepper", "counters"): ("walk",),
    ("PrecisionStepper", "iteration"): ("walk",),
    ("PrecisionStepper", "keeper"): ("plugin", "masters"),  # and "compact": the weight keeper's state_dict
    ("RunCounters", "step_count"): ("plugin", "step_count"),
    ("RunCounters", "overflow_count"): ("plugin", "overflow_count"),
    ("RunCounters", "skipped_steps"): ("plugin", "skipped_steps"),
    ("RunCounters", "last_step_skipped"): ("plugin", "last_step_skipped"),
    ("DynamicLossScaler", "_scale"): ("plugin", "scaler", "scale"),
    ("DynamicLossScaler", "_growth_factor"): ("plugin", "scaler", "growth_factor"),
    ("DynamicLossScaler", "_backoff_factor"): ("plugin", "scaler", "backoff_factor"),
    ("DynamicLossScaler", "_growth_interval"): ("plugin", "scaler", "growth_interval"),
    ("DynamicLossScaler", "_growth_tracker"): ("plugin", "scaler", "_growth_tracker"),
    ("DynamicLossScaler", "hysteresis"): ("plugin", "scaler", "hysteresis"),
    ("DynamicLossScaler", "_hysteresis_tracker"): ("plugin", "scaler", "_hysteresis_tracker"),
    ("DynamicLossScaler", "min_scale"): ("plugin", "scaler", "min_scale"),
    ("DynamicLossScaler", "max_scale"): ("plugin", "scaler", "max_scale"),
    ("DynamicLossScaler", "step_count"): ("plugin", "scaler", "step_count"),
    ("DynamicLossScaler", "_overflow_count"): ("plugin", "scaler", "overflow_count"),
    ("DynamicLossScaler", "_min_scale_hits"): ("plugin", "scaler", "min_scale_hits"),
    ("DynamicLossScaler", "last_step_skipped"): ("plugin", "last_step_skipped"),
    ("PrecisionLayout", "islands"): ("walk",),
    ("PrecisionLayout", "fp32"): ("plugin", "layout", "fp32"),
    ("PrecisionLayout", "fp8_off"): ("plugin", "layout", "fp8_off"),
    ("PrecisionLayout", "fp8_removed"): ("plugin", "layout", "fp8_removed"),
    ("PrecisionLayout", "fp32_modules"): ("plugin", "layout", "fp32_modules"),
    ("GradObserver", "telemetry"): ("walk",),
    ("GradObserver", "tracer"): ("rank", "plugin", "tracer_armed"),
    ("OpPolicy", "choices"): ("plugin", "op_policy"),
    ("OverflowMonitor", "windowed"): ("callback", "counts"),
    ("OverflowMonitor", "above"): ("callback", "above"),
    ("OverflowMonitor", "blamed"): ("callback", "blamed"),
    ("PrecisionFallback", "grad_error_runs"): ("callback", "grad_error_runs"),
    ("PrecisionFallback", "last_probe_step"): ("callback", "last_probe_step"),
    ("PrecisionFallback", "overflow_run"): ("callback", "overflow_run"),
    ("PrecisionFallback", "nonfinite_run"): ("callback", "nonfinite_run"),
    ("PrecisionFallback", "recent"): ("callback", "recent"),
    ("PrecisionFallback", "decisions"): ("callback", "decisions"),
    ("PrecisionFallback", "blamed"): ("callback", "blamed"),
    ("PrecisionFallback", "_nonfinite"): ("callback", "previous_nonfinite"),
    ("ScaleCheckpoint", "rollbacks"): ("callback", "rollbacks"),
    ("ScaleCheckpoint", "skips"): ("callback", "skips"),
    ("ScaleCheckpoint", "events"): ("callback", "events"),
    ("ScaleCheckpoint", "lr_scale"): ("callback", "lr_scale"),
    ("ScaleCheckpoint", "_snapshot"): ("preempt", "scale_checkpoint", 0, "snapshot"),
    ("ScaleCheckpoint", "_layout"): ("preempt", "scale_checkpoint", 0, "layout"),
    ("AMPPreflight", "result"): ("callback", "result"),
    ("PrecisionProbe", "history"): ("callback", "history"),
    ("PrecisionProbe", "pending"): ("callback", "pending"),
}
_CALLBACK_COMMON = {"_plugin": _SETUP, "_warned_no_plugin": _MSG, "log": _SETUP, "log_dict": _SETUP,
                    "_global_step": _SETUP, "_log_every": _SETUP,
                    "_ladder": "the run's remedy ladder, kept on the plugin (StablePrecision.ladder)",
                    "state_key": "the checkpoint key, from the constructor's arguments (cached on first read)",
                    **dict.fromkeys(STEP_HOOKS, "None: a per-step hook the callback leaves to pl.Callback (Lightning"
                                                " skips it)")}
NOT_STATE: dict[str, dict[str, str]] = {
    "StablePrecision": {"_args": _CONFIG, "precision": _CONFIG, "master_weights": _CONFIG, "_warned": _MSG,
                        "_runaway": "a cache of the growth monitor's last answer (recomputed from its samples)",
                        "_notes_shown": _MSG,
                        "_budget_batch": "the first training batch, held until the probe's budget measures it (the"
                                         " choice itself is in fp8_budget)",
                        "_state_loaded": "whether this fit loaded the plugin's state (for the resume warning only)",
                        "_schedule_preloaded": "a loading checkpoint's schedule entry, between on_load_checkpoint and"
                                               " load_state_dict (None otherwise)",
                        "ladder": "the remedy ladder: faces and knobs set again by the callbacks at fit start; its"
                                  " decisions are history (each face's own remedies are in its state)",
                        "ladder_events": "the ladder's decisions (history, as the ladder)",
                        "fingerprint": "the numeric fingerprint's keeper: its pinned batch is in the plugin state's"
                                       " 'fingerprint' entry (added to each saved dict), the rest config or loads",
                        "findings": "the callbacks' latest results, measured anew after a resume (the probe step a"
                                    " fallback counted is PrecisionFallback's last_probe_step)",
                        "precision_schedule": "no schedule in this run (falsy runner, nothing to save); with one its"
                                              " state is the checkpoint's precision_schedule entry (test_schedule.py"
                                              " resumes a switched run)"},
    "PrecisionStepper": {
        "optimizer_state": _CONFIG,
        "owner": _CONFIG, "warnings": _MSG, "device": _SETUP, "master_mode": _CONFIG, "skip_nonfinite": _CONFIG,
        "fp8": _CONFIG, "op_policy": _CONFIG, "diagnose": _CONFIG, "fsdp2": _SETUP, "_fsdp_checked": _SETUP,
        "optimizers": "the run's optimizers (their state is Lightning's optimizer_states)", "_initial": _SETUP,
        "_checker": "the scaler itself (walked as such), or without one a fixed scale-1 check with per-iteration state",
        "_compact_grad": _ITER, "_norms": _ITER, "last_loss": _ITER, "_unscaled": _ITER, "_skip_requested": _ITER,
        "_input_ends": _ITER, "_input_flag": _ITER,
        "_pending": "state loaded before the model arrived, consumed at setup",
        "_layout_seen": "the layout of the last forward, for the compile note only",
        "_autocast": "the plain forward's autocast object, reused (built again from the device and dtype)",
        "_applied_by": "applied steps per optimizer in this process; the schedules' state is saved relative to it",
        "_data_fault": _ITER, "_overflowed": _ITER, "_stepped": _ITER, "_stepped_on": _ITER,
        "_spike": _ITER, "_zclipped": _ITER,
        "_converted_to": "the dtype the latest batch was converted to, for that batch's forwards only",
        "step_buffers": "copies of the module's buffers from before the step in progress (its own state: _ITER;"
                        " which buffers to copy is learned again from the first step)",
        "last_step_spiked": "why the last step was skipped, read right after it (its count: spike_guard's state)",
        "_loss_scaled": "whether this process has scaled a loss yet, for the call-order error only",
    },
    "RunCounters": {"applied_by": "applied steps per optimizer in this process; the schedules' state is saved"
                                  " relative to it"},
    "Iteration": {"unscaled": _ITER, "stepped": _ITER, "data_fault": _ITER, "overflowed": _ITER,
                  "stepped_on": _ITER, "checked": _ITER},
    "DynamicLossScaler": {
        "_device": _SETUP, "_enabled": _CONFIG, "_init_scale": _SEED, "_init_growth_tracker": _SEED,
        "_init_hysteresis_tracker": _SEED, "_init_overflow_count": _SEED, "_init_min_scale_hits": _SEED,
        "_per_optimizer_states": _ITER, "_host_found": _ITER, "allow_fp16_grads": _SETUP, "_min_scale_warned": _MSG,
        "checks_only": _CONFIG,
        "measures_norm": "set by the stepper: for a SpikeGuard at construction, else learned again at the first clip"
                         " by norm after a resume",
        "last_data_fault": _ITER,
        "_spare_flag": "the scale-1 check's flag its last step read as 0.0, reused as the next check's zero: " + _ITER,
        "_before_backoff": "the scale before this step's backoff, for triage to undo within the step: " + _ITER,
    },
    "PrecisionLayout": {"dtype": _CONFIG, "cast_parameters": _SETUP, "fp8": _CONFIG, "fp8_backend": _CONFIG,
                        "_user_islands": _CONFIG, "module": _SETUP, "device_type": _SETUP, "after_recast": _SETUP,
                        "find_ddp": _SETUP, "after_fp8_swap": _SETUP,
                        "_fp8_selected": "selected from the model at its first attach (FP8 state: layout.fp8)",
                        "_fp8_layers": "the selection minus fp8_removed (FP8 state: layout.fp8)"},
    "FP32Islands": {"specs": "the user's islands plus layout.fp32_modules", "device_type": _SETUP,
                    "output_dtype": _SETUP, "names": "specs resolved on the model", "_modules": "specs resolved",
                    "_handles": "hooks of the resolved islands"},
    "GradObserver": {"diagnose": _CONFIG, "_traced": _ITER,
                     "_idle": "the last tracer, detached and reset: armed again at the next overflow (its hooks)",
                     "quiet": "the steps until the next due one, from the step count; recomputed by the next call"},
    "GradTelemetry": {"every_n_steps": _CONFIG, "formats": _CONFIG, "per_module": _CONFIG,
                      "latest": "the last computation, reported through plugin.stats (in the checkpoint)"},
    "OpPolicy": {"dtype": _CONFIG, "margin": _CONFIG, "budget_s": _CONFIG, "_measure": _CONFIG, "requested": _CONFIG,
                 "steers": _CONFIG,
                 "measurements": "timings behind the choices (the choices are saved; the timings in stats)",
                 "step_cost": "timing report", "_recording": _ITER},
    "OverflowMonitor": {**_CALLBACK_COMMON,
                        "indicators": "off in this run; when on, its state is the callback's 'indicators' entry"
                                      " (test_indicator_monitor: a resumed run logs what an uninterrupted one does)",
                        "attention": _CONFIG, "attention_logits": "the attention recorder, built at fit start",
                        "latest_attention": "the last logging step's per-head readings (measured anew)",
                        "attention_warned": "warned-once names; with attention on, the callback's 'attention_warned'"
                                            " entry",
                        "growth_warned": _MSG, "lag_warned": _MSG, "window": _CONFIG, "warn_rate": _CONFIG,
                        "log_every_n_steps": _CONFIG,
                        "latest_measured": "the values last logged (report; measured again at the next due step)",
                        "_steps": "counter baseline, reset from the plugin's restored counters at train start",
                        "_logged": _LOGGED,
                        "_stats_step": "the telemetry step last looked at (a resumed run looks at its next one)"},
    "PrecisionFallback": {**_CALLBACK_COMMON, "on_growth": _CONFIG,
                          "_growth_moved": "layers moved for growth; the move itself is the layout's (fp32_modules)",
                          "patience": _CONFIG, "min_scale": _CONFIG, "mode": _CONFIG,
                          "cooldown": _CONFIG, "max_overflow_rate": _CONFIG, "nonfinite_loss_patience": _CONFIG,
                          "window": _CONFIG, "max_grad_error": _CONFIG, "grad_error_patience": _CONFIG,
                          "_steps": "counter baseline, reset from the plugin's restored counters at train start",
                          "state": "derived on load from cooldown_end and the last decision",
                          "retry_step": "saved as cooldown_end (-1: no retry pending)",
                          "_warned_fp32": _MSG, "_warned_data": _MSG, "_warned_fp32_modules": _MSG,
                          "_recent_sums": "the sums of recent (saved), rebuilt from it on load"},
    "ScaleCheckpoint": {**_CALLBACK_COMMON, "every_n_steps": _CONFIG, "max_rollbacks": _CONFIG,
                        "snapshot_device": _CONFIG, "restored_window": _CONFIG, "lr_factor": _CONFIG,
                        "_logged": _LOGGED,
                        "_groups": "the optimizers' param groups at the snapshot: a resume's run has the groups the"
                                   " restored snapshot was loaded into, and notes them at its first batch end"},
    "AMPPreflight": {**_CALLBACK_COMMON, "atol": _CONFIG, "rtol": _CONFIG, "action": _CONFIG, "forward_fn": _CONFIG,
                     "_pending": "the check is owed: set at train start, cleared on resume once `result` is loaded"},
    "PrecisionProbe": {**_CALLBACK_COMMON, "every_n_steps": _CONFIG, "raise_scale": _CONFIG, "loss_fn": _CONFIG,
                       "_capture": _ITER, "_inert": _SETUP, "_warned": _MSG},
}


def stability_objects(plugin: StablePrecision, cbs: list[pl.Callback]) -> list[Any]:
    """The plugin, everything the inventory walks into from it, and the callbacks; each object once."""
    found, todo = {}, [plugin, *cbs]
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in found:
            continue
        found[id(obj)] = obj
        todo += [getattr(obj, attr) for (cls, attr), where in COVERED.items()
                 if where == ("walk",) and cls == type(obj).__name__ and hasattr(obj, attr)]
    return list(found.values())


def unexplained(objects: list[Any]) -> list[str]:
    """``Class.attribute`` of every attribute neither in COVERED nor in NOT_STATE."""
    return sorted(f"{type(o).__name__}.{attr}" for o in objects for attr in vars(o)
                  if (type(o).__name__, attr) not in COVERED and attr not in NOT_STATE.get(type(o).__name__, {}))


def _at(checkpoint: dict[str, Any], state_key: str, where: tuple) -> Any:
    root, *path = where
    node = {"plugin": checkpoint["StablePrecision"], "callback": checkpoint["callbacks"].get(state_key),
            "preempt": checkpoint["callbacks"]["PreemptionCheckpoint"],
            "rank": checkpoint["callbacks"]["PreemptionCheckpoint"]["ranks"][0]}[root]
    for key in path:
        node = node[key]
    return node


def _plain_value(value: Any) -> Any:
    """A live value as the checkpoint writes it: 0-dim tensors as numbers, sequences as lists, dtypes by name."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (list, tuple)) or type(value).__name__ == "deque":
        return [_plain_value(v) for v in value]
    return value


@pytest.fixture(scope="module")
def preempted_single(tmp_path_factory):
    """One process, StablePrecision('16-mixed') and every callback, preempted after a skip, a fallback, a rollback."""
    ckpt_dir = tmp_path_factory.mktemp("inventory")
    plug, cbs = plugin(), callbacks()
    trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[plug], max_steps=16,
                         callbacks=[*cbs, PreemptionCheckpoint(ckpt_dir, exit=False), SignalAt(11, signal.SIGTERM, 0)],
                         enable_progress_bar=False, enable_model_summary=False, logger=False,
                         enable_checkpointing=False)
    trainer.fit(PreemptModule(**FAULTS, fault_rank=0))
    return plug, cbs, torch.load(ckpt_dir / "preemption.ckpt", weights_only=True)


def test_every_piece_of_stability_state_is_in_the_checkpoint(preempted_single) -> None:
    plug, cbs, checkpoint = preempted_single
    assert checkpoint["global_step"] == 12
    assert plug.skipped_steps >= 3 and cbs[1].decisions and cbs[2].rollbacks == 1  # the state is not trivial
    assert checkpoint["StablePrecision"]["fingerprint"]["checksums"]  # the numeric fingerprint rides along (#46)
    objects = stability_objects(plug, cbs)
    assert {type(o).__name__ for o in objects} == set(NOT_STATE)  # the walk reached every class it classifies
    missing = unexplained(objects)
    assert missing == [], "\n".join(missing)
    checked = 0
    for obj in objects:
        name = type(obj).__name__
        for attr, value in vars(obj).items():
            where = COVERED.get((name, attr))
            if where is None or where == ("walk",):
                continue
            saved = _at(checkpoint, getattr(obj, "state_key", ""), where)  # raises if the entry is missing
            live = _plain_value(value)
            if isinstance(live, (bool, int, float, str, list)) and not isinstance(saved, dict):
                assert live == saved, f"{name}.{attr}: live {live!r}, checkpoint {saved!r}"
                checked += 1
    assert checked >= 30


def test_the_inventory_fails_on_a_new_stateful_field(preempted_single) -> None:
    plug, cbs, _ = preempted_single
    plug.stepper.rescue_count = 0  # a new piece of state nobody saves
    cbs[2].cool_off = 3
    try:
        assert unexplained(stability_objects(plug, cbs)) == [
            "PrecisionStepper.rescue_count", "ScaleCheckpoint.cool_off",
        ]
    finally:
        del plug.stepper.rescue_count, cbs[2].cool_off

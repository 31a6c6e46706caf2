"""ScaleCheckpoint: inf/NaN weights or optimizer state roll back to the last-known-good snapshot, restored exactly;
spikes are SpikeGuard's (the old detector's arguments warn and do nothing)."""

from __future__ import annotations

import copy
import math
import os
import warnings

import pytest
import torch
from cb_helpers import PoisonModule, Recorder, fp16_scaler_plugin, quiet
from helpers import make_trainer
from trainer_pkg import FaultTriage, ScaleCheckpoint, StablePrecision, pl

from lit_mpstable import SpikeGuard


class _FullRecorder(Recorder):
    """Also records optimizer state, loss scale and the plugin's FP32 masters after every batch."""

    def __init__(self) -> None:
        super().__init__()
        self.optimizer_states: list[dict] = []
        self.scales: list[float] = []
        self.masters: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        super().on_train_batch_end(trainer, pl_module, *args)
        self.optimizer_states.append(copy.deepcopy(trainer.optimizers[0].state_dict()))
        self.scales.append(trainer.precision_plugin.loss_scale)
        self.masters.append(copy.deepcopy(trainer.precision_plugin.state_dict()["masters"]))


class _NanWeight(pl.Callback):
    """A NaN in fc1's weight at the start of each of ``steps`` (a bit flip in memory): the step's loss is NaN."""

    def __init__(self, *steps: int) -> None:
        self.steps = set(steps)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step in self.steps:
            with torch.no_grad():
                pl_module.model.fc1.weight.view(-1)[0] = float("nan")


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_the_old_spike_arguments_warn_once_naming_spikeguard_and_do_nothing() -> None:
    # The host-side spike detector is gone (SpikeGuard is the one detector): its arguments warn once and have no
    # effect. Before, ScaleCheckpoint(spike_patience=2) rolled back after 2 spikes within `window` steps.
    ScaleCheckpoint._warned_deprecated = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint = ScaleCheckpoint(every_n_steps=4, min_history=3, window=8, spike_patience=2, on_spike="undo")
        ScaleCheckpoint(spike_zscore=3.0)
    said = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert len(said) == 1 and "SpikeGuard" in said[0] and "spike_patience=2" in said[0] and "no effect" in said[0]
    module = PoisonModule(optimizer="adamw", lr=1e-2, loss_factor={5: 1e6, 7: 1e6})
    with quiet():
        make_trainer(StablePrecision("32-true"), max_steps=9, callbacks=[checkpoint]).fit(module)
    assert checkpoint.rollbacks == 0 and checkpoint.events == []


STEPS, POISON, EVERY = 48, 10, 4  # snapshot at step 8 (after batch 7); batch 9 grows the scale; batch 10 poisoned


def test_nan_weights_roll_back_exactly_and_training_recovers() -> None:
    def run(poison: tuple[int, ...]):
        torch.manual_seed(0)
        module = PoisonModule(optimizer="adamw", lr=3e-2, scheduler=True, n=128)
        checkpoint = ScaleCheckpoint(every_n_steps=EVERY)
        recorder = _FullRecorder()
        plugin = fp16_scaler_plugin(init_scale=2.0**8, growth_interval=3, max_scale=2.0**12)  # FP16 holds the grads
        with quiet():
            make_trainer(plugin, max_steps=STEPS, callbacks=[_NanWeight(*poison), checkpoint, recorder]).fit(module)
        return module, checkpoint, recorder, plugin

    clean, clean_checkpoint, _, _ = run(())
    module, checkpoint, recorder, plugin = run((POISON,))

    assert clean_checkpoint.rollbacks == 0 and checkpoint.rollbacks == 1
    event = checkpoint.events[0]
    assert event["step"] == POISON and event["restored_step"] == 8
    assert event["kind"] == "inf/NaN in the weights or optimizer state"
    (decided,) = [e for e in plugin.ladder_events if e["action"] != "skip"]
    assert (decided["step"], decided["fault"], decided["rung"], decided["restored_step"]) == (
        POISON, "nonfinite_state", "rollback", 8)
    # After batch 10 everything equals the snapshot taken after batch 7: weights, Adam moments, lr, loss scale.
    snap, after = 8 - 1, POISON
    _assert_same(recorder.weights[after], recorder.weights[snap])
    _assert_same(recorder.optimizer_states[after], recorder.optimizer_states[snap])
    assert recorder.lrs[after] == recorder.lrs[snap] and recorder.lrs[snap] != recorder.lrs[snap + 2]
    assert recorder.scales[snap] == 2.0**10 and recorder.scales[POISON - 1] == 2.0**11  # grew in between...
    assert recorder.scales[after] == 2.0**10  # ...and was restored
    assert recorder.skipped[POISON] and plugin.skipped_steps == 1 and plugin.overflow_count == 0  # history kept
    # Training went on to a normal loss: the last epoch's mean within 10% of the unpoisoned run's (0.14 vs 0.79 at
    # the start; the rollback cost 3 of 48 steps).
    last = sum(module.losses[-8:]) / 8
    assert last == pytest.approx(sum(clean.losses[-8:]) / 8, rel=0.1) and last < 0.25 * module.losses[0]


def test_rollbacks_restore_fp32_masters_of_bf16_true_twice() -> None:
    # The masters share storage with the optimizer's parameters, and optimizer.load_state_dict keeps the tensors it
    # is given: a snapshot not cloned on the way in and out would follow the live values, and the second rollback
    # to the same snapshot would restore what the steps in between wrote.
    module = PoisonModule(optimizer="adamw", lr=1e-2)
    recorder = _FullRecorder()
    checkpoint = ScaleCheckpoint(every_n_steps=4)
    with quiet():
        make_trainer(StablePrecision("bf16-true"), max_steps=9,
                     callbacks=[_NanWeight(5, 7), checkpoint, recorder]).fit(module)
    assert [e["restored_step"] for e in checkpoint.events] == [4, 4]
    assert not torch.equal(recorder.masters[6]["model.fc2.weight"], recorder.masters[3]["model.fc2.weight"])
    for after in (5, 7):
        _assert_same(recorder.masters[after], recorder.masters[3])
        _assert_same(recorder.weights[after], recorder.weights[3])
        _assert_same(recorder.optimizer_states[after], recorder.optimizer_states[3])
    assert module.model.fc2.weight.dtype == torch.bfloat16


class _CorruptWeights(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.model.fc1.weight[0, 0] = float("nan")


def test_non_finite_weights_roll_back_before_a_snapshot() -> None:
    module = PoisonModule()
    checkpoint = ScaleCheckpoint(every_n_steps=2)
    recorder = Recorder()
    with pytest.warns(UserWarning, match="ScaleCheckpoint at step 4: non-finite weights or optimizer state"):
        callbacks = [_CorruptWeights(4), checkpoint, recorder]
        trainer = make_trainer(StablePrecision("bf16-mixed"), max_steps=6, callbacks=callbacks)
        trainer.fit(module)
    assert checkpoint.events == [dict(step=4, kind="non-finite weights or optimizer state", loss=None, zscore=None,
                                      action="rollback", restored_step=2)]
    _assert_same(recorder.weights[3], recorder.weights[1])
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_too_many_rollbacks_raise_with_where_and_what_to_try() -> None:
    module = PoisonModule()
    checkpoint = ScaleCheckpoint(every_n_steps=2, max_rollbacks=2)
    with quiet(), pytest.raises(RuntimeError) as error:
        callbacks = [_NanWeight(5, 6, 7), checkpoint]
        make_trainer(StablePrecision("bf16-mixed"), max_steps=10, callbacks=callbacks).fit(module)
    message = str(error.value)
    assert "weights or optimizer state at step 7" in message and "after 2 rollbacks" in message
    assert "learning rate" in message and "max_rollbacks=2" in message
    assert checkpoint.rollbacks == 2


def test_a_rollback_never_undoes_a_precision_fallback() -> None:
    # The fallback at step 3 changes the precision layout, which triggers a fresh snapshot: the NaN weight at step 5
    # rolls back to step 3, in FP32, not to the BF16 snapshot of step 0.
    from trainer_pkg import PrecisionFallback

    from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler

    plugin = StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu"))
    fallback = PrecisionFallback(patience=2)
    checkpoint = ScaleCheckpoint(every_n_steps=100)
    module = PoisonModule(inf_grad_steps={1, 2})
    with quiet():
        make_trainer(plugin, max_steps=7, callbacks=[fallback, checkpoint, _NanWeight(5)]).fit(module)
    assert [d["step"] for d in fallback.decisions] == [3]
    assert [(e["step"], e["restored_step"]) for e in checkpoint.events] == [(5, 3)]
    assert plugin.compute_dtype == torch.float32 and plugin.overflow_count == 2


# --------------------------------------------------------------------------------- spikes: SpikeGuard's
def test_a_spike_is_spikeguards_to_skip_and_never_rolls_back() -> None:
    # The spike never reaches the weights, and nothing older is thrown away: SpikeGuard skips it on the device, the
    # ladder records one skip, and ScaleCheckpoint neither reads the loss nor restores its snapshot of step 8.
    torch.manual_seed(0)
    module = PoisonModule(optimizer="adamw", lr=3e-2, n=128, loss_factor={POISON: 1e6})
    plugin = StablePrecision("32-true", spike_guard=SpikeGuard(warmup=4, watch=["loss"]))
    checkpoint, recorder = ScaleCheckpoint(every_n_steps=EVERY), _FullRecorder()
    with quiet():
        make_trainer(plugin, max_steps=14, callbacks=[checkpoint, recorder]).fit(module)
    assert checkpoint.rollbacks == 0 and checkpoint.skips == 0 and checkpoint.events == []
    assert [(e["step"], e["fault"], e["action"]) for e in plugin.ladder_events] == [(POISON, "spike", "skip")]
    _assert_same(recorder.weights[POISON], recorder.weights[POISON - 1])  # the batch did not move the weights
    _assert_same(recorder.optimizer_states[POISON], recorder.optimizer_states[POISON - 1])
    assert not torch.equal(recorder.weights[POISON - 1]["model.fc2.weight"],
                           recorder.weights[EVERY * 2 - 1]["model.fc2.weight"])  # steps 8..9 kept, not undone


class _CorruptOptimizerState(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step == 3:
            state = trainer.optimizers[0].state[next(iter(trainer.optimizers[0].state))]
            state["exp_avg_sq"].view(-1)[0] = float("inf")


def test_non_finite_optimizer_state_rolls_back() -> None:
    checkpoint, recorder = ScaleCheckpoint(every_n_steps=2), _FullRecorder()
    with quiet():
        make_trainer(StablePrecision("bf16-mixed"), max_steps=5,
                     callbacks=[_CorruptOptimizerState(), checkpoint, recorder]).fit(PoisonModule(optimizer="adamw"))
    assert [(e["step"], e["kind"], e["restored_step"]) for e in checkpoint.events] == [
        (4, "non-finite weights or optimizer state", 2)]


class _CorruptFP8Moments(pl.Callback):
    """inf in the FP8 first moment of fc1's weight (its first block's amax; the store's own tensor) at the end of
    step 4, before ScaleCheckpoint's snapshot of it: the weights are still finite."""

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step == 4:
            moments = trainer.precision_plugin.state_dict()["masters"]["optimizer_state"]["moments"]
            moments["model.fc1.weight"][0]["tensors"]["amax"][0] = float("inf")


def test_non_finite_fp8_moments_roll_back_and_are_named() -> None:
    # The snapshot check reads the FP8 moments' E4M3 codes, which torch's isfinite and aminmax refuse: finding the
    # bad entry by name raised NotImplementedError instead of rolling back.
    checkpoint = ScaleCheckpoint(every_n_steps=2)
    plugin = StablePrecision("bf16-true", optimizer_state="fp8")
    with pytest.warns(UserWarning, match=r"plugin state masters\['optimizer_state'\]\['moments'\]"
                      r"\['model.fc1.weight'\]\[0\]\['tensors'\]\['amax'\]\)"):
        make_trainer(plugin, max_steps=5, callbacks=[_CorruptFP8Moments(), checkpoint]).fit(
            PoisonModule(optimizer="adamw"))
    assert [(e["step"], e["restored_step"]) for e in checkpoint.events] == [(4, 2)]
    moments = plugin.state_dict()["masters"]["optimizer_state"]["moments"]
    assert torch.isfinite(moments["model.fc1.weight"][0]["tensors"]["amax"]).all()  # step 2's, stepped on


def test_snapshots_live_off_the_accelerator_by_default() -> None:
    checkpoint = ScaleCheckpoint(every_n_steps=2)
    with quiet():
        make_trainer(StablePrecision("bf16-true"), max_steps=3, callbacks=[checkpoint]).fit(PoisonModule())
    saved = checkpoint.snapshot_state()
    assert saved is not None
    snapshot = saved["snapshot"]
    tensors = list(snapshot["model"].values()) + list(snapshot["plugin"]["masters"].values())
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    with pytest.raises(ValueError, match="snapshot_device='gpu'"):
        ScaleCheckpoint(snapshot_device="gpu")


@pytest.mark.gpu
def test_a_cpu_snapshot_adds_no_accelerator_memory() -> None:
    sizes = {}
    for device in ("cpu", "device"):
        torch.cuda.empty_cache()
        checkpoint = ScaleCheckpoint(every_n_steps=1, snapshot_device=device)
        module = PoisonModule(optimizer="adamw", n=256)
        trainer = pl.Trainer(accelerator="cuda", devices=1, max_steps=3, plugins=[StablePrecision("bf16-mixed")],
                             callbacks=[checkpoint], enable_progress_bar=False, logger=False,
                             enable_checkpointing=False, enable_model_summary=False)
        trainer.fit(module)
        sizes[device] = torch.cuda.memory_allocated()
        del trainer, checkpoint, module
    assert sizes["cpu"] < sizes["device"]


def test_after_a_rollback_the_plugin_and_its_scaler_count_the_same() -> None:
    # One owner per fact: the event counters are history, and a rollback restores neither the plugin's nor the
    # scaler's copy of them.
    plugin = fp16_scaler_plugin(init_scale=2.0**8)
    checkpoint = ScaleCheckpoint(every_n_steps=4)
    with quiet():
        make_trainer(plugin, max_steps=10, callbacks=[checkpoint, _NanWeight(7)]).fit(
            PoisonModule(inf_grad_steps={1, 6}))
    assert checkpoint.rollbacks == 1
    assert plugin.overflow_count == plugin.scaler.overflow_count == 2
    assert plugin.step_count == plugin.scaler.step_count


@pytest.mark.parametrize("where", ["weights", "optimizer state"])
def test_a_run_started_from_non_finite_state_is_refused_naming_it(where: str) -> None:
    """Resumed from NaN weights (or optimizer state), the first snapshot would be bad: rolling back to it three times
    and then advising a lower learning rate hides the cause."""

    class Corrupted(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:  # what a checkpoint with NaN weights restores
            if where == "weights":
                with torch.no_grad():
                    pl_module.model.fc2.weight.view(-1)[0] = float("nan")
            else:
                opt = trainer.optimizers[0]
                for p in pl_module.parameters():
                    opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p),
                                    "exp_avg_sq": torch.full_like(p, float("nan"))}

    checkpoint = ScaleCheckpoint(every_n_steps=2)
    with quiet(), pytest.raises(ValueError) as error:
        make_trainer(StablePrecision("bf16-mixed"), max_steps=8,
                     callbacks=[Corrupted(), checkpoint]).fit(PoisonModule(optimizer="adamw"))
    message = str(error.value)
    assert checkpoint.rollbacks == 0 and "learning rate" not in message
    assert "at train start" in message and "inf/NaN" in message
    assert ("model.fc2.weight" if where == "weights" else "exp_avg_sq") in message


# ------------------------------------------------------------------------------------- the restored-state rung
LOADED = 4  # the checkpoint of step 4 is written wrong; steps 1-3 are good


class _WrongLRAtSave(pl.Callback):
    """At the end of the optimizer steps ``steps``, before ModelCheckpoint writes them, the optimizer's learning rate
    is written wrong (x1e7; the run itself goes on with the right one): every number of such a checkpoint is finite and
    its fingerprint matches what was written, yet the third step after loading it has a non-finite loss
    (Megatron-LM#5281's shape: NaN three steps after a load)."""

    def __init__(self, *steps: int) -> None:
        self.steps, self.right = set(steps), None

    def on_train_batch_start(self, trainer, pl_module, *args) -> None:
        if self.right is not None:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = self.right
            self.right = None

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step in self.steps:
            self.right = trainer.optimizers[0].param_groups[0]["lr"]
            for group in trainer.optimizers[0].param_groups:
                group["lr"] *= 1e7


class _Losses(pl.Callback):
    """``(global_step before the step, loss)`` of every training batch, and the lr after it."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, float]] = []
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, *args) -> None:
        self.rows.append((self._step, float(outputs["loss"])))
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def _written_wrong(directory, seed: int, scheduler: bool = False, precision: str = "32-true") -> list:
    """Checkpoints of steps 1..LOADED of a seeded AdamW run, the last one with its learning rate written wrong."""
    from helpers import make_module

    torch.manual_seed(seed)
    module = make_module(optimizer="adamw", lr=1e-2, scheduler=scheduler)
    saver = pl.callbacks.ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=-1)
    with quiet():
        make_trainer(StablePrecision(precision), max_steps=LOADED, enable_checkpointing=True,
                     callbacks=[_WrongLRAtSave(LOADED), saver]).fit(module)
    return sorted(directory.glob("*.ckpt"), key=lambda p: int(p.stem.rpartition("=")[2]))


def _resume(path, seed: int, checkpoint, steps: int = LOADED + 6, scheduler: bool = False, warn: bool = False,
            precision: str = "32-true"):
    from helpers import make_module

    torch.manual_seed(seed)
    module = make_module(optimizer="adamw", lr=1e-2, scheduler=scheduler)
    losses, plugin = _Losses(), StablePrecision(precision)
    saver = pl.callbacks.ModelCheckpoint(dirpath=path.parent, every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer(plugin, max_steps=steps, enable_checkpointing=True, callbacks=[checkpoint, losses, saver])
    with warnings.catch_warnings():
        if warn:
            warnings.filterwarnings("ignore", message=r"^(?!ScaleCheckpoint)")
        else:
            warnings.simplefilter("ignore")
        trainer.fit(module, ckpt_path=path)
    return trainer, module, plugin, losses


@pytest.mark.parametrize("seed", range(5))
def test_a_checkpoint_that_goes_nan_three_steps_after_load_restores_the_one_before(seed: int, tmp_path) -> None:
    # Before: the bad step 6 rolled back to the snapshot of the loaded state (step 4), which went NaN again three steps
    # later, and again: "RuntimeError: ScaleCheckpoint: inf/NaN in the weights or optimizer state at step 15, after 3
    # rollbacks to the snapshot of step 4 (max_rollbacks=3)" (Megatron-LM#5281 looped 44 times).
    paths = _written_wrong(tmp_path, seed)
    checkpoint = ScaleCheckpoint(every_n_steps=50, restored_window=5)
    trainer, module, plugin, losses = _resume(paths[-1], seed, checkpoint)

    bad = [step for step, loss in losses.rows if not math.isfinite(loss)]
    assert bad == [LOADED + 2]  # the third step after the load, and only that one
    (event,) = [e for e in plugin.ladder_events if e["action"] != "skip"]
    assert (event["step"], event["fault"], event["rung"], event["action"]) == (
        LOADED + 2, "restored", "restore", "restore_previous")
    assert event["checkpoint"] == str(paths[-2]) and event["restored_step"] == LOADED - 1
    assert [(e["action"], e["checkpoint"], e["restored_step"]) for e in checkpoint.events] == [
        ("restore_previous", str(paths[-2]), LOADED - 1)]
    assert checkpoint.rollbacks == 1 and trainer.ckpt_path == str(paths[-2])
    # It resumed at the earlier checkpoint's step and trained on to max_steps: 7 more steps, all finite.
    assert [step for step, _ in losses.rows] == [4, 5, 6, 3, 4, 5, 6, 7, 8, 9]
    assert trainer.global_step == LOADED + 6 and plugin.step_count >= 6
    assert all(math.isfinite(loss) for _, loss in losses.rows[3:]) and losses.rows[-1][1] < losses.rows[3][1] * 1.5
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert losses.lrs[-1] == 1e-2  # the earlier file's learning rate, not the one written wrong
    state = trainer.optimizers[0].state[next(iter(trainer.optimizers[0].state))]
    assert int(state["step"]) == LOADED + 6  # the optimizer's own step count agrees with global_step


def test_restore_attempts_are_capped_then_the_run_stops_naming_why(tmp_path) -> None:
    # Every earlier file is written wrong too (each one's third step after the load is non-finite): one attempt is
    # allowed (max_rollbacks=1), the second bad step stops the run with the reason, no loop.
    from helpers import make_module

    torch.manual_seed(0)
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    with quiet():
        make_trainer(StablePrecision("32-true"), max_steps=LOADED, enable_checkpointing=True,
                     callbacks=[_WrongLRAtSave(1, 2, 3, 4), saver]).fit(make_module(optimizer="adamw", lr=1e-2))
    paths = sorted(tmp_path.glob("*.ckpt"), key=lambda p: int(p.stem.rpartition("=")[2]))
    checkpoint = ScaleCheckpoint(every_n_steps=50, restored_window=5, max_rollbacks=1)
    with pytest.warns(UserWarning, match=r"The run stops") as caught:
        trainer, module, plugin, losses = _resume(paths[-1], 0, checkpoint, steps=20, warn=True)
    said = " ".join(str(w.message) for w in caught)
    assert f"restored {paths[-2]} instead (global_step={LOADED - 1}; attempt 1 of max_rollbacks=1)" in said
    assert [e["action"] for e in checkpoint.events] == ["restore_previous", "stop"]
    stop = checkpoint.events[-1]
    assert "max_rollbacks=1" in stop["reason"] and str(paths[-2]) in stop["reason"]
    assert [(e["fault"], e["rung"]) for e in plugin.ladder_events if e["action"] != "skip"] == [
        ("restored", "restore"), ("restored", "stop")]
    assert trainer.global_step < 20  # stopped, not looping to max_steps


def test_with_no_earlier_checkpoint_that_passes_the_run_stops_naming_why(tmp_path) -> None:
    paths = _written_wrong(tmp_path, 0)
    for path in paths[:-1]:  # the earlier files are weights-only copies (as old as they were)
        saved, written = torch.load(path, weights_only=True), path.stat().st_mtime_ns
        torch.save({"state_dict": saved["state_dict"], "global_step": saved["global_step"]}, path)
        os.utime(path, ns=(written, written))
    checkpoint = ScaleCheckpoint(every_n_steps=50, restored_window=5)
    with pytest.warns(UserWarning, match=r"no earlier checkpoint passes among 3 .*weights-only"):
        trainer, _, plugin, _ = _resume(paths[-1], 0, checkpoint, warn=True)
    assert [e["action"] for e in checkpoint.events] == ["stop"] and trainer.global_step == LOADED + 3


class _StepLosses(pl.Callback):
    """Per rank, ``(global_step before the step, loss)`` of every batch, as ``events`` (what ``RankReport`` saves)."""

    def __init__(self) -> None:
        self.events: list[tuple[int, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, *args) -> None:
        self.events.append((self._step, float(outputs["loss"])))


@pytest.mark.slow
@pytest.mark.skipif(pl.__name__ != "lightning.pytorch", reason="the DDP fit helper (dist_helpers.fit_ddp) builds"
                    " lightning.pytorch Trainers; the pytorch_lightning tree runs this file without it")
def test_under_ddp_both_ranks_restore_the_same_checkpoint_and_finish_finite(tmp_path) -> None:
    # 2 processes (gloo, ddp_fork), each training on its half of the data from the checkpoint written wrong: the bad
    # step is classified alike (its flags agreed across ranks), both ranks restore the same earlier file, once, and
    # train on to max_steps with finite, equal weights.
    from dist_helpers import fit_ddp
    from helpers import make_module

    paths = _written_wrong(tmp_path / "ckpt", 0)
    torch.manual_seed(0)
    checkpoint = ScaleCheckpoint(every_n_steps=50, restored_window=5)
    rank0, rank1 = fit_ddp(make_module(optimizer="adamw", lr=1e-2), StablePrecision("32-true"),
                           [checkpoint, _StepLosses()], tmp_path / "out", max_steps=LOADED + 6, ckpt_path=paths[-1])
    for rank in (rank0, rank1):
        assert [(e["action"], e["checkpoint"], e["failed"], e["restored_step"])
                for e in rank["ScaleCheckpoint.events"]] == [("restore_previous", str(paths[-2]), str(paths[-1]),
                                                              LOADED - 1)]
        assert rank["ScaleCheckpoint.rollbacks"] == 1
        assert [(e["step"], e["fault"], e["rung"]) for e in rank["ladder_events"] if e["action"] != "skip"] == [
            (LOADED + 2, "restored", "restore")]
        rows = rank["_StepLosses.events"]
        assert [step for step, _ in rows] == [4, 5, 6, 3, 4, 5, 6, 7, 8, 9]  # resumed at step 3, on to max_steps
        assert all(math.isfinite(loss) for _, loss in rows[3:]) and not math.isfinite(rows[2][1])
        assert all(bool(torch.isfinite(p).all()) for p in rank["params"].values())
    assert rank0["ScaleCheckpoint.events"] == rank1["ScaleCheckpoint.events"]
    assert rank0["ladder_events"] == rank1["ladder_events"] and rank0["counters"] == rank1["counters"]
    assert all(torch.equal(rank0["params"][k], rank1["params"][k]) for k in rank0["params"])


def test_the_restored_window_and_lr_factor_are_checked() -> None:
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match=rf"ScaleCheckpoint\(restored_window={bad!r}\): must be an int >= 0"):
            ScaleCheckpoint(restored_window=bad)
    for bad in (0, 0.0, -0.5, 1.5, float("nan"), "0.5"):
        with pytest.raises(ValueError, match=r"ScaleCheckpoint\(lr_factor=.*\): must be a number in \(0, 1\]"):
            ScaleCheckpoint(lr_factor=bad)


def test_after_a_restore_plugin_optimizer_schedule_and_step_agree(tmp_path) -> None:
    # bf16-true with FP32 masters and a StepLR(gamma=0.5) stepped every optimizer step: after the restore the masters
    # are the weights, the schedule's step is global_step, and the rate is the schedule's at that step.
    paths = _written_wrong(tmp_path, 0, scheduler=True, precision="bf16-true")
    checkpoint = ScaleCheckpoint(every_n_steps=50, restored_window=5)
    trainer, module, plugin, losses = _resume(paths[-1], 0, checkpoint, scheduler=True, precision="bf16-true")
    assert [e["action"] for e in checkpoint.events] == ["restore_previous"]
    after = [loss for step, loss in losses.rows][[step for step, _ in losses.rows].index(LOADED - 1):]
    assert trainer.global_step == LOADED + 6 and len(after) == 7 and all(math.isfinite(loss) for loss in after)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == trainer.global_step and losses.lrs[-1] == pytest.approx(1e-2 * 0.5**(LOADED + 6))
    masters = plugin.state_dict()["masters"]
    for name, param in module.named_parameters():
        assert param.dtype == torch.bfloat16 and torch.equal(masters[name].bfloat16(), param.detach()), name


# ------------------------------------------------------------------------------------------ LR reduction on rollback
def _decay(epoch: int) -> float:
    return 1.0 / (1.0 + 0.25 * epoch)


class _LambdaModule(PoisonModule):
    """A LambdaLR computed from its base rate each step (lr = base * _decay(step)): a schedule that would undo a
    reduction of the param groups' rates alone."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _decay)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _Rates(pl.Callback):
    """``(scheduler step, lr)`` after every batch."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        self.rows.append((scheduler.last_epoch, trainer.optimizers[0].param_groups[0]["lr"]))


def test_a_rollback_multiplies_the_lr_by_lr_factor_and_the_schedule_and_a_resume_keep_it(tmp_path) -> None:
    # Before (no lr_factor): a rollback restored the snapshot's rates exactly, so the run went back into the same
    # divergence at the same rate (levanter#391).
    lr = 1e-2
    checkpoint, rates = ScaleCheckpoint(every_n_steps=2, lr_factor=0.5), _Rates()
    trainer = make_trainer(StablePrecision("32-true"), max_steps=8, callbacks=[_NanWeight(5), checkpoint, rates])
    with quiet():
        trainer.fit(_LambdaModule(optimizer="adamw", lr=lr))
    assert [(e["step"], e["restored_step"], e["lr_scale"]) for e in checkpoint.events] == [(5, 4, 0.5)]
    assert checkpoint.lr_scale == 0.5
    for batch, (epoch, rate) in enumerate(rates.rows):  # the schedule keeps the reduction: 0.5 x from the rollback
        assert rate == pytest.approx((0.5 if batch >= 5 else 1.0) * lr * _decay(epoch)), (batch, epoch, rate)
    assert trainer.lr_scheduler_configs[0].scheduler.base_lrs == [pytest.approx(0.5 * lr)]
    path = tmp_path / "after.ckpt"
    trainer.save_checkpoint(path)

    # A resume keeps it (the optimizer's rates, the schedule's base and lr_scale are in the checkpoint), and the next
    # rollback halves it again, from there.
    resumed, rates = ScaleCheckpoint(every_n_steps=2, lr_factor=0.5), _Rates()
    trainer = make_trainer(StablePrecision("32-true"), max_steps=14, callbacks=[_NanWeight(11), resumed, rates])
    with quiet():
        trainer.fit(_LambdaModule(optimizer="adamw", lr=lr), ckpt_path=path)
    assert resumed.events[-1]["lr_scale"] == 0.25 and resumed.lr_scale == 0.25 and resumed.rollbacks == 2
    for batch, (epoch, rate) in enumerate(rates.rows, start=8):
        assert rate == pytest.approx((0.25 if batch >= 11 else 0.5) * lr * _decay(epoch)), (batch, epoch, rate)
    state = ScaleCheckpoint()
    state.load_state_dict(torch.load(path, weights_only=True)["callbacks"]["ScaleCheckpoint"])
    assert state.lr_scale == 0.5
    old = {k: v for k, v in checkpoint.state_dict().items() if k != "lr_scale"}  # written before lr_factor existed
    state.load_state_dict(old)
    assert state.lr_scale == 1.0


class _Composed(PoisonModule):
    """A warmup handed over to a cosine (``SequentialLR``), or a ``CyclicLR``: schedules that put the full rate back
    from their children's or their own ``max_lrs``."""

    def __init__(self, kind: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.kind = kind

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if self.kind == "sequential":
            warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
            cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
            sched = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[6])
        else:
            sched = torch.optim.lr_scheduler.CyclicLR(opt, base_lr=self.lr / 10, max_lr=self.lr, step_size_up=4)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.mark.parametrize("kind", ["sequential", "cyclic"])
def test_lr_factor_holds_through_composed_and_cyclic_schedules(kind: str) -> None:
    # The rollback halved the group's rate and the outer scheduler's base_lrs, and the next step (CyclicLR's
    # max_lrs) or the milestone (SequentialLR's children) put the full rate back while the warning said x0.5.
    runs = {}
    for factor in (1.0, 0.5):
        checkpoint, rates = ScaleCheckpoint(every_n_steps=2, lr_factor=factor), _Rates()
        torch.manual_seed(0)
        with quiet():
            make_trainer(StablePrecision("32-true"), max_steps=10,
                         callbacks=[_NanWeight(3), checkpoint, rates]).fit(_Composed(kind, lr=1e-2))
        runs[factor] = [rate for _, rate in rates.rows]
    for batch in range(4, 10):  # after the rollback at step 3, every rate halved, past the milestone too
        assert runs[0.5][batch] == pytest.approx(0.5 * runs[1.0][batch]), (batch, runs)


class _GrowsAGroup(pl.Callback):
    """Adds the model's frozen last layer to the optimizer at step ``at`` (as BaseFinetuning's unfreezing does), and
    writes a NaN into Adam's state one step later."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        optimizer = trainer.optimizers[0]
        if trainer.global_step == self.at:
            for p in pl_module.model.fc3.parameters():
                p.requires_grad_(True)
            optimizer.add_param_group({"params": list(pl_module.model.fc3.parameters())})
        elif trainer.global_step == self.at + 1:
            optimizer.state[next(iter(optimizer.state))]["exp_avg_sq"].view(-1)[0] = float("nan")


class _FrozenHead(PoisonModule):
    def configure_optimizers(self):
        for p in self.model.fc3.parameters():
            p.requires_grad_(False)
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


@pytest.mark.parametrize("weights", [dict(), dict(master_weights="kahan")])
def test_a_rollback_after_the_optimizer_gained_a_param_group_restores_a_snapshot_it_can_load(weights: dict) -> None:
    # The snapshot (step 5) was taken before add_param_group (step 8): the rollback the NaN at step 9 asked for
    # crashed the fit ("loaded state dict has a different number of parameter groups"; Kahan: missing compensation
    # keys). A change of the groups takes a new snapshot.
    precision = "bf16-true" if weights else "32-true"
    checkpoint = ScaleCheckpoint(every_n_steps=5)
    torch.manual_seed(0)
    module = _FrozenHead(optimizer="adamw", lr=1e-2)
    with quiet():
        make_trainer(StablePrecision(precision, **weights), max_steps=12,
                     callbacks=[_GrowsAGroup(8), checkpoint]).fit(module)
    assert [(e["action"], e["restored_step"]) for e in checkpoint.events] == [("rollback", 9)]
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_lr_factor_one_changes_nothing() -> None:
    rates = {}
    for factor in (None, 1.0):
        checkpoint = ScaleCheckpoint(every_n_steps=2) if factor is None else ScaleCheckpoint(every_n_steps=2,
                                                                                             lr_factor=factor)
        rates[factor] = _Rates()
        torch.manual_seed(0)
        with quiet():
            make_trainer(StablePrecision("32-true"), max_steps=8,
                         callbacks=[_NanWeight(5), checkpoint, rates[factor]]).fit(_LambdaModule(optimizer="adamw"))
        assert checkpoint.lr_scale == 1.0 and "lr_scale" not in checkpoint.events[0]
    assert rates[None].rows == rates[1.0].rows


def test_a_spike_soon_after_a_load_restores_the_checkpoint_before(tmp_path) -> None:
    # SpikeGuard's statistics come back with the checkpoint (warm): a loss spike at the second step after the load is
    # the loaded state's (within restored_window=2): the file of step 7 is restored. The spike is keyed on step 9, so it
    # comes again after the restore, two steps after that load: outside the window, SpikeGuard's skip.
    def plugin():
        return StablePrecision("32-true", spike_guard=SpikeGuard(warmup=4, watch=["loss"]))

    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    torch.manual_seed(0)
    with quiet():
        make_trainer(plugin(), max_steps=8, enable_checkpointing=True, callbacks=[saver]).fit(
            PoisonModule(optimizer="adamw", lr=1e-2))
    paths = sorted(tmp_path.glob("*.ckpt"), key=lambda p: int(p.stem.rpartition("=")[2]))
    checkpoint, resumed = ScaleCheckpoint(every_n_steps=50, restored_window=2), plugin()
    trainer = make_trainer(resumed, max_steps=12, callbacks=[checkpoint])
    with quiet():
        trainer.fit(PoisonModule(optimizer="adamw", lr=1e-2, loss_factor={9: 1e6}), ckpt_path=paths[-1])
    event, skip = resumed.ladder_events
    assert (event["step"], event["fault"], event["rung"], event["checkpoint"], event["restored_step"]) == (
        9, "restored", "restore", str(paths[-2]), 7)
    assert (skip["step"], skip["fault"], skip["rung"]) == (9, "spike", "skip")
    assert trainer.global_step == 12 and checkpoint.rollbacks == 1


def test_a_skipped_bad_batch_in_the_growth_samples_is_no_reason_to_roll_back() -> None:
    # The growth monitor samples the forward of step 2, whose inf input is skipped as a data fault: its row holds an
    # inf amax (a layer with a non-finite amax is named: diagnostics). Before, the snapshot check took that row for
    # training state and rolled the healthy model back at every snapshot until max_rollbacks stopped the fit.
    module = PoisonModule(optimizer="adamw", lr=1e-2, inf_input_steps=(2,))
    checkpoint = ScaleCheckpoint(every_n_steps=2, max_rollbacks=1)
    plugin = StablePrecision("bf16-mixed", growth_every_n_steps=2)
    with quiet():
        make_trainer(plugin, max_steps=8, callbacks=[checkpoint]).fit(module)
    assert checkpoint.rollbacks == 0 and checkpoint.snapshot_step == 8
    assert [(e["step"], e["action"]) for e in plugin.ladder_events] == [(2, "skip")]
    assert not math.isfinite(plugin.state_dict()["growth"]["layers"]["model.fc1"]["rows"][:, 0].max().item())


@pytest.mark.parametrize("order", [("ema", "checkpoint", "triage"), ("checkpoint", "ema", "triage")])
def test_weight_averaging_before_a_rollback_is_refused_naming_the_order_that_works(order) -> None:
    # EMA averages the weights at batch end; listed before the callback that rolls a NaN back (ScaleCheckpoint, or
    # FaultTriage's "state" verdict), it took the NaN in first: the run "recovered", but its average, every later
    # checkpoint and the final model (EMA copies the average in at fit end) were NaN.
    made = {"ema": pl.callbacks.EMAWeightAveraging(), "checkpoint": ScaleCheckpoint(every_n_steps=2),
            "triage": FaultTriage()}
    trainer = make_trainer(StablePrecision("bf16-mixed"), max_steps=6,
                           callbacks=[_NanWeight(3), *(made[name] for name in order)])
    with quiet(), pytest.raises(ValueError, match="listed after EMAWeightAveraging") as refused:
        trainer.fit(PoisonModule(optimizer="adamw", lr=1e-2))
    assert "callbacks=[ScaleCheckpoint(...), FaultTriage(...), EMAWeightAveraging(...)]" in str(refused.value)


def test_weight_averaging_after_the_rollback_keeps_a_finite_average() -> None:
    module, ema = PoisonModule(optimizer="adamw", lr=1e-2), pl.callbacks.EMAWeightAveraging()
    checkpoint = ScaleCheckpoint(every_n_steps=2)
    with quiet():
        make_trainer(StablePrecision("bf16-mixed"), max_steps=6,
                     callbacks=[_NanWeight(3), checkpoint, FaultTriage(), ema]).fit(module)
    assert checkpoint.rollbacks == 1
    assert all(torch.isfinite(p).all() for p in module.parameters())  # the average, copied in at fit end


def _scheduled() -> StablePrecision:
    from lit_mpstable.fp8 import FP8Config, PrecisionSchedule

    return StablePrecision("32-true", fp8=FP8Config(recipe="nvfp4"), schedule=PrecisionSchedule(at=3, recipe="current"))


def test_the_restored_rung_takes_the_runs_own_file_written_before_a_schedule_switch(tmp_path) -> None:
    # Before: every file written before the switch at step 3 was refused ("checkpoint trained `model.fc2` in nvfp4,
    # this run has it in fp8 current"), compared with the live switched layers, and the rung stopped the run.
    from helpers import make_module

    torch.manual_seed(0)
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    with quiet():
        make_trainer(_scheduled(), max_steps=LOADED, enable_checkpointing=True,
                     callbacks=[_WrongLRAtSave(LOADED), saver]).fit(make_module(optimizer="adamw", lr=1e-2))
    paths = sorted(tmp_path.glob("*.ckpt"), key=lambda p: int(p.stem.rpartition("=")[2]))
    torch.manual_seed(0)
    plugin, checkpoint = _scheduled(), ScaleCheckpoint(every_n_steps=50, restored_window=5)
    module = make_module(optimizer="adamw", lr=1e-2)
    trainer = make_trainer(plugin, max_steps=LOADED + 4, callbacks=[checkpoint])
    with quiet():
        trainer.fit(module, ckpt_path=paths[-1])
    assert [(e["action"], e.get("checkpoint"), e.get("reason")) for e in checkpoint.events] == [
        ("restore_previous", str(paths[-2]), None)]
    assert trainer.global_step == LOADED + 4 and plugin.precision_schedule.applied == [3]
    assert module.model.fc2.fp8_config.spec.name == "current"
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_previous_takes_the_runs_own_file_written_before_a_schedule_switch(tmp_path) -> None:
    # on_fingerprint_mismatch="previous" compared each earlier file with the live, switched layers: with the files
    # after the switch at step 3 corrupt, every earlier one was refused ("checkpoint trained `model.fc2` in nvfp4,
    # this run has it in fp8 current") and the resume failed.
    from helpers import make_module

    from lit_mpstable.fp8 import FP8Config, PrecisionSchedule

    def plugin() -> StablePrecision:
        return StablePrecision("32-true", fp8=FP8Config(recipe="nvfp4"), on_fingerprint_mismatch="previous",
                               schedule=PrecisionSchedule(at=3, recipe="current"))

    torch.manual_seed(0)
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    with quiet():
        make_trainer(plugin(), max_steps=5, enable_checkpointing=True, callbacks=[saver]).fit(
            make_module(optimizer="adamw", lr=1e-2))
    paths = sorted(tmp_path.glob("*.ckpt"), key=lambda p: int(p.stem.rpartition("=")[2]))
    for path in paths[-2:]:  # the files of steps 4 and 5, written in the switched recipe, corrupt
        checkpoint = torch.load(path, weights_only=False)
        next(iter(checkpoint["state_dict"].values())).view(-1)[0] += 1
        torch.save(checkpoint, path)
    torch.manual_seed(0)
    resumed = plugin()
    with quiet():
        make_trainer(resumed, max_steps=7).fit(make_module(optimizer="adamw", lr=1e-2), ckpt_path=paths[-1])
    assert [(e["action"], e.get("fallback")) for e in resumed.fingerprint.events] == [
        ("previous", str(paths[2])), ("passed", None)]
    assert resumed.precision_schedule.applied == [3]

"""SpikeGuard wired into the step: a loss spike and a gradient spike are skipped like an overflow (no scale backoff,
no overflow counted, LR held), on a plain PrecisionStepper loop, the Trainer and Fabric, with no extra host read,
under torch.compile, on 2 DDP ranks, and resumed exactly mid-window."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import HostReads, TinyMLP, make_trainer, regression_data, spawn_ranks
from torch import nn

from lit_mpstable import SpikeGuard
from lit_mpstable.core.step.stepper import PrecisionStepper

STEPS, SPIKE_AT = 16, 12


def guard() -> SpikeGuard:
    return SpikeGuard(zscore=6.0, window=16, warmup=5)


def spike_(kind: str, loss: torch.Tensor) -> torch.Tensor:
    return loss * 1e4 if kind == "loss_spike" else loss


def grad_spike_(model: nn.Module) -> None:
    """FaultInjector's gradient spike, by hand: every 100th coordinate of fc1's weight gradient x1000 (scaled or
    not, the factor is the same)."""
    model.fc1.weight.grad.view(-1)[::100] *= 1e3


class Loop:
    """A plain PrecisionStepper loop over the regression data (batch 16, cycling), AdamW."""

    def __init__(self, precision="bf16-mixed", spike_guard=None, seed=0, compile=False, **kwargs) -> None:
        torch.manual_seed(seed)
        self.model = TinyMLP()
        self.stepper = PrecisionStepper(precision, device="cpu", spike_guard=spike_guard, **kwargs)
        self.stepper.setup_module(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=1, gamma=0.9)
        self.stepper.setup_optimizers(self.model, [self.opt], [self.sched])
        self.forward = torch.compile(self.model, backend="aot_eager") if compile else self.model
        self.x, self.y = regression_data(64)
        self.lrs: list[float] = []
        self.skipped: list[bool] = []

    def batch(self, i: int):
        j = (i % 4) * 16
        return self.x[j:j + 16], self.y[j:j + 16]

    def run_step(self, i: int, kind: str | None = None) -> None:
        x, y = self.batch(i)
        with self.stepper.forward_context():
            loss = nn.functional.mse_loss(self.forward(self.stepper.convert_input(x)).float(), y)
        if kind == "loss_spike":
            loss = loss * 1e4
        self.stepper.scale_loss(loss).backward()
        if kind == "grad_spike":
            grad_spike_(self.model)
        self.stepper.step(self.opt)
        self.opt.zero_grad()
        if not self.stepper.last_step_skipped:
            self.sched.step()
        self.lrs.append(self.opt.param_groups[0]["lr"])
        self.skipped.append(self.stepper.last_step_skipped)

    def run(self, faults: dict[int, str] = {}, batches=None) -> Loop:  # noqa: B006
        for i in batches if batches is not None else range(STEPS):
            self.run_step(i, faults.get(i))
        return self


@pytest.mark.parametrize("kind", ["loss_spike", "grad_spike"])
def test_plain_loop_skips_a_spike_like_a_step_never_seen(kind):
    run = Loop(spike_guard=guard()).run({SPIKE_AT: kind})
    assert run.skipped == [i == SPIKE_AT for i in range(STEPS)]
    assert run.stepper.last_step_skipped is False and int(run.stepper.spike_guard.spikes_skipped) == 1
    assert run.stepper.overflow_count == 0 and run.stepper.skipped_steps == 1
    assert run.lrs[SPIKE_AT] == run.lrs[SPIKE_AT - 1]  # LR held on the skipped step
    # The same optimizer that never saw the batch: equal weights, Adam step count and moments (bias correction).
    ref = Loop().run(batches=[i for i in range(STEPS) if i != SPIKE_AT])
    for p, q in zip(run.model.parameters(), ref.model.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(run.opt.state[p]["step"], ref.opt.state[q]["step"])
        assert torch.equal(run.opt.state[p]["exp_avg_sq"], ref.opt.state[q]["exp_avg_sq"])
    assert float(run.opt.state[next(run.model.parameters())]["step"]) == STEPS - 1


def test_spike_does_not_back_off_the_fp16_scale():
    # A gradient spike: a x1e4 loss would overflow FP16's backward itself (a true overflow, rightly backed off).
    run = Loop("16-mixed", spike_guard=guard()).run({SPIKE_AT: "grad_spike"})
    ref = Loop("16-mixed").run(batches=[i for i in range(STEPS) if i != SPIKE_AT])
    assert run.skipped[SPIKE_AT] and run.stepper.overflow_count == ref.stepper.overflow_count
    assert run.stepper.loss_scale == ref.stepper.loss_scale


def test_clean_run_is_unchanged_by_the_guard():
    run, ref = Loop(spike_guard=guard()).run(), Loop().run()
    assert not any(run.skipped)
    for p, q in zip(run.model.parameters(), ref.model.parameters()):
        assert torch.equal(p, q)


def test_discarded_batch_never_enters_the_statistics():
    run = Loop(spike_guard=guard()).run(batches=range(8))
    before = run.stepper.spike_guard.state_dict()
    x, y = run.batch(0)
    with run.stepper.forward_context():
        loss = nn.functional.mse_loss(run.model(x).float(), y)
    run.stepper.scale_loss(loss * 1e4).backward()
    run.stepper.skip_step()
    run.stepper.step(run.opt)
    after = run.stepper.spike_guard.state_dict()
    assert all(torch.equal(before[k], after[k]) if isinstance(before[k], torch.Tensor) else before[k] == after[k]
               for k in before)


@pytest.mark.parametrize("precision, masters", [("bf16-mixed", True), ("16-mixed", True), ("bf16-true", True),
                                                ("bf16-true", "kahan")])
def test_no_extra_host_read_on_clean_steps(precision, masters):
    reads = {}
    # A first run in the process pays one-time reads (the compact step's compile attempt): not what is compared.
    warm = Loop(precision, master_weights=masters).run(batches=range(8))
    with HostReads():
        warm.run_step(8)
    for on in (False, True):
        run = Loop(precision, spike_guard=guard() if on else None, master_weights=masters).run(batches=range(8))
        with HostReads() as seen:
            run.run_step(8)
        assert not run.skipped[-1]
        reads[on] = seen.ops
    assert reads[True] == reads[False]
    assert "_local_scalar_dense" in reads[False]  # the skip decision (and AdamW's own reads of its step counts)


def test_constructor_refuses_a_non_guard():
    with pytest.raises(TypeError, match="spike_guard=6.0"):
        PrecisionStepper("bf16-mixed", spike_guard=6.0)
    with pytest.raises(ValueError, match="skip_nonfinite"):
        PrecisionStepper("bf16-mixed", scaler=None, skip_nonfinite=False, spike_guard=SpikeGuard())


def test_state_resumes_mid_window_exactly():
    run = Loop(spike_guard=guard()).run({SPIKE_AT: "grad_spike"})
    state = copy.deepcopy(run.stepper.state_dict())
    assert state["spike_guard"]["grad_norm_count"] == STEPS - 1
    fresh = Loop(spike_guard=guard())
    fresh.stepper.load_state_dict(state)
    assert torch.equal(fresh.stepper.spike_guard.state_dict()["loss"], state["spike_guard"]["loss"])
    assert int(fresh.stepper.spike_guard.spikes_skipped) == 1
    assert Loop().stepper.state_dict()["spike_guard"] == {}
    legacy = {k: v for k, v in Loop().stepper.state_dict().items() if k != "spike_guard"}
    Loop(spike_guard=guard()).stepper.load_state_dict(legacy)  # a checkpoint from before SpikeGuard


@pytest.mark.slow
def test_compiled_model_decides_as_eager():
    faults = {10: "loss_spike", 13: "grad_spike"}
    eager = Loop(spike_guard=guard()).run(faults)
    compiled = Loop(spike_guard=guard(), compile=True).run(faults)
    assert compiled.skipped == eager.skipped == [i in faults for i in range(STEPS)]


# ------------------------------------------------------------------------------------------------ Trainer
def _fit(kind_at: dict[int, str], *, max_steps=STEPS, ckpt_path=None, callbacks=(), on=True, **trainer_kwargs):
    from cb_helpers import PoisonModule, Recorder, quiet
    from helpers import make_trainer
    from trainer_pkg import StablePrecision

    from lit_mpstable.faults import FaultInjector

    torch.manual_seed(0)
    module = PoisonModule(optimizer="adamw", scheduler=True, lr=0.01)
    plugin = StablePrecision("bf16-mixed", spike_guard=guard() if on else None)
    recorder = Recorder()
    injector = FaultInjector(dict(kind_at), module="model.fc1") if kind_at else None
    cbs = [c for c in (*callbacks, injector, recorder) if c is not None]  # before the injector's undo at batch end
    with quiet():
        trainer = make_trainer(plugin, callbacks=cbs, max_steps=max_steps, **trainer_kwargs)
        trainer.fit(module, ckpt_path=ckpt_path)
    return plugin, recorder, module, trainer


@pytest.mark.parametrize("kind", ["loss_spike", "grad_spike"])
def test_trainer_skips_a_spike(kind):
    from trainer_pkg import NAME

    if NAME != "lightning.pytorch":
        pytest.skip("FaultInjector is a lightning.pytorch callback")
    plugin, recorder, module, _ = _fit({SPIKE_AT: kind})
    assert recorder.skipped == [i == SPIKE_AT for i in range(STEPS)]
    assert int(plugin.spike_guard.spikes_skipped) == 1 and plugin.overflow_count == 0
    assert recorder.lrs[SPIKE_AT] == recorder.lrs[SPIKE_AT - 1]
    opt = module.trainer.optimizers[0]
    assert float(opt.state[next(module.parameters())]["step"]) == STEPS - 1


def test_overflow_monitor_logs_the_spike_metrics():
    from cb_helpers import PoisonModule  # noqa: F401  (Lightning imported)
    from trainer_pkg import NAME, pl

    from lit_mpstable.callbacks import OverflowMonitor

    if NAME != "lightning.pytorch":
        pytest.skip("FaultInjector is a lightning.pytorch callback")

    class Logged(pl.Callback):
        def __init__(self):
            self.metrics = {}

        def on_train_batch_end(self, trainer, *args):
            self.metrics.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("mp/")})

    logged = Logged()
    _fit({SPIKE_AT: "loss_spike"}, callbacks=[OverflowMonitor(log_every_n_steps=1), logged], log_every_n_steps=1)
    assert logged.metrics["mp/spikes_skipped"] == 1.0
    assert "mp/loss_zscore" in logged.metrics and "mp/grad_norm_zscore" in logged.metrics


def test_trainer_resume_mid_window_is_exact(tmp_path):
    from trainer_pkg import NAME, pl

    if NAME != "lightning.pytorch":
        pytest.skip("FaultInjector is a lightning.pytorch callback")
    faults = {6: "grad_spike", SPIKE_AT: "loss_spike"}
    full, rec_full, module_full, _ = _fit(faults)
    # Saved at an epoch's end (4 batches an epoch): the resumed loader starts where the full run's next epoch did.
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=8, save_top_k=-1)
    # The interrupted run gets the entries its 8 steps reach (FaultInjector refuses one that can never fire).
    _fit({step: kind for step, kind in faults.items() if step < 8}, max_steps=8, callbacks=[ckpt],
         enable_checkpointing=True)
    path = next(tmp_path.glob("*step=8*.ckpt"))
    resumed, rec, module, _ = _fit(faults, ckpt_path=str(path))
    assert rec.skipped == rec_full.skipped[8:]
    a, b = full.spike_guard.state_dict(), resumed.spike_guard.state_dict()
    assert all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)
    assert int(b["spikes_skipped"]) == 2
    for p, q in zip(module_full.parameters(), module.parameters()):
        assert torch.equal(p, q)


# ------------------------------------------------------------------------------------------------ Fabric
@pytest.mark.parametrize("kind", ["loss_spike", "grad_spike"])
def test_fabric_skips_a_spike(kind):
    from lightning.fabric import Fabric

    from lit_mpstable.fabric import StablePrecision

    torch.manual_seed(0)
    plugin = StablePrecision("bf16-mixed", spike_guard=guard())
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = TinyMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    x, y = regression_data(64)
    skipped = []
    for i in range(STEPS):
        j = (i % 4) * 16
        loss = nn.functional.mse_loss(model(x[j:j + 16]).float(), y[j:j + 16])
        fabric.backward(spike_(kind, loss) if i == SPIKE_AT else loss)
        if kind == "grad_spike" and i == SPIKE_AT:
            grad_spike_(model.module)
        opt.step()
        opt.zero_grad()
        skipped.append(plugin.last_step_skipped)
    assert skipped == [i == SPIKE_AT for i in range(STEPS)]
    assert int(plugin.spike_guard.spikes_skipped) == 1 and plugin.overflow_count == 0


# ------------------------------------------------------------------------------------------------ DDP
# A collective that one rank never joins fails after this instead of waiting 30 minutes; the whole run after DDP_RUN_S.
DDP_TIMEOUT_S, DDP_RUN_S = 60, 240


def _ddp_run(rank: int) -> dict:
    """A plain DDP loop through PrecisionStepper on one of two ranks; rank 1 alone gets a gradient spike at step 10
    (after DDP's all-reduce) and a loss spike at step 13 (its own loss only)."""
    torch.manual_seed(0)
    model = TinyMLP()
    stepper = PrecisionStepper("bf16-mixed", device="cpu", spike_guard=guard())
    stepper.setup_module(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepper.setup_optimizers(model, [opt])
    x, y = regression_data(64)
    x, y = x[rank::2], y[rank::2]
    skipped = []
    for i in range(STEPS):
        j = (i % 2) * 16
        with stepper.forward_context():
            loss = nn.functional.mse_loss(ddp(x[j:j + 16]).float(), y[j:j + 16])
        if rank == 1 and i == 13:
            loss = loss * 1e4
        stepper.scale_loss(loss).backward()
        if rank == 1 and i == 10:
            grad_spike_(model)
        stepper.step(opt)
        opt.zero_grad()
        skipped.append(stepper.last_step_skipped)
    return {"skipped": skipped, "spikes": int(stepper.spike_guard.spikes_skipped),
            "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def _ddp_worker(rank: int, init_file: str, out_dir: str) -> None:
    """Two gloo ranks run :func:`_ddp_run`. Its DDP wrapper is gone before the process group is destroyed: a DDP
    reducer that outlives the group's registration frees the gloo group itself, joining gloo's threads while holding
    the GIL that one of them needs to free the tensors of its last all-reduce (a hang at a rank's exit, seen in
    gdb)."""
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)  # as conftest does: a spawned process starts with the machine's default
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=DDP_TIMEOUT_S))
    try:
        torch.save(_ddp_run(rank), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _run_two_ranks(worker, tmp_path) -> None:
    """``worker(rank, init_file, out_dir)`` on 2 processes, rendezvous through a file of this test's own (no port).
    Spawned, not forked: this module compiles before (inductor's worker threads), and a fork could copy a lock another
    thread holds. A rank that has not finished after DDP_RUN_S is killed and the test fails, naming it."""
    spawn_ranks(worker, str(tmp_path / "init"), str(tmp_path), limit_s=DDP_RUN_S)


@pytest.mark.slow
def test_ddp_spike_on_one_rank_is_skipped_on_both(tmp_path):
    _run_two_ranks(_ddp_worker, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    expected = [i in (10, 13) for i in range(STEPS)]
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == expected
    assert ranks[0]["spikes"] == ranks[1]["spikes"] == 2
    for k, v in ranks[0]["weights"].items():
        assert torch.equal(v, ranks[1]["weights"][k])


def test_clip_zscore_clips_to_the_adaptive_threshold():
    # Only the loss is watched: a gradient spike is not skipped, it is clipped to mean + 2.5 std of the recent norms.
    zclip = SpikeGuard(window=16, warmup=5, watch=("loss",), clip_zscore=2.5)
    run = Loop(spike_guard=zclip).run(batches=range(SPIKE_AT))
    x, y = run.batch(SPIKE_AT)
    with run.stepper.forward_context():
        loss = nn.functional.mse_loss(run.model(x).float(), y)
    run.stepper.scale_loss(loss).backward()
    grad_spike_(run.model)
    run.stepper.unscale_(run.opt)
    threshold = zclip.clip_threshold()
    assert torch.isfinite(threshold)
    norm = run.stepper.clip_grad_norm_(run.opt, 1e9)  # the user's limit is far above: the adaptive one clips
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in run.model.parameters()]))
    assert norm > threshold and torch.allclose(clipped, threshold, rtol=1e-4)
    run.stepper.step(run.opt)
    assert not run.stepper.last_step_skipped


def test_fault_triage_replays_a_spike_and_keeps_it_out():
    from trainer_pkg import NAME

    from lit_mpstable.callbacks import FaultTriage

    if NAME != "lightning.pytorch":
        pytest.skip("FaultInjector is a lightning.pytorch callback")
    triage = FaultTriage()
    plugin, recorder, module, _ = _fit({SPIKE_AT: "loss_spike"}, callbacks=[triage])
    assert [e["step"] for e in triage.events] == [SPIKE_AT]
    # The injected spike comes back in every replay: the batch is judged bad and stays skipped.
    assert triage.events[0]["kind"] == "data"
    assert triage.events[0]["replays"][:2] == ["as_is:nonfinite", "fp32:nonfinite"]  # rejected: spikes again
    assert recorder.skipped[SPIKE_AT] and int(plugin.spike_guard.spikes_skipped) == 1
    assert float(module.trainer.optimizers[0].state[next(module.parameters())]["step"]) == STEPS - 1


def test_scale_checkpoint_leaves_detection_to_the_guard():
    from trainer_pkg import NAME

    from lit_mpstable.callbacks import ScaleCheckpoint

    if NAME != "lightning.pytorch":
        pytest.skip("FaultInjector is a lightning.pytorch callback")
    checkpoint = ScaleCheckpoint(every_n_steps=4)
    plugin, recorder, _, _ = _fit({SPIKE_AT: "loss_spike"}, callbacks=[checkpoint])
    # SpikeGuard is the one detector: ScaleCheckpoint skips and records nothing (it once counted the guard's skips and
    # kept its own losses); the ladder records the one decision, the guard's skip.
    assert checkpoint.events == [] and checkpoint.skips == 0 and checkpoint.rollbacks == 0
    assert [(e["step"], e["fault"], e["action"], e["by"]) for e in plugin.ladder_events] == [
        (SPIKE_AT, "spike", "skip", "ScaleCheckpoint")]
    assert plugin.ladder_events[0]["remaining"] == []  # no rung above a skip acts on a spike without FaultTriage
    assert recorder.skipped == [i == SPIKE_AT for i in range(STEPS)] and int(plugin.spike_guard.spikes_skipped) == 1


@pytest.mark.parametrize("faces, aside, watches", [
    (["AMPPreflight"], False, True),
    (["AMPPreflight", "ScaleCheckpoint"], False, False),  # ScaleCheckpoint watches every step's end: it asks for both
    (["AMPPreflight", "PrecisionFallback", "ScaleCheckpoint"], False, False),
    # PrecisionFallback may stand aside at its train start, after AMPPreflight's: AMPPreflight keeps watching.
    (["AMPPreflight", "PrecisionFallback"], False, True),
    (["AMPPreflight", "PrecisionFallback"], True, True),
    (["PrecisionFallback", "AMPPreflight"], True, True),  # stood aside (FSDP2 '*-true'): the next face decides
    (["PrecisionFallback", "AMPPreflight", "ScaleCheckpoint"], True, False),
])
def test_the_first_face_that_watches_names_the_decision_whoever_asks_first(monkeypatch, faces, aside, watches):
    # Each bad step is decided once, by the first face at the step's end; AMPPreflight's batch-end hook does nothing
    # else, so Lightning calls it only where no face after it surely watches, and the decision keeps its name.
    from cb_helpers import ActionNames
    from trainer_pkg import NAME, StablePrecision

    from lit_mpstable import callbacks as cbs

    if NAME != "lightning.pytorch":
        pytest.skip("FaultInjector is a lightning.pytorch callback")
    if aside:  # as FSDP2 with a '*-true' precision: PrecisionFallback stands aside at the train start
        monkeypatch.setattr(StablePrecision, "can_fallback", property(lambda self: False))

    callbacks = [getattr(cbs, face)() for face in faces]
    profiler = ActionNames()
    plugin, recorder, _, _ = _fit({SPIKE_AT: "loss_spike"}, callbacks=callbacks, profiler=profiler)
    first = next(face for face in faces if not (aside and face == "PrecisionFallback"))
    assert [(e["step"], e["fault"], e["action"], e["by"]) for e in plugin.ladder_events] == [
        (SPIKE_AT, "spike", "skip", first)]
    assert recorder.skipped == [i == SPIKE_AT for i in range(STEPS)]
    preflight = callbacks[faces.index("AMPPreflight")]
    assert profiler.names.count(f"[Callback]{preflight.state_key}.on_train_batch_end") == (STEPS if watches else 0)


@pytest.mark.parametrize("precision, masters", [("bf16-true", True), ("bf16-true", "kahan"), ("16-mixed", True),
                                                ("16-true", True)])
@pytest.mark.parametrize("kind", ["loss_spike", "grad_spike"])
def test_every_weight_keeper_skips_a_spike(precision, masters, kind):
    if (kind, precision) == ("grad_spike", "16-true"):
        pytest.skip("x1e3 on a scaled FP16 gradient overflows FP16 and its norm is inf, which judges nothing: a true"
                    " overflow, handled as one")
    # A loss spike in FP16 overflows the scaled gradients too; the spike explains the overflow: no backoff, no count.
    run = Loop(precision, spike_guard=guard(), master_weights=masters).run({SPIKE_AT: kind})
    assert run.skipped == [i == SPIKE_AT for i in range(STEPS)]
    assert int(run.stepper.spike_guard.spikes_skipped) == 1 and run.stepper.overflow_count == 0
    if precision.startswith("16"):  # the scale never backed off: that of the same run skipping the batch itself
        same = Loop(precision, spike_guard=guard(), master_weights=masters)
        for i in range(STEPS):
            if i == SPIKE_AT:
                same.stepper.skip_step()
            same.run_step(i)
        assert run.stepper.loss_scale == same.stepper.loss_scale


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_a_sparse_embedding_trains_under_the_guard_the_indicators_and_checkpoints(tmp_path, precision) -> None:
    # nn.Embedding(sparse=True) gives sparse COO gradients. The guard's gradient norm, SpikeScore's norm and the
    # checkpoint's pinned pass each took torch._foreach_norm over them, which has no sparse kernel: the fit crashed at
    # its first step. Their norms are now their coalesced values'.
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset
    from trainer_pkg import OverflowMonitor, StablePrecision, pl

    class Recommender(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(200, 8, sparse=True)
            self.head = nn.Linear(32, 1)

        def training_step(self, batch, batch_idx):
            tokens, target = batch
            return F.mse_loss(self.head(self.embedding(tokens).flatten(1)).squeeze(-1).float(), target)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    def fit(steps: int, ckpt_path=None) -> tuple:
        torch.manual_seed(0)
        data = DataLoader(TensorDataset(torch.randint(0, 200, (96, 4)), torch.randn(96)), batch_size=16)
        plugin = StablePrecision(precision, spike_guard=SpikeGuard(warmup=2))
        model = Recommender()
        trainer = make_trainer(plugin, max_steps=steps, default_root_dir=tmp_path, log_every_n_steps=2,
                               callbacks=[OverflowMonitor(indicators=True)], limit_val_batches=0)
        trainer.fit(model, data, ckpt_path=ckpt_path)
        return trainer, plugin, model

    trainer, plugin, model = fit(6)
    assert model.embedding.weight.grad is None or model.embedding.weight.grad.is_sparse
    assert plugin.step_count == 6 and plugin.skipped_steps <= 1  # FP16's first scale may overflow once
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert "mp/spike_score" in trainer.callback_metrics
    trainer.save_checkpoint(tmp_path / "six.ckpt")  # the pinned pass's gradient norm, over a sparse gradient
    checkpoint = torch.load(tmp_path / "six.ckpt", weights_only=False)
    pinned = checkpoint["StablePrecision"]["fingerprint"]["pinned"]
    assert pinned and math.isfinite(pinned["grad_norm"]) and pinned["grad_norm"] > 0
    resumed, plugin, _ = fit(8, ckpt_path=tmp_path / "six.ckpt")
    assert resumed.global_step == 8 and [e["action"] for e in plugin.fingerprint.events] == ["passed", "passed"]

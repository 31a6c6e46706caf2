"""PrecisionSchedule: formats of chosen FP8 layers and roles switched in process, at a step, at the LR decay or on a
trigger; checkpointed and validated; the plugin hooks (Trainer) and torch.compile at the switch."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lit_mpstable import StablePrecision
from lit_mpstable.fp8 import FP8Config, FP8Linear, PrecisionSchedule, ScheduleRunner, convert_to_fp8, recipe
from lit_mpstable.fp8.schedule import load_schedule_state, lr_decay_step


def _model(fp8: str = "nvfp4") -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("attn", nn.Linear(32, 32))
    model.add_module("act", nn.GELU())
    model.add_module("mlp", nn.Linear(32, 32))
    convert_to_fp8(model, FP8Config(recipe=fp8, keep_high_precision=[]))
    return model


def _warmup_cosine(total: int, warmup: int = 2, decay_from: int = 7):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if step < decay_from:
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * (step - decay_from) / (total - decay_from)))
    return factor


def _scheduler(factor=None, total: int = 10) -> torch.optim.lr_scheduler.LRScheduler:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    return torch.optim.lr_scheduler.LambdaLR(opt, factor or _warmup_cosine(total))


def test_switch_at_a_step_changes_only_the_chosen_roles_and_layers():
    model = _model()
    runner = ScheduleRunner(PrecisionSchedule(at=2, fprop="bf16", layers="mlp"))
    runner.bind(model, max_steps=5)
    assert runner.on_step_start(0) == [] and runner.on_step_start(1) == []
    assert model.mlp.fp8_config.spec.fprop == "nvfp4"
    lines = runner.on_step_start(2)
    assert len(lines) == 1 and "fprop->bf16" in lines[0]
    assert model.mlp.fp8_config.spec.formats == {"fprop": "bf16", "dgrad": "nvfp4", "wgrad": "nvfp4"}
    assert model.attn.fp8_config.spec.formats == {"fprop": "nvfp4", "dgrad": "nvfp4", "wgrad": "nvfp4"}
    assert runner.events[0]["step"] == 2 and runner.events[0]["layers"] == 1
    # The switched layer computes what a layer built with the switched recipe computes (a BF16 forward).
    x = torch.randn(4, 32)
    reference = FP8Linear(32, 32, config=FP8Config(recipe=recipe("nvfp4", fprop="bf16", name="ref")))
    reference.load_state_dict(model.mlp.state_dict())
    assert torch.equal(model.mlp(x), reference(x))
    assert not torch.equal(model.attn(x), nn.functional.linear(x, model.attn.weight, model.attn.bias))
    assert runner.on_step_start(3) == []  # applied once


def test_full_bf16_and_a_whole_recipe_switch_buffers_follow():
    model = _model("current")
    assert "sr_counter" not in model.mlp._buffers
    runner = ScheduleRunner([PrecisionSchedule(at=1, recipe="nvfp4"),
                             PrecisionSchedule(at=3, fprop="bf16", dgrad="bf16", wgrad="bf16")])
    runner.bind(model, max_steps=5)
    runner.on_step_start(1)
    assert model.mlp.fp8_config.spec.fprop == "nvfp4" and "sr_counter" in model.mlp._buffers
    model(torch.randn(4, 32)).sum().backward()
    assert model.mlp.fp8_state_dict()["sr_counter"].item() == 1
    runner.on_step_start(3)
    spec = model.mlp.fp8_config.spec
    assert spec.formats == {"fprop": "bf16", "dgrad": "bf16", "wgrad": "bf16"}
    assert spec.stochastic_rounding == () and spec.hadamard == ()  # dropped with the formats that had them
    assert model.mlp.fp8_state_dict() == {}


def test_lr_decay_is_the_first_step_below_the_peak():
    assert lr_decay_step(_scheduler(total=10)) == 8  # factor(7) is still 1.0; step 8 is the first below
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    assert lr_decay_step(torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)) == 1
    # The real optimizer's LR is untouched by the simulation.
    sched = _scheduler(total=10)
    lr_decay_step(sched)
    assert sched.optimizer.param_groups[0]["lr"] == pytest.approx(0.05) and sched.last_epoch == 0
    # Stepped per epoch: the epoch boundary in optimizer steps.
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    assert lr_decay_step(step_lr, interval="epoch", steps_per_epoch=5) == 15
    # Bound mid-run (a resume): the step is absolute.
    model, sched = _model(), _scheduler(total=10)
    for _ in range(4):
        sched.optimizer.step()
        sched.step()
    runner = ScheduleRunner(PrecisionSchedule(at="lr_decay", fprop="bf16"))
    runner.bind(model, [sched], max_steps=10, step=4)
    assert runner.steps == [8]


@pytest.mark.parametrize(("make", "match"), [
    (lambda: PrecisionSchedule(at=3, fprop="fp6"), "fprop='fp6'"),
    (lambda: PrecisionSchedule(at=3, recipe="nvfp8"), "nvfp8"),
    (lambda: PrecisionSchedule(at=3), "nothing to change"),
    (lambda: PrecisionSchedule(at=-1, fprop="bf16"), "at=-1"),
    (lambda: PrecisionSchedule(at="decay", fprop="bf16"), "at='decay'"),
    (lambda: PrecisionSchedule(at=3, fprop="bf16", layers=[""]), "layers="),
    (lambda: FP8Config(recipe="nvfp4", schedule="lr_decay"), r"FP8Config\(schedule='lr_decay'\)"),
])
def test_bad_milestones_are_refused_by_name(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_bindings_are_refused_by_name():
    model = _model()
    with pytest.raises(ValueError, match=r"\['\*\.mlp\.\*'\] match no FP8 layer; the FP8 layers are \['attn', 'mlp'\]"):
        ScheduleRunner(PrecisionSchedule(at=1, fprop="bf16", layers="*.mlp.*")).bind(model, max_steps=5)
    with pytest.raises(ValueError, match="step 5 is never reached: the run has max_steps=5"):
        ScheduleRunner(PrecisionSchedule(at=5, fprop="bf16")).bind(model, max_steps=5)
    with pytest.raises(ValueError, match="needs an LR scheduler"):
        ScheduleRunner(PrecisionSchedule(at="lr_decay", fprop="bf16")).bind(model, max_steps=5)
    constant = _scheduler(lambda step: 1.0)
    with pytest.raises(ValueError, match="never falls below its peak 0.1 within max_steps=50"):
        ScheduleRunner(PrecisionSchedule(at="lr_decay", fprop="bf16")).bind(model, [constant], max_steps=50)
    with pytest.raises(ValueError, match=r"never falls below its peak 0.1 within max_steps=8"):
        ScheduleRunner(PrecisionSchedule(at="lr_decay", fprop="bf16")).bind(model, [_scheduler(total=8)],
                                                                            max_steps=8)
    with pytest.raises(ValueError, match="'delayed' keeps one amax history"):
        ScheduleRunner(PrecisionSchedule(at=1, fprop="delayed")).bind(model, max_steps=5)
    with pytest.raises(ValueError, match="fp8 is None"):
        StablePrecision("bf16-mixed", schedule=PrecisionSchedule(at=1, fprop="bf16"))
    with pytest.raises(ValueError, match="two schedules"):
        StablePrecision("bf16-mixed", fp8=FP8Config(recipe="nvfp4", schedule=PrecisionSchedule(at=1, fprop="bf16")),
                        schedule=PrecisionSchedule(at=2, fprop="bf16"))


def test_trigger_fires_on_host_data_every_n_steps():
    seen = []

    def trigger(step, stats):
        seen.append(step)
        return stats.get("loss", 9.0) < 1.0

    model = _model()
    runner = ScheduleRunner(PrecisionSchedule(at=trigger, wgrad="bf16", every=2))
    runner.bind(model, max_steps=20)
    for step in range(5):
        runner.on_step_start(step, {"loss": 2.0})
    assert runner.applied == [None] and seen == [0, 2, 4]
    runner.on_step_start(5, {"loss": 0.5})  # not a checking step
    assert runner.applied == [None]
    runner.on_step_start(6, {"loss": 0.5})
    assert runner.applied == [6] and model.mlp.fp8_config.spec.wgrad == "bf16"
    assert runner.state_dict()["steps"] == [6]


def test_checkpoint_past_a_milestone_resumes_switched_and_another_schedule_is_named():
    schedule = PrecisionSchedule(at=2, fprop="bf16", dgrad="bf16", wgrad="bf16", layers=["attn"])
    model = _model()
    runner = ScheduleRunner(schedule)
    runner.bind(model, max_steps=5)
    for step in range(3):
        runner.on_step_start(step)
    state = {"precision_schedule": runner.state_dict(), "other": 1}
    fresh, resumed = _model(), ScheduleRunner(schedule)
    rest = load_schedule_state(resumed, state, fresh)  # before the layers' FP8 state: its keys follow the recipe
    assert rest == {"other": 1}
    assert fresh.attn.fp8_config.spec.formats == model.attn.fp8_config.spec.formats
    assert fresh.attn.fp8_state_dict().keys() == model.attn.fp8_state_dict().keys()
    resumed.bind(fresh, max_steps=5, step=3)
    assert resumed.on_step_start(3) == [] and fresh.attn.fp8_config.spec.name == model.attn.fp8_config.spec.name
    other = ScheduleRunner(PrecisionSchedule(at=3, fprop="bf16"))
    with pytest.raises(ValueError, match=r"written under the schedule \['at=2 layers=attn .*this run has \['at=3"):
        load_schedule_state(other, state, _model())
    with pytest.raises(ValueError, match="written without one"):
        load_schedule_state(ScheduleRunner(schedule), {"other": 1}, _model())
    with pytest.raises(ValueError, match="this run has none"):
        load_schedule_state(ScheduleRunner(None), state, _model())


@pytest.mark.slow
def test_compile_switch_recompiles_once_without_graph_breaks():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = _model()
    runner = ScheduleRunner(PrecisionSchedule(at=1, fprop="bf16"))
    runner.bind(model, max_steps=3)
    compiled = torch.compile(model, backend="aot_eager")
    counters.clear()
    x = torch.randn(16, 32)
    for step in range(3):
        runner.on_step_start(step)
        compiled(x).sum().backward()
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 2  # one graph per recipe: the switch recompiles once
    assert model.mlp.fp8_config.spec.fprop == "bf16"


class _LM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _plain()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(8, warmup=1, decay_from=3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _plain() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))


class _Formats(pl.Callback):
    def __init__(self) -> None:
        self.fprop: list[str] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.fprop.append(pl_module.net[2].fp8_config.spec.fprop)


def _fit(plugin: StablePrecision, steps: int = 8, ckpt: str | None = None, callbacks=()) -> pl.Trainer:
    data = torch.utils.data.TensorDataset(torch.randn(64, 32), torch.randn(64, 32))
    trainer = pl.Trainer(max_steps=steps, plugins=[plugin], accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=list(callbacks))
    trainer.fit(_LM(), torch.utils.data.DataLoader(data, batch_size=8), ckpt_path=ckpt)
    return trainer


def test_trainer_switches_at_lr_decay_and_resumes_switched(tmp_path):
    fp8 = FP8Config(recipe="nvfp4", keep_high_precision=[])
    schedule = PrecisionSchedule(at="lr_decay", fprop="bf16")
    plugin, formats = StablePrecision("bf16-mixed", fp8=fp8, schedule=schedule), _Formats()
    trainer = _fit(plugin, callbacks=[formats])
    assert plugin.precision_schedule.steps == [4]  # factor(3) = 1.0, factor(4) < 1
    assert formats.fprop == ["nvfp4"] * 4 + ["bf16"] * 4
    assert plugin.precision_schedule.events[0]["step"] == 4
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["StablePrecision"]["precision_schedule"]
    assert saved["applied"] == [4] and saved["steps"] == [4]
    again, formats = StablePrecision("bf16-mixed", fp8=FP8Config(recipe="nvfp4", keep_high_precision=[],
                                                                   schedule=schedule)), _Formats()
    _fit(again, steps=10, ckpt=str(path), callbacks=[formats])
    assert formats.fprop == ["bf16", "bf16"]
    other = StablePrecision("bf16-mixed", fp8=fp8, schedule=PrecisionSchedule(at=6, fprop="bf16"))
    with pytest.raises(ValueError, match="written under the schedule"):
        _fit(other, steps=10, ckpt=str(path))
    from lit_mpstable.app.report import schedule_timeline, write_report

    timeline = schedule_timeline(plugin)
    assert timeline == [{"step": 4, "kind": "precision", "what": "switched fprop to bf16 on 2 FP8 layer(s)",
                         "why": "PrecisionSchedule(at=lr_decay layers=* fprop=bf16)"}]
    text = write_report({"events": timeline}, tmp_path / "report").read_text()
    assert "step 4: switched fprop to bf16 on 2 FP8 layer(s): PrecisionSchedule(at=lr_decay" in text


def test_fabric_switches_at_a_step():
    from lightning.fabric import Fabric

    from lit_mpstable.fabric import StablePrecision as FabricPrecision

    plugin = FabricPrecision("bf16-mixed", fp8=FP8Config(recipe="nvfp4", keep_high_precision=[],
                                                         schedule=PrecisionSchedule(at=2, dgrad="bf16")))
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = _plain()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    seen = []
    for _ in range(4):
        loss = model(torch.randn(8, 32)).float().pow(2).mean()
        seen.append(model.module[2].fp8_config.spec.dgrad)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    assert seen == ["nvfp4", "nvfp4", "bf16", "bf16"]
    assert plugin.state_dict()["precision_schedule"]["applied"] == [2]


def _trigger_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        runner = ScheduleRunner(PrecisionSchedule(at=lambda step, stats: stats["rank"] == 1 and step >= 2,
                                                  fprop="bf16"))
        model = _model()
        runner.bind(model, max_steps=6)
        for step in range(4):
            runner.on_step_start(step, {"rank": rank})
        torch.save({"applied": runner.applied, "fprop": model.mlp.fp8_config.spec.fprop}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_trigger_on_one_rank_switches_every_rank_at_the_same_step(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_trigger_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="fork")
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == {"applied": [2], "fprop": "bf16"}


def test_fabric_resumes_past_a_milestone_with_the_fingerprint_checked(tmp_path):
    """Saved after the switch; a new process loads it: the layers are switched back before the fingerprint's manifest
    (each layer's recipe) is compared, and the run goes on in the switched format."""
    from lightning.fabric import Fabric

    from lit_mpstable.fabric import StablePrecision as FabricPrecision

    def run(load: bool) -> tuple[FabricPrecision, nn.Module]:
        plugin = FabricPrecision("bf16-mixed", fp8=FP8Config(recipe="nvfp4", keep_high_precision=[],
                                                             schedule=PrecisionSchedule(at=2, dgrad="bf16")))
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        net = _plain()
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        state = {"model": model, "optimizer": optimizer, "precision": plugin}
        if load:
            fabric.load(tmp_path / "fabric.ckpt", state)
        for _ in range(1 if load else 3):
            fabric.backward(model(torch.randn(8, 32)).float().pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
        if not load:
            fabric.save(tmp_path / "fabric.ckpt", state)
        return plugin, net

    run(load=False)
    plugin, net = run(load=True)
    assert [e["action"] for e in plugin.fingerprint.events] == ["passed", "passed"]
    assert net[2].fp8_config.spec.dgrad == "bf16" and plugin.state_dict()["precision_schedule"]["applied"] == [2]


class _FlipAt(pl.Callback):
    """A NaN written into a weight at the start of optimizer step ``step`` (a bit flip)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.net[0].weight.view(-1)[0] = float("nan")


@pytest.mark.parametrize("flip_at", [3, 6])  # before the switch at 4, and after it (the snapshot of 4 predates it)
def test_a_rollback_under_a_schedule_keeps_the_switched_formats(flip_at):
    from lit_mpstable.callbacks import ScaleCheckpoint

    fp8 = FP8Config(recipe="nvfp4", keep_high_precision=[])
    plugin = StablePrecision("bf16-mixed", fp8=fp8, schedule=PrecisionSchedule(at=4, fprop="bf16"))
    checkpoint, formats = ScaleCheckpoint(every_n_steps=2), _Formats()
    trainer = _fit(plugin, callbacks=[checkpoint, _FlipAt(flip_at), formats])
    assert checkpoint.rollbacks == 1 and trainer.global_step == 8
    assert all(p.isfinite().all() for p in trainer.lightning_module.parameters())
    assert formats.fprop[4:] == ["bf16"] * (len(formats.fprop) - 4) and formats.fprop[:4] == ["nvfp4"] * 4
    assert plugin.precision_schedule.applied == [4]


class _Recipes(pl.Callback):
    """The last layer's recipe at each step's end; ``fallback_at``/``restore_at``: a module fallback of it and the
    plugin's ``restore_precision()`` at those steps' ends (as PrecisionFallback or FaultTriage's verdict do)."""

    def __init__(self, fallback_at: int = -1, restore_at: int = -1) -> None:
        self.fallback_at, self.restore_at = fallback_at, restore_at
        self.names: list[str | None] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        layer = pl_module.net[2]
        self.names.append(layer.fp8_config.spec.name if hasattr(layer, "fp8_config") else None)
        if trainer.global_step == self.fallback_at:
            trainer.precision_plugin.fallback(["net.2"], reason="test")
        if trainer.global_step == self.restore_at:
            trainer.precision_plugin.restore_precision()


def test_a_milestone_skips_a_fallen_back_layer_and_a_restore_brings_it_back_switched():
    plugin = StablePrecision("bf16-mixed", fp8=FP8Config(recipe="nvfp4", keep_high_precision=[]),
                             schedule=PrecisionSchedule(at=3, recipe="current"))
    recipes = _Recipes(fallback_at=2, restore_at=5)
    trainer = _fit(plugin, callbacks=[recipes])
    assert trainer.global_step == 8 and plugin.precision_schedule.applied == [3]
    assert recipes.names == ["nvfp4", "nvfp4", None, None, None, "current", "current", "current"]
    assert trainer.lightning_module.net[0].fp8_config.spec.name == "current"


def test_a_rollback_to_a_snapshot_before_a_recipe_switch_loads_it_in_the_recipe_it_was_taken_in():
    """The snapshot of step 4 holds the NVFP4 layers' state (an SR counter); the switch to 'current' at 5 drops it.
    A NaN at 6 rolls back to that snapshot: its FP8 state is loaded into the layers put back in NVFP4 first, and the
    run goes on in 'current' (the milestone follows the step count, which a rollback keeps)."""
    from lit_mpstable.callbacks import ScaleCheckpoint

    plugin = StablePrecision("bf16-mixed", fp8=FP8Config(recipe="nvfp4", keep_high_precision=[]),
                             schedule=PrecisionSchedule(at=5, recipe="current"))
    checkpoint, recipes = ScaleCheckpoint(every_n_steps=4), _Recipes()
    trainer = _fit(plugin, callbacks=[checkpoint, _FlipAt(6), recipes])
    assert checkpoint.rollbacks == 1 and trainer.global_step == 8
    assert all(p.isfinite().all() for p in trainer.lightning_module.parameters())
    assert recipes.names == ["nvfp4"] * 5 + ["current"] * 3 and plugin.precision_schedule.applied == [5]

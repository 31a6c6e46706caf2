"""FaultInjector through a real Trainer on the CPU: each kind has its effect at its step and nowhere else."""

from __future__ import annotations

import pytest
import torch
from cb_helpers import PoisonModule, Recorder, quiet
from helpers import make_trainer, regression_data
from trainer_pkg import NAME, StablePrecision, pl

from lit_mpstable.faults import FaultInjector

pytestmark = pytest.mark.skipif(NAME != "lightning.pytorch", reason="FaultInjector is a lightning.pytorch callback")


class ReplayModule(PoisonModule):
    """Runs the forward twice per training step (a replay, as triage does) and records whether each was finite."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.finite: list[tuple[bool, bool]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        first, replay = self(x), self(x)
        self.finite.append((bool(first.isfinite().all()), bool(replay.isfinite().all())))
        return torch.nn.functional.mse_loss(first.float(), y)


class Watch(pl.Callback):
    """Records what Lightning saw: the loss of each batch and fc2's weight gradient before each optimizer step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters()})


def seeded(cls=PoisonModule, **kwargs):
    """The same initial weights on every call, so a faulted run can be compared with a clean one."""
    torch.manual_seed(0)
    return cls(**kwargs)


def fit(module, precision="32-true", injector=None, **trainer_kwargs):
    recorder, watch = Recorder(), Watch()
    callbacks = [c for c in (injector, recorder, watch) if c is not None]
    plugin = StablePrecision(precision)
    with quiet():
        make_trainer(plugin, callbacks=callbacks, **trainer_kwargs).fit(module)
    return plugin, recorder, watch


def test_nan_batch_skips_that_step_only_and_leaves_the_data():
    module = PoisonModule()
    injector = FaultInjector({1: "nan_batch"})
    plugin, recorder, _ = fit(module, injector=injector)
    assert recorder.skipped == [False, True, False, False]
    assert plugin.overflow_count == 1 and injector.injected == [(1, "nan_batch")]
    assert torch.equal(module.x, regression_data(64)[0])  # the batch was restored after its step


def test_transient_fires_on_the_first_execution_only():
    module = ReplayModule()
    injector = FaultInjector({2: "transient"})
    _, recorder, _ = fit(module, injector=injector)
    assert module.finite == [(True, True), (True, True), (False, True), (True, True)]  # the replay is clean
    assert recorder.skipped == [False, False, True, False]
    assert injector.injected == [(2, "transient")]
    assert not module.model.fc1._forward_hooks  # the default module (the first leaf) is unhooked after fit


def test_fp16_overflow_is_inf_in_fp16_and_exact_in_fp32():
    injector = FaultInjector({1: "fp16_overflow"}, module="model.fc2")
    _, recorder, _ = fit(seeded(), "16-mixed", injector)
    assert recorder.skipped == [False, True, False, False] and injector.injected == [(1, "fp16_overflow")]
    # The same numbers bit for bit in FP32 and BF16 (what an FP32 replay computes): the fault exists only in FP16's
    # range. Such a run refuses the entry at setup (test_a_schedule_that_can_never_fire_is_refused_at_setup).
    injector._armed, injector._step = "fp16_overflow", 1
    layer = torch.nn.Linear(16, 16).train()
    for dtype in (torch.float32, torch.bfloat16):
        output = 1e3 * torch.randn(8, 16).to(dtype)
        assert torch.equal(injector._forward_hook(layer, (), output), output)


def test_loss_spike_multiplies_the_returned_loss():
    module = PoisonModule()
    injector = FaultInjector({2: "loss_spike"})
    _, _, watch = fit(module, injector=injector)
    ratios = [seen / own for seen, own in zip(watch.losses, module.losses)]
    assert ratios[:2] == [1.0, 1.0] and ratios[2] == pytest.approx(1e4, rel=1e-6)
    assert injector.injected == [(2, "loss_spike")]
    assert "training_step" not in module.__dict__  # the wrapper is gone after fit


def test_loss_spike_factor_is_what_the_loss_is_multiplied_by():
    module = PoisonModule()
    _, _, watch = fit(module, injector=FaultInjector({1: "loss_spike"}, loss_spike_factor=100.0))
    ratios = [seen / own for seen, own in zip(watch.losses, module.losses)]
    assert ratios[0] == 1.0 and ratios[1] == pytest.approx(100.0, rel=1e-6)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_grad_spike_scales_some_coordinates_by_1e3(accumulate):
    # With gradient accumulation each micro-batch's contribution is scaled once: the step's gradient is x1e3 on the
    # chosen coordinates, not x1e6 (as multiplying the accumulated .grad after each backward would give).
    injector = FaultInjector({1: "grad_spike"}, module="model.fc2")
    kwargs = dict(accumulate_grad_batches=accumulate, max_steps=2)
    _, _, watch = fit(seeded(), injector=injector, **kwargs)
    _, _, clean = fit(seeded(), **kwargs)
    assert all(torch.equal(watch.grads[0][k], clean.grads[0][k]) for k in clean.grads[0])
    for name, grad in watch.grads[1].items():
        expected = clean.grads[1][name].clone()
        if name.startswith("model.fc2."):
            expected.view(-1)[::100] *= 1e3
        assert torch.allclose(grad, expected, rtol=1e-6, atol=0), name
    def norm(g):
        return torch.stack([t.norm() for t in g.values()]).norm()

    assert norm(watch.grads[1]) > 10 * norm(clean.grads[1])
    assert injector.injected == [(1, "grad_spike")]


def test_ranks_limit_where_faults_are_injected(monkeypatch):
    # Rank 0 of a run of two (the world size is all the setup check reads): rank 1 injects, rank 0 does not.
    monkeypatch.setattr(pl.Trainer, "world_size", property(lambda self: 2))
    injector = FaultInjector({1: "nan_batch"}, ranks=[1])
    _, recorder, _ = fit(PoisonModule(), injector=injector)
    assert recorder.skipped == [False] * 4 and injector.injected == []


def test_state_dict_round_trips():
    injector = FaultInjector({0: "transient", 1: "loss_spike"})
    fit(ReplayModule(), injector=injector)
    state = injector.state_dict()
    assert state == {"injected": [[0, "transient"], [1, "loss_spike"]], "transient_done": [0]}
    other = FaultInjector({0: "transient"})
    other.load_state_dict(state)
    assert other.injected == injector.injected and other.state_dict() == state
    with pytest.raises(KeyError, match="transient_done"):
        other.load_state_dict({"injected": []})


def test_two_injectors_in_one_trainer_keep_their_own_state(tmp_path):
    """Faults on different ranks need one injector each (``ranks`` is per injector): Lightning accepts two only with
    distinct state keys, and each one's state comes back to it from the checkpoint."""
    first, second = FaultInjector({1: "nan_batch"}, ranks=[0]), FaultInjector({2: "loss_spike"})
    plugin = StablePrecision("32-true")
    trainer = make_trainer(plugin, callbacks=[first, second])
    with quiet():
        trainer.fit(PoisonModule())
    trainer.save_checkpoint(tmp_path / "two.ckpt")
    saved = torch.load(tmp_path / "two.ckpt", weights_only=True)["callbacks"]
    assert first.state_key != second.state_key
    assert saved[first.state_key]["injected"] == [[1, "nan_batch"]]
    assert saved[second.state_key]["injected"] == [[2, "loss_spike"]]
    # The key follows the arguments, not the instance: a resumed run's injectors find their entries.
    assert FaultInjector({2: "loss_spike"}).state_key == second.state_key


@pytest.mark.parametrize(
    "args, kwargs, error, words",
    [
        (([1, "nan_batch"],), {}, TypeError, "schedule=[1, 'nan_batch']"),
        (({-1: "nan_batch"},), {}, ValueError, "step -1 must be >= 0"),
        (({"3": "nan_batch"},), {}, TypeError, "step '3' must be an int"),
        (({True: "nan_batch"},), {}, TypeError, "step True must be an int"),
        (({3: "bitflip"},), {}, ValueError, "kind 'bitflip' at step 3 is not one of ('transient', 'nan_batch'"),
        (({3: "transient"},), {"module": 3}, TypeError, "module=3"),
        (({3: "transient"},), {"ranks": "0"}, TypeError, "ranks='0'"),
        (({3: "transient"},), {"ranks": [-1]}, ValueError, "ranks=[-1]"),
        (({3: "loss_spike"},), {"loss_spike_factor": 1.0}, ValueError, "loss_spike_factor=1.0"),
        (({3: "loss_spike"},), {"loss_spike_factor": float("inf")}, ValueError, "loss_spike_factor=inf"),
        (({3: "loss_spike"},), {"loss_spike_factor": "100"}, TypeError, "loss_spike_factor='100'"),
    ],
)
def test_constructor_validates(args, kwargs, error, words):
    with pytest.raises(error) as info:
        FaultInjector(*args, **kwargs)
    assert words in str(info.value) and "FaultInjector(" in str(info.value)


def test_unknown_module_is_named_at_setup():
    with pytest.raises(ValueError, match=r"module='model\.nope'.*no such module.*'model\.fc1'"):
        fit(PoisonModule(), injector=FaultInjector({1: "transient"}, module="model.nope"))


class Blame(pl.Callback):
    """What the plugin said about each skipped step: its blamed modules and whether the batch held inf/NaN."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[str], bool]] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        plugin = trainer.precision_plugin
        if plugin.last_step_skipped:
            stats = plugin.stats
            self.seen.append((trainer.global_step - 1, list(stats["blamed_modules"]), bool(stats["nonfinite_input"])))


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_nan_batch_is_a_data_fault_no_layer_is_blamed(precision):
    # The NaN is a corrupted record: the plugin's input check must see it as it sees one from the data pipeline, so
    # no layer is blamed and PrecisionFallback counts no overflow (three NaN batches in a row moved the model to FP32).
    from lit_mpstable.callbacks import FaultTriage, PrecisionFallback

    blame, fallback, triage = Blame(), PrecisionFallback(), FaultTriage()
    plugin = StablePrecision(precision)
    with quiet():
        make_trainer(plugin, callbacks=[triage, FaultInjector({1: "nan_batch", 2: "nan_batch", 3: "nan_batch"}), blame,
                                        fallback], max_steps=5).fit(seeded())
    assert blame.seen == [(1, [], True), (2, [], True), (3, [], True)]
    assert [(e["kind"], e["blamed"]) for e in triage.events] == [("data", [])] * 3
    assert not plugin.fallback_active and plugin.islands.names == [] and fallback.decisions == []


class Crash(pl.Callback):
    """Raises before the optimizer step of one step: a fit that ends by an exception mid-step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("crash for the test")


def test_a_fit_that_raises_leaves_no_hook_and_faults_no_later_fit():
    module = PoisonModule()
    injector = FaultInjector({1: "loss_spike", 2: "grad_spike", 3: "transient"}, module="model.fc2")
    with quiet(), pytest.raises(RuntimeError, match="crash for the test"):
        make_trainer(StablePrecision("32-true"), callbacks=[injector, Crash(1)], max_steps=4).fit(module)
    fc2 = module.model.fc2
    assert "training_step" not in module.__dict__ and not fc2._forward_hooks
    assert not fc2.weight._backward_hooks and not fc2.bias._backward_hooks
    # The same module trained again without the injector: every loss is its own, none multiplied.
    module.losses.clear()
    _, _, watch = fit(module)
    assert [seen / own for seen, own in zip(watch.losses, module.losses)] == [1.0] * 4


class UnusedLayer(PoisonModule):
    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Linear(16, 16)  # never called in training_step


@pytest.mark.parametrize("schedule, kwargs, precision, words", [
    ({1: "nan_batch", 4: "transient"}, {}, "32-true", "entry 4: 'transient' can never fire: max_steps=4"),
    ({1: "fp16_overflow"}, {}, "32-true", "entry 1: 'fp16_overflow' can never fire: the precision is '32-true'"),
    ({1: "fp16_overflow"}, {}, "bf16-mixed", "the precision is 'bf16-mixed'"),
    ({1: "nan_batch"}, {"module": "model.nope"}, "32-true", "module='model.nope'"),
    ({1: "nan_batch"}, {"ranks": [1]}, "32-true", "ranks=[1]"),
])
def test_a_schedule_that_can_never_fire_is_refused_at_setup(schedule, kwargs, precision, words):
    module, steps = PoisonModule(), []
    injector = FaultInjector(schedule, **kwargs)
    with quiet(), pytest.raises(ValueError) as info:
        make_trainer(StablePrecision(precision), callbacks=[injector, Recorder()], max_steps=4).fit(module)
    assert words in str(info.value) and "FaultInjector" in str(info.value), str(info.value)
    assert module.losses == steps and "training_step" not in module.__dict__  # refused before any step


def test_a_fault_that_did_not_take_effect_is_an_error_at_its_step():
    # A module that exists but never runs in training: the transient fault armed at step 1 injects nothing.
    with quiet(), pytest.raises(RuntimeError, match=r"FaultInjector: schedule entry 1: 'transient' took no effect"):
        make_trainer(StablePrecision("32-true"), callbacks=[FaultInjector({1: "transient"}, module="unused")],
                     max_steps=3).fit(UnusedLayer())

"""PrecisionFallback: every trigger, module and global fallback, escalation, cooldown."""

from __future__ import annotations

import pytest
import torch
from cb_helpers import BlameFirstNonfinite, PoisonModule, Recorder, TiedLM, quiet
from helpers import make_trainer
from trainer_pkg import PrecisionFallback, StablePrecision, pl

from lit_mpstable.callbacks.precision_fallback import FallbackState, fallback_reason
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler

EVERY_STEP = set(range(100))


def _fp16_scaled(**kwargs) -> StablePrecision:
    # FP16 autocast with an explicit scaler (a scaler is taken in the FP16 precisions only): overflows come from
    # injected inf gradients, and a global fallback visibly changes compute_dtype.
    return StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu", **kwargs))


def test_fallback_reason_by_hand() -> None:
    quiet_args = dict(overflow_run=0, patience=3, loss_scale=None, min_scale=1.0, nonfinite_run=0,
                      nonfinite_patience=2, overflow_rate=None, max_overflow_rate=0.5, window=10)
    assert fallback_reason(**quiet_args) is None
    assert "3 consecutive steps" in fallback_reason(**{**quiet_args, "overflow_run": 3})
    assert "fell to 1" in fallback_reason(**{**quiet_args, "loss_scale": 1.0})
    assert fallback_reason(**{**quiet_args, "loss_scale": 2.0}) is None
    assert "non-finite on 2" in fallback_reason(**{**quiet_args, "nonfinite_run": 2})
    assert "60.0% of the last 10" in fallback_reason(**{**quiet_args, "overflow_rate": 0.6})
    assert fallback_reason(**{**quiet_args, "overflow_rate": 0.5}) is None


def test_module_mode_moves_exactly_the_blamed_layer_and_training_recovers() -> None:
    # Amplify computes x * 1e5 / 1e5: inf in FP16 on every step, harmless in FP32. The stand-in attribution names
    # the first module whose output is non-finite, as plugin.stats["blamed_modules"] will.
    module = PoisonModule(amplify=True, optimizer="adamw", lr=1e-2)
    plugin = StablePrecision("16-mixed")
    fallback = PrecisionFallback(patience=3, mode="module")
    recorder = Recorder()
    with quiet():
        make_trainer(plugin, max_steps=16, callbacks=[BlameFirstNonfinite(), fallback, recorder]).fit(module)
    assert plugin.islands.names == ["model.amp"] and plugin.compute_dtype == torch.float16
    (decision,) = fallback.decisions
    assert decision == dict(
        step=3, action="fallback", modules=["model.amp"], reason="3 consecutive steps overflowed (patience=3)",
        effect=decision["effect"],
    )
    assert "['model.amp'] now run in FP32" in decision["effect"]
    assert recorder.skipped == [True] * 3 + [False] * 13  # recovered from the next step on
    assert plugin.overflow_count == 3 and plugin.fallback_active
    clean = module.losses[3:]
    assert all(map(torch.isfinite, map(torch.tensor, clean))) and clean[-1] < 0.8 * clean[0]


def test_module_mode_with_real_telemetry() -> None:
    # The same run without the stand-in: the plugin's own telemetry must name the layer.
    module = PoisonModule(amplify=True)
    plugin = StablePrecision("16-mixed")
    fallback = PrecisionFallback(patience=3, mode="module")
    with quiet():
        make_trainer(plugin, max_steps=6, callbacks=[fallback]).fit(module)
    if not any(d["modules"] for d in fallback.decisions) and "blamed_modules" not in plugin.stats:
        pytest.skip("awaits telemetry: StablePrecision.stats holds no 'blamed_modules' yet")
    assert plugin.islands.names == ["model.amp"] and plugin.compute_dtype == torch.float16


def test_module_mode_escalates_when_the_blamed_layer_already_runs_in_fp32() -> None:
    # Amplify is fixed by the first (module) fallback, but inf gradients keep coming: an overflow storm.
    module = PoisonModule(amplify=True, inf_grad_steps=EVERY_STEP)
    plugin = StablePrecision("16-mixed")
    fallback = PrecisionFallback(patience=2, mode="module")
    with quiet():
        make_trainer(plugin, max_steps=6, callbacks=[BlameFirstNonfinite(), fallback]).fit(module)
    # The plugin's own attribution then names fc2 (its gradients get the injected inf): it moves too, and when the
    # storm goes on with every blamed layer in FP32, the run escalates globally.
    assert [(d["step"], d["modules"]) for d in fallback.decisions] == [
        (2, ["model.amp"]), (4, ["model.fc2"]), (6, None)
    ]
    assert "already run in FP32, so globally" in fallback.decisions[2]["reason"]
    assert plugin.compute_dtype == torch.float32


class _ForgetBlame(pl.Callback):
    """Simulates attribution that names nothing (e.g. only the root module): drops the plugin's verdict."""

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        trainer.precision_plugin.stats.pop("blamed_modules", None)


def test_module_mode_without_blamed_modules_falls_back_globally_and_says_why() -> None:
    plugin = _fp16_scaled()
    fallback = PrecisionFallback(patience=2, mode="module")
    expected = r"fallback at step 2: the whole model now computes in FP32 \(PrecisionFallback: .*names no blamed"
    with pytest.warns(UserWarning, match=expected):
        make_trainer(plugin, max_steps=3, callbacks=[_ForgetBlame(), fallback]).fit(
            PoisonModule(inf_grad_steps=EVERY_STEP)
        )
    assert fallback.decisions[0]["modules"] is None and plugin.compute_dtype == torch.float32


@pytest.mark.parametrize(
    "trigger, kwargs, faults, scaler, step, reason",
    [
        ("storm", dict(patience=4), dict(inf_grad_steps=EVERY_STEP), {}, 4, "4 consecutive steps overflowed"),
        ("scale", dict(patience=100, min_scale=2.0), dict(inf_grad_steps=EVERY_STEP), dict(init_scale=16.0), 3,
         "loss scale fell to 2"),
        ("rate", dict(patience=100, window=6, max_overflow_rate=0.3), dict(inf_grad_steps={1, 3, 5, 7, 9}), {}, 6,
         "50.0% of the last 6 steps"),
        ("nan-loss", dict(patience=100, nonfinite_loss_patience=2), dict(inf_input_steps=EVERY_STEP), None, 3,
         "non-finite on 2 consecutive steps"),
    ],
)
def test_global_mode_triggers(trigger: str, kwargs: dict, faults: dict, scaler, step: int, reason: str) -> None:
    plugin = StablePrecision("bf16-mixed") if scaler is None else _fp16_scaled(**scaler)
    fallback = PrecisionFallback(**kwargs)
    recorder = Recorder()
    with quiet():
        make_trainer(plugin, max_steps=8, callbacks=[fallback, recorder]).fit(PoisonModule(**faults))
    assert [d["step"] for d in fallback.decisions] == [step] and reason in fallback.decisions[0]["reason"]
    assert plugin.compute_dtype == torch.float32 and plugin.fallback_active
    # It takes effect from the next batch on: the dtype recorded after each batch switches at that step.
    low = torch.bfloat16 if scaler is None else torch.float16
    assert recorder.dtypes == [low] * (step - 1) + [torch.float32] * (8 - step + 1)


def test_cooldown_retries_low_precision_and_falls_back_again() -> None:
    plugin = _fp16_scaled()
    fallback = PrecisionFallback(patience=2, cooldown=3)
    recorder = Recorder()
    with quiet():
        make_trainer(plugin, max_steps=10, callbacks=[fallback, recorder]).fit(PoisonModule(inf_grad_steps=EVERY_STEP))
    assert [(d["step"], d["action"]) for d in fallback.decisions] == [
        (2, "fallback"), (5, "restore"), (7, "fallback"), (10, "restore"),
    ]
    low, fp = torch.float16, torch.float32
    assert recorder.dtypes == [low, fp, fp, fp, low, low, fp, fp, fp, low]
    assert fallback.cooldown_end == -1 and fallback.state is FallbackState.RESTORED


def test_fallback_states_follow_the_decisions_and_reload_from_the_checkpoint_format() -> None:
    # Hand-written transitions: no cooldown -> fallen back for good; a cooldown -> cooling until step + cooldown.
    fallback = PrecisionFallback(patience=2, cooldown=3)
    assert fallback.state is FallbackState.NORMAL and fallback.cooldown_end == -1
    fallback._record(4, "fallback", None, "test", "the whole model now computes in FP32")
    assert fallback.state is FallbackState.COOLING and fallback.retry_step == 7 and fallback.cooldown_end == 7
    saved = fallback.state_dict()
    assert saved["cooldown_end"] == 7  # the checkpoint format is unchanged: a step, -1 for none
    fallback._record(7, "restore", None, "cooldown over", "low precision restored")
    assert fallback.state is FallbackState.RESTORED and fallback.cooldown_end == -1
    fallback.load_state_dict(saved)
    assert fallback.state is FallbackState.COOLING and fallback.retry_step == 7
    permanent = PrecisionFallback(patience=2)
    permanent._record(4, "fallback", None, "test", "the whole model now computes in FP32")
    assert permanent.state is FallbackState.FALLEN_BACK and permanent.cooldown_end == -1
    reloaded = PrecisionFallback(patience=2)
    reloaded.load_state_dict(permanent.state_dict())
    assert reloaded.state is FallbackState.FALLEN_BACK


def test_global_mode_climbs_the_fp8_ladder_one_rung_at_a_time() -> None:
    plugin = StablePrecision("16-mixed", fp8="delayed", scaler=DynamicLossScaler("cpu"))
    fallback = PrecisionFallback(patience=2)
    recorder = Recorder()
    with quiet():
        make_trainer(plugin, max_steps=5, callbacks=[fallback, recorder]).fit(PoisonModule(inf_grad_steps=EVERY_STEP))
    assert [d["step"] for d in fallback.decisions] == [2, 4]
    assert "FP8 layers now compute in the base precision" in fallback.decisions[0]["effect"]
    assert "the whole model now computes in FP32" in fallback.decisions[1]["effect"]
    assert recorder.dtypes == [torch.float16] * 3 + [torch.float32] * 2


class _LossOnlyPlugin:
    """The plugin as PrecisionFallback's loss check sees it: the step's batch ends, and ``input_nonfinite`` (counted:
    asking it costs kernels on every step)."""

    def __init__(self) -> None:
        self.input_ends: list[torch.Tensor] = []
        self.asked = 0

    @property
    def input_nonfinite(self) -> torch.Tensor | None:
        from lit_mpstable.core.step.step_guard import ends_nonfinite

        self.asked += 1
        return ends_nonfinite(self.input_ends) if self.input_ends else None

    def new_step(self, *batches: torch.Tensor) -> None:
        self.input_ends = []  # the stepper replaces the list at a step's end
        self.add_batch(*batches)

    def add_batch(self, *batches: torch.Tensor) -> None:
        self.input_ends += [end for b in batches for end in torch.aminmax(b)]


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_nonfinite_loss_check_reads_the_loss_late_and_asks_the_batch_only_after_a_nonfinite_loss(
        world_size: int) -> None:
    # A backward launches no kernel (the loss is kept, detached: one op, was 9 with the check and the batch's check
    # folded in); on one process the next step reads the loss itself (the one read, which the flag's was) and asks
    # the batch (a poisoned one excuses the loss) on the bad step only; on several each rank's verdict is formed at
    # the step's end and summed. The verdicts are those of the check before it: one step late, per backward with the
    # batches so far.
    from types import SimpleNamespace

    fallback, plugin = PrecisionFallback(nonfinite_loss_patience=2), _LossOnlyPlugin()
    fallback._plugin = plugin  # type: ignore[assignment]
    strategy = SimpleNamespace(reduce=lambda t, reduce_op: t)
    trainer = SimpleNamespace(world_size=world_size, strategy=strategy, reduce=strategy.reduce)
    clean, poisoned, nan = torch.ones(4), torch.tensor([1.0, float("inf")]), torch.tensor(float("nan"))

    def step(*losses_and_batches) -> tuple[bool | None, int]:
        plugin.new_step()
        for loss, batch in losses_and_batches:
            plugin.add_batch(batch)
            with _Ops() as backward:
                fallback.on_before_backward(trainer, None, loss)
            assert backward.n <= 1
        with _Ops() as end:
            read = fallback._nonfinite.end_step(trainer)
        return read, end.n

    reads = [step((torch.tensor(0.5, requires_grad=True), clean)) for _ in range(3)]
    assert [read for read, _ in reads] == [None, False, False] and plugin.asked == 0
    if world_size == 1:
        assert [ops for _, ops in reads] == [0, 1, 1]  # a clean step: the read of the last step's loss, nothing else
    assert step((nan, poisoned))[0] is False  # reads the last clean step
    assert step((nan, clean))[0] is False  # the poisoned batch excused the NaN loss
    assert plugin.asked == 0
    # Two backwards in one step: the first's NaN loss came before the poisoned batch, so nothing excuses it.
    assert step((nan, clean), (torch.tensor(0.5), poisoned))[0] is True  # the NaN loss of a clean batch, read late
    assert fallback.state_dict()["previous_nonfinite"] is True  # the unread flag, exact, for checkpoints
    assert step((torch.tensor([1.0, float("inf")]), clean))[0] is True
    assert fallback.state_dict()["previous_nonfinite"] is True  # a loss of two elements, one of them inf
    assert step((torch.tensor(float("-inf")), clean))[0] is True
    assert step((torch.tensor(1.0), clean))[0] is True
    assert fallback.state_dict()["previous_nonfinite"] is False


def test_module_mode_on_a_tied_head_moves_it_with_its_embedding_and_training_recovers() -> None:
    # 16-true, GPT-2's tie: the head computes x * 1e5 / 1e5 (inf in FP16, harmless in FP32). The module fallback must
    # take the embedding sharing its weight along; before, the next forward died of a dtype error.
    from torch import nn

    class AmplifyingHead(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x * 1e5) / 1e5

    plugin = StablePrecision("16-true")
    fallback = PrecisionFallback(patience=2, mode="module")
    recorder = Recorder()
    module = TiedLM(AmplifyingHead)
    with quiet():
        make_trainer(plugin, max_steps=5, callbacks=[BlameFirstNonfinite(), fallback, recorder]).fit(module)
    (decision,) = fallback.decisions
    assert decision["modules"] == ["model.head"] and "with ['model.emb']" in decision["effect"]
    assert sorted(plugin.islands.names) == ["model.emb", "model.head"] and plugin.compute_dtype == torch.float16
    assert recorder.skipped == [True, True, False, False, False]  # recovered from the step after the fallback
    assert module.model.head.weight is module.model.emb.weight and module.model.emb.weight.dtype == torch.float32

"""GrowthMonitor measures an FP8 layer's saturation and underflow at the scale the layer casts with: per tensor from
the tensor's own amax under current scaling (nothing saturates; a dominant outlier flushes the rest), the amax
history's scale under delayed scaling (a jump past it saturates). At scale 1 a stable layer with large activations
under current scaling read as saturating, so the fallback would take it out of FP8 for nothing."""

from __future__ import annotations

import torch
from torch import nn

from lit_mpstable.core.step.stepper import PrecisionStepper
from lit_mpstable.fp8 import FP8Config


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _stepper(recipe: str) -> tuple[PrecisionStepper, nn.Module, torch.optim.Optimizer]:
    fp8 = FP8Config(recipe=recipe, filter=["a", "b"])
    stepper = PrecisionStepper("bf16-mixed", fp8=fp8, growth_every_n_steps=1, telemetry_every_n_steps=None)
    model = _Net()
    stepper.setup_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    stepper.setup_optimizers(model, [opt])
    return stepper, model, opt


def _step(stepper: PrecisionStepper, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    with stepper.forward_context():
        loss = model(x).float().square().mean()
    stepper.scale_loss(loss).backward()
    stepper.step(opt)
    opt.zero_grad(set_to_none=True)


def test_current_scaling_large_steady_activations_neither_saturate_nor_run_away() -> None:
    stepper, model, opt = _stepper("current")
    g = torch.Generator().manual_seed(0)
    for _ in range(12):  # inputs up to ~4000: far above E4M3's 448, and steady
        _step(stepper, model, opt, 1000.0 * torch.randn(64, 16, generator=g))
    assert stepper.growth is not None
    stats = stepper.growth.stats()
    assert stats["a"]["saturation"] == 0.0, stats["a"]
    assert stepper.growth.runaway() == []


def test_current_scaling_underflow_counts_what_the_outlier_flushes() -> None:
    stepper, model, opt = _stepper("current")
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    x[0, 0] = 1e6  # per-tensor scale 448 / 1e6: every other value (|x| < 4) lands below E4M3's smallest subnormal
    _step(stepper, model, opt, x)
    assert stepper.growth is not None
    underflow = stepper.growth.stats()["a"]["underflow"]
    assert underflow > 0.95, underflow  # at scale 1 nothing here flushes: it read 0


def test_delayed_scaling_saturation_is_read_at_the_history_scale() -> None:
    stepper, model, opt = _stepper("delayed")
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        _step(stepper, model, opt, torch.randn(64, 16, generator=g))
    _step(stepper, model, opt, 20.0 * torch.randn(64, 16, generator=g))  # a jump: the scale from |x| ~ 4 clips it
    assert stepper.growth is not None
    saturation = stepper.growth.stats()["a"]["saturation"]
    assert saturation > 0.2, saturation  # |x| <= ~90 < 448: at scale 1 it read 0
    # The history catches up at this very step (the next scale covers the new amax): a clip while it does is no
    # runaway; only kurtosis or a non-finite value name a layer whose scale follows its amax.
    assert stepper.growth.runaway() == []



def _growing(rate: float, steps: int = 24):
    """SGD at a tiny LR on inputs of ~4000 growing ``rate`` a step: the monitor's trend is the inputs'."""
    stepper, model, opt = _stepper("current")
    for group in opt.param_groups:
        group["lr"] = 1e-9
    g = torch.Generator().manual_seed(0)
    for i in range(steps):
        _step(stepper, model, opt, 1000.0 * rate**i * torch.randn(64, 16, generator=g))
    assert stepper.growth is not None
    return stepper.growth


def test_a_fp8_layer_heading_out_of_its_dtypes_range_is_named_a_slow_one_is_not() -> None:
    slow, fast = _growing(1.05), _growing(2.0)  # log2 amax +0.07 a step (200 steps: +14); +1 (200 steps: +200)
    assert slow.stats()["a"]["samples"] >= slow.window and slow.runaway() == []
    assert "a" in fast.runaway()  # ~2**35 now: BF16's 2**128 within 100 steps


def test_a_resumed_monitor_judges_fp8_layers_at_their_own_scale_before_its_next_sample() -> None:
    monitor = _growing(1.05)
    fresh, _, _ = _stepper("current")  # setup attached the monitor to the FP8 layers; nothing sampled yet
    assert fresh.growth is not None
    fresh.growth.load_state_dict(monitor.state_dict())
    # The saved rows: an amax of ~10**4, rising slowly. At scale 1 that read as past 448 and heading further.
    assert fresh.growth.runaway() == monitor.runaway() == []

"""StablePrecision(growth_every_n_steps=10) in FP8 through the Trainer: a SwiGLU block whose gate and up rows are driven
into alignment (Smooth-SwiGLU's mechanism, as in tests/core/test_growth.py, grown faster so the run reaches a real
non-finite step in a few hundred steps) is named by OverflowMonitor >= 50 steps before its first non-finite loss;
PrecisionFallback(on_growth=True) moves that layer alone out of FP8; a clean run raises nothing."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from helpers import make_trainer
from torch import nn
from trainer_pkg import OverflowMonitor, PrecisionFallback, StablePrecision, pl

GROW_FROM, RATE = 80, 1.12  # from step 80 the two rows grow 12% a step (the product feeding mlp.down ~25%)


class SwiGLU(nn.Module):
    def __init__(self, d: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class GrowthTask(pl.LightningModule):
    """A pre-norm residual SwiGLU block on a fixed regression (AdamW); ``grow``: the alignment injection."""

    def __init__(self, seed: int, grow: bool, grow_until: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp, self.mlp, self.out = nn.Linear(16, 16), SwiGLU(), nn.Linear(16, 16)
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(256, 16, generator=g)
        self.y = torch.tanh(self.x @ torch.randn(16, 16, generator=g) / 4)
        self.grow, self.grow_until, self.u = grow, grow_until, torch.zeros(16)
        self.first_nonfinite: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.mlp(nn.functional.layer_norm(h, (16,)))
        return self.out(nn.functional.layer_norm(h, (16,)))

    def training_step(self, batch, batch_idx):
        loss = nn.functional.mse_loss(self(batch[0]).float(), batch[1])
        if self.first_nonfinite is None and not math.isfinite(loss.item()):
            self.first_nonfinite = self.trainer.global_step
        return loss

    def on_train_batch_end(self, *args) -> None:
        step = self.trainer.global_step
        if not self.grow or step < GROW_FROM or (self.grow_until is not None and step >= self.grow_until):
            return
        with torch.no_grad():
            gate, up = self.mlp.gate.weight, self.mlp.up.weight
            if step == GROW_FROM:
                self.u[:] = (gate[0] + up[0]).float()
                self.u.div_(self.u.norm())
            for weight in (gate, up):
                weight[0].mul_(RATE).add_(self.u.to(weight.dtype), alpha=0.01 * weight[0].norm().item())

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=32,
                                           shuffle=True, generator=torch.Generator().manual_seed(0))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def _run(seed: int, grow: bool, steps: int, fallback: bool = False, recipe: str | None = "current",
         grow_until: int | None = None):
    module = GrowthTask(seed, grow, grow_until)
    plugin = StablePrecision("bf16-mixed", fp8=recipe, growth_every_n_steps=10)
    monitor = OverflowMonitor(log_every_n_steps=10)
    callbacks = [monitor] + ([PrecisionFallback(on_growth=True, patience=10**6, max_overflow_rate=None,
                                                nonfinite_loss_patience=None)] if fallback else [])
    warned: list[tuple[int, str]] = []

    class Seen(pl.Callback):  # the step of each growth warning
        def on_train_batch_end(self, trainer, *args) -> None:
            for w in caught[len(warned):]:
                warned.append((trainer.global_step, str(w.message)))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(plugin, max_steps=steps, max_epochs=-1, callbacks=[*callbacks, Seen()]).fit(module)
    growth = [(s, m) for s, m in warned if "activations growing" in m]
    return module, plugin, growth, callbacks


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2))
def test_growth_warned_50_steps_before_the_first_nonfinite_step(seed: int) -> None:
    module, plugin, growth, _ = _run(seed, grow=True, steps=400)
    assert module.first_nonfinite is not None, "the injected growth must reach a non-finite loss"
    assert growth, "no growth warning"
    first = growth[0][0]
    assert module.first_nonfinite - first >= 50, (first, module.first_nonfinite)
    assert "'mlp.down'" in growth[0][1] and "'out'" not in growth[0][1]
    assert plugin.runaway_layers() and set(plugin.stats["growth"]) >= {"inp", "mlp.gate", "mlp.up", "mlp.down", "out"}


@pytest.mark.slow
def test_fallback_on_growth_moves_only_the_runaway_layer() -> None:
    module, plugin, _, callbacks = _run(0, grow=True, steps=200, fallback=True)
    fallback = callbacks[1]
    moved = [d["modules"] for d in fallback.decisions if d["action"] == "fallback"]
    assert moved and moved[0] == ["mlp.down"], fallback.decisions
    assert all(m == ["mlp.down"] for m in moved)
    fp8 = {n for n, m in module.named_modules() if type(m).__name__ == "FP8Linear"}
    assert "mlp.down" not in fp8 and {"mlp.gate", "mlp.up"} <= fp8  # the first and last layers never were FP8


@pytest.mark.slow
def test_clean_run_raises_no_alarm() -> None:
    module, plugin, growth, _ = _run(0, grow=False, steps=300)
    assert module.first_nonfinite is None and growth == [] and plugin.runaway_layers() == []
    assert set(plugin.stats["growth"]) == {"inp", "mlp.gate", "mlp.up", "mlp.down", "out"}

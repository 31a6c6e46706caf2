"""StablePrecision(growth_every_n_steps=10) in FP8 through the Trainer: a SwiGLU block whose gate and up rows are driven
into alignment (Smooth-SwiGLU's mechanism, as in tests/core/test_growth.py, grown faster so the run reaches a real
non-finite step in a few hundred steps) is named by OverflowMonitor >= 50 steps before its first non-finite loss;
PrecisionFallback(on_growth=True) moves that layer alone out of FP8; a clean run raises nothing.

``mode="dead_channel"`` (the fallback's end-loss task, ``experiments/growth_fallback.py``): hidden unit 0 grows as in
the alignment mode into a massive activation (Sun et al. 2024) until it is ``cap`` times every other unit's amax,
and its column of ``mlp.down`` is pinned to zero (from the start): the output does not depend on unit 0 in exact
arithmetic or in BF16, while FP8's per-tensor scale of ``mlp.down``'s input (448 / amax) flushes every other unit."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from helpers import make_trainer
from torch import nn
from trainer_pkg import OverflowMonitor, PrecisionFallback, StablePrecision, pl

GROW_FROM, RATE = 80, 1.12  # from step 80 the two rows grow 12% a step (the product feeding mlp.down ~25%)
MODES = ("align", "dead_channel")
DEAD_CAP = 1e8  # dead_channel: unit 0's amax / the other units' amax where the growth stops (BF16 stays finite)


class SwiGLU(nn.Module):
    def __init__(self, d: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class GrowthTask(pl.LightningModule):
    """A pre-norm residual SwiGLU block on a fixed regression (AdamW); ``grow``: the alignment injection.

    ``mode="dead_channel"``: ``mlp.down``'s column 0 is zero from the start (pinned after every step), and the growth
    of unit 0 stops once its amax over the data set reaches ``cap`` x the other units' (:attr:`saturated_at`)."""

    def __init__(self, seed: int, grow: bool, grow_until: int | None = None, mode: str = "align",
                 cap: float = DEAD_CAP) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"GrowthTask(mode={mode!r}): allowed: {list(MODES)}.")
        if not (isinstance(cap, (int, float)) and 1 < cap < 1e30):
            raise ValueError(f"GrowthTask(cap={cap!r}): must be a number in (1, 1e30) (an amax ratio BF16 holds).")
        self.mode, self.cap, self.saturated_at = mode, float(cap), None
        torch.manual_seed(seed)
        self.inp, self.mlp, self.out = nn.Linear(16, 16), SwiGLU(), nn.Linear(16, 16)
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(256, 16, generator=g)
        self.y = torch.tanh(self.x @ torch.randn(16, 16, generator=g) / 4)
        self.grow, self.grow_until, self.u = grow, grow_until, torch.zeros(16)
        self.first_nonfinite: int | None = None
        self.losses: list[float] = []  # the training loss of every step (read anyway for first_nonfinite)
        if mode == "dead_channel":
            with torch.no_grad():
                self.mlp.down.weight[:, 0] = 0

    @torch.no_grad()
    def hidden(self) -> torch.Tensor:
        """``mlp.down``'s input over the whole data set, in FP32. Functional: calling the layers would feed the
        growth monitor's hooks and the FP8 layers' amax records."""
        linear = nn.functional.linear
        h = nn.functional.layer_norm(linear(self.x, self.inp.weight, self.inp.bias), (16,))
        return nn.functional.silu(linear(h, self.mlp.gate.weight)) * linear(h, self.mlp.up.weight)

    def unit_ratio(self) -> float:
        """Unit 0's amax over the data set / the largest amax of the other hidden units."""
        amax = self.hidden().abs().amax(0)
        return float(amax[0] / amax[1:].amax())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.mlp(nn.functional.layer_norm(h, (16,)))
        return self.out(nn.functional.layer_norm(h, (16,)))

    def training_step(self, batch, batch_idx):
        loss = nn.functional.mse_loss(self(batch[0]).float(), batch[1])
        self.losses.append(loss.item())
        if self.first_nonfinite is None and not math.isfinite(self.losses[-1]):
            self.first_nonfinite = self.trainer.global_step
        return loss

    def on_train_batch_end(self, *args) -> None:
        step = self.trainer.global_step
        if self.mode == "dead_channel":
            with torch.no_grad():
                self.mlp.down.weight[:, 0] = 0  # unit 0 never reaches the output (AdamW moved it)
        if not self.grow or step < GROW_FROM or (self.grow_until is not None and step >= self.grow_until):
            return
        if self.mode == "dead_channel" and (self.saturated_at is not None or self.unit_ratio() >= self.cap):
            self.saturated_at = step if self.saturated_at is None else self.saturated_at
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
         grow_until: int | None = None, mode: str = "align", cap: float = DEAD_CAP):
    module = GrowthTask(seed, grow, grow_until, mode, cap)
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
def test_fallback_on_growth_moves_only_the_runaway_layers() -> None:
    module, plugin, _, callbacks = _run(0, grow=True, steps=200, fallback=True)
    fallback = callbacks[1]
    moved = [d["modules"] for d in fallback.decisions if d["action"] == "fallback"]
    assert moved and moved[0] == ["mlp.down"], fallback.decisions  # its input's kurtosis, from step 91
    # Later the gate and up rows, grown 1e5x, make their own FP8 weight casts flush the rest of their weights.
    assert moved[1:] == [["mlp.gate", "mlp.up"]], fallback.decisions
    assert plugin.stats["growth"]["mlp.gate"]["weight_underflow"] > 0.05  # as last read, at step 160
    fp8 = {n for n, m in module.named_modules() if type(m).__name__ == "FP8Linear"}
    assert fp8 == set()  # the first and last layers never were FP8


@pytest.mark.slow
def test_clean_run_raises_no_alarm() -> None:
    module, plugin, growth, _ = _run(0, grow=False, steps=300)
    assert module.first_nonfinite is None and growth == [] and plugin.runaway_layers() == []
    assert set(plugin.stats["growth"]) == {"inp", "mlp.gate", "mlp.up", "mlp.down", "out"}


def test_growth_task_rejects_an_unknown_mode_and_a_cap_bf16_cannot_hold() -> None:
    with pytest.raises(ValueError, match=r"mode='dead'.*allowed"):
        GrowthTask(0, grow=True, mode="dead")
    with pytest.raises(ValueError, match=r"cap=1e\+40"):
        GrowthTask(0, grow=True, mode="dead_channel", cap=1e40)


@pytest.mark.slow
def test_dead_channel_fallback_moves_only_mlp_down_and_ends_near_bf16() -> None:
    """The dead massive-activation unit: BF16 does not see it (bit for bit the clean run), FP8 loses mlp.down's input
    to E4M3's flush, and the fallback, moving mlp.down alone out of FP8, ends closer to BF16 than FP8 alone."""
    steps = 200  # the growth saturates near step 160; FP8 has lost mlp.down's other units from ~step 140

    def end_loss(module: GrowthTask) -> float:
        with torch.no_grad():
            return nn.functional.mse_loss(module.float()(module.x), module.y).item()

    bf16, _, _, _ = _run(0, grow=True, steps=steps, recipe=None, mode="dead_channel")
    clean, _, _, _ = _run(0, grow=False, steps=steps, recipe=None, mode="dead_channel")
    fp8, _, _, _ = _run(0, grow=True, steps=steps, mode="dead_channel")
    fallback_run, _, _, callbacks = _run(0, grow=True, steps=steps, fallback=True, mode="dead_channel")
    assert bf16.saturated_at is not None and bf16.unit_ratio() > 1e7  # the unit did grow
    assert bf16.losses == clean.losses  # BF16 never sees unit 0
    moved = [d["modules"] for d in callbacks[1].decisions if d["action"] == "fallback"]
    assert moved == [["mlp.down"]], callbacks[1].decisions
    fp8_layers = {n for n, m in fallback_run.named_modules() if type(m).__name__ == "FP8Linear"}
    assert fp8_layers == {"mlp.gate", "mlp.up"}
    reference = end_loss(bf16)
    assert abs(end_loss(fallback_run) / reference - 1) < 0.1 < end_loss(fp8) / reference - 1

"""The FP8 growth task: a pre-norm residual SwiGLU block whose gate and up rows are driven into alignment
(Smooth-SwiGLU's mechanism, grown fast so the run reaches a real non-finite step in a few hundred steps), trained
through the Trainer with ``StablePrecision(growth_every_n_steps=10)``, ``OverflowMonitor`` and, when asked,
``PrecisionFallback(on_growth=True)``. What ``tests/adapter/test_growth_warning.py`` checks and
``experiments/growth_fallback.py`` and ``experiments/optimizer_state.py`` measure.

``mode="dead_channel"`` (the fallback's end-loss task, ``experiments/growth_fallback.py``): hidden unit 0 grows as in
the alignment mode into a massive activation (Sun et al. 2024) until it is ``cap`` times every other unit's amax,
and its column of ``mlp.down`` is pinned to zero (from the start): the output does not depend on unit 0 in exact
arithmetic or in BF16, while FP8's per-tensor scale of ``mlp.down``'s input (448 / amax) flushes every other unit."""

from __future__ import annotations

import math
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lit_mpstable.callbacks import OverflowMonitor, PrecisionFallback
from lit_mpstable.frontends.trainer import StablePrecision

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
        self.mode, self.cap = mode, float(cap)
        self.saturated_at: int | None = None
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


def run_growth_task(seed: int, grow: bool, steps: int, fallback: bool = False, recipe: Any = "current",
                    grow_until: int | None = None, mode: str = "align", cap: float = DEAD_CAP,
                    ) -> tuple[GrowthTask, StablePrecision, list[tuple[int, str]], list[pl.Callback]]:
    """Train :class:`GrowthTask` for ``steps`` steps (``recipe``: ``StablePrecision``'s ``fp8``, ``None`` for BF16);
    returns the module, the plugin, the growth warnings as ``(step, message)`` and the callbacks (the monitor, then
    the fallback when asked)."""
    module = GrowthTask(seed, grow, grow_until, mode, cap)
    plugin = StablePrecision("bf16-mixed", fp8=recipe, growth_every_n_steps=10)
    monitor = OverflowMonitor(log_every_n_steps=10)
    callbacks: list[pl.Callback] = [monitor]
    if fallback:
        callbacks.append(PrecisionFallback(on_growth=True, patience=10**6, max_overflow_rate=None,
                                           nonfinite_loss_patience=None))
    warned: list[tuple[int, str]] = []

    class Seen(pl.Callback):  # the step of each growth warning
        def on_train_batch_end(self, trainer, *args) -> None:
            for w in caught[len(warned):]:
                warned.append((trainer.global_step, str(w.message)))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = pl.Trainer(plugins=[plugin], accelerator="cpu", devices=1, max_steps=steps, max_epochs=-1,
                             enable_progress_bar=False, enable_model_summary=False, logger=False,
                             enable_checkpointing=False, num_sanity_val_steps=0, callbacks=[*callbacks, Seen()])
        trainer.fit(module)
    growth = [(s, m) for s, m in warned if "activations growing" in m]
    return module, plugin, growth, callbacks

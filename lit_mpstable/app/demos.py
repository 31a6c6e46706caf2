"""Demo models for the experiment configs: a loss-weighted MLP and models with scripted faults (loss spikes,
overflow storms, silent underflow). Hydra targets such as ``lit_mpstable.app.demos.FaultyMLP``, importable wherever the
package is."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lit_mpstable.app.zoo import GPTLM, DigitsData, MLPClassifier
from lit_mpstable.fp8.backend import linear_like


class WeightedLossMLP(MLPClassifier):
    """:class:`MLPClassifier` whose training loss is multiplied by ``loss_weight`` (e.g. a mean over a large global
    batch, or a down-weighted loss term): only the gradients' magnitude changes.

    AdamW's ``eps`` is multiplied by the same weight, so the update ``m / (sqrt(v) + eps)`` is unchanged in exact
    arithmetic, and bit for bit in FP32 when the weight is a power of two: any difference between weights is the
    low-precision format's doing. Logged losses (``train/loss``, ``val/loss``) stay unweighted.
    """

    def __init__(self, loss_weight: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.loss_weight = float(loss_weight)

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * self.loss_weight

    def configure_optimizers(self):
        config = super().configure_optimizers()
        for group in config["optimizer"].param_groups:
            group["eps"] *= self.loss_weight
        return config


class _ScaleGrad(torch.autograd.Function):
    """The identity forward; the backward multiplies the gradient by ``factor`` in the gradient's own dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class GradientAttenuatedLinear(nn.Linear):
    """An ``nn.Linear`` whose output gradient is multiplied by ``factor`` on its way in and whose parameter gradients
    are divided by it on their way out: exactly ``nn.Linear`` in FP32 (and BF16) for a power of two, but in FP16 the
    attenuated gradient flushes to zero (below 6e-8; with the default 2**-40 even at a loss scale of 2**16) and the
    layer silently stops learning, while the loss, the other layers and the loss scale look healthy. A scripted
    stand-in for a path whose gradients are far smaller than the rest (a LayerScale branch initialised at 1e-12, a
    down-weighted auxiliary loss). The gradient it passes to the layers before it is attenuated too (they starve as
    well): use it on a first layer.
    """

    factor: float = 2.0**-40

    @classmethod
    def from_linear(cls, linear: nn.Linear, factor: float) -> GradientAttenuatedLinear:
        """The same layer (its ``Parameter`` objects, mode and hooks), attenuated by ``factor``."""
        new = linear_like(linear, cls)
        new.factor = float(factor)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _ScaleGrad.apply(self.weight, 1.0 / self.factor)
        bias = _ScaleGrad.apply(self.bias, 1.0 / self.factor) if self.bias is not None else None
        return _ScaleGrad.apply(nn.functional.linear(x, weight, bias), self.factor)


class _Faults:
    """Scripted faults, keyed on the optimizer step being taken while a trainer runs the model (a rollback restores
    weights, not the step count, so it never replays a fault; a replay of the step, as PrecisionProbe's, sees the
    same one), else on the number of training steps called.

    - Loss spike: the loss of batch ``spike_batch`` is multiplied by ``spike_factor`` (a corrupted batch).
    - Overflow storm: on batches ``storm_start <= b < storm_stop`` the output ``y`` of ``storm_module`` becomes
      ``y * storm_factor / storm_factor``: an intermediate value past FP16's range (65504) for ``|y| >= 2**-4`` with
      the default ``2**20``. In FP16 that is inf; in FP32 (and BF16) the same ``y``, exactly, since the factor is a
      power of two. So the fault is precision-dependent, as a real activation overflow is.
    - Silent underflow: the linear layer ``underflow_module`` becomes a :class:`GradientAttenuatedLinear` with
      ``underflow_factor`` (for the whole run): in FP16 its gradients flush to zero, in FP32 nothing changes.
    """

    batches_seen: int

    def _batch_index(self) -> int:
        try:
            return self.trainer.global_step  # type: ignore[attr-defined]
        except RuntimeError:  # not attached to a trainer: count the calls
            return self.batches_seen

    def _setup_faults(
        self, spike_batch: int | None, spike_factor: float, storm_module: str | None, storm_start: int,
        storm_stop: int, storm_factor: float, underflow_module: str | None = None, underflow_factor: float = 2.0**-40,
    ) -> None:
        self.batches_seen = 0
        self.spike_batch, self.spike_factor = spike_batch, float(spike_factor)
        self.storm_start, self.storm_stop, self.storm_factor = storm_start, storm_stop, float(storm_factor)
        self._storm_on = False
        if storm_module is not None:
            module: nn.Module = self.get_submodule(storm_module)  # type: ignore[attr-defined]
            module.register_forward_hook(self._storm_hook)
        if underflow_module is not None:
            parent, _, child = underflow_module.rpartition(".")
            container: nn.Module = self.get_submodule(parent)  # type: ignore[attr-defined]
            linear = container.get_submodule(child)
            if type(linear) is not nn.Linear:
                raise ValueError(f"underflow_module={underflow_module!r} is a {type(linear).__name__}, not nn.Linear.")
            setattr(container, child, GradientAttenuatedLinear.from_linear(linear, underflow_factor))

    def _storm_hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        return output * self.storm_factor / self.storm_factor if self._storm_on else None

    def training_step(self, batch, batch_idx):
        seen, self.batches_seen = self._batch_index(), self.batches_seen + 1
        self._storm_on = self.storm_start <= seen < self.storm_stop
        try:
            loss = super().training_step(batch, batch_idx)  # type: ignore[misc]
        finally:
            self._storm_on = False  # validation and preflight forwards stay clean
        return loss * self.spike_factor if seen == self.spike_batch else loss


class FaultyGPTLM(_Faults, GPTLM):
    """:class:`GPTLM` with the scripted faults of :class:`_Faults` (module names are relative to the
    LightningModule, e.g. ``model.blocks.0.fc``)."""

    def __init__(
        self, vocab_size: int, *, spike_batch: int | None = None, spike_factor: float = 1e6,
        storm_module: str | None = None, storm_start: int = 0, storm_stop: int = 0, storm_factor: float = 2.0**20,
        **kwargs: Any,
    ) -> None:
        super().__init__(vocab_size, **kwargs)
        self._setup_faults(spike_batch, spike_factor, storm_module, storm_start, storm_stop, storm_factor)


class FaultyMLP(_Faults, MLPClassifier):
    """:class:`MLPClassifier` with the scripted faults of :class:`_Faults` (e.g. ``storm_module="model.0"`` or
    ``underflow_module="model.0"``, the first linear layer)."""

    def __init__(
        self, *, spike_batch: int | None = None, spike_factor: float = 1e6, storm_module: str | None = None,
        storm_start: int = 0, storm_stop: int = 0, storm_factor: float = 2.0**20, underflow_module: str | None = None,
        underflow_factor: float = 2.0**-40, **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._setup_faults(spike_batch, spike_factor, storm_module, storm_start, storm_stop, storm_factor,
                           underflow_module, underflow_factor)


class FaultyDigitsData(DigitsData):
    """:class:`DigitsData` whose ``bad_batch``-th training batch of the run (0-based, counted across epochs) carries a
    NaN in its first input: a corrupted record as it comes out of the data pipeline, before the model sees it."""

    def __init__(self, batch_size: int = 64, *, bad_batch: int | None = None, bad_value: float = float("nan")) -> None:
        super().__init__(batch_size)
        self.bad_batch, self.bad_value = bad_batch, float(bad_value)
        self.batches_served = 0

    def _collate(self, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        x, y = (torch.stack(column) for column in zip(*samples))
        if self.batches_served == self.bad_batch:
            x = x.clone()
            x.view(-1)[0] = self.bad_value
        self.batches_served += 1
        return [x, y]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        generator = torch.Generator().manual_seed(0)
        return torch.utils.data.DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True,
                                           generator=generator, collate_fn=self._collate)


def stall_task(n: int = 64, d: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Linear regression whose full-batch SGD update is exactly ``lr * 2 (W - W*)``, with W in [1, 2).

    The inputs are 16 columns of a 64x64 Sylvester-Hadamard matrix: entries +-1 (exact in every format) and
    ``x.T @ x / n == I``, so the FP32 loss after k steps is ``(1 - 2 lr)**(2k)`` times the first one. The weights
    start in [1.25, 1.75] (exact in BF16) and their targets lie within 0.2 of them, so every weight stays in
    [1, 2), where one BF16 ulp is 2**-7 and one FP16 ulp 2**-10.
    """
    g = torch.Generator().manual_seed(seed)
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    x = h[:, 1 : d + 1]
    w0 = (1.25 + 0.5 * torch.rand(d, d, generator=g)).bfloat16().float()
    w_star = w0 + 0.4 * (torch.rand(d, d, generator=g) - 0.5)
    return x, x @ w_star.T, w0

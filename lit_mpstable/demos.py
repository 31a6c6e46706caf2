"""Demo models for the experiment configs: a loss-weighted MLP and models with scripted faults (loss spikes,
overflow storms). Hydra targets such as ``lit_mpstable.demos.FaultyMLP``, importable wherever the package is."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lit_mpstable.zoo import GPTLM, DigitsData, MLPClassifier

__all__ = ["FaultyDigitsData", "FaultyGPTLM", "FaultyMLP", "WeightedLossMLP"]


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


class _Faults:
    """Scripted faults, keyed on the number of training batches seen (a rollback restores weights, not this count,
    so it never replays a fault).

    - Loss spike: the loss of batch ``spike_batch`` is multiplied by ``spike_factor`` (a corrupted batch).
    - Overflow storm: on batches ``storm_start <= b < storm_stop`` the output ``y`` of ``storm_module`` becomes
      ``y * storm_factor / storm_factor``: an intermediate value past FP16's range (65504) for ``|y| >= 2**-4`` with
      the default ``2**20``. In FP16 that is inf; in FP32 (and BF16) the same ``y``, exactly, since the factor is a
      power of two. So the fault is precision-dependent, as a real activation overflow is.
    """

    batches_seen: int

    def _setup_faults(
        self, spike_batch: int | None, spike_factor: float, storm_module: str | None, storm_start: int,
        storm_stop: int, storm_factor: float,
    ) -> None:
        self.batches_seen = 0
        self.spike_batch, self.spike_factor = spike_batch, float(spike_factor)
        self.storm_start, self.storm_stop, self.storm_factor = storm_start, storm_stop, float(storm_factor)
        self._storm_on = False
        if storm_module is not None:
            module: nn.Module = self.get_submodule(storm_module)  # type: ignore[attr-defined]
            module.register_forward_hook(self._storm_hook)

    def _storm_hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        return output * self.storm_factor / self.storm_factor if self._storm_on else None

    def training_step(self, batch, batch_idx):
        seen, self.batches_seen = self.batches_seen, self.batches_seen + 1
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
    """:class:`MLPClassifier` with the scripted faults of :class:`_Faults` (e.g. ``storm_module="model.0"``, the
    first linear layer)."""

    def __init__(
        self, *, spike_batch: int | None = None, spike_factor: float = 1e6, storm_module: str | None = None,
        storm_start: int = 0, storm_stop: int = 0, storm_factor: float = 2.0**20, **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._setup_faults(spike_batch, spike_factor, storm_module, storm_start, storm_stop, storm_factor)


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

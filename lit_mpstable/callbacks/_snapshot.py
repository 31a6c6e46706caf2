"""In-memory training snapshots for ScaleCheckpoint: what is copied, and the order a restore must follow."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import torch

from lit_mpstable.callbacks._common import clone_tensors
from lit_mpstable.plugin import StablePrecision

__all__ = ["layout_key", "restore_snapshot", "take_snapshot", "weights_finite"]

# The plugin's event counters are history, not numeric state: a rollback keeps their live values.
_COUNTER_KEYS = ("step_count", "overflow_count", "skipped_steps", "last_step_skipped")


def layout_key(plugin: StablePrecision) -> tuple:
    """What a precision fallback changes, as far as the plugin's public state shows it."""
    return plugin.fallback_active, plugin.compute_dtype, tuple(plugin.islands.names)


def weights_finite(module: torch.nn.Module) -> bool:
    """Whether every parameter is finite: one reduction per tensor, one host sync."""
    weights = [p.detach() for p in module.parameters() if p.numel()]
    return bool(torch.stack([w.abs().amax().float() for w in weights]).isfinite().all()) if weights else True


def take_snapshot(trainer: pl.Trainer, pl_module: pl.LightningModule, plugin: StablePrecision) -> dict[str, Any]:
    """Copies, on their devices, of the module, optimizer, LR scheduler and plugin state dicts."""
    return {
        "step": trainer.global_step,
        "model": clone_tensors(pl_module.state_dict()),
        "plugin": clone_tensors(plugin.state_dict()),  # FP32 masters share storage with the optimizer's parameters
        "optimizers": [copy.deepcopy(opt.state_dict()) for opt in trainer.optimizers],
        "schedulers": [copy.deepcopy(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs],
    }


def restore_snapshot(
    trainer: pl.Trainer, pl_module: pl.LightningModule, plugin: StablePrecision, snapshot: dict[str, Any]
) -> None:
    """Load ``snapshot`` back through public ``load_state_dict`` methods; the snapshot stays intact for reuse."""
    live = plugin.state_dict()
    counters = {key: live[key] for key in _COUNTER_KEYS if key in live}
    # The plugin first: it re-applies the snapshot's precision layout (casts, FP8 swaps) the weights belong to.
    plugin.load_state_dict({**clone_tensors(snapshot["plugin"]), **counters})
    pl_module.load_state_dict(snapshot["model"])  # copies into the live parameters
    # optimizer.load_state_dict keeps tensors that already have the right dtype and device: hand it copies.
    for optimizer, state in zip(trainer.optimizers, snapshot["optimizers"]):
        optimizer.load_state_dict(copy.deepcopy(state))
    for config, state in zip(trainer.lr_scheduler_configs, snapshot["schedulers"]):
        config.scheduler.load_state_dict(copy.deepcopy(state))

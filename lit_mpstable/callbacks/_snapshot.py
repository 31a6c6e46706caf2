"""In-memory training snapshots for ScaleCheckpoint: what is copied, where it lives, and the order a restore follows."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import torch

from lit_mpstable.callbacks.views import PrecisionView
from lit_mpstable.core.checkpoints import copy_state
from lit_mpstable.core.guards.triage import all_finite
from lit_mpstable.core.guards.triage import state_finite as core_state_finite

DIAGNOSTICS = ("growth",)
"""Plugin-state entries that are the run's record, not state a step computes with: a rollback keeps their live values
(``restore_state``), so a snapshot's copy is never restored, and the growth monitor's rows hold a non-finite amax by
design (the sample of an overflowing or bad batch, whose layer it names). The finite check leaves them out."""


def layout_key(plugin: PrecisionView) -> tuple:
    """What a precision fallback changes, as far as the plugin's public state shows it."""
    return plugin.fallback_active, plugin.compute_dtype, tuple(plugin.islands.names)


def state_finite(module: torch.nn.Module, optimizers: list[Any]) -> bool:
    """Whether every parameter and every floating optimizer-state tensor is finite: one reduction per tensor, one
    host sync (the core's check, which the ladder's classification of a rejected step uses too)."""
    return core_state_finite(module, optimizers)


def nonfinite_entries(snapshot: dict[str, Any], limit: int = 5) -> list[str]:
    """Where ``snapshot`` holds inf/NaN (weights, FP32 masters, compensation, loss scale, FP8 scaling state, optimizer
    state), named as in the state dicts; empty when every floating value is finite (the plugin's :data:`DIAGNOSTICS`
    are not checked). One reduction over all tensors (one host sync for a snapshot on the accelerator); the names are
    only looked up when something is not finite."""
    named: list[tuple[str, Any]] = []
    _floating(snapshot["model"], "weights ", named)
    plugin = {key: value for key, value in snapshot["plugin"].items() if key not in DIAGNOSTICS}
    _floating(plugin, "plugin state ", named)
    for index, state in enumerate(snapshot["optimizers"]):
        _floating(state.get("state", {}), f"optimizer {index} state ", named)
    bad_floats = [path for path, value in named if isinstance(value, float) and not math.isfinite(value)]
    tensors = [(path, value) for path, value in named if isinstance(value, torch.Tensor)]
    cpu = torch.device("cpu")
    finite = bool(all_finite([t for _, t in tensors], cpu)) if tensors else True
    if finite:
        return bad_floats[:limit]
    bad = bad_floats + [path for path, t in tensors if not bool(all_finite([t], cpu))]  # FP8 too: no isfinite there
    return bad[:limit]


def _floating(obj: Any, path: str, out: list[tuple[str, Any]]) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.numel() and type(obj) is torch.Tensor:
            out.append((path.strip(), obj.detach()))
    elif isinstance(obj, float) and not isinstance(obj, bool):
        out.append((path.strip(), obj))
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _floating(value, f"{path}{key}" if path.endswith(" ") else f"{path}[{key!r}]", out)
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            _floating(value, f"{path}[{index}]", out)


def take_snapshot(trainer: Any, pl_module: Any, plugin: PrecisionView, device: str | None) -> dict[str, Any]:
    """Copies of the module, optimizer, LR scheduler and plugin state dicts, on ``device`` (None: where they are)."""
    target = torch.device(device) if device is not None else None
    return {
        "step": trainer.global_step,
        "model": copy_state(pl_module.state_dict(), target),
        "plugin": copy_state(plugin.state_dict(), target),  # FP32 masters share storage with the optimizer's parameters
        "optimizers": [copy_state(opt.state_dict(), target) for opt in trainer.optimizers],
        "schedulers": [copy.deepcopy(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs],
    }


def restore_snapshot(trainer: Any, pl_module: Any, plugin: PrecisionView, snapshot: dict[str, Any]) -> None:
    """Load ``snapshot`` back through public ``load_state_dict`` methods; the snapshot stays intact for reuse.

    The plugin's event counters are history, not numeric state: ``restore_state`` keeps their live values."""
    # The plugin first: it re-applies the snapshot's precision layout (casts, FP8 swaps) the weights belong to.
    plugin.restore_state(copy_state(snapshot["plugin"], None))
    pl_module.load_state_dict(snapshot["model"])  # copies into the live parameters, onto their devices
    # optimizer.load_state_dict keeps tensors that already have the right dtype and device: hand it copies.
    for optimizer, state in zip(trainer.optimizers, snapshot["optimizers"]):
        optimizer.load_state_dict(copy_state(state, None))
    for config, state in zip(trainer.lr_scheduler_configs, snapshot["schedulers"]):
        config.scheduler.load_state_dict(copy.deepcopy(state))

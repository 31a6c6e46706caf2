"""The restored-state rung's Trainer side (:attr:`~lit_mpstable.core.guards.ladder.Rung.RESTORE`): find the checkpoint
written before the loaded one that passes its fingerprint, and load it into the running fit, in process."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lit_mpstable.core.fingerprint import CheckpointCheck
from lit_mpstable.core.fingerprint import earlier_checkpoint as earlier_passing

TRAINING_KEYS = ("state_dict", "optimizer_states", "lr_schedulers", "loops")
"""What a checkpoint needs to resume training from it (a ``save_weights_only`` file lacks the last three)."""

PROGRESS = ("epoch_loop.automatic_optimization.optim_progress", "epoch_loop.manual_optimization.optim_step_progress",
            "epoch_loop.scheduler_progress")
"""The fit loop's step counters a fallback takes from the file (``global_step`` is the optimizer steps completed)."""


def _global_step(checkpoint: Mapping[str, Any]) -> int:
    step = checkpoint.get("global_step")
    return step if isinstance(step, int) and not isinstance(step, bool) else -1


def earlier_checkpoint(plugin: Any, path: str | Path, loaded_step: int
                       ) -> tuple[Path, dict[str, Any], dict[str, list[str]]] | tuple[None, None, str]:
    """The newest checkpoint of ``path``'s directory written before it (its modification time, and a ``global_step``
    below ``loaded_step``, the step ``path`` resumed at: a file the run wrote after the load is not earlier) that
    holds the training state and passes its numeric fingerprint (checksums and manifest; a file without one passes
    unchecked): ``(its path, the loaded dict, {rejected path: its differences})``, else ``(None, None, why)``
    (:func:`~lit_mpstable.core.fingerprint.earlier_checkpoint`)."""
    fingerprint = getattr(plugin, "fingerprint", None)

    def differences(checkpoint: dict[str, Any]) -> list[str]:
        if fingerprint is None:
            return []
        check = CheckpointCheck(fingerprint, type(plugin).__qualname__, lambda: plugin.manifest_as_of(checkpoint),
                                lambda checkpoint: None)
        return check.differences(checkpoint, required=False)

    return earlier_passing(path, loaded_step, differences, step_of=_global_step, required=TRAINING_KEYS)


def load_in_process(trainer: pl.Trainer, checkpoint: dict[str, Any], path: str | Path) -> int:
    """Load ``checkpoint`` (read from ``path``) into the running fit through Lightning's own checkpoint connector, as
    ``trainer.fit(ckpt_path=path)`` restores it: the LightningModule's ``on_load_checkpoint`` and its weights, the
    precision plugin's state (its fingerprint checked again, the pinned pass included), the optimizers and LR
    schedulers, and the loop's step counters (``global_step``, the scheduler steps, the logging step). The callbacks'
    states and the position in the data stay (the next batch is the one after the bad step), as after a rollback.
    ``trainer.ckpt_path`` becomes ``path``. Returns the ``global_step`` the run resumes at."""
    # Lightning's private connector, on purpose: it is the one path that restores a checkpoint into a Trainer, hooks
    # and strategy included, and it has no public entry point for a fit already running.
    connector = trainer._checkpoint_connector
    connector._ckpt_path = str(path)
    connector._loaded_checkpoint = checkpoint
    try:
        connector.restore_model()
        connector.restore_precision_plugin_state()
        connector.restore_optimizers_and_schedulers()
        loops = checkpoint["loops"].get("fit_loop", {})
        epoch_loop = trainer.fit_loop.epoch_loop
        targets = (epoch_loop.automatic_optimization.optim_progress, epoch_loop.manual_optimization.optim_step_progress,
                   epoch_loop.scheduler_progress)
        for key, target in zip(PROGRESS, targets):
            if key in loops:
                target.load_state_dict(loops[key])
        stepped = loops.get("epoch_loop.state_dict", {}).get("_batches_that_stepped")
        if isinstance(stepped, int):
            epoch_loop._batches_that_stepped = stepped
    finally:
        connector._loaded_checkpoint = {}
    return trainer.global_step

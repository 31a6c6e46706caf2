"""What an exact continuation restores beyond the checkpoint Lightning writes: each rank's RNG, callback and plugin
state, rollback snapshots and the position in the epoch (for :class:`~lit_mpstable.callbacks.PreemptionCheckpoint`)."""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.loops.progress import _ProcessedTracker
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit_mpstable.callbacks._common import run_trainer
from lit_mpstable.core.attribution import OverflowTracer


def rng_state() -> dict[str, Any]:
    import numpy as np

    legacy = np.random.get_state()  # legacy=True (the default): the tuple form
    assert isinstance(legacy, tuple)
    keys, pos, has_gauss, gauss = legacy[1:]
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos), "has_gauss": int(has_gauss),
                  "gauss": float(gauss)},
        "python": [version, list(internal), gauss_next],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    np.random.set_state(("MT19937", numpy["keys"].numpy().astype("uint32"), numpy["pos"], numpy["has_gauss"],
                         numpy["gauss"]))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -------------------------------------------------------------------------------------- rank-local state
# Pieces of state that the run's decisions read but that their owners' state_dict leaves out or holds for rank 0
# only. Each belongs in its owner's state_dict; until it is there, the preemption checkpoint carries it.
def rank_state(trainer: pl.Trainer, own: pl.Callback) -> dict[str, Any]:
    callbacks = {}
    for cb in run_trainer(trainer).callbacks:
        if cb is not own and (state := cb.state_dict()):
            callbacks[cb.state_key] = copy.deepcopy(state)
    plugin = trainer.precision_plugin
    stepper = getattr(plugin, "stepper", None)
    plugin_state = {} if stepper is None else {
        "stats": plain(stepper.stats),  # blame (blamed_modules, nonfinite_input) and telemetry, rank-local
        "tracer_armed": stepper.observer.tracer is not None,  # the step after an overflow is traced
    }
    return {"rng": rng_state(), "callbacks": callbacks, "plugin": plugin_state}


def plain(value: Any) -> Any:
    """``value`` with only what ``torch.load(weights_only=True)`` reads: tensors, numbers, strings, lists, dicts."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items() if isinstance(k, str)}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return None


def scale_checkpoints(trainer: pl.Trainer) -> list[Any]:
    from lit_mpstable.callbacks.scale_checkpoint import ScaleCheckpoint

    return [cb for cb in run_trainer(trainer).callbacks if isinstance(cb, ScaleCheckpoint)]


def snapshots(trainer: pl.Trainer) -> list[Any]:
    """ScaleCheckpoint's rollback snapshots (in memory only; the same on every rank), with their layout key, through
    the snapshot owner's public API (``snapshot_state``)."""
    return [cb.snapshot_state() for cb in scale_checkpoints(trainer)]


def restore_callbacks(trainer: pl.Trainer, own: pl.Callback, states: Mapping[str, Any], snapshots: list[Any]) -> None:
    from lit_mpstable.callbacks.amp_preflight import AMPPreflight

    for cb in run_trainer(trainer).callbacks:
        if cb is not own and cb.state_key in states:
            cb.load_state_dict(copy.deepcopy(states[cb.state_key]))
        if isinstance(cb, AMPPreflight) and cb.result:
            cb.mark_checked()  # it checked the first batch of the run already; a resume is not a new run
    for cb, saved in zip(scale_checkpoints(trainer), snapshots):
        if saved is not None:  # the snapshot of the run, not the one its on_train_start took of the resume point
            cb.load_snapshot_state(saved)


def restore_plugin(trainer: pl.Trainer, state: Mapping[str, Any]) -> None:
    stepper = getattr(trainer.precision_plugin, "stepper", None)
    if stepper is None or not state:
        return
    stepper.stats.clear()
    stepper.stats.update(copy.deepcopy(state["stats"]))
    observer, module = stepper.observer, stepper.layout.module
    if state["tracer_armed"] and observer.tracer is None and module is not None:
        observer.tracer = OverflowTracer(module).attach()


# --------------------------------------------------------------------------------------------------- data
# Lightning's privates, on purpose: the fit loop's loader and fetcher (``_combined_loader``, ``_data_fetcher``) and the
# CombinedLoader's ``iterator`` have no public accessor, and the exact data position needs them.
def train_loaders(trainer: pl.Trainer) -> list[Any]:
    combined = trainer.fit_loop._combined_loader
    return [] if combined is None else list(combined.flattened)


def train_iterator(trainer: pl.Trainer) -> Any:
    """The train loader's current iterator object (a new one each time Lightning calls ``iter`` on it)."""
    combined = trainer.fit_loop._combined_loader
    return None if combined is None else combined._iterator


def next_epoch_iterator(trainer: pl.Trainer) -> None:
    """The checkpoint ended an epoch: the uninterrupted run created the next epoch's iterator after it, drawing the
    iterator's seed from the global RNG (DataLoader does, whatever its workers); the resumed run created one before
    the RNG was restored. Create it again, now."""
    loaders, fetcher = train_loaders(trainer), trainer.fit_loop._data_fetcher
    if loaders and fetcher is not None and not any(isinstance(loader, _Stateful) for loader in loaders):
        iter(fetcher)


def skip_consumed_batches(trainer: pl.Trainer, consumed: int, epoch_rng: Mapping[str, Any] | None,
                           recreate: bool) -> None:
    """Replay the start of the epoch of a loader without state and skip the batches it already trained on: from the
    RNG at the epoch's start, a new iterator where the epoch created one after that point (its seed draw), then
    ``consumed`` batches (a RandomSampler draws its order at the first)."""
    loaders = train_loaders(trainer)
    fetcher = trainer.fit_loop._data_fetcher
    if not loaders or fetcher is None or all(isinstance(loader, _Stateful) for loader in loaders):
        return  # Lightning restored their positions
    if getattr(fetcher, "batches", None):
        rank_zero_warn("PreemptionCheckpoint: the train loader has no length (it was prefetched), so the resumed epoch"
                       " starts from its beginning; make it stateful (state_dict/load_state_dict) to resume exactly.")
        return
    for loader in loaders:  # the epoch's order, as Lightning sets it at the epoch's start (not yet, on a resume)
        # The epoch's tracker is a _ProcessedTracker (typed as its base); either Trainer package's, so no isinstance.
        _set_sampler_epoch(loader, cast(_ProcessedTracker, trainer.fit_loop.epoch_progress.current).processed)
    if epoch_rng is not None:
        set_rng_state(epoch_rng)
        if recreate:
            iter(fetcher)
    elif any(isinstance(getattr(loader, "sampler", None), torch.utils.data.RandomSampler) for loader in loaders):
        rank_zero_warn("PreemptionCheckpoint: the checkpoint does not hold the RNG the epoch started from, so the"
                       " RandomSampler's order of the resumed epoch differs from the interrupted one.")
    for _ in range(consumed):
        assert fetcher.iterator is not None  # made by iter(fetcher): the loop's, or the one above
        next(fetcher.iterator)

"""PreemptionCheckpoint: on SIGTERM / SIGUSR1 (SLURM, submitit, torchrun elastic) every rank stops at the same step
boundary, one checkpoint is written atomically, and ``trainer.fit(model, ckpt_path=...)`` continues the run
bit-identically."""

from __future__ import annotations

import os
import shutil
import signal
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.multiprocessing import ProcessExitedException

from lit_mpstable.callbacks._common import check, run_trainer
from lit_mpstable.callbacks._resume import (
    next_epoch_iterator,
    rank_state,
    restore_callbacks,
    restore_plugin,
    rng_state,
    set_rng_state,
    skip_consumed_batches,
    snapshots,
    train_iterator,
)

_FORBIDDEN = ("SIGKILL", "SIGSTOP")  # cannot be caught


def _signal_of(call: str, value: Any) -> signal.Signals:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(f"{call}: each signal must be a name such as 'SIGTERM' or a signal.Signals; got"
                        f" {type(value).__name__}.")
    try:
        sig = signal.Signals[value] if isinstance(value, str) else signal.Signals(value)
    except (KeyError, ValueError):
        raise ValueError(f"{call}: {value!r} is not a signal of this platform; use names such as 'SIGTERM',"
                         " 'SIGUSR1'.") from None
    check(sig.name not in _FORBIDDEN, call, f"{sig.name} cannot be caught; use 'SIGTERM' or 'SIGUSR1'.")
    return sig


def atomic_save(write: Any, path: str | os.PathLike) -> None:
    """``write(tmp)`` writes a file, or a directory (a sharded checkpoint: FSDP2's); it then replaces ``path``: a
    temporary one in the same folder, fsync of what it holds, ``os.replace``, fsync of the folder. Whatever stops it
    half-way (an exception, SIGKILL, a power cut) leaves the previous ``path`` as it was; a failed write removes its
    temporary one. A directory cannot replace another in one rename: the previous one moves aside first (a crash
    between the two renames leaves it as ``.<name>.old``) and is removed after."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        _fsync_tree(tmp)
        if tmp.is_dir() or path.is_dir():
            old = path.with_name(f".{path.name}.old")
            remove_path(old)
            if path.exists():
                os.replace(path, old)
            os.replace(tmp, path)
            remove_path(old)
        else:
            os.replace(tmp, path)
    except BaseException:
        remove_path(tmp)
        raise
    _fsync_dir(path.parent)  # the rename itself survives a crash


def remove_path(path: Path) -> None:
    """Remove a file or a directory tree, if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _fsync_tree(path: Path) -> None:
    if not path.is_dir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        return
    for folder, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(folder))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PreemptionCheckpoint(pl.Callback):
    """Turns a preemption signal into one checkpoint at a step boundary from which the run continues exactly.

    The handlers, installed at ``setup`` (and restored at ``teardown``; Python allows it in the main thread only:
    elsewhere the callback warns and does nothing), only note the signal. The handler that was there before (a
    callable one: ``SIG_DFL`` would end the process at once) is handed the signal after the checkpoint is written,
    at the boundary, or at the end of the fit if it ends first (a signal after the last step boundary, e.g. during
    the final validation: where no handler was there before ours, ``exit=True`` then leaves the process with
    ``128 + signum`` at the fit's teardown rather than going on with the code after ``fit``): a launcher's or
    library's handler that exits at once (Ray's driver installs one that stays after ``ray.shutdown()``) would
    otherwise end the run before the checkpoint. Lightning's own SIGTERM handler, which it installs after
    ``setup``, is replaced for the fit: it runs a collective inside the handler on the signalled rank alone and ends
    the run through ``SIGTERMException`` (exit status 0, no checkpoint).

    At the end of every batch that stepped the optimizer (after the step, the scale update and every other callback:
    the callback moves itself to the end of ``trainer.callbacks``) the ranks agree: the signal number is max-reduced,
    so a signal delivered to one rank stops all of them at the same step. Distributed runs issue that reduction at one
    boundary and read it at the next (no host sync in the step), so they stop one step after the signal; a single
    process stops at the first boundary. Then ``{dirpath}/{filename}`` is written through ``trainer.save_checkpoint``
    into a temporary file in the same folder, fsync-ed and ``os.replace``-d (a signal or kill during writing leaves the
    previous checkpoint loadable), and the run stops: ``exit=True`` raises ``SystemExit(128 + signum)`` (143 for
    SIGTERM, 138 for SIGUSR1: the status a requeueing launcher expects), else ``trainer.should_stop`` (which
    ``min_epochs``/``min_steps`` can overrule). Under ``ddp_spawn``/``ddp_fork`` the ranks are children of the
    launching process, where torch reports their exit as a crash (``ProcessExitedException``); it exits with their
    status too. That process runs no hook before the ranks start, so it has no handler: a signal sent to it as well
    (a scheduler signalling every process of the job) ends it at once, and torch's parent-death signal (SIGINT) then
    ends the ranks before any checkpoint. There, signal the ranks only, or run one process per rank (``srun``,
    ``torchrun``).

    The checkpoint holds, beyond Lightning's own content (weights, optimizers, LR schedulers, loops, the plugin's
    ``state_dict``, every callback's ``state_dict``), per rank: the RNG states (torch, CUDA, numpy, Python), the
    callbacks' rank-local state (recent losses, blamed modules), the plugin's telemetry and blame (``plugin.stats``)
    and whether its overflow tracer is armed; and ``ScaleCheckpoint``'s in-memory rollback snapshot.
    ``trainer.fit(model, ckpt_path=path)`` with the same world size then continues bit-identically.

    Requirements on the training data (Lightning 2.6 restores a loader's position only if it is stateful):

    - A loader with ``state_dict``/``load_state_dict`` (e.g. ``torchdata.stateful_dataloader.StatefulDataLoader``):
      Lightning stores and restores its position itself. Any other loader must have a length (a map-style dataset)
      and an order that is a function of the epoch and the global torch RNG: ``shuffle=False``, ``shuffle=True``
      (a ``RandomSampler`` drawing from the global RNG, replayed from the RNG saved at the epoch's start), the
      ``DistributedSampler`` Lightning injects in distributed runs, or any sampler following ``set_epoch``; not a
      sampler with its own ``torch.Generator``. The resumed run replays the epoch's start and skips the batches
      it already consumed (they are loaded again, not trained on).
    - Randomness in the dataset must come from the global RNGs or follow the sample index. With ``num_workers > 0``,
      random transforms in the workers resume exactly except in the first epoch a process runs (its iterator is
      created before the epoch's RNG can be recorded, so the workers' seeds differ).
    - Nothing in ``LightningModule.on_train_epoch_start`` may draw from the global RNG (the epoch's RNG is recorded
      in the callbacks' hook, which runs before it).
    - The same world size (else each rank takes rank 0's RNG and rank-local state, with a warning); single-file
      checkpoints (DDP, one device): sharded strategies (FSDP2, DeepSpeed) write folders, which are not covered.

    Args:
        dirpath: folder of the checkpoint; ``None``: ``trainer.default_root_dir``.
        signals: the signals that preempt, by name (``"SIGTERM"``) or ``signal.Signals``.
        exit: leave the process with status ``128 + signum`` after the checkpoint; ``False``: stop the fit.
        filename: the checkpoint's file name inside ``dirpath``.

    Raises:
        ValueError, TypeError: an argument is not allowed (the message names it).
    """

    def __init__(self, dirpath: str | os.PathLike | None = None, signals: Iterable[Any] = ("SIGTERM", "SIGUSR1"),
                 exit: bool = True, *, filename: str = "preemption.ckpt") -> None:
        name = type(self).__name__
        if dirpath is not None and not isinstance(dirpath, (str, os.PathLike)):
            raise TypeError(f"{name}(dirpath={dirpath!r}): must be a folder path (str or os.PathLike) or None.")
        if isinstance(signals, (str, int)) or not isinstance(signals, Iterable):
            raise TypeError(f"{name}(signals={signals!r}): must be a sequence of signals, e.g. ('SIGTERM',).")
        sigs = [_signal_of(f"{name}(signals={signals!r})", s) for s in signals]
        check(bool(sigs) and len(set(sigs)) == len(sigs), f"{name}(signals={signals!r})",
              "must name at least one signal, each once.")
        if not isinstance(exit, bool):
            raise TypeError(f"{name}(exit={exit!r}): must be True (leave with 128 + signum) or False (stop the fit).")
        check(isinstance(filename, str) and filename not in ("", ".", "..") and os.sep not in filename,
              f"{name}(filename={filename!r})", "must be a plain file name (no folder); put the folder in dirpath.")
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.signals, self.exit, self.filename = tuple(sigs), exit, filename
        self.saved_path: Path | None = None
        """The checkpoint written by the last preemption, None before."""
        self.saved_step: int | None = None
        """Its ``trainer.global_step``."""
        self._received: int = 0  # signal number noted by the handler, 0: none
        self._unhanded: list[int] = []  # signals noted but not yet handed to the handler before ours
        self._previous: dict[int, Any] = {}  # signum -> handler before ours, restored at teardown
        self._active = False  # between setup and teardown (or an exception)
        self._issued: torch.Tensor | None = None  # the agreement reduction in flight (distributed runs)
        self._step_before = -1
        self._to_save: dict[str, Any] = {}  # what state_dict() returns during the preemption save
        self._loaded: dict[str, Any] | None = None  # read from a checkpoint, applied at train start
        # Where the current epoch's loader iterator drew its randomness: the RNG at the epoch's start, the iterator
        # then (created before the hook: the process's first epoch) and whether it was created after the hook.
        self._epoch_start: dict[str, Any] | None = None

    # ----------------------------------------------------------------------------------------------- signals
    def _handle(self, signum: int, frame: Any) -> None:
        previous = self._previous.get(signum)
        if not self._active:
            # Still installed after the fit: when fit ends by an exception, Lightning's teardown runs after ours and
            # re-installs what it found at its setup (this handler). Hand the signal to the one before us.
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            if callable(previous):
                previous(signum, frame)
            elif previous in (None, signal.SIG_DFL):
                os.kill(os.getpid(), signum)  # the default action, now that it is installed again
            return
        # Only note it: anything more (I/O, collectives, a handler that exits) could run in the middle of a step or a
        # collective, or end the run before its checkpoint.
        self._received = self._received or signum
        if callable(previous) and signum not in self._unhanded:
            self._unhanded.append(signum)

    def _hand_on(self) -> None:
        """Call the handlers that were there before ours with the signals noted since (once each, in order)."""
        while self._unhanded:
            signum = self._unhanded.pop(0)
            previous = self._previous.get(signum)
            if callable(previous):
                previous(signum, None)  # may exit: the checkpoint, if any, is written

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._received, self._issued, self._active, self._unhanded = 0, None, True, []
        # Last among the callbacks: the step boundary is after every other callback's decisions of that step (a
        # rollback), and the restore after their on_train_start (ScaleCheckpoint's snapshot).
        run_trainer(trainer).callbacks = [cb for cb in run_trainer(trainer).callbacks if cb is not self] + [self]
        if threading.current_thread() is not threading.main_thread():
            rank_zero_warn(f"{type(self).__name__}: fit runs outside the main thread, where Python cannot install"
                           " signal handlers; preemption signals are not handled in this run.")
            return
        for sig in self.signals:
            current = signal.signal(sig, self._handle)
            # A fit that ended by an exception may leave a PreemptionCheckpoint's handler installed (Lightning's
            # teardown re-installs it after ours restored): ours again, or another instance's, inactive now; take
            # the handler it had replaced.
            seen: set[int] = set()
            while (isinstance(owner := getattr(current, "__self__", None), PreemptionCheckpoint)
                   and owner is not self and not owner._active and id(owner) not in seen):
                seen.add(id(owner))
                current = owner._previous.get(sig, signal.SIG_DFL)
            if current != self._handle:
                self._previous[sig] = current

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        signum = self._received if stage == "fit" and self._active else 0  # noted after the last step boundary
        self._received = 0
        self._restore_handlers()  # a callable handler before ours is handed the signal here, and decides
        if not signum or self._previous.get(signum) not in (None, signal.SIG_DFL):
            return  # handed on, or ignored (SIG_IGN) as before us
        name = signal.Signals(signum).name
        if self.exit:
            # No boundary is left to stop at: the fit has ended, and the process leaves as the signal asked, rather
            # than going on with the code after fit.
            rank_zero_info(f"{type(self).__name__}: {name} after the last step boundary (step"
                           f" {trainer.global_step}): the fit had ended, no checkpoint was needed; exiting with status"
                           f" {128 + signum}.")
            raise SystemExit(128 + signum)
        rank_zero_warn(f"{type(self).__name__}: {name} came after the last step boundary (step"
                       f" {trainer.global_step}): the fit had ended, so nothing was saved and nothing stopped"
                       " (exit=False).")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_handlers()  # Lightning skips the teardown hooks when fit ends by an exception (our exit too)
        status = getattr(exception, "exit_code", None)
        if self.exit and isinstance(exception, ProcessExitedException) and status in {128 + s for s in self.signals}:
            # The launching process of ddp_spawn / ddp_fork: the ranks are its children and left with the signal's
            # status (after the checkpoint, or at the fit's end), which torch reports here as a crash (status 1 and a
            # traceback). Leave with theirs, the one a requeueing scheduler waits for. Nothing of the fit ran in this
            # process (no logger, no strategy state to finalize), so ending the exception hooks here loses nothing.
            rank_zero_info(f"{type(self).__name__}: the ranks left with status {status} (on"
                           f" {signal.Signals(status - 128).name}); the launching process exits with it too.")
            raise SystemExit(status) from None

    def _restore_handlers(self) -> None:
        self._active = False
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._hand_on()  # a signal the fit ended before acting on still reaches the handler before ours

    def _own_handlers(self) -> None:
        """Put ours back where Lightning's signal connector installed its own over it (after setup)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self._previous:
            current = signal.getsignal(sig)
            if current != self._handle and type(current).__module__.startswith(
                    ("lightning.pytorch.trainer.connectors", "pytorch_lightning.trainer.connectors")):
                signal.signal(sig, self._handle)  # Lightning's teardown restores what it found: ours

    # -------------------------------------------------------------------------------------------- boundary
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._epoch_start is None or self._epoch_start["epoch"] != trainer.current_epoch:
            self._epoch_start = {"epoch": trainer.current_epoch, "rng": rng_state(),
                                 "iterator": train_iterator(trainer),
                                 "after": None}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._step_before = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._step_before:
            return  # accumulating gradients: not a step boundary
        signum = self._agreed(trainer, pl_module)
        if not signum:
            return
        self._save(trainer, pl_module, signum, batch_idx)
        self._hand_on()
        name = signal.Signals(signum).name
        if self.exit:
            rank_zero_info(f"{type(self).__name__}: {name} at step {trainer.global_step}; checkpoint"
                           f" {self.saved_path}; exiting with status {128 + signum}.")
            raise SystemExit(128 + signum)
        rank_zero_info(f"{type(self).__name__}: {name} at step {trainer.global_step}; checkpoint {self.saved_path};"
                       " stopping.")
        trainer.should_stop = True

    def _agreed(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
        """The signal every rank acts on (0: none), the same on all ranks."""
        if trainer.world_size == 1:
            return self._received
        # Issued here, read at the next boundary (long computed by then): no host sync inside the step.
        previous = self._issued
        flag = torch.tensor(float(self._received), device=pl_module.device)
        self._issued = trainer.strategy.reduce(flag, reduce_op="max")
        return int(previous.item()) if previous is not None else 0

    # ----------------------------------------------------------------------------------------------- saving
    def _save(self, trainer: pl.Trainer, pl_module: pl.LightningModule, signum: int, batch_idx: int) -> None:
        start = self._epoch_start if self._epoch_start is not None and (
            self._epoch_start["epoch"] == trainer.current_epoch) else None
        ranks: list[Any] = [{**rank_state(trainer, self), "epoch_rng": None if start is None else start["rng"]}]
        if trainer.world_size > 1:
            gathered: list[Any] = [None] * trainer.world_size
            torch.distributed.all_gather_object(gathered, ranks[0])
            ranks = gathered
        self._to_save = {
            "signal": signum, "global_step": trainer.global_step, "epoch": trainer.current_epoch,
            "batches_in_epoch": batch_idx + 1, "world_size": trainer.world_size, "ranks": ranks,
            "scale_checkpoint": snapshots(trainer),
            "iterator_after_epoch_start": None if start is None else (
                start["after"] if start["after"] is not None else train_iterator(trainer) is not start["iterator"]),
        }
        folder = self.dirpath if self.dirpath is not None else Path(trainer.default_root_dir)
        path = folder / self.filename
        if trainer.is_global_zero:
            folder.mkdir(parents=True, exist_ok=True)
            remove_path(path.with_name(f".{path.name}.tmp"))  # a crash's leftover: a sharded save adds to a directory
        trainer.strategy.barrier("PreemptionCheckpoint.mkdir")
        try:
            if trainer.is_global_zero:
                # trainer.save_checkpoint is collective and writes on rank zero only (DDP, one device).
                atomic_save(lambda tmp: trainer.save_checkpoint(tmp), path)
            else:
                trainer.save_checkpoint(path.with_name(f".{path.name}.tmp"))
        finally:
            self._to_save = {}
        trainer.strategy.barrier("PreemptionCheckpoint.saved")
        self.saved_path, self.saved_step = path, trainer.global_step
        self._received = 0

    def state_dict(self) -> dict[str, Any]:
        """Keys, in the checkpoint a preemption writes (empty otherwise): ``signal``, ``global_step``, ``epoch``,
        ``batches_in_epoch``, ``world_size``, ``ranks`` (per rank: ``rng``, ``epoch_rng`` (at the epoch's start),
        ``callbacks``, ``plugin``), ``scale_checkpoint`` (ScaleCheckpoint's rollback snapshot) and
        ``iterator_after_epoch_start`` (whether the epoch's loader iterator was created after ``epoch_rng``)."""
        return dict(self._to_save)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict) if state_dict else None

    # ---------------------------------------------------------------------------------------------- resume
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._own_handlers()
        state, self._loaded = self._loaded, None
        if state is None:
            return
        rank = trainer.global_rank
        if state["world_size"] != trainer.world_size:
            rank_zero_warn(f"{type(self).__name__}: the checkpoint was written by {state['world_size']} ranks, this"
                           f" run has {trainer.world_size}; each rank takes rank 0's RNG and rank-local state, so the"
                           " continuation is not bit-identical.")
            rank = 0
        entry = state["ranks"][rank]
        restore_callbacks(trainer, self, entry["callbacks"], state["scale_checkpoint"])
        restore_plugin(trainer, entry["plugin"])
        consumed = int(state["batches_in_epoch"])
        if consumed < trainer.num_training_batches and trainer.current_epoch == state["epoch"]:
            # Mid-epoch: replay the epoch's start (the iterator's seed draw, a RandomSampler's order) from the RNG it
            # started from, skip what it consumed, then continue from the RNG of the checkpoint.
            after = bool(state["iterator_after_epoch_start"])
            self._epoch_start = {"epoch": trainer.current_epoch, "rng": entry["epoch_rng"], "iterator": None,
                                 "after": after}
            skip_consumed_batches(trainer, consumed, entry["epoch_rng"], recreate=after)
            set_rng_state(entry["rng"])
        else:
            # The checkpoint ended the epoch: the uninterrupted run created the next epoch's iterator after it.
            set_rng_state(entry["rng"])
            self._epoch_start = {"epoch": trainer.current_epoch, "rng": rng_state(), "iterator": None, "after": True}
            next_epoch_iterator(trainer)


# ---------------------------------------------------------------------------------------------------- RNG

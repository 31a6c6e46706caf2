"""What every front end of the precision core shares: the constructor, the live state, the actions and the state
dict, all read from one :class:`~lit_mpstable.core.stepper.PrecisionStepper` (the one owner of each fact)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lit_mpstable.fp8 import FP8Config
from lit_mpstable.core.fsdp import island_mp_policy as fsdp_island_mp_policy
from lit_mpstable.core.fsdp import mp_policy as fsdp_mp_policy
from lit_mpstable.core.islands import FP32Islands
from lit_mpstable.core.master import MasterKeeper, MasterWeights
from lit_mpstable.core.optim_state import StateKind
from lit_mpstable.core.stepper import MasterMode, OpPolicyName, PrecisionName, PrecisionStepper, ScalerName

__all__ = ["StableFrontEnd"]

_SHOWN = ("precision", "scaler", "master_weights", "skip_nonfinite", "fp8", "fp32_modules", "op_policy", "device",
          "telemetry_every_n_steps", "diagnose", "optimizer_state", "growth_every_n_steps")


class StableFrontEnd:
    """Mixin of the Trainer and Fabric plugins: ``StablePrecision``'s constructor and everything users and
    callbacks read or call on it. See :class:`lit_mpstable.StablePrecision` for the arguments.

    Raises:
        ValueError, TypeError: an argument is not one of the allowed values.
    """

    can_skip = True
    """Callbacks may discard a step in progress (:meth:`skip_step`)."""

    def __init__(
        self,
        precision: PrecisionName = "bf16-mixed",
        *,
        scaler: ScalerName | torch.amp.GradScaler | None = "auto",
        master_weights: bool | MasterMode = True,
        skip_nonfinite: bool = True,
        fp8: str | FP8Config | None = None,
        fp32_modules: Iterable[type[nn.Module] | str] = (),
        op_policy: OpPolicyName | dict[str, str] = "autocast",
        device: str | None = None,
        telemetry_every_n_steps: int | None = 50,
        diagnose: bool = False,
        optimizer_state: StateKind = "fp32",
        growth_every_n_steps: int | None = None,
    ) -> None:
        # A list for the repr; anything else (None, 5, one name) goes to the stepper's check as it is.
        listed = isinstance(fp32_modules, Iterable) and not isinstance(fp32_modules, (str, bytes, dict))
        self._args = dict(precision=precision, scaler=scaler, master_weights=master_weights,
                          skip_nonfinite=skip_nonfinite, fp8=fp8,
                          fp32_modules=list(fp32_modules) if listed else fp32_modules, op_policy=op_policy,
                          device=device, telemetry_every_n_steps=telemetry_every_n_steps, diagnose=diagnose,
                          optimizer_state=optimizer_state, growth_every_n_steps=growth_every_n_steps)
        self.stepper = PrecisionStepper(**self._args, owner=type(self).__name__)
        self.precision = self.stepper.precision  # Lightning reads the attribute
        self.master_weights = master_weights
        self._warned: set[str] = set()  # warnings fire once per cause and plugin
        self._state_loaded = False  # load_state_dict was called (a resume that brought the plugin's state)
        self._notes_shown = 0
        self._runaway: tuple[int, list[str]] = (-1, [])  # (growth samples when computed, the layers)
        self._show_notes()

    def __repr__(self) -> str:
        defaults = StableFrontEnd.__init__.__kwdefaults__ or {}
        shown = [repr(self.stepper.precision)] + [
            f"{name}={self._args[name]!r}" for name in _SHOWN[1:]
            if self._args[name] != defaults.get(name) and not (name == "fp32_modules" and not self._args[name])
        ]
        return f"{type(self).__name__}({', '.join(shown)})"

    # ------------------------------------------------------------------------------------------- live state
    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The loss scaler (None without scaling)."""
        return self.stepper.scaler

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without scaling). Reading it synchronises with the device."""
        return self.stepper.loss_scale

    @property
    def dtype(self) -> torch.dtype:
        """The 16-bit compute dtype, or ``torch.float32`` for ``"32-true"``."""
        return self.stepper.dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model computes in now: :attr:`dtype`, or FP32 while a global fallback is active."""
        return self.stepper.compute_dtype

    @property
    def true_16bit(self) -> bool:
        """Whether parameters themselves live in 16 bits (``*-true`` modes)."""
        return self.stepper.true_16bit

    @property
    def fallback_active(self) -> bool:
        """Whether any part of the run has been moved up the precision ladder by :meth:`fallback`."""
        return self.stepper.fallback_active

    @property
    def islands(self) -> FP32Islands:
        """The FP32 islands in force (``islands.names``: qualified module names)."""
        return self.stepper.islands

    @property
    def master(self) -> MasterWeights | None:
        """The FP32 master weights (``*-true`` modes with ``master_weights``), once training has set them up: a view of
        the stepper's weight keeper (``stepper.keeper``)."""
        keeper = self.stepper.keeper
        return keeper.weights if isinstance(keeper, MasterKeeper) else None

    @property
    def last_step_skipped(self) -> bool:
        return self.stepper.last_step_skipped

    @property
    def step_count(self) -> int:
        """Optimizer steps taken or skipped."""
        return self.stepper.step_count

    @property
    def overflow_count(self) -> int:
        """Steps skipped because their gradients held inf/NaN."""
        return self.stepper.overflow_count

    @property
    def skipped_steps(self) -> int:
        """Steps not applied: overflows plus steps discarded by :meth:`skip_step`."""
        return self.stepper.skipped_steps

    @property
    def stats(self) -> dict[str, Any]:
        """Latest telemetry: ``grad_norm``, ``grad_amax``, ``grad_underflow_frac``, ``grad_overflow_frac`` (in the
        compute format at the current scale: a forecast), ``grad_zero_frac``, ``grad_underflow_per_module``,
        ``fp8_saturation_frac``, ``fp8_underflow_frac``, ``stats_step`` (the step they were measured on); after an
        overflow ``blamed_params``, ``blamed_modules`` and ``nonfinite_input`` (the batch held inf/NaN); from
        ``PrecisionProbe``, ``probe``; with ``growth_every_n_steps``, after :meth:`runaway_layers`, ``growth``
        (per linear layer: ``amax``, ``kurtosis``, ``saturation``, ``underflow``, ``amax_growth``, ``samples``,
        ``step``). Rank-local."""
        return self.stepper.stats

    def runaway_layers(self) -> list[str]:
        """The linear layers whose activations are heading out of FP8's range (the growth monitor's
        :meth:`~lit_mpstable.core.growth.GrowthMonitor.runaway`: amax trend, kurtosis, saturation), and
        ``stats["growth"]`` refreshed; ``[]`` without ``growth_every_n_steps``. Computed once per new sample (one
        host read then; later calls return the same list). Rank-local."""
        growth = self.stepper.growth
        if growth is None:
            return []
        if self._runaway[0] != growth.samples:
            self.stepper.stats["growth"] = growth.stats()
            self._runaway = (growth.samples, growth.runaway())
        return list(self._runaway[1])

    def growth_metrics(self) -> dict[str, torch.Tensor]:
        """``mp/amax_growth`` and ``mp/kurtosis_max`` as device tensors (empty before a sample, or without
        ``growth_every_n_steps``); no host read."""
        return {} if self.stepper.growth is None else self.stepper.growth.metrics()

    @property
    def last_loss(self) -> torch.Tensor | None:
        """The latest loss before scaling, detached, on the device (reading it syncs)."""
        return self.stepper.last_loss

    @property
    def checks_nonfinite(self) -> bool:
        """Whether a step whose gradients hold inf/NaN is skipped and counted (a loss scaler, or ``skip_nonfinite``)."""
        return self.stepper.checks_nonfinite

    @property
    def input_nonfinite(self) -> torch.Tensor | None:
        """Whether a batch of the step in progress held inf/NaN: a 0-dim device bool, or None when the batches hold no
        floating tensors (token ids). Reading its value syncs."""
        return self.stepper.input_nonfinite

    @property
    def layout(self) -> Any:
        return self.stepper.layout

    @property
    def policy(self) -> Any:
        return self.stepper.policy

    @property
    def observer(self) -> Any:
        return self.stepper.observer

    @property
    def fp8(self) -> FP8Config | None:
        return self.stepper.fp8

    @property
    def diagnose(self) -> bool:
        return self.stepper.diagnose

    @property
    def device(self) -> str:
        return self.stepper.device

    @property
    def can_fallback(self) -> bool:
        """Callbacks may widen the precision (:meth:`fallback`): always, except where FSDP2 fixed it at
        ``fully_shard`` (``*-true`` modes, FP8 layers)."""
        return self.stepper.can_fallback

    # ---- FSDP2 (begin)
    @property
    def mp_policy(self) -> Any:
        """The ``torch.distributed.fsdp.MixedPrecisionPolicy`` for this precision, for every ``fully_shard`` call in
        ``configure_model``: in ``*-true`` modes FP32 sharded parameters (FSDP2's own master weights) computed in
        the 16-bit dtype and reduced in FP32; in ``*-mixed`` modes FP32 parameters under autocast. Setup refuses
        units sharded otherwise. See :func:`lit_mpstable.core.fsdp.mp_policy`."""
        return fsdp_mp_policy(self.precision, master_weights=self.stepper.master_mode is not None)

    @property
    def island_mp_policy(self) -> Any:
        """The policy of an FP32 island (``fp32_modules``) sharded as its own ``fully_shard`` unit: FP32 compute, and
        in ``*-true`` modes its output cast back to 16 bits. Under FSDP2 ``*-true`` every island needs one."""
        return fsdp_island_mp_policy(self.precision)
    # ---- FSDP2 (end)

    # ---------------------------------------------------------------------------------------------- actions
    def skip_step(self) -> None:
        """Discard the gradients of the step in progress: no update, LR schedule held, scale unchanged.

        Call it from a hook inside the step (``on_before_backward``, ``on_after_backward``), e.g. on a non-finite or
        spiking loss, so a poisoned batch never reaches the weights. In distributed runs call it on every rank or
        none (reduce the trigger first): a stepping rank waits in the found-inf all-reduce for the others.
        """
        self.stepper.skip_step()

    def fallback(self, modules: Iterable[str] | None = None, *, reason: str) -> str:
        """Climb one rung of the precision ladder: with ``modules=None`` the whole run (FP8 -> base precision ->
        FP32), else the named modules (FP8 layers leave FP8, others become FP32 islands). Loss scaling and master
        weights keep working. Returns what was done, also logged once on rank zero. Takes effect from the next
        forward; :meth:`restore_precision` undoes it."""
        action = self.stepper.fallback(modules)
        rank_zero_info(f"StablePrecision fallback at step {self.step_count}: {action} ({reason}).")
        return action

    def restore_precision(self) -> None:
        """Undo every :meth:`fallback`: back to the configured precision, FP8 layers and the user's own islands."""
        if self.stepper.restore_precision():
            rank_zero_info(f"StablePrecision at step {self.step_count}: low precision restored ({self.precision}).")

    def validate(self, model: nn.Module) -> None:
        """Check ``fp32_modules`` and the FP8 filter against ``model`` before training, without changing it (the
        plugin checks again when the trainer hands it the model).

        Raises:
            ValueError: a pattern matches no module (the message lists the model's names), or ``fp8`` is set and no
                layer of ``model`` is eligible.
        """
        self.stepper.layout.validate(model)

    def restore_state(self, state: dict[str, Any]) -> None:
        """Load numeric state from :meth:`state_dict` (a rollback): scale, masters, layout, FP8 histories; the
        event counters (steps, overflows, skips; the scaler's too) keep their live values."""
        self.stepper.load_state_dict(state, keep_counters=True)

    def state_tensors(self) -> list[torch.Tensor]:
        """Resident tensors of the precision itself (compensation buffers) that neither the model nor the optimizers
        hold; give them to ``lit_mpstable.core.memory.MemoryProbe.start(..., extra=...)``."""
        return self.stepper.state_tensors()

    def memory_report(self) -> dict[str, int]:
        """Bytes of training state by kind: ``weights``, ``masters`` (FP32 masters), ``gradients``,
        ``optimizer_state`` (quantized states by their inner tensors), ``compensation`` (``master_weights="kahan"``),
        ``total``; tensor sizes, each storage once, no allocator overhead. The stability report adds the
        activations' peak, measured. Available once training has set up model and optimizers."""
        return self.stepper.memory_report()

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly; see ``PrecisionStepper.state_dict`` for the keys."""
        return self.stepper.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Strict: a missing or unknown key raises ``KeyError`` naming it, a corrupted field (NaN/inf scale, negative
        counter, ``"False"`` for a bool, NaN masters or compensation, ``None``, junk) ``ValueError``/``TypeError``
        naming it, before anything is loaded. A checkpoint of another precision loads too (scaler state is used only
        where both sides scale)."""
        for note in self.stepper.load_state_dict(state_dict):
            rank_zero_info(f"StablePrecision: {note}")
        self._state_loaded = True

    # --------------------------------------------------------------------------------------------- messages
    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)

    def _show_notes(self) -> None:
        """The stepper's once-per-cause messages (adopted scalers, blame verdicts), as rank-zero warnings."""
        notes = self.stepper.warnings
        for message in notes[self._notes_shown:]:
            self._warn_once(message.split(" (step")[0], f"StablePrecision: {message}")
        self._notes_shown = len(notes)

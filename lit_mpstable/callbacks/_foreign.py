"""What the callbacks can read and do when a project keeps Lightning's own precision plugin (``MixedPrecision``,
``HalfPrecision``, ``FSDPPrecision``, ...) instead of ``StablePrecision``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lit_mpstable.core.formats import PRECISION_DTYPES
from lit_mpstable.frontends.live_state import Findings


class _NoIslands:
    names: list[str] = []


class ForeignPrecision:
    """``StablePrecision``'s live state, read from another precision plugin and its ``GradScaler``.

    Steps skipped for inf/NaN are counted without any host sync: GradScaler does not call ``optimizer.step()`` on an
    overflowing step, so a step post-hook on each optimizer counts the applied steps, and the trainer's step counter
    the attempted ones. (A fused optimizer skips inside its own ``step``: there the scale is read after each step,
    one sync, and said so once.) Without a scaler nothing is skipped: the counts stay 0. Counts start at ``fit``.

    What needs ``StablePrecision`` is not offered: ``can_skip`` and ``can_fallback`` are False.
    """

    can_skip = False
    can_fallback = False

    def __init__(self, plugin: Any, trainer: Any) -> None:
        self.plugin, self._trainer = plugin, trainer
        self.precision = str(getattr(plugin, "precision", "32-true"))
        self.scaler = getattr(plugin, "scaler", None)
        self.stats: dict[str, Any] = {}
        self.findings = Findings()
        self.islands = _NoIslands()
        self.input_nonfinite = None
        self.fallback_active = False
        self._start = trainer.global_step
        self._applied = 0
        self._fused_skips = 0
        self._fused = self.scaler is not None and any(
            getattr(opt, "_step_supports_amp_scaling", False) for opt in trainer.optimizers)
        if self._fused:
            rank_zero_warn(
                f"lit_mpstable callbacks with {type(plugin).__name__}: a fused optimizer skips overflowing steps inside"
                " its own step(), so each step's inf check is read after it (one host sync per step)."
            )
        self._handles = [opt.register_step_post_hook(self._count) for opt in trainer.optimizers]

    def _count(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._fused:
            self._applied += 1  # GradScaler calls step() only when the gradients are finite
            return
        # A fused step ran whatever the gradients held; its inf check is still in the scaler until update().
        states = getattr(self.scaler, "_per_optimizer_states", {})
        found = states.get(id(optimizer), {}).get("found_inf_per_device", {})
        self._fused_skips += int(bool(sum(v.item() for v in found.values())))

    def remove(self) -> None:
        """Drop the step hooks (at the end of fit)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------------------------------- live state
    @property
    def checks_nonfinite(self) -> bool:
        """GradScaler skips a step whose gradients hold inf/NaN; without one nothing does."""
        return self.scaler is not None

    @property
    def dtype(self) -> torch.dtype:
        return PRECISION_DTYPES.get(self.precision, torch.float32)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def loss_scale(self) -> float:
        """The GradScaler's scale (1.0 without one); reading it synchronises."""
        if self.scaler is None or not self.scaler.is_enabled():
            return 1.0
        return float(self.scaler.get_scale())

    @property
    def step_count(self) -> int:
        return self._trainer.global_step - self._start

    @property
    def skipped_steps(self) -> int:
        if self.scaler is None:
            return 0
        return self._fused_skips if self._fused else max(self.step_count - self._applied, 0)

    @property
    def overflow_count(self) -> int:
        return self.skipped_steps

    @property
    def last_step_skipped(self) -> bool:
        return False  # not tracked per step (it would need a sync); the counts above are exact

    def forward_context(self) -> Any:
        return self.plugin.forward_context()

    # ------------------------------------------------------------------------------------------- refused
    def _refuse(self, call: str) -> RuntimeError:
        return RuntimeError(f"{call}() needs StablePrecision; the trainer's precision plugin is"
                            f" {type(self.plugin).__name__} (can_skip and can_fallback are False here).")

    def skip_step(self) -> None:
        """Refused: only ``StablePrecision`` discards a step (``can_skip`` is False).

        Raises:
            RuntimeError: always.
        """
        raise self._refuse("skip_step")

    def fallback(self, modules: Iterable[str] | None = None, *, reason: str) -> str:
        """Refused: only ``StablePrecision`` widens its precision (``can_fallback`` is False).

        Raises:
            RuntimeError: always.
        """
        raise self._refuse("fallback")

    def restore_precision(self) -> None:
        """Refused, as :meth:`fallback`.

        Raises:
            RuntimeError: always.
        """
        raise self._refuse("restore_precision")

    def state_dict(self) -> dict[str, Any]:
        return self.plugin.state_dict()

    def restore_state(self, state: dict[str, Any]) -> None:
        """A rollback: the scaler's state back (Lightning's plugins keep no event counters)."""
        self.plugin.load_state_dict(state)

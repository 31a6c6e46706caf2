"""The ``WeightKeeper`` protocol: how a weight mode keeps the trainable weights through a step, and its factory.

A weight mode is one object the stepper calls in step order, never an ``if`` on the mode:
:class:`~lit_mpstable.core.weights.keeper.PlainKeeper` (the model's own parameters, also FSDP2's FP32 shards, which
are the masters there), :class:`~lit_mpstable.core.weights.master.MasterWeights` (FP32 masters owned by the
optimizers) and :class:`~lit_mpstable.core.weights.compact.CompactWeights` (16-bit weights with Kahan compensation or
stochastic rounding). :func:`make_keeper` builds the one a run's ``master_weights`` asks for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lit_mpstable.base.notes import Notes
from lit_mpstable.core.scaling.scalers import LossScaler
from lit_mpstable.core.weights.compact import CompactMode, CompactWeights
from lit_mpstable.core.weights.keeper import GradView, PlainKeeper
from lit_mpstable.core.weights.master import MasterWeights

if TYPE_CHECKING:
    from torch.optim.optimizer import Kwargs, StateDict


@runtime_checkable
class WeightKeeper(Protocol):
    """Everything the stepper asks of a weight mode, in step order. The keeper owns its gradients' round trip: a read
    with ``absorb=True`` takes in what was written on the model's side since the unscale, :meth:`clip_` (by norm or by
    value) shows the clipped values again, and ``end_step_(..., None)`` forgets a dropped step's gradients.
    :class:`~lit_mpstable.core.weights.keeper.Keeper` writes each method once; the weight modes override its hooks.

    Attributes:
        mode: ``None`` (plain), ``"fp32"``, ``"kahan"`` or ``"stochastic"``.
        state_key: the key of the stepper's state dict this keeper fills (``"masters"``, ``"compact"``; None: none).
        defers_unscale: the gradients stay scaled (and 16-bit) until the step unscales them in FP32 (compact).
        exposes_grads: the model's gradients are a copy of the keeper's FP32 ones, shown again after a clip.
    """

    @property
    def mode(self) -> str | None: ...  # read only: compact weights narrow it to their two modes
    state_key: str | None
    defers_unscale: bool
    exposes_grads: bool

    def adopt_optimizer_(self, optimizer: Optimizer) -> None: ...
    def follow_model_weights_(self, replicas: ProcessGroup | None = None, *,
                              recast: Sequence[tuple[nn.Parameter, torch.Tensor]] | None = None) -> list[str]: ...
    def unscale_(self, optimizer: Optimizer, checker: LossScaler | None,
                 scaler: object, device: torch.device | str) -> None: ...
    def grads(self, optimizer: Optimizer, *, absorb: bool = False) -> GradView: ...
    def clip_(self, optimizer: Optimizer, *, max_norm: float | torch.Tensor | None = None, norm_type: float = 2.0,
              clip_value: float | None = None, total_norm: torch.Tensor | None = None) -> torch.Tensor | None: ...
    def end_step_(self, optimizer: Optimizer, checker: LossScaler | None,
                  step_kwargs: Kwargs | None) -> tuple[object, bool]: ...
    def fp32_weights(self) -> dict[str, torch.Tensor]: ...
    def state_tensors(self) -> list[torch.Tensor]: ...
    def state_dict(self) -> dict[str, object]: ...
    def load_state_dict(self, state: StateDict, *, carry_into: nn.Module | None = None, saved: str = "",
                        target: str = "") -> str | None: ...


def make_keeper(
    mode: str | None, module: nn.Module, optimizers: Sequence[Optimizer], *, owner: str, precision: str,
    dtype: torch.dtype, checker: LossScaler | None, fsdp2: bool = False,
    initial: Mapping[str, torch.Tensor] | None = None, warnings: Notes | None = None,
    optimizer_state: str = "fp32",
) -> WeightKeeper:
    """The keeper of ``master_weights=mode`` bound to ``module`` and ``optimizers`` (``mode=None``: plain). Under FSDP2
    it is plain whatever the mode: FSDP2's FP32 sharded parameters are the masters. ``optimizer_state``: where the
    masters' or compact weights' Adam/AdamW moments live (``"fp32"``: in the optimizer, as always).

    Raises:
        ValueError: compact weights with a scaler that cannot check without unscaling; BF16/FP8 moments under FSDP2,
            or with an optimizer other than torch's Adam/AdamW (or one of their options the moment step lacks).
    """
    if fsdp2 and optimizer_state != "fp32":
        raise ValueError(
            f"{owner}({precision!r}, optimizer_state={optimizer_state!r}): under FSDP2 the optimizer steps DTensor"
            " shards itself, so its moments stay in the optimizer; use optimizer_state='fp32' with FSDP2 (or an"
            " 8-bit optimizer such as torchao's AdamW8bit)."
        )
    if mode == "fp32" and not fsdp2:
        return MasterWeights(module, optimizers, dtype=dtype, initial=initial, optimizer_state=optimizer_state,
                             owner=owner)
    if not fsdp2 and mode in ("kahan", "stochastic"):
        return CompactWeights(module, optimizers, cast(CompactMode, mode), seed=torch.initial_seed() % 2**31,
                              owner=owner, precision=precision, checker=checker,
                              notes=warnings if warnings is not None else Notes(), optimizer_state=optimizer_state)
    return PlainKeeper(owner, fp16_state=precision == "16-true" and mode is None)

"""The ``WeightKeeper`` protocol: how a weight mode keeps the trainable weights through a step, and the plain keeper.

A weight mode is one object the stepper calls in step order, never an ``if`` on the mode: :class:`PlainKeeper`
(the model's own parameters, also FSDP2's FP32 shards, which are the masters there),
:class:`~lit_mpstable.core.weights.master.MasterWeights` (FP32 masters owned by the optimizers) and
:class:`~lit_mpstable.core.weights.compact.CompactWeights` (16-bit weights with Kahan compensation or stochastic
rounding). :func:`make_keeper` builds the one a run's ``master_weights`` asks for.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lit_mpstable.base.notes import Notes
from lit_mpstable.core.scaling.scalers import LossScaler
from lit_mpstable.core.weights.carry import carry_precise_state_
from lit_mpstable.core.weights.compact import CompactMode, CompactWeights
from lit_mpstable.core.weights.compact_slices import cast_state_
from lit_mpstable.core.weights.keeper_steps import GradView, clip_either_, clip_norm_, step_checked, unscale_checked_
from lit_mpstable.core.weights.master import MasterWeights


@runtime_checkable
class WeightKeeper(Protocol):
    """Everything the stepper asks of a weight mode, in step order. The keeper owns its gradients' round trip: a read
    with ``absorb=True`` takes in what was written on the model's side since the unscale, :meth:`clip_` (by norm or by
    value) shows the clipped values again, and ``end_step_(..., None)`` forgets a dropped step's gradients.

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
    def follow_model_weights_(self, replicas: ProcessGroup | None = None) -> list[str]: ...
    def unscale_(self, optimizer: Optimizer, checker: LossScaler | None,
                 scaler: object, device: torch.device | str) -> None: ...
    def clip_(self, optimizer: Optimizer, *, max_norm: float | torch.Tensor | None = None, norm_type: float = 2.0,
              clip_value: float | None = None, total_norm: torch.Tensor | None = None) -> torch.Tensor | None: ...
    def end_step_(self, optimizer: Optimizer, checker: LossScaler | None,
                  step_kwargs: dict[str, Any] | None) -> tuple[Any, bool]: ...
    def grads(self, optimizer: Optimizer, *, absorb: bool = False) -> GradView: ...
    def fp32_weights(self) -> dict[str, torch.Tensor]: ...
    def state_tensors(self) -> list[torch.Tensor]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def carry_(self, module: nn.Module, masters: dict[str, Any], compact: dict[str, Any], *, saved: str,
               target: str) -> str | None: ...
    def follow_recast_(self, changed: Sequence[tuple[nn.Parameter, torch.Tensor]]) -> None: ...


class PlainKeeper:
    """The model's parameters are the weights the optimizer updates: ``*-mixed``, ``32-true``, ``*-true`` without
    masters, and FSDP2 (its FP32 sharded parameters are the masters; it casts for compute itself).

    Args:
        owner: the class name error messages use.
        fp16_state: the optimizer state is FP16 (``"16-true"`` without masters): :meth:`check_eps` refuses an
            ``eps`` FP16 cannot hold.
    """

    mode: str | None = None
    state_key: str | None = None
    defers_unscale = False
    exposes_grads = False

    def __init__(self, owner: str = "PrecisionStepper", *, fp16_state: bool = False) -> None:
        self.owner = owner
        self.fp16_state = fp16_state
        self.optimizers: list[Optimizer] = []

    def follow_recast_(self, changed: Sequence[tuple[nn.Parameter, torch.Tensor]]) -> None:
        # The optimizer steps the parameters themselves, whatever their dtype, but its per-element state must follow
        # a parameter a fallback or restore recast (``*-true``): Adam's lerp_ refuses a BF16 moment with an FP32 grad.
        # Its .grad follows too: a forward before the next zero_grad (Lightning's order) would otherwise meet an FP32
        # parameter with a BF16 gradient, which breaks a compiled graph.
        for param, _ in changed:
            for optimizer in self.optimizers:
                cast_state_(optimizer, param)
            if param.grad is not None and param.grad.dtype != param.dtype:
                param.grad = param.grad.to(param.dtype)

    def check_eps(self, optimizers: Iterable[Optimizer]) -> None:
        if self.fp16_state:
            check_eps(self.owner, optimizers)

    def adopt_optimizer_(self, optimizer: Optimizer) -> None:
        if optimizer not in self.optimizers:
            self.optimizers.append(optimizer)

    def follow_model_weights_(self, replicas: ProcessGroup | None = None) -> list[str]:
        return []  # the optimizer steps the model's own weights, which DDP broadcast: nothing else to agree on

    def unscale_(self, optimizer: Optimizer, checker: LossScaler | None,
                 scaler: object, device: torch.device | str) -> None:
        unscale_checked_(optimizer, checker, scaler, device)

    def absorb_grads_(self, optimizer: Optimizer) -> None:
        pass

    def clip_grad_norm_(
        self, optimizer: Optimizer, max_norm: float, norm_type: float, total_norm: torch.Tensor | None = None
    ) -> torch.Tensor:
        return clip_norm_(list(_with_grads(optimizer)), max_norm, norm_type, total_norm)

    def clip_grad_value_(self, optimizer: Optimizer, clip_value: float) -> None:
        torch.nn.utils.clip_grad_value_(_with_grads(optimizer), clip_value)

    def expose_grads_(self, optimizer: Optimizer) -> None:
        pass

    def clip_(self, optimizer: Optimizer, *, max_norm: float | torch.Tensor | None = None, norm_type: float = 2.0,
              clip_value: float | None = None, total_norm: torch.Tensor | None = None) -> torch.Tensor | None:
        return clip_either_(self.clip_grad_norm_, self.clip_grad_value_, optimizer, max_norm, norm_type, clip_value,
                            total_norm)

    def end_step_(self, optimizer: Optimizer, checker: LossScaler | None,
                  step_kwargs: dict[str, Any] | None) -> tuple[Any, bool]:
        """Step (``step_kwargs``: the optimizer's keyword arguments) or, with None, drop this iteration's gradients."""
        if step_kwargs is None:
            self.drop_(optimizer)
            return None, True
        return self.checked_step_(optimizer, checker, **step_kwargs)

    def grads(self, optimizer: Optimizer, *, absorb: bool = False) -> GradView:
        return GradView(self.grad_holders(optimizer), self.grad_multiplier(optimizer))

    def checked_step_(self, optimizer: Optimizer, checker: LossScaler | None, **kwargs: Any) -> tuple[Any, bool]:
        return step_checked(optimizer, checker, None, kwargs)

    def drop_(self, optimizer: Optimizer) -> None:
        pass

    def grad_holders(self, optimizer: Optimizer) -> list[torch.Tensor]:
        return [p for group in optimizer.param_groups for p in group["params"]]

    def grad_multiplier(self, optimizer: Optimizer) -> torch.Tensor | None:
        return None  # the gradients are true values after unscale_

    def fp32_weights(self) -> dict[str, torch.Tensor]:
        return {}

    def state_tensors(self) -> list[torch.Tensor]:
        return []

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def carry_(self, module: nn.Module, masters: dict[str, Any], compact: dict[str, Any], *, saved: str,
               target: str) -> str | None:
        return carry_precise_state_(module, masters, compact, master=None, compact_weights=None, saved=saved,
                                    target=target)


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


def check_eps(owner: str, optimizers: Iterable[Optimizer]) -> None:
    """Refuse, in ``'16-true'`` without masters (the optimizer state is FP16), an ``eps`` below FP16's smallest
    normal number: rounded to 0 (Adam's default 1e-8), a parameter whose gradient is 0 (a dead ReLU) gets
    ``0 / 0 = NaN`` at its first step; subnormal, the steps of parameters whose second moment underflows grow to
    ``lr * m / eps`` and overflow the next forward. Either way every later step is skipped. Only torch's own
    optimizers are checked: they compute in the parameters' dtype (torchao's and bitsandbytes' 8-bit ones in
    FP32)."""
    tiny = torch.finfo(torch.float16).tiny  # 2**-14: below it FP16 rounds to a subnormal or to 0
    for optimizer in optimizers:
        if not type(optimizer).__module__.startswith("torch.optim."):
            continue
        for index, group in enumerate(optimizer.param_groups):
            eps = group.get("eps")
            if isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 <= eps < tiny:
                held = float(torch.tensor(eps, dtype=torch.float16))
                raise ValueError(
                    f"{owner}('16-true', master_weights=False): {type(optimizer).__name__} param group"
                    f" {index} has eps={eps!r}, which FP16 (the dtype of its state) holds as {held!r}: a"
                    " parameter with a zero gradient gets 0/0 = NaN, or one whose second moment underflows a step"
                    f" of lr * m / eps, and the run stalls on skipped steps. The smallest normal FP16 eps is"
                    f" {tiny:.3g} (2**-14; the smallest nonzero is 5.96e-08); use eps=1e-4, or"
                    " master_weights=True (FP32 masters and FP32 optimizer state keep eps=1e-8)."
                )


def _with_grads(optimizer: Optimizer) -> Iterator[torch.Tensor] | list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]

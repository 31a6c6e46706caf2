"""The FP32-masters weight keeper: :class:`~lit_mpstable.core.weights.master.MasterWeights` behind the
:class:`~lit_mpstable.core.weights.weights.WeightKeeper` protocol."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lit_mpstable.core.replicas import agree_seed
from lit_mpstable.core.scaling.scalers import LossScaler
from lit_mpstable.core.weights.carry import carry_precise_state_
from lit_mpstable.core.weights.keeper_steps import clip_norm_, step_checked, unscale_checked_
from lit_mpstable.core.weights.master import MasterWeights
from lit_mpstable.core.weights.moment_keeper import KEY, AdamMoments, split_moments


class MasterKeeper:
    """The :class:`~lit_mpstable.core.weights.weights.WeightKeeper` of FP32 masters (``master_weights=True``): the
    gradients go into the masters before anyone reads them, the optimizers step the masters, the 16-bit weights follow.

    ``dtype``: the model's 16-bit dtype (a trainable parameter of it met later gets a master at its first unscale);
    ``initial``: FP32 values to start the masters from (see :class:`MasterWeights`); ``optimizer_state``: ``"bf16"``
    or ``"fp8"`` keeps Adam/AdamW moments in :class:`~lit_mpstable.core.weights.moment_keeper.AdamMoments` and steps the
    masters through them (``"fp32"``: ``optimizer.step()``, as always).
    """

    mode: str | None = "fp32"
    state_key: str | None = "masters"
    defers_unscale = False
    exposes_grads = True

    def __init__(self, module: nn.Module, optimizers: Sequence[Optimizer], *, dtype: torch.dtype,
                 initial: Mapping[str, torch.Tensor] | None = None, optimizer_state: str = "fp32",
                 owner: str = "PrecisionStepper") -> None:
        self.weights = MasterWeights(module, optimizers, initial=initial)
        self.dtype = dtype
        self.module = module
        self.moments: AdamMoments | None = None
        if optimizer_state != "fp32":
            self.moments = AdamMoments(optimizer_state, seed=torch.initial_seed() % 2**31, owner=owner)
            for optimizer in optimizers:
                self.moments.bind_(optimizer, self._names())
        self.follow_recast_ = self.weights.follow_recast_  # a fallback to FP32 computes with the masters

    def check_eps(self, optimizers: Iterable[Optimizer]) -> None:
        pass  # FP32 optimizer state holds any eps

    def _names(self) -> dict[int, str]:
        # Masters by their parameter's name, and the optimizer's FP32 parameters (islands) by their own.
        names = {id(p): name for name, p in self.module.named_parameters()}
        names.update((id(master), name) for name, master, _ in self.weights.named_pairs())
        return names

    def adopt_optimizer_(self, optimizer: Optimizer) -> None:
        self.weights.bind_new_(optimizer)
        if self.moments is not None:
            self.moments.bind_(optimizer, self._names())

    @torch.no_grad()
    def follow_model_weights_(self, replicas: ProcessGroup | None = None) -> list[str]:
        """Restart from its 16-bit weight every master whose rounding that weight no longer is (weights loaded into
        the model after the masters were bound); returns their names. One host sync. ``replicas``: the process group
        of DDP replicas: first the masters (and the moments' seed) are taken from its first rank."""
        if replicas is not None:
            self.weights.broadcast_(replicas)
            if self.moments is not None:
                self.moments.reseed_(agree_seed(self.moments.seed, replicas, _device(self.module)))
        pairs = list(self.weights.named_pairs())
        if not pairs:
            return []
        stale = torch.stack([(master.to(param.dtype) != param).any() for _, master, param in pairs]).tolist()
        for (_, master, param), changed in zip(pairs, stale):
            if changed:
                master.copy_(param)
        return [name for (name, _, _), changed in zip(pairs, stale) if changed]

    def unscale_(self, optimizer: Optimizer, checker: LossScaler | None,
                 scaler: object, device: torch.device | str) -> None:
        if any(p.requires_grad and p.dtype == self.dtype for g in optimizer.param_groups for p in g["params"]):
            self.weights.bind_new_(optimizer)  # added (add_param_group) or unfrozen since setup
            if self.moments is not None:
                self.moments.bind_(optimizer, self._names())
        self.weights.copy_grads_to_master_(optimizer)
        unscale_checked_(optimizer, checker, scaler, device)
        self.weights.expose_grads_(optimizer, copy=scaler is not None)

    def absorb_grads_(self, optimizer: Optimizer) -> None:
        self.weights.absorb_grads_(optimizer)

    def clip_grad_norm_(
        self, optimizer: Optimizer, max_norm: float, norm_type: float, total_norm: torch.Tensor | None = None
    ) -> torch.Tensor:
        self.weights.absorb_grads_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = clip_norm_(params, max_norm, norm_type, total_norm)
        self.weights.expose_grads_(optimizer)  # hooks after this see the clipped values
        return norm

    def clip_grad_value_(self, optimizer: Optimizer, clip_value: float) -> None:
        self.weights.absorb_grads_(optimizer)
        torch.nn.utils.clip_grad_value_([p for g in optimizer.param_groups for p in g["params"] if p.grad is not None],
                                        clip_value)
        self.weights.expose_grads_(optimizer)

    def expose_grads_(self, optimizer: Optimizer) -> None:
        self.weights.expose_grads_(optimizer)

    def step_(self, optimizer: Optimizer, checker: LossScaler | None, **kwargs: Any) -> tuple[Any, bool]:
        moments = self.moments
        update = None if moments is None else (lambda: moments.step_(optimizer, self._names(), **kwargs))
        output, skipped = step_checked(optimizer, checker, update, kwargs)
        if not skipped:
            self.weights.refresh_model_(optimizer)
        self.weights.zero_model_grads_(optimizer)
        return output, skipped

    def drop_(self, optimizer: Optimizer) -> None:
        self.weights.zero_model_grads_(optimizer)

    def grad_multiplier(self, optimizer: Optimizer) -> torch.Tensor | None:
        return None  # the masters' gradients are true values after unscale_

    def grad_holders(self, optimizer: Optimizer) -> list[torch.Tensor]:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if id(optimizer) in self.weights._names_by_optimizer:
            params += self.weights._select(optimizer)[1]
        return params

    def named_grads(self, module: nn.Module) -> list[tuple[str, torch.Tensor]]:
        masters = self.fp32_weights()
        return [(name, masters.get(name, p)) for name, p in module.named_parameters()]

    def fp32_weights(self) -> dict[str, torch.Tensor]:
        return {name: master for name, master, _ in self.weights.named_pairs()}

    def state_tensors(self) -> list[torch.Tensor]:
        return [] if self.moments is None else self.moments.tensors()

    def state_dict(self) -> dict[str, Any]:
        """The masters by name, and with BF16/FP8 moments their state under ``"optimizer_state"``."""
        state: dict[str, Any] = dict(self.weights.state_dict())
        if self.moments is not None:
            state[KEY] = self.moments.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state, moments = split_moments("MasterKeeper", state, self.moments)
        self.weights.load_state_dict(state)
        if self.moments is not None:
            self.moments.load_state_dict(moments)

    def carry_(self, module: nn.Module, masters: dict[str, Any], compact: dict[str, Any], *, saved: str,
               target: str) -> str | None:
        return carry_precise_state_(module, masters, compact, master=self.weights, compact_weights=None, saved=saved,
                                    target=target)


def _device(module: nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))

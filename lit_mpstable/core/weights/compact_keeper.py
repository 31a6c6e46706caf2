"""The ``WeightKeeper`` of compact weights (``master_weights="kahan"``/``"stochastic"``) around CompactWeights."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lit_mpstable.base.notes import Notes
from lit_mpstable.core.replicas import agree_seed, broadcast_
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler
from lit_mpstable.core.scaling.scalers import LossScaler
from lit_mpstable.core.tensors import grad_norms
from lit_mpstable.core.weights.carry import carry_precise_state_
from lit_mpstable.core.weights.compact import CompactMode, CompactWeights
from lit_mpstable.core.weights.compact_slices import LOW, Piece, transform
from lit_mpstable.core.weights.keeper_steps import first_grad_device, step_checked
from lit_mpstable.core.weights.moment_keeper import KEY, AdamMoments, split_moments


class CompactKeeper:
    """16-bit weights updated through transient FP32 views. The gradients stay as they are (scaled, 16-bit) until the
    FP32 chunks of the step unscale them: the check at :meth:`unscale_` only looks (``check_``), and the unscale and
    clip factors wait per optimizer until the step (the 16-bit gradients are not rounded twice).

    With ``optimizer_state="bf16"``/``"fp8"`` exact Adam/AdamW groups are stepped one whole parameter at a time
    through :class:`~lit_mpstable.core.weights.moment_keeper.AdamMoments` (FP32 copy of the weight, plus its
    compensation, stepped and rounded back) instead of the optimizer's step on FP32 stand-ins.

    Raises:
        ValueError: the scaler cannot check without unscaling (compact weights unscale in FP32 themselves).
    """

    state_key: str | None = "compact"
    defers_unscale = True
    exposes_grads = False

    def __init__(self, module: nn.Module, optimizers: Sequence[Optimizer], mode: str, *, owner: str, precision: str,
                 checker: LossScaler | None, warnings: Notes, optimizer_state: str = "fp32") -> None:
        if checker is not None and not checker.checks_without_unscaling:
            raise ValueError(
                f"{owner}({precision!r}, master_weights={mode!r},"
                f" scaler={type(checker).__name__}(...)): compact weights unscale in FP32 themselves and need"
                " a scaler that checks without unscaling (check_()); use scaler='dynamic' or DynamicLossScaler."
            )
        compact_mode = cast(CompactMode, mode)  # make_keeper passes 'kahan' or 'stochastic' only
        self.weights = CompactWeights(module, optimizers, compact_mode, seed=torch.initial_seed() % 2**31)
        self.mode: str | None = mode
        self.follow_recast_ = self.weights.follow_recast_  # a fallback carries the compensation
        self._pending: dict[int, list[Any]] = {}  # per optimizer this iteration: [multiplier, clip value]
        self.module = module
        self.moments: AdamMoments | None = None
        if optimizer_state != "fp32":
            self.moments = AdamMoments(optimizer_state, seed=self.weights.seed, owner=owner)
            names = {id(p): name for name, p in module.named_parameters()}
            for optimizer in optimizers:
                self.moments.bind_(optimizer, names)
        if precision == "16-true":
            warnings.add(
                f"compact-16-true:{mode}",
                f"{owner}('16-true', master_weights={mode!r}): optimizer state stays FP16, where"
                " Adam's second moment (about 1e-3 * grad**2) falls into the subnormal range for gradients below"
                " ~1e-2 and its rounding distorts the steps; with Adam-family optimizers prefer 'bf16-true' or"
                " master_weights=True (SGD-like optimizers are fine)."
            )

    def check_eps(self, optimizers: Iterable[Optimizer]) -> None:
        pass

    def adopt_optimizer_(self, optimizer: Optimizer) -> None:
        pass  # bound at its first unscale_ (bind_new_ is cheap and runs every step)

    @torch.no_grad()
    def follow_model_weights_(self, replicas: ProcessGroup | None = None) -> list[str]:
        """The weights are the model's own: nothing to follow. ``replicas``: the process group of DDP replicas: the
        compensation and the seed of stochastic rounding (weights, optimizer state, BF16/FP8 moments) are taken from
        its first rank, so every replica rounds alike."""
        if replicas is not None:
            weights = self.weights
            broadcast_([comp for _, _, comp in sorted(weights.named_buffers(), key=lambda item: item[0])
                        if comp is not None], replicas)
            device = next((p.device for p in self.module.parameters()), torch.device("cpu"))
            weights.seed = agree_seed(weights.seed, replicas, device)
            if self.moments is not None:
                self.moments.reseed_(weights.seed)
        return []

    def unscale_(self, optimizer: Optimizer, checker: LossScaler | None,
                 scaler: object, device: torch.device | str) -> None:
        self.weights.bind_new_(optimizer)
        if self.moments is not None:
            self.moments.bind_(optimizer, {id(p): name for name, p in self.module.named_parameters()})
        multiplier: torch.Tensor | None = None
        if checker is not None:
            checker.check_grads_(optimizer, first_grad_device(optimizer) or device, unscale=False)
            if isinstance(scaler, DynamicLossScaler):
                multiplier = scaler.get_scale_tensor().reciprocal()
        self._pending[id(optimizer)] = [multiplier, None]

    def absorb_grads_(self, optimizer: Optimizer) -> None:
        pass

    def clip_grad_norm_(
        self, optimizer: Optimizer, max_norm: float, norm_type: float, total_norm: torch.Tensor | None = None
    ) -> torch.Tensor:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        pending = self._pending[id(optimizer)]
        multiplier = pending[0] if pending[0] is not None else torch.ones((), device=grads[0].device if grads else None)
        if not grads:
            return torch.zeros(())
        if total_norm is not None:  # a SpikeGuard's norm of the same gradients, times the same multiplier
            norm = total_norm
        else:
            per_tensor = grad_norms(grads, norm_type)
            norm = torch.linalg.vector_norm(torch.stack(per_tensor), norm_type) * multiplier  # true gradients, FP32
        # clip_grad_norm_'s rule, as a factor for the step's FP32 chunks: no host sync.
        coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        pending[0] = multiplier * coefficient
        return norm

    def clip_grad_value_(self, optimizer: Optimizer, clip_value: float) -> None:
        pending = self._pending[id(optimizer)]
        if clip_value != clip_value:  # NaN: torch's clamp makes every gradient NaN, so the step is skipped (the check
            # of the pending factor sees it), as in the other weight modes
            device = first_grad_device(optimizer)
            pending[0] = (pending[0] if pending[0] is not None else torch.ones((), device=device)) * float("nan")
            return
        pending[1] = float(clip_value) if pending[1] is None else min(pending[1], float(clip_value))

    def expose_grads_(self, optimizer: Optimizer) -> None:
        pass

    def step_(self, optimizer: Optimizer, checker: LossScaler | None, **kwargs: Any) -> tuple[Any, bool]:
        multiplier, clip = self._pending.pop(id(optimizer), [None, None])
        weights = self.weights
        update = lambda: weights.step_(optimizer, grad_multiplier=multiplier, clip_value=clip, **kwargs)  # noqa: E731
        if self.moments is not None:
            update = lambda: self._moment_step_(optimizer, multiplier, clip, kwargs)  # noqa: E731
        return step_checked(optimizer, checker, update, kwargs)

    @torch.no_grad()
    def _moment_step_(self, optimizer: Optimizer, multiplier: torch.Tensor | None, clip: float | None,
                      kwargs: dict[str, Any]) -> Any:
        """The step with BF16/FP8 moments: per parameter, its FP32 value (Kahan: plus the compensation) is stepped
        with the FP32 gradient (unscaled, clipped) and rounded back as :meth:`CompactWeights.step_` rounds."""
        weights, moments = self.weights, self.moments
        assert moments is not None
        weights.steps += 1  # the weights' random keys advance as with the optimizer's step

        def update(p: torch.Tensor, name: str, step_fn: Callable[[torch.Tensor, torch.Tensor], object]) -> None:
            assert p.grad is not None  # update() runs on the parameters that have a gradient
            grad = transform(p.grad.to(torch.float32, copy=True), multiplier, clip)
            p.grad = None
            if p.dtype not in LOW:  # an FP32 island, or cast to FP32 by a fallback: stepped in place
                comp = weights._comp.get(name)
                if comp is not None:
                    comp.zero_()  # follow_recast_ moved it into the weight already
                step_fn(p.data, grad)
                return
            value = p.detach().to(torch.float32, copy=True)
            comp = weights._comp.get(name)
            if comp is not None:
                value.add_(comp)
            step_fn(value, grad)
            weight = p.detach()
            if comp is not None:
                weight.copy_(value)  # round to nearest; the residual is exact in FP32
                comp.copy_(value.sub_(weight))
            else:
                weights._round_(weight, value, Piece(0, cast(nn.Parameter, p), name, 0, p.numel(), 0), [])

        return moments.step_(optimizer, {id(p): name for name, p in self.module.named_parameters()}, update, **kwargs)

    def drop_(self, optimizer: Optimizer) -> None:
        self._pending.pop(id(optimizer), None)

    def grad_multiplier(self, optimizer: Optimizer) -> torch.Tensor | None:
        """The unscale factor the step still owes the 16-bit gradients (None: nothing pending)."""
        pending = self._pending.get(id(optimizer))
        return pending[0] if pending else None

    def grad_holders(self, optimizer: Optimizer) -> list[torch.Tensor]:
        return [p for group in optimizer.param_groups for p in group["params"]]

    def named_grads(self, module: nn.Module) -> list[tuple[str, torch.Tensor]]:
        return list(module.named_parameters())

    def fp32_weights(self) -> dict[str, torch.Tensor]:
        """A Kahan weight is its 16-bit part plus its compensation; stochastic rounding keeps nothing more."""
        return {name: p.detach().float() + c.float() for name, p, c in self.weights.named_buffers() if c is not None}

    def state_tensors(self) -> list[torch.Tensor]:
        comp = [c for _, _, c in self.weights.named_buffers() if c is not None]
        return comp + (self.moments.tensors() if self.moments is not None else [])

    def state_dict(self) -> dict[str, Any]:
        """CompactWeights' state, and with BF16/FP8 moments their state under ``"optimizer_state"``."""
        state = self.weights.state_dict()
        if self.moments is not None:
            state[KEY] = self.moments.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state, moments = split_moments("CompactKeeper", state, self.moments)
        self.weights.load_state_dict(state)
        if self.moments is not None:
            self.moments.load_state_dict(moments)

    def carry_(self, module: nn.Module, masters: dict[str, Any], compact: dict[str, Any], *, saved: str,
               target: str) -> str | None:
        return carry_precise_state_(module, masters, compact, master=None, compact_weights=self.weights, saved=saved,
                                    target=target)

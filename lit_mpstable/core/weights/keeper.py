"""What every weight keeper shares, written once, and the plain keeper: the checked unscale and step around the
optimizer's own step, the one clip, the gradient read, and carrying a checkpoint's precise weights across modes.

:class:`Keeper` implements :class:`~lit_mpstable.core.weights.weights.WeightKeeper` for the model's own weights; the
FP32 masters (:class:`~lit_mpstable.core.weights.master.MasterWeights`) and compact weights
(:class:`~lit_mpstable.core.weights.compact.CompactWeights`) subclass it and override the private hooks where their
gradients or step differ (``_absorb_``/``_expose_`` around a clip, ``_clip_norm_``/``_clip_value_``, ``_update``,
``_done_``, ``_load_``, ``_recast_``, ``_replicate_``, ``_precise``); where their gradients live, :meth:`grads`, is
each keeper's own.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, cast

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lit_mpstable.core.scaling.scalers import LossScaler
from lit_mpstable.core.tensors import first_grad_device as first_grad_device  # re-exported: the keepers' helper

if TYPE_CHECKING:
    # torch's names: a state dict as loaded (its values unchecked until a load checks them), optimizer.step's kwargs
    from torch.optim.optimizer import Kwargs, StateDict


class GradView(NamedTuple):
    """What the step reads of an optimizer's gradients: the tensors whose ``.grad`` holds them (the model's and the
    masters') and the unscale factor the step still owes them (None: they are true values)."""

    holders: list[torch.Tensor]
    multiplier: torch.Tensor | None


class Keeper:
    """The weight keeper of the model's own weights, and the base of the others: the protocol's methods in step
    order, each written once over the private hooks a weight mode overrides.

    Attributes:
        mode: ``None`` (plain), ``"fp32"``, ``"kahan"`` or ``"stochastic"``.
        state_key: the key of the stepper's state dict this keeper fills (``"masters"``, ``"compact"``; None: none).
        defers_unscale: the gradients stay scaled (and 16-bit) until the step unscales them in FP32 (compact).
        exposes_grads: the model's gradients are a copy of the keeper's FP32 ones, shown again after a clip.
    """

    mode: str | None = None
    state_key: str | None = None
    defers_unscale = False
    exposes_grads = False

    # ------------------------------------------------------------------------------------------ binding
    def adopt_optimizer_(self, optimizer: Optimizer) -> None:
        """Take ``optimizer`` in (a front end that sets optimizers up one at a time)."""

    def follow_model_weights_(
        self, replicas: ProcessGroup | None = None, *, recast: Sequence[tuple[nn.Parameter, torch.Tensor]] | None = None
    ) -> list[str]:
        """Follow the model's weights where they changed outside the keeper; returns the names of the weights whose
        state restarted from them.

        Without ``recast``: weights loaded into the model after the keeper was bound (``replicas``: the process group
        of DDP replicas, whose first rank's state every replica takes first). With ``recast``: parameters a precision
        fallback or restore cast in place (``(parameter, its data before)``): what the keeper holds for them (and
        their per-element optimizer state) follows their new dtype.
        """
        if recast is not None:
            self._recast_(recast)
            return []
        return self._replicate_(replicas)

    # ------------------------------------------------------------------------------------------ the step
    def unscale_(self, optimizer: Optimizer, checker: LossScaler | None,
                 scaler: object, device: torch.device | str) -> None:
        """Unscale ``optimizer``'s gradients in place (unless the keeper :attr:`defers_unscale`) and check them for
        inf/NaN, agreed across ranks (no host sync)."""
        if checker is None:
            return
        # The scale-1 check of scaler=None creates its state where the gradients are (no loss was scaled to create
        # it; ``device`` where there are none). An inf only some ranks see (written after DDP's all-reduce, or in a
        # gradient shard) must skip the step on every rank: the check ends with one all-reduce of the found-inf flag
        # (and the adaptive amax), on the device.
        checker.check_grads_(optimizer, device, unscale=not self.defers_unscale)

    def grads(self, optimizer: Optimizer, *, absorb: bool = False) -> GradView:
        """The tensors holding ``optimizer``'s gradients and the unscale factor still owed them; ``absorb``: first
        take in what was written on the model's side since the unscale (the model's own gradients: nothing)."""
        return GradView([p for group in optimizer.param_groups for p in group["params"]], None)

    def clip_(self, optimizer: Optimizer, *, max_norm: float | torch.Tensor | None = None, norm_type: float = 2.0,
              clip_value: float | None = None, total_norm: torch.Tensor | None = None) -> torch.Tensor | None:
        """Clip ``optimizer``'s true gradients by value (``clip_value``; returns None) or by total norm (``max_norm``;
        returns it, ``total_norm`` when a SpikeGuard judged it already); hooks after it see the clipped values."""
        if (clip_value is None) == (max_norm is None):
            raise TypeError(f"clip_: give exactly one of max_norm and clip_value, got max_norm={max_norm!r} and"
                            f" clip_value={clip_value!r}")
        self._absorb_(optimizer)
        norm = None
        if max_norm is not None:
            norm = self._clip_norm_(optimizer, max_norm, norm_type, total_norm)
        elif clip_value is not None:
            self._clip_value_(optimizer, clip_value)
        self._expose_(optimizer)
        return norm

    def end_step_(self, optimizer: Optimizer, checker: LossScaler | None,
                  step_kwargs: Kwargs | None) -> tuple[object, bool]:
        """Step ``optimizer`` (``step_kwargs``: its keyword arguments) unless the checker found inf/NaN, or, with
        None, drop this iteration's gradients; returns the step's output and whether it was skipped."""
        if step_kwargs is None:
            self._done_(optimizer, stepped=False)
            return None, True
        update = self._update(optimizer, step_kwargs)
        if checker is None:
            output, skipped = (update() if update is not None else optimizer.step(**step_kwargs)), False
        else:
            output = (checker.step_with(optimizer, update) if update is not None
                      else checker.step(optimizer, **step_kwargs))
            skipped = checker.last_step_skipped
        self._done_(optimizer, stepped=not skipped)
        return output, skipped

    # ------------------------------------------------------------------------------------------ views and state
    def fp32_weights(self) -> dict[str, torch.Tensor]:
        """The FP32 values the keeper holds beyond the model's 16-bit weights, by parameter name."""
        return {}

    def state_tensors(self) -> list[torch.Tensor]:
        """Resident tensors the keeper holds that neither the model nor the optimizers do, for memory accounting."""
        return []

    def state_dict(self) -> dict[str, object]:
        return {}

    def load_state_dict(self, state: StateDict, *, carry_into: nn.Module | None = None, saved: str = "",
                        target: str = "") -> str | None:
        """Restore :meth:`state_dict`'s values; or, with ``carry_into`` (the model, its weights loaded from the same
        checkpoint), carry a checkpoint of another weight mode (``state``: its ``{"masters": ..., "compact": ...}``)
        into this run's weights, to the precision they hold (see :meth:`_carry_`).

        Returns:
            With ``carry_into``, a warning for the user when something could not be carried; else ``None``.
        """
        if carry_into is not None:
            return self._carry_(carry_into, state.get("masters", {}), state.get("compact", {}), saved=saved,
                                target=target)
        self._load_(state)
        return None

    # ------------------------------------------------------------------------------------------ the hooks
    def _replicate_(self, replicas: ProcessGroup | None) -> list[str]:
        return []  # the optimizer steps the model's own weights, which DDP broadcast: nothing else to agree on

    def _recast_(self, changed: Sequence[tuple[nn.Parameter, torch.Tensor]]) -> None:
        pass

    def _absorb_(self, optimizer: Optimizer) -> None:
        pass  # the gradients are the model's own: nothing written elsewhere to take in

    def _expose_(self, optimizer: Optimizer) -> None:
        pass

    def _clip_norm_(self, optimizer: Optimizer, max_norm: float | torch.Tensor, norm_type: float,
                    total_norm: torch.Tensor | None) -> torch.Tensor:
        # torch.nn.utils.clip_grad_norm_, with the total_norm when it is known already: the gradients are read once
        # less. A tensor max_norm (ZClip's adaptive limit) works as well: torch divides it by the norm on the device.
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        limit = cast(float, max_norm)
        if total_norm is None:
            return torch.nn.utils.clip_grad_norm_(params, limit, norm_type)
        torch.nn.utils.clip_grads_with_norm_(params, limit, total_norm)
        return total_norm

    def _clip_value_(self, optimizer: Optimizer, clip_value: float) -> None:
        torch.nn.utils.clip_grad_value_(
            [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None], clip_value
        )

    def _update(self, optimizer: Optimizer, kwargs: Kwargs) -> Callable[[], object] | None:
        return None  # optimizer.step(**kwargs)

    def _done_(self, optimizer: Optimizer, *, stepped: bool) -> None:
        pass

    def _load_(self, state: StateDict) -> None:
        pass

    def _precise(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The FP32 masters and the Kahan compensations this keeper holds, by parameter name (carry's targets)."""
        return {}, {}

    @torch.no_grad()
    def _carry_(self, module: nn.Module, masters: Mapping[str, torch.Tensor], compact: StateDict, *,
                saved: str, target: str) -> str | None:
        """Carry what a checkpoint holds beyond its 16-bit weights into a run of another precision or master mode.

        The checkpoint's FP32 values are its FP32 masters (``masters``), or its weights plus their Kahan compensation
        (``compact``; the weights must be loaded into ``module`` already, as Lightning does before the plugin's
        state). They go exactly where this run can hold them: into its FP32 masters, into FP32 weights
        (``*-mixed``, ``"32-true"``, FP32 islands), or into Kahan weights and their compensation (to about 16
        significant bits). Where it cannot (stochastic rounding, no masters) the weights keep the checkpoint's 16-bit
        values and the returned message says how much was dropped. Same-mode state is not handled here.

        Args:
            saved, target: how the checkpoint's and this run's weights are kept, for the message.

        Raises:
            KeyError: a name of the checkpoint's state is not a parameter of ``module``.
            ValueError: a tensor's shape differs from its parameter's.
        """
        call = f"{type(self).__name__}.load_state_dict(carry_into=...)"
        params = dict(module.named_parameters())
        if masters:
            values = {name: value.float() for name, value in masters.items()}
        else:
            comp = compact.get("compensation", {})
            if not comp:
                return None  # stochastic rounding keeps nothing beyond the weights
            unknown = sorted(set(comp) - set(params))
            if unknown:
                raise KeyError(f"{call}: compensation of {unknown} names no parameter of the model.")
            values = {name: params[name].detach().float() + value.float() for name, value in comp.items()}
        unknown = sorted(set(values) - set(params))
        if unknown:
            raise KeyError(f"{call}: {saved} of {unknown} name no parameter of the model.")
        for name, value in values.items():
            if value.shape != params[name].shape:
                raise ValueError(f"{call}: {name!r} has shape {tuple(value.shape)} in the checkpoint,"
                                 f" {tuple(params[name].shape)} in the model.")
        sharded = [name for name in values if type(params[name].data) is not torch.Tensor]
        if sharded:
            return (f"the checkpoint's {saved} were not carried into this run ({target}): {sharded[:4]} are sharded"
                    " (DTensor); resume with the precision and master_weights it was written with.")
        held = {name for name in values if params[name].dtype == torch.float32}
        mastered, comps = self._precise()
        lost = 0.0
        for name, value in values.items():
            param = params[name]
            if name in mastered:
                mastered[name].copy_(value)
                param.copy_(value)  # round to nearest, as refresh_model_ does
            elif name in held:
                param.copy_(value)
            elif name in comps:
                param.copy_(value)
                comps[name].copy_(value - param.float())
            else:
                param.copy_(value)  # nearest: the 16-bit weight closest to the value the run held
                lost = max(lost, float((value - param.float()).abs().max()) if value.numel() else 0.0)
        if lost == 0.0:
            return None
        return (f"the checkpoint's {saved} could not all be carried into this run ({target}): its 16-bit weights hold"
                f" them to nearest rounding, up to {lost:.3g} per weight dropped; resume with master_weights=True"
                " (FP32 masters) or 'kahan', or a '*-mixed' precision, to keep them.")


class PlainKeeper(Keeper):
    """The model's parameters are the weights the optimizer updates: ``*-mixed``, ``32-true``, ``*-true`` without
    masters, and FSDP2 (its FP32 sharded parameters are the masters; it casts for compute itself).

    Args:
        owner: the class name error messages use.
        fp16_state: the optimizer state is FP16 (``"16-true"`` without masters): :meth:`check_eps` refuses an
            ``eps`` FP16 cannot hold.
    """

    def __init__(self, owner: str = "PrecisionStepper", *, fp16_state: bool = False) -> None:
        self.owner = owner
        self.fp16_state = fp16_state
        self.optimizers: list[Optimizer] = []

    def check_eps(self, optimizers: Iterable[Optimizer]) -> None:
        if self.fp16_state:
            check_eps(self.owner, optimizers)

    def adopt_optimizer_(self, optimizer: Optimizer) -> None:
        if optimizer not in self.optimizers:
            self.optimizers.append(optimizer)

    def _recast_(self, changed: Sequence[tuple[nn.Parameter, torch.Tensor]]) -> None:
        # The optimizer steps the parameters themselves, whatever their dtype, but its per-element state must follow
        # a parameter a fallback or restore recast (``*-true``): Adam's lerp_ refuses a BF16 moment with an FP32 grad.
        # Its .grad follows too: a forward before the next zero_grad (Lightning's order) would otherwise meet an FP32
        # parameter with a BF16 gradient, which breaks a compiled graph.
        for param, _ in changed:
            for optimizer in self.optimizers:
                cast_state_(optimizer, param)
            if param.grad is not None and param.grad.dtype != param.dtype:
                param.grad = param.grad.to(param.dtype)


def check_eps(owner: str, optimizers: Iterable[Optimizer], master_weights: str | bool = False) -> None:
    """Refuse, in ``'16-true'`` without FP32 masters (the optimizer state is FP16: ``master_weights`` False, "kahan" or
    "stochastic", named in the message), an ``eps`` below FP16's smallest
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
                    f"{owner}('16-true', master_weights={master_weights!r}): {type(optimizer).__name__} param group"
                    f" {index} has eps={eps!r}, which FP16 (the dtype of its state) holds as {held!r}: a"
                    " parameter with a zero gradient gets 0/0 = NaN, or one whose second moment underflows a step"
                    f" of lr * m / eps, and the run stalls on skipped steps. The smallest normal FP16 eps is"
                    f" {tiny:.3g} (2**-14; the smallest nonzero is 5.96e-08); use eps=1e-4, or"
                    " master_weights=True (FP32 masters and FP32 optimizer state keep eps=1e-8)."
                )


def cast_state_(optimizer: Optimizer, param: torch.Tensor) -> None:
    """The per-element floating state of ``param`` in ``optimizer`` in the parameter's dtype (after a recast)."""
    state = optimizer.state.get(param)
    if state:
        non_castable = getattr(optimizer, "non_castable_tensor_keys", ())
        for key, value in state.items():
            if per_element(key, value, param, non_castable) and value.dtype != param.dtype:
                state[key] = value.to(param.dtype)


def per_element(key: object, value: object, param: torch.Tensor, non_castable: Container[object]) -> bool:
    # Exactly what torch's Optimizer.load_state_dict casts to the parameter's dtype (floating, not "step"), unless the
    # optimizer opts out (bitsandbytes), and per element: so it is 16-bit between steps and round-trips bit for bit.
    return (
        type(value) is torch.Tensor and value.is_floating_point() and key != "step" and key not in non_castable
        and value.shape == param.shape
    )

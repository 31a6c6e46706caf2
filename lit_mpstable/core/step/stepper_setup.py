"""How the stepper meets the model and the optimizers: the layout applied, FSDP2 recognised and checked, the weight
keeper bound, state loaded before them handed over, and the run moved onto the model's device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lit_mpstable.core.layout.fsdp import check_fsdp_policies, setup_fsdp2, unsharded_message
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler
from lit_mpstable.core.step.stepper_state import adopt_recast_state_
from lit_mpstable.core.weights.weights import make_keeper


def setup_module(stepper: Any, module: nn.Module, *, fsdp2: bool) -> nn.Module:
    """``PrecisionStepper.setup_module``: see its docstring."""
    if stepper._skip_requested:  # no step is in progress between fits: the request must not eat the next first batch
        stepper._skip_requested = False
        stepper.warnings.add("skip-step-outside", f"{stepper.owner}.skip_step() was called outside a step (between"
                             " fits): ignored; call it during a step (before optimizer_step), e.g. from"
                             " on_before_backward.")
    stepper.fsdp2, sharded, stepper.layout.cast_parameters = setup_fsdp2(
        stepper.owner, stepper.precision, module, requested=fsdp2, master_mode=stepper.master_mode, fp8=stepper.fp8,
        swapped_elsewhere=stepper.layout.module is not module, true_16bit=stepper.true_16bit,
    )
    if not stepper.fsdp2 and stepper.master_mode == "fp32" and stepper.keeper.mode != "fp32":
        # Masters start from these FP32 values, not from their 16-bit rounding (kept until the optimizers come).
        stepper._initial = {name: p.detach().clone() for name, p in module.named_parameters()
                            if p.requires_grad and p.dtype == torch.float32}
    if stepper.fsdp2 and stepper.fp8_budget.budget is not None:
        raise ValueError(
            f"{stepper.owner}(fp8=FP8Config(keep_high_precision={stepper.fp8_budget.budget!r})) with FSDP2: the probe's"
            " choice moves layers out of FP8 after the first step, when fully_shard has already bound them; use"
            f" HighPrecisionBudget(fraction={stepper.fp8_budget.budget.fraction}, by='last') (decided before"
            " sharding).")
    stepper.layout.attach(module, stepper.device)
    stepper.fp8_budget.attach_(stepper.layout)  # a probe choice loaded before the model: before the layout's state
    if "layout" in stepper._pending:
        stepper.layout.load_state_dict(stepper._pending.pop("layout"))
    adopt_recast_state_(stepper, stepper.optimizers, weights=True)  # a resumed fallback's FP32 values, loaded before
    stepper.observer.attach(module)
    if stepper.growth is not None:  # after the FP8 swap: the hooks go on the layers that run
        stepper.growth.detach()
        stepper.growth.attach(module, hooks="on_demand")  # hooked in forward_context on sampling steps only
    if sharded:
        check_fsdp_policies(module, stepper.precision, master_weights=stepper.master_mode is not None,
                            islands=stepper.layout.islands.names, owner=stepper.owner)
    stepper._fsdp_checked = sharded
    return module


def setup_optimizers(stepper: Any, module: nn.Module, optimizers: Sequence[Optimizer], schedulers: list[Any]) -> None:
    """``PrecisionStepper.setup_optimizers``: see its docstring."""
    if stepper.layout.module is None:
        raise RuntimeError(
            f"{stepper.owner}.setup_optimizers: call setup_module(module) first; without it the model keeps its"
            f" FP32 weights and no precision layout ({stepper.precision!r}, FP32 islands, FP8), and trains in FP32.")
    stepper.optimizers = list(optimizers)
    adopt_device(stepper, module)
    for scaler in (stepper.scaler, stepper._checker):  # the scale-1 check of scaler=None unscales FP16 gradients too
        if isinstance(scaler, DynamicLossScaler):
            scaler.allow_fp16_grads = stepper.precision == "16-true" and stepper.master_mode is None
    if stepper.fsdp2 and stepper.true_16bit and not stepper._fsdp_checked:
        raise ValueError(unsharded_message(stepper.owner, stepper.precision, module))
    stepper.check_eps(optimizers)
    if stepper.master_mode is not None:  # plain needs no binding (the plain keeper checked eps above)
        stepper.keeper = make_keeper(
            stepper.master_mode, module, optimizers, owner=stepper.owner, precision=stepper.precision,
            dtype=stepper.dtype, checker=stepper._checker, fsdp2=stepper.fsdp2, initial=stepper._initial,
            warnings=stepper.warnings, optimizer_state=stepper.optimizer_state,
        )
        stepper._initial = {}
    else:
        stepper.keeper.optimizers = list(optimizers)  # their state follows a fallback's recast of the parameters
    stepper.layout.after_recast = stepper.keeper.follow_recast_  # a fallback carries what the keeper holds
    key = stepper.keeper.state_key
    if key is not None and key in stepper._pending:
        stepper.keeper.load_state_dict(stepper._pending.pop(key))
    adopt_recast_state_(stepper, list(optimizers))  # a resumed fallback's FP32 optimizer state, loaded before
    stepper.schedules.hold(list(schedulers))


def adopt_device(stepper: Any, module: nn.Module) -> None:
    """``PrecisionStepper.adopt_device_``: see its docstring."""
    device_type = next((p.device.type for p in module.parameters()), stepper.device)
    if device_type in ("cpu", "cuda"):
        stepper.device = stepper.layout.islands.device_type = stepper.layout.device_type = device_type
    scaler = stepper._checker  # a foreign scaler's wrapper adopts nothing; ours is stepper.scaler itself
    previous = scaler.adopt_device_(stepper.device) if scaler is not None else None
    if previous is not None and scaler is stepper.scaler:
        stepper.warnings.add(
            f"scaler-adopted:{type(scaler).__name__}:{previous}:{stepper.device}",
            f"{type(scaler).__name__} built for {previous!r} adopted onto the run's device {stepper.device!r}."
        )

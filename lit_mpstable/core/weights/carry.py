"""Carrying a checkpoint's precise weights (FP32 masters, Kahan compensation) into a run of another weight mode."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import torch
from torch import nn


class _Masters(Protocol):  # MasterWeights (which calls carry_precise_state_ itself)
    def named_pairs(self) -> Iterator[tuple[str, nn.Parameter, nn.Parameter]]: ...


class _Compact(Protocol):  # CompactWeights (which calls carry_precise_state_ itself)
    def named_buffers(self) -> Iterator[tuple[str, nn.Parameter, torch.Tensor | None]]: ...


@torch.no_grad()
def carry_precise_state_(
    module: nn.Module | None, masters: Mapping[str, torch.Tensor], compact: Mapping[str, Any], *,
    master: _Masters | None, compact_weights: _Compact | None, saved: str, target: str,
) -> str | None:
    """Carry what a checkpoint holds beyond its 16-bit weights into a run of another precision or master mode.

    The checkpoint's FP32 values are its FP32 masters (``masters``), or its weights plus their Kahan compensation
    (``compact``; the weights must be loaded into ``module`` already, as Lightning does before the plugin's state).
    They go exactly where this run can hold them: into its FP32 masters (``master``), into FP32 weights
    (``*-mixed``, ``"32-true"``, FP32 islands), or into Kahan weights and their compensation (to about 16
    significant bits). Where it cannot (stochastic rounding, no masters) the weights keep the checkpoint's 16-bit
    values and the returned message says how much was dropped. Same-mode state is not handled here.

    Args:
        saved, target: how the checkpoint's and this run's weights are kept, for the message.

    Returns:
        A warning for the user when something could not be carried, else ``None``.

    Raises:
        KeyError: a name of the checkpoint's state is not a parameter of ``module``.
        ValueError: a tensor's shape differs from its parameter's.
    """
    params = dict(module.named_parameters()) if module is not None else {}
    if masters:
        values = {name: value.float() for name, value in masters.items()}
    else:
        comp = compact.get("compensation", {})
        if not comp:
            return None  # stochastic rounding keeps nothing beyond the weights
        unknown = sorted(set(comp) - set(params))
        if unknown:
            raise KeyError(f"carry_precise_state_: compensation of {unknown} names no parameter of the model.")
        values = {name: params[name].detach().float() + value.float() for name, value in comp.items()}
    unknown = sorted(set(values) - set(params))
    if unknown:
        raise KeyError(f"carry_precise_state_: {saved} of {unknown} name no parameter of the model.")
    for name, value in values.items():
        if value.shape != params[name].shape:
            raise ValueError(f"carry_precise_state_: {name!r} has shape {tuple(value.shape)} in the checkpoint,"
                             f" {tuple(params[name].shape)} in the model.")
    sharded = [name for name in values if type(params[name].data) is not torch.Tensor]
    if sharded:
        return (f"the checkpoint's {saved} were not carried into this run ({target}): {sharded[:4]} are sharded"
                " (DTensor); resume with the precision and master_weights it was written with.")
    held = {name for name in values if params[name].dtype == torch.float32}
    mastered = {name: m for name, m, _ in master.named_pairs()} if master is not None else {}
    comps = ({name: c for name, _, c in compact_weights.named_buffers() if c is not None}
             if compact_weights is not None else {})
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

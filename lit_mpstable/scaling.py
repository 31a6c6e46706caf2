"""Public face: re-exports the loss scalers from lit_mpstable.core (loss_scaler, adaptive_scaler, scalers)."""

from __future__ import annotations

from lit_mpstable.core.scaling.adaptive_scaler import AdaptiveLossScaler
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler, StaticLossScaler
from lit_mpstable.core.scaling.scaler_state import StateKeyError
from lit_mpstable.core.scaling.scalers import ForeignScaler, LossScaler

__all__ = [
    "AdaptiveLossScaler",
    "DynamicLossScaler",
    "ForeignScaler",
    "LossScaler",
    "StateKeyError",
    "StaticLossScaler",
]

"""Public face: re-exports the loss scalers from lit_mpstable.core.scaling."""

from __future__ import annotations

from lit_mpstable.core.scaling import AdaptiveLossScaler, DynamicLossScaler, StaticLossScaler

__all__ = ["AdaptiveLossScaler", "DynamicLossScaler", "StaticLossScaler"]

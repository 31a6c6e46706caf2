"""lit_mpstable: stable mixed-precision training for PyTorch Lightning.

``from lit_mpstable import StablePrecision`` loads Lightning; the numerics core (``lit_mpstable.core.scaling.scalers``,
``lit_mpstable.core.formats``, ...) imports torch only, so importing this package itself loads nothing else.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AdaptiveLossScaler", "DynamicLossScaler", "FP8Config", "SpikeGuard", "StablePrecision", "StaticLossScaler"]
__version__ = "0.1.0"

_LAZY = {
    "StablePrecision": "lit_mpstable.frontends.trainer",
    "DynamicLossScaler": "lit_mpstable.core.scaling.loss_scaler",
    "StaticLossScaler": "lit_mpstable.core.scaling.loss_scaler",
    "AdaptiveLossScaler": "lit_mpstable.core.scaling.adaptive_scaler",
    "SpikeGuard": "lit_mpstable.core.guards.spike",
    "FP8Config": "lit_mpstable.fp8",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lit_mpstable' has no attribute {name!r}")

"""Structured configs: one dataclass per public constructor (same fields and defaults, plus ``_target_``).

A config is only a schema: validation lives once, in the constructor. ``register_configs()`` puts the schemas in
Hydra's ConfigStore, so ``conf/train.yaml`` type-checks ``plugin.*`` before anything is built. Any other Hydra
project can instantiate these nodes (or write the ``_target_`` by hand).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = [
    "AMPPreflightConfig",
    "AdaptiveLossScalerConfig",
    "DynamicLossScalerConfig",
    "FP8RecipeConfig",
    "OverflowMonitorConfig",
    "PrecisionFallbackConfig",
    "ScaleCheckpointConfig",
    "StablePrecisionConfig",
    "StaticLossScalerConfig",
    "register_configs",
]

# Omegaconf only accepts typing.Optional / Any here (no `X | None` at run time), hence the older spellings.


@dataclass
class StablePrecisionConfig:
    _target_: str = "lit_mpstable.StablePrecision"
    precision: str = "bf16-mixed"
    scaler: Any = "auto"
    """"auto", "dynamic", "static", "adaptive", null, or a scaler node with its own _target_."""
    master_weights: Any = True
    """true/false, or "fp32", "kahan", "stochastic"."""
    skip_nonfinite: bool = True
    fp8: Any = None
    """null, a recipe name ("delayed", "current", "mxfp8") or an FP8RecipeConfig node."""
    fp32_modules: list[Any] = field(default_factory=list)
    op_policy: Any = "autocast"
    """"autocast", "auto", or a mapping {family: dtype} such as {attention: fp32} (see lit_mpstable.policy)."""
    device: Optional[str] = None
    telemetry_every_n_steps: Optional[int] = 50
    diagnose: bool = False


@dataclass
class DynamicLossScalerConfig:
    _target_: str = "lit_mpstable.scaling.DynamicLossScaler"
    device: Optional[str] = None
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: Optional[float] = None
    max_scale: Optional[float] = 2.0**24
    enabled: bool = True


@dataclass
class StaticLossScalerConfig:
    _target_: str = "lit_mpstable.scaling.StaticLossScaler"
    device: Optional[str] = None
    init_scale: float = 2.0**16
    enabled: bool = True


@dataclass
class AdaptiveLossScalerConfig:
    _target_: str = "lit_mpstable.scaling.AdaptiveLossScaler"
    device: Optional[str] = None
    init_scale: float = 2.0**16
    target_format: str = "fp16"
    headroom: float = 2.0
    amax_history_len: int = 16
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: Optional[float] = None
    max_scale: Optional[float] = 2.0**24
    enabled: bool = True


@dataclass
class FP8RecipeConfig:
    _target_: str = "lit_mpstable.fp8.FP8Config"
    recipe: str = "delayed"
    format: str = "hybrid"
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    filter: Optional[list[str]] = None
    """Qualified names or fnmatch patterns (types and callables need Python, not YAML)."""
    backend: str = "native"
    emulate: Optional[bool] = None


@dataclass
class OverflowMonitorConfig:
    _target_: str = "lit_mpstable.callbacks.OverflowMonitor"
    window: int = 100
    warn_rate: float = 0.01
    log_every_n_steps: Optional[int] = None


@dataclass
class PrecisionFallbackConfig:
    _target_: str = "lit_mpstable.callbacks.PrecisionFallback"
    patience: int = 10
    min_scale: Optional[float] = 1.0
    mode: str = "global"
    cooldown: Optional[int] = None
    max_overflow_rate: Optional[float] = 0.2
    nonfinite_loss_patience: int = 3
    window: int = 100


@dataclass
class ScaleCheckpointConfig:
    _target_: str = "lit_mpstable.callbacks.ScaleCheckpoint"
    every_n_steps: int = 50
    spike_zscore: float = 6.0
    window: int = 50
    max_rollbacks: int = 3
    min_history: int = 10
    on_spike: str = "skip"
    spike_patience: int = 3
    snapshot_device: str = "cpu"


@dataclass
class AMPPreflightConfig:
    _target_: str = "lit_mpstable.callbacks.AMPPreflight"
    atol: Optional[float] = None
    rtol: Optional[float] = None
    action: str = "fallback"
    forward_fn: Any = None


SCHEMAS: dict[str, type] = {
    "stable_precision": StablePrecisionConfig,
    "dynamic_loss_scaler": DynamicLossScalerConfig,
    "static_loss_scaler": StaticLossScalerConfig,
    "adaptive_loss_scaler": AdaptiveLossScalerConfig,
    "fp8_recipe": FP8RecipeConfig,
    "overflow_monitor": OverflowMonitorConfig,
    "precision_fallback": PrecisionFallbackConfig,
    "scale_checkpoint": ScaleCheckpointConfig,
    "amp_preflight": AMPPreflightConfig,
}


def register_configs() -> None:
    """Store every schema in Hydra's ConfigStore under the group ``schema`` (``schema/stable_precision``, ...)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        store.store(group="schema", name=name, node=node)

"""Public face: re-exports the Hydra schemas and register_configs from lit_mpstable.app.config."""

from __future__ import annotations

from lit_mpstable.app.config import (
    SCHEMAS,
    AdaptiveLossScalerConfig,
    AMPPreflightConfig,
    DynamicLossScalerConfig,
    FaultTriageConfig,
    FP8RecipeConfig,
    OverflowMonitorConfig,
    PrecisionFallbackConfig,
    PrecisionProbeConfig,
    PreemptionCheckpointConfig,
    ScaleCheckpointConfig,
    SpikeGuardConfig,
    StablePrecisionConfig,
    StaticLossScalerConfig,
    derive_schema,
    register_configs,
    schema_type,
)

__all__ = [
    "AMPPreflightConfig",
    "AdaptiveLossScalerConfig",
    "DynamicLossScalerConfig",
    "FP8RecipeConfig",
    "FaultTriageConfig",
    "OverflowMonitorConfig",
    "PrecisionFallbackConfig",
    "PrecisionProbeConfig",
    "PreemptionCheckpointConfig",
    "SCHEMAS",
    "ScaleCheckpointConfig",
    "SpikeGuardConfig",
    "StablePrecisionConfig",
    "StaticLossScalerConfig",
    "derive_schema",
    "register_configs",
    "schema_type",
]

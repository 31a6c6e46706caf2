"""Public face: re-exports PrecisionStepper and its argument types from lit_mpstable.core.step.stepper."""

from __future__ import annotations

from lit_mpstable.core.step.stepper import (
    MasterMode,
    OpPolicyName,
    PrecisionName,
    PrecisionStepper,
    ScalerName,
    default_dtype,
    tensor_init_context,
)

__all__ = ["MasterMode", "OpPolicyName", "PrecisionName", "PrecisionStepper", "ScalerName", "default_dtype",
           "tensor_init_context"]

"""Public face: re-exports PrecisionStepper and its argument types from lit_mpstable.core.step.stepper."""

from __future__ import annotations

import warnings

from lit_mpstable.core.step.stepper import (
    MasterMode,
    OpPolicyName,
    PrecisionName,
    PrecisionStepper,
    ScalerName,
    default_dtype,
)

__all__ = ["MasterMode", "OpPolicyName", "PrecisionName", "PrecisionStepper", "ScalerName", "default_dtype"]


def __getattr__(name: str) -> object:
    if name == "tensor_init_context":  # the free function of earlier releases: the method, called the same way
        warnings.warn("lit_mpstable.stepper.tensor_init_context(stepper) is deprecated: call "
                      "stepper.tensor_init_context() (the same context).", DeprecationWarning, stacklevel=2)
        return PrecisionStepper.tensor_init_context
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

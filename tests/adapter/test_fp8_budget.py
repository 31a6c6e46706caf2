"""The probe-chosen FP8 budget is refused in a Trainer/Fabric run until the plugin makes the choice itself."""

from __future__ import annotations

import pytest

from lit_mpstable.fp8 import FP8Config, HighPrecisionBudget
from lit_mpstable.frontends.fabric import StablePrecision as FabricStablePrecision
from lit_mpstable.frontends.trainer import StablePrecision


@pytest.mark.parametrize("plugin", [StablePrecision, FabricStablePrecision])
def test_a_probe_budget_is_refused_at_construction_naming_what_works(plugin) -> None:
    config = FP8Config(recipe="nvfp4", keep_high_precision=HighPrecisionBudget(0.15, by="probe"))
    with pytest.raises(ValueError, match=r"keep_high_precision=HighPrecisionBudget\(fraction=0.15, by='probe'\).*"
                                         r"by='last'.*choose_high_precision"):
        plugin("bf16-mixed", fp8=config)


def test_the_fixed_budget_builds() -> None:
    config = FP8Config(recipe="nvfp4", keep_high_precision=HighPrecisionBudget(0.15, by="last"))
    assert StablePrecision("bf16-mixed", fp8=config).stepper.fp8 is not None

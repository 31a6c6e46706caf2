"""The frontier recipes (blockwise FP8, NVFP4) under FSDP2 (ModelParallelStrategy, fully_shard, 2 CPU ranks): the FP8
layer is swapped before sharding, trains, and lands where DDP's does; the probe's budget is refused there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_helpers import RankFaultModule, ShardedFaultModule, fit_ddp, fit_fsdp2

from lit_mpstable import StablePrecision
from lit_mpstable.core.step.stepper import PrecisionStepper
from lit_mpstable.fp8 import FP8Config, HighPrecisionBudget

pytestmark = pytest.mark.filterwarnings("ignore")  # Lightning's CPU/num_workers notices, FP8 emulation notes

STEPS = 4  # one epoch: 64 samples, 2 ranks, batches of 8


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["blockwise", "nvfp4"])
def test_a_block_recipe_trains_under_fsdp2_as_under_ddp(tmp_path: Path, recipe: str) -> None:
    def plugin() -> StablePrecision:
        return StablePrecision("bf16-mixed", fp8=FP8Config(recipe=recipe), device="cpu")

    initial = {k: v.detach().clone() for k, v in RankFaultModule(batch_by_step=True).state_dict().items()}
    # The documented way: plugin.convert_module(self) at the top of configure_model, then fully_shard.
    fsdp = fit_fsdp2(ShardedFaultModule(batch_by_step=True, convert_first=True, policy="plugin"), plugin(),
                     tmp_path / "fsdp", STEPS)
    ddp = fit_ddp(RankFaultModule(batch_by_step=True), plugin(), [], tmp_path / "ddp", STEPS)
    assert fsdp[0]["fp8_layers"] == fsdp[1]["fp8_layers"] == ddp[0]["fp8_layers"] == ["model.fc2"]
    assert fsdp[0]["counters"] == (STEPS, 0, 0)  # every step applied
    moved = _max_diff(ddp[0]["params"], initial)
    assert moved > 1e-3  # it trained
    assert _max_diff(fsdp[0]["params"], fsdp[1]["params"]) == 0.0
    # Same batches, same quantised GEMMs, the same averaged gradients (measured: 0.0 for both recipes; moved 0.019).
    assert _max_diff(fsdp[0]["params"], ddp[0]["params"]) <= 1e-6


def test_the_probe_budget_is_refused_under_fsdp2_with_the_rule_that_works() -> None:
    stepper = PrecisionStepper("bf16-mixed", fp8=FP8Config(recipe="nvfp4", keep_high_precision=HighPrecisionBudget(
        0.2)), device="cpu")
    with pytest.raises(ValueError, match=r"FSDP2.*HighPrecisionBudget\(fraction=0.2, by='last'\)"):
        stepper.setup_module(RankFaultModule(), fsdp2=True)

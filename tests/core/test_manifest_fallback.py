"""The fingerprint's manifest comparison and a fallback in force: a layer that left FP8 keeps no stochastic-rounding
key or Hadamard signs in the checkpoint, while the run loading it has them until the fallback is re-applied."""

from __future__ import annotations

import pytest

from lit_mpstable.core.fingerprint import compare_manifests


def _manifest(sr_key: int | None, **fallbacks) -> dict:
    layer = {"recipe": "delayed", "recipe_fields": "delayed", "format": "hybrid", "hadamard": None}
    if sr_key is not None:
        layer["sr_key"] = sr_key
    return {"precision": "bf16-mixed", "master_weights": None, "optimizer_state": "fp32",
            "fp8": {"recipe": "delayed", "format": "hybrid"}, "layers": {"blocks.0.fc": layer},
            "high_precision": [], "islands": [],
            "fallbacks": {"fp32": False, "fp8_off": False, "fp8_removed": [], "fp32_modules": [], **fallbacks}}


@pytest.mark.parametrize("fallbacks", [dict(fp8_removed=["blocks.0.fc"]), dict(fp32_modules=["blocks.0"]),
                                       dict(fp8_off=True)])
def test_a_layer_that_fell_back_is_not_compared_by_its_keys(fallbacks: dict) -> None:
    # The run's own checkpoint after FaultTriage took the layer out of FP8 was refused ("other stochastic-rounding
    # keys (None vs 485904132)").
    differences, _ = compare_manifests(_manifest(None, **fallbacks), _manifest(485904132))
    assert differences == []


def test_a_layer_in_fp8_on_both_sides_is_compared_by_its_keys() -> None:
    differences, _ = compare_manifests(_manifest(1), _manifest(2))
    assert len(differences) == 1 and "stochastic-rounding keys" in differences[0] and "(1 vs 2)" in differences[0]

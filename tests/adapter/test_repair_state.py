"""The plugin's own repairs (preflight fallback, fallbacks with compact weights, FP8 state across a recast, a
second fit, a refused call, a resume in another precision) leave a consistent state: each case crashed or was
silently wrong before."""

from __future__ import annotations

import pytest
import torch
from helpers import make_module, make_trainer
from trainer_pkg import StablePrecision

from lit_mpstable.callbacks import AMPPreflight

pytestmark = pytest.mark.filterwarnings("ignore")


def _off_in_low_precision(module, batch):
    """A forward whose 16-bit output is off by 1 (the FP32 reference is not): the check must disagree."""
    output = module(batch[0])
    return output + 1.0 if output.dtype != torch.float32 else output


# ------------------------------------------------------------------------------------- AMPPreflight, *-true
@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
@pytest.mark.parametrize("master_weights", [True, False])
def test_preflight_fallback_in_true_precisions_trains_on(precision: str, master_weights: bool) -> None:
    # The batch was cast to the 16-bit dtype before the check; after the check's global fallback the model is FP32.
    plugin = StablePrecision(precision, master_weights=master_weights, device="cpu")
    preflight = AMPPreflight(forward_fn=_off_in_low_precision)
    module = make_module()
    make_trainer(plugin, callbacks=[preflight], max_steps=2).fit(module)
    assert plugin.compute_dtype == torch.float32 and plugin.fallback_active
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    assert len(module.losses) == 2 and all(torch.isfinite(torch.tensor(module.losses)))

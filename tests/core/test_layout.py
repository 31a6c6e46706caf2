"""PrecisionLayout in *-true modes: casts never round the FP32 islands' own parameters and buffers."""

from __future__ import annotations

import torch
from torch import nn

from lit_mpstable.layout import PrecisionLayout


def test_islands_keep_their_fp32_values_through_casts_fallbacks_and_restores() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
    with torch.no_grad():
        model[1].running_var.fill_(1e5)  # above FP16's max
        model[1].weight.fill_(1 + 1e-5)  # below FP16's resolution at 1.0
    expected_var, expected_weight = model[1].running_var.clone(), model[1].weight.detach().clone()
    layout = PrecisionLayout(torch.float16, cast_parameters=True, fp32_modules=[nn.BatchNorm1d])
    layout.attach(model, "cpu")
    assert model[0].weight.dtype == torch.float16 and model[2].weight.dtype == torch.float16
    for action in (lambda: layout.fallback(["2"]), layout.restore, lambda: layout.fallback(None), layout.restore):
        action()
        assert torch.equal(model[1].running_var, expected_var) and torch.equal(model[1].weight, expected_weight)
    assert model[2].weight.dtype == torch.float16  # the module fallback was undone

"""FP8 regressions: the ``_scaled_mm`` probe in the ``*-true`` modes, activation checkpointing with delayed
scaling, compiled FP8 on 16-bit inputs, and the refusal message for models without eligible ``nn.Linear`` layers."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import TinyMLP
from torch import nn
from torch.utils.checkpoint import checkpoint

import lit_mpstable.fp8.gemm as gemm_module
import lit_mpstable.fp8.linear as linear_module
from lit_mpstable.fp8 import FP8Config, FP8Linear, convert_to_fp8
from lit_mpstable.stepper import PrecisionStepper, default_dtype

def _cpu_runs_scaled_mm() -> bool:
    a = torch.eye(16).to(torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32)
    try:
        return torch.equal(torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32), torch.eye(16))
    except Exception:  # noqa: BLE001 - an older build without the CPU kernel
        return False


needs_cpu_scaled_mm = pytest.mark.skipif(not _cpu_runs_scaled_mm(), reason="this torch has no CPU torch._scaled_mm")


class _CountScaledMM:
    def __init__(self) -> None:
        self.calls = 0
        self.real = torch._scaled_mm

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)


# ------------------------------------------------------------------------------------ item 6: the probe
@needs_cpu_scaled_mm
@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_true_16bit_fp8_still_uses_scaled_mm_after_the_first_forward(
    precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh process: nothing probed, nothing warned.
    gemm_module._PROBED.clear()
    monkeypatch.setattr(linear_module, "_WARNED_EMULATION", set())
    stepper = PrecisionStepper(precision, fp8="current", device="cpu")
    model = stepper.setup_module(TinyMLP())
    x = torch.randn(16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "does not run FP8 GEMMs on cpu" blaming the hardware
        with stepper.forward_context():
            model(stepper.convert_input(x))
    assert gemm_module.scaled_mm_supported("cpu")
    counter = _CountScaledMM()
    monkeypatch.setattr(torch, "_scaled_mm", counter)
    with stepper.forward_context():
        model(stepper.convert_input(x))
    assert counter.calls == 1  # fc2's forward GEMM


def test_a_refused_probe_is_not_cached_when_our_arguments_were_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    # Whatever context the first call runs in (a 16-bit default dtype, autocast), the probe builds fp32 operands.
    gemm_module._PROBED.clear()
    with default_dtype(torch.bfloat16), torch.autocast("cpu", dtype=torch.bfloat16):
        inside = gemm_module.scaled_mm_supported("cpu")
    gemm_module._PROBED.clear()
    outside = gemm_module.scaled_mm_supported("cpu")
    assert inside == outside == _cpu_runs_scaled_mm()

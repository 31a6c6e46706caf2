"""The format table against named edge cases, and the overflow/underflow fractions."""

from __future__ import annotations

import pytest
import torch

from lit_mpstable.core.formats import FORMATS, get_format, overflow_fraction, underflow_fraction

# name: (largest normal, smallest normal, smallest subnormal) from the IEEE / OCP FP8 definitions
EDGES = {
    "fp32": (3.4028234663852886e38, 2.0**-126, 2.0**-149),
    "fp16": (65504.0, 2.0**-14, 2.0**-24),
    "bf16": (3.3895313892515355e38, 2.0**-126, 2.0**-133),
    "fp8_e4m3": (448.0, 2.0**-6, 2.0**-9),
    "fp8_e5m2": (57344.0, 2.0**-14, 2.0**-16),
}


@pytest.mark.parametrize("name", sorted(EDGES))
def test_table_matches_the_format_definitions(name: str) -> None:
    fmt = get_format(name)
    assert (fmt.max, fmt.smallest_normal, fmt.smallest_subnormal) == EDGES[name]
    assert get_format(fmt.dtype) is fmt


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"])
def test_casts_agree_with_the_table(name: str) -> None:
    fmt = get_format(name)
    sub = fmt.smallest_subnormal
    values = torch.tensor([fmt.max, sub, sub / 2, sub * 0.75], dtype=torch.float64)
    cast = values.to(fmt.dtype).double()
    assert cast[0] == fmt.max  # largest normal is representable
    assert cast[1] == sub  # smallest subnormal survives
    assert cast[2] == 0  # half of it rounds to even: zero
    assert cast[3] == sub  # above half rounds up


def test_fractions_on_edge_values() -> None:
    fmt = FORMATS["fp16"]
    sub = fmt.smallest_subnormal
    t = torch.tensor([fmt.max, fmt.max * 1.01, sub, sub / 2, 0.0, 1.0, float("inf")])
    # finite nonzero: max, max*1.01, sub, sub/2, 1.0 -> 5 ; overflow among finite: max*1.01 -> 1/6 of finite
    # (0.0 counts)
    assert overflow_fraction(t, "fp16").item() == pytest.approx(1 / 6)
    # nonzero (inf included): 6; flush: sub/2 -> 1/6
    assert underflow_fraction(t, "fp16").item() == pytest.approx(1 / 6)
    # scaling by 2**10 lifts sub/2 out of the flush zone and pushes max over the top
    assert underflow_fraction(t, "fp16", scale=2.0**10).item() == 0.0
    assert overflow_fraction(t, "fp16", scale=2.0**10).item() == pytest.approx(2 / 6)


def test_unknown_format_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="'fp12'"):
        get_format("fp12")

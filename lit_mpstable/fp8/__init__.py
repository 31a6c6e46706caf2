"""FP8 training core: FP8Config and recipes (delayed, current, mxfp8), FP8Linear, the module swap. Torch only."""

from __future__ import annotations

from lit_mpstable.fp8.backends import fp8_autocast_context
from lit_mpstable.fp8.config import FP8Config, fp8_config
from lit_mpstable.fp8.gemm import fp8_mm, scaled_mm_supported
from lit_mpstable.fp8.linear import FP8_TENSORS, FP8Linear
from lit_mpstable.fp8.quant import (
    MX_BLOCK_SIZE,
    amax_from_history,
    compute_scale,
    dequantize,
    dequantize_mx,
    fp8_max,
    mx_block_scales,
    quantize,
    quantize_mx,
    update_amax_history_,
)
from lit_mpstable.fp8.swap import (
    collect_fp8_stats_,
    convert_from_fp8,
    convert_to_fp8,
    fp8_state_dict,
    fp8_stats,
    load_fp8_state_dict,
    select_fp8_modules,
)

__all__ = [
    "FP8Config",
    "FP8Linear",
    "FP8_TENSORS",
    "MX_BLOCK_SIZE",
    "amax_from_history",
    "collect_fp8_stats_",
    "compute_scale",
    "convert_from_fp8",
    "convert_to_fp8",
    "dequantize",
    "dequantize_mx",
    "fp8_autocast_context",
    "fp8_config",
    "fp8_max",
    "fp8_mm",
    "fp8_state_dict",
    "fp8_stats",
    "load_fp8_state_dict",
    "mx_block_scales",
    "quantize",
    "quantize_mx",
    "scaled_mm_supported",
    "select_fp8_modules",
    "update_amax_history_",
]

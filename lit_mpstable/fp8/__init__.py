"""FP8 training core: FP8Config and recipes as data (:class:`Recipe`, :func:`recipe`, :func:`register_recipe`: delayed,
current, mxfp8; blockwise FP8, MXFP4, NVFP4; per-role and per-module), FP8Linear,
the module swap, and one backend seam (:class:`FP8Backend`) behind which the native layers, torchao and
TransformerEngine look alike. Torch only; the optional packages are imported when a backend that needs them is built.

How our recipes relate to TransformerEngine's and torchao's, term by term: docs/fp8-recipes.md.
"""

from __future__ import annotations

from lit_mpstable.fp8.backend import FP8Backend
from lit_mpstable.fp8.backends import BACKENDS, fp8_backend
from lit_mpstable.fp8.blockwise import blockwise_dequantize, blockwise_quantize
from lit_mpstable.fp8.budget import choose_high_precision, keep_high_precision_, layer_gradient_errors
from lit_mpstable.fp8.config import FP8Config, HighPrecisionBudget, fp8_config
from lit_mpstable.fp8.hadamard import hadamard_matrix, random_hadamard_transform, random_signs
from lit_mpstable.fp8.linear import FP8Linear
from lit_mpstable.fp8.mx import mx_dequantize, mx_quantize
from lit_mpstable.fp8.native import NativeBackend
from lit_mpstable.fp8.nvfp4 import nvfp4_dequantize, nvfp4_quantize
from lit_mpstable.fp8.quantizers import fake_quantize
from lit_mpstable.fp8.recipe import FORMATS, Recipe, recipe, recipe_names, register_recipe
from lit_mpstable.fp8.schedule import PrecisionSchedule, ScheduleRunner
from lit_mpstable.fp8.swap import (
    convert_from_fp8,
    convert_to_fp8,
    export_recipe_map,
    fp8_state_dict,
    fp8_stats,
    load_fp8_state_dict,
)
from lit_mpstable.fp8.te_backend import TransformerEngineBackend
from lit_mpstable.fp8.torchao_backend import TorchaoBackend

__all__ = [
    "BACKENDS",
    "FORMATS",
    "FP8Backend",
    "FP8Config",
    "FP8Linear",
    "HighPrecisionBudget",
    "NativeBackend",
    "PrecisionSchedule",
    "Recipe",
    "ScheduleRunner",
    "TorchaoBackend",
    "TransformerEngineBackend",
    "blockwise_dequantize",
    "blockwise_quantize",
    "choose_high_precision",
    "convert_from_fp8",
    "convert_to_fp8",
    "export_recipe_map",
    "fake_quantize",
    "fp8_backend",
    "fp8_config",
    "fp8_state_dict",
    "fp8_stats",
    "hadamard_matrix",
    "keep_high_precision_",
    "layer_gradient_errors",
    "load_fp8_state_dict",
    "mx_dequantize",
    "mx_quantize",
    "nvfp4_dequantize",
    "nvfp4_quantize",
    "random_hadamard_transform",
    "random_signs",
    "recipe",
    "recipe_names",
    "register_recipe",
]

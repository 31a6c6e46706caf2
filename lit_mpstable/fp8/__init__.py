"""FP8 training core: FP8Config and recipes as data (:class:`Recipe`, :func:`recipe`, :func:`register_recipe`: delayed,
current, mxfp8; blockwise FP8, MXFP4, NVFP4; per-role and per-module), FP8Linear,
the module swap, and one backend seam (:class:`FP8Backend`) behind which the native layers, torchao and
TransformerEngine look alike. Torch only; the optional packages are imported when a backend that needs them is built.

How our recipes relate to TransformerEngine's (``backend="transformer_engine"`` hands them to TE as written):

- ``"delayed"`` uses TE's ``DelayedScaling`` formula, ``scale = fp8_max / amax / 2**margin``, with ``amax`` the max
  over the last ``amax_history_len`` amaxes including the current one (``"most_recent"``: the current one), the
  scale computed after the tensor's cast and used from the next cast on. TE keeps the history as (len, tensors)
  with the current amax in row 0 and rolls it by -1 at each update; ours is (3, len), newest first, rolled by +1
  before writing: the same window (``tests/core/test_fp8_backends.py`` checks the scales bit for bit). Where they
  differ: TE updates a forward's scales when its ``autocast`` exits (a layer called twice in one forward overwrites
  its amax: TE forbids that with ``reduce_amax``), ours after each call; TE keeps a non-finite amax in the
  history, which freezes the scale for up to ``amax_history_len`` steps, ours records it as 0; TE all-reduces the
  newest amaxes over its ``amax_reduction_group`` at every autocast exit and after the backward
  (``reduce_amax=True``), ours reduces the whole history once per optimizer step (``PrecisionLayout.sync_fp8_``).
  ``margin`` means the same in both (scales divided by ``2**margin``); TE has it for delayed scaling only, ours
  applies to ``"current"`` too.
- ``"current"`` is TE's ``Float8CurrentScaling`` and torchao's tensorwise dynamic scaling: each tensor scaled by
  its own amax, no state; ours and torchao's give the same correctly rounded scales and FP8 bytes. TE also
  offers power-of-two scales and an amax epsilon (off by default) and, under sequence parallelism, reduces input
  amaxes over the tensor-parallel group; we reduce nothing (each rank its own amax).
- ``"mxfp8"``: one E8M0 scale per 32 elements along the reduction dim, with the recipe's ``scale_rule``:
  ``"rceil"`` (the default, TE's ``MXFP8BlockScaling`` and torchao's training rule: ``amax / fp8_max`` rounded up to a
  power of two, nothing saturates) or ``"floor"`` (the OCP MX spec: a block's largest elements may saturate by up to
  2**-3, and its small values keep up to one binade more). TE's default format there is E4M3 for gradients too
  (ours: E5M2 with ``format="hybrid"``); both quantise the row- and column-wise copies from the high-precision
  tensor; TE's needs a Blackwell GPU.
- ``"blockwise"`` is TE's ``Float8BlockScaling`` (E4M3, power-of-two scales, 1x128 / 128x128 tiles; Hopper or
  later), ``"nvfp4"`` TE's ``NVFP4BlockScaling`` (RHT, 2-D weight tiles and stochastic rounding on, as its defaults;
  Blackwell). TE has no MXFP4 recipe. torchao refuses ``"blockwise"`` (its prototype ``Float8BlockwiseLinear``
  scales tiles by exactly ``448 / amax``, with no power-of-two option, so the same name would give other numbers)
  and maps MXFP4/NVFP4 to training configs only where its version has them (0.18 has NVFP4 and MX for inference
  only, MXFP8 for training); what cannot run is refused when the backend is built, naming ``backend="native"``,
  which emulates every recipe exactly on any device.
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

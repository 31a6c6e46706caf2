"""Optional FP8 backends, TransformerEngine and torchao, imported only inside the functions that use them."""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, ContextManager

import torch
from torch import nn

from lit_mpstable.fp8.config import FP8Config, fp8_config
from lit_mpstable.fp8.gemm import scaled_mm_supported
from lit_mpstable.fp8.swap import _replace

__all__ = ["convert", "fp8_autocast_context", "transformer_engine_recipe"]

_PIP = {"transformer_engine": 'pip install "transformer-engine[pytorch]"', "torchao": "pip install torchao"}


def _import(module: str, backend: str) -> Any:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"FP8Config(backend={backend!r}) needs the {backend} package, which is not installed: {_PIP[backend]}"
        ) from err


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def convert(model: nn.Module, config: FP8Config, names: list[str]) -> None:
    """Swap the linear layers ``names`` of ``model`` for the FP8 layers of ``config.backend``, in place."""
    if config.backend == "transformer_engine":
        _convert_transformer_engine(model, names)
    elif config.backend == "torchao":
        _convert_torchao(model, config, names)
    else:
        raise ValueError(f"convert: backend {config.backend!r} is not an optional backend; use convert_to_fp8.")


def _convert_transformer_engine(model: nn.Module, names: list[str]) -> None:
    # TE layers own new parameters (copied): build optimizers after the swap, as Lightning does.
    te = _import("transformer_engine.pytorch", "transformer_engine")
    for name in names:
        linear = model.get_submodule(name)
        layer = te.Linear(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            params_dtype=linear.weight.dtype,
            device=linear.weight.device,
        )
        with torch.no_grad():
            layer.weight.copy_(linear.weight)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        layer.train(linear.training)
        _replace(model, name, layer)


def _convert_torchao(model: nn.Module, config: FP8Config, names: list[str]) -> None:
    selected = set(names)

    def module_filter_fn(module: nn.Module, fqn: str) -> bool:
        return fqn in selected

    device = _device(model)
    if config.recipe == "current":
        float8 = _import("torchao.float8", "torchao")
        emulate = config.emulate if config.emulate is not None else not scaled_mm_supported(device)
        grad = {}  # torchao's default is hybrid: E5M2 gradients
        if config.format == "e4m3":
            grad["cast_config_grad_output"] = float8.CastConfig(target_dtype=torch.float8_e4m3fn)
        float8_config = float8.Float8LinearConfig(emulate=emulate, **grad)
        float8.convert_to_float8_training(model, module_filter_fn=module_filter_fn, config=float8_config)
        return
    # recipe == "mxfp8" (FP8Config rejects "delayed" for torchao). MX GEMMs need Blackwell (cc >= 10.0).
    _import("torchao", "torchao")
    try:
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
        from torchao.quantization import quantize_
        from torchao.quantization.quantize_.common import KernelPreference
    except ImportError as err:
        raise ValueError(
            "FP8Config(recipe='mxfp8', backend='torchao'): this torchao version has no MXFP8 training config"
            " (torchao.prototype.moe_training.config.MXFP8TrainingOpConfig); use backend='native' or upgrade torchao."
        ) from err
    hardware_mx = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (10, 0)
    emulate = config.emulate if config.emulate is not None else not hardware_mx
    preference = KernelPreference.EMULATED if emulate else KernelPreference.AUTO
    quantize_(model, MXFP8TrainingOpConfig(kernel_preference=preference), filter_fn=module_filter_fn)


def transformer_engine_recipe(config: FP8Config) -> Any:
    """TransformerEngine's recipe for ``config``: DelayedScaling, Float8CurrentScaling or MXFP8BlockScaling."""
    recipe = _import("transformer_engine.common.recipe", "transformer_engine")
    fp8_format = recipe.Format.HYBRID if config.format == "hybrid" else recipe.Format.E4M3
    if config.recipe == "delayed":
        return recipe.DelayedScaling(
            margin=config.margin,
            fp8_format=fp8_format,
            amax_history_len=config.amax_history_len,
            amax_compute_algo=config.amax_compute_algo,
        )
    if config.recipe == "current":
        return recipe.Float8CurrentScaling(fp8_format=fp8_format)
    return recipe.MXFP8BlockScaling(fp8_format=fp8_format)


def fp8_autocast_context(config: FP8Config | str | None) -> ContextManager:
    """The context the forward pass must run in: ``te.fp8_autocast`` for TransformerEngine, else a no-op.

    Native FP8Linear and torchao layers carry their recipe themselves and need no context.
    """
    config = fp8_config(config)
    if config is None or config.backend != "transformer_engine":
        return contextlib.nullcontext()
    te = _import("transformer_engine.pytorch", "transformer_engine")
    return te.fp8_autocast(enabled=True, fp8_recipe=transformer_engine_recipe(config))

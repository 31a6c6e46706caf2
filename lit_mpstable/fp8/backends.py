"""The FP8 backends by name, and which backend a layer belongs to; optional packages are imported only when used."""

from __future__ import annotations

import contextlib
from typing import ContextManager

from torch import nn

from lit_mpstable.fp8.backend import FP8Backend
from lit_mpstable.fp8.config import FP8Config, fp8_config
from lit_mpstable.fp8.native import NativeBackend
from lit_mpstable.fp8.te_backend import TransformerEngineBackend
from lit_mpstable.fp8.torchao_backend import TorchaoBackend

BACKENDS: dict[str, type[FP8Backend]] = {
    NativeBackend.name: NativeBackend,
    TorchaoBackend.name: TorchaoBackend,
    TransformerEngineBackend.name: TransformerEngineBackend,
}
"""``FP8Config.backend`` -> the class implementing it."""


def fp8_backend(config: FP8Config | str) -> FP8Backend:
    """The backend ``config.backend`` names, built for ``config`` (a recipe name means the native backend).

    Raises:
        ModuleNotFoundError: the backend's package is not installed (the message has the pip line).
        ValueError: the backend cannot do what ``config`` asks.
    """
    resolved = fp8_config(config)
    if resolved is None:
        raise ValueError("fp8_backend(None): no FP8 config, so no backend; pass a recipe name or an FP8Config.")
    return BACKENDS[resolved.backend](resolved)


def backend_of(module: nn.Module) -> type[FP8Backend] | None:
    """The backend class whose FP8 layer ``module`` is, or None for any other module."""
    return next((backend for backend in BACKENDS.values() if backend.is_fp8_layer(module)), None)


def find_fp8_layers(model: nn.Module) -> dict[str, type[FP8Backend]]:
    """``{qualified name: backend class}`` of every FP8 layer in ``model``, whichever backend built it."""
    return {name: backend for name, module in model.named_modules() if (backend := backend_of(module)) is not None}


def fp8_autocast_context(config: FP8Config | str | None) -> ContextManager:
    """The context a forward with FP8 layers of ``config.backend`` runs in: TransformerEngine's autocast, else a
    no-op. Builds the backend on each call; ``PrecisionLayout.forward_context`` keeps one."""
    config = fp8_config(config)
    return fp8_backend(config).forward_context() if config is not None else contextlib.nullcontext()

"""The native FP8 backend: this package's FP8Linear, its amax histories and their cross-rank synchronisation."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from lit_mpstable.fp8.backend import FP8Backend, replace_module
from lit_mpstable.fp8.linear import FP8Linear
from lit_mpstable.fp8.quant import amax_from_history, compute_scale


class NativeBackend(FP8Backend):
    """:class:`FP8Linear` layers: the same ``Parameter`` objects, FP8 GEMMs through ``torch._scaled_mm`` or exact
    emulation, amax histories as non-persistent buffers (saved through :meth:`state_dict`), per-layer telemetry.

    :meth:`sync_` (delayed recipe, several ranks): one MAX all-reduce of every layer's amax history together,
    on the device, then the scales recomputed from the reduced histories with the same formula the layers use,
    so every rank scales the next step alike. A no-op on one process: single-process numerics are untouched.
    """

    name: ClassVar[str] = "native"
    records_stats: ClassVar[bool] = True

    @classmethod
    def is_fp8_layer(cls, module: nn.Module) -> bool:
        return isinstance(module, FP8Linear)

    def convert_(self, model: nn.Module, names: list[str]) -> None:
        for name in names:
            linear = model.get_submodule(name)
            assert isinstance(linear, nn.Linear)  # select_fp8_modules picks plain nn.Linear layers only
            layer_config = self.config.for_layer(name)  # a per-module map gives each layer its own recipe
            if layer_config is not None:
                replace_module(model, name, FP8Linear.from_linear(linear, layer_config, name))

    @classmethod
    def to_linear(cls, layer: nn.Module) -> nn.Linear:
        return _native(layer).to_linear()

    @classmethod
    def layer_state(cls, layer: nn.Module) -> dict[str, torch.Tensor]:
        return _native(layer).fp8_state_dict()

    @classmethod
    def load_layer_state(cls, layer: nn.Module, state: dict[str, torch.Tensor]) -> None:
        _native(layer).load_fp8_state_dict(state)

    @classmethod
    def collect_stats_(cls, model: nn.Module, names: list[str], enabled: bool = True) -> None:
        for name in names:
            layer = _native(model.get_submodule(name))
            layer.collect_stats = enabled
            if not enabled:
                layer.clear_stats()

    @classmethod
    def layer_stats(cls, layer: nn.Module) -> dict[str, torch.Tensor | float]:
        return dict(_native(layer).fp8_stats)

    def sync_(self, model: nn.Module, names: list[str], group: Any = None) -> None:
        if self.config.is_map or not self.config.spec.history or not names or not _several_ranks(group):
            return  # current and mxfp8 keep no state: each rank scales its own tensors
        layers = [_native(model.get_submodule(name)) for name in names]
        import torch.distributed as dist

        # Histories roll once per cast on every rank, so entry i holds the same step everywhere: an elementwise MAX
        # gives every rank the amax of all ranks' data for that step (TE reduces only the newest entry, at each
        # autocast exit; the whole history here also covers gradient accumulation, one collective per step).
        histories = [layer.amax_history for layer in layers]
        flat = torch.cat([history.reshape(-1) for history in histories])
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        reduced = flat.view(len(layers), *histories[0].shape)  # all built from self.config: same shapes
        torch._foreach_copy_(histories, list(reduced.unbind(0)))
        config = self.config
        amax = amax_from_history(reduced, config.amax_compute_algo)  # (layers, 3): x, w, grad_out
        previous = torch.stack([layer.scale for layer in layers])
        forward = compute_scale(amax[:, :2], config.forward_dtype, margin=config.margin, previous=previous[:, :2])
        grad = compute_scale(amax[:, 2:], config.grad_dtype, margin=config.margin, previous=previous[:, 2:])
        torch._foreach_copy_([layer.scale for layer in layers], list(torch.cat([forward, grad], dim=1).unbind(0)))


def _several_ranks(group: Any) -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _native(layer: nn.Module) -> FP8Linear:
    assert isinstance(layer, FP8Linear)  # this backend is only handed its own layers (is_fp8_layer)
    return layer

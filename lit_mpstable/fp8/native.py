"""The native FP8 backend: this package's FP8Linear, its amax histories and their cross-rank synchronisation."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from lit_mpstable.fp8.backend import FP8Backend, replace_module
from lit_mpstable.fp8.config import FP8Config
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


def conformance_gate(backend: FP8Backend, model: nn.Module, names: list[str]) -> list[str]:
    """Called by a library backend's ``convert_`` before it converts ``names``: :func:`check_conformance` (once per
    config and process) and what ``config.conformance`` says to do on a failure: ``"raise"`` a ValueError with the
    numbers, ``"native"`` a warning with them and those layers converted by the native backend instead (returns the
    names left for ``backend``: none). ``"off"``, or a backend not checked here
    (:meth:`~FP8Backend.checks_conformance`), returns ``names``."""
    if not names or backend.config.conformance == "off" or backend.__dict__.get("_probing") or not (
            backend.checks_conformance()):
        return names
    report = check_conformance(backend)
    if report.ok:
        return names
    if backend.config.conformance == "raise":
        raise ValueError(f"{report.describe()} Refused for the layers {names}; use backend='native' (exact"
                         " emulation), or FP8Config(conformance='native') to fall back to it automatically.")
    warnings.warn(f"{report.describe()} The layers {names} run on backend='native' instead"
                  " (FP8Config(conformance='native')).", RuntimeWarning, stacklevel=3)
    NativeBackend(dataclasses.replace(backend.config, backend="native")).convert_(model, names)
    return []


@dataclass(frozen=True)
class Conformance:
    """What :func:`check_conformance` found for one backend and recipe."""

    backend: str
    recipe: str
    scales_differ: dict[str, float] = field(default_factory=dict)
    """Per probed operand (``"input"``, ``"weight"``, ``"grad"``), the largest fraction of decode scales that differ
    from our reference over the probe tensors."""
    values_differ: dict[str, float] = field(default_factory=dict)
    """The same for the dequantized values (codes times scales; not for stochastically rounded gradients)."""
    unprobed: tuple[str, ...] = ()
    """Operands not compared: the backend exposes no quantizer here."""
    grad_zero: bool = False
    """The probe layer's weight gradient came back all zero (while the reference's is not)."""
    grad_nonfinite: bool = False

    @property
    def ok(self) -> bool:
        mismatch = any(v > 0 for v in (*self.scales_differ.values(), *self.values_differ.values()))
        return not (mismatch or self.grad_zero or self.grad_nonfinite)

    def describe(self) -> str:
        ops = [op for op in self.scales_differ if self.scales_differ[op] or self.values_differ.get(op)]
        parts = [f"{op}: {self.scales_differ[op]:.1%} of scales and {self.values_differ.get(op, 0.0):.1%} of values"
                 " differ" for op in ops]
        if self.grad_zero:
            parts.append("the probe layer's weight gradient is all zero (the reference's is not)")
        if self.grad_nonfinite:
            parts.append("the probe layer's weight gradient is not finite")
        verdict = "; ".join(parts) if parts else "conforms"
        return (f"FP8Config(recipe={self.recipe!r}, backend={self.backend!r}): conformance check against the native"
                f" reference on probe tensors: {verdict}.")


_CHECKED: dict[tuple[type, FP8Config], Conformance] = {}


def _probes(device: torch.device) -> list[torch.Tensor]:
    # Gaussian; uneven column scales; rows of very different magnitude (tiny tiles: subnormal block scales).
    gen = torch.Generator().manual_seed(20261207)
    gauss = torch.randn(64, 128, generator=gen)
    columns = torch.randn(64, 128, generator=gen) * torch.logspace(-3, 2, 128)
    rows = torch.randn(64, 128, generator=gen) * torch.logspace(-7, 1, 64).unsqueeze(1)
    return [t.to(device) for t in (gauss, columns, rows)]


def check_conformance(backend: FP8Backend) -> Conformance:
    """Compare ``backend`` with our reference for its config's recipe, once per (backend class, config) and process:
    per operand, the fraction of decode scales and of values of :meth:`~FP8Backend.probe_quantize` that differ from
    :func:`~lit_mpstable.fp8.quantizers.reference_quantize`'s on three probe tensors (bitwise; NaN equals NaN), and
    a probe layer's weight gradient (:meth:`~FP8Backend.probe_gradients`), which fails all zero (where the
    reference's is not) or non-finite. The probes and why: docs/fp8-recipes.md, "Backend conformance check"."""
    config = backend.config
    key = (type(backend), config)
    if key in _CHECKED:
        return _CHECKED[key]
    from lit_mpstable.fp8.quantizers import reference_quantize

    spec = config.spec
    on_gpu = torch.cuda.is_available() and backend.name == "transformer_engine"  # TE's layers run on CUDA only
    probes = _probes(torch.device("cuda" if on_gpu else "cpu"))
    scales: dict[str, float] = {}
    values: dict[str, float] = {}
    unprobed: list[str] = []
    for operand in ("input", "weight", "grad"):
        for x in probes:
            theirs = backend.probe_quantize(x, operand)
            if theirs is None:
                unprobed.append(operand)
                scales.pop(operand, None)
                values.pop(operand, None)
                break
            ours = reference_quantize(spec, operand, x, grad_dtype=config.grad_dtype)
            scales[operand] = max(scales.get(operand, 0.0), _differ(theirs[1], ours[1]))
            if not (operand == "grad" and "dgrad" in spec.stochastic_rounding):
                values[operand] = max(values.get(operand, 0.0), _differ(theirs[0], ours[0]))
    x, weight, grad_out = probes[1], probes[0] * 0.05, probes[2][:, :64]
    with torch.enable_grad():
        grad = backend.probe_gradients(x, weight, grad_out)
        native = NativeBackend(dataclasses.replace(config, backend="native"))
        reference = native.probe_gradients(x, weight, grad_out)
    report = Conformance(
        backend=backend.name, recipe=spec.name, scales_differ=scales, values_differ=values, unprobed=tuple(unprobed),
        grad_zero=bool((grad == 0).all()) and bool((reference != 0).any()),
        grad_nonfinite=not bool(torch.isfinite(grad).all()),
    )  # setup only (once per config): the host reads above are not on the step path
    _CHECKED[key] = report
    return report


def _differ(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().flatten().cpu(), b.float().flatten().cpu()
    if a.shape != b.shape:
        return 1.0
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    return float((~same).float().mean())

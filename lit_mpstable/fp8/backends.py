"""The FP8 backends by name, and which backend a layer belongs to; optional packages are imported only when used."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import ContextManager

import torch
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
    """Operands not compared: the backend exposes no quantizer here, or this build has no reference for a field."""
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

    - quantizers: for each operand (``"input"``, ``"weight"``, ``"grad"``) and three probe tensors (64x128: Gaussian,
      uneven columns, rows spanning 1e-7 to 10), the backend's :meth:`~FP8Backend.probe_quantize` against
      :func:`~lit_mpstable.fp8.quantizers.reference_quantize`: the fraction of decode scales and of values that
      differ (bitwise; NaN equals NaN);
    - gradients: a 128 -> 64 probe layer built by the backend, one forward and backward
      (:meth:`~FP8Backend.probe_gradients`): an all-zero weight gradient (where the reference's is not) or a
      non-finite one fails (TE's NVFP4 stochastic rounding returned all-zero gradients on some GPUs, TE PR #3281).
    """
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
            ours = reference_quantize(spec, operand, x, grad_dtype=config.grad_dtype)
            theirs = backend.probe_quantize(x, operand)
            if ours is None or theirs is None:
                unprobed.append(operand)
                scales.pop(operand, None)
                values.pop(operand, None)
                break
            scales[operand] = max(scales.get(operand, 0.0), _differ(theirs[1], ours[1]))
            if not (operand == "grad" and "dgrad" in spec.stochastic_rounding):
                values[operand] = max(values.get(operand, 0.0), _differ(theirs[0], ours[0]))
    x, weight, grad_out = probes[1], probes[0] * 0.05, probes[2][:, :64]
    with torch.enable_grad():
        grad = backend.probe_gradients(x, weight, grad_out)
        native = BACKENDS["native"](dataclasses.replace(config, backend="native"))
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


def backend_of(module: nn.Module) -> type[FP8Backend] | None:
    """The backend class whose FP8 layer ``module`` is, or None for any other module."""
    return next((backend for backend in BACKENDS.values() if backend.is_fp8_layer(module)), None)


def find_fp8_layers(model: nn.Module) -> dict[str, type[FP8Backend]]:
    """``{qualified name: backend class}`` of every FP8 layer in ``model``, whichever backend built it."""
    return {name: backend for name, module in model.named_modules() if (backend := backend_of(module)) is not None}


def convert(model: nn.Module, config: FP8Config, names: list[str]) -> None:
    """Swap the linear layers ``names`` of ``model`` for the FP8 layers of ``config.backend``, in place."""
    fp8_backend(config).convert_(model, names)


def fp8_autocast_context(config: FP8Config | str | None) -> ContextManager:
    """The context a forward with FP8 layers of ``config.backend`` runs in: TransformerEngine's autocast, else a
    no-op. Builds the backend on each call; ``PrecisionLayout.forward_context`` keeps one."""
    config = fp8_config(config)
    return fp8_backend(config).forward_context() if config is not None else contextlib.nullcontext()

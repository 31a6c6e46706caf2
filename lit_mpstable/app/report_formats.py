"""The stability report's per-layer format map: which layers computed in the FP8/FP4 recipe, in the base precision
(and why: the FP8 filter, the probe's budget, a fallback) or in an FP32 island, at the end of the run."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from torch import nn

from lit_mpstable.fp8.backends import backend_of

_BASE = {"bf16-mixed": "bf16 (autocast)", "16-mixed": "fp16 (autocast)", "bf16-true": "bf16", "16-true": "fp16",
         "32-true": "fp32"}


def layer_formats(plugin: Any) -> dict[str, str]:
    """``{qualified name: format}`` for every linear layer of the plugin's model and every FP32 island (names as the
    plugin sees them, relative to the LightningModule): ``"fp8 <recipe>"`` (``"nvfp4"``, ``"mxfp4"`` as they are),
    the base precision (``"bf16 (autocast)"``, with the reason it is not low when the FP8 config chose so:
    ``"filter"``, ``"probe budget"``, ``"fallback"``) or ``"fp32 (island)"``. ``{}`` for a plugin that is not ours
    or before the model was set up."""
    layout = getattr(plugin, "layout", None)
    module = getattr(layout, "module", None)
    if layout is None or not isinstance(module, nn.Module):
        return {}
    fp8 = getattr(plugin, "fp8", None)
    low = set(layout.fp8_layers)
    selected = set(layout.fp8_selected)
    probed = set(getattr(plugin, "fp8_high_precision_layers", None) or [])
    islands = list(layout.islands.names)
    base = "fp32" if layout.fp32 else _BASE.get(str(getattr(plugin, "precision", "")), str(plugin.precision))
    formats: dict[str, str] = {}
    for name, layer in module.named_modules():
        if name and any(name == island or name.startswith(f"{island}.") for island in islands):
            if name in islands or type(layer) is nn.Linear or backend_of(layer) is not None:
                formats[name] = "fp32 (island)"
            continue
        if type(layer) is not nn.Linear and backend_of(layer) is None:
            continue
        if name in low:
            formats[name] = _low_format(layer, fp8)
        elif fp8 is None:
            formats[name] = base
        elif name in probed:
            formats[name] = f"{base}, probe budget"
        elif name in selected:
            formats[name] = f"{base}, fallback"
        else:
            formats[name] = f"{base}, filter"
    return formats


def _low_format(layer: nn.Module, fp8: Any) -> str:
    """A low-precision layer's format: the recipe's name (``"fp8 "`` before an FP8 one; FP4 ones as they are) and,
    where its GEMM roles differ (a per-role recipe), ``fprop/dgrad/wgrad`` formats."""
    config = getattr(layer, "fp8_config", fp8)  # native layers carry their own (a per-module map's entry)
    spec = config.spec if hasattr(config, "spec") else None
    if spec is None:
        return f"fp8 {getattr(fp8, 'recipe', '?')}"
    label = spec.name if spec.fp4 else f"fp8 {spec.name}"
    return label if spec.uniform else f"{label} ({spec.fprop}/{spec.dgrad}/{spec.wgrad})"


def format_lines(summary: Mapping[str, Any]) -> list[str]:
    """The report's section for ``summary["layer_formats"]``: a count per format, then the table; ``[]`` without
    one."""
    formats = summary.get("layer_formats") or {}
    if not formats:
        return []
    counts = ", ".join(f"{fmt}: {n}" for fmt, n in Counter(formats.values()).most_common())
    lines = ["## Formats per layer", "", f"At the end of the run ({counts}).", ""]
    lines += ["| layer | format |", "| --- | --- |"]
    lines += [f"| {name} | {fmt} |" for name, fmt in formats.items()]
    return [*lines, ""]

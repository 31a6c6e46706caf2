"""The front ends' live state: attributes read from the stepper (:class:`FromStepper`) and the callbacks' shared
record (:class:`Findings`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lit_mpstable.core.step.stepper import PrecisionStepper


@dataclass
class Findings:
    """What one callback measures and another acts on, kept by the plugin (``plugin.findings``): callbacks read each
    other's results here, never each other's attributes. One writer per field."""

    probe: dict[str, Any] | None = None
    """``PrecisionProbe``'s latest result (``step``, ``modules``: per module ``rel_error``, ...), read by
    ``PrecisionFallback(max_grad_error=...)``; also shown as ``stats["probe"]``."""


class FromStepper:
    """A read-only attribute of the front end that reads the stepper's attribute of the same name; its docstring is
    the stepper's (or the one given)."""

    def __init__(self, doc: str | None = None) -> None:
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        if self.__doc__ is None:
            self.__doc__ = getattr(getattr(PrecisionStepper, name, None), "__doc__", None)

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self if obj is None else getattr(obj.stepper, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        raise AttributeError(f"{type(obj).__name__}.{self.name} is read-only: it is the stepper's live state.")


@contextmanager
def recast_from(module: nn.Module | None, weights: Mapping[str, Any] | None) -> Iterator[None]:
    """Around a load of the precision state that re-applies a fallback: the parameters it recasts (e.g. BF16 weights
    to FP32) are copied again from ``weights`` (the checkpoint's model state dict, already loaded into them at the
    configured dtype, so rounded) where it holds them in their new dtype and shape: kahan/stochastic weights saved
    mid-fallback resume exactly."""
    before = {name: p.dtype for name, p in module.named_parameters()} if module is not None and weights else {}
    yield
    if not before:
        return
    assert module is not None and weights is not None
    with torch.no_grad():
        for name, param in module.named_parameters():
            saved = weights.get(name)
            if (param.dtype != before.get(name) and isinstance(saved, torch.Tensor) and saved.dtype == param.dtype
                    and saved.shape == param.shape):
                param.copy_(saved)

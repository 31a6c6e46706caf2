"""The front ends' live state: attributes read from the stepper (:class:`FromStepper`) and the callbacks' shared
record (:class:`Findings`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lit_mpstable.core.stepper import PrecisionStepper

__all__ = ["Findings", "FromStepper"]


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

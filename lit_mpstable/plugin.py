"""Public face: re-exports the Trainer plugin StablePrecision from lit_mpstable.frontends.plugin."""

from __future__ import annotations

from lit_mpstable.frontends.plugin import StablePrecision

__all__ = ["StablePrecision"]

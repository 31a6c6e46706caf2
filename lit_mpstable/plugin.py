"""Public face: re-exports the Trainer plugin StablePrecision from lit_mpstable.frontends.trainer."""

from __future__ import annotations

from lit_mpstable.frontends.trainer import StablePrecision

__all__ = ["StablePrecision"]

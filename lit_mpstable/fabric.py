"""Public face: re-exports the Fabric plugin StablePrecision from lit_mpstable.frontends.fabric."""

from __future__ import annotations

from lit_mpstable.frontends.fabric import StablePrecision

__all__ = ["StablePrecision"]

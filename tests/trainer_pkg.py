"""The Trainer package the adapter suites run against, and our classes for it.

``lightning.pytorch`` by default; ``pytorch_lightning`` when ``LIT_MPSTABLE_TEST_TRAINER=pytorch_lightning``, which
``tests/test_pytorch_lightning.py`` sets to rerun the same suites on the standalone package's class tree (the suites
are written once, against the names here).
"""

from __future__ import annotations

import importlib
import os

NAME = os.environ.get("LIT_MPSTABLE_TEST_TRAINER", "lightning.pytorch")
pl = importlib.import_module(NAME)

if NAME == "pytorch_lightning":
    from lit_mpstable.pytorch_lightning import StablePrecision
    from lit_mpstable.pytorch_lightning.callbacks import (
        AMPPreflight,
        FaultTriage,
        OverflowMonitor,
        PrecisionFallback,
        PrecisionProbe,
        ScaleCheckpoint,
    )
else:
    from lit_mpstable import StablePrecision
    from lit_mpstable.callbacks import (
        AMPPreflight,
        FaultTriage,
        OverflowMonitor,
        PrecisionFallback,
        PrecisionProbe,
        ScaleCheckpoint,
    )

HalfPrecision, MixedPrecision = pl.plugins.precision.HalfPrecision, pl.plugins.precision.MixedPrecision

__all__ = ["AMPPreflight", "FaultTriage", "HalfPrecision", "MixedPrecision", "NAME", "OverflowMonitor",
           "PrecisionFallback", "PrecisionProbe", "ScaleCheckpoint", "StablePrecision", "pl"]

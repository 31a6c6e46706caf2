"""Callbacks that watch (OverflowMonitor), measure (PrecisionProbe), explain and repair (PrecisionFallback,
ScaleCheckpoint, AMPPreflight, FaultTriage), and survive preemption (PreemptionCheckpoint)."""

from __future__ import annotations

from lit_mpstable.callbacks.amp_preflight import AMPPreflight
from lit_mpstable.callbacks.fault_triage import FaultTriage
from lit_mpstable.callbacks.overflow_monitor import OverflowMonitor
from lit_mpstable.callbacks.precision_fallback import PrecisionFallback
from lit_mpstable.callbacks.precision_probe import PrecisionProbe
from lit_mpstable.callbacks.preemption import PreemptionCheckpoint
from lit_mpstable.callbacks.qk_clip import QKClip
from lit_mpstable.callbacks.scale_checkpoint import ScaleCheckpoint

__all__ = [
    "AMPPreflight", "FaultTriage", "OverflowMonitor", "PrecisionFallback", "PrecisionProbe", "PreemptionCheckpoint",
    "ScaleCheckpoint",
    "QKClip",
]

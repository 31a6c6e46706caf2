"""What the stepper reports beside the step: telemetry on due steps, and after a skip the blame (the data, the
parameters with inf/NaN gradients, the first module that produced them) in ``stepper.stats``."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from lit_mpstable.core.step.step_guard import late_nonfinite_note


def observe(stepper: Any) -> None:
    """Gradient telemetry into ``stepper.stats`` (the observer computes it on due steps only)."""
    module = stepper.layout.module
    if module is None:
        return
    scaler = stepper.scaler
    scale = scaler.get_scale if scaler is not None else lambda: 1.0  # called on due steps only
    fp8 = stepper.fp8 is not None and bool(stepper.layout.fp8_layers)
    updates, warning = stepper.observer.observe(module, stepper.named_grads, stepper.step_count, scale, fp8=fp8)
    stepper.stats.update(updates)
    if warning is not None:
        stepper.warnings.add_once(*warning, per=stepper.step_count)
    flush = flush_note(stepper, updates)
    if flush is not None:
        stepper.warnings.add_once("flush", flush)


_FLUSH_LIMIT = 0.05
"""Above this fraction of the nonzero gradient elements flushing to zero in FP16, the loss scale is named (once)."""
_FLUSH_PREFIX = "The loss scale flushes the FP16 gradients"


def flush_note(stepper: Any, updates: dict[str, Any]) -> str | None:
    """On a telemetry step of an FP16 run with a loss scaler: a warning when the scale flushes the gradients, else
    None. Flushing: more than 5% of the nonzero elements would flush to zero at the scale (the telemetry's forecast),
    or, at a scale below 1, more than 5% of the elements are zero already (the FP16 backward flushed them; above 1 a
    zero is as likely the model's own: a dead ReLU, an unused embedding row). Host reads on telemetry steps only
    (they have synchronised already)."""
    if stepper.scaler is None or stepper.compute_dtype != torch.float16 or "grad_underflow_frac" not in updates:
        return None
    scale = stepper.loss_scale
    forecast, zero = float(updates["grad_underflow_frac"]), float(updates.get("grad_zero_frac") or 0.0)
    flushed = max(forecast, zero if scale < 1.0 else 0.0)
    if flushed <= _FLUSH_LIMIT:
        return None
    return (f"{_FLUSH_PREFIX}: at loss scale {scale:g} (step {updates.get('stats_step')}) {flushed:.1%} of the"
            " gradient elements are zero or flush to zero in FP16. The scale grows back only after growth_interval"
            " clean steps in a row, so overflows more frequent than that ratchet it down (a FaultTriage verdict undoes"
            " the backoffs it explains). Use scaler='adaptive' (the scale follows the gradients' amax), a"
            " DynamicLossScaler with hysteresis or min_scale, or PrecisionFallback.")


def blame(stepper: Any) -> None:
    """After an overflow: the data if the batch held inf/NaN, else the parameters with inf/NaN gradients and (traced
    on the next step) the first module whose inputs were finite and outputs were not."""
    module = stepper.layout.module
    if module is None:
        return
    flag = stepper.input_nonfinite
    stepper.stats.pop("nonfinite_after_check", None)
    stepper.stats.update(stepper.observer.blame(module, stepper.named_grads(),
                                                nonfinite_input=flag is not None and bool(flag)))


def blame_late(stepper: Any, optimizer: Optimizer) -> None:
    """The gradient check found nothing: inf/NaN entered after it, which no precision setting explains. Nothing is
    blamed on a module (a fallback would island healthy layers)."""
    stepper.stats.update(blamed_params=[], blamed_modules=[], nonfinite_input=False, nonfinite_after_check=True)
    stepper.warnings.add_once(f"late-nonfinite:{type(optimizer).__name__}", late_nonfinite_note(optimizer))

"""What the stepper reports beside the step: telemetry on due steps, and after a skip the blame (the data, the
parameters with inf/NaN gradients, the first module that produced them) in ``stepper.stats``."""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

from lit_mpstable.core.step_guard import late_nonfinite_note

__all__ = ["blame", "blame_late", "observe"]


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
    if warning is not None and warning not in stepper.warnings:
        stepper.warnings.append(warning)


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
    note = late_nonfinite_note(optimizer)
    if note not in stepper.warnings:
        stepper.warnings.append(note)

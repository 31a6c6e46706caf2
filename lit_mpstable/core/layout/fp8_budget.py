"""``FP8Config(keep_high_precision=HighPrecisionBudget(by="probe"))`` inside a run: once, at the first step, each FP8
layer's weight-gradient error in the low format is measured on the step's batch, and the costliest layers go back
to the base precision within the budget. The choice is part of the stepper's state (re-applied on resume)."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from torch import nn

from lit_mpstable.core.layout.layout import PrecisionLayout
from lit_mpstable.fp8.budget import LossFn, fill_budget, layer_gradient_errors, linear_weight_numel
from lit_mpstable.fp8.config import FP8Config, HighPrecisionBudget


class BudgetReport(TypedDict):
    """What :meth:`ProbeBudget.report` returns."""

    layers: list[str]
    fraction: float
    budget: float | None
    step: int | None
    errors: dict[str, float]


class ProbeBudget:
    """The probe's choice of high-precision layers for one run (``budget`` is None unless the run's FP8 config asks
    for ``HighPrecisionBudget(by="probe")``).

    Attributes:
        layers: the layers moved back to the base precision, most costly first; ``None`` until the choice is made.
        errors: the measured relative weight-gradient error of every layer that was in the low format, by name.
        step: the optimizer step the choice was made at.
    """

    def __init__(self, fp8: FP8Config | None, owner: str) -> None:
        self.fp8 = fp8
        keep = fp8.keep_high_precision if fp8 is not None else None
        self.budget = keep if isinstance(keep, HighPrecisionBudget) and keep.by == "probe" else None
        self.owner = owner
        self.pending = self.budget is not None
        """A probe budget whose choice is still to be made (a plain attribute: the front ends read it every step)."""
        self.layers = None
        self.errors: dict[str, float] = {}
        self.step: int | None = None
        self._saved: dict[str, Any] = {}  # a choice loaded before the model was attached

    @property
    def layers(self) -> list[str] | None:
        return self._layers

    @layers.setter
    def layers(self, value: list[str] | None) -> None:
        self._layers = value
        self.pending = self.budget is not None and value is None

    # -------------------------------------------------------------------------------------------- choosing
    def choose_(self, layout: PrecisionLayout, loss_fn: LossFn, batch: object, *,
                base_precision: Callable[[], AbstractContextManager[object]], step: int,
                stats: dict[str, object]) -> list[str]:
        """See :meth:`PrecisionStepper.choose_high_precision_`: ``base_precision`` is the run's base precision
        alone (the measurement's context), ``step`` the optimizer step, ``stats`` where the report goes."""
        call = f"{self.owner}.choose_high_precision_"
        if self.budget is None:
            raise RuntimeError(f"{call}: the run's fp8 ({self.fp8!r}) has no HighPrecisionBudget(by='probe');"
                               " nothing to choose.")
        if not callable(loss_fn):
            raise TypeError(f"{call}(loss_fn={loss_fn!r}): must be a callable (module, batch) -> scalar loss.")
        if self.layers is not None:
            return list(self.layers)  # made once (or loaded): a second call changes nothing
        if layout.module is None:
            raise RuntimeError(f"{call}: call setup_module(module) first; the layers to measure are the model's.")
        low = layout.fp8_layers
        errors: dict[str, float] = {}
        if low:  # a global fallback out of FP8 leaves nothing to measure
            with base_precision():
                errors = layer_gradient_errors(layout.module, low, loss_fn, batch, config=layout.fp8)
            errors = _agreed(errors)
        chosen = fill_budget(layout.module, errors, self.budget.fraction) if errors else []
        self._apply(layout, chosen, errors, step)
        stats["fp8_high_precision"] = self.report(layout.module)
        return list(chosen)

    def report(self, module: nn.Module | None) -> BudgetReport:
        """``layers`` (kept in the base precision), ``fraction`` (their share of the linear weight elements),
        ``budget``, ``step`` and ``errors`` (per measured layer): plain values, for ``stats`` and the log line."""
        sizes = linear_weight_numel(module) if module is not None else {}
        kept = self.layers or []
        total = sum(sizes.values())
        share = sum(sizes.get(name, 0) for name in kept) / total if total else 0.0
        return {"layers": list(kept), "fraction": share, "budget": self.budget.fraction if self.budget else None,
                "step": self.step, "errors": dict(self.errors)}

    def describe(self, module: nn.Module | None, recipe: str) -> str:
        """One line: the layers kept and why (their measured error against the others')."""
        info = self.report(module)
        ranked = sorted(self.errors.items(), key=lambda kv: kv[1], reverse=True)
        measured = ", ".join(f"{name} {error:.3g}" for name, error in ranked) or "no layer was in the low format"
        kept = ", ".join(info["layers"]) or "none (no layer fits the budget)"
        return (f"HighPrecisionBudget(fraction={info['budget']}, by='probe') at step {info['step']}: kept {kept} in"
                f" the base precision ({info['fraction']:.1%} of the linear weights), the largest {recipe!r}"
                f" weight-gradient errors measured on the step's batch (relative, highest first: {measured}).")

    def _apply(self, layout: PrecisionLayout, chosen: list[str], errors: dict[str, float], step: int) -> None:
        assert layout.module is not None  # checked by the callers
        layout.keep_high_precision_(chosen)  # the layout's selection is the one list of layers FP8 may use
        self.layers, self.errors, self.step = list(chosen), dict(errors), step

    # ----------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, object]:
        """``{}`` before the choice (or without a probe budget); else ``layers``, ``errors``, ``step``."""
        if self.layers is None:
            return dict(self._saved)
        return {"layers": list(self.layers), "errors": dict(self.errors), "step": self.step}

    def check_state(self, call: str, state: object, layout: PrecisionLayout) -> None:
        """Refuse a malformed saved choice, or one that names layers this run's model does not run in FP8, before
        anything is loaded."""
        if not isinstance(state, dict):
            raise TypeError(f"{call}(fp8_budget={state!r}): must be a dict ({{}} or layers, errors, step).")
        if not state:
            return
        if set(state) != {"layers", "errors", "step"}:
            raise KeyError(f"{call}(fp8_budget keys {sorted(map(str, state))}): expected ['errors', 'layers', 'step'].")
        layers, errors, step = state["layers"], state["errors"], state["step"]
        if not isinstance(layers, (list, tuple)) or not all(isinstance(n, str) and n for n in layers):
            raise TypeError(f"{call}(fp8_budget['layers']={layers!r}): must be a list of qualified layer names.")
        if not isinstance(errors, dict) or not all(
                isinstance(k, str) and isinstance(v, float) and math.isfinite(v) and v >= 0 for k, v in errors.items()):
            raise ValueError(f"{call}(fp8_budget['errors']={errors!r}): must map layer names to finite errors >= 0.")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"{call}(fp8_budget['step']={step!r}): must be an optimizer step, an int >= 0.")
        if self.budget is None:
            return  # not applied (a note says so)
        if self.layers is not None and list(layers) != self.layers:
            raise ValueError(f"{call}(fp8_budget['layers']={list(layers)!r}): this run already moved {self.layers!r}"
                             " to the base precision; a choice cannot be undone within a run.")
        if self.layers is None and layout.module is not None:
            allowed = layout.fp8_selected
            if unknown := [name for name in layers if name not in allowed]:
                raise ValueError(f"{call}(fp8_budget['layers']={list(layers)!r}): {unknown!r} are not FP8 layers"
                                 f" of this run's model ({allowed}); resume with the model and FP8 config it was"
                                 " written with.")

    def load_state_dict(self, state: dict[str, Any], layout: PrecisionLayout) -> list[str]:
        """Re-apply a saved choice (checked by :meth:`check_state` first). Returns notes for the user."""
        if not state:
            return []
        if self.budget is None:
            return [f"{self.owner}.load_state_dict: the checkpoint holds the probe's high-precision layers"
                    f" {list(state['layers'])} but this run's fp8 has no HighPrecisionBudget(by='probe'); not applied."]
        if self.layers is not None:
            return []  # the same choice (checked)
        if layout.module is None:
            self._saved = dict(state)  # applied when the model is attached
            return []
        self._apply(layout, list(state["layers"]), state["errors"], int(state["step"]))
        return []

    def attach_(self, layout: PrecisionLayout) -> None:
        """Apply a choice loaded before the model arrived (``setup_module``, after the layout was attached)."""
        if self._saved and self.budget is not None and self.layers is None:
            saved, self._saved = self._saved, {}
            allowed = layout.fp8_selected
            if unknown := [name for name in saved["layers"] if name not in allowed]:
                raise ValueError(f"{self.owner}.setup_module: the loaded probe choice {saved['layers']!r} names"
                                 f" {unknown!r}, which are not FP8 layers of this model ({allowed}).")
            self._apply(layout, list(saved["layers"]), saved["errors"], int(saved["step"]))


def _agreed(errors: dict[str, float]) -> dict[str, float]:
    """Across data-parallel ranks (each measured its own batch), the mean error per layer: every rank then chooses
    the same layers."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return errors
    names = list(errors)
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    values = torch.tensor([errors[name] for name in names], dtype=torch.float64, device=device)
    dist.all_reduce(values)
    values /= dist.get_world_size()
    return dict(zip(names, values.tolist()))

"""The forward half of :class:`~lit_mpstable.core.step.stepper.PrecisionStepper` (a mixin): the precision context of a
forward and the batch it sees."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from lit_mpstable.base.notes import Notes
from lit_mpstable.core.attribution import any_nonfinite
from lit_mpstable.core.compiled import eager, is_compiled, recompile_note
from lit_mpstable.core.guards.growth import GrowthMonitor
from lit_mpstable.core.layout.layout import PrecisionLayout
from lit_mpstable.core.layout.policy import OpPolicy
from lit_mpstable.core.observer import GradObserver
from lit_mpstable.core.step.step_buffers import StepBuffers
from lit_mpstable.core.tensors import default_dtype, floating_tensors, map_tensors


class StepperForward:
    """``forward_context`` and ``convert_input``: they read the stepper's layout, policy, observer and dtypes."""

    layout: PrecisionLayout
    policy: OpPolicy
    observer: GradObserver
    growth: GrowthMonitor | None
    stats: dict[str, Any]
    warnings: Notes
    device: str
    _layout_seen: tuple | None
    _input_nonfinite: torch.Tensor | None
    step_buffers: StepBuffers
    _converted_to: torch.dtype | None = None  # the dtype convert_input cast the latest batch to (*-true)
    compute_dtype: torch.dtype
    dtype: torch.dtype
    true_16bit: bool
    step_count: int

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Autocast (``*-mixed``), the 16-bit default dtype (``*-true``), the op policy and FP8's own context.

        With ``torch.compile``: none of this adds a graph break (autocast and the policy's mode are traced into the
        graph, or guarded on from outside it). The forward that traces an overflow (the step after one, or every step
        with ``diagnose``) and a growth monitor's sampled forward run eagerly: their hooks would break the graph and
        recompile it.
        """
        self._note_recompile()
        self.step_buffers.begin_(self.layout.module)  # the buffers before the step's first training forward
        traced = self.observer.tracer is not None
        # A growth sample hooks the layers for this forward only; a compiled model runs it eagerly (its graph
        # holds no hook, so it neither breaks nor recompiles).
        growth = self.growth if self.growth is not None and self.growth.due() else None
        module = self.layout.module
        eagerly = traced or (growth is not None and module is not None and is_compiled(module))
        with eager() if eagerly else nullcontext(), growth.sampling() if growth is not None else nullcontext(), \
                self.layout.forward_context(), self._recast_inputs():
            if self.compute_dtype == torch.float32:
                yield
            elif self.true_16bit:
                with default_dtype(self.dtype):  # tensors created inside forward default to the 16-bit dtype
                    yield
            else:
                # cache_enabled=False as Lightning's MixedPrecision: the weight-cast cache leaks across no_grad
                # regions. The op policy runs inside autocast: it overrides it for whole families, never in islands.
                autocast = torch.autocast(self.device, dtype=self.dtype, cache_enabled=False)
                with autocast, self.policy.context(self.device):
                    yield
                if not self.policy.pending and self.stats.get("op_policy") != self.policy.choices:
                    self.stats["op_policy"] = dict(self.policy.choices)  # decided (second forward), forced or resumed
                    self.stats["op_policy_ms"] = {f: {"autocast": m.autocast_ms, "fp32": m.fp32_ms}
                                                  for f, m in self.policy.measurements.items()}

    @contextmanager
    def _recast_inputs(self) -> Generator[None, None, None]:
        """``*-true``: a batch converted before a fallback (or a restore) changed the compute dtype, e.g. by
        ``plugin.fallback(None)`` from ``on_train_batch_start`` (Lightning converts the batch before that hook): its
        16-bit tensors would meet FP32 weights ("mat1 and mat2 must have the same dtype"). For the forwards of that
        batch every module of the model casts its floating inputs of the converted dtype to the compute dtype (as
        AMPPreflight casts the batch it falls back for). Hooks for those forwards only; none otherwise."""
        stale, now, module = self._converted_to, self.compute_dtype, self.layout.module
        if not self.true_16bit or stale is None or stale == now or module is None:
            yield
            return

        def cast(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(now) if tensor.is_floating_point() and tensor.dtype == stale else tensor

        def hook(_: object, args: object, kwargs: object) -> tuple[Any, Any]:
            return map_tensors(args, cast), map_tensors(kwargs, cast)

        handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in module.modules()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _note_recompile(self) -> None:
        layout = self.layout
        seen = (layout.fp32, layout.fp8_off, tuple(layout.fp8_removed), tuple(layout.fp32_modules))
        changed, self._layout_seen = self._layout_seen not in (None, seen), seen
        if changed and layout.module is not None and is_compiled(layout.module):
            recompile_note(self.step_count, self.warnings)

    def convert_input(self, data: object) -> Any:
        """``*-true`` modes: floating tensors of ``data`` cast to the compute dtype. In every mode it notes, on the
        device, whether the batch holds inf/NaN (read only after an overflow, to blame the data and not a layer)."""
        tensors = floating_tensors(data)
        if tensors:
            flag = any_nonfinite(tensors)
            self._input_nonfinite = flag if self._input_nonfinite is None else self._input_nonfinite | flag
        if not self.true_16bit:
            return data
        self._converted_to = self.compute_dtype
        return map_tensors(data, lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t)


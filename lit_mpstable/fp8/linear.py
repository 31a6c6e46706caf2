"""FP8Linear: an nn.Linear whose three GEMMs take FP8 operands; parameters and master weights are untouched."""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import torch
from torch import nn

from lit_mpstable.base.validate import check_keys
from lit_mpstable.fp8.backend import linear_like
from lit_mpstable.fp8.block_gemm import BlockLinearFunction, counter_snapshot, layer_seed, rht_signs
from lit_mpstable.fp8.config import FP8Config
from lit_mpstable.fp8.gemm import _scaled_mm_decision, fp8_mm
from lit_mpstable.fp8.quant import (
    MX_BLOCK_SIZE,
    amax_from_history,
    as_stored,
    clip_threshold,
    compute_scale,
    current_scale,
    dequantize_mx,
    inside_backward,
    quantize,
    to_stored,
    update_amax_history_,
)
from lit_mpstable.fp8.quantizers import quantize_mx_as
from lit_mpstable.fp8.recipe import Recipe

FP8_TENSORS = ("x", "w", "grad_out")
"""The three FP8 operands of a linear layer, in the row order of ``amax_history`` and ``scale``."""
_X, _W, _GRAD = range(3)


class FP8Linear(nn.Linear):
    """``nn.Linear`` with FP8 GEMMs: ``y = x W^T``, ``grad_x = dY W`` and ``grad_W = dY^T x`` take FP8 operands.

    Weight and bias stay the same ``nn.Parameter`` objects in their own dtype (the FP32 master weights); only
    the GEMM operands are cast. Outputs come in the base precision: the autocast dtype inside ``torch.autocast``,
    else the input's dtype; ``grad_x`` has the input's dtype and ``grad_W`` the weight's.

    Execution (``emulate=None``): ``torch._scaled_mm`` on a GPU that runs it (every GEMM dim a multiple of 16) and,
    for the delayed recipe, on a CPU that runs it (:func:`_scaled_mm_decision`), else exact emulation (saturating
    cast, dequantise, fp32 matmul). ``"mxfp8"`` is always emulated: hardware MX GEMMs need Blackwell and a swizzled
    scale layout.

    State (delayed recipe only): non-persistent buffers ``amax_history`` (3, amax_history_len) and ``scale`` (3,),
    rows in :data:`FP8_TENSORS` order. Non-persistent keeps ``model.state_dict()`` identical with and without FP8,
    so plain checkpoints load either way; :meth:`fp8_state_dict` / :meth:`load_fp8_state_dict` save and restore
    them (the precision plugin stores them in its own state). Histories are updated only in ``train()`` mode.

    Activation checkpointing (``torch.utils.checkpoint``, reentrant or not): a forward that runs inside a backward
    pass is a recompute; it casts with the scales its original forward used and records nothing, so a step records
    one amax per operand and computes the same FP8 data as without checkpointing. Recomputes take the stored
    forwards' scales oldest first (as TransformerEngine does): exact for a layer called once per checkpointed
    region and step; a layer shared by several checkpointed regions is recomputed last region first, so its
    recomputes may swap the scales of its calls.

    Block recipes (``"blockwise"``, ``"mxfp4"``, ``"nvfp4"``; see :mod:`lit_mpstable.fp8.block_gemm` for which
    blocks each GEMM uses) are always emulated exactly: each operand quantised along its GEMM's reduction dim,
    dequantised, multiplied in fp32. They keep no amax history. ``"nvfp4"`` keeps a step counter, the
    non-persistent int64 buffer ``sr_counter`` (advanced by each training forward that builds a graph, saved by
    :meth:`fp8_state_dict`), which with the layer's seed (:attr:`sr_seed`, from its qualified name when the module
    swap builds it) keys the stochastic rounding of gradients: a resumed run draws the same noise. The seed also
    fixes the layer's random Hadamard signs (buffer ``rht_signs``). Each call's backward uses the counter of
    its own forward; an activation-checkpointing recompute advances it again, so the noise differs from a run
    without checkpointing (still repeatable).

    Telemetry: with ``collect_stats = True`` each call records, per operand, the saturated fraction (finite values
    beyond what rounds to the FP8 max: 464 for E4M3, 61440 for E5M2), the underflow fraction (nonzero values that
    became 0) and the amax, as 0-dim tensors in :attr:`fp8_stats` (no host sync); it costs a few passes per tensor.
    For mxfp8, ``x`` and ``w`` are measured in the forward GEMM and ``grad_out`` in the ``grad_x`` GEMM; the block
    recipes record none (their scales follow each block's amax). The GEMMs
    write them into the non-persistent buffer ``stats_buffer`` (rows in :data:`FP8_TENSORS` order), in place:
    ``torch.compile`` traces that into the graph, where Python state written inside the autograd function would
    break it.
    """

    # Buffers, registered in __init__ (amax_history and scale for delayed, sr_counter and rht_signs for nvfp4):
    # declared so that they read as tensors, not as nn.Module.__getattr__'s Tensor | Module.
    stats_buffer: torch.Tensor
    amax_history: torch.Tensor
    scale: torch.Tensor
    sr_counter: torch.Tensor
    rht_signs: torch.Tensor

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, *, config: FP8Config | None = None,
        device: torch.device | str | None = None, dtype: torch.dtype | None = None, name: str = "",
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.fp8_config = config if config is not None else FP8Config()
        self.collect_stats = False
        self._stats_numel: dict[str, float] = {}  # operands measured since stats were last cleared: their sizes
        # Delayed recipe: the scales each forward used, oldest first, for an activation-checkpointing recompute.
        self._forward_scales: deque[tuple[int, bool, torch.Tensor]] = deque()
        self.sr_seed = layer_seed(name)
        self._register_buffers(self.fp8_config, self.weight.device)

    def _register_buffers(self, config: FP8Config, device: torch.device, *, keep: bool = False) -> None:
        """Register on ``device`` the non-persistent buffers ``config``'s recipe uses (see the class docstring), fresh;
        ``keep``: leave those this layer has (their state goes on)."""

        def fresh(name: str) -> bool:
            return not (keep and name in self._buffers)

        if fresh("stats_buffer"):
            self.register_buffer("stats_buffer", torch.zeros(3, 3, device=device), persistent=False)
        if config.spec.history and fresh("amax_history"):
            history = torch.zeros(3, config.amax_history_len, device=device)
            self.register_buffer("amax_history", history, persistent=False)
            self.register_buffer("scale", torch.ones(3, device=device), persistent=False)
        if config.spec.needs_counter and fresh("sr_counter"):
            self.register_buffer("sr_counter", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
            self.register_buffer("rht_signs", rht_signs(self.sr_seed, device=device), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: FP8Config, name: str = "") -> FP8Linear:
        """An FP8Linear sharing ``linear``'s parameters (same objects: optimizers keep working) and hooks.

        ``name``: the layer's qualified name, which seeds its stochastic rounding (nvfp4).
        """
        new = linear_like(linear, cls, config=config, name=name)
        new._register_buffers(new.fp8_config, linear.weight.device)  # built on the meta device
        return new

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` sharing this layer's parameters and hooks (FP8 state is dropped)."""
        return linear_like(self)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.fp8_config.spec.name!r}, format={self.fp8_config.format!r}"

    # ----------------------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        autocast = torch.is_autocast_enabled(device_type)
        out_dtype = torch.get_autocast_dtype(device_type) if autocast else x.dtype
        if x.numel() == 0:  # shapes are host metadata: no sync
            return self._empty_forward(x, out_dtype)
        spec = self.fp8_config.spec
        if spec.blocked and not spec.mx_uniform:
            counter = None
            if spec.needs_counter:
                if self.training and torch.is_grad_enabled():
                    self.sr_counter.add_(1)  # a buffer mutation: torch.compile keeps it in the graph
                counter = counter_snapshot(self.sr_counter)
            with torch.autocast(device_type, enabled=False):
                return BlockLinearFunction.apply(x, self.weight, self.bias, self, out_dtype, counter)
        if self.collect_stats:  # sizes here, values in the GEMMs: no Python state changes inside the autograd function
            self._stats_numel = {"x": float(x.numel()), "w": float(self.weight.numel())}
            if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
                self._stats_numel["grad_out"] = float(x.numel() // self.in_features * self.out_features)
        # Autocast off inside: the casts are ours, and fp32 emulation must not be downcast to 16 bits.
        with torch.autocast(device_type, enabled=False):
            forward_scales = self._begin_forward(x)  # outside the Function: its forward runs with grad disabled
            return _FP8LinearFunction.apply(x, self.weight, self.bias, self, out_dtype, forward_scales)

    def _empty_forward(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """An empty batch (an MoE expert no token was routed to): an empty output, an empty input gradient and zero
        weight and bias gradients (so data-parallel reducers see every parameter), from a plain linear in
        ``out_dtype``; nothing is quantised or recorded (amax histories, scales and the SR counter stay as they are:
        an empty tensor has no amax)."""
        with torch.autocast(x.device.type, enabled=False):
            bias = self.bias.to(out_dtype) if self.bias is not None else None
            return nn.functional.linear(x.to(out_dtype), self.weight.to(out_dtype), bias)

    def growth_input_scale(self) -> torch.Tensor | None:
        """The scale the next forward casts its input at (delayed: a view of the history's), or None where each
        tensor or block is scaled from its own amax; GrowthMonitor's range checks use it."""
        return self.scale[_X] if self.fp8_config.spec.history else None

    @torch.no_grad()
    def growth_weight_flush(self) -> torch.Tensor | None:
        """The fraction of the weight's nonzero elements that its FP8 cast flushes to zero, at the scale the next
        forward casts it with (a 0-dim FP32 device tensor; no host read), or None for the block recipes, whose
        per-block scales confine an outlier to its own block. A weight row grown far beyond the others (a massive
        activation made in the weights) flushes the rest of the matrix, silently; GrowthMonitor names such a layer."""
        spec = self.fp8_config.spec
        if spec.blocked:
            return None
        weight, dtype = _local(self.weight.detach()), self._dtype(_W)  # FSDP2: this rank's shard, its own amax
        if spec.history:
            scale = _local(self.scale)[_W]
        else:
            scale = compute_scale(weight.abs().amax().float(), dtype, margin=self.fp8_config.margin)
        # What the cast rounds to zero: at or below half the smallest subnormal once scaled (ties go to even, 0).
        # Counted in float arithmetic: an FP8 cast, and bool comparisons, run several times slower on a CPU. A float
        # difference is positive exactly when the value lies above the threshold; NaN and inf count as above.
        finfo = torch.finfo(dtype)
        scaled = (weight.float() * scale).abs_()
        above = torch.count_nonzero(scaled.sub_(finfo.smallest_normal * finfo.eps / 2).clamp_min_(0))
        nonzero = torch.count_nonzero(weight)
        return (nonzero - above).float() / nonzero.clamp_min(1)

    def _use_scaled_mm(self, device: torch.device) -> bool:
        return _scaled_mm_decision(self.fp8_config.emulate, str(device), self.fp8_config.spec.history)

    def _dtype(self, role: int) -> torch.dtype:
        return self.fp8_config.grad_dtype if role == _GRAD else self.fp8_config.forward_dtype

    def _cast(
        self, t: torch.Tensor, role: int, recompute_scales: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-tensor recipes: (FP8 data, inverse scale) of ``t``; records the amax (delayed) and stats.

        ``recompute_scales``: a checkpointing recompute's stored scales (delayed): used as they are, nothing recorded.
        """
        config, dtype = self.fp8_config, self._dtype(role)
        amax = t.detach().abs().amax().float()
        if recompute_scales is not None:
            scale = recompute_scales[role]
        elif config.spec.history:
            # From previous steps; the buffer is updated below. An opaque copy: with a plain clone, torch.compile's
            # partitioner may recompute this cast in the backward from the buffer, updated by then (it did, for an
            # input made by a GELU: grad_W 210x off at step 0 under inductor).
            scale = counter_snapshot(self.scale[role])
        else:
            scale = current_scale(amax, dtype, margin=config.margin)
        data = quantize(t, scale, dtype)
        if self.collect_stats:
            self._record_stats(role, t, t.float() * scale, data, amax)
        if config.spec.history and self.training and recompute_scales is None:
            with torch.no_grad():
                history = update_amax_history_(self.amax_history[role], amax)
                amax_next = amax_from_history(history, config.amax_compute_algo)
                self.scale[role] = compute_scale(amax_next, dtype, margin=config.margin, previous=self.scale[role])
        return data, scale.reciprocal()

    def _begin_forward(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Delayed recipe in training: ``(recompute_scales, entry)``.

        A recompute (a forward inside a backward pass: both kinds of ``torch.utils.checkpoint`` recompute there)
        gets the oldest stored scales of a forward under the same weights, and ``entry`` None. An original forward
        that a recompute may follow stores a copy of the scales it is about to use and gets ``(None, entry)``: one
        that builds a graph (its backward drops the entry again: no recompute happened, or one consumed it), or one
        under ``no_grad`` (a reentrant checkpoint's first pass; a graph-building forward drops such entries later).
        """
        if not self.fp8_config.spec.history or not self.training or torch.compiler.is_compiling():
            return None, None  # compiled: the graph's backward recomputes without calling the module again
        stored = self.__dict__.setdefault("_forward_scales", deque())  # also for layers pickled before it existed
        version = self.weight._version  # an optimizer step between two forwards makes the older entries stale
        while stored and stored[0][0] != version:
            stored.popleft()
        if inside_backward():
            if stored:
                return stored.popleft()[2], None
            return self.scale.detach().clone(), None  # no stored forward: keep the state as it is
        builds_graph = torch.is_grad_enabled()
        if builds_graph:
            if not (x.requires_grad or any(p is not None and p.requires_grad for p in (self.weight, self.bias))):
                return None, None  # no backward, so no recompute, will follow
            # No-grad entries left over were never recomputed (a plain no_grad forward in training mode).
            kept = [e for e in stored if e[1]]
            stored.clear()
            stored.extend(kept)
        entry = self.scale.detach().clone()
        stored.append((version, builds_graph, entry))
        while len(stored) > _MAX_STORED_FORWARDS:  # forwards never recomputed nor backpropagated: forget the oldest
            stored.popleft()
        return None, entry

    def _end_backward(self, entry: torch.Tensor | None) -> None:
        """Drop the stored scales of the forward whose backward runs (a recompute may have taken them already)."""
        if entry is None:
            return
        for index, (_, _, stored) in enumerate(self._forward_scales):
            if stored is entry:
                del self._forward_scales[index]
                return

    def _cast_mx(self, t: torch.Tensor, role: int, record: bool = True) -> torch.Tensor:
        """MX recipe: ``t`` quantised in blocks of 32 along its last dim and dequantised to fp32 (emulation)."""
        dtype = self._dtype(role)
        data, block_scale = quantize_mx_as(self.fp8_config.spec, t, dtype)
        values = dequantize_mx(data, block_scale)
        if record and self.collect_stats:
            per_element = block_scale.repeat_interleave(MX_BLOCK_SIZE, dim=-1)[..., : t.shape[-1]]
            self._record_stats(role, t, t.float() / per_element, data, t.detach().abs().amax().float())
        return values

    @torch.no_grad()
    def _record_stats(
        self, role: int, t: torch.Tensor, scaled: torch.Tensor, data: torch.Tensor, amax: torch.Tensor
    ) -> None:
        finite = torch.isfinite(scaled)
        nonzero = t != 0
        saturated = (scaled.abs() > clip_threshold(data.dtype)) & finite
        underflowed = (data.float() == 0) & nonzero
        self.stats_buffer[role] = torch.stack(
            [saturated.sum() / finite.sum().clamp_min(1), underflowed.sum() / nonzero.sum().clamp_min(1), amax]
        )

    @property
    def fp8_stats(self) -> dict[str, torch.Tensor | float]:
        """The latest telemetry, per operand measured since stats were last cleared: ``<t>_saturation_frac``,
        ``<t>_underflow_frac``, ``<t>_amax`` (0-dim tensors, copies) and ``<t>_numel`` (a float)."""
        stats: dict[str, torch.Tensor | float] = {}
        for name, numel in self._stats_numel.items():
            saturation, underflow, amax = self.stats_buffer[FP8_TENSORS.index(name)].clone().unbind()
            stats.update({f"{name}_saturation_frac": saturation, f"{name}_underflow_frac": underflow,
                          f"{name}_amax": amax, f"{name}_numel": numel})
        return stats

    def clear_stats(self) -> None:
        """Forget the recorded telemetry (:attr:`fp8_stats` becomes empty)."""
        self._stats_numel = {}

    # ------------------------------------------------------------------------------------------------- state
    def fp8_state_dict(self) -> dict[str, torch.Tensor]:
        """Keys ``amax_history`` and ``scale`` (copies) for the delayed recipe, ``sr_counter`` for nvfp4; empty for
        the stateless ones."""
        spec = self.fp8_config.spec
        if spec.needs_counter:
            return {"sr_counter": self.sr_counter.detach().clone()}
        if not spec.history:
            return {}
        return {"amax_history": self.amax_history.detach().clone(), "scale": self.scale.detach().clone()}

    def load_fp8_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`fp8_state_dict`'s output (copied into the buffers, on their device).

        Raises:
            KeyError: a key is missing or unknown (saved with another recipe?).
            ValueError: a shape differs (saved with another ``amax_history_len``?).
        """
        expected = self.fp8_state_dict()
        check_keys("FP8Linear.load_fp8_state_dict", state, expected, suffix="; was it saved with another FP8 recipe?")
        for key, value in state.items():
            buffer = getattr(self, key)
            if tuple(value.shape) != tuple(buffer.shape):
                raise ValueError(
                    f"FP8Linear.load_fp8_state_dict: {key} has shape {tuple(value.shape)}, expected"
                    f" {tuple(buffer.shape)}; was it saved with another amax_history_len?"
                )
            buffer.copy_(value)

    def set_recipe_(self, spec: Recipe | FP8Config) -> None:
        """Switch this layer to another recipe in process (a precision schedule): from the next forward on, its GEMMs
        take ``spec``'s formats. Buffers the new recipe needs are created (an amax history starts empty, the SR
        counter at 0, the Hadamard signs from the layer's seed); those it keeps are kept (the SR counter goes on)."""
        config = spec if isinstance(spec, FP8Config) else dataclasses.replace(self.fp8_config, recipe=spec)
        self._register_buffers(config, self.weight.device, keep=True)
        self.fp8_config = config


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor as it is): ``core.tensors.local_view``, which fp8 cannot import (core
    imports fp8; the folders stay acyclic, ``tests/test_layering.py``)."""
    return t.to_local() if hasattr(t, "to_local") else t


_MAX_STORED_FORWARDS = 64
"""Forwards awaiting their recompute that one delayed FP8Linear remembers (pipelines keep a few microbatches)."""


class _FP8LinearFunction(torch.autograd.Function):
    """The three GEMMs of a linear layer with FP8 operands; saves FP8 data (per-tensor) or inputs (MX)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        layer: FP8Linear,
        out_dtype: torch.dtype,
        forward_scales: tuple[torch.Tensor | None, torch.Tensor | None],
    ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        x_in = as_stored(x2)  # under torch.compile: x rounded as eager stores it, whatever inductor fuses it with
        # GEMM and bias are summed in fp32 and rounded once to the output dtype, as nn.Linear's fused bias epilogue
        # does. Rounding the GEMM to 16 bits before the add is a second rounding that inductor elides when it fuses
        # the add (it keeps the fp32 value), so eager and compiled 16-bit outputs differed by one ulp on a third of
        # the elements.
        gemm_dtype = torch.promote_types(out_dtype, torch.float32) if bias is not None else out_dtype
        ctx.layer, ctx.x_shape, ctx.x_dtype, ctx.has_bias = layer, x.shape, x.dtype, bias is not None
        ctx.mx = layer.fp8_config.spec.mx_uniform
        if ctx.mx:
            # MX scales run along the reduction dim, which differs per GEMM: keep the inputs, quantise each time.
            y = to_stored(layer._cast_mx(x_in, _X) @ layer._cast_mx(weight, _W).t(), gemm_dtype)
            ctx.save_for_backward(x2, weight)
        else:
            ctx.use_scaled_mm = layer._use_scaled_mm(x.device)
            recompute_scales, ctx.forward_scales = forward_scales
            x_fp8, x_inv = layer._cast(x_in, _X, recompute_scales)
            w_fp8, w_inv = layer._cast(weight, _W, recompute_scales)
            y = fp8_mm(x_fp8, w_fp8, x_inv, w_inv, out_dtype=gemm_dtype, use_scaled_mm=ctx.use_scaled_mm)
            ctx.save_for_backward(x_fp8, w_fp8, x_inv, w_inv)
        if bias is not None:
            y = to_stored(y + bias.to(gemm_dtype), out_dtype)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        layer = ctx.layer
        g2 = as_stored(grad_out.reshape(-1, grad_out.shape[-1]))
        with torch.autocast(grad_out.device.type, enabled=False):
            if ctx.mx:
                x2, weight = ctx.saved_tensors
                w_dtype = weight.dtype
                # grad_x = dY W: reduce over out_features; grad_W = dY^T x: reduce over the tokens.
                grad_x = layer._cast_mx(g2, _GRAD) @ layer._cast_mx(weight.t(), _W, record=False).t()
                grad_w = layer._cast_mx(g2.t(), _GRAD, record=False) @ layer._cast_mx(as_stored(x2).t(), _X,
                                                                                      record=False).t()
            else:
                x_fp8, w_fp8, x_inv, w_inv = ctx.saved_tensors  # may recompute a checkpointed region first
                layer._end_backward(ctx.forward_scales)
                w_dtype = layer.weight.dtype
                g_fp8, g_inv = layer._cast(g2, _GRAD)
                # A per-tensor scale does not depend on the axis: the forward's FP8 data is reused, transposed.
                fast = ctx.use_scaled_mm
                grad_x = fp8_mm(g_fp8, w_fp8.t(), g_inv, w_inv, out_dtype=torch.float32, use_scaled_mm=fast)
                grad_w = fp8_mm(g_fp8.t(), x_fp8.t(), g_inv, x_inv, out_dtype=torch.float32, use_scaled_mm=fast)
            grad_b = to_stored(g2.float().sum(0), layer.bias.dtype) if ctx.has_bias else None
        return to_stored(grad_x, ctx.x_dtype).reshape(ctx.x_shape), to_stored(grad_w, w_dtype), grad_b, None, None, None

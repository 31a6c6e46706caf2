"""Leading indicators of a loss spike, measured on the device and read on logging steps only.

Four statistics (DESIGN "Fingerprints and leading indicators"):

- **update ratio** (``mp/update_ratio_max``): per parameter tensor, RMS(p_after - p_before) / RMS(p_before), the
  largest over the tensors (Marin's precursor: Adam's update norm doubles before the loss spikes). The update is
  measured, not modelled: the optimizer's parameters are copied before the step of a logging step only
  (:meth:`Indicators.snapshot_`), so it holds for any optimizer, weight decay and clipping included, and costs one
  transient copy of the parameters on logging steps and nothing on the others. A tensor that was all zeros before the
  step (a zero-initialised bias, LoRA's B, a zero-init output layer, on its first step) has no ratio: it counts as 0,
  below any measured ratio, so it never sets the maximum (over tensors, or over ranks in the monitor's MAX
  all-reduce). When no tensor has one the logged maximum is 0, as without a snapshot, rather than nothing: the metric
  keeps one value per logging step, the same on every rank, decided on the device before the one read, and a real
  ratio is 0 only where nothing moved.
- **Adam lag** (``mp/adam_lag_frac``): the fraction of coordinates whose squared gradient is below ``lag_threshold``
  times Adam's bias-corrected second moment, g^2 < threshold * v_hat (arXiv 2506.04805: spikes follow a regime where
  v_hat lags, g^2 << v_hat, so a later rise of g meets a stale, small denominator). Read from the optimizer's
  ``exp_avg_sq`` and ``step`` after the step (or from a weight keeper's BF16/FP8 moments, given to
  :meth:`Indicators.measure`), and the gradient the parameter still holds (or, for compact weights, whose step frees
  each gradient, the one the step kept for a logging step); parameters without them (SGD's) are skipped. Where none is
  left, the fraction is no value: :attr:`Indicators.lag_unmeasured` says why (OverflowMonitor then does not log it).
- **attention logit** (``mp/attn_logit_max``): the largest q.k/sqrt(d) per head, for modules that opt in through
  :class:`AttentionLogits` (``nn.MultiheadAttention`` and callers of ``F.scaled_dot_product_attention``).
- **SpikeScore** (``mp/spike_score``): OLMo-core's definition. A step is a spike when its loss or its gradient norm
  exceeds mean + ``threshold_std`` (6) standard deviations (population std, only when std > 1e-10) of the previous
  ``window_size`` (128) values of the same series, judged only once that window is full; the score is the fraction of
  spike steps over the last ``rolling_window`` (10000) steps, reported once that window is full (before that, the
  total: spikes / steps, once ``window_size`` steps were seen). Like OLMo-core's (which judges every step's recorded
  loss and total gradient norm, the norm its gradient clipping measured), it must see every step. Here the windows
  live on the device; a step only queues its loss and gradient norm, judged with the others in one batch of tensor ops
  when the score is read: no host read, and no judging, per step.

:class:`Indicators` also holds the warning rule (host side, on the values read at a logging step): it warns when the
update ratio passes ``ratio_factor`` times the median of its previous ``baseline`` logged values, or when the Adam
lag fraction passes ``lag_limit`` (after ``baseline`` logging steps: Adam's first steps lag by construction), once per
crossing, naming the layer. A logged maximum of 0 (no tensor had a ratio, or nothing moved: a skipped step) does not
join the baseline: it says nothing about the update's normal size, and a median of 0 would make any later update
infinitely many times it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.optim import Optimizer

from lit_mpstable.core.tensors import dense_values

MEASURED_LEAD = {
    "update_ratio": "on the CPU GPT at a spiking LR this warning came 1-11 steps before the loss spike in 4 of 5 seeds"
                    " on one machine, in 1 of 5 on another (after it, or never, in the rest); never on 5 seeds at the"
                    " normal LR",
    "adam_lag": "on the CPU GPT at a spiking LR this warning came 33-55 steps (median 46) before the loss spike in 5 of"
                " 5 seeds on each of two machines; never on 5 seeds at the normal LR",
}
"""What each warning says about its lead, as measured by experiments/indicators/lead_time.py (GPT d 128, 2 blocks,
AdamW at LR 0.4 vs 3e-3, logging every 5 steps; experiments/results/indicators/table.md, and lead_time_rerun/ on a
second machine, where the training runs, hence the spikes, differ)."""


def _check(ok: bool, call: str, rule: str) -> None:
    if not ok:
        raise ValueError(f"{call}: {rule}")


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _count(value: Any, low: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= 2**20


# ---------------------------------------------------------------------------------------------------- SpikeScore
class SpikeScore:
    """OLMo-core's SpikeScore on device buffers (see the module docstring); :meth:`update` once per step.

    A step's loss and gradient norm are queued (:meth:`update` does no device arithmetic beyond what the caller
    computed) and judged in one batch of tensor ops when the score or the state is asked for, or when
    ``PENDING`` steps are queued. Each queued step is judged against exactly the window of ``window_size`` values
    before it, in a batch of fixed shape, so the flags do not depend on when the batch ran (a resumed run judges as an
    uninterrupted one). The windows are kept oldest first, with room for a batch after them: the ``window_size``
    values before queued step i are one slice of that buffer, so a batch is judged in about 15 tensor ops."""

    PENDING = 64
    """Steps queued at most before they are judged (fewer when a window is shorter)."""

    def __init__(self, window_size: int = 128, rolling_window: int = 10000, threshold_std: float = 6.0) -> None:
        _check(_count(window_size, 2), f"SpikeScore(window_size={window_size!r})", "must be an int in [2, 2**20].")
        _check(_count(rolling_window), f"SpikeScore(rolling_window={rolling_window!r})",
               "must be an int in [1, 2**20].")
        _check(_positive(threshold_std), f"SpikeScore(threshold_std={threshold_std!r})", "must be a number > 0.")
        self.window_size, self.rolling_window, self.threshold_std = window_size, rolling_window, float(threshold_std)
        self.capacity = min(self.PENDING, window_size, rolling_window)
        self.flags = torch.zeros(rolling_window)
        """1.0 for a spike, else 0.0: the last ``rolling_window`` judged steps (a ring: step s at s % that)."""
        self.spikes = torch.zeros(())
        """Spike steps over the whole run (a device count)."""
        self.steps = 0
        """Steps seen, queued ones included (a host int: counted, never read from the device)."""
        self._pending: list[torch.Tensor] = []
        """The queued steps' loss and gradient norm, in order (0-d tensors, two a step)."""
        self._values = torch.zeros(2, window_size + self.capacity)
        """Rows: loss, gradient norm; the last ``window_size`` judged values oldest first, then a batch's room."""
        self._spare = torch.zeros_like(self._values)
        """The next batch's buffer: the kept values are copied into it (a shift in place would overlap itself)."""

    @property
    def history(self) -> torch.Tensor:
        """Rows: loss, gradient norm; the last ``window_size`` judged values as a ring (step s at s % window_size)."""
        judged = self.steps - len(self._pending) // 2
        return self._values[:, :self.window_size].roll(judged % self.window_size, dims=1)

    def to(self, device: torch.device | str) -> SpikeScore:
        self.flush()
        self._values, self._spare, self.flags, self.spikes = (
            t.to(device) for t in (self._values, self._spare, self.flags, self.spikes))
        return self

    def update(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Queue one step's loss and gradient norm (no host read, no device op)."""
        self._pending += (loss.detach() if loss.requires_grad else loss,
                          grad_norm.detach() if grad_norm.requires_grad else grad_norm)
        self.steps += 1
        if len(self._pending) >= 2 * self.capacity:
            self.flush()

    def flush(self) -> None:
        """Judge the queued steps, each against the ``window_size`` values before it, and add them to the windows."""
        if not self._pending:
            return
        size, values = self.window_size, self._values
        k = len(self._pending) // 2
        first = self.steps - k  # the first queued step
        pending, like = self._pending, self._pending[0]
        if any(t.device != like.device or t.shape != like.shape for t in pending):  # mixed devices, or a (1,)-shaped
            pending = [t.reshape(()).to(values.device) for t in pending]  # loss with a 0-d norm: one stack after all
        values[:, size:size + k].copy_(torch.stack(pending).view(k, 2).t())  # to FP32, on this device, on the way in
        self._pending = []
        # window i, the `size` values before queued step i, is values[:, i:i + size]; a batch has a fixed shape (the
        # entries past the k queued ones are stale and their verdicts dropped)
        windows = values.unfold(1, size, 1)[:, :self.capacity].contiguous()  # (2, capacity, size)
        # the population std in two passes, as OLMo writes it (torch.var's one-pass Welford kernel is ~20x slower on
        # CPUs at this shape)
        mean = windows.mean(dim=-1)
        std = torch.linalg.vector_norm(windows.sub_(mean.unsqueeze(-1)), dim=-1).div_(math.sqrt(size))
        spike = ((values[:, size:] > mean.add(std, alpha=self.threshold_std)) & (std >= 1e-10)).any(dim=0)[:k]
        if first < size:  # OLMo judges only with a full window
            spike[:size - first] = False
        start = first % self.rolling_window  # the flags ring: one slice, two where it wraps (k <= rolling_window)
        head = min(k, self.rolling_window - start)
        self.flags[start:start + head].copy_(spike[:head])
        if head < k:
            self.flags[:k - head].copy_(spike[head:])
        self.spikes += spike.sum()
        self._spare[:, :size].copy_(values[:, k:k + size])
        self._values, self._spare = self._spare, values

    def score(self) -> torch.Tensor:
        """The running score over a full rolling window, else the total rate (0 before ``window_size`` steps)."""
        self.flush()
        if self.steps >= self.rolling_window:
            return self.flags.mean()
        return self.spikes / self.steps if self.steps >= self.window_size else torch.zeros_like(self.spikes)

    def state_dict(self) -> dict[str, Any]:
        """Keys: ``history`` (as :attr:`history`), ``flags``, ``spikes``, ``steps``."""
        self.flush()
        return {"history": self.history.tolist(), "flags": self.flags.tolist(), "spikes": float(self.spikes),
                "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        history, flags = torch.tensor(state["history"]), torch.tensor(state["flags"])
        size = self.window_size
        _check(tuple(history.shape) == (2, size) and tuple(flags.shape) == tuple(self.flags.shape),
               f"SpikeScore.load_state_dict(history {tuple(history.shape)}, flags {tuple(flags.shape)})",
               f"this score's windows are {size} and {self.rolling_window} steps; the checkpoint's differ.")
        self._pending = []
        self.steps = int(state["steps"])
        self._values[:, :size].copy_(history.roll(-(self.steps % size), dims=1))  # the ring, oldest first
        self.flags.copy_(flags)
        self.spikes.fill_(float(state["spikes"]))


# ---------------------------------------------------------------------------------------------------- attention
def _masked_logit_max(q: torch.Tensor, k: torch.Tensor, scale: float, attn_mask: torch.Tensor | None,
                      is_causal: bool) -> torch.Tensor:
    """Per head, the largest scaled logit q.k * scale over the pairs the mask allows. ``q``: (..., H, L, d), ``k``:
    (..., H, S, d), or (..., H / G, S, d) with grouped keys (SDPA's ``enable_gqa``: query heads g*G to g*G + G - 1
    read key head g); returns (H,). A boolean mask allows where True; a float mask is added, as SDPA does.

    One product q.k^T, edited in place: the causal mask is added as a cached 0/-inf bias, and a positive scale is
    applied to the maxima (rounding is monotone, so max(x) * s == max(x * s)) rather than to every logit."""
    heads, kv_heads = q.shape[-3], k.shape[-3]
    if kv_heads != heads:  # each key head repeated for its group of query heads, as SDPA's enable_gqa does
        k = k.unsqueeze(-3).expand(*k.shape[:-2], heads // kv_heads, *k.shape[-2:]).flatten(-4, -3)
    # In FP32 whatever autocast is on (an FP16 product would make a logit above 65504 inf); contiguous q and k: a
    # batched product of strided views (q, k sliced from one qkv projection) is several times slower on CPUs.
    with torch.autocast(q.device.type, enabled=False):
        logits = torch.matmul(q.float().contiguous(), k.float().contiguous().transpose(-2, -1))
    late = (attn_mask is not None and attn_mask.dtype != torch.bool) or scale <= 0
    if late:  # a float mask is added to scaled logits
        logits.mul_(scale)
    if is_causal:
        logits.add_(_causal_bias(logits.shape[-2], logits.shape[-1], logits.device))
    if attn_mask is not None:
        inplace = torch.broadcast_shapes(logits.shape, attn_mask.shape) == logits.shape
        if attn_mask.dtype == torch.bool:
            logits = (logits.masked_fill_ if inplace else logits.masked_fill)(~attn_mask, float("-inf"))
        else:
            logits = logits.add_(attn_mask.float()) if inplace else logits + attn_mask.float()
    per_head = logits.amax(dim=(-2, -1))  # (..., H)
    per_head = per_head.reshape(-1, per_head.shape[-1]).amax(dim=0)
    return per_head if late else per_head.mul_(scale)


_CAUSAL: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _causal_bias(length: int, source: int, device: torch.device) -> torch.Tensor:
    """0 where query i may see key j (j <= i, SDPA's top-left causal alignment), -inf above; cached per shape."""
    key = (length, source, device)
    bias = _CAUSAL.get(key)
    if bias is None:
        future = torch.ones(length, source, dtype=torch.bool, device=device).triu(1)
        bias = _CAUSAL[key] = torch.zeros(length, source, device=device).masked_fill_(future, float("-inf"))
        if len(_CAUSAL) > 64:  # a few shapes in a run; never an unbounded cache
            del _CAUSAL[next(iter(_CAUSAL))]
    return bias


class AttentionLogits:
    """Opt-in recorder of the per-head max attention logit, q.k/sqrt(d), of a model's attention modules.

    What it recognises:

    - every ``nn.MultiheadAttention``: a forward pre-hook recomputes q and k from its input projection
      (``in_proj_weight``/``in_proj_bias``, or ``q_proj_weight``/``k_proj_weight``), honouring ``attn_mask``,
      ``is_causal`` and ``key_padding_mask``;
    - ``F.scaled_dot_product_attention`` called inside the forward of a module in ``sdpa_modules`` (names; default:
      every module with a ``qkv`` child or ``q_proj`` and ``k_proj`` children, the layouts :class:`QKClip` repairs):
      while such a module runs on an armed step, ``torch.nn.functional.scaled_dot_product_attention`` is wrapped to
      record q.k*scale of its q and k (with its ``attn_mask``, ``is_causal`` and ``scale``; grouped keys, its
      ``enable_gqa``, per query head) before attending. Code that imported the function under another name
      (``from torch.nn.functional import scaled_dot_product_attention``) is not seen.

    It measures only while :attr:`armed` (a logging step, or every step for QKClip); :meth:`take` returns the maxima
    since the last take, per module name, as device tensors of shape (heads,), maxed over micro-batches.
    """

    def __init__(self, model: nn.Module, sdpa_modules: Sequence[str] | None = None) -> None:
        named = dict(model.named_modules())
        if sdpa_modules is None:
            sdpa_modules = [name for name, module in named.items() if has_qk_projections(module)
                            and not isinstance(module, nn.MultiheadAttention)]
        unknown = [name for name in sdpa_modules if name not in named]
        _check(not unknown, f"AttentionLogits(sdpa_modules={list(sdpa_modules)!r})",
               f"{unknown} are not modules of the model (names as model.named_modules() gives them).")
        self.maxima: dict[str, torch.Tensor] = {}
        self._mha = [(name, module) for name, module in named.items() if isinstance(module, nn.MultiheadAttention)]
        self._sdpa = [(name, named[name]) for name in sdpa_modules]
        self._armed = False
        self._handles: list[Any] = []
        self.names = [n for n, m in named.items() if isinstance(m, nn.MultiheadAttention)] + list(sdpa_modules)
        """The modules watched, MultiheadAttention first."""

    @property
    def armed(self) -> bool:
        """Whether the next forwards are measured. Arming installs the hooks and disarming removes them, so an unarmed
        model runs with no hook of ours (the steps between logging steps pay nothing)."""
        return self._armed

    @armed.setter
    def armed(self, value: bool) -> None:
        value = bool(value)
        if value == self._armed:
            return
        self._armed = value
        if not value:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            _SDPA.leave(self, every=True)  # a forward that raised past torch's hooks (KeyboardInterrupt) never left
            return
        for name, module in self._mha:
            self._handles.append(module.register_forward_pre_hook(self._mha_hook(name), with_kwargs=True))
        for name, module in self._sdpa:
            self._handles.append(module.register_forward_pre_hook(self._enter(name)))
            # always_call: a forward that raises (an OOM, a KeyboardInterrupt) must not leave torch's function wrapped
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))

    def remove(self) -> None:
        """Disarm (remove the hooks); the recorder can be armed again."""
        self.armed = False

    def take(self) -> dict[str, torch.Tensor]:
        maxima, self.maxima = self.maxima, {}
        return maxima

    def _record(self, name: str, per_head: torch.Tensor) -> None:
        per_head = per_head.detach()
        old = self.maxima.get(name)
        self.maxima[name] = per_head if old is None else torch.maximum(old, per_head)

    # -- nn.MultiheadAttention
    def _mha_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.MultiheadAttention, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not self.armed:
                return
            with torch.no_grad():
                self._record(name, _mha_logit_max(module, args, kwargs))
        return hook

    # -- scaled_dot_product_attention callers
    def _enter(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self.armed:
                _SDPA.enter(self, name)
        return hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        _SDPA.leave(self)


class _SdpaTap:
    """The one wrapper of ``torch.nn.functional.scaled_dot_product_attention``, installed while any recorder's
    watched module runs (several recorders, e.g. OverflowMonitor's and QKClip's, share it: each records under its
    innermost active module), and the real function put back when the last one leaves."""

    def __init__(self) -> None:
        self.real: Callable[..., Any] | None = None
        self.active: list[tuple[AttentionLogits, str]] = []

    def enter(self, recorder: AttentionLogits, name: str) -> None:
        self.active.append((recorder, name))
        if self.real is None:
            self.real = F.scaled_dot_product_attention
            torch.nn.functional.scaled_dot_product_attention = self.sdpa  # type: ignore[assignment]

    def leave(self, recorder: AttentionLogits, *, every: bool = False) -> None:
        """``recorder``'s innermost module returned; ``every``: all of its modules are left (it was disarmed)."""
        for index in range(len(self.active) - 1, -1, -1):
            if self.active[index][0] is recorder:
                del self.active[index]
                if not every:
                    break
        if not self.active and self.real is not None:
            torch.nn.functional.scaled_dot_product_attention = self.real
            self.real = None

    def sdpa(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
             dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, **kwargs: Any) -> Any:
        assert self.real is not None
        innermost = {id(recorder): (recorder, name) for recorder, name in self.active}
        if innermost:
            with torch.no_grad():
                factor = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
                per_head = _masked_logit_max(query, key, factor, attn_mask, is_causal)
            for recorder, name in innermost.values():
                recorder._record(name, per_head)
        return self.real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, **kwargs)


_SDPA = _SdpaTap()


def has_qk_projections(module: nn.Module) -> bool:
    """Whether ``module`` has an ``nn.Linear`` child ``qkv``, or children ``q_proj`` and ``k_proj``: an attention
    layout :class:`AttentionLogits` watches by default."""
    children = dict(module.named_children())
    return isinstance(children.get("qkv"), nn.Linear) or (
        isinstance(children.get("q_proj"), nn.Linear) and isinstance(children.get("k_proj"), nn.Linear))


def _mha_logit_max(module: nn.MultiheadAttention, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """Per head max logit of a MultiheadAttention call, from its inputs and its input projection."""
    names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights",
             "is_causal")
    call = dict(zip(names, args)) | kwargs
    query, key = call["query"], call["key"]
    if module.batch_first and query.dim() == 3:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    if query.dim() == 2:  # unbatched (L, E)
        query, key = query.unsqueeze(1), key.unsqueeze(1)
    heads, dim = module.num_heads, module.head_dim
    w_q, w_k = qk_weights(module)
    b_q = b_k = None
    if module.in_proj_bias is not None:
        b_q, b_k = module.in_proj_bias[:module.embed_dim], module.in_proj_bias[module.embed_dim:2 * module.embed_dim]
    q = F.linear(query, w_q, b_q)  # (L, N, E)
    k = F.linear(key, w_k, b_k)
    length, batch, source = q.shape[0], q.shape[1], k.shape[0]
    q = q.reshape(length, batch, heads, dim).permute(1, 2, 0, 3)  # (N, H, L, d)
    k = k.reshape(source, batch, heads, dim).permute(1, 2, 0, 3)
    mask = call.get("attn_mask")
    allowed: torch.Tensor | None = None
    if mask is not None:
        allowed = ~mask if mask.dtype == torch.bool else mask  # MHA's boolean mask marks the pairs NOT allowed
        if allowed.dim() == 3:  # (N*H, L, S)
            allowed = allowed.reshape(batch, heads, length, source)
    padding = call.get("key_padding_mask")
    if padding is not None:
        keep = ~padding.bool() if padding.dtype == torch.bool else padding
        keep = keep.reshape(batch, 1, 1, source)
        if keep.dtype == torch.bool:
            allowed = keep if allowed is None else (allowed & keep if allowed.dtype == torch.bool
                                                    else allowed.masked_fill(~keep, float("-inf")))
        else:
            allowed = keep if allowed is None else allowed + keep
    causal = bool(call.get("is_causal", False)) and mask is None
    return _masked_logit_max(q, k, 1.0 / math.sqrt(dim), allowed, causal)


def qk_weights(module: nn.MultiheadAttention) -> tuple[torch.Tensor, torch.Tensor]:
    """W_q and W_k of a MultiheadAttention (views: rows of ``in_proj_weight``, or the separate weights)."""
    if module.in_proj_weight is not None:
        e = module.embed_dim
        return module.in_proj_weight[:e], module.in_proj_weight[e:2 * e]
    assert module.q_proj_weight is not None and module.k_proj_weight is not None
    return module.q_proj_weight, module.k_proj_weight


# ---------------------------------------------------------------------------------------------------- the indicators
Optimizers = Optimizer | Sequence[Optimizer]
"""One optimizer or several (a Trainer's list): their parameters, in order, are the indicators' 'layers'."""


def _entries(optimizers: Optimizers) -> list[tuple[Optimizer, dict[str, Any], torch.Tensor]]:
    """(optimizer, param group, parameter) of every parameter the optimizers step, in order."""
    listed = [optimizers] if isinstance(optimizers, Optimizer) else list(optimizers)
    return [(opt, group, p) for opt in listed for group in opt.param_groups for p in group["params"]]


def _fp32(t: torch.Tensor) -> torch.Tensor:
    if type(t).dequantize is not torch.Tensor.dequantize:  # torchao's 8-bit, 4-bit and FP8 optimizer states hold
        t = t.dequantize()  # codes and scales, which the multi-tensor ops do not take (and .float() keeps them)
    return t if t.dtype == torch.float32 and type(t) is torch.Tensor else t.float()


def _step_counts(steps: list[Any], device: torch.device) -> torch.Tensor:
    """The optimizers' step count of each parameter as one FP32 vector on ``device``: one stack where they are 0-d
    tensors there (torch.optim's Adam family keeps them so), else one conversion each."""
    if all(isinstance(s, torch.Tensor) and s.dim() == 0 and s.device == device for s in steps):
        return torch.stack(steps).float()
    return torch.stack([torch.as_tensor(s, dtype=torch.float32, device=device).reshape(()) for s in steps])


def _params(optimizers: Optimizers) -> list[torch.Tensor]:
    return [p for _, _, p in _entries(optimizers)]


class Indicators:
    """The update ratio, Adam lag and SpikeScore of one run, and the rule that turns logged values into warnings.

    Per step (no host read): :meth:`update_spike_score`. On logging steps: :meth:`snapshot_` before the optimizer
    step, :meth:`measure` after it (device tensors, one flat vector: read it once), :meth:`judge` on the host values.

    Args:
        ratio_factor: warn when the update ratio of a layer passes this many times the median of its ``baseline``
            previous logged maxima (Marin: the update norm doubled before the loss spiked).
        baseline: logged values the median is taken over (the rule is quiet until that many were logged).
        lag_threshold: a coordinate lags when g^2 < lag_threshold * v_hat.
        lag_limit: warn when the fraction of lagging coordinates passes it.
        spike_window, spike_rolling_window, spike_threshold_std: SpikeScore's ``window_size``, ``rolling_window``
            and ``threshold_std`` (OLMo-core's defaults).
        spike_score: ``False``: no SpikeScore (:attr:`spike_score` is None). It is the only statistic that needs
            every step: the loss and the norm of all gradients, free where the step measured that norm (pass it to
            :meth:`update_spike_score`: OverflowMonitor takes StablePrecision's), else one memory-bound pass over
            the gradients (~0.5% of the CPU GPT's step in experiments/indicators/overhead.py --grad-norm read);
            without it the steps between logging steps do nothing.
    """

    def __init__(self, ratio_factor: float = 2.0, baseline: int = 8, lag_threshold: float = 0.01,
                 lag_limit: float = 0.5, spike_window: int = 128, spike_rolling_window: int = 10000,
                 spike_threshold_std: float = 6.0, spike_score: bool = True) -> None:
        _check(_positive(ratio_factor) and ratio_factor > 1, f"Indicators(ratio_factor={ratio_factor!r})",
               "must be a number > 1 (2.0: the update ratio doubled).")
        _check(_count(baseline), f"Indicators(baseline={baseline!r})", "must be an int in [1, 2**20] (logged values).")
        _check(_positive(lag_threshold), f"Indicators(lag_threshold={lag_threshold!r})", "must be a number > 0.")
        _check(_positive(lag_limit) and lag_limit <= 1, f"Indicators(lag_limit={lag_limit!r})",
               "must be a fraction in (0, 1].")
        self.ratio_factor, self.baseline = float(ratio_factor), baseline
        self.lag_threshold, self.lag_limit = float(lag_threshold), float(lag_limit)
        _check(isinstance(spike_score, bool), f"Indicators(spike_score={spike_score!r})", "must be True or False.")
        self.spike_score = SpikeScore(spike_window, spike_rolling_window, spike_threshold_std) if spike_score else None
        self.ratios: list[float] = []
        """The last ``baseline`` logged ``update_ratio_max`` values (the warning's baseline)."""
        self.judged = 0
        """Logging steps judged so far (the Adam-lag rule waits for ``baseline`` of them: Adam's first steps lag)."""
        self.above = {"update_ratio": False, "adam_lag": False}
        """Whether each indicator was above its limit at the last logging step (a warning fires on each crossing)."""
        self.lag_unmeasured: str | None = None
        """Why the last :meth:`measure` measured the Adam lag of no parameter (its 0 is then no value); None where
        it measured one."""
        self._before: list[torch.Tensor] | None = None

    # -- device side
    def update_spike_score(self, loss: torch.Tensor, optimizer: Optimizers | None,
                           norms: Sequence[torch.Tensor | None] | None = None) -> None:
        """One step's SpikeScore input: the loss and the total norm of the optimizer's gradients (device); nothing
        without a SpikeScore. ``norms``: each optimizer's gradient norm as the step measured it (the precision
        plugin's one pass, or what ``clip_grad_norm_`` returned); where one is missing the gradients are read here, one
        pass over them every step."""
        if self.spike_score is None:
            return
        if norms and all(n is not None for n in norms):
            known = [n for n in norms if n is not None]  # one: queued as it is (made FP32 when judged)
            norm = known[0] if len(known) == 1 else torch.linalg.vector_norm(torch.stack([n.float() for n in known]))
        else:
            params = _params(optimizer) if optimizer is not None else []
            grads = dense_values([p.grad for p in params if p.grad is not None])
            norm = (torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) if grads
                    else torch.zeros((), device=loss.device))
        self.spike_score.update(loss, norm)

    def snapshot_(self, optimizer: Optimizers) -> None:
        """Copy the optimizer's parameters before the step of a logging step (the update ratio's 'before')."""
        self._before = [p.detach().clone() for p in _params(optimizer)]

    def measure(self, optimizer: Optimizers, moments: Mapping[int, tuple[torch.Tensor, Any]] | None = None,
                grads: Mapping[int, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """After the step: per parameter tensor, the update ratio (0 without a snapshot, or where the tensor was all
        zeros before the step: it has none) and the Adam-lag fraction (0 where no Adam state), and the global lag
        fraction; device tensors, nothing read. Where no parameter's lag could be measured, :attr:`lag_unmeasured`
        says why (decided on the host, from what the parameters and states hold).

        ``moments``: Adam's second moment (of the parameter's shape) and step count by parameter id, for
        parameters whose moments a weight keeper holds outside ``optimizer.state`` (BF16/FP8 moments). ``grads``: the
        gradient each parameter was stepped with (true values: unscaled, clipped) by parameter id, for parameters whose
        step freed it (compact weights' :meth:`~lit_mpstable.core.weights.compact.CompactWeights.take_stepped_grads`).

        Seven multi-tensor (``torch._foreach_*``) passes over all parameters, no per-parameter arithmetic: three for
        the update ratio (the update is p_before - p_after, computed in the snapshot's own memory), four for the lag
        (five where the optimizer keeps its step counts on the accelerator)."""
        entries = _entries(optimizer)
        params = [p.detach() for _, _, p in entries]
        device = params[0].device if params else torch.device("cpu")
        before, self._before = self._before, None
        if before is not None and len(before) == len(params):
            scale = torch._foreach_norm(before)
            torch._foreach_sub_(before, params)  # the update (negated), in place
            norms = torch.stack(torch._foreach_norm(before) + scale).view(2, len(params))
            ratios = norms[0].div(norms[1]).masked_fill_(norms[1] == 0, 0.0)  # all zeros before: no ratio
        else:
            ratios = torch.zeros(len(params), device=device)
        del before
        # A coordinate lags when g^2 < threshold * v / (1 - beta2^t), i.e. v - g * g * (1 - beta2^t) / threshold > 0:
        # v is subtracted, never multiplied (Adam's second moments are often subnormal, and subnormal products are
        # slow on CPUs). The non-positive differences are made 0 and the positive 1 (clamp, sign: NaN gives 0, not
        # lagging, as a comparison would) and counted as a squared norm (exact below 2**22 coordinates a tensor).
        used, stepped, seconds, steps, betas = [], [], [], [], []
        adam = 0  # parameters with Adam's second moment and step count
        for i, (opt, group, p) in enumerate(entries):
            state = opt.state.get(p, {})
            v, step = moments[id(p)] if moments is not None and id(p) in moments else (state.get("exp_avg_sq"),
                                                                                          state.get("step"))
            if v is None or step is None or v.shape != p.shape:
                continue
            adam += 1
            grad = grads[id(p)] if grads is not None and id(p) in grads else p.grad
            if grad is None:
                continue
            used.append(i)
            stepped.append(_fp32(grad.detach()))
            seconds.append(_fp32(v))
            steps.append(step)
            betas.append(float(group.get("betas", (0.9, 0.999))[1]))
        self.lag_unmeasured = (
            None if used else "no parameter holds a gradient after the optimizer step" if adam
            else "the optimizer's state holds no Adam second moment (exp_avg_sq) and step count")
        lag = torch.zeros(len(params), device=device)
        if stepped:
            where = steps[0].device if isinstance(steps[0], torch.Tensor) else torch.device("cpu")
            decayed = torch.tensor(betas, device=where) ** _step_counts(steps, where)  # beta2^t
            factors = decayed.sub_(1).mul_(1 / self.lag_threshold)  # -(1 - beta2^t) / threshold
            # v + g * g * factor in one pass where the factors are in host memory (read as scalars: no device sync);
            # where the optimizer keeps its step counts on the accelerator (a capturable Adam) they scale g first
            if factors.device.type == "cpu":
                lagging = torch._foreach_addcmul(seconds, stepped, stepped, factors)
            else:
                lagging = torch._foreach_addcmul(seconds, stepped, torch._foreach_mul(stepped, list(factors.unbind())))
            torch._foreach_clamp_min_(lagging, 0.0)
            torch._foreach_sign_(lagging)
            counts = torch.stack(torch._foreach_norm(lagging)).square_().round_().to(device)
            lag = counts if len(used) == len(params) else lag.index_copy_(0, torch.tensor(used, device=device), counts)
        sizes = [0] * len(params)
        for i in used:
            sizes[i] = params[i].numel()
        per_layer = lag / torch.tensor([max(n, 1) for n in sizes], dtype=torch.float32, device=device)
        total = lag.sum() / max(sum(sizes), 1)
        return ratios, per_layer, total

    # -- host side
    def judge(self, ratios: Sequence[float], lags: Sequence[float], lag_total: float, names: Sequence[str],
              step: int) -> list[str]:
        """Warnings for one logging step's host values (the same values on every rank give the same warnings)."""
        warnings = []
        self.judged += 1
        if ratios:
            worst = max(range(len(ratios)), key=lambda i: ratios[i])
            ratio = ratios[worst]
            reference = sorted(self.ratios)[len(self.ratios) // 2] if len(self.ratios) >= self.baseline else None
            above = reference is not None and ratio > self.ratio_factor * reference
            if above and not self.above["update_ratio"] and reference is not None:
                warnings.append(
                    f"update ratio of {names[worst]!r} at step {step}: {ratio:.3g} (update RMS / parameter RMS),"
                    f" {ratio / reference:.1f}x the median of the last {self.baseline} logged ({reference:.3g});"
                    f" {MEASURED_LEAD['update_ratio']}")
            self.above["update_ratio"] = above
            # a warned-about value does not become the new normal; a step with no ratio (0) is no normal at all
            if not above and math.isfinite(ratio) and ratio > 0:
                self.ratios = (self.ratios + [ratio])[-self.baseline:]
        if lags:
            above = lag_total > self.lag_limit and self.judged > self.baseline
            if above and not self.above["adam_lag"]:
                worst = max(range(len(lags)), key=lambda i: lags[i])
                warnings.append(
                    f"Adam lag at step {step}: {lag_total:.1%} of coordinates have g^2 < {self.lag_threshold:g} *"
                    f" v_hat (lag_limit {self.lag_limit:.0%}); most in {names[worst]!r} ({lags[worst]:.1%});"
                    f" {MEASURED_LEAD['adam_lag']}")
            self.above["adam_lag"] = above
        return warnings

    def state_dict(self) -> dict[str, Any]:
        return {"ratios": list(self.ratios), "judged": self.judged, "above": dict(self.above),
                "spike_score": self.spike_score.state_dict() if self.spike_score is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ratios, self.judged = [float(r) for r in state["ratios"]], int(state["judged"])
        self.above = {key: bool(state["above"][key]) for key in self.above}
        if self.spike_score is not None:
            _check(isinstance(state["spike_score"], dict), "Indicators.load_state_dict(spike_score=None)",
                   "the checkpoint has no SpikeScore (saved with spike_score=False); this run measures one.")
            self.spike_score.load_state_dict(state["spike_score"])


def parameter_names(model: nn.Module, optimizer: Optimizers) -> list[str]:
    """The model's name of each optimizer parameter (by identity), ``group{g}.{i}`` where the optimizer holds a
    copy (FP32 masters: ``param{i}``, the i-th parameter the optimizers step): the layer a warning names."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    return [by_id.get(id(p), f"param{i}") for i, p in enumerate(_params(optimizer))]

"""QKClip: after each optimizer step, rescale W_q and W_k of every attention head whose max logit passed a threshold
(Kimi K2's QK-Clip, Megatron-LM's ``qk_clip``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lit_mpstable.callbacks._common import check, strict_keys
from lit_mpstable.core.guards.indicators import AttentionLogits, has_qk_projections, qk_weights

HEAD_COUNTS = ("n_heads", "num_heads", "n_head", "num_attention_heads")
"""The int attributes a module's head count is read from, in this order (the zoo's, torch's, nanoGPT's, Hugging
Face's)."""


class QKClip(pl.Callback):
    """Keeps attention logits under ``threshold`` by shrinking the query and key projections of the heads that pass
    it. Each step the per-head max logit S_h = max q.k/sqrt(d) of the step's forward is measured on the device
    (:class:`~lit_mpstable.core.guards.indicators.AttentionLogits`); after the optimizer step, with
    eta_h = min(1, threshold / S_h), head h's rows of W_q are multiplied by eta_h ** alpha and its rows of W_k by
    eta_h ** (1 - alpha) (their biases too), so its largest logit becomes ``threshold``; heads below it are multiplied
    by 1. All of it is tensor arithmetic: no host read.

    What it recognises (the attention modules of ``pl_module``, or those named in ``modules``):

    - ``nn.MultiheadAttention``: the first and second ``embed_dim`` rows of ``in_proj_weight`` (or ``q_proj_weight``,
      ``k_proj_weight``), ``head_dim`` rows a head;
    - a module with an ``nn.Linear`` child ``qkv`` (rows: all of q, then k, then v; ``head_dim`` rows a head, as
      ``lit_mpstable.app.zoo.GPT``'s blocks) or children ``q_proj`` and ``k_proj``, and an int head count (an
      attribute of :data:`HEAD_COUNTS`: ``n_heads``, ``num_heads``, ``n_head`` or ``num_attention_heads``), calling
      ``F.scaled_dot_product_attention`` in its forward. Grouped keys (fewer key than query heads) are refused.

    A module with such projections that it cannot clip (no head count, grouped keys), or a model with no attention
    module it recognises, is named in a warning at fit start: ``OverflowMonitor(attention=True)`` records the logits
    of every module with those projections, so it may log logits above the threshold that QKClip leaves alone.

    It edits the module's parameters in place: the weights the optimizer steps. Under ``StablePrecision`` with FP32
    master weights the optimizer steps copies, which would overwrite the edit: QKClip then warns once and does
    nothing.

    Args:
        threshold: the largest attention logit allowed (Kimi K2: 100).
        alpha: the share of the rescaling put on W_q (0.5: the square root of eta on each).
        modules: names of the SDPA-calling modules to clip (default: every module recognised).

    Raises:
        ValueError: an argument is out of range; at fit start, a named module is not recognised.
    """

    def __init__(self, threshold: float = 100.0, alpha: float = 0.5, modules: Sequence[str] | None = None) -> None:
        super().__init__()
        number = isinstance(threshold, (int, float)) and not isinstance(threshold, bool)
        check(number and math.isfinite(threshold) and threshold > 0, f"QKClip(threshold={threshold!r})",
              "must be a finite number > 0 (a max attention logit; Kimi K2 uses 100).")
        number = isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
        check(number and 0 <= alpha <= 1, f"QKClip(alpha={alpha!r})",
              "must be a number in [0, 1] (the share of the rescaling on W_q; 0.5 splits it evenly).")
        check(modules is None or (isinstance(modules, (list, tuple)) and all(isinstance(m, str) for m in modules)),
              f"QKClip(modules={modules!r})", "must be None or a list of module names.")
        self.threshold, self.alpha = float(threshold), float(alpha)
        self.modules = None if modules is None else list(modules)
        self.recorder: AttentionLogits | None = None
        self.targets: dict[str, _Target] = {}
        self.heads_clipped = torch.zeros((), dtype=torch.long)
        """Head-steps rescaled over the run (a device count, read only when saved)."""
        self._inactive = False
        self._step = -1

    @cached_property  # the constructor's arguments: Lightning reads the key at every hook of every step
    def state_key(self) -> str:
        return type(self).__qualname__ + repr(dict(threshold=self.threshold, alpha=self.alpha))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        named = dict(pl_module.named_modules())
        chosen = self.modules if self.modules is not None else [n for n, m in named.items() if _target(m) is not None]
        for name in chosen:
            target = _target(named[name]) if name in named else None
            check(target is not None, f"QKClip(modules=[..., {name!r}, ...])",
                  "is not an nn.MultiheadAttention nor a module with a qkv (or q_proj and k_proj) nn.Linear and an"
                  f" int {' / '.join(HEAD_COUNTS)}" + ("" if name in named else ": no module has that name") + ".")
            assert target is not None
            self.targets[name] = target
        if self.modules is None:
            unclipped = {n: m for n, m in named.items() if has_qk_projections(m) and n not in self.targets}
            if unclipped or not self.targets:
                rank_zero_warn(_unclipped_note(unclipped, list(self.targets)))
            if not self.targets:
                return
        stepped = {id(p) for opt in trainer.optimizers for group in opt.param_groups for p in group["params"]}
        if any(id(t.weights[0]) not in stepped for t in self.targets.values()):
            self._inactive = True
            rank_zero_warn("QKClip does nothing: the optimizer does not step the attention modules' own weights"
                           " (FP32 master weights?), so a rescale would be overwritten.")
            return
        sdpa = [n for n in self.targets if not isinstance(named[n], nn.MultiheadAttention)]
        self.recorder = AttentionLogits(pl_module, sdpa)
        self.heads_clipped = self.heads_clipped.to(pl_module.device)
        self._step = trainer.global_step

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.recorder is not None:
            self.recorder.remove()
            self.recorder = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """As :meth:`on_fit_end`: an exception that passed torch's forward hooks (a KeyboardInterrupt) left
        ``F.scaled_dot_product_attention`` wrapped, for every later call in the process."""
        self.on_fit_end(trainer, pl_module)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.recorder is not None:
            self.recorder.armed = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.recorder is None or trainer.global_step == self._step:  # no optimizer step yet (accumulation)
            return
        self._step = trainer.global_step
        self.recorder.armed = False
        maxima = self.recorder.take()
        if trainer.world_size > 1 and maxima:  # every rank rescales by the same factors
            names = sorted(maxima)
            flat = trainer.strategy.reduce(torch.cat([maxima[n] for n in names]), reduce_op="max")
            maxima = dict(zip(names, flat.split([maxima[n].numel() for n in names])))
        for name, per_head in maxima.items():
            self.clip_(name, per_head)

    @torch.no_grad()
    def clip_(self, name: str, per_head: torch.Tensor) -> None:
        """Rescale the heads of module ``name`` whose max logit in ``per_head`` (heads,) passes the threshold."""
        target = self.targets[name]
        eta = (self.threshold / per_head.float().clamp_min(1e-30)).clamp(max=1.0)
        self.heads_clipped += (eta < 1).sum()
        for tensors, power in ((target.q, self.alpha), (target.k, 1 - self.alpha)):
            factor = eta.pow(power)
            for t in tensors:
                t.view(target.heads, -1).mul_(factor.to(t.dtype).view(-1, 1))

    def state_dict(self) -> dict[str, Any]:
        """Keys: ``heads_clipped`` (head-steps rescaled so far)."""
        return {"heads_clipped": int(self.heads_clipped)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        strict_keys(type(self).__name__, state_dict, {"heads_clipped"})
        self.heads_clipped.fill_(int(state_dict["heads_clipped"]))


class _Target:
    """One attention module's query and key rows (weight, then bias when present), ``heads`` heads."""

    def __init__(self, q: list[torch.Tensor], k: list[torch.Tensor], heads: int, weights: list[torch.Tensor]):
        self.q, self.k, self.heads, self.weights = q, k, heads, weights


def _target(module: nn.Module) -> _Target | None:
    if isinstance(module, nn.MultiheadAttention):
        w_q, w_k = qk_weights(module)
        e, heads = module.embed_dim, module.num_heads
        bias = module.in_proj_bias
        q = [w_q] + ([bias[:e]] if bias is not None else [])
        k = [w_k] + ([bias[e:2 * e]] if bias is not None else [])
        base = module.in_proj_weight if module.in_proj_weight is not None else module.q_proj_weight
        assert base is not None
        return _Target(q, k, heads, [base])
    heads = _head_count(module)
    if heads is None:
        return None
    children = dict(module.named_children())
    qkv, q_proj, k_proj = children.get("qkv"), children.get("q_proj"), children.get("k_proj")
    if isinstance(qkv, nn.Linear) and qkv.out_features % 3 == 0:
        d = qkv.out_features // 3
        q = [qkv.weight[:d]] + ([qkv.bias[:d]] if qkv.bias is not None else [])
        k = [qkv.weight[d:2 * d]] + ([qkv.bias[d:2 * d]] if qkv.bias is not None else [])
        return _Target(q, k, heads, [qkv.weight])
    if isinstance(q_proj, nn.Linear) and isinstance(k_proj, nn.Linear):
        if q_proj.out_features != k_proj.out_features:
            return None  # grouped keys: a key head serves several query heads
        q = [q_proj.weight] + ([q_proj.bias] if q_proj.bias is not None else [])
        k = [k_proj.weight] + ([k_proj.bias] if k_proj.bias is not None else [])
        return _Target(q, k, heads, [q_proj.weight, k_proj.weight])
    return None


def _head_count(module: nn.Module) -> int | None:
    heads = next((getattr(module, name) for name in HEAD_COUNTS if hasattr(module, name)), None)
    return heads if isinstance(heads, int) and not isinstance(heads, bool) and heads >= 1 else None


def _unclipped_note(unclipped: dict[str, nn.Module], clipped: list[str]) -> str:
    """The fit-start warning: the modules with q/k projections QKClip cannot clip, each with its cause."""
    causes = []
    for name, module in unclipped.items():
        children = dict(module.named_children())
        q_proj, k_proj = children.get("q_proj"), children.get("k_proj")
        if (_head_count(module) is not None and isinstance(q_proj, nn.Linear) and isinstance(k_proj, nn.Linear)
                and q_proj.out_features != k_proj.out_features):
            causes.append(f"{name!r}: grouped keys (a key head serves several query heads, so its W_k rows cannot be"
                          " rescaled per query head)")
        else:
            causes.append(f"{name!r}: no int head count (an attribute {' / '.join(HEAD_COUNTS)}); set one on it,"
                          " e.g. self.n_heads = n_heads")
    if clipped:
        return f"QKClip clips {clipped} but not " + "; ".join(causes) + "."
    if causes:
        return "QKClip does nothing: it can clip no attention module of the model; " + "; ".join(causes) + "."
    return ("QKClip does nothing: the model has no nn.MultiheadAttention and no module calling"
            " F.scaled_dot_product_attention with an nn.Linear child qkv (q, then k, then v rows) or children q_proj"
            " and k_proj, and an int head count (an attribute " + " / ".join(HEAD_COUNTS) + ").")

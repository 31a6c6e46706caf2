"""StablePrecision: the precision plugin of Lightning's Trainer (``lightning.pytorch``)."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision

from lit_mpstable.frontends.trainer import TrainerPrecision

__all__ = ["StablePrecision"]


class StablePrecision(TrainerPrecision, Precision):
    """Mixed precision that is stable by default: loss scaling done right, FP32 masters, FP32 islands, FP8 and live
    telemetry. ``Trainer(plugins=[StablePrecision(...)])``, instead of ``precision=``.

    Args:
        precision: Lightning's spelling (``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``, ``"16-true"``,
            ``"bf16-true"``) or ``"auto"``: BF16 where the device supports it, else FP16.
        scaler: ``"auto"`` (dynamic for FP16 modes, none otherwise), ``"dynamic"``, ``"static"``, ``"adaptive"``,
            ``None`` (no scaling) or a ``torch.amp.GradScaler``-like instance (a plain GradScaler is adopted with its
            state; one built for another device is moved to the run's).
        master_weights: for ``*-true`` modes, ``True``/``"fp32"``: an FP32 master copy of every trainable parameter,
            owned by the optimizers (so their state is FP32 too), the 16-bit weights refreshed from it after each
            applied step; ``False``: Lightning's plain ``*-true`` behaviour. Whatever the choice, hooks and clipping
            see (and act on) a gradient on every trainable parameter.
        skip_nonfinite: in every mode, BF16 and FP32 included, a step whose gradients hold inf/NaN is skipped and
            counted (GradScaler's fused check), so NaN never reaches the weights. ``False`` (no scaler only):
            Lightning's behaviour.
        fp8: ``None``, a recipe name (``"delayed"``, ``"current"``, ``"mxfp8"``) or an ``FP8Config``: eligible
            ``nn.Linear`` layers run their three GEMMs in FP8 on top of the base precision.
        fp32_modules: module types or qualified-name patterns (``fnmatch``) that always run in FP32.
        op_policy: ``"autocast"``: PyTorch's per-op lists; ``"auto"``: per op family (matmul, conv, attention,
            norm, softmax) the faster of FP32 and the 16-bit dtype, recorded in the first training forward and
            measured on the model's shapes at the start of the second (within the memory a step holds), FP32 only
            where it is also numerically no worse and lowers the step's time x memory; or a mapping such as
            ``{"attention": "fp32"}``.
            ``"*-mixed"`` precisions only; ``fp32_modules`` always win.
        device: ``"cpu"`` or ``"cuda"``; default: CUDA when available, else the CPU (the run's device wins).
        telemetry_every_n_steps: gradient telemetry into :attr:`stats` on step 0 and every N-th optimizer step
            (one host sync on those steps only, aligned with Lightning's ``log_every_n_steps``); ``None``: off.
        diagnose: trace every step for the first module producing inf/NaN (costly); by default only the step
            after an overflow is traced.
        optimizer_state: where Adam/AdamW moments live with FP32 masters or compact weights: ``"fp32"`` (the
            optimizer's own state and step), ``"bf16"`` (stochastically rounded) or ``"fp8"`` (per-block scales with
            dynamic range expansion); see :mod:`lit_mpstable.core.optim_state`. Other optimizers and FSDP2 are
            refused at setup.
        growth_every_n_steps: sample every linear layer's input statistics (amax trend, kurtosis, FP8 saturation
            and underflow) every N optimizer steps, an early warning of FP8 overflow (:meth:`runaway_layers`,
            ``mp/amax_growth``, ``mp/kurtosis_max``, ``stats["growth"]``); 10 costs about 1% of a step; ``None``
            (default): off.

    Raises:
        ValueError, TypeError: an argument is not one of the allowed values (the message names it).
    """

    _pl = pl

"""StablePrecision: the Lightning precision plugin. A translation table from Lightning hooks to core calls."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override


from lightning_utilities.core.apply_func import apply_to_collection

from lit_mpstable.fp8 import FP8Config, fp8_config
from lit_mpstable.islands import FP32Islands
from lit_mpstable.layout import PrecisionLayout
from lit_mpstable.master import MasterWeights
from lit_mpstable.policy import OpPolicy
from lit_mpstable.observer import GradObserver, shard_view
from lit_mpstable.scaling import AdaptiveLossScaler, DynamicLossScaler, StaticLossScaler
from lit_mpstable.schedulers import hold_on_skip
from lit_mpstable.strategies import check_strategy, lightning_module

__all__ = ["StablePrecision"]

PrecisionName = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "auto"]
ScalerName = Literal["auto", "dynamic", "static", "adaptive"]
OpPolicyName = Literal["autocast", "auto"]

_FORMAT_IDS = {"16-mixed": "fp16", "16-true": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16"}
_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, "16-true": torch.float16, "bf16-true": torch.bfloat16}


class StablePrecision(Precision):
    """Mixed precision that is stable by default: loss scaling done right, FP32 islands and live telemetry.

    Args:
        precision: Lightning's spelling (``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``, ``"16-true"``,
            ``"bf16-true"``) or ``"auto"``: BF16 where the device supports it, else FP16.
        scaler: ``"auto"`` (dynamic for FP16 modes, none otherwise), ``"dynamic"``, ``"static"``, ``None`` (no
            scaling) or a ``torch.amp.GradScaler``-like instance.
        master_weights: for ``*-true`` modes, keep an FP32 master copy of every trainable parameter, owned by the
            optimizers (so their state is FP32 too); the 16-bit weights are refreshed from it after each applied
            step. ``False``: Lightning's plain ``*-true`` behaviour.
        fp8: ``None``, a recipe name (``"delayed"``, ``"current"``, ``"mxfp8"``) or an ``FP8Config``: eligible
            ``nn.Linear`` layers run their three GEMMs in FP8 on top of the base precision.
        fp32_modules: module types or qualified-name patterns (``fnmatch``) that always run in FP32.
        op_policy: ``"autocast"``: PyTorch's per-op lists; ``"auto"``: per op family (matmul, conv, attention,
            norm, softmax) the faster of FP32 and the 16-bit dtype, measured on the model's shapes in the first
            forward, FP32 only where it is also numerically no worse; or a mapping such as ``{"attention": "fp32"}``
            (see ``lit_mpstable.policy.OpPolicy``). ``"*-mixed"`` precisions only; ``fp32_modules`` always win.
        device: ``"cpu"`` or ``"cuda"``; default: CUDA when available, else the CPU.
        telemetry_every_n_steps: gradient telemetry (norm, underflow per layer, FP8 saturation) into :attr:`stats`
            every N optimizer steps (one host sync on those steps only); ``None`` turns it off.
        diagnose: trace every step for the first module producing inf/NaN (costly); by default only the step
            after an overflow is traced.

    Raises:
        ValueError: an argument is not one of the allowed values.
    """

    def __init__(
        self,
        precision: PrecisionName = "bf16-mixed",
        *,
        scaler: ScalerName | torch.amp.GradScaler | None = "auto",
        master_weights: bool = True,
        fp8: str | FP8Config | None = None,
        fp32_modules: Iterable[type[nn.Module] | str] = (),
        op_policy: OpPolicyName | dict[str, str] = "autocast",
        device: str | None = None,
        telemetry_every_n_steps: int | None = 50,
        diagnose: bool = False,
    ) -> None:
        if precision not in get_args(PrecisionName):
            raise ValueError(f"StablePrecision(precision={precision!r}): allowed values are {list(get_args(PrecisionName))}.")
        if device is not None and device not in ("cpu", "cuda"):
            raise ValueError(f"StablePrecision(device={device!r}): allowed values are 'cpu', 'cuda' or None (auto).")
        if telemetry_every_n_steps is not None and (
            isinstance(telemetry_every_n_steps, bool) or not isinstance(telemetry_every_n_steps, int)
            or telemetry_every_n_steps < 1
        ):
            raise ValueError(
                f"StablePrecision(telemetry_every_n_steps={telemetry_every_n_steps!r}): must be an int >= 1 (optimizer"
                " steps between computations) or None (off); 50 keeps the cost under 1% of a step."
            )
        if not isinstance(master_weights, bool):
            raise ValueError(f"StablePrecision(master_weights={master_weights!r}): must be True or False.")
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if precision == "auto":
            bf16_ok = self.device == "cpu" or torch.cuda.is_bf16_supported()
            precision = "bf16-mixed" if bf16_ok else "16-mixed"
        self.precision = precision
        self.scaler = self._build_scaler(scaler)
        self.master_weights = master_weights
        self.fp8 = fp8_config(fp8)
        self.op_policy = op_policy
        self.policy = OpPolicy(op_policy, dtype=self.dtype)  # validates families and dtypes
        if not self.policy.is_default and self.precision not in ("16-mixed", "bf16-mixed"):
            raise ValueError(
                f"StablePrecision({self.precision!r}, op_policy={op_policy!r}): a per-op policy steers autocast, which"
                " only the '*-mixed' precisions use; use 'bf16-mixed' or '16-mixed', or op_policy='autocast'."
            )
        self.layout = PrecisionLayout(
            self.dtype, cast_parameters=self.true_16bit, fp32_modules=fp32_modules, fp8=self.fp8
        )
        self._pending_layout: dict[str, Any] | None = None
        self.last_step_skipped = False
        self.step_count = 0
        self.overflow_count = 0
        self.skipped_steps = 0
        """Steps not applied: overflows plus steps discarded by :meth:`skip_step`."""
        self._skip_requested = False
        self.master: MasterWeights | None = None
        self.stats: dict[str, Any] = {}
        """Latest telemetry: ``grad_norm``, ``grad_amax``, ``grad_underflow_frac``, ``grad_overflow_frac`` (in the
        compute format at the current scale), ``grad_zero_frac`` (exact zeros: what FP16 already flushed, against
        an FP32 run's), ``grad_underflow_per_module``, ``fp8_saturation_frac``,
        ``fp8_underflow_frac``, ``stats_step``; after an overflow ``blamed_params`` and ``blamed_modules``
        (qualified names relative to the LightningModule), refined by tracing the next step. Rank-local: each rank
        measures its own gradients (identical after DDP's all-reduce; this rank's shard under FSDP2) and names the
        parameters where it saw the inf; callbacks agree on names before acting."""
        self.last_loss: torch.Tensor | None = None
        """The latest loss before scaling, detached, on the device (reading it syncs)."""
        self.diagnose = diagnose
        formats = [_FORMAT_IDS.get(self.precision, "fp32")] + (["fp8_e5m2"] if self.fp8 is not None else [])
        self.observer = GradObserver(telemetry_every_n_steps, formats, diagnose=diagnose)
        self._warned: set[str] = set()  # warnings fire once per cause and plugin

    def _build_scaler(self, scaler: Any) -> torch.amp.GradScaler | None:
        fp16 = self.precision in ("16-mixed", "16-true")
        if isinstance(scaler, str) and scaler == "auto":
            scaler = "dynamic" if fp16 else None
        if scaler is None:
            return None
        if isinstance(scaler, str):
            if scaler not in get_args(ScalerName):
                raise ValueError(
                    f"StablePrecision(scaler={scaler!r}): allowed values are {list(get_args(ScalerName))}, None or a"
                    " GradScaler-like instance."
                )
            if not fp16:
                raise ValueError(
                    f"StablePrecision({self.precision!r}, scaler={scaler!r}): loss scaling is only meaningful for FP16"
                    " modes (BF16 and FP32 share FP32's exponent range); use scaler=None."
                )
            return {"dynamic": DynamicLossScaler, "static": StaticLossScaler, "adaptive": AdaptiveLossScaler}[scaler](
                self.device
            )
        if type(scaler) is torch.amp.GradScaler:
            # Adopted with its settings and state: our subclass also reports skipped steps (LR hold, counters,
            # attribution), which a plain GradScaler keeps to itself.
            adopted = DynamicLossScaler(
                scaler._device, scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(),
                scaler.get_growth_interval(), max_scale=None, enabled=scaler.is_enabled(),
            )
            if scaler.is_enabled():
                adopted.load_state_dict(scaler.state_dict())
            return adopted
        needed = ("scale", "unscale_", "step", "update", "get_scale", "state_dict", "load_state_dict")
        missing = [name for name in needed if not callable(getattr(scaler, name, None))]
        if missing:
            raise ValueError(
                f"StablePrecision(scaler={scaler!r}): a scaler instance needs GradScaler's methods; missing {missing}."
            )
        return scaler

    # ------------------------------------------------------------------------------------------- live state
    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without scaling). Reading it synchronises with the device."""
        if self.scaler is None or not self.scaler.is_enabled():
            return 1.0
        return float(self.scaler.get_scale())

    @property
    def dtype(self) -> torch.dtype:
        """The 16-bit compute dtype, or ``torch.float32`` for ``"32-true"``."""
        return _DTYPES.get(self.precision, torch.float32)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model computes in now: :attr:`dtype`, or FP32 while a global fallback is active."""
        return self.layout.compute_dtype

    @property
    def fallback_active(self) -> bool:
        """Whether any part of the run has been moved up the precision ladder by :meth:`fallback`."""
        return self.layout.fallback_active

    @property
    def islands(self) -> FP32Islands:
        """The FP32 islands in force (``islands.names``: qualified module names)."""
        return self.layout.islands

    @property
    def true_16bit(self) -> bool:
        """Whether parameters themselves live in 16 bits (``*-true`` modes)."""
        return self.precision in ("16-true", "bf16-true")

    def memory_report(self) -> dict[str, int]:
        """Bytes of parameters, gradients, FP32 masters and optimizer state (tensor sizes, no allocator overhead)."""
        if self.master is None:
            raise RuntimeError(
                f"StablePrecision({self.precision!r}).memory_report(): available once fit() has set up FP32 master"
                " weights (a '*-true' precision with master_weights=True)."
            )
        return self.master.memory_report()

    # ---------------------------------------------------------------------------------------- Lightning hooks
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        # The first hook every strategy's setup calls: refuse before converting.
        if warning := check_strategy(self, module):
            self._warn_once("strategy", warning)
        self.layout.attach(module, self.device)
        if self._pending_layout is not None:  # state loaded before the model arrived
            self.layout.load_state_dict(self._pending_layout)
            self._pending_layout = None
        self.observer.attach(module)
        return module

    # ------------------------------------------------------------------------------------------ fallback
    def fallback(self, modules: Iterable[str] | None = None, *, reason: str) -> str:
        """Climb one rung of the precision ladder: with ``modules=None`` the whole run (FP8 -> base precision ->
        FP32), else the named modules (qualified names: FP8 layers leave FP8, others become FP32 islands). Loss
        scaling and master weights keep working. Returns what was done, also logged once on rank zero.

        Takes effect from the next batch (Lightning casts a batch before its hooks run). Callbacks decide when
        (``PrecisionFallback``); :meth:`restore_precision` undoes it.
        """
        action = self.layout.fallback(modules)
        rank_zero_info(f"StablePrecision fallback at step {self.step_count}: {action} ({reason}).")
        return action

    def restore_precision(self) -> None:
        """Undo every :meth:`fallback`: back to the configured precision, FP8 layers and the user's own islands."""
        if self.fallback_active:
            self.layout.restore()
            rank_zero_info(f"StablePrecision at step {self.step_count}: low precision restored ({self.precision}).")

    @override
    def convert_input(self, data: Any) -> Any:
        if not self.true_16bit:
            return data
        return apply_to_collection(data, function=_cast_floating, dtype=torch.Tensor, dst_type=self.compute_dtype)

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return _default_dtype(self.dtype) if self.true_16bit else super().tensor_init_context()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        device_type = next((p.device.type for p in model.parameters()), self.device)
        if device_type in ("cpu", "cuda"):
            self.device = device_type
            self.layout.islands.device_type = self.layout.device_type = device_type
        if self.precision == "16-mixed" and self.device == "cpu":
            self._warn_once(
                "fp16-cpu",
                "StablePrecision('16-mixed') on the CPU: FP16 arithmetic is emulated there and runs ~100x slower than"
                " BF16. Running real FP16 autocast with loss scaling, as asked; use 'bf16-mixed' for speed."
            )
        module = lightning_module(model)
        if self.true_16bit and self.master_weights:
            self.master = MasterWeights(module, optimizers)
        for config in lr_schedulers:
            hold_on_skip(config.scheduler, lambda: self.step_count - self.skipped_steps)
        return model, optimizers, lr_schedulers

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        # TransformerEngine's FP8 needs its own autocast around the forward; a no-op for the native FP8 layers.
        with self.layout.forward_context():
            if self.compute_dtype == torch.float32:
                yield
            elif self.true_16bit:
                # Like Lightning's HalfPrecision: tensors created inside forward default to the 16-bit dtype.
                with _default_dtype(self.dtype):
                    yield
            else:
                # cache_enabled=False as Lightning's MixedPrecision: the weight-cast cache leaks across no_grad regions.
                # The op policy runs inside autocast: it overrides it for whole op families, never inside FP32 islands.
                autocast = torch.autocast(self.device, dtype=self.dtype, cache_enabled=False)
                with autocast, self.policy.context(self.device):
                    yield
                if self.stats.get("op_policy") != self.policy.choices:  # decided (first forward), forced or resumed
                    self._show_op_policy()

    @override
    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        self.last_loss = tensor.detach()
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if isinstance(optimizer, LBFGS):
            if self.scaler is not None or self.master is not None:
                raise ValueError(
                    "StablePrecision: LBFGS re-evaluates the loss inside step(), which loss scaling and master weights"
                    " cannot follow; use scaler=None with a '*-mixed' or '32-true' precision."
                )
            output = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
            self._record_step(skipped=False)
            return output
        closure_result = closure()
        # training_step returned None: Lightning ran no backward, so there is nothing to unscale or step.
        if closure_result is None and model.automatic_optimization:
            if self.master is not None:  # optimizer.zero_grad() reaches only the masters: drop the 16-bit grads
                self.master.zero_model_grads_(optimizer)
            return closure_result
        if self._skip_requested:
            return self._discard_step(optimizer)
        if self.master is not None:
            # A 16-bit trainable parameter held by the optimizer has no master yet: added with add_param_group or
            # unfrozen since setup (fine-tuning). A flag check per parameter (cheap); binding only when one appears.
            if any(p.requires_grad and p.dtype == self.dtype for g in optimizer.param_groups for p in g["params"]):
                if new := self.master.bind_new_(optimizer):
                    rank_zero_info(f"StablePrecision: FP32 masters for {len(new)} parameters added or unfrozen.")
            # The optimizer holds the FP32 masters: move the 16-bit grads there and free them.
            self.master.copy_grads_to_master_(optimizer)
            self.master.zero_model_grads_(optimizer)
        # Order matters: unscale before on_before_optimizer_step and clipping, so both see true gradient values and
        # the clip threshold means what the user wrote. Fused optimizers too: after unscale_ GradScaler hands them
        # found_inf and no grad_scale, so they skip without rescaling.
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
            # Distributed: an inf only some ranks see (written after DDP's all-reduce, or in a gradient shard) must
            # skip the step on every rank; one all-reduce of the found-inf flag (and the adaptive amax), on the device.
            if callable(sync := getattr(self.scaler, "sync_found_inf_", None)):
                sync(optimizer)
        self._observe()
        self._after_closure(model, optimizer)
        if self.scaler is not None:
            output = self.scaler.step(optimizer, **kwargs)
            self.scaler.update()
            skipped = bool(getattr(self.scaler, "last_step_skipped", False))
        else:
            output, skipped = optimizer.step(**kwargs), False
        if self.master is not None and not skipped:
            self.master.refresh_model_(optimizer)
        if skipped:
            self._blame()
        self._record_step(skipped=skipped)
        return output

    # ----------------------------------------------------------------------------------- telemetry, blame
    def _named_grads(self) -> list[tuple[str, torch.Tensor]]:
        # With masters the FP32 master holds the gradient; names stay the model's.
        assert self.layout.module is not None
        masters = {name: m for name, m, _ in self.master.named_pairs()} if self.master is not None else {}
        return [(name, shard_view(masters.get(name, p))) for name, p in self.layout.module.named_parameters()]

    def _observe(self) -> None:
        """On unscaled gradients, before hooks and clipping: telemetry when due, and the traced step's verdict."""
        module = self.layout.module
        if module is None:
            return
        scale = self.scaler.get_scale if self.scaler is not None else lambda: 1.0  # called on due steps only
        fp8 = self.fp8 is not None and bool(self.layout.fp8_layers)
        updates, warning = self.observer.observe(module, self._named_grads, self.step_count, scale, fp8=fp8)
        self.stats.update(updates)
        if warning is not None:
            self._warn_once(warning.split(" (step")[0], f"StablePrecision: {warning}")

    def _blame(self) -> None:
        """After an overflow: name the parameters with inf/NaN gradients, and trace the next step for the module."""
        if self.layout.module is not None:
            self.stats.update(self.observer.blame(self.layout.module, self._named_grads()))

    def _show_op_policy(self) -> None:
        self.stats["op_policy"] = dict(self.policy.choices)
        measured = self.policy.measurements
        self.stats["op_policy_ms"] = {f: {"autocast": m.autocast_ms, "fp32": m.fp32_ms} for f, m in measured.items()}
        if not self.policy.is_default:
            parts = [f"{f}={c}" + (f" ({measured[f].fp32_ms:.1f} ms fp32 vs {measured[f].autocast_ms:.1f} ms autocast)"
                                   if f in measured else "") for f, c in self.policy.choices.items()]
            rank_zero_info(f"StablePrecision op_policy={self.op_policy!r} on {self.device}: {', '.join(parts)}.")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)

    def skip_step(self) -> None:
        """Discard the gradients of the step in progress: no update, LR schedule held, scale unchanged.

        Callbacks call it from a hook inside the step (``on_before_backward``, ``on_after_backward``), e.g. on a
        non-finite or spiking loss, so a poisoned batch never reaches the weights. In distributed runs call it on
        every rank or none (reduce the trigger first, as ``ScaleCheckpoint`` does): a stepping rank waits in the
        found-inf all-reduce for the others.
        """
        self._skip_requested = True

    def _discard_step(self, optimizer: Optimizer) -> None:
        self._skip_requested = False
        optimizer.zero_grad(set_to_none=True)
        if self.master is not None:
            self.master.zero_model_grads_(optimizer)
        self._record_step(skipped=True, overflow=False)
        return None

    def _record_step(self, *, skipped: bool, overflow: bool | None = None) -> None:
        self.last_step_skipped = skipped
        self.step_count += 1
        self.skipped_steps += int(skipped)
        self.overflow_count += int(skipped if overflow is None else overflow)

    # ------------------------------------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly; plain Python scalars and dicts (``weights_only=True`` loads it).

        Keys: ``precision``, ``scaler`` (the scaler's own state dict, ``{}`` without scaling), ``step_count``,
        ``overflow_count``, ``skipped_steps``, ``last_step_skipped``, ``layout`` (fallback decisions and FP8 amax
        histories, see ``PrecisionLayout.state_dict``), ``masters`` (FP32 master tensors by parameter name, ``{}``
        without masters), ``op_policy`` (the dtype choice per op family, so a resumed ``"auto"`` run keeps it).
        """
        return {
            "masters": self.master.state_dict() if self.master is not None else {},
            "precision": self.precision,
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "step_count": self.step_count,
            "overflow_count": self.overflow_count,
            "last_step_skipped": self.last_step_skipped,
            "skipped_steps": self.skipped_steps,
            "layout": self.layout.state_dict(),
            "op_policy": self.policy.state_dict(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Strict: a missing or unknown key raises ``KeyError`` naming it.

        A checkpoint of another precision loads too (scaler state is used only where both sides scale).

        Raises:
            KeyError: keys differ from :meth:`state_dict`'s.
        """
        expected = set(self.state_dict())
        if set(state_dict) != expected:
            missing, unknown = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
            raise KeyError(
                f"StablePrecision.load_state_dict: missing keys {missing}, unknown keys {unknown}; was the checkpoint"
                " written by another version of lit_mpstable?"
            )
        scaling = self.scaler is not None and self.scaler.is_enabled()
        if scaling and state_dict["scaler"]:
            self.scaler.load_state_dict(state_dict["scaler"])
        elif scaling or state_dict["scaler"]:
            # A precision switch on resume (e.g. 16-mixed -> bf16-mixed) is legitimate: say what happens.
            rank_zero_info(
                f"StablePrecision: checkpoint written with precision={state_dict['precision']!r}"
                f" {'with' if state_dict['scaler'] else 'without'} loss scaling; this run ({self.precision!r})"
                f" {'starts a fresh scaler' if scaling else 'does not scale'}."
            )
        self.step_count = int(state_dict["step_count"])
        self.overflow_count = int(state_dict["overflow_count"])
        self.last_step_skipped = bool(state_dict["last_step_skipped"])
        self.skipped_steps = int(state_dict["skipped_steps"])
        if self.layout.module is None:
            self._pending_layout = state_dict["layout"]
        else:
            self.layout.load_state_dict(state_dict["layout"])
        if self.master is not None and state_dict["masters"]:
            self.master.load_state_dict(state_dict["masters"])
        self.policy.load_state_dict(state_dict["op_policy"])

    def _masters_from_weights(self, weights: dict[str, torch.Tensor] | None) -> None:
        assert self.master is not None
        if weights is None:
            self.master.rebuild_from_model_()
            source = "the 16-bit model weights"
        else:
            names = [name for name, _, _ in self.master.named_pairs()]
            self.master.load_state_dict({name: weights[name].float() for name in names})
            dtypes = sorted({str(weights[name].dtype) for name in names})
            source = f"the checkpoint's model weights ({', '.join(dtypes)})"
        rank_zero_info(f"StablePrecision: the checkpoint holds no FP32 masters; built them from {source}.")

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Runs before load_state_dict. A checkpoint of Lightning's own "16-mixed" keeps GradScaler state under
        # "MixedPrecision": carry it over.
        ours = checkpoint.get(type(self).__qualname__)
        if ours is None and "MixedPrecision" in checkpoint and self.scaler is not None:
            self.scaler.load_state_dict(checkpoint["MixedPrecision"])
            rank_zero_info("StablePrecision: loss-scaler state taken from a Lightning MixedPrecision checkpoint.")
        # Written without masters (plain FP32, Lightning's bf16-true, ours with master_weights=False): build them
        # from the checkpoint's weights at whatever precision they were saved, not from their 16-bit rounding.
        if self.master is not None and not (ours or {}).get("masters"):
            weights = checkpoint.get("state_dict", {})
            names = [name for name, _, _ in self.master.named_pairs()]
            self._masters_from_weights(weights if all(name in weights for name in names) else None)


def _cast_floating(tensor: torch.Tensor, dst_type: torch.dtype) -> torch.Tensor:
    return tensor.to(dst_type) if torch.is_floating_point(tensor) else tensor


@contextmanager
def _nothing() -> Generator[None, None, None]:
    yield


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)

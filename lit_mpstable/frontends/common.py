"""What every front end of the precision core shares: the constructor, the live state, the actions and the state
dict, all read from one :class:`~lit_mpstable.core.step.stepper.PrecisionStepper` (the one owner of each fact)."""

from __future__ import annotations

import inspect
from collections.abc import Generator, Iterable, Mapping, Sequence
from contextlib import _GeneratorContextManager, contextmanager
from typing import Any, Literal, cast

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from lit_mpstable.core.fingerprint import KEY as FINGERPRINT
from lit_mpstable.core.fingerprint import Fingerprint, OnMismatch
from lit_mpstable.core.guards.spike import SpikeGuard
from lit_mpstable.core.layout.fsdp import island_mp_policy as fsdp_island_mp_policy
from lit_mpstable.core.layout.fsdp import mp_policy as fsdp_mp_policy
from lit_mpstable.core.layout.policy import describe
from lit_mpstable.core.step.stepper import (
    MasterMode,
    OpPolicyName,
    PrecisionName,
    PrecisionStepper,
    ScalerName,
    check_module,
)
from lit_mpstable.core.weights.master import MasterWeights
from lit_mpstable.core.weights.optim_state import StateKind
from lit_mpstable.fp8 import FP8Config
from lit_mpstable.fp8.schedule import PrecisionSchedule, load_schedule_state, schedule_runner
from lit_mpstable.frontends.live_state import Findings, FromStepper

# The type of Lightning's ``Precision.precision`` (both Trainer packages and Fabric): ours is one of its values.
LightningPrecision = Literal["transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true",
                             "bf16-mixed", "32-true", "64-true"]

ARGS_DOC = """
    Args:
        precision: Lightning's spelling (``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``, ``"16-true"``,
            ``"bf16-true"``) or ``"auto"``: BF16 where the device supports it, else FP16.
        scaler: ``"auto"`` (dynamic for FP16 modes, none otherwise), ``"dynamic"``, ``"static"``, ``"adaptive"``,
            ``None`` (no scaling) or a ``torch.amp.GradScaler``-like instance (a plain GradScaler is adopted with its
            state; one built for another device is moved to the run's).
        master_weights: how ``*-true`` modes keep their 16-bit weights (``*-mixed`` modes keep FP32 weights and
            ignore it):

            - ``True``/``"fp32"`` (default): an FP32 master copy of every trainable parameter, owned by the
              optimizers (so their state is FP32 too), the 16-bit weights refreshed from it after each applied step;
            - ``"kahan"``: compact weights, no FP32 copy between steps: a 16-bit compensation per weight holds what
              the weight could not, the optimizer's per-element state is kept 16-bit (rounded stochastically);
            - ``"stochastic"``: compact weights rounded up or down at random, without bias, so small updates survive
              on average; state as with ``"kahan"``;
            - ``False``: Lightning's plain ``*-true`` behaviour.

            Whatever the choice, hooks and clipping see (and act on) a gradient on every trainable parameter. Under
            FSDP2 the FP32 sharded parameters are the masters.
        skip_nonfinite: in every mode, BF16 and FP32 included, a step whose gradients hold inf/NaN is skipped and
            counted (GradScaler's fused check), so NaN never reaches the weights. ``False`` (no scaler only):
            Lightning's behaviour.
        fp8: ``None``, a recipe name or an ``FP8Config``: eligible ``nn.Linear`` layers run their three GEMMs in a
            low format on top of the base precision. Recipes: ``"delayed"`` (FP8, per-tensor scales from an amax
            history), ``"current"`` (FP8, per-tensor scales from each tensor's own amax), ``"mxfp8"`` (FP8 with one
            power-of-two scale per 32 elements), ``"blockwise"`` (E4M3 with 1x128 blocks for inputs and gradients,
            128x128 for weights), ``"mxfp4"`` (E2M1 with one power-of-two scale per 32 elements) and ``"nvfp4"``
            (E2M1 with 16-element blocks, E4M3 block scales and an FP32 tensor scale, stochastically rounded
            gradients and a random Hadamard transform). With ``keep_high_precision=HighPrecisionBudget(by="probe")``
            the first training batch is measured once and the costliest layers stay in the base precision
            (:meth:`choose_high_precision_`, :attr:`fp8_high_precision_layers`).
        fp32_modules: module types or qualified-name patterns (``fnmatch``) that always run in FP32.
        op_policy: ``"autocast"``: PyTorch's per-op lists; ``"auto"``: per op family (matmul, conv, attention,
            norm, softmax) the faster of FP32 and the 16-bit dtype, recorded in the first training forward and
            measured on the model's shapes at the start of the second (within the memory a step holds), FP32 only
            where it is also numerically no worse and lowers the step's time x memory; or a mapping such as
            ``{"attention": "fp32"}``. ``"*-mixed"`` precisions only; ``fp32_modules`` always win.
        device: ``"cpu"`` or ``"cuda"``; default: CUDA when available, else the CPU (the run's device wins).
        telemetry_every_n_steps: gradient telemetry into :attr:`stats` on step 0 and every N-th optimizer step
            (one host sync on those steps only, aligned with Lightning's ``log_every_n_steps``); ``None``: off.
        diagnose: trace every step for the first module producing inf/NaN (costly); by default only the step
            after an overflow is traced.
        spike_guard: ``None`` or a :class:`~lit_mpstable.SpikeGuard`: a step whose loss or gradient norm spikes is
            skipped like an overflow (no scale backoff), decided on the device with no extra host read.
        optimizer_state: where Adam/AdamW moments live with FP32 masters or compact weights: ``"fp32"`` (the
            optimizer's own state and step), ``"bf16"`` (stochastically rounded) or ``"fp8"`` (per-block scales with
            dynamic range expansion); see :mod:`lit_mpstable.core.weights.optim_state`. Other optimizers and FSDP2 are
            refused at setup.
        growth_every_n_steps: sample every linear layer's input statistics (amax trend, kurtosis, FP8 saturation
            and underflow) every N optimizer steps, an early warning of FP8 overflow (:meth:`runaway_layers`,
            ``mp/amax_growth``, ``mp/kurtosis_max``, ``stats["growth"]``); 10 costs about 1% of a step; ``None``
            (default): off.
        schedule: ``None``, a :class:`~lit_mpstable.fp8.PrecisionSchedule` or a list of them (or
            ``FP8Config(schedule=...)``, not both): the formats of chosen FP8 layers and GEMM roles change in process
            at a step, at the start of the LR decay (``at="lr_decay"``, found from the LR scheduler) or on a
            trigger, the same step on every rank; e.g. ``PrecisionSchedule(at="lr_decay", fprop="bf16")``. Checked
            at the first training step (patterns that match no FP8 layer, unreachable milestones: ValueError);
            the switches are in :attr:`precision_schedule` ``.events`` and the plugin's checkpoint state.
        on_fingerprint_mismatch: what a load does when the checkpoint fails its numeric fingerprint (checksums of
            the weights, masters and optimizer state, the precision manifest, the pinned micro-batch's loss; see
            ``docs/fingerprints.md``): ``"raise"`` (default) refuses it naming what differs, ``"warn"`` warns and
            loads it, ``"previous"`` resumes from the newest earlier checkpoint of its directory that passes.

    Raises:
        ValueError, TypeError: an argument is not one of the allowed values (the message names it).
    """
"""``StablePrecision``'s arguments, written once: the Trainer, Fabric and ``pytorch_lightning`` classes append it to
their docstrings (a front end adds only what its loop does differently)."""


class StableFrontEnd:
    """Mixin of the Trainer and Fabric plugins: ``StablePrecision``'s constructor and everything users and
    callbacks read or call on it. The arguments are documented once, in :data:`ARGS_DOC`.

    Raises:
        ValueError, TypeError: an argument is not one of the allowed values.
    """

    can_skip = True
    """Callbacks may discard a step in progress (:meth:`skip_step`)."""

    def __init__(
        self,
        precision: PrecisionName = "bf16-mixed",
        *,
        scaler: ScalerName | torch.amp.GradScaler | None = "auto",
        master_weights: bool | MasterMode = True,
        skip_nonfinite: bool = True,
        fp8: str | FP8Config | None = None,
        fp32_modules: Iterable[type[nn.Module] | str] = (),
        op_policy: OpPolicyName | dict[str, str] = "autocast",
        device: str | None = None,
        telemetry_every_n_steps: int | None = 50,
        diagnose: bool = False,
        spike_guard: SpikeGuard | None = None,
        optimizer_state: StateKind = "fp32",
        growth_every_n_steps: int | None = None,
        schedule: PrecisionSchedule | Sequence[PrecisionSchedule] | None = None,
        on_fingerprint_mismatch: OnMismatch = "raise",
    ) -> None:
        # A list for the repr; anything else (None, 5, one name) goes to the stepper's check as it is.
        # Every argument goes to the stepper by name: a new one is one line in the signature above.
        args = {name: value for name, value in locals().items() if name in _ARGS}
        listed = isinstance(fp32_modules, Iterable) and not isinstance(fp32_modules, (str, bytes, dict))
        args["fp32_modules"] = list(fp32_modules) if listed else fp32_modules
        self._args = args
        self.fingerprint = Fingerprint(on_fingerprint_mismatch, owner=type(self).__name__)  # core/fingerprint.py
        own = ("schedule", "on_fingerprint_mismatch")  # the front end's own; the rest is the stepper's
        self.stepper = PrecisionStepper(**{k: v for k, v in args.items() if k not in own}, owner=type(self).__name__)
        self.precision_schedule = schedule_runner(schedule, self.stepper.fp8)
        self.stepper.layout.after_fp8_swap = self.precision_schedule.sync_
        # Lightning reads the attribute; the stepper resolved "auto", so it is one of Lightning's own spellings.
        self.precision: LightningPrecision = cast(LightningPrecision, self.stepper.precision)
        self.master_weights = master_weights
        self.findings = Findings()
        self._warned: set[str] = set()  # warnings fire once per cause and plugin
        self._state_loaded = False  # load_state_dict was called (a resume that brought the plugin's state)
        self._schedule_preloaded: Any = None  # the schedule state switched in before the fingerprint's manifest check
        self._notes_shown = 0
        self._runaway: tuple[int, list[str]] = (-1, [])  # (growth samples when computed, the layers)
        self._show_notes()

    def __repr__(self) -> str:
        defaults = StableFrontEnd.__init__.__kwdefaults__ or {}
        shown = [repr(self.stepper.precision)] + [
            f"{name}={self._args[name]!r}" for name in _ARGS[1:]
            if self._args[name] != defaults.get(name) and not (name == "fp32_modules" and not self._args[name])
        ]
        return f"{type(self).__name__}({', '.join(shown)})"

    # ------------------------------------------------------------------------------------------- live state
    # Read from the stepper, the one owner of each fact; the docstring is the stepper's. Rarer state is on
    # ``plugin.stepper`` itself (``stepper.keeper``, ``stepper.counters``, ...).
    scaler = FromStepper('The loss scaler (None without scaling).')
    loss_scale = FromStepper()
    dtype = FromStepper()
    compute_dtype = FromStepper()
    true_16bit = FromStepper()
    fallback_active = FromStepper(
        'Whether any part of the run has been moved up the precision ladder by :meth:`fallback`.')
    islands = FromStepper('The FP32 islands in force (``islands.names``: qualified module names).')
    last_step_skipped = FromStepper()
    step_count = FromStepper()
    overflow_count = FromStepper()
    skipped_steps = FromStepper()
    stats = FromStepper(
        "Latest telemetry: ``grad_norm``, ``grad_amax``, ``grad_underflow_frac``, ``grad_overflow_frac`` (in the"
        " compute format at the current scale: a forecast), ``grad_zero_frac``, ``grad_underflow_per_module``,"
        " ``fp8_saturation_frac``, ``fp8_underflow_frac``, ``stats_step`` (the step they were measured on); after an"
        " overflow ``blamed_params``, ``blamed_modules`` and ``nonfinite_input`` (the batch held inf/NaN); from"
        " ``PrecisionProbe``, ``probe``; from ``HighPrecisionBudget(by='probe')``, ``fp8_high_precision`` (layers kept,"
        " their share, the measured errors, the step). Rank-local.")
    last_loss = FromStepper('The latest loss before scaling, detached, on the device (reading it syncs).')
    checks_nonfinite = FromStepper()
    input_nonfinite = FromStepper()
    input_ends = FromStepper()
    layout = FromStepper()
    policy = FromStepper()
    observer = FromStepper()
    fp8 = FromStepper()
    diagnose = FromStepper()
    device = FromStepper()
    can_fallback = FromStepper()
    spike_guard = FromStepper(
        'The :class:`~lit_mpstable.SpikeGuard` that skips loss and gradient-norm spikes (None: off).')
    last_step_spiked = FromStepper()

    @property
    def master(self) -> MasterWeights | None:
        """The FP32 master weights (``*-true`` modes with ``master_weights``), once training has set them up: a view of
        the stepper's weight keeper (``stepper.keeper``)."""
        keeper = self.stepper.keeper
        return keeper if isinstance(keeper, MasterWeights) else None

    def undo_backoff_(self) -> bool:
        """The stepper's :meth:`~lit_mpstable.core.step.stepper.PrecisionStepper.undo_backoff_`: undo the last
        iteration's scale backoff (``FaultTriage`` calls it for a step whose overflow the scale did not cause)."""
        return self.stepper.undo_backoff_()

    def runaway_layers(self) -> list[str]:
        """The linear layers whose activations are heading out of FP8's range (the growth monitor's
        :meth:`~lit_mpstable.core.guards.growth.GrowthMonitor.runaway`: amax trend, kurtosis, saturation), and
        ``stats["growth"]`` refreshed; ``[]`` without ``growth_every_n_steps``. Computed once per new sample (one
        host read then; later calls return the same list). Rank-local."""
        growth = self.stepper.growth
        if growth is None:
            return []
        if self._runaway[0] != growth.samples:
            self.stepper.stats["growth"] = stats = growth.stats()
            self._runaway = (growth.samples, growth.runaway(stats=stats))
        return list(self._runaway[1])

    def growth_metrics(self) -> dict[str, torch.Tensor]:
        """``mp/amax_growth`` and ``mp/kurtosis_max`` as device tensors (empty before a sample, or without
        ``growth_every_n_steps``); no host read."""
        return {} if self.stepper.growth is None else self.stepper.growth.metrics()

    # ---- FSDP2 (begin)
    @property
    def mp_policy(self) -> Any:
        """The ``torch.distributed.fsdp.MixedPrecisionPolicy`` for this precision, for every ``fully_shard`` call in
        ``configure_model``: in ``*-true`` modes FP32 sharded parameters (FSDP2's own master weights) computed in
        the 16-bit dtype and reduced in FP32; in ``*-mixed`` modes FP32 parameters under autocast. Setup refuses
        units sharded otherwise. See :func:`lit_mpstable.core.layout.fsdp.mp_policy`."""
        return fsdp_mp_policy(self.precision, master_weights=self.stepper.master_mode is not None)

    @property
    def island_mp_policy(self) -> Any:
        """The policy of an FP32 island (``fp32_modules``) sharded as its own ``fully_shard`` unit: FP32 compute, and
        in ``*-true`` modes its output cast back to 16 bits. Under FSDP2 ``*-true`` every island needs one."""
        return fsdp_island_mp_policy(self.precision)
    # ---- FSDP2 (end)

    # ------------------------------------------------------------------------------------------------ hooks
    def forward_context(self) -> _GeneratorContextManager[None]:
        """Autocast and the op policy; the policy's choices are reported once, when they are made. A policy that never
        steers off autocast has no choice to report: the stepper's context itself, nothing around it."""
        stepper = self.stepper
        if not stepper.policy.steers:
            return stepper.forward_context()
        return self._reported_forward_context()

    @contextmanager
    def _reported_forward_context(self) -> Generator[None, None, None]:
        choices = self.stepper.stats.get("op_policy")
        with self.stepper.forward_context():
            yield
        if self.stepper.stats.get("op_policy") != choices and not self.policy.is_default:
            policy, measured = self.policy, self.policy.measurements
            parts = [describe(f, c, measured[f], policy.margin, policy.step_cost) if f in measured else f"{f}={c}"
                     for f, c in policy.choices.items()]
            choices = ", ".join(parts)
            rank_zero_info(f"StablePrecision op_policy={self.stepper.op_policy!r} on {self.device}: {choices}.")

    def _warn_fp16_cpu(self) -> None:
        """Once the run's device is known: FP16 on the CPU is real but slow, said once."""
        if self.precision == "16-mixed" and self.device == "cpu":
            self._warn_once(
                "fp16-cpu",
                "StablePrecision('16-mixed') on the CPU: FP16 arithmetic is emulated there, several times slower than"
                " BF16 (measured on a CPU: 12.6x on nanoGPT's shakespeare_char model, 745 ms vs 59 ms a step)."
                " Running real FP16 autocast with loss scaling, as asked; use 'bf16-mixed' for speed.",
            )

    def _check_closure_step(self, optimizer: Optimizer) -> None:
        """An optimizer step with a closure (LBFGS) re-evaluates the loss inside ``step()``: refused with loss scaling
        or master weights, else run unchecked (said once). Count it with ``stepper.count_unchecked_step()``."""
        if self.scaler is not None or self.master is not None:
            raise ValueError(
                f"{self!r}: {type(optimizer).__name__}.step(closure) re-evaluates the loss inside step(), which loss"
                " scaling and master weights cannot follow; use scaler=None with a '*-mixed' or '32-true' precision."
            )
        self._warn_once("closure", "StablePrecision: an optimizer step with a closure (LBFGS) re-evaluates the loss"
                        " inside step(), so its gradients are not checked for inf/NaN (skip_nonfinite does not apply"
                        " to it).")

    # ---------------------------------------------------------------------------------------------- actions
    def skip_step(self) -> None:
        """Discard the gradients of the step in progress: no update, LR schedule held, scale unchanged.

        Call it from a hook inside the step (``on_before_backward``, ``on_after_backward``), e.g. on a non-finite or
        spiking loss, so a poisoned batch never reaches the weights. In distributed runs call it on every rank or
        none (reduce the trigger first): a stepping rank waits in the found-inf all-reduce for the others.
        """
        self.stepper.skip_step()

    def fallback(self, modules: Iterable[str] | None = None, *, reason: str, step: int | None = None) -> str:
        """Climb one rung of the precision ladder: with ``modules=None`` the whole run (FP8 -> base precision ->
        FP32), else the named modules (FP8 layers leave FP8, others become FP32 islands). Loss scaling and master
        weights keep working. Returns what was done, also warned once on rank zero (the one log line of a fallback),
        at ``step`` (the loop's step it answers; default: :attr:`step_count`, which counts a triage's replays too).
        Takes effect from the next forward; :meth:`restore_precision` undoes it."""
        if not isinstance(reason, str) or not reason:
            raise (ValueError if isinstance(reason, str) else TypeError)(
                f"{type(self).__name__}.fallback(reason={reason!r:.80}): must be a non-empty string (why: it ends"
                " the fallback's log line).")
        action = self.stepper.fallback(modules)
        # The one log line of a fallback, whoever decided it (a callback names itself in ``reason``).
        at = self.step_count if step is None else step
        rank_zero_warn(f"StablePrecision fallback at step {at}: {action} ({reason}).")
        return action

    def restore_precision(self) -> None:
        """Undo every :meth:`fallback`: back to the configured precision, FP8 layers and the user's own islands."""
        if self.stepper.restore_precision():
            rank_zero_info(f"StablePrecision at step {self.step_count}: low precision restored ({self.precision}).")

    def validate(self, model: nn.Module) -> None:
        """Check ``fp32_modules`` and the FP8 filter against ``model`` before training, without changing it (the
        plugin checks again when the trainer hands it the model).

        Raises:
            ValueError: a pattern matches no module (the message lists the model's names), or ``fp8`` is set and no
                layer of ``model`` is eligible.
            TypeError: ``model`` is not an ``nn.Module``.
        """
        self.stepper.layout.validate(check_module(f"{type(self).__name__}.validate", model, "model"))

    def choose_high_precision_(self, loss_fn: Any, batch: Any) -> list[str]:
        """``FP8Config(keep_high_precision=HighPrecisionBudget(by="probe"))``: measure each FP8 layer's weight-gradient
        error on ``batch`` and move the costliest back to the base precision within the budget, once (logged, in
        ``stats["fp8_high_precision"]`` and the state dict). The Trainer plugin calls it at the first training batch
        with ``training_step``; with Fabric or manual optimization call it yourself at the first step, before its
        forward: ``plugin.choose_high_precision_(lambda module, batch: loss(module(batch)), batch)`` (the module
        given, not a wrapper). Returns the layers kept; see ``PrecisionStepper.choose_high_precision_``."""
        first = self.stepper.fp8_budget.layers is None
        chosen = self.stepper.choose_high_precision_(loss_fn, batch)
        if first:
            recipe = self.stepper.fp8.recipe_name if self.stepper.fp8 is not None else "low-format"
            rank_zero_info(f"{type(self).__name__}: {self.stepper.fp8_budget.describe(self.layout.module, recipe)}")
        return chosen

    @property
    def fp8_high_precision_layers(self) -> list[str] | None:
        """The layers ``HighPrecisionBudget(by="probe")`` moved back to the base precision (None until chosen)."""
        return self.stepper.fp8_high_precision_layers

    def manifest_as_of(self, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        """This run's precision manifest with the FP8 layers in the recipes its precision schedule had when
        ``checkpoint`` (a Trainer checkpoint dict of this run) was saved: an earlier file of the run differs from the
        live layers only by the switches made since, which its load puts back from the file's schedule state. A file
        without schedule state, or of another schedule, is compared with the live layers (and the difference named)."""
        state = checkpoint.get(type(self).__qualname__)
        saved = state.get("precision_schedule") if isinstance(state, Mapping) else None
        if not self.precision_schedule or saved is None:
            return self.stepper.manifest()
        with self.precision_schedule.rewound(saved):
            return self.stepper.manifest()

    def restore_state(self, state: dict[str, Any]) -> None:
        """Load numeric state from :meth:`state_dict` (a rollback): scale, masters, layout, FP8 histories; the
        event counters (steps, overflows, skips; the scaler's too) keep their live values, and so does the precision
        schedule (its milestones follow the step count, which a rollback keeps): the FP8 layers take the state's
        recipes while their FP8 state is loaded, then the milestones in force again."""
        own = (FINGERPRINT, "precision_schedule")
        with self.precision_schedule.rewound(state.get("precision_schedule")):
            self.stepper.load_state_dict({k: v for k, v in state.items() if k not in own}, keep_counters=True)

    def want_grad_norm_(self) -> None:
        """Keep each step's gradient norm, measured by the gradient check's one pass, for :meth:`take_grad_norm` (the
        indicators' SpikeScore asks at fit start instead of reading the gradients again)."""
        self.stepper.want_grad_norm_()

    def take_grad_norm(self, optimizer: Optimizer) -> torch.Tensor | None:
        """This step's L2 norm of ``optimizer``'s true gradients, before clipping (device tensor), once; else None."""
        return self.stepper.take_grad_norm(optimizer)

    def state_tensors(self) -> list[torch.Tensor]:
        """Resident tensors of the precision itself (compensation buffers) that neither the model nor the optimizers
        hold; give them to ``lit_mpstable.core.weights.memory.MemoryProbe.start(..., extra=...)``."""
        return self.stepper.state_tensors()

    def memory_report(self) -> dict[str, int]:
        """Bytes of training state by kind: ``weights``, ``masters`` (FP32 masters), ``gradients``,
        ``optimizer_state`` (quantized states by their inner tensors), ``compensation`` (``master_weights="kahan"``),
        ``total``; tensor sizes, each storage once, no allocator overhead. The stability report adds the
        activations' peak, measured. Available once training has set up model and optimizers."""
        return self.stepper.memory_report()

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly; see ``PrecisionStepper.state_dict`` for the keys (and
        ``precision_schedule`` with a schedule)."""
        state = self.stepper.state_dict()
        if self.precision_schedule:
            state["precision_schedule"] = self.precision_schedule.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Strict: a missing or unknown key raises ``KeyError`` naming it, a corrupted field (NaN/inf scale, negative
        counter, ``"False"`` for a bool, NaN masters or compensation, ``None``, junk) ``ValueError``/``TypeError``
        naming it, before anything is loaded. A checkpoint of another precision loads too (scaler state is used only
        where both sides scale). A checkpoint's numeric fingerprint is checked (``on_fingerprint_mismatch``). A
        checkpoint written under another precision schedule raises ``ValueError`` naming both; one past a milestone
        resumes with the switched formats."""
        fingerprint, state_dict = self.fingerprint.split(state_dict, call=f"{type(self).__name__}.load_state_dict")
        preloaded, self._schedule_preloaded = self._schedule_preloaded, None
        if preloaded is not None and isinstance(state_dict, dict) and state_dict.get("precision_schedule") == preloaded:
            state_dict = {k: v for k, v in state_dict.items() if k != "precision_schedule"}  # loaded already
        else:  # before the fingerprint's manifest check: the layers in the formats the checkpoint trained in
            state_dict = load_schedule_state(self.precision_schedule, state_dict, self.layout.module)
        self._check_fingerprint(fingerprint, state_dict, loaded=False)
        for note in self.stepper.load_state_dict(state_dict):
            rank_zero_info(f"StablePrecision: {note}")
        self._state_loaded = True
        self._check_fingerprint(fingerprint, state_dict, loaded=True)

    def _check_fingerprint(self, fingerprint: dict[str, Any] | None, state: dict[str, Any], *, loaded: bool) -> None:
        """A front end's check of a loaded fingerprint (:mod:`lit_mpstable.core.fingerprint`), before (``loaded``
        False) and after the plugin's state is loaded."""

    def _preload_schedule_(self, plugin_state: Any) -> None:
        """A checkpoint's schedule state, loaded before its fingerprint's manifest is compared: a run resumed past a
        milestone compares its layers in the switched formats the checkpoint trained in."""
        if self.precision_schedule and isinstance(plugin_state, dict) and "precision_schedule" in plugin_state:
            load_schedule_state(self.precision_schedule, plugin_state, self.layout.module)
            self._schedule_preloaded = plugin_state["precision_schedule"]

    def _schedule_step_(self, schedulers: Sequence[Any], max_steps: int | None, steps_per_epoch: int | None) -> None:
        """At the start of each training step: the precision schedule's switches due now (bound at the first)."""
        runner, module = self.precision_schedule, self.layout.module
        if not runner or module is None:
            return
        if not runner.bound:
            runner.bind(module, schedulers, max_steps=max_steps, steps_per_epoch=steps_per_epoch, step=self.step_count)
        for line in runner.on_step_start(self.step_count, self.stepper.stats):
            rank_zero_info(f"StablePrecision: {line}")

    # --------------------------------------------------------------------------------------------- messages
    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)

    def _show_notes(self) -> None:
        """The stepper's notes (adopted scalers, blame verdicts), as rank-zero warnings: the first of each key."""
        notes = self.stepper.warnings
        if notes.added == self._notes_shown:  # nothing new: a clean step reads one integer
            return
        for key, message in notes.keyed(self._notes_shown):
            self._warn_once(f"stepper:{key}", f"StablePrecision: {message}")
        self._notes_shown = notes.added


_ARGS = tuple(inspect.signature(StableFrontEnd.__init__).parameters)[1:]  # the constructor's arguments, in order

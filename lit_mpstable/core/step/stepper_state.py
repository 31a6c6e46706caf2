"""What :meth:`PrecisionStepper.load_state_dict <lit_mpstable.core.step.stepper.PrecisionStepper.load_state_dict>` does
with a checkpoint's weights and scaler: the weight keeper's entries (or what waits for it), the scaler's, and the
carry-over of a checkpoint written with another precision or master mode. Helpers on a keeper and a scaler; the
stepper's own ``state_dict``/``load_state_dict`` are in :mod:`~lit_mpstable.core.step.stepper`."""

from __future__ import annotations

from typing import Any, get_args

import torch
from torch import nn

from lit_mpstable.base.validate import int_arg
from lit_mpstable.core.formats import FormatName
from lit_mpstable.core.guards.spike_state import OPTIONAL as GUARD_OPTIONAL
from lit_mpstable.core.loaded_state import (
    Field,
    check_fields,
    check_mapping,
    count,
    count_list,
    finite,
    finite_list,
    finite_tensors,
    flag,
    name_list,
    optional,
    short,
    tensor_tree,
    text,
)
from lit_mpstable.core.weights.moment_keeper import KEY as MOMENTS
from lit_mpstable.core.weights.moment_keeper import AdamMoments, split_moments
from lit_mpstable.core.weights.optim_state import moment_state
from lit_mpstable.core.weights.weights import WeightKeeper

_KEYS = ("masters", "compact")


def weights_state(keeper: WeightKeeper, pending: dict[str, Any]) -> dict[str, Any]:
    """``masters`` and ``compact``: the keeper's state under its key, state loaded before it was bound under the other
    (``{}`` without)."""
    return {key: keeper.state_dict() if keeper.state_key == key else dict(pending.get(key, {})) for key in _KEYS}


def load_scaler_state_(scaler: torch.amp.GradScaler | None, state: dict[str, Any], *, precision: str,
                       keep_counters: bool) -> list[str]:
    """Restore the scaler from ``state`` (a stepper state dict); its event counters keep their live values with
    ``keep_counters``. Returns a note when the checkpoint was written with or without loss scaling unlike this run."""
    scaling = scaler is not None and scaler.is_enabled()
    if scaling and state["scaler"]:
        assert scaler is not None
        saved, live = dict(state["scaler"]), scaler.state_dict()
        notes = []
        if set(saved) != set(live):
            # Another kind of scaler (scaler="adaptive" on resume after "dynamic", or back): where the scale stood,
            # its growth count and its counters carry; this run's scaler keeps its own settings and the rest.
            saved = {**live, **{key: saved[key] for key in _CARRIED if key in saved and key in live}}
            notes.append(f"checkpoint written with another loss scaler than this run's {type(scaler).__name__}: its"
                         f" scale ({float(saved['scale']):.6g}) and counters carried, the scaler's own state starts"
                         " fresh.")
        scaler.load_state_dict(keep_live_counters(saved, live) if keep_counters else saved)
        return notes
    elif scaling or state["scaler"]:
        # A precision switch on resume (e.g. 16-mixed -> bf16-mixed) is legitimate: say what happens.
        return [
            f"checkpoint written with precision={state['precision']!r}"
            f" {'with' if state['scaler'] else 'without'} loss scaling; this run ({precision!r})"
            f" {'starts a fresh scaler' if scaling else 'does not scale'}."
        ]
    return []


def _route(keeper: WeightKeeper, masters: dict[str, Any], compact: dict[str, Any], *, mode: str | None,
           fsdp2: bool, bound: bool) -> str | None:
    """Where the checkpoint's ``masters``/``compact`` go: ``"load"`` into ``keeper`` (same mode, ``bound`` to the
    run's optimizers), ``"pending"`` until it is bound (``validate``/``test``/``predict``, which Lightning restores the
    plugin for too, bind none: they run on the checkpoint's 16-bit weights), ``"carry"`` their FP32 values (and BF16/FP8
    moments) into this run's weight mode, or None."""
    if masters and keeper.state_key == "masters":
        return "load" if bound else "pending"
    if masters and mode == "fp32" and not fsdp2:
        return "pending"
    if compact and keeper.state_key == "compact" and compact.get("mode") == keeper.mode:
        return "load" if bound else "pending"
    if compact and keeper.state_key != "compact" and compact.get("mode") == mode:
        return "pending"
    if masters or compact.get("compensation") or compact.get(MOMENTS):
        return "carry"
    return None


def _moments_of(keeper: WeightKeeper) -> AdamMoments | None:
    # Only FP32 masters and compact weights keep BF16/FP8 moments (not part of the WeightKeeper protocol).
    return getattr(keeper, "moments", None)


def check_weights_state(call: str, keeper: WeightKeeper, masters: dict[str, Any], compact: dict[str, Any], *,
                        mode: str | None, fsdp2: bool, module: nn.Module | None, bound: bool) -> None:
    """Refuse, before anything is loaded, BF16/FP8 moments that :func:`load_weights_state_` would refuse: of
    parameters other than this run's (missing, renamed, of another shape), or, into the same weight mode, of another
    ``optimizer_state``."""
    route = _route(keeper, masters, compact, mode=mode, fsdp2=fsdp2, bound=bound)
    key = "masters" if masters else "compact"
    saved = (masters or compact).get(MOMENTS)
    moments = _moments_of(keeper)
    if route == "load" and (saved is None) != (moments is None):  # saved with BF16/FP8 moments, resumed without
        split_moments(type(keeper).__name__, {MOMENTS: saved} if saved is not None else {}, moments)  # (or the reverse)
    if saved is not None and moments is not None and route in ("load", "carry") and module is not None:
        moments.check_state(saved, call=call, name=f"{key}[{MOMENTS!r}]", same_kind=route == "load")


def load_weights_state_(
    keeper: WeightKeeper, masters: dict[str, Any], compact: dict[str, Any], *, mode: str | None, fsdp2: bool,
    pending: dict[str, Any], module: nn.Module | None, precision: str, bound: bool,
) -> tuple[str, str] | None:
    """Load the checkpoint's ``masters``/``compact`` into ``keeper`` (same mode), keep them in ``pending`` until it is
    bound, or carry their FP32 values into this run's weight mode (BF16/FP8 moments into its moments, converted to
    its ``optimizer_state``). Returns a warning for the user, if any, as ``(key, message)``: the key names the
    saved state and this run's mode."""
    route = _route(keeper, masters, compact, mode=mode, fsdp2=fsdp2, bound=bound)
    if route == "load":
        keeper.load_state_dict(masters or compact)
    elif route == "pending":
        pending["masters" if masters else "compact"] = masters or compact
    elif route == "carry":  # another master mode or precision: carry the FP32 values
        masters, compact = dict(masters), dict(compact)
        saved_moments = masters.pop(MOMENTS, None) or compact.pop(MOMENTS, None)
        saved = "FP32 masters" if masters else "Kahan compensation" if compact.get("compensation") else "moments"
        target = f"{precision!r}, master_weights={mode or False!r}"
        if module is None:
            return (f"weights-not-carried:{saved}:{target}",
                    f"the checkpoint's {saved} were not carried into this run ({target}): load it after setup.")
        notes = [keeper.load_state_dict({"masters": masters, "compact": compact}, carry_into=module, saved=saved,
                                        target=target)]
        moments = _moments_of(keeper)
        if saved_moments is not None and moments is not None:
            notes.append(moments.carry_(saved_moments))
        elif saved_moments is not None:
            notes.append(
                f"the checkpoint's {saved_moments['kind']!r} Adam moments were not carried into this run ({target},"
                " optimizer_state='fp32'): the optimizer's own moments restart at 0; resume with"
                f" optimizer_state={saved_moments['kind']!r} and FP32 or compact master weights to keep them."
            )
        message = "; ".join(note for note in notes if note)
        return (f"weights-carried:{saved}:{target}", message) if message else None
    return None


# ------------------------------------------------------------------------------------------------ the plugin's state
# 1/scale must stay a finite FP32 number (unscaling multiplies by it).
_MIN_SCALE = 1.0 / torch.finfo(torch.float32).max
_MAX_SCALE = float(torch.finfo(torch.float32).max)

_SCALER: dict[str, Field] = {
    "scale": finite(_MIN_SCALE, _MAX_SCALE),
    "growth_factor": finite(1.0, low_open=True),
    "backoff_factor": finite(0.0, 1.0, low_open=True, high_open=True),
    "growth_interval": lambda c, n, v: int_arg(c, n, v, low=1),
    "_growth_tracker": count,
    "hysteresis": lambda c, n, v: int_arg(c, n, v, low=1),
    "_hysteresis_tracker": count,
    "min_scale": optional(finite(_MIN_SCALE, _MAX_SCALE)),
    "max_scale": optional(finite(_MIN_SCALE, _MAX_SCALE)),
    "overflow_count": count,
    "min_scale_hits": count,
    "step_count": count,
    "target_format": text(*get_args(FormatName)),
    "headroom": finite(1.0),
    "amax_history_len": lambda c, n, v: int_arg(c, n, v, low=1),
    "underflow_boost": finite(0.0, low_open=True),
    "overflowed_since_note": flag,
    "raise_blocked_until": count,
    "_amax_history": finite_list(0.0),
    "_extra_headroom": finite(0.0, low_open=True),
    "_last_overflow_scale": finite(0.0),
    "_overflow_streak": count,
}


def _fp8_state(call: str, name: str, value: Any) -> None:
    check_mapping(call, value, name=name)
    tensor_tree(call, name, value)


_LAYOUT: dict[str, Field] = {
    "fp32": flag, "fp8_off": flag, "fp8_removed": name_list, "fp32_modules": name_list, "fp8": _fp8_state,
}
_COMPACT: dict[str, Field] = {
    "mode": text("kahan", "stochastic"), "seed": lambda c, n, v: int_arg(c, n, v, low=0, high=2**63 - 1),
    "steps": lambda c, n, v: int_arg(c, n, v, low=0, high=2**63 - 1), "compensation": finite_tensors,
}


def check_plugin_state(call: str, state: Any, expected: set[str], precisions: tuple[str, ...]) -> None:
    """Check a plugin state dict (``PrecisionStepper.state_dict``'s keys) before anything of it is loaded.

    Raises:
        TypeError, ValueError, KeyError: a field is missing, unknown, of the wrong type or out of range (named).
    """
    check_mapping(call, state, expected)
    if not isinstance(state["precision"], str) or state["precision"] not in precisions:
        raise (ValueError if isinstance(state["precision"], str) else TypeError)(
            f"{call}(precision={short(state['precision'])}): must be one of {list(precisions)}.")
    check_fields(call, state, {"step_count": count, "overflow_count": count, "skipped_steps": count,
                               "last_step_skipped": flag})
    if state["skipped_steps"] > state["step_count"]:
        raise ValueError(f"{call}(skipped_steps={state['skipped_steps']}, step_count={state['step_count']}): more"
                         " steps skipped than taken; the checkpoint is corrupted.")
    scaler = check_mapping(call, state["scaler"], name="scaler")
    if scaler and "scale" not in scaler:
        raise KeyError(f"{call}: scaler state {sorted(map(str, scaler))} has no 'scale'; every loss scaler saves one.")
    check_fields(call, scaler, _SCALER, prefix="scaler")
    low, high = scaler.get("min_scale"), scaler.get("max_scale")
    if low is not None and high is not None and low > high:
        raise ValueError(f"{call}(scaler['min_scale']={low!r}, scaler['max_scale']={high!r}): min_scale must not"
                         " exceed max_scale.")
    if "_amax_history" in scaler and "amax_history_len" in scaler and len(scaler["_amax_history"]) != scaler[
            "amax_history_len"]:
        raise ValueError(f"{call}(scaler['_amax_history'] of length {len(scaler['_amax_history'])}): must hold"
                         f" amax_history_len={scaler['amax_history_len']} values.")
    layout = check_mapping(call, state["layout"], name="layout")
    check_fields(call, layout, _LAYOUT, prefix="layout")
    # "optimizer_state": BF16/FP8 Adam moments a keeper holds (their names are checked against its parameters).
    masters = check_mapping(call, state["masters"], name="masters")
    finite_tensors(call, "masters", {k: v for k, v in masters.items() if k != "optimizer_state"})
    check_fields(call, masters, {"optimizer_state": moment_state}, prefix="masters")
    compact = check_mapping(call, state["compact"], name="compact")
    if compact:
        check_mapping(call, compact, set(_COMPACT) | ({"optimizer_state"} & set(compact)), name="compact")
        check_fields(call, compact, {**_COMPACT, "optimizer_state": moment_state}, prefix="compact")
    check_mapping(call, state["op_policy"], name="op_policy")
    count_list(call, "schedules", state["schedules"])
    guard = check_mapping(call, state["spike_guard"], name="spike_guard")  # its values: SpikeGuard.load_state_dict
    if guard:  # {} without a guard; otherwise SpikeGuard.state_dict's keys, whether or not this run has a guard
        check_mapping(call, guard, {"window", "loss", "loss_count", "grad_norm", "grad_norm_count", "spikes_skipped"}
                      | (GUARD_OPTIONAL & set(guard)), name="spike_guard")
    recast = check_mapping(call, state.get("recast", {}), name="recast")  # present while a fallback recasts
    if recast:
        check_mapping(call, recast, {"weights", "optimizer_state"}, name="recast")
        finite_tensors(call, "recast['weights']", recast["weights"])
        moments = check_mapping(call, recast["optimizer_state"], name="recast['optimizer_state']")
        for name, entry in moments.items():  # {parameter name: {state key: tensor}}
            finite_tensors(call, f"recast['optimizer_state'][{name!r}]", entry)
    growth = check_mapping(call, state["growth"], name="growth")  # its values: GrowthMonitor.check_state
    if growth:  # {} without a growth monitor; otherwise GrowthMonitor.state_dict's keys, with a monitor or not
        check_mapping(call, growth, {"steps", "samples", "sampled", "layers"}, name="growth")


# The scaler's own event counters (what it saw: its steps, overflows, hits of the scale floor). The scaler owns them
# and counts them itself (it runs without a stepper too); they are history like the run's, so a rollback that restores
# the scaler's numeric state keeps their live values (see RunCounters.keep_live_ in the stepper).
SCALER_COUNTERS = ("overflow_count", "step_count", "min_scale_hits")


_CARRIED = ("scale", "_growth_tracker", *SCALER_COUNTERS)
"""What a scaler's state carries into a scaler of another kind."""


def keep_live_counters(saved: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """A scaler's saved state with its event counters at their ``live`` values (a rollback keeps history)."""
    return {**saved, **{k: live[k] for k in SCALER_COUNTERS if k in live and k in saved}}

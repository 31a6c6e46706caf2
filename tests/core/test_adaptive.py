"""AdaptiveLossScaler: hand-computed scale trajectories, overflow handling, bounds and state."""

from __future__ import annotations

import io
import math
import pickle

import pytest
import torch
import torch._dynamo  # noqa: F401  (the first Optimizer() imports it, ~1-2 s here: pay it at collection, not in a test)
from helpers import HostReads, TinyMLP, regression_data
from torch import nn

from lit_mpstable.core.scaling.adaptive_scaler import AdaptiveLossScaler
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler

INF, NAN = float("inf"), float("nan")


class OneParam:
    """A parameter whose gradient is exactly the given values: loss = sum(p * values), so dloss/dp = values."""

    def __init__(self, scaler: AdaptiveLossScaler, lr: float = 0.0, optimizer: type = torch.optim.SGD, **kw) -> None:
        self.p = nn.Parameter(torch.zeros(4))
        self.opt = optimizer([self.p], lr=lr, **kw)
        self.scaler = scaler

    def step(self, *values: float) -> float:
        self.opt.zero_grad()
        self.scaler.scale((self.p * torch.tensor(values + (0.0,) * (4 - len(values)))).sum()).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        return self.scaler.get_scale()


def test_scale_is_largest_power_of_two_under_format_max_with_headroom():
    # amax * s * headroom <= 65504 with headroom 2: amax = 2**-10 gives s = 2**24 (2**-10 * 2**24 * 2 = 32768).
    run = OneParam(AdaptiveLossScaler("cpu", max_scale=None))
    assert run.step(2.0**-10, -(2.0**-12)) == 2.0**24
    assert run.step(-(2.0**-3)) == 2.0**17  # a larger amax enters the window: the scale drops at once
    assert not run.scaler.last_step_skipped


@pytest.mark.parametrize(
    ("amax", "kwargs", "expected"),
    [
        (3 * 2.0**-10, {}, 2.0**23),  # 3 * 2**-10 * 2**23 * 2 = 49152 <= 65504 < 98304
        (2.0**-10, {"headroom": 1.0}, 2.0**25),  # 65504 * 2**10 = 2**25.99...
        (65504 * 2.0**-20, {"headroom": 1.0}, 2.0**20),  # exactly at the max: allowed
        (1.0, {"target_format": "fp8_e5m2", "headroom": 1.0}, 2.0**15),  # 57344 = 1.75 * 2**15
        (1.0, {"headroom": 4.0}, 2.0**13),  # 65504 / 4 = 16376 -> 2**13
        (2.0**-40, {"max_scale": 2.0**24}, 2.0**24),  # the default bound
        (2.0**-40, {}, 2.0**54),
        (2.0**10, {}, 2.0**4),  # 2**10 * 2**4 * 2 = 32768
        (2.0**20, {}, 2.0**-6),  # below 1 is allowed: huge gradients need it
    ],
)
def test_scale_for_known_amax(amax, kwargs, expected):
    run = OneParam(AdaptiveLossScaler("cpu", **{"max_scale": None, **kwargs}))
    assert run.step(amax) == expected


def test_window_max_delays_growth_until_large_amax_leaves():
    run = OneParam(AdaptiveLossScaler("cpu", max_scale=None, amax_history_len=3))
    assert run.step(2.0**-3) == 2.0**17
    assert [run.step(2.0**-10) for _ in range(3)] == [2.0**17, 2.0**17, 2.0**24]


def test_zero_gradients_keep_the_scale():
    run = OneParam(AdaptiveLossScaler("cpu", init_scale=2.0**10))
    assert run.step(0.0) == 2.0**10
    assert run.scaler.last_amax.item() == 0.0
    assert run.step(2.0**-10) == 2.0**24
    assert run.step(0.0) == 2.0**24  # a zero step does not erase the history


def test_overflow_skips_and_backs_off_faster_when_consecutive():
    run = OneParam(AdaptiveLossScaler("cpu", max_scale=None), lr=1.0)
    assert run.step(2.0**-3) == 2.0**17
    before = run.p.detach().clone()
    # Backoff: x0.5, then x0.25, then x1/16 (the k-th consecutive overflow squares the factor).
    assert run.step(INF) == 2.0**16 and run.scaler.last_step_skipped
    assert run.step(INF, 1.0) == 2.0**14
    assert run.step(NAN) == 2.0**10
    assert torch.equal(run.p.detach(), before)  # skipped steps leave the weights alone
    assert run.scaler.overflow_count == 3
    assert torch.isnan(run.scaler.last_amax)
    # Clean again with amax 1: the rule says 2**14, the scale that last overflowed. Amax 1 would have fit there
    # (1 * 2**14 <= 65504), so the overflow is unexplained: extra headroom 2 keeps the scale at 2**13.
    assert run.step(1.0) == 2.0**13 and not run.scaler.last_step_skipped
    assert run.step(2.0**-10) == 2.0**13
    assert run.scaler.state_dict()["_extra_headroom"] == 2.0


def test_overflow_explained_by_larger_gradients_adds_no_headroom():
    run = OneParam(AdaptiveLossScaler("cpu", max_scale=None))
    assert run.step(2.0**-10) == 2.0**24
    assert run.step(INF) == 2.0**23
    # The next gradients (2**-3 * 2**24 > 65504) would have overflowed too: the amax rule alone sets the scale.
    assert run.step(2.0**-3) == 2.0**17
    assert run.scaler.state_dict()["_extra_headroom"] == 1.0


def test_extra_headroom_is_relative_to_amax_and_halves_after_growth_interval():
    run = OneParam(AdaptiveLossScaler("cpu", max_scale=None, amax_history_len=1, growth_interval=3))
    assert run.step(2.0**-10) == 2.0**24
    assert run.step(INF) == 2.0**23  # unexplained below: extra headroom 2
    assert run.step(2.0**-10) == 2.0**23
    assert run.step(2.0**-14) == 2.0**27  # gradients shrink: the scale still follows them, one binade lower
    assert run.step(2.0**-14) == 2.0**28  # 3 clean steps: extra headroom back to 1
    assert run.step(2.0**-14) == 2.0**28


def test_bounds_and_min_scale_hits():
    run = OneParam(AdaptiveLossScaler("cpu", min_scale=2.0**4, max_scale=2.0**20))
    assert run.step(2.0**-10) == 2.0**20
    assert run.step(2.0**20) == 2.0**4  # would be 2**-6
    with pytest.warns(RuntimeWarning, match="min_scale"):
        for _ in range(2):
            assert run.step(INF) == 2.0**4
    assert run.scaler.min_scale_hits == 2


def test_scale_never_reaches_zero_without_min_scale():
    run = OneParam(AdaptiveLossScaler("cpu"))
    for _ in range(40):
        run.step(NAN)
    assert run.scaler.get_scale() == torch.finfo(torch.float32).tiny


def test_unscaled_gradients_match_gradscaler():
    grads = {}
    for cls in (AdaptiveLossScaler, torch.amp.GradScaler):
        torch.manual_seed(0)
        model, (x, y) = TinyMLP(), regression_data(16)
        scaler = cls("cpu")
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler.unscale_(opt)
        grads[cls] = [p.grad.clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(*grads.values()))


def test_fused_optimizer_measures_the_same_amax():
    scales = []
    for fused in (False, True):
        run = OneParam(AdaptiveLossScaler("cpu", max_scale=None), lr=0.1, optimizer=torch.optim.AdamW, fused=fused)
        scales.append([run.step(2.0**-10), run.step(INF), run.step(2.0**-6)])
    assert scales[0] == scales[1] == [2.0**24, 2.0**23, 2.0**20]


def test_trains_exactly_like_unscaled_fp32():
    # Power-of-two scales are exact in float32: with no overflow, scaled training equals plain training bit for bit.
    runs = []
    for scaler in (AdaptiveLossScaler("cpu"), None):
        torch.manual_seed(0)
        model, (x, y) = TinyMLP(), regression_data(64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(10):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        runs.append((model, scaler))
    (model, scaler), (plain, _) = runs
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    assert scaler.overflow_count == 0
    # The window holds this step's (now unscaled) gradients, so their amax fits with the headroom of 2.
    amax = max(p.grad.abs().max().item() for p in model.parameters())
    scale = scaler.get_scale()
    assert math.log2(scale).is_integer() and amax * scale * 2 <= 65504 < amax * scale * 2 * 2**4


def test_update_and_unscale_do_not_sync():
    run = OneParam(AdaptiveLossScaler("cpu"))
    run.step(2.0**-10)
    run.opt.zero_grad()
    run.scaler.scale((run.p * torch.tensor([1.0, 0, 0, 0])).sum()).backward()
    with HostReads() as unscale:
        run.scaler.unscale_(run.opt)
    with HostReads() as step:
        run.scaler.step(run.opt)
    with HostReads() as update:
        run.scaler.update()
    assert unscale.ops == [] and update.ops == []
    assert step.ops == ["_local_scalar_dense"]  # the skip decision: GradScaler's one sync


# ------------------------------------------------------------------------------------------------ state
def _scripted(scaler: AdaptiveLossScaler, values: list[float]) -> OneParam:
    run = OneParam(scaler)
    for v in values:
        run.step(v)
    return run


SCRIPT = [2.0**-10, INF, 2.0**-10, 2.0**-8, 0.0, INF]


def test_state_dict_round_trip_resumes_exactly():
    kwargs = dict(headroom=4.0, amax_history_len=4, growth_interval=5, min_scale=1.0)
    rest = [2.0**-12, INF, 2.0**-9, 2.0**-9]
    reference = _scripted(AdaptiveLossScaler("cpu", **kwargs), SCRIPT + rest)
    first = _scripted(AdaptiveLossScaler("cpu", **kwargs), SCRIPT)
    buffer = io.BytesIO()
    torch.save(first.scaler.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    resumed = AdaptiveLossScaler("cpu", **kwargs)
    resumed.load_state_dict(state)
    run = _scripted(resumed, rest)
    assert run.scaler.state_dict() == reference.scaler.state_dict()
    # By hand (limit 65504 / 4 = 16376): 2**-10 -> 2**23; overflow -> 2**22; 2**-10 fits at 2**23, so extra headroom
    # 2 -> 2**22; 2**-8 -> 2**21 / 2 = 2**20; no gradient keeps it; overflow -> 2**19.
    expected = {"scale": 2.0**19, "_amax_history": [2.0**-8, 2.0**-10, 2.0**-10, 0.0], "_extra_headroom": 2.0}
    expected.update(_last_overflow_scale=2.0**20, _overflow_streak=1, overflow_count=2, _growth_tracker=0)
    assert {key: state[key] for key in expected} == expected


def test_state_dict_keys_are_strict():
    state = _scripted(AdaptiveLossScaler("cpu"), SCRIPT).scaler.state_dict()
    for broken in ({k: v for k, v in state.items() if k != "_amax_history"}, {**state, "extra": 1}):
        with pytest.raises(KeyError, match="_amax_history|extra"):
            AdaptiveLossScaler("cpu").load_state_dict(broken)
    with pytest.raises(RuntimeError, match="disabled"):
        AdaptiveLossScaler("cpu").load_state_dict({})
    with pytest.raises(KeyError, match="missing keys"):  # a DynamicLossScaler checkpoint lacks the amax state
        AdaptiveLossScaler("cpu").load_state_dict(DynamicLossScaler("cpu").state_dict())


def test_loads_a_gradscaler_state_dict():
    legacy = torch.amp.GradScaler("cpu", init_scale=2.0**8).state_dict()
    scaler = AdaptiveLossScaler("cpu")
    scaler.load_state_dict(legacy)
    assert scaler.get_scale() == 2.0**8 and scaler.state_dict()["_amax_history"] == [0.0] * 16


def test_pickle_keeps_device_state():
    run = _scripted(AdaptiveLossScaler("cpu", amax_history_len=2), SCRIPT)
    clone = pickle.loads(pickle.dumps(run.scaler))
    assert clone.state_dict() == run.scaler.state_dict()


def test_disabled_is_a_no_op():
    scaler = AdaptiveLossScaler("cpu", enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss and scaler.state_dict() == {} and not scaler.is_enabled()


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"headroom": 0.5}, "headroom"),
        ({"headroom": float("inf")}, "headroom"),
        ({"target_format": "fp7"}, "target_format"),
        ({"amax_history_len": 0}, "amax_history_len"),
        ({"backoff_factor": 1.5}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"min_scale": 2.0**20, "max_scale": 2.0**10}, "min_scale"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=rf"AdaptiveLossScaler\(.*{argument}="):
        AdaptiveLossScaler("cpu", **kwargs)


def test_undo_backoff_forgets_the_overflow_it_undoes():
    # A transient fault's overflow, undone by FaultTriage: the scale comes back and the next clean step is not taken
    # for an unexplained overflow (no extra headroom), as if the fault had never come. The overflow stays counted.
    run = OneParam(AdaptiveLossScaler("cpu", max_scale=None))
    assert run.step(1.0) == 2.0**14
    assert run.step(INF) == 2.0**13
    assert run.scaler.undo_backoff_() and run.scaler.get_scale() == 2.0**14
    assert run.step(1.0) == 2.0**14
    assert run.scaler.state_dict()["_extra_headroom"] == 1.0 and run.scaler.overflow_count == 1


# --------------------------------------------------------------------------------- loaded state is checked (adaptive)
@pytest.mark.parametrize("key, value", [("overflowed_since_note", "False"), ("underflow_boost", 0.5),
                                        ("_amax_history", [NAN] * 16), ("_amax_history", [1.0]),
                                        ("_extra_headroom", 0.0), ("_overflow_streak", -1), ("headroom", INF),
                                        ("target_format", "bf16x"), ("raise_blocked_until", -5),
                                        ("_last_overflow_scale", NAN)])
def test_adaptive_fields_are_refused_by_name(key: str, value) -> None:
    scaler = AdaptiveLossScaler("cpu")
    with pytest.raises((ValueError, TypeError), match=key):
        scaler.load_state_dict({**scaler.state_dict(), key: value})


# ----------------------------------------------------------------------------------- with compact 16-bit weights
def _stepper_scales(master_weights, *, with_norm: bool = False, steps: int = 4) -> tuple[list[float], list[float]]:
    """16-true, scaler='adaptive': the scale after each step, and each step's largest unscaled gradient magnitude."""
    from lit_mpstable.core.step.stepper import PrecisionStepper

    torch.manual_seed(0)
    model = TinyMLP().half().float()  # FP16 values: the masters start where the compact weights do
    stepper = PrecisionStepper("16-true", master_weights=master_weights, scaler="adaptive", device="cpu",
                               telemetry_every_n_steps=None)
    stepper.setup_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper.setup_optimizers(model, [optimizer])
    if with_norm:
        stepper.want_grad_norm_()  # the check becomes the norm's pass (SpikeScore's indicators)
    x, y = regression_data(16)
    scales, amaxes = [], []
    for _ in range(steps):
        optimizer.zero_grad()
        with stepper.forward_context():
            loss = nn.functional.mse_loss(model(stepper.convert_input(x)).float(), y) * 2.0**-4
        stepper.scale_loss(loss).backward()
        amaxes.append(max(p.grad.float().abs().max().item() for p in model.parameters()) / stepper.loss_scale)
        with HostReads() as reads:
            stepper.step(optimizer)
        assert reads.ops == ["_local_scalar_dense"]  # the skip decision's one sync, nothing for the amax
        scales.append(stepper.loss_scale)
    return scales, amaxes


@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
@pytest.mark.parametrize("with_norm", [False, True])
def test_compact_weights_scale_follows_the_amax_as_fp32_masters_do(mode: str, with_norm: bool) -> None:
    # Compact weights check the gradients without unscaling them (the step unscales in FP32); the adaptive scaler
    # still measures their amax there, so the scale follows the gradients as with FP32 masters.
    scales, amaxes = _stepper_scales(mode, with_norm=with_norm)
    expected = [2.0 ** math.floor(math.log2(65504 / (2 * amax))) for amax in amaxes]  # amax * s * headroom <= max
    assert scales[0] == expected[0] > 2.0**17, (scales, expected)  # far above the initial 2**15: the amax is small
    assert scales == _stepper_scales(True, with_norm=with_norm)[0]

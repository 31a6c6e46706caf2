"""GrowthMonitor: statistics against hand-computed and scipy values, no host read while training, and a runaway layer
named at least 50 steps before its activations leave E4M3's range, with no alarm on clean runs."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import HostReads, TinyMLP, regression_data
from torch import nn

from lit_mpstable.app.growth_demo import SwiGLU
from lit_mpstable.core.guards.growth import GrowthMonitor
from lit_mpstable.core.guards.growth_stats import layer_stats

INF = float("inf")


def test_layer_stats_hand_computed() -> None:
    log2_amax, kurtosis, saturation, underflow = layer_stats(torch.tensor([1.0, -1.0, 1.0, -1.0])).tolist()
    assert (log2_amax, kurtosis, saturation, underflow) == (0.0, 1.0, 0.0, 0.0)  # z = +-1: E[z**4] = 1
    # E4M3: max 448, smallest subnormal 2**-9; a value flushes at or below half of it (ties to even).
    _, _, saturation, _ = layer_stats(torch.tensor([448.0, 449.0, INF, 1.0])).tolist()
    assert saturation == 0.5
    _, _, _, underflow = layer_stats(torch.tensor([2.0**-10, 2.0**-9, 0.0, 1.0])).tolist()
    assert underflow == pytest.approx(1 / 3)
    assert layer_stats(torch.tensor([1.0, 0.5]), scale=449.0)[2].item() == 0.5
    assert layer_stats(torch.full((8,), 3.0))[1].item() == 0.0  # constant: kurtosis defined as 0
    assert math.isnan(layer_stats(torch.tensor([1.0, float("nan")]))[1].item())


@pytest.mark.parametrize("case", ["gaussian", "student-t", "one spike"])
def test_kurtosis_matches_scipy(case: str) -> None:
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g, dtype=torch.float64)
    if case == "student-t":
        x = x / ((torch.randn(4096, 5, generator=g, dtype=torch.float64) ** 2).mean(dim=1)).sqrt()
    elif case == "one spike":
        x = torch.zeros(4096, dtype=torch.float64)
        x[17] = 1e30  # its square overflows FP32
    expected = stats.kurtosis(x.numpy(), fisher=False)
    got = layer_stats(x.float().view(64, 64))[1].item()
    assert got == pytest.approx(expected, rel=1e-3)


def _reference(x: torch.Tensor, scale: float, fmt_max: float = 448.0, flush: float = 2.0**-10) -> list[float]:
    """layer_stats' documented statistics computed plainly in float64 (flush: half E4M3's smallest subnormal)."""
    v = x.detach().double().reshape(-1)
    n, a = v.numel(), v.abs()
    amax = a.max().item() if n else 0.0
    if math.isnan(amax):
        kurtosis = math.nan
    elif math.isinf(amax):
        kurtosis = 0.0  # documented: an inf makes kurtosis 0 (the run is flagged by its amax)
    else:
        c = v - v.mean()
        var = (c**2).mean().item()
        kurtosis = (c**4).mean().item() / var**2 if var > 1e-12 * amax**2 else 0.0
    scaled = a * scale
    nonzero = int((a != 0).sum())
    return [math.log2(max(amax, 2.0**-126)) if not math.isnan(amax) else math.nan, kurtosis,
            int((scaled > fmt_max).sum()) / max(n, 1), int(((scaled <= flush) & (a != 0)).sum()) / max(nonzero, 1)]


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(16, 16, generator=g) * 10.0 ** torch.empty(16, 16).uniform_(-12, 3, generator=g)
    heavy = torch.randn(16, 16, generator=g) / torch.randn(16, 16, generator=g).abs().clamp_min(0.05)
    with_nan, with_inf, both = torch.randn(16, 16, generator=g), torch.randn(4, 8, generator=g), torch.randn(24)
    with_nan[3, 4], with_inf[1, 1], both[[2, 5]] = math.nan, math.inf, torch.tensor([-math.inf, math.nan])
    sparse = torch.randn(16, 16, generator=g) * (torch.rand(16, 16, generator=g) > 0.7)
    spike = torch.zeros(256)
    spike[17] = 1e30  # its square overflows FP32
    return {"gaussian": torch.randn(16, 16, generator=g) + 5.0, "wide": wide, "heavy": heavy, "nan": with_nan,
            "inf": with_inf, "inf+nan": both, "zeros": torch.zeros(8, 8), "constant": torch.full((7, 9), -3.25),
            "sparse": sparse, "spike": spike, "bf16": (torch.randn(16, 16, generator=g) * 300).bfloat16(),
            "one": torch.tensor([2.5]), "empty": torch.empty(0, 16)}


def _close(got: list[float], expected: list[float]) -> bool:
    return all((math.isnan(g) and math.isnan(e)) or g == pytest.approx(e, rel=1e-4, abs=1e-6)
               for g, e in zip(got, expected))


@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_statistics_match_a_float64_reference(scale: float) -> None:
    """Each case alone (layer_stats) and all of them sampled in one step by the monitor (per-layer reductions in the
    hooks, the rows finished together and written into the shared ring buffer) equal the float64 reference."""
    cases = _cases()
    for name, x in cases.items():
        assert _close(layer_stats(x, scale=scale).tolist(), _reference(x, scale)), name

    class Fan(nn.Module):  # one linear layer per case, each fed its case as input
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleDict({k.replace("+", "_"): nn.Linear(x.shape[-1], 2) for k, x in cases.items()})

        def forward(self) -> None:
            for layer, x in zip(self.layers.values(), cases.values()):
                layer.to(x.dtype)(x if x.dim() > 1 else x.view(-1, layer.in_features))

    fan = Fan()
    monitor = GrowthMonitor(every_n_steps=1, window=3, scale=scale).attach(fan)
    for _ in range(5):  # 5 samples into rings of 3: finished at the third (a full queue) and when read
        fan()
        monitor.step()
    stats = monitor.stats()
    for (name, x), key in zip(cases.items(), fan.layers):
        row = stats[f"layers.{key}"]
        log2_amax = math.log2(row["amax"]) if row["amax"] > 0 else row["amax"]
        assert row["samples"] == 3 and row["step"] == 4, name
        assert _close([log2_amax, row["kurtosis"], row["saturation"], row["underflow"]], _reference(x, scale)), name


def test_reading_every_step_or_once_gives_the_same_samples() -> None:
    """Queued samples are finished when read or when a layer's queue is full: the reading pattern changes nothing."""
    models, monitors = [], []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(TinyMLP())
        monitors.append(GrowthMonitor(every_n_steps=2, window=3).attach(models[-1]))
    x, y = regression_data(16)
    for step in range(15):
        for model, monitor in zip(models, monitors):
            model(x * (1 + step)).square().mean().backward()
            monitor.step()
        monitors[0].metrics()  # read (finished) every step; the other is finished by its full queues
    assert monitors[0].state_dict()["layers"]["fc1"]["steps"] == [12, 14, 10]
    assert torch.equal(torch.stack([s["rows"] for s in monitors[0].state_dict()["layers"].values()]),
                       torch.stack([s["rows"] for s in monitors[1].state_dict()["layers"].values()]))
    assert monitors[0].stats() == monitors[1].stats()


def test_an_empty_activation_has_no_underflow() -> None:
    assert layer_stats(torch.empty(0, 4)).tolist() == [-126.0, 0.0, 0.0, 0.0]  # no elements: nothing flushed


def _train(model: nn.Module, monitor: GrowthMonitor, steps: int) -> None:
    x, y = regression_data(32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        monitor.step()


def test_no_host_read_while_training_sampled_or_not() -> None:
    model = TinyMLP()
    monitor = GrowthMonitor(every_n_steps=3, window=3).attach(model)
    _train(model, monitor, 1)  # first sample outside: lazy buffers
    with HostReads() as reads:
        _train(model, monitor, 9)  # 3 sampling steps, 6 others
        metrics = monitor.metrics()
    assert reads.ops == []
    assert set(metrics) == {"mp/amax_growth", "mp/kurtosis_max"}
    with HostReads() as reads:
        stats = monitor.stats()
    assert reads.ops  # the one read stats() documents, and HostReads sees it
    assert set(stats) == {"fc1", "fc2", "fc3"} and stats["fc2"]["samples"] == 3 and stats["fc2"]["step"] == 9


def test_samples_once_per_due_step_in_training_mode_only() -> None:
    model = TinyMLP()
    monitor = GrowthMonitor(every_n_steps=2, window=4, source="output").attach(model, names=["fc2"])
    x, _ = regression_data(8)
    for _ in range(6):
        model(x)
        model(x)  # a second micro-batch: not sampled again
        model.eval()
        model(x * 1e6)  # validation: never sampled
        model.train()
        monitor.step()
    row = monitor.stats()["fc2"]
    assert row["samples"] == 3 and row["step"] == 4
    monitor.detach()
    assert row["amax"] == pytest.approx(model.fc2(model.act(model.fc1(x))).abs().max().item(), rel=1e-6)
    model(x)  # step 6 is due, but the hooks are gone
    assert monitor.stats()["fc2"]["samples"] == 3


def test_state_dict_round_trip() -> None:
    model = TinyMLP()
    monitor = GrowthMonitor(every_n_steps=1, window=3).attach(model)
    _train(model, monitor, 5)
    other = GrowthMonitor(every_n_steps=1, window=3).attach(TinyMLP())
    other.load_state_dict(monitor.state_dict())
    assert other.stats() == monitor.stats() and other.steps == 5
    with pytest.raises(KeyError, match="attach the same model"):
        GrowthMonitor().attach(nn.Sequential(nn.Linear(2, 2))).load_state_dict(monitor.state_dict())


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "fp16", "bf16"])
def test_format_ranges_match_the_format_table(fmt: str) -> None:
    from lit_mpstable.core.formats import FORMATS

    edge = FORMATS[fmt]
    values = torch.tensor([edge.max, edge.max * 1.01, edge.smallest_subnormal / 2, edge.smallest_subnormal, 1.0])
    _, _, saturation, underflow = layer_stats(values, fmt).tolist()
    assert saturation == pytest.approx(1 / 5) and underflow == pytest.approx(1 / 5)


def test_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="every_n_steps=0"):
        GrowthMonitor(every_n_steps=0)
    with pytest.raises(ValueError, match="source='weight'"):
        GrowthMonitor(source="weight")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"names=\['fc9'\]"):
        GrowthMonitor().attach(TinyMLP(), names=["fc2", "fc9"])
    with pytest.raises(ValueError, match="fmt='fp4'"):
        GrowthMonitor(fmt="fp4")
    with pytest.raises(ValueError, match="horizon=0"):
        GrowthMonitor().runaway(horizon=0)


# ------------------------------------------------------------------------------------------------ early warning
class Block(nn.Module):
    """A pre-norm residual block around a SwiGLU MLP, between an input and an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mlp, self.out = nn.Linear(16, 16), SwiGLU(), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.mlp(nn.functional.layer_norm(h, (16,)))
        return self.out(nn.functional.layer_norm(h, (16,)))


def _growth_run(
    seed: int, model: nn.Module, watched: nn.Module, monitor: GrowthMonitor, grow, steps: int
) -> tuple[int | None, int | None, set[str]]:
    """AdamW on a fixed regression task; ``grow(step)`` after each optimizer step (None: a clean run). Returns the
    first step ``runaway()`` named anything, the first step whose watched activation (``monitor.source`` of
    ``watched``, measured every step by an independent hook) exceeded 448, and every layer named before it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 16, generator=g) / 4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    monitor.attach(model)
    amax: list[float] = []
    index = 0 if monitor.source == "input" else None
    watched.register_forward_hook(lambda m, i, o: amax.append((i[0] if index == 0 else o).abs().max().item()))
    first_alarm, named = None, set()
    for step in range(steps):
        batch = torch.randint(0, 256, (32,), generator=g)
        loss = nn.functional.mse_loss(model(x[batch]), y[batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if amax[-1] > 448:
            return first_alarm, step, named
        if grow is not None:
            grow(step, g)
        monitor.step()
        if monitor.is_due(monitor.steps - 1):  # on sampling steps, as a logging callback would
            alarms = monitor.runaway()
            named.update(alarms)
            if alarms and first_alarm is None:
                first_alarm = step
    return first_alarm, None, named


@pytest.mark.parametrize("seed", range(5))
def test_weight_growth_named_50_steps_before_overflow(seed: int) -> None:
    """From step 100 the middle layer's weight is multiplied by 1.05 each step (a LayerNorm after it keeps the next
    layer's output in range). Watching outputs, the monitor names that layer alone, >= 50 steps before its output
    exceeds 448 (measured leads 78-91 steps); the same run without growth raises nothing in 300 steps."""

    def build() -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.ReLU(),
                              nn.Linear(32, 16))
        return model, model[2]

    def grow(step: int, g: torch.Generator) -> None:
        if step >= 100:
            with torch.no_grad():
                model[2].weight.mul_(1.05)

    model, watched = build()
    alarm, overflow, named = _growth_run(seed, model, watched, GrowthMonitor(source="output"), grow, 400)
    assert overflow is not None and alarm is not None and overflow - alarm >= 50, (alarm, overflow)
    assert named == {"2"}
    model, watched = build()
    alarm, overflow, named = _growth_run(seed, model, watched, GrowthMonitor(source="output"), None, 300)
    assert (alarm, overflow, named) == (None, None, set())


@pytest.mark.parametrize("seed", range(5))
def test_swiglu_alignment_named_50_steps_before_overflow(seed: int) -> None:
    """From step 100, row 0 of the SwiGLU's gate and up weights is pulled towards their common direction and grown 1% a
    step (Smooth-SwiGLU's mechanism: aligned gate and up rows square a channel of the product feeding ``down``).
    Watching inputs (what FP8 quantizes), the monitor names ``mlp.down`` alone, >= 50 steps before that input exceeds
    448 (measured leads 124-287 steps); the same run without the pull raises nothing in 500 steps."""

    def build() -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(seed)
        model = Block()
        return model, model.mlp.down

    def grow(step: int, g: torch.Generator) -> None:
        if step == 100:  # the rows' common direction at the start: they align with each other
            with torch.no_grad():
                u[:] = model.mlp.gate.weight[0] + model.mlp.up.weight[0]
                u.div_(u.norm())
        if step >= 100:
            with torch.no_grad():
                for weight in (model.mlp.gate.weight, model.mlp.up.weight):
                    weight[0].mul_(1.01).add_(u, alpha=0.01 * weight[0].norm().item())

    u = torch.zeros(16)
    model, watched = build()
    alarm, overflow, named = _growth_run(seed, model, watched, GrowthMonitor(), grow, 1000)
    assert overflow is not None and alarm is not None and overflow - alarm >= 50, (alarm, overflow)
    assert named == {"mlp.down"}
    model, watched = build()
    alarm, overflow, named = _growth_run(seed, model, watched, GrowthMonitor(), None, 500)
    assert (alarm, overflow, named) == (None, None, set())

"""The growth monitor's samples in the plugin's checkpoint: a run interrupted mid-trend and resumed names the same
layers at the same steps as the uninterrupted run (without the samples its trend fit would restart), and a corrupt
field of the saved samples is refused by name before anything is loaded."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import TinyMLP, regression_data
from torch import nn

from lit_mpstable import StablePrecision
from lit_mpstable.core.guards.growth import GrowthMonitor
from lit_mpstable.core.step.stepper import PrecisionStepper

EVERY, GROW_FROM, RATE, STEPS, RESUME_AT = 5, 55, 1.02, 110, 60


class Block(nn.Module):
    """A pre-norm residual SwiGLU block between two projections (as in test_growth.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(16, 16), nn.Linear(16, 16)
        self.gate, self.up, self.down = nn.Linear(16, 64, bias=False), nn.Linear(16, 64, bias=False), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        z = nn.functional.layer_norm(h, (16,))
        h = h + self.down(nn.functional.silu(self.gate(z)) * self.up(z))
        return self.out(nn.functional.layer_norm(h, (16,)))


class Run:
    """AdamW through a PrecisionStepper with ``growth_every_n_steps=5`` on a fixed regression; from step 55 the gate
    and up weights grow 2% a step (their product, ``down``'s input, about 4%). Measured: the trend over a full window
    names ``down`` first at step 80; no alarm before the growth."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = Block()
        self.stepper = PrecisionStepper("32-true", growth_every_n_steps=EVERY, telemetry_every_n_steps=None)
        self.stepper.setup_module(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.stepper.setup_optimizers(self.model, [self.opt])
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(256, 16, generator=g)
        self.y = torch.tanh(self.x @ torch.randn(16, 16, generator=g) / 4)
        self.g = torch.Generator().manual_seed(2)
        self.step = 0

    def train(self, until: int) -> list[tuple[int, list[str]]]:
        """Train to step ``until``; after each sampling step, the layers ``runaway()`` names (as a logging callback
        would read them)."""
        named = []
        while self.step < until:
            batch = torch.randint(0, 256, (32,), generator=self.g)
            with self.stepper.forward_context():
                loss = nn.functional.mse_loss(self.model(self.x[batch]), self.y[batch])
            self.stepper.scale_loss(loss).backward()
            self.stepper.step(self.opt)
            self.opt.zero_grad()
            if self.step >= GROW_FROM:
                with torch.no_grad():
                    self.model.gate.weight.mul_(RATE)
                    self.model.up.weight.mul_(RATE)
            if self.stepper.growth.is_due(self.step):
                named.append((self.step, self.stepper.growth.runaway()))
            self.step += 1
        return named

    def checkpoint(self) -> dict:
        return copy.deepcopy({"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                              "plugin": self.stepper.state_dict(), "g": self.g.get_state(), "step": self.step})

    @classmethod
    def resumed(cls, checkpoint: dict) -> Run:
        run = cls()
        run.model.load_state_dict(checkpoint["model"])
        run.opt.load_state_dict(checkpoint["opt"])
        assert run.stepper.load_state_dict(checkpoint["plugin"]) == []
        run.g.set_state(checkpoint["g"])
        run.step = checkpoint["step"]
        return run


def _first(named: list[tuple[int, list[str]]]) -> int | None:
    return next((step for step, layers in named if layers), None)


def test_a_resume_mid_trend_names_the_same_layers_at_the_same_steps() -> None:
    whole = Run()
    expected = whole.train(STEPS)
    first = _first(expected)
    # The alarm comes after the interruption, sooner than a restarted fit could raise it (window 8 x 5 steps).
    assert first is not None and RESUME_AT < first < RESUME_AT + 8 * EVERY, expected
    assert {n for _, layers in expected for n in layers} == {"down"}

    interrupted = Run()
    interrupted.train(RESUME_AT)
    checkpoint = interrupted.checkpoint()
    assert checkpoint["plugin"]["growth"]["samples"] > 0
    resumed = Run.resumed(checkpoint)
    assert resumed.train(STEPS) == [(s, n) for s, n in expected if s >= RESUME_AT]
    assert resumed.stepper.growth.stats() == whole.stepper.growth.stats()
    assert resumed.stepper.growth.samples == whole.stepper.growth.samples

    # A checkpoint without the samples (written before they were saved) restarts the fit: the alarm comes later.
    old = copy.deepcopy(checkpoint)
    del old["plugin"]["growth"]
    restarted = Run.resumed(old)
    assert _first(restarted.train(STEPS)) != first


def test_state_loaded_before_attach_waits_for_it() -> None:
    source = Run()
    source.train(20)
    state = source.stepper.state_dict()
    stepper = PrecisionStepper("32-true", growth_every_n_steps=EVERY, telemetry_every_n_steps=None)
    stepper.load_state_dict(copy.deepcopy(state))  # before the model: kept, checked once the layers are known
    assert stepper.state_dict()["growth"]["samples"] == state["growth"]["samples"]
    torch.manual_seed(0)
    stepper.setup_module(Block())
    assert stepper.growth.stats() == source.stepper.growth.stats()


def test_a_rollback_keeps_the_live_samples() -> None:
    run = Run()
    run.train(15)
    snapshot = copy.deepcopy(run.stepper.state_dict())
    run.train(30)
    live = run.stepper.growth.stats()
    run.stepper.load_state_dict(snapshot, keep_counters=True)
    assert run.stepper.growth.stats() == live


def test_plugin_without_a_monitor_notes_saved_samples() -> None:
    run = Run()
    run.train(10)
    plain = PrecisionStepper("32-true", telemetry_every_n_steps=None)
    notes = plain.load_state_dict(run.stepper.state_dict())
    assert any("growth_every_n_steps" in n for n in notes)


# ----------------------------------------------------------------------------------------- corrupt fields refused
def _plugin() -> StablePrecision:
    plugin = StablePrecision("bf16-mixed", growth_every_n_steps=2)
    module = plugin.convert_module(TinyMLP())
    plugin.stepper.setup_optimizers(module, [torch.optim.SGD(module.parameters(), lr=0.1)])
    x, y = regression_data(16)
    for _ in range(5):
        with plugin.forward_context():  # where the plugin hooks the layers on sampling steps
            loss = nn.functional.mse_loss(module(x).float(), y)
        plugin.stepper.scale_loss(loss).backward()
        plugin.stepper.step(plugin.stepper.optimizers[0])
        plugin.stepper.optimizers[0].zero_grad()
    return plugin


def _rows(value: float, column: int) -> callable:
    def corrupt(rows: torch.Tensor) -> torch.Tensor:
        rows = rows.clone()
        rows[0, column] = value
        return rows
    return corrupt


CORRUPT = [
    (("steps",), -1), (("steps",), "4"), (("steps",), None), (("samples",), -2), (("samples",), 1.5),
    (("samples",), 0),  # fewer than the filled slots
    (("sampled",), ["fc9"]), (("sampled",), "fc1"), (("layers",), None), (("layers",), {"fc1": {}}),
    (("layers", "fc2", "next"), 8), (("layers", "fc2", "next"), -1), (("layers", "fc2", "next"), 0),
    (("layers", "fc2", "next"), True), (("layers", "fc2", "steps"), [0, 2, "4"]),
    (("layers", "fc2", "steps"), [0, 2, 40]), (("layers", "fc2", "steps"), [-2, 0, 2]), (("layers", "fc2", "steps"), 3),
    (("layers", "fc2", "rows"), "junk"), (("layers", "fc2", "rows"), torch.zeros(4, 4)),
    (("layers", "fc2", "rows"), torch.zeros(8, 4, dtype=torch.int64)),
    (("layers", "fc2", "rows"), _rows(math.nan, 2)), (("layers", "fc2", "rows"), _rows(1.5, 3)),
    (("layers", "fc2", "rows"), _rows(-1.0, 1)), (("layers", "fc2", "rows"), _rows(-200.0, 0)),
    (("layers", "fc2", "rows"), None),  # None rows with saved steps
]


@pytest.mark.parametrize("path, value", CORRUPT, ids=[f"{'.'.join(p)}={v!r:.20}" for p, v in CORRUPT])
def test_a_corrupt_growth_field_is_refused_by_name_and_changes_nothing(path: tuple, value) -> None:
    plugin = _plugin()
    state = copy.deepcopy(plugin.state_dict())
    target = state["growth"]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value(target[path[-1]]) if callable(value) else value
    before = plugin.stepper.growth.stats()
    with pytest.raises((TypeError, ValueError, KeyError)) as error:
        plugin.load_state_dict(state)
    message = str(error.value)
    assert "StablePrecision.load_state_dict" in message and f"{path[-1]}" in message, message
    assert plugin.stepper.growth.stats() == before


def test_legitimate_values_load() -> None:
    """NaN/inf statistics of a sample of non-finite activations, and a full ring, are legitimate state."""
    plugin = _plugin()
    state = copy.deepcopy(plugin.state_dict())
    layer = state["growth"]["layers"]["fc1"]
    latest = layer["next"] - 1
    layer["rows"][latest, 0], layer["rows"][latest, 1] = math.inf, math.nan
    plugin.load_state_dict(state)
    stats = plugin.stepper.growth.stats()["fc1"]
    assert math.isinf(stats["amax"]) and math.isnan(stats["kurtosis"])
    assert plugin.stepper.growth.runaway() == ["fc1"]  # a non-finite sample is always named


def test_monitor_check_state_names_the_window() -> None:
    model = TinyMLP()
    monitor = GrowthMonitor(every_n_steps=1, window=3).attach(model)
    x, _ = regression_data(8)
    for _ in range(4):
        model(x)
        monitor.step()
    with pytest.raises(ValueError, match=r"must be \(5, 4\).*another window"):
        GrowthMonitor(every_n_steps=1, window=5).attach(TinyMLP()).load_state_dict(monitor.state_dict())

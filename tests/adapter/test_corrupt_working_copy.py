"""A NaN written into a model weight (a flipped bit in memory) is the state's fault in every weight mode: the triage
rolls it back. With FP32 masters the corrupt weight is the 16-bit working copy, which the FP32 replay does not read
(it widens the masters), so a clean FP32 replay once named the fault "precision" and moved the layer to FP32 for
good."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from cb_helpers import PoisonModule, quiet
from helpers import TinyMLP, make_trainer, regression_data
from lightning.fabric import Fabric
from trainer_pkg import FaultTriage, ScaleCheckpoint, StablePrecision, pl

from lit_mpstable.fabric import StablePrecision as FabricPrecision
from lit_mpstable.faults import StateSnapshot, StepTriage

CORRUPT_STEP = 3
WEIGHT_MODES = [
    ("bf16-true", True),  # FP32 masters: the corrupt weight is the working copy
    ("bf16-true", "kahan"),
    ("bf16-true", "stochastic"),
    ("bf16-true", False),
    ("bf16-mixed", True),
    ("32-true", True),
]


class CorruptWeight(pl.Callback):
    """Writes a NaN into fc1's weight (the model's own tensor: 16-bit in ``*-true``) at the start of one step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.model.fc1.weight.view(-1)[3] = float("nan")


def assert_rolled_back_in_the_run_precision(events: list[dict], ladder: list[dict], plugin, model) -> None:
    """One ``state`` verdict at the corrupt step, rolled back; no fallback; every weight finite and in the dtype the
    precision gives it."""
    assert [(e["step"], e["kind"], e["action"]) for e in events] == [(CORRUPT_STEP, "state", "rollback")]
    assert events[0]["replays"] == ["as_is:nonfinite", "fp32:nonfinite", "snapshot:clean"]
    assert [(e["step"], e["fault"], e["action"]) for e in ladder] == [(CORRUPT_STEP, "nonfinite_state", "rollback")]
    assert not plugin.fallback_active
    expected = torch.bfloat16 if plugin.precision == "bf16-true" else torch.float32
    assert {p.dtype for p in model.parameters()} == {expected}
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("precision, master_weights", WEIGHT_MODES)
def test_trainer_a_nan_weight_is_state_and_rolls_back_in_every_weight_mode(precision, master_weights):
    torch.manual_seed(0)
    module, triage = PoisonModule(optimizer="adamw", lr=1e-2), FaultTriage()
    plugin = StablePrecision(precision, master_weights=master_weights)
    checkpoint = ScaleCheckpoint(every_n_steps=1)
    with quiet():
        make_trainer(plugin, callbacks=[CorruptWeight(CORRUPT_STEP), checkpoint, triage], max_steps=6).fit(module)
    assert_rolled_back_in_the_run_precision(triage.events, plugin.ladder_events, plugin, module.model)
    assert checkpoint.rollbacks == 1


def fabric_run(precision: str, master_weights: bool | str, *,
               snapshot: bool) -> tuple[StepTriage, FabricPrecision, TinyMLP]:
    """Six steps of TinyMLP (seed 0, AdamW) through Fabric and StepTriage, a NaN written into fc1's weight before step
    :data:`CORRUPT_STEP`; with ``snapshot``, a StateSnapshot taken after every applied step."""
    plugin = FabricPrecision(precision, master_weights=master_weights)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    inner = TinyMLP()
    model, optimizer = fabric.setup(inner, torch.optim.AdamW(inner.parameters(), lr=1e-2))
    snapshots = StateSnapshot(plugin, model, optimizer) if snapshot else None
    triage = StepTriage(plugin, snapshot=snapshots)
    x, y = regression_data(64)
    for step in range(6):
        rows = slice(16 * (step % 4), 16 * (step % 4 + 1))
        if step == CORRUPT_STEP:
            with torch.no_grad():
                inner.fc1.weight.view(-1)[3] = float("nan")

        def closure(x=x[rows], y=y[rows]) -> torch.Tensor:
            loss = F.mse_loss(model(x).float(), y)
            fabric.backward(loss)
            return loss

        with quiet():
            triage.run(optimizer, closure)
        if triage.stop_reason is not None:
            break
        if snapshots is not None and not plugin.last_step_skipped:
            snapshots.take()
    return triage, plugin, inner


@pytest.mark.parametrize("precision, master_weights", WEIGHT_MODES)
def test_fabric_a_nan_weight_is_state_and_rolls_back_in_every_weight_mode(precision, master_weights):
    triage, plugin, inner = fabric_run(precision, master_weights, snapshot=True)
    assert_rolled_back_in_the_run_precision(triage.events, triage.ladder_events, plugin, inner)
    assert triage.rollbacks == 1 and triage.stop_reason is None


@pytest.mark.parametrize("precision, master_weights", WEIGHT_MODES)
def test_fabric_a_nan_weight_without_a_snapshot_stops_in_every_weight_mode(precision, master_weights):
    # The ladder's table: inf/NaN in the state and no snapshot to roll back to stops the run, FP32 masters or not.
    triage, plugin, _ = fabric_run(precision, master_weights, snapshot=False)
    assert [(e["step"], e["fault"], e["action"]) for e in triage.ladder_events] == [
        (CORRUPT_STEP, "nonfinite_state", "stop")]
    assert triage.stop_reason is not None and not plugin.fallback_active

"""StepTriage over Lightning Fabric (the plugin exposes its stepper): each kind of event classified and acted on."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import HostReads, TinyMLP, regression_data
from lightning.fabric import Fabric
from torch import nn

from lit_mpstable.fabric import StablePrecision
from lit_mpstable.faults import StateSnapshot, StepTriage

NAN = float("nan")
FP16_MAX = 65504.0


class FabricLoop:
    """A Fabric loop on TinyMLP (seed 0), AdamW, 4 batches of 16 cycled; faults by step (as in
    tests/core/test_step_triage.py): ``transient`` (a NaN in fc2's output on the step's first execution),
    ``overflow`` (fc2's output past FP16's range on every execution), ``nan_batch``, ``corrupt`` (a NaN written into
    fc1's weight before the step)."""

    def __init__(self, precision: str = "32-true", *, triage: bool = True, snapshot: bool = False,
                 transient: int | None = None, overflow: int | None = None, nan_batch: int | None = None,
                 corrupt: int | None = None, compile: bool = False) -> None:
        self.plugin = StablePrecision(precision)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FP16 on the CPU, said once
            self.fabric = Fabric(accelerator="cpu", devices=1, plugins=[self.plugin])
        torch.manual_seed(0)
        self.inner = TinyMLP()
        self.inner.fc2.register_forward_hook(self._hook)
        module = torch.compile(self.inner) if compile else self.inner  # as a user compiles: before fabric.setup
        self.model, self.opt = self.fabric.setup(module, torch.optim.AdamW(self.inner.parameters(), lr=1e-2))
        self.snapshot = StateSnapshot(self.plugin, self.model, self.opt) if snapshot else None
        self.triage = StepTriage(self.plugin, snapshot=self.snapshot) if triage else None
        self.x, self.y = regression_data(64)
        self.transient, self.overflow, self.nan_batch, self.corrupt = transient, overflow, nan_batch, corrupt
        self.step = self.executions = self.forwards = 0

    def _hook(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor | None:
        self.forwards += 1
        self.executions += 1
        if self.step == self.transient and self.executions == 1:
            output = output.clone()
            output.view(-1)[0] = NAN
            return output
        if self.step == self.overflow:
            amax = output.detach().abs().amax().float().clamp(min=2.0**-100)
            factor = torch.exp2(torch.ceil(torch.log2(2 * FP16_MAX / amax)))
            return output * factor / factor
        return None

    def train(self, steps: int) -> FabricLoop:
        for step in range(steps):
            self.step, self.executions = step, 0
            rows = slice(16 * (step % 4), 16 * (step % 4 + 1))
            x, y = self.x[rows].clone(), self.y[rows]
            if step == self.nan_batch:
                x.view(-1)[0] = NAN
            if step == self.corrupt:
                with torch.no_grad():
                    self.inner.fc1.weight.view(-1)[3] = NAN

            def closure(x=x, y=y) -> torch.Tensor:
                loss = F.mse_loss(self.model(x), y)
                self.fabric.backward(loss)
                return loss

            if self.triage is not None:
                self.triage.run(self.opt, closure)
            else:
                self.opt.zero_grad()
                closure()
                self.opt.step()
            if self.snapshot is not None and not self.plugin.last_step_skipped:
                self.snapshot.take()
        return self

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.inner.state_dict().items()}


def assert_same_weights(a: FabricLoop, b: FabricLoop) -> None:
    for name, value in a.weights().items():
        torch.testing.assert_close(b.weights()[name], value, rtol=1e-6, atol=1e-7)


def test_clean_steps_run_no_replay_and_add_no_host_read():
    def run(triage: bool) -> tuple[FabricLoop, list[str]]:
        loop = FabricLoop(triage=triage).train(1)  # the first step binds the optimizer (one-time setup)
        with HostReads() as seen:
            loop.train(3)
        return loop, seen.ops

    (plain, plain_reads), (loop, reads) = run(False), run(True)
    assert reads == plain_reads and loop.forwards == plain.forwards == 3 + 1
    assert loop.triage.events == [] and loop.triage.replays_run == 0
    assert_same_weights(plain, loop)


def test_transient_uses_the_replay_and_matches_a_fault_free_run():
    clean = FabricLoop().train(5)
    loop = FabricLoop(transient=2).train(5)
    assert [(e["step"], e["kind"], e["action"]) for e in loop.triage.events] == [(2, "transient", "use_replay")]
    assert loop.triage.events[0]["replays"] == ["as_is:clean"] and loop.forwards == 6
    assert loop.plugin.skipped_steps == 1 and loop.plugin.step_count == 6
    assert_same_weights(clean, loop)


def test_a_nan_batch_is_data_and_the_batch_stays_skipped():
    loop = FabricLoop(snapshot=True, nan_batch=1).train(3)
    (event,) = loop.triage.events
    assert (event["step"], event["kind"], event["action"], event["batch_idx"]) == (1, "data", "skip", 1)
    assert event["replays"] == ["as_is:nonfinite", "fp32:nonfinite", "snapshot:nonfinite"]
    assert loop.triage.skipped_batches == [1] and loop.triage.rollbacks == 0
    assert loop.plugin.stepper.applied_steps() == 2
    assert all(torch.isfinite(v).all() for v in loop.weights().values())


def test_an_fp16_overflow_is_precision_and_falls_back_the_blamed_module():
    loop = FabricLoop("16-mixed", overflow=1).train(3)
    (event,) = loop.triage.events
    assert (event["step"], event["kind"], event["action"]) == (1, "precision", "fallback")
    assert event["replays"] == ["as_is:nonfinite", "fp32:clean"] and event["blamed"] == ["fc2"]
    assert loop.plugin.islands.names == ["fc2"] and loop.plugin.compute_dtype == torch.float16


def test_a_nan_weight_is_state_and_rolls_back_to_the_fault_free_run():
    clean = FabricLoop().train(4)
    loop = FabricLoop(snapshot=True, corrupt=2).train(4)
    (event,) = loop.triage.events
    assert (event["step"], event["kind"], event["action"], event["restored_step"]) == (2, "state", "rollback", 2)
    assert event["replays"] == ["as_is:nonfinite", "fp32:nonfinite", "snapshot:clean"]
    assert_same_weights(clean, loop)


@pytest.mark.parametrize("bad", [0, "3"])
def test_max_replays_is_validated_over_the_plugin(bad):
    with pytest.raises(ValueError, match=r"StepTriage\(max_replays="):
        StepTriage(StablePrecision("32-true"), max_replays=bad)


@pytest.mark.slow
def test_a_compiled_model_in_fabric_is_triaged_as_eagerly():
    # torch.compile before fabric.setup: the traced as-is replay runs eagerly (Dynamo cannot trace the tracer's hooks),
    # the others compiled; each event is classified and acted on as in the eager loop, the weights end the same.
    def events(loop: FabricLoop) -> list[tuple]:
        return [(e["step"], e["kind"], e["action"], tuple(e["replays"])) for e in loop.triage.events]

    eager = FabricLoop(snapshot=True, transient=1, nan_batch=3, corrupt=5).train(7)
    compiled = FabricLoop(snapshot=True, transient=1, nan_batch=3, corrupt=5, compile=True).train(7)
    assert [e[:3] for e in events(eager)] == [(1, "transient", "use_replay"), (3, "data", "skip"),
                                                (5, "state", "rollback")]
    assert events(compiled) == events(eager)
    assert_same_weights(eager, compiled)

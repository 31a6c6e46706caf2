"""The run's counters have one owner (RunCounters); the stepper's counter attributes are views of it."""

from __future__ import annotations

import torch
from helpers import TinyMLP

from lit_mpstable.core.step.stepper import PrecisionStepper, RunCounters


def test_the_stepper_counts_into_its_run_counters_and_resumes_them():
    torch.manual_seed(0)
    model = TinyMLP()
    stepper = PrecisionStepper("32-true", scaler=None, device="cpu")
    stepper.setup_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper.setup_optimizers(model, [opt])
    for bad in (False, True, False):
        loss = model(torch.randn(4, 16)).pow(2).mean()
        stepper.scale_loss(loss).backward()
        if bad:
            model.fc2.weight.grad.view(-1)[0] = float("inf")
        stepper.step(opt)
        opt.zero_grad()
    expected = {"step_count": 3, "overflow_count": 1, "last_step_skipped": False, "skipped_steps": 1}
    assert stepper.counters.state_dict() == expected
    assert (stepper.step_count, stepper.overflow_count, stepper.skipped_steps) == (3, 1, 1)
    assert stepper.applied_steps() == 2 and stepper.applied_steps(opt) == 2
    state = stepper.state_dict()
    assert {k: state[k] for k in expected} == expected

    resumed = RunCounters()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == expected
    stepper.step_count = 7  # a view: writes into the owner
    assert stepper.counters.step_count == 7


def test_a_rollback_keeps_the_scalers_live_event_counters_and_restores_its_numbers():
    saved = {"scale": 2.0, "_growth_tracker": 3, "overflow_count": 1, "step_count": 5, "min_scale_hits": 0}
    live = {"scale": 0.5, "_growth_tracker": 0, "overflow_count": 4, "step_count": 9, "min_scale_hits": 2}
    kept = RunCounters.keep_live_(saved, live)
    assert kept == {"scale": 2.0, "_growth_tracker": 3, "overflow_count": 4, "step_count": 9, "min_scale_hits": 2}
    assert list(kept) == list(saved)

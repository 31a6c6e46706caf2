"""hold_on_skip: the schedule stays put on skipped steps, and the scheduler still pickles and saves plainly."""

from __future__ import annotations

import pickle

import torch

from lit_mpstable.schedulers import hold_on_skip


def test_held_scheduler_skips_then_steps_and_pickles_as_its_own_class() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    skipped = [True]
    hold_on_skip(sched, lambda: skipped[0])
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 1.0  # held
    skipped[0] = False
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5
    clone = pickle.loads(pickle.dumps(sched))
    assert type(clone) is torch.optim.lr_scheduler.StepLR and clone.state_dict()["last_epoch"] == 1
    assert "step" not in sched.state_dict()  # checkpoints stay plain

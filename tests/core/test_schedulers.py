"""hold_on_skip: the schedule moves only when the weights did, and the scheduler still pickles and saves plainly."""

from __future__ import annotations

import pickle

import torch

from lit_mpstable.core.schedulers import hold_on_skip


def _scheduler():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    return opt, sched


def test_per_step_schedule_holds_on_a_skipped_step_and_pickles_as_its_own_class() -> None:
    opt, sched = _scheduler()
    applied = [0]
    hold_on_skip(sched, lambda: applied[0])
    sched.step()  # no optimizer step applied since: held
    assert opt.param_groups[0]["lr"] == 1.0
    applied[0] += 1
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5
    clone = pickle.loads(pickle.dumps(sched))
    assert type(clone) is torch.optim.lr_scheduler.StepLR and clone.state_dict()["last_epoch"] == 1
    assert "step" not in sched.state_dict()  # checkpoints stay plain


def test_per_epoch_schedule_holds_only_when_the_whole_epoch_was_skipped() -> None:
    opt, sched = _scheduler()
    applied = [0]
    hold_on_skip(sched, lambda: applied[0])
    applied[0] += 9  # an epoch with many applied steps, even if its last one was skipped
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5
    sched.step()  # a whole epoch without an applied step
    assert opt.param_groups[0]["lr"] == 0.5

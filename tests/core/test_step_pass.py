"""The step's one pass over the gradients (lit_mpstable/core/tensors.py's grad_pass): the gradient check, SpikeGuard's
norm and a clip by norm all read it; a clean step makes one host read in all."""

from __future__ import annotations

import pytest
import torch
from helpers import GradReads, HostReads, OpNames, TinyMLP, mse_backward, regression_data, tiny_stepper

from lit_mpstable.core.guards.spike import SpikeGuard
from lit_mpstable.core.step.stepper import PrecisionStepper
from lit_mpstable.core.tensors import grad_pass


def test_one_pass_gives_the_norm_and_the_finite_flag_without_a_host_read():
    grads = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2, dtype=torch.bfloat16)]
    with HostReads() as seen:
        measured = grad_pass(grads)
    assert seen.ops == [] and measured is not None
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    torch.testing.assert_close(measured.norm, expected)
    assert bool(measured.finite) and not measured.fp32  # one BF16 gradient: not torch's clip norm
    assert grad_pass(grads[:2]).fp32
    assert not bool(grad_pass([torch.ones(3), torch.tensor([1.0, float("nan")])]).finite)
    assert not bool(grad_pass([torch.tensor([float("-inf")])]).finite)
    overflowing = grad_pass([torch.full((4,), 3e19), torch.ones(2)])  # finite elements, squares past FP32's range
    assert float(overflowing.found) == 1.0 and not bool(overflowing.finite)
    unflagged = grad_pass([torch.ones(3), torch.tensor([1.0, float("nan")])], check=False)  # no flag kernel
    assert unflagged.found is None and not bool(unflagged.finite) and bool(grad_pass(grads, check=False).finite)
    flag = torch.zeros(())
    assert grad_pass([torch.tensor([float("inf")])], flag).found is flag and float(flag) == 1.0  # into the given zero
    # No gradients, or sparse ones: no pass (the caller checks them its own way).
    assert grad_pass([]) is None and grad_pass([torch.ones(3).to_sparse()]) is None


def _whole_stack(precision: str, **kwargs):
    """TinyMLP through a stepper with SpikeGuard and growth sampling, SGD with momentum (AdamW reads its step count on
    the host on the CPU, one read per parameter: its own, not the step's)."""
    torch.manual_seed(0)
    model = TinyMLP()
    stepper = PrecisionStepper(precision, spike_guard=SpikeGuard(warmup=2), growth_every_n_steps=2,
                               telemetry_every_n_steps=None, **kwargs)
    stepper.setup_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    stepper.setup_optimizers(model, [optimizer])
    return model, stepper, optimizer


@pytest.mark.parametrize("precision, kwargs", [("bf16-mixed", {}), ("16-mixed", {}), ("bf16-true", {}),
                                               ("bf16-true", {"master_weights": "kahan"})],
                         ids=["bf16-mixed", "16-mixed-scaler", "bf16-true-masters", "bf16-true-kahan"])
def test_a_clean_step_with_the_whole_stack_reads_the_gradients_once_and_the_host_once(precision, kwargs):
    """SpikeGuard, growth sampling (a sampled step), the loss scaler's (or the scale-1) check, the step-input check and
    a clip by norm: one _foreach_norm over the gradients (the check's own pass where it only checks; after GradScaler's
    unscale kernel, which must write them, where a loss scale is undone) and one host read, the skip decision."""
    model, stepper, optimizer = _whole_stack(precision, **kwargs)
    x, y = regression_data(16)
    for _ in range(4):  # past the guard's warmup and the growth monitor's first (lazy) sample
        mse_backward(stepper, model, x, y)
        stepper.clip_grad_norm_(optimizer, 1.0)
        stepper.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    assert stepper.growth.due()  # the step below samples the activations
    with HostReads() as reads, GradReads() as kernels:
        mse_backward(stepper, model, x, y)
        grads = [p.grad for p in model.parameters()]  # held: compact weights drop them in their step
        stepper.unscale_(optimizer)
        grads += [p.grad for group in optimizer.param_groups for p in group["params"]]  # the FP32 masters' ones
        stepper.clip_grad_norm_(optimizer, 1.0)
        stepper.step(optimizer)
    names = kernels.over(grads)
    optimizer.zero_grad(set_to_none=True)
    assert not stepper.last_step_skipped and stepper.step_count == 5
    assert len(reads.ops) == 1, reads.ops
    assert names.count("_foreach_norm") == 1, names
    unscaled = precision == "16-mixed"  # a real scale is undone by GradScaler's kernel (it writes the gradients)
    assert names.count("_amp_foreach_non_finite_check_and_unscale_") == int(unscaled), names


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true"])
def test_the_shared_pass_leaves_the_run_bit_identical(precision):
    """The norm SpikeGuard judges and the clip uses, read off the check's pass, is the number each computed alone:
    the same weights after steps with a clip, a guard, and a NaN step skipped."""
    runs = []
    for reuse in (True, False):
        torch.manual_seed(0)
        model = TinyMLP()
        _, stepper, optimizer = tiny_stepper(precision, spike_guard=SpikeGuard(warmup=2))
        model = stepper.layout.module
        if not reuse:
            stepper._checker.measures_norm = False  # the check makes no pass: the guard and the clip read alone
            stepper._checker.__dict__["grad_pass"] = lambda optimizer: None
        x, y = regression_data(16)
        for step in range(6):
            mse_backward(stepper, model, x * (float("nan") if step == 3 else 1.0), y)
            stepper.clip_grad_norm_(optimizer, 0.5)
            stepper.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
        runs.append([p.detach().clone() for p in model.parameters()])
        assert stepper.skipped_steps == 1
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_a_clip_by_norm_alone_reuses_the_checks_pass_from_its_second_step():
    """Without a guard the first clip computes its norm and asks the check for the pass; later clips read it (FP32
    gradients: torch's number), so the step reads the gradients once."""
    model, stepper, optimizer = tiny_stepper("bf16-mixed", telemetry_every_n_steps=None)
    x, y = regression_data(16)
    counts = []
    for _ in range(3):
        mse_backward(stepper, model, x, y)
        with GradReads() as kernels:
            stepper.clip_grad_norm_(optimizer, 1.0)
            stepper.step(optimizer)
        counts.append(len(kernels.over([p.grad for p in model.parameters()])))
        optimizer.zero_grad(set_to_none=True)
    assert counts == [2, 1, 1]  # check kernel + the clip's norm, then the one pass


def test_a_clean_step_allocates_no_flag_and_the_reused_flag_still_skips_the_next_nan():
    """The scale-1 check (scaler=None) starts each clean iteration from the flag the last step read as 0.0 instead of
    allocating a zero, and the batch's inf/NaN is noted as its minima and maxima only (aminmax, no flag): a clean
    step makes no zeros/stack/isfinite. A NaN gradient after clean steps is still found (skipped, counted), and the
    clean step after it (a fresh flag) is applied."""
    model, stepper, optimizer = tiny_stepper("bf16-mixed", telemetry_every_n_steps=None)
    x, y = regression_data(16)
    skipped, made = [], []
    for step in range(6):
        with OpNames() as ops:
            mse_backward(stepper, model, x, y)
            if step == 3:
                model.fc1.weight.grad[0, 0] = float("nan")
            stepper.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        skipped.append(stepper.last_step_skipped)
        made.append([name for name in ops.names if name.split(".")[1] in ("zeros", "stack", "isfinite", "abs")])
    assert skipped == [False, False, False, True, False, False]
    assert stepper.overflow_count == 1 and stepper.skipped_steps == 1
    # Clean steps after a clean one (steps 1 and 2 check no share of the state): no flag made, no isfinite chain.
    assert made[1] == [] and made[2] == [], made
    assert stepper._checker._spare_flag is not None  # step 5 was clean: its flag (0.0) waits for the next check


def test_the_batch_note_is_read_only_when_asked_and_sees_the_batch_as_it_came():
    """input_nonfinite comes from the minima and maxima convert_input took: a NaN batch reads True even if the batch is
    cleaned in place afterwards, a clean one False; None before any floating input; reset by the step."""
    model, stepper, optimizer = tiny_stepper("bf16-mixed", telemetry_every_n_steps=None)
    assert stepper.input_nonfinite is None
    x, y = regression_data(16)
    bad = x.clone()
    bad[0, 0] = float("nan")
    stepper.convert_input((bad, y))
    bad.nan_to_num_(0.0)  # cleaned in place after the note: the note keeps what came
    assert bool(stepper.input_nonfinite)
    stepper.convert_input((x, y))
    assert bool(stepper.input_nonfinite)  # the same step's batches fold together until it ends
    mse_backward(stepper, model, x, y)
    stepper.step(optimizer)
    assert stepper.input_nonfinite is None
    stepper.convert_input((x, y))
    assert not bool(stepper.input_nonfinite)


def _stack_after_steps(precision: str, steps: int):
    """The whole stack (growth sampling off) after ``steps`` clean steps, with the next step's gradients made."""
    model, stepper, optimizer = _whole_stack(precision)
    stepper.growth_every_n_steps = None
    x, y = regression_data(16)
    for _ in range(steps):
        mse_backward(stepper, model, x, y)
        stepper.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    mse_backward(stepper, model, x, y)
    return stepper, optimizer


def test_the_check_by_the_pass_and_the_spike_fold_are_few_kernels_on_a_clean_step():
    """The gradient check read off the pass is _foreach_norm, stack, the norm and GradScaler's check kernel on the norm
    (its float flag as the step's found-inf flag; the last step's 0.0 flag reused, no zero made): no isfinite chain
    (abs/ne/eq/mul), no logical_not, no copy to float. SpikeGuard's flag folds into the step's flag in one kernel, and
    the check's own flag (what the step returns as the check before the fold) keeps its value."""
    stepper, optimizer = _stack_after_steps("bf16-mixed", 4)
    checker = stepper._checker
    with OpNames() as ops:
        checker.check_grads_(optimizer, stepper.device)
    assert [name.split(".")[1] for name in ops.names] == [
        "_foreach_norm", "stack", "linalg_vector_norm", "_amp_foreach_non_finite_check_and_unscale_"], ops.names
    check = checker._per_optimizer_states[id(optimizer)]["found_inf_per_device"][torch.device("cpu")]
    spike = torch.tensor(True)
    with OpNames() as ops:
        before = checker.fold_found_inf_(optimizer, spike)
    assert len(ops.names) == 1, ops.names
    assert before is check and float(before) == 0.0  # the check as it was: not written by the fold
    (folded,) = checker._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()
    assert float(folded) == 1.0 and folded.dtype == torch.float32
    assert float(checker.fold_found_inf_(optimizer, torch.tensor(0.0))) == 1.0  # a float flag folds too
    (kept,) = checker._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()
    assert float(kept) == 1.0


def test_after_the_unscale_kernel_the_pass_makes_no_flag_of_its_own():
    """A real loss scale is undone by GradScaler's kernel, which checks the gradients as it writes them: the pass after
    it (SpikeGuard's norm) is the norm's three kernels, no zero and no check of the norm."""
    stepper, optimizer = _stack_after_steps("16-mixed", 3)
    with OpNames() as ops:
        stepper._checker.check_grads_(optimizer, stepper.device)
    names = [name.split(".")[1] for name in ops.names]
    assert names[-3:] == ["_foreach_norm", "stack", "linalg_vector_norm"], names
    assert names.count("_amp_foreach_non_finite_check_and_unscale_") == 1 and "zeros" not in names[-4:], names
    assert stepper._checker.grad_pass(optimizer).found is None
    assert not stepper._checker.found_inf(optimizer)  # the kernel's flag: clean


def test_a_share_step_checks_the_held_state_in_the_gradient_checks_own_kernel():
    """A step whose share of the held state (parameters, optimizer state) is not empty checks that share with the
    gradient check's kernel into the check's own flag (one process): no zero made for it, no fold, the kernel twice
    (the gradients', the share's) and nothing else. An inf in the share is still caught: the step skipped, counted as
    no overflow (inf/NaN the gradient check did not put there: nothing blamed on a module)."""
    from lit_mpstable.core.step.step_guard import STATE_SHARES, _shares

    model, stepper, optimizer = tiny_stepper("bf16-mixed", telemetry_every_n_steps=None)
    busy = [index for index, share in enumerate(_shares(optimizer)) if share]
    x, y = regression_data(16)
    target = next(index for index in busy if index > 1)  # after two clean steps: the check reuses its flag
    kernels = []
    for _ in range(target + 1):
        with OpNames() as ops:
            mse_backward(stepper, model, x, y)
            stepper.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        kernels.append([name.split(".")[1] for name in ops.names
                        if name.split(".")[1] in ("zeros", "maximum", "_amp_foreach_non_finite_check_and_unscale_")])
    assert stepper.step_count == target + 1 and stepper.skipped_steps == 0
    assert kernels[target] == ["_amp_foreach_non_finite_check_and_unscale_"] * 2, kernels[target]
    # Corrupt state in the share of the next busy step: caught there, as no overflow.
    step = stepper.counters.applied_by[id(optimizer)]
    following = next(index for index in busy + [b + STATE_SHARES for b in busy] if index >= step % STATE_SHARES)
    for _ in range(following - step % STATE_SHARES):
        mse_backward(stepper, model, x, y)
        stepper.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    param = _shares(optimizer)[following % STATE_SHARES][0]
    optimizer.state[param]["exp_avg"].view(-1)[0] = float("inf")
    mse_backward(stepper, model, x, y)
    stepper.step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    assert stepper.last_step_skipped and stepper.overflow_count == 0 and stepper.skipped_steps == 1
    assert stepper.stats["nonfinite_after_check"] is True and stepper.stats["blamed_modules"] == []

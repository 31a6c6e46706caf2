"""The step path under faults: dropped batches, several optimizers' schedules, NaN that enters after the check."""

from __future__ import annotations

import pytest
import torch
from helpers import HostReads, TinyMLP, regression_data

from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler
from lit_mpstable.core.step.step_guard import STATE_SHARES, held_tensors
from lit_mpstable.core.step.stepper import PrecisionStepper

INF, NAN = float("inf"), float("nan")


def _setup(precision: str, **kwargs):
    torch.manual_seed(0)
    model = TinyMLP()
    if kwargs.get("scaler") == "dynamic-cpu":
        kwargs = {**kwargs, "scaler": DynamicLossScaler("cpu")}
    stepper = PrecisionStepper(precision, **kwargs)
    stepper.setup_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper.setup_optimizers(model, [opt])
    return stepper, model, opt


def _backward(stepper, model, x, y, bad: float | None = None):
    with stepper.forward_context():
        loss = torch.nn.functional.mse_loss(model(stepper.convert_input(x)).float(), y)
    stepper.scale_loss(loss).backward()
    if bad is not None:
        model.fc2.weight.grad.view(-1)[0] = bad


CASES = [("16-mixed", dict(scaler="dynamic-cpu")), ("bf16-true", {}),
         ("bf16-true", dict(master_weights="kahan")), ("16-mixed", {})]


@pytest.mark.parametrize("precision, kwargs", CASES, ids=["scaled", "masters", "kahan", "16-mixed"])
@pytest.mark.parametrize("how", ["unscale", "clip"])
@pytest.mark.parametrize("bad", [None, INF], ids=["clean", "inf"])
def test_a_batch_dropped_after_unscale_leaves_nothing_behind(precision, kwargs, how, bad) -> None:
    x, y = regression_data(32)
    # Reference: the same model, one clean step, no dropped batch before it.
    ref_stepper, ref_model, ref_opt = _setup(precision, **dict(kwargs))
    _backward(ref_stepper, ref_model, x, y)
    ref_stepper.step(ref_opt)
    stepper, model, opt = _setup(precision, **dict(kwargs))
    _backward(stepper, model, x * 3, y, bad)  # a batch the loop drops after looking at its gradients
    stepper.unscale_(opt) if how == "unscale" else stepper.clip_grad_norm_(opt, 0.5)
    opt.zero_grad()
    _backward(stepper, model, x, y)
    stepper.step(opt)
    assert stepper.skipped_steps == 0 and stepper.applied_steps() == 1
    assert stepper.loss_scale == ref_stepper.loss_scale
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# --------------------------------------------------------------------------- the LR hold with several optimizers
def _gan(stepper: PrecisionStepper, steps: int, bad_d: set[int], *, state=None):
    torch.manual_seed(0)
    model = TinyMLP()
    opt_g = torch.optim.SGD([*model.fc2.parameters(), *model.fc3.parameters()], lr=1.0)
    opt_d = torch.optim.SGD(model.fc1.parameters(), lr=1.0)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt_g, opt_d)]
    stepper.setup_module(model)
    stepper.setup_optimizers(model, [opt_g, opt_d], scheds)
    if state is not None:
        stepper.load_state_dict(state)
    x, y = regression_data(32)
    for step in range(steps):
        for opt, bad in ((opt_d, step in bad_d), (opt_g, False)):  # each its own loss, as a GAN
            loss = torch.nn.functional.mse_loss(model(x), y)
            stepper.scale_loss(loss).backward()
            if bad:
                model.fc1.weight.grad.view(-1)[0] = INF
            stepper.step(opt)
            model.zero_grad()
        for sched in scheds:
            sched.step()
    return opt_g, opt_d


def test_each_scheduler_is_held_by_its_own_optimizers_outcome() -> None:
    stepper = PrecisionStepper("32-true")
    opt_g, opt_d = _gan(stepper, 3, {1})
    assert stepper.skipped_steps == 1
    assert opt_g.param_groups[0]["lr"] == 0.5**3  # the generator stepped every time
    assert opt_d.param_groups[0]["lr"] == 0.5**2  # the discriminator's skipped step held its schedule


def test_where_each_scheduler_stands_survives_a_resume() -> None:
    first = PrecisionStepper("32-true")
    _gan(first, 2, set())
    # Resumed in a fresh process (new counters) right after a skipped discriminator step that its scheduler held.
    state = first.state_dict()
    resumed = PrecisionStepper("32-true")
    opt_g, opt_d = _gan(resumed, 2, {0}, state=state)
    assert opt_g.param_groups[0]["lr"] == 0.5**2 and opt_d.param_groups[0]["lr"] == 0.5
    with pytest.raises(ValueError, match="schedules|ints >= 0"):
        PrecisionStepper("32-true").schedules.load_state_dict([-1])


# ------------------------------------------------------------------------- NaN that enters after the gradient check
def _late_nan(stepper, model, opt, where: str) -> None:
    if where == "grad-after-check":  # a hook (on_before_optimizer_step) writes into a gradient after unscale_
        stepper.unscale_(opt)
        next(p for p in opt.param_groups[0]["params"] if p.grad is not None).grad.view(-1)[0] = NAN
    elif where == "clip-norm-nan":  # clipping whose norm came out NaN multiplies every gradient by NaN
        stepper.unscale_(opt)
        for p in opt.param_groups[0]["params"]:
            p.grad.mul_(NAN)
    elif where == "optimizer-state":
        next(iter(opt.state.values()))["exp_avg"].view(-1)[0] = NAN
    elif where == "masters":
        stepper.keeper.masters[0].data.view(-1)[0] = NAN


@pytest.mark.parametrize("precision, where", [
    ("32-true", "grad-after-check"), ("bf16-mixed", "clip-norm-nan"), ("bf16-true", "grad-after-check"),
    ("16-mixed", "grad-after-check"),
])
def test_nan_entering_after_the_check_never_reaches_the_weights_and_blames_no_module(precision, where) -> None:
    torch.manual_seed(0)
    model = TinyMLP()
    stepper = PrecisionStepper(precision)
    stepper.setup_module(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    stepper.setup_optimizers(model, [opt])
    x, y = regression_data(32)
    for step in range(3):
        _backward(stepper, model, x, y)
        if step == 1:
            scale = stepper.loss_scale
            before = [p.detach().clone() for p in model.parameters()]
            _late_nan(stepper, model, opt, where)
        stepper.step(opt)
        opt.zero_grad()
        if step == 1:
            assert stepper.last_step_skipped
            for a, b in zip(model.parameters(), before):
                torch.testing.assert_close(a, b, rtol=0, atol=0)  # nothing was written
            assert stepper.loss_scale == scale  # not the scale's fault: no backoff
            assert stepper.stats["blamed_modules"] == [] and stepper.stats["nonfinite_after_check"]
            # Skipped, but no overflow: nothing a wider precision would fix (PrecisionFallback counts overflows).
            assert stepper.skipped_steps == 1 and stepper.overflow_count == 0
            if stepper.scaler is not None:
                assert stepper.scaler.overflow_count == 0
            assert any("after the gradient check" in w and "not a precision problem" in w for w in stepper.warnings)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("precision, where", [("bf16-true", "optimizer-state"), ("bf16-true", "masters"),
                                              ("bf16-mixed", "optimizer-state"), ("16-mixed", "optimizer-state")])
def test_corrupt_parameters_or_state_are_found_within_a_round_of_shares_and_never_blamed_on_precision(
        precision, where) -> None:
    # Only the step writes the parameters (FP32 masters) and the optimizer state, so they are checked in STATE_SHARES
    # shares, one per applied step. Corrupted between steps (a flipped bit), they are found within a round of shares:
    # by their share, or, if the step wrote the NaN into the weights first, when the next gradients come out
    # non-finite. Either way the skip is no overflow: no module blamed, no backoff, nothing counted as precision.
    torch.manual_seed(0)
    model = TinyMLP()
    stepper = PrecisionStepper(precision)
    stepper.setup_module(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    stepper.setup_optimizers(model, [opt])
    x, y = regression_data(32)
    scale, found = None, None
    for step in range(STATE_SHARES + 3):
        _backward(stepper, model, x, y)
        if step == 1:
            scale = stepper.loss_scale
            _late_nan(stepper, model, opt, where)
        stepper.step(opt)
        opt.zero_grad()
        if step >= 1 and stepper.last_step_skipped:
            found = step
            break
    assert found is not None and found <= 1 + STATE_SHARES, found
    assert stepper.loss_scale == scale  # not the scale's fault: no backoff
    assert stepper.stats["blamed_modules"] == [] and stepper.stats["nonfinite_after_check"]
    assert stepper.skipped_steps == 1 and stepper.overflow_count == 0
    assert any("after the gradient check" in w and "not a precision problem" in w for w in stepper.warnings)


def test_the_shares_cover_every_parameter_and_state_tensor_once_per_round() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(300, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.arange(4)).sum().backward()
    opt.step()
    held = held_tensors(opt)
    assert len(held) == 3 * len(list(model.parameters()))
    shares = [held_tensors(opt, i) for i in range(STATE_SHARES)]
    seen = [id(t) for share in shares for t in share]
    assert sorted(seen) == sorted(id(t) for t in held)  # each tensor in exactly one share
    total = sum(t.numel() for t in held)
    assert max(sum(t.numel() for t in share) for share in shares) <= total / STATE_SHARES + 3 * max(
        t.numel() for t in held)  # about equal shares by size (a parameter and its state go together)


@pytest.mark.parametrize("precision, kwargs", [("16-mixed", {"scaler": "dynamic-cpu"}), ("bf16-true", {}),
                                               ("bf16-mixed", {}), ("bf16-true", {"master_weights": "kahan"})])
def test_the_step_input_check_adds_no_host_read(precision, kwargs) -> None:
    stepper, model, opt = _setup(precision, **kwargs)
    x, y = regression_data(32)
    for _ in range(2):
        _backward(stepper, model, x, y)
        with HostReads() as reads:
            stepper.step(opt)
        opt.zero_grad()
    assert reads.ops == ["_local_scalar_dense"]  # GradScaler's one skip decision (SGD reads nothing itself)


@pytest.mark.parametrize("where", ["grad-after-check", "gradient-check"])
def test_a_fused_optimizer_skips_on_the_folded_flag_too(where: str) -> None:
    # Fused optimizers skip inside their step only when found_inf is exactly 1: the folded flag must stay 0 or 1.
    torch.manual_seed(0)
    model = TinyMLP()
    stepper = PrecisionStepper("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=256.0))
    stepper.setup_module(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    stepper.setup_optimizers(model, [opt])
    x, y = regression_data(32)
    for step in range(3):
        _backward(stepper, model, x, y, bad=INF if step == 1 and where == "gradient-check" else None)
        if step == 1 and where == "grad-after-check":
            stepper.unscale_(opt)
            model.fc2.weight.grad.view(-1)[0] = NAN
        stepper.step(opt)
        opt.zero_grad()
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert all(torch.isfinite(v).all() for s in opt.state.values() for v in s.values())
    assert stepper.skipped_steps == 1


def test_a_nan_loss_scale_is_skipped_and_repaired_not_kept() -> None:
    stepper, model, opt = _setup("16-mixed", scaler="dynamic-cpu")
    x, y = regression_data(32)
    for step in range(3):
        _backward(stepper, model, x, y)
        if step == 1:
            before = [p.detach().clone() for p in model.parameters()]
            stepper.scaler.get_scale_tensor().fill_(NAN)  # the scale itself goes bad after backward
        stepper.step(opt)
        opt.zero_grad()
        if step == 1:
            assert stepper.last_step_skipped and stepper.stats["nonfinite_after_check"]
            for a, b in zip(model.parameters(), before):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert stepper.loss_scale == 2.0**16 and stepper.skipped_steps == 1  # back at init_scale; the next step applied
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_backward_after_unscale_without_zero_grad_drops_the_unscaled_batch_and_says_so() -> None:
    x, y = regression_data(32)
    ref_stepper, ref_model, ref_opt = _setup("16-mixed")
    _backward(ref_stepper, ref_model, x, y)
    ref_stepper.step(ref_opt)
    stepper, model, opt = _setup("16-mixed")
    _backward(stepper, model, x * 3, y)
    stepper.unscale_(opt)  # ... and neither step() nor zero_grad(): unscaled gradients would meet scaled ones
    _backward(stepper, model, x, y)
    stepper.step(opt)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any("without a step()" in w for w in stepper.warnings)


def test_a_checkpoint_holds_the_scale_update_a_gan_loop_still_owes() -> None:
    # Each loss's backward also fills the other optimizer's gradients (zeroed only before its own backward), so the
    # update waits for the next backward; a checkpoint taken meanwhile holds it, as GradScaler's would.
    torch.manual_seed(0)
    model = TinyMLP()
    stepper = PrecisionStepper("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=256.0))
    stepper.setup_module(model)
    opt_d = torch.optim.SGD(model.fc1.parameters(), lr=0.1)
    opt_g = torch.optim.SGD([*model.fc2.parameters(), *model.fc3.parameters()], lr=0.1)
    stepper.setup_optimizers(model, [opt_d, opt_g])
    x, y = regression_data(32)
    scales = []
    for step in range(3):
        for opt in (opt_d, opt_g):
            opt.zero_grad()
            _backward(stepper, model, x, y)
            if step == 1 and opt is opt_d:
                model.fc1.weight.grad.view(-1)[0] = INF
            stepper.step(opt)
            scales.append(stepper.state_dict()["scaler"]["scale"])
    assert stepper.overflow_count == 1
    assert scales == [256.0, 256.0, 128.0, 128.0, 128.0, 128.0]


@pytest.mark.slow
def test_a_trainer_gan_holds_only_the_skipped_discriminators_schedule() -> None:
    from helpers import make_trainer
    from trainer_pkg import StablePrecision, pl

    class Gan(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.model = TinyMLP()
            self.x, self.y = regression_data(32)

        def training_step(self, batch, batch_idx):
            opt_g, opt_d = self.optimizers()
            for opt, poison in ((opt_d, batch_idx == 1), (opt_g, False)):
                self.toggle_optimizer(opt)
                loss = torch.nn.functional.mse_loss(self.model(batch[0]), batch[1])
                self.manual_backward(loss)
                if poison:
                    self.model.fc1.weight.grad.view(-1)[0] = INF
                opt.step()
                opt.zero_grad()
                self.untoggle_optimizer(opt)
            for sched in self.lr_schedulers():
                sched.step()

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=8)

        def configure_optimizers(self):
            opt_g = torch.optim.SGD([*self.model.fc2.parameters(), *self.model.fc3.parameters()], lr=1.0)
            opt_d = torch.optim.SGD(self.model.fc1.parameters(), lr=1.0)
            scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt_g, opt_d)]
            return [opt_g, opt_d], scheds

    module = Gan()
    plugin = StablePrecision("32-true")
    make_trainer(plugin, max_epochs=1, max_steps=-1).fit(module)
    opt_g, opt_d = module.optimizers()
    assert plugin.skipped_steps == 1
    assert opt_g.param_groups[0]["lr"] == 0.5**4 and opt_d.param_groups[0]["lr"] == 0.5**3


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-true"])
def test_a_fabric_loop_that_drops_a_batch_after_clipping_steps_the_next_one_exactly(precision: str) -> None:
    import warnings

    from lightning.fabric import Fabric

    from lit_mpstable.frontends.fabric import StablePrecision

    def run(drop: bool):
        plugin = StablePrecision(precision)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        torch.manual_seed(0)
        model, opt = fabric.setup(TinyMLP(), torch.optim.SGD(TinyMLP().parameters(), lr=0.1))
        opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = regression_data(32)
        for batch, dropped in (((x * 3, y), True), ((x, y), False)):
            if dropped and not drop:
                continue
            loss = torch.nn.functional.mse_loss(model(batch[0]).float(), batch[1])
            fabric.backward(loss)
            fabric.clip_gradients(model, opt, max_norm=0.5)
            if dropped:  # the loop looked at the clipped gradients and dropped the batch
                opt.zero_grad()
                continue
            opt.step()
            opt.zero_grad()
        return plugin, [p.detach().clone() for p in model.parameters()]

    plugin, params = run(drop=True)
    _, ref = run(drop=False)
    assert plugin.skipped_steps == 0 and plugin.step_count == 1
    for a, b in zip(params, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_gradients_an_optimizer_stepped_on_are_not_kept_alive() -> None:
    import gc
    import weakref

    torch.manual_seed(0)
    model = TinyMLP()
    stepper = PrecisionStepper("32-true")
    stepper.setup_module(model)
    opts = [torch.optim.SGD(model.fc1.parameters(), lr=0.1), torch.optim.SGD(model.fc2.parameters(), lr=0.1)]
    stepper.setup_optimizers(model, opts)
    x, y = regression_data(32)
    _backward(stepper, model, x, y)
    grad = weakref.ref(model.fc1.weight.grad)
    for opt in opts:
        stepper.step(opt)
    model.zero_grad(set_to_none=True)
    gc.collect()
    assert grad() is None


def _late_nan_worker(rank: int, init_file: str, out_dir: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        _late_nan_run(rank, out_dir)  # its DDP wrapper is freed before the group is: gloo's threads then stop cleanly
    finally:
        dist.destroy_process_group()


def _late_nan_run(rank: int, out_dir: str) -> None:
    from pathlib import Path

    torch.manual_seed(0)
    model = TinyMLP()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    stepper = PrecisionStepper("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=256.0))
    stepper.setup_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    stepper.setup_optimizers(model, [opt])
    x, y = regression_data(32)
    skipped = []
    for step in range(3):
        stepper.scale_loss(torch.nn.functional.mse_loss(ddp(x[rank::2]), y[rank::2])).backward()
        stepper.unscale_(opt)
        if rank == 1 and step == 1:  # a hook on one rank writes NaN after the (agreed) gradient check
            model.fc2.weight.grad.view(-1)[0] = NAN
        stepper.step(opt)
        opt.zero_grad()
        skipped.append(stepper.last_step_skipped)
    torch.save({"skipped": skipped, "params": [p.detach().clone() for p in model.parameters()]},
               Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
def test_nan_written_after_the_check_on_one_rank_skips_the_step_on_every_rank(tmp_path) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_late_nan_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="fork")
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert rank0["skipped"] == rank1["skipped"] == [False, True, False]
    for a, b in zip(rank0["params"], rank1["params"]):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ----------------------------------------------------------------- clipping reads the gradients once with a guard
class _GradReads(torch.utils._python_dispatch.TorchDispatchMode):
    """The gradient tensors each norm and each inf/NaN-check kernel reads (by storage), per kind."""

    def __init__(self, grads) -> None:
        super().__init__()
        self.grads = {g.untyped_storage().data_ptr() for g in grads}
        self.norm: list[int] = []
        self.check: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        first = args[0] if args else None
        tensors = first if isinstance(first, (list, tuple)) else [first]
        read = [t for t in tensors if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.grads]
        if name in ("linalg_vector_norm", "_foreach_norm", "norm"):
            self.norm += [id(t) for t in read]
        elif name == "_amp_foreach_non_finite_check_and_unscale_":
            self.check += [id(t) for t in read]
        return func(*args, **(kwargs or {}))


def _guarded(precision: str, **kwargs):
    from lit_mpstable.core.guards.spike import SpikeGuard

    return _setup(precision, spike_guard=SpikeGuard(warmup=2), **kwargs)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true-masters"])
def test_clipping_with_a_guard_reuses_its_norm_and_the_check_does_not_read_the_clipped_gradients(precision) -> None:
    stepper, model, opt = (_guarded("bf16-true", master_weights=True) if precision == "bf16-true-masters"
                           else _guarded(precision))
    x, y = regression_data(32)
    for _ in range(3):
        _backward(stepper, model, x, y)
        stepper.unscale_(opt)
        grads = [p.grad for g in opt.param_groups for p in g["params"]]
        # The independent expectation: torch's own clip_grad_norm_ (its own norm) on copies of the same gradients.
        reference = [_with_grad(g.detach().clone()) for g in grads]
        norm = torch.nn.utils.clip_grad_norm_(reference, 0.1)
        with _GradReads(grads) as reads:
            returned = stepper.clip_grad_norm_(opt, 0.1)
            clipped = [g.detach().clone() for g in grads]
            stepper.step(opt)
        opt.zero_grad()
        assert reads.norm == []  # the guard's norm of the same gradients, not a second read
        assert reads.check == []  # clipped by a finite limit: the step-input check reads parameters and state only
        assert not stepper.last_step_skipped
        assert torch.allclose(returned, norm, rtol=1e-5)
        for got, want in zip(clipped, reference):
            assert torch.allclose(got, want.grad, rtol=1e-5, atol=1e-7)


def _with_grad(grad: torch.Tensor) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.empty_like(grad))
    p.grad = grad
    return p


def test_a_gradient_written_after_the_check_gets_a_fresh_norm_and_a_fresh_check() -> None:
    stepper, model, opt = _guarded("bf16-mixed")
    x, y = regression_data(32)
    _backward(stepper, model, x, y)
    stepper.unscale_(opt)
    model.fc2.weight.grad.mul_(3.0)  # a hook on_before_optimizer_step scales one gradient
    grads = [p.grad for g in opt.param_groups for p in g["params"]]
    want = torch.nn.utils.get_total_norm([g.detach().clone() for g in grads])
    with _GradReads(grads) as reads:
        norm = stepper.clip_grad_norm_(opt, 0.1)
    assert len(reads.norm) == len(grads)  # computed again, over every gradient
    assert torch.allclose(norm, want, rtol=1e-5)


def test_zclip_alone_with_an_infinite_norm_still_rechecks_the_clipped_gradients() -> None:
    # Finite gradients whose FP32 norm overflows: ZClip alone clips to an infinite limit in its warmup, and inf / inf
    # is NaN, so the clipped gradients are NaN. The step-input check must read them again and skip the step.
    from lit_mpstable.core.guards.spike import SpikeGuard

    stepper, model, opt = _setup("32-true", spike_guard=SpikeGuard(clip_zscore=2.5))
    x, y = regression_data(32)
    _backward(stepper, model, x, y)
    for p in model.parameters():
        p.grad.fill_(1e30)  # finite; their squares are not
    before = [p.detach().clone() for p in model.parameters()]
    stepper.step(opt)
    assert stepper.last_step_skipped
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize("call", ["clip_grad_norm_", "clip_grad_value_", "unscale_"])
def test_clipping_before_any_loss_was_scaled_names_the_call_order(call: str) -> None:
    # An optimizer that unscales itself (or a loop that clips first) in 16-mixed: GradScaler's own assertion ("_scale
    # is None") said nothing of what to do.
    model = TinyMLP()
    stepper = PrecisionStepper("16-mixed", device="cpu")
    stepper.setup_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper.setup_optimizers(model, [optimizer])
    x, y = regression_data(8)
    torch.nn.functional.mse_loss(model(x).float(), y).backward()  # not through scale_loss
    args = {"clip_grad_norm_": (1.0,), "clip_grad_value_": (1.0,), "unscale_": ()}[call]
    with pytest.raises(RuntimeError, match=r"SGD.*before any loss was scaled.*scale_loss\(loss\)\.backward\(\).*then"
                                           r" clipping, then the optimizer step"):
        getattr(stepper, call)(optimizer, *args)


# ------------------------------------------------------------------------------------------------ buffers
class BatchNormMLP(torch.nn.Module):
    """TinyMLP's shape with a BatchNorm between fc1 and fc2: running statistics change in every training forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _bn_setup(precision: str):
    torch.manual_seed(0)
    model = BatchNormMLP()
    stepper = PrecisionStepper(precision, device="cpu")
    stepper.setup_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper.setup_optimizers(model, [opt])
    return stepper, model, opt


def _buffers(model) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true"])
@pytest.mark.parametrize("how", ["nan_batch", "skip_step"])
def test_a_skipped_step_leaves_the_buffers_as_the_step_before_left_them(precision, how) -> None:
    stepper, model, opt = _bn_setup(precision)
    x, y = regression_data(32)
    for step, batch in enumerate((x[:16], x[16:] * 3, x[:16])):
        before = _buffers(model)
        bad = step == 1
        if bad and how == "nan_batch":
            batch = batch.clone()
            batch[0, 0] = NAN
        opt.zero_grad(set_to_none=True)
        with stepper.forward_context():
            loss = torch.nn.functional.mse_loss(model(stepper.convert_input(batch)).float(), y[:16])
        if bad and how == "skip_step":
            stepper.skip_step()
        stepper.scale_loss(loss).backward()
        stepper.step(opt)
        assert stepper.last_step_skipped == bad
        after = _buffers(model)
        for name, value in before.items():
            changed = not torch.equal(after[name], value)
            assert changed != bad, (step, name)  # a clean step updates the statistics, a skipped one leaves them
    assert int(model.bn.num_batches_tracked) == 2 and torch.isfinite(model.bn.running_var).all()
    model.eval()
    assert torch.isfinite(model(stepper.convert_input(x))).all()


def test_a_model_without_changing_buffers_keeps_no_copy_after_its_first_step() -> None:
    # A buffer no forward writes (a mask, a cache) is copied on the first step only; a model without buffers never.
    stepper, model, opt = _setup("32-true")
    model.register_buffer("mask", torch.ones(16))
    x, y = regression_data(32)
    copies = []
    for _ in range(3):
        opt.zero_grad()
        _backward(stepper, model, x, y)
        copies.append(stepper.step_buffers.copied)
        stepper.step(opt)
    assert copies == [1, 0, 0]

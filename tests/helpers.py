"""Small models, data and fault injection shared by the tests."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from lit_mpstable.app.demos import stall_task  # noqa: F401  (the stall case; bench/ uses it too)
from lit_mpstable.app.fault_demos import TinyMLP, regression_data  # the model and data the tests train; bench/ too


def inject_overflow(module: nn.Module, steps: Iterable[int], value: float = float("inf")) -> list[int]:
    """Make the gradient of ``module.weight`` hold ``value`` on the given backward calls (0-based).

    Returns a list that records the backward calls seen, so a test can check where it fired.
    """
    steps = set(steps)
    seen: list[int] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        call = len(seen)
        seen.append(call)
        if call in steps:
            grad = grad.clone()
            grad.view(-1)[0] = value
        return grad

    module.weight.register_hook(hook)
    return seen


def make_module(**kwargs):
    """A TinyModule (LightningModule) built lazily so core tests never import Lightning through this file."""
    from trainer_pkg import pl

    class TinyModule(pl.LightningModule):
        """TinyMLP on `regression_data`; options: lr, optimizer ("sgd", "adamw", "adamw_fused"), scheduler (bool),
        poison_steps (optimizer steps whose fc2 gradient gets an inf)."""

        def __init__(
            self, lr: float = 0.05, optimizer: str = "sgd", scheduler: bool = False, n: int = 64,
            poison_steps: Iterable[int] = (),
        ) -> None:
            super().__init__()
            self.model = TinyMLP()
            self.lr, self.optimizer_name, self.use_scheduler = lr, optimizer, scheduler
            self.poison_steps = set(poison_steps)
            self.x, self.y = regression_data(n)
            self.losses: list[float] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self(x).float(), y)
            self.losses.append(loss.item())
            return loss

        def on_after_backward(self) -> None:
            # Fault injection keyed on the optimizer step, so a resumed run poisons the same steps.
            if self.trainer.global_step in self.poison_steps:
                self.model.fc2.weight.grad.view(-1)[0] = float("inf")

        def train_dataloader(self):
            ds = torch.utils.data.TensorDataset(self.x, self.y)
            return torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False)

        def configure_optimizers(self):
            if self.optimizer_name == "sgd":
                opt = torch.optim.SGD(self.parameters(), lr=self.lr)
            else:
                opt = torch.optim.AdamW(self.parameters(), lr=self.lr, fused=self.optimizer_name == "adamw_fused")
            if not self.use_scheduler:
                return opt
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return TinyModule(**kwargs)


def make_trainer(plugin=None, **kwargs):
    """A quiet CPU Trainer: no progress bar, summary, logger or checkpointing unless asked."""
    from trainer_pkg import pl

    defaults = dict(
        accelerator="cpu", devices=1, max_steps=4, enable_progress_bar=False, enable_model_summary=False,
        logger=False, enable_checkpointing=False, num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return pl.Trainer(plugins=[plugin] if plugin is not None else None, **defaults)


def compiles_like_eager(make: Callable[[], nn.Module], x: torch.Tensor, dy: torch.Tensor, *,
                        input_grad: bool = True) -> nn.Module:
    """``make()`` compiled (fullgraph) has no graph break and matches a fresh eager ``make()``: output, weight gradient
    and (``input_grad``) input gradient. Returns the compiled layer, after its one forward and backward."""
    import torch._dynamo

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(make())(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    eager, compiled = make(), make()
    fn = torch.compile(compiled, fullgraph=True)
    xe, xc = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    eager(xe).backward(dy)
    out = fn(xc)
    out.backward(dy)
    torch.testing.assert_close(out, eager(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled.weight.grad, eager.weight.grad, rtol=1e-4, atol=1e-4)
    if input_grad:
        torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-4, atol=1e-4)
    return compiled


class GradReads(torch.utils._python_dispatch.TorchDispatchMode):
    """The multi-tensor kernels run inside the block, with the tensors they read (by identity): ``_foreach_norm`` and
    GradScaler's check-and-unscale. :meth:`over` names those that read any of the given gradients."""

    _KERNELS = ("_foreach_norm", "_amp_foreach_non_finite_check_and_unscale_")

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, set[int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self._KERNELS:
            self.calls.append((name, {id(t) for t in args[0]}))
        return func(*args, **(kwargs or {}))

    def over(self, grads: list[torch.Tensor | None]) -> list[str]:
        ids = {id(g) for g in grads if g is not None}
        return [name for name, read in self.calls if read & ids]


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every operation that needs a tensor's value on the host: on an accelerator each one waits for the
    device (a host sync). ``.item()``, ``float()``/``int()``/``bool()`` and ``if tensor:`` (all through
    ``_local_scalar_dense`` or ``is_nonzero``), ``torch.equal``, data-dependent shapes (``nonzero``,
    ``masked_select``, ``unique``, indexing by a boolean mask...) and ``tolist()``/``numpy()`` (not dispatched:
    patched for the duration).
    On a CPU-only run it cannot see a device-to-host copy (``.cpu()`` of a CPU tensor does nothing), so it checks
    what code decides from tensor values, not where tensors live.

        with HostReads() as reads:
            step()
        assert reads.ops == []
    """

    _READS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "nonzero_static", "masked_select", "unique",
              "_unique", "_unique2", "unique_dim", "unique_consecutive", "bincount", "repeat_interleave", "item"}

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self._patched: list[tuple[str, object]] = []

    def __enter__(self):
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)
            self._patched.append((name, original))

            def patched(tensor, *args, _name=name, _original=original, **kwargs):
                self.ops.append(_name)
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, patched)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched:
            setattr(torch.Tensor, name, original)
        self._patched = []
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self._READS:
            self.ops.append(name)
        elif name.startswith(("index", "_index_put")) and len(args) > 1 and isinstance(args[1], (list, tuple)) and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        ):
            self.ops.append(f"{name} by a mask")  # t[mask]: the result's size depends on the values
        return func(*args, **(kwargs or {}))


def tiny_stepper(precision: str = "bf16-true", *, seed: int = 0, lr: float = 1e-2, **kwargs):
    """TinyMLP (made after ``torch.manual_seed(seed)``) set up through ``PrecisionStepper(precision, **kwargs)`` with
    AdamW(lr): ``(model, stepper, optimizer)``."""
    from lit_mpstable.core.step.stepper import PrecisionStepper

    torch.manual_seed(seed)
    model = TinyMLP()
    stepper = PrecisionStepper(precision, **kwargs)
    stepper.setup_module(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    stepper.setup_optimizers(model, [optimizer])
    return model, stepper, optimizer


def mse_backward(stepper, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """A forward in the stepper's context and the scaled backward of its MSE loss against ``y``."""
    with stepper.forward_context():
        loss = nn.functional.mse_loss(model(stepper.convert_input(x)).float(), y)
    stepper.scale_loss(loss).backward()


def quiet_fabric(plugin):
    """A one-device CPU Fabric with ``plugin``, its FP16-on-the-CPU warning silenced."""
    import warnings

    from lightning.fabric import Fabric

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FP16 on the CPU, said once
        return Fabric(accelerator="cpu", devices=1, plugins=[plugin])


def fabric_backward(fabric, model: nn.Module, step: int = 0, scale: float = 1.0) -> None:
    """``fabric.backward`` of the MSE loss of batch ``step % 4`` (16 rows) of ``regression_data(64)`` x ``scale``."""
    x, y = regression_data(64)
    batch = slice(16 * (step % 4), 16 * (step % 4 + 1))
    fabric.backward(scale * nn.functional.mse_loss(model(x[batch]), y[batch]))


class OpNames(torch.utils._python_dispatch.TorchDispatchMode):
    """The names of the tensor operations dispatched inside the block, in order (``.names``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def spawn_ranks(worker, init_file: str, out_dir: str, *, nprocs: int = 2, limit_s: float = 240.0) -> None:
    """``worker(rank, init_file, out_dir)`` on ``nprocs`` spawned processes (not forked: a fork could copy a lock that
    another thread holds, e.g. inductor's workers after a compile), rendezvous through ``init_file``. A rank still
    running after ``limit_s`` is killed and the test fails, naming it; a rank's error is raised."""
    import time

    import pytest
    import torch.multiprocessing as mp

    context = mp.start_processes(worker, args=(init_file, out_dir), nprocs=nprocs, start_method="spawn", join=False)
    deadline = time.monotonic() + limit_s
    while not context.join(timeout=max(deadline - time.monotonic(), 0.0)):
        if time.monotonic() >= deadline:
            alive = [rank for rank, process in enumerate(context.processes) if process.is_alive()]
            for rank in alive:
                context.processes[rank].kill()
                context.processes[rank].join()
            pytest.fail(f"ranks {alive} still running after {limit_s} s (killed): a rank waits in a collective the"
                        " other never joins, or never started")

"""Two-process CPU runs (gloo) for the distributed tests: faults on one rank only, and per-rank results on disk.

The runs fork (the children inherit the imports: ~0.2 s a run instead of ~5 s with spawn); everything they run
lives here at module level, so spawning works too.
"""

from __future__ import annotations

import gc
import os
import socket
from collections.abc import Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from helpers import TinyMLP, regression_data
from torch import nn
from torch.distributed.tensor import DTensor

from lit_mpstable.core.scaling.adaptive_scaler import AdaptiveLossScaler
from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler

WORLD_SIZE = 2
# A collective that one rank never joins (ranks deciding differently) fails after this instead of hanging for 30 min.
TIMEOUT = timedelta(seconds=60)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_ranks(out_dir: Path) -> list[dict[str, Any]]:
    """What each rank wrote, in rank order."""
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]


def assert_same_state(a, b, where: str = "") -> None:
    """``a`` and ``b`` (nested dicts, lists, tensors, numbers) are equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_same_state(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}/{i}")
    else:
        assert a == b, (where, a, b)


# Every weight mode: (master_weights, optimizer_state, AdamW or SGD with momentum); compact weights with SGD (the
# fused Adam step would compile in every rank) and BF16/FP8 moments with AdamW (they need it).
WEIGHT_MODES = [(False, "fp32", False), (True, "fp32", True), (True, "bf16", True), (True, "fp8", True),
                ("kahan", "fp32", False), ("kahan", "bf16", True), ("stochastic", "fp32", False),
                ("stochastic", "fp8", True)]
MODE_IDS = [f"{m}-{s}" for m, s, _ in WEIGHT_MODES]


# ------------------------------------------------------------------------------------- plain PyTorch + gloo
def _loop(
    rank: int, scaler: DynamicLossScaler, *, sync: bool, inf_step: int, big_step: int | None
) -> dict[str, Any]:
    """DDP on TinyMLP, 4 steps; rank 1 only gets an inf gradient at ``inf_step`` and a large finite one at
    ``big_step``, both written after backward (after DDP's gradient all-reduce)."""
    torch.manual_seed(0)
    model = TinyMLP()
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = regression_data(32)
    x, y = x[rank::WORLD_SIZE], y[rank::WORLD_SIZE]
    skipped, scales = [], []
    for step in range(4):
        optimizer.zero_grad()
        scaler.scale(nn.functional.mse_loss(ddp(x), y)).backward()
        if rank == 1 and step in (inf_step, big_step):
            value = float("inf") if step == inf_step else 1e3 * scaler.get_scale()  # still scaled here
            model.fc2.weight.grad.view(-1)[0] = value
        scaler.unscale_(optimizer)
        if sync:
            scaler.sync_found_inf_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        skipped.append(scaler.last_step_skipped)
        scales.append(scaler.get_scale())
    return {"skipped": skipped, "scales": scales, "overflow_count": scaler.overflow_count,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def scaler_worker(rank: int, init_file: str, out_dir: str) -> None:
    """torch.multiprocessing target: each scaler with and without ``sync_found_inf_``; results to ``rank{r}.pt``."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE, timeout=TIMEOUT
    )
    try:
        results = {}
        # The large finite gradient only for the adaptive scaler: it changes the weights of one rank anyway.
        for name, cls, big_step in (("dynamic", DynamicLossScaler, None), ("adaptive", AdaptiveLossScaler, 2)):
            for sync in (True, False):
                scaler = cls("cpu", init_scale=2.0**8)
                results[name, sync] = _loop(rank, scaler, sync=sync, inf_step=1, big_step=big_step)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def replicas_worker(rank: int, init_file: str, out_dir: str) -> None:
    """torch.multiprocessing target: a plain DDP loop on a ``PrecisionStepper`` in every one of :data:`WEIGHT_MODES`,
    each rank's model built from its own seed; per mode the weights and the keeper's state to ``rank{r}.pt``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE,
                            timeout=TIMEOUT)
    try:
        results = {mode: _replica_run(rank, *mode) for mode in WEIGHT_MODES}
        gc.collect()  # the DDP wrappers before the process group (see layout_worker)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _replica_run(rank: int, master_weights: Any, optimizer_state: str, adam: bool) -> dict[str, Any]:
    from lit_mpstable.core.step.stepper import PrecisionStepper

    torch.manual_seed(100 + rank)
    model = TinyMLP()
    stepper = PrecisionStepper("bf16-true", master_weights=master_weights, optimizer_state=optimizer_state,
                               device="cpu")
    stepper.setup_module(model)
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-2) if adam
                 else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    stepper.setup_optimizers(model, [optimizer])
    ddp = nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's 16-bit weights
    stepper.follow_model_weights_(ddp.process_group)  # and the keeper's state beside them
    x, y = regression_data(32)
    x, y = x[rank::WORLD_SIZE], y[rank::WORLD_SIZE]
    for step in range(3):
        rows = slice(4 * step, 4 * step + 4)
        with stepper.forward_context():
            loss = nn.functional.mse_loss(ddp(stepper.convert_input(x[rows])).float(), y[rows])
        stepper.scale_loss(loss).backward()
        stepper.step(optimizer)
        optimizer.zero_grad()
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "keeper": stepper.keeper.state_dict(), "steps": stepper.step_count}


# ----------------------------------------------------------------------------------------------- Lightning
class RankFaultModule(pl.LightningModule):
    """TinyMLP regression with faults on ``fault_rank`` only, keyed on the optimizer step.

    Args:
        inf_grad_steps: fc2's weight gradient gets an inf in ``on_after_backward`` of the step's last micro-batch
            (after DDP's all-reduce; earlier micro-batches run under ``no_sync``).
        big_grad_steps: the same, with a finite gradient of 1e3 (unscaled): a larger amax on that rank only.
        loss_factor: ``{step: factor}``: that rank's loss is multiplied by ``factor`` (a loss spike).
        batch_by_step: train on the batch the optimizer step picks, not the one the loader hands over: rank r's k-th
            step takes 8 of the samples r, r+2, ... from ``8 * (k % 4)``, so both ranks together take samples
            ``16 (k % 4) ...`` (independent of Lightning's shuffling sampler, its seed, and how a resume replays it).
    """

    def __init__(
        self, *, fault_rank: int = 1, inf_grad_steps: Iterable[int] = (), big_grad_steps: Iterable[int] = (),
        loss_factor: Mapping[int, float] | None = None, batch_by_step: bool = False,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyMLP()
        self.fault_rank = fault_rank
        self.inf_grad_steps, self.big_grad_steps = set(inf_grad_steps), set(big_grad_steps)
        self.loss_factor = dict(loss_factor or {})
        self.x, self.y = regression_data(64)
        self.batch_idx = -1
        self.batch_by_step = batch_by_step

    def _faulty(self, steps: Iterable[int]) -> bool:
        return self.global_rank == self.fault_rank and self.global_step in steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.batch_by_step:
            rows = slice(self.global_rank + 16 * (self.global_step % 4), None, WORLD_SIZE)
            x, y = (self.trainer.precision_plugin.convert_input(t[rows][:8]) for t in (self.x, self.y))
        self.batch_idx = batch_idx
        loss = nn.functional.mse_loss(self(x).float(), y)
        return loss * self.loss_factor.get(self.global_step, 1.0) if self._faulty(self.loss_factor) else loss

    def on_after_backward(self) -> None:
        grad = self.model.fc2.weight.grad
        grad = grad.to_local() if isinstance(grad, DTensor) else grad  # FSDP2: this rank's shard
        if (self.batch_idx + 1) % self.trainer.accumulate_grad_batches:
            return  # not the last micro-batch
        if self._faulty(self.inf_grad_steps):
            grad.view(-1)[0] = float("inf")
        elif self._faulty(self.big_grad_steps):
            grad.view(-1)[0] = 1e3 * self.trainer.precision_plugin.loss_scale  # gradients are still scaled here

    def train_dataloader(self):
        dataset = torch.utils.data.TensorDataset(self.x, self.y)
        return torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class UnseededModule(RankFaultModule):
    """:class:`RankFaultModule` initialised and seeded per rank, as ranks launched without ``seed_everything`` (or
    with per-rank seeds, as nanoGPT seeds) are: ``setup`` seeds torch with ``100 + rank`` and builds the model again.
    ``adam``: AdamW (BF16/FP8 moments need it), else SGD with momentum. Each rank trains on its own half of the data.
    """

    def __init__(self, adam: bool) -> None:
        super().__init__(batch_by_step=True)
        self.adam = adam

    def setup(self, stage: str) -> None:
        torch.manual_seed(100 + self.global_rank)
        self.model = TinyMLP()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2) if self.adam else super().configure_optimizers()


class ShardedFaultModule(RankFaultModule):
    """:class:`RankFaultModule` with every linear layer and the model sharded by FSDP2 (``fully_shard``).

    Args:
        convert_first: call ``plugin.convert_module(self)`` before sharding (the documented way: FP8 layers and
            islands exist before ``fully_shard``).
        policy: ``"plugin"``: ``plugin.mp_policy`` for every unit and ``plugin.island_mp_policy`` for the islands;
            ``None``: FSDP2's default (no mixed precision); or a ``MixedPrecisionPolicy`` for every unit.
        units: the layers sharded as their own units before the root ``model``.
        forward_inf_steps: fc2's output turns inf on ``fault_rank`` at these steps (a module to blame).
        all_gather_fp8: ``lit_mpstable.core.layout.fsdp.fp8_all_gather_`` between the FP8 swap and ``fully_shard``
        (torchao).
    """

    def __init__(self, *, convert_first: bool = False, policy: Any = None,
                 units: Iterable[str] = ("model.fc1", "model.fc2", "model.fc3"), forward_inf_steps: Iterable[int] = (),
                 all_gather_fp8: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.convert_first, self.policy, self.units = convert_first, policy, tuple(units)
        self.all_gather_fp8, self.gathered_fp8 = all_gather_fp8, []
        self.forward_inf_steps = set(forward_inf_steps)
        self.seen_dtypes: set[torch.dtype] = set()
        """The dtypes fc2's weight had inside its forward (FSDP2's unsharded parameter: what it computed in)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        plugin = self.trainer.precision_plugin
        if self.convert_first:
            plugin.convert_module(self)
        if self.all_gather_fp8:
            from lit_mpstable.core.layout.fsdp import fp8_all_gather_

            self.gathered_fp8 = fp8_all_gather_(self)
        islands = set(plugin.islands.names) if hasattr(plugin, "islands") else set()

        def policy(name: str) -> MixedPrecisionPolicy:
            if self.policy == "plugin":
                return plugin.island_mp_policy if name in islands else plugin.mp_policy
            return self.policy or MixedPrecisionPolicy()

        mesh = self.device_mesh["data_parallel"]
        for name in self.units:
            fully_shard(self.get_submodule(name), mesh=mesh, mp_policy=policy(name))
        fully_shard(self.model, mesh=mesh, mp_policy=policy("model"))
        self.fc2_shard_type = type(self.model.fc2.weight.to_local()).__name__  # what FSDP2 all-gathers
        # After fully_shard: FSDP2's own hooks run first (the unshard before, the output cast after).
        self.model.fc2.register_forward_pre_hook(lambda module, args: self.seen_dtypes.add(module.weight.dtype))
        self.model.fc2.register_forward_hook(self._forward_fault)

    def _forward_fault(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        """fc2's output overflows (inf) on ``fault_rank`` at ``forward_inf_steps``: the module to blame."""
        return output * float("inf") if self._faulty(self.forward_inf_steps) else None


def forward_off_on_rank1(module: pl.LightningModule, batch: Any) -> torch.Tensor:
    """An ``AMPPreflight`` forward whose low-precision output is off by 1 on rank 1 only."""
    output = module(batch[0])
    return output + 1.0 if module.global_rank == 1 and torch.is_autocast_enabled("cpu") else output


def low_precision_off_on_rank1(module: pl.LightningModule, batch: Any) -> torch.Tensor:
    """An ``AMPPreflight`` forward whose 16-bit output (autocast or ``*-true``) is off by 1 on rank 1 only."""
    output = module(batch[0])
    low = torch.is_autocast_enabled("cpu") or output.dtype != torch.float32
    return output + 1.0 if module.global_rank == 1 and low else output


class RankReport(pl.Callback):
    """Per step: loss scale and skip flag; at the end, weights, plugin state and every callback's decisions, written
    to ``out_dir/rank{global_rank}.pt``. List it last."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = str(out_dir)
        self.scales: list[float] = []
        self.skipped: list[bool] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        torch.set_num_threads(1)  # as conftest does; a spawned process would start with the machine's default

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        plugin = trainer.precision_plugin
        self.scales.append(plugin.loss_scale)
        self.skipped.append(plugin.last_step_skipped)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plugin = trainer.precision_plugin
        report = {
            "world_size": trainer.world_size,
            "scales": self.scales,
            "skipped": self.skipped,
            # Sharded weights gathered whole (a collective: every rank reaches this hook).
            "params": {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                       for k, v in pl_module.state_dict().items()},
            # Our FP32 masters where there are (DDP *-true); FSDP2's are the parameters themselves.
            "masters": {name: master.detach().clone() for name, master, _ in plugin.master.named_pairs()}
            if getattr(plugin, "master", None) is not None else {},
            # What the weight keeper saves: masters, compensation, the rounding seeds, BF16/FP8 moments.
            "keeper": plugin.stepper.keeper.state_dict() if hasattr(plugin, "stepper") else {},
            "param_dtypes": {name: p.dtype for name, p in pl_module.named_parameters()},
            "seen_dtypes": set(getattr(pl_module, "seen_dtypes", ())),
            "gathered_fp8": list(getattr(pl_module, "gathered_fp8", [])),
            "fc2_shard_type": getattr(pl_module, "fc2_shard_type", None),
            "fp8": dict(plugin.layout.state_dict()["fp8"]) if hasattr(plugin, "layout") else {},
            "fp8_layers": plugin.layout.fp8_layers if hasattr(plugin, "layout") else [],
            "stats": {k: v for k, v in plugin.stats.items() if k in ("blamed_modules", "blamed_params")},
            "counters": (plugin.step_count, plugin.overflow_count, plugin.skipped_steps),
            "islands": list(plugin.islands.names),
            "fallback_active": plugin.fallback_active,
            "scaler": plugin.scaler.state_dict() if plugin.scaler is not None else {},
            "ladder_events": [dict(e) for e in plugin.ladder_events],  # the remedy ladder's decisions
        }
        for callback in trainer.callbacks:
            for name in ("decisions", "events", "rollbacks"):
                if hasattr(callback, name):
                    report[f"{type(callback).__name__}.{name}"] = getattr(callback, name)
        torch.save(report, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def fit_ddp(module: pl.LightningModule, plugin: Any, callbacks: list[pl.Callback], out_dir: Path, max_steps: int,
            ddp_kwargs: Mapping[str, Any] | None = None, ckpt_path: str | Path | None = None,
            **trainer_kwargs: Any) -> list[dict[str, Any]]:
    """Fit with DDP (``ddp_fork``; ``ddp_kwargs`` go to ``DDPStrategy``) on 2 CPU processes (gloo), resumed from
    ``ckpt_path`` where given, and return what each rank reported."""
    from lightning.pytorch.strategies import DDPStrategy

    out_dir.mkdir(parents=True, exist_ok=True)
    strategy = DDPStrategy(**{"start_method": "fork", "timeout": TIMEOUT, **(ddp_kwargs or {})})
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD_SIZE, strategy=strategy,
        plugins=[plugin], callbacks=[*callbacks, RankReport(out_dir)], max_steps=max_steps,
        enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False,
        **trainer_kwargs,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return read_ranks(out_dir)


def _external_worker(
    rank: int, port: int, module: pl.LightningModule, plugin: Any, out_dir: Path, max_steps: int,
    callbacks: list[pl.Callback] = (), trainer_kwargs: Mapping[str, Any] | None = None, ckpt_path: str | None = None,
) -> None:
    # Processes "launched externally" (as torchrun would): Lightning's ModelParallelStrategy would otherwise re-run
    # the command line (pytest) once per rank.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD_SIZE), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(data_parallel_size=WORLD_SIZE, tensor_parallel_size=1, timeout=TIMEOUT)
    options = dict(enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD_SIZE, strategy=strategy, plugins=[plugin],
        callbacks=[*callbacks, RankReport(out_dir)], max_steps=max_steps, **{**options, **(trainer_kwargs or {})},
    )
    trainer.fit(module, ckpt_path=ckpt_path)


def spawn_ranks(worker: Any, out_dir: Path, *args: Any) -> list[dict[str, Any]]:
    """``worker(rank, port, *args)`` on each of the ranks (forked: the children inherit the imports), then what each
    wrote under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.multiprocessing.start_processes(worker, nprocs=WORLD_SIZE, start_method="fork", args=(free_port(), *args))
    return read_ranks(out_dir)


def sharded_fabric(rank: int, port: int, plugin: Any) -> Any:
    """A launched 2-rank Fabric with ``plugin`` and ``ModelParallelStrategy`` (FSDP2) sharding a :class:`TinyMLP`'s
    fc1-fc3 and the whole with ``plugin.mp_policy``; processes "launched externally" (as torchrun would: Fabric's
    launcher would re-run pytest once per rank). Lightning's notices silenced."""
    import warnings

    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD_SIZE), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)

    def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
        for layer in (model.fc1, model.fc2, model.fc3):
            fully_shard(layer, mesh=mesh["data_parallel"], mp_policy=plugin.mp_policy)
        fully_shard(model, mesh=mesh["data_parallel"], mp_policy=plugin.mp_policy)
        return model

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=WORLD_SIZE, tensor_parallel_size=1,
                                     timeout=timedelta(seconds=60))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric = Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy, plugins=[plugin])
        fabric.launch()
    return fabric


def fit_fsdp2(
    module: pl.LightningModule, plugin: Any, out_dir: Path, max_steps: int, callbacks: list[pl.Callback] = (), *,
    ckpt_path: str | Path | None = None, **trainer_kwargs: Any,
) -> list[dict[str, Any]]:
    """Fit on 2 CPU processes (gloo) with Lightning's ModelParallelStrategy (FSDP2) and return each rank's report;
    ``ckpt_path`` resumes from a checkpoint (a DCP folder of shards)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.multiprocessing.start_processes(
        _external_worker, nprocs=WORLD_SIZE, start_method="fork",
        args=(free_port(), module, plugin, out_dir, max_steps, list(callbacks), trainer_kwargs,
              None if ckpt_path is None else str(ckpt_path)),
    )
    return read_ranks(out_dir)


class PrecisionChanges(pl.Callback):
    """Calls the plugin's repairs at fixed optimizer steps, on every rank alike (after that step).

    Args:
        at: ``{step: action}``; an action is ``"global"`` (``fallback(None)``), ``"restore"``
            (``restore_precision()``), ``"snapshot"`` (keep ``plugin.state_dict()``), ``"rollback"``
            (``restore_state`` of the snapshot) or a list of module names (a module fallback).
    """

    def __init__(self, at: Mapping[int, Any]) -> None:
        self.at = dict(at)
        self.snapshot: dict[str, Any] | None = None
        self.events: list[tuple[int, Any]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step - 1  # the optimizer step that just ran
        action = self.at.get(step)
        if action is None:
            return
        plugin = trainer.precision_plugin
        if action == "global":
            plugin.fallback(None, reason="test")
        elif action == "restore":
            plugin.restore_precision()
        elif action == "snapshot":
            import copy

            self.snapshot = copy.deepcopy(plugin.state_dict())
        elif action == "rollback":
            plugin.restore_state(self.snapshot)
        else:
            plugin.fallback(list(action), reason="test")
        self.events.append((step, action))


def layout_worker(rank: int, init_file: str, out_dir: str) -> None:
    """A plain DDP loop on a bf16 ``PrecisionLayout``: a fallback without a way to find the DDP wrapper is refused
    (nothing changes), with one it rebuilds the reducer; each rank trains on its own half of the data.

    The wrapper lives in :func:`_layout_run` and is freed (cycles collected) before the process group is destroyed:
    a reducer that outlives the group's registration frees the gloo group itself, joining gloo's threads while
    holding the GIL that one of them needs to free its last all-reduce (a hang at the rank's exit, seen in gdb)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE,
                            timeout=TIMEOUT)
    try:
        _layout_run(rank, out_dir)
        gc.collect()  # the layout's hooks and find_ddp keep the wrapper in reference cycles
    finally:
        dist.destroy_process_group()


def _layout_run(rank: int, out_dir: str) -> None:
    from lit_mpstable.core.layout.layout import PrecisionLayout

    torch.manual_seed(0)
    model = TinyMLP()
    layout = PrecisionLayout(torch.bfloat16, cast_parameters=True)
    layout.attach(model, "cpu")
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = regression_data(32)
    x, y = x[rank::WORLD_SIZE], y[rank::WORLD_SIZE]
    result: dict[str, Any] = {}
    try:
        layout.fallback(None)
    except RuntimeError as err:
        result["refused"] = str(err)
    result["after_refusal"] = (layout.fp32, {p.dtype for p in model.parameters()})
    layout.find_ddp = lambda: ddp
    layout.fallback(["fc2"])
    for _ in range(2):
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x.to(layout.compute_dtype)).float(), y).backward()
        optimizer.step()
    layout.restore()
    for _ in range(2):
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x.to(layout.compute_dtype)).float(), y).backward()
        optimizer.step()
    result["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    layout.find_ddp = None


def allreduce_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
    """A Python communication hook (what ``register_comm_hook`` takes): the default mean all-reduce (the rebuilt
    reducer must take it over; replicas are compared, not the hook's calls)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook as default

    return default(None, bucket)

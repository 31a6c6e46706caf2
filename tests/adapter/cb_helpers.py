"""Fault injection for the callback tests: the poisoned regression module (on the Trainer package under test; its
faults live in lit_mpstable.app.fault_demos), a stand-in attribution, recorders."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from functools import partial

import torch
from trainer_pkg import StablePrecision, pl

from lit_mpstable.app import fault_demos
from lit_mpstable.app.fault_demos import PoisonTask


class TiedLM(pl.LightningModule):
    """A tiny language model whose head is its embedding's ``Parameter`` (GPT-2's tie), on 6-token sequences of 32
    symbols, AdamW; ``head``: the head's class (an ``nn.Linear``)."""

    def __init__(self, head: type[torch.nn.Linear] = torch.nn.Linear) -> None:
        super().__init__()
        self.model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(32, 16), "body": torch.nn.Linear(16, 16),
                                          "head": head(16, 32, bias=False)})
        self.model.head.weight = self.model.emb.weight

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model.head(self.model.body(self.model.emb(x)))
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, 32), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        tokens = torch.randint(0, 32, (16, 7), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]),
                                           batch_size=4)


class PoisonModule(PoisonTask, pl.LightningModule):
    """:class:`~lit_mpstable.app.fault_demos.PoisonTask` on the Trainer package under test."""


class ManualPoisonModule(PoisonModule):
    """:class:`PoisonModule` under manual optimization: ``training_step`` runs its own backward and optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(self(batch[0]).float(), batch[1])
        self.manual_backward(loss)
        optimizer.step()
        return loss


class BlameFirstNonfinite(pl.Callback):
    """A stand-in for overflow attribution: names the first module whose forward output held inf/NaN in
    ``plugin.stats["blamed_modules"]`` at the end of the batch. List it before ``PrecisionFallback``."""

    def __init__(self) -> None:
        self.first: str | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        for name, module in pl_module.named_modules():
            module.register_forward_hook(self._hook(name))

    def _hook(self, name: str):
        def hook(module, args, output) -> None:
            if self.first is None and isinstance(output, torch.Tensor) and not torch.isfinite(output).all():
                self.first = name

        return hook

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.first = None

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if self.first is not None:
            trainer.precision_plugin.stats["blamed_modules"] = [self.first]


class NanWeight(pl.Callback):
    """A NaN in the module's first parameter at the start of each of ``steps`` (on ``rank`` only, if given), as after a
    bit flip in memory: the step's loss is NaN, and the remedy ladder rolls the state back (``ScaleCheckpoint``)."""

    def __init__(self, *steps: int, rank: int | None = None) -> None:
        self.steps, self.rank = set(steps), rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step in self.steps and self.rank in (None, trainer.global_rank):
            param = next(pl_module.parameters())
            local = param.to_local() if hasattr(param, "to_local") else param  # a shard's own values under FSDP2
            with torch.no_grad():
                local.view(-1)[0] = float("nan")


class Recorder(pl.Callback):
    """Records, after every batch (after the callbacks listed before it), fc2's weight, the lr and the plugin flags."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.lrs: list[float] = []
        self.skipped: list[bool] = []
        self.dtypes: list[torch.dtype] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.weights.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
        plugin = trainer.precision_plugin
        self.skipped.append(getattr(plugin, "last_step_skipped", False))
        self.dtypes.append(getattr(plugin, "compute_dtype", None))


@contextmanager
def quiet():
    """Silence warnings (FP16-on-CPU notice, the callbacks' own reports) where a test does not check them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ``StablePrecision("16-mixed")`` with an explicit CPU DynamicLossScaler: overflows come from injected infs.
fp16_scaler_plugin = partial(fault_demos.fp16_scaler_plugin, plugin_class=StablePrecision)


class ListLogger:
    """A Lightning logger that keeps every ``log_metrics`` call as ``(step, metrics)``: what reaches a real logger."""

    def __new__(cls, *args, **kwargs):
        Logger = pl.loggers.logger.Logger

        class _ListLogger(Logger):
            def __init__(self) -> None:
                super().__init__()
                self.rows: list[tuple[int, dict[str, float]]] = []

            @property
            def name(self) -> str:
                return "list"

            @property
            def version(self) -> int:
                return 0

            def log_hyperparams(self, params, *args, **kwargs) -> None:
                pass

            def log_metrics(self, metrics, step=None) -> None:
                self.rows.append((step, {k: float(v) for k, v in metrics.items()}))

            def steps_with(self, name: str) -> list[int]:
                return [step for step, metrics in self.rows if name in metrics]

            def values(self, name: str) -> list[float]:
                return [metrics[name] for _, metrics in self.rows if name in metrics]

        return _ListLogger()


class ActionNames(pl.profilers.PassThroughProfiler):
    """A profiler that lists the actions Lightning starts, in order (a callback hook's dispatch is
    ``[Callback]<state key>.<hook>``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def start(self, action_name: str) -> None:
        self.names.append(action_name)

"""Fault injection for the callback tests: poisoned batches, a layer that overflows in FP16, a stand-in attribution."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from contextlib import contextmanager

import torch
from helpers import TinyMLP, regression_data
from torch import nn
from trainer_pkg import pl


class Amplify(nn.Module):
    """``x * factor / factor``: the identity in FP32 and BF16, but inf in FP16 for |x| > 65504 / factor."""

    def __init__(self, factor: float = 1e5) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor / self.factor


class AmplifiedMLP(TinyMLP):
    """TinyMLP with :class:`Amplify` between fc1 and fc2 (qualified name ``model.amp`` inside :class:`PoisonModule`)."""

    def __init__(self) -> None:
        super().__init__()
        self.amp = Amplify()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act(self.fc2(self.amp(self.act(self.fc1(x))))))


class PoisonModule(pl.LightningModule):
    """TinyMLP regression with faults keyed on the optimizer step (``trainer.global_step``), so a resumed run poisons
    the same steps.

    Args:
        inf_input_steps: the batch's first input value becomes inf.
        loss_factor: ``{step: factor}``: the loss is multiplied by ``factor``.
        inf_grad_steps: fc2's weight gradient gets an inf after backward.
        amplify: use :class:`AmplifiedMLP` (overflows on every FP16 forward).
    """

    def __init__(
        self, *, inf_input_steps: Iterable[int] = (), loss_factor: Mapping[int, float] | None = None,
        inf_grad_steps: Iterable[int] = (), amplify: bool = False, lr: float = 0.05, optimizer: str = "sgd",
        scheduler: bool = False, n: int = 64, batch_size: int = 16,
    ) -> None:
        super().__init__()
        self.model = AmplifiedMLP() if amplify else TinyMLP()
        self.inf_input_steps, self.inf_grad_steps = set(inf_input_steps), set(inf_grad_steps)
        self.loss_factor = dict(loss_factor or {})
        self.lr, self.optimizer_name, self.use_scheduler, self.batch_size = lr, optimizer, scheduler, batch_size
        self.x, self.y = regression_data(n)
        self.losses: list[float] = []  # (unpoisoned) loss of every training step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step in self.inf_input_steps:
            x = x.clone()
            x.view(-1)[0] = float("inf")
        loss = nn.functional.mse_loss(self(x).float(), y)
        self.losses.append(loss.item())
        return loss * self.loss_factor.get(self.global_step, 1.0)

    def on_after_backward(self) -> None:
        if self.global_step in self.inf_grad_steps:
            self.model.fc2.weight.grad.view(-1)[0] = float("inf")

    def train_dataloader(self):
        ds = torch.utils.data.TensorDataset(self.x, self.y)
        return torch.utils.data.DataLoader(ds, batch_size=self.batch_size, shuffle=False)

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        if not self.use_scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


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


def fp32_scaler_plugin(**scaler_kwargs):
    """``StablePrecision("32-true")`` with an explicit DynamicLossScaler: fast; overflows come from injected infs."""
    from trainer_pkg import StablePrecision

    from lit_mpstable.core.loss_scaler import DynamicLossScaler

    return StablePrecision("32-true", scaler=DynamicLossScaler("cpu", **scaler_kwargs))


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

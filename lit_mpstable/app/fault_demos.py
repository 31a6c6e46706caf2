"""A tiny regression workload with faults keyed on the optimizer step: an inf input, an inf gradient, a loss spike, a
layer that overflows in FP16. What the callback tests and the fault benchmarks (``bench/triage_events.py``) train.

The faults live in :class:`PoisonTask`, a mixin of LightningModule hooks, so the same module runs on either Trainer
package: :class:`PoisonModule` is it on ``lightning.pytorch``; on ``pytorch_lightning`` combine it with that
package's class, ``class PoisonModule(PoisonTask, pytorch_lightning.LightningModule)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from torch import nn

from lit_mpstable.core.scaling.loss_scaler import DynamicLossScaler
from lit_mpstable.frontends.trainer import StablePrecision


class TinyMLP(nn.Module):
    """Three linear layers, dimensions multiples of 16 (FP8-eligible in the middle)."""

    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act(self.fc2(self.act(self.fc1(x)))))


def regression_data(n: int = 64, d_in: int = 16, d_out: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic linear-regression task with noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g) / d_in**0.5
    return x, x @ w + 0.01 * torch.randn(n, d_out, generator=g)


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


class PoisonTask:
    """TinyMLP regression with faults keyed on the optimizer step (``trainer.global_step``), so a resumed run poisons
    the same steps. A mixin: list it before a LightningModule class (see :class:`PoisonModule`).

    Args:
        inf_input_steps: the batch's first input value becomes inf.
        loss_factor: ``{step: factor}``: the loss is multiplied by ``factor``.
        inf_grad_steps: fc2's weight gradient gets an inf after backward.
        amplify: use :class:`AmplifiedMLP` (overflows on every FP16 forward).
    """

    if TYPE_CHECKING:  # what the LightningModule it is mixed into provides
        global_step: int

        def __call__(self, x: torch.Tensor) -> torch.Tensor: ...
        def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

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
            grad = self.model.fc2.weight.grad
            assert grad is not None  # after a backward through fc2
            grad.view(-1)[0] = float("inf")

    def train_dataloader(self):
        ds = torch.utils.data.TensorDataset(self.x, self.y)
        return torch.utils.data.DataLoader(ds, batch_size=self.batch_size, shuffle=False)

    def configure_optimizers(self):
        opt: torch.optim.Optimizer
        if self.optimizer_name == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        if not self.use_scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class PoisonModule(PoisonTask, pl.LightningModule):
    """:class:`PoisonTask` on ``lightning.pytorch``."""


def fp16_scaler_plugin(*, plugin_class: type = StablePrecision, **scaler_kwargs: Any) -> Any:
    """``plugin_class("16-mixed")`` (``StablePrecision``) with an explicit CPU DynamicLossScaler built from
    ``scaler_kwargs``: a loss scaler is only taken in the FP16 precisions; on the tiny models here its overflows come
    from injected infs."""
    return plugin_class("16-mixed", scaler=DynamicLossScaler("cpu", **scaler_kwargs))

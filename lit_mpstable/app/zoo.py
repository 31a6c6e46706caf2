"""Small real models and data that need no download: a character-level GPT on Python's own standard-library
source, and an MLP on scikit-learn's handwritten digits (the ``demo`` extra). Used by ``train``, the experiments and
the benchmarks."""

from __future__ import annotations

import inspect
import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

# Modules whose source text ships with every CPython: a real, deterministic corpus (~400 kB).
_CORPUS_MODULES = ("argparse", "textwrap", "string", "shlex", "csv", "difflib", "fractions", "calendar", "tokenize")


def stdlib_text(modules: tuple[str, ...] = _CORPUS_MODULES) -> str:
    """Concatenated source of standard-library modules, in a fixed order."""
    import importlib

    return "\n".join(inspect.getsource(importlib.import_module(name)) for name in modules)


class CharLMData(pl.LightningDataModule):
    """Character-level language modelling on :func:`stdlib_text`: the last ``val_fraction`` is held out."""

    def __init__(
        self, seq_len: int = 64, batch_size: int = 16, val_fraction: float = 0.1, max_chars: int | None = None
    ):
        super().__init__()
        text = stdlib_text()[:max_chars]
        self.vocab = sorted(set(text))
        lookup = {ch: i for i, ch in enumerate(self.vocab)}
        self.tokens = torch.tensor([lookup[ch] for ch in text], dtype=torch.long)
        self.seq_len, self.batch_size, self.val_fraction = seq_len, batch_size, val_fraction

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def _windows(self, tokens: torch.Tensor) -> TensorDataset:
        n = (len(tokens) - 1) // self.seq_len
        x = tokens[: n * self.seq_len].view(n, self.seq_len)
        y = tokens[1 : n * self.seq_len + 1].view(n, self.seq_len)
        return TensorDataset(x, y)

    def setup(self, stage: str | None = None) -> None:
        cut = int(len(self.tokens) * (1 - self.val_fraction))
        self.train_set, self.val_set = self._windows(self.tokens[:cut]), self._windows(self.tokens[cut:])

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=generator, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A decoder-only transformer (pre-norm, causal SDPA attention); all dimensions multiples of 16."""

    def __init__(self, vocab_size: int, d_model: int = 128, n_layers: int = 2, n_heads: int = 4, seq_len: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class _Classifier(pl.LightningModule):
    """Shared training logic: cross-entropy in FP32 (the loss is a reduction), accuracy, AdamW + cosine schedule."""

    def __init__(
        self, lr: float, weight_decay: float, warmup_steps: int, total_steps: int, optimizer: Any = None
    ) -> None:
        super().__init__()
        self.lr, self.weight_decay, self.warmup_steps, self.total_steps = lr, weight_decay, warmup_steps, total_steps
        self.optimizer_factory = optimizer
        """``(params, lr=..., weight_decay=...) -> Optimizer`` (e.g. ``torchao.optim.AdamW8bit``, or a Hydra node
        with ``_partial_: true``); None: ``torch.optim.AdamW``."""

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x).float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        acc = (logits.argmax(-1) == y).float().mean()
        self.log(f"{stage}/loss", loss, prog_bar=True, on_step=stage == "train", on_epoch=True)
        self.log(f"{stage}/acc", acc, prog_bar=stage == "val", on_step=False, on_epoch=True)
        return loss

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def configure_optimizers(self):
        factory = self.optimizer_factory or torch.optim.AdamW
        opt = factory(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)

        def schedule(step: int) -> float:
            if step < self.warmup_steps:
                return (step + 1) / self.warmup_steps
            progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class GPTLM(_Classifier):
    """:class:`GPT` trained for next-character prediction."""

    def __init__(
        self, vocab_size: int, d_model: int = 128, n_layers: int = 2, n_heads: int = 4, seq_len: int = 64,
        lr: float = 3e-3, weight_decay: float = 0.01, warmup_steps: int = 20, total_steps: int = 300,
        optimizer: Any = None,
    ) -> None:
        super().__init__(lr, weight_decay, warmup_steps, total_steps, optimizer)
        self.save_hyperparameters()
        self.model = GPT(vocab_size, d_model, n_layers, n_heads, seq_len)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)


class DigitsData(pl.LightningDataModule):
    """scikit-learn's 8x8 handwritten digits (1,797 images, shipped with the package); a fixed 80/20 split."""

    def __init__(self, batch_size: int = 64) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str | None = None) -> None:
        try:
            from sklearn.datasets import load_digits
        except ModuleNotFoundError as error:
            raise ModuleNotFoundError(
                'DigitsData needs scikit-learn (its digits ship with it): pip install "lit_mpstable[demo]"'
            ) from error

        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        cut = int(0.8 * len(x))
        self.train_set = TensorDataset(x[order[:cut]], y[order[:cut]])
        self.val_set = TensorDataset(x[order[cut:]], y[order[cut:]])

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)


class MLPClassifier(_Classifier):
    """A 64-256-256-10 MLP for :class:`DigitsData`."""

    def __init__(
        self, hidden: int = 256, lr: float = 3e-3, weight_decay: float = 0.01, warmup_steps: int = 10,
        total_steps: int = 300, optimizer: Any = None,
    ) -> None:
        super().__init__(lr, weight_decay, warmup_steps, total_steps, optimizer)
        self.save_hyperparameters(ignore=["optimizer"])
        self.model = nn.Sequential(
            nn.Linear(64, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

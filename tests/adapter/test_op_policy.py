"""StablePrecision(op_policy=...): construction checks, the policy in a real fit, visibility, resume, islands."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
from helpers import make_trainer
from torch import nn
from torch.nn import functional as F

from lit_mpstable import StablePrecision
from lit_mpstable.core.layout import policy as policy_module
from lit_mpstable.core.layout.policy import FAMILIES, Measurement


class TinyGPT(pl.LightningModule):
    """One pre-norm attention block on random tokens; records the dtype attention produced in each forward."""

    def __init__(self, d: int = 16, heads: int = 2, seq: int = 8, vocab: int = 32) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.qkv, self.proj, self.head = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, vocab)
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (32, seq + 1), generator=g)
        self.attention_dtypes: list[torch.dtype] = []
        self.norm_dtypes: list[torch.dtype] = []
        self.ln.register_forward_hook(lambda module, args, out: self.norm_dtypes.append(out.dtype))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        self.attention_dtypes.append(y.dtype)
        return self.head(x + self.proj(y.transpose(1, 2).reshape(b, t, d)))

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self(tokens[:, :-1]).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.tokens), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Injected timings (no clock in tests): attention 1.8x faster in FP32, matmul 2x slower; FP32 always closer to
    FP64. Returns the families measured, in order."""
    calls: list[str] = []

    def measure(op_calls, device_type, dtype, budget_s):
        family = op_calls[0].family
        calls.append(family)
        autocast_ms, fp32_ms = {"attention": (53.0, 29.0), "matmul": (10.0, 21.0)}.get(family, (1.0, 1.0))
        return Measurement(autocast_ms, fp32_ms, autocast_err=4e-3, fp32_err=5e-7)

    monkeypatch.setattr(policy_module, "measure_calls", measure)
    return calls


def _policy_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "op_policy" in r.getMessage()]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(op_policy={"atention": "fp32"}), ["op_policy", "atention"]),
        (dict(op_policy={"attention": "fp8"}), ["op_policy", "fp8"]),
        (dict(op_policy="fastest"), ["op_policy", "fastest"]),
        (dict(precision="bf16-true", op_policy="auto"), ["op_policy", "bf16-true", "mixed"]),
        (dict(precision="32-true", op_policy={"attention": "fp32"}), ["op_policy", "32-true"]),
    ],
)
def test_bad_op_policies_raise_at_construction_naming_them(kwargs: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        StablePrecision(**kwargs)
    assert all(word in str(info.value) for word in words), str(info.value)


def test_auto_decides_in_the_first_forward_then_runs_attention_in_fp32(measured, caplog) -> None:
    plugin, model = StablePrecision("bf16-mixed", op_policy="auto"), TinyGPT()
    with caplog.at_level(logging.INFO):
        make_trainer(plugin, max_steps=3).fit(model)
    assert measured == ["matmul", "attention", "norm"]  # the families the model ran; measured once
    assert plugin.stats["op_policy"] == {**dict.fromkeys(FAMILIES, "autocast"), "attention": "fp32"}
    assert plugin.stats["op_policy_ms"]["attention"] == {"autocast": 53.0, "fp32": 29.0}
    # The recorded first forward runs as autocast would; from then on attention computes in FP32.
    assert model.attention_dtypes == [torch.bfloat16, torch.float32, torch.float32]
    (line,) = _policy_lines(caplog)  # one line, with the numbers behind the choice
    assert "attention=fp32 (29.0 ms fp32 vs 53.0 ms autocast)" in line and "matmul=autocast" in line


def test_the_default_changes_nothing_and_logs_nothing(measured, caplog) -> None:
    plugin, model = StablePrecision("bf16-mixed"), TinyGPT()
    with caplog.at_level(logging.INFO):
        make_trainer(plugin, max_steps=2).fit(model)
    assert plugin.stats["op_policy"] == dict.fromkeys(FAMILIES, "autocast") and not measured
    assert model.attention_dtypes == [torch.bfloat16] * 2 and not _policy_lines(caplog)


def test_checkpoint_keeps_the_choice_and_a_resumed_run_does_not_measure(measured, tmp_path, caplog) -> None:
    first = StablePrecision("bf16-mixed", op_policy="auto")
    trainer = make_trainer(first, max_steps=2)
    trainer.fit(TinyGPT())
    trainer.save_checkpoint(tmp_path / "policy.ckpt")
    saved = torch.load(tmp_path / "policy.ckpt", weights_only=True)["StablePrecision"]
    assert saved["op_policy"] == first.stats["op_policy"] and saved["op_policy"]["attention"] == "fp32"

    measured.clear()
    caplog.clear()
    resumed, model = StablePrecision("bf16-mixed", op_policy="auto"), TinyGPT()
    with caplog.at_level(logging.INFO):
        make_trainer(resumed, max_steps=4).fit(model, ckpt_path=tmp_path / "policy.ckpt")
    assert not measured and resumed.policy.choices == first.policy.choices
    assert model.attention_dtypes == [torch.float32] * 2  # the saved choice from the first resumed step on
    assert len(_policy_lines(caplog)) == 1
    with pytest.raises(KeyError, match="op_policy"):  # load stays strict
        StablePrecision("bf16-mixed").load_state_dict({k: v for k, v in saved.items() if k != "op_policy"})


def test_fp32_modules_win_over_a_forced_policy() -> None:
    forced = StablePrecision("bf16-mixed", op_policy={"norm": "bf16"})
    model = TinyGPT()
    make_trainer(forced, max_steps=1).fit(model)
    assert model.norm_dtypes == [torch.bfloat16]  # the policy forces BF16 layer norms ...
    islanded = StablePrecision("bf16-mixed", op_policy={"norm": "bf16", "attention": "bf16"}, fp32_modules=["ln"])
    model = TinyGPT()
    make_trainer(islanded, max_steps=1).fit(model)
    assert model.norm_dtypes == [torch.float32]  # ... except inside an FP32 island the user asked for
    assert islanded.stats["op_policy"]["norm"] == "bf16"  # the policy itself is unchanged: the island wins locally

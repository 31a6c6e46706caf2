"""QKClip: the heads whose max attention logit passed the threshold are rescaled to it after the step, the others
untouched; MultiheadAttention and SDPA callers (qkv / q_proj+k_proj); bad arguments; state."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import make_trainer
from torch import nn
from torch.nn import functional as F
from trainer_pkg import pl

from lit_mpstable.callbacks import QKClip


class _Fused(nn.Module):
    """zoo.GPT's attention layout: one qkv Linear, heads contiguous."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.n_heads = heads
        self.qkv = nn.Linear(d, 3 * d)

    def qk(self, x):
        b, t, d = x.shape
        q, k, _ = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        return q, k

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)


class _Split(nn.Module):
    """The q_proj / k_proj naming (Hugging Face style)."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.num_heads = heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def qk(self, x):
        b, t, d = x.shape
        return (self.q_proj(x).view(b, t, self.num_heads, -1).transpose(1, 2),
                self.k_proj(x).view(b, t, self.num_heads, -1).transpose(1, 2))

    def forward(self, x):
        b, t, d = x.shape
        q, k = self.qk(x)
        v = self.v_proj(x).view(b, t, self.num_heads, -1).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)


class _MHA(nn.Module):
    def __init__(self, d=8, heads=2):
        super().__init__()
        self.mha = nn.MultiheadAttention(d, heads, batch_first=True)

    def qk(self, x):
        w_q, w_k, _ = self.mha.in_proj_weight.chunk(3)
        b_q, b_k, _ = self.mha.in_proj_bias.chunk(3)
        b, t, d = x.shape
        h = self.mha.num_heads
        q, k = x @ w_q.T + b_q, x @ w_k.T + b_k
        return q.view(b, t, h, -1).transpose(1, 2), k.view(b, t, h, -1).transpose(1, 2)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


class _Task(pl.LightningModule):
    def __init__(self, attention: nn.Module, lr: float = 0.0):
        super().__init__()
        self.attention, self.lr = attention, lr
        self.x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(0))

    def training_step(self, batch, batch_idx):
        return self.attention(batch[0]).square().mean()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _head_max(attention, x):
    q, k = attention.qk(x)
    return (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("layout", [_Fused, _Split, _MHA])
def test_heads_above_the_threshold_are_rescaled_to_it_and_the_others_kept(layout):
    torch.manual_seed(0)
    attention = layout()
    task = _Task(attention)  # lr 0: only QKClip moves the weights
    with torch.no_grad():
        for p in attention.parameters():
            p.mul_(3.0)
    before = _head_max(attention, task.x).detach()
    threshold = float(before.min() + before.max()) / 2  # one head above, one below
    assert (before > threshold).sum() == 1
    clip = QKClip(threshold=threshold, alpha=0.5)
    make_trainer(max_steps=1, callbacks=[clip]).fit(task)
    after = _head_max(attention, task.x).detach()
    above = before > threshold
    assert torch.allclose(after[above], torch.full_like(after[above], threshold), rtol=1e-4)
    assert torch.equal(after[~above], before[~above])
    assert int(clip.heads_clipped) == 1


def test_alpha_puts_the_rescaling_on_the_query_or_the_key():
    torch.manual_seed(0)
    attention = _Fused()
    task = _Task(attention)
    with torch.no_grad():
        attention.qkv.weight.mul_(4.0)
    w_k = attention.qkv.weight[8:16].detach().clone()
    make_trainer(max_steps=1, callbacks=[QKClip(threshold=1e-3, alpha=1.0)]).fit(task)
    assert torch.equal(attention.qkv.weight[8:16], w_k)  # alpha 1: all of it on W_q
    assert _head_max(attention, task.x).max() <= 1e-3 * (1 + 1e-4)


@pytest.mark.parametrize("kwargs, name", [
    (dict(threshold=0.0), "threshold"), (dict(threshold=float("inf")), "threshold"),
    (dict(threshold=True), "threshold"),
    (dict(alpha=1.5), "alpha"), (dict(alpha=-0.1), "alpha"), (dict(modules="qkv"), "modules"),
])
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=rf"QKClip\({name}="):
        QKClip(**kwargs)


def test_a_named_module_that_is_not_attention_is_refused_at_fit_start():
    task = _Task(_Fused())
    with pytest.raises(ValueError, match="'attention.qkv'"):
        make_trainer(max_steps=1, callbacks=[QKClip(modules=["attention.qkv"])]).fit(task)


def test_state_round_trips_and_is_checked():
    clip = QKClip()
    clip.heads_clipped.fill_(7)
    other = QKClip()
    other.load_state_dict(clip.state_dict())
    assert int(other.heads_clipped) == 7
    with pytest.raises(ValueError):
        other.load_state_dict({"heads_clipped": -1})


class _Stop(BaseException):
    """Passes torch's forward hooks, as a KeyboardInterrupt does; Lightning hands it to on_exception, then raises it."""


class _Stopping(_Fused):
    def forward(self, x):
        super().forward(x)
        raise _Stop


def test_a_fit_that_raises_in_a_clipped_forward_leaves_torchs_function_in_place():
    with pytest.raises(_Stop):
        make_trainer(max_steps=1, callbacks=[QKClip()]).fit(_Task(_Stopping()))
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


class _HeadsAs(nn.Module):
    """_Fused's layout (2 heads) with the head count under the attribute ``name`` (nanoGPT's is ``n_head``)."""

    def __init__(self, name):
        super().__init__()
        setattr(self, name, 2)
        self.qkv = nn.Linear(8, 24)

    def qk(self, x):
        q, k, _ = self.qkv(x).view(*x.shape[:2], 3, 2, 4).permute(2, 0, 3, 1, 4)
        return q, k

    def forward(self, x):
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape)


@pytest.mark.parametrize("name", ["n_head", "num_attention_heads"])
def test_nanogpts_and_hugging_faces_head_counts_are_read(name):
    attention = _HeadsAs(name)
    task = _Task(attention)
    clip = QKClip(threshold=1e-3)
    make_trainer(max_steps=1, callbacks=[clip]).fit(task)
    assert list(clip.targets) == ["attention"] and int(clip.heads_clipped) == 2
    assert _head_max(attention, task.x).max() <= 1e-3 * (1 + 1e-4)


class _Grouped(nn.Module):
    """Grouped keys: 2 query heads share 1 key head."""

    def __init__(self):
        super().__init__()
        self.num_heads = 2
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, 2, 4).transpose(1, 2)
        k, v = (proj(x).view(b, t, 1, 4).transpose(1, 2) for proj in (self.k_proj, self.v_proj))
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2).reshape(b, t, 8)


@pytest.mark.parametrize(("layout", "cause"), [(lambda: _HeadsAs("heads"), "n_heads"), (_Grouped, "grouped keys")],
                         ids=["no head count", "grouped keys"])
def test_an_attention_module_it_cannot_clip_is_named_in_one_warning(layout, cause):
    """It used to say nothing and clip nothing, while OverflowMonitor(attention=True) logged the module's logits."""
    task = _Task(layout())
    with pytest.warns(UserWarning, match="QKClip does nothing") as caught:
        make_trainer(max_steps=2, callbacks=[QKClip(threshold=1e-3)]).fit(task)
    texts = [str(w.message) for w in caught if "QKClip" in str(w.message)]
    assert len(texts) == 1 and "'attention'" in texts[0] and cause in texts[0], texts

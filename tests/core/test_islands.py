"""FP32 islands: structured inputs and outputs (namedtuples, PackedSequence) survive the casts."""

from __future__ import annotations

from collections import namedtuple

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from lit_mpstable.islands import FP32Islands

Pair = namedtuple("Pair", "a b")


class _Pairwise(nn.Module):
    def forward(self, pair: Pair) -> Pair:
        return Pair(pair.a * 2, pair.b + 1)


def test_packed_sequences_and_namedtuples_pass_through_an_island() -> None:
    rnn = nn.LSTM(8, 8, batch_first=True)
    islands = FP32Islands([nn.LSTM, _Pairwise])
    root = nn.ModuleDict({"rnn": rnn, "pair": _Pairwise()})
    islands.attach(root, device_type="cpu", output_dtype=torch.bfloat16)
    packed = pack_padded_sequence(torch.randn(2, 5, 8), torch.tensor([5, 3]), batch_first=True)
    out, _ = root["rnn"](packed)
    assert type(out).__name__ == "PackedSequence" and out.data.dtype == torch.bfloat16  # cast back down
    result = root["pair"](Pair(torch.ones(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.bfloat16)))
    assert isinstance(result, Pair) and result.a.dtype == torch.bfloat16 and torch.equal(result.b.float(), torch.ones(2))

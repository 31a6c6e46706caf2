"""FP32 islands: structured inputs and outputs (namedtuples, PackedSequence) survive the casts."""

from __future__ import annotations

from collections import namedtuple

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from lit_mpstable.core.layout.islands import FP32Islands, tied_modules

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
    assert isinstance(result, Pair) and result.a.dtype == torch.bfloat16
    assert torch.equal(result.b.float(), torch.ones(2))


def test_wrapping_the_forward_keeps_a_users_own_forward_and_never_wraps_twice() -> None:
    # Islands wrap forward (so torch.compile traces them); detach gives back exactly what the module had before.
    root = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    own = root[1].forward = lambda x: x * 3.0  # a user's instance-level forward
    islands = FP32Islands([nn.Linear])
    for _ in range(2):  # a second fit attaches again
        islands.attach(root, device_type="cpu", output_dtype=torch.bfloat16)
    islands.device_type = "cpu"  # the run's device found later: wrapped again, not wrapped twice
    x = torch.ones(2, 4, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = root(x)
    first = nn.functional.linear(x.float(), root[0].weight, root[0].bias).bfloat16()  # FP32 inside, cast back out
    assert out.dtype == torch.bfloat16 and torch.equal(out, (3.0 * first.float()).bfloat16())  # own forward kept
    islands.detach()
    assert root[1].forward is own and "forward" not in root[0].__dict__


def test_a_deep_copy_of_the_model_has_its_own_islands() -> None:
    # copy.deepcopy (PrecisionProbe's FP32 replay, snapshots) must give a copy whose islands run the copy's weights
    # and follow a copy of the islands object, not the original's.
    import copy

    root = nn.Sequential(nn.Linear(4, 4))
    islands = FP32Islands([nn.Linear])
    islands.attach(root, device_type="cpu", output_dtype=torch.bfloat16)
    memo: dict = {}
    twin = copy.deepcopy(root, memo)
    with torch.no_grad():
        twin[0].weight.mul_(2.0)
    memo[id(islands)].output_dtype = None  # the copy's islands: FP32 outputs now, the original's unchanged
    x = torch.ones(1, 4)
    assert root(x).dtype == torch.bfloat16 and twin(x).dtype == torch.float32
    expected = nn.functional.linear(x, twin[0].weight, twin[0].bias)
    assert torch.equal(twin(x), expected) and not torch.equal(root(x).float(), expected)


def test_tied_modules_follow_a_chain_of_shared_parameters_and_name_the_root() -> None:
    # a and b share a weight, b and c a bias: an island on a takes b, and through b c (a parameter has one dtype).
    root = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4), "c": nn.Linear(4, 4), "d": nn.Linear(4, 4)})
    root["b"].weight = root["a"].weight
    root["c"].bias = root["b"].bias
    assert tied_modules(root, {"a": root["a"]}) == {"b": "a.weight", "c": "b.bias"}
    assert tied_modules(root, {"d": root["d"]}) == {}
    root.table = root["d"].weight  # the root itself holds it too
    assert tied_modules(root, {"d": root["d"]}) == {"": "d.weight"}

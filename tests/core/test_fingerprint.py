"""The numeric fingerprint every checkpoint carries (docs/fingerprints.md): per-tensor checksums, the precision
manifest, the pinned micro-batch's loss; checked at load, ``on_fingerprint_mismatch`` deciding what a mismatch does."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_module, make_trainer
from torch import nn

from lit_mpstable.core.fingerprint import (
    KEY,
    PIN_ROWS,
    FingerprintMismatch,
    _word_sum,
    checksum,
    compare_checksums,
    pin_batch,
    previous_checkpoints,
)


def _flip(tensor: torch.Tensor, index: int = 0, bit: int = 0) -> None:
    """Flip one bit of ``tensor``'s ``index``-th 32-bit word, in place."""
    words = tensor.view(-1).view(torch.int32) if tensor.element_size() == 4 else tensor.view(-1).view(torch.int16)
    words[index] ^= 1 << bit


def test_checksum_is_bitwise_and_exact() -> None:
    x = torch.randn(7, 5)  # 140 bytes: 17 whole words and a 4-byte tail
    saved = checksum(x)
    assert checksum(x.clone()) == saved and checksum(x.t().contiguous().t()) == saved  # the values, not the layout
    for index, bit in ((0, 0), (34, 0), (12, 30)):  # first word, the tail, a high bit
        y = x.clone()
        _flip(y, index, bit)
        assert checksum(y) != saved, (index, bit)
    y = x.clone()
    y[2] *= 2  # a row scaled
    assert checksum(y) != saved
    assert checksum(x.bfloat16()) != checksum(x.bfloat16().float())
    assert checksum(torch.zeros(0)) != checksum(torch.zeros(2))  # the byte count is in it: zeros appended differ
    assert checksum(torch.tensor([True, False])) != checksum(torch.tensor([False, True]))  # the order of values too


@pytest.mark.parametrize("size", [32, 1000, 509 * 8 * 3 + 4])
def test_balanced_changes_do_not_cancel_in_the_checksum(size: int) -> None:
    # One wrap-around sum of all words (version 1) misses a tensor negated whose signs were half and half, and two
    # flips of a word's top bit; the lanes and their hash do not.
    x = torch.tensor([1.0, 1.0, -1.0, -1.0]).repeat(size // 4) * torch.rand(size).add(0.5)  # signs in pairs
    negated = -x
    pair = x.clone()
    _flip(pair, 1, 31)
    _flip(pair, 3, 31)  # the sign bits of two words' upper halves: 2**63 + 2**63 wraps to 0
    for changed in (negated, pair):
        assert int(_word_sum(changed)) == int(_word_sum(x))  # what version 1 could not see
        assert checksum(changed) != checksum(x)



def _reference_checksum(tensor: torch.Tensor, version: int) -> int:
    """The checksum as docs/fingerprints.md defines it, in plain Python: the bytes as little-endian 64-bit words (the
    last zero-padded), word i added into lane i mod 509 modulo 2**64; BLAKE2b-64 of the lanes (version 3: one lane a
    word, at most 509; version 2: always 509) as little-endian words, then the byte count."""
    import hashlib
    import struct

    flat = tensor.detach().reshape(-1).contiguous()
    data = bytes(flat.view(torch.uint8).numpy()) if flat.dtype != torch.bool else bytes(flat.numpy())
    data += bytes(-len(data) % 8)
    words = struct.unpack(f"<{len(data) // 8}Q", data)
    lanes = [0] * (min(len(words), 509) if version == 3 else 509)
    for index, word in enumerate(words):
        lanes[index % 509] = (lanes[index % 509] + word) % 2**64
    body = struct.pack(f"<{len(lanes)}Q", *lanes) + (tensor.numel() * tensor.element_size()).to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(body, digest_size=8).digest(), "little")


_SIZES = [0, 1, 3, 8, 509 * 2, 509 * 2 + 1, 509 * 8 + 7, 5000]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.bool])
@pytest.mark.parametrize("numel", _SIZES)
def test_the_checksum_is_the_documented_one_on_both_paths(dtype: torch.dtype, numel: int) -> None:
    import lit_mpstable.core.fingerprint as fp

    x = (torch.randn(numel) * 100).to(dtype)
    expected = _reference_checksum(x, 3)
    assert checksum(x) == expected
    assert fp._device_checksums([x, x[1:]], 3) == [expected, _reference_checksum(x[1:], 3)]  # a GPU's path, here
    assert fp.checksums({"t": x}, version=2)["t"] == _reference_checksum(x, 2)  # version 2 checkpoints still check
    assert fp._device_checksums([x], 2) == [_reference_checksum(x, 2)]


def test_checksums_of_views_and_many_small_tensors_are_their_values_in_order() -> None:
    import lit_mpstable.core.fingerprint as fp

    base = torch.randn(64, 33)
    views = [base[1:, 1:], base.t(), base[:, 5], base[3, 7:], torch.tensor(7), torch.tensor([True, False, True]),
             torch.randn(3, requires_grad=True), (torch.randn(2, 2) * 1j).conj()]  # offsets, strides, a conj bit
    for t in views:
        assert checksum(t) == checksum(t.detach().resolve_conj().clone()) == _reference_checksum(t.resolve_conj(), 3)
    sums = fp.checksums({"s": {str(i): t for i, t in enumerate(views)}})
    assert list(sums.values()) == fp._device_checksums(views, 3) == [checksum(t) for t in views]


def test_a_version_1_fingerprint_is_checked_with_its_own_checksum() -> None:
    masters = {"w": torch.randn(8, 8)}
    saved_v1 = {"plugin['masters']['w']": int(_word_sum(masters["w"]))}
    assert compare_checksums(saved_v1, {"plugin": {"masters": masters}}, version=1) == []
    assert compare_checksums(saved_v1, {"plugin": {"masters": masters}}) != []  # not the current checksum
    masters["w"][0, 0] += 1
    assert compare_checksums(saved_v1, {"plugin": {"masters": masters}}, version=1) != []


def test_checksum_comparison_names_the_tensor_and_what_it_looks_like() -> None:
    masters = {"w": torch.randn(8, 8), "b": torch.randn(8)}
    saved = {f"plugin['masters'][{k!r}]": checksum(v) for k, v in masters.items()}
    assert compare_checksums(saved, {"plugin": {"masters": masters}}) == []
    rounded = {"w": masters["w"].bfloat16().float(), "b": torch.zeros(8)}
    found = compare_checksums(saved, {"plugin": {"masters": rounded}})
    assert len(found) == 2
    assert "FP32 master `plugin['masters']['w']`" in found[0] and "round-tripped through BF16" in found[0]
    assert "now all zeros" in found[1]
    assert "missing" in compare_checksums(saved, {"plugin": {"masters": {"w": masters["w"]}}})[0]


def test_pinned_batch_is_capped_and_on_the_cpu() -> None:
    pinned = pin_batch((torch.randn(64, 16), {"y": torch.arange(64)}, "tag"))
    assert isinstance(pinned, tuple) and pinned[0].shape == (PIN_ROWS, 16) and pinned[1]["y"].tolist() == [0, 1, 2, 3]
    assert pinned[2] == "tag" and pinned[0].device.type == "cpu"
    assert pin_batch(torch.randn(4, 1 << 20)) is None  # over the byte cap: no pinned loss rather than a huge one
    assert pin_batch(["no tensors"]) is None


def test_a_namedtuple_batch_keeps_its_type_in_the_pass_and_is_written_as_a_tuple(tmp_path) -> None:
    import collections
    from contextlib import nullcontext

    from lit_mpstable.core.fingerprint import Fingerprint, pinned_pass, to_device

    Batch = collections.namedtuple("Batch", "x y")
    batch = Batch(torch.randn(8, 4), torch.randn(8, 4))
    pinned = pin_batch(batch)
    assert type(pinned) is Batch and pinned.x.shape == (PIN_ROWS, 4)  # before: a list, whose .x the step cannot read
    assert type(to_device(pinned, torch.device("cpu"))) is Batch
    module = nn.Linear(4, 4)
    fingerprint = Fingerprint()
    fingerprint.pin(batch)
    saved = fingerprint.capture({}, {}, lambda rows: pinned_pass(module, lambda net, b: (net(b.x) - b.y).pow(2).sum(),
                                                                 rows, forward_context=nullcontext))
    torch.save(saved, tmp_path / "f.pt")
    loaded = torch.load(tmp_path / "f.pt", weights_only=True)  # a checkpoint holds plain containers
    assert type(loaded["pinned"]["batch"]) is tuple and loaded["pinned"]["grad_norm"] > 0
    resumed = Fingerprint()
    resumed.adopt(loaded)
    assert resumed.pinning  # the next training batch retypes the checkpoint's rows
    resumed.pin(Batch(torch.zeros(8, 4), torch.zeros(8, 4)))
    assert type(resumed.batch) is Batch and torch.equal(resumed.batch.x, pinned.x) and not resumed.pinning


def test_on_fingerprint_mismatch_is_checked() -> None:
    from trainer_pkg import StablePrecision

    with pytest.raises(ValueError, match=r"on_fingerprint_mismatch='never'\): must be one of \['raise', 'previous', "):
        StablePrecision(on_fingerprint_mismatch="never")
    with pytest.raises(TypeError, match="on_fingerprint_mismatch=None"):
        StablePrecision(on_fingerprint_mismatch=None)  # type: ignore[arg-type]
    assert "on_fingerprint_mismatch='warn'" in repr(StablePrecision(on_fingerprint_mismatch="warn"))


# ------------------------------------------------------------------------------------------------- the Trainer
def _fit(plugin: Any, steps: int, directory: Path | None = None, ckpt_path: Path | None = None, **module: Any):
    """A TinyModule fit on the CPU; with ``directory`` a ModelCheckpoint writes every step there."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    model = make_module(optimizer="adamw", lr=1e-2, **module)
    callbacks = [ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=-1)] if directory else []
    trainer = make_trainer(plugin, max_steps=steps, callbacks=callbacks, enable_checkpointing=bool(directory))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(resuming from a checkpoint|ckpt_path|dataloader).*")
        trainer.fit(model, ckpt_path=ckpt_path)
    return model, trainer


def _checkpoints(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.ckpt"), key=lambda p: int(p.stem.rpartition("=")[2]))


def _corrupt(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    checkpoint = torch.load(path, weights_only=True)
    change(checkpoint)
    torch.save(checkpoint, path)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Three checkpoints (steps 1-3) of a bf16-true run with FP32 masters and AdamW, its losses, and the losses of the
    same run without checkpoints."""
    from trainer_pkg import StablePrecision

    directory = tmp_path_factory.mktemp("fingerprint")
    model, _ = _fit(StablePrecision("bf16-true"), 3, directory)
    reference, _ = _fit(StablePrecision("bf16-true"), 3)
    return directory, model.losses, reference.losses


def _copy(written, tmp_path: Path) -> list[Path]:
    paths = []
    for path in _checkpoints(written[0]):
        paths.append(tmp_path / path.name)
        paths[-1].write_bytes(path.read_bytes())
    return paths


def test_every_checkpoint_carries_the_fingerprint_and_saving_changes_nothing(written) -> None:
    directory, losses, reference = written
    assert losses == reference  # the pinned pass at each save left the run exactly as without it
    fingerprint = torch.load(_checkpoints(directory)[-1], weights_only=True)["StablePrecision"][KEY]
    assert {"checksums", "manifest", "pinned", "version"} <= set(fingerprint)
    kinds = {path.split("[")[0] for path in fingerprint["checksums"]}
    assert kinds == {"state_dict", "optimizer_states", "plugin"}
    assert any("['masters']" in path for path in fingerprint["checksums"])
    assert fingerprint["manifest"]["precision"] == "bf16-true" and fingerprint["manifest"]["master_weights"] == "fp32"
    pinned = fingerprint["pinned"]
    assert pinned["batch"][0].shape[0] == PIN_ROWS and pinned["deterministic"] and pinned["grad_norm"] > 0


def test_a_clean_resume_passes_bitwise_and_stays_exact(written, tmp_path) -> None:
    from trainer_pkg import StablePrecision

    path = _copy(written, tmp_path)[-1]
    plugin = StablePrecision("bf16-true")
    model, _ = _fit(plugin, 5, ckpt_path=path)
    assert [event["action"] for event in plugin.fingerprint.events] == ["passed", "passed"]  # checksums, pinned pass
    _corrupt(path, lambda c: c["StablePrecision"].pop(KEY))  # the same checkpoint without its fingerprint
    unchecked, _ = _fit(StablePrecision("bf16-true"), 5, ckpt_path=path)
    assert len(model.losses) == 2 and model.losses == unchecked.losses  # the check changed nothing of the run
    saved = torch.load(_checkpoints(written[0])[-1], weights_only=True)["StablePrecision"][KEY]["pinned"]["batch"]
    assert all(torch.equal(a, b) for a, b in zip(plugin.fingerprint.batch, saved))  # carried to the next saves


def _scale_row(c: dict[str, Any]) -> None:
    c["state_dict"]["model.fc2.weight"][3] *= 2


def _masters_through_bf16(c: dict[str, Any]) -> None:
    masters = c["StablePrecision"]["masters"]
    name = next(k for k, v in masters.items() if isinstance(v, torch.Tensor) and v.dim() == 2)
    masters[name] = masters[name].bfloat16().float()


def _flip_optimizer_bit(c: dict[str, Any]) -> None:
    _flip(c["optimizer_states"][0]["state"][0]["exp_avg_sq"], 5, 3)


def _pinned_loss_moved(c: dict[str, Any]) -> None:
    c["StablePrecision"][KEY]["pinned"]["loss"] += 1e-6


@pytest.mark.parametrize(("change", "named"), [
    (_scale_row, r"checksum of weight `state_dict\['model.fc2.weight'\]` differs"),
    (_masters_through_bf16, r"FP32 master `plugin\['masters'\]\[.*round-tripped through BF16"),
    (_flip_optimizer_bit, r"optimizer state `optimizer_states\[0\]\['state'\]\[0\]\['exp_avg_sq'\]`"),
    (_pinned_loss_moved, r"pinned micro-batch's loss is .* after the load, .* at the save \(compared bitwise\)"),
], ids=["weight-row-scaled", "masters-through-bf16", "optimizer-bit-flip", "pinned-loss"])
def test_a_corrupted_checkpoint_is_refused_naming_the_difference(written, tmp_path, change, named) -> None:
    from trainer_pkg import StablePrecision

    path = _copy(written, tmp_path)[-1]
    _corrupt(path, change)
    with pytest.raises(FingerprintMismatch, match=named):
        _fit(StablePrecision("bf16-true"), 4, ckpt_path=path)


def test_warn_loads_the_checkpoint_and_says_what_differs(written, tmp_path) -> None:
    from trainer_pkg import StablePrecision

    path = _copy(written, tmp_path)[-1]
    _corrupt(path, _scale_row)
    plugin = StablePrecision("bf16-true", on_fingerprint_mismatch="warn")
    with pytest.warns(UserWarning, match=r"fails its numeric fingerprint: checksum of weight .* Loaded anyway"):
        _, trainer = _fit(plugin, 4, ckpt_path=path)
    assert trainer.global_step == 4 and plugin.fingerprint.events[0]["action"] == "warned"


@pytest.mark.parametrize("change", [_flip_optimizer_bit, _pinned_loss_moved], ids=["checksum", "pinned-loss"])
def test_previous_resumes_from_the_newest_earlier_checkpoint_that_passes(written, tmp_path, change) -> None:
    from trainer_pkg import StablePrecision

    paths = _copy(written, tmp_path)
    reference, _ = _fit(StablePrecision("bf16-true"), 4, ckpt_path=paths[0])  # resumed from step 1 directly
    _corrupt(paths[-1], change)
    _corrupt(paths[-2], _scale_row)  # the one before fails too: the step-1 checkpoint is the newest that passes
    for step, path in enumerate(paths):  # "earlier" is by modification time: the order they were written in
        os.utime(path, ns=(1_000_000_000 * (step + 1), 1_000_000_000 * (step + 1)))
    assert previous_checkpoints(paths[-1]) == [paths[-2], paths[0]]
    plugin = StablePrecision("bf16-true", on_fingerprint_mismatch="previous")
    with pytest.warns(UserWarning, match=r"step=3.ckpt fails its numeric fingerprint .* resumed from .*step=1.ckpt"
                                         r" \(global_step=1\).*step=2.ckpt failed too"):
        model, trainer = _fit(plugin, 4, ckpt_path=paths[-1])
    assert trainer.global_step == 4 and model.losses == reference.losses  # steps 2-4 again, exactly
    assert plugin.fingerprint.events[-1]["action"] == "passed"


def test_previous_names_the_fallback_that_fails_its_pinned_pass(written, tmp_path) -> None:
    # Step 3 fails its checksums, step 2 (the fallback) its pinned pass: that failure is step 2's, said once, and the
    # run goes on from step 1, loaded once.
    from trainer_pkg import StablePrecision

    paths = _copy(written, tmp_path)
    _corrupt(paths[-1], _flip_optimizer_bit)
    _corrupt(paths[-2], _pinned_loss_moved)
    for step, path in enumerate(paths):
        os.utime(path, ns=(1_000_000_000 * (step + 1), 1_000_000_000 * (step + 1)))
    plugin = StablePrecision("bf16-true", on_fingerprint_mismatch="previous")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, trainer = _fit(plugin, 4, ckpt_path=paths[-1])
    said = [str(w.message) for w in caught if "fails its numeric fingerprint" in str(w.message)]
    assert len(said) == 2 and "step=3.ckpt fails" in said[0] and "resumed from" in said[0]
    assert "step=2.ckpt fails" in said[1] and "pinned micro-batch" in said[1] and "step=1.ckpt" in said[1]
    events = [(Path(e["source"].split(" (")[0]).name, e["action"], Path(e.get("fallback", "")).name)
              for e in plugin.fingerprint.events]
    assert events == [("epoch=0-step=3.ckpt", "previous", "epoch=0-step=2.ckpt"),
                      ("epoch=0-step=2.ckpt", "previous", "epoch=0-step=1.ckpt"),
                      ("epoch=0-step=1.ckpt", "passed", "")]
    assert trainer.global_step == 4


@pytest.mark.parametrize(("failing", "removed", "outcome"), [
    ("b-step=1.ckpt", None, "among 3 .*written at step 3, not before the loaded checkpoint's 1"),
    ("b-step=2.ckpt", "b-step=1.ckpt", "among 3 .*step 2, not before .*; it pinned another micro-batch than the"
                                       " failed file"),
    ("b-step=2.ckpt", None, "b-step=1.ckpt"),
], ids=["later-step", "other-run", "same-run"])
def test_previous_keeps_to_earlier_steps_of_the_same_run(written, tmp_path, failing, removed, outcome) -> None:
    # Run B (other data: another pinned micro-batch) writes into run A's directory after it: A's files are earlier
    # by modification time, but A's steps 2-3 are later than B's and A's step 1 is another run's.
    from trainer_pkg import StablePrecision

    paths = _copy(written, tmp_path)
    _fit(StablePrecision("bf16-true"), 2, tmp_path / "b", n=32)
    for step in (1, 2):
        paths.append(tmp_path / f"b-step={step}.ckpt")
        (tmp_path / "b" / f"epoch=0-step={step}.ckpt").rename(paths[-1])
    _corrupt(tmp_path / failing, _scale_row)
    for order, path in enumerate(paths):
        os.utime(path, ns=(1_000_000_000 * (order + 1),) * 2)
    if removed:
        (tmp_path / removed).unlink()
    plugin = StablePrecision("bf16-true", on_fingerprint_mismatch="previous")
    if outcome.endswith(".ckpt"):
        with pytest.warns(UserWarning, match=rf"{failing} fails .* resumed from .*{outcome} \(global_step=1\)"):
            _, trainer = _fit(plugin, 3, ckpt_path=tmp_path / failing, n=32)
        assert trainer.global_step == 3
        return
    with pytest.raises(FingerprintMismatch, match=rf"'previous': no earlier checkpoint passes {outcome}"):
        _fit(plugin, 3, ckpt_path=tmp_path / failing, n=32)


def test_previous_without_a_passing_checkpoint_raises(written, tmp_path) -> None:
    from trainer_pkg import StablePrecision

    path = tmp_path / "only.ckpt"  # alone in its directory: nothing earlier
    path.write_bytes(_checkpoints(written[0])[0].read_bytes())
    _corrupt(path, _scale_row)
    with pytest.raises(FingerprintMismatch, match="'previous': no earlier checkpoint passes among 0"):
        _fit(StablePrecision("bf16-true", on_fingerprint_mismatch="previous"), 4, ckpt_path=path)


class _Stateful(nn.Module):
    """A forward that changes a buffer (as an FP8 amax history does), a public list and a counter, and draws dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(()))
        self.calls: list[int] = []
        self.count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        self.calls.append(len(self.calls))
        self.count += 1
        return nn.functional.dropout(self.fc(x), 0.5, training=True)


def test_the_pinned_pass_leaves_the_run_as_it_was() -> None:
    from contextlib import nullcontext

    from lit_mpstable.core.fingerprint import pinned_pass

    torch.manual_seed(0)
    module, batch = _Stateful(), torch.randn(3, 4)
    module.calls.append(7)
    rng, calls = torch.get_rng_state(), module.calls

    def loss_fn(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return net(x).pow(2).sum()

    first = pinned_pass(module, loss_fn, batch, forward_context=nullcontext)
    assert int(module.seen) == 0 and module.calls is calls and calls == [7] and module.count == 0
    assert module.training and module.fc.weight.grad is None and torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(pinned_pass(module, loss_fn, batch, forward_context=nullcontext), first)  # seeded: bitwise
    grad = torch.autograd.grad(loss_fn(module, batch), list(module.parameters()))  # what the norm is of (own seed)
    assert first[1] > 0 and len(grad) == 2


def test_a_pinned_pass_that_writes_to_a_weight_says_so() -> None:
    """A training_step with a side effect on the weights (a step-keyed fault, a projection done in place): the pass
    names the parameter instead of recording a loss that a resume would not repeat (the write itself stays: copying
    every weight at each save to undo it costs a model's worth of memory)."""
    from contextlib import nullcontext

    from lit_mpstable.core.fingerprint import pinned_pass

    module, batch = nn.Linear(4, 4), torch.randn(3, 4)
    before = module.weight.detach().clone()

    def loss_fn(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            net.weight.view(-1)[0] = float("nan")
        return net(x).pow(2).sum()

    with pytest.raises(RuntimeError, match=r"wrote to \['weight'\] in place"):
        pinned_pass(module, loss_fn, batch, forward_context=nullcontext)
    assert module.weight.isnan().sum() == 1 and torch.equal(module.weight.view(-1)[1:], before.view(-1)[1:])


# -------------------------------------------------------------------------------------- plugin state and recipes
def test_kahan_compensation_dropped_is_refused(tmp_path) -> None:
    from trainer_pkg import StablePrecision

    _fit(StablePrecision("bf16-true", master_weights="kahan"), 2, tmp_path)
    path = _checkpoints(tmp_path)[-1]

    def drop(c: dict[str, Any]) -> None:
        for tensor in c["StablePrecision"]["compact"]["compensation"].values():
            tensor.zero_()

    _corrupt(path, drop)
    with pytest.raises(FingerprintMismatch, match=r"Kahan compensation `plugin\['compact'\]\['compensation'\].*zeros"):
        _fit(StablePrecision("bf16-true", master_weights="kahan"), 3, ckpt_path=path)


def test_fp8_scale_history_zeroed_is_refused(tmp_path) -> None:
    from trainer_pkg import StablePrecision

    _fit(StablePrecision("bf16-mixed", fp8="delayed"), 2, tmp_path)
    path = _checkpoints(tmp_path)[-1]
    _corrupt(path, lambda c: c["StablePrecision"]["layout"]["fp8"]["model.fc2.amax_history"].zero_())
    with pytest.raises(FingerprintMismatch, match=r"FP8 scaling state `plugin\['layout'\]\['fp8'\]\['model.fc2.amax"):
        _fit(StablePrecision("bf16-mixed", fp8="delayed"), 3, ckpt_path=path)


@pytest.mark.parametrize(("saved", "resumed", "named"), [
    ("current", "mxfp8", "checkpoint trained `model.fc2` in fp8 current (hybrid), this run has it in mxfp8"),
    ("current", None, "checkpoint trained `model.fc2` in fp8 current (hybrid), this run has it in bf16"),
])
def test_a_checkpoint_under_another_recipe_is_named(tmp_path, saved, resumed, named) -> None:
    from trainer_pkg import StablePrecision

    _fit(StablePrecision("bf16-mixed", fp8=saved), 2, tmp_path)
    with pytest.raises(FingerprintMismatch, match=named.replace("(", r"\(").replace(")", r"\)")):
        _fit(StablePrecision("bf16-mixed", fp8=resumed), 3, ckpt_path=_checkpoints(tmp_path)[-1])


def test_another_base_precision_still_resumes_with_a_note(tmp_path) -> None:
    from trainer_pkg import StablePrecision

    _fit(StablePrecision("bf16-mixed"), 2, tmp_path)
    plugin = StablePrecision("32-true")
    _, trainer = _fit(plugin, 3, ckpt_path=_checkpoints(tmp_path)[-1])
    assert trainer.global_step == 3
    assert plugin.fingerprint.events[0]["action"] == "passed"
    assert "precision='bf16-mixed', this run has '32-true'" in plugin.fingerprint.events[0]["notes"][0]


# ---------------------------------------------------------------------------------------------------- Fabric
def _square_loss(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x).float().pow(2).mean()


def _fabric_run(path: Path, *, load: bool, change: Callable[[dict[str, Any]], None] | None = None,
                pin: bool = False, norm: bool = False, precision: str = "bf16-true",
                loss_fn: Callable[[nn.Module, Any], torch.Tensor] = _square_loss, bind: bool = True) -> Any:
    from lightning.fabric import Fabric

    from lit_mpstable.fabric import StablePrecision

    torch.manual_seed(0)
    plugin = StablePrecision(precision)  # type: ignore[arg-type]
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    module = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8) if norm else nn.ReLU(), nn.Linear(8, 2))
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    if bind:
        plugin.setup_optimizers(optimizer)
    state = {"model": model, "optimizer": optimizer, "precision": plugin}
    x = torch.randn(4, 8)
    if pin:
        plugin.pin(loss_fn, x)  # the pinned micro-batch and its loss function, before the first forward
    if load:
        if change is not None:
            _corrupt(path, change)
        fabric.load(path, state)
    for _ in range(2):
        fabric.backward(model(x).float().pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    if not load:
        fabric.save(path, state)
    return plugin


def test_the_fingerprint_rides_in_the_fabric_save(tmp_path) -> None:
    path = tmp_path / "fabric.ckpt"
    _fabric_run(path, load=False)
    fingerprint = torch.load(path, weights_only=True)["precision"][KEY]
    assert {p.split("[")[0] for p in fingerprint["checksums"]} == {"model", "optimizer", "plugin"}
    assert fingerprint["pinned"] == {}  # without plugin.pin Fabric gives the plugin no loss to pin
    assert [e["action"] for e in _fabric_run(path, load=True).fingerprint.events] == ["passed", "passed"]
    named = r"optimizer state `optimizer\['0.weight'\]\['state'\]\[1\]\['exp_avg'\]`"  # by its first parameter
    with pytest.raises(FingerprintMismatch, match=named):
        _fabric_run(path, load=True, change=lambda c: _flip(c["optimizer"]["state"][1]["exp_avg"], 2, 7))


def _fabric_row_scaled(c: dict[str, Any]) -> None:
    c["model"]["0.weight"][3] *= 2


def _fabric_row_scaled_checksum_rewritten(c: dict[str, Any]) -> None:
    _fabric_row_scaled(c)  # and the checksum written for the new numbers: only the pinned loss can tell
    c["precision"][KEY]["checksums"]["model['0.weight']"] = checksum(c["model"]["0.weight"])


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_a_fabric_pinned_loss_rides_in_the_save_and_a_load_recomputes_it(tmp_path, precision: str) -> None:
    # Before: Fabric's fingerprint had no pinned loss (`pinned == {}`, the plugin had no loss function) and the
    # plugin no `pin`: "AttributeError: 'StablePrecision' object has no attribute 'pin'".
    path = tmp_path / "fabric.ckpt"
    _fabric_run(path, load=False, pin=True, precision=precision)
    pinned = torch.load(path, weights_only=True)["precision"][KEY]["pinned"]
    assert set(pinned) == {"batch", "loss", "grad_norm", "deterministic"} and pinned["deterministic"]
    assert pinned["batch"].shape == (4, 8) and pinned["loss"] > 0 and pinned["grad_norm"] > 0
    plugin = _fabric_run(path, load=True, pin=True, precision=precision)
    assert [e["action"] for e in plugin.fingerprint.events] == ["passed", "passed"]  # bitwise, on the CPU
    assert torch.equal(plugin.fingerprint.batch, pinned["batch"])  # the checkpoint's rows, carried on


def _eval_mode_fails(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if not module.training:
        raise AttributeError("'list' object has no attribute 'values'")  # losses only in train mode
    return _square_loss(module, x)


@pytest.mark.parametrize("bind", [True, False])
def test_a_fabric_pinned_pass_that_raises_neither_stops_a_save_nor_a_load(tmp_path, bind: bool) -> None:
    # Before: the AttributeError came out of fabric.save, and out of the first forward after fabric.load.
    path, mixed = tmp_path / "fabric.ckpt", "bf16-mixed"  # no masters: bind=False is a sound load order
    with pytest.warns(UserWarning, match=r"no pinned loss .* raised AttributeError"):
        _fabric_run(path, load=False, pin=True, loss_fn=_eval_mode_fails, precision=mixed)
    fingerprint = torch.load(path, weights_only=True)["precision"][KEY]
    assert fingerprint["pinned"] == {} and fingerprint["checksums"]
    _fabric_run(path, load=False, pin=True, precision=mixed)  # a pinned loss, and a loss_fn that cannot recompute it
    plugin = _fabric_run(path, load=True, pin=True, loss_fn=_eval_mode_fails, bind=bind, precision=mixed)
    assert {e["action"] for e in plugin.fingerprint.events} == {"passed"}
    notes = [note for event in plugin.fingerprint.events for note in event["notes"]]
    assert notes == ["the pinned micro-batch's loss was not compared (AttributeError: 'list' object has no attribute"
                     " 'values')"]  # kept until the optimizers' part records the check (bind=False)


def test_a_fabric_save_with_a_pinned_loss_leaves_the_run_as_it_was(tmp_path) -> None:
    # The pinned pass at each save (BatchNorm in the model: its statistics are put back) changes nothing of the run.
    from lightning.fabric import Fabric

    from lit_mpstable.fabric import StablePrecision

    def run(save: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        plugin = StablePrecision("bf16-true")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        module = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
        x = torch.randn(16, 8)
        plugin.pin(_square_loss, x)
        for step in range(4):
            fabric.backward(model(x[4 * step:4 * step + 4]).float().pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            if save:
                fabric.save(tmp_path / f"step={step}.ckpt", {"model": model, "optimizer": optimizer,
                                                              "precision": plugin})
        return {**module.state_dict(), **{f"master.{k}": v for k, v in plugin.state_dict()["masters"].items()}}

    saved, plain = run(True), run(False)
    assert torch.load(tmp_path / "step=3.ckpt", weights_only=True)["precision"][KEY]["pinned"]["loss"] > 0
    assert saved.keys() == plain.keys() and all(torch.equal(saved[k], plain[k]) for k in saved)


def test_a_weight_row_scaled_in_a_fabric_checkpoint_is_refused_naming_the_pinned_loss(tmp_path) -> None:
    # 32-true: the model's weights are the run's (with FP32 masters the plugin's masters are, and a load writes them
    # into the model: a row scaled in the model's part of the file is overwritten, the masters' checksums cover them).
    path = tmp_path / "fabric.ckpt"
    _fabric_run(path, load=False, pin=True, precision="32-true")
    with pytest.raises(FingerprintMismatch, match=r"checksum of weight `model\['0.weight'\]` differs .*; the pinned"
                                                  r" micro-batch's loss is .* after the load, .* at the save"):
        _fabric_run(path, load=True, pin=True, precision="32-true", change=_fabric_row_scaled)
    with pytest.raises(FingerprintMismatch, match=r"fabric.load: the checkpoint fails its numeric fingerprint: the"
                                                  r" pinned micro-batch's loss is .*; the pinned micro-batch's"
                                                  r" grad norm is"):
        _fabric_run(path, load=True, pin=True, precision="32-true", change=_fabric_row_scaled_checksum_rewritten)
    # Without a loss function the load checks the rest and says the pinned loss went unchecked.
    plugin = _fabric_run(path, load=True, precision="32-true", change=_fabric_row_scaled_checksum_rewritten)
    assert plugin.fingerprint.events[-1]["action"] == "passed"
    assert "no loss function was given (plugin.pin" in plugin.fingerprint.events[-1]["notes"][0]


def test_a_fabric_pin_is_checked() -> None:
    from lightning.fabric import Fabric

    from lit_mpstable.fabric import StablePrecision

    plugin = StablePrecision("32-true")
    Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    with pytest.raises(ValueError, match=r"pin\(loss_fn=3\): must be a callable \(module, batch\) -> loss"):
        plugin.pin(3, torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"pin\(batch=\['no tensor'\]\): must hold a tensor"):
        plugin.pin(_square_loss, ["no tensor"])
    with pytest.raises(ValueError, match=r"and its first rows at most 1 MiB"):
        plugin.pin(_square_loss, torch.zeros(4, 1 << 17))


def test_a_fabric_load_checks_batchnorm_before_the_first_forward_moves_its_statistics(tmp_path) -> None:
    # The loaded model's checksums are compared before the first forward after fabric.load: a training forward moves
    # BatchNorm's running statistics (and FP8 histories), which the checksums cover.
    path = tmp_path / "fabric.ckpt"
    _fabric_run(path, load=False, pin=True, norm=True)
    plugin = _fabric_run(path, load=True, pin=True, norm=True)
    assert [e["action"] for e in plugin.fingerprint.events] == ["passed", "passed"]


def test_nvfp4_manifest_holds_sr_keys_and_hadamard_signs_and_resumes_bitwise(tmp_path) -> None:
    from trainer_pkg import StablePrecision

    _fit(StablePrecision("bf16-mixed", fp8="nvfp4"), 2, tmp_path)
    path = _checkpoints(tmp_path)[-1]
    layers = torch.load(path, weights_only=True)["StablePrecision"][KEY]["manifest"]["layers"]
    assert list(layers) == ["model.fc2"] and layers["model.fc2"]["recipe"] == "nvfp4"
    assert isinstance(layers["model.fc2"]["sr_key"], int) and isinstance(layers["model.fc2"]["hadamard"], int)
    plugin = StablePrecision("bf16-mixed", fp8="nvfp4")
    _fit(plugin, 3, ckpt_path=path)
    assert [event["action"] for event in plugin.fingerprint.events] == ["passed", "passed"]  # SR included, bitwise
    _corrupt(path, lambda c: c["StablePrecision"][KEY]["manifest"]["layers"]["model.fc2"].update(sr_key=1))
    with pytest.raises(FingerprintMismatch, match="`model.fc2`: the checkpoint was trained with other stochastic-r"):
        _fit(StablePrecision("bf16-mixed", fp8="nvfp4"), 3, ckpt_path=path)


# --------------------------------------------------------------------------------------------------------- DDP
@pytest.mark.slow
def test_ddp_ranks_fall_back_to_the_same_checkpoint(tmp_path) -> None:
    import json
    from datetime import timedelta

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy
    from trainer_pkg import StablePrecision, pl

    class Events(pl.Callback):
        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            events = trainer.precision_plugin.fingerprint.events
            (tmp_path / f"rank{trainer.global_rank}.json").write_text(json.dumps(events))

    def fit(steps: int, ckpt: Path | None = None) -> None:
        torch.manual_seed(0)
        callbacks = [Events()] if ckpt else [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)]
        trainer = make_trainer(StablePrecision("bf16-true", on_fingerprint_mismatch="previous"), max_steps=steps,
                               devices=2, strategy=DDPStrategy(start_method="fork", timeout=timedelta(seconds=60)),
                               callbacks=callbacks, enable_checkpointing=not ckpt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(make_module(optimizer="adamw", lr=1e-2), ckpt_path=ckpt)

    fit(2)
    paths = _checkpoints(tmp_path)
    _corrupt(paths[-1], _flip_optimizer_bit)
    for step, path in enumerate(paths):
        os.utime(path, ns=(1_000_000_000 * (step + 1),) * 2)
    fit(3, ckpt=paths[-1])
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0] == ranks[1]  # the same checks, differences and fallback on both ranks
    assert [e["action"] for e in ranks[0]] == ["previous", "passed"]  # the fallback, then its pinned pass
    assert ranks[0][0]["fallback"].endswith("step=1.ckpt") and "exp_avg_sq" in ranks[0][0]["differences"][0]


def test_a_tensor_listed_twice_is_read_once_and_both_names_are_checked(monkeypatch) -> None:
    import lit_mpstable.core.fingerprint as fp

    shared = torch.randn(8, 4)  # tied weights: one tensor under two names
    trees = {"state_dict": {"embed.weight": shared, "head.weight": shared, "head.bias": torch.randn(8)}}
    seen: list[int] = []
    real = fp._host_array
    monkeypatch.setattr(fp, "_host_array", lambda t: (seen.append(t.numel()), real(t))[1])
    sums = fp.checksums(trees)
    assert sorted(seen) == [8, 32]  # the shared tensor once
    assert sums["state_dict['embed.weight']"] == sums["state_dict['head.weight']"] == fp.checksum(shared)
    untied = {"state_dict": {**trees["state_dict"], "head.weight": shared.clone()}}
    _flip(untied["state_dict"]["head.weight"], 3)
    found = compare_checksums(sums, untied)
    assert len(found) == 1 and "`state_dict['head.weight']` differs" in found[0]


def test_a_manual_optimization_fit_saves_and_resumes_with_checksums_and_no_pinned_pass(tmp_path) -> None:
    # Its training_step steps the optimizers itself: the plugin cannot replay it as a measurement (it would backward
    # twice and step), so the fingerprint holds the checksums and the manifest, and says why it holds no pinned loss.
    from lightning.pytorch.callbacks import ModelCheckpoint
    from trainer_pkg import StablePrecision

    def fit(plugin: Any, steps: int, ckpt_path: Path | None = None) -> Any:
        torch.manual_seed(0)
        model = make_module(optimizer="adamw", lr=1e-2)
        model.automatic_optimization = False

        def training_step(batch: Any, batch_idx: int) -> torch.Tensor:
            optimizer = model.optimizers()
            loss = nn.functional.mse_loss(model(batch[0]).float(), batch[1])
            optimizer.zero_grad()
            model.manual_backward(loss)
            optimizer.step()
            return loss

        model.training_step = training_step
        trainer = make_trainer(plugin, max_steps=steps, enable_checkpointing=True,
                               callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)])
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*(resuming from a checkpoint|ckpt_path|dataloader).*")
            trainer.fit(model, ckpt_path=ckpt_path)
        return model

    fit(StablePrecision("bf16-mixed"), 3)
    path = _checkpoints(tmp_path)[-1]
    fingerprint = torch.load(path, weights_only=True)["StablePrecision"][KEY]
    assert not fingerprint["pinned"] and fingerprint["checksums"]
    plugin = StablePrecision("bf16-mixed")
    fit(plugin, 4, ckpt_path=path)
    assert [event["action"] for event in plugin.fingerprint.events] == ["passed"]
    _corrupt(path, lambda c: c["state_dict"]["model.fc1.weight"].mul_(2))
    with pytest.raises(FingerprintMismatch, match=r"state_dict\['model.fc1.weight'\]"):
        fit(StablePrecision("bf16-mixed"), 4, ckpt_path=path)


class _Accumulates(nn.Module):
    """State a metric keeps outside buffers: a tensor attribute summed in place, one rebound, a private counter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.total, self.last = torch.zeros(()), torch.zeros(())
        self._updates = 0
        self._cached: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        self.total += out.detach().sum()
        self.last = out.detach().sum()
        self._updates += 1
        self._cached = out.detach()
        return out


def test_the_pinned_pass_puts_back_tensor_attributes_and_private_counters() -> None:
    """A torchmetrics Metric's states are plain tensor attributes (and its counters private): a pass through the
    training step updated them at every save (train metrics changed by checkpointing)."""
    from contextlib import nullcontext

    from lit_mpstable.core.fingerprint import pinned_pass

    module = _Accumulates()
    total = module.total
    pinned_pass(module, lambda net, x: net(x).pow(2).sum(), torch.randn(3, 4), forward_context=nullcontext)
    assert module.total is total and float(total) == 0.0  # before: the pass's sum
    assert float(module.last) == 0.0 and module._updates == 0 and module._cached is None


def test_a_custom_block_recipe_is_named_as_itself_in_the_manifest_difference(tmp_path) -> None:
    # The description once tested the recipe's name against the built-in block recipes: a custom NVFP4 recipe read
    # "fp8 nv2 (hybrid)", a per-tensor FP8 recipe it is not.
    from trainer_pkg import StablePrecision

    from lit_mpstable.fp8 import FP8Config, recipe

    _fit(StablePrecision("bf16-mixed", fp8="nvfp4"), 2, tmp_path)
    custom = FP8Config(recipe=recipe("nvfp4", name="nv2", stochastic_rounding=()))
    with pytest.raises(FingerprintMismatch, match=r"trained `model.fc2` in nvfp4, this run has it in nv2\b"):
        _fit(StablePrecision("bf16-mixed", fp8=custom), 3, ckpt_path=_checkpoints(tmp_path)[-1])

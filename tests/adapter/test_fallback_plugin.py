"""StablePrecision.fallback / restore_precision: global and per module, mixed and true modes, and state."""

from __future__ import annotations

import contextlib

import lightning.pytorch as pl
import pytest
import torch
from helpers import make_module, make_trainer

from lit_mpstable import StablePrecision


class _Switch(pl.Callback):
    """Calls fallback at step `at` and restore_precision at step `back`; records the fc2 output dtype per step."""

    def __init__(self, modules, at: int, back: int | None = None) -> None:
        self.modules, self.at, self.back = modules, at, back
        self.dtypes: list[tuple[torch.dtype, torch.dtype]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Decisions take effect from the next batch (Lightning converts a batch's inputs before its hooks run).
        plugin = trainer.precision_plugin
        if trainer.global_step == self.at:
            plugin.fallback(self.modules, reason="test")
        if trainer.global_step == self.back:
            plugin.restore_precision()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        plugin = trainer.precision_plugin
        seen = {}

        def record(name):
            def hook(module, inputs, output) -> None:
                seen[name] = output.dtype

            return hook

        handles = [pl_module.model.get_submodule(n).register_forward_hook(record(n)) for n in ("fc2", "fc3")]
        with plugin.forward_context():
            pl_module(plugin.convert_input(batch[0]))
        for handle in handles:
            handle.remove()
        self.dtypes.append((seen["fc2"], seen["fc3"]))


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_global_fallback_and_restore(precision: str) -> None:
    plugin = StablePrecision(precision)
    switch = _Switch(None, at=1, back=3)
    module = make_module(optimizer="adamw", lr=1e-2)
    make_trainer(plugin, max_steps=4, callbacks=[switch]).fit(module)
    bf, fp = (torch.bfloat16,) * 2, (torch.float32,) * 2
    assert switch.dtypes == [bf, fp, fp, bf]
    assert not plugin.fallback_active and plugin.compute_dtype == torch.bfloat16
    assert all(torch.isfinite(p).all() for p in module.parameters())


class _FallbackAtBatchStart(pl.Callback):
    """Calls ``plugin.fallback(None)`` (or restore_precision) from on_train_batch_start: after Lightning converted
    the batch for the precision in force."""

    def __init__(self, at: int, back: int | None = None) -> None:
        self.at, self.back = at, back

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at:
            trainer.precision_plugin.fallback(None, reason="test")
        if trainer.global_step == self.back:
            trainer.precision_plugin.restore_precision()


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
@pytest.mark.parametrize("master_weights", [True, False])
def test_a_fallback_from_on_train_batch_start_runs_that_batch_in_the_new_precision(precision, master_weights) -> None:
    plugin = StablePrecision(precision, master_weights=master_weights)
    module = make_module(optimizer="sgd", lr=1e-2)
    make_trainer(plugin, callbacks=[_FallbackAtBatchStart(at=1, back=3)], max_steps=5).fit(module)
    assert plugin.step_count == 5 and plugin.skipped_steps == 0
    assert module.model.fc1.weight.dtype == plugin.dtype  # restored at step 3
    assert all(torch.isfinite(p).all() for p in module.parameters())


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_module_fallback_moves_only_that_module(precision: str) -> None:
    plugin = StablePrecision(precision)
    switch = _Switch(["model.fc2"], at=1)
    module = make_module(optimizer="adamw", lr=1e-2)
    make_trainer(plugin, max_steps=3, callbacks=[switch]).fit(module)
    # Mixed: autocast is off inside the island; true: its weights are FP32 and its output is cast back down.
    island_out = torch.float32 if precision == "bf16-mixed" else torch.bfloat16
    assert switch.dtypes == [(torch.bfloat16, torch.bfloat16)] + [(island_out, torch.bfloat16)] * 2
    assert module.model.fc2.weight.dtype == (torch.float32 if precision == "bf16-true" else torch.float32)
    assert module.model.fc3.weight.dtype == (torch.bfloat16 if precision == "bf16-true" else torch.float32)
    assert plugin.fallback_active and plugin.islands.names == ["model.fc2"]
    layout = plugin.state_dict()["layout"]
    assert layout["fp32_modules"] == ["model.fc2"] and layout["fp32"] is False


def test_fallback_survives_resume(tmp_path) -> None:
    plugin = StablePrecision("bf16-true")
    trainer = make_trainer(plugin, max_steps=-1, max_epochs=1, callbacks=[_Switch(["model.fc2"], at=1)])
    trainer.fit(make_module(optimizer="adamw", lr=1e-2))
    trainer.save_checkpoint(tmp_path / "fb.ckpt")
    resumed = StablePrecision("bf16-true")
    module = make_module(optimizer="adamw", lr=1e-2)
    make_trainer(resumed, max_steps=-1, max_epochs=2).fit(module, ckpt_path=tmp_path / "fb.ckpt")
    assert resumed.fallback_active and resumed.islands.names == ["model.fc2"]
    assert module.model.fc2.weight.dtype == torch.float32 and module.model.fc3.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("modules", [None, ["model.fc2"]])
def test_true_mode_fallback_without_masters_keeps_adam_state_in_the_parameters_dtype(modules) -> None:
    # bf16-true with master_weights=False: the optimizer steps the model's own parameters. A fallback that recasts
    # them to FP32 must recast AdamW's moments too (its lerp_ refuses a BF16 exp_avg with an FP32 gradient), and a
    # restore must bring both back to BF16.
    plugin = StablePrecision("bf16-true", master_weights=False)
    module = make_module(optimizer="adamw", lr=1e-2)
    make_trainer(plugin, max_steps=5, callbacks=[_Switch(modules, at=1, back=3)]).fit(module)
    opt = module.trainer.optimizers[0]
    for param in module.parameters():
        assert param.dtype == torch.bfloat16
        state = opt.state[param]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        assert int(state["step"]) == 5
        assert torch.isfinite(param).all()


@pytest.mark.parametrize("master_weights", [
    pytest.param("kahan", marks=pytest.mark.slow),  # compiles the fused Kahan Adam kernel on first use (~3 s)
    "stochastic", True])
def test_resume_with_a_global_fallback_active_is_exact(master_weights, tmp_path) -> None:
    # With 16-bit weights (kahan, stochastic), a global fallback holds the model in FP32 and the checkpoint holds
    # those FP32 weights. Lightning loads them into the resumed model (still BF16) before the plugin's state re-applies
    # the fallback: the resumed run must still continue from the saved FP32 values, as the uninterrupted run does.
    def fit(epochs, ckpt=None):
        torch.manual_seed(0 if ckpt is None else 1)
        module = make_module(optimizer="adamw", lr=1e-2)
        plugin = StablePrecision("bf16-true", master_weights=master_weights)
        trainer = make_trainer(plugin, max_steps=-1, max_epochs=epochs, callbacks=[_Switch(None, at=1)])
        trainer.fit(module, ckpt_path=ckpt)
        return trainer, module

    _, whole = fit(2)
    first, _ = fit(1)
    first.save_checkpoint(tmp_path / "fb.ckpt")
    _, resumed = fit(2, ckpt=tmp_path / "fb.ckpt")
    for (name, a), b in zip(whole.named_parameters(), resumed.parameters()):
        assert a.dtype == b.dtype == torch.float32
        assert torch.equal(a, b), f"{name}: max |diff| {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "16-true"])
def test_a_tied_head_as_an_island_or_a_fallback_trains_and_says_what_moved(precision: str) -> None:
    # GPT-2's tie (head.weight is emb.weight) with the README's fp32_modules=["model.head"], or a module fallback
    # onto that head mid-run: both modules run in FP32 together in the *-true modes; *-mixed keeps the island as is.
    from cb_helpers import TiedLM
    from trainer_pkg import StablePrecision as Plugin
    from trainer_pkg import pl as trainer_pl

    class HeadFallback(trainer_pl.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step == 1:
                trainer.precision_plugin.fallback(["model.head"], reason="test")

    true_mode = precision != "bf16-mixed"
    island = Plugin(precision, fp32_modules=["model.head"])
    with pytest.warns(UserWarning, match=r"takes 'model\.emb' \(holds 'model\.head\.weight'\) into FP32 too") \
            if true_mode else contextlib.nullcontext():
        make_trainer(island, max_steps=2).fit(TiedLM())
    assert island.step_count == 2 and sorted(island.islands.names) == (
        ["model.emb", "model.head"] if true_mode else ["model.head"])
    fallback, module = Plugin(precision), TiedLM()
    expected = r"fallback at step 1: \['model\.head'\] now run in FP32, with \['model\.emb'\]" if true_mode else \
        r"fallback at step 1: \['model\.head'\] now run in FP32 \(test\)"
    with pytest.warns(UserWarning, match=expected):
        make_trainer(fallback, max_steps=3, callbacks=[HeadFallback()]).fit(module)
    assert fallback.step_count == 3 and module.model.emb.weight.dtype == torch.float32
    assert all(torch.isfinite(p).all() for p in module.parameters())

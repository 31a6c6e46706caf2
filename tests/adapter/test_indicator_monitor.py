"""OverflowMonitor(indicators=..., attention=...) through the Trainer: the metrics are logged on logging steps, read in
one host read each, warnings name the layer and the indicator, a resumed run logs what an uninterrupted one does, and
two DDP ranks take the same decisions."""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import GradReads, HostReads, make_trainer
from torch import nn
from torch.nn import functional as F
from trainer_pkg import StablePrecision, pl

from lit_mpstable.callbacks import OverflowMonitor
from lit_mpstable.core.guards.indicators import Indicators

INDICATOR_METRICS = ("mp/update_ratio_max", "mp/adam_lag_frac", "mp/spike_score", "mp/attn_logit_max")


class Block(nn.Module):
    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.n_heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))


class AttentionTask(pl.LightningModule):
    """A one-block causal attention regression; ``rank_scale`` multiplies the inputs of DDP rank 1 only."""

    def __init__(self, lr: float = 0.05, rank_scale: float = 1.0, n: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block, self.lr, self.rank_scale = Block(), lr, rank_scale
        gen = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(n, 6, 8, generator=gen), torch.randn(n, 6, 8, generator=gen)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_rank == 1:
            x = x * self.rank_scale
        return F.mse_loss(self.block(x).float(), y)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class Logged(pl.Callback):
    """The indicator metrics after each batch (list it after the monitor)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if k in INDICATOR_METRICS}
                         | {"step": trainer.global_step})


def _fit(monitor: OverflowMonitor, steps: int, task: AttentionTask | None = None, **kwargs):
    logged = Logged()
    trainer = make_trainer(StablePrecision("bf16-mixed"), max_steps=steps, callbacks=[monitor, logged], **kwargs)
    trainer.fit(task or AttentionTask())
    return trainer, logged.rows


def test_indicators_are_logged_on_logging_steps():
    monitor = OverflowMonitor(log_every_n_steps=2, indicators=True, attention=True)
    _, rows = _fit(monitor, 4)
    assert set(rows[1]) == {*INDICATOR_METRICS, "step"} and rows[1]["step"] == 2
    assert "mp/update_ratio_max" not in rows[0]  # step 1 is not a logging step
    assert 0 < rows[3]["mp/update_ratio_max"] < 1 and 0 <= rows[3]["mp/adam_lag_frac"] <= 1
    assert rows[3]["mp/attn_logit_max"] == max(max(v) for v in monitor.latest_attention.values())
    assert list(monitor.latest_attention) == ["block"] and len(monitor.latest_attention["block"]) == 2


def test_one_host_read_per_logging_step_and_none_on_the_others():
    reads = {}
    for on in (False, True):
        monitor = OverflowMonitor(log_every_n_steps=3, indicators=on, attention=on)
        with HostReads() as seen:
            _fit(monitor, 6)
        reads[on] = seen.ops
    extra = Counter(reads[True]) - Counter(reads[False])
    assert Counter(reads[False]) - Counter(reads[True]) == Counter()
    # Ours: one tolist at steps 3 and 6. Lightning's: each value given to LightningModule.log is made a tensor and
    # read back twice (callback_metrics and the progress bar), 2 reads per metric per logging step, as for every mp/*
    # metric; the 4 indicator metrics add 2 * 4 * 2.
    assert extra == Counter({"tolist": 2, "_local_scalar_dense": 16})


def test_without_a_spike_score_the_rest_is_logged_in_the_same_one_read():
    with HostReads() as plain:
        _fit(OverflowMonitor(log_every_n_steps=2), 4)
    monitor = OverflowMonitor(log_every_n_steps=2, indicators=Indicators(spike_score=False), attention=True)
    with HostReads() as seen:
        _, rows = _fit(monitor, 4)
    assert set(rows[3]) == {*INDICATOR_METRICS, "step"} - {"mp/spike_score"}
    assert rows[3]["mp/attn_logit_max"] == max(max(v) for v in monitor.latest_attention.values())
    assert 0 < rows[3]["mp/update_ratio_max"] < 1
    assert seen.ops.count("tolist") - plain.ops.count("tolist") == 2  # one a logging step


def test_warnings_name_the_layer_and_the_indicator():
    task = AttentionTask(lr=0.05)
    with torch.no_grad():
        task.block.qkv.weight.mul_(40.0)  # logits far above 100
    monitor = OverflowMonitor(log_every_n_steps=1, indicators=Indicators(lag_limit=1e-6, baseline=1), attention=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(monitor, 3, task)
    texts = [str(w.message) for w in caught if "OverflowMonitor" in str(w.message)]
    assert any("Adam lag" in t and "most in 'block." in t for t in texts), texts
    assert any("attention logit of 'block' head" in t and "QKClip" in t for t in texts), texts


def test_a_resumed_run_logs_what_an_uninterrupted_one_does(tmp_path: Path):
    def monitor():
        return OverflowMonitor(log_every_n_steps=2, attention=True,
                               indicators=Indicators(baseline=2, spike_window=2, spike_rolling_window=3))

    # 32 samples, batch 8: 4 steps an epoch; the checkpoint is taken at an epoch's end (Lightning replays a cut one).
    _, whole = _fit(monitor(), -1, AttentionTask(n=32), max_epochs=2)
    first, _ = _fit(monitor(), -1, AttentionTask(n=32), max_epochs=1)
    ckpt = tmp_path / "epoch1.ckpt"
    first.save_checkpoint(ckpt)
    assert set(torch.load(ckpt, weights_only=True)["callbacks"][monitor().state_key]) >= {"indicators"}
    resumed_monitor = monitor()
    logged = Logged()
    trainer = make_trainer(StablePrecision("bf16-mixed"), max_steps=-1, max_epochs=2,
                           callbacks=[resumed_monitor, logged])
    trainer.fit(AttentionTask(n=32), ckpt_path=ckpt)
    assert logged.rows[-1]["step"] == 8 and whole[-1]["step"] == 8
    resumed = {r["step"]: r for r in logged.rows}
    for step in (6, 8):
        assert resumed[step] == pytest.approx(whole[step - 1]), step
    assert whole[5]["mp/spike_score"] == resumed[6]["mp/spike_score"]


def _ddp_run(out_dir: Path):
    import dist_helpers

    class Decisions(pl.Callback):
        def __init__(self, monitor):
            self.monitor = monitor
            self.events: list = []

        def on_train_batch_end(self, trainer, pl_module, *args):
            self.events.append((trainer.global_step, sorted(self.monitor.attention_warned),
                                dict(self.monitor.indicators.above), list(self.monitor.indicators.ratios)))

    monitor = OverflowMonitor(log_every_n_steps=1, indicators=True, attention=True)
    task = AttentionTask(rank_scale=60.0)  # only rank 1's logits pass 100
    return dist_helpers.fit_ddp(task, StablePrecision("bf16-mixed"), [monitor, Decisions(monitor)], out_dir, 3)


@pytest.mark.slow
def test_two_ddp_ranks_take_the_same_decisions(tmp_path: Path):
    ranks = _ddp_run(tmp_path)
    assert ranks[0]["Decisions.events"] == ranks[1]["Decisions.events"]
    assert ranks[0]["Decisions.events"][-1][1] == ["block"]  # rank 1's large logits warned on both ranks


class _CountStep(pl.Callback):
    """The gradient kernels of step ``step`` (a step that does not log), from its batch start to its batch end."""

    def __init__(self, step: int) -> None:
        self.step, self.mode, self.calls = step, None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            self.mode = GradReads()
            self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if self.mode is not None and self.calls is None:
            self.mode.__exit__(None, None, None)
            self.calls = self.mode.over([p.grad for p in pl_module.parameters()])


def test_spike_score_reads_the_steps_one_pass_over_the_gradients():
    """The SpikeScore needs the step's gradient norm: it takes the one the step's gradient check computes (that check
    becomes one _foreach_norm pass) instead of reading every gradient again at the batch's end."""
    counter = _CountStep(3)
    monitor = OverflowMonitor(log_every_n_steps=5, indicators=True)
    trainer = make_trainer(StablePrecision("bf16-mixed"), max_steps=5, callbacks=[monitor, counter])
    trainer.fit(AttentionTask())
    assert counter.calls == ["_foreach_norm"]


def test_a_tensor_zero_before_the_step_has_no_update_ratio():
    """A zero-initialised tensor (a bias, LoRA's B, a zero-init output layer) has RMS 0 before its first step: its
    update has no ratio to it, so it stays out of the logged maximum and of the warning's baseline (it once made the
    first logged value ~1e28 and put that into the baseline)."""
    task = AttentionTask()
    with torch.no_grad():
        task.block.out.bias.zero_()
    before = {name: p.detach().clone() for name, p in task.named_parameters()}
    monitor = OverflowMonitor(log_every_n_steps=1, indicators=True)
    _, rows = _fit(monitor, 1, task)
    moved = {name: float((p.detach() - before[name]).norm() / before[name].norm())
             for name, p in task.named_parameters() if name != "block.out.bias"}
    assert float((task.block.out.bias.detach() - before["block.out.bias"]).norm()) > 0  # it moved, from 0
    assert rows[0]["mp/update_ratio_max"] == pytest.approx(max(moved.values()), rel=1e-4)
    assert monitor.indicators is not None and monitor.indicators.ratios == [rows[0]["mp/update_ratio_max"]]


def test_a_step_with_no_update_ratio_does_not_join_the_baseline():
    """A logging step whose largest ratio is 0 (every tensor zero before it, or a skipped step: nothing moved) says
    nothing about the update's normal size; a median of 0 would make any later update infinitely many times it."""
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    indicators = Indicators(baseline=2, spike_score=False)
    names = ["weight", "bias"]
    logged = []
    for step in range(2):
        indicators.snapshot_(optimizer)
        model(torch.ones(4, 3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        ratios, lags, lag_total = indicators.measure(optimizer)
        logged.append(ratios.tolist())
        assert indicators.judge(logged[-1], lags.tolist(), float(lag_total), names, step) == []
    assert logged[0] == [0.0, 0.0]  # every tensor was 0 before step 0
    assert logged[1] == pytest.approx([1.0, 1.0])  # step 1 has step 0's gradient: its update equals the tensor
    assert indicators.ratios == [max(logged[1])]  # step 0's 0 is left out

    quiet = Indicators(baseline=2, spike_score=False)
    for step in range(2):
        assert quiet.judge([0.0, 0.0], [0.0, 0.0], 0.0, names, step) == []
    assert quiet.judge([0.5, 0.0], [0.0, 0.0], 0.0, names, 2) == []  # no baseline yet: 0.5 is its first value
    assert quiet.ratios == [0.5] and quiet.judged == 3


def test_a_step_skipped_for_inf_nan_is_no_spike_and_leaves_the_windows_seeing():
    # Its inf gradient norm was queued: counted as a spike, then the windows' mean was inf and a real spike after it
    # went unseen for spike_window steps.
    from lit_mpstable.faults import FaultInjector

    def run(schedule: dict) -> OverflowMonitor:
        monitor = OverflowMonitor(indicators=Indicators(spike_window=8), log_every_n_steps=5)
        from lit_mpstable.scaling import DynamicLossScaler

        plugin = StablePrecision("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**8))
        trainer = make_trainer(plugin, max_steps=40, log_every_n_steps=5,
                               callbacks=[monitor, FaultInjector(schedule, module="block.out")])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(AttentionTask())
        return monitor

    clean, overflowed = run({}), run({30: "fp16_overflow"})
    for monitor in (clean, overflowed):
        state = monitor.state_dict()["indicators"]["spike_score"]
        assert state["spikes"] == 0.0 and all(torch.isfinite(torch.tensor(state["history"])).flatten())


class GroupedBlock(nn.Module):
    """Llama's attention layout: 4 query heads share 2 key/value heads (``enable_gqa``); ``stop`` raises after the
    attention when set."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d // 2), nn.Linear(d, d // 2)
        self.stop: BaseException | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.q_proj(x).view(b, t, 4, d // 4).transpose(1, 2)
        k, v = (proj(x).view(b, t, 2, d // 4).transpose(1, 2) for proj in (self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if self.stop is not None:
            raise self.stop
        return out.transpose(1, 2).reshape(b, t, d)


def test_grouped_query_attention_is_measured_per_query_head():
    """It once died at the first logging step: 4 query heads met 2 key heads in q.k^T."""
    task = AttentionTask()
    task.block = GroupedBlock()
    monitor = OverflowMonitor(log_every_n_steps=2, attention=True)
    _, rows = _fit(monitor, 2, task)
    assert len(monitor.latest_attention["block"]) == 4  # one value a query head (the values: test_indicators.py)
    assert rows[1]["mp/attn_logit_max"] == max(monitor.latest_attention["block"])


class _Stop(BaseException):
    """Passes torch's forward hooks, as a KeyboardInterrupt does; Lightning hands it to on_exception, then raises it."""


def test_a_fit_that_raises_in_a_watched_forward_leaves_torchs_function_in_place():
    task = AttentionTask()
    task.block = GroupedBlock()
    task.block.stop = _Stop()
    with pytest.raises(_Stop):
        _fit(OverflowMonitor(log_every_n_steps=1, attention=True), 2, task)
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def _lag_run(task: AttentionTask | None = None, **plugin_kwargs) -> tuple[list[dict[str, float]], list[str]]:
    logged = Logged()
    monitor = OverflowMonitor(log_every_n_steps=2, indicators=Indicators(spike_score=False))
    trainer = make_trainer(StablePrecision("bf16-true", **plugin_kwargs), max_steps=4, callbacks=[monitor, logged])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(task or AttentionTask())
    return logged.rows, [str(w.message) for w in caught if "adam_lag_frac" in str(w.message)]


@pytest.mark.parametrize("state", ["bf16", "fp8"])
def test_adam_lag_reads_the_moments_the_weight_keeper_holds(state):
    """With BF16/FP8 moments the keeper steps Adam itself and optimizer.state holds none: the lag read 0.0 at every
    logging step, so its warning could never fire."""
    reference, _ = _lag_run(master_weights=True)
    rows, notes = _lag_run(master_weights=True, optimizer_state=state)
    assert reference[3]["mp/adam_lag_frac"] > 0 and notes == []
    assert rows[3]["mp/adam_lag_frac"] == pytest.approx(reference[3]["mp/adam_lag_frac"], abs=0.05)


@pytest.mark.parametrize("state", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
def test_adam_lag_of_compact_weights_is_measured_on_the_gradients_they_stepped_with(mode, state):
    """Compact weights free each gradient as they step it: the lag, g^2 against v_hat after the step, had no g, and was
    left out with a warning. The step now keeps a logging step's gradients for the monitor. Against FP32 masters the
    run differs by BF16 rounding only (v_hat stored in BF16, stochastically rounded weights): the coordinates whose
    g^2 / v_hat lies within about 1% of the threshold may change sides, 2 of the 288 here; 0.02 allows 5."""
    reference, _ = _lag_run(master_weights=True, optimizer_state=state)
    rows, notes = _lag_run(master_weights=mode, optimizer_state=state)
    assert notes == [] and "mp/adam_lag_frac" in rows[1]
    assert reference[3]["mp/adam_lag_frac"] > 0
    for step in (1, 3):
        assert rows[step]["mp/adam_lag_frac"] == pytest.approx(reference[step]["mp/adam_lag_frac"], abs=0.02)


class SGDTask(AttentionTask):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def test_adam_lag_of_compact_weights_without_adam_is_not_logged_and_says_why():
    rows, notes = _lag_run(SGDTask(), master_weights="kahan")
    assert "mp/update_ratio_max" in rows[3] and "mp/adam_lag_frac" not in rows[1] and "mp/adam_lag_frac" not in rows[3]
    assert len(notes) == 1 and "exp_avg_sq" in notes[0], notes


def test_adam_lag_of_compact_weights_adds_no_host_read_between_logging_steps():
    """The gradients are kept for the logging step only, read in its one read: the same reads as without the
    indicators but for the logging steps' (as with FP32 masters)."""
    reads = {}
    for on in (False, True):
        monitor = OverflowMonitor(log_every_n_steps=3, indicators=Indicators(spike_score=False) if on else False)
        trainer = make_trainer(StablePrecision("bf16-true", master_weights="kahan"), max_steps=6, callbacks=[monitor])
        with HostReads() as seen:
            trainer.fit(AttentionTask())
        reads[on] = seen.ops
    assert Counter(reads[True]) - Counter(reads[False]) == Counter({"tolist": 2})  # one at steps 3 and 6
    assert Counter(reads[False]) - Counter(reads[True]) == Counter()

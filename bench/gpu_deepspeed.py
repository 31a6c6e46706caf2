"""DeepSpeed observed, on one GPU: Lightning's own ``DeepSpeedStrategy`` (CUDA, NCCL, no CPU shims) with
``OverflowMonitor`` and ``ScaleCheckpoint``, for FP16 and BF16 and ZeRO stages 0-2.

    .venv/bin/python bench/gpu_deepspeed.py            # ~1 min on an H100/H200 (pip install deepspeed)
    .venv/bin/python bench/gpu_deepspeed.py --steps 40 --stages 0 1 2 3

Each run injects inf gradients at fixed steps (before DeepSpeed's step: after ``backward``, into the parameters'
``.grad`` under stage 0, into the loss otherwise, since ZeRO moves gradients into its partitions during backward)
and checks, against the engine's own record (``engine.was_step_applied()`` per step, ``engine.skipped_steps``):

- ``logged_skips``: every skipped step reached ``mp/skipped_steps`` (the target: 100%);
- ``scales``: ``mp/loss_scale`` equals DeepSpeed's FP16 scale step by step (1.0 in BF16);
- ``rollback`` (stage 0): a NaN loss rolls back to the last snapshot, masters and loss scale included; stages 1-3
  refuse the snapshot with the reason (``refused``).

Without CUDA or without DeepSpeed it prints why and exits 0. Writes a Markdown table to stdout and JSON to
``--out`` (default ``bench/results/gpu_deepspeed.json``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def _module_class() -> type:
    import lightning.pytorch as pl

    class Faulty(pl.LightningModule):
        """A 3-layer MLP regression; inf gradients at ``inf_steps``, a NaN loss at ``nan_step``."""

        def __init__(self, inf_steps: set[int], nan_step: int | None, grads: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
            self.inf_steps, self.nan_step, self.grads = inf_steps, nan_step, grads
            self.x, self.y = torch.randn(512, 64), torch.randn(512, 8)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.model(x).float(), y.float())
            if self.global_step == self.nan_step:
                return loss * math.nan
            if not self.grads and self.global_step in self.inf_steps:
                return loss * math.inf
            return loss

        def on_after_backward(self) -> None:
            if self.grads and self.global_step in self.inf_steps:
                self.model[2].weight.grad.view(-1)[0] = math.inf

        def train_dataloader(self):
            data = torch.utils.data.TensorDataset(self.x, self.y)
            return torch.utils.data.DataLoader(data, batch_size=32)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Faulty


def run(precision: str, stage: int, steps: int, folder: Path) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from lit_mpstable.callbacks import OverflowMonitor, ScaleCheckpoint

    inf_steps = {3, 7, 8, steps - 4}
    engine_skips: list[bool] = []
    engine_scales: list[float] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            engine = trainer.strategy.model
            engine_skips.append(not engine.was_step_applied())
            engine_scales.append(float(getattr(engine.optimizer, "loss_scale", 1.0)))

    monitor = OverflowMonitor(window=8, log_every_n_steps=1)
    checkpoint = ScaleCheckpoint(every_n_steps=5, on_spike="rollback", min_history=2)
    module = _module_class()(inf_steps, nan_step=steps - 2 if stage == 0 else None, grads=stage == 0)
    trainer = pl.Trainer(
        accelerator="cuda", devices=1, precision=precision, max_steps=steps, log_every_n_steps=1,
        strategy=DeepSpeedStrategy(stage=stage, initial_scale_power=12, hysteresis=1, loss_scale_window=1000),
        callbacks=[monitor, checkpoint, Record()], logger=CSVLogger(folder, name=f"{precision}-{stage}"),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    result: dict[str, Any] = dict(precision=precision, stage=stage, steps=steps)
    try:
        trainer.fit(module)
    except ValueError as err:  # ZeRO >= 1: the snapshot is refused at train start, with the reason
        result.update(refused=str(err).split(":")[0], ok="ZeRO stage" in str(err) and stage > 0)
        return result
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = {int(r["step"]): float(r["mp/skipped_steps"]) for r in rows if r.get("mp/skipped_steps")}
    scales = {int(r["step"]): float(r["mp/loss_scale"]) for r in rows if r.get("mp/loss_scale")}
    engine = trainer.strategy.model
    cumulative = [sum(engine_skips[: i + 1]) for i in range(len(engine_skips))]
    logged_ok = sum(1 for i, skipped in enumerate(engine_skips)
                    if skipped and logged.get(i) == cumulative[i])
    result.update(
        engine_skipped=engine.skipped_steps, logged_skips=f"{logged_ok}/{sum(engine_skips)}",
        scales_match=[scales.get(i) for i in range(len(engine_scales))] == engine_scales,
        rollbacks=checkpoint.rollbacks,
        ok=logged_ok == sum(engine_skips) > 0 and (stage > 0 or checkpoint.rollbacks == 1),
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--precisions", nargs="+", default=["16-mixed", "bf16-mixed"])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu_deepspeed.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_deepspeed: no CUDA device here; nothing to measure"
              " (tests/adapter/test_deepspeed.py runs on the CPU).")
        return 0
    try:
        import deepspeed
    except ImportError:
        print("gpu_deepspeed: DeepSpeed is not installed (pip install 'lit_mpstable[deepspeed]').")
        return 0
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for precision in args.precisions:
            for stage in args.stages:
                results.append(run(precision, stage, args.steps, Path(folder)))
    print("| precision | ZeRO | skipped (engine) | logged | scales match | rollbacks | refused | ok |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['precision']} | {r['stage']} | {r.get('engine_skipped', '')} | {r.get('logged_skips', '')} |"
              f" {r.get('scales_match', '')} | {r.get('rollbacks', '')} | {r.get('refused', '')} | {r['ok']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, deepspeed=deepspeed.__version__,
        python=platform.python_version(), results=results), indent=2))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

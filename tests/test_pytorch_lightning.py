"""The adapter suites again, on the standalone ``pytorch_lightning`` package's class tree (written once: they import
the Trainer package and our classes through ``tests/trainer_pkg.py``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SUITES = ["test_plugin.py", "test_master_plugin.py", "test_callbacks.py",
          "test_cb_rollback.py", "test_foreign_plugins.py", "test_cb_fallback.py", "test_telemetry_plugin.py",
          "test_cb_resume.py"]


def test_our_classes_live_on_the_pytorch_lightning_tree() -> None:
    import lightning.pytorch
    import pytorch_lightning

    from lit_mpstable.pytorch_lightning import StablePrecision
    from lit_mpstable.pytorch_lightning.callbacks import OverflowMonitor

    assert issubclass(StablePrecision, pytorch_lightning.plugins.precision.Precision)
    assert not issubclass(StablePrecision, lightning.pytorch.plugins.precision.Precision)
    assert issubclass(OverflowMonitor, pytorch_lightning.Callback)
    trainer = pytorch_lightning.Trainer(plugins=[StablePrecision("bf16-mixed")], callbacks=[OverflowMonitor()],
                                        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert trainer.precision_plugin.precision == "bf16-mixed"


@pytest.mark.slow
def test_the_adapter_suites_pass_on_pytorch_lightning() -> None:
    here = Path(__file__).parent
    env = {**os.environ, "LIT_MPSTABLE_TEST_TRAINER": "pytorch_lightning"}
    code = ("import sys, trainer_pkg; assert trainer_pkg.pl.__name__ == 'pytorch_lightning';"
            " import pytest; sys.exit(pytest.main(sys.argv[1:]))")
    args = [sys.executable, "-c", code, "-q", "-p", "no:cacheprovider", *[str(here / "adapter" / s) for s in SUITES]]
    result = subprocess.run(args, cwd=here, env=env, capture_output=True, text=True, timeout=600)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert int(re.search(r"(\d+) passed", summary).group(1)) >= 100, summary

"""The numerics core imports with Lightning, Hydra and OmegaConf blocked: it works in a plain PyTorch loop."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import lit_mpstable

# Modules allowed to import Lightning or Hydra: the adapter, the callbacks, configs, the entry point, the demo models.
ADAPTER = {
    "plugin", "fabric", "callbacks", "config", "train", "report", "zoo", "demos", "strategies", "_frontend", "_trainer",
}


def _core_modules() -> list[str]:
    names = [m.name for m in pkgutil.iter_modules(lit_mpstable.__path__)]
    return [f"lit_mpstable.{name}" for name in names if name not in ADAPTER]


def test_core_imports_without_lightning_hydra_omegaconf() -> None:
    modules = _core_modules()
    assert "lit_mpstable.scaling" in modules and "lit_mpstable.formats" in modules
    code = (
        "import sys\n"
        "for name in ('lightning', 'pytorch_lightning', 'hydra', 'omegaconf', 'torchmetrics'):\n"
        "    sys.modules[name] = None\n"
        f"import importlib\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
        "import lit_mpstable\n"
        "assert 'lightning' not in [k for k, v in sys.modules.items() if v is not None]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr

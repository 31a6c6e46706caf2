"""The package's layers: a torch-only core, thin adapters over it, and the app on top; no import cycles.

- core: numerics in pure PyTorch, usable from a plain loop (imports with Lightning, Hydra and torchmetrics blocked);
- adapters: the Trainer, Fabric and pytorch_lightning front ends and the callbacks (Lightning, never Hydra);
- app: the Hydra entry point, configs, the report and the demo models.
A module imports only from its own layer or the ones below, and no two modules import each other, even indirectly
(imports inside functions and under TYPE_CHECKING count: they are dependencies too).
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import lit_mpstable

ROOT = Path(lit_mpstable.__file__).parent
LAYERS = {
    "core": {"_validate", "loaded_state", "formats", "scaling", "master", "compact", "compact_fused", "islands", "layout",
             "telemetry", "attribution", "observer", "policy", "schedulers", "memory", "stepper", "probe", "fp8",
             "checkpoints", "fsdp", "opcalls"},
    "adapters": {"_frontend", "_trainer", "plugin", "strategies", "fabric", "pytorch_lightning", "callbacks"},
    "app": {"config", "train", "report", "report_probe", "showcase", "zoo", "demos", "conf"},
}
RANK = {"core": 0, "adapters": 1, "app": 2}


def _layer(module: str) -> str:
    if module == "lit_mpstable":
        return "core"  # its __init__ imports nothing eagerly (names load lazily)
    top = module.split(".")[1]
    for layer, names in LAYERS.items():
        if top in names:
            return layer
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in {__file__}")


def _modules() -> dict[str, Path]:
    found = {"lit_mpstable": ROOT / "__init__.py"}
    for info in pkgutil.walk_packages([str(ROOT)], prefix="lit_mpstable."):
        spec = info.module_finder.find_spec(info.name)  # type: ignore[union-attr]
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            found[info.name] = Path(spec.origin)
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The lit_mpstable modules ``name`` imports, anywhere in its source."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    return {t for t in targets if t in known and t != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def test_every_module_has_a_layer_and_imports_only_downwards() -> None:
    graph = _graph()
    assert "lit_mpstable.stepper" in graph and "lit_mpstable.pytorch_lightning.callbacks" in graph
    upward = [
        f"{a} ({_layer(a)}) imports {b} ({_layer(b)})" for a, deps in graph.items() for b in deps
        if RANK[_layer(b)] > RANK[_layer(a)]
    ]
    assert not upward, upward


def test_no_import_cycles() -> None:
    graph = _graph()
    # A package's __init__ re-exports its submodules; a submodule importing its own package is not a cycle of code.
    edges = {a: {b for b in deps if not a.startswith(b + ".")} for a, deps in graph.items()}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep] if dep in stack else [node, dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, [" -> ".join(c) for c in cycles]


def _import_blocked(modules: list[str], blocked: tuple[str, ...]) -> subprocess.CompletedProcess:
    code = (
        "import sys\n"
        f"for name in {blocked!r}:\n    sys.modules[name] = None\n"
        f"import importlib\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_core_imports_with_lightning_hydra_and_torchmetrics_blocked() -> None:
    core = [m for m in _graph() if m != "lit_mpstable" and _layer(m) == "core"]
    assert {"lit_mpstable.scaling", "lit_mpstable.stepper", "lit_mpstable.fp8.native"} <= set(core)
    blocked = ("lightning", "pytorch_lightning", "lightning_fabric", "hydra", "omegaconf", "torchmetrics")
    result = _import_blocked(core + ["lit_mpstable"], blocked)
    assert result.returncode == 0, result.stderr


def test_the_adapters_import_with_hydra_blocked() -> None:
    adapters = [m for m in _graph() if m != "lit_mpstable" and _layer(m) == "adapters"]
    assert {"lit_mpstable.plugin", "lit_mpstable.callbacks.overflow_monitor"} <= set(adapters)
    result = _import_blocked(adapters, ("hydra", "omegaconf"))
    assert result.returncode == 0, result.stderr

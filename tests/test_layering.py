"""The package's layers are its folders; each imports only from its own folder or the folders below it.

- ``base/``, ``core/`` and ``fp8/``: the ground, numerics in pure PyTorch (``base/`` holds the argument and key
  checks the other two share); they import with Lightning, Hydra, OmegaConf, torchmetrics, matplotlib and rich
  blocked;
- ``frontends/``: the Trainer and Fabric adapters over core; ``callbacks/`` above them (they read the front end);
  ``pytorch_lightning/``: the same classes on that package, over both;
- ``app/``: the Hydra entry point, its schemas, the report and the demo models (``conf/`` holds YAML only);
- the faces at the top (``lit_mpstable/stepper.py``, ``scaling.py``, ...): public import paths that re-export from
  the folders; no folder imports a face.

``core/`` is layered the same way inside: its own modules are the shared low-level pieces (tensors, counters, formats,
telemetry, the checks of loaded state, ...); above them ``layout/``, ``scaling/`` and ``guards/``, then ``weights/``
(the keepers call the scaler), then ``step/`` (the stepper, over all of them). A folder of core imports only from the
folders ranked below it, never from one of its own rank or above.

A folder never imports a folder above it, nothing imports another folder's private ``_module``, and no two modules
import each other, even indirectly (imports inside functions and under TYPE_CHECKING count: they are dependencies
too). The layers are read from the folders on disk, so a new module needs no entry here.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

import lit_mpstable

ROOT = Path(lit_mpstable.__file__).parent
# Folders, lowest first. base (argument and key checks), core and fp8 are the ground: they share rank 0.
RANK = {"base": 0, "core": 0, "fp8": 0, "frontends": 1, "callbacks": 2, "pytorch_lightning": 3, "app": 4, "conf": 4}
FACE = 5  # lit_mpstable/<name>.py: public faces over the folders
GROUND = ("base", "core", "fp8")
# core's concept folders, lowest first; "" is core's own modules. Folders of one rank never import each other.
CORE_RANK = {"": 0, "layout": 1, "scaling": 1, "guards": 1, "weights": 2, "step": 3}
CORE_MODULES_MAX = 15  # modules directly in core/ (issue 43): the rest belong to a concept folder
# Known debts, each to be removed when fixed (the tests below fail on any new one, and on a fixed one still listed).
KNOWN_FOLDER_CYCLES: set[tuple[str, str]] = set()
KNOWN_PRIVATE_IMPORTS: set[str] = set()


def _folder(module: str) -> str | None:
    """The folder ``module`` lives in, or None for the package itself and its faces."""
    parts = module.split(".")
    if len(parts) > 1 and (ROOT / parts[1]).is_dir():
        return parts[1]
    return None


def _core_folder(module: str) -> str | None:
    """The concept folder of core ``module`` lives in ("" for core's own modules), or None outside core."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] != "core":
        return None
    return parts[2] if len(parts) > 2 and (ROOT / "core" / parts[2]).is_dir() else ""


def _rank(module: str) -> int:
    folder = _folder(module)
    if folder is None:
        return FACE
    assert folder in RANK, f"{module}: folder {folder!r} has no rank: add it to RANK in {__file__}"
    return RANK[folder]


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
    # The package itself is no dependency: every lit_mpstable import runs its (lazy, import-free) __init__.
    return {t for t in targets if t in known and t not in (name, "lit_mpstable")}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _in(folders: tuple[str, ...]) -> list[str]:
    return sorted(m for m in _graph() if _folder(m) in folders)


def test_every_folder_has_a_rank_and_imports_only_downwards() -> None:
    graph = _graph()
    assert {"lit_mpstable.core.step.stepper", "lit_mpstable.fp8.native", "lit_mpstable.frontends.fabric",
            "lit_mpstable.callbacks.overflow_monitor", "lit_mpstable.app.train", "lit_mpstable.stepper"} <= set(graph)
    upward = [f"{a} imports {b}" for a, deps in graph.items() for b in deps if _rank(b) > _rank(a)]
    assert not upward, upward


def test_no_import_cycles_between_folders() -> None:
    graph = _graph()
    edges = {(_folder(a), _folder(b)) for a, deps in graph.items() for b in deps}
    cycles = {tuple(sorted((x, y))) for x, y in edges if x and y and x != y and (y, x) in edges}
    assert cycles <= KNOWN_FOLDER_CYCLES, f"new cycles between folders: {sorted(cycles - KNOWN_FOLDER_CYCLES)}"
    assert cycles >= KNOWN_FOLDER_CYCLES, f"fixed, remove from KNOWN_FOLDER_CYCLES: {KNOWN_FOLDER_CYCLES - cycles}"


def test_core_folders_have_a_rank_and_import_only_downwards() -> None:
    graph = _graph()
    on_disk = {path.name for path in (ROOT / "core").iterdir() if (path / "__init__.py").is_file()}
    assert on_disk | {""} == set(CORE_RANK), f"core's folders {sorted(on_disk)}: give each a rank in CORE_RANK"
    assert {"lit_mpstable.core.step.stepper", "lit_mpstable.core.scaling.loss_scaler",
            "lit_mpstable.core.weights.weights", "lit_mpstable.core.guards.spike",
            "lit_mpstable.core.layout.islands", "lit_mpstable.core.loaded_state"} <= set(graph)
    wrong = [
        f"{a} ({_core_folder(a) or 'core'}) imports {b} ({_core_folder(b) or 'core'})"
        for a, deps in graph.items() if _core_folder(a) is not None
        for b in deps if _core_folder(b) is not None and _core_folder(b) != _core_folder(a)
        and CORE_RANK[_core_folder(b)] >= CORE_RANK[_core_folder(a)]
    ]
    assert not wrong, wrong


def test_no_import_cycles_between_core_folders() -> None:
    graph = _graph()
    edges: dict[str, set[str]] = {}
    for a, deps in graph.items():
        for b in deps:
            fa, fb = _core_folder(a), _core_folder(b)
            if fa is not None and fb is not None and fa != fb:
                edges.setdefault(fa, set()).add(fb)
    # A folder that reaches itself through the others is in a cycle.
    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cyclic = sorted(f or "core" for f in edges if f in reach(f))
    assert not cyclic, f"core's folders in an import cycle: {cyclic}"


def test_core_holds_few_modules_directly() -> None:
    direct = sorted(m for m in _graph() if _core_folder(m) == "" and m != "lit_mpstable.core")
    assert 0 < len(direct) <= CORE_MODULES_MAX, f"{len(direct)} modules directly in core/: {direct}"


def test_nothing_imports_another_folders_private_module() -> None:
    graph = _graph()
    private = {
        f"{a} -> {b}" for a, deps in graph.items() for b in deps
        if b.rpartition(".")[2].startswith("_") and b.rpartition(".")[2] != "__init__"
        and _folder(b) != _folder(a)
    }
    new, fixed = sorted(private - KNOWN_PRIVATE_IMPORTS), KNOWN_PRIVATE_IMPORTS - private
    assert private <= KNOWN_PRIVATE_IMPORTS, f"new imports of a private module: {new}"
    assert private >= KNOWN_PRIVATE_IMPORTS, f"fixed, remove from KNOWN_PRIVATE_IMPORTS: {fixed}"


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


def _import_blocked(modules: list[str], blocked: tuple[str, ...], code: str = "") -> subprocess.CompletedProcess:
    """Import ``modules`` in a fresh interpreter where the ``blocked`` packages look uninstalled.

    One meta-path finder stands in front of the others and finds nothing under a blocked name: ``import`` raises
    ModuleNotFoundError and ``importlib.util.find_spec`` answers None, as without the package (Lightning probes for
    omegaconf that way and must see it absent, not fail).
    """
    script = (
        "import importlib, importlib.abc, sys\n"
        f"BLOCKED = {blocked!r}\n"
        "class Uninstalled(importlib.abc.MetaPathFinder):\n"
        "    def __init__(self, finders):\n"
        "        self.finders = finders\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            return None\n"
        "        for finder in self.finders:\n"
        "            spec = finder.find_spec(name, path, target) if hasattr(finder, 'find_spec') else None\n"
        "            if spec is not None:\n"
        "                return spec\n"
        "        return None\n"
        "    def invalidate_caches(self):\n"
        "        for finder in self.finders:\n"
        "            getattr(finder, 'invalidate_caches', lambda: None)()\n"
        "sys.meta_path[:] = [Uninstalled(list(sys.meta_path))]\n"
        f"{code}"
        f"for m in {modules!r}:\n    importlib.import_module(m)\n"
        "leaked = sorted(m for m in sys.modules if m.split('.')[0] in BLOCKED)\n"
        "assert not leaked, leaked\n"
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def test_core_and_fp8_import_torch_only() -> None:
    ground = _in(GROUND)
    assert {
        "lit_mpstable.core.scaling.loss_scaler", "lit_mpstable.core.scaling.scalers", "lit_mpstable.core.step.stepper",
        "lit_mpstable.fp8.native",
    } <= set(ground)
    blocked = ("lightning", "lightning_fabric", "pytorch_lightning", "hydra", "omegaconf", "torchmetrics",
               "matplotlib", "rich")
    # Importing the package and core/__init__ runs nothing: no core module is loaded by them.
    nothing = ("import lit_mpstable, lit_mpstable.core\n"
               "assert not [m for m in sys.modules if m.startswith('lit_mpstable.core.')], 'core/__init__ imports'\n")
    result = _import_blocked(["lit_mpstable", *ground], blocked, nothing)
    assert result.returncode == 0, result.stderr


def _external(path: Path) -> set[str]:
    """The top-level names of the packages a source file imports (absolute imports only)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_frontends_and_callbacks_import_with_hydra_blocked() -> None:
    adapters = _in(("frontends", "callbacks", "pytorch_lightning"))
    assert {"lit_mpstable.frontends.trainer", "lit_mpstable.callbacks.overflow_monitor"} <= set(adapters)
    result = _import_blocked(adapters, ("hydra", "omegaconf"))
    assert result.returncode == 0, result.stderr


def test_only_the_app_imports_hydra_matplotlib_and_rich() -> None:
    # Read from the source: Lightning's torchmetrics imports matplotlib itself when it is installed, so blocking it
    # at import time would test Lightning, not us.
    app_only = {"hydra", "omegaconf", "matplotlib", "rich"}
    modules = _modules()
    found = [f"{name} imports {sorted(_external(path) & app_only)}" for name, path in modules.items()
             if _folder(name) not in ("app", None) and _external(path) & app_only]
    assert not found, found


def test_the_faces_reexport_the_folders_objects() -> None:
    import importlib

    faces = {"stepper": ["core.step.stepper"], "fabric": ["frontends.fabric"], "plugin": ["frontends.trainer"],
             "train": ["app.train"], "config": ["app.config"],
             "scaling": ["core.scaling.loss_scaler", "core.scaling.adaptive_scaler", "core.scaling.scaler_state",
                         "core.scaling.scalers"]}
    for face, homes in faces.items():
        module = importlib.import_module(f"lit_mpstable.{face}")
        sources = [importlib.import_module(f"lit_mpstable.{home}") for home in homes]
        # The homes list no __all__ (only the faces do): a face's names are the homes' own public objects, and the
        # face defines nothing public it does not list.
        exported = {name: getattr(source, name) for source in sources for name in vars(source) if name[0] != "_"}
        assert set(module.__all__) <= set(exported), face
        assert all(getattr(module, name) is exported[name] for name in module.__all__), face
        defined = {name for name, value in vars(module).items()
                   if name[0] != "_" and name != "annotations" and not isinstance(value, types.ModuleType)}
        assert defined == set(module.__all__), face



def test_the_free_tensor_init_context_of_earlier_releases_warns_and_is_the_method() -> None:
    import torch

    import lit_mpstable.stepper as face

    stepper = face.PrecisionStepper("bf16-true", master_weights=False, device="cpu")
    with pytest.warns(DeprecationWarning, match=r"stepper\.tensor_init_context\(\)"):
        alias = face.tensor_init_context
    with alias(stepper):
        assert torch.empty(1).dtype == torch.bfloat16
    assert torch.empty(1).dtype == torch.float32
    with pytest.raises(AttributeError, match="no_such_name"):
        face.no_such_name  # noqa: B018

def test_only_the_faces_list_public_names() -> None:
    # __all__ where users import from, nowhere else; and a surface users can hold (120 names at most, in all).
    faces = {"lit_mpstable", "lit_mpstable.callbacks", "lit_mpstable.fp8", "lit_mpstable.faults",
             "lit_mpstable.scaling", "lit_mpstable.stepper", "lit_mpstable.fabric", "lit_mpstable.plugin",
             "lit_mpstable.train", "lit_mpstable.config", "lit_mpstable.pytorch_lightning",
             "lit_mpstable.pytorch_lightning.callbacks"}
    listed = {name for name, path in _modules().items()
              if any(isinstance(node, (ast.Assign, ast.AnnAssign)) and "__all__" in ast.unparse(node).split("=")[0]
                     for node in ast.parse(path.read_text()).body)}
    assert listed <= faces, sorted(listed - faces)
    import importlib

    names = sum(len(importlib.import_module(face).__all__) for face in listed)
    assert names <= 120, names


def test_no_free_function_takes_the_stepper_first() -> None:
    # STYLE.md: no free functions whose first parameter is another module's object. The stepper's readers take what
    # they read (core.fingerprint.manifest: the layout and plain values) or are its methods.
    found = [f"{name}.{node.name}({node.args.args[0].arg})" for name, path in _modules().items()
             for node in ast.parse(path.read_text()).body
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.args.args
             and ("stepper" in node.args.args[0].arg
                  or "PrecisionStepper" in ast.unparse(node.args.args[0].annotation or ast.Constant(None)))]
    assert found == [], found


@pytest.mark.slow
def test_python_m_lit_mpstable_train_runs_the_app_through_its_face() -> None:
    result = subprocess.run([sys.executable, "-m", "lit_mpstable.train", "--help"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "scaler: adaptive, default, dynamic, none, static" in result.stdout  # Hydra's help lists our config groups

"""FP32 islands: modules that always run in FP32 inside a low-precision model (autocast off, inputs cast up)."""

from __future__ import annotations

import fnmatch
import types
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle


def match_modules(root: nn.Module, specs: Iterable[type[nn.Module] | str]) -> dict[str, nn.Module]:
    """The submodules of ``root`` named by ``specs``: module types, or ``fnmatch`` patterns on qualified names.

    Outermost matches win: a match inside an already matched module is left out (it runs in FP32 anyway).

    Raises:
        ValueError: a spec matches no module (a stale pattern would silently protect nothing).
        TypeError: a spec is neither a string nor an ``nn.Module`` subclass.
    """
    specs = _checked(specs)
    matched: dict[str, nn.Module] = {}
    hits = {id(spec): 0 for spec in specs}
    for name, module in root.named_modules():
        for spec in specs:
            hit = isinstance(module, spec) if isinstance(spec, type) else fnmatch.fnmatchcase(name, spec)
            if hit:
                hits[id(spec)] += 1
                if not any(name.startswith(outer + ".") for outer in matched) and name not in matched:
                    matched[name] = module
    unused = [spec for spec in specs if hits[id(spec)] == 0]
    if unused:
        names = [name for name, _ in root.named_modules() if name][:20]
        raise ValueError(f"fp32_modules={unused!r} match no module of {type(root).__name__}; names look like {names}.")
    return matched


def tied_modules(root: nn.Module, islands: dict[str, nn.Module]) -> dict[str, str]:
    """The modules of ``root`` outside ``islands`` that hold one of their parameters too (a tied weight: GPT-2's head
    is its embedding's ``Parameter``), and those sharing with them in turn, each with the qualified name of the
    parameter it shares; the root module is named ``""``.

    A parameter has one dtype: where islands hold theirs in FP32 and the rest of the model in 16 bits, such a module
    would meet an FP32 weight with 16-bit inputs (or emit FP32 into 16-bit layers), so it runs as an island too.
    """
    shared = {id(p): name for island, module in islands.items() for name, p in module.named_parameters(prefix=island)}
    inside = {id(m) for module in islands.values() for m in module.modules()}
    tied: dict[str, str] = {}
    grown = True
    while grown:  # a module taken along may share another of its parameters further
        grown = False
        for name, module in root.named_modules():
            held = [shared[id(p)] for p in module.parameters(recurse=False) if id(p) in shared]
            if id(module) in inside or not held:
                continue
            tied[name], grown = held[0], True
            inside.update(id(m) for m in module.modules())
            shared.update({id(p): qualified for qualified, p in module.named_parameters(prefix=name)
                           if id(p) not in shared})
    return tied


def _checked(specs: Iterable[Any]) -> list[type[nn.Module] | str]:
    specs = [specs] if isinstance(specs, (str, type)) else list(specs)
    for spec in specs:
        if not (isinstance(spec, str) or (isinstance(spec, type) and issubclass(spec, nn.Module))):
            raise TypeError(f"fp32_modules entry {spec!r}: expected a module type or a qualified-name pattern (str).")
    return specs


def _to_dtype(value: object, dtype: torch.dtype) -> Any:
    """``value`` with every floating tensor in it cast to ``dtype``; lists, tuples, namedtuples (PackedSequence)
    and dicts are rebuilt as the same type."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_to_dtype(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_dtype(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _to_dtype(v, dtype) for k, v in value.items()}
    return value


def _to_fp32(value: object) -> Any:
    return _to_dtype(value, torch.float32)


class FP32Islands:
    """Matched modules run their forward with autocast off and their inputs cast to FP32.

    The module's ``forward`` is wrapped (an instance attribute over the class's: :func:`island_forward` bound to the
    module), and its inputs cast by a forward pre-hook: autocast is turned off by a ``with`` block inside the call,
    which ``torch.compile`` traces into the graph like any other code. (Entering autocast in a forward pre-hook and
    leaving it in a forward hook cannot be traced.) The wrapper is the same function for every module, reading
    :attr:`device_type` and :attr:`output_dtype` from this object when called: re-attaching (a rollback, a restore)
    meets a compiled graph's guards, and ``copy.deepcopy`` of the model gives islands on the copy, run by a copy of this
    object.

    ``attach`` may be called again (a second ``fit``): earlier wrappers are removed first.
    """

    def __init__(self, specs: Iterable[type[nn.Module] | str] = ()) -> None:
        self.specs = _checked(specs)
        self.device_type = "cpu"
        """The device whose autocast the islands turn off (set again when the run's device is known)."""
        self.output_dtype: torch.dtype | None = None
        self.names: list[str] = []
        self._modules: list[nn.Module] = []
        self._handles: list[RemovableHandle] = []

    def attach(self, root: nn.Module, *, device_type: str, output_dtype: torch.dtype | None) -> None:
        """Wrap the matched modules of ``root``; ``output_dtype`` casts their outputs back (``*-true`` modes)."""
        self.detach()
        self.device_type, self.output_dtype = device_type, output_dtype
        if not self.specs:
            return
        for name, module in match_modules(root, self.specs).items():
            module.float()
            # Inputs cast in a pre-hook, so the module's own hooks see them as its forward does.
            self._handles.append(module.register_forward_pre_hook(_inputs_to_fp32, with_kwargs=True))
            module.__dict__[_ISLAND] = (self, module.__dict__.get("forward"))  # a user's own forward is kept
            module.__dict__["forward"] = types.MethodType(island_forward, module)
            self._modules.append(module)
            self.names.append(name)

    def add(self, root: nn.Module, names: Iterable[str]) -> None:
        """Make more modules of ``root`` islands (used by fallback); already-wrapped names are ignored."""
        self.specs.extend(name for name in names if name not in self.names)
        self.attach(root, device_type=self.device_type, output_dtype=self.output_dtype)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in self._modules:
            _, inner = module.__dict__.pop(_ISLAND, (None, None))
            if inner is None:
                module.__dict__.pop("forward", None)  # the class's forward again
            else:
                module.__dict__["forward"] = inner  # the user's own instance forward
        self._modules.clear()
        self.names.clear()


_ISLAND = "_fp32_island"  # on an island module: (its FP32Islands, the instance forward it had or None)


def _inputs_to_fp32(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return _to_fp32(args), _to_fp32(kwargs)


def island_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """An island's ``forward``: autocast off around the module's own forward (the class's, or the instance one it
    had), floating inputs in FP32 (the pre-hook cast them already, unless ``forward`` is called directly), the output
    cast to the islands' ``output_dtype`` when set."""
    islands, inner = module.__dict__[_ISLAND]
    forward = inner if inner is not None else type(module).forward.__get__(module)
    with torch.autocast(islands.device_type, enabled=False):
        output = forward(*_to_fp32(args), **_to_fp32(kwargs))
    return output if islands.output_dtype is None else _to_dtype(output, islands.output_dtype)

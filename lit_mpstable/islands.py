"""FP32 islands: modules that always run in FP32 inside a low-precision model (autocast off, inputs cast up)."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["FP32Islands", "match_modules"]


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


def _checked(specs: Iterable[Any]) -> list[type[nn.Module] | str]:
    specs = [specs] if isinstance(specs, (str, type)) else list(specs)
    for spec in specs:
        if not (isinstance(spec, str) or (isinstance(spec, type) and issubclass(spec, nn.Module))):
            raise TypeError(f"fp32_modules entry {spec!r}: expected a module type or a qualified-name pattern (str).")
    return specs


def _to_dtype(value: Any, dtype: torch.dtype) -> Any:
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


def _to_fp32(value: Any) -> Any:
    return _to_dtype(value, torch.float32)


class FP32Islands:
    """Matched modules run their forward with autocast off and their inputs cast to FP32.

    The module's ``forward`` is wrapped (an instance attribute over the class's), not hooked: autocast is turned
    off by a ``with`` block inside the call, which ``torch.compile`` traces into the graph like any other code.
    (Entering autocast in a forward pre-hook and leaving it in a forward hook cannot be traced.) Its code is the same
    for every module and setting, so re-attaching after a rollback or a restore meets the compiled graph's guards:
    only a new layout recompiles.

    ``attach`` may be called again (a second ``fit``): earlier wrappers are removed first.
    """

    def __init__(self, specs: Iterable[type[nn.Module] | str] = ()) -> None:
        self.specs = _checked(specs)
        self._device_type = "cpu"
        self.output_dtype: torch.dtype | None = None
        self.names: list[str] = []
        self._modules: list[nn.Module] = []

    @property
    def device_type(self) -> str:
        """The device whose autocast the islands turn off (set again when the run's device is known)."""
        return self._device_type

    @device_type.setter
    def device_type(self, device_type: str) -> None:
        self._device_type = device_type
        for module in self._modules:
            _install(module, device_type, self.output_dtype)

    def attach(self, root: nn.Module, *, device_type: str, output_dtype: torch.dtype | None) -> None:
        """Wrap the matched modules of ``root``; ``output_dtype`` casts their outputs back (``*-true`` modes)."""
        self.detach()
        self._device_type, self.output_dtype = device_type, output_dtype
        if not self.specs:
            return
        for name, module in match_modules(root, self.specs).items():
            module.float()
            _install(module, device_type, output_dtype)
            self._modules.append(module)
            self.names.append(name)

    def add(self, root: nn.Module, names: Iterable[str]) -> None:
        """Make more modules of ``root`` islands (used by fallback); already-wrapped names are ignored."""
        self.specs.extend(name for name in names if name not in self.names)
        self.attach(root, device_type=self.device_type, output_dtype=self.output_dtype)

    def detach(self) -> None:
        for module in self._modules:
            _uninstall(module)
        self._modules.clear()
        self.names.clear()


def _install(module: nn.Module, device_type: str, output_dtype: torch.dtype | None) -> None:
    current = module.__dict__.get("forward")
    inner = getattr(current, "island_inner", current)  # wrapped again (a new setting): wrap what was there first
    module.__dict__["forward"] = _island_forward(module, inner, device_type, output_dtype)


def _uninstall(module: nn.Module) -> None:
    current = module.__dict__.get("forward")
    if not hasattr(current, "island_inner"):
        return  # not ours (any more): leave it
    if current.island_inner is None:
        del module.__dict__["forward"]  # the class's forward again
    else:
        module.__dict__["forward"] = current.island_inner  # the user's own instance forward


def _island_forward(
    module: nn.Module, inner: Callable[..., Any] | None, device_type: str, output_dtype: torch.dtype | None
) -> Callable[..., Any]:
    forward = inner if inner is not None else type(module).forward.__get__(module)

    def island_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, enabled=False):
            output = forward(*_to_fp32(args), **_to_fp32(kwargs))
        return output if output_dtype is None else _to_dtype(output, output_dtype)

    island_forward.island_inner = inner  # type: ignore[attr-defined]  # what detach puts back (None: the class's)
    return island_forward

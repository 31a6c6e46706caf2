"""FP32 islands: modules that always run in FP32 inside a low-precision model (autocast off, inputs cast up)."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
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
    """Forward hooks that turn autocast off inside the matched modules and cast their inputs to FP32.

    ``attach`` may be called again (a second ``fit``): earlier hooks are removed first.
    """

    def __init__(self, specs: Iterable[type[nn.Module] | str] = ()) -> None:
        self.specs = _checked(specs)
        self.device_type = "cpu"
        self.output_dtype: torch.dtype | None = None
        self.names: list[str] = []
        self._handles: list[Any] = []
        self._contexts: list[torch.autocast] = []

    def attach(self, root: nn.Module, *, device_type: str, output_dtype: torch.dtype | None) -> None:
        """Hook the matched modules of ``root``; ``output_dtype`` casts their outputs back (``*-true`` modes)."""
        self.detach()
        self.device_type, self.output_dtype = device_type, output_dtype
        if not self.specs:
            return
        for name, module in match_modules(root, self.specs).items():
            module.float()
            self._handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._exit, always_call=True))
            self.names.append(name)

    def add(self, root: nn.Module, names: Iterable[str]) -> None:
        """Make more modules of ``root`` islands (used by fallback); already-hooked names are ignored."""
        self.specs.extend(name for name in names if name not in self.names)
        self.attach(root, device_type=self.device_type, output_dtype=self.output_dtype)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.names.clear()

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        context = torch.autocast(self.device_type, enabled=False)
        context.__enter__()
        self._contexts.append(context)
        return _to_fp32(args), _to_fp32(kwargs)

    def _exit(self, module: nn.Module, args: tuple, output: Any) -> Any:
        # always_call=True: runs even when forward raised, so autocast is never left switched off.
        self._contexts.pop().__exit__(None, None, None)
        return output if self.output_dtype is None else _to_dtype(output, self.output_dtype)

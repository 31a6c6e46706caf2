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
    (Entering autocast in a forward pre-hook and leaving it in a forward hook cannot be traced.) Each module keeps
    one wrapper per setting, re-installed as the same object by every later :meth:`attach`, so a compiled model's
    guards on it still hold after a fallback, a restore, a rollback or a second ``fit``.

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


# On an island module: the forward it had before (a user's own instance attribute, or None for the class's) and
# its wrappers by (device_type, output_dtype).
_STATE = "_lit_mpstable_fp32_island"


def _install(module: nn.Module, device_type: str, output_dtype: torch.dtype | None) -> None:
    state = module.__dict__.get(_STATE)
    current = module.__dict__.get("forward")
    if state is None or (current is not None and current not in state["wrappers"].values()):
        # First time, or the user set their own forward since: wrap whatever forward the module has now.
        state = module.__dict__[_STATE] = {"inner": current, "wrappers": {}}
    key = (device_type, output_dtype)
    if key not in state["wrappers"]:
        state["wrappers"][key] = _island_forward(module, state["inner"], device_type, output_dtype)
    module.__dict__["forward"] = state["wrappers"][key]


def _uninstall(module: nn.Module) -> None:
    state = module.__dict__.get(_STATE)
    if state is None or module.__dict__.get("forward") not in state["wrappers"].values():
        return  # not ours (any more): leave it
    if state["inner"] is None:
        del module.__dict__["forward"]
    else:
        module.__dict__["forward"] = state["inner"]


def _island_forward(
    module: nn.Module, inner: Callable[..., Any] | None, device_type: str, output_dtype: torch.dtype | None
) -> Callable[..., Any]:
    forward = inner if inner is not None else type(module).forward.__get__(module)

    def island_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, enabled=False):
            output = forward(*_to_fp32(args), **_to_fp32(kwargs))
        return output if output_dtype is None else _to_dtype(output, output_dtype)

    return island_forward

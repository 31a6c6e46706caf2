"""Checkpoints on disk as the package reads them: optimizer states that a checkpoint cannot hold as they are, and
sharded checkpoints' directories.

Tensor subclasses (torchao's 8-bit, 4-bit and FP8 optimizer states) are stored flat, as their plain inner tensors,
and rebuilt on load.

Lightning loads checkpoints with a callable ``map_location``, which ``torch.load`` refuses for wrapper subclasses
("Callable map_location not supported with _rebuild_wrapper_subclass"), so a run with ``torchao.optim.AdamW8bit``
could save but never resume. Flat, the states are plain tensors and values: ``torch.load(weights_only=True)`` reads
them. Only known classes are rebuilt (an allow-list, as ``weights_only`` has one).

A sharded checkpoint (``fabric.save`` under FSDP2's ``ModelParallelStrategy`` or ``FSDPStrategy``:
torch.distributed.checkpoint) is a directory: the shards, DCP's index (:data:`SHARD_INDEX`) and the rest of the state
rank 0 wrote (:data:`SHARDED_META`); :func:`earlier_sharded_checkpoints` lists those written before one.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast, overload

import torch

if TYPE_CHECKING:
    from torch.optim.optimizer import StateDict
    from torch.utils._python_dispatch import TraceableWrapperSubclass

_T = TypeVar("_T")
_K = TypeVar("_K")
_V = TypeVar("_V")

_MARK = "lit_mpstable.flat_tensor"
# Classes whose __tensor_flatten__ / __tensor_unflatten__ round trip is known to rebuild them exactly.
_ALLOWED = (
    "torchao.optim.subclass_8bit.OptimState8bit",
    "torchao.optim.subclass_4bit.OptimState4bit",
    "torchao.optim.subclass_fp8.OptimStateFp8",
)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _flatten(value: torch.Tensor) -> dict[str, object]:
    # Only states of the allowed classes come here: wrapper subclasses, which Tensor's stubs do not describe.
    flat: tuple[Sequence[str], Any] = cast("TraceableWrapperSubclass", value).__tensor_flatten__()
    names, context = flat  # torchao's contexts are sequences of plain values
    return {
        _MARK: _qualname(type(value)), "inner": {name: getattr(value, name) for name in names},
        "context": list(context), "size": list(value.shape), "stride": list(value.stride()),
    }


def _rebuild(flat: dict[str, Any]) -> torch.Tensor:
    name = flat[_MARK]
    if name not in _ALLOWED:
        raise ValueError(f"checkpoint optimizer state: {name!r} is not a tensor class lit_mpstable rebuilds; allowed:"
                         f" {list(_ALLOWED)}.")
    module, _, cls_name = name.rpartition(".")
    cls = getattr(importlib.import_module(module), cls_name)
    return cls.__tensor_unflatten__(dict(flat["inner"]), tuple(flat["context"]), torch.Size(flat["size"]),
                                    tuple(flat["stride"]))


def copy_quantized_state(value: torch.Tensor, device: torch.device | None) -> torch.Tensor | None:
    """A copy of an allowed tensor-subclass state (on ``device``, else where it is) that shares nothing with it, or
    None for any other tensor. torchao's states implement neither ``clone`` nor a copying ``.to()`` (theirs keeps the
    inner tensors when the device does not change): their inner tensors are copied and the state rebuilt."""
    if _qualname(type(value)) not in _ALLOWED:
        return None
    wrapper = cast("TraceableWrapperSubclass", value)  # an allowed class: a wrapper subclass (checked above)
    names, context = wrapper.__tensor_flatten__()
    inner = {}
    for name in names:
        t = getattr(value, name).detach()
        inner[name] = t.clone() if device is None or t.device == device else t.to(device, copy=True)
    return type(wrapper).__tensor_unflatten__(inner, context, value.shape, value.stride())


def flatten_optimizer_states_(optimizer_states: Iterable[StateDict]) -> int:
    """Replace, in these ``optimizer.state_dict()`` results, every allowed tensor-subclass state by its flat form;
    returns how many were replaced. The live optimizer keeps its states: ``state_dict()`` hands out the optimizer's
    own per-parameter dicts, so each one that changes is replaced by a new dict, never written into."""
    return _replace_states_(optimizer_states, lambda v: isinstance(v, torch.Tensor) and _qualname(type(v)) in _ALLOWED,
                            _flatten)


def unflatten_optimizer_states_(optimizer_states: Iterable[StateDict]) -> int:
    """Rebuild, in place, every state :func:`flatten_optimizer_states_` stored flat; returns how many.

    Raises:
        ValueError: a flat state names a class outside the allow-list.
    """
    return _replace_states_(optimizer_states, lambda v: isinstance(v, dict) and _MARK in v, _rebuild)


def flat_optimizer_state(optimizer_state: StateDict) -> StateDict | None:
    """``optimizer_state`` (an ``optimizer.state_dict()``) with its allowed tensor-subclass states flat, as a new dict
    sharing everything else, or None where it holds none: for ``Optimizer.register_state_dict_post_hook``, so every
    save of the optimizer writes them flat."""
    return _with_states_replaced(optimizer_state, flatten_optimizer_states_)


def rebuilt_optimizer_state(optimizer_state: StateDict) -> StateDict | None:
    """``optimizer_state`` with the states :func:`flat_optimizer_state` stored flat rebuilt, as a new dict (the one
    given, a snapshot to load again perhaps, is not changed), or None where none is flat: for
    ``Optimizer.register_load_state_dict_pre_hook``, which runs before ``load_state_dict`` casts each state tensor to
    its parameter's dtype (a flat state's integer codes with them).

    Raises:
        ValueError: a flat state names a class outside the allow-list.
    """
    return _with_states_replaced(optimizer_state, unflatten_optimizer_states_)


def holds_flat_state(state: Mapping[str, object]) -> bool:
    """Whether one parameter's live optimizer ``state`` holds a state stored flat: loaded without
    :func:`rebuilt_optimizer_state`, so no longer what the optimizer steps with."""
    return any(isinstance(value, dict) and _MARK in value for value in state.values())


def _with_states_replaced(optimizer_state: StateDict, replace_: Callable[[Iterable[StateDict]], int]
                          ) -> StateDict | None:
    copied = {**optimizer_state, "state": dict(optimizer_state.get("state", {}))}
    return copied if replace_([copied]) else None


def _replace_states_(optimizer_states: Iterable[StateDict], pick: Callable[[object], bool],
                     convert: Callable[[Any], object]) -> int:
    count = 0
    for optimizer_state in optimizer_states:
        states = optimizer_state.get("state", {})
        for index, state in states.items():
            picked = [key for key, value in state.items() if pick(value)]
            if picked:
                states[index] = {**state, **{key: convert(state[key]) for key in picked}}
                count += len(picked)
    return count


@overload
def copy_state(obj: Mapping[_K, _V], device: torch.device | None = None) -> dict[_K, _V]: ...
@overload
def copy_state(obj: _T, device: torch.device | None = None) -> _T: ...
def copy_state(obj: object, device: torch.device | None = None) -> object:
    """Nested dicts/lists with every tensor copied (to ``device``, else where it is): state dicts share storage with
    the live tensors, and a snapshot must not follow them (torchao's quantized states included)."""
    if isinstance(obj, torch.Tensor):
        quantized = copy_quantized_state(obj, device)
        if quantized is not None:
            return quantized
        return obj.detach().clone() if device is None or obj.device == device else obj.detach().to(device, copy=True)
    if isinstance(obj, Mapping):
        return {key: copy_state(value, device) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(copy_state(value, device) for value in obj)
    return copy.copy(obj)


# ------------------------------------------------------------------------------------- sharded checkpoints
SHARDED_META = "meta.pt"
"""What a sharded checkpoint's directory holds beside the shards: everything of the saved state that is not a model
or an optimizer (the precision plugin's state, the loop's entries), written by rank 0 with ``torch.save`` (Lightning's
``_METADATA_FILENAME``; the core does not import Lightning)."""
SHARD_INDEX = ".metadata"
"""torch.distributed.checkpoint's index of the shards (the model's and optimizers' tensors)."""


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a sharded checkpoint's directory: one holding :data:`SHARDED_META` (Lightning's test)."""
    path = Path(path)
    return path.is_dir() and (path / SHARDED_META).is_file()


def read_sharded_meta(path: str | Path) -> dict[str, Any]:
    """A sharded checkpoint's :data:`SHARDED_META` (``torch.load(map_location="cpu", weights_only=True)``).

    Raises:
        ValueError: it holds no dict.
    """
    meta = torch.load(Path(path) / SHARDED_META, map_location="cpu", weights_only=True)
    if not isinstance(meta, dict):
        raise ValueError(f"{Path(path) / SHARDED_META} holds a {type(meta).__name__}, not the dict fabric.save writes.")
    return meta


def earlier_sharded_checkpoints(path: str | Path) -> list[Path]:
    """The other sharded checkpoints (:func:`is_sharded_checkpoint`) of ``path``'s parent directory written before it
    (:func:`written_before`; a directory's modification time is set when its last file, :data:`SHARDED_META`, was
    created)."""
    path = Path(path)
    return written_before(path, [p for p in path.parent.iterdir() if is_sharded_checkpoint(p)])


def written_before(path: Path, candidates: Iterable[Path]) -> list[Path]:
    """``candidates`` other than ``path`` whose modification time is not later than ``path``'s (all of them where
    ``path`` does not exist), newest first, ties broken by name, descending."""
    own = path.stat().st_mtime_ns if path.exists() else None
    others = [p for p in candidates if p.resolve() != path.resolve()]
    earlier = [p for p in others if own is None or p.stat().st_mtime_ns <= own]
    return sorted(earlier, key=lambda p: (p.stat().st_mtime_ns, p.name), reverse=True)

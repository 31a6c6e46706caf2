"""A checkpoint's numeric fingerprint: what the saved numbers were, so a load can tell that they still are.

Under :data:`KEY` in the plugin's state: ``checksums`` (a 64-bit digest of every tensor's bytes, :func:`checksum`),
``manifest`` (the precision the run trained in, :func:`manifest`) and ``pinned`` (a pinned micro-batch and its loss
and gradient norm at the save, :func:`pinned_pass`). :class:`Fingerprint` captures and checks them and names each
difference (:class:`FingerprintMismatch`); :func:`previous_passing_checkpoint` finds the newest earlier checkpoint that
passes (``on_fingerprint_mismatch="previous"``, the remedy ladder's "restored state" rung). The format and what each
check catches: ``docs/fingerprints.md``.
"""

from __future__ import annotations

import copy
import hashlib
import math
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

import numpy as np
import torch
from torch import nn

from lit_mpstable.core.checkpoints import written_before
from lit_mpstable.core.tensors import dense_values

KEY = "fingerprint"
"""Where the fingerprint sits in the plugin's state."""
VERSION = 3
"""3: checksums in lanes (:func:`checksum`), a tensor's own lanes hashed; 2: the same lanes zero-padded to
:data:`LANES` before the hash (read); 1 (this round's first release): one wrap-around sum a tensor (read)."""
READS = (1, 2, VERSION)
"""The fingerprint versions a load checks, each with its own checksum."""
LANES = 509
"""Lanes of a checksum: word i is summed into lane i mod 509 (a prime, so no power-of-two row width folds a column
into one lane)."""
PIN_ROWS = 4
"""Rows of the first training batch kept as the pinned micro-batch (dimension 0 of every tensor in it)."""
PIN_MAX_BYTES = 1 << 20
"""A pinned micro-batch larger than this (after the row cap) is not kept: the fingerprint then has no pinned loss."""
PIN_SEED = 0x5EED
"""The RNG seed of the pinned pass (dropout, if the module keeps any in eval mode): the same draw at save and load."""
LOSS_RTOL = 1e-4
GRAD_NORM_RTOL = 1e-3
"""Relative tolerances of the pinned loss and gradient norm where the pass is not deterministic (CUDA without
``torch.use_deterministic_algorithms``); on the CPU, or deterministic CUDA, they are compared bitwise."""

OnMismatch = Literal["raise", "previous", "warn"]
ON_MISMATCH: tuple[str, ...] = get_args(OnMismatch)


class FingerprintMismatch(ValueError):
    """A checkpoint's numbers are not what its fingerprint says; ``differences`` names each."""

    def __init__(self, source: str, differences: list[str]) -> None:
        self.source, self.differences = source, list(differences)
        shown = "; ".join(differences[:8]) + (f"; and {len(differences) - 8} more" if len(differences) > 8 else "")
        super().__init__(f"{source}: the checkpoint fails its numeric fingerprint: {shown}.")


def check_on_mismatch(call: str, value: object) -> OnMismatch:
    """``on_fingerprint_mismatch``, checked: one of :data:`ON_MISMATCH`."""
    if not isinstance(value, str) or value not in ON_MISMATCH:
        raise (ValueError if isinstance(value, str) else TypeError)(
            f"{call}(on_fingerprint_mismatch={value!r:.80}): must be one of {list(ON_MISMATCH)}.")
    return value  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------------- checksums
_PLAIN = (torch.Tensor, nn.Parameter)  # checksummed; a subclass (DTensor, a quantized state) is not one whole value
# numpy reads these dtypes' bytes in place (bool as its 0/1 bytes); bfloat16 and the FP8 types go through a torch view.
_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool})
_SAME_WIDTH = {torch.bfloat16: torch.int16, **{dtype: torch.uint8 for dtype in (
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu)}}
"""Dtypes numpy lacks, read as the integers of their width (the same bytes)."""
_BLAKE = hashlib.blake2b(digest_size=8)  # copied for each digest (a copy costs a tenth of a construction)
_LITTLE = sys.byteorder == "little"  # a tensor's bytes are then its words as the digest hashes them ("<i8")


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in order (uint8, on its device): a view where it is contiguous."""
    flat = tensor.detach().resolve_conj().resolve_neg().reshape(-1)  # the values, not a lazy conjugate or negation
    if flat.is_complex() or flat.dtype == torch.bool:
        flat = torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat.to(torch.uint8)
    return flat.contiguous().view(torch.uint8)


def _host_array(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as a C-contiguous numpy array whose buffer is the tensor's bytes in order: the tensor's
    own memory where it is contiguous (bfloat16 and the FP8 types read as integers of their width), else a copy."""
    t = tensor.detach() if tensor.requires_grad else tensor
    as_int = _SAME_WIDTH.get(t.dtype)
    if as_int is not None:
        t = t.view(as_int)
    if t.dtype in _NUMPY_DTYPES and t.is_contiguous() and not t.is_neg():
        return t.numpy()
    return _bytes(tensor).numpy()


def _row_bytes(nbytes: int) -> int:
    """The bytes of a tensor's whole rows of :data:`LANES` words (the rest: fewer than ``LANES`` words)."""
    return nbytes // (8 * LANES) * (8 * LANES)


def _numpy_lanes(data: np.ndarray) -> np.ndarray:
    """The lanes of ``data`` (bytes, numpy uint8): its 64-bit words (the last one zero-padded), word i added into lane
    i mod :data:`LANES` with wrap-around; ``min(words, LANES)`` int64 lanes. numpy's sum: one thread, vectorised, in
    place over a ``(rows, LANES)`` view (torch's threaded reduction waits on its barriers when the cores are busy)."""
    full = _row_bytes(data.size)
    rows = data[:full].view(np.int64).reshape(-1, LANES).sum(axis=0, dtype=np.int64) if full else None
    return _plus_rest(rows, data[full:])


def _plus_rest(rows: np.ndarray | None, rest: np.ndarray) -> np.ndarray:
    """The lanes: the sums of a tensor's whole rows (``rows``, int64, updated in place; None where it has none) plus
    the ``rest`` of its bytes (uint8) as words, the last one zero-padded. With no whole row the lanes are the words."""
    if rest.size % 8:
        padded = np.zeros(rest.size + (-rest.size % 8), dtype=np.uint8)
        padded[:rest.size] = rest
        rest = padded
    words = rest.view(np.int64)
    if rows is None:
        return words
    rows[:words.size] += words
    return rows


def _digest(lanes: np.ndarray, nbytes: int, version: int = VERSION) -> int:
    """The 64-bit digest of a tensor's lane sums and byte count (BLAKE2b: no two changes cancel in it). Version 3
    hashes the lanes a tensor has (one per word, at most :data:`LANES`: a step counter hashes 16 bytes, not 4 KiB);
    version 2 hashed all :data:`LANES`, zero-padded. The byte count fixes the number of lanes: neither loses a bit."""
    if version == 2 and lanes.size < LANES:
        lanes = np.concatenate([lanes, np.zeros(LANES - lanes.size, dtype=np.int64)])
    return _hash(lanes.astype("<i8", copy=False).view(np.uint8), nbytes)


def _hash(data: np.ndarray, nbytes: int) -> int:
    """BLAKE2b-64 of ``data``'s bytes (any C-contiguous array), zero-padded to whole words, and then the byte count
    ``nbytes``."""
    hasher = _BLAKE.copy()
    hasher.update(data.data)
    if data.nbytes % 8:
        hasher.update(bytes(-data.nbytes % 8))
    hasher.update(nbytes.to_bytes(8, "little"))
    return int.from_bytes(hasher.digest(), "little")


def _word_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Version 1's checksum: one wrap-around sum of the words (plus the tail's bytes), kept to check its
    checkpoints. Balanced changes cancel in it (a tensor negated whose signs were half and half; two flips of a
    word's top bit); :func:`checksum`'s lanes and hash do not let them."""
    raw = _bytes(tensor)
    whole = raw.numel() // 8 * 8
    if raw.device.type == "cpu":
        data = raw.numpy()
        total = int(data[:whole].view(np.int64).sum(dtype=np.int64)) + int(data[whole:].sum(dtype=np.int64))
        return torch.tensor(total, dtype=torch.int64)
    words = raw[:whole].view(torch.int64).sum() if whole else torch.zeros((), dtype=torch.int64, device=raw.device)
    return words + raw[whole:].to(torch.int64).sum() if whole < raw.numel() else words


def _checksums_on(tensors: Sequence[torch.Tensor], version: int = VERSION) -> list[int]:
    """The checksums of ``tensors``, all on one device: on the CPU in numpy, in place; elsewhere the lanes summed on
    the device and brought over in one host read (one concatenation: a small tensor's lanes are its own bytes)."""
    if version == 1:
        return torch.stack([_word_sum(t) for t in tensors]).tolist()  # one host read
    if tensors[0].device.type != "cpu":
        return _device_checksums(tensors, version)
    digests = []
    rowless = version == VERSION and _LITTLE
    for tensor in tensors:
        data = _host_array(tensor)
        if data.nbytes < 8 * LANES and rowless:  # no whole row (a step counter, a bias): its lanes are its words,
            digests.append(_hash(data, data.nbytes))  # hashed as they lie in memory
        else:
            digests.append(_digest(_numpy_lanes(data.reshape(-1).view(np.uint8)), data.nbytes, version))
    return digests


def _device_checksums(tensors: Sequence[torch.Tensor], version: int) -> list[int]:
    """:func:`_checksums_on` off the CPU (and on it, where a test asks): on the device, one kernel a tensor with whole
    rows of lanes (their sum); those sums and every tensor's other bytes (a small tensor's all, a large one's partial
    row) go to the host in one concatenation, one read; the partial rows are added there."""
    raw = [_bytes(t) for t in tensors]
    rows = []
    for r in raw:
        if full := _row_bytes(r.numel()):
            whole = r[:full] if r.storage_offset() % 8 == 0 else r[:full].clone()  # a word view needs 8-byte alignment
            rows.append(whole.view(torch.int64).view(-1, LANES).sum(0).view(torch.uint8))
    host = torch.cat([*rows, *(r[_row_bytes(r.numel()):] for r in raw)]).cpu().numpy()  # the one host read
    sums = host[:len(rows) * 8 * LANES].view(np.int64).reshape(-1, LANES)
    digests, at, row = [], sums.nbytes, 0
    for r in raw:
        nbytes = r.numel()
        rest = nbytes - _row_bytes(nbytes)
        lanes = _plus_rest(sums[row] if rest < nbytes else None, host[at:at + rest])
        row, at = row + (rest < nbytes), at + rest
        digests.append(_digest(lanes, nbytes, version))
    return digests


def checksum(tensor: torch.Tensor) -> int:
    """The tensor's 64-bit checksum (one host read): its bytes as 64-bit words summed with wrap-around into
    :data:`LANES` lanes by position (integer addition is exact: the same on every device and run), the lanes and the
    byte count hashed (BLAKE2b). Any flipped bit, any changed value changes it, and, unlike one sum of all words, no
    balanced set of changes cancels out (a tensor negated, two flipped sign bits), unless every lane's changes
    cancel on their own. The layout does not matter, only the values in order."""
    return _checksums_on([tensor])[0]


def tensor_leaves(tree: object, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every plain tensor in nested dicts, lists and tuples (paths such as
    ``state_dict['model.0.weight']``, ``optimizer_states[0]['state'][1]['exp_avg']``). Tensor subclasses (DTensor
    shards, quantized optimizer states) are skipped: their bytes are not one rank's whole value."""
    found: list[tuple[str, torch.Tensor]] = []
    _collect(tree, path, found)
    return iter(found)


def _collect(tree: object, path: str, found: list[tuple[str, torch.Tensor]]) -> None:
    # Appends to one list (not nested generators: a leaf four levels down would pass through four of them). A child's
    # path is written only for a tensor or a container: an optimizer's param_groups hold many plain numbers.
    if isinstance(tree, torch.Tensor):
        if type(tree) in _PLAIN and not tree.is_meta:
            found.append((path, tree))
        return
    items: Iterable[tuple[object, object]]
    if type(tree) is dict or isinstance(tree, Mapping):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return
    for key, value in items:
        kind = type(value)
        if kind in _PLAIN:
            if not value.is_meta:  # type: ignore[union-attr]
                found.append((f"{path}[{key!r}]", value))  # type: ignore[arg-type]
        elif kind is dict or kind is list or isinstance(value, (Mapping, list, tuple, torch.Tensor)):
            _collect(value, f"{path}[{key!r}]", found)


def _leaves(trees: Mapping[str, object]) -> list[tuple[str, torch.Tensor]]:
    # tensor_leaves of each tree, its paths under the tree's root name.
    found: list[tuple[str, torch.Tensor]] = []
    for root, tree in trees.items():
        _collect(tree, root, found)
    return found


def _view_key(t: torch.Tensor) -> tuple:
    """What identifies a tensor's bytes: its device, address (storage and offset), shape, strides and dtype (two entries
    of a state that are one tensor, such as tied embeddings listed under two names, have the same key)."""
    return t.device, t.data_ptr(), t.shape, t.stride(), t.dtype


def checksums(trees: Mapping[str, object], version: int = VERSION) -> dict[str, int]:
    """Every tensor's :func:`checksum` in ``trees`` (``{root name: nested state}``), by path; one host read per
    device. A tensor listed under several paths (tied weights: ``torch.save`` writes its storage once too) is read
    once. ``version``: the checksum of that fingerprint version, to check its checkpoints (1: :func:`_word_sum`; 2:
    the lanes zero-padded to :data:`LANES` before the hash)."""
    leaves = _leaves(trees)
    keys = [_view_key(t) for _, t in leaves]
    first: dict[tuple, int] = {}  # view key -> the index of the leaf that computes it
    by_device: dict[torch.device, list[int]] = {}
    for index, ((_, t), key) in enumerate(zip(leaves, keys, strict=True)):
        if first.setdefault(key, index) == index:
            by_device.setdefault(t.device, []).append(index)
    values: dict[int, int] = {}
    for indices in by_device.values():
        values.update(zip(indices, _checksums_on([leaves[i][1] for i in indices], version), strict=True))
    return {path: values[first[key]] for (path, _), key in zip(leaves, keys, strict=True)}


def _kind(path: str) -> str:
    if path.startswith("state_dict") or path.startswith("model"):
        return "weight"
    if path.startswith("optimizer_states") or path.startswith("optimizer"):
        return "optimizer state"
    for key, kind in (("['masters']", "FP32 master"), ("['compensation']", "Kahan compensation"),
                      ("['layout']['fp8']", "FP8 scaling state"), ("['recast']", "recast FP32 state")):
        if key in path:
            return kind
    return "tensor"


def _diagnose(path: str, tensor: torch.Tensor) -> str:
    """A cheap guess at what happened to a tensor whose checksum changed (one host read; only on a mismatch)."""
    if tensor.numel() and not bool(tensor.detach().reshape(-1).ne(0).any()):
        return " (now all zeros)"
    if tensor.dtype == torch.float32 and tensor.numel():
        low = tensor.detach().reshape(-1).contiguous().view(torch.int32) & 0xFFFF
        if not bool(low.ne(0).any()):
            return " (FP32 values that hold only BF16 bits: round-tripped through BF16)"
    return ""


def compare_checksums(saved: Mapping[str, int], trees: Mapping[str, object], version: int = VERSION) -> list[str]:
    """The differences between ``saved`` checksums (of fingerprint ``version``) and ``trees``' tensors, named: a
    changed tensor (and what it looks like), a missing one, an unexpected one. Only paths under the roots of
    ``trees`` are compared."""
    now = checksums(trees, version)
    roots = tuple(trees)
    differences = []
    live: dict[str, torch.Tensor] = {}  # for the diagnosis, walked only where a checksum differs
    for path, value in saved.items():
        if not path.startswith(roots):
            continue
        if path not in now:
            differences.append(f"{_kind(path)} `{path}` is missing from the loaded checkpoint")
        elif now[path] != value:
            live = live or dict(_leaves(trees))
            differences.append(f"checksum of {_kind(path)} `{path}` differs (saved {value & (2**64 - 1):#018x},"
                               f" loaded {now[path] & (2**64 - 1):#018x}){_diagnose(path, live[path])}")
    differences += [f"{_kind(path)} `{path}` was not in the saved checkpoint" for path in now if path not in saved]
    return differences


# ---------------------------------------------------------------------------------------------------- manifest
def manifest(layout: Any, *, precision: str, master_weights: str | None, optimizer_state: str = "fp32",
             high_precision: Sequence[str] = ()) -> dict[str, Any]:
    """The precision a run trains in, as plain values: ``layout`` (a
    :class:`~lit_mpstable.core.layout.layout.PrecisionLayout`: the FP8 config, the layers it selected, the FP32 islands,
    the fallbacks in force) and the step's settings (``master_weights``: the weight mode, None without masters;
    ``high_precision``: the layers the probe's budget kept out). ``PrecisionStepper.manifest()`` passes its own.

    Keys: ``precision``, ``master_weights``, ``optimizer_state``, ``fp8`` (the FP8 config's fields, ``None``
    without), ``layers`` (per layer the FP8 filter selected: ``recipe``, ``format``, ``sr_key``, ``hadamard``: the
    stochastic-rounding seed and a checksum of the Hadamard signs where the recipe has them), ``high_precision``
    (layers the probe's budget kept out), ``islands`` (the user's FP32 modules), ``fallbacks`` (in force)."""
    from lit_mpstable.fp8.linear import FP8Linear

    config = layout.fp8
    fields = None if config is None else {
        name: str(getattr(config, name)) for name in ("recipe", "format", "margin", "amax_history_len",
                                                     "amax_compute_algo", "backend")}
    module = layout.module
    layers: dict[str, dict[str, Any]] = {}
    for name in layout.fp8_selected:
        layer = module.get_submodule(name) if module is not None else None
        # A layer's own recipe where it has one (a per-layer map, a Recipe object: its name and all its fields).
        recipe = layer.fp8_config.recipe if isinstance(layer, FP8Linear) else getattr(config, "recipe", None)
        layer_config = layer.fp8_config if isinstance(layer, FP8Linear) else (
            config.for_layer(name) if config is not None else None)
        entry: dict[str, Any] = {"recipe": str(getattr(recipe, "name", recipe)), "recipe_fields": str(recipe),
                                 "format": fields["format"] if fields else None,
                                 "per_tensor": layer_config is None or layer_config.spec.per_tensor}
        if isinstance(layer, FP8Linear):
            entry["sr_key"] = getattr(layer, "sr_seed", None)
            signs = getattr(layer, "rht_signs", None)
            entry["hadamard"] = checksum(signs) if isinstance(signs, torch.Tensor) else None
        layers[name] = entry
    state = layout.state_dict()
    return {
        "version": VERSION,
        "precision": precision,
        "master_weights": master_weights,
        "optimizer_state": str(optimizer_state),
        "fp8": fields,
        "layers": layers,
        "high_precision": list(high_precision),
        "islands": sorted(str(spec) for spec in getattr(layout, "_user_islands", ())),
        "fallbacks": {key: state[key] for key in ("fp32", "fp8_off", "fp8_removed", "fp32_modules")},
    }


_BASE = {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "16-true": "fp16", "32-true": "fp32"}


def _layer_format(entry: Mapping[str, Any] | None, base: str) -> str:
    if entry is None:
        return base
    # A manifest written before "per_tensor" was recorded: only the built-in block recipes' names say it.
    per_tensor = entry.get("per_tensor", entry["recipe"] not in ("mxfp4", "nvfp4", "mxfp8", "blockwise"))
    return f"fp8 {entry['recipe']} ({entry['format']})" if per_tensor else str(entry["recipe"])


def _fallen(manifest: Mapping[str, Any], name: str) -> bool:
    """Whether layer ``name`` had left its low format by a fallback in force (its SR key and signs went with it)."""
    fallbacks = manifest.get("fallbacks") or {}
    modules = [*fallbacks.get("fp8_removed", []), *fallbacks.get("fp32_modules", [])]
    return bool(fallbacks.get("fp32") or fallbacks.get("fp8_off")) or any(
        name == str(m) or name.startswith(f"{m}.") for m in modules)


def compare_manifests(saved: Mapping[str, Any], live: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """``(differences, notes)`` between a checkpoint's manifest and this run's. Differences (the numbers would not
    mean the same): a layer in another low format, or in a low format on one side only; another FP8 field, SR key or
    Hadamard signs; other FP32 islands. Notes (carried on load, as before the fingerprint): another base precision,
    weight mode or optimizer-state kind. The fallbacks are the checkpoint's (re-applied at load): not compared."""
    differences, notes = [], []
    base_saved, base_live = _BASE.get(saved["precision"], saved["precision"]), _BASE.get(live["precision"],
                                                                                         live["precision"])
    for key in ("precision", "master_weights", "optimizer_state"):
        if saved.get(key) != live.get(key):
            notes.append(f"checkpoint written with {key}={saved.get(key)!r}, this run has {live.get(key)!r}")
    # The probe budget's choice is in the checkpoint and re-applied at load: a run that has not chosen yet takes it.
    kept_saved = set(saved.get("high_precision", []))
    kept_live = set(live.get("high_precision", [])) or kept_saved
    saved_layers, live_layers = dict(saved["layers"]), dict(live["layers"])
    for name in sorted(set(saved_layers) | set(live_layers)):
        was = _layer_format(saved_layers.get(name) if name not in kept_saved else None, base_saved)
        now = _layer_format(live_layers.get(name) if name not in kept_live else None, base_live)
        if was != now and (name in saved_layers or name in live_layers) and not {was, now} <= set(_BASE.values()):
            differences.append(f"checkpoint trained `{name}` in {was}, this run has it in {now}")
        elif name in saved_layers and name in live_layers and not (_fallen(saved, name) or _fallen(live, name)):
            for key, what in (("recipe_fields", "recipe fields (scale rule, block shapes, rounding)"),
                              ("sr_key", "stochastic-rounding keys"), ("hadamard", "Hadamard signs")):
                if saved_layers[name].get(key) != live_layers[name].get(key):
                    differences.append(f"`{name}`: the checkpoint was trained with other {what} than this run"
                                       f" ({saved_layers[name].get(key)!r} vs {live_layers[name].get(key)!r})")
    if saved["fp8"] and live["fp8"]:
        for key in sorted(set(saved["fp8"]) - {"recipe"}):
            if saved["fp8"][key] != live["fp8"].get(key):
                differences.append(f"checkpoint trained with fp8 {key}={saved['fp8'][key]}, this run has"
                                   f" {live['fp8'].get(key)}")
    if saved["islands"] != live["islands"]:
        differences.append(f"checkpoint trained with FP32 islands {saved['islands']}, this run has {live['islands']}")
    return differences, notes


# ------------------------------------------------------------------------------------------ the pinned micro-batch
def pin_batch(batch: object, rows: int = PIN_ROWS) -> object | None:
    """The first ``rows`` rows (dimension 0) of every tensor in ``batch`` (dicts, lists, tuples), detached CPU copies;
    other leaves as they are. None when the result would exceed :data:`PIN_MAX_BYTES` or holds no tensor."""
    size = 0

    def cut(value: object) -> object:
        nonlocal size
        if isinstance(value, torch.Tensor):
            part = value.detach()[:rows] if value.dim() else value.detach()
            size += part.numel() * part.element_size()
            return part.to("cpu", copy=True)
        if isinstance(value, Mapping):
            return {key: cut(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return _rebuilt(value, [cut(item) for item in value])
        return value

    pinned = cut(batch)
    has_tensor = any(True for _ in tensor_leaves(pinned))
    return pinned if has_tensor and size <= PIN_MAX_BYTES else None


def to_device(batch: object, device: torch.device, dtype: torch.dtype | None = None) -> object:
    """``batch``'s tensors on ``device``; floating ones cast to ``dtype`` where given."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, dtype=dtype if dtype is not None and batch.is_floating_point() else None)
    if isinstance(batch, Mapping):
        return {key: to_device(value, device, dtype) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return _rebuilt(batch, [to_device(v, device, dtype) for v in batch])
    return batch


def _rebuilt(value: list | tuple, items: list[Any]) -> object:
    """``items`` in ``value``'s type, as Lightning moves a batch (``apply_to_collection``): a namedtuple from its
    fields (``training_step`` reads ``batch.x``), any other list or tuple from the sequence."""
    return type(value)(*items) if isinstance(value, tuple) and hasattr(value, "_fields") else type(value)(items)


def _typed_like(pinned: object, batch: object) -> object:
    """``pinned`` (plain containers, as a checkpoint holds them: :func:`_plain`) in the container types of ``batch``
    where the two have the same structure; its tensors as they are."""
    if isinstance(pinned, Mapping) and isinstance(batch, Mapping):
        return {key: _typed_like(value, batch[key]) if key in batch else value for key, value in pinned.items()}
    if isinstance(pinned, (list, tuple)) and isinstance(batch, (list, tuple)) and len(pinned) == len(batch):
        return _rebuilt(batch, [_typed_like(value, like) for value, like in zip(pinned, batch, strict=True)])
    return pinned


def _plain(batch: object) -> object:
    """``batch`` with every tuple subclass (a namedtuple) a tuple and every list subclass a list: what a checkpoint
    loaded with ``weights_only=True`` can hold."""
    if isinstance(batch, Mapping):
        return {key: _plain(value) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return (tuple if isinstance(batch, tuple) else list)(_plain(value) for value in batch)
    return batch


class PinnedPassWrote(RuntimeError):
    """The pinned pass's loss function wrote to a parameter in place: its loss is not one a resume repeats."""


def pinned_pass(module: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: object, *,
                forward_context: Callable[[], AbstractContextManager[Any]], dtype: torch.dtype | None = None
                ) -> torch.Tensor:
    """The loss and gradient norm of ``batch``: ``tensor([loss, grad_norm])`` (float64, on the module's device).
    ``batch`` is as the data loader gave it; ``dtype``: what a ``*-true`` run casts its floating inputs to now.

    One forward and backward in the run's precision (``forward_context``), with gradients whatever the caller's grad
    mode (a save from the validation loop), the module in eval mode, the RNG forked and seeded (:data:`PIN_SEED`);
    gradients through ``torch.autograd.grad``, so ``.grad`` is untouched (FSDP2's sharded parameters:
    :func:`_sharded_grads`, and the norm over every rank: collective). Afterwards every buffer (BatchNorm
    statistics, FP8 amax histories, stochastic-rounding counters), every tensor attribute of the modules (a
    torchmetrics ``Metric``'s states), every attribute holding a number or None (its private ``_update_count`` and
    ``_computed``) and every public one holding a list, dict or set is restored, the objects themselves and their
    values in place, so the run goes on exactly as without the pass."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    versions = [p._version for p in params]  # an in-place write during the pass bumps it
    device = params[0].device if params else torch.device("cpu")
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    attributes = [(sub, name, copy.copy(value)) for sub in module.modules() for name, value in vars(sub).items()
                  if _restored(name, value)]
    tensors = [(sub, name, value, value._version, value.detach().clone()) for sub in module.modules()
               for name, value in vars(sub).items() if isinstance(value, torch.Tensor) and not value.is_meta]
    training = module.training
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        torch.manual_seed(PIN_SEED)
        module.eval()
        try:
            # A save from the validation loop (ModelCheckpoint at a mid-epoch validation's end) runs under no_grad or
            # inference_mode: the pass is a training step's, with its graph. Eagerly: on a compiled model its rows and
            # eval mode would compile a graph of their own, and the rows' batch size would make Dynamo compile the
            # training graph again, dynamic in the batch.
            with torch.inference_mode(False), torch.enable_grad(), torch.compiler.set_stance("force_eager"):
                with forward_context():
                    loss = loss_fn(module, to_device(batch, device, dtype))
                if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                    raise RuntimeError("the pinned micro-batch's loss is not a differentiable tensor")
                grads = _sharded_grads(loss, params, module) if _is_sharded(params) else torch.autograd.grad(
                    loss, params, allow_unused=True)
        finally:
            module.train(training)
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
            for sub, name, value in attributes:
                _restore(sub, name, value)
            for sub, name, tensor, version, saved in tensors:
                if tensor._version != version:  # summed into in place (a SumMetric's `+=`)
                    with torch.no_grad():
                        tensor.copy_(saved)
                setattr(sub, name, tensor)  # rebound (``self.total = self.total + x``)
    written = [n for (n, p), v in zip(named, versions, strict=True) if p._version != v]
    if written:
        raise PinnedPassWrote(f"the pinned micro-batch's pass wrote to {written[:5]} in place (the loss function"
                              " changes weights as a side effect, e.g. a step-keyed write in training_step): a resume"
                              " would not repeat its loss; move the write to a hook such as on_train_batch_start")
    present = dense_values([g.detach() for g in grads if g is not None])  # a sparse embedding's: its values
    if _is_sharded(present):
        norm = _sharded_norm(present)
    else:
        norm = torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(present)])) if (
            present) else torch.zeros((), device=device)
    return torch.stack([loss.detach().double().reshape(()), norm.double()])


def _is_sharded(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether any of ``tensors`` is a DTensor (FSDP2 / ``ModelParallelStrategy`` parameters or their gradients)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in tensors)


def _sharded_grads(loss: torch.Tensor, params: Sequence[torch.Tensor], module: nn.Module
                   ) -> list[torch.Tensor | None]:
    """The gradients of ``loss`` as FSDP2 leaves them in ``.grad`` (reduce-scattered shards) after a real backward;
    every ``.grad`` is set aside before and put back after (the same tensor), so accumulated ones are untouched.

    Inside a no-sync accumulation window (``set_requires_gradient_sync(False)``, Fabric's ``no_backward_sync``) FSDP2
    accumulates the micro-batches' gradients unsharded, outside ``.grad``: those are set aside and put back too, and
    the sync is on for this one backward (its gradients reduce-scattered as at a synced step), then set as it was."""
    held = [p.grad for p in params]
    groups = _fsdp_param_groups(module)
    flags = [(group.reduce_grads, group.all_reduce_grads) for group in groups]
    unsharded = [(fsdp_param, fsdp_param.unsharded_accumulated_grad, _unsharded_grad(fsdp_param))
                 for group in groups for fsdp_param in group.fsdp_params]
    for p in params:
        p.grad = None
    for group in groups:
        group.reduce_grads = group.all_reduce_grads = True
    for fsdp_param, _, grad in unsharded:
        fsdp_param.unsharded_accumulated_grad = None
        if grad is not None:
            fsdp_param._unsharded_param.grad = None
    try:
        loss.backward()
        return [p.grad for p in params]
    finally:
        for p, grad in zip(params, held, strict=True):
            p.grad = grad
        for group, (reduce, all_reduce) in zip(groups, flags, strict=True):
            group.reduce_grads, group.all_reduce_grads = reduce, all_reduce
        for fsdp_param, accumulated, grad in unsharded:
            fsdp_param.unsharded_accumulated_grad = accumulated
            if grad is not None:
                fsdp_param._unsharded_param.grad = grad


def _fsdp_param_groups(module: nn.Module) -> list[Any]:
    """FSDP2's parameter groups of ``module``'s ``fully_shard`` units (private state: FSDP2 has no public handle on the
    gradients it accumulates while the sync is off)."""
    from torch.distributed.fsdp import FSDPModule

    groups: list[Any] = []
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            state = unit._get_fsdp_state()
            own = getattr(state, "_fsdp_param_groups", None)
            if own is None:  # a torch before grouped fully_shard: one group at most
                own = [] if state._fsdp_param_group is None else [state._fsdp_param_group]
            groups += own
    return groups


def _unsharded_grad(fsdp_param: Any) -> torch.Tensor | None:
    """The gradient an FSDP2 parameter accumulates unsharded while the sync is off, in its compute dtype (its
    ``unsharded_accumulated_grad`` holds it instead where the reduce dtype differs)."""
    unsharded = getattr(fsdp_param, "_unsharded_param", None)  # none before the first all-gather
    return None if unsharded is None else unsharded.grad


def _sharded_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of ``grads`` over every rank: DTensor gradients' through ``get_total_norm`` (a partial norm,
    all-reduced), any plain tensor's (a parameter FSDP2 does not manage) as this rank holds it."""
    from torch.distributed.tensor import DTensor

    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    total = torch.nn.utils.get_total_norm(sharded)
    norm = (total.full_tensor() if isinstance(total, DTensor) else total).float()
    if plain:
        norm = torch.linalg.vector_norm(torch.stack([norm, *(n.float().to(norm.device)
                                                             for n in torch._foreach_norm(plain))]))
    return norm


def _restored(name: str, value: object) -> bool:
    """Whether :func:`pinned_pass` puts a module attribute back: a number or None (private ones too: a metric's update
    counter, its cached result), or a public list, dict or set (the module's own ``_parameters``, ``_buffers`` and
    hooks are not the pass's to touch)."""
    return value is None or isinstance(value, (int, float)) or (
        not name.startswith("_") and isinstance(value, (list, dict, set)))


def _restore(owner: object, name: str, saved: object) -> None:
    """Put ``saved`` back as ``owner.name``: containers in place (other references see it), numbers by assignment."""
    live = getattr(owner, name, None)
    if isinstance(live, list) and isinstance(saved, list):
        live[:] = saved
    elif isinstance(live, (dict, set)) and type(live) is type(saved):
        live.clear()
        live.update(saved)
    else:
        setattr(owner, name, saved)


def deterministic(device: torch.device | str) -> bool:
    """Whether :func:`pinned_pass` repeats bitwise on ``device``: the CPU, or CUDA with deterministic algorithms."""
    return torch.device(device).type == "cpu" or torch.are_deterministic_algorithms_enabled()


_T = TypeVar("_T")


def from_rank_zero(value: _T) -> _T:
    """Rank 0's ``value`` on every rank (pickled: CPU tensors come back on the CPU): collective (one
    ``broadcast_object_list``) where several processes run, so every rank calls it; ``value`` itself in one process."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def same_pinned_batch(fingerprint: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    """Whether two fingerprints pinned the same micro-batch (equal tensors at equal paths), which tells one run's
    checkpoints from another's cheaply: a run pins its first batch and a resume carries it to every later save. True
    where either pinned none (nothing to tell by)."""
    batches = [(f.get("pinned") or {}).get("batch") for f in (fingerprint, other)]
    if batches[0] is None or batches[1] is None:
        return True
    leaves = [list(tensor_leaves(batch)) for batch in batches]
    return len(leaves[0]) == len(leaves[1]) and all(
        path == other_path and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        for (path, a), (other_path, b) in zip(*leaves, strict=True))


def _reason(error: Exception) -> str:
    """Why a pinned pass did not run, in one line: the exception's type and the start of its message."""
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}".rstrip(": ")


def compare_pinned(saved: Mapping[str, Any], measured: tuple[float, float], *, exact: bool) -> list[str]:
    """The pinned loss and gradient norm at the load against the save's: bitwise with ``exact``, else within
    :data:`LOSS_RTOL` / :data:`GRAD_NORM_RTOL`."""
    differences = []
    for key, value, rtol in (("loss", measured[0], LOSS_RTOL), ("grad_norm", measured[1], GRAD_NORM_RTOL)):
        was = float(saved[key])
        same = (was == value or (math.isnan(was) and math.isnan(value))) if exact else math.isclose(
            was, value, rel_tol=rtol, abs_tol=1e-12)
        if not same:
            how = "bitwise" if exact else f"rtol={rtol:g}"
            differences.append(f"the pinned micro-batch's {key.replace('_', ' ')} is {value!r} after the load,"
                               f" {was!r} at the save (compared {how})")
    return differences


# ------------------------------------------------------------------------------------------------ the fingerprint
class Fingerprint:
    """The run's side of the fingerprint: the pinned micro-batch, the reaction to a mismatch, what the last load found.

    A front end calls :meth:`pin` with the first training batch, :meth:`capture` when a checkpoint is written,
    :meth:`check_checksums` / :meth:`check_manifest` / :meth:`check_pinned` when one is read, and :meth:`react` with
    their differences; :meth:`start_run` when the same owner starts another run. ``on_mismatch``: ``"raise"``
    (:class:`FingerprintMismatch`), ``"warn"`` (a ``UserWarning``; the load goes on), ``"previous"`` (the front end
    loads the newest earlier checkpoint that passes; the differences are kept in :attr:`events`)."""

    def __init__(self, on_mismatch: OnMismatch = "raise", *, owner: str = "StablePrecision") -> None:
        self.on_mismatch = check_on_mismatch(owner, on_mismatch)
        self.owner = owner
        self.batch: object | None = None
        self.events: list[dict[str, Any]] = []
        """Each load checked: ``source``, ``differences``, ``notes``, ``action`` (``"passed"``, ``"raised"``,
        ``"warned"``, ``"previous"``)."""
        self.pending: dict[str, Any] | None = None
        """A loaded fingerprint whose pinned pass is still owed (the front end runs it when the model is loaded)."""
        self._unpinned: set[str] = set()  # why saves of this run hold no pinned loss, by exception type: warned once
        self._typed = True  # the pinned batch's containers are the loader's (a checkpoint's are plain: adopt)
        self.shared = False
        """Whether this run's :meth:`pin` broadcast rank 0's rows (``rank_zero``), kept or not (too large): a front end
        that pins at every batch until one is kept makes that collective once."""

    def start_run(self) -> None:
        """A new run with the same owner (a plugin reused for another Trainer's fit): nothing pinned (its first training
        batch pins its own rows), no load's pass pending, the once-a-run warnings due again. :attr:`events` stays, the
        record of every load checked."""
        self.batch, self.pending, self._typed, self.shared = None, None, True, False
        self._unpinned.clear()

    @property
    def pinning(self) -> bool:
        """Whether :meth:`pin` wants the next training batch: none is pinned, or the one a checkpoint gave
        (:meth:`adopt`) holds plain tuples where the loader's batch has namedtuples, which that batch retypes."""
        return self.batch is None or not self._typed

    def split(self, state: object, *, call: str) -> tuple[dict[str, Any] | None, Any]:
        """``(fingerprint, the plugin state without it)`` of a plugin state dict; ``(None, state)`` without one.

        Raises:
            TypeError, ValueError: the fingerprint is not what :meth:`capture` writes (each part named).
        """
        if not isinstance(state, dict) or KEY not in state:
            return None, state
        fingerprint = state[KEY]
        rest = {key: value for key, value in state.items() if key != KEY}
        if not isinstance(fingerprint, dict) or set(fingerprint) != {"version", "checksums", "manifest", "pinned"}:
            raise (ValueError if isinstance(fingerprint, dict) else TypeError)(
                f"{call}(fingerprint={fingerprint!r:.80}): must be the dict a save writes, with keys ['checksums',"
                " 'manifest', 'pinned', 'version']; the checkpoint is corrupted.")
        if fingerprint["version"] not in READS:
            raise ValueError(f"{call}(fingerprint['version']={fingerprint['version']!r}): this release reads"
                             f" versions {list(READS)}; the checkpoint is corrupted or from a newer release.")
        sums, manifest_, pinned = fingerprint["checksums"], fingerprint["manifest"], fingerprint["pinned"]
        if not isinstance(sums, dict) or not all(isinstance(k, str) and type(v) is int for k, v in sums.items()):
            raise TypeError(f"{call}(fingerprint['checksums']={sums!r:.80}): must map tensor paths to int checksums.")
        needed = {"precision", "master_weights", "layers", "fp8", "islands"}
        if not isinstance(manifest_, dict) or not needed <= set(manifest_) or not isinstance(manifest_["layers"],
                                                                                              dict):
            raise (TypeError if not isinstance(manifest_, dict) else ValueError)(
                f"{call}(fingerprint['manifest']={manifest_!r:.80}): must hold {sorted(needed)}.")
        if not isinstance(pinned, dict) or (pinned and not (
                {"batch", "loss", "grad_norm", "deterministic"} <= set(pinned)
                and all(isinstance(pinned[k], float) for k in ("loss", "grad_norm"))
                and isinstance(pinned["deterministic"], bool))):
            raise (TypeError if not isinstance(pinned, dict) else ValueError)(
                f"{call}(fingerprint['pinned']={pinned!r:.80}): must be {{}} or hold the pinned 'batch', its 'loss'"
                " and 'grad_norm' (floats) and 'deterministic' (a bool).")
        return fingerprint, rest

    def pin(self, batch: object, *, rank_zero: bool = False) -> None:
        """Keep ``batch`` (capped: :func:`pin_batch`) as the pinned micro-batch, unless one is pinned already. With
        ``rank_zero``, rank 0's cut rows on every rank (:func:`from_rank_zero`: collective where several processes run
        and none is pinned yet), so a pass whose gradient norm spans the ranks (FSDP2) runs on the rows the checkpoint
        keeps. A batch adopted from a checkpoint stays, its containers retyped as ``batch``'s (local: the rows are
        every rank's already)."""
        if self.batch is None:
            pinned = pin_batch(batch)
            self.batch = from_rank_zero(pinned) if rank_zero else pinned
            self.shared = self.shared or rank_zero
        elif not self._typed:
            self.batch = _typed_like(self.batch, batch)
        self._typed = True

    def capture(self, trees: Mapping[str, object], live: Mapping[str, Any],
                loss: Callable[[object], torch.Tensor] | None) -> dict[str, Any]:
        """The fingerprint of a checkpoint: ``trees``' checksums, ``live`` (this run's :func:`manifest`) and, with a
        pinned batch and ``loss`` (``batch -> tensor([loss, grad_norm])`` on the model's device, e.g.
        :func:`pinned_pass`), the pinned entry."""
        pinned: dict[str, Any] = {}
        if self.batch is not None and loss is not None:
            try:
                measured = loss(self.batch)
            except Exception as error:  # noqa: BLE001  the user's step or autograd: a save must not kill the run
                # The pass changed weights (PinnedPassWrote), or cannot run the rows: a step that returns None for
                # them, losses only in train mode, reentrant activation checkpointing (no torch.autograd.grad).
                # Checksums and manifest only, and a load of this checkpoint compares no pinned loss.
                if type(error).__name__ not in self._unpinned:
                    self._unpinned.add(type(error).__name__)
                    warnings.warn(f"{self.owner}: this checkpoint's fingerprint has no pinned loss (checksums and"
                                  f" manifest only; said once a run): the pinned pass raised {_reason(error)}.",
                                  UserWarning, stacklevel=2)
            else:
                values = measured.tolist()
                pinned = {"batch": _plain(self.batch), "loss": values[0], "grad_norm": values[1],
                          "deterministic": deterministic(measured.device)}
        return {"version": VERSION, "checksums": checksums(trees), "manifest": dict(live), "pinned": pinned}

    def adopt(self, fingerprint: Mapping[str, Any]) -> None:
        """After a load: the checkpoint's pinned batch becomes the run's (later saves pin the same rows)."""
        pinned = fingerprint.get("pinned") or {}
        if pinned.get("batch") is not None:
            self.batch, self._typed = pinned["batch"], False

    def check(self, fingerprint: Mapping[str, Any], trees: Mapping[str, object], live: Mapping[str, Any]
              ) -> tuple[list[str], list[str]]:
        """``(differences, notes)``: ``trees``' checksums against the fingerprint's, its manifest against ``live``
        (this run's :func:`manifest`)."""
        differences = compare_checksums(fingerprint["checksums"], trees, fingerprint["version"])
        more, notes = compare_manifests(fingerprint["manifest"], live)
        return differences + more, notes

    def candidate_differences(self, plugin_state: object, trees: Callable[[dict[str, Any]], Mapping[str, object]],
                              live: Callable[[], Mapping[str, Any]], *, call: str, required: bool = True,
                              run_of: Mapping[str, Any] | None = None) -> list[str]:
        """A candidate checkpoint's differences (:meth:`check`): its plugin state's fingerprint against
        ``trees(the plugin state without it)`` and ``live()``; an unreadable fingerprint, or none where one is
        ``required``, is the difference. ``run_of``: the fingerprint of the file the candidate would replace; a
        candidate that pinned another micro-batch is another run's (:func:`same_pinned_batch`)."""
        try:
            saved, plugin = self.split(plugin_state, call=call)
        except (TypeError, ValueError) as error:
            return [str(error)]
        if saved is None:
            return ["it holds no fingerprint"] if required else []
        if run_of is not None and not same_pinned_batch(saved, run_of):
            return ["it pinned another micro-batch than the failed file: another run's checkpoint (two runs writing"
                    " to one directory?)"]
        differences, _ = self.check(saved, trees(plugin), live())
        return differences

    def check_pinned(self, fingerprint: Mapping[str, Any], loss: Callable[[object], torch.Tensor],
                     live: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        """``(differences, notes)``: the pinned micro-batch recomputed (``loss``: as for :meth:`capture`) against the
        save's; none without a pinned entry, or when the checkpoint was written in another precision or weight mode
        (its loss differs by design; said in the notes of :meth:`check`). A pass that raises (the user's step, which
        may have changed since the save, or autograd) is no mismatch: a note says it was not compared and why. One
        host read."""
        pinned, saved = fingerprint.get("pinned") or {}, fingerprint["manifest"]
        if not pinned or (saved["precision"], saved["master_weights"]) != (live["precision"], live["master_weights"]):
            return [], []
        try:
            measured = loss(pinned["batch"])  # on every rank: a sharded model's forward is collective
        except Exception as error:  # noqa: BLE001  a check that cannot run must not stop the resume
            found: tuple[list[str], list[str]] = [], [
                f"the pinned micro-batch's loss was not compared ({_reason(error)})"]
        else:
            values = measured.tolist()
            exact = bool(pinned["deterministic"]) and deterministic(measured.device)
            found = compare_pinned(pinned, (values[0], values[1]), exact=exact), []
        # The file holds the plugin state of rank 0 (DDP's one file, DCP's metadata), so rank 0's verdict counts: under
        # the Trainer another rank's training_step may pick its rows by rank.
        return from_rank_zero(found)

    def react(self, source: str, differences: list[str], notes: list[str] = ()) -> bool:  # type: ignore[assignment]
        """Record the check of ``source``; with differences raise (``"raise"``), warn (``"warn"``) or return True
        (``"previous"``: the caller falls back). Returns False when the load goes on."""
        action = "passed" if not differences else {"raise": "raised", "warn": "warned"}.get(self.on_mismatch,
                                                                                             "previous")
        self.events.append({"source": source, "differences": list(differences), "notes": list(notes),
                            "action": action})
        if not differences:
            return False
        if self.on_mismatch == "raise":
            raise FingerprintMismatch(source, differences)
        if self.on_mismatch == "warn":
            warnings.warn(f"{FingerprintMismatch(source, differences)} Loaded anyway"
                          " (on_fingerprint_mismatch='warn').", UserWarning, stacklevel=3)
            return False
        return True


# ------------------------------------------------------------------------------------------ earlier checkpoints
def _step_of(checkpoint: Mapping[str, Any]) -> int:
    step = checkpoint.get("global_step", -1)
    return int(step) if isinstance(step, int) else -1


def previous_checkpoints(path: str | Path, *, pattern: str = "*.ckpt") -> list[Path]:
    """The other checkpoints in ``path``'s directory written before it, newest first: files matching ``pattern``
    whose modification time is earlier than ``path``'s (ties broken by name, descending)."""
    path = Path(path)
    return written_before(path, [p for p in path.parent.glob(pattern) if p.is_file()])


def previous_passing_checkpoint(path: str | Path, check: Callable[[dict[str, Any]], list[str]], *,
                                pattern: str = "*.ckpt") -> tuple[Path, dict[str, Any], dict[str, list[str]]] | None:
    """The newest checkpoint written before ``path`` (:func:`previous_checkpoints`) for which ``check(checkpoint)``
    (the loaded dict) finds no difference: ``(its path, the loaded dict, {rejected path: its differences})``, or None
    when none passes. The entry point of the remedy ladder's "restored state" rung (fall back to the previous good
    checkpoint); loads with ``torch.load(map_location="cpu", weights_only=True)``, one file at a time."""
    rejected: dict[str, list[str]] = {}
    for candidate in previous_checkpoints(path, pattern=pattern):
        try:
            loaded = torch.load(candidate, map_location="cpu", weights_only=True)
        except Exception as error:  # unreadable: not a candidate  # noqa: BLE001
            rejected[str(candidate)] = [f"unreadable ({type(error).__name__}: {str(error)[:120]})"]
            continue
        differences = check(loaded)
        if not differences:
            return candidate, loaded, rejected
        rejected[str(candidate)] = differences
    return None


def earlier_checkpoint(path: str | Path, loaded_step: int, check: Callable[[dict[str, Any]], list[str]], *,
                       step_of: Callable[[Mapping[str, Any]], int], required: Sequence[str] = (),
                       pattern: str = "*.ckpt") -> tuple[Path, dict[str, Any], dict[str, list[str]]] | tuple[
                           None, None, str]:
    """The restored-state rung's search (the Trainer's ``ScaleCheckpoint(restored_window=N)``, Fabric's
    ``StablePrecision.load(..., restored_window=N)``): the newest checkpoint of ``path``'s directory written before it
    (:func:`previous_checkpoints`; and ``step_of(checkpoint)``, the step it holds, below ``loaded_step``, the step
    ``path`` resumed at: a file the run wrote after the load is not earlier) that holds every key of ``required``
    (the training state, not a weights-only file) and for which ``check(checkpoint)`` finds no difference (its
    fingerprint): ``(its path, the loaded dict, {rejected path: its differences})``, else ``(None, None, why)``."""
    reasons: list[str] = []

    def differences(checkpoint: dict[str, Any]) -> list[str]:
        step = step_of(checkpoint)
        if missing := [key for key in required if key not in checkpoint]:
            found = [f"holds no {', '.join(missing)} (a weights-only checkpoint)"]
        elif step < 0 or step >= loaded_step:
            found = [f"written at step {step}, not before the loaded checkpoint's {loaded_step}"]
        else:
            found = check(checkpoint)
        reasons.extend(found[:1])
        return found

    found = previous_passing_checkpoint(path, differences, pattern=pattern)
    if found is not None:
        return found
    tried = previous_checkpoints(path, pattern=pattern)
    return None, None, (f"no earlier checkpoint passes among {len(tried)} in {Path(path).parent}"
                        + (f" ({'; '.join(reasons[:3])})" if reasons else ""))


# ------------------------------------------------------------------------------------- a Lightning checkpoint dict
def checkpoint_trees(checkpoint: Mapping[str, Any], plugin_key: str) -> dict[str, object]:
    """What a Trainer checkpoint's checksums cover: the model's ``state_dict``, the ``optimizer_states`` (as written:
    torchao states flat) and the plugin's state under ``plugin_key`` (without the fingerprint)."""
    plugin = {key: value for key, value in dict(checkpoint.get(plugin_key) or {}).items() if key != KEY}
    return {"state_dict": checkpoint.get("state_dict", {}), "optimizer_states": checkpoint.get("optimizer_states", []),
            "plugin": plugin}


def _without_added_weights(saved: Mapping[str, int], trees: dict[str, object]) -> tuple[dict[str, object], list[str]]:
    """``(trees without the model weights the save did not checksum, a note naming them)``. Lightning runs the
    LightningModule's ``on_load_checkpoint`` on the loaded dict before the plugin sees it, and a module that leaves a
    frozen layer out of its files puts its own tensors back there (to load strictly): they are not the file's, and
    nothing of the file's saved tensors changed. Weights the save held and the load lacks are still differences."""
    state = trees.get("state_dict")
    if not isinstance(state, Mapping):
        return trees, []
    added = [key for key, value in state.items() if type(value) in _PLAIN and f"state_dict[{key!r}]" not in saved]
    if not added:
        return trees, []
    named = ", ".join(f"`state_dict[{key!r}]`" for key in added[:5]) + (f" and {len(added) - 5} more" if len(
        added) > 5 else "")
    return {**trees, "state_dict": {key: value for key, value in state.items() if key not in added}}, [
        f"weights {named} were not in the saved checkpoint (put into the loaded dict by a load hook, such as the"
        " LightningModule's on_load_checkpoint): not compared"]


class CheckpointCheck:
    """Checks a Trainer checkpoint dict at load (``on_load_checkpoint``: before anything of it is restored but the
    model's weights) and, with ``on_mismatch="previous"``, swaps the dict's contents for the newest earlier checkpoint
    of its directory that passes, reloading what was restored from it already (``reload``)."""

    def __init__(self, fingerprint: Fingerprint, plugin_key: str, live: Callable[[], Mapping[str, Any]],
                 reload: Callable[[dict[str, Any]], None],
                 live_as_of: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None) -> None:
        """``live``: this run's :func:`manifest` when called (``PrecisionStepper.manifest``); ``live_as_of``: the
        manifest an earlier checkpoint of the run is compared with (a precision schedule's switches since undone)."""
        self.fingerprint, self.plugin_key, self.live, self.reload = fingerprint, plugin_key, live, reload
        self.live_as_of = live_as_of

    def differences(self, checkpoint: Mapping[str, Any], *, required: bool = True,
                    run_of: Mapping[str, Any] | None = None) -> list[str]:
        as_of = self.live_as_of
        return self.fingerprint.candidate_differences(
            checkpoint.get(self.plugin_key), lambda _: checkpoint_trees(checkpoint, self.plugin_key),
            self.live if as_of is None else lambda: as_of(checkpoint), call=self.plugin_key, required=required,
            run_of=run_of)

    def verify_(self, checkpoint: dict[str, Any], path: str | Path | None,
                loaded: Mapping[str, object] | None = None) -> None:
        """Check ``checkpoint`` (read from ``path``); a checkpoint without a fingerprint passes unchecked. ``loaded``:
        the trees a strategy loaded in place instead of returning them in ``checkpoint`` (a sharded directory)."""
        saved, _ = self.fingerprint.split(checkpoint.get(self.plugin_key), call=f"{self.plugin_key}.load_state_dict")
        if saved is None:
            return
        trees, added = _without_added_weights(saved["checksums"], {**checkpoint_trees(checkpoint, self.plugin_key),
                                                                   **(loaded or {})})
        differences, notes = self.fingerprint.check(saved, trees, self.live())
        if self.fingerprint.react(str(path), differences, notes + added):
            self.fall_back_(checkpoint, path, differences)  # it owes the fallback's pinned pass, under its own path
        else:
            self._loaded(checkpoint, path)

    def fall_back_(self, checkpoint: dict[str, Any], path: str | Path | None, why: list[str]) -> None:
        """Replace ``checkpoint``'s contents by the newest earlier passing checkpoint's and ``reload`` it. Earlier is
        the restored-state rung's (:func:`earlier_checkpoint`): written before it, at a ``global_step`` below its
        own; and of the same run: the same pinned micro-batch (a directory two runs wrote to holds the other run's
        files, later steps among them).

        Raises:
            FingerprintMismatch: ``path`` is unknown, or no earlier checkpoint passes (each one's reason named).
        """
        if path is None:
            raise FingerprintMismatch("None", [*why, "on_fingerprint_mismatch='previous' found no earlier checkpoint:"
                                                     " the loaded one's directory is unknown"])
        failed = checkpoint[self.plugin_key][KEY]
        found = earlier_checkpoint(path, _step_of(checkpoint), lambda c: self.differences(c, run_of=failed),
                                   step_of=_step_of)
        if found[0] is None:
            raise FingerprintMismatch(str(path), [*why, f"on_fingerprint_mismatch='previous': {found[2]}"])
        previous, loaded, rejected = found
        checkpoint.clear()
        checkpoint.update(loaded)
        self.reload(checkpoint)
        skipped = "".join(f"; {p} failed too ({d[0]})" for p, d in rejected.items())
        warnings.warn(f"{self.fingerprint.owner}: {path} fails its numeric fingerprint ({'; '.join(why[:3])});"
                      f" resumed from {previous} (global_step={_step_of(loaded)}) instead{skipped}"
                      " (on_fingerprint_mismatch='previous').", UserWarning, stacklevel=3)
        self.fingerprint.events[-1]["fallback"] = str(previous)
        self._loaded(checkpoint, previous)

    def _loaded(self, checkpoint: dict[str, Any], path: str | Path | None) -> None:
        saved = checkpoint[self.plugin_key][KEY]
        self.fingerprint.adopt(saved)
        self.fingerprint.pending = {"fingerprint": saved, "path": path, "checkpoint": checkpoint}

    def verify_pinned_(self, loss: Callable[[object], torch.Tensor], load_plugin: Callable[[dict[str, Any]], None]
                       ) -> None:
        """Once the model and the plugin's state are loaded: the pinned micro-batch recomputed; with "previous" a
        mismatch falls back (and ``load_plugin`` loads the new checkpoint's plugin state, which checks again)."""
        pending, self.fingerprint.pending = self.fingerprint.pending, None
        if pending is None:
            return
        differences, notes = self.fingerprint.check_pinned(pending["fingerprint"], loss, self.live())
        if self.fingerprint.react(f"{pending['path']} (pinned micro-batch)", differences, notes):
            self.fall_back_(pending["checkpoint"], pending["path"], differences)
            load_plugin(pending["checkpoint"][self.plugin_key])


# ---------------------------------------------------------------------------------------- sharded (DTensor) state
SHARDS = "shards"
"""The root of the checksums of sharded tensors' local shards: ``shards[rank 1 of 2]model['fc1.weight']`` is rank 1's
shard of the model's ``fc1.weight``. :func:`compare_checksums` compares the roots it is given, so these entries are
only ever compared by :func:`compare_shard_checksums`."""


def _rank_and_world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shard_root(rank: int, world: int) -> str:
    return f"{SHARDS}[rank {rank} of {world}]"


def _local_shards(tree: object) -> object:
    """``tree`` with every DTensor replaced by its local shard (a plain tensor) and every other tensor dropped."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, Mapping):
        return {key: _local_shards(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_local_shards(value) for value in tree]
    return None


def _has_shards(trees: Mapping[str, object]) -> bool:
    from torch.distributed.tensor import DTensor

    def walk(tree: object) -> bool:
        if isinstance(tree, Mapping):
            return any(walk(value) for value in tree.values())
        if isinstance(tree, (list, tuple)):
            return any(walk(value) for value in tree)
        return isinstance(tree, DTensor)

    return any(walk(tree) for tree in trees.values())


def _all_ranks(value: dict[str, int] | list[str]) -> list[Any]:
    """``value`` of every rank, in rank order (one ``all_gather_object``; just ``[value]`` in one process)."""
    _, world = _rank_and_world()
    if world < 2:
        return [value]
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def every_rank(lines: list[str]) -> list[str]:
    """Every rank's ``lines``, in rank order, each once: collective (one ``all_gather_object``) where several processes
    run, so every rank calls it and decides alike on what one rank found."""
    return list(dict.fromkeys(line for part in _all_ranks(lines) for line in part))


def shard_checksums(trees: Mapping[str, object]) -> dict[str, int]:
    """The :func:`checksum` of every DTensor's local shard in ``trees`` (FSDP2 / ``ModelParallelStrategy`` weights and
    optimizer states, which :func:`tensor_leaves` skips), of every rank, keyed by rank and path
    (``shards[rank 1 of 2]model['fc1.weight']``). A sharded checkpoint's plugin state is rank 0's (DCP's metadata), so
    each rank's checksums are gathered into every rank's dict: collective (one ``all_gather_object``) where the trees
    hold DTensors and several processes run, so every rank calls it (as ``fabric.save`` calls ``state_dict``); ``{}``
    where they hold none."""
    if not _has_shards(trees):
        return {}
    rank, world = _rank_and_world()
    root = _shard_root(rank, world)
    own = checksums({f"{root}{name}": _local_shards(tree) for name, tree in trees.items()})
    return {path: value for part in _all_ranks(own) for path, value in part.items()}


def compare_shard_checksums(saved: Mapping[str, int], trees: Mapping[str, object]) -> tuple[list[str], list[str]]:
    """``(differences, notes)``: each rank's local shards of ``trees``' DTensors against the checksums this rank had at
    the save (:func:`shard_checksums`), the differences of every rank named and gathered, so every rank decides
    alike (collective where ``saved`` holds shard checksums under ``trees``' roots and several processes run: every
    rank calls it). A checkpoint saved on another number of ranks is resharded as it loads (DCP): its local shards are
    other slices, not compared (a note says so); one without shard checksums passes."""
    roots = tuple(trees)
    entries = {path: value for path, value in saved.items()
               if path.startswith(f"{SHARDS}[") and path.partition("]")[2].startswith(roots)}
    if not entries:
        return [], []
    rank, world = _rank_and_world()
    saved_worlds = sorted({path.partition(" of ")[2].partition("]")[0] for path in entries})
    if saved_worlds != [str(world)]:
        return [], [f"the checkpoint's shards were checksummed on {' or '.join(saved_worlds)} ranks, this run has"
                    f" {world}: resharded as they load, their local shards were not compared"]
    root = _shard_root(rank, world)
    mine = {path: value for path, value in entries.items() if path.startswith(root)}
    live = {f"{root}{name}": _local_shards(tree) for name, tree in trees.items()}
    differences = compare_checksums(mine, live)
    return [line for part in _all_ranks(differences) for line in part], []

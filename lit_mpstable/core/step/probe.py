"""What low precision cost a step's gradients, per module: the run's gradients against an FP32 recompute."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from itertools import groupby
from operator import itemgetter
from typing import Any

import torch
from torch import nn

from lit_mpstable.core.layout.layout import PrecisionLayout
from lit_mpstable.core.tensors import default_dtype
from lit_mpstable.core.weights.weights import WeightKeeper
from lit_mpstable.fp8 import convert_from_fp8
from lit_mpstable.fp8.budget import LossFn  # (module, batch) -> the loss of one (micro-)batch, before loss scaling

METRICS = ("underflow_frac", "rel_error", "cosine")
"""The measures, overall and per module (see :func:`measure`)."""
_FP8_METRICS = ("fp8_rel_error", "base_rel_error")
# Columns of a module's sums: elements flushed (nonzero in FP32, zero in the run), nonzero in FP32,
# ||g - g32||^2, ||g32||^2, ||g||^2, <g, g32>, non-finite elements of g (float64, on the device), elements (counted
# on the host, appended to the rows read back).
_FLUSHED, _NONZERO, _DIFF2, _REF2, _RUN2, _DOT, _BAD, _NUMEL = range(8)
_CHUNK = 1 << 22
"""Gradient elements :func:`_module_sums` takes in one pass: its float64 buffers (9 x 8 bytes an element, 300 MB at
most) stay this size whatever the model's; one pass is ~20 kernels, however many parameters it holds."""
_BLOCK = 128
"""Elements :func:`_module_sums` adds in one vectorized sum; a parameter starts a block (zeros pad the one before)."""

try:
    from torch.distributed.tensor import DTensor as _DTENSOR
except ImportError:  # a torch build without torch.distributed
    _DTENSOR = ()  # type: ignore[assignment,misc]


def forward_state(layout: PrecisionLayout, device: str) -> dict[str, object]:
    """:meth:`PrecisionStepper.forward_state <lit_mpstable.core.step.stepper.PrecisionStepper.forward_state>` of a
    stepper's ``layout``; ``device``: the stepper's, where the RNG lives while no model is attached."""
    rng: dict[str, torch.Tensor] = {"cpu": torch.get_rng_state()}
    device_ = next(layout.module.parameters()).device if layout.module is not None else torch.device(device)
    if device_.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device_)
    layers = layout.fp8_layers
    backend, module = layout.fp8_backend, layout.module  # FP8 layers: converted by a backend, in an attached model
    fp8 = backend.state_dict(module, layers) if layers and backend is not None and module is not None else {}
    return {"rng": rng, "fp8_layers": layers, "fp8": fp8}


def measure(
    module: nn.Module,
    loss_fn: LossFn,
    batch: object,
    *,
    layout: PrecisionLayout,
    keeper: WeightKeeper,
    named_grads: Callable[[], list[tuple[str, torch.Tensor]]],
    owed: Mapping[str, torch.Tensor],
    scale: Callable[[], float],
    forward_context: Callable[[], AbstractContextManager[object]],
    device: str,
    recompute: bool = False,
    start: dict[str, Any] | None = None,
    step: int | None = None,
) -> dict[str, Any]:
    """:meth:`PrecisionStepper.measure <lit_mpstable.core.step.stepper.PrecisionStepper.measure>` over the
    stepper's parts: its ``layout`` (the model, FP8 layers, FP32 islands), ``keeper`` (the FP32 weights),
    ``named_grads`` (the run's gradients, read unless ``recompute``) and the factors they still ``owe`` (by name:
    compact weights unscale in the step), the loss ``scale``, its ``forward_context`` and ``device`` (where the RNG
    lives without a model)."""
    if module is not layout.module:
        raise ValueError(
            f"measure(module={type(module).__name__}): the stepper was set up with another module"
            f" ({type(layout.module).__name__}); pass the one given to stepper.setup_module()."
        )
    params = dict(module.named_parameters())
    if any(isinstance(p, _DTENSOR) for p in params.values()):
        raise RuntimeError("measure(): sharded (DTensor, FSDP2) parameters are not supported: the FP32 recompute needs"
                           " whole parameters on each rank.")
    if recompute:
        names = [name for name, p in params.items() if p.requires_grad]
        run: list[torch.Tensor | None] = []
    else:
        grads = [(name, grad) for name, holder in named_grads() if (grad := holder.grad) is not None]
        names = [name for name, _ in grads]
        # A gradient the step still unscales is measured as it will step: times its factor, in FP32 (a copy).
        run = [grad if (factor := owed.get(name)) is None else grad.float() * factor for name, grad in grads]
    loss_scale = scale()
    where = next(iter(params.values())).device if params else torch.device("cpu")
    start = start if start is not None else forward_state(layout, device)
    present = dict(module.named_modules()) if layout.fp8_layers else {}
    fp8_layers = [name for name in layout.fp8_layers if name in present]
    # The gradients unscaled in FP32: those that go into the masters, and all of a keeper that unscales in its step.
    in_fp32 = set(names) if keeper.defers_unscale else set(keeper.fp32_weights()) if keeper.exposes_grads else set()
    # Eagerly: on a compiled model the FP32 copy and the probe's recomputes would each compile graphs of their own.
    with _forked_rng(where), torch.compiler.set_stance("force_eager"):
        reference = _fp32_grads(module, loss_fn, batch, names, start, where, keeper, layout.islands)
        if recompute:
            run = _run_grads(module, loss_fn, batch, names, start, loss_scale, layout=layout,
                             forward_context=forward_context, in_fp32=in_fp32, keep_fp8=True)
        base = _run_grads(module, loss_fn, batch, names, start, loss_scale, layout=layout,
                          forward_context=forward_context, in_fp32=in_fp32, keep_fp8=False) if fp8_layers else []

    owners = [name.rpartition(".")[0] for name in names]
    modules = {owner: i for i, owner in enumerate(dict.fromkeys(owners))}  # in order of their first parameter
    owner_ids = [modules[o] for o in owners]
    # A parameter's elements: its FP32 gradient's, else its run gradient's, else its own (no gradient either way).
    numels = [(r if r is not None else g if g is not None else params[n]).numel()
              for n, g, r in zip(names, run, reference)]
    per_module = _module_sums(run, reference, numels, owner_ids, len(modules), device=where)
    fp8_rows = [_fp8_sums([i for i, o in enumerate(owners) if o == layer], run, base, reference, params, names)
                for layer in fp8_layers]
    values = torch.cat([per_module.sum(0, keepdim=True), per_module, *fp8_rows]).tolist()  # the one host sync
    module_numels = [0] * len(modules)
    for i, n in zip(owner_ids, numels):
        module_numels[i] += n
    for row, n in zip(values, [sum(numels), *module_numels]):
        row.append(float(n))

    total = values[0]
    result: dict[str, Any] = {"step": step, "loss_scale": loss_scale, "recomputed": recompute,
                              "finite": total[_BAD] == 0}
    result.update(_metrics(total))
    result["modules"] = {name: _metrics(row) for name, row in zip(modules, values[1 : 1 + len(modules)])}
    result["fp8"] = {
        layer: _fp8_metrics(row) for layer, row in zip(fp8_layers, values[1 + len(modules) :])
    }
    return result


# ------------------------------------------------------------------------------------------------ the passes
def _fp32_grads(
    module: nn.Module, loss_fn: LossFn, batch: object, names: Sequence[str], start: dict[str, Any],
    device: torch.device, keeper: WeightKeeper, islands: object,
) -> list[torch.Tensor | None]:
    """FP32 gradients of ``names`` on a copy of ``module``: no FP8, FP32 weights (the masters where they exist, the
    compensated values of ``master_weights='kahan'``)."""
    memo: dict[int, Any] = {}
    reference = _copy(module, memo)
    convert_from_fp8(reference)
    reference.float()
    params = dict(reference.named_parameters())
    with torch.no_grad():
        # The masters, or a Kahan weight's 16-bit part plus its compensation.
        for name, weight in keeper.fp32_weights().items():
            if name in params:
                params[name].copy_(weight)
    islands = memo.get(id(islands))  # the copy's FP32 islands: in *-true modes they cast outputs to 16 bits
    if islands is not None:
        islands.output_dtype = None
    _restore_rng(start["rng"], device)
    with torch.enable_grad(), torch.autocast(device.type, enabled=False), default_dtype(torch.float32):
        loss = _checked_loss(loss_fn(reference, _upcast(batch)))
        return list(torch.autograd.grad(loss.float(), [params[n] for n in names], allow_unused=True))


def _run_grads(
    module: nn.Module, loss_fn: LossFn, batch: object, names: Sequence[str], start: dict[str, Any], scale: float, *,
    layout: PrecisionLayout, forward_context: Callable[[], AbstractContextManager[object]], in_fp32: set[str],
    keep_fp8: bool,
) -> list[torch.Tensor | None]:
    """Gradients of ``names`` in the run's precision (``forward_context``) on a copy of ``module`` (with its FP8
    layers at ``start``'s scaling state, or without FP8), scaled backward, unscaled as the step unscales them
    (in FP32 where the step unscales in FP32, into a master or in a compact step: ``in_fp32``)."""
    low = _copy(module, {})
    if not keep_fp8:
        convert_from_fp8(low)
    elif start["fp8"] and start["fp8_layers"] == layout.fp8_layers:
        assert layout.fp8_backend is not None  # the start state holds FP8 layers: a backend converted them
        layout.fp8_backend.load_state_dict(low, layout.fp8_layers, start["fp8"])
    params = dict(low.named_parameters())
    device = next(iter(params.values())).device
    _restore_rng(start["rng"], device)
    with torch.enable_grad():
        with forward_context():
            loss = _checked_loss(loss_fn(low, batch))
        # As GradScaler: the FP32 scale times the loss (fp16 * fp32 promotes), reciprocal in FP64 rounded to FP32.
        scaled = loss * torch.tensor(scale, dtype=torch.float32, device=loss.device)
        grads = torch.autograd.grad(scaled, [params[n] for n in names], allow_unused=True)
    inv_scale = torch.tensor(1.0 / scale, dtype=torch.float32, device=device)
    return [_unscaled(g, inv_scale, fp32=name in in_fp32) for name, g in zip(names, grads)]


def _copy(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """A deep copy of ``module`` for a replay. A tensor attribute that is not a graph leaf (a torchmetrics state
    updated with the attached loss, as the Lightning-Hydra template does) refuses ``copy.deepcopy``; the copy gets it
    detached and cloned instead, so the replay can update it without reaching the run's metric or graph."""
    for sub in module.modules():
        for value in vars(sub).values():
            _detach_non_leaves(value, memo)
    try:
        return copy.deepcopy(module, memo)
    except Exception as error:  # an attribute deepcopy cannot copy (a lock, a handle): a loss_fn would not help
        raise ProbeCopyError(
            f"measure(): {type(module).__name__} cannot be deep-copied for the replay ({error!r}); make the attribute"
            " copyable (or drop it from the module) to probe this run.") from error


class ProbeCopyError(RuntimeError):
    """The module could not be copied for a replay (no ``loss_fn`` can help)."""


def _detach_non_leaves(value: object, memo: dict[int, Any], depth: int = 0) -> None:
    if isinstance(value, torch.Tensor):
        if not value.is_leaf and id(value) not in memo:
            memo[id(value)] = value.detach().clone()
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            _detach_non_leaves(item, memo, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for item in value.values():
            _detach_non_leaves(item, memo, depth + 1)


def _unscaled(grad: torch.Tensor | None, inv_scale: torch.Tensor, *, fp32: bool) -> torch.Tensor | None:
    if grad is None:
        return None
    if fp32 or grad.dtype == torch.float32:
        return grad.float() * inv_scale  # into the FP32 master (or an FP32 parameter), unscaled there
    # 16-bit gradients without a master ("16-true" without masters) are unscaled in place: the product rounds to
    # their dtype (small values may flush there too).
    return (grad.float() * inv_scale).to(grad.dtype)


def _checked_loss(loss: object) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise RuntimeError(
            f"measure(): loss_fn returned {type(loss).__name__}"
            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; it must return the scalar loss of the"
            " module it is given, with its graph (not detached)."
        )
    return loss.reshape(())


# ------------------------------------------------------------------------------------------------ the numbers
def _module_sums(
    run: Sequence[torch.Tensor | None], reference: Sequence[torch.Tensor | None], numels: Sequence[int],
    owners: Sequence[int], modules: int, *, device: torch.device, chunk: int = _CHUNK, block: int = _BLOCK,
) -> torch.Tensor:
    """The sums ``_FLUSHED`` .. ``_BAD`` of each module's gradients as a (``modules``, 7) float64 tensor: parameter
    ``i`` (``numels[i]`` elements, of module ``owners[i]``) has the run's gradient ``run[i]`` and the FP32 one
    ``reference[i]``, zeros where either is ``None``. In float64 (squares of tiny gradients underflow in FP32), and
    many parameters a kernel: the gradients, a module's side by side, go through ``chunk`` elements at a time, each
    parameter padded with zeros (which add nothing to any sum) to whole ``block``s. The per-element terms are those of
    a parameter alone; only the order of their additions differs: by block, then the blocks of a module in order."""
    order = sorted(range(len(owners)), key=owners.__getitem__)  # stable: a module's parameters in their order
    flat = [(owners[i], _flat(run[i], numels[i], device), _flat(reference[i], numels[i], device)) for i in order]
    zero = torch.zeros((), dtype=torch.float64, device=device)
    parts: list[torch.Tensor] = []
    segments: list[int] = []  # the module of each column of parts
    with torch.no_grad():
        for pieces in _chunks(flat, chunk, block):
            g = _joined([(g, pad) for _, g, _, pad in pieces], zero)
            r = _joined([(r, pad) for _, _, r, pad in pieces], zero)
            terms = torch.empty(_NUMEL, g.numel(), dtype=torch.float64, device=device)
            # Each term written as float64 in place (boolean temporaries cost more than the float64 passes here).
            torch.ne(r, 0, out=terms[_NONZERO])
            torch.eq(g, 0, out=terms[_FLUSHED]).mul_(terms[_NONZERO])
            diff = torch.sub(g, r, out=terms[_DIFF2])
            diff.mul_(diff)
            torch.mul(r, r, out=terms[_REF2])
            torch.mul(g, g, out=terms[_RUN2])
            torch.mul(g, r, out=terms[_DOT])
            bad = torch.sub(g, g, out=terms[_BAD])  # 0 where g is finite, NaN where it is not (inf - inf, NaN)
            bad.ne_(bad)
            blocks = terms.view(_NUMEL, g.numel() // block, block).sum(2)
            lengths = [(m, sum((p.numel() + pad) // block for _, p, _, pad in group))
                       for m, group in groupby(pieces, key=itemgetter(0))]
            parts.append(_segment_sums(blocks, [length for _, length in lengths]))
            segments += [m for m, _ in lengths]
        if not parts:
            return torch.zeros(modules, _NUMEL, dtype=torch.float64, device=device)
        sums = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
        if len(segments) > modules:  # a module split between chunks: add its parts
            sums = _segment_sums(sums, [len(list(group)) for _, group in groupby(segments)])
    return sums.T


def _flat(grad: torch.Tensor | None, numel: int, device: torch.device) -> torch.Tensor:
    if grad is None:
        return torch.zeros((), dtype=torch.float64, device=device).expand(numel)
    if grad.layout != torch.strided:  # a sparse gradient (nn.Embedding(sparse=True)): its values in place, dense
        grad = grad.to_dense()
    return grad.reshape(-1).to(device)


def _chunks(
    flat: list[tuple[int, torch.Tensor, torch.Tensor]], size: int, block: int,
) -> Generator[list[tuple[int, torch.Tensor, torch.Tensor, int]], None, None]:
    """``flat``'s (module, run, reference) in lists of at most ``size`` elements (a multiple of ``block``), a
    parameter split where a list ends; each piece with the zeros that pad it to whole blocks: (..., padding)."""
    pieces: list[tuple[int, torch.Tensor, torch.Tensor, int]] = []
    room = size
    for m, g, r in flat:
        start, numel = 0, g.numel()
        while True:
            take = min(room, numel - start)
            padded = -(-take // block) * block  # <= room: room stays a multiple of block
            whole = take == numel
            pieces.append((m, g if whole else g[start:start + take], r if whole else r[start:start + take],
                           padded - take))
            start, room = start + take, room - padded
            if start == numel:
                break
            yield pieces
            pieces, room = [], size
    if pieces:
        yield pieces


def _joined(pieces: list[tuple[torch.Tensor, int]], zero: torch.Tensor) -> torch.Tensor:
    """The tensors end to end in float64 (``zero``'s dtype and device), each followed by its padding of zeros."""
    parts: list[torch.Tensor] = [t for piece, pad in pieces for t in ((piece, zero.expand(pad)) if pad else (piece,))]
    out = torch.empty(sum(t.numel() for t in parts), dtype=zero.dtype, device=zero.device)
    return torch.cat(parts, out=out)


def _segment_sums(terms: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Sums of ``terms``' rows over consecutive segments of ``lengths`` columns: a (rows, segments) tensor (one
    ``index_add_``, which every device runs in float64)."""
    index = torch.repeat_interleave(torch.arange(len(lengths), device=terms.device),
                                    torch.tensor(lengths, device=terms.device))
    out = torch.zeros(terms.shape[0], len(lengths), dtype=terms.dtype, device=terms.device)
    return out.index_add_(1, index, terms)


def _fp8_sums(
    rows: list[int], run: Sequence[torch.Tensor | None], base: Sequence[torch.Tensor | None],
    reference: Sequence[torch.Tensor | None], params: Mapping[str, torch.Tensor],
    names: Sequence[str],
) -> torch.Tensor:
    """``[||g - g_base||^2, ||g_base - g32||^2, ||g32||^2]`` over one FP8 layer's parameters, as a (1, 3) row."""
    out = torch.zeros(1, 3, dtype=torch.float64, device=next(iter(params.values())).device)
    for i in rows:
        like = params[names[i]]
        g, b, r = (_dense(t, like) for t in (run[i], base[i], reference[i]))
        out[0, 0] += ((g - b) ** 2).sum()
        out[0, 1] += ((b - r) ** 2).sum()
        out[0, 2] += (r * r).sum()
    return torch.nn.functional.pad(out, (0, 4))  # as wide as the other rows, for one concatenation


def _dense(tensor: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if tensor is None:
        return torch.zeros(like.shape, dtype=torch.float64, device=like.device)
    return tensor.detach().to(like.device, torch.float64)


def _ratio(numerator: float, denominator: float) -> float:
    if denominator > 0:
        return numerator / denominator
    return 0.0 if numerator == 0 else math.inf


def _metrics(s: Sequence[float]) -> dict[str, float]:
    norms = math.sqrt(s[_RUN2]) * math.sqrt(s[_REF2])
    cosine = s[_DOT] / norms if norms > 0 else (1.0 if s[_RUN2] == s[_REF2] == 0 else 0.0)
    return {
        "underflow_frac": s[_FLUSHED] / s[_NONZERO] if s[_NONZERO] else 0.0,
        "rel_error": math.sqrt(_ratio(s[_DIFF2], s[_REF2])),
        "cosine": cosine,
        "numel": int(s[_NUMEL]),
    }


def _fp8_metrics(s: Sequence[float]) -> dict[str, float]:
    return {"fp8_rel_error": math.sqrt(_ratio(s[0], s[2])), "base_rel_error": math.sqrt(_ratio(s[1], s[2]))}


# ------------------------------------------------------------------------------------------------ across ranks
def metric_vector(result: dict[str, Any]) -> list[float]:
    """The measured values of a :func:`measure` result as one flat list (overall, per module, per FP8 layer), in
    an order every rank of the same model agrees on: average it across ranks, then :func:`with_metric_vector`."""
    values = [float(result[m]) for m in METRICS]
    for entry in result["modules"].values():
        values += [float(entry[m]) for m in METRICS]
    for entry in result["fp8"].values():
        values += [float(entry[m]) for m in _FP8_METRICS]
    return values


def with_metric_vector(result: dict[str, Any], values: Sequence[float]) -> dict[str, Any]:
    """A copy of ``result`` with its measured values replaced by ``values`` (in :func:`metric_vector`'s order)."""
    it = iter(values)
    out = {**result, **{m: next(it) for m in METRICS}}
    out["modules"] = {name: {**entry, **{m: next(it) for m in METRICS}} for name, entry in result["modules"].items()}
    out["fp8"] = {name: {m: next(it) for m in _FP8_METRICS} for name in result["fp8"]}
    return out


# ------------------------------------------------------------------------------------------------ helpers
@contextmanager
def _forked_rng(device: torch.device) -> Generator[None, None, None]:
    """Fork the RNG: training's stream continues as if nothing ran (each pass restores the step's state itself)."""
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        yield


def _restore_rng(rng: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(rng["cpu"])
    if device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], device)


def _upcast(data: object) -> Any:
    """``data`` with every floating tensor in FP32; lists, tuples, namedtuples and dicts rebuilt as they were."""
    if isinstance(data, torch.Tensor):
        return data.float() if data.is_floating_point() else data
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_upcast(v) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_upcast(v) for v in data)
    if isinstance(data, dict):
        return type(data)((k, _upcast(v)) for k, v in data.items())
    return data

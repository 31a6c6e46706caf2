"""Opt-in attribution of inf/NaN: which parameters hold them, and which module produced them first."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from functools import partial
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lit_mpstable.core.compiled import eager
from lit_mpstable.core.tensors import amax_per_tensor

try:
    from torch.distributed.tensor import DTensor as _DTENSOR
except ImportError:  # a torch build without torch.distributed
    _DTENSOR = ()  # type: ignore[assignment,misc]


def overflow_key(first: str, *, forward: bool) -> str:
    """The cause :func:`overflow_warning` reports, as a note's key: the module and the direction (a front end says it
    once, whatever the step or the scale)."""
    return f"overflow:{'forward' if forward else 'backward'}:{first}"


def overflow_warning(first: str, *, forward: bool, step: int, scale: float) -> str:
    """What a traced overflow means for the user, and what (if anything) to change.

    ``first``: the module where the tracer first saw inf/NaN (``""``: the model itself); ``forward``: in its output
    (it produced it from finite inputs: "appeared in"), else in a gradient flowing back through it ("first seen in":
    a hook or the user's own code may have written it there); ``scale``: the step's loss scale. A backward overflow at
    a loss scale above 1 is the scale's own doing (the scaler skips the step and backs off; routine while the scale
    settles from 2**16), so no FP32 island is advised for it.
    """
    subject = "the model itself" if first == "" else repr(first)
    if not forward and scale > 1:
        return (f"inf/NaN first seen in the backward gradient of {subject} (step {step}) at loss scale {scale:g}: the"
                " scaled gradients overflowed, which the loss scaler handles (the step is skipped and the scale backs"
                " off; routine while it settles). Nothing to change unless it persists at a low scale.")
    verb, where = ("appeared in", "forward output") if forward else ("first seen in", "backward gradient")
    advice = (f"fp32_modules=[{first!r}] would keep it in FP32" if first else
              "no FP32 island can isolate a single-module model: use a wider precision ('bf16-mixed', '32-true')")
    return f"inf/NaN {verb} the {where} of {subject} (step {step}); {advice}."


def nonfinite_grad_params(named_params: nn.Module | Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the parameters whose gradients hold inf or NaN, in the given order.

    Meant for a step already known to overflow: it synchronises with the device (once per device).
    """
    named = named_params.named_parameters() if isinstance(named_params, nn.Module) else named_params
    pairs = [(name, _dense(param.grad)) for name, param in named if param.grad is not None]
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, grad) in enumerate(pairs):
        by_device.setdefault(grad.device, []).append(i)
    bad: set[int] = set()
    for indices in by_device.values():
        finite = torch.isfinite(amax_per_tensor([pairs[i][1] for i in indices])).tolist()
        bad.update(i for i, ok in zip(indices, finite) if not ok)
    return [name for i, (name, _) in enumerate(pairs) if i in bad]


def _dense(grad: torch.Tensor) -> torch.Tensor:
    """The values a gradient holds on this rank: a sparse one's values, a DTensor's (FSDP2) local shard."""
    if isinstance(grad, _DTENSOR):
        return grad.to_local()
    return grad._values() if grad.is_sparse else grad


def _tensors(obj: object) -> list[torch.Tensor]:
    """The floating-point tensors in a (nested) tuple, list or dict, or the tensor itself."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors(item)]
    return []


class _Edge:
    """One tensor that crosses a module boundary: who produced it and who consumed it, in forward order."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.ref = weakref.ref(tensor)
        self.producers: list[tuple[int, int, str]] = []  # (depth, call order, module name)
        self.consumers: list[tuple[int, int, str]] = []

    def blamed(self) -> str:
        # A bad gradient arriving at this tensor was made by the backward of a module that consumed it (that module's
        # grad_input). The deepest consumer is the most specific; among equally deep ones, the last to run forward
        # ran first in backward. With no consuming module (the model output), it is the producer's grad_output.
        return max(self.consumers or self.producers)[2]


class OverflowTracer:
    """Hooks on every submodule that record where inf/NaN first appears, forward and backward.

    Forward: a module whose output holds inf/NaN. Backward, in execution order: a module whose parameter gradients
    hold inf/NaN, or a gradient holding inf/NaN that arrives at a tensor between modules; that gradient is blamed on
    the deepest module that consumed the tensor (its grad_input), or, for the model output, on the module that
    produced it (its grad_output). Plain tensor and parameter hooks are used rather than full module backward hooks,
    which break models that modify a module output in place (``nn.ReLU(inplace=True)``).

    FSDP2 models (DTensor parameters) work too, rank-local: module outputs are plain tensors, and FSDP2 runs the
    parameters' post-accumulate-grad hooks when it assigns each sharded gradient (after its reduce-scatter), where
    the tracer reads this rank's shard.

    Each check stays on the device; reading ``first_forward``/``first_backward`` (or the lists) synchronises once.
    Use it for one diagnostic step, not every step: it checks every module output and gradient. Events accumulate
    until :meth:`reset`.

    Example::

        with trace_nonfinite(model) as tracer:
            loss = model(x).sum()
            loss.backward()
        print(tracer.first_forward, tracer.first_backward)
    """

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"OverflowTracer(model={model!r}): model must be a torch.nn.Module.")
        self.model = model
        self._handles: list[RemovableHandle] = []
        # Events keep the minimum and maximum of each tensor they saw (device tensors, no host read); whether they held
        # inf/NaN is read off all of them at once, by the first reading (one kernel and one host read for the step).
        self._forward_events: list[tuple[str, list[torch.Tensor], list[torch.Tensor] | None]] = []
        self._backward_events: list[tuple[str, list[torch.Tensor]]] = []
        self._edges: dict[int, _Edge] = {}
        self._calls = 0
        self._inputs: list[list[torch.Tensor] | None] = []  # per module call in progress: its inputs' ends
        self._root_inputs: list[list[torch.Tensor]] = []
        self._hooks: dict[tuple[str, str], Callable[..., None]] = {}  # built once, registered at each attach
        self._verdicts: tuple[tuple[int, int, int], tuple[list[bool], list[bool], bool]] | None = None

    # ------------------------------------------------------------------------------------------- hooks
    def attach(self) -> OverflowTracer:
        """Register the hooks (idempotent); :meth:`detach` removes them."""
        if self._handles:
            return self
        owners: dict[nn.Parameter, str] = {}
        hooks = self._hooks
        for name, module in self.model.named_modules():
            if (pre := hooks.get(("pre", name))) is None:  # a tracer attached again (each overflow) reuses its hooks
                depth = name.count(".") + 1 if name else 0
                pre = hooks["pre", name] = self._pre_hook(name, depth)
                hooks["post", name] = self._post_hook(name, depth)
            self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(hooks["post", name]))
            for param in module.parameters(recurse=False):
                owners.setdefault(param, name)
        for param, owner in owners.items():
            if param.requires_grad:
                if (hook := hooks.get(("param", owner))) is None:
                    hook = hooks["param", owner] = self._param_hook(owner)
                self._handles.append(param.register_post_accumulate_grad_hook(hook))
        return self

    def detach(self) -> None:
        """Remove every hook; recorded events stay readable."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._edges.clear()

    def reset(self) -> None:
        """Forget the recorded events (for the next step)."""
        self._forward_events.clear()
        self._backward_events.clear()
        self._edges.clear()
        self._inputs.clear()
        self._root_inputs.clear()
        self._calls = 0
        self._verdicts = None

    def __enter__(self) -> OverflowTracer:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def _edge(self, tensor: torch.Tensor) -> _Edge:
        edge = self._edges.get(id(tensor))
        if edge is None or edge.ref() is not tensor:  # ids are reused once a tensor is freed
            edge = self._edges[id(tensor)] = _Edge(tensor)
            if (hook := self._hooks.get(("grad", ""))) is None:
                hook = self._hooks["grad", ""] = self._grad_hook()
            self._handles.append(tensor.register_hook(partial(hook, edge)))
        return edge

    # Each hook runs outside torch.compile. The step that traces runs eagerly (``compiled.eager``), unless the compiled
    # region encloses our forward context (``torch.compile`` of Fabric's wrapped module): there a traced hook would
    # guard on ``id(tensor)`` of each step's tensors and recompile until Dynamo's limit; a disabled one breaks the
    # graph once.
    def _pre_hook(self, name: str, depth: int):
        @torch.compiler.disable
        def hook(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
            self._calls += 1
            inputs = _tensors((args, kwargs))
            ends_in = _ends(inputs) if inputs else None
            self._inputs.append(ends_in)
            if depth == 0 and ends_in is not None:
                self._root_inputs.append(ends_in)
            if torch.is_grad_enabled():
                for tensor in inputs:
                    if tensor.requires_grad:
                        self._edge(tensor).consumers.append((depth, self._calls, name))

        return hook

    def _post_hook(self, name: str, depth: int):
        @torch.compiler.disable
        def hook(module: nn.Module, args: tuple[object, ...], output: object) -> None:
            self._calls += 1
            ends_in = self._inputs.pop() if self._inputs else None
            tensors = _tensors(output)
            if not tensors:
                return
            # Blame a module only for inf/NaN it made: finite inputs, non-finite output. A poisoned batch passes
            # through every layer, and no layer is to blame for it (see nonfinite_input).
            self._forward_events.append((name, _ends(tensors), ends_in))
            if torch.is_grad_enabled():
                for tensor in tensors:
                    if tensor.requires_grad:
                        self._edge(tensor).producers.append((depth, self._calls, name))

        return hook

    def _grad_hook(self):
        @torch.compiler.disable
        def hook(edge: _Edge, grad: torch.Tensor) -> None:  # one function, bound to each edge with partial
            self._backward_events.append((edge.blamed(), _ends([grad])))

        return hook

    def _param_hook(self, owner: str):
        @torch.compiler.disable
        def hook(param: torch.Tensor) -> None:
            if param.grad is not None:
                self._backward_events.append((owner, _ends([_dense(param.grad)])))

        return hook

    def _verdict(self) -> tuple[list[bool], list[bool], bool]:
        """Per forward event, whether its module made inf/NaN (a non-finite output from finite inputs); per backward
        event, whether its gradient held inf/NaN; and whether the root's inputs did. One kernel over every end
        recorded and one host read, kept until more events come (or :meth:`reset`)."""
        forward, backward, root = self._forward_events, self._backward_events, self._root_inputs
        key = (len(forward), len(backward), len(root))
        if self._verdicts is not None and self._verdicts[0] == key:
            return self._verdicts[1]
        groups = [ends for _, out, ends_in in forward for ends in (out, ends_in or [])]
        groups += [ends for _, ends in backward] + root
        finite = _finite([end for ends in groups for end in ends])
        bad, at = [], 0
        for ends in groups:
            bad.append(not all(finite[at:at + len(ends)]))
            at += len(ends)
        n = 2 * len(forward)
        made = [bad[i] and not (forward[i // 2][2] is not None and bad[i + 1]) for i in range(0, n, 2)]
        verdict = made, bad[n:n + len(backward)], any(bad[n + len(backward):])
        self._verdicts = key, verdict
        return verdict

    # ------------------------------------------------------------------------------------------ reading
    @property
    def nonfinite_input(self) -> bool:
        """Whether an input of the root module (the batch) held inf/NaN (syncs)."""
        return self._verdict()[2] if self._root_inputs else False

    @property
    def first_forward(self) -> str | None:
        """Qualified name of the first module (``""`` is the root) whose inputs were finite and whose output held
        inf/NaN, or None (syncs)."""
        names = self.forward_modules
        return names[0] if names else None

    @property
    def first_backward(self) -> str | None:
        """Qualified name of the first module blamed for an inf/NaN gradient in backward, or None (syncs)."""
        names = self.backward_modules
        return names[0] if names else None

    @property
    def forward_modules(self) -> list[str]:
        """Every module whose inputs were finite and whose output held inf/NaN, each once, in execution order: the
        module that made it first, then the containers around it (syncs)."""
        if not self._forward_events:
            return []
        made = self._verdict()[0]
        return list(dict.fromkeys(name for (name, _, _), bad in zip(self._forward_events, made) if bad))

    @property
    def backward_modules(self) -> list[str]:
        """Every module blamed for an inf/NaN gradient, each once, in backward execution order (syncs)."""
        if not self._backward_events:
            return []
        bad = self._verdict()[1]
        return list(dict.fromkeys(name for (name, _), flag in zip(self._backward_events, bad) if flag))


def _ends(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The minimum and maximum of each non-empty tensor (0-d device tensors, no host read): a tensor holds inf/NaN if
    and only if one of its two ends is not finite (NaN propagates through both, an inf is the minimum or the maximum).
    One kernel per tensor; the finiteness of all of them is read later, together (:func:`_finite`)."""
    return [end for t in tensors if t.numel() for end in torch.aminmax(t)]


def _finite(ends: list[torch.Tensor]) -> list[bool]:
    """Whether each of ``ends`` is finite: per dtype and device one stack and one ``isfinite`` (stacking mixed dtypes
    promotes them, at ~6x the cost), the flags gathered on the first end's device, and one host read for all."""
    if not ends:
        return []
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, end in enumerate(ends):
        groups.setdefault((end.dtype, end.device), []).append(i)
    device = ends[0].device
    flags = [torch.stack([ends[i] for i in indices]).isfinite().to(device) for indices in groups.values()]
    finite = [False] * len(ends)
    order = (i for indices in groups.values() for i in indices)
    for i, value in zip(order, (flags[0] if len(flags) == 1 else torch.cat(flags)).tolist(), strict=True):
        finite[i] = value
    return finite


def trace_nonfinite(model: nn.Module) -> OverflowTracer:
    """An :class:`OverflowTracer` for ``model``, to use as ``with trace_nonfinite(model) as tracer:``."""
    return OverflowTracer(model)


RngState = tuple[torch.Tensor, list[torch.Tensor] | None]


class NonfiniteOrigin(NamedTuple):
    """Where inf/NaN first appeared in a traced forward and backward: ``module`` (``""``: the model itself, or no
    module for ``where="input"``) and ``where``: ``"forward"`` (its output, from finite inputs), ``"backward"`` (a
    gradient its backward made) or ``"input"`` (the batch itself held inf/NaN)."""

    module: str
    where: str


def rng_state() -> RngState:
    """The torch RNG states (CPU, and every CUDA device where CUDA is initialised) as host tensors, for
    :func:`locate_nonfinite` to replay a step with the same random draws (dropout masks). A few KiB, no host read."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng(state: RngState) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def locate_nonfinite(model: nn.Module, forward: Callable[[], torch.Tensor], *, scale: float = 1.0,
                     rng: RngState | None = None) -> NonfiniteOrigin | None:
    """Replay one step's forward and backward with an :class:`OverflowTracer` attached, and name where inf/NaN first
    appeared; None if the replay stayed finite (the fault came and went).

    Meant for a step already skipped: clean steps pay nothing (no hook), and the skipped one pays one traced forward
    and backward. The replay runs eagerly (``torch.compile``'d submodules too: their Python forward runs, so the
    modules inside them are hooked). ``forward`` returns the step's loss (the same batch, in the step's precision
    context); its backward runs here, times ``scale`` (the loss scale of the step, for an FP16 overflow to recur).
    ``rng`` (:func:`rng_state` taken before the step) is restored for the replay, so dropout draws the same masks;
    the RNG goes on afterwards from where it stood before the replay. The replay's gradients are dropped.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``forward`` is not callable, or it returned no tensor.
        ValueError: ``scale`` is not a finite number > 0.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"locate_nonfinite(model={model!r}): model must be a torch.nn.Module.")
    if not callable(forward):
        raise TypeError(f"locate_nonfinite(forward={forward!r}): forward must be a callable returning the loss.")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise ValueError(f"locate_nonfinite(scale={scale!r}): scale must be a finite number > 0 (the step's loss"
                         " scale; 1.0 without scaling).")
    after = rng_state()
    if rng is not None:
        _set_rng(rng)
    try:
        with eager(), trace_nonfinite(model) as tracer:
            loss = forward()
            if not isinstance(loss, torch.Tensor):
                raise TypeError(f"locate_nonfinite(forward={forward!r}): forward returned {type(loss).__name__},"
                                " not the loss tensor.")
            (loss * scale if scale != 1 else loss).backward()
    finally:
        _set_rng(after)
        model.zero_grad(set_to_none=True)
    if tracer.nonfinite_input:
        return NonfiniteOrigin("", "input")
    first = tracer.first_forward
    if first is not None:
        return NonfiniteOrigin(first, "forward")
    first = tracer.first_backward
    return None if first is None else NonfiniteOrigin(first, "backward")

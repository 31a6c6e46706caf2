"""Adam/AdamW moments kept by a weight keeper in BF16 or FP8 (``optimizer_state="bf16"``/``"fp8"``).

With FP32 masters or compact weights the keeper steps exact ``torch.optim.Adam``/``AdamW`` groups itself through
:func:`~lit_mpstable.core.weights.optim_state.adamw_step_`, with two
:class:`~lit_mpstable.core.weights.optim_state.MomentStore` objects per parameter and a per-parameter step count,
instead of ``optimizer.step()``: no ``exp_avg``/``exp_avg_sq`` stays in ``optimizer.state``. ``group["lr"]`` (and the
other hyper-parameters) are read at every step, so LR schedulers work; a skipped step (inf/NaN) never reaches the
update. ``"fp32"`` never builds this object: the optimizer's own step runs, as before.
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast, get_args

import torch
from torch.optim import Optimizer

from lit_mpstable.base.validate import choice_arg
from lit_mpstable.core.weights.optim_state import MomentStore, StateKind, adam_moments, moment_state

if TYPE_CHECKING:
    from torch.optim.optimizer import StateDict


def check_optimizer_state(owner: str, kind: str, precision: str, master_mode: str | None) -> str:
    """``kind`` if it is one of :data:`StateKind` and a weight keeper can hold it: BF16/FP8 moments need FP32 masters
    or compact weights (a ``*-true`` precision with ``master_weights``).

    Raises:
        ValueError: an unknown kind, or BF16/FP8 moments where the optimizer steps the model's own parameters.
    """
    choice_arg(owner, "optimizer_state", kind, get_args(StateKind))
    if kind != "fp32" and master_mode is None:
        raise ValueError(
            f"{owner}({precision!r}, optimizer_state={kind!r}): BF16/FP8 moments are kept by the FP32 masters or the"
            " compact weights, which this run has none of (the '*-mixed' and '32-true' precisions, and '*-true'"
            " with master_weights=False, let the optimizer step the model's parameters with its own FP32 state);"
            " use a '*-true' precision with master_weights=True/'kahan'/'stochastic', or optimizer_state='fp32'."
        )
    return kind

# By id, with a weak reference to tell a reused id apart (a WeakSet compares tensors with ==, elementwise).
_MOMENT_TENSORS: dict[int, weakref.ref] = {}


def is_moment_tensor(tensor: object) -> bool:
    """Whether ``tensor`` is a stored moment of an :class:`AdamMoments` (memory reports count it as optimizer
    state, not as compensation)."""
    ref = _MOMENT_TENSORS.get(id(tensor))
    return ref is not None and ref() is tensor

KEY = "optimizer_state"
"""The key of a keeper's state dict under which the moments and step counts are saved."""

SAVED_MARK = "lit_mpstable_moments"
"""A key that ``optimizer.state_dict()`` adds to each param group of an optimizer whose moments an
:class:`AdamMoments` keeps (its value: the kind). That optimizer's own state holds no moments, so a resume that loads
it without the plugin's state (litgpt's layout) would restart them at 0 unnoticed; ``Optimizer.load_state_dict``
keeps a saved group's keys, so the mark arrives with it and :func:`pop_saved_mark` finds it."""

_MARKED: weakref.WeakSet[Optimizer] = weakref.WeakSet()  # optimizers whose state_dict() adds the mark


def _mark_saved_groups(kind: str) -> Callable[[Optimizer, StateDict], StateDict]:
    def hook(optimizer: Optimizer, state_dict: StateDict) -> StateDict:
        for group in state_dict["param_groups"]:  # packed copies: the live groups are not changed
            group[SAVED_MARK] = kind
        return state_dict
    return hook


def pop_saved_mark(optimizer: Optimizer) -> str | None:
    """The kind of BF16/FP8 moments that ``optimizer``'s loaded state was saved beside (None: none), removed from its
    param groups (asked once, at its first step)."""
    kinds = [group.pop(SAVED_MARK) for group in optimizer.param_groups if SAVED_MARK in group]
    return kinds[0] if kinds else None

_REFUSED_FLAGS = ("amsgrad", "capturable", "differentiable")



ZERO_GRAD_SWAP = "_lit_mpstable_zero_grad"
"""The mark of the one-method subclass FP32 masters swap an optimizer's class for (its ``zero_grad`` also clears the
model's 16-bit gradients: ``core.weights.master.zero_grad_reaches_model``); it steps exactly as its base."""


def optimizer_class(optimizer: object) -> type:
    """``optimizer``'s own class, under the subclass of :data:`ZERO_GRAD_SWAP`."""
    cls = type(optimizer)
    return cls.__mro__[1] if cls.__dict__.get(ZERO_GRAD_SWAP, False) else cls

def check_adam(owner: str, kind: str, optimizer: Optimizer) -> None:
    """Refuse what :func:`adamw_step_` does not compute exactly as torch: another optimizer class, or a group with
    ``amsgrad``/``capturable``/``differentiable``, a tensor ``lr`` or tensor betas.

    Raises:
        ValueError: naming the optimizer and the group.
    """
    if optimizer_class(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ValueError(
            f"{owner}(optimizer_state={kind!r}): {type(optimizer).__name__} is not torch.optim.Adam or AdamW; BF16/FP8"
            " moments replace exactly those two optimizers' steps. Use optimizer_state='fp32' with this optimizer"
            " (or an 8-bit optimizer of its own, e.g. torchao's AdamW8bit)."
        )
    for index, group in enumerate(optimizer.param_groups):
        flags = [flag for flag in _REFUSED_FLAGS if group.get(flag)]
        if isinstance(group.get("lr"), torch.Tensor):
            flags.append("tensor lr")
        if any(isinstance(b, torch.Tensor) for b in group.get("betas", ())):
            flags.append("tensor betas")
        if flags:
            raise ValueError(
                f"{owner}(optimizer_state={kind!r}): {type(optimizer).__name__} param group {index} uses"
                f" {', '.join(flags)}, which the BF16/FP8 moment step does not implement; build the optimizer without"
                " them (float lr, amsgrad=False, capturable=False, differentiable=False), or use"
                " optimizer_state='fp32'."
            )


class AdamMoments:
    """The moment stores and step counts of every parameter a keeper steps, by qualified name.

    Args:
        kind: ``"bf16"`` or ``"fp8"``.
        seed: the random bits of stochastic rounding (with the step, the parameter's name and the element).
        owner: the class name error messages use.
    """

    def __init__(self, kind: str, *, seed: int, owner: str = "PrecisionStepper") -> None:
        self.kind: StateKind = cast(StateKind, kind)  # checked by the stepper against StateKind's choices
        self.seed, self.owner = int(seed), owner
        self.stores: dict[str, tuple[MomentStore, MomentStore]] = {}
        self.steps: dict[str, int] = {}
        self._names: dict[int, str] = {}  # the parameter names of the last binding: what a checkpoint may name

    def bind_(self, optimizer: Optimizer, names: dict[int, str]) -> None:
        """Check ``optimizer`` and give every named parameter of it stores (once); moments the optimizer already holds
        for it (a checkpoint loaded into the optimizer) move into the stores."""
        check_adam(self.owner, self.kind, optimizer)
        self._names = names
        if optimizer not in _MARKED:
            optimizer.register_state_dict_post_hook(_mark_saved_groups(self.kind))
            _MARKED.add(optimizer)
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = names.get(id(p))
                if name is None:
                    continue
                if name not in self.stores:
                    index = zlib.crc32(name.encode())
                    self.stores[name] = adam_moments(self.kind, p.shape, p.device, seed=self.seed, index=index)
                    self.steps[name] = 0
                elif self.stores[name][0].shape != p.shape:  # loaded before this parameter was bound
                    raise ValueError(
                        f"{self.owner}(optimizer_state={self.kind!r}): the loaded moments of {name!r} have shape"
                        f" {list(self.stores[name][0].shape)}, the parameter {list(p.shape)}; was the checkpoint"
                        " saved from a different model?"
                    )
                state = optimizer.state.pop(p, None)
                if state and "exp_avg" in state:
                    m, v = self.stores[name]
                    step = int(state.get("step", 0))
                    m.write_(state["exp_avg"].float(), step=max(step, 1))
                    v.write_(state["exp_avg_sq"].float(), step=max(step, 1))
                    self.steps[name] = step

    def reseed_(self, seed: int) -> None:
        """Draw the random bits of stochastic rounding from ``seed`` from now on (every store's): the seed the
        data-parallel replicas agreed on."""
        self.seed = int(seed)
        for m, v in self.stores.values():
            m.seed = v.seed = self.seed

    @torch.no_grad()
    def step_(self, optimizer: Optimizer, names: dict[int, str],
              update: Callable[[torch.Tensor, str, Callable[[torch.Tensor, torch.Tensor], None]], None] | None = None,
              **kwargs: Any) -> object:
        """One Adam/AdamW step of ``optimizer``'s parameters that have a gradient.

        ``update(param, name, step_fn)``, when given, is how a keeper steps a parameter stored in 16 bits: it calls
        ``step_fn(fp32_value, fp32_grad)`` and rounds the value back; without it the (FP32) parameter is stepped in
        place. Afterwards ``optimizer.step()`` runs once with empty groups, so its hooks, and what LR schedulers
        read of it, still see a step.
        """
        closure = kwargs.pop("closure", None)
        if kwargs:  # torch's Adam/AdamW take a closure only; with FP32 moments they refuse the rest themselves
            raise TypeError(f"{type(optimizer).__name__}.step() got unexpected keyword argument(s) {sorted(kwargs)}"
                            " (with BF16/FP8 moments the step takes closure= only, as torch's Adam and AdamW).")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in optimizer.param_groups:
            decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
            hyper = dict(lr=float(group["lr"]), betas=tuple(float(b) for b in group["betas"]), eps=group["eps"],
                         weight_decay=group["weight_decay"], decoupled_weight_decay=decoupled,
                         maximize=bool(group.get("maximize", False)))
            for p in group["params"]:
                if p.grad is None:
                    continue
                name = names.get(id(p))
                if name is None or name not in self.stores:
                    raise RuntimeError(
                        f"{self.owner}(optimizer_state={self.kind!r}): a parameter of shape {tuple(p.shape)} of"
                        f" {type(optimizer).__name__} has no moment store (added after binding without a name in"
                        " the model?); add parameters to the optimizer before fit."
                    )
                self.steps[name] += 1
                m, v = self.stores[name]
                step = self.steps[name]

                def step_fn(value: torch.Tensor, grad: torch.Tensor, m: MomentStore = m, v: MomentStore = v,
                            step: int = step) -> None:
                    from lit_mpstable.core.weights.optim_state import adamw_step_
                    adamw_step_(value, grad, m, v, step=step, **hyper)

                if update is not None:
                    update(p, name, step_fn)
                else:
                    step_fn(p.data, p.grad)
        step_without_params(optimizer)
        return loss

    # ------------------------------------------------------------------------------------------------ state
    def nbytes(self) -> int:
        """Bytes of the stored moments (FP8: codes plus per-block amax and k)."""
        return sum(m.nbytes + v.nbytes for m, v in self.stores.values())

    def tensors(self) -> list[torch.Tensor]:
        """The stored tensors (for memory accounting; each registered as a moment tensor)."""
        tensors = [t for pair in self.stores.values() for store in pair for t in store.tensors.values()]
        for key in [key for key, ref in _MOMENT_TENSORS.items() if ref() is None]:
            del _MOMENT_TENSORS[key]
        _MOMENT_TENSORS.update((id(t), weakref.ref(t)) for t in tensors)
        return tensors

    def state_dict(self) -> dict[str, object]:
        """``kind``, ``seed``, ``steps`` (per name) and ``moments`` (per name: the two stores' state dicts); plain
        values and tensors (shared with the stores: clone them for an in-memory snapshot)."""
        return {"kind": self.kind, "seed": self.seed, "steps": dict(self.steps),
                "moments": {name: [m.state_dict(), v.state_dict()] for name, (m, v) in self.stores.items()}}

    def check_state(self, state: StateDict, *, call: str | None = None, name: str = "optimizer_state",
                    same_kind: bool = True) -> None:
        """Refuse ``state`` unless :meth:`load_state_dict` (``same_kind``) or :meth:`carry_` can load it whole: every
        field valid (``optim_state.moment_state``), saved with this ``kind``, and the moments of exactly the
        parameters this object holds stores for (a missing one would restart at 0; one of an unknown name, a renamed
        parameter, would never be read), each of its parameter's shape. Changes nothing.

        Raises:
            TypeError, ValueError, KeyError: naming ``call``, the field and the rule.
        """
        call = call or f"{self.owner}.load_state_dict"
        moment_state(call, name, state)
        if same_kind and state["kind"] != self.kind:
            raise ValueError(
                f"{call}({name}['kind']={state['kind']!r}): this run keeps its moments in {self.kind!r}; resume with"
                f" optimizer_state={state['kind']!r}."
            )
        saved = state["moments"]
        known = set(self._names.values()) | set(self.stores)
        missing = sorted(set(self.stores) - set(saved))
        unknown = sorted(set(saved) - known) if known else []
        if missing or unknown:
            raise KeyError(
                f"{call}: {name}['moments'] has missing parameters {missing} (their moments would restart at 0),"
                f" unknown parameters {unknown} (renamed?); was it saved from a different model, or with other"
                " parameters trainable?"
            )
        for key, (m_state, _) in saved.items():
            if key in self.stores and m_state["shape"] != list(self.stores[key][0].shape):
                raise ValueError(
                    f"{call}({name}['moments'][{key!r}][0]['shape']={m_state['shape']!r}): the parameter has shape"
                    f" {list(self.stores[key][0].shape)}; was it saved from a different model?"
                )

    def load_state_dict(self, state: StateDict) -> None:
        """Restore :meth:`state_dict` (stores of names not bound yet are built from the saved shapes), after
        :meth:`check_state`.

        Raises:
            TypeError, ValueError, KeyError: see :meth:`check_state`; nothing is loaded then.
        """
        self.check_state(state)
        self._load(state, state["kind"])

    def carry_(self, state: StateDict, *, call: str | None = None) -> str | None:
        """Load the moments of a checkpoint written with another weight mode (FP32 masters, compact weights: the
        moments are by parameter name in both). Of this ``kind`` they load exactly; of another they are read in
        theirs and stored again in this one (one more rounding of each value: returned as a note).

        Raises:
            TypeError, ValueError, KeyError: see :meth:`check_state`; nothing is loaded then.
        """
        self.check_state(state, call=call, same_kind=False)
        if state["kind"] == self.kind:
            self._load(state, self.kind)
            return None
        self._load(state, state["kind"])
        return (f"the checkpoint's {state['kind']!r} Adam moments were stored again as {self.kind!r} (one more"
                " rounding of each value, not an exact resume).")

    def _load(self, state: StateDict, kind: str) -> None:
        self.seed = state["seed"]
        for name, (m_state, v_state) in state["moments"].items():
            index = zlib.crc32(name.encode())
            if name not in self.stores:
                device = m_state["tensors"][next(iter(m_state["tensors"]))].device
                self.stores[name] = adam_moments(self.kind, m_state["shape"], device, seed=self.seed, index=index)
            m, v = self.stores[name]
            if kind == self.kind:
                m.load_state_dict(m_state)
                v.load_state_dict(v_state)
            else:  # read in the saved kind, stored again in this one
                device = m.tensors[next(iter(m.tensors))].device
                for store, saved in ((m, m_state), (v, v_state)):
                    source = adam_moments(cast(StateKind, kind), saved["shape"], device, index=index)[
                        0 if saved["signed"] else 1]
                    source.load_state_dict(saved)
                    store.write_(source.read(), step=max(state["steps"][name], 1))
            self.steps[name] = state["steps"][name]


def step_without_params(optimizer: Optimizer, **kwargs: Any) -> object:
    """``optimizer.step(**kwargs)`` with empty param groups, for what sees a step beside the parameters: its hooks, a
    wrapper of its ``step`` (an LR scheduler's "optimizer stepped" mark), its check of the keywords."""
    saved = [group["params"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["params"] = []
        return optimizer.step(**kwargs)
    finally:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params


def split_moments(owner: str, state: Mapping[str, Any], moments: AdamMoments | None) -> tuple[StateDict, Any]:
    """A keeper's saved state without its moments, and the moments (None when saved without): refused when the
    checkpoint and ``moments`` disagree on whether BF16/FP8 moments are kept."""
    state = dict(state)
    saved = state.pop(KEY, None)
    if saved is not None and moments is not None:
        moments.check_state(saved, call=f"{owner}.load_state_dict")  # before the keeper loads anything
    if (saved is None) != (moments is None):
        kind = "fp32" if moments is None else moments.kind
        raise ValueError(
            f"{owner}(optimizer_state={kind!r}).load_state_dict: the checkpoint was saved"
            f" {'without' if saved is None else 'with'} BF16/FP8 moments; resume with the optimizer_state it"
            " was saved with."
        )
    return state, saved

"""FP32 master weights for the ``*-true`` modes: the optimizers own FP32 copies, the model keeps 16-bit weights."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from lit_mpstable.base.validate import check_keys
from lit_mpstable.core.replicas import agree_seed, broadcast_
from lit_mpstable.core.scaling.scalers import LossScaler
from lit_mpstable.core.tensors import local_view
from lit_mpstable.core.weights.keeper import GradView, Keeper
from lit_mpstable.core.weights.memory import nbytes
from lit_mpstable.core.weights.moment_keeper import KEY, ZERO_GRAD_SWAP, AdamMoments, split_moments

if TYPE_CHECKING:
    from torch.optim.optimizer import Kwargs, StateDict

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class MasterWeights(Keeper):
    """FP32 master copies of a 16-bit model's trainable parameters, owned by the optimizers.

    BF16 keeps 8 significant bits, so a weight update below half a unit in the last place is rounded away and
    training stalls (FP16 keeps 11 bits: the same happens at smaller updates). apex O2, DeepSpeed and Megatron-LM
    let an FP32 copy receive the update instead; this class does that for any ``torch.optim.Optimizer``:

    - At construction every trainable 16-bit parameter of ``model`` that an optimizer holds is replaced, inside
      that optimizer's ``param_groups``, by an FP32 ``nn.Parameter`` master at the same position, so group
      hyper-parameters, LR schedulers and the indices of ``optimizer.state_dict()`` stay valid. Optimizer state
      already kept for the old parameter moves to the master, cast to FP32.
    - Each step: backward (16-bit grads), :meth:`copy_grads_to_master_`, :meth:`zero_model_grads_`, unscale and
      clip on the optimizer as usual, ``optimizer.step()``, :meth:`refresh_model_`.
    - ``optimizer.zero_grad()`` clears the masters' gradients and the model's 16-bit ones (the optimizer's class is
      swapped for a subclass whose ``zero_grad`` does both, see :func:`zero_grad_reaches_model`): a backward discarded
      with it (a GAN's generator loss reaching the discriminator) does not leak into the next step.

    FP32 parameters (FP32 islands), frozen parameters and parameters that are not the model's stay in the
    optimizers as they are and get no master. A parameter held by two optimizers gets one master, held by both.

    Args:
        initial: FP32 values to start the masters from, by qualified name (the weights before the model was cast to
            16 bits: starting from the 16-bit rounding would lose what the FP32 initialisation had below it).
            Names missing here start from the 16-bit parameter.
        dtype: the model's 16-bit dtype, as the weight keeper of a run (``master_weights=True``): a trainable
            parameter of it met later gets a master at its first :meth:`unscale_`.
        optimizer_state: ``"bf16"`` or ``"fp8"`` keeps Adam/AdamW moments in
            :class:`~lit_mpstable.core.weights.moment_keeper.AdamMoments` and steps the masters through them
            (``"fp32"``: ``optimizer.step()``, as always).

    As the :class:`~lit_mpstable.core.weights.weights.WeightKeeper` of FP32 masters, the gradients go into the masters
    before anyone reads them, the optimizers step the masters, the 16-bit weights follow.
    """

    mode: str | None = "fp32"
    state_key: str | None = "masters"
    exposes_grads = True

    def __init__(
        self, model: nn.Module, optimizers: Sequence[Optimizer], *, initial: Mapping[str, torch.Tensor] | None = None,
        dtype: torch.dtype = torch.bfloat16, optimizer_state: str = "fp32", owner: str = "PrecisionStepper",
    ) -> None:
        self._model = model
        self.dtype = dtype
        self._initial = dict(initial or {})
        self._grad_versions: dict[int, list[tuple[torch.Tensor | None, int]]] = {}
        self._optimizers: list[Optimizer] = []
        self._masters: dict[str, nn.Parameter] = {}
        self._params: dict[str, nn.Parameter] = {}
        self._names_by_optimizer: dict[int, list[str]] = {}
        self._sharded = False  # some master is a DTensor (its parameter's layout)
        for optimizer in optimizers:
            self.bind_new_(optimizer)
        self.moments: AdamMoments | None = None
        if optimizer_state != "fp32":
            self.moments = AdamMoments(optimizer_state, seed=torch.initial_seed() % 2**31, owner=owner)
            for optimizer in optimizers:
                self.moments.bind_(optimizer, self._ids_to_names())

    def _bind(self, optimizer: Optimizer, named: dict[int, str]) -> list[str]:
        bound: list[str] = []
        for group in optimizer.param_groups:
            params = group["params"]
            for i, param in enumerate(params):
                name = named.get(id(param))
                if name is None or not param.requires_grad or param.dtype not in _LOW_PRECISION:
                    continue
                master = self._masters.get(name)
                if master is None:
                    master = nn.Parameter(self._start(name, param), requires_grad=True)
                    self._masters[name], self._params[name] = master, param
                # In place: some optimizers (LBFGS) keep a reference to the group's list itself.
                params[i] = master
                state = optimizer.state.pop(param, None)
                if state is not None:
                    optimizer.state[master] = {key: _to_fp32(value) for key, value in state.items()}
                if name not in bound:
                    bound.append(name)
        return bound

    def _start(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """A master's first value: the FP32 weight of ``initial``, else the 16-bit weight widened (``.float()``
        copies: the master never aliases it). A DTensor parameter (FSDP2 sharded the 16-bit model: Fabric shards after
        converting) gets a DTensor master laid out as it is, so the optimizer steps shards, clipping reads global
        norms and every rank keeps only its own shard: its part of its own FP32 initialisation (FSDP2 shards each
        rank's own weights alike, without communicating)."""
        start = self._initial.pop(name, None)
        self._sharded |= isinstance(param, DTensor)
        if start is None or start.shape != param.shape:
            return param.detach().float()  # a DTensor's too: the same mesh and placements
        start = start.detach().to(param.device, torch.float32)
        if isinstance(param, DTensor):
            return distribute_tensor(start, param.device_mesh, param.placements, src_data_rank=None)
        return start

    def bind_new_(self, optimizer: Optimizer) -> list[str]:
        """Give masters to 16-bit parameters added to ``optimizer`` since construction (``add_param_group``, as
        Lightning's ``BackboneFinetuning`` does) or unfrozen since; returns their names."""
        if id(optimizer) not in self._names_by_optimizer:
            self._optimizers.append(optimizer)
            self._names_by_optimizer[id(optimizer)] = []
            zero_grad_reaches_model(optimizer, self)
        named = {id(param): name for name, param in self._model.named_parameters()}
        new = [name for name in self._bind(optimizer, named) if name not in self._names_by_optimizer[id(optimizer)]]
        self._names_by_optimizer[id(optimizer)].extend(new)
        return new

    def _copy_(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        # One grouped copy; DTensors have no sharded _foreach_copy_, and a master shares its parameter's layout, so
        # their local shards are copied instead.
        if self._sharded:
            dst, src = [local_view(t) for t in dst], [local_view(t) for t in src]
        torch._foreach_copy_(dst, src)

    # ------------------------------------------------------------------------------------------ reading
    @property
    def masters(self) -> list[nn.Parameter]:
        """The FP32 masters, in the order the optimizers hold them."""
        return list(self._masters.values())

    def named_pairs(self) -> Iterator[tuple[str, nn.Parameter, nn.Parameter]]:
        """Yield ``(qualified name, master, 16-bit model parameter)`` for every master."""
        for name, master in self._masters.items():
            yield name, master, self._params[name]

    def _names(self, optimizer: Optimizer | None) -> list[str]:
        if optimizer is None:
            return list(self._masters)
        if id(optimizer) in self._names_by_optimizer:
            return self._names_by_optimizer[id(optimizer)]
        raise ValueError(
            f"MasterWeights: optimizer {type(optimizer).__name__} (id {id(optimizer):#x}) was not given at"
            " construction, so it holds no masters; pass one of those optimizers or None (all)."
        )

    def _select(self, optimizer: Optimizer | None) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        names = self._names(optimizer)
        return [self._masters[name] for name in names], [self._params[name] for name in names]

    # ---------------------------------------------------------------------------------------- stepping
    @torch.no_grad()
    def copy_grads_to_master_(self, optimizer: Optimizer | None = None) -> None:
        """Set each master's grad to its 16-bit parameter's grad cast to FP32; no host sync.

        A parameter without a grad leaves its master without one, so the optimizer skips it as it would have
        skipped the parameter. A master grad that already exists is overwritten in place (one grouped copy);
        ``optimizer.zero_grad()`` (``set_to_none=True``) makes the next call allocate again, as backward would.
        Inf/NaN values are copied as they are, so a loss scaler's ``unscale_`` on the optimizer still sees them.

        Args:
            optimizer: only the masters this optimizer holds; ``None``: all.
        """
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for master, param in zip(*self._select(optimizer)):
            grad = param.grad
            if grad is None:
                master.grad = None
            elif master.grad is None:
                master.grad = grad.float()
            else:
                dst.append(master.grad)
                src.append(grad)
        if dst:
            self._copy_(dst, src)

    @torch.no_grad()
    def refresh_model_(self, optimizer: Optimizer | None = None) -> None:
        """Copy the masters into the 16-bit parameters (round to nearest); call after an applied step; no host sync.

        After a skipped step the masters are unchanged, so refreshing then is harmless (it rewrites equal values).

        Args:
            optimizer: only the masters this optimizer holds; ``None``: all.
        """
        masters, params = self._select(optimizer)
        if masters:
            self._copy_(list[torch.Tensor](params), list[torch.Tensor](masters))

    def zero_model_grads_(self, optimizer: Optimizer | None = None, *, set_to_none: bool = True) -> None:
        """Drop (or, without ``set_to_none``, zero) the 16-bit grads of the parameters that have masters: after
        copying, to free their memory, and in ``optimizer.zero_grad()``."""
        for param in self._select(optimizer)[1]:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.detach_().zero_()

    @torch.no_grad()
    def expose_grads_(self, optimizer: Optimizer | None = None, *, copy: bool = True) -> None:
        """Let the 16-bit parameters show their masters' (unscaled) gradients, for hooks, ``grad_norm`` and a user's
        own clipping; :meth:`absorb_grads_` later takes back whatever was changed there. No host sync.

        Args:
            copy: write the master grads into the 16-bit grads (after unscaling: they differ); ``False`` when the
                16-bit grads already hold the same values (nothing was scaled).
        """
        masters, params = self._select(optimizer)
        pairs = [(m.grad, p) for m, p in zip(masters, params) if m.grad is not None and p.grad is not None]
        if copy and pairs:
            self._copy_([p.grad for _, p in pairs if p.grad is not None], [g for g, _ in pairs])
        self._grad_versions[id(optimizer)] = [(p.grad, p.grad._version if p.grad is not None else -1) for p in params]

    @torch.no_grad()
    def absorb_grads_(self, optimizer: Optimizer | None = None) -> list[str]:
        """Copy into the masters every 16-bit gradient changed since :meth:`expose_grads_` (modified in place, e.g.
        by ``clip_grad_norm_(model.parameters())``, replaced or set to None); returns their names. A version-counter
        check per parameter, no host sync."""
        seen = self._grad_versions.pop(id(optimizer), None)
        if seen is None:
            return []
        changed = []
        for name, (grad, version) in zip(self._names(optimizer), seen):
            param, master = self._params[name], self._masters[name]
            now = param.grad
            if now is grad and (now is None or now._version == version):
                continue
            changed.append(name)
            master.grad = None if now is None else now.float()
        return changed

    @torch.no_grad()
    def rebuild_from_model_(self) -> None:
        """Set every master to its 16-bit parameter cast to FP32, e.g. after loading a checkpoint without masters.

        The bits below the 16-bit resolution that the masters had gathered are lost; optimizer state is kept.
        """
        masters, params = self._select(None)
        if masters:
            self._copy_(list[torch.Tensor](masters), list[torch.Tensor](params))

    def broadcast_(self, group: ProcessGroup | None) -> None:
        """Take every master from the first rank of the process group ``group``, as ``DistributedDataParallel``
        takes the 16-bit weights from it (a collective: every rank calls it, after the model was wrapped), and forget
        the FP32 start values kept for parameters not bound yet (each rank's own initialisation: bound later, they
        start from their 16-bit weight, the same on every rank)."""
        broadcast_([self._masters[name] for name in sorted(self._masters)
                    if not isinstance(self._masters[name], DTensor)], group)  # shards differ by rank: not replicas
        self._initial.clear()

    # --------------------------------------------------------------------------------------------- state
    @torch.no_grad()
    def _recast_(self, changed: Sequence[tuple[nn.Parameter, torch.Tensor]]) -> None:
        # After a precision fallback or restore cast parameters in place: each one with a master takes its value
        # again (into FP32: exactly, not the 16-bit rounding it held).
        by_id = {id(param): name for name, param in self._params.items()}
        for param, _ in changed:
            name = by_id.get(id(param))
            if name is not None:
                param.copy_(self._masters[name])

    def state_dict(self) -> dict[str, object]:
        """``{qualified parameter name: FP32 master}``; tensors only, so ``torch.load(weights_only=True)`` reads it.
        With BF16/FP8 moments their state is under ``"optimizer_state"``.

        Like ``nn.Module.state_dict``, the tensors share storage with the masters (detached, not copied): clone
        them to keep an in-memory snapshot that later steps must not change.
        """
        state: dict[str, object] = {name: master.detach() for name, master in self._masters.items()}
        if self.moments is not None:
            state[KEY] = self.moments.state_dict()
        return state

    @torch.no_grad()
    def _load_(self, state: StateDict) -> None:
        """:meth:`load_state_dict`: restore the masters from :meth:`state_dict`, then refresh the 16-bit weights from
        them.

        The masters are the more precise copy, so the model follows them and not the other way round.

        Raises:
            KeyError: a name is missing or unknown (each one is listed).
            ValueError: a tensor's shape differs from its master's, or the checkpoint and this run disagree on
                BF16/FP8 moments.
        """
        state, moments = split_moments("MasterKeeper", state, self.moments)
        check_keys("MasterWeights.load_state_dict", state, self._masters,
                   suffix="; was it saved from a different model, or with other parameters trainable or in FP32, or"
                          " loaded before every optimizer was set up (Fabric: plugin.setup_optimizers(*optimizers)"
                          " after fabric.setup, before fabric.load)?")
        for name, master in self._masters.items():
            if state[name].shape != master.shape:
                raise ValueError(
                    f"MasterWeights.load_state_dict: {name!r} has shape {tuple(state[name].shape)}, the master"
                    f" {tuple(master.shape)}; was it saved from a different model?"
                )
        masters = list(self._masters.values())
        if masters:
            self._copy_(list[torch.Tensor](masters), [state[name] for name in self._masters])
        self.refresh_model_()
        if self.moments is not None:
            self.moments.load_state_dict(moments)

    # ----------------------------------------------------------------------------- the weight keeper's step
    def _ids_to_names(self) -> dict[int, str]:
        # Masters by their parameter's name, and the optimizer's FP32 parameters (islands) by their own.
        names = {id(p): name for name, p in self._model.named_parameters()}
        names.update((id(master), name) for name, master, _ in self.named_pairs())
        return names

    def adopt_optimizer_(self, optimizer: Optimizer) -> None:
        self.bind_new_(optimizer)
        if self.moments is not None:
            self.moments.bind_(optimizer, self._ids_to_names())

    @torch.no_grad()
    def _replicate_(self, replicas: ProcessGroup | None) -> list[str]:
        """:meth:`follow_model_weights_`: restart from its 16-bit weight every master whose rounding that weight no
        longer is (weights loaded into the model after the masters were bound); returns their names. One host sync.
        ``replicas``: the process group of DDP replicas: first the masters (and the moments' seed) are taken from its
        first rank."""
        if replicas is not None:
            self.broadcast_(replicas)
            if self.moments is not None:
                self.moments.reseed_(agree_seed(self.moments.seed, replicas, _device(self._model)))
        pairs = list(self.named_pairs())
        if not pairs:
            return []
        # A DTensor master and its parameter share their layout: each rank compares and restarts its own shards.
        local = [(local_view(master), local_view(param)) for _, master, param in pairs]
        stale = torch.stack([(master.to(param.dtype) != param).any() for master, param in local]).tolist()
        for (master, param), changed in zip(local, stale):
            if changed:
                master.copy_(param)
        return [name for (name, _, _), changed in zip(pairs, stale) if changed]

    def unscale_(self, optimizer: Optimizer, checker: LossScaler | None,
                 scaler: object, device: torch.device | str) -> None:
        if any(p.requires_grad and p.dtype == self.dtype for g in optimizer.param_groups for p in g["params"]):
            self.bind_new_(optimizer)  # added (add_param_group) or unfrozen since setup
            if self.moments is not None:
                self.moments.bind_(optimizer, self._ids_to_names())
        self.copy_grads_to_master_(optimizer)
        super().unscale_(optimizer, checker, scaler, device)
        self.expose_grads_(optimizer, copy=scaler is not None)

    def grads(self, optimizer: Optimizer, *, absorb: bool = False) -> GradView:
        """The masters' gradients (true values after :meth:`unscale_`) and the model's, whose ``.grad`` shows them;
        ``absorb``: first copy into the masters what was written on the model's side since."""
        if absorb:
            self.absorb_grads_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if id(optimizer) in self._names_by_optimizer:
            params += self._select(optimizer)[1]
        return GradView(params, None)

    def _absorb_(self, optimizer: Optimizer) -> None:
        self.absorb_grads_(optimizer)  # gradients written on the model's side since the unscale reach the masters

    def _expose_(self, optimizer: Optimizer) -> None:
        self.expose_grads_(optimizer)  # hooks after a clip see the clipped values

    def _update(self, optimizer: Optimizer, kwargs: Kwargs) -> Callable[[], object] | None:
        moments = self.moments
        return None if moments is None else (lambda: moments.step_(optimizer, self._ids_to_names(), **kwargs))

    def _done_(self, optimizer: Optimizer, *, stepped: bool) -> None:
        if stepped:
            self.refresh_model_(optimizer)
        self.zero_model_grads_(optimizer)
        # Lightning's toggle_optimizer (a GAN's loop) freezes the other optimizers' parameters, which are masters
        # here: the model's parameters they stand for kept requires_grad and took gradients from this optimizer's
        # loss (the discriminator's, from the generator's), which Lightning's own bf16-true never computes. Dropped,
        # they do not add into the other optimizer's next step.
        for name, master in self._masters.items():
            if not master.requires_grad:
                self._params[name].grad = None

    def fp32_weights(self) -> dict[str, torch.Tensor]:
        return {name: master for name, master, _ in self.named_pairs()}

    def state_tensors(self) -> list[torch.Tensor]:
        return [] if self.moments is None else self.moments.tensors()

    def _precise(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return dict(self._masters), {}

    def memory_report(self) -> dict[str, int]:
        """Bytes held by training state, by kind; counts tensors, not allocator overhead. Reads no device data.

        Keys: ``params_16bit`` (every FP16/BF16 parameter of the model, frozen ones too), ``grads_16bit`` (their
        grads that exist now), ``masters``, ``master_grads``, ``optimizer_state`` (every tensor in the optimizers'
        ``state``, ``step`` counters included), ``params_fp32_other`` (trainable parameters of any other dtype,
        which have no master), ``total`` (their sum).
        """
        params = dict(self._model.named_parameters())
        low = [p for p in params.values() if p.dtype in _LOW_PRECISION]
        other = [p for p in params.values() if p.dtype not in _LOW_PRECISION and p.requires_grad]
        masters = self.masters
        state: dict[int, torch.Tensor] = {}
        for optimizer in self._optimizers:
            for param_state in optimizer.state.values():
                state.update((id(v), v) for v in param_state.values() if isinstance(v, torch.Tensor))
        report = {
            "params_16bit": nbytes(low),
            "grads_16bit": nbytes(p.grad for p in low if p.grad is not None),
            "masters": nbytes(masters),
            "master_grads": nbytes(m.grad for m in masters if m.grad is not None),
            "optimizer_state": nbytes(state.values()),
            "params_fp32_other": nbytes(other),
        }
        report["total"] = sum(report.values())
        return report


def _device(module: nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))


_KEEPERS: weakref.WeakKeyDictionary[Optimizer, weakref.ref[MasterWeights]] = weakref.WeakKeyDictionary()
"""The keeper that holds each optimizer's masters, for its ``zero_grad``."""


def zero_grad_reaches_model(optimizer: Any, keeper: MasterWeights | None = None) -> None:
    """Make ``optimizer.zero_grad()`` clear the 16-bit model gradients of the parameters whose masters it holds, as
    well as the masters' own: its class is swapped for a one-method subclass (pickled as the original, so a copy is a
    plain optimizer). ``keeper``: the one holding the masters (given for the optimizer itself; a Lightning or Fabric
    wrapper of it, whose class was made from the optimizer's before the swap, is swapped alike and finds the keeper
    through the optimizer it wraps). The wrappers Lightning makes after the plugin's setup take the swapped class."""
    if keeper is not None:
        _KEEPERS[optimizer] = weakref.ref(keeper)
    cls = type(optimizer)
    if cls.__dict__.get(ZERO_GRAD_SWAP, False):
        return

    def zero_grad(self: Any, set_to_none: bool = True) -> None:
        cls.zero_grad(self, set_to_none=set_to_none)
        real = self.__dict__.get("_optimizer", self)  # a wrapper's optimizer
        ref = _KEEPERS.get(real)
        master_keeper = ref() if ref is not None else None
        if master_keeper is not None and id(real) in master_keeper._names_by_optimizer:
            master_keeper.zero_model_grads_(real, set_to_none=set_to_none)

    optimizer.__class__ = type(cls.__name__, (cls,), {"zero_grad": zero_grad, ZERO_GRAD_SWAP: True,
                                                      "__module__": cls.__module__, "__reduce_ex__": _reduce_ex})


def _reduce_ex(self: Any, protocol: int) -> tuple[object, ...]:
    # Pickle as the original class (the swapped one is made at run time and cannot be imported).
    return _rebuild, (type(self).__mro__[1], self.__getstate__())


def _rebuild(cls: type[Optimizer], state: dict[str, Any]) -> Optimizer:
    optimizer = cls.__new__(cls)
    optimizer.__setstate__(state)
    return optimizer


def _to_fp32(value: object) -> object:
    # Only 16-bit floating state is widened; int step counters and FP32 state stay as they are.
    if isinstance(value, torch.Tensor) and value.dtype in _LOW_PRECISION:
        return value.float()
    return value


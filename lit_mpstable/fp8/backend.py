"""The FP8 backend seam: what every FP8 implementation (native FP8Linear, torchao, TransformerEngine) provides."""

from __future__ import annotations

import contextlib
import importlib
import warnings
from typing import Any, ClassVar, ContextManager, TypeVar, cast

import torch
from torch import nn

from lit_mpstable.base.validate import check_keys
from lit_mpstable.fp8.config import FP8Config

_PIP = {"transformer_engine": 'pip install "transformer-engine[pytorch]"', "torchao": "pip install torchao"}
_HOOK_DICTS = (
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks", "_is_full_backward_hook",
)  # fmt: skip
_WARNED: set[str] = set()
_Linear = TypeVar("_Linear", bound=nn.Linear)


class FP8Backend:
    """One FP8 implementation behind one interface, so that the precision layout, the fallback ladder, checkpoints,
    telemetry and the preflight never ask which library built a layer.

    Layer-level operations need no config and are class methods, so model-level helpers (``convert_from_fp8``,
    ``fp8_state_dict``, ``fp8_stats``) apply them to whatever FP8 layers a model holds:

    - :meth:`is_fp8_layer`: whether a module is one of this backend's FP8 layers (never imports the library: a
      layer of a library nobody imported cannot exist).
    - :meth:`revert_`: the named FP8 layers back to ``nn.Linear`` sharing the same ``Parameter`` objects, so
      optimizers and master weights stay bound (and hooks registered on the original layer keep firing).
    - :meth:`state_dict` / :meth:`load_state_dict`: the scaling state of the named layers, keyed
      ``"<fqn>.<key>"``, tensors only (``torch.load(..., weights_only=True)`` reads it); loading is strict.
    - :meth:`collect_stats_` / :meth:`stats`: saturation/underflow telemetry where the backend records it; a
      backend that cannot says so once.

    Config-level operations are instance methods; the constructor refuses what the backend cannot do with the
    config (``ValueError``) or a missing package (``ModuleNotFoundError`` with the pip line):

    - :meth:`convert_`: swap the named ``nn.Linear`` layers for FP8 layers, sharing their parameters.
    - :meth:`forward_context`: the context every forward of a model with FP8 layers must run in.
    - :meth:`sync_`: once per optimizer step, make the scaling state agree across ranks (delayed recipe).
    """

    name: ClassVar[str] = "base"
    records_stats: ClassVar[bool] = False
    """Whether :meth:`collect_stats_` records anything (else it warns once when asked)."""

    def __init__(self, config: FP8Config) -> None:
        if config.backend != self.name:
            raise ValueError(f"{type(self).__name__}(config): config.backend is {config.backend!r}, not {self.name!r}.")
        self.config = config

    # ------------------------------------------------------------------------------------------------ layers
    @classmethod
    def is_fp8_layer(cls, module: nn.Module) -> bool:
        raise NotImplementedError

    def convert_(self, model: nn.Module, names: list[str]) -> None:
        raise NotImplementedError

    @classmethod
    def revert_(cls, model: nn.Module, names: list[str]) -> None:
        for name in names:
            replace_module(model, name, cls.to_linear(model.get_submodule(name)))

    @classmethod
    def to_linear(cls, layer: nn.Module) -> nn.Linear:
        """A plain ``nn.Linear`` sharing ``layer``'s parameters and hooks (its FP8 state is dropped)."""
        return linear_like(layer)

    # ------------------------------------------------------------------------------------------------- state
    @classmethod
    def layer_state(cls, layer: nn.Module) -> dict[str, torch.Tensor]:
        """One layer's scaling state (copies); empty for a stateless recipe or backend."""
        return {}

    @classmethod
    def load_layer_state(cls, layer: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`layer_state`'s output (keys already checked)."""

    @classmethod
    def state_dict(cls, model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
        state = {}
        for name in names:
            state.update({f"{name}.{key}": value for key, value in cls.layer_state(model.get_submodule(name)).items()})
        return state

    @classmethod
    def load_state_dict(cls, model: nn.Module, names: list[str], state: dict[str, torch.Tensor]) -> None:
        """Strict: the keys must be exactly :meth:`state_dict`'s.

        Raises:
            KeyError: keys are missing or unknown (another recipe, filter or backend, or layers moved back to base
                precision before or after the save).
        """
        expected = cls.state_dict(model, names)
        check_keys(f"{cls.__name__}.load_state_dict", state, expected,
                   suffix="; was it saved with another FP8 recipe, filter or backend, or before/after a fallback moved"
                          " layers back to base precision?")
        for name in names:
            prefix = f"{name}."
            own = {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}
            cls.load_layer_state(model.get_submodule(name), own)

    # -------------------------------------------------------------------------------------------- telemetry
    @classmethod
    def collect_stats_(cls, model: nn.Module, names: list[str], enabled: bool = True) -> None:
        """Turn per-layer saturation/underflow recording on or off (off clears old stats)."""
        if enabled and names and not cls.records_stats:
            warn_once(
                cls.name,
                f"FP8 backend {cls.name!r} records no saturation/underflow statistics, so fp8_saturation_frac and"
                f" fp8_underflow_frac leave out its layers {names[:4]}{'...' if len(names) > 4 else ''}."
                " (Warned once.)",
            )

    @classmethod
    def layer_stats(cls, layer: nn.Module) -> dict[str, torch.Tensor | float]:
        """The latest statistics of one layer (see ``FP8Linear``); empty when none were recorded."""
        return {}

    # ------------------------------------------------------------------------------------------ conformance
    def checks_conformance(self) -> bool:
        """Whether :func:`~lit_mpstable.fp8.native.conformance_gate` checks this backend here (the native backend is
        the reference)."""
        return False

    def probe_quantize(self, x: torch.Tensor, operand: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This backend's own quantization of the probe tensor ``x`` as the operand ``operand`` (``"input"``,
        ``"weight"``, ``"grad"``) of its recipe: ``(dequantized values, decode scales)`` in fp32, laid out as
        :func:`~lit_mpstable.fp8.quantizers.reference_quantize`'s, or None where it exposes no quantizer here."""
        return None

    def probe_gradients(self, x: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
        """The weight gradient of a probe layer (``weight``, no bias) this backend builds, for input ``x`` and
        output gradient ``grad_out``: one forward and backward in :meth:`forward_context`."""
        model = nn.Sequential(nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device))
        model[0].weight = nn.Parameter(weight.clone())
        self._probing = True  # the probe layer itself is not gated
        try:
            self.convert_(model, ["0"])
        finally:
            self._probing = False
        with self.forward_context():
            out = model(x)
        out.backward(grad_out.to(out.dtype))
        grad = model[0].weight.grad
        return grad.detach().float() if grad is not None else torch.zeros_like(weight)

    # ------------------------------------------------------------------------------------------- per step
    def forward_context(self) -> ContextManager:
        return contextlib.nullcontext()

    def sync_(self, model: nn.Module, names: list[str], group: Any = None) -> None:
        """Make the scaling state of the named layers agree across the ranks of ``group`` (default: all)."""


# --------------------------------------------------------------------------------------------------- helpers
def optional_import(module: str, backend: str) -> Any:
    """``importlib.import_module(module)``, or ModuleNotFoundError naming the pip line of ``backend``."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"FP8Config(backend={backend!r}) needs the {backend} package, which is not installed: {_PIP[backend]}"
        ) from err


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where the submodule ``name`` of ``model`` is."""
    if not name:
        raise ValueError(f"cannot swap the root module {type(model).__name__} in place; wrap it in a container.")
    parent, _, child = name.rpartition(".")
    owner = model.get_submodule(parent)
    setattr(owner, child, new)
    if child == "_orig_mod":
        from torch._dynamo.eval_frame import OptimizedModule

        if isinstance(owner, OptimizedModule):
            owner._initialize()  # torch.compile(layer) itself: its compiled forward still calls the layer it wrapped


def share_hooks(source: nn.Module, target: nn.Module) -> None:
    """Make ``target`` use ``source``'s hook dicts, so handles registered on either still remove them."""
    for name in _HOOK_DICTS:
        setattr(target, name, getattr(source, name))


def linear_like(layer: nn.Module, cls: type[_Linear] = nn.Linear, **kwargs: Any) -> _Linear:  # type: ignore[assignment]
    """A ``cls`` (an ``nn.Linear`` subclass, built with ``kwargs``) with ``layer``'s ``weight`` and ``bias`` (the same
    ``Parameter`` objects), mode and hooks. Built on the meta device: buffers of its own stay there. (The ignore:
    mypy refuses a TypeVar parameter's default of its bound.)

    A ``bias`` that is not a Parameter (TransformerEngine keeps an empty tensor when there is none) means no bias.
    """
    bias = getattr(layer, "bias", None)
    bias = bias if isinstance(bias, nn.Parameter) else None
    like = cast(nn.Linear, layer)  # duck-typed: TE's and torchao's linears carry the same features and weight
    linear = cls(like.in_features, like.out_features, bias is not None, device="meta", **kwargs)
    linear.weight = like.weight
    linear.bias = bias  # type: ignore[assignment]  # torch annotates bias as Parameter, yet Linear(bias=False) holds None
    linear.train(layer.training)
    share_hooks(layer, linear)
    return linear


def warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

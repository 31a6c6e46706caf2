"""The torchao FP8 backend: torchao's Float8Linear (current scaling) and its MXFP8 weight wrapper, behind the seam."""

from __future__ import annotations

import functools
import importlib
import math
import sys
from typing import Any, ClassVar

import torch
from torch import nn

from lit_mpstable.fp8.backend import FP8Backend, optional_import, share_hooks
from lit_mpstable.fp8.config import FP8Config
from lit_mpstable.fp8.gemm import scaled_mm_supported
from lit_mpstable.fp8.native import conformance_gate

_MX_CONFIG = "torchao.prototype.moe_training.config"
_TORCHAO_RECIPES = {"current": "_convert_float8", "mxfp8": "_convert_mx"}
"""Recipe name -> the method converting layers to torchao's training layers for it (one entry per recipe)."""
_TORCHAO_REFUSALS = {
    "mxfp4": " has no mxfp4 training config (its MX/NVFP4 configs quantise for inference)",
    "nvfp4": " has no nvfp4 training config (its MX/NVFP4 configs quantise for inference)",
    "blockwise": "'s blockwise FP8 kernels scale each tile by exactly 448 / amax, and its"
                 " Float8BlockwiseLinearConfig has no option for the power-of-two scales that 'blockwise' means"
                 " (TransformerEngine's Float8BlockScaling default; exact scaling and unscaling), so the same recipe"
                 " would give other numbers",
}
_TORCHAO_ELSE = {"nvfp4": ", or backend='transformer_engine' on a Blackwell GPU",
                 "blockwise": " or backend='transformer_engine' on a Hopper GPU"}
_MX_TENSOR = "torchao.prototype.moe_training.tensor"


class TorchaoBackend(FP8Backend):
    """torchao's FP8 training layers, sharing the original ``Parameter`` objects.

    - ``recipe="current"``: ``torchao.float8.convert_to_float8_training`` with ``Float8LinearConfig`` (tensorwise
      dynamic scaling, E4M3 forward, E5M2 or E4M3 gradients), restricted to the selected names. Reverting gives an
      ``nn.Linear`` with the same parameters.
    - ``recipe="mxfp8"``: torchao's ``MXFP8TrainingOpConfig`` through ``quantize_``: the layer stays an ``nn.Linear``
      whose parameters hold an ``MXFP8TrainingWeightWrapperTensor``. torchao makes new Parameters; their contents
      are swapped into the original ones (``torch.utils.swap_tensors``), and back on revert, so the objects that
      optimizers hold stay the ones the model computes with. A layer with a bias is refused (torchao's linear leaves
      the bias out, silently). Each forward first refuses what torchao's linear cannot
      compute (:func:`_check_operands`: 16-bit operands, an emulated ``*-mixed`` step, a row count its weight
      gradient cannot block), naming the way out, instead of an error from inside torchao.
    - ``"blockwise"``, ``"mxfp4"``, ``"nvfp4"``: refused, with the reason (:data:`_TORCHAO_REFUSALS`), naming
      ``backend="native"`` (exact emulation).

    Stateless (nothing to checkpoint, nothing to synchronise across ranks) and without telemetry.

    Raises:
        ModuleNotFoundError: torchao is not installed.
        ValueError: ``recipe="blockwise"``, ``"mxfp4"`` or ``"nvfp4"``, or ``"mxfp8"`` with a torchao that has no
            MXFP8 training config (FP8Config itself refuses ``recipe="delayed"``: torchao removed delayed scaling);
            at conversion, ``"mxfp8"`` layers with a bias.
    """

    name: ClassVar[str] = "torchao"

    def __init__(self, config: FP8Config) -> None:
        super().__init__(config)
        name = config.spec.name
        convert = _TORCHAO_RECIPES.get(name)
        if convert is None:
            torchao = optional_import("torchao", "torchao")
            unmapped = f": no mapping of recipe {name!r} to a torchao training config (see _TORCHAO_RECIPES)"
            reason = _TORCHAO_REFUSALS.get(name, unmapped)
            raise ValueError(f"FP8Config(recipe={name!r}, backend='torchao'): torchao {torchao.__version__}{reason};"
                             f" use backend='native' (exact emulation on any device){_TORCHAO_ELSE.get(name, '')}.")
        self._convert = getattr(self, convert)
        if convert == "_convert_mx":
            optional_import("torchao", "torchao")
            try:
                importlib.import_module(_MX_CONFIG)
                importlib.import_module("torchao.quantization.quantize_.common")
            except ImportError as err:
                raise ValueError(
                    f"FP8Config(recipe={name!r}, backend='torchao'): this torchao version has no MXFP8 training config"
                    f" ({_MX_CONFIG}.MXFP8TrainingOpConfig); use backend='native' or upgrade torchao."
                ) from err
        else:
            optional_import("torchao.float8", "torchao")

    def probe_quantize(self, x: torch.Tensor, operand: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """torchao's own casts for the conformance check: tensorwise ``tensor_to_scale`` / ``to_fp8_saturated``
        (``"current"``), ``to_mx`` with the scale mode of ``MXFP8TrainingOpConfig`` (``"mxfp8"``)."""
        try:
            return self._probe_quantize(x, operand == "grad")
        except (ImportError, AttributeError, TypeError):  # a torchao without these functions: nothing to compare
            return None

    def _probe_quantize(self, x: torch.Tensor, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if self._convert == self._convert_mx:
            from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
            from torchao.prototype.mx_formats.mx_tensor import to_mx

            mode = getattr(MXFP8TrainingOpConfig(), "scale_calculation_mode", None)
            kwargs = {"scaling_mode": mode} if mode is not None else {}
            e8m0, data = to_mx(x.float().contiguous(), torch.float8_e4m3fn, 32, **kwargs)
            scales = torch.ldexp(torch.ones(e8m0.shape), e8m0.view(torch.uint8).long().cpu() - 127).to(x.device)
            values = data.float().unflatten(-1, (-1, 32)) * scales.unsqueeze(-1)
            return values.flatten(-2), scales
        from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

        dtype = self.config.grad_dtype if grad else torch.float8_e4m3fn
        scale = tensor_to_scale(x.float(), dtype)
        return to_fp8_saturated(x.float() * scale, dtype).float() / scale, scale.reciprocal().reshape(1)

    @classmethod
    def is_fp8_layer(cls, module: nn.Module) -> bool:
        linear_module = sys.modules.get("torchao.float8.float8_linear")
        if linear_module is not None and isinstance(module, linear_module.Float8Linear):
            return True
        return type(module) is nn.Linear and _mx_wrapped(module.weight)

    def checks_conformance(self) -> bool:
        return True

    def convert_(self, model: nn.Module, names: list[str]) -> None:
        names = conformance_gate(self, model, names)
        if not names:
            return
        selected = set(names)

        def module_filter_fn(module: nn.Module, fqn: str) -> bool:
            return fqn in selected

        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        originals = {name: model.get_submodule(name) for name in names}
        self._convert(model, originals, module_filter_fn, device)

    def _convert_float8(self, model: nn.Module, originals: dict[str, nn.Module], module_filter_fn: Any,
                        device: torch.device) -> None:
        float8 = optional_import("torchao.float8", "torchao")
        emulate = self.config.emulate if self.config.emulate is not None else not scaled_mm_supported(device)
        grad = {}  # torchao's default is hybrid: E5M2 gradients
        if self.config.format == "e4m3":
            grad["cast_config_grad_output"] = float8.CastConfig(target_dtype=torch.float8_e4m3fn)
        float8_config = float8.Float8LinearConfig(emulate=emulate, **grad)
        float8.convert_to_float8_training(model, module_filter_fn=module_filter_fn, config=float8_config)
        for name, linear in originals.items():
            share_hooks(linear, model.get_submodule(name))

    def _convert_mx(self, model: nn.Module, originals: dict[str, nn.Module], module_filter_fn: Any, device) -> None:
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
        from torchao.quantization import quantize_
        from torchao.quantization.quantize_.common import KernelPreference

        if biased := [name for name, layer in originals.items() if getattr(layer, "bias", None) is not None]:
            version = sys.modules["torchao"].__version__
            raise ValueError(
                f"FP8Config(recipe='mxfp8', backend='torchao'): layers {biased} have a bias, which torchao {version}'s"
                " MXFP8 training linear leaves out (its output lacks it and it gets no gradient). Use"
                " backend='native' (exact MXFP8 emulation, bias included), or keep these layers out of FP8"
                " (FP8Config(filter=...) or keep_high_precision=[...])."
            )
        hardware_mx = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (10, 0)  # Blackwell
        emulate = self.config.emulate if self.config.emulate is not None else not hardware_mx
        preference = KernelPreference.EMULATED if emulate else KernelPreference.AUTO
        before = {name: dict(layer.named_parameters(recurse=False)) for name, layer in originals.items()}
        quantize_(model, MXFP8TrainingOpConfig(kernel_preference=preference), filter_fn=module_filter_fn)
        for name, params in before.items():
            layer = model.get_submodule(name)
            for key, original in params.items():
                wrapped = getattr(layer, key)
                torch.utils.swap_tensors(original, wrapped)  # the original object now holds torchao's wrapper
                setattr(layer, key, original)
            setattr(layer, _HOOKS, (
                # The model's state dict keeps plain tensors, so checkpoints load with weights_only=True and into the
                # plain model (a wrapper subclass would need torchao and an unsafe load).
                layer.register_state_dict_post_hook(_plain_state),
                layer.register_forward_pre_hook(functools.partial(_check_operands, name, emulate), with_kwargs=True),
            ))

    @classmethod
    def revert_(cls, model: nn.Module, names: list[str]) -> None:
        float8 = [name for name in names if type(model.get_submodule(name)) is not nn.Linear]
        super().revert_(model, float8)
        for name in names:
            if name not in float8:
                layer = model.get_submodule(name)
                for param in layer.parameters(recurse=False):
                    if _mx_wrapped(param):
                        plain = nn.Parameter(_unwrap(param), requires_grad=param.requires_grad)
                        torch.utils.swap_tensors(param, plain)
                for handle in layer.__dict__.pop(_HOOKS, ()):
                    handle.remove()


_HOOKS = "_lit_mpstable_mx_hooks"
_MX_DTYPES = (torch.bfloat16, torch.float32)
"""The operand dtypes torchao's MX cast takes (``to_mx`` asserts them)."""
_MX_BLOCK = 32
"""torchao's MXFP8 block, along the reduction dim of each GEMM (the tokens for the weight gradient)."""


def _check_operands(name: str, emulated: bool, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse, before torchao's code runs, what its MXFP8 training linear cannot compute (else a torch error or an
    assertion from inside torchao, in the forward or the backward). It overrides ``F.linear`` above autocast, so
    under ``*-mixed`` a 16-bit activation meets the FP32 weight as they are. A Python check of dtypes and shapes, no
    host sync; under ``torch.compile`` a guard."""
    x, weight = args[0] if args else kwargs["input"], layer.weight  # torchao's wrapper has its tensor's dtype
    rows = math.prod(x.shape[:-1])
    if x.dtype not in _MX_DTYPES or weight.dtype not in _MX_DTYPES:
        why = "casts bfloat16 and float32 only (so neither '16-mixed' nor '16-true')"
        instead = ", 'bf16-true' or '32-true'"
    elif emulated and x.dtype != weight.dtype:
        why = ("emulated (torchao's MX kernels need a Blackwell GPU) multiplies operands of one dtype only (so not"
               " 'bf16-mixed', where autocast does not reach it)")
        instead = ", 'bf16-true' or '32-true'"
    elif rows % _MX_BLOCK and torch.is_grad_enabled():
        why = (f"casts the weight gradient's operands in blocks of {_MX_BLOCK} rows (tokens: batch x sequence), which"
               " it does not pad")
        instead = f", or {_MX_BLOCK}-row multiples"
    else:
        return
    raise RuntimeError(
        f"FP8Config(recipe='mxfp8', backend='torchao'): layer {name!r} gets a {x.dtype} input of {rows} rows for its"
        f" {weight.dtype} weight; torchao's MXFP8 training linear {why}. Use backend='native' (exact MXFP8 emulation"
        f" in every precision, padding as the hardware pads){instead}."
    )


def _mx_wrapped(tensor: Any) -> bool:
    tensor_module = sys.modules.get(_MX_TENSOR)
    return tensor_module is not None and isinstance(tensor, tensor_module.TrainingWeightWrapperBaseTensor)


def _unwrap(tensor: Any) -> torch.Tensor:  # a torchao tensor subclass (torch.Tensor's stubs lack the protocol)
    (inner,), _ = tensor.__tensor_flatten__()  # the tensor-subclass protocol names its plain tensor
    return getattr(tensor, inner)


def _plain_state(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for key in ("weight", "bias"):
        if _mx_wrapped(value := state_dict.get(prefix + key)):
            state_dict[prefix + key] = _unwrap(value).detach()

"""FP8 matrix products: ``torch._scaled_mm`` or exact emulation (:func:`scaled_mm_preferred` says which by default)."""

from __future__ import annotations

import warnings

import torch

from lit_mpstable.fp8.quant import to_stored


def scaled_mm_supported(device: torch.device | str) -> bool:
    """Whether ``torch._scaled_mm`` computes FP8 GEMMs correctly on ``device`` (probed once per device).

    CUDA needs compute capability >= 8.9 (Ada, Hopper and later). Recent CPU builds of torch also implement it;
    the probe runs a 16x16 product of each operand pairing FP8Linear uses and compares with an fp32 matmul. It
    builds its operands with explicit dtypes (fp32 scales) and runs outside autocast, so the context of its first
    call (a ``*-true`` forward sets a 16-bit default dtype) cannot make it fail.
    """
    return scaled_mm_refusal(device) is None


def scaled_mm_preferred(device: torch.device | str) -> bool:
    """Whether ``FP8Config(emulate=None)`` sends FP8 GEMMs on ``device`` to ``torch._scaled_mm``: where it runs, except
    on a CPU. torch's CPU kernel computes the emulation's product (up to fp32 rounding: it scales after the sum) and
    is never faster; on an Intel Xeon with AMX, torch 2.13's kernel for two operands of one format (the forward GEMM,
    and every GEMM of ``format="e4m3"``) was 250-4700x slower than the emulation, 64x64x64 to 1024x256x256
    (``bench/bench_fp8_cpu_gemm.py``; an FP8 MLP's step 800 ms instead of 14). ``emulate=False`` still forces it.
    The exceptions, delayed scaling and the torchao backend: docs/fp8-recipes.md, "On the CPU".
    """
    return torch.device(device).type != "cpu" and scaled_mm_supported(device)


def scaled_mm_refusal(device: torch.device | str) -> str | None:
    """Why ``torch._scaled_mm`` does not run FP8 GEMMs on ``device`` (None where it does), for messages."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        capability = torch.cuda.get_device_capability(index)
        if capability < (8, 9):
            return f"CUDA device {index} has compute capability {capability}; FP8 GEMMs need >= (8, 9)"
        device = torch.device("cuda", index)
    key = str(device)
    if key not in _PROBED:
        _PROBED[key] = _probe(key)
    return _PROBED[key]


_PROBED: dict[str, str | None] = {}
"""Probe outcomes per device: None (runs) or the refusal. Only outcomes of sound arguments are stored."""


def _probe(device: str) -> str | None:
    device_type = torch.device(device).type
    # Explicit dtypes everywhere, no autocast, no autograd: the caller may run inside a 16-bit forward, where
    # ``torch.ones(())`` would give a bf16 scale that _scaled_mm refuses (a refusal of our arguments, not the device).
    with torch.no_grad(), torch.autocast(device_type, enabled=False):
        gen = torch.Generator().manual_seed(0)
        a = torch.randint(-8, 9, (16, 16), generator=gen).to(device=device, dtype=torch.float32)
        b = torch.randint(-8, 9, (16, 16), generator=gen).to(device=device, dtype=torch.float32)
        one = torch.ones((), device=device, dtype=torch.float32)
        try:
            pairs = ((torch.float8_e4m3fn, torch.float8_e4m3fn), (torch.float8_e5m2, torch.float8_e4m3fn))
            for a_dtype, b_dtype in pairs:
                out = torch._scaled_mm(
                    a.to(a_dtype), b.to(b_dtype).t(), scale_a=one, scale_b=one, out_dtype=torch.float32
                )
                if not torch.equal(out, a @ b.t()):  # small integers: both products are exact
                    return f"torch._scaled_mm gave a wrong {a_dtype} x {b_dtype} product on {device}"
        except Exception as error:  # noqa: BLE001 - a missing kernel, unsupported dtype or layout: "not here"
            return f"torch._scaled_mm refused a 16x16 {a_dtype} x {b_dtype} product on {device}: {error}"
    return None


_SCALED_MM_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fits_scaled_mm(a: torch.Tensor, b_t: torch.Tensor) -> bool:
    # cuBLASLt's FP8 kernels need every dimension a multiple of 16; other shapes take the emulated path (the CPU
    # kernel takes any shape).
    if a.device.type != "cuda" or all(size % 16 == 0 for size in (*a.shape, b_t.shape[0])):
        return True
    if not _warned_shape:
        _warned_shape.append(True)
        warnings.warn(
            f"fp8_mm: a GEMM of shape ({a.shape[0]} x {a.shape[1]}) @ ({b_t.shape[1]} x {b_t.shape[0]}) has a dimension"
            " that is not a multiple of 16, which torch._scaled_mm needs on CUDA; such GEMMs run emulated (same"
            " numerics, slower). Make batch * sequence length a multiple of 16 to avoid it. (Warned once.)",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


_warned_shape: list[bool] = []


def fp8_mm(
    a: torch.Tensor,
    b_t: torch.Tensor,
    a_inv_scale: torch.Tensor,
    b_inv_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    use_scaled_mm: bool,
) -> torch.Tensor:
    """``(a * a_inv_scale) @ (b_t * b_inv_scale).T`` for FP8 ``a`` (M, K) and ``b_t`` (N, K), reduced along K.

    Both operands have K contiguous ("TN" layout), which is what ``_scaled_mm`` wants: ``b_t.t()`` is the
    column-major second operand. The emulated path dequantises exactly (an FP8 value times an fp32 scale) and
    multiplies in fp32; the two paths agree up to fp32 accumulation order.
    """
    if use_scaled_mm and _fits_scaled_mm(a, b_t):
        mm_dtype = out_dtype if out_dtype in _SCALED_MM_OUT_DTYPES else torch.float32
        out = torch._scaled_mm(
            a.contiguous(), b_t.contiguous().t(), scale_a=a_inv_scale, scale_b=b_inv_scale, out_dtype=mm_dtype
        )
        return out.to(out_dtype)
    return to_stored((a.float() * a_inv_scale) @ (b_t.float() * b_inv_scale).t(), out_dtype)


_WARNED_EMULATION: set[str] = set()  # devices auto mode has said it emulates on


# Run by torch.compile at trace time, in plain Python, and baked into the graph as a constant: the probe behind it
# runs real FP8 GEMMs (a seeded generator, an equality check) that cannot be traced, and is cached per device.
@torch.compiler.assume_constant_result
def _scaled_mm_decision(emulate: bool | None, device: str, delayed: bool = False) -> bool:
    """Whether FP8 GEMMs on ``device`` go through ``torch._scaled_mm`` (else exact emulation).

    Auto mode on a CPU emulates (:func:`scaled_mm_preferred`), except under delayed scaling, which keeps
    ``_scaled_mm`` from when the emulated backward used the next step's scale under ``torch.compile`` (torch 2.13's
    partitioner recomputed the saved inverse scale from the updated buffer; FP8Linear now copies it with an opaque op,
    :func:`~lit_mpstable.fp8.block_gemm.counter_snapshot`, which the partitioner saves).
    """
    if emulate is None and torch.device(device).type == "cpu" and not delayed:
        return False
    if emulate is None:
        refusal = scaled_mm_refusal(device)
        if refusal is not None and device not in _WARNED_EMULATION:
            _WARNED_EMULATION.add(device)
            warnings.warn(
                f"FP8Linear: torch._scaled_mm does not run FP8 GEMMs on {device} ({refusal}), so FP8 is emulated"
                " there: FP8 numerics, no speed-up. Set FP8Config(emulate=True) to say that is intended. (Warned"
                " once per device.)",
                RuntimeWarning,
                stacklevel=5,
            )
        return refusal is None
    if not emulate and (refusal := scaled_mm_refusal(device)) is not None:
        raise RuntimeError(
            f"FP8Config(emulate=False): torch._scaled_mm does not run FP8 GEMMs on {device} ({refusal}); use"
            " emulate=None to fall back to emulation."
        )
    return not emulate

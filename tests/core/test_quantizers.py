"""Frontier quantizers (blockwise FP8, MXFP4/MXFP8, NVFP4, the random Hadamard transform), element for element:
against torchao's MX and NVFP4 reference quantizers where they run on the CPU, and elsewhere against references
written here from the OCP MX spec v1.0 and TransformerEngine's formulas (nearest-even by search over the format's
whole grid, scales in numpy float32)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lit_mpstable.fp8.blockwise import blockwise_quantize, blockwise_scale
from lit_mpstable.fp8.hadamard import hadamard_matrix, random_hadamard_transform, random_signs
from lit_mpstable.fp8.mx import MXElement, mx_dequantize, mx_quantize
from lit_mpstable.fp8.nvfp4 import nvfp4_dequantize, nvfp4_quantize
from lit_mpstable.fp8.quantizers import QuantRecipe, QuantRole, fake_quantize

N_TENSORS = 1000  # random tensors per comparison with torchao (issue 27's target)
INF, NAN = float("inf"), float("nan")


# ---------------------------------------------------------------------------------------------------------------
# Independent references
# ---------------------------------------------------------------------------------------------------------------

def _grid(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Every finite non-negative value of a format, ascending, and its code (its bit pattern without the sign)."""
    if name == "fp4_e2m1":  # OCP MX v1.0 table 5: E2M1 codes 0..7
        return np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64), np.arange(8)
    dtype, last = {"fp8_e4m3": (torch.float8_e4m3fn, 0x7E), "fp8_e5m2": (torch.float8_e5m2, 0x7B)}[name]
    codes = torch.arange(0, last + 1, dtype=torch.uint8)
    return codes.view(dtype).double().numpy(), codes.numpy()


def _nearest_even(v: np.ndarray, name: str) -> np.ndarray:
    """``v`` rounded to the format by brute force: the nearest grid value, a tie to the even code; saturating at the
    largest finite value; NaN stays NaN."""
    values, codes = _grid(name)
    v = np.asarray(v, np.float64)
    mag = np.minimum(np.abs(np.nan_to_num(v, nan=0.0)), values[-1])
    dist = np.abs(mag.reshape(-1, 1) - values.reshape(1, -1))
    best = dist == dist.min(axis=1, keepdims=True)
    pick = best & ((codes % 2 == 0) | (best.sum(axis=1, keepdims=True) == 1))
    out = values[pick.argmax(axis=1)].reshape(v.shape) * np.where(np.signbit(v), -1.0, 1.0)
    return np.where(np.isnan(v), np.nan, out)


def _mx_reference(x: torch.Tensor, element: str, block: int = 32) -> torch.Tensor:
    """OCP MX v1.0 section 6.3, block by block: X = 2**(floor(log2(amax)) - emax_elem) clamped to E8M0's range,
    elements nearest-even of x / X saturated. A NaN block is NaN (E8M0's NaN scale); an inf amax takes exponent 128,
    the fp32 exponent field of inf, as torchao does."""
    emax = {"fp4_e2m1": 2, "fp8_e4m3": 8, "fp8_e5m2": 15}[element]
    flat = x.float().reshape(-1, block).double().numpy()
    out = np.empty_like(flat)
    for i, v in enumerate(flat):
        amax = np.abs(v).max()
        if np.isnan(amax):
            out[i] = np.nan
            continue
        floor_log2 = 128 if np.isinf(amax) else (math.frexp(amax)[1] - 1 if amax > 0 else -127)
        e = min(max(floor_log2 - emax, -127), 127)
        out[i] = _nearest_even(v / 2.0**e, element) * 2.0**e
    with np.errstate(over="ignore"):  # an inf block's saturated element times 2**126 overflows fp32, as it should
        out = out.astype(np.float32)
    return torch.from_numpy(out).reshape(x.shape).to(x.dtype)


def _te_blockwise_reference(x: torch.Tensor, tile: tuple[int, int], pow2: bool = True) -> torch.Tensor:
    """TransformerEngine's blockwise FP8, tile by tile: amax (zero padding), scale = 448 / amax in fp32 (fp32 max if
    that overflows, 1 for amax 0), rounded down to a power of two by frexp; E4M3 nearest-even of x * scale, times
    1 / scale in fp32. A tile holding inf/NaN is NaN (TE's reference: scale 0, scale_inv inf)."""
    a = x.float().numpy().astype(np.float32)
    a2 = a.reshape(1, -1) if a.ndim == 1 else a.reshape(-1, a.shape[-1])
    out = np.empty_like(a2)
    rows, cols = tile
    lead = 1 if a.ndim == 1 else int(np.prod(a.shape[:-2], dtype=np.int64))
    r_per = a2.shape[0] // lead
    for m in range(lead):
        for r0 in range(0, r_per, rows):
            for c0 in range(0, a2.shape[1], cols):
                sl = (slice(m * r_per + r0, m * r_per + min(r0 + rows, r_per)), slice(c0, c0 + cols))
                t = a2[sl]
                amax = np.float32(np.abs(t).max())
                if not np.isfinite(amax):
                    out[sl] = np.nan
                    continue
                if amax == 0:
                    scale = np.float32(1.0)
                else:
                    with np.errstate(over="ignore"):
                        scale = np.float32(448.0) / amax
                    scale = np.float32(np.finfo(np.float32).max) if np.isinf(scale) else scale
                    if pow2:
                        scale = np.float32(2.0 ** (math.frexp(float(scale))[1] - 1))
                q = _nearest_even((t * scale).astype(np.float32), "fp8_e4m3").astype(np.float32)
                out[sl] = q * (np.float32(1.0) / scale)
    return torch.from_numpy(out.reshape(a.shape)).to(x.dtype)


def _nvfp4_reference(x: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """NVFP4 two-level scaling, tile by tile in numpy float32: tensor scale amax / (448 * 6) (1 if amax is 0), block
    scale E4M3-nearest-even of (tile amax / 6) / tensor scale clamped to [2**-6, 448], elements E2M1-nearest-even of
    x * ((1 / tensor scale) / block) clamped to ±6, dequantized as elements * (tensor scale * block)."""
    a = x.float().numpy().astype(np.float32)
    amax = np.float32(np.abs(a).max())
    ts = np.float32(1.0) if amax == 0 else amax / np.float32(2688.0)
    out = np.empty_like(a)
    rows, cols = tile
    for r0 in range(0, a.shape[0], rows):
        for c0 in range(0, a.shape[1], cols):
            t = a[r0:r0 + rows, c0:c0 + cols]
            with np.errstate(invalid="ignore"):  # inf / inf and 0 * inf: NaN, as it should be
                b = (np.float32(np.abs(t).max()) / np.float32(6.0)) / ts
                s = np.float32(_nearest_even(np.clip(b, np.float32(2.0**-6), np.float32(448.0)), "fp8_e4m3"))
                enc = (np.float32(1.0) / ts) / s
                v = np.clip((t * enc).astype(np.float32), np.float32(-6), np.float32(6))
                out[r0:r0 + rows, c0:c0 + cols] = _nearest_even(v, "fp4_e2m1").astype(np.float32) * (ts * s)
    return torch.from_numpy(out).to(x.dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, NaN where the other is NaN (inf equals inf)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) and torch.equal(
        torch.where(a.isnan(), 0, a), torch.where(b.isnan(), 0, b))


def _random_batch(n: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """n tensors over 80 binades of magnitude, with 2% outliers (x100) and 2% exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g)
    x = x * torch.exp2(torch.randint(-40, 40, (n,) + (1,) * len(shape), generator=g).float())
    u = torch.rand(x.shape, generator=g)
    return torch.where(u < 0.02, x * 100, torch.where(u > 0.98, 0.0, x))


def _edge_cases(fmt_max: float) -> dict[str, torch.Tensor]:
    """Named (4, 64) tensors: one 32-element block of each row holds the case, the rest is plain randn."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(4, 64, generator=g)
    cases = {}
    for name, fill in {
        "all_zero": lambda b: b * 0,
        "nan": lambda b: b.index_fill(-1, torch.tensor([3]), NAN),
        "inf": lambda b: b.index_fill(-1, torch.tensor([5]), INF),
        "-inf": lambda b: b.index_fill(-1, torch.tensor([5]), -INF),
        "fp32_subnormal": lambda b: b * 1e-40,
        "amax_at_format_max": lambda b: (b / b.abs().amax() * fmt_max).index_fill(-1, torch.tensor([0]), fmt_max),
        "amax_past_format_max": lambda b: b / b.abs().amax() * fmt_max * 1.9,
        "huge": lambda b: b * 1e38,
        # Midpoints of the E2M1 grid with the block amax at the format's max, so x / scale lands on ties (E2M1 only).
        "e2m1_ties": lambda b: torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4) * (fmt_max / 6),
    }.items():
        x = base.clone()
        x[:, :32] = fill(x[:, :32])
        cases[name] = x
    return cases


# ---------------------------------------------------------------------------------------------------------------
# MX vs torchao's to_mx (scaling mode FLOOR, the OCP rule)
# ---------------------------------------------------------------------------------------------------------------

def _torchao_mx():
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    return mx_tensor, kernels


_MX_ELEMENTS = {"fp4_e2m1": "float4_e2m1fn_x2", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def _torchao_to_mx(x: torch.Tensor, element: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchao's (scale bytes, elements as fp32, dequantized in x's dtype)."""
    mx_tensor, kernels = _torchao_mx()
    elem_dtype = getattr(torch, _MX_ELEMENTS[element])
    scale, data = mx_tensor.to_mx(x, elem_dtype, 32)
    if element == "fp4_e2m1":
        elements = kernels.f4_unpacked_to_f32(kernels.unpack_uint4(data)).reshape(x.shape)
    else:
        elements = data.float()
    return scale.view(torch.uint8), elements, mx_tensor.to_dtype(data, scale, elem_dtype, 32, x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("element", list(_MX_ELEMENTS))
def test_mx_equals_torchao_on_1000_random_tensors(element: MXElement, dtype: torch.dtype) -> None:
    x = _random_batch(N_TENSORS, (4, 64), seed=1).to(dtype)
    ref_scale, ref_elements, ref_values = _torchao_to_mx(x, element)
    q = mx_quantize(x, element, scale_rule="floor")  # torchao's to_mx default, ScaleCalculationMode.FLOOR
    def per_tensor(a, b):
        return (a.flatten(1) == b.flatten(1)).all(dim=1)

    assert int(per_tensor(q.scale_e8m0, ref_scale).sum()) == N_TENSORS
    assert int(per_tensor(q.elements, ref_elements).sum()) == N_TENSORS
    assert int(per_tensor(mx_dequantize(q, dtype), ref_values).sum()) == N_TENSORS
    # The recipes' default is RCEIL (TransformerEngine's rule; the golden vectors check it bit for bit).
    rceil = mx_dequantize(mx_quantize(x, element), dtype)
    if element == "fp4_e2m1":
        assert _same(fake_quantize(x, "mxfp4"), rceil)
    if element == "fp8_e4m3":
        assert _same(fake_quantize(x, "mxfp8", role="weight"), rceil)


@pytest.mark.parametrize("element", list(_MX_ELEMENTS))
def test_mx_edge_cases_equal_torchao_and_the_spec(element: MXElement) -> None:
    fmt_max = {"fp4_e2m1": 6.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}[element]
    for name, x in _edge_cases(fmt_max).items():
        q = mx_quantize(x, element, scale_rule="floor")
        ours = mx_dequantize(q)
        assert _same(ours, _mx_reference(x, element)), name
        # torchao agrees except on blocks with the smallest scale (see the next test): the subnormal case in FP8.
        spec_only = (q.scale_e8m0 == 0).repeat_interleave(32, dim=-1) & (x != 0)
        assert _same(ours[~spec_only], _torchao_to_mx(x, element)[2][~spec_only]), name
        if name == "nan":  # E8M0's NaN scale: the whole block, and only it
            assert ours[:, :32].isnan().all() and not ours[:, 32:].isnan().any()
        if name in ("inf", "-inf"):  # the inf survives (the product overflows), its finite neighbours round to 0
            assert torch.equal(ours[:, 5], x[:, 5]) and not ours.isnan().any()
        if name == "all_zero":
            assert torch.equal(ours[:, :32], x[:, :32])
        if name == "fp32_subnormal":  # FP4 flushes these to 0, FP8 keeps a few bits of them
            assert ours.isfinite().all() and (ours[:, :32] != 0).any() == (element != "fp4_e2m1")
    on_grid = torch.tensor([[0.5, -1.0, 1.5, 6.0] * 8]) * 2.0**-20  # amax at the format's max: exact
    if element == "fp4_e2m1":
        assert torch.equal(mx_dequantize(mx_quantize(on_grid, element, scale_rule="floor")), on_grid)
        assert torch.equal(mx_dequantize(mx_quantize(on_grid, element)), on_grid)


def test_mx_smallest_scale_follows_the_spec_where_torchao_halves_the_block() -> None:
    # A block whose scale is E8M0's smallest, 2**-127: the spec divides by 2**-127. torchao divides by 2**-126 (a
    # Triton subnormal workaround) but multiplies back by 2**-127, so its values come back halved.
    x = torch.tensor([[2.0**-125, -2.0**-126, 3 * 2.0**-127, 2.0**-126] * 8])
    q = mx_quantize(x, "fp4_e2m1", scale_rule="floor")
    assert int(q.scale_e8m0[0, 0]) == 0
    ours = mx_dequantize(q)
    assert _same(ours, _mx_reference(x, "fp4_e2m1"))
    assert torch.equal(ours, x)  # 4, -2, 3 and 2 (times 2**-127) are E2M1 values
    assert torch.equal(_torchao_to_mx(x, "fp4_e2m1")[2], x / 2)


# ---------------------------------------------------------------------------------------------------------------
# NVFP4 vs torchao's nvfp4_quantize / NVFP4Tensor (two-level: per_tensor_amax_to_scale)
# ---------------------------------------------------------------------------------------------------------------

def _torchao_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """torchao's NVFP4Tensor dequantized, each x[i] with its own per-tensor scale (the per-expert (E, 1, 1) form)."""
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    scale = nv.per_tensor_amax_to_scale(x.abs().amax(dim=(1, 2), keepdim=True))
    return nv.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale).dequantize(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_equals_torchao_on_1000_random_tensors(dtype: torch.dtype) -> None:
    x = _random_batch(N_TENSORS, (4, 64), seed=2).to(dtype)
    ref = _torchao_nvfp4(x)
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    ref_scales, _ = nv.nvfp4_quantize(x, 16, nv.per_tensor_amax_to_scale(x.abs().amax(dim=(1, 2), keepdim=True)))
    agree = sum(_same(_nvfp4_torchao_variant(x[i]), ref[i]) for i in range(N_TENSORS))
    assert agree == N_TENSORS
    scales = torch.stack([nvfp4_quantize(x[i], block_scale_floor="e4m3_tiny").block_scale.float().reshape(4, 4)
                          for i in range(N_TENSORS)])
    assert torch.equal(scales, ref_scales.float().reshape(N_TENSORS, 4, 4))


def _nvfp4_torchao_variant(x: torch.Tensor, tile: tuple[int, int] = (1, 16)) -> torch.Tensor:
    return nvfp4_dequantize(nvfp4_quantize(x, tile=tile, block_scale_floor="e4m3_tiny"), x.dtype)


def test_nvfp4_edge_cases_equal_torchao_except_the_all_zero_tensor() -> None:
    cases = _edge_cases(2688.0)  # amax = 448 * 6: the largest block scale, exactly
    for name, x in cases.items():
        ours = _nvfp4_torchao_variant(x)
        assert _same(ours, _nvfp4_reference(x, (1, 16))), name
        if name != "all_zero":
            assert _same(ours, _torchao_nvfp4(x.unsqueeze(0))[0]), name
        if name in ("nan", "inf", "-inf"):  # the tensor scale is non-finite: nothing comes back finite
            assert not ours.isfinite().any()
            assert not fake_quantize(x, "nvfp4").isfinite().any()  # TE's arithmetic (the default) too
    zero = torch.zeros(4, 64)
    assert torch.equal(_nvfp4_torchao_variant(zero), zero)  # torchao: 0 / 0 tensor scale, NaN everywhere
    assert torch.equal(fake_quantize(zero, "nvfp4"), zero)
    assert _torchao_nvfp4(zero.unsqueeze(0)).isnan().all()
    on_grid = torch.tensor([[0.5, -1.0, 1.5, 6.0] * 16]) * 448  # tensor amax 2688: scales 1 and 448, exact
    assert torch.equal(_nvfp4_torchao_variant(on_grid), on_grid)
    assert torch.equal(fake_quantize(on_grid, "nvfp4"), on_grid)


def test_nvfp4_weights_use_16x16_tiles_as_the_reference_and_commute_with_transpose() -> None:
    g = torch.Generator().manual_seed(3)
    for i in range(20):
        w = torch.randn(32, 48, generator=g) * torch.exp2(torch.randn(32, 1, generator=g) * 3)
        ours = _nvfp4_torchao_variant(w, (16, 16))
        assert _same(ours, _nvfp4_reference(w, (16, 16))), i
        assert torch.equal(_nvfp4_torchao_variant(w.T.contiguous(), (16, 16)), ours.T)
        te = fake_quantize(w, "nvfp4", role="weight")  # TE's arithmetic (the default) commutes as well
        assert torch.equal(fake_quantize(w.T.contiguous(), "nvfp4", role="weight"), te.T)
    # One scale per 16x16 tile: rows that differ only in magnitude share it (1x16 blocks would not).
    w = torch.ones(16, 16) * torch.linspace(0.1, 6.0, 16).unsqueeze(1)
    assert nvfp4_quantize(w, tile=(16, 16)).block_scale.numel() == 1
    assert not torch.equal(fake_quantize(w, "nvfp4", role="weight"), fake_quantize(w, "nvfp4", role="input"))


def test_nvfp4_four_over_six_scales_a_tile_to_4_where_that_errs_less() -> None:
    # Tensor amax 1: S_enc = 256 * 6 / 1. Tile 0 holds 1.0 and 0.8: mapped to 6, 0.8 -> 4.8 rounds to 4 (error 0.133);
    # mapped to 4 (block scale 384 = 1.5 * 256), 0.8 -> 3.2 rounds to 3 (error 0.05): 4 wins. Tile 1 holds 1.0 and
    # 0.5, exact either way: the tie keeps 6 (block scale 256).
    x = torch.tensor([[1.0, 0.8] * 8 + [1.0, 0.5] * 8])
    q = nvfp4_quantize(x, four_over_six=True)
    assert q.block_scale.float().flatten().tolist() == [384.0, 256.0]
    assert nvfp4_dequantize(q).tolist() == [[1.0, 0.75] * 8 + [1.0, 0.5] * 8]
    plain = nvfp4_dequantize(nvfp4_quantize(x))  # map-to-6 only: 0.8 -> 4 / 6
    assert plain[0, 1].item() == pytest.approx(2 / 3) and plain[0, 17].item() == 0.5
    # On Gaussian data the chosen tiles lower the total error (arXiv 2512.02010; experiments/four_over_six.py).
    g = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    err = {k: (nvfp4_dequantize(nvfp4_quantize(g, four_over_six=k)) - g).abs().sum() for k in (False, True)}
    assert err[True] < err[False]
    mse = nvfp4_dequantize(nvfp4_quantize(g, four_over_six=True, four_over_six_error="mse"))
    assert (mse - g).square().sum() < (nvfp4_dequantize(nvfp4_quantize(g, four_over_six=True)) - g).square().sum()


@pytest.mark.parametrize("tile", [(1, 16), (16, 16)])
def test_nvfp4_and_mx_pad_ragged_shapes_with_zeros_as_the_references(tile: tuple[int, int]) -> None:
    x = torch.randn(21, 40, generator=torch.Generator().manual_seed(5))
    padded = torch.nn.functional.pad(x, (0, 24, 0, 11))  # (32, 64): whole 16x16 tiles and 32-blocks
    q = nvfp4_quantize(x, tile=tile)
    assert nvfp4_dequantize(q).shape == x.shape
    assert torch.equal(nvfp4_dequantize(q), nvfp4_dequantize(nvfp4_quantize(padded, tile=tile))[:21, :40])
    for rule in ("rceil", "floor"):
        m = mx_quantize(x, "fp8_e4m3", scale_rule=rule)
        assert m.scale_e8m0.shape == (21, 2)
        full = mx_quantize(padded, "fp8_e4m3", scale_rule=rule)
        assert torch.equal(mx_dequantize(m), mx_dequantize(full)[:21, :40])


# ---------------------------------------------------------------------------------------------------------------
# Blockwise FP8 vs TransformerEngine's formulas
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockwise_inputs_and_grads_equal_te_formula_per_1x128_tile(dtype: torch.dtype) -> None:
    x = _random_batch(250, (2, 256), seed=4).to(dtype)
    for role in ("input", "grad"):
        assert _same(fake_quantize(x, "blockwise", role=role), _te_blockwise_reference(x, (1, 128))), role
    x = x[:20]
    q = blockwise_quantize(x, power_2_scale=False)  # DeepSeek-V3's amax / 448 scales
    ours = (q.data.float() * q.scale_inv).reshape(x.shape).to(dtype)
    assert _same(ours, _te_blockwise_reference(x, (1, 128), pow2=False))


def test_blockwise_weights_equal_te_formula_per_128x128_block_with_padding() -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(256, 256, generator=g) * torch.exp2(torch.randn(256, 1, generator=g) * 4)
    assert _same(fake_quantize(w, "blockwise", role="weight"), _te_blockwise_reference(w, (128, 128)))
    odd = torch.randn(130, 200, generator=g)  # partial blocks: zero-padded, as TE does
    ours = fake_quantize(odd, "blockwise", role="weight")
    assert ours.shape == odd.shape and _same(ours, _te_blockwise_reference(odd, (128, 128)))


def test_blockwise_edge_cases_equal_te_formula() -> None:
    for name, x in _edge_cases(448.0).items():
        x = torch.cat([x, x], dim=-1)  # 128 wide: the case fills half of each tile
        ours = fake_quantize(x, "blockwise")
        assert _same(ours, _te_blockwise_reference(x, (1, 128))), name
        if name in ("nan", "inf", "-inf"):
            assert ours.isnan().all()
        else:
            assert ours.isfinite().all(), name
    on_grid = torch.tensor([448.0, -0.5, 2.0**-9, 240.0] * 32)  # amax 448: scale 1, E4M3 values come back exactly
    assert torch.equal(fake_quantize(on_grid, "blockwise"), on_grid)
    ties = torch.tensor([448.0, 1.0625, -1.1875, 232.0, 3 * 2.0**-10] * 25 + [0.0] * 3)  # E4M3 midpoints: to even
    assert torch.equal(fake_quantize(ties, "blockwise"), torch.tensor([448.0, 1.0, -1.25, 224.0, 2.0**-8] * 25
                                                                      + [0.0] * 3))
    assert torch.equal(blockwise_scale(torch.tensor([0.0, 3.5, 448.0, 1e-40])),
                       torch.tensor([1.0, 128.0, 1.0, torch.finfo(torch.float32).max]).view(torch.int32)
                       .bitwise_and(0x7F800000).view(torch.float32))


def test_current_recipe_is_one_scale_per_tensor() -> None:
    x = _random_batch(1, (4, 64), seed=6)[0]
    scale = np.float32(448.0) / np.float32(x.abs().max().item())
    expected = _nearest_even((x.numpy() * scale).astype(np.float32), "fp8_e4m3").astype(np.float32) / scale
    assert _same(fake_quantize(x, "current"), torch.from_numpy(expected.astype(np.float32)))
    scale = np.float32(57344.0) / np.float32(x.abs().max().item())
    expected = _nearest_even((x.numpy() * scale).astype(np.float32), "fp8_e5m2").astype(np.float32) / scale
    assert _same(fake_quantize(x, "current", role="grad"), torch.from_numpy(expected.astype(np.float32)))


@pytest.mark.parametrize("role", ["input", "grad"])
@pytest.mark.parametrize("bad", [INF, -INF, NAN])
def test_current_recipe_turns_a_tensor_with_a_non_finite_amax_into_nan_throughout(role: QuantRole, bad: float) -> None:
    # As torchao and TransformerEngine: the scale 448 / inf (or / NaN) poisons every element, not only the bad one
    # (it kept the finite ones at scale 1: [1e-3, 0.3, 1000, inf] gave [0.00195, 0.3125, 448, nan]).
    x = torch.tensor([[1e-3, 0.3, 1000.0, bad]])
    assert fake_quantize(x, "current", role=role).isnan().all()


def test_fp8_linear_current_recipe_poisons_the_whole_product_like_fake_quantize() -> None:
    from lit_mpstable.fp8 import FP8Config, FP8Linear

    layer = FP8Linear(16, 16, config=FP8Config(recipe="current", emulate=True))
    x = torch.randn(4, 16)
    x[1, 2] = INF
    assert layer(x).isnan().all()  # not only row 1: every element of x went NaN with the tensor's scale


def test_block_recipes_poison_the_non_finite_block_only_where_the_reference_does() -> None:
    # A NaN poisons its block (blockwise: its 1x128 tile; MX: its 32 elements) or, for NVFP4, the tensor (its FP32
    # tensor scale); an inf poisons its blockwise tile and the NVFP4 tensor, while MX follows torchao: the inf
    # survives, its block's finite neighbours round to 0, other blocks are untouched.
    x = torch.linspace(-2, 2, 256).reshape(1, 256)
    for bad in (NAN, INF):
        y = x.clone()
        y[0, 3] = bad
        blockwise = fake_quantize(y, "blockwise")
        assert blockwise[:, :128].isnan().all() and not blockwise[:, 128:].isnan().any()
        assert fake_quantize(y, "nvfp4").isnan().all()
        for recipe in ("mxfp8", "mxfp4"):
            mx = fake_quantize(y, recipe)
            assert not mx[:, 32:].isnan().any()
            if bad != bad:
                assert mx[:, :32].isnan().all()
            else:
                block = mx[0, :32]
                assert block[3] == INF and (block != INF).sum() == 31 and (block[block != INF] == 0).all()


@pytest.mark.parametrize("recipe", ["current", "blockwise", "mxfp4", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fake_quantize_keeps_dtype_and_shape(recipe: QuantRecipe, dtype: torch.dtype) -> None:
    x = torch.randn(2, 16, 64).to(dtype)
    for role in ("input", "weight", "grad"):
        y = fake_quantize(x, recipe, role=role, generator=torch.Generator().manual_seed(0))
        assert y.dtype == dtype and y.shape == x.shape and y.isfinite().all()
        assert (y.float() - x.float()).norm() <= 0.2 * x.float().norm()


@pytest.mark.parametrize("recipe", ["current", "blockwise", "mxfp4", "mxfp8", "nvfp4"])
def test_fake_quantize_passes_the_gradient_straight_through_and_reads_nothing_on_the_host(recipe: QuantRecipe) -> None:
    from helpers import HostReads

    x = torch.randn(16, 128, requires_grad=True)
    for role in ("input", "weight", "grad"):
        with HostReads() as reads:
            y = fake_quantize(x, recipe, role=role)
        assert reads.ops == [], (role, reads.ops)
        assert torch.equal(y, fake_quantize(x.detach(), recipe, role=role)) or role == "grad"
        (grad,) = torch.autograd.grad(y, x, torch.arange(x.numel(), dtype=torch.float32).reshape(x.shape))
        assert torch.equal(grad, torch.arange(x.numel(), dtype=torch.float32).reshape(x.shape))


# ---------------------------------------------------------------------------------------------------------------
# Stochastic rounding (NVFP4 gradients)
# ---------------------------------------------------------------------------------------------------------------

def test_nvfp4_stochastic_rounding_is_unbiased_over_1e5_draws_and_nearest_even_is_not() -> None:
    # Each 16-block's amax is 6 times an E4M3 value and the tensor's is 6 * 448, so every scale is exact and no
    # element saturates: E[draw] = x exactly. (Where a block's E4M3 scale rounds down, its largest element saturates
    # at 6, deterministically, in torchao and TE alike: stochastic rounding is unbiased inside the range.)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, 16, generator=g)
    top = torch.tensor([448.0, 64.0, 2.0, 0.125]).unsqueeze(1) * 6
    x = x / x.abs().amax(dim=1, keepdim=True) * top
    x[torch.arange(4), x.abs().argmax(dim=1)] = top[:, 0]
    x = x.reshape(1, 64)
    draws = x.expand(100_000, 64)  # one tensor scale and the same block scales per row: 1e5 independent draws
    sr = fake_quantize(draws, "nvfp4", role="grad", generator=torch.Generator().manual_seed(9))
    mean, std = sr.double().mean(dim=0), sr.double().std(dim=0)
    bias = mean - x[0].double()
    assert bias.abs().mean() / x.abs().mean() < 1e-3  # |mean error| relative to the mean magnitude
    standard_error = std / math.sqrt(100_000)
    assert (bias.abs() <= 6 * standard_error).all()  # per element, within 6 standard errors of x
    assert ((sr == sr.amax(dim=0)) | (sr == sr.amin(dim=0))).all()  # only the two neighbours of x
    assert ((sr.amin(dim=0) <= x[0]) & (x[0] <= sr.amax(dim=0))).all()
    rne = fake_quantize(x, "nvfp4", role="input")[0].double()
    assert ((rne - x[0].double()).abs() > 6 * standard_error).sum() > 32  # rounding to nearest: biased


def test_stochastic_rounding_repeats_by_seed() -> None:
    x = torch.randn(8, 64)
    first = fake_quantize(x, "nvfp4", role="grad", generator=torch.Generator().manual_seed(1))
    again = fake_quantize(x, "nvfp4", role="grad", generator=torch.Generator().manual_seed(1))
    other = fake_quantize(x, "nvfp4", role="grad", generator=torch.Generator().manual_seed(2))
    assert torch.equal(first, again) and not torch.equal(first, other)
    torch.manual_seed(3)
    a = fake_quantize(x, "nvfp4", role="grad")
    torch.manual_seed(3)
    assert torch.equal(a, fake_quantize(x, "nvfp4", role="grad"))  # None: the default generator
    g = torch.Generator().manual_seed(1)  # inputs and weights round to nearest: no draw, no generator needed
    assert torch.equal(fake_quantize(x, "nvfp4", generator=g), fake_quantize(x, "nvfp4"))


def test_stochastic_rounding_noise_drawn_outside_equals_the_generator_path() -> None:
    # One draw per element in x's order, so noise drawn by the caller (torch.compile cannot trace a generator)
    # reproduces the seeded path exactly.
    x = torch.randn(8, 64)
    noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(1))
    q = nvfp4_quantize(x, stochastic=True, noise=noise)
    assert torch.equal(nvfp4_dequantize(q), fake_quantize(x, "nvfp4", role="grad",
                                                          generator=torch.Generator().manual_seed(1)))
    ones = nvfp4_dequantize(nvfp4_quantize(x, stochastic=True, noise=torch.full_like(x, 1 - 2**-24)))
    zeros = nvfp4_dequantize(nvfp4_quantize(x, stochastic=True, noise=torch.zeros_like(x)))
    assert (zeros.abs() >= ones.abs()).all() and (zeros.abs() > ones.abs()).any()  # u = 0 rounds every value up


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "role"), [("blockwise", "weight"), ("mxfp4", "input"), ("nvfp4", "weight"),
                                              ("nvfp4", "grad")])
def test_fake_quantize_compiles_without_graph_breaks_and_matches_eager(recipe: QuantRecipe, role: QuantRole) -> None:
    torch._dynamo.reset()
    x = _random_batch(8, (16, 128), seed=10)
    compiled = torch.compile(lambda t: fake_quantize(t, recipe, role=role), fullgraph=True, backend="aot_eager")
    torch.manual_seed(0)
    out = compiled(x)
    torch.manual_seed(0)
    assert torch.equal(out, fake_quantize(x, recipe, role=role))


# ---------------------------------------------------------------------------------------------------------------
# Random Hadamard transform
# ---------------------------------------------------------------------------------------------------------------

def test_hadamard_is_orthogonal_involutive_and_random_signs_repeat_by_seed() -> None:
    h = hadamard_matrix(16)
    assert (h @ h.T - torch.eye(16)).abs().max() < 1e-6
    assert (h @ h - torch.eye(16)).abs().max() < 1e-6  # symmetric and its own inverse
    assert torch.equal(h.abs(), torch.full((16, 16), 0.25))
    signs = random_signs(16, generator=torch.Generator().manual_seed(4))
    assert torch.equal(signs, random_signs(16, generator=torch.Generator().manual_seed(4)))
    assert set(signs.tolist()) == {-1.0, 1.0}
    m = signs.unsqueeze(-1) * h
    assert (m @ m.T - torch.eye(16)).abs().max() < 1e-6
    eye = random_hadamard_transform(torch.eye(16), signs)
    assert torch.equal(eye, m)


def test_random_hadamard_transform_is_invertible_and_keeps_gemms_over_the_last_dim() -> None:
    g = torch.Generator().manual_seed(5)
    signs = random_signs(generator=g)
    a, b = torch.randn(24, 64, generator=g), torch.randn(40, 64, generator=g)
    ta, tb = random_hadamard_transform(a, signs), random_hadamard_transform(b, signs)
    back = random_hadamard_transform(ta, signs, inverse=True)
    assert (back - a).abs().max() / a.abs().max() < 1e-6
    assert ((ta.norm(dim=-1) - a.norm(dim=-1)).abs() / a.norm(dim=-1)).max() < 1e-6
    assert ((ta @ tb.T - a @ b.T).abs().max() / (a @ b.T).abs().max()) < 1e-6
    assert not torch.allclose(ta, a)
    # Blockwise: each 16 elements mix only with their own block.
    one_block = torch.zeros(1, 64)
    one_block[0, 16:32] = 1.0
    assert (random_hadamard_transform(one_block, signs)[0, :16] == 0).all()
    assert random_hadamard_transform(a.bfloat16(), signs).dtype == torch.bfloat16


@pytest.mark.parametrize(("recipe", "role", "shape"), [("mxfp4", "input", (4, 48)), ("nvfp4", "input", (4, 40)),
                                                   ("nvfp4", "weight", (24, 64)), ("mxfp8", "grad", (3, 50))])
def test_fake_quantize_pads_ragged_inputs_as_the_references(recipe: str, role: str, shape: tuple[int, int]) -> None:
    # Partial blocks are zero-padded (zeros raise no block amax, nor the NVFP4 tensor amax) and the padding dropped,
    # never refused (DESIGN, round 4); the values equal those of the explicitly padded tensor.
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    padded = torch.zeros(32 * -(-shape[0] // 32), 32 * -(-shape[1] // 32))
    padded[: shape[0], : shape[1]] = x
    ours = fake_quantize(x, recipe, role=role, generator=torch.Generator().manual_seed(0))
    assert ours.shape == x.shape
    ref = fake_quantize(padded, recipe, role=role, generator=torch.Generator().manual_seed(0))
    if role != "grad":  # stochastic draws follow the element order, which padding shifts
        assert torch.equal(ours, ref[: shape[0], : shape[1]])
    assert torch.isfinite(ours).all() and (ours != 0).any()


# ---------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: fake_quantize(torch.randn(4, 64), "fp4"), ValueError, ["recipe='fp4'", "nvfp4"]),  # type: ignore[arg-type]  # invalid on purpose
        (lambda: fake_quantize(torch.randn(4, 64), "nvfp4", role="activation"), ValueError, ["role='activation'"]),  # type: ignore[arg-type]  # invalid on purpose
        (lambda: fake_quantize(torch.ones(4, 64, dtype=torch.int32), "mxfp4"), TypeError, ["torch.int32"]),
        (lambda: fake_quantize([1.0] * 32, "mxfp4"), TypeError, ["list"]),  # type: ignore[arg-type]  # invalid on purpose
        (lambda: fake_quantize(torch.tensor(1.0), "current"), ValueError, ["at least one dim"]),
        (lambda: fake_quantize(torch.randn(4, 64), "nvfp4", role="grad", generator=0), TypeError, ["generator=0"]),  # type: ignore[arg-type]  # invalid on purpose
        (lambda: mx_quantize(torch.randn(4, 64), "fp6_e2m3"), ValueError, ["element='fp6_e2m3'"]),  # type: ignore[arg-type]  # invalid on purpose
        (lambda: nvfp4_quantize(torch.randn(32, 32), tile=(8, 8)), ValueError, ["tile=(8, 8)"]),
        (lambda: mx_quantize(torch.randn(4, 64), "fp8_e4m3", scale_rule="ceil"), ValueError,  # type: ignore[arg-type]  # invalid on purpose
         ["scale_rule='ceil'", "rceil", "floor"]),
        (lambda: nvfp4_quantize(torch.randn(4, 64), block_scale_floor="tiny"), ValueError,  # type: ignore[arg-type]  # invalid on purpose
         ["block_scale_floor='tiny'", "e4m3_tiny"]),
        (lambda: nvfp4_quantize(torch.randn(4, 64), block_scale_floor="e4m3_tiny", four_over_six=True), ValueError,
         ["four_over_six=True", "block_scale_floor=None"]),
        (lambda: nvfp4_quantize(torch.randn(4, 64), four_over_six=True, four_over_six_error="max"), ValueError,  # type: ignore[arg-type]  # invalid on purpose
         ["four_over_six_error='max'", "mae", "mse"]),
        (lambda: nvfp4_quantize(torch.randn(4, 64), tensor_scale=torch.tensor(1.0)), ValueError,
         ["tensor_scale", "global_amax"]),
        (lambda: blockwise_quantize(torch.randn(4, 128), tile=(1, 64)), ValueError, ["tile=(1, 64)"]),
        (lambda: nvfp4_quantize(torch.randn(4, 64), stochastic=True, noise=torch.rand(64)), ValueError,
         ["noise of shape (64,)", "(4, 64)"]),
        (lambda: random_hadamard_transform(torch.randn(4, 40), random_signs()), ValueError, ["multiple of 16"]),
        (lambda: random_hadamard_transform(torch.randn(4, 48), torch.ones(12)), ValueError, ["power-of-two"]),
        (lambda: hadamard_matrix(12), ValueError, ["n=12", "power of two"]),
    ],
)
def test_bad_input_is_a_named_error(call, error: type, words: list[str]) -> None:
    with pytest.raises(error) as info:
        call()
    for word in words:
        assert word in str(info.value), (word, str(info.value))

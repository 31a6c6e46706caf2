"""The C loop of compact weights' fused Adam step (lit_mpstable.core.weights.compact_fused.native_kernel) against the
compiled kernel and the eager rounding."""

from __future__ import annotations

import pytest
import torch

from lit_mpstable.core.weights import compact_fused as fused
from lit_mpstable.core.weights.compact_fused import FusedAdam
from lit_mpstable.core.weights.compact_rounding import noise_bits, round_stochastic_

GROUP = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "decoupled_weight_decay": True}
N = 3 * 16384 + 37  # several of the loop's chunks, and a tail of no vector width


def _tensors(mode: str, n: int = N, seed: int = 0) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g).bfloat16()
    grad = torch.randn(n, generator=g).bfloat16()
    w[:3] = torch.tensor([float("inf"), -float("inf"), float("nan")])  # non-finite values pass through as compiled
    grad[3:6] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    return [w, (w.float() * 2.0**-9).bfloat16() if mode == "kahan" else None, grad,
            (torch.randn(n, generator=g) * 0.1).bfloat16(), (torch.rand(n, generator=g) * 0.01).bfloat16()]


def _native() -> fused.NativeKernel:
    native = fused.native_kernel()
    assert native is not None  # CI and development machines have a C compiler
    return native


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int16) == b.view(torch.int16)) | (a.isnan() & b.isnan())


@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
@pytest.mark.parametrize("plain", [True, False])
def test_the_c_loop_writes_the_compiled_kernels_words_but_for_ties(mode: str, plain: bool) -> None:
    # The same arithmetic in the same order (no fused multiply-add on either side); where the compiled kernel's float
    # formulation rounds a tie to even (one draw in 65536 per value), the C loop adds and truncates: an ulp apart.
    scalars = FusedAdam.scalars({**GROUP, "decoupled_weight_decay": plain}, 3.0, torch.tensor(0.5), None if plain
                                else 0.5)
    key = torch.tensor(-12345, dtype=torch.int32)
    native, compiled = _tensors(mode), _tensors(mode)
    assert fused.native_takes(*native, scalars, key)  # type: ignore[arg-type]
    _native()(*native, scalars, key, plain)
    kernel = FusedAdam()
    (kernel._plain_kernel if plain else kernel._kernel)(*compiled, scalars, key)
    assert not torch.equal(native[0], _tensors(mode)[0])  # it stepped
    for a, b in zip(native, compiled):
        if a is None or b is None:
            continue
        same = _same(a, b)
        assert int((~same).sum()) <= max(4, N // 8192), int((~same).sum())
        ulp = torch.finfo(torch.bfloat16).eps * b.float().abs()
        assert bool(((a.float() - b.float()).abs()[~same] <= ulp[~same] + 2.0**-133).all())


def test_the_c_loop_rounds_a_moment_exactly_as_the_eager_bit_trick() -> None:
    # exp_avg_sq = v * beta2 + (1 - beta2) * g * g has no lerp: eager FP32 arithmetic gives its very value, and its
    # stochastic rounding with the element keys' bits (noise_bits) must be the C loop's, every bit, ties included.
    w, _, grad, m, v = _tensors("stochastic", seed=1)
    assert w is not None and grad is not None and m is not None and v is not None
    scalars = FusedAdam.scalars(GROUP, 5.0, torch.tensor(1.0), None)
    value = v.float() * scalars[5] + scalars[6] * grad.float() * scalars[0] * grad.float() * scalars[0]
    expected = round_stochastic_(torch.empty_like(v), value, noise_bits(N, 777, v.device, torch.bfloat16))
    _native()(w, None, grad, m, v, scalars, torch.tensor(777, dtype=torch.int32), True)
    assert bool(_same(v, expected).all())


def test_threads_change_no_bit() -> None:
    # The loop splits into chunks over OpenMP threads; each element's words depend on its own key only.
    words = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            tensors = _tensors("stochastic", n=8 * 16384 + 5)
            scalars = FusedAdam.scalars(GROUP, 2.0, torch.tensor(1.0), None)
            _native()(*tensors, scalars, torch.tensor(5, dtype=torch.int32), True)
            words.append([t.view(torch.int16).clone() for t in tensors if t is not None])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*words))


def test_what_the_c_loop_does_not_take() -> None:
    w, comp, g, m, v = _tensors("kahan", n=64)
    assert w is not None and g is not None and m is not None and v is not None
    scalars = FusedAdam.scalars(GROUP, 1.0, torch.tensor(1.0), None)
    key = torch.tensor(0, dtype=torch.int32)
    assert fused.native_takes(w, comp, g, m, v, scalars, key)
    assert not fused.native_takes(w.half(), comp, g, m, v, scalars, key)
    assert not fused.native_takes(w, comp, g[:32], m, v, scalars, key)
    assert not fused.native_takes(w, comp, g.view(8, 8).t(), m, v, scalars, key)
    assert not fused.native_takes(w, comp, g, m, v, scalars.double(), key)
    assert not fused.native_takes(w, comp, g, m, v, scalars, key.long())

    class Wrapped(torch.Tensor):  # a subclass (a DTensor, say): its pointer need not be its data
        pass

    assert not fused.native_takes(w.as_subclass(Wrapped), comp, g, m, v, scalars, key)


def test_without_a_compiler_or_when_turned_off_there_is_no_c_loop(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("LIT_MPSTABLE_NATIVE", "0")
    assert fused.native_kernel() is None
    monkeypatch.delenv("LIT_MPSTABLE_NATIVE")
    monkeypatch.setattr(fused, "_compiler", lambda: None)
    fused._load_native.cache_clear()
    try:
        assert fused.native_kernel() is None
        monkeypatch.undo()  # a compiler that fails: no library, no exception
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
        monkeypatch.setattr(fused, "SOURCE", "this is not C")
        fused._load_native.cache_clear()
        assert fused.native_kernel() is None
        assert not list(tmp_path.rglob("*.so"))
    finally:
        monkeypatch.undo()
        fused._load_native.cache_clear()
    assert fused.native_kernel() is not None


def test_a_compiler_without_openmp_or_march_native_still_builds_the_loop(monkeypatch, tmp_path) -> None:
    # The build tries -fopenmp, then without it (Apple's clang), then without -march=native: a compiler that refuses
    # both still gives a loop, and its words are the OpenMP build's.
    real = fused._compiler()
    assert real is not None
    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\ncase "$*" in *-fopenmp*|*-march=native*) exit 1;; esac\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    expected = _tensors("stochastic")
    scalars = FusedAdam.scalars(GROUP, 2.0, torch.tensor(1.0), None)
    key = torch.tensor(9, dtype=torch.int32)
    _native()(*expected, scalars, key, True)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    fused._load_native.cache_clear()
    try:
        built = fused.native_kernel()
        assert built is not None
        assert [p.name.startswith("adam_bf16_") for p in (tmp_path / "cache").rglob("*.so")] == [True]
        got = _tensors("stochastic")
        built(*got, scalars, key, True)
    finally:
        monkeypatch.undo()
        fused._load_native.cache_clear()
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got, expected) if a is not None)

"""The CPU build of the fused Adam step of compact weights: a small C loop, compiled once per machine and loaded.

Inductor's C++ for :func:`~lit_mpstable.core.weights.compact_adam._adam` loads BF16 data in vectors of 32 elements, and
in torch 2.13 it converts 32 int32 lanes to FP32 (the random bits of the stochastic rounding) and reinterprets bits one
element at a time (``VecConvert<float, 2, int32_t, 2>`` has no vector specialization): those conversions took about
half the kernel's time. Written as a plain C loop, the same arithmetic vectorizes whole (GCC and Clang at ``-O3``),
and the rounding is the bit trick itself (:func:`~lit_mpstable.core.weights.compact_rounding.round_stochastic_`, ties
included). Measured over the memory bench MLP's 2.9M BF16 weights (Intel Xeon, AVX-512, one thread,
``bench/bench_adam_kernel.py``): the compiled kernel at 1.11x / 1.32x torch's own AdamW step (``"kahan"`` /
``"stochastic"``), the C loop at 0.44x / 0.30x.

The numbers are the compiled kernel's: torch's Adam arithmetic in FP32, operation for operation, with
``-ffp-contract=off`` (no fused multiply-add the compiled kernel does not make: its lerp rounds twice, as torch's
decomposition of ``torch.lerp`` writes it), the same element keys and :func:`hash32`. Where the compiled kernel's
float formulation rounds a tie to even (one draw in 65536), this loop adds and truncates as the eager rounding does.

It is built with the C compiler inductor would use (``$CC``, else ``cc``/``gcc``/``clang``), ``-O3 -march=native``
and OpenMP when the compiler has it, into inductor's cache folder, keyed by the source, the flags and this CPU's
feature flags (a cache shared by machines of other kinds builds its own copy). Without a compiler, or when the build
fails, :func:`kernel` returns ``None`` and the compiled kernel steps as before. ``LIT_MPSTABLE_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable

import torch

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float bf2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
/* Round to nearest even, NaN to the quiet NaN: c10::BFloat16's conversion. */
static inline uint16_t rne(float f) {
    uint32_t u = f2u(f);
    uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return f != f ? (uint16_t)0x7FC0 : r;
}
/* 16 random bits added to the low half, then truncation: round_stochastic_'s bit trick. */
static inline uint16_t sr(float f, uint32_t k) { return (uint16_t)((f2u(f) + k) >> 16); }
/* lowbias32, as hash32 */
static inline uint32_t hash32(uint32_t x) {
    x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; x ^= x >> 16; return x;
}

/* _adam in compact_fused.py, operation for operation; KAHAN and PLAIN are constants, so each loop is branch-free. */
#define BODY(KAHAN, PLAIN) \
    for (uint32_t j = 0; j < len; j++) { \
        float value = KAHAN ? bf2f(w[j]) + bf2f(comp[j]) : bf2f(w[j]); \
        float grad = bf2f(g[j]) * s0; \
        value = value * s2; \
        if (!PLAIN) { \
            grad = grad < -s1 ? -s1 : (grad > s1 ? s1 : grad); \
            grad = s3 != 0.0f ? grad + value * s3 : grad; \
        } \
        float mf = bf2f(m[j]); \
        float exp_avg = coeff * (grad - mf) + (big ? grad : mf); \
        float exp_avg_sq = bf2f(v[j]) * s5 + s6 * grad * grad; \
        float denom = sqrtf(exp_avg_sq) / s7 + s8; \
        value = value + s9 * exp_avg / denom; \
        uint32_t k = hash32(base + j) >> 16; \
        if (KAHAN) { uint16_t r = rne(value); w[j] = r; comp[j] = rne(value - bf2f(r)); } \
        else { w[j] = sr(value, k); } \
        m[j] = sr(exp_avg, k); \
        v[j] = sr(exp_avg_sq, k); \
    }

static void block(uint16_t *restrict w, uint16_t *restrict comp, const uint16_t *restrict g, uint16_t *restrict m,
                  uint16_t *restrict v, uint32_t len, const float *s, uint32_t base, int plain) {
    const float s0 = s[0], s1 = s[1], s2 = s[2], s3 = s[3], s4 = s[4], s5 = s[5], s6 = s[6], s7 = s[7];
    const float s8 = s[8], s9 = s[9];
    const int big = fabsf(s4) >= 0.5f;  /* torch's lerp: weight - 1 and the end as base from 0.5 up */
    const float coeff = big ? s4 - 1.0f : s4;
    if (comp) { if (plain) { BODY(1, 1) } else { BODY(1, 0) } }
    else { if (plain) { BODY(0, 1) } else { BODY(0, 0) } }
}

#define CHUNK 16384
void lmp_adam_bf16(uint16_t *w, uint16_t *comp, const uint16_t *g, uint16_t *m, uint16_t *v, int64_t n,
                   const float *scalars, const int32_t *key, int plain, int threads) {
    int64_t chunks = (n + CHUNK - 1) / CHUNK;
    uint32_t first = (uint32_t)*key;
    (void)threads;
#ifdef _OPENMP
    #pragma omp parallel for schedule(static) num_threads(threads) if(threads > 1 && chunks > 4)
#endif
    for (int64_t c = 0; c < chunks; c++) {
        int64_t lo = c * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
        block(w + lo, comp ? comp + lo : 0, g + lo, m + lo, v + lo, (uint32_t)(hi - lo), scalars,
              first + (uint32_t)lo, plain);
    }
}
"""

_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")
_POINTER = ctypes.c_void_p

Kernel = Callable[..., None]


def kernel() -> Kernel | None:
    """The loaded step ``(w, comp, g, m, v, scalars, key, plain)`` over flat contiguous CPU tensors (BF16 but the
    FP32 scalars and the 0-d int32 key, read in C: no host read in torch's sense), or ``None`` where it cannot be
    built (then the compiled kernel steps). Built at the first call on a machine (0.2-2.5 s measured), then loaded
    from the cache."""
    if os.environ.get("LIT_MPSTABLE_NATIVE", "1") == "0":
        return None
    return _load()


@functools.cache
def _load() -> Kernel | None:
    compiler = _compiler()
    if compiler is None:
        return None
    portable = tuple(flag for flag in _FLAGS if flag != "-march=native")
    # A compiler without OpenMP (Apple's clang): one thread; one that does not know -march=native: the baseline ISA.
    for flags in (_FLAGS + ("-fopenmp",), _FLAGS, portable):
        path = _build(compiler, flags)
        if path is not None:
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            step = lib.lmp_adam_bf16
            step.restype = None
            step.argtypes = [_POINTER] * 5 + [ctypes.c_int64, _POINTER, _POINTER, ctypes.c_int, ctypes.c_int]
            return functools.partial(_call, step)
    return None


def _call(
    step: Callable[..., None], w: torch.Tensor, comp: torch.Tensor | None, g: torch.Tensor, m: torch.Tensor,
    v: torch.Tensor, scalars: torch.Tensor, key: torch.Tensor, plain: bool,
) -> None:
    step(
        w.data_ptr(), None if comp is None else comp.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), w.numel(),
        scalars.data_ptr(), key.data_ptr(), int(plain), torch.get_num_threads(),
    )


def takes(
    w: torch.Tensor, comp: torch.Tensor | None, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
    scalars: torch.Tensor, key: torch.Tensor,
) -> bool:
    """Whether the C loop can step these tensors: plain tensors (no subclass such as a DTensor, whose pointer is not
    its data) on the CPU and contiguous, the data BF16, the scalars FP32, the key int32 (what
    :class:`~lit_mpstable.core.weights.compact_fused.FusedSteps` passes; anything else takes the compiled kernel)."""
    data = (w, g, m, v) if comp is None else (w, comp, g, m, v)
    return (
        all(type(t) is torch.Tensor for t in (*data, scalars, key))
        and all(t.is_cpu and t.dtype == torch.bfloat16 and t.is_contiguous() for t in data)
        and all(t.numel() == w.numel() for t in data)
        and scalars.is_cpu and scalars.dtype == torch.float32 and scalars.is_contiguous()
        and scalars.numel() == 10 and key.is_cpu and key.dtype == torch.int32 and key.numel() == 1
    )


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _build(compiler: str, flags: tuple[str, ...]) -> str | None:
    folder = os.path.join(_cache_root(), "lit_mpstable_native")
    digest = hashlib.sha256("\0".join((SOURCE, compiler, *flags, _cpu_features())).encode()).hexdigest()[:20]
    path = os.path.join(folder, f"adam_bf16_{digest}.so")
    if os.path.exists(path):
        return path
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            source = os.path.join(scratch, "adam_bf16.c")
            with open(source, "w") as f:
                f.write(SOURCE)
            built = os.path.join(scratch, "adam_bf16.so")
            done = subprocess.run(
                [compiler, *flags, source, "-o", built], capture_output=True, timeout=120, check=False
            )
            if done.returncode != 0:
                return None
            os.replace(built, path)  # atomic: concurrent ranks each build, one file stays
    except (OSError, subprocess.SubprocessError):
        return None
    return path


def _cache_root() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return cache_dir()
    except ImportError:  # pragma: no cover - inductor ships with every torch this package supports
        return os.path.join(tempfile.gettempdir(), "lit_mpstable")


def _cpu_features() -> str:
    # -march=native builds for this CPU: the key tells machines apart that share a cache folder.
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {torch.backends.cpu.get_cpu_capability()}"

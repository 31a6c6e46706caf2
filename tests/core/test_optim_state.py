"""Compact Adam moments: FP32 equals torch's AdamW bit for bit, BF16 stochastic rounding is unbiased and seeded,
FP8 with dynamic range expansion meets its derived error bound and beats plain per-block E4M3, exact resume."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from lit_mpstable.core.weights.optim_state import (
    BLOCK_SIZE,
    MomentStore,
    adam_moments,
    adamw_step_,
    dequantize_moment,
    quantize_moment,
    state_bytes,
)

SHAPES = [(16, 16), (16,), (3, 100)]  # 300 elements: a partial last block


def _grads(steps: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) * 10.0 ** torch.randint(-3, 1, (), generator=g) for s in SHAPES]
            for _ in range(steps)]


def _run(kind: str, grads: list[list[torch.Tensor]], *, params=None, stores=None, first: int = 1, **hyper):
    params = params or [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(SHAPES)]
    stores = stores or [adam_moments(kind, p.shape, seed=7, index=i) for i, p in enumerate(params)]
    for t, step_grads in enumerate(grads, start=first):
        for p, g, (m, v) in zip(params, step_grads, stores):
            adamw_step_(p, g, m, v, step=t, **hyper)
    return params, stores


# ------------------------------------------------------------------------------------------------ fp32 kind
@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam-L2"])
def test_fp32_kind_equals_torch_adamw_bit_for_bit(decoupled: bool) -> None:
    grads = _grads(20)
    hyper = {"lr": 3e-3, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
    params, _ = _run("fp32", grads, decoupled_weight_decay=decoupled, **hyper)
    ref = [nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i))) for i, s in enumerate(SHAPES)]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(ref, lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, foreach=False)
    for step_grads in grads:
        for p, g in zip(ref, step_grads):
            p.grad = g.clone()
        opt.step()
    for mine, theirs in zip(params, ref):
        assert torch.equal(mine, theirs.detach())


# ------------------------------------------------------------------------------------------------ bf16
def test_bf16_stochastic_rounding_is_unbiased_where_nearest_is_not() -> None:
    g = torch.Generator().manual_seed(1)
    values = torch.exp(torch.empty(100).uniform_(-14, 7, generator=g)) * torch.sign(torch.randn(100, generator=g))
    values = values.bfloat16().float() * (1 + 0.4 * 2.0**-8)  # 0.4 BF16 ulp above a BF16 value: nearest rounds down
    x = values.repeat_interleave(1000)  # 1e5 draws, 1000 per value
    for rounding, low, high in (("stochastic", 0.0, 1e-3), ("nearest", 1e-3, 1.0)):
        stored = dequantize_moment(quantize_moment(x, "bf16", rounding=rounding, seed=3, step=5))
        bias = ((stored - x) / x.abs()).view(100, 1000).mean(dim=1).abs().max().item()
        assert low <= bias < high, (rounding, bias)


def test_bf16_rounding_is_reproducible_and_slice_invariant() -> None:
    x = torch.randn(1000)
    whole = quantize_moment(x, "bf16", seed=1, step=4, key=9)["value"]
    assert torch.equal(whole, quantize_moment(x, "bf16", seed=1, step=4, key=9)["value"])
    others = ({"seed": 2, "step": 4, "key": 9}, {"seed": 1, "step": 5, "key": 9}, {"seed": 1, "step": 4, "key": 10})
    for other in others:
        assert not torch.equal(whole, quantize_moment(x, "bf16", **other)["value"])
    tail = quantize_moment(x[300:], "bf16", seed=1, step=4, key=9, offset=300)["value"]
    assert torch.equal(whole[300:], tail)


def test_bf16_keeps_nan_and_inf() -> None:
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0])
    out = dequantize_moment(quantize_moment(x, "bf16"))
    assert out[0].isnan() and out[1] == math.inf and out[2] == -math.inf and torch.equal(out[3:], x[3:])


# ------------------------------------------------------------------------------------------------ fp8
def _heavy_tailed_moments(n: int = 128 * 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    # EMA-like moments of Student-t (df=3) gradients with per-block magnitudes spread over 4 decades.
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(n, generator=g)  # Student-t = normal / sqrt(chi2_3 / 3), drawn with the generator
    chi2 = (torch.randn(n, 3, generator=g) ** 2).sum(dim=1)
    grads = normal / (chi2 / 3).sqrt()
    grads = grads * 10.0 ** torch.empty(n // BLOCK_SIZE).uniform_(-4, 0, generator=g).repeat_interleave(BLOCK_SIZE)
    return grads, grads**2


def _plain_e4m3(x: torch.Tensor) -> torch.Tensor:
    # Per-block absmax scaling onto E4M3's 448, round to nearest, no expansion: the baseline COAT improves on.
    rows = x.view(-1, BLOCK_SIZE)
    scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-38) / 448.0
    return ((rows / scale).to(torch.float8_e4m3fn).float() * scale).view(-1)


@pytest.mark.parametrize("signed", [True, False], ids=["exp_avg (E4M3)", "exp_avg_sq (E4M4)"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_fp8_round_trip_within_derived_bound(signed: bool, rounding: str) -> None:
    """Neighbouring codes y_lo < y_hi of a normal 8-bit float with m mantissa bits differ by at most a factor
    1 + 2**-m, so their values x = amax (y / ymax)**(1/k) differ by at most r = (1 + 2**-m)**(1/k): the error is at
    most (r - 1) |x| / 2 rounding to nearest, (r - 1) |x| stochastically (plus FP32 slack)."""
    m, v = _heavy_tailed_moments()
    x = m if signed else v
    state = quantize_moment(x, "fp8", signed=signed, rounding=rounding, step=1)
    out = dequantize_moment(state)
    k = state["k"].repeat_interleave(BLOCK_SIZE)
    r = (1 + 2.0 ** -(3 if signed else 4)) ** (1 / k) - 1
    bound = (r / 2 if rounding == "nearest" else r) * x.abs() * (1 + 1e-5)
    err = (out - x).abs()
    assert (err <= bound).all(), (err / bound).max()
    assert (out.sign() == x.sign()).all()  # nothing flushed to zero, no sign lost


@pytest.mark.parametrize(("signed", "gain"), [(True, 0.8), (False, 0.5)], ids=["exp_avg", "exp_avg_sq"])
def test_fp8_expansion_beats_plain_blockwise_e4m3_on_heavy_tails(signed: bool, gain: float) -> None:
    """Measured mean relative errors (expansion vs plain): exp_avg 0.0160 vs 0.0224 (the t-distributed values span
    about E4M3's range already: k ~ 1.4), exp_avg_sq 0.0158 vs 0.0427 with 1.6% of plain's values flushed to 0."""
    m, v = _heavy_tailed_moments()
    x = m if signed else v
    dre = dequantize_moment(quantize_moment(x, "fp8", signed=signed, rounding="nearest"))
    plain = _plain_e4m3(x)
    rel_dre, rel_plain = ((dre - x) / x).abs(), ((plain - x) / x).abs()
    flushed = (plain == 0).float().mean().item()
    if not signed:
        assert flushed > 0.01  # squared heavy tails span more than E4M3's range: plain scaling flushes
    assert (dre != 0).all()
    assert rel_dre.mean() < gain * rel_plain.mean(), (rel_dre.mean(), rel_plain.mean())
    assert rel_dre.median() <= rel_plain.median()


def test_fp8_stochastic_rounding_is_unbiased() -> None:
    m, v = _heavy_tailed_moments(n=BLOCK_SIZE * 4)
    for signed, x in ((True, m), (False, v)):
        draws = torch.stack([
            dequantize_moment(quantize_moment(x, "fp8", signed=signed, step=s)) for s in range(1, 201)
        ])  # 200 x 512 = 1e5 draws
        bias = ((draws - x) / x.abs()).mean().item()
        assert abs(bias) < 1e-3, (signed, bias)


def test_fp8_zero_blocks_and_zeros_are_exact() -> None:
    x = torch.randn(3 * BLOCK_SIZE + 5)
    x[:BLOCK_SIZE] = 0.0  # a zero block
    x[BLOCK_SIZE + 3] = 0.0  # a zero inside a block: not its amin
    for signed in (True, False):
        out = dequantize_moment(quantize_moment(x if signed else x.abs(), "fp8", signed=signed))
        assert torch.isfinite(out).all()
        assert (out[:BLOCK_SIZE] == 0).all() and out[BLOCK_SIZE + 3] == 0
    assert (dequantize_moment(quantize_moment(torch.zeros(10), "fp8")) == 0).all()
    # A parameter whose gradient is always zero stays put: m = v = 0, the update 0 / eps.
    p = torch.ones(200)
    m, v = adam_moments("fp8", p.shape)
    for t in range(1, 4):
        adamw_step_(p, torch.zeros(200), m, v, step=t, lr=0.1, weight_decay=0.0)
    assert (p == 1).all()


def test_fp8_non_finite_value_makes_only_its_block_nan() -> None:
    x = torch.randn(3 * BLOCK_SIZE)
    x[BLOCK_SIZE + 7] = float("nan")
    x[2 * BLOCK_SIZE + 1] = float("inf")
    out = dequantize_moment(quantize_moment(x, "fp8"))
    assert out[BLOCK_SIZE:].isnan().all()
    assert torch.isfinite(out[:BLOCK_SIZE]).all()


# FP8 codes the finite check meets: each format's largest normal and smallest subnormal (finite), its non-finite codes.
_FP8_EDGES = [
    (torch.float8_e4m3fn, 448.0, True), (torch.float8_e4m3fn, 2.0**-9, True), (torch.float8_e4m3fn, math.nan, False),
    (torch.float8_e5m2, 57344.0, True), (torch.float8_e5m2, 2.0**-16, True), (torch.float8_e5m2, math.inf, False),
    (torch.float8_e5m2, -math.inf, False), (torch.float8_e5m2, math.nan, False),
]


@pytest.mark.parametrize(("dtype", "value", "finite"), _FP8_EDGES)
def test_the_finite_check_reads_fp8_codes(dtype: torch.dtype, value: float, finite: bool) -> None:
    # ScaleCheckpoint's snapshot check reads every floating tensor of the plugin's state, FP8 moments' E4M3 codes
    # included; torch reduces no FP8 dtype ("aminmax_cpu" not implemented for 'Float8_e4m3fn').
    from lit_mpstable.core.guards.triage import all_finite

    codes = torch.tensor([1.0, value, -2.0]).to(dtype)
    assert bool(all_finite([torch.ones(2), codes], torch.device("cpu"))) is finite


def test_fp8_moments_pass_the_finite_check_until_a_block_goes_bad() -> None:
    from lit_mpstable.core.guards.triage import all_finite

    x = torch.randn(2 * BLOCK_SIZE)
    state = quantize_moment(x, "fp8")
    assert state["codes"].dtype == torch.float8_e4m3fn
    assert bool(all_finite(list(state.values()), torch.device("cpu")))
    x[BLOCK_SIZE] = float("inf")
    assert not bool(all_finite(list(quantize_moment(x, "fp8").values()), torch.device("cpu")))  # its block's amax


def test_fp8_slices_must_be_block_aligned() -> None:
    store = MomentStore("fp8", (300,))
    store.read(128, 300)
    with pytest.raises(ValueError, match=f"blocks of {BLOCK_SIZE}"):
        store.read(100, 300)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_second_moment_ema_stalls_rounded_to_nearest_not_stochastically(kind: str) -> None:
    """v <- 0.999 v + 0.001 g**2, exactly g**2 (1 - 0.999**t) from 0, for g**2 in [0.5, 2], in a block whose first
    element has converged at 4 (it sets the FP8 block's amax and range). An increment of ~1/1000 of v is below half a
    spacing, so rounded to nearest v stops growing; stochastically rounded, it follows the exact EMA."""
    g2 = torch.linspace(0.5, 2.0, BLOCK_SIZE)
    g2[0] = 4.0
    stores = {r: MomentStore(kind, (BLOCK_SIZE,), signed=False, rounding=r) for r in ("nearest", "stochastic")}
    for store in stores.values():
        store.write_(torch.cat([g2[:1], torch.zeros(BLOCK_SIZE - 1)]), step=0)
    for t in range(1, 1001):
        for store in stores.values():
            store.write_(store.read().mul_(0.999).add_(g2, alpha=0.001), step=t)
    exact = g2[1:] * (1 - 0.999**1000)
    nearest, stochastic = ((stores[r].read()[1:] / exact).mean() for r in ("nearest", "stochastic"))
    assert nearest < 0.8, nearest
    assert abs(stochastic - 1) < 0.02, stochastic


def _update_error(sigma: float, steps: int = 80, n: int = 2048) -> tuple[float, float]:
    """Adam's step with FP8 moments against FP32 moments fed the same gradients (lr 1, no decay, so the step is the
    update): the mean over steps of |du| / |u| and of <du, u> / |u|**2. Gradients: per-element magnitudes
    log-normal (``sigma``; a block's range grows with it), a slowly drifting mean plus noise, as a layer's."""
    g = torch.Generator().manual_seed(0)
    scale, drift = torch.exp(sigma * torch.randn(n, generator=g)), torch.randn(n, generator=g)
    ref, fp8 = adam_moments("fp32", (n,)), adam_moments("fp8", (n,), seed=3)
    err = proj = 0.0
    for t in range(1, steps + 1):
        drift = 0.98 * drift + 0.2 * torch.randn(n, generator=g)
        grad = scale * (0.5 * drift + torch.randn(n, generator=g))
        u, uq = torch.zeros(n), torch.zeros(n)
        adamw_step_(u, grad, *ref, step=t, lr=1.0, weight_decay=0.0)
        adamw_step_(uq, grad, *fp8, step=t, lr=1.0, weight_decay=0.0)
        err += ((uq - u).norm() / u.norm()).item() / steps
        proj += ((uq - u).dot(u) / u.dot(u)).item() / steps
    return err, proj


@pytest.mark.parametrize(("sigma", "bound"), [(0.5, 0.0365), (1.5, 0.065)])
def test_fp8_update_error_against_fp32_moments(sigma: float, bound: float) -> None:
    """The FP8 moments' error where it acts, on the update, against FP32 moments. Measured: 0.034 and 0.061 with
    blocks of 64; blocks of 128 (COAT's group) give 0.039 and 0.069, above the bounds. No bias along the update:
    the rounding error is noise, not a shrinking or growing step."""
    err, proj = _update_error(sigma)
    assert err < bound, err
    assert abs(proj) < 0.005, proj


# ------------------------------------------------------------------------------------------------ stores
@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
def test_sliced_step_equals_whole_step(kind: str) -> None:
    grads = _grads(5)
    whole, _ = _run(kind, grads, lr=1e-2)
    params = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(SHAPES)]
    stores = [adam_moments(kind, p.shape, seed=7, index=i) for i, p in enumerate(params)]
    for t, step_grads in enumerate(grads, start=1):
        for p, g, (m, v) in zip(params, step_grads, stores):
            flat, gflat = p.view(-1), g.reshape(-1)
            for a in range(0, p.numel(), 256):  # a keeper's FP32 copy of each slice, stepped and written back
                piece = flat[a : a + 256].clone()
                adamw_step_(piece, gflat[a : a + 256], m, v, step=t, lr=1e-2, start=a)
                flat[a : a + 256] = piece
    for a, b in zip(whole, params):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
def test_state_dict_round_trip_resumes_exactly(kind: str) -> None:
    grads = _grads(20)
    params, stores = _run(kind, grads[:10], lr=1e-2)
    buffer = io.BytesIO()
    torch.save({"params": params, "stores": [[m.state_dict(), v.state_dict()] for m, v in stores]}, buffer)
    results = []
    for _ in range(2):
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        copies = [adam_moments(kind, p.shape, seed=0, index=99) for p in saved["params"]]  # overwritten by the load
        for (m, v), (ms, vs) in zip(copies, saved["stores"]):
            m.load_state_dict(ms)
            v.load_state_dict(vs)
        results.append(_run(kind, grads[10:], params=saved["params"], stores=copies, first=11, lr=1e-2)[0])
    straight, _ = _run(kind, grads, lr=1e-2)
    for a, b, c in zip(*results, straight):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_load_state_dict_is_strict() -> None:
    store = MomentStore("fp8", (300,))
    with pytest.raises(ValueError, match="kind='bf16'"):
        store.load_state_dict(MomentStore("bf16", (300,)).state_dict())
    with pytest.raises(KeyError, match="keys"):
        store.load_state_dict({"kind": "fp8"})


def test_state_bytes() -> None:
    n = 16 * 1024
    assert state_bytes(n, "bf16") / state_bytes(n, "fp32") == 0.5
    assert state_bytes(n, "fp8") / state_bytes(n, "fp32") == pytest.approx((1 + 8 / 64) / 4)  # <= the 0.3x budget
    for kind in ("fp32", "bf16", "fp8"):
        for numel in (1, 300, n):
            m, v = adam_moments(kind, (numel,))
            assert m.nbytes == v.nbytes == state_bytes(numel, kind)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
def test_step_reads_nothing_on_the_host(kind: str) -> None:
    from helpers import HostReads

    p = torch.randn(300)
    m, v = adam_moments(kind, p.shape)
    adamw_step_(p, torch.randn(300), m, v, step=1, lr=1e-2)  # first use: the value tables reach the device
    with HostReads() as reads:
        adamw_step_(p, torch.randn(300), m, v, step=2, lr=1e-2)
        m.state_dict()
    assert reads.ops == []


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
def test_empty_parameter(kind: str) -> None:
    m, v = adam_moments(kind, (0, 4))
    p = torch.zeros(0, 4)
    adamw_step_(p, torch.zeros(0, 4), m, v, step=1, lr=1.0)
    assert m.read().numel() == 0 and m.nbytes == state_bytes(0, kind) == 0


def test_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="kind='fp16'"):
        MomentStore("fp16", (4,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rounding='up'"):
        quantize_moment(torch.ones(3), "bf16", rounding="up")  # type: ignore[arg-type]
    m, v = adam_moments("fp32", (4,))
    with pytest.raises(ValueError, match="step=0"):
        adamw_step_(torch.ones(4), torch.ones(4), m, v, step=0, lr=1.0)
    with pytest.raises(ValueError, match="FP32"):
        adamw_step_(torch.ones(4, dtype=torch.bfloat16), torch.ones(4), m, v, step=1, lr=1.0)


# ------------------------------------------------------------------------------------------------ training
def digits_run(kind: str, seed: int, steps: int = 200, rounding: str | None = None) -> tuple[float, int]:
    """An MLP (64-128-128-10) on sklearn's digits, AdamW (lr 3e-3, wd 1e-2, batch 64) with moments in ``kind``:
    (validation loss on the last 297 images after ``steps`` steps, optimizer-state bytes)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    x_train, y_train, x_val, y_val = x[:1500], y[:1500], x[1500:], y[1500:]
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    params = list(model.parameters())
    stores = [adam_moments(kind, p.shape, seed=seed, index=i, rounding=rounding) for i, p in enumerate(params)]
    order = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        batch = torch.randint(0, 1500, (64,), generator=order)
        loss = nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
        model.zero_grad()
        loss.backward()
        for p, (m, v) in zip(params, stores):
            adamw_step_(p.data, p.grad, m, v, step=step, lr=3e-3, weight_decay=1e-2)
    with torch.no_grad():
        val = nn.functional.cross_entropy(model(x_val), y_val).item()
    return val, sum(m.nbytes + v.nbytes for m, v in stores)


@pytest.mark.slow
def test_digits_training_with_compact_moments_tracks_fp32() -> None:
    # A training check, not the 0.3% / 0.5% targets (experiments/optimizer_state.py measures those, longer
    # and over more seeds): at this length a run's val loss moves by the float rounding of the machine's kernels.
    # Measured per seed vs FP32 moments: AMD EPYC: means within 0.3% / 0.5%; Intel Xeon (AMX): bf16 +0.28, -0.46,
    # -0.40%, fp8 -0.87, +0.66, -1.37% (mean -0.57%), and with round-to-nearest moments -0.44% / +0.77%: seed noise
    # of +-1.4% that 3 seeds cannot resolve to 0.5%. A broken codec does not hide in it (moments decoded x2: NaN).
    results = {kind: [digits_run(kind, seed) for seed in range(3)] for kind in ("fp32", "bf16", "fp8")}
    ref = sum(loss for loss, _ in results["fp32"]) / 3
    ref_bytes = results["fp32"][0][1]
    for kind, memory in (("bf16", 0.5), ("fp8", 0.3)):
        mean = sum(loss for loss, _ in results[kind]) / 3
        assert abs(mean - ref) / ref <= 0.015, (kind, mean, ref)
        assert all(abs(loss - fp32) / fp32 <= 0.03 for (loss, _), (fp32, _) in zip(results[kind], results["fp32"]))
        assert results[kind][0][1] <= memory * ref_bytes


if __name__ == "__main__":  # the table for the report: python tests/core/test_optim_state.py
    torch.set_num_threads(1)
    rows = {}
    for kind, rounding in (("fp32", None), ("bf16", None), ("bf16", "nearest"), ("fp8", None), ("fp8", "stochastic"),
                           ("fp8", "nearest")):
        rows[kind, rounding] = [digits_run(kind, seed, rounding=rounding) for seed in range(3)]
    ref = sum(loss for loss, _ in rows["fp32", None]) / 3
    for (kind, rounding), runs in rows.items():
        mean = sum(loss for loss, _ in runs) / 3
        print(f"{kind:5s} {rounding!s:10s} val loss {[round(loss, 5) for loss, _ in runs]} mean {mean:.5f}"
              f" ({100 * (mean - ref) / ref:+.2f}% vs fp32)  state {runs[0][1]} B"
              f" ({runs[0][1] / rows['fp32', None][0][1]:.3f}x)")


def test_fp8_moments_saved_in_blocks_of_128_are_read_in_theirs_and_stored_in_this_versions_blocks() -> None:
    # The last version kept FP8 moments in blocks of 128: such a checkpoint resumes with each value rounded once more
    # (said in a warning), not as garbage and not as a shape error.
    from lit_mpstable.core.weights.optim_state import BLOCK_SIZE, decode_fp8, encode_fp8

    torch.manual_seed(0)
    values = torch.randn(1000) * torch.logspace(-6, 0, 1000)  # scales that differ within a block
    m, _ = adam_moments("fp8", (1000,))
    codes, amax, k = encode_fp8(values, True, None, block_size=128)
    state = {**m.state_dict(), "tensors": {"codes": codes, "amax": amax, "k": k}}
    old = decode_fp8(codes, amax, k, block_size=128)  # what the last version read back
    with pytest.warns(UserWarning, match=f"blocks of 128 elements were stored again in this version's blocks of"
                      f" {BLOCK_SIZE}"):
        m.load_state_dict(state)
    assert m.tensors["amax"].numel() == -(-1000 // BLOCK_SIZE)
    relative = ((m.read() - old).abs() / old.abs().clamp(min=1e-30)).max()
    assert relative < 0.07  # one E4M3 rounding (3 mantissa bits: < 1/8 of the value, ~1/16 to nearest + noise)
    assert torch.equal(torch.sign(m.read()), torch.sign(old))


def test_fp8_moments_of_another_shape_are_refused_by_name() -> None:
    m, _ = adam_moments("fp8", (1024,))
    state = m.state_dict()
    state["tensors"] = {**state["tensors"], "amax": torch.ones(3), "k": torch.ones(3)}  # no block size gives 3
    fresh, _ = adam_moments("fp8", (1024,))
    before = {k: v.clone() for k, v in fresh.tensors.items()}
    with pytest.raises(ValueError, match=r"tensors\['amax'\] has shape \(3,\), this store's has \(16,\)"):
        fresh.load_state_dict(state)
    assert all(torch.equal(before[k], v) for k, v in fresh.tensors.items())  # nothing half-loaded

"""SPEC §5: RoPE, LayerNorm, RMSNorm, Hadamard and the cos/sin look-up, against explicit numpy.float32
computations written here one rounding at a time (numpy float32 ufuncs are single IEEE operations; no FMA).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsaquant.reference import transforms as T
from f32_steps import b32, canonical_np, f32, from_bits, same_bits

F32 = torch.float32


def rand_rows(n, seed, spread=6):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, 128)) * np.exp2(rng.integers(-spread, spread, (n, 128)))).astype(np.float32)


# ---- RoPE -------------------------------------------------------------------------------------------
def rope_np(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool, tail: bool) -> np.ndarray:
    """a' = fl(fl(a*c) - fl(b*s)), b' = fl(fl(b*c) + fl(a*s)) with scalar float32 ops, pair by pair."""
    out = x.copy()
    off = 64 if tail else 0
    for t in range(x.shape[0]):
        for j in range(32):
            ia, ib = (off + j, off + j + 32) if neox else (off + 2 * j, off + 2 * j + 1)
            a, b, c, s = f32(x[t, ia]), f32(x[t, ib]), f32(cos[t, j]), f32(sin[t, j])
            ac, bs, bc, as_ = a * c, b * s, b * c, a * s
            out[t, ia] = ac - bs
            out[t, ib] = bc + as_
    return out


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("tail", [False, True])
def test_rope_matches_stepwise_numpy(neox, tail):
    rng = np.random.default_rng(int(neox) * 2 + int(tail))
    x = rand_rows(6, 11 + neox + 2 * tail)
    ang = rng.uniform(-10, 10, (6, 32))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    got = T.rope(torch.from_numpy(x), torch.from_numpy(cos), torch.from_numpy(sin), neox, tail)
    assert got.dtype == F32 and got.shape == (6, 128)
    want = rope_np(x, cos, sin, neox, tail)
    assert same_bits(got, want)
    # the 64 non-rope dims pass through bit for bit
    keep = slice(0, 64) if tail else slice(64, 128)
    assert same_bits(got[:, keep].contiguous(), x[:, keep])


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("tail", [False, True])
def test_rope_hand_pairs(neox, tail):
    # One pair per variant: (a, b) = (1, 2), (c, s) = (0.5, 0.25): a' = 0.5 - 0.5 = 0, b' = 1 + 0.25 = 1.25.
    # The partner dims are literal positions, so a wrong pairing or a wrong half is caught.
    x = np.zeros((1, 128), dtype=np.float32)
    ia, ib = {(True, False): (5, 37), (False, False): (10, 11), (True, True): (69, 101), (False, True): (74, 75)}[
        (neox, tail)]
    x[0, ia], x[0, ib] = 1.0, 2.0
    x[0, 0 if tail else 127] = 7.0      # a non-rope dim
    cos = np.ones((1, 32), dtype=np.float32)
    sin = np.zeros((1, 32), dtype=np.float32)
    cos[0, 5], sin[0, 5] = 0.5, 0.25
    got = T.rope(torch.from_numpy(x), torch.from_numpy(cos), torch.from_numpy(sin), neox, tail).numpy()
    want = np.zeros((1, 128), dtype=np.float32)
    want[0, ia], want[0, ib] = 0.0, 1.25
    want[0, 0 if tail else 127] = 7.0
    assert same_bits(got, want)


def test_rope_fma_contraction_exposed():
    # a = 1 + 2^-12, c = 0.5 + 2^-13, b = 1 + 2^-11, s = 0.5:
    #   a*c = (1 + 2^-11 + 2^-24)/2, a tie that rounds to (1 + 2^-11)/2 = fl(b*s), so the SPEC's a' = 0;
    #   a fused a*c - fl(b*s) (rounded once) would give 2^-25.
    a, c = f32(1 + 2.0 ** -12), f32(0.5 + 2.0 ** -13)
    b, s = f32(1 + 2.0 ** -11), f32(0.5)
    separate = (a * c) - (b * s)
    fused = f32(float(a) * float(c) - float(b * s))          # float64 product is exact; one rounding
    assert separate == 0.0 and fused == f32(2.0 ** -25)      # the input really exposes contraction
    b_sep = f32(b * c) + f32(a * s)
    for neox in (True, False):
        for tail in (False, True):
            x = np.zeros((1, 128), dtype=np.float32)
            off = 64 if tail else 0
            ia, ib = (off + 3, off + 35) if neox else (off + 6, off + 7)
            x[0, ia], x[0, ib] = a, b
            cos = np.full((1, 32), c, dtype=np.float32)
            sin = np.full((1, 32), s, dtype=np.float32)
            got = T.rope(torch.from_numpy(x), torch.from_numpy(cos), torch.from_numpy(sin), neox, tail).numpy()
            assert b32(got[0, ia]) == 0x00000000, (neox, tail, got[0, ia])
            assert b32(got[0, ib]) == b32(b_sep)


def test_rope_broadcast_cos_sin_over_heads():
    # q [T, H, 128] with cos/sin [T, 1, 32] (one table row per token, shared by the heads)
    rng = np.random.default_rng(5)
    x = rand_rows(6, 21).reshape(2, 3, 128)
    ang = rng.uniform(-3, 3, (2, 1, 32))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    got = T.rope(torch.from_numpy(x), torch.from_numpy(cos), torch.from_numpy(sin), True, False).numpy()
    want = rope_np(x.reshape(6, 128), np.repeat(cos[:, 0], 3, 0), np.repeat(sin[:, 0], 3, 0), True, False)
    assert same_bits(got.reshape(6, 128), want)


# ---- LayerNorm / RMSNorm ----------------------------------------------------------------------------
# SPEC §0.1: `1/sqrt(v)` is `1.0f / sqrtf(v)`, both correctly rounded. numpy's float32 sqrt is correctly
# rounded (it equals the float64 sqrt rounded once, which is exact for sqrt), so the models below use it.
# torch's own CPU fp32 sqrt is NOT (torch 2.13.0+cpu, AVX-512 and default builds: about 17% of inputs are
# 1 ulp off, e.g. sqrt(0x40000002) -> 0x3FB504F4 instead of 0x3FB504F5); the *_sqrt_correctly_rounded_hand
# tests pin values where the two differ.


def layer_norm_np(x, w, b, eps):
    """Returns (y, the sqrt arguments var + eps per row)."""
    out = np.empty_like(x)
    args = np.empty(x.shape[0], dtype=np.float32)
    n = f32(128)
    e = f32(eps)
    for r in range(x.shape[0]):
        mean = canonical_np(x[r]) / n
        d = x[r] - mean
        var = canonical_np(d * d) / n
        args[r] = var + e
        inv = f32(1) / np.sqrt(args[r])
        out[r] = ((d * inv) * w) + b
    return out, args


def rms_norm_np(x, w, eps):
    out = np.empty_like(x)
    args = np.empty(x.shape[0], dtype=np.float32)
    for r in range(x.shape[0]):
        ms = canonical_np(x[r] * x[r]) / f32(128)
        args[r] = ms + f32(eps)
        inv = f32(1) / np.sqrt(args[r])
        out[r] = w * (x[r] * inv)
    return out, args


def norm_rows(n=40):
    x = rand_rows(n, 3)
    x[1] = 1000.0 + rand_rows(1, 4, 2)[0]             # a large mean
    x[2] = 0.0                                         # var 0 -> 1/sqrt(eps)
    x[3, :] = rand_rows(1, 5, 30)[0]                   # a wide dynamic range
    for r in range(4, n, 3):                           # rows whose sums depend on the order of addition
        x[r] = rand_rows(1, 100 + r, 20)[0]
    return x


def ln_params():
    rng = np.random.default_rng(9)
    w = (1 + 0.1 * rng.standard_normal(128)).astype(np.float32)
    b = (0.1 * rng.standard_normal(128)).astype(np.float32)
    return w, b


@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_layer_norm_stepwise(eps):
    x = norm_rows()
    w, b = ln_params()
    want, args = layer_norm_np(x, w, b, eps)
    got = T.layer_norm(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), eps)
    assert got.dtype == F32
    bad = np.flatnonzero(~np.all(b32(got.numpy()) == b32(want), axis=1))
    assert bad.size == 0, f"rows {bad.tolist()} differ"


def test_layer_norm_sum_order_matters_for_this_data():
    # Sanity for the test above: a left-to-right sum gives other bytes on some of the checked rows.
    x = norm_rows()
    w, b = ln_params()
    want, _ = layer_norm_np(x, w, b, 1e-6)
    alt = np.empty_like(x)
    for r in range(x.shape[0]):
        mean = np.float32(sum(np.float32(v) for v in x[r])) / f32(128)
        d = x[r] - mean
        var = np.float32(sum(np.float32(v) for v in d * d)) / f32(128)
        alt[r] = (d * (f32(1) / np.sqrt(var + f32(1e-6)))) * w + b
    assert not np.array_equal(b32(alt), b32(want))


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_rms_norm_stepwise(wdtype):
    x = norm_rows()
    x[2] = rand_rows(1, 8)[0] * f32(1e-3)
    rng = np.random.default_rng(10)
    w_t = torch.from_numpy((1 + 0.2 * rng.standard_normal(128)).astype(np.float32)).to(wdtype)
    w = w_t.to(F32).numpy()
    want, _ = rms_norm_np(x, w, 1e-6)
    got = T.rms_norm(torch.from_numpy(x), w_t, 1e-6)
    bad = np.flatnonzero(~np.all(b32(got.numpy()) == b32(want), axis=1))
    assert bad.size == 0, f"rows {bad.tolist()} differ"


def test_rms_norm_sum_order_matters_for_this_data():
    x = norm_rows()
    w = np.ones(128, dtype=np.float32)
    want, _ = rms_norm_np(x, w, 1e-6)
    alt = np.empty_like(x)
    for r in range(x.shape[0]):
        ms = np.float32(sum(np.float32(v) for v in x[r] * x[r])) / f32(128)
        alt[r] = x[r] * (f32(1) / np.sqrt(ms + f32(1e-6)))
    assert not np.array_equal(b32(alt), b32(want))


def test_rms_norm_hand_row():
    # x = all 2: S(x*x) = 512, /128 = 4, + eps(1e-6f) -> 4.000001 (fl), sqrt, 1/sqrt; y = w * fl(2 * inv)
    x = np.full((1, 128), 2.0, dtype=np.float32)
    w = np.full(128, 3.0, dtype=np.float32)
    ms = f32(4.0) + f32(1e-6)
    inv = f32(1) / np.sqrt(ms)
    want = f32(3.0) * (f32(2.0) * inv)
    got = T.rms_norm(torch.from_numpy(x), torch.from_numpy(w), 1e-6).numpy()
    assert np.all(b32(got) == b32(want))
    assert 2.999998 < float(want) < 3.0


def test_canonical_mean_in_layer_norm_hand():
    # x = [1, 2^-24 x 127]: S(x*x) = 1 in any order (2^-48 terms vanish) but S(x) depends on the order
    x = np.array([[1.0] + [2.0 ** -24] * 127], dtype=np.float32)
    w, b = np.ones(128, dtype=np.float32), np.zeros(128, dtype=np.float32)
    want, _ = layer_norm_np(x, w, b, 1e-5)
    assert canonical_np(x[0]) == f32(1 + 31 * 2.0 ** -22)
    got = T.layer_norm(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), 1e-5)
    assert same_bits(got, want)


def test_rms_norm_sqrt_correctly_rounded_hand():
    # x = [1, 2^-24 x 127], w = 1, eps = 1e-6: S(x*x)/128 = 2^-7, + 1e-6f (0x358637BD) = 0x3C000432;
    # sqrt correctly rounded = 0x3DB507EB (torch: 0x3DB507EA); inv = 0x413501FB; y0 = inv, y1 = 2^-24*inv.
    x = torch.tensor([[1.0] + [2.0 ** -24] * 127])
    y = T.rms_norm(x, torch.ones(128), 1e-6)
    got = b32(y.numpy()[0])
    assert got[0] == 0x413501FB and np.all(got[1:] == 0x353501FB), hex(got[0])


def test_layer_norm_sqrt_correctly_rounded_hand():
    # all 32 partials are (2, -2, 0, 0): mean 0, var = 64*4/128 = 2, eps = 2^-21 -> 0x40000002;
    # sqrt = 0x3FB504F5 (torch: 0x3FB504F4), inv = 0x3F3504F1, y(+-2) = +-0x3FB504F1, y(0) = 0.
    x = torch.zeros(1, 128)
    x[0, 0:128:8] = 2.0
    x[0, 1:128:8] = -2.0
    x[0, 4:128:8] = 2.0
    x[0, 5:128:8] = -2.0
    y = T.layer_norm(x, torch.ones(128), torch.zeros(128), 2.0 ** -21)
    got = b32(y.numpy()[0])
    assert got[0] == 0x3FB504F1 and got[1] == 0xBFB504F1 and got[2] == 0, hex(got[0])


def test_norms_many_rows():
    x = norm_rows(200)
    w, b = ln_params()
    want, _ = layer_norm_np(x, w, b, 1e-6)
    got = T.layer_norm(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), 1e-6)
    ok_ln = np.array_equal(b32(got.numpy()), b32(want))
    want, _ = rms_norm_np(x, w, 1e-6)
    got = T.rms_norm(torch.from_numpy(x), torch.from_numpy(w), 1e-6)
    assert ok_ln and np.array_equal(b32(got.numpy()), b32(want))


# ---- Hadamard ---------------------------------------------------------------------------------------
def sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def test_inv_sqrt128_constant():
    c = f32(1.0 / np.sqrt(128.0))
    assert b32(c) == 0x3DB504F3


def test_hadamard_close_to_dense_matrix():
    x = rand_rows(16, 77, 3)
    got = T.hadamard(torch.from_numpy(x)).numpy().astype(np.float64)
    want = (x.astype(np.float64) @ sylvester(128).T) * 128 ** -0.5
    tol = 2e-6 * np.abs(x).astype(np.float64).sum(axis=1, keepdims=True)
    assert np.all(np.abs(got - want) <= tol)


def test_hadamard_exact_on_powers_of_two():
    rng = np.random.default_rng(12)
    k = rng.integers(-8, 9, (8, 128))
    sgn = rng.choice([-1.0, 1.0], (8, 128))
    x = (sgn * np.exp2(k)).astype(np.float32)
    x[0] = 0.0
    x[0, 0] = 1.0                                          # a unit vector: every output is +-fl(128^-0.5)
    exact = x.astype(np.float64) @ sylvester(128).T        # every partial sum is exact in fp32 too
    assert np.array_equal(exact.astype(np.float32).astype(np.float64), exact)
    want = exact.astype(np.float32) * from_bits(0x3DB504F3)
    got = T.hadamard(torch.from_numpy(x)).numpy()
    assert np.array_equal(b32(got), b32(want))
    assert set(b32(got[0]).tolist()) == {0x3DB504F3}


def test_hadamard_butterfly_rounding_order():
    # Random fp32 data, so the intermediate roundings matter: the SPEC butterfly (h = 1, 2, ..., 64;
    # (a, b) -> (a+b, a-b)) then the multiply, with numpy.float32 ops.
    x = rand_rows(8, 31, 10)
    y = x.copy()
    h = 1
    while h < 128:
        z = y.copy()
        for i in range(128):
            if i & h == 0:
                a, b = y[:, i], y[:, i + h]
                z[:, i], z[:, i + h] = a + b, a - b
        y = z
        h *= 2
    want = y * from_bits(0x3DB504F3)
    got = T.hadamard(torch.from_numpy(x)).numpy()
    assert np.array_equal(b32(got), b32(want))
    # the reverse order (h = 64 .. 1) would give other bits for this data
    y2 = x.copy()
    for h in (64, 32, 16, 8, 4, 2, 1):
        z = y2.copy()
        for i in range(128):
            if i & h == 0:
                z[:, i], z[:, i + h] = y2[:, i] + y2[:, i + h], y2[:, i] - y2[:, i + h]
        y2 = z
    assert not np.array_equal(b32(y2 * from_bits(0x3DB504F3)), b32(want))


# ---- cos/sin look-up --------------------------------------------------------------------------------
POSITIONS = [0, 5, 7, 8, -3, 100, 15, 14]
ROWS_R1 = [0, 5, 7, 8, 0, 15, 15, 14]          # clamped into [0, 16)
ROWS_R4 = [0, 4, 4, 8, 0, 15, 12, 12]          # pos & ~3, then clamped (-3 & ~3 = -4 -> 0; 100 -> 15)


@pytest.mark.parametrize("ratio,rows", [(1, ROWS_R1), (4, ROWS_R4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cos_sin_tables(ratio, rows, dtype):
    g = torch.Generator().manual_seed(3)
    cos_cache = torch.randn(16, 32, generator=g).to(dtype)
    sin_cache = torch.randn(16, 32, generator=g).to(dtype)
    c, s = T.cos_sin(torch.tensor(POSITIONS), cos_cache=cos_cache, sin_cache=sin_cache, compress_ratio=ratio)
    assert c.dtype == F32 and s.dtype == F32 and c.shape == (8, 32)
    for t, r in enumerate(rows):
        assert torch.equal(c[t], cos_cache[r].to(F32)) and torch.equal(s[t], sin_cache[r].to(F32)), (t, r)


@pytest.mark.parametrize("ratio,rows", [(1, ROWS_R1), (4, ROWS_R4)])
def test_cos_sin_freqs_pairs(ratio, rows):
    # freqs[p, 2j] = cos = 100p + j, freqs[p, 2j+1] = sin = -(100p + j) - 0.5
    p = torch.arange(16, dtype=F32).view(16, 1)
    j = torch.arange(32, dtype=F32).view(1, 32)
    freqs = torch.stack((100 * p + j, -(100 * p + j) - 0.5), dim=-1).reshape(16, 64)
    c, s = T.cos_sin(torch.tensor(POSITIONS), freqs=freqs, compress_ratio=ratio)
    for t, r in enumerate(rows):
        assert c[t].tolist() == [100.0 * r + jj for jj in range(32)]
        assert s[t].tolist() == [-(100.0 * r + jj) - 0.5 for jj in range(32)]


def test_cos_sin_ratio_128():
    freqs = torch.arange(300 * 64, dtype=F32).reshape(300, 64)
    c, _ = T.cos_sin(torch.tensor([127, 128, 255, 256, 299]), freqs=freqs, compress_ratio=128)
    assert (c[:, 0] / 64).tolist() == [0, 128, 128, 256, 256]


def test_rope_with_bf16_table_uses_bf16_values():
    # a bf16 table rotates by the bf16-rounded cos/sin, converted exactly
    rng = np.random.default_rng(2)
    ang = rng.uniform(-5, 5, (8, 32))
    cos_b = torch.from_numpy(np.cos(ang).astype(np.float32)).to(torch.bfloat16)
    sin_b = torch.from_numpy(np.sin(ang).astype(np.float32)).to(torch.bfloat16)
    pos = torch.tensor([3, 1, 7, 0])
    c, s = T.cos_sin(pos, cos_cache=cos_b, sin_cache=sin_b)
    x = rand_rows(4, 17)
    got = T.rope(torch.from_numpy(x), c, s, False, True)
    cn = cos_b.to(F32).numpy()[[3, 1, 7, 0]]
    sn = sin_b.to(F32).numpy()[[3, 1, 7, 0]]
    assert same_bits(got, rope_np(x, cn, sn, False, True))

"""The shared header (src/include/dsaquant) against the torch reference, byte for byte, on the host.

Every test compares the header, through the pybind11 harness tests/cpp/header_host.cpp, with
python/dsaquant/reference and requires ZERO mismatches. Comparisons are of bit patterns; where a NaN
is compared, only NaN-ness counts (the SPEC fixes no NaN payload for fp32 / bf16 / fp16 values; the
byte formats' NaN codes are compared exactly). Counts are printed in the terminal summary.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsaquant.reference import arith, fp4, fp8, layouts, transforms

POLICY = {"threshold": 0, "rne": 1, "hardware": 2}
RULE = {"pack": 0, "recip": 1}
FLAVOUR = {"e4m3fn": 0, "e4m3fnuz": 1}

SEED = 20240603


@pytest.fixture(scope="module")
def h(header_host):
    return header_host


# ---- comparison helpers --------------------------------------------------------------------------
def _np(a):
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu()
        if a.dtype == torch.bfloat16:
            a = a.view(torch.int16)
        return a.numpy()
    return np.asarray(a)


def _bits(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.float32:
        return a.view(np.uint32)
    if a.dtype == np.float16:
        return a.view(np.uint16)
    return a


def check(counts, name, got, want, nan_equal=False):
    """Bitwise comparison; with nan_equal, two NaNs (of any payload) are equal. Records counts."""
    got, want = _np(got), _np(want)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    if nan_equal:
        gf, wf = got.astype(np.float32, copy=False), want.astype(np.float32, copy=False)
        both_nan = np.isnan(gf) & np.isnan(wf)
        bad = (_bits(gf) != _bits(wf)) & ~both_nan
    else:
        bad = _bits(got) != _bits(want.astype(got.dtype, copy=False))
    n_bad = int(bad.sum())
    c = counts.setdefault(name, [0, 0])
    c[0] += int(bad.size)
    c[1] += n_bad
    if n_bad:
        idx = np.argwhere(bad)[:5]
        raise AssertionError(f"{name}: {n_bad} mismatches of {bad.size}; first at {idx.tolist()}: "
                             f"got {[got[tuple(i)] for i in idx]}, want {[want[tuple(i)] for i in idx]}")


def f32(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint64).astype(np.uint32).view(np.float32)


def t32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def all_bf16_as_f32() -> np.ndarray:
    """The 65536 bf16 bit patterns, as fp32."""
    return (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)


def fp32_sweep(rng, stride=1021, low=(0x0, 0x1, 0x7FFF, 0x8000, 0x8001, 0xFFFF)) -> np.ndarray:
    """A broad sweep of fp32 bit patterns: every top-16-bit pattern with several low halves, a
    strided walk over all 2^32 patterns and random patterns. Includes ±0, subnormals, ±Inf, NaNs."""
    top = np.arange(65536, dtype=np.uint32) << 16
    parts = [top | np.uint32(lo) for lo in low]
    parts.append(np.arange(0, 2**32, stride, dtype=np.uint64).astype(np.uint32))
    parts.append(rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32))
    return np.concatenate(parts).view(np.float32)


def around(values: np.ndarray, k: int = 3) -> np.ndarray:
    """Each value and its k fp32 neighbours on either side, both signs."""
    v = np.abs(np.asarray(values, dtype=np.float32)).view(np.uint32).astype(np.int64)
    d = np.arange(-k, k + 1, dtype=np.int64)
    b = (v[:, None] + d[None, :]).reshape(-1)
    b = b[(b >= 0) & (b <= 0x7F800000)].astype(np.uint32)
    return np.concatenate([b, b | np.uint32(0x80000000)]).view(np.float32)


# ---- SPEC §0 ---------------------------------------------------------------------------------------
def test_pow2_ceil_exp(h, header_counts):
    rng = np.random.default_rng(SEED)
    e = np.arange(0, 256, dtype=np.int32)
    check(header_counts, "pow2", h.pow2(e), arith.pow2(torch.from_numpy(e)))
    f = np.abs(fp32_sweep(rng))
    f = f[~np.isnan(f)]
    check(header_counts, "ceil_exp", h.ceil_exp(f), arith.ceil_exp(t32(f)))


def test_bf16_fp16_rounding(h, header_counts):
    """Round to nearest even; a NaN becomes the canonical NaN (reference `round_to`, `canon_nan`)."""
    rng = np.random.default_rng(SEED + 1)
    x = np.concatenate([fp32_sweep(rng), around(np.array([65504, 65520, 2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-25],
                                                         dtype=np.float32), 40)])
    tx = t32(x)
    got_b = h.round_bf16(x)
    check(header_counts, "round_bf16", h.bf16_to_f32(got_b), arith.round_to(tx, torch.bfloat16))
    got_h = h.round_fp16(x)
    check(header_counts, "round_fp16", h.fp16_to_f32(got_h), arith.round_to(tx, torch.float16))
    nan = np.isnan(x)
    assert nan.any() and (got_b[nan] == 0x7FC0).all() and (got_h[nan] == 0x7E00).all()   # canonical NaN bits
    check(header_counts, "round_bf16 (torch, non-NaN)", got_b[~nan],
          tx[~nan].to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    check(header_counts, "round_fp16 (torch, non-NaN)", got_h[~nan],
          tx[~nan].to(torch.float16).view(torch.int16).numpy().view(np.uint16))
    allh = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    check(header_counts, "bf16_to_f32", h.bf16_to_f32(allh),
          torch.from_numpy(allh.view(np.int16)).view(torch.bfloat16).float())
    check(header_counts, "fp16_to_f32", h.fp16_to_f32(allh),
          torch.from_numpy(allh.view(np.int16)).view(torch.float16).float(), nan_equal=True)


@pytest.mark.parametrize("n", [4, 8, 32, 128, 512, 1024])
def test_canonical_sum(h, header_counts, n):
    rng = np.random.default_rng(SEED + n)
    rows = 4000 if n <= 128 else 600
    # Wide dynamic range and cancellation, so that any other order would show.
    x = (rng.standard_normal((rows, n)) * 2.0 ** rng.integers(-30, 30, (rows, n))).astype(np.float32)
    x[::7] *= np.float32(1e8)
    x[1::11, n // 2:] = -x[1::11, : n // 2][:, ::-1]   # exact cancellation in some order only
    want = arith.canonical_sum(t32(x))
    variants = [0, 2] + ([1] if n in (8, 128, 512) else [])
    for v in variants:
        check(header_counts, f"canonical_sum n={n} variant={v}", h.canonical_sum(x, v), want)
    check(header_counts, "nan_amax", h.nan_amax(x), arith.nan_amax(t32(x)))


def test_nan_amax_specials(h, header_counts):
    x = np.zeros((6, 32), dtype=np.float32)
    x[1, :] = np.nan
    x[2, 3] = np.nan
    x[2, 5] = -7.0
    x[3, 0] = -np.inf
    x[4, :] = -0.0
    x[5, 31] = np.nan
    x[5, 0] = 1e-45
    check(header_counts, "nan_amax specials", h.nan_amax(x), arith.nan_amax(t32(x)))


EXP_DS_GOLDEN = {0.0: 0x3F800000, -0.5: 0x3F1B4598, -1.0: 0x3EBC5AB2, -2.0: 0x3E0A9555, -10.0: 0x383E6BCE,
                 -87.0: 0x00B33687, -100.0: 0x0000001B, -103.0: 0x00000001, -104.0: 0x00000000,
                 float("-inf"): 0x00000000}


def test_exp_ds(h, header_counts):
    xs = np.array(list(EXP_DS_GOLDEN), dtype=np.float32)
    check(header_counts, "exp_ds golden", h.exp_ds(xs), f32(list(EXP_DS_GOLDEN.values())))
    rng = np.random.default_rng(SEED + 2)
    neg_bf16 = all_bf16_as_f32()
    neg_bf16 = neg_bf16[(neg_bf16 <= 0) & (neg_bf16 >= -110)]
    lows = np.uint32(rng.integers(0, 1 << 16, neg_bf16.size, dtype=np.uint32))
    x = np.concatenate([
        -rng.uniform(0, 110, 2_000_000).astype(np.float32),
        neg_bf16, (neg_bf16.view(np.uint32) | lows).view(np.float32),
        around(np.arange(0, 111, dtype=np.float32) * np.float32(np.log(2.0) / 1.0), 3),
        np.array([0.0, -0.0, -np.inf, np.inf, np.nan, -np.nan, 1e-45, -1e-45, 0.5, 3.0, 88.0, 1e30, -1e30, -3e38],
                 dtype=np.float32),
        -rng.uniform(0, 1e-3, 100_000).astype(np.float32),
    ])
    check(header_counts, "exp_ds", h.exp_ds(x), arith.exp_ds(t32(x)))


# ---- SPEC §1-§3: FP4 ----------------------------------------------------------------------------------
E2M1_GOLDEN = [  # v, threshold, rne, hardware (SPEC §2)
    (0x00000000, 0x0, 0x0, 0x0), (0x80000000, 0x0, 0x0, 0x8), (-0.2, 0x0, 0x0, 0x8), (0.25, 0x0, 0x0, 0x0),
    (0.26, 0x1, 0x1, 0x1), (0.75, 0x1, 0x2, 0x2), (-1.75, 0xB, 0xC, 0xC), (2.5, 0x4, 0x4, 0x4), (3.5, 0x5, 0x6, 0x6),
    (5.0, 0x6, 0x6, 0x6), (5.0000005, 0x7, 0x7, 0x7), (-7.0, 0xF, 0xF, 0xF), (0x7F800000, 0x7, 0x7, 0x7),
    (0xFFC00000, 0x7, 0x7, 0xF),
]


def test_e2m1_golden(h, header_counts):
    v = np.array([f32(a)[()] if isinstance(a, int) else a for a, *_ in E2M1_GOLDEN], dtype=np.float32)
    for k, pol in enumerate(POLICY):
        want = np.array([row[1 + k] for row in E2M1_GOLDEN], dtype=np.uint8)
        check(header_counts, f"e2m1 golden {pol}", h.e2m1_encode(v, POLICY[pol]), want)
        check(header_counts, f"e2m1 golden {pol} (reference)", fp4.e2m1_encode(t32(v), pol), want)


@pytest.mark.parametrize("policy", list(POLICY))
def test_e2m1_every_bf16_at_every_exponent(h, header_counts, policy):
    """All 65536 bf16 patterns x at every exponent e in 1..254: code of x / 2^(e-127) (16.6M codes),
    through the pair encoder (e2m1_encode_pair, the block helper's path)."""
    x = all_bf16_as_f32()
    es = np.arange(1, 255, dtype=np.int32)
    got = h.e2m1_encode_grid(x, es, POLICY[policy])
    tx = t32(x)
    for i in range(0, es.size, 32):
        e = torch.from_numpy(es[i:i + 32])
        want = fp4.e2m1_encode(tx[None, :] / arith.pow2(e)[:, None], policy)
        check(header_counts, f"e2m1 bf16 x all e, {policy}", got[i:i + 32], want)


@pytest.mark.parametrize("policy", list(POLICY))
def test_e2m1_encode8_bf16_every_value_every_exponent(h, header_counts, policy):
    """The packed bf16 encoder (e2m1x8.h, the CUDA FP4 indexer's for bf16 inputs) on all 65536 bf16
    patterns at every exponent e in 1..255 (16.7M codes) against the reference quantizer's codes:
    NaN counts as the canonical NaN, e = 255 is the NaN-scale rule (SPEC §3)."""
    xbits = np.arange(65536, dtype=np.uint32)
    # Shuffled so that every group of 8 mixes classes (NaN, Inf, zeros, subnormals, both signs).
    xbits = xbits[np.random.default_rng(SEED + 11).permutation(xbits.size)]
    es = np.arange(1, 256, dtype=np.int32)
    got = h.e2m1_encode8_bf16_grid(xbits.astype(np.uint16), es, POLICY[policy])
    tx = arith.canon_nan(t32((xbits << 16).view(np.float32)))
    sign = (tx.view(torch.int32) < 0).to(torch.uint8)
    for i in range(0, es.size, 32):
        e = torch.from_numpy(es[i:i + 32])
        codes = fp4.e2m1_encode(tx[None, :] / arith.pow2(e)[:, None], policy)
        fill = (sign << 3) | 7 if policy == "hardware" else torch.full_like(sign, 7)
        codes = torch.where((e == 255)[:, None], fill[None, :].expand_as(codes), codes)
        check(header_counts, f"e2m1 packed bf16 x all e, {policy}", got[i:i + 32], fp4.pack_nibbles(codes))


def _e2m1_codes8(x: np.ndarray, e: torch.Tensor, policy: str) -> torch.Tensor:
    """Reference bytes of blocks x [n, 8] at exponents e [n] (canonical NaN; e = 255: the NaN-scale rule)."""
    tx = arith.canon_nan(t32(x))
    codes = fp4.e2m1_encode(tx / arith.pow2(e).unsqueeze(-1), policy)
    sign = (tx.view(torch.int32) < 0).to(torch.uint8)
    fill = (sign << 3) | 7 if policy == "hardware" else torch.full_like(sign, 7)
    codes = torch.where((e == 255).unsqueeze(-1), fill, codes)
    return fp4.pack_nibbles(codes).reshape(-1)


_E2M1_GRID = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1, 1.5, 2, 3, 4, 6, 0], dtype=np.float32)


@pytest.mark.parametrize("policy", list(POLICY))
def test_e2m1_encode8_f32_every_exponent(h, header_counts, policy):
    """The fp32 eight-value encoder (e2m1x8.h e2m1_encode8_f32: round to odd bf16, then the bf16 encoder; the
    CUDA rope_rotate_quant's) against the reference codes of x / 2^(e-127) with canonical NaN, at every exponent
    e in 1..255 (16.7M codes): random fp32 patterns (most with dropped low bits set) and the E2M1 midpoints and
    grid values times 2^k, with their fp32 neighbours, across the exponent range."""
    rng = np.random.default_rng(SEED + 12)
    near = around(np.concatenate([_E2M1_GRID * np.float32(2.0 ** k) for k in range(-149, 128, 4)]), 2)
    pool = np.concatenate([near[np.isfinite(near)], rng.integers(0, 2**32, 20_000, dtype=np.uint64)
                           .astype(np.uint32).view(np.float32), np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0],
                                                                         dtype=np.float32)])
    pool = pool[rng.permutation(pool.size)]
    x = np.resize(pool, 65536).reshape(-1, 8)
    for e0 in range(1, 256, 32):
        es = torch.arange(e0, min(e0 + 32, 256), dtype=torch.int32)
        e = es.repeat_interleave(x.shape[0])
        xx = np.tile(x, (es.numel(), 1))
        got = h.e2m1_encode8_f32(xx.reshape(-1), e.numpy(), POLICY[policy])
        check(header_counts, f"e2m1 fp32 x8 all e, {policy}", got, _e2m1_codes8(xx, e, policy))


@pytest.mark.parametrize("policy", list(POLICY))
def test_e2m1_encode8_f32_block_exponents(h, header_counts, policy):
    """The same at the exponent quantizers use: each block's rule-recip exponent of its own amax (and a few larger
    ones, and 255), on every bf16 pattern, an fp32 sweep, and blocks holding 6 * 2^k next to the E2M1 midpoints and
    grid values times 2^k (and their fp32 neighbours), so that the scaled values hit the ties exactly."""
    rng = np.random.default_rng(SEED + 13)
    tie_blocks = []
    for k in range(-149, 126, 3):
        vals = around(_E2M1_GRID * np.float32(2.0 ** k), 2)
        vals = np.resize(vals[np.isfinite(vals)], (vals.size + 6) // 7 * 7).reshape(-1, 7)
        tie_blocks.append(np.concatenate([np.full((vals.shape[0], 1), np.float32(6.0 * 2.0 ** k)), vals], axis=1))
    pool = np.concatenate([all_bf16_as_f32(), fp32_sweep(rng, stride=8191)])
    pool = pool[rng.permutation(pool.size)]
    x = np.concatenate([np.resize(pool, pool.size // 8 * 8).reshape(-1, 8), *tie_blocks]).astype(np.float32)
    e0 = fp4.ue8m0_exponent(arith.nan_amax(arith.canon_nan(t32(x)), -1), "recip").to(torch.int32)
    for extra in (0, 1, 7, None):
        e = torch.full_like(e0, 255) if extra is None else torch.clamp(e0 + extra, max=254).where(e0 < 255, e0)
        got = h.e2m1_encode8_f32(x.reshape(-1), e.numpy(), POLICY[policy])
        check(header_counts, f"e2m1 fp32 x8 block e+{extra}, {policy}", got, _e2m1_codes8(x, e, policy))


def test_div128_equals_division(h, header_counts):
    """rope.h div128 (the k rows' LayerNorm S / 128 as a multiply) against torch's correctly rounded x / 128,
    bit for bit: every float32 exponent (subnormal results and zeros included) with random fractions and
    both signs, the fraction extremes, and Inf / NaN (any NaN counts alike)."""
    rng = np.random.default_rng(128)
    exps = np.repeat(np.arange(256, dtype=np.uint32), 512)
    frac = rng.integers(0, 1 << 23, exps.size, dtype=np.uint32)
    frac[::512] = 0
    frac[1::512] = (1 << 23) - 1
    sign = rng.integers(0, 2, exps.size, dtype=np.uint32) << 31
    x = (sign | (exps << 23) | frac).view(np.float32)
    want = t32(x) / 128.0
    sub = (want != 0) & (want.abs() < 2.0 ** -126)
    assert int(sub.sum()) > 1000   # subnormal results are exercised
    check(header_counts, "div128 vs x / 128", h.div128(x), want, nan_equal=True)


def test_ue8m0_recip_exponent_bf16_every_amax(h, header_counts):
    """The bf16 form of rule recip (e2m1x8.h) on every non-negative bf16 amax, against the reference
    (a NaN amax, which only an all-NaN block gives, counts as 0)."""
    b = np.arange(0x8000, dtype=np.uint32)
    amax = t32((b << 16).view(np.float32))
    want = fp4.ue8m0_exponent(torch.nan_to_num(amax, nan=0.0, posinf=float("inf")), "recip")
    check(header_counts, "ue8m0 recip, bf16 amax", h.ue8m0_recip_exponent_bf16(b.astype(np.uint16)), want.to(torch.int32))


def test_ue8m0_recip_scales_bf16x2_every_amax(h, header_counts):
    """Both blocks' exponents at once (e2m1x8.h ue8m0_recip_scales_bf16x2, the CUDA FP4 indexer's): every
    amax 0..Inf in the low half with a random partner in the high half, and the other way round,
    against ue8m0_recip_exponent_bf16 (tested above on every amax), and each block's multiplier against
    2^(127-e) in both halves (bf16x2_inv_pow2; for e = 255 the encoder ignores it)."""
    rng = np.random.default_rng(SEED + 17)
    b = np.arange(0x7F81, dtype=np.uint32)
    other = rng.integers(0, 0x7F81, b.size, dtype=np.uint32)
    words = np.concatenate([b | (other << 16), other | (b << 16)])
    got = h.ue8m0_recip_scales_bf16x2(words)
    lo, hi = (words & 0xFFFF).astype(np.uint16), (words >> 16).astype(np.uint16)
    e_lo, e_hi = h.ue8m0_recip_exponent_bf16(lo), h.ue8m0_recip_exponent_bf16(hi)
    check(header_counts, "ue8m0 recip x2, exponent a", got[:, 0], e_lo.astype(np.int64))
    check(header_counts, "ue8m0 recip x2, exponent b", got[:, 1], e_hi.astype(np.int64))
    for col, e in ((2, e_lo), (3, e_hi)):
        e = e.astype(np.int64)
        half = np.where(e < 254, (254 - e) << 7, np.where(e == 254, 0x40, 0))
        keep = e < 255
        check(header_counts, f"ue8m0 recip x2, multiplier {'ab'[col - 2]}", got[keep, col], (half | (half << 16))[keep])
        check(header_counts, f"ue8m0 recip x2, NaN scale {'ab'[col - 2]}", got[:, col + 2], (e == 255).astype(np.int64))


def test_ue8m0_pack_exponent_bf16_every_amax(h, header_counts):
    """Rule pack on a bf16 amax's bits (e2m1x8.h, SPEC §7.2 stage 2 of bf16 stage-1 values): every amax 0..Inf."""
    b = np.arange(0x7F81, dtype=np.uint32)
    want = fp4.ue8m0_exponent(t32((b << 16).view(np.float32)), "pack")
    check(header_counts, "ue8m0 pack, bf16 amax", h.ue8m0_pack_exponent_bf16(b.astype(np.uint16)), want.to(torch.int32))


# ---- SPEC §7.2 for bf16 inputs (two_stage_x8.h: the CUDA q packer's) ----------------------------------
def _bf16_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _largest_amax_per_e1(h) -> dict:
    """e1 -> the largest bf16 amax (bits) whose rule-recip exponent is e1 (255: +Inf)."""
    b = np.arange(0x7F81, dtype=np.uint32)
    e1 = h.ue8m0_recip_exponent_bf16(b.astype(np.uint16))
    return {int(e): int(b[e1 == e].max()) for e in np.unique(e1)}


def test_fake_quant_bf16x2_every_value_every_exponent(h, header_counts):
    """Stage 1 (two_stage_x8.h fake_quant_bf16x2) of every bf16 value x at every exponent e1 a block can have
    with x in it (|x| <= its amax, or NaN; e1 = 255: every x), against the reference's stage 1 of a block
    [31 values, the largest amax of that exponent] rounded to bf16: the value, its sign (a negative that
    rounds to zero gives -0 unless its fp32 quotient is 0) and the canonical NaN, bit for bit."""
    allb = np.arange(65536, dtype=np.uint32)
    xf = _bf16_f32(allb)
    rng = np.random.default_rng(SEED + 21)
    for e1, amax in sorted(_largest_amax_per_e1(h).items()):
        a = _bf16_f32(np.array([amax]))[0]
        keep = np.isnan(xf) | (np.abs(xf) <= a)
        xs = allb[keep][rng.permutation(int(keep.sum()))]
        xs = np.concatenate([xs, np.zeros((-xs.size) % 62, dtype=np.uint32)])
        got = h.fake_quant_bf16x2_grid(xs.astype(np.uint16), np.array([e1], dtype=np.int32))[0]
        rows = xs.reshape(-1, 31)
        blk = np.concatenate([_bf16_f32(rows), np.full((rows.shape[0], 1), a, dtype=np.float32)], axis=1)
        want = fp4.fp4_fake_quant(t32(blk), 32, "ue8m0", out_dtype=torch.bfloat16).view(torch.int16).numpy()
        check(header_counts, "fake_quant bf16x2, every x at every e1", got.view(np.int16), want[:, :31].reshape(-1))


def test_two_stage_exponents_every_amax(h, header_counts):
    """Both stages' exponents from a block's bf16 amax (two_stage_exponents_bf16): every amax 0..Inf, against the
    reference two-stage quantizer on the block [amax, 0, ..., 0] (its stored exponent is e2)."""
    b = np.arange(0x7F81, dtype=np.uint32)
    got = h.two_stage_exponents_bf16(b.astype(np.uint16))
    blk = np.zeros((b.size, 32), dtype=np.float32)
    blk[:, 0] = _bf16_f32(b)
    want_e1 = fp4.ue8m0_exponent(t32(blk[:, 0]), "recip").numpy()
    _, want_e2 = fp4.sglang_two_stage(t32(blk), "rne")
    check(header_counts, "two-stage e1, bf16 amax", got[:, 0], want_e1.astype(np.int32))
    check(header_counts, "two-stage e2, bf16 amax", got[:, 1], want_e2[:, 0].numpy().astype(np.int32))


def _sign_threshold(e1: int) -> float:
    """The largest bf16 |x| whose fp32 quotient x / 2^(e1-127) is zero (0 if only 0 is)."""
    pos = torch.from_numpy(_bf16_f32(np.arange(0x7F80, dtype=np.uint32)))
    zero = (pos / arith.pow2(torch.tensor(e1))) == 0
    return float(pos[zero].max())


def test_two_stage_params_every_amax(h, header_counts):
    """The fast path's block parameters (two_stage_params_bf16x2): every amax in the low half with a random
    partner in the high half and the other way round. A block is fast exactly where e1 < 255 and
    d = e1 - e2 is 0 or 1 (two_stage_exponents_bf16, checked above), except the blocks whose d rule pack's
    floor turns from 1 into 0 (e1 = e2 = 114 with g_max = 3: amax fraction 0x41..0x5F), which the parameters
    leave to the general path; on fast blocks the exponent, 2^(127-e1), the clamp (6, or 3 for d = 1),
    2^(d-126) and the sign threshold are as two_stage_x8.h says."""
    rng = np.random.default_rng(SEED + 22)
    b = np.arange(0x7F81, dtype=np.uint32)
    other = rng.integers(0, 0x7F81, b.size, dtype=np.uint32)
    words = np.concatenate([b | (other << 16), other | (b << 16)])
    got = h.two_stage_params_bf16x2(words)
    thr_of = {}
    n_fast = 0
    for half in (0, 1):
        hb = (words >> (16 * half)) & 0xFFFF
        ex = h.two_stage_exponents_bf16(hb.astype(np.uint16)).astype(np.int64)
        e1, e2 = ex[:, 0], ex[:, 1]
        d = e1 - e2
        frac = hb & 0x7F
        floored = (e1 == 114) & (e2 == 114) & (frac >= 0x41) & (frac <= 0x5F)
        assert int(floored.sum()) > 0
        fast = (e1 < 255) & ((d == 0) | (d == 1)) & ~floored
        n_fast += int(fast.sum())
        check(header_counts, "two-stage params, fast", got[:, 10 + half], fast.astype(np.int64))
        f = fast
        both = lambda v: v | (v << 16)  # noqa: E731
        check(header_counts, "two-stage params, e2", got[f, 8 + half], e2[f])
        check(header_counts, "two-stage params, 2^(127-e1)", got[f, 0 + half], both((254 - e1[f]) << 7))
        check(header_counts, "two-stage params, clamp", got[f, 2 + half], both(np.where(d[f] == 1, 0x4040, 0x40C0)))
        check(header_counts, "two-stage params, 2^(d-126)", got[f, 4 + half], both(np.where(d[f] == 1, 0x0100, 0x0080)))
        for e in np.unique(e1[f]):
            if int(e) not in thr_of:
                t = np.float32(_sign_threshold(int(e)))
                thr_of[int(e)] = int(np.array([t]).view(np.uint32)[0] >> 16)
        want_thr = np.array([thr_of[int(e)] for e in e1[f]], dtype=np.int64)
        check(header_counts, "two-stage params, sign threshold", got[f, 6 + half], both(want_thr))
    assert n_fast > 0.6 * words.size   # most normal amax are fast


def test_two_stage8_fast_equals_general_every_value(h, header_counts):
    """The fast stage 2 (two_stage8_bf16_fast) equals the general one (two_stage8_bf16: stage 1 above, then the
    e2m1x8.h encoder checked on every value at every exponent) on every bf16 value that a fast block can
    hold, for every parameter set a fast block can have (e1, d: the parameters depend on nothing else), every
    policy. The values: |x| <= the largest amax of that set, or NaN."""
    rng = np.random.default_rng(SEED + 23)
    b = np.arange(0x7F81, dtype=np.uint32)
    ex = h.two_stage_exponents_bf16(b.astype(np.uint16)).astype(np.int64)
    fast = h.two_stage_params_bf16x2(b)[:, 10].astype(bool)
    allb = np.arange(65536, dtype=np.uint32)
    xf = _bf16_f32(allb)
    classes = {}
    for i in np.nonzero(fast)[0]:
        classes[(int(ex[i, 0]), int(ex[i, 1]))] = int(b[i])   # b ascending: the largest amax of the class
    assert len(classes) > 250
    for (e1, e2), amax in sorted(classes.items()):
        a = _bf16_f32(np.array([amax]))[0]
        keep = np.isnan(xf) | (np.abs(xf) <= a)
        xs = allb[keep][rng.permutation(int(keep.sum()))]
        xs = np.concatenate([xs, np.zeros((-xs.size) % 8, dtype=np.uint32)]).astype(np.uint16)
        got, want = h.two_stage8_fast_and_general(xs, amax)
        check(header_counts, "two-stage fast vs general, every x", got, want)


def _two_stage_rows(rng, rows: int) -> np.ndarray:
    """bf16 rows [rows, 128] (bits) for the two-stage tests: the special rows above at every binade, and blocks
    built around amax values at the fast path's edges (fraction 0x40 / 0x41 / 0x5F / 0x60, e1 - d near 114,
    e1 = 253, Inf) with values down to the sign threshold, both signs, NaN and zeros."""
    x = torch.from_numpy(_special_rows(rng, rows, 128)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    x = x.astype(np.uint32)
    edge_frac = np.array([0x00, 0x01, 0x3F, 0x40, 0x41, 0x42, 0x5E, 0x5F, 0x60, 0x61, 0x7F], dtype=np.uint32)
    edge_exp = np.concatenate([np.arange(110, 121), np.arange(140, 156), np.arange(245, 255), [1, 2, 3, 127, 128]])
    nb = rows * 4 // 2                                  # half of the blocks
    blocks = x.reshape(-1, 32)
    idx = rng.choice(blocks.shape[0], nb, replace=False)
    amax = (rng.choice(edge_exp, nb).astype(np.uint32) << 7) | rng.choice(edge_frac, nb)
    amax = np.minimum(amax, 0x7F80)
    af = _bf16_f32(amax).astype(np.float64)
    scale = np.where(rng.random((nb, 32)) < 0.2, 2.0 ** -rng.integers(0, 160, (nb, 32)), rng.random((nb, 32)))
    vals = np.where(np.isinf(af)[:, None], rng.standard_normal((nb, 32)), af[:, None] * scale)
    vals *= np.where(rng.random((nb, 32)) < 0.5, -1.0, 1.0)
    vals = torch.from_numpy(vals.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    vals = vals.astype(np.uint32)
    vals[:, 0] = amax | np.where(rng.random(nb) < 0.5, 0x8000, 0)
    sel = rng.random((nb, 32))
    vals[sel < 0.02] = 0x7FC0
    vals[(sel >= 0.02) & (sel < 0.04)] = 0x8000
    vals[:, 0] = np.where(sel[:, 0] < 0.04, amax, vals[:, 0])   # the amax stays
    blocks[idx] = vals
    return blocks.reshape(rows, 128).astype(np.uint16)


@pytest.mark.parametrize("policy", list(POLICY))
def test_two_stage_rows_vs_reference(h, header_counts, policy):
    """Whole rows through the q packer's steps for bf16 inputs (the harness's two_stage_rows_bf16: the lanes'
    pairing, the block amax, the parameters, the fast path or the general one) against the reference two-stage
    quantizer (SPEC §7.2), payload and exponents, bit for bit; both paths are exercised."""
    rng = np.random.default_rng(SEED + 24)
    bits = _two_stage_rows(rng, 40000)
    payload, exps, n_fast = h.two_stage_rows_bf16(bits, POLICY[policy])
    wp, we = fp4.sglang_two_stage(t32(_bf16_f32(bits)), policy)
    nblocks = bits.shape[0] * 4
    assert 0.3 * nblocks < n_fast < 0.95 * nblocks, n_fast
    check(header_counts, f"two-stage rows exps {policy}", exps, we)
    check(header_counts, f"two-stage rows payload {policy}", payload, wp)


def test_fp8_132_rows_16_apart(h):
    """The scorer's copy loop steps 16 positions by kFp8132Rows16 bytes, plain and preshuffled."""
    for P in (16, 32, 64, 128):
        t = np.arange(0, 4 * P, dtype=np.int64)
        t = t[(t % P) + 16 < P]
        d = np.arange(t.size, dtype=np.int64) % 128
        for pre in (False, True):
            step = h.fp8_132_data_offset(t + 16, P, d, pre) - h.fp8_132_data_offset(t, P, d, pre)
            assert (step == h.kFp8132Rows16).all(), (P, pre)


def test_layouts_slots_past_32_bits(h, header_counts):
    """layouts.h splits a slot into (page, place) in 32 bits when the slot and P fit, else in 64 bits:
    slots on both sides of 2^32 and far past it, with page sizes that do and do not divide them, against
    the reference layouts."""
    rng = np.random.default_rng(SEED + 19)
    t = np.concatenate([np.arange(2**32 - 70, 2**32 + 70), rng.integers(2**32, 2**45, 200), rng.integers(0, 2**32, 200)])
    t = t.astype(np.int64)
    for P in (16, 64, 48):
        tt, bb = np.repeat(t, 4), np.tile(np.array([0, 17, 40, 63], dtype=np.int64), t.size)
        check(header_counts, f"packed68_payload_offset, large slots P={P}", h.packed68_payload_offset(tt, P, bb),
              layouts.packed68_payload_offset(torch.from_numpy(tt), P, torch.from_numpy(bb)))
        check(header_counts, f"aiter_fp4_data_offset, large slots P={P}", h.aiter_fp4_data_offset(tt, P, bb),
              layouts.aiter_fp4_data_offset(torch.from_numpy(tt), P, torch.from_numpy(bb)))
        check(header_counts, f"fp8_132_scale_offset, large slots P={P}", h.fp8_132_scale_offset(t, P),
              layouts.fp8_132_scale_offset(torch.from_numpy(t), P))


@pytest.mark.parametrize("policy", list(POLICY))
def test_e2m1_fp32_sweep(h, header_counts, policy):
    rng = np.random.default_rng(SEED + 3)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, 2.0**-126], dtype=np.float32)
    v = np.concatenate([fp32_sweep(rng, stride=4099), around(mids, 64)])
    check(header_counts, f"e2m1 fp32 sweep, {policy}", h.e2m1_encode(v, POLICY[policy]), fp4.e2m1_encode(t32(v), policy))


def test_e2m1_decode_pack(h, header_counts):
    c = np.arange(256, dtype=np.uint8)
    check(header_counts, "e2m1_decode", h.e2m1_decode(c), fp4.e2m1_decode(torch.from_numpy(c)))
    rng = np.random.default_rng(SEED + 4)
    codes = rng.integers(0, 16, (1000, 128), dtype=np.uint8)
    check(header_counts, "pack_nibbles", h.pack_nibbles(codes), fp4.pack_nibbles(torch.from_numpy(codes)))


def _amax_sweep(rng) -> np.ndarray:
    a = np.abs(fp32_sweep(rng))
    # Every binade: 6 * 2^k and the fp32 neighbours around it and around 2^k (the floors of both rules).
    k = np.arange(-149, 128, dtype=np.float64)
    edges = np.concatenate([6.0 * 2.0 ** k, 2.0 ** k, 448.0 * 2.0 ** k, 240.0 * 2.0 ** k, [1e-4, 6e-4, 1e-10, 4.48e-8]])
    edges = edges[edges < 3.4e38].astype(np.float32)
    extra = around(edges, 4)
    return np.concatenate([a, np.abs(extra), np.array([0.0, np.inf, np.nan], dtype=np.float32)])


@pytest.mark.parametrize("rule", list(RULE))
def test_ue8m0(h, header_counts, rule):
    rng = np.random.default_rng(SEED + 5)
    a = _amax_sweep(rng)
    check(header_counts, f"ue8m0 {rule}", h.ue8m0_exponent(a, RULE[rule]), fp4.ue8m0_exponent(t32(a), rule))


def _special_rows(rng, rows: int, n: int) -> np.ndarray:
    """Rows of n values over many binades, with zero / -0 / NaN / ±Inf / subnormal / huge blocks."""
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x *= (2.0 ** rng.integers(-150, 125, (rows, n // 32, 1))).repeat(32, axis=2).reshape(rows, n).astype(np.float32)
    sel = rng.random((rows, n))
    x[sel < 0.01] = 0.0
    x[(sel >= 0.01) & (sel < 0.02)] = -0.0
    x[(sel >= 0.02) & (sel < 0.025)] = np.nan
    x[(sel >= 0.025) & (sel < 0.028)] = np.inf
    x[(sel >= 0.028) & (sel < 0.031)] = -np.inf
    x[(sel >= 0.031) & (sel < 0.035)] = f32(0x80000001)
    x[(sel >= 0.035) & (sel < 0.04)] = np.float32(3.4e38) * np.sign(x[(sel >= 0.035) & (sel < 0.04)])
    x[0] = 0.0
    x[1] = -0.0
    x[2] = np.nan
    x[3, :64] = -np.inf
    x[4] = f32(np.arange(1, n + 1) | 0x80000000)  # negative subnormals
    x[5] = np.float32(5.0) * np.float32(2.0 ** -20)
    x[6, ::2] = np.nan
    # Values that sit exactly on the midpoints after scaling, and tiny negatives rounding to -0.
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, 6.0, -6.0, -0.1, 0.1, -1e-3, 1e-3],
                    dtype=np.float32)
    x[7:9] = np.tile(mids, (2, n // 16))
    return x


@pytest.mark.parametrize("rule", list(RULE))
@pytest.mark.parametrize("policy", list(POLICY))
def test_fp4_quantize_blocks(h, header_counts, policy, rule):
    rng = np.random.default_rng(SEED + 6)
    x = _special_rows(rng, 3000, 128)
    packed, exps = h.fp4_quantize(x, POLICY[policy], RULE[rule])
    wp, we = fp4.fp4_quantize(t32(x), policy, rule)
    check(header_counts, f"fp4_quantize exps {policy}/{rule}", exps, we)
    check(header_counts, f"fp4_quantize payload {policy}/{rule}", packed, wp)


def test_fp4_fake_quant(h, header_counts):
    rng = np.random.default_rng(SEED + 7)
    x = _special_rows(rng, 2000, 128)
    got = h.fp4_fake_quant(x)
    want = fp4.fp4_fake_quant(t32(x), 32, "ue8m0", out_dtype=torch.float32)
    check(header_counts, "fp4_fake_quant (fp32)", got, want)
    check(header_counts, "fp4_fake_quant by exponent (fp32)", h.fp4_fake_quant(x, True), want)
    # bf16 bits, NaN included: the reference stores the canonical bf16 NaN 0x7FC0, as round_bf16 does.
    want16 = fp4.fp4_fake_quant(t32(x), 32, "ue8m0", out_dtype=torch.bfloat16).view(torch.int16).numpy()
    check(header_counts, "fp4_fake_quant (bf16 bits)", h.round_bf16(got).view(np.int16), want16)


# ---- SPEC §4: FP8 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("flavour", list(FLAVOUR))
def test_fp8_encode(h, header_counts, flavour):
    rng = np.random.default_rng(SEED + 8)
    vals = fp8.fp8_decode(torch.arange(256, dtype=torch.uint8), flavour).numpy()
    vals = np.unique(np.abs(vals[np.isfinite(vals)]))
    mids = (vals[1:].astype(np.float64) + vals[:-1]) / 2
    edges = np.concatenate([vals, mids.astype(np.float32), [464.0, 480.0, 248.0, 256.0, 3.4e38, 2.0**-149]]).astype(np.float32)
    sub = rng.uniform(-2.0 ** -6, 2.0 ** -6, 200_000).astype(np.float32)
    x = np.concatenate([fp32_sweep(rng), around(edges, 8), sub,
                        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, f32(0xFFC00000)[()], f32(0x7F800001)[()]],
                                 dtype=np.float32)])
    check(header_counts, f"fp8_encode {flavour}", h.fp8_encode(x, FLAVOUR[flavour]), fp8.fp8_encode(t32(x), flavour))
    c = np.arange(256, dtype=np.uint8)
    check(header_counts, f"fp8_decode {flavour}", h.fp8_decode(c, FLAVOUR[flavour]),
          fp8.fp8_decode(torch.from_numpy(c), flavour), nan_equal=True)


@pytest.mark.parametrize("flavour", list(FLAVOUR))
def test_fp8_scales_and_rows(h, header_counts, flavour):
    rng = np.random.default_rng(SEED + 9)
    a = _amax_sweep(rng)
    a = a[~np.isnan(a)]
    for role in ("q", "k"):
        for fmt in (None, "ue8m0"):
            got = h.fp8_row_scale(a, FLAVOUR[flavour], 0 if role == "q" else 1, fmt == "ue8m0")
            check(header_counts, f"fp8_row_scale {flavour}/{role}/{fmt}", got,
                  fp8.fp8_scale(t32(a), flavour, role, fmt), nan_equal=True)
    x = _special_rows(rng, 1500, 256)
    x[10:] = np.nan_to_num(x[10:], nan=0.0, posinf=1.0, neginf=-1.0)  # most rows finite, some not
    for role in ("q", "k"):
        for fmt in (None, "ue8m0"):
            codes, scales = h.fp8_quantize(x, FLAVOUR[flavour], 0 if role == "q" else 1, fmt == "ue8m0")
            wc, ws = fp8.fp8_quantize(t32(x), flavour, role, fmt)
            check(header_counts, f"fp8_quantize scales {flavour}/{role}/{fmt}", scales, ws)
            check(header_counts, f"fp8_quantize codes {flavour}/{role}/{fmt}", codes, wc)


# ---- SPEC §5 ------------------------------------------------------------------------------------------
def test_rope(h, header_counts):
    rng = np.random.default_rng(SEED + 10)
    n = 500_000
    a, b = (rng.standard_normal((2, n)) * 2.0 ** rng.integers(-20, 20, (2, n))).astype(np.float32)
    ang = rng.uniform(-np.pi, np.pi, n)
    c, s = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    ga, gb = h.rope_pair(a, b, c, s)
    wa = t32(a) * t32(c) - t32(b) * t32(s)   # SPEC §5 with torch ops, one rounding each
    wb = t32(b) * t32(c) + t32(a) * t32(s)
    check(header_counts, "rope_pair a'", ga, wa, nan_equal=True)
    check(header_counts, "rope_pair b'", gb, wb, nan_equal=True)
    # The FMA hazard (SPEC §8): a*c - b*s with a*c == b*s in fp32 but not exactly.
    fa = np.float32(1.0000001)
    ga, _ = h.rope_pair(np.array([fa]), np.array([fa]), np.array([fa]), np.array([fa]))
    check(header_counts, "rope_pair no FMA", ga, np.array([0.0], dtype=np.float32))

    R = 3000
    x = (rng.standard_normal((R, 128)) * 8).astype(np.float32)
    ang = rng.uniform(-np.pi, np.pi, (R, 32))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    for neox in (True, False):
        for tail in (True, False):
            got = h.rope_row(x, cos, sin, neox, tail)
            want = transforms.rope(t32(x), t32(cos), t32(sin), neox, tail)
            check(header_counts, f"rope_row neox={neox} tail={tail}", got, want)
            # The index helpers: rotate a one-hot probe through the reference.
            for j in range(32):
                ia, ib = h.rope_dims(j, neox, tail)
                probe = torch.zeros(1, 128)
                probe[0, ia] = 1.0
                cs = torch.zeros(1, 32)
                sn = torch.zeros(1, 32)
                sn[0, j] = 1.0   # a' = -b s, b' = a s: the probe moves from ia to ib
                r = transforms.rope(probe, cs, sn, neox, tail)
                check(header_counts, "rope_dims", np.array([ia, ib]),
                      np.array([ia, int(torch.argmax(r[0]))]))
    pos = np.concatenate([np.arange(-40, 5000, dtype=np.int64), np.array([2**40, -2**40], dtype=np.int64)])
    for ratio in (1, 4, 128):
        check(header_counts, "rope_position", h.rope_position(pos, 4096, ratio),
              transforms.rope_positions(torch.from_numpy(pos), 4096, ratio))


def test_reference_norms_use_a_correctly_rounded_sqrt():
    """SPEC §0.1: torch's CPU fp32 sqrt is off by one ulp for ~15 % of inputs on some builds (torch 2.13
    +cpu on AVX-512); the reference takes it in fp64 and rounds once, which is correctly rounded."""
    x = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 4 + 1
    want = 1.0 / torch.sqrt(x.double()).float()
    assert torch.equal(transforms._inv_sqrt(x), want)


def test_norms(h, header_counts):
    rng = np.random.default_rng(SEED + 11)
    for scale in (1e-20, 1e-3, 1.0, 1e3, 1e18):
        x = (rng.standard_normal((2000, 128)) * scale + rng.standard_normal((2000, 1)) * scale).astype(np.float32)
        w = rng.standard_normal(128).astype(np.float32)
        b = rng.standard_normal(128).astype(np.float32)
        eps = float(rng.choice([1e-6, 1e-5, 1e-12]))
        check(header_counts, "layer_norm", h.layer_norm(x, w, b, eps),
              transforms.layer_norm(t32(x), t32(w), t32(b), eps))
        check(header_counts, "rms_norm 128", h.rms_norm(x, w, eps), transforms.rms_norm(t32(x), t32(w), eps))
        x5 = (rng.standard_normal((500, 512)) * scale).astype(np.float32)
        w5 = rng.standard_normal(512).astype(np.float32)
        check(header_counts, "rms_norm 512", h.rms_norm(x5, w5, eps), transforms.rms_norm(t32(x5), t32(w5), eps))


@pytest.mark.parametrize("n", [2, 32, 64, 128, 256, 512, 1024])
def test_hadamard(h, header_counts, n):
    rng = np.random.default_rng(SEED + n)
    x = (rng.standard_normal((2000 if n <= 128 else 300, n)) * 2.0 ** rng.integers(-10, 10, (1, n))).astype(np.float32)
    check(header_counts, f"hadamard n={n}", h.hadamard(x), transforms.hadamard(t32(x)))
    want_c = arith.INV_SQRT128 if n == 128 else torch.tensor(n ** -0.5, dtype=torch.float32).item()
    check(header_counts, "hadamard_scale", np.array([h.hadamard_scale(n)], dtype=np.float32),
          np.array([want_c], dtype=np.float32))


# ---- SPEC §6 ------------------------------------------------------------------------------------------
def _grid(*sizes):
    g = np.meshgrid(*[np.arange(s, dtype=np.int64) for s in sizes], indexing="ij")
    return [a.reshape(-1) for a in g]


def _covers(counts, name, offsets, total):
    """Offsets of every (slot, byte) of a whole cache hit every byte of it exactly once."""
    hist = np.bincount(offsets, minlength=total)
    check(counts, name + " (bijective)", np.array([hist.size, hist.min(), hist.max()]), np.array([total, 1, 1]))


@pytest.mark.parametrize("P", [16, 64])
def test_layouts_whole_caches(h, header_counts, P):
    NB = 5
    slots = NB * P
    t, d = _grid(slots, 64)
    tt = torch.from_numpy(t)
    td = torch.from_numpy(d)
    got_pay = h.packed68_payload_offset(t, P, d)
    check(header_counts, "packed68_payload_offset", got_pay, layouts.packed68_payload_offset(tt, P, td))
    t4, g4 = _grid(slots, 4)
    got_sc = h.packed68_scale_offset(t4, P, g4)
    check(header_counts, "packed68_scale_offset", got_sc,
          layouts.packed68_scale_offset(torch.from_numpy(t4), P, torch.from_numpy(g4)))
    _covers(header_counts, "packed68", np.concatenate([got_pay, got_sc]), NB * P * 68)

    t128, d128 = _grid(slots, 128)
    for pre in (False, True):
        got_data = h.fp8_132_data_offset(t128, P, d128, pre)
        check(header_counts, f"fp8_132_data_offset preshuffle={pre}", got_data,
              layouts.fp8_132_data_offset(torch.from_numpy(t128), P, torch.from_numpy(d128), pre))
        ts = np.arange(slots, dtype=np.int64)
        got_scale = h.fp8_132_scale_offset(ts, P)
        check(header_counts, "fp8_132_scale_offset", got_scale, layouts.fp8_132_scale_offset(torch.from_numpy(ts), P))
        scale_bytes = (got_scale[:, None] + np.arange(4)).reshape(-1)
        _covers(header_counts, f"fp8_132 preshuffle={pre}", np.concatenate([got_data, scale_bytes]), NB * P * 132)

    got_ad = h.aiter_fp4_data_offset(t, P, d)
    check(header_counts, "aiter_fp4_data_offset", got_ad, layouts.aiter_fp4_data_offset(tt, P, td))
    _covers(header_counts, "aiter_fp4 data", got_ad, NB * 4 * P * 16)
    got_as = h.aiter_fp4_scale_offset(t4, P, g4)
    check(header_counts, "aiter_fp4_scale_offset", got_as,
          layouts.aiter_fp4_scale_offset(torch.from_numpy(t4), P, torch.from_numpy(g4)))
    _covers(header_counts, "aiter_fp4 scale", got_as, NB * 4 * P)
    o = np.arange(P, dtype=np.int64)
    check(header_counts, "aiter_sflat", h.aiter_sflat(o, P), layouts.aiter_sflat(torch.from_numpy(o), P))


@pytest.mark.parametrize("H", [16, 32, 64, 128])
def test_q_scale_offsets(h, header_counts, H):
    T = 7
    qs_pad = h.aiter_q_scale_pad(H)
    check(header_counts, "aiter_q_scale_pad", np.array([qs_pad]), np.array([layouts.aiter_q_scale_pad(H)]))
    t, hh, g = _grid(T, 16 * qs_pad, 4)   # every head, pad entries included
    got = h.aiter_q_scale_offset(t, hh, g, H)
    want = layouts.aiter_q_scale_offset(torch.from_numpy(t), torch.from_numpy(hh), torch.from_numpy(g), H)
    check(header_counts, f"aiter_q_scale_offset H={H}", got, want)
    _covers(header_counts, f"aiter q scale H={H}", got, T * 4 * 16 * qs_pad)

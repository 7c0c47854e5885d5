"""SPEC §7.6 compress_kv (the DeepSeek-V4 compressor) on the CPU reference backend.

- an independent numpy.float32 oracle written here from the SPEC (exp_ds, the window pool with the canonical
  sums, RMSNorm, tail interleaved RoPE, Hadamard, bf16 rounding points, FP4 stage 1), sharing no code with
  dsaquant.reference; it reads every window from the full history of a sequence, never from a ring;
- chunking invariance (whole / random chunks / token by token), bf16 == fp32 inputs, ragged batches against
  the oracle for every quant mode and layout, the §7.6 test-4 rounding case, every bad input of §7.6;
- tolerance against a float64 torch implementation of dsv4-ref's Compressor semantics, per preset.
Quantized rows are compared through dsaquant.formats (quantizers tested in test_formats_golden.py) and the
§6 layout readers (tested with literal offsets in test_layouts.py).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import dsaquant
from dsaquant import formats
from dsaquant import testing as tt
from dsaquant import compress
from dsaquant.reference import compress as rc
from dsaquant.reference import layouts as L

POISON = 0xA5
F = np.float32
BF16 = torch.bfloat16


# ------------------------------------------------------------------------------------------------
# numpy.float32 oracle (SPEC §0, §5, §7.2 stage 1, §7.6), independent of dsaquant.reference
# ------------------------------------------------------------------------------------------------
def f32(b: int) -> F:
    return np.array([b], dtype=np.uint32).view(np.float32)[0]


def pow2(e) -> np.ndarray:
    return (np.asarray(e, dtype=np.int64).astype(np.uint32) << 23).view(np.float32)


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def bf16(a) -> np.ndarray:
    a = np.asarray(a, dtype=np.float32)
    b = a.view(np.uint32).astype(np.uint64)
    r = ((((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16) & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(a), a, r).astype(np.float32)


def bf16_bits(a) -> np.ndarray:
    return (bits(bf16(a)) >> 16).astype(np.uint16)


def csum(x) -> np.ndarray:
    """§0.2 canonical sum over the last dim (4*m)."""
    x = np.asarray(x, dtype=np.float32)
    p = ((x[..., 0::4] + x[..., 1::4]) + x[..., 2::4]) + x[..., 3::4]
    m = p.shape[-1]
    idx, s = np.arange(m), m // 2
    while s:
        p = p + p[..., idx ^ s]
        s //= 2
    return p[..., 0]


LOG2E, LN2_HI, LN2_LO = f32(0x3FB8AA3B), f32(0x3F317200), f32(0x35BFBE8E)
POLY = [f32(b) for b in (0x39500D01, 0x3AB60B61, 0x3C088889, 0x3D2AAAAB, 0x3E2AAAAB, 0x3F000000, 0x3F800000)]


def np_exp_ds(x) -> np.ndarray:
    """§0.7, step by step in float32."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        xs = np.where(np.isinf(x), F(0), x).astype(F)
        n = np.rint(xs * LOG2E).astype(F)
        r = (xs - n * LN2_HI) - n * LN2_LO
        a = np.full(x.shape, POLY[0], dtype=F)
        for c in POLY[1:]:
            a = c + r * a
        p = F(1) + r * a
        ni = np.clip(np.nan_to_num(n, nan=0.0), -300, 300).astype(np.int64)
        y = np.where(ni >= -126, p * pow2(np.clip(ni + 127, 1, 254)),
                     (p * pow2(np.clip(ni + 191, 1, 254))) * pow2(63))
        y = np.where(ni < -151, F(0), y)
        y = np.where(np.isneginf(x), F(0), y)
        return np.where(np.isnan(x), x, y).astype(F)


def np_pool(sig, kv, incl) -> np.ndarray:
    """§7.6 step 2 over the last dim (the window)."""
    sig, kv = np.asarray(sig, F), np.asarray(kv, F)
    incl = np.broadcast_to(incl, sig.shape)
    with np.errstate(invalid="ignore"):
        m = np.fmax.reduce(np.where(incl, sig, F(np.nan)), axis=-1)
        e = np.where(incl, np_exp_ds(sig - m[..., None]), F(0))
        S = csum(e)
        w = e / S[..., None]
        y = csum(w * np.where(incl, kv, F(0)))
    bad = (~incl | (sig == -np.inf)).all(-1) | (incl & (np.isnan(sig) | (sig == np.inf))).any(-1)
    return np.where(bad, F(np.nan), y).astype(F)


def np_hadamard(x) -> np.ndarray:
    x = np.array(x, dtype=F)
    n, h = x.shape[-1], 1
    while h < n:
        y = x.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        a, b = y[..., 0, :].copy(), y[..., 1, :].copy()
        x = np.stack((a + b, a - b), axis=-2).reshape(*x.shape[:-1], n)
        h *= 2
    return x * f32(0x3DB504F3)


def np_rope_tail(y, c, s) -> np.ndarray:
    y = np.array(y, dtype=F)
    D = y.shape[-1]
    ia, ib = np.arange(D - 64, D, 2), np.arange(D - 63, D, 2)
    a, b = y[..., ia].copy(), y[..., ib].copy()
    y[..., ia] = a * c - b * s
    y[..., ib] = b * c + a * s
    return y


GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def grid_rne(a) -> np.ndarray:
    """|y| <= 6 rounded half-to-even onto the E2M1 grid (values)."""
    a = np.asarray(a, dtype=np.float64)
    d = np.abs(a[..., None] - GRID)
    best = d.min(-1, keepdims=True)
    cand = d == best
    lo, hi = np.argmax(cand, -1), 7 - np.argmax(cand[..., ::-1], -1)
    return GRID[np.where(lo % 2 == 0, lo, hi)].astype(F)


def np_stage1(x, rule) -> np.ndarray:
    """§7.2 stage 1 with exponent rule `rule`, blocks of 32 -> bf16 values (float32)."""
    xb = np.asarray(x, F).reshape(*np.shape(x)[:-1], -1, 32)
    amax = np.abs(xb).max(-1)
    if rule == "recip":
        f = np.maximum(amax, F(6 * 2.0 ** -126)) * f32(0x3E2AAAAB)
    else:
        f = np.maximum(amax / F(6), f32(0x38D1B717))
    b = bits(f).astype(np.int64)
    e = ((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0)
    if rule == "pack":
        e = np.clip(e, 1, 254)
    s = pow2(e)[..., None]
    y = np.clip(xb / s, F(-6), F(6))
    r = grid_rne(np.abs(y))
    q = np.where(y < 0, -r, r).astype(F)
    return bf16(q * s).reshape(np.shape(x))


def oracle(hist_kv, hist_sig, p, *, ratio, overlap, nw, eps, cos_t, sin_t, points, had):
    """y (float32 [D]) of the boundary at position p of one sequence, from its full history
    hist_kv / hist_sig = fl(score + ape[pos % ratio]) [L, C] (float32)."""
    C = hist_kv.shape[1]
    D = C // 2 if overlap else C
    K = ratio * (2 if overlap else 1)
    k = np.arange(K)
    s = p - K + 1 + k
    incl = s >= 0
    half = np.where(overlap & (k < ratio), 0, D if overlap else 0)
    cols = half[:, None] + np.arange(D)
    sc = np.maximum(s, 0)[:, None]
    y = np_pool(hist_sig[sc, cols].T, hist_kv[sc, cols].T, incl[None, :])
    if "pool" in points:
        y = bf16(y)
    inv = F(1) / np.sqrt(csum(y * y) / F(D) + F(eps))
    y = nw * (y * inv)
    if "norm" in points:
        y = bf16(y)
    pos = min(max(p + 1 - ratio, 0), cos_t.shape[0] - 1)
    y = np_rope_tail(y, cos_t[pos], sin_t[pos])
    if "rope" in points:
        y = bf16(y)
    if had:
        y = np_hadamard(y)
        if "hadamard" in points:
            y = bf16(y)
    return y.astype(F)


# ------------------------------------------------------------------------------------------------
# case builder
# ------------------------------------------------------------------------------------------------
MODES = {  # name -> (quant_mode, knobs)
    "none": ("none", {}),
    "fp4_packed68": ("fp4", dict(layout="packed68")),
    "fp4_packed68_pack_threshold": ("fp4", dict(layout="packed68", scale_rule="pack", rounding="threshold")),
    "fp4_aiter": ("fp4", dict(layout="aiter_fp4", rounding="hardware")),
    "fp4_packed68_no_overlap": ("fp4", dict(layout="packed68", overlap=False)),
    "fp4_sim": ("fp4_sim", {}),
    "fp4_sim_pack": ("fp4_sim", dict(scale_rule="pack")),
    "fp8_ue8m0_preshuffle": ("fp8", dict(preshuffle=True)),
    "fp8_fp32scale_fnuz": ("fp8", dict(scale_fmt=None, fp8_flavour="e4m3fnuz")),
}


def make_cache(quant_mode, knobs, D, capacity):
    """(cache, cache_scale, P), poisoned, with at least `capacity` slots."""
    layout = knobs.get("layout", "packed68")
    P = 64 if (quant_mode == "fp4" and layout == "aiter_fp4") else 16
    NB = max(1, -(-capacity // P))
    scale = None
    if quant_mode in ("none", "fp4_sim"):
        cache = tt.poisoned((NB, P, D), BF16, "cpu")
    elif quant_mode == "fp4" and layout == "aiter_fp4":
        cache = tt.poisoned((NB, 1, 4, P, 16), torch.uint8, "cpu")
        scale = tt.poisoned((NB, 1, 4, P), torch.uint8, "cpu")
    elif quant_mode == "fp4":
        cache = tt.poisoned((NB, P * 68), torch.uint8, "cpu")
    else:
        cache = tt.poisoned((NB, P * 132), torch.uint8, "cpu")
    return cache, scale, P


def expected_cache(cache0, scale0, P, quant_mode, knobs, slots, ys):
    """Poisoned copies of the cache with the oracle rows `ys` [N, D] written at `slots` (all valid)."""
    cache, scale = cache0.clone(), None if scale0 is None else scale0.clone()
    if not len(slots):
        return cache, scale
    s = torch.tensor(slots, dtype=torch.int64)
    y = torch.from_numpy(np.stack(ys).astype(F))
    layout = knobs.get("layout", "packed68")
    if quant_mode == "none":
        cache.view(-1, y.shape[1]).view(torch.int16)[s] = torch.from_numpy(bf16_bits(y.numpy()).view(np.int16))
    elif quant_mode == "fp4_sim":
        st = np_stage1(y.numpy(), knobs.get("scale_rule", "recip"))
        cache.view(-1, y.shape[1]).view(torch.int16)[s] = torch.from_numpy(bf16_bits(st).view(np.int16))
    elif quant_mode == "fp4":
        payload, exps = formats.fp4_quantize(y, knobs.get("rounding", "rne"), knobs.get("scale_rule", "recip"))
        if layout == "aiter_fp4":
            L.write_aiter_fp4(cache, scale, s, payload, exps, P)
        else:
            L.write_packed68(cache, s, payload, exps, P)
    else:
        codes, sc = formats.fp8_quantize(y, knobs.get("fp8_flavour", "e4m3fn"), "k", knobs.get("scale_fmt", "ue8m0"))
        L.write_fp8_132(cache, s, codes, sc[:, 0], P, knobs.get("preshuffle", False))
    return cache, scale


def u8(t):
    return t.contiguous().view(torch.uint8).reshape(-1)


def same_bytes(a, b) -> bool:
    return torch.equal(u8(a), u8(b))


class Seqs:
    """B sequences with full histories (positions 0 .. start+len-1) and a ring prefilled with the rows a call
    starting at start_pos may read (the K positions before it); the rest of the ring is NaN garbage."""

    def __init__(self, starts, lens, *, ratio=4, overlap=None, D=128, dtype=torch.float32, R_extra=3, seed=0,
                 max_pos=4096, score_scale=1.0):
        g = torch.Generator().manual_seed(seed)
        self.ratio, self.overlap = ratio, (ratio == 4) if overlap is None else overlap
        self.D, self.C = D, D * (2 if self.overlap else 1)
        self.K = ratio * (2 if self.overlap else 1)
        self.R = self.K + R_extra
        self.starts, self.lens = list(starts), list(lens)
        B = len(starts)
        C = self.C
        self.ape = torch.randn(ratio, C, generator=g) * 0.5
        self.hist_kv, self.hist_score = [], []
        for st, ln in zip(starts, lens):
            self.hist_kv.append(torch.randn(st + ln, C, generator=g).to(dtype))
            self.hist_score.append((torch.randn(st + ln, C, generator=g) * score_scale).to(dtype))
        self.dtype = dtype
        self.state_slot = torch.randperm(B + 1, generator=g)[:B].to(torch.int32)
        self.state_kv = torch.full((B + 1, self.R, C), float("nan"))
        self.state_score = torch.full((B + 1, self.R, C), float("nan"))
        for b, st in enumerate(starts):
            sig = self.sig(b)
            for q in range(max(0, st - self.K), st):
                self.state_kv[self.state_slot[b], q % self.R] = self.hist_kv[b][q].float()
                self.state_score[self.state_slot[b], q % self.R] = sig[q]
        self.nw = (1 + 0.1 * torch.randn(D, generator=g))
        self.cos, self.sin, _ = tt.rope_tables(max_pos, "cpu", torch.float32)
        self.g = g

    def sig(self, b):
        """fl(score + ape[pos % ratio]) of sequence b's history, fp32 torch [L, C]."""
        h = self.hist_score[b].float()
        return h + self.ape[torch.arange(h.shape[0]) % self.ratio]

    def inputs(self):
        kv = torch.cat([h[st:] for h, st in zip(self.hist_kv, self.starts)])
        sc = torch.cat([h[st:] for h, st in zip(self.hist_score, self.starts)])
        cu = torch.tensor([0] + list(np.cumsum(self.lens)), dtype=torch.int32)
        return kv, sc, cu, torch.tensor(self.starts, dtype=torch.int64)

    def boundaries(self):
        """[(token index i, b, p)] of the call's boundary tokens."""
        out, i = [], 0
        for b, (st, ln) in enumerate(zip(self.starts, self.lens)):
            for j in range(ln):
                if (st + j + 1) % self.ratio == 0:
                    out.append((i + j, b, st + j))
            i += ln
        return out

    def oracle_y(self, b, p, points, had, eps=1e-6):
        return oracle(self.hist_kv[b].float().numpy(), self.sig(b).numpy(), p, ratio=self.ratio,
                      overlap=self.overlap, nw=self.nw.numpy(), eps=eps, cos_t=self.cos.numpy(),
                      sin_t=self.sin.numpy(), points=points, had=had)


def call(kv, score, ape, state_kv, state_score, state_slot, cu, start_pos, nw, cos, sin, out_slots, cache,
         cache_scale=None, **kw):
    compress.compress_kv(kv, score, ape, state_kv, state_score, state_slot, cu, start_pos, nw, 1e-6, cos, sin,
                      out_slots, cache, cache_scale, **kw)


# ------------------------------------------------------------------------------------------------
# the numpy oracle itself
# ------------------------------------------------------------------------------------------------
def test_np_exp_ds_matches_golden():
    gold = [(0.0, 0x3F800000), (-0.5, 0x3F1B4598), (-1.0, 0x3EBC5AB2), (-2.0, 0x3E0A9555), (-10.0, 0x383E6BCE),
            (-87.0, 0x00B33687), (-100.0, 0x0000001B), (-103.0, 0x00000001), (-104.0, 0), (-np.inf, 0)]
    x = np.array([g[0] for g in gold], dtype=F)
    assert [int(v) for v in bits(np_exp_ds(x))] == [g[1] for g in gold]
    xs = -np.abs(np.random.default_rng(0).standard_normal(4096).astype(F) * 30)
    assert np.array_equal(bits(np_exp_ds(xs)), bits(formats.exp_ds(torch.from_numpy(xs)).numpy()))


# ------------------------------------------------------------------------------------------------
# (4) a hand-checked K = 8 window, step by step
# ------------------------------------------------------------------------------------------------
def test_pool_hand_window_k8():
    # Hand case: scores (0, 0, -inf x 6) -> e = (1, 1, 0, ...), S = ((1+1)+0)+0 + (((0+0)+0)+0) = 2, w = (0.5, 0.5, 0..)
    # y = 0.5*kv0 + 0.5*kv1 exactly: (3 + 5) / 2 = 4.
    sig = np.array([[0, 0] + [-np.inf] * 6], dtype=F)
    kv = np.array([[3, 5, 7, 7, 7, 7, 7, 7]], dtype=F)
    incl = np.ones(8, dtype=bool)
    got = rc.pool(torch.from_numpy(sig), torch.from_numpy(kv), torch.from_numpy(incl))
    assert got.tolist() == [4.0]

    # Random windows, with the K = 8 canonical shape written out term by term.
    rng = np.random.default_rng(7)
    N = 64
    sig = (rng.standard_normal((N, 8)) * 3).astype(F)
    kv = rng.standard_normal((N, 8)).astype(F)
    incl = np.ones((N, 8), dtype=bool)
    incl[: N // 2, :4] = False  # the first windows of a sequence: rows s < 0 excluded
    sig[N // 2:N // 2 + 4, 5] = -np.inf
    m = np.full(N, -np.inf, dtype=F)
    for k in range(8):
        m = np.where(incl[:, k], np.fmax(m, sig[:, k]), m)
    e = [np.where(incl[:, k], np_exp_ds((sig[:, k] - m).astype(F)), F(0)) for k in range(8)]
    S = (((e[0] + e[1]) + e[2]) + e[3]) + (((e[4] + e[5]) + e[6]) + e[7])
    w = [(e[k] / S).astype(F) for k in range(8)]
    t = [(w[k] * np.where(incl[:, k], kv[:, k], F(0))).astype(F) for k in range(8)]
    y = (((t[0] + t[1]) + t[2]) + t[3]) + (((t[4] + t[5]) + t[6]) + t[7])
    got = rc.pool(torch.from_numpy(sig), torch.from_numpy(kv), torch.from_numpy(incl)).numpy()
    assert np.array_equal(bits(got), bits(y))
    assert np.array_equal(bits(np_pool(sig, kv, incl)), bits(y))


def test_pool_nan_windows():
    sig = np.zeros((5, 8), dtype=F)
    kv = np.ones((5, 8), dtype=F)
    incl = np.ones((5, 8), dtype=bool)
    incl[:, :4] = False
    sig[0, 4:] = -np.inf                 # every included score -inf -> NaN
    sig[1, 6] = np.inf                   # +inf -> NaN
    sig[2, 7] = np.nan                   # NaN -> NaN
    sig[3, :4] = np.nan                  # NaN only in excluded rows -> finite
    sig[4, 4:7] = -np.inf                # one finite included row -> y = kv of it
    y = rc.pool(torch.from_numpy(sig), torch.from_numpy(kv), torch.from_numpy(incl)).numpy()
    assert np.isnan(y[:3]).all() and y[3] == 1.0 and y[4] == 1.0


def test_pool_through_op_k8():
    """One boundary at p = 7 (full K = 8 window from the inputs), identity RoPE, no rounding points: the
    cache row is bf16(nw * (y * inv)) with y from the step-by-step pool above."""
    S = Seqs([0], [8], seed=3)
    kv, sc, cu, sp = S.inputs()
    cos = torch.ones(16, 32)
    sin = torch.zeros(16, 32)
    cache, _, P = make_cache("none", {}, 128, 16)
    out_slots = torch.full((8,), -1, dtype=torch.int64)
    out_slots[7] = 5
    out_slots[3] = 2
    call(kv, sc, S.ape, S.state_kv, S.state_score, S.state_slot, cu, sp, S.nw, cos, sin, out_slots, cache,
         ratio=4, bf16_after=())
    for p, slot in ((7, 5), (3, 2)):
        want = oracle(S.hist_kv[0].numpy(), S.sig(0).numpy(), p, ratio=4, overlap=True, nw=S.nw.numpy(), eps=1e-6,
                      cos_t=cos.numpy(), sin_t=sin.numpy(), points=(), had=False)
        got = cache.view(-1, 128)[slot].view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(got, bf16_bits(want))


# ------------------------------------------------------------------------------------------------
# (3) SPEC §7.6 test 4: the bf16 pool rounding point decides an FP4 code
# ------------------------------------------------------------------------------------------------
def test_pool_rounding_flips_code():
    """A pooled value y0 = -0.3599996 (0xBEB851DE; bf16 -0.359375). The row around it makes block 0's scale
    2^-1 after the norm (its amax is bf16(2 * inv) = 1.984375), and norm weight w0 = 1 + 397/8192 puts
    w0 * y0 * inv just past the bf16 midpoint 0.3740234375 only without the pool rounding:
      with "pool":    |bf16(w0 * -0.359375 * inv)| = 0.373046875, v = -0.74609375 -> 0.5 -> code 0x9;
      without it:     |bf16(w0 * -0.3599996 * inv)| = 0.375,      v = -0.75 -> (tie, even) 1.0 -> code 0xA."""
    y0 = f32(0xBEB851DE)
    assert y0 == F(-0.3599996) and bf16(y0) == F(-0.359375)
    w0 = F(1 + 397 / 8192)
    for pool_round, want in ((True, 0x9), (False, 0xA)):
        row = np.ones(128, dtype=F)
        row[1] = 2.0
        row[0] = bf16(y0) if pool_round else y0
        inv = F(1) / np.sqrt(csum(row * row) / F(128) + F(1e-6))
        assert bf16(F(2) * inv) == F(1.984375)
        assert abs(bf16(w0 * (row[0] * inv))) == (F(0.373046875) if pool_round else F(0.375))

    # Through the op: one window whose only finite score is the last row's, so y = kv of that row exactly.
    T, D, C = 4, 128, 256
    kv = torch.zeros(T, C)
    kv[3, D:] = 1.0
    kv[3, D + 1] = 2.0
    kv[3, D] = float(y0)
    score = torch.full((T, C), float("-inf"))
    score[3] = 0.0
    ape = torch.zeros(4, C)
    nw = torch.ones(D)
    nw[0] = float(w0)
    cos, sin = torch.ones(8, 32), torch.zeros(8, 32)
    for points, want in ((("pool", "norm", "rope"), 0x9), (("norm", "rope"), 0xA)):
        for rounding in ("rne", "hardware"):
            cache, _, P = make_cache("fp4", {}, D, 16)
            call(kv, score, ape, torch.zeros(1, 8, C), torch.zeros(1, 8, C), torch.zeros(1, dtype=torch.int32),
                 torch.tensor([0, T], dtype=torch.int32), torch.zeros(1, dtype=torch.int64), nw, cos, sin,
                 torch.tensor([-1, -1, -1, 0]), cache, ratio=4, quant_mode="fp4", rounding=rounding,
                 bf16_after=points)
            payload, exps = L.read_packed68(cache, torch.tensor([0]), P)
            assert int(exps[0, 0]) == 126                      # scale 2^-1
            assert int(payload[0, 0]) & 0xF == want, (points, rounding)


# ------------------------------------------------------------------------------------------------
# (1) chunking invariance
# ------------------------------------------------------------------------------------------------
def _feed(S, b, chunks, quant_mode, knobs, R):
    """Feed sequence b of S (history from position 0) in chunks; returns (cache, cache_scale, state_kv, state_score)."""
    kvh, sch = S.hist_kv[b], S.hist_score[b]
    Ltot = kvh.shape[0]
    cache, scale, P = make_cache(quant_mode, knobs, S.D, Ltot // S.ratio + 1)
    skv = torch.full((1, R, S.C), float("nan"))
    ssc = torch.full((1, R, S.C), float("nan"))
    pos = 0
    for n in chunks:
        p = torch.arange(pos, pos + n)
        out_slots = torch.where((p + 1) % S.ratio == 0, p // S.ratio, torch.full_like(p, 1 << 40))
        call(kvh[pos:pos + n], sch[pos:pos + n], S.ape, skv, ssc, torch.zeros(1, dtype=torch.int32),
             torch.tensor([0, n], dtype=torch.int32), torch.tensor([pos]), S.nw, S.cos, S.sin, out_slots, cache,
             scale, ratio=S.ratio, overlap=S.overlap, quant_mode=quant_mode, **knobs)
        pos += n
    assert pos == Ltot
    dsaquant.check_errors()   # junk out_slots of non-boundary tokens are never read
    return cache, scale, skv, ssc


def _random_chunks(L, g, hi):
    out = []
    while sum(out) < L:
        out.append(min(int(torch.randint(1, hi + 1, (1,), generator=g)), L - sum(out)))
    return out


@pytest.mark.parametrize("ratio,L,mode", [
    (4, 45, "fp4_packed68"), (4, 45, "fp8_ue8m0_preshuffle"), (4, 45, "none"), (4, 45, "fp4_sim"),
    (4, 45, "fp4_aiter"), (128, 300, "fp4_packed68"), (128, 300, "none")])
def test_chunking_invariance(ratio, L, mode):
    quant_mode, knobs = MODES[mode]
    S = Seqs([0], [L], ratio=ratio, seed=11)
    K, R = S.K, S.K + 3
    g = torch.Generator().manual_seed(5)
    runs = {"whole": [L], "chunks": _random_chunks(L, g, 2 * K + 3), "tokens": [1] * L}
    res = {name: _feed(S, 0, ch, quant_mode, knobs, R) for name, ch in runs.items()}
    rows = torch.tensor([q % R for q in range(L - K, L)])
    base = res["whole"]
    assert not bool((u8(base[0]) == POISON).all())
    for name, r in res.items():
        assert same_bytes(r[0], base[0]), name
        if base[1] is not None:
            assert same_bytes(r[1], base[1]), name
        assert same_bytes(r[2][0, rows], base[2][0, rows]), name
        assert same_bytes(r[3][0, rows], base[3][0, rows]), name


def test_chunking_invariance_batched_overlap_ratio128():
    """Two sequences chunked differently within the same calls, ratio 128 with overlap (K = 256)."""
    lens = [300, 270]
    S = Seqs([0, 0], lens, ratio=128, overlap=True, seed=2)
    quant_mode, knobs = MODES["fp4_packed68"]
    whole = [_feed(S, b, [lens[b]], quant_mode, knobs, S.K)[0] for b in range(2)]
    cache, _, _ = make_cache(quant_mode, knobs, S.D, 8)
    skv = torch.full((2, S.K, S.C), float("nan"))
    ssc = skv.clone()
    g = torch.Generator().manual_seed(1)
    pos = [0, 0]
    while pos != lens:
        n = [min(int(torch.randint(0, 90, (1,), generator=g)), lens[b] - pos[b]) for b in range(2)]
        kv = torch.cat([S.hist_kv[b][pos[b]:pos[b] + n[b]] for b in range(2)])
        sc = torch.cat([S.hist_score[b][pos[b]:pos[b] + n[b]] for b in range(2)])
        p = torch.cat([torch.arange(pos[b], pos[b] + n[b]) for b in range(2)])
        seq = torch.cat([torch.full((n[b],), b) for b in range(2)])
        out_slots = torch.where((p + 1) % 128 == 0, seq * 4 + p // 128, torch.full_like(p, -1))
        call(kv, sc, S.ape, skv, ssc, torch.tensor([0, 1], dtype=torch.int32),
             torch.tensor([0, n[0], n[0] + n[1]], dtype=torch.int32), torch.tensor(pos), S.nw, S.cos, S.sin,
             out_slots, cache, ratio=128, overlap=True, quant_mode=quant_mode, **knobs)
        pos = [pos[b] + n[b] for b in range(2)]
    for b in range(2):
        n = lens[b] // 128
        assert torch.equal(L_read(cache, torch.arange(n) + 4 * b), L_read(whole[b], torch.arange(n)))


def L_read(cache, slots):
    p, e = L.read_packed68(cache, slots, 16)
    return torch.cat((p, e), dim=1)


# ------------------------------------------------------------------------------------------------
# (2) bf16 and fp32 inputs holding the same values
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["fp4_packed68", "fp8_ue8m0_preshuffle", "none", "fp4_aiter"])
def test_bf16_and_fp32_inputs_same_bytes(mode):
    quant_mode, knobs = MODES[mode]
    S = Seqs([5, 0, 17], [30, 9, 14], dtype=BF16, seed=4)
    kv, sc, cu, sp = S.inputs()
    out = []
    for dt in (BF16, torch.float32):
        cache, scale, P = make_cache(quant_mode, knobs, S.D, 64)
        skv, ssc = S.state_kv.clone(), S.state_score.clone()
        T = kv.shape[0]
        out_slots = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:T]
        call(kv.to(dt), sc.to(dt), S.ape, skv, ssc, S.state_slot, cu, sp, S.nw.to(BF16), S.cos, S.sin,
             out_slots, cache, scale, ratio=4, quant_mode=quant_mode, **knobs)
        out.append((cache, scale, skv, ssc))
    a, b = out
    assert same_bytes(a[0], b[0]) and same_bytes(a[2], b[2]) and same_bytes(a[3], b[3])
    if a[1] is not None:
        assert same_bytes(a[1], b[1])


# ------------------------------------------------------------------------------------------------
# (5) ragged batches against the oracle: every quant mode and layout, negative out_slots, update_state
# ------------------------------------------------------------------------------------------------
RAGGED = [  # (mode, ratio, D, hadamard, bf16_after, B, seed)
    ("none", 4, 128, False, ("pool", "norm", "rope"), 1, 0),
    ("none", 4, 512, False, ("rope",), 3, 1),
    ("fp4_packed68_no_overlap", 4, 128, False, ("pool", "norm", "rope"), 4, 11),
    ("none", 128, 512, False, ("pool", "norm", "rope"), 2, 2),
    ("fp4_packed68", 4, 128, True, ("pool", "norm", "rope", "hadamard"), 8, 3),
    ("fp4_packed68_pack_threshold", 4, 128, True, (), 5, 4),
    ("fp4_aiter", 4, 128, False, (), 6, 5),
    ("fp4_aiter", 128, 128, False, ("norm",), 3, 6),
    ("fp4_sim", 4, 128, True, ("pool", "norm", "rope", "hadamard"), 4, 7),
    ("fp4_sim_pack", 4, 128, False, ("pool",), 2, 8),
    ("fp8_ue8m0_preshuffle", 4, 128, False, ("pool", "norm", "rope"), 7, 9),
    ("fp8_fp32scale_fnuz", 128, 128, True, ("rope",), 4, 10),
]


@pytest.mark.parametrize("update_state", [True, False])
@pytest.mark.parametrize("mode,ratio,D,had,points,B,seed", RAGGED)
def test_ragged_batch_vs_oracle(mode, ratio, D, had, points, B, seed, update_state):
    quant_mode, knobs = MODES[mode]
    g = torch.Generator().manual_seed(100 + seed)
    hi_start, hi_len = (24, 14) if ratio == 4 else (300, 280)
    starts = [int(x) for x in torch.randint(0, hi_start, (B,), generator=g)]
    lens = [int(x) for x in torch.randint(0, hi_len, (B,), generator=g)]
    lens[0] = min(lens[0], ratio - 1)            # shorter than one window
    if B > 2:
        starts[1] = 0                            # a prompt from position 0
        lens[2] = 0                              # an empty sequence
    S = Seqs(starts, lens, ratio=ratio, overlap=knobs.get("overlap"), D=D, seed=seed)
    kv, sc, cu, sp = S.inputs()
    T = kv.shape[0]
    bnd = S.boundaries()
    cache, scale, P = make_cache(quant_mode, knobs, D, max(2 * len(bnd), 8))
    cap = cache.shape[0] * P
    perm = torch.randperm(cap, generator=g)
    out_slots = torch.randint(cap, 1 << 40, (T,), generator=g)      # non-boundary tokens: never read
    slots, ys = [], []
    for n, (i, b, p) in enumerate(bnd):
        s = -1 - n if n % 5 == 3 else int(perm[n])                # some negative: no store
        out_slots[i] = s
        if s >= 0:
            slots.append(s)
            ys.append(S.oracle_y(b, p, points, had))
    want_cache, want_scale = expected_cache(cache, scale, P, quant_mode, knobs, slots, ys)
    want_kv, want_sc = S.state_kv.clone(), S.state_score.clone()
    if update_state:
        for b, (st, ln) in enumerate(zip(starts, lens)):
            for q in range(max(st, st + ln - S.K), st + ln):
                want_kv[S.state_slot[b], q % S.R] = S.hist_kv[b][q].float()
                want_sc[S.state_slot[b], q % S.R] = S.sig(b)[q]
    skv, ssc = S.state_kv.clone(), S.state_score.clone()
    call(kv, sc, S.ape, skv, ssc, S.state_slot, cu, sp, S.nw, S.cos, S.sin, out_slots, cache, scale,
         ratio=ratio, quant_mode=quant_mode, hadamard=had, bf16_after=points, update_state=update_state, **knobs)
    dsaquant.check_errors()
    assert same_bytes(cache, want_cache)
    if scale is not None:
        assert same_bytes(scale, want_scale)
    assert same_bytes(skv, want_kv) and same_bytes(ssc, want_sc)


def test_out_of_range_slots_and_ring_slots_are_skipped_and_flagged():
    S = Seqs([0, 3], [12, 9], seed=5)
    kv, sc, cu, sp = S.inputs()
    cache, _, P = make_cache("fp4", {}, 128, 16)
    cap = cache.shape[0] * P
    out_slots = torch.arange(kv.shape[0]) % cap
    out_slots[3] = cap + 7                          # boundary token of sequence 0 (p = 3)
    skv, ssc = S.state_kv.clone(), S.state_score.clone()
    call(kv, sc, S.ape, skv, ssc, S.state_slot, cu, sp, S.nw, S.cos, S.sin, out_slots, cache, quant_mode="fp4",
         ratio=4)
    with pytest.raises(dsaquant.DsaquantError, match="capacity"):
        dsaquant.check_errors()
    assert cache.shape[0] * P == cap              # nothing out of bounds (the write would have raised)
    # A ring slot outside the ring: that sequence is skipped entirely (no store, no ring write), flagged.
    cache2, _, _ = make_cache("fp4", {}, 128, 16)
    bad = S.state_slot.clone()
    bad[1] = S.state_kv.shape[0] + 2
    skv2, ssc2 = S.state_kv.clone(), S.state_score.clone()
    out_slots = torch.arange(kv.shape[0]) % cap
    call(kv, sc, S.ape, skv2, ssc2, bad, cu, sp, S.nw, S.cos, S.sin, out_slots, cache2, quant_mode="fp4", ratio=4)
    with pytest.raises(dsaquant.DsaquantError, match="capacity"):
        dsaquant.check_errors()
    seq1 = out_slots[12:][(torch.arange(3, 12) + 1) % 4 == 0]
    written0 = out_slots[:12][(torch.arange(12) + 1) % 4 == 0]
    assert bool((L_read(cache2, seq1) == POISON).all())
    assert not bool((L_read(cache2, written0) == POISON).all(dim=1).any())
    others = [i for i in range(skv2.shape[0]) if i != int(S.state_slot[0])]
    assert same_bytes(skv2[others], S.state_kv[others]) and same_bytes(ssc2[others], S.state_score[others])


def test_positions_past_table_are_clamped_and_reported():
    S = Seqs([0], [16], seed=6, max_pos=6)          # boundary at p = 15 ropes at 12 >= max_pos
    kv, sc, cu, sp = S.inputs()
    cache, _, _ = make_cache("none", {}, 128, 8)
    call(kv, sc, S.ape, S.state_kv, S.state_score, S.state_slot, cu, sp, S.nw, S.cos, S.sin,
         torch.arange(16) // 4, cache, ratio=4)
    with pytest.raises(dsaquant.DsaquantError, match="position"):
        dsaquant.check_errors()
    want = S.oracle_y(0, 15, ("pool", "norm", "rope"), False)   # the oracle clamps to max_pos - 1
    assert np.array_equal(cache.view(-1, 128)[3].view(torch.int16).numpy().view(np.uint16), bf16_bits(want))


def test_freqs_table_equals_cos_sin():
    S = Seqs([2], [21], seed=8)
    kv, sc, cu, sp = S.inputs()
    _, _, freqs = tt.rope_tables(4096, "cpu")
    caches = []
    for use_freqs in (False, True):
        cache, _, _ = make_cache("fp4", {}, 128, 32)
        rope = dict(freqs=freqs) if use_freqs else {}
        compress.compress_kv(kv, sc, S.ape, S.state_kv.clone(), S.state_score.clone(), S.state_slot, cu, sp, S.nw,
                          1e-6, None if use_freqs else S.cos, None if use_freqs else S.sin, torch.arange(21), cache,
                          ratio=4, quant_mode="fp4", **rope)
        caches.append(cache)
    assert same_bytes(*caches)


# ------------------------------------------------------------------------------------------------
# presets
# ------------------------------------------------------------------------------------------------
def test_presets_fill_knobs_and_keywords_override():
    assert set(compress.PRESETS) == {"dsv4-ref", "aiter", "vllm-v4", "sglang-c4"}
    S = Seqs([0, 6], [20, 11], seed=9)
    kv, sc, cu, sp = S.inputs()

    def run(**kw):
        layout = kw.get("layout") or compress.PRESETS.get(kw.get("preset"), {}).get("layout", "packed68")
        cache, scale, _ = make_cache("fp4", {"layout": layout}, 128, 32)
        call(kv, sc, S.ape, S.state_kv.clone(), S.state_score.clone(), S.state_slot, cu, sp, S.nw, S.cos, S.sin,
             torch.arange(kv.shape[0]), cache, scale, ratio=4, quant_mode="fp4", **kw)
        return u8(cache)
    for name, knobs in compress.PRESETS.items():
        assert torch.equal(run(preset=name), run(**knobs)), name
    assert torch.equal(run(preset="aiter", rounding="rne", layout="packed68"),
                       run(**{**compress.PRESETS["aiter"], "rounding": "rne", "layout": "packed68"}))
    assert not torch.equal(run(preset="sglang-c4"), run(preset="dsv4-ref"))


def _compressor64(S, b, p, nw, eps, had):
    """dsv4-ref's Compressor semantics in float64 torch: softmax over the window of score + ape, weighted sum,
    RMSNorm, interleaved tail RoPE, Hadamard (orthonormal). Rows with s < 0 are masked out."""
    K, ratio, D = S.K, S.ratio, S.D
    s = torch.arange(p - K + 1, p + 1)
    ok = s >= 0
    sc = s.clamp_min(0)
    kvh, sch = S.hist_kv[b].double(), S.hist_score[b].double()
    score = sch + S.ape.double()[torch.arange(sch.shape[0]) % ratio]
    half = torch.where(torch.arange(K) < ratio, 0, D)
    cols = half[:, None] + torch.arange(D)
    kw = kvh[sc[:, None], cols]
    sw = score[sc[:, None], cols].masked_fill(~ok[:, None], float("-inf"))
    y = (torch.softmax(sw, dim=0) * kw).sum(0)
    y = y * torch.rsqrt((y * y).mean() + eps) * nw.double()
    pos = p + 1 - ratio
    c, sn = S.cos[pos].double(), S.sin[pos].double()
    a, bb = y[D - 64::2].clone(), y[D - 63::2].clone()
    y[D - 64::2], y[D - 63::2] = a * c - bb * sn, bb * c + a * sn
    if had:
        H = torch.ones(1, 1, dtype=torch.float64)
        while H.shape[0] < D:
            H = torch.cat((torch.cat((H, H), 1), torch.cat((H, -H), 1)), 0)
        y = (H @ y) / D ** 0.5
    return y


@pytest.mark.parametrize("preset", ["dsv4-ref", "aiter", "vllm-v4", "sglang-c4"])
def test_preset_tolerance_vs_float64_compressor(preset, capsys):
    """Agreement with the producers' semantics is a tolerance test (SPEC §7.6): cosine of the dequantized FP4
    rows against the float64 Compressor, and the fraction of FP4 codes that differ from quantizing the
    float64 rows with the preset's own rule and policy."""
    kn = compress.PRESETS[preset]
    dtype = torch.float32 if preset in ("dsv4-ref", "sglang-c4") else BF16   # the producers' input dtype
    S = Seqs([0, 9, 30], [61, 40, 23], dtype=dtype, seed=21, score_scale=2.0)
    kv, sc, cu, sp = S.inputs()
    bnd = S.boundaries()
    cache, scale, P = make_cache("fp4", {"layout": kn["layout"]}, 128, len(bnd) + 1)
    out_slots = torch.full((kv.shape[0],), -1)
    for n, (i, _, _) in enumerate(bnd):
        out_slots[i] = n
    call(kv, sc, S.ape, S.state_kv.clone(), S.state_score.clone(), S.state_slot, cu, sp, S.nw, S.cos, S.sin,
         out_slots, cache, scale, ratio=4, quant_mode="fp4", preset=preset)
    slots = torch.arange(len(bnd))
    if kn["layout"] == "aiter_fp4":
        payload, exps = L.read_aiter_fp4(cache, scale, slots, P)
    else:
        payload, exps = L.read_packed68(cache, slots, P)
    ours = formats.fp4_dequantize(payload, exps).double()
    y64 = torch.stack([_compressor64(S, b, p, S.nw, 1e-6, kn["hadamard"]) for _, b, p in bnd])
    p64, e64 = formats.fp4_quantize(y64.float(), kn["rounding"], kn["scale_rule"])
    codes = formats.unpack_nibbles(payload)
    codes64 = formats.unpack_nibbles(p64)
    cos_ours = tt.cosine(ours, y64)
    cos_fp4_of_64 = tt.cosine(formats.fp4_dequantize(p64, e64).double(), y64)
    diff = float((codes != codes64).float().mean())
    with capsys.disabled():
        print(f"\n[compress_kv preset {preset}] rows={len(bnd)} cosine(ours, fp64)={cos_ours:.5f} "
              f"cosine(fp4(fp64), fp64)={cos_fp4_of_64:.5f} FP4 codes differing={diff:.4%}")
    assert cos_ours > 0.98 and abs(cos_ours - cos_fp4_of_64) < 0.005
    assert diff < 0.05
    # Unquantized rows (quant_mode none, same rounding points) are within bf16 noise of the float64 rows.
    cache_n, _, _ = make_cache("none", {}, 128, len(bnd) + 1)
    call(kv, sc, S.ape, S.state_kv.clone(), S.state_score.clone(), S.state_slot, cu, sp, S.nw, S.cos, S.sin,
         out_slots, cache_n, ratio=4, preset=preset)
    assert tt.cosine(cache_n.view(-1, 128)[slots].double(), y64) > 0.9999


# ------------------------------------------------------------------------------------------------
# (6) bad input: rejected with the argument named, nothing written
# ------------------------------------------------------------------------------------------------
def _base(quant_mode="fp4", layout="packed68", P=16, D=128, ratio=4, overlap=None):
    S = Seqs([0, 2], [6, 3], ratio=ratio, overlap=overlap, D=D, seed=1)
    kv, sc, cu, sp = S.inputs()
    cache, scale, P = make_cache(quant_mode, {"layout": layout}, D, 16)
    if quant_mode == "fp8" and P != 16:
        cache = tt.poisoned((2, P * 132), torch.uint8, "cpu")
    a = dict(kv=kv, score=sc, ape=S.ape, state_kv=S.state_kv.clone(), state_score=S.state_score.clone(),
             state_slot=S.state_slot, cu_seqlens=cu, start_pos=sp, norm_weight=S.nw, epsilon=1e-6, cos_cache=S.cos,
             sin_cache=S.sin, out_slots=torch.arange(9), cache=cache, cache_scale=scale, ratio=ratio,
             quant_mode=quant_mode, layout=layout)
    return a


def _wide(a, C):
    g = torch.Generator().manual_seed(0)
    T = a["kv"].shape[0]
    a.update(kv=torch.randn(T, C, generator=g), score=torch.randn(T, C, generator=g),
             ape=torch.randn(a["ratio"], C, generator=g), state_kv=torch.zeros(3, 8, C),
             state_score=torch.zeros(3, 8, C))
    return a


def _set(**kw):
    return lambda a: {**a, **kw}


BAD = [
    ("ratio_8", _set(ratio=8), ValueError, "ratio"),
    ("ratio_str", _set(ratio="4"), TypeError, "ratio"),
    ("overlap_str", _set(overlap="yes"), TypeError, "overlap"),
    ("C_not_2D", lambda a: _wide(a, 200), ValueError, "kv"),
    ("D_256", lambda a: _wide(a, 512), ValueError, "kv"),
    ("no_overlap_C_256", _set(overlap=False), ValueError, "kv"),
    ("D_512_fp4", lambda a: {**_wide(a, 1024), "norm_weight": torch.ones(512)}, ValueError, "quant_mode"),
    ("kv_fp16", lambda a: {**a, "kv": a["kv"].half(), "score": a["score"].half()}, TypeError, "kv"),
    ("score_dtype", lambda a: {**a, "score": a["score"].bfloat16()}, TypeError, "score"),
    ("score_shape", lambda a: {**a, "score": a["score"][:-1]}, ValueError, "score"),
    ("kv_cols_strided", lambda a: {**a, "kv": a["kv"].t().contiguous().t()}, ValueError, "kv"),
    ("ape_bf16", lambda a: {**a, "ape": a["ape"].bfloat16()}, TypeError, "ape"),
    ("ape_shape", lambda a: {**a, "ape": torch.zeros(8, 256)}, ValueError, "ape"),
    ("ape_permuted", lambda a: {**a, "ape": torch.zeros(8, 128)}, ValueError, "ape"),
    ("ring_bf16", lambda a: {**a, "state_kv": a["state_kv"].bfloat16()}, TypeError, "state_kv"),
    ("ring_short", lambda a: {**a, "state_kv": torch.zeros(3, 7, 256), "state_score": torch.zeros(3, 7, 256)},
     ValueError, "state_kv"),
    ("ring_width", lambda a: {**a, "state_kv": torch.zeros(3, 11, 128)}, ValueError, "state_kv"),
    ("state_score_shape", lambda a: {**a, "state_score": torch.zeros(3, 12, 256)}, ValueError, "state_score"),
    ("hadamard_D512", lambda a: {**_wide(a, 1024), "norm_weight": torch.ones(512), "quant_mode": "none",
                                 "cache": tt.poisoned((2, 16, 512), BF16, "cpu"), "cache_scale": None,
                                 "hadamard": True}, ValueError, "hadamard"),
    ("bf16_after_hadamard_without", _set(bf16_after=("pool", "hadamard")), ValueError, "bf16_after"),
    ("bf16_after_unknown", _set(bf16_after=("pool", "normm")), ValueError, "bf16_after"),
    ("bf16_after_str", _set(bf16_after="pool"), TypeError, "bf16_after"),
    ("aiter_P16", lambda a: {**a, "layout": "aiter_fp4", "cache": tt.poisoned((2, 1, 4, 16, 16), torch.uint8, "cpu"),
                             "cache_scale": tt.poisoned((2, 1, 4, 16), torch.uint8, "cpu")}, ValueError, "cache"),
    ("aiter_no_scale", lambda a: {**a, "layout": "aiter_fp4", "cache": tt.poisoned((1, 1, 4, 64, 16), torch.uint8,
                                                                                     "cpu")}, TypeError, "cache_scale"),
    ("scale_not_used", lambda a: {**a, "cache_scale": tt.poisoned((2, 1, 4, 16), torch.uint8, "cpu")}, ValueError,
     "cache_scale"),
    ("preshuffle_P8", lambda a: {**a, "quant_mode": "fp8", "preshuffle": True,
                                 "cache": tt.poisoned((2, 8 * 132), torch.uint8, "cpu")}, ValueError, "cache"),
    ("fp8_cache_bytes", lambda a: {**a, "quant_mode": "fp8", "cache": tt.poisoned((2, 100), torch.uint8, "cpu")},
     ValueError, "cache"),
    ("none_cache_fp16", lambda a: {**a, "quant_mode": "none", "cache": tt.poisoned((2, 16, 128), torch.float16,
                                                                                    "cpu")}, TypeError, "cache"),
    ("none_cache_width", lambda a: {**a, "quant_mode": "none", "cache": tt.poisoned((2, 16, 64), BF16, "cpu")},
     ValueError, "cache"),
    ("fp8_flavour_contradicts", lambda a: {**a, "quant_mode": "fp8", "fp8_flavour": "e4m3fnuz",
                                           "cache": tt.poisoned((2, 16 * 132), torch.float8_e4m3fn, "cpu")},
     ValueError, "fp8_flavour"),
    ("cu_int64", lambda a: {**a, "cu_seqlens": a["cu_seqlens"].long()}, TypeError, "cu_seqlens"),
    ("cu_len", lambda a: {**a, "cu_seqlens": a["cu_seqlens"][:-1]}, ValueError, "cu_seqlens"),
    ("start_pos_int32", lambda a: {**a, "start_pos": a["start_pos"].int()}, TypeError, "start_pos"),
    ("start_pos_len", lambda a: {**a, "start_pos": a["start_pos"][:1]}, ValueError, "start_pos"),
    ("state_slot_int64", lambda a: {**a, "state_slot": a["state_slot"].long()}, TypeError, "state_slot"),
    ("out_slots_int32", lambda a: {**a, "out_slots": a["out_slots"].int()}, TypeError, "out_slots"),
    ("out_slots_len", lambda a: {**a, "out_slots": a["out_slots"][:-1]}, ValueError, "out_slots"),
    ("norm_weight_len", lambda a: {**a, "norm_weight": torch.ones(64)}, ValueError, "norm_weight"),
    ("norm_weight_fp16", lambda a: {**a, "norm_weight": a["norm_weight"].half()}, TypeError, "norm_weight"),
    ("epsilon_str", _set(epsilon="1e-6"), TypeError, "epsilon"),
    ("cos_width", lambda a: {**a, "cos_cache": torch.ones(8, 64), "sin_cache": torch.ones(8, 64)}, ValueError,
     "cos_cache"),
    ("sin_dtype", lambda a: {**a, "sin_cache": a["sin_cache"].bfloat16()}, TypeError, "sin_cache"),
    ("freqs_and_cos", lambda a: {**a, "freqs": torch.zeros(8, 64)}, ValueError, "cos_cache"),
    ("freqs_width", lambda a: {**a, "freqs": torch.zeros(8, 32), "cos_cache": None, "sin_cache": None},
     ValueError, "freqs"),
    ("quant_mode", _set(quant_mode="fp6"), ValueError, "quant_mode"),
    ("layout", _set(layout="dense"), ValueError, "layout"),
    ("layout_fp8_for_fp4", _set(layout="fp8_132"), ValueError, "layout"),
    ("rounding", _set(rounding="nearest"), ValueError, "rounding"),
    ("scale_rule", _set(scale_rule="ceil"), ValueError, "scale_rule"),
    ("scale_fmt", _set(scale_fmt="e8m0"), ValueError, "scale_fmt"),
    ("fp8_flavour", _set(fp8_flavour="e5m2"), ValueError, "fp8_flavour"),
    ("preshuffle_int", _set(preshuffle=1), TypeError, "preshuffle"),
    ("update_state_int", _set(update_state=1), TypeError, "update_state"),
    ("preset", _set(preset="trtllm"), ValueError, "preset"),
    ("device", lambda a: {**a, "ape": a["ape"].to("meta")}, ValueError, "ape"),
]


@pytest.mark.parametrize("case,mutate,exc,name", BAD, ids=[b[0] for b in BAD])
def test_bad_input_rejected_nothing_written(case, mutate, exc, name):
    a = mutate(_base())
    before = {k: v.clone() for k, v in a.items() if isinstance(v, torch.Tensor) and v.device.type == "cpu"}
    with pytest.raises(exc) as ei:
        compress.compress_kv(**a)
    assert str(ei.value).startswith(name), str(ei.value)
    for k, v in before.items():
        assert same_bytes(a[k], v), k
    for k in ("cache", "cache_scale"):
        if isinstance(a.get(k), torch.Tensor):
            assert bool((u8(a[k]) == POISON).all()), k


def test_base_call_is_valid():
    a = _base()
    compress.compress_kv(**a)
    dsaquant.check_errors()
    assert not bool((u8(a["cache"]) == POISON).all())


@pytest.mark.parametrize("case,mutate,name", [
    ("out_slot_past_capacity", lambda a: {**a, "out_slots": torch.arange(9) + 30}, "out_slots"),
    ("state_slot_past_ring", lambda a: {**a, "state_slot": torch.tensor([0, 3], dtype=torch.int32)}, "state_slot"),
    ("cu_not_monotone", lambda a: {**a, "cu_seqlens": torch.tensor([0, 7, 6], dtype=torch.int32)}, "cu_seqlens"),
    ("cu_total", lambda a: {**a, "cu_seqlens": torch.tensor([0, 6, 8], dtype=torch.int32)}, "cu_seqlens"),
    ("start_pos_negative", lambda a: {**a, "start_pos": torch.tensor([0, -4])}, "start_pos"),
])
def test_host_checks(case, mutate, name):
    a = mutate(_base())
    ring = a["state_kv"].clone()
    dsaquant.set_host_checks(True)
    with pytest.raises(ValueError) as ei:
        compress.compress_kv(**a)
    assert str(ei.value).startswith(name), str(ei.value)
    assert bool((u8(a["cache"]) == POISON).all()) and same_bytes(a["state_kv"], ring)


# ------------------------------------------------------------------------------------------------
# torch.library: schema, fake impl, compile
# ------------------------------------------------------------------------------------------------
def test_compile_fullgraph_same_bytes():
    a, b = _base(), _base()
    compress.compress_kv(**a)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(kw):
        compress.compress_kv(**kw)
    f(b)
    for k in ("cache", "state_kv", "state_score"):
        assert same_bytes(a[k], b[k]), k


def test_opcheck():
    a = _base()
    args = (a["kv"], a["score"], a["ape"], a["state_kv"], a["state_score"], a["state_slot"], a["cu_seqlens"],
            a["start_pos"], a["norm_weight"], 1e-6, a["cos_cache"], a["sin_cache"], a["out_slots"], a["cache"], None,
            4, True, "fp4", "packed68", "recip", "rne", "ue8m0", "e4m3fn", False, False, "pool,norm,rope", None, True,
            16, "reference")
    torch.library.opcheck(compress._compress_op.op, args, test_utils=("test_schema", "test_faketensor"))

"""The `triton` backend's DeepSeek-V4 compressor, SPEC §7.6 `compress_kv`: kernels and the host wrapper.

`compress_kv` below has exactly the signature of reference.compress.compress_kv (dsaquant.compress validates
the arguments and calls it positionally) and writes the same bytes: the cache rows of every boundary token
and, with update_state, the fp32 ring rows of the last K tokens of every sequence.

Two launches per call, in stream order (SPEC §7.6 "every read before any write"; no host sync, so a call
can be captured in a CUDA graph):
1. `_compress_kernel` reads the windows (inputs and ring) and writes the cache. Program j owns the tokens
   [j*TB, (j+1)*TB): it finds each token's sequence (binary search of cu_seqlens) and position, marks the
   boundary tokens ((p+1) % ratio == 0), compacts them (a prefix sum) and processes them ROWS at a time:
   for each chunk of CW columns, the K x CW window of every boundary is loaded as four [ROWS, K/4, CW]
   tiles (window rows k = 4m + j, j = 0..3, so the canonical-sum partials are elementwise), pooled per
   column (NaN-ignoring max, exp_ds, canonical sum, true division, canonical sum), and the pooled row
   [ROWS, D] then goes through the rounding points, RMSNorm, tail RoPE, the optional Hadamard, and the
   quantizer of `quant_mode` into its slot.
2. `_state_kernel` (only with update_state) writes the ring rows: program rows are (sequence, j) pairs,
   j = 0..K-1 standing for token cu_seqlens[b+1] - K + j, so no search is needed. kv is copied bit for
   bit (bf16 -> its fp32 bits), the score as canon_nan(fl(score + ape[p % ratio])).

Format math comes from formats.py; every step is the reference's fp32 operation in the reference's order,
kernels are launched with enable_fp_fusion=False (SPEC §0.1). Error flags (SLOT_OUT_OF_RANGE for
out_slots past the cache's capacity and ring slots outside the ring, POSITION_OUT_OF_RANGE for RoPE
positions past the table) are OR-ed into the device flag with one atomic per program.

Known difference from the reference, malformed input only: the reference makes cu_seqlens monotone with
a cumulative max before use; the kernels assume it is non-decreasing (the opt-in host check rejects
anything else) and only guarantee that a malformed one never causes an out-of-bounds access.

Block sizes: `LAUNCH` (per window size K) or DSAQUANT_TRITON_V4_LAUNCH="compress_k8=8x16x4" (boundaries per
step x pool columns x warps, powers of two; rope_rotate.py reads the same variable). They change speed only,
never bytes.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from .. import codes, errors
from ..codes import QuantMode, Rounding, ScaleRule, code_of
from . import formats as F
from . import layouts as L
from .formats import (KIND_BF16, KIND_F32, amax_tile, as_bits, canon_nan, cast_for_store, exp_ds,
                      fake_quant_ue8m0_tile, fake_quant_values, fp4_quant_tile, fp8_group_quant, hadamard_row,
                      load_f32, pow2, pow2_inv, rms_norm_row, rope_tail_row, round_bf16, ue8m0_pack)
from .quant import as_f32, as_u8, launch_from_env, launch_modes, tensor_kind

SLOT_ERR: tl.constexpr = tl.constexpr(errors.SLOT_OUT_OF_RANGE)
POS_ERR: tl.constexpr = tl.constexpr(errors.POSITION_OUT_OF_RANGE)
NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))

QUANT_NONE: tl.constexpr = tl.constexpr(int(codes.QuantMode.none))
QUANT_FP4: tl.constexpr = tl.constexpr(int(codes.QuantMode.fp4))
QUANT_FP4_SIM: tl.constexpr = tl.constexpr(int(codes.QuantMode.fp4_sim))
POINT_BITS = {"pool": 1, "norm": 2, "rope": 4, "hadamard": 8}

# window rows K -> (boundaries per step, pool columns per chunk, warps); tokens per program = boundaries x ratio.
# Chosen so that ptxas (sm_90, Triton 3.6) reports no spills, except K = 256 (ratio 128 with overlap, not a
# default), which spills a few hundred bytes at every size tried. Not yet tuned on a GPU.
LAUNCH = {
    "compress_k4": (8, 32, 4),
    "compress_k8": (8, 16, 4),
    "compress_k128": (1, 16, 8),
    "compress_k256": (1, 16, 8),
    # calls with few tokens (decode, ratio 4): one boundary per step, ratio tokens per program, whole rows
    "compress_small": (1, 128, 8),
}
STATE_ELEMS = 4096          # ring-update tile: rows x C elements per program
SMALL_PROGRAMS = 64         # below this many programs at the default block size, use compress_small (ratio 4)


launch_from_env(LAUNCH, "DSAQUANT_TRITON_V4_LAUNCH", "rows x columns x warps", strict=False)   # the other V4 module shares it


# ---------------------------------------------------------------------------------------------------
# device helpers
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _seq_count(tok, cu_ptr, s_cu, B, T, nit):
    """#{j in 1..B : clamp(cu[j], 0, T) <= tok} per token (int32), by binary search over the non-decreasing
    cu_seqlens (nit >= bit length of B iterations). Token tok belongs to sequence count when count < B."""
    lo = tl.zeros(tok.shape, tl.int32)
    hi = tl.zeros(tok.shape, tl.int32) + B
    it = 0
    while it < nit:                      # (a while loop: the interpreter cannot range() over a kernel argument)
        go = lo < hi
        mid = (lo + hi + 1) >> 1
        v = tl.load(cu_ptr + mid.to(tl.int64) * s_cu, mask=go, other=0)
        v = tl.minimum(tl.maximum(v, 0), T)
        le = v <= tok
        lo = tl.where(go & le, mid, lo)
        hi = tl.where(go & ~le, mid - 1, hi)
        it += 1
    return lo


@triton.jit
def _window_part(J: tl.constexpr, i, pb, spb, rslot, act, c, kv_ptr, s_kv, sc_ptr, s_sc, ape_ptr, s_ape,
                 rkv_ptr, rkv0, rkv1, rsc_ptr, rsc0, rsc1, T, R_ring,
                 KIND: tl.constexpr, D: tl.constexpr, RATIO: tl.constexpr, OVERLAP: tl.constexpr, K: tl.constexpr,
                 ROWS: tl.constexpr, CW: tl.constexpr, NATIVE: tl.constexpr):
    """Window rows k = 4m + J (m = 0..K/4-1) of ROWS boundaries (token i [ROWS], position pb, its sequence's
    start position spb and ring slot rslot), columns [c*CW, c*CW + CW) of the row's half: (kv, sigma, included)
    with kv, sigma fp32 [ROWS, K/4, CW] and included bool [ROWS, K/4, 1] (SPEC §7.6 step 1).

    Window row k sits at s = p - K + 1 + k. s < 0: excluded. s >= start_pos: this call's inputs, row
    r = i - (K - 1 - k), sigma = fl(score + ape[s mod ratio]). Otherwise the ring row [slot, s mod R]."""
    M: tl.constexpr = K // 4
    k = 4 * tl.arange(0, M)[None, :, None] + J                       # [1, M, 1]
    s = pb[:, None, None] - (K - 1) + k                               # [ROWS, M, 1] int64
    incl = act[:, None, None] & (s >= 0)
    frm = s >= spb[:, None, None]
    if OVERLAP:
        half = tl.where(k < RATIO, 0, D)                              # the overlap half, then the current half
    else:
        half = k * 0
    col = half + c * CW + tl.arange(0, CW)[None, None, :]            # [1, M, CW]
    r = i[:, None, None].to(tl.int64) - (K - 1) + k
    r = tl.minimum(tl.maximum(r, 0), T - 1)
    sc = tl.maximum(s, 0)
    ph = sc & (RATIO - 1)                                             # s mod ratio (a power of two)
    rr = sc % R_ring
    m_in = incl & frm
    m_rg = incl & ~frm
    kv_in = load_f32(kv_ptr, r * s_kv + col, m_in, KIND, NATIVE)
    sg_in = load_f32(sc_ptr, r * s_sc + col, m_in, KIND, NATIVE) + tl.load(ape_ptr + (ph * s_ape + col), mask=m_in,
                                                                            other=0.0)
    slot = rslot[:, None, None].to(tl.int64)
    kv_rg = tl.load(rkv_ptr + (slot * rkv0 + rr * rkv1 + col), mask=m_rg, other=0.0)
    sg_rg = tl.load(rsc_ptr + (slot * rsc0 + rr * rsc1 + col), mask=m_rg, other=0.0)
    return tl.where(frm, kv_in, kv_rg), tl.where(frm, sg_in, sg_rg), incl


@triton.jit
def _part_stats(g, inc):
    """Per column of a window part g [ROWS, M, CW] (included rows inc): the max of the included non-NaN
    scores (-inf if none), whether an included score is NaN or +inf, whether one is not -inf."""
    mx = tl.max(tl.where(inc & (g == g), g, NEG_INF), axis=1)
    bad = tl.max((inc & ((g != g) | (g == F.FLT_INF))).to(tl.int32), axis=1)
    fin = tl.max((inc & (g != NEG_INF)).to(tl.int32), axis=1)
    return mx, bad, fin


@triton.jit
def _halve_window(p, ROWS: tl.constexpr, N: tl.constexpr, CW: tl.constexpr):
    """One canonical-sum butterfly level over the window axis of [ROWS, N, CW]: out[i] = p[i] + p[i + N/2]."""
    x = tl.permute(tl.reshape(p, (ROWS, 2, N // 2, CW)), (0, 2, 3, 1))     # [ROWS, N/2, CW, 2]
    lo, hi = tl.split(x)
    return lo + hi


@triton.jit
def _window_sum(p, ROWS: tl.constexpr, M: tl.constexpr, CW: tl.constexpr):
    """SPEC §0.2 butterfly of the K/4 = M partials [ROWS, M, CW] along the window axis -> [ROWS, CW]."""
    if M >= 2:
        p = _halve_window(p, ROWS, M, CW)
    if M >= 4:
        p = _halve_window(p, ROWS, M // 2, CW)
    if M >= 8:
        p = _halve_window(p, ROWS, M // 4, CW)
    if M >= 16:
        p = _halve_window(p, ROWS, M // 8, CW)
    if M >= 32:
        p = _halve_window(p, ROWS, M // 16, CW)
    if M >= 64:
        p = _halve_window(p, ROWS, M // 32, CW)
    return tl.reshape(p, (ROWS, CW))


@triton.jit
def _pool_chunk(i, pb, spb, rslot, act, c, kv_ptr, s_kv, sc_ptr, s_sc, ape_ptr, s_ape,
                rkv_ptr, rkv0, rkv1, rsc_ptr, rsc0, rsc1, T, R_ring,
                KIND: tl.constexpr, D: tl.constexpr, RATIO: tl.constexpr, OVERLAP: tl.constexpr, K: tl.constexpr,
                ROWS: tl.constexpr, CW: tl.constexpr, NATIVE: tl.constexpr):
    """SPEC §7.6 step 2 for columns [c*CW, c*CW + CW) of ROWS boundaries -> y [ROWS, CW] fp32:
    m = NaN-ignoring max of the included sigma; e_k = exp_ds(fl(sigma_k - m)) (+0 excluded); S = canonical
    sum of e; w_k = fl(e_k / S); y = canonical sum of fl(w_k * kv_k) (kv = +0 excluded). NaN when every
    included score is -inf or one is NaN or +inf (reference.compress.pool)."""
    M: tl.constexpr = K // 4
    k0, g0, i0 = _window_part(0, i, pb, spb, rslot, act, c, kv_ptr, s_kv, sc_ptr, s_sc, ape_ptr, s_ape, rkv_ptr,
                              rkv0, rkv1, rsc_ptr, rsc0, rsc1, T, R_ring, KIND, D, RATIO, OVERLAP, K, ROWS, CW, NATIVE)
    k1, g1, i1 = _window_part(1, i, pb, spb, rslot, act, c, kv_ptr, s_kv, sc_ptr, s_sc, ape_ptr, s_ape, rkv_ptr,
                              rkv0, rkv1, rsc_ptr, rsc0, rsc1, T, R_ring, KIND, D, RATIO, OVERLAP, K, ROWS, CW, NATIVE)
    k2, g2, i2 = _window_part(2, i, pb, spb, rslot, act, c, kv_ptr, s_kv, sc_ptr, s_sc, ape_ptr, s_ape, rkv_ptr,
                              rkv0, rkv1, rsc_ptr, rsc0, rsc1, T, R_ring, KIND, D, RATIO, OVERLAP, K, ROWS, CW, NATIVE)
    k3, g3, i3 = _window_part(3, i, pb, spb, rslot, act, c, kv_ptr, s_kv, sc_ptr, s_sc, ape_ptr, s_ape, rkv_ptr,
                              rkv0, rkv1, rsc_ptr, rsc0, rsc1, T, R_ring, KIND, D, RATIO, OVERLAP, K, ROWS, CW, NATIVE)
    return _pool_core(k0, k1, k2, k3, g0, g1, g2, g3, i0, i1, i2, i3, ROWS, M, CW)


@triton.jit
def _pool_core(k0, k1, k2, k3, g0, g1, g2, g3, i0, i1, i2, i3, ROWS: tl.constexpr, M: tl.constexpr,
               CW: tl.constexpr):
    """SPEC §7.6 step 2 on a window given as four parts: kv kj, sigma gj [ROWS, M, CW] and included ij
    (broadcastable to them) of window rows k = 4m + j -> y [ROWS, CW] (reference.compress.pool)."""
    m0, b0, f0 = _part_stats(g0, i0)
    m1, b1, f1 = _part_stats(g1, i1)
    m2, b2, f2 = _part_stats(g2, i2)
    m3, b3, f3 = _part_stats(g3, i3)
    m = tl.maximum(tl.maximum(m0, m1), tl.maximum(m2, m3))[:, None, :]
    nan_out = ((b0 | b1 | b2 | b3) != 0) | ((f0 | f1 | f2 | f3) == 0)
    e0 = tl.where(i0, exp_ds(g0 - m), 0.0)
    e1 = tl.where(i1, exp_ds(g1 - m), 0.0)
    e2 = tl.where(i2, exp_ds(g2 - m), 0.0)
    e3 = tl.where(i3, exp_ds(g3 - m), 0.0)
    S = tl.broadcast_to(_window_sum(((e0 + e1) + e2) + e3, ROWS, M, CW)[:, None, :], (ROWS, M, CW))
    t0 = tl.math.div_rn(e0, S) * tl.where(i0, k0, 0.0)
    t1 = tl.math.div_rn(e1, S) * tl.where(i1, k1, 0.0)
    t2 = tl.math.div_rn(e2, S) * tl.where(i2, k2, 0.0)
    t3 = tl.math.div_rn(e3, S) * tl.where(i3, k3, 0.0)
    y = _window_sum(((t0 + t1) + t2) + t3, ROWS, M, CW)
    return tl.where(nan_out, F.from_bits(tl.full(y.shape, F.CANON_NAN_BITS, tl.int32)), y)


@triton.jit
def _store_f32_bytes(ptr, off, x, mask):
    """fp32 x [ROWS] as 4 little-endian bytes at byte offsets off [ROWS]."""
    j = tl.arange(0, 4)[None, :]
    tl.store(ptr + (off[:, None] + j), ((as_bits(x)[:, None] >> (8 * j)) & 0xFF).to(tl.uint8), mask=mask[:, None])


@triton.jit
def _compress_rows(i, pb, spb, rslot, act, kv_ptr, s_kv, sc_ptr, s_sc, ape_ptr, s_ape, rkv_ptr, rkv0, rkv1,
                   rsc_ptr, rsc0, rsc1, nw_ptr, s_nw, eps, cos_ptr, sin_ptr, s_cos, s_sin, max_pos,
                   outs_ptr, s_outs, cache_ptr, cscale_ptr, T, R_ring, capacity, P, points, hadamard, ue8m0, presh,
                   KIND: tl.constexpr, NW_KIND: tl.constexpr, CS_KIND: tl.constexpr, FREQS: tl.constexpr,
                   D: tl.constexpr, RATIO: tl.constexpr, OVERLAP: tl.constexpr, K: tl.constexpr,
                   ROWS: tl.constexpr, CW: tl.constexpr, MODE: tl.constexpr, AITER: tl.constexpr,
                   RULE: tl.constexpr, POLICY: tl.constexpr, BIAS: tl.constexpr, FMAX: tl.constexpr,
                   FNUZ: tl.constexpr, HW_FP8: tl.constexpr, NATIVE: tl.constexpr):
    """SPEC §7.6 steps 1-7 for ROWS boundary tokens (rows with act); returns the error code of these rows."""
    NCH: tl.constexpr = D // CW
    # ---- 1-2. windows and pool, CW columns at a time -------------------------------------------------
    if NCH == 1:
        y = _pool_chunk(i, pb, spb, rslot, act, 0, kv_ptr, s_kv, sc_ptr, s_sc, ape_ptr, s_ape, rkv_ptr, rkv0, rkv1,
                        rsc_ptr, rsc0, rsc1, T, R_ring, KIND, D, RATIO, OVERLAP, K, ROWS, CW, NATIVE)
    else:
        acc = tl.zeros((ROWS, NCH, CW), tl.float32)
        for c in range(NCH):
            yc = _pool_chunk(i, pb, spb, rslot, act, c, kv_ptr, s_kv, sc_ptr, s_sc, ape_ptr, s_ape, rkv_ptr, rkv0,
                             rkv1, rsc_ptr, rsc0, rsc1, T, R_ring, KIND, D, RATIO, OVERLAP, K, ROWS, CW, NATIVE)
            acc = tl.where((tl.arange(0, NCH) == c)[None, :, None], yc[:, None, :], acc)
        y = tl.reshape(acc, (ROWS, D))
    # ---- 3. pool rounding point; 4. RMSNorm over D --------------------------------------------------
    if (points & 1) != 0:
        y = round_bf16(y, NATIVE)
    dd = tl.arange(0, D)
    y = rms_norm_row(y, load_f32(nw_ptr, dd * s_nw, dd >= 0, NW_KIND, NATIVE)[None, :], eps, ROWS, D)
    if (points & 2) != 0:
        y = round_bf16(y, NATIVE)
    # ---- 5. tail RoPE at p + 1 - ratio, clamped into the table --------------------------------------
    raw = pb + 1 - RATIO
    bad_pos = act & ((raw < 0) | (raw >= max_pos))
    pos = tl.minimum(tl.maximum(raw, 0), max_pos - 1)
    am = act[:, None]
    if FREQS:
        f = tl.load(cos_ptr + (pos[:, None] * s_cos + tl.arange(0, 64)[None, :]), mask=am, other=0.0)
        cc, sn = tl.split(tl.reshape(f, (ROWS, 32, 2)))
    else:
        j = tl.arange(0, 32)[None, :]
        cc = load_f32(cos_ptr, pos[:, None] * s_cos + j, am, CS_KIND, NATIVE)
        sn = load_f32(sin_ptr, pos[:, None] * s_sin + j, am, CS_KIND, NATIVE)
    y = rope_tail_row(y, cc, sn, ROWS, D)
    if (points & 4) != 0:
        y = round_bf16(y, NATIVE)
    # ---- 6. optional Hadamard (D = 128) ---------------------------------------------------------------
    if D == 128:
        if hadamard != 0:
            y = hadamard_row(y, ROWS, 128, F.INV_SQRT128)
            if (points & 8) != 0:
                y = round_bf16(y, NATIVE)
    # ---- 7. quantize and store at out_slots[i] --------------------------------------------------------
    slot = tl.load(outs_ptr + i.to(tl.int64) * s_outs, mask=act, other=-1).to(tl.int64)
    bad_slot = act & (slot >= capacity)
    st = act & (slot >= 0) & (slot < capacity)
    n = slot // P
    o = slot % P
    if MODE == QUANT_NONE or MODE == QUANT_FP4_SIM:
        # "none": bf16(y); "fp4_sim": §7.2 stage 1 with scale_rule, as bf16 (bf16 caches go as int16 views)
        if MODE == QUANT_FP4_SIM:
            x4 = tl.reshape(y, (ROWS * 4, 32))
            if RULE == F.RULE_RECIP:
                v = fake_quant_ue8m0_tile(x4, NATIVE)
            else:
                e = ue8m0_pack(amax_tile(x4, NATIVE))[:, None]
                v = fake_quant_values(x4 * pow2_inv(e), pow2(e))
            y = tl.reshape(v, (ROWS, D))
        tl.store(cache_ptr + (slot[:, None] * D + dd[None, :]), cast_for_store(y, KIND_BF16), mask=st[:, None])
    elif MODE == QUANT_FP4:
        q, e = fp4_quant_tile(tl.reshape(y, (ROWS * 4, 32)), RULE, POLICY, ROWS * 4, NATIVE)   # [4R, 16], [4R]
        blk = tl.arange(0, ROWS * 4) % 4
        n4 = tl.reshape(tl.broadcast_to(n[:, None], (ROWS, 4)), (ROWS * 4,))
        o4 = tl.reshape(tl.broadcast_to(o[:, None], (ROWS, 4)), (ROWS * 4,))
        st4 = tl.reshape(tl.broadcast_to(st[:, None], (ROWS, 4)), (ROWS * 4,))
        b16 = tl.arange(0, 16)[None, :]
        if AITER:
            # §6 aiter_fp4: payload tile blk and the exponent of block blk
            tl.store(cache_ptr + (L.aiter_fp4_payload_at(n4, o4, blk, P)[:, None] + b16), q, mask=st4[:, None])
            sf = L.aiter_sflat(o4, P)
            tl.store(cscale_ptr + L.aiter_fp4_exponent_at(n4, sf, blk, P), e.to(tl.uint8), mask=st4)
        else:
            # §6 packed68: payload bytes 16*blk.. and the exponent of block blk
            tl.store(cache_ptr + ((L.packed68_payload_at(n4, o4, P) + 16 * blk)[:, None] + b16), q, mask=st4[:, None])
            tl.store(cache_ptr + (L.packed68_exponent_at(n4, o4, P) + blk), e.to(tl.uint8), mask=st4)
    else:
        # §4 k rule, fp8_132 (§6), preshuffled when presh != 0
        codes, s = fp8_group_quant(y, F.ONE_EM4, ue8m0, BIAS, FMAX, FNUZ, HW_FP8, NATIVE)
        base = L.fp8_132_page_at(n, P)
        off = L.fp8_132_data_in_page(o[:, None], dd[None, :], presh)
        tl.store(cache_ptr + (base[:, None] + off), codes.to(tl.uint8), mask=st[:, None])
        _store_f32_bytes(cache_ptr, base + L.fp8_132_scale_in_page(o, P), s, st)
    return (tl.max(bad_slot.to(tl.int32), axis=0) * SLOT_ERR) | (tl.max(bad_pos.to(tl.int32), axis=0) * POS_ERR)


# ---------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["eps", "max_pos", "T", "B", "nit", "n_ring", "R_ring", "capacity", "P", "points",
                               "hadamard", "ue8m0", "presh"])
def _compress_kernel(kv_ptr, s_kv, sc_ptr, s_sc, ape_ptr, s_ape, rkv_ptr, rkv0, rkv1, rsc_ptr, rsc0, rsc1,
                     sslot_ptr, s_sslot, cu_ptr, s_cu, sp_ptr, s_sp, nw_ptr, s_nw, eps,
                     cos_ptr, sin_ptr, s_cos, s_sin, max_pos, outs_ptr, s_outs, cache_ptr, cscale_ptr,
                     T, B, nit, n_ring, R_ring, capacity, P, err_ptr, points, hadamard, ue8m0, presh,
                     KIND: tl.constexpr, NW_KIND: tl.constexpr, CS_KIND: tl.constexpr, FREQS: tl.constexpr,
                     D: tl.constexpr, RATIO: tl.constexpr, OVERLAP: tl.constexpr, K: tl.constexpr,
                     ROWS: tl.constexpr, TB: tl.constexpr, CW: tl.constexpr, MODE: tl.constexpr, AITER: tl.constexpr,
                     RULE: tl.constexpr, POLICY: tl.constexpr, BIAS: tl.constexpr, FMAX: tl.constexpr,
                     FNUZ: tl.constexpr, HW_FP8: tl.constexpr, NATIVE: tl.constexpr):
    """SPEC §7.6 pooling and stores for the boundary tokens among tokens [pid*TB, pid*TB + TB)."""
    tok = tl.program_id(0) * TB + tl.arange(0, TB)
    cnt = _seq_count(tok, cu_ptr, s_cu, B, T, nit)
    b = tl.minimum(cnt, B - 1).to(tl.int64)
    cu0 = tl.minimum(tl.maximum(tl.load(cu_ptr), 0), T)
    cub = tl.minimum(tl.maximum(tl.load(cu_ptr + b * s_cu), 0), T)
    in_seq = (tok < T) & (cnt < B) & (tok >= cu0)
    sp = tl.load(sp_ptr + b * s_sp, mask=in_seq, other=0).to(tl.int64)
    p = sp + (tok - cub).to(tl.int64)
    rslot = tl.load(sslot_ptr + b * s_sslot, mask=in_seq, other=0)
    ring_ok = (rslot >= 0) & (rslot < n_ring)
    code = tl.max((in_seq & ~ring_ok).to(tl.int32), axis=0) * SLOT_ERR   # the sequence is skipped entirely
    is_b = in_seq & ring_ok & (p >= 0) & (((p + 1) & (RATIO - 1)) == 0)
    flags = is_b.to(tl.int32)
    nb = tl.sum(flags, axis=0)
    idx = tl.cumsum(flags, axis=0) - 1                     # rank of each boundary among this program's
    g = 0
    while g < nb:
        q = g + tl.arange(0, ROWS)
        sel = is_b[None, :] & (idx[None, :] == q[:, None])                 # [ROWS, TB]
        i = tl.sum(tl.where(sel, tok[None, :], 0), axis=1)
        pb = tl.sum(tl.where(sel, p[None, :], 0), axis=1)
        spb = tl.sum(tl.where(sel, sp[None, :], 0), axis=1)
        rs = tl.sum(tl.where(sel, rslot[None, :], 0), axis=1)
        act = q < nb
        code = code | _compress_rows(i, pb, spb, rs, act, kv_ptr, s_kv, sc_ptr, s_sc, ape_ptr, s_ape, rkv_ptr, rkv0,
                                     rkv1, rsc_ptr, rsc0, rsc1, nw_ptr, s_nw, eps, cos_ptr, sin_ptr, s_cos, s_sin,
                                     max_pos, outs_ptr, s_outs, cache_ptr, cscale_ptr, T, R_ring, capacity, P,
                                     points, hadamard, ue8m0, presh, KIND, NW_KIND, CS_KIND, FREQS, D, RATIO, OVERLAP,
                                     K, ROWS, CW, MODE, AITER, RULE, POLICY, BIAS, FMAX, FNUZ, HW_FP8, NATIVE)
        g += ROWS
    tl.atomic_or(err_ptr, code, mask=code != 0)


@triton.jit(do_not_specialize=["T", "B", "n_ring", "R_ring"])
def _state_kernel(kvb_ptr, s_kv, sc_ptr, s_sc, ape_ptr, s_ape, rkv_ptr, rkv0, rkv1, rsc_ptr, rsc0, rsc1,
                  sslot_ptr, s_sslot, cu_ptr, s_cu, sp_ptr, s_sp, T, B, n_ring, R_ring,
                  KIND: tl.constexpr, C: tl.constexpr, K: tl.constexpr, RATIO: tl.constexpr, ROWS: tl.constexpr,
                  NATIVE: tl.constexpr):
    """SPEC §7.6 state update: ring row [state_slot[b], p mod R] of each of the last K tokens of every sequence
    gets kv (its fp32 bits; kvb_ptr is an int16 view of bf16 kv or an int32 view of fp32 kv, rkv_ptr an int32
    view of state_kv) and canon_nan(fl(score + ape[p mod ratio])). Rows are (b, j): token cu[b+1] - K + j."""
    g = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    b = g // K
    jj = g % K
    act = b < B
    lo = tl.minimum(tl.maximum(tl.load(cu_ptr + b * s_cu, mask=act, other=0), 0), T).to(tl.int64)
    hi = tl.minimum(tl.maximum(tl.load(cu_ptr + (b + 1) * s_cu, mask=act, other=0), 0), T).to(tl.int64)
    i = hi - K + jj
    act = act & (i >= lo)
    p = tl.load(sp_ptr + b * s_sp, mask=act, other=0).to(tl.int64) + (i - lo)
    rslot = tl.load(sslot_ptr + b * s_sslot, mask=act, other=0).to(tl.int64)
    act = act & (p >= 0) & (rslot >= 0) & (rslot < n_ring)
    m = act[:, None]
    col = tl.arange(0, C)[None, :]
    ii = tl.where(act, i, 0)[:, None]
    row = (tl.where(act, p, 0) % R_ring)[:, None]
    ph = (tl.where(act, p, 0) & (RATIO - 1))[:, None]
    sl = rslot[:, None]
    if KIND == KIND_BF16:
        bits = tl.load(kvb_ptr + (ii * s_kv + col), mask=m, other=0).to(tl.int32) << 16
    else:
        bits = tl.load(kvb_ptr + (ii * s_kv + col), mask=m, other=0)
    tl.store(rkv_ptr + (sl * rkv0 + row * rkv1 + col), bits, mask=m)
    sg = load_f32(sc_ptr, ii * s_sc + col, m, KIND, NATIVE) + tl.load(ape_ptr + (ph * s_ape + col), mask=m, other=0.0)
    tl.store(rsc_ptr + (sl * rsc0 + row * rsc1 + col), canon_nan(sg), mask=m)


# ---------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------
def launch_config(K: int, D: int, T: int, ratio: int):
    """(boundaries per step, tokens per program, pool columns per chunk, warps) of the compress launch."""
    rows, cw, warps = LAUNCH[f"compress_k{K}"]
    if ratio == 4 and triton.cdiv(T, rows * ratio) < SMALL_PROGRAMS:
        rows, cw, warps = LAUNCH["compress_small"]
    return rows, rows * ratio, min(cw, D), warps


def _common(kv, score, ape, state_kv, state_score, state_slot, cu_seqlens, start_pos):
    return [kv, kv.stride(0), score, score.stride(0), ape, ape.stride(0), state_kv, state_kv.stride(0),
            state_kv.stride(1), state_score, state_score.stride(0), state_score.stride(1), state_slot,
            state_slot.stride(0), cu_seqlens, cu_seqlens.stride(0), start_pos, start_pos.stride(0)]


def prepare_compress(kv, score, ape, state_kv, state_score, state_slot, cu_seqlens, start_pos, norm_weight, epsilon,
                     cos_cache, sin_cache, out_slots, cache, cache_scale, ratio, overlap, quant_mode, layout,
                     scale_rule, rounding, scale_fmt, fp8_flavour, preshuffle, hadamard_on, bf16_after, freqs,
                     update_state, page_size, modes=None):
    """(kernel, grid, positional args, constexprs, num_warps) of the compress launch (the op's first launch;
    also used by the ahead-of-time compile test). Arguments as reference.compress.compress_kv."""
    T, C = kv.shape
    D = C // 2 if overlap else C
    K = ratio * (2 if overlap else 1)
    B = state_slot.shape[0]
    fp8 = quant_mode == "fp8"
    flavour = fp8_flavour if fp8 else "e4m3fn"
    md = launch_modes(kv.device, flavour if fp8 else None, modes)
    nat = md["NATIVE"]
    rows, tb, cw, warps = launch_config(K, D, T, ratio)
    kvv, kind = tensor_kind(kv, nat)
    scv, _ = tensor_kind(score, nat)
    nwv, nw_kind = tensor_kind(norm_weight, nat)
    if freqs is not None:
        cv, sv, s_cos, s_sin, cs_kind, max_pos = freqs, freqs, freqs.stride(0), freqs.stride(0), KIND_F32.value, \
            freqs.shape[0]
    else:
        cv, cs_kind = tensor_kind(cos_cache, nat)
        sv, _ = tensor_kind(sin_cache, nat)
        s_cos, s_sin, max_pos = cos_cache.stride(0), sin_cache.stride(0), cos_cache.shape[0]
    cache_v = cache.view(torch.int16) if quant_mode in ("none", "fp4_sim") else as_u8(cache)
    cscale_v = as_u8(cache_scale) if cache_scale is not None else cache_v
    bias, fmax, _ = F.fp8_consts(flavour)
    points = sum(POINT_BITS[n] for n in set(bf16_after))
    args = _common(kvv, scv, ape, state_kv, state_score, state_slot, cu_seqlens, start_pos)
    args += [nwv, norm_weight.stride(0), as_f32(epsilon), cv, sv, s_cos, s_sin, max_pos, out_slots, out_slots.stride(0),
             cache_v, cscale_v, T, B, max(1, B.bit_length()), state_kv.shape[0], state_kv.shape[1],
             cache.shape[0] * page_size, page_size, errors.flag_tensor(kv.device), points, int(bool(hadamard_on)),
             int(scale_fmt == "ue8m0"), int(bool(preshuffle))]
    consts = dict(KIND=kind, NW_KIND=nw_kind, CS_KIND=cs_kind, FREQS=freqs is not None, D=D, RATIO=ratio,
                  OVERLAP=bool(overlap), K=K, ROWS=rows, TB=tb, CW=cw, MODE=code_of(QuantMode, quant_mode),
                  AITER=(quant_mode == "fp4" and layout == "aiter_fp4"), RULE=code_of(ScaleRule, scale_rule),
                  POLICY=code_of(Rounding, rounding), BIAS=bias, FMAX=fmax, FNUZ=(flavour == "e4m3fnuz"),
                  HW_FP8=md["HW_FP8"] and fp8, NATIVE=nat)
    return _compress_kernel, (triton.cdiv(T, tb),), args, consts, warps


def prepare_state(kv, score, ape, state_kv, state_score, state_slot, cu_seqlens, start_pos, ratio, overlap,
                  modes=None):
    """(kernel, grid, positional args, constexprs, num_warps) of the ring update (the op's second launch)."""
    T, C = kv.shape
    K = ratio * (2 if overlap else 1)
    B = state_slot.shape[0]
    md = launch_modes(kv.device, None, modes)
    nat = md["NATIVE"]
    if kv.dtype == torch.bfloat16:
        kvb, kind = kv.view(torch.int16), KIND_BF16.value
    else:
        kvb, kind = kv.view(torch.int32), KIND_F32.value
    scv, _ = tensor_kind(score, nat)
    rows = max(1, STATE_ELEMS // C)
    args = _common(kvb, scv, ape, state_kv.view(torch.int32), state_score, state_slot, cu_seqlens, start_pos)
    args += [T, B, state_kv.shape[0], state_kv.shape[1]]
    consts = dict(KIND=kind, C=C, K=K, RATIO=ratio, ROWS=rows, NATIVE=nat)
    return _state_kernel, (triton.cdiv(B * K, rows),), args, consts, 4


def compress_kv(kv, score, ape, state_kv, state_score, state_slot, cu_seqlens, start_pos, norm_weight, epsilon,
                cos_cache, sin_cache, out_slots, cache, cache_scale, ratio, overlap, quant_mode, layout, scale_rule,
                rounding, scale_fmt, fp8_flavour, preshuffle, hadamard_on, bf16_after, freqs, update_state,
                page_size):
    """SPEC §7.6 (same arguments as reference.compress.compress_kv; see dsaquant.compress.compress_kv).

    kv, score [T, C] fp32/bf16 (rows may be strided); ape [ratio, C] fp32; state_kv, state_score
    [N_ring, R, C] fp32; state_slot [B] int32; cu_seqlens [B+1] int32; start_pos [B] int64; norm_weight [D]
    fp32/bf16; cos_cache/sin_cache [max_pos, 32] or freqs [max_pos, 64] fp32; out_slots [T] int64; cache (and
    cache_scale) as quant_mode/layout say. Two launches: compress (every ring read), then the ring update."""
    T = kv.shape[0]
    B = state_slot.shape[0]
    if T == 0 or B == 0:
        return
    kernel, grid, args, consts, warps = prepare_compress(
        kv, score, ape, state_kv, state_score, state_slot, cu_seqlens, start_pos, norm_weight, epsilon, cos_cache,
        sin_cache, out_slots, cache, cache_scale, ratio, overlap, quant_mode, layout, scale_rule, rounding, scale_fmt,
        fp8_flavour, preshuffle, hadamard_on, bf16_after, freqs, update_state, page_size)
    kernel[grid](*args, **consts, num_warps=warps, enable_fp_fusion=False)
    if update_state:
        kernel, grid, args, consts, warps = prepare_state(kv, score, ape, state_kv, state_score, state_slot,
                                                          cu_seqlens, start_pos, ratio, overlap)
        kernel[grid](*args, **consts, num_warps=warps, enable_fp_fusion=False)


OPS = {"compress_kv": compress_kv}

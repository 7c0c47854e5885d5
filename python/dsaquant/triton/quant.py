"""The `triton` backend's writers (SPEC §7.1-§7.3): kernels and host wrappers.

Each host wrapper has exactly the signature of the reference function of the same name in
python/dsaquant/reference/ops.py (dsaquant.ops validates the arguments and calls it positionally) and
writes the same bytes. The format math lives in formats.py.

Kernel design (see also `LAUNCH` below):
- every program works on a [BLOCK, 128] tile of rows (q rows are (token, head) pairs flattened, so any H
  works and a program may span tokens; k rows are tokens), carried as four [BLOCK, 32] fp32 tiles; each
  tile load is 16 bytes per thread for bf16/fp16 rows; cos/sin rows are gathered per row (L1 hits: the
  heads of a token share them);
- `indexer_qk_rope_quant_and_cache` is one launch: programs [0, n_q) do q rows, the rest k rows;
- the other ops are one launch each;
- slots at or past the cache's capacity are skipped; they, and positions outside [0, max_pos) (clamped),
  OR errors.SLOT_OUT_OF_RANGE / POSITION_OUT_OF_RANGE into the device's error flag, with at most one
  atomic per program (no host sync);
- kernels are launched with enable_fp_fusion=False (SPEC §0.1);
- `prepare_*` return (kernel, grid, args, constexprs, num_warps) of a launch without launching it
  (tests/test_triton_aot.py compiles them for sm_90, sm_100, gfx942 and gfx950).

Block sizes: `LAUNCH`, or DSAQUANT_TRITON_LAUNCH="indexer_q=64x8,k_store=32x4" (rows x warps, powers of
two). They change speed only, never bytes.
"""
from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

from .. import errors
from ..codes import Rounding, code_of
from . import formats as F
from . import layouts as L
from .formats import (KIND_BF16, KIND_F16, KIND_F32, RULE_PACK, RULE_RECIP, amax_tile, canon_nan, canonical_sum4,
                      cast_for_store, fake_quant_e4m3_tile, fake_quant_ue8m0_tile, fp4_quant_tile, fp8_encode_scaled,
                      hadamard4, load_f32, pow2, rms_inv, rope_interleaved_tile, rope_pair, round_bf16, round_to)

SLOT_ERR: tl.constexpr = tl.constexpr(errors.SLOT_OUT_OF_RANGE)
POS_ERR: tl.constexpr = tl.constexpr(errors.POSITION_OUT_OF_RANGE)

# rows per program and warps per program, by kernel (any powers of two work; bytes never depend on them)
LAUNCH = {
    "indexer_q": (32, 4),
    "indexer_k": (16, 4),
    "k_store": (16, 4),
    "q_pack": (16, 1),
    "fake_quant": (32, 4),
    "v4_k": (16, 4),
}


def launch_from_env(launch: dict, var: str, fields: str, strict: bool = True) -> None:
    """Override entries of `launch` ({kernel: (n, ...)}) from the environment variable `var`:
    "name=AxB,name2=A" (`fields` names the numbers, e.g. "rows x warps"; omitted trailing numbers keep their
    value; each a power of two). strict: an unknown name is an error; otherwise it is left to the other
    module that reads the same variable."""
    for item in filter(None, (x.strip() for x in os.environ.get(var, "").split(","))):
        name, _, val = item.partition("=")
        if name not in launch:
            if strict:
                raise ValueError(f"{var}: unknown kernel {name!r}; expected one of {sorted(launch)}")
            continue
        parts = [int(v) for v in val.split("x")]
        if len(parts) > len(launch[name]) or any(v < 1 or v & (v - 1) for v in parts):
            raise ValueError(f"{var}: {item!r}: expected {fields}, powers of two")
        launch[name] = tuple(parts) + tuple(launch[name][len(parts):])


launch_from_env(LAUNCH, "DSAQUANT_TRITON_LAUNCH", "rows x warps")


# ---------------------------------------------------------------------------------------------------
# shared device helpers
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _flag_errors(err_ptr, bad_slot, bad_pos):
    """OR SLOT_OUT_OF_RANGE / POSITION_OUT_OF_RANGE into the device error flag if any row of bad_slot /
    bad_pos ([R] bool) is set: at most one atomic per program, none when all is well."""
    code = (tl.max(bad_slot.to(tl.int32), axis=0) * SLOT_ERR) | (tl.max(bad_pos.to(tl.int32), axis=0) * POS_ERR)
    tl.atomic_or(err_ptr, code, mask=code != 0)


@triton.jit
def _load_tiles(ptr, row_off, mask, KIND: tl.constexpr, NATIVE: tl.constexpr):
    """Four [R, 32] fp32 tiles of the 128-wide rows starting at element offsets row_off [R]."""
    c = tl.arange(0, 32)[None, :]
    base = row_off[:, None]
    m = mask[:, None]
    t0 = load_f32(ptr, base + c, m, KIND, NATIVE)
    t1 = load_f32(ptr, base + (c + 32), m, KIND, NATIVE)
    t2 = load_f32(ptr, base + (c + 64), m, KIND, NATIVE)
    t3 = load_f32(ptr, base + (c + 96), m, KIND, NATIVE)
    return t0, t1, t2, t3


@triton.jit
def _load_vec_tiles(ptr, stride, KIND: tl.constexpr, NATIVE: tl.constexpr):
    """A [128] vector (norm weight/bias) as four [1, 32] fp32 tiles."""
    c = tl.arange(0, 32)[None, :]
    m = c >= 0
    t0 = load_f32(ptr, c * stride, m, KIND, NATIVE)
    t1 = load_f32(ptr, (c + 32) * stride, m, KIND, NATIVE)
    t2 = load_f32(ptr, (c + 64) * stride, m, KIND, NATIVE)
    t3 = load_f32(ptr, (c + 96) * stride, m, KIND, NATIVE)
    return t0, t1, t2, t3


@triton.jit
def _rope_positions(pos_ptr, s_pos, t, mask, max_pos, ratio):
    """(pos & ~(r-1) clamped into [0, max_pos), raw pos outside [0, max_pos)) for rows `mask` ([R] int64,
    [R] bool; reference transforms.rope_positions, which flags POSITION_OUT_OF_RANGE for the latter)."""
    raw = tl.load(pos_ptr + t * s_pos, mask=mask, other=0).to(tl.int64)
    bad = mask & ((raw < 0) | (raw >= max_pos))
    p = raw & (-ratio)                               # ratio a power of two (1: & -1, no change)
    p = tl.where(p < 0, 0, p)
    return tl.where(p > max_pos - 1, max_pos - 1, p), bad


@triton.jit
def _rope_head(t0, t1, cos_ptr, sin_ptr, s_cos, s_sin, p, mask, CS_KIND: tl.constexpr, NEOX: tl.constexpr,
               R: tl.constexpr, NATIVE: tl.constexpr):
    """SPEC §5 head RoPE (dims 0..63 = tiles t0, t1) with cos/sin tables [max_pos, 32]."""
    m = mask[:, None]
    if NEOX:
        j = tl.arange(0, 32)[None, :]
        c = load_f32(cos_ptr, p[:, None] * s_cos + j, m, CS_KIND, NATIVE)
        s = load_f32(sin_ptr, p[:, None] * s_sin + j, m, CS_KIND, NATIVE)
        t0, t1 = rope_pair(t0, t1, c, s)
    else:
        j = tl.arange(0, 16)[None, :]
        c0 = load_f32(cos_ptr, p[:, None] * s_cos + j, m, CS_KIND, NATIVE)
        s0 = load_f32(sin_ptr, p[:, None] * s_sin + j, m, CS_KIND, NATIVE)
        c1 = load_f32(cos_ptr, p[:, None] * s_cos + (j + 16), m, CS_KIND, NATIVE)
        s1 = load_f32(sin_ptr, p[:, None] * s_sin + (j + 16), m, CS_KIND, NATIVE)
        t0 = rope_interleaved_tile(t0, c0, s0, R)
        t1 = rope_interleaved_tile(t1, c1, s1, R)
    return t0, t1


@triton.jit
def _rope_tail_tables(t2, t3, cos_ptr, sin_ptr, s_cos, s_sin, p, mask, CS_KIND: tl.constexpr, R: tl.constexpr,
                      NATIVE: tl.constexpr):
    """SPEC §5 tail interleaved RoPE (dims 64..127 = tiles t2, t3) with cos/sin tables [max_pos, 32]."""
    m = mask[:, None]
    j = tl.arange(0, 16)[None, :]
    c0 = load_f32(cos_ptr, p[:, None] * s_cos + j, m, CS_KIND, NATIVE)
    s0 = load_f32(sin_ptr, p[:, None] * s_sin + j, m, CS_KIND, NATIVE)
    c1 = load_f32(cos_ptr, p[:, None] * s_cos + (j + 16), m, CS_KIND, NATIVE)
    s1 = load_f32(sin_ptr, p[:, None] * s_sin + (j + 16), m, CS_KIND, NATIVE)
    return rope_interleaved_tile(t2, c0, s0, R), rope_interleaved_tile(t3, c1, s1, R)


@triton.jit
def _rope_tail_freqs(t2, t3, f_ptr, s_f, p, mask, R: tl.constexpr):
    """SPEC §5 tail interleaved RoPE with the fp32 (cos, sin) pair table freqs [max_pos, 64]."""
    m = mask[:, None]
    j = tl.arange(0, 32)[None, :]
    f0 = tl.load(f_ptr + (p[:, None] * s_f + j), mask=m, other=0.0)          # pairs 0..15
    f1 = tl.load(f_ptr + (p[:, None] * s_f + (j + 32)), mask=m, other=0.0)   # pairs 16..31
    c0, s0 = tl.split(tl.reshape(f0, (R, 16, 2)))
    c1, s1 = tl.split(tl.reshape(f1, (R, 16, 2)))
    return rope_interleaved_tile(t2, c0, s0, R), rope_interleaved_tile(t3, c1, s1, R)


@triton.jit
def _store_bytes16(ptr, off, vals, mask):
    """Store [R, 16] bytes at byte offsets off [R] (+ 0..15)."""
    tl.store(ptr + (off[:, None] + tl.arange(0, 16)[None, :]), vals, mask=mask[:, None])


@triton.jit
def _fp8_row(t0, t1, t2, t3, IS_Q: tl.constexpr, ue8m0, BIAS: tl.constexpr, FMAX: tl.constexpr,
             INV_FMAX: tl.constexpr, FNUZ: tl.constexpr, HW_FP8: tl.constexpr, NATIVE: tl.constexpr):
    """SPEC §4 row quantization (reference fp8_quantize, block 128): codes [R, 32] x4 (int32) and scale [R]."""
    amax = tl.maximum(tl.maximum(amax_tile(t0, NATIVE), amax_tile(t1, NATIVE)),
                      tl.maximum(amax_tile(t2, NATIVE), amax_tile(t3, NATIVE)))
    if IS_Q:
        s = tl.where(amax < F.ONE_EM10, F.ONE_EM10, amax) * INV_FMAX
    else:
        a = tl.where(amax < F.ONE_EM4, F.ONE_EM4, amax)
        s = tl.math.div_rn(a, tl.full(a.shape, FMAX, tl.float32))
    s = tl.where(ue8m0 != 0, pow2(F.ceil_exp(s)), s)
    inv = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)[:, None]
    c0 = fp8_encode_scaled(t0, inv, BIAS, FMAX, FNUZ, HW_FP8)
    c1 = fp8_encode_scaled(t1, inv, BIAS, FMAX, FNUZ, HW_FP8)
    c2 = fp8_encode_scaled(t2, inv, BIAS, FMAX, FNUZ, HW_FP8)
    c3 = fp8_encode_scaled(t3, inv, BIAS, FMAX, FNUZ, HW_FP8)
    return c0, c1, c2, c3, s


@triton.jit
def _fp8_132_tile_off(base, o, k: tl.constexpr, presh):
    """Byte offsets [R, 32] of data bytes 32k..32k+31 of slots at page base `base` [R], position o [R],
    plain or preshuffled when presh != 0 (layouts.fp8_132_data_in_page)."""
    d = tl.arange(0, 32)[None, :] + 32 * k
    return base[:, None] + L.fp8_132_data_in_page(o[:, None], d, presh)


@triton.jit
def _store_f32_bytes(ptr, off, x, mask):
    """Store fp32 x [R] as 4 little-endian bytes at byte offsets off [R]."""
    j = tl.arange(0, 4)[None, :]
    b = (F.as_bits(x)[:, None] >> (8 * j)) & 0xFF
    tl.store(ptr + (off[:, None] + j), b.to(tl.uint8), mask=mask[:, None])


@triton.jit
def _aiter_fp4_store(kv_ptr, kvs_ptr, slot, P, p0, p1, p2, p3, e0, e1, e2, e3, mask):
    """SPEC §6 aiter_fp4 (layouts.aiter_fp4_payload_at / aiter_fp4_exponent_at): payload tiles p0..p3 [R, 16]
    and block exponents e0..e3 [R] of slots [R]."""
    n = slot // P
    o = slot % P
    _store_bytes16(kv_ptr, L.aiter_fp4_payload_at(n, o, 0, P), p0, mask)
    _store_bytes16(kv_ptr, L.aiter_fp4_payload_at(n, o, 1, P), p1, mask)
    _store_bytes16(kv_ptr, L.aiter_fp4_payload_at(n, o, 2, P), p2, mask)
    _store_bytes16(kv_ptr, L.aiter_fp4_payload_at(n, o, 3, P), p3, mask)
    sf = L.aiter_sflat(o, P)
    tl.store(kvs_ptr + L.aiter_fp4_exponent_at(n, sf, 0, P), e0.to(tl.uint8), mask=mask)
    tl.store(kvs_ptr + L.aiter_fp4_exponent_at(n, sf, 1, P), e1.to(tl.uint8), mask=mask)
    tl.store(kvs_ptr + L.aiter_fp4_exponent_at(n, sf, 2, P), e2.to(tl.uint8), mask=mask)
    tl.store(kvs_ptr + L.aiter_fp4_exponent_at(n, sf, 3, P), e3.to(tl.uint8), mask=mask)


@triton.jit
def _sglang_two_stage(t, POLICY: tl.constexpr, R: tl.constexpr, NATIVE: tl.constexpr, PACKED_FP4: tl.constexpr):
    """SPEC §7.2 stage 1 (recip fake-quant, bf16) then stage 2 (rule pack) on one block-of-32 tile. The staged
    values are bf16 values whatever the input dtype, so stage 2 may take the packed bf16x2 encoder."""
    staged = round_bf16(fake_quant_ue8m0_tile(t, NATIVE), NATIVE)
    return fp4_quant_tile(staged, RULE_PACK, POLICY, R, NATIVE, PACKED_FP4)


# ---------------------------------------------------------------------------------------------------
# §7.1 indexer_qk_rope_quant_and_cache
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _indexer_q_rows(pid, q_ptr, sq_t, sq_h, w_ptr, sw_t, sw_h, wo_ptr, swo_t, swo_h, qo_ptr, qs_ptr, slot_ptr,
                    s_slot, pos_ptr, s_pos, cos_ptr, sin_ptr, s_cos, s_sin, max_pos, wscale, T, qs_pad,
                    ue8m0, all_q,
                    X_KIND: tl.constexpr, W_KIND: tl.constexpr, WO_KIND: tl.constexpr, CS_KIND: tl.constexpr,
                    FP4: tl.constexpr, POLICY: tl.constexpr, BIAS: tl.constexpr,
                    FMAX: tl.constexpr, INV_FMAX: tl.constexpr, FNUZ: tl.constexpr, NEOX: tl.constexpr,
                    BLOCK_Q: tl.constexpr, HW_FP8: tl.constexpr, NATIVE: tl.constexpr,
                    PACKED_FP4: tl.constexpr, H: tl.constexpr, ROWS32: tl.constexpr):
    """q rows ((token, head) pairs) of program `pid` (SPEC §7.1). H is a constexpr (a model has one or two
    head counts): the split of a row index into (token, head) is a multiply and a shift, in 32 bits when
    ROWS32 (T * H < 2^31), instead of a 64-bit division by a runtime H."""
    R: tl.constexpr = BLOCK_Q
    if ROWS32:
        r32 = pid * R + tl.arange(0, R)
        in_range = r32 < T * H
        t32 = r32 // H
        h = r32 - t32 * H
        r = r32.to(tl.int64)
        t = t32.to(tl.int64)
    else:
        r = pid.to(tl.int64) * R + tl.arange(0, R)
        in_range = r < T * H
        t = r // H
        h = r % H
    slot = tl.load(slot_ptr + t * s_slot, mask=in_range, other=-1).to(tl.int64)
    act = in_range & ((slot >= 0) | (all_q != 0))
    p, _ = _rope_positions(pos_ptr, s_pos, t, act, max_pos, 1)     # the k programs flag bad positions
    t0, t1, t2, t3 = _load_tiles(q_ptr, t * sq_t + h * sq_h, act, X_KIND, NATIVE)
    t0, t1 = _rope_head(t0, t1, cos_ptr, sin_ptr, s_cos, s_sin, p, act, CS_KIND, NEOX, R, NATIVE)
    t0 = round_to(t0, X_KIND, NATIVE)
    t1 = round_to(t1, X_KIND, NATIVE)
    # t2, t3 pass through: exact in X's dtype already (a NaN among them is canonicalised by the quantizer)
    w_off = t * sw_t + h * sw_h
    wo_off = t * swo_t + h * swo_h
    if FP4:
        # PACKED_FP4 (bf16 q only): t0..t3 hold bf16 values (t0, t1 rounded above, t2, t3 loaded)
        q0, e0 = fp4_quant_tile(t0, RULE_RECIP, POLICY, R, NATIVE, PACKED_FP4)
        q1, e1 = fp4_quant_tile(t1, RULE_RECIP, POLICY, R, NATIVE, PACKED_FP4)
        q2, e2 = fp4_quant_tile(t2, RULE_RECIP, POLICY, R, NATIVE, PACKED_FP4)
        q3, e3 = fp4_quant_tile(t3, RULE_RECIP, POLICY, R, NATIVE, PACKED_FP4)
        _store_bytes16(qo_ptr, r * 64, q0, act)
        _store_bytes16(qo_ptr, r * 64 + 16, q1, act)
        _store_bytes16(qo_ptr, r * 64 + 32, q2, act)
        _store_bytes16(qo_ptr, r * 64 + 48, q3, act)
        # q scales [T, 1, 4, 16, qs_pad] (layouts.aiter_q_scale_at, 4 groups a token)
        tl.store(qs_ptr + L.aiter_q_scale_at(t, 0, h, 4, qs_pad), e0.to(tl.uint8), mask=act)
        tl.store(qs_ptr + L.aiter_q_scale_at(t, 1, h, 4, qs_pad), e1.to(tl.uint8), mask=act)
        tl.store(qs_ptr + L.aiter_q_scale_at(t, 2, h, 4, qs_pad), e2.to(tl.uint8), mask=act)
        tl.store(qs_ptr + L.aiter_q_scale_at(t, 3, h, 4, qs_pad), e3.to(tl.uint8), mask=act)
        # pad columns H/16 .. qs_pad-1 are written 0 by the rows of heads 0..15
        hb = H // 16
        jj = tl.arange(0, 4)[None, :]
        padm = act[:, None] & (h[:, None] < 16) & (jj < qs_pad - hb)
        zero = tl.zeros((R, 4), tl.uint8)
        for g in tl.static_range(4):
            tl.store(qs_ptr + ((L.aiter_q_scale_at(t, g, h % 16, 4, qs_pad) + hb)[:, None] + jj), zero, mask=padm)
        # weights: copied, cast to weights_out's dtype (reference `cast`: canonical NaN)
        w = load_f32(w_ptr, w_off, act, W_KIND, NATIVE)
        tl.store(wo_ptr + wo_off, cast_for_store(w, WO_KIND), mask=act)
    else:
        c0, c1, c2, c3, s = _fp8_row(t0, t1, t2, t3, True, ue8m0, BIAS, FMAX, INV_FMAX, FNUZ, HW_FP8, NATIVE)
        d = tl.arange(0, 32)[None, :]
        m = act[:, None]
        ob = (r * 128)[:, None]
        tl.store(qo_ptr + (ob + d), c0.to(tl.uint8), mask=m)
        tl.store(qo_ptr + (ob + (d + 32)), c1.to(tl.uint8), mask=m)
        tl.store(qo_ptr + (ob + (d + 64)), c2.to(tl.uint8), mask=m)
        tl.store(qo_ptr + (ob + (d + 96)), c3.to(tl.uint8), mask=m)
        w = load_f32(w_ptr, w_off, act, W_KIND, NATIVE)
        tl.store(wo_ptr + wo_off, canon_nan((w * s) * wscale), mask=act)


@triton.jit
def _indexer_k_rows(pid, k_ptr, sk_t, kv_ptr, kvs_ptr, slot_ptr, s_slot, pos_ptr, s_pos, nw_ptr, s_nw, nb_ptr, s_nb,
                    cos_ptr, sin_ptr, s_cos, s_sin, max_pos, eps, T, capacity, P, err_ptr, ue8m0, presh,
                    X_KIND: tl.constexpr, CS_KIND: tl.constexpr, NW_KIND: tl.constexpr, NB_KIND: tl.constexpr,
                    FP4: tl.constexpr, POLICY: tl.constexpr, BIAS: tl.constexpr,
                    FMAX: tl.constexpr, INV_FMAX: tl.constexpr, FNUZ: tl.constexpr,
                    NEOX: tl.constexpr, BLOCK_K: tl.constexpr, HW_FP8: tl.constexpr, NATIVE: tl.constexpr,
                    PACKED_FP4: tl.constexpr):
    """k rows (tokens) of k-program `pid` (SPEC §7.1)."""
    R: tl.constexpr = BLOCK_K
    t = pid.to(tl.int64) * R + tl.arange(0, R)
    in_range = t < T
    slot = tl.load(slot_ptr + t * s_slot, mask=in_range, other=-1).to(tl.int64)
    act = in_range & (slot >= 0) & (slot < capacity)
    p, bad_pos = _rope_positions(pos_ptr, s_pos, t, in_range, max_pos, 1)   # every token, as the reference
    _flag_errors(err_ptr, in_range & (slot >= capacity), bad_pos)
    x0, x1, x2, x3 = _load_tiles(k_ptr, t * sk_t, act, X_KIND, NATIVE)
    # LayerNorm (SPEC §5): mean = S(x)/128, d = x - mean, var = S(d*d)/128, inv = 1/sqrt(var + eps)
    mean = (canonical_sum4(x0, x1, x2, x3, R) * F.INV128)[:, None]
    d0 = x0 - mean
    d1 = x1 - mean
    d2 = x2 - mean
    d3 = x3 - mean
    var = canonical_sum4(d0 * d0, d1 * d1, d2 * d2, d3 * d3, R) * F.INV128
    inv = F.inv_sqrt(var + eps)[:, None]
    w0, w1, w2, w3 = _load_vec_tiles(nw_ptr, s_nw, NW_KIND, NATIVE)
    b0, b1, b2, b3 = _load_vec_tiles(nb_ptr, s_nb, NB_KIND, NATIVE)
    y0 = round_to((d0 * inv) * w0 + b0, X_KIND, NATIVE)
    y1 = round_to((d1 * inv) * w1 + b1, X_KIND, NATIVE)
    y2 = round_to((d2 * inv) * w2 + b2, X_KIND, NATIVE)
    y3 = round_to((d3 * inv) * w3 + b3, X_KIND, NATIVE)
    y0, y1 = _rope_head(y0, y1, cos_ptr, sin_ptr, s_cos, s_sin, p, act, CS_KIND, NEOX, R, NATIVE)
    y0 = round_to(y0, X_KIND, NATIVE)
    y1 = round_to(y1, X_KIND, NATIVE)
    n = slot // P
    o = slot % P
    if FP4:
        # PACKED_FP4 (bf16 k only): y0..y3 are rounded to bf16 above
        q0, e0 = fp4_quant_tile(y0, RULE_RECIP, POLICY, R, NATIVE, PACKED_FP4)
        q1, e1 = fp4_quant_tile(y1, RULE_RECIP, POLICY, R, NATIVE, PACKED_FP4)
        q2, e2 = fp4_quant_tile(y2, RULE_RECIP, POLICY, R, NATIVE, PACKED_FP4)
        q3, e3 = fp4_quant_tile(y3, RULE_RECIP, POLICY, R, NATIVE, PACKED_FP4)
        _aiter_fp4_store(kv_ptr, kvs_ptr, slot, P, q0, q1, q2, q3, e0, e1, e2, e3, act)
    else:
        c0, c1, c2, c3, s = _fp8_row(y0, y1, y2, y3, False, ue8m0, BIAS, FMAX, INV_FMAX, FNUZ, HW_FP8, NATIVE)
        base = L.fp8_132_page_at(n, P)
        m = act[:, None]
        tl.store(kv_ptr + _fp8_132_tile_off(base, o, 0, presh), c0.to(tl.uint8), mask=m)
        tl.store(kv_ptr + _fp8_132_tile_off(base, o, 1, presh), c1.to(tl.uint8), mask=m)
        tl.store(kv_ptr + _fp8_132_tile_off(base, o, 2, presh), c2.to(tl.uint8), mask=m)
        tl.store(kv_ptr + _fp8_132_tile_off(base, o, 3, presh), c3.to(tl.uint8), mask=m)
        _store_f32_bytes(kv_ptr, base + L.fp8_132_scale_in_page(o, P), s, act)


@triton.jit(do_not_specialize=["ue8m0", "presh", "all_q"])
def _indexer_kernel(
        q_ptr, sq_t, sq_h, k_ptr, sk_t, w_ptr, sw_t, sw_h, wo_ptr, swo_t, swo_h,
        qo_ptr, qs_ptr, kv_ptr, kvs_ptr, slot_ptr, s_slot, pos_ptr, s_pos,
        nw_ptr, s_nw, nb_ptr, s_nb, cos_ptr, sin_ptr, s_cos, s_sin, max_pos,
        eps, wscale, T, n_q_prog, capacity, P, qs_pad, err_ptr, ue8m0, presh, all_q,
        X_KIND: tl.constexpr, W_KIND: tl.constexpr, WO_KIND: tl.constexpr, CS_KIND: tl.constexpr,
        NW_KIND: tl.constexpr, NB_KIND: tl.constexpr,
        FP4: tl.constexpr, POLICY: tl.constexpr, BIAS: tl.constexpr, FMAX: tl.constexpr,
        INV_FMAX: tl.constexpr, FNUZ: tl.constexpr, NEOX: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HW_FP8: tl.constexpr, NATIVE: tl.constexpr,
        PACKED_FP4: tl.constexpr, H: tl.constexpr, ROWS32: tl.constexpr):
    """One launch: programs [0, n_q_prog) quantize q rows, the rest LayerNorm/quantize/store k rows."""
    pid = tl.program_id(0)
    if pid < n_q_prog:
        _indexer_q_rows(pid, q_ptr, sq_t, sq_h, w_ptr, sw_t, sw_h, wo_ptr, swo_t, swo_h, qo_ptr, qs_ptr, slot_ptr,
                        s_slot, pos_ptr, s_pos, cos_ptr, sin_ptr, s_cos, s_sin, max_pos, wscale, T, qs_pad,
                        ue8m0, all_q, X_KIND, W_KIND, WO_KIND, CS_KIND, FP4, POLICY, BIAS, FMAX, INV_FMAX, FNUZ,
                        NEOX, BLOCK_Q, HW_FP8, NATIVE, PACKED_FP4, H, ROWS32)
    else:
        _indexer_k_rows(pid - n_q_prog, k_ptr, sk_t, kv_ptr, kvs_ptr, slot_ptr, s_slot, pos_ptr, s_pos, nw_ptr, s_nw,
                        nb_ptr, s_nb, cos_ptr, sin_ptr, s_cos, s_sin, max_pos, eps, T, capacity, P, err_ptr,
                        ue8m0, presh, X_KIND, CS_KIND, NW_KIND, NB_KIND, FP4, POLICY, BIAS, FMAX, INV_FMAX, FNUZ,
                        NEOX, BLOCK_K, HW_FP8, NATIVE, PACKED_FP4)


# ---------------------------------------------------------------------------------------------------
# §7.2 index_k_norm_rope_pack_store
# ---------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["ratio"])
def _k_store_v41_kernel(k_ptr, sk_t, nw_ptr, s_nw, eps, pos_ptr, s_pos, f_ptr, s_f, max_pos, slot_ptr, s_slot,
                        cache_ptr, T, capacity, P, err_ptr, ratio,
                        X_KIND: tl.constexpr, NW_KIND: tl.constexpr, POLICY: tl.constexpr,
                        BLOCK: tl.constexpr, NATIVE: tl.constexpr, PACKED_FP4: tl.constexpr):
    R: tl.constexpr = BLOCK
    t = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    in_range = t < T
    slot = tl.load(slot_ptr + t * s_slot, mask=in_range, other=-1).to(tl.int64)
    act = in_range & (slot >= 1) & (slot < capacity)
    p, bad_pos = _rope_positions(pos_ptr, s_pos, t, in_range, max_pos, ratio)
    _flag_errors(err_ptr, in_range & (slot >= capacity), bad_pos)
    x0, x1, x2, x3 = _load_tiles(k_ptr, t * sk_t, act, X_KIND, NATIVE)
    # RMSNorm (SPEC §5): y = fl(w * fl(x * inv)), rounded to k's dtype
    inv = rms_inv(x0, x1, x2, x3, eps, R)[:, None]
    w0, w1, w2, w3 = _load_vec_tiles(nw_ptr, s_nw, NW_KIND, NATIVE)
    y0 = round_to(w0 * (x0 * inv), X_KIND, NATIVE)
    y1 = round_to(w1 * (x1 * inv), X_KIND, NATIVE)
    y2 = round_to(w2 * (x2 * inv), X_KIND, NATIVE)
    y3 = round_to(w3 * (x3 * inv), X_KIND, NATIVE)
    y2, y3 = _rope_tail_freqs(y2, y3, f_ptr, s_f, p, act, R)
    y2 = round_to(y2, X_KIND, NATIVE)
    y3 = round_to(y3, X_KIND, NATIVE)
    q0, e0 = _sglang_two_stage(y0, POLICY, R, NATIVE, PACKED_FP4)
    q1, e1 = _sglang_two_stage(y1, POLICY, R, NATIVE, PACKED_FP4)
    q2, e2 = _sglang_two_stage(y2, POLICY, R, NATIVE, PACKED_FP4)
    q3, e3 = _sglang_two_stage(y3, POLICY, R, NATIVE, PACKED_FP4)
    # packed68 (SPEC §6)
    n = slot // P
    o = slot % P
    base = L.packed68_payload_at(n, o, P)
    _store_bytes16(cache_ptr, base, q0, act)
    _store_bytes16(cache_ptr, base + 16, q1, act)
    _store_bytes16(cache_ptr, base + 32, q2, act)
    _store_bytes16(cache_ptr, base + 48, q3, act)
    sb = L.packed68_exponent_at(n, o, P)
    tl.store(cache_ptr + sb, e0.to(tl.uint8), mask=act)
    tl.store(cache_ptr + (sb + 1), e1.to(tl.uint8), mask=act)
    tl.store(cache_ptr + (sb + 2), e2.to(tl.uint8), mask=act)
    tl.store(cache_ptr + (sb + 3), e3.to(tl.uint8), mask=act)


# ---------------------------------------------------------------------------------------------------
# §7.2 index_q_rope_pack_weights
# ---------------------------------------------------------------------------------------------------
@triton.jit
def row_split(pid, T, R: tl.constexpr, H: tl.constexpr, I32: tl.constexpr):
    """Rows [pid*R, pid*R + R) of the T*H (token, head) rows: (r, t, h [R], r in range [R]), t and h those of row
    min(r, T*H - 1), so that loads by (t, h) need no mask. H is a constexpr: the split is a multiply and a shift.
    I32 (the launch's offsets all below 2^31): int32 indices, otherwise int64."""
    if I32:
        r = pid * R + tl.arange(0, R)
        c = tl.minimum(r, T * H - 1)
    else:
        r = pid.to(tl.int64) * R + tl.arange(0, R)
        c = tl.minimum(r, T.to(tl.int64) * H - 1)
    t = c // H
    return r, t, c - t * H, r < T * H


@triton.jit
def load_pairs(ptr, off, KIND: tl.constexpr, PAIRS: tl.constexpr, NATIVE: tl.constexpr):
    """Blocks of 32 elements starting at `off` (offsets [A, B] in units of ptr's elements, all valid): (even, odd)
    fp32 [A, B, 16], elements 2i and 2i+1. Each lane loads its block whole, 16 bytes a load. PAIRS: a bf16
    tensor passed as int32 words (two elements each, the even one in the low half): one shift or mask per
    element."""
    A: tl.constexpr = off.shape[0]
    B: tl.constexpr = off.shape[1]
    if PAIRS:
        w = tl.arange(0, 4)[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :]
        v = tl.reshape(tl.load(ptr + (off[:, :, None, None] + w)), (A, B, 16))
        return F.from_bits(v << 16), F.from_bits(v & -65536)
    else:
        CH: tl.constexpr = 4 if KIND == KIND_F32 else 8
        e = tl.arange(0, 32 // CH)[None, None, :, None] * CH + tl.arange(0, CH)[None, None, None, :]
        v = load_f32(ptr, off[:, :, None, None] + e, e >= 0, KIND, NATIVE)
        return tl.split(tl.reshape(v, (A, B, 16, 2)))


@triton.jit
def load_f32_pairs(ptr, off):
    """fp32 pairs (2i, 2i+1), i < 16, at offsets off [A, B] (elements, all valid): two [A, B, 16] tensors, 16
    bytes a load."""
    A: tl.constexpr = off.shape[0]
    B: tl.constexpr = off.shape[1]
    e = tl.arange(0, 8)[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :]
    return tl.split(tl.reshape(tl.load(ptr + (off[:, :, None, None] + e)), (A, B, 16, 2)))


@triton.jit
def _q_pack_v41_kernel(q_ptr, sq_t, sq_h, pos_ptr, s_pos, f_ptr, s_f, max_pos, w_ptr, sw_t, sw_h, wscale,
                       pay_ptr, exp_ptr, wo_ptr, T, err_ptr,
                       X_KIND: tl.constexpr, W_KIND: tl.constexpr, POLICY: tl.constexpr, BLOCK: tl.constexpr,
                       NATIVE: tl.constexpr, PAIRS: tl.constexpr, H: tl.constexpr, I32: tl.constexpr):
    """SPEC §7.2 index_q_rope_pack_weights for rows [pid*BLOCK, pid*BLOCK + BLOCK) of the T*H rows. Lane (u, row)
    holds blocks u (head) and u + 2 (tail) of a row, as even/odd element pairs: the RoPE pairs, the payload
    bytes' nibble pairs, and every block reduction without crossing lanes. The two stages in closed form
    (formats.two_stage_fast); a program holding any block outside its range (NaN/Inf, tiny or huge scales)
    takes the general path for all of its rows."""
    R: tl.constexpr = BLOCK
    UNIT: tl.constexpr = 16 if PAIRS else 32          # a block of 32 elements in units of q_ptr's elements
    r, t, h, act = row_split(tl.program_id(0), T, R, H, I32)
    p, bad_pos = _rope_positions(pos_ptr, s_pos, t, act, max_pos, 1)
    code = tl.max(bad_pos.to(tl.int32), axis=0) * POS_ERR
    tl.atomic_or(err_ptr, code, mask=code != 0)
    # weights_out = float(bf16(fl(float(w) * weight_scale))), canonical NaN (software rounding)
    w = load_f32(w_ptr, t * sw_t + h * sw_h, act | True, W_KIND, NATIVE)
    tl.store(wo_ptr + r, round_bf16(w * wscale, False), mask=act)
    u = tl.arange(0, 2)[:, None]                                   # [2, 1]: block u and u + 2
    m2 = act[None, :] & (u >= 0)                                   # [2, R]
    base = (t * sq_t + h * sq_h)[None, :] + u * UNIT
    he, ho = load_pairs(q_ptr, base, X_KIND, PAIRS, NATIVE)
    te, to = load_pairs(q_ptr, base + 2 * UNIT, X_KIND, PAIRS, NATIVE)
    # tail interleaved RoPE: pair i of block u + 2 is rope pair 16u + i, freqs (cos, sin) at 2(16u + i)
    c, s = load_f32_pairs(f_ptr, (p * s_f)[None, :] + u * 32)
    te, to = rope_pair(te, to, c, s)
    te = round_to(te, X_KIND, NATIVE)
    to = round_to(to, X_KIND, NATIVE)
    sh, ph, eh, okh = F.two_stage_scales(he, ho)
    st, pt, et, okt = F.two_stage_scales(te, to)
    if tl.min((okh & okt | ~m2).to(tl.int32)) == 0:
        # the general two stages (NaN/Inf, a scale at the edges of the range or a tiny block in the program),
        # a block of every row at a time, reloaded
        for k in range(4):
            xe, xo = load_pairs(q_ptr, (t * sq_t + h * sq_h)[None, :] + k * UNIT, X_KIND, PAIRS, NATIVE)
            if k >= 2:
                ck, sk = load_f32_pairs(f_ptr, (p * s_f)[None, :] + (k - 2) * 32)
                xe, xo = rope_pair(xe, xo, ck, sk)
                xe = round_to(xe, X_KIND, NATIVE)
                xo = round_to(xo, X_KIND, NATIVE)
            q, e = _sglang_two_stage(tl.reshape(tl.join(xe, xo), (R, 32)), POLICY, R, NATIVE, False)
            _store_bytes16(pay_ptr, r * 64 + k * 16, q, act)
            tl.store(exp_ptr + (r * 4 + k), e.to(tl.uint8), mask=act)
    else:
        qh = F.two_stage_codes(he, ho, sh, ph, POLICY)
        qt = F.two_stage_codes(te, to, st, pt, POLICY)
        pb = (r * 64)[None, :, None] + u[:, :, None] * 16 + tl.arange(0, 16)[None, None, :]
        tl.store(pay_ptr + pb, qh, mask=m2[:, :, None])
        tl.store(pay_ptr + (pb + 32), qt, mask=m2[:, :, None])
        eb = (r * 4)[None, :] + u                                  # exponent of block j in byte j
        tl.store(exp_ptr + eb, eh.to(tl.uint8), mask=m2)
        tl.store(exp_ptr + (eb + 2), et.to(tl.uint8), mask=m2)


# ---------------------------------------------------------------------------------------------------
# §7.2 rope_fake_quant_fp4
# ---------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["ratio"])
def _fake_quant_kernel(x_ptr, sx_t, sx_h, pos_ptr, s_pos, f_ptr, s_f, max_pos, out_ptr, T, H, err_ptr, ratio,
                       X_KIND: tl.constexpr, E4M3: tl.constexpr, BLOCK: tl.constexpr, NATIVE: tl.constexpr):
    R: tl.constexpr = BLOCK
    r = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    act = r < T * H
    t = r // H
    h = r % H
    p, bad_pos = _rope_positions(pos_ptr, s_pos, t, act, max_pos, ratio)
    _flag_errors(err_ptr, bad_pos & False, bad_pos)
    x0, x1, x2, x3 = _load_tiles(x_ptr, t * sx_t + h * sx_h, act, X_KIND, NATIVE)
    x2, x3 = _rope_tail_freqs(x2, x3, f_ptr, s_f, p, act, R)
    x2 = round_to(x2, X_KIND, NATIVE)
    x3 = round_to(x3, X_KIND, NATIVE)
    # a NaN stays a NaN through stage 1 and is stored as the canonical NaN of the output dtype
    if E4M3:
        y0 = fake_quant_e4m3_tile(x0, R, NATIVE)
        y1 = fake_quant_e4m3_tile(x1, R, NATIVE)
        y2 = fake_quant_e4m3_tile(x2, R, NATIVE)
        y3 = fake_quant_e4m3_tile(x3, R, NATIVE)
    else:
        y0 = fake_quant_ue8m0_tile(x0, NATIVE)
        y1 = fake_quant_ue8m0_tile(x1, NATIVE)
        y2 = fake_quant_ue8m0_tile(x2, NATIVE)
        y3 = fake_quant_ue8m0_tile(x3, NATIVE)
    d = tl.arange(0, 32)[None, :]
    ob = (r * 128)[:, None]
    m = act[:, None]
    tl.store(out_ptr + (ob + d), cast_for_store(y0, X_KIND), mask=m)
    tl.store(out_ptr + (ob + (d + 32)), cast_for_store(y1, X_KIND), mask=m)
    tl.store(out_ptr + (ob + (d + 64)), cast_for_store(y2, X_KIND), mask=m)
    tl.store(out_ptr + (ob + (d + 96)), cast_for_store(y3, X_KIND), mask=m)


# ---------------------------------------------------------------------------------------------------
# §7.3 rmsnorm_rope_rotate_fp4quant_kvcache
# ---------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["hadamard", "dense"])
def _v4_k_kernel(kv_ptr, skv_t, nw_ptr, s_nw, eps, pos_ptr, s_pos, cos_ptr, sin_ptr, s_cos, s_sin, max_pos,
                 slot_ptr, s_slot, cache_ptr, scale_ptr, T, capacity, P, err_ptr, hadamard, dense,
                 X_KIND: tl.constexpr, NW_KIND: tl.constexpr, CS_KIND: tl.constexpr,
                 POLICY: tl.constexpr, BLOCK: tl.constexpr, NATIVE: tl.constexpr):
    R: tl.constexpr = BLOCK
    t = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    in_range = t < T
    slot = tl.load(slot_ptr + t * s_slot, mask=in_range, other=-1).to(tl.int64)
    act = in_range & (slot >= 0) & (slot < capacity)
    p, bad_pos = _rope_positions(pos_ptr, s_pos, t, in_range, max_pos, 1)
    _flag_errors(err_ptr, in_range & (slot >= capacity), bad_pos)
    x0, x1, x2, x3 = _load_tiles(kv_ptr, t * skv_t, act, X_KIND, NATIVE)
    inv = rms_inv(x0, x1, x2, x3, eps, R)[:, None]
    w0, w1, w2, w3 = _load_vec_tiles(nw_ptr, s_nw, NW_KIND, NATIVE)
    y0 = w0 * (x0 * inv)
    y1 = w1 * (x1 * inv)
    y2 = w2 * (x2 * inv)
    y3 = w3 * (x3 * inv)
    y2, y3 = _rope_tail_tables(y2, y3, cos_ptr, sin_ptr, s_cos, s_sin, p, act, CS_KIND, R, NATIVE)
    if hadamard != 0:
        y0, y1, y2, y3 = hadamard4(y0, y1, y2, y3, R)
    q0, e0 = fp4_quant_tile(y0, RULE_RECIP, POLICY, R, NATIVE)
    q1, e1 = fp4_quant_tile(y1, RULE_RECIP, POLICY, R, NATIVE)
    q2, e2 = fp4_quant_tile(y2, RULE_RECIP, POLICY, R, NATIVE)
    q3, e3 = fp4_quant_tile(y3, RULE_RECIP, POLICY, R, NATIVE)
    # the dense layout (payload tile k at slot*64 + 16k, exponent g at slot*4 + g), otherwise aiter_fp4 (P = 1
    # when dense, so the shared offsets below stay in range either way)
    n = slot // P
    o = slot % P
    dn = dense != 0
    sf = L.aiter_sflat(o, P)
    dp = L.dense_fp4_payload_at(slot)
    de = L.dense_fp4_exponent_at(slot)
    _store_bytes16(cache_ptr, tl.where(dn, dp, L.aiter_fp4_payload_at(n, o, 0, P)), q0, act)
    _store_bytes16(cache_ptr, tl.where(dn, dp + 16, L.aiter_fp4_payload_at(n, o, 1, P)), q1, act)
    _store_bytes16(cache_ptr, tl.where(dn, dp + 32, L.aiter_fp4_payload_at(n, o, 2, P)), q2, act)
    _store_bytes16(cache_ptr, tl.where(dn, dp + 48, L.aiter_fp4_payload_at(n, o, 3, P)), q3, act)
    tl.store(scale_ptr + tl.where(dn, de, L.aiter_fp4_exponent_at(n, sf, 0, P)), e0.to(tl.uint8), mask=act)
    tl.store(scale_ptr + tl.where(dn, de + 1, L.aiter_fp4_exponent_at(n, sf, 1, P)), e1.to(tl.uint8), mask=act)
    tl.store(scale_ptr + tl.where(dn, de + 2, L.aiter_fp4_exponent_at(n, sf, 2, P)), e2.to(tl.uint8), mask=act)
    tl.store(scale_ptr + tl.where(dn, de + 3, L.aiter_fp4_exponent_at(n, sf, 3, P)), e3.to(tl.uint8), mask=act)


# ---------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------
# Code paths (module switches, read at each launch; environment: DSAQUANT_TRITON_NATIVE=0 / DSAQUANT_TRITON_HW_FP8=0
# / DSAQUANT_TRITON_PACKED_FP4=0):
# - NATIVE (every GPU): bf16 loaded and rounded with the hardware conversions, amax with the GPU's NaN-ignoring
#   max. Off under the interpreter (CPU), whose bf16 conversions truncate: integer bit arithmetic there.
# - HW_FP8 (NVIDIA sm_89+, e4m3fn only): FP8 codes from cvt.rn.satfinite.e4m3x2.f32 instead of the software
#   encoder (same map: round half even, saturating ±Inf/overflow, NaN 0x7F, signed zero).
# - PACKED_FP4 (NVIDIA sm_80+, with NATIVE): the E2M1 codes of bf16 values two at a time with fma/min/max.bf16x2
#   PTX (formats.e2m1_code_bf16x2, the algorithm of e2m1x8.h) instead of the fp32 encoder (formats.e2m1_index_core
#   and its sign code). Used where the values quantized are bf16 values: the FP4 indexer with bf16 q/k, and the
#   §7.2 key writer and query packer (their stage 2 input is bf16 for every input dtype).
# tests/gpu/test_triton_gpu.py checks both settings of NATIVE and HW_FP8 against the reference on the GPU (its
# "triton" mode has PACKED_FP4 on where the GPU allows it; run it with DSAQUANT_TRITON_PACKED_FP4=0 for the other).
NATIVE_ENABLED = os.environ.get("DSAQUANT_TRITON_NATIVE", "1") != "0"
HW_FP8_ENABLED = os.environ.get("DSAQUANT_TRITON_HW_FP8", "1") != "0"
PACKED_FP4_ENABLED = os.environ.get("DSAQUANT_TRITON_PACKED_FP4", "1") != "0"


def launch_modes(device: torch.device, fp8_flavour=None, modes=None):
    """{'NATIVE': bool, 'HW_FP8': bool, 'PACKED_FP4': bool} for launches on `device` (`modes` overrides, e.g.
    for AOT compiles; PACKED_FP4 needs NATIVE). PACKED_FP4 says the target may run the bf16x2 FP4 encoder;
    each prepare_* decides whether its values are bf16 values."""
    native = device.type != "cpu" and NATIVE_ENABLED
    nvidia = device.type == "cuda" and not getattr(torch.version, "hip", None)
    hw = packed = False
    if native and HW_FP8_ENABLED and fp8_flavour == "e4m3fn" and nvidia:
        hw = torch.cuda.get_device_capability(device) >= (8, 9)
    if native and PACKED_FP4_ENABLED and nvidia:
        packed = torch.cuda.get_device_capability(device) >= (8, 0)
    out = dict(NATIVE=native, HW_FP8=hw, PACKED_FP4=packed)
    if modes:
        out.update(modes)
        out["HW_FP8"] = bool(out["HW_FP8"]) and fp8_flavour == "e4m3fn"
        out["PACKED_FP4"] = bool(out["PACKED_FP4"]) and bool(out["NATIVE"])
    return out


def tensor_kind(t: torch.Tensor, native: bool, output: bool = False):
    """(tensor to pass, dtype kind). bf16 inputs go as int16 views unless `native`; bf16 outputs always do
    (their bits are computed in the kernel)."""
    if t.dtype == torch.bfloat16:
        return (t if native and not output else t.view(torch.int16)), KIND_BF16.value
    if t.dtype == torch.float16:
        return t, KIND_F16.value
    if t.dtype == torch.float32:
        return t, KIND_F32.value
    raise TypeError(f"unsupported float dtype {t.dtype}")


def as_u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def as_f32(v: float) -> float:
    """Round a Python float to fp32 once (reference to_f32_scalar: nearest even, Inf on overflow)."""
    with np.errstate(over="ignore"):
        return float(np.float32(v))


def _run(prep, *args):
    kernel, grid, kargs, consts, warps = prep(*args)
    kernel[grid](*kargs, **consts, num_warps=warps, enable_fp_fusion=False)


def prepare_indexer(q, q_out, weights, weights_out, k, kv_cache, slot_mapping, norm_weight, norm_bias, positions,
                    cos_cache, sin_cache, epsilon, quant_block_size, scale_fmt, weights_scale, preshuffle, is_neox,
                    compute_all_q_rope, q_scale_out, kv_cache_scale, rounding, fp8_flavour, page_size, modes=None):
    """(kernel, grid, positional args, constexprs, num_warps) of the one indexer launch (used by the op and by
    the ahead-of-time compile test)."""
    T, H, _ = q.shape
    fp4 = q_scale_out is not None
    flavour = "e4m3fn" if fp4 else fp8_flavour
    md = launch_modes(q.device, None if fp4 else flavour, modes)
    nat = md["NATIVE"]
    bq, wq = LAUNCH["indexer_q"]
    bk, _ = LAUNCH["indexer_k"]
    n_q = triton.cdiv(T * H, bq)
    n_k = triton.cdiv(T, bk)
    qv, x_kind = tensor_kind(q, nat)
    kvv, _ = tensor_kind(k, nat)
    wv, w_kind = tensor_kind(weights, nat)
    wov, wo_kind = tensor_kind(weights_out, nat, output=True)
    cv, cs_kind = tensor_kind(cos_cache, nat)
    sv, _ = tensor_kind(sin_cache, nat)
    nwv, nw_kind = tensor_kind(norm_weight, nat)
    nbv, nb_kind = tensor_kind(norm_bias, nat)
    bias, fmax, inv_fmax = F.fp8_consts(flavour)
    qs = as_u8(q_scale_out) if fp4 else as_u8(q_out)
    kvs = as_u8(kv_cache_scale) if fp4 else as_u8(kv_cache)
    qs_pad = q_scale_out.shape[-1] if fp4 else 4
    capacity = kv_cache.shape[0] * page_size
    args = [qv, q.stride(0), q.stride(1), kvv, k.stride(0), wv, weights.stride(0), weights.stride(1),
            wov, weights_out.stride(0), weights_out.stride(1), as_u8(q_out), qs, as_u8(kv_cache), kvs,
            slot_mapping, slot_mapping.stride(0), positions, positions.stride(0),
            nwv, norm_weight.stride(0), nbv, norm_bias.stride(0), cv, sv, cos_cache.stride(0), sin_cache.stride(0),
            cos_cache.shape[0], as_f32(epsilon), as_f32(weights_scale), T, n_q, capacity, page_size, qs_pad,
            errors.flag_tensor(q.device), int(scale_fmt == "ue8m0" or fp4), int(bool(preshuffle)),
            int(bool(compute_all_q_rope))]
    consts = dict(X_KIND=x_kind, W_KIND=w_kind, WO_KIND=wo_kind, CS_KIND=cs_kind, NW_KIND=nw_kind, NB_KIND=nb_kind,
                  FP4=fp4, POLICY=code_of(Rounding, rounding), BIAS=bias, FMAX=fmax, INV_FMAX=inv_fmax,
                  FNUZ=(flavour == "e4m3fnuz"), NEOX=bool(is_neox), BLOCK_Q=bq, BLOCK_K=bk,
                  H=H, ROWS32=(n_q + n_k) * bq < 2 ** 31,
                  **dict(md, PACKED_FP4=bool(md["PACKED_FP4"]) and fp4 and q.dtype == k.dtype == torch.bfloat16))
    return _indexer_kernel, (n_q + n_k,), args, consts, wq


def indexer_qk_rope_quant_and_cache(q, q_out, weights, weights_out, k, kv_cache, slot_mapping, norm_weight,
                                    norm_bias, positions, cos_cache, sin_cache, epsilon, quant_block_size,
                                    scale_fmt, weights_scale, preshuffle, is_neox, compute_all_q_rope,
                                    q_scale_out, kv_cache_scale, rounding, fp8_flavour, page_size):
    """SPEC §7.1 (same arguments as reference.ops.indexer_qk_rope_quant_and_cache)."""
    if q.shape[0] == 0:
        return
    _run(prepare_indexer, q, q_out, weights, weights_out, k, kv_cache, slot_mapping, norm_weight, norm_bias,
         positions, cos_cache, sin_cache, epsilon, quant_block_size, scale_fmt, weights_scale, preshuffle, is_neox,
         compute_all_q_rope, q_scale_out, kv_cache_scale, rounding, fp8_flavour, page_size)


def prepare_k_store(k, norm_weight, eps, positions, freqs, slots, cache, compress_ratio, rounding, page_size,
                    modes=None):
    T = k.shape[0]
    md = launch_modes(k.device, None, modes)
    nat = md["NATIVE"]
    block, warps = LAUNCH["k_store"]
    kv, x_kind = tensor_kind(k, nat)
    nwv, nw_kind = tensor_kind(norm_weight, nat)
    args = [kv, k.stride(0), nwv, norm_weight.stride(0), as_f32(eps), positions, positions.stride(0), freqs,
            freqs.stride(0), freqs.shape[0], slots, slots.stride(0), as_u8(cache), T, cache.shape[0] * page_size,
            page_size, errors.flag_tensor(k.device), int(compress_ratio)]
    consts = dict(X_KIND=x_kind, NW_KIND=nw_kind, POLICY=code_of(Rounding, rounding), BLOCK=block, NATIVE=nat,
                  PACKED_FP4=md["PACKED_FP4"])
    return _k_store_v41_kernel, (triton.cdiv(T, block),), args, consts, warps


def index_k_norm_rope_pack_store(k, norm_weight, eps, positions, freqs, slots, cache, compress_ratio, rounding,
                                 page_size):
    """SPEC §7.2 key writer (same arguments as the reference)."""
    if k.shape[0] == 0:
        return
    _run(prepare_k_store, k, norm_weight, eps, positions, freqs, slots, cache, compress_ratio, rounding, page_size)


def offsets_fit_i32(*bounds) -> bool:
    """Whether every offset a kernel forms (each below one of `bounds`, in elements or bytes) fits in int32."""
    return max(bounds) < 2 ** 31


def pair_view(t: torch.Tensor):
    """A bf16 tensor whose last dim is contiguous as int32 words (two elements each), or None where its strides or
    offset are odd."""
    if t.dtype != torch.bfloat16 or t.stride(-1) != 1 or t.storage_offset() % 2 or \
            any(st % 2 for st in t.stride()[:-1]) or t.shape[-1] % 2:
        return None
    return t.view(torch.int32)


def prepare_q_pack(q, positions, freqs, head_weights, weight_scale, rounding, payload_out, exps_out, weights_out,
                   modes=None):
    T, H, _ = q.shape
    md = launch_modes(q.device, None, modes)
    nat = md["NATIVE"]
    block, warps = LAUNCH["q_pack"]
    q32 = pair_view(q)
    qv, x_kind = tensor_kind(q, nat) if q32 is None else (q32, KIND_BF16.value)
    wv, w_kind = tensor_kind(head_weights, nat)
    n = triton.cdiv(T * H, block)
    args = [qv, qv.stride(0), qv.stride(1), positions, positions.stride(0), freqs, freqs.stride(0), freqs.shape[0],
            wv, head_weights.stride(0), head_weights.stride(1), as_f32(weight_scale), payload_out, as_u8(exps_out),
            weights_out, T, errors.flag_tensor(q.device)]
    consts = dict(X_KIND=x_kind, W_KIND=w_kind, POLICY=code_of(Rounding, rounding), BLOCK=block, NATIVE=nat,
                  PAIRS=q32 is not None, H=H,
                  I32=offsets_fit_i32(n * block * 64, (T - 1) * qv.stride(0) + (H - 1) * qv.stride(1) + 128,
                                      (T - 1) * positions.stride(0), freqs.numel(),
                                      (T - 1) * head_weights.stride(0) + (H - 1) * head_weights.stride(1)))
    return _q_pack_v41_kernel, (n,), args, consts, warps


def index_q_rope_pack_weights(q, positions, freqs, head_weights, weight_scale, rounding, payload_out, exps_out,
                              weights_out):
    """SPEC §7.2 query packer (same arguments as the reference)."""
    if q.shape[0] * q.shape[1] == 0:
        return
    _run(prepare_q_pack, q, positions, freqs, head_weights, weight_scale, rounding, payload_out, exps_out,
         weights_out)


def prepare_fake_quant(x, positions, freqs, block, scale, compress_ratio, out, modes=None):
    T = x.shape[0]
    H = x.shape[1] if x.dim() == 3 else 1
    md = launch_modes(x.device, None, modes)
    nat = md["NATIVE"]
    blk, warps = LAUNCH["fake_quant"]
    xv, x_kind = tensor_kind(x, nat)
    ov, _ = tensor_kind(out, nat, output=True)
    args = [xv, x.stride(0), x.stride(1) if x.dim() == 3 else 0, positions, positions.stride(0), freqs,
            freqs.stride(0), freqs.shape[0], ov, T, H, errors.flag_tensor(x.device), int(compress_ratio)]
    consts = dict(X_KIND=x_kind, E4M3=(scale == "e4m3"), BLOCK=blk, NATIVE=nat)
    return _fake_quant_kernel, (triton.cdiv(T * H, blk),), args, consts, warps


def rope_fake_quant_fp4(x, positions, freqs, block, scale, compress_ratio, out):
    """SPEC §7.2 stage 1 with tail RoPE (same arguments as the reference)."""
    if (block, scale) not in ((32, "ue8m0"), (16, "e4m3")):
        raise ValueError(f"block, scale: expected (32, 'ue8m0') or (16, 'e4m3'), got ({block!r}, {scale!r})")
    if x.numel() == 0:
        return
    _run(prepare_fake_quant, x, positions, freqs, block, scale, compress_ratio, out)


def prepare_v4_k(kv, norm_weight, epsilon, positions, cos_cache, sin_cache, slot_mapping, kv_cache,
                 kv_cache_scale, hadamard_on, rounding, layout, page_size, modes=None):
    T = kv.shape[0]
    md = launch_modes(kv.device, None, modes)
    nat = md["NATIVE"]
    block, warps = LAUNCH["v4_k"]
    xv, x_kind = tensor_kind(kv, nat)
    nwv, nw_kind = tensor_kind(norm_weight, nat)
    cv, cs_kind = tensor_kind(cos_cache, nat)
    sv, _ = tensor_kind(sin_cache, nat)
    dense = layout != "aiter_fp4"
    capacity = kv_cache.shape[0] if dense else kv_cache.shape[0] * page_size
    args = [xv, kv.stride(0), nwv, norm_weight.stride(0), as_f32(epsilon), positions, positions.stride(0), cv, sv,
            cos_cache.stride(0), sin_cache.stride(0), cos_cache.shape[0], slot_mapping, slot_mapping.stride(0),
            as_u8(kv_cache), as_u8(kv_cache_scale), T, capacity, page_size, errors.flag_tensor(kv.device),
            int(bool(hadamard_on)), int(dense)]
    consts = dict(X_KIND=x_kind, NW_KIND=nw_kind, CS_KIND=cs_kind, POLICY=code_of(Rounding, rounding),
                  BLOCK=block, NATIVE=nat)
    return _v4_k_kernel, (triton.cdiv(T, block),), args, consts, warps


def rmsnorm_rope_rotate_fp4quant_kvcache(kv, norm_weight, epsilon, positions, cos_cache, sin_cache, slot_mapping,
                                         kv_cache, kv_cache_scale, hadamard_on, rounding, layout, page_size):
    """SPEC §7.3 (same arguments as the reference). kv [T, 128] or [T, Hk, 128]: head 0 is used."""
    if kv.shape[0] == 0:
        return
    _run(prepare_v4_k, kv, norm_weight, epsilon, positions, cos_cache, sin_cache, slot_mapping, kv_cache,
         kv_cache_scale, hadamard_on, rounding, layout, page_size)


OPS = {
    "indexer_qk_rope_quant_and_cache": indexer_qk_rope_quant_and_cache,
    "index_k_norm_rope_pack_store": index_k_norm_rope_pack_store,
    "index_q_rope_pack_weights": index_q_rope_pack_weights,
    "rope_fake_quant_fp4": rope_fake_quant_fp4,
    "rmsnorm_rope_rotate_fp4quant_kvcache": rmsnorm_rope_rotate_fp4quant_kvcache,
}

# (op name -> prepare function), for the ahead-of-time compile test
PREPARE = {
    "indexer_qk_rope_quant_and_cache": prepare_indexer,
    "index_k_norm_rope_pack_store": prepare_k_store,
    "index_q_rope_pack_weights": prepare_q_pack,
    "rope_fake_quant_fp4": prepare_fake_quant,
    "rmsnorm_rope_rotate_fp4quant_kvcache": prepare_v4_k,
}

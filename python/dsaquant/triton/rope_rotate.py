"""The `triton` backend's query-side RoPE + rotate + quant, SPEC §7.7 `rope_rotate_quant` (compat: aiter
`rope_rotate_activation`): kernel and host wrapper.

`rope_rotate_quant` below has exactly the signature of reference.compress.rope_rotate_quant (dsaquant.compress
validates the arguments and calls it positionally) and writes the same bytes. One launch per call, no host
sync. Each program takes ROWS (token, head) rows of x [T, H, D] as one [ROWS, D] fp32 tile: tail RoPE with
interleaved pairs on the last 64 dims (fp32, not rounded), the optional Hadamard over D (times fl(D^-0.5)),
then, by out's dtype:
- FP4 (uint8 / float4_e2m1fn_x2 [T, H, D/2]): groups of G, rule recip, codes by the policy; exponents into
  the aiter q-scale layout [T, D/128, 4, 16, qs_pad] (shuffled, G = 32, pad entries written 0) or dense
  [T, H, D/G];
- FP8 (e4m3fn / e4m3fnuz [T, H, D]): groups of G, s = fl(max(amax, 1e-10f) / fmax) fp32 into
  out_scale [T, H, D/G], codes encode(x * fl(1/s));
- bf16/fp16 (x's dtype): the rotated values rounded to it (out may alias x; any strides).
Positions outside [0, max_pos) are clamped and reported (POSITION_OUT_OF_RANGE, one atomic per program).
Kernels are launched with enable_fp_fusion=False (SPEC §0.1); the format math is formats.py's.

Block size: `LAUNCH["rope_rotate"]` = (elements per program, warps) or DSAQUANT_TRITON_V4_LAUNCH=
"rope_rotate=4096x4" (powers of two); rows per program = elements / D. Speed only, never bytes.
"""
from __future__ import annotations


import numpy as np
import torch
import triton
import triton.language as tl

from .. import codes, errors
from ..codes import Rounding, code_of
from ..reference.compress import FP4_OUT_DTYPES, FP8_OUT_DTYPES
from . import formats as F
from . import layouts as L
from .formats import (amax_tile, cast_for_store, fp4_encode_tile, fp4_quant_tile, fp8_group_quant, hadamard_level_row,
                      hadamard_row, load_f32, pack_nibbles_row, rope_pair, rope_tail_row, ue8m0_recip)
from .quant import as_u8, launch_from_env, launch_modes, load_pairs, offsets_fit_i32, pair_view, row_split, tensor_kind

POS_ERR: tl.constexpr = tl.constexpr(errors.POSITION_OUT_OF_RANGE)
OUT_FP4: tl.constexpr = tl.constexpr(int(codes.OutKind.fp4))
OUT_FP8: tl.constexpr = tl.constexpr(int(codes.OutKind.fp8))
OUT_HALF: tl.constexpr = tl.constexpr(int(codes.OutKind.half))

LAUNCH = {"rope_rotate": (4096, 4), "rope_rotate_fp4": (32, 1)}


launch_from_env(LAUNCH, "DSAQUANT_TRITON_V4_LAUNCH", "elements x warps", strict=False)   # the other V4 module shares it


@triton.jit(do_not_specialize=["max_pos", "T", "H", "qs_pad"])
def _rope_rotate_kernel(x_ptr, sx_t, sx_h, pos_ptr, s_pos, cos_ptr, sin_ptr, s_cos, s_sin, max_pos,
                        out_ptr, so_t, so_h, so_d, scale_ptr, T, H, qs_pad, err_ptr,
                        X_KIND: tl.constexpr, CS_KIND: tl.constexpr, D: tl.constexpr, OUT: tl.constexpr,
                        G: tl.constexpr, SHUFFLE: tl.constexpr, HADAMARD: tl.constexpr, HSCALE: tl.constexpr,
                        POLICY: tl.constexpr, BIAS: tl.constexpr, FMAX: tl.constexpr, FNUZ: tl.constexpr,
                        HW_FP8: tl.constexpr, ROWS: tl.constexpr, NATIVE: tl.constexpr):
    """SPEC §7.7 for rows [pid*ROWS, pid*ROWS + ROWS) of the T*H (token, head) rows."""
    NG: tl.constexpr = D // G
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    act = r < T * H
    t = r // H
    h = r % H
    raw = tl.load(pos_ptr + t * s_pos, mask=act, other=0).to(tl.int64)
    bad_pos = act & ((raw < 0) | (raw >= max_pos))
    pos = tl.minimum(tl.maximum(raw, 0), max_pos - 1)
    am = act[:, None]
    d = tl.arange(0, D)[None, :]
    x = load_f32(x_ptr, (t * sx_t + h * sx_h)[:, None] + d, am, X_KIND, NATIVE)
    j = tl.arange(0, 32)[None, :]
    c = load_f32(cos_ptr, pos[:, None] * s_cos + j, am, CS_KIND, NATIVE)
    s = load_f32(sin_ptr, pos[:, None] * s_sin + j, am, CS_KIND, NATIVE)
    y = rope_tail_row(x, c, s, ROWS, D)
    if HADAMARD:
        y = hadamard_row(y, ROWS, D, HSCALE)
    gg = tl.arange(0, NG)[None, :]
    if OUT == OUT_FP4:
        xg = tl.reshape(y, (ROWS * NG, G))
        e = ue8m0_recip(amax_tile(xg, NATIVE))                              # [ROWS*NG]
        codes = tl.reshape(fp4_encode_tile(xg, e, POLICY), (ROWS, D))
        tl.store(out_ptr + ((r * (D // 2))[:, None] + tl.arange(0, D // 2)[None, :]), pack_nibbles_row(codes, ROWS, D),
                 mask=am)
        e2 = tl.reshape(e, (ROWS, NG)).to(tl.uint8)
        if SHUFFLE:
            # [T, D/128, 4, 16, qs_pad] (layouts.aiter_q_scale_at); pad columns H/16 .. qs_pad-1 written 0 by
            # heads 0..15
            tl.store(scale_ptr + L.aiter_q_scale_at(t[:, None], gg, h[:, None], NG, qs_pad), e2, mask=am)
            hb = H // 16
            jj = tl.arange(0, 4)[None, None, :]
            padm = (act & (h < 16))[:, None, None] & (jj < qs_pad - hb)
            poff = L.aiter_q_scale_at(t[:, None, None], gg[:, :, None], (h % 16)[:, None, None], NG, qs_pad) + hb + jj
            tl.store(scale_ptr + poff, tl.zeros((ROWS, NG, 4), tl.uint8), mask=padm)
        else:
            tl.store(scale_ptr + L.dense_q_scale_at(r[:, None], gg, NG), e2, mask=am)
    elif OUT == OUT_FP8:
        codes, sc = fp8_group_quant(tl.reshape(y, (ROWS * NG, G)), F.ONE_EM10, 0, BIAS, FMAX, FNUZ, HW_FP8, NATIVE)
        tl.store(out_ptr + ((r * D)[:, None] + d), tl.reshape(codes, (ROWS, D)).to(tl.uint8), mask=am)
        tl.store(scale_ptr + ((r * NG)[:, None] + gg), tl.reshape(sc, (ROWS, NG)), mask=am)
    else:
        tl.store(out_ptr + ((t * so_t + h * so_h)[:, None] + d * so_d), cast_for_store(y, X_KIND), mask=am)
    code = tl.max(bad_pos.to(tl.int32), axis=0) * POS_ERR
    tl.atomic_or(err_ptr, code, mask=code != 0)


@triton.jit
def _load_row_pairs(ptr, off, KIND: tl.constexpr, PAIRS: tl.constexpr, NATIVE: tl.constexpr):
    """Blocks u = 0, 1 of 32 elements at offsets off [R, 2] (units of ptr's elements, all valid) as (even, odd)
    fp32 [R, 2, 16]; the row index first, so that a lane holds all blocks of its row. PAIRS: a bf16 tensor passed
    as int32 words (two elements each, the even one in the low half)."""
    R: tl.constexpr = off.shape[0]
    if PAIRS:
        w = tl.arange(0, 4)[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :]
        v = tl.reshape(tl.load(ptr + (off[:, :, None, None] + w)), (R, 2, 16))
        return F.from_bits(v << 16), F.from_bits(v & -65536)
    else:
        CH: tl.constexpr = 4 if KIND == F.KIND_F32 else 8
        e = tl.arange(0, 32 // CH)[None, None, :, None] * CH + tl.arange(0, CH)[None, None, None, :]
        v = load_f32(ptr, off[:, :, None, None] + e, e >= 0, KIND, NATIVE)
        return tl.split(tl.reshape(v, (R, 2, 16, 2)))


@triton.jit
def _load_row_vec16(ptr, off, KIND: tl.constexpr, PAIRS: tl.constexpr, NATIVE: tl.constexpr):
    """16 consecutive elements at offsets off [R, 2] (units of ptr's elements, all valid) as fp32 [R, 2, 16];
    PAIRS: a bf16 tensor passed as int32 words (off in words)."""
    R: tl.constexpr = off.shape[0]
    if PAIRS:
        w = tl.reshape(tl.load(ptr + (off[:, :, None, None] + (tl.arange(0, 2)[None, None, :, None] * 4 +
                                                                tl.arange(0, 4)[None, None, None, :]))), (R, 2, 8))
        return tl.reshape(tl.join(F.from_bits(w << 16), F.from_bits(w & -65536)), (R, 2, 16))
    else:
        CH: tl.constexpr = 4 if KIND == F.KIND_F32 else 8
        e = tl.arange(0, 16 // CH)[None, None, :, None] * CH + tl.arange(0, CH)[None, None, None, :]
        return tl.reshape(load_f32(ptr, off[:, :, None, None] + e, e >= 0, KIND, NATIVE), (R, 2, 16))


@triton.jit
def _hadamard_block_pairs(e, o):
    """SPEC §5 Hadamard levels h = 1..16 (inside blocks of 32) of blocks given as even/odd elements e, o [R, 2, 16]:
    h = 1 pairs e[i] with o[i]; h = 2..16 pair elements h apart, i.e. e[i] with e[i + h/2] (o likewise)."""
    R: tl.constexpr = e.shape[0]
    e, o = e + o, e - o
    e = tl.reshape(e, (2 * R, 16))
    o = tl.reshape(o, (2 * R, 16))
    for k in tl.static_range(4):
        e = hadamard_level_row(e, 2 * R, 16, 1 << k)
        o = hadamard_level_row(o, 2 * R, 16, 1 << k)
    return tl.reshape(e, (R, 2, 16)), tl.reshape(o, (R, 2, 16))


@triton.jit
def _hadamard_blocks01(x):
    """SPEC §5 Hadamard level h = 32 on x [R, 2, 16] holding blocks u = 0, 1 (or 2, 3) of rows: (a, b) -> (a + b, a - b)
    between the two blocks."""
    a, b = tl.split(tl.permute(x, (0, 2, 1)))
    return tl.permute(tl.join(a + b, a - b), (0, 2, 1))


@triton.jit(do_not_specialize=["max_pos", "T"])
def _rope_rotate_fp4_kernel(x_ptr, sx_t, sx_h, pos_ptr, s_pos, cos_ptr, sin_ptr, s_cos, s_sin, max_pos,
                            out_ptr, scale_ptr, T, err_ptr,
                            X_KIND: tl.constexpr, CS_KIND: tl.constexpr, PAIRS: tl.constexpr,
                            CS_PAIRS: tl.constexpr, SHUFFLE: tl.constexpr, HADAMARD: tl.constexpr,
                            POLICY: tl.constexpr, ROWS: tl.constexpr, NATIVE: tl.constexpr, H: tl.constexpr,
                            QS_PAD: tl.constexpr, I32: tl.constexpr):
    """SPEC §7.7 with D = 128 and FP4 in groups of 32, for rows [pid*ROWS, pid*ROWS + ROWS) of the T*H rows.
    A lane holds a whole row, as head blocks 0, 1 and tail blocks 2, 3, each as even/odd element pairs: the RoPE
    pairs, every Hadamard level, the block amax and the payload's nibble pairs are in the lane. The codes come
    from formats.e2m1_index_float on the block's scaled grid; a program holding a block with a NaN or an
    exponent above 150 (or any program under threshold, whose ties go toward zero) takes the general encoder."""
    R: tl.constexpr = ROWS
    UNIT: tl.constexpr = 16 if PAIRS else 32           # a block of 32 elements in units of x_ptr's elements
    CSU: tl.constexpr = 8 if CS_PAIRS else 16
    r, t, h, act = row_split(tl.program_id(0), T, R, H, I32)
    raw = tl.load(pos_ptr + t * s_pos).to(tl.int64)
    bad_pos = act & ((raw < 0) | (raw >= max_pos))
    pos = tl.minimum(tl.maximum(raw, 0), max_pos - 1)
    code = tl.max(bad_pos.to(tl.int32), axis=0) * POS_ERR
    tl.atomic_or(err_ptr, code, mask=code != 0)
    u = tl.arange(0, 2)[None, :]                                   # [1, 2]: blocks u (head) and 2 + u (tail)
    m2 = act[:, None] & (u >= 0)                                   # [R, 2]
    base = (t * sx_t + h * sx_h)[:, None] + u * UNIT
    he, ho = _load_row_pairs(x_ptr, base, X_KIND, PAIRS, NATIVE)
    te, to = _load_row_pairs(x_ptr, base + 2 * UNIT, X_KIND, PAIRS, NATIVE)
    # tail interleaved RoPE, fp32: pair i of block 2 + u is rope pair 16u + i
    c = _load_row_vec16(cos_ptr, (pos * s_cos)[:, None] + u * CSU, CS_KIND, CS_PAIRS, NATIVE)
    s = _load_row_vec16(sin_ptr, (pos * s_sin)[:, None] + u * CSU, CS_KIND, CS_PAIRS, NATIVE)
    te, to = rope_pair(te, to, c, s)
    if HADAMARD:
        he, ho = _hadamard_block_pairs(he, ho)
        te, to = _hadamard_block_pairs(te, to)
        he = _hadamard_blocks01(he)                                # h = 32
        ho = _hadamard_blocks01(ho)
        te = _hadamard_blocks01(te)
        to = _hadamard_blocks01(to)
        he, te = he + te, he - te                                  # h = 64
        ho, to = ho + to, ho - to
        he = he * F.INV_SQRT128
        ho = ho * F.INV_SQRT128
        te = te * F.INV_SQRT128
        to = to * F.INV_SQRT128
    ah = tl.reduce(tl.maximum(tl.abs(he), tl.abs(ho), propagate_nan=tl.PropagateNan.ALL), 2, F.max_nan)
    at = tl.reduce(tl.maximum(tl.abs(te), tl.abs(to), propagate_nan=tl.PropagateNan.ALL), 2, F.max_nan)
    eh = ue8m0_recip(ah)
    et = ue8m0_recip(at)
    okay = (ah == ah) & (at == at) & (eh <= 150) & (et <= 150) | ~m2
    if SHUFFLE:
        HB: tl.constexpr = H // 16
        if QS_PAD > HB:
            # pad columns H/16 .. QS_PAD-1 of the aiter q-scale layout, written 0 by heads 0..15
            tt = t[:, None]
            hh = h[:, None]
            jj = tl.arange(0, QS_PAD)[None, None, :]
            padm = (m2 & (hh < 16))[:, :, None] & (jj >= HB)
            z = tl.zeros((R, 2, QS_PAD), tl.uint8)
            p0 = L.aiter_q_scale_at(tt, u, hh % 16, 4, QS_PAD) - hh // 16
            p2 = L.aiter_q_scale_at(tt, u + 2, hh % 16, 4, QS_PAD) - hh // 16
            tl.store(scale_ptr + (p0[:, :, None] + jj), z, mask=padm)
            tl.store(scale_ptr + (p2[:, :, None] + jj), z, mask=padm)
    if POLICY == F.ROUND_THRESHOLD or tl.min(okay.to(tl.int32)) == 0:
        # the general encoder (NaN/Inf, exponents above 150, threshold's ties)
        eh = ue8m0_recip(F.amax_pairs(he, ho, NATIVE))
        et = ue8m0_recip(F.amax_pairs(te, to, NATIVE))
        qh = F.pack_index_pairs(F.e2m1_index_float_any(he, eh[:, :, None], POLICY),
                                F.e2m1_index_float_any(ho, eh[:, :, None], POLICY))
        qt = F.pack_index_pairs(F.e2m1_index_float_any(te, et[:, :, None], POLICY),
                                F.e2m1_index_float_any(to, et[:, :, None], POLICY))
    else:
        # formats.e2m1_index_float: v on the grid scaled by s = 2^(e-127), index floats times 2^(1-e)
        SIGN: tl.constexpr = F.SIGN_BIT if POLICY == F.ROUND_HARDWARE else F.SIGN_NONZERO
        sh = F.pow2(eh)[:, :, None]
        ph = F.pow2_any(1 - eh)[:, :, None]
        st = F.pow2(et)[:, :, None]
        pt = F.pow2_any(1 - et)[:, :, None]
        qh = F.pack_index_pairs(F.e2m1_index_float(he, sh, ph, SIGN), F.e2m1_index_float(ho, sh, ph, SIGN))
        qt = F.pack_index_pairs(F.e2m1_index_float(te, st, pt, SIGN), F.e2m1_index_float(to, st, pt, SIGN))
    pb = (r * 64)[:, None, None] + u[:, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    tl.store(out_ptr + pb, qh, mask=m2[:, :, None])
    tl.store(out_ptr + (pb + 32), qt, mask=m2[:, :, None])
    if SHUFFLE:
        tl.store(scale_ptr + L.aiter_q_scale_at(t[:, None], u, h[:, None], 4, QS_PAD), eh.to(tl.uint8), mask=m2)
        tl.store(scale_ptr + L.aiter_q_scale_at(t[:, None], u + 2, h[:, None], 4, QS_PAD), et.to(tl.uint8), mask=m2)
    else:
        eb = (r * 4)[:, None] + u                                  # dense [T, H, 4]
        tl.store(scale_ptr + eb, eh.to(tl.uint8), mask=m2)
        tl.store(scale_ptr + (eb + 2), et.to(tl.uint8), mask=m2)


def _hadamard_scale(D: int) -> float:
    """fl(D^-0.5) as the reference's hadamard uses it (fl(128^-0.5) = 0x3DB504F3 for D = 128)."""
    return float(np.float32(D ** -0.5))


def prepare_rope_rotate(out, x, cos_cache, sin_cache, positions, rope_dim, out_scale, group_size, shuffle_scale,
                        hadamard_on, rounding, modes=None):
    """(kernel, grid, positional args, constexprs, num_warps) of the one launch (also used by the
    ahead-of-time compile test). Arguments as reference.compress.rope_rotate_quant."""
    T, H, D = x.shape
    if out.dtype in FP4_OUT_DTYPES:
        kind_out, flavour = OUT_FP4, None
    elif out.dtype in FP8_OUT_DTYPES:
        kind_out, flavour = OUT_FP8, FP8_OUT_DTYPES[out.dtype]
    elif out.dtype == x.dtype and out.dtype in (torch.bfloat16, torch.float16):
        kind_out, flavour = OUT_HALF, None
    else:
        raise TypeError(f"out: unsupported dtype {out.dtype}")
    md = launch_modes(x.device, flavour, modes)
    nat = md["NATIVE"]
    if kind_out == OUT_FP4 and D == 128 and group_size == 32:
        return _prepare_fp4_128(out, x, cos_cache, sin_cache, positions, out_scale, shuffle_scale, hadamard_on,
                                rounding, nat)
    elems, warps = LAUNCH["rope_rotate"]
    rows = max(1, elems // D)
    xv, x_kind = tensor_kind(x, nat)
    cv, cs_kind = tensor_kind(cos_cache, nat)
    sv, _ = tensor_kind(sin_cache, nat)
    if kind_out == OUT_HALF:
        ov, _ = tensor_kind(out, nat, output=True)
        so = (out.stride(0), out.stride(1), out.stride(2))
        sc = ov
    else:
        ov = as_u8(out)
        so = (0, 0, 0)
        sc = out_scale if kind_out == OUT_FP8 else as_u8(out_scale)
    g = group_size if kind_out != OUT_HALF else D
    qs_pad = out_scale.shape[-1] if (kind_out == OUT_FP4 and shuffle_scale) else 4
    bias, fmax, _ = F.fp8_consts(flavour or "e4m3fn")
    args = [xv, x.stride(0), x.stride(1), positions, positions.stride(0), cv, sv, cos_cache.stride(0),
            sin_cache.stride(0), cos_cache.shape[0], ov, *so, sc, T, H, qs_pad, errors.flag_tensor(x.device)]
    consts = dict(X_KIND=x_kind, CS_KIND=cs_kind, D=D, OUT=kind_out, G=g,
                  SHUFFLE=bool(shuffle_scale) and kind_out == OUT_FP4, HADAMARD=bool(hadamard_on),
                  HSCALE=_hadamard_scale(D), POLICY=code_of(Rounding, rounding), BIAS=bias, FMAX=fmax,
                  FNUZ=(flavour == "e4m3fnuz"), HW_FP8=md["HW_FP8"] and kind_out == OUT_FP8, ROWS=rows, NATIVE=nat)
    return _rope_rotate_kernel, (triton.cdiv(T * H, rows),), args, consts, warps


def _prepare_fp4_128(out, x, cos_cache, sin_cache, positions, out_scale, shuffle_scale, hadamard_on, rounding, nat):
    """The launch of _rope_rotate_fp4_kernel (D = 128, FP4 in groups of 32)."""
    T, H, _ = x.shape
    rows, warps = LAUNCH["rope_rotate_fp4"]
    x32 = pair_view(x)
    xv, x_kind = tensor_kind(x, nat) if x32 is None else (x32, F.KIND_BF16.value)
    c32, s32 = pair_view(cos_cache), pair_view(sin_cache)
    cs_pairs = c32 is not None and s32 is not None
    if cs_pairs:
        cv, sv, cs_kind = c32, s32, F.KIND_BF16.value
    else:
        cv, cs_kind = tensor_kind(cos_cache, nat)
        sv, _ = tensor_kind(sin_cache, nat)
    qs_pad = out_scale.shape[-1] if shuffle_scale else 4        # shuffled: round_up(H/16, 4), a function of H
    n = triton.cdiv(T * H, rows)
    args = [xv, xv.stride(0), xv.stride(1), positions, positions.stride(0), cv, sv, cv.stride(0), sv.stride(0),
            cos_cache.shape[0], as_u8(out), as_u8(out_scale), T, errors.flag_tensor(x.device)]
    consts = dict(X_KIND=x_kind, CS_KIND=cs_kind, PAIRS=x32 is not None, CS_PAIRS=cs_pairs,
                  SHUFFLE=bool(shuffle_scale), HADAMARD=bool(hadamard_on), POLICY=code_of(Rounding, rounding),
                  ROWS=rows, NATIVE=nat, H=H, QS_PAD=qs_pad,
                  I32=offsets_fit_i32(n * rows * 64, T * 64 * qs_pad, (T - 1) * xv.stride(0) + (H - 1) * xv.stride(1) + 128,
                                      (T - 1) * positions.stride(0), cv.numel(), sv.numel()))
    return _rope_rotate_fp4_kernel, (n,), args, consts, warps


def rope_rotate_quant(out, x, cos_cache, sin_cache, positions, rope_dim, out_scale, group_size, shuffle_scale,
                      hadamard_on, rounding):
    """SPEC §7.7 (same arguments as reference.compress.rope_rotate_quant; see dsaquant.compress.rope_rotate_quant).

    x [T, H, D] bf16/fp16/fp32 (D in 128..1024, H a power of two); cos_cache, sin_cache [max_pos, 32];
    positions [T] int32/int64; out by dtype: uint8/float4_e2m1fn_x2 [T, H, D/2] with out_scale uint8 (shuffled
    [T, D/128, 4, 16, qs_pad] or dense [T, H, D/group_size]); float8 [T, H, D] with out_scale fp32
    [T, H, D/group_size]; x's bf16/fp16 dtype [T, H, D] (may alias x). Any other out dtype raises TypeError."""
    if x.shape[0] * x.shape[1] == 0:
        return
    kernel, grid, args, consts, warps = prepare_rope_rotate(out, x, cos_cache, sin_cache, positions, rope_dim,
                                                            out_scale, group_size, shuffle_scale, hadamard_on,
                                                            rounding)
    kernel[grid](*args, **consts, num_warps=warps, enable_fp_fusion=False)


OPS = {"rope_rotate_quant": rope_rotate_quant}

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
from .formats import (amax_tile, cast_for_store, fp4_encode_tile, fp8_group_quant, hadamard_row, load_f32,
                      pack_nibbles_row, rope_tail_row, ue8m0_recip)
from .quant import as_u8, launch_from_env, launch_modes, tensor_kind

POS_ERR: tl.constexpr = tl.constexpr(errors.POSITION_OUT_OF_RANGE)
OUT_FP4: tl.constexpr = tl.constexpr(int(codes.OutKind.fp4))
OUT_FP8: tl.constexpr = tl.constexpr(int(codes.OutKind.fp8))
OUT_HALF: tl.constexpr = tl.constexpr(int(codes.OutKind.half))

LAUNCH = {"rope_rotate": (4096, 4)}


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

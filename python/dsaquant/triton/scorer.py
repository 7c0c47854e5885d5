"""SPEC §7.4 in Triton: `paged_mqa_logits` over the three §6 cache layouts (fp8_132 plain and
preshuffled, packed68, aiter_fp4).

Kernel design (one kernel, the layout is a constexpr):
  * grid = (B, splits, query groups). Program (b, s, g) owns the KV tiles [s*TPP, (s+1)*TPP) of sequence b,
    a tile being BLOCK_KV (default 64, one page at P = 64) consecutive positions. A tile inside one page
    (P a multiple of BLOCK_KV) looks up one block-table entry, otherwise every position its own
    (block_tables[b, p // P]), so any page size works, and consecutive positions of one page are one
    contiguous load.
  * The NG*H query rows of its queries (row r = (n - n0)*H + h, padded to a power of two; NG = every
    query of the sequence when N*H <= 256, i.e. next_n 1..4 at H = 64, else groups of 256 // H) are loaded
    and dequantized ONCE per program, before the tile loop, and reused for every tile.
  * Per tile: S[p, r] = tl.dot(K_tile [BLOCK_KV, 128], Q^T [128, NHP]) with fp32 accumulation
    (the KV tile is the M side, so M = 64 for every H and N: Hopper wgmma shape), then
    relu (NaN kept), times w[r], a sum over the H columns of each query n, times weight_scale,
    and -inf at p >= context_len[b, n]. Tiles entirely past the context are only filled with -inf
    (no cache read). Rows at or past the context never read the cache (masked loads); positions whose
    page id is outside [0, num_pages) or past the block table are not read either: -inf, and the error
    flag's PAGE_OUT_OF_RANGE (set once a program, after its tiles).
  * Loads: the compiler's software pipeline (num_stages) copies the cache tiles (and their block-table
    entries) ahead of the dot; the fp8 k scales, which feed no dot and so are not pipelined by the
    compiler, are loaded by the kernel one tile ahead (their block-table entry two tiles ahead), in
    registers carried through the loop.
  * The epilogue sums the heads of each query at once, the [BLOCK_KV, NHP] tile seen as
    [BLOCK_KV, NHP / H, H] (one reduction for every query of the program, not one masked sum each).
  * fp8_132: native fp8 x fp8 tl.dot where the target has it for the flavour (e4m3fn on sm_89+ and
    gfx950, e4m3fnuz on gfx942); the per-position k scale is applied after the dot (q's scale is folded
    into the weights by the writer, SPEC §7.1). On sm_90 the dot is promoted to a fp32 accumulator every
    32 products (max_num_imprecise_acc=32), DeepGEMM-style, instead of Triton's default imprecise
    accumulation. Elsewhere (fnuz on NVIDIA, fn on gfx942, the interpreter by default) the codes are
    decoded bit-exactly to bf16 (every e4m3 value is a bf16) and the dot runs in bf16.
  * packed68 / aiter_fp4: q and k tiles are decoded to value * 2^(e-127) (SPEC §1, §3; e = 255 -> NaN,
    e = 0 -> 0 as pow2 from bits) in fp32 and rounded to bf16, which is EXACT: an E2M1 value has at
    most 2 significant bits and bf16 has fp32's exponent range (the smallest nonzero value,
    0.5 * 2^-126 = 2^-127, is a bf16 subnormal; overflow is Inf in both). The nibbles are not
    interleaved: the dot is split as dot(k_lo, q_lo) + dot(k_hi, q_hi) over the even and odd elements
    (K = 64 each), which is the same sum over d in another order.
  * Under TRITON_INTERPRET=1 the bf16 operands are converted back to fp32 for an fp32 dot (the
    interpreter cannot multiply bf16); the bf16 rounding still happens, so its exactness is tested.

Accuracy (not byte-exact; the reference sums in another order): every product q*k is exact in fp32
except under/overflow, so the difference to the reference is fp32 summation error only. With
mag = |weight_scale| * sum_h |w_h| * sum_d |q_hd * k_pd| (both sides dequantized):
    |triton - reference| <= 3e-5 * mag   (bf16 / fp32 dot paths; worst-case bound for 128 + H terms
                                          summed in fp32 twice, reference and Triton)
    |triton - reference| <= 1e-3 * mag   (native fp8 tl.dot on a GPU: tensor cores' reduced-precision
                                          fp8 accumulation inside each K=32 step)
NaN inputs (FP8 NaN codes, e = 255 scales) give NaN logits inside the context, as in the reference.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .. import errors
from . import layouts as L
from .. import codes
from ..codes import Layout, code_of
from ..reference.layouts import aiter_q_scale_pad

LAYOUT_FP8_132: tl.constexpr = tl.constexpr(int(codes.Layout.fp8_132))
LAYOUT_PACKED68: tl.constexpr = tl.constexpr(int(codes.Layout.packed68))
ERR_PAGE: tl.constexpr = tl.constexpr(int(codes.ErrFlag.page_out_of_range))
TOL_EXACT_PRODUCTS = 3e-5   # relative to `mag` (see module docstring): bf16 / fp32 dot paths
TOL_NATIVE_FP8 = 1e-3       # relative to `mag`: native fp8 tensor-core dot
BLOCK_KV_DEFAULT = 64
MAX_QUERY_ROWS = 256        # q rows (queries x heads) per program


# ------------------------------------------------------------------------------------------------
# element decoders
# ------------------------------------------------------------------------------------------------
@triton.jit
def _e2m1_value(c):
    """int32 nibble codes (bit 3 sign, bits 0..2 magnitude index) -> fp32 E2M1 values (0x8 -> -0)."""
    m = c & 7
    e2 = m >> 1
    mag_bits = tl.where(m >= 2, ((e2 + 126) << 23) | ((m & 1) << 22), tl.where(m == 1, 126 << 23, 0))
    return (mag_bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _ue8m0_scale(e):
    """int32 biased exponents -> fp32 2^(e-127) from bits (e = 0 -> 0.0, e = 255 -> NaN)."""
    s = (e << 23).to(tl.float32, bitcast=True)
    return tl.where(e == 255, float("nan"), s)


@triton.jit
def _fp4_dequant(payload, word, col):
    """payload uint8 [R, 64] (byte i: element 2i low nibble, 2i+1 high; block i // 16), word int32 [R]
    (exponent of block j in byte j), col = arange(64) -> (even elements, odd elements) as fp32
    value * 2^(e-127)."""
    c = payload.to(tl.int32)
    s = _ue8m0_scale((word[:, None] >> ((col // 16) * 8)[None, :]) & 255)
    return _e2m1_value(c & 15) * s, _e2m1_value(c >> 4) * s


@triton.jit
def _fp8_decode(codes, FNUZ: tl.constexpr):
    """uint8 E4M3 codes -> fp32 values (e4m3fn or e4m3fnuz; NaN codes -> NaN), bit-exact."""
    c = codes.to(tl.int32)
    e = (c >> 3) & 15
    m = c & 7
    if FNUZ:
        normal = ((e + 119) << 23) | (m << 20)
        sub = m.to(tl.float32) * 0.0009765625          # m * 2^-10
        nan = c == 0x80
    else:
        normal = ((e + 120) << 23) | (m << 20)
        sub = m.to(tl.float32) * 0.001953125           # m * 2^-9
        nan = (c & 0x7F) == 0x7F
    mag = tl.where(e == 0, sub, normal.to(tl.float32, bitcast=True))
    val = tl.where((c & 0x80) != 0, -mag, mag)
    return tl.where(nan, float("nan"), val)


@triton.jit
def _to_dot_operand(x, DOT_F32: tl.constexpr):
    """fp32 values (exactly representable in bf16) -> the dot operand: bf16, or bf16 -> fp32 when
    DOT_F32 (the interpreter; the rounding to bf16 still happens)."""
    y = x.to(tl.bfloat16)
    if DOT_F32:
        y = y.to(tl.float32)
    return y


# ------------------------------------------------------------------------------------------------
# the kernel
# ------------------------------------------------------------------------------------------------
@triton.jit
def _paged_mqa_logits_kernel(
    q_ptr, qs_ptr, w_ptr, ctx_ptr, bt_ptr, kv_ptr, kvf_ptr, ks_ptr, out_ptr, err_ptr,
    num_pages, nblk, max_seq_len, tiles_per_prog, weight_scale,
    stride_wt, stride_wh, stride_cb, stride_cn, stride_bb, stride_bk, stride_out,
    N: tl.constexpr, NG: tl.constexpr, H: tl.constexpr, NHP: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_KV: tl.constexpr, LAYOUT: tl.constexpr, PRESHUFFLE: tl.constexpr, FP8_NATIVE: tl.constexpr,
    FNUZ: tl.constexpr, QS_PAD: tl.constexpr, DOT_F32: tl.constexpr, IMPRECISE: tl.constexpr,
    STATIC_TILES: tl.constexpr, CLEAN: tl.constexpr, OUT_BF16: tl.constexpr,
):
    b = tl.program_id(0)
    sp = tl.program_id(1)
    n0 = tl.program_id(2) * NG                                         # this program's queries: n0 .. n0+NG-1
    b64 = b.to(tl.int64)

    # ---- query rows r = (n - n0)*H + h (padded to NHP), loaded and dequantized once per program ------
    r = tl.arange(0, NHP)
    n_of_r = n0 + r // H
    h_of_r = r % H
    r_ok = (r < NG * H) & (n_of_r < N)
    row = (b64 * N + n_of_r) * H + h_of_r
    w_col = tl.load(w_ptr + (b64 * N + n_of_r) * stride_wt + h_of_r * stride_wh, mask=r_ok,
                    other=0.0).to(tl.float32)
    ctx_col = tl.load(ctx_ptr + b64 * stride_cb + n_of_r * stride_cn, mask=r_ok, other=0)
    ctx_max = tl.minimum(tl.max(ctx_col, axis=0).to(tl.int32), max_seq_len)

    if LAYOUT == LAYOUT_FP8_132:
        d = tl.arange(0, 128)
        qc = tl.load(q_ptr + row[:, None] * 128 + d[None, :], mask=r_ok[:, None], other=0)
        if FP8_NATIVE:
            if FNUZ:
                qT = tl.trans(qc.to(tl.float8e4b8, bitcast=True))
            else:
                qT = tl.trans(qc.to(tl.float8e4nv, bitcast=True))
        else:
            qT = tl.trans(_to_dot_operand(_fp8_decode(qc, FNUZ), DOT_F32))
        qT_hi = qT  # unused
    else:
        col = tl.arange(0, 64)
        qp = tl.load(q_ptr + row[:, None] * 64 + col[None, :], mask=r_ok[:, None], other=0)
        if LAYOUT == LAYOUT_PACKED68:   # the 4 exponent bytes of row (b, n, h) as one int32 (qs_ptr: *i32)
            qword = tl.load(qs_ptr + row, mask=r_ok, other=0)
        else:             # aiter q_scale [B*N, 1, 4, 16, QS_PAD]: [t, 0, j, h % 16, h // 16]
            qe_base = (b64 * N + n_of_r) * (64 * QS_PAD) + (h_of_r % 16) * QS_PAD + h_of_r // 16
            qword = tl.zeros((NHP,), tl.int32)
            for g in tl.static_range(4):
                eg = tl.load(qs_ptr + qe_base + g * (16 * QS_PAD), mask=r_ok, other=0).to(tl.int32)
                qword = qword | (eg << (8 * g))
        q_lo, q_hi = _fp4_dequant(qp, qword, col)
        qT = tl.trans(_to_dot_operand(q_lo, DOT_F32))
        qT_hi = tl.trans(_to_dot_operand(q_hi, DOT_F32))

    # ---- the tiles of this program --------------------------------------------------------------------
    num_tiles = tl.cdiv(max_seq_len, BLOCK_KV)
    t_begin = sp * tiles_per_prog
    t_end = tl.minimum(t_begin + tiles_per_prog, num_tiles)
    t_ctx = tl.minimum(tl.cdiv(ctx_max, BLOCK_KV), t_end)
    bad = tl.zeros((BLOCK_KV,), tl.int32)   # positions whose page id is out of range, over the program's tiles
    if STATIC_TILES == 0:
        # page ids two tiles ahead and fp8 scales one tile ahead of the one scored, carried in registers
        page_a = _tile_pages(t_begin, b64, bt_ptr, stride_bb, stride_bk, nblk, ctx_max, PAGE, BLOCK_KV)
        page_b = _tile_pages(t_begin + 1, b64, bt_ptr, stride_bb, stride_bk, nblk, ctx_max, PAGE, BLOCK_KV)
        scale_a = _tile_scales(page_a, t_begin, kvf_ptr, num_pages, PAGE, BLOCK_KV, LAYOUT)
        for t in range(t_begin, t_ctx):
            page_c = _tile_pages(t + 2, b64, bt_ptr, stride_bb, stride_bk, nblk, ctx_max, PAGE, BLOCK_KV)
            scale_b = _tile_scales(page_b, t + 1, kvf_ptr, num_pages, PAGE, BLOCK_KV, LAYOUT)
            page_t = _tile_pages(t, b64, bt_ptr, stride_bb, stride_bk, nblk, ctx_max, PAGE, BLOCK_KV)
            bad |= _score_tile(t, page_t, scale_a, qT, qT_hi, w_col, n0, b64, ctx_ptr, stride_cb, stride_cn,
                               kv_ptr, kvf_ptr, ks_ptr, out_ptr, stride_out, num_pages, max_seq_len, ctx_max,
                               weight_scale, N, NG, PAGE, BLOCK_KV, LAYOUT, PRESHUFFLE, FP8_NATIVE, FNUZ, DOT_F32,
                               IMPRECISE, CLEAN, OUT_BF16, H)
            page_a = page_b
            page_b = page_c
            scale_a = scale_b
        for t in range(tl.maximum(t_begin, t_ctx), t_end):   # past the context: -inf only, no cache read
            if CLEAN:
                _fill_tile(t, n0, b64, out_ptr, stride_out, max_seq_len, N, NG, BLOCK_KV, OUT_BF16)
    else:
        # the same loops with a constexpr trip count and a branch: the interpreter cannot run loops with
        # tensor bounds under numpy >= 2.4 (int() of a 1-element array)
        for i in range(STATIC_TILES):
            t = t_begin + i
            if t < t_ctx:
                page_a = _tile_pages(t, b64, bt_ptr, stride_bb, stride_bk, nblk, ctx_max, PAGE, BLOCK_KV)
                scale_a = _tile_scales(page_a, t, kvf_ptr, num_pages, PAGE, BLOCK_KV, LAYOUT)
                bad |= _score_tile(t, page_a, scale_a, qT, qT_hi, w_col, n0, b64, ctx_ptr, stride_cb,
                                   stride_cn, kv_ptr, kvf_ptr, ks_ptr, out_ptr, stride_out, num_pages, max_seq_len,
                                   ctx_max, weight_scale, N, NG, PAGE, BLOCK_KV, LAYOUT, PRESHUFFLE, FP8_NATIVE, FNUZ,
                                   DOT_F32, IMPRECISE, CLEAN, OUT_BF16, H)
            else:
                if CLEAN and t < t_end:
                    _fill_tile(t, n0, b64, out_ptr, stride_out, max_seq_len, N, NG, BLOCK_KV, OUT_BF16)
    if tl.max(bad, axis=0) > 0:   # one flag update a program, after its tiles (no reduction inside the loop)
        tl.atomic_or(err_ptr, ERR_PAGE)


@triton.jit
def _fill_tile(t, n0, b64, out_ptr, stride_out, max_seq_len, N: tl.constexpr, NG: tl.constexpr,
               BLOCK_KV: tl.constexpr, OUT_BF16: tl.constexpr):
    p = t * BLOCK_KV + tl.arange(0, BLOCK_KV)
    ninf = tl.full((BLOCK_KV,), float("-inf"), tl.float32)
    if OUT_BF16:
        ninf = ninf.to(tl.bfloat16)
    for i in tl.static_range(NG):
        n = n0 + i
        tl.store(out_ptr + (b64 * N + n) * stride_out + p, ninf, mask=(p < max_seq_len) & (n < N))


@triton.jit
def _tile_pages(t, b64, bt_ptr, stride_bb, stride_bk, nblk, ctx_max, PAGE: tl.constexpr, BLOCK_KV: tl.constexpr):
    """[BLOCK_KV] int64 page ids of the positions of tile t (-1 at and past ctx_max and past the table)."""
    p = t * BLOCK_KV + tl.arange(0, BLOCK_KV)
    if PAGE % BLOCK_KV == 0:   # the tile lies in one page: one block-table entry
        blk0 = (t * BLOCK_KV) // PAGE
        page0 = tl.load(bt_ptr + b64 * stride_bb + blk0.to(tl.int64) * stride_bk,
                        mask=(blk0 < nblk) & (t * BLOCK_KV < ctx_max), other=-1)
        page = tl.where(p < ctx_max, page0.to(tl.int64), -1)
    else:
        blk = p // PAGE
        page = tl.load(bt_ptr + b64 * stride_bb + blk.to(tl.int64) * stride_bk, mask=(p < ctx_max) & (blk < nblk),
                       other=-1).to(tl.int64)
    return page


@triton.jit
def _tile_scales(page, t, kvf_ptr, num_pages, PAGE: tl.constexpr, BLOCK_KV: tl.constexpr, LAYOUT: tl.constexpr):
    """fp8_132: the [BLOCK_KV] fp32 k scales of tile t's positions (0 where the page is not read); other
    layouts: zeros (unused)."""
    if LAYOUT == LAYOUT_FP8_132:
        o = (t * BLOCK_KV + tl.arange(0, BLOCK_KV)) % PAGE
        ok = (page >= 0) & (page < num_pages)
        return tl.load(kvf_ptr + L.fp8_132_scale(tl.where(ok, page, 0), o, PAGE), mask=ok, other=0.0)
    else:
        return tl.zeros((BLOCK_KV,), tl.float32)


@triton.jit
def _score_tile(t, page, k_scale, qT, qT_hi, w_col, n0, b64, ctx_ptr, stride_cb, stride_cn,
                kv_ptr, kvf_ptr, ks_ptr, out_ptr, stride_out, num_pages, max_seq_len,
                ctx_max, weight_scale, N: tl.constexpr, NG: tl.constexpr, PAGE: tl.constexpr,
                BLOCK_KV: tl.constexpr, LAYOUT: tl.constexpr, PRESHUFFLE: tl.constexpr, FP8_NATIVE: tl.constexpr,
                FNUZ: tl.constexpr, DOT_F32: tl.constexpr, IMPRECISE: tl.constexpr, CLEAN: tl.constexpr,
                OUT_BF16: tl.constexpr, H: tl.constexpr):
    """Logits of positions [t*BLOCK_KV, (t+1)*BLOCK_KV) of sequence b for its queries n0 .. n0+NG-1, given the
    tile's page ids (_tile_pages) and, for fp8_132, its k scales (_tile_scales), both loaded a tile or two ahead
    (loads that feed no dot are not pipelined by the compiler). Returns 1 at the positions inside the context whose
    page id is out of range (not read, -inf), else 0."""
    p = t * BLOCK_KV + tl.arange(0, BLOCK_KV)                          # int32 positions
    in_ctx = p < ctx_max
    found = (page >= 0) & (page < num_pages)                           # else: not read, -inf, flagged
    p_ok = in_ctx & found
    page = tl.where(found, page, 0)
    o = p % PAGE

    if LAYOUT == LAYOUT_FP8_132:
        d = tl.arange(0, 128)
        kc = tl.load(kv_ptr + L.fp8_132_data(page, o, d, PAGE, PRESHUFFLE), mask=p_ok[:, None], other=0)
        if FP8_NATIVE:
            if FNUZ:
                kf = kc.to(tl.float8e4b8, bitcast=True)
            else:
                kf = kc.to(tl.float8e4nv, bitcast=True)
            acc = tl.dot(kf, qT, max_num_imprecise_acc=IMPRECISE)
        else:
            kf = _to_dot_operand(_fp8_decode(kc, FNUZ), DOT_F32)
            if DOT_F32:
                acc = tl.dot(kf, qT, input_precision="ieee")
            else:
                acc = tl.dot(kf, qT)
        acc = acc * k_scale[:, None]
    else:
        col = tl.arange(0, 64)
        if LAYOUT == LAYOUT_PACKED68:   # packed68: payload at 64*o + byte, exponents at 64*P + 4*o (kvf_ptr: *i32 view)
            kp = tl.load(kv_ptr + L.packed68_payload(page, o, col, PAGE), mask=p_ok[:, None], other=0)
            kword = tl.load(kvf_ptr + L.packed68_exponent_word(page, o, PAGE), mask=p_ok, other=0)
        else:             # aiter_fp4: [NB, 1, 4, P, 16] and [NB, 1, 4, P] at sflat(o)
            kp = tl.load(kv_ptr + L.aiter_fp4_payload(page, o, col, PAGE), mask=p_ok[:, None], other=0)
            ke_base = L.aiter_fp4_exponent(page, o, PAGE)
            kword = tl.zeros((BLOCK_KV,), tl.int32)
            for g in tl.static_range(4):
                eg = tl.load(ks_ptr + ke_base + g * PAGE, mask=p_ok, other=0).to(tl.int32)
                kword = kword | (eg << (8 * g))
        k_lo, k_hi = _fp4_dequant(kp, kword, col)
        k_lo = _to_dot_operand(k_lo, DOT_F32)
        k_hi = _to_dot_operand(k_hi, DOT_F32)
        if DOT_F32:
            acc = tl.dot(k_lo, qT, input_precision="ieee")
            acc = tl.dot(k_hi, qT_hi, acc, input_precision="ieee")
        else:
            acc = tl.dot(k_lo, qT)
            acc = tl.dot(k_hi, qT_hi, acc)

    v = tl.where(acc < 0, 0.0, acc) * w_col[None, :]                   # relu that keeps NaN, times w[h]
    p_out = p < max_seq_len
    # the heads of each query summed at once: [BLOCK_KV, NHP] as [BLOCK_KV, NHP / H, H] (NHP / H >= NG queries)
    logit = tl.sum(tl.reshape(v, (BLOCK_KV, v.shape[1] // H, H)), axis=2) * weight_scale
    n = n0 + tl.arange(0, v.shape[1] // H)
    n_ok = (n < n0 + NG) & (n < N)
    ctx_n = tl.load(ctx_ptr + b64 * stride_cb + n * stride_cn, mask=n_ok, other=0)
    logit = tl.where((p[:, None] < ctx_n[None, :]) & found[:, None], logit, float("-inf"))
    if OUT_BF16:
        logit = logit.to(tl.bfloat16)
    mask = p_out[:, None] & n_ok[None, :]
    if not CLEAN:
        mask = mask & (p[:, None] < ctx_n[None, :])
    tl.store(out_ptr + (b64 * N + n.to(tl.int64))[None, :] * stride_out + p[:, None], logit, mask=mask)
    return tl.where(in_ctx & ~found, 1, 0)


# ------------------------------------------------------------------------------------------------
# target selection and launch
# ------------------------------------------------------------------------------------------------
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _dev_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _device_info(index: int):
    """(is ROCm, gfx arch or '', (major, minor), SM count) of one GPU."""
    props = torch.cuda.get_device_properties(index)
    is_hip = bool(getattr(torch.version, "hip", None))
    arch = props.gcnArchName.split(":")[0] if is_hip else ""
    return is_hip, arch, (props.major, props.minor), props.multi_processor_count


def native_fp8_for(device: torch.device, fp8_flavour: str) -> bool:
    """Whether this device has a native fp8 x fp8 dot for the flavour (False on the CPU/interpreter)."""
    if device.type != "cuda" or _interpreting():
        return False
    is_hip, arch, cap, _ = _device_info(_dev_index(device))
    if is_hip:
        return (arch == "gfx942" and fp8_flavour == "e4m3fnuz") or (arch == "gfx950" and fp8_flavour == "e4m3fn")
    return fp8_flavour == "e4m3fn" and cap >= (8, 9)


@functools.lru_cache(maxsize=None)
def kernel_constexprs(layout: str, N: int, H: int, page_size: int, *, preshuffle: bool = False,
                      fp8_native: bool = False, fnuz: bool = False, block_kv: int = BLOCK_KV_DEFAULT,
                      dot_f32: bool = False, imprecise: int | None = None, static_tiles: int = 0,
                      clean: bool = True, out_bf16: bool = False) -> dict:
    """The kernel's constexpr arguments for one configuration (shared by the launcher and AOT tests)."""
    if layout not in codes.LAYOUTS:
        raise ValueError(f"layout: expected one of {codes.LAYOUTS}, got {layout!r}")
    if N < 1 or H < 1:
        raise ValueError(f"q: expected next_n >= 1 and H >= 1, got next_n = {N}, H = {H}")
    if block_kv < 16 or block_kv & (block_kv - 1):
        raise ValueError(f"block_kv must be a power of two >= 16, got {block_kv}")
    if preshuffle and page_size % 16:
        raise ValueError(f"kv_cache: page size must be a multiple of 16 for preshuffle, got {page_size}")
    fp8 = layout == "fp8_132"
    NG = queries_per_program(N, H)
    return dict(N=N, NG=NG, H=H, NHP=max(16, _next_pow2(NG * H)), PAGE=page_size, BLOCK_KV=block_kv,
                LAYOUT=code_of(Layout, layout), PRESHUFFLE=bool(preshuffle and fp8),
                FP8_NATIVE=bool(fp8_native and fp8),
                FNUZ=bool(fnuz and fp8), QS_PAD=aiter_q_scale_pad(H) if layout == "aiter_fp4" else 1,
                DOT_F32=bool(dot_f32), IMPRECISE=32 if imprecise is None else int(imprecise),
                STATIC_TILES=int(static_tiles), CLEAN=bool(clean), OUT_BF16=bool(out_bf16))


def queries_per_program(N: int, H: int) -> int:
    """How many of a sequence's N queries one program scores together: as many as fit in 256 q rows
    (N = next_n <= 4 at H = 64 is one group; larger N, e.g. demo.py's 16 queries, take several groups)."""
    return max(1, min(N, MAX_QUERY_ROWS // H))


@functools.lru_cache(maxsize=None)
def launch_options(N: int, H: int, target: str | None = None) -> dict:
    """num_warps / num_stages for one configuration on `target` ("cuda" or "hip"; None: the platform of this
    torch build); do not mutate the returned dict. NVIDIA: five stages, which give the cache tiles two buffers
    (the block-table load takes a stage of the pipeline); measured on the H100 against three and seven stages
    ((64, 1, 8192) fp8_132: 39.3 µs against 43.5 and 41.7; (64, 2, 8192): 72.2 against 90.8 and 77.4)."""
    nhp = max(16, _next_pow2(queries_per_program(N, H) * H))
    is_hip = bool(getattr(torch.version, "hip", None)) if target is None else target == "hip"
    return dict(num_warps=8 if nhp >= 128 else 4, num_stages=2 if is_hip else 5)


def _tiles_per_prog(B: int, groups: int, num_tiles: int, q_bytes: int, tile_bytes: int,
                    device: torch.device) -> int:
    """KV tiles per program: about 8 programs per SM (short tail waves), but at least enough tiles that
    re-reading the program's q rows (from L2) costs no more than its KV reads; at most 16."""
    if device.type != "cuda":
        return 2
    sms = _device_info(_dev_index(device))[3]
    by_fill = (B * groups * num_tiles) // (sms * 8)
    by_q = _cdiv(q_bytes, tile_bytes)
    return max(1, min(16, num_tiles, max(by_fill, by_q)))


def paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, max_seq_len, layout, q_scale,
                     kv_cache_scale, weight_scale, preshuffle, fp8_flavour, page_size, clean_logits, out, *,
                     fp8_dot=None, block_kv=BLOCK_KV_DEFAULT, tiles_per_prog=None, num_warps=None, num_stages=None):
    """The Triton backend of dsaquant.ops.paged_mqa_logits (same positional arguments as the reference;
    the arguments are validated there); writes `out` and returns it. Keyword-only tuning knobs: `fp8_dot`
    (None: native fp8 dot where the device has it; True/False forces it), `block_kv`, `tiles_per_prog`,
    `num_warps`, `num_stages`."""
    B, N, H = q.shape[:3]
    dev = q.device
    L = int(max_seq_len)
    if B * N == 0 or L == 0:
        return out
    fp8_flavour = fp8_flavour or "e4m3fn"
    fnuz = layout == "fp8_132" and fp8_flavour == "e4m3fnuz"
    native = native_fp8_for(dev, fp8_flavour) if fp8_dot is None else bool(fp8_dot)
    interp = _interpreting() or dev.type == "cpu"
    P = int(page_size)
    num_tiles = _cdiv(L, block_kv)
    NG = queries_per_program(N, H)
    if tiles_per_prog is None:
        fp8 = layout == "fp8_132"
        tiles_per_prog = _tiles_per_prog(B, _cdiv(N, NG), num_tiles, NG * H * (128 if fp8 else 68),
                                         block_kv * (132 if fp8 else 68), dev)
    tpp = int(tiles_per_prog)
    cx = kernel_constexprs(layout, N, H, P, preshuffle=bool(preshuffle), fp8_native=native, fnuz=fnuz,
                           block_kv=block_kv, dot_f32=interp, static_tiles=tpp if interp else 0,
                           clean=bool(clean_logits), out_bf16=out.dtype == torch.bfloat16)

    # the op validated contiguity; only dtypes are reinterpreted here (no copies)
    q_u8 = q if q.dtype == torch.uint8 else q.view(torch.uint8)
    kv_u8 = kv_cache if kv_cache.dtype == torch.uint8 else kv_cache.view(torch.uint8)
    if layout == "fp8_132":
        kvf, ks, qs = kv_u8.view(torch.float32), kv_u8, q_u8          # kvf: the fp32 k scales
    elif layout == "packed68":
        kvf, ks = kv_u8.view(torch.int32), kv_u8                      # kvf: a slot's 4 exponent bytes as one int32
        qs = q_scale if q_scale.dtype == torch.int32 else q_scale.view(torch.int32)
    else:
        kvf, ks, qs = kv_u8, kv_cache_scale, q_scale
    num_pages = kv_cache.shape[0]

    w = weights if weights.dim() == 2 else weights.reshape(B * N, H)
    ctx = context_lens
    scb, scn = (ctx.stride(0), 0) if ctx.dim() == 1 else (ctx.stride(0), ctx.stride(1))
    bt = block_tables
    nblk = bt.shape[1]

    grid = (B, _cdiv(num_tiles, tpp), _cdiv(N, NG))
    opts = dict(launch_options(N, H))
    if num_warps is not None:
        opts["num_warps"] = num_warps
    if num_stages is not None:
        opts["num_stages"] = num_stages
    _paged_mqa_logits_kernel[grid](
        q_u8, qs, w, ctx, bt, kv_u8, kvf, ks, out, errors.flag_tensor(dev),
        num_pages, nblk, L, tpp, float(weight_scale),
        w.stride(0), w.stride(1), scb, scn, bt.stride(0), bt.stride(1), out.stride(0),
        **cx, **opts)
    return out


OPS = {"paged_mqa_logits": paged_mqa_logits}


# ------------------------------------------------------------------------------------------------
# AOT compilation (tests/test_triton_scorer_aot.py) and the benchmark helper
# ------------------------------------------------------------------------------------------------
def aot_signature(layout: str, ctx_dtype: str = "i32", bt_dtype: str = "i32", w_dtype: str = "fp32") -> dict:
    """triton.compile signature of the kernel for one layout (pointers as the launcher passes them)."""
    return {
        "q_ptr": "*u8", "qs_ptr": "*i32" if layout == "packed68" else "*u8", "w_ptr": f"*{w_dtype}",
        "ctx_ptr": f"*{ctx_dtype}", "bt_ptr": f"*{bt_dtype}", "kv_ptr": "*u8",
        "kvf_ptr": {"fp8_132": "*fp32", "packed68": "*i32"}.get(layout, "*u8"), "ks_ptr": "*u8", "out_ptr": "*fp32",
        "err_ptr": "*i32", "num_pages": "i32", "nblk": "i32", "max_seq_len": "i32", "tiles_per_prog": "i32",
        "weight_scale": "fp32", "stride_wt": "i32", "stride_wh": "i32", "stride_cb": "i32", "stride_cn": "i32",
        "stride_bb": "i32", "stride_bk": "i32", "stride_out": "i32",
    }


def aot_compile(target, layout: str, N: int = 1, H: int = 64, page_size: int = 64, *, preshuffle=False,
                fp8_native=False, fnuz=False, num_warps=4, num_stages=5, ctx_dtype="i32", bt_dtype="i32",
                w_dtype="fp32"):
    """Compile the scorer kernel for a GPUTarget without a GPU. Returns the CompiledKernel."""
    from triton.compiler import ASTSource
    cx = kernel_constexprs(layout, N, H, page_size, preshuffle=preshuffle, fp8_native=fp8_native, fnuz=fnuz)
    sig = aot_signature(layout, ctx_dtype, bt_dtype, w_dtype)
    names = list(sig)
    sig.update({k: "constexpr" for k in cx})
    # pointers 16-byte aligned, as the JIT specializes them for torch allocations
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items() if v.startswith("*")}
    src = ASTSource(fn=_paged_mqa_logits_kernel, signature=sig, constexprs=cx, attrs=attrs)
    return triton.compile(src, target=target, options=dict(num_warps=num_warps, num_stages=num_stages))


BENCH_CASES = {
    # name: (layout-independent) shape. decode: DeepSeek decode step; glm: 32 heads; mtp: next_n = 2;
    # long: one sequence, 4 query tokens (MTP / chunked-prefill tail) over a 64K context.
    "decode": dict(B=64, N=1, H=64, ctx=8192),
    "decode_glm": dict(B=64, N=1, H=32, ctx=8192),
    "decode_mtp": dict(B=64, N=2, H=64, ctx=8192),
    "long": dict(B=1, N=4, H=64, ctx=65536),
}


def make_scorer_inputs(layout: str, B: int, N: int, H: int, ctx: int, page_size: int = 64, device="cuda",
                       seed: int = 0, fp8_flavour: str = "e4m3fn", preshuffle: bool = False, extra_pages: int = 1):
    """Random scorer inputs (keyword arguments of dsaquant.ops.paged_mqa_logits minus layout/backend, plus
    fp8_flavour/preshuffle for fp8_132): every sequence has context `ctx` on its own shuffled pages; codes
    are random bytes (no NaN codes), FP4 exponents in 120..129, fp8 k scales in [0.01, 0.03)."""
    g = torch.Generator().manual_seed(seed)
    P = page_size
    pages_per_seq = _cdiv(ctx, P)
    NB = B * pages_per_seq + extra_pages
    tables = torch.randperm(NB, generator=g)[:B * pages_per_seq].reshape(B, pages_per_seq).to(torch.int32)
    ctx_t = torch.full((B,), ctx, dtype=torch.int32)
    w = torch.randn(B * N, H, generator=g)

    def fp8_codes(*shape):   # magnitude codes 1..0x6F (|v| <= 120 for e4m3fn), random sign: never NaN
        mag = torch.randint(1, 0x70, shape, generator=g, dtype=torch.uint8)
        return mag | (torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7)

    if layout == "fp8_132":
        scales = torch.rand(NB, P, generator=g) * 0.02 + 0.01
        cache = torch.cat((fp8_codes(NB, P * 128), scales.view(torch.uint8).reshape(NB, P * 4)), dim=1)
        args = dict(q=fp8_codes(B, N, H, 128), kv_cache=cache, preshuffle=preshuffle, fp8_flavour=fp8_flavour)
    else:
        qp = torch.randint(0, 256, (B, N, H, 64), generator=g, dtype=torch.uint8)
        qe = torch.randint(120, 130, (B, N, H, 4), generator=g, dtype=torch.uint8)
        if layout == "packed68":
            kp = torch.randint(0, 256, (NB, P * 64), generator=g, dtype=torch.uint8)
            ke = torch.randint(120, 130, (NB, P * 4), generator=g, dtype=torch.uint8)
            args = dict(q=qp, q_scale=qe, kv_cache=torch.cat((kp, ke), dim=1))
        else:
            from ..reference.layouts import write_aiter_q_scale
            qs = torch.empty((B * N, 1, 4, 16, aiter_q_scale_pad(H)), dtype=torch.uint8)
            write_aiter_q_scale(qs, torch.arange(B * N), qe.reshape(B * N, H, 4), H)
            kv = torch.randint(0, 256, (NB, 1, 4, P, 16), generator=g, dtype=torch.uint8)
            ks = torch.randint(120, 130, (NB, 1, 4, P), generator=g, dtype=torch.uint8)
            args = dict(q=qp, q_scale=qs, kv_cache=kv, kv_cache_scale=ks)
    args.update(weights=w, context_lens=ctx_t, block_tables=tables, max_seq_len=ctx, weight_scale=128 ** -0.5)
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def bench_scorer(layout: str, B: int, N: int, H: int, ctx: int, page_size: int = 64, *, fp8_flavour: str = "e4m3fn",
                 preshuffle: bool = False, graph: bool = True, **knobs):
    """Time the Triton scorer on the current CUDA/ROCm device.

    Returns (median microseconds by triton.testing.do_bench(return_mode="median"), bytes moved, flops):
    bytes = KV rows read (B * ctx rows of 132 bytes for fp8_132, 68 for the FP4 layouts) + q + q scales
    + weights + block tables + context lengths + the fp32 logits written; flops = 2 * B * N * H * ctx * 128
    (the epilogue is not counted). Suggested cases: BENCH_CASES (decode: B=64, N=1, H=64, ctx=8192;
    long: B=1, N=4, H=64, ctx=65536). With `graph` (default) the call is captured in a CUDA graph and
    do_bench times its replay, so the ~10-15 us of Python launch cost is not counted (it would dominate a
    ~20 us decode kernel); graph=False times direct calls. do_bench clears L2 before every call, so the
    KV reads are cold. `knobs` go to the launcher (fp8_dot, block_kv, tiles_per_prog, num_warps, num_stages).
    """
    from triton.testing import do_bench
    a = make_scorer_inputs(layout, B, N, H, ctx, page_size, device="cuda", fp8_flavour=fp8_flavour,
                           preshuffle=preshuffle)
    flavour = a.pop("fp8_flavour", "e4m3fn")
    pre = a.pop("preshuffle", False)

    out = torch.empty((B * N, ctx), dtype=torch.float32, device="cuda")

    def fn():
        return paged_mqa_logits(a["q"], a["kv_cache"], a["weights"], a["context_lens"], a["block_tables"],
                                a["max_seq_len"], layout, a.get("q_scale"), a.get("kv_cache_scale"), a["weight_scale"],
                                pre, flavour, page_size, True, out, **knobs)

    fn()                                   # compile
    torch.cuda.synchronize()
    call = fn
    if graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            call = g.replay
        except Exception:                  # no graphs here: time direct calls
            torch.cuda.synchronize()
            call = fn
    ms = do_bench(call, return_mode="median")
    row = 132 if layout == "fp8_132" else 68
    nbytes = (B * ctx * row + a["q"].numel() + (a["q_scale"].numel() if "q_scale" in a else 0)
              + a["weights"].numel() * 4 + a["block_tables"].numel() * 4 + B * 4 + B * N * ctx * 4)
    flops = 2 * B * N * H * ctx * 128
    return ms * 1e3, nbytes, flops

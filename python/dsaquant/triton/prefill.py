"""Ragged prefill scoring in Triton (docs/prefill.md): `mqa_logits` (FP8, FP4, exact FP4), `mqa_topk`
(row chunks of the same kernel's logits, each selected by topk_indices) and `gather_index_cache`.

mqa_logits kernel (one kernel; the layout is a constexpr):
  * grid = (row blocks, key splits). Program (qb, sp) owns rows i0 .. i0+BQ-1 (BQ*H query rows, head
    h of row i being q row (i - i0)*H + h) and the key tiles [sp*TPP, (sp+1)*TPP) of BLOCK_KV keys.
    Only tiles that meet the union of its rows' ranges [lo, hi) are scored; with clean_logits the
    others are filled with -inf (full layout) and nothing is read for them.
  * The BQ*H query rows are loaded (and for FP4 dequantized) once per program.
  * Per tile: S[key, qrow] = tl.dot(K_tile [BLOCK_KV, 128], Q^T [128, BQ*H]) with fp32 accumulation (the key
    tile is the M side), relu, times w, summed over each row's H heads, times the fp8 k scale; stored to
    out[i, j] (full) or out[i, j - base[i]] (compressed).
  * FP8: native fp8 x fp8 dot where the device has one for the flavour (promoted to fp32 every 32
    products on sm_90), else the codes decoded exactly to bf16 (fp32 in the interpreter).
    FP4 fast mode: where the device has a native e4m3fn dot, the keys and the query rows are folded into e4m3 by
    pre-passes (_fp4_keys_e4m3_kernel, _fp4_queries_e4m3_kernel: rows whose 4 block exponents lie in [64, 190]
    within 14 of the largest are exact in e4m3 times a power of two; the query rows' powers of two go into the
    weights, the keys' are the key scales), then the FP8 kernel itself scores every tile (one fp8 dot), and
    FOLD_PASS 2 rewrites with bf16 dots the logits whose key or query row does not fold (values decoded exactly:
    SPEC §1 values times a power of two, split into the even and odd elements, two dots with K = 64; a program
    loads and decodes its query rows only when one of its rows or of the keys does not fold, so where everything
    folds the pass costs its launch). Other devices: the bf16 dots, one launch. The cuda backend runs its own
    kernel in place of the query pre-pass and the FP8 launch (after fold_keys; it folds the query rows itself).
  * FP4 exact mode: per block of 32 an integer dot of the doubled E2M1 values (int8 x int8 -> int32 on a
    GPU; in the interpreter an fp32 dot, exact because every partial sum is an integer below 2^13),
    then the same ldexp, block order, relu, weight multiply and canonical head sum as
    reference/prefill.py and src/include/dsaquant/exact_dot.h: identical bytes. Launched with
    enable_fp_fusion=False (no FMA contraction of the weight products into the head sum, SPEC §0.1).

Accuracy of the fast modes (the reference sums in another order): with
mag = sum_h |w_h| * sum_d |q_hd k_jd| (times |k_scale_j| for FP8), |triton - reference| <= 3e-5 * mag
for the bf16 / fp32 dots (tests use 1e-5 relative to the largest mag of a row); a native fp8 tensor-core
dot (FP8, and the FP4 tiles folded into e4m3) accumulates with reduced precision inside each 32-product
step: <= 1e-3 * mag (as the scorer).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import formats as F
from . import layouts as L
from .scorer import _cdiv, _device_info, _dev_index, _e2m1_value, _fp4_dequant, _fp8_decode, native_fp8_for

LAYOUT_IDS = {"fp8": 0, "fp4": 1, "fp4_exact": 2}
TOL_FAST = 3e-5
TOL_NATIVE_FP8 = 1e-3


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# ------------------------------------------------------------------------------------------------
# device helpers
# ------------------------------------------------------------------------------------------------
@triton.jit
def _twice_e2m1(c):
    """int32 nibble codes -> 2 * E2M1 value as int32 in [-12, 12]: m < 2 -> m, else (2 + (m & 1)) << (m/2 - 1)."""
    m = c & 7
    mag = tl.where(m < 2, m, (2 + (m & 1)) << tl.maximum((m >> 1) - 1, 0))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _twice_block(bytes16, R: tl.constexpr, DOT_INT: tl.constexpr):
    """uint8 [R, 16] packed bytes of one block -> its 32 doubled values [R, 32] as the dot operand (int8, or
    fp32 in the interpreter). The order (byte i's low nibble, then its high nibble) is the element order."""
    c = bytes16.to(tl.int32)
    v = tl.reshape(tl.join(_twice_e2m1(c & 15), _twice_e2m1(c >> 4)), (R, 32))
    if DOT_INT:
        return v.to(tl.int8)
    else:
        return v.to(tl.float32)


@triton.jit
def _pow2_unbiased(e):
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _exact_block_value(idot, eq, ek):
    """reference/prefill.exact_block_value: I * 2^(eq + ek - 256) rounded once; exponent 0 -> fl(I * 0),
    exponent 255 -> NaN. idot int32 [M, N]; eq [1, N] and ek [M, 1] int32."""
    e = eq + ek - 256
    ec = tl.maximum(e, -164)
    small = ec < -126
    big = ec > 127
    e1 = tl.where(small, ec + 64, tl.where(big, ec - 127, ec))
    e2 = tl.where(small, -64, tl.where(big, 127, 0))
    i = idot.to(tl.float32)
    v = (i * _pow2_unbiased(e1)) * _pow2_unbiased(e2)
    v = tl.where((eq == 0) | (ek == 0), i * 0.0, v)
    return tl.where((eq == 255) | (ek == 255), float("nan"), v)


@triton.jit
def _int_dot(a, bT, DOT_INT: tl.constexpr):
    if DOT_INT:
        return tl.dot(a, bT, out_dtype=tl.int32)
    else:
        return tl.dot(a, bT, input_precision="ieee").to(tl.int32)


@triton.jit
def _dot_any(a, bT, acc, DOT_F32: tl.constexpr):
    if DOT_F32:
        return tl.dot(a, bT, acc, input_precision="ieee")
    else:
        return tl.dot(a, bT, acc)


@triton.jit
def _operand(x, DOT_F32: tl.constexpr):
    """fp32 values exact in bf16 -> bf16 dot operand (fp32 again in the interpreter)."""
    y = x.to(tl.bfloat16)
    if DOT_F32:
        y = y.to(tl.float32)
    return y


FOLD_SHIFT = 6     # folded E2M1 values are scaled by up to 2^6 (6 * 2^6 = 384 <= 448, e4m3fn's largest)
FOLD_SPAN = 14     # a row's block exponents within 14 of its largest: the smallest value 2^(5-14) = 2^-9 is e4m3's


@triton.jit
def _fold_ok(word):
    """int32 exponent words [N] (block j in byte j) -> (row can be rescaled exactly into e4m3, largest exponent):
    every exponent in [64, 190] and within FOLD_SPAN of the largest. Then e2m1 * 2^(e_b - e_max + FOLD_SHIFT) is
    an e4m3 value (a multiple of 2^-9 of at most 2 significant bits, at most 384) and the row scale
    2^(e_max - 127 - FOLD_SHIFT) lies in [2^-69, 2^57]."""
    e0 = word & 255
    e1 = (word >> 8) & 255
    e2 = (word >> 16) & 255
    e3 = (word >> 24) & 255
    emax = tl.maximum(tl.maximum(e0, e1), tl.maximum(e2, e3))
    emin = tl.minimum(tl.minimum(e0, e1), tl.minimum(e2, e3))
    return (emin >= 64) & (emax <= 190) & (emax - emin <= 14), emax


@triton.jit
def _fp4_fold_e4m3(payload, word, emax, col):
    """payload uint8 [N, 64], words int32 [N], emax int32 [N] -> the row's 128 values e2m1 * 2^(e_b - emax + 6)
    as e4m3 [N, 128] in element order (exact where _fold_ok holds)."""
    c = payload.to(tl.int32)
    e = (word[:, None] >> ((col // 16) * 8)[None, :]) & 255
    rel = ((e - emax[:, None] + 133) << 23).to(tl.float32, bitcast=True)      # 2^(e_b - emax + 6)
    lo = (_e2m1_value(c & 15) * rel).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    hi = (_e2m1_value(c >> 4) * rel).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    n: tl.constexpr = payload.shape[0]
    return tl.reshape(tl.join(lo, hi), (n, 128)).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _fold_scale(emax):
    """The scale 2^(emax - 127 - 6) a folded row keeps (emax in [64, 190])."""
    return ((emax - 6) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fold_rows(qword, w_col, r_ok, BQ: tl.constexpr, H: tl.constexpr):
    """Which of the BQ query rows fold (BQ*H rows (i, h): exponent words, weights; r_ok: rows that exist) ->
    (the rows' largest exponents (127 where a row does not fold), weights times the rows' scales, [BQ] int32: every
    head of the query folds, its weight product a normal number or 0 (rows that do not exist count as folding))."""
    q_ok, q_emax = _fold_ok(qword)
    q_emax = tl.where(q_ok, q_emax, 127)
    w_fold = w_col * _fold_scale(q_emax)
    aw = tl.abs(w_fold)
    q_ok = q_ok & ((w_col == 0.0) | ((aw >= 1.1754943508222875e-38) & (aw < float("inf"))))
    rfold = tl.min(tl.reshape((q_ok | ~r_ok).to(tl.int32), (BQ, H)), axis=1)
    return q_emax, w_fold, rfold


@triton.jit
def _fold_query_rows(qp, qword, w_col, r_ok, BQ: tl.constexpr, H: tl.constexpr):
    """The BQ query rows (payload [BQ*H, 64] besides _fold_rows' arguments) folded into e4m3 -> (values
    [BQ*H, 128] in element order, and _fold_rows' weights and flags)."""
    q_emax, w_fold, rfold = _fold_rows(qword, w_col, r_ok, BQ, H)
    return _fp4_fold_e4m3(qp, qword, q_emax, tl.arange(0, 64)), w_fold, rfold


@triton.jit
def _fp4_keys_e4m3_kernel(k_ptr, kf_ptr, k8_ptr, ksc_ptr, kt_ptr, kall_ptr, SKV, BLOCK: tl.constexpr,
                          SUB: tl.constexpr):
    """FP4 keys -> e4m3 rows [SKV, 128] (the folded values, element order) and fp32 scales [SKV] (the row's
    _fold_scale; -1 where the key does not fold). Program p: keys p * SUB .. p * SUB + SUB - 1 (SUB divides BLOCK,
    the logits kernel's tile). kt (int32 per tile of BLOCK keys) and kall (int32) are 1 before the launch; a
    program with a key that does not fold clears its tile's kt (its logits take the bf16 dots) and kall."""
    j = tl.program_id(0) * SUB + tl.arange(0, SUB)
    j_ok = j < SKV
    krow = j.to(tl.int64)
    col = tl.arange(0, 64)
    kp = tl.load(k_ptr + krow[:, None] * 64 + col[None, :], mask=j_ok[:, None], other=0)
    kword = tl.load(kf_ptr + krow, mask=j_ok, other=0)
    ok, emax = _fold_ok(kword)
    emax = tl.where(ok, emax, 127)
    d = tl.arange(0, 128)
    tl.store(k8_ptr + krow[:, None] * 128 + d[None, :], _fp4_fold_e4m3(kp, kword, emax, col), mask=j_ok[:, None])
    tl.store(ksc_ptr + krow, tl.where(ok, _fold_scale(emax), -1.0), mask=j_ok)
    all_ok = tl.min((ok | ~j_ok).to(tl.int32), axis=0)
    if all_ok == 0:
        tl.atomic_and(kt_ptr + (tl.program_id(0) * SUB) // BLOCK, 0)
        tl.atomic_and(kall_ptr, 0)


@triton.jit
def _fp4_queries_e4m3_kernel(q_ptr, qs_ptr, w_ptr, q8_ptr, wf_ptr, kall_ptr, S, stride_w, H: tl.constexpr,
                             BI: tl.constexpr):
    """FP4 query rows -> e4m3 rows [S * H, 128] (_fold_query_rows: the folded values in element order) and fp32
    weights [S, H] times the rows' scales, the operands of the FP8 kernel. Program p: tokens p * BI .. p * BI + BI - 1
    (all their heads). kall[1] is 1 before the launch; a program with a token one of whose heads does not fold
    clears it (the second pass then rewrites that token's logits from bf16 dots)."""
    R: tl.constexpr = BI * H
    r = tl.arange(0, R)
    qi = tl.program_id(0) * BI + r // H
    h = r % H
    r_ok = qi < S
    qrow = qi.to(tl.int64) * H + h
    col = tl.arange(0, 64)
    qword = tl.load(qs_ptr + qrow, mask=r_ok, other=0)
    w_col = tl.load(w_ptr + qi.to(tl.int64) * stride_w + h, mask=r_ok, other=0.0).to(tl.float32)
    qp = tl.load(q_ptr + qrow[:, None] * 64 + col[None, :], mask=r_ok[:, None], other=0)
    q8, w_fold, rfold = _fold_query_rows(qp, qword, w_col, r_ok, BI, H)
    d = tl.arange(0, 128)
    tl.store(q8_ptr + qrow[:, None] * 128 + d[None, :], q8, mask=r_ok[:, None])
    tl.store(wf_ptr + qrow, w_fold, mask=r_ok)
    if tl.min(rfold, axis=0) == 0:
        tl.atomic_and(kall_ptr + 1, 0)


@triton.jit
def _fp4_tile_bf16(k_ptr, kf_ptr, krow, j_ok, qT0, qT1, w_col, H: tl.constexpr, BQ: tl.constexpr,
                   BLOCK_KV: tl.constexpr, DOT_F32: tl.constexpr):
    """An FP4 tile's logits [BLOCK_KV, BQ] from dots on exactly dequantized bf16 values (even and odd elements,
    K = 64 each)."""
    col = tl.arange(0, 64)
    kp = tl.load(k_ptr + krow[:, None] * 64 + col[None, :], mask=j_ok[:, None], other=0)
    kword = tl.load(kf_ptr + krow, mask=j_ok, other=0)
    k_lo, k_hi = _fp4_dequant(kp, kword, col)
    acc = _dot_any(_operand(k_lo, DOT_F32), qT0, tl.zeros((BLOCK_KV, BQ * H), tl.float32), DOT_F32)
    acc = _dot_any(_operand(k_hi, DOT_F32), qT1, acc, DOT_F32)
    v = tl.where(acc < 0, 0.0, acc) * w_col[None, :]
    return tl.sum(tl.reshape(v, (BLOCK_KV, BQ, H)), axis=2)


# ------------------------------------------------------------------------------------------------
# the logits kernel
# ------------------------------------------------------------------------------------------------
@triton.jit
def _mqa_logits_kernel(
    q_ptr, qs_ptr, k_ptr, kf_ptr, k8_ptr, ksc_ptr, kt_ptr, kall_ptr, w_ptr, lo_ptr, hi_ptr, base_ptr, out_ptr,
    S, SKV, W, tiles_per_prog, stride_w, stride_out,
    H: tl.constexpr, BQ: tl.constexpr, BLOCK_KV: tl.constexpr, LAYOUT: tl.constexpr, FP8_NATIVE: tl.constexpr,
    FNUZ: tl.constexpr, DOT_F32: tl.constexpr, DOT_INT: tl.constexpr, IMPRECISE: tl.constexpr,
    CLEAN: tl.constexpr, COMPRESSED: tl.constexpr, FILL: tl.constexpr, OUT_KIND: tl.constexpr,
    STATIC_TILES: tl.constexpr, FOLD_PASS: tl.constexpr, ROW_BLOCKS: tl.constexpr,
):
    """Program (p, sp): the blocks of BQ query rows p * ROW_BLOCKS .. p * ROW_BLOCKS + ROW_BLOCKS - 1, each against
    split sp of the key tiles (_mqa_logits_rows). Several blocks a program serve the FP4 second pass of the cuda
    backend, whose programs usually find nothing to do: fewer, longer programs."""
    todo = True
    if FOLD_PASS == 2:   # FP4 second pass: nothing to do where every key and every query row folds (the usual case)
        todo = (tl.load(kall_ptr) == 0) | (tl.load(kall_ptr + 1) == 0)
    if todo:
        for rb in range(ROW_BLOCKS):
            _mqa_logits_rows(tl.program_id(0) * ROW_BLOCKS + rb, tl.program_id(1), q_ptr, qs_ptr, k_ptr, kf_ptr,
                             k8_ptr, ksc_ptr, kt_ptr, kall_ptr, w_ptr, lo_ptr, hi_ptr, base_ptr, out_ptr, S, SKV, W,
                             tiles_per_prog, stride_w, stride_out, H, BQ, BLOCK_KV, LAYOUT, FP8_NATIVE, FNUZ, DOT_F32,
                             DOT_INT, IMPRECISE, CLEAN, COMPRESSED, FILL, OUT_KIND, STATIC_TILES, FOLD_PASS)


@triton.jit
def _mqa_logits_rows(
    qb, sp, q_ptr, qs_ptr, k_ptr, kf_ptr, k8_ptr, ksc_ptr, kt_ptr, kall_ptr, w_ptr, lo_ptr, hi_ptr, base_ptr, out_ptr,
    S, SKV, W, tiles_per_prog, stride_w, stride_out,
    H: tl.constexpr, BQ: tl.constexpr, BLOCK_KV: tl.constexpr, LAYOUT: tl.constexpr, FP8_NATIVE: tl.constexpr,
    FNUZ: tl.constexpr, DOT_F32: tl.constexpr, DOT_INT: tl.constexpr, IMPRECISE: tl.constexpr,
    CLEAN: tl.constexpr, COMPRESSED: tl.constexpr, FILL: tl.constexpr, OUT_KIND: tl.constexpr,
    STATIC_TILES: tl.constexpr, FOLD_PASS: tl.constexpr,
):
    """Query rows qb * BQ .. qb * BQ + BQ - 1 against split sp of the key tiles."""
    R: tl.constexpr = BQ * H
    i0 = qb * BQ
    # ---- the rows of this program and the union of their key ranges -----------------------------
    rows = i0 + tl.arange(0, BQ)
    row_ok = rows < S
    # The bounds as given (int32, any value): a key j in [0, SKV) is inside row i's range iff lo[i] <= j < hi[i],
    # clamped or not; only the union of the ranges, which sets the loop over the tiles, is clamped to [0, SKV].
    # Clamping each row's bounds instead measured 20 % slower for FP8 on the H100 (its registers allocated
    # otherwise) and 4 % faster for the FP4 first pass, which therefore clamps them.
    lo = tl.load(lo_ptr + rows, mask=row_ok, other=0)
    hi = tl.load(hi_ptr + rows, mask=row_ok, other=0)
    if LAYOUT == 1:
        lo = tl.minimum(tl.maximum(lo, 0), SKV)
        hi = tl.minimum(tl.maximum(hi, 0), SKV)
    base = tl.load(base_ptr + rows, mask=row_ok, other=0)
    nonempty = lo < hi
    lo_min = tl.minimum(tl.maximum(tl.min(tl.where(nonempty, lo, SKV), axis=0), 0), SKV)
    hi_max = tl.minimum(tl.maximum(tl.max(tl.where(nonempty, hi, 0), axis=0), 0), SKV)

    # ---- query rows r = (i - i0) * H + h, loaded once -------------------------------------------------
    r = tl.arange(0, R)
    qi = i0 + r // H
    h = r % H
    r_ok = qi < S
    qrow = qi.to(tl.int64) * H + h
    w_col = tl.load(w_ptr + qi.to(tl.int64) * stride_w + h, mask=r_ok, other=0.0).to(tl.float32)
    qT0 = tl.zeros((16, R), tl.float32)          # placeholders, replaced below by the layout's operands
    qT1 = tl.zeros((16, R), tl.float32)
    qT2 = tl.zeros((16, R), tl.float32)
    qT3 = tl.zeros((16, R), tl.float32)
    qe0 = tl.zeros((R,), tl.int32)
    qe1 = tl.zeros((R,), tl.int32)
    qe2 = tl.zeros((R,), tl.int32)
    qe3 = tl.zeros((R,), tl.int32)
    rfold = row_ok.to(tl.int32)
    if LAYOUT == 0:
        d = tl.arange(0, 128)
        if FP8_NATIVE:      # q_ptr and k_ptr are fp8 pointers: the tiles go to the dot without a conversion
            qT0 = tl.trans(tl.load(q_ptr + qrow[:, None] * 128 + d[None, :], mask=r_ok[:, None], other=0.0))
        else:
            qc = tl.load(q_ptr + qrow[:, None] * 128 + d[None, :], mask=r_ok[:, None], other=0)
            qT0 = tl.trans(_operand(_fp8_decode(qc, FNUZ), DOT_F32))
    elif LAYOUT == 1:
        col = tl.arange(0, 64)
        qword = tl.load(qs_ptr + qrow, mask=r_ok, other=0)
        if FOLD_PASS == 0:   # the bf16 operands (even and odd elements)
            qp = tl.load(q_ptr + qrow[:, None] * 64 + col[None, :], mask=r_ok[:, None], other=0)
            q_lo, q_hi = _fp4_dequant(qp, qword, col)
            qT0 = tl.trans(_operand(q_lo, DOT_F32))
            qT1 = tl.trans(_operand(q_hi, DOT_F32))
        else:   # only which rows fold here: the bf16 operands are built below, by programs with entries to write
            q_emax, w_fold, rfold = _fold_rows(qword, w_col, r_ok, BQ, H)
            qe1 = tl.min(rfold, axis=0)
    else:
        c16 = tl.arange(0, 16)
        qword = tl.load(qs_ptr + qrow, mask=r_ok, other=0)
        qT0 = tl.trans(_twice_block(tl.load(q_ptr + qrow[:, None] * 64 + c16[None, :], mask=r_ok[:, None], other=0),
                                    R, DOT_INT))
        qT1 = tl.trans(_twice_block(tl.load(q_ptr + qrow[:, None] * 64 + 16 + c16[None, :], mask=r_ok[:, None],
                                            other=0), R, DOT_INT))
        qT2 = tl.trans(_twice_block(tl.load(q_ptr + qrow[:, None] * 64 + 32 + c16[None, :], mask=r_ok[:, None],
                                            other=0), R, DOT_INT))
        qT3 = tl.trans(_twice_block(tl.load(q_ptr + qrow[:, None] * 64 + 48 + c16[None, :], mask=r_ok[:, None],
                                            other=0), R, DOT_INT))
        qe0 = qword & 255
        qe1 = (qword >> 8) & 255
        qe2 = (qword >> 16) & 255
        qe3 = (qword >> 24) & 255

    # ---- tiles -------------------------------------------------------------------------------------
    num_tiles = tl.cdiv(SKV, BLOCK_KV)
    t_begin = sp * tiles_per_prog
    t_end = tl.minimum(t_begin + tiles_per_prog, num_tiles)
    t_lo = tl.maximum(t_begin, lo_min // BLOCK_KV)
    t_hi = tl.minimum(t_end, tl.cdiv(hi_max, BLOCK_KV))
    if FOLD_PASS == 2:
        # the second pass (FP4 folded) has nothing to do where every key and every row of the program folds, the
        # usual case: only programs with entries to write load and decode their query rows
        t_hi = tl.where((tl.load(kall_ptr) != 0) & (qe1 != 0), t_lo, t_hi)
        if t_lo < t_hi:
            c64 = tl.arange(0, 64)
            qp2 = tl.load(q_ptr + qrow[:, None] * 64 + c64[None, :], mask=r_ok[:, None], other=0)
            q_lo2, q_hi2 = _fp4_dequant(qp2, qword, c64)
            qL = tl.trans(_operand(q_lo2, DOT_F32))
            qH = tl.trans(_operand(q_hi2, DOT_F32))
            _score_tiles(t_begin, t_lo, t_hi, qL, qH, qT2, qT3, qe0, qe1, qe2, qe3, w_col, rfold, rows, row_ok,
                         lo, hi, base, k_ptr, kf_ptr, k8_ptr, ksc_ptr, kt_ptr, out_ptr, SKV, W, stride_out, H, BQ,
                         BLOCK_KV, LAYOUT, FP8_NATIVE, FNUZ, DOT_F32, DOT_INT, IMPRECISE, CLEAN, COMPRESSED, OUT_KIND,
                         FOLD_PASS, STATIC_TILES)
    else:
        _score_tiles(t_begin, t_lo, t_hi, qT0, qT1, qT2, qT3, qe0, qe1, qe2, qe3, w_col, rfold, rows, row_ok,
                     lo, hi, base, k_ptr, kf_ptr, k8_ptr, ksc_ptr, kt_ptr, out_ptr, SKV, W, stride_out, H, BQ, BLOCK_KV,
                     LAYOUT, FP8_NATIVE, FNUZ, DOT_F32, DOT_INT, IMPRECISE, CLEAN, COMPRESSED, OUT_KIND, FOLD_PASS,
                     STATIC_TILES)
        if FILL:
            _fill_tiles(t_begin, t_lo, t_hi, t_end, rows, row_ok, out_ptr, SKV, stride_out, BQ, BLOCK_KV, OUT_KIND,
                        STATIC_TILES)


@triton.jit
def _score_tiles(t_begin, t_lo, t_hi, qT0, qT1, qT2, qT3, qe0, qe1, qe2, qe3, w_col, rfold, rows, row_ok, lo, hi,
                 base, k_ptr, kf_ptr, k8_ptr, ksc_ptr, kt_ptr, out_ptr, SKV, W, stride_out, H: tl.constexpr,
                 BQ: tl.constexpr, BLOCK_KV: tl.constexpr, LAYOUT: tl.constexpr, FP8_NATIVE: tl.constexpr,
                 FNUZ: tl.constexpr, DOT_F32: tl.constexpr, DOT_INT: tl.constexpr, IMPRECISE: tl.constexpr,
                 CLEAN: tl.constexpr, COMPRESSED: tl.constexpr, OUT_KIND: tl.constexpr, FOLD_PASS: tl.constexpr,
                 STATIC_TILES: tl.constexpr):
    """_logits_tile for the tiles [t_lo, t_hi). STATIC_TILES > 0 (the interpreter, which cannot loop over tensor
    bounds with numpy >= 2.4): a constexpr trip count over the program's tiles from t_begin, and a branch."""
    if STATIC_TILES == 0:
        for t in range(t_lo, t_hi):
            _logits_tile(t, qT0, qT1, qT2, qT3, qe0, qe1, qe2, qe3, w_col, rfold, rows, row_ok, lo, hi, base,
                         k_ptr, kf_ptr, k8_ptr, ksc_ptr, kt_ptr, out_ptr, SKV, W, stride_out, H, BQ, BLOCK_KV, LAYOUT,
                         FP8_NATIVE, FNUZ, DOT_F32, DOT_INT, IMPRECISE, CLEAN, COMPRESSED, OUT_KIND, FOLD_PASS)
    else:
        for it in range(STATIC_TILES):
            t = t_begin + it
            if (t >= t_lo) & (t < t_hi):
                _logits_tile(t, qT0, qT1, qT2, qT3, qe0, qe1, qe2, qe3, w_col, rfold, rows, row_ok, lo, hi,
                             base, k_ptr, kf_ptr, k8_ptr, ksc_ptr, kt_ptr, out_ptr, SKV, W, stride_out, H, BQ,
                             BLOCK_KV, LAYOUT, FP8_NATIVE, FNUZ, DOT_F32, DOT_INT, IMPRECISE, CLEAN, COMPRESSED,
                             OUT_KIND, FOLD_PASS)


@triton.jit
def _fill_tiles(t_begin, t_lo, t_hi, t_end, rows, row_ok, out_ptr, SKV, stride_out, BQ: tl.constexpr,
                BLOCK_KV: tl.constexpr, OUT_KIND: tl.constexpr, STATIC_TILES: tl.constexpr):
    """-inf in the program's tiles [t_begin, t_end) outside [t_lo, t_hi) (STATIC_TILES as _score_tiles)."""
    if STATIC_TILES == 0:
        for t in range(t_begin, tl.minimum(t_lo, t_end)):
            _fill_tile(t, rows, row_ok, out_ptr, SKV, stride_out, BQ, BLOCK_KV, OUT_KIND)
        for t in range(tl.maximum(t_hi, t_begin), t_end):
            _fill_tile(t, rows, row_ok, out_ptr, SKV, stride_out, BQ, BLOCK_KV, OUT_KIND)
    else:
        for it in range(STATIC_TILES):
            t = t_begin + it
            if ((t < t_lo) | (t >= t_hi)) & (t < t_end):
                _fill_tile(t, rows, row_ok, out_ptr, SKV, stride_out, BQ, BLOCK_KV, OUT_KIND)


@triton.jit
def _store(out_ptr, offs, vals, mask, OUT_KIND: tl.constexpr):
    v = F.cast_for_store(vals, OUT_KIND)
    if OUT_KIND == 1:
        tl.store(out_ptr.to(tl.pointer_type(tl.int16), bitcast=True) + offs, v, mask=mask)
    else:
        tl.store(out_ptr + offs, v, mask=mask)


@triton.jit
def _fill_tile(t, rows, row_ok, out_ptr, SKV, stride_out, BQ: tl.constexpr, BLOCK_KV: tl.constexpr,
               OUT_KIND: tl.constexpr):
    j = t * BLOCK_KV + tl.arange(0, BLOCK_KV)
    offs = rows.to(tl.int64)[None, :] * stride_out + j[:, None]
    ninf = tl.full((BLOCK_KV, BQ), float("-inf"), tl.float32)
    _store(out_ptr, offs, ninf, (j < SKV)[:, None] & row_ok[None, :], OUT_KIND)


@triton.jit
def _exact_block(k_ptr, krow, j_ok, kword, qT, qe, b: tl.constexpr, BLOCK_KV: tl.constexpr, R: tl.constexpr,
                 DOT_INT: tl.constexpr):
    c16 = tl.arange(0, 16)
    kb = tl.load(k_ptr + krow[:, None] * 64 + b * 16 + c16[None, :], mask=j_ok[:, None], other=0)
    idot = _int_dot(_twice_block(kb, BLOCK_KV, DOT_INT), qT, DOT_INT)              # [BLOCK_KV, R]
    ke = (kword >> (8 * b)) & 255
    return _exact_block_value(idot, qe[None, :], ke[:, None])


@triton.jit
def _logits_tile(t, qT0, qT1, qT2, qT3, qe0, qe1, qe2, qe3, w_col, rfold, rows, row_ok, lo, hi, base, k_ptr, kf_ptr,
                 k8_ptr, ksc_ptr, kt_ptr, out_ptr, SKV, W, stride_out, H: tl.constexpr, BQ: tl.constexpr, BLOCK_KV: tl.constexpr,
                 LAYOUT: tl.constexpr, FP8_NATIVE: tl.constexpr, FNUZ: tl.constexpr, DOT_F32: tl.constexpr,
                 DOT_INT: tl.constexpr, IMPRECISE: tl.constexpr, CLEAN: tl.constexpr, COMPRESSED: tl.constexpr,
                 OUT_KIND: tl.constexpr, FOLD_PASS: tl.constexpr):
    R: tl.constexpr = BQ * H
    j = t * BLOCK_KV + tl.arange(0, BLOCK_KV)
    j_ok = j < SKV
    krow = j.to(tl.int64)
    if LAYOUT == 0:
        d = tl.arange(0, 128)
        k_scale = tl.load(kf_ptr + krow, mask=j_ok, other=0.0)
        if FP8_NATIVE:
            kf = tl.load(k_ptr + krow[:, None] * 128 + d[None, :], mask=j_ok[:, None], other=0.0)
            acc = tl.dot(kf, qT0, max_num_imprecise_acc=IMPRECISE)
        else:
            kc = tl.load(k_ptr + krow[:, None] * 128 + d[None, :], mask=j_ok[:, None], other=0)
            acc = _dot_any(_operand(_fp8_decode(kc, FNUZ), DOT_F32), qT0, tl.zeros((BLOCK_KV, R), tl.float32),
                           DOT_F32)
        v = tl.where(acc < 0, 0.0, acc) * w_col[None, :]
        logit = tl.sum(tl.reshape(v, (BLOCK_KV, BQ, H)), axis=2) * k_scale[:, None]
    elif LAYOUT == 1:
        if FOLD_PASS == 2:
            # the FP8 kernel has scored the tile from the folded keys (ksc: their scale, -1 where a key does not
            # fold) and query rows (rfold: the rows that fold); this pass rewrites the logits whose key or row does
            # not fold (bf16 dots; a tile whose keys (kt) and rows (qe1) all fold is skipped)
            ksc = tl.load(ksc_ptr + krow, mask=j_ok, other=1.0)
            own = ~((ksc > 0.0)[:, None] & (rfold != 0)[None, :])
            if (tl.load(kt_ptr + t) != 0) & (qe1 != 0):
                logit = tl.zeros((BLOCK_KV, BQ), tl.float32)
            else:
                logit = _fp4_tile_bf16(k_ptr, kf_ptr, krow, j_ok, qT0, qT1, w_col, H, BQ, BLOCK_KV, DOT_F32)
        else:
            logit = _fp4_tile_bf16(k_ptr, kf_ptr, krow, j_ok, qT0, qT1, w_col, H, BQ, BLOCK_KV, DOT_F32)
    else:
        kword = tl.load(kf_ptr + krow, mask=j_ok, other=0)
        v0 = _exact_block(k_ptr, krow, j_ok, kword, qT0, qe0, 0, BLOCK_KV, R, DOT_INT)
        v1 = _exact_block(k_ptr, krow, j_ok, kword, qT1, qe1, 1, BLOCK_KV, R, DOT_INT)
        v2 = _exact_block(k_ptr, krow, j_ok, kword, qT2, qe2, 2, BLOCK_KV, R, DOT_INT)
        v3 = _exact_block(k_ptr, krow, j_ok, kword, qT3, qe3, 3, BLOCK_KV, R, DOT_INT)
        head = ((v0 + v1) + v2) + v3
        tv = tl.where(head < 0, 0.0, head) * w_col[None, :]                       # [BLOCK_KV, R]
        logit = tl.reshape(F.canonical_sum_row(tl.reshape(tv, (BLOCK_KV * BQ, H)), BLOCK_KV * BQ, H),
                           (BLOCK_KV, BQ))
    valid = (j[:, None] >= lo[None, :]) & (j[:, None] < hi[None, :]) & row_ok[None, :]
    r64 = rows.to(tl.int64)[None, :] * stride_out
    if FOLD_PASS == 0:
        if COMPRESSED:
            c = j[:, None] - base[None, :]
            valid = valid & (c >= 0) & (c < W)
            _store(out_ptr, r64 + c, logit, valid, OUT_KIND)
        else:
            if CLEAN:
                _store(out_ptr, r64 + j[:, None], tl.where(valid, logit, float("-inf")),
                       j_ok[:, None] & row_ok[None, :], OUT_KIND)
            else:
                _store(out_ptr, r64 + j[:, None], logit, valid, OUT_KIND)
    else:   # the entries that do not fold; -inf outside the ranges by the FP8 launch
        if COMPRESSED:
            c = j[:, None] - base[None, :]
            _store(out_ptr, r64 + c, logit, valid & own & (c >= 0) & (c < W), OUT_KIND)
        else:
            _store(out_ptr, r64 + j[:, None], logit, valid & own, OUT_KIND)


# ------------------------------------------------------------------------------------------------
# launchers
# ------------------------------------------------------------------------------------------------
def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


FOLD_CONFIG = 0                  # FP4 folded into e4m3: pass 1 runs with the fp8 kernel's configuration
FOLD_FALLBACK_LAUNCH = (8, 2)    # pass 2 (the bf16 dots of the tiles that do not fold): warps, stages


def kernel_config(layout_id: int, H: int) -> tuple[int, int, int, int]:
    """(rows per program, keys per tile, warps, stages) of the GPU launch, chosen from the sm_90 compiles of
    tests/test_triton_prefill_aot.py (no register spills at H = 64): FP8 128 query rows (rows x heads) against
    128-key tiles in 4 warps, so that two programs per SM overlap one's MMA with the other's epilogue (64 rows
    below H = 64, 8 warps at H = 128); FP4 with bf16 dots 128 x 64 in 8 warps; exact FP4 64 x 64 in 8 warps
    (its per-block epilogue holds four [keys, rows] tiles). FP4 folded into e4m3 takes FP8's (FOLD_CONFIG), its
    second pass FOLD_FALLBACK_LAUNCH's warps and stages."""
    if layout_id == 0:
        qrows, bkv, warps, stages = (128 if H >= 64 else 64), 128, (8 if H >= 128 else 4), 3
    elif layout_id == 1:
        qrows, bkv, warps, stages = 128, 64, 8, 2
    else:
        qrows, bkv, warps, stages = 64, 64, 8, 2
    return max(1, qrows // H), bkv, warps, stages


def default_config(S: int, SKV: int, H: int, layout_id: int, device: torch.device) -> dict:
    """block_q (rows per program), block_kv, tiles_per_prog, num_warps, num_stages for one problem."""
    interp = _interpreting() or device.type != "cuda"
    if interp:
        return dict(block_q=2, block_kv=16, tiles_per_prog=2, num_warps=4, num_stages=1)
    bq, bkv, warps, stages = kernel_config(layout_id, H)
    if getattr(torch.version, "hip", None):
        stages = min(stages, 2)
    num_tiles = _cdiv(SKV, bkv)
    sms = _device_info(_dev_index(device))[3]
    progs_rows = _cdiv(S, bq)
    # key splits only where the row blocks alone leave SMs idle (a split re-reads the program's q rows)
    splits = max(1, min(num_tiles, _cdiv(sms * 4, progs_rows)))
    tpp = _cdiv(num_tiles, splits)
    return dict(block_q=bq, block_kv=bkv, tiles_per_prog=tpp, num_warps=warps, num_stages=stages)


def mqa_logits(q, q_scale, k, k_scale, weights, lo, hi, base, out, layout, fp8_flavour, exact, clean_logits,
               compressed, *, fp8_dot=None, fp4_dot=None, block_q=None, block_kv=None, tiles_per_prog=None,
               num_warps=None, num_stages=None, int_dot=None, folded_keys=None, row_blocks=None):
    """The Triton backend of dsaquant.mqa_logits (the reference's positional arguments; validated by the op).
    Keyword-only tuning knobs: fp8_dot (None: native where available), fp4_dot (FP4 fast mode: "fp8" rescales
    foldable tiles into e4m3 for the fp8 dot, "bf16" always dequantizes to bf16; None: "fp8" where the device
    has a native e4m3fn dot), block_q, block_kv, tiles_per_prog, num_warps, num_stages, int_dot (exact mode:
    int8 dot; default on a GPU). folded_keys (FP4 folded, fold_keys' result): another kernel has written the
    first pass's entries (the cuda backend); only the second pass runs, on these keys. row_blocks: blocks of
    query rows a program (default 1)."""
    S, H = q.shape[0], q.shape[1]
    SKV, W = k.shape[0], out.shape[1]
    dev = q.device
    if S == 0 or W == 0:
        return out
    if compressed and clean_logits and folded_keys is None:
        out.fill_(float("-inf"))
    if SKV == 0:
        if clean_logits and not compressed:
            out.fill_(float("-inf"))
        return out
    layout_id = 2 if (layout == "fp4" and exact) else LAYOUT_IDS[layout]
    interp = _interpreting() or dev.type != "cuda"
    if fp4_dot not in (None, "fp8", "bf16"):
        raise ValueError(f"fp4_dot: expected None, 'fp8' or 'bf16', got {fp4_dot!r}")
    fp4_fp8 = layout_id == 1 and (native_fp8_for(dev, "e4m3fn") if fp4_dot is None else fp4_dot == "fp8")
    cfg = default_config(S, SKV, H, FOLD_CONFIG if fp4_fp8 else layout_id, dev)
    for name, val in (("block_q", block_q), ("block_kv", block_kv), ("tiles_per_prog", tiles_per_prog),
                      ("num_warps", num_warps), ("num_stages", num_stages)):
        if val is not None:
            cfg[name] = int(val)
    bq, bkv, tpp = cfg["block_q"], cfg["block_kv"], cfg["tiles_per_prog"]
    if bq * H < 16:
        bq = _next_pow2(_cdiv(16, H))
    fnuz = layout == "fp8" and fp8_flavour == "e4m3fnuz"
    native = layout == "fp8" and (native_fp8_for(dev, fp8_flavour or "e4m3fn") if fp8_dot is None else bool(fp8_dot))
    dot_int = (not interp) if int_dot is None else bool(int_dot)
    if layout == "fp8":
        if native:
            fp8_dtype = torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn
            q, k = q.view(fp8_dtype), k.view(fp8_dtype)
        kf, qs = k_scale, q
    else:
        kf = k_scale.contiguous().view(torch.int32).reshape(SKV)
        qs = q_scale.contiguous().view(torch.int32).reshape(S * H)
    num_tiles = _cdiv(SKV, bkv)
    k8, ksc, kt, kall = k, kf, kf, kf
    if fp4_fp8:   # the keys folded into e4m3 once (not once per row block), a flag per tile; kall: every key folds
        if folded_keys is not None and folded_keys.block != bkv:
            raise ValueError(f"folded_keys: tiles of {folded_keys.block} keys, this launch's are {bkv}")
        k8, ksc, kt, kall = folded_keys or fold_keys(k, kf, bkv)
    row_blocks = max(1, int(row_blocks or 1))
    grid = (_cdiv(_cdiv(S, bq), row_blocks), _cdiv(num_tiles, tpp))
    out_kind = 1 if out.dtype == torch.bfloat16 else 0

    def launch(q_, qs_, k_, kf_, w_, lid, fp8_native, fold_pass, warps, stages):
        if num_warps is not None or num_stages is not None:
            warps, stages = cfg["num_warps"], cfg["num_stages"]
        _mqa_logits_kernel[grid](
            q_, qs_, k_, kf_, k8, ksc, kt, kall, w_, lo, hi, base, out, S, SKV, W, tpp, w_.stride(0), out.stride(0),
            H=H, BQ=bq, BLOCK_KV=bkv, LAYOUT=lid, FP8_NATIVE=fp8_native, FNUZ=fnuz, DOT_F32=interp,
            DOT_INT=dot_int, IMPRECISE=32, CLEAN=bool(clean_logits), COMPRESSED=bool(compressed),
            FILL=bool(clean_logits and not compressed), OUT_KIND=out_kind, STATIC_TILES=tpp if interp else 0,
            FOLD_PASS=fold_pass, ROW_BLOCKS=row_blocks, num_warps=warps, num_stages=stages,
            enable_fp_fusion=lid != 2)     # exact mode: no FMA contraction (SPEC §0.1)

    if not fp4_fp8:
        launch(q, qs, k, kf, weights, layout_id, native, 0, cfg["num_warps"], cfg["num_stages"])
        return out
    if folded_keys is None:   # the query rows folded, then the FP8 kernel over every tile (the cuda backend: its own)
        q8, w_fold = fold_queries(q, qs, weights, kall)
        launch(q8, q8, k8, ksc, w_fold, LAYOUT_IDS["fp8"], True, 0, cfg["num_warps"], cfg["num_stages"])
    launch(q, qs, k, kf, weights, layout_id, False, 2, *FOLD_FALLBACK_LAUNCH)   # what does not fold
    return out


class FoldedKeys(tuple):
    """fold_keys' result: (k8 e4m3 [SKV, 128], ksc fp32 [SKV], kt int32 [tiles], kall int32 [2]) and `block`, the
    keys per tile of kt. kall[0]: every key folds; kall[1]: every query row folds, 1 until the query pre-pass
    (or the cuda backend's kernel) clears it."""
    block: int

    def __new__(cls, k8, ksc, kt, kall, block):
        t = super().__new__(cls, (k8, ksc, kt, kall))
        t.block = block
        return t


FOLD_KEYS_SUB = 32   # keys a program of the keys' pre-pass (more programs than tiles: it is bound by latency)


def fold_keys(k, kf, block: int) -> FoldedKeys:
    """FP4 keys (uint8 [SKV, 64], exponent words int32 [SKV]) folded into e4m3 (_fp4_keys_e4m3_kernel), with the
    flags of tiles of `block` keys."""
    SKV, dev = k.shape[0], k.device
    tiles = _cdiv(SKV, block)
    sub = min(FOLD_KEYS_SUB, block)
    k8 = torch.empty((SKV, 128), dtype=torch.float8_e4m3fn, device=dev)
    ksc = torch.empty((SKV,), dtype=torch.float32, device=dev)
    flags = torch.ones((tiles + 2,), dtype=torch.int32, device=dev)   # kt, then kall: one fill
    kt, kall = flags[:tiles], flags[tiles:]
    _fp4_keys_e4m3_kernel[(_cdiv(SKV, sub),)](k, kf, k8, ksc, kt, kall, SKV, BLOCK=block, SUB=sub, num_warps=2)
    return FoldedKeys(k8, ksc, kt, kall, block)


FOLD_QUERIES_ROWS = 64   # query rows (tokens x heads) a program of the query pre-pass


def fold_queries(q, qs, weights, kall):
    """FP4 query rows (uint8 [S, H, 64], exponent words int32 [S * H], weights [S, H]) folded into e4m3
    (_fp4_queries_e4m3_kernel): (e4m3 [S * H, 128], fp32 weights times the rows' scales [S, H]); kall[1] cleared
    where a token has a head that does not fold."""
    S, H, dev = q.shape[0], q.shape[1], q.device
    bi = max(1, FOLD_QUERIES_ROWS // H)
    q8 = torch.empty((S * H, 128), dtype=torch.float8_e4m3fn, device=dev)
    w_fold = torch.empty((S, H), dtype=torch.float32, device=dev)
    _fp4_queries_e4m3_kernel[(_cdiv(S, bi),)](q, qs, weights, q8, w_fold, kall, S, weights.stride(0), H=H, BI=bi,
                                              num_warps=4)
    return q8, w_fold


def fold_block(S: int, SKV: int, H: int, device) -> int:
    """Keys per tile of the folded FP4 launches on `device` (the second pass's tiles, fold_keys' block)."""
    return default_config(S, SKV, H, FOLD_CONFIG, device)["block_kv"]


TOPK_WORKSPACE_ELEMS = 1 << 26   # fp32 logits of one row chunk in mqa_topk: 256 MiB


def mqa_topk(q, q_scale, k, k_scale, weights, lo, hi, base, topk, layout, fp8_flavour, exact, *, row_chunk=None,
             **knobs):
    """The Triton backend of dsaquant.mqa_topk: rows in chunks of R whose fp32 logits [R, SKV] (mqa_logits on the
    device's fastest backend for it, this module's with tuning knobs or off a GPU; -inf outside each row's
    [lo, hi)) fill a workspace of at most TOPK_WORKSPACE_ELEMS elements (at least one row), each chunk selected
    by dsaquant.topk_indices on the device's fastest backend for it (the same positions as mqa_logits followed by
    topk_indices). Memory: the int32 [S, topk] result plus the workspace (and the selection's own scratch)."""
    from .. import dispatch

    S, SKV = q.shape[0], k.shape[0]
    dev = q.device
    R = int(row_chunk or max(1, min(S, TOPK_WORKSPACE_ELEMS // max(SKV, 1))))
    if row_chunk is None and R < S:
        R = max(8, R // 8 * 8)      # row blocks aligned as in mqa_logits (block_q <= 8): the same per-tile paths
    ws = torch.empty((min(R, S), SKV), dtype=torch.float32, device=dev)
    zeros = torch.zeros(min(R, S), dtype=torch.int32, device=dev)
    out = torch.empty((S, topk), dtype=torch.int32, device=dev)
    select = dispatch.get(dispatch.choose_for("topk_indices", dev, None, min(R, S)), "topk_indices")
    logits = mqa_logits      # on a GPU without tuning knobs: the logits of the device's fastest backend
    if dev.type == "cuda" and not knobs:
        logits = dispatch.get(dispatch.choose_for("mqa_logits", dev, None, min(R, S)), "mqa_logits")
    for r0 in range(0, S, R):
        r1 = min(S, r0 + R)
        n = r1 - r0
        qs = q_scale[r0:r1] if q_scale is not None else None
        logits(q[r0:r1], qs, k, k_scale, weights[r0:r1], lo[r0:r1], hi[r0:r1], zeros[:n], ws[:n], layout,
               fp8_flavour, exact, True, False, **knobs)
        part = out[r0:r1]
        select(ws[:n], topk, None, 1, lo[r0:r1], hi[r0:r1], False, part)
        part.sub_(torch.where(part >= 0, base[r0:r1, None].to(torch.int32), 0))
    return out


# ------------------------------------------------------------------------------------------------
# gather_index_cache
# ------------------------------------------------------------------------------------------------
@triton.jit
def _gather_kernel(kv_ptr, kvs_ptr, bt_ptr, cu_ptr, out_ptr, outs_ptr, flag_ptr, T, B, nblk, num_pages,
                   stride_bt, PAGE: tl.constexpr, LAYOUT: tl.constexpr, PRESHUFFLE: tl.constexpr,
                   BLOCK_T: tl.constexpr, SEARCH_STEPS: tl.constexpr, FLAG_CODE: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    t64 = t.to(tl.int64)
    # sequence of token t: the largest b in [0, B] with cu[b] <= t (binary search over cu[0..B])
    lo_b = tl.zeros((BLOCK_T,), tl.int32)
    hi_b = tl.full((BLOCK_T,), 0, tl.int32) + B
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo_b + hi_b + 1) // 2
        cm = tl.load(cu_ptr + mid, mask=t_ok & (lo_b < hi_b), other=0).to(tl.int64)
        go = (lo_b < hi_b) & (cm <= t64)
        lo_b = tl.where(go, mid, lo_b)
        hi_b = tl.where((lo_b < hi_b) & ~go, mid - 1, hi_b)
    b = lo_b
    cb = tl.load(cu_ptr + b, mask=t_ok, other=0).to(tl.int64)
    cb1 = tl.load(cu_ptr + b + 1, mask=t_ok & (b < B), other=0).to(tl.int64)
    p = t64 - cb
    ok = t_ok & (b < B) & (cb <= t64) & (t64 < cb1)
    blk = p // PAGE
    ok = ok & (blk < nblk)
    page = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + blk, mask=ok, other=0).to(tl.int64)
    ok = ok & (page >= 0) & (page < num_pages)
    o = p % PAGE
    page = tl.where(ok, page, 0)
    o = tl.where(ok, o, 0)
    if LAYOUT == 0:
        d = tl.arange(0, 128)
        codes = tl.load(kv_ptr + L.fp8_132_data(page, o, d, PAGE, PRESHUFFLE), mask=ok[:, None], other=0)
        tl.store(out_ptr + t64[:, None] * 128 + d[None, :], codes, mask=t_ok[:, None])
        sc = tl.load(kv_ptr.to(tl.pointer_type(tl.float32), bitcast=True) + L.fp8_132_scale(page, o, PAGE),
                     mask=ok, other=0.0)
        tl.store(outs_ptr.to(tl.pointer_type(tl.float32), bitcast=True) + t64, sc, mask=t_ok)
    else:
        col = tl.arange(0, 64)
        g = tl.arange(0, 4)
        if LAYOUT == 1:
            off = L.packed68_payload(page, o, col, PAGE)
            soff = L.packed68_exponent(page, o, g, PAGE)
            ex = tl.load(kv_ptr + soff, mask=ok[:, None], other=0)
        else:
            off = L.aiter_fp4_payload(page, o, col, PAGE)
            soff = L.aiter_fp4_exponent(page, o, PAGE)[:, None] + (g * PAGE)[None, :]
            ex = tl.load(kvs_ptr + soff, mask=ok[:, None], other=0)
        pay = tl.load(kv_ptr + off, mask=ok[:, None], other=0)
        tl.store(out_ptr + t64[:, None] * 64 + col[None, :], pay, mask=t_ok[:, None])
        tl.store(outs_ptr + t64[:, None] * 4 + g[None, :], ex, mask=t_ok[:, None])
    bad = tl.max((t_ok & ~ok).to(tl.int32), axis=0)
    if bad != 0:
        tl.atomic_or(flag_ptr, FLAG_CODE)


def gather_index_cache(kv_cache, kv_cache_scale, block_table, cu_seqlens, layout, page_size, preshuffle, out,
                       out_scale, flag, flag_code):
    """The Triton backend of dsaquant.gather_index_cache (arguments validated by the op). Tokens without a
    valid page get zeros and OR `flag_code` into `flag` (int32 [1])."""
    T = out.shape[0]
    if T == 0:
        return
    B = cu_seqlens.shape[0] - 1
    lid = {"fp8_132": 0, "packed68": 1, "aiter_fp4": 2}[layout]
    kv = kv_cache.view(torch.uint8)
    kvs = kv_cache_scale if kv_cache_scale is not None else kv
    outs = out_scale.view(torch.uint8)
    BLOCK_T = 16 if (_interpreting() or out.device.type != "cuda") else 32
    steps = max(1, int(B).bit_length())
    _gather_kernel[(_cdiv(T, BLOCK_T),)](
        kv, kvs, block_table, cu_seqlens, out.view(torch.uint8), outs, flag, T, B, block_table.shape[1],
        kv_cache.shape[0], block_table.stride(0), PAGE=int(page_size), LAYOUT=lid, PRESHUFFLE=bool(preshuffle),
        BLOCK_T=BLOCK_T, SEARCH_STEPS=steps, FLAG_CODE=int(flag_code), num_warps=4)


OPS = {"mqa_logits": mqa_logits, "mqa_topk": mqa_topk, "gather_index_cache": gather_index_cache}


# ------------------------------------------------------------------------------------------------
# AOT compilation (tests/test_triton_prefill_aot.py)
# ------------------------------------------------------------------------------------------------
def aot_compile(target, layout: str, H: int = 64, *, exact=False, fp8_native=False, fnuz=False, int_dot=True,
                fp4_fp8=False, block_q=None, block_kv=None, clean=True, compressed=False, out_bf16=False,
                w_dtype="fp32", num_warps=None, num_stages=None):
    """Compile the mqa_logits kernel for a GPUTarget without a GPU (the launcher's default block sizes unless
    given; fp4_fp8: the FP4 folded mode's second pass, the bf16 dots of what does not fold; its first pass is the
    FP8 kernel). Returns the CompiledKernel."""
    from triton.compiler import ASTSource
    lid = 2 if (layout == "fp4" and exact) else LAYOUT_IDS[layout]
    fp8 = lid == 0
    fold = bool(fp4_fp8 and lid == 1)
    bq_default, bkv_default, warps, stages = kernel_config(FOLD_CONFIG if fold else lid, H)
    if fold:
        warps, stages = FOLD_FALLBACK_LAUNCH
    bq = block_q or bq_default
    bkv = block_kv or bkv_default
    f8 = ("*fp8e4b8" if fnuz else "*fp8e4nv") if (fp8 and fp8_native) else "*u8"
    sig = {"q_ptr": f8, "qs_ptr": f8 if fp8 else "*i32", "k_ptr": f8, "kf_ptr": "*fp32" if fp8 else "*i32",
           "k8_ptr": "*fp8e4nv" if fold else f8, "ksc_ptr": "*fp32" if fold or fp8 else "*i32",
           "kt_ptr": "*i32" if fold else ("*fp32" if fp8 else "*i32"),
           "kall_ptr": "*i32" if fold else ("*fp32" if fp8 else "*i32"),
           "w_ptr": f"*{w_dtype}", "lo_ptr": "*i32", "hi_ptr": "*i32", "base_ptr": "*i32",
           "out_ptr": "*bf16" if out_bf16 else "*fp32", "S": "i32", "SKV": "i32", "W": "i32", "tiles_per_prog": "i32",
           "stride_w": "i32", "stride_out": "i32"}
    cx = dict(H=H, BQ=bq, BLOCK_KV=bkv, LAYOUT=lid, FP8_NATIVE=bool(fp8_native and fp8), FNUZ=bool(fnuz and fp8),
              DOT_F32=False, DOT_INT=bool(int_dot), IMPRECISE=32, CLEAN=bool(clean), COMPRESSED=bool(compressed),
              FILL=bool(clean and not compressed), OUT_KIND=1 if out_bf16 else 0, STATIC_TILES=0,
              FOLD_PASS=2 if fold else 0, ROW_BLOCKS=1)
    names = list(sig)
    sig.update({k: "constexpr" for k in cx})
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items() if v.startswith("*")}
    src = ASTSource(fn=_mqa_logits_kernel, signature=sig, constexprs=cx, attrs=attrs)
    opts = dict(num_warps=num_warps or warps, num_stages=num_stages or (min(stages, 2) if target.backend == "hip"
                                                                        else stages), enable_fp_fusion=lid != 2)
    return triton.compile(src, target=target, options=opts)


def aot_compile_fold(target, rows: str = "keys", H: int = 64):
    """Compile the FP4 pre-pass into e4m3 of the keys (rows="keys") or of the query rows ("queries", H heads) for a
    GPUTarget without a GPU. Returns the CompiledKernel."""
    from triton.compiler import ASTSource
    if rows == "keys":
        sig = {"k_ptr": "*u8", "kf_ptr": "*i32", "k8_ptr": "*fp8e4nv", "ksc_ptr": "*fp32", "kt_ptr": "*i32",
               "kall_ptr": "*i32", "SKV": "i32", "BLOCK": "constexpr", "SUB": "constexpr"}
        src = ASTSource(fn=_fp4_keys_e4m3_kernel, signature=sig, constexprs={"BLOCK": 128, "SUB": FOLD_KEYS_SUB},
                        attrs={(i,): [["tt.divisibility", 16]] for i in range(4)})
        return triton.compile(src, target=target, options=dict(num_warps=2))
    sig = {"q_ptr": "*u8", "qs_ptr": "*i32", "w_ptr": "*fp32", "q8_ptr": "*fp8e4nv", "wf_ptr": "*fp32",
           "kall_ptr": "*i32", "S": "i32", "stride_w": "i32", "H": "constexpr", "BI": "constexpr"}
    src = ASTSource(fn=_fp4_queries_e4m3_kernel, signature=sig,
                    constexprs={"H": H, "BI": max(1, FOLD_QUERIES_ROWS // H)},
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(6)})
    return triton.compile(src, target=target, options=dict(num_warps=4))


def aot_compile_gather(target, layout: str, page_size: int = 64, *, preshuffle=False, bt_dtype="i32", cu_dtype="i32"):
    """Compile the gather kernel for a GPUTarget without a GPU."""
    from triton.compiler import ASTSource
    sig = {"kv_ptr": "*u8", "kvs_ptr": "*u8", "bt_ptr": f"*{bt_dtype}", "cu_ptr": f"*{cu_dtype}", "out_ptr": "*u8",
           "outs_ptr": "*u8", "flag_ptr": "*i32", "T": "i32", "B": "i32", "nblk": "i32", "num_pages": "i32",
           "stride_bt": "i32"}
    cx = dict(PAGE=page_size, LAYOUT={"fp8_132": 0, "packed68": 1, "aiter_fp4": 2}[layout],
              PRESHUFFLE=bool(preshuffle), BLOCK_T=32, SEARCH_STEPS=4, FLAG_CODE=4)
    names = list(sig)
    sig.update({k: "constexpr" for k in cx})
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items() if v.startswith("*")}
    src = ASTSource(fn=_gather_kernel, signature=sig, constexprs=cx, attrs=attrs)
    return triton.compile(src, target=target, options=dict(num_warps=4, num_stages=2))

"""`topk_indices` (docs/topk.md) in Triton: a per-row radix select on order keys, then a sort of the k
selected. Byte-identical to the reference (dsaquant.reference.topk) on every input.

Kernel design (`_topk_kernel`, one program per row, or per (row, chunk) in the first of two stages):
  * Keys. Each value becomes the reference's `order_key`: a uint32 that compares like the float, 0 for
    NaN, -inf and positions outside the row's span (never selected), > 0 for every candidate.
  * Threshold. Four passes over the keys, 8 bits each from the top: a 256-bin `tl.histogram` of the
    current digit of the keys that match the digits fixed so far, then the digit d where the running
    count of larger keys crosses the number still wanted. The passes stop early once the wanted number
    equals the size of the matching bucket (all of it is taken). If the first pass counts at most k
    candidates, no further pass runs and every candidate is taken.
  * Compaction. One more pass in position order takes every key above the threshold and the first
    `wanted` keys equal to it (so ties go to the smaller positions), placed with `tl.cumsum` at a
    running offset: the selected positions land in position order.
  * Sort (final stage). The selected positions are read back, their keys recomputed from the logits,
    and `(key << 32) | (2^32 - 1 - position)` sorted descending with `tl.sort` over K_PAD (the next
    power of two of min(k, L)): value descending, position ascending. Candidates past the count
    stay 0 and become -1.
  * Long rows, few rows: stage 1 splits each row into `chunks` (at most MAX_CHUNKS) and writes each
    chunk's min(k, chunk) selected keys and positions in position order into a scratch buffer
    (padding keys 0); stage 2 runs the same select on a row's chunk candidates, in buffer order, which
    is position order, so the tie rule carries over. The global top k of a row is within the union of
    its chunks' top k because the order is total.
Spans are computed in the kernel from context_lens / ks, ke by the rule of reference.topk.row_spans.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ..reference.topk import DECODE_1D, DECODE_2D, PREFILL, span_form  # noqa: F401  (the span forms)

BLOCK = 2048                 # keys per step of a pass
MAX_SORT = 16384             # largest K_PAD the final tl.sort handles
MAX_CHUNKS = 8               # most programs per row in the two-stage form
STAGE_WHOLE, STAGE_CHUNK, STAGE_MERGE = 0, 1, 2


@triton.jit
def _order_key(x):
    """fp32 block -> uint32 order key (reference.topk.order_key), 0 for NaN and -inf."""
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.uint32, bitcast=True)
    key = tl.where((b >> 31) != 0, b ^ 0xFFFFFFFF, b | 0x80000000)
    return tl.where(x > float("-inf"), key, 0).to(tl.uint32)


@triton.jit
def _load_scalar(ptr):
    """One int element as an int64 scalar (a one-element block reduced: the interpreter gives a plain
    scalar load a shape of [1], which a loop bound cannot take)."""
    return tl.sum(tl.load(ptr + tl.arange(0, 1)).to(tl.int64), axis=0)


@triton.jit
def _row_span(row, L, ctx_ptr, ks_ptr, ke_ptr, next_n, FORM: tl.constexpr):
    """(start, end) int64 of a row, clamped: 0 <= start <= end <= L (reference.topk.row_spans)."""
    if FORM == 0:       # DECODE_1D
        b = row // next_n
        end = _load_scalar(ctx_ptr + b) - next_n + (row - b * next_n) + 1
        start = end * 0
    elif FORM == 1:     # DECODE_2D, context_lens [B, next_n] flattened
        end = _load_scalar(ctx_ptr + row)
        start = end * 0
    else:               # PREFILL
        start = _load_scalar(ks_ptr + row)
        end = _load_scalar(ke_ptr + row)
    start = tl.minimum(tl.maximum(start, 0), L)
    end = tl.maximum(tl.minimum(tl.maximum(end, 0), L), start)
    return start, end


@triton.jit
def _keys(i, n, src_ptr, seg_start, ck_ptr, ci_ptr, FROM_CANDS: tl.constexpr):
    """Keys (uint32, 0 past n) and positions (int32) of elements i of the current segment."""
    m = i < n
    if FROM_CANDS:
        key = tl.load(ck_ptr + i, mask=m, other=0).to(tl.uint32, bitcast=True)
        pos = tl.load(ci_ptr + i, mask=m, other=0)
    else:
        pos = (seg_start + i).to(tl.int32)
        x = tl.load(src_ptr + pos, mask=m, other=float("-inf")).to(tl.float32)
        key = _order_key(x)
    return tl.where(m, key, 0).to(tl.uint32), pos


@triton.jit
def _topk_kernel(logits_ptr, stride_row, L, ctx_ptr, ks_ptr, ke_ptr, next_n, k, out_ptr,
                 cand_key_ptr, cand_idx_ptr, n_chunks, chunk_len, cand_per_chunk,
                 FORM: tl.constexpr, STAGE: tl.constexpr, RELATIVE: tl.constexpr,
                 BLOCK: tl.constexpr, K_PAD: tl.constexpr, N_BOUND: tl.constexpr, K_BOUND: tl.constexpr,
                 C_BOUND: tl.constexpr):
    # N_BOUND, K_BOUND, C_BOUND: 0 on a GPU (loops run to n, k, cand_per_chunk); under the interpreter,
    # which cannot loop to a tensor bound, constant upper bounds of them (the bodies are masked by the
    # runtime values, so the extra steps change nothing)
    pid = tl.program_id(0)
    if STAGE == 1:
        row = pid // n_chunks
        chunk = pid - row * n_chunks
    else:
        row = pid
        chunk = 0
    row64 = row.to(tl.int64)
    src = logits_ptr + row64 * stride_row
    start, end = _row_span(row, L, ctx_ptr, ks_ptr, ke_ptr, next_n, FORM)
    if STAGE == 1:
        seg_start = start + chunk.to(tl.int64) * chunk_len
        n = tl.minimum(tl.maximum(end - seg_start, 0), chunk_len).to(tl.int32)
    else:
        seg_start = start
        n = (end - start).to(tl.int32)
    ck = cand_key_ptr
    ci = cand_idx_ptr
    if STAGE == 2:
        n = (n_chunks * cand_per_chunk).to(tl.int32)
        ck = cand_key_ptr + row64 * n_chunks * cand_per_chunk
        ci = cand_idx_ptr + row64 * n_chunks * cand_per_chunk
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)

    # ---- threshold: `prefix` holds the digits fixed so far, down to bit `lvl`; `want` is how many keys whose
    # bits from `lvl` up equal prefix's are still to be taken. (prefix 0, lvl 0: take every candidate.)
    prefix = tl.zeros([], dtype=tl.uint32)
    want = tl.minimum(n, k)
    lvl = n * 0
    done = n < 0
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        if not done:
            hist = tl.zeros([256], dtype=tl.int32)
            for i0 in range(0, n if N_BOUND == 0 else N_BOUND, BLOCK):
                key, pos = _keys(i0 + offs, n, src, seg_start, ck, ci, STAGE == 2)
                if p == 0:
                    match = key > 0
                else:
                    match = (key > 0) & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
                hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)
            total = tl.sum(hist, axis=0)
            cnt_gt = total - tl.cumsum(hist, axis=0)        # matching keys of a larger digit
            d = tl.max(tl.where(cnt_gt + hist >= want, bins, -1), axis=0)
            above = tl.sum(tl.where(bins == d, cnt_gt, 0), axis=0)
            in_bucket = tl.sum(tl.where(bins == d, hist, 0), axis=0)
            if p == 0:
                all_in = total <= k                           # at most k candidates: take them all
            else:
                all_in = total < 0
            new_want = want - above
            prefix = tl.where(all_in, prefix, prefix | (d.to(tl.uint32) << shift))
            lvl = tl.where(all_in, lvl, shift)
            want = tl.where(all_in, want, new_want)
            done = all_in | (new_want == in_bucket)         # the whole bucket is wanted: stop here

    # ---- compaction, in position order: keys above the threshold, and the first `want` equal to it
    if STAGE == 1:
        dst_key = cand_key_ptr + pid.to(tl.int64) * cand_per_chunk
        dst_idx = cand_idx_ptr + pid.to(tl.int64) * cand_per_chunk
    else:
        dst_key = cand_key_ptr     # unused
        dst_idx = out_ptr + row64 * k
    taken = n * 0
    eq_seen = n * 0
    lvl_u = lvl.to(tl.uint32)
    t_hi = prefix >> lvl_u
    for i0 in range(0, n if N_BOUND == 0 else N_BOUND, BLOCK):
        key, pos = _keys(i0 + offs, n, src, seg_start, ck, ci, STAGE == 2)
        hi = key >> lvl_u
        gt = (key > 0) & (hi > t_hi)
        eq = (key > 0) & (hi == t_hi)
        eq_i = eq.to(tl.int32)
        rank = eq_seen + tl.cumsum(eq_i, axis=0) - eq_i
        take = gt | (eq & (rank < want))
        take_i = take.to(tl.int32)
        slot = taken + tl.cumsum(take_i, axis=0) - take_i
        if STAGE == 1:
            tl.store(dst_key + slot, key.to(tl.int32, bitcast=True), mask=take)
        tl.store(dst_idx + slot, pos, mask=take)
        taken += tl.sum(take_i, axis=0)
        eq_seen += tl.sum(eq_i, axis=0)

    if STAGE == 1:
        # pad this chunk's candidates with key 0 (never selected)
        for j0 in range(0, cand_per_chunk if C_BOUND == 0 else C_BOUND, BLOCK):
            j = j0 + offs
            pad = (j >= taken) & (j < cand_per_chunk)
            tl.store(dst_key + j, tl.zeros([BLOCK], dtype=tl.int32), mask=pad)
            tl.store(dst_idx + j, tl.full([BLOCK], -1, dtype=tl.int32), mask=pad)
    else:
        # ---- sort the `taken` selected by (key desc, position asc); the rest of the row is -1
        tl.debug_barrier()
        j = tl.arange(0, K_PAD)
        sel = j < taken
        pos = tl.load(dst_idx + j, mask=sel, other=0, volatile=True)   # this program's stores, not a cache
        x = tl.load(src + pos, mask=sel, other=float("-inf")).to(tl.float32)
        key = _order_key(x)
        inv = (~pos).to(tl.uint32, bitcast=True)                           # 2^32 - 1 - pos
        comp = (key.to(tl.uint64) << 32) | inv.to(tl.uint64)
        comp = tl.where(sel, comp, tl.zeros_like(comp))
        comp = tl.sort(comp, 0, descending=True)
        key_s = (comp >> 32).to(tl.uint32)
        pos_s = (comp.to(tl.uint32) ^ 0xFFFFFFFF).to(tl.int32, bitcast=True)
        if RELATIVE:
            pos_s = pos_s - start.to(tl.int32)
        res = tl.where(key_s > 0, pos_s, -1)
        tl.debug_barrier()
        tl.store(dst_idx + j, res, mask=j < k)
        for j0 in range(K_PAD, k if K_BOUND == 0 else K_BOUND, BLOCK):
            jj = j0 + offs
            tl.store(dst_idx + jj, tl.full([BLOCK], -1, dtype=tl.int32), mask=jj < k)


def _num_sms(device: torch.device) -> int:
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def plan(rows: int, L: int, k: int, sms: int, chunks=None) -> int:
    """Chunks per row: 1 (one program per row) unless the rows are too few to fill the device and long
    enough (at least 4k per chunk) to split, then up to MAX_CHUNKS. `chunks` overrides."""
    if chunks is not None:
        return max(1, min(int(chunks), max(1, L)))
    if rows >= sms or L < 8 * k:
        return 1
    return max(1, min(MAX_CHUNKS, -(-2 * sms // rows), L // (4 * k)))


def topk_indices(logits, k, context_lens, next_n, ks, ke, relative, out, *, chunks=None, block=BLOCK,
                 num_warps=8):
    """The triton backend of dsaquant.topk_indices (same arguments, validated there). Keyword knobs:
    `chunks` (programs per row; None: `plan`), `block` (keys per pass step), `num_warps`."""
    rows, L = logits.shape
    if rows == 0:
        return
    if L == 0:
        out.fill_(-1)
        return
    dev = logits.device
    k_pad = triton.next_power_of_2(min(k, L))
    if k_pad > MAX_SORT:
        # the final tl.sort holds K_PAD keys in one program; beyond MAX_SORT the torch reference (same bytes)
        from ..reference.topk import topk_indices as ref
        ref(logits, k, context_lens, next_n, ks, ke, relative, out)
        return
    form = span_form(context_lens, ks)
    dummy = out
    ctx = context_lens if context_lens is not None else dummy
    ks_ = ks if ks is not None else dummy
    ke_ = ke if ke is not None else dummy
    S = plan(rows, L, k, _num_sms(dev), chunks)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    chunk_len = -(-L // S)
    per = min(k, chunk_len)
    common = dict(FORM=form, RELATIVE=bool(relative), BLOCK=block, K_PAD=k_pad, num_warps=num_warps,
                  K_BOUND=k if interp else 0, C_BOUND=per if interp else 0)
    if S == 1:
        _topk_kernel[(rows,)](logits, logits.stride(0), L, ctx, ks_, ke_, next_n, k, out, dummy, dummy,
                              1, L, 0, STAGE=STAGE_WHOLE, N_BOUND=L if interp else 0, **common)
        return
    cand_key = torch.empty((rows * S * per,), dtype=torch.int32, device=dev)
    cand_idx = torch.empty((rows * S * per,), dtype=torch.int32, device=dev)
    _topk_kernel[(rows * S,)](logits, logits.stride(0), L, ctx, ks_, ke_, next_n, k, out, cand_key, cand_idx,
                              S, chunk_len, per, STAGE=STAGE_CHUNK, N_BOUND=chunk_len if interp else 0, **common)
    _topk_kernel[(rows,)](logits, logits.stride(0), L, ctx, ks_, ke_, next_n, k, out, cand_key, cand_idx,
                          S, chunk_len, per, STAGE=STAGE_MERGE, N_BOUND=S * per if interp else 0, **common)


OPS = {"topk_indices": topk_indices}


def aot_compile(target, stage: int = STAGE_WHOLE, form: int = PREFILL, *, logits_dtype="fp32", index_dtype="i32",
                relative=False, k_pad=2048, block=BLOCK, num_warps=8):
    """Compile `_topk_kernel` for a GPUTarget without a GPU (the variant a launch on that device would
    build; scalar arguments as the launcher passes them). Returns the CompiledKernel."""
    from triton.compiler import ASTSource
    sig = {"logits_ptr": f"*{logits_dtype}", "stride_row": "i32", "L": "i32", "ctx_ptr": f"*{index_dtype}",
           "ks_ptr": f"*{index_dtype}", "ke_ptr": f"*{index_dtype}", "next_n": "i32", "k": "i32", "out_ptr": "*i32",
           "cand_key_ptr": "*i32", "cand_idx_ptr": "*i32", "n_chunks": "i32", "chunk_len": "i32",
           "cand_per_chunk": "i32"}
    names = list(sig)
    cx = dict(FORM=form, STAGE=stage, RELATIVE=bool(relative), BLOCK=block, K_PAD=k_pad, N_BOUND=0, K_BOUND=0,
              C_BOUND=0)
    sig.update({c: "constexpr" for c in cx})
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, v in sig.items() if v.startswith("*")}
    src = ASTSource(fn=_topk_kernel, signature=sig, constexprs=cx, attrs=attrs)
    return triton.compile(src, target=target, options=dict(num_warps=num_warps))

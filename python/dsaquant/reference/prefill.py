"""Ragged prefill scoring (docs/prefill.md): `mqa_logits`, the exact FP4 logit, top-k selection,
the fused `mqa_topk` and `gather_index_cache`. Reference (torch, any device).

Shapes used below: S query rows, H heads, SKV keys, W output columns (SKV, or max_seqlen_k when the
output is compressed). The op layer (dsaquant.prefill) has already validated the arguments and turned
the hostile row ranges into three int32 [S] tensors:
  lo[i] = clamp(ks[i], 0, SKV), hi[i] = clamp(ke[i], 0, SKV)    key j is valid for row i iff lo <= j < hi
(mqa_logits gets ks and ke themselves where they are int32, which saves the clamps' launches: its backends clamp
lo and hi to [0, SKV] as they read them)
  base[i]                                                        column of key j is j - base[i]
(base = ks clamped to [-W, SKV] for the compressed output, which keeps every column's key, j = ks + c, or keeps
it invalid; mqa_logits reads base for the compressed output only, the full [S, SKV] output puts key j at column
j; mqa_topk gets base = 0 for absolute positions.)
"""
from __future__ import annotations

import torch

from .arith import F32, canonical_sum, cast, from_bits
from .fp4 import e2m1_decode, fp4_dequantize, unpack_nibbles
from .fp8 import fp8_decode
from .layouts import (aiter_fp4_data_offset, aiter_fp4_scale_offset, fp8_132_data_offset, fp8_132_scale_offset,
                      packed68_payload_offset, packed68_scale_offset)

# elements per reference chunk (S x H x keys): bounds the reference's temporaries to ~2^24 fp32
CHUNK_ELEMS = 1 << 24
INVALID_KEY = -(1 << 63)       # selection key of a logit that is never selected (-inf, NaN)


# ------------------------------------------------------------------------------------------------
# the exact FP4 logit (docs/prefill.md "Exact FP4 mode"; the same order as src/include/dsaquant/exact_dot.h)
# ------------------------------------------------------------------------------------------------
def e2m1_twice(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (low nibble) -> int32 2 * value, an integer in [-12, 12] (0x8 gives 0)."""
    return (e2m1_decode(codes) * 2).to(torch.int32)


def _pow2_unbiased(e: torch.Tensor) -> torch.Tensor:
    """fp32 2^e for int32 e in [-126, 127], from bits."""
    return from_bits((e + 127) << 23)


def exact_block_value(idot: torch.Tensor, eq: torch.Tensor, ek: torch.Tensor) -> torch.Tensor:
    """One block's value: the integer block dot I = sum (2 q)(2 k) (int32, |I| < 2^13) times
    2^(eq-127) * 2^(ek-127) / 4 = I * 2^E, E = eq + ek - 256, rounded ONCE to fp32 (nearest even).

    Computed as products by powers of two of which only the last can round:
      E < -126:  fl(fl(I * 2^(E'+64)) * 2^-64) with E' = max(E, -164) (the first product is exact and
                 normal; below -164, |I * 2^E| < 2^-151 rounds to a signed zero either way)
      E > 127:   fl(fl(I * 2^(E-127)) * 2^127)   (overflow gives +-Inf)
      else:      fl(I * 2^E)
    An exponent byte 0 (scale 0, as fp4_dequantize reads it) gives fl(I * 0) (a zero with I's sign);
    an exponent byte 255 (NaN scale) gives NaN."""
    e = eq.to(torch.int32) + ek.to(torch.int32) - 256
    ec = torch.clamp_min(e, -164)
    small, big = ec < -126, ec > 127
    e1 = torch.where(small, ec + 64, torch.where(big, ec - 127, ec))
    e2 = torch.where(small, torch.full_like(ec, -64), torch.where(big, torch.full_like(ec, 127), torch.zeros_like(ec)))
    i = idot.to(F32)
    v = (i * _pow2_unbiased(e1)) * _pow2_unbiased(e2)
    zero = (eq == 0) | (ek == 0)
    v = torch.where(zero, i * 0.0, v)
    nan = (eq == 255) | (ek == 255)
    return torch.where(nan, torch.full_like(v, float("nan")), v)


def exact_head_value(vb: torch.Tensor) -> torch.Tensor:
    """[..., 4] block values -> ((b0 + b1) + b2) + b3 (fp32)."""
    return ((vb[..., 0] + vb[..., 1]) + vb[..., 2]) + vb[..., 3]


def relu_keep_nan(x: torch.Tensor) -> torch.Tensor:
    """x < 0 -> +0, else x (NaN and -0 kept)."""
    return torch.where(x < 0, torch.zeros_like(x), x)


def exact_logits_block(q2, qe, k2, ke, w):
    """Exact FP4 logits of rows x a key chunk.

    q2 int32 [S, H, 4, 32] (2 * e2m1 values per block), qe uint8 [S, H, 4]; k2 int32 [C, 4, 32], ke uint8
    [C, 4]; w fp32 [S, H]. Returns fp32 [S, C]: per head ((v0+v1)+v2)+v3, relu, fl(r * w[h]), then the
    SPEC §0.2 canonical sum over the H heads."""
    # integer block dots: float64 products and sums of integers below 2^13 are exact
    idot = torch.einsum("shbd,cbd->scbh", q2.to(torch.float64), k2.to(torch.float64)).to(torch.int32)
    v = exact_block_value(idot, qe.permute(0, 2, 1).unsqueeze(1), ke.unsqueeze(0).unsqueeze(-1))   # [S, C, 4, H]
    head = exact_head_value(v.permute(0, 1, 3, 2))                                                   # [S, C, H]
    t = relu_keep_nan(head) * w.to(F32).unsqueeze(1)
    return canonical_sum(t)


def _fp4_twice_blocks(payload: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., 64] -> int32 [..., 4, 32]."""
    c = unpack_nibbles(payload)
    return e2m1_twice(c).reshape(*payload.shape[:-1], 4, 32)


# ------------------------------------------------------------------------------------------------
# mqa_logits
# ------------------------------------------------------------------------------------------------
def _chunk_logits(q, q_scale, k, k_scale, weights, j0, j1, layout, fp8_flavour, exact):
    """fp32 logits [S, j1 - j0] of every row against keys j0 .. j1-1 (no range masking)."""
    w = weights.to(F32)
    if layout == "fp8":
        qf = fp8_decode(q, fp8_flavour)
        kf = fp8_decode(k[j0:j1], fp8_flavour)
        dots = torch.einsum("shd,cd->shc", qf, kf)
        return (relu_keep_nan(dots) * w.unsqueeze(-1)).sum(dim=1) * k_scale[j0:j1].to(F32).unsqueeze(0)
    if exact:
        return exact_logits_block(_fp4_twice_blocks(q), q_scale, _fp4_twice_blocks(k[j0:j1]), k_scale[j0:j1], w)
    qf = fp4_dequantize(q, q_scale)
    kf = fp4_dequantize(k[j0:j1], k_scale[j0:j1])
    dots = torch.einsum("shd,cd->shc", qf, kf)
    return (relu_keep_nan(dots) * w.unsqueeze(-1)).sum(dim=1)


def _chunk(S: int, H: int) -> int:
    return max(1, CHUNK_ELEMS // max(1, S * H * 4))


def mqa_logits(q, q_scale, k, k_scale, weights, lo, hi, base, out, layout, fp8_flavour, exact, clean_logits,
               compressed):
    """Fill `out` [S, W] (fp32 or bf16) with the logits of rows against their keys [lo, hi).

    layout "fp8": q uint8 [S, H, 128] codes, k uint8 [SKV, 128] codes, k_scale fp32 [SKV] (q_scale unused):
      logit = k_scale[j] * sum_h w[i, h] * relu(q[i, h] . k[j]) over decoded e4m3 values.
    layout "fp4": q uint8 [S, H, 64], q_scale uint8 [S, H, 4], k uint8 [SKV, 64], k_scale uint8 [SKV, 4]:
      logit = sum_h w[i, h] * relu(dequant(q[i, h]) . dequant(k[j])), or with `exact` the exact logit.
    Columns: key j at column j - base[i] (compressed) or j. Invalid entries are -inf with clean_logits,
    untouched otherwise. Keys whose column falls outside [0, W) are not written."""
    S, H = q.shape[0], q.shape[1]
    SKV, W = k.shape[0], out.shape[1]
    dev = q.device
    lo64, hi64, base64 = lo.to(torch.int64).clamp(0, SKV), hi.to(torch.int64).clamp(0, SKV), base.to(torch.int64)
    if compressed and clean_logits:
        out.fill_(float("-inf"))
    C = _chunk(S, H)
    for j0 in range(0, SKV, C):
        j1 = min(SKV, j0 + C)
        j = torch.arange(j0, j1, device=dev, dtype=torch.int64)
        valid = (j.unsqueeze(0) >= lo64.unsqueeze(1)) & (j.unsqueeze(0) < hi64.unsqueeze(1))
        if not compressed and not clean_logits and not bool(valid.any()):
            continue
        vals = cast(_chunk_logits(q, q_scale, k, k_scale, weights, j0, j1, layout, fp8_flavour, exact), out.dtype)
        if compressed:
            col = j.unsqueeze(0) - base64.unsqueeze(1)
            valid = valid & (col >= 0) & (col < W)
            rows = torch.arange(S, device=dev).unsqueeze(1).expand(S, j1 - j0)
            out[rows[valid], col[valid]] = vals[valid]
        elif clean_logits:
            out[:, j0:j1] = torch.where(valid, vals, torch.full_like(vals, float("-inf")))
        else:
            out[:, j0:j1] = torch.where(valid, vals, out[:, j0:j1])
    if not compressed and clean_logits and SKV < W:
        out[:, SKV:] = float("-inf")
    return out


# ------------------------------------------------------------------------------------------------
# top-k selection: value descending, ties by the smaller position, -inf and NaN never selected, -1 padding
# ------------------------------------------------------------------------------------------------
def selection_keys(vals: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Unique int64 keys whose descending order is the selection order: (value desc, position asc).

    vals float [..., n] (-0 counts as +0; -inf and NaN get INVALID_KEY); pos int64 [..., n] in [0, 2^32)."""
    v = vals.to(F32)
    v = torch.where(v == 0, torch.zeros_like(v), v)
    b = v.view(torch.int32)
    mono = torch.where(b < 0, b ^ 0x7FFFFFFF, b).to(torch.int64)          # signed, monotone in the value
    key = (mono << 32) + (0xFFFFFFFF - pos)
    bad = torch.isnan(v) | (v == float("-inf"))
    return torch.where(bad, torch.full_like(key, INVALID_KEY), key)


def keys_to_positions(keys: torch.Tensor) -> torch.Tensor:
    """int64 selection keys -> int32 positions (-1 for INVALID_KEY)."""
    pos = 0xFFFFFFFF - (keys & 0xFFFFFFFF)
    return torch.where(keys == INVALID_KEY, torch.full_like(pos, -1), pos).to(torch.int32)


def merge_topk(run_keys: torch.Tensor, keys: torch.Tensor, topk: int) -> torch.Tensor:
    """Keep the `topk` largest of the running keys [R, topk] and new keys [R, n] (int64)."""
    both = torch.cat((run_keys, keys), dim=1)
    return torch.topk(both, topk, dim=1, largest=True, sorted=True).values


def select_topk(logits: torch.Tensor, topk: int, offset: torch.Tensor | None = None) -> torch.Tensor:
    """The selection order on a whole logits matrix [R, n] -> int32 [R, topk] column indices (plus
    `offset[r]` when given), -1 where fewer than topk entries are finite or +inf."""
    R, n = logits.shape
    pos = torch.arange(n, device=logits.device, dtype=torch.int64).expand(R, n)
    keys = selection_keys(logits, pos)
    if n < topk:
        keys = torch.cat((keys, torch.full((R, topk - n), INVALID_KEY, dtype=torch.int64, device=logits.device)), 1)
    top = torch.topk(keys, topk, dim=1, largest=True, sorted=True).values
    idx = keys_to_positions(top)
    if offset is not None:
        idx = torch.where(idx >= 0, idx + offset.to(torch.int32).unsqueeze(1), idx)
    return idx


def topk_chunked(chunk_logits, S: int, SKV: int, topk: int, lo, hi, base, key_chunk: int, row_chunk: int, dev):
    """Running top-k over key chunks: `chunk_logits(r0, r1, j0, j1)` gives fp32 [r1-r0, j1-j0] logits (any
    values outside [lo, hi) are masked here). Returns int32 [S, topk] positions j - base[i] (or -1).
    Memory: the running keys S*topk*8 bytes plus one [row_chunk, key_chunk + topk] workspace."""
    out = torch.empty((S, topk), dtype=torch.int32, device=dev)
    lo64, hi64, base64 = lo.to(torch.int64), hi.to(torch.int64), base.to(torch.int64)
    for r0 in range(0, S, row_chunk):
        r1 = min(S, r0 + row_chunk)
        run = torch.full((r1 - r0, topk), INVALID_KEY, dtype=torch.int64, device=dev)
        for j0 in range(0, SKV, key_chunk):
            j1 = min(SKV, j0 + key_chunk)
            j = torch.arange(j0, j1, device=dev, dtype=torch.int64).unsqueeze(0)
            vals = chunk_logits(r0, r1, j0, j1)
            valid = (j >= lo64[r0:r1, None]) & (j < hi64[r0:r1, None])
            vals = torch.where(valid, vals, torch.full_like(vals, float("-inf")))
            run = merge_topk(run, selection_keys(vals, j.expand(r1 - r0, j1 - j0)), topk)
        pos = keys_to_positions(run)
        out[r0:r1] = torch.where(pos >= 0, pos - base64[r0:r1, None].to(torch.int32), pos)
    return out


def mqa_topk(q, q_scale, k, k_scale, weights, lo, hi, base, topk, layout, fp8_flavour, exact):
    """int32 [S, topk]: the selection of `mqa_logits` (fp32 logits of the full layout) per row, as positions
    j - base[i] (base = 0 for absolute positions). Never materialises [S, SKV]."""
    S, H, SKV = q.shape[0], q.shape[1], k.shape[0]
    C = max(64, min(SKV, _chunk(1, H) // 4))
    R = max(1, min(S, CHUNK_ELEMS // max(1, (C + topk) * H)))

    def chunk_logits(r0, r1, j0, j1):
        qs = q_scale[r0:r1] if q_scale is not None else None
        return _chunk_logits(q[r0:r1], qs, k, k_scale, weights[r0:r1], j0, j1, layout, fp8_flavour, exact)

    return topk_chunked(chunk_logits, S, SKV, topk, lo, hi, base, C, R, q.device)


# ------------------------------------------------------------------------------------------------
# gather_index_cache
# ------------------------------------------------------------------------------------------------
def gather_slots(block_table, cu_seqlens, T: int, page_size: int, num_pages: int):
    """Token t of out -> (slot int64 [T], ok bool [T]). Token t belongs to sequence b with
    cu[b] <= t < cu[b+1] (the last such b); its position p = t - cu[b] lives in page block_table[b, p // P].
    ok is False for a token in no sequence, p // P past the block table, or a page id outside [0, NB)."""
    dev = block_table.device
    t = torch.arange(T, device=dev, dtype=torch.int64)
    cu = cu_seqlens.to(torch.int64)
    B = cu.shape[0] - 1
    nblk = block_table.shape[1]
    b = torch.searchsorted(cu[1:].contiguous(), t, right=True)               # first b with cu[b+1] > t
    b_ok = b < B
    bc = torch.clamp(b, max=max(B - 1, 0))
    p = t - cu[bc]
    ok = b_ok & (p >= 0) & (cu[bc] <= t)
    blk = p // page_size
    ok = ok & (blk < nblk)
    page = block_table.to(torch.int64)[bc, torch.clamp(blk, 0, max(nblk - 1, 0))] if nblk else torch.zeros_like(t)
    ok = ok & (page >= 0) & (page < num_pages)
    slot = torch.where(ok, page * page_size + p % page_size, torch.zeros_like(t))
    return slot, ok


def gather_index_cache(kv_cache, kv_cache_scale, block_table, cu_seqlens, layout, page_size, preshuffle, out,
                       out_scale, flag, flag_code):
    """Copy the keys of the given sequences out of a paged cache (SPEC §6) into `out` / `out_scale`.

    fp8_132: out uint8 [T, 128] codes, out_scale fp32 [T]. packed68 / aiter_fp4: out uint8 [T, 64] payload,
    out_scale uint8 [T, 4] exponents (or int32 [T]). A token without a valid page gets zeros and ORs
    `flag_code` into `flag` (int32 [1], dsaquant.errors)."""
    T = out.shape[0]
    P = page_size
    num_pages = kv_cache.shape[0]
    slot, ok = gather_slots(block_table, cu_seqlens, T, P, num_pages)
    s = slot.unsqueeze(-1)
    dev = kv_cache.device
    ar = lambda n: torch.arange(n, device=dev, dtype=torch.int64)  # noqa: E731
    flat = kv_cache.contiguous().view(torch.uint8).reshape(-1)
    if layout == "fp8_132":
        codes = flat[fp8_132_data_offset(s, P, ar(128), preshuffle)]
        sb = flat[fp8_132_scale_offset(s, P) + ar(4)].contiguous().view(torch.float32).reshape(-1)
        out.view(torch.uint8).copy_(torch.where(ok.unsqueeze(-1), codes, torch.zeros_like(codes)))
        out_scale.copy_(torch.where(ok, sb, torch.zeros_like(sb)))
    else:
        if layout == "packed68":
            payload = flat[packed68_payload_offset(s, P, ar(64))]
            exps = flat[packed68_scale_offset(s, P, ar(4))]
        else:
            sflat = kv_cache_scale.contiguous().view(torch.uint8).reshape(-1)
            payload = flat[aiter_fp4_data_offset(s, P, ar(64))]
            exps = sflat[aiter_fp4_scale_offset(s, P, ar(4))]
        out.copy_(torch.where(ok.unsqueeze(-1), payload, torch.zeros_like(payload)))
        out_scale.copy_(torch.where(ok.unsqueeze(-1), exps, torch.zeros_like(exps)).view(out_scale.dtype)
                        .reshape(out_scale.shape))
    if T:
        flag.bitwise_or_((~ok).any().to(torch.int32) * flag_code)


OPS = {"mqa_logits": mqa_logits, "mqa_topk": mqa_topk, "gather_index_cache": gather_index_cache}

"""DeepGEMM's indexer-logits API on dsaquant's ops: `import dsaquant.compat.deep_gemm as deep_gemm`.

Same argument order, shapes, dtypes, defaults and semantics as DeepGEMM's public functions (docs/compat.md
has the mapping side by side); every function maps its arguments onto a dsaquant op and computes nothing
of its own. Unlike DeepGEMM these run on every backend (NVIDIA, AMD, the CPU reference), for every next_n,
H in {16, 32, 64, 128} and pages of 32, 64 or 128 slots.
"""
from __future__ import annotations

import torch

from .. import ops, prefill

# =====================================================================================================
# Ragged prefill logits: fp8_mqa_logits, fp8_fp4_mqa_logits (dsaquant.mqa_logits)
# =====================================================================================================


def _unpack_pair(name: str, pair, n_required: int):
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"{name}: expected a tuple (values, scales), got {type(pair).__name__}")
    if n_required == 2 and pair[1] is None:
        raise ValueError(f"{name}: the scales (second element) are required")
    return pair[0], pair[1]


def _packed_u8(t):
    """Packed FP4 bytes given as uint8, int8 or torch.float4_e2m1fn_x2 -> the same bytes as uint8."""
    if isinstance(t, torch.Tensor) and t.element_size() == 1 and (t.dtype == torch.int8 or "float4" in str(t.dtype)):
        return t.view(torch.uint8)
    return t


def _check_clean(clean_logits, max_seqlen_k):
    if isinstance(max_seqlen_k, int) and not isinstance(max_seqlen_k, bool) and max_seqlen_k > 0 and clean_logits:
        raise ValueError("clean_logits: DeepGEMM's compressed logits (max_seqlen_k > 0) take clean_logits=False")


def fp8_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True, max_seqlen_k=0,
                   logits_dtype=torch.float32):
    """DeepGEMM `fp8_mqa_logits`: q float8_e4m3fn [S, H, 128]; kv = (k float8_e4m3fn [SKV, 128], k scales fp32
    [SKV]); weights fp32 [S, H] (q's scale folded in); cu_seq_len_k_start / _end int32 [S]. Returns logits
    [S, SKV] (max_seqlen_k = 0) or [S, max_seqlen_k] with column c = key start + c (then clean_logits must be
    False, as in DeepGEMM), of logits_dtype (fp32 or bf16). Entries outside a row's range are -inf with
    clean_logits, unspecified without."""
    k, k_scale = _unpack_pair("kv", kv, 2)
    _check_clean(clean_logits, max_seqlen_k)
    return prefill.mqa_logits(q, k, weights, cu_seq_len_k_start, cu_seq_len_k_end, layout="fp8", k_scale=k_scale,
                              clean_logits=clean_logits, out_dtype=logits_dtype, max_seqlen_k=max_seqlen_k)


def fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True, max_seqlen_k=0,
                       logits_dtype=torch.float32):
    """DeepGEMM `fp8_fp4_mqa_logits`: q = (values, scales). With scales None it is fp8_mqa_logits. With scales
    it is the FP4 form: q packed E2M1 uint8 [S, H, 64] and its UE8M0 exponents int32 [S, H] (block j in byte
    j; uint8 [S, H, 4] accepted); kv = (k packed uint8 [SKV, 64], exponents int32 [SKV] or uint8 [SKV, 4]).
    dsaquant scores FP4 q against FP4 keys only: FP4 q with FP8 keys is rejected."""
    q_values, q_scale = _unpack_pair("q", q, 1)
    if q_scale is None:
        return fp8_mqa_logits(q_values, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits,
                              max_seqlen_k, logits_dtype)
    k, k_scale = _unpack_pair("kv", kv, 2)
    k = _packed_u8(k)
    if isinstance(k, torch.Tensor) and k.dtype != torch.uint8:
        raise TypeError(f"kv: FP4 q needs packed FP4 keys (uint8 [SKV, 64]); got keys of dtype {k.dtype}")
    _check_clean(clean_logits, max_seqlen_k)
    return prefill.mqa_logits(_packed_u8(q_values), k, weights, cu_seq_len_k_start, cu_seq_len_k_end, layout="fp4",
                              q_scale=q_scale, k_scale=k_scale, clean_logits=clean_logits, out_dtype=logits_dtype,
                              max_seqlen_k=max_seqlen_k)


# ------------------------------------------------------------------------------------------------
# paged (decode) logits
# ------------------------------------------------------------------------------------------------
SPLIT_KV = 256   # positions per unit of work in the schedule (DeepGEMM's split on sm_90 / sm_100)


def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, block_kv: int, num_sms: int) -> torch.Tensor:
    """int32 [num_sms + 1, 2] schedule: row i is the (query row, split) where processor i's share of the
    work starts, the work being every query row's context cut into SPLIT_KV-position splits and shared
    evenly; the last row is the end. context_lens int32 [B] or [B, next_n]. Computed on the device of
    context_lens without a host synchronisation (capturable in a CUDA graph). dsaquant's scorer splits
    the work itself, so fp8_paged_mqa_logits only checks this tensor's shape."""
    if not isinstance(context_lens, torch.Tensor) or context_lens.dim() not in (1, 2):
        raise ValueError("context_lens: expected an int32 tensor [B] or [B, next_n]")
    if not isinstance(block_kv, int) or block_kv <= 0:
        raise ValueError(f"block_kv: expected a positive int, got {block_kv!r}")
    if not isinstance(num_sms, int) or num_sms <= 0:
        raise ValueError(f"num_sms: expected a positive int, got {num_sms!r}")
    lens = context_lens.reshape(-1).to(torch.int64).clamp(min=0)
    splits = (lens + SPLIT_KV - 1) // SPLIT_KV                                  # per query row
    ends = torch.cumsum(splits, 0)
    firsts = torch.cat((ends.new_zeros(1), ends))                              # the first split of each row
    starts = torch.arange(num_sms + 1, device=lens.device, dtype=torch.int64) * firsts[-1:] // num_sms
    row = torch.searchsorted(ends, starts, right=True)
    return torch.stack((row, starts - firsts[row]), dim=1).to(torch.int32)


def _paged_lens(context_lens: torch.Tensor, B: int, N: int) -> torch.Tensor:
    """DeepGEMM's rule: with context_lens [B] and next_n > 1, query j of sequence b sees the positions
    < context_lens[b] - next_n + j + 1 (the later draft tokens see more); [B, next_n] is taken as it is."""
    if context_lens.dim() == 2 or N == 1:
        return context_lens
    j = torch.arange(N, device=context_lens.device, dtype=context_lens.dtype)
    return context_lens.reshape(B, 1) - N + 1 + j.reshape(1, N)


def fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                             clean_logits=False, logits_dtype=torch.float32, indices=None):
    """Logits of next_n queries per sequence against a paged index cache.

    q: FP8 e4m3 [B, next_n, H, 128], or a tuple (q, None) for FP8 or (q_packed, q_scales) for FP4 with
    q_packed [B, next_n, H, 64] (uint8 or float4_e2m1fn_x2; element 2i in the low nibble) and q_scales
    int32 [B, next_n, H] (four UE8M0 exponents, block j in byte j). kv_cache uint8 [num_blocks, block_kv,
    1, 132] (FP8: a page's block_kv * 128 codes, then block_kv fp32 scales = dsaquant's fp8_132) or
    [num_blocks, block_kv, 1, 68] (FP4: block_kv * 64 packed bytes, then block_kv int32 exponent words
    = packed68). weights fp32 [B * next_n, H]; context_lens int32 [B] or [B, next_n]; block_table int32
    [B, max_blocks]; schedule_meta from get_paged_mqa_logits_metadata. Returns logits_dtype
    [B * next_n, max_context_len]: sum_h w[h] * relu(q[h] . k[p]) inside the context; past it -inf
    with clean_logits, else left as allocated. `indices` (variable-length batches) is not supported."""
    if indices is not None:
        raise ValueError("indices: variable-length batches are not supported; pass indices=None")
    q_fp, q_sf = q if isinstance(q, tuple) else (q, None)
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 4 or kv_cache.shape[2] != 1:
        raise ValueError("kv_cache: expected uint8 [num_blocks, block_kv, 1, 132 or 68]")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache: expected a contiguous tensor (pages block_kv * row bytes apart)")
    if not isinstance(schedule_meta, torch.Tensor) or schedule_meta.dim() != 2 or schedule_meta.shape[1] != 2:
        raise ValueError("schedule_meta: expected the int32 [num_sms + 1, 2] tensor of get_paged_mqa_logits_metadata")
    NB, P, _, row = kv_cache.shape
    if not isinstance(q_fp, torch.Tensor) or q_fp.dim() != 4:
        raise ValueError("q: expected [B, next_n, H, 128] (FP8) or [B, next_n, H, 64] (FP4)")
    B, N = q_fp.shape[:2]
    lens = _paged_lens(context_lens, B, N) if isinstance(context_lens, torch.Tensor) else context_lens
    if q_sf is None:
        if row != 132:
            raise ValueError(f"kv_cache: FP8 q needs 132-byte rows (128 codes + an fp32 scale), got {row}")
        return ops.paged_mqa_logits(q_fp, kv_cache.view(NB, P * row), weights, lens, block_table, max_context_len,
                                    layout="fp8_132", clean_logits=clean_logits, logits_dtype=logits_dtype)
    if row != 68:
        raise ValueError(f"kv_cache: FP4 q needs 68-byte rows (64 packed bytes + 4 exponents), got {row}")
    return ops.paged_mqa_logits(q_fp.view(torch.uint8), kv_cache.view(NB, P * row), weights, lens, block_table,
                                max_context_len, layout="packed68", q_scale=q_sf, clean_logits=clean_logits,
                                logits_dtype=logits_dtype)


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                         clean_logits=False, indices=None):
    """DeepGEMM's FP8 form: fp8_fp4_paged_mqa_logits((q, None), ...) with fp32 logits."""
    return fp8_fp4_paged_mqa_logits((q, None), kv_cache, weights, context_lens, block_table, schedule_meta,
                                    max_context_len, clean_logits, torch.float32, indices)

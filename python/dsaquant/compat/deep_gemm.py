"""DeepGEMM's indexer logits entry points with DeepGEMM's public argument order, tuple arguments, defaults and
semantics, as thin adapters over dsaquant ops (docs/compat.md, "DeepGEMM")."""
from __future__ import annotations

import torch

from .. import prefill

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

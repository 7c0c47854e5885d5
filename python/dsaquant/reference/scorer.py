"""SPEC §7.4: the paged MQA logits scorer, reading every §6 layout. Reference (torch, fp32)."""
from __future__ import annotations

import torch

from .. import errors
from .arith import F32
from .fp4 import fp4_dequantize
from .fp8 import fp8_decode
from .layouts import read_aiter_fp4, read_aiter_q_scale, read_fp8_132, read_packed68


def dequant_q(q, layout, q_scale, fp8_flavour, H):
    """q codes [B, N, H, 128] (fp8) or [B, N, H, 64] (fp4) -> fp32 [B, N, H, 128]."""
    B, N = q.shape[:2]
    if layout == "fp8_132":
        return fp8_decode(q.view(torch.uint8), fp8_flavour)
    if layout == "packed68":
        e = q_scale.contiguous().view(torch.uint8).reshape(B, N, H, 4)
    else:  # aiter_fp4: q_scale [B*N, 1, 4, 16, qs_pad]
        e = read_aiter_q_scale(q_scale, H).reshape(B, N, H, 4)
    return fp4_dequantize(q.view(torch.uint8), e)


def dequant_k(kv_cache, kv_cache_scale, slots, layout, page_size, preshuffle, fp8_flavour):
    """Slots int64 [M] -> fp32 [M, 128] dequantized keys."""
    if layout == "fp8_132":
        codes, s = read_fp8_132(kv_cache, slots, page_size, preshuffle)
        return fp8_decode(codes, fp8_flavour) * s.unsqueeze(-1)
    if layout == "packed68":
        payload, e = read_packed68(kv_cache, slots, page_size)
    else:
        payload, e = read_aiter_fp4(kv_cache, kv_cache_scale, slots, page_size)
    return fp4_dequantize(payload, e)


def paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, max_seq_len, layout, q_scale,
                     kv_cache_scale, weight_scale, preshuffle, fp8_flavour, page_size, clean_logits, out):
    """Writes out [B*N, max_seq_len] (fp32 or bf16, rows may be strided): weight_scale * sum_h w[h] *
    relu(q[h] . k[p]) for p < the query's context length (clamped to [0, max_seq_len]), -inf past it
    (left untouched when clean_logits is False). A position inside the context whose page cannot be found
    (p // P past the block table, or a table entry outside [0, num_blocks)) is not read: its logit is -inf
    and the device error flag gets PAGE_OUT_OF_RANGE. Shapes: see dsaquant.ops.paged_mqa_logits."""
    B, N, H = q.shape[:3]
    dev = q.device
    L = int(max_seq_len)
    if B * N == 0 or L == 0:
        return
    qf = dequant_q(q, layout, q_scale, fp8_flavour, H)                      # [B, N, H, 128]
    p = torch.arange(L, device=dev, dtype=torch.int64)
    nblk = block_tables.shape[1]
    blk_idx = p // page_size
    pages = block_tables.to(torch.int64)[:, blk_idx.clamp(max=max(nblk - 1, 0))] if nblk else \
        torch.full((B, L), -1, dtype=torch.int64, device=dev)
    found = (blk_idx < nblk).unsqueeze(0) & (pages >= 0) & (pages < kv_cache.shape[0])   # [B, L]
    ctx = context_lens.to(torch.int64).reshape(B, -1).expand(B, N).clamp(0, L)            # [B, N]
    in_ctx = p.view(1, 1, L) < ctx.unsqueeze(-1)                               # [B, N, L]
    errors.flag_if(in_ctx.any(dim=1) & ~found, errors.PAGE_OUT_OF_RANGE)
    read = in_ctx.any(dim=1) & found                                           # [B, L]
    slots = torch.where(read, pages * page_size + (p % page_size), torch.zeros_like(pages))
    kf = dequant_k(kv_cache, kv_cache_scale, slots.reshape(-1), layout, page_size, preshuffle, fp8_flavour)
    kf = kf.reshape(B, L, 128)
    dots = torch.einsum("bnhd,bld->bnhl", qf, kf)                               # fp32
    w = weights.to(F32).reshape(B, N, H)
    logits = (torch.relu(dots) * w.unsqueeze(-1)).sum(dim=2) * float(weight_scale)
    ninf = torch.full_like(logits, float("-inf"))
    logits = torch.where(found.unsqueeze(1), logits, ninf)
    past = ninf if clean_logits else out.to(F32).reshape(B, N, L)           # untouched: the old values
    logits = torch.where(in_ctx, logits, past)
    out.copy_(logits.reshape(B * N, L).to(out.dtype))

"""Input builders shared by the tests, the demo, the benchmark and the GPU check script.

Each `make_*` returns a dict of keyword arguments for the op of the same name, on `device`, with
realistic values (random, never zeros) and output tensors poisoned with `POISON` so that an
unwritten byte is visible. `scale` multiplies the random inputs (1, 40, 1e-3, 1e-30 probe every
exponent range).
"""
from __future__ import annotations

import math

import torch

from .reference.layouts import aiter_q_scale_pad

POISON = 0xA5


def rope_tables(max_pos: int, device, dtype=torch.bfloat16, base: float = 10000.0):
    """(cos_cache, sin_cache) [max_pos, 32] in `dtype` and freqs [max_pos, 64] fp32 (cos, sin) pairs."""
    inv = 1.0 / (base ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    ang = torch.arange(max_pos, dtype=torch.float64).unsqueeze(1) * inv
    cos, sin = torch.cos(ang).float(), torch.sin(ang).float()
    freqs = torch.stack((cos, sin), dim=-1).reshape(max_pos, 64).to(device)
    return cos.to(dtype).to(device), sin.to(dtype).to(device), freqs


def poisoned(shape, dtype, device):
    t = torch.empty(shape, dtype=dtype, device=device)
    t.view(torch.uint8).fill_(POISON)
    return t


def clone_tensor(v: torch.Tensor) -> torch.Tensor:
    """A copy of v with its strides and storage offset, so also its data pointer's offset from the allocation's
    alignment: a view into padded or shifted storage stays one (Tensor.clone makes such a view contiguous, and so
    aligned, which would hide a kernel's unaligned paths)."""
    n = v.untyped_storage().nbytes() // v.element_size()
    whole = torch.empty(0, dtype=v.dtype, device=v.device).set_(v.untyped_storage(), 0, (n,), (1,))
    return whole.clone().as_strided(v.size(), v.stride(), v.storage_offset())


def clone_args(args: dict) -> dict:
    """The keyword arguments with every tensor copied by clone_tensor (the others as they are)."""
    return {k: (clone_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def at_offset(t: torch.Tensor, nbytes: int, pad: int = 0) -> torch.Tensor:
    """t's values in new storage at `nbytes` (a multiple of the element size) past the allocation's start (CPU and
    CUDA allocations are at least 64-byte aligned), so not 16- (or 4-) byte aligned; with `pad`, the rows of a 2-D
    t `pad` elements wider than t apart."""
    es = t.element_size()
    if nbytes % es:
        raise ValueError(f"at_offset: nbytes={nbytes} is not a multiple of the element size {es}")
    lead = nbytes // es
    if pad:
        rows, cols = t.shape
        v = torch.zeros(rows * (cols + pad) + lead, dtype=t.dtype, device=t.device)[lead:]
        v = v.view(rows, cols + pad)[:, :cols]
    else:
        v = torch.zeros(t.numel() + lead, dtype=t.dtype, device=t.device)[lead:].view(t.shape)
    v.copy_(t)
    return v


def slot_map(T: int, capacity: int, g: torch.Generator, negatives=True, device="cpu"):
    """Distinct slots in random order, with about 1/8 negative (skipped) when `negatives`; always
    includes the last slot of the cache when T >= 2."""
    T_valid = min(T, capacity)
    s = torch.randperm(capacity, generator=g)[:T_valid]
    if T_valid >= 2 and not bool((s == capacity - 1).any()):
        s[0] = capacity - 1
    s = torch.cat((s, torch.full((T - T_valid,), -1, dtype=torch.int64)))
    if negatives:
        neg = torch.rand(T, generator=g) < 0.125
        s = torch.where(neg, torch.full_like(s, -1), s)
    return s.to(device)


def make_indexer(T=64, H=64, mode="fp8", device="cpu", seed=0, scale=1.0, page_size=64, dtype=torch.bfloat16,
                 preshuffle=False, is_neox=True, scale_fmt="ue8m0", rounding="hardware", max_pos=4096,
                 compute_all_q_rope=False, pos_dtype=torch.int64, fp8_dtype=torch.float8_e4m3fn, extra_pages=1):
    """Arguments of indexer_qk_rope_quant_and_cache (SPEC §7.1) in FP8 or FP4 mode."""
    g = torch.Generator().manual_seed(seed)
    P = page_size
    NB = max(1, math.ceil(T / P) + extra_pages)
    cos, sin, _ = rope_tables(max_pos, device, dtype)
    q = (torch.randn(T, H, 128, generator=g) * scale).to(dtype).to(device)
    k = (torch.randn(T, 128, generator=g) * scale).to(dtype).to(device)
    args = dict(
        q=q, weights=torch.randn(T, H, generator=g).to(device), k=k,
        slot_mapping=slot_map(T, NB * P, g, device=device),
        norm_weight=(1 + 0.1 * torch.randn(128, generator=g)).to(device),
        norm_bias=(0.1 * torch.randn(128, generator=g)).to(device),
        positions=torch.randint(0, max_pos, (T,), generator=g).to(pos_dtype).to(device),
        cos_cache=cos, sin_cache=sin, epsilon=1e-6, weights_scale=128 ** -0.5 * 64 ** -0.5,
        preshuffle=preshuffle, is_neox=is_neox, compute_all_q_rope=compute_all_q_rope, rounding=rounding,
    )
    if mode == "fp8":
        args.update(q_out=poisoned((T, H, 128), fp8_dtype, device), weights_out=poisoned((T, H), torch.float32, device),
                    kv_cache=poisoned((NB, P * 132), torch.uint8, device), quant_block_size=128, scale_fmt=scale_fmt)
    else:
        args.update(q_out=poisoned((T, H, 64), torch.uint8, device), weights_out=poisoned((T, H), dtype, device),
                    kv_cache=poisoned((NB, 1, 4, P, 16), torch.uint8, device), quant_block_size=32, scale_fmt="ue8m0",
                    q_scale_out=poisoned((T, 1, 4, 16, aiter_q_scale_pad(H)), torch.uint8, device),
                    kv_cache_scale=poisoned((NB, 1, 4, P), torch.uint8, device))
    return args


def make_k_store(T=64, device="cpu", seed=0, scale=1.0, page_size=64, compress_ratio=1, rounding="rne",
                 max_pos=4096, dtype=torch.bfloat16):
    """Arguments of index_k_norm_rope_pack_store (SPEC §7.2)."""
    g = torch.Generator().manual_seed(seed)
    NB = max(1, math.ceil((T + 1) / page_size) + 1)
    _, _, freqs = rope_tables(max_pos, device)
    slots = slot_map(T, NB * page_size, g, device=device)
    if T >= 3:
        slots[1] = 0  # the reserved slot: must stay untouched
    return dict(k=(torch.randn(T, 128, generator=g) * scale).to(dtype).to(device),
                norm_weight=(1 + 0.1 * torch.randn(128, generator=g)).to(dtype).to(device), eps=1e-6,
                positions=torch.randint(0, max_pos, (T,), generator=g).to(device), freqs=freqs, slots=slots,
                cache=poisoned((NB, page_size * 68), torch.uint8, device), compress_ratio=compress_ratio,
                rounding=rounding)


def make_q_pack(T=64, H=64, device="cpu", seed=0, scale=1.0, rounding="rne", max_pos=4096, dtype=torch.bfloat16):
    """Arguments of index_q_rope_pack_weights (SPEC §7.2)."""
    g = torch.Generator().manual_seed(seed)
    _, _, freqs = rope_tables(max_pos, device)
    return dict(q=(torch.randn(T, H, 128, generator=g) * scale).to(dtype).to(device),
                positions=torch.randint(0, max_pos, (T,), generator=g).to(device), freqs=freqs,
                head_weights=torch.randn(T, H, generator=g).to(dtype).to(device), weight_scale=128 ** -0.5,
                rounding=rounding)


def make_v4_k(T=64, device="cpu", seed=0, scale=1.0, page_size=64, hadamard=True, rounding="hardware",
              layout="aiter_fp4", max_pos=4096, dtype=torch.bfloat16):
    """Arguments of rmsnorm_rope_rotate_fp4quant_kvcache (SPEC §7.3)."""
    g = torch.Generator().manual_seed(seed)
    cos, sin, _ = rope_tables(max_pos, device, dtype)
    if layout == "aiter_fp4":
        NB = max(1, math.ceil(T / page_size) + 1)
        cap = NB * page_size
        kv_cache = poisoned((NB, 1, 4, page_size, 16), torch.uint8, device)
        kv_scale = poisoned((NB, 1, 4, page_size), torch.uint8, device)
    else:
        cap = T + 8
        kv_cache = poisoned((cap, 64), torch.uint8, device)
        kv_scale = poisoned((cap, 4), torch.uint8, device)
    return dict(kv=(torch.randn(T, 128, generator=g) * scale).to(dtype).to(device),
                norm_weight=(1 + 0.1 * torch.randn(128, generator=g)).to(dtype).to(device), epsilon=1e-6,
                positions=torch.randint(0, max_pos, (T,), generator=g).to(device), cos_cache=cos, sin_cache=sin,
                slot_mapping=slot_map(T, cap, g, device=device), kv_cache=kv_cache, kv_cache_scale=kv_scale,
                hadamard=hadamard, rounding=rounding, layout=layout)


MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
SPECIAL_KINDS = 6


def special_rows(x: torch.Tensor, which: int = 0) -> torch.Tensor:
    """A copy of x [T, (H,) 128] whose rows 0..5 are special (kind (i + which) % 6): 0 all zero; 1 the E2M1
    midpoints and 6.0 in every block of 32 (amax 6: the scale is 1 under both UE8M0 rules); 2 NaN, +Inf and
    -Inf elements; 3 tiny (subnormal-heavy) values; 4 RoPE partners equal in both pair layouts (a*c - b*s
    cancels, which exposes an FMA); 5 a block whose amax is a power of two times 6, with negative values that
    round to zero next to it. Used by the byte-exact tests of every backend."""
    x = x.clone()
    mid = torch.tensor(MIDPOINTS + (6.0,), dtype=torch.float32)
    blk = torch.cat([mid, -mid, mid.flip(0), -mid.flip(0)])
    for i in range(min(x.shape[0], SPECIAL_KINDS)):
        kind = (i + which) % SPECIAL_KINDS
        if kind == 0:
            x[i] = 0
        elif kind == 1:
            x[i] = blk.repeat(4).to(x.device, x.dtype)
        elif kind == 2:
            for d, v in ((3, "nan"), (40, "nan"), (70, "inf"), (100, "-inf"), (33, "-inf")):
                x[i, ..., d] = float(v)
        elif kind == 3:
            x[i] = (x[i].float() * 1e-38).to(x.dtype)
        elif kind == 4:
            r = x[i].clone()
            v = r[..., 0:32].clone()
            v[..., 1::2] = v[..., 0::2]                      # interleaved head pairs (2j, 2j+1) equal
            r[..., 0:32] = v
            r[..., 32:64] = v                                # neox head pairs (j, j+32) equal
            r[..., 65:128:2] = r[..., 64:128:2]              # interleaved tail pairs equal
            x[i] = r
        else:
            v = torch.full((128,), -0.01, dtype=torch.float32)
            v[0::32] = 12.0
            v[5::32] = -0.0
            v[7::32] = 3.0
            x[i] = v.to(x.device, x.dtype)
    return x


def every_bf16_blocks(seed: int = 0) -> torch.Tensor:
    """FP4 blocks that put every finite bf16 value at many places of the E2M1 grid: bf16 [N, 32].

    The finite magnitudes, sorted, are cut into runs of 31; each run gets a 32nd element, its largest
    magnitude times 1, 2, 4, 16 or 64 (the block amax; times 64 can overflow to Inf, a NaN-scale block),
    so each value is quantized at five scales relative to its neighbours. Signs are random, positions
    within a block shuffled, and 64 blocks more carry NaN, -NaN, +Inf and -Inf among ordinary values."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.arange(0x8000, dtype=torch.int32)
    mags = (bits[(bits & 0x7F80) != 0x7F80] << 16).view(torch.float32)   # +0 .. bf16 max, ascending
    n = mags.numel() // 31 * 31
    runs = mags[:n].reshape(-1, 31)
    blocks = torch.cat([torch.cat([runs[:, -1:] * m, runs], dim=1) for m in (1.0, 2.0, 4.0, 16.0, 64.0)])
    special = blocks[torch.randint(0, blocks.shape[0], (64,), generator=g)].clone()
    for j, v in enumerate((float("nan"), -float("nan"), float("inf"), -float("inf"))):
        special[j::4, torch.randint(0, 32, (1,), generator=g)] = v
    blocks = torch.cat([blocks, special])
    sign = torch.where(torch.rand(blocks.shape, generator=g) < 0.5, -1.0, 1.0)
    perm = torch.rand(blocks.shape, generator=g).argsort(dim=1)
    return (blocks * sign).gather(1, perm).to(torch.bfloat16)


def topk_overlap(a: torch.Tensor, b: torch.Tensor, k: int) -> float:
    """Mean over rows of |topk(a) ∩ topk(b)| / k (rows of fp32 logits; -inf entries never count)."""
    k = min(k, a.shape[-1])
    ia = a.topk(k, dim=-1).indices
    ib = b.topk(k, dim=-1).indices
    hits = (ia.unsqueeze(-1) == ib.unsqueeze(-2)).any(-1).float().sum(-1)
    return float((hits / k).mean())


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two tensors over their finite entries (both finite)."""
    m = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[m].double(), b[m].double()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))


# ---- DeepSeek-V4 ops (SPEC §7.6, §7.7) ------------------------------------------------------------------
def compress_boundaries(starts, lens, ratio: int):
    """[(token index i, sequence b, position p)] of the boundary tokens ((p+1) % ratio == 0) of one call."""
    out, i = [], 0
    for b, (st, ln) in enumerate(zip(starts, lens)):
        out += [(i + j, b, st + j) for j in range(ln) if (st + j + 1) % ratio == 0]
        i += ln
    return out


def make_compress_kv(starts=(0,), lens=(64,), ratio=4, overlap=None, D=128, device="cpu", seed=0,
                     dtype=torch.bfloat16, quant_mode="none", layout="packed68", scale_rule="recip", rounding="rne",
                     scale_fmt="ue8m0", fp8_flavour="e4m3fn", fp8_cache_dtype=torch.uint8, preshuffle=False,
                     hadamard=False, bf16_after=("pool", "norm", "rope"), update_state=True, page_size=None,
                     scale=1.0, score_scale=1.0, ring_extra=3, cs_dtype=torch.bfloat16, use_freqs=False,
                     nw_dtype=torch.float32, max_pos=4096, negatives=True, extra_pages=1):
    """Keyword arguments of dsaquant.compress_kv (SPEC §7.6) for sequences b starting at position starts[b] with
    lens[b] tokens in this call (one after another in kv/score).

    The ring [B+1, K+ring_extra, C] holds random fp32 values everywhere (the rows before each start are what a
    previous call would have left; others are never read), state_slot is a random permutation. Boundary tokens
    get distinct random slots of the poisoned cache (about 1/8 negative when `negatives`: no store); the other
    tokens get junk slot ids past the capacity (never read). Cache layout by quant_mode/layout: bf16
    [NB, P, D] ("none", "fp4_sim"), u8 [NB, P*68] (fp4 packed68), u8 [NB, 1, 4, 64, 16] + [NB, 1, 4, 64]
    (fp4 aiter_fp4), `fp8_cache_dtype` [NB, P*132] (fp8). P defaults to 64 for aiter_fp4, 16 otherwise."""
    g = torch.Generator().manual_seed(seed)
    overlap = (ratio == 4) if overlap is None else overlap
    C, K = D * (2 if overlap else 1), ratio * (2 if overlap else 1)
    B, T = len(starts), sum(lens)
    kv = (torch.randn(T, C, generator=g) * scale).to(dtype).to(device)
    score = (torch.randn(T, C, generator=g) * score_scale).to(dtype).to(device)
    n_ring, R = B + 1, K + ring_extra
    bnd = compress_boundaries(starts, lens, ratio)
    aiter = quant_mode == "fp4" and layout == "aiter_fp4"
    P = page_size or (64 if aiter else 16)
    NB = max(1, math.ceil(max(len(bnd), 1) / P) + extra_pages)
    cap = NB * P
    out_slots = cap + torch.randint(0, 1 << 40, (T,), generator=g)          # junk: read only at boundaries
    perm = torch.randperm(cap, generator=g)
    neg = torch.rand(len(bnd), generator=g) < (0.125 if negatives else 0.0)
    for n, (i, _, _) in enumerate(bnd):
        out_slots[i] = -1 - n if neg[n] else perm[n]
    cache_scale = None
    if quant_mode in ("none", "fp4_sim"):
        cache = poisoned((NB, P, D), torch.bfloat16, device)
    elif aiter:
        cache = poisoned((NB, 1, 4, P, 16), torch.uint8, device)
        cache_scale = poisoned((NB, 1, 4, P), torch.uint8, device)
    elif quant_mode == "fp4":
        cache = poisoned((NB, P * 68), torch.uint8, device)
    else:
        cache = poisoned((NB, P * 132), fp8_cache_dtype, device)
    cos, sin, freqs = rope_tables(max_pos, device, cs_dtype)
    a = dict(kv=kv, score=score, ape=(torch.randn(ratio, C, generator=g) * 0.5).to(device),
             state_kv=(torch.randn(n_ring, R, C, generator=g) * scale).to(device),
             state_score=(torch.randn(n_ring, R, C, generator=g) * score_scale).to(device),
             state_slot=torch.randperm(n_ring, generator=g)[:B].to(torch.int32).to(device),
             cu_seqlens=torch.tensor([0] + [sum(lens[:b + 1]) for b in range(B)], dtype=torch.int32, device=device),
             start_pos=torch.tensor(list(starts), dtype=torch.int64, device=device),
             norm_weight=(1 + 0.1 * torch.randn(D, generator=g)).to(nw_dtype).to(device), epsilon=1e-6,
             cos_cache=None if use_freqs else cos, sin_cache=None if use_freqs else sin,
             out_slots=out_slots.to(device), cache=cache, cache_scale=cache_scale, ratio=ratio, overlap=overlap,
             quant_mode=quant_mode, hadamard=hadamard, bf16_after=tuple(bf16_after), update_state=update_state,
             freqs=freqs if use_freqs else None)
    if quant_mode == "fp4":
        a.update(layout=layout, scale_rule=scale_rule, rounding=rounding)
    elif quant_mode == "fp4_sim":
        a.update(scale_rule=scale_rule)
    elif quant_mode == "fp8":
        a.update(scale_fmt=scale_fmt, preshuffle=preshuffle)
        if fp8_cache_dtype == torch.uint8:
            a.update(fp8_flavour=fp8_flavour)
    return a


def make_rope_rotate_quant(T=8, H=16, D=128, out="fp4", device="cpu", seed=0, dtype=torch.bfloat16,
                           cs_dtype=None, group_size=None, shuffle_scale=True, hadamard=True, rounding="hardware",
                           max_pos=4096, scale=2.0, pos_dtype=torch.int64):
    """Keyword arguments of dsaquant.rope_rotate_quant (SPEC §7.7). out: "fp4" (uint8 [T, H, D/2]), "fp4x2"
    (float4_e2m1fn_x2), "e4m3fn" / "e4m3fnuz" (float8 [T, H, D]) or "half" (x's dtype [T, H, D]), poisoned;
    out_scale poisoned in the layout the output needs (shuffled needs H % 16 == 0)."""
    g = torch.Generator().manual_seed(seed)
    cos, sin, _ = rope_tables(max_pos, device, cs_dtype or dtype)
    x = (torch.randn(T, H, D, generator=g) * scale).to(dtype).to(device)
    a = dict(x=x, cos_cache=cos, sin_cache=sin,
             positions=torch.randint(0, max_pos, (T,), generator=g).to(pos_dtype).to(device),
             shuffle_scale=shuffle_scale, hadamard=hadamard, rounding=rounding)
    if group_size is not None:
        a["group_size"] = group_size
    if out in ("fp4", "fp4x2"):
        o = poisoned((T, H, D // 2), torch.uint8, device)
        a["out"] = o.view(torch.float4_e2m1fn_x2) if out == "fp4x2" else o
        a["out_scale"] = (poisoned((T, D // 128, 4, 16, aiter_q_scale_pad(H)), torch.uint8, device) if shuffle_scale
                          else poisoned((T, H, D // (group_size or 32)), torch.uint8, device))
    elif out in ("e4m3fn", "e4m3fnuz"):
        a["out"] = poisoned((T, H, D), getattr(torch, f"float8_{out}"), device)
        a["out_scale"] = poisoned((T, H, D // (group_size or 128)), torch.float32, device)
    else:
        a["out"] = poisoned((T, H, D), dtype, device)
    return a


def compress_special_values(a: dict, n0: int) -> dict:
    """make_compress_kv arguments with special values (SPEC §7.6 pool edge cases): in the first n0 tokens
    (sequence 0) a NaN, a +Inf and a -Inf score, an infinite and a NaN value and a column of -inf scores
    (windows inside those inputs pool to NaN, so these rows come out NaN); in the other tokens a single -inf
    score with a finite value (weight 0), scores spread by 1e4 (exp_ds underflows to subnormals and zero),
    a column of +Inf values and a NaN value next to a -inf score; tiny values in one column everywhere; -inf
    and NaN scores in ring columns."""
    kv, sc = a["kv"].float().clone(), a["score"].float().clone()
    T = kv.shape[0]
    if n0 >= 4:
        sc[0, 3] = float("nan")
        sc[1, 5] = float("inf")
        sc[2, 7] = float("-inf")
        kv[2, 7] = float("inf")
        sc[:n0, 9] = float("-inf")
        kv[3, 13] = float("nan")
    if T > n0 + 1:
        sc[n0 + 1, 17] = float("-inf")
        sc[n0:, 19] = sc[n0:, 19] * 1e4
        kv[n0:, 21] = float("inf")
        sc[T - 1, 23] = float("-inf")
        kv[T - 1, 23] = float("nan")
    kv[:, 25] = kv[:, 25] * 1e-38
    ss = a["state_score"].clone()
    ss[:, :, 27] = float("-inf")
    ss[:, 1, 29] = float("nan")
    return dict(a, kv=kv.to(a["kv"].dtype), score=sc.to(a["score"].dtype), state_score=ss)


def run_scorer(fn, *args, clean_logits=True, logits_dtype=None, **knobs):
    """Call a backend's paged_mqa_logits `fn` with the reference's 13 leading positional arguments (q ...
    page_size) into a fresh [B*N, max_seq_len] output (fp32 unless `logits_dtype`), and return it."""
    import torch
    q, max_seq_len = args[0], args[5]
    out = torch.empty((q.shape[0] * q.shape[1], max_seq_len), dtype=logits_dtype or torch.float32, device=q.device)
    fn(*args, clean_logits, out, **knobs)
    return out


def scorer_magnitude(args):
    """|weight_scale| * sum_h |w_h| * sum_d |q_hd k_pd| per logit: the reference scorer on sign-cleared codes,
    |scales| and |w|, for the reference's 13 leading positional arguments `args` (the scale of a scorer's
    summation error)."""
    from .reference.scorer import paged_mqa_logits as ref_scorer
    q, kv, w, ctx, tables, L, layout, qs, ks, ws, pre, flavour, P = args
    qa = q.view(torch.uint8)
    kva = kv.view(torch.uint8).clone()
    if layout == "fp8_132":
        qa = qa & 0x7F
        kva[:, :P * 128] &= 0x7F
        kva[:, P * 128:] = kva[:, P * 128:].contiguous().view(torch.float32).abs().view(torch.uint8)
    else:
        qa = qa & 0x77
        if layout == "packed68":
            kva[:, :P * 64] &= 0x77
        else:
            kva &= 0x77
    return run_scorer(ref_scorer, qa, kva, w.abs(), ctx, tables, L, layout, qs, ks, abs(ws), pre, flavour, P)


def scorer_nan_inputs(a: dict, layout: str) -> dict:
    """make_scorer_inputs' `a` (B >= 2, N = 1, H = 64, pages of 64, contexts >= 70) with NaN inputs, in place: in
    sequence 0 a NaN at position 64 + 5 (fp8_132: a NaN code; FP4: a NaN block scale), in sequence 1 a q head with a
    NaN code (fp8_132) or a NaN block scale (FP4). Returns a."""
    kv = a["kv_cache"]
    page = int(a["block_tables"][0, 1])
    if layout == "fp8_132":
        kv[page, 5 * 128 + 3] = 0x7F
        a["q"][1, 0, 7, 9] = 0xFF
    elif layout == "packed68":
        kv[page, 64 * 64 + 4 * 5 + 2] = 255
        a["q_scale"][1, 0, 7, 1] = 255
    else:
        a["kv_cache_scale"][page, 0, 1, (5 % 16) * 4 + 5 // 16] = 255
        a["q_scale"][1, 0, 2, 7, 0] = 255
    return a


def scorer_hostile_tables(a: dict) -> dict:
    """make_scorer_inputs' `a` (B = 5, N = 2, context 640, pages of 64) made hostile, in place: page ids outside
    [0, num_blocks), a table of 8 pages (512 positions) and context lengths past max_seq_len, past the table, negative
    and zero ([B, N] int32). Returns a."""
    NB = a["kv_cache"].shape[0]
    bt = a["block_tables"]
    bt[0, 1] = -3
    bt[1, 2] = NB
    bt[2, 0] = NB + 1000
    a["block_tables"] = bt[:, :8].contiguous()
    a["context_lens"] = torch.tensor([[640, 300], [5000, 100], [-4, 64], [600, 0], [513, 512]], dtype=torch.int32,
                                     device=bt.device)
    return a


def triton_aot_missing(kind: str) -> str:
    """'' if this Triton can compile ahead of time for `kind` ("cuda" or "hip"), else why not (a skip reason)."""
    import triton
    try:
        from triton.backends import backends
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except Exception as e:  # pragma: no cover
        return f"this triton ({triton.__version__}) cannot compile ahead of time: {e}"
    name = "nvidia" if kind == "cuda" else "amd"
    return "" if name in backends else f"this triton ({triton.__version__}) has no {name} backend"


# Ahead-of-time compile targets of the Triton tests: name -> (backend, arch, warp size, native fp8 flavour).
AOT_TARGETS = {
    "sm_90": ("cuda", 90, 32, "e4m3fn"),
    "sm_100": ("cuda", 100, 32, "e4m3fn"),
    "gfx942": ("hip", "gfx942", 64, "e4m3fnuz"),
    "gfx950": ("hip", "gfx950", 64, "e4m3fn"),
}


def triton_jit_module(name: str, kernel: str):
    """dsaquant.triton.<name> for an AOT test, skipping (pytest) where its `kernel` is not a JIT function
    (TRITON_INTERPRET=1 in this process, now or when dsaquant.triton was first imported)."""
    import importlib
    import os

    import pytest
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: kernels are interpreted functions, nothing to compile")
    from triton.runtime.jit import JITFunction
    mod = importlib.import_module(f"dsaquant.triton.{name}")
    if not isinstance(getattr(mod, kernel), JITFunction):
        pytest.skip("dsaquant.triton was imported under TRITON_INTERPRET=1 in this process: no JIT kernels")
    return mod

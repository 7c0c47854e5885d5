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

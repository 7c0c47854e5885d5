"""SPEC §7.6 (the DeepSeek-V4 compressor, `compress_kv`) and §7.7 (query-side RoPE + rotate + quant,
`rope_rotate_quant`), as torch reference implementations.

Like reference/ops.py, these functions assume validated arguments (dsaquant.compress checks them first), run on
any device, and build every arithmetic step from the §0-§6 helpers. Slots at or past a cache's capacity, and
ring slots outside the ring, are skipped and raise the device error flag SLOT_OUT_OF_RANGE (errors.py).
"""
from __future__ import annotations

import torch

from .. import errors
from .arith import F32, canon_nan, canonical_sum, cast, div, exp_ds, f32_from_bits, nan_amax, nan_max, pow2, round_to
from .fp4 import _grid_rne_value, fp4_fake_quant, fp4_quantize, ue8m0_exponent
from .fp8 import FLAVOURS, fp8_encode, fp8_quantize
from .layouts import write_aiter_fp4, write_aiter_q_scale, write_fp8_132, write_packed68
from .ops import _valid_slots
from .transforms import cos_sin, hadamard, rms_norm, rope

BF16 = torch.bfloat16
ROUNDING_POINTS = ("pool", "norm", "rope", "hadamard")
QUANT_MODES = ("none", "fp4", "fp4_sim", "fp8")
_ROW = 128  # RoPE acts on the tail 64 dims of the last 128-wide row


# ------------------------------------------------------------------------------------------------
# pieces shared by §7.6 and §7.7
# ------------------------------------------------------------------------------------------------
def rope_tail_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """§5 RoPE with interleaved pairs on the last 64 dims of rows of any width D >= 128 (fp32, not rounded)."""
    D = x.shape[-1]
    if D == _ROW:
        return rope(x, cos, sin, neox=False, tail=True)
    return torch.cat((x[..., :D - _ROW].to(F32), rope(x[..., D - _ROW:], cos, sin, neox=False, tail=True)), dim=-1)


def pool(sig: torch.Tensor, kv: torch.Tensor, included: torch.Tensor) -> torch.Tensor:
    """§7.6 step 2, for each column independently. sig, kv fp32 [..., K] (the window on the last dim, K = 4*2^j);
    included bool broadcastable to them. Returns fp32 [...]:
    m = NaN-ignoring max of the included sig; e_k = exp_ds(fl(sig_k - m)) (+0 if excluded); S = canonical sum
    of e; w_k = fl(e_k / S); y = canonical sum of fl(w_k * kv_k) (kv = +0 if excluded). A window whose included
    scores are all -inf, or hold a +inf or a NaN, gives NaN."""
    sig, kv = sig.to(F32), kv.to(F32)
    included = included.expand(sig.shape)
    nan = torch.full_like(sig, float("nan"))
    m = nan_max(torch.where(included, sig, nan), -1)
    e = torch.where(included, exp_ds(sig - m.unsqueeze(-1)), torch.zeros_like(sig))
    S = canonical_sum(e)
    w = e / S.unsqueeze(-1)                                    # true division, tensor by tensor
    y = canonical_sum(w * torch.where(included, kv, torch.zeros_like(kv)))
    all_neg_inf = (~included | (sig == float("-inf"))).all(-1)
    poisoned = (included & (torch.isnan(sig) | (sig == float("inf")))).any(-1)
    return torch.where(all_neg_inf | poisoned, torch.full_like(y, float("nan")), y)


def fp4_stage1(x: torch.Tensor, rule: str) -> torch.Tensor:
    """§7.2 stage 1 (the dequantized fake-quant, rounded to bf16) with the §3 exponent rule `rule`, blocks of 32.
    `recip` is fp4_fake_quant itself; `pack` only swaps the exponent rule. Returns bf16."""
    if rule == "recip":
        return fp4_fake_quant(x.to(F32), 32, "ue8m0", out_dtype=BF16)
    xb = canon_nan(x).reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    s = pow2(ue8m0_exponent(nan_amax(xb, -1), rule)).unsqueeze(-1)
    y = torch.clamp(xb / s, -6.0, 6.0)
    r = _grid_rne_value(y.abs())
    q = torch.where(y < 0, -r, r)
    q = torch.where(torch.isnan(y), y, q)
    return cast(q * s, BF16).reshape(x.shape)


def _bf16_if(y: torch.Tensor, point: str, bf16_after) -> torch.Tensor:
    return round_to(y, BF16) if point in bf16_after else y


# ------------------------------------------------------------------------------------------------
# §7.6 compress_kv
# ------------------------------------------------------------------------------------------------
def _token_map(cu_seqlens: torch.Tensor, start_pos: torch.Tensor, T: int):
    """Per token: (valid, sequence b, position p_i). cu_seqlens is clamped into [0, T] and made monotone (a
    malformed one is caught only by the opt-in host check; here it just never reads or writes out of bounds).
    Tokens outside [cu[0], cu[B]) and tokens at negative positions are invalid (neither compressed nor stored)."""
    dev = cu_seqlens.device
    cu = torch.cummax(cu_seqlens.to(torch.int64).clamp(0, T), 0).values
    B = cu.numel() - 1
    tok = torch.arange(T, device=dev, dtype=torch.int64)
    seq = torch.searchsorted(cu[1:].contiguous(), tok, right=True)
    valid = (seq < B) & (tok >= cu[0])
    b = seq.clamp(max=max(B - 1, 0))
    p = start_pos.to(torch.int64)[b] + (tok - cu[b])
    return valid & (p >= 0), b, p, cu[1:] - cu[:-1]


def compress_kv(kv, score, ape, state_kv, state_score, state_slot, cu_seqlens, start_pos, norm_weight, epsilon,
                cos_cache, sin_cache, out_slots, cache, cache_scale, ratio, overlap, quant_mode, layout, scale_rule,
                rounding, scale_fmt, fp8_flavour, preshuffle, hadamard_on, bf16_after, freqs, update_state,
                page_size):
    """SPEC §7.6, for validated arguments (see dsaquant.compress.compress_kv for the contract).

    kv, score [T, C] fp32/bf16 (C = (1+overlap)*D); ape [ratio, C] fp32; state_kv, state_score [N_ring, R, C] fp32;
    state_slot [B]; cu_seqlens [B+1]; start_pos [B]; norm_weight [D]; cos_cache/sin_cache [max_pos, 32] or
    freqs [max_pos, 64]; out_slots [T]; `bf16_after` a collection of names from ROUNDING_POINTS; `page_size` P.
    Writes the compressed row of every boundary token whose out_slot is in [0, capacity), then (if
    `update_state`) the ring rows of the last K tokens of every sequence. All ring reads precede all ring writes.
    A sequence whose state_slot is outside [0, N_ring) is skipped entirely (no store, no ring write; flagged).
    """
    dev = kv.device
    T, C = kv.shape
    D = C // 2 if overlap else C
    K = ratio * (2 if overlap else 1)
    N_ring, R = state_kv.shape[0], state_kv.shape[1]
    bf16_after = tuple(bf16_after)

    valid, b, p, lens = _token_map(cu_seqlens, start_pos, T)
    sslot = state_slot.to(torch.int64)
    ring_ok = (sslot >= 0) & (sslot < N_ring)
    errors.flag_if(~ring_ok & (lens > 0), errors.SLOT_OUT_OF_RANGE)
    ok = valid & ring_ok[b]
    kv32 = kv.to(F32)                      # exact for bf16
    sc32 = score.to(F32)
    ape32 = ape.to(F32)
    spos = start_pos.to(torch.int64)

    # ---- 1. windows of the boundary tokens (every read of the ring happens here, before any write) -------
    bi = (ok & ((p + 1) % ratio == 0)).nonzero().squeeze(-1)
    if bi.numel():
        pb, sb = p[bi], b[bi]
        k = torch.arange(K, device=dev, dtype=torch.int64)
        s = pb.unsqueeze(-1) - K + 1 + k                                           # [Nb, K]
        included = s >= 0
        from_inputs = s >= spos[sb].unsqueeze(-1)
        half = torch.where(k < ratio, 0, D) if overlap else torch.zeros_like(k)   # overlap half, current half
        cols = (half.unsqueeze(-1) + torch.arange(D, device=dev)).unsqueeze(0)     # [1, K, D]
        sc = s.clamp_min(0)
        r = (bi.unsqueeze(-1) - (pb.unsqueeze(-1) - s)).clamp(0, T - 1).unsqueeze(-1)
        in_kv = kv32[r, cols]                                                       # [Nb, K, D]
        in_sig = sc32[r, cols] + ape32[(sc % ratio).unsqueeze(-1), cols]
        slot = sslot[sb].view(-1, 1, 1)
        rrow = (sc % R).unsqueeze(-1)
        win_kv = torch.where(from_inputs.unsqueeze(-1), in_kv, state_kv[slot, rrow, cols].to(F32))
        win_sig = torch.where(from_inputs.unsqueeze(-1), in_sig, state_score[slot, rrow, cols].to(F32))

        # ---- 2-6. pool, rounding points, RMSNorm, tail RoPE, Hadamard ---------------------------------
        y = pool(win_sig.transpose(1, 2), win_kv.transpose(1, 2), included.unsqueeze(1))   # [Nb, D]
        y = _bf16_if(y, "pool", bf16_after)
        y = _bf16_if(rms_norm(y, norm_weight, epsilon), "norm", bf16_after)
        cos, sin = cos_sin(pb + 1 - ratio, cos_cache, sin_cache, freqs)
        y = _bf16_if(rope_tail_interleaved(y, cos, sin), "rope", bf16_after)
        if hadamard_on:
            y = _bf16_if(hadamard(y), "hadamard", bf16_after)

        # ---- 7. quantize and store ----------------------------------------------------------------------
        slots = out_slots.to(torch.int64)[bi]
        capacity = cache.shape[0] * page_size
        keep = _valid_slots(slots, capacity).nonzero().squeeze(-1)
        slots, y = slots[keep], y[keep]
        if quant_mode == "none":
            cache.view(-1, D)[slots] = cast(y, cache.dtype)
        elif quant_mode == "fp4_sim":
            cache.view(-1, D)[slots] = fp4_stage1(y, scale_rule).to(cache.dtype)
        elif quant_mode == "fp4":
            payload, exps = fp4_quantize(y, rounding, scale_rule, 32)
            if layout == "aiter_fp4":
                write_aiter_fp4(cache, cache_scale, slots, payload, exps, page_size)
            else:
                write_packed68(cache, slots, payload, exps, page_size)
        elif quant_mode == "fp8":
            codes, scales = fp8_quantize(y, fp8_flavour, "k", scale_fmt)
            write_fp8_132(cache, slots, codes, scales[:, 0], page_size, preshuffle)
        else:
            raise ValueError(f"quant_mode must be one of {QUANT_MODES}, got {quant_mode!r}")

    # ---- state update: the last K tokens of every sequence -------------------------------------------------
    if update_state:
        wi = (ok & (p >= spos[b] + lens[b] - K)).nonzero().squeeze(-1)
        if wi.numel():
            slot, row = sslot[b[wi]], p[wi] % R
            state_kv[slot, row] = kv32[wi].to(state_kv.dtype)
            state_score[slot, row] = canon_nan(sc32[wi] + ape32[p[wi] % ratio])


# ------------------------------------------------------------------------------------------------
# §7.7 rope_rotate_quant
# ------------------------------------------------------------------------------------------------
FP4_OUT_DTYPES = (torch.uint8, torch.float4_e2m1fn_x2) if hasattr(torch, "float4_e2m1fn_x2") else (torch.uint8,)
FP8_OUT_DTYPES = {torch.float8_e4m3fn: "e4m3fn", torch.float8_e4m3fnuz: "e4m3fnuz"}
_Q_FLOOR = 0x2EDBE6FF  # 1e-10f


def fp8_group_quantize(x: torch.Tensor, flavour: str, group: int):
    """§7.7 FP8: x [..., n] -> (codes u8 [..., n], fp32 scales [..., n/group]) with s = max(amax, 1e-10f) / fmax
    (true division; no UE8M0 rounding) and codes encode(x * fl(1/s))."""
    _, fmax, _ = FLAVOURS[flavour]
    n = x.shape[-1]
    xb = canon_nan(x).reshape(*x.shape[:-1], n // group, group)
    s = div(torch.clamp_min(nan_amax(xb, -1), f32_from_bits(_Q_FLOOR)), fmax)
    codes = fp8_encode(canon_nan(xb * (1.0 / s).unsqueeze(-1)), flavour)
    return codes.reshape(x.shape), s


def rope_rotate_quant(out, x, cos_cache, sin_cache, positions, rope_dim, out_scale, group_size, shuffle_scale,
                      hadamard_on, rounding):
    """SPEC §7.7, for validated arguments (see dsaquant.compress.rope_rotate_quant). x [T, H, D] -> tail interleaved
    RoPE (fp32, not rounded) -> optional Hadamard over D -> by out's dtype: FP4 (u8/fp4x2 [T, H, D/2], recip,
    scales shuffled into the aiter q-scale layout or dense [T, H, D/group]), FP8 ([T, H, D], fp32 group scales)
    or x's half dtype (out may alias x)."""
    T, H, D = x.shape
    cos, sin = cos_sin(positions, cos_cache, sin_cache)
    y = rope_tail_interleaved(x.to(F32), cos.unsqueeze(1), sin.unsqueeze(1))
    if hadamard_on:
        y = hadamard(y)
    if out.dtype in FP4_OUT_DTYPES:
        payload, exps = fp4_quantize(y, rounding, "recip", group_size)            # [T, H, D/2], [T, H, G]
        out.view(torch.uint8).copy_(payload)
        if shuffle_scale:                                                          # group_size == 32
            KT = D // 128
            tiles = exps.reshape(T, H, KT, 4).permute(0, 2, 1, 3).reshape(T * KT, H, 4)
            flat = out_scale.view(T * KT, 1, 4, 16, out_scale.shape[-1])            # one k tile per row
            write_aiter_q_scale(flat, torch.arange(T * KT, device=x.device), tiles, H)
        else:
            out_scale.view(torch.uint8).copy_(exps)
    elif out.dtype in FP8_OUT_DTYPES:
        codes, s = fp8_group_quantize(y, FP8_OUT_DTYPES[out.dtype], group_size)
        out.view(torch.uint8).copy_(codes)
        out_scale.copy_(s)
    elif out.dtype == x.dtype and out.dtype in (torch.bfloat16, torch.float16):
        out.copy_(cast(y, out.dtype))
    else:
        raise TypeError(f"out: unsupported dtype {out.dtype}")

"""SPEC §7.1-§7.3: the indexer ops, as torch reference implementations.

These functions assume validated arguments (python/dsaquant/validate.py checks them first) and write
only the rows and slots the SPEC says they write. Every arithmetic step is one of §0-§5's helpers.
Slots at or past the cache's capacity are skipped and raise the device error flag (errors.py).
"""
from __future__ import annotations

import torch

from .. import errors
from .arith import F32, cast, round_to, to_f32_scalar
from .fp4 import fp4_quantize, fp4_fake_quant, sglang_two_stage
from .fp8 import fp8_quantize
from .layouts import write_aiter_fp4, write_aiter_q_scale, write_fp8_132, write_packed68
from .transforms import cos_sin, hadamard, layer_norm, rms_norm, rope


def _valid_slots(slots: torch.Tensor, capacity: int, lowest: int = 0) -> torch.Tensor:
    """Rows whose slot is in [lowest, capacity); raises the error flag for slots >= capacity."""
    s = slots.to(torch.int64)
    errors.flag_if(s >= capacity, errors.SLOT_OUT_OF_RANGE)
    return (s >= lowest) & (s < capacity)


def indexer_qk_rope_quant_and_cache(q, q_out, weights, weights_out, k, kv_cache, slot_mapping, norm_weight,
                                    norm_bias, positions, cos_cache, sin_cache, epsilon, quant_block_size,
                                    scale_fmt, weights_scale, preshuffle, is_neox, compute_all_q_rope,
                                    q_scale_out, kv_cache_scale, rounding, fp8_flavour, page_size):
    """SPEC §7.1. q [T, H, 128] bf16/fp16; k [T, 128]; weights [T, H]; slot_mapping [T]; positions [T].
    FP8 mode when q_scale_out is None, FP4 mode otherwise (see dsaquant.ops for the full contract)."""
    T, H, _ = q.shape
    slots = slot_mapping.to(torch.int64)
    q_rows = torch.ones_like(slots, dtype=torch.bool) if compute_all_q_rope else slots >= 0
    capacity = kv_cache.shape[0] * page_size
    k_rows = _valid_slots(slots, capacity)
    cos, sin = cos_sin(positions, cos_cache, sin_cache)

    qr = round_to(rope(q, cos.unsqueeze(1), sin.unsqueeze(1), is_neox, tail=False), q.dtype)
    kn = round_to(layer_norm(k, norm_weight, norm_bias, epsilon), k.dtype)
    kr = round_to(rope(kn, cos, sin, is_neox, tail=False), k.dtype)
    qi = q_rows.nonzero().squeeze(-1)
    ki = k_rows.nonzero().squeeze(-1)

    if q_scale_out is not None:  # FP4 mode
        qp, qe = fp4_quantize(qr, rounding, "recip", 32)
        q_out.view(torch.uint8)[qi] = qp[qi]
        write_aiter_q_scale(q_scale_out, qi, qe[qi], H)
        weights_out[qi] = cast(weights[qi].to(F32), weights_out.dtype)
        kp, ke = fp4_quantize(kr, rounding, "recip", 32)
        write_aiter_fp4(kv_cache, kv_cache_scale, slots[ki], kp[ki], ke[ki], page_size)
        return
    qc, qs = fp8_quantize(qr, fp8_flavour, "q", scale_fmt)            # qs [T, H, 1]
    q_out.view(torch.uint8)[qi] = qc[qi]
    w = (weights.to(F32) * qs.squeeze(-1)) * to_f32_scalar(weights_scale)
    weights_out[qi] = cast(w[qi], weights_out.dtype)
    kc, ks = fp8_quantize(kr, fp8_flavour, "k", scale_fmt)             # ks [T, 1]
    write_fp8_132(kv_cache, slots[ki], kc[ki], ks[ki, 0], page_size, preshuffle)


def _k_norm_rope_v41(k, norm_weight, eps, positions, freqs, compress_ratio):
    """RMSNorm -> bf16 -> tail interleaved RoPE at pos & ~(r-1) -> bf16 (SPEC §7.2). fp32 values."""
    kn = round_to(rms_norm(k, norm_weight, eps), k.dtype)
    cos, sin = cos_sin(positions, freqs=freqs, compress_ratio=compress_ratio)
    return round_to(rope(kn, cos, sin, neox=False, tail=True), k.dtype)


def index_k_norm_rope_pack_store(k, norm_weight, eps, positions, freqs, slots, cache, compress_ratio, rounding,
                                 page_size):
    """SPEC §7.2: k [T, 128] -> packed68 cache [NB, P*68]. Slot 0 is reserved; negative slots skipped."""
    kr = _k_norm_rope_v41(k, norm_weight, eps, positions, freqs, compress_ratio)
    payload, exps = sglang_two_stage(kr, rounding)
    s = slots.to(torch.int64)
    ki = _valid_slots(s, cache.shape[0] * page_size, lowest=1).nonzero().squeeze(-1)
    write_packed68(cache, s[ki], payload[ki], exps[ki], page_size)


def index_q_rope_pack_weights(q, positions, freqs, head_weights, weight_scale, rounding, payload_out, exps_out,
                              weights_out):
    """SPEC §7.2: q [T, H, 128] -> payload u8 [T, H, 64], exponents int32 [T, H] (block j in byte j),
    weights fp32 [T, H] = float(bf16(fl(float(w) * weight_scale)))."""
    cos, sin = cos_sin(positions, freqs=freqs)
    qr = round_to(rope(q, cos.unsqueeze(1), sin.unsqueeze(1), neox=False, tail=True), q.dtype)
    payload, exps = sglang_two_stage(qr, rounding)
    payload_out.copy_(payload)
    exps_out.copy_(exps.contiguous().view(torch.int32).squeeze(-1))
    w = round_to(head_weights.to(F32) * to_f32_scalar(weight_scale), torch.bfloat16)
    weights_out.copy_(w)


def rope_fake_quant_fp4(x, positions, freqs, block, scale, compress_ratio, out):
    """SPEC §7.2: tail interleaved RoPE (rounded to x's dtype) then stage 1 (fake-quant) -> out (x's dtype).
    x [T, 128] or [T, H, 128]."""
    cos, sin = cos_sin(positions, freqs=freqs, compress_ratio=compress_ratio)
    if x.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    xr = round_to(rope(x, cos, sin, neox=False, tail=True), x.dtype)
    out.copy_(fp4_fake_quant(xr, block, scale, out_dtype=x.dtype))


def rmsnorm_rope_rotate_fp4quant_kvcache(kv, norm_weight, epsilon, positions, cos_cache, sin_cache, slot_mapping,
                                         kv_cache, kv_cache_scale, hadamard_on, rounding, layout, page_size):
    """SPEC §7.3: kv [T, Hk, 128] (head 0 is used) -> RMSNorm (fp32) -> tail interleaved RoPE (fp32) ->
    optional Hadamard -> FP4 (rule recip) -> `aiter_fp4` cache, or the dense layout
    (kv_cache u8 [num_slots, 64], kv_cache_scale u8 [num_slots, 4])."""
    x = kv[:, 0, :] if kv.dim() == 3 else kv
    y = rms_norm(x, norm_weight, epsilon)
    cos, sin = cos_sin(positions, cos_cache, sin_cache)
    y = rope(y, cos, sin, neox=False, tail=True)
    if hadamard_on:
        y = hadamard(y)
    payload, exps = fp4_quantize(y, rounding, "recip", 32)
    s = slot_mapping.to(torch.int64)
    if layout == "aiter_fp4":
        ki = _valid_slots(s, kv_cache.shape[0] * page_size).nonzero().squeeze(-1)
        write_aiter_fp4(kv_cache, kv_cache_scale, s[ki], payload[ki], exps[ki], page_size)
    else:
        ki = _valid_slots(s, kv_cache.shape[0]).nonzero().squeeze(-1)
        kv_cache.view(torch.uint8)[s[ki]] = payload[ki]
        kv_cache_scale.view(torch.uint8)[s[ki]] = exps[ki]

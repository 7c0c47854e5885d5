"""The public ops: validate (SPEC §7.5) -> pick a backend (dispatch.py) -> call one torch.library op.

Every op is registered as a `torch.library` custom op in the `dsaquant` namespace with a fake (meta)
implementation and its mutated arguments declared, so torch.compile(fullgraph=True) and CUDA graphs
see one opaque call. Rows are tokens (T); H is the number of heads; head_dim is always 128.
"""

from typing import Optional

import math

import torch
from torch import Tensor

from . import preference, dispatch
from . import validate as V
from .codes import LAYOUTS
from .reference.fp4 import POLICIES
from .reference.layouts import aiter_fp4_to_packed68, aiter_q_scale_pad, packed68_to_aiter_fp4

D = 128


def _call(op: str, backend: str, *args):
    return dispatch.get(backend, op)(*args)


# ------------------------------------------------------------------------------------------------
# §7.1 indexer_qk_rope_quant_and_cache
# ------------------------------------------------------------------------------------------------
@dispatch.library_op("dsaquant::indexer_qk_rope_quant_and_cache",
                         mutates_args=("q_out", "weights_out", "kv_cache", "q_scale_out", "kv_cache_scale"))
def _indexer_op(q: Tensor, q_out: Tensor, weights: Tensor, weights_out: Tensor, k: Tensor, kv_cache: Tensor,
                slot_mapping: Tensor, norm_weight: Tensor, norm_bias: Tensor, positions: Tensor, cos_cache: Tensor,
                sin_cache: Tensor, epsilon: float, quant_block_size: int, scale_fmt: Optional[str],
                weights_scale: float, preshuffle: bool, is_neox: bool, compute_all_q_rope: bool,
                q_scale_out: Optional[Tensor], kv_cache_scale: Optional[Tensor], rounding: str, fp8_flavour: str,
                page_size: int, backend: str) -> None:
    _call("indexer_qk_rope_quant_and_cache", backend, q, q_out, weights, weights_out, k, kv_cache, slot_mapping,
          norm_weight, norm_bias, positions, cos_cache, sin_cache, epsilon, quant_block_size, scale_fmt,
          weights_scale, preshuffle, is_neox, compute_all_q_rope, q_scale_out, kv_cache_scale, rounding,
          fp8_flavour, page_size)


@_indexer_op.register_fake
def _(*args, **kwargs) -> None:
    return None


def indexer_qk_rope_quant_and_cache(q, q_out, weights, weights_out, k, kv_cache, slot_mapping, norm_weight,
                                    norm_bias, positions, cos_cache, sin_cache, epsilon, quant_block_size,
                                    scale_fmt, weights_scale, preshuffle=False, is_neox=True,
                                    compute_all_q_rope=False, q_scale_out=None, kv_cache_scale=None, *,
                                    rounding="hardware", fp8_flavour=None, backend=None):
    """RoPE on q and k, LayerNorm on k, quantize both, store k in the paged cache (SPEC §7.1; AITER's
    signature and defaults, plus keyword-only `rounding`, `fp8_flavour` and `backend`).

    Inputs (T tokens, H heads, head_dim 128):
      q [T, H, 128] bf16/fp16 (last dim contiguous); weights [T, H] fp32/bf16/fp16; k [T, 128], q's dtype;
      slot_mapping [T] int64/int32 (slot < 0: the row is skipped, unless compute_all_q_rope);
      norm_weight, norm_bias [128] float (LayerNorm); positions [T] int64/int32 (clamped to [0, max_pos));
      cos_cache, sin_cache [max_pos, 32] bf16/fp16/fp32; epsilon float; weights_scale float.
    FP8 mode (q_scale_out and kv_cache_scale both None): quant_block_size 128; scale_fmt "ue8m0" or None (fp32).
      q_out [T, H, 128] float8_e4m3fn / float8_e4m3fnuz / uint8 (flavour from the dtype, or `fp8_flavour`);
      weights_out [T, H] fp32 = fl(fl(w * q_scale) * weights_scale);
      kv_cache uint8 (or fp8) [NB, P*132] or [NB, P, 132], layout fp8_132 (SPEC §6), `preshuffle` needs P % 16 == 0.
    FP4 mode (both given): quant_block_size 32, scale rule recip, codes by `rounding`
      ("threshold" | "rne" | "hardware", SPEC §2); q_out uint8 [T, H, 64];
      q_scale_out uint8 [T, 1, 4, 16, round_up(H/16, 4)] (H % 16 == 0; pad entries written 0);
      weights_out [T, H] float = weights (copied); kv_cache uint8 [NB, 1, 4, P, 16];
      kv_cache_scale uint8 [NB, 1, 4, P] (P % 16 == 0), layout aiter_fp4.
    Slots at or past the capacity NB*P are never written (dsaquant.check_errors() reports them).
    """
    fp4 = q_scale_out is not None or kv_cache_scale is not None
    V.tensor("q", q, V.HALFS, (None, None, D), last_contiguous=True)
    T, H = q.shape[0], q.shape[1]
    dev = q.device
    V.choice("rounding", rounding, POLICIES)
    V.epsilon("epsilon", epsilon)
    V.number("weights_scale", weights_scale)
    V.number("quant_block_size", quant_block_size, (int,))
    V.flag("preshuffle", preshuffle)
    V.flag("is_neox", is_neox)
    V.flag("compute_all_q_rope", compute_all_q_rope)
    V.tensor("weights", weights, V.FLOATS, (T, H), dev)
    V.tensor("k", k, (q.dtype,), (T, D), dev, last_contiguous=True)
    V.tensor("slot_mapping", slot_mapping, V.INDEX, (T,), dev)
    V.tensor("norm_weight", norm_weight, V.FLOATS, (D,), dev)
    V.tensor("norm_bias", norm_bias, V.FLOATS, (D,), dev)
    V.tensor("positions", positions, V.INDEX, (T,), dev)
    V.tensor("cos_cache", cos_cache, V.FLOATS, (None, 32), dev, last_contiguous=True)
    V.tensor("sin_cache", sin_cache, (cos_cache.dtype,), (cos_cache.shape[0], 32), dev, last_contiguous=True)
    if cos_cache.shape[0] < 1:
        raise ValueError("cos_cache: expected at least one position row, got 0")
    if fp4:
        if q_scale_out is None or kv_cache_scale is None:
            missing = "q_scale_out" if q_scale_out is None else "kv_cache_scale"
            raise ValueError(f"{missing}: FP4 mode needs both q_scale_out and kv_cache_scale; only one was given")
        if quant_block_size != 32:
            raise ValueError(f"quant_block_size: FP4 mode uses blocks of 32, got {quant_block_size}")
        if scale_fmt not in (None, "", "ue8m0"):
            raise ValueError(f"scale_fmt: FP4 mode uses UE8M0 scales ('ue8m0' or None), got {scale_fmt!r}")
        if H % 16:
            raise ValueError(f"q: FP4 mode's q scale layout needs H % 16 == 0, got H = {H}")
        V.tensor("q_out", q_out, (torch.uint8,), (T, H, 64), dev, contiguous=True)
        V.tensor("q_scale_out", q_scale_out, (torch.uint8,), (T, 1, 4, 16, aiter_q_scale_pad(H)), dev, contiguous=True)
        V.tensor("weights_out", weights_out, V.FLOATS, (T, H), dev)
        V.tensor("kv_cache", kv_cache, (torch.uint8,), (None, 1, 4, None, 16), dev, contiguous=True)
        NB, P = kv_cache.shape[0], kv_cache.shape[3]
        V.page_multiple_of_16("kv_cache", P, "the aiter_fp4 layout")
        V.tensor("kv_cache_scale", kv_cache_scale, (torch.uint8,), (NB, 1, 4, P), dev, contiguous=True)
        flavour = "e4m3fn"
    else:
        if quant_block_size != 128:
            raise ValueError(f"quant_block_size: FP8 mode uses one scale per 128-wide row, got {quant_block_size}")
        V.choice("scale_fmt", scale_fmt, (None, "", "ue8m0"))
        V.tensor("q_out", q_out, (torch.uint8, *V.FP8_DTYPES), (T, H, D), dev, contiguous=True)
        flavour = V.fp8_flavour_of(q_out, fp8_flavour)
        V.tensor("weights_out", weights_out, (torch.float32,), (T, H), dev)
        V.tensor("kv_cache", kv_cache, (torch.uint8, *V.FP8_DTYPES), None, dev, contiguous=True)
        P = V.page_size_of("kv_cache", kv_cache, 132)
        if preshuffle:
            V.page_multiple_of_16("kv_cache", P, "preshuffle")
    V.host_slot_check("slot_mapping", slot_mapping, kv_cache.shape[0] * P)
    if T == 0:
        return
    name = dispatch.choose_for("indexer_qk_rope_quant_and_cache", dev, backend, T,
                               preference.variant("indexer_qk_rope_quant_and_cache", out_format="fp4" if fp4 else "fp8"))
    _indexer_op(q, q_out, weights, weights_out, k, kv_cache, slot_mapping, norm_weight, norm_bias, positions,
                cos_cache, sin_cache, float(epsilon), quant_block_size, scale_fmt or None, float(weights_scale),
                preshuffle, is_neox, compute_all_q_rope, q_scale_out, kv_cache_scale, rounding, flavour, P, name)


# ------------------------------------------------------------------------------------------------
# §7.2 sglang-v41 ops
# ------------------------------------------------------------------------------------------------
def _check_freqs(freqs, dev):
    V.tensor("freqs", freqs, (torch.float32,), (None, 64), dev, last_contiguous=True)
    if freqs.shape[0] < 1:
        raise ValueError("freqs: expected at least one position row, got 0")


def _check_ratio(compress_ratio):
    V.number("compress_ratio", compress_ratio, (int,))
    if compress_ratio < 1 or compress_ratio & (compress_ratio - 1):
        raise ValueError(f"compress_ratio: expected a power of two >= 1, got {compress_ratio}")


@dispatch.library_op("dsaquant::index_k_norm_rope_pack_store", mutates_args=("cache",))
def _k_store_op(k: Tensor, norm_weight: Tensor, eps: float, positions: Tensor, freqs: Tensor, slots: Tensor,
                cache: Tensor, compress_ratio: int, rounding: str, page_size: int, backend: str) -> None:
    _call("index_k_norm_rope_pack_store", backend, k, norm_weight, eps, positions, freqs, slots, cache,
          compress_ratio, rounding, page_size)


@_k_store_op.register_fake
def _(*args, **kwargs) -> None:
    return None


def index_k_norm_rope_pack_store(k, norm_weight, eps, positions, freqs, slots, cache, compress_ratio=1,
                                 rounding="rne", *, backend=None):
    """sglang-v41 key writer (SPEC §7.2): RMSNorm -> bf16 -> tail interleaved RoPE at pos & ~(r-1) ->
    bf16 -> stage 1 (recip fake-quant) -> stage 2 (rule pack, codes by `rounding`) -> packed68 store.

    k [T, 128] bf16/fp16; norm_weight [128] float; eps float; positions [T] int32/int64;
    freqs [max_pos, 64] fp32 (cos, sin) pairs; slots [T] int32/int64 (slot 0 reserved and never
    written, negative slots skipped); cache uint8 [NB, P*68] or [NB, P, 68] (layout packed68, SPEC §6).
    """
    V.tensor("k", k, V.HALFS, (None, D), last_contiguous=True)
    T, dev = k.shape[0], k.device
    V.tensor("norm_weight", norm_weight, V.FLOATS, (D,), dev)
    V.epsilon("eps", eps)
    V.tensor("positions", positions, V.INDEX, (T,), dev)
    _check_freqs(freqs, dev)
    V.tensor("slots", slots, V.INDEX, (T,), dev)
    V.tensor("cache", cache, (torch.uint8,), None, dev, contiguous=True)
    P = V.page_size_of("cache", cache, 68)
    _check_ratio(compress_ratio)
    V.choice("rounding", rounding, POLICIES)
    V.host_slot_check("slots", slots, cache.shape[0] * P)
    if T == 0:
        return
    name = dispatch.choose_for("index_k_norm_rope_pack_store", dev, backend, T)
    _k_store_op(k, norm_weight, float(eps), positions, freqs, slots, cache, compress_ratio, rounding, P, name)


@dispatch.library_op("dsaquant::index_q_rope_pack_weights",
                         mutates_args=("payload_out", "exps_out", "weights_out"))
def _q_pack_op(q: Tensor, positions: Tensor, freqs: Tensor, head_weights: Tensor, weight_scale: float,
               rounding: str, payload_out: Tensor, exps_out: Tensor, weights_out: Tensor, backend: str) -> None:
    _call("index_q_rope_pack_weights", backend, q, positions, freqs, head_weights, weight_scale, rounding,
          payload_out, exps_out, weights_out)


@_q_pack_op.register_fake
def _(*args, **kwargs) -> None:
    return None


def index_q_rope_pack_weights(q, positions, freqs, head_weights, weight_scale, rounding="rne", *, out=None,
                              backend=None):
    """sglang-v41 query packer (SPEC §7.2): tail interleaved RoPE -> bf16 -> stage 1 -> stage 2.

    q [T, H, 128] bf16/fp16; positions [T]; freqs [max_pos, 64] fp32; head_weights [T, H] float;
    weight_scale float. Returns (payload uint8 [T, H, 64], exponents int32 [T, H] with block j's
    UE8M0 exponent in byte j, weights fp32 [T, H] = float(bf16(fl(float(w) * weight_scale)))).
    `out` may give those three tensors to write into.
    """
    V.tensor("q", q, V.HALFS, (None, None, D), last_contiguous=True)
    T, H, dev = q.shape[0], q.shape[1], q.device
    V.tensor("positions", positions, V.INDEX, (T,), dev)
    _check_freqs(freqs, dev)
    V.tensor("head_weights", head_weights, V.FLOATS, (T, H), dev)
    V.number("weight_scale", weight_scale)
    V.choice("rounding", rounding, POLICIES)
    if out is None:
        out = (torch.empty((T, H, 64), dtype=torch.uint8, device=dev),
               torch.empty((T, H), dtype=torch.int32, device=dev),
               torch.empty((T, H), dtype=torch.float32, device=dev))
    payload, exps, w = out
    V.tensor("out[0] (payload)", payload, (torch.uint8,), (T, H, 64), dev, contiguous=True)
    V.tensor("out[1] (exponents)", exps, (torch.int32,), (T, H), dev, contiguous=True)
    V.tensor("out[2] (weights)", w, (torch.float32,), (T, H), dev, contiguous=True)
    if T:
        name = dispatch.choose_for("index_q_rope_pack_weights", dev, backend, T)
        _q_pack_op(q, positions, freqs, head_weights, float(weight_scale), rounding, payload, exps, w, name)
    return payload, exps, w


@dispatch.library_op("dsaquant::rope_fake_quant_fp4", mutates_args=("out",))
def _fake_quant_op(x: Tensor, positions: Tensor, freqs: Tensor, block: int, scale: str, compress_ratio: int,
                   out: Tensor, backend: str) -> None:
    _call("rope_fake_quant_fp4", backend, x, positions, freqs, block, scale, compress_ratio, out)


@_fake_quant_op.register_fake
def _(*args, **kwargs) -> None:
    return None


def rope_fake_quant_fp4(x, positions, freqs, block=32, scale="ue8m0", *, compress_ratio=1, out=None, backend=None):
    """Tail interleaved RoPE (rounded to x's dtype) then SPEC §7.2 stage 1, the model's QAT fake-quant.

    x [T, 128] or [T, H, 128] bf16/fp16; positions [T]; freqs [max_pos, 64] fp32.
    block=32, scale="ue8m0": UE8M0 scales by rule recip; block=16, scale="e4m3": e4m3 scales.
    Returns (or writes into `out`) a tensor of x's shape and dtype holding the dequantized values.
    """
    V.tensor("x", x, V.HALFS, None, last_contiguous=True)
    if x.dim() not in (2, 3) or x.shape[-1] != D:
        raise ValueError(f"x: expected shape [T, 128] or [T, H, 128], got {list(x.shape)}")
    T, dev = x.shape[0], x.device
    V.tensor("positions", positions, V.INDEX, (T,), dev)
    _check_freqs(freqs, dev)
    V.number("block", block, (int,))
    if not isinstance(scale, str):
        raise TypeError(f"scale: expected a str ('ue8m0' or 'e4m3'), got {type(scale).__name__}")
    if (block, scale) not in ((32, "ue8m0"), (16, "e4m3")):
        raise ValueError(f"block, scale: expected (32, 'ue8m0') or (16, 'e4m3'), got ({block!r}, {scale!r})")
    _check_ratio(compress_ratio)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    V.tensor("out", out, (x.dtype,), tuple(x.shape), dev, contiguous=True)
    if T:
        name = dispatch.choose_for("rope_fake_quant_fp4", dev, backend, T)
        _fake_quant_op(x, positions, freqs, block, scale, compress_ratio, out, name)
    return out


# ------------------------------------------------------------------------------------------------
# §7.3 aiter DeepSeek-V4 k writer
# ------------------------------------------------------------------------------------------------
@dispatch.library_op("dsaquant::rmsnorm_rope_rotate_fp4quant_kvcache", mutates_args=("kv_cache", "kv_cache_scale"))
def _v4_k_op(kv: Tensor, norm_weight: Tensor, epsilon: float, positions: Tensor, cos_cache: Tensor,
             sin_cache: Tensor, slot_mapping: Tensor, kv_cache: Tensor, kv_cache_scale: Tensor, hadamard: bool,
             rounding: str, layout: str, page_size: int, backend: str) -> None:
    _call("rmsnorm_rope_rotate_fp4quant_kvcache", backend, kv, norm_weight, epsilon, positions, cos_cache,
          sin_cache, slot_mapping, kv_cache, kv_cache_scale, hadamard, rounding, layout, page_size)


@_v4_k_op.register_fake
def _(*args, **kwargs) -> None:
    return None


def rmsnorm_rope_rotate_fp4quant_kvcache(kv, norm_weight, epsilon, positions, cos_cache, sin_cache, slot_mapping,
                                         kv_cache, kv_cache_scale, *, hadamard=True, rounding="hardware",
                                         layout="aiter_fp4", backend=None):
    """AITER's DeepSeek-V4 key writer (SPEC §7.3): RMSNorm (kept fp32) -> tail interleaved RoPE (fp32) ->
    optional 128-point Hadamard -> FP4 (blocks of 32, rule recip, codes by `rounding`) -> cache.

    kv [T, 128] or [T, Hk, 128] bf16/fp16/fp32 (only head 0 is written); norm_weight [128] float;
    positions [T]; cos_cache, sin_cache [max_pos, 32]; slot_mapping [T] (negative: skipped).
    layout "aiter_fp4": kv_cache uint8 [NB, 1, 4, P, 16], kv_cache_scale uint8 [NB, 1, 4, P] (P % 16 == 0).
    layout "dense": kv_cache uint8 [num_slots, 64], kv_cache_scale uint8 [num_slots, 4].
    """
    V.tensor("kv", kv, V.FLOATS, None, last_contiguous=True)
    if kv.dim() not in (2, 3) or kv.shape[-1] != D:
        raise ValueError(f"kv: expected shape [T, 128] or [T, Hk, 128], got {list(kv.shape)}")
    T, dev = kv.shape[0], kv.device
    V.tensor("norm_weight", norm_weight, V.FLOATS, (D,), dev)
    V.epsilon("epsilon", epsilon)
    V.tensor("positions", positions, V.INDEX, (T,), dev)
    V.tensor("cos_cache", cos_cache, V.FLOATS, (None, 32), dev, last_contiguous=True)
    V.tensor("sin_cache", sin_cache, (cos_cache.dtype,), (cos_cache.shape[0], 32), dev, last_contiguous=True)
    V.tensor("slot_mapping", slot_mapping, V.INDEX, (T,), dev)
    V.flag("hadamard", hadamard)
    V.choice("rounding", rounding, POLICIES)
    V.choice("layout", layout, ("aiter_fp4", "dense"))
    if layout == "aiter_fp4":
        V.tensor("kv_cache", kv_cache, (torch.uint8,), (None, 1, 4, None, 16), dev, contiguous=True)
        NB, P = kv_cache.shape[0], kv_cache.shape[3]
        V.page_multiple_of_16("kv_cache", P, "the aiter_fp4 layout")
        V.tensor("kv_cache_scale", kv_cache_scale, (torch.uint8,), (NB, 1, 4, P), dev, contiguous=True)
        capacity = NB * P
    else:
        V.tensor("kv_cache", kv_cache, (torch.uint8,), (None, 64), dev, contiguous=True)
        V.tensor("kv_cache_scale", kv_cache_scale, (torch.uint8,), (kv_cache.shape[0], 4), dev, contiguous=True)
        P, capacity = 1, kv_cache.shape[0]
    V.host_slot_check("slot_mapping", slot_mapping, capacity)
    if T == 0:
        return
    name = dispatch.choose_for("rmsnorm_rope_rotate_fp4quant_kvcache", dev, backend, T)
    _v4_k_op(kv, norm_weight, float(epsilon), positions, cos_cache, sin_cache, slot_mapping, kv_cache,
             kv_cache_scale, hadamard, rounding, layout, P, name)


# ------------------------------------------------------------------------------------------------
# §7.4 scorer
# ------------------------------------------------------------------------------------------------
@dispatch.library_op("dsaquant::paged_mqa_logits", mutates_args=("out",))
def _scorer_op(q: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor, block_tables: Tensor,
               max_seq_len: int, layout: str, q_scale: Optional[Tensor], kv_cache_scale: Optional[Tensor],
               weight_scale: float, preshuffle: bool, fp8_flavour: str, page_size: int, clean_logits: bool,
               out: Tensor, backend: str) -> None:
    _call("paged_mqa_logits", backend, q, kv_cache, weights, context_lens, block_tables, max_seq_len, layout,
          q_scale, kv_cache_scale, weight_scale, preshuffle, fp8_flavour, page_size, clean_logits, out)


@_scorer_op.register_fake
def _(*args):
    return None


def paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, max_seq_len, *, layout, q_scale=None,
                     kv_cache_scale=None, weight_scale=1.0, preshuffle=False, fp8_flavour=None, clean_logits=True,
                     logits_dtype=torch.float32, out=None, backend=None):
    """Indexer logits over a paged cache (SPEC §7.4), the reader of every §6 layout (docs/scorer.md).

    logits[b*N + n, p] = weight_scale * sum_h weights[b, n, h] * relu(sum_d q[b, n, h, d] * k[p, d]) for
    p < len(b, n), -inf for p >= it (left untouched with clean_logits=False); q and k dequantized (value
    times scale). B batch, N = next_n queries per sequence (1..8), H heads (16, 32, 64 or 128 on the fast paths).
      layout "fp8_132":  q [B, N, H, 128] fp8 or uint8 (q's scale folded into weights, as §7.1 writes it);
                          kv_cache uint8 [NB, P*132]; `preshuffle` as written.
      layout "packed68": q uint8 [B, N, H, 64]; q_scale int32 [B, N, H] (block j in byte j) or uint8
                          [B, N, H, 4]; kv_cache uint8 [NB, P*68].
      layout "aiter_fp4": q uint8 [B, N, H, 64]; q_scale uint8 [B*N, 1, 4, 16, qs_pad];
                          kv_cache uint8 [NB, 1, 4, P, 16]; kv_cache_scale uint8 [NB, 1, 4, P].
    weights [B*N, H] or [B, N, H], fp32 or bf16; context_lens int32/int64 [B] (every query of a sequence
    sees the same length) or [B, N]; lengths are clamped to [0, max_seq_len]. block_tables int32/int64
    [B, max_blocks] (page ids). A context position whose page cannot be found (past the table, or an
    entry outside [0, num_blocks)) is not read: its logit is -inf and check_errors() reports it.
    Returns `out` (allocated when None): [B*N, max_seq_len] of logits_dtype (fp32 or bf16), rows may be
    strided (last dim contiguous).
    """
    V.choice("layout", layout, LAYOUTS)
    V.tensor("q", q, (torch.uint8, *V.FP8_DTYPES), None, contiguous=True)
    if q.dim() != 4:
        raise ValueError(f"q: expected shape [B, next_n, H, {128 if layout == 'fp8_132' else 64}], got {list(q.shape)}")
    B, N, H = q.shape[:3]
    dev = q.device
    if layout == "fp8_132":
        V.tensor("q", q, None, (B, N, H, D))
        flavour = V.fp8_flavour_of(q, fp8_flavour)
        V.tensor("kv_cache", kv_cache, (torch.uint8, *V.FP8_DTYPES), None, dev, contiguous=True)
        P = V.page_size_of("kv_cache", kv_cache, 132)
        if preshuffle:
            V.page_multiple_of_16("kv_cache", P, "preshuffle")
    else:
        flavour = "e4m3fn"
        V.tensor("q", q, (torch.uint8,), (B, N, H, 64))
        if layout == "packed68":
            V.tensor("kv_cache", kv_cache, (torch.uint8,), None, dev, contiguous=True)
            P = V.page_size_of("kv_cache", kv_cache, 68)
            if q_scale is None:
                raise ValueError("q_scale: layout 'packed68' needs the query exponents, got None")
            if q_scale.dtype == torch.int32:
                V.tensor("q_scale", q_scale, None, (B, N, H), dev, contiguous=True)
            else:
                V.tensor("q_scale", q_scale, (torch.uint8, torch.int32), (B, N, H, 4), dev, contiguous=True)
        else:
            if H % 16:
                raise ValueError(f"q: layout 'aiter_fp4' needs H % 16 == 0, got H = {H}")
            V.tensor("q_scale", q_scale, (torch.uint8,), (B * N, 1, 4, 16, aiter_q_scale_pad(H)), dev, contiguous=True)
            V.tensor("kv_cache", kv_cache, (torch.uint8,), (None, 1, 4, None, 16), dev, contiguous=True)
            P = kv_cache.shape[3]
            V.page_multiple_of_16("kv_cache", P, "the aiter_fp4 layout")
            V.tensor("kv_cache_scale", kv_cache_scale, (torch.uint8,), (kv_cache.shape[0], 1, 4, P), dev,
                     contiguous=True)
    if weights is None or not isinstance(weights, torch.Tensor) or weights.shape not in ((B * N, H), (B, N, H)):
        V.tensor("weights", weights, V.FLOATS, (B * N, H), dev)
    V.tensor("weights", weights, V.FLOATS, None, dev)
    if context_lens is None or not isinstance(context_lens, torch.Tensor) or context_lens.shape not in ((B,), (B, N)):
        V.tensor("context_lens", context_lens, V.INDEX, (B,), dev)
    V.tensor("context_lens", context_lens, V.INDEX, None, dev)
    V.tensor("block_tables", block_tables, V.INDEX, (B, None), dev)
    V.number("max_seq_len", max_seq_len, (int,))
    V.number("weight_scale", weight_scale)
    if not math.isfinite(weight_scale):
        raise ValueError(f"weight_scale: expected a finite number, got {weight_scale}")
    V.flag("preshuffle", preshuffle)
    if max_seq_len < 0:
        raise ValueError(f"max_seq_len: expected >= 0, got {max_seq_len}")
    V.flag("clean_logits", clean_logits)
    if logits_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"logits_dtype: expected torch.float32 or torch.bfloat16, got {logits_dtype}")
    if out is None:
        out = torch.empty((B * N, max_seq_len), dtype=logits_dtype, device=dev)
    else:
        V.tensor("out", out, (logits_dtype,), (B * N, max_seq_len), dev, last_contiguous=True)
    name = dispatch.choose_for("paged_mqa_logits", dev, backend, B * N)
    _scorer_op(q, kv_cache, weights, context_lens, block_tables, max_seq_len, layout, q_scale, kv_cache_scale,
               float(weight_scale), preshuffle, flavour, P, bool(clean_logits), out, name)
    return out


# ------------------------------------------------------------------------------------------------
# FP4 layout converter (SPEC §6)
# ------------------------------------------------------------------------------------------------
def convert_fp4_cache(cache, cache_scale=None, *, to, page_size=64):
    """Convert a whole FP4 cache between `packed68` and `aiter_fp4` (SPEC §6); every slot keeps its
    page and position, payload and exponents are copied bit for bit.

    to="aiter_fp4": cache uint8 [NB, P*68] -> (kv_cache uint8 [NB, 1, 4, P, 16], kv_cache_scale uint8 [NB, 1, 4, P]).
    to="packed68": (cache [NB, 1, 4, P, 16], cache_scale [NB, 1, 4, P]) -> uint8 [NB, P*68].
    P must be a multiple of 16.
    """
    V.choice("to", to, ("aiter_fp4", "packed68"))
    if to == "aiter_fp4":
        V.tensor("cache", cache, (torch.uint8,), None, contiguous=True)
        P = V.page_size_of("cache", cache, 68)
        if P != page_size:
            raise ValueError(f"page_size: cache holds pages of {P} slots, but page_size={page_size} was given")
        V.page_multiple_of_16("cache", P, "the aiter_fp4 layout")
        return packed68_to_aiter_fp4(cache, P)
    V.tensor("cache", cache, (torch.uint8,), (None, 1, 4, None, 16), contiguous=True)
    V.page_multiple_of_16("cache", cache.shape[3], "the aiter_fp4 layout")
    V.tensor("cache_scale", cache_scale, (torch.uint8,), (cache.shape[0], 1, 4, cache.shape[3]), cache.device,
             contiguous=True)
    return aiter_fp4_to_packed68(cache, cache_scale)

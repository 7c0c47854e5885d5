"""SPEC §7.5: every op rejects bad input before launching, with a TypeError (type/dtype) or ValueError
(shape, size, device, layout, option) whose message starts with the offending argument's name and says
what was given, and a rejected call writes nothing (every output and cache stays entirely poison).
T = 0 is a no-op. Device mismatches use the `meta` device (this machine has no GPU)."""
from __future__ import annotations

import pytest
import torch

import dsaquant
from dsaquant import testing as tt

POISON = 0xA5
P = 16


# ------------------------------------------------------------------------------------------------
# base (valid) calls: (function, kwargs, names of the tensors that must stay poison)
# ------------------------------------------------------------------------------------------------
def _indexer(mode, T=4, H=16, page_size=P):
    return (dsaquant.indexer_qk_rope_quant_and_cache,
            tt.make_indexer(T=T, H=H, mode=mode, page_size=page_size, seed=1),
            ["q_out", "weights_out", "kv_cache"] + (["q_scale_out", "kv_cache_scale"] if mode == "fp4" else []))


def _k_store(T=4, page_size=P):
    return dsaquant.index_k_norm_rope_pack_store, tt.make_k_store(T=T, page_size=page_size, seed=1), ["cache"]


def _q_pack(T=4, H=16):
    a = tt.make_q_pack(T=T, H=H, seed=1)
    a["out"] = (tt.poisoned((T, H, 64), torch.uint8, "cpu"), tt.poisoned((T, H), torch.int32, "cpu"),
                tt.poisoned((T, H), torch.float32, "cpu"))
    return dsaquant.index_q_rope_pack_weights, a, ["out"]


def _fake_quant(T=4, H=None):
    q = tt.make_q_pack(T=T, H=H or 1, seed=1)
    x = q["q"] if H else q["q"][:, 0].contiguous()
    a = dict(x=x, positions=q["positions"], freqs=q["freqs"], out=tt.poisoned(tuple(x.shape), x.dtype, "cpu"))
    return dsaquant.rope_fake_quant_fp4, a, ["out"]


def _v4(layout, T=4, page_size=P):
    return (dsaquant.rmsnorm_rope_rotate_fp4quant_kvcache,
            tt.make_v4_k(T=T, page_size=page_size, layout=layout, seed=1), ["kv_cache", "kv_cache_scale"])


def _scorer(layout, B=2, N=1, H=16, page_size=P, NB=4):
    g = torch.Generator().manual_seed(0)
    ri = lambda *s: torch.randint(0, 0x7E, s, generator=g, dtype=torch.uint8)  # noqa: E731
    a = dict(weights=torch.randn(B * N, H, generator=g), context_lens=torch.tensor([20, 7][:B], dtype=torch.int32),
             block_tables=torch.tensor([[2, 0], [1, 3]][:B], dtype=torch.int32), max_seq_len=2 * page_size,
             layout=layout)
    if layout == "fp8_132":
        a.update(q=ri(B, N, H, 128), kv_cache=ri(NB, page_size * 132))
    elif layout == "packed68":
        a.update(q=ri(B, N, H, 64), q_scale=torch.full((B, N, H), 0x7F7F7F7F, dtype=torch.int32),
                 kv_cache=ri(NB, page_size * 68))
    else:
        pad = (H // 16 + 3) // 4 * 4
        a.update(q=ri(B, N, H, 64), q_scale=torch.full((B * N, 1, 4, 16, pad), 127, dtype=torch.uint8),
                 kv_cache=ri(NB, 1, 4, page_size, 16), kv_cache_scale=torch.full((NB, 1, 4, page_size), 127,
                                                                                dtype=torch.uint8))
    return dsaquant.paged_mqa_logits, a, []


def _convert(to, page_size=P):
    g = torch.Generator().manual_seed(0)
    if to == "aiter_fp4":
        a = dict(cache=torch.randint(0, 256, (2, page_size * 68), generator=g, dtype=torch.uint8), to=to,
                 page_size=page_size)
    else:
        a = dict(cache=torch.randint(0, 256, (2, 1, 4, page_size, 16), generator=g, dtype=torch.uint8),
                 cache_scale=torch.randint(0, 256, (2, 1, 4, page_size), generator=g, dtype=torch.uint8), to=to)
    return dsaquant.convert_fp4_cache, a, []


BASES = {
    "indexer_fp8": lambda: _indexer("fp8"),
    "indexer_fp4": lambda: _indexer("fp4"),
    "k_store": _k_store,
    "q_pack": _q_pack,
    "fake_quant_2d": _fake_quant,
    "fake_quant_3d": lambda: _fake_quant(H=3),
    "v4_aiter": lambda: _v4("aiter_fp4"),
    "v4_dense": lambda: _v4("dense"),
    "scorer_fp8": lambda: _scorer("fp8_132"),
    "scorer_packed68": lambda: _scorer("packed68"),
    "scorer_aiter": lambda: _scorer("aiter_fp4"),
    "convert_to_aiter": lambda: _convert("aiter_fp4"),
    "convert_to_packed68": lambda: _convert("packed68"),
}


# ------------------------------------------------------------------------------------------------
# mutations
# ------------------------------------------------------------------------------------------------
def _set(name, fn):
    def m(a):
        a[name] = fn(a)
    return m


def dtype_(name, dtype):
    """Convert an input to `dtype`; an output (all poison) is replaced by a poisoned tensor of `dtype`."""
    def m(a):
        old = a[name]
        if _storage_all_poison(old):
            a[name] = tt.poisoned(tuple(old.shape), dtype, "cpu")
        else:
            a[name] = old.to(dtype)
    return m


def shape_(name, shape_fn, fill=None):
    """Replace `name` by a tensor of the same dtype and shape shape_fn(old shape), poisoned."""
    def m(a):
        old = a[name]
        a[name] = tt.poisoned(tuple(shape_fn(tuple(old.shape))), old.dtype, "cpu")
    return m


def meta_(name):
    return _set(name, lambda a: torch.empty(a[name].shape, dtype=a[name].dtype, device="meta"))


def noncontig_(name):
    """The same shape and dtype, poisoned, but a strided view (last dim stride 2)."""
    def m(a):
        old = a[name]
        big = tt.poisoned(tuple(old.shape[:-1]) + (old.shape[-1] * 2,), old.dtype, "cpu")
        a[name] = big[..., ::2]
    return m


def value_(name, v):
    return _set(name, lambda a: v)


def last_(n):
    return lambda s: s[:-1] + (n,)


def drop_last_dim(s):
    return s[:-1]


def plus_one(i):
    return lambda s: tuple(x + 1 if j == i else x for j, x in enumerate(s))


def rebuild(base_fn):
    """Replace the whole call by another (still bad) base."""
    def m(a):
        _, b, _ = base_fn()
        a.clear()
        a.update(b)
    return m


def seq(*ms):
    def m(a):
        for f in ms:
            f(a)
    return m


TE, VE = TypeError, ValueError

CASES = [
    # ---- §7.1 indexer, FP8 mode ----------------------------------------------------------------
    ("indexer_fp8", "q_fp32", dtype_("q", torch.float32), TE, "q"),
    ("indexer_fp8", "q_head_dim_64", shape_("q", last_(64)), VE, "q"),
    ("indexer_fp8", "q_2d", shape_("q", drop_last_dim), VE, "q"),
    ("indexer_fp8", "q_last_dim_strided", noncontig_("q"), VE, "q"),
    ("indexer_fp8", "q_not_tensor", value_("q", [[1.0]]), TE, "q"),
    ("indexer_fp8", "weights_int", dtype_("weights", torch.int32), TE, "weights"),
    ("indexer_fp8", "weights_shape", shape_("weights", plus_one(1)), VE, "weights"),
    ("indexer_fp8", "weights_device", meta_("weights"), VE, "weights"),
    ("indexer_fp8", "k_other_dtype", dtype_("k", torch.float16), TE, "k"),
    ("indexer_fp8", "k_head_dim", shape_("k", last_(64)), VE, "k"),
    ("indexer_fp8", "k_device", meta_("k"), VE, "k"),
    ("indexer_fp8", "slot_mapping_float", dtype_("slot_mapping", torch.float32), TE, "slot_mapping"),
    ("indexer_fp8", "slot_mapping_shape", shape_("slot_mapping", plus_one(0)), VE, "slot_mapping"),
    ("indexer_fp8", "slot_mapping_device", meta_("slot_mapping"), VE, "slot_mapping"),
    ("indexer_fp8", "norm_weight_shape", shape_("norm_weight", last_(64)), VE, "norm_weight"),
    ("indexer_fp8", "norm_bias_int", dtype_("norm_bias", torch.int64), TE, "norm_bias"),
    ("indexer_fp8", "positions_float", dtype_("positions", torch.float32), TE, "positions"),
    ("indexer_fp8", "positions_shape", shape_("positions", plus_one(0)), VE, "positions"),
    ("indexer_fp8", "cos_cache_width", shape_("cos_cache", last_(64)), VE, "cos_cache"),
    ("indexer_fp8", "cos_cache_empty",
     seq(shape_("cos_cache", lambda s: (0, 32)), shape_("sin_cache", lambda s: (0, 32))),
     VE, "cos_cache"),
    ("indexer_fp8", "sin_cache_dtype", dtype_("sin_cache", torch.float32), TE, "sin_cache"),
    ("indexer_fp8", "sin_cache_rows", shape_("sin_cache", plus_one(0)), VE, "sin_cache"),
    ("indexer_fp8", "epsilon_str", value_("epsilon", "1e-6"), TE, "epsilon"),
    ("indexer_fp8", "weights_scale_none", value_("weights_scale", None), TE, "weights_scale"),
    ("indexer_fp8", "quant_block_size_64", value_("quant_block_size", 64), VE, "quant_block_size"),
    ("indexer_fp8", "quant_block_size_32", value_("quant_block_size", 32), VE, "quant_block_size"),
    ("indexer_fp8", "quant_block_size_float", value_("quant_block_size", 128.0), TE, "quant_block_size"),
    ("indexer_fp8", "scale_fmt_bad", value_("scale_fmt", "e8m0"), VE, "scale_fmt"),
    ("indexer_fp8", "rounding_bad", value_("rounding", "nearest"), VE, "rounding"),
    ("indexer_fp8", "preshuffle_int", value_("preshuffle", 1), TE, "preshuffle"),
    ("indexer_fp8", "is_neox_none", value_("is_neox", None), TE, "is_neox"),
    ("indexer_fp8", "compute_all_str", value_("compute_all_q_rope", "yes"), TE, "compute_all_q_rope"),
    ("indexer_fp8", "q_out_fp16", dtype_("q_out", torch.float16), TE, "q_out"),
    ("indexer_fp8", "q_out_shape", shape_("q_out", last_(64)), VE, "q_out"),
    ("indexer_fp8", "q_out_noncontig", noncontig_("q_out"), VE, "q_out"),
    ("indexer_fp8", "q_out_device", meta_("q_out"), VE, "q_out"),
    ("indexer_fp8", "weights_out_bf16", dtype_("weights_out", torch.bfloat16), TE, "weights_out"),
    ("indexer_fp8", "weights_out_shape", shape_("weights_out", plus_one(1)), VE, "weights_out"),
    ("indexer_fp8", "kv_cache_int32", dtype_("kv_cache", torch.int32), TE, "kv_cache"),
    ("indexer_fp8", "kv_cache_noncontig", noncontig_("kv_cache"), VE, "kv_cache"),
    ("indexer_fp8", "kv_cache_row_bytes", shape_("kv_cache", last_(P * 132 + 4)), VE, "kv_cache"),
    ("indexer_fp8", "kv_cache_1d", shape_("kv_cache", lambda s: (s[0] * s[1],)), VE, "kv_cache"),
    ("indexer_fp8", "kv_cache_device", meta_("kv_cache"), VE, "kv_cache"),
    ("indexer_fp8", "preshuffle_P8", seq(rebuild(lambda: _indexer("fp8", page_size=8)), value_("preshuffle", True)),
     VE, "kv_cache"),
    ("indexer_fp8", "fp8_flavour_contradicts", value_("fp8_flavour", "e4m3fnuz"), VE, "fp8_flavour"),
    ("indexer_fp8", "fp8_flavour_bad", seq(dtype_("q_out", torch.uint8), value_("fp8_flavour", "e5m2")), VE,
     "fp8_flavour"),
    ("indexer_fp8", "only_q_scale_out",
     _set("q_scale_out", lambda a: tt.poisoned((4, 1, 4, 16, 4), torch.uint8, "cpu")),
     VE, "kv_cache_scale"),
    ("indexer_fp8", "only_kv_cache_scale",
     _set("kv_cache_scale", lambda a: tt.poisoned((2, 1, 4, P), torch.uint8, "cpu")),
     VE, "q_scale_out"),
    # ---- §7.1 indexer, FP4 mode ----------------------------------------------------------------
    ("indexer_fp4", "H_8", rebuild(lambda: _indexer("fp4", H=8)), VE, "q"),
    ("indexer_fp4", "H_24", rebuild(lambda: _indexer("fp4", H=24)), VE, "q"),
    ("indexer_fp4", "P_8", rebuild(lambda: _indexer("fp4", page_size=8)), VE, "kv_cache"),
    ("indexer_fp4", "q_scale_out_missing", value_("q_scale_out", None), VE, "q_scale_out"),
    ("indexer_fp4", "kv_cache_scale_missing", value_("kv_cache_scale", None), VE, "kv_cache_scale"),
    ("indexer_fp4", "quant_block_size_128", value_("quant_block_size", 128), VE, "quant_block_size"),
    ("indexer_fp4", "scale_fmt_fp32", value_("scale_fmt", "fp32"), VE, "scale_fmt"),
    ("indexer_fp4", "rounding_bad", value_("rounding", "stochastic"), VE, "rounding"),
    ("indexer_fp4", "q_out_fp8_shape", shape_("q_out", last_(128)), VE, "q_out"),
    ("indexer_fp4", "q_out_fp8_dtype", dtype_("q_out", torch.float8_e4m3fn), TE, "q_out"),
    ("indexer_fp4", "q_scale_out_pad", shape_("q_scale_out", last_(1)), VE, "q_scale_out"),
    ("indexer_fp4", "q_scale_out_int32", dtype_("q_scale_out", torch.int32), TE, "q_scale_out"),
    ("indexer_fp4", "weights_out_int", dtype_("weights_out", torch.int32), TE, "weights_out"),
    ("indexer_fp4", "kv_cache_noncontig", noncontig_("kv_cache"), VE, "kv_cache"),
    ("indexer_fp4", "kv_cache_fp8_132_shape", shape_("kv_cache", lambda s: (s[0], P * 132)), VE, "kv_cache"),
    ("indexer_fp4", "kv_cache_scale_shape", shape_("kv_cache_scale", plus_one(3)), VE, "kv_cache_scale"),
    ("indexer_fp4", "kv_cache_scale_noncontig", noncontig_("kv_cache_scale"), VE, "kv_cache_scale"),
    ("indexer_fp4", "kv_cache_scale_device", meta_("kv_cache_scale"), VE, "kv_cache_scale"),
    # ---- §7.2 index_k_norm_rope_pack_store -------------------------------------------------------
    ("k_store", "k_fp32", dtype_("k", torch.float32), TE, "k"),
    ("k_store", "k_head_dim", shape_("k", last_(64)), VE, "k"),
    ("k_store", "k_3d", shape_("k", lambda s: (s[0], 1, 128)), VE, "k"),
    ("k_store", "norm_weight_int", dtype_("norm_weight", torch.int32), TE, "norm_weight"),
    ("k_store", "norm_weight_shape", shape_("norm_weight", last_(127)), VE, "norm_weight"),
    ("k_store", "eps_str", value_("eps", "x"), TE, "eps"),
    ("k_store", "positions_float", dtype_("positions", torch.float64), TE, "positions"),
    ("k_store", "positions_device", meta_("positions"), VE, "positions"),
    ("k_store", "freqs_bf16", dtype_("freqs", torch.bfloat16), TE, "freqs"),
    ("k_store", "freqs_width", shape_("freqs", last_(32)), VE, "freqs"),
    ("k_store", "freqs_empty", shape_("freqs", lambda s: (0, 64)), VE, "freqs"),
    ("k_store", "slots_float", dtype_("slots", torch.float32), TE, "slots"),
    ("k_store", "slots_shape", shape_("slots", plus_one(0)), VE, "slots"),
    ("k_store", "cache_int8", dtype_("cache", torch.int8), TE, "cache"),
    ("k_store", "cache_noncontig", noncontig_("cache"), VE, "cache"),
    ("k_store", "cache_row_bytes", shape_("cache", last_(P * 68 + 1)), VE, "cache"),
    ("k_store", "cache_device", meta_("cache"), VE, "cache"),
    ("k_store", "compress_ratio_3", value_("compress_ratio", 3), VE, "compress_ratio"),
    ("k_store", "compress_ratio_0", value_("compress_ratio", 0), VE, "compress_ratio"),
    ("k_store", "compress_ratio_float", value_("compress_ratio", 2.0), TE, "compress_ratio"),
    ("k_store", "rounding_bad", value_("rounding", "RNE"), VE, "rounding"),
    # ---- §7.2 index_q_rope_pack_weights ----------------------------------------------------------
    ("q_pack", "q_fp32", dtype_("q", torch.float32), TE, "q"),
    ("q_pack", "q_head_dim", shape_("q", last_(96)), VE, "q"),
    ("q_pack", "positions_shape", shape_("positions", plus_one(0)), VE, "positions"),
    ("q_pack", "freqs_fp64", dtype_("freqs", torch.float64), TE, "freqs"),
    ("q_pack", "head_weights_shape", shape_("head_weights", plus_one(1)), VE, "head_weights"),
    ("q_pack", "head_weights_int", dtype_("head_weights", torch.int32), TE, "head_weights"),
    ("q_pack", "head_weights_device", meta_("head_weights"), VE, "head_weights"),
    ("q_pack", "weight_scale_str", value_("weight_scale", "0.1"), TE, "weight_scale"),
    ("q_pack", "rounding_bad", value_("rounding", None), VE, "rounding"),
    ("q_pack", "out0_dtype", _set("out", lambda a: (tt.poisoned((4, 16, 64), torch.int8, "cpu"),) + a["out"][1:]),
     TE, "out[0]"),
    ("q_pack", "out1_int64",
     _set("out", lambda a: (a["out"][0], tt.poisoned((4, 16), torch.int64, "cpu"), a["out"][2])),
     TE, "out[1]"),
    ("q_pack", "out2_shape", _set("out", lambda a: a["out"][:2] + (tt.poisoned((4, 17), torch.float32, "cpu"),)),
     VE, "out[2]"),
    # ---- §7.2 rope_fake_quant_fp4 ----------------------------------------------------------------
    ("fake_quant_2d", "x_fp32", seq(dtype_("x", torch.float32), dtype_("out", torch.float32)), TE, "x"),
    ("fake_quant_2d", "x_width", seq(shape_("x", last_(64)), shape_("out", last_(64))), VE, "x"),
    ("fake_quant_2d", "x_4d", seq(shape_("x", lambda s: (s[0], 1, 1, 128)), shape_("out", lambda s: (s[0], 1, 1, 128))),
     VE, "x"),
    ("fake_quant_2d", "positions_shape", shape_("positions", plus_one(0)), VE, "positions"),
    ("fake_quant_2d", "freqs_width", shape_("freqs", last_(128)), VE, "freqs"),
    ("fake_quant_2d", "block_32_e4m3", seq(value_("block", 32), value_("scale", "e4m3")), VE, "block"),
    ("fake_quant_2d", "block_16_ue8m0", seq(value_("block", 16), value_("scale", "ue8m0")), VE, "block"),
    ("fake_quant_2d", "scale_bad", value_("scale", "e8m0"), VE, "block"),
    ("fake_quant_2d", "compress_ratio_6", value_("compress_ratio", 6), VE, "compress_ratio"),
    ("fake_quant_3d", "out_dtype", dtype_("out", torch.float16), TE, "out"),
    ("fake_quant_3d", "out_shape", shape_("out", plus_one(1)), VE, "out"),
    ("fake_quant_3d", "out_noncontig", noncontig_("out"), VE, "out"),
    ("fake_quant_3d", "out_device", meta_("out"), VE, "out"),
    # ---- §7.3 rmsnorm_rope_rotate_fp4quant_kvcache -----------------------------------------------
    ("v4_aiter", "kv_int", dtype_("kv", torch.int32), TE, "kv"),
    ("v4_aiter", "kv_width", shape_("kv", last_(64)), VE, "kv"),
    ("v4_aiter", "kv_1d", shape_("kv", lambda s: (s[0] * s[1],)), VE, "kv"),
    ("v4_aiter", "norm_weight_shape", shape_("norm_weight", last_(64)), VE, "norm_weight"),
    ("v4_aiter", "epsilon_none", value_("epsilon", None), TE, "epsilon"),
    ("v4_aiter", "positions_float", dtype_("positions", torch.float32), TE, "positions"),
    ("v4_aiter", "cos_cache_width", shape_("cos_cache", last_(64)), VE, "cos_cache"),
    ("v4_aiter", "sin_cache_dtype", dtype_("sin_cache", torch.float16), TE, "sin_cache"),
    ("v4_aiter", "slot_mapping_shape", shape_("slot_mapping", plus_one(0)), VE, "slot_mapping"),
    ("v4_aiter", "slot_mapping_device", meta_("slot_mapping"), VE, "slot_mapping"),
    ("v4_aiter", "hadamard_int", value_("hadamard", 1), TE, "hadamard"),
    ("v4_aiter", "rounding_bad", value_("rounding", "hw"), VE, "rounding"),
    ("v4_aiter", "layout_packed68", value_("layout", "packed68"), VE, "layout"),
    ("v4_aiter", "P_8", rebuild(lambda: _v4("aiter_fp4", page_size=8)), VE, "kv_cache"),
    ("v4_aiter", "kv_cache_noncontig", noncontig_("kv_cache"), VE, "kv_cache"),
    ("v4_aiter", "kv_cache_dense_shape", shape_("kv_cache", lambda s: (s[0] * s[3], 64)), VE, "kv_cache"),
    ("v4_aiter", "kv_cache_scale_shape", shape_("kv_cache_scale", plus_one(0)), VE, "kv_cache_scale"),
    ("v4_aiter", "kv_cache_scale_none", value_("kv_cache_scale", None), TE, "kv_cache_scale"),
    ("v4_dense", "kv_cache_width", shape_("kv_cache", last_(32)), VE, "kv_cache"),
    ("v4_dense", "kv_cache_noncontig", noncontig_("kv_cache"), VE, "kv_cache"),
    ("v4_dense", "kv_cache_scale_rows", shape_("kv_cache_scale", plus_one(0)), VE, "kv_cache_scale"),
    ("v4_dense", "kv_cache_scale_dtype", dtype_("kv_cache_scale", torch.int32), TE, "kv_cache_scale"),
    ("v4_dense", "layout_bad", value_("layout", "DENSE"), VE, "layout"),
    # ---- §7.4 paged_mqa_logits -------------------------------------------------------------------
    ("scorer_fp8", "layout_bad", value_("layout", "fp4"), VE, "layout"),
    ("scorer_fp8", "q_fp16", dtype_("q", torch.float16), TE, "q"),
    ("scorer_fp8", "q_3d", shape_("q", lambda s: (s[0] * s[1],) + s[2:]), VE, "q"),
    ("scorer_fp8", "q_fp4_width", shape_("q", last_(64)), VE, "q"),
    ("scorer_fp8", "q_noncontig", noncontig_("q"), VE, "q"),
    ("scorer_fp8", "kv_cache_noncontig", noncontig_("kv_cache"), VE, "kv_cache"),
    ("scorer_fp8", "kv_cache_int32", dtype_("kv_cache", torch.int32), TE, "kv_cache"),
    ("scorer_fp8", "kv_cache_row_bytes", shape_("kv_cache", last_(P * 132 + 2)), VE, "kv_cache"),
    ("scorer_fp8", "kv_cache_device", meta_("kv_cache"), VE, "kv_cache"),
    ("scorer_fp8", "preshuffle_P8", seq(rebuild(lambda: _scorer("fp8_132", page_size=8)), value_("preshuffle", True)),
     VE, "kv_cache"),
    ("scorer_fp8", "fp8_flavour_bad", value_("fp8_flavour", "e5m2"), VE, "fp8_flavour"),
    ("scorer_fp8", "weights_shape", shape_("weights", plus_one(1)), VE, "weights"),
    ("scorer_fp8", "weights_int", dtype_("weights", torch.int32), TE, "weights"),
    ("scorer_fp8", "weights_device", meta_("weights"), VE, "weights"),
    ("scorer_fp8", "weights_none", value_("weights", None), TE, "weights"),
    ("scorer_fp8", "context_lens_float", dtype_("context_lens", torch.float32), TE, "context_lens"),
    ("scorer_fp8", "context_lens_shape", shape_("context_lens", plus_one(0)), VE, "context_lens"),
    ("scorer_fp8", "block_tables_float", dtype_("block_tables", torch.float32), TE, "block_tables"),
    ("scorer_fp8", "block_tables_1d", shape_("block_tables", lambda s: (s[0] * s[1],)), VE, "block_tables"),
    ("scorer_fp8", "block_tables_device", meta_("block_tables"), VE, "block_tables"),
    ("scorer_fp8", "max_seq_len_float", value_("max_seq_len", 32.0), TE, "max_seq_len"),
    ("scorer_fp8", "max_seq_len_negative", value_("max_seq_len", -1), VE, "max_seq_len"),
    ("scorer_fp8", "weight_scale_str", value_("weight_scale", "1"), TE, "weight_scale"),
    ("scorer_packed68", "q_scale_none", value_("q_scale", None), VE, "q_scale"),
    ("scorer_packed68", "q_scale_int32_shape", shape_("q_scale", plus_one(2)), VE, "q_scale"),
    ("scorer_packed68", "q_scale_uint8_shape",
     _set("q_scale", lambda a: torch.zeros(tuple(a["q"].shape[:3]) + (3,), dtype=torch.uint8)), VE, "q_scale"),
    ("scorer_packed68", "q_scale_int64", _set("q_scale", lambda a: torch.zeros(tuple(a["q"].shape[:3]) + (4,),
                                                                               dtype=torch.int64)), TE, "q_scale"),
    ("scorer_packed68", "q_width_128", shape_("q", last_(128)), VE, "q"),
    ("scorer_packed68", "q_fp8", dtype_("q", torch.float8_e4m3fn), TE, "q"),
    ("scorer_packed68", "kv_cache_row_bytes", shape_("kv_cache", last_(P * 68 + 4)), VE, "kv_cache"),
    ("scorer_aiter", "H_8", rebuild(lambda: _scorer("aiter_fp4", H=8)), VE, "q"),
    ("scorer_aiter", "P_8", rebuild(lambda: _scorer("aiter_fp4", page_size=8)), VE, "kv_cache"),
    ("scorer_aiter", "q_scale_pad", shape_("q_scale", last_(1)), VE, "q_scale"),
    ("scorer_aiter", "q_scale_rows", shape_("q_scale", plus_one(0)), VE, "q_scale"),
    ("scorer_aiter", "kv_cache_scale_shape", shape_("kv_cache_scale", plus_one(3)), VE, "kv_cache_scale"),
    ("scorer_aiter", "kv_cache_scale_none", value_("kv_cache_scale", None), TE, "kv_cache_scale"),
    ("scorer_aiter", "kv_cache_packed68", shape_("kv_cache", lambda s: (s[0], P * 68)), VE, "kv_cache"),
    # ---- §6 convert_fp4_cache --------------------------------------------------------------------
    ("convert_to_aiter", "to_bad", value_("to", "fp8_132"), VE, "to"),
    ("convert_to_aiter", "page_size_mismatch", value_("page_size", 64), VE, "page_size"),
    ("convert_to_aiter", "P_8", seq(rebuild(lambda: _convert("aiter_fp4", page_size=8))), VE, "cache"),
    ("convert_to_aiter", "cache_int8", dtype_("cache", torch.int8), TE, "cache"),
    ("convert_to_aiter", "cache_noncontig", noncontig_("cache"), VE, "cache"),
    ("convert_to_packed68", "cache_scale_shape", shape_("cache_scale", plus_one(3)), VE, "cache_scale"),
    ("convert_to_packed68", "cache_scale_none", value_("cache_scale", None), TE, "cache_scale"),
    ("convert_to_packed68", "P_8", rebuild(lambda: _convert("packed68", page_size=8)), VE, "cache"),
    ("convert_to_packed68", "cache_packed68_shape", shape_("cache", lambda s: (s[0], P * 68)), VE, "cache"),
]


def _storage_all_poison(t) -> bool:
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return True
    s = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return bool((s == POISON).all())


def _outputs(a, names):
    for n in names:
        v = a.get(n)
        for t in (v if isinstance(v, tuple) else (v,)):
            if isinstance(t, torch.Tensor):
                yield n, t


@pytest.fixture(autouse=True)
def _flags():
    try:
        dsaquant.check_errors()
    except dsaquant.DsaquantError:
        pass
    yield
    dsaquant.check_errors()          # a rejected call raised no device flag either


@pytest.mark.parametrize("base", sorted(BASES))
def test_base_call_is_valid(base):
    """Each unmutated base call runs (so every rejection below is caused by its one mutation)."""
    fn, a, outs = BASES[base]()
    fn(**a)
    for n, t in _outputs(a, outs):
        assert not _storage_all_poison(t), n


def test_every_base_has_cases():
    assert {c[0] for c in CASES} == set(BASES)


@pytest.mark.parametrize("base,case,mutate,exc,name", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_bad_input(base, case, mutate, exc, name):
    fn, a, outs = BASES[base]()
    mutate(a)
    for n, t in _outputs(a, outs):
        assert _storage_all_poison(t), f"{n} not poisoned before the call"
    with pytest.raises(exc) as ei:
        fn(**a)
    msg = str(ei.value)
    assert type(ei.value) is exc, (type(ei.value), msg)
    assert msg.startswith(name), msg
    assert any(w in msg for w in ("got", "given", "contradicts")), msg     # says what was given
    for n, t in _outputs(a, outs):
        assert _storage_all_poison(t), f"{n} was written by a rejected call ({case})"


# Bad inputs that once slipped past the wrappers (32.0 == 32 in a tuple test; an unchecked flag) and
# reached torch.library's schema check as a RuntimeError instead of SPEC §7.5's TypeError.
KNOWN_GAPS = [
    pytest.param("fake_quant_2d", "block_float", value_("block", 32.0), TE, "block", id="fake_quant-block_float"),
    pytest.param("scorer_fp8", "preshuffle_str", value_("preshuffle", "yes"), TE, "preshuffle",
                 id="scorer-preshuffle_str"),
    pytest.param("scorer_packed68", "preshuffle_int", value_("preshuffle", 1), TE, "preshuffle",
                 id="scorer-preshuffle_int"),
]


@pytest.mark.parametrize("base,case,mutate,exc,name", KNOWN_GAPS)
def test_bad_input_known_gaps(base, case, mutate, exc, name):
    test_bad_input(base, case, mutate, exc, name)


# ---- T = 0 of every op: tests/test_edge_cases.py test_zero_tokens_is_a_noop ------------------------------
def test_zero_length_scorer_context():
    """A scorer call with max_seq_len = 0 returns an empty [B*N, 0] tensor."""
    fn, a, _ = _scorer("fp8_132")
    a["max_seq_len"] = 0
    a["context_lens"] = torch.zeros(2, dtype=torch.int32)
    out = fn(**a)
    assert out.shape == (2, 0) and out.dtype == torch.float32


# ---- float scalars: NaN and infinities rejected (ValueError naming the argument), nothing written ----
def _compress():
    return dsaquant.compress_kv, tt.make_compress_kv(lens=(8,), quant_mode="fp4"), ["cache", "state_kv",
                                                                                      "state_score"]


# (base, argument): every float scalar of every op. `eps`/`epsilon` are norm epsilons (also rejected <= 0).
FLOAT_ARGS = [("indexer_fp8", "epsilon"), ("indexer_fp8", "weights_scale"), ("indexer_fp4", "epsilon"),
              ("indexer_fp4", "weights_scale"), ("k_store", "eps"), ("q_pack", "weight_scale"),
              ("v4_aiter", "epsilon"), ("v4_dense", "epsilon"), ("scorer_fp8", "weight_scale"),
              ("scorer_packed68", "weight_scale"), ("scorer_aiter", "weight_scale"), ("compress_kv", "epsilon")]
FLOAT_BASES = {**BASES, "compress_kv": _compress}


def _bytes(t):
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


def _rejected(base, arg, value, match):
    """Call base with arg=value: a ValueError whose message matches, and no tensor argument changed."""
    fn, a, _ = FLOAT_BASES[base]()
    a[arg] = value
    before = {n: _bytes(t) for n, t in a.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(ValueError) as ei:
        fn(**a)
    assert type(ei.value) is ValueError and ei.value.args[0] == match, ei.value
    for n, t in a.items():
        if isinstance(t, torch.Tensor):
            assert torch.equal(_bytes(t), before[n]), f"{n} was written by a rejected call"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("base,arg", FLOAT_ARGS, ids=[f"{b}-{n}" for b, n in FLOAT_ARGS])
def test_non_finite_float_scalar(base, arg, value):
    _rejected(base, arg, value, f"{arg}: expected a finite number, got {value!r}")


EPS_ARGS = [c for c in FLOAT_ARGS if c[1] in ("eps", "epsilon")]


@pytest.mark.parametrize("value", [-1e-6, 0.0, -0.0, 0, -1], ids=["neg", "zero", "negzero", "int0", "int-1"])
@pytest.mark.parametrize("base,arg", EPS_ARGS, ids=[f"{b}-{n}" for b, n in EPS_ARGS])
def test_epsilon_not_positive(base, arg, value):
    _rejected(base, arg, value, f"{arg}: expected a number > 0, got {value!r}")


@pytest.mark.parametrize("value,fp32", [(1e-50, 0.0), (2.0 ** -150, 0.0), (1e39, float("inf"))],
                         ids=["underflow", "half-subnormal", "overflow"])
@pytest.mark.parametrize("base,arg", EPS_ARGS, ids=[f"{b}-{n}" for b, n in EPS_ARGS])
def test_epsilon_not_positive_in_fp32(base, arg, value, fp32):
    """Every backend adds the epsilon in fp32: one that rounds to 0 or to inf there is rejected too."""
    _rejected(base, arg, value, f"{arg}: expected a number > 0 and finite in fp32, got {value!r} (fp32: {fp32!r})")


@pytest.mark.parametrize("base,arg", FLOAT_ARGS, ids=[f"{b}-{n}" for b, n in FLOAT_ARGS])
def test_finite_float_scalar_accepted(base, arg):
    """The rejections above are about the value only: the same call with a finite value (an int; for an
    epsilon, the smallest positive fp32 subnormal) runs."""
    fn, a, _ = FLOAT_BASES[base]()
    a[arg] = 2.0 ** -149 if (base, arg) in EPS_ARGS else 2
    fn(**a)


# ---- every tensor argument of every op on the op's device -------------------------------------------------
# A call whose tensors are on different devices is rejected (ValueError) before anything is written, whichever
# tensor is the odd one out: each tensor argument in turn (each element of a tuple of outputs too) is moved to
# the `meta` device. The compiled backends launch on the device of the tensors, so a mixed call must never
# reach them.
def _v4_compress(quant_mode, layout="packed68", use_freqs=False):
    return dsaquant.compress_kv, tt.make_compress_kv(starts=(0, 3), lens=(6, 5), quant_mode=quant_mode,
                                                     layout=layout, use_freqs=use_freqs, seed=1), []


def _v4_rotate(out):
    return dsaquant.rope_rotate_quant, tt.make_rope_rotate_quant(T=3, out=out, seed=1), []


DEVICE_BASES = dict(BASES, compress_fp4_aiter=lambda: _v4_compress("fp4", "aiter_fp4"),
                    compress_fp8=lambda: _v4_compress("fp8"),
                    compress_freqs=lambda: _v4_compress("none", use_freqs=True),
                    rotate_fp4=lambda: _v4_rotate("fp4"), rotate_fp8=lambda: _v4_rotate("e4m3fn"))


def _tensor_args(base):
    """(base, name, index in a tuple or None) of each tensor argument, where the call has two or more."""
    _, a, _ = DEVICE_BASES[base]()
    found = []
    for name, v in a.items():
        if isinstance(v, torch.Tensor):
            found.append((base, name, None))
        elif isinstance(v, tuple):
            found += [(base, name, i) for i, t in enumerate(v) if isinstance(t, torch.Tensor)]
    return found if len(found) > 1 else []


DEVICE_CASES = [c for base in sorted(DEVICE_BASES) for c in _tensor_args(base)]


def _to_meta(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


@pytest.mark.parametrize("base,name,index", DEVICE_CASES,
                         ids=[f"{b}-{n}" + ("" if i is None else f"[{i}]") for b, n, i in DEVICE_CASES])
def test_every_tensor_argument_on_another_device_is_rejected(base, name, index):
    fn, a, _ = DEVICE_BASES[base]()
    if index is None:
        a[name] = _to_meta(a[name])
    else:
        a[name] = tuple(_to_meta(t) if i == index else t for i, t in enumerate(a[name]))
    before = {(n, i): t.clone() for n, v in a.items() for i, t in
              enumerate(v if isinstance(v, tuple) else (v,)) if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
    with pytest.raises(ValueError, match="meta") as ei:
        fn(**a)
    assert type(ei.value) is ValueError and "expected a tensor on" in str(ei.value), str(ei.value)
    for (n, i), t in before.items():
        now = a[n][i] if isinstance(a[n], tuple) else a[n]
        assert torch.equal(now.view(torch.uint8) if now.dim() else now, t.view(torch.uint8) if t.dim() else t), \
            f"{n} was written by a rejected call"


def test_device_cases_cover_every_op():
    ops = {DEVICE_BASES[b]()[0].__name__ for b, _, _ in DEVICE_CASES}
    assert ops == {"indexer_qk_rope_quant_and_cache", "index_k_norm_rope_pack_store", "index_q_rope_pack_weights",
                   "rope_fake_quant_fp4", "rmsnorm_rope_rotate_fp4quant_kvcache", "paged_mqa_logits",
                   "convert_fp4_cache", "compress_kv", "rope_rotate_quant"}, ops

"""torch.compile(fullgraph=True) over every public op, and torch.library.opcheck on the custom ops.

Every op is a torch.library custom op with a fake implementation and declared mutations, so a compiled
call must trace without a graph break and give the same bytes as the eager call. CPU backends "eager"
and "aot_eager" keep this fast; one op also goes through the default inductor backend.
"""
from __future__ import annotations

import pytest
import torch

import dsaquant
from dsaquant import testing as tt


def _scorer_args(layout, B=2, N=2, H=16, P=16, NB=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ri = lambda *s: torch.randint(0, 0x7E, s, generator=g, dtype=torch.uint8)  # noqa: E731
    a = dict(weights=torch.randn(B * N, H, generator=g), context_lens=torch.tensor([27, 9], dtype=torch.int32),
             block_tables=torch.tensor([[2, 0], [1, 3]], dtype=torch.int32), max_seq_len=2 * P, layout=layout)
    if layout == "fp8_132":
        a.update(q=ri(B, N, H, 128), kv_cache=ri(NB, P * 132), preshuffle=True)
    elif layout == "packed68":
        a.update(q=ri(B, N, H, 64), kv_cache=ri(NB, P * 68),
                 q_scale=torch.randint(120, 134, (B, N, H, 4), generator=g, dtype=torch.uint8))
    else:
        a.update(q=ri(B, N, H, 64), q_scale=torch.randint(120, 134, (B * N, 1, 4, 16, 4), generator=g,
                                                          dtype=torch.uint8),
                 kv_cache=ri(NB, 1, 4, P, 16),
                 kv_cache_scale=torch.randint(120, 134, (NB, 1, 4, P), generator=g, dtype=torch.uint8))
    return a


def _convert_args(to, P=16):
    g = torch.Generator().manual_seed(1)
    if to == "aiter_fp4":
        return dict(cache=torch.randint(0, 256, (2, P * 68), generator=g, dtype=torch.uint8), to=to, page_size=P)
    return dict(cache=torch.randint(0, 256, (2, 1, 4, P, 16), generator=g, dtype=torch.uint8),
                cache_scale=torch.randint(0, 256, (2, 1, 4, P), generator=g, dtype=torch.uint8), to=to)


def _fake_quant_args(H=None, **kw):
    q = tt.make_q_pack(T=8, H=H or 1, seed=2)
    x = q["q"] if H else q["q"][:, 0].contiguous()
    return dict(x=x, positions=q["positions"], freqs=q["freqs"], **kw)


# name -> (function, builder of fresh kwargs (outputs poisoned), names of mutated outputs)
OPS = {
    "indexer_fp8": (dsaquant.indexer_qk_rope_quant_and_cache,
                    lambda: tt.make_indexer(T=8, H=16, mode="fp8", page_size=16, seed=1),
                    ("q_out", "weights_out", "kv_cache")),
    "indexer_fp8_preshuffle_fp32scale": (
        dsaquant.indexer_qk_rope_quant_and_cache,
        lambda: tt.make_indexer(T=8, H=16, mode="fp8", page_size=16, seed=1, preshuffle=True, scale_fmt=None,
                                compute_all_q_rope=True, is_neox=False, fp8_dtype=torch.float8_e4m3fnuz),
        ("q_out", "weights_out", "kv_cache")),
    "indexer_fp4": (dsaquant.indexer_qk_rope_quant_and_cache,
                    lambda: tt.make_indexer(T=8, H=16, mode="fp4", page_size=16, seed=1),
                    ("q_out", "weights_out", "kv_cache", "q_scale_out", "kv_cache_scale")),
    "k_store": (dsaquant.index_k_norm_rope_pack_store,
                lambda: tt.make_k_store(T=8, page_size=16, seed=1, compress_ratio=4), ("cache",)),
    "q_pack": (dsaquant.index_q_rope_pack_weights, lambda: tt.make_q_pack(T=8, H=16, seed=1), ()),
    "fake_quant_ue8m0": (dsaquant.rope_fake_quant_fp4, lambda: _fake_quant_args(), ()),
    "fake_quant_e4m3_3d": (dsaquant.rope_fake_quant_fp4, lambda: _fake_quant_args(H=4, block=16, scale="e4m3"), ()),
    "v4_aiter": (dsaquant.rmsnorm_rope_rotate_fp4quant_kvcache,
                 lambda: tt.make_v4_k(T=8, page_size=16, seed=1), ("kv_cache", "kv_cache_scale")),
    "v4_dense": (dsaquant.rmsnorm_rope_rotate_fp4quant_kvcache,
                 lambda: tt.make_v4_k(T=8, page_size=16, seed=1, layout="dense", hadamard=False),
                 ("kv_cache", "kv_cache_scale")),
    "scorer_fp8": (dsaquant.paged_mqa_logits, lambda: _scorer_args("fp8_132"), ()),
    "scorer_packed68": (dsaquant.paged_mqa_logits, lambda: _scorer_args("packed68"), ()),
    "scorer_aiter": (dsaquant.paged_mqa_logits, lambda: _scorer_args("aiter_fp4"), ()),
    "convert_to_aiter": (dsaquant.convert_fp4_cache, lambda: _convert_args("aiter_fp4"), ()),
    "convert_to_packed68": (dsaquant.convert_fp4_cache, lambda: _convert_args("packed68"), ()),
}


def _bytes(x):
    if isinstance(x, torch.Tensor):
        return [x.contiguous().view(torch.uint8).reshape(-1).clone()]
    if isinstance(x, (tuple, list)):
        return [b for t in x for b in _bytes(t)]
    return []


def _run(fn, a, outs):
    r = fn(**a)
    return _bytes(r) + [b for n in outs for b in _bytes(a[n])]


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _check_compiled(name, backend):
    fn, build, outs = OPS[name]
    eager = _run(fn, build(), outs)
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    got = _run(compiled, build(), outs)
    assert len(got) == len(eager) and len(got) > 0
    for i, (e, c) in enumerate(zip(eager, got)):
        assert torch.equal(e, c), (name, i)
    # and a second compiled call reuses the graph with the same result
    again = _run(compiled, build(), outs)
    assert all(torch.equal(e, c) for e, c in zip(eager, again))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_compile_fullgraph_matches_eager(name, backend):
    _check_compiled(name, backend)


@pytest.mark.parametrize("name", ["indexer_fp4", "k_store", "scorer_packed68"])
def test_compile_first_call_is_compiled(name):
    """No eager warm-up: the compiled call is the first call of the op in a fresh Dynamo state."""
    fn, build, outs = OPS[name]
    got = _run(torch.compile(fn, fullgraph=True, backend="aot_eager"), build(), outs)
    want = _run(fn, build(), outs)
    assert all(torch.equal(e, c) for e, c in zip(want, got))


def test_compile_inductor_one_op():
    """The default backend (inductor) on the indexer: the graph is one opaque custom-op call."""
    _check_compiled("indexer_fp8", "inductor")


def test_compile_keeps_the_slot_flag():
    """A compiled call still skips an out-of-capacity slot and raises the device flag."""
    fn, build, outs = OPS["k_store"]
    a = build()
    a["slots"][0] = a["cache"].shape[0] * 16
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    compiled(**a)
    with pytest.raises(dsaquant.DsaquantError):
        dsaquant.check_errors()


# ---- torch.library.opcheck on the raw custom ops ---------------------------------------------------
def _indexer_raw(mode, fp8_dtype=torch.uint8):
    a = tt.make_indexer(T=4, H=16, mode=mode, page_size=16, seed=3, fp8_dtype=fp8_dtype)
    a.pop("rounding")
    return (torch.ops.dsaquant.indexer_qk_rope_quant_and_cache.default,
            (a["q"], a["q_out"], a["weights"], a["weights_out"], a["k"], a["kv_cache"], a["slot_mapping"],
             a["norm_weight"], a["norm_bias"], a["positions"], a["cos_cache"], a["sin_cache"], 1e-6,
             a["quant_block_size"], a["scale_fmt"], 0.25, False, True, False, a.get("q_scale_out"),
             a.get("kv_cache_scale"), "hardware", "e4m3fn", 16, "reference"))


def _k_store_raw():
    a = tt.make_k_store(T=4, page_size=16, seed=3)
    return (torch.ops.dsaquant.index_k_norm_rope_pack_store.default,
            (a["k"], a["norm_weight"], 1e-6, a["positions"], a["freqs"], a["slots"], a["cache"], 2, "rne", 16,
             "reference"))


def _q_pack_raw():
    a = tt.make_q_pack(T=4, H=16, seed=3)
    return (torch.ops.dsaquant.index_q_rope_pack_weights.default,
            (a["q"], a["positions"], a["freqs"], a["head_weights"], 0.5, "rne",
             torch.empty(4, 16, 64, dtype=torch.uint8), torch.empty(4, 16, dtype=torch.int32),
             torch.empty(4, 16, dtype=torch.float32), "reference"))


def _fake_quant_raw():
    a = _fake_quant_args(H=2)
    return (torch.ops.dsaquant.rope_fake_quant_fp4.default,
            (a["x"], a["positions"], a["freqs"], 32, "ue8m0", 1, torch.empty_like(a["x"]), "reference"))


def _v4_raw():
    a = tt.make_v4_k(T=4, page_size=16, seed=3)
    return (torch.ops.dsaquant.rmsnorm_rope_rotate_fp4quant_kvcache.default,
            (a["kv"], a["norm_weight"], 1e-6, a["positions"], a["cos_cache"], a["sin_cache"], a["slot_mapping"],
             a["kv_cache"], a["kv_cache_scale"], True, "hardware", "aiter_fp4", 16, "reference"))


def _scorer_raw():
    a = _scorer_args("aiter_fp4")
    B, N = a["q"].shape[:2]
    out = torch.empty((B * N, a["max_seq_len"]), dtype=torch.float32)
    return (torch.ops.dsaquant.paged_mqa_logits.default,
            (a["q"], a["kv_cache"], a["weights"], a["context_lens"], a["block_tables"], a["max_seq_len"], "aiter_fp4",
             a["q_scale"], a["kv_cache_scale"], 0.5, False, "e4m3fn", 16, True, out, "reference"))


RAW = {"indexer_fp8": lambda: _indexer_raw("fp8"), "indexer_fp4": lambda: _indexer_raw("fp4"),
       "k_store": _k_store_raw, "q_pack": _q_pack_raw, "fake_quant": _fake_quant_raw, "v4": _v4_raw,
       "scorer": _scorer_raw}


@pytest.mark.parametrize("name", sorted(RAW))
def test_opcheck(name):
    op, args = RAW[name]()
    res = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in res.values()), res


def test_opcheck_fp8_dtype_q_out():
    """With a float8 q_out, torch's SchemaCheckMode itself cannot compare the tensors (it multiplies them,
    which CPU float8 does not implement), so only the other opcheck utilities apply."""
    op, args = _indexer_raw("fp8", fp8_dtype=torch.float8_e4m3fn)
    res = torch.library.opcheck(op, args, test_utils=("test_autograd_registration", "test_faketensor",
                                                      "test_aot_dispatch_dynamic"))
    assert all(v == "SUCCESS" for v in res.values()), res

"""The automatic choice's table (preference.py) and dispatch.choose with it, on a CPU-only machine: GPU
backends are faked (registered stand-ins, a device of type cuda that no kernel ever sees)."""
from __future__ import annotations

import pytest
import torch

from dsaquant import dispatch, preference
from dsaquant.preference import DEFAULT, Rule

GPU = torch.device("cuda", 0)
NV, AMD = DEFAULT["nvidia"], DEFAULT["amd"]
TRITON_FIRST = ("triton", "cuda", "reference")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("DSAQUANT_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


# ---- the table ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["indexer_qk_rope_quant_and_cache", "index_q_rope_pack_weights", "paged_mqa_logits",
                                "topk_indices", "rope_fake_quant_fp4", "index_k_norm_rope_pack_store",
                                "rmsnorm_rope_rotate_fp4quant_kvcache", "mqa_logits", "no_such_op"])
@pytest.mark.parametrize("size", [None, 1, 1024, 8192])
def test_default_order_on_nvidia(op, size):
    assert preference.order("nvidia", op, size) == NV == ("cuda", "triton", "reference")


def test_variants_on_nvidia():
    v = preference.variant
    assert v("compress_kv", ratio=128) == "ratio=128" and v("compress_kv", ratio=4) == "ratio=4"
    assert v("compress_kv", ratio=4, decode=True) == "ratio=4 decode"
    assert v("rope_rotate_quant", out_format="fp4") == "fp4"
    assert v("paged_mqa_logits", ratio=4) is None and v("compress_kv") is None
    assert v("indexer_qk_rope_quant_and_cache", out_format="fp8") == "fp8"
    for ratio in (4, 128):      # measured faster on cuda at every T, decode steps included
        for T in (1, 64, 1024, 8192, 32768):
            assert preference.order("nvidia", "compress_kv", T, v("compress_kv", ratio=ratio)) == NV
        assert preference.order("nvidia", "compress_kv", 1, v("compress_kv", ratio=ratio, decode=True)) == NV
    assert preference.order("nvidia", "compress_kv", 8192) == NV                 # no variant: the default
    assert preference.order("nvidia", "rope_rotate_quant", 8192, "fp4") == TRITON_FIRST
    assert preference.order("nvidia", "rope_rotate_quant", 64, "fp4") == NV
    assert preference.order("nvidia", "indexer_qk_rope_quant_and_cache", 1024, "fp8") == TRITON_FIRST
    for T, mode in ((64, "fp8"), (8192, "fp8"), (1024, "fp4")):
        assert preference.order("nvidia", "indexer_qk_rope_quant_and_cache", T, mode) == NV
    for fmt in ("fp8", "half", None):                                              # not measured
        assert preference.order("nvidia", "rope_rotate_quant", 8192, fmt) == NV


@pytest.mark.parametrize("op", sorted(set(preference.TABLE["nvidia"]) | {"paged_mqa_logits", "compress_kv"}))
@pytest.mark.parametrize("variant", [None, "fp4", "ratio=128"])
def test_amd_keeps_the_default_order(op, variant):
    assert preference.order("amd", op, 8192, variant) == AMD == ("hip", "triton", "reference")


def test_unknown_vendor_raises():
    with pytest.raises(ValueError, match="intel"):
        preference.order("intel", "compress_kv")


def test_size_rules(monkeypatch):
    """A synthetic table: sizes in [min_size, max_size), the first matching rule wins, a call without a
    size skips ranged rules, and an order is completed with the default's remaining backends."""
    rules = (Rule(("triton",), variant="fp8", max_size=64),
             Rule(("triton", "cuda", "reference"), min_size=1024, max_size=8192),
             Rule(("reference",), min_size=100000),
             Rule(("cuda", "triton", "reference"), variant="fp4"))
    monkeypatch.setitem(preference.TABLE, "nvidia", {"op": rules})
    order = preference.order
    assert order("nvidia", "op", 16, "fp8") == ("triton", "cuda", "reference")      # completed
    assert order("nvidia", "op", 64, "fp8") == NV                                    # max_size excluded
    assert order("nvidia", "op", 16, "fp4") == NV
    assert order("nvidia", "op", 1023) == NV
    assert order("nvidia", "op", 1024) == TRITON_FIRST
    assert order("nvidia", "op", 8191) == TRITON_FIRST
    assert order("nvidia", "op", 8192) == NV
    assert order("nvidia", "op", 100000) == ("reference", "cuda", "triton")
    assert order("nvidia", "op", None) == NV and order("nvidia", "op", None, "fp8") == NV
    assert order("nvidia", "op", None, "fp4") == NV
    assert order("nvidia", "other", 2048) == NV


def test_every_rule_names_known_backends_and_measurements():
    for vendor, ops in preference.TABLE.items():
        assert vendor in preference.VENDORS
        for op, rules in ops.items():
            for r in rules:
                assert r.order and set(r.order) <= set(dispatch.BACKENDS), (op, r)
                assert r.why, (op, "a rule says which measurement it comes from")
                assert preference.order(vendor, op, 8192, r.variant)[0] in dispatch.BACKENDS


def test_describe_lists_every_rule_and_the_default():
    lines = preference.describe("nvidia")
    assert not any(line.startswith("compress_kv") for line in lines)
    assert "rope_rotate_quant [fp4, 1024 <= T]: triton > cuda > reference" in lines
    assert "indexer_qk_rope_quant_and_cache [fp8, 1024 <= T < 2048]: triton > cuda > reference" in lines
    assert lines[-1].endswith("cuda > triton > reference")
    assert preference.describe("amd") == [lines[-1].replace("cuda > triton", "hip > triton")]


# ---- dispatch.choose with the table -------------------------------------------------------------------
def _fake_backends(monkeypatch, impls: dict[str, set[str]]):
    """Make each backend of `impls` available with stand-ins for the named ops (others unavailable)."""
    assert dispatch.available("reference")[0]            # the real reference, loaded before faking the rest
    for b in ("triton", "cuda", "hip"):
        monkeypatch.setitem(dispatch._impls, b, {op: (lambda *a: None) for op in impls.get(b, ())})
    monkeypatch.setattr(dispatch, "_loaded", set(dispatch._loaded) | {"reference", "triton", "cuda", "hip"})
    errs = {b: "not built" for b in ("triton", "cuda", "hip") if b not in impls}
    errs.update({k: v for k, v in dispatch._load_errors.items() if k == "reference"})
    monkeypatch.setattr(dispatch, "_load_errors", errs)


OPS = ("index_q_rope_pack_weights", "index_k_norm_rope_pack_store", "rmsnorm_rope_rotate_fp4quant_kvcache",
       "indexer_qk_rope_quant_and_cache", "paged_mqa_logits", "compress_kv", "rope_rotate_quant", "topk_indices")


def test_choose_follows_the_table_on_nvidia(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    _fake_backends(monkeypatch, {"cuda": set(OPS), "triton": set(OPS)})
    assert dispatch.vendor() == "nvidia"
    assert dispatch.choose("index_q_rope_pack_weights", GPU) == "cuda"
    assert dispatch.choose("index_q_rope_pack_weights", GPU, size=8192) == "cuda"
    assert dispatch.choose("index_k_norm_rope_pack_store", GPU, size=16) == "cuda"
    assert dispatch.choose("rmsnorm_rope_rotate_fp4quant_kvcache", GPU, size=1) == "cuda"
    assert dispatch.choose("indexer_qk_rope_quant_and_cache", GPU, size=1024) == "cuda"
    assert dispatch.choose("paged_mqa_logits", GPU, size=64) == "cuda"
    assert dispatch.choose("topk_indices", GPU, size=64) == "cuda"
    assert dispatch.choose("compress_kv", GPU, size=32768, variant="ratio=128") == "cuda"
    assert dispatch.choose("compress_kv", GPU, size=8192, variant="ratio=128") == "cuda"
    assert dispatch.choose("compress_kv", GPU, size=8192, variant="ratio=4") == "cuda"
    assert dispatch.choose("rope_rotate_quant", GPU, size=8192, variant="fp4") == "triton"
    assert dispatch.choose("rope_rotate_quant", GPU, size=8192, variant="fp8") == "cuda"
    # the CPU is never affected by the table
    assert dispatch.choose("index_q_rope_pack_weights", torch.device("cpu"), size=8192) == "reference"


def test_choose_falls_back_along_the_order(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    # triton missing: the triton-first op runs on cuda; triton lacking one op: cuda for that op
    _fake_backends(monkeypatch, {"cuda": set(OPS)})
    assert dispatch.choose("index_q_rope_pack_weights", GPU, size=1024) == "cuda"
    _fake_backends(monkeypatch, {"cuda": set(OPS), "triton": set(OPS) - {"index_k_norm_rope_pack_store"}})
    assert dispatch.choose("index_k_norm_rope_pack_store", GPU, size=1024) == "cuda"
    # neither GPU backend: the reference
    _fake_backends(monkeypatch, {})
    assert dispatch.choose("index_q_rope_pack_weights", GPU, size=1024) == "reference"


def test_forced_backends_ignore_the_table(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    _fake_backends(monkeypatch, {"cuda": set(OPS), "triton": set(OPS)})
    assert dispatch.choose("index_q_rope_pack_weights", GPU, "cuda", size=8192) == "cuda"
    assert dispatch.choose("paged_mqa_logits", GPU, "triton", size=64) == "triton"
    monkeypatch.setenv("DSAQUANT_BACKEND", "cuda")
    assert dispatch.choose("rope_rotate_quant", GPU, size=8192, variant="fp4") == "cuda"   # the table says triton
    assert dispatch.choose("compress_kv", GPU, "triton", size=8192) == "triton"      # the argument wins


def test_choose_on_amd_keeps_the_default(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "7.0")
    _fake_backends(monkeypatch, {"hip": set(OPS), "triton": set(OPS)})
    assert dispatch.vendor() == "amd"
    for op in OPS:
        assert dispatch.choose(op, GPU, size=8192, variant="ratio=128" if op == "compress_kv" else None) == "hip"
    _fake_backends(monkeypatch, {"triton": set(OPS)})
    assert dispatch.choose("paged_mqa_logits", GPU, size=64) == "triton"


def test_size_key_is_on_the_same_side_of_every_bound(monkeypatch):
    monkeypatch.setitem(preference.TABLE, "nvidia", {"op": (Rule(("triton",), min_size=64, max_size=1024),)})
    monkeypatch.setitem(preference.TABLE, "amd", {"op": (Rule(("triton",), min_size=8192),)})
    keys = {n: preference.size_key("op", n) for n in (0, 1, 63, 64, 1023, 1024, 8191, 8192, 70000)}
    assert keys == {0: 0, 1: 0, 63: 0, 64: 64, 1023: 64, 1024: 1024, 8191: 1024, 8192: 8192, 70000: 8192}
    for n, k in keys.items():
        for vendor in ("nvidia", "amd"):
            assert preference.order(vendor, "op", n) == preference.order(vendor, "op", k), (vendor, n)
    assert preference.size_key("no_rules", 12345) == 0


def test_choose_for_passes_the_size_key(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    _fake_backends(monkeypatch, {"cuda": set(OPS), "triton": set(OPS)})
    monkeypatch.setitem(preference.TABLE, "nvidia",
                        {"paged_mqa_logits": (Rule(("triton",), min_size=100, max_size=200),)})
    assert [dispatch.choose_for("paged_mqa_logits", GPU, None, n) for n in (99, 100, 199, 200)] == \
        ["cuda", "triton", "triton", "cuda"]
    assert dispatch.choose_for("paged_mqa_logits", GPU, "cuda", 150) == "cuda"


def test_choose_for_under_torch_compile_with_dynamic_shapes(monkeypatch):
    """A symbolic T reaches the rules as guards on their bounds, never as an argument of the trace-time
    constant choose(): fullgraph compiles, one graph per side of the bounds."""
    import dsaquant
    from dsaquant import testing as tt
    monkeypatch.setitem(preference.TABLE, "nvidia",
                        {"index_q_rope_pack_weights": (Rule(("triton",), min_size=10),)})
    torch._dynamo.reset()
    f = torch.compile(dsaquant.index_q_rope_pack_weights, fullgraph=True, backend="eager")
    for T in (4, 6, 12, 14):
        a = tt.make_q_pack(T=T, H=16, seed=T)
        for k in ("q", "positions", "head_weights"):   # T symbolic; "maybe": guards on the rule's bounds allowed
            torch._dynamo.maybe_mark_dynamic(a[k], 0)
        got = f(a["q"], a["positions"], a["freqs"], a["head_weights"], 0.5)
        want = dsaquant.index_q_rope_pack_weights(a["q"], a["positions"], a["freqs"], a["head_weights"], 0.5)
        assert all(torch.equal(x, y) for x, y in zip(got, want)), T
    torch._dynamo.reset()

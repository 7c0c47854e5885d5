"""dsaquant.compat.deep_gemm's prefill logits (fp8_mqa_logits, fp8_fp4_mqa_logits) against DeepGEMM's documented
semantics, written out here in plain torch: argument order and tuples, defaults, the compressed layout
(column c = key cu_seq_len_k_start[i] + c, clean_logits=False required), int32 UE8M0 words, bf16 logits."""
from __future__ import annotations

import inspect

import pytest
import torch

from dsaquant.compat import deep_gemm as dg
from test_prefill import RANGES, check_close, expected_layout, make, oracle


def test_signatures_follow_deep_gemm():
    for fn in (dg.fp8_mqa_logits, dg.fp8_fp4_mqa_logits):
        p = inspect.signature(fn).parameters
        assert list(p) == ["q", "kv", "weights", "cu_seq_len_k_start", "cu_seq_len_k_end", "clean_logits",
                           "max_seqlen_k", "logits_dtype"]
        assert p["clean_logits"].default is True and p["max_seqlen_k"].default == 0
        assert p["logits_dtype"].default is torch.float32


def test_fp8_full_and_compressed():
    a = make("fp8")
    ks, ke = (t.to(torch.int32) for t in RANGES)
    vals, mag = oracle(a, "fp8")
    got = dg.fp8_mqa_logits(a["q"], (a["k"], a["k_scale"]), a["weights"], ks, ke)
    check_close(got, expected_layout(vals, ks, ke, 80),
                expected_layout(mag, ks, ke, 80).clamp_min(0).nan_to_num(0, 0, 0))
    comp = dg.fp8_mqa_logits(a["q"], (a["k"], a["k_scale"]), a["weights"], ks, ke, False, 24)
    want = expected_layout(vals, ks, ke, 80, 24)
    fin = torch.isfinite(want)
    assert comp.shape == (6, 24)
    assert torch.allclose(comp[fin].double(), want[fin], rtol=0, atol=1e-5 * float(mag.max()))
    same = dg.fp8_fp4_mqa_logits((a["q"], None), (a["k"], a["k_scale"]), a["weights"], ks, ke)
    assert torch.equal(same, got)
    with pytest.raises(ValueError, match="clean_logits"):
        dg.fp8_mqa_logits(a["q"], (a["k"], a["k_scale"]), a["weights"], ks, ke, True, 24)


def test_fp4_int32_words_and_bf16():
    a = make("fp4")
    ks, ke = (t.to(torch.int32) for t in RANGES)
    qw = a["q_scale"].view(torch.int32).reshape(6, 16)
    kw = a["k_scale"].view(torch.int32).reshape(-1)
    vals, mag = oracle(a, "fp4")
    got = dg.fp8_fp4_mqa_logits((a["q"], qw), (a["k"], kw), a["weights"], ks, ke)
    check_close(got, expected_layout(vals, ks, ke, 80),
                expected_layout(mag, ks, ke, 80).clamp_min(0).nan_to_num(0, 0, 0))
    bf = dg.fp8_fp4_mqa_logits((a["q"].view(torch.int8), qw), (a["k"], kw), a["weights"], ks, ke,
                               logits_dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf.view(torch.int16), got.to(torch.bfloat16).view(torch.int16))


def test_fp4_q_with_fp8_keys_rejected():
    a, b = make("fp4"), make("fp8")
    with pytest.raises(TypeError, match="kv"):
        dg.fp8_fp4_mqa_logits((a["q"], a["q_scale"]), (b["k"], b["k_scale"]), a["weights"], *RANGES)
    with pytest.raises(TypeError, match="kv"):
        dg.fp8_mqa_logits(b["q"], b["k"], b["weights"], *RANGES)

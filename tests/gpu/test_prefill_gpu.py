"""Prefill ops (docs/prefill.md) on a GPU: every GPU backend that implements them against the reference.

- mqa_logits fast modes: |backend - reference| <= 1e-5 * (largest magnitude of the row) for the bf16 / fp32 dots
  (FP4, FP8 decoded to bf16); <= 1e-3 * magnitude (elementwise) for the native FP8 tensor-core dot, where
  mag = sum_h |w| sum_d |q k| (times |k_scale|). -inf at exactly the reference's entries.
- exact FP4 mode: identical bytes (fp32 and bf16 output), on the GPU and against the reference run on the CPU.
- mqa_topk: the same positions as the backend's own mqa_logits followed by the selection (exact mode: identical;
  fast modes: the selected logits equal the row's top-k values); its peak memory at S = 8192, SKV = 65536.
- gather_index_cache: identical bytes and the same error flag.
Every test prints what it measured.
"""
from __future__ import annotations

import pytest
import torch

import dsaquant
from dsaquant import dispatch
from dsaquant.bench_prefill import make_prefill_inputs
from dsaquant.reference import prefill as R

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda")


def _backends(op):
    out = [b for b in ("triton", "cuda", "hip") if dispatch.available(b)[0] and op in dispatch.ops_of(b)]
    if not out:
        pytest.skip(f"no GPU backend implements {op}")
    return out


def _ranges(S, SKV, g):
    ks = torch.randint(-50, SKV, (S,), generator=g)
    ke = ks + torch.randint(-10, SKV, (S,), generator=g)
    ks[:4] = torch.tensor([0, 0, SKV - 1, 5])
    ke[:4] = torch.tensor([SKV, SKV + 100, SKV, 5])
    return ks.to(DEV), ke.to(DEV)


def _magnitude(a, layout, W=0):
    """sum_h |w| sum_d |q k| (times |k_scale|) in mqa_logits' layout: the reference on sign-cleared codes."""
    b = dict(a)
    if layout == "fp8":
        b["q"] = (a["q"].view(torch.uint8) & 0x7F).view(a["q"].dtype)
        b["k"] = (a["k"].view(torch.uint8) & 0x7F).view(a["k"].dtype)
        b["k_scale"] = a["k_scale"].abs()
    else:
        b["q"], b["k"] = a["q"] & 0x77, a["k"] & 0x77
    b["weights"] = a["weights"].abs()
    return dsaquant.mqa_logits(layout=layout, max_seqlen_k=W, backend="reference", **b)


@pytest.mark.parametrize("layout", ["fp8", "fp4"])
@pytest.mark.parametrize("H", [32, 64])
@pytest.mark.parametrize("W", [0, 1536])
@pytest.mark.parametrize("dot", ["default", "bf16"])
@pytest.mark.parametrize("spread", ["none", "wide", "few"])
def test_fast_mode_against_reference(layout, H, W, dot, spread):
    """dot "default": the native fp8 dot where the device has one (FP4: the tiles whose block exponents fold
    into e4m3); "bf16": FP8 codes / FP4 values decoded exactly to bf16. spread "wide": FP4 exponents 100..139,
    so that most tiles cannot fold and take the bf16 dots; "few": exponents 118..132 (spans up to the 14 that
    fold) with one key in 500 and one query row that do not fold (their tiles take the bf16 dots)."""
    if layout == "fp8" and spread != "none":
        pytest.skip("exponent spread applies to FP4")
    S, SKV = 384, 3000
    a = make_prefill_inputs(layout, S, SKV, H, seed=H + W)
    if spread != "none":
        g = torch.Generator().manual_seed(5)
        lo, hi = (100, 140) if spread == "wide" else (118, 133)
        a["q_scale"] = torch.randint(lo, hi, a["q_scale"].shape, generator=g, dtype=torch.uint8)
        a["k_scale"] = torch.randint(lo, hi, a["k_scale"].shape, generator=g, dtype=torch.uint8)
        if spread == "few":
            a["k_scale"][::500, 2] = 90
            a["q_scale"][17, 3, 1] = 0
        a["q_scale"], a["k_scale"] = a["q_scale"].to(DEV), a["k_scale"].to(DEV)
    a["ks"], a["ke"] = _ranges(S, SKV, torch.Generator().manual_seed(W))
    ref = dsaquant.mqa_logits(layout=layout, max_seqlen_k=W, backend="reference", **a)
    mag = _magnitude(a, layout, W)
    from dsaquant.triton import prefill as TP
    native = dot == "default" and TP.native_fp8_for(DEV, "e4m3fn")
    for b in _backends("mqa_logits"):
        if dot == "default":
            got = dsaquant.mqa_logits(layout=layout, max_seqlen_k=W, backend=b, **a)
        elif b == "triton":
            knob = dict(fp8_dot=False) if layout == "fp8" else dict(fp4_dot="bf16")
            got = TP.mqa_logits(*_op_args(a, layout, W), **knob)
        else:
            continue
        assert torch.equal(torch.isneginf(got), torch.isneginf(ref))
        fin = torch.isfinite(ref)
        err = (got - ref).abs()
        if native:
            bound = 1e-3 * mag
        else:
            bound = 1e-5 * torch.where(fin, mag, 0).amax(dim=1, keepdim=True).expand_as(mag)
        worst = float((err[fin] / bound[fin].clamp_min(1e-30)).max()) if fin.any() else 0.0
        print(f"{b} {layout} H={H} W={W} dot={dot} spread={spread} native={native}: worst error / bound = {worst:.3g}")
        assert worst <= 1.0


def _op_args(a, layout, W):
    """The backend-level arguments of mqa_logits for inputs `a` (as dsaquant.prefill builds them)."""
    S, SKV = a["q"].shape[0], a["k"].shape[0]
    lo = a["ks"].to(torch.int64).clamp(0, SKV).to(torch.int32)
    hi = a["ke"].to(torch.int64).clamp(0, SKV).to(torch.int32)
    base = a["ks"].to(torch.int64).clamp(-W, SKV).to(torch.int32) if W else torch.zeros_like(lo)
    out = torch.empty((S, W or SKV), device=DEV)
    q = a["q"].view(torch.uint8)
    k = a["k"].view(torch.uint8)
    return (q, a.get("q_scale"), k, a["k_scale"], a["weights"], lo, hi, base, out, layout, "e4m3fn", False, True,
            bool(W))


@pytest.mark.parametrize("H", [16, 64, 128])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_exact_mode_identical_bytes(H, out_dtype):
    S, SKV = 256, 2100
    a = make_prefill_inputs("fp4", S, SKV, H, seed=H)
    g = torch.Generator().manual_seed(H)
    from test_prefill import mixed_exponents, mixed_q_exponents
    a["q_scale"] = mixed_q_exponents(a["q_scale"].shape, g).to(DEV)
    a["k_scale"] = mixed_exponents(SKV, g).to(DEV)
    a["ks"], a["ke"] = _ranges(S, SKV, g)
    view = torch.int32 if out_dtype == torch.float32 else torch.int16
    ref = dsaquant.mqa_logits(layout="fp4", exact=True, out_dtype=out_dtype, backend="reference", **a)
    cpu = dsaquant.mqa_logits(layout="fp4", exact=True, out_dtype=out_dtype, backend="reference",
                              **{k: v.cpu() for k, v in a.items()})
    assert torch.equal(ref.view(view).cpu(), cpu.view(view)), "reference differs between GPU and CPU"
    for b in _backends("mqa_logits"):
        got = dsaquant.mqa_logits(layout="fp4", exact=True, out_dtype=out_dtype, backend=b, **a)
        bad = int((got.view(view) != ref.view(view)).sum())
        fin = int(torch.isfinite(ref).sum())
        print(f"{b} exact H={H} {out_dtype}: {bad} of {ref.numel()} entries differ ({fin} finite, "
              f"{int(torch.isnan(ref).sum())} NaN)")
        assert bad == 0


@pytest.mark.parametrize("layout,exact", [("fp8", False), ("fp4", False), ("fp4", True)])
def test_topk_equals_logits_selection(layout, exact):
    S, SKV, K = 300, 5000, 256
    a = make_prefill_inputs(layout, S, SKV, 64, seed=3)
    a["ks"], a["ke"] = _ranges(S, SKV, torch.Generator().manual_seed(3))
    for b in _backends("mqa_topk"):
        logits = dsaquant.mqa_logits(layout=layout, exact=exact, backend=b, **a)
        got = dsaquant.mqa_topk(topk=K, layout=layout, exact=exact, backend=b, **a)
        want = R.select_topk(logits, K)
        if exact:
            assert torch.equal(got, want)
        else:   # the chunked top-k scores tiles in its own row blocks: equal values up to the fast-mode bound
            assert torch.equal(got < 0, want < 0)
            gv = torch.where(got >= 0, torch.gather(logits, 1, got.clamp_min(0).long()), 0)
            wv = torch.where(want >= 0, torch.gather(logits, 1, want.clamp_min(0).long()), 0)
            tol = 1e-3 * float(_magnitude(a, layout).nan_to_num(0, 0, 0).max())
            assert torch.allclose(gv, wv, rtol=0, atol=tol)
        print(f"{b} {layout} exact={exact}: top-{K} positions match ({int((got == want).float().mean() * 100)}% "
              f"identical positions)")


def test_topk_peak_memory_large():
    S, SKV, K = 8192, 65536, 2048
    a = make_prefill_inputs("fp8", S, SKV, 64, seed=1)
    for b in _backends("mqa_topk"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        idx = dsaquant.mqa_topk(topk=K, layout="fp8", backend=b, **a)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        full = S * SKV * 4
        print(f"{b} mqa_topk S={S} SKV={SKV} k={K}: peak {peak / 1e9:.3f} GB above the inputs "
              f"([S, SKV] fp32 would be {full / 1e9:.2f} GB)")
        assert idx.shape == (S, K) and bool((idx >= 0).all())
        assert peak < full / 2
        if b == "triton":   # the result plus one row chunk's logits (docs/prefill.md), and 16 MiB of slack
            from dsaquant.triton import prefill as TP
            assert peak <= S * K * 8 + TP.TOPK_WORKSPACE_ELEMS * 4 + (16 << 20), peak
        # spot check a few rows against the reference selection
        rows = torch.tensor([0, 4097, 8191], device=DEV)
        sub = {k: (v[rows] if k in ("q", "weights", "ks", "ke") else v) for k, v in a.items()}
        ref = dsaquant.mqa_logits(layout="fp8", backend="reference", **sub)
        wv = torch.topk(ref, K, dim=1).values
        gv = torch.gather(ref, 1, idx[rows].long())
        tol = 1e-3 * float(_magnitude(sub, "fp8").max())
        assert torch.allclose(gv.sort(dim=1, descending=True).values, wv, rtol=0, atol=tol)


@pytest.mark.parametrize("layout,pre", [("fp8_132", False), ("fp8_132", True), ("packed68", False),
                                        ("aiter_fp4", False)])
def test_gather_identical(layout, pre):
    from test_prefill import make_gather
    a = make_gather(layout, pre=pre, bad=True)
    dev = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    for b in _backends("gather_index_cache"):
        out = dsaquant.gather_index_cache(dev["cache"], dev["table"], dev["cu"], layout=layout,
                                          kv_cache_scale=dev.get("scale"), preshuffle=pre, backend=b)
        with pytest.raises(dsaquant.DsaquantError):
            dsaquant.check_errors()
        assert torch.equal(out[0].cpu(), a["want"][0]) and torch.equal(out[1].cpu(), a["want"][1])
        print(f"{b} gather {layout} preshuffle={pre}: identical, bad pages flagged")


@pytest.mark.parametrize("layout,exact", [("fp8", False), ("fp4", True)])
def test_cuda_graph_replay(layout, exact):
    """mqa_logits and mqa_topk captured in one CUDA graph (no host synchronisation inside) replay the eager bytes."""
    a = make_prefill_inputs(layout, 256, 2048, 64, seed=9)
    a["ks"], a["ke"] = _ranges(256, 2048, torch.Generator().manual_seed(9))
    want = dsaquant.mqa_logits(layout=layout, exact=exact, **a)
    want_idx = dsaquant.mqa_topk(topk=64, layout=layout, exact=exact, **a)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dsaquant.mqa_logits(layout=layout, exact=exact, **a)
        dsaquant.mqa_topk(topk=64, layout=layout, exact=exact, **a)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = dsaquant.mqa_logits(layout=layout, exact=exact, **a)
        got_idx = dsaquant.mqa_topk(topk=64, layout=layout, exact=exact, **a)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)) and torch.equal(got_idx, want_idx)
    print(f"graph replay {layout} exact={exact}: identical")

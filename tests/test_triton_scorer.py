"""SPEC §7.4: the Triton paged_mqa_logits against the reference scorer, under TRITON_INTERPRET=1 on the CPU.

Not byte-exact (the two sum in different orders): every finite logit must satisfy
    |triton - reference| <= tol * mag,   mag = |weight_scale| * sum_h |w_h| * sum_d |q_hd| * |k_pd|
with tol = scorer.TOL_EXACT_PRODUCTS (bf16-exact operands, fp32 dot) or TOL_NATIVE_FP8 (fp8 tl.dot).
`mag` is computed by the reference scorer itself on sign-cleared inputs. -inf (positions at or past the
context) and NaN (NaN codes, e = 255 scales) must sit at exactly the reference's positions.

The interpreter must be on before triton is imported and must not leak into a process that also runs
compiled kernels (the GPU suite, the AOT test), so the cases run in worker subprocesses with
TRITON_INTERPRET=1; this file is also the worker (`python tests/test_triton_scorer.py --worker IN.json OUT.json`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from interp_workers import run_workers, selected_case_ids

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
LAYOUTS = ("fp8_132", "packed68", "aiter_fp4")


# =====================================================================================================
# the cases: id -> dict(make=make_case kwargs, knobs=launcher kwargs, tol="exact"|"native", kind=..., flagged=
#            whether the Triton call must raise the page-out-of-range flag)
# =====================================================================================================
def _cases():
    c = {}
    for layout in LAYOUTS:
        for N in (1, 2, 3, 4):      # next_n, [B, N] contexts (MTP: query n sees ctx - (N-1-n)) for N > 1
            c[f"{layout}-N{N}"] = dict(make=dict(layout=layout, N=N, H=16, seed=N, per_query_ctx=N > 1))
        for tpp in (1, 3):           # N*H = 96: rows padded to 128; tiles per program
            c[f"{layout}-H32-N3-tpp{tpp}"] = dict(make=dict(layout=layout, N=3, H=32, seed=7, per_query_ctx=True),
                                                  knobs=dict(tiles_per_prog=tpp))
        for P, bkv in ((16, 64), (32, 32), (128, 64), (64, 128)):
            c[f"{layout}-P{P}-bkv{bkv}"] = dict(make=dict(layout=layout, N=1, H=16, P=P, seed=P + bkv,
                                                          preshuffle=layout == "fp8_132"), knobs=dict(block_kv=bkv))
        # int64 tables and contexts, weights [B, N, H] bf16, int32 packed68 exponents, bad page ids in context
        # more queries than fit in one program (256 q rows): several query groups
        Nq, Hq = (9, 32) if layout == "packed68" else (5, 64)
        c[f"{layout}-N{Nq}-H{Hq}-groups"] = dict(make=dict(layout=layout, B=2, N=Nq, H=Hq, seed=13,
                                                           per_query_ctx=True))
        c[f"{layout}-argforms"] = dict(make=dict(layout=layout, N=2, H=16, seed=3, per_query_ctx=True, w_shape3=True,
                                                 w_dtype="bfloat16", idx_dtype="int64", q_scale_int32=True,
                                                 bad_pages=True))
        c[f"{layout}-ctx-past-L"] = dict(make=dict(layout=layout, N=2, H=16, seed=9, ctxs=[100, 40], L=64))
        c[f"{layout}-tiny"] = dict(make=dict(layout=layout, N=1, H=16, seed=9, ctxs=[1, 3], L=3))
        # hostile tables: a table of two pages' columns under longer contexts (positions past it: -inf, flagged),
        # context lengths past max_seq_len, negative and zero; one block-table entry a tile (P = 64) and one a
        # position (P = 32)
        for P in (64, 32):
            c[f"{layout}-hostile-P{P}"] = dict(
                make=dict(layout=layout, N=2, H=16, P=P, seed=21 + P, ctxs=[200, 150, 130], L=160, table_cols=2,
                          ctx_override=[[200, -4], [150, 0], [97, 129]]),
                flagged=True)
    for flavour in ("e4m3fn", "e4m3fnuz"):
        for native in (False, True):
            if native and flavour == "e4m3fnuz":
                continue  # the interpreter has no fp8e4b8 type: the gfx942 native dot is covered by the AOT test
            for pre in (False, True):
                c[f"fp8-{flavour}-{'native' if native else 'decode'}-{'pre' if pre else 'plain'}"] = dict(
                    make=dict(layout="fp8_132", N=2, H=16, seed=11, flavour=flavour, preshuffle=pre),
                    knobs=dict(fp8_dot=native), tol="native" if native else "exact")
    for layout in ("packed68", "aiter_fp4"):
        c[f"{layout}-nan-and-zero-scales"] = dict(make=dict(layout=layout, N=2, H=16, seed=5, ctxs=[70, 130], nan=True),
                                                  expect_nan=True)
    c["fp8-nan-code"] = dict(make=dict(layout="fp8_132", N=1, H=16, seed=6, ctxs=[70, 130], fp8_nan_free=False),
                             knobs=dict(fp8_dot=False), expect_nan=True)
    c["empty-L0"] = dict(kind="empty", make=dict(layout="packed68", N=1, H=16, ctxs=[5, 6], L=0))
    c["public-op-dispatch"] = dict(kind="dispatch", make=dict(layout="aiter_fp4", N=2, H=16, seed=1))
    return c


CASES = _cases()


# =====================================================================================================
# the parent: run the selected cases in interpreter workers, one test per case
# =====================================================================================================
if __name__ != "__main__":
    import pytest

    @pytest.fixture(scope="session")
    def scorer_results(request):
        pytest.importorskip("triton")
        selected = selected_case_ids(request, HERE)
        n_workers = max(1, min(2, os.cpu_count() or 1, len(selected)))
        shards = [selected[w::n_workers] for w in range(n_workers)]
        results = run_workers(HERE, shards, "dsq_triton_scorer_", 1200)
        total = sum(r.get("seconds", 0.0) for r in results.values())
        worst = max((r.get("worst", 0.0) for r in results.values()), default=0.0)
        print(f"\n[triton scorer, interpreter] {len(results)} cases, {total:.1f} s of worker time, "
              f"worst error {worst:.3g} x tolerance")
        return results

    @pytest.mark.parametrize("case_id", list(CASES))
    def test_triton_scorer_matches_reference(case_id, scorer_results):
        r = scorer_results.get(case_id)
        assert r is not None, f"{case_id}: no result from the interpreter worker"
        if r.get("skip"):
            pytest.skip(r["skip"])
        assert r.get("error") is None, f"{case_id}: {r['error']}"
        assert r["ok"], f"{case_id}: {r['note']}"


# =====================================================================================================
# the worker (TRITON_INTERPRET=1): everything below runs only in the subprocess
# =====================================================================================================
def make_case(layout, B=3, N=1, H=16, P=64, seed=0, ctxs=None, L=None, per_query_ctx=False, flavour="e4m3fn",
              preshuffle=False, extra_cols=2, bad_pages=False, w_shape3=False, w_dtype=None, idx_dtype=None,
              q_scale_int32=False, nan=False, fp8_nan_free=True, table_cols=None, ctx_override=None):
    """Positional arguments of the scorer (the reference's order) for a random case: random codes and
    exponents, each sequence on its own random pages, block-table columns past the context filled with
    ids far outside the cache (never to be read). `table_cols`: the table cut to that many columns;
    `ctx_override`: the context lengths ([B] or [B][N]) given instead of those the pages were made for."""
    import torch
    from dsaquant.reference.fp8 import fp8_encode
    from dsaquant.reference.layouts import aiter_q_scale_pad, write_aiter_q_scale
    w_dtype = w_dtype or torch.float32
    idx_dtype = idx_dtype or torch.int32
    g = torch.Generator().manual_seed(seed)
    if ctxs is None:
        ctxs = [int(x) for x in torch.randint(1, 3 * P + 7, (B,), generator=g)]
        ctxs[0] = 0 if B > 2 else ctxs[0]                      # an empty sequence
        ctxs[-1] = 2 * P                                       # a whole number of pages
    B = len(ctxs)
    L = L if L is not None else max(ctxs) + 5                  # a -inf tail
    need = [-(-c // P) for c in ctxs]
    nblk = max(need + [1]) + extra_cols
    NB = sum(need) + 2
    perm = torch.randperm(NB, generator=g).tolist()
    tables = torch.full((B, nblk), 1 << 30, dtype=torch.int64)
    tables[:, -1] = -1
    k = 0
    for b in range(B):
        for i in range(need[b]):
            tables[b, i] = perm[k]
            k += 1
    if bad_pages:  # ids outside the cache inside the context: not read, -inf and flagged
        for b in range(B):
            if need[b] >= 2:
                tables[b, 1] = NB + 5 if b % 2 else -3
    if table_cols is not None:
        tables = tables[:, :table_cols].contiguous()
    tables = tables.to(idx_dtype)
    if ctx_override is not None:
        ctx = torch.tensor(ctx_override, dtype=idx_dtype)
    elif per_query_ctx:   # MTP: query n of sequence b sees ctx - (N - 1 - n) positions
        ctx = torch.tensor([[max(0, c - (N - 1 - n)) for n in range(N)] for c in ctxs], dtype=idx_dtype)
    else:
        ctx = torch.tensor(ctxs, dtype=idx_dtype)
    w = torch.randn(B * N, H, generator=g)
    w = (w.reshape(B, N, H) if w_shape3 else w).to(w_dtype)
    ws = 0.0883883476

    if layout == "fp8_132":
        lim = 6 if flavour == "e4m3fn" else 4
        q = fp8_encode(torch.randn(B, N, H, 128, generator=g) * lim, flavour)
        kc = fp8_encode(torch.randn(NB, P * 128, generator=g) * lim, flavour)
        if not fp8_nan_free:
            kc[0, 5] = 0x7F if flavour == "e4m3fn" else 0x80
        kscale = torch.rand(NB, P, generator=g) * 0.05 + 1e-3
        cache = torch.cat((kc, kscale.view(torch.uint8).reshape(NB, P * 4)), dim=1)
        if flavour == "e4m3fnuz":
            q = q.view(torch.float8_e4m3fnuz)
        return (q, cache, w, ctx, tables, L, layout, None, None, ws, preshuffle, flavour, P)

    qp = torch.randint(0, 256, (B, N, H, 64), generator=g, dtype=torch.uint8)
    qe = torch.randint(110, 140, (B, N, H, 4), generator=g, dtype=torch.uint8)
    kp = torch.randint(0, 256, (NB, P, 64), generator=g, dtype=torch.uint8)
    ke = torch.randint(110, 140, (NB, P, 4), generator=g, dtype=torch.uint8)
    if nan:
        qe[0, 0, 1, 2] = 255
        ke[perm[0], 3, 1] = 255
        ke[perm[0], 7, 0] = 0          # pow2(0) = 0
    if layout == "packed68":
        cache = torch.cat((kp.reshape(NB, P * 64), ke.reshape(NB, P * 4)), dim=1)
        qs = qe.view(torch.int32).reshape(B, N, H) if q_scale_int32 else qe
        return (qp, cache, w, ctx, tables, L, layout, qs, None, ws, False, "e4m3fn", P)
    from dsaquant.reference.layouts import write_aiter_fp4
    kv = torch.zeros((NB, 1, 4, P, 16), dtype=torch.uint8)
    ks = torch.zeros((NB, 1, 4, P), dtype=torch.uint8)
    write_aiter_fp4(kv, ks, torch.arange(NB * P), kp.reshape(NB * P, 64), ke.reshape(NB * P, 4), P)
    qs = torch.full((B * N, 1, 4, 16, aiter_q_scale_pad(H)), 0xA5, dtype=torch.uint8)
    write_aiter_q_scale(qs, torch.arange(B * N), qe.reshape(B * N, H, 4), H)
    return (qp, kv, w, ctx, tables, L, layout, qs, ks, ws, False, "e4m3fn", P)


def check(args, tol, knobs):
    """(worst error / tolerance, note) of the Triton scorer against the reference on `args`."""
    import torch
    from dsaquant.reference.scorer import paged_mqa_logits as ref_scorer
    from dsaquant.testing import run_scorer
    from dsaquant.triton import scorer as S
    out = run_scorer(S.paged_mqa_logits, *args, **knobs)
    ref = run_scorer(ref_scorer, *args)
    B, N = args[0].shape[:2]
    if out.shape != ref.shape or out.shape != (B * N, args[5]) or out.dtype != torch.float32:
        return None, f"shape/dtype {tuple(out.shape)} {out.dtype} vs {tuple(ref.shape)}"
    if not torch.equal(torch.isneginf(out), torch.isneginf(ref)):
        return None, "-inf positions differ"
    if not torch.equal(torch.isnan(out), torch.isnan(ref)):
        return None, "NaN positions differ"
    fin = torch.isfinite(ref)
    if not bool(torch.isfinite(out[fin]).all()):
        return None, "+inf where the reference is finite"
    from dsaquant.testing import scorer_magnitude
    mag = scorer_magnitude(args)
    err = (out[fin] - ref[fin]).abs()
    worst = float((err / (tol * mag[fin] + 1e-30)).max()) if err.numel() else 0.0
    return worst, (f"error {worst:.3g} x the tolerance (max abs err {float(err.max()):.3g})"
                   if err.numel() else "nothing finite")


def run_case(case):
    import torch
    from dsaquant.testing import run_scorer
    from dsaquant.triton import scorer as S
    mk = dict(case["make"])
    for k in ("w_dtype", "idx_dtype"):
        if k in mk:
            mk[k] = getattr(torch, mk[k])
    args = make_case(**mk)
    kind = case.get("kind", "check")
    if kind == "empty":
        out = run_scorer(S.paged_mqa_logits, *args)
        return dict(ok=tuple(out.shape) == (args[0].shape[0] * args[0].shape[1], 0), note=f"shape {tuple(out.shape)}")
    if kind == "dispatch":
        from dsaquant import dispatch, ops
        ok, why = dispatch.available("triton")
        if not ok:
            return dict(skip=f"triton backend not loadable here: {why}")
        q, kv, w, ctx, tables, L, layout, qs, ks, ws, pre, flavour, P = args
        out = ops.paged_mqa_logits(q, kv, w, ctx, tables, L, layout=layout, q_scale=qs, kv_cache_scale=ks,
                                   weight_scale=ws, backend="triton")
        direct = run_scorer(S.paged_mqa_logits, *args)
        return dict(ok=bool(torch.equal(out, direct)), note="dispatch result differs from the direct call")
    if case.get("flagged"):   # the Triton kernel alone raises the page flag (positions past the table)
        from dsaquant import codes, errors
        flag = errors.flag_tensor(args[0].device)
        flag.zero_()
        run_scorer(S.paged_mqa_logits, *args, **case.get("knobs", {}))
        if not int(flag.item()) & int(codes.ErrFlag.page_out_of_range):
            return dict(ok=False, note="the page-out-of-range flag was not raised")
        flag.zero_()
    tol = S.TOL_NATIVE_FP8 if case.get("tol") == "native" else S.TOL_EXACT_PRODUCTS
    worst, note = check(args, tol, case.get("knobs", {}))
    if worst is None:
        return dict(ok=False, note=note)
    if case.get("expect_nan"):
        from dsaquant.reference.scorer import paged_mqa_logits as ref_scorer
        if not bool(torch.isnan(run_scorer(ref_scorer, *args)).any()):
            return dict(ok=False, note="the case was meant to produce NaN logits")
    return dict(ok=worst <= 1.0, worst=worst, note=note)


def _worker_main(cases_path, out_path):
    assert os.environ.get("TRITON_INTERPRET") == "1", "the worker needs TRITON_INTERPRET=1"
    sys.path.insert(0, str(REPO / "python"))
    results = {}
    for cid in json.loads(Path(cases_path).read_text()):
        t0 = time.perf_counter()
        try:
            r = run_case(CASES[cid])
        except Exception:
            r = dict(error=traceback.format_exc()[-3000:])
        r["seconds"] = time.perf_counter() - t0
        results[cid] = r
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker_main(sys.argv[2], sys.argv[3])
    else:
        print(__doc__)

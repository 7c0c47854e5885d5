"""dsaquant.topk_indices (docs/topk.md) on the CPU.

Every span form and option of the reference backend against a brute force written here (a Python sort of
(-value, position) over each row's candidates: positions of the span whose value is neither NaN nor -inf),
on rows full of ties, NaN, +-inf and -0.0 / +0.0; argument checks; and the Triton kernel under
TRITON_INTERPRET=1, byte-equal to the reference (worker subprocesses, as tests/test_triton_scorer.py; this
file is also the worker: `python tests/test_topk.py --worker IN.json OUT.json`).
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))

from interp_workers import Tally, check_result, run_cases, run_workers, selected_case_ids  # noqa: E402

NAN, INF = float("nan"), float("inf")


# =====================================================================================================
# inputs and the brute force (shared by the parent and the worker)
# =====================================================================================================
def make_logits(rows, L, seed, dtype="float32", ties=True, specials=True, stride_pad=0):
    """[rows, L] logits (a view with row stride L + stride_pad): values on a coarse grid (many ties) or
    random normals, with NaN, +-inf, -0.0 and +0.0 sprinkled in."""
    import torch
    g = torch.Generator().manual_seed(seed)
    if ties:
        x = torch.randint(-6, 7, (rows, L + stride_pad), generator=g).float() * 0.25
    else:
        x = torch.randn(rows, L + stride_pad, generator=g)
    if specials and L:
        n = max(1, (rows * L) // 6)
        r = torch.randint(0, rows, (n,), generator=g)
        c = torch.randint(0, L, (n,), generator=g)
        vals = torch.tensor([NAN, INF, -INF, -0.0, 0.0, -NAN])
        x[r, c] = vals[torch.randint(0, len(vals), (n,), generator=g)]
    x = x.to(getattr(torch, dtype))
    return x[:, :L]


def spans(rows, L, context_lens=None, next_n=1, ks=None, ke=None):
    """[(start, end)] per row, computed from docs/topk.md's rule with Python ints."""
    out = []
    for i in range(rows):
        if context_lens is not None:
            c = context_lens.tolist()
            if context_lens.dim() == 2:
                s, e = 0, c[i // next_n][i % next_n]
            else:
                s, e = 0, c[i // next_n] - next_n + (i % next_n) + 1
        else:
            s, e = int(ks[i]), int(ke[i])
        s = min(max(s, 0), L)
        e = max(min(max(e, 0), L), s)
        out.append((s, e))
    return out


def brute_topk(logits, k, context_lens=None, next_n=1, ks=None, ke=None, relative=False):
    """int32 [rows, k] by sorting (-value, position) tuples of each row's candidates."""
    import torch
    rows, L = logits.shape
    vals = logits.float().tolist()
    res = []
    for i, (s, e) in enumerate(spans(rows, L, context_lens, next_n, ks, ke)):
        cands = sorted((-vals[i][p], p) for p in range(s, e) if not math.isnan(vals[i][p]) and vals[i][p] != -INF)
        sel = [p - (s if relative else 0) for _, p in cands[:k]]
        res.append(sel + [-1] * (k - len(sel)))
    return torch.tensor(res, dtype=torch.int32).reshape(rows, k)


def _args(case):
    """(logits, k, kwargs of dsaquant.topk_indices) of a case dict."""
    import torch
    g = torch.Generator().manual_seed(case.get("seed", 0) + 1000)
    L = case["L"]
    idx = getattr(torch, case.get("idx", "int32"))
    if case["form"] == "prefill":
        rows = case["rows"]
        ks = torch.randint(-3, L + 4, (rows,), generator=g)
        ke = ks + torch.randint(-2, L + 3, (rows,), generator=g)
        ks[0], ke[0] = 0, L                                      # a whole row
        if rows > 2:
            ks[1], ke[1] = L // 2, L // 2 - 1                    # ks > ke: empty
        kw = dict(ks=ks.to(idx), ke=ke.to(idx))
    else:
        B, N = case["B"], case.get("next_n", 1)
        rows = B * N
        if case["form"] == "decode2d":
            c = torch.randint(-2, L + 5, (B, N), generator=g)
        else:
            c = torch.randint(-2, L + 5, (B,), generator=g)
            c[0] = L
        kw = dict(context_lens=c.to(idx), next_n=N)
    kw["relative"] = case.get("relative", False)
    x = make_logits(rows, L, case.get("seed", 0), case.get("dtype", "float32"), case.get("ties", True),
                    case.get("specials", True), case.get("stride_pad", 0))
    return x, case["k"], kw


# =====================================================================================================
# the Triton cases (interpreter)
# =====================================================================================================
def _triton_cases():
    c = {}
    for form in ("prefill", "decode", "decode2d"):
        shape = dict(rows=5) if form == "prefill" else dict(B=2, next_n=3 if form == "decode" else 2)
        for chunks, k in ((1, 7), (1, 200), (3, 1), (3, 30)):
            c[f"{form}-k{k}-chunks{chunks}"] = dict(form=form, L=110, k=k, chunks=chunks, seed=k + chunks, **shape)
        c[f"{form}-relative"] = dict(form=form, L=130, k=20, chunks=2, relative=True, seed=3, idx="int64", **shape)
    c["ties-only"] = dict(form="prefill", rows=3, L=200, k=50, chunks=2, seed=4, specials=False)
    c["random-no-ties"] = dict(form="prefill", rows=3, L=260, k=33, chunks=1, seed=5, ties=False, specials=False)
    c["bf16"] = dict(form="decode", B=3, L=120, k=16, chunks=2, dtype="bfloat16", seed=6)
    c["fp16-stride"] = dict(form="prefill", rows=4, L=100, k=12, chunks=1, dtype="float16", stride_pad=37, seed=7)
    c["k-past-L"] = dict(form="prefill", rows=3, L=40, k=70, chunks=1, seed=8)
    c["k-past-L-chunks"] = dict(form="decode", B=2, L=90, k=100, chunks=4, seed=9)
    c["block-multi-step"] = dict(form="prefill", rows=2, L=300, k=64, chunks=1, block=16, seed=10)
    c["public-op"] = dict(form="decode", B=2, next_n=2, L=64, k=10, seed=11, public=True)
    c["public-op-L0"] = dict(form="prefill", rows=3, L=0, k=5, seed=12, public=True)
    return c


CASES = _triton_cases()


def run_case(case):
    import torch
    import dsaquant
    from dsaquant.triton import topk as T
    t = Tally()
    x, k, kw = _args(case)
    ref = dsaquant.topk_indices(x, k, **kw, backend="reference")
    t.eq("reference vs brute force", brute_topk(x, k, **kw), ref)
    if case.get("public"):
        got = dsaquant.topk_indices(x, k, **kw, backend="triton")
    else:
        got = torch.full((x.shape[0], k), 12345, dtype=torch.int32)
        T.topk_indices(x, k, kw.get("context_lens"), kw.get("next_n", 1), kw.get("ks"), kw.get("ke"),
                       kw["relative"], got, chunks=case.get("chunks"), block=case.get("block", 32))
    t.eq("triton vs reference", ref, got)
    return t.result()


if __name__ != "__main__":
    import pytest
    import torch

    import dsaquant

    # -------------------------------------------------------------------------------------------------
    # reference backend against the brute force
    # -------------------------------------------------------------------------------------------------
    REF_CASES = {
        "prefill": dict(form="prefill", rows=9, L=57, k=13),
        "prefill-relative": dict(form="prefill", rows=9, L=57, k=13, relative=True),
        "prefill-int64": dict(form="prefill", rows=6, L=40, k=5, idx="int64", relative=True),
        "prefill-k1": dict(form="prefill", rows=6, L=40, k=1),
        "prefill-k-past-L": dict(form="prefill", rows=6, L=30, k=45, relative=True),
        "decode": dict(form="decode", B=4, next_n=1, L=50, k=9),
        "decode-mtp3": dict(form="decode", B=4, next_n=3, L=50, k=9),
        "decode-mtp2-int64-relative": dict(form="decode", B=3, next_n=2, L=33, k=40, idx="int64", relative=True),
        "decode2d": dict(form="decode2d", B=3, next_n=2, L=45, k=11),
        "bf16": dict(form="decode", B=3, next_n=2, L=64, k=10, dtype="bfloat16"),
        "fp16-strided": dict(form="prefill", rows=5, L=64, k=10, dtype="float16", stride_pad=9),
        "no-ties": dict(form="prefill", rows=5, L=64, k=10, ties=False),
        "ties-only": dict(form="prefill", rows=5, L=64, k=30, specials=False),
    }

    @pytest.mark.parametrize("seed", [0, 1, 2])
    @pytest.mark.parametrize("name", list(REF_CASES))
    def test_reference_matches_brute_force(name, seed):
        x, k, kw = _args(dict(REF_CASES[name], seed=seed))
        got = dsaquant.topk_indices(x, k, **kw, backend="reference")
        assert got.dtype == torch.int32 and got.shape == (x.shape[0], k)
        assert torch.equal(got, brute_topk(x, k, **kw))

    from hypothesis import given, settings, strategies as st

    _VALUES = st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e-40, -1e-40, 3.4e38, -3.4e38, INF, -INF, NAN])

    @settings(max_examples=60, deadline=None)
    @given(data=st.data(), rows=st.integers(1, 4), L=st.integers(0, 12), k=st.integers(1, 15),
           relative=st.booleans())
    def test_reference_property(data, rows, L, k, relative):
        """Arbitrary rows of special values and arbitrary (hostile) spans: the brute force's bytes."""
        x = torch.tensor(data.draw(st.lists(st.lists(_VALUES, min_size=L, max_size=L), min_size=rows,
                                            max_size=rows)), dtype=torch.float32).reshape(rows, L)
        ks = torch.tensor(data.draw(st.lists(st.integers(-20, 20), min_size=rows, max_size=rows)), dtype=torch.int32)
        ke = torch.tensor(data.draw(st.lists(st.integers(-20, 20), min_size=rows, max_size=rows)), dtype=torch.int32)
        got = dsaquant.topk_indices(x, k, ks=ks, ke=ke, relative=relative, backend="reference")
        assert torch.equal(got, brute_topk(x, k, ks=ks, ke=ke, relative=relative))

    def test_order_rules_by_hand():
        """The rules of docs/topk.md on one row: +inf first, ties by position, -0.0 == +0.0, NaN and -inf
        never selected, -1 after the candidates."""
        x = torch.tensor([[1.0, NAN, 3.0, -0.0, INF, 3.0, -INF, 0.0, -2.0, -0.0]])
        ks, ke = torch.tensor([0], dtype=torch.int32), torch.tensor([10], dtype=torch.int32)
        got = dsaquant.topk_indices(x, 12, ks=ks, ke=ke, backend="reference")
        assert got.tolist() == [[4, 2, 5, 0, 3, 7, 9, 8, -1, -1, -1, -1]]
        got = dsaquant.topk_indices(x, 12, ks=ks + 3, ke=ke - 1, relative=True, backend="reference")
        assert got.tolist() == [[1, 2, 0, 4, 5, -1, -1, -1, -1, -1, -1, -1]]

    def test_decode_mtp_rule_by_hand():
        """context_lens [B]: query j of next_n sees p < len - next_n + j + 1; [B, next_n]: p < len[b, j]."""
        x = torch.arange(8, dtype=torch.float32).repeat(4, 1)          # larger position = larger value
        got = dsaquant.topk_indices(x, 8, context_lens=torch.tensor([6, 3]), next_n=2, backend="reference")
        want = [[4, 3, 2, 1, 0], [5, 4, 3, 2, 1, 0], [1, 0], [2, 1, 0]]
        assert got.tolist() == [w + [-1] * (8 - len(w)) for w in want]
        got = dsaquant.topk_indices(x, 2, context_lens=torch.tensor([[6, 0], [9, 1]]), next_n=2, backend="reference")
        assert got.tolist() == [[5, 4], [-1, -1], [7, 6], [0, -1]]

    def test_out_is_written_in_place():
        x, k, kw = _args(dict(form="prefill", rows=4, L=20, k=6, seed=3))
        out = torch.full((4, 6), 99, dtype=torch.int32)
        res = dsaquant.topk_indices(x, k, **kw, out=out, backend="reference")
        assert res is out and torch.equal(out, brute_topk(x, k, **kw))

    def test_empty_shapes():
        ks = torch.zeros(0, dtype=torch.int32)
        assert dsaquant.topk_indices(torch.zeros(0, 16), 4, ks=ks, ke=ks).shape == (0, 4)
        z = torch.zeros(3, dtype=torch.int32)
        got = dsaquant.topk_indices(torch.zeros(3, 0), 4, ks=z, ke=z + 5)
        assert got.tolist() == [[-1] * 4] * 3
        got = dsaquant.topk_indices(torch.zeros(2, 0), 2, context_lens=torch.tensor([3, 0]))
        assert got.tolist() == [[-1, -1]] * 2

    def _bad(**over):
        a = dict(logits=torch.zeros(4, 8), k=2, ks=torch.zeros(4, dtype=torch.int32),
                 ke=torch.full((4,), 8, dtype=torch.int32))
        a.update(over)
        return a

    @pytest.mark.parametrize("over, exc, name", [
        (dict(k=0), ValueError, "k"),
        (dict(k=-3), ValueError, "k"),
        (dict(k=2.0), TypeError, "k"),
        (dict(k=True), TypeError, "k"),
        (dict(k=2**31), ValueError, "k"),
        (dict(logits=torch.zeros(4, 8, dtype=torch.int32)), TypeError, "logits"),
        (dict(logits=torch.zeros(32)), ValueError, "logits"),
        (dict(logits=torch.zeros(8, 4).t()), ValueError, "logits"),
        (dict(logits=[[1.0]]), TypeError, "logits"),
        (dict(ks=None), ValueError, "ks"),
        (dict(ke=None), ValueError, "ke"),
        (dict(ks=None, ke=None), ValueError, "ks and ke"),
        (dict(context_lens=torch.ones(4, dtype=torch.int32)), ValueError, "context_lens"),
        (dict(ks=torch.zeros(4)), TypeError, "ks"),
        (dict(ke=torch.zeros(3, dtype=torch.int32)), ValueError, "ke"),
        (dict(relative=1), TypeError, "relative"),
        (dict(out=torch.zeros(4, 2, dtype=torch.int64)), TypeError, "out"),
        (dict(out=torch.zeros(4, 3, dtype=torch.int32)), ValueError, "out"),
        (dict(out=torch.zeros(2, 4, dtype=torch.int32).t()), ValueError, "out"),
    ])
    def test_bad_arguments(over, exc, name):
        a = _bad(**over)
        out = a.get("out")
        before = out.clone() if isinstance(out, torch.Tensor) else None
        with pytest.raises(exc, match=name):
            dsaquant.topk_indices(a.pop("logits"), a.pop("k"), **a)
        if before is not None:
            assert torch.equal(before, out), "an argument error must not write the output"

    @pytest.mark.parametrize("over, exc, name", [
        (dict(context_lens=torch.ones(4, dtype=torch.float32)), TypeError, "context_lens"),
        (dict(context_lens=torch.ones(3, dtype=torch.int32)), ValueError, "logits"),
        (dict(context_lens=torch.ones(2, dtype=torch.int32), next_n=2, logits=torch.zeros(5, 8)), ValueError, "logits"),
        (dict(context_lens=torch.ones(2, 3, dtype=torch.int32), next_n=2), ValueError, "context_lens"),
        (dict(context_lens=torch.ones(2, 2, 1, dtype=torch.int32), next_n=2), ValueError, "context_lens"),
        (dict(context_lens=torch.ones(4, dtype=torch.int32), next_n=0), ValueError, "next_n"),
        (dict(context_lens=torch.ones(4, dtype=torch.int32), next_n=1.0), TypeError, "next_n"),
    ])
    def test_bad_decode_arguments(over, exc, name):
        a = dict(logits=torch.zeros(4, 8), k=2)
        a.update(over)
        with pytest.raises(exc, match=name):
            dsaquant.topk_indices(a.pop("logits"), a.pop("k"), **a)

    def test_forced_missing_backend_on_cpu():
        x, k, kw = _args(dict(form="prefill", rows=2, L=8, k=2))
        with pytest.raises(dsaquant.BackendUnavailable):
            dsaquant.topk_indices(x, k, **kw, backend="cuda")

    def test_custom_op_under_compile():
        """One opaque op under torch.compile(fullgraph=True), same bytes as eager."""
        x, k, kw = _args(dict(form="decode", B=2, next_n=2, L=30, k=5, seed=4))
        f = torch.compile(lambda x, c: dsaquant.topk_indices(x, 5, context_lens=c, next_n=2), fullgraph=True,
                          backend="eager")
        assert torch.equal(f(x, kw["context_lens"]), brute_topk(x, k, **kw))

    @pytest.mark.parametrize("form", ["prefill", "decode2d"])
    def test_opcheck(form):
        """The registered op's schema, fake implementation and declared mutation of `out` (torch.library)."""
        shape = dict(rows=4) if form == "prefill" else dict(B=2, next_n=2)
        x, k, kw = _args(dict(form=form, L=24, k=6, seed=2, **shape))
        out = torch.empty((x.shape[0], k), dtype=torch.int32)
        args = (x, k, kw.get("context_lens"), kw.get("next_n", 1), kw.get("ks"), kw.get("ke"), True, out, "reference")
        res = torch.library.opcheck(torch.ops.dsaquant.topk_indices.default, args)
        assert all(v == "SUCCESS" for v in res.values()), res

    # -------------------------------------------------------------------------------------------------
    # Triton under the interpreter, byte-equal to the reference
    # -------------------------------------------------------------------------------------------------
    @pytest.fixture(scope="session")
    def topk_results(request):
        pytest.importorskip("triton")
        selected = selected_case_ids(request, HERE)
        n_workers = max(1, min(2, os.cpu_count() or 1, len(selected)))
        shards = [selected[w::n_workers] for w in range(n_workers)]
        res = run_workers(HERE, shards, "dsq_topk_", 900)
        print(f"\n[triton topk, interpreter] {len(res)} cases, "
              f"{sum(r.get('seconds', 0.0) for r in res.values()):.1f} s of worker time")
        return res

    @pytest.mark.parametrize("case_id", list(CASES))
    def test_triton_topk_matches_reference(case_id, topk_results):
        check_result(case_id, topk_results.get(case_id))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        assert os.environ.get("TRITON_INTERPRET") == "1", "the worker needs TRITON_INTERPRET=1"
        run_cases(sys.argv[2], sys.argv[3], CASES, run_case)
    else:
        print(__doc__)

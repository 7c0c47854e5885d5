"""Prefill ops (docs/prefill.md) on the CPU: mqa_logits, mqa_topk and gather_index_cache against values
computed here in plain torch (float64 dots, torch's own fp8 conversion, a table of E2M1 values, Python
fractions for the exact mode), hostile ranges, argument checks, and the Triton backend under
TRITON_INTERPRET=1 (fast modes within 1e-5 of the magnitude, exact mode and selections identical bytes).

The interpreter must be on before triton is imported, so the Triton cases run in one worker subprocess
(`python tests/test_prefill.py --worker OUT.json`), whose results the parametrized tests read.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# =====================================================================================================
# inputs and the plain-torch oracle
# =====================================================================================================
def make(layout, S=6, H=16, SKV=80, seed=0, exp_lo=120, exp_hi=130, fp8_dtype=torch.float8_e4m3fn):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(S, H, generator=g)
    if layout == "fp8":
        def codes(*shape):   # never NaN: magnitude codes 1..0x6F (0x80 is e4m3fnuz's NaN), random sign
            return torch.randint(1, 0x70, shape, generator=g, dtype=torch.uint8) | \
                (torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7)
        return dict(q=codes(S, H, 128).view(fp8_dtype), k=codes(SKV, 128).view(fp8_dtype),
                    k_scale=torch.rand(SKV, generator=g) * 0.02 + 0.01, weights=w)
    return dict(q=torch.randint(0, 256, (S, H, 64), generator=g, dtype=torch.uint8),
                q_scale=torch.randint(exp_lo, exp_hi, (S, H, 4), generator=g, dtype=torch.uint8),
                k=torch.randint(0, 256, (SKV, 64), generator=g, dtype=torch.uint8),
                k_scale=torch.randint(exp_lo, exp_hi, (SKV, 4), generator=g, dtype=torch.uint8), weights=w)


def mixed_exponents(n, g):
    """Key exponent bytes uint8 [n, 4] by row class: 70 % normal (110..139), 8 % with one block's byte 0
    (scale 0), 2 % with one byte 255 (NaN scale), 10 % 1..3 (products in the subnormals, against query
    exponents 95..139), 10 % 235..254 (products near or past the fp32 maximum)."""
    e = torch.randint(110, 140, (n, 4), generator=g, dtype=torch.uint8)
    u = torch.rand(n, generator=g)
    blk = torch.randint(0, 4, (n,), generator=g)
    rows = torch.arange(n)
    zero, nan = u < 0.08, (u >= 0.08) & (u < 0.10)
    low, high = (u >= 0.10) & (u < 0.20), u >= 0.90
    e[low] = torch.randint(1, 4, (int(low.sum()), 4), generator=g, dtype=torch.uint8)
    e[high] = torch.randint(235, 255, (int(high.sum()), 4), generator=g, dtype=torch.uint8)
    e[rows[zero], blk[zero]] = 0
    e[rows[nan], blk[nan]] = 255
    return e


def mixed_q_exponents(shape, g):
    """Query exponent bytes: 110..139, and 95..111 in every other row (with mixed_exponents' low keys the
    logits fall into the subnormal range)."""
    e = torch.randint(110, 140, shape, generator=g, dtype=torch.uint8)
    e[1::2] = torch.randint(95, 112, e[1::2].shape, generator=g, dtype=torch.uint8)
    return e


def _fp4_values(packed, exps):
    """float64 [..., 128] from packed uint8 [..., 64] and exponent bytes [..., 4] (normal exponents)."""
    tab = torch.tensor(E2M1, dtype=torch.float64)
    lo, hi = packed.to(torch.int64) & 15, packed.to(torch.int64) >> 4
    c = torch.stack((lo, hi), -1).reshape(*packed.shape[:-1], 128)
    v = torch.where((c & 8) != 0, -tab[c & 7], tab[c & 7])
    s = torch.pow(2.0, exps.to(torch.float64) - 127).repeat_interleave(32, dim=-1)
    return v * s


def oracle(a, layout):
    """(logits, magnitude) float64 [S, SKV]: sum_h w relu(q . k) (times k_scale) and sum_h |w| sum_d |q k|."""
    w = a["weights"].to(torch.float64)
    if layout == "fp8":
        dt = a["q"].dtype if a["q"].dtype != torch.uint8 else torch.float8_e4m3fn
        q = a["q"].view(dt).to(torch.float64)
        k = a["k"].view(dt).to(torch.float64)
        ks = a["k_scale"].to(torch.float64)
    else:
        qs = a["q_scale"] if a["q_scale"].dtype == torch.uint8 else a["q_scale"].view(torch.uint8).reshape(
            *a["q"].shape[:2], 4)
        ksc = a["k_scale"] if a["k_scale"].dtype == torch.uint8 else a["k_scale"].view(torch.uint8).reshape(-1, 4)
        q, k = _fp4_values(a["q"], qs), _fp4_values(a["k"], ksc)
        ks = torch.ones(k.shape[0], dtype=torch.float64)
    dots = torch.einsum("shd,jd->shj", q, k)
    logits = (torch.relu(dots) * w.unsqueeze(-1)).sum(1) * ks
    mag = (torch.einsum("shd,jd->shj", q.abs(), k.abs()) * w.abs().unsqueeze(-1)).sum(1) * ks.abs()
    return logits, mag


def expected_layout(vals, ks, ke, SKV, W=0):
    """Place float64 [S, SKV] logits by the op's range rules: full, or compressed to W columns."""
    S = vals.shape[0]
    out = torch.full((S, W or SKV), float("-inf"), dtype=torch.float64)
    for i in range(S):
        lo, hi = max(int(ks[i]), 0), min(int(ke[i]), SKV)
        for j in range(lo, hi):
            c = j - int(ks[i]) if W else j
            if 0 <= c < out.shape[1]:
                out[i, c] = vals[i, j]
    return out


def check_close(got, want, mag, tol=1e-5):
    fin = torch.isfinite(want)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "-inf at other entries"
    err = (got.to(torch.float64) - want).abs()[fin]
    bound = tol * torch.clamp_min(mag.max(dim=1, keepdim=True).values.expand_as(want)[fin], 1e-30)
    assert bool((err <= bound).all()), f"max error {float(err.max())}"


RANGES = (torch.tensor([0, 3, -5, 40, 70, 9], dtype=torch.int32),   # empty, clamped, negative; int32: the
          torch.tensor([10, 80, 20, 200, 50, 9], dtype=torch.int32))  # backends clamp the bounds themselves


# =====================================================================================================
# exact rational arithmetic for the exact mode
# =====================================================================================================
def f32_round(x: Fraction) -> Fraction:
    """Round a rational to the nearest fp32 (ties to even, subnormals kept, overflow to +-inf as a float)."""
    if x == 0:
        return Fraction(0)
    sign = -1 if x < 0 else 1
    a = abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    e = max(e, -126)                                 # below: the subnormal quantum 2^-149
    q = Fraction(2) ** (e - 23)
    n, r = divmod(a, q)
    if r * 2 > q or (r * 2 == q and n % 2 == 1):
        n += 1
    v = n * q
    if v >= Fraction(2) ** 128:
        return Fraction(sign * 10 ** 60)             # marks overflow (never reached in these cases)
    return sign * v


def exact_fraction(q, qe, k, ke, w):
    """The exact-mode logit of one query row and one key, step by step in rationals (docs/prefill.md)."""
    def vals(p):
        out = []
        for byte in p.tolist():
            for c in (byte & 15, byte >> 4):
                v = Fraction(E2M1[c & 7]).limit_denominator()
                out.append(-v if c & 8 else v)
        return out
    kv = vals(k)
    t = []
    for h in range(q.shape[0]):
        qv = vals(q[h])
        v = []
        for b in range(4):
            i = sum(4 * qv[d] * kv[d] for d in range(32 * b, 32 * b + 32))     # the integer block dot
            eqb, ekb = int(qe[h, b]), int(ke[b])
            v.append(f32_round(i * Fraction(2) ** (eqb + ekb - 256)))
        s = f32_round(f32_round(f32_round(v[0] + v[1]) + v[2]) + v[3])
        r = s if s > 0 else Fraction(0)
        t.append(f32_round(r * Fraction(float(w[h]))))
    m = len(t) // 4
    p = [f32_round(f32_round(f32_round(t[4 * i] + t[4 * i + 1]) + t[4 * i + 2]) + t[4 * i + 3]) for i in range(m)]
    s = m // 2
    while s >= 1:
        p = [f32_round(p[i] + p[i + s]) for i in range(s)]
        s //= 2
    return p[0]


# =====================================================================================================
# the Triton cases (run in the interpreter worker)
# =====================================================================================================
TRITON_CASES = {
    "fp8-full": dict(layout="fp8"),
    # 20 rows, every one its own range: blocks of rows whose ranges end (or start) tiles away from the keys' ends
    "fp8-ragged-rows": dict(layout="fp8", S=20),
    "fp8-compressed": dict(layout="fp8", W=24),
    "fp8-noclean": dict(layout="fp8", clean=False),
    "fp8-bf16": dict(layout="fp8", bf16=True),
    "fp8-native-dot": dict(layout="fp8", knobs=dict(fp8_dot=True)),
    "fp8-fnuz": dict(layout="fp8", fnuz=True),
    "fp8-int32-extreme-bounds": dict(layout="fp8", extreme=True),   # bounds at the ends of int32, unclamped
    "fp4-full": dict(layout="fp4"),
    "fp4-compressed-int32-exps": dict(layout="fp4", W=24, int32=True),
    "fp4-H32": dict(layout="fp4", H=32),
    "fp4-fp8-fold": dict(layout="fp4", exp_lo=120, exp_hi=127, knobs=dict(fp4_dot="fp8")),
    "fp4-fp8-fold-fallback": dict(layout="fp4", exp_lo=100, exp_hi=130, knobs=dict(fp4_dot="fp8")),
    # spans up to the 14 binades that fold; one key whose block is 32 below (its tile falls back) and one query
    # row with a zero-scale block (its row block falls back)
    "fp4-fp8-fold-mixed": dict(layout="fp4", exp_lo=118, exp_hi=133, unfold=True, knobs=dict(fp4_dot="fp8")),
    # every key folds, one query row does not (a block 23 binades above the others, whose value the FP8 launch
    # cannot hold): the second pass rewrites that row alone
    "fp4-fp8-fold-query": dict(layout="fp4", exp_lo=120, exp_hi=127, unfold_query=150, knobs=dict(fp4_dot="fp8")),
    # the same through the compressed bf16 output and without clean_logits: the FP8 launch writes every entry of
    # its tiles, the second pass rewrites those that do not fold
    # (key 45: inside row 3's window of 24 keys from 40)
    "fp4-fp8-fold-mixed-compressed-bf16": dict(layout="fp4", exp_lo=118, exp_hi=133, unfold=True, unfold_key=45, W=24,
                                               bf16=True, knobs=dict(fp4_dot="fp8")),
    "fp4-fp8-fold-mixed-noclean": dict(layout="fp4", exp_lo=118, exp_hi=133, unfold=True, clean=False,
                                       knobs=dict(fp4_dot="fp8")),
    "exact-full": dict(layout="fp4", exact=True),
    "exact-compressed-bf16": dict(layout="fp4", exact=True, W=24, bf16=True),
    "exact-mixed-exponents": dict(layout="fp4", exact=True, mixed=True),
    "exact-H64": dict(layout="fp4", exact=True, H=64),
    "topk-fp8": dict(kind="topk", layout="fp8"),
    "topk-exact-relative": dict(kind="topk", layout="fp4", exact=True, relative=True),
    # 20 rows through a workspace of 8 rows of logits: row chunks of 8, 8 and 4
    "topk-row-chunks-relative": dict(kind="topk", layout="fp8", relative=True, S=20, workspace_rows=8),
    "gather-fp8_132-pre": dict(kind="gather", layout="fp8_132", pre=True),
    "gather-packed68": dict(kind="gather", layout="packed68"),
    "gather-aiter_fp4": dict(kind="gather", layout="aiter_fp4"),
}


def run_triton_case(c):
    import dsaquant
    from dsaquant.reference import prefill as R
    kind = c.get("kind", "logits")
    if kind == "gather":
        a = make_gather(c["layout"], pre=c.get("pre", False), bad=True)
        res = {}
        for be in ("reference", "triton"):
            out = dsaquant.gather_index_cache(a["cache"], a["table"], a["cu"], layout=c["layout"],
                                              kv_cache_scale=a.get("scale"), preshuffle=a["pre"], backend=be)
            try:
                dsaquant.check_errors()
                flagged = False
            except dsaquant.DsaquantError:
                flagged = True
            res[be] = (out, flagged)
        assert all(torch.equal(x, y) for x, y in zip(res["reference"][0], res["triton"][0])), "gather bytes differ"
        assert res["reference"][1] and res["triton"][1], "bad pages not flagged"
        return
    a = make(c["layout"], S=c.get("S", 6), H=c.get("H", 16), exp_lo=c.get("exp_lo", 120), exp_hi=c.get("exp_hi", 130),
             fp8_dtype=torch.float8_e4m3fnuz if c.get("fnuz") else torch.float8_e4m3fn)
    if c.get("mixed"):
        a["q_scale"] = mixed_q_exponents(a["q_scale"].shape, torch.Generator().manual_seed(11))
        a["k_scale"] = mixed_exponents(a["k"].shape[0], torch.Generator().manual_seed(12))
    if c.get("unfold"):
        a["k_scale"][c.get("unfold_key", 37), 2] = 100
    if c.get("unfold") or c.get("unfold_query"):
        a["q_scale"][3, 5, 0] = c.get("unfold_query", 0)
    if c.get("int32"):
        a["q_scale"] = a["q_scale"].view(torch.int32).reshape(a["q"].shape[:2])
        a["k_scale"] = a["k_scale"].view(torch.int32).reshape(-1)
    ks, ke = RANGES
    if c.get("extreme"):
        ks, ke = ks.clone(), ke.clone()
        ks[0], ke[0], ks[3], ke[3] = -(1 << 31), (1 << 31) - 1, 40, (1 << 31) - 1
    if c.get("S"):   # every row a different range, some empty, clamped or negative
        r = torch.arange(c["S"])
        ks, ke = r * 7 % 90 - 5, r * 13 % 110
    exact = c.get("exact", False)
    if kind == "topk":
        from dsaquant.triton import prefill as TP
        saved = TP.TOPK_WORKSPACE_ELEMS
        TP.TOPK_WORKSPACE_ELEMS = c.get("workspace_rows", 0) * a["k"].shape[0] or saved
        try:
            got = dsaquant.mqa_topk(ks=ks, ke=ke, topk=12, layout=c["layout"], exact=exact,
                                    relative=c.get("relative", False), backend="triton", **a)
        finally:
            TP.TOPK_WORKSPACE_ELEMS = saved
        want = dsaquant.mqa_topk(ks=ks, ke=ke, topk=12, layout=c["layout"], exact=exact,
                                 relative=c.get("relative", False), backend="reference", **a)
        assert torch.equal(got, want), "top-k differs from the reference"
        return
    kw = dict(layout=c["layout"], exact=exact, max_seqlen_k=c.get("W", 0), clean_logits=c.get("clean", True),
              out_dtype=torch.bfloat16 if c.get("bf16") else torch.float32)
    outs = {}
    for be in ("reference", "triton"):
        o = None
        if not kw["clean_logits"]:
            o = torch.full((a["q"].shape[0], kw["max_seqlen_k"] or a["k"].shape[0]), 12345.0)
        if be == "triton" and c.get("knobs"):   # launcher knobs (fp8 dots the CPU has not), the op's arguments
            from dsaquant import prefill as P
            from dsaquant.triton import prefill as TP
            SKV, W = a["k"].shape[0], kw["max_seqlen_k"]
            lo, hi = P._ranges(ks, ke, SKV)
            base = P._clamp32(ks, -W, SKV) if W else lo
            if o is None:
                o = torch.empty(a["q"].shape[0], W or SKV)
            o = o.to(kw["out_dtype"])
            outs[be] = TP.mqa_logits(a["q"].view(torch.uint8), a.get("q_scale"), a["k"].view(torch.uint8),
                                     a["k_scale"], a["weights"], lo, hi, base, o, c["layout"], "e4m3fn", False,
                                     kw["clean_logits"], bool(W), **c["knobs"])
            continue
        outs[be] = dsaquant.mqa_logits(ks=ks, ke=ke, out=o, backend=be, **kw, **a)
    ref, tri = outs["reference"], outs["triton"]
    if exact:
        assert torch.equal(ref.view(torch.int16 if c.get("bf16") else torch.int32),
                           tri.view(torch.int16 if c.get("bf16") else torch.int32)), "exact bytes differ"
        return
    _, mag = oracle(a, c["layout"])
    if kw["clean_logits"]:
        mag = expected_layout(mag, ks, ke, a["k"].shape[0], kw["max_seqlen_k"])
    tol = 1e-2 if c.get("bf16") else 1e-5
    check_close(tri.float(), ref.to(torch.float64), mag.clamp_min(0).nan_to_num(0, 0, 0), tol)
    if not kw["clean_logits"]:
        assert torch.equal(tri == 12345.0, ref == 12345.0), "untouched entries differ"


def make_gather(layout, pre=False, bad=False, seed=3, P=16):
    from dsaquant.reference.layouts import write_aiter_fp4, write_fp8_132, write_packed68
    g = torch.Generator().manual_seed(seed)
    lens = [5, 0, 37, 16]
    B = len(lens)
    NB = 12
    table = torch.randperm(NB, generator=g)[:B * 3].reshape(B, 3).to(torch.int32)
    if bad:
        table[2, 2] = NB + 5          # sequence 2's positions 32..36 point past the cache
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    T = int(cu[-1])
    slots = torch.cat([table[b, torch.arange(lens[b]) // P].long() * P + torch.arange(lens[b]) % P
                       for b in range(B)])
    ok = slots < NB * P
    if layout == "fp8_132":
        cache = torch.randint(0, 256, (NB, P * 132), generator=g, dtype=torch.uint8)
        codes = torch.randint(0, 256, (T, 128), generator=g, dtype=torch.uint8)
        scales = torch.rand(T, generator=g)
        write_fp8_132(cache, slots[ok], codes[ok], scales[ok], P, pre)
        want = (torch.where(ok[:, None], codes, 0), torch.where(ok, scales, 0.0))
        return dict(cache=cache, table=table, cu=cu, pre=pre, want=want)
    pay = torch.randint(0, 256, (T, 64), generator=g, dtype=torch.uint8)
    ex = torch.randint(0, 256, (T, 4), generator=g, dtype=torch.uint8)
    want = (torch.where(ok[:, None], pay, 0), torch.where(ok[:, None], ex, 0))
    if layout == "packed68":
        cache = torch.randint(0, 256, (NB, P * 68), generator=g, dtype=torch.uint8)
        write_packed68(cache, slots[ok], pay[ok], ex[ok], P)
        return dict(cache=cache, table=table, cu=cu, pre=False, want=want)
    cache = torch.randint(0, 256, (NB, 1, 4, P, 16), generator=g, dtype=torch.uint8)
    scale = torch.randint(0, 256, (NB, 1, 4, P), generator=g, dtype=torch.uint8)
    write_aiter_fp4(cache, scale, slots[ok], pay[ok], ex[ok], P)
    return dict(cache=cache, scale=scale, table=table, cu=cu, pre=False, want=want)


def _worker(out_path):
    results = {}
    for name, c in TRITON_CASES.items():
        try:
            run_triton_case(c)
            results[name] = ""
        except Exception as e:  # reported per case by the parent
            import traceback
            results[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    sys.path.insert(0, str(REPO / "python"))
    _worker(sys.argv[2])
    sys.exit(0)


# =====================================================================================================
# the tests
# =====================================================================================================
import pytest  # noqa: E402

import dsaquant  # noqa: E402
from dsaquant.reference import prefill as R  # noqa: E402


@pytest.mark.parametrize("layout", ["fp8", "fp4"])
@pytest.mark.parametrize("W", [0, 24, 200])
def test_logits_against_plain_torch(layout, W):
    a = make(layout)
    ks, ke = RANGES
    got = dsaquant.mqa_logits(ks=ks, ke=ke, layout=layout, max_seqlen_k=W, **a)
    vals, mag = oracle(a, layout)
    SKV = a["k"].shape[0]
    check_close(got, expected_layout(vals, ks, ke, SKV, W), expected_layout(mag, ks, ke, SKV, W).clamp_min(0)
                .nan_to_num(0, 0, 0))
    assert got.shape == (6, W or SKV) and got.dtype == torch.float32


def test_logits_argument_forms_int64_bf16_weights_uint8_fp8():
    a = make("fp8")
    a["weights"] = a["weights"].to(torch.bfloat16)
    ks, ke = (t.to(torch.int64) for t in RANGES)
    got = dsaquant.mqa_logits(a["q"].view(torch.uint8), a["k"].view(torch.uint8), a["weights"], ks, ke,
                              k_scale=a["k_scale"].reshape(-1, 1))
    a["weights"] = a["weights"].float()
    want = dsaquant.mqa_logits(ks=RANGES[0], ke=RANGES[1], **a)
    assert torch.equal(got, want)


def test_fp4_int32_exponents_match_bytes():
    a = make("fp4")
    b = dict(a, q_scale=a["q_scale"].view(torch.int32).reshape(6, 16), k_scale=a["k_scale"].view(torch.int32)
             .reshape(-1))
    x = dsaquant.mqa_logits(ks=RANGES[0], ke=RANGES[1], layout="fp4", **a)
    y = dsaquant.mqa_logits(ks=RANGES[0], ke=RANGES[1], layout="fp4", **b)
    assert torch.equal(x, y)
    assert int(b["q_scale"][0, 0]) & 255 == int(a["q_scale"][0, 0, 0])     # block 0 in byte 0


def test_clean_false_leaves_out_untouched_and_bf16_rounds():
    a = make("fp4")
    ks, ke = RANGES
    full = dsaquant.mqa_logits(ks=ks, ke=ke, layout="fp4", **a)
    out = torch.full_like(full, 7.0)
    dsaquant.mqa_logits(ks=ks, ke=ke, layout="fp4", clean_logits=False, out=out, **a)
    valid = torch.isfinite(full)
    assert torch.equal(out[valid], full[valid]) and bool((out[~valid] == 7.0).all())
    bf = dsaquant.mqa_logits(ks=ks, ke=ke, layout="fp4", out_dtype=torch.bfloat16, **a)
    assert torch.equal(bf.view(torch.int16), full.to(torch.bfloat16).view(torch.int16))


def test_hostile_ranges_never_out_of_bounds():
    a = make("fp8", S=4, SKV=10)
    ks = torch.tensor([-(1 << 40), 9, 12, 5], dtype=torch.int64)
    ke = torch.tensor([1 << 40, 3, 20, 5], dtype=torch.int64)
    got = dsaquant.mqa_logits(ks=ks, ke=ke, max_seqlen_k=4, **a)
    assert bool(torch.isneginf(got[0]).all())            # keys ks + c are all negative
    assert bool(torch.isneginf(got[1:]).all())           # empty, past the end, empty
    full = dsaquant.mqa_logits(ks=ks, ke=ke, **a)
    assert bool(torch.isfinite(full[0]).all()) and bool(torch.isneginf(full[1:]).all())


def test_hostile_int32_bounds_and_strided_ones():
    """int32 bounds reach the backends unclamped (each clamps them as it reads them): the extremes of int32 score
    exactly the clamped ranges; strided int32 bounds and int64 ones are clamped by the op first, same result."""
    a = make("fp8", S=4, SKV=10)
    ks = torch.tensor([-(1 << 31), 9, 12, -3], dtype=torch.int32)
    ke = torch.tensor([(1 << 31) - 1, 3, 20, 4], dtype=torch.int32)
    got = dsaquant.mqa_logits(ks=ks, ke=ke, **a)
    assert torch.equal(got, dsaquant.mqa_logits(ks=ks.to(torch.int64), ke=ke.to(torch.int64), **a))
    strided = torch.stack([ks, ks], dim=1)[:, 0], torch.stack([ke, ke], dim=1)[:, 0]
    assert not strided[0].is_contiguous()
    assert torch.equal(got, dsaquant.mqa_logits(ks=strided[0], ke=strided[1], **a))
    assert bool(torch.isfinite(got[0]).all()) and bool(torch.isneginf(got[1:3]).all())
    assert bool(torch.isfinite(got[3, :4]).all()) and bool(torch.isneginf(got[3, 4:]).all())


def test_nan_logits_and_empty_inputs():
    a = make("fp4", S=2, SKV=8)
    a["k_scale"][3, 1] = 255                              # NaN scale: key 3's logits are NaN
    got = dsaquant.mqa_logits(ks=torch.tensor([0, 0]), ke=torch.tensor([8, 8]), layout="fp4", **a)
    assert bool(torch.isnan(got[:, 3]).all()) and bool(torch.isfinite(got[:, :3]).all())
    e = make("fp8", S=0)
    assert dsaquant.mqa_logits(ks=torch.zeros(0, dtype=torch.int32), ke=torch.zeros(0, dtype=torch.int32),
                               **e).shape == (0, 80)
    z = make("fp8", S=2, SKV=0)
    got = dsaquant.mqa_logits(ks=torch.tensor([0, 1]), ke=torch.tensor([5, 5]), max_seqlen_k=3, **z)
    assert got.shape == (2, 3) and bool(torch.isneginf(got).all())
    assert dsaquant.mqa_topk(ks=torch.tensor([0, 1]), ke=torch.tensor([5, 5]), topk=2, **z).tolist() == [[-1, -1]] * 2


def test_fnuz_flavour_and_mixed_flavours():
    a = make("fp8", fp8_dtype=torch.float8_e4m3fnuz)
    vals, mag = oracle(a, "fp8")
    got = dsaquant.mqa_logits(ks=RANGES[0], ke=RANGES[1], **a)
    check_close(got, expected_layout(vals, *RANGES, 80), expected_layout(mag, *RANGES, 80).clamp_min(0)
                .nan_to_num(0, 0, 0))
    with pytest.raises(TypeError, match="flavour"):
        dsaquant.mqa_logits(ks=RANGES[0], ke=RANGES[1], **dict(a, k=a["k"].view(torch.float8_e4m3fn)))


def test_exact_mode_against_fractions():
    g = torch.Generator().manual_seed(5)
    H = 16
    q = torch.randint(0, 256, (1, H, 64), generator=g, dtype=torch.uint8)
    k = torch.randint(0, 256, (6, 64), generator=g, dtype=torch.uint8)
    qe = torch.randint(100, 150, (1, H, 4), generator=g, dtype=torch.uint8)
    ke = torch.randint(100, 150, (6, 4), generator=g, dtype=torch.uint8)
    ke[1] = torch.tensor([1, 2, 3, 1], dtype=torch.uint8)        # products into the subnormal range
    qe[0, :4] = torch.tensor([1, 1, 2, 1], dtype=torch.uint8)
    ke[2] = torch.tensor([200, 180, 190, 205], dtype=torch.uint8)  # large finite values
    ke[3] = torch.tensor([1, 1, 1, 1], dtype=torch.uint8)          # everything far below 2^-149
    w = torch.randn(1, H, generator=g)
    got = dsaquant.mqa_logits(q, k, w, torch.tensor([0]), torch.tensor([6]), layout="fp4", q_scale=qe, k_scale=ke,
                              exact=True)
    for j in range(6):
        want = exact_fraction(q[0], qe[0], k[j], ke[j], w[0])
        assert Fraction(float(got[0, j])) == want, (j, float(got[0, j]), float(want))


def test_exact_special_exponents():
    vals = R.exact_block_value(torch.tensor([5, -3, 0, 7, 9]), torch.tensor([0, 0, 100, 255, 254]),
                               torch.tensor([130, 130, 100, 127, 254]))
    b = vals.view(torch.int32).tolist()
    assert b[0] == 0 and b[1] == -(1 << 31) and b[2] == 0 and torch.isnan(vals[3]) and torch.isinf(vals[4])


def test_selection_order():
    v = torch.tensor([[1.0, 3.0, float("nan"), 3.0, float("-inf"), -0.0, 0.0, float("inf")]])
    assert R.select_topk(v, 8).tolist() == [[7, 1, 3, 0, 5, 6, -1, -1]]
    assert R.select_topk(v, 2).tolist() == [[7, 1]]


def _brute_topk(logits, k):
    out = []
    for row in logits.tolist():
        cand = [(-x, j) for j, x in enumerate(row) if x == x and x != float("-inf")]
        cand.sort()
        idx = [j for _, j in cand[:k]]
        out.append(idx + [-1] * (k - len(idx)))
    return torch.tensor(out, dtype=torch.int32)


@pytest.mark.parametrize("layout,exact", [("fp8", False), ("fp4", False), ("fp4", True)])
def test_topk_equals_logits_then_selection(layout, exact, monkeypatch):
    monkeypatch.setattr(R, "CHUNK_ELEMS", 1 << 12)          # several key and row chunks
    a = make(layout, SKV=300)
    ks, ke = torch.tensor([0, 3, -5, 40, 290, 9]), torch.tensor([300, 80, 20, 299, 250, 9])
    full = dsaquant.mqa_logits(ks=ks, ke=ke, layout=layout, exact=exact, **a)
    got = dsaquant.mqa_topk(ks=ks, ke=ke, topk=40, layout=layout, exact=exact, **a)
    assert torch.equal(got, _brute_topk(full, 40))
    rel = dsaquant.mqa_topk(ks=ks, ke=ke, topk=40, layout=layout, exact=exact, relative=True, **a)
    assert torch.equal(rel, torch.where(got >= 0, got - ks.to(torch.int32).unsqueeze(1), got))


@pytest.mark.parametrize("layout,pre", [("fp8_132", False), ("fp8_132", True), ("packed68", False),
                                        ("aiter_fp4", False)])
def test_gather_against_written_rows(layout, pre):
    a = make_gather(layout, pre=pre, bad=False)
    out, sc = dsaquant.gather_index_cache(a["cache"], a["table"], a["cu"], layout=layout,
                                          kv_cache_scale=a.get("scale"), preshuffle=pre)
    dsaquant.check_errors()
    assert torch.equal(out, a["want"][0]) and torch.equal(sc, a["want"][1])


def test_gather_bad_pages_zero_and_flag():
    a = make_gather("packed68", bad=True)
    out = torch.full((58, 64), 9, dtype=torch.uint8)
    sc = torch.full((58,), 9, dtype=torch.int32)          # int32 exponent words, T = 5 + 0 + 37 + 16
    dsaquant.gather_index_cache(a["cache"], a["table"], a["cu"], layout="packed68", out=out, out_scale=sc)
    with pytest.raises(dsaquant.DsaquantError, match="was not read"):
        dsaquant.check_errors()
    assert torch.equal(out, a["want"][0]) and torch.equal(sc.view(torch.uint8).reshape(58, 4), a["want"][1])


@pytest.mark.parametrize("bad,exc,name", [
    (dict(layout="fp16"), ValueError, "layout"),
    (dict(exact=True), ValueError, "exact"),
    (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k"),
    (dict(max_seqlen_k=2.0), TypeError, "max_seqlen_k"),
    (dict(out_dtype=torch.float16), TypeError, "out_dtype"),
    (dict(clean_logits=1), TypeError, "clean_logits"),
    (dict(q_scale=torch.zeros(6, 16)), ValueError, "q_scale"),
    (dict(k_scale=torch.zeros(79)), ValueError, "k_scale"),
    (dict(weights=torch.zeros(6, 16, dtype=torch.float16)), TypeError, "weights"),
    (dict(ks=torch.zeros(5, dtype=torch.int32)), ValueError, "ks"),
    (dict(ke=torch.zeros(6)), TypeError, "ke"),
    (dict(out=torch.zeros(6, 79)), ValueError, "out"),
])
def test_bad_arguments_named(bad, exc, name):
    a = make("fp8")
    kw = dict(ks=RANGES[0], ke=RANGES[1], **a)
    kw.update(bad)
    with pytest.raises(exc, match=name):
        dsaquant.mqa_logits(**kw)


def test_bad_heads_and_topk():
    a = make("fp4", H=16)
    a["q"] = a["q"][:, :8].contiguous()
    a["q_scale"] = a["q_scale"][:, :8].contiguous()
    a["weights"] = a["weights"][:, :8].contiguous()
    with pytest.raises(ValueError, match="heads"):
        dsaquant.mqa_logits(ks=RANGES[0], ke=RANGES[1], layout="fp4", **a)
    with pytest.raises(ValueError, match="topk"):
        dsaquant.mqa_topk(ks=RANGES[0], ke=RANGES[1], topk=0, **make("fp8"))
    g = make_gather("packed68")
    with pytest.raises(ValueError, match="page_size"):
        dsaquant.gather_index_cache(g["cache"], g["table"], g["cu"], layout="packed68", page_size=32)
    with pytest.raises(ValueError, match="preshuffle"):
        dsaquant.gather_index_cache(g["cache"], g["table"], g["cu"], layout="packed68", preshuffle=True)


# ---- the Triton backend in the interpreter ---------------------------------------------------------
@pytest.fixture(scope="module")
def triton_results():
    pytest.importorskip("triton")
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.json"
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO / "python"))
        r = subprocess.run([sys.executable, str(HERE), "--worker", str(out)], env=env, capture_output=True,
                           text=True, timeout=900)
        if r.returncode != 0 or not out.exists():
            pytest.fail(f"interpreter worker failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
        return json.loads(out.read_text())


@pytest.mark.parametrize("case_id", sorted(TRITON_CASES))
def test_triton_interpreter(triton_results, case_id):
    assert triton_results[case_id] == "", triton_results[case_id]


def test_custom_ops_opcheck_and_compile():
    from dsaquant import prefill as P
    a = make("fp4")
    lo, hi = P._ranges(*RANGES, 80)
    base = torch.zeros(6, dtype=torch.int32)
    args = (a["q"], a["q_scale"], a["k"], a["k_scale"], a["weights"], lo, hi, base)
    torch.library.opcheck(P._logits_op.op, (*args, torch.empty(6, 80), "fp4", "e4m3fn", True, True, False, "reference"))
    torch.library.opcheck(P._topk_op.op, (*args, 8, "fp4", "e4m3fn", True, "reference"))
    g = make_gather("packed68")
    torch.library.opcheck(P._gather_op.op, (g["cache"], None, g["table"], g["cu"], "packed68", 16, False,
                                            torch.empty(58, 64, dtype=torch.uint8), torch.empty(58, 4, dtype=torch.uint8),
                                            torch.zeros(1, dtype=torch.int32), "reference"))
    f = torch.compile(lambda q, k, w: dsaquant.mqa_topk(q, k, w, RANGES[0], RANGES[1], 8, layout="fp4",
                                                        q_scale=a["q_scale"], k_scale=a["k_scale"], exact=True),
                      fullgraph=True, backend="aot_eager")
    want = dsaquant.mqa_topk(a["q"], a["k"], a["weights"], *RANGES, 8, layout="fp4", q_scale=a["q_scale"],
                             k_scale=a["k_scale"], exact=True)
    assert torch.equal(f(a["q"], a["k"], a["weights"]), want)

"""paged_mqa_logits (SPEC §7.4) on every GPU backend against the reference scorer: every layout, H, next_n,
page size, context form, weight and logits dtype, clean_logits, hostile tables, NaN inputs, CUDA-graph
replays with changing context lengths, and the top-2048 sets.

Tolerance: with mag = |weight_scale| * sum_h |w_h| * sum_d |q_hd k_pd|, |backend - reference| <= TOL * mag
(the FP8 tensor cores accumulate the 128 exact products with less than fp32 precision). Every test prints
the largest error it measured, as a multiple of mag.
"""
from __future__ import annotations

import pytest
import torch

from dsaquant import dispatch, errors, ops
from dsaquant.reference.scorer import paged_mqa_logits as ref_scorer
from dsaquant.testing import run_scorer, scorer_hostile_tables, scorer_magnitude, scorer_nan_inputs
from dsaquant.triton.scorer import make_scorer_inputs


pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

TOL = 1e-3
BACKENDS = [b for b in ("cuda", "triton") if dispatch.available(b)[0] and "paged_mqa_logits" in dispatch.ops_of(b)]
LAYOUTS = ("fp8_132", "packed68", "aiter_fp4")




def make(layout, B, N, H, ctx, P=64, seed=0, ctx_form="1d", preshuffle=False, w_dtype=torch.float32):
    a = make_scorer_inputs(layout, B, N, H, ctx, P, device="cuda", seed=seed, preshuffle=preshuffle)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    shape = (B,) if ctx_form == "1d" else (B, N)
    a["context_lens"] = torch.randint(1, ctx + 1, shape, generator=g, device="cuda", dtype=torch.int32)
    a["weights"] = a["weights"].to(w_dtype)
    return a


def ref_args(a, layout, P):
    return (a["q"], a["kv_cache"], a["weights"], a["context_lens"], a["block_tables"], a["max_seq_len"], layout,
            a.get("q_scale"), a.get("kv_cache_scale"), a["weight_scale"], a.get("preshuffle", False),
            a.get("fp8_flavour", "e4m3fn"), P)


def compare(out, ref, mag, what):
    """Largest |out - ref| / mag; asserts the -inf and NaN patterns are identical."""
    out, ref = out.float(), ref.float()
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref)), f"{what}: -inf positions differ"
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), f"{what}: NaN positions differ"
    fin = torch.isfinite(ref)
    assert bool(torch.isfinite(out[fin]).all()), f"{what}: non-finite where the reference is finite"
    if not bool(fin.any()):
        return 0.0
    return float(((out[fin] - ref[fin]).abs() / (mag[fin] + 1e-30)).max())


GRID = [  # layout, B, N, H, ctx, P, ctx_form, preshuffle, w_dtype
    *[(lay, 3, n, h, 700, 64, "2d" if n > 1 else "1d", False, torch.float32)
      for lay in LAYOUTS for h in (16, 32, 64, 128) for n in (1, 2, 3, 8) if h * n <= 1024],
    *[(lay, 2, 2, 64, 1000, p, "1d", False, torch.bfloat16) for lay in LAYOUTS for p in (32, 128)],
    ("fp8_132", 2, 1, 64, 900, 64, "1d", True, torch.float32),
    ("fp8_132", 2, 2, 64, 1000, 100, "2d", False, torch.float32),   # tiles across pages of 100 and 96 slots
    ("packed68", 2, 2, 64, 1000, 96, "2d", False, torch.float32),
    ("fp8_132", 2, 4, 32, 900, 32, "2d", True, torch.bfloat16),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_scorer_grid_matches_reference(backend):
    worst = {}
    for (layout, B, N, H, ctx, P, form, pre, wdt) in (GRID if backend == "cuda" else GRID[::3]):
        a = make(layout, B, N, H, ctx, P, seed=B * N + H, ctx_form=form, preshuffle=pre, w_dtype=wdt)
        args = ref_args(a, layout, P)
        ref = run_scorer(ref_scorer, *args)
        mag = scorer_magnitude(args)
        for dt in (torch.float32, torch.bfloat16):
            out = ops.paged_mqa_logits(layout=layout, backend=backend, logits_dtype=dt, **a)
            what = f"{backend} {layout} B={B} N={N} H={H} P={P} {form} pre={pre} w={wdt} out={dt}"
            if dt == torch.bfloat16:   # one bf16 rounding of the logit on top
                e = compare(out, ref.to(torch.bfloat16), mag + ref.abs(), what)
                assert e <= TOL + 2 ** -8, f"{what}: error {e:.3g}"
            else:
                e = compare(out, ref, mag, what)
                assert e <= TOL, f"{what}: error {e:.3g} x mag"
                worst[layout] = max(worst.get(layout, 0.0), e)
    print(f"\n{backend}: worst |err| / mag by layout: " + ", ".join(f"{k} {v:.3g}" for k, v in worst.items()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scorer_clean_logits_false_leaves_the_rest(backend, layout):
    a = make(layout, 4, 2, 64, 1500, seed=3, ctx_form="2d")
    out = torch.full((8, 1500), 7.0, device="cuda")
    ops.paged_mqa_logits(layout=layout, backend=backend, clean_logits=False, out=out, **a)
    ref = run_scorer(ref_scorer, *ref_args(a, layout, 64))
    inside = torch.arange(1500, device="cuda")[None, :] < a["context_lens"].reshape(8, 1)
    assert bool((out[~inside] == 7.0).all()), "entries past the context were written"
    assert bool(torch.isfinite(out[inside]).all())
    assert compare(torch.where(inside, out, ref), ref, scorer_magnitude(ref_args(a, layout, 64)), "clean=False") <= TOL


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scorer_hostile_tables(backend, layout):
    """Page ids outside [0, num_blocks), contexts past max_seq_len, past the table and negative: the same
    -inf pattern and values as the reference, nothing read out of bounds, and the error flag raised."""
    a = scorer_hostile_tables(make(layout, 5, 2, 32, 640, seed=5, ctx_form="2d"))
    errors.check_errors()
    ref = run_scorer(ref_scorer, *ref_args(a, layout, 64))
    with pytest.raises(errors.DsaquantError):
        errors.check_errors()
    out = ops.paged_mqa_logits(layout=layout, backend=backend, **a)
    e = compare(out, ref, scorer_magnitude(ref_args(a, layout, 64)), f"hostile {backend} {layout}")
    assert e <= TOL
    with pytest.raises(errors.DsaquantError, match="block table"):
        errors.check_errors()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scorer_nan_inputs(backend, layout):
    a = scorer_nan_inputs(make(layout, 2, 1, 64, 300, seed=7), layout)
    args = ref_args(a, layout, 64)
    ref = run_scorer(ref_scorer, *args)
    assert bool(torch.isnan(ref).any())
    out = ops.paged_mqa_logits(layout=layout, backend=backend, **a)
    assert compare(out, ref, scorer_magnitude(args), f"NaN {backend} {layout}") <= TOL


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scorer_top2048_overlap(backend, layout):
    a = make(layout, 8, 1, 64, 16384, seed=11)
    a["context_lens"].fill_(16384)
    args = ref_args(a, layout, 64)
    ref = run_scorer(ref_scorer, *args)
    out = ops.paged_mqa_logits(layout=layout, backend=backend, **a)
    k = 2048
    r = torch.topk(ref, k, dim=1).indices.sort(dim=1).values
    o = torch.topk(out, k, dim=1).indices.sort(dim=1).values
    same = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(r, o)) / r.numel()
    print(f"\n{backend} {layout}: top-{k} overlap {same:.6f}")
    assert same >= 0.999


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scorer_graph_replay_with_new_context_lengths(backend, layout):
    a = make(layout, 6, 2, 64, 2048, seed=13, ctx_form="2d")
    out = torch.empty((12, 2048), device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ops.paged_mqa_logits(layout=layout, backend=backend, out=out, **a)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.paged_mqa_logits(layout=layout, backend=backend, out=out, **a)
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(100 + seed)
        a["context_lens"].copy_(torch.randint(0, 2049, (6, 2), generator=gen, device="cuda", dtype=torch.int32))
        out.fill_(float("nan"))
        g.replay()
        args = ref_args(a, layout, 64)
        ref = run_scorer(ref_scorer, *args)
        assert compare(out, ref, scorer_magnitude(args), f"graph {backend} {layout} replay {seed}") <= TOL

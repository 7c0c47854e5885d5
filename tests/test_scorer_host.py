"""The CUDA decode scorer's block body (kernels/cuda/scorer_body.cuh) on the CPU, against the reference.

tests/cpp/scorer_host.cpp runs the body unchanged under the fiber emulator of tests/cpp/fibers.h, with a layer
modelled on the hardware (asynchronous copies that land only when their group is waited for, the matrix unit's
swizzled operand addressing, register operands gathered across the lanes that hold them, accumulator fragments,
garbage shared memory), through the backend's own argument struct (dsaquant.backends.scorer.make_args). Every
case compares with the reference scorer: -inf, NaN and untouched entries exactly where it has them, logits within
1e-5 of mag = |weight_scale| * sum_h |w_h| * sum_d |q_hd k_pd| (the emulated products are exact; the sums run in
another order), every layout, H, queries per block, page size (powers of two and not), context form, dtype,
split and block order, hostile tables with the error flag, NaN inputs and negative fp8 scales."""
from __future__ import annotations

import ctypes

import pytest
import torch

from dsaquant.backends import scorer as abi
from dsaquant.codes import ErrFlag
from dsaquant.reference.scorer import paged_mqa_logits as ref_scorer
from dsaquant.testing import run_scorer, scorer_hostile_tables, scorer_magnitude, scorer_nan_inputs
from dsaquant.triton.scorer import make_scorer_inputs

from conftest import REPO
from host_cpp import emulator

CPP = REPO / "tests" / "cpp"
SOURCES = [CPP / "scorer_host.cpp", *(REPO / "kernels" / "cuda" / f for f in ("scorer_body.cuh", "scorer.h", "quad.cuh")),
           CPP / "sm90_emu.h", CPP / "fibers.h"]
LAYOUTS = ("fp8_132", "packed68", "aiter_fp4")
UNTOUCHED = 12345.0
TOL = 1e-5
FLAG_PAGE = int(ErrFlag.page_out_of_range)


def load(flags=()):
    """The emulator of the kernel body, built with `flags` (the kernel's tuning macros)."""
    h = emulator(SOURCES, "scorer_host", "the scorer emulator", flags)
    h.dsq_paged_mqa_logits.argtypes = [ctypes.POINTER(abi.PagedLogitsArgs), ctypes.c_void_p]
    h.dsq_paged_mqa_logits.restype = ctypes.c_int
    return h


@pytest.fixture(scope="module")
def lib():
    """The emulator of the kernel body as built."""
    return load()


def make(layout, B, N, H, ctx, P=64, seed=0, ctx_form="1d", preshuffle=False, w_dtype=torch.float32):
    """Random inputs with context lengths in [1, ctx] ([B] or [B, N])."""
    a = make_scorer_inputs(layout, B, N, H, ctx, P, device="cpu", seed=seed, preshuffle=preshuffle)
    g = torch.Generator().manual_seed(seed + 1)
    a["context_lens"] = torch.randint(1, ctx + 1, (B,) if ctx_form == "1d" else (B, N), generator=g, dtype=torch.int32)
    a["weights"] = a["weights"].to(w_dtype)
    return a


def ref_args(a, layout, P):
    return (a["q"], a["kv_cache"], a["weights"], a["context_lens"], a["block_tables"], a["max_seq_len"], layout,
            a.get("q_scale"), a.get("kv_cache_scale"), a["weight_scale"], a.get("preshuffle", False), "e4m3fn", P)


def emulate(lib, a, layout, P, *, clean=True, out_dtype=torch.float32, splits=0, slots=8, order=0, prefetch=False):
    """(logits, error flag) of the emulated kernel; entries it does not write keep UNTOUCHED. `prefetch`: each block
    runs the prefetch of a dependent launch (prefetch_block) first, whose every prefetch the emulator checks."""
    args = ref_args(a, layout, P)
    B, N = a["q"].shape[:2]
    out = torch.full((B * N, a["max_seq_len"]), UNTOUCHED, dtype=out_dtype)
    flag = torch.zeros(1, dtype=torch.int32)
    st = abi.make_args(*args[:11], P, clean, out, flag, 0, splits)
    lib.dsq_emu_set_order(order, 11)
    lib.dsq_emu_set_slots(slots)
    lib.dsq_emu_set_prefetch(int(prefetch))
    rc = lib.dsq_paged_mqa_logits(ctypes.byref(st), None)
    assert rc == 0, f"rc {rc}: {lib.dsq_error_string(rc).decode()}"
    return out, int(flag)


def check(out, a, layout, P, what, *, clean=True, bf16=False):
    """Asserts the emulated logits match the reference's (see the module docstring)."""
    args = ref_args(a, layout, P)
    ref = run_scorer(ref_scorer, *args)
    mag = scorer_magnitude(args)
    B, N = a["q"].shape[:2]
    if not clean:   # entries past each query's context stay untouched, the rest as with clean logits
        ctx = a["context_lens"].to(torch.int64).reshape(B, -1).expand(B, N).reshape(B * N, 1)   # [B]: every query
        inside = torch.arange(a["max_seq_len"])[None, :] < ctx.clamp(0, a["max_seq_len"])
        assert bool((out[~inside].float() == UNTOUCHED).all()), f"{what}: entries past the context were written"
        out = torch.where(inside, out.float(), ref)
    assert not bool((out.float() == UNTOUCHED).any()), f"{what}: entries left unwritten"
    if bf16:
        ref, mag = ref.to(torch.bfloat16).float(), mag + ref.abs()
    got = out.float()
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), f"{what}: -inf positions differ"
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), f"{what}: NaN positions differ"
    fin = torch.isfinite(ref)
    assert bool(torch.isfinite(got[fin]).all()), f"{what}: non-finite where the reference is finite"
    if bool(fin.any()):
        err = float(((got[fin] - ref[fin]).abs() / (mag[fin] + 1e-30)).max())
        assert err <= (2 ** -8 if bf16 else TOL), f"{what}: error {err:.3g} x mag"


# layout, H, N (queries: NQ = the next power of two, up to 128 / H), ctx form: every tile width (NT = 16 .. 128),
# both accumulator modes (two sets up to 64 rows, one beyond), 1 to 4 logits a lane stores, and partial query
# groups (N = 3 of NQ = 4, 7 of 8).
GRID = [(lay, h, n, "2d" if n > 1 else "1d") for lay in LAYOUTS
        for (h, n) in ((16, 1), (16, 3), (16, 7), (32, 2), (32, 4), (64, 1), (64, 2), (128, 1))]


@pytest.mark.parametrize("layout,H,N,form", GRID)
def test_grid_matches_reference(lib, layout, H, N, form):
    a = make(layout, 2, N, H, 300, seed=H + N, ctx_form=form)
    out, flag = emulate(lib, a, layout, 64)
    check(out, a, layout, 64, f"{layout} H={H} N={N} {form}")
    assert flag == 0


@pytest.mark.parametrize("layout,P,pre", [(lay, p, False) for lay in LAYOUTS for p in (16, 32, 128)] +
                         [("fp8_132", 48, False), ("packed68", 20, False), ("fp8_132", 100, False),
                          ("packed68", 96, False), ("fp8_132", 128, True), ("fp8_132", 32, True), ("fp8_132", 80, True)])
def test_page_sizes(lib, layout, P, pre):
    """Tiles over several pages (P < 64), pages over several tiles (tiles at rows 64, 128 .. of a page), page sizes
    that are not powers of two (tiles across two pages), plain and preshuffled fp8 rows."""
    a = make(layout, 2, 2, 32, 333, P=P, seed=P, ctx_form="2d", preshuffle=pre)
    out, flag = emulate(lib, a, layout, P)
    check(out, a, layout, P, f"{layout} P={P} preshuffle={pre}")
    assert flag == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dtypes_and_preshuffle(lib, layout):
    """bf16 weights and logits; fp8_132 with the preshuffled row order."""
    a = make(layout, 2, 2, 64, 200, seed=3, ctx_form="1d", preshuffle=layout == "fp8_132", w_dtype=torch.bfloat16)
    for dt in (torch.float32, torch.bfloat16):
        out, _ = emulate(lib, a, layout, 64, out_dtype=dt)
        check(out, a, layout, 64, f"{layout} out={dt}", bf16=dt == torch.bfloat16)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_clean_logits_false_leaves_the_rest(lib, layout):
    a = make(layout, 3, 2, 16, 260, seed=4, ctx_form="1d")
    out, _ = emulate(lib, a, layout, 64, clean=False)
    check(out, a, layout, 64, f"{layout} clean=False", clean=False)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_splits_and_block_orders(lib, layout):
    """The context split over blocks (explicit counts, and the plan's for several device sizes) and the order in
    which blocks run change nothing."""
    a = make(layout, 2, 1, 64, 520, seed=5)
    for splits, slots, order in ((1, 8, 0), (3, 8, 1), (0, 40, 2), (0, 1, 0), (100, 8, 2)):
        out, _ = emulate(lib, a, layout, 64, splits=splits, slots=slots, order=order)
        check(out, a, layout, 64, f"{layout} splits={splits} slots={slots} order={order}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_long_blocks(lib, layout):
    """Blocks of many tile pairs (full contexts of 1500 positions, one or two blocks a sequence): the stage ring and
    the copy barriers' phases wrap several times (a barrier waited on with the wrong phase, or a stage refilled
    before it was read, shows in the logits or as an emulator fault)."""
    a = make(layout, 2, 1, 64, 1500, seed=12)
    a["context_lens"] = torch.tensor([1500, 1437], dtype=torch.int32)
    for splits in (1, 2):
        out, _ = emulate(lib, a, layout, 64, splits=splits)
        check(out, a, layout, 64, f"{layout} long blocks, splits={splits}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hostile_tables(lib, layout):
    """Page ids outside [0, num_blocks), contexts past max_seq_len, past the table and negative: the reference's
    values and -inf pattern, no copy outside the cache (the emulator checks every one), and the error flag."""
    a = scorer_hostile_tables(make(layout, 5, 2, 32, 640, seed=6, ctx_form="2d"))
    out, flag = emulate(lib, a, layout, 64, splits=3)
    check(out, a, layout, 64, f"hostile {layout}")
    assert flag & FLAG_PAGE


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefetch_stays_inside_the_inputs(lib, layout):
    """The prefetch of a dependent launch (prefetch_block, a DSQ_SCORER_PREFETCH build) names only bytes of the q rows
    and of the cache, 16-byte aligned (the emulator checks every one), for every page size, split, 64-bit tables and
    hostile ones (entries outside [0, num_blocks), contexts past the table); the logits are those without it."""
    sizes = (16, 32, 64, 128) if layout == "aiter_fp4" else (16, 32, 64, 96, 128)
    cases = [(make(layout, 3, 2, 32, 700, P=P, seed=30 + i, ctx_form="2d"), P) for i, P in enumerate(sizes)]
    cases.append((scorer_hostile_tables(make(layout, 5, 2, 32, 640, seed=6, ctx_form="2d")), 64))
    for i, (a, P) in enumerate(cases):
        if i % 2:
            a["block_tables"] = a["block_tables"].to(torch.int64)
        for splits in (0, 3):
            out, _ = emulate(lib, a, layout, P, splits=splits, prefetch=True)
            check(out, a, layout, P, f"prefetch {layout} P={P} splits={splits}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nan_inputs(lib, layout):
    a = scorer_nan_inputs(make(layout, 2, 1, 64, 300, seed=7), layout)
    a["context_lens"] = torch.tensor([300, 300], dtype=torch.int32)
    out, _ = emulate(lib, a, layout, 64)
    check(out, a, layout, 64, f"NaN {layout}")
    assert bool(out.isnan().any())


def test_negative_fp8_scales(lib):
    """fp8_132 k scales below zero (no writer produces them): relu applies to the scaled products."""
    P = 64
    a = make("fp8_132", 2, 2, 32, 256, seed=8, ctx_form="2d")
    sc = a["kv_cache"][:, P * 128:].contiguous().view(torch.float32)
    sc[::2, 3::7] *= -1
    a["kv_cache"][:, P * 128:] = sc.view(torch.uint8)
    out, _ = emulate(lib, a, "fp8_132", P)
    check(out, a, "fp8_132", P, "negative scales")


def test_aiter_pages_across_tiles_are_left_to_triton(lib):
    """aiter_fp4 pages of 80, 96 or 112 slots (a tile's exponents in two pages) are not taken: the library
    returns cudaErrorNotSupported (801) before anything is written, and the backend calls the Triton kernel."""
    a = make("aiter_fp4", 1, 1, 16, 200, P=96, seed=9)
    out = torch.full((1, 200), UNTOUCHED)
    st = abi.make_args(*ref_args(a, "aiter_fp4", 96)[:11], 96, True, out, torch.zeros(1, dtype=torch.int32), 0)
    assert lib.dsq_paged_mqa_logits(ctypes.byref(st), None) == abi.ERR_NOT_SUPPORTED
    assert bool((out == UNTOUCHED).all())


@pytest.mark.parametrize("flags", [("-DDSQ_SCORER_DUAL_MAX_ROWS=128", "-DDSQ_SCORER_DUAL_MAX_ROWS_FP4=128"),
                                   ("-DDSQ_SCORER_STAGES_FP8=6", "-DDSQ_SCORER_STAGES_FP4=8")],
                         ids=["dual-128-rows", "deeper-pipelines"])
def test_build_variants(flags):
    """The build variants give the same logits: two accumulator sets of up to 128 q rows (DSQ_SCORER_DUAL_MAX_ROWS*),
    and more tile pairs in flight (DSQ_SCORER_STAGES_*: the stage ring wraps at another count, more copy groups
    pending), over contexts of many pairs and splits that end inside the ring."""
    lib = load(flags)
    for layout in LAYOUTS:
        for (H, N, ctx, splits) in ((64, 2, 200, 0), (128, 1, 900, 2), (16, 7, 700, 3)):
            a = make(layout, 2, N, H, ctx, seed=H + N, ctx_form="2d" if N > 1 else "1d")
            out, _ = emulate(lib, a, layout, 64, splits=splits)
            check(out, a, layout, 64, f"{flags} {layout} H={H} N={N} splits={splits}")


@pytest.mark.parametrize("layout", ["packed68", "aiter_fp4"])
@pytest.mark.parametrize("k_exps,q_exps", [((100, 131), (100, 131)), ((1, 31), (200, 240))])
def test_fp4_wide_exponent_spans_and_zero_scales(lib, layout, k_exps, q_exps):
    """FP4 rows whose block exponents span more than the 14 binades the fold keeps exact (the small blocks round to
    e4m3 subnormals), keys whose largest exponent is below 31 (against huge query scales, so that their logits are
    normal numbers), and zero-scale blocks (exponent 0): within the tolerance of mag all the same."""
    P = 64
    a = make(layout, 2, 2, 64, 200, seed=k_exps[0] + 3, ctx_form="2d")
    g = torch.Generator().manual_seed(q_exps[0])
    if layout == "packed68":
        kv = a["kv_cache"]
        kv[:, P * 64:] = torch.randint(*k_exps, kv[:, P * 64:].shape, generator=g, dtype=torch.uint8)
        kv[::3, P * 64 + 5::7] = 0
        a["q_scale"][:] = torch.randint(*q_exps, a["q_scale"].shape, generator=g, dtype=torch.uint8)
        a["q_scale"][0, 1, ::9, 2] = 0
    else:
        from dsaquant.reference.layouts import write_aiter_q_scale
        a["kv_cache_scale"][:] = torch.randint(*k_exps, a["kv_cache_scale"].shape, generator=g, dtype=torch.uint8)
        a["kv_cache_scale"][::3, :, 1, ::5] = 0
        qe = torch.randint(*q_exps, (4, 64, 4), generator=g, dtype=torch.uint8)
        qe[1, ::9, 2] = 0
        write_aiter_q_scale(a["q_scale"], torch.arange(4), qe, 64)
    out, _ = emulate(lib, a, layout, P)
    check(out, a, layout, P, f"{layout} k exponents {k_exps}, q exponents {q_exps}")

"""The CUDA top-k selection's block bodies on the CPU, byte for byte.

kernels/cuda/topk_body.cuh holds the algorithm that kernels/cuda/topk.cu launches on NVIDIA (and hipified on AMD).
tests/cpp/topk_host.cpp runs the same bodies on the host, one cooperative fiber per GPU thread (1024 a block, and
256 in the AMD configuration): block barriers and 32-lane shuffles are rendezvous points, and the blocks of a grid
run one after another in order, reversed or shuffled. It exports kernels/cuda/topk.h's C interface, so the
arguments come from the same ctypes glue (dsaquant.backends.topk_abi) as on the GPU, with CPU tensors. Every
output is compared with the reference backend (dsaquant.reference.topk) on the same inputs: both paths (one block
a row, and the few-long-rows histogram / scatter / finish path with its fallback for a threshold bin too full
to sort), every span form, hostile spans, ties, NaN and infinities, fp32/bf16/fp16 logits, relative positions
and block orders. What this cannot see: the device SIMT layer of topk.cu (a dozen lines), races between blocks
running at the same time (the lists are filled through atomic slot reservations, whose order the shuffled runs
vary), and the launches themselves.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

import dsaquant as dq
import host_cpp
from dsaquant.backends import topk_abi

REPO = Path(__file__).resolve().parents[1]
SOURCES = [REPO / "tests/cpp/topk_host.cpp", REPO / "tests/cpp/fibers.h", REPO / "kernels/cuda/topk_body.cuh",
           REPO / "kernels/cuda/topk.h",
           *sorted((REPO / "src/include/dsaquant").glob("*.h"))]
POISON = -123456


# The build options off by default (topk_body.cuh): the merge sort and the finish by 8 blocks a row.
OPTIONS = ("-DDSQ_TOPK_MERGE=1", "-DDSQ_TOPK_FINISH_GROUPS=8")


def _build(amd: bool, options: bool = False) -> Path:
    flags = (("-DDSQ_TOPK_AMD=1",) if amd else ()) + (OPTIONS if options else ())
    return host_cpp.build(SOURCES, "test_topk_host" + ("_amd" if amd else "") + ("_options" if options else ""),
                          "the top-k emulator", flags)


# Each platform's configuration, as built by default and with the build options.
@pytest.fixture(scope="module", params=["nvidia", "amd", "nvidia-options", "amd-options"])
def emu(request):
    if host_cpp.cxx() is None:
        pytest.skip("no C++ compiler")
    amd = request.param.startswith("amd")
    lib = ctypes.CDLL(str(_build(amd, request.param.endswith("options"))))
    lib.dsq_error_string.restype = ctypes.c_char_p
    lib.dsq_emu_set_order.argtypes = [ctypes.c_int, ctypes.c_uint64]
    assert lib.dsq_emu_threads() == (256 if amd else 1024)
    return lib


def logits_of(rows, L, kind, seed, dtype=torch.float32, stride_pad=0):
    g = torch.Generator().manual_seed(seed)
    n = L + stride_pad
    if kind == "randn":
        x = torch.randn(rows, n, generator=g)
    elif kind == "ties":    # 17 values: thousands of ties at the k-th value
        x = torch.randint(-8, 9, (rows, n), generator=g).float() * 0.5
    elif kind == "zeros":   # +0.0 and -0.0 only: one key, a threshold bin too full to sort
        x = torch.where(torch.rand(rows, n, generator=g) < 0.5, 0.0, -0.0)
    elif kind == "specials":
        x = torch.randn(rows, n, generator=g)
        pick = torch.rand(rows, n, generator=g)
        x = torch.where(pick < 0.05, float("nan"), x)
        x = torch.where((pick >= 0.05) & (pick < 0.07), float("inf"), x)
        x = torch.where((pick >= 0.07) & (pick < 0.3), float("-inf"), x)
    elif kind == "outlier":   # random normal and a few huge values: the taken keys' range stretched, the words
        x = torch.randn(rows, n, generator=g)   # crowded into few sort buckets (the bitonic sort's turn)
        at = torch.randint(0, n, (rows, 3), generator=g)
        x.scatter_(1, at, torch.tensor([1e30, -1e30, 3e29]).expand(rows, 3).contiguous())
    elif kind == "lsb":     # one sign and exponent: keys share their top 12 bits (one bin), differ below
        x = (0x3F900000 | torch.randint(0, 1 << 20, (rows, n), generator=g, dtype=torch.int32)).view(torch.float32)
    else:
        raise ValueError(kind)
    return x.to(dtype)[:, :L]


def spans(rows, L, form, seed, next_n=1):
    g = torch.Generator().manual_seed(seed + 7)
    if form == "prefill":   # hostile: negative starts, ks > ke, ke past L
        ks = torch.randint(-5, L // 2, (rows,), generator=g, dtype=torch.int32)
        ke = ks + torch.randint(-10, L + 10, (rows,), generator=g, dtype=torch.int32)
        ks[0], ke[0] = 0, L
        return dict(ks=ks, ke=ke)
    B = rows // next_n
    if form == "decode2d":
        return dict(context_lens=torch.randint(-3, L + 9, (B, next_n), generator=g, dtype=torch.int64), next_n=next_n)
    c = torch.randint(next_n, L + 9, (B,), generator=g, dtype=torch.int32)
    c[0] = L
    return dict(context_lens=c, next_n=next_n)


def run(lib, x, k, kw, chunks, order=0, seed=0):
    """dsq_topk_indices on the emulator: (rc, out, workspace)."""
    ctx, ks, ke = kw.get("context_lens"), kw.get("ks"), kw.get("ke")
    out = torch.full((x.shape[0], k), POISON, dtype=torch.int32)
    ws = torch.full((max(1, topk_abi.workspace_bytes(x.shape[0], x.shape[1], k, chunks)),), 0x5A, dtype=torch.uint8)
    a = topk_abi.make_args(x, k, ctx.contiguous() if ctx is not None else None, kw.get("next_n", 1), ks, ke,
                           kw.get("relative", False), out, workspace=ws, chunks=chunks)
    lib.dsq_emu_set_order(order, seed)
    rc = topk_abi.call(lib, a, 0)
    assert rc != 2, lib.dsq_error_string(2).decode()
    return rc, out, ws


def check(lib, x, k, kw, chunks, order=0):
    rc, out, ws = run(lib, x, k, kw, chunks, order)
    assert rc == 0
    ref = dq.topk_indices(x, k, **kw, backend="reference")
    bad = (out != ref).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} of {out.numel()} outputs differ, first at {bad[0].tolist()}"
    return ws


CASES = {
    # name: (rows, L, k, kind, form, next_n, dtype, chunks)
    "randn-few-long-rows": (4, 24000, 512, "randn", "decode", 1, torch.float32, 5),
    "randn-one-block-a-row": (4, 24000, 512, "randn", "decode", 1, torch.float32, 1),
    "ties-one-block-a-row": (3, 30000, 700, "ties", "prefill", 1, torch.float32, 1),
    "zeros-one-block-a-row-fallback": (2, 9000, 1000, "zeros", "prefill", 1, torch.float32, 1),
    "specials-one-block-a-row": (4, 10000, 600, "specials", "decode", 2, torch.float32, 1),
    "outlier-one-block-a-row": (3, 20000, 1000, "outlier", "decode", 1, torch.float32, 1),
    "k2048-planned": (2, 40000, 2048, "randn", "decode", 1, torch.float32, 0),
    "ties-prefill": (3, 30000, 700, "ties", "prefill", 1, torch.float32, 4),
    "zeros-fallback": (2, 9000, 1000, "zeros", "prefill", 1, torch.float32, 3),
    # ~3500 keys a value: lists of 5000-6500 words, the 8192-word sort (AMD: past its 4096, the fallback)
    "ties-big-sort": (2, 60000, 3000, "ties", "decode", 1, torch.float32, 4),
    "lsb-one-top-bin": (2, 12000, 300, "lsb", "decode", 1, torch.float32, 3),
    # the selection inside bin b: 8000 words of one bin (AMD: past its 4096, the fallback), and a bin of equal
    # keys where only the positions decide
    "lsb-select-in-bin": (2, 8000, 300, "lsb", "decode", 1, torch.float32, 1),
    "lsb-select-in-bin-lists": (2, 8000, 300, "lsb", "decode", 1, torch.float32, 2),
    "ties-select-by-position": (2, 6000, 700, "ties", "prefill", 1, torch.float32, 1),
    "specials-mtp2": (4, 10000, 600, "specials", "decode", 2, torch.float32, 2),
    "decode2d-mtp3": (6, 9000, 256, "specials", "decode2d", 3, torch.float32, 2),
    "k-past-row": (3, 3000, 4000, "randn", "prefill", 1, torch.float32, 2),
    "bf16": (2, 16000, 1000, "ties", "decode", 1, torch.bfloat16, 3),
    "fp16": (2, 16000, 1000, "specials", "prefill", 1, torch.float16, 3),
    # the cached-row path (chunks = -blocks; AMD: one block a row): clusters of 1 to 8 blocks, each block's part
    # of the row cached, the words collected into the first block's lists
    "randn-cached-one-block": (4, 24000, 512, "randn", "decode", 1, torch.float32, -1),
    "ties-cached-2": (3, 30000, 700, "ties", "prefill", 1, torch.float32, -2),
    "outlier-cached-2": (3, 20000, 1000, "outlier", "decode", 1, torch.float32, -2),
    "zeros-cached-fallback": (2, 9000, 1000, "zeros", "prefill", 1, torch.float32, -2),
    "specials-cached-4-mtp2": (4, 10000, 600, "specials", "decode", 2, torch.float32, -4),
    "lsb-cached-8": (2, 12000, 300, "lsb", "decode", 1, torch.float32, -8),
    "randn-cached-16": (2, 70000, 2048, "randn", "prefill", 1, torch.float32, -16),
    "k2048-cached-planned": (2, 40000, 2048, "randn", "decode", 1, torch.float32, None),
    "ties-big-sort-cached": (2, 60000, 3000, "ties", "decode", 1, torch.float32, -2),
    "decode2d-cached-mtp3": (6, 9000, 256, "specials", "decode2d", 3, torch.float32, -2),
    "bf16-cached": (2, 16000, 1000, "ties", "decode", 1, torch.bfloat16, -2),
    "fp16-cached": (2, 16000, 1000, "specials", "prefill", 1, torch.float16, -4),
    "zeros-cached-fallback-4": (2, 9000, 1000, "zeros", "prefill", 1, torch.float32, -4),
    "ties-cached-8": (3, 30000, 700, "ties", "prefill", 1, torch.float32, -8),
    "k-past-row-cached-4": (3, 3000, 4000, "randn", "prefill", 1, torch.float32, -4),
    # a cluster too small for the row: one block a row instead
    "cached-too-few-blocks": (2, 40000, 700, "randn", "prefill", 1, torch.float32, -1),
}


@pytest.mark.parametrize("relative", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_emulated_kernel_equals_reference(emu, name, relative):
    rows, L, k, kind, form, next_n, dtype, chunks = CASES[name]
    x = logits_of(rows, L, kind, seed=len(name), dtype=dtype)
    kw = dict(spans(rows, L, form, seed=len(name), next_n=next_n), relative=relative)
    if chunks == 0:     # the few-long-rows plan (a build without the cached-row path)
        chunks = topk_abi.plan_chunks(rows, L, k, 132, cache_keys=0)
        assert chunks > 1
    elif chunks is None:   # the NVIDIA build's plan: the cached-row path, 2 blocks' caches spread over 4 blocks
        chunks = topk_abi.plan_chunks(rows, L, k, 132)
        assert chunks == -4
    check(emu, x, k, kw, chunks)


@pytest.mark.parametrize("order", [1, 2])
def test_block_order_does_not_change_the_bytes(emu, order):
    x = logits_of(4, 20000, "ties", seed=3)
    kw = spans(4, 20000, "decode", seed=3)
    check(emu, x, 900, kw, 6, order)


def test_histogram_counts_every_candidate_of_the_span(emu):
    """The workspace after a few-long-rows call: each row's 4096-bin histogram sums to its candidates (values
    neither NaN nor -inf inside the span), and the above + bin lists hold at least min(k, candidates)."""
    rows, L, k, chunks = 4, 10000, 300, 3
    x = logits_of(rows, L, "specials", seed=5)
    kw = spans(rows, L, "prefill", seed=5)
    ws = check(emu, x, k, kw, chunks)
    hist = ws[: rows * 4096 * 4].view(torch.int32).view(rows, 4096)
    counts = ws[rows * 4096 * 4: rows * 4098 * 4].view(torch.int32).view(rows, 2)
    for r in range(rows):
        s = max(0, min(int(kw["ks"][r]), L))
        e = max(s, min(max(int(kw["ke"][r]), 0), L))
        v = x[r, s:e]
        cands = int((~torch.isnan(v) & (v != float("-inf"))).sum())
        assert int(hist[r].sum()) == cands
        assert int(counts[r, 0]) < max(k, 1) or cands <= k
        assert int(counts[r].sum()) >= min(k, cands)


def test_strided_rows(emu):
    x = logits_of(3, 15000, "randn", seed=11, stride_pad=77)
    assert x.stride(0) == 15077
    check(emu, x, 777, spans(3, 15000, "prefill", seed=2), 3)


def test_bad_arguments_write_nothing(emu):
    x = logits_of(2, 10000, "randn", seed=1)
    kw = spans(2, 10000, "prefill", seed=1)
    rc, out, _ = run(emu, x, 5000, kw, 1)          # min(k, L) rounds up past DSQ_TOPK_MAX_SORT
    assert rc == 1 and bool((out == POISON).all())
    rc, out, _ = run(emu, x, 16, kw, 2000)         # more blocks a row than kMaxChunks
    assert rc == 1 and bool((out == POISON).all())
    rc, out, _ = run(emu, x[:, :0], 5000, spans(2, 0, "prefill", seed=1), 1)   # min(k, L) = 0: all -1
    assert rc == 0 and bool((out == -1).all())


@pytest.mark.parametrize("amd", [False, True], ids=["nvidia", "amd"])
def test_plan_and_workspace_mirror(amd):
    """The library's plan and workspace size equal topk_abi's mirrors, with the platform's cached-row keys (the
    NVIDIA build's plan takes the cached-row path up to 8 blocks' caches, AMD's never)."""
    lib = ctypes.CDLL(str(_build(amd)))
    plan, wsb = topk_abi.host_functions(lib)
    keys = 0 if amd else topk_abi.CACHE_KEYS
    for rows, L, k, sms in ((64, 65536, 2048, 132), (4, 163840, 2048, 132), (16, 65536, 512, 78),
                            (200, 65536, 2048, 132), (4, 300000, 2048, 132), (8, 32768, 2048, 132),
                            (8, 32769, 2048, 132), (3, 1000, 10, 132)):
        c = plan(rows, L, k, sms)
        assert c == topk_abi.plan_chunks(rows, L, k, sms, cache_keys=keys), (rows, L, k)
        assert wsb(rows, L, k, c) == topk_abi.workspace_bytes(rows, L, k, c)
        if not amd and L <= 8 * 32768:   # at least the fewest blocks (a power of two) whose caches hold the row,
            fewest = min(b for b in (1, 2, 4, 8) if b * 32768 >= L)   # more only within half of the SMs
            assert -c in (1, 2, 4, 8, 16) and -c >= fewest, (rows, L, k, c)
            assert -c == fewest or (rows * -c <= sms // 2 and L >= -c * 8192), (rows, L, k, c)

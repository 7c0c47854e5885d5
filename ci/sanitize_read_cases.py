"""Read-side cases for compute-sanitizer (memcheck, racecheck, initcheck): the decode scorer on every layout with
normal and hostile block tables, top-k over hostile spans, prefill logits, the fused top-k and the cache gather
over hostile ranges. Small shapes: the tools slow kernels down by orders of magnitude.

    compute-sanitizer --tool memcheck python ci/sanitize_read_cases.py [BACKEND]

Exit status 0 when every call returned; the sanitizer's own report says whether an access was bad.
"""
import sys

import torch

from dsaquant import dispatch, errors, ops
from dsaquant.prefill import gather_index_cache, mqa_logits, mqa_topk
from dsaquant.testing import scorer_hostile_tables
from dsaquant.topk import topk_indices
from dsaquant.triton.scorer import make_scorer_inputs

backend = sys.argv[1] if len(sys.argv) > 1 else "cuda"


def on(op):
    """The backend asked for when it implements `op`, else the automatic choice (what a user gets)."""
    return backend if op in dispatch.ops_of(backend) else None

dev = "cuda" if torch.cuda.is_available() else "cpu"   # cpu: a dry run of the cases with the reference
LAYOUTS = ("fp8_132", "packed68", "aiter_fp4")


def scorer_cases():
    for layout in LAYOUTS:
        # pages of 96 and 100 slots: tiles of 64 keys that span two pages (aiter_fp4 pages are multiples of 16)
        odd = 96 if layout == "aiter_fp4" else 100
        for (B, N, H, ctx, P) in ((2, 1, 64, 300, 64), (1, 4, 32, 700, 32), (3, 2, 16, 130, 128), (2, 1, 64, 390, odd),
                                  (1, 2, 32, 290, 96)):
            a = make_scorer_inputs(layout, B, N, H, ctx, page_size=P, device=dev)
            ops.paged_mqa_logits(layout=layout, backend=on("paged_mqa_logits"), **a)
        # a grid that fills the blocks resident at once (two sequences of 512 tiles, more than the splits that fit):
        # launched as a programmatic dependent of the kernel before it (kernels/cuda/scorer.cu)
        a = make_scorer_inputs(layout, 2, 1, 64, 32768, device=dev, seed=7)
        ops.paged_mqa_logits(layout=layout, backend=on("paged_mqa_logits"), **a)
        # hostile: page ids outside [0, NB), lengths past max_seq_len, past the table, negative
        a = scorer_hostile_tables(make_scorer_inputs(layout, 5, 2, 32, 640, device=dev, seed=5))
        for clean in (True, False):
            ops.paged_mqa_logits(layout=layout, backend=on("paged_mqa_logits"), clean_logits=clean, **a)


def topk_cases():
    g = torch.Generator(device=dev).manual_seed(1)
    logits = torch.randn(6, 3000, device=dev, generator=g)
    logits[1, :] = 0.5                       # a row of ties
    logits[2, 100:200] = float("nan")
    logits[3, :] = float("-inf")
    ks = torch.tensor([0, 5, 2900, -40, 100, 2000], dtype=torch.int32, device=dev)
    ke = torch.tensor([3000, 2999, 5000, 50, 90, 2000], dtype=torch.int32, device=dev)   # ke > L, ks > ke, empty
    for k in (1, 64, 2048, 4000):            # k larger than every row
        topk_indices(logits, k, ks=ks, ke=ke, backend=on("topk_indices"))
        topk_indices(logits, k, ks=ks, ke=ke, relative=True, backend=on("topk_indices"))
        ctx = torch.tensor([3000, -5, 9999], dtype=torch.int32, device=dev)
        topk_indices(logits, k, context_lens=ctx, next_n=2, backend=on("topk_indices"))
    topk_indices(torch.empty(0, 3000, device=dev), 16, ks=ks[:0], ke=ke[:0], backend=on("topk_indices"))
    # rows of 70000 and 140000: on NVIDIA sm_90 the cached-row path in clusters of 8 and 16 blocks (the plan's
    # spread; spans across the blocks' parts)
    for L, n in ((70000, 3), (140000, 2)):
        long = torch.randn(n, L, device=dev, generator=g)
        long[1, 30000:40000] = 0.25
        lks = torch.tensor([0, 100, L - 1000][:n], dtype=torch.int32, device=dev)
        lke = torch.tensor([L, 50000, L + 10000][:n], dtype=torch.int32, device=dev)
        for k in (64, 2048):
            topk_indices(long, k, ks=lks, ke=lke, backend=on("topk_indices"))


def prefill_cases():
    g = torch.Generator(device=dev).manual_seed(2)
    S, H, SKV = 37, 32, 500
    ks = torch.tensor([(i * 13) % 600 - 50 for i in range(S)], dtype=torch.int32, device=dev)
    ke = ks + torch.tensor([(i * 29) % 700 - 100 for i in range(S)], dtype=torch.int32, device=dev)
    w = torch.randn(S, H, device=dev, generator=g)
    q8 = torch.randint(0, 0x70, (S, H, 128), device=dev, generator=g, dtype=torch.uint8)
    k8 = torch.randint(0, 0x70, (SKV, 128), device=dev, generator=g, dtype=torch.uint8)
    k8s = torch.rand(SKV, device=dev, generator=g)
    q4 = torch.randint(0, 256, (S, H, 64), device=dev, generator=g, dtype=torch.uint8)
    q4s = torch.randint(120, 130, (S, H, 4), device=dev, generator=g, dtype=torch.uint8)
    k4 = torch.randint(0, 256, (SKV, 64), device=dev, generator=g, dtype=torch.uint8)
    k4s = torch.randint(120, 130, (SKV, 4), device=dev, generator=g, dtype=torch.uint8)
    for layout, q, qs, k, kss in (("fp8", q8, None, k8, k8s), ("fp4", q4, q4s, k4, k4s)):
        for exact in ((False, True) if layout == "fp4" else (False,)):
            for max_k in (0, 64):
                mqa_logits(q, k, w, ks, ke, layout=layout, q_scale=qs, k_scale=kss, max_seqlen_k=max_k,
                           exact=exact, backend=on("mqa_logits"))
            mqa_topk(q, k, w, ks, ke, 100, layout=layout, q_scale=qs, k_scale=kss, exact=exact, backend=on("mqa_topk"))
        mqa_logits(q[:0], k, w[:0], ks[:0], ke[:0], layout=layout, q_scale=None if qs is None else qs[:0],
                   k_scale=kss, backend=on("mqa_logits"))


def gather_cases():
    for layout in LAYOUTS:
        a = make_scorer_inputs(layout, 3, 1, 16, 200, device=dev, seed=3)
        bt = a["block_tables"].clone()
        bt[1, 0] = -1
        bt[2, 1] = 10 ** 6
        cu = torch.tensor([0, 200, 260, 600], dtype=torch.int32, device=dev)   # the last sequence runs past its table
        kw = dict(kv_cache_scale=a.get("kv_cache_scale"), page_size=64) if layout == "aiter_fp4" else {}
        gather_index_cache(a["kv_cache"], bt, cu, layout=layout, backend=on("gather_index_cache"), **kw)


def main():
    for part in (scorer_cases, topk_cases, prefill_cases, gather_cases):
        part()
        if dev == "cuda":
            torch.cuda.synchronize()
        try:
            errors.check_errors()
        except errors.DsaquantError as e:   # the hostile cases raise flags on purpose
            print(f"{part.__name__}: flags as expected: {e}")
        print(f"{part.__name__}: done", flush=True)


if __name__ == "__main__":
    main()

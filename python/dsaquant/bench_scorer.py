"""Decode scorer rows of `python -m dsaquant bench`: paged_mqa_logits per layout, shape and backend.

Each row is the median of CUDA-event timings of CUDA-graph replays (20 calls per replay, cycling over
enough input sets that the caches do not stay in L2). "Bytes that must move" are the cache rows inside
the contexts (132 bytes a position for fp8_132, 68 for the FP4 layouts), q and its scales, the weights
and the logits written (fp32, every position of [B*N, max_context]). Ceilings measured in the same run:
the device copy (read + write), an HBM read (a read-only reduction) and the dense FP8 tensor-core rate.
Shapes: the decode shapes servers run (H = 64 unless given), contexts either full or drawn uniformly
from [0.7, 1.0] of the nominal length (the way DeepGEMM's tests build them).
"""
from __future__ import annotations

import torch

from . import bench, ops
from .triton.scorer import make_scorer_inputs

# (batch, next_n, context, heads, contexts "full" or "uniform")
SHAPES = (
    (64, 1, 8192, 64, "full"), (4, 4, 32768, 64, "full"), (1, 1, 65536, 64, "full"),
    (64, 1, 8192, 64, "uniform"), (64, 2, 8192, 64, "uniform"), (4, 1, 32768, 64, "uniform"),
    (4, 2, 32768, 64, "uniform"), (32, 1, 65536, 32, "uniform"), (128, 1, 32768, 64, "uniform"),
    (128, 1, 32768, 64, "full"),
)
LAYOUTS = ("fp8_132", "packed68", "aiter_fp4")
L2_BYTES = 60 << 20
PAGE = 64   # slots per cache page


def inputs(layout, B, N, H, ctx, contexts, seed):
    a = make_scorer_inputs(layout, B, N, H, ctx, page_size=PAGE, device="cuda", seed=seed)
    if contexts == "uniform":
        g = torch.Generator(device="cuda").manual_seed(seed)
        lens = (torch.rand(B, generator=g, device="cuda") * 0.3 + 0.7) * ctx
        a["context_lens"] = lens.to(torch.int32).clamp(min=1)
    return a


def must_move(a, layout) -> int:
    row = 132 if layout == "fp8_132" else 68
    B, N = a["q"].shape[:2]
    keys = int(a["context_lens"].sum())
    qs = a["q_scale"].numel() if "q_scale" in a else 0
    return keys * row + a["q"].numel() + qs + a["weights"].numel() * 4 + B * N * a["max_seq_len"] * 4


def input_sets(layout, B, N, H, ctx, contexts) -> list[dict]:
    """The input sets a timing cycles over: enough that together they move at least twice the L2 (at most 4)."""
    first = inputs(layout, B, N, H, ctx, contexts, 0)
    n_sets = min(4, max(1, -(-2 * L2_BYTES // must_move(first, layout))))
    return [first] + [inputs(layout, B, N, H, ctx, contexts, s) for s in range(1, n_sets)]


def run(backends, copy_gb_s: float, fp8_tflops: float | None, shapes=SHAPES, log=print,
        read_gb_s: float | None = None, layouts=LAYOUTS) -> list[dict]:
    """One row per (shape, layout, backend); `auto` in each row is the backend the automatic choice picks
    for the shape. `read_gb_s`: the HBM read ceiling already measured in this run (None: measured here)."""
    if read_gb_s is None:
        read_gb_s = bench.hbm_read_bandwidth()
        log(f"HBM read (read-only reduction): {read_gb_s:.0f} GB/s")
    rows = []
    for (B, N, ctx, H, contexts) in shapes:
        for layout in layouts:
            sets = input_sets(layout, B, N, H, ctx, contexts)
            moved = sum(must_move(a, layout) for a in sets) / len(sets)
            flops = sum(2 * N * H * 128 * int(a["context_lens"].sum()) for a in sets) / len(sets)
            auto = bench.auto_of("paged_mqa_logits", B * N)
            for b in backends:
                if b == "reference":
                    continue
                outs = [torch.empty((B * N, ctx), dtype=torch.float32, device="cuda") for _ in sets]
                for o in outs:
                    o.fill_(float("nan"))   # poisoned: every entry is written by the call
                idx = {id(a): i for i, a in enumerate(sets)}

                def call(a, b=b):
                    ops.paged_mqa_logits(layout=layout, backend=b, out=outs[idx[id(a)]], **a)

                try:
                    sec = bench.time_graph(call, sets, 20)
                except Exception as e:   # report, keep benchmarking the rest
                    log(f"  scorer {layout} {B}x{N}x{ctx} {b}: failed: {type(e).__name__}: {e}")
                    continue
                if bool(torch.isnan(outs[0]).all()):
                    log(f"  scorer {layout} {B}x{N}x{ctx} {b}: output not written")
                us = sec * 1e6
                tflops = flops / sec / 1e12
                rows.append(dict(op=f"paged_mqa_logits {layout}", batch=B, next_n=N, context=ctx, heads=H,
                                 contexts=contexts, backend=b, us=us, bytes=moved, gb_s=moved / sec / 1e9,
                                 pct_copy=100 * moved / sec / 1e9 / copy_gb_s, pct_read=100 * moved / sec / 1e9 / read_gb_s,
                                 us_at_copy=moved / copy_gb_s / 1e3, tflops=tflops,
                                 pct_fp8=100 * tflops / fp8_tflops if fp8_tflops else None, auto=auto))
                log(f"  scorer {layout} B={B} N={N} ctx={ctx} H={H} {contexts} {b}: {us:.1f} us "
                          f"({rows[-1]['pct_copy']:.1f} % of copy)")
            del sets
    return rows


def format_rows(rows) -> list[str]:
    out = ["| scorer | batch | next_n | context | H | contexts | backend | median µs | µs at copy speed | GB/s | "
           "% copy | % HBM read | TFLOP/s | % FP8 ceiling |",
           "|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        fp8 = f"{r['pct_fp8']:.1f}" if r.get("pct_fp8") is not None else "-"
        out.append(f"| {r['op']} | {r['batch']} | {r['next_n']} | {r['context']} | {r['heads']} | {r['contexts']} | "
                   f"{r['backend']} | {r['us']:.1f} | {r['us_at_copy']:.1f} | {r['gb_s']:.0f} | {r['pct_copy']:.1f} | "
                   f"{r['pct_read']:.1f} | {r['tflops']:.0f} | {fp8} |")
    return out

"""Timing of `topk_indices` (docs/topk.md) for `python -m dsaquant bench`: CUDA-graph replays of the op on
the targets' shapes, per GPU backend, in bench.py's row format (median device time per call, bytes =
the logits read once plus the indices written once).

Shapes: DeepSeek-V3.2 decode, top-2048 over [64, 65536] (target 25 us on an H200) and over [4, 163840]
(target 20 us); DeepSeek-V4, top-512 over [64, 65536]; 4 query tokens (next_n) over [4 x 4, 65536].
"""
from __future__ import annotations

import torch

from . import dispatch
from .bench import auto_of, time_graph
from .topk import topk_indices

SHAPES = (  # (label, rows, L, k, next_n)
    ("topk_indices k2048 L65536", 64, 65536, 2048, 1),
    ("topk_indices k2048 L163840", 4, 163840, 2048, 1),
    ("topk_indices k512 L65536", 64, 65536, 512, 1),
    ("topk_indices k2048 L65536 next_n4", 16, 65536, 2048, 4),
)


def _inputs(rows, L, k, next_n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(rows, L, device="cuda", generator=g)
    ctx = torch.full((rows // next_n,), L, dtype=torch.int32, device="cuda")
    out = torch.empty((rows, k), dtype=torch.int32, device="cuda")
    return dict(logits=logits, k=k, context_lens=ctx, next_n=next_n, out=out)


def topk_rows(backends, copy_gb_s: float, read_gb_s: float | None = None, calls: int = 20, log=print) -> list[dict]:
    """bench.py rows (op, tokens = rows, backend, us, gb_s, pct_copy, pct_read (None without `read_gb_s`),
    bytes, timing, auto) for every shape and every GPU backend in `backends` that implements topk_indices;
    a failing backend is logged and skipped."""
    rows_out = []
    for label, rows, L, k, next_n in SHAPES:
        sets = [_inputs(rows, L, k, next_n, s) for s in range(4)]
        moved = rows * L * 4 + rows * k * 4
        auto = auto_of("topk_indices", rows)
        for b in backends:
            if b == "reference" or "topk_indices" not in dispatch.ops_of(b):
                continue
            try:
                sec = time_graph(lambda a, b=b: topk_indices(a["logits"], a["k"], context_lens=a["context_lens"],
                                                             next_n=a["next_n"], out=a["out"], backend=b),
                                 sets, calls)
            except Exception as e:  # report, keep benchmarking the rest
                log(f"  {label} {b}: failed: {type(e).__name__}: {e}")
                continue
            gbs = moved / sec / 1e9
            rows_out.append(dict(op=label, tokens=rows, heads=None, backend=b, us=sec * 1e6, gb_s=gbs,
                                 pct_copy=100 * gbs / copy_gb_s,
                                 pct_read=100 * gbs / read_gb_s if read_gb_s else None, bytes=moved,
                                 timing=f"graph x{calls}", auto=auto))
    return rows_out

"""Prefill benchmark (docs/prefill.md): mqa_logits FP8 / FP4 / exact FP4 at S = 2048, SKV = 8192, H = 64 (full and
causal ranges) in TFLOP/s, and mqa_topk at S = 8192, SKV = 65536 (time and peak memory, and its time over that of
mqa_logits alone at the same shape, full [S, SKV] fp32 output).

`bench_prefill()` returns rows (dicts) and `format_rows(rows)` a Markdown table; bench.py's `run` can add the
rows with one line (`rows += bench_prefill(log)`). Logits timings are medians of CUDA-graph replays
(bench.time_graph: device time only); mqa_topk is timed call by call with CUDA events (its host loop over
chunks is part of its cost), and so are the logits it is compared with. TFLOP/s counts 2 * 128 * H multiply-adds per (row, valid key) pair.
"""
from __future__ import annotations

import torch

from . import prefill


def make_prefill_inputs(layout: str, S: int, SKV: int, H: int, *, causal: bool = False, device="cuda", seed: int = 0):
    """Random mqa_logits keyword arguments: FP8 codes without NaN (|v| <= 120), k scales in [0.01, 0.03); FP4 random
    bytes with exponents 122..129 (a row's blocks within 8 binades, as in real keys and queries: the FP4 fast mode
    folds them into e4m3, docs/prefill.md); fp32 weights; full ranges [0, SKV), or causal ones (row i of the last S tokens
    of an SKV-token sequence sees keys [0, SKV - S + i + 1))."""
    g = torch.Generator().manual_seed(seed)

    def fp8_codes(*shape):
        mag = torch.randint(1, 0x70, shape, generator=g, dtype=torch.uint8)
        return mag | (torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7)

    if layout == "fp8":
        a = dict(q=fp8_codes(S, H, 128).view(torch.float8_e4m3fn), k=fp8_codes(SKV, 128).view(torch.float8_e4m3fn),
                 k_scale=torch.rand(SKV, generator=g) * 0.02 + 0.01)
    else:
        a = dict(q=torch.randint(0, 256, (S, H, 64), generator=g, dtype=torch.uint8),
                 q_scale=torch.randint(122, 130, (S, H, 4), generator=g, dtype=torch.uint8),
                 k=torch.randint(0, 256, (SKV, 64), generator=g, dtype=torch.uint8),
                 k_scale=torch.randint(122, 130, (SKV, 4), generator=g, dtype=torch.uint8))
    a["weights"] = torch.randn(S, H, generator=g)
    a["ks"] = torch.zeros(S, dtype=torch.int32)
    if causal:
        a["ke"] = torch.arange(S, dtype=torch.int32) + (SKV - S + 1)
    else:
        a["ke"] = torch.full((S,), SKV, dtype=torch.int32)
    return {k: v.to(device) for k, v in a.items()}


def _pairs(a) -> int:
    return int((a["ke"].clamp(max=a["k"].shape[0]) - a["ks"].clamp(min=0)).clamp(min=0).sum())


def bench_prefill(log=print, backends=None, S: int = 2048, SKV: int = 8192, H: int = 64,
                  topk_shape=(8192, 65536, 2048)):
    """Rows: dict(op, S, SKV, H, backend, us, tflops[, peak_gb, x_logits]) for each case and backend (default: every
    available GPU backend implementing the op); a failing case is logged and skipped. x_logits: mqa_topk's time over
    mqa_logits' at its shape (None when the logits alone could not be timed)."""
    from . import dispatch
    rows = []
    for backend in backends or [b for b in ("triton", "cuda", "hip") if dispatch.available(b)[0]]:
        if "mqa_logits" in dispatch.ops_of(backend):
            rows += _bench_backend(log, backend, S, SKV, H, topk_shape, "mqa_topk" in dispatch.ops_of(backend))
    return rows


def _bench_backend(log, backend, S, SKV, H, topk_shape, topk):
    from .bench import _median_event_seconds, time_graph
    rows = []
    cases = (("mqa_logits fp8", "fp8", False, False), ("mqa_logits fp4", "fp4", False, False),
             ("mqa_logits fp4 exact", "fp4", True, False), ("mqa_logits fp8 causal", "fp8", False, True),
             ("mqa_logits fp4 causal", "fp4", False, True))
    for label, layout, exact, causal in cases:
        try:
            sets = [make_prefill_inputs(layout, S, SKV, H, causal=causal, seed=s) for s in range(2)]
            def call(a, layout=layout, exact=exact):
                return prefill.mqa_logits(layout=layout, exact=exact, backend=backend, **a)
            sec = time_graph(call, sets, calls=4, reps=10)
            flops = 2 * 128 * H * _pairs(sets[0])
            rows.append(dict(op=label, S=S, SKV=SKV, H=H, backend=backend, us=sec * 1e6, tflops=flops / sec / 1e12))
            log(f"{label} ({backend}): {sec * 1e6:.1f} us, {flops / sec / 1e12:.1f} TFLOP/s")
        except Exception as e:  # report, keep benchmarking the rest
            log(f"{label} ({backend}): failed: {type(e).__name__}: {e}")
    TS, TSKV, K = topk_shape
    for layout in ("fp8", "fp4") if topk else ():
        label = f"mqa_topk {layout} k={K}"
        try:
            a = make_prefill_inputs(layout, TS, TSKV, H, seed=7)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            prefill.mqa_topk(topk=K, layout=layout, backend=backend, **a)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            sec = _median_event_seconds(lambda i: prefill.mqa_topk(topk=K, layout=layout, backend=backend, **a), 3,
                                        warmup=1)
            flops = 2 * 128 * H * _pairs(a)
            ratio = None
            try:   # the logits alone at the same shape, into one [S, SKV] fp32 output
                out = torch.empty((TS, TSKV), dtype=torch.float32, device="cuda")
                alone = _median_event_seconds(
                    lambda i: prefill.mqa_logits(layout=layout, backend=backend, out=out, **a), 3, warmup=1)
                ratio = sec / alone
                del out
            except Exception as e:
                log(f"{label}: the logits alone at this shape failed: {type(e).__name__}: {e}")
            rows.append(dict(op=label, S=TS, SKV=TSKV, H=H, backend=backend, us=sec * 1e6, tflops=flops / sec / 1e12,
                             peak_gb=peak / 1e9, x_logits=ratio))
            log(f"{label}: {sec * 1e3:.2f} ms, {flops / sec / 1e12:.1f} TFLOP/s, peak {peak / 1e9:.2f} GB above the "
                f"inputs (the [S, SKV] fp32 logits alone: {TS * TSKV * 4 / 1e9:.2f} GB)"
                + (f", {ratio:.2f} x the logits alone" if ratio else ""))
        except Exception as e:
            log(f"{label}: failed: {type(e).__name__}: {e}")
    return rows


def format_rows(rows) -> str:
    out = ["| prefill op | S | SKV | H | backend | median µs | TFLOP/s | peak GB | x logits alone |",
           "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        peak = f"{r['peak_gb']:.2f}" if "peak_gb" in r else "-"
        ratio = f"{r['x_logits']:.2f}" if r.get("x_logits") else "-"
        out.append(f"| {r['op']} | {r['S']} | {r['SKV']} | {r['H']} | {r['backend']} | {r['us']:.1f} | "
                   f"{r['tflops']:.1f} | {peak} | {ratio} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(format_rows(bench_prefill()))

"""`python -m dsaquant bench`: each op on each GPU backend against the device's copy bandwidth.

Timings are medians of CUDA-event measurements around CUDA-graph replays: a graph holds 100 calls
(T <= 64) or 20 calls (larger T, cycling over 4 input sets so the L2 cache does not hold them), and the
time per call is reported (device time, no host overhead). The `reference` backend cannot be captured
(it syncs), so its calls are timed one by one with events (host time between them included). The bytes moved are the fewest the op
must move (each input read once, each output written once); GB/s = bytes / time, compared with two
ceilings measured once in the same run: "% copy", a device-to-device copy (its rate counts bytes read plus
bytes written), and "% HBM read", a read-only reduction (hbm_read_bandwidth). An op that
reads more than it writes can pass 100 % of copy; it cannot pass the read ceiling by much. The `reference`
backend on the GPU is the unfused torch (eager) pipeline.

The automatic-choice check: each row carries `auto`, the backend dispatch.choose picks for its op, size and
variant with no backend forced; `auto_check` compares, per group of rows (same op and size), auto's time with
the fastest backend measured and flags auto when it is more than 10 % slower.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from . import compress, dispatch, ops, preference, testing as tt

OUT_KEYS = {
    "indexer_qk_rope_quant_and_cache": ("q_out", "weights_out", "kv_cache", "q_scale_out", "kv_cache_scale"),
    "index_k_norm_rope_pack_store": ("cache",),
    "rmsnorm_rope_rotate_fp4quant_kvcache": ("kv_cache", "kv_cache_scale"),
}


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy, GB/s counting bytes read plus bytes written (median)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_event_seconds(lambda i: dst.copy_(src), reps) / 1e9


def hbm_read_bandwidth(nbytes: int = 2 << 30, reps: int = 20) -> float:
    """A read-only pass over nbytes (an fp32 max over random values), GB/s of bytes read (median)."""
    src = torch.rand(nbytes // 4, device="cuda")
    return nbytes / _median_event_seconds(lambda i: src.amax(), reps) / 1e9


def _median_event_seconds(fn, reps: int, warmup: int = 3) -> float:
    """Median seconds of fn(i) between two CUDA events, over reps calls after `warmup` untimed ones."""
    times = []
    for i in range(reps + warmup):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(i)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    return statistics.median(times[warmup:])


def tensor_core_ceilings(n: int = 8192, reps: int = 10) -> dict:
    """Dense n x n x n matrix products on random data (never zeros), TFLOP/s = 2 n^3 / median seconds:
    'bf16' (torch.matmul) and 'fp8' (torch._scaled_mm, e4m3fn x e4m3fn -> bf16, unit scales), the ceilings
    the scorer's bf16 and fp8 dots are compared with. A product this torch cannot run is left out."""
    out = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g)
    out["bf16"] = 2 * n ** 3 / _median_event_seconds(lambda i: a @ b, reps) / 1e12
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        mm = lambda i=0: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
        mm()
        out["fp8"] = 2 * n ** 3 / _median_event_seconds(mm, reps) / 1e12
    except Exception:   # no fp8 matrix product in this torch / on this device
        pass
    return out


def time_calls(fn, arg_sets, reps: int = 30) -> float:
    """Median seconds of one call, rotating over `arg_sets`."""
    for a in arg_sets:
        fn(a)
    torch.cuda.synchronize()
    return _median_event_seconds(lambda i: fn(arg_sets[i % len(arg_sets)]), reps, warmup=0)


def time_graph(fn, arg_sets, calls: int = 100, reps: int = 20) -> float:
    """Median seconds per call when `calls` calls (cycling over `arg_sets`) are replayed from one CUDA
    graph: device time only, no host overhead between the events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for a in arg_sets:
            fn(a)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(arg_sets[i % len(arg_sets)])
    g.replay()
    torch.cuda.synchronize()
    return _median_event_seconds(lambda i: g.replay(), reps, warmup=0) / calls


GROUP_FIELDS = ("op", "tokens", "heads", "batch", "next_n", "context", "contexts")
AUTO_TOLERANCE = 0.10


def auto_check(rows, tolerance: float = AUTO_TOLERANCE) -> dict:
    """The automatic-choice check over bench rows (dicts with `backend`, `us`, `auto` and the GROUP_FIELDS
    they have): rows sharing every GROUP_FIELDS value form a group (one op at one size). Per group: auto
    (the backend dispatch.choose picked, None if none), the fastest backend measured and its µs, auto's µs
    (None if auto was not measured in the group), `slower` = auto µs / fastest µs - 1, and `flagged`: auto
    was measured and is more than `tolerance` slower. Returns {"tolerance", "groups": [...], "flagged":
    count, "passed": no group flagged}. Pure: no device, no timing."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = tuple((k, r[k]) for k in GROUP_FIELDS if k in r)
        groups.setdefault(key, []).append(r)
    out = []
    for key, rs in groups.items():
        best = min(rs, key=lambda r: r["us"])
        autos = {r.get("auto") for r in rs}
        auto = autos.pop() if len(autos) == 1 else None
        mine = [r["us"] for r in rs if auto is not None and r["backend"] == auto]
        auto_us = min(mine) if mine else None
        slower = auto_us / best["us"] - 1 if auto_us is not None and best["us"] > 0 else None
        out.append(dict(dict(key), auto=auto, fastest=best["backend"], fastest_us=best["us"], auto_us=auto_us,
                        slower=slower, flagged=auto_us is not None and auto_us > (1 + tolerance) * best["us"]))
    n = sum(g["flagged"] for g in out)
    return dict(tolerance=tolerance, groups=out, flagged=n, passed=n == 0)


def auto_of(op: str, tokens: int, variant: str | None = None) -> str | None:
    """The backend the op's wrapper picks with no backend forced (dispatch.choose_for) for a call of `tokens`
    tokens and `variant` on the current GPU; None if none."""
    try:
        return dispatch.choose_for(op, torch.device("cuda", torch.cuda.current_device()), None, tokens, variant)
    except dispatch.BackendUnavailable:
        return None


def cases(T: int, H: int):
    """(label, op name, public fn, make(seed) -> kwargs, bytes(kwargs) -> int, variant: preference.variant of the
    call)."""
    idx = "indexer_qk_rope_quant_and_cache"

    def idx_bytes(a):
        T_, H_ = a["q"].shape[:2]
        out = _nbytes(a["q_out"]) + _nbytes(a["weights_out"]) + _nbytes(a.get("q_scale_out"))
        row = 132 if a.get("q_scale_out") is None else 68
        return _nbytes(a["q"]) + _nbytes(a["k"]) + _nbytes(a["weights"]) + 16 * T_ + out + row * T_

    for mode in ("fp8", "fp4"):
        yield (f"indexer {mode.upper()}", idx, ops.indexer_qk_rope_quant_and_cache,
               lambda s, mode=mode: tt.make_indexer(T=T, H=H, mode=mode, device="cuda", seed=s, extra_pages=0),
               idx_bytes, preference.variant(idx, out_format=mode))
    yield ("k pack store (v41)", "index_k_norm_rope_pack_store", ops.index_k_norm_rope_pack_store,
           lambda s: tt.make_k_store(T=T, device="cuda", seed=s), lambda a: _nbytes(a["k"]) + 16 * T + 68 * T, None)
    yield ("q pack weights (v41)", "index_q_rope_pack_weights", ops.index_q_rope_pack_weights,
           lambda s: tt.make_q_pack(T=T, H=H, device="cuda", seed=s),
           lambda a: _nbytes(a["q"]) + _nbytes(a["head_weights"]) + 8 * T + (64 + 4 + 4) * T * H, None)
    yield ("V4 k writer (aiter)", "rmsnorm_rope_rotate_fp4quant_kvcache", ops.rmsnorm_rope_rotate_fp4quant_kvcache,
           lambda s: tt.make_v4_k(T=T, device="cuda", seed=s), lambda a: _nbytes(a["kv"]) + 16 * T + 68 * T, None)


def compress_bytes(a, starts, lens) -> int:
    """The fewest bytes compress_kv (SPEC §7.6) must move for the arguments `a` of sequences (starts, lens):
    kv and score read once; each boundary's window rows that precede its call come from the fp32 ring (the
    half of the columns each row contributes, both ring tensors); the cache rows written (non-negative
    slots); the ring rows written (the last K tokens of each sequence, full width, both tensors); out_slots,
    positions and ring slots of the tokens; the cos/sin rows of the boundaries. ape and the norm weight are
    a few KB (not counted)."""
    kv = a["kv"]
    T, C = kv.shape
    ratio = a["ratio"]
    K = ratio * (2 if a["overlap"] else 1)
    D = C // (2 if a["overlap"] else 1)
    bnd = tt.compress_boundaries(starts, lens, ratio)
    ring_rows = sum(sum(1 for s in range(p - K + 1, p + 1) if 0 <= s < starts[b]) for _, b, p in bnd)
    mode = a["quant_mode"]
    row = {"none": 2 * D, "fp4_sim": 2 * D, "fp4": 68, "fp8": 132}[mode]
    slots = a["out_slots"].cpu()
    stored = sum(1 for i, _, _ in bnd if int(slots[i]) >= 0)
    written = sum(min(n, K) for n in lens)
    cs = 2 * 32 * a["cos_cache"].element_size() if a.get("cos_cache") is not None else 64 * 4
    return (2 * _nbytes(kv) + ring_rows * D * 4 * 2 + stored * row + written * C * 4 * 2 + 8 * T
            + 12 * len(lens) + len(bnd) * cs)


def v4_cases(tokens=(8192,)):
    """(label, tokens, op name, public fn, make(seed) -> kwargs, bytes(kwargs) -> int, variant) of the
    DeepSeek-V4 rows (variant: preference.variant of the call), FP4 packed68 with bf16 inputs: compress_kv decode
    (64 sequences of one token, ratio 4, about a quarter of them at a boundary) and, for each T of `tokens`,
    compress_kv prefill (one T-token prompt, ratio 4 and ratio 128) and rope_rotate_quant (H = 64, D = 128, into
    FP4 with the shuffled (aiter) scales)."""
    dec_starts, dec_lens = tuple(1000 + 4 * b + (b % 4) for b in range(64)), (1,) * 64
    compress_rows = [("compress_kv decode B=64 r4 fp4", dec_starts, dec_lens, 4)]
    for T in tokens:
        compress_rows += [("compress_kv prefill r4 fp4", (0,), (T,), 4), ("compress_kv prefill r128 fp4", (0,), (T,), 128)]
    for label, starts, lens, ratio in compress_rows:
        def make(s, starts=starts, lens=lens, ratio=ratio):
            return tt.make_compress_kv(starts=starts, lens=lens, ratio=ratio, device="cuda", seed=s,
                                       quant_mode="fp4", negatives=False, dtype=torch.bfloat16,
                                       max_pos=max(4096, max(st + n for st, n in zip(starts, lens))))
        yield (label, sum(lens), "compress_kv", compress.compress_kv, make,
               lambda a, starts=starts, lens=lens: compress_bytes(a, starts, lens),
               preference.variant("compress_kv", ratio=ratio, decode=sum(lens) == len(lens)))
    H = 64
    for T in tokens:
        def rr_bytes(a, T=T):
            return (_nbytes(a["x"]) + _nbytes(a["out"]) + _nbytes(a["out_scale"]) + _nbytes(a["positions"])
                    + T * 2 * 32 * a["cos_cache"].element_size())
        yield ("rope_rotate_quant fp4 H=64", T, "rope_rotate_quant", compress.rope_rotate_quant,
               lambda s, T=T: tt.make_rope_rotate_quant(T=T, H=H, device="cuda", seed=s), rr_bytes,
               preference.variant("rope_rotate_quant", out_format="fp4"))


def run(tokens=(1, 64, 1024, 8192, 32768), heads=64, backends=None, graph_calls=100, log=print, v4=True,
        scorer=True, prefill=True):
    bw, read_bw = copy_bandwidth(), hbm_read_bandwidth()
    log(f"device: {torch.cuda.get_device_name()}   copy bandwidth (read+write): {bw:.0f} GB/s   "
        f"HBM read (read-only reduction): {read_bw:.0f} GB/s")
    backends = backends or [b for b in ("cuda", "triton", "reference") if dispatch.available(b)[0]]
    rows = []

    def bench_case(label, T, op, fn, make, nbytes, row_heads, variant=None):
        sets = [make(s) for s in range(4 if T >= 1024 else 1)]
        moved = nbytes(sets[0])
        auto = auto_of(op, T, variant)
        for b in backends:
            if op not in dispatch.ops_of(b):
                continue
            call = (lambda a, b=b, fn=fn: fn(**a, backend=b))
            try:
                if b != "reference":
                    n = graph_calls if T <= 64 else 20
                    sec, how = time_graph(call, sets, n), f"graph x{n}"
                else:
                    sec, how = time_calls(call, sets), "events"
            except Exception as e:  # report, keep benchmarking the rest
                log(f"  {label} T={T} {b}: failed: {type(e).__name__}: {e}")
                continue
            gbs = moved / sec / 1e9
            rows.append(dict(op=label, tokens=T, heads=row_heads, backend=b, us=sec * 1e6, gb_s=gbs,
                             pct_copy=100 * gbs / bw, pct_read=100 * gbs / read_bw, bytes=moved, timing=how,
                             auto=auto))

    for T in tokens:
        for label, op, fn, make, nbytes, variant in cases(T, heads):
            bench_case(label, T, op, fn, make, nbytes, heads, variant)
    for label, T, op, fn, make, nbytes, variant in (v4_cases(tokens) if v4 else ()):
        bench_case(label, T, op, fn, make, nbytes, heads if op == "rope_rotate_quant" else None, variant)
    from .bench_topk import topk_rows
    rows += topk_rows(backends, bw, read_bw, log=log)
    scorer_rows, tc = [], {}
    if scorer or prefill:   # the ceilings the scorer's and the prefill logits' rows compare with
        tc = tensor_core_ceilings()
        log("tensor-core ceilings (dense 8192^3 products): " + ", ".join(f"{k} {v:.0f} TFLOP/s" for k, v in tc.items()))
    if scorer:
        from . import bench_scorer
        scorer_rows = bench_scorer.run([b for b in backends if b != "reference"], bw, tc.get("fp8"), log=log,
                                       read_gb_s=read_bw)
    prefill_rows = []
    if prefill and "triton" in backends:
        from .bench_prefill import bench_prefill
        prefill_rows = bench_prefill(log)
    return dict(copy_gb_s=bw, hbm_read_gb_s=read_bw, device=torch.cuda.get_device_name(), rows=rows,
                scorer=scorer_rows, tensor_core_tflops=tc, prefill=prefill_rows,
                auto_check=auto_check(rows + scorer_rows))


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def format_auto_check(check) -> list[str]:
    """Markdown rows of auto_check's groups, then its summary line (the last line)."""
    out = ["| op | size | auto | auto µs | fastest | fastest µs | auto slower by % | flag |",
           "|---|---|---|---:|---|---:|---:|---|"]
    for g in check["groups"]:
        size = ", ".join(f"{k} {g[k]}" for k in GROUP_FIELDS[1:] if g.get(k) is not None)
        auto_us = "-" if g["auto_us"] is None else f"{g['auto_us']:.2f}"
        slower = "-" if g["slower"] is None else f"{100 * g['slower']:.1f}"
        flag = "SLOWER" if g["flagged"] else ("not measured" if g["auto_us"] is None else "ok")
        out.append(f"| {g['op']} | {size} | {g['auto']} | {auto_us} | {g['fastest']} | {g['fastest_us']:.2f} | "
                   f"{slower} | {flag} |")
    tol = 100 * check["tolerance"]
    out.append(f"automatic choice check: {'passed' if check['passed'] else 'FAILED'} "
               f"({check['flagged']} of {len(check['groups'])} groups more than {tol:.0f} % slower than the "
               f"fastest backend measured)")
    return out


def format_table(res) -> str:
    read = res.get("hbm_read_gb_s")
    out = [f"copy bandwidth (read+write): {res['copy_gb_s']:.0f} GB/s, HBM read (read-only reduction): "
           f"{read:.0f} GB/s on {res['device']}" if read else
           f"copy bandwidth (read+write): {res['copy_gb_s']:.0f} GB/s on {res['device']}", "",
           "| op | tokens | backend | auto | median µs | GB/s | % copy | % HBM read | timing |",
           "|---|---:|---|---|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        out.append(f"| {r['op']} | {r['tokens']} | {r['backend']} | {r.get('auto') or '-'} | {r['us']:.2f} | "
                   f"{r['gb_s']:.0f} | {_pct(r['pct_copy'])} | {_pct(r.get('pct_read'))} | {r['timing']} |")
    if res["scorer"]:
        from . import bench_scorer
        tc = res.get("tensor_core_tflops") or {}
        out += ["", "tensor-core ceilings (dense 8192^3 products, same run): "
                + (", ".join(f"{k} {v:.0f} TFLOP/s" for k, v in tc.items()) or "not measured"), ""]
        out += bench_scorer.format_rows(res["scorer"])
    if res.get("prefill"):
        from .bench_prefill import format_rows
        out += ["", format_rows(res["prefill"])]
    if res.get("auto_check"):
        out += ["", *format_auto_check(res["auto_check"])]
    return "\n".join(out)


def add_arguments(p) -> None:
    """The bench's options, on an argparse parser (the CLI's `bench` subcommand uses them)."""
    p.add_argument("--tokens", default="1,64,1024,8192,32768", help="comma list of T (default 1,64,1024,8192,32768)")
    p.add_argument("--heads", type=int, default=64, help="H, the query heads (default 64)")
    p.add_argument("--backends", default=None, help="comma list (default: every available GPU backend)")
    p.add_argument("--json", default=None, help="write the results as JSON here")
    p.add_argument("--markdown", default=None, help="write the table as Markdown here")
    p.add_argument("--no-scorer", action="store_true", help="skip the decode scorer rows")
    p.add_argument("--no-prefill", action="store_true", help="skip the prefill rows (mqa_logits, mqa_topk)")
    p.add_argument("--no-writers", action="store_true", help="skip the writer rows (indexer, k writers, V4 ops)")
    p.add_argument("--no-v4", action="store_true",
                   help="skip the DeepSeek-V4 rows (compress_kv decode, compress_kv prefill and rope_rotate_quant at each T)")
    p.add_argument("--check", action="store_true",
                   help="exit with status 1 when the automatic choice is more than 10 %% slower than the fastest "
                        "backend measured for some op and size (the summary line is printed either way)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="dsaquant bench", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return show(p.parse_args(argv))


def show(a) -> int:
    """Run the bench with parsed options `a`, print the table (its last line: the automatic-choice check's
    summary), write --json / --markdown. Returns the exit status: 1 if --check and the check failed, else 0."""
    if not torch.cuda.is_available():
        print("bench needs a CUDA/ROCm GPU (none found); nothing to time")
        return 0
    tokens = () if a.no_writers else tuple(int(t) for t in a.tokens.split(","))
    res = run(tokens, a.heads, a.backends.split(",") if a.backends else None, v4=not (a.no_v4 or a.no_writers),
              scorer=not a.no_scorer, prefill=not a.no_prefill)
    table = format_table(res)
    print(table)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(table + "\n")
    return 1 if getattr(a, "check", False) and not res["auto_check"]["passed"] else 0

"""Where a block of the CUDA decode scorer spends its time: the clock of every block's phase boundaries
(kernels/cuda/scorer_body.cuh SC_PHASE), one Markdown row a case, medians over the blocks.

Needs the cuda library built with the phase records (a few stores a block, and a few registers spilled in some
kernels, so its times are a little longer than a release build's; never a release build):
    DSAQUANT_NVCC_EXTRA=-DDSQ_SCORER_PHASES DSAQUANT_CUDA_ARCHS=90a python3 tools/build_native.py cuda
    python dev/scorer_phases.py [LAYOUT:B:N:CONTEXT:CONTEXTS ...] [--json DIR]
Cases default to the small-batch decode shapes (H = 64; CONTEXTS "full" or "uniform", as dsaquant.bench_scorer
builds them). Each case runs eight calls in a row and reads the records of the last. Columns: µs from the block's
own start to the end of each phase, medians over the blocks; "a pair" is a pair of tiles from its copies' landing to
its logits stored, "wait" the time from one pair's end to the next pair's landing; "blocks end" is µs after the
first block's start (10th percentile, median, last). --json writes every block's raw records (32 words: clocks at
phases 0 .. 27, then the end's clock, global timer and 1 + SM index, then the start's global timer).
"""
import ctypes
import json
import statistics as st
import sys
from pathlib import Path

import torch

import dsaquant
from dsaquant import bench_scorer, ops

BLOCKS, WORDS = 4096, 32
PHASES = (("loads issued", 1), ("table barrier", 3), ("first copies issued", 4), ("q barrier", 6))
DEFAULT = ("fp8_132:4:4:32768:full", "fp8_132:4:2:32768:uniform", "fp8_132:4:1:32768:uniform",
           "fp8_132:64:1:8192:full", "packed68:4:4:32768:full", "aiter_fp4:4:4:32768:full")


def records(lib, run):
    """Runs run() eight times and returns the records of the blocks of the last call (lists of WORDS ints)."""
    buf = (ctypes.c_ulonglong * (BLOCKS * WORDS))()
    run()
    torch.cuda.synchronize()
    if lib.dsq_scorer_phases(buf, 0, 1) != 0:
        raise RuntimeError("dsq_scorer_phases: clearing the records failed")
    for _ in range(8):
        run()
    torch.cuda.synchronize()
    if lib.dsq_scorer_phases(buf, BLOCKS * WORDS, 0) != 0:
        raise RuntimeError("dsq_scorer_phases: reading the records failed")
    rows = [list(buf[i * WORDS:(i + 1) * WORDS]) for i in range(BLOCKS)]
    return [r for r in rows if r[30]]


def summary(rows):
    """The Markdown cells of one case from its blocks' records."""
    ghz = st.median((r[28] - r[0]) / max(1, r[29] - r[31]) for r in rows)
    us = lambda cycles: cycles / ghz / 1e3   # noqa: E731
    med = lambda xs: st.median(xs) if xs else float("nan")   # noqa: E731
    cells = [f"{med([us(r[k] - r[0]) for r in rows if r[k]]):.2f}" for _, k in PHASES]
    landed, pair, wait = [], [], []
    for r in rows:
        if not r[7]:
            continue
        landed.append(us(r[7] - r[0]))
        prev = None
        for p in range(10):
            if not r[7 + 2 * p]:
                break
            if prev is not None:
                wait.append(us(r[7 + 2 * p] - prev))
            pair.append(us(r[8 + 2 * p] - r[7 + 2 * p]))
            prev = r[8 + 2 * p]
    g0 = min(r[31] for r in rows)
    ends = sorted((r[29] - g0) / 1e3 for r in rows)
    per_sm = {}
    for r in rows:
        per_sm[r[30]] = per_sm.get(r[30], 0) + 1
    cells = [f"{len(rows)} ({max(per_sm.values())})", *cells, f"{med(landed):.2f}", f"{med(pair):.2f}",
             f"{med(wait):.2f}", f"{ends[len(ends) // 10]:.2f}, {ends[len(ends) // 2]:.2f}, {ends[-1]:.2f}"]
    return cells, ghz


def main(argv):
    out_dir = None
    if "--json" in argv:
        i = argv.index("--json")
        out_dir = Path(argv[i + 1])
        out_dir.mkdir(parents=True, exist_ok=True)
        argv = argv[:i] + argv[i + 2:]
    path = Path(dsaquant.__file__).parent / "libdsaquant_cuda.so"
    lib = ctypes.CDLL(str(path))
    if not hasattr(lib, "dsq_scorer_phases"):
        sys.exit(f"{path} has no phase records: build it with DSAQUANT_NVCC_EXTRA=-DDSQ_SCORER_PHASES (see above)")
    lib.dsq_scorer_phases.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_int, ctypes.c_int]
    print("| layout | batch, next_n, context | contexts | blocks (an SM) | " + " | ".join(n for n, _ in PHASES) +
          " | first pair landed | a pair | wait | blocks end | GHz |")
    print("|---|---|---|---:|" + "---:|" * (len(PHASES) + 3) + "---|---:|")
    for case in argv or DEFAULT:
        layout, B, N, ctx, contexts = case.split(":")
        B, N, ctx = int(B), int(N), int(ctx)
        a = bench_scorer.input_sets(layout, B, N, 64, ctx, contexts)[0]
        rows = records(lib, lambda: ops.paged_mqa_logits(layout=layout, backend="cuda", **a))
        if out_dir is not None:
            (out_dir / f"{layout}_{B}_{N}_{ctx}_{contexts}.json").write_text(json.dumps(rows))
        cells, ghz = summary(rows)
        print(f"| {layout} | {B}, {N}, {ctx} | {contexts} | " + " | ".join(cells) + f" | {ghz:.2f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

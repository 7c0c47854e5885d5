"""Time indexer_qk_rope_quant_and_cache (FP8 and FP4, H=64) at a few T for launch variants on one backend,
with the copy ceiling of the same run (the bench's own timing: medians of CUDA events around graph replays).

  python dev/tune_indexer.py cuda LABEL          # the built module as it is (LABEL names its build flags)
  python dev/tune_indexer.py triton 32x4 64x8    # Triton: rows x warps of the q programs (quant.LAUNCH)
TUNE_T="1 64 8192" (default) picks the token counts.
"""
import os
import sys

import torch

from dsaquant import bench, testing as tt
from dsaquant.ops import indexer_qk_rope_quant_and_cache as op

backend, variants = sys.argv[1], sys.argv[2:] or ["default"]
bw = bench.copy_bandwidth()
print(f"copy bandwidth {bw:.0f} GB/s")
print("| backend | variant | mode | T | median µs | % copy |")
print("|---|---|---|---:|---:|---:|")
for v in variants:
    if backend == "triton" and "x" in v:
        from dsaquant.triton import quant
        r, w = (int(x) for x in v.split("x"))
        quant.LAUNCH["indexer_q"] = (r, w)
    for mode in ("fp8", "fp4"):
        for T in [int(x) for x in os.environ.get("TUNE_T", "1 64 8192").split()]:
            sets = [tt.make_indexer(T=T, H=64, mode=mode, device="cuda", seed=s, extra_pages=0)
                    for s in range(4 if T >= 1024 else 1)]
            a0 = sets[0]
            moved = (sum(bench._nbytes(a0.get(k)) for k in ("q", "k", "weights", "q_out", "weights_out", "q_scale_out"))
                     + 16 * T + (132 if mode == "fp8" else 68) * T)
            sec = bench.time_graph(lambda a: op(**a, backend=backend), sets, 100 if T <= 64 else 20)
            print(f"| {backend} | {v} | {mode} | {T} | {sec * 1e6:.2f} | {100 * moved / sec / 1e9 / bw:.1f} |", flush=True)

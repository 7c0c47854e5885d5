"""Time the bench's writer rows (`dsaquant.bench.cases`: the indexer, the v41 k and q writers, the V4 k writer; H = 64)
whose label starts with one of TUNE_CASES (default "k pack store,V4 k writer", comma-separated) at the T of TUNE_T
(default "1 64 1024 8192 32768") on the backends of TUNE_BACKENDS (default "cuda"), with the bench's timer and byte
count against the copy rate of the same run, one Markdown row each.

  python dev/tune_writers.py [LABEL]    # LABEL names the cuda module's build
  TUNE="python3 dev/tune_writers.py" dev/cuda_variants.sh "default:" ...
"""
import os
import sys

from dsaquant import bench

label = sys.argv[1] if len(sys.argv) > 1 else "default"
prefixes = tuple(p.strip() for p in os.environ.get("TUNE_CASES", "k pack store,V4 k writer").split(","))
bw = bench.copy_bandwidth()
print(f"copy bandwidth {bw:.0f} GB/s")
print("| variant | backend | case | T | median µs | % copy |")
print("|---|---|---|---:|---:|---:|")
for T in [int(x) for x in os.environ.get("TUNE_T", "1 64 1024 8192 32768").split()]:
    for name, _op, fn, make, nbytes, _variant in bench.cases(T, 64):
        if not name.startswith(prefixes):
            continue
        sets = [make(s) for s in range(4 if T >= 1024 else 1)]
        moved = nbytes(sets[0])
        for backend in os.environ.get("TUNE_BACKENDS", "cuda").split():
            sec = bench.time_graph(lambda kw: fn(**kw, backend=backend), sets, 100 if T <= 64 else 20)
            print(f"| {label} | {backend} | {name} | {T} | {sec * 1e6:.2f} | {100 * moved / sec / 1e9 / bw:.1f} |",
                  flush=True)

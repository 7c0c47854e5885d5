"""Time the bench's writer rows (`dsaquant.bench.cases`: the indexer, the v41 k and q writers, the V4 k writer; H = 64)
whose label starts with one of TUNE_CASES (default "k pack store,V4 k writer", comma-separated) at the T of TUNE_T
(default "1 64 1024 8192 32768") on the backends of TUNE_BACKENDS (default "cuda"), with the bench's timer and byte
count against the copy rate of the same run, one Markdown row each.

  python dev/tune_writers.py [LABEL]    # LABEL names the cuda module's build
  TUNE="python3 dev/tune_writers.py" dev/cuda_variants.sh "default:" ...
"""
import os
import sys

import tune_rows
from dsaquant import bench

label = sys.argv[1] if len(sys.argv) > 1 else "default"
prefixes = tuple(p.strip() for p in os.environ.get("TUNE_CASES", "k pack store,V4 k writer").split(","))
bw = tune_rows.header()
for T in [int(x) for x in os.environ.get("TUNE_T", "1 64 1024 8192 32768").split()]:
    for name, _op, fn, make, nbytes, _variant in bench.cases(T, 64):
        if name.startswith(prefixes):
            sets = [make(s) for s in range(4 if T >= 1024 else 1)]
            tune_rows.time_rows(label, name, T, fn, sets, nbytes(sets[0]), bw, tune_rows.backends("cuda"))

"""Time compress_kv on the bench's DeepSeek-V4 shapes (FP4 packed68, bf16 in: one T-token prompt at ratio 4 and 128,
and the decode step of 64 sequences of one token at ratio 4) on the backends of TUNE_BACKENDS (default "cuda
triton"): the bench's timer (CUDA-graph medians) and byte count, one Markdown row each.

  python dev/tune_compress.py [LABEL]    # LABEL names the cuda module's build flags
  TUNE="python3 dev/tune_compress.py" dev/cuda_variants.sh "default:" "s8:-DDSQ_COMPRESS_SLICES_128=8"
TUNE_T="1 64 1024 8192" (default) picks the token counts, TUNE_RATIOS="4 128" (default) the ratios; the decode row
runs when 64 is among the token counts and 4 among the ratios.
"""
import os
import sys

import tune_rows
from dsaquant import bench

label = sys.argv[1] if len(sys.argv) > 1 else "default"
Ts = [int(x) for x in os.environ.get("TUNE_T", "1 64 1024 8192").split()]
ratios = {f"r{x}" for x in os.environ.get("TUNE_RATIOS", "4 128").split()}
bw = tune_rows.header()
for T in Ts:
    for name, tokens, _op, fn, make, nbytes, _variant in bench.v4_cases((T,)):
        if not name.startswith("compress_kv") or name.split()[-2] not in ratios:
            continue
        if "decode" in name and T != 64:      # the decode step's size is fixed (64 tokens); run it once
            continue
        sets = [make(s) for s in range(4 if tokens >= 1024 else 1)]
        tune_rows.time_rows(label, name, tokens, fn, sets, nbytes(sets[0]), bw, tune_rows.backends())

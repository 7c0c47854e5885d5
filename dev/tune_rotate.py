"""Time rope_rotate_quant (H = 64, into FP4 with the shuffled scales, bf16 in) at a few T on the backends of
TUNE_BACKENDS (default "cuda triton"), against the copy rate of the same run: the bench's timer and byte count.

  python dev/tune_rotate.py [LABEL]      # LABEL names the cuda module's build flags
  TUNE="python3 dev/tune_rotate.py" dev/cuda_variants.sh "default:" "v64:-DDSQ_ROTATE_V_LARGE_128=64"
TUNE_T="1024 8192 32768" (default) picks the token counts, TUNE_D="128" (default) the row widths.
"""
import os
import sys

import tune_rows
from dsaquant import bench, compress, testing as tt

label = sys.argv[1] if len(sys.argv) > 1 else "default"
bw = tune_rows.header("D")
for D in [int(x) for x in os.environ.get("TUNE_D", "128").split()]:
    for T in [int(x) for x in os.environ.get("TUNE_T", "1024 8192 32768").split()]:
        sets = [tt.make_rope_rotate_quant(T=T, H=64, D=D, device="cuda", seed=s) for s in range(4 if T >= 1024 else 1)]
        a = sets[0]
        moved = (sum(bench._nbytes(a[k]) for k in ("x", "out", "out_scale", "positions"))
                 + T * 2 * 32 * a["cos_cache"].element_size())
        tune_rows.time_rows(label, D, T, compress.rope_rotate_quant, sets, moved, bw, tune_rows.backends())

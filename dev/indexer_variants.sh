#!/usr/bin/env bash
# Build the cuda module once per tuning variant of the indexer kernel and time each with dev/tune_indexer.py
# (FP8 and FP4, H=64, T = 1, 64, 8192, copy ceiling of the same run). The last variant built stays installed.
#   dev/indexer_variants.sh "default:" "hif1:-DDSQ_INDEXER_HEADS_IN_FLIGHT=1" ...
# Each argument is LABEL:NVCC_FLAGS (the macros are listed at the top of kernels/cuda/indexer.cu).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
for v in "$@"; do
  label=${v%%:*}; flags=${v#*:}
  DSAQUANT_NVCC_EXTRA="$flags" DSAQUANT_CUDA_ARCHS=${DSAQUANT_CUDA_ARCHS:-90a} python3 tools/build_native.py cuda \
    >"$OUT/build_$label.log" 2>&1 || { echo "build $label FAILED"; tail -20 "$OUT/build_$label.log"; continue; }
  timeout 300 python3 dev/tune_indexer.py cuda "$label" 2>&1 | tee -a "$OUT/variants.md"
done

#!/usr/bin/env bash
# Build the cuda module once per tuning variant and time each with a tuning tool (default dev/tune_indexer.py cuda;
# TUNE="python3 dev/tune_prefill.py" for the prefill logits). The last variant built stays installed.
#   dev/cuda_variants.sh "default:" "hif1:-DDSQ_INDEXER_HEADS_IN_FLIGHT_FP8=1" ...
#   TUNE="python3 dev/tune_prefill.py" dev/cuda_variants.sh "default:" "s3:-DDSQ_PREFILL_STAGES=3"
# Each argument is LABEL:NVCC_FLAGS (the macros are listed at the top of each kernel file); the tool gets LABEL as
# its last argument. Logs and variants.md under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
TUNE=${TUNE:-python3 dev/tune_indexer.py cuda}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
for v in "$@"; do
  label=${v%%:*}; flags=${v#*:}
  DSAQUANT_NVCC_EXTRA="$flags" DSAQUANT_CUDA_ARCHS=${DSAQUANT_CUDA_ARCHS:-90a} python3 tools/build_native.py cuda \
    >"$OUT/build_$label.log" 2>&1 || { echo "build $label FAILED"; tail -20 "$OUT/build_$label.log"; continue; }
  timeout 300 $TUNE "$label" 2>&1 | tee -a "$OUT/variants.md"
done

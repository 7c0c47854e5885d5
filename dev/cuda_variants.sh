#!/usr/bin/env bash
# Time tuning variants of the cuda module with a tuning tool (default dev/tune_indexer.py cuda;
# TUNE="python3 dev/tune_prefill.py" for the prefill logits). Every variant is built (or taken) first, then timed in
# turn, ROUNDS times (default 1), so that the rounds alternate them in one call. The last variant stays installed.
#   dev/cuda_variants.sh "default:" "hif1:-DDSQ_INDEXER_HEADS_IN_FLIGHT_FP8=1" ...
#   TUNE="python3 dev/tune_prefill.py" dev/cuda_variants.sh "default:" "s3:-DDSQ_PREFILL_STAGES=3"
#   ROUNDS=2 dev/cuda_variants.sh "before@.gpu/before.so" "after@.gpu/after.so"
# Each argument is LABEL:NVCC_FLAGS (the macros are listed at the top of each kernel file), or LABEL@LIBRARY: a
# libdsaquant_cuda.so built elsewhere (tools/build_native.py), which saves the build on the GPU machine. The tool
# gets LABEL as its last argument. Logs and variants.md under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
TUNE=${TUNE:-python3 dev/tune_indexer.py cuda}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
LIB=python/dsaquant/libdsaquant_cuda.so
LIBS=$(mktemp -d)
trap 'rm -rf "$LIBS"' EXIT
labels=()
for v in "$@"; do
  head=${v%%:*}
  if [[ $head == *@* ]]; then   # LABEL@LIBRARY (a colon, if any, comes after the @)
    label=${v%%@*}
    cp "${v#*@}" "$LIBS/$label.so" || { echo "variant $label: no library at ${v#*@}"; continue; }
  else
    label=${v%%:*}; flags=${v#*:}
    DSAQUANT_NVCC_EXTRA="$flags" DSAQUANT_CUDA_ARCHS=${DSAQUANT_CUDA_ARCHS:-90a} python3 tools/build_native.py cuda \
      >"$OUT/build_$label.log" 2>&1 || { echo "build $label FAILED"; tail -20 "$OUT/build_$label.log"; continue; }
    cp "$LIB" "$LIBS/$label.so"
  fi
  labels+=("$label")
done
for _ in $(seq "${ROUNDS:-1}"); do
  for label in "${labels[@]}"; do
    cp "$LIBS/$label.so" "$LIB"
    timeout 300 $TUNE "$label" 2>&1 | tee -a "$OUT/variants.md"
  done
done

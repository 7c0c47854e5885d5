#!/usr/bin/env bash
# Session 4, device call 1: the packed bf16 FP4 encoder in the CUDA indexer (timing variants, then the byte-exact
# indexer tests on the last build). Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
timeout 240 ci/indexer_variants.sh "mb3:-DDSQ_INDEXER_MIN_BLOCKS_FP4=3" "packed:" > "$OUT/variants.log" 2>&1
cat "$OUT/variants.md"
DSAQUANT_COUNTS_FILE="$OUT/counts.txt" timeout 280 python3 -m pytest -q --tb=short -rf -p no:cacheprovider \
  tests/gpu/test_backend_exact.py -k "indexer" > "$OUT/tests.log" 2>&1
tail -30 "$OUT/tests.log"

#!/usr/bin/env bash
# Indexer check: timing variants (ci/indexer_variants.sh, arguments LABEL:NVCC_FLAGS), then the byte-exact
# indexer tests (tests/gpu/test_backend_exact.py -k indexer) on the last build. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
[ $# -gt 0 ] || set -- "packed:"   # LABEL:NVCC_FLAGS variants, the last one stays built for the tests
timeout 300 ci/indexer_variants.sh "$@" > "$OUT/variants.log" 2>&1
cat "$OUT/variants.md"
DSAQUANT_COUNTS_FILE="$OUT/counts.txt" timeout 280 python3 -m pytest -q --tb=short -rf -p no:cacheprovider \
  tests/gpu/test_backend_exact.py -k "indexer" > "$OUT/tests.log" 2>&1
tail -30 "$OUT/tests.log"

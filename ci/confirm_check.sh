#!/usr/bin/env bash
# A short confirmation call after a small kernel change: build, the indexer's byte-exact tests on cuda,
# indexer timings at TUNE_T (default "1024 8192"), and compute-sanitizer memcheck of ci/sanitize_cases.py.
# Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python
DSAQUANT_CUDA_ARCHS=90a python3 tools/build_native.py cuda > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
DSAQUANT_COUNTS_FILE="$OUT/counts.txt" timeout 120 python3 -m pytest -q --tb=short -rf -p no:cacheprovider \
  tests/gpu/test_backend_exact.py -k "indexer and not soft and not triton" > "$OUT/tests.log" 2>&1
tail -8 "$OUT/tests.log"
TUNE_T="${TUNE_T:-1024 8192}" timeout 60 python3 ci/tune_indexer.py cuda default > "$OUT/cuda_timing.md" 2>&1; cat "$OUT/cuda_timing.md"
timeout ${SANITIZE_TIMEOUT:-100} compute-sanitizer --tool memcheck --error-exitcode 9 python3 ci/sanitize_cases.py cuda \
  > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log")"

#!/usr/bin/env bash
# One device call after an indexer change on both backends: build, the byte-exact indexer tests (cuda grid
# and Triton grid), indexer timings (TUNE_T), the small-T probe. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python
( time DSAQUANT_CUDA_ARCHS=90a python3 tools/build_native.py cuda ) > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
DSAQUANT_COUNTS_FILE="$OUT/counts.txt" timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q --tb=short -rf -p no:cacheprovider \
  tests/gpu/test_backend_exact.py tests/gpu/test_triton_gpu.py -k "indexer and not soft" > "$OUT/tests.log" 2>&1
tail -14 "$OUT/tests.log"
TUNE_T="1 16 64 8192" timeout 60 python3 ci/tune_indexer.py cuda final > "$OUT/cuda_timing.md" 2>&1; cat "$OUT/cuda_timing.md"
TUNE_T="64 8192" timeout 60 python3 ci/tune_indexer.py triton default > "$OUT/triton_timing.md" 2>&1; cat "$OUT/triton_timing.md"
timeout 60 python3 ci/small_t_probe.py cuda > "$OUT/small_t.md" 2>&1; cat "$OUT/small_t.md"

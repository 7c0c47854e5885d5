#!/usr/bin/env bash
# One device call: build the CUDA module, the byte-exact writer tests (cuda and triton, incl. every bf16 value;
# TESTS_K selects them), indexer timings of both backends (TUNE_T picks the token counts), the small-T probe,
# then the bench without the V4 rows (BENCH_TIMEOUT=0 skips it). Logs under $OUT; each part has its own
# timeout so that the call ends in time.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python
( time DSAQUANT_CUDA_ARCHS=90a python3 tools/build_native.py cuda ) > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
DSAQUANT_COUNTS_FILE="$OUT/counts.txt" timeout ${TESTS_TIMEOUT:-170} python3 -m pytest -q --tb=short -rf -p no:cacheprovider \
  tests/gpu/test_backend_exact.py tests/gpu/test_triton_gpu.py -k "${TESTS_K:-(indexer or k_store or q_pack) and not soft}" \
  > "$OUT/tests.log" 2>&1
tail -25 "$OUT/tests.log"
timeout 70 python3 ci/tune_indexer.py triton default > "$OUT/triton_timing.md" 2>&1; cat "$OUT/triton_timing.md"
timeout 60 python3 ci/tune_indexer.py cuda default > "$OUT/cuda_timing.md" 2>&1; cat "$OUT/cuda_timing.md"
timeout 60 python3 ci/small_t_probe.py cuda > "$OUT/small_t.md" 2>&1; cat "$OUT/small_t.md"
if [ "${BENCH_TIMEOUT:-110}" != 0 ]; then
  timeout ${BENCH_TIMEOUT:-110} python3 -m dsaquant bench --no-v4 --json "$OUT/bench.json" --markdown "$OUT/bench.md" > "$OUT/bench.log" 2>&1
  cat "$OUT/bench.md" 2>/dev/null | head -60 || tail -20 "$OUT/bench.log"
fi

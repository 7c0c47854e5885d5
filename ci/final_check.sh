#!/usr/bin/env bash
# One device call: build the CUDA module (NVCC_EXTRA: extra flags, e.g. a tuning macro), the byte-exact
# writer tests (cuda and triton, incl. every bf16 value; TESTS_K selects them), indexer timings
# (TUNE_BACKENDS, default "triton cuda"; TUNE_T picks the token counts), the small-T probe (PROBE_BACKENDS),
# the bench without the V4 rows (BENCH_TIMEOUT=0 skips it), and ncu summaries of PROFILE_CASES (e.g. "fp4";
# empty by default). Logs under $OUT; each part has its own timeout so that the call ends in time.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python
( time DSAQUANT_NVCC_EXTRA="${NVCC_EXTRA:-}" DSAQUANT_CUDA_ARCHS=90a python3 tools/build_native.py cuda ) > "$OUT/build.log" 2>&1 \
  || { tail -20 "$OUT/build.log"; exit 1; }
DSAQUANT_COUNTS_FILE="$OUT/counts.txt" timeout ${TESTS_TIMEOUT:-170} python3 -m pytest -q --tb=short -rf -p no:cacheprovider \
  tests/gpu/test_backend_exact.py tests/gpu/test_triton_gpu.py -k "${TESTS_K:-(indexer or k_store or q_pack) and not soft}" \
  > "$OUT/tests.log" 2>&1
tail -25 "$OUT/tests.log"
for b in ${TUNE_BACKENDS:-triton cuda}; do
  timeout 70 python3 ci/tune_indexer.py "$b" default > "$OUT/${b}_timing.md" 2>&1; cat "$OUT/${b}_timing.md"
done
timeout 90 python3 ci/small_t_probe.py ${PROBE_BACKENDS:-cuda} > "$OUT/small_t.md" 2>&1; cat "$OUT/small_t.md"
if [ "${BENCH_TIMEOUT:-110}" != 0 ]; then
  timeout ${BENCH_TIMEOUT:-110} python3 -m dsaquant bench --no-v4 --json "$OUT/bench.json" --markdown "$OUT/bench.md" > "$OUT/bench.log" 2>&1
  cat "$OUT/bench.md" 2>/dev/null | head -60 || tail -20 "$OUT/bench.log"
fi
if [ -n "${PROFILE_CASES:-}" ]; then   # ncu via ci/gpu_check.sh's profile part, then the numbers that matter
  GPU_CHECK_PARTS=profile OUT=$OUT timeout 200 bash ci/gpu_check.sh cuda 2>&1 | grep "^ncu"
  for f in "$OUT"/ncu_*.txt; do
    grep -E "^\s+(Duration|Executed Ipc Active|Issue Slots Busy|No Eligible|Eligible Warps Per|Active Warps Per|Warp Cycles Per Issued|Executed Instructions |Achieved Occupancy|Registers Per|DRAM Throughput|Block Limit|Static Shared|Stall [A-Z])" "$f" | sort -u
  done
fi

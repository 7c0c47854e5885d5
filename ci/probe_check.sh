#!/usr/bin/env bash
# One device call for a kernel change: build, the byte-exact indexer tests (cuda), the indexer timings
# (ci/tune_indexer.py), the small-T probe (ci/small_t_probe.py) and an ncu profile of PROFILE_CASES
# (default fp4: T=8192). Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python
( time DSAQUANT_NVCC_EXTRA="${NVCC_EXTRA:-}" DSAQUANT_CUDA_ARCHS=90a python3 tools/build_native.py cuda ) > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
DSAQUANT_COUNTS_FILE="$OUT/counts.txt" timeout 200 python3 -m pytest -q --tb=short -rf -p no:cacheprovider \
  tests/gpu/test_backend_exact.py -k "indexer and cuda" > "$OUT/tests.log" 2>&1
tail -8 "$OUT/tests.log"
timeout 60 python3 ci/tune_indexer.py cuda "${LABEL:-new}" > "$OUT/cuda_timing.md" 2>&1; cat "$OUT/cuda_timing.md"
timeout 90 python3 ci/small_t_probe.py ${PROBE_BACKENDS:-cuda triton} > "$OUT/small_t.md" 2>&1; cat "$OUT/small_t.md"
if [ -n "${PROFILE_CASES-fp4}" ]; then
  GPU_CHECK_PARTS=profile PROFILE_CASES="${PROFILE_CASES:-fp4}" OUT=$OUT timeout 200 bash ci/gpu_check.sh cuda 2>&1 | grep "^ncu"
  for f in "$OUT"/ncu_*.txt; do
    grep -E "^\s+(Duration|Executed Ipc Active|Issue Slots Busy|No Eligible|Eligible Warps Per|Active Warps Per|Warp Cycles Per Issued|Executed Instructions |Achieved Occupancy|Registers Per|DRAM Throughput|Block Limit Shared|Dynamic Shared|Static Shared|Shared Memory Configuration)" "$f" | sort -u | head -24
  done
fi

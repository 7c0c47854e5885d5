#!/usr/bin/env bash
# One call on a GPU machine: build the CUDA module, run GPU test groups side by side (Triton compiles are CPU-bound,
# the GPU work of the tests is small), then the benchmark alone. Logs and byte-count tables go to $OUT.
#   GPU_GROUPS: ';'-separated pytest argument lists, one process each (default below)
#   GPU_TESTS_TIMEOUT (s, per group, default 330), GPU_BENCH_ARGS (default "--tokens 1,64,8192"; "skip": no bench)
#   GPU_BUILD=0: use the library already at python/dsaquant/ (built elsewhere and copied in) instead of building
#   GPU_SANITIZE="memcheck racecheck": compute-sanitizer tools run over ci/sanitize_read_cases.py (GPU_SANITIZE_SCRIPT)
#     beside the test groups (default: none)
#   GPU_TAR=1: every log in one archive, $OUT/gpu_check.tgz (for runners that bring back few files)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
if [ "${GPU_BUILD:-1}" != 0 ]; then
  ( time DSAQUANT_CUDA_ARCHS=${DSAQUANT_CUDA_ARCHS:-90a} python3 tools/build_native.py cuda ) >"$OUT/build.log" 2>&1 \
    || { echo "BUILD FAILED"; tail -30 "$OUT/build.log"; exit 1; }
fi
python3 -m dsaquant info >"$OUT/info.txt" 2>&1
DEFAULT_GROUPS="tests/gpu/test_triton_gpu.py;tests/gpu/test_compress_gpu.py;tests/gpu/test_backend_exact.py tests/gpu/test_reliability_gpu.py -k cuda;tests/gpu/test_reliability_gpu.py -k triton"
IFS=';' read -ra groups <<<"${GPU_GROUPS:-$DEFAULT_GROUPS}"
i=0
for g in "${groups[@]}"; do
  i=$((i + 1))
  eval "args=($g)"
  ( DSAQUANT_COUNTS_FILE="$OUT/counts_$i.txt" DSAQUANT_BACKEND= timeout ${GPU_TESTS_TIMEOUT:-330} \
      python3 -m pytest -v --tb=short -rf -p no:cacheprovider "${args[@]}" >"$OUT/tests_$i.log" 2>&1
    echo "group $i ($g): rc=$? $(tail -1 "$OUT/tests_$i.log")" ) &
done
for tool in ${GPU_SANITIZE:-}; do
  log="$OUT/sanitizer_$tool.log"
  ( timeout ${GPU_TESTS_TIMEOUT:-330} compute-sanitizer --tool "$tool" --error-exitcode 9 python3 \
      "${GPU_SANITIZE_SCRIPT:-ci/sanitize_read_cases.py}" cuda >"$log" 2>&1; echo "rc=$?" >>"$log"
    echo "sanitizer $tool: $(tail -1 "$log") $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)" ) &
done
wait
status=0
for log in "$OUT"/sanitizer_*.log; do
  [ -e "$log" ] && [ "$(tail -1 "$log")" != rc=0 ] && status=1
done
for j in $(seq 1 $i); do
  if grep -qE " FAILED| ERROR" "$OUT/tests_$j.log"; then grep -E " FAILED| ERROR" "$OUT/tests_$j.log" | head -10; status=1; fi
  cat "$OUT/counts_$j.txt" 2>/dev/null
done
if [ "${GPU_BENCH_ARGS:-}" != skip ]; then
  timeout 200 python3 -m dsaquant bench ${GPU_BENCH_ARGS:---tokens 1,64,8192} --json "$OUT/bench.json" \
    --markdown "$OUT/bench.md" >"$OUT/bench.log" 2>&1 || status=1
  cat "$OUT/bench.md" 2>/dev/null || tail -20 "$OUT/bench.log"
fi
if [ "${GPU_TAR:-0}" = 1 ]; then
  tar czf /tmp/gpu_check.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu_check.tgz "$OUT/"
fi
exit $status

#!/usr/bin/env bash
# The GPU check: build the CUDA module, run the GPU test suite, the benchmark and compute-sanitizer, in
# one call on a GPU machine. Logs go to $OUT (default ./gpu_out). Usage: ci/gpu_check.sh [cuda|hip]
#   GPU_CHECK_PARTS="build tests bench sanitize" selects parts (also: profile). Knobs: GPU_TESTS_FILES,
#   GPU_TESTS_ARGS, GPU_TESTS_TIMEOUT, GPU_BENCH_ARGS, PROFILE_BACKENDS, PROFILE_CASES, SANITIZE_TOOLS,
#   SANITIZE_SCRIPTS, SANITIZE_BACKENDS, SANITIZE_TIMEOUT, GPU_CHECK_TAR=1 (one .tgz of every log).
set -uo pipefail
cd "$(dirname "$0")/.."
BACKEND=${1:-cuda}
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
PARTS=${GPU_CHECK_PARTS:-"build tests bench sanitize"}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
status=0
has() { [[ " $PARTS " == *" $1 "* ]]; }

if has build; then
  if [ "$BACKEND" = cuda ]; then
    ( time DSAQUANT_CUDA_ARCHS=${DSAQUANT_CUDA_ARCHS:-90a} python3 tools/build_native.py cuda ) \
      >"$OUT/build.log" 2>&1 || { echo "BUILD FAILED"; tail -30 "$OUT/build.log"; exit 1; }
  elif [ "$BACKEND" = hip ]; then
    # HIP: hipify + build libdsaquant_hip.so for $DSAQUANT_HIP_ARCHS (default "gfx942;gfx950"), then the on-device check
    # of the gfx950 FP4 instruction against its emulation (kernels/hip/fp4_selfcheck.hip; on gfx942 it checks the
    # harness). A mismatch fails the check; the first mismatches are in fp4_selfcheck.log.
    ( time DSAQUANT_BUILD_HIP=1 python3 tools/build_hip.py --build ) >"$OUT/build.log" 2>&1 \
      || { echo "BUILD FAILED"; tail -30 "$OUT/build.log"; exit 1; }
    timeout 300 python3 tools/build_hip.py --selfcheck >"$OUT/fp4_selfcheck.log" 2>&1 || status=1
    head -20 "$OUT/fp4_selfcheck.log"
  fi
  tail -3 "$OUT/build.log"
fi
python3 -m dsaquant info | tee "$OUT/info.txt"
if has tests; then
  eval "extra=(${GPU_TESTS_ARGS:-})"   # e.g. GPU_TESTS_ARGS="-k 'cuda or native'"
  # -v --tb=short: each test's name and result is in the log as it happens, so a run stopped by the timeout
  # still says which tests failed. The whole folder takes about ten minutes or more with a cold
  # Triton cache: split it by file (GPU_TESTS_FILES="tests/gpu/test_backend_exact.py" ...) when time is short.
  DSAQUANT_COUNTS_FILE="$OUT/counts.txt" DSAQUANT_BACKEND= timeout ${GPU_TESTS_TIMEOUT:-420} python3 -m pytest -v --tb=short \
    -rf -p no:cacheprovider ${GPU_TESTS_FILES:-tests/gpu} "${extra[@]}" >"$OUT/gpu_tests.log" 2>&1 || status=1
  grep -E " FAILED| ERROR" "$OUT/gpu_tests.log" | head -40
  tail -25 "$OUT/gpu_tests.log"
fi
if has bench; then
  timeout 300 python3 -m dsaquant bench ${GPU_BENCH_ARGS:-} --json "$OUT/bench.json" --markdown "$OUT/bench.md" >"$OUT/bench.log" 2>&1 || status=1
  cat "$OUT/bench.md" 2>/dev/null || tail -20 "$OUT/bench.log"
fi
if has profile && command -v ncu >/dev/null; then
  # Nsight Compute, full set, of the second launch of each case (ci/profile_case.py) on each backend:
  # ncu_<backend>_<case>_T<T>.txt holds every section (occupancy, warp stalls, memory tables), _sass.csv the
  # per-instruction stall samples of the SASS.
  kernels=$(python3 ci/profile_case.py --kernels)
  for b in ${PROFILE_BACKENDS:-$BACKEND}; do
    for case in ${PROFILE_CASES:-fp8 fp4 qpack}; do   # CASE or CASE@T (e.g. fp4@1); read side: topk64, scorer_packed68..
      w=${case%@*}; T=8192; [[ $case == *@* ]] && T=${case#*@}
      rep="$OUT/ncu_${b}_${w}_T$T"
      timeout 240 ncu --clock-control none --set full --kernel-name regex:"$kernels" \
        --launch-skip 1 --launch-count 1 -f -o "$rep" python3 ci/profile_case.py $w "$b" $T >"$rep.log" 2>&1
      ncu -i "$rep.ncu-rep" --page details --print-details all >"$rep.txt" 2>&1
      ncu -i "$rep.ncu-rep" --page source --csv --print-source sass >"${rep}_sass.csv" 2>&1
      rm -f "$rep.ncu-rep"; gzip -f "${rep}_sass.csv"
      echo "ncu $b $w T=$T: $(grep -E '^ +(Duration|DRAM Throughput|Achieved Occupancy|Issued Warp Per Scheduler|Registers Per Thread) ' "$rep.txt" | awk '{print $1, $2, $(NF)}' | tr '\n' ';')"
    done
  done
fi
if has sanitize && command -v compute-sanitizer >/dev/null; then
  # Every (tool, script, backend) run at once: the tools are host-bound, and each process has its own outputs.
  pids=()
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck}; do
    for script in ${SANITIZE_SCRIPTS:-ci/sanitize_cases.py ci/sanitize_edge_cases.py ci/sanitize_read_cases.py}; do
      for b in ${SANITIZE_BACKENDS:-$BACKEND}; do
        log="$OUT/sanitizer_${tool}_$(basename "$script" .py)_$b.log"
        ( timeout ${SANITIZE_TIMEOUT:-400} compute-sanitizer --tool $tool --error-exitcode 9 python3 "$script" "$b" \
            >"$log" 2>&1; echo "rc=$?" >>"$log" ) &
        pids+=($!)
      done
    done
  done
  wait "${pids[@]}"
  for log in "$OUT"/sanitizer_*.log; do
    rc=$(tail -1 "$log")
    echo "$(basename "$log" .log): $rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|done' "$log" | tail -2 | tr '\n' ' ')"
    [ "$rc" = rc=0 ] || status=1
  done
fi
if [ -n "${GPU_CHECK_TAR:-}" ]; then   # one archive of every log, for runners that keep few files
  tar czf /tmp/gpu_check.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu_check.tgz "$OUT/"
fi
exit $status

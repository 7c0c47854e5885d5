#!/usr/bin/env bash
# The built wheels on an NVIDIA GPU, as installed (not the source tree): the pure package and the CUDA plugin from
# the wheel files in $1 (default dist/; no network needed: nothing else is installed, torch must be there) are
# installed into a fresh target directory, then
#   1. `python -m dsaquant info` from there: the plugin found, and which device code runs on this GPU
#      ("cubin sm_90a", or "PTX compute_80, JIT-compiled for sm_XY");
#   2. the device-code checks and the GPU byte-exact suite (GPU_TESTS, default tests/gpu/test_device_code_gpu.py
#      tests/gpu/test_backend_exact.py) against the installed copy;
#   3. the host overhead per eager call of indexer_qk_rope_quant_and_cache at T = 1 (H = 64, FP8) with
#      backend="cuda": N calls (OVERHEAD_CALLS, default 2000) after a warm-up, torch.cuda.synchronize() only at the
#      end, wall-clock per call in µs (the GPU time of one such launch is a few µs: the figure is the host's).
# Logs under $OUT (default ./gpu_out). A few minutes at most. The wheels are git-ignored: carry dist/ to the machine.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
dist=$(realpath "${1:-dist}")
OUT=${OUT:-$repo/gpu_out}; mkdir -p "$OUT"
py=${PYTHON:-python3}
target=$(mktemp -d)/site
status=0
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH

"$py" -m pip install -q --no-deps --no-index --target "$target" "$dist"/dsaquant-*-py3-none-any.whl \
  "$dist"/dsaquant_cuda13-*.whl || { echo "INSTALL FAILED"; exit 1; }
export PYTHONPATH=$target

(cd "$target" && "$py" - <<'PY') 2>&1 | tee "$OUT/wheel_info.txt" || status=1
import os, sys
import dsaquant
from dsaquant.backends.compiled import library
from dsaquant.info import format_info, info
print(format_info(info()))
site = os.environ["PYTHONPATH"]
assert dsaquant.__file__.startswith(site), f"dsaquant imported from {dsaquant.__file__}, not {site}"
assert library("cuda").path.startswith(site), f"the cuda library {library('cuda').path} is not the installed plugin's"
print(f"installed copy: {os.path.dirname(dsaquant.__file__)}; library {library('cuda').path}")
PY

# --rootdir/-c: the repository's test configuration, the package from $target (the tree's python/ is not on the path).
timeout ${GPU_TESTS_TIMEOUT:-150} "$py" -m pytest -q -p no:cacheprovider -rf --rootdir "$repo" -c "$repo/pyproject.toml" \
  ${GPU_TESTS:-tests/gpu/test_device_code_gpu.py tests/gpu/test_backend_exact.py} >"$OUT/wheel_gpu_tests.log" 2>&1 || status=1
grep -E " FAILED| ERROR" "$OUT/wheel_gpu_tests.log" | head -20
tail -3 "$OUT/wheel_gpu_tests.log"

(cd "$target" && OVERHEAD_CALLS=${OVERHEAD_CALLS:-2000} "$py" - <<'PY') 2>&1 | tee "$OUT/wheel_overhead.txt" || status=1
import os, time
import torch
import dsaquant
from dsaquant import ops, testing

n = int(os.environ["OVERHEAD_CALLS"])
a = testing.make_indexer(T=1, H=64, mode="fp8", device="cuda", seed=1)
for _ in range(50):   # warm-up: library load, JIT where there is one, allocator
    ops.indexer_qk_rope_quant_and_cache(**a, backend="cuda")
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(n):
    ops.indexer_qk_rope_quant_and_cache(**a, backend="cuda")
torch.cuda.synchronize()
dt = time.perf_counter() - t0
print(f"indexer_qk_rope_quant_and_cache T=1 H=64 fp8 backend=cuda: {dt / n * 1e6:.2f} us/call "
      f"(wall clock, {n} eager calls, one synchronize; torch {torch.__version__}, {torch.cuda.get_device_name()})")
PY
exit $status

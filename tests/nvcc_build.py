"""The CUDA build tests' shared steps (tests/test_topk_build.py, tests/test_scorer_build.py): one translation unit
built into a shared library with nvcc and the project's flags (tools/build_native.py nvcc_flags) for one
architecture, ptxas reporting every kernel's resources; the stack and spill figures of that report; the functions
the library exports."""
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
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA_HOME, PATH, /usr/local/cuda/bin)")


def build_shared(tu: Path, so: Path, arch: str, extra: tuple[str, ...] = ()) -> str:
    """Builds `tu` into the shared library `so` for sm_`arch` (e.g. "90a") with `extra` flags; returns nvcc's
    report (stderr). Fails the test, with the command and the report, when nvcc fails."""
    flags = [f for f in bn.nvcc_flags() if not f.startswith("-gencode")]
    cmd = [NVCC, *flags, *extra, f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v", "-shared", str(tu),
           "-o", str(so)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr}"
    return res.stderr


def frames(log: str) -> list[tuple[str, str, str]]:
    """(stack frame, spill stores, spill loads) bytes of every kernel in a ptxas report, as strings."""
    return re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)


def exported_functions(so: Path) -> set[str]:
    """The functions `so` defines and exports (nm -D); skips the test where nm is missing."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not found")
    syms = subprocess.run([nm, "-D", "--defined-only", str(so)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in syms.splitlines() if " T " in line}

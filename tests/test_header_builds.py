"""Build checks of the shared header (src/include/dsaquant) for every target; nothing runs.

- g++ / clang++: the headers alone compile as plain C++17, warning-free; fast-math is rejected.
- nvcc: tests/cpp/instantiate.cu (every header function in a __global__ kernel) compiles for sm_90a
  and sm_100a with --fmad=false, and its PTX holds no fused multiply-add on f32.
- clang (HIP, device only): the same file compiles for gfx942 and gfx950; the gfx950 assembly of
  the `hardware` FP4 kernel uses V_CVT_SCALEF32_PK_FP4_F32 and the gfx942 one does not; the LLVM IR of
  header arithmetic carries no `contract` flag even under HIP's default -ffp-contract=fast-honor-pragmas.
No fast-math, FTZ or contraction flag is used anywhere (SPEC §0.1, §0.6).
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INCLUDE = REPO / "src" / "include"
INSTANTIATE = REPO / "tests" / "cpp" / "instantiate.cu"


def _find_tool(name: str, *fallbacks: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    return next((f for f in fallbacks if Path(f).exists()), None)


NVCC = _find_tool("nvcc", "/usr/local/cuda/bin/nvcc")
CLANG = _find_tool("clang-22", "/usr/bin/clang-22", "/usr/lib/llvm-22/bin/clang")
GXX = _find_tool("g++")


def _hip_path() -> str | None:
    """A directory holding include/hip/hip_runtime.h: ROCm, or the HIP headers Triton ships."""
    for cand in ("/opt/rocm",):
        if (Path(cand) / "include" / "hip" / "hip_runtime.h").exists():
            return cand
    spec = importlib.util.find_spec("triton")
    if spec and spec.origin:
        amd = Path(spec.origin).parent / "backends" / "amd"
        if (amd / "include" / "hip" / "hip_runtime.h").exists():
            return str(amd)
    return None


HIP_PATH = _hip_path()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, /usr/local/cuda/bin)")
needs_clang = pytest.mark.skipif(CLANG is None, reason="clang-22 not found (PATH, /usr/bin/clang-22)")
needs_hip_headers = pytest.mark.skipif(HIP_PATH is None, reason="no HIP headers (ROCm or triton/backends/amd/include)")


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout}\n{res.stderr}"
    assert "warning" not in res.stderr.lower(), f"{' '.join(cmd)} warned:\n{res.stderr}"
    return res


# ---- host C++17 ----------------------------------------------------------------------------------
HOST_TU = '#include "dsaquant/dsaquant.h"\nint main() { return dsq::e2m1_encode(1.0f, dsq::Rounding::rne) == 2 ? 0 : 1; }\n'


@pytest.mark.parametrize("compiler", ["g++", "clang++"])
def test_host_cxx17(tmp_path, compiler):
    cxx = GXX if compiler == "g++" else CLANG
    if cxx is None:
        pytest.skip(f"{compiler} not found")
    src = tmp_path / "host.cpp"
    src.write_text(HOST_TU)
    lang = ["-x", "c++"] if compiler == "clang++" else []
    _run([cxx, *lang, "-std=c++17", "-O2", "-ffp-contract=off", "-Wall", "-Wextra", "-Wpedantic", "-Werror",
          f"-I{INCLUDE}", str(src), "-o", str(tmp_path / "host"), *(["-lstdc++", "-lm"] if compiler == "clang++" else [])])
    assert subprocess.run([str(tmp_path / "host")]).returncode == 0


def test_fast_math_is_rejected(tmp_path):
    if GXX is None:
        pytest.skip("g++ not found")
    src = tmp_path / "fm.cpp"
    src.write_text(HOST_TU)
    res = subprocess.run([GXX, "-std=c++17", "-ffast-math", "-fsyntax-only", f"-I{INCLUDE}", str(src)],
                         capture_output=True, text=True)
    assert res.returncode != 0 and "fast-math" in res.stderr


# ---- CUDA ------------------------------------------------------------------------------------------
NVCC_FLAGS = ["-std=c++17", "--fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true",
              "-Xcompiler", "-ffp-contract=off", f"-I{INCLUDE}"]


@needs_nvcc
@pytest.mark.parametrize("arch", ["90a", "100a"])
def test_nvcc_compiles(tmp_path, arch):
    _run([NVCC, *NVCC_FLAGS, f"-gencode=arch=compute_{arch},code=sm_{arch}", "-c", str(INSTANTIATE),
          "-o", str(tmp_path / f"instantiate_sm{arch}.o")])
    ptx = tmp_path / f"instantiate_{arch}.ptx"
    _run([NVCC, *NVCC_FLAGS, f"-gencode=arch=compute_{arch},code=compute_{arch}", "-ptx", str(INSTANTIATE),
          "-o", str(ptx)])
    text = ptx.read_text()
    fused = re.findall(r"\b(?:fma|mad)\.[a-z.]*f32\b", text)
    assert not fused, f"fused f32 multiply-add in the PTX: {sorted(set(fused))}"
    assert "mul.rn.f32" in text and "div.rn.f32" in text and "sqrt.rn.f32" in text


# ---- HIP (clang, device only) ------------------------------------------------------------------------
def _hip_cmd(arch: str, out: Path, *extra: str) -> list[str]:
    return [CLANG, "-x", "hip", f"--offload-arch={arch}", "--cuda-device-only", "-nogpulib", "-O3", "-std=c++17",
            f"--hip-path={HIP_PATH}", f"-I{INCLUDE}", *extra, str(INSTANTIATE), "-o", str(out)]


# SPEC §0: no contraction, denormals kept, correctly rounded fp32 division and sqrt.
HIP_FLAGS = ["-ffp-contract=off", "-fno-gpu-flush-denormals-to-zero", "-fhip-fp32-correctly-rounded-divide-sqrt"]


def _function_body(asm: str, name: str) -> str:
    m = re.search(rf"^{re.escape(name)}:[^\n]*\n(.*?)^\.Lfunc_end", asm, re.S | re.M)
    assert m, f"kernel {name} not found in the assembly"
    return m.group(1)


@needs_clang
@needs_hip_headers
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_hip_compiles(tmp_path, arch):
    out = tmp_path / f"instantiate_{arch}.s"
    _run(_hip_cmd(arch, out, "-S", *HIP_FLAGS))
    asm = out.read_text()
    hw = _function_body(asm, "fp4_hardware_kernel")
    n_cvt = hw.count("v_cvt_scalef32_pk_fp4_f32")
    if arch == "gfx950":
        assert n_cvt == 16, f"gfx950: expected 16 V_CVT_SCALEF32_PK_FP4_F32 in the hardware kernel, got {n_cvt}"
    else:
        assert "v_cvt_scalef32_pk_fp4_f32" not in asm, "gfx942 has no FP4 convert: the emulation must be used"
        assert hw.count("global_store") >= 1
    # The emulated policies never use the instruction, on either target.
    assert "v_cvt_scalef32_pk_fp4_f32" not in _function_body(asm, "fp4_emulated_kernel")


_ARITH_CONTRACT = re.compile(r"= (?:fadd|fsub|fmul|fdiv) contract|@llvm\.(?:fma|fmuladd)\.|sqrt[^\n]*contract|!fpmath")


@needs_clang
@needs_hip_headers
def test_hip_ir_has_no_contraction(tmp_path):
    # With the SPEC flags: nothing in the whole translation unit may be fused or approximated.
    ll = tmp_path / "strict.ll"
    _run(_hip_cmd("gfx942", ll, "-S", "-emit-llvm", *HIP_FLAGS))
    bad = _ARITH_CONTRACT.findall(ll.read_text())
    assert not bad, f"contractible / approximate fp32 arithmetic in the IR: {sorted(set(bad))}"
    # With HIP's default (-ffp-contract=fast-honor-pragmas), the header's own operations still carry no
    # `contract` flag (they sit under `#pragma clang fp contract(off)`).
    ll = tmp_path / "default.ll"
    _run(_hip_cmd("gfx942", ll, "-S", "-emit-llvm"))
    m = re.search(r"define[^\n]*@no_contract_kernel\(.*?\n}\n", ll.read_text(), re.S)
    assert m, "no_contract_kernel not found in the IR"
    bad = _ARITH_CONTRACT.findall(m.group(0))
    assert not bad, f"header arithmetic is contractible under the default flags: {sorted(set(bad))}"

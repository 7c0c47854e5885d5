"""Build checks of the DeepSeek-V4 kernels' translation unit (kernels/cuda/compress.cu: SPEC §7.6 compress_kv, §7.7
rope_rotate_quant) with nvcc and the project's flags (tools/build_native.py nvcc_flags: --fmad=false, no fast
math), for sm_90a and sm_100a; nothing runs:
- the PTX holds no fused multiply-add on f32 (SPEC §0.1; the header's own check is tests/test_header_builds.py);
- ptxas reports every kernel with no spill and no stack frame (the compress kernels keep up to ~250 registers for
  the large windows, K = 128 / 256, by design: see kernels/cuda/compress.cu; rope_rotate_quant's large-call instances
  hold a row of 128 fp32 values a thread within 168 registers).
The HIP side of the same sources is checked by tests/test_hip_build.py.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import build_native as bn  # noqa: E402

NVCC = bn.find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA_HOME, PATH, /usr/local/cuda/bin)")
TU = REPO / "kernels" / "cuda" / "compress.cu"
# rope_rotate_quant (kernels/cuda/rotate_body.cuh): per D, the small-call instance (16 values a lane, 32 for D = 1024;
# the output mode chosen at run time: -1) and the large-call instances (64 values a lane), one per output mode but
# FP8 e4m3fnuz (0-2 FP4 threshold / rne / hardware, 3 FP8 e4m3fn, 5 bf16/fp16).
ROTATE_INSTANCES = {128: (16, 64), 256: (16, 64), 512: (16, 64), 1024: (32, 64)}
# compress_kv: <K, D, range mode> (0 one range a block; 1 one range a warp, for K <= 8 and D = 128; 2 and 3 the
# column split in clusters of 4 and of 8 blocks, for K >= 128, sm_90 on).
KERNELS = {f"compress_kv_kernel<{k}, {d}, 0>" for k in (4, 8, 128, 256) for d in (128, 512)} | \
          {f"compress_kv_kernel<{k}, 128, 1>" for k in (4, 8)} | \
          {f"compress_kv_kernel<{k}, {d}, {m}>" for k in (128, 256) for d in (128, 512) for m in (2, 3)} | \
          {f"rope_rotate_kernel<{d}, {s}, -1>" for d, (s, _) in ROTATE_INSTANCES.items()} | \
          {f"rope_rotate_kernel<{d}, {v}, {m}>" for d, (_, v) in ROTATE_INSTANCES.items() for m in (0, 1, 2, 3, 5)}


# (arch, kernel) -> the most (stack, spill stores, spill loads) bytes accepted: sm_100a's column-split instance of the
# overlapping ratio-128 windows sits at 255 registers with one 4-byte spill (its pool holds 16 window rows a thread).
ACCEPTED_SPILLS: dict = {}


def _flags() -> list[str]:
    return [f for f in bn.nvcc_flags() if not f.startswith("-gencode")]


def _demangled(name: str) -> str:
    m = re.match(r"_ZN5dsqv4\d+(\w+?_kernel)I", name)
    if not m:
        return name
    args = [a.replace("n", "-") for a in re.findall(r"Li(n?[0-9]+)E", name)]   # Itanium: n1 is -1
    return f"{m.group(1)}<{', '.join(args)}>"


@pytest.fixture(scope="module", params=["90a", "100a"])
def built(request, tmp_path_factory):
    arch = request.param
    out = tmp_path_factory.mktemp(f"v4_{arch}")
    cmd = [NVCC, *_flags(), f"-gencode=arch=compute_{arch},code=[sm_{arch},compute_{arch}]", "-Xptxas", "-v",
           "--keep", f"--keep-dir={out}", "-c", str(TU), "-o", str(out / "v4.o")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr}"
    assert "warning" not in res.stderr.lower().replace("ptxas info", ""), res.stderr
    ptx = next(out.glob("*.ptx")).read_text()
    return arch, ptx, res.stderr


def test_ptx_has_no_fused_multiply_add(built):
    """No f32 multiply-add outside inline PTX (the fused operations the code asks for, platform.h fma_explicit: the
    division of dsq::pool_weights and the Hadamard exchange of rope_rotate_quant)."""
    arch, ptx, _ = built
    outside = re.sub(r"// begin inline asm.*?// end inline asm", "", ptx, flags=re.S)
    assert "fma.rn.f32" in ptx and len(outside) < len(ptx)
    fused = re.findall(r"\b(?:fma|mad)\.[a-z.]*f32\b", outside)
    assert not fused, f"sm_{arch}: fused f32 multiply-add in the PTX: {sorted(set(fused))}"
    assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx and "mul.rn.f32" in ptx


def test_every_kernel_without_spills(built):
    arch, _, log = built
    found = {}
    for m in re.finditer(r"Compiling entry function '(\w+)' for 'sm_\w+'\n(?:.*\n)*?.*?(\d+) bytes stack frame, "
                         r"(\d+) bytes spill stores, (\d+) bytes spill loads\n.*?Used (\d+) registers", log):
        found[_demangled(m.group(1))] = tuple(int(x) for x in m.group(2, 3, 4, 5))
    print(f"\nsm_{arch}: kernel (stack, spill stores, spill loads, registers)")
    for k in sorted(found):
        print(f"  {k:34} {found[k]}")
    assert set(found) == KERNELS, sorted(found)
    bad = {k: v for k, v in found.items() if any(x > y for x, y in zip(v[:3], ACCEPTED_SPILLS.get((arch, k), (0, 0, 0))))}
    assert not bad, f"sm_{arch}: stack or spills: {bad}"

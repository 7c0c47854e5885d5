"""HIP build checks, on any machine: nothing runs on a GPU.

tools/build_hip.py hipifies kernels/cuda/* and src/capi.cpp (torch.utils.hipify) into build/hip/ and compiles
every HIP translation unit, device pass only, for gfx942 (MI300) and gfx950 (MI355) with clang-22 (or
$DSAQUANT_HIP_CLANG) against Triton's HIP headers (or ROCm's), plus the host passes. Checked here:
- the HIP sources are generated, never committed, and differ from the CUDA sources only by hipify's renames and
  kernels/hip/hipify_extra.map's (every changed line is explained; the renames used are the reviewed list);
- the device passes never see a CUDA-only path (__CUDA_ARCH__ undefined; the header's DSQ_HIP_DEVICE set);
- the gfx950 assembly of every kernel that encodes FP4 pairs holds V_CVT_SCALEF32_PK_FP4_F32, gfx942 none, and no
  kernel uses a hardware FP8 convert (SPEC §2, §8);
- no kernel uses scratch, spills, calls or leaves a device-library reference; fp32 denormals are kept and rounding
  is to nearest even (FloatMode), wave64; cross-lane traffic is ds_bpermute (HIP's plain shuffles), no traps;
- no compiler warnings; every compile carries the SPEC §0 flags;
- the full build's commands (one fat binary per TU with both archs, the C interface as host C++, shared link) work
  with clang-22 on the two small TUs (no ROCm here, so the link leaves out amdhip64 and the result is not imported).
The per-kernel VGPR/AGPR/SGPR/occupancy/LDS/scratch table is printed (pytest -s, or on failure).
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import build_hip as bh  # noqa: E402

ARCHS = ["gfx942", "gfx950"]
CLANG = bh.find_clang()
HIP = bh.find_hip_headers()
HAS_TORCH = importlib.util.find_spec("torch") is not None   # its files: torch/utils/hipify (torch is not imported)

needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch (torch.utils.hipify) not installed")
needs_toolchain = pytest.mark.skipif(
    CLANG is None or HIP is None or not HAS_TORCH,
    reason="needs clang-22 (or $DSAQUANT_HIP_CLANG), HIP headers (ROCm or triton/backends/amd/include) and torch; "
           f"found clang={CLANG}, hip headers={HIP}, torch={HAS_TORCH}")

# Every rename the HIP translation may make (CUDA name -> HIP name), reviewed. A new CUDA API in kernels/cuda
# fails test_hipified_lines_differ_only_by_the_mapping until it is added here after checking its HIP meaning.
REVIEWED_RENAMES = {
    "cuda_runtime.h": "hip/hip_runtime.h",
    "cuda_bf16.h": "hip/hip_bf16.h",
    "cuda_fp16.h": "hip/hip_fp16.h",
    "cudaStream_t": "hipStream_t",
    "cudaError_t": "hipError_t",
    "cudaGetLastError": "hipGetLastError",
    "cudaGetErrorString": "hipGetErrorString",
    "cudaErrorInvalidValue": "hipErrorInvalidValue",   # kernels/cuda/compress.cu: a K or D without a kernel (both 1)
    "__shfl_xor_sync": "dsq_shfl_xor_sync",   # kernels/hip/hipify_extra.map -> platform_hip.h
    "__shfl_sync": "dsq_shfl_sync",
    "__shfl_up_sync": "dsq_shfl_up_sync",
    "__shfl_down_sync": "dsq_shfl_down_sync",
    "cudaSuccess": "hipSuccess",
    # kernels/cuda/device.h and src/capi.cpp: the op's device made current for the launch, its properties read.
    "cudaSetDevice": "hipSetDevice",
    "cudaErrorInvalidDevice": "hipErrorInvalidDevice",
    "cudaDeviceGetAttribute": "hipDeviceGetAttribute",
    "cudaDeviceAttr": "hipDeviceAttribute_t",
    "cudaDevAttrMultiProcessorCount": "hipDeviceAttributeMultiprocessorCount",
    "cudaDevAttrComputeCapabilityMajor": "hipDeviceAttributeComputeCapabilityMajor",
    "cudaDevAttrComputeCapabilityMinor": "hipDeviceAttributeComputeCapabilityMinor",
    "cudaGetDevice": "hipGetDevice",   # also kernels/cuda/device.h
    # kernels/cuda/indexer.cu prefer_shared_memory: inside #if !defined(__HIP__) (the cp.async row ring is
    # NVIDIA's), so these are translated but never compiled for AMD.
    "cudaStreamCaptureStatus": "hipStreamCaptureStatus",
    "cudaStreamCaptureStatusNone": "hipStreamCaptureStatusNone",
    "cudaStreamIsCapturing": "hipStreamIsCapturing",
    "cudaFuncSetAttribute": "hipFuncSetAttribute",
    "cudaFuncAttributePreferredSharedMemoryCarveout": "hipFuncAttributePreferredSharedMemoryCarveout",
    "cudaFuncAttributeMaxDynamicSharedMemorySize": "hipFuncAttributeMaxDynamicSharedMemorySize",   # same meaning
    "cudaMemsetAsync": "hipMemsetAsync",   # (dst, value, bytes, stream): same order and meaning
    # kernels/cuda/selfcheck.cu dsq_kernel_code_query (dsq_kernel_code): the attributes of a kernel on the current
    # device; on AMD its ptxVersion/binaryVersion are the HIP runtime's, and dsaquant.info reads them only on NVIDIA.
    "cudaFuncAttributes": "hipFuncAttributes",
    "cudaFuncGetAttributes": "hipFuncGetAttributes",
}


# ---- the translation ---------------------------------------------------------------------------------------
def _repo_files() -> list[str]:
    """Tracked files plus untracked ones git would pick up (not ignored)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [f for f in out.stdout.splitlines() if (REPO / f).is_file()]


def test_no_generated_hip_source_is_committed():
    files = _repo_files()
    # The names hipify gives its outputs: X.cu -> X.hip, headers keep theirs, capi.cpp -> capi_hip.cpp.
    generated = {Path(c).stem + ".hip" if c.endswith(".cu") else Path(c).name for c in bh.cuda_sources()
                 if c.startswith("kernels/cuda/")} | {"capi_hip.cpp"}
    bad = [f for f in files if Path(f).name in generated and not f.startswith("kernels/cuda/")]
    for f in files:
        if f.endswith((".h", ".cuh", ".cpp", ".cu", ".hip")):
            with open(REPO / f, encoding="utf-8", errors="replace") as fh:
                if fh.readline().startswith("// !!! This is a file automatically generated by hipify"):
                    bad.append(f)
    assert not bad, f"generated HIP sources in the repository (they belong in build/): {bad}"
    assert "kernels/hip/platform_hip.h" in files and "kernels/hip/hipify_extra.map" in files
    ignored = subprocess.run(["git", "check-ignore", "-q", "build/hip/x"], cwd=REPO).returncode == 0
    assert ignored, "build/ must be ignored by git (the HIP sources are generated there)"


def _expected_hip_line(line: str, tree: "bh.Tree") -> tuple[str, set]:
    """The CUDA line after hipify's own token renames, its header path rewrite and hipify_extra.map; and the
    renames that fired."""
    hp = bh.load_hipify()
    used = set()

    def rename(m):
        used.add((m.group(0), hp.PYTORCH_MAP[m.group(0)]))
        return hp.PYTORCH_MAP[m.group(0)]

    out = hp.RE_PYTORCH_PREPROCESSOR.sub(rename, "\n" + line + "\n")[1:-1]
    project_headers = {Path(c).name: Path(h).name for c, h in tree.files.items() if c.startswith("kernels/cuda/")
                       and not c.endswith(".cu")}
    out = re.sub(r'#include "([^"/]+)"', lambda m: f'#include "../hip/{project_headers[m.group(1)]}"'
                 if m.group(1) in project_headers else m.group(0), out)
    for cuda, hip in bh.read_extra_map().items():
        if re.search(rf"(?<![\w]){re.escape(cuda)}(?![\w])", out):
            used.add((cuda, hip))
    return bh.apply_extra_map(out, bh.read_extra_map()), used


@needs_torch
def test_hipified_lines_differ_only_by_the_mapping():
    tree = bh.hipify()
    diffs = bh.diff_lines(tree)   # also asserts that every line keeps its number
    assert diffs, "hipify changed nothing: the translation did not run"
    used, unexplained = set(), []
    for rel, hip_rel, n, cuda_line, hip_line in diffs:
        expected, fired = _expected_hip_line(cuda_line, tree)
        used |= fired
        if expected != hip_line:
            unexplained.append(f"{rel}:{n}\n  cuda: {cuda_line}\n  hip:  {hip_line}\n  want: {expected}")
    print(f"\n{len(diffs)} lines changed by the HIP translation:")
    for rel, hip_rel, n, cuda_line, hip_line in diffs:
        print(f"  {rel}:{n}: {cuda_line.strip()}  ->  {hip_line.strip()}")
    assert not unexplained, "lines changed beyond the mapping:\n" + "\n".join(unexplained)
    unreviewed = {(c, h) for c, h in used if REVIEWED_RENAMES.get(c) != h}
    assert not unreviewed, f"renames not in REVIEWED_RENAMES (check their HIP meaning first): {sorted(unreviewed)}"
    # The shared header is included as it is, never translated.
    assert not any(c.startswith("src/include") for c in tree.files)


@needs_torch
def test_no_warp_builtin_left_unmapped():
    tree = bh.hipify()
    for p in tree.generated():
        code = "\n".join(line.split("//", 1)[0] for line in p.read_text().splitlines())
        found = sorted({m.group(1) for m in bh.UNMAPPED_WARP.finditer(code)})
        assert not found, f"{p.name}: {found} (HIP's *_sync builtins check 64-bit wave masks; see platform_hip.h)"
    lanes = (tree.include_dir / "lanes.cuh").read_text()
    assert "dsq_shfl_xor_sync(mask, v, s, LANES)" in lanes


def test_refusal_of_unmapped_warp_votes():
    assert bh.UNMAPPED_WARP.search("  unsigned b = __ballot_sync(0xFFFFFFFFu, p);")
    assert bh.UNMAPPED_WARP.search("  if (lane < warpSize) x = 1;")
    assert not bh.UNMAPPED_WARP.search("  return dsq_shfl_xor_sync(mask, v, s, LANES);")


def test_full_build_without_rocm_fails_clearly(monkeypatch, tmp_path):
    if bh.find_rocm() is not None:
        pytest.skip("ROCm present: the full build is exercised by ci/workflows/amd.yml")
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))
    monkeypatch.delenv("DSAQUANT_HIP_CXX", raising=False)
    with pytest.raises(RuntimeError, match="no ROCm toolchain"):
        bh.build_module(out=tmp_path / "libdsaquant_hip.so")


def test_isa_version_numbers():
    assert bh._isa_version("gfx942") == 9402 and bh._isa_version("gfx950") == 9500 and bh._isa_version("gfx90a") == 9010
    assert bh.FP8_FLAVOUR == {"gfx942": "e4m3fnuz", "gfx950": "e4m3fn"}   # SPEC §4


# ---- device-only compile --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dev():
    return bh.device_only(ARCHS)


@pytest.fixture(scope="module")
def rows(dev):
    rows = bh.isa_report(dev)
    print(f"\nHIP kernels ({'cached build' if dev.cached else f'built in {dev.seconds:.1f} s'}; device libraries: "
          f"{dev.devlibs}{'; stubbed: ' + ', '.join(dev.stubs) if dev.stubs else ''}):")
    print(bh.resource_table(rows))
    return rows


@needs_toolchain
def test_every_tu_compiles_for_every_arch_without_warnings(dev):
    assert sorted(dev.asm) == sorted((a, t) for a in ARCHS for t in ("compress", "fp4_selfcheck", "indexer",
                                                                     "kstore_qpack", "qpack", "selfcheck", "topk"))
    for s in dev.asm.values():
        assert s.stat().st_size > 0
    warnings = (dev.out / "warnings.txt").read_text()
    assert not warnings.strip(), warnings
    assert (dev.out / "host" / "capi_hip.syntax").exists()


@needs_toolchain
def test_every_compile_uses_the_spec_flags(dev):
    for cmd in dev.commands:
        args = cmd.split()
        assert not any(f in args for f in bh.FORBIDDEN_FLAGS), cmd
        assert "-ffp-contract=off" in args, cmd
        if "--cuda-device-only" in args:
            assert all(f in args for f in bh.SPEC_FLAGS), cmd
            assert any(a.startswith("--rocm-path") or a.startswith("--rocm-device-lib-path") for a in args), \
                f"device pass without device libraries (ockl calls would stay calls): {cmd}"


@needs_toolchain
@pytest.mark.parametrize("arch", ARCHS)
def test_device_pass_takes_no_cuda_path(dev, arch):
    for (a, tu), path in dev.macros.items():
        if a != arch:
            continue
        macros = dict(re.findall(r"^#define (\w+)(?:\(.*?\))?(?: (.*))?$", path.read_text(), re.M))
        where = f"{arch} {tu}"
        assert "DSQ_HIP_DEVICE" in macros, where
        for cuda_only in ("__CUDA_ARCH__", "DSQ_CUDA_DEVICE", "__CUDACC__", "__NVCC__", "__CUDA_FP8_H__",
                          "__CUDA_BF16_H__", "__CUDA_FP16_H__", "__FAST_MATH__"):
            assert cuda_only not in macros, f"{where}: {cuda_only} is defined in the HIP device pass"
        assert ("__gfx950__" in macros) == (arch == "gfx950"), where
        assert f"__{arch}__" in macros, where


@needs_toolchain
def test_fp4_instruction_only_on_gfx950_and_only_for_fp4_kernels(rows):
    fp4 = [r for r in rows if bh.encodes_fp4_pairs(r["label"])]
    assert fp4 and len(fp4) < len(rows)
    for r in rows:
        where = f"{r['arch']} {r['label']}"
        if r["arch"] == "gfx950" and bh.encodes_fp4_pairs(r["label"]):
            # fp4_quant8: 4 pairs per lane, unrolled; the policy is a runtime argument, so the emulation is there too.
            assert r["fp4_cvt"] >= bh.min_fp4_cvt(r["label"]), f"{where}: {r['fp4_cvt']} {bh.FP4_CVT}"
        else:
            assert r["fp4_cvt"] == 0, f"{where}: {r['fp4_cvt']} {bh.FP4_CVT}"
        assert r["fp8_cvt"] == 0, f"{where}: a hardware FP8 convert (SPEC §8: AMD encodes FP8 in software)"
    n950 = sum(r["fp4_cvt"] for r in rows if r["arch"] == "gfx950")
    assert n950 > 0 and sum(r["fp4_cvt"] for r in rows if r["arch"] == "gfx942") == 0


@needs_toolchain
def test_no_scratch_spills_or_calls(rows):
    bad = [b for b in bh.check_isa(rows)]
    assert not bad, "\n".join(bad)
    assert all(r["scratch"] == 0 and r["scratch_comment"] == 0 for r in rows)
    assert all(r["vgpr_spill"] == 0 for r in rows)
    assert all(r["sgpr_spill"] == 0 for r in rows if not r["label"].startswith(bh.SGPR_SPILL_OK))   # (to VGPR lanes)
    # The kernels keep everything in registers and shuffles, except compress_kv (kernels/cuda/compress_body.cuh
    # CompressSmem: the pooled row passes from the block's pool to warp 0's finish through 2 KB of LDS) and
    # the indexer (kernels/cuda/indexer.cu: a k block shares the 256 norm weights and biases through 1 KB;
    # the q rows' cp.async ring is NVIDIA-only).
    # the top-k selection (kernels/cuda/topk.cu) counts a 4096-bin histogram in static LDS (16 KB); its sorting
    # kernels take their buffer (4096 64-bit words and 4 histograms of 256 bins) as dynamic LDS, which the ISA
    # does not count; rope_rotate_quant (kernels/cuda/rotate_body.cuh RotateSmem) shares its block's RoPE table, 2 KB.
    lds_cap = {"compress_kv": 2048, "indexer": 1024, "topk": 16384 + 1024, "rope_rotate": 2048}
    dynamic = ("topk_row_kernel", "topk_finish_kernel")
    for r in rows:
        cap = next((v for k, v in lds_cap.items() if r["label"].startswith(k)), 0)
        if r["label"].startswith(dynamic):
            assert r["lds"] == 0, (r["label"], r["lds"])
        else:
            assert (0 < r["lds"] <= cap) if cap else r["lds"] == 0, (r["label"], r["lds"])


@needs_toolchain
def test_float_mode_wave64_and_launch_bounds(rows):
    for r in rows:
        where = f"{r['arch']} {r['label']}"
        assert r["wave"] == 64, where
        assert r["float_mode"] & 0xF == 0, f"{where}: FloatMode {r['float_mode']}: not round-to-nearest-even"
        assert (r["float_mode"] >> 4) & 3 == 3, f"{where}: FloatMode {r['float_mode']}: fp32 denormals flushed"
        if r["label"] != "fp8_selfcheck_kernel":   # rope_rotate_quant's blocks (rotate_body.cuh) and the k writers'
            want = 128 if r["label"].startswith(("rope_rotate", "kstore")) else 256   # (kstore_qpack.cu): 128 threads
            assert r["max_wg"] == want, f"{where}: __launch_bounds__({want}) lost ({r['max_wg']})"


@needs_toolchain
def test_cross_lane_traffic_is_plain_bpermute(dev):
    for (arch, tu), s in dev.asm.items():
        text = s.read_text()
        if tu == "fp4_selfcheck":   # hand-written, no shuffles
            continue
        assert "s_trap" not in text, f"{arch} {tu}: a trap (HIP's mask-checking *_sync builtins assert)"
        assert text.count("ds_bpermute_b32") > 0, f"{arch} {tu}: no shuffles?"


@needs_toolchain
def test_full_build_pipeline_smoke(tmp_path):
    """The full build's commands (fat binary for both archs, the C interface as host C++, shared link) with clang-22
    and Triton's headers, on the two small TUs; linked without amdhip64 (absent here), so it is not loaded. The
    library exports the C interface (dsaquant/abi.h) and no Python entry point."""
    if not (Path(CLANG).resolve().parent / "ld.lld").exists() and not bh._exe("ld.lld"):
        pytest.skip("no ld.lld (lld-22) to link the device code objects")
    libs, _ = bh.device_lib_flags(CLANG, HIP, ARCHS)
    stubs, _ = bh.stub_flags(bh.hipify(), HIP)
    so = bh.build_module(out=tmp_path / "libdsaquant_hip_smoke.so", archs=ARCHS, cxx=CLANG, rocm=HIP, device_libs=libs + stubs,
                         only=["selfcheck", "fp4_selfcheck"], runtime=False)
    blob = so.read_bytes()
    for arch in ARCHS:
        assert f"hipv4-amdgcn-amd-amdhsa--{arch}".encode() in blob, f"no {arch} code object in the fat binary"
    nm = next((t for t in map(bh._exe, [Path(CLANG).resolve().parent / "llvm-nm", "llvm-nm", "nm"]) if t), None)
    if nm is None:
        pytest.skip("no nm to list the module's symbols")
    defined = subprocess.run([nm, "-D", "--defined-only", str(so)], capture_output=True, text=True).stdout
    undefined = subprocess.run([nm, "-D", "--undefined-only", str(so)], capture_output=True, text=True).stdout
    for sym in ("dsq_indexer", "dsq_kstore", "dsq_qpack", "dsq_compress_kv", "dsq_rope_rotate_quant",
                "dsq_fp8_selfcheck", "dsq_exp_ds", "dsq_abi_version", "dsq_abi_sizeof", "dsq_abi_field",
                "dsq_error_string"):
        assert re.search(rf" T {sym}$", defined, re.M), f"{sym} is not exported"
    assert not re.search(r"\bPyInit_|\bPy[A-Z]\w+", defined + undefined), "Python symbols in the library"
    assert re.search(r" T dsq_hip_fp4_selfcheck$", defined, re.M)
    hip_syms = set(re.findall(r"\b((?:__)?hip\w+)", undefined))
    assert {"hipLaunchKernel", "hipGetLastError", "__hipRegisterFatBinary", "hipGetDevice", "hipSetDevice"} <= \
        hip_syms, sorted(hip_syms)
    assert not re.search(r"\b(?:c10|at|torch)\w*::|_ZN3c10|_ZN2at", undefined), "libtorch symbols in the module"

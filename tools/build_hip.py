"""HIP build of the compiled backend for AMD Instinct MI300 (gfx942) and MI355 (gfx950), from the CUDA sources.

  python3 tools/build_hip.py                  full build if a ROCm compiler is found (or DSAQUANT_BUILD_HIP=1),
                                              else the device-only check
  python3 tools/build_hip.py --build          full build: python/dsaquant/libdsaquant_hip.so (needs ROCm)
  python3 tools/build_hip.py --device-only    hipify + device-only compile of every TU for every arch (any
                                              clang >= 19 with HIP headers, e.g. clang-22 + Triton's headers),
                                              plus the host passes; prints the kernels' register/LDS/scratch table
  python3 tools/build_hip.py --hipify-only    only the translation; prints the directory of the HIP sources

Steps (see kernels/hip/README.md), each cached under build/hip/ by a hash of everything it reads:
 1. hipify. kernels/cuda/*.cu|*.cuh|*.h and src/capi.cpp are copied to build/hip/tree-<key>/ and translated by
    torch's hipify (torch.utils.hipify.hipify_python): *.cu -> kernels/hip/*.hip, headers -> kernels/hip/*,
    src/capi.cpp -> src/capi_hip.cpp. Then kernels/hip/hipify_extra.map renames the CUDA warp shuffles to
    kernels/hip/platform_hip.h's, and sources that use warp votes/masks (wave64 differs) are refused.
    Nothing generated is ever written outside build/.
 2. compile, with the SPEC §0 flags (-ffp-contract=off -fno-gpu-flush-denormals-to-zero
    -fhip-fp32-correctly-rounded-divide-sqrt; never fast-math), kernels/hip/platform_hip.h force-included:
    device-only: each .hip to gfx assembly (-S) per arch, its device-pass macros (-E -dM), and the host passes;
    full: objects for all archs in one fat binary, the C interface (src/capi.cpp) as host C++, linked with amdhip64
    only: a plain shared library (no Python headers, no libtorch) loaded with ctypes.

Environment:
  DSAQUANT_HIP_ARCHS  semicolon list, default "gfx942;gfx950"
  DSAQUANT_BUILD_HIP  "1": full build required (fails without ROCm); "0": never the full build; unset: auto
  ROCM_PATH, HIP_PATH ROCm root (default /opt/rocm)
  DSAQUANT_HIP_CXX    compiler for the full build (default <rocm>/llvm/bin/clang++, then amdclang++, hipcc)
  DSAQUANT_HIP_CLANG  clang for the device-only check (default clang-22, then ROCm's clang)
  DSAQUANT_HIP_HEADERS directory holding include/hip/hip_runtime.h for the device-only check (default: ROCm,
                      then triton/backends/amd)
FP8 flavour by arch (SPEC §4; the Python glue passes the one the user chose): gfx942 e4m3fnuz, gfx950 e4m3fn.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CUDA_DIR = ROOT / "kernels" / "cuda"
HIP_DIR = ROOT / "kernels" / "hip"
INCLUDE = ROOT / "src" / "include"
PLATFORM_HEADER = HIP_DIR / "platform_hip.h"
EXTRA_MAP = HIP_DIR / "hipify_extra.map"
BINDINGS = "src/capi.cpp"        # the C interface (src/include/dsaquant/abi.h), compiled as host C++
LIBRARY = "libdsaquant_hip.so"   # the file name python/dsaquant/backends/hip.py loads
# Hand-written HIP translation units, compiled and linked with the hipified ones (kernels/hip/README.md).
HIP_ONLY_TUS = [HIP_DIR / "fp4_selfcheck.hip"]
BUILD = ROOT / "build" / "hip"
DEFAULT_ARCHS = ("gfx942", "gfx950")
FP8_FLAVOUR = {"gfx942": "e4m3fnuz", "gfx950": "e4m3fn"}   # SPEC §4: the arch's native flavour
# SPEC §0.1 / §0.6: no contraction, denormals kept, correctly rounded fp32 division and sqrt.
SPEC_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-gpu-flush-denormals-to-zero",
              "-fhip-fp32-correctly-rounded-divide-sqrt"]
HOST_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off"]   # host passes: the device-only flags do not apply
FORBIDDEN_FLAGS = ("-ffast-math", "-fgpu-flush-denormals-to-zero", "-fno-hip-fp32-correctly-rounded-divide-sqrt",
                   "-ffp-contract=fast", "-funsafe-math-optimizations", "-fgpu-approx-transcendentals")
# Warp-level CUDA builtins whose HIP meaning differs on a 64-lane wave (mask width, vote width): a kernel that
# uses one needs a deliberate HIP version in kernels/hip/platform_hip.h, so the build refuses them.
UNMAPPED_WARP = re.compile(r"(?<![\w])(__ballot_sync|__any_sync|__all_sync|__uni_sync|__activemask|__syncwarp|"
                           r"__match_any_sync|__match_all_sync|__reduce_\w+_sync|__shfl\w*_sync|__ballot|__any|"
                           r"__all|warpSize|__lanemask_\w+)(?![\w])")
# Headers the kernels include but do not use (hipify maps cuda_bf16.h/cuda_fp16.h to these); Triton's HIP headers
# lack them, so the device-only check may replace them with empty stubs. A full build uses ROCm's.
STUBBABLE = ("hip/hip_bf16.h", "hip/hip_fp16.h")


def _rel(p: Path) -> Path:
    return p.relative_to(ROOT) if p.is_relative_to(ROOT) else p


def log(msg: str) -> None:
    print(f"[build_hip] {msg}", flush=True)


# ---- inputs and cache keys -------------------------------------------------------------------------------
# NVIDIA-only sources: the decode scorer and the prefill logits are written for sm_90a's wgmma; AMD scores with the
# Triton kernels.
NVIDIA_ONLY = {"scorer.cu", "scorer.h", "scorer_body.cuh", "quad.cuh", "sm90_layer.cuh", "wgmma.cuh", "ptx.cuh", "prefill.cu", "prefill.h", "prefill_body.cuh"}


def cuda_sources() -> list[str]:
    """The translated sources, relative to the repository root."""
    files = sorted(p for p in CUDA_DIR.iterdir()
                   if p.is_file() and p.suffix in (".cu", ".cuh", ".h") and p.name not in NVIDIA_ONLY)
    return [p.relative_to(ROOT).as_posix() for p in files] + [BINDINGS]


def _digest(paths, *extra) -> str:
    h = hashlib.sha256()
    for p in paths:
        p = Path(p)
        h.update(str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p).encode())
        h.update(p.read_bytes())
    for e in extra:
        h.update(repr(e).encode())
    return h.hexdigest()[:16]


def _prune(build: Path, prefix: str, keep: Path, n: int = 3) -> None:
    """Keep the n most recent cache directories build/<prefix>-* (and `keep`); remove the older ones."""
    old = sorted((d for d in build.glob(f"{prefix}-*") if d.is_dir() and d != keep and ".tmp" not in d.name),
                 key=lambda d: d.stat().st_mtime, reverse=True)
    for d in old[n - 1:]:
        shutil.rmtree(d, ignore_errors=True)


def _hipify_dir() -> Path:
    """torch/utils/hipify of the installed torch, found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("torch (which ships torch.utils.hipify) is not installed; the HIP build needs its files "
                           "(with `python -m build`, use --no-isolation)")
    return Path(list(spec.submodule_search_locations)[0]) / "utils" / "hipify"


def load_hipify():
    """torch.utils.hipify.hipify_python. Its package imports nothing from torch, so it is loaded from its files
    under a private name: no `import torch` (seconds, and a GPU runtime) just to translate sources."""
    if "torch.utils.hipify.hipify_python" in sys.modules:
        return sys.modules["torch.utils.hipify.hipify_python"]
    name = "_dsq_torch_hipify"
    if name + ".hipify_python" not in sys.modules:
        d = _hipify_dir()
        spec = importlib.util.spec_from_file_location(name, d / "__init__.py", submodule_search_locations=[str(d)])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[name] = pkg
        spec.loader.exec_module(pkg)
        importlib.import_module(name + ".hipify_python")
    return sys.modules[name + ".hipify_python"]


def _torch_version() -> str:
    """Keys the hipify cache: the mapping tables' bytes (they are all hipify's behaviour)."""
    d = _hipify_dir()
    return _digest([d / "hipify_python.py", d / "cuda_to_hip_mappings.py", d / "constants.py"])


def read_extra_map(path: Path = EXTRA_MAP) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            cuda, hip = line.split()
            out[cuda] = hip
    return out


def apply_extra_map(text: str, extra: dict[str, str]) -> str:
    for cuda, hip in extra.items():
        text = re.sub(rf"(?<![\w]){re.escape(cuda)}(?![\w])", hip, text)
    return text


# ---- step 1: hipify ---------------------------------------------------------------------------------------
@dataclass
class Tree:
    root: Path
    files: dict          # CUDA source (repo-relative) -> hipified file (tree-relative)

    @property
    def tus(self) -> list[Path]:
        """The kernel translation units (*.hip), in build order (largest first)."""
        tus = [self.root / h for c, h in self.files.items() if c.endswith(".cu")]
        return sorted(tus, key=lambda p: -p.stat().st_size)

    @property
    def all_tus(self) -> list[Path]:
        """The hipified kernel TUs and the hand-written HIP ones."""
        return self.tus + list(HIP_ONLY_TUS)

    @property
    def capi(self) -> Path:
        return self.root / self.files[BINDINGS]

    @property
    def include_dir(self) -> Path:
        return self.root / "kernels" / "hip"

    def generated(self) -> list[Path]:
        return [self.root / h for h in self.files.values()]


def hipify(build: Path = BUILD) -> Tree:
    """Translate the CUDA sources into build/hip/tree-<key> (cached by a hash of the inputs)."""
    sources = cuda_sources()
    key = _digest([ROOT / s for s in sources] + [EXTRA_MAP, Path(__file__).resolve()], _torch_version())
    tree = build / f"tree-{key}"
    stamp = tree / "hipify.json"
    if stamp.exists():
        return Tree(tree, json.loads(stamp.read_text()))
    tmp = build / f"tree-{key}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for rel in sources:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / rel, tmp / rel)
    hipify_python = load_hipify()
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        result = hipify_python.hipify(project_directory=str(tmp), output_directory=str(tmp),
                                      includes=[str(tmp / rel) for rel in sources],
                                      header_include_dirs=["kernels/cuda"], is_pytorch_extension=True,
                                      hip_clang_launch=True, show_progress=False, show_detailed=False)
    files = {}
    for rel in sources:
        res = result.get(str(tmp / rel))
        out = getattr(res, "hipified_path", None)
        if not out or Path(out).resolve() == (tmp / rel).resolve():
            raise RuntimeError(f"hipify produced no HIP file for {rel}:\n{sink.getvalue()}")
        files[rel] = Path(out).resolve().relative_to(tmp.resolve()).as_posix()
    extra = read_extra_map()
    problems = []
    for rel, hip_rel in files.items():
        p = tmp / hip_rel
        text = apply_extra_map(p.read_text(), extra)
        p.write_text(text)
        for n, line in enumerate(text.splitlines(), 1):
            code = line.split("//", 1)[0]
            for m in UNMAPPED_WARP.finditer(code):
                problems.append(f"{hip_rel}:{n}: {m.group(1)} (from {rel})")
    if problems:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError("warp-level builtins without a wave64 mapping (add one to kernels/hip/platform_hip.h and "
                           "kernels/hip/hipify_extra.map):\n  " + "\n  ".join(problems))
    (tmp / "hipify.json").write_text(json.dumps(files, indent=1))
    shutil.rmtree(tree, ignore_errors=True)
    os.replace(tmp, tree)
    _prune(build, "tree", tree)
    log(f"hipified {len(files)} files into {_rel(tree)}")
    return Tree(tree, files)


def diff_lines(tree: Tree) -> list[tuple[str, str, int, str, str]]:
    """Every line that differs between a CUDA source and its HIP translation, as (cuda file, hip file, CUDA line
    number, CUDA line, HIP line). hipify's two header lines (its breadcrumb comment and, in .hip files, the
    hip_runtime.h include) are left out; every other line keeps its number (asserted)."""
    out = []
    for rel, hip_rel in tree.files.items():
        a = (ROOT / rel).read_text().splitlines()
        b = (tree.root / hip_rel).read_text().splitlines()
        if b and b[0].startswith("// !!! This is a file automatically generated by hipify"):
            b = b[1:]
        if len(b) == len(a) + 1 and b[0] == '#include "hip/hip_runtime.h"':
            b = b[1:]
        if len(a) != len(b):
            raise AssertionError(f"{hip_rel}: {len(b)} lines after hipify's header, {rel} has {len(a)}")
        out += [(rel, hip_rel, i + 1, x, y) for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return out


# ---- toolchains -----------------------------------------------------------------------------------------
def _exe(p) -> str | None:
    if not p:
        return None
    p = shutil.which(str(p)) if os.sep not in str(p) else str(p)
    return p if p and os.path.isfile(p) and os.access(p, os.X_OK) else None


def find_rocm() -> Path | None:
    for cand in (os.environ.get("ROCM_PATH"), os.environ.get("HIP_PATH"), "/opt/rocm"):
        if cand and (Path(cand) / "include" / "hip" / "hip_runtime.h").exists():
            return Path(cand)
    return None


def find_hip_cxx(rocm: Path | None) -> str | None:
    """The full build's compiler: ROCm's clang++ (amdclang++), else hipcc."""
    env = os.environ.get("DSAQUANT_HIP_CXX")
    if env:
        return _exe(env)
    cands = []
    if rocm:
        cands += [rocm / "llvm" / "bin" / "clang++", rocm / "bin" / "amdclang++", rocm / "bin" / "hipcc"]
    cands += ["amdclang++", "hipcc"]
    return next((e for e in map(_exe, cands) if e), None)


def find_clang() -> str | None:
    """The device-only check's clang (needs gfx950 support: clang >= 19)."""
    env = os.environ.get("DSAQUANT_HIP_CLANG")
    if env:
        return _exe(env)
    cands = ["clang-22", "/usr/bin/clang-22", "/usr/lib/llvm-22/bin/clang"]
    rocm = find_rocm()
    if rocm:
        cands.append(rocm / "llvm" / "bin" / "clang")
    return next((e for e in map(_exe, cands) if e), None)


def triton_hip_dir() -> Path | None:
    spec = importlib.util.find_spec("triton")
    if spec and spec.origin:
        amd = Path(spec.origin).parent / "backends" / "amd"
        if (amd / "include" / "hip" / "hip_runtime.h").exists():
            return amd
    return None


def find_hip_headers() -> Path | None:
    """A directory holding include/hip/hip_runtime.h: DSAQUANT_HIP_HEADERS, ROCm, or Triton's copy."""
    env = os.environ.get("DSAQUANT_HIP_HEADERS")
    if env:
        return Path(env) if (Path(env) / "include" / "hip" / "hip_runtime.h").exists() else None
    return find_rocm() or triton_hip_dir()


def archs_from_env() -> list[str]:
    return [a.strip() for a in os.environ.get("DSAQUANT_HIP_ARCHS", ";".join(DEFAULT_ARCHS)).split(";") if a.strip()]


def _run(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{what} failed (rc {res.returncode}):\n{' '.join(map(str, cmd))}\n{res.stdout}{res.stderr}")
    return res


def _tool_id(exe: str) -> str:
    return subprocess.run([exe, "--version"], capture_output=True, text=True).stdout


def _isa_version(arch: str) -> int:
    """oclc ISA version number of a gfx name: gfx942 -> 9402, gfx950 -> 9500, gfx90a -> 9010."""
    m = re.fullmatch(r"gfx(\d+)([0-9a-f])([0-9a-f])", arch)
    if not m:
        raise ValueError(f"unrecognised arch {arch!r}")
    return int(m.group(1)) * 1000 + int(m.group(2), 16) * 100 + int(m.group(3), 16)


def device_lib_flags(clang: str, hip: Path, archs: list[str], build: Path = BUILD) -> tuple[list[str], str]:
    """How the device pass gets the ROCm device libraries (ockl/ocml: threadIdx and friends are ockl calls that
    must be inlined for the register counts to mean anything). ROCm: --rocm-path. Triton's HIP headers: its
    ockl.bc/ocml.bc plus the oclc control libraries (one constant each) generated here, in ROCm's layout, so
    the driver links exactly what a ROCm build links (oclc_correctly_rounded_sqrt_on, ..._unsafe_math_off,
    wavefrontsize64_on, isa_version_<arch>, abi_version_<n>). Returns (flags, description)."""
    for root in (hip, find_rocm()):
        if not root:
            continue
        if (root / "amdgcn" / "bitcode" / "ocml.bc").exists():
            return [f"--rocm-path={root}"], f"ROCm device libraries ({root}/amdgcn/bitcode)"
        found = sorted(root.glob("lib/llvm/lib/clang/*/lib/amdgcn/bitcode/ocml.bc")) + \
            sorted(root.glob("llvm/lib/clang/*/lib/amdgcn/bitcode/ocml.bc"))
        if found:
            return [f"--rocm-path={root}", f"--rocm-device-lib-path={found[-1].parent}"], \
                f"ROCm device libraries ({found[-1].parent})"
    lib = hip / "lib"
    if not ((lib / "ocml.bc").exists() and (lib / "ockl.bc").exists()):
        return ["-nogpulib"], "none (-nogpulib: ockl calls stay calls; resource counts are not meaningful)"
    key = _digest([lib / "ocml.bc", lib / "ockl.bc"], _tool_id(clang), sorted(set(archs) | set(DEFAULT_ARCHS)))
    out = build / f"devlibs-{key}"
    if not (out / ".done").exists():
        tmp = build / f"devlibs-{key}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        shutil.copyfile(lib / "ocml.bc", tmp / "ocml.bc")
        shutil.copyfile(lib / "ockl.bc", tmp / "ockl.bc")
        ll = _run([clang, "-x", "hip", "--offload-arch=gfx942", "--cuda-device-only", "-nogpulib", f"--hip-path={hip}",
                   "-S", "-emit-llvm", "-o", "-", "/dev/null"], "reading the amdgcn data layout").stdout
        layout = re.search(r'^target datalayout = ".*"$', ll, re.M).group(0)
        consts = {"opencl": None}   # clang requires an opencl library to exist; HIP never links it
        for on, val in (("on", 1), ("off", 0)):
            for name, var in (("finite_only", "__oclc_finite_only_opt"), ("unsafe_math", "__oclc_unsafe_math_opt"),
                              ("daz_opt", "__oclc_daz_opt"), ("correctly_rounded_sqrt", "__oclc_correctly_rounded_sqrt32"),
                              ("wavefrontsize64", "__oclc_wavefrontsize64")):
                consts[f"oclc_{name}_{on}"] = (var, "i8", val)
        for a in sorted(set(archs) | set(DEFAULT_ARCHS)):
            consts[f"oclc_isa_version_{a[3:]}"] = ("__oclc_ISA_version", "i32", _isa_version(a))
        for v in (400, 500, 600):
            consts[f"oclc_abi_version_{v}"] = ("__oclc_ABI_version", "i32", v)
        as_ = _exe(Path(clang).resolve().parent / "llvm-as")
        for name, c in consts.items():
            text = f'{layout}\ntarget triple = "amdgcn-amd-amdhsa"\n'
            if c:
                var, ty, val = c
                text += (f"@{var} = linkonce_odr hidden local_unnamed_addr addrspace(4) constant {ty} {val}, "
                         f"align {1 if ty == 'i8' else 4}\n")
            (tmp / f"{name}.ll").write_text(text)
            if as_:
                _run([as_, tmp / f"{name}.ll", "-o", tmp / f"{name}.bc"], "llvm-as")
            else:
                _run([clang, "--target=amdgcn-amd-amdhsa", "-nogpulib", "-x", "ir", "-c", "-emit-llvm", tmp / f"{name}.ll",
                      "-o", tmp / f"{name}.bc"], "clang -x ir")
            (tmp / f"{name}.ll").unlink()
        (tmp / ".done").write_text("")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    return [f"--rocm-device-lib-path={out}"], f"Triton's ocml/ockl + generated oclc controls ({_rel(out)})"


def stub_flags(tree: Tree, hip: Path, build: Path = BUILD) -> tuple[list[str], list[str]]:
    """Empty stand-ins for STUBBABLE headers the HIP headers in use lack (Triton's). Returns (flags, stubbed)."""
    wanted = set()
    for p in tree.generated():
        wanted |= set(re.findall(r"#include\s*<([^>]+)>", p.read_text()))
    missing = sorted(h for h in wanted if h.startswith("hip/") and not (hip / "include" / h).exists())
    bad = [h for h in missing if h not in STUBBABLE]
    if bad:
        raise RuntimeError(f"HIP headers {bad} are not in {hip}/include (use ROCm: set ROCM_PATH)")
    if not missing:
        return [], []
    d = build / "stub-include"
    for h in missing:
        (d / h).parent.mkdir(parents=True, exist_ok=True)
        (d / h).write_text(f"// Empty stand-in for <{h}> (tools/build_hip.py, device-only check): the kernels include it\n"
                           "// but use none of its types; a full ROCm build includes the real header.\n#pragma once\n")
    return [f"-I{d}"], missing


# ---- step 2a: device-only compile -----------------------------------------------------------------------------
@dataclass
class DeviceBuild:
    out: Path
    archs: list[str]
    asm: dict = field(default_factory=dict)      # (arch, tu name) -> .s path
    macros: dict = field(default_factory=dict)   # (arch, tu name) -> -dM output path
    commands: list = field(default_factory=list)
    stubs: list = field(default_factory=list)
    devlibs: str = ""
    seconds: float = 0.0
    cached: bool = False


def device_only(archs: list[str] | None = None, clang: str | None = None, hip: Path | None = None,
                build: Path = BUILD, jobs: int | None = None) -> DeviceBuild:
    """hipify, then compile every HIP TU for every arch, device pass only, to assembly; the device pass's macros;
    the host passes (each .hip, and the C interface as host C++). Cached by a hash of all inputs."""
    t0 = time.time()
    archs = archs or archs_from_env()
    clang = clang or find_clang()
    hip = hip or find_hip_headers()
    if clang is None:
        raise RuntimeError("no clang for the device-only check (clang-22, or set DSAQUANT_HIP_CLANG)")
    if hip is None:
        raise RuntimeError("no HIP headers (ROCm, or triton/backends/amd/include; set DSAQUANT_HIP_HEADERS)")
    tree = hipify(build)
    lib_flags, lib_desc = device_lib_flags(clang, hip, archs, build)
    stubs, stubbed = stub_flags(tree, hip, build)

    incs = ["-include", str(PLATFORM_HEADER), f"-I{INCLUDE}", f"-I{tree.include_dir}", *stubs]
    hip_version = (hip / "include" / "hip" / "hip_version.h")
    key = _digest(sorted(INCLUDE.rglob("*.h")) + [PLATFORM_HEADER, Path(__file__).resolve(), *HIP_ONLY_TUS] +
                  ([hip_version] if hip_version.exists() else []),
                  tree.root.name, _tool_id(clang), str(hip), archs, lib_flags, stubbed, SPEC_FLAGS)
    out = build / f"device-{key}"
    res = DeviceBuild(out=out, archs=archs, stubs=stubbed, devlibs=lib_desc)
    jobs_list = []   # (kind, arch, name, cmd, output)
    for arch in archs:
        for tu in tree.all_tus:
            base = ["-x", "hip", f"--offload-arch={arch}", "--cuda-device-only", *SPEC_FLAGS, f"--hip-path={hip}",
                    *lib_flags, *incs, "-Wall"]
            s = out / arch / (tu.stem + ".s")
            m = out / arch / (tu.stem + ".macros")
            res.asm[(arch, tu.stem)] = s
            res.macros[(arch, tu.stem)] = m
            jobs_list.append(("asm", arch, tu.stem, [clang, *base, "-S", str(tu), "-o", str(s)], s))
            jobs_list.append(("macros", arch, tu.stem, [clang, *base, "-E", "-dM", str(tu), "-o", str(m)], m))
    offload = [f"--offload-arch={a}" for a in archs]
    for tu in tree.all_tus:
        o = out / "host" / (tu.stem + ".o")
        jobs_list.append(("host", "host", tu.stem, [clang, "-x", "hip", *offload, "--cuda-host-only", "-nogpulib",
                                                   *HOST_FLAGS, "-fPIC", f"--hip-path={hip}", *incs, "-Wall", "-c",
                                                   str(tu), "-o", str(o)], o))
    o = out / "host" / "capi_hip.syntax"
    jobs_list.append(("host", "host", "capi_hip",
                      [clang, "-x", "c++", *HOST_FLAGS, "-fsyntax-only", "-D__HIP_PLATFORM_AMD__=1",
                       f"-isystem{hip / 'include'}", *incs, "-Wall", str(tree.capi)], o))
    res.commands = [" ".join(map(str, j[3])) for j in jobs_list]
    if (out / "done.json").exists():
        res.cached = True
        res.seconds = time.time() - t0
        return res
    for d in {j[4].parent for j in jobs_list}:
        d.mkdir(parents=True, exist_ok=True)
    warnings = []

    def one(job):
        kind, arch, name, cmd, target = job
        r = _run(cmd, f"{kind} compile of {name} ({arch})")
        if kind == "host" and target.suffix == ".syntax":
            target.write_text("ok\n")
        if "warning:" in r.stderr:
            warnings.append(f"{name} ({arch}, {kind}):\n{r.stderr}")
        return job

    with ThreadPoolExecutor(max_workers=jobs or max(1, os.cpu_count() or 1)) as pool:
        list(pool.map(one, jobs_list))
    (out / "warnings.txt").write_text("\n".join(warnings))
    (out / "commands.txt").write_text("\n".join(res.commands) + "\n")
    res.seconds = time.time() - t0
    (out / "done.json").write_text(json.dumps({"seconds": res.seconds, "stubs": stubbed, "devlibs": lib_desc}))
    _prune(build, "device", out)
    return res


# ---- ISA report --------------------------------------------------------------------------------------------
FP4_CVT = "v_cvt_scalef32_pk_fp4_f32"


def _demangle(names: list[str], clang: str | None = None) -> dict[str, str]:
    tools = []
    if clang:
        tools.append(Path(clang).resolve().parent / "llvm-cxxfilt")
    tools += ["llvm-cxxfilt-22", "llvm-cxxfilt", "c++filt"]
    for t in map(_exe, tools):
        if t:
            r = subprocess.run([t], input="\n".join(names), capture_output=True, text=True)
            if r.returncode == 0 and len(r.stdout.splitlines()) == len(names):
                return dict(zip(names, r.stdout.splitlines()))
    return {n: n for n in names}


_DT = {"0": "f32", "1": "bf16", "2": "f16", "5": "pairs"}


def kernel_label(demangled: str) -> str:
    """A short, readable name: 'indexer fp4-rne bf16 tab=bf16 neox', 'kstore v41 bf16', 'qpack pack f16', ..."""
    m = re.search(r"(\w+_kernel)<([^>]*)>", demangled)
    if not m:
        return demangled.split("(")[0].split("::")[-1]
    name, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
    if name == "indexer_kernel":   # MODE 0 = FP8, 1..3 = FP4 with policy threshold / rne / hardware
        mode, dt, cdt, neox = args
        kind = ["fp8", "fp4-threshold", "fp4-rne", "fp4-hardware"][int(mode)]
        return f"indexer {kind} {_DT[dt]} tab={_DT[cdt]}{' neox' if neox == 'true' else ''}"
    if name == "kstore_kernel":
        dt, cdt, mode = args
        return f"kstore {['v41', 'aiter_fp4', 'dense'][int(mode)]} {_DT[dt]} tab={_DT[cdt]}"
    if name == "qpack_kernel":
        dt, mode = args
        return f"qpack {['pack', 'fq_ue8m0', 'fq_e4m3'][int(mode)]} {_DT[dt]}"
    if name == "compress_kv_kernel":   # <K, D, range mode>: 0 one range a block, 1 one range a warp
        k, d, mode = args
        return f"compress_kv K={k}{' warp-ranges' if mode == '1' else ''} D={d}"
    if name == "rope_rotate_kernel":   # <D, V, MODE>: kernels/cuda/rotate_body.cuh's output modes, -1 chosen at run time
        d, v, mode = args
        kind = {"-1": "any", "0": "fp4-threshold", "1": "fp4-rne", "2": "fp4-hardware", "3": "fp8-e4m3fn",
                "4": "fp8-e4m3fnuz", "5": "half"}[mode]
        return f"rope_rotate {kind} D={d} V={v}"
    return f"{name}<{', '.join(args)}>"


def encodes_fp4_pairs(label: str) -> bool:
    """Kernels that call dsq::e2m1_encode_pair (the gfx950 `hardware` instruction path). compress_kv stores FP4 only
    for D = 128 (SPEC §7.6)."""
    # the indexer takes its policy as a template argument: only its `hardware` kernels hold the instruction
    return (label.startswith(("indexer fp4-hardware", "kstore", "qpack pack", "fp4_hw_selfcheck", "rope_rotate any",
                              "rope_rotate fp4-hardware"))
            or (label.startswith("compress_kv") and label.endswith("D=128")))


def min_fp4_cvt(label: str) -> int:
    """Fewest V_CVT_SCALEF32_PK_FP4_F32 a gfx950 kernel that encodes FP4 pairs must hold: fp4_quant8 encodes 4
    pairs per lane (unrolled); the self-check calls the pair encoder twice (raw, canonical NaN); compress_kv
    (kernels/cuda/compress_body.cuh) holds 4 values a lane, 2 pairs; rope_rotate (kernels/cuda/rotate_body.cuh) V values
    a lane, V/2 pairs."""
    if label.startswith("fp4_hw_selfcheck") or label.startswith("compress_kv"):
        return 2
    if label.startswith("rope_rotate"):
        return int(label.split("V=")[1]) // 2
    return 4


def parse_asm(path: Path) -> list[dict]:
    """Per kernel of one assembly file: its metadata (amdhsa.kernels), 'Kernel info' comments and body counts."""
    text = path.read_text()
    kernels, cur = [], None
    meta = re.search(r"^amdhsa\.kernels:\n(.*?)^amdhsa\.", text, re.S | re.M)
    for line in (meta.group(1).splitlines() if meta else []):
        m = re.match(r"^  - \.([\w]+):\s*(.*)$", line)
        if m:
            cur = {}
            kernels.append(cur)
        m = m or re.match(r"^    \.([\w]+):\s*(.*)$", line)
        if m and cur is not None and m.group(2) != "":
            v = m.group(2).strip()
            cur[m.group(1)] = int(v) if re.fullmatch(r"-?\d+", v) else (v == "true" if v in ("true", "false") else v)
    info = {}   # the "; Kernel info:" comment block after each kernel (after its `.size name, .Lfunc_endN-name`)
    sizes = [(m.start(), m.group(1)) for m in re.finditer(r"^\s*\.size\s+(\S+), \.Lfunc_end\d+-", text, re.M)]
    for m in re.finditer(r"^; Kernel info:\n((?:;[^\n]*\n)+)", text, re.M):
        owner = [name for pos, name in sizes if pos < m.start()]
        if owner:
            vals = dict(re.findall(r"^; (\w+)\s*[:=]\s*(-?\d+)\s*$", m.group(1), re.M))
            info[owner[-1]] = {k: int(v) for k, v in vals.items()}
    out = []
    for k in kernels:
        name = k["name"]
        body = re.search(rf"^{re.escape(name)}:.*?\n(.*?)^\.Lfunc_end", text, re.S | re.M)
        body = body.group(1) if body else ""
        ki = info.get(name, {})
        out.append(dict(
            name=name, file=path.stem, sgpr=k.get("sgpr_count"), vgpr=k.get("vgpr_count"), agpr=k.get("agpr_count", 0),
            lds=k.get("group_segment_fixed_size"), scratch=k.get("private_segment_fixed_size"),
            sgpr_spill=k.get("sgpr_spill_count"), vgpr_spill=k.get("vgpr_spill_count"),
            dynamic_stack=k.get("uses_dynamic_stack"), wave=k.get("wavefront_size"),
            max_wg=k.get("max_flat_workgroup_size"), occupancy=ki.get("Occupancy"), float_mode=ki.get("FloatMode"),
            scratch_comment=ki.get("ScratchSize"), code_bytes=ki.get("codeLenInByte"),
            fp4_cvt=body.count(FP4_CVT), calls=len(re.findall(r"\bs_swappc_b64\b|\bs_call_b64\b", body)),
            ext_refs=sorted(set(re.findall(r"(__o[ck]l[a-z]?_\w+|__oclc_\w+)@", body))),
            fp8_cvt=len(re.findall(r"\bv_cvt_(?:scalef32_)?(?:pk_)?(?:fp8|bf8)\w*", body))))
    return out


def isa_report(dev: DeviceBuild, clang: str | None = None) -> list[dict]:
    """Every kernel of every arch (dicts of parse_asm plus arch, demangled and label)."""
    rows = []
    for (arch, _), s in sorted(dev.asm.items()):
        for k in parse_asm(s):
            k["arch"] = arch
            rows.append(k)
    names = sorted({r["name"] for r in rows})
    dm = _demangle(names, clang or find_clang())
    for r in rows:
        r["demangled"] = dm[r["name"]]
        r["label"] = kernel_label(r["demangled"])
    return rows


def resource_table(rows: list[dict]) -> str:
    """One line per kernel, the archs side by side: VGPR (+AGPR), SGPR, occupancy (waves/SIMD), LDS, scratch."""
    archs = sorted({r["arch"] for r in rows})
    by = {}
    for r in rows:
        by.setdefault((r["file"], r["label"]), {})[r["arch"]] = r
    head = f"{'kernel':<38}" + "".join(f" | {a:^27}" for a in archs)
    sub = f"{'':<38}" + "".join(f" | {'VGPR AGPR SGPR occ LDS scr':>27}" for _ in archs)
    lines = [head, sub, "-" * len(sub)]
    for (f, label), per in sorted(by.items()):
        cells = []
        for a in archs:
            r = per.get(a)
            cells.append(" | " + (f"{r['vgpr']:>4} {r['agpr']:>4} {r['sgpr']:>4} {r['occupancy'] or 0:>3} {r['lds']:>3} "
                                  f"{r['scratch']:>3}" if r else f"{'-':>27}").rjust(27))
        lines.append(f"{label:<38}" + "".join(cells))
    return "\n".join(lines)


# Kernels whose SGPR spills are accepted: compress_kv (kernels/cuda/compress_body.cuh) keeps more uniform 64-bit values
# (its ~30 pointer/stride arguments, window row addresses, layout offsets) than gfx9's 102 SGPRs hold; the excess goes
# to VGPR lanes (v_writelane/v_readlane), never to scratch (still checked: scratch 0, VGPR spills 0).
SGPR_SPILL_OK = ("compress_kv",)


def check_isa(rows: list[dict]) -> list[str]:
    """The ISA rules (tests/test_hip_build.py asserts the same): no scratch, spills, calls or unresolved device-library
    references; fp32 denormals kept, round to nearest even; the FP4 instruction exactly where it belongs."""
    bad = []
    for r in rows:
        where = f"{r['arch']} {r['label']} ({r['file']})"
        sgpr_spill = r["sgpr_spill"] if not r["label"].startswith(SGPR_SPILL_OK) else 0
        if r["scratch"] or r["scratch_comment"] or sgpr_spill or r["vgpr_spill"] or r["dynamic_stack"]:
            bad.append(f"{where}: scratch {r['scratch']}, spills sgpr {r['sgpr_spill']} vgpr {r['vgpr_spill']}, "
                       f"dynamic stack {r['dynamic_stack']}")
        if r["calls"] or r["ext_refs"]:
            bad.append(f"{where}: {r['calls']} calls, unresolved {r['ext_refs']}")
        if r["float_mode"] is None or (r["float_mode"] & 0xF) != 0 or ((r["float_mode"] >> 4) & 3) != 3:
            bad.append(f"{where}: FloatMode {r['float_mode']} (need round-to-nearest-even and fp32 denormals kept)")
        if r["wave"] != 64:
            bad.append(f"{where}: wavefront size {r['wave']}")
        want_cvt = r["arch"] == "gfx950" and encodes_fp4_pairs(r["label"])
        if want_cvt and r["fp4_cvt"] < min_fp4_cvt(r["label"]):
            bad.append(f"{where}: {r['fp4_cvt']} {FP4_CVT} (the `hardware` policy must use it on gfx950)")
        if not want_cvt and r["fp4_cvt"]:
            bad.append(f"{where}: {r['fp4_cvt']} {FP4_CVT} where none may be")
        if r["fp8_cvt"]:
            bad.append(f"{where}: hardware FP8 convert used (the header encodes FP8 in software on AMD, SPEC §8)")
    return bad


# ---- step 2b: full build ------------------------------------------------------------------------------------
def build_module(out: Path | None = None, archs: list[str] | None = None, cxx: str | None = None,
                 rocm: Path | None = None, build: Path = BUILD, link: bool = True,
                 device_libs: list[str] | None = None, only: list[str] | None = None, runtime: bool | str = True) -> Path:
    """libdsaquant_hip.so: every .hip for all archs (one fat binary each), the C interface as host C++, linked with
    amdhip64.
    For tests/test_hip_build.py's smoke build with clang-22 and Triton's headers (no ROCm): `device_libs` replaces
    --rocm-path in the HIP compiles, `only` limits the kernel TUs (by stem), runtime=False links without amdhip64;
    runtime="stub" links against a link-time stand-in of ROCm 7's libamdhip64.so.7 (runtime_stub), for a wheel built
    without ROCm (build_without_rocm)."""
    archs = archs or archs_from_env()
    rocm = rocm or find_rocm()
    cxx = cxx or find_hip_cxx(rocm)
    if cxx is None or rocm is None:
        raise RuntimeError("no ROCm toolchain found (need <rocm>/include/hip and amdclang++/hipcc; set ROCM_PATH)")
    out = out or ROOT / "python" / "dsaquant" / LIBRARY
    tree = hipify(build)
    is_hipcc = Path(cxx).name.startswith("hipcc")
    rocm_flag = [] if is_hipcc else [f"--rocm-path={rocm}"]
    hip_flags = rocm_flag if device_libs is None else [f"--hip-path={rocm}", *device_libs]
    incs = ["-include", str(PLATFORM_HEADER), f"-I{INCLUDE}", f"-I{tree.include_dir}"]
    key = _digest(sorted(INCLUDE.rglob("*.h")) + [PLATFORM_HEADER, Path(__file__).resolve(), *HIP_ONLY_TUS],
                  tree.root.name, _tool_id(cxx), str(rocm), archs, SPEC_FLAGS, sys.version, device_libs)
    obj_dir = build / f"full-{key}"
    obj_dir.mkdir(parents=True, exist_ok=True)
    _prune(build, "full", obj_dir)
    _check_runtime_matches_torch(rocm)
    cmds = []
    for tu in tree.all_tus:
        if only is not None and tu.stem not in only:
            continue
        cmds.append([cxx, "-x", "hip", *[f"--offload-arch={a}" for a in archs], *SPEC_FLAGS, *hip_flags, "-fPIC",
                     "-fvisibility=hidden", *incs, "-Wall", "-c", str(tu), "-o", str(obj_dir / (tu.stem + ".o"))])
    cmds.append([cxx, "-x", "c++", *HOST_FLAGS, "-fPIC", "-fvisibility=hidden", "-D__HIP_PLATFORM_AMD__=1",
                 f'-DDSQ_DEVICE_CODE="{";".join(archs)}"', f"-isystem{rocm / 'include'}", *incs, "-c", str(tree.capi),
                 "-o", str(obj_dir / "capi_hip.o")])
    for c in cmds:
        assert not any(f in c for f in FORBIDDEN_FLAGS)

    def one(cmd):
        target = Path(cmd[-1])
        if target.exists():
            return target
        tmp = target.with_suffix(f".tmp{os.getpid()}.o")
        log(" ".join(map(str, cmd[:-1] + [str(tmp)])))
        _run(cmd[:-1] + [str(tmp)], f"compiling {Path(cmd[-3]).name}")
        os.replace(tmp, target)
        return target

    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        objs = list(pool.map(one, cmds))
    if not link:
        return obj_dir
    out.parent.mkdir(parents=True, exist_ok=True)
    link_cmd = [cxx, "-shared", "-fPIC", *(rocm_flag if device_libs is None else []), *map(str, objs), "-o", str(out)]
    if runtime == "stub":
        link_cmd += [str(runtime_stub(cxx, objs, obj_dir))]
    elif runtime:
        link_cmd += [f"-L{rocm / 'lib'}", "-lamdhip64", f"-Wl,-rpath,{rocm / 'lib'}"]
    log(" ".join(link_cmd))
    _run(link_cmd, f"linking {LIBRARY}")
    return out


HIP_RUNTIME_SONAME = "libamdhip64.so.7"   # ROCm 7's HIP runtime


def runtime_stub(cc: str, objs: list[Path], build: Path) -> Path:
    """A link-time stand-in for the HIP runtime: a shared library named libamdhip64.so.7 (its SONAME) defining, as
    empty functions, the HIP symbols the objects use. Linking against it records NEEDED libamdhip64.so.7 and leaves
    those symbols to the real runtime at load time, as linking against ROCm's library does. Never shipped."""
    nm = next((t for t in map(_exe, [Path(cc).resolve().parent / "llvm-nm", "llvm-nm", "nm"]) if t), None)
    if nm is None:
        raise RuntimeError("no nm (llvm-nm or binutils) to list the HIP runtime symbols the objects use")
    names = set()
    for o in objs:
        out = _run([nm, "--undefined-only", "--format=just-symbols", str(o)], f"listing the symbols of {o}").stdout
        names |= {n.strip() for n in out.split() if re.match(r"^_*hip\w+$", n.strip())}
    d = build / "runtime-stub"
    d.mkdir(parents=True, exist_ok=True)
    src = d / "amdhip64_stub.c"
    src.write_text("/* link-time stand-in for libamdhip64.so.7 (tools/build_hip.py runtime_stub) */\n" +
                   "".join(f"void {n}(void) {{}}\n" for n in sorted(names)))
    lib = d / HIP_RUNTIME_SONAME
    _run([cc, "-x", "c", "-shared", "-fPIC", "-nostdlib", f"-Wl,-soname,{HIP_RUNTIME_SONAME}", str(src), "-o", str(lib)],
         "building the HIP runtime stub")
    return lib


def build_without_rocm(out: Path, archs: list[str] | None = None) -> Path:
    """libdsaquant_hip.so without ROCm: clang-22 (find_clang) with Triton's HIP headers and device libraries
    (device_lib_flags), every TU for every arch, linked against runtime_stub, so the library needs ROCm 7's
    libamdhip64.so.7 at load time like a ROCm build. The device code is what the ROCm compiler's clang would make
    from the same sources; the host side is the same C interface."""
    archs = archs or archs_from_env()
    clang, hip = find_clang(), find_hip_headers()
    if clang is None or hip is None:
        raise RuntimeError("building without ROCm needs clang-22 (or DSAQUANT_HIP_CLANG) and HIP headers "
                           "(triton/backends/amd, or DSAQUANT_HIP_HEADERS)")
    libs, _ = device_lib_flags(clang, hip, archs)
    stubs, _ = stub_flags(hipify(), hip)
    return build_module(out=out, archs=archs, cxx=clang, rocm=hip, device_libs=libs + stubs, runtime="stub")


def _hip_major(rocm: Path) -> int | None:
    m = re.search(r"#define HIP_VERSION_MAJOR (\d+)", (rocm / "include" / "hip" / "hip_version.h").read_text()
                  if (rocm / "include" / "hip" / "hip_version.h").exists() else "")
    return int(m.group(1)) if m else None


def _check_runtime_matches_torch(rocm: Path) -> None:
    """The module and torch must share one HIP runtime (libamdhip64.so.<major>): torch's streams are handles of its
    runtime. Warn when the ROCm we link against has another major version than torch's."""
    try:
        import torch
    except ImportError:
        return
    th = getattr(torch.version, "hip", None)
    mine = _hip_major(rocm)
    if th and mine is not None and int(th.split(".")[0]) != mine:
        log(f"WARNING: torch is built for HIP {th} but {rocm} is HIP {mine}.x: the module would load a second HIP "
            "runtime and torch's streams would be invalid in it; build against the ROCm that matches torch")


# ---- on-device check of the gfx950 FP4 instruction (kernels/hip/fp4_selfcheck.hip) ---------------------------
def run_fp4_selfcheck(module: Path | None = None, max_first: int = 32) -> int:
    """Runs dsq_hip_fp4_selfcheck (linked into libdsaquant_hip.so) on the current AMD GPU: e2m1_encode_pair under the
    `hardware` policy (V_CVT_SCALEF32_PK_FP4_F32 on gfx950) vs the emulation, 5 x 65536 x 254 pairs, raw and with
    NaN made canonical. Prints the counts and the first mismatches; returns the number of mismatches."""
    import ctypes

    import torch

    if not torch.cuda.is_available() or not getattr(torch.version, "hip", None):
        raise SystemExit("--selfcheck needs a ROCm build of torch and an AMD GPU")
    module = module or ROOT / "python" / "dsaquant" / LIBRARY
    lib = ctypes.CDLL(str(module))
    fn = lib.dsq_hip_fp4_selfcheck
    fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    arch = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
    counts = torch.zeros(2, dtype=torch.int64, device="cuda")
    first = torch.zeros(max_first, 4, dtype=torch.int32, device="cuda")
    n_first = torch.zeros(1, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    for variant in range(5):
        rc = fn(variant, counts.data_ptr(), first.data_ptr(), n_first.data_ptr(), max_first, stream)
        if rc != 0:
            raise RuntimeError(f"dsq_hip_fp4_selfcheck launch failed: hipError_t {rc}")
    torch.cuda.synchronize()
    raw, canon = (int(v) for v in counts.tolist())
    n = 5 * 65536 * 254
    print(f"{arch}: e2m1_encode_pair(hardware) vs emulation: {n:,} pairs raw: {raw} mismatches; "
          f"{n:,} pairs with canonical NaN (the kernels' path): {canon} mismatches"
          + ("" if arch == "gfx950" else " (no FP4 instruction on this arch: emulation vs emulation)"))
    import struct

    def f(bits):
        return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]

    for xe, xo, e, codes in first[: min(max_first, int(n_first.item()))].tolist():
        hw, sw, c = codes & 0xFF, (codes >> 8) & 0xFF, (codes >> 16) & 1
        scale = 2.0 ** (e - 127)
        print(f"  {'canon' if c else 'raw  '} e={e:3d} x_even={xe & 0xFFFFFFFF:#010x} (v={f(xe) / scale:.9g}) "
              f"x_odd={xo & 0xFFFFFFFF:#010x} (v={f(xo) / scale:.9g}): instruction {hw:#04x}, emulation {sw:#04x}")
    return raw + canon


# ---- command line ------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--build", action="store_true", help="full build of libdsaquant_hip.so (ROCm)")
    mode.add_argument("--device-only", action="store_true", help="device-only compile + ISA/resource check")
    mode.add_argument("--hipify-only", action="store_true", help="translate only; print the HIP source directory")
    mode.add_argument("--selfcheck", action="store_true",
                      help="run the gfx950 FP4 instruction vs emulation check on the GPU (needs the built module)")
    ap.add_argument("--archs", default=None, help='semicolon list (default $DSAQUANT_HIP_ARCHS or "gfx942;gfx950")')
    ap.add_argument("--out", type=Path, default=None, help="module path (--build)")
    ap.add_argument("--no-link", action="store_true", help="--build: objects only")
    ap.add_argument("--json", type=Path, default=None, help="--device-only: write the per-kernel report here")
    args = ap.parse_args(argv)
    archs = [a for a in (args.archs.split(";") if args.archs else archs_from_env()) if a]
    env = os.environ.get("DSAQUANT_BUILD_HIP")

    if args.selfcheck:
        return 1 if run_fp4_selfcheck(args.out) else 0
    if args.hipify_only:
        tree = hipify()
        for c, h in tree.files.items():
            print(f"{c:<28} -> {tree.root / h}")
        return 0
    full = args.build or (not args.device_only and env != "0" and (env == "1" or find_hip_cxx(find_rocm())))
    if full:
        if env == "0":
            log(f"DSAQUANT_BUILD_HIP=0: not building {LIBRARY}")
            return 0
        out = build_module(args.out, archs, link=not args.no_link)
        log(f"built {out}")
        for a in archs:
            log(f"{a}: native FP8 flavour {FP8_FLAVOUR.get(a, '?')}")
        return 0
    dev = device_only(archs)
    rows = isa_report(dev)
    print(resource_table(rows))
    log(f"{len(dev.asm)} device compiles for {', '.join(archs)} ({'cached' if dev.cached else f'{dev.seconds:.1f} s'}); "
        f"device libraries: {dev.devlibs}" + (f"; stubbed headers: {', '.join(dev.stubs)}" if dev.stubs else ""))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    bad = check_isa(rows)
    warn = (dev.out / "warnings.txt").read_text() if (dev.out / "warnings.txt").exists() else ""
    if warn.strip():
        print(warn)
        bad.append("compiler warnings (above)")
    for b in bad:
        print(f"ISA CHECK FAILED: {b}")
    return 1 if bad else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as err:
        print(f"[build_hip] ERROR: {err}", file=sys.stderr)
        sys.exit(1)

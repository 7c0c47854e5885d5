"""Builds the compiled backend modules without setuptools (setup.py calls the same functions).

  python3 tools/build_native.py cuda   -> python/dsaquant/libdsaquant_cuda.so (nvcc)

Environment: DSAQUANT_CUDA_ARCHS (default "90a;100a;compute_80": see cuda_targets), CUDA_HOME,
DSAQUANT_NVCC_EXTRA (extra flags, e.g. tuning macros of a kernel for an experiment). Flags follow SPEC §0: -O3
--fmad=false (no FMA contraction); never fast-math or FTZ. The result is a plain shared library with the C
interface of src/include/dsaquant/abi.h (loaded with ctypes: python/dsaquant/backends/abi.py). The CUDA runtime
is linked statically and neither Python nor libtorch is linked, so it serves every CPython and torch version.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CUDA_SOURCES = ["src/capi.cpp", "kernels/cuda/indexer.cu", "kernels/cuda/sglang.cu", "kernels/cuda/selfcheck.cu",
                "kernels/cuda/v4.cu", "kernels/cuda/scorer.cu", "kernels/cuda/topk.cu"]
LIBRARY = "libdsaquant_cuda.so"   # the file name python/dsaquant/backends/cuda.py loads
# Cubins for Hopper (sm_90a) and Blackwell (sm_100a), the fast paths, and compute_80 PTX that the driver compiles at
# load time for every other NVIDIA GPU from sm_80 on (docs/wheels.md: which code a GPU runs).
DEFAULT_CUDA_ARCHS = "90a;100a;compute_80"


def find_nvcc() -> str | None:
    cands = [os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"), shutil.which("nvcc") or "",
             "/usr/local/cuda/bin/nvcc"]
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def cuda_targets(spec: str | None = None) -> list[str]:
    """The device code of a build, from a DSAQUANT_CUDA_ARCHS-style list (default DEFAULT_CUDA_ARCHS): an entry
    "90a", "100f", "80" (or "sm_90a") is a cubin (machine code for that architecture, or for its family with an
    `f` suffix), "compute_80" is PTX (compiled by the driver for the GPU it meets). Returns ["sm_90a", ...,
    "compute_80"], in the order given."""
    spec = os.environ.get("DSAQUANT_CUDA_ARCHS", DEFAULT_CUDA_ARCHS) if spec is None else spec
    out = []
    for a in (a.strip() for a in spec.split(";")):
        if not a:
            continue
        t = a if a.startswith(("sm_", "compute_")) else f"sm_{a}"
        if not t.split("_", 1)[1][:2].isdigit():
            raise ValueError(f"DSAQUANT_CUDA_ARCHS: {a!r} is not an architecture (e.g. 90a, 100f, compute_80)")
        out.append(t)
    return out


def gencode_flags(targets: list[str]) -> list[str]:
    """nvcc -gencode options: sm_X -> machine code compiled from compute_X; compute_X -> PTX, embedded as is."""
    return [f"-gencode=arch=compute_{t[3:]},code={t}" if t.startswith("sm_") else f"-gencode=arch={t},code={t}"
            for t in targets]


def nvcc_flags() -> list[str]:
    targets = cuda_targets()
    # DSQ_DEVICE_CODE: the targets as text, reported by dsq_device_code() (src/capi.cpp)
    return ["-std=c++17", "-O3", "--fmad=false", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
            f"-I{ROOT / 'src/include'}", f"-I{ROOT / 'kernels/cuda'}", *gencode_flags(targets),
            f'-DDSQ_DEVICE_CODE="{";".join(targets)}"', *os.environ.get("DSAQUANT_NVCC_EXTRA", "").split()]


def build_cuda(out: Path, tmp: Path, nvcc: str, sources=CUDA_SOURCES) -> Path:
    """Compile `sources` (objects in parallel) and link the shared library at `out`."""
    tmp.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    flags = nvcc_flags()

    def compile_one(src: str) -> str:
        obj = tmp / (Path(src).name + ".o")
        cmd = [nvcc, *flags, "-c", str(ROOT / src), "-o", str(obj)]   # (an absolute src stays as it is)
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        return str(obj)

    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        objs = list(pool.map(compile_one, sources))
    subprocess.run([nvcc, *flags, "-shared", *objs, "-o", str(out)], check=True)
    return out


def library_filename(ext_name: str) -> str:
    """The file of a library extension named like a module ("dsaquant.libdsaquant_cuda" -> "dsaquant/
    libdsaquant_cuda.so"): no Python ABI suffix, since the library has none (setup.py's build_ext uses this)."""
    return os.path.join(*ext_name.split(".")) + ".so"


def py3_wheel_command():
    """setuptools' bdist_wheel tagged py3-none-<platform>: the compiled libraries link no Python, so one wheel
    serves every CPython >= 3.10 (requires-python) on its platform."""
    from setuptools.command.bdist_wheel import bdist_wheel

    class Py3Wheel(bdist_wheel):
        def get_tag(self):
            _, _, plat = super().get_tag()
            return "py3", "none", plat

    return Py3Wheel


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    what = argv[0] if argv else "cuda"
    if what != "cuda":
        raise SystemExit(f"unknown module {what!r}; expected 'cuda'")
    nvcc = find_nvcc()
    if nvcc is None:
        raise SystemExit("no nvcc found (set CUDA_HOME)")
    out = ROOT / "python" / "dsaquant" / LIBRARY
    print(f"built {build_cuda(out, ROOT / 'build' / 'native-cuda', nvcc)}")


if __name__ == "__main__":
    main()

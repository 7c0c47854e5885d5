"""Builds the compiled backend modules without setuptools (setup.py calls the same functions).

  python3 tools/build_native.py cuda   -> python/dsaquant/libdsaquant_cuda.so (nvcc)

Environment: DSAQUANT_CUDA_ARCHS (default "90a;100a"), CUDA_HOME, DSAQUANT_NVCC_EXTRA (extra flags, e.g.
tuning macros of a kernel for an experiment). Flags follow SPEC §0: -O3
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
CUDA_SOURCES = ["src/capi.cpp", "kernels/cuda/indexer.cu", "kernels/cuda/kstore_qpack.cu", "kernels/cuda/selfcheck.cu",
                "kernels/cuda/compress.cu", "kernels/cuda/scorer.cu", "kernels/cuda/topk.cu"]
LIBRARY = "libdsaquant_cuda.so"   # the file name python/dsaquant/backends/cuda.py loads


def find_nvcc() -> str | None:
    cands = [os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"), shutil.which("nvcc") or "",
             "/usr/local/cuda/bin/nvcc"]
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def nvcc_flags() -> list[str]:
    archs = [a.strip() for a in os.environ.get("DSAQUANT_CUDA_ARCHS", "90a;100a").split(";") if a.strip()]
    return ["-std=c++17", "-O3", "--fmad=false", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
            f"-I{ROOT / 'src/include'}", f"-I{ROOT / 'kernels/cuda'}", *[f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs],
            *os.environ.get("DSAQUANT_NVCC_EXTRA", "").split()]


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

"""Builds the compiled backend modules without setuptools (setup.py calls the same functions).

  python3 tools/build_native.py cuda   -> python/dsaquant/_cuda<EXT_SUFFIX> (nvcc)

Environment: DSAQUANT_CUDA_ARCHS (default "90a;100a"), CUDA_HOME, DSAQUANT_NVCC_EXTRA (extra flags, e.g.
tuning macros of a kernel for an experiment). Flags follow SPEC §0: -O3
--fmad=false (no FMA contraction); never fast-math or FTZ. The CUDA runtime is linked statically and
no libtorch is linked, so the module imports under any torch version.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CUDA_SOURCES = ["src/bindings.cpp", "kernels/cuda/indexer.cu", "kernels/cuda/sglang.cu", "kernels/cuda/selfcheck.cu",
                "kernels/cuda/v4.cu", "kernels/cuda/scorer.cu",
                "kernels/cuda/topk.cu"]


def find_nvcc() -> str | None:
    cands = [os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"), shutil.which("nvcc") or "",
             "/usr/local/cuda/bin/nvcc"]
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def nvcc_flags() -> list[str]:
    import pybind11
    archs = [a.strip() for a in os.environ.get("DSAQUANT_CUDA_ARCHS", "90a;100a").split(";") if a.strip()]
    return ["-std=c++17", "-O3", "--fmad=false", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
            f"-I{ROOT / 'src/include'}", f"-I{ROOT / 'kernels/cuda'}", f"-I{pybind11.get_include()}",
            f"-I{sysconfig.get_paths()['include']}", *[f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs],
            *os.environ.get("DSAQUANT_NVCC_EXTRA", "").split()]


def build_cuda(out: Path, tmp: Path, nvcc: str, sources=CUDA_SOURCES) -> Path:
    """Compile `sources` (objects in parallel) and link the module at `out`."""
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


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    what = argv[0] if argv else "cuda"
    if what != "cuda":
        raise SystemExit(f"unknown module {what!r}; expected 'cuda'")
    nvcc = find_nvcc()
    if nvcc is None:
        raise SystemExit("no nvcc found (set CUDA_HOME)")
    out = ROOT / "python" / "dsaquant" / ("_cuda" + sysconfig.get_config_var("EXT_SUFFIX"))
    print(f"built {build_cuda(out, ROOT / 'build' / 'native-cuda', nvcc)}")


if __name__ == "__main__":
    main()

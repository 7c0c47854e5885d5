"""Builds the compiled backend modules without setuptools (setup.py calls the same functions).

  python3 tools/build_native.py cuda   -> python/dsaquant/libdsaquant_cuda.so (nvcc)

Environment: DSAQUANT_CUDA_ARCHS (default "90a;100a;compute_80": see cuda_targets), CUDA_HOME,
DSAQUANT_NVCC_EXTRA (extra flags, e.g. tuning macros of a kernel for an experiment), DSAQUANT_OLD_GLIBC_SYMBOLS=1
(link glibc's thread/dlopen calls at their pre-2.34 versions: old_glibc_shims; ci/build_wheels.sh sets it). Flags follow SPEC §0: -O3
--fmad=false (no FMA contraction); never fast-math or FTZ. The result is a plain shared library with the C
interface of src/include/dsaquant/abi.h (loaded with ctypes: python/dsaquant/backends/abi.py). The CUDA runtime
is linked statically and neither Python nor libtorch is linked, so it serves every CPython and torch version.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CUDA_SOURCES = ["src/capi.cpp", "kernels/cuda/indexer.cu", "kernels/cuda/qpack.cu", "kernels/cuda/kstore_qpack.cu",
                "kernels/cuda/selfcheck.cu", "kernels/cuda/compress.cu", "kernels/cuda/scorer.cu", "kernels/cuda/topk.cu",
                "kernels/cuda/prefill.cu"]
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
    if os.environ.get("DSAQUANT_OLD_GLIBC_SYMBOLS") == "1":
        shims = old_glibc_shims(out, tmp / "glibc-shims")
        if shims:   # relink: the shims come first, so the references bind to their (old) versions
            subprocess.run([nvcc, *flags, "-shared", *objs, f"-L{tmp / 'glibc-shims'}", *[f"-l{n}" for n in shims],
                            "-o", str(out)], check=True)
    return out


# The libraries that held the threads, dynamic-loading and shared-memory calls before glibc 2.34 moved them into
# libc.so.6 (under new symbol versions, keeping the old ones for existing binaries).
_OLD_HOMES = (("dl", "libdl.so.2"), ("shm_", "librt.so.1"), ("pthread_", "libpthread.so.0"), ("sem_", "libpthread.so.0"))


def _glibc_version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.strip("()").split("_", 1)[1].split("."))


def _dynamic_glibc_symbols(path: str) -> list[tuple[str, str, str]]:
    """(section, version, name) of the GLIBC-versioned dynamic symbols of `path` (objdump -T); a version in
    parentheses is a non-default (compatibility) one."""
    txt = subprocess.run(["objdump", "-T", path], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\s(\*UND\*|\.\w+)\s+[0-9a-f]+\s+(\(?GLIBC_[\d.]+\)?)\s+(\S+)$", txt, re.M)


def old_glibc_shims(lib: Path, out: Path, target: tuple[int, ...] = (2, 17)) -> list[str]:
    """Link-time shims that make a relink of `lib` reference the pre-2.34 versions of glibc's thread, dlopen and
    shm calls, as a build on an old glibc does (so that the library's manylinux tag is set by what it really needs,
    not by the build machine's glibc). For each such call `lib` references at a version newer than `target` whose
    older version this glibc still provides for compatibility: a stub shared library named as its old home
    (libpthread.so.0, libdl.so.2, librt.so.1) defining it at that version. The stubs are only linked against,
    never shipped: at run time every glibc resolves those versions (in libc.so.6 from 2.34 on). Returns the -l
    names of the stubs written to `out` (none when nothing needs them)."""
    libc = subprocess.run(["gcc", "-print-file-name=libc.so.6"], capture_output=True, text=True).stdout.strip()
    if not libc or not os.path.isabs(libc):
        return []
    newer = {n for sec, v, n in _dynamic_glibc_symbols(str(lib)) if sec == "*UND*" and _glibc_version(v) > target}
    older: dict[str, str] = {}
    for _, v, n in _dynamic_glibc_symbols(libc):
        if n in newer and v.startswith("(") and _glibc_version(v) <= target:
            older[n] = min(older.get(n, v), v, key=_glibc_version)
    homes: dict[str, dict[str, list[str]]] = {}
    for n, v in older.items():
        home = next((h for prefix, h in _OLD_HOMES if n.startswith(prefix)), None)
        if home is not None:
            homes.setdefault(home, {}).setdefault(v.strip("()"), []).append(n)
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for soname, versions in sorted(homes.items()):
        name = "dsq_glibc_" + soname.split(".")[0][3:]
        c, m = out / f"{name}.c", out / f"{name}.map"
        c.write_text("".join(f"void {n}(void) {{}}\n" for ns in versions.values() for n in sorted(ns)))
        m.write_text("".join(f"{v} {{ global: {'; '.join(sorted(ns))}; }};\n" for v, ns in sorted(versions.items())))
        subprocess.run(["gcc", "-shared", "-fPIC", "-nostdlib", f"-Wl,-soname,{soname}", f"-Wl,--version-script={m}",
                        str(c), "-o", str(out / f"lib{name}.so")], check=True)
        names.append(name)
    return names


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

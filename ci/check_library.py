"""Holds a built library to what docs/wheels.md promises: the dynamic symbols it defines are exactly the C interface
(python/dsaquant/backends/abi.py: CUDA_EXPORTS / HIP_EXPORTS), and the shared libraries it needs (NEEDED) are glibc's
and the C++ runtime's only (plus the HIP runtime for AMD): never the NVIDIA driver, a shared CUDA runtime, Python or
libtorch. Also that a plugin wheel carries no grafted libraries. Prints NEEDED, the device code the library records,
and (where cuobjdump is found) the cubins and PTX it embeds.

  python3 ci/check_library.py cuda|hip PATH [--archs "90a;100a;compute_80"]

PATH: the library (.so) or a plugin wheel holding it. --archs: the device code the build was asked for (for cuda:
each must be embedded). Exits 1 on any mismatch. Needs readelf and nm (binutils)."""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
# the ctypes mirror (plain ctypes: no torch needed), loaded from its file
_spec = importlib.util.spec_from_file_location("dsaquant_abi_mirror", ROOT / "python" / "dsaquant" / "backends" / "abi.py")
abi = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(abi)

LIBRARY = {"cuda": "libdsaquant_cuda.so", "hip": "libdsaquant_hip.so"}


def needed(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def defined(path: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout
    return {m.group(1) for m in re.finditer(r" [TtDdBbRrVvWwi] (\S+)$", out, re.M)}


def find_cuobjdump() -> str | None:
    cands = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump"), shutil.which("cuobjdump")]
    try:
        import triton
        cands.append(str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"))
    except Exception:
        pass
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)


def embedded_code(path: Path) -> tuple[set[str], set[str]] | None:
    """(cubin archs, PTX archs) embedded in the library, e.g. ({"sm_90", "sm_100"}, {"sm_80"}): cuobjdump's
    --list-elf / --list-ptx (which name the architecture number, without an a/f suffix). None without cuobjdump."""
    tool = find_cuobjdump()
    if tool is None:
        return None
    elf = subprocess.run([tool, "--list-elf", str(path)], capture_output=True, text=True, check=True).stdout
    ptx = subprocess.run([tool, "--list-ptx", str(path)], capture_output=True, text=True, check=True).stdout
    print(elf + ptx, end="")
    return ({m.rstrip("af") for m in re.findall(r"\.(sm_\w+?)\.cubin", elf)},
            {m.rstrip("af") for m in re.findall(r"\.(sm_\w+?)\.ptx", ptx)})


def check(backend: str, path: Path, archs: str | None = None) -> list[str]:
    bad = []
    libs = needed(path)
    print(f"{path.name}: NEEDED {libs}")
    allowed = abi.SYSTEM_LIBRARIES | ({abi.HIP_RUNTIME} if backend == "hip" else set())
    if set(libs) - allowed:
        bad.append(f"needs {sorted(set(libs) - allowed)} (allowed: {sorted(allowed)})")
    if backend == "hip" and abi.HIP_RUNTIME not in libs:
        print(f"note: {path.name} does not link {abi.HIP_RUNTIME} (built without ROCm: not loadable on its own)")
    syms = defined(path)
    want = abi.CUDA_EXPORTS if backend == "cuda" else abi.HIP_EXPORTS
    extra = syms - want
    if backend == "hip":   # clang keeps HIP kernels (their host stubs) and the TUs' __hip_cuid_ markers visible
        extra = {s for s in extra if not re.match(abi.HIP_KERNEL_SYMBOL, s)}
    if want - syms or extra:
        bad.append(f"exports: missing {sorted(want - syms)}, unexpected {sorted(extra)}")
    if backend == "cuda":
        from build_native import cuda_targets
        targets = cuda_targets(archs)
        try:
            import ctypes
            lib = ctypes.CDLL(str(path))
            lib.dsq_device_code.restype = ctypes.c_char_p
            code = lib.dsq_device_code().decode()
            print(f"dsq_device_code(): {code}")
            if code.split(";") != targets:
                bad.append(f"dsq_device_code() is {code!r}, the build was asked for {';'.join(targets)!r}")
        except OSError as e:
            bad.append(f"does not load: {e}")
        found = embedded_code(path)
        if found is not None:
            cubins, ptx = found
            # cuobjdump names a cubin by its architecture number (sm_90 for sm_90a, sm_100 for sm_100a or sm_100f)
            want_cubins = {t.rstrip("af") for t in targets if t.startswith("sm_")}
            want_ptx = {"sm_" + t[len("compute_"):].rstrip("af") for t in targets if t.startswith("compute_")}
            if cubins != want_cubins or ptx != want_ptx:
                bad.append(f"embeds cubins {sorted(cubins)} and PTX {sorted(ptx)}; expected {sorted(want_cubins)} "
                           f"and {sorted(want_ptx)}")
        else:
            print("note: no cuobjdump here; the embedded cubins and PTX were not listed")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("backend", choices=sorted(LIBRARY))
    ap.add_argument("path", type=Path)
    ap.add_argument("--archs", default=None, help="the build's DSAQUANT_CUDA_ARCHS (default: the environment's)")
    args = ap.parse_args(argv)
    bad = []
    with tempfile.TemporaryDirectory() as tmp:
        path = args.path
        if path.suffix == ".whl":
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
                grafted = [n for n in names if ".libs/" in n]
                if grafted:
                    bad.append(f"{path.name} carries grafted libraries {grafted}")
                member = next((n for n in names if n.endswith("/" + LIBRARY[args.backend])), None)
                if member is None:
                    print(f"{path.name} holds no {LIBRARY[args.backend]}: {names}")
                    return 1
                path = Path(z.extract(member, tmp))
        bad += check(args.backend, path, args.archs)
    for b in bad:
        print(f"CHECK FAILED: {b}")
    print("library check:", "FAILED" if bad else "ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

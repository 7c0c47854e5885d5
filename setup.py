"""Build of the compiled backends; everything else about the package is in pyproject.toml.

The compiled backends are plain shared libraries with a C interface (src/include/dsaquant/abi.h), loaded with
ctypes: no Python headers, so a wheel holding them is tagged py3-none-<platform> and serves every CPython >= 3.10.
dsaquant/libdsaquant_hip.so is built from the same sources, hipified, when a ROCm toolchain is found (tools/build_hip.py):
  DSAQUANT_BUILD_HIP=0 skips it, =1 requires it, unset: built if ROCm is there; DSAQUANT_HIP_ARCHS
  (default "gfx942;gfx950"). It needs torch installed (hipify), so build wheels with --no-isolation.
dsaquant/libdsaquant_cuda.so is built with nvcc when one is found (CUDA_HOME/bin, PATH, /usr/local/cuda/bin):
  DSAQUANT_BUILD_CUDA=0 skips it, =1 requires it (the build fails without nvcc), unset: built if possible
  (a failed build then only warns, and the cuda backend is unavailable).
  DSAQUANT_CUDA_ARCHS: semicolon list, default "90a;100a;compute_80" (Hopper and Blackwell cubins, PTX for every
  other GPU from sm_80 on; docs/wheels.md).
The compile itself lives in tools/build_native.py (also runnable without setuptools).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))
from build_native import CUDA_SOURCES, build_cuda, find_nvcc, library_filename, py3_wheel_command  # noqa: E402


def _build_hip(ext_path: Path, skipped: set, name: str) -> None:
    """The ROCm build of libdsaquant_hip.so (tools/build_hip.py), as configured by DSAQUANT_BUILD_HIP."""
    mode = os.environ.get("DSAQUANT_BUILD_HIP", "auto")
    if mode == "0":
        skipped.add(name)
        return
    try:
        import build_hip
    except Exception as e:  # its hipify step needs torch
        if mode == "1":
            raise
        print(f"dsaquant: not building {name} ({e})")
        skipped.add(name)
        return
    rocm = build_hip.find_rocm()
    if mode == "auto" and (rocm is None or build_hip.find_hip_cxx(rocm) is None):
        print(f"dsaquant: not building {name} (no ROCm toolchain found)")
        skipped.add(name)
        return
    try:
        build_hip.build_module(ext_path)
    except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
        if mode == "1":
            raise
        skipped.add(name)
        print(f"dsaquant: WARNING: building {name} failed ({e}); the hip backend will be unavailable", file=sys.stderr)


class BuildExt(build_ext):
    """Builds libdsaquant_cuda.so with nvcc (and libdsaquant_hip.so with ROCm), or skips them as configured. A
    skipped or (in auto mode) failed library is dropped from the outputs, so the install goes on without it."""

    skipped: set = set()

    def _built(self):
        return [e for e in self.extensions if e.name not in self.skipped]

    def copy_extensions_to_source(self):
        self.extensions = self._built()
        super().copy_extensions_to_source()

    def get_outputs(self):
        self.extensions = self._built()
        return super().get_outputs()

    def get_output_mapping(self):
        self.extensions = self._built()
        return super().get_output_mapping()

    def get_ext_filename(self, ext_name):
        return library_filename(ext_name)

    def build_extension(self, ext):
        if ext.name == "dsaquant.libdsaquant_hip":
            return _build_hip(Path(self.get_ext_fullpath(ext.name)), self.skipped, ext.name)
        if ext.name != "dsaquant.libdsaquant_cuda":
            return super().build_extension(ext)
        mode = os.environ.get("DSAQUANT_BUILD_CUDA", "auto")
        nvcc = find_nvcc()
        if mode == "0" or (mode == "auto" and nvcc is None):
            print(f"dsaquant: not building {ext.name} ({'DSAQUANT_BUILD_CUDA=0' if mode == '0' else 'no nvcc found'})")
            self.skipped.add(ext.name)
            return
        if nvcc is None:
            raise RuntimeError("DSAQUANT_BUILD_CUDA=1 but no nvcc was found (set CUDA_HOME)")
        try:
            build_cuda(Path(self.get_ext_fullpath(ext.name)), Path(self.build_temp) / "cuda", nvcc, ext.sources)
        except (subprocess.CalledProcessError, OSError) as e:
            if mode == "1":
                raise
            self.skipped.add(ext.name)
            print(f"dsaquant: WARNING: building {ext.name} failed ({e}); the cuda backend will be unavailable",
                  file=sys.stderr)


# DSAQUANT_PURE=1: the pure-Python wheel (API, dispatcher, reference, Triton); the compiled backends then
# come from the plugin wheels (plugins/cuda13: dsaquant-cuda13), found at import.
PURE = os.environ.get("DSAQUANT_PURE", "0") == "1"
setup(ext_modules=[] if PURE else [Extension("dsaquant.libdsaquant_cuda", sources=CUDA_SOURCES),
                                   Extension("dsaquant.libdsaquant_hip", sources=["src/capi.cpp"])],
      cmdclass={"build_ext": BuildExt} if PURE else {"build_ext": BuildExt, "bdist_wheel": py3_wheel_command()})

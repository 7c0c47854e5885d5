"""Builds the dsaquant-cuda13 plugin wheel from the repository's sources (tools/build_native.py, nvcc).
Build it from a checkout: `pip wheel plugins/cuda13` (DSAQUANT_CUDA_ARCHS as for the main build), or with the
manylinux repair and the library checks: `bash ci/build_wheels.sh` (docs/wheels.md). The wheel holds
libdsaquant_cuda.so, a plain shared library (C interface, loaded with ctypes), and is tagged py3-none-<platform>."""
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO / "tools"))
from build_native import CUDA_SOURCES, build_cuda, find_nvcc, library_filename, py3_wheel_command  # noqa: E402


class BuildExt(build_ext):
    def get_ext_filename(self, ext_name):
        return library_filename(ext_name)

    def build_extension(self, ext):
        nvcc = find_nvcc()
        if nvcc is None:
            raise RuntimeError("dsaquant-cuda13 needs nvcc (set CUDA_HOME)")
        build_cuda(Path(self.get_ext_fullpath(ext.name)), Path(self.build_temp) / "cuda", nvcc, ext.sources)


# Sources are named relative to the repository root (tools/build_native.py resolves them there).
setup(ext_modules=[Extension("dsaquant_cuda13.libdsaquant_cuda", sources=list(CUDA_SOURCES))],
      cmdclass={"build_ext": BuildExt, "bdist_wheel": py3_wheel_command()})

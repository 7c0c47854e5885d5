"""Builds the dsaquant-rocm7 plugin wheel from the repository's sources (tools/build_hip.py: hipify, then the
ROCm compiler; DSAQUANT_HIP_ARCHS as for the main build). Needs ROCm and torch (for hipify) in the build
environment: `pip wheel --no-build-isolation plugins/rocm7`. The wheel holds libdsaquant_hip.so, a plain shared
library (C interface, loaded with ctypes), and is tagged py3-none-<platform>."""
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO / "tools"))
from build_native import library_filename, py3_wheel_command  # noqa: E402


class BuildExt(build_ext):
    def get_ext_filename(self, ext_name):
        return library_filename(ext_name)

    def build_extension(self, ext):
        import build_hip
        build_hip.build_module(Path(self.get_ext_fullpath(ext.name)))


setup(ext_modules=[Extension("dsaquant_rocm7.libdsaquant_hip", sources=["src/capi.cpp"])],
      cmdclass={"build_ext": BuildExt, "bdist_wheel": py3_wheel_command()})

"""Builds the dsaquant-rocm7 plugin wheel from the repository's sources (tools/build_hip.py: hipify, then the
ROCm compiler; DSAQUANT_HIP_ARCHS as for the main build). Needs torch (for hipify) in the build environment:
`pip wheel --no-build-isolation plugins/rocm7`. With ROCm (ROCM_PATH) the library links its libamdhip64; without
ROCm it is built with clang-22 and Triton's HIP headers and device libraries, linked against a link-time stand-in
of libamdhip64.so.7 (build_hip.build_without_rocm): the same NEEDED entry, resolved by ROCm 7 at load time. The
wheel holds libdsaquant_hip.so, a plain shared library (C interface, loaded with ctypes), tagged py3-none-<platform>."""
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
        out = Path(self.get_ext_fullpath(ext.name))
        rocm = build_hip.find_rocm()
        if rocm is not None and build_hip.find_hip_cxx(rocm) is not None:
            build_hip.build_module(out)
        else:
            build_hip.build_without_rocm(out)


setup(ext_modules=[Extension("dsaquant_rocm7.libdsaquant_hip", sources=["src/capi.cpp"])],
      cmdclass={"build_ext": BuildExt, "bdist_wheel": py3_wheel_command()})

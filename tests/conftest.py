"""Shared pytest fixtures, and the `slow` marker.

`slow` marks every test of the files in SLOW_FILES: those that compile kernels or headers (nvcc, clang-22,
g++, Triton AOT), run Triton kernels in the interpreter, or sweep large value sets. `pytest -m "not slow"`
is the quick subset the README documents.

Shared-header fixtures: `header_host` builds tests/cpp/header_host.cpp, a pybind11 module
over src/include/dsaquant, with g++ and the SPEC §0 flags, once per source hash (cached under
build/test_header/), and imports it.
"""
from __future__ import annotations

import importlib.util
import sysconfig
from pathlib import Path

import host_cpp
import pytest

REPO = Path(__file__).resolve().parents[1]
HEADER_DIR = REPO / "src" / "include"
TESTS_CPP = REPO / "tests" / "cpp"
SLOW_FILES = {
    "test_compile.py", "test_cuda_module.py", "test_e2m1_exhaustive.py", "test_header_builds.py",
    "test_header_host.py", "test_header_compress_host.py", "test_hip_build.py", "test_properties.py",
    "test_triton_aot.py", "test_triton_fp4_packed.py", "test_triton_quant.py", "test_triton_scorer.py",
    "test_triton_scorer_aot.py", "test_triton_compress.py", "test_compress_build.py", "test_compress_host.py", "test_wheels.py",
    "test_topk_host.py", "test_kstore_host.py", "test_prefill_host.py",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)


def _header_sources() -> list[Path]:
    return sorted((HEADER_DIR / "dsaquant").glob("*.h"))


def _build_header_host() -> Path:
    import pybind11

    return host_cpp.build([TESTS_CPP / "header_host.cpp", *_header_sources()], "test_header", "the header harness",
                          includes=(pybind11.get_include(), sysconfig.get_paths()["include"]),
                          filename="dsq_header_host" + sysconfig.get_config_var("EXT_SUFFIX"))


@pytest.fixture(scope="session")
def header_host():
    """The compiled shared-header harness module (tests/cpp/header_host.cpp)."""
    so = _build_header_host()
    spec = importlib.util.spec_from_file_location("dsq_header_host", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


HEADER_COUNTS: dict[str, list[int]] = {}


@pytest.fixture(scope="session")
def header_counts():
    """name -> [comparisons, mismatches], filled by tests/test_header_host.py, printed at the end."""
    return HEADER_COUNTS


def pytest_terminal_summary(terminalreporter):
    if not HEADER_COUNTS:
        return
    tr = terminalreporter
    tr.section("shared header vs reference")
    for name, (n, bad) in sorted(HEADER_COUNTS.items()):
        tr.write_line(f"{name:<48} {n:>12,} compared {bad:>6} mismatches")
    tot = sum(v[0] for v in HEADER_COUNTS.values())
    bad = sum(v[1] for v in HEADER_COUNTS.values())
    tr.write_line(f"{'TOTAL':<48} {tot:>12,} compared {bad:>6} mismatches")


def _drain_error_flags():
    import dsaquant
    try:
        dsaquant.check_errors()
    except dsaquant.DsaquantError:
        pass


@pytest.fixture(autouse=True)
def clean_error_state():
    """Every test starts and ends with cleared device error flags and host checks off, so a test that
    provokes a flag never leaks it into the next one."""
    import dsaquant
    _drain_error_flags()
    dsaquant.set_host_checks(False)
    yield
    dsaquant.set_host_checks(False)
    _drain_error_flags()

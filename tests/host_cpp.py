"""The host C++ test libraries of tests/cpp/ (harnesses and kernel-body emulators): `build` compiles one with g++,
cached under build/ by the hash of its sources, flags and Python version, so that each configuration is compiled
once per source state; `same_bytes` and `take_flag` are the emulator tests' comparisons."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# SPEC §0.1 / §0.6: no contraction, no fast-math, no flush-to-zero.
CXXFLAGS = ["-O2", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-Wall"]


def cxx() -> str | None:
    """The C++ compiler ($CXX or g++), or None when there is none."""
    c = os.environ.get("CXX", "g++")
    return shutil.which(c)


def build(sources: list[Path], name: str, what: str, extra_flags: tuple[str, ...] = (), includes: tuple[str, ...] = (),
          filename: str | None = None) -> Path:
    """The shared library build/<name>/<hash>/<filename> (default lib<name>.so) of sources[0] (the others: what
    it includes, for the hash, besides every shared header of src/include), compiled with CXXFLAGS + extra_flags
    and the include dirs src/include, kernels/cuda and `includes`. Raises RuntimeError naming `what` when the
    compile fails."""
    compiler = cxx() or "g++"
    flags = [*CXXFLAGS, *extra_flags, f"-I{REPO / 'src/include'}", f"-I{REPO / 'kernels/cuda'}",
             *(f"-I{d}" for d in includes)]
    h = hashlib.sha256()
    for p in [*sources, *sorted((REPO / "src" / "include" / "dsaquant").glob("*.h"))]:   # and the shared headers
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(" ".join([compiler, *flags, sys.version]).encode())
    out = REPO / "build" / name / h.hexdigest()[:16]
    so = out / (filename or f"lib{name}.so")
    if so.exists():
        return so
    out.mkdir(parents=True, exist_ok=True)
    tmp = so.with_suffix(f".tmp{os.getpid()}")
    cmd = [compiler, *flags, str(sources[0]), "-o", str(tmp)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"building {what} failed:\n{' '.join(cmd)}\n{res.stderr}")
    os.replace(tmp, so)
    return so


def emulator(sources: list[Path], name: str, what: str, flags: tuple[str, ...] = ()):
    """A kernel-body emulator of tests/cpp built with `flags` (tuning macros: each gets its own build) and loaded,
    with its common entry points typed: dsq_error_string, dsq_emu_set_order(order, seed), dsq_emu_set_slots(n).
    Skips the test when there is no C++ compiler."""
    import ctypes

    import pytest
    if cxx() is None:
        pytest.skip("no C++ compiler")
    so = build(sources, name + "".join(f.replace("-D", "_").replace("=", "") for f in flags), what, tuple(flags),
               includes=(str(REPO / "tests" / "cpp"),))
    h = ctypes.CDLL(str(so))
    h.dsq_error_string.restype = ctypes.c_char_p
    h.dsq_emu_set_order.argtypes = [ctypes.c_int, ctypes.c_uint64]
    h.dsq_emu_set_slots.argtypes = [ctypes.c_int64]
    return h


def same_bytes(name: str, got, want) -> None:
    """Asserts that two tensors hold the same bytes, naming the first that differ."""
    gb, wb = got.contiguous().view(torch.uint8).reshape(-1), want.contiguous().view(torch.uint8).reshape(-1)
    assert gb.shape == wb.shape, name
    diff = (gb != wb).nonzero().reshape(-1)
    assert diff.numel() == 0, (f"{name}: {diff.numel()} of {gb.numel()} bytes differ, first at {diff[:6].tolist()}: "
                               f"got {gb[diff[:6]].tolist()}, want {wb[diff[:6]].tolist()}")


def take_flag() -> int:
    """The CPU error flag's value (dsaquant.errors), cleared."""
    from dsaquant import errors

    f = errors.flag_tensor("cpu")
    v = int(f.item())
    f.zero_()
    return v

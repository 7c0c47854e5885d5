"""The pure-Python wheel and the CUDA 13 plugin wheel build from this tree; the plugin holds a plain shared library
(libdsaquant_cuda.so: C interface, no Python, no libtorch) and is tagged py3-none-<platform>; both installed into a
fresh virtual environment give a working `python -m dsaquant info` with the cuda backend found through the plugin,
and so do they installed for the oldest supported torch (2.4). Needs nvcc (skipped without it) and a few minutes of
CPU. The ROCm plugin wheel (built without ROCm: clang-22 and Triton's HIP headers) holds code objects for gfx942 and
gfx950 and needs libamdhip64.so.7: with DSAQUANT_TEST_ROCM_WHEEL=1 (a full HIP build of every kernel file)."""
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import build_native  # noqa: E402
from build_native import find_nvcc  # noqa: E402

from test_cuda_module import needed_libraries  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ci"))
import check_library  # noqa: E402

from dsaquant.backends import abi  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _pip(*args, env=None, python=sys.executable):
    subprocess.run([python, "-m", "pip", *args], check=True, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    if find_nvcc() is None:
        pytest.skip("no nvcc: the CUDA plugin wheel cannot be built here")
    out = tmp_path_factory.mktemp("wheels")
    env = dict(os.environ, DSAQUANT_PURE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    _pip("wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), env=env)
    # PTX only: the quickest build (no machine code), enough for what is checked here
    env = dict(os.environ, DSAQUANT_CUDA_ARCHS="compute_80", PIP_DISABLE_PIP_VERSION_CHECK="1",
               DSAQUANT_OLD_GLIBC_SYMBOLS="1")   # as ci/build_wheels.sh links it
    _pip("wheel", "plugins/cuda13", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), env=env)
    return sorted(out.glob("*.whl"))


def test_pure_wheel_has_no_compiled_code(wheels):
    pure = [w for w in wheels if w.name.startswith("dsaquant-")]
    assert len(pure) == 1 and pure[0].name.endswith("-py3-none-any.whl"), [w.name for w in wheels]


def test_plugin_is_one_wheel_for_every_python_and_links_no_torch(wheels, tmp_path):
    plugin = next(w for w in wheels if w.name.startswith("dsaquant_cuda13-"))
    assert "-py3-none-" in plugin.name and plugin.name.endswith(("_x86_64.whl", "_aarch64.whl")), plugin.name
    subprocess.run([sys.executable, "-m", "zipfile", "-e", str(plugin), str(tmp_path)], check=True)
    so = tmp_path / "dsaquant_cuda13" / "libdsaquant_cuda.so"
    assert so.is_file() and not list(tmp_path.glob("dsaquant_cuda13/*cpython*")), sorted(tmp_path.rglob("*"))
    libs = needed_libraries(str(so))
    assert not any("torch" in lib or "c10" in lib or "python" in lib or lib.startswith("libcudart") for lib in libs), \
        libs
    assert set(libs) <= abi.SYSTEM_LIBRARIES, libs   # no libcuda.so.1: the static runtime opens the driver itself
    assert check_library.check("cuda", so, "compute_80") == []
    # linked as ci/build_wheels.sh links it: no glibc symbol version newer than 2.17 (manylinux_2_17), whatever glibc
    # this machine has
    versions = {v for sec, v, _ in build_native._dynamic_glibc_symbols(str(so)) if sec == "*UND*"}
    assert max(map(build_native._glibc_version, versions)) <= (2, 17), sorted(versions)


def test_fresh_venv_install_and_info(wheels, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    torch_spec = os.environ.get("DSAQUANT_TEST_TORCH", "torch==2.13.0")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # the installed copy, not a source tree
    _pip("install", "-q", torch_spec, "numpy", python=py, env=env)
    _pip("install", "-q", "--no-deps", *map(str, wheels), python=py, env=env)
    run = subprocess.run([py, "-m", "dsaquant", "info"], capture_output=True, text=True, cwd=tmp_path, check=True,
                         env=env)
    print(run.stdout)
    assert "cuda       available" in run.stdout, run.stdout
    assert "device code: compute_80" in run.stdout, run.stdout
    where = subprocess.run([py, "-c", "import dsaquant, dsaquant_cuda13; print(dsaquant.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, check=True, env=env).stdout
    assert str(env_dir) in where, f"dsaquant was imported from {where}, not the venv"


OLD_TORCH_VENV = Path(os.environ.get("DSAQUANT_OLD_TORCH_VENV", "/tmp/dsaquant-torch-2.4.0"))


@pytest.mark.skipif(not (OLD_TORCH_VENV / "bin" / "python").exists(),
                    reason=f"no torch 2.4 environment at {OLD_TORCH_VENV} (.ci/run makes it)")
def test_oldest_torch_finds_the_plugin(wheels, tmp_path):
    """The same two wheels installed for torch 2.4 (.ci/run's environment; into a fresh target directory, so that the
    environment itself is left as it is): info finds the cuda backend in the installed plugin."""
    py = str(OLD_TORCH_VENV / "bin" / "python")
    site = tmp_path / "site"
    _pip("install", "-q", "--no-deps", "--target", str(site), *map(str, wheels), python=py)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    code = ("import torch, dsaquant; from dsaquant.backends.compiled import library; d = dsaquant.info(); "
            "print(torch.__version__, d['backends']['cuda']['available'], d['backends']['cuda'].get('device_code'), "
            "library('cuda').path)")
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, check=True).stdout
    print(out)
    version, ok, code_, path = out.split()
    assert version.startswith("2.4.") and ok == "True" and code_ == "compute_80", out
    assert path.startswith(str(site)), path


@pytest.mark.skipif(os.environ.get("DSAQUANT_TEST_ROCM_WHEEL") != "1",
                    reason="a full HIP build of every kernel file: set DSAQUANT_TEST_ROCM_WHEEL=1 (amd.yml does)")
def test_rocm_wheel_contents(tmp_path):
    """The ROCm plugin wheel built here without ROCm: one py3-none wheel holding dsaquant_rocm7/libdsaquant_hip.so
    with a code object for each of gfx942 and gfx950, the C interface exported (abi.HIP_EXPORTS), and NEEDED
    libamdhip64.so.7 beside the system libraries (the stand-in it was linked against is not in the wheel)."""
    import zipfile

    import build_hip
    if build_hip.find_clang() is None or build_hip.find_hip_headers() is None:
        pytest.skip("needs clang-22 and HIP headers (triton/backends/amd)")
    env = dict(os.environ, DSAQUANT_HIP_ARCHS="gfx942;gfx950", PIP_DISABLE_PIP_VERSION_CHECK="1")
    _pip("wheel", "plugins/rocm7", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), env=env)
    whl = next(tmp_path.glob("dsaquant_rocm7-*.whl"))
    assert "-py3-none-" in whl.name and whl.name.endswith("_x86_64.whl"), whl.name
    with zipfile.ZipFile(whl) as z:
        names = sorted(z.namelist())
        assert [n for n in names if not n.startswith("dsaquant_rocm7-0.1.0.dist-info/") and not n.endswith("/")] == \
            ["dsaquant_rocm7/__init__.py", "dsaquant_rocm7/libdsaquant_hip.so"], names
        so = Path(z.extract("dsaquant_rocm7/libdsaquant_hip.so", tmp_path / "x"))
    blob = so.read_bytes()
    for arch in ("gfx942", "gfx950"):
        assert f"hipv4-amdgcn-amd-amdhsa--{arch}".encode() in blob, f"no {arch} code object"
    assert check_library.check("hip", so) == []
    assert abi.HIP_RUNTIME in needed_libraries(str(so))

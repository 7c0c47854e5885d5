"""The pure-Python wheel and the CUDA 13 plugin wheel build from this tree; the plugin holds a plain shared library
(libdsaquant_cuda.so: C interface, no Python, no libtorch) and is tagged py3-none-<platform>; both installed into a fresh virtual environment give a working `python -m dsaquant info` with
the cuda backend found through the plugin. Needs nvcc (skipped without it) and a few minutes of CPU."""
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from build_native import find_nvcc  # noqa: E402

from test_cuda_module import needed_libraries  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(find_nvcc() is None, reason="no nvcc: the CUDA plugin wheel cannot be built here")


def _pip(*args, env=None, python=sys.executable):
    subprocess.run([python, "-m", "pip", *args], check=True, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheels")
    env = dict(os.environ, DSAQUANT_PURE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    _pip("wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), env=env)
    env = dict(os.environ, DSAQUANT_CUDA_ARCHS="90a", PIP_DISABLE_PIP_VERSION_CHECK="1")   # one arch: CI time
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


def test_fresh_venv_install_and_info(wheels, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    torch_spec = os.environ.get("DSAQUANT_TEST_TORCH", "torch==2.13.0")
    _pip("install", "-q", torch_spec, "numpy", python=py)
    _pip("install", "-q", "--no-deps", *map(str, wheels), python=py)
    run = subprocess.run([py, "-m", "dsaquant", "info"], capture_output=True, text=True, cwd=tmp_path, check=True)
    print(run.stdout)
    assert "cuda       available" in run.stdout, run.stdout
    where = subprocess.run([py, "-c", "import dsaquant, dsaquant_cuda13; print(dsaquant.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, check=True).stdout
    assert str(env_dir) in where, f"dsaquant was imported from {where}, not the venv"

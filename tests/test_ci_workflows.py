"""The CI workflow definitions (ci/workflows/*.yml) parse, every job has steps, and every repository script
a step runs exists (bash/python paths like ci/gpu_check.sh, .ci/run, tools/build_hip.py)."""
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted((ROOT / "ci" / "workflows").glob("*.yml"))
SCRIPT = re.compile(r"(?:bash|python3?|sh)\s+(?:-m\s+\S+\s+)?((?:\.ci|ci|tools|tests)/[\w./-]+)")


def test_there_are_workflows():
    names = {p.stem for p in WORKFLOWS}
    assert {"cpu", "nvidia", "wheels"} <= names, names


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_jobs_and_scripts(path):
    doc = yaml.safe_load(path.read_text())
    assert doc.get("jobs"), f"{path.name}: no jobs"
    for name, job in doc["jobs"].items():
        steps = job.get("steps") or []
        assert steps, f"{path.name}:{name} has no steps"
        for step in steps:
            for script in SCRIPT.findall(step.get("run", "") or ""):
                assert (ROOT / script).exists(), f"{path.name}:{name} runs {script}, which is not in the repo"


def _wheels_jobs():
    return yaml.safe_load((ROOT / "ci" / "workflows" / "wheels.yml").read_text())["jobs"]


def test_cuda_plugin_wheel_is_built_for_x86_64_and_aarch64():
    """wheels.yml builds the CUDA plugin wheel on an x86_64 and on an arm64 runner (GH200/GB200 hosts: NVIDIA's sbsa
    CUDA packages), each in a manylinux_2_28 image of its architecture, through ci/build_wheels.sh."""
    jobs = _wheels_jobs()
    for runner, arch, cuda in (("ubuntu-24.04", "x86_64", "x86_64"), ("ubuntu-24.04-arm", "aarch64", "sbsa")):
        job = jobs[f"cuda13-{arch}"]
        assert job["runs-on"] == runner, job["runs-on"]
        assert job["container"] == f"quay.io/pypa/manylinux_2_28_{arch}", job["container"]
        runs = "\n".join(step.get("run", "") or "" for step in job["steps"])
        assert f"cuda/repos/rhel8/{cuda}/" in runs and "cuda-nvcc-13-0" in runs
        assert "ci/build_wheels.sh" in runs and "ci/wheel_smoke.sh" in runs
        assert "compute_80" in job["env"]["DSAQUANT_CUDA_ARCHS"]


def test_wheel_install_job_covers_oldest_and_newest_torch():
    """The wheel install check (ci/wheel_install_check.sh) runs in CI, for the oldest and newest supported torch."""
    runs = "\n".join(step.get("run", "") or "" for job in _wheels_jobs().values() for step in job["steps"])
    assert "ci/wheel_install_check.sh" in runs
    script = (ROOT / "ci" / "wheel_install_check.sh").read_text()
    assert "2.4.0" in script and "2.13.0" in script

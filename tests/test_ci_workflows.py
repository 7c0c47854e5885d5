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

"""Run a test module's cases in TRITON_INTERPRET=1 worker subprocesses (shared by the Triton CPU tests).

`triton.jit` decides at import whether to interpret, so interpreter runs live in fresh processes that
re-run the test file as `python FILE --worker cases.json out.json`; the parent never sets the variable.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def selected_case_ids(request, test_file: Path) -> list[str]:
    """The `case_id` parameters of the collected tests of `test_file` in this pytest session."""
    ids = set()
    for item in request.session.items:
        cs = getattr(item, "callspec", None)
        if Path(str(item.fspath)).resolve() == test_file and cs is not None and "case_id" in cs.params:
            ids.add(cs.params["case_id"])
    return sorted(ids)


def run_workers(script: Path, shards: list[list[str]], prefix: str, timeout: int) -> dict:
    """Start one interpreter worker per shard of case ids; returns {case_id: result dict}. A worker that
    dies or times out gives each of its cases an `error` entry with the tail of its log."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")]))
    env.pop("DSAQUANT_BACKEND", None)
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    procs = []
    for w, shard in enumerate(shards):
        cin, cout = tmp / f"cases{w}.json", tmp / f"out{w}.json"
        cin.write_text(json.dumps(shard))
        log = open(tmp / f"log{w}.txt", "w")
        procs.append((subprocess.Popen([sys.executable, str(script), "--worker", str(cin), str(cout)], env=env,
                                       stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO)), cout, log, w))
    results = {}
    for p, cout, log, w in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
        if cout.exists():
            results.update(json.loads(cout.read_text()))
        else:
            tail = (tmp / f"log{w}.txt").read_text()[-4000:]
            for k in shards[w]:
                results.setdefault(k, dict(error=f"worker {w} died (rc {p.returncode}):\n{tail}"))
    return results

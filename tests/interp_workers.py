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


def run_selected(request, test_file: Path, cases: dict, cost, prefix: str, label: str) -> dict:
    """Run the selected cases of `test_file` in up to 4 interpreter workers, shards balanced by `cost(case)`
    (greedy: biggest case to the least loaded worker); returns {case_id: result dict}."""
    selected = sorted(selected_case_ids(request, test_file), key=lambda k: -cost(cases[k]))
    n_workers = max(1, min(4, os.cpu_count() or 1, len(selected)))
    shards = [[] for _ in range(n_workers)]
    loads = [0.0] * n_workers
    for k in selected:
        w = loads.index(min(loads))
        shards[w].append(k)
        loads[w] += cost(cases[k])
    results = run_workers(test_file, shards, prefix, 1800)
    total = sum(r.get("seconds", 0.0) for r in results.values())
    print(f"\n[{label}] {len(results)} cases, {total:.1f} s of worker time, {n_workers} workers")
    return results


def check_result(case_id: str, r) -> None:
    """Fail unless the worker's result for case_id compared something and found no differing byte."""
    import pytest
    assert r is not None, f"{case_id}: no result from the interpreter worker"
    assert r.get("error") is None, f"{case_id}: {r['error']}"
    assert r["compared"] > 0, f"{case_id}: nothing was compared"
    assert r["mismatches"] == 0, f"{case_id}: {r['mismatches']} of {r['compared']} differ: {r.get('detail')}"
    for note in r.get("checks_failed", []):
        pytest.fail(f"{case_id}: {note}")


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


# ---- inside a worker (TRITON_INTERPRET=1) ----------------------------------------------------------------
def run_cases(cases_path: str, out_path: str, cases: dict, run_case) -> None:
    """The worker loop: run_case(cases[id]) for each id in cases_path (JSON list), results to out_path."""
    import time
    import traceback
    import warnings

    import numpy as np
    warnings.filterwarnings("ignore")
    np.seterr(all="ignore")
    results = {}
    for cid in json.loads(Path(cases_path).read_text()):
        t0 = time.time()
        try:
            res = run_case(cases[cid])
        except Exception:
            res = dict(error=traceback.format_exc()[-3000:])
        res["seconds"] = time.time() - t0
        results[cid] = res
        print(f"{cid}: {json.dumps(res)[:300]}", flush=True)
    Path(out_path).write_text(json.dumps(results))


def torch_dtype(name):
    import torch
    return getattr(torch, name)


def clone_args(args):
    from dsaquant import testing
    return testing.clone_args(args)


def as_bytes(t):
    import torch
    flat = torch.empty(t.numel(), dtype=t.dtype)
    flat.copy_(t.detach().reshape(-1))
    return flat.view(torch.uint8)


class Tally:
    """Byte comparisons of one case: eq(name, reference tensor, triton tensor), check(ok, note), result()."""

    def __init__(self):
        self.compared = 0
        self.mismatches = 0
        self.detail = []
        self.checks_failed = []

    def eq(self, name, a, b):
        import torch
        ab, bb = as_bytes(a), as_bytes(b)
        if ab.shape != bb.shape:
            self.mismatches += max(ab.numel(), bb.numel())
            self.detail.append(f"{name}: shapes {tuple(a.shape)} vs {tuple(b.shape)}")
            return
        self.compared += ab.numel()
        bad = int((ab != bb).sum())
        if bad:
            self.mismatches += bad
            idx = torch.nonzero(ab != bb).reshape(-1)[:6].tolist()
            self.detail.append(f"{name}: {bad} bytes, first at {idx}: ref {ab[idx].tolist()} triton {bb[idx].tolist()}")

    def check(self, ok, note):
        if not ok:
            self.checks_failed.append(note)

    def result(self):
        return dict(compared=self.compared, mismatches=self.mismatches, detail="; ".join(self.detail)[:2000],
                    checks_failed=self.checks_failed, error=None)

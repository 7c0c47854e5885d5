"""kernels/cuda/scorer.cu (docs/scorer.md) builds with nvcc and the project's flags (tools/build_native.py
nvcc_flags) for sm_90a without warnings, spills or stack frames in any kernel, and exports exactly its C interface;
its build with the phase records of dev/scorer_phases.py (-DDSQ_SCORER_PHASES; whose records may spill a few
registers) builds without warnings and adds their reader; the prefetch variant (-DDSQ_SCORER_PREFETCH=1, a build to
time) builds with no warning but a few spilled registers."""
from __future__ import annotations

import pytest

from nvcc_build import REPO, build_shared, exported_functions, frames, needs_nvcc

pytestmark = needs_nvcc
TU = REPO / "kernels" / "cuda" / "scorer.cu"
INTERFACE = {"dsq_paged_mqa_logits", "dsq_paged_mqa_logits_layout"}


EXTRA = {"release": (), "phases": ("-DDSQ_SCORER_PHASES",), "prefetch": ("-DDSQ_SCORER_PREFETCH=1",)}


@pytest.fixture(scope="module", params=list(EXTRA))
def built(request, tmp_path_factory):
    so = tmp_path_factory.mktemp(f"scorer_{request.param}") / "libscorer.so"
    return request.param, so, build_shared(TU, so, "90a", EXTRA[request.param])


def test_no_warnings_spills_or_stack(built):
    kind, _, log = built
    text = log.lower().replace("ptxas info", "")
    if kind == "prefetch":   # a few spilled bytes allowed in the variant
        text = "\n".join(line for line in text.splitlines() if "registers are spilled" not in line)
    assert "warning" not in text, log
    found = frames(log)
    assert len(found) >= 30, log   # 3 layouts x 10 (H, queries a block) instances
    if kind == "release":
        assert all(f == ("0", "0", "0") for f in found), found


def test_exports_only_the_c_interface(built):
    kind, so, _ = built
    names = exported_functions(so)
    assert names == (INTERFACE | {"dsq_scorer_phases"} if kind == "phases" else INTERFACE), names

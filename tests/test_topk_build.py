"""kernels/cuda/topk.cu (docs/topk.md) builds with nvcc and the project's flags (tools/build_native.py
nvcc_flags: --fmad=false, -fvisibility=hidden) for sm_90a and sm_100a, without warnings, spills or stack
frames, and a shared library of it exports exactly its C interface (kernels/cuda/topk.h). Its host-only
functions run here (no GPU): the plan and workspace size equal the Python mirrors
(dsaquant.backends.topk_abi), and bad arguments are refused before any CUDA call."""
from __future__ import annotations

import pytest

from nvcc_build import REPO, build_shared, exported_functions, frames, needs_nvcc

pytestmark = needs_nvcc
TU = REPO / "kernels" / "cuda" / "topk.cu"


@pytest.fixture(scope="module", params=["90a", "100a"])
def built(request, tmp_path_factory):
    pytest.importorskip("pybind11")
    arch = request.param
    so = tmp_path_factory.mktemp(f"topk_{arch}") / "libtopk.so"
    return arch, so, build_shared(TU, so, arch)


def test_no_warnings_spills_or_stack(built):
    arch, _, log = built
    assert "warning" not in log.lower().replace("ptxas info", ""), log
    found = frames(log)
    assert len(found) >= 12, log                      # 3 logits dtypes x 4 kernels
    assert all(f == ("0", "0", "0") for f in found), f"sm_{arch}: {found}"


def test_exports_only_the_c_interface(built):
    names = exported_functions(built[1])
    assert {"dsq_topk_indices", "dsq_topk_workspace_bytes", "dsq_topk_plan_chunks"} <= names, names
    assert not [n for n in names if "topk_kernel" in n], names


def test_host_functions_match_the_mirror(built):
    import ctypes

    import torch

    from dsaquant.backends import topk_abi
    _, so, _ = built
    lib = ctypes.CDLL(str(so))
    plan, ws = topk_abi.host_functions(lib)
    for rows in (0, 1, 4, 16, 64, 131, 132, 500):
        for L in (0, 100, 16384, 65536, 163840, 262144, 262145, 400000):
            for k in (1, 512, 2048, 5000):
                for sms in (78, 132, 304):
                    assert plan(rows, L, k, sms) == topk_abi.plan_chunks(rows, L, k, sms), (rows, L, k, sms)
                for chunks in (0, 1, 3, 8, 40):
                    assert ws(rows, L, k, chunks) == topk_abi.workspace_bytes(rows, L, k, chunks)
    # the cached-row path while 8 blocks' caches hold a row: the fewest blocks that do, doubled while the call's
    # blocks stay within half of the SMs and a block reads at least 8192 keys, up to 16
    assert plan(64, 65536, 2048, 132) == -2 and plan(500, 32768, 2048, 132) == -1
    assert plan(16, 65536, 2048, 132) == -4 and plan(8, 32768, 2048, 132) == -4 and plan(1, 65536, 2048, 132) == -8
    assert plan(4, 163840, 2048, 132) == -16 and plan(4, 163840, 2048, 78) == -8
    assert plan(4, 262145, 2048, 132) == 33
    # past that: one block a row, or few long rows (3 blocks a row fill a wave)
    assert plan(200, 300000, 2048, 132) == 1 and plan(44, 300000, 2048, 132) == 3
    # refused before any CUDA call: no device is touched here
    x = torch.zeros(4, 10)
    ks = torch.zeros(4, dtype=torch.int32)
    out = torch.zeros(4, 5, dtype=torch.int32)
    good = dict(logits=x, k=5, context_lens=None, next_n=1, ks=ks, ke=ks, relative=False, out=out)
    for field, value in (("k", 0), ("form", 7), ("logits_dtype", 9), ("index_dtype", 0), ("next_n", 0),
                         ("rows", -1), ("L", 1 << 31), ("ks", None), ("chunks", 5000)):
        a = topk_abi.make_args(**good)
        setattr(a, field, value)
        assert topk_abi.call(lib, a, 0) == 1, field
    a = topk_abi.make_args(**good)
    a.k, a.L, a.row_stride = 10000, 9000, 9000       # min(k, L) = 9000 rounds up past DSQ_TOPK_MAX_SORT
    assert topk_abi.call(lib, a, 0) == 1
    a = topk_abi.make_args(**good)
    a.rows = 0
    assert topk_abi.call(lib, a, 0) == 0             # nothing to do, nothing launched

"""src/include/dsaquant/exact_dot.h against the reference's exact FP4 logit, bit for bit, on the host.

tests/cpp/exact_dot_host.cpp is compiled by g++ with the SPEC §0 flags (no contraction, no fast-math); it
reads a query row and key rows on stdin and writes dsq::exact_logit for each key. Random rows, the extreme
exponents (subnormal results, overflow to Inf, exponent bytes 0 and 255) and signed zeros are compared with
python/dsaquant/reference/prefill.exact_logits_block; a NaN must meet a NaN.
"""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import torch

from conftest import HEADER_DIR, REPO
from host_cpp import CXXFLAGS
from dsaquant.reference import prefill as R

SRC = REPO / "tests" / "cpp" / "exact_dot_host.cpp"


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++")
    exe = tmp_path_factory.mktemp("exact_dot") / "exact_dot_host"
    flags = [f for f in CXXFLAGS if f not in ("-shared", "-fPIC")]
    r = subprocess.run([cxx, *flags, f"-I{HEADER_DIR}", str(SRC), "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return exe


def run(exe, q, qe, w, k, ke):
    """q uint8 [H, 64], qe uint8 [H, 4], w fp32 [H], k uint8 [N, 64], ke uint8 [N, 4] -> fp32 [N] from the header."""
    H, N = q.shape[0], k.shape[0]
    rec = np.concatenate([k.numpy(), ke.numpy()], axis=1).astype(np.uint8)
    data = (np.array([H, N], np.int32).tobytes() + q.numpy().tobytes() + qe.numpy().tobytes()
            + w.numpy().astype(np.float32).tobytes() + rec.tobytes())
    r = subprocess.run([str(exe)], input=data, capture_output=True)
    assert r.returncode == 0, r.returncode
    return torch.from_numpy(np.frombuffer(r.stdout, np.float32).copy())


def reference(q, qe, w, k, ke):
    return R.exact_logits_block(R._fp4_twice_blocks(q.unsqueeze(0)), qe.unsqueeze(0),
                                R._fp4_twice_blocks(k), ke, w.unsqueeze(0))[0]


def same_bits(a, b):
    nan = torch.isnan(a) & torch.isnan(b)
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | nan).all())


@pytest.mark.parametrize("H", [16, 32, 64, 128])
@pytest.mark.parametrize("exps", ["normal", "extreme"])
def test_header_equals_reference(harness, H, exps):
    g = torch.Generator().manual_seed(H)
    N = 64
    q = torch.randint(0, 256, (H, 64), generator=g, dtype=torch.uint8)
    k = torch.randint(0, 256, (N, 64), generator=g, dtype=torch.uint8)
    if exps == "normal":
        qe = torch.randint(110, 140, (H, 4), generator=g, dtype=torch.uint8)
        ke = torch.randint(110, 140, (N, 4), generator=g, dtype=torch.uint8)
    else:   # every exponent byte, including 0 (scale 0) and 255 (NaN scale)
        qe = torch.randint(0, 256, (H, 4), generator=g, dtype=torch.uint8)
        ke = torch.randint(0, 256, (N, 4), generator=g, dtype=torch.uint8)
        ke[:8] = torch.randint(1, 4, (8, 4), generator=g, dtype=torch.uint8)      # deep in the subnormals
        k[8:12] = 0x88                                                           # -0 elements: zero dots
    w = torch.randn(H, generator=g)
    w[0] = -0.0
    got, want = run(harness, q, qe, w, k, ke), reference(q, qe, w, k, ke)
    assert same_bits(got, want), (got, want)


def test_block_values_every_exponent_sum(harness):
    """One block per head carries the value, every exponent pair (eq, ek) of a fixed q exponent sweep."""
    H = 16
    q = torch.zeros(H, 64, dtype=torch.uint8)
    q[:, 0] = 0x07                       # element 0 = 6, element 1 = 0: I = 12 * (2 * k_0)
    k = torch.zeros(256, 64, dtype=torch.uint8)
    k[:, 0] = torch.randint(1, 16, (256,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    qe = torch.arange(H, dtype=torch.uint8).mul(16).unsqueeze(1).expand(H, 4).contiguous()
    ke = torch.arange(256, dtype=torch.uint8).unsqueeze(1).expand(256, 4).contiguous()
    w = torch.ones(H)
    assert same_bits(run(harness, q, qe, w, k, ke), reference(q, qe, w, k, ke))

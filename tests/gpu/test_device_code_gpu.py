"""On an NVIDIA GPU: dsq_kernel_code names the code that runs there (a cubin where the library holds one for the
GPU, else the compute_80 PTX compiled by the driver), `dsaquant.info()` reports it, and the decode scorer's own
kernel runs exactly where the library holds sm_90a code for a 9.0 GPU (elsewhere it answers cudaErrorNotSupported
and the Triton kernel scores). docs/wheels.md."""
from __future__ import annotations

import pytest
import torch

from dsaquant import dispatch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or getattr(torch.version, "hip", None):
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
if not dispatch.available("cuda")[0]:
    pytest.skip("the cuda backend is not available", allow_module_level=True)

from dsaquant.backends import scorer  # noqa: E402
from dsaquant.backends.abi import describe_code  # noqa: E402
from dsaquant.backends.compiled import library  # noqa: E402


def cubin_for(targets: list[str], major: int, minor: int) -> str | None:
    """The cubin of `targets` the runtime runs on a major.minor GPU: sm_XYa only on X.Y, sm_XYf on X.Y' for Y' >= Y,
    sm_XY on X.Y' for Y' >= Y; None (the PTX then) where none fits."""
    for t in targets:
        if not t.startswith("sm_"):
            continue
        num, suffix = t[3:].rstrip("af"), t[3:][len(t[3:].rstrip("af")):]
        tmaj, tmin = int(num[:-1]), int(num[-1])
        if tmaj == major and (tmin == minor if suffix == "a" else tmin <= minor):
            return t
    return None


def test_kernel_code_names_the_code_that_runs():
    lib = library("cuda")
    dev = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(dev)
    err, ptx, binary = lib.kernel_code(dev)
    assert err == 0, lib.error_string(err)
    targets = lib.device_code()
    text = describe_code(targets, ptx, binary)
    want = cubin_for(targets, major, minor)
    print(f"sm_{major}{minor}: {targets} -> ptx {ptx}, binary {binary}: {text}")
    if want is not None:
        assert text == f"cubin {want}", text
    else:
        assert any(t.startswith("compute_") for t in targets), targets
        assert text == f"PTX compute_{ptx}, JIT-compiled for sm_{major}{minor}", text
    import dsaquant
    assert dsaquant.info()["backends"]["cuda"]["device_code"].endswith(f"on this GPU: {text}")


def test_scorer_kernel_only_with_sm90a_code_on_a_9_0_gpu():
    """An empty launch (B = 0) passes the scorer's code check and returns 0 where its wgmma kernel runs, and
    cudaErrorNotSupported (Triton scores) anywhere else."""
    lib = scorer.load(library("cuda").path)
    dev = torch.cuda.current_device()
    a = scorer.PagedLogitsArgs()
    a.device, a.page_size, a.H, a.B, a.N, a.max_seq_len = dev, 64, 64, 0, 1, 0
    rc = lib.dsq_paged_mqa_logits(a, torch.cuda.current_stream().cuda_stream)
    major, minor = torch.cuda.get_device_capability(dev)
    expected = 0 if (major, minor) == (9, 0) and "sm_90a" in library("cuda").device_code() else scorer.ERR_NOT_SUPPORTED
    assert rc == expected, (rc, major, minor, library("cuda").device_code())

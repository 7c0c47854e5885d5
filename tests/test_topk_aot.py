"""The Triton top-k kernel (dsaquant/triton/topk.py) compiles ahead of time, without a GPU, for sm_90 (every
stage) and gfx942 (the merge stage, which holds every code path but the chunk padding); `plan` picks the chunk
counts docs/topk.md describes. Skipped in a process running TRITON_INTERPRET=1 (no JIT kernels there)."""
from __future__ import annotations


import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402

from dsaquant.testing import triton_jit_module  # noqa: E402


def _topk():
    return triton_jit_module("topk", "_topk_kernel")


@pytest.mark.parametrize("target, stage, form, dtype", [
    (("cuda", 90, 32), 0, 2, "fp32"),
    (("cuda", 90, 32), 1, 0, "bf16"),
    (("cuda", 90, 32), 2, 1, "fp16"),
    (("hip", "gfx942", 64), 2, 0, "fp32"),
])
def test_topk_kernel_compiles(target, stage, form, dtype):
    T = _topk()
    try:
        k = T.aot_compile(GPUTarget(*target), stage, form, logits_dtype=dtype, relative=stage != 1)
    except Exception as e:   # a missing backend in this triton build is a skip, anything else a failure
        if "backend" in str(e).lower() and "not" in str(e).lower():
            pytest.skip(str(e))
        raise
    asm = k.asm.get("ptx") or k.asm.get("amdgcn") or ""
    assert asm and (k.asm.get("cubin") or k.asm.get("hsaco"))


def test_plan():
    T = _topk()
    assert T.plan(64, 65536, 2048, 132) == 5          # 2 * 132 / 64 rounded up
    assert T.plan(4, 163840, 2048, 132) == 8          # MAX_CHUNKS
    assert T.plan(132, 65536, 2048, 132) == 1         # enough rows for every multiprocessor
    assert T.plan(4, 16000, 2048, 132) == 1           # shorter than 8k
    assert T.plan(2, 40000, 2048, 132) == 4           # at least 4k per chunk
    assert T.plan(3, 10, 4, 132, chunks=50) == 10     # forced, at most L

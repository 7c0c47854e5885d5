"""topk_indices (docs/topk.md) on a GPU: every GPU backend that implements it, byte-equal to the reference
on the same CUDA tensors (skipped without CUDA/ROCm).

Shapes include the two production targets, top-2048 over [64, 65536] and over [4, 163840] fp32, both
span forms, next_n 1..4, hostile spans, k > L, k = 512 and a k that is not a power of two; values are
random normals, a coarse grid (thousands of ties at the k-th value), all-zero rows of mixed sign, and rows
sprinkled with NaN and +-inf. The Triton backend also runs with its chunk count forced (1, 2, 8), and once
from a CUDA graph. Outputs start poisoned, so an unwritten element is a mismatch. The reference on the
GPU is also held to the reference on the CPU.
"""
from __future__ import annotations

import pytest
import torch

import dsaquant as dq
from dsaquant import dispatch

from .counts import byte_diff, record

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA (or ROCm) GPU", allow_module_level=True)

DEV = torch.device("cuda")
BACKENDS = [b for b in ("triton", "cuda", "hip") if dispatch.available(b)[0] and "topk_indices" in dispatch.ops_of(b)]
POISON = -123456


def logits_of(rows, L, kind, seed, dtype=torch.float32, stride_pad=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    n = L + stride_pad
    if kind == "randn":
        x = torch.randn(rows, n, device=DEV, generator=g)
    elif kind == "ties":
        x = torch.randint(-8, 9, (rows, n), device=DEV, generator=g).float() * 0.5
    elif kind == "zeros":   # +0.0 and -0.0 only: every value ties
        x = torch.where(torch.rand(rows, n, device=DEV, generator=g) < 0.5, 0.0, -0.0)
    elif kind == "specials":
        x = torch.randn(rows, n, device=DEV, generator=g)
        pick = torch.rand(rows, n, device=DEV, generator=g)
        x = torch.where(pick < 0.05, float("nan"), x)
        x = torch.where((pick >= 0.05) & (pick < 0.07), float("inf"), x)
        x = torch.where((pick >= 0.07) & (pick < 0.3), float("-inf"), x)
    elif kind == "10lsb":   # one exponent and sign, random low mantissa bits: keys differ only in the last digit
        bits = 0x3F900000 | torch.randint(0, 1024, (rows, n), device=DEV, generator=g, dtype=torch.int32)
        x = bits.view(torch.float32)
    else:
        raise ValueError(kind)
    return x.to(dtype)[:, :L]


def forms(rows, L, form, seed, next_n=1):
    g = torch.Generator(device=DEV).manual_seed(seed + 7)
    if form == "prefill":
        ks = torch.randint(-5, L // 2, (rows,), device=DEV, generator=g, dtype=torch.int32)
        ke = ks + torch.randint(-10, L + 10, (rows,), device=DEV, generator=g, dtype=torch.int32)
        ks[0], ke[0] = 0, L
        return dict(ks=ks, ke=ke)
    B = rows // next_n
    if form == "decode2d":
        c = torch.randint(-3, L + 9, (B, next_n), device=DEV, generator=g, dtype=torch.int32)
    else:
        c = torch.randint(next_n, L + 9, (B,), device=DEV, generator=g, dtype=torch.int32)
        c[0] = L
    return dict(context_lens=c, next_n=next_n)


def check(tag, backend, x, k, kw, **knobs):
    ref = dq.topk_indices(x, k, **kw, backend="reference")
    out = torch.full((x.shape[0], k), POISON, dtype=torch.int32, device=DEV)
    if knobs:
        from dsaquant.triton import topk as T
        T.topk_indices(x, k, kw.get("context_lens"), kw.get("next_n", 1), kw.get("ks"), kw.get("ke"),
                       kw.get("relative", False), out, **knobs)
    else:
        dq.topk_indices(x, k, **kw, out=out, backend=backend)
    torch.cuda.synchronize()
    total, bad, where = byte_diff([("indices", ref, out)], backend)
    record(backend, "topk_indices", total, bad)
    assert bad == 0, f"{tag}: {bad} of {total} bytes differ: {where}"


CASES = {
    # name: (rows, L, k, kind, form, next_n, dtype)
    "v32-decode-64x65536": (64, 65536, 2048, "randn", "decode", 1, torch.float32),
    "v32-long-4x163840": (4, 163840, 2048, "randn", "decode", 1, torch.float32),
    "long-prefill-4x163840-ties": (4, 163840, 2048, "ties", "prefill", 1, torch.float32),
    "64x65536-ties": (64, 65536, 2048, "ties", "decode", 1, torch.float32),
    "64x65536-10lsb": (64, 65536, 2048, "10lsb", "decode", 1, torch.float32),
    "64x65536-specials": (64, 65536, 2048, "specials", "prefill", 1, torch.float32),
    "zeros-mixed-sign": (8, 20000, 2048, "zeros", "prefill", 1, torch.float32),
    "v4-k512-mtp2": (32, 32768, 512, "randn", "decode", 2, torch.float32),
    "mtp4-2d": (16, 9000, 2048, "specials", "decode2d", 4, torch.float32),
    "k3000": (6, 50000, 3000, "ties", "prefill", 1, torch.float32),
    "k-past-L": (10, 1000, 2048, "randn", "prefill", 1, torch.float32),
    "bf16": (16, 40000, 2048, "ties", "decode", 1, torch.bfloat16),
    "fp16": (16, 40000, 2048, "specials", "prefill", 1, torch.float16),
    "many-short-rows": (512, 4096, 2048, "randn", "decode", 1, torch.float32),
    "k20000": (4, 50000, 20000, "ties", "prefill", 1, torch.float32),   # past the Triton sort: reference path
}


@pytest.mark.parametrize("relative", [False, True])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_backend_bytes(backend, name, relative):
    rows, L, k, kind, form, next_n, dtype = CASES[name]
    x = logits_of(rows, L, kind, seed=list(CASES).index(name), dtype=dtype)
    kw = dict(forms(rows, L, form, seed=len(name), next_n=next_n), relative=relative)
    check(name, backend, x, k, kw)


@pytest.mark.parametrize("chunks", [1, 2, 8])
@pytest.mark.parametrize("name", ["v32-decode-64x65536", "long-prefill-4x163840-ties", "64x65536-specials",
                                  "k-past-L", "mtp4-2d"])
def test_triton_chunk_counts(name, chunks):
    if "triton" not in BACKENDS:
        pytest.skip("triton backend unavailable")
    rows, L, k, kind, form, next_n, dtype = CASES[name]
    x = logits_of(rows, L, kind, seed=3, dtype=dtype)
    kw = dict(forms(rows, L, form, seed=5, next_n=next_n), relative=True)
    check(f"{name}-chunks{chunks}", "triton", x, k, kw, chunks=chunks)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_rows_and_empty_shapes(backend):
    x = logits_of(8, 30000, "ties", seed=11, stride_pad=77)
    assert x.stride(0) == 30077
    check("strided", backend, x, 2048, forms(8, 30000, "prefill", seed=2))
    for rows, L in ((0, 100), (5, 0)):
        z = torch.zeros(rows, dtype=torch.int32, device=DEV)
        got = dq.topk_indices(torch.zeros(rows, L, device=DEV), 16, ks=z, ke=z + 50, backend=backend)
        assert got.shape == (rows, 16) and bool((got == -1).all())


def test_reference_gpu_equals_cpu():
    x = logits_of(8, 30000, "specials", seed=4)
    kw = forms(8, 30000, "prefill", seed=4)
    gpu = dq.topk_indices(x, 2048, **kw, backend="reference")
    cpu = dq.topk_indices(x.cpu(), 2048, **{k: v.cpu() for k, v in kw.items()}, backend="reference")
    assert torch.equal(gpu.cpu(), cpu)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_graph_replay(backend):
    """The op captured in a CUDA graph (no host sync inside), replayed on new logits."""
    x = logits_of(64, 65536, "randn", seed=1)
    ctx = torch.full((64,), 65536, dtype=torch.int32, device=DEV)
    out = torch.empty((64, 2048), dtype=torch.int32, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dq.topk_indices(x, 2048, context_lens=ctx, out=out, backend=backend)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dq.topk_indices(x, 2048, context_lens=ctx, out=out, backend=backend)
    x.copy_(logits_of(64, 65536, "ties", seed=2))
    g.replay()
    torch.cuda.synchronize()
    ref = dq.topk_indices(x, 2048, context_lens=ctx, backend="reference")
    assert torch.equal(out, ref)


# -----------------------------------------------------------------------------------------------------
# kernels/cuda/topk.cu through its C ABI (dsaquant.backends.topk_abi) in the built library, with every
# blocks-a-row count (not only the plan's), byte-equal to the reference.
# -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def topk_lib():
    import ctypes
    from dsaquant.backends.compiled import find_library
    if getattr(torch.version, "hip", None):
        pytest.skip("kernels/cuda/topk.cu is built for NVIDIA here")
    path = find_library("libdsaquant_cuda.so", "dsaquant_cuda13")
    if path is None:
        pytest.skip("the cuda library is not built")
    return ctypes.CDLL(str(path))


def run_cuda_lib(lib, x, k, kw, chunks):
    from dsaquant.backends import topk_abi
    ctx, ks, ke = kw.get("context_lens"), kw.get("ks"), kw.get("ke")
    out = torch.full((x.shape[0], k), POISON, dtype=torch.int32, device=DEV)
    if chunks == 0:   # the library's plan for this device
        plan, _ = topk_abi.host_functions(lib)
        chunks = plan(x.shape[0], x.shape[1], k, torch.cuda.get_device_properties(DEV).multi_processor_count)
    ws = torch.empty(max(1, topk_abi.workspace_bytes(x.shape[0], x.shape[1], k, chunks)), dtype=torch.uint8, device=DEV)
    a = topk_abi.make_args(x, k, ctx.contiguous() if ctx is not None else None, kw.get("next_n", 1), ks, ke,
                           kw.get("relative", False), out, workspace=ws, chunks=chunks)
    rc = topk_abi.call(lib, a, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    return rc, out


# 0: the library's plan (the cached-row path up to 8 blocks' caches); 1: one block a row; 2, 8: few long rows;
# -1 .. -16: the cached-row path in clusters of that many blocks (one block a row where they cannot hold the row)
@pytest.mark.parametrize("chunks", [0, 1, 2, 8, -1, -2, -4, -8, -16])
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_kernel_via_c_abi(topk_lib, name, chunks):
    rows, L, k, kind, form, next_n, dtype = CASES[name]
    if 1 << (min(k, L) - 1).bit_length() > 4096:
        pytest.skip("min(k, L) past DSQ_TOPK_MAX_SORT (test_cuda_kernel_rejects_large_k_without_writing)")
    x = logits_of(rows, L, kind, seed=list(CASES).index(name) + 50, dtype=dtype)
    kw = dict(forms(rows, L, form, seed=len(name) + 1, next_n=next_n), relative=chunks % 2 == 0)
    rc, out = run_cuda_lib(topk_lib, x, k, kw, chunks)
    assert rc == 0, f"dsq_topk_indices returned cudaError {rc}"
    ref = dq.topk_indices(x, k, **kw, backend="reference")
    total, bad, where = byte_diff([("indices", ref, out)], "cuda-abi")
    record("cuda-abi", "topk_indices", total, bad)
    assert bad == 0, f"{name} chunks={chunks}: {bad} of {total} bytes differ: {where}"


def test_cuda_kernel_rejects_large_k_without_writing(topk_lib):
    x = logits_of(2, 10000, "randn", seed=1)
    rc, out = run_cuda_lib(topk_lib, x, 5000, forms(2, 10000, "prefill", seed=1), 1)
    assert rc == 1 and bool((out == POISON).all())
    rc, out = run_cuda_lib(topk_lib, x[:, :0], 5000, forms(2, 0, "prefill", seed=1), 1)   # min(k, L) = 0
    assert rc == 0 and bool((out == -1).all())

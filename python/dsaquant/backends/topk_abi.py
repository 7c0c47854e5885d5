"""The Python side of kernels/cuda/topk.h: `DsqTopkArgs` as a ctypes.Structure (field for field, the
offsets held equal to the C header's by tests/test_topk_abi.py) and `make_args`, which fills it from
dsaquant.topk_indices' validated arguments. Loading the compiled library is the build's business; `call`
runs `dsq_topk_indices` from any ctypes handle that exports it.
"""
from __future__ import annotations

import ctypes

import torch

from ..codes import DType

from ..reference.topk import DECODE_1D, DECODE_2D, PREFILL, span_form  # noqa: F401  (DSQ_TOPK_* values)

DTYPE = {torch.float32: int(DType.f32), torch.bfloat16: int(DType.bf16), torch.float16: int(DType.f16),
         torch.int32: int(DType.i32), torch.int64: int(DType.i64)}
MAX_SORT = 4096   # DSQ_TOPK_MAX_SORT
MAX_CHUNKS = 1024   # kMaxChunks of kernels/cuda/topk.cu
DIGITS = 4096       # kDigits: the first-digit histogram of the few-long-rows path
BIN_CAP = 8192      # kBinCap: workspace slots of a row's threshold-bin list
CACHE_KEYS = 32768  # kCacheKeys of the NVIDIA build: keys a block of the cached-row path holds (0 on AMD)
MAX_CLUSTER = 8     # kMaxCluster: the most blocks whose caches the plan fills
MAX_SPREAD = 16     # kMaxSpread: the most blocks a row of that path
MIN_SPREAD_KEYS = 8192   # kMinSpreadKeys: the fewest keys a block of a spread row reads


class DsqTopkArgs(ctypes.Structure):
    _fields_ = [
        ("logits", ctypes.c_void_p),
        ("context_lens", ctypes.c_void_p),
        ("ks", ctypes.c_void_p),
        ("ke", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_int64),
        ("rows", ctypes.c_int64),
        ("L", ctypes.c_int64),
        ("row_stride", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("next_n", ctypes.c_int32),
        ("form", ctypes.c_int32),
        ("logits_dtype", ctypes.c_int32),
        ("index_dtype", ctypes.c_int32),
        ("relative", ctypes.c_int32),
        ("chunks", ctypes.c_int32),
    ]


def workspace_bytes(rows: int, L: int, k: int, chunks: int) -> int:
    """Mirror of dsq_topk_workspace_bytes."""
    if chunks <= 1 or rows <= 0 or L <= 0 or k <= 0:
        return 0
    return rows * ((DIGITS + 2) * 4 + (k + BIN_CAP) * 8)


def cache_blocks(L: int, cache_keys: int = CACHE_KEYS) -> int:
    """Mirror of cache_blocks (topk_body.cuh): blocks a row of the cached-row path, 0 where it cannot hold L."""
    if cache_keys == 0:
        return 0
    c = 1
    while c * cache_keys < L:
        c *= 2
    return c if c <= MAX_CLUSTER else 0


def spread_blocks(rows: int, L: int, sms: int, cache_keys: int = CACHE_KEYS) -> int:
    """Mirror of spread_blocks (topk_body.cuh): cache_blocks doubled while the call's blocks stay within half of
    the SMs and each block reads at least MIN_SPREAD_KEYS keys (at most MAX_SPREAD blocks)."""
    c = cache_blocks(L, cache_keys)
    if c == 0:
        return 0
    while 2 * c <= MAX_SPREAD and rows * 2 * c <= sms // 2 and L >= 2 * c * MIN_SPREAD_KEYS:
        c *= 2
    return c


def plan_chunks(rows: int, L: int, k: int, sms: int, cache_keys: int = CACHE_KEYS) -> int:
    """Mirror of dsq_topk_plan_chunks of a build whose cached-row path holds `cache_keys` keys a block (the
    NVIDIA build's CACHE_KEYS; 0 for AMD's): -blocks for that path, else the blocks a row of the others."""
    if rows > 0 and k > 0 and cache_blocks(L, cache_keys) > 0:
        return -spread_blocks(rows, L, sms, cache_keys)
    if rows <= 0 or sms // rows < 3 or k <= 0 or L < 8 * k:
        return 1
    return max(2, min(sms // rows, L // 4096, MAX_CHUNKS))


def host_functions(lib):
    """(dsq_topk_plan_chunks, dsq_topk_workspace_bytes) of a library handle (ctypes), with their C signatures: the
    library's own plan (its platform's paths) and workspace size."""
    plan, ws = lib.dsq_topk_plan_chunks, lib.dsq_topk_workspace_bytes
    plan.restype, ws.restype = ctypes.c_int32, ctypes.c_int64
    plan.argtypes = ws.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32]
    return plan, ws


def make_args(logits, k, context_lens, next_n, ks, ke, relative, out, workspace=None, chunks=0) -> DsqTopkArgs:
    """DsqTopkArgs for one call (arguments as dsaquant.topk_indices validated them; index tensors contiguous).
    `workspace`: a byte tensor for the few-long-rows path, or None; `chunks`: blocks per row (plan_chunks; -blocks: the
    cached-row path; 0 or 1: one block a row)."""
    idx = context_lens if context_lens is not None else ks
    ptr = (lambda t: t.data_ptr() if t is not None else None)
    return DsqTopkArgs(
        logits=logits.data_ptr(), context_lens=ptr(context_lens), ks=ptr(ks), ke=ptr(ke), out=out.data_ptr(),
        workspace=ptr(workspace), workspace_bytes=0 if workspace is None else workspace.numel(),
        rows=logits.shape[0], L=logits.shape[1], row_stride=logits.stride(0) if logits.shape[0] else logits.shape[1],
        k=k, next_n=next_n, form=span_form(context_lens, ks), logits_dtype=DTYPE[logits.dtype],
        index_dtype=DTYPE[idx.dtype], relative=int(bool(relative)), chunks=int(chunks))


def call(lib, args: DsqTopkArgs, stream: int) -> int:
    """lib.dsq_topk_indices(&args, stream): the cudaError_t code (0 = success)."""
    fn = lib.dsq_topk_indices
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(DsqTopkArgs), ctypes.c_void_p]
    return fn(ctypes.byref(args), ctypes.c_void_p(stream))

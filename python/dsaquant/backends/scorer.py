"""The CUDA decode scorer (kernels/cuda/scorer.cu) through its C ABI (kernels/cuda/scorer.h).

The compiled module exports `dsq_paged_mqa_logits(const DsqPagedLogitsArgs*, void* stream)`; this module
mirrors the struct with ctypes (checked field by field against `dsq_paged_mqa_logits_layout`) and fills it
in one place. The kernel runs on sm_90 (wgmma); elsewhere, and for the cases it does not cover (e4m3fnuz
codes, H outside {16, 32, 64, 128}, unaligned tensors, page sizes the kernel does not tile), the call goes
to the Triton kernel, which computes the same logits.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from .. import errors
from ..codes import DType, Layout, code_of

DTYPE = {torch.float32: int(DType.f32), torch.bfloat16: int(DType.bf16), torch.float16: int(DType.f16),
         torch.int32: int(DType.i32), torch.int64: int(DType.i64)}
ERR_NOT_SUPPORTED = 801   # cudaErrorNotSupported


class PagedLogitsArgs(ctypes.Structure):
    """Mirror of DsqPagedLogitsArgs (kernels/cuda/scorer.h), field for field."""
    _fields_ = [(n, ctypes.c_void_p) for n in ("q", "q_scale", "weights", "context_lens", "block_table",
                                                "kv_cache", "kv_scale", "logits", "err_flag")] + \
               [(n, ctypes.c_int64) for n in ("B", "N", "H", "num_blocks", "page_size", "max_blocks", "max_seq_len",
                                              "ld", "w_row", "w_head", "ctx_b", "ctx_n", "bt_b", "bt_k")] + \
               [(n, ctypes.c_int32) for n in ("layout", "preshuffle", "w_dtype", "ctx_dtype", "bt_dtype", "out_dtype",
                                              "clean_logits", "device", "splits")] + \
               [("weight_scale", ctypes.c_float)]


def layout_mismatches(lib) -> list[str]:
    """Fields whose size or offset differ between the ctypes mirror and the compiled struct (empty: equal)."""
    n = 1 + len(PagedLogitsArgs._fields_)
    buf = (ctypes.c_int64 * n)()
    have = lib.dsq_paged_mqa_logits_layout(buf, n)
    bad = [] if have == n else [f"the library describes {have - 1} fields, the mirror has {n - 1}"]
    if buf[0] != ctypes.sizeof(PagedLogitsArgs):
        bad.append(f"sizeof: library {buf[0]}, mirror {ctypes.sizeof(PagedLogitsArgs)}")
    for i, (name, _) in enumerate(PagedLogitsArgs._fields_):
        if buf[1 + i] != getattr(PagedLogitsArgs, name).offset:
            bad.append(f"{name}: library offset {buf[1 + i]}, mirror {getattr(PagedLogitsArgs, name).offset}")
    return bad


@functools.lru_cache(maxsize=None)
def load(path: str):
    """The shared object at `path` with the scorer's symbols typed, or None when it has none."""
    lib = ctypes.CDLL(path)
    if not hasattr(lib, "dsq_paged_mqa_logits"):
        return None
    lib.dsq_paged_mqa_logits.argtypes = [ctypes.POINTER(PagedLogitsArgs), ctypes.c_void_p]
    lib.dsq_paged_mqa_logits.restype = ctypes.c_int
    lib.dsq_paged_mqa_logits_layout.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
    lib.dsq_paged_mqa_logits_layout.restype = ctypes.c_int
    bad = layout_mismatches(lib)
    if bad:
        raise ImportError(f"{path}: DsqPagedLogitsArgs does not match its Python mirror: {'; '.join(bad)}")
    return lib


def _aligned(*ts) -> bool:
    return all(t is None or t.data_ptr() % 16 == 0 for t in ts)


def make_args(q, kv_cache, weights, context_lens, block_tables, max_seq_len, layout, q_scale, kv_cache_scale,
              weight_scale, preshuffle, page_size, clean_logits, out, err_flag, device: int,
              splits: int = 0) -> PagedLogitsArgs:
    """The kernel's arguments for one call (the reference scorer's arguments, the int32 error flag tensor, the
    device index and the context splits, 0: chosen from the SM count). Pointers are the tensors' data pointers."""
    B, N, H = q.shape[:3]
    a = PagedLogitsArgs()
    w = weights if weights.dim() == 2 else weights.reshape(B * N, H)
    ctx, bt = context_lens, block_tables
    a.q, a.weights, a.context_lens, a.block_table = q.data_ptr(), w.data_ptr(), ctx.data_ptr(), bt.data_ptr()
    a.q_scale = q_scale.data_ptr() if q_scale is not None else None
    a.kv_cache = kv_cache.data_ptr()
    a.kv_scale = kv_cache_scale.data_ptr() if kv_cache_scale is not None else None
    a.logits, a.err_flag = out.data_ptr(), err_flag.data_ptr()
    a.B, a.N, a.H, a.num_blocks, a.page_size = B, N, H, kv_cache.shape[0], page_size
    a.max_blocks, a.max_seq_len, a.ld = bt.shape[1], max_seq_len, out.stride(0)
    a.w_row, a.w_head = w.stride(0), w.stride(1)
    a.ctx_b, a.ctx_n = ctx.stride(0), (ctx.stride(1) if ctx.dim() == 2 else 0)
    a.bt_b, a.bt_k = bt.stride(0), bt.stride(1)
    a.layout, a.preshuffle = code_of(Layout, layout), bool(preshuffle)
    a.w_dtype, a.ctx_dtype, a.bt_dtype = DTYPE[w.dtype], DTYPE[ctx.dtype], DTYPE[bt.dtype]
    a.out_dtype, a.clean_logits = DTYPE[out.dtype], bool(clean_logits)
    a.device, a.splits, a.weight_scale = device, splits, weight_scale
    a.keep = w   # a reshaped copy of the weights lives as long as the arguments
    return a


def make_paged_mqa_logits(lib, splits: int = 0):
    """The cuda backend's paged_mqa_logits over library `lib` (reference signature; writes `out`)."""

    def paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, max_seq_len, layout, q_scale,
                         kv_cache_scale, weight_scale, preshuffle, fp8_flavour, page_size, clean_logits, out):
        B, N, H = q.shape[:3]
        dev = q.device
        supported = (dev.type == "cuda" and torch.cuda.get_device_capability(dev) == (9, 0)
                     and H in (16, 32, 64, 128) and weights.dtype in (torch.float32, torch.bfloat16) and (layout != "fp8_132" or fp8_flavour in (None, "e4m3fn"))
                     and _aligned(q, kv_cache) and out.stride(-1) == 1)
        if supported:
            a = make_args(q, kv_cache, weights, context_lens, block_tables, max_seq_len, layout, q_scale,
                          kv_cache_scale, weight_scale, preshuffle, page_size, clean_logits, out,
                          errors.flag_tensor(dev), dev.index if dev.index is not None else torch.cuda.current_device(),
                          splits)
            err = lib.dsq_paged_mqa_logits(ctypes.byref(a), torch.cuda.current_stream(dev).cuda_stream)
            if err == 0:
                return out
            if err != ERR_NOT_SUPPORTED:
                raise RuntimeError(f"dsaquant: launching paged_mqa_logits failed with CUDA error {err}")
        from ..triton import scorer as triton_scorer
        return triton_scorer.paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, max_seq_len, layout,
                                              q_scale, kv_cache_scale, weight_scale, preshuffle, fp8_flavour, page_size,
                                              clean_logits, out)

    return paged_mqa_logits

"""The Python side of kernels/cuda/prefill.h: `DsqMqaLogitsArgs` as a ctypes.Structure (field for field, the
offsets held equal to the C header's by tests/test_prefill_host.py), `make_args`, which fills it from the Triton
backend's positional arguments of mqa_logits, `supported`, the calls the CUDA kernel takes, and `call`, which runs
`dsq_mqa_logits` from any ctypes handle that exports it (the library, or the host emulator of the tests).
"""
from __future__ import annotations

import ctypes

import torch

from ..codes import DType

TILE = 64                    # DSQ_PREFILL_TILE
HEADS = (16, 32, 64, 128)
ERR_NOT_SUPPORTED = 801      # cudaErrorNotSupported


class DsqMqaLogitsArgs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("q", "k", "k_scale", "weights", "lo", "hi", "base", "out")] + \
               [(n, ctypes.c_int64) for n in ("S", "SKV", "H", "W", "ld", "w_row", "w_head")] + \
               [(n, ctypes.c_int32) for n in ("w_dtype", "out_dtype", "clean", "compressed", "device", "splits")]


def supported(q, k, k_scale, weights, out, layout, fp8_flavour, exact) -> bool:
    """Whether the CUDA kernel takes the call (else the Triton kernel does): the FP8 layout with e4m3fn codes,
    H in HEADS, fp32 or bf16 weights, 16-byte aligned q, k and k_scale, the output's last dim contiguous."""
    return (layout == "fp8" and not exact and fp8_flavour in (None, "e4m3fn") and q.shape[1] in HEADS
            and weights.dtype in (torch.float32, torch.bfloat16) and out.dtype in (torch.float32, torch.bfloat16)
            and all(t.data_ptr() % 16 == 0 for t in (q, k, k_scale)) and k_scale.is_contiguous()
            and (out.shape[0] == 0 or out.stride(-1) == 1))


def make_args(q, k, k_scale, weights, lo, hi, base, out, clean_logits, compressed, splits=0) -> DsqMqaLogitsArgs:
    """DsqMqaLogitsArgs for one call (the op's validated tensors: q [S, H, 128] and k [SKV, 128] e4m3 codes,
    k_scale fp32 [SKV], weights [S, H], lo / hi / base int32 [S], out [S, W])."""
    dev = q.device
    return DsqMqaLogitsArgs(
        q=q.data_ptr(), k=k.data_ptr(), k_scale=k_scale.data_ptr(), weights=weights.data_ptr(), lo=lo.data_ptr(),
        hi=hi.data_ptr(), base=base.data_ptr(), out=out.data_ptr(), S=q.shape[0], SKV=k.shape[0], H=q.shape[1],
        W=out.shape[1], ld=out.stride(0) if out.shape[0] else out.shape[1], w_row=weights.stride(0),
        w_head=weights.stride(1), w_dtype=int(DType.bf16 if weights.dtype == torch.bfloat16 else DType.f32),
        out_dtype=int(DType.bf16 if out.dtype == torch.bfloat16 else DType.f32), clean=int(bool(clean_logits)),
        compressed=int(bool(compressed)),
        device=(dev.index if dev.index is not None else torch.cuda.current_device()) if dev.type == "cuda" else 0,
        splits=int(splits))


def call(lib, args: DsqMqaLogitsArgs, stream: int) -> int:
    """lib.dsq_mqa_logits(&args, stream): the cudaError_t code (0 = success)."""
    fn = lib.dsq_mqa_logits
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(DsqMqaLogitsArgs), ctypes.c_void_p]
    return fn(ctypes.byref(args), ctypes.c_void_p(stream))

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
SECOND_PASS_ROW_BLOCKS = 8   # blocks of query rows a program of the FP4 second pass


class DsqMqaLogitsArgs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("q", "k", "k_scale", "weights", "lo", "hi", "base", "q_scale",
                                                "fold_all", "out")] + \
               [(n, ctypes.c_int64) for n in ("S", "SKV", "H", "W", "ld", "w_row", "w_head")] + \
               [(n, ctypes.c_int32) for n in ("w_dtype", "out_dtype", "clean", "compressed", "device", "splits")]


def supported(q, k, k_scale, weights, out, layout, fp8_flavour, exact) -> bool:
    """Whether the CUDA kernel takes the call (else the Triton kernel does): the FP8 layout with e4m3fn codes
    (16-byte aligned q, k and contiguous k_scale), or the FP4 fast mode (16-byte aligned q, folded by the kernel;
    the keys by a pre-pass); H in HEADS, fp32 or bf16 weights whose heads are contiguous, the output's last dim
    contiguous."""
    if layout == "fp8":
        ok = (fp8_flavour in (None, "e4m3fn") and all(t.data_ptr() % 16 == 0 for t in (q, k, k_scale))
              and k_scale.is_contiguous())
    else:
        ok = layout == "fp4" and not exact and q.data_ptr() % 16 == 0
    return (ok and q.shape[1] in HEADS and weights.dtype in (torch.float32, torch.bfloat16)
            and weights.stride(1) == 1 and out.dtype in (torch.float32, torch.bfloat16)
            and (out.shape[0] == 0 or out.stride(-1) == 1))


def make_args(q, k, k_scale, weights, lo, hi, base, out, clean_logits, compressed, splits=0,
              q_scale=None, fold_all=None) -> DsqMqaLogitsArgs:
    """DsqMqaLogitsArgs for one call (the op's validated tensors: q [S, H, 128] and k [SKV, 128] e4m3 codes,
    k_scale fp32 [SKV], weights [S, H], lo / hi / base int32 [S], out [S, W]; FP4 fold mode: q packed E2M1
    uint8 [S, H, 64], q_scale its exponent words int32 [S * H], k and k_scale the folded keys, fold_all int32 [1]
    cleared when a query row does not fold)."""
    dev = q.device
    return DsqMqaLogitsArgs(
        q=q.data_ptr(), k=k.data_ptr(), k_scale=k_scale.data_ptr(), weights=weights.data_ptr(), lo=lo.data_ptr(),
        hi=hi.data_ptr(), base=base.data_ptr(), q_scale=None if q_scale is None else q_scale.data_ptr(),
        fold_all=None if fold_all is None else fold_all.data_ptr(),
        out=out.data_ptr(), S=q.shape[0], SKV=k.shape[0], H=q.shape[1],
        W=out.shape[1], ld=out.stride(0) if out.shape[0] else out.shape[1], w_row=weights.stride(0),
        w_head=weights.stride(1), w_dtype=int(DType.bf16 if weights.dtype == torch.bfloat16 else DType.f32),
        out_dtype=int(DType.bf16 if out.dtype == torch.bfloat16 else DType.f32), clean=int(bool(clean_logits)),
        compressed=int(bool(compressed)),
        device=(dev.index if dev.index is not None else torch.cuda.current_device()) if dev.type == "cuda" else 0,
        splits=int(splits))


def run(lib, stream: int, q, q_scale, k, k_scale, weights, lo, hi, base, out, layout, clean_logits, compressed) -> int:
    """One mqa_logits call on `lib` (a call `supported` takes; the Triton backend's positional arguments): FP8
    directly; FP4 folded into e4m3 (docs/prefill.md): a Triton pre-pass folds the keys, the CUDA kernel folds the
    query rows as it loads them and writes the entries whose key and query fold, then Triton's second pass the
    others. Returns the library's code (0: `out` written; otherwise nothing was launched but the -inf fill of a
    clean compressed output and the FP4 pre-pass)."""
    if out.shape[0] == 0 or out.shape[1] == 0 or k.shape[0] == 0:
        from ..triton.prefill import mqa_logits as triton_mqa_logits   # the trivial cases, as Triton does them
        triton_mqa_logits(q, q_scale, k, k_scale, weights, lo, hi, base, out, layout, None, False, clean_logits,
                          compressed)
        return 0
    if compressed and clean_logits:
        out.fill_(float("-inf"))   # the kernels write the valid entries of the compressed form only
    if layout == "fp8":
        return call(lib, make_args(q.view(torch.uint8), k.view(torch.uint8), k_scale.reshape(-1), weights, lo, hi,
                                   base, out, clean_logits, compressed), stream)
    from ..triton import prefill as triton_prefill
    S, H, SKV = q.shape[0], q.shape[1], k.shape[0]
    kf = k_scale.contiguous().view(torch.int32).reshape(SKV)
    keys = triton_prefill.fold_keys(k, kf, triton_prefill.fold_block(S, SKV, H, q.device))
    qs = q_scale.contiguous().view(torch.int32).reshape(S * H)
    rc = call(lib, make_args(q, keys[0].view(torch.uint8), keys[1], weights, lo, hi, base, out, clean_logits,
                             compressed, q_scale=qs, fold_all=keys[3][1:]), stream)
    if rc == 0:   # the entries whose key or row does not fold: programs of all the key tiles and several blocks
        #           of rows (usually every key and row folds, and each block only reads its rows' exponents and
        #           weights: the pass is then bound by its programs' launches)
        triton_prefill.mqa_logits(q, q_scale, k, k_scale, weights, lo, hi, base, out, layout, None, False,
                                  clean_logits, compressed, fp4_dot="fp8", folded_keys=keys,
                                  tiles_per_prog=-(-SKV // keys.block), row_blocks=SECOND_PASS_ROW_BLOCKS)
    return rc


def call(lib, args: DsqMqaLogitsArgs, stream: int) -> int:
    """lib.dsq_mqa_logits(&args, stream): the cudaError_t code (0 = success)."""
    fn = lib.dsq_mqa_logits
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(DsqMqaLogitsArgs), ctypes.c_void_p]
    return fn(ctypes.byref(args), ctypes.c_void_p(stream))

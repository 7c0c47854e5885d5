"""The prefill ops (docs/prefill.md): validate -> pick a backend (dispatch.py) -> call one torch.library op.

`mqa_logits` scores S query rows against the keys of their own ranges [ks[i], ke[i]) of a contiguous key
set (DeepGEMM's fp8_mqa_logits / fp8_fp4_mqa_logits), `mqa_topk` selects the top-k positions of the same
logits without materialising them, and `gather_index_cache` copies the keys of given sequences out of a
paged cache (SPEC §6) into the contiguous form the two read.
"""

from typing import Optional

import torch
from torch import Tensor

from . import dispatch, errors
from . import validate as V

D = 128
HEADS = (16, 32, 64, 128)
LAYOUTS = ("fp8", "fp4")
CACHE_LAYOUTS = ("fp8_132", "packed68", "aiter_fp4")
_FP8_IN = (torch.uint8, *V.FP8_DTYPES)
_INT32_MAX = (1 << 31) - 1


def _call(op: str, backend: str, *args):
    return dispatch.get(backend, op)(*args)


# ------------------------------------------------------------------------------------------------
# argument normalisation shared by mqa_logits and mqa_topk
# ------------------------------------------------------------------------------------------------
def _flavour(q: Tensor, k: Tensor) -> str:
    fq, fk = V.FP8_DTYPES.get(q.dtype), V.FP8_DTYPES.get(k.dtype)
    if fq and fk and fq != fk:
        raise TypeError(f"k: FP8 flavour {fk} differs from q's {fq}")
    return fq or fk or "e4m3fn"


def _exps(name: str, t, lead: tuple, dev) -> Tensor:
    """UE8M0 exponents: uint8 [*lead, 4] or int32 [*lead] (block j in byte j) -> uint8 [*lead, 4]."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor (FP4 exponents), got {type(t).__name__}")
    if t.dtype == torch.int32:
        V.tensor(name, t, (torch.int32,), lead, dev, contiguous=True)
        return t.view(torch.uint8).reshape(*lead, 4)
    V.tensor(name, t, (torch.uint8,), (*lead, 4), dev, contiguous=True)
    return t


def _inputs(q, k, weights, ks, ke, layout, q_scale, k_scale, exact):
    """Validate the shared arguments; returns (q u8, q_scale, k u8, k_scale, weights, flavour, S, H, SKV)."""
    V.choice("layout", layout, LAYOUTS)
    V.flag("exact", exact)
    if exact and layout != "fp4":
        raise ValueError("exact: the exact mode is defined for layout='fp4' only")
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    dev = q.device
    if layout == "fp8":
        V.tensor("q", q, _FP8_IN, (None, None, D), contiguous=True)
        S, H = q.shape[0], q.shape[1]
        if q_scale is not None:
            raise ValueError("q_scale: the FP8 layout takes q's scale folded into weights; pass None")
        V.tensor("k", k, _FP8_IN, (None, D), dev, contiguous=True)
        SKV = k.shape[0]
        if not isinstance(k_scale, torch.Tensor):
            raise TypeError(f"k_scale: expected a torch.Tensor (fp32 [SKV]), got {type(k_scale).__name__}")
        if k_scale.dim() == 2 and k_scale.shape[1:] == (1,):
            k_scale = k_scale.reshape(-1)
        V.tensor("k_scale", k_scale, (torch.float32,), (SKV,), dev, contiguous=True)
        flavour = _flavour(q, k)
        qu, ku, qs = q.view(torch.uint8), k.view(torch.uint8), None
    else:
        V.tensor("q", q, (torch.uint8,), (None, None, 64), contiguous=True)
        S, H = q.shape[0], q.shape[1]
        qs = _exps("q_scale", q_scale, (S, H), dev)
        V.tensor("k", k, (torch.uint8,), (None, 64), dev, contiguous=True)
        SKV = k.shape[0]
        k_scale = _exps("k_scale", k_scale, (SKV,), dev)
        flavour, qu, ku = "e4m3fn", q, k
    if H not in HEADS:
        raise ValueError(f"q: the number of heads must be one of {HEADS}, got {H}")
    V.tensor("weights", weights, (torch.float32, torch.bfloat16), (S, H), dev, last_contiguous=True)
    V.tensor("ks", ks, V.INDEX, (S,), dev)
    V.tensor("ke", ke, V.INDEX, (S,), dev)
    return qu, qs, ku, k_scale, weights, flavour, S, H, SKV


def _clamp32(x: Tensor, lo: int, hi: int) -> Tensor:
    """int32 [S]: x (int32 or int64 [S]) clamped to [lo, hi]; one launch for int32 x (a graph of a prefill call
    holds a handful of these small launches, each costing about as much as a microsecond of the logits kernel)."""
    if x.dtype == torch.int32:
        return torch.clamp(x, lo, hi)
    return torch.clamp(x, lo, hi).to(torch.int32)


def _ranges(ks, ke, SKV: int):
    return _clamp32(ks, 0, SKV), _clamp32(ke, 0, SKV)


# ------------------------------------------------------------------------------------------------
# mqa_logits
# ------------------------------------------------------------------------------------------------
@dispatch.library_op("dsaquant::mqa_logits", mutates_args=("out",))
def _logits_op(q: Tensor, q_scale: Optional[Tensor], k: Tensor, k_scale: Tensor, weights: Tensor, lo: Tensor,
               hi: Tensor, base: Tensor, out: Tensor, layout: str, fp8_flavour: str, exact: bool, clean_logits: bool,
               compressed: bool, backend: str) -> None:
    _call("mqa_logits", backend, q, q_scale, k, k_scale, weights, lo, hi, base, out, layout, fp8_flavour, exact,
          clean_logits, compressed)


@_logits_op.register_fake
def _(*args, **kwargs) -> None:
    return None


def mqa_logits(q, k, weights, ks, ke, *, layout="fp8", q_scale=None, k_scale=None, clean_logits=True,
               out_dtype=torch.float32, max_seqlen_k=0, exact=False, out=None, backend=None):
    """Ragged prefill logits: out[i, j] = sum_h w[i, h] * relu(q[i, h] . k[j]) for keys ks[i] <= j < ke[i].

    layout "fp8": q [S, H, 128] float8_e4m3fn / float8_e4m3fnuz / uint8 codes (q's scale folded into weights
      by the writer, SPEC §7.1); k [SKV, 128] of the same family; k_scale fp32 [SKV] (or [SKV, 1]);
      k[j] is dequantized as code * k_scale[j] (the logit is k_scale[j] * sum_h w relu(q . code)).
    layout "fp4": q uint8 [S, H, 64] packed E2M1 (SPEC §1), q_scale its UE8M0 exponents, int32 [S, H] (block j
      in byte j) or uint8 [S, H, 4]; k uint8 [SKV, 64]; k_scale uint8 [SKV, 4] or int32 [SKV]; values are
      dequantized by SPEC §1/§3. exact=True gives the exact logit (docs/prefill.md), the same bytes on every
      backend.
    weights [S, H] fp32 or bf16; H in (16, 32, 64, 128); ks, ke int32/int64 [S].
    Ranges are clamped to [0, SKV]: a row's keys are max(ks, 0) <= j < min(ke, SKV) (empty when ks >= ke).
    Output [S, SKV] (max_seqlen_k = 0), or the compressed [S, max_seqlen_k] whose column c is key ks[i] + c
    (keys at c >= max_seqlen_k are dropped), of out_dtype fp32 or bf16 (rounded to nearest even).
    clean_logits=True writes -inf at every other entry; clean_logits=False leaves them untouched: give `out`
    to keep their contents (without `out` a fresh uninitialised tensor is returned, as DeepGEMM does).
    Returns `out`.
    """
    q, q_scale, k, k_scale, weights, flavour, S, H, SKV = _inputs(q, k, weights, ks, ke, layout, q_scale, k_scale,
                                                                  exact)
    dev = q.device
    V.flag("clean_logits", clean_logits)
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"out_dtype: expected torch.float32 or torch.bfloat16, got {out_dtype}")
    V.number("max_seqlen_k", max_seqlen_k, (int,))
    if max_seqlen_k < 0:
        raise ValueError(f"max_seqlen_k: expected >= 0, got {max_seqlen_k}")
    compressed = max_seqlen_k > 0
    W = max_seqlen_k if compressed else SKV
    if out is None:
        out = torch.empty((S, W), dtype=out_dtype, device=dev)
    V.tensor("out", out, (out_dtype,), (S, W), dev, last_contiguous=True)
    # contiguous int32 bounds go as they are (the backends clamp them to [0, SKV] as they read them: no launch);
    # others are clamped here (int64 ones before they narrow to int32)
    raw = all(t.dtype == torch.int32 and t.is_contiguous() for t in (ks, ke))
    lo, hi = (ks, ke) if raw else _ranges(ks, ke, SKV)
    # base is read by the compressed output only (the backends' full output puts key j at column j)
    base = _clamp32(ks, -W, SKV) if compressed else lo
    if S == 0 or W == 0:
        return out
    name = dispatch.choose_for("mqa_logits", dev, backend, S)
    _logits_op(q, q_scale, k, k_scale, weights, lo, hi, base, out, layout, flavour, exact, clean_logits, compressed,
               name)
    return out


# ------------------------------------------------------------------------------------------------
# mqa_topk
# ------------------------------------------------------------------------------------------------
@dispatch.library_op("dsaquant::mqa_topk", mutates_args=())
def _topk_op(q: Tensor, q_scale: Optional[Tensor], k: Tensor, k_scale: Tensor, weights: Tensor, lo: Tensor,
             hi: Tensor, base: Tensor, topk: int, layout: str, fp8_flavour: str, exact: bool, backend: str) -> Tensor:
    return _call("mqa_topk", backend, q, q_scale, k, k_scale, weights, lo, hi, base, topk, layout, fp8_flavour,
                 exact)


@_topk_op.register_fake
def _(q, q_scale, k, k_scale, weights, lo, hi, base, topk, layout, fp8_flavour, exact, backend):
    return q.new_empty((q.shape[0], topk), dtype=torch.int32)


def mqa_topk(q, k, weights, ks, ke, topk, *, layout="fp8", q_scale=None, k_scale=None, exact=False, relative=False,
             backend=None):
    """Top-k key positions of each row's mqa_logits (fp32 logits, same arguments as mqa_logits) without the
    [S, SKV] matrix: int32 [S, topk], ordered by logit descending, ties by the smaller position, -inf and NaN
    never selected, padded with -1. Positions are key indices j, or j - ks[i] with relative=True (the
    compressed logits' columns). Memory: S * topk * 8 bytes plus a fixed workspace (docs/prefill.md)."""
    q, q_scale, k, k_scale, weights, flavour, S, H, SKV = _inputs(q, k, weights, ks, ke, layout, q_scale, k_scale,
                                                                  exact)
    dev = q.device
    V.number("topk", topk, (int,))
    if topk < 1:
        raise ValueError(f"topk: expected >= 1, got {topk}")
    V.flag("relative", relative)
    lo, hi = _ranges(ks, ke, SKV)
    if relative:
        base = _clamp32(ks, SKV - _INT32_MAX, SKV)
    else:
        base = torch.zeros(S, dtype=torch.int32, device=dev)
    if S == 0:
        return torch.empty((0, topk), dtype=torch.int32, device=dev)
    if SKV == 0:
        return torch.full((S, topk), -1, dtype=torch.int32, device=dev)
    name = dispatch.choose_for("mqa_topk", dev, backend, S)
    return _topk_op(q, q_scale, k, k_scale, weights, lo, hi, base, topk, layout, flavour, exact, name)


# ------------------------------------------------------------------------------------------------
# gather_index_cache
# ------------------------------------------------------------------------------------------------
@dispatch.library_op("dsaquant::gather_index_cache", mutates_args=("out", "out_scale", "flag"))
def _gather_op(kv_cache: Tensor, kv_cache_scale: Optional[Tensor], block_table: Tensor, cu_seqlens: Tensor,
               layout: str, page_size: int, preshuffle: bool, out: Tensor, out_scale: Tensor, flag: Tensor,
               backend: str) -> None:
    _call("gather_index_cache", backend, kv_cache, kv_cache_scale, block_table, cu_seqlens, layout, page_size,
          preshuffle, out, out_scale, flag, errors.PAGE_OUT_OF_RANGE)


@_gather_op.register_fake
def _(*args, **kwargs) -> None:
    return None


def gather_index_cache(kv_cache, block_table, cu_seqlens, *, layout, kv_cache_scale=None, page_size=None,
                       preshuffle=False, out=None, out_scale=None, backend=None):
    """The keys of B sequences out of a paged index cache (SPEC §6), contiguous, for mqa_logits / mqa_topk.

    Sequence b's tokens cu_seqlens[b] .. cu_seqlens[b+1]-1 are its positions p = 0 .. len-1; position p lives
    at page block_table[b, p // P], offset p % P. Row t of the output is token t.
      fp8_132:   kv_cache uint8/fp8 [NB, P*132] or [NB, P, 132] (preshuffle optional, P % 16 == 0);
                 out uint8 [T, 128] codes (or an fp8 dtype), out_scale fp32 [T].
      packed68:  kv_cache uint8 [NB, P*68] or [NB, P, 68]; out uint8 [T, 64], out_scale uint8 [T, 4] or int32 [T].
      aiter_fp4: kv_cache uint8 [NB, 1, 4, P, 16], kv_cache_scale uint8 [NB, 1, 4, P] (P % 16 == 0);
                 out and out_scale as packed68.
    block_table int32/int64 [B, max_pages] (last dim contiguous); cu_seqlens int32/int64 [B+1], non-decreasing. T = out.shape[0],
    or cu_seqlens[-1] when out is None (read on the host: one synchronisation).
    A token whose page is missing (p // P past the block table, a page id outside [0, NB), or a row t in no
    sequence) gets zeros and is reported by dsaquant.check_errors(). Returns (out, out_scale).
    """
    V.choice("layout", layout, CACHE_LAYOUTS)
    V.flag("preshuffle", preshuffle)
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache: expected a torch.Tensor, got {type(kv_cache).__name__}")
    dev = kv_cache.device
    if layout == "aiter_fp4":
        V.tensor("kv_cache", kv_cache, (torch.uint8,), (None, 1, 4, None, 16), dev, contiguous=True)
        NB, P = kv_cache.shape[0], kv_cache.shape[3]
        V.page_multiple_of_16("kv_cache", P, "the aiter_fp4 layout")
        V.tensor("kv_cache_scale", kv_cache_scale, (torch.uint8,), (NB, 1, 4, P), dev, contiguous=True)
    else:
        if kv_cache_scale is not None:
            raise ValueError(f"kv_cache_scale: the {layout} layout keeps its scales in kv_cache; pass None")
        V.tensor("kv_cache", kv_cache, _FP8_IN if layout == "fp8_132" else (torch.uint8,), None, dev, contiguous=True)
        P = V.page_size_of("kv_cache", kv_cache, 132 if layout == "fp8_132" else 68)
    if page_size is not None:
        V.number("page_size", page_size, (int,))
        if page_size != P:
            raise ValueError(f"page_size: {page_size} contradicts kv_cache's page size {P}")
    if preshuffle:
        if layout != "fp8_132":
            raise ValueError("preshuffle: only the fp8_132 layout has a preshuffled form")
        V.page_multiple_of_16("kv_cache", P, "preshuffle")
    V.tensor("block_table", block_table, V.INDEX, (None, None), dev, last_contiguous=True)
    B = block_table.shape[0]
    V.tensor("cu_seqlens", cu_seqlens, V.INDEX, (B + 1,), dev, contiguous=True)
    fp8 = layout == "fp8_132"
    if out is None:
        if out_scale is not None:
            raise ValueError("out_scale: given without out; pass both or neither")
        T = int(cu_seqlens[-1].item()) if B else 0
        if T < 0:
            raise ValueError(f"cu_seqlens: the total token count cu_seqlens[-1] is negative ({T})")
        out = torch.empty((T, D if fp8 else 64), dtype=torch.uint8, device=dev)
        out_scale = torch.empty((T,) if fp8 else (T, 4), dtype=torch.float32 if fp8 else torch.uint8, device=dev)
    if out_scale is None:
        raise ValueError("out_scale: out was given without out_scale; pass both or neither")
    T = out.shape[0] if isinstance(out, torch.Tensor) else 0
    if fp8:
        V.tensor("out", out, _FP8_IN, (T, D), dev, contiguous=True)
        V.tensor("out_scale", out_scale, (torch.float32,), (T,), dev, contiguous=True)
    else:
        V.tensor("out", out, (torch.uint8,), (T, 64), dev, contiguous=True)
        if out_scale.dtype == torch.int32:
            V.tensor("out_scale", out_scale, (torch.int32,), (T,), dev, contiguous=True)
        else:
            V.tensor("out_scale", out_scale, (torch.uint8,), (T, 4), dev, contiguous=True)
    if T == 0:
        return out, out_scale
    name = dispatch.choose("gather_index_cache", dev, backend)
    _gather_op(kv_cache, kv_cache_scale, block_table, cu_seqlens, layout, P, preshuffle, out, out_scale,
               errors.flag_tensor(dev), name)
    return out, out_scale

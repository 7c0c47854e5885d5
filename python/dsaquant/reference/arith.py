"""SPEC §0: the arithmetic every backend shares, written with torch ops.

Every function here takes and returns torch tensors on any device (CPU or GPU). Each torch
elementwise op is one correctly rounded IEEE binary32 operation, so writing the formula one op
at a time gives the SPEC's rounding sequence (no FMA contraction happens between torch ops).
"""
from __future__ import annotations

import torch

F32 = torch.float32

# fp32 constants of the SPEC, given by their bits.
INV6_BITS = 0x3E2AAAAB          # fl(1/6), SPEC §3 rule `recip`
INV_SQRT128_BITS = 0x3DB504F3   # fl(128^-0.5), SPEC §5 Hadamard


def f32_from_bits(b: int) -> float:
    """Python float holding the fp32 whose bit pattern is `b` (exact)."""
    return torch.tensor([b], dtype=torch.int32).view(F32).item()


def to_f32_scalar(v: float) -> float:
    """Round a Python float to fp32 once (SPEC §7.6 `epsilon`; weight scales)."""
    return torch.tensor([v], dtype=F32).item()


INV6 = f32_from_bits(INV6_BITS)
INV_SQRT128 = f32_from_bits(INV_SQRT128_BITS)


def bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 tensor -> int32 tensor of its bit patterns."""
    return x.contiguous().to(F32).view(torch.int32)


def from_bits(b: torch.Tensor) -> torch.Tensor:
    """int32 tensor of bit patterns -> fp32 tensor."""
    return b.to(torch.int32).contiguous().view(F32)


def div(a: torch.Tensor, b: float) -> torch.Tensor:
    """fl(a / b), one correctly rounded division per element. (torch on CUDA turns `tensor / python
    scalar` into a multiplication by the rounded reciprocal, which is not the SPEC's division.)"""
    return a / torch.tensor(b, dtype=F32, device=a.device)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """SPEC §0.5: fp32 2^(e-127) built from bits for a biased exponent e (int tensor).

    e = 255 gives +Inf (the bits of a NaN-scale block are handled by callers).
    """
    return from_bits(e.to(torch.int32) << 23)


def ceil_exp(f: torch.Tensor) -> torch.Tensor:
    """SPEC §3: biased exponent of the smallest power of two >= f (f >= 0 fp32), from bits. int32."""
    b = bits(f)
    return ((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0).to(torch.int32)


def nan_amax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """SPEC §0.3: max |x| along `dim`, ignoring NaN (fmaxf); an all-NaN slice gives 0."""
    a = torch.nan_to_num(x.to(F32).abs(), nan=0.0, posinf=float("inf"), neginf=float("inf"))
    return a.amax(dim=dim)


def nan_max(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Signed max along `dim` ignoring NaN (fmaxf). An all-NaN slice gives NaN."""
    x = x.to(F32)
    filled = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x)
    m = filled.amax(dim=dim)
    all_nan = torch.isnan(x).all(dim=dim)
    return torch.where(all_nan, torch.full_like(m, float("nan")), m)


def canonical_sum(x: torch.Tensor) -> torch.Tensor:
    """SPEC §0.2: the canonical sum over the last dim (length n = 4*m, m a power of two).

    Partials p[i] = ((x[4i] + x[4i+1]) + x[4i+2]) + x[4i+3], then for s = m/2 .. 1:
    p[i] = p[i] + p[i ^ s]; the result is p[0]. Returns fp32 with the last dim removed.
    """
    x = x.to(F32)
    n = x.shape[-1]
    m = n // 4
    if n != 4 * m or m & (m - 1):
        raise ValueError(f"canonical_sum needs a length 4*2^k, got {n}")
    q = x.reshape(*x.shape[:-1], m, 4)
    p = ((q[..., 0] + q[..., 1]) + q[..., 2]) + q[..., 3]
    idx = torch.arange(m, device=x.device)
    s = m // 2
    while s >= 1:
        p = p + torch.index_select(p, -1, idx ^ s)   # (index_select: far faster than p[..., idx] on CPU)
        s //= 2
    return p[..., 0]


CANONICAL_NAN_BITS = 0x7FC00000


def canon_nan(x: torch.Tensor) -> torch.Tensor:
    """Replace every NaN by the canonical quiet NaN +0x7FC00000 (fp32).

    The sign and payload of a NaN produced by arithmetic differ by platform (NVIDIA GPUs return a
    positive canonical NaN; x86 and AMD propagate an operand's). Every op canonicalises NaN where the
    sign could reach a byte: at the entry of each quantizer and at each rounding to bf16/fp16, so
    a NaN inside an op always encodes as positive (docs/semantics.md, "NaN inside ops")."""
    x = x.to(F32)
    return torch.where(torch.isnan(x), from_bits(torch.full_like(x, CANONICAL_NAN_BITS, dtype=torch.int32)), x)


_CANON_HALF = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values -> `dtype` (nearest even), with every NaN stored as the canonical quiet NaN of that
    dtype (fp32 0x7FC00000, bf16 0x7FC0, fp16 0x7E00): torch's own NaN bits differ between CPU and CUDA."""
    if dtype == F32:
        return canon_nan(x)
    y = x.to(F32).to(dtype)
    if dtype in _CANON_HALF:
        bits16 = y.view(torch.int16)
        y = torch.where(torch.isnan(y), torch.full_like(bits16, _CANON_HALF[dtype]), bits16).view(dtype)
    return y


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SPEC §0.4: round fp32 to `dtype` (bf16/fp16, nearest-even) and back to fp32; NaN becomes the
    canonical NaN (see canon_nan)."""
    if dtype == F32:
        return canon_nan(x)
    return canon_nan(x.to(F32).to(dtype).to(F32))


# SPEC §0.7 constants, by their bits.
_LOG2E = 0x3FB8AA3B
_LN2_HI = 0x3F317200
_LN2_LO = 0x35BFBE8E
_POLY = (0x39500D01, 0x3AB60B61, 0x3C088889, 0x3D2AAAAB, 0x3E2AAAAB, 0x3F000000, 0x3F800000)


def exp_ds(x: torch.Tensor) -> torch.Tensor:
    """SPEC §0.7: the one exponential of format math, for fp32 x <= 0. Returns fp32.

    Identical on every backend: only correctly rounded fp32 ops, rint and bit-built powers of two.
    """
    x = x.to(F32)
    c = lambda b: f32_from_bits(b)  # noqa: E731
    xs = torch.where(torch.isinf(x), torch.zeros_like(x), x)   # keep the arithmetic finite
    n = torch.round(xs * c(_LOG2E))                              # rint: half to even
    r = (xs - n * c(_LN2_HI)) - n * c(_LN2_LO)
    a = torch.full_like(xs, c(_POLY[0]))
    for k in _POLY[1:]:
        a = c(k) + r * a
    p = 1.0 + r * a
    ni = n.clamp(-200, 200).to(torch.int32)
    normal = p * pow2((ni + 127).clamp(1, 254))
    sub = (p * pow2((ni + 191).clamp(1, 254))) * f32_from_bits(63 << 23)
    y = torch.where(ni >= -126, normal, sub)
    y = torch.where(ni < -151, torch.zeros_like(y), y)
    y = torch.where(torch.isneginf(x), torch.zeros_like(y), y)
    return torch.where(torch.isnan(x), x, y)

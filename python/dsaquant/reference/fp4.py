"""SPEC §1-§3 and §7.2 stages: E2M1 codes, the three rounding policies, UE8M0 block scales.

Tensors may live on any device. Codes are uint8 tensors holding one 4-bit code per element
(bit 3 the sign, bits 0..2 the magnitude index) unless a function says it packs them.
"""
from __future__ import annotations

import torch

from ..codes import ROUNDINGS as POLICIES, SCALE_RULES  # noqa: F401  (the option strings, in code order)
from .arith import F32, INV6, bits, canon_nan, cast, ceil_exp, div, f32_from_bits, nan_amax, pow2

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes, and whether a tie at that midpoint goes up
# (to the even index) under round-half-to-even.
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def check_policy(rounding: str) -> str:
    if rounding not in POLICIES:
        raise ValueError(f"rounding must be one of {POLICIES}, got {rounding!r}")
    return rounding


def e2m1_encode(v: torch.Tensor, rounding: str) -> torch.Tensor:
    """SPEC §2: already-scaled fp32 values `v` (any shape) -> uint8 E2M1 codes, one per element."""
    check_policy(rounding)
    v = v.to(F32)
    a = v.abs()
    m = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for mid, tie_up in _MIDPOINTS:
        up = (a >= mid) if (tie_up and rounding != "threshold") else (a > mid)
        m += up.to(torch.uint8)
    nan = torch.isnan(v)
    m = torch.where(nan, torch.full_like(m, 7), m)
    if rounding == "hardware":
        sign = (bits(v) < 0).to(torch.uint8) << 3
    else:
        sign = ((v < 0) & (m != 0)).to(torch.uint8) << 3
    return m | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """SPEC §1: uint8 codes (low nibble used) -> fp32 values; 0x8 gives -0."""
    c = codes.to(torch.int64) & 0xF
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=F32, device=codes.device)
    val = mags[c & 7]
    return torch.where((c & 8) != 0, -val, val)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """SPEC §1 packing: codes [..., n] -> bytes [..., n/2]; element 2i low nibble, 2i+1 high."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_nibbles`: bytes [..., n/2] -> codes [..., n] (uint8)."""
    p = packed.to(torch.uint8)
    return torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def ue8m0_exponent(amax: torch.Tensor, rule: str) -> torch.Tensor:
    """SPEC §3: fp32 block maxima (>= 0) -> int32 biased UE8M0 exponents by rule `pack` or `recip`."""
    amax = amax.to(F32)
    if rule == "pack":
        f = torch.clamp_min(div(amax, 6.0), f32_from_bits(0x38D1B717))  # max(amax / 6.0f, 1e-4f)
        return ceil_exp(f).clamp(1, 254)
    if rule == "recip":
        f = torch.clamp_min(amax, 6.0 * 2.0 ** -126) * INV6
        e = ceil_exp(f)
        return torch.where(((bits(f) >> 23) & 0xFF) == 0xFF, torch.full_like(e, 255), e)
    raise ValueError(f"rule must be one of {SCALE_RULES}, got {rule!r}")


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., n] -> canonical-NaN fp32 [..., n/block, block] (a quantizer's entry, see canon_nan)."""
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"last dim {n} is not a multiple of the block size {block}")
    return canon_nan(x).reshape(*x.shape[:-1], n // block, block)


def fp4_quantize(x: torch.Tensor, rounding: str = "rne", rule: str = "recip", block: int = 32):
    """SPEC §3 + §2: x [..., n] (any float dtype, converted exactly) -> (packed uint8 [..., n/2],
    exponents uint8 [..., n/block]). A NaN-scale block (e = 255) gets `sign|7` codes under
    `hardware` and 7 otherwise. NaN elements are canonical (positive) first: they give 0x7 under
    every policy (unlike the raw `e2m1_encode`, whose input NaN keeps its sign)."""
    check_policy(rounding)
    xb = _blocks(x, block)
    e = ue8m0_exponent(nan_amax(xb, -1), rule)
    v = xb / pow2(e).unsqueeze(-1)
    codes = e2m1_encode(v, rounding)
    nan_scale = (e == 255).unsqueeze(-1)
    if rounding == "hardware":
        fill = ((bits(xb) < 0).to(torch.uint8) << 3) | 7
    else:
        fill = torch.full_like(codes, 7)
    codes = torch.where(nan_scale, fill, codes)
    return pack_nibbles(codes.reshape(x.shape)), e.to(torch.uint8)


def fp4_dequantize(packed: torch.Tensor, exponents: torch.Tensor, block: int = 32) -> torch.Tensor:
    """packed uint8 [..., n/2] + exponents uint8 [..., n/block] -> fp32 [..., n] (value * 2^(e-127))."""
    vals = e2m1_decode(unpack_nibbles(packed))
    n = vals.shape[-1]
    vb = vals.reshape(*vals.shape[:-1], n // block, block)
    e = exponents.to(torch.int32)
    scale = torch.where(e == 255, torch.full(e.shape, float("nan"), device=e.device), pow2(e))
    return (vb * scale.unsqueeze(-1)).reshape(vals.shape)


def _grid_rne_value(a: torch.Tensor) -> torch.Tensor:
    """|y| (fp32, <= 6) rounded half-to-even onto the E2M1 grid, as a value."""
    return e2m1_decode(e2m1_encode(a, "rne") & 7)


def e4m3_rne_value(x: torch.Tensor) -> torch.Tensor:
    """x fp32 (finite, in range) rounded to the nearest e4m3fn value, as fp32 (SPEC §7.2 e4m3 scale)."""
    from .fp8 import fp8_decode, fp8_encode
    return fp8_decode(fp8_encode(x, "e4m3fn"), "e4m3fn")


def fp4_fake_quant(x: torch.Tensor, block: int = 32, scale: str = "ue8m0", out_dtype=None) -> torch.Tensor:
    """SPEC §7.2 stage 1 on any tensor whose last dim is a multiple of `block`.

    `scale="ue8m0"` (block 32): e by rule `recip`, s = 2^(e-127). `scale="e4m3"` (block 16):
    s = e4m3_rne(clamp(fl(amax * fl(1/6)), 2^-9, 448)). Then y = clamp(x / s, -6, 6), |y| rounded
    half-to-even onto the E2M1 grid with the sign of y (a zero y counts as positive), times s,
    rounded to `out_dtype` (default: x's dtype). NaN stays NaN.
    """
    out_dtype = out_dtype or x.dtype
    xb = _blocks(x, block)
    amax = nan_amax(xb, -1)
    if scale == "ue8m0":
        s = pow2(ue8m0_exponent(amax, "recip"))
    elif scale == "e4m3":
        s = e4m3_rne_value(torch.clamp(amax * INV6, 2.0 ** -9, 448.0))
    else:
        raise ValueError(f"scale must be 'ue8m0' or 'e4m3', got {scale!r}")
    s = s.unsqueeze(-1)
    y = torch.clamp(xb / s, -6.0, 6.0)
    r = _grid_rne_value(y.abs())
    q = torch.where(y < 0, -r, r)
    q = torch.where(torch.isnan(y), y, q)
    out = q * s
    return cast(out, out_dtype).reshape(x.shape)


def sglang_two_stage(x: torch.Tensor, rounding: str):
    """SPEC §7.2 stage 1 (recip fake-quant, bf16) then stage 2 (rule `pack`, codes by `rounding`).

    x [..., 128] fp32 values -> (packed uint8 [..., 64], exponents uint8 [..., 4]).
    """
    staged = fp4_fake_quant(x.to(F32), 32, "ue8m0", out_dtype=torch.bfloat16).to(F32)
    return fp4_quantize(staged, rounding, "pack", 32)

"""SPEC §4: FP8 E4M3 encoding (flavours e4m3fn and e4m3fnuz) and the per-row scales of q and k."""
from __future__ import annotations

import torch

from .arith import F32, bits, canon_nan, ceil_exp, div, f32_from_bits, nan_amax, pow2

# flavour -> (exponent bias, max finite value, NaN code)
FLAVOURS = {"e4m3fn": (7, 448.0, 0x7F), "e4m3fnuz": (8, 240.0, 0x80)}


def check_flavour(flavour: str) -> str:
    if flavour not in FLAVOURS:
        raise ValueError(f"fp8 flavour must be one of {tuple(FLAVOURS)}, got {flavour!r}")
    return flavour


def fp8_encode(x: torch.Tensor, flavour: str = "e4m3fn") -> torch.Tensor:
    """SPEC §4: fp32 values -> uint8 E4M3 codes (round half to even, saturate finite values and
    ±Inf to ±max (ours: satfinite), NaN -> NaN code; -0 and negatives that round to 0 give 0x80
    for e4m3fn and 0x00 for e4m3fnuz)."""
    bias, fmax, nan_code = FLAVOURS[check_flavour(flavour)]
    x = x.to(F32)
    neg = bits(x) < 0
    a = torch.clamp(x.abs(), max=fmax)                       # Inf saturates too; NaN stays NaN
    emin = 1 - bias                                           # smallest normal exponent
    e = torch.clamp_min(((bits(a) >> 23) & 0xFF) - 127, emin)  # unbiased exponent of a's binade
    q = pow2(e - 3 + 127)                                     # quantum: 3 mantissa bits
    n = torch.round(a / q)                                    # exact division, then rint
    r = torch.clamp(n * q, max=fmax)                          # carries into the next binade are fine
    rb = bits(r)
    re = ((rb >> 23) & 0xFF) - 127
    normal = r >= f32_from_bits((emin + 127) << 23)
    code_norm = ((re + bias) << 3) | ((rb >> 20) & 7)
    code_sub = (r / f32_from_bits((emin - 3 + 127) << 23)).to(torch.int32)
    code = torch.where(normal, code_norm, code_sub)
    if flavour == "e4m3fn":
        code = code | (neg.to(torch.int32) << 7)
    else:
        code = code | ((neg & (code != 0)).to(torch.int32) << 7)
    nan = torch.isnan(x)
    nan_val = (nan_code | (neg.to(torch.int32) << 7)) if flavour == "e4m3fn" else torch.full_like(code, nan_code)
    code = torch.where(nan, nan_val, code)
    return code.to(torch.uint8)


def fp8_decode(codes: torch.Tensor, flavour: str = "e4m3fn") -> torch.Tensor:
    """uint8 E4M3 codes -> fp32 values (NaN codes give NaN)."""
    bias, _, nan_code = FLAVOURS[check_flavour(flavour)]
    c = codes.to(torch.int32) & 0xFF
    s = (c >> 7) & 1
    e = (c >> 3) & 0xF
    m = (c & 7).to(F32)
    mag = torch.where(e == 0, m * 2.0 ** (1 - bias - 3), (8.0 + m) * pow2(e - bias - 3 + 127))
    val = torch.where(s == 1, -mag, mag)
    if flavour == "e4m3fn":
        isnan = (c & 0x7F) == 0x7F
    else:
        isnan = c == 0x80
    return torch.where(isnan, torch.full_like(val, float("nan")), val)


def fp8_scale(amax: torch.Tensor, flavour: str, role: str, scale_fmt) -> torch.Tensor:
    """SPEC §4 scale of one row: q: max(amax, 1e-10f) * fl(1/fmax); k: max(amax, 1e-4f) / fmax;
    with scale_fmt == "ue8m0" rounded up to a power of two on bits. fp32 tensor."""
    _, fmax, _ = FLAVOURS[check_flavour(flavour)]
    amax = amax.to(F32)
    if role == "q":
        s = torch.clamp_min(amax, f32_from_bits(0x2EDBE6FF)) * (1.0 / torch.tensor(fmax, dtype=F32)).item()
    elif role == "k":
        s = div(torch.clamp_min(amax, f32_from_bits(0x38D1B717)), fmax)
    else:
        raise ValueError(f"role must be 'q' or 'k', got {role!r}")
    if scale_fmt == "ue8m0":
        s = pow2(ceil_exp(s))
    elif scale_fmt not in (None, "", "fp32", "none"):
        raise ValueError(f"scale_fmt must be 'ue8m0' or None, got {scale_fmt!r}")
    return s


def fp8_quantize(x: torch.Tensor, flavour: str = "e4m3fn", role: str = "k", scale_fmt=None, block: int = 128):
    """SPEC §4: x [..., n] -> (uint8 codes [..., n], fp32 scales [..., n/block]); codes encode x * fl(1/s)."""
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"last dim {n} is not a multiple of the block size {block}")
    xb = canon_nan(x).reshape(*x.shape[:-1], n // block, block)
    s = fp8_scale(nan_amax(xb, -1), flavour, role, scale_fmt)
    inv = 1.0 / s
    codes = fp8_encode(canon_nan(xb * inv.unsqueeze(-1)), flavour)
    return codes.reshape(x.shape), s

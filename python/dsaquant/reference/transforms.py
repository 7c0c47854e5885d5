"""SPEC §5: RoPE (neox / interleaved, head / tail), LayerNorm, RMSNorm and the 128-point Hadamard.

All functions take and return fp32 tensors whose last dim is the 128-wide row (D for RMSNorm);
callers round to bf16 where the SPEC says so.
"""
from __future__ import annotations

import torch

from .. import errors

from .arith import F32, INV_SQRT128, canonical_sum, div, to_f32_scalar


def _inv_sqrt(v: torch.Tensor) -> torch.Tensor:
    """fl(1 / fl(sqrt(v))) with a correctly rounded sqrt: torch's CPU fp32 sqrt is off by 1 ulp on some
    builds (AVX-512), so take it in fp64 and round once (exact for sqrt: 53 >= 2*24 + 2 bits)."""
    return 1.0 / torch.sqrt(v.double()).float()

ROPE_DIM = 64
HEAD_DIM = 128


def rope_positions(positions: torch.Tensor, max_pos: int, compress_ratio: int = 1) -> torch.Tensor:
    """Positions used for the table look-up (int64): `pos & ~(r-1)`, then clamped into [0, max_pos)
    (SPEC §5, §7.5). A raw position outside [0, max_pos) raises the device error flag
    POSITION_OUT_OF_RANGE (reported by dsaquant.check_errors())."""
    p = positions.to(torch.int64)
    errors.flag_if((p < 0) | (p >= max_pos), errors.POSITION_OUT_OF_RANGE)
    if compress_ratio > 1:
        p = p & ~(compress_ratio - 1)
    return p.clamp(0, max_pos - 1)


def cos_sin(positions: torch.Tensor, cos_cache=None, sin_cache=None, freqs=None, compress_ratio: int = 1):
    """Look up (cos, sin), each fp32 [T, 32], from `cos_cache`/`sin_cache` [max_pos, 32] (any float
    dtype, converted exactly) or `freqs` [max_pos, 64] fp32 holding (cos, sin) pairs (SPEC §5)."""
    if freqs is not None:
        p = rope_positions(positions, freqs.shape[0], compress_ratio)
        rows = freqs[p].to(F32)
        return rows[..., 0::2], rows[..., 1::2]
    p = rope_positions(positions, cos_cache.shape[0], compress_ratio)
    return cos_cache[p].to(F32), sin_cache[p].to(F32)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool, tail: bool) -> torch.Tensor:
    """SPEC §5 RoPE on 64 dims of each 128 row. x fp32 [..., 128]; cos, sin fp32 broadcastable to
    [..., 32]. neox pairs (j, j+32), interleaved pairs (2j, 2j+1); head = dims 0..63, tail = 64..127.
    a' = fl(fl(a*c) - fl(b*s)), b' = fl(fl(b*c) + fl(a*s)). Returns fp32, not rounded."""
    x = x.to(F32)
    off = HEAD_DIM - ROPE_DIM if tail else 0
    r = x[..., off:off + ROPE_DIM]
    if neox:
        a, b = r[..., :32], r[..., 32:]
    else:
        a, b = r[..., 0::2], r[..., 1::2]
    a2 = a * cos - b * sin
    b2 = b * cos + a * sin
    if neox:
        rot = torch.cat((a2, b2), dim=-1)
    else:
        rot = torch.stack((a2, b2), dim=-1).reshape(r.shape)
    parts = [x[..., :off], rot, x[..., off + ROPE_DIM:]]
    return torch.cat([p for p in parts if p.shape[-1]], dim=-1)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """SPEC §5 LayerNorm over the last dim (128): mean = S(x)/n, d = x - mean, var = S(d*d)/n,
    inv = 1/sqrt(var + eps), y = fl(fl(d*inv) * w) + b. fp32 in and out (not rounded)."""
    x = x.to(F32)
    n = x.shape[-1]
    mean = div(canonical_sum(x), n)
    d = x - mean.unsqueeze(-1)
    var = div(canonical_sum(d * d), n)
    inv = _inv_sqrt(var + to_f32_scalar(eps))
    return (d * inv.unsqueeze(-1)) * weight.to(F32) + bias.to(F32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """SPEC §5 RMSNorm over the last dim: inv = 1/sqrt(S(x*x)/n + eps), y = fl(w * fl(x*inv)).
    fp32 in and out (not rounded)."""
    x = x.to(F32)
    n = x.shape[-1]
    inv = _inv_sqrt(div(canonical_sum(x * x), n) + to_f32_scalar(eps))
    return weight.to(F32) * (x * inv.unsqueeze(-1))


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """SPEC §5 Hadamard over the last dim (a power of two; 128 for the indexer), Sylvester order:
    for h = 1, 2, 4, ...: (a, b) at (i, i+h) with bit h of i clear -> (a+b, a-b); then times
    fl(n^-0.5) (for n = 128 the constant fl(128^-0.5)). fp32 in and out."""
    x = x.to(F32)
    n = x.shape[-1]
    h = 1
    while h < n:
        y = x.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*x.shape[:-1], n)
        h *= 2
    c = INV_SQRT128 if n == 128 else torch.tensor(n ** -0.5, dtype=F32).item()
    return x * c

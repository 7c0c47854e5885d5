"""Top-k selection per row of a logits matrix (docs/topk.md). Reference (torch, any device).

The order of selection is a strict total order, so the output bytes are unique:
  * a candidate is a position p of the row's span whose value is neither NaN nor -inf;
  * larger value first, compared as floats (-0.0 == +0.0), +inf first of all;
  * equal values: the smaller position first.
Each row lists its min(k, #candidates) selected positions in that order, then -1 up to k.

`order_key` maps a value to an unsigned 32-bit integer (held in int64) that compares like the value:
0 for NaN and -inf (never selected), and every other value above 0. The Triton kernel computes the same key.
"""
from __future__ import annotations

import torch

# Span forms (which arguments describe a row's candidate positions). The Triton kernel restates them.
DECODE_1D, DECODE_2D, PREFILL = 0, 1, 2


def order_key(x: torch.Tensor) -> torch.Tensor:
    """Float tensor (fp32/bf16/fp16, any shape) -> int64 tensor of uint32 order keys, same shape.

    -0.0 becomes +0.0; then the sign bit is flipped for non-negative values and every bit inverted for
    negative ones, which makes unsigned integer order equal float order. NaN and -inf map to 0."""
    x = x.float()
    x = torch.where(x == 0, torch.zeros_like(x), x)
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    key = torch.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits | 0x80000000)
    return torch.where(x > float("-inf"), key, torch.zeros_like(key))


def span_form(context_lens, ks) -> int:
    """The span form of a call: DECODE_1D, DECODE_2D (context_lens [B, next_n]) or PREFILL."""
    if context_lens is None:
        return PREFILL
    return DECODE_2D if context_lens.dim() == 2 else DECODE_1D


def row_spans(rows: int, L: int, context_lens=None, next_n: int = 1, ks=None, ke=None):
    """(start, end) int64 [rows] of every row, clamped so that 0 <= start <= L and start <= end <= L.

    Decode (context_lens given): start 0; with context_lens [B], row b*next_n + j ends at
    context_lens[b] - next_n + j + 1 (query j of the next_n of sequence b); with [B, next_n], at
    context_lens[b, j]. Prefill (ks, ke [rows]): the row is [ks[i], ke[i]); ks > ke is empty."""
    if context_lens is not None:
        dev = context_lens.device
        c = context_lens.to(torch.int64)
        if c.dim() == 2:
            end = c.reshape(-1)
        else:
            r = torch.arange(rows, device=dev)
            end = c[r // next_n] - next_n + (r % next_n) + 1
        start = torch.zeros_like(end)
    else:
        start, end = ks.to(torch.int64), ke.to(torch.int64)
    start = start.clamp(0, L)
    end = torch.maximum(end.clamp(0, L), start)
    return start, end


def topk_indices(logits: torch.Tensor, k: int, context_lens, next_n: int, ks, ke, relative: bool,
                 out: torch.Tensor) -> None:
    """Writes out int32 [rows, k]: the selected positions of each row of logits [rows, L] (fp32, bf16 or
    fp16), in selection order (module docstring), -1 after them. With `relative`, positions are given
    minus the row's (clamped) start. Arguments are validated by dsaquant.topk."""
    rows, L = logits.shape
    if rows == 0:
        return
    out.fill_(-1)
    if L == 0:
        return
    start, end = row_spans(rows, L, context_lens, next_n, ks, ke)
    pos = torch.arange(L, device=logits.device)
    inside = (pos >= start[:, None]) & (pos < end[:, None])
    key = torch.where(inside, order_key(logits), torch.zeros((), dtype=torch.int64, device=logits.device))
    # stable: equal keys keep their position order, so ties go to the smaller position
    skey, order = torch.sort(key, dim=1, descending=True, stable=True)
    m = min(k, L)
    skey, order = skey[:, :m], order[:, :m]
    if relative:
        order = order - start[:, None]
    out[:, :m] = torch.where(skey > 0, order, torch.full_like(order, -1)).to(torch.int32)

"""vLLM's per-row top-k selection for the sparse-attention indexer, with vLLM's signatures (the custom ops
`torch.ops._C.top_k_per_row_prefill` and `torch.ops._C.top_k_per_row_decode`): arguments mapped onto
dsaquant.topk_indices, nothing computed here. docs/compat.md ("vLLM") gives the mapping and the three
places where the bytes may differ from vLLM's kernels (order within a row, ties at the k-th value,
NaN / -inf logits).
"""
from __future__ import annotations

import torch

from .. import validate as V
from ..topk import topk_indices


def _rows_view(logits, num_rows, stride0, stride1):
    """logits[:num_rows] after checking that (stride0, stride1) are logits' own strides (the only view
    vLLM's callers pass; any other would read outside the tensor)."""
    V.tensor("logits", logits, V.FLOATS, (None, None), last_contiguous=True)
    V.number("num_rows", num_rows, (int,))
    V.number("stride0", stride0, (int,))
    V.number("stride1", stride1, (int,))
    if not 0 <= num_rows <= logits.shape[0]:
        raise ValueError(f"num_rows: expected 0 <= num_rows <= logits.shape[0] = {logits.shape[0]}, got {num_rows}")
    if logits.shape[1] > 1 and (stride0, stride1) != (logits.stride(0), logits.stride(1)):
        raise ValueError(f"stride0, stride1: expected logits' strides {tuple(logits.stride())}, "
                         f"got ({stride0}, {stride1})")
    return logits[:num_rows]


def _target(indices, num_rows, top_k, device):
    """The [num_rows, top_k] block of `indices` to fill: the tensor itself when it is exactly that and
    contiguous, else None (the result is computed into a new tensor and copied into the block)."""
    V.tensor("indices", indices, (torch.int32,), (None, None), device)
    V.number("top_k", top_k, (int,))
    if indices.shape[0] < num_rows or indices.shape[1] < top_k:
        raise ValueError(f"indices: expected at least [num_rows, top_k] = [{num_rows}, {top_k}], "
                         f"got {list(indices.shape)}")
    block = indices[:num_rows, :top_k]
    return block, (block if block.is_contiguous() else None)


def top_k_per_row_prefill(logits, row_starts, row_ends, indices, num_rows, stride0, stride1, top_k):
    """vLLM `top_k_per_row_prefill(logits, rowStarts, rowEnds, indices!, numRows, stride0, stride1, topK)`.

    logits fp32 (bf16/fp16 accepted) [>= num_rows, L]; row_starts, row_ends int32 (int64 accepted)
    [num_rows]; indices int32 [>= num_rows, >= top_k], written in place: row i's top_k positions among
    row_starts[i] <= p < row_ends[i], **relative to row_starts[i]**, -1 padding. Returns None, like vLLM.
    """
    x = _rows_view(logits, num_rows, stride0, stride1)
    block, out = _target(indices, num_rows, top_k, logits.device)
    V.tensor("row_starts", row_starts, V.INDEX, None, logits.device)
    V.tensor("row_ends", row_ends, V.INDEX, None, logits.device)
    if row_starts.dim() != 1 or row_starts.shape[0] < num_rows:
        raise ValueError(f"row_starts: expected shape [num_rows = {num_rows}], got {list(row_starts.shape)}")
    if row_ends.dim() != 1 or row_ends.shape[0] < num_rows:
        raise ValueError(f"row_ends: expected shape [num_rows = {num_rows}], got {list(row_ends.shape)}")
    res = topk_indices(x, top_k, ks=row_starts[:num_rows], ke=row_ends[:num_rows], relative=True, out=out)
    if out is None:
        block.copy_(res)


def top_k_per_row_decode(logits, next_n, seq_lens, indices, num_rows, stride0, stride1, top_k):
    """vLLM `top_k_per_row_decode(logits, next_n, seq_lens, indices!, numRows, stride0, stride1, topK)`.

    logits fp32 (bf16/fp16 accepted) [>= num_rows, L], num_rows = B * next_n; seq_lens int32 (int64
    accepted) [B] (row b*next_n + j sees p < seq_lens[b] - next_n + j + 1) or [B, next_n] (p < seq_lens[b, j]);
    indices int32 [>= num_rows, >= top_k], written in place (positions from 0, -1 padding). Returns None.
    """
    x = _rows_view(logits, num_rows, stride0, stride1)
    block, out = _target(indices, num_rows, top_k, logits.device)
    res = topk_indices(x, top_k, context_lens=seq_lens, next_n=next_n, out=out)
    if out is None:
        block.copy_(res)

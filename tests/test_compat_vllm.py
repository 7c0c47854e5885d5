"""dsaquant.compat.vllm: vLLM's top_k_per_row_prefill / top_k_per_row_decode signatures and semantics
(docs/compat.md, "vLLM"), against a plain computation in this file: torch.sort of each row's span, in
vLLM's call pattern (indices written in place, strides passed explicitly, prefill positions relative to
the row start, -1 padding).
"""
from __future__ import annotations

import pytest
import torch

from dsaquant.compat import vllm


def plain(logits, starts, ends, k):
    """Row i: the positions of logits[i, starts[i]:ends[i]] by descending value (stable, so equal values in
    position order), minus starts[i], then -1. The rows here hold distinct finite values, or ties."""
    rows = []
    for i in range(logits.shape[0]):
        s, e = int(starts[i]), int(ends[i])
        seg = logits[i, s:e].float()
        order = torch.sort(seg, descending=True, stable=True).indices[:k].tolist()
        rows.append(order + [-1] * (k - len(order)))
    return torch.tensor(rows, dtype=torch.int32)


def test_prefill_relative_positions_in_place():
    g = torch.Generator().manual_seed(0)
    rows, L, k = 6, 300, 16
    logits = torch.randn(rows, L, generator=g)
    starts = torch.tensor([0, 10, 100, 250, 5, 299], dtype=torch.int32)
    ends = torch.tensor([300, 200, 116, 260, 5, 300], dtype=torch.int32)   # 16 = k, 10 < k, empty, 1
    indices = torch.full((rows, k), 77, dtype=torch.int32)
    assert vllm.top_k_per_row_prefill(logits, starts, ends, indices, rows, logits.stride(0),
                                      logits.stride(1), k) is None
    assert torch.equal(indices, plain(logits, starts, ends, k))
    assert indices[1].max() < 190 and indices[4].tolist() == [-1] * k


def test_prefill_ties_take_smaller_positions():
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.5, 2.0]])
    indices = torch.empty((1, 3), dtype=torch.int32)
    vllm.top_k_per_row_prefill(logits, torch.tensor([1], dtype=torch.int32), torch.tensor([6], dtype=torch.int32),
                               indices, 1, 6, 1, 3)
    assert indices.tolist() == [[0, 1, 2]]     # positions 1, 2, 3 relative to the start 1


@pytest.mark.parametrize("next_n", [1, 2, 4])
def test_decode_mtp_rule(next_n):
    g = torch.Generator().manual_seed(next_n)
    B, L, k = 3, 200, 24
    logits = torch.randn(B * next_n, L, generator=g)
    seq_lens = torch.tensor([200, 30, next_n], dtype=torch.int32)
    indices = torch.full((B * next_n, k), 77, dtype=torch.int32)
    vllm.top_k_per_row_decode(logits, next_n, seq_lens, indices, B * next_n, L, 1, k)
    r = torch.arange(B * next_n)
    ends = seq_lens[r // next_n] - next_n + r % next_n + 1
    assert torch.equal(indices, plain(logits, torch.zeros_like(ends), ends, k))


def test_decode_2d_seq_lens_per_row():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 50, generator=g)
    seq_lens = torch.tensor([[50, 3], [0, 20]], dtype=torch.int32)
    indices = torch.full((4, 8), 77, dtype=torch.int32)
    vllm.top_k_per_row_decode(logits, 2, seq_lens, indices, 4, 50, 1, 8)
    assert torch.equal(indices, plain(logits, torch.zeros(4, dtype=torch.int32), seq_lens.reshape(-1), 8))


def test_wider_indices_and_fewer_rows():
    """indices [>= num_rows, >= top_k]: only the [num_rows, top_k] block is written; logits rows past
    num_rows are not read."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 64, generator=g)
    logits[3:] = float("nan")
    indices = torch.full((6, 12), 77, dtype=torch.int32)
    starts = torch.zeros(3, dtype=torch.int32)
    ends = torch.full((3,), 64, dtype=torch.int32)
    vllm.top_k_per_row_prefill(logits, starts, ends, indices, 3, 64, 1, 10)
    assert torch.equal(indices[:3, :10], plain(logits[:3], starts, ends, 10))
    assert (indices[3:] == 77).all() and (indices[:, 10:] == 77).all()


def test_strided_rows():
    g = torch.Generator().manual_seed(8)
    big = torch.randn(4, 96, generator=g)
    logits = big[:, :80]
    indices = torch.empty((4, 5), dtype=torch.int32)
    vllm.top_k_per_row_decode(logits, 1, torch.tensor([80, 40, 7, 1]), indices, 4, 96, 1, 5)
    assert torch.equal(indices, plain(logits, torch.zeros(4), torch.tensor([80, 40, 7, 1]), 5))


@pytest.mark.parametrize("call, name", [
    (lambda x, i: vllm.top_k_per_row_prefill(x, torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32),
                                             i, 2, 16, 2, 4), "stride"),
    (lambda x, i: vllm.top_k_per_row_prefill(x, torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32),
                                             i, 3, 8, 1, 4), "num_rows"),
    (lambda x, i: vllm.top_k_per_row_prefill(x, torch.zeros(1, dtype=torch.int32), torch.ones(2, dtype=torch.int32),
                                             i, 2, 8, 1, 4), "row_starts"),
    (lambda x, i: vllm.top_k_per_row_prefill(x, torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32),
                                             i, 2, 8, 1, 5), "indices"),
    (lambda x, i: vllm.top_k_per_row_decode(x, 1, torch.ones(2, dtype=torch.int32), i.long(), 2, 8, 1, 4), "indices"),
    (lambda x, i: vllm.top_k_per_row_decode(x, 2, torch.ones(2, dtype=torch.int32), i, 2, 8, 1, 4), "logits"),
    (lambda x, i: vllm.top_k_per_row_decode(x, 1, torch.ones(2), i, 2, 8, 1, 4), "context_lens"),
    (lambda x, i: vllm.top_k_per_row_decode(x, 1, torch.ones(2, dtype=torch.int32), i, 2, 8, 1, 0), "k"),
])
def test_bad_arguments_write_nothing(call, name):
    x = torch.randn(2, 8)
    i = torch.full((2, 4), 77, dtype=torch.int32)
    with pytest.raises((ValueError, TypeError), match=name):
        call(x, i)
    assert (i == 77).all()

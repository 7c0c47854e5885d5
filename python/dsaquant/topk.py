"""`topk_indices`: the top-k positions of every row of a logits matrix (docs/topk.md), the indexer's
selection step. Validate (SPEC §7.5) -> pick a backend (dispatch.py) -> one torch.library op that writes
`out`, with a fake implementation, as in ops.py.
"""

from typing import Optional

import torch
from torch import Tensor

from . import dispatch
from . import validate as V

INT32_MAX = 2**31 - 1


@dispatch.library_op("dsaquant::topk_indices", mutates_args=("out",))
def _topk_op(logits: Tensor, k: int, context_lens: Optional[Tensor], next_n: int, ks: Optional[Tensor],
             ke: Optional[Tensor], relative: bool, out: Tensor, backend: str) -> None:
    dispatch.get(backend, "topk_indices")(logits, k, context_lens, next_n, ks, ke, relative, out)


@_topk_op.register_fake
def _(*args, **kwargs) -> None:
    return None


def topk_indices(logits, k, *, context_lens=None, next_n=1, ks=None, ke=None, relative=False, out=None,
                 backend=None):
    """The k largest logits of every row, as positions: int32 [rows, k] (docs/topk.md).

    logits [rows, L] fp32, bf16 or fp16, last dim contiguous (the row stride may exceed L).
    One of two span forms (exactly one):
      decode:  context_lens int32/int64 [B] or [B, next_n], rows = B * next_n. With [B], row b*next_n + j
               sees positions p < context_lens[b] - next_n + j + 1; with [B, next_n], p < context_lens[b, j].
      prefill: ks, ke int32/int64 [rows]; row i sees ks[i] <= p < ke[i] (ks > ke: no position).
    Spans are clamped to [0, L]. Order: larger value first (-0.0 == +0.0), ties to the smaller position;
    NaN and -inf are never selected; rows with fewer than k candidates end in -1. relative=True gives
    positions minus the row's clamped start (ks[i] in prefill, 0 in decode); -1 stays -1.
    out: int32 [rows, k] contiguous to write into (returned); allocated when None.
    """
    V.tensor("logits", logits, V.FLOATS, (None, None), last_contiguous=True)
    rows, L = logits.shape
    dev = logits.device
    V.number("k", k, (int,))
    if k <= 0 or k > INT32_MAX:
        raise ValueError(f"k: expected 1 <= k <= {INT32_MAX}, got {k}")
    if L > INT32_MAX:
        raise ValueError(f"logits: rows longer than {INT32_MAX} positions do not fit int32 indices, got L = {L}")
    V.number("next_n", next_n, (int,))
    if next_n < 1:
        raise ValueError(f"next_n: expected >= 1, got {next_n}")
    V.flag("relative", relative)
    if context_lens is not None:
        if ks is not None or ke is not None:
            raise ValueError("context_lens, ks, ke: give either context_lens (decode) or ks and ke (prefill), not both")
        V.tensor("context_lens", context_lens, V.INDEX, None, dev)
        if context_lens.dim() == 1:
            B = context_lens.shape[0]
        elif context_lens.dim() == 2 and context_lens.shape[1] == next_n:
            B = context_lens.shape[0]
        else:
            raise ValueError(f"context_lens: expected shape [B] or [B, next_n={next_n}], got {list(context_lens.shape)}")
        if B * next_n != rows:
            raise ValueError(f"logits: expected B * next_n = {B} * {next_n} = {B * next_n} rows "
                             f"(context_lens has B = {B}), got {rows}")
        context_lens = context_lens.contiguous()
    else:
        if ks is None or ke is None:
            missing = "ks and ke" if ks is None and ke is None else ("ks" if ks is None else "ke")
            raise ValueError(f"{missing}: give either context_lens (decode) or both ks and ke (prefill); "
                             f"{missing} missing")
        V.tensor("ks", ks, V.INDEX, (rows,), dev)
        V.tensor("ke", ke, V.INDEX, (rows,), dev)
        ks, ke = ks.contiguous(), ke.contiguous()
    if out is None:
        out = torch.empty((rows, k), dtype=torch.int32, device=dev)
    V.tensor("out", out, (torch.int32,), (rows, k), dev, contiguous=True)
    if rows == 0:
        return out
    if L == 0:
        out.fill_(-1)
        return out
    name = dispatch.choose_for("topk_indices", dev, backend, rows)
    _topk_op(logits, k, context_lens, next_n, ks, ke, relative, out, name)
    return out

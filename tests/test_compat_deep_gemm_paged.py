"""dsaquant.compat.deep_gemm's paged logits against computations written here in plain torch: DeepGEMM's
cache views ([num_blocks, block_kv, 1, 132] FP8 and [.., 68] FP4), its next_n rule for 1-D context
lengths, clean_logits, the FP4 tuple form and the schedule metadata."""
from __future__ import annotations

import pytest
import torch

from dsaquant.compat import deep_gemm as dg

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def fp8_case(B=3, N=2, H=16, P=32, pages=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    NB = B * pages + 1
    codes = torch.randint(0, 0x78, (NB, P, 128), generator=g, dtype=torch.uint8)   # |v| <= 240, no NaN
    codes |= torch.randint(0, 2, codes.shape, generator=g, dtype=torch.uint8) << 7
    scales = torch.rand(NB, P, generator=g) * 0.1 + 0.01
    kv = torch.cat((codes.reshape(NB, P * 128), scales.view(torch.uint8).reshape(NB, P * 4)), 1).reshape(NB, P, 1, 132)
    q = torch.randint(0, 0x78, (B, N, H, 128), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    w = torch.randn(B * N, H, generator=g)
    table = torch.randperm(NB, generator=g)[:B * pages].reshape(B, pages).to(torch.int32)
    return q, kv, w, table


def expected(qf, kf_of, w, table, lens2d, L, P, clean=True, fill=float("nan")):
    """qf float64 [B, N, H, 128]; kf_of(page, o) -> float64 [128]; lens2d [B, N] (unclamped)."""
    B, N, H, _ = qf.shape
    out = torch.full((B * N, L), fill, dtype=torch.float64)
    for b in range(B):
        keys = torch.stack([kf_of(int(table[b, p // P]), p % P) for p in range(min(L, table.shape[1] * P))])
        for n in range(N):
            ln = max(0, min(int(lens2d[b, n]), L))
            dots = qf[b, n] @ keys[:ln].T                                   # [H, ln]
            out[b * N + n, :ln] = (torch.relu(dots) * w[b * N + n].double()[:, None]).sum(0)
            if clean:
                out[b * N + n, ln:] = float("-inf")
    return out


def check_close(got, want, mag, mask):
    """-inf where expected; |got - want| <= 1e-5 * mag, mag = sum_h |w_h| sum_d |q_hd k_pd|."""
    assert torch.equal(torch.isneginf(got[mask]), torch.isneginf(want[mask]))
    fin = torch.isfinite(want) & mask
    err = (got.double()[fin] - want[fin]).abs() / (mag[fin] + 1e-30)
    assert float(err.max()) < 1e-5


def fp8_keys(kv, P):
    codes = kv.reshape(kv.shape[0], -1)[:, :P * 128].reshape(-1, P, 128).view(torch.float8_e4m3fn).double()
    scales = kv.reshape(kv.shape[0], -1)[:, P * 128:].contiguous().view(torch.float32).double()
    return lambda page, o: codes[page, o] * scales[page, o]


@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("clean", [True, False])
def test_fp8_paged_mqa_logits(two_d, clean):
    B, N, H, P, L = 3, 2, 16, 32, 128
    q, kv, w, table = fp8_case(B, N, H, P)
    ctx1 = torch.tensor([128, 57, 1], dtype=torch.int32)
    if two_d:
        lens = torch.tensor([[100, 128], [0, 33], [1, 2]], dtype=torch.int32)
        lens2d = lens
    else:
        lens = ctx1
        lens2d = torch.stack([ctx1 - N + j + 1 for j in range(N)], 1)      # DeepGEMM's next_n rule
    meta = dg.get_paged_mqa_logits_metadata(lens, P, 8)
    got = dg.fp8_paged_mqa_logits(q, kv, w, lens, table, meta, L, clean_logits=clean)
    assert got.shape == (B * N, L) and got.dtype == torch.float32
    keys = fp8_keys(kv, P)
    want = expected(q.double(), keys, w, table, lens2d, L, P, clean)
    mag = expected(q.double().abs(), lambda page, o: keys(page, o).abs(), w.abs(), table, lens2d, L, P)
    inside = torch.arange(L)[None, :] < lens2d.reshape(-1, 1).clamp(0, L)
    check_close(got, want, mag, inside if not clean else torch.ones_like(inside))


def test_fp8_fp4_paged_mqa_logits_fp4_tuple():
    B, N, H, P, L, pages = 2, 3, 16, 32, 96, 3
    g = torch.Generator().manual_seed(5)
    NB = B * pages + 2
    payload = torch.randint(0, 256, (NB, P, 64), generator=g, dtype=torch.uint8)
    kexp = torch.randint(122, 132, (NB, P, 4), generator=g, dtype=torch.uint8)
    kv = torch.cat((payload.reshape(NB, P * 64), kexp.reshape(NB, P * 4)), 1).reshape(NB, P, 1, 68)
    qp = torch.randint(0, 256, (B, N, H, 64), generator=g, dtype=torch.uint8)
    qe = torch.randint(122, 132, (B, N, H, 4), generator=g, dtype=torch.uint8)
    q_sf = qe.view(torch.int32).reshape(B, N, H)
    w = torch.randn(B * N, H, generator=g)
    table = torch.randperm(NB, generator=g)[:B * pages].reshape(B, pages).to(torch.int32)
    lens = torch.tensor([[96, 50, 3], [7, 0, 96]], dtype=torch.int32)

    def dequant(packed, exps):          # packed [..., 64], exps [..., 4] -> float64 [..., 128]
        lo, hi = packed & 15, packed >> 4
        codes = torch.stack((lo, hi), -1).reshape(*packed.shape[:-1], 128).long()
        vals = torch.tensor(E2M1, dtype=torch.float64)[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
        scale = torch.pow(2.0, exps.double() - 127).repeat_interleave(32, -1)
        return vals * scale

    kf = dequant(payload, kexp)
    got = dg.fp8_fp4_paged_mqa_logits((qp, q_sf), kv, w, lens, table, dg.get_paged_mqa_logits_metadata(lens, P, 4), L,
                                      clean_logits=True)
    want = expected(dequant(qp, qe), lambda page, o: kf[page, o], w, table, lens, L, P)
    mag = expected(dequant(qp, qe).abs(), lambda page, o: kf[page, o].abs(), w.abs(), table, lens, L, P)
    check_close(got, want, mag, torch.ones(B * N, L, dtype=torch.bool))
    bf = dg.fp8_fp4_paged_mqa_logits((qp, q_sf), kv, w, lens, table, dg.get_paged_mqa_logits_metadata(lens, P, 4), L,
                                     True, torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.equal(torch.isneginf(bf), torch.isneginf(got))


def test_metadata_splits_the_work_evenly():
    lens = torch.tensor([1000, 0, 300, 5000], dtype=torch.int32)
    meta = dg.get_paged_mqa_logits_metadata(lens, 64, 7)
    assert meta.shape == (8, 2) and meta.dtype == torch.int32
    splits = [(int(x) + dg.SPLIT_KV - 1) // dg.SPLIT_KV for x in lens]
    starts = [sum(splits[:r]) + s for r, s in meta.tolist()]
    total = sum(splits)
    assert starts == [i * total // 7 for i in range(8)]


def test_bad_arguments_named():
    q, kv, w, table = fp8_case()
    meta = dg.get_paged_mqa_logits_metadata(torch.tensor([5, 5, 5], dtype=torch.int32), 32, 4)
    lens = torch.tensor([5, 5, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="indices"):
        dg.fp8_paged_mqa_logits(q, kv, w, lens, table, meta, 64, indices=lens)
    with pytest.raises(ValueError, match="kv_cache"):
        dg.fp8_paged_mqa_logits(q, kv[..., :68].contiguous(), w, lens, table, meta, 64)
    with pytest.raises(ValueError, match="schedule_meta"):
        dg.fp8_paged_mqa_logits(q, kv, w, lens, table, meta[:, 0], 64)
    with pytest.raises(ValueError, match="num_sms"):
        dg.get_paged_mqa_logits_metadata(lens, 32, 0)

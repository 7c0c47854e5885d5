"""SPEC §7.4 paged_mqa_logits against a dense float64 computation written here from dequantized values
(every §6 layout, next_n 1..4, variable context lengths, shuffled block tables, both context_lens forms),
and end to end: writer -> cache -> scorer against a bf16 ground truth of the unquantized q and k."""
from __future__ import annotations

import math

import pytest
import torch

import dsaquant
from dsaquant import testing as tt

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    dtype=torch.float64)


# ------------------------------------------------------------------------------------------------
# independent decoders and layout writers (SPEC §1, §4, §6)
# ------------------------------------------------------------------------------------------------
def fp8_values(codes: torch.Tensor) -> torch.Tensor:
    """e4m3fn codes -> float64 through torch's own float8 dtype."""
    return codes.contiguous().view(torch.float8_e4m3fn).to(torch.float64)


def fp4_values(payload: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """payload u8 [..., 64] + exps u8 [..., 4] -> float64 [..., 128]; element 2i low nibble, 2i+1 high."""
    p = payload.to(torch.int64)
    codes = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], 128)
    v = E2M1[codes].reshape(*p.shape[:-1], 4, 32)
    scale = torch.pow(2.0, exps.to(torch.float64) - 127).unsqueeze(-1)
    return (v * scale).reshape(*p.shape[:-1], 128)


def put_fp8_132(cache, slot, codes, scale, P, preshuffle):
    flat = cache.view(torch.uint8).reshape(-1)
    n, o = slot // P, slot % P
    base = n * P * 132
    d = torch.arange(128)
    if preshuffle:
        off = base + (o // 16) * 2048 + (d // 16) * 256 + (o % 16) * 16 + (d % 16)
    else:
        off = base + 128 * o + d
    flat[off] = codes
    flat[base + 128 * P + 4 * o: base + 128 * P + 4 * o + 4] = torch.tensor([scale], dtype=torch.float32).view(
        torch.uint8)


def put_packed68(cache, slot, payload, exps, P):
    n, o = slot // P, slot % P
    cache[n, 64 * o: 64 * o + 64] = payload
    cache[n, 64 * P + 4 * o: 64 * P + 4 * o + 4] = exps


def put_aiter_fp4(kv, ks, slot, payload, exps, P):
    n, o = slot // P, slot % P
    b = torch.arange(64)
    kv[n, 0, b // 16, o, b % 16] = payload
    ks[n, 0, torch.arange(4), (o % 16) * (P // 16) + o // 16] = exps


def aiter_q_scale(exps: torch.Tensor) -> torch.Tensor:
    """exps u8 [R, H, 4] -> q_scale u8 [R, 1, 4, 16, round_up(H/16, 4)], pad entries 0."""
    R, H, _ = exps.shape
    pad = (H // 16 + 3) // 4 * 4
    qs = torch.zeros(R, 1, 4, 16, pad, dtype=torch.uint8)
    for h in range(H):
        for g in range(4):
            qs[:, 0, g, h % 16, h // 16] = exps[:, h, g]
    return qs


def exps_from_aiter_q_scale(qs: torch.Tensor, H: int) -> torch.Tensor:
    h = torch.arange(H).view(H, 1)
    g = torch.arange(4).view(1, 4)
    return qs[:, 0][:, g, h % 16, h // 16]                                    # [R, H, 4]


def dense_logits(qf, kf_slots, weights, ctx, bt, P, L, weight_scale):
    """qf float64 [B, N, H, 128]; kf_slots float64 [capacity, 128]; ctx [B, N]; -> float64 [B*N, L]."""
    B, N = qf.shape[:2]
    out = torch.full((B, N, L), -math.inf, dtype=torch.float64)
    for b in range(B):
        for n in range(N):
            c = int(ctx[b, n])
            if c == 0:
                continue
            p = torch.arange(c)
            slots = bt[b, p // P].to(torch.int64) * P + p % P
            k = kf_slots[slots]                                                 # [c, 128]
            dots = qf[b, n] @ k.T                                               # [H, c]
            out[b, n, :c] = (weights[b, n].unsqueeze(-1) * torch.relu(dots)).sum(0) * weight_scale
    return out.reshape(B * N, L)


def assert_logits_close(got, want):
    assert got.dtype == torch.float32 and got.shape == want.shape
    finite = torch.isfinite(want)
    assert torch.equal(torch.isneginf(got), ~finite), "-inf exactly at positions >= context length"
    g, w = got[finite].double(), want[finite]
    tol = 1e-5 * float(w.abs().max()) if w.numel() else 0.0
    torch.testing.assert_close(g, w, rtol=1e-5, atol=tol)


# ------------------------------------------------------------------------------------------------
# scorer vs dense fp32/fp64 math, per layout
# ------------------------------------------------------------------------------------------------
def _setup(B, N, H, P, pages_per_seq, seed, ctx_form, weights_form):
    g = torch.Generator().manual_seed(seed)
    NB = B * pages_per_seq + 2                                     # two pages belong to no sequence
    perm = torch.randperm(NB, generator=g)
    bt = perm[:B * pages_per_seq].reshape(B, pages_per_seq).to(torch.int32)   # non-identity page order
    L = pages_per_seq * P
    base = torch.tensor([L, max(1, L // 3), 1, L - P // 2 - 1][:B])
    if ctx_form == "B":
        ctx_arg = base.to(torch.int32)
        ctx = base.view(B, 1).expand(B, N)
    else:                                                          # [B, N]: causal MTP-style lengths
        ctx = (base.view(B, 1) - (N - 1) + torch.arange(N).view(1, N)).clamp(min=0)
        ctx_arg = ctx.to(torch.int64)
    w = torch.randn(B, N, H, generator=g)
    w_arg = w if weights_form == "BNH" else w.reshape(B * N, H)
    return g, NB, bt, L, ctx, ctx_arg, w, w_arg


CASES = [(layout, N, "B" if N % 2 else "BN", "BNH" if N > 2 else "flat")
         for layout in ("fp8_132", "fp8_132_preshuffle", "packed68_int32", "packed68_uint8", "aiter_fp4")
         for N in (1, 2, 3, 4)]


@pytest.mark.parametrize("layout,N,ctx_form,weights_form", CASES)
def test_scorer_vs_dense(layout, N, ctx_form, weights_form):
    B, H = 3, 32 if layout == "aiter_fp4" else 16
    P = 64 if layout == "aiter_fp4" else 16
    pages = 2 if layout == "aiter_fp4" else 4
    g, NB, bt, L, ctx, ctx_arg, w, w_arg = _setup(B, N, H, P, pages, seed=N, ctx_form=ctx_form,
                                                  weights_form=weights_form)
    cap = NB * P
    ws = 0.37
    if layout.startswith("fp8_132"):
        pre = layout.endswith("preshuffle")
        valid = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)   # no NaN codes
        kc = valid[torch.randint(0, len(valid), (cap, 128), generator=g)]
        ks = torch.exp2(torch.randint(-8, 0, (cap,), generator=g).float()) * (1 + torch.rand(cap, generator=g))
        cache = torch.zeros(NB, P * 132, dtype=torch.uint8)
        for s in range(cap):
            put_fp8_132(cache, s, kc[s], float(ks[s]), P, pre)
        q = valid[torch.randint(0, len(valid), (B, N, H, 128), generator=g)]
        kf = fp8_values(kc) * ks.to(torch.float64).unsqueeze(-1)
        qf = fp8_values(q)
        if N == 2:
            q = q.view(torch.float8_e4m3fn)                       # an fp8-typed q works as well as uint8
        got = dsaquant.paged_mqa_logits(q, cache, w_arg, ctx_arg, bt, L, layout="fp8_132", preshuffle=pre,
                                        weight_scale=ws)
    else:
        kp = torch.randint(0, 256, (cap, 64), generator=g, dtype=torch.uint8)
        ke = torch.randint(117, 138, (cap, 4), generator=g, dtype=torch.uint8)
        qp = torch.randint(0, 256, (B, N, H, 64), generator=g, dtype=torch.uint8)
        qe = torch.randint(117, 138, (B, N, H, 4), generator=g, dtype=torch.uint8)
        kf, qf = fp4_values(kp, ke), fp4_values(qp, qe)
        if layout.startswith("packed68"):
            cache = torch.zeros(NB, P * 68, dtype=torch.uint8)
            for s in range(cap):
                put_packed68(cache, s, kp[s], ke[s], P)
            if layout.endswith("int32"):
                e = qe.to(torch.int64)
                qs = (e[..., 0] | (e[..., 1] << 8) | (e[..., 2] << 16) | (e[..., 3] << 24)).to(torch.int32)
            else:
                qs = qe.clone()
            got = dsaquant.paged_mqa_logits(qp, cache, w_arg, ctx_arg, bt, L, layout="packed68", q_scale=qs,
                                            weight_scale=ws)
        else:
            kv = torch.zeros(NB, 1, 4, P, 16, dtype=torch.uint8)
            kvs = torch.zeros(NB, 1, 4, P, dtype=torch.uint8)
            for s in range(cap):
                put_aiter_fp4(kv, kvs, s, kp[s], ke[s], P)
            qs = aiter_q_scale(qe.reshape(B * N, H, 4))
            got = dsaquant.paged_mqa_logits(qp, kv, w_arg, ctx_arg, bt, L, layout="aiter_fp4", q_scale=qs,
                                            kv_cache_scale=kvs, weight_scale=ws)
    want = dense_logits(qf, kf, w.to(torch.float64), ctx, bt, P, L, ws)
    assert_logits_close(got, want)
    # a nonzero fraction of the dot products is negative, so relu matters; and not every logit is zero
    assert bool((want[torch.isfinite(want)] != 0).any())


def test_scorer_relu_is_applied_per_head():
    """One head with a negative dot product contributes nothing, whatever its weight."""
    P, H = 16, 16
    cache = torch.zeros(1, P * 132, dtype=torch.uint8)
    one = torch.full((128,), 0x38, dtype=torch.uint8)              # e4m3fn 1.0
    put_fp8_132(cache, 0, one, 1.0, P, False)
    q = torch.zeros(1, 1, H, 128, dtype=torch.uint8)
    q[0, 0, 0] = 0x38                                              # head 0: dot = 128
    q[0, 0, 1] = 0xB8                                              # head 1: dot = -128 -> relu 0
    w = torch.zeros(1, H)
    w[0, 0], w[0, 1] = 0.5, 1000.0
    out = dsaquant.paged_mqa_logits(q, cache, w, torch.tensor([1]), torch.tensor([[0]]), 2, layout="fp8_132")
    assert out[0, 0].item() == 64.0 and out[0, 1].item() == -math.inf


# ------------------------------------------------------------------------------------------------
# end to end: writer -> cache -> scorer vs a bf16 ground truth
# ------------------------------------------------------------------------------------------------
def _bf16(x):
    return x.float().to(torch.bfloat16).float()


def _rope_gt(x, cos, sin, neox, tail):
    x = x.float().clone()
    off = 64 if tail else 0
    r = x[..., off:off + 64]
    a, b = (r[..., :32], r[..., 32:]) if neox else (r[..., 0::2], r[..., 1::2])
    a2, b2 = a * cos - b * sin, b * cos + a * sin
    if neox:
        rot = torch.cat((a2, b2), -1)
    else:
        rot = torch.stack((a2, b2), -1).reshape(r.shape)
    x[..., off:off + 64] = rot
    return x


def _truth(q, k, w, ctx, L):
    """q [N, H, 128], k [L, 128], w [N, H] (fp32) -> logits [N, L] (-inf past ctx[n])."""
    dots = torch.einsum("nhd,ld->nhl", q.double(), k.double())
    out = (torch.relu(dots) * w.double().unsqueeze(-1)).sum(1)
    pos = torch.arange(L).view(1, L)
    return torch.where(pos < ctx.view(-1, 1), out, torch.full_like(out, -math.inf))


def _cosine(a, b):
    m = torch.isfinite(a) & torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), torch.isfinite(b))
    a, b = a[m].double(), b[m].double()
    return float(a @ b / (a.norm() * b.norm()))


def _topk_overlap(a, b, ctx):
    """Mean over rows of |topk(a) & topk(b)| / k, k = 512 where the row's context allows, else its length."""
    fr = []
    for r in range(a.shape[0]):
        k = min(512, int(ctx[r]))
        ia = set(a[r].topk(k).indices.tolist())
        ib = set(b[r].topk(k).indices.tolist())
        fr.append(len(ia & ib) / k)
    return sum(fr) / len(fr)


T_E2E, H_E2E, N_E2E, P_E2E = 1024, 32, 4, 64


def _indexer_e2e(mode):
    T, H, P = T_E2E, H_E2E, P_E2E
    a = tt.make_indexer(T=T, H=H, mode=mode, page_size=P, seed=21, extra_pages=0)
    a["slot_mapping"] = torch.arange(T)
    a["positions"] = torch.arange(T)
    dsaquant.indexer_qk_rope_quant_and_cache(**a)
    dsaquant.check_errors()
    cos, sin = a["cos_cache"][a["positions"]].float(), a["sin_cache"][a["positions"]].float()
    q = _bf16(_rope_gt(a["q"], cos.unsqueeze(1), sin.unsqueeze(1), a["is_neox"], False))
    kn = torch.nn.functional.layer_norm(a["k"].float(), (128,), a["norm_weight"], a["norm_bias"], a["epsilon"])
    k = _bf16(_rope_gt(_bf16(kn), cos, sin, a["is_neox"], False))
    return a, q, k


def _ctx_forms(T, N):
    rows = torch.arange(T - N, T)
    return rows, torch.tensor([T], dtype=torch.int32), (rows + 1).view(1, N)   # [B] and causal [B, N]


def test_end_to_end_fp8():
    T, H, N, P = T_E2E, H_E2E, N_E2E, P_E2E
    a, q, k = _indexer_e2e("fp8")
    rows, ctx_b, ctx_bn = _ctx_forms(T, N)
    bt = torch.arange(a["kv_cache"].shape[0], dtype=torch.int32).view(1, -1)
    for ctx_arg, ctx in ((ctx_b, torch.full((N,), T)), (ctx_bn, ctx_bn.view(N))):
        logits = dsaquant.paged_mqa_logits(a["q_out"][T - N:].unsqueeze(0), a["kv_cache"], a["weights_out"][rows],
                                           ctx_arg, bt, T, layout="fp8_132")
        truth = _truth(q[rows], k, a["weights"][rows] * a["weights_scale"], ctx, T)
        cos_, top = _cosine(logits, truth), _topk_overlap(logits, truth, ctx)
        print(f"\nfp8_132  ctx {tuple(ctx_arg.shape)}: cosine {cos_:.6f}  top-512 overlap {top:.4f}")
        assert cos_ >= 0.999
        assert top >= 0.9


def test_end_to_end_fp4_aiter_and_converted_packed68():
    T, H, N, P = T_E2E, H_E2E, N_E2E, P_E2E
    a, q, k = _indexer_e2e("fp4")
    rows, ctx_b, _ = _ctx_forms(T, N)
    bt = torch.arange(a["kv_cache"].shape[0], dtype=torch.int32).view(1, -1)
    qc = a["q_out"][rows].unsqueeze(0)
    w = a["weights_out"][rows].float()
    ws = a["weights_scale"]
    la = dsaquant.paged_mqa_logits(qc, a["kv_cache"], w, ctx_b, bt, T, layout="aiter_fp4",
                                   q_scale=a["q_scale_out"][rows].contiguous(), kv_cache_scale=a["kv_cache_scale"],
                                   weight_scale=ws)
    truth = _truth(q[rows], k, a["weights"][rows] * ws, torch.full((N,), T), T)
    cos_, top = _cosine(la, truth), _topk_overlap(la, truth, torch.full((N,), T))
    print(f"\naiter_fp4: cosine {cos_:.6f}  top-512 overlap {top:.4f}")
    assert cos_ >= 0.97
    # the same bytes through the other FP4 layout: packed68 cache + exponents read from q_scale_out
    packed = dsaquant.convert_fp4_cache(a["kv_cache"], a["kv_cache_scale"], to="packed68")
    exps = exps_from_aiter_q_scale(a["q_scale_out"][rows], H).unsqueeze(0).contiguous()     # [1, N, H, 4]
    e = exps.to(torch.int64)
    exps32 = (e[..., 0] | (e[..., 1] << 8) | (e[..., 2] << 16) | (e[..., 3] << 24)).to(torch.int32)
    for qs in (exps, exps32):
        lp = dsaquant.paged_mqa_logits(qc, packed, w, ctx_b, bt, T, layout="packed68", q_scale=qs, weight_scale=ws)
        assert torch.equal(lp, la)
        assert _topk_overlap(lp, la, torch.full((N,), T)) == 1.0


def test_end_to_end_packed68_sglang_writers():
    T, H, N, P = T_E2E, H_E2E, N_E2E, P_E2E
    g = torch.Generator().manual_seed(31)
    _, _, freqs = tt.rope_tables(4096, "cpu")
    k_in = torch.randn(T, 128, generator=g).to(torch.bfloat16)
    q_in = torch.randn(N, H, 128, generator=g).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(128, generator=g)).to(torch.bfloat16)
    hw = torch.randn(N, H, generator=g).to(torch.bfloat16)
    pos = torch.arange(T)
    NB = T // P + 1
    cache = tt.poisoned((NB, P * 68), torch.uint8, "cpu")
    # page 0 holds the reserved slot 0, so the sequence lives on pages 1..NB-1
    dsaquant.index_k_norm_rope_pack_store(k_in, norm_w, 1e-6, pos, freqs, pos + P, cache)
    qpos = pos[T - N:]
    payload, exps, wq = dsaquant.index_q_rope_pack_weights(q_in, qpos, freqs, hw, 128 ** -0.5)
    dsaquant.check_errors()
    bt = torch.arange(1, NB, dtype=torch.int32).view(1, -1)
    ctx = torch.tensor([T])
    lp = dsaquant.paged_mqa_logits(payload.unsqueeze(0), cache, wq, ctx, bt, T, layout="packed68",
                                   q_scale=exps.unsqueeze(0))
    # ground truth: RMSNorm -> bf16 -> tail interleaved RoPE -> bf16 (k); tail RoPE -> bf16 (q)
    cos, sin = freqs[pos, 0::2], freqs[pos, 1::2]
    kf = k_in.float()
    kn = _bf16(norm_w.float() * (kf * torch.rsqrt(kf.pow(2).mean(-1, keepdim=True) + 1e-6)))
    k = _bf16(_rope_gt(kn, cos, sin, neox=False, tail=True))
    qr = _bf16(_rope_gt(q_in, cos[qpos].unsqueeze(1), sin[qpos].unsqueeze(1), neox=False, tail=True))
    truth = _truth(qr, k, hw.float() * 128 ** -0.5, torch.full((N,), T), T)
    cos_, top = _cosine(lp, truth), _topk_overlap(lp, truth, torch.full((N,), T))
    print(f"\npacked68 (sglang writers): cosine {cos_:.6f}  top-512 overlap {top:.4f}")
    assert cos_ >= 0.97
    # the converted aiter_fp4 cache gives the very same logits
    kv, kvs = dsaquant.convert_fp4_cache(cache, to="aiter_fp4", page_size=P)
    qs = aiter_q_scale(exps.contiguous().view(torch.uint8).reshape(N, H, 4))
    la = dsaquant.paged_mqa_logits(payload.unsqueeze(0), kv, wq, ctx, bt, T, layout="aiter_fp4", q_scale=qs,
                                   kv_cache_scale=kvs)
    assert torch.equal(la, lp)
    assert _topk_overlap(la, lp, torch.full((N,), T)) == 1.0

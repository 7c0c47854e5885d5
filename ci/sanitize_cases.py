"""A representative subset of every op on one backend, for compute-sanitizer (memcheck / racecheck /
initcheck). Usage: python ci/sanitize_cases.py [cuda|triton]. Small sizes: the tools are slow."""
import sys

import torch

import dsaquant as dq
from dsaquant import testing as tt

backend = sys.argv[1] if len(sys.argv) > 1 else "cuda"
dev = torch.device("cuda")
for T in (1, 37, 300):
    for mode in ("fp8", "fp4"):
        dq.indexer_qk_rope_quant_and_cache(**tt.make_indexer(T=T, H=16 if T > 1 else 64, mode=mode, device=dev,
                                                             preshuffle=T == 37), backend=backend)
    dq.index_k_norm_rope_pack_store(**tt.make_k_store(T=T, device=dev, compress_ratio=4), backend=backend)
    dq.index_q_rope_pack_weights(**tt.make_q_pack(T=T, H=16, device=dev), backend=backend)
    a = tt.make_q_pack(T=T, H=16, device=dev)
    dq.rope_fake_quant_fp4(a["q"], a["positions"], a["freqs"], 16, "e4m3", backend=backend)
    for layout in ("aiter_fp4", "dense"):
        dq.rmsnorm_rope_rotate_fp4quant_kvcache(**tt.make_v4_k(T=T, device=dev, layout=layout), backend=backend)
for shift in (1, 2):   # k rows not 16-byte aligned, caches not 4-byte aligned (the k writers' byte stores)
    a = tt.make_k_store(T=37, device=dev)
    a["k"], a["cache"] = tt.at_offset(a["k"], 2, pad=1), tt.at_offset(a["cache"], shift)
    dq.index_k_norm_rope_pack_store(**a, backend=backend)
    a = tt.make_v4_k(T=37, device=dev, layout="aiter_fp4")
    a["kv"], a["kv_cache"] = tt.at_offset(a["kv"], 2, pad=1), tt.at_offset(a["kv_cache"], shift)
    dq.rmsnorm_rope_rotate_fp4quant_kvcache(**a, backend=backend)
for mode, H, T in (("fp8", 18, 4096), ("fp4", 48, 2048)):   # a warp per token (T * ceil(H/32) >= 4096 FP8, 2048 FP4); FP8: the last 4 heads partly empty
    dq.indexer_qk_rope_quant_and_cache(**tt.make_indexer(T=T, H=H, mode=mode, device=dev), backend=backend)


def v4_compress(ratio, mode, starts, lens, D=128, P=64, max_pos=4096):
    """SPEC §7.6 arguments: ragged sequences (a prefill from 0, a chunk, a decode token) over a ring of R = K + 2."""
    g = torch.Generator().manual_seed(ratio)
    K = 2 * ratio if ratio == 4 else ratio
    C, T, R = (2 * D if ratio == 4 else D), sum(lens), K + 2
    kv, score = (torch.randn(T, C, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    ring_kv, ring_sc = (torch.randn(len(lens) + 1, R, C, generator=g).to(dev) for _ in range(2))
    cos, sin, _ = tt.rope_tables(max_pos, dev)
    NB = T // P + 2
    cache = tt.poisoned((NB, P * (68 if mode == "fp4" else 132)), torch.uint8, dev)
    out_slots = torch.randperm(NB * P, generator=g)[:T].to(dev)
    return dict(kv=kv, score=score, ape=torch.randn(ratio, C, generator=g).to(dev), state_kv=ring_kv, state_score=ring_sc,
                state_slot=torch.arange(len(lens), dtype=torch.int32, device=dev),
                cu_seqlens=torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32,
                                        device=dev),
                start_pos=torch.tensor(starts, dtype=torch.int64, device=dev),
                norm_weight=torch.ones(D, device=dev), epsilon=1e-6, cos_cache=cos, sin_cache=sin, out_slots=out_slots,
                cache=cache, ratio=ratio, quant_mode=mode)


# SPEC §7.6 compress_kv (ratio 4 with overlap into FP4 packed68, ratio 128 into FP8) and §7.7 rope_rotate_quant.
dq.compress_kv(**v4_compress(4, "fp4", (0, 37, 9), (300, 5, 1)), backend=backend)
dq.compress_kv(**v4_compress(128, "fp8", (0, 100), (300, 60)), preshuffle=True, backend=backend)
# The launch shapes of large calls: one range a warp (>= 512 ranges of ratio 4), clusters of 4 blocks (>= 129
# windows of ratio 128).
dq.compress_kv(**v4_compress(4, "fp4", (0,), (2100,)), backend=backend)
dq.compress_kv(**v4_compress(128, "fp4", (0,), (16640,), max_pos=16640), backend=backend)
for T in (1, 37):
    x = torch.randn(T, 16, 128, device=dev, dtype=torch.bfloat16)
    cos, sin, _ = tt.rope_tables(4096, dev)
    pos = torch.arange(T, device=dev)
    q_scale = torch.empty(T, 1, 4, 16, 4, dtype=torch.uint8, device=dev)
    dq.rope_rotate_quant(torch.empty(T, 16, 64, dtype=torch.uint8, device=dev), x, cos, sin, pos, out_scale=q_scale,
                         backend=backend)
    dq.rope_rotate_quant(torch.empty(T, 16, 128, dtype=torch.float8_e4m3fn, device=dev), x, cos, sin, pos,
                         out_scale=torch.empty(T, 16, 1, device=dev), backend=backend)
    dq.rope_rotate_quant(x, x, cos, sin, pos, backend=backend)
# The q writers' warp-per-token mode (its cp.async row ring; H = 36 leaves warps partly empty) and
# rope_rotate_quant on several tokens per block and every D.
a = tt.make_q_pack(T=4096, H=36, device=dev)
dq.index_q_rope_pack_weights(**a, backend=backend)
dq.rope_fake_quant_fp4(a["q"], a["positions"], a["freqs"], 32, "ue8m0", backend=backend)
for D in (128, 256, 512, 1024):
    T = 300 if D == 128 else 33
    x = torch.randn(T, 8, D, device=dev, dtype=torch.bfloat16)
    cos, sin, _ = tt.rope_tables(4096, dev)
    pos = torch.randint(0, 4096, (T,), device=dev)
    dq.rope_rotate_quant(torch.empty(T, 8, D // 2, dtype=torch.uint8, device=dev), x, cos, sin, pos,
                         out_scale=torch.empty(T, 8, D // 32, dtype=torch.uint8, device=dev), group_size=32, shuffle_scale=False,
                         backend=backend)
torch.cuda.synchronize()
print(f"sanitize cases done on backend {backend}")

"""One op called twice, for ncu: python ci/profile_case.py CASE [backend] [T]. ncu's --launch-skip 1 --launch-count 1
(ci/gpu_check.sh, with KERNELS as its kernel-name filter: `python ci/profile_case.py --kernels` prints it) then
profiles the second (warm) call's main kernel.

Writers (H = 64, T = 8192 unless given): fp8, fp4 (indexer_qk_rope_quant_and_cache), qpack (index_q_rope_pack_weights),
rotate (rope_rotate_quant, D = 128, into FP4), kpack (index_k_norm_rope_pack_store), v4k
(rmsnorm_rope_rotate_fp4quant_kvcache), compress4 / compress128 (compress_kv prefill, one T-token prompt, ratio 4 /
128, FP4 packed68, the bench's arguments), compress_dec (compress_kv decode, the bench's 64 sequences of one token).
Read side (the bench's shapes): topk64 (top-2048 of [64, 65536] fp32), topk4 (of [4, 163840]): on sm_90 both the
cached-row kernel, in clusters of 2 and 8 blocks a row, scorer_fp8_132 / scorer_packed68 / scorer_aiter_fp4
(paged_mqa_logits, batch 64, next_n 1, context 8192, full; scorer_LAYOUT:B:N:CONTEXT another shape, H = 64), prefill_fp8 / prefill_fp4 (mqa_logits, S = 2048,
SKV = 8192, full ranges: the CUDA kernel; FP4's Triton passes do not match KERNELS).
"""
import sys

import torch

import dsaquant as dq
from dsaquant import testing as tt

# The kernels a case profiles (ncu --kernel-name regex): one launch a call matches.
KERNELS = "indexer_kernel|kstore_kernel|compress_kv_kernel|qpack_kernel|rope_rotate_kernel|topk_cache_kernel|topk_row_kernel|topk_finish_kernel|paged_logits_kernel|mqa_logits_kernel"

what = sys.argv[1] if len(sys.argv) > 1 else "fp8"
if what == "--kernels":
    print(KERNELS)
    raise SystemExit(0)
backend = sys.argv[2] if len(sys.argv) > 2 else "cuda"
T = int(sys.argv[3]) if len(sys.argv) > 3 else 8192
if what in ("fp8", "fp4"):
    a = tt.make_indexer(T=T, H=64, mode=what, device="cuda", extra_pages=0)
    call = lambda: dq.indexer_qk_rope_quant_and_cache(**a, backend=backend)  # noqa: E731
elif what == "qpack":
    a = tt.make_q_pack(T=T, H=64, device="cuda")
    call = lambda: dq.index_q_rope_pack_weights(**a, backend=backend)  # noqa: E731
elif what == "rotate":
    from dsaquant import compress
    a = tt.make_rope_rotate_quant(T=T, H=64, device="cuda")
    call = lambda: compress.rope_rotate_quant(**a, backend=backend)  # noqa: E731
elif what == "kpack":
    a = tt.make_k_store(T=T, device="cuda")
    call = lambda: dq.index_k_norm_rope_pack_store(**a, backend=backend)  # noqa: E731
elif what == "v4k":
    a = tt.make_v4_k(T=T, device="cuda")
    call = lambda: dq.rmsnorm_rope_rotate_fp4quant_kvcache(**a, backend=backend)  # noqa: E731
elif what.startswith("compress"):
    from dsaquant import compress
    from dsaquant.bench import v4_cases
    label = {"compress4": "compress_kv prefill r4 fp4", "compress128": "compress_kv prefill r128 fp4",
             "compress_dec": "compress_kv decode B=64 r4 fp4"}[what]
    make = next(c[4] for c in v4_cases((T,)) if c[0] == label)
    a = make(0)
    call = lambda: compress.compress_kv(**a, backend=backend)  # noqa: E731
elif what in ("topk64", "topk4"):
    from dsaquant.topk import topk_indices
    rows, L = (64, 65536) if what == "topk64" else (4, 163840)
    logits = torch.randn(rows, L, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    ctx = torch.full((rows,), L, dtype=torch.int32, device="cuda")
    out = torch.empty((rows, 2048), dtype=torch.int32, device="cuda")
    call = lambda: topk_indices(logits, 2048, context_lens=ctx, out=out, backend=backend)  # noqa: E731
elif what.startswith("scorer_"):
    from dsaquant import ops
    from dsaquant.bench_scorer import inputs
    layout, *shape = what[len("scorer_"):].split(":")
    B, N, ctx = (int(x) for x in shape) if shape else (64, 1, 8192)
    a = inputs(layout, B, N, 64, ctx, "full", 0)
    call = lambda: ops.paged_mqa_logits(layout=layout, backend=backend, **a)  # noqa: E731
elif what.startswith("prefill_"):
    from dsaquant.bench_prefill import make_prefill_inputs
    from dsaquant.prefill import mqa_logits
    layout = what[len("prefill_"):]
    a = make_prefill_inputs(layout, 2048, 8192, 64)
    call = lambda: mqa_logits(layout=layout, backend=backend, **a)  # noqa: E731
else:
    raise SystemExit(f"unknown case {what!r}")
call()
call()
torch.cuda.synchronize()

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
torch.cuda.synchronize()
print(f"sanitize cases done on backend {backend}")

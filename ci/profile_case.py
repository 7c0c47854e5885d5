"""One call of an op, for ncu: python ci/profile_case.py [fp8|fp4|qpack] [backend] [T] (H = 64, T = 8192
unless given). ncu's --launch-skip 1 --launch-count 1 then profiles the second (warm) call."""
import sys

import torch

import dsaquant as dq
from dsaquant import testing as tt

what = sys.argv[1] if len(sys.argv) > 1 else "fp8"
backend = sys.argv[2] if len(sys.argv) > 2 else "cuda"
T = int(sys.argv[3]) if len(sys.argv) > 3 else 8192
if what in ("fp8", "fp4"):
    a = tt.make_indexer(T=T, H=64, mode=what, device="cuda", extra_pages=0)
    dq.indexer_qk_rope_quant_and_cache(**a, backend=backend)
    dq.indexer_qk_rope_quant_and_cache(**a, backend=backend)
else:
    a = tt.make_q_pack(T=T, H=64, device="cuda")
    dq.index_q_rope_pack_weights(**a, backend=backend)
    dq.index_q_rope_pack_weights(**a, backend=backend)
torch.cuda.synchronize()

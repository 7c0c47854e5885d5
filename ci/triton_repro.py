"""Rebuild one failing Triton GPU case, run it on the reference and both Triton code paths, and save the
inputs and every output (as CPU tensors) to $OUT/repro.pt, so the same bytes can be replayed on a CPU under
TRITON_INTERPRET=1. Usage: python ci/triton_repro.py  (the case is the first GPU failure of issue #5)."""
import os

import torch

import dsaquant as dq
from dsaquant import testing as tt
from dsaquant.triton import quant

T, H = 5, 16
a = tt.make_indexer(T=T, H=H, mode="fp4", device=torch.device("cuda"), seed=T * 131 + H, scale=40.0,
                    rounding="threshold", is_neox=False, preshuffle=True, scale_fmt="ue8m0", pos_dtype=torch.int32,
                    compute_all_q_rope=False, fp8_dtype=torch.float8_e4m3fn, dtype=torch.bfloat16, page_size=64)
a["q"], a["k"] = tt.special_rows(a["q"], T), tt.special_rows(a["k"], T + 3)
pos = a["positions"].clone()
pos[1], pos[2] = -3, 10 ** 6
a["positions"] = pos
s = a["slot_mapping"].clone()
s[3] = 0
a["slot_mapping"] = s
saved = {"inputs": {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}}
for name in ("reference", "triton", "triton-soft"):
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    quant.NATIVE_ENABLED = quant.HW_FP8_ENABLED = name != "triton-soft"
    dq.indexer_qk_rope_quant_and_cache(**b, backend=name.split("-")[0])
    torch.cuda.synchronize()
    saved[name] = {k: v.cpu() for k, v in b.items() if isinstance(v, torch.Tensor)}
for name in ("triton", "triton-soft"):
    for k, v in saved["reference"].items():
        x, y = v.reshape(-1).view(torch.uint8), saved[name][k].reshape(-1).view(torch.uint8)
        bad = torch.nonzero(x != y).reshape(-1)
        if bad.numel():
            print(f"{name} {k}: {bad.numel()} bytes differ, first at {bad[:8].tolist()} "
                  f"ref {x[bad[:8]].tolist()} got {y[bad[:8]].tolist()}")
    print(name, "compared")
torch.save(saved, os.path.join(os.environ.get("OUT", "."), "repro.pt"))

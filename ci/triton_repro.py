"""Rebuild Triton GPU grid cases (tests/gpu/test_triton_gpu.py ids), run each on the reference and both
Triton code paths, print the mismatching bytes and save inputs and outputs (CPU tensors) to
$OUT/repro_<n>.pt, so the same bytes can be replayed on a CPU under TRITON_INTERPRET=1.
Usage: python ci/triton_repro.py CASE_ID [CASE_ID ...]   (ids without the trailing -triton)"""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dsaquant as dq  # noqa: E402
from dsaquant.triton import quant  # noqa: E402
from tests.gpu import test_triton_gpu as g  # noqa: E402

cases = {g._cid(c): c for c in g.indexer_cases()}
for n, cid in enumerate(sys.argv[1:]):
    a = g.build_indexer_case(cases[cid])
    saved = {"case": cid, "inputs": {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}}
    for name in ("reference", "triton", "triton-soft"):
        b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
        quant.NATIVE_ENABLED = quant.HW_FP8_ENABLED = name != "triton-soft"
        dq.indexer_qk_rope_quant_and_cache(**b, backend=name.split("-")[0])
        torch.cuda.synchronize()
        saved[name] = {k: v.cpu() for k, v in b.items() if isinstance(v, torch.Tensor)}
    quant.NATIVE_ENABLED = quant.HW_FP8_ENABLED = True
    for name in ("triton", "triton-soft"):
        for k, v in saved["reference"].items():
            x, y = v.reshape(-1).view(torch.uint8), saved[name][k].reshape(-1).view(torch.uint8)
            bad = torch.nonzero(x != y).reshape(-1)
            if bad.numel():
                print(f"{cid} {name} {k}: {bad.numel()} bytes differ, first at {bad[:8].tolist()} "
                      f"ref {x[bad[:8]].tolist()} got {y[bad[:8]].tolist()}")
    print(cid, "compared", flush=True)
    torch.save(saved, os.path.join(os.environ.get("OUT", "."), f"repro_{n}.pt"))

"""Time mqa_logits (S = 2048, SKV = 8192, H = 64; FP8 and FP4 fast mode; full and causal ranges) on the cuda and
triton backends, in TFLOP/s against the FP8 dense tensor-core rate of the same run (the bench's timing: medians
of CUDA events around graph replays), with the cuda result checked against triton's (largest |difference| over
the row's largest magnitude).

  python dev/tune_prefill.py [LABEL]      # LABEL names the cuda module's build flags (dev/cuda_variants.sh)
TUNE_SHAPE="2048 8192 64" picks S, SKV and H; TUNE_BACKENDS="cuda" the backends (default "triton cuda"; the
check needs both).
"""
import os
import sys

import torch

from dsaquant import bench
from dsaquant.bench_prefill import _pairs, make_prefill_inputs
from dsaquant.prefill import mqa_logits

label = sys.argv[1] if len(sys.argv) > 1 else "default"
S, SKV, H = (int(x) for x in os.environ.get("TUNE_SHAPE", "2048 8192 64").split())
backends = os.environ.get("TUNE_BACKENDS", "triton cuda").split()
peak = bench.tensor_core_ceilings()["fp8"]
print(f"fp8 dense tensor cores {peak:.0f} TFLOP/s")
print("| variant | layout | ranges | backend | median µs | TFLOP/s | % fp8 peak | max diff / row max |")
print("|---|---|---|---|---:|---:|---:|---:|")
for layout in ("fp8", "fp4"):
    for causal in (False, True):
        sets = [make_prefill_inputs(layout, S, SKV, H, causal=causal, seed=s) for s in range(2)]
        flops = 2 * 128 * H * _pairs(sets[0])
        outs = {}
        for backend in backends:
            sec = bench.time_graph(lambda a: mqa_logits(layout=layout, backend=backend, **a), sets, calls=4, reps=10)
            outs[backend] = mqa_logits(layout=layout, backend=backend, **sets[0])
            tf = flops / sec / 1e12
            diff = ""
            if backend == "cuda" and "triton" in outs:
                a, b = outs["cuda"], outs["triton"]
                fin = torch.isfinite(b)
                same_inf = bool(torch.equal(torch.isneginf(a), torch.isneginf(b)))
                rowmax = torch.where(fin, b.abs(), 0).amax(dim=1, keepdim=True).clamp_min(1e-30)
                d = float((torch.where(fin, (a - b).abs(), 0) / rowmax).max())
                diff = f"{d:.2e}" + ("" if same_inf else " (-inf differ)")
            print(f"| {label} | {layout} | {'causal' if causal else 'full'} | {backend} | {sec * 1e6:.1f} | {tf:.1f} | "
                  f"{100 * tf / peak:.1f} | {diff} |", flush=True)

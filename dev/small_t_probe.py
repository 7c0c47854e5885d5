"""Where a small indexer call's device time goes: python dev/small_t_probe.py [backend ...] (H = 64).

Every row is a median of CUDA events around CUDA-graph replays (bench.time_graph, 100 calls per graph),
and each isolates one part by the op's own semantics, without special builds:
  - `launch floor`: a one-element torch add, the cost of any kernel node in a graph on this GPU;
  - `full`: the call (q, weights and the k row all written);
  - `q only`: every slot -1 with compute_all_q_rope, so q and the weights are written and the k rows stop
    after their first loads;
  - `loads only`: every slot -1 without compute_all_q_rope, so q and k both stop after their first loads.
"""
import sys

import torch

from dsaquant import bench, testing as tt
from dsaquant.ops import indexer_qk_rope_quant_and_cache as op

backends = sys.argv[1:] or ["cuda", "triton"]
one = torch.zeros(1, device="cuda")
floor = bench.time_graph(lambda x: x.add_(1.0), [one], 100)
print(f"launch floor (one-element add in a graph): {floor * 1e6:.2f} µs")
print("| backend | mode | T | full µs | q only µs | loads only µs |")
print("|---|---|---:|---:|---:|---:|")
for backend in backends:
    for mode in ("fp8", "fp4"):
        for T in (1, 16, 64):
            row = []
            for variant in ("full", "q", "loads"):
                a = tt.make_indexer(T=T, H=64, mode=mode, device="cuda", extra_pages=0,
                                    compute_all_q_rope=variant == "q")
                if variant != "full":
                    a["slot_mapping"].fill_(-1)
                row.append(bench.time_graph(lambda x: op(**x, backend=backend), [a], 100) * 1e6)
            print(f"| {backend} | {mode} | {T} | {row[0]:.2f} | {row[1]:.2f} | {row[2]:.2f} |", flush=True)

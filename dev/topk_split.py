"""Times the CUDA top-k selection (kernels/cuda/topk.cu) on the bench's shapes, for tuning its plan.

    python dev/topk_split.py [CHUNKS ...] [LABEL]
    TUNE="python3 dev/topk_split.py 0" dev/cuda_variants.sh "default:" "merge:-DDSQ_TOPK_MERGE=1"

For each shape of dsaquant.bench_topk.SHAPES and each blocks-per-row count in CHUNKS (0: the library's own plan,
dsq_topk_plan_chunks; 1: one block a row; -C: the cached-row path in clusters of C blocks; default: 0 1), one
Markdown row: the CUDA-graph median per call (bench.time_graph, four input sets), whether the result equals the
reference, and the device time of each kernel of the call (memset, histogram, scatter, finish or the one-block
kernel) from the torch profiler. The copy and HBM read rates of the same run head the table. Needs a GPU and the built library (python/dsaquant/libdsaquant_cuda.so).
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import dsaquant as dq
from dsaquant import bench
from dsaquant.backends import topk_abi
from dsaquant.bench_topk import SHAPES

LIB = Path(dq.__file__).with_name("libdsaquant_cuda.so")


def main(argv: list[str]) -> None:
    lib = ctypes.CDLL(str(LIB))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plans = [int(c) for c in argv if c.lstrip("-").isdigit()] or [0, 1]
    labels = [c for c in argv if not c.lstrip("-").isdigit()]   # dev/cuda_variants.sh passes the build's label last
    plan_of, _ = topk_abi.host_functions(lib)
    print(f"{' '.join(labels) + ': ' if labels else ''}copy {bench.copy_bandwidth():.0f} GB/s, "
          f"HBM read {bench.hbm_read_bandwidth():.0f} GB/s, {sms} SMs\n")
    print("| shape | k | blocks a row | µs | equal | kernels (µs each) |\n|---|---:|---:|---:|---|---|")
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    for label, rows, L, k, next_n in SHAPES:
        sets = []
        for s in range(4):
            g = torch.Generator(device="cuda").manual_seed(s)
            x = torch.randn(rows, L, device="cuda", generator=g)
            ctx = torch.full((rows // next_n,), L, dtype=torch.int32, device="cuda")
            sets.append((x, ctx, torch.full((rows, k), -7, dtype=torch.int32, device="cuda")))
        for plan in plans:
            chunks = plan if plan != 0 else plan_of(rows, L, k, sms)
            ws = torch.empty(max(1, topk_abi.workspace_bytes(rows, L, k, chunks)), dtype=torch.uint8, device="cuda")
            args = [topk_abi.make_args(x, k, ctx, next_n, None, None, False, out, workspace=ws, chunks=chunks)
                    for x, ctx, out in sets]

            def call(a):
                rc = topk_abi.call(lib, a, stream())
                if rc != 0:
                    raise RuntimeError(f"dsq_topk_indices: CUDA error {rc}")

            us = bench.time_graph(call, args, 20) * 1e6
            x, ctx, out = sets[0]
            call(args[0])
            equal = torch.equal(out, dq.topk_indices(x, k, context_lens=ctx, next_n=next_n, backend="reference"))
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    call(args[0])
                torch.cuda.synchronize()
            kernels = ", ".join(f"{e.key.split('<')[0].split('(')[0].split('::')[-1]} {e.device_time_total / e.count:.1f}"
                                for e in prof.key_averages() if e.device_time_total > 0)
            print(f"| {rows} x {L} (next_n {next_n}) | {k} | {chunks} | {us:.2f} | {equal} | {kernels} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

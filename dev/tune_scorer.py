"""Time paged_mqa_logits on the cuda backend over the bench's decode shapes (dsaquant.bench_scorer.SHAPES, every
layout), with the bench's own timing and byte count, against the copy rate of the same run: one Markdown row per
shape and layout, for comparing builds of the kernel.

  python dev/tune_scorer.py [LABEL]       # LABEL names the cuda module's build flags (dev/cuda_variants.sh)
TUNE_SHAPES="0 1 4" picks shapes by their index in SHAPES (default: all); TUNE_BACKENDS="cuda triton" the backends.
"""
import os
import sys

from dsaquant import bench, bench_scorer

label = sys.argv[1] if len(sys.argv) > 1 else "default"
picked = [int(i) for i in os.environ.get("TUNE_SHAPES", "").split()] or range(len(bench_scorer.SHAPES))
shapes = [bench_scorer.SHAPES[i] for i in picked]
backends = os.environ.get("TUNE_BACKENDS", "cuda").split()
copy = bench.copy_bandwidth()
print(f"copy {copy:.0f} GB/s")
rows = bench_scorer.run(backends, copy, None, shapes=shapes, log=lambda *_: None)
print("| variant | batch, next_n, context, H | contexts | layout | backend | median µs | % copy |")
print("|---|---|---|---|---|---:|---:|")
for r in rows:
    print(f"| {label} | {r['batch']}, {r['next_n']}, {r['context']}, {r['heads']} | {r['contexts']} | "
          f"{r['op'].split()[-1]} | {r['backend']} | {r['us']:.1f} | {r['pct_copy']:.1f} |", flush=True)

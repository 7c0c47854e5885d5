"""Time paged_mqa_logits on the cuda backend over the bench's decode shapes (dsaquant.bench_scorer.SHAPES, every
layout), with the bench's own timing and byte count, against the copy rate of the same run: one Markdown row per
shape and layout, for comparing builds of the kernel.

  python dev/tune_scorer.py [LABEL]       # LABEL names the cuda module's build flags (dev/cuda_variants.sh)
TUNE_SHAPES="0 1 4" picks shapes by their index in SHAPES (default: all); TUNE_BACKENDS="cuda triton" the backends;
TUNE_LAYOUTS="fp8_132" the layouts (default: all).

TUNE_TRITON="block_kv=64,128 num_warps=4,8 num_stages=2,3,4 tiles_per_prog=0,16" sweeps the Triton launcher's
knobs instead (every combination; 0 or "auto" keeps the launcher's own choice), one row per combination.
"""
import itertools
import os
import sys

import torch

from dsaquant import bench, bench_scorer
from dsaquant.triton.scorer import paged_mqa_logits as triton_scorer

label = sys.argv[1] if len(sys.argv) > 1 else "default"
picked = [int(i) for i in os.environ.get("TUNE_SHAPES", "").split()] or range(len(bench_scorer.SHAPES))
shapes = [bench_scorer.SHAPES[i] for i in picked]
layouts = os.environ.get("TUNE_LAYOUTS", "").split() or list(bench_scorer.LAYOUTS)
backends = os.environ.get("TUNE_BACKENDS", "cuda").split()
copy = bench.copy_bandwidth()
print(f"copy {copy:.0f} GB/s")


def knob_grid(spec: str) -> list[dict]:
    """'a=1,2 b=3' -> [{a: 1, b: 3}, {a: 2, b: 3}]; 0 or 'auto' -> None (the launcher's choice)."""
    names, values = [], []
    for item in spec.split():
        name, vals = item.split("=")
        names.append(name)
        values.append([None if v in ("0", "auto") else int(v) for v in vals.split(",")])
    return [dict(zip(names, combo)) for combo in itertools.product(*values)]


def sweep_triton(spec: str) -> None:
    print("| knobs | batch, next_n, context, H | contexts | layout | median µs | % copy |")
    print("|---|---|---|---|---:|---:|")
    for (B, N, ctx, H, contexts) in shapes:
        for layout in layouts:
            sets = bench_scorer.input_sets(layout, B, N, H, ctx, contexts)
            moved = sum(bench_scorer.must_move(a, layout) for a in sets) / len(sets)
            outs = [torch.empty((B * N, ctx), dtype=torch.float32, device="cuda") for _ in sets]
            idx = {id(a): i for i, a in enumerate(sets)}
            for knobs in knob_grid(spec):
                def call(a, knobs=knobs):
                    triton_scorer(a["q"], a["kv_cache"], a["weights"], a["context_lens"], a["block_tables"],
                                  a["max_seq_len"], layout, a.get("q_scale"), a.get("kv_cache_scale"),
                                  a["weight_scale"], a.get("preshuffle", False), a.get("fp8_flavour"),
                                  bench_scorer.PAGE, True, outs[idx[id(a)]], **knobs)
                name = " ".join(f"{k}={'auto' if v is None else v}" for k, v in knobs.items())
                try:
                    us = bench.time_graph(call, sets, 20) * 1e6
                except Exception as e:   # a combination the compiler refuses: report it, go on
                    print(f"| {name} | {B}, {N}, {ctx}, {H} | {contexts} | {layout} | failed: {type(e).__name__} | |")
                    continue
                print(f"| {name} | {B}, {N}, {ctx}, {H} | {contexts} | {layout} | {us:.1f} | "
                      f"{100 * moved / us / 1e3 / copy:.1f} |", flush=True)


if os.environ.get("TUNE_TRITON"):
    sweep_triton(os.environ["TUNE_TRITON"])
    sys.exit(0)
rows = bench_scorer.run(backends, copy, None, shapes=shapes, log=lambda *_: None, layouts=layouts)
print("| variant | batch, next_n, context, H | contexts | layout | backend | median µs | % copy |")
print("|---|---|---|---|---|---:|---:|")
for r in rows:
    print(f"| {label} | {r['batch']}, {r['next_n']}, {r['context']}, {r['heads']} | {r['contexts']} | "
          f"{r['op'].split()[-1]} | {r['backend']} | {r['us']:.1f} | {r['pct_copy']:.1f} |", flush=True)

"""Find which GPU-only Triton code path (formats.py NATIVE) breaks FP4 q bytes (issue #5).

Part 1 runs the public op (FP4 indexer, T=3, H=16, random bf16 data) for every policy x RoPE style in the
default (NATIVE) and the software path against the reference and prints mismatching bytes. Part 2 runs a
small kernel made of the same formats.py pieces with separate switches for the native load (NL), native
bf16 rounding (NR) and native max (NM), against the all-software kernel (BISECT_PIECES=0 skips part 2).

Outcome on the H200 (Triton 3.6): part 1 failed only for `threshold` in the NATIVE path, part 2 passed
everywhere; the threshold index below 1.0 written as a sum of two comparisons was narrowed by LLVM to
16-bit vector code (add.s16x2 / selp.b16 in the PTX) in the indexer kernel. formats.e2m1_index_core now
derives it from the rne index instead (no 16-bit code left in the PTX)."""
import itertools

import torch
import triton
import triton.language as tl

import dsaquant as dq
from dsaquant import testing as tt
from dsaquant.triton import quant
from dsaquant.triton.formats import (KIND_BF16, fp4_quant_tile, load_f32, rope_interleaved_tile, rope_pair,
                                     round_to)

import os
DEV = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") else "cuda")
print("part 1: the op")
PART1 = DEV.type == "cuda"
for policy, neox in itertools.product(("threshold", "rne", "hardware"), (False, True)) if PART1 else ():
    a = tt.make_indexer(T=3, H=16, mode="fp4", device=DEV, seed=0, scale=1.0, rounding=policy, is_neox=neox,
                        max_pos=1)
    outs = {}
    for name in ("reference", "triton", "triton-soft"):
        b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
        quant.NATIVE_ENABLED = quant.HW_FP8_ENABLED = name != "triton-soft"
        dq.indexer_qk_rope_quant_and_cache(**b, backend=name.split("-")[0])
        outs[name] = b
    torch.cuda.synchronize()
    for name in ("triton", "triton-soft"):
        bad = {k: int((outs["reference"][k].reshape(-1).view(torch.uint8) != v.reshape(-1).view(torch.uint8)).sum())
               for k, v in outs[name].items() if isinstance(v, torch.Tensor) and v.is_contiguous()}
        print(f"  {policy:9s} neox={int(neox)} {name:11s} mismatching bytes: { {k: n for k, n in bad.items() if n} }")
quant.NATIVE_ENABLED = quant.HW_FP8_ENABLED = True


@triton.jit
def _mini(x_ptr, c_ptr, s_ptr, o_ptr, e_ptr, POLICY: tl.constexpr, NEOX: tl.constexpr, NL: tl.constexpr,
          NR: tl.constexpr, NM: tl.constexpr, R: tl.constexpr):
    r = tl.program_id(0) * R + tl.arange(0, R)
    m = (r >= 0)[:, None]
    c = tl.arange(0, 32)[None, :]
    base = (r * 128)[:, None]
    t0 = load_f32(x_ptr, base + c, m, KIND_BF16, NL)
    t1 = load_f32(x_ptr, base + (c + 32), m, KIND_BF16, NL)
    if NEOX:
        j = tl.arange(0, 32)[None, :] + 0 * r[:, None]
        t0, t1 = rope_pair(t0, t1, load_f32(c_ptr, j, m, KIND_BF16, NL), load_f32(s_ptr, j, m, KIND_BF16, NL))
    else:
        j = tl.arange(0, 16)[None, :] + 0 * r[:, None]
        t0 = rope_interleaved_tile(t0, load_f32(c_ptr, j, m, KIND_BF16, NL), load_f32(s_ptr, j, m, KIND_BF16, NL), R)
        t1 = rope_interleaved_tile(t1, load_f32(c_ptr, j + 16, m, KIND_BF16, NL),
                                   load_f32(s_ptr, j + 16, m, KIND_BF16, NL), R)
    t0 = round_to(t0, KIND_BF16, NR)
    t1 = round_to(t1, KIND_BF16, NR)
    q0, e0 = fp4_quant_tile(t0, 0, POLICY, R, NM)
    q1, e1 = fp4_quant_tile(t1, 0, POLICY, R, NM)
    d = tl.arange(0, 16)[None, :]
    tl.store(o_ptr + ((r * 32)[:, None] + d), q0)
    tl.store(o_ptr + ((r * 32)[:, None] + (d + 16)), q1)
    tl.store(e_ptr + r * 2, e0)
    tl.store(e_ptr + r * 2 + 1, e1)


if os.environ.get("BISECT_PIECES", "1") == "0":
    raise SystemExit(0)
print("part 2: pieces (NL native load, NR native round, NM native max)")
g = torch.Generator(device=DEV).manual_seed(0)
x = torch.randn(48, 128, device=DEV, generator=g).to(torch.bfloat16)
ang = torch.rand(32, device=DEV, generator=g) * 6
for cs_name, (cc, ss) in {"pos0": (torch.ones(32, device=DEV), torch.zeros(32, device=DEV)),
                          "random": (ang.cos(), ang.sin())}.items():
    cb, sb = cc.to(torch.bfloat16), ss.to(torch.bfloat16)
    for policy, neox in itertools.product((0, 1, 2), (False, True)):
        res = {}
        for nl, nr, nm in itertools.product((0, 1), repeat=3) if PART1 else ((0, 0, 0), (0, 0, 1)):
            o = torch.full((48, 32), 0xAB, dtype=torch.uint8, device=DEV)
            e = torch.full((48, 2), -7, dtype=torch.int32, device=DEV)
            xs = x if nl else x.view(torch.int16)
            _mini[(3,)](xs, cb if nl else cb.view(torch.int16), sb if nl else sb.view(torch.int16), o, e,
                        POLICY=policy, NEOX=neox, NL=bool(nl), NR=bool(nr), NM=bool(nm), R=16,
                        enable_fp_fusion=False)
            res[(nl, nr, nm)] = (o, e)
        base = res[(0, 0, 0)]
        line = " ".join(f"{k}:{int((v[0] != base[0]).sum())}/{int((v[1] != base[1]).sum())}"
                        for k, v in res.items() if k != (0, 0, 0))
        print(f"  {cs_name:6s} policy={policy} neox={int(neox)} bytes/exps differing from soft: {line}")

"""Hypothesis property tests of every writer op (reliability).

Cases are drawn, not enumerated: T in 0..40, H (any 1..40 in FP8 mode and for the sglang ops, 16 or 32 in
FP4 mode), page sizes 16/32/64 and caches of exactly one page, values of every class (normal, subnormal,
±0, huge, NaN, ±Inf, rows of exact E2M1 midpoints of a block of amax 6·2^k, blocks whose amax is exactly or
just above 6·2^k, constant rows), slot maps with negatives, slot 0, the last slot, out-of-range slots and
duplicates, positions int32/int64 inside and outside the table, strided (server-style) inputs, and every
option (rounding policy, FP8 flavour and output dtype, scale_fmt, preshuffle, neox, compute_all_q_rope,
compress ratio, Hadamard, cache layouts and shapes, input/weight/table dtypes).

Two kinds of property:

(a) `test_reference_*`: the reference obeys invariants derived from docs/spec.md without reusing its encoders.
    The expected bytes are recomputed here from the quantizer's input (the reference's RoPE/norm transforms,
    which tests/test_transforms.py checks separately) with independent code: UE8M0 exponents from
    torch.frexp, E2M1 codes as "the nearest grid point, ties by the policy's rule", E4M3 codes by torch's
    own float8 conversion. Plus: rows and slots that are skipped keep testing.POISON; aiter q-scale pad
    entries are 0; dequantized k is within the format's error of its (bf16) input for finite rows; the
    device error flags are raised exactly when a slot is at/past capacity or a position is outside the
    table. Slots written twice in one call (docs/semantics.md: unspecified winner) are left out of every
    byte comparison; all other bytes are compared.
(b) `test_triton_interpreter_equals_reference`: the triton backend equals the reference byte for byte
    (and raises the same error flags), under TRITON_INTERPRET=1 in worker subprocesses (the interpreter
    must be on before triton compiles anything and must not leak into this process). Skipped when
    `dispatch.available('triton')` is false there. Fewer, smaller examples: the interpreter is slow.

tests/gpu/test_reliability_gpu.py reuses the strategies, builders and comparator of this file on CUDA
tensors for the `cuda` and `triton` backends.

Budget: DSAQUANT_HYPOTHESIS_EXAMPLES=N (environment) sets every property's example count to N (the
defaults below keep this file well under a minute on two cores; the GPU file sets its own defaults).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, example, given, note, settings
from hypothesis import strategies as st

import dsaquant as dq
from dsaquant import errors
from dsaquant import testing as tt
from dsaquant.reference.arith import round_to
from dsaquant.reference.layouts import (aiter_fp4_data_offset, aiter_fp4_scale_offset, aiter_q_scale_offset,
                                        aiter_q_scale_pad, fp8_132_data_offset, fp8_132_scale_offset,
                                        packed68_payload_offset, packed68_scale_offset)
from dsaquant.reference.transforms import hadamard, layer_norm, rms_norm, rope

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
POISON = tt.POISON
F32 = torch.float32
DT = {n: getattr(torch, n) for n in ("float32", "bfloat16", "float16", "int32", "int64", "uint8",
                                     "float8_e4m3fn", "float8_e4m3fnuz")}
MAX_T = 40
MAX_H = 40


# =====================================================================================================
# budget
# =====================================================================================================
def examples(default: int) -> int:
    """Example count of one property: $DSAQUANT_HYPOTHESIS_EXAMPLES if set, else `default`."""
    v = os.environ.get("DSAQUANT_HYPOTHESIS_EXAMPLES", "").strip()
    return max(1, int(v)) if v else default


def prop_settings(n: int, shrink: bool = True):
    """Bounded, deadline-free settings. Without `shrink` the first failing example is reported as drawn
    (for slow backends such as the Triton interpreter, where shrinking can take many minutes)."""
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    return settings(max_examples=examples(n), deadline=None, database=None, print_blob=True, phases=phases,
                    suppress_health_check=list(HealthCheck))


# =====================================================================================================
# value recipes: a few drawn numbers that expand to a whole tensor (drawing 10^5 floats one by one would
# be slow and would not shrink well)
# =====================================================================================================
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0)
ROW_KINDS = ("zero", "negzero", "midpoints", "norm_midpoints", "tiny", "pow2amax", "pow2amax_up", "nan_block", "huge",
             "const", "neg_small", "inf_row")
ELEM_KINDS = ("nan", "inf", "ninf", "pzero", "nzero", "huge", "nhuge", "sub", "nsub", "one")
ELEM = dict(nan=float("nan"), inf=float("inf"), ninf=float("-inf"), pzero=0.0, nzero=-0.0, huge=3.0e38,
            nhuge=-3.0e38, sub=1e-40, nsub=-1e-40, one=1.0)
SCALES = (1.0, 40.0, 1e-3, 1e-30, 2.0 ** -126, 1e4, 1e30)
ROUNDINGS = ("threshold", "rne", "hardware")


def values(rows=True, normed=False):
    """A value recipe. `normed`: the tensor goes through LayerNorm/RMSNorm, so `norm_midpoints` rows (the only
    ones that reach the quantizer as exact midpoints) are drawn more often."""
    kinds = ROW_KINDS + ("norm_midpoints",) * 4 if normed else ROW_KINDS
    return st.fixed_dictionaries(dict(
        seed=st.integers(0, 2 ** 31 - 1),
        scale=st.sampled_from(SCALES),
        rows=st.lists(st.tuples(st.integers(0, 10 ** 4), st.sampled_from(kinds), st.integers(-6, 6)),
                      max_size=5) if rows else st.just([]),
        elems=st.lists(st.tuples(st.integers(0, 10 ** 7), st.sampled_from(ELEM_KINDS)), max_size=6)))


def _mid_block() -> torch.Tensor:
    m = torch.tensor(MIDPOINTS)
    return torch.cat([m, -m, m.flip(0), -m.flip(0)])       # 32 values, amax exactly 6


def _norm_filler() -> torch.Tensor:
    """64 values with sum 0 and sum of squares 1370 (27 pairs ±5, then ±1, ±3, six zeros): next to the 64
    midpoint values (sum 0, sum of squares 678) a row has mean 0 and mean square exactly 16."""
    return torch.tensor([5.0, -5.0] * 27 + [1.0, -1.0, 3.0, -3.0] + [0.0] * 6)


def _row_kind(r: torch.Tensor, kind: str, k: int, g: torch.Generator, exact_half: int = 0) -> None:
    s = 2.0 ** k
    n = r.numel()
    if kind == "zero":
        r.zero_()
    elif kind == "negzero":
        r.fill_(-0.0)
    elif kind == "midpoints":      # exact E2M1 midpoints once scaled by the block exponent (amax 6·2^k)
        r.copy_(_mid_block().repeat(n // 32) * s)
    elif kind == "norm_midpoints" and n == 128:
        # LayerNorm / RMSNorm of this row (eps EXACT_EPS, unit weight, zero bias) is exact: mean 0, mean
        # square 16·4^j >= 2^-2 (var + EXACT_EPS rounds back to var in fp32), so inv = 2^-(2+j) and the
        # midpoint half (dims 0..63 if exact_half == 0: untouched by tail RoPE; 64..127 if 1: untouched by
        # head RoPE) stays exact E2M1 midpoints of a block of amax 1.5.
        j = k // 2
        mids, fill = _mid_block().repeat(2) * 2.0 ** j, _norm_filler() * 2.0 ** j
        r.copy_(torch.cat((mids, fill) if exact_half == 0 else (fill, mids)))
    elif kind == "norm_midpoints":
        r.copy_(_mid_block().repeat(n // 32) * s)
    elif kind == "tiny":           # fp32 subnormals (bf16 keeps some of them, fp16 none)
        r.mul_(2.0 ** -135)
    elif kind in ("pow2amax", "pow2amax_up"):
        r.copy_((torch.rand(n, generator=g) * 2 - 1) * 5.5 * s)
        r[0::32] = 6 * s if kind == "pow2amax" else 6 * s * (1 + 2.0 ** -7)
        r[17::32] = -6 * s
    elif kind == "nan_block":
        r[:32] = float("nan")
    elif kind == "huge":
        r.copy_(torch.randn(n, generator=g) * 2.0 ** (118 + abs(k) % 6))
    elif kind == "const":
        r.fill_(1.5 * s)
    elif kind == "neg_small":      # negatives that round to zero, a -0, big entries setting the scale
        r.fill_(-0.01 * s)
        r[0::32] = 12.0 * s
        r[5::32] = -0.0
        r[7::32] = 3.0 * s
    elif kind == "inf_row":
        r[::17] = float("inf")
        r[3::29] = float("-inf")


def make_values(shape, recipe, dtype, row=128, exact_half=0) -> torch.Tensor:
    """A CPU tensor of `shape` and `dtype` from a recipe: randn * scale (fp32), then special rows of `row`
    elements, then special elements, then one rounding to `dtype`."""
    g = torch.Generator().manual_seed(recipe["seed"])
    x = torch.randn(tuple(shape), generator=g, dtype=F32) * recipe["scale"]
    n = x.numel()
    if n:
        if row and recipe["rows"]:
            rows = x.view(-1, row)
            for r, kind, k in recipe["rows"]:
                _row_kind(rows[r % rows.shape[0]], kind, k, g, exact_half)
        flat = x.view(-1)
        for i, kind in recipe["elems"]:
            flat[i % n] = ELEM[kind]
    return x.to(dtype)


# =====================================================================================================
# slots and positions
# =====================================================================================================
SLOT_KINDS = ("fresh",) * 7 + ("neg", "zero", "last", "dup", "oob")
POS_KINDS = ("in",) * 7 + ("zero", "last", "neg", "over", "extreme")


def index_kinds(kinds, T):
    return st.lists(st.sampled_from(kinds), min_size=T, max_size=T)


def resolve_slots(kinds, cap: int, dtype, seed: int, lowest: int = 0) -> list[int]:
    """Slot ids from kinds: fresh (an unused valid slot), neg, zero, last (cap - 1), dup (a slot already
    written in this call), oob (at or past the capacity, up to the dtype's extreme)."""
    g = torch.Generator().manual_seed(seed)
    free = [p for p in torch.randperm(cap, generator=g).tolist() if p >= lowest]
    big = 2 ** 31 - 1 if dtype == torch.int32 else 2 ** 40
    most_neg = -(2 ** 31) if dtype == torch.int32 else -(2 ** 40)
    used, out = [], []
    for i, kd in enumerate(kinds):
        if kd == "fresh":
            v = free.pop() if free else (used[i % len(used)] if used else -1)
        elif kd == "neg":
            v = (-1, -2, most_neg)[i % 3]
        elif kd == "zero":
            v = 0
        elif kd == "last":
            v = cap - 1
        elif kd == "dup":
            v = used[i % len(used)] if used else -1
        else:
            v = (cap, cap + 1 + i, big)[i % 3]
        if lowest <= v < cap:
            used.append(v)
        out.append(v)
    return out


def resolve_positions(kinds, max_pos: int, dtype, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed + 1)
    big = 2 ** 31 - 1 if dtype == torch.int32 else 2 ** 40
    most_neg = -(2 ** 31) if dtype == torch.int32 else -(2 ** 40)
    out = []
    for i, kd in enumerate(kinds):
        if kd == "in":
            v = int(torch.randint(0, max_pos, (1,), generator=g))
        elif kd == "zero":
            v = 0
        elif kd == "last":
            v = max_pos - 1
        elif kd == "neg":
            v = -1 - i
        elif kd == "over":
            v = max_pos + i
        else:
            v = (big, most_neg)[i % 2]
        out.append(v)
    return out


def _pos_rows(positions: torch.Tensor, max_pos: int, ratio: int = 1) -> torch.Tensor:
    """Table rows used (SPEC §5, §7.5): clamp(pos & ~(r-1), 0, max_pos - 1)."""
    p = positions.detach().cpu().to(torch.int64)
    if ratio > 1:
        p = p & ~(ratio - 1)
    return p.clamp(0, max_pos - 1)


# =====================================================================================================
# server-style strided inputs (views built on the target device)
# =====================================================================================================
def fused_q(q: torch.Tensor, style: int) -> torch.Tensor:
    """q [T, H, 128] as a view into a larger buffer: 1 = the first H*128 columns of a fused projection
    output [T, H*128 + 512]; 2 = heads 136 elements apart, starting 4 elements in (not 16-byte aligned)."""
    T, H, D = q.shape
    if style == 1:
        big = torch.full((T, H * D + 512), 7.0, dtype=q.dtype, device=q.device)
        big[:, :H * D] = q.reshape(T, H * D)
        return big[:, :H * D].view(T, H, D)
    big = torch.full((T, H, D + 8), 7.0, dtype=q.dtype, device=q.device)
    big[:, :, 4:4 + D] = q
    return big[:, :, 4:4 + D]


def col_slice(x: torch.Tensor, style: int) -> torch.Tensor:
    """x [T, n] as a column slice: 1 = columns 64.. of [T, n + 192] (aligned), 2 = columns 3.. of
    [T, n + 5] (odd offset and odd row stride)."""
    T, n = x.shape
    off, extra = (64, 192) if style == 1 else (3, 5)
    big = torch.full((T, n + extra), 7.0, dtype=x.dtype, device=x.device)
    big[:, off:off + n] = x
    return big[:, off:off + n]


def strided_vec(v: torch.Tensor) -> torch.Tensor:
    """A 1-D index tensor as column 0 of [T, 2] (stride 2); column 1 holds different values."""
    big = torch.stack((v, v * 0 - 3 - torch.arange(v.shape[0], device=v.device, dtype=v.dtype)), dim=1)
    return big[:, 0]


# =====================================================================================================
# case strategies (plain data; the builders below turn a case into tensors on a device)
# =====================================================================================================
def _common(draw, T):
    return dict(T=T, seed=draw(st.integers(0, 2 ** 31 - 1)),
                max_pos=draw(st.sampled_from([1, 7, 64, 300])),
                pos_dtype=draw(st.sampled_from(["int64", "int32"])),
                strided=draw(st.sampled_from([0, 0, 1, 2])),
                strided_idx=draw(st.booleans()))


# The norm epsilon of the exact setting: positive (an epsilon must be, SPEC §7.5) and below half an fp32 ulp
# of the smallest variance of a `norm_midpoints` row (2^-2), so it does not change that row's inv.
EXACT_EPS = 2.0 ** -40


def _norm(draw, eps_choices):
    """Norm parameters: random weights (and bias) with a drawn eps, or the exact setting (unit weight, zero
    bias, eps EXACT_EPS) under which the `norm_midpoints` rows reach the quantizer as exact E2M1 midpoints."""
    if draw(st.booleans()):
        return dict(eps=EXACT_EPS, unit_norm=True)
    return dict(eps=draw(st.sampled_from(eps_choices)), unit_norm=False)


@st.composite
def indexer_case(draw, mode, max_t=MAX_T, max_h=MAX_H):
    T = draw(st.integers(0, max_t))
    c = _common(draw, T)
    H = draw(st.sampled_from([16, 32] if mode == "fp4" else [1, 2, 3, 5, 7, 8, 16, 17, 31, 32, 40]))
    H = min(H, max_h) if mode == "fp8" else H
    c.update(op=f"indexer_{mode}", mode=mode, H=H, P=draw(st.sampled_from([16, 32, 64])),
             extra_pages=draw(st.integers(-1, 2)), dtype=draw(st.sampled_from(["bfloat16", "float16"])),
             w_dtype=draw(st.sampled_from(["float32", "bfloat16", "float16"])),
             cs_dtype=draw(st.sampled_from(["bfloat16", "float16", "float32"])),
             nw_dtype=draw(st.sampled_from(["float32", "bfloat16"])),
             neox=draw(st.booleans()), all_q=draw(st.booleans()), **_norm(draw, (1e-6, 1e-5, EXACT_EPS)),
             slot_dtype=draw(st.sampled_from(["int64", "int32"])), q_vals=draw(values()),
             k_vals=draw(values(normed=True)),
             w_vals=draw(values(rows=False)), ws=draw(st.sampled_from([1.0, 128 ** -0.5 * 64 ** -0.5, 3.0])))
    c["slots"] = draw(index_kinds(SLOT_KINDS, T))
    c["pos"] = draw(index_kinds(POS_KINDS, T))
    if mode == "fp8":
        c.update(q_out=draw(st.sampled_from(["float8_e4m3fn", "float8_e4m3fnuz", "uint8"])),
                 flavour=draw(st.sampled_from(["e4m3fn", "e4m3fnuz", None])),
                 scale_fmt=draw(st.sampled_from(["ue8m0", None, ""])), preshuffle=draw(st.booleans()),
                 kv_dtype=draw(st.sampled_from(["uint8", "float8_e4m3fn"])), cache_3d=draw(st.booleans()))
    else:
        c.update(rounding=draw(st.sampled_from(["threshold", "rne", "hardware"])),
                 wo_dtype=draw(st.sampled_from(["float32", "bfloat16", "float16"])))
    return c


@st.composite
def k_store_case(draw, max_t=MAX_T):
    T = draw(st.integers(0, max_t))
    c = _common(draw, T)
    c.update(op="k_store", P=draw(st.sampled_from([16, 32, 64])), extra_pages=draw(st.integers(-1, 2)),
             dtype=draw(st.sampled_from(["bfloat16", "float16"])),
             nw_dtype=draw(st.sampled_from(["bfloat16", "float32", "float16"])),
             ratio=draw(st.sampled_from([1, 2, 4, 8])), rounding=draw(st.sampled_from(ROUNDINGS)),
             **_norm(draw, (1e-6, EXACT_EPS)), slot_dtype=draw(st.sampled_from(["int64", "int32"])),
             k_vals=draw(values(normed=True)), nw_scale=draw(st.sampled_from([1.0, 1e-3, 1e3])),
             cache_3d=draw(st.booleans()))
    c["slots"] = draw(index_kinds(SLOT_KINDS, T))
    c["pos"] = draw(index_kinds(POS_KINDS, T))
    return c


@st.composite
def q_pack_case(draw, max_t=MAX_T, max_h=MAX_H):
    T = draw(st.integers(0, max_t))
    c = _common(draw, T)
    c.update(op="q_pack", H=draw(st.integers(1, max_h)), dtype=draw(st.sampled_from(["bfloat16", "float16"])),
             w_dtype=draw(st.sampled_from(["float32", "bfloat16", "float16"])),
             rounding=draw(st.sampled_from(["threshold", "rne", "hardware"])), q_vals=draw(values()),
             w_vals=draw(values(rows=False)), ws=draw(st.sampled_from([128 ** -0.5, 1.0, 1e30])))
    c["pos"] = draw(index_kinds(POS_KINDS, T))
    return c


@st.composite
def fake_quant_case(draw, max_t=MAX_T, max_h=MAX_H):
    T = draw(st.integers(0, max_t))
    c = _common(draw, T)
    block, scale = draw(st.sampled_from([(32, "ue8m0"), (16, "e4m3")]))
    c.update(op="fake_quant", H=draw(st.one_of(st.none(), st.integers(1, max_h))), block=block, scale=scale,
             ratio=draw(st.sampled_from([1, 2, 4])), dtype=draw(st.sampled_from(["bfloat16", "float16"])),
             x_vals=draw(values()))
    c["pos"] = draw(index_kinds(POS_KINDS, T))
    return c


@st.composite
def v4_k_case(draw, max_t=MAX_T):
    T = draw(st.integers(0, max_t))
    c = _common(draw, T)
    c.update(op="v4_k", P=draw(st.sampled_from([16, 32, 64])), extra_pages=draw(st.integers(-1, 2)),
             layout=draw(st.sampled_from(["aiter_fp4", "dense"])), hk=draw(st.sampled_from([None, 1, 3])),
             dtype=draw(st.sampled_from(["bfloat16", "float16", "float32"])),
             nw_dtype=draw(st.sampled_from(["bfloat16", "float32", "float16"])),
             cs_dtype=draw(st.sampled_from(["bfloat16", "float16", "float32"])),
             hadamard=draw(st.booleans()), rounding=draw(st.sampled_from(["threshold", "rne", "hardware"])),
             **_norm(draw, (1e-6, EXACT_EPS)), slot_dtype=draw(st.sampled_from(["int64", "int32"])),
             k_vals=draw(values(normed=True)))
    c["slots"] = draw(index_kinds(SLOT_KINDS, T))
    c["pos"] = draw(index_kinds(POS_KINDS, T))
    return c


# ---- explicit examples, always run first (hypothesis.example): E2M1 ties under every policy through every
# transform, every special class on written rows, T = 0, caches of one page, each strided style ----------
SPECIAL_ROWS = [(0, "norm_midpoints", 0), (1, "midpoints", 0), (2, "zero", 0), (3, "nan_block", 0),
                (4, "pow2amax", 1), (5, "pow2amax_up", -2), (6, "tiny", 0), (7, "neg_small", 0), (8, "inf_row", 0),
                (9, "negzero", 0), (10, "huge", 0), (11, "const", 0)]
SPECIAL_ELEMS = [(128 + 131 * i, kd) for i, kd in enumerate(ELEM_KINDS)]      # rows 1..10, not row 0


def _recipe(rows=(), elems=(), scale=1.0, seed=1):
    return dict(seed=seed, scale=scale, rows=list(rows), elems=list(elems))


def base_case(op: str, T: int = 12, **kw) -> dict:
    """A deterministic case of `op` (same keys as the strategies draw): T tokens whose rows 0..11 are one
    special row kind each, special elements, slots fresh/-1/0/last, positions in/over/neg/last, one page
    of 16, exact norms. Keyword arguments override any key."""
    slots = (["fresh", "neg", "zero", "last"] + ["fresh"] * T)[:T]
    pos = (["in", "over", "neg", "last"] + ["in"] * T)[:T]
    vals = _recipe(SPECIAL_ROWS, SPECIAL_ELEMS)
    w_vals = _recipe(elems=[(1, "nan"), (2, "inf"), (3, "nzero"), (5, "sub")])
    c = dict(T=T, seed=1, max_pos=64, pos_dtype="int64", strided=0, strided_idx=False, op=op)
    if op.startswith("indexer"):
        c.update(mode=op[-3:], H=16, P=16, extra_pages=0, dtype="bfloat16", w_dtype="float32", cs_dtype="bfloat16",
                 nw_dtype="float32", neox=True, all_q=False, eps=EXACT_EPS, unit_norm=True, slot_dtype="int64",
                 q_vals=vals, k_vals=vals, w_vals=w_vals, ws=1.0, slots=slots, pos=pos)
        if op == "indexer_fp8":
            c.update(q_out="float8_e4m3fn", flavour=None, scale_fmt="ue8m0", preshuffle=False, kv_dtype="uint8",
                     cache_3d=False)
        else:
            c.update(rounding="rne", wo_dtype="bfloat16")
    elif op == "k_store":
        c.update(P=16, extra_pages=0, dtype="bfloat16", nw_dtype="bfloat16", ratio=1, rounding="rne",
                 eps=EXACT_EPS, unit_norm=True, slot_dtype="int64", k_vals=vals, nw_scale=1.0, cache_3d=False,
                 slots=slots, pos=pos)
    elif op == "q_pack":
        c.update(H=3, dtype="bfloat16", w_dtype="float32", rounding="rne", q_vals=vals, w_vals=w_vals,
                 ws=128 ** -0.5, pos=pos)
    elif op == "fake_quant":
        c.update(H=None, block=32, scale="ue8m0", ratio=1, dtype="bfloat16", x_vals=vals, pos=pos)
    else:
        c.update(P=16, extra_pages=0, layout="aiter_fp4", hk=None, dtype="bfloat16", nw_dtype="float32",
                 cs_dtype="bfloat16", hadamard=False, rounding="rne", eps=EXACT_EPS, unit_norm=True,
                 slot_dtype="int64", k_vals=vals, slots=slots, pos=pos)
    c.update(kw)
    return c


EXPLICIT = {
    "indexer_fp8": [base_case("indexer_fp8"), base_case("indexer_fp8", T=0),
                    base_case("indexer_fp8", q_out="uint8", flavour="e4m3fnuz", scale_fmt=None, preshuffle=True,
                              neox=False, all_q=True, strided=1, strided_idx=True, pos_dtype="int32",
                              slot_dtype="int32", H=5, cache_3d=True),
                    base_case("indexer_fp8", q_out="float8_e4m3fnuz", flavour="e4m3fnuz", strided=2, H=17,
                              kv_dtype="float8_e4m3fn", dtype="float16", cs_dtype="float32")],
    "indexer_fp4": [base_case("indexer_fp4", rounding=r, neox=(r != "rne"), strided=i, all_q=(i == 1))
                    for i, r in enumerate(ROUNDINGS)] + [base_case("indexer_fp4", T=0)],
    "k_store": [base_case("k_store", rounding=r, ratio=(1, 4, 2)[i], strided=i, cache_3d=(i == 1),
                          strided_idx=(i == 2)) for i, r in enumerate(ROUNDINGS)] + [base_case("k_store", T=0)],
    "q_pack": [base_case("q_pack", rounding=r, strided=i, dtype=("bfloat16", "float16", "bfloat16")[i])
               for i, r in enumerate(ROUNDINGS)],
    "fake_quant": [base_case("fake_quant"), base_case("fake_quant", block=16, scale="e4m3", H=3, strided=1),
                   base_case("fake_quant", ratio=4, dtype="float16", strided=2)],
    "v4_k": [base_case("v4_k", rounding=r, dtype=("bfloat16", "float32", "float16")[i], hk=(None, 3, None)[i],
                       strided=(0, 0, 2)[i]) for i, r in enumerate(ROUNDINGS)]
            + [base_case("v4_k", layout="dense", hadamard=True, rounding="hardware", strided_idx=True)],
}


def with_examples(op: str, prop):
    """`prop` (a @given test) with the explicit examples of `op` added."""
    for c in EXPLICIT[op]:
        prop = example(case=c)(prop)
    return prop


STRATEGIES = {
    "indexer_fp8": lambda **kw: indexer_case("fp8", **kw),
    "indexer_fp4": lambda **kw: indexer_case("fp4", **{k: v for k, v in kw.items() if k != "max_h"}),
    "k_store": lambda **kw: k_store_case(**{k: v for k, v in kw.items() if k != "max_h"}),
    "q_pack": lambda **kw: q_pack_case(**kw),
    "fake_quant": lambda **kw: fake_quant_case(**kw),
    "v4_k": lambda **kw: v4_k_case(**{k: v for k, v in kw.items() if k != "max_h"}),
}
OPS = tuple(STRATEGIES)


# =====================================================================================================
# builders: case -> one op call on a device
# =====================================================================================================
@dataclass
class Call:
    fn: object
    kwargs: dict                    # every argument but `backend`
    outs: list                      # names of the output arguments (tensors, or the `out` tuple of q_pack)
    meta: dict = field(default_factory=dict)
    returns: bool = False           # compare the return value too


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _tables(c, dev, dtype=None):
    cos, sin, freqs = tt.rope_tables(c["max_pos"], "cpu", DT[dtype or c.get("cs_dtype", "bfloat16")])
    return cos.to(dev), sin.to(dev), freqs.to(dev)


def _index_tensors(c, dev, cap=None, lowest=0):
    pdt = DT[c["pos_dtype"]]
    pos = torch.tensor(resolve_positions(c["pos"], c["max_pos"], pdt, c["seed"]), dtype=pdt).to(dev)
    slots = None
    if cap is not None:
        sdt = DT[c["slot_dtype"]]
        slots = torch.tensor(resolve_slots(c["slots"], cap, sdt, c["seed"], lowest), dtype=sdt).to(dev)
    if c["strided_idx"]:
        pos = strided_vec(pos)
        slots = strided_vec(slots) if slots is not None else None
    return pos, slots


def build_indexer(c, dev="cpu") -> Call:
    dev = torch.device(dev)
    T, H, P, mode = c["T"], c["H"], c["P"], c["mode"]
    dt = DT[c["dtype"]]
    NB = max(1, math.ceil(T / P) + c["extra_pages"])
    cap = NB * P
    g = _gen(c["seed"])
    cos, sin, _ = _tables(c, dev)
    q = make_values((T, H, 128), c["q_vals"], dt).to(dev)
    k = make_values((T, 128), c["k_vals"], dt, exact_half=1).to(dev)       # head RoPE: dims 64.. stay exact
    w = make_values((T, H), c["w_vals"], DT[c["w_dtype"]], row=None).to(dev)
    nw = (1 + 0.1 * torch.randn(128, generator=g)).to(DT[c["nw_dtype"]]).to(dev)
    nb = (0.1 * torch.randn(128, generator=g)).to(dev)
    if c["unit_norm"]:
        nw, nb = torch.ones_like(nw), torch.zeros_like(nb)
    pos, slots = _index_tensors(c, dev, cap)
    if c["strided"]:
        q = fused_q(q, c["strided"])
        k = col_slice(k, c["strided"])
        w = col_slice(w, c["strided"]) if c["strided"] == 1 else w.t().contiguous().t()
    a = dict(q=q, weights=w, k=k, slot_mapping=slots, norm_weight=nw, norm_bias=nb, positions=pos, cos_cache=cos,
             sin_cache=sin, epsilon=c["eps"], weights_scale=c["ws"], is_neox=c["neox"], compute_all_q_rope=c["all_q"])
    meta = dict(op=c["op"], T=T, H=H, P=P, cap=cap, lowest=0, max_pos=c["max_pos"], ratio=1)
    if mode == "fp8":
        qdt = DT[c["q_out"]]
        if qdt == torch.uint8:       # the flavour from `fp8_flavour` (default e4m3fn)
            flavour, flavour_arg = c["flavour"] or "e4m3fn", c["flavour"]
        else:                        # from q_out's dtype; `fp8_flavour` may repeat it
            flavour = c["q_out"].replace("float8_", "")
            flavour_arg = flavour if c["flavour"] is not None else None
        kv_shape = (NB, P, 132) if c["cache_3d"] else (NB, P * 132)
        a.update(q_out=tt.poisoned((T, H, 128), qdt, dev), weights_out=tt.poisoned((T, H), F32, dev),
                 kv_cache=tt.poisoned(kv_shape, DT[c["kv_dtype"]], dev), quant_block_size=128,
                 scale_fmt=c["scale_fmt"], preshuffle=c["preshuffle"], fp8_flavour=flavour_arg)
        meta.update(layout="fp8_132", preshuffle=c["preshuffle"], flavour=flavour, caches=("kv_cache",))
        outs = ["q_out", "weights_out", "kv_cache"]
    else:
        a.update(q_out=tt.poisoned((T, H, 64), torch.uint8, dev),
                 weights_out=tt.poisoned((T, H), DT[c["wo_dtype"]], dev),
                 kv_cache=tt.poisoned((NB, 1, 4, P, 16), torch.uint8, dev), quant_block_size=32, scale_fmt="ue8m0",
                 q_scale_out=tt.poisoned((T, 1, 4, 16, aiter_q_scale_pad(H)), torch.uint8, dev),
                 kv_cache_scale=tt.poisoned((NB, 1, 4, P), torch.uint8, dev), rounding=c["rounding"],
                 preshuffle=False)
        meta.update(layout="aiter_fp4", caches=("kv_cache", "kv_cache_scale"))
        outs = ["q_out", "weights_out", "kv_cache", "q_scale_out", "kv_cache_scale"]
    return Call(dq.indexer_qk_rope_quant_and_cache, a, outs, meta)


def build_k_store(c, dev="cpu") -> Call:
    dev = torch.device(dev)
    T, P = c["T"], c["P"]
    NB = max(1, math.ceil(T / P) + c["extra_pages"])
    cap = NB * P
    g = _gen(c["seed"])
    _, _, freqs = _tables(c, dev)
    k = make_values((T, 128), c["k_vals"], DT[c["dtype"]]).to(dev)
    nw = ((1 + 0.1 * torch.randn(128, generator=g)) * c["nw_scale"]).to(DT[c["nw_dtype"]]).to(dev)
    if c["unit_norm"]:
        nw = torch.ones_like(nw)
    pos, slots = _index_tensors(c, dev, cap, lowest=1)
    if c["strided"]:
        k = col_slice(k, c["strided"])
    shape = (NB, P, 68) if c["cache_3d"] else (NB, P * 68)
    a = dict(k=k, norm_weight=nw, eps=c["eps"], positions=pos, freqs=freqs, slots=slots,
             cache=tt.poisoned(shape, torch.uint8, dev), compress_ratio=c["ratio"], rounding=c["rounding"])
    meta = dict(op="k_store", T=T, P=P, cap=cap, lowest=1, max_pos=c["max_pos"], ratio=c["ratio"],
                layout="packed68", caches=("cache",))
    return Call(dq.index_k_norm_rope_pack_store, a, ["cache"], meta)


def build_q_pack(c, dev="cpu") -> Call:
    dev = torch.device(dev)
    T, H = c["T"], c["H"]
    _, _, freqs = _tables(c, dev)
    q = make_values((T, H, 128), c["q_vals"], DT[c["dtype"]]).to(dev)
    w = make_values((T, H), c["w_vals"], DT[c["w_dtype"]], row=None).to(dev)
    pos, _ = _index_tensors(c, dev)
    if c["strided"]:
        q = fused_q(q, c["strided"])
        w = col_slice(w, c["strided"])
    out = (tt.poisoned((T, H, 64), torch.uint8, dev), tt.poisoned((T, H), torch.int32, dev),
           tt.poisoned((T, H), F32, dev))
    a = dict(q=q, positions=pos, freqs=freqs, head_weights=w, weight_scale=c["ws"], rounding=c["rounding"], out=out)
    meta = dict(op="q_pack", T=T, H=H, max_pos=c["max_pos"], ratio=1, caches=())
    return Call(dq.index_q_rope_pack_weights, a, ["out"], meta, returns=True)


def build_fake_quant(c, dev="cpu") -> Call:
    dev = torch.device(dev)
    T, H = c["T"], c["H"]
    _, _, freqs = _tables(c, dev)
    shape = (T, 128) if H is None else (T, H, 128)
    x = make_values(shape, c["x_vals"], DT[c["dtype"]]).to(dev)
    pos, _ = _index_tensors(c, dev)
    if c["strided"]:
        x = col_slice(x, c["strided"]) if H is None else fused_q(x, c["strided"])
    a = dict(x=x, positions=pos, freqs=freqs, block=c["block"], scale=c["scale"], compress_ratio=c["ratio"],
             out=tt.poisoned(shape, DT[c["dtype"]], dev))
    meta = dict(op="fake_quant", T=T, H=H, max_pos=c["max_pos"], ratio=c["ratio"], caches=())
    return Call(dq.rope_fake_quant_fp4, a, ["out"], meta, returns=True)


def build_v4_k(c, dev="cpu") -> Call:
    dev = torch.device(dev)
    T, P = c["T"], c["P"]
    g = _gen(c["seed"])
    cos, sin, _ = _tables(c, dev)
    x = make_values((T, 128), c["k_vals"], DT[c["dtype"]])
    if c["hk"]:
        other = torch.randn(T, c["hk"] - 1, 128, generator=g).to(x.dtype)
        x = torch.cat((x.unsqueeze(1), other), dim=1)          # [T, Hk, 128]: head 0 is written
    x = x.to(dev)
    nw = (1 + 0.1 * torch.randn(128, generator=g)).to(DT[c["nw_dtype"]]).to(dev)
    if c["unit_norm"]:
        nw = torch.ones_like(nw)
    if c["layout"] == "aiter_fp4":
        NB = max(1, math.ceil(T / P) + c["extra_pages"])
        cap = NB * P
        kv = tt.poisoned((NB, 1, 4, P, 16), torch.uint8, dev)
        kvs = tt.poisoned((NB, 1, 4, P), torch.uint8, dev)
    else:
        cap = max(1, T + 4 * c["extra_pages"])
        kv = tt.poisoned((cap, 64), torch.uint8, dev)
        kvs = tt.poisoned((cap, 4), torch.uint8, dev)
    pos, slots = _index_tensors(c, dev, cap)
    if c["strided"] and x.dim() == 2:
        x = col_slice(x, c["strided"])
    a = dict(kv=x, norm_weight=nw, epsilon=c["eps"], positions=pos, cos_cache=cos, sin_cache=sin, slot_mapping=slots,
             kv_cache=kv, kv_cache_scale=kvs, hadamard=c["hadamard"], rounding=c["rounding"], layout=c["layout"])
    meta = dict(op="v4_k", T=T, P=P if c["layout"] == "aiter_fp4" else 1, cap=cap, lowest=0, max_pos=c["max_pos"],
                ratio=1, layout=c["layout"], caches=("kv_cache", "kv_cache_scale"))
    return Call(dq.rmsnorm_rope_rotate_fp4quant_kvcache, a, ["kv_cache", "kv_cache_scale"], meta)


BUILDERS = {"indexer_fp8": build_indexer, "indexer_fp4": build_indexer, "k_store": build_k_store,
            "q_pack": build_q_pack, "fake_quant": build_fake_quant, "v4_k": build_v4_k}


def build(c, dev="cpu") -> Call:
    return BUILDERS[c["op"]](c, dev)


# =====================================================================================================
# byte helpers: slots' byte offsets per layout, written-once / written-twice sets, flags
# =====================================================================================================
def u8(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 bytes of a (contiguous) tensor, on the CPU."""
    return t.detach().contiguous().view(torch.uint8).reshape(-1).cpu()


def slot_offsets(meta, s: int) -> dict:
    """{cache tensor name: int64 byte offsets} of slot s in the op's layout (SPEC §6)."""
    P = meta["P"]
    ar = torch.arange
    lay = meta["layout"]
    if lay == "fp8_132":
        return {"kv_cache": torch.cat([fp8_132_data_offset(s, P, ar(128), meta["preshuffle"]),
                                       fp8_132_scale_offset(s, P) + ar(4)])}
    if lay == "packed68":
        return {"cache": torch.cat([packed68_payload_offset(s, P, ar(64)), packed68_scale_offset(s, P, ar(4))])}
    if lay == "aiter_fp4":
        return {"kv_cache": aiter_fp4_data_offset(s, P, ar(64)), "kv_cache_scale": aiter_fp4_scale_offset(s, P, ar(4))}
    return {"kv_cache": s * 64 + ar(64), "kv_cache_scale": s * 4 + ar(4)}


def slot_rows(meta, slots: list[int]):
    """(once: {slot: row}, twice: set of slots written by two or more rows) among the valid slots."""
    rows: dict[int, list[int]] = {}
    for t, s in enumerate(slots):
        if meta["lowest"] <= s < meta["cap"]:
            rows.setdefault(s, []).append(t)
    once = {s: r[0] for s, r in rows.items() if len(r) == 1}
    return once, {s for s, r in rows.items() if len(r) > 1}


def cache_masks(meta, slots: list[int], which: str, sizes: dict) -> dict:
    """{cache name: bool mask over its bytes} of the slots in `which` ('twice' or 'any' written)."""
    once, twice = slot_rows(meta, slots)
    chosen = twice if which == "twice" else set(once) | twice
    masks = {n: torch.zeros(sizes[n], dtype=torch.bool) for n in meta["caches"]}
    for s in chosen:
        for n, off in slot_offsets(meta, s).items():
            masks[n][off] = True
    return masks


def take_flags(device) -> int:
    """Read and clear the device error flag (0 if none was raised)."""
    f = errors.flag_tensor(device)
    v = int(f.item())
    f.zero_()
    return v


def drain_flags() -> None:
    try:
        errors.check_errors()
    except errors.DsaquantError:
        pass


def _device_of(call: Call) -> torch.device:
    for v in call.kwargs.values():
        if isinstance(v, torch.Tensor):
            return v.device
    raise AssertionError("no tensor argument")


def expected_flags(call: Call) -> int:
    m, a = call.meta, call.kwargs
    if m["T"] == 0:
        return 0
    flags = 0
    pos = a["positions"].detach().cpu().to(torch.int64)
    if bool(((pos < 0) | (pos >= m["max_pos"])).any()):
        flags |= errors.POSITION_OUT_OF_RANGE
    slots = a.get("slot_mapping", a.get("slots"))
    if slots is not None and bool((slots.detach().cpu().to(torch.int64) >= m["cap"]).any()):
        flags |= errors.SLOT_OUT_OF_RANGE
    return flags


# =====================================================================================================
# (b) the comparator: reference vs a backend, same inputs, every output byte
# =====================================================================================================
def clone_layout(t: torch.Tensor) -> torch.Tensor:
    """A copy of t with the same storage contents, storage offset and strides (Tensor.clone() would make a
    strided view contiguous)."""
    if t.is_contiguous() and t.storage_offset() == 0:
        return t.clone()
    st = t.untyped_storage().clone()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(st, t.storage_offset(), t.shape, t.stride())


def storage_u8(t: torch.Tensor) -> torch.Tensor:
    """Every byte of t's storage (the view and what lies around it), on the CPU."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).cpu()


def outside_view(t: torch.Tensor) -> torch.Tensor:
    """bool mask over storage_u8(t): True for the bytes that are not elements of the view t."""
    es = t.element_size()
    n = t.untyped_storage().nbytes() // es
    inside = torch.zeros(n, dtype=torch.bool)
    if t.numel():
        idx = torch.arange(n).as_strided(t.shape, t.stride(), t.storage_offset())
        inside[idx.reshape(-1)] = True
    return (~inside).repeat_interleave(es)


def _clone_outs(call: Call) -> dict:
    out = {}
    for n in call.outs:
        v = call.kwargs[n]
        out[n] = tuple(clone_layout(t) for t in v) if isinstance(v, tuple) else clone_layout(v)
    return out


def _flat_outputs(kw: dict, names, ret):
    """[(name, tensor)] of every output argument and returned tensor."""
    items = []
    for n in names:
        v = kw[n]
        if isinstance(v, tuple):
            items += [(f"{n}[{i}]", t) for i, t in enumerate(v)]
        else:
            items.append((n, v))
    if ret is not None:
        rs = ret if isinstance(ret, tuple) else (ret,)
        items += [(f"return[{i}]", t) for i, t in enumerate(rs)]
    return items


def compare_outputs(call: Call, kw_a: dict, ret_a, kw_b: dict, ret_b, label_a="reference", label_b="backend"):
    """Compare every output byte of two runs of `call` (outputs in kw_a / kw_b, returns ret_a / ret_b).
    Bytes of slots written twice in the call are left out (docs/semantics.md); for a strided output the
    bytes around the view must be equal too. Returns (problems, bytes compared, bytes differing)."""
    problems = []
    slots = call.kwargs.get("slot_mapping", call.kwargs.get("slots"))
    skip = {}
    if slots is not None and call.meta.get("caches"):
        sizes = {n: u8(kw_a[n]).numel() for n in call.meta["caches"]}
        skip = cache_masks(call.meta, slots.detach().cpu().tolist(), "twice", sizes)
    total = bad = 0
    items_a = _flat_outputs(kw_a, call.outs, ret_a if call.returns else None)
    items_b = _flat_outputs(kw_b, call.outs, ret_b if call.returns else None)
    for (name, r), (_, b) in zip(items_a, items_b):
        rb, bb = u8(r), u8(b)
        if rb.shape != bb.shape:
            problems.append(f"{name}: {rb.numel()} vs {bb.numel()} bytes")
            bad += max(rb.numel(), bb.numel())
            continue
        keep = ~skip[name] if name in skip else torch.ones(rb.shape, dtype=torch.bool)
        diff = (rb != bb) & keep
        n = int(diff.sum())
        total += int(keep.sum())
        bad += n
        if n:
            idx = diff.nonzero().flatten()[:6].tolist()
            problems.append(f"{name}: {n} bytes differ, first at {idx}: {label_a} {rb[idx].tolist()}, "
                            f"{label_b} {bb[idx].tolist()}")
        if not name.startswith("return") and not b.is_contiguous():      # a strided output: the memory
            out_r, out_b = storage_u8(r), storage_u8(b)                   # around the view stays as it was
            m = outside_view(b)
            nb = int(((out_r != out_b) & m).sum())
            total += int(m.sum())
            bad += nb
            if nb:
                problems.append(f"{name}: {label_b} wrote {nb} bytes outside the output view")
    return problems, total, bad


def compare_backend(call: Call, backend: str):
    """Run `call` on the reference and on `backend` (outputs cloned from the same poisoned tensors, layout
    kept; inputs shared, so strided views stay strided), compare the error flags and every output byte.
    Returns (problems, bytes compared, bytes differing)."""
    dev = _device_of(call)
    drain_flags()
    kw_ref = dict(call.kwargs, **_clone_outs(call))
    kw_be = dict(call.kwargs, **_clone_outs(call))
    r_ref = call.fn(**kw_ref, backend="reference")
    f_ref = take_flags(dev)
    r_be = call.fn(**kw_be, backend=backend)
    f_be = take_flags(dev)
    problems, total, bad = compare_outputs(call, kw_ref, r_ref, kw_be, r_be, "reference", backend)
    if f_ref != f_be:
        problems.insert(0, f"error flags: reference {f_ref}, {backend} {f_be}")
    return problems, total, bad


def to_device_layout(t: torch.Tensor, dev) -> torch.Tensor:
    """t on `dev` with the same storage contents, storage offset and strides (t.to(dev) would make a strided
    view contiguous)."""
    st = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).to(dev).untyped_storage()
    return torch.empty(0, dtype=t.dtype, device=dev).set_(st, t.storage_offset(), t.shape, t.stride())


def call_to(call: Call, dev) -> Call:
    """The call with every tensor moved to `dev`, layouts kept."""
    kw = {k: (tuple(to_device_layout(t, dev) for t in v) if isinstance(v, tuple)
              else to_device_layout(v, dev) if isinstance(v, torch.Tensor) else v) for k, v in call.kwargs.items()}
    return Call(call.fn, kw, call.outs, call.meta, call.returns)


# =====================================================================================================
# (a) independent expectations (SPEC §2-§4, §7)
# =====================================================================================================
GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
INV6 = torch.tensor([0x3E2AAAAB], dtype=torch.int32).view(F32)[0]        # fl(1/6), SPEC §3
FP8 = {"e4m3fn": (torch.float8_e4m3fn, 448.0, 0x7F), "e4m3fnuz": (torch.float8_e4m3fnuz, 240.0, 0x80)}


def canon(x: torch.Tensor) -> torch.Tensor:
    x = x.to(F32)
    return torch.where(torch.isnan(x), torch.full_like(x, float("nan")), x)


def amax_nan_ignoring(x: torch.Tensor) -> torch.Tensor:
    a = x.abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a).amax(-1)


def ceil_exp_frexp(f: torch.Tensor) -> torch.Tensor:
    """Biased exponent of the smallest power of two >= f (f > 0 normal fp32; Inf -> 255), by frexp."""
    m, e = torch.frexp(f)
    out = torch.where(m == 0.5, e - 1, e).to(torch.int64) + 127
    return torch.where(torch.isinf(f), torch.full_like(out, 255), out)


def ue8m0_expected(amax: torch.Tensor, rule: str) -> torch.Tensor:
    if rule == "recip":
        f = amax.to(F32).clamp_min(6.0 * 2.0 ** -126) * INV6
        return ceil_exp_frexp(f)
    f = (amax.to(F32) / torch.tensor(6.0)).clamp_min(torch.tensor(1e-4, dtype=F32).item())
    return ceil_exp_frexp(f).clamp(1, 254)


def pow2_f32(e: torch.Tensor) -> torch.Tensor:
    """2^(e-127) as fp32 for biased e in 1..254; e = 255 gives +Inf (the bits 0x7F800000)."""
    v = torch.pow(2.0, (e.to(torch.float64) - 127)).to(F32)
    return torch.where(e >= 255, torch.full_like(v, float("inf")), v)


def e2m1_index(a: torch.Tensor, rounding: str) -> torch.Tensor:
    """Magnitude index of |v| (float64 >= 0, NaN -> 7): the nearest grid point; at an exact midpoint
    `threshold` goes toward zero, `rne`/`hardware` to the even index (SPEC §2)."""
    a = a.to(torch.float64)
    nan = torch.isnan(a)
    a = torch.where(nan, torch.zeros_like(a), a).clamp(max=6.0)
    i = (torch.searchsorted(GRID, a.reshape(-1).contiguous(), right=True) - 1).clamp(0, 7).reshape(a.shape)
    lo = a - GRID[i]
    hi = GRID[(i + 1).clamp(max=7)] - a
    tie = i if rounding == "threshold" else torch.where(i % 2 == 0, i, i + 1)
    m = torch.where((lo == 0) | (lo < hi), i, torch.where(lo > hi, i + 1, tie))
    return torch.where(nan, torch.full_like(m, 7), m)


def e2m1_expected(v: torch.Tensor, rounding: str) -> torch.Tensor:
    m = e2m1_index(v.abs(), rounding)
    if rounding == "hardware":
        sign = torch.signbit(v)
    else:
        sign = (v < 0) & (m != 0)
    return (m | (sign.to(torch.int64) << 3)).to(torch.uint8)


def fp4_expected(x: torch.Tensor, rounding: str, rule: str):
    """x fp32 [..., n] -> (packed payload uint8 [..., n/2], exponents uint8 [..., n/32]) per SPEC §2-§3."""
    x = canon(x)
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    e = ue8m0_expected(amax_nan_ignoring(xb), rule)
    v = xb / pow2_f32(e).unsqueeze(-1)
    codes = e2m1_expected(v, rounding)
    if rule == "recip":
        nan_scale = (e == 255).unsqueeze(-1)
        fill = ((torch.signbit(xb).to(torch.uint8) << 3) | 7) if rounding == "hardware" else torch.full_like(codes, 7)
        codes = torch.where(nan_scale, fill, codes)
    codes = codes.reshape(x.shape)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)), e.to(torch.uint8)


def fake_quant_expected(x: torch.Tensor, block: int, scale: str, out_dtype) -> torch.Tensor:
    """SPEC §7.2 stage 1 in fp32 ops, rounded to out_dtype with canonical NaN."""
    x = canon(x)
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = amax_nan_ignoring(xb)
    if scale == "ue8m0":
        s = pow2_f32(ue8m0_expected(amax, "recip"))
    else:
        s = (amax * INV6).clamp(2.0 ** -9, 448.0).to(torch.float8_e4m3fn).to(F32)
    s = s.unsqueeze(-1)
    y = torch.clamp(xb / s, -6.0, 6.0)
    r = GRID[e2m1_index(y.abs(), "rne")].to(F32)
    q = torch.where(y < 0, -r, r)
    q = torch.where(torch.isnan(y), y, q)
    return cast_canon((q * s).reshape(x.shape), out_dtype)


def cast_canon(x: torch.Tensor, dtype) -> torch.Tensor:
    """fp32 -> dtype (nearest even) with the canonical NaN of dtype (docs/semantics.md)."""
    y = x.to(F32).to(dtype)
    nan = torch.isnan(y)
    return torch.where(nan, torch.full_like(y, float("nan")), y)


def two_stage_expected(x: torch.Tensor, rounding: str):
    staged = fake_quant_expected(x, 32, "ue8m0", torch.bfloat16).to(F32)
    return fp4_expected(staged, rounding, "pack")


def fp8_scale_expected(amax: torch.Tensor, flavour: str, role: str, scale_fmt) -> torch.Tensor:
    _, fmax, _ = FP8[flavour]
    amax = amax.to(F32)
    if role == "q":
        inv_fmax = torch.tensor(1.0, dtype=F32) / torch.tensor(fmax, dtype=F32)
        s = amax.clamp_min(torch.tensor(1e-10, dtype=F32).item()) * inv_fmax
    else:
        s = amax.clamp_min(torch.tensor(1e-4, dtype=F32).item()) / torch.tensor(fmax, dtype=F32)
    if scale_fmt == "ue8m0":
        m, e = torch.frexp(s)
        p = torch.where(m == 0.5, s, torch.ldexp(torch.ones_like(s), e))
        s = torch.where(torch.isinf(s), s, p)
    return s


def fp8_expected(x: torch.Tensor, s: torch.Tensor, flavour: str) -> torch.Tensor:
    """Codes of x * fl(1/s) (SPEC §4) by torch's own float8 conversion (RNE) after saturation."""
    dt, fmax, nan_code = FP8[flavour]
    inv = torch.ones_like(s) / s
    y = canon(canon(x) * inv.unsqueeze(-1))
    codes = y.clamp(-fmax, fmax).to(dt).view(torch.uint8)
    return torch.where(torch.isnan(y), torch.full_like(codes, nan_code), codes)


def _bits_eq(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.contiguous().view(torch.uint8) == b.contiguous().view(torch.uint8)


def _first(mask: torch.Tensor, *tensors, k=4):
    idx = mask.nonzero()[:k].tolist()
    return [(i, *[t[tuple(i)].item() if t.dim() else t.item() for t in tensors]) for i in idx]


# ---- per-op quantizer inputs (fp32, CPU) ----------------------------------------------------------
def _cs(a, m, ratio=1):
    p = _pos_rows(a["positions"], m["max_pos"], ratio)
    if "freqs" in a:
        f = a["freqs"].detach().cpu()[p].to(F32)
        return f[..., 0::2], f[..., 1::2]
    return a["cos_cache"].detach().cpu()[p].to(F32), a["sin_cache"].detach().cpu()[p].to(F32)


def indexer_inputs(a, m):
    cos, sin = _cs(a, m)
    q, k = a["q"].detach().cpu(), a["k"].detach().cpu()
    dt = q.dtype
    qr = round_to(rope(q.to(F32), cos.unsqueeze(1), sin.unsqueeze(1), a["is_neox"], tail=False), dt)
    kn = round_to(layer_norm(k.to(F32), a["norm_weight"].cpu(), a["norm_bias"].cpu(), a["epsilon"]), dt)
    kr = round_to(rope(kn, cos, sin, a["is_neox"], tail=False), dt)
    return qr, kr


# ---- the invariant checks --------------------------------------------------------------------------
def _cmp(problems, name, exp, got):
    ok = _bits_eq(exp, got)
    if not bool(ok.all()):
        bad = (~ok).nonzero()[:4].tolist()
        eb, gb = exp.contiguous().view(torch.uint8), got.contiguous().view(torch.uint8)
        problems.append(f"{name}: {int((~ok).sum())} bytes differ from the SPEC expectation, first at {bad}: "
                        f"expected {[eb[tuple(i)].item() for i in bad]} got {[gb[tuple(i)].item() for i in bad]}")


def check_untouched(call: Call, problems: list, q_rows: torch.Tensor | None):
    """Skipped token rows keep the poison; cache bytes of slots not written keep the poison."""
    a, m = call.kwargs, call.meta
    if q_rows is not None:
        for name in ("q_out", "weights_out", "q_scale_out"):
            t = a.get(name)
            if t is None or t.shape[0] == 0:
                continue
            rows = t.detach().cpu().contiguous().view(torch.uint8).reshape(t.shape[0], -1)
            skipped = rows[~q_rows]
            if skipped.numel() and not bool((skipped == POISON).all()):
                problems.append(f"{name}: a skipped token's row was written")
    if m.get("caches") and "cap" in m:
        slots = a.get("slot_mapping", a.get("slots")).detach().cpu().tolist()
        sizes = {n: u8(a[n]).numel() for n in m["caches"]}
        written = cache_masks(m, slots, "any", sizes)
        for n in m["caches"]:
            rest = u8(a[n])[~written[n]]
            if not bool((rest == POISON).all()):
                problems.append(f"{n}: {int((rest != POISON).sum())} bytes outside the written slots changed")


def check_indexer(call: Call, problems: list):
    a, m = call.kwargs, call.meta
    T, H = m["T"], m["H"]
    slots = a["slot_mapping"].detach().cpu().to(torch.int64)
    q_rows = torch.ones(T, dtype=torch.bool) if a["compute_all_q_rope"] else slots >= 0
    check_untouched(call, problems, q_rows)
    if T == 0:
        return
    qr, kr = indexer_inputs(a, m)
    qi = q_rows.nonzero().flatten()
    once, _ = slot_rows(m, slots.tolist())
    w = a["weights"].detach().cpu()
    if m["layout"] == "fp8_132":
        fl = m["flavour"]
        s_q = fp8_scale_expected(amax_nan_ignoring(qr), fl, "q", a["scale_fmt"])        # [T, H]
        _cmp(problems, "q_out (rows written)", fp8_expected(qr, s_q, fl)[qi],
             a["q_out"].detach().cpu().view(torch.uint8)[qi])
        ws = torch.tensor(a["weights_scale"], dtype=F32)
        w_exp = canon((w.to(F32) * s_q) * ws)
        _cmp(problems, "weights_out (rows written)", w_exp[qi], a["weights_out"].detach().cpu()[qi])
        s_k = fp8_scale_expected(amax_nan_ignoring(kr), fl, "k", a["scale_fmt"])        # [T]
        codes_k = fp8_expected(kr, s_k, fl)
        flat = u8(a["kv_cache"])
        for s, t in once.items():
            off = slot_offsets(m, s)["kv_cache"]
            _cmp(problems, f"kv_cache slot {s} (token {t}) codes", codes_k[t], flat[off[:128]])
            _cmp(problems, f"kv_cache slot {s} (token {t}) scale", s_k[t:t + 1], flat[off[128:]].view(F32))
            dec = flat[off[:128]].view(FP8[fl][0]).to(F32) * flat[off[128:]].view(F32)
            _check_fp8_error(problems, kr[t], dec, float(s_k[t]), fl, f"kv_cache slot {s}")
    else:
        pol = a["rounding"]
        pq, eq = fp4_expected(qr, pol, "recip")                                         # [T,H,64], [T,H,4]
        _cmp(problems, "q_out (rows written)", pq[qi], a["q_out"].detach().cpu()[qi])
        qs = u8(a["q_scale_out"])
        per_tok = qs.numel() // T
        for t in qi.tolist():
            h = torch.arange(H).view(H, 1)
            gg = torch.arange(4).view(1, 4)
            off = aiter_q_scale_offset(torch.tensor(t), h, gg, H)
            _cmp(problems, f"q_scale_out token {t}", eq[t], qs[off])
            pad = torch.ones(per_tok, dtype=torch.bool)
            pad[(off - t * per_tok).reshape(-1)] = False
            region = qs[t * per_tok:(t + 1) * per_tok][pad]
            if not bool((region == 0).all()):
                problems.append(f"q_scale_out token {t}: pad entries not 0")
        _cmp(problems, "weights_out (rows written)", cast_canon(w.to(F32), a["weights_out"].dtype)[qi],
             a["weights_out"].detach().cpu()[qi])
        pk, ek = fp4_expected(kr, pol, "recip")
        kv, kvs = u8(a["kv_cache"]), u8(a["kv_cache_scale"])
        for s, t in once.items():
            off = slot_offsets(m, s)
            _cmp(problems, f"kv_cache slot {s} (token {t})", pk[t], kv[off["kv_cache"]])
            _cmp(problems, f"kv_cache_scale slot {s} (token {t})", ek[t], kvs[off["kv_cache_scale"]])
            _check_fp4_error(problems, kr[t], kv[off["kv_cache"]], kvs[off["kv_cache_scale"]], f"kv slot {s}")


def _check_fp8_error(problems, x, dec, s, flavour, name):
    """Dequantized FP8 within the format's error of its input, for rows whose input is finite:
    |dec - x| <= 2^-4 |x| + s * 2^-9 (3 mantissa bits; subnormal quantum of either flavour)."""
    x = x.to(F32)
    if not bool(torch.isfinite(x).all()) or not math.isfinite(s):
        return
    err = (dec.double() - x.double()).abs()
    tol = 2.0 ** -4 * x.double().abs() * (1 + 1e-6) + s * 2.0 ** -9
    if bool((err > tol).any()):
        problems.append(f"{name}: dequantized FP8 off by more than the format's error: {_first(err > tol, x, dec)}")


def _check_fp4_error(problems, x, payload, exps, name):
    """Dequantized FP4 within half an E2M1 step (at the element's magnitude) of its input, finite blocks."""
    x = x.to(F32).reshape(-1, 32)
    codes = torch.stack((payload & 0xF, payload >> 4), dim=-1).reshape(-1, 32).to(torch.int64)
    val = GRID[codes & 7] * torch.where((codes & 8) != 0, -1.0, 1.0)
    e = exps.to(torch.int64)
    for j in range(x.shape[0]):
        if not bool(torch.isfinite(x[j]).all()) or int(e[j]) == 255:
            continue
        sc = 2.0 ** (int(e[j]) - 127)
        a = (x[j].double() / sc).abs().clamp(max=6)
        half = torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0))
        err = (val[j] - x[j].double().clamp(-6 * sc, 6 * sc) / sc).abs()
        if bool((err > half + 1e-12).any()):
            problems.append(f"{name} block {j}: a code is more than half an E2M1 step from its input")


def check_k_store(call: Call, problems: list):
    a, m = call.kwargs, call.meta
    check_untouched(call, problems, None)
    if m["T"] == 0:
        return
    k = a["k"].detach().cpu()
    cos, sin = _cs(a, m, m["ratio"])
    kn = round_to(rms_norm(k.to(F32), a["norm_weight"].cpu(), a["eps"]), k.dtype)
    kr = round_to(rope(kn, cos, sin, neox=False, tail=True), k.dtype)
    p, e = two_stage_expected(kr, a["rounding"])
    once, _ = slot_rows(m, a["slots"].detach().cpu().tolist())
    flat = u8(a["cache"])
    for s, t in once.items():
        off = slot_offsets(m, s)["cache"]
        _cmp(problems, f"cache slot {s} (token {t}) payload", p[t], flat[off[:64]])
        _cmp(problems, f"cache slot {s} (token {t}) exponents", e[t], flat[off[64:]])
        if bool(torch.isfinite(kr[t]).all()) and float(amax_nan_ignoring(kr[t])) < 2.0 ** 120:
            # two stages lose at most one half-step each: check against the stage-1 values
            staged = fake_quant_expected(kr[t], 32, "ue8m0", torch.bfloat16).to(F32)
            _check_fp4_error(problems, staged, flat[off[:64]], flat[off[64:]], f"cache slot {s}")
    if 0 in a["slots"].detach().cpu().tolist():
        off = slot_offsets(m, 0)["cache"]
        if not bool((flat[off] == POISON).all()):
            problems.append("cache: the reserved slot 0 was written")


def check_q_pack(call: Call, problems: list, ret):
    a, m = call.kwargs, call.meta
    payload, exps, w_out = ret
    if m["T"] == 0:
        return
    q = a["q"].detach().cpu()
    cos, sin = _cs(a, m)
    qr = round_to(rope(q.to(F32), cos.unsqueeze(1), sin.unsqueeze(1), neox=False, tail=True), q.dtype)
    p, e = two_stage_expected(qr, a["rounding"])
    _cmp(problems, "payload", p, payload.detach().cpu())
    _cmp(problems, "exponents (byte j = block j)", e, exps.detach().cpu().contiguous().view(torch.uint8)
         .reshape(*exps.shape, 4))
    w = a["head_weights"].detach().cpu().to(F32)
    w_exp = cast_canon(w * torch.tensor(a["weight_scale"], dtype=F32), torch.bfloat16).to(F32)
    _cmp(problems, "weights", w_exp, w_out.detach().cpu())


def check_fake_quant(call: Call, problems: list, ret):
    a, m = call.kwargs, call.meta
    if m["T"] == 0:
        return
    x = a["x"].detach().cpu()
    cos, sin = _cs(a, m, m["ratio"])
    if x.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    xr = round_to(rope(x.to(F32), cos, sin, neox=False, tail=True), x.dtype)
    _cmp(problems, "out", fake_quant_expected(xr, a["block"], a["scale"], x.dtype), ret.detach().cpu())


def check_v4_k(call: Call, problems: list):
    a, m = call.kwargs, call.meta
    check_untouched(call, problems, None)
    if m["T"] == 0:
        return
    kv = a["kv"].detach().cpu()
    x = kv[:, 0, :] if kv.dim() == 3 else kv
    cos, sin = _cs(a, m)
    y = rope(rms_norm(x.to(F32), a["norm_weight"].cpu(), a["epsilon"]), cos, sin, neox=False, tail=True)
    if a["hadamard"]:
        y = hadamard(y)
    p, e = fp4_expected(y, a["rounding"], "recip")
    once, _ = slot_rows(m, a["slot_mapping"].detach().cpu().tolist())
    kvb, kvs = u8(a["kv_cache"]), u8(a["kv_cache_scale"])
    for s, t in once.items():
        off = slot_offsets(m, s)
        _cmp(problems, f"kv_cache slot {s} (token {t})", p[t], kvb[off["kv_cache"]])
        _cmp(problems, f"kv_cache_scale slot {s} (token {t})", e[t], kvs[off["kv_cache_scale"]])
        _check_fp4_error(problems, y[t], kvb[off["kv_cache"]], kvs[off["kv_cache_scale"]], f"kv slot {s}")


def run_reference_and_check(c) -> list:
    """Build case `c` on the CPU, run the reference (default backend on CPU), check every invariant."""
    call = build(c)
    drain_flags()
    ret = call.fn(**call.kwargs)
    flags = take_flags("cpu")
    problems = []
    exp_flags = expected_flags(call)
    if flags != exp_flags:
        problems.append(f"error flags: expected {exp_flags}, got {flags}")
    op = c["op"]
    if op.startswith("indexer"):
        check_indexer(call, problems)
    elif op == "k_store":
        check_k_store(call, problems)
    elif op == "q_pack":
        check_q_pack(call, problems, ret)
    elif op == "fake_quant":
        check_fake_quant(call, problems, ret)
    else:
        check_v4_k(call, problems)
    return problems


# =====================================================================================================
# (a) the reference properties (pytest)
# =====================================================================================================
REF_EXAMPLES = {"indexer_fp8": 200, "indexer_fp4": 150, "k_store": 200, "q_pack": 150, "fake_quant": 150, "v4_k": 200}


def _ref_property(op):
    @prop_settings(REF_EXAMPLES[op])
    @given(case=STRATEGIES[op]())
    def prop(case):
        note(f"case = {case!r}")
        problems = run_reference_and_check(case)
        assert not problems, "\n".join(problems[:12])
    return with_examples(op, prop)


test_reference_indexer_fp8 = _ref_property("indexer_fp8")
test_reference_indexer_fp4 = _ref_property("indexer_fp4")
test_reference_k_store = _ref_property("k_store")
test_reference_q_pack = _ref_property("q_pack")
test_reference_fake_quant = _ref_property("fake_quant")
test_reference_v4_k = _ref_property("v4_k")


# =====================================================================================================
# (b) backend == reference, as a hypothesis property (used by the interpreter workers and the GPU file)
# =====================================================================================================
def equality_property(op: str, backend: str, device, n: int, max_t: int = MAX_T, max_h: int = MAX_H,
                      on_result=None, adjust=None, shrink: bool = True):
    """A hypothesis-driven callable: every drawn case of `op` gives the same bytes on `backend` as on the
    reference. `adjust(case)` may edit a case (e.g. to leave out a known bug); `on_result(total, bad)`
    sees the byte counts."""
    @prop_settings(n, shrink)
    @given(case=STRATEGIES[op](max_t=max_t, max_h=max_h))
    def prop(case):
        if adjust is not None:
            case = adjust(case)
        note(f"case = {case!r}")
        problems, total, bad = compare_backend(build(case, device), backend)
        if on_result is not None:
            on_result(total, bad)
        assert not problems, "\n".join(problems[:12])
    return with_examples(op, prop)


# ---- the interpreter workers -------------------------------------------------------------------------
INTERP_EXAMPLES = {"indexer_fp8": 25, "indexer_fp4": 20, "k_store": 30, "q_pack": 25, "fake_quant": 25, "v4_k": 30}
INTERP_MAX_T, INTERP_MAX_H = 12, 20
INTERP_SHARDS = (("indexer_fp8", "k_store", "fake_quant"), ("indexer_fp4", "q_pack", "v4_k"))


def _worker_main(ops: list[str], out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "the worker must run with TRITON_INTERPRET=1"
    import warnings
    warnings.filterwarnings("ignore")
    from dsaquant import dispatch
    ok, why = dispatch.available("triton")
    results = {}
    for op in ops:
        t0 = time.time()
        if not ok:
            results[op] = dict(status="skip", detail=f"dispatch.available('triton') is false: {why}")
            continue
        counts = [0, 0, 0]

        def tally(total, bad):
            counts[0] += 1
            counts[1] += total
            counts[2] += bad
        try:
            equality_property(op, "triton", "cpu", INTERP_EXAMPLES[op], INTERP_MAX_T, INTERP_MAX_H, tally,
                              shrink=False)()
            res = dict(status="ok")
        except BaseException as e:  # hypothesis re-raises the shrunk failure (with the case in its notes)
            notes = "\n".join(getattr(e, "__notes__", []))
            res = dict(status="fail", detail=(traceback.format_exc()[-3000:] + "\n" + notes[-3000:]))
        res.update(seconds=time.time() - t0, examples=counts[0], compared=counts[1], mismatches=counts[2])
        results[op] = res
        print(f"{op}: {json.dumps(res)[:400]}", flush=True)
    Path(out_path).write_text(json.dumps(results))


if __name__ != "__main__":
    import pytest

    @pytest.fixture(autouse=True, scope="module")
    def _one_thread():
        """The tensors here are small: torch's intra-op thread pool only adds spin-waiting, which gets very
        slow when the machine is oversubscribed. Restored afterwards."""
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(n)

    @pytest.fixture(scope="module")
    def interp_results(request):
        import importlib.util
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed")
        selected = {item.callspec.params["op"] for item in request.session.items
                    if getattr(item, "callspec", None) is not None and "op" in item.callspec.params
                    and Path(str(item.fspath)).resolve() == HERE}
        shards = [[op for op in shard if op in selected] for shard in INTERP_SHARDS]
        shards = [s for s in shards if s]
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")]))
        env.pop("DSAQUANT_BACKEND", None)
        env.pop("DSAQUANT_HOST_CHECKS", None)
        tmp = Path(tempfile.mkdtemp(prefix="dsq_props_interp_"))
        procs = []
        for i, shard in enumerate(shards):
            out = tmp / f"out{i}.json"
            log = open(tmp / f"log{i}.txt", "w")
            procs.append((subprocess.Popen([sys.executable, str(HERE), "--triton-worker", ",".join(shard), str(out)],
                                           env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO)),
                          out, log, i, shard))
        results = {}
        for p, out, log, i, shard in procs:
            try:
                p.wait(timeout=900)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            log.close()
            if out.exists():
                results.update(json.loads(out.read_text()))
            tail = (tmp / f"log{i}.txt").read_text()[-3000:]
            for op in shard:
                results.setdefault(op, dict(status="fail", detail=f"worker died (rc {p.returncode}):\n{tail}"))
        return results

    @pytest.mark.parametrize("op", OPS)
    def test_triton_interpreter_equals_reference(op, interp_results):
        r = interp_results[op]
        if r["status"] == "skip":
            pytest.skip(r["detail"])
        assert r["status"] == "ok", f"{op}: triton (interpreter) differs from the reference:\n{r['detail']}"
        assert r["examples"] > 0 and r["compared"] > 0, r
        print(f"{op}: {r['examples']} examples, {r['compared']} bytes compared, {r['seconds']:.1f} s")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--triton-worker":
        sys.path.insert(0, str(REPO / "python"))
        _worker_main(sys.argv[2].split(","), sys.argv[3])
    else:
        print(__doc__)
        print(f"usage: TRITON_INTERPRET=1 python {HERE.name} --triton-worker OP[,OP...] OUT.json")

"""The `triton` backend's writers against the reference, byte for byte, under TRITON_INTERPRET=1 (CPU).

The interpreter must be switched on before triton compiles anything, and must never leak into a process
that also runs compiled Triton kernels (the GPU suite, the ahead-of-time compile test). So the cases run
in worker subprocesses started with TRITON_INTERPRET=1: this file is also the worker
(`python tests/test_triton_quant.py --worker CASES.json OUT.json`). The parent runs every selected case
once (a session fixture, spread over up to 4 workers) and each parametrized test checks its case's result.

Two kinds of cases:
- `op:*`: one public op called with backend="triton" and backend="reference" on the same inputs (outputs
  poisoned with testing.POISON); every byte of every tensor argument and return value must agree, so a
  byte the kernel fails to write, or writes where it must not (skipped rows, slot 0, pad entries), is a
  mismatch. Small grids: T in {1, 5, 17}, H in {16, 32}, scales {1, 40, 1e-3, 1e-30}, all policies,
  both FP8 flavours, ue8m0/fp32 scales, preshuffle, neox/interleaved, compute_all_q_rope, compress
  ratios 1/2/4, rows of zeros / E2M1 midpoints / NaN and ±Inf / tiny values, negative slots, slot 0,
  the last slot, an out-of-range slot and positions outside [0, max_pos) (the device error flag must
  equal the reference's), int32/int64 indices,
  strided inputs and every input dtype.
- `fmt:*`: the device functions of dsaquant/triton/formats.py on large value sets (every bf16 bit
  pattern, random fp32 bit patterns, rounding boundaries) against the reference helpers.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from interp_workers import Tally, as_bytes, check_result, clone_args, run_cases, run_selected, torch_dtype

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]

SCALES = (1.0, 40.0, 1e-3, 1e-30)
POLICIES = ("threshold", "rne", "hardware")
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# =====================================================================================================
# the case list (shared by the parent and the workers)
# =====================================================================================================
def _indexer_cases():
    cases = {}
    i = 0
    # FP8: every (flavour, scale_fmt, preshuffle, rope style) once, T/H/scale cycling
    for flavour in ("e4m3fn", "e4m3fnuz"):
        for sfmt in ("ue8m0", None):
            for presh in (False, True):
                for neox in (True, False):
                    T, H = (1, 5, 17)[i % 3], (16, 32)[i % 2]
                    c = dict(op="indexer", mode="fp8", T=T, H=H, scale=SCALES[i % 4], flavour=flavour,
                             scale_fmt=sfmt, preshuffle=presh, neox=neox, all_q=(i % 3 == 1),
                             pos_dtype="int32" if i % 2 else "int64", slot_dtype="int64" if i % 3 else "int32",
                             page=16 if i % 4 == 1 else 64, special=i, seed=100 + i)
                    cases[f"indexer-fp8-{flavour}-{sfmt}-p{int(presh)}-{'neox' if neox else 'il'}-T{T}-H{H}"] = c
                    i += 1
    # FP4: every (policy, rope style, scale)
    for policy in POLICIES:
        for neox in (True, False):
            for j, scale in enumerate(SCALES):
                T, H = (1, 5, 17)[(i + j) % 3], (16, 32)[(i + j) % 2]
                c = dict(op="indexer", mode="fp4", T=T, H=H, scale=scale, policy=policy, neox=neox,
                         all_q=(j == 2), pos_dtype="int32" if j % 2 else "int64",
                         slot_dtype="int32" if j == 1 else "int64", page=16 if j == 3 else 64, special=i + j,
                         seed=200 + i * 4 + j)
                cases[f"indexer-fp4-{policy}-{'neox' if neox else 'il'}-s{scale:g}-T{T}-H{H}"] = c
            i += 1
    # dtypes, tables, strides, weights conversions, out-of-range slots
    extra = [
        dict(mode="fp8", dtype="float16", cs_dtype="float16", T=17, H=16, scale=40.0, flavour="e4m3fn"),
        dict(mode="fp8", dtype="bfloat16", cs_dtype="float32", T=5, H=32, scale=1.0, flavour="e4m3fnuz",
             strided=True, w_dtype="bfloat16"),
        dict(mode="fp8", dtype="float16", cs_dtype="float32", T=5, H=16, scale=1e-3, flavour="e4m3fn",
             oob=True, neox=False),
        dict(mode="fp8", dtype="bfloat16", T=17, H=16, scale=1.0, flavour="e4m3fn", all_q=True, oob=True),
        dict(mode="fp4", dtype="float16", cs_dtype="float16", T=5, H=16, scale=1.0, policy="hardware",
             w_dtype="float32", wo_dtype="float16"),
        dict(mode="fp4", dtype="bfloat16", cs_dtype="float32", T=5, H=32, scale=40.0, policy="rne",
             w_dtype="bfloat16", wo_dtype="bfloat16", strided=True),
        dict(mode="fp4", dtype="bfloat16", T=5, H=16, scale=1e-30, policy="threshold", w_dtype="float16",
             wo_dtype="bfloat16", oob=True),
        dict(mode="fp4", dtype="float16", T=17, H=16, scale=40.0, policy="rne", w_dtype="float32",
             wo_dtype="float32", all_q=True, neox=False),
    ]
    for j, c in enumerate(extra):
        c = dict(dict(op="indexer", neox=True, all_q=False, pos_dtype="int64", slot_dtype="int64", page=64,
                      special=j, seed=300 + j, scale_fmt="ue8m0", preshuffle=False), **c)
        cases[f"indexer-extra{j}-{c['mode']}-{c.get('dtype')}-T{c['T']}-H{c['H']}"] = c
    return cases


def _k_store_cases():
    cases = {}
    i = 0
    for ratio in (1, 2, 4):
        for policy in POLICIES:
            T = (1, 5, 17)[i % 3]
            c = dict(op="k_store", T=T, ratio=ratio, policy=policy, scale=SCALES[i % 4],
                     dtype="float16" if i % 4 == 3 else "bfloat16", nw_dtype=("bfloat16", "float32", "float16")[i % 3],
                     pos_dtype="int32" if i % 2 else "int64", slot_dtype="int32" if i % 3 == 2 else "int64",
                     page=16 if i % 2 else 64, special=i, seed=400 + i, oob=(i == 4), strided=(i == 5))
            cases[f"k_store-r{ratio}-{policy}-T{T}-s{SCALES[i % 4]:g}"] = c
            i += 1
    for j, scale in enumerate(SCALES):      # every scale under the default policy
        c = dict(op="k_store", T=17, ratio=1, policy="rne", scale=scale, dtype="bfloat16", nw_dtype="bfloat16",
                 pos_dtype="int64", slot_dtype="int64", page=64, special=j + 2, seed=450 + j, oob=False, strided=False)
        cases[f"k_store-scale{scale:g}"] = c
    return cases


def _q_pack_cases():
    cases = {}
    i = 0
    for policy in POLICIES:
        for j, scale in enumerate(SCALES):
            T, H = (1, 5, 17)[(i + j) % 3], (16, 32)[(i + j) % 2]
            if T == 17 and H == 32:
                T = 9
            c = dict(op="q_pack", T=T, H=H, policy=policy, scale=scale, dtype="float16" if j == 3 else "bfloat16",
                     w_dtype=("bfloat16", "float32", "float16")[(i + j) % 3], pos_dtype="int32" if j % 2 else "int64",
                     special=i + j, seed=500 + 4 * i + j, strided=(j == 1))
            cases[f"q_pack-{policy}-s{scale:g}-T{T}-H{H}"] = c
        i += 1
    return cases


def _fake_quant_cases():
    cases = {}
    i = 0
    for block, scale in ((32, "ue8m0"), (16, "e4m3")):
        for ratio in (1, 2, 4):
            for three_d in (False, True):
                T = (1, 5, 17)[i % 3]
                c = dict(op="fake_quant", T=T, H=16 if three_d else None, block=block, qscale=scale, ratio=ratio,
                         scale=SCALES[i % 4], dtype="float16" if i % 3 == 1 else "bfloat16",
                         pos_dtype="int32" if i % 2 else "int64", special=i, seed=600 + i, strided=(i % 4 == 2))
                cases[f"fake_quant-b{block}-r{ratio}-{'3d' if three_d else '2d'}-T{T}"] = c
                i += 1
    return cases


def _v4_k_cases():
    cases = {}
    i = 0
    for policy in POLICIES:
        for hadamard in (True, False):
            for layout in ("aiter_fp4", "dense"):
                T = (1, 5, 17)[i % 3]
                c = dict(op="v4_k", T=T, policy=policy, hadamard=hadamard, layout=layout, scale=SCALES[i % 4],
                         dtype=("bfloat16", "float16", "float32")[i % 3], nw_dtype=("bfloat16", "float32")[i % 2],
                         cs_dtype=("bfloat16", "float16", "float32")[(i // 3) % 3], three_d=(i % 4 == 1),
                         pos_dtype="int32" if i % 2 else "int64", slot_dtype="int32" if i % 5 == 0 else "int64",
                         page=16 if i % 3 == 2 else 64, special=i, seed=700 + i, oob=(i in (3, 8)))
                cases[f"v4_k-{policy}-h{int(hadamard)}-{layout}-T{T}"] = c
                i += 1
    return cases


FMT_CASES = {f"fmt-{n}": dict(op="fmt", name=n) for n in
             ("fp8_encode", "e2m1_encode", "round_to", "ue8m0", "canonical_sum", "hadamard", "fake_quant",
              "fp4_quantize", "fp4_packed", "sqrt")}


def all_cases():
    cases = {}
    for part in (FMT_CASES, _indexer_cases(), _k_store_cases(), _q_pack_cases(), _fake_quant_cases(),
                 _v4_k_cases()):
        cases.update(part)
    return cases


CASES = all_cases()


# =====================================================================================================
# the parent: run the selected cases in interpreter workers, one test per case
# =====================================================================================================
if __name__ != "__main__":
    import pytest

    def _cost(c):
        if c["op"] == "fmt":
            return 8.0
        T, H = c.get("T", 1), c.get("H") or 1
        return 0.3 + 0.004 * T * (H if c["op"] in ("indexer", "q_pack", "fake_quant") else 1)

    @pytest.fixture(scope="session")
    def interp_results(request):
        pytest.importorskip("triton")
        return run_selected(request, HERE, CASES, _cost, "dsq_triton_interp_", "triton interpreter")

    @pytest.mark.parametrize("case_id", list(CASES))
    def test_triton_matches_reference(case_id, interp_results):
        check_result(case_id, interp_results.get(case_id))


# =====================================================================================================
# the worker (TRITON_INTERPRET=1): everything below runs only in the subprocess
# =====================================================================================================
def _worker_main(cases_path: str, out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "the worker must run with TRITON_INTERPRET=1"

    # the fmt kernels below are nested functions: the interpreter resolves their names in this module's globals
    global triton, tl, F
    import triton
    import triton.language as tl
    from dsaquant.triton import formats as F

    run_cases(cases_path, out_path, CASES, run_case)


def _inject(x, which: int):
    """The shared special rows (dsaquant.testing.special_rows)."""
    from dsaquant.testing import special_rows
    return special_rows(x, which)


def _strided_rows(x):
    """A non-contiguous copy of x whose last dim is contiguous (rows padded to twice the width)."""
    import torch
    big = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    big.view(torch.uint8).fill_(0x5A)
    big[..., : x.shape[-1]] = x
    return big[..., : x.shape[-1]]


def _strided_vec(v):
    import torch
    big = torch.zeros(v.shape[0], 2, dtype=v.dtype)
    big[:, 0] = v
    return big[:, 0]


def _strided_2d(w):
    """[T, H] -> same values in a transposed (non-contiguous) layout."""
    return w.t().contiguous().t()


def _run_pair(fn, args, tally, out_keys=None, returns=False, oob=False):
    """Call fn with backend reference and triton on clones of args; compare every tensor argument and return
    value; check the device error flag (raised by both when `oob`)."""
    import torch
    from dsaquant import errors
    try:
        errors.check_errors()
    except errors.DsaquantError:
        pass
    a_ref, a_tr = clone_args(args), clone_args(args)
    r_ref = fn(**a_ref, backend="reference")
    ref_flag = int(errors.flag_tensor("cpu").item())
    errors.flag_tensor("cpu").zero_()
    r_tr = fn(**a_tr, backend="triton")
    tr_flag = int(errors.flag_tensor("cpu").item())
    errors.flag_tensor("cpu").zero_()
    tally.check(ref_flag == tr_flag, f"error flag: reference {ref_flag}, triton {tr_flag}")
    tally.check(bool(tr_flag & errors.SLOT_OUT_OF_RANGE) == bool(oob),
                f"error flag {tr_flag} but out-of-range slot present: {oob}")
    for k in args:
        if isinstance(args[k], torch.Tensor):
            tally.eq(k, a_ref[k], a_tr[k])
    if returns:
        rr = r_ref if isinstance(r_ref, tuple) else (r_ref,)
        rt = r_tr if isinstance(r_tr, tuple) else (r_tr,)
        for i, (x, y) in enumerate(zip(rr, rt)):
            tally.eq(f"ret{i}", x, y)
    return a_ref, a_tr


def _case_indexer(c, tally):
    import torch
    import dsaquant as dq
    from dsaquant import testing as tt
    dtype = torch_dtype(c.get("dtype", "bfloat16"))
    fp8_dtype = torch.float8_e4m3fnuz if c.get("flavour") == "e4m3fnuz" else torch.float8_e4m3fn
    a = tt.make_indexer(T=c["T"], H=c["H"], mode=c["mode"], seed=c["seed"], scale=c["scale"], page_size=c["page"],
                        dtype=dtype, preshuffle=c.get("preshuffle", False), is_neox=c["neox"],
                        scale_fmt=c.get("scale_fmt", "ue8m0"), rounding=c.get("policy", "hardware"),
                        max_pos=256, compute_all_q_rope=c["all_q"], pos_dtype=torch_dtype(c["pos_dtype"]), fp8_dtype=fp8_dtype)
    T, H = c["T"], c["H"]
    a["q"] = _inject(a["q"], c["special"])
    a["k"] = _inject(a["k"], c["special"] + 2)
    if c.get("cs_dtype"):
        cos, sin, _ = tt.rope_tables(256, "cpu", torch_dtype(c["cs_dtype"]))
        a["cos_cache"], a["sin_cache"] = cos, sin
    pos = a["positions"].clone()
    if T >= 2:
        pos[1] = 10 ** 6          # clamped to max_pos - 1
    if T >= 4:
        pos[3] = -7               # clamped to 0
    a["positions"] = pos
    cap = a["kv_cache"].shape[0] * c["page"]
    s = a["slot_mapping"].clone()
    if T >= 3:
        s[2] = -1                 # skipped (q too unless compute_all_q_rope)
    if T >= 4:
        s[min(4, T - 1)] = 0      # slot 0 is an ordinary slot for this op
    if T == 1:
        s[0] = cap - 1            # the last slot
    if c.get("oob"):
        s[T - 1] = cap + 3
    a["slot_mapping"] = s.to(torch_dtype(c["slot_dtype"]))
    if c.get("w_dtype"):
        a["weights"] = a["weights"].to(torch_dtype(c["w_dtype"]))
    if T >= 2:
        w = a["weights"].clone()
        w[1, 0] = float("nan")
        w[1, 1] = float("-inf")
        a["weights"] = w
    if c.get("wo_dtype"):
        a["weights_out"] = tt.poisoned((T, H), torch_dtype(c["wo_dtype"]), "cpu")
    if c.get("strided"):
        a["q"] = _strided_rows(a["q"])
        a["k"] = _strided_rows(a["k"])
        a["weights"] = _strided_2d(a["weights"])
        a["slot_mapping"] = _strided_vec(a["slot_mapping"])
        a["positions"] = _strided_vec(a["positions"])
        a["norm_weight"] = _strided_vec(a["norm_weight"])
        assert not a["q"].is_contiguous() and not a["weights"].is_contiguous()
    a_ref, a_tr = _run_pair(dq.indexer_qk_rope_quant_and_cache, a, tally, oob=c.get("oob", False))
    # untouched bytes: skipped rows keep the poison in both
    if T >= 3 and not c["all_q"]:
        tally.check(bool((as_bytes(a_tr["q_out"][2]) == tt.POISON).all()), "q_out row of a skipped token was written")


def _case_k_store(c, tally):
    import torch
    import dsaquant as dq
    from dsaquant import testing as tt
    a = tt.make_k_store(T=c["T"], seed=c["seed"], scale=c["scale"], page_size=c["page"], compress_ratio=c["ratio"],
                        rounding=c["policy"], max_pos=256, dtype=torch_dtype(c["dtype"]))
    T = c["T"]
    a["k"] = _inject(a["k"], c["special"])
    a["norm_weight"] = a["norm_weight"].to(torch_dtype(c["nw_dtype"]))
    pos = a["positions"].clone()
    if T >= 2:
        pos[1] = 255 * 4 + 3      # & ~(r-1), then clamped
    if T >= 3:
        pos[2] = -3
    a["positions"] = pos.to(torch_dtype(c["pos_dtype"]))
    cap = a["cache"].shape[0] * c["page"]
    s = a["slots"].clone()
    if T == 1:
        s[0] = cap - 1
    if c.get("oob"):
        s[T - 1] = cap
    a["slots"] = s.to(torch_dtype(c["slot_dtype"]))
    if c.get("strided"):
        a["k"] = _strided_rows(a["k"])
        a["slots"] = _strided_vec(a["slots"])
    a_ref, a_tr = _run_pair(dq.index_k_norm_rope_pack_store, a, tally, oob=c.get("oob", False))
    if T >= 3:   # slot 0 (token 1) is reserved: page 0 position 0 keeps the poison
        P = c["page"]
        flat = as_bytes(a_tr["cache"])
        tally.check(bool((flat[:64] == tt.POISON).all()) and bool((flat[64 * P: 64 * P + 4] == tt.POISON).all()),
                    "slot 0 was written")


def _case_q_pack(c, tally):
    import torch
    import dsaquant as dq
    from dsaquant import testing as tt
    T, H = c["T"], c["H"]
    a = tt.make_q_pack(T=T, H=H, seed=c["seed"], scale=c["scale"], rounding=c["policy"], max_pos=256,
                       dtype=torch_dtype(c["dtype"]))
    a["q"] = _inject(a["q"], c["special"])
    a["head_weights"] = a["head_weights"].to(torch_dtype(c["w_dtype"]))
    hw = a["head_weights"].clone()
    if T >= 2:
        hw[1, 0] = float("nan")
        hw[1, 1] = float("inf")
    a["head_weights"] = hw
    pos = a["positions"].clone()
    if T >= 2:
        pos[-1] = 4096
    a["positions"] = pos.to(torch_dtype(c["pos_dtype"]))
    if c.get("strided"):
        a["q"] = _strided_rows(a["q"])
        a["head_weights"] = _strided_2d(a["head_weights"])
        a["positions"] = _strided_vec(a["positions"])
    a["out"] = (tt.poisoned((T, H, 64), torch.uint8, "cpu"), tt.poisoned((T, H), torch.int32, "cpu"),
                tt.poisoned((T, H), torch.float32, "cpu"))

    def fn(out, backend, **kw):
        return dq.index_q_rope_pack_weights(**kw, out=tuple(o.clone() for o in out), backend=backend)
    _run_pair(fn, a, tally, returns=True)


def _case_fake_quant(c, tally):
    import torch
    import dsaquant as dq
    from dsaquant import testing as tt
    T, H = c["T"], c["H"]
    dtype = torch_dtype(c["dtype"])
    a = tt.make_q_pack(T=T, H=H or 1, seed=c["seed"], scale=c["scale"], max_pos=256, dtype=dtype)
    x = _inject(a["q"], c["special"])
    if H is None:
        x = x[:, 0, :].contiguous()
    if c.get("strided"):
        x = _strided_rows(x)
    pos = a["positions"].clone()
    if T >= 2:
        pos[0] = 300
    args = dict(x=x, positions=pos.to(torch_dtype(c["pos_dtype"])), freqs=a["freqs"], block=c["block"], scale=c["qscale"],
                compress_ratio=c["ratio"], out=tt.poisoned(tuple(x.shape), dtype, "cpu"))

    def fn(out, backend, **kw):
        return dq.rope_fake_quant_fp4(**kw, out=out, backend=backend)
    _run_pair(fn, args, tally, returns=True)


def _case_v4_k(c, tally):
    import torch
    import dsaquant as dq
    from dsaquant import testing as tt
    T = c["T"]
    a = tt.make_v4_k(T=T, seed=c["seed"], scale=c["scale"], page_size=c["page"], hadamard=c["hadamard"],
                     rounding=c["policy"], layout=c["layout"], max_pos=256, dtype=torch_dtype(c["dtype"]))
    kv = _inject(a["kv"], c["special"])
    if c.get("three_d"):
        other = torch.randn(T, 128).to(kv.dtype)
        kv = torch.stack((kv, other), dim=1)             # [T, 2, 128]: head 0 is written
    a["kv"] = kv
    a["norm_weight"] = a["norm_weight"].to(torch_dtype(c["nw_dtype"]))
    cos, sin, _ = tt.rope_tables(256, "cpu", torch_dtype(c["cs_dtype"]))
    a["cos_cache"], a["sin_cache"] = cos, sin
    pos = a["positions"].clone()
    if T >= 2:
        pos[1] = 999
    a["positions"] = pos.to(torch_dtype(c["pos_dtype"]))
    cap = a["kv_cache"].shape[0] * (c["page"] if c["layout"] == "aiter_fp4" else 1)
    s = a["slot_mapping"].clone()
    if T == 1:
        s[0] = cap - 1
    if T >= 3:
        s[0] = 0
        s[2] = -5
    if c.get("oob"):
        s[T - 1] = cap + 1
    a["slot_mapping"] = s.to(torch_dtype(c["slot_dtype"]))
    _run_pair(dq.rmsnorm_rope_rotate_fp4quant_kvcache, a, tally, oob=c.get("oob", False))


def run_case(c):
    tally = Tally()
    op = c["op"]
    if op == "fmt":
        _FMT[c["name"]](tally)
    else:
        {"indexer": _case_indexer, "k_store": _case_k_store, "q_pack": _case_q_pack,
         "fake_quant": _case_fake_quant, "v4_k": _case_v4_k}[op](c, tally)
    return tally.result()


# ---- fmt cases: formats.py device functions on large value sets ----------------------------------------
def _value_set(seed=0, n_random=1 << 18):
    """fp32 values: every bf16 bit pattern, random fp32 bit patterns, and +-1 ulp around the E2M1 and E4M3
    rounding boundaries and their power-of-two multiples."""
    import numpy as np
    import torch
    rng = np.random.default_rng(seed)
    allbf = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
    rnd = rng.integers(0, 1 << 32, size=n_random, dtype=np.uint64).astype(np.uint32).view(np.float32)
    bnd = []
    e2m1_mid = np.array(MIDPOINTS + (6.0, 0.0), dtype=np.float32)
    e4m3 = np.array([(8 + m + 0.5) * 2.0 ** (e - 3) for e in range(-9, 9) for m in range(8)], dtype=np.float32)
    for base in (e2m1_mid, e4m3):
        for k in range(-12, 13):
            v = (base * np.float32(2.0 ** k)).astype(np.float32)
            b = v.view(np.uint32)
            for d in (-1, 0, 1):
                bnd.append((b.astype(np.int64) + d).clip(0, 0xFFFFFFFF).astype(np.uint32).view(np.float32))
    bnd = np.concatenate(bnd)
    vals = np.concatenate([allbf, rnd, bnd, -bnd])
    pad = (-len(vals)) % 4096
    vals = np.concatenate([vals, np.zeros(pad, dtype=np.float32)])
    return torch.from_numpy(vals.copy())


def _fmt_fp8_encode(tally):
    import torch
    from dsaquant.reference.arith import canon_nan
    from dsaquant.reference.fp8 import fp8_encode as ref

    @triton.jit
    def k(x_ptr, o_ptr, c_ptr, BIAS: tl.constexpr, FMAX: tl.constexpr, FNUZ: tl.constexpr, B: tl.constexpr):
        offs = tl.program_id(0) * B + tl.arange(0, B)
        x = tl.load(x_ptr + offs)
        tl.store(o_ptr + offs, F.fp8_encode(x, BIAS, FMAX, FNUZ, False).to(tl.uint8))
        tl.store(c_ptr + offs, F.fp8_encode_scaled(x, 1.0, BIAS, FMAX, FNUZ, False).to(tl.uint8))
    x = _value_set(1)
    for flavour in ("e4m3fn", "e4m3fnuz"):
        bias, fmax, _ = F.fp8_consts(flavour)
        out = torch.empty(x.shape, dtype=torch.uint8)
        canon = torch.empty(x.shape, dtype=torch.uint8)
        k[(x.numel() // 4096,)](x, out, canon, BIAS=bias, FMAX=fmax, FNUZ=flavour == "e4m3fnuz", B=4096)
        tally.eq(f"fp8_encode {flavour}", ref(x, flavour), out)
        tally.eq(f"fp8_encode(canon_nan) {flavour}", ref(canon_nan(x), flavour), canon)


def _fmt_e2m1_encode(tally):
    import torch
    from dsaquant.reference.fp4 import e2m1_encode as ref

    @triton.jit
    def k(x_ptr, o_ptr, POLICY: tl.constexpr, B: tl.constexpr):
        offs = tl.program_id(0) * B + tl.arange(0, B)
        tl.store(o_ptr + offs, F.e2m1_encode(tl.load(x_ptr + offs), POLICY).to(tl.uint8))
    x = _value_set(2)
    for pid, policy in enumerate(POLICIES):
        out = torch.empty(x.shape, dtype=torch.uint8)
        k[(x.numel() // 4096,)](x, out, POLICY=pid, B=4096)
        tally.eq(f"e2m1_encode {policy}", ref(x, policy), out)


def _fmt_round_to(tally):
    import torch
    from dsaquant.reference.arith import cast
    from dsaquant.reference.arith import round_to as ref

    @triton.jit
    def k(x_ptr, o_ptr, KIND: tl.constexpr, B: tl.constexpr):
        offs = tl.program_id(0) * B + tl.arange(0, B)
        tl.store(o_ptr + offs, F.canon_nan(F.round_to(tl.load(x_ptr + offs), KIND, False)))

    @triton.jit
    def kst(x_ptr, o_ptr, KIND: tl.constexpr, B: tl.constexpr):
        offs = tl.program_id(0) * B + tl.arange(0, B)
        tl.store(o_ptr + offs, F.cast_for_store(tl.load(x_ptr + offs), KIND))

    @triton.jit
    def kld(x_ptr, o_ptr, KIND: tl.constexpr, B: tl.constexpr):
        offs = tl.program_id(0) * B + tl.arange(0, B)
        tl.store(o_ptr + offs, F.load_f32(x_ptr, offs, offs >= 0, KIND, False))
    x = _value_set(3)
    n = x.numel() // 4096
    for kind, dtype in ((F.KIND_BF16.value, torch.bfloat16), (F.KIND_F16.value, torch.float16),
                        (F.KIND_F32.value, torch.float32)):
        out = torch.empty_like(x)
        k[(n,)](x, out, KIND=kind, B=4096)
        tally.eq(f"round_to {dtype}", ref(x, dtype), out)
        if dtype != torch.float32:
            st = torch.empty(x.shape, dtype=dtype)
            kst[(n,)](x, st.view(torch.int16) if dtype == torch.bfloat16 else st, KIND=kind, B=4096)
            tally.eq(f"cast to {dtype}", cast(x, dtype), st)
            src = st.clone()
            ld = torch.empty_like(x)
            kld[(n,)](src.view(torch.int16) if dtype == torch.bfloat16 else src, ld, KIND=kind, B=4096)
            tally.eq(f"load {dtype}", src.to(torch.float32), ld)


def _fmt_ue8m0(tally):
    import torch
    from dsaquant.reference.fp4 import ue8m0_exponent as ref
    from dsaquant.reference.arith import ceil_exp, pow2

    @triton.jit
    def k(x_ptr, o_ptr, RULE: tl.constexpr, B: tl.constexpr):
        offs = tl.program_id(0) * B + tl.arange(0, B)
        a = tl.load(x_ptr + offs)
        if RULE == 0:
            e = F.ue8m0_recip(a)
        elif RULE == 1:
            e = F.ue8m0_pack(a)
        else:
            e = F.as_bits(F.pow2(F.ceil_exp(a)))
        tl.store(o_ptr + offs, e)
    x = _value_set(4).abs()
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)      # amax is never NaN
    n = x.numel() // 4096
    for rid, rule in enumerate(("recip", "pack")):
        out = torch.empty(x.shape, dtype=torch.int32)
        k[(n,)](x, out, RULE=rid, B=4096)
        tally.eq(f"ue8m0 {rule}", ref(x, rule).to(torch.int32), out)
    out = torch.empty(x.shape, dtype=torch.int32)
    k[(n,)](x, out, RULE=2, B=4096)
    tally.eq("pow2(ceil_exp)", pow2(ceil_exp(x)).view(torch.int32), out)


def _rows(n, seed, wide=True):
    """[n, 128] fp32 rows: random with a wide dynamic range, plus special rows."""
    import torch
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 128, generator=g)
    if wide:
        x = x * torch.exp2(torch.randint(-30, 30, (n, 128), generator=g).float())
    x = _inject(x, seed)
    x[5] = x[5] * 2.0 ** -140                      # fp32 subnormals
    x[6] = x[6] * 2.0 ** 100
    x[7, ::3] = float("nan")
    return x


def _fmt_canonical_sum(tally):
    import torch
    from dsaquant.reference.arith import canonical_sum as ref

    @triton.jit
    def k(x_ptr, o_ptr, R: tl.constexpr):
        r = tl.program_id(0) * R + tl.arange(0, R)
        c = tl.arange(0, 32)[None, :]
        b = (r * 128)[:, None]
        t0 = tl.load(x_ptr + b + c)
        t1 = tl.load(x_ptr + b + c + 32)
        t2 = tl.load(x_ptr + b + c + 64)
        t3 = tl.load(x_ptr + b + c + 96)
        tl.store(o_ptr + r, F.canonical_sum4(t0, t1, t2, t3, R))
    x = _rows(2048, 5)
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)
    out = torch.empty(x.shape[0])
    k[(x.shape[0] // 64,)](x, out, R=64)
    tally.eq("canonical_sum", ref(x), out)
    xs = x * x
    k[(x.shape[0] // 64,)](xs, out, R=64)
    tally.eq("canonical_sum of squares", ref(xs), out)


def _fmt_hadamard(tally):
    import torch
    from dsaquant.reference.transforms import hadamard as ref

    @triton.jit
    def k(x_ptr, o_ptr, R: tl.constexpr):
        r = tl.program_id(0) * R + tl.arange(0, R)
        c = tl.arange(0, 32)[None, :]
        b = (r * 128)[:, None]
        t0, t1, t2, t3 = F.hadamard4(tl.load(x_ptr + b + c), tl.load(x_ptr + b + c + 32),
                                     tl.load(x_ptr + b + c + 64), tl.load(x_ptr + b + c + 96), R)
        tl.store(o_ptr + b + c, t0)
        tl.store(o_ptr + b + c + 32, t1)
        tl.store(o_ptr + b + c + 64, t2)
        tl.store(o_ptr + b + c + 96, t3)
    x = _rows(512, 6)
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)
    out = torch.empty_like(x)
    k[(x.shape[0] // 64,)](x, out, R=64)
    tally.eq("hadamard", ref(x), out)


def _fmt_fake_quant(tally):
    import torch
    from dsaquant.reference.fp4 import fp4_fake_quant as ref

    @triton.jit
    def k(x_ptr, o_ptr, E4M3: tl.constexpr, R: tl.constexpr):
        r = tl.program_id(0) * R + tl.arange(0, R)
        c = tl.arange(0, 32)[None, :]
        b = (r * 32)[:, None]
        x = F.canon_nan(tl.load(x_ptr + b + c))
        if E4M3:
            y = F.fake_quant_e4m3_tile(x, R, False)
        else:
            y = F.fake_quant_ue8m0_tile(x, False)
        tl.store(o_ptr + b + c, F.round_bf16(y, False))
    x = _rows(1024, 7).reshape(-1, 32)
    for e4m3, (block, scale) in ((False, (32, "ue8m0")), (True, (16, "e4m3"))):
        out = torch.empty_like(x)
        k[(x.shape[0] // 64,)](x, out, E4M3=e4m3, R=64)
        exp = ref(x, block, scale, out_dtype=torch.bfloat16).to(torch.float32)
        tally.eq(f"fake_quant {scale}", exp, out)


def _fmt_fp4_quantize(tally):
    import torch
    from dsaquant.reference.fp4 import fp4_quantize as ref

    @triton.jit
    def k(x_ptr, p_ptr, e_ptr, RULE: tl.constexpr, POLICY: tl.constexpr, R: tl.constexpr):
        r = tl.program_id(0) * R + tl.arange(0, R)
        c = tl.arange(0, 32)[None, :]
        x = tl.load(x_ptr + (r * 32)[:, None] + c)
        p, e = F.fp4_quant_tile(x, RULE, POLICY, R, False)
        tl.store(p_ptr + (r * 16)[:, None] + tl.arange(0, 16)[None, :], p)
        tl.store(e_ptr + r, e.to(tl.uint8))
    x = _rows(1024, 8, wide=False).reshape(-1, 32)
    x[::7] = x[::7] * 1e-30
    x[1::7] = x[1::7] * 1e30
    from dsaquant.codes import Rounding, ScaleRule
    for rule in ("recip", "pack"):
        for policy in POLICIES:
            rid, pid = int(ScaleRule[rule]), int(Rounding[policy])
            p = torch.empty(x.shape[0], 16, dtype=torch.uint8)
            e = torch.empty(x.shape[0], dtype=torch.uint8)
            k[(x.shape[0] // 64,)](x, p, e, RULE=rid, POLICY=pid, R=64)
            rp, re_ = ref(x, policy, rule, 32)
            tally.eq(f"fp4 payload {rule} {policy}", rp, p)
            tally.eq(f"fp4 exps {rule} {policy}", re_.reshape(-1), e)


def _fmt_fp4_packed(tally):
    """The packed bf16x2 FP4 path of fp4_quant_tile (PACKED=True), whose inline PTX the interpreter cannot
    run: the Triton steps (exponents by rule, bf16_inv_pow2_bits) run here, the PTX on the PTX emulator of
    tests/test_triton_fp4_packed.py, and the packed bytes must equal fp4_quantize's, on bf16 values: every
    bf16 bit pattern and wide-range rows with NaN/±Inf blocks, with the exponents of both rules and arbitrary
    ones (1..255, RULE 2 below)."""
    import numpy as np
    import torch
    from dsaquant.reference.arith import bits, canon_nan, pow2
    from dsaquant.reference.fp4 import e2m1_encode, fp4_quantize, pack_nibbles
    from test_triton_fp4_packed import packed_codes

    @triton.jit
    def k(x_ptr, ei_ptr, e_ptr, s_ptr, RULE: tl.constexpr, R: tl.constexpr):
        r = tl.program_id(0) * R + tl.arange(0, R)
        x = tl.load(x_ptr + (r * 32)[:, None] + tl.arange(0, 32)[None, :])
        if RULE == 0:
            e = F.ue8m0_recip(F.amax_tile(x, False))
        elif RULE == 1:
            e = F.ue8m0_pack(F.amax_tile(x, False))
        else:
            e = tl.load(ei_ptr + r)
        tl.store(e_ptr + r, e)
        tl.store(s_ptr + r, F.bf16_inv_pow2_bits(e))

    allbf = (torch.arange(1 << 16, dtype=torch.int32) << 16).view(torch.float32).reshape(-1, 32)
    wide = _rows(512, 11).to(torch.bfloat16).to(torch.float32).reshape(-1, 32)
    wide[5::97] = float("nan")                         # whole NaN blocks (e = 255 under recip)
    wide[6::97, ::5] = float("inf")
    wide[7::97, 1::5] = float("-inf")
    x = torch.cat([allbf, wide])
    n = x.shape[0]
    g = torch.Generator().manual_seed(12)
    e_any = torch.randint(1, 256, (n,), generator=g, dtype=torch.int32)
    e_any[:8] = torch.tensor([1, 2, 126, 127, 128, 253, 254, 255], dtype=torch.int32)
    e_any[::97] = 255
    xb = (bits(x).numpy().view(np.uint32) >> 16).reshape(-1, 2)
    xw = xb[:, 0] | (xb[:, 1] << 16)                  # element 2i low, 2i + 1 high (one row's neighbours)
    # every bf16 scale the kernels can pass: 2^(127-e) for e in 1..254 (a bf16 value), +Inf for e = 255
    e_all = torch.arange(1, 256, dtype=torch.int32)
    inv = torch.exp2((127 - e_all).to(torch.float64)).to(torch.float32)       # exact (2^-127: a subnormal)
    want_s = torch.where(e_all == 255, 0x7F80, bits(inv) >> 16).to(torch.int16)
    for rid, rule in enumerate(("recip", "pack", "any")):
        e_out = torch.empty(n, dtype=torch.int32)
        s_out = torch.empty(n, dtype=torch.int16)
        k[(n // 64,)](x, e_any, e_out, s_out, RULE=rid, R=64)
        sw = np.repeat(s_out.numpy().view(np.uint16).astype(np.uint32), 16) * np.uint32(0x10001)
        for policy in POLICIES:
            c_lo, c_hi = packed_codes(policy, xw, sw)
            codes = torch.from_numpy(np.stack([c_lo, c_hi], axis=1).reshape(x.shape).astype(np.uint8))
            if rule == "any":
                xc = canon_nan(x)
                want = e2m1_encode(xc / pow2(e_out).unsqueeze(-1), policy)
                fill = ((bits(xc) < 0).to(torch.uint8) << 3) | 7 if policy == "hardware" else torch.full_like(want, 7)
                want = pack_nibbles(torch.where((e_out == 255).unsqueeze(-1), fill, want))
            else:
                want, want_e = fp4_quantize(x, policy, rule, 32)
                tally.eq(f"packed fp4 exps {rule}", want_e, e_out.to(torch.uint8))
            tally.eq(f"packed fp4 payload {rule} {policy}", want, pack_nibbles(codes))
    e_out = torch.empty(256, dtype=torch.int32)
    s_out = torch.empty(256, dtype=torch.int16)
    k[(4,)](x, torch.cat([e_all, e_all[-1:]]), e_out, s_out, RULE=2, R=64)
    tally.eq("bf16_inv_pow2_bits", want_s, s_out[:255])


def _fmt_sqrt(tally):
    import numpy as np
    import torch

    @triton.jit
    def k(x_ptr, s_ptr, i_ptr, B: tl.constexpr):
        offs = tl.program_id(0) * B + tl.arange(0, B)
        v = tl.load(x_ptr + offs)
        tl.store(s_ptr + offs, F.sqrt_cr(v))
        tl.store(i_ptr + offs, F.inv_sqrt(v))
    x = _value_set(9).abs()
    g = torch.Generator().manual_seed(9)
    mant = torch.randint(0, 1 << 23, (1 << 16,), generator=g, dtype=torch.int32)
    ex = torch.randint(0, 255, (1 << 16,), generator=g, dtype=torch.int32)
    x = torch.cat([x, (mant | (ex << 23)).view(torch.float32)])          # every binade, denormals included
    x = torch.cat([x, torch.zeros((-x.numel()) % 4096)])
    s = torch.empty_like(x)
    inv = torch.empty_like(x)
    k[(x.numel() // 4096,)](x, s, inv, B=4096)
    ref_s = torch.from_numpy(np.sqrt(x.numpy().astype(np.float64)).astype(np.float32))
    tally.eq("sqrt_cr", ref_s, s)
    tally.eq("inv_sqrt", 1.0 / ref_s, inv)


_FMT = {"sqrt": _fmt_sqrt, "fp8_encode": _fmt_fp8_encode, "e2m1_encode": _fmt_e2m1_encode, "round_to": _fmt_round_to,
        "ue8m0": _fmt_ue8m0, "canonical_sum": _fmt_canonical_sum, "hadamard": _fmt_hadamard,
        "fake_quant": _fmt_fake_quant, "fp4_quantize": _fmt_fp4_quantize, "fp4_packed": _fmt_fp4_packed}


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker_main(sys.argv[2], sys.argv[3])
    else:
        print(__doc__)
        print(f"usage: TRITON_INTERPRET=1 python {HERE.name} --worker CASES.json OUT.json ({len(CASES)} cases)")

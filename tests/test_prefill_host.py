"""The CUDA prefill logits' block body (kernels/cuda/prefill_body.cuh) on the CPU, against the reference.

tests/cpp/prefill_host.cpp runs the body unchanged under the fiber emulator of tests/cpp/fibers.h, with a layer
modelled on the hardware (asynchronous copies that land only when their group is waited for, the matrix unit's
swizzled operand addressing and accumulator fragments, garbage shared memory), through the backend's own
argument struct (dsaquant.backends.prefill_abi). Every case compares with dsaquant.mqa_logits on the reference
backend: -inf and untouched entries exactly where it has them, logits within 1e-5 of the row's largest
magnitude (the emulated products are exact; the sums run in another order)."""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import dsaquant
from dsaquant.backends import prefill_abi

from conftest import REPO
from host_cpp import emulator
from test_prefill import RANGES, _fp4_values, check_close, expected_layout, make, oracle

CPP = REPO / "tests" / "cpp"
SOURCES = [CPP / "prefill_host.cpp", *(REPO / "kernels" / "cuda" / f for f in ("prefill_body.cuh", "prefill.h", "quad.cuh")),
           CPP / "sm90_emu.h", CPP / "fibers.h"]
UNTOUCHED = 12345.0


def load(flags=()):
    """The emulator of the kernel body, built with `flags` (the kernel's tuning macros)."""
    return emulator(SOURCES, "prefill_host", "the prefill emulator", flags)


@pytest.fixture(scope="module")
def lib():
    """The emulator of the kernel body as built."""
    return load()


def run(lib, a, ks, ke, *, W=0, clean=True, bf16=False, splits=0, slots=8, order=0, raw=False):
    """The emulated kernel's output for make() inputs `a` (as the op prepares a call; raw: the int32 bounds as
    they are, unclamped), and the reference's."""
    S, SKV = a["q"].shape[0], a["k"].shape[0]
    Wd = W or SKV
    dt = torch.bfloat16 if bf16 else torch.float32
    ref = torch.full((S, Wd), UNTOUCHED, dtype=dt)
    dsaquant.mqa_logits(ks=ks, ke=ke, layout="fp8", clean_logits=clean, out_dtype=dt, max_seqlen_k=W, out=ref,
                        backend="reference", **a)
    lo = ks.to(torch.int32) if raw else ks.to(torch.int64).clamp(0, SKV).to(torch.int32)
    hi = ke.to(torch.int32) if raw else ke.to(torch.int64).clamp(0, SKV).to(torch.int32)
    base = ks.to(torch.int64).clamp(-Wd, SKV).to(torch.int32) if W else torch.zeros(S, dtype=torch.int32)
    out = torch.full((S, Wd), float("-inf") if (W and clean) else UNTOUCHED, dtype=dt)
    q, k = a["q"].view(torch.uint8).contiguous(), a["k"].view(torch.uint8).contiguous()
    args = prefill_abi.make_args(q, k, a["k_scale"].contiguous(), a["weights"], lo, hi, base, out, clean, bool(W),
                                 splits)
    lib.dsq_emu_set_order(order, 7)
    lib.dsq_emu_set_slots(slots)
    rc = prefill_abi.call(lib, args, 0)
    assert rc == 0, f"rc {rc}: {lib.dsq_error_string(rc).decode()}"
    return out, ref


def compare(a, ks, ke, got, ref, W=0, bf16=False):
    assert torch.equal(got == UNTOUCHED, ref == UNTOUCHED), "untouched entries differ"
    keep = ref != UNTOUCHED
    _, mag = oracle(a, "fp8")
    mag = expected_layout(mag, ks, ke, a["k"].shape[0], W).nan_to_num(0, 0, 0).clamp_min(0)
    g, r = torch.where(keep, got.float(), float("-inf")), torch.where(keep, ref.float(), float("-inf"))
    check_close(g, r.to(torch.float64), mag, 1e-2 if bf16 else 1e-5)


def _ranges(S, SKV, seed):
    g = torch.Generator().manual_seed(seed)
    ks = torch.randint(-30, SKV, (S,), generator=g)
    ke = ks + torch.randint(-10, SKV, (S,), generator=g)
    ks[:3], ke[:3] = torch.tensor([0, SKV - 1, 5]), torch.tensor([SKV + 40, SKV, 5])   # full+, last key, empty
    return ks, ke


CASES = {   # name: (H, S, SKV, W, clean, bf16 out, bf16 weights, splits)
    "H16-partial-tiles": (16, 20, 203, 0, True, False, False, 0),
    "H32-compressed": (32, 9, 150, 40, True, False, False, 0),
    "H64-noclean-bf16w": (64, 6, 80, 0, False, False, True, 0),
    "H64-compressed-noclean-bf16": (64, 5, 130, 24, False, True, False, 0),
    "H128-splits3": (128, 3, 260, 0, True, False, False, 3),
    "H64-bf16-out": (64, 4, 70, 0, True, True, False, 0),
}


@pytest.mark.parametrize("order", [0, 2])
@pytest.mark.parametrize("name", list(CASES))
def test_body_against_reference(lib, name, order):
    H, S, SKV, W, clean, bf16, bf16w, splits = CASES[name]
    a = make("fp8", S=S, H=H, SKV=SKV, seed=H + S)
    if bf16w:
        a["weights"] = a["weights"].to(torch.bfloat16)
    ks, ke = (RANGES if S == 6 else _ranges(S, SKV, S))
    got, ref = run(lib, a, ks, ke, W=W, clean=clean, bf16=bf16, splits=splits, order=order)
    compare(a, ks, ke, got, ref, W, bf16)


def test_one_block_of_rows_many_splits(lib):
    """Few rows: the plan splits the keys (16 slots, one block of rows); every split fills its own tiles."""
    a = make("fp8", S=2, H=64, SKV=700, seed=3)
    ks, ke = torch.tensor([100, -4]), torch.tensor([650, 300])
    got, ref = run(lib, a, ks, ke, slots=16)
    compare(a, ks, ke, got, ref)


@pytest.mark.parametrize("S,SKV", [(2, 1400), (4, 1290)])
def test_long_split(lib, S, SKV):
    """One split of many tiles a block (22 and 21: every stage reused several times, a partial last tile): a stage
    refilled while a tile's MMA still reads it, or a tile never copied, would change logits (the emulated MMA reads
    its operands when it is waited for)."""
    a = make("fp8", S=S, H=64, SKV=SKV, seed=S)
    ks = torch.tensor([0, 70, 3, 900][:S])
    ke = torch.tensor([SKV, 1250, SKV - 5, SKV][:S])
    got, ref = run(lib, a, ks, ke, splits=1)
    compare(a, ks, ke, got, ref)


@pytest.mark.parametrize("W", [0, 40])
def test_unclamped_bounds(lib, W):
    """Bounds outside [0, SKV], down to the extremes of int32, reach the kernel as they are (the op passes int32
    bounds unclamped): it scores exactly the clamped ranges."""
    a = make("fp8", S=4, H=64, SKV=400, seed=6)
    ks = torch.tensor([-(1 << 31), -50, 300, 390], dtype=torch.int32)
    ke = torch.tensor([(1 << 31) - 1, 130, 1000, 10], dtype=torch.int32)
    got, ref = run(lib, a, ks, ke, W=W, raw=True)
    compare(a, ks, ke, got, ref, W)


@pytest.mark.parametrize("clean", [True, False])
def test_ranges_at_tile_edges(lib, clean):
    """Ranges a few keys off the 64-key tile boundaries, shared by all rows of a block or not: the tiles every row
    scores whole take the epilogue's fast path, the others the per-logit one; the boundary keys must follow the
    range either way."""
    S, SKV = 8, 400
    a = make("fp8", S=S, H=32, SKV=SKV, seed=11)
    ks = torch.tensor([60, 60, 60, 60, 127, 129, 64, 1])
    ke = torch.tensor([316, 316, 316, 316, 193, 320, 321, 384])
    got, ref = run(lib, a, ks, ke, clean=clean)
    compare(a, ks, ke, got, ref)


@pytest.mark.parametrize("W", [0, 30])
@pytest.mark.parametrize("bf16w", [False, True])
def test_fold_mode_leaves_the_other_entries(lib, W, bf16w):
    """FP4 fold mode (q_scale given): the kernel folds the packed query rows as it loads them. The logits of
    queries with a head that does not fold exactly (exponents 15 binades apart, a zero-scale block, outside [64,
    190], a weight whose product with the fold scale is subnormal) and of keys with a scale <= 0 are left untouched
    (another launch writes them); every other entry, -inf included, is the logit of the dequantized q rows against
    the e4m3 keys times their scales. A query whose exponents span exactly 14 binades folds. fold_all is cleared
    (and stays 1 where every query folds: test_fold_mode_all_queries_fold)."""
    S, H, SKV = 8, 32, 150
    a = make("fp4", S=S, H=H, SKV=SKV, seed=9)
    a8 = make("fp8", S=S, H=H, SKV=SKV, seed=9)
    qs = a["q_scale"].clone()
    qs[1, 3] = torch.tensor([120, 134, 127, 125], dtype=torch.uint8)    # span 14: folds
    qs[2, 5] = torch.tensor([120, 135, 127, 125], dtype=torch.uint8)    # span 15
    qs[4, 0, 2] = 0                                                     # a zero-scale block
    qs[5, 31] = torch.tensor([191, 190, 185, 188], dtype=torch.uint8)   # above 190
    w = a["weights"].clone()
    qs[6, 7] = 120
    w[6, 7] = 2.0 ** -120                                               # w * 2^(120 - 133) subnormal
    w[0, 1] = 0.0                                                       # a zero weight folds
    if bf16w:
        w = w.to(torch.bfloat16)
    k_scale = a8["k_scale"].clone()
    k_scale[[3, 70, 149]] = -1.0
    ks = torch.tensor([0, 10, 0, 20, 5, -7, 30, 46])
    ke = torch.tensor([150, 140, 160, 149, 150, 120, 150, 123])
    Wd = W or SKV
    out = torch.full((S, Wd), float("-inf") if W else UNTOUCHED)
    lo, hi = ks.clamp(0, SKV).to(torch.int32), ke.clamp(0, SKV).to(torch.int32)
    base = ks.clamp(-Wd, SKV).to(torch.int32) if W else lo
    words = qs.contiguous().view(torch.int32).reshape(S * H)
    flag = torch.ones(1, dtype=torch.int32)
    args = prefill_abi.make_args(a["q"].contiguous(), a8["k"].view(torch.uint8).contiguous(), k_scale, w, lo, hi,
                                 base, out, True, bool(W), 0, words, flag)
    lib.dsq_emu_set_order(0, 7)
    lib.dsq_emu_set_slots(8)
    assert prefill_abi.call(lib, args, 0) == 0
    assert int(flag) == 0, "fold_all: some queries do not fold"

    qv = _fp4_values(a["q"], qs)                                        # float64 [S, H, 128]
    kv = a8["k"].view(torch.float8_e4m3fn).to(torch.float64)
    w64 = w.to(torch.float64)
    dots = torch.einsum("shd,jd->shj", qv, kv)
    vals = (torch.relu(dots) * w64.unsqueeze(-1)).sum(1) * k_scale.to(torch.float64)
    mag = (torch.einsum("shd,jd->shj", qv.abs(), kv.abs()) * w64.abs().unsqueeze(-1)).sum(1) * k_scale.abs()
    folds = torch.tensor([1, 1, 0, 1, 0, 0, 0, 1], dtype=torch.bool)
    other = (~folds[:, None]) | (k_scale[None, :] <= 0)                 # entries the kernel leaves
    want = expected_layout(torch.where(other, float("nan"), vals), ks, ke, SKV, W)
    got = out.to(torch.float64)
    left = want.isnan()
    fill = float("-inf") if W else UNTOUCHED
    assert bool(left.any()) and bool((got[left] == fill).all()), "entries of queries or keys that do not fold"
    mag = expected_layout(mag, ks, ke, SKV, W).nan_to_num(0, 0, 0).clamp_min(0)
    check_close(torch.where(left, float("-inf"), got), torch.where(left, float("-inf"), want), mag)


def test_fold_mode_all_queries_fold(lib):
    """FP4 fold mode where every query row folds: fold_all keeps its 1 (the second pass then returns at once) and
    every logit is written."""
    S, H, SKV = 4, 16, 70
    a = make("fp4", S=S, H=H, SKV=SKV, seed=4)
    a8 = make("fp8", S=S, H=H, SKV=SKV, seed=4)
    ks, ke = torch.tensor([0, 3, 10, 0]), torch.tensor([70, 50, 66, 1])
    out = torch.full((S, SKV), UNTOUCHED)
    lo, hi = ks.clamp(0, SKV).to(torch.int32), ke.clamp(0, SKV).to(torch.int32)
    words = a["q_scale"].contiguous().view(torch.int32).reshape(S * H)
    flag = torch.ones(1, dtype=torch.int32)
    args = prefill_abi.make_args(a["q"].contiguous(), a8["k"].view(torch.uint8).contiguous(), a8["k_scale"],
                                 a["weights"], lo, hi, lo, out, True, False, 0, words, flag)
    lib.dsq_emu_set_order(0, 7)
    lib.dsq_emu_set_slots(8)
    assert prefill_abi.call(lib, args, 0) == 0
    assert int(flag) == 1
    assert not bool((out == UNTOUCHED).any())


def test_nan_codes(lib):
    """A NaN code of q makes its row's logits NaN for the keys it scores; one of k, that key's logits."""
    a = make("fp8", S=6, H=16, SKV=80, seed=5)
    q, k = a["q"].view(torch.uint8).clone(), a["k"].view(torch.uint8).clone()
    q[1, 3, 7] = 0x7F
    k[33, 100] = 0xFF
    a["q"], a["k"] = q.view(torch.float8_e4m3fn), k.view(torch.float8_e4m3fn)
    ks, ke = RANGES
    got, ref = run(lib, a, ks, ke)
    assert torch.equal(got.isnan(), ref.isnan()) and bool(got.isnan().any())
    fin = ~ref.isnan()
    compare(a, ks, ke, torch.where(fin, got, 0.0), torch.where(fin, ref, 0.0))


def test_bad_arguments_write_nothing(lib):
    a = make("fp8", S=2, H=16, SKV=64, seed=1)
    S, SKV = 2, 64
    z = torch.zeros(S, dtype=torch.int32)
    out = torch.full((S, SKV), UNTOUCHED)
    q, k = a["q"].view(torch.uint8), a["k"].view(torch.uint8)
    args = prefill_abi.make_args(q, k, a["k_scale"], a["weights"], z, z + SKV, z, out, True, False)
    for field, value in (("H", 8), ("w_dtype", 2), ("out_dtype", 4), ("S", -1)):
        bad = prefill_abi.DsqMqaLogitsArgs.from_buffer_copy(args)
        setattr(bad, field, value)
        assert prefill_abi.call(lib, bad, 0) == 1, field
    assert bool((out == UNTOUCHED).all())


def test_struct_layout_matches_ctypes(tmp_path):
    """prefill.h compiles as C and C++; its struct has the ctypes mirror's size and offsets."""
    fields = [n for n, _ in prefill_abi.DsqMqaLogitsArgs._fields_]
    for compiler, lang, std in (("gcc", "c", "-std=c11"), ("g++", "cpp", "-std=c++17")):
        if shutil.which(compiler) is None:
            pytest.skip(f"{compiler} not found")
        src = tmp_path / f"layout.{lang}"
        lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "prefill.h"', "int main(void) {",
                 '  printf("size %zu\\n", sizeof(DsqMqaLogitsArgs));',
                 '  printf("tile %d\\n", (int)DSQ_PREFILL_TILE);']
        lines += [f'  printf("{f} %zu\\n", offsetof(DsqMqaLogitsArgs, {f}));' for f in fields]
        src.write_text("\n".join(lines + ["  return 0;", "}"]) + "\n")
        exe = tmp_path / f"layout_{lang}"
        subprocess.run([compiler, std, "-Wall", "-Werror", f"-I{REPO / 'kernels' / 'cuda'}", str(src), "-o", str(exe)],
                       check=True, capture_output=True, text=True)
        got = dict(line.split(" ", 1) for line in subprocess.run([str(exe)], check=True, capture_output=True,
                                                                 text=True).stdout.splitlines())
        assert int(got["size"]) == ctypes.sizeof(prefill_abi.DsqMqaLogitsArgs)
        assert int(got["tile"]) == prefill_abi.TILE
        for f in fields:
            assert int(got[f]) == getattr(prefill_abi.DsqMqaLogitsArgs, f).offset, f


@pytest.mark.parametrize("arch", ["90a", "100a"])
def test_kernel_builds_without_spills(tmp_path, arch):
    """prefill.cu compiles with the project's nvcc flags; the sm_90a kernels (one
    per H) run the fp8 wgmma, which the compiler does not serialise (no injected warpgroup wait, no serialised
    MMAs), and keep everything in registers (no stack frame, no spills) within the 3 blocks an SM they ask for."""
    import re
    import sys
    sys.path.insert(0, str(REPO / "tools"))
    import build_native as bn
    nvcc = bn.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    flags = [f for f in bn.nvcc_flags() if not f.startswith("-gencode")]
    out = tmp_path / "prefill.cubin"
    cmd = [nvcc, *flags, f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v", "-cubin",
           str(REPO / "kernels" / "cuda" / "prefill.cu"), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr}"
    assert "warning" not in res.stderr.lower().replace("ptxas info", ""), res.stderr
    assert "warpgroup.wait is injected" not in res.stderr, res.stderr
    assert "Performance Loss" not in res.stderr, res.stderr
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    assert len(frames) == 4 and all(f == ("0", "0", "0") for f in frames), res.stderr
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", res.stderr)]
    assert regs and max(regs) <= 65536 // (3 * 128), regs
    if arch == "90a":
        ptx = subprocess.run([nvcc, *flags, "-arch=compute_90a", "-ptx", str(REPO / "kernels" / "cuda" / "prefill.cu"),
                              "-o", "-"], capture_output=True, text=True, check=True).stdout
        # four k steps a tile, in each of the four kernels
        assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3", ptx)) == 16


# ---- FP4 folded into e4m3: the Triton pre-passes, the emulated kernel, then Triton's second pass -------------
def _fold_pipeline(so):
    """prefill_abi.run on FP4 inputs (TRITON_INTERPRET=1: the Triton kernels in the interpreter, the CUDA kernel
    in the emulator): block exponents spanning up to the 14 binades that fold, one key that does not fold and two
    query rows with a zero-scale block. Returns the failures."""
    h = ctypes.CDLL(so)
    h.dsq_emu_set_slots.argtypes = [ctypes.c_int64]
    h.dsq_emu_set_slots(4)
    fails = []
    a = make("fp4", S=6, H=32, SKV=150, exp_lo=118, exp_hi=133, seed=2)
    a["k_scale"][37, 2] = 100
    a["q_scale"][1, 5, 0] = 0
    a["q_scale"][3, 2, 1] = 0    # a query of a later block of rows too (the second pass's programs take several)
    ks, ke = RANGES
    for W, clean in ((0, True), (24, True), (0, False), (30, False)):
        S, SKV = 6, 150
        Wd = W or SKV
        ref = torch.full((S, Wd), UNTOUCHED)
        dsaquant.mqa_logits(ks=ks, ke=ke, layout="fp4", clean_logits=clean, max_seqlen_k=W, out=ref,
                            backend="reference", **a)
        lo = ks.clamp(0, SKV).to(torch.int32)
        hi = ke.clamp(0, SKV).to(torch.int32)
        base = ks.clamp(-Wd, SKV).to(torch.int32) if W else torch.zeros(S, dtype=torch.int32)
        out = torch.full((S, Wd), UNTOUCHED)
        rc = prefill_abi.run(h, 0, a["q"], a["q_scale"], a["k"], a["k_scale"], a["weights"], lo, hi, base, out, "fp4",
                             clean, bool(W))
        try:
            assert rc == 0, rc
            assert torch.equal(out == UNTOUCHED, ref == UNTOUCHED), "untouched entries differ"
            _, mag = oracle(a, "fp4")
            mag = expected_layout(mag, ks, ke, SKV, W).nan_to_num(0, 0, 0).clamp_min(0)
            keep = ref != UNTOUCHED
            check_close(torch.where(keep, out, float("-inf")), torch.where(keep, ref, float("-inf")).double(), mag)
        except AssertionError as e:
            fails.append(f"W={W} clean={clean}: {e}")
    return fails


def test_fp4_folded_pipeline(lib):
    """The cuda backend's FP4 path (prefill_abi.run) end to end on the CPU, against the reference."""
    pytest.importorskip("triton")
    so = lib._name
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(REPO / "python"), str(REPO / "tests")]))
    r = subprocess.run([sys.executable, __file__, "--fold-worker", str(so)], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    fails = json.loads(r.stdout.strip().splitlines()[-1])
    assert not fails, fails


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--fold-worker":
    print(json.dumps(_fold_pipeline(sys.argv[2])))

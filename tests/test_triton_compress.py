"""The `triton` backend's DeepSeek-V4 ops (SPEC §7.6 compress_kv, §7.7 rope_rotate_quant) against the reference,
byte for byte, under TRITON_INTERPRET=1 (CPU).

As in tests/test_triton_quant.py, the interpreter runs in worker subprocesses (this file is also the worker:
`python tests/test_triton_compress.py --worker CASES.json OUT.json`); the parent runs every selected case once
(a session fixture, up to 4 workers) and each parametrized test checks its case's result.

Cases:
- `compress-*`: dsaquant.compress_kv with backend="reference" and backend="triton" on clones of the same
  arguments (poisoned caches, random rings): every byte of every tensor argument must agree (cache, cache
  scales, both ring tensors, the untouched inputs), and so must the device error flag. The grid covers
  ratio 4 (overlap, K = 8), ratio 4 without overlap (K = 4), ratio 128 (K = 128) and ratio 128 with
  overlap (K = 256); D = 128 and 512; batches of 1..8 ragged sequences, incl. sequences shorter than one
  window, empty ones, prompts from position 0 and continuations whose windows come from the ring; bf16
  and fp32 inputs; every quant mode and layout (none, fp4 packed68 and aiter_fp4 with every scale rule and
  policy, fp4_sim with both rules, fp8 fp8_132 both flavours, ue8m0/fp32 scales, preshuffle, uint8 and
  float8 caches); Hadamard on/off and every subset of rounding points; cos/sin tables in bf16/fp16/fp32
  and the freqs table; bf16/fp32 norm weights; strided kv/score rows; negative out_slots; update_state
  on and off; NaN/±Inf scores and values, all -inf windows and exp_ds underflow (large score spreads);
  out-of-range out_slots and ring slots and positions past the RoPE table (error flags); a negative start
  position and tokens outside [cu_seqlens[0], cu_seqlens[B]); both launch
  shapes (the decode-sized one and the blocked one with several compaction steps per program).
- `chunk-*`: chunking invariance on the triton backend: one sequence fed whole, in random chunks and
  token by token gives identical cache bytes and ring rows, equal to the reference's whole call.
- `same-*`: bf16 and fp32 inputs holding the same values give identical triton bytes.
- `rr-*`: dsaquant.rope_rotate_quant, reference vs triton, for every output dtype (FP4 uint8 and
  float4_e2m1fn_x2 with shuffled and dense scales and group sizes 16..128, FP8 e4m3fn/e4m3fnuz with group
  sizes 16..1024, bf16/fp16 incl. in place and strided outputs), D in {128, 256, 512, 1024}, Hadamard
  on/off, every rounding policy, positions outside the table; `rr-reject-*`: other dtypes raise TypeError
  (through the public op and through the triton function itself) and write nothing.
- `fmt-*`: the device functions against the reference helpers on large value sets, fp32 bit for bit (the
  ops' outputs are bf16/FP4/FP8, which hide most 1-ulp slips): exp_ds (SPEC §0.7 golden vectors, every
  997th fp32 pattern in [-104, 0], the n-rounding boundaries), canonical sums of widths 4..1024, RMSNorm
  (128, 512), the Hadamard for 128..1024, tail RoPE, and the §7.6 pool for K = 4, 8, 128, 256.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from interp_workers import Tally, as_bytes, check_result, clone_args, run_cases, run_selected, torch_dtype

HERE = Path(__file__).resolve()

EXP_DS_GOLDEN = [(0.0, 0x3F800000), (-0.5, 0x3F1B4598), (-1.0, 0x3EBC5AB2), (-2.0, 0x3E0A9555),
                 (-10.0, 0x383E6BCE), (-87.0, 0x00B33687), (-100.0, 0x0000001B), (-103.0, 0x00000001),
                 (-104.0, 0x00000000), (float("-inf"), 0x00000000)]


# =====================================================================================================
# the case list (shared by the parent and the workers)
# =====================================================================================================
FP4_MODES = {  # name -> make_compress_kv knobs
    "none": dict(quant_mode="none"),
    "fp4_p68_rne": dict(quant_mode="fp4", layout="packed68"),
    "fp4_p68_pack_thr": dict(quant_mode="fp4", layout="packed68", scale_rule="pack", rounding="threshold"),
    "fp4_p68_hw": dict(quant_mode="fp4", layout="packed68", rounding="hardware"),
    "fp4_aiter_hw": dict(quant_mode="fp4", layout="aiter_fp4", rounding="hardware"),
    "fp4_aiter_pack_rne": dict(quant_mode="fp4", layout="aiter_fp4", scale_rule="pack", rounding="rne"),
    "fp4_sim": dict(quant_mode="fp4_sim"),
    "fp4_sim_pack": dict(quant_mode="fp4_sim", scale_rule="pack"),
    "fp8_ue8m0_presh": dict(quant_mode="fp8", preshuffle=True),
    "fp8_fp32": dict(quant_mode="fp8", scale_fmt=None),
    "fp8_fnuz_ue8m0_presh": dict(quant_mode="fp8", fp8_flavour="e4m3fnuz", preshuffle=True, page_size=32),
    "fp8_fnuz_fp32_f8cache": dict(quant_mode="fp8", scale_fmt=None, fp8_cache_dtype="float8_e4m3fnuz"),
    "fp8_fn_f8cache": dict(quant_mode="fp8", fp8_cache_dtype="float8_e4m3fn", page_size=64),
}
ALL_POINTS = ("pool", "norm", "rope", "hadamard")
DEF_POINTS = ("pool", "norm", "rope")


def _compress_cases():
    cases = {}

    def add(name, **kw):
        c = dict(op="compress", ratio=4, D=128, dtype="float32", starts=(5, 0, 17), lens=(30, 3, 14), hadamard=False,
                 points=DEF_POINTS, update=True, launch="auto", cs="bfloat16", nw="float32", seed=len(cases))
        c.update(kw)
        cases[f"compress-{name}"] = c

    # ratio 4 with overlap (K = 8), D = 128: every mode and layout
    add("r4-none-f32", mode="none")
    add("r4-none-bf16-noupdate-nopoints-blocked", mode="none", dtype="bfloat16", update=False, points=(),
        launch="blocked")
    add("r4-fp4_p68_rne-bf16-had-allpoints", mode="fp4_p68_rne", dtype="bfloat16", hadamard=True, points=ALL_POINTS)
    add("r4-fp4_p68_pack_thr-had-p64-blocked", mode="fp4_p68_pack_thr", hadamard=True, points=(), page=64,
        launch="blocked", starts=(0, 9), lens=(70, 41))
    add("r4-fp4_p68_hw-bf16-freqs-nwbf16", mode="fp4_p68_hw", dtype="bfloat16", cs="freqs", nw="bfloat16",
        points=("rope",))
    add("r4-fp4_aiter_hw-bf16-noupdate", mode="fp4_aiter_hw", dtype="bfloat16", points=(), update=False)
    add("r4-fp4_aiter_pack_rne-had", mode="fp4_aiter_pack_rne", hadamard=True, points=("norm", "hadamard"))
    add("r4-fp4_sim-had-allpoints", mode="fp4_sim", hadamard=True, points=ALL_POINTS, cs="float32")
    add("r4-fp4_sim_pack-bf16-blocked", mode="fp4_sim_pack", dtype="bfloat16", points=("pool",), launch="blocked",
        starts=(3, 64), lens=(61, 50))
    add("r4-fp8_ue8m0_presh-bf16", mode="fp8_ue8m0_presh", dtype="bfloat16")
    add("r4-fp8_fp32-fp16tables-blocked", mode="fp8_fp32", cs="float16", launch="blocked", starts=(0, 2, 7),
        lens=(40, 33, 60))
    add("r4-fp8_fnuz_ue8m0_presh-bf16-had", mode="fp8_fnuz_ue8m0_presh", dtype="bfloat16", hadamard=True)
    add("r4-fp8_fnuz_fp32_f8cache-noupdate", mode="fp8_fnuz_fp32_f8cache", update=False, points=("norm",))
    add("r4-fp8_fn_f8cache-bf16", mode="fp8_fn_f8cache", dtype="bfloat16", nw="bfloat16")
    # ratio 4 without overlap (K = 4)
    add("r4o0-fp4_p68_rne-bf16", mode="fp4_p68_rne", overlap=False, dtype="bfloat16")
    add("r4o0-none-blocked", mode="none", overlap=False, launch="blocked", starts=(1, 0), lens=(90, 37))
    add("r4o0-fp8_fp32-had", mode="fp8_fp32", overlap=False, hadamard=True, points=ALL_POINTS)
    # decode-like: 8 sequences of 1..2 tokens, most of them boundaries; several compaction steps per program
    add("r4-decode8-fp4_p68_rne-bf16", mode="fp4_p68_rne", dtype="bfloat16", starts=(3, 7, 0, 11, 2, 3, 126, 19),
        lens=(1, 1, 1, 2, 2, 1, 2, 1))
    add("r4-decode8-fp8-steps", mode="fp8_ue8m0_presh", starts=(3, 7, 0, 11, 2, 3, 126, 19),
        lens=(1, 1, 1, 2, 2, 1, 2, 1), launch="steps")
    # ratio 128 (K = 128): boundaries from inputs, from the ring, shorter than one window
    add("r128-fp4_p68_rne-bf16", mode="fp4_p68_rne", ratio=128, dtype="bfloat16", starts=(100, 0), lens=(60, 140))
    add("r128-fp8_ue8m0_presh-short", mode="fp8_ue8m0_presh", ratio=128, starts=(120, 250, 0), lens=(10, 8, 130))
    add("r128-none-D512-bf16", mode="none", ratio=128, D=512, dtype="bfloat16", starts=(200, 0), lens=(60, 130))
    add("r128-fp4_aiter_hw-noupdate", mode="fp4_aiter_hw", ratio=128, starts=(127, 5), lens=(1, 125), update=False)
    add("r128-fp4_sim_pack-bf16-had", mode="fp4_sim_pack", ratio=128, dtype="bfloat16", hadamard=True,
        starts=(0,), lens=(128,), cs="float16")
    # ratio 128 with overlap (K = 256)
    add("r128o1-fp4_p68_hw-bf16", mode="fp4_p68_hw", ratio=128, overlap=True, dtype="bfloat16", starts=(200,),
        lens=(60,))
    add("r128o1-none-f32", mode="none", ratio=128, overlap=True, starts=(0, 130), lens=(128, 3), points=())
    # D = 512 at ratio 4
    add("r4-none-D512-bf16", mode="none", D=512, dtype="bfloat16")
    add("r4-none-D512-nopoints-blocked", mode="none", D=512, points=(), launch="blocked", starts=(0,), lens=(80,))
    # strided rows, special values, error flags
    add("r4-fp4_p68_rne-strided-bf16", mode="fp4_p68_rne", dtype="bfloat16", strided=True)
    add("r4-fp8_fp32-strided-blocked", mode="fp8_fp32", strided=True, launch="blocked")
    add("r4-special-fp4_p68_hw", mode="fp4_p68_hw", special=True, score_scale=40.0)
    add("r4-special-fp8-bf16", mode="fp8_ue8m0_presh", dtype="bfloat16", special=True, score_scale=30.0,
        launch="blocked")
    add("r4-special-none-tiny", mode="none", special=True, scale=1e-30)
    add("r4-special-fp4_sim-huge", mode="fp4_sim", special=True, scale=1e30, score_scale=60.0)
    add("r128-special-fp4_aiter_hw", mode="fp4_aiter_hw", ratio=128, special=True, score_scale=50.0,
        starts=(60, 0), lens=(80, 131))
    add("r4-oob-slot-and-ring", mode="fp4_p68_rne", oob=True, bad_ring=True)
    add("r4-edges-negative-start-partial-cu", mode="fp4_p68_rne", dtype="bfloat16", edges=True)
    add("r4-edges-negative-start-partial-cu-blocked", mode="fp8_fp32", edges=True, launch="blocked")
    add("r4-position-past-table", mode="none", max_pos=6, starts=(0, 2), lens=(16, 9))
    add("r128-oob-slot-position", mode="fp8_fp32", ratio=128, oob=True, max_pos=64, starts=(100,), lens=(156,))
    return cases


def _chunk_cases():
    cases = {}
    for name, ratio, L, mode, extra in (("r4-fp4_p68_rne-bf16", 4, 45, "fp4_p68_rne", dict(dtype="bfloat16")),
                                        ("r4-fp8_ue8m0_presh", 4, 37, "fp8_ue8m0_presh", {}),
                                        ("r4-fp4_aiter_hw-had", 4, 29, "fp4_aiter_hw", dict(hadamard=True)),
                                        ("r4o0-none-D512", 4, 21, "none", dict(overlap=False, D=512)),
                                        ("r128-none-bf16", 128, 131, "none", dict(dtype="bfloat16"))):
        cases[f"chunk-{name}"] = dict(op="chunk", ratio=ratio, L=L, mode=mode, seed=len(cases) + 50, **extra)
    return cases


def _same_cases():
    return {f"same-{m}": dict(op="same", mode=m, seed=70 + i) for i, m in
            enumerate(("fp4_p68_rne", "fp8_ue8m0_presh", "none"))}


def _rr_cases():
    cases = {}

    def add(name, **kw):
        c = dict(op="rr", T=3, H=16, D=128, out="fp4", dtype="bfloat16", group=None, shuffle=True, hadamard=True,
                 rounding="hardware", seed=100 + len(cases))
        c.update(kw)
        cases[f"rr-{name}"] = c

    for D, H in ((128, 16), (256, 32), (1024, 16)):
        for had in (True, False):
            add(f"fp4-shuffled-D{D}-H{H}-h{int(had)}", D=D, H=H, hadamard=had, T=2 if D == 1024 else 3)
    add("fp4-shuffled-H64-rne-T5", H=64, T=5, rounding="rne")
    import torch
    if hasattr(torch, "float4_e2m1fn_x2"):             # torch >= 2.8
        add("fp4x2-shuffled-threshold-fp16", out="fp4x2", dtype="float16", rounding="threshold")
    add("fp4-dense-g32-rne-D512", D=512, H=4, shuffle=False, rounding="rne")
    add("fp4-dense-g16-hw-D256-f32x", D=256, H=2, shuffle=False, group=16, dtype="float32")
    add("fp4-dense-g128-thr-D128", H=8, shuffle=False, group=128, rounding="threshold", hadamard=False)
    add("fp4-dense-g64-hw-D1024", D=1024, H=1, shuffle=False, group=64, cs="float32")
    add("fp8-e4m3fn-g128", out="e4m3fn", H=4)
    add("fp8-e4m3fn-g64-D512-f32x", out="e4m3fn", H=2, D=512, group=64, dtype="float32", hadamard=False)
    add("fp8-e4m3fnuz-g16-D256", out="e4m3fnuz", H=4, D=256, group=16, cs="float16")
    add("fp8-e4m3fnuz-g1024-D1024", out="e4m3fnuz", H=2, D=1024, group=1024, hadamard=False)
    add("bf16-D128", out="half", H=4)
    add("bf16-D1024-nohad", out="half", H=2, D=1024, hadamard=False)
    add("fp16-D256-inplace", out="half", H=4, D=256, dtype="float16", inplace=True)
    add("bf16-D512-strided-out", out="half", H=4, D=512, strided_out=True, cs="float32")
    add("bf16-D128-strided-x-int32pos", out="half", H=8, strided_x=True, pos="int32")
    # D = 128 FP4 in groups of 32 (the whole-row kernel): dense scales, every policy, dtypes without the int32
    # word view (fp16, fp32), several programs with and without special rows (general and fast encoders)
    add("fp4-dense-g32-D128-thr-fp16", H=16, T=5, shuffle=False, group=32, rounding="threshold", dtype="float16")
    add("fp4-dense-g32-D128-rne-f32x", H=32, T=4, shuffle=False, group=32, rounding="rne", dtype="float32",
        cs="float32")
    add("special-fp4-dense-g32-D128-rne", H=32, T=6, shuffle=False, group=32, rounding="rne", special=True)
    add("special-fp4-shuffled-H32-nohad", H=32, T=6, hadamard=False, special=True, cs="float16", dtype="float16")
    add("fp4-shuffled-positions-out-of-range", T=5, bad_pos=True)
    add("fp8-positions-out-of-range-strided-x", out="e4m3fn", H=4, T=5, bad_pos=True, strided_x=True)
    add("special-fp4-shuffled", T=6, special=True)
    add("special-fp8", out="e4m3fn", H=4, T=6, special=True)
    add("special-bf16", out="half", H=4, T=6, special=True)
    for dt in ("float32", "int8", "float8_e5m2", "fp16_for_bf16"):
        cases[f"rr-reject-{dt}"] = dict(op="rr_reject", dtype=dt)
    return cases


FMT_CASES = {f"fmt-{n}": dict(op="fmt", name=n) for n in ("exp_ds", "exp_ds_golden", "rows", "rms_norm", "pool")}


def all_cases():
    cases = {}
    for part in (FMT_CASES, _compress_cases(), _chunk_cases(), _same_cases(), _rr_cases()):
        cases.update(part)
    return cases


CASES = all_cases()


# =====================================================================================================
# the parent: run the selected cases in interpreter workers, one test per case
# =====================================================================================================
if __name__ != "__main__":
    import pytest

    def _cost(c):
        op = c["op"]
        if op == "fmt":
            return 6.0
        if op == "chunk":
            return 0.08 * c["L"] * (3 if c["ratio"] == 128 else 1)
        if op == "compress":
            return 0.5 + 0.02 * sum(c["lens"]) * (4 if c["ratio"] == 128 else 1)
        if op == "same":
            return 2.0
        return 0.3

    @pytest.fixture(scope="session")
    def v4_results(request):
        pytest.importorskip("triton")
        return run_selected(request, HERE, CASES, _cost, "dsq_triton_compress_",
                            "triton interpreter, compress_kv and rope_rotate_quant")

    @pytest.mark.parametrize("case_id", list(CASES))
    def test_triton_compress_matches_reference(case_id, v4_results):
        check_result(case_id, v4_results.get(case_id))

    def test_ops_registered_with_the_reference_signature():
        """register_all registers both ops for `triton`, with exactly the reference functions' parameters."""
        pytest.importorskip("triton")
        import inspect
        from dsaquant import dispatch
        from dsaquant.reference import compress as rc
        if not dispatch.available("triton")[0]:
            pytest.skip(dispatch.available("triton")[1])
        for op in ("compress_kv", "rope_rotate_quant"):
            assert op in dispatch.ops_of("triton")
            got = list(inspect.signature(dispatch.get("triton", op)).parameters)
            assert got == list(inspect.signature(getattr(rc, op)).parameters), op


# =====================================================================================================
# the worker (TRITON_INTERPRET=1): everything below runs only in the subprocess
# =====================================================================================================
def _worker_main(cases_path: str, out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "the worker must run with TRITON_INTERPRET=1"

    # the fmt kernels below are nested functions: the interpreter resolves their names in this module's globals
    global triton, tl, F, C
    import triton
    import triton.language as tl
    from dsaquant.triton import compress as C
    from dsaquant.triton import formats as F

    run_cases(cases_path, out_path, CASES, run_case)


def _flag():
    from dsaquant import errors
    f = int(errors.flag_tensor("cpu").item())
    errors.flag_tensor("cpu").zero_()
    return f


def _run_pair(fn, args, tally, want_flag=0):
    """fn(**args, backend=...) with the reference and triton on clones of args; compare every tensor argument
    and the device error flag (which must also equal `want_flag`)."""
    import torch
    _flag()
    a_ref, a_tr = clone_args(args), clone_args(args)
    fn(**a_ref, backend="reference")
    ref_flag = _flag()
    fn(**a_tr, backend="triton")
    tr_flag = _flag()
    tally.check(ref_flag == tr_flag, f"error flag: reference {ref_flag}, triton {tr_flag}")
    tally.check(tr_flag == want_flag, f"error flag {tr_flag}, expected {want_flag}")
    for k in args:
        if isinstance(args[k], torch.Tensor):
            tally.eq(k, a_ref[k], a_tr[k])
    return a_ref, a_tr


class _launch:
    """Select the compress launch shape: 'auto' (the host's choice), 'blocked' (the blocked shape whatever T),
    'steps' (blocked with 2 boundaries per step, so one program takes several compaction steps)."""

    def __init__(self, how):
        self.how = how

    def __enter__(self):
        from dsaquant.triton import compress as C
        self.saved = (dict(C.LAUNCH), C.SMALL_PROGRAMS)
        if self.how in ("blocked", "steps"):
            C.SMALL_PROGRAMS = 0
        if self.how == "steps":
            for k in ("compress_k4", "compress_k8"):
                C.LAUNCH[k] = (2, 32, 4)

    def __exit__(self, *exc):
        from dsaquant.triton import compress as C
        C.LAUNCH.clear()
        C.LAUNCH.update(self.saved[0])
        C.SMALL_PROGRAMS = self.saved[1]


def _compress_args(c, starts=None, lens=None):
    import torch
    from dsaquant import testing as tt
    knobs = dict(FP4_MODES[c["mode"]])
    if "fp8_cache_dtype" in knobs:
        knobs["fp8_cache_dtype"] = torch_dtype(knobs["fp8_cache_dtype"])
    if c.get("page"):
        knobs["page_size"] = c["page"]
    cs = c.get("cs", "bfloat16")
    a = tt.make_compress_kv(starts=starts or c["starts"], lens=lens or c["lens"], ratio=c["ratio"],
                            overlap=c.get("overlap"), D=c.get("D", 128), seed=c["seed"],
                            dtype=torch_dtype(c.get("dtype", "float32")), hadamard=c.get("hadamard", False),
                            bf16_after=c.get("points", DEF_POINTS), update_state=c.get("update", True),
                            scale=c.get("scale", 1.0), score_scale=c.get("score_scale", 1.0),
                            cs_dtype=torch_dtype("float32" if cs == "freqs" else cs), use_freqs=cs == "freqs",
                            nw_dtype=torch_dtype(c.get("nw", "float32")), max_pos=c.get("max_pos", 4096),
                            negatives=c.get("negatives", True), **knobs)
    return a


def _strided(a):
    """kv and score as column views of one [T, 2C] tensor (row stride 2C; sglang passes [T, 4D] views)."""
    import torch
    kv, sc = a["kv"], a["score"]
    big = torch.empty(kv.shape[0], 2 * kv.shape[1], dtype=kv.dtype)
    big[:, : kv.shape[1]] = kv
    big[:, kv.shape[1]:] = sc
    a["kv"], a["score"] = big[:, : kv.shape[1]], big[:, kv.shape[1]:]
    return a


def _capacity(a):
    """Slots of the cache of make_compress_kv's arguments `a`."""
    cache = a["cache"]
    if cache.dim() == 5:                        # aiter_fp4 [NB, 1, 4, P, 16]
        return cache.shape[0] * cache.shape[3]
    if cache.dim() == 3:                        # bf16 [NB, P, D]
        return cache.shape[0] * cache.shape[1]
    return cache.shape[0] * cache.shape[1] // (68 if a["quant_mode"] == "fp4" else 132)


def _case_compress(c, tally):
    import dsaquant as dq
    from dsaquant import errors, testing as tt
    a = _compress_args(c)
    if c.get("special"):
        a = tt.compress_special_values(a, c["lens"][0])
    if c.get("strided"):
        a = _strided(a)
    want = 0
    bnd = tt.compress_boundaries(c["starts"], c["lens"], c["ratio"])
    if c.get("oob"):                            # the last boundary's slot is past the capacity
        a["out_slots"] = a["out_slots"].clone()
        a["out_slots"][bnd[-1][0]] = _capacity(a) + 3
        want |= errors.SLOT_OUT_OF_RANGE
    if c.get("bad_ring"):
        a["state_slot"] = a["state_slot"].clone()
        a["state_slot"][1] = a["state_kv"].shape[0] + 2
        want |= errors.SLOT_OUT_OF_RANGE
    if c.get("edges"):
        # a negative start position (its first tokens are at p < 0: neither pooled nor stored), tokens before
        # cu_seqlens[0] and after cu_seqlens[B] (they belong to no sequence)
        a["start_pos"] = a["start_pos"].clone()
        a["start_pos"][0] = -6
        a["cu_seqlens"] = a["cu_seqlens"].clone()
        a["cu_seqlens"][0] = 2
        a["cu_seqlens"][-1] -= 3
        cu, sp = a["cu_seqlens"].tolist(), a["start_pos"].tolist()
        a["out_slots"] = a["out_slots"].clone()
        n = 0
        for b in range(len(sp)):                 # the boundaries moved: fresh distinct slots for them
            for i in range(cu[b], cu[b + 1]):
                p = sp[b] + i - cu[b]
                if p >= 0 and (p + 1) % c["ratio"] == 0:
                    a["out_slots"][i] = n
                    n += 1
    if c.get("max_pos", 4096) < 4096:
        if any(p + 1 - c["ratio"] >= c["max_pos"] for _, _, p in bnd):
            want |= errors.POSITION_OUT_OF_RANGE
    with _launch(c.get("launch", "auto")):
        a_ref, a_tr = _run_pair(dq.compress_kv, a, tally, want)
    poison = as_bytes(a_tr["cache"]) == tt.POISON
    tally.check(not bool(poison.all()) or not bnd, "nothing was written to the cache")


def _feed(a, chunks, backend, ratio):
    """Feed the one sequence of `a` (history from position 0) in chunks; returns (cache, cache_scale, ring kv,
    ring score)."""
    import torch
    import dsaquant as dq
    b = clone_args(a)
    kv, sc, outs = a["kv"], a["score"], a["out_slots"]
    pos = 0
    for n in chunks:
        b.update(kv=kv[pos:pos + n], score=sc[pos:pos + n], out_slots=outs[pos:pos + n],
                 cu_seqlens=torch.tensor([0, n], dtype=torch.int32), start_pos=torch.tensor([pos]))
        dq.compress_kv(**b, backend=backend)
        pos += n
    return b["cache"], b["cache_scale"], b["state_kv"], b["state_score"]


def _case_chunk(c, tally):
    import torch
    L, ratio = c["L"], c["ratio"]
    a = _compress_args(dict(c, starts=(0,), lens=(L,), negatives=L // ratio > 4))
    K = ratio * (2 if a["overlap"] else 1)
    g = torch.Generator().manual_seed(c["seed"])
    chunks = []
    while sum(chunks) < L:
        chunks.append(min(int(torch.randint(1, 2 * K + 4, (1,), generator=g)), L - sum(chunks)))
    R = a["state_kv"].shape[1]
    rows = torch.tensor([q % R for q in range(max(0, L - K), L)])
    slot = int(a["state_slot"][0])
    ref = _feed(a, [L], "reference", ratio)
    runs = {"whole": [L], "chunks": chunks, "tokens": [1] * L}
    for name, ch in runs.items():
        got = _feed(a, ch, "triton", ratio)
        tally.eq(f"{name}: cache", ref[0], got[0])
        if ref[1] is not None:
            tally.eq(f"{name}: cache_scale", ref[1], got[1])
        tally.eq(f"{name}: ring kv rows", ref[2][slot, rows], got[2][slot, rows])
        tally.eq(f"{name}: ring score rows", ref[3][slot, rows], got[3][slot, rows])
    tally.check(not bool((as_bytes(ref[0]) == 0xA5).all()), "nothing was written to the cache")
    _flag()


def _case_same(c, tally):
    """bf16 and fp32 inputs holding the same values: identical triton bytes."""
    import torch
    import dsaquant as dq
    a = _compress_args(dict(op="compress", ratio=4, starts=(5, 0, 17), lens=(30, 9, 14), dtype="bfloat16",
                            mode=c["mode"], seed=c["seed"]))
    b = clone_args(a)
    b["kv"], b["score"] = a["kv"].float(), a["score"].float()
    dq.compress_kv(**a, backend="triton")
    dq.compress_kv(**b, backend="triton")
    for k in ("cache", "cache_scale", "state_kv", "state_score"):
        if isinstance(a[k], torch.Tensor):
            tally.eq(k, a[k], b[k])
    _flag()


def _rr_args(c):
    import torch
    from dsaquant import testing as tt
    dtype = torch_dtype(c["dtype"])
    a = tt.make_rope_rotate_quant(T=c["T"], H=c["H"], D=c["D"], out=c["out"], seed=c["seed"], dtype=dtype,
                                  cs_dtype=torch_dtype(c["cs"]) if c.get("cs") else None, group_size=c["group"],
                                  shuffle_scale=c["shuffle"], hadamard=c["hadamard"], rounding=c["rounding"],
                                  max_pos=64, pos_dtype=torch_dtype(c.get("pos", "int64")))
    if c.get("special"):                        # D = 128: the shared special rows (tokens 0..5, every head)
        a["x"] = tt.special_rows(a["x"], c["seed"])
    if c.get("strided_x"):
        x = a["x"]
        big = torch.empty(x.shape[0], x.shape[1], 2 * x.shape[2], dtype=x.dtype)
        big.view(torch.uint8).fill_(0x5A)
        big[..., : x.shape[2]] = x
        a["x"] = big[..., : x.shape[2]]
    if c.get("strided_out"):
        T, H, D = a["out"].shape
        o = torch.empty(H, T, D, dtype=a["out"].dtype)
        o.view(torch.uint8).fill_(0xA5)
        a["out"] = o.transpose(0, 1)
    if c.get("bad_pos"):
        p = a["positions"].clone()
        p[0], p[-1] = -3, 64 + 7
        a["positions"] = p
    return a


def _case_rr(c, tally):
    import dsaquant as dq
    from dsaquant import errors
    a = _rr_args(c)
    want = errors.POSITION_OUT_OF_RANGE if c.get("bad_pos") else 0
    if c.get("inplace"):
        a["out"] = a["x"]
        _flag()
        x_ref, x_tr = a["x"].clone(), a["x"].clone()
        dq.rope_rotate_quant(**dict(a, x=x_ref, out=x_ref), backend="reference")
        dq.rope_rotate_quant(**dict(a, x=x_tr, out=x_tr), backend="triton")
        tally.eq("x (in place)", x_ref, x_tr)
        tally.check(_flag() == want, "error flag")
        return
    _run_pair(dq.rope_rotate_quant, a, tally, want)


def _case_rr_reject(c, tally):
    """Unsupported output dtypes raise TypeError naming `out`, through the public op and through the triton
    function itself, and write nothing."""
    import torch
    import dsaquant as dq
    from dsaquant import dispatch, testing as tt
    a = tt.make_rope_rotate_quant(T=2, H=16, out="half", seed=3)
    if c["dtype"] == "fp16_for_bf16":
        out = tt.poisoned((2, 16, 128), torch.float16, "cpu")
    else:
        out = tt.poisoned((2, 16, 128), torch_dtype(c["dtype"]), "cpu")
    a["out"] = out
    for how in ("op", "backend function"):
        try:
            if how == "op":
                dq.rope_rotate_quant(**a, backend="triton")
            else:
                dispatch.get("triton", "rope_rotate_quant")(out, a["x"], a["cos_cache"], a["sin_cache"],
                                                             a["positions"], 64, None, 128, True, True, "hardware")
            tally.check(False, f"{how}: no error for out dtype {out.dtype}")
        except TypeError as e:
            tally.check(str(e).startswith("out"), f"{how}: error does not name `out`: {e}")
        tally.eq(f"{how}: out untouched", out, tt.poisoned(out.shape, out.dtype, "cpu"))


def run_case(c):
    tally = Tally()
    op = c["op"]
    if op == "fmt":
        _FMT[c["name"]](tally)
    else:
        {"compress": _case_compress, "chunk": _case_chunk, "same": _case_same, "rr": _case_rr,
         "rr_reject": _case_rr_reject}[op](c, tally)
    return tally.result()


# ---- fmt cases: formats.py's row functions on large value sets ------------------------------------------
def _exp_ds_points():
    """Every 997th fp32 bit pattern in [-104, -0], the values within 4 ulp of each n-rounding boundary
    (x*log2e = k + 0.5), values below the range, and the specials."""
    import numpy as np
    hi = int(np.float32(-104.0).view(np.uint32))
    by_bits = np.arange(0x80000000, hi + 1, 997, dtype=np.int64).astype(np.uint32).view(np.float32)
    k = np.arange(-151, 1, dtype=np.float64) + 0.5
    mids = (k / np.log2(np.e)).astype(np.float32)
    near = ((mids.view(np.uint32)[:, None].astype(np.int64) + np.arange(-4, 5)[None, :]).reshape(-1)
            .astype(np.uint32).view(np.float32))
    spec = np.array([0.0, -0.0, -1e-45, -1e-38, -87.33654, -87.33655, -103.27893, -103.97208, -110.0, -1e30,
                     -3.4e38, float("-inf"), float("inf"), float("nan"), 0.5, 3.0], dtype=np.float32)
    x = np.concatenate([by_bits, near, spec])
    return np.concatenate([x, np.zeros((-len(x)) % 4096, dtype=np.float32)])


def _fmt_exp_ds_kernel():
    @triton.jit
    def k(x_ptr, o_ptr, B: tl.constexpr):
        offs = tl.program_id(0) * B + tl.arange(0, B)
        tl.store(o_ptr + offs, F.exp_ds(tl.load(x_ptr + offs)))
    return k


def _fmt_exp_ds(tally):
    import torch
    from dsaquant.reference.arith import exp_ds as ref
    x = torch.from_numpy(_exp_ds_points())
    out = torch.empty_like(x)
    _fmt_exp_ds_kernel()[(x.numel() // 4096,)](x, out, B=4096)
    tally.eq("exp_ds vs reference", ref(x), out)


def _fmt_exp_ds_golden(tally):
    """SPEC §0.7 golden vectors through the Triton exp_ds, bit for bit."""
    import torch
    x = torch.tensor([g[0] for g in EXP_DS_GOLDEN] * 2 + [0.0] * 12, dtype=torch.float32)   # 32 lanes
    out = torch.empty_like(x)
    _fmt_exp_ds_kernel()[(1,)](x, out, B=32)
    want = torch.tensor([g[1] for g in EXP_DS_GOLDEN] * 2 + [0x3F800000] * 12, dtype=torch.int64)
    tally.eq("exp_ds golden", want.to(torch.int32).view(torch.float32), out)


def _fmt_rows(tally):
    import torch
    from dsaquant.reference.arith import canonical_sum
    from dsaquant.reference.compress import rope_tail_interleaved
    from dsaquant.reference.transforms import hadamard

    @triton.jit
    def k_sum(x_ptr, o_ptr, R: tl.constexpr, N: tl.constexpr):
        r = tl.program_id(0) * R + tl.arange(0, R)
        x = tl.load(x_ptr + (r * N)[:, None] + tl.arange(0, N)[None, :])
        tl.store(o_ptr + r, F.canonical_sum_row(x, R, N))

    @triton.jit
    def k_had(x_ptr, c_ptr, s_ptr, o_ptr, q_ptr, R: tl.constexpr, N: tl.constexpr, SCALE: tl.constexpr):
        r = tl.program_id(0) * R + tl.arange(0, R)
        off = (r * N)[:, None] + tl.arange(0, N)[None, :]
        x = tl.load(x_ptr + off)
        tl.store(o_ptr + off, F.hadamard_row(x, R, N, SCALE))
        j = (r * 32)[:, None] + tl.arange(0, 32)[None, :]
        tl.store(q_ptr + off, F.rope_tail_row(x, tl.load(c_ptr + j), tl.load(s_ptr + j), R, N))

    g = torch.Generator().manual_seed(11)
    for N in (4, 8, 16, 32, 64, 128, 256, 512, 1024):
        x = torch.randn(256, N, generator=g) * torch.exp2(torch.randint(-30, 30, (256, N), generator=g).float())
        x[3, ::5] = float("inf")
        x[4, 1] = float("-inf")
        out = torch.empty(256)
        k_sum[(256 // 16,)](x, out, R=16, N=N)
        tally.eq(f"canonical_sum_row N={N}", canonical_sum(x), out)
    import numpy as np
    for N in (128, 256, 512, 1024):
        x = torch.randn(64, N, generator=g) * torch.exp2(torch.randint(-20, 20, (64, N), generator=g).float())
        c, s = torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g)
        out, q = torch.empty_like(x), torch.empty_like(x)
        k_had[(64 // 8,)](x, c, s, out, q, R=8, N=N, SCALE=float(np.float32(N ** -0.5)))
        tally.eq(f"hadamard_row N={N}", hadamard(x), out)
        tally.eq(f"rope_tail_row N={N}", rope_tail_interleaved(x, c, s), q)


def _fmt_rms_norm(tally):
    import numpy as np
    import torch
    from dsaquant.reference.transforms import rms_norm

    @triton.jit
    def k(x_ptr, w_ptr, o_ptr, eps, R: tl.constexpr, N: tl.constexpr):
        r = tl.program_id(0) * R + tl.arange(0, R)
        off = (r * N)[:, None] + tl.arange(0, N)[None, :]
        w = tl.load(w_ptr + tl.arange(0, N))[None, :]
        tl.store(o_ptr + off, F.rms_norm_row(tl.load(x_ptr + off), w, eps, R, N))

    g = torch.Generator().manual_seed(12)
    for N in (128, 512):
        x = torch.randn(256, N, generator=g) * torch.exp2(torch.randint(-40, 40, (256, 1), generator=g).float())
        x[0] = 0.0
        x[1] *= 1e-30
        x[2] *= 1e30
        x[3, 7] = float("nan")
        x[4, 9] = float("inf")
        w = 1 + 0.1 * torch.randn(N, generator=g)
        for eps in (1e-6, 1e-20):
            out = torch.empty_like(x)
            k[(256 // 16,)](x, w, out, float(np.float32(eps)), R=16, N=N)
            tally.eq(f"rms_norm_row N={N} eps={eps}", rms_norm(x, w, eps), out)


def _fmt_pool(tally):
    """The §7.6 pool (compress._pool_core) on windows given in memory against reference.compress.pool, fp32
    bit for bit: K = 4, 8, 128, 256; excluded leading rows; -inf, NaN, +inf scores; score spreads up to
    ~1000 (exp_ds underflow to subnormals and zero); infinite and NaN values."""
    import torch
    from dsaquant.reference.arith import canon_nan
    from dsaquant.reference.compress import pool

    @triton.jit
    def k(sig_ptr, kv_ptr, inc_ptr, o_ptr, ROWS: tl.constexpr, K: tl.constexpr, CW: tl.constexpr):
        M: tl.constexpr = K // 4
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        mm = 4 * tl.arange(0, M)[None, :, None]
        c = tl.arange(0, CW)[None, None, :]
        rr = r[:, None, None]
        g0 = tl.load(sig_ptr + ((rr * K + mm + 0) * CW + c))
        g1 = tl.load(sig_ptr + ((rr * K + mm + 1) * CW + c))
        g2 = tl.load(sig_ptr + ((rr * K + mm + 2) * CW + c))
        g3 = tl.load(sig_ptr + ((rr * K + mm + 3) * CW + c))
        k0 = tl.load(kv_ptr + ((rr * K + mm + 0) * CW + c))
        k1 = tl.load(kv_ptr + ((rr * K + mm + 1) * CW + c))
        k2 = tl.load(kv_ptr + ((rr * K + mm + 2) * CW + c))
        k3 = tl.load(kv_ptr + ((rr * K + mm + 3) * CW + c))
        i0 = tl.load(inc_ptr + (rr * K + mm + 0)) != 0
        i1 = tl.load(inc_ptr + (rr * K + mm + 1)) != 0
        i2 = tl.load(inc_ptr + (rr * K + mm + 2)) != 0
        i3 = tl.load(inc_ptr + (rr * K + mm + 3)) != 0
        y = C._pool_core(k0, k1, k2, k3, g0, g1, g2, g3, i0, i1, i2, i3, ROWS, M, CW)
        tl.store(o_ptr + ((r * CW)[:, None] + tl.arange(0, CW)[None, :]), y)

    g = torch.Generator().manual_seed(13)
    CW = 32
    for K, n in ((4, 256), (8, 256), (128, 16), (256, 8)):
        spread = torch.tensor([1.0, 10.0, 100.0, 1000.0])[torch.arange(n) % 4].view(n, 1, 1)
        sig = torch.randn(n, K, CW, generator=g) * spread
        kv = torch.randn(n, K, CW, generator=g) * torch.exp2(torch.randint(-20, 20, (n, 1, CW), generator=g).float())
        u = torch.rand(n, K, CW, generator=g)
        sig = torch.where(u < 0.02, torch.full_like(sig, float("-inf")), sig)
        sig = torch.where((u > 0.02) & (u < 0.022), torch.full_like(sig, float("nan")), sig)
        sig = torch.where((u > 0.5) & (u < 0.501), torch.full_like(sig, float("inf")), sig)
        kv = torch.where((u > 0.3) & (u < 0.301), torch.full_like(kv, float("inf")), kv)
        kv = torch.where((u > 0.7) & (u < 0.701), torch.full_like(kv, float("nan")), kv)
        sig[1, :, 3] = float("-inf")                                        # an all -inf column
        lead = torch.randint(0, K, (n,), generator=g) * (torch.arange(n) % 3 == 0)
        inc = (torch.arange(K)[None, :] >= lead[:, None]).to(torch.int32)    # excluded leading rows (s < 0)
        sig = torch.where(inc[:, :, None] == 0, torch.full_like(sig, float("nan")), sig)   # garbage there
        out = torch.empty(n, CW)
        rows = 4 if K <= 8 else 1
        k[(n // rows,)](sig, kv, inc, out, ROWS=rows, K=K, CW=CW)
        want = pool(sig.transpose(1, 2), kv.transpose(1, 2), (inc != 0)[:, None, :])
        # NaN bits of an arithmetic NaN are the platform's (every store of the op canonicalises them)
        tally.eq(f"pool K={K}", canon_nan(want), canon_nan(out))
        tally.check(bool(torch.isnan(want).any()) and bool(torch.isfinite(want).any()), f"pool K={K}: no NaN cases")


_FMT = {"exp_ds": _fmt_exp_ds, "exp_ds_golden": _fmt_exp_ds_golden, "rows": _fmt_rows, "rms_norm": _fmt_rms_norm,
        "pool": _fmt_pool}


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker_main(sys.argv[2], sys.argv[3])
    else:
        print(__doc__)
        print(f"usage: TRITON_INTERPRET=1 python {HERE.name} --worker CASES.json OUT.json ({len(CASES)} cases)")

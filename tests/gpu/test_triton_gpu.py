"""The `triton` backend's writers against the reference on a GPU, byte for byte (skipped without CUDA).

Every case runs the public op twice on the same CUDA inputs, with backend="reference" and backend="triton",
on poisoned outputs (testing.POISON), and compares every byte of every tensor argument and return value, so
an unwritten byte or a stray write is a mismatch. Each case runs in two Triton code paths (quant.py):
  - "triton": the default on this GPU (NATIVE bf16 conversions; HW_FP8 = cvt.rn.satfinite on sm_89+);
  - "triton-soft": DSAQUANT_TRITON_NATIVE=0 / DSAQUANT_TRITON_HW_FP8=0 (the interpreter's software paths).
The soft path runs on a subset of the grid (every op, policy, FP8 flavour and RoPE style). Counts of
compared and mismatching bytes are printed per op at the end (tests/gpu/conftest.py table, backend
column "triton" / "triton-soft") and by test_zz_summary.

Grid: T in {1, 5, 64, 300, 4096}; H in {16, 32, 64, 128}; scales {1, 40, 1e-3, 1e-30}; rows of
zeros, exact E2M1 midpoints, NaN/±Inf, tiny values and FMA-exposing RoPE pairs; every rounding policy; both
RoPE styles; compress ratios 1, 2, 4; int32/int64 positions and slots; negative slots, slot 0, the last slot,
random slot order, an out-of-range slot and out-of-range positions (the device error flag must equal the
reference's).
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA (or ROCm) GPU", allow_module_level=True)
pytest.importorskip("triton")

import dsaquant as dq  # noqa: E402
from dsaquant import dispatch, errors, testing as tt  # noqa: E402

from .counts import byte_diff, record  # noqa: E402

if not dispatch.available("triton")[0]:
    pytest.skip(f"triton backend unavailable: {dispatch.available('triton')[1]}", allow_module_level=True)
from dsaquant.triton import quant  # noqa: E402

DEV = torch.device("cuda")
T_GRID = (1, 5, 64, 300, 4096)
H_GRID = (16, 32, 64, 128)
SCALES = (1.0, 40.0, 1e-3, 1e-30)
POLICIES = ("threshold", "rne", "hardware")
MODES = ("triton", "triton-soft")
TOTAL = {}          # op -> [cases, bytes, mismatches] over both modes, for test_zz_summary


def inject(x: torch.Tensor, which: int = 0) -> torch.Tensor:
    """The shared special rows (dsaquant.testing.special_rows)."""
    return tt.special_rows(x, which)


def clone_args(args: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


class mode_ctx:
    """Select the Triton code path: 'triton' (defaults) or 'triton-soft' (software conversions)."""

    def __init__(self, mode):
        self.mode = mode

    def __enter__(self):
        self.saved = (quant.NATIVE_ENABLED, quant.HW_FP8_ENABLED)
        if self.mode == "triton-soft":
            quant.NATIVE_ENABLED = False
            quant.HW_FP8_ENABLED = False

    def __exit__(self, *exc):
        quant.NATIVE_ENABLED, quant.HW_FP8_ENABLED = self.saved


def run_pair(op_name: str, fn, args: dict, mode: str, label: str, returns=False, oob=False):
    """Run reference and triton on clones of `args`; compare all tensor arguments (and return values)."""
    try:
        errors.check_errors()
    except errors.DsaquantError:
        pass
    a_ref, a_tr = clone_args(args), clone_args(args)
    errors.flag_tensor(DEV).zero_()
    r_ref = fn(**a_ref, backend="reference")
    ref_flag = int(errors.flag_tensor(DEV).item())
    errors.flag_tensor(DEV).zero_()
    with mode_ctx(mode):
        r_tr = fn(**a_tr, backend="triton")
    torch.cuda.synchronize()
    flag = int(errors.flag_tensor(DEV).item())
    errors.flag_tensor(DEV).zero_()
    pairs = [(k, a_ref[k], a_tr[k]) for k in args if isinstance(args[k], torch.Tensor)]
    if returns:
        rr = r_ref if isinstance(r_ref, tuple) else (r_ref,)
        rt = r_tr if isinstance(r_tr, tuple) else (r_tr,)
        pairs += [(f"ret{i}", x, y) for i, (x, y) in enumerate(zip(rr, rt))]
    total, bad, where = byte_diff(pairs, "triton")
    record(mode, op_name, total, bad)
    t = TOTAL.setdefault(f"{mode} {op_name}", [0, 0, 0])
    t[0] += 1
    t[1] += total
    t[2] += bad
    assert bad == 0, f"{mode} {op_name} {label}: {bad} of {total} bytes differ: " + "; ".join(where)
    assert flag == ref_flag, f"{mode} {op_name} {label}: device error flag {flag}, reference {ref_flag}"
    assert bool(flag & errors.SLOT_OUT_OF_RANGE) == bool(oob), \
        f"{mode} {op_name} {label}: device error flag {flag}, out-of-range slot {oob}"


def _set_oob(slots: torch.Tensor, capacity: int) -> torch.Tensor:
    s = slots.clone()
    s[-1] = capacity + 5
    return s


# ---- §7.1 -----------------------------------------------------------------------------------------------
def indexer_cases():
    cases = []
    for i, (T, H) in enumerate(itertools.product(T_GRID, H_GRID)):
        for mode in ("fp8", "fp4"):
            j = 2 * i + (mode == "fp4")
            cases.append(dict(T=T, H=H, mode=mode, scale=SCALES[j % 4], policy=POLICIES[j % 3], neox=bool(i % 2),
                              preshuffle=bool((i // 2) % 2), scale_fmt="ue8m0" if j % 3 else None,
                              pos=torch.int32 if j % 2 else torch.int64,
                              slot=torch.int32 if j % 5 == 1 else torch.int64,
                              all_q=(j % 5 == 0), flavour="e4m3fnuz" if j % 4 == 3 else "e4m3fn",
                              dtype=torch.float16 if j % 7 == 3 else torch.bfloat16, page=16 if j % 6 == 5 else 64,
                              oob=(j % 9 == 4), soft=False))
    # every (policy, rope style, scale) in FP4 and every (flavour, scale_fmt, preshuffle, rope style) in FP8
    for k, (policy, neox, scale) in enumerate(itertools.product(POLICIES, (True, False), SCALES)):
        cases.append(dict(T=64, H=64, mode="fp4", scale=scale, policy=policy, neox=neox, preshuffle=False,
                          scale_fmt="ue8m0", pos=torch.int64, slot=torch.int64, all_q=k % 5 == 0, flavour="e4m3fn",
                          dtype=torch.bfloat16, page=64, oob=False, soft=k % 4 == 0))
    for k, (fl, sf, ps, neox) in enumerate(itertools.product(("e4m3fn", "e4m3fnuz"), ("ue8m0", None), (False, True),
                                                             (True, False))):
        cases.append(dict(T=300, H=32, mode="fp8", scale=SCALES[k % 4], policy="hardware", neox=neox, preshuffle=ps,
                          scale_fmt=sf, pos=torch.int32, slot=torch.int64, all_q=k % 3 == 0, flavour=fl,
                          dtype=torch.bfloat16 if k % 2 else torch.float16, page=64, oob=False, soft=k % 4 == 0))
    return cases


def _cid(c):
    return (f"T{c['T']}-H{c['H']}-{c['mode']}-s{c['scale']:g}-" +
            (c["policy"] if c["mode"] == "fp4" else f"{c['flavour']}-{c['scale_fmt']}-p{int(c['preshuffle'])}") +
            ("-neox" if c["neox"] else "-il") + ("-all" if c["all_q"] else "") + ("-oob" if c["oob"] else ""))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("c", indexer_cases(), ids=_cid)
def test_indexer(c, mode):
    if mode == "triton-soft" and not c["soft"]:
        pytest.skip("software path checked on a subset (it is the interpreter's path; compile time)")
    a = build_indexer_case(c)
    run_pair("indexer_qk_rope_quant_and_cache", dq.indexer_qk_rope_quant_and_cache, a, mode, _cid(c), oob=c["oob"])


def build_indexer_case(c) -> dict:
    """The arguments of one grid case."""
    f8 = torch.float8_e4m3fnuz if c["flavour"] == "e4m3fnuz" else torch.float8_e4m3fn
    a = tt.make_indexer(T=c["T"], H=c["H"], mode=c["mode"], device=DEV, seed=c["T"] * 131 + c["H"], scale=c["scale"],
                        rounding=c["policy"], is_neox=c["neox"], preshuffle=c["preshuffle"], scale_fmt=c["scale_fmt"],
                        pos_dtype=c["pos"], compute_all_q_rope=c["all_q"], fp8_dtype=f8, dtype=c["dtype"],
                        page_size=c["page"])
    a["q"], a["k"] = inject(a["q"], c["T"]), inject(a["k"], c["T"] + 3)
    cap = a["kv_cache"].shape[0] * c["page"]
    if c["T"] >= 3 and c["T"] % 2:
        pos = a["positions"].clone()
        pos[1], pos[2] = -3, 10 ** 6          # clamped into [0, max_pos) and flagged
        a["positions"] = pos
    s = a["slot_mapping"].clone()
    if c["T"] >= 4:   # token 3 takes slot 0; a token that already had it takes token 3's slot (slots stay
        s[s == 0] = s[3].item()   # distinct: with a duplicate the last writer is unspecified on a GPU)
        s[3] = 0
    if c["oob"]:
        s = _set_oob(s, cap)
    a["slot_mapping"] = s.to(c["slot"])
    return a


# ---- §7.2 -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("T", T_GRID)
@pytest.mark.parametrize("ratio", (1, 2, 4))
def test_k_store(T, ratio, mode):
    if mode == "triton-soft" and T != 5:
        pytest.skip("software path checked on a subset")
    for i, policy in enumerate(POLICIES):
        a = tt.make_k_store(T=T, device=DEV, seed=T + ratio * 7 + i, scale=SCALES[(T + i + ratio) % 4],
                            compress_ratio=ratio, rounding=policy, dtype=torch.float16 if i == 2 else torch.bfloat16)
        a["k"] = inject(a["k"], i + ratio)
        if i == 0 and T >= 2:
            a["positions"][0] = 4096 * 4 + 3
        if i == 1:
            a["positions"] = a["positions"].to(torch.int32)
            a["slots"] = a["slots"].to(torch.int32)
        oob = (i == 0 and ratio == 2 and T > 1)
        if oob:
            a["slots"] = _set_oob(a["slots"], a["cache"].shape[0] * 64)
        run_pair("index_k_norm_rope_pack_store", dq.index_k_norm_rope_pack_store, a, mode, f"T{T} r{ratio} {policy}",
                 oob=oob)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("T,H", list(itertools.product(T_GRID, H_GRID)))
def test_q_pack(T, H, mode):
    if mode == "triton-soft" and T != 5:
        pytest.skip("software path checked on a subset")
    i = (T + H) % 3
    a = tt.make_q_pack(T=T, H=H, device=DEV, seed=T * H + i, scale=SCALES[(T // 2 + H // 16) % 4], rounding=POLICIES[i],
                       dtype=torch.float16 if H == 32 else torch.bfloat16)
    a["q"] = inject(a["q"], T + H)
    if T % 2:
        a["positions"] = a["positions"].to(torch.int32)
    run_pair("index_q_rope_pack_weights", dq.index_q_rope_pack_weights, a, mode, f"T{T} H{H} {POLICIES[i]}",
             returns=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("T", T_GRID)
@pytest.mark.parametrize("variant", ((32, "ue8m0", 1), (16, "e4m3", 1), (32, "ue8m0", 4), (16, "e4m3", 2)))
def test_rope_fake_quant(T, variant, mode):
    if mode == "triton-soft" and T != 5:
        pytest.skip("software path checked on a subset")
    block, scale, ratio = variant
    for dtype, H in ((torch.bfloat16, 16), (torch.float16, None)):
        a = tt.make_q_pack(T=T, H=H or 1, device=DEV, seed=T + block + ratio, scale=SCALES[(T + ratio) % 4],
                           dtype=dtype)
        x = inject(a["q"], T + block)
        if H is None:
            x = x[:, 0, :].contiguous()
        args = dict(x=x, positions=a["positions"], freqs=a["freqs"], block=block, scale=scale, compress_ratio=ratio)
        run_pair("rope_fake_quant_fp4", dq.rope_fake_quant_fp4, args, mode, f"T{T} {variant} {dtype}", returns=True)


# ---- §7.3 -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("T", T_GRID)
@pytest.mark.parametrize("layout", ("aiter_fp4", "dense"))
def test_v4_k(T, layout, mode):
    if mode == "triton-soft" and T != 5:
        pytest.skip("software path checked on a subset")
    for i, policy in enumerate(POLICIES):
        a = tt.make_v4_k(T=T, device=DEV, seed=T + i, scale=SCALES[(T + i) % 4], layout=layout, rounding=policy,
                         hadamard=bool((T + i) % 2), dtype=(torch.bfloat16, torch.float32, torch.float16)[i])
        a["kv"] = inject(a["kv"], T + i)
        if i == 1:
            a["positions"] = a["positions"].to(torch.int32)
            cos, sin, _ = tt.rope_tables(4096, DEV, torch.float32)
            a["cos_cache"], a["sin_cache"] = cos, sin
        oob = (i == 2 and T > 1)
        if oob:
            cap = a["kv_cache"].shape[0] * (64 if layout == "aiter_fp4" else 1)
            a["slot_mapping"] = _set_oob(a["slot_mapping"], cap)
        run_pair("rmsnorm_rope_rotate_fp4quant_kvcache", dq.rmsnorm_rope_rotate_fp4quant_kvcache, a, mode,
                 f"T{T} {layout} {policy}", oob=oob)


# ---- the closing tally (speed is measured by `python -m dsaquant bench`, which has the indexer rows) ----
def test_zz_summary():
    """Print the comparison counts of this file (also in the conftest table)."""
    if not TOTAL:
        pytest.skip("no cases ran")
    lines = [f"{'path':<12} {'op':<40} {'cases':>6} {'bytes compared':>15} {'mismatches':>11}"]
    for key, (n, tot, bad) in sorted(TOTAL.items()):
        mode, op = key.split(" ", 1)
        lines.append(f"{mode:<12} {op:<40} {n:>6} {tot:>15} {bad:>11}")
    print("\n" + "\n".join(lines))
    path = os.environ.get("DSAQUANT_TRITON_COUNTS_FILE")
    if path:
        with open(path, "a") as f:
            f.write("\n".join(lines) + "\n")
    assert all(bad == 0 for _, _, bad in TOTAL.values())

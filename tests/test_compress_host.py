"""The compiled kernels of SPEC §7.6 compress_kv and §7.7 rope_rotate_quant, on the CPU, byte for byte.

kernels/cuda/compress_body.cuh holds the kernel bodies that kernels/cuda/compress.cu launches on NVIDIA (and hipified on AMD).
tests/cpp/compress_host.cpp runs the same bodies on the host, one cooperative fiber per GPU thread: block barriers and
32-lane shuffles are rendezvous points, a shuffle that not every lane of its warp reaches is an error, and the
blocks of a grid run one after another in order, reversed or shuffled (results must not depend on it). The module
is driven through the compiled backends' own glue (dsaquant.backends.compiled.make_ops), with CPU tensors, and
every output byte (caches, scale tensors, the whole ring, the error flags) is compared with the reference backend
(dsaquant.reference.compress) on the same inputs. What this cannot see: the device SIMT layer of compress.cu (a dozen
lines), the hardware converts (checked against the software forms on the GPU by tests/gpu/test_fp8_native.py),
races between blocks running at the same time (the design has none: see compress_body.cuh), and the launch itself.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

import host_cpp
from dsaquant import errors
from dsaquant import testing as tt
from dsaquant.backends.abi import DsqCompressArgs, Library
from dsaquant.backends.compiled import make_ops
from dsaquant.reference import compress as rc

REPO = Path(__file__).resolve().parents[1]
SOURCES = [REPO / "tests/cpp/compress_host.cpp", REPO / "tests/cpp/fibers.h", REPO / "kernels/cuda/compress_body.cuh",
           REPO / "kernels/cuda/rotate_body.cuh",
           REPO / "kernels/cuda/compress_args.h", *sorted((REPO / "src/include/dsaquant").glob("*.h"))]
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def _build() -> Path:
    return host_cpp.build(SOURCES, "test_compress_host", "the V4 kernel emulator")


class Emulator:
    """The emulator library: its C interface (`lib`, an abi.Library the glue drives) and the dsq_emu_* extras."""

    def __init__(self, so: Path):
        self.lib = Library(str(so))
        c = self.lib.cdll
        c.dsq_emu_pool_rows.argtypes = [ctypes.POINTER(DsqCompressArgs), ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_void_p]
        c.dsq_emu_warp_op.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
        c.dsq_emu_set_block_order.argtypes = [ctypes.c_int, ctypes.c_uint64]
        c.dsq_emu_set_block_order.restype = None
        c.dsq_emu_set_rotate_v.argtypes = [ctypes.c_int]
        c.dsq_emu_set_rotate_v.restype = None
        c.dsq_emu_set_compress_mode.argtypes = [ctypes.c_int]
        c.dsq_emu_set_compress_mode.restype = None

    def _check(self, err: int):
        if err:
            raise RuntimeError(self.lib.error_string(err))

    def pool_rows(self, args: DsqCompressArgs, boundaries) -> torch.Tensor:
        """pool_row alone for the boundaries (i, p, b): fp32 [N, D]."""
        bs = torch.tensor(boundaries, dtype=torch.int64).reshape(-1, 3).contiguous()
        out = torch.empty(bs.shape[0], args.D, dtype=F32)
        self._check(self.lib.cdll.dsq_emu_pool_rows(ctypes.byref(args), bs.data_ptr(), bs.shape[0], out.data_ptr()))
        return out

    def warp_op(self, x: torch.Tensor, n: int, op: int) -> torch.Tensor:
        """warp_sum (op 0) / warp_hadamard (op 1) on the rows of n values of fp32 x (a copy)."""
        y = x.to(F32).contiguous().clone()
        self._check(self.lib.cdll.dsq_emu_warp_op(y.data_ptr(), y.numel(), n, op))
        return y

    def set_block_order(self, order: int, seed: int = 0):
        self.lib.cdll.dsq_emu_set_block_order(order, seed)

    def set_compress_mode(self, force: int):
        """compress_kv's range mode: 0 the launcher's choice by call size (windows of K >= 128 rows in clusters of
        blocks, as on sm_90: 8 a cluster for calls of few windows, else 4), 1 one range a block (and one block a
        window), 2 one range a warp (K <= 8 and D = 128 only; other calls keep one range a block), 3 clusters of 4
        blocks whatever the call's size."""
        self.lib.cdll.dsq_emu_set_compress_mode(force)

    def set_rotate_v(self, v: int):
        """rope_rotate_quant's values a lane (0: the launcher's choice by call size)."""
        self.lib.cdll.dsq_emu_set_rotate_v(v)


@pytest.fixture(scope="module")
def emu():
    return Emulator(_build())


@pytest.fixture(scope="module")
def ops(emu):
    return make_ops(emu.lib)


# ------------------------------------------------------------------------------------------------
# SPEC §7.6 compress_kv
# ------------------------------------------------------------------------------------------------
def compress_case(*, ratio=4, overlap=None, D=128, dtype=F32, starts=(0, 5, 13, 3), lens=(9, 1, 20, 0),
                  quant_mode="none", layout="packed68", scale_rule="recip", rounding="rne", scale_fmt="ue8m0",
                  fp8_flavour="e4m3fn", preshuffle=False, hadamard=False, bf16_after=("pool", "norm", "rope"),
                  table="f32", max_pos=4096, update_state=True, R_extra=3, specials=False, strided=False,
                  bad_ring=None, over_cap=0, P=None, nw_dtype=F32, seed=0):
    """(outputs, positional args of the reference signature), built afresh from `seed` on every call."""
    g = torch.Generator().manual_seed(seed)
    overlap = ratio == 4 if overlap is None else overlap
    K = ratio * (2 if overlap else 1)
    C = D * (2 if overlap else 1)
    R = K + R_extra
    B, T = len(starts), sum(lens)
    kv = torch.randn(T, C, generator=g)
    score = torch.randn(T, C, generator=g) * 2
    if specials:
        kv[:, :128] = tt.special_rows(kv[:, :128])
        for t in range(0, T, 3):
            c = int(torch.randint(0, C, (1,), generator=g))
            score[t, c] = (float("nan"), float("inf"), float("-inf"))[t % 3]
        score[T // 2:T // 2 + ratio, 5] = float("-inf")     # a whole window's column -inf (NaN result)
        score[T // 3, 7:] *= 1e30
    if strided:   # column views of wider rows (sglang's [T, 4D] kv|score layout)
        wide = torch.zeros(T, 2 * C + 8)
        wide[:, 4:4 + C], wide[:, 4 + C:4 + 2 * C] = kv, score
        wide = wide.to(dtype)
        kv, score = wide[:, 4:4 + C], wide[:, 4 + C:4 + 2 * C]
    else:
        kv, score = kv.to(dtype), score.to(dtype)
    ape = torch.randn(ratio, C, generator=g) * 0.5
    n_ring = B + 2
    ring_kv = torch.randn(n_ring, R + 2, C + 4, generator=g)
    ring_sc = torch.randn(n_ring, R + 2, C + 4, generator=g)
    ring_sc[0, 1, 3] = float("nan")
    if strided:
        state_kv, state_score = ring_kv[:, 1:1 + R, 2:2 + C], ring_sc[:, 2:2 + R, :C]
    else:
        state_kv, state_score = ring_kv[:, :R, :C].contiguous(), ring_sc[:, :R, :C].contiguous()
        ring_kv, ring_sc = state_kv, state_score
    state_slot = torch.randperm(n_ring, generator=g)[:B].to(torch.int32)
    if bad_ring is not None:
        state_slot[bad_ring] = n_ring + 5
    cu = torch.tensor([0] + [sum(lens[:b + 1]) for b in range(B)], dtype=torch.int32)
    start_pos = torch.tensor(starts, dtype=torch.int64)
    nw = (1 + 0.1 * torch.randn(D, generator=g)).to(nw_dtype)
    cos = sin = freqs = None
    if table == "freqs":
        _, _, freqs = tt.rope_tables(max_pos, "cpu")
    else:
        cos, sin, _ = tt.rope_tables(max_pos, "cpu", {"f32": F32, "bf16": BF16, "f16": F16}[table])
    cache_scale = None
    if quant_mode in ("none", "fp4_sim"):
        P = P or 16
        cache = tt.poisoned((max(1, -(-T // P)) + 1, P, D), BF16, "cpu")
    elif quant_mode == "fp4" and layout == "aiter_fp4":
        P = 64
        NB = max(1, -(-T // P)) + 1
        cache = tt.poisoned((NB, 1, 4, P, 16), torch.uint8, "cpu")
        cache_scale = tt.poisoned((NB, 1, 4, P), torch.uint8, "cpu")
    elif quant_mode == "fp4":
        P = P or 16
        cache = tt.poisoned((max(1, -(-T // P)) + 1, P * 68), torch.uint8, "cpu")
    else:
        P = P or 16
        cache = tt.poisoned((max(1, -(-T // P)) + 1, P * 132), torch.uint8, "cpu")
    capacity = cache.shape[0] * P
    out_slots = torch.randperm(capacity, generator=g)[:T].to(torch.int64)
    out_slots[torch.rand(T, generator=g) < 0.125] = -1
    if over_cap:
        out_slots[torch.randperm(T, generator=g)[:over_cap]] = capacity + torch.arange(over_cap) * 7
    args = (kv, score, ape, state_kv, state_score, state_slot, cu, start_pos, nw, 1e-6, cos, sin, out_slots, cache,
            cache_scale, ratio, overlap, quant_mode, layout, scale_rule, rounding, scale_fmt, fp8_flavour, preshuffle,
            hadamard, tuple(bf16_after), freqs, update_state, P)
    outs = {"cache": cache, "cache_scale": cache_scale, "ring_kv": ring_kv, "ring_score": ring_sc}
    return outs, args


COMPRESS = {
    "r4_none_f32": {},
    "r4_none_bf16_freqs": dict(dtype=BF16, table="freqs", nw_dtype=BF16),
    "r4_fp4_packed68": dict(quant_mode="fp4"),
    "r4_fp4_aiter_hw": dict(quant_mode="fp4", layout="aiter_fp4", rounding="hardware", dtype=BF16, bf16_after=()),
    "r4_fp4_c4_had": dict(quant_mode="fp4", scale_rule="pack", rounding="threshold", hadamard=True, bf16_after=()),
    "r4_fp4_sim_had": dict(quant_mode="fp4_sim", hadamard=True, bf16_after=("pool", "norm", "rope", "hadamard")),
    "r4_fp4_sim_pack": dict(quant_mode="fp4_sim", scale_rule="pack", table="bf16"),
    "r4_fp8_ue8m0_pre": dict(quant_mode="fp8", preshuffle=True, table="bf16", bf16_after=("rope",)),
    "r4_fp8_fp32_fnuz": dict(quant_mode="fp8", scale_fmt=None, fp8_flavour="e4m3fnuz", table="f16"),
    "r4_no_overlap_fp4": dict(overlap=False, quant_mode="fp4", rounding="hardware"),
    "r4_decode": dict(starts=(3, 7, 11, 0, 126, 127, 6), lens=(1, 1, 1, 1, 1, 1, 1), quant_mode="fp4"),
    "r4_ring_wraps": dict(R_extra=0, starts=(5, 50, 2), lens=(40, 3, 17), quant_mode="fp8"),
    "r4_no_update": dict(update_state=False, quant_mode="fp4_sim"),
    "r4_specials_hw": dict(specials=True, quant_mode="fp4", rounding="hardware", starts=(0, 9), lens=(36, 12)),
    "r4_specials_fp8": dict(specials=True, quant_mode="fp8", starts=(0, 9), lens=(36, 12), seed=3),
    "r4_specials_none": dict(specials=True, starts=(0, 9), lens=(36, 12), bf16_after=(), seed=4),
    "r4_bad_input": dict(bad_ring=1, over_cap=4, max_pos=24, quant_mode="fp4", starts=(0, 5, 13, 30),
                         lens=(9, 6, 20, 4)),
    "r4_strided_bf16": dict(strided=True, dtype=BF16, quant_mode="fp4", layout="aiter_fp4"),
    "r128_fp4": dict(ratio=128, starts=(0, 200, 120), lens=(260, 60, 8), quant_mode="fp4"),
    "r128_fp8_bf16": dict(ratio=128, starts=(130, 0), lens=(140, 130), quant_mode="fp8", dtype=BF16, R_extra=0),
    "r128_overlap_none": dict(ratio=128, overlap=True, starts=(0, 300), lens=(400, 30)),
    "r128_overlap_fp4_sim": dict(ratio=128, overlap=True, starts=(250, 0), lens=(20, 130), quant_mode="fp4_sim",
                                 specials=True),
    "d512_r4": dict(D=512, starts=(0, 5), lens=(9, 12)),
    "d512_r128": dict(D=512, ratio=128, starts=(100,), lens=(60,), bf16_after=("norm",)),
    "d512_r4_no_overlap": dict(D=512, overlap=False, starts=(1, 0), lens=(8, 7), dtype=BF16),
}


def _run_compress(ops, emu, case: dict, order: int):
    emu.set_block_order(order, 11)
    host_cpp.take_flag()
    outs_e, args_e = compress_case(**case)
    ops["compress_kv"](*args_e)
    flag_e = host_cpp.take_flag()
    outs_r, args_r = compress_case(**case)
    rc.compress_kv(*args_r)
    flag_r = host_cpp.take_flag()
    return outs_e, flag_e, outs_r, flag_r


@pytest.mark.parametrize("order", [0, 1, 2])
@pytest.mark.parametrize("name", list(COMPRESS))
def test_compress_kv(ops, emu, name, order):
    if order == 2 and not name.startswith(("r4_fp4_packed68", "r128_fp4", "r4_ring", "r4_bad", "r128_overlap_none")):
        pytest.skip("shuffled block order: a few cases")
    outs_e, flag_e, outs_r, flag_r = _run_compress(ops, emu, COMPRESS[name], order)
    for k in outs_r:
        if outs_r[k] is not None:
            host_cpp.same_bytes(f"{name} {k}", outs_e[k], outs_r[k])
    assert flag_e == flag_r, (flag_e, flag_r)
    if name == "r4_bad_input":
        assert flag_r == errors.SLOT_OUT_OF_RANGE | errors.POSITION_OUT_OF_RANGE


# The windows of K >= 128 rows: by default (the launcher's choice on sm_90) pooled by clusters of blocks that split the
# columns; forced here to one block a window, the mode of devices without clusters.
WINDOW_CASES = [n for n, c in COMPRESS.items() if c.get("ratio", 4) == 128]


@pytest.mark.parametrize("name", WINDOW_CASES)
def test_compress_kv_one_block_a_window(ops, emu, name):
    """The same bytes with each window of K >= 128 rows pooled by one block (no cluster)."""
    _compare_in_mode(ops, emu, COMPRESS[name], 0, 1, name)


@pytest.mark.parametrize("name", WINDOW_CASES)
def test_compress_kv_clusters_of_four(ops, emu, name):
    """The same bytes with clusters of 4 blocks (the launcher's choice for calls of many windows; the small cases
    here get clusters of 8 by default)."""
    _compare_in_mode(ops, emu, COMPRESS[name], 0, 3, name)


# The cases that the range mode `warp` (one range a warp) can run: K <= 8 and D = 128.
WARP_RANGE_CASES = [n for n, c in COMPRESS.items() if c.get("ratio", 4) == 4 and c.get("D", 128) == 128]


@pytest.mark.parametrize("order", [0, 2])
@pytest.mark.parametrize("name", WARP_RANGE_CASES)
def test_compress_kv_warp_ranges(ops, emu, name, order):
    """The same bytes with the range blocks taking one range a warp (the launcher's choice for calls of many
    ranges), forced here on the small cases."""
    if order == 2 and not name.startswith(("r4_fp4_packed68", "r4_ring", "r4_bad", "r4_specials_hw")):
        pytest.skip("shuffled block order: a few cases")
    _compare_in_mode(ops, emu, COMPRESS[name], order, 2, name)


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("case", [dict(quant_mode="fp4", dtype=BF16, starts=(0,), lens=(2100,)),
                                  dict(quant_mode="fp8", starts=(3, 0, 40), lens=(700, 1500, 9), seed=5)],
                         ids=["one_prompt", "three"])
def test_compress_kv_many_ranges(ops, emu, case, mode):
    """Calls of more than 512 ranges at ratio 4, whose range blocks the launcher gives one range a warp (mode 0),
    and the same calls one range a block (mode 1)."""
    _compare_in_mode(ops, emu, case, 2, mode, "many ranges")


def _compare_in_mode(ops, emu, case, order, mode, tag):
    """compress_kv on the emulator with its range mode forced to `mode` (0 the launcher's choice, 1 a range a
    block, 2 a range a warp) against the reference: every output byte and the error flags."""
    emu.set_compress_mode(mode)
    try:
        outs_e, flag_e, outs_r, flag_r = _run_compress(ops, emu, case, order)
    finally:
        emu.set_compress_mode(0)
    for k in outs_r:
        if outs_r[k] is not None:
            host_cpp.same_bytes(f"{tag} {k}", outs_e[k], outs_r[k])
    assert flag_e == flag_r, (flag_e, flag_r)


def test_compress_kv_writes_something(ops, emu):
    """The comparison above is not vacuous: boundaries were stored and ring rows written."""
    outs, args = compress_case(quant_mode="fp4")
    before = {k: v.clone() for k, v in outs.items() if v is not None}
    ops["compress_kv"](*args)
    host_cpp.take_flag()
    for k in before:
        assert not torch.equal(before[k].view(torch.uint8), outs[k].view(torch.uint8)), k


POOL_CASES = {
    "K4": dict(overlap=False, specials=True),
    "K8": dict(specials=True, starts=(0, 9, 2), lens=(36, 12, 1)),
    "K8_bf16_wrap": dict(dtype=BF16, R_extra=0, starts=(5, 50), lens=(40, 3)),
    "K128": dict(ratio=128, starts=(0, 200, 120), lens=(260, 60, 8), specials=True),
    "K256": dict(ratio=128, overlap=True, starts=(250, 0), lens=(20, 300)),
    "K8_D512": dict(D=512, starts=(0, 5), lens=(9, 12)),
    "K128_D512": dict(D=512, ratio=128, starts=(100,), lens=(60,)),
}


POOL_WARP_CASES = ["K4", "K8", "K8_bf16_wrap"]


@pytest.mark.parametrize("name", list(POOL_CASES) + [f"{n}_warp" for n in POOL_WARP_CASES])
def test_pool_rows_fp32(ops, emu, monkeypatch, name):
    """The distributed pool (pool_row: kPL window slices per column, in-thread and cross-lane butterflies; `_warp`:
    pool_warp, a lane's columns over the whole window in its registers) against the reference's pool() in fp32,
    before any rounding point hides an ulp (every boundary, out slot or not)."""
    warp = name.endswith("_warp")
    case = dict(POOL_CASES[name[:-5] if warp else name])
    emu.set_compress_mode(2 if warp else 0)
    try:
        _pool_rows_check(ops, emu, monkeypatch, case)
    finally:
        emu.set_compress_mode(0)


def _pool_rows_check(ops, emu, monkeypatch, case):
    _, args = compress_case(**case)
    got = []

    class Capture:   # a library whose compress_kv runs the emulator's pool_rows on the glue's argument struct
        @staticmethod
        def has(op):
            return True

        @staticmethod
        def launch(op, a, stream):
            assert op == "compress_kv"
            cu, sp = args[6].tolist(), args[7].tolist()
            bs = []
            for b in range(len(sp)):
                for j in range(cu[b + 1] - cu[b]):
                    p = sp[b] + j
                    if (p + 1) % a.ratio == 0:
                        bs.append((cu[b] + j, p, b))
            got.append(emu.pool_rows(a, bs))

    want = []
    real_pool = rc.pool
    monkeypatch.setattr(rc, "pool", lambda *a: want.append(real_pool(*a)) or want[-1])
    make_ops(Capture)["compress_kv"](*args)
    rc.compress_kv(*compress_case(**case)[1])
    host_cpp.take_flag()
    assert len(got) == len(want) == 1 and got[0].shape == want[0].shape and got[0].shape[0] > 0
    g, w = got[0], want[0]
    both_nan = torch.isnan(g) & torch.isnan(w)
    bad = (g.view(torch.int32) != w.view(torch.int32)) & ~both_nan
    assert not bool(bad.any()), f"{int(bad.sum())} of {bad.numel()} pooled values differ at {bad.nonzero()[:5].tolist()}"


@pytest.mark.parametrize("n", [128, 256, 512, 1024])
def test_warp_sum_and_hadamard_fp32(emu, n):
    """The warp-distributed canonical sum (RMSNorm's S over D = n) and Hadamard over n, in fp32, against
    reference.arith.canonical_sum and reference.transforms.hadamard (rows of wide dynamic range)."""
    from dsaquant.reference import arith, transforms
    g = torch.Generator().manual_seed(n)
    rows = 24 if n >= 512 else 48
    x = torch.randn(rows, n, generator=g) * 2.0 ** torch.randint(-20, 20, (rows, n), generator=g).float()
    x[1::5, n // 2:] = -x[1::5, :n // 2].flip(-1)      # cancellations that only some orders see
    s = emu.warp_op(x, n, 0).reshape(rows, n)[:, 0]
    host_cpp.same_bytes(f"warp_sum n={n}", s, arith.canonical_sum(x))
    hd = emu.warp_op(x, n, 1).reshape(rows, n)
    host_cpp.same_bytes(f"warp_hadamard n={n}", hd, transforms.hadamard(x))


@pytest.mark.parametrize("preset", ["dsv4-ref", "aiter", "vllm-v4", "sglang-c4"])
def test_compress_kv_presets(ops, emu, preset):
    from dsaquant.compress import PRESETS
    p = dict(PRESETS[preset])
    mode = "fp8" if preset == "vllm-v4" else "fp4"
    case = dict(quant_mode=mode, bf16_after=p.pop("bf16_after"), dtype=BF16 if preset in ("aiter", "vllm-v4") else F32,
                starts=(0, 7), lens=(17, 9), **{k: v for k, v in p.items() if k in ("hadamard", "scale_rule", "rounding",
                                                                                   "layout", "scale_fmt", "preshuffle")})
    outs_e, flag_e, outs_r, flag_r = _run_compress(ops, emu, case, 0)
    for k in outs_r:
        if outs_r[k] is not None:
            host_cpp.same_bytes(f"{preset} {k}", outs_e[k], outs_r[k])
    assert flag_e == flag_r


# ------------------------------------------------------------------------------------------------
# SPEC §7.7 rope_rotate_quant
# ------------------------------------------------------------------------------------------------
ROTATE = {  # name -> (x dtype, out dtype, shuffle_scale, group (None: D), rounding)
    "fp4_shuffled_hw": (BF16, torch.uint8, True, 32, "hardware"),
    "fp4_dense_rne_g16": (BF16, torch.uint8, False, 16, "rne"),
    "fp4_dense_gD_f32": (F32, torch.uint8, False, None, "hardware"),
    "fp8_fn_g128": (BF16, torch.float8_e4m3fn, False, 128, "hardware"),
    "fp8_fnuz_g16": (BF16, torch.float8_e4m3fnuz, False, 16, "hardware"),
    "fp8_fn_gD_f32": (F32, torch.float8_e4m3fn, False, None, "hardware"),
    "bf16_inplace": (BF16, "alias", True, 0, "hardware"),
    "fp16": (F16, F16, True, 0, "hardware"),
    "bf16_strided_out": (BF16, "strided", True, 0, "hardware"),
}
if hasattr(torch, "float4_e2m1fn_x2"):                 # torch >= 2.8
    ROTATE["fp4x2_threshold_g64"] = (F16, torch.float4_e2m1fn_x2, False, 64, "threshold")


def rotate_case(kind, D, had, H=16, T=3, seed=0, max_pos=64, group=False, misaligned=False, pos_dtype=torch.int64,
                cs_dtype=None):
    """(outputs, positional args of the reference signature) of ROTATE[kind], built afresh from `seed`. group: a
    group size instead of the kind's; misaligned: x, out and (half) out's rows off 16-byte boundaries (the kernels'
    scalar loads and byte stores); cs_dtype: the RoPE tables' dtype (default: x's, fp32 for fp32 x)."""
    xdt, odt, shuffle, group_, rounding = ROTATE[kind]
    group_ = group if group is not False else group_
    g = torch.Generator().manual_seed(seed)
    pad = 9 if misaligned else 8            # x's rows start `pad` elements into wider rows
    x = torch.randn(T, H, D + pad, generator=g) * 2.0
    x[..., pad:pad + 128] = tt.special_rows(x[..., pad:pad + 128].reshape(T * H, 128)).reshape(T, H, 128)
    x = x.to(xdt)[..., pad:]                # strided rows, last dim contiguous
    cos, sin, _ = tt.rope_tables(max_pos, "cpu", cs_dtype or (F32 if xdt == F32 else xdt))
    pos = torch.tensor([5, max_pos + 2, -3][:T] + [(7 * t) % max_pos for t in range(3, T)], dtype=pos_dtype)
    g_ = group_ if group_ is not None else D
    out_scale = None

    def dense(shape, dtype):                # a poisoned tensor, one byte off alignment when misaligned
        if not misaligned:
            return tt.poisoned(shape, dtype, "cpu")
        n = 1
        for d in shape:
            n *= d
        es = torch.empty(0, dtype=dtype).element_size()
        return tt.poisoned((n * es + 1,), torch.uint8, "cpu")[1:].view(dtype).view(shape)

    if odt == "alias":
        out, g_ = x, 0
    elif odt == "strided":
        out, g_ = tt.poisoned((T, H, D, 2), xdt, "cpu")[..., 0], 0
    elif odt in (F16, BF16):
        out = tt.poisoned((T, H, D + 1), odt, "cpu")[..., 1:] if misaligned else tt.poisoned((T, H, D), odt, "cpu")
        g_ = 0
    elif odt in rc.FP8_OUT_DTYPES:
        out = dense((T, H, D), odt)
        out_scale = tt.poisoned((T, H, D // g_), F32, "cpu")
    else:
        out = dense((T, H, D // 2), torch.uint8).view(odt)
        out_scale = (tt.poisoned((T, D // 128, 4, 16, (H // 16 + 3) // 4 * 4), torch.uint8, "cpu") if shuffle
                     else tt.poisoned((T, H, D // g_), torch.uint8, "cpu"))
    args = (out, x, cos, sin, pos, 64, out_scale, g_, shuffle, had, rounding)
    return (out, out_scale, x), args


def _rotate_values(D: int):
    """The values a lane the emulator runs rope_rotate_quant with, for D: every instance the kernels have
    (16 .. 128, at most 32 lanes a row)."""
    return [v for v in (16, 32, 64, 128) if D // v <= 32]


ROTATE_DV = [(D, v) for D in (128, 256, 512, 1024) for v in _rotate_values(D)]


def _run_rotate(ops, emu, kind, D, had, v, order=0, **kw):
    emu.set_rotate_v(v)
    emu.set_block_order(order, 5)
    host_cpp.take_flag()
    try:
        outs_e, args_e = rotate_case(kind, D, had, **kw)
        ops["rope_rotate_quant"](*args_e)
    finally:
        emu.set_rotate_v(0)
    flag_e = host_cpp.take_flag()
    outs_r, args_r = rotate_case(kind, D, had, **kw)
    rc.rope_rotate_quant(*args_r)
    flag_r = host_cpp.take_flag()
    for name, e, r in zip(("out", "out_scale", "x"), outs_e, outs_r):
        if r is not None:
            host_cpp.same_bytes(f"{kind} D={D} V={v} had={had} {kw} {name}", e, r)
    assert flag_e == flag_r == errors.POSITION_OUT_OF_RANGE, (flag_e, flag_r)


@pytest.mark.parametrize("had", [True, False])
@pytest.mark.parametrize("D,v", ROTATE_DV)
@pytest.mark.parametrize("kind", list(ROTATE))
def test_rope_rotate_quant(ops, emu, kind, D, v, had):
    """Every output kind at every D and every values-a-lane instance (lanes a row: D/v, Hadamard exchanges between
    lanes: log2(D/v)), the Hadamard on and off."""
    H = 32 if kind == "fp4_shuffled_hw" and D == 256 else 16
    _run_rotate(ops, emu, kind, D, had, v, order=1 if had else 0, H=H)


# The kernels' other paths: rows off 16-byte boundaries (scalar loads, byte stores); few heads (the RoPE table read
# per row: more tokens in a block than the shared table holds) and many (a token's rows over several blocks, pad-free
# shuffled scales); several blocks in any order; every chunk size of the group amax and groups spanning lanes and
# both runs of a lane; int32 positions; fp32 / fp16 RoPE tables; fp16 and fp32 inputs.
ROTATE_PATHS = {
    "misaligned_fp4": dict(kind="fp4_shuffled_hw", misaligned=True),
    "misaligned_fp8": dict(kind="fp8_fn_g128", misaligned=True),
    "misaligned_half": dict(kind="fp16", misaligned=True),
    "misaligned_f32_fp4": dict(kind="fp4_dense_gD_f32", misaligned=True, group=32),
    "h1_direct_rope": dict(kind="fp4_dense_rne_g16", H=1, T=40),
    "h4_direct_rope": dict(kind="fp8_fnuz_g16", H=4, T=33),
    "h8_fp4": dict(kind="fp4_dense_rne_g16", H=8, T=20, group=64, pos_dtype=torch.int32),
    "h64_shuffled": dict(kind="fp4_shuffled_hw", H=64, T=5, cs_dtype=F32),
    "h32_blocks_shuffled": dict(kind="fp4_shuffled_hw", H=32, T=12, order=2, cs_dtype=F16),
    "h16_many_blocks": dict(kind="bf16_inplace", H=16, T=40, order=1),
    "fp4_g32_dense": dict(kind="fp4_dense_rne_g16", group=32),
    "fp4_g64": dict(kind="fp4x2_threshold_g64" if "fp4x2_threshold_g64" in ROTATE else "fp4_dense_rne_g16", group=64),
    "fp4_g128_256": dict(kind="fp4_dense_gD_f32", group=128, D=256),
    "fp4_g256_f32": dict(kind="fp4_dense_gD_f32", group=256, D=256),
    "fp8_g32": dict(kind="fp8_fnuz_g16", group=32),
    "fp8_g64_f32": dict(kind="fp8_fn_gD_f32", group=64),
    "fp8_gD_512": dict(kind="fp8_fn_g128", group=None, D=512),
    "fp4_g512_1024": dict(kind="fp4_dense_gD_f32", group=512, D=1024),
    "half_strided_h2": dict(kind="bf16_strided_out", H=2, T=9),
}


@pytest.mark.parametrize("had", [True, False])
@pytest.mark.parametrize("name", list(ROTATE_PATHS))
def test_rope_rotate_quant_paths(ops, emu, name, had):
    """Each of ROTATE_PATHS at every values-a-lane instance of its D (default 128)."""
    case = dict(ROTATE_PATHS[name])
    kind, D, order = case.pop("kind"), case.pop("D", 128), case.pop("order", 0)
    for v in _rotate_values(D):
        _run_rotate(ops, emu, kind, D, had, v, order=order, **case)


def test_rope_rotate_quant_launch_choice(ops, emu):
    """The launcher's own choice of values a lane (rot::rotate_values_per_lane) on a call large enough for the
    large instance (DSQ_ROTATE_LARGE_UNITS = 32768 rows of 128 at D = 128), and on a small one."""
    for kind in ("fp4_shuffled_hw", "fp8_fnuz_g16"):
        _run_rotate(ops, emu, kind, 128, True, 0, H=64, T=512, max_pos=600)
        _run_rotate(ops, emu, kind, 128, True, 0, H=16, T=3)


# ------------------------------------------------------------------------------------------------
# The compiled library takes the glue's argument structs and fails at the launch (no GPU here)
# ------------------------------------------------------------------------------------------------
CUDA_LIB = REPO / "python" / "dsaquant" / "libdsaquant_cuda.so"


@pytest.mark.skipif(not CUDA_LIB.is_file(), reason="libdsaquant_cuda.so not built here")
@pytest.mark.skipif(torch.cuda.is_available(), reason="drives the library with CPU pointers: only where no GPU exists")
def test_cuda_library_rejects_the_launch_without_a_gpu():
    """On a machine without a GPU, libdsaquant_cuda.so takes the structs the glue fills and returns the runtime's
    error when it tries to make the device current, before touching any pointer; the glue raises RuntimeError."""
    cops = make_ops(Library(str(CUDA_LIB)))
    _, args = compress_case(quant_mode="fp4")
    with pytest.raises(RuntimeError, match="launching compress_kv failed: error [1-9]"):
        cops["compress_kv"](*args)
    _, args = rotate_case("fp4_shuffled_hw", 128, True)
    with pytest.raises(RuntimeError, match="launching rope_rotate_quant failed: error [1-9]"):
        cops["rope_rotate_quant"](*args)

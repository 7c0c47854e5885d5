"""The DeepSeek-V4 ops (SPEC §7.6 compress_kv, §7.7 rope_rotate_quant) on a GPU: every backend that implements
them ("triton", "cuda") against the reference on the same CUDA tensors, byte for byte (skipped without CUDA).

Each case builds its inputs once (testing.make_compress_kv / make_rope_rotate_quant: poisoned caches and
outputs, random rings), runs the public op with backend="reference" and with each backend on clones, and
compares every byte of every tensor argument (cache, cache scales, both ring tensors, untouched inputs) and
the device error flag. Backends are those among ("triton", "cuda") whose dispatch.ops_of() lists the op, so the
file works before and after a backend gains the op; "triton-soft" is the triton backend with its software
conversions (DSAQUANT_TRITON_NATIVE=0, the interpreter's path), run on a small subset. Byte counts per
(backend, op) go into the closing table (tests/gpu/counts.py).

Grid, chosen to keep the Triton compile count small (each constexpr setting is one compile):
- compress_kv, ratio 4 (K = 8, decode-sized launch): each quant mode and layout once (none, fp4 packed68
  rne/recip and threshold/pack, fp4 aiter_fp4 hardware, fp4_sim recip and pack, fp8 e4m3fn ue8m0 preshuffled,
  fp8 e4m3fnuz fp32 scales), batch sizes 1..8 with ragged lengths (sequence 0 shorter than one window, empty
  sequences, prompts from 0 and continuations reading the ring), bf16 and fp32 inputs, Hadamard and rounding
  points varied, negative out_slots, update_state on and off; ratio 4 prefill-sized (the blocked launch);
  ratio 4 without overlap (K = 4); ratio 128 (K = 128) in five modes incl. D = 512; ratio 128 with overlap
  (K = 256); special values; out-of-range slots, ring slots and positions (the error flags);
- chunking invariance per backend: one sequence fed whole, in random chunks and token by token (ratio 4 and
  128) gives the reference's bytes;
- exp_ds (SPEC §0.7): the golden vectors through the reference on the CUDA device and through the Triton
  exp_ds, plus 2^20 points of [-104, 0] against the CPU reference;
- the pool's shared-reciprocal division (dsq::pool_weights) against the correctly rounded division over every
  dividend of [2^-100, 2) for 412 divisors;
- rope_rotate_quant: every output dtype (FP4 shuffled/dense, FP8 both flavours, bf16/fp16, in place),
  D in {128, 256, 512, 1024}, T in {1, 5, 300}, H in {16, 64}.
"""
from __future__ import annotations

import zlib

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA (or ROCm) GPU", allow_module_level=True)

import dsaquant as dq  # noqa: E402
from dsaquant import dispatch, errors, testing as tt  # noqa: E402

from .counts import byte_diff, record  # noqa: E402

DEV = torch.device("cuda")
CANDIDATES = ("triton", "cuda")


def backends_for(op: str, soft: bool = False) -> list:
    """Backends among CANDIDATES that implement `op` here (plus "triton-soft" when `soft` and triton does)."""
    out = [b for b in CANDIDATES if dispatch.available(b)[0] and op in dispatch.ops_of(b)]
    if soft and "triton" in out:
        out.append("triton-soft")
    return out


class backend_ctx:
    """'triton-soft': the triton backend with DSAQUANT_TRITON_NATIVE=0 / DSAQUANT_TRITON_HW_FP8=0 semantics."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        if self.name == "triton-soft":
            from dsaquant.triton import quant
            self.quant = quant
            self.saved = (quant.NATIVE_ENABLED, quant.HW_FP8_ENABLED)
            quant.NATIVE_ENABLED = False
            quant.HW_FP8_ENABLED = False
        return "triton" if self.name == "triton-soft" else self.name

    def __exit__(self, *exc):
        if self.name == "triton-soft":
            self.quant.NATIVE_ENABLED, self.quant.HW_FP8_ENABLED = self.saved


clone_args = tt.clone_args


def _flag() -> int:
    torch.cuda.synchronize()
    f = errors.flag_tensor(DEV)
    v = int(f.item())
    f.zero_()
    return v


def compare(op: str, backend: str, label: str, pairs, flags=None):
    """Byte-compare (name, reference tensor, backend tensor) pairs; record the counts; assert equality (and
    equal error flags when given as (reference, backend))."""
    total, bad, where = byte_diff(pairs)
    record(backend, op, total, bad)
    assert bad == 0, f"{backend} {op} {label}: {bad} of {total} bytes differ: " + "; ".join(where)
    if flags is not None:
        assert flags[0] == flags[1], f"{backend} {op} {label}: device error flag {flags[1]}, reference {flags[0]}"


def run_all(op: str, fn, args: dict, label: str, backends, want_flag=None):
    """fn(**clone, backend=...) for the reference and each backend; compare all tensor arguments and flags."""
    _flag()
    ref = clone_args(args)
    fn(**ref, backend="reference")
    ref_flag = _flag()
    if want_flag is not None:
        assert ref_flag == want_flag, f"reference {op} {label}: error flag {ref_flag}, expected {want_flag}"
    for b in backends:
        got = clone_args(args)
        with backend_ctx(b) as name:
            fn(**got, backend=name)
        flag = _flag()
        compare(op, b, label, [(k, ref[k], got[k]) for k in args if isinstance(args[k], torch.Tensor)],
                (ref_flag, flag))


# ---- §7.6 compress_kv -------------------------------------------------------------------------------------
R4_MODES = [
    ("none", dict(quant_mode="none")),
    ("fp4_p68_rne", dict(quant_mode="fp4")),
    ("fp4_p68_pack_thr", dict(quant_mode="fp4", scale_rule="pack", rounding="threshold")),
    ("fp4_aiter_hw", dict(quant_mode="fp4", layout="aiter_fp4", rounding="hardware")),
    ("fp4_sim", dict(quant_mode="fp4_sim")),
    ("fp4_sim_pack", dict(quant_mode="fp4_sim", scale_rule="pack")),
    ("fp8_ue8m0_presh", dict(quant_mode="fp8", preshuffle=True)),
    ("fp8_fnuz_fp32", dict(quant_mode="fp8", fp8_flavour="e4m3fnuz", scale_fmt=None)),
]
POINTS = (("pool", "norm", "rope"), (), ("rope",), ("pool", "norm", "rope", "hadamard"), ("norm",))


def _ragged(B: int, ratio: int, seed: int, max_len: int, max_start: int):
    """Starts and lengths of B sequences: sequence 0 shorter than one window, one empty sequence (B > 2), one
    prompt from position 0 (B > 1)."""
    g = torch.Generator().manual_seed(seed)
    starts = [int(x) for x in torch.randint(0, max_start, (B,), generator=g)]
    lens = [int(x) for x in torch.randint(1, max_len, (B,), generator=g)]
    lens[0] = min(lens[0], ratio - 1)
    if B > 1:
        starts[1] = 0
    if B > 2:
        lens[2] = 0
    return tuple(starts), tuple(lens)


def compress_cases():
    cases = []
    for i, (name, knobs) in enumerate(R4_MODES):          # ratio 4, K = 8: batch 1..8
        B = i + 1
        starts, lens = _ragged(B, 4, 10 + i, 40, 60)
        cases.append(dict(name=f"r4-{name}-B{B}", ratio=4, starts=starts, lens=lens, knobs=knobs,
                          dtype=torch.bfloat16 if i % 2 else torch.float32, hadamard=i % 3 == 0,
                          points=POINTS[i % len(POINTS)] if i % 3 else POINTS[3], update=i % 4 != 1, soft=i in (1, 6)))
    cases += [
        dict(name="r4-fp4_p68_rne-prefill-blocked", ratio=4, starts=(0, 7, 3), lens=(3000, 1100, 2),
             knobs=R4_MODES[1][1], dtype=torch.bfloat16),
        dict(name="r4-fp8_ue8m0_presh-prefill-blocked-noupdate", ratio=4, starts=(0, 2), lens=(2500, 3),
             knobs=R4_MODES[6][1], dtype=torch.float32, update=False, hadamard=True),
        dict(name="r4o0-fp4_p68_hw-B5", ratio=4, overlap=False, starts=(1, 0, 6, 9, 2), lens=(3, 40, 0, 17, 9),
             knobs=dict(quant_mode="fp4", rounding="hardware"), dtype=torch.bfloat16),
        dict(name="r4-none-D512-B4-freqs", ratio=4, D=512, starts=(0, 5, 10, 3), lens=(3, 30, 7, 60), knobs={},
             dtype=torch.bfloat16, use_freqs=True),
        dict(name="r128-fp4_p68_rne-B2", ratio=128, starts=(100, 0), lens=(200, 300), knobs=R4_MODES[1][1],
             dtype=torch.bfloat16),
        dict(name="r128-fp8_ue8m0_presh-B3", ratio=128, starts=(120, 250, 0), lens=(10, 8, 400), knobs=R4_MODES[6][1],
             dtype=torch.float32, hadamard=True, points=POINTS[3]),
        dict(name="r128-none-D512-B4", ratio=128, D=512, starts=(200, 0, 60, 127), lens=(60, 300, 0, 1), knobs={},
             dtype=torch.bfloat16, update=False),
        dict(name="r128-fp4_aiter_hw-B6", ratio=128, starts=(0, 127, 5, 90, 300, 2), lens=(100, 1, 260, 38, 0, 255),
             knobs=R4_MODES[3][1], dtype=torch.float32, points=()),
        dict(name="r128-fp4_sim_pack-B2-fp16tables", ratio=128, starts=(0, 64), lens=(128, 200), knobs=R4_MODES[5][1],
             dtype=torch.bfloat16, cs_dtype=torch.float16, nw_dtype=torch.bfloat16),
        dict(name="r128o1-none-B2", ratio=128, overlap=True, starts=(200, 0), lens=(60, 300), knobs={},
             dtype=torch.bfloat16),
        dict(name="r4-special-fp4_p68_rne-bf16", ratio=4, starts=(5, 0, 17), lens=(30, 9, 14), knobs=R4_MODES[1][1],
             dtype=torch.bfloat16, special=True, score_scale=40.0),
        dict(name="r4-special-fp8", ratio=4, starts=(5, 0, 17), lens=(30, 9, 14), knobs=R4_MODES[6][1],
             dtype=torch.float32, special=True, score_scale=30.0, soft=True),
        dict(name="r4-oob-slot-bad-ring", ratio=4, starts=(5, 0, 17), lens=(30, 9, 14), knobs=R4_MODES[1][1],
             dtype=torch.bfloat16, oob=True, bad_ring=True),
        dict(name="r4-position-past-table-strided", ratio=4, starts=(0, 2), lens=(16, 9), knobs={},
             dtype=torch.float32, max_pos=6, strided=True),
    ]
    return cases


def _capacity(a):
    c = a["cache"]
    if c.dim() == 5:
        return c.shape[0] * c.shape[3]
    if c.dim() == 3:
        return c.shape[0] * c.shape[1]
    return c.shape[0] * c.shape[1] // (68 if a["quant_mode"] == "fp4" else 132)


def build_compress(c):
    kw = dict(c["knobs"])
    a = tt.make_compress_kv(starts=c["starts"], lens=c["lens"], ratio=c["ratio"], overlap=c.get("overlap"),
                            D=c.get("D", 128), device=DEV, seed=zlib.crc32(c["name"].encode()) % 1000, dtype=c["dtype"],
                            hadamard=c.get("hadamard", False), bf16_after=c.get("points", POINTS[0]),
                            update_state=c.get("update", True), score_scale=c.get("score_scale", 1.0),
                            cs_dtype=c.get("cs_dtype", torch.bfloat16), use_freqs=c.get("use_freqs", False),
                            nw_dtype=c.get("nw_dtype", torch.float32), max_pos=c.get("max_pos", 4096), **kw)
    want = 0
    bnd = tt.compress_boundaries(c["starts"], c["lens"], c["ratio"])
    if c.get("special"):
        a = tt.compress_special_values(a, c["lens"][0])
    if c.get("strided"):
        kv, sc = a["kv"], a["score"]
        big = torch.empty(kv.shape[0], 2 * kv.shape[1], dtype=kv.dtype, device=DEV)
        big[:, : kv.shape[1]], big[:, kv.shape[1]:] = kv, sc
        a["kv"], a["score"] = big[:, : kv.shape[1]], big[:, kv.shape[1]:]
    if c.get("oob"):
        a["out_slots"][bnd[-1][0]] = _capacity(a) + 3
        want |= errors.SLOT_OUT_OF_RANGE
    if c.get("bad_ring"):
        a["state_slot"][1] = a["state_kv"].shape[0] + 2
        want |= errors.SLOT_OUT_OF_RANGE
    if any(p + 1 - c["ratio"] >= c.get("max_pos", 4096) for _, _, p in bnd):
        want |= errors.POSITION_OUT_OF_RANGE
    return a, want


@pytest.mark.parametrize("c", compress_cases(), ids=lambda c: c["name"])
def test_compress_kv(c):
    bes = backends_for("compress_kv", soft=c.get("soft", False))
    if not bes:
        pytest.skip("no GPU backend implements compress_kv here")
    a, want = build_compress(c)
    run_all("compress_kv", dq.compress_kv, a, c["name"], bes, want)


def _feed(a, chunks, backend):
    """One sequence of `a` (positions from 0) fed in chunks; returns the cache, cache_scale and ring."""
    b = clone_args(a)
    pos = 0
    for n in chunks:
        b.update(kv=a["kv"][pos:pos + n], score=a["score"][pos:pos + n], out_slots=a["out_slots"][pos:pos + n],
                 cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=DEV),
                 start_pos=torch.tensor([pos], device=DEV))
        with backend_ctx(backend) as name:
            dq.compress_kv(**b, backend=name)
        pos += n
    return b


@pytest.mark.parametrize("ratio,L,knobs,dtype", [
    (4, 203, R4_MODES[1][1], torch.bfloat16),
    (4, 97, R4_MODES[3][1], torch.float32),
    (128, 300, R4_MODES[6][1], torch.bfloat16),
], ids=["r4-fp4_p68", "r4-fp4_aiter-f32", "r128-fp8"])
def test_compress_kv_chunking_invariance(ratio, L, knobs, dtype):
    bes = backends_for("compress_kv")
    if not bes:
        pytest.skip("no GPU backend implements compress_kv here")
    a = tt.make_compress_kv(starts=(0,), lens=(L,), ratio=ratio, device=DEV, seed=L, dtype=dtype, negatives=False,
                            **knobs)
    K = ratio * (2 if a["overlap"] else 1)
    g = torch.Generator().manual_seed(L)
    chunks = []
    while sum(chunks) < L:
        chunks.append(min(int(torch.randint(1, 2 * K + 4, (1,), generator=g)), L - sum(chunks)))
    R = a["state_kv"].shape[1]
    rows = torch.tensor([q % R for q in range(L - K, L)], device=DEV)
    slot = int(a["state_slot"][0])
    ref = _feed(a, [L], "reference")
    for b in bes:
        for how, ch in (("whole", [L]), ("chunks", chunks), ("tokens", [1] * L)):
            got = _feed(a, ch, b)
            pairs = [("cache", ref["cache"], got["cache"]),
                     ("ring kv", ref["state_kv"][slot, rows], got["state_kv"][slot, rows]),
                     ("ring score", ref["state_score"][slot, rows], got["state_score"][slot, rows])]
            if ref["cache_scale"] is not None:
                pairs.append(("cache_scale", ref["cache_scale"], got["cache_scale"]))
            compare("compress_kv (chunking)", b, f"ratio {ratio} L {L} {how}", pairs)
    _flag()


# ---- §0.7 exp_ds ------------------------------------------------------------------------------------------
EXP_DS_GOLDEN = [(0.0, 0x3F800000), (-0.5, 0x3F1B4598), (-1.0, 0x3EBC5AB2), (-2.0, 0x3E0A9555),
                 (-10.0, 0x383E6BCE), (-87.0, 0x00B33687), (-100.0, 0x0000001B), (-103.0, 0x00000001),
                 (-104.0, 0x00000000), (float("-inf"), 0x00000000)]


def _golden():
    x = torch.tensor([g[0] for g in EXP_DS_GOLDEN], dtype=torch.float32)
    want = torch.tensor([g[1] for g in EXP_DS_GOLDEN], dtype=torch.int64).to(torch.int32)
    return x, want


def test_exp_ds_golden_reference_on_gpu():
    from dsaquant.reference.arith import exp_ds
    x, want = _golden()
    got = exp_ds(x.to(DEV)).cpu().view(torch.int32)
    record("reference", "exp_ds (golden)", 4 * x.numel(), 4 * int((got != want).sum()))
    assert torch.equal(got, want), [(float(v), hex(int(a)), hex(int(b))) for v, a, b in zip(x, got, want) if a != b]


def test_exp_ds_cuda_on_gpu():
    """The shared header's exp_ds (the cuda backend's) on the GPU: golden vectors and 2^20 points of [-104, 0]."""
    if not dispatch.available("cuda")[0]:
        pytest.skip(dispatch.available("cuda")[1])
    from dsaquant.backends.abi import DsqExpDsArgs
    from dsaquant.backends.compiled import library
    from dsaquant.reference.arith import exp_ds
    lib = library("cuda")
    x, want = _golden()
    g = torch.Generator().manual_seed(1)
    xs = torch.cat([x, -torch.rand(1 << 20, generator=g) * 104,
                    torch.tensor([0.0, -0.0, -1e-45, -110.0, -1e30, float("inf"), float("nan")])]).to(DEV)
    out = torch.empty_like(xs)
    lib.launch("exp_ds", DsqExpDsArgs(device=xs.device.index, x=xs.data_ptr(), y=out.data_ptr(), n=xs.numel()),
               torch.cuda.current_stream().cuda_stream)
    got = out.cpu().view(torch.int32)
    ref = exp_ds(xs.cpu()).view(torch.int32)
    bad = int((got[: x.numel()] != want).sum()) + int((got != ref).sum())
    record("cuda", "exp_ds", 4 * (x.numel() + xs.numel()), 4 * bad)
    assert bad == 0


def test_pool_weights_fast_path(tmp_path):
    """The pool's shared-reciprocal division (dsq::pool_weights, the compress kernels' fl(e/S)) against the
    correctly rounded division, on the GPU: every fp32 e in [2^-100, 2) and 0 for 412 divisors S of [1, 256]
    (tests/cpp/pool_div_check.cu, built here with the library's nvcc flags)."""
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(repo / "tools"))
    import build_native as bn
    nvcc = bn.find_nvcc()
    if nvcc is None or torch.version.cuda is None:
        pytest.skip("needs nvcc and a CUDA GPU")
    major, minor = torch.cuda.get_device_capability()
    exe = tmp_path / "pool_div_check"
    subprocess.run([nvcc, "-std=c++17", "-O3", "--fmad=false", f"-I{repo / 'src/include'}",
                    f"-arch=sm_{major}{minor}", str(repo / "tests/cpp/pool_div_check.cu"), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    print(out.stdout)
    assert out.returncode == 0 and out.stdout.startswith("mismatches 0 of "), out.stdout + out.stderr


if dispatch.available("triton")[0]:
    import triton
    import triton.language as tl
    from dsaquant.triton import formats as F

    @triton.jit
    def _exp_ds_kernel(x_ptr, o_ptr, n, B: tl.constexpr):
        offs = tl.program_id(0) * B + tl.arange(0, B)
        m = offs < n
        tl.store(o_ptr + offs, F.exp_ds(tl.load(x_ptr + offs, mask=m, other=0.0)), mask=m)


def test_exp_ds_triton_on_gpu():
    if not dispatch.available("triton")[0]:
        pytest.skip(dispatch.available("triton")[1])
    from dsaquant.reference.arith import exp_ds
    x, want = _golden()
    g = torch.Generator().manual_seed(0)
    dense = -torch.rand(1 << 20, generator=g) * 104
    specials = torch.tensor([0.0, -0.0, -1e-45, -87.33654, -103.97208, -110.0, -1e30, float("inf"), float("nan")])
    xs = torch.cat([x, dense, specials])
    out = torch.empty(xs.numel(), dtype=torch.float32, device=DEV)
    _exp_ds_kernel[(triton.cdiv(xs.numel(), 1024),)](xs.to(DEV), out, xs.numel(), B=1024, enable_fp_fusion=False)
    got = out.cpu().view(torch.int32)
    ref = exp_ds(xs).view(torch.int32)
    bad = int((got[: x.numel()] != want).sum()) + int((got != ref).sum())
    record("triton", "exp_ds", 4 * (x.numel() + xs.numel()), 4 * bad)
    assert torch.equal(got[: x.numel()], want), [hex(int(v)) for v in got[: x.numel()]]
    diff = (got != ref).nonzero().reshape(-1)[:5].tolist()
    assert not diff, [(float(xs[i]), hex(int(got[i])), hex(int(ref[i]))) for i in diff]


# ---- §7.7 rope_rotate_quant -------------------------------------------------------------------------------
def rope_cases():
    cases = []
    for i, (out, D, kw) in enumerate([
            ("fp4", 128, dict(H=16)), ("fp4", 256, dict(H=64, rounding="rne")),
            ("fp4", 1024, dict(H=16, rounding="threshold", hadamard=False)),
            ("fp4", 512, dict(H=16, shuffle_scale=False, group_size=16)),
            ("fp4x2", 128, dict(H=64, dtype=torch.float16)),
            ("e4m3fn", 128, dict(H=16)), ("e4m3fn", 512, dict(H=16, group_size=64, dtype=torch.float32)),
            ("e4m3fnuz", 1024, dict(H=16, group_size=1024, hadamard=False)),
            ("half", 128, dict(H=64)), ("half", 256, dict(H=16, dtype=torch.float16, hadamard=False)),
            ("half", 1024, dict(H=16, inplace=True)),
            ("fp4", 128, dict(H=128))]):   # T = 300: 38400 rows, the launcher's large instance (64 values a lane)
        for T in (1, 5, 300):
            cases.append(dict(name=f"{out}-D{D}-T{T}-{i}", out=out, D=D, T=T, soft=(i in (0, 5) and T == 5), **kw))
    return cases


@pytest.mark.parametrize("c", rope_cases(), ids=lambda c: c["name"])
def test_rope_rotate_quant(c):
    bes = backends_for("rope_rotate_quant", soft=c.get("soft", False))
    if not bes:
        pytest.skip("no GPU backend implements rope_rotate_quant here")
    kw = {k: v for k, v in c.items() if k not in ("name", "soft", "inplace")}
    a = tt.make_rope_rotate_quant(device=DEV, seed=c["T"] + c["D"], **kw)
    if c["D"] == 128:
        a["x"] = tt.special_rows(a["x"], c["T"])
    if c["T"] >= 5:
        a["positions"][1], a["positions"][3] = -3, 10 ** 6          # clamped and flagged
    if c.get("inplace"):
        a["out"] = a["x"]
        _flag()
        ref = clone_args(a)
        ref["out"] = ref["x"]
        dq.rope_rotate_quant(**ref, backend="reference")
        ref_flag = _flag()
        for b in bes:
            got = clone_args(a)
            got["out"] = got["x"]
            with backend_ctx(b) as name:
                dq.rope_rotate_quant(**got, backend=name)
            compare("rope_rotate_quant", b, c["name"] + " in place", [("x", ref["x"], got["x"])], (ref_flag, _flag()))
        return
    run_all("rope_rotate_quant", dq.rope_rotate_quant, a, c["name"], bes)

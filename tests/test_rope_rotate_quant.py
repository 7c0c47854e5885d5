"""SPEC §7.7 rope_rotate_quant (compat: aiter `rope_rotate_activation`) on the CPU reference backend.

Every output dtype (FP4 as uint8 or float4_e2m1fn_x2 with shuffled or dense scales, FP8 e4m3fn/e4m3fnuz,
bf16/fp16 including in place), Hadamard on/off, D in {128, 256, 512, 1024}, against a numpy.float32 oracle
written here from the SPEC (FP8 codes through torch's own float8 casts, not dsaquant's encoder); a hand-checked
case; rejection of every other dtype and of missing or misshapen scales with nothing written.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import dsaquant
from dsaquant import testing as tt
from dsaquant import compress
from dsaquant.reference.compress import FP4_OUT_DTYPES

POISON = 0xA5
F = np.float32
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}


# ------------------------------------------------------------------------------------------------
# numpy.float32 oracle (SPEC §1-§5, §7.7)
# ------------------------------------------------------------------------------------------------
def bits(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def pow2(e) -> np.ndarray:
    return (np.asarray(e, dtype=np.int64).astype(np.uint32) << 23).view(np.float32)


def bf16_bits(a) -> np.ndarray:
    b = bits(a).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def fp16_bits(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).astype(np.float16).view(np.uint16)


def np_rope_hadamard(x, cos_t, sin_t, pos, had) -> np.ndarray:
    """Tail interleaved RoPE (fp32, not rounded), then the Sylvester Hadamard times fl(D^-0.5)."""
    x = np.array(x, dtype=F)
    T, H, D = x.shape
    p = np.clip(pos, 0, cos_t.shape[0] - 1)
    c, s = cos_t[p][:, None, :], sin_t[p][:, None, :]
    ia, ib = np.arange(D - 64, D, 2), np.arange(D - 63, D, 2)
    a, b = x[..., ia].copy(), x[..., ib].copy()
    x[..., ia] = a * c - b * s
    x[..., ib] = b * c + a * s
    if had:
        h = 1
        while h < D:
            y = x.reshape(T, H, D // (2 * h), 2, h)
            u, v = y[..., 0, :].copy(), y[..., 1, :].copy()
            x = np.stack((u + v, u - v), axis=-2).reshape(T, H, D)
            h *= 2
        x = x * F(D ** -0.5)
    return x


def e2m1_codes(v, rounding) -> np.ndarray:
    v = np.asarray(v, dtype=np.float32)
    a = np.minimum(np.abs(v.astype(np.float64)), 7.0)
    d = np.abs(a[..., None] - GRID)
    cand = d == d.min(-1, keepdims=True)
    lo, hi = np.argmax(cand, -1), 7 - np.argmax(cand[..., ::-1], -1)
    m = (lo if rounding == "threshold" else np.where(lo % 2 == 0, lo, hi)).astype(np.uint8)
    sign = np.signbit(v) if rounding == "hardware" else (v < 0) & (m != 0)
    return m | (sign.astype(np.uint8) << 3)


def np_fp4(y, g, rounding):
    """(packed u8 [..., D/2], exponents u8 [..., D/g]) with rule recip."""
    yb = y.reshape(*y.shape[:-1], -1, g)
    f = np.maximum(np.abs(yb).max(-1), F(6 * 2.0 ** -126)) * np.array([0x3E2AAAAB], np.uint32).view(F)[0]
    b = bits(f).astype(np.int64)
    e = ((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0)
    codes = e2m1_codes(yb / pow2(e)[..., None], rounding).reshape(y.shape)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), e.astype(np.uint8)


def np_fp8(y, g, dtype):
    """(codes u8 [..., D], fp32 scales [..., D/g]): s = max(amax, 1e-10f) / fmax, codes of y * fl(1/s)."""
    yb = y.reshape(*y.shape[:-1], -1, g)
    s = np.maximum(np.abs(yb).max(-1), F(1e-10)) / F(FMAX[dtype])
    v = yb * (F(1) / s)[..., None]
    v = np.clip(v, -FMAX[dtype], FMAX[dtype]).astype(F).reshape(y.shape)
    return torch.from_numpy(v).to(dtype).view(torch.uint8).numpy(), s.astype(F)


def shuffled_scales(exps, H):
    """exps u8 [T, H, G] -> the §6 q-scale layout [T, G/4, 4, 16, qs_pad], pad entries 0 (literal indices)."""
    T, _, G = exps.shape
    qs = (H // 16 + 3) // 4 * 4
    out = np.zeros((T, G // 4, 4, 16, qs), dtype=np.uint8)
    for h in range(H):
        for g in range(G):
            out[:, g // 4, g % 4, h % 16, h // 16] = exps[:, h, g]
    return out


# ------------------------------------------------------------------------------------------------
# cases
# ------------------------------------------------------------------------------------------------
KINDS = {  # name -> (x dtype, out dtype, shuffle_scale, group_size, rounding)
    "fp4_shuffled": (torch.bfloat16, torch.uint8, True, None, "hardware"),
    "fp4_dense_rne": (torch.bfloat16, torch.uint8, False, None, "rne"),
    "fp4_dense_g16": (torch.bfloat16, torch.uint8, False, 16, "hardware"),
    "fp8_e4m3fn": (torch.bfloat16, torch.float8_e4m3fn, True, None, "hardware"),
    "fp8_e4m3fnuz_g64": (torch.bfloat16, torch.float8_e4m3fnuz, False, 64, "hardware"),
    "bf16": (torch.bfloat16, torch.bfloat16, True, None, "hardware"),
    "fp16": (torch.float16, torch.float16, True, None, "hardware"),
}
FP4X2 = getattr(torch, "float4_e2m1fn_x2", None)      # torch >= 2.8
if FP4X2 is not None:
    KINDS["fp4x2_dtype_threshold"] = (torch.float16, FP4X2, True, None, "threshold")


def make(kind, T=3, H=16, D=128, seed=0, max_pos=4096, scale=2.0):
    xdt, odt, shuffle, g, rounding = KINDS[kind]
    gen = torch.Generator().manual_seed(seed)
    cos, sin, _ = tt.rope_tables(max_pos, "cpu", xdt)
    x = (torch.randn(T, H, D, generator=gen) * scale).to(xdt)
    pos = torch.randint(0, max_pos, (T,), generator=gen)
    a = dict(x=x, cos_cache=cos, sin_cache=sin, positions=pos, shuffle_scale=shuffle, rounding=rounding)
    if g is not None:
        a["group_size"] = g
    if odt in FP4_OUT_DTYPES:
        a["out"] = tt.poisoned((T, H, D // 2), torch.uint8, "cpu").view(odt)
        gs = g or 32
        a["out_scale"] = (tt.poisoned((T, D // 128, 4, 16, (H // 16 + 3) // 4 * 4), torch.uint8, "cpu") if shuffle
                          else tt.poisoned((T, H, D // gs), torch.uint8, "cpu"))
    elif odt in FMAX:
        a["out"] = tt.poisoned((T, H, D), odt, "cpu")
        a["out_scale"] = tt.poisoned((T, H, D // (g or 128)), torch.float32, "cpu")
    else:
        a["out"] = tt.poisoned((T, H, D), odt, "cpu")
    return a


def u8(t) -> np.ndarray:
    return t.contiguous().view(torch.uint8).reshape(-1).numpy().copy()


def expected(a, had):
    x = a["x"].float().numpy()
    y = np_rope_hadamard(x, a["cos_cache"].float().numpy(), a["sin_cache"].float().numpy(), a["positions"].numpy(),
                         had)
    out = a["out"]
    H = x.shape[1]
    if out.dtype in FP4_OUT_DTYPES:
        payload, exps = np_fp4(y, a.get("group_size", 32), a["rounding"])
        return payload, shuffled_scales(exps, H) if a["shuffle_scale"] else exps
    if out.dtype in FMAX:
        codes, s = np_fp8(y, a.get("group_size", 128), out.dtype)
        return codes, s
    return (bf16_bits(y) if out.dtype == torch.bfloat16 else fp16_bits(y)), None


@pytest.mark.parametrize("had", [True, False])
@pytest.mark.parametrize("D", [128, 256, 512, 1024])
@pytest.mark.parametrize("kind", list(KINDS))
def test_vs_oracle(kind, D, had):
    shuffled = KINDS[kind][2] and KINDS[kind][1] in FP4_OUT_DTYPES
    a = make(kind, D=D, H=16 if shuffled else 4, seed=D + had)
    want, want_scale = expected(a, had)
    compress.rope_rotate_quant(hadamard=had, **a)
    dsaquant.check_errors()
    assert np.array_equal(u8(a["out"]), want.reshape(-1).view(np.uint8))
    if want_scale is not None:
        assert np.array_equal(u8(a["out_scale"]), want_scale.reshape(-1).view(np.uint8))


def test_in_place_bf16_equals_out_of_place():
    a = make("bf16", D=256, H=8, seed=3)
    compress.rope_rotate_quant(**a)
    x = a["x"].clone()
    compress.rope_rotate_quant(**{**a, "out": x, "x": x})
    assert np.array_equal(u8(x), u8(a["out"]))


@pytest.mark.skipif(FP4X2 is None, reason="this torch has no float4_e2m1fn_x2 dtype")
def test_fp4x2_and_uint8_give_the_same_bytes():
    a = make("fp4_shuffled", D=512, seed=4)
    b = {**a, "out": a["out"].clone().view(FP4X2), "out_scale": a["out_scale"].clone()}
    compress.rope_rotate_quant(**a)
    compress.rope_rotate_quant(**b)
    assert np.array_equal(u8(a["out"]), u8(b["out"])) and np.array_equal(u8(a["out_scale"]), u8(b["out_scale"]))


def test_hand_case():
    """Position 0 (cos 1, sin 0: RoPE is the identity), no Hadamard.
    FP4, dense scales: block 0 = (0.5, -1, 3, 6, 0...) has amax 6, f = 6 * fl(1/6) rounds to 1.0, e = 127, so
    the codes are the values themselves: 0x1, 0xA, 0x5, 0x7 -> bytes 0xA1, 0x75. The all-zero blocks get e = 1.
    FP8 (e4m3fn, group 128): amax 448 -> s = 448/448 = 1; 1.0 -> 0x38, -2.0 -> 0xC0, 448 -> 0x7E, 0.5 -> 0x30.
    bf16 at position 1 with x[64] = 1 and the other rope dims 0: the pair (64, 65) becomes (cos, sin) of table
    row 1, column 0 (inverse frequency 1), as stored in bf16; the other pairs stay 0, dims 0..63 pass through."""
    cos, sin, _ = tt.rope_tables(8, "cpu", torch.bfloat16)
    x = torch.zeros(1, 1, 128, dtype=torch.bfloat16)
    x[0, 0, :4] = torch.tensor([0.5, -1.0, 3.0, 6.0])
    out = tt.poisoned((1, 1, 64), torch.uint8, "cpu")
    sc = tt.poisoned((1, 1, 4), torch.uint8, "cpu")
    compress.rope_rotate_quant(out, x, cos, sin, torch.tensor([0]), out_scale=sc, shuffle_scale=False, hadamard=False)
    assert out[0, 0, :2].tolist() == [0xA1, 0x75] and out[0, 0, 2:].eq(0).all()
    assert sc[0, 0].tolist() == [127, 1, 1, 1]

    x8 = torch.zeros(1, 1, 128, dtype=torch.bfloat16)
    x8[0, 0, :4] = torch.tensor([1.0, -2.0, 448.0, 0.5])
    o8 = tt.poisoned((1, 1, 128), torch.float8_e4m3fn, "cpu")
    s8 = tt.poisoned((1, 1, 1), torch.float32, "cpu")
    compress.rope_rotate_quant(o8, x8, cos, sin, torch.tensor([0]), out_scale=s8, hadamard=False)
    assert o8.view(torch.uint8)[0, 0, :4].tolist() == [0x38, 0xC0, 0x7E, 0x30] and s8.item() == 1.0

    xb = torch.full((1, 1, 128), 0.75, dtype=torch.bfloat16)
    xb[0, 0, 64:] = 0.0
    xb[0, 0, 64] = 1.0
    ob = tt.poisoned((1, 1, 128), torch.bfloat16, "cpu")
    compress.rope_rotate_quant(ob, xb, cos, sin, torch.tensor([1]), hadamard=False)
    assert ob[0, 0, 64] == cos[1, 0] and ob[0, 0, 65] == sin[1, 0]
    assert ob[0, 0, :64].eq(0.75).all() and ob[0, 0, 66:].eq(0).all()


def test_positions_out_of_range_clamped_and_reported():
    a = make("fp8_e4m3fn", max_pos=16, seed=5)
    a["positions"] = torch.tensor([-3, 7, 99])
    want, want_scale = expected(a, True)          # the oracle clamps into [0, max_pos)
    compress.rope_rotate_quant(**a)
    with pytest.raises(dsaquant.DsaquantError, match="position"):
        dsaquant.check_errors()
    assert np.array_equal(u8(a["out"]), want.reshape(-1).view(np.uint8))


# ------------------------------------------------------------------------------------------------
# rejection: every other dtype, missing or misshapen scales; nothing written
# ------------------------------------------------------------------------------------------------
def _set(**kw):
    return lambda a: {**a, **kw}


BAD = [
    ("out_fp32", "bf16", _set(out=tt.poisoned((3, 16, 128), torch.float32, "cpu")), TypeError, "out"),
    ("out_int8", "bf16", _set(out=tt.poisoned((3, 16, 128), torch.int8, "cpu")), TypeError, "out"),
    ("out_fp16_x_bf16", "bf16", _set(out=tt.poisoned((3, 16, 128), torch.float16, "cpu")), TypeError, "out"),
    ("out_e5m2", "fp8_e4m3fn", _set(out=tt.poisoned((3, 16, 128), torch.float8_e5m2, "cpu")), TypeError, "out"),
    ("out_int32", "fp4_shuffled", _set(out=tt.poisoned((3, 16, 16), torch.int32, "cpu")), TypeError, "out"),
    ("out_not_tensor", "bf16", _set(out=None), TypeError, "out"),
    ("fp4_no_scale", "fp4_shuffled", _set(out_scale=None), ValueError, "out_scale"),
    ("fp8_no_scale", "fp8_e4m3fn", _set(out_scale=None), ValueError, "out_scale"),
    ("fp4_scale_dense_shape_for_shuffled", "fp4_shuffled",
     _set(out_scale=tt.poisoned((3, 16, 4), torch.uint8, "cpu")), ValueError, "out_scale"),
    ("fp4_scale_dtype", "fp4_dense_rne", _set(out_scale=tt.poisoned((3, 16, 4), torch.int32, "cpu")), TypeError,
     "out_scale"),
    ("fp8_scale_dtype", "fp8_e4m3fn", _set(out_scale=tt.poisoned((3, 16, 1), torch.uint8, "cpu")), TypeError,
     "out_scale"),
    ("fp8_scale_shape", "fp8_e4m3fn", _set(group_size=64), ValueError, "out_scale"),
    ("bf16_with_scale", "bf16", _set(out_scale=tt.poisoned((3, 16, 1), torch.float32, "cpu")), ValueError,
     "out_scale"),
    ("bf16_with_group", "bf16", _set(group_size=32), ValueError, "group_size"),
    ("shuffled_group16", "fp4_shuffled", _set(group_size=16), ValueError, "group_size"),
    ("group_48", "fp4_dense_rne", _set(group_size=48), ValueError, "group_size"),
    ("group_float", "fp8_e4m3fn", _set(group_size=128.0), TypeError, "group_size"),
    ("out_shape", "fp4_dense_rne", _set(out=tt.poisoned((3, 16, 128), torch.uint8, "cpu")), ValueError, "out"),
    ("shuffled_H8", "fp4_shuffled", lambda a: {**a, "x": a["x"][:, :8], "out": a["out"][:, :8].clone()}, ValueError,
     "x"),
    ("H_3", "bf16", lambda a: {**a, "x": a["x"][:, :3], "out": a["out"][:, :3]}, ValueError, "x"),
    ("D_192", "bf16", lambda a: {**a, "x": a["x"][..., :96].repeat(1, 1, 2), "out": a["out"][..., :96]},
     ValueError, "x"),
    ("x_2d", "bf16", lambda a: {**a, "x": a["x"][:, 0]}, ValueError, "x"),
    ("x_int", "bf16", lambda a: {**a, "x": a["x"].to(torch.int16)}, TypeError, "x"),
    ("rope_dim", "bf16", _set(rope_dim=32), ValueError, "rope_dim"),
    ("positions_dtype", "bf16", lambda a: {**a, "positions": a["positions"].float()}, TypeError, "positions"),
    ("positions_len", "bf16", lambda a: {**a, "positions": a["positions"][:2]}, ValueError, "positions"),
    ("cos_width", "bf16", lambda a: {**a, "cos_cache": a["cos_cache"].repeat(1, 2)}, ValueError, "cos_cache"),
    ("sin_dtype", "bf16", lambda a: {**a, "sin_cache": a["sin_cache"].float()}, TypeError, "sin_cache"),
    ("rounding", "fp4_shuffled", _set(rounding="floor"), ValueError, "rounding"),
    ("hadamard_int", "bf16", _set(hadamard=1), TypeError, "hadamard"),
    ("shuffle_int", "fp4_shuffled", _set(shuffle_scale=0), TypeError, "shuffle_scale"),
    ("device", "bf16", lambda a: {**a, "positions": a["positions"].to("meta")}, ValueError, "positions"),
]


@pytest.mark.parametrize("case,kind,mutate,exc,name", BAD, ids=[b[0] for b in BAD])
def test_bad_input_rejected_nothing_written(case, kind, mutate, exc, name):
    a = mutate(make(kind))
    with pytest.raises(exc) as ei:
        compress.rope_rotate_quant(**a)
    assert str(ei.value).startswith(name), str(ei.value)
    for k in ("out", "out_scale"):
        t = a.get(k)
        if isinstance(t, torch.Tensor):
            assert (u8(t) == POISON).all(), k


@pytest.mark.parametrize("kind", ["fp4_shuffled", "bf16"])
def test_zero_tokens_still_checks_arguments(kind):
    """T = 0 is a no-op (tests/test_edge_cases.py test_zero_tokens_is_a_noop) that still checks its
    arguments."""
    full = make(kind, T=2)
    a = make(kind, T=0)
    for k in ("out", "out_scale"):
        if k in a:
            a[k] = full[k][:0]
    with pytest.raises(ValueError, match="^rope_dim"):
        compress.rope_rotate_quant(**{**a, "rope_dim": 32})


def test_compile_and_opcheck():
    a, b = make("fp4_shuffled", seed=9), make("fp4_shuffled", seed=9)
    compress.rope_rotate_quant(**a)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(kw):
        compress.rope_rotate_quant(**kw)
    f(b)
    assert np.array_equal(u8(a["out"]), u8(b["out"])) and np.array_equal(u8(a["out_scale"]), u8(b["out_scale"]))
    c = make("fp4_shuffled", seed=9)   # (schema checks cannot compare float8 tensors on the CPU)
    torch.library.opcheck(compress._rope_rotate_op.op, (c["out"], c["x"], c["cos_cache"], c["sin_cache"], c["positions"], 64,
                                                 c["out_scale"], 32, True, True, "hardware", "reference"),
                          test_utils=("test_schema", "test_faketensor"))

"""SPEC §0.2, §1-§3 and §7.2 stage 1: golden values worked out by hand.

Every expected number in this file is a literal (or, for the canonical sum, an explicit chain of
numpy.float32 operations written here), never a call back into the code under test.
"""
from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from dsaquant import formats as F
from f32_steps import canonical_np

F32 = torch.float32


def f32(b: int) -> float:
    """The fp32 with bit pattern b, as a Python float (exact)."""
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def bits_of(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def t32(values) -> torch.Tensor:
    """fp32 tensor from Python floats (each already exactly an fp32, or rounded once)."""
    return torch.tensor(values, dtype=F32)


def tbits(bit_patterns) -> torch.Tensor:
    """fp32 tensor built from bit patterns (keeps NaN sign and payload)."""
    return torch.tensor([b - (1 << 32) if b >= (1 << 31) else b for b in bit_patterns],
                        dtype=torch.int32).view(F32)


def tensor_bits(t: torch.Tensor) -> list[int]:
    return [b & 0xFFFFFFFF for b in t.contiguous().to(F32).view(torch.int32).reshape(-1).tolist()]


# ---- SPEC §2 golden table, cell by cell -----------------------------------------------------------
INF = 0x7F800000
NEG_NAN = 0xFFC00000

# (fp32 bits of v, threshold, rne, hardware)
GOLDEN_E2M1 = [
    (0x00000000, 0x0, 0x0, 0x0),     # 0.0
    (0x80000000, 0x0, 0x0, 0x8),     # -0.0
    (0xBE4CCCCD, 0x0, 0x0, 0x8),     # -0.2
    (0x3E800000, 0x0, 0x0, 0x0),     # 0.25
    (0x3E851EB8, 0x1, 0x1, 0x1),     # 0.26
    (0x3F400000, 0x1, 0x2, 0x2),     # 0.75
    (0xBFE00000, 0xB, 0xC, 0xC),     # -1.75
    (0x40200000, 0x4, 0x4, 0x4),     # 2.5
    (0x40600000, 0x5, 0x6, 0x6),     # 3.5
    (0x40A00000, 0x6, 0x6, 0x6),     # 5.0
    (0x40A00001, 0x7, 0x7, 0x7),     # 5.0000005 (one ulp above 5)
    (0xC0E00000, 0xF, 0xF, 0xF),     # -7.0
    (INF, 0x7, 0x7, 0x7),            # +Inf
    (NEG_NAN, 0x7, 0x7, 0xF),        # -NaN 0xFFC00000
]


def test_golden_table_bit_patterns_are_the_named_values():
    # Guard the table itself: the bit patterns are the fp32 roundings of the SPEC's decimals.
    named = [0.0, -0.0, -0.2, 0.25, 0.26, 0.75, -1.75, 2.5, 3.5, 5.0, 5.0000005, -7.0, float("inf")]
    for (b, *_), v in zip(GOLDEN_E2M1, named):
        assert b == bits_of(v), (hex(b), v)
    assert np.isnan(f32(NEG_NAN)) and (NEG_NAN >> 31) == 1


@pytest.mark.parametrize("col,policy", [(1, "threshold"), (2, "rne"), (3, "hardware")])
@pytest.mark.parametrize("row", range(len(GOLDEN_E2M1)))
def test_e2m1_golden_cell(row, col, policy):
    b = GOLDEN_E2M1[row][0]
    expected = GOLDEN_E2M1[row][col]
    got = F.e2m1_encode(tbits([b]), policy)
    assert got.dtype == torch.uint8
    assert got.item() == expected, f"v=0x{b:08X} policy={policy}: got 0x{got.item():X}, want 0x{expected:X}"


@pytest.mark.parametrize("policy", ["threshold", "rne", "hardware"])
def test_e2m1_golden_table_vectorised(policy):
    col = {"threshold": 1, "rne": 2, "hardware": 3}[policy]
    v = tbits([r[0] for r in GOLDEN_E2M1]).reshape(2, 7)   # shape must not matter
    got = F.e2m1_encode(v, policy)
    assert got.shape == (2, 7)
    assert got.reshape(-1).tolist() == [r[col] for r in GOLDEN_E2M1]


def test_e2m1_tie_table():
    # SPEC §2 "Ties, by magnitude" line, as magnitude indices.
    mids = t32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert F.e2m1_encode(mids, "threshold").tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert F.e2m1_encode(mids, "rne").tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert F.e2m1_encode(mids, "hardware").tolist() == [0, 2, 2, 4, 4, 6, 6]
    # Negative ties: same magnitude, sign bit set.
    assert F.e2m1_encode(-mids, "threshold").tolist() == [0x0, 0x9, 0xA, 0xB, 0xC, 0xD, 0xE]
    assert F.e2m1_encode(-mids, "rne").tolist() == [0x0, 0xA, 0xA, 0xC, 0xC, 0xE, 0xE]
    assert F.e2m1_encode(-mids, "hardware").tolist() == [0x8, 0xA, 0xA, 0xC, 0xC, 0xE, 0xE]
    # Values in (5, 6] and above give 6; +-Inf saturate; -Inf keeps its sign under every policy.
    big = t32([5.5, 6.0, 6.5, 1e30, float("-inf"), -6.0])
    for p in ("threshold", "rne", "hardware"):
        assert F.e2m1_encode(big, p).tolist() == [7, 7, 7, 7, 0xF, 0xF]


def test_e2m1_decode_all_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    got = F.e2m1_decode(codes)
    want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert tensor_bits(got) == [bits_of(w) for w in want]   # 0x8 decodes to -0 (sign bit kept)


# ---- SPEC §3 UE8M0 exponents ------------------------------------------------------------------
# amax bits -> (recip, pack). Worked by hand from the SPEC formulas:
#   recip: f = fl(max(amax, 6*2^-126) * 0x3E2AAAAB); e = ceil_exp(f) (255 if f is Inf/NaN)
#   pack:  f = max(fl(amax / 6), 1e-4f = 0x38D1B717); e = clamp(ceil_exp(f), 1, 254)
#   fl(1/6) = 1/6 * (1 + 2^-25), so 6 * fl(1/6) = 1 + 2^-25, which rounds to 1.0.
UE8M0_CASES = [
    (0x00000000, 1, 114),    # 0: recip floor 6*2^-126 -> 2^-126 -> 1; pack: 1e-4f (field 113, mantissa != 0) -> 114
    (0x40C00000, 127, 127),  # 6: f = 1.0 exactly
    (0x41400000, 128, 128),  # 12: f = 2.0
    (0x40400000, 126, 126),  # 3: f = 0.5
    (0x40C00001, 128, 128),  # 6 + 1ulp: f = 1 + 2^-23 under both
    (0x40BFFFFF, 127, 127),  # 6 - 1ulp: f = 1 - 2^-24
    (0x40E00000, 128, 128),  # 7: f = 1.1666667
    (0x3F000000, 124, 124),  # 0.5: f = 0.0833 in [2^-4, 2^-3)
    (0x3F800000, 125, 125),  # 1: f = 0.1667 in [2^-3, 2^-2)
    (0x399D4952, 113, 114),  # 3e-4: f = 5e-5 in [2^-15, 2^-14) -> 113; pack clamps to 1e-4f -> 114
    (0x3A83126F, 115, 115),  # 1e-3: f = 1.667e-4 in [2^-13, 2^-12)
    (0x7F7FFFFF, 253, 253),  # FLT_MAX: f = 5.67e37 in [2^125, 2^126)
    (0x000116C2, 1, 114),    # fp32 subnormal amax: recip floor
    (0x02400000, 2, 114),    # 12*2^-126: f = 2^-125
    (0x7F800000, 255, 254),  # +Inf: recip NaN scale; pack clamps 255 -> 254
]


@pytest.mark.parametrize("amax_bits,recip,pack", UE8M0_CASES)
def test_ue8m0_hand_values(amax_bits, recip, pack):
    a = tbits([amax_bits])
    r = F.ue8m0_exponent(a, "recip")
    p = F.ue8m0_exponent(a, "pack")
    assert r.tolist() == [recip], f"recip(0x{amax_bits:08X})"
    assert p.tolist() == [pack], f"pack(0x{amax_bits:08X})"


def test_ue8m0_vectorised_and_ceil_exp():
    a = tbits([c[0] for c in UE8M0_CASES])
    assert F.ue8m0_exponent(a, "recip").tolist() == [c[1] for c in UE8M0_CASES]
    assert F.ue8m0_exponent(a, "pack").tolist() == [c[2] for c in UE8M0_CASES]
    # ceil_exp on bits: exact powers of two keep their exponent, anything above goes up one.
    f = tbits([0x3F800000, 0x3F800001, 0x3F7FFFFF, 0x00000001, 0x00800000, 0x7F000000, 0x7F7FFFFF, 0x00000000])
    assert F.ceil_exp(f).tolist() == [127, 128, 127, 1, 1, 254, 255, 0]


def test_all_zero_block_exponents():
    x = torch.zeros(3, 128, dtype=F32)
    _, e_recip = F.fp4_quantize(x, "rne", "recip")
    _, e_pack = F.fp4_quantize(x, "rne", "pack")
    assert e_recip.dtype == torch.uint8 and e_recip.shape == (3, 4)
    assert e_recip.reshape(-1).tolist() == [1] * 12
    assert e_pack.reshape(-1).tolist() == [114] * 12
    # all-NaN block: amax ignores NaN -> 0 -> same exponents; the NaN codes are 7. A quantizer first
    # replaces every NaN by the canonical +NaN (reference/arith.py canon_nan), so even -NaN gives 0x7
    # under `hardware` here, unlike the raw e2m1_encode (golden table: -NaN -> 0xF).
    xn = torch.full((1, 32), float("nan"))
    pk, er = F.fp4_quantize(xn, "hardware", "recip")
    assert er.tolist() == [[1]] and pk.reshape(-1).tolist() == [0x77] * 16
    pk, ep = F.fp4_quantize(-xn, "hardware", "pack")
    assert ep.tolist() == [[114]] and pk.reshape(-1).tolist() == [0x77] * 16
    assert F.e2m1_encode(-xn[0, :2], "hardware").tolist() == [0xF, 0xF]


# ---- SPEC §1 packing ---------------------------------------------------------------------------------
def test_nibble_packing_order():
    codes = torch.tensor([[0x1, 0x2, 0x3, 0x4, 0xF, 0x0, 0x0, 0xA]], dtype=torch.uint8)
    packed = F.pack_nibbles(codes)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [[0x21, 0x43, 0x0F, 0xA0]]       # element 2i low nibble, 2i+1 high
    assert F.unpack_nibbles(packed).tolist() == codes.tolist()
    assert F.unpack_nibbles(torch.tensor([0x9C], dtype=torch.uint8)).tolist() == [0xC, 0x9]


# ---- SPEC §3 fp4_quantize / fp4_dequantize on hand blocks ---------------------------------------
def _row():
    """A 128 row of 4 blocks with amax 6, 3, 0 and 7 (hand-checked codes below)."""
    x = [0.0] * 128
    # block 0: amax 6 -> e = 127 under both rules, v = x
    x[0:12] = [0.0, 0.25, 0.26, 0.75, -1.75, 2.5, 3.5, 5.0, 6.0, -0.2, -0.0, 1.25]
    # block 1: amax 3 -> e = 126, v = 2x
    x[32:36] = [3.0, -0.375, 0.125, 1.25]
    # block 2: all zero -> e = 1 (recip) or 114 (pack)
    # block 3: amax 7 -> e = 128, v = x/2
    x[96:101] = [7.0, -7.0, 1.0, 0.5, 2.9]
    return t32(x)


# Expected packed bytes (byte i = code[2i] | code[2i+1] << 4) of the non-zero pairs; all others are 0x00.
#   block 0 pairs: (0, .25) (.26, .75) (-1.75, 2.5) (3.5, 5) (6, -.2) (-0, 1.25)
#   block 1 pairs: v = (6, -.75) (.25, 2.5)
#   block 3 pairs: v = (3.5, -3.5) (.5, .25) (1.45, 0)
EXPECTED_BYTES = {
    "threshold": {0: 0x00, 1: 0x11, 2: 0x4B, 3: 0x65, 4: 0x07, 5: 0x20,
                  16: 0x97, 17: 0x40, 48: 0xD5, 49: 0x01, 50: 0x03},
    "rne":       {0: 0x00, 1: 0x21, 2: 0x4C, 3: 0x66, 4: 0x07, 5: 0x20,
                  16: 0xA7, 17: 0x40, 48: 0xE6, 49: 0x01, 50: 0x03},
    "hardware":  {0: 0x00, 1: 0x21, 2: 0x4C, 3: 0x66, 4: 0x87, 5: 0x28,
                  16: 0xA7, 17: 0x40, 48: 0xE6, 49: 0x01, 50: 0x03},
}


@pytest.mark.parametrize("policy", ["threshold", "rne", "hardware"])
@pytest.mark.parametrize("rule,exps", [("recip", [127, 126, 1, 128]), ("pack", [127, 126, 114, 128])])
def test_fp4_quantize_hand_row(policy, rule, exps):
    packed, e = F.fp4_quantize(_row().unsqueeze(0), policy, rule)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 64)
    assert e.dtype == torch.uint8 and e.tolist() == [exps]
    want = [EXPECTED_BYTES[policy].get(i, 0x00) for i in range(64)]
    got = packed[0].tolist()
    assert got == want, [(i, hex(g), hex(w)) for i, (g, w) in enumerate(zip(got, want)) if g != w]


def test_fp4_quantize_accepts_bf16_exactly():
    x = _row()
    xb = x.to(torch.bfloat16)           # every value except 0.26 and 2.9 is bf16-exact
    xb_f = xb.to(F32)
    a, ea = F.fp4_quantize(xb, "rne", "recip")
    b, eb = F.fp4_quantize(xb_f, "rne", "recip")
    assert torch.equal(a, b) and torch.equal(ea, eb)


def test_fp4_dequantize_hand_row():
    packed, e = F.fp4_quantize(_row().unsqueeze(0), "threshold", "recip")
    d = F.fp4_dequantize(packed, e)[0]
    assert d.dtype == F32 and d.shape == (128,)
    want = [0.0] * 128
    want[0:12] = [0.0, 0.0, 0.5, 0.5, -1.5, 2.0, 3.0, 4.0, 6.0, 0.0, 0.0, 1.0]
    want[32:36] = [3.0, -0.25, 0.0, 1.0]                 # v grid (6, -0.5, 0, 2) times 2^-1
    want[96:101] = [6.0, -6.0, 1.0, 0.0, 3.0]            # v grid (3, -3, 0.5, 0, 1.5) times 2^1
    assert tensor_bits(d) == [bits_of(w) for w in want]


def test_fp4_dequantize_hand_codes_and_exponents():
    # byte 0x9F: low nibble 0xF (-6), high 0x9 (-0.5); e = 130 -> scale 8; e = 1 -> 2^-126; 255 -> NaN
    packed = torch.tensor([[0x9F] + [0x00] * 15, [0x71] + [0x00] * 15, [0x12] + [0x00] * 15], dtype=torch.uint8)
    e = torch.tensor([[130], [1], [255]], dtype=torch.uint8)
    d = F.fp4_dequantize(packed, e)
    assert d[0, :2].tolist() == [-48.0, -4.0]
    assert d[1, :2].tolist() == [0.5 * 2.0 ** -126, 6.0 * 2.0 ** -126]
    assert bool(torch.isnan(d[2]).all())


# The NaN-scale block: recip with an infinite amax gives e = 255 and fill codes (SPEC §3).
NAN_BLOCK_BITS = [INF, 0xBF800000, 0x40000000, 0x80000000, 0x7FC00000, 0xFF800000, 0x00000000, 0xC0400000,
                  NEG_NAN, 0x3F800000] + [0] * 22          # +Inf -1 2 -0 +NaN -Inf 0 -3 -NaN 1 0...


@pytest.mark.parametrize("policy,want", [
    ("threshold", [0x77] * 16),
    ("rne", [0x77] * 16),
    # hardware: sign | 7 for every element: (Inf,-1) (2,-0) (NaN,-Inf) (0,-3) then (-NaN,1) (+0,+0) ...;
    # the -NaN is canonicalised to +NaN at the quantizer's entry (canon_nan), so it gives 7, not 0xF.
    ("hardware", [0xF7, 0xF7, 0xF7, 0xF7, 0x77] + [0x77] * 11),
])
def test_nan_scale_block(policy, want):
    x = tbits(NAN_BLOCK_BITS).reshape(1, 32)
    packed, e = F.fp4_quantize(x, policy, "recip")
    assert e.tolist() == [[255]]
    assert packed[0].tolist() == want
    assert bool(torch.isnan(F.fp4_dequantize(packed, e)).all())


@pytest.mark.parametrize("policy,want", [
    # pack rule: e = 254, v = x / 2^127: +-Inf stay infinite (m = 7), NaN -> 7, finite values -> tiny -> m = 0
    ("threshold", [0x07, 0x00, 0xF7, 0x00, 0x07] + [0x00] * 11),
    ("rne", [0x07, 0x00, 0xF7, 0x00, 0x07] + [0x00] * 11),
    ("hardware", [0x87, 0x80, 0xF7, 0x80, 0x07] + [0x00] * 11),     # -NaN canonical -> 7
])
def test_infinite_block_under_pack(policy, want):
    x = tbits(NAN_BLOCK_BITS).reshape(1, 32)
    packed, e = F.fp4_quantize(x, policy, "pack")
    assert e.tolist() == [[254]]
    assert packed[0].tolist() == want


# ---- SPEC §7.2 stage 1: fp4_fake_quant -----------------------------------------------------------
def test_fake_quant_ue8m0_signs_and_values():
    x = [0.0] * 64
    # block 0: amax 6 -> s = 1
    x[0:11] = [6.0, -0.2, -0.0, 0.2, 0.3, -2.5, 2.6, 1.75, 0.75, 0.25, -0.25]
    # block 1: amax 7 -> e = 128, s = 2: y = (3.5, -3.5, 0.45, -0.2) -> (4, -4, 0.5, -0) * 2
    x[32:36] = [7.0, -7.0, 0.9, -0.4]
    out = F.fp4_fake_quant(t32(x).reshape(1, 64))
    assert out.dtype == F32 and out.shape == (1, 64)
    want = [0.0] * 64
    want[0:11] = [6.0, -0.0, 0.0, 0.0, 0.5, -2.0, 3.0, 2.0, 1.0, 0.0, -0.0]
    want[32:36] = [8.0, -8.0, 1.0, -0.0]
    got = tensor_bits(out)
    assert got == [bits_of(w) for w in want], [(i, hex(g)) for i, g in enumerate(got) if g != bits_of(want[i])]
    # the two sign rules, spelled out
    assert got[1] == 0x80000000     # negative y rounding to zero -> -0
    assert got[2] == 0x00000000     # -0 input -> +0
    assert got[35] == 0x80000000


def test_fake_quant_bf16_in_bf16_out():
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, :4] = torch.tensor([7.0, -0.0, -0.1, 1.5])     # s = 2: y = (3.5, -0, -0.05, 0.75) -> (4, 0, -0, 1)
    out = F.fp4_fake_quant(x)
    assert out.dtype == torch.bfloat16
    assert out.view(torch.int16)[0, :4].tolist() == [0x4100, 0x0000, -0x8000, 0x4000]   # 8, +0, -0, 2


def test_fake_quant_nan_stays_nan():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = float("nan"), 3.0
    out = F.fp4_fake_quant(x)
    assert bool(torch.isnan(out[0, 0])) and out[0, 1].item() == 3.0 and out[0, 2].item() == 0.0


def test_fake_quant_e4m3_block16():
    x = [0.0] * 48
    # block 0 (16): amax 7 -> fl(7*fl(1/6)) = 1.1666666 -> e4m3 rne -> 1.125 = s
    #   7/s = 6.22 -> clamp 6 -> 6.75; 1/s = 0.889 -> 1 -> 1.125; -2/s = -1.78 -> -2 -> -2.25;
    #   0.5/s = 0.444 -> 0.5 -> 0.5625; -0 -> +0; -0.1/s = -0.089 -> -0
    x[0:6] = [7.0, 1.0, -2.0, 0.5, -0.0, -0.1]
    # block 1: amax 6.375 -> fl(6.375*fl(1/6)) = 1.0625, a tie between e4m3 1.0 and 1.125 -> even -> s = 1
    #   6.375 -> clamp 6 -> 6; -3.1875 -> -3
    x[16:18] = [6.375, -3.1875]
    # block 2: amax 3*2^-10 -> 2^-11 -> clamp up to 2^-9 = s (an e4m3 subnormal)
    #   3*2^-10 / s = 1.5 -> 1.5 * 2^-9; 2^-11 / s = 0.25 (tie) -> 0; -1.25*2^-10 / s = -0.625 -> -0.5 -> -2^-10
    x[32:35] = [3 * 2.0 ** -10, 2.0 ** -11, -1.25 * 2.0 ** -10]
    out = F.fp4_fake_quant(t32(x), block=16, scale="e4m3")
    want = [0.0] * 48
    want[0:6] = [6.75, 1.125, -2.25, 0.5625, 0.0, -0.0]
    want[16:18] = [6.0, -3.0]
    want[32:35] = [1.5 * 2.0 ** -9, 0.0, -(2.0 ** -10)]
    got = tensor_bits(out)
    assert got == [bits_of(w) for w in want], [(i, hex(g)) for i, g in enumerate(got) if g != bits_of(want[i])]


def test_fake_quant_e4m3_differs_from_ue8m0():
    # Same data, the other scale: amax 7 -> s = 2 -> 7 -> 3.5 -> 4 -> 8 (not 6.75)
    x = torch.zeros(32)
    x[0] = 7.0
    assert F.fp4_fake_quant(x, block=32, scale="ue8m0")[0].item() == 8.0
    assert F.fp4_fake_quant(x[:16], block=16, scale="e4m3")[0].item() == 6.75


# ---- SPEC §0.2 canonical sum -------------------------------------------------------------------


def _naive_np(row) -> np.float32:
    acc = np.float32(0.0)
    for v in row:
        acc = acc + np.float32(v)
    return acc


def test_canonical_sum_hand_row():
    # 1 followed by 127 copies of 2^-24. Left to right each 1 + 2^-24 is a tie that rounds back to 1.
    # Canonical: p[0] = 1 (its three 2^-24 are lost), p[i>0] = 2^-22 exactly; the butterfly then adds
    # 31 * 2^-22 to p[0] without loss -> 1 + 31 * 2^-22.
    row = [1.0] + [2.0 ** -24] * 127
    naive = _naive_np(row)
    canon = canonical_np(row)
    assert naive == np.float32(1.0)
    assert canon == np.float32(1.0 + 31 * 2.0 ** -22)
    got = F.canonical_sum(t32(row))
    assert got.dtype == F32 and got.shape == ()
    assert bits_of(got.item()) == bits_of(float(canon)) == 0x3F80003E


def test_canonical_sum_butterfly_order_matters():
    # A row where the butterfly order (s = 16, 8, 4, 2, 1) differs from the reverse order and from
    # naive / pairwise summation; expected by explicit numpy.float32 steps.
    rng = np.random.default_rng(1234)
    found = 0
    for _ in range(200):
        row = (rng.standard_normal(128) * np.exp2(rng.integers(-20, 20, 128))).astype(np.float32)
        canon = canonical_np(row)
        # the same partials but butterfly s = 1, 2, 4, 8, 16
        p = [((row[4 * i] + row[4 * i + 1]) + row[4 * i + 2]) + row[4 * i + 3] for i in range(32)]
        for s in (1, 2, 4, 8, 16):
            p = [p[i] + p[i ^ s] for i in range(32)]
        got = F.canonical_sum(torch.from_numpy(row))
        assert np.float32(got.item()).view(np.int32) == canon.view(np.int32)
        if p[0] != canon and _naive_np(row) != canon:
            found += 1
    assert found > 10   # the test data really distinguishes the orders


def test_canonical_sum_batched_and_other_lengths():
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((3, 5, 128)) * 1000).astype(np.float32)
    got = F.canonical_sum(torch.from_numpy(x))
    assert got.shape == (3, 5)
    for i in range(3):
        for j in range(5):
            assert np.float32(got[i, j].item()) == canonical_np(x[i, j])
    for n in (4, 8, 32, 512):     # n = 4*m with m partials, same shape
        row = (rng.standard_normal(n) * np.exp2(rng.integers(-10, 10, n))).astype(np.float32)
        assert np.float32(F.canonical_sum(torch.from_numpy(row)).item()).view(np.int32) == \
            canonical_np(row).view(np.int32)

"""SPEC §0-§6 format math, restated once in Triton (`@triton.jit` device functions).

Every function here is the Triton twin of a helper in python/dsaquant/reference/ and must give the same
bits on a GPU and under TRITON_INTERPRET=1. Rules followed throughout (SPEC §0, §8):
- one IEEE binary32 operation per step, in the reference's order and with the reference's operand order;
  kernels are launched with `enable_fp_fusion=False` so no FMA is formed;
- `tl.math.div_rn` for division (Triton's `/` is approximate on NVIDIA) and `sqrt_cr` below for the
  square root; division by a power of two is done as a multiplication by its exact inverse
  (same correctly rounded result), never log2/exp2;
- without NATIVE (the interpreter), bf16 values are raw 16-bit integers (loaded through int16 views,
  rounded by integer bit arithmetic): the interpreter truncates fp32 -> bf16 and mishandles bf16
  subnormals. bf16 outputs are always written as integer bits (canonical NaN);
- NaN: the reference makes every NaN inside an op the canonical +0x7FC00000 (`canon_nan`) and stores
  the canonical NaN of each output dtype (`cast`). Here a NaN may carry any bits between steps (a GPU's
  conversions and arithmetic make their own), but every step where NaN bits could reach a byte treats
  any NaN as the canonical one: amax ignores NaN, the E2M1 and E4M3 encoders give the canonical NaN's
  code, and stores write the canonical NaN of the output dtype. So no platform-dependent bits escape.
- `NATIVE` (constexpr, set on GPUs) selects the hardware bf16 conversions and the GPU's NaN-ignoring max;
  without it (the interpreter) the same results come from integer bit arithmetic and explicit NaN masks.
- `PACKED` (constexpr of fp4_encode_tile / fp4_quant_tile, NVIDIA sm_80+ only, for tiles of bf16 values):
  the E2M1 codes from inline PTX on bf16x2 registers (e2m1_code_bf16x2: explicit fma.rn.bf16x2, each an
  exact step or the one rounding of the algorithm), the same bytes as the fp32 encoder.

Row data of the 128-wide head dim is carried as four [R, 32] fp32 tiles t0..t3 (dims 32k..32k+31). That
shape makes the FP4 blocks of 32 whole tiles, the neox head RoPE elementwise between t0 and t1, and the
first two levels of the canonical-sum butterfly (SPEC §0.2) and of the Hadamard elementwise between
tiles; what is left is done inside a tile with reshape/split/join, always in the SPEC's order.
"""
from __future__ import annotations

import struct

import triton
import triton.language as tl

from .. import codes


def _f32(b: int) -> float:
    """The fp32 with bit pattern b, as an exact Python float."""
    return struct.unpack("<f", struct.pack("<I", b))[0]


# dsaquant.codes as Triton constexprs: the kernels compare their constexpr parameters with these.
# Dtype kinds of tensors the kernels read or write (codes.DType; bf16 tensors are passed as int16 views).
KIND_F32: tl.constexpr = tl.constexpr(int(codes.DType.f32))
KIND_BF16: tl.constexpr = tl.constexpr(int(codes.DType.bf16))
KIND_F16: tl.constexpr = tl.constexpr(int(codes.DType.f16))
# POLICY parameters (codes.Rounding), RULE parameters (codes.ScaleRule).
ROUND_THRESHOLD: tl.constexpr = tl.constexpr(int(codes.Rounding.threshold))
ROUND_RNE: tl.constexpr = tl.constexpr(int(codes.Rounding.rne))
ROUND_HARDWARE: tl.constexpr = tl.constexpr(int(codes.Rounding.hardware))
RULE_PACK: tl.constexpr = tl.constexpr(int(codes.ScaleRule.pack))
RULE_RECIP: tl.constexpr = tl.constexpr(int(codes.ScaleRule.recip))

# SPEC constants, exact fp32 values.
INV6: tl.constexpr = tl.constexpr(_f32(0x3E2AAAAB))            # fl(1/6), §3 rule recip
RECIP_FLOOR: tl.constexpr = tl.constexpr(6.0 * 2.0 ** -126)     # §3 rule recip: max(amax, 6*2^-126)
ONE_EM4: tl.constexpr = tl.constexpr(_f32(0x38D1B717))          # 1e-4f
ONE_EM10: tl.constexpr = tl.constexpr(_f32(0x2EDBE6FF))         # 1e-10f
INV_SQRT128: tl.constexpr = tl.constexpr(_f32(0x3DB504F3))      # fl(128^-0.5), §5 Hadamard
INV128: tl.constexpr = tl.constexpr(2.0 ** -7)                  # exact: x / 128 == x * 2^-7
CANON_NAN_BITS: tl.constexpr = tl.constexpr(0x7FC00000)         # reference arith.CANONICAL_NAN_BITS
E4M3_TWO_M9: tl.constexpr = tl.constexpr(2.0 ** -9)             # §7.2 e4m3 scale clamp
FLT_INF: tl.constexpr = tl.constexpr(float("inf"))


def fp8_consts(flavour: str):
    """(bias, fmax, fl(1/fmax)) of an FP8 flavour (SPEC §4) as exact Python numbers."""
    if flavour == "e4m3fn":
        return 7, 448.0, _f32(0x3B124925)
    if flavour == "e4m3fnuz":
        return 8, 240.0, _f32(0x3B888889)
    raise ValueError(f"fp8 flavour must be 'e4m3fn' or 'e4m3fnuz', got {flavour!r}")


# ---------------------------------------------------------------------------------------------------
# bits, conversions, loads and stores
# ---------------------------------------------------------------------------------------------------
@triton.jit
def as_bits(x):
    """fp32 -> int32 bit pattern."""
    return x.to(tl.int32, bitcast=True)


@triton.jit
def from_bits(b):
    """int32 bit pattern -> fp32."""
    return b.to(tl.float32, bitcast=True)


@triton.jit
def negate(x):
    """-x by flipping the sign bit (Triton lowers unary minus to 0 - x, which turns -0 into +0)."""
    return from_bits(as_bits(x) ^ -2147483648)


@triton.jit
def canon_nan(x):
    """Reference `canon_nan`: every NaN becomes +0x7FC00000."""
    return tl.where(x != x, from_bits(tl.full(x.shape, CANON_NAN_BITS, tl.int32)), x)


@triton.jit
def load_f32(ptr, offs, mask, KIND: tl.constexpr, NATIVE: tl.constexpr):
    """Load values of dtype KIND and convert them exactly to fp32. NATIVE (GPU): a bf16 pointer and the
    hardware conversion; otherwise (interpreter) bf16 comes through an int16 view and a shift."""
    if KIND == KIND_BF16 and not NATIVE:
        v = tl.load(ptr + offs, mask=mask, other=0)
        return from_bits(v.to(tl.int32) << 16)
    else:
        return tl.load(ptr + offs, mask=mask, other=0).to(tl.float32)


@triton.jit
def round_bf16(x, NATIVE: tl.constexpr):
    """SPEC §0.4 round fp32 to bf16 (nearest even), returned as fp32.

    A NaN stays a NaN whose bits are unspecified (NATIVE: the hardware conversion; otherwise the canonical
    NaN): every consumer either ignores NaN (amax) or canonicalises it (quantizer entry, FP8 encode, stores),
    which is what the reference's canonical NaN amounts to. Not NATIVE: integer bit arithmetic (the
    interpreter's fp32 -> bf16 cast truncates)."""
    if NATIVE:
        return x.to(tl.bfloat16).to(tl.float32)
    else:
        b = as_bits(x)
        r = (b + (0x7FFF + ((b >> 16) & 1))) & -65536
        return tl.where(x != x, from_bits(tl.full(x.shape, CANON_NAN_BITS, tl.int32)), from_bits(r))


@triton.jit
def round_f16(x):
    """SPEC §0.4 round fp32 to fp16 (nearest even), returned as fp32 (NaN: see round_bf16)."""
    return x.to(tl.float16).to(tl.float32)


@triton.jit
def round_to(x, KIND: tl.constexpr, NATIVE: tl.constexpr):
    """Reference `round_to(x, dtype)` for dtype KIND, up to NaN bits (see round_bf16); fp32: identity."""
    if KIND == KIND_BF16:
        return round_bf16(x, NATIVE)
    elif KIND == KIND_F16:
        return round_f16(x)
    else:
        return x


@triton.jit
def cast_for_store(x, KIND: tl.constexpr):
    """Reference `cast(x, dtype)`: fp32 -> the value stored in a tensor of dtype KIND (nearest even), every
    NaN as the canonical quiet NaN of that dtype (fp32 0x7FC00000, bf16 0x7FC0, fp16 0x7E00). bf16 comes
    back as int16 bits (bf16 tensors are written through int16 views)."""
    if KIND == KIND_BF16:
        b = as_bits(x)
        r = (b + (0x7FFF + ((b >> 16) & 1))) >> 16
        return tl.where(x != x, 0x7FC0, r).to(tl.int16)
    elif KIND == KIND_F16:
        h = x.to(tl.float16).to(tl.int16, bitcast=True)
        return tl.where(x != x, 0x7E00, h).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        return canon_nan(x)


# ---------------------------------------------------------------------------------------------------
# exponents on bits (SPEC §0.5, §3)
# ---------------------------------------------------------------------------------------------------
@triton.jit
def pow2(e):
    """2^(e-127) for a biased exponent e (int32), built from bits (e = 255 gives +Inf)."""
    return from_bits(e << 23)


@triton.jit
def pow2_inv(e):
    """The exact fp32 2^(127-e) for e in 1..254 (2^-127 is the subnormal 0x00400000); 0 for e = 255.
    x * pow2_inv(e) equals the reference's x / pow2(e) bit for bit (both are the correctly rounded
    x * 2^(127-e); for e = 255 both give ±0 for finite x and NaN for infinite x)."""
    b = tl.where(e < 254, (254 - e) << 23, 0x00400000)
    b = tl.where(e >= 255, 0, b)
    return from_bits(b)


@triton.jit
def ceil_exp(f):
    """SPEC §3: biased exponent of the smallest power of two >= f (f >= 0), from bits."""
    b = as_bits(f)
    return ((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def ue8m0_recip(amax):
    """SPEC §3 rule `recip`: f = max(amax, 6*2^-126) * fl(1/6); e = ceil_exp(f) (255 when f is Inf)."""
    f = tl.where(amax < RECIP_FLOOR, RECIP_FLOOR, amax) * INV6
    return ceil_exp(f)


@triton.jit
def ue8m0_pack(amax):
    """SPEC §3 rule `pack`: ceil_exp(max(amax / 6.0f, 1e-4f)) clamped to [1, 254]."""
    f = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
    f = tl.where(f < ONE_EM4, ONE_EM4, f)
    e = ceil_exp(f)
    return tl.minimum(tl.maximum(e, 1), 254)


@triton.jit
def amax_tile(x, NATIVE: tl.constexpr):
    """SPEC §0.3 max |x| along the last axis ignoring NaN (all NaN: 0). x [R, n] -> [R].
    NATIVE: the GPU's maxNum (max.f32 / v_max_f32 ignore a NaN operand) with a final max with 0 for an
    all-NaN block; the interpreter's maximum propagates NaN, so NaN is replaced by 0 first there."""
    a = tl.abs(x)
    if NATIVE:
        return tl.maximum(tl.max(a, axis=1), 0.0)
    else:
        a = tl.where(a != a, 0.0, a)
        return tl.max(a, axis=1)


# ---------------------------------------------------------------------------------------------------
# the canonical sum (SPEC §0.2) of four [R, 32] tiles
# ---------------------------------------------------------------------------------------------------
@triton.jit
def quad_partials(t, R: tl.constexpr):
    """[R, 32] -> [R, 8]: p[i] = ((x[4i] + x[4i+1]) + x[4i+2]) + x[4i+3]."""
    x = tl.reshape(t, (R, 8, 2, 2))
    x_even, x_odd = tl.split(x)          # [R, 8, 2]: (x[4i], x[4i+2]) and (x[4i+1], x[4i+3])
    e0, e2 = tl.split(x_even)
    e1, e3 = tl.split(x_odd)
    return ((e0 + e1) + e2) + e3


@triton.jit
def halve(p, R: tl.constexpr, N: tl.constexpr):
    """One butterfly level on [R, N] partials: out[i] = p[i] + p[i + N/2], i < N/2 (lower index first)."""
    x = tl.permute(tl.reshape(p, (R, 2, N // 2)), (0, 2, 1))   # [R, N/2, 2]
    lo, hi = tl.split(x)
    return lo + hi


@triton.jit
def canonical_sum4(t0, t1, t2, t3, R: tl.constexpr):
    """SPEC §0.2 canonical sum of each 128-row given as tiles t0..t3 [R, 32] -> [R].

    Partials p[0..7] come from t0, p[8..15] from t1, p[16..23] from t2, p[24..31] from t3. Level s = 16
    adds p[i] + p[i+16] (t0 with t2, t1 with t3), level 8 adds those two, levels 4, 2, 1 halve in-tile."""
    p0 = quad_partials(t0, R)
    p1 = quad_partials(t1, R)
    p2 = quad_partials(t2, R)
    p3 = quad_partials(t3, R)
    s = (p0 + p2) + (p1 + p3)            # [R, 8]
    s = halve(s, R, 8)
    s = halve(s, R, 4)
    s = halve(s, R, 2)                   # [R, 1]
    return tl.reshape(s, (R,))


# ---------------------------------------------------------------------------------------------------
# RoPE, norms, Hadamard (SPEC §5)
# ---------------------------------------------------------------------------------------------------
@triton.jit
def rope_pair(a, b, c, s):
    """a' = fl(fl(a*c) - fl(b*s)), b' = fl(fl(b*c) + fl(a*s))."""
    return a * c - b * s, b * c + a * s


@triton.jit
def rope_interleaved_tile(t, c, s, R: tl.constexpr):
    """Interleaved pairs (2j, 2j+1) inside one [R, 32] tile; c, s [R, 16] (pair j of the tile)."""
    x = tl.reshape(t, (R, 16, 2))
    a, b = tl.split(x)
    a2, b2 = rope_pair(a, b, c, s)
    return tl.reshape(tl.join(a2, b2), (R, 32))


@triton.jit
def sqrt_cr(v):
    """Correctly rounded fp32 sqrt of v (fp32, any value), the same on every target and the interpreter.

    Not tl.math.sqrt_rn: on AMD, Triton lowers it to v_rsq_f32 plus one Newton/Markstein step, which is
    not proven correctly rounded and reads denormals through rsq. Here: the fp64 square root rounded to
    fp32 (correctly rounded when the fp64 sqrt is: 53 >= 2*24 + 2 bits), then an exact fix-up against the
    two neighbours, so a faithful-only fp64 sqrt would still give the right bits: the square of the
    midpoint between s and a neighbour is exact in fp64 (<= 50 bits) and never equals v."""
    vd = v.to(tl.float64)
    s = tl.sqrt(vd).to(tl.float32)
    b = as_bits(s)
    ok = (v > 0.0) & (v < FLT_INF) & (b > 0)
    lo = from_bits(tl.where(ok, b - 1, b)).to(tl.float64)
    hi = from_bits(tl.where(ok, b + 1, b)).to(tl.float64)
    sd = s.to(tl.float64)
    m_lo = (lo + sd) * 0.5
    m_hi = (sd + hi) * 0.5
    s = tl.where(ok & (vd < m_lo * m_lo), lo.to(tl.float32), s)
    s = tl.where(ok & (vd > m_hi * m_hi), hi.to(tl.float32), s)
    return s


@triton.jit
def inv_sqrt(v):
    """fl(1 / fl(sqrt(v))), both correctly rounded (SPEC §0.1)."""
    return tl.math.div_rn(tl.full(v.shape, 1.0, tl.float32), sqrt_cr(v))


@triton.jit
def rms_inv(t0, t1, t2, t3, eps, R: tl.constexpr):
    """SPEC §5 RMSNorm factor: 1 / sqrt(S(x*x)/128 + eps), correctly rounded. [R]."""
    ss = canonical_sum4(t0 * t0, t1 * t1, t2 * t2, t3 * t3, R)
    return inv_sqrt(ss * INV128 + eps)


@triton.jit
def hadamard_tile_level(x, R: tl.constexpr, H: tl.constexpr):
    """One Sylvester level with stride H (1..16) inside a [R, 32] tile: (a, b) at (i, i+H), bit H of i
    clear -> (a+b, a-b)."""
    if H == 1:
        a, b = tl.split(tl.reshape(x, (R, 16, 2)))
        return tl.reshape(tl.join(a + b, a - b), (R, 32))
    else:
        y = tl.permute(tl.reshape(x, (R, 32 // (2 * H), 2, H)), (0, 1, 3, 2))   # [R, G, H, 2]
        a, b = tl.split(y)
        z = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))                    # [R, G, 2, H]
        return tl.reshape(z, (R, 32))


@triton.jit
def hadamard4(t0, t1, t2, t3, R: tl.constexpr):
    """SPEC §5 128-point Hadamard of rows given as four [R, 32] tiles, times fl(128^-0.5)."""
    t0 = hadamard_tile_level(t0, R, 1)
    t1 = hadamard_tile_level(t1, R, 1)
    t2 = hadamard_tile_level(t2, R, 1)
    t3 = hadamard_tile_level(t3, R, 1)
    t0 = hadamard_tile_level(t0, R, 2)
    t1 = hadamard_tile_level(t1, R, 2)
    t2 = hadamard_tile_level(t2, R, 2)
    t3 = hadamard_tile_level(t3, R, 2)
    t0 = hadamard_tile_level(t0, R, 4)
    t1 = hadamard_tile_level(t1, R, 4)
    t2 = hadamard_tile_level(t2, R, 4)
    t3 = hadamard_tile_level(t3, R, 4)
    t0 = hadamard_tile_level(t0, R, 8)
    t1 = hadamard_tile_level(t1, R, 8)
    t2 = hadamard_tile_level(t2, R, 8)
    t3 = hadamard_tile_level(t3, R, 8)
    t0 = hadamard_tile_level(t0, R, 16)
    t1 = hadamard_tile_level(t1, R, 16)
    t2 = hadamard_tile_level(t2, R, 16)
    t3 = hadamard_tile_level(t3, R, 16)
    # h = 32: (t0, t1) and (t2, t3); h = 64: (t0, t2) and (t1, t3)
    u0 = t0 + t1
    u1 = t0 - t1
    u2 = t2 + t3
    u3 = t2 - t3
    v0 = u0 + u2
    v2 = u0 - u2
    v1 = u1 + u3
    v3 = u1 - u3
    return v0 * INV_SQRT128, v1 * INV_SQRT128, v2 * INV_SQRT128, v3 * INV_SQRT128


# ---------------------------------------------------------------------------------------------------
# E2M1 (SPEC §1, §2)
# ---------------------------------------------------------------------------------------------------
@triton.jit
def e2m1_index_core(a, POLICY: tl.constexpr):
    """Index 0..7 of |v| = a (fp32 >= 0, not NaN: a NaN gives an unspecified value) on the E2M1 grid
    [0, .5, 1, 1.5, 2, 3, 4, 6]; int32. POLICY threshold: ties toward zero; rne / hardware:
    ties to even. a > 5 (incl. Inf) gives 7.

    a >= 1 is E2M1's normal range (1 mantissa bit): the mantissa is rounded on the fp32 bits (adding
    2^21 - 1, plus the kept bit for ties-to-even; a carry moves into the exponent exactly), and the index
    is the rounded bits >> 22 minus 252 (1.0 = 0x3F800000 -> 2). Below 1 the quantum is 0.5: rne adds
    2^22 in fp32 (round half even to a multiple of 0.5, exact) and reads the multiple off the bits;
    threshold does the same and takes back the one tie that went up (0.75 -> 1.0). Values are clamped to 6 first (6 -> 7)."""
    c = tl.minimum(a, 6.0)
    b = as_bits(c)
    if POLICY == ROUND_THRESHOLD:
        # below 1: the rne index, minus one at the only tie rne sends up (0.75). Not the shorter
        # (c > 0.25) + (c > 0.75): LLVM narrows that to 16-bit vector code, and with Triton 3.6 on
        # sm_90 the FP4 indexer's first q tile then got wrong codes.
        m_norm = ((b + 0x1FFFFF) >> 22) - 252
        m_sub = (as_bits(c + 4194304.0) - 0x4A800000) - (c == 0.75).to(tl.int32)
    else:
        m_norm = ((b + (0x1FFFFF + ((b >> 22) & 1))) >> 22) - 252
        m_sub = as_bits(c + 4194304.0) - 0x4A800000           # bits(2^22) = 0x4A800000
    return tl.where(c < 1.0, m_sub, m_norm)


@triton.jit
def e2m1_magnitude_index(a, POLICY: tl.constexpr):
    """e2m1_index_core with NaN -> 7."""
    return tl.where(a != a, 7, e2m1_index_core(a, POLICY))


@triton.jit
def e2m1_encode(v, POLICY: tl.constexpr):
    """SPEC §2: scaled fp32 v -> 4-bit code (int32). POLICY a codes.Rounding (raw: a NaN
    keeps its sign under hardware, as the reference's e2m1_encode)."""
    m = e2m1_magnitude_index(tl.abs(v), POLICY)
    if POLICY == ROUND_HARDWARE:
        sign = (as_bits(v) >> 28) & 8
    else:
        sign = ((v < 0) & (m != 0)).to(tl.int32) << 3
    return m | sign


@triton.jit
def e2m1_grid_value(a):
    """|y| = a (fp32 in [0, 6], not NaN) rounded half-to-even onto the E2M1 grid, as a value (stage 1)."""
    b = as_bits(a)
    v_norm = from_bits((b + (0x1FFFFF + ((b >> 22) & 1))) & -4194304)
    v_sub = (a + 4194304.0) - 4194304.0
    return tl.where(a < 1.0, v_sub, v_norm)


@triton.jit
def e2m1_grid_round(c):
    """c (fp32 in [0, 6], not NaN) rounded half-to-even onto the E2M1 grid, as a value: (c + M) - M with
    M = 2^(E+22), E the exponent of max(c, 1). The sum lies in [M, 2M), where the fp32 quantum is 2^(E-1),
    E2M1's spacing at c (0.5 below 2, 1 in [2, 4), 2 in [4, 6]); the addition rounds half to even at that
    quantum (M is an even multiple of it) and the subtraction is exact. Equals e2m1_grid_value."""
    m = from_bits((as_bits(tl.maximum(c, 1.0)) & 0x7F800000) + (22 << 23))
    return (c + m) - m


@triton.jit
def pack_nibbles_tile(codes, R: tl.constexpr):
    """[R, 32] codes (int32, low 4 bits) -> [R, 16] bytes (uint8): element 2i low nibble, 2i+1 high."""
    lo, hi = tl.split(tl.reshape(codes, (R, 16, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


# ---------------------------------------------------------------------------------------------------
# E2M1 with packed bf16x2 PTX (NVIDIA sm_80+): the codes of two bf16 values per instruction
# ---------------------------------------------------------------------------------------------------
# The algorithm of src/include/dsaquant/e2m1x8.h (e2m1_encode8_bf16), per 32-bit register of two bf16
# values (value 0 in bits 0..15, value 1 in bits 16..31; every step works on both halves, none carries from
# one half into the other), x the value and s = 2^(127-e) its block's scale:
#   |v| = fl(|x| * s)                       exact wherever the index depends on it (s a power of two; a
#                                           |v| below bf16's subnormal quantum 2^-133 has index 0 anyway)
#   c   = min(|v|, 6)                       min.bf16x2 ignores a NaN operand: NaN -> 6 (index 7)
#   mx  = max(c, 1) & 0x7F80 = 2^E'         E' = max(floor(log2 c), 0)
#   M   = mx * 64 = 2^(E'+6)                bf16's ulp at M is E2M1's quantum at c (0.5, 1, 2)
#   r   = fl(c*K + M)                       one rounding onto the quantum: K = 1 ties to even (rne,
#                                           hardware), K = 1 - 2^-8 ties down (threshold)
#   g   = fl(r * 2^-126 + mx * -2^-120)     (r - M) * 2^-126, exact: bits 6..8 of each half are the index m
# e = 255 gets s = +Inf: |x| * Inf is Inf, or NaN for x = 0 or NaN, so m = 7, the NaN-scale magnitude.
# The sign (bit 3 of the code) is x's sign bit, 0 for a NaN x (the canonical NaN): |x| + 0x7F carries
# into bit 15 exactly for a NaN. Hardware keeps it as is (also under e = 255); threshold and rne keep it only
# where m != 0 (m + 7 has bit 3 set) and e != 255 (s + 0x80 carries into bit 15 exactly for s = +Inf).
# bf16x2 operands take no immediates: constants go through mov.b32 (ptxas keeps them in registers).
def e2m1_bf16x2_ptx(policy: int) -> str:
    """The PTX of e2m1_code_bf16x2 for POLICY `policy` (a codes.Rounding): $2 = two bf16 values
    (a bf16x2 register), $3 = their scales (bf16_inv_pow2_bits, int16 x2); $0, $1 = the codes of the low and
    the high value (32-bit registers)."""
    k = 0x3F7F3F7F if policy == codes.Rounding.threshold else 0x3F803F80
    sign_rt = "" if policy == codes.Rounding.hardware else """add.u32 dqt, $3, 0x00800080;
not.b32 dqt, dqt;
and.b32 dqs, dqs, dqt;
"""
    code_rt = "" if policy == codes.Rounding.hardware else """add.u32 dqt, dqr, 0x00070007;
and.b32 dqs, dqs, dqt;
"""
    return f"""{{
.reg .b32 dqx, dqa, dqc, dqmx, dqm, dqr, dqnz, dqk, dqs, dqt;
and.b32 dqx, $2, 0x7FFF7FFF;
mov.b32 dqnz, 0x80008000;
fma.rn.bf16x2 dqa, dqx, $3, dqnz;
mov.b32 dqk, 0x40C040C0;
min.bf16x2 dqc, dqa, dqk;
mov.b32 dqk, 0x3F803F80;
max.bf16x2 dqmx, dqc, dqk;
and.b32 dqmx, dqmx, 0x7F807F80;
mov.b32 dqk, 0x42804280;
fma.rn.bf16x2 dqm, dqmx, dqk, dqnz;
mov.b32 dqk, 0x{k:08X};
fma.rn.bf16x2 dqr, dqc, dqk, dqm;
mov.b32 dqk, 0x83808380;
fma.rn.bf16x2 dqm, dqmx, dqk, dqnz;
mov.b32 dqk, 0x00800080;
fma.rn.bf16x2 dqr, dqr, dqk, dqm;
shr.b32 dqr, dqr, 6;
and.b32 dqr, dqr, 0x00070007;
add.u32 dqt, dqx, 0x007F007F;
not.b32 dqt, dqt;
and.b32 dqs, $2, dqt;
{sign_rt}and.b32 dqs, dqs, 0x80008000;
shr.b32 dqs, dqs, 12;
{code_rt}or.b32 dqr, dqr, dqs;
and.b32 $0, dqr, 0xF;
shr.b32 $1, dqr, 16;
}}"""


E2M1_BF16X2_PTX_THRESHOLD: tl.constexpr = tl.constexpr(e2m1_bf16x2_ptx(codes.Rounding.threshold))
E2M1_BF16X2_PTX_RNE: tl.constexpr = tl.constexpr(e2m1_bf16x2_ptx(codes.Rounding.rne))
E2M1_BF16X2_PTX_HARDWARE: tl.constexpr = tl.constexpr(e2m1_bf16x2_ptx(codes.Rounding.hardware))


@triton.jit
def bf16_inv_pow2_bits(e):
    """The bf16 bits (int16) of the block scale 2^(127-e) for biased exponents e (int32): (254-e) << 7 for
    e in 1..253, the subnormal 0x0040 for e = 254, and +Inf (0x7F80) for e = 255 (see above)."""
    b = tl.where(e < 254, (254 - e) << 7, 0x0040)
    b = tl.where(e >= 255, 0x7F80, b)
    return b.to(tl.int16)


@triton.jit
def e2m1_code_bf16x2(x, s, POLICY: tl.constexpr):
    """fp4_encode_tile's 4-bit codes (int32) of bf16 values x in blocks with scales s (int16 bits from
    bf16_inv_pow2_bits, same shape): e2m1_encode of x / 2^(e-127) with x's NaN as the canonical NaN (0x7), and
    the NaN-scale codes for e = 255. Two values per instruction (inline PTX, pack=2: each asm instance gets two
    elements of x, in one register, with the same two elements of s, and returns the code of the first in $0
    and of the second in $1). NVIDIA sm_80+ only (fma/min/max.bf16x2)."""
    if POLICY == ROUND_THRESHOLD:
        c = tl.inline_asm_elementwise(E2M1_BF16X2_PTX_THRESHOLD, "=r,=r,r,r", [x, s], dtype=tl.int32, is_pure=True,
                                      pack=2)
    elif POLICY == ROUND_RNE:
        c = tl.inline_asm_elementwise(E2M1_BF16X2_PTX_RNE, "=r,=r,r,r", [x, s], dtype=tl.int32, is_pure=True,
                                      pack=2)
    else:
        c = tl.inline_asm_elementwise(E2M1_BF16X2_PTX_HARDWARE, "=r,=r,r,r", [x, s], dtype=tl.int32, is_pure=True,
                                      pack=2)
    return c


@triton.jit
def fp4_encode_tile(x, e, POLICY: tl.constexpr, PACKED: tl.constexpr = False):
    """SPEC §3/§2 codes of one block-of-32 tile x [R, 32] with exponents e [R] (int32), int32 codes [R, 32].
    As the reference (fp4_quantize, whose input NaN is canonical): a NaN element gives 0x7 under every
    policy; e = 255 (NaN scale) gives `sign(x)|7` under hardware and 0x7 otherwise.

    v = x / 2^(e-127) is x * 2^(127-e), which has the sign of x, so the hardware policy takes the sign bit
    from x (for e = 255 the product is x * 0, or NaN for x = ±Inf, but the sign of x is what is stored).
    Under rne/threshold, v < 0 is false for e = 255 (v = ±0 or NaN), so those codes need no sign fix.

    PACKED (NVIDIA sm_80+, and only for x whose values are all exact bf16 values, NaN bits aside): the same
    codes from e2m1_code_bf16x2, two values per bf16x2 instruction."""
    ee = e[:, None]
    if PACKED:
        s = tl.broadcast_to(bf16_inv_pow2_bits(ee), x.shape)
        return e2m1_code_bf16x2(x.to(tl.bfloat16), s, POLICY)
    else:
        v = x * pow2_inv(ee)
        nan = x != x
        m = tl.where(nan | (ee == 255), 7, e2m1_index_core(tl.abs(v), POLICY))
        if POLICY == ROUND_HARDWARE:
            sign = tl.where(nan, 0, (as_bits(x) >> 28) & 8)
        else:
            sign = ((v < 0) & (m != 0)).to(tl.int32) << 3
        return m | sign


@triton.jit
def fp4_quant_tile(x, RULE: tl.constexpr, POLICY: tl.constexpr, R: tl.constexpr, NATIVE: tl.constexpr,
                   PACKED: tl.constexpr = False):
    """reference fp4_quantize of one block-of-32 tile: x [R, 32] fp32 -> (packed uint8 [R, 16],
    exponent int32 [R]). RULE: a codes.ScaleRule (RULE_RECIP, RULE_PACK). Any NaN in x (whatever its bits) is
    treated as the reference's canonical NaN: ignored by amax, code 0x7. PACKED: see fp4_encode_tile (x must hold exact
    bf16 values; NVIDIA sm_80+)."""
    amax = amax_tile(x, NATIVE)
    if RULE == RULE_RECIP:
        e = ue8m0_recip(amax)
    else:
        e = ue8m0_pack(amax)
    return pack_nibbles_tile(fp4_encode_tile(x, e, POLICY, PACKED), R), e


# ---------------------------------------------------------------------------------------------------
# §7.2 stage 1 (fake quant): values, not codes
# ---------------------------------------------------------------------------------------------------
@triton.jit
def fake_quant_values(y, s):
    """y (already x / s) clamped to [-6, 6], |y| rounded half-to-even onto the E2M1 grid with the sign of
    y (a zero y counts as positive, so a negative y rounding to 0 gives -0), NaN kept, times s."""
    y = tl.where(y > 6.0, 6.0, y)
    y = tl.where(y < -6.0, -6.0, y)
    r = e2m1_grid_value(tl.abs(y))
    q = tl.where(y < 0, negate(r), r)
    q = tl.where(y != y, y, q)
    return q * s


@triton.jit
def fake_quant_ue8m0_tile(x, NATIVE: tl.constexpr):
    """Stage 1 with UE8M0 scales (rule recip) on a block-of-32 tile x [R, 32] (a NaN stays a NaN).
    Returns the unrounded fp32 values (callers round to the output dtype). x / 2^k is x * 2^-k (exact)."""
    e = ue8m0_recip(amax_tile(x, NATIVE))[:, None]
    return fake_quant_values(x * pow2_inv(e), pow2(e))


@triton.jit
def e4m3_rne_value(a):
    """a (fp32, in [2^-9, 448]) rounded half-to-even onto the e4m3fn grid, as fp32."""
    return fp8_round_value(a, 7, 448.0)


@triton.jit
def fake_quant_e4m3_tile(x, R: tl.constexpr, NATIVE: tl.constexpr):
    """Stage 1 with e4m3 scales on blocks of 16 (two per [R, 32] tile):
    s = e4m3_rne(clamp(fl(amax * fl(1/6)), 2^-9, 448)); values divided by s (true division)."""
    xb = tl.reshape(x, (R, 2, 16))
    a = tl.abs(xb)
    if NATIVE:
        amax = tl.maximum(tl.max(a, axis=2), 0.0)              # [R, 2]
    else:
        amax = tl.max(tl.where(a != a, 0.0, a), axis=2)
    f = amax * INV6
    f = tl.where(f < E4M3_TWO_M9, E4M3_TWO_M9, f)
    f = tl.where(f > 448.0, 448.0, f)
    s = tl.broadcast_to(e4m3_rne_value(f)[:, :, None], (R, 2, 16))
    return tl.reshape(fake_quant_values(tl.math.div_rn(xb, s), s), (R, 32))


# E2M1 codes without the per-element scaling (the fast paths of §7.2 and §7.7): a block's values v are put on the
# grid scaled by the block's power of two s = 2^(e-127) directly, and the code is read off float bits.
SIGN_NONZERO: tl.constexpr = tl.constexpr(0)    # sign bit only where the index is not 0 (rne, threshold)
SIGN_BIT: tl.constexpr = tl.constexpr(1)        # the sign bit of v, also for -0 and values rounding to 0 (hardware)
SIGN_NEGATIVE: tl.constexpr = tl.constexpr(2)   # v < 0 (the sign bit of v + 0: -0 counts as +0)


@triton.jit
def pow2_any(k):
    """The exact fp32 2^k for integers k in [-149, 127] (subnormal below -126), built from bits."""
    return from_bits(tl.where(k >= -126, (k + 127) << 23, 1 << (tl.maximum(k, -149) + 149)))


@triton.jit
def e2m1_grid_round_scaled(v, s):
    """v rounded half to even onto the E2M1 grid scaled by s (a power of two, normal), keeping v's sign, for
    |v| < 7 * s (not NaN): (v + M) - M with M = ±2^(E+22), E the exponent of max(|v|, s) and the sign of v.
    |v + M| lies in [2^(E+22), 2^(E+23)), whose quantum 2^(E-1) is the grid's spacing at |v| (0.5 s below 2 s,
    s in [2 s, 4 s), 2 s from 4 s on; (6 s, 7 s) rounds to 6 s); M is an even multiple of it, so the sum rounds
    half to even and the difference is exact. A v that rounds to 0 gives +0 (x - x = +0). Equals s times the
    reference's rne(v / s) for every such v (the sum and the grid are exact power-of-two scalings of the s = 1
    case, all in the normal range: M >= 2^-104)."""
    mx = tl.maximum(tl.abs(v), s)
    m = from_bits(((as_bits(mx) & 0x7F800000) + (22 << 23)) | (as_bits(v) & -2147483648))
    return (v + m) - m


@triton.jit
def e2m1_index_float(v, s, P, SIGN: tl.constexpr):
    """The E2M1 code of v / s (s a power of two, normal; v not NaN, |v| < 7 s), rounded half to even, as a float
    f = ±rne(|v| / s) * 2^(j-126) computed as the exact product (grid value * s) * P, P = 2^(j-126) / s (j = 0:
    the code of v / s; j = 1..3: of v / s * 2^j, exact on the grid where the §7.2 closed form uses it). Its
    bits are sign << 31 | index << 22: the index of a grid value g * 2^j <= 6 is the bits 22..24 of
    g * 2^(j-126) (0.5 -> 2^-127, subnormal), so `(bits(f) >> 22) & 0xF` (arithmetic shift) is the 4-bit code.
    Signs by SIGN: SIGN_NONZERO rounds the signed value (a result 0 is +0); SIGN_BIT and SIGN_NEGATIVE round
    |v| and put the sign of v (of v + 0) on every result, also on 0."""
    if SIGN == SIGN_NONZERO:
        return e2m1_grid_round_scaled(v, s) * P
    else:
        mx = tl.maximum(tl.abs(v), s)
        m = from_bits((as_bits(mx) & 0x7F800000) + (22 << 23))
        if SIGN == SIGN_BIT:
            sv = as_bits(v)
        else:
            sv = as_bits(v + 0.0)
        return ((tl.abs(v) + m) - m) * from_bits(as_bits(P) | (sv & -2147483648))


@triton.jit
def e2m1_index_float_any(x, e, POLICY: tl.constexpr):
    """fp4_encode_tile's code of every x with block exponent e (int32 1..255, broadcast against x), as an index
    float of e2m1_index_float (the pair packer takes both): v = x * 2^(127-e) as the reference divides, then
    rne(|v|) by the magic-number rounding on the unscaled grid (|v| < 7 by rule recip), ties toward zero under
    threshold (a sum that went up by exactly half the quantum steps back). Signs as the reference: hardware the
    sign bit of x, rne and threshold x < 0 with a nonzero index; a NaN x gives 0x7, e = 255 gives 0x7 (hardware:
    x's sign | 0x7, a NaN x 0x7). Elementwise, for the general paths of the fast kernels."""
    a = tl.abs(x * pow2_inv(e))
    m = from_bits((as_bits(tl.maximum(a, 1.0)) & 0x7F800000) + (22 << 23))
    d = (a + m) - m
    if POLICY == ROUND_THRESHOLD:
        d = tl.where(d - a == m * (2.0 ** -24), d - m * (2.0 ** -23), d)
    fb = as_bits(d * (2.0 ** -126))
    if POLICY == ROUND_HARDWARE:
        sg = as_bits(x) & -2147483648
        fill = sg | 0x01C00000
    else:
        sg = as_bits(x) & -2147483648 & -fb                    # -fb has bit 31 set exactly where fb != 0
        fill = tl.full(fb.shape, 0x01C00000, tl.int32)
    fb = tl.where(e == 255, fill, fb | sg)
    return from_bits(tl.where(x != x, 0x01C00000, fb))


@triton.jit
def amax_pairs(xe, xo, NATIVE: tl.constexpr):
    """SPEC §0.3 block amax (NaN ignored, all NaN: 0) of blocks given as even/odd elements [..., 16] -> [...]."""
    a = tl.maximum(tl.abs(xe), tl.abs(xo))
    if NATIVE:
        return tl.maximum(tl.max(a, axis=len(a.shape) - 1), 0.0)
    else:
        b = tl.abs(xe)
        c = tl.abs(xo)
        a = tl.maximum(tl.where(b != b, 0.0, b), tl.where(c != c, 0.0, c))
        return tl.max(a, axis=len(a.shape) - 1)


@triton.jit
def pack_index_pairs(fe, fo):
    """Index floats (e2m1_index_float: sign at bit 31, index at bits 22..24, the other bits 0) of elements 2i
    (fe) and 2i+1 (fo), any equal shapes -> bytes (uint8), 2i's code in the low nibble, 2i+1's in the high one.
    t = (fe >> 22) + (fo >> 18) (logical shifts) holds the indices at bits 0..2 and 4..6 and the signs at
    bits 9 and 13; moving t's signs down by 6 completes the byte."""
    t = (as_bits(fe) >> 22 & 0x3FF) + (as_bits(fo) >> 18 & 0x3FFF)
    return (t | ((t >> 6) & 0xFE)).to(tl.uint8)         # t >> 6: the signs at bits 3 and 7, bit 0 is t's bit 6


@triton.jit
def max_nan(a, b):
    """max that propagates NaN (a reduction with it gives NaN for a block holding one)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def two_stage_scales(xe, xo):
    """SPEC §7.2 stage 1 (recip fake-quant, bf16) then stage 2 (rule pack) of blocks of 32 given as their even
    and odd elements xe, xo [..., 16] (fp32 holding values of the input dtype), in closed form, the block part:
    (s1, P, stage-2 exponents int32, ok), each [...]; two_stage_codes gives the codes. Exact where ok: no NaN
    in the block and a stage-1 exponent e1 in [114, 143], or a block whose stage 1 is all zero; elsewhere the
    results are unspecified and the caller takes the general path. (e1 <= 143: no nonzero bf16 or fp16 x has
    an x / 2^(e1-127) that underflows to zero, bf16's smallest 2^-133 / 2^16 being 2^-149, so y < 0 is x < 0.)

    Stage 1 rounds y = x / 2^(e1-127) onto the E2M1 grid (g = rne(|y|); |y| < 6.0000002 for e1 by rule recip,
    so the clamp to 6 changes nothing) and stores ±g * s1, s1 = 2^(e1-127), with the sign of y (a negative y
    rounding to 0 gives -0, x = -0 gives +0): exact in bf16. Its block amax is G = gm * s1, gm = rne of the
    block's largest |y|, so stage 2's exponent is e2 = max(e1 - k, 114), k = 0, 1, 2, 3 for gm in {4, 6},
    {2, 3}, {1, 1.5}, {0.5} (ceil_exp(gm / 6) = 2^-k; 114 = ceil_exp(1e-4), the floor). The stage-2 values
    g * 2^j, j = e1 - e2 in [0, k], lie on the grid: no rounding, the same magnitude under every policy, index
    from the bits of g * 2^(j-126) = (stage-1 value) * P, P = 2^(j+1-e1)."""
    amax = tl.reduce(tl.maximum(tl.abs(xe), tl.abs(xo), propagate_nan=tl.PropagateNan.ALL), len(xe.shape) - 1,
                     max_nan)
    e1 = ue8m0_recip(amax)
    ok = (amax == amax) & (e1 <= 143)
    e1 = tl.where(ok, e1, 127)                               # keeps the scales below in range
    s1 = pow2(e1)
    g = e2m1_grid_round_scaled(amax, s1)                     # G = gm * s1
    zero = g == 0.0
    k = e1 + 2 - ((as_bits(g) >> 23) & 0xFF)
    j = tl.minimum(k, e1 - 114)
    ok = ok & ((j >= 0) | zero)
    j = tl.where(zero | (j < 0), 0, j)
    return s1, pow2_any(j + 1 - e1), tl.where(zero, 114, e1 - j), ok


@triton.jit
def two_stage_codes(xe, xo, s1, P, POLICY: tl.constexpr):
    """The payload bytes [..., 16] of blocks with two_stage_scales' s1 and P (where ok): the stage-1 value's code
    on the grid scaled by s1, times 2^j. Signs: hardware the sign bit of the stage-1 value (y < 0), rne and
    threshold only where the index is not 0."""
    LAST: tl.constexpr = len(xe.shape) - 1
    si = tl.expand_dims(s1, LAST)
    pp = tl.expand_dims(P, LAST)
    if POLICY == ROUND_HARDWARE:
        return pack_index_pairs(e2m1_index_float(xe, si, pp, SIGN_NEGATIVE), e2m1_index_float(xo, si, pp, SIGN_NEGATIVE))
    else:
        return pack_index_pairs(e2m1_index_float(xe, si, pp, SIGN_NONZERO), e2m1_index_float(xo, si, pp, SIGN_NONZERO))


# ---------------------------------------------------------------------------------------------------
# FP8 E4M3 (SPEC §4)
# ---------------------------------------------------------------------------------------------------
@triton.jit
def fp8_round_value(a, BIAS: tl.constexpr, FMAX: tl.constexpr):
    """a >= 0 fp32 (<= FMAX, not NaN) rounded half-to-even onto the E4M3 grid of the flavour, as fp32
    (reference fp8_encode's r = n * q)."""
    EMIN: tl.constexpr = 1 - BIAS
    e = tl.maximum(((as_bits(a) >> 23) & 0xFF) - 127, EMIN)
    q = pow2(e - 3 + 127)
    qi = pow2(127 + 3 - e)                                  # exact 1/q (e - 3 >= -10)
    n = (a * qi + 8388608.0) - 8388608.0                    # rint of a value in [0, 16): exact RNE
    r = n * q
    return tl.where(r > FMAX, FMAX, r)


@triton.jit
def fp8_encode(x, BIAS: tl.constexpr, FMAX: tl.constexpr, FNUZ: tl.constexpr, CANON: tl.constexpr):
    """SPEC §4 / reference fp8_encode: fp32 -> E4M3 code (int32 0..255). Round half to even, finite
    values and ±Inf beyond max saturate, NaN -> 0x7F|sign (e4m3fn) or 0x80 (e4m3fnuz); -0 and negatives
    rounding to 0 -> 0x80 (e4m3fn) / 0x00 (e4m3fnuz). CANON: a NaN counts as the canonical (positive)
    NaN, i.e. the code of encode(canon_nan(x)).

    Normal range: the mantissa is rounded to 3 bits on the integer bits (adding 2^19 - 1 plus the kept
    bit; a carry moves into the exponent exactly) and rebiased. Below the smallest normal 2^EMIN the code
    is rint(a / 2^(EMIN-3)), read off the bits of a + 2^(EMIN-3+23) (fp32 addition rounds half to even
    at exactly that quantum)."""
    EMIN: tl.constexpr = 1 - BIAS
    MAGIC: tl.constexpr = 2.0 ** (EMIN - 3 + 23)
    MAGIC_BITS: tl.constexpr = (EMIN - 3 + 23 + 127) << 23
    b = as_bits(x)
    a = tl.minimum(tl.abs(x), FMAX)                         # NaN: handled at the end
    ab = as_bits(a)
    code_norm = ((ab + (0x7FFFF + ((ab >> 20) & 1))) >> 20) - ((127 - BIAS) << 3)
    code_sub = as_bits(a + MAGIC) - MAGIC_BITS
    code = tl.where(a < 2.0 ** EMIN, code_sub, code_norm)
    if FNUZ:
        code = tl.where(b < 0, tl.where(code != 0, code | 0x80, code), code)
        code = tl.where(x != x, 0x80, code)
    else:
        code = code | ((b >> 24) & 0x80)
        if CANON:
            code = tl.where(x != x, 0x7F, code)
        else:
            code = tl.where(x != x, 0x7F | ((b >> 24) & 0x80), code)
    return code


@triton.jit
def fp8_encode_scaled(x, inv, BIAS: tl.constexpr, FMAX: tl.constexpr, FNUZ: tl.constexpr, HW: tl.constexpr):
    """Reference fp8_quantize's codes: encode(canon_nan(x * inv)), int32. HW (NVIDIA sm_89+, e4m3fn):
    the hardware cvt.rn.satfinite.e4m3x2.f32 (round half even, ±Inf and overflow saturate to ±448, NaN
    -> 0x7F, sign of zero kept), which is the same map; otherwise the software encoder."""
    y = x * inv
    if HW:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        return fp8_encode(y, BIAS, FMAX, FNUZ, True)


# ---------------------------------------------------------------------------------------------------
# rows of any power-of-two width (SPEC §0.2, §0.7, §5), used by the §7.6/§7.7 kernels (compress.py,
# rope_rotate.py), whose rows are 128..1024 wide: one [R, N] tile instead of four [R, 32] tiles
# ---------------------------------------------------------------------------------------------------
EXP_LOG2E: tl.constexpr = tl.constexpr(_f32(0x3FB8AA3B))      # §0.7 fl(log2 e)
EXP_LN2_HI: tl.constexpr = tl.constexpr(_f32(0x3F317200))     # ln 2, head (15 significant bits)
EXP_LN2_LO: tl.constexpr = tl.constexpr(_f32(0x35BFBE8E))     # ln 2, tail
EXP_C7: tl.constexpr = tl.constexpr(_f32(0x39500D01))         # 1/7!
EXP_C6: tl.constexpr = tl.constexpr(_f32(0x3AB60B61))         # 1/6!
EXP_C5: tl.constexpr = tl.constexpr(_f32(0x3C088889))         # 1/5!
EXP_C4: tl.constexpr = tl.constexpr(_f32(0x3D2AAAAB))         # 1/4!
EXP_C3: tl.constexpr = tl.constexpr(_f32(0x3E2AAAAB))         # 1/3!
EXP_C2: tl.constexpr = tl.constexpr(_f32(0x3F000000))         # 1/2!
EXP_C1: tl.constexpr = tl.constexpr(_f32(0x3F800000))         # 1/1!
TWO_23: tl.constexpr = tl.constexpr(8388608.0)
TWO_M64: tl.constexpr = tl.constexpr(2.0 ** -64)               # pow2(63), §0.7 subnormal step


@triton.jit
def rint_f32(v):
    """Round half to even to an integer (fp32 in, fp32 out), without libdevice (the interpreter has no
    rint): |v| < 2^23 is rounded by adding and subtracting 2^23 (the sum lies in [2^23, 2^24), where the
    fp32 quantum is 1 and the addition rounds half to even; 2^23 is even, so ties go to the even
    integer); larger |v| (and NaN, ±Inf) are integers already. The sign of a zero result may differ from
    C rint; exp_ds never lets it matter."""
    a = tl.abs(v)
    r = (a + TWO_23) - TWO_23
    r = tl.where(v < 0, 0.0 - r, r)
    return tl.where(a < TWO_23, r, v)


@triton.jit
def exp_ds(x):
    """SPEC §0.7 exp_ds, the one exponential of format math (fp32, defined for x <= 0), step by step:
    n = rint(fl(x * log2e)); r = fl(fl(x - fl(n*LN2_HI)) - fl(n*LN2_LO)); a = 1/7!, then a = fl(c + fl(r*a))
    for c = 1/6! .. 1/1!; p = fl(1 + fl(r*a)); 2^n applied from bits (one rounding into the subnormals).
    NaN gives the NaN x itself, -Inf gives +0, n < -151 gives +0 (as the reference arith.exp_ds)."""
    inf = (x == FLT_INF) | (x == -FLT_INF)
    xs = tl.where(inf, 0.0, x)
    n = rint_f32(xs * EXP_LOG2E)
    r = (xs - n * EXP_LN2_HI) - n * EXP_LN2_LO
    a = tl.full(x.shape, EXP_C7, tl.float32)
    a = EXP_C6 + r * a
    a = EXP_C5 + r * a
    a = EXP_C4 + r * a
    a = EXP_C3 + r * a
    a = EXP_C2 + r * a
    a = EXP_C1 + r * a
    p = 1.0 + r * a
    nc = tl.where(n != n, 0.0, n)                        # NaN x: any n (the result is x)
    nc = tl.minimum(tl.maximum(nc, -200.0), 200.0)
    ni = nc.to(tl.int32)
    normal = p * pow2(tl.minimum(tl.maximum(ni + 127, 1), 254))
    sub = (p * pow2(tl.minimum(tl.maximum(ni + 191, 1), 254))) * TWO_M64
    y = tl.where(ni >= -126, normal, sub)
    y = tl.where(ni < -151, 0.0, y)
    y = tl.where(x == -FLT_INF, 0.0, y)
    return tl.where(x != x, x, y)


@triton.jit
def butterfly_row(p, R: tl.constexpr, M: tl.constexpr):
    """SPEC §0.2 butterfly of [R, M] partials (M a power of two <= 256) -> [R]: for s = M/2, ..., 1:
    p[i] = p[i] + p[i ^ s]; the result is p[0] (each level keeps the lower half, `halve`)."""
    if M >= 2:
        p = halve(p, R, M)
    if M >= 4:
        p = halve(p, R, M // 2)
    if M >= 8:
        p = halve(p, R, M // 4)
    if M >= 16:
        p = halve(p, R, M // 8)
    if M >= 32:
        p = halve(p, R, M // 16)
    if M >= 64:
        p = halve(p, R, M // 32)
    if M >= 128:
        p = halve(p, R, M // 64)
    if M >= 256:
        p = halve(p, R, M // 128)
    return tl.reshape(p, (R,))


@triton.jit
def canonical_sum_row(x, R: tl.constexpr, N: tl.constexpr):
    """SPEC §0.2 canonical sum of each row of x [R, N] (N = 4*2^j, 4..1024) -> [R]: partials
    ((x[4i] + x[4i+1]) + x[4i+2]) + x[4i+3], then the butterfly (equals canonical_sum4 for N = 128)."""
    ev, od = tl.split(tl.reshape(x, (R, N // 4, 2, 2)))   # [R, N/4, 2]: (x[4i], x[4i+2]), (x[4i+1], x[4i+3])
    e0, e2 = tl.split(ev)
    e1, e3 = tl.split(od)
    return butterfly_row(((e0 + e1) + e2) + e3, R, N // 4)


@triton.jit
def rms_norm_row(x, w, eps, R: tl.constexpr, N: tl.constexpr):
    """SPEC §5 RMSNorm of rows x [R, N] with weight w (fp32, broadcastable to [R, N]): inv = fl(1 / fl(sqrt(
    fl(S(x*x) / N) + eps))), y = fl(w * fl(x * inv)); S the canonical sum, / N exact (a power of two). Not
    rounded."""
    inv = inv_sqrt(canonical_sum_row(x * x, R, N) * (1.0 / N) + eps)[:, None]
    return w * (x * inv)


@triton.jit
def rope_tail_row(x, c, s, R: tl.constexpr, N: tl.constexpr):
    """SPEC §5 RoPE with interleaved pairs (N-64+2j, N-64+2j+1) and cos/sin index j on the last 64 dims of
    rows x [R, N] (N >= 128); c, s [R, 32] fp32. Not rounded. The other dims pass through unchanged (the
    rotation is computed for every 64-dim chunk and selected for the last one: no slicing in Triton)."""
    a, b = tl.split(tl.reshape(x, (R, N // 64, 32, 2)))    # [R, N/64, 32]
    cc = c[:, None, :]
    ss = s[:, None, :]
    a2, b2 = rope_pair(a, b, cc, ss)
    tail = (tl.arange(0, N // 64) == N // 64 - 1)[None, :, None]
    return tl.reshape(tl.join(tl.where(tail, a2, a), tl.where(tail, b2, b)), (R, N))


@triton.jit
def hadamard_level_row(x, R: tl.constexpr, N: tl.constexpr, H: tl.constexpr):
    """One Sylvester level with stride H on rows x [R, N]: (a, b) at (i, i+H), bit H of i clear ->
    (a+b, a-b)."""
    y = tl.permute(tl.reshape(x, (R, N // (2 * H), 2, H)), (0, 1, 3, 2))    # [R, G, H, 2]
    a, b = tl.split(y)
    z = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))                      # [R, G, 2, H]
    return tl.reshape(z, (R, N))


@triton.jit
def hadamard_row(x, R: tl.constexpr, N: tl.constexpr, SCALE: tl.constexpr):
    """SPEC §5 Hadamard over rows x [R, N] (N a power of two, 128..1024), Sylvester order (h = 1, 2, ...,
    N/2), then times SCALE = fl(N^-0.5) (fl(128^-0.5) = 0x3DB504F3 for N = 128)."""
    for k in tl.static_range(10):          # h = 2^k < N (N <= 1024)
        if (2 << k) <= N:
            x = hadamard_level_row(x, R, N, 1 << k)
    return x * SCALE


@triton.jit
def pack_nibbles_row(codes, R: tl.constexpr, N: tl.constexpr):
    """[R, N] codes (int32, low 4 bits) -> [R, N/2] bytes (uint8): element 2i low nibble, 2i+1 high."""
    lo, hi = tl.split(tl.reshape(codes, (R, N // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def fp8_group_quant(x, FLOOR: tl.constexpr, ue8m0, BIAS: tl.constexpr, FMAX: tl.constexpr, FNUZ: tl.constexpr,
                    HW: tl.constexpr, NATIVE: tl.constexpr):
    """SPEC §4 scale and codes of groups x [N, G] (fp32, any NaN counts as the canonical NaN):
    s = fl(max(amax, FLOOR) / FMAX) (true division), rounded up to pow2(ceil_exp(s)) when ue8m0 != 0; codes
    encode(x * fl(1/s)) (int32 [N, G]) and s [N]. FLOOR = 1e-4f for the k rule (§7.6 FP8), 1e-10f for §7.7
    (which passes ue8m0 = 0: fp32 scales)."""
    amax = amax_tile(x, NATIVE)
    a = tl.where(amax < FLOOR, FLOOR, amax)
    s = tl.math.div_rn(a, tl.full(a.shape, FMAX, tl.float32))
    if ue8m0 != 0:
        s = pow2(ceil_exp(s))
    inv = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    return fp8_encode_scaled(x, inv[:, None], BIAS, FMAX, FNUZ, HW), s

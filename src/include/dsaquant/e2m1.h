// dsaquant/e2m1.h: E2M1 (FP4) codes (SPEC §1), the three rounding policies (SPEC §2), nibble
// packing, the per-block encoder with the NaN-scale rule (SPEC §3) and the §7.2 stage-1 value.
#pragma once

#include "arith.h"
#include "codes.h"

namespace dsq {

// Rounding (SPEC §2 policies) is defined in codes.h.

// SPEC §2: already-scaled fp32 v -> 4-bit code (bit 3 sign, bits 0..2 magnitude index m), the
// bit-exact emulation used on every target.
//  m:    number of midpoints 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 that |v| exceeds; under rne and
//        hardware a tie at 0.75, 1.75, 3.5 goes up (to the even index), every other tie goes down;
//        threshold sends every tie down. |v| > 5 (Inf included) gives 7. NaN gives m = 7 (ours).
//  sign: threshold/rne: set only if v < 0 and m != 0 (so -0, NaN and small negatives give 0x0).
//        hardware: the sign bit of v, always (-0 -> 0x8, -NaN -> 0xF).
// Computed on the bits rather than by seven comparisons: c = min(|v|, 6) (NaN -> 6, so m = 7);
// for c >= 1 (E2M1's normal range, one mantissa bit) the fp32 mantissa is rounded at bit 22 by an
// integer add (2^21 - 1, plus the kept bit for ties to even; a carry moves into the exponent
// exactly) and m = bits >> 22 minus 252 (1.0 = 0x3F800000 -> 2); below 1 the quantum is 0.5 and
// fl(c + 2^22) rounds c half to even onto it (m = its bits minus those of 2^22), after which
// threshold takes back the one tie that went up (0.75 -> 1.0). tests/test_header_host.py checks
// this against the reference (every bf16 value at every exponent, and an fp32 sweep).
DSQ_HD uint8_t e2m1_encode(float v, Rounding r) {
  // Both ranges are computed and one is selected (no branch: lanes of a warp hold values of both).
  const float a = abs_f(v);
  const float c = fmin_nn(a, 6.0f);   // NaN -> 6 (platform.h: the non-NaN operand)
  const uint32_t b = f2u(c);
  const bool even_up = r != Rounding::threshold;
  const uint32_t m_sub = f2u(fadd(c, 4194304.0f)) - 0x4A800000u - static_cast<uint32_t>(!even_up && c == 0.75f);
  const uint32_t m_norm = ((b + 0x1FFFFFu + (even_up ? (b >> 22) & 1u : 0u)) >> 22) - 252u;
  const uint32_t m = c < 1.0f ? m_sub : m_norm;
  const bool neg = r == Rounding::hardware ? sign_bit(v) : (v < 0.0f && m != 0u);
  return static_cast<uint8_t>((neg ? 8u : 0u) | m);
}

// SPEC §1: code (low nibble) -> fp32; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; 0x8 gives -0.
DSQ_HD float e2m1_decode(uint8_t code) {
  const uint32_t m = code & 7u;
  // m >= 2: (1 + (m & 1) / 2) * 2^((m >> 1) - 1), built from bits; m = 1: 0.5; m = 0: 0.
  const uint32_t mag = m == 0u ? 0u : (m == 1u ? 0x3F000000u : ((126u + (m >> 1)) << 23) | ((m & 1u) << 22));
  return u2f(mag | ((code & 8u) ? 0x80000000u : 0u));
}

// SPEC §1 packing: element 2i in the low nibble, element 2i+1 in the high nibble of byte i.
DSQ_HD uint8_t pack_nibbles(uint8_t lo, uint8_t hi) {
  return static_cast<uint8_t>((lo & 0xFu) | ((hi & 0xFu) << 4));
}

// SPEC §3: every code of a block whose exponent is 255 (a NaN scale, from infinite amax under rule
// `recip`): sign(x) | 7 under hardware, 7 otherwise (ours).
DSQ_HD uint8_t e2m1_nan_scale_code(float x, Rounding r) {
  return static_cast<uint8_t>(r == Rounding::hardware && sign_bit(x) ? 0xF : 0x7);
}

// SPEC §3 + §2: code of x in a block with biased exponent e (1..255): v = x / 2^(e-127), one
// correctly rounded division (exact unless v is subnormal, where every policy gives m = 0).
DSQ_HD uint8_t e2m1_encode_scaled(float x, int e, Rounding r) {
  const uint8_t code = e2m1_encode(fmul(x, inv_pow2(e)), r);   // = fl(x / 2^(e-127)), arith.h inv_pow2
  return e == 255 ? e2m1_nan_scale_code(x, r) : code;          // (a select, not a branch)
}

// Two consecutive elements (2i, 2i+1) of a block with exponent e -> one packed byte.
// gfx950, policy hardware: V_CVT_SCALEF32_PK_FP4_F32 (SPEC §2). It divides both inputs by the
// scale, of which only the exponent is read; src0 goes to the low nibble of the selected byte.
// Behaviours documented by the SPEC but not yet confirmed on MI355 silicon against the emulation
// (tests/test_header_builds.py only checks that the instruction is emitted):
//   - the sign of a NaN input (SPEC: sign of the NaN | 0x7),
//   - subnormal fp32 inputs and results (the emulation keeps them: SPEC §0.6; they always give m = 0),
//   - the sign of zero and of negatives that round to zero (SPEC: kept, 0x8),
//   - ±Inf inputs (SPEC: saturate, sign | 0x7), and whether any scale mantissa bit is read,
//   - |v| in (0.25, 0.5) (SPEC: 0.5, code 1; a public AMD software model of the instruction flushes
//     every |v| < 0.5 to 0).
// See docs/shared_header.md, "gfx950 notes".
// e = 255 never reaches the instruction: SPEC §3's NaN-scale rule is applied first.
DSQ_HD uint8_t e2m1_encode_pair(float x_even, float x_odd, int e, Rounding r) {
#if defined(__gfx950__)
  if (r == Rounding::hardware && e != 255)
    return static_cast<uint8_t>(__builtin_amdgcn_cvt_scalef32_pk_fp4_f32(0u, x_even, x_odd, pow2(e), 0) & 0xFFu);
#endif
  return pack_nibbles(e2m1_encode_scaled(x_even, e, r), e2m1_encode_scaled(x_odd, e, r));
}

// One block of 32 fp32 values with exponent e -> 16 packed bytes (SPEC §1-§3). This is a
// quantizer's entry: NaN inputs are made canonical (positive) first, so they give 0x7 under every
// policy, also in a NaN-scale block (unlike the raw e2m1_encode, which keeps a NaN's sign).
DSQ_HD void fp4_encode_block32(const float* x, int e, Rounding r, uint8_t* out16) {
  for (int i = 0; i < 16; ++i) out16[i] = e2m1_encode_pair(canon_nan(x[2 * i]), canon_nan(x[2 * i + 1]), e, r);
}

// SPEC §7.2 stage 1 for one element with block scale s (s = pow2(e)): y = clamp(x / s, -6, 6);
// |y| rounded half to even onto the grid, given the sign of y (a zero y counts as positive:
// -0 -> +0, small negatives -> -0); times s. A NaN result is the canonical NaN (with e = 255,
// s = +Inf, the whole block is NaN). Callers round the result to bf16.
DSQ_HD float fp4_fake_quant_from_y(float y, float s) {
  const float yc = clamp_hi(clamp_lo(y, -6.0f), 6.0f);
  const float q = e2m1_decode(e2m1_encode(abs_f(yc), Rounding::rne) & 7u);
  return canon_nan(fmul(is_nan(yc) ? yc : (yc < 0.0f ? -q : q), s));
}

DSQ_HD float fp4_fake_quant_value(float x, float s) { return fp4_fake_quant_from_y(fdiv(x, s), s); }

// The same with a UE8M0 scale s = pow2(e): x / s as an exact multiply by the reciprocal (arith.h inv_pow2).
DSQ_HD float fp4_fake_quant_value_e(float x, int e) {
  return fp4_fake_quant_from_y(e == 255 ? fdiv(x, pow2(e)) : fmul(x, inv_pow2(e)), pow2(e));
}

}  // namespace dsq

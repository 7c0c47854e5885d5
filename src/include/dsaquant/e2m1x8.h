// dsaquant/e2m1x8.h: the E2M1 block encoder (SPEC §1-§3) for bf16 inputs, two values per 32-bit
// operation: eight values of one block -> four packed bytes; and (at the end) the same for fp32 inputs, rounded
// to odd bf16 first. Byte-identical to e2m1_encode_pair on the same values (tests/test_header_host.py: every
// bf16 value at every exponent, every policy; fp32 sweeps at every exponent).
//
// Why: the scalar encoder (e2m1.h) costs about 15 integer instructions per value, which bounds the
// FP4 indexer on the ALU pipe. Here the rounding is done by the bf16 FMA unit, two values at a time:
//   c = min(|v|, 6)                         (NaN -> 6, so m = 7)
//   M = 2^(E'+6), E' = max(floor(log2 c), 0) (then bf16's ulp at M is E2M1's quantum at c: 0.5, 1, 2)
//   R = fl(c*K + M)                          one rounding onto the quantum; K = 1 rounds half to even
//                                            (rne, hardware); K = 1 - 2^-8 sends ties down (threshold:
//                                            c*2^-8 is below one bf16 ulp of c, so only exact ties move)
//   G = fl((R - M) * 2^-126)                 exact; the E2M1 grid value g scaled into bf16's smallest
//                                            binades, where bits 6..8 of g * 2^-126 are the index m
//                                            (0.5 -> 0x0040 -> 1, 1 -> 0x0080 -> 2, ..., 6 -> 0x01C0 -> 7).
// The sign (bit 3) is the input's sign bit (a NaN counts as positive: the quantizer's canonical NaN);
// threshold and rne keep it only where m != 0.
//
// Primitives: bf16x2_fma (one rounding, half to even, subnormals kept) and bf16x2_min_nn / max_nn
// (a NaN operand is ignored). CUDA sm_80+: one instruction each (fma.rn.bf16x2, min/max.bf16x2).
// Elsewhere (host, HIP) an exact emulation, so that the CPU tests check the same algorithm; the HIP
// kernels keep the scalar encoder (gfx950's hardware-policy instruction lives there).
#pragma once

#include "e2m1.h"

namespace dsq {

// Packed bf16x2 words: value 0 in bits 0..15, value 1 in bits 16..31.
#if defined(DSQ_CUDA_DEVICE) && (__CUDA_ARCH__ >= 800)
#define DSQ_BF16X2_NATIVE 1
#endif

#if !defined(DSQ_BF16X2_NATIVE)
// Exact emulation of one bf16 FMA: a*b is exact in double (8 + 8 significant bits); the sum is split
// into its double rounding s and the exact error (two-sum), which breaks a tie of s at bf16 precision.
DSQ_HD uint16_t bf16_fma_emulated(uint16_t a, uint16_t b, uint16_t c) {
  const double p = static_cast<double>(bf16_to_f32(a)) * static_cast<double>(bf16_to_f32(b));
  const double cd = bf16_to_f32(c);
  const double s = p + cd;
  if (s != s) return 0x7FC0u;                                     // NaN (payload: the canonical one)
  if (s == 0.0) return sign_bit(static_cast<float>(s)) ? 0x8000u : 0u;
  const uint16_t sg = s < 0.0 ? 0x8000u : 0u;
  if (std::isinf(s)) return sg | 0x7F80u;
  const double bb = s - p, err = (p - (s - bb)) + (cd - bb);     // s + err == p + c exactly
  const double as = std::fabs(s);
  int ex;
  std::frexp(as, &ex);                                            // as in [2^(ex-1), 2^ex)
  const int q = (ex - 1 > -126 ? ex - 1 : -126) - 7;              // bf16 ulp 2^q at as (subnormal floor)
  const double k = std::ldexp(as, -q);                            // exact
  const double fl = std::floor(k);
  double r = std::nearbyint(k);                                   // half to even
  if (k - fl == 0.5 && err != 0.0) r = ((err > 0.0) == (s > 0.0)) ? fl + 1.0 : fl;
  const double mag = std::ldexp(r, q);
  if (mag >= 0x1p128) return sg | 0x7F80u;
  return static_cast<uint16_t>(sg | (f2u(static_cast<float>(mag)) >> 16));
}
#endif

// Per half: fl_bf16(a * b + c), one rounding to nearest even.
DSQ_HD uint32_t bf16x2_fma(uint32_t a, uint32_t b, uint32_t c) {
#if defined(DSQ_BF16X2_NATIVE)
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
#else
  const uint32_t lo = bf16_fma_emulated(a & 0xFFFFu, b & 0xFFFFu, c & 0xFFFFu);
  const uint32_t hi = bf16_fma_emulated(a >> 16, b >> 16, c >> 16);
  return lo | (hi << 16);
#endif
}

// Per half: the smaller (kMax false) / larger value, a NaN operand ignored (two NaNs give a NaN).
template <bool kMax>
DSQ_HD uint32_t bf16x2_minmax_nn(uint32_t a, uint32_t b) {
#if defined(DSQ_BF16X2_NATIVE)
  uint32_t d;
  if (kMax)
    asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  else
    asm("min.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#else
  const auto one = [](uint32_t x, uint32_t y) {
    const float fx = bf16_to_f32(x & 0xFFFFu), fy = bf16_to_f32(y & 0xFFFFu);
    return f2u(kMax ? fmax_nn(fx, fy) : fmin_nn(fx, fy)) >> 16;
  };
  return one(a, b) | (one(a >> 16, b >> 16) << 16);
#endif
}
DSQ_HD uint32_t bf16x2_min_nn(uint32_t a, uint32_t b) { return bf16x2_minmax_nn<false>(a, b); }
DSQ_HD uint32_t bf16x2_max_nn(uint32_t a, uint32_t b) { return bf16x2_minmax_nn<true>(a, b); }

// Per half: the smaller value, or a NaN where either operand is NaN (payload unspecified: CUDA's
// min.NaN gives 0x7FFF, the emulation 0x7FC0). Only ever compared with a non-negative operand here, so
// the order of +0 and -0 never matters.
DSQ_HD uint32_t bf16x2_min_nan(uint32_t a, uint32_t b) {
#if defined(DSQ_BF16X2_NATIVE)
  uint32_t d;
  asm("min.NaN.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#else
  const auto one = [](uint32_t x, uint32_t y) -> uint32_t {
    const float fx = bf16_to_f32(x & 0xFFFFu), fy = bf16_to_f32(y & 0xFFFFu);
    return is_nan(fx) || is_nan(fy) ? 0x7FC0u : f2u(fmin_nn(fx, fy)) >> 16;
  };
  return one(a, b) | (one(a >> 16, b >> 16) << 16);
#endif
}

// Byte permute (CUDA __byte_perm): byte i of the result is byte sel_i of the pair (b:a), sel_i the
// i-th nibble of s (0..7).
DSQ_HD uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t s) {
#if defined(DSQ_CUDA_DEVICE)
  return __byte_perm(a, b, s);
#else
  const uint64_t ab = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) d |= static_cast<uint32_t>((ab >> (8 * ((s >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
  return d;
#endif
}

// The block's 1 / 2^(e-127) = 2^(127-e) in both halves (e in 1..254; 254 gives the subnormal 2^-127).
DSQ_HD uint32_t bf16x2_inv_pow2(int e) {
  const uint32_t h = e < 254 ? static_cast<uint32_t>(254 - e) << 7 : (e == 254 ? 0x0040u : 0u);
  return h | (h << 16);
}

// SPEC §3 rule `recip` for a bf16 amax, on its bits b (>= 0; a NaN counts as 0, the all-NaN block):
// equal to ue8m0_exponent(bf16_to_f32(b), recip). For amax = m * 2^k (m in [1, 2), 7 fraction bits),
// f = fl(m * fl(1/6)) * 2^k lies in [1/6, 1/4) * 2^k for m < 1.5 (never a power of two), is exactly
// 2^(k-2) for m = 1.5 (fl(1.5 * fl(1/6)) = 0.25), and lies in (1/4, 1/3) * 2^k for m > 1.5; so
// e = E - 2 + (fraction > 0x40) = ((b + 63) >> 7) - 2 with E the biased exponent, at least 1 (the floor
// 6 * 2^-126 gives e = 1, as do smaller amax); Inf gives 255. tests/test_header_host.py checks all 2^15.
DSQ_HD int ue8m0_recip_exponent_bf16(uint32_t b) {
  const int e = static_cast<int>((b + 63u) >> 7) - 2;
  return b == 0x7F80u ? 255 : (b > 0x7F80u || e < 1 ? 1 : e);
}

// SPEC §3 rule `pack` for a bf16 amax, on its bits b (0 .. 0x7F80): equal to ue8m0_exponent(bf16_to_f32(b),
// pack). amax / 6 splits as rule recip's amax * fl(1/6) does above (m / 1.5 with 7 fraction bits is never
// within an fp32 rounding of a power of two), so ceil_exp(amax / 6) = ((b + 63) >> 7) - 2 for a normal amax;
// the floor 1e-4f (ceil_exp = 114) covers every smaller amax, subnormals included; Inf gives 255, clamped to
// 254. tests/test_header_host.py checks all 2^15 + 1 values.
DSQ_HD int ue8m0_pack_exponent_bf16(uint32_t b) {
  const int e = static_cast<int>((b + 63u) >> 7) - 2;
  return b >= 0x7F80u ? 254 : (e < 114 ? 114 : e);
}

// The same for two blocks at once, with their encoder multipliers: m = amax_a | amax_b << 16 (bf16
// bits, each 0..0x7F80: the caller maps an all-NaN block's NaN to 0). Per half, t = (e + 2) << 7 =
// max((b + 63) & 0xFF80, 3 << 7) (no carry crosses the halves; non-negative bf16 bits order as
// integers), and 2^(127-e) has the bits (254 - e) << 7 = 0x8000 - t (e <= 253 for a finite amax).
// An Inf amax gives e = 255 and a multiplier the encoder ignores (nan_scale). tests/test_header_host.py
// checks every amax in either half against ue8m0_recip_exponent_bf16 and bf16x2_inv_pow2.
struct Bf16x2Scales {
  uint32_t s_a, s_b;     // 2^(127-e) in both halves of each word (e2m1_encode8_bf16_s)
  int e_a, e_b;          // the exponents, 1..255
  bool nan_a, nan_b;     // e == 255 (an Inf amax: the NaN scale)
};
DSQ_HD Bf16x2Scales ue8m0_recip_scales_bf16x2(uint32_t m) {
  const uint32_t t = bf16x2_max_nn((m + 0x003F003Fu) & 0xFF80FF80u, 0x01800180u);
  const uint32_t s = 0x80008000u - t;
  const bool inf_a = (m << 16) == 0x7F800000u, inf_b = m >= 0x7F800000u;
  return Bf16x2Scales{byte_perm(s, s, 0x1010u),
                      byte_perm(s, s, 0x3232u),
                      inf_a ? 255 : static_cast<int>((t & 0xFFFFu) >> 7) - 2,
                      inf_b ? 255 : static_cast<int>(t >> 23) - 2,
                      inf_a,
                      inf_b};
}

// Words of |x| (sign bits cleared), as the encoder and a bf16x2 amax take them. CUDA: abs.bf16x2, which
// ptxas folds into the |x| operand modifiers of the max and multiply that read it (no instruction).
DSQ_HD uint32_t bf16x2_abs(uint32_t x) {
#if defined(DSQ_BF16X2_NATIVE)
  uint32_t d;
  asm("abs.bf16x2 %0, %1;" : "=r"(d) : "r"(x));
  return d;
#else
  return x & 0x7FFF7FFFu;
#endif
}

// The last steps of the encoder below, shared with the SPEC §7.2 two-stage encoder (two_stage_x8.h).
// Magnitudes: z[j] holds m of value j at bits 6..8 and of value j + 4 at bits 22..24 (every other bit
// clear); the nibbles of values 0..7 in order (the fields do not overlap: + is |, and the multiplies can go
// to the FMA pipe on CUDA).
DSQ_HD uint32_t e2m1_mags8_bf16(const uint32_t (&z)[4]) {
  const uint32_t lo = z[0] + z[1] * 16u, hi = z[2] + z[3] * 16u;
  return (lo >> 6) + hi * 4u;
}
// Signs: xc[j] holds the signs of values j and j + 4 at bits 15 and 31; bytes 1 and 3 of each word hold
// them at bit 7; gather values (0, 2, 4, 6) and (1, 3, 5, 7) into bit 3 of each nibble.
DSQ_HD uint32_t e2m1_signs8_bf16(const uint32_t (&xc)[4]) {
  return ((byte_perm(xc[0], xc[2], 0x7351u) >> 4) & 0x08080808u) | (byte_perm(xc[1], xc[3], 0x7351u) & 0x80808080u);
}
// The codes (SPEC §2): hardware keeps every sign; threshold and rne keep it where m != 0 (bit 3 of a
// nibble m + 7 is set iff m != 0).
DSQ_HD uint32_t e2m1_join8(uint32_t mag, uint32_t sg, Rounding r) {
  return r == Rounding::hardware ? mag | sg : mag | (sg & (mag + 0x77777777u));
}

// SPEC §2 + §3, policy R: eight bf16 values of one block, given as x[j] = (value j, value j + 4) and
// ax[j] = bf16x2_abs(x[j]), with the block's multiplier s = 2^(127-e) in both halves (bf16x2_inv_pow2,
// ue8m0_recip_scales_bf16x2) -> four packed bytes (value 2i in the low nibble of byte i, SPEC §1). NaN
// inputs count as the canonical (positive) NaN; nan_scale (e = 255) gives sign | 0x7 under hardware and
// 0x7 otherwise (SPEC §3), whatever s is. Equals, byte for byte,
// pack_nibbles(e2m1_encode_scaled(canon_nan(x[2i]), e, R), e2m1_encode_scaled(canon_nan(x[2i+1]), e, R)).
template <Rounding R>
DSQ_HD uint32_t e2m1_encode8_bf16_s(const uint32_t (&x)[4], const uint32_t (&ax)[4], uint32_t s, bool nan_scale) {
  constexpr uint32_t kNegZero = 0x80008000u, kSix = 0x40C040C0u, kOne = 0x3F803F80u, kInf = 0x7F807F80u;
  constexpr uint32_t k64 = 0x42804280u, kMinus2m120 = 0x83808380u, k2m126 = 0x00800080u;
  constexpr uint32_t kK = R == Rounding::threshold ? 0x3F7F3F7Fu : kOne;   // 1 - 2^-8 : 1
  uint32_t z[4], xc[4];
  for (int j = 0; j < 4; ++j) {
    const uint32_t c = bf16x2_min_nn(bf16x2_fma(ax[j], s, kNegZero), kSix);    // min(|v|, 6), exact
    const uint32_t mx = bf16x2_max_nn(c, kOne) & 0x7F807F80u;                  // 2^E'
    const uint32_t r = bf16x2_fma(c, kK, bf16x2_fma(mx, k64, kNegZero));       // fl(c*K + M)
    z[j] = bf16x2_fma(r, k2m126, bf16x2_fma(mx, kMinus2m120, kNegZero));       // (R - M) * 2^-126: m << 6
    xc[j] = bf16x2_min_nn(x[j], kInf);                                         // a NaN -> +Inf (positive)
  }
  const uint32_t mag = e2m1_mags8_bf16(z), sg = e2m1_signs8_bf16(xc);
  const uint32_t out = e2m1_join8(mag, sg, R);
  const uint32_t nan_out = R == Rounding::hardware ? (0x77777777u | sg) : 0x77777777u;
  return nan_scale ? nan_out : out;
}
// The same with the block's exponent e (1..255).
template <Rounding R>
DSQ_HD uint32_t e2m1_encode8_bf16(const uint32_t (&x)[4], const uint32_t (&ax)[4], int e) {
  return e2m1_encode8_bf16_s<R>(x, ax, bf16x2_inv_pow2(e), e == 255);
}

// ---- fp32 inputs: eight values of one block per call --------------------------------------------------------
// Two fp32 values rounded to odd bf16, packed (lo in bits 0..15): each value's top 16 bits, with the lowest kept
// bit set when any dropped bit is (von Neumann rounding). A value's order and equality with every number of at
// most 6 significant bits (bf16 has 8) and at least bf16's smallest exponent survive it, so any later rounding to
// at most 6 bits (E2M1: 2) of the rounded value, times any power of two, equals that rounding of the fp32 value
// times the same power (the scaled E2M1 midpoints are such numbers; NaN stays NaN, Inf stays Inf).
// CUDA sm_90+: two byte permutes, one min.u16x2 (the dropped bits' "any set") and one OR.
DSQ_HD uint32_t bf16x2_round_odd(float lo, float hi) {
  const uint32_t top = byte_perm(f2u(lo), f2u(hi), 0x7632u), low = byte_perm(f2u(lo), f2u(hi), 0x5410u);
#if defined(DSQ_CUDA_DEVICE) && (__CUDA_ARCH__ >= 900)
  uint32_t sticky;
  asm("min.u16x2 %0, %1, %2;" : "=r"(sticky) : "r"(low), "r"(0x00010001u));
#else
  const uint32_t sticky = ((low & 0xFFFFu) != 0u ? 1u : 0u) | ((low >> 16) != 0u ? 0x10000u : 0u);
#endif
  return top | sticky;
}

// SPEC §2 + §3, policy R: eight fp32 values x[0..7] of one block, block multiplier s = bf16x2_inv_pow2(e) (both
// halves), nan_scale = (e == 255) -> four packed bytes (value 2i in the low nibble of byte i), byte-identical to
// pack_nibbles(e2m1_encode_scaled(canon_nan(x[2i]), e, R), e2m1_encode_scaled(canon_nan(x[2i+1]), e, R)) for every
// x and e. The values are rounded to odd bf16 (bf16x2_round_odd: the E2M1 code of x / 2^(e-127) is unchanged) and
// encoded by e2m1_encode8_bf16_s. Why: the scalar encoder costs about 15 ALU-pipe instructions a value, which
// bounds a kernel that encodes fp32 values (rope_rotate_quant); this form costs about 8, two values per operation.
// HIP keeps the scalar encoder (gfx950's hardware-policy instruction lives there; bf16x2 is emulated on AMD).
template <Rounding R>
DSQ_HD uint32_t e2m1_encode8_f32_s(const float (&x)[8], int e, uint32_t s, bool nan_scale) {
#if defined(DSQ_HIP_DEVICE)
  (void)s;
  (void)nan_scale;
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i)
    out |= static_cast<uint32_t>(e2m1_encode_pair(canon_nan(x[2 * i]), canon_nan(x[2 * i + 1]), e, R)) << (8 * i);
  return out;
#else
  (void)e;
  uint32_t w[4], aw[4];
  for (int j = 0; j < 4; ++j) {   // the encoder's pairs: values j and j + 4
    w[j] = bf16x2_round_odd(x[j], x[j + 4]);
    aw[j] = bf16x2_abs(w[j]);
  }
  return e2m1_encode8_bf16_s<R>(w, aw, s, nan_scale);
#endif
}
// The same with the block's exponent e (1..255).
template <Rounding R>
DSQ_HD uint32_t e2m1_encode8_f32(const float (&x)[8], int e) {
  return e2m1_encode8_f32_s<R>(x, e, bf16x2_inv_pow2(e), e == 255);
}

}  // namespace dsq

// dsaquant/two_stage_x8.h: SPEC §7.2's two stages (stage 1, the recip fake-quant rounded to bf16; stage 2,
// FP4 with rule pack) for bf16 inputs, two values per 32-bit operation, on the primitives of e2m1x8.h.
// Byte-identical to the scalar definition (e2m1.h fp4_fake_quant_value_e, round_bf16, ue8m0.h, e2m1_encode_pair):
// tests/test_header_host.py checks stage 1 on every bf16 value at every exponent, the block parameters on every
// amax, the fast stage 2 on every value of every block it takes, and whole blocks against the reference.
//
// Stage 1 of x in a block with exponent e1 (s = 2^(e1-127)) is bf16(sign * g * s), g = grid(min(|x| / s, 6))
// rounded half to even onto the E2M1 grid, where the sign is that of the fp32 quotient x / s (SPEC §7.2: a zero
// quotient counts as positive). In bf16 arithmetic:
//   |x| / s = fl(|x| * 2^(127-e1))   exact where it is normal; below 2^-126 it rounds differently from fp32,
//                                    but every such value has g = 0 either way
//   g       = fl(c + M) - M          c = min(|x| / s, 6), M = 2^(max(floor(log2 c), 0) + 6): e2m1x8.h's rounding
//   value   = fl(g * s)              exact (g has two significant bits) or +Inf, as in fp32
//   sign    = sign of fl(x + thr)    set iff x < -thr, thr = 2^(e1-277): the largest |x| whose fp32 quotient
//                                    x / s rounds to zero (bf16 holds it exactly for e1 >= 144; below, every
//                                    nonzero bf16 |x| exceeds it and thr = 0 does the same; +Inf for e1 = 255)
// A NaN x gives a NaN value (the canonical 0x7FC0 after masking: every non-NaN value has its low 6 bits clear),
// and the sign of fl(x + thr) is made positive for a NaN (min with +Inf).
//
// Stage 2 takes the block's stage-1 values: amax2 = the largest |stage-1 value| = stage 1 of the block's amax
// (stage 1 is monotone in |x|, and NaN elements count in neither amax), e2 = rule pack of amax2. In the usual
// block (the fast path below) e2 is e1 or e1 - 1, every stage-1 value divided by 2^(e2-127) is g * 2^d
// (d = e1 - e2 in {0, 1}), which lies on the E2M1 grid, and the codes come from g directly:
// fl((R - M) * 2^(d-126)) has the magnitude index in bits 6..8 as in e2m1x8.h, under every policy.
#pragma once

#include "e2m1x8.h"

namespace dsq {

// Stage-1 multipliers of a block with exponent e1 (1..255), in both halves of each word.
struct FakeQuantBf16x2 {
  uint32_t inv;   // 2^(127-e1) (0 for e1 = 255: every value of the block is NaN)
  uint32_t s;     // 2^(e1-127) (+Inf for e1 = 255)
  uint32_t thr;   // 2^(e1-277) rounded to bf16 (0 for e1 < 144, +Inf for e1 = 255): see the top
};

// thr from s (both halves; s = 2^(e1-127) for e1 in 1..255): fl(fl(s * 2^-126) * 2^-24). The first product
// 2^(e1-253) is exact for e1 >= 120 and 0 below 119 (2^-134 ties to the even 0); the second is exact for
// e1 >= 144 and 0 below (again 2^-134 ties to 0); +Inf stays +Inf.
DSQ_HD uint32_t fake_quant_threshold_bf16x2(uint32_t s) {
  constexpr uint32_t kNegZero = 0x80008000u, k2m126 = 0x00800080u, k2m24 = 0x33803380u;
  return bf16x2_fma(bf16x2_fma(s, k2m126, kNegZero), k2m24, kNegZero);
}

DSQ_HD FakeQuantBf16x2 fake_quant_consts_bf16x2(int e1) {
  const uint32_t s = static_cast<uint32_t>(e1) << 7;   // e1 = 255: 0x7F80, +Inf
  return FakeQuantBf16x2{bf16x2_inv_pow2(e1), s | (s << 16), fake_quant_threshold_bf16x2(s | (s << 16))};
}

// |stage-1 value| of two values from ax = |x| (bits; NaN for a NaN x).
DSQ_HD uint32_t fake_quant_mag_bf16x2(uint32_t ax, uint32_t inv, uint32_t s) {
  constexpr uint32_t kNegZero = 0x80008000u, kSix = 0x40C040C0u, kOne = 0x3F803F80u;
  constexpr uint32_t k64 = 0x42804280u, kMinus64 = 0xC280C280u;
  const uint32_t c = bf16x2_min_nan(bf16x2_fma(ax, inv, kNegZero), kSix);      // min(|x| / s, 6), NaN kept
  const uint32_t mx = bf16x2_max_nn(c, kOne) & 0x7F807F80u;                    // 2^E'
  const uint32_t r = bf16x2_fma(c, kOne, bf16x2_fma(mx, k64, kNegZero));       // fl(c + M)
  return bf16x2_fma(bf16x2_fma(mx, kMinus64, r), s, kNegZero);                  // (R - M) * s
}

// SPEC §7.2 stage 1 of two values, x = (value 0, value 1) and ax = |x|, as the bf16 bits of both results
// (NaN: 0x7FC0). Equals round_bf16(fp4_fake_quant_value_e(canon_nan(x), e1)) in each half.
DSQ_HD uint32_t fake_quant_bf16x2(uint32_t x, uint32_t ax, const FakeQuantBf16x2& k) {
  constexpr uint32_t kOne = 0x3F803F80u, kInf = 0x7F807F80u;
  const uint32_t v = fake_quant_mag_bf16x2(ax, k.inv, k.s);
  const uint32_t sg = bf16x2_min_nn(bf16x2_fma(x, kOne, k.thr), kInf);         // sign: x < -thr (NaN: +Inf)
  return (v & 0x7FC07FC0u) | (sg & 0x80008000u);
}

// Both stages' exponents of a block whose amax (NaN ignored; an all-NaN block has 0) has the bf16 bits b
// (0 .. 0x7F80): e1 by rule recip, e2 by rule pack of amax2 = stage 1 of the amax (an Inf amax makes every
// stage-1 value NaN: amax2 = 0, e2 = 114; an amax2 past the bf16 range is +Inf: e2 = 254).
DSQ_HD void two_stage_exponents_bf16(uint32_t b, int& e1, int& e2) {
  e1 = ue8m0_recip_exponent_bf16(b);
  const FakeQuantBf16x2 k = fake_quant_consts_bf16x2(e1);
  const uint32_t amax2 = fake_quant_mag_bf16x2(b, k.inv, k.s) & 0xFFFFu;
  e2 = e1 == 255 ? 114 : ue8m0_pack_exponent_bf16(amax2);
}

// Both stages of eight values of any block: x[j] = (value j, value j + 4), ax[j] = |x[j]|, b the block's amax
// bits as above, r the policy (SPEC §2) -> four packed bytes (SPEC §1); e2_out = the stored exponent.
DSQ_HD uint32_t two_stage8_bf16(const uint32_t (&x)[4], const uint32_t (&ax)[4], uint32_t b, Rounding r, int& e2_out) {
  int e1, e2;
  two_stage_exponents_bf16(b, e1, e2);
  const FakeQuantBf16x2 k = fake_quant_consts_bf16x2(e1);
  uint32_t z[4], az[4];
  for (int j = 0; j < 4; ++j) {
    z[j] = fake_quant_bf16x2(x[j], ax[j], k);
    az[j] = bf16x2_abs(z[j]);
  }
  e2_out = e2;
  if (r == Rounding::threshold) return e2m1_encode8_bf16<Rounding::threshold>(z, az, e2);
  if (r == Rounding::rne) return e2m1_encode8_bf16<Rounding::rne>(z, az, e2);
  return e2m1_encode8_bf16<Rounding::hardware>(z, az, e2);
}

// The fast path's parameters of two blocks at once, from m = amax_a | amax_b << 16 (bf16 bits, each
// 0 .. 0x7F80). A block is fast when e1 < 255, amax2 is finite and d = e1 - e2 is 0 or 1. With amax =
// (1 + f/128) * 2^(E-127) (f: the 7 fraction bits) and e1 >= 2: e1 = E - 2 + (f > 0x40) (e2m1x8.h), so
// amax / s = 4 (1 + f/128) in [4, 6] for f <= 0x40 and 2 (1 + f/128) in (3, 4) otherwise; its grid value g_max
// is 3 exactly for 0x41 <= f <= 0x5F (3.5 ties to 4), then amax2 / 6 = s / 2 and d = 1; g_max = 4 or 6 gives
// d = 0. Rule pack's floor (e2 >= 114) breaks this where e1 - d < 114 (there d < 0: not fast), and so does an
// overflow: e1 = 253 with g_max >= 4 makes amax2 = g_max * 2^126 = +Inf (e2 = 254). e1 is at most 253 for a
// finite bf16 amax. (At e1 - d = 113 with d = 1 the floor gives e2 = e1, a d of 0 that would be fast too: those
// few blocks, amax about 3.6e-4, take the general path.) Per half, with u = (b + 63) & ~0x7F = (E + (f > 0x40)) << 7:
//   t = max(u, 3 << 7) = (e1 + 2) << 7           (as ue8m0_recip_scales_bf16x2; Inf: 255 << 7)
//   d << 7 = u - ((b + 32) & ~0x7F)              (f >= 0x41 minus f >= 0x60; no borrow between halves)
//   x = t - (d << 7) = (e1 - d + 2) << 7         fast iff 116 << 7 <= x < 255 << 7 (Inf: x = 255 << 7)
// tests/test_header_host.py checks every amax in either half against two_stage_exponents_bf16.
struct TwoStageBf16x2 {
  uint32_t inv_a, inv_b;       // 2^(127-e1), both halves of the word (a fast block has e1 <= 253)
  uint32_t clamp_a, clamp_b;   // 6 (d = 0) or 3 (d = 1): see two_stage8_bf16_fast
  uint32_t kr_a, kr_b;         // 2^(d-126)
  uint32_t thr_a, thr_b;       // fake_quant_threshold_bf16x2
  uint32_t e2;                 // e2 of a (bits 0..7) and b (bits 16..23), where the block is fast
  bool fast_a, fast_b;
};
DSQ_HD TwoStageBf16x2 two_stage_params_bf16x2(uint32_t m) {
  const uint32_t u = (m + 0x003F003Fu) & 0xFF80FF80u;
  const uint32_t t = bf16x2_max_nn(u, 0x01800180u);
  const uint32_t dd = u - ((m + 0x00200020u) & 0xFF80FF80u);
  const uint32_t x = t - dd;
  const uint32_t inv = 0x80008000u - t, clamp = 0x40C040C0u - dd, kr = 0x00800080u + dd;
  const uint32_t thr = fake_quant_threshold_bf16x2(t - 0x01000100u);   // from s = e1 << 7
  const uint32_t xa = x & 0xFFFFu, xb = x >> 16;
  return TwoStageBf16x2{byte_perm(inv, inv, 0x1010u), byte_perm(inv, inv, 0x3232u),
                        byte_perm(clamp, clamp, 0x1010u), byte_perm(clamp, clamp, 0x3232u),
                        byte_perm(kr, kr, 0x1010u), byte_perm(kr, kr, 0x3232u),
                        byte_perm(thr, thr, 0x1010u), byte_perm(thr, thr, 0x3232u),
                        ((x >> 7) & 0x01FF01FFu) - 0x00020002u,
                        xa - (116u << 7) < ((255u - 116u) << 7), xb - (116u << 7) < ((255u - 116u) << 7)};
}

// Both stages of eight values of a fast block (x[j] = (value j, value j + 4), ax[j] = |x[j]|, the block's
// parameters from two_stage_params_bf16x2) -> four packed bytes; equal to two_stage8_bf16 there. Per value:
// g = grid(min(|x| / s, clamp)), then fl(g * 2^(d-126)) holds stage 2's magnitude index (g * 2^d is a grid
// value: 6 at most, since d = 1 only where g_max = 3). clamp is 6, or 3 where d = 1: no value of such a block
// exceeds 3.5 (g_max = 3), so min(., 3) keeps every g, and sends a NaN to 3 (then m = 7, as a NaN gets).
// The sign is stage 1's (see the top); threshold and rne keep it only where m != 0.
DSQ_HD uint32_t two_stage8_bf16_fast(const uint32_t (&x)[4], const uint32_t (&ax)[4], uint32_t inv, uint32_t clamp,
                                     uint32_t kr, uint32_t thr, Rounding r) {
  constexpr uint32_t kNegZero = 0x80008000u, kOne = 0x3F803F80u, kInf = 0x7F807F80u;
  constexpr uint32_t k64 = 0x42804280u, kMinus64 = 0xC280C280u;
  uint32_t z[4], xc[4];
  for (int j = 0; j < 4; ++j) {
    const uint32_t c = bf16x2_min_nn(bf16x2_fma(ax[j], inv, kNegZero), clamp);   // NaN -> clamp
    const uint32_t mx = bf16x2_max_nn(c, kOne) & 0x7F807F80u;
    const uint32_t rr = bf16x2_fma(c, kOne, bf16x2_fma(mx, k64, kNegZero));
    z[j] = bf16x2_fma(bf16x2_fma(mx, kMinus64, rr), kr, kNegZero);               // g * 2^(d-126): m << 6
    xc[j] = bf16x2_min_nn(bf16x2_fma(x[j], kOne, thr), kInf);
  }
  return e2m1_join8(e2m1_mags8_bf16(z), e2m1_signs8_bf16(xc), r);
}

}  // namespace dsq

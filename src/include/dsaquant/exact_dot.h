// dsaquant/exact_dot.h: the exact FP4 logit of mqa_logits(exact=True) (docs/prefill.md, "Exact FP4 mode";
// python reference: python/dsaquant/reference/prefill.py). Every step below is fixed, so every backend
// and vendor gives the same bits.
//   1. Per block b of 32 elements, the integer dot I_b = sum (2 q_d)(2 k_d) of the doubled E2M1 values
//      (integers in [-12, 12]; |I_b| <= 32 * 144 < 2^13, exact in int32).
//   2. v_b = I_b * 2^(eq_b + ek_b - 256) rounded once to fp32 (exact_block_value); an exponent byte 0
//      gives fl(I_b * 0), 255 gives NaN.
//   3. Per head: s = ((v_0 + v_1) + v_2) + v_3; r = s < 0 ? +0 : s (NaN and -0 kept); t_h = fl(r * w_h).
//   4. The logit is the SPEC §0.2 canonical sum of t_0 .. t_{H-1} (H = 16, 32, 64 or 128).
#pragma once

#include <stdint.h>

#include "arith.h"

namespace dsq {

// 2 * the E2M1 value of a 4-bit code (bit 3 sign): m < 2 -> m, else (2 + (m & 1)) << (m/2 - 1).
DSQ_HD int e2m1_twice(uint8_t code) {
  const int m = code & 7;
  const int mag = m < 2 ? m : (2 + (m & 1)) << ((m >> 1) - 1);
  return (code & 8) ? -mag : mag;
}

// I_b over one block: 16 packed bytes of q and of k (byte i: element 2i low nibble, 2i+1 high nibble).
DSQ_HD int exact_block_dot(const uint8_t* q16, const uint8_t* k16) {
  int acc = 0;
  for (int i = 0; i < 16; ++i) {
    acc += e2m1_twice(q16[i] & 15) * e2m1_twice(k16[i] & 15);
    acc += e2m1_twice(q16[i] >> 4) * e2m1_twice(k16[i] >> 4);
  }
  return acc;
}

// fp32 2^e for e in [-126, 127], from bits.
DSQ_HD float pow2_unbiased(int e) { return pow2(e + 127); }

// I * 2^(eq + ek - 256) rounded once: only the last of the products below can round.
//   E < -126: fl(fl(I * 2^(E'+64)) * 2^-64), E' = max(E, -164)  (below -164 both round to a signed zero)
//   E > 127:  fl(fl(I * 2^(E-127)) * 2^127)
//   else:     fl(I * 2^E)
DSQ_HD float exact_block_value(int idot, int eq, int ek) {
  const float i = static_cast<float>(idot);
  if (eq == 255 || ek == 255) return u2f(kCanonicalNanBits);
  if (eq == 0 || ek == 0) return fmul(i, 0.0f);
  int e = eq + ek - 256;
  if (e < -164) e = -164;
  if (e < -126) return fmul(fmul(i, pow2_unbiased(e + 64)), pow2_unbiased(-64));
  if (e > 127) return fmul(fmul(i, pow2_unbiased(e - 127)), pow2_unbiased(127));
  return fmul(i, pow2_unbiased(e));
}

// One head: q row (64 packed bytes, exponent word with block j in byte j) against one key row.
DSQ_HD float exact_head_value(const uint8_t* q64, uint32_t qexp, const uint8_t* k64, uint32_t kexp) {
  float v[4];
  for (int b = 0; b < 4; ++b)
    v[b] = exact_block_value(exact_block_dot(q64 + 16 * b, k64 + 16 * b), (qexp >> (8 * b)) & 255,
                             (kexp >> (8 * b)) & 255);
  return fadd(fadd(fadd(v[0], v[1]), v[2]), v[3]);
}

// The logit of one query row (H heads: q [H][64] bytes, qexp [H], w [H] fp32) against one key row.
DSQ_HD float exact_logit(const uint8_t* q, const uint32_t* qexp, const float* w, int H, const uint8_t* k64,
                         uint32_t kexp) {
  float t[128];
  for (int h = 0; h < H; ++h) {
    const float s = exact_head_value(q + 64 * h, qexp[h], k64, kexp);
    t[h] = fmul(s < 0.0f ? 0.0f : s, w[h]);
  }
  return canonical_sum_n(t, H);
}

}  // namespace dsq

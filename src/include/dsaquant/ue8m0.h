// dsaquant/ue8m0.h: UE8M0 block scales of FP4 (SPEC §3): the rules `pack` and `recip`.
#pragma once

#include "arith.h"
#include "codes.h"

namespace dsq {

// ScaleRule (pack, recip) is defined in codes.h.

// SPEC §3: block amax (>= 0, from nan_amax) -> biased exponent e of the block scale 2^(e-127).
//  pack:  ceil_exp(max(amax / 6.0f, 1e-4f)) clamped to [1, 254]    (compat: sglang-v41 stage 2)
//  recip: f = max(amax, 6 * 2^-126) * fl(1/6); e = 255 if f's exponent field is 0xFF (amax = Inf),
//         else ceil_exp(f)                                          (compat: aiter, DeepSeek-V4)
// An all-zero block gives 114 under pack and 1 under recip. (A NaN amax cannot come from
// nan_amax; it would give 254 / 255, as in the reference's clamp_min.)
DSQ_HD int ue8m0_exponent(float amax, ScaleRule rule) {
  if (rule == ScaleRule::pack) {
    const int e = ceil_exp(clamp_lo(fdiv(amax, 6.0f), u2f(0x38D1B717u)));   // 1e-4f
    return e < 1 ? 1 : (e > 254 ? 254 : e);
  }
  const float f = fmul(clamp_lo(amax, u2f(0x01C00000u)), u2f(0x3E2AAAABu)); // 6*2^-126, fl(1/6)
  return ((f2u(f) >> 23) & 0xFFu) == 0xFFu ? 255 : ceil_exp(f);
}

// Exponent of a block of n values (n = 32 for every FP4 format here): amax per SPEC §0.3.
DSQ_HD int fp4_block_exponent(const float* x, int n, ScaleRule rule) {
  return ue8m0_exponent(nan_amax(x, n), rule);
}

}  // namespace dsq

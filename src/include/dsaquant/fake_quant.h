// dsaquant/fake_quant.h: the e4m3 block scale of SPEC §7.2's 16-wide fake-quant (NVFP4-style).
#pragma once

#include "e2m1.h"
#include "fp8.h"

namespace dsq {

// SPEC §7.2, block=16, scale="e4m3": s = e4m3_rne(clamp(fl(amax * fl(1/6)), 2^-9, 448)).
DSQ_HD float nvfp4_e4m3_scale(float amax) {
  const float f = clamp_hi(clamp_lo(fmul(amax, u2f(0x3E2AAAABu)), pow2(127 - 9)), 448.0f);
  return fp8_decode(fp8_encode(f, Fp8Flavour::e4m3fn), Fp8Flavour::e4m3fn);
}

}  // namespace dsq

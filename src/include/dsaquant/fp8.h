// dsaquant/fp8.h: FP8 E4M3 codes in two flavours and the per-row q/k scales (SPEC §4).
#pragma once

#include "arith.h"
#include "codes.h"

#if defined(__CUDACC__) && !defined(__HIP__)
#include <cuda_fp8.h>
#endif

namespace dsq {

// Fp8Flavour is defined in codes.h:
//   e4m3fn:   bias 7, max 448, NaN 0x7F/0xFF, has -0 (0x80)  (NVIDIA, gfx950)
//   e4m3fnuz: bias 8, max 240, NaN 0x80, no -0               (gfx942)
enum class Fp8Role : int { q = 0, k = 1 };

DSQ_HD int fp8_bias(Fp8Flavour f) { return f == Fp8Flavour::e4m3fn ? 7 : 8; }
DSQ_HD float fp8_max(Fp8Flavour f) { return f == Fp8Flavour::e4m3fn ? 448.0f : 240.0f; }

// SPEC §4 encoder (software, every target): round half to even; finite values beyond max AND ±Inf
// saturate to ±max (ours, as the reference); NaN -> 0x7F | sign (e4m3fn) or 0x80 (e4m3fnuz);
// -0 and negatives that round to 0 give 0x80 (e4m3fn) or 0x00 (e4m3fnuz). Do not use gfx942's
// convert instruction: it returns 0x80 (NaN) for values that round to -0 (SPEC §8).
DSQ_HD uint8_t fp8_encode(float x, Fp8Flavour fl) {
  // Branch-free (selects only): this runs once per element in every FP8 kernel.
  const bool fn = fl == Fp8Flavour::e4m3fn;
  const uint32_t neg = f2u(x) >> 31;
  const bool nan = is_nan(x);
  const int bias = fp8_bias(fl), emin = 1 - bias;                   // smallest normal exponent
  const float fmax = fp8_max(fl);
  const float a = nan ? 0.0f : clamp_hi(abs_f(x), fmax);
  int e = static_cast<int>((f2u(a) >> 23) & 0xFFu) - 127;
  e = e < emin ? emin : e;
  // r = rint(a / q) * q with q = 2^(e-3): the division is an exact multiply by 1/q, the product exact.
  const float r = clamp_hi(fmul(rint_f(fmul(a, inv_pow2(e - 3 + 127))), pow2(e - 3 + 127)), fmax);
  const uint32_t rb = f2u(r);
  const uint32_t code_normal = ((((rb >> 23) & 0xFFu) - 127u + static_cast<uint32_t>(bias)) << 3) | ((rb >> 20) & 7u);
  const uint32_t code_sub = static_cast<uint32_t>(fmul(r, inv_pow2(emin - 3 + 127)));  // 0..7, exact
  uint32_t code = r >= pow2(emin + 127) ? code_normal : code_sub;
  code |= (fn || code != 0u) ? (neg << 7) : 0u;
  const uint32_t nan_code = fn ? (0x7Fu | (neg << 7)) : 0x80u;
  return static_cast<uint8_t>(nan ? nan_code : code);
}

// Two values -> two codes as a little-endian pair (x0 in the low byte), NaN taken as the canonical NaN
// (every op canonicalises before encoding, so inside ops this is fp8_encode). On NVIDIA sm_89+ the
// e4m3fn pair uses the hardware convert (cvt.rn.satfinite.e4m3x2.f32): RNE, finite and infinite
// values saturate to +-448, NaN -> 0x7F, sign of zero kept. It is used because tests/gpu/
// test_fp8_native.py compares it with the software encoder over all 2^32 fp32 inputs on the GPU
// (0 mismatches on an H200); define DSQ_SOFTWARE_FP8 to build without it.
DSQ_HD uint16_t fp8_encode2(float x0, float x1, Fp8Flavour fl) {
#if defined(DSQ_CUDA_DEVICE) && (__CUDA_ARCH__ >= 890) && !defined(DSQ_SOFTWARE_FP8)
  if (fl == Fp8Flavour::e4m3fn)
    return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(x0, x1), __NV_SATFINITE, __NV_E4M3));
#endif
  return static_cast<uint16_t>(fp8_encode(canon_nan(x0), fl) | (fp8_encode(canon_nan(x1), fl) << 8));
}

// The software form of fp8_encode2 (what the hardware path is checked against).
DSQ_HD uint16_t fp8_encode2_software(float x0, float x1, Fp8Flavour fl) {
  return static_cast<uint16_t>(fp8_encode(canon_nan(x0), fl) | (fp8_encode(canon_nan(x1), fl) << 8));
}

DSQ_HD bool fp8_is_nan(uint8_t c, Fp8Flavour fl) {
  return fl == Fp8Flavour::e4m3fn ? (c & 0x7Fu) == 0x7Fu : c == 0x80u;
}

// Code -> fp32 (NaN codes give NaN).
DSQ_HD float fp8_decode(uint8_t c, Fp8Flavour fl) {
  if (fp8_is_nan(c, fl)) return u2f(0x7FC00000u);
  const int bias = fp8_bias(fl);
  const int e = (c >> 3) & 0xF, m = c & 7;
  const float mag = e == 0 ? fmul(static_cast<float>(m), pow2(1 - bias - 3 + 127))
                           : fmul(static_cast<float>(8 + m), pow2(e - bias - 3 + 127));
  return (c & 0x80u) ? -mag : mag;
}

// SPEC §4 row scale (one per 128 values) from the row's amax (SPEC §0.3):
//  q: s = max(amax, 1e-10f) * fl(1/fmax);   k: s = max(amax, 1e-4f) / fmax (true division);
//  ue8m0: s = pow2(ceil_exp(s)) (bits, never exp2(ceil(log2 s))).
DSQ_HD float fp8_row_scale(float amax, Fp8Flavour fl, Fp8Role role, bool ue8m0) {
  const float inv_max = u2f(fl == Fp8Flavour::e4m3fn ? 0x3B124925u : 0x3B888889u);  // fl(1/448), fl(1/240)
  const float s = role == Fp8Role::q ? fmul(clamp_lo(amax, u2f(0x2EDBE6FFu)), inv_max)  // 1e-10f
                                     : fdiv(clamp_lo(amax, u2f(0x38D1B717u)), fp8_max(fl));  // 1e-4f
  return ue8m0 ? pow2(ceil_exp(s)) : s;
}

// SPEC §4: the stored value is encode(x * fl(1/s)); inv = fp8_inv_scale(s), one correct division.
// The product's NaN is made canonical (positive) first: a NaN x, or ±Inf x in a row whose scale is
// Inf (inv = 0), gives 0x7F (e4m3fn) / 0x80 (e4m3fnuz) on every platform (see canon_nan).
DSQ_HD float fp8_inv_scale(float s) { return fdiv(1.0f, s); }
DSQ_HD uint8_t fp8_encode_scaled(float x, float inv, Fp8Flavour fl) { return fp8_encode(canon_nan(fmul(x, inv)), fl); }

// SPEC §7.7 FP8 group scale (query side, rope_rotate_quant): s = max(amax, 1e-10f) / fmax, one true
// division, no UE8M0 rounding (unlike §4's q rule, which multiplies by fl(1/fmax)).
DSQ_HD float fp8_group_scale(float amax, Fp8Flavour fl) {
  return fdiv(clamp_lo(amax, u2f(0x2EDBE6FFu)), fp8_max(fl));   // 1e-10f
}

// A whole row of n values in one thread: codes into out[0..n), returns the fp32 scale s.
DSQ_HD float fp8_quantize_row(const float* x, int n, Fp8Flavour fl, Fp8Role role, bool ue8m0, uint8_t* out) {
  const float s = fp8_row_scale(nan_amax(x, n), fl, role, ue8m0);
  const float inv = fp8_inv_scale(s);
  for (int i = 0; i < n; ++i) out[i] = fp8_encode_scaled(x[i], inv, fl);
  return s;
}

}  // namespace dsq

// dsaquant/arith.h: SPEC §0 arithmetic shared by every format: powers of two and exponents on
// bits, bf16/fp16 rounding, the NaN-ignoring amax, the canonical sum and exp_ds.
#pragma once

#include "platform.h"

#if defined(__CUDACC__) && !defined(__HIP__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace dsq {

// ---- SPEC §0.5 / §3: exponents on bits --------------------------------------------------------
// pow2(e) = the fp32 with bits e << 23, i.e. 2^(e-127) for a biased exponent e in 1..254
// (e = 255 gives +Inf, e = 0 gives +0: callers handle those).
DSQ_HD float pow2(int e) { return u2f(static_cast<uint32_t>(e) << 23); }

// 1 / pow2(e) = 2^(127-e) for e in 1..254, exact (e = 254 gives the subnormal 2^-127). Multiplying by
// it gives the same bits as dividing by pow2(e): both are the correctly rounded value of the same real
// number, so kernels use this instead of a (slower) division by a power of two.
DSQ_HD float inv_pow2(int e) { return e < 254 ? pow2(254 - e) : u2f(0x00400000u); }

// SPEC §3 ceil_exp(f): biased exponent of the smallest power of two >= f (f >= 0), from bits.
DSQ_HD int ceil_exp(float f) {
  const uint32_t u = f2u(f);
  return static_cast<int>((u >> 23) & 0xFFu) + ((u & 0x7FFFFFu) != 0u ? 1 : 0);
}

// SPEC §0.3: max |x[i]| ignoring NaN; an empty or all-NaN range gives 0.
DSQ_HD float nan_amax(const float* x, int n) {
  float a = 0.0f;
  for (int i = 0; i < n; ++i) a = fmax_nn(a, abs_f(x[i]));
  return a;
}

// ---- NaN inside ops (ours; python reference `canon_nan`) -------------------------------------------
// The sign and payload of a NaN made by arithmetic differ by platform (NVIDIA returns a positive
// canonical NaN; x86 and AMD propagate an operand's). Wherever a NaN's sign could reach a byte (at a
// quantizer's entry, after the FP8 scale multiply, at every rounding to bf16/fp16) it is replaced by
// the canonical quiet NaN +0x7FC00000.
constexpr uint32_t kCanonicalNanBits = 0x7FC00000u;
DSQ_HD float canon_nan(float x) { return is_nan(x) ? u2f(kCanonicalNanBits) : x; }

// ---- SPEC §0.4: round to bf16 / fp16 (nearest even) -------------------------------------------
// A NaN becomes the canonical NaN of the format (bf16 0x7FC0, fp16 0x7E00), as the reference's
// `cast`/`round_to` store it (torch's own NaN bits differ between CPU and CUDA). The *_software forms
// are the definition; on NVIDIA sm_80+ round_bf16/round_fp16 use the hardware converts (cvt.rn), which
// tests/gpu/test_fp8_native.py checks against the software forms over all 2^32 inputs on the GPU.
DSQ_HD uint16_t round_bf16_software(float x) {
  if (is_nan(x)) return 0x7FC0u;
  const uint32_t u = f2u(x);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

DSQ_HD uint16_t round_bf16(float x) {
#if defined(DSQ_CUDA_DEVICE) && (__CUDA_ARCH__ >= 800) && !defined(DSQ_SOFTWARE_ROUNDING)
  return is_nan(x) ? static_cast<uint16_t>(0x7FC0u) : __bfloat16_as_ushort(__float2bfloat16_rn(x));
#else
  return round_bf16_software(x);
#endif
}

DSQ_HD float bf16_to_f32(uint16_t h) { return u2f(static_cast<uint32_t>(h) << 16); }

DSQ_HD float round_to_bf16(float x) { return bf16_to_f32(round_bf16(x)); }

DSQ_HD uint16_t round_fp16_software(float x) {
  const uint32_t u = f2u(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7E00u;                                  // canonical NaN
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520: Inf
  if (a >= 0x38800000u) {                                               // fp16 normal (>= 2^-14)
    const uint32_t r = a + 0x0FFFu + ((a >> 13) & 1u);                  // RNE at 10 mantissa bits
    return static_cast<uint16_t>(sign | ((r - 0x38000000u) >> 13));     // rebias 127 -> 15
  }
  if (a < 0x33000000u) return static_cast<uint16_t>(sign);              // < 2^-25: rounds to 0
  // fp16 subnormal: the integer a / 2^-24, rounded half to even.
  const int shift = 126 - static_cast<int>(a >> 23);                    // 14..24
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

DSQ_HD uint16_t round_fp16(float x) {
#if defined(DSQ_CUDA_DEVICE) && (__CUDA_ARCH__ >= 800) && !defined(DSQ_SOFTWARE_ROUNDING)
  return is_nan(x) ? static_cast<uint16_t>(0x7E00u) : __half_as_ushort(__float2half_rn(x));
#else
  return round_fp16_software(x);
#endif
}

DSQ_HD float fp16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1Fu) return u2f(sign | 0x7F800000u | (m << 13));
  if (e != 0u) return u2f(sign | ((e + 112u) << 23) | (m << 13));
  const float v = fmul(static_cast<float>(m), pow2(127 - 24));  // exact: m * 2^-24
  return sign ? -v : v;
}

DSQ_HD float round_to_fp16(float x) { return fp16_to_f32(round_fp16(x)); }

// Two values rounded to bf16 (is_bf16) or fp16, nearest even, packed in one word: lo in bits 0..15, hi
// in bits 16..31. For callers whose next step treats every NaN alike (the quantizers: amax ignores NaN,
// the encoders map any NaN to one code): a NaN gives *a* NaN of the format, payload unspecified (on
// NVIDIA sm_80+ one cvt.rn.{bf16,f16}x2 for both values; elsewhere round_bf16 / round_fp16). Every other
// value is bit-identical to round_bf16 / round_fp16 (same IEEE rounding).
DSQ_HD uint32_t round_pair_any_nan(float lo, float hi, bool is_bf16) {
#if defined(DSQ_CUDA_DEVICE) && (__CUDA_ARCH__ >= 800) && !defined(DSQ_SOFTWARE_ROUNDING)
  uint32_t d;
  if (is_bf16)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#else
  return is_bf16 ? (round_bf16(lo) | (static_cast<uint32_t>(round_bf16(hi)) << 16))
                 : (round_fp16(lo) | (static_cast<uint32_t>(round_fp16(hi)) << 16));
#endif
}

// ---- SPEC §0.2: the canonical sum ----------------------------------------------------------------
// Partial i of a row: ((x[4i] + x[4i+1]) + x[4i+2]) + x[4i+3].
DSQ_HD float canonical_partial(float x0, float x1, float x2, float x3) {
  return fadd(fadd(fadd(x0, x1), x2), x3);
}

// The xor butterfly over m partials (m a power of two), serial and in place; returns p[0].
// For s = m/2 .. 1, p[i] = p[i] + p[i ^ s]. Lanes i and i ^ s end with the same value (fp32
// addition commutes), so only the lower half needs updating: this is the lanes' order exactly.
DSQ_HD float canonical_butterfly(float* p, int m) {
  for (int s = m >> 1; s >= 1; s >>= 1)
    for (int i = 0; i < s; ++i) p[i] = fadd(p[i], p[i + s]);
  return p[0];
}

// The same butterfly across lanes: `p` is this lane's partial, m the number of lanes taking part,
// `shfl_xor(v, s)` returns v from lane (lane ^ s) (e.g. __shfl_xor_sync(mask, v, s, 32)).
template <class ShflXor>
DSQ_HD float canonical_reduce_lanes(float p, int m, ShflXor shfl_xor) {
  for (int s = m >> 1; s >= 1; s >>= 1) p = fadd(p, shfl_xor(p, s));
  return p;
}

// Canonical sum of N = 4m terms term(i), i = 0..N-1, in one thread (N a compile-time constant).
template <int N, class Term>
DSQ_HD float canonical_sum_map(Term term) {
  static_assert(N >= 4 && N % 4 == 0 && ((N / 4) & (N / 4 - 1)) == 0, "N must be 4 * 2^k");
  float p[N / 4];
  for (int i = 0; i < N / 4; ++i)
    p[i] = canonical_partial(term(4 * i), term(4 * i + 1), term(4 * i + 2), term(4 * i + 3));
  return canonical_butterfly(p, N / 4);
}

template <int N>
DSQ_HD float canonical_sum(const float* x) {
  return canonical_sum_map<N>([x](int i) { return x[i]; });
}

// Runtime length n = 4m (m a power of two, m <= 256), in one thread.
DSQ_HD float canonical_sum_n(const float* x, int n) {
  float p[256];
  const int m = n / 4;
  for (int i = 0; i < m; ++i) p[i] = canonical_partial(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]);
  return canonical_butterfly(p, m);
}

// ---- SPEC §0.7: exp_ds, the one exponential of format math (x <= 0) ----------------------------
// Its range reduction and polynomial for a finite x: n = rint(x * log2 e) and p, the polynomial of the remainder
// (exp_ds(x) = p * 2^n before the exponent's clamps). Shared by exp_ds and by dsq::pool_exp (pool.h), its form for
// the pool's arguments.
struct ExpDsParts {
  float n, p;
};
DSQ_HD ExpDsParts exp_ds_parts(float xs) {
  const float n = rint_f(fmul(xs, u2f(0x3FB8AA3Bu)));                        // rint(x * log2 e)
  const float r = fsub(fsub(xs, fmul(n, u2f(0x3F317200u))), fmul(n, u2f(0x35BFBE8Eu)));
  const uint32_t poly[6] = {0x3AB60B61u, 0x3C088889u, 0x3D2AAAABu, 0x3E2AAAABu, 0x3F000000u, 0x3F800000u};
  float a = u2f(0x39500D01u);                                                 // 1/7!
  for (int k = 0; k < 6; ++k) a = fadd(u2f(poly[k]), fmul(r, a));            // 1/6! .. 1/1!
  return ExpDsParts{n, fadd(1.0f, fmul(r, a))};
}

// Out of the domain it mirrors the reference: +Inf is evaluated as 0 (gives 1), x > 0 clamps
// n to 200 and the exponent to 254. Written without branches (every case is computed and the result
// selected), so that a kernel evaluating many of them side by side keeps them in flight together.
DSQ_HD float exp_ds(float x) {
  const bool nan = is_nan(x), inf = is_inf(x);
  const ExpDsParts q = exp_ds_parts((nan || inf) ? 0.0f : x);
  const float p = q.p;
  const int ni = static_cast<int>(clamp_hi(clamp_lo(q.n, -200.0f), 200.0f));
  // ni >= -126: p * 2^ni with the biased exponent clamped into [1, 254]; below: p * 2^(ni+64) (exact) times
  // 2^-64, one rounding into subnormals; below -151 (or x = -Inf): 0.
  const bool normal = ni >= -126;
  int e = normal ? ni + 127 : ni + 191;
  e = e < 1 ? 1 : (e > 254 ? 254 : e);
  float y = fmul(p, pow2(e));
  y = normal ? y : fmul(y, pow2(63));
  y = (ni < -151 || (inf && sign_bit(x))) ? 0.0f : y;
  return nan ? x : y;
}

}  // namespace dsq

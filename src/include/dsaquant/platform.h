// dsaquant/platform.h: the portability layer of the shared header.
//
// One macro (DSQ_HD) makes every helper a __host__ __device__ inline function under nvcc and HIP
// (clang) and a plain inline function in C++17 host code. The fp32 operations below are the only
// way format math touches floats (SPEC §0.1): each is ONE correctly rounded binary32 operation that
// is never contracted into an FMA.
//   CUDA device: __fadd_rn/__fsub_rn/__fmul_rn/__fdiv_rn/__fsqrt_rn (never contracted by nvcc/ptxas).
//   clang (HIP device and host): plain operators inside `#pragma clang fp contract(off)`, so the IR
//     carries no `contract` flag even after inlining; build with -ffp-contract=off anyway, and keep
//     the HIP default -fhip-fp32-correctly-rounded-divide-sqrt (never pass the `no-` form).
//   g++ host: plain operators; build with -ffp-contract=off (GCC contracts per caller after inlining).
// Never build with fast-math or flush-to-zero (SPEC §0.6); fast-math is rejected below.
#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>

#if defined(__FAST_MATH__) || defined(__USE_FAST_MATH__)
#error "dsaquant: fast-math breaks byte-exactness (SPEC §0.1); build without it"
#endif

#if defined(__CUDACC__) && !defined(__HIP__)
#define DSQ_HD __host__ __device__ __forceinline__
#elif defined(__HIP__)
#define DSQ_HD __attribute__((host)) __attribute__((device)) inline __attribute__((always_inline))
#else
#define DSQ_HD inline
#endif

// Device-pass detection: CUDA (nvcc or clang-cuda) and HIP (clang).
#if defined(__CUDA_ARCH__)
#define DSQ_CUDA_DEVICE 1
#endif
#if defined(__HIP_DEVICE_COMPILE__)
#define DSQ_HIP_DEVICE 1
#endif

// Full unrolling of a loop with constant bounds in device code (its array indices then become registers); host
// passes keep the loop.
// DSQ_UNROLL_N(n): unroll by n (several independent loads in flight per thread).
#define DSQ_STRINGIFY_(x) #x
#define DSQ_STRINGIFY(x) DSQ_STRINGIFY_(x)
#if defined(DSQ_CUDA_DEVICE) || defined(DSQ_HIP_DEVICE)
#define DSQ_UNROLL _Pragma("unroll")
#define DSQ_UNROLL_N(n) _Pragma(DSQ_STRINGIFY(unroll n))
#else
#define DSQ_UNROLL
#define DSQ_UNROLL_N(n)
#endif

#if defined(__clang__)
#define DSQ_NO_CONTRACT _Pragma("clang fp contract(off)")
#else
#define DSQ_NO_CONTRACT
#endif

namespace dsq {

// ---- bit casts -------------------------------------------------------------------------------
DSQ_HD uint32_t f2u(float f) {
#if defined(DSQ_CUDA_DEVICE)
  return __float_as_uint(f);
#elif defined(__clang__)
  return __builtin_bit_cast(uint32_t, f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

DSQ_HD float u2f(uint32_t u) {
#if defined(DSQ_CUDA_DEVICE)
  return __uint_as_float(u);
#elif defined(__clang__)
  return __builtin_bit_cast(float, u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// ---- classification on bits (immune to compiler assumptions about NaN) -----------------------
DSQ_HD bool is_nan(float x) { return (f2u(x) & 0x7FFFFFFFu) > 0x7F800000u; }
DSQ_HD bool is_inf(float x) { return (f2u(x) & 0x7FFFFFFFu) == 0x7F800000u; }
DSQ_HD bool sign_bit(float x) { return (f2u(x) >> 31) != 0u; }
DSQ_HD float abs_f(float x) { return u2f(f2u(x) & 0x7FFFFFFFu); }

// ---- SPEC §0.1: one correctly rounded binary32 operation each, never contracted --------------
DSQ_HD float fadd(float a, float b) {
#if defined(DSQ_CUDA_DEVICE)
  return __fadd_rn(a, b);
#else
  DSQ_NO_CONTRACT
  return a + b;
#endif
}

DSQ_HD float fsub(float a, float b) {
#if defined(DSQ_CUDA_DEVICE)
  return __fsub_rn(a, b);
#else
  DSQ_NO_CONTRACT
  return a - b;
#endif
}

DSQ_HD float fmul(float a, float b) {
#if defined(DSQ_CUDA_DEVICE)
  return __fmul_rn(a, b);
#else
  DSQ_NO_CONTRACT
  return a * b;
#endif
}

// fl(a * b + c) with one rounding: a fused operation the code asks for (SPEC §0.1 forbids the compiler's
// contractions, not these). On CUDA inline PTX, so that the build checks, which reject every f32 multiply-add the
// compiler emits, tell it from a contraction.
DSQ_HD float fma_explicit(float a, float b, float c) {
#if defined(DSQ_CUDA_DEVICE)
  float r;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
  return r;
#elif defined(__clang__)
  return __builtin_fmaf(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// fl(y + sign * x) for sign = +1 or -1: fl(y + x) or fl(y - x), bit for bit (the product is exact, so the one
// rounding of a fused multiply-add is that of the sum), in one instruction where the hardware fuses. For a
// butterfly whose two lanes hold their operands in opposite roles (SPEC §5 Hadamard between lanes).
DSQ_HD float fadd_signed(float x, float sign, float y) { return fma_explicit(x, sign, y); }

// Correctly rounded division (HIP: correct by default, -fhip-fp32-correctly-rounded-divide-sqrt).
DSQ_HD float fdiv(float a, float b) {
#if defined(DSQ_CUDA_DEVICE)
  return __fdiv_rn(a, b);
#else
  DSQ_NO_CONTRACT
  return a / b;
#endif
}

// Correctly rounded square root.
DSQ_HD float fsqrt(float a) {
#if defined(DSQ_CUDA_DEVICE)
  return __fsqrt_rn(a);
#elif defined(__clang__)
  DSQ_NO_CONTRACT
  return __builtin_sqrtf(a);
#else
  return std::sqrt(a);
#endif
}

// Round half to even to an integral value (C rint in the default rounding mode).
DSQ_HD float rint_f(float a) {
#if defined(DSQ_CUDA_DEVICE)
  return rintf(a);
#elif defined(__clang__)
  return __builtin_rintf(a);
#else
  return std::nearbyint(a);
#endif
}

// SPEC §0.3: IEEE maxNum (C fmaxf): a NaN operand is ignored; two NaNs give NaN.
DSQ_HD float fmax_nn(float a, float b) {
#if defined(DSQ_CUDA_DEVICE)
  return fmaxf(a, b);   // one FMNMX: IEEE maxNum, a NaN operand is ignored (SPEC §8)
#else
  if (is_nan(a)) return b;
  if (is_nan(b)) return a;
  return a > b ? a : b;
#endif
}
// The smaller of a and b, ignoring a NaN operand (as fmax_nn).
DSQ_HD float fmin_nn(float a, float b) {
#if defined(DSQ_CUDA_DEVICE)
  return fminf(a, b);   // one FMNMX: IEEE minNum, a NaN operand is ignored
#else
  if (is_nan(a)) return b;
  if (is_nan(b)) return a;
  return a < b ? a : b;
#endif
}

// The larger of a and b, NaN when either is NaN (IEEE maximum; PTX max.NaN).
DSQ_HD float fmax_nan(float a, float b) {
#if defined(DSQ_CUDA_DEVICE) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (is_nan(a) || a > b) ? a : b;
#endif
}

// torch.clamp_min / clamp_max semantics: a NaN `a` stays NaN (the reference's max(amax, floor)).
DSQ_HD float clamp_lo(float a, float lo) { return a < lo ? lo : a; }
DSQ_HD float clamp_hi(float a, float hi) { return a > hi ? hi : a; }

}  // namespace dsq

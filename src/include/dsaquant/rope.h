// dsaquant/rope.h: RoPE, LayerNorm, RMSNorm and the Hadamard transform (SPEC §5).
#pragma once

#include "arith.h"

namespace dsq {

constexpr int kHeadDim = 128;
constexpr int kRopeDim = 64;

// ---- RoPE -----------------------------------------------------------------------------------------
// SPEC §5 pair rotation, every product rounded on its own:
//   a' = fl(fl(a*c) - fl(b*s)),  b' = fl(fl(b*c) + fl(a*s)).
DSQ_HD void rope_pair(float& a, float& b, float c, float s) {
  const float a2 = fsub(fmul(a, c), fmul(b, s));
  const float b2 = fadd(fmul(b, c), fmul(a, s));
  a = a2;
  b = b2;
}

// Dims of pair j (0..31, which is also the cos/sin index) in a 128 row. neox: (j, j+32);
// interleaved: (2j, 2j+1); within the rope dims at the head (0..63) or the tail (64..127).
DSQ_HD int rope_dim_a(int j, bool neox, bool tail) { return (tail ? kHeadDim - kRopeDim : 0) + (neox ? j : 2 * j); }
DSQ_HD int rope_dim_b(int j, bool neox, bool tail) { return rope_dim_a(j, neox, tail) + (neox ? kRopeDim / 2 : 1); }

// SPEC §5 / §7.5: table row of a position: pos & ~(r-1) (r a power of two), clamped to [0, max_pos).
DSQ_HD int64_t rope_position(int64_t pos, int64_t max_pos, int64_t ratio) {
  if (ratio > 1) pos &= ~(ratio - 1);
  return pos < 0 ? 0 : (pos >= max_pos ? max_pos - 1 : pos);
}

// Rotate the 64 rope dims of one 128 row in place (fp32, not rounded; callers round per SPEC §5).
DSQ_HD void rope_row128(float* x, const float* cos32, const float* sin32, bool neox, bool tail) {
  for (int j = 0; j < kRopeDim / 2; ++j)
    rope_pair(x[rope_dim_a(j, neox, tail)], x[rope_dim_b(j, neox, tail)], cos32[j], sin32[j]);
}

// ---- Norms (S = canonical sum, SPEC §0.2) ------------------------------------------------------
// 1 / sqrt(v + eps), both correctly rounded (SPEC §0.1).
DSQ_HD float inv_sqrt_eps(float v, float eps) { return fdiv(1.0f, fsqrt(fadd(v, eps))); }

// S / 128 for the norms of a 128 row, without a division: x * 2^-7 and x / 128 are both the correctly
// rounded value of x * 2^-7, so their bits agree for every x (subnormal results too: no FTZ, SPEC §0.6).
// tests/test_header_host.py::test_div128_equals_division checks it.
DSQ_HD float div128(float x) { return fmul(x, 0.0078125f); }

// LayerNorm: mean = S(x)/n, d = x - mean, var = S(d*d)/n, inv = 1/sqrt(var + eps), y = fl(fl(d*inv)*w) + b.
DSQ_HD float layer_norm_apply(float d, float inv, float w, float b) { return fadd(fmul(fmul(d, inv), w), b); }

template <int N>
DSQ_HD void layer_norm_row(float* x, const float* w, const float* b, float eps) {
  const float mean = fdiv(canonical_sum<N>(x), static_cast<float>(N));
  const float var = fdiv(canonical_sum_map<N>([x, mean](int i) { const float d = fsub(x[i], mean); return fmul(d, d); }),
                         static_cast<float>(N));
  const float inv = inv_sqrt_eps(var, eps);
  for (int i = 0; i < N; ++i) x[i] = layer_norm_apply(fsub(x[i], mean), inv, w[i], b[i]);
}

// RMSNorm: inv = 1/sqrt(S(x*x)/n + eps), y = fl(w * fl(x*inv)).
DSQ_HD float rms_norm_apply(float x, float inv, float w) { return fmul(w, fmul(x, inv)); }

template <int N>
DSQ_HD void rms_norm_row(float* x, const float* w, float eps) {
  const float ss = canonical_sum_map<N>([x](int i) { return fmul(x[i], x[i]); });
  const float inv = inv_sqrt_eps(fdiv(ss, static_cast<float>(N)), eps);
  for (int i = 0; i < N; ++i) x[i] = rms_norm_apply(x[i], inv, w[i]);
}

// ---- Hadamard (Sylvester order) ----------------------------------------------------------------
// fl(n^-0.5) for n = 2^k, from bits: 2^(-k/2) for even k, else fl(sqrt(1/2)) * 2^(-(k-1)/2).
// n = 128 gives 0x3DB504F3.
DSQ_HD float hadamard_scale(int n) {
  int k = 0;
  while ((1 << k) < n) ++k;
  return (k & 1) ? u2f((static_cast<uint32_t>(127 - (k + 1) / 2) << 23) | 0x3504F3u) : pow2(127 - k / 2);
}

// SPEC §5's butterflies on fp32[N]: for h = 1, 2, ..., N/2, each pair (i, i+h) with bit h of i clear becomes
// (a+b, a-b). In place, not scaled. Kernels whose thread holds N consecutive values of a longer row run these, then
// the larger strides across threads.
template <int N>
DSQ_HD void hadamard_butterflies(float* x) {
  static_assert(N >= 1 && (N & (N - 1)) == 0, "N must be a power of two");
  DSQ_UNROLL
  for (int h = 1; h < N; h <<= 1) {
    DSQ_UNROLL
    for (int i = 0; i < N; ++i)
      if ((i & h) == 0) {
        const float a = x[i], b = x[i + h];
        x[i] = fadd(a, b);
        x[i + h] = fsub(a, b);
      }
  }
}

// SPEC §5: the butterflies, then every element multiplied by fl(N^-0.5). In place on fp32[N] (N = 128 for the
// indexer).
template <int N>
DSQ_HD void hadamard_inplace(float* x) {
  static_assert(N >= 2 && (N & (N - 1)) == 0, "N must be a power of two");
  hadamard_butterflies<N>(x);
  const float c = hadamard_scale(N);
  for (int i = 0; i < N; ++i) x[i] = fmul(x[i], c);
}

DSQ_HD void hadamard128(float* x) { hadamard_inplace<kHeadDim>(x); }

}  // namespace dsq

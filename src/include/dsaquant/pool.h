// dsaquant/pool.h: the window pool of the DeepSeek-V4 compressor (SPEC §7.6 step 2), per column.
//
// For the K rows k of one column's window (sig_k = fl(score + ape), kv_k, `included` = the row's position
// s >= 0):
//   m   = NaN-ignoring max (fmaxf) of the included sig_k;
//   e_k = exp_ds(fl(sig_k - m)) for included rows, +0 for excluded ones          (SPEC §0.7)
//   S   = canonical sum of the K values e_k                                      (SPEC §0.2)
//   y   = canonical sum of fl(fl(e_k / S) * kv_k), the term +0 for excluded rows
// and y is NaN when any included sig_k is NaN or +Inf, or when every included sig_k is -Inf (or none is
// included). The pieces below are what a kernel distributes over threads; pool_window<K> is the whole pool
// in one thread, for the host tests (tests/test_header_compress_host.py holds both to reference.compress.pool).
#pragma once

#include "arith.h"

namespace dsq {

// Running state of the window max over the included rows: m is the NaN-propagating max of their sig (-Inf
// while there is none). Where no included sig is NaN it equals the NaN-ignoring max the pool subtracts; where one
// is, or where m is +Inf (an included +Inf) or -Inf (every included sig -Inf, or none included), the pooled value
// is the canonical NaN whatever the exponentials give, so one non-finite test of m decides pool_finish. One
// max a row and no flags: the kernels' pool stays free of branches.
struct PoolMax {
  float m;
};

DSQ_HD PoolMax pool_max_init() { return PoolMax{u2f(0xFF800000u)}; }

// Add an included row's sig. An excluded row may be added as -Inf instead of being skipped: it changes neither m
// nor the outcome, and its e_k = exp_ds(fl(-Inf - m)) is +0 wherever m is finite.
DSQ_HD void pool_max_add(PoolMax& a, float sig) { a.m = fmax_nan(a.m, sig); }

// Merge another part of the same window (max is exact, so the order of merges does not matter; a +0/-0 tie
// may give either zero, and exp_ds(fl(sig - (+-0))) is the same for both).
DSQ_HD void pool_max_merge(PoolMax& a, float m) { a.m = fmax_nan(a.m, m); }

// e_k of an included row: exp_ds(fl(sig - m)), bit for bit wherever m is finite (the only case whose e_k reach a
// pooled value). There x = fl(sig - m) lies in [-Inf, 0], and exp_ds's steps simplify: x clamped to -200 (-Inf
// included) gives n in [-289, 0], where exp_ds's clamps of n and of the exponent never act and every n below -151
// gives 0, as -Inf does. tests/test_header_compress_host.py holds it to exp_ds over every such x.
DSQ_HD float pool_exp(float sig, float m) {
  const ExpDsParts q = exp_ds_parts(fmax_nn(fsub(sig, m), -200.0f));
  const float p = q.p;
  const int ni = static_cast<int>(q.n);
  const bool normal = ni >= -126;
  float y = fmul(p, pow2(normal ? ni + 127 : (ni + 191 > 0 ? ni + 191 : 1)));
  y = normal ? y : fmul(y, pow2(63));
  return ni < -151 ? 0.0f : y;
}

// The weight of an included row, fl(e / S), and its term of y, fl(fl(e / S) * kv).
DSQ_HD float pool_weight(float e, float S) { return fdiv(e, S); }
DSQ_HD float pool_term(float e, float S, float kv) { return fmul(pool_weight(e, S), kv); }

// The N weights of one column in place, v[k] = fl(v[k] / S), bit for bit pool_weight. On CUDA the column shares one
// reciprocal: the fast path of the correctly rounded division (the hardware reciprocal of S refined once, then per
// value a product and one correction, the sequence of div.rn's own fast path) with the reciprocal computed once for
// the N values. It is taken where every v[k] is 0 or in [2^-100, 2) and S in [1, 256] (the pool's e_k and S for a
// finite window max, but for quotients near the subnormals, where div.rn takes its slow path); any other column
// divides each value. tests/gpu/test_compress_gpu.py holds the fast path to div.rn over every such v[k] for a set of S.
template <int N>
DSQ_HD void pool_weights(float (&v)[N], float S) {
#if defined(DSQ_CUDA_DEVICE)
  bool fast = S >= 1.0f && S <= 256.0f;
  DSQ_UNROLL
  for (int k = 0; k < N; ++k) fast = fast && ((v[k] >= u2f(0x0D800000u) && v[k] < 2.0f) || v[k] == 0.0f);
  if (fast) {
    float y0;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y0) : "f"(S));
    const float y1 = fma_explicit(y0, fma_explicit(-S, y0, 1.0f), y0);
    DSQ_UNROLL
    for (int k = 0; k < N; ++k) {
      const float q0 = __fmul_rn(v[k], y1);
      v[k] = fma_explicit(y1, fma_explicit(-S, q0, v[k]), q0);
    }
    return;
  }
#endif
  DSQ_UNROLL
  for (int k = 0; k < N; ++k) v[k] = pool_weight(v[k], S);
}

// The pooled value: y, or the canonical NaN for a poisoned or empty window (m not finite).
DSQ_HD float pool_finish(float y, const PoolMax& a) {
  return (f2u(a.m) & 0x7F800000u) == 0x7F800000u ? u2f(kCanonicalNanBits) : y;
}

// The whole pool of one column in one thread: sig, kv [K] fp32, incl [K] (K = 4 * 2^j, at most 1024).
template <int K>
DSQ_HD float pool_window(const float* sig, const float* kv, const bool* incl) {
  PoolMax st = pool_max_init();
  for (int k = 0; k < K; ++k)
    if (incl[k]) pool_max_add(st, sig[k]);
  const float S = canonical_sum_map<K>([&](int k) { return incl[k] ? pool_exp(sig[k], st.m) : 0.0f; });
  const float y = canonical_sum_map<K>([&](int k) { return incl[k] ? pool_term(pool_exp(sig[k], st.m), S, kv[k]) : 0.0f; });
  return pool_finish(y, st);
}

}  // namespace dsq

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

// Running state of the window max (m) and the two NaN conditions over the included rows.
struct PoolMax {
  float m;     // NaN-ignoring max of the included sig (-Inf while none is finite or +Inf)
  bool bad;    // an included sig is NaN or +Inf
  bool live;   // an included sig is not -Inf
};

DSQ_HD PoolMax pool_max_init() { return PoolMax{u2f(0xFF800000u), false, false}; }

// Add an included row's sig.
DSQ_HD void pool_max_add(PoolMax& a, float sig) {
  a.m = fmax_nn(a.m, sig);
  a.bad = a.bad || is_nan(sig) || (is_inf(sig) && !sign_bit(sig));
  a.live = a.live || !(is_inf(sig) && sign_bit(sig));
}

// Merge another part of the same window (max is exact, so the order of merges does not matter; a +0/-0 tie
// may give either zero, and exp_ds(fl(sig - (+-0))) is the same for both).
DSQ_HD void pool_max_merge(PoolMax& a, float m, bool bad, bool live) {
  a.m = fmax_nn(a.m, m);
  a.bad = a.bad || bad;
  a.live = a.live || live;
}

// e_k of an included row.
DSQ_HD float pool_exp(float sig, float m) { return exp_ds(fsub(sig, m)); }

// The weight of an included row, fl(e / S), and its term of y, fl(fl(e / S) * kv).
DSQ_HD float pool_weight(float e, float S) { return fdiv(e, S); }
DSQ_HD float pool_term(float e, float S, float kv) { return fmul(pool_weight(e, S), kv); }

// The pooled value: y, or the canonical NaN for a poisoned or empty window.
DSQ_HD float pool_finish(float y, const PoolMax& a) { return (a.bad || !a.live) ? u2f(kCanonicalNanBits) : y; }

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

// kernels/cuda/quad.cuh: the sum over the four lanes of a quad (lanes 4r .. 4r + 3, which hold the same rows of a
// warpgroup MMA accumulator fragment) of V partial values each, as a reduce-scatter: two exchanges (lane ^ 2, then
// lane ^ 1) that each halve the values a lane keeps, so that every sum is complete in one lane and the lanes of a
// quad store disjoint values. Shared by the scorers' block bodies (prefill_body.cuh, scorer_body.cuh) on the GPU
// and under the host emulators of the tests; the caller passes its 32-lane exchange.
#pragma once

#include "dsaquant/platform.h"

namespace dsq_quad {

// Sums a lane holds after the reduce-scatter of V values (V a power of two >= 2).
template <int V>
constexpr int kSlots = V >= 4 ? V / 4 : 1;

// The value (index into v) that slot i of `lane` holds: lane (b1, b0) = bits 1 and 0 of the lane holds
// b1 V/2 + b0 V/4 + i; for V = 2 both lanes of a pair hold value b1 (quad_stores: the even one stores it).
template <int V>
DSQ_HD int quad_value(int lane, int i) {
  const int b1 = (lane >> 1) & 1, b0 = lane & 1;
  return V >= 4 ? b1 * (V / 2) + b0 * (V / 4) + i : b1;
}
template <int V>
DSQ_HD bool quad_stores(int lane) { return V >= 4 || (lane & 1) == 0; }

// g[i] = the quad's sum of value quad_value<V>(lane, i). shfl(x, m): lane ^ m's x (every lane of the warp calls
// it together).
template <int V, class Shfl>
DSQ_HD void quad_reduce_scatter(const float (&v)[V], int lane, float (&g)[kSlots<V>], Shfl shfl) {
  static_assert(V >= 2 && (V & (V - 1)) == 0, "V: a power of two >= 2");
  const int b1 = (lane >> 1) & 1, b0 = lane & 1;
  constexpr int V1 = V / 2;
  float h[V1];
  DSQ_UNROLL
  for (int e = 0; e < V1; ++e) {
    const float give = b1 ? v[e] : v[e + V1], keep = b1 ? v[e + V1] : v[e];
    h[e] = keep + shfl(give, 2);
  }
  if constexpr (V1 >= 2) {
    constexpr int S = kSlots<V>;
    DSQ_UNROLL
    for (int e = 0; e < S; ++e) {
      const float give = b0 ? h[e] : h[e + S], keep = b0 ? h[e + S] : h[e];
      g[e] = keep + shfl(give, 1);
    }
  } else {
    g[0] = h[0] + shfl(h[0], 1);
  }
}

}  // namespace dsq_quad

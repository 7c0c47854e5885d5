// kernels/cuda/lanes.cuh: the cross-lane steps of a 128-wide row held by a group of LANES consecutive lanes
// of a warp, written once for every group size of the writers:
//   LANES = 16: row16.cuh (8 values a lane);
//   LANES = 8:  qrows.cuh (the indexer, the v41 q writers and the k writers: 16 values a lane, "split8");
// A group starts at a lane that is a multiple of LANES. Every lane of the group must call these helpers
// together, with s < LANES (they shuffle with width LANES, so no read leaves the group; platform_hip.h relies
// on this on a wave64). What each lane holds, and so which partials or values it passes in, is the
// includer's layout; these helpers only combine them across the group.
#pragma once

#include <cstdint>

#include "dsaquant/dsaquant.h"

namespace dsqk {

using namespace dsq;

// The group's lanes as a CUDA warp mask: LANES set bits at the group's first lane, that is
// ((1 << LANES) - 1) << (threadIdx.x & (32 - LANES)). The 16-lane form is a select between the warp's two
// halves (the instructions the 16-lane kernels were measured with), the 8-lane form the shift.
template <int LANES>
__device__ __forceinline__ unsigned group_mask() {
  static_assert(LANES == 8 || LANES == 16, "a row group is 8 or 16 lanes");
  if constexpr (LANES == 16) return (threadIdx.x & 16) ? 0xFFFF0000u : 0x0000FFFFu;
  else return ((1u << LANES) - 1u) << (threadIdx.x & (32 - LANES));
}

// The value of lane (l ^ s) of the group (s < LANES). `mask` is group_mask<LANES>().
template <int LANES, class T>
__device__ __forceinline__ T group_shfl_xor(unsigned mask, T v, int s) {
  return __shfl_xor_sync(mask, v, s, LANES);
}

// SPEC §0.2: the canonical sum's levels between lanes, then its last level. Lane l holds partials 2l and
// 2l+1 as p0 and p1 (any level above partial stride LANES already added in-lane), so the level of partial
// stride 2s pairs lane l with lane l ^ s (s = LANES/2 .. 1), and the last level (stride 1) adds the
// lane's two. Every lane gets the sum.
template <int LANES>
__device__ __forceinline__ float group_sum(unsigned mask, float p0, float p1) {
#pragma unroll
  for (int s = LANES / 2; s >= 1; s >>= 1) {
    p0 = fadd(p0, group_shfl_xor<LANES>(mask, p0, s));
    p1 = fadd(p1, group_shfl_xor<LANES>(mask, p1, s));
  }
  return fadd(p0, p1);
}

// SPEC §0.3: the NaN-ignoring max of the lanes' m over `lanes` lanes (a power of two <= LANES: the whole
// row, or the lanes of one scale block); lanes 0 .. lanes-1 of each aligned run get the same result.
template <int LANES>
__device__ __forceinline__ float group_max(unsigned mask, float m, int lanes) {
  for (int s = lanes >> 1; s >= 1; s >>= 1) m = fmax_nn(m, group_shfl_xor<LANES>(mask, m, s));
  return m;
}

}  // namespace dsqk

// kernels/hip/platform_hip.h: what the hipified kernels need on top of HIP, force-included (`-include`)
// first into every translation unit of the HIP build by tools/build_hip.py. Nothing else of the HIP
// build is written by hand: the sources are kernels/cuda/* and src/bindings.cpp, hipified at build time.
//
// Warp shuffles (kernels/hip/hipify_extra.map renames the CUDA calls to these).
//   CUDA: __shfl_xor_sync(mask, v, s, width = 32), __shfl_sync(mask, v, src, width = 32), ...
//   HIP's own *_sync builtins (ROCm >= 6.2) are not used, on purpose:
//     - they require a 64-bit mask naming lanes of the 64-lane wave and check it (a waterfall loop over
//       __ballot/readfirstlane, and a trap when a lane of the mask is absent). The kernels' masks are CUDA
//       warp masks: lanes.cuh's group_mask<16>() gives 0x0000FFFF / 0xFFFF0000 from threadIdx.x & 16, which on
//       a wave64 names lanes 0..31 for the groups at lanes 32..63 too. Passing it on would be wrong, and
//       the check costs instructions on every shuffle.
//     - HIP's plain __shfl_xor / __shfl / __shfl_up / __shfl_down take no mask and are exact on wave64 for
//       every width that is a power of two <= 64: a lane reads lane (lane ^ s) of its own aligned group of
//       `width` lanes (ds_bpermute_b32).
//   So the mask is dropped. That is correct because of the contract of kernels/cuda/lanes.cuh: every lane
//   of a 16-lane group calls each shuffle together, with width 16 and s < 16 (qrows.cuh's 8-lane groups:
//   width 8 and s < 8), so every lane read is an active lane of the caller's own group. Other groups of the same wave may have returned early (their
//   exec bits are off): they are never read, because no shuffle of width 16 leaves its group.
//   The default width is CUDA's warp size, 32 (not HIP's warpSize, 64), so a call without a width behaves
//   on each half of a wave64 as on a CUDA warp (kernels/cuda/selfcheck.cu's 32-lane reduction).
//   Warp votes and masks (__ballot_sync, __any_sync, __all_sync, __activemask, __syncwarp, warpSize, ...)
//   have different widths on a wave64 and are not mapped: tools/build_hip.py refuses hipified sources
//   that use them, so a kernel that starts using one gets a deliberate HIP version here.
#pragma once

#if defined(__HIP__)
#include <hip/hip_runtime.h>

template <class T>
__device__ __forceinline__ T dsq_shfl_xor_sync(unsigned long long /*cuda_mask*/, T v, int lane_mask, int width = 32) {
  return __shfl_xor(v, lane_mask, width);
}

template <class T>
__device__ __forceinline__ T dsq_shfl_sync(unsigned long long /*cuda_mask*/, T v, int src_lane, int width = 32) {
  return __shfl(v, src_lane, width);
}

template <class T>
__device__ __forceinline__ T dsq_shfl_up_sync(unsigned long long /*cuda_mask*/, T v, unsigned int delta, int width = 32) {
  return __shfl_up(v, delta, width);
}

template <class T>
__device__ __forceinline__ T dsq_shfl_down_sync(unsigned long long /*cuda_mask*/, T v, unsigned int delta, int width = 32) {
  return __shfl_down(v, delta, width);
}
#endif  // __HIP__

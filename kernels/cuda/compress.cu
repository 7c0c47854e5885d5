// kernels/cuda/compress.cu: SPEC §7.6 compress_kv and §7.7 rope_rotate_quant on the GPU. The kernel bodies are
// compress_body.cuh and rotate_body.cuh (shared with the host emulator of tests/cpp/compress_host.cpp); this file
// supplies the SIMT layer (thread/block ids, block barrier, 32-lane shuffles, the error-flag atomic, an L1 prefetch
// hint, 16/8-byte loads, 16/8/4-byte stores), the kernels and the launchers.
//
// compress_kv: one launch, 256 threads a block, grid = B sequence blocks + the token-range blocks (compress_args.h
//   compress_grid: one range of `ratio` tokens a block, or 8 a block, one a warp, for calls of many ranges; for
//   K >= 128 on sm_90 and later, a cluster of 8 or 4 blocks for each sequence and each range, splitting the
//   columns); template <K, D, MODE> (K = (1+overlap)*ratio in {4, 8, 128, 256}, D in {128, 512}, MODE kRangeBlock,
//   kRangeWarp for K <= 8 and D = 128, or kSplit8 / kSplit4); the ring ordering argument is in compress_body.cuh.
//   Static shared memory: CompressSmem (2 KB).
// rope_rotate_quant: one launch, 128 threads a block, D/V lanes a (t, h) row (rotate_body.cuh); template <D, V, MODE>:
//   V = 16 (32 for D = 1024) with the output mode chosen at run time for small calls; for large ones V = 64
//   (DSQ_ROTATE_V_LARGE_128 for D = 128, _WIDE for wider rows), one instance per output mode. Static shared
//   memory: RotateSmem (the block's RoPE table, 2 KB).
// Built with --fmad=false and without fast math (tools/build_native.py; SPEC §0.1).
#include <climits>

#include "compress.h"
#include "cluster.cuh"
#include "launch.cuh"

namespace dsqv4 {

#define V4_FN __device__ __forceinline__
#define V4_UNROLL _Pragma("unroll")
#define V4_NO_UNROLL _Pragma("unroll 1")

__device__ __forceinline__ int thread_id() { return static_cast<int>(threadIdx.x); }
__device__ __forceinline__ int64_t block_id() { return static_cast<int64_t>(blockIdx.x); }
__device__ __forceinline__ void block_sync() { __syncthreads(); }
__device__ __forceinline__ float shfl_xor(float v, int s) { return __shfl_xor_sync(0xFFFFFFFFu, v, s, 32); }
__device__ __forceinline__ int shfl_xor_i(int v, int s) { return __shfl_xor_sync(0xFFFFFFFFu, v, s, 32); }
__device__ __forceinline__ void atomic_or(int* p, int v) { atomicOr(p, v); }
#if defined(__HIP__)
__device__ __forceinline__ void prefetch_l1(const void*) {}
#else
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }
#endif
__device__ __forceinline__ void ld16(const void* p, uint32_t (&w)[4]) {
  const uint4 v = *static_cast<const uint4*>(p);
  w[0] = v.x;
  w[1] = v.y;
  w[2] = v.z;
  w[3] = v.w;
}
__device__ __forceinline__ void ld8(const void* p, uint32_t (&w)[2]) {
  const uint2 v = *static_cast<const uint2*>(p);
  w[0] = v.x;
  w[1] = v.y;
}
__device__ __forceinline__ void st16(void* p, const uint32_t (&w)[4]) {
  *static_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ void st8(void* p, uint32_t w0, uint32_t w1) { *static_cast<uint2*>(p) = make_uint2(w0, w1); }
__device__ __forceinline__ void st4(void* p, uint32_t w) { *static_cast<uint32_t*>(p) = w; }
#if !defined(__HIP__)
// The cluster layer of the column-split windows (cluster.cuh; their kernels run sm_90 code only).
#define DSQ_V4_CLUSTERS 1
using dsqcl::cluster_peer;
using dsqcl::cluster_rank;
using dsqcl::cluster_sync;
#endif

}  // namespace dsqv4

#include "compress_body.cuh"
#include "rotate_body.cuh"

namespace dsqv4 {

// The second bound (CUDA: min resident blocks per SM; HIP: min waves per EU) is given so that ptxas does not pick an
// occupancy-driven register target of its own, which spilled a few registers of some instantiations (sm_90a/100a).
// Large windows keep 120-170 registers on sm_90a (a thread holds 8 window rows of sig and kv, compress_body.cuh Geo).
// The column-split instances (MODE kSplit4, kSplit8) exist in sm_90 code and later only: launch_split checks that the
// device runs such code (cluster.cuh runs_sm90_code) before it launches them in clusters.
template <int K, int D, int MODE>
__global__ void __launch_bounds__(256, K <= 8 ? 2 : 1) compress_kv_kernel(CompressArgs a) {
  __shared__ CompressSmem sm;
  dsq_launch::dependent_entry();
  if constexpr (kSplitOf<MODE> > 1) {
#if defined(DSQ_V4_CLUSTERS) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    compress_block<K, D, MODE>(a, sm);
#endif
  } else {
    compress_block<K, D, MODE>(a, sm);
  }
}

// At most 168 registers (3 blocks of 128 threads an SM): a large call's thread holds a row of 128 fp32 values.
template <int D, int V, int MODE>
__global__ void __launch_bounds__(rot::kThreads, 3) rope_rotate_kernel(RotateArgs a, rot::Run run) {
  __shared__ rot::RotateSmem sm;
  dsq_launch::dependent_entry();
  rot::rotate_block<D, V, MODE>(a, run, sm);
}

template <int D, int V, int MODE>
int launch_rotate(const RotateArgs& a, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(rot::rotate_grid(a, V));
  static_cast<void>(dsq_launch::launch(rope_rotate_kernel<D, V, MODE>, {dim3(grid), dim3(rot::kThreads)}, stream,
                                       dsq_launch::kWriters, a, rot::rotate_run(a, V)));
  return static_cast<int>(cudaGetLastError());
}

// Small calls: one instance of D, the output mode chosen at run time. Large calls: an instance per output mode, so
// that each keeps the registers of its own path only (FP8 e4m3fnuz: always the small instance). AMD: the small
// instance for every call (a 64- or 128-value lane does not fit gfx942/gfx950's registers at 3 blocks of 128
// threads without scratch).
template <int D>
int launch_rotate_d(const RotateArgs& a, cudaStream_t stream) {
  using I = rot::Instances<D>;
#if defined(__HIP__)
  return launch_rotate<D, I::kSmall, rot::kAnyMode>(a, stream);
#else
  if (rot::rotate_values_per_lane(a, I::kSmall, I::kLarge) == I::kSmall)
    return launch_rotate<D, I::kSmall, rot::kAnyMode>(a, stream);
  switch (rot::rotate_mode(a)) {
    case rot::kFp4Threshold: return launch_rotate<D, I::kLarge, rot::kFp4Threshold>(a, stream);
    case rot::kFp4Rne: return launch_rotate<D, I::kLarge, rot::kFp4Rne>(a, stream);
    case rot::kFp4Hardware: return launch_rotate<D, I::kLarge, rot::kFp4Hardware>(a, stream);
    case rot::kFp8Fn: return launch_rotate<D, I::kLarge, rot::kFp8Fn>(a, stream);
    case rot::kHalf: return launch_rotate<D, I::kLarge, rot::kHalf>(a, stream);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
#endif
}

#if defined(DSQ_V4_CLUSTERS)
// Windows of K >= 128 rows in clusters of kSplitOf<MODE> blocks (compress_body.cuh kSplit4, kSplit8). Returns
// -1 where the device cannot run them (no sm_90 code, or the launch refused): the caller then takes one block a window.
template <int K, int D, int MODE>
int launch_split(const CompressArgs& a, cudaStream_t stream) {
  constexpr int S = kSplitOf<MODE>;
  const auto kernel = compress_kv_kernel<K, D, MODE>;
  if (!dsqcl::runs_sm90_code<struct CompressSplit>(reinterpret_cast<const void*>(kernel))) return -1;
  const dsq_launch::Shape shape{dim3(static_cast<unsigned>(compress_grid(a, false, S))), dim3(kThreads), 0, S};
  if (dsq_launch::launch(kernel, shape, stream, dsq_launch::kWriters, a) == cudaSuccess) return 0;
  static_cast<void>(cudaGetLastError());
  return -1;
}
#endif

template <int K>
int launch_compress_k(const CompressArgs& a, cudaStream_t stream) {
#if defined(DSQ_V4_CLUSTERS)
  if constexpr (K >= 128) {
    const int S = compress_split_blocks(a);
    if (compress_split_windows(a) && compress_grid(a, false, S) <= INT32_MAX) {
      const int rc = S == 8 ? (a.D == 128 ? launch_split<K, 128, kSplit8>(a, stream)
                                          : launch_split<K, 512, kSplit8>(a, stream))
                            : (a.D == 128 ? launch_split<K, 128, kSplit4>(a, stream)
                                          : launch_split<K, 512, kSplit4>(a, stream));
      if (rc == 0) return 0;
    }
  }
#endif
  const bool warps = compress_warp_ranges(a);
  const unsigned grid = static_cast<unsigned>(compress_grid(a, warps));
  auto go = [&](auto kernel) {
    return static_cast<int>(dsq_launch::launch(kernel, {dim3(grid), dim3(kThreads)}, stream, dsq_launch::kWriters, a));
  };
  if constexpr (K <= 8) {
    if (warps) return go(compress_kv_kernel<K, 128, kRangeWarp>);
  }
  if (a.D == 128) return go(compress_kv_kernel<K, 128, kRangeBlock>);
  if (a.D == 512) return go(compress_kv_kernel<K, 512, kRangeBlock>);
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace dsqv4

int dsq_compress_kv_launch(const dsqv4::CompressArgs& a, cudaStream_t stream) {
  using namespace dsqv4;
  if (a.T == 0 || a.B == 0) return 0;
  switch (a.K) {
    case 4: return launch_compress_k<4>(a, stream);
    case 8: return launch_compress_k<8>(a, stream);
    case 128: return launch_compress_k<128>(a, stream);
    case 256: return launch_compress_k<256>(a, stream);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

int dsq_rope_rotate_launch(const dsqv4::RotateArgs& a, cudaStream_t stream) {
  using namespace dsqv4;
  if (a.T == 0 || a.H == 0) return 0;
  switch (a.D) {
    case 128: return launch_rotate_d<128>(a, stream);
    case 256: return launch_rotate_d<256>(a, stream);
    case 512: return launch_rotate_d<512>(a, stream);
    case 1024: return launch_rotate_d<1024>(a, stream);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

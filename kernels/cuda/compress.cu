// kernels/cuda/compress.cu: SPEC §7.6 compress_kv and §7.7 rope_rotate_quant on the GPU. The kernel bodies are
// compress_body.cuh (shared with the host emulator of tests/cpp/compress_host.cpp); this file supplies the SIMT layer
// (thread/block ids, block barrier, 32-lane shuffles, the error-flag atomic), the kernels and the launchers.
//
// compress_kv: one launch, 256 threads a block, grid = B sequence blocks + ceil(T / ratio) token-range
//   blocks; template <K, D> (K = (1+overlap)*ratio in {4, 8, 128, 256}, D in {128, 512}); the ring ordering
//   argument is in compress_body.cuh. Static shared memory: CompressSmem (2 KB).
// rope_rotate_quant: one launch, one 32-lane warp per (t, h) row, 8 rows per 256-thread block; template <D>.
// Built with --fmad=false and without fast math (tools/build_native.py; SPEC §0.1).
#include "compress.h"

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

}  // namespace dsqv4

#include "compress_body.cuh"

namespace dsqv4 {

// The second bound (CUDA: min resident blocks per SM; HIP: min waves per EU) is given so that ptxas does not pick an
// occupancy-driven register target of its own, which spilled a few registers of some instantiations (sm_90a/100a).
// Large windows keep ~200 registers (the pool holds K/32 rows of sig per thread and hoists their loads).
template <int K, int D>
__global__ void __launch_bounds__(256, K <= 8 ? 2 : 1) compress_kv_kernel(CompressArgs a) {
  __shared__ CompressSmem sm;
  compress_block<K, D>(a, sm);
}

template <int D>
__global__ void __launch_bounds__(256) rope_rotate_kernel(RotateArgs a) {
  rotate_block<D>(a);
}

template <int K>
int launch_compress_k(const CompressArgs& a, unsigned grid, cudaStream_t stream) {
  if (a.D == 128) compress_kv_kernel<K, 128><<<grid, kThreads, 0, stream>>>(a);
  else if (a.D == 512) compress_kv_kernel<K, 512><<<grid, kThreads, 0, stream>>>(a);
  else return static_cast<int>(cudaErrorInvalidValue);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace dsqv4

int dsq_compress_kv_launch(const dsqv4::CompressArgs& a, cudaStream_t stream) {
  using namespace dsqv4;
  if (a.T == 0 || a.B == 0) return 0;
  const unsigned grid = static_cast<unsigned>(compress_grid(a));
  switch (a.K) {
    case 4: return launch_compress_k<4>(a, grid, stream);
    case 8: return launch_compress_k<8>(a, grid, stream);
    case 128: return launch_compress_k<128>(a, grid, stream);
    case 256: return launch_compress_k<256>(a, grid, stream);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

int dsq_rope_rotate_launch(const dsqv4::RotateArgs& a, cudaStream_t stream) {
  using namespace dsqv4;
  if (a.T == 0 || a.H == 0) return 0;
  const unsigned grid = static_cast<unsigned>(rotate_grid(a));
  switch (a.D) {
    case 128: rope_rotate_kernel<128><<<grid, kThreads, 0, stream>>>(a); break;
    case 256: rope_rotate_kernel<256><<<grid, kThreads, 0, stream>>>(a); break;
    case 512: rope_rotate_kernel<512><<<grid, kThreads, 0, stream>>>(a); break;
    case 1024: rope_rotate_kernel<1024><<<grid, kThreads, 0, stream>>>(a); break;
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

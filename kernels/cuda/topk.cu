// kernels/cuda/topk.cu: top-k positions per row of a logits matrix (docs/topk.md), byte-identical to the
// reference (python/dsaquant/reference/topk.py) and the Triton kernel. The algorithm is topk_body.cuh (shared
// with the host emulator of the tests); this file supplies the SIMT layer (thread id, block barrier, 32-lane
// shuffles, atomic adds, and on NVIDIA the cluster barrier and addresses of another block's shared memory), the
// kernels, their launches and the C interface (topk.h).
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cluster.cuh"
#include "launch.cuh"

#if defined(__HIP__)
#define DSQ_TOPK_AMD 1
#endif

namespace dsqtopk {

#define TOPK_FN __device__ __forceinline__
__device__ __forceinline__ int thread_id() { return static_cast<int>(threadIdx.x); }
__device__ __forceinline__ void block_sync() { __syncthreads(); }
__device__ __forceinline__ int shfl_up_i(int v, int off) { return __shfl_up_sync(0xFFFFFFFFu, v, off, 32); }
__device__ __forceinline__ unsigned long long shfl_up_u64(unsigned long long v, int off) {
  return __shfl_up_sync(0xFFFFFFFFu, v, off, 32);
}
__device__ __forceinline__ unsigned long long shfl_xor_u64(unsigned long long v, int m) {
  return __shfl_xor_sync(0xFFFFFFFFu, v, m, 32);
}
__device__ __forceinline__ int shared_add(int* p, int v) { return atomicAdd(p, v); }
__device__ __forceinline__ int global_add(int* p, int v) { return atomicAdd(p, v); }
#if !defined(__HIP__)
// The cluster layer (cluster.cuh; sm_90 on; only cache_block uses it, and only in clusters launched as such).
using dsqcl::cluster_peer;
using dsqcl::cluster_rank;
using dsqcl::cluster_sync;
#endif

}  // namespace dsqtopk

#include "topk_body.cuh"

namespace dsqtopk {
namespace {

__device__ __forceinline__ Shared& dynamic_shared() {
  extern __shared__ __align__(16) unsigned char dsq_topk_smem[];
  return *reinterpret_cast<Shared*>(dsq_topk_smem);
}

template <int DT>
__global__ void __launch_bounds__(kThreads, 1) topk_row_kernel(const DsqTopkArgs a) {
  row_block<DT>(a, blockIdx.x, dynamic_shared());
}

#if DSQ_TOPK_CACHE_KEYS > 0
// Clusters of `blocks` blocks a row (a plain launch for one); the body exists in sm_90 code and later only
// (cache_supported checks that the device runs such code).
template <int DT, int C>
__global__ void __launch_bounds__(kThreads, 1) topk_cache_kernel(const DsqTopkArgs a, int blocks) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char dsq_topk_smem[];
  dsq_launch::dependent_entry();   // launched as a dependent (launch.cuh)
  const int rank = blocks > 1 ? cluster_rank() : 0;
  cache_block<DT, C>(a, blockIdx.x / blocks, rank, blocks, *reinterpret_cast<CacheShared*>(dsq_topk_smem));
#endif
}

// Whether the current device runs the cached-row kernel (from sm_90 code: cluster.cuh runs_sm90_code).
bool cache_supported() {
  return dsqcl::runs_sm90_code<struct TopkCache>(reinterpret_cast<const void*>(topk_cache_kernel<0, kCollectSum>));
}
#endif

template <int DT>
__global__ void __launch_bounds__(kThreads) topk_hist_kernel(const DsqTopkArgs a, int32_t chunks) {
  __shared__ ChunkShared sh;
  hist_block<DT>(a, chunks, blockIdx.x, sh);
}

template <int DT>
__global__ void __launch_bounds__(kThreads, 1) topk_scatter_kernel(const DsqTopkArgs a, int32_t chunks) {
  __shared__ ChunkShared sh;
  scatter_block<DT>(a, chunks, blockIdx.x, sh);
}

template <int DT>
__global__ void __launch_bounds__(kThreads, 1) topk_finish_kernel(const DsqTopkArgs a) {
  finish_block<DT>(a, blockIdx.x, dynamic_shared());
}

// The launches of one call on a stream (topk_body.cuh run()).
struct Stream {
  cudaStream_t stream;

  template <class Kernel>
  int dynamic(Kernel kernel, int64_t grid, const DsqTopkArgs& a) {
    const cudaError_t e = cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, sizeof(Shared));
    if (e != cudaSuccess) return static_cast<int>(e);
    kernel<<<grid, kThreads, sizeof(Shared), stream>>>(a);
    return static_cast<int>(cudaGetLastError());
  }
  template <int DT>
  int row(const DsqTopkArgs& a) { return dynamic(topk_row_kernel<DT>, a.rows, a); }
  template <int DT>
  int finish(const DsqTopkArgs& a) { return dynamic(topk_finish_kernel<DT>, a.rows * kFinishGroups, a); }
#if DSQ_TOPK_CACHE_KEYS > 0
  // -1 where the device cannot run it (run() then takes one block a row): no sm_90 code for it, a grid past
  // 2^31 - 1 blocks, or a launch refused for its resources (clusters of blocks of 1024 threads and ~210 KB of
  // shared memory each).
  template <int DT>
  int cache(const DsqTopkArgs& a, int blocks) {
    if (!cache_supported() || a.rows > INT32_MAX / blocks) return -1;
    const int c = cache_collect(blocks);
    auto kernel = c == kCollectSum   ? topk_cache_kernel<DT, kCollectSum>
                  : c == kCollectAdd ? topk_cache_kernel<DT, kCollectAdd>
                                     : topk_cache_kernel<DT, kCollectStage>;
    // clusters past 8 blocks are a non-portable size (sm_90: up to 16)
    if (cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
                             sizeof(CacheShared)) != cudaSuccess ||
        (blocks > 8 && cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                            cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess)) {
      static_cast<void>(cudaGetLastError());
      return -1;
    }
    const dsq_launch::Shape shape{dim3(static_cast<unsigned>(a.rows * blocks)), dim3(kThreads), sizeof(CacheShared),
                                  static_cast<unsigned>(blocks)};
    const cudaError_t e = dsq_launch::launch(kernel, shape, stream, dsq_launch::kTopk, a, blocks);
    if (e == cudaSuccess) return 0;
    static_cast<void>(cudaGetLastError());
    return -1;
  }
#endif
  int memset(void* p, size_t bytes) { return static_cast<int>(cudaMemsetAsync(p, 0, bytes, stream)); }
  template <int DT>
  int hist(const DsqTopkArgs& a, int32_t chunks) {
    topk_hist_kernel<DT><<<a.rows * chunks, kThreads, 0, stream>>>(a, chunks);
    return static_cast<int>(cudaGetLastError());
  }
  template <int DT>
  int scatter(const DsqTopkArgs& a, int32_t chunks) {
    topk_scatter_kernel<DT><<<a.rows * chunks, kThreads, 0, stream>>>(a, chunks);
    return static_cast<int>(cudaGetLastError());
  }
};

}  // namespace
}  // namespace dsqtopk

extern "C" __attribute__((visibility("default"))) int32_t dsq_topk_plan_chunks(int64_t rows, int64_t L, int64_t k,
                                                                             int32_t sms) {
  return dsqtopk::plan_chunks(rows, L, k, sms);
}

extern "C" __attribute__((visibility("default"))) int64_t dsq_topk_workspace_bytes(int64_t rows, int64_t L, int64_t k,
                                                                                 int32_t chunks) {
  return dsqtopk::workspace_bytes(rows, L, k, chunks);
}

extern "C" __attribute__((visibility("default"))) int dsq_topk_indices(const DsqTopkArgs* args, void* stream) {
  dsqtopk::Stream dev{static_cast<cudaStream_t>(stream)};
  return dsqtopk::run(args, dev);
}

// kernels/cuda/cluster.cuh: the thread-block-cluster layer of the NVIDIA kernels (sm_90 and later) that pool work
// across the blocks of a cluster (topk.cu's cached-row path, compress.cu's column-split windows): the barrier of
// every thread of the cluster, with release / acquire ordering of shared-memory accesses across its blocks; the
// address in block r's shared memory of the object at p in the caller's (distributed shared memory); the block's
// rank in its cluster; and the host's check that a device runs a kernel from sm_90 code. Nothing here exists on
// AMD (no clusters): the includers take their one-block paths there.
#pragma once

#if !defined(__HIP__)
#include <cuda_runtime.h>

namespace dsqcl {

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
template <class T>
__device__ __forceinline__ T* cluster_peer(T* p, int r) {
  T* q;
  asm volatile("mapa.u64 %0, %1, %2;" : "=l"(q) : "l"(p), "r"(r));
  return q;
}
__device__ __forceinline__ int cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return static_cast<int>(r);
}

namespace {   // internal linkage: each library source keeps its own flags, and none of them is exported

// Whether the current device runs `kernel` from sm_90 code or later: compute capability 9.0 or later and a binary
// of the kernel for it (not one from the compute_80 PTX, where the cluster bodies are empty). Read once per device
// for each Tag (one tag a kernel family); threads that read it at the same time store the same answer.
template <class Tag>
bool runs_sm90_code(const void* kernel) {
  constexpr int kDevices = 64;
  static int known[kDevices];   // 0: not read yet, 1: runs it, 2: does not
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kDevices) {
    static_cast<void>(cudaGetLastError());
    return false;
  }
  int k = __atomic_load_n(&known[dev], __ATOMIC_ACQUIRE);
  if (k == 0) {
    int major = 0;
    cudaFuncAttributes attr{};
    const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                    major >= 9 && cudaFuncGetAttributes(&attr, kernel) == cudaSuccess && attr.binaryVersion >= 90 &&
                    attr.ptxVersion >= 90;
    static_cast<void>(cudaGetLastError());
    k = ok ? 1 : 2;
    __atomic_store_n(&known[dev], k, __ATOMIC_RELEASE);
  }
  return k == 1;
}

}  // namespace
}  // namespace dsqcl
#endif

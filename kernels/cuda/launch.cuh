// kernels/cuda/launch.cuh: kernel launches that may overlap the previous kernel in the stream (programmatic
// dependent launch, sm_90 and later).
//
// A kernel launched by launch() with `dependent` set may be placed on the SMs before the kernel ahead of it in the
// stream has completed: its launch and block placement overlap that kernel's last blocks (in a CUDA graph the
// dependency is captured as such). Every such kernel calls dependent_entry() before it touches global memory: it
// lets the kernel after it start the same way, then returns once the kernel ahead has completed and its writes are
// visible. Where the launch is plain (dependent unset, an AMD build, a device before sm_90) both steps return at
// once, so a kernel calls dependent_entry() however it was launched.
#pragma once

#include <utility>

namespace dsq_launch {

// Build switches of the families whose launch sites pass them: the writers (the indexer op, the q and k writers,
// compress_kv, rope_rotate_quant) and the top-k's cached-row kernel. A launch is made dependent by default only
// where it measured faster (the decode scorer's rule, scorer.cu); these two are variants to time
// (dev/cuda_variants.sh "plain:" "dependent:-DDSQ_DEPENDENT_WRITERS=1 -DDSQ_DEPENDENT_TOPK=1"), off because no
// size rule separated their gains from their losses (H100, µs, plain against dependent, two rounds each): the k
// writers and the indexer at T = 1 gained 0.25 - 0.45, the q packer lost 0.37 at T = 64, the V4 k writer 0.3 at
// T = 8192; the top-k gained 0.3 - 0.8 on three of the bench's shapes and lost 0.3 on 16 x 65536.
#ifndef DSQ_DEPENDENT_WRITERS
#define DSQ_DEPENDENT_WRITERS 0
#endif
#ifndef DSQ_DEPENDENT_TOPK
#define DSQ_DEPENDENT_TOPK 0
#endif
constexpr bool kWriters = DSQ_DEPENDENT_WRITERS != 0;
constexpr bool kTopk = DSQ_DEPENDENT_TOPK != 0;

// dependent_entry() in two steps, for a kernel with work to do in between that reads no global memory the kernel
// ahead may write (or reads it only to choose what to prefetch, never to compute with).
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_previous() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void dependent_entry() {
  allow_dependents();
  wait_previous();
}

// A launch's grid, blocks, dynamic shared memory and cluster size (blocks; 1: no cluster).
struct Shape {
  dim3 grid, block;
  size_t smem = 0;
  unsigned cluster = 1;
};

// kernel<<<grid, block, smem, stream>>>(args...) in clusters of shape.cluster blocks, a programmatic dependent of
// the previous kernel where `dependent` (NVIDIA builds; AMD has no clusters: cudaErrorInvalidValue for any).
// Returns the launch's error code.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), const Shape& shape, cudaStream_t stream, bool dependent, Args&&... args) {
#if defined(__HIP__)
  static_cast<void>(dependent);
  if (shape.cluster != 1) return cudaErrorInvalidValue;
  kernel<<<shape.grid, shape.block, shape.smem, stream>>>(std::forward<Args>(args)...);
  return cudaGetLastError();
#else
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = shape.grid;
  cfg.blockDim = shape.block;
  cfg.dynamicSmemBytes = shape.smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (dependent) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (shape.cluster != 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = shape.cluster;
    attr[n].val.clusterDim.y = 1;
    attr[n++].val.clusterDim.z = 1;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
#endif
}

}  // namespace dsq_launch

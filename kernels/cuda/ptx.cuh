// kernels/cuda/ptx.cuh: the inline PTX that the NVIDIA kernels share. Asynchronous copies (sm_80+): 16 or 4 bytes
// from global into shared memory without passing through registers, committed in groups that complete in order
// (cp_async_wait<N> returns when at most N of the thread's groups are still in flight); the proxy fence (sm_90)
// that makes a thread's generic-proxy shared-memory writes (cp.async, st.shared) visible to the async proxy
// (wgmma); and the NaN-keeping relu of the scorers' epilogues. NVIDIA only (tools/build_hip.py NVIDIA_ONLY).
#pragma once

#include <cstdint>

namespace dsq_ptx {

__device__ __forceinline__ unsigned smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// max(x, 0) that keeps NaN (relu as the reference computes it), one instruction.
__device__ __forceinline__ float relu_nan(float x) {
  float r;
  asm("max.NaN.f32 %0, %1, 0f00000000;\n" : "=f"(r) : "f"(x));
  return r;
}

}  // namespace dsq_ptx

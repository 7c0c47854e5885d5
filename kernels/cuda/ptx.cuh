// kernels/cuda/ptx.cuh: the inline PTX that the NVIDIA kernels share. Asynchronous copies (sm_80+): 16 or 4 bytes
// from global into shared memory without passing through registers, committed in groups that complete in order
// (cp_async_wait<N> returns when at most N of the thread's groups are still in flight); the proxy fence (sm_90)
// that makes a thread's generic-proxy shared-memory writes (cp.async, st.shared) visible to the async proxy
// (wgmma); bulk copies completing on shared-memory barriers (sm_90); and the NaN-keeping relu of the scorers'
// epilogues. NVIDIA only (tools/build_hip.py NVIDIA_ONLY).
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
// Bulk copies (sm_90): `bytes` (a multiple of 16, both addresses 16-byte aligned) from global into shared memory by
// the copy engine, completing as transaction bytes on a shared-memory barrier (mbarrier): a phase of the barrier
// completes when its expected arrivals arrived and the bytes announced with mbar_expect_tx landed; threads wait on
// the phase's parity.
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// Makes the barriers this thread initialised visible to the copy engine (then a block barrier, to the threads).
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, int bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, int bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
// `bytes` (a multiple of 16) at src (16-byte aligned) fetched into L2, nothing waited for.
__device__ __forceinline__ void bulk_prefetch_l2(const void* src, int bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
}
// max(x, 0) that keeps NaN (relu as the reference computes it), one instruction.
__device__ __forceinline__ float relu_nan(float x) {
  float r;
  asm("max.NaN.f32 %0, %1, 0f00000000;\n" : "=f"(r) : "f"(x));
  return r;
}

}  // namespace dsq_ptx

// kernels/cuda/sm90_layer.cuh: the GPU side of the layer that the sm_90a block bodies (prefill_body.cuh,
// scorer_body.cuh) are written against; their host emulators (tests/cpp) supply the other side. Thread index, block
// barrier, 32-lane exchange, asynchronous 16-byte copies in groups, bulk copies on shared-memory barriers, the proxy
// fence, the NaN-keeping relu, L2 prefetches and reads that keep no L1 line, and the warpgroup MMA of one tile:
// acc[64 x NT] = A[64 x 128] . B[NT x 128]^T in four 32-wide steps of wgmma.cuh's e4m3 instructions, started as one
// group. The MMA templates are instantiated from sm_90a code only.
#pragma once

#include <cstdint>

#include "ptx.cuh"
#include "wgmma.cuh"

namespace dsq_sm90 {

__device__ __forceinline__ int thread_id() { return static_cast<int>(threadIdx.x); }
__device__ __forceinline__ void block_sync() { __syncthreads(); }
__device__ __forceinline__ float shfl_xor(float v, int m) { return __shfl_xor_sync(0xFFFFFFFFu, v, m, 32); }
__device__ __forceinline__ void cp16(void* dst, const void* src) { dsq_ptx::cp_async16(dst, src); }
__device__ __forceinline__ void cp_commit() { dsq_ptx::cp_async_commit(); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  dsq_ptx::cp_async_wait<N>();
}
__device__ __forceinline__ void async_fence() { dsq_ptx::fence_proxy_async(); }
// Shared-memory barriers of one arrival and bulk copies that complete on them (ptx.cuh).
__device__ __forceinline__ void bar_init(uint64_t* bar) {
  dsq_ptx::mbar_init(bar, 1);
  dsq_ptx::mbar_init_fence();
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, int bytes, uint64_t* bar) {
  dsq_ptx::mbar_expect_tx(bar, bytes);
  dsq_ptx::bulk_copy_g2s(dst, src, bytes, bar);
}
__device__ __forceinline__ void bar_arrive(uint64_t* bar) { dsq_ptx::mbar_arrive(bar); }
__device__ __forceinline__ void bar_wait(uint64_t* bar, int parity) { dsq_ptx::mbar_wait(bar, parity); }
__device__ __forceinline__ float relu_nan(float x) { return dsq_ptx::relu_nan(x); }
// An L2 prefetch of `bytes`, and an index read through L2 only (no L1 line of it is kept).
__device__ __forceinline__ void prefetch_l2(const void* p, int bytes) { dsq_ptx::bulk_prefetch_l2(p, bytes); }
__device__ __forceinline__ int64_t peek_index(const void* p, int64_t i, bool i64) {
  if (i64) return static_cast<int64_t>(__ldcg(static_cast<const long long*>(p) + i));
  return __ldcg(static_cast<const int*>(p) + i);
}

// A and B in shared memory (K-major, 128-byte rows, the 128-byte swizzle, 1024-aligned).
template <int NT>
__device__ __forceinline__ void mma_ss(float (&acc)[NT / 2], const uint8_t* a_tile, const uint8_t* b_rows) {
  using Mma = dsq_wgmma::MmaE4M3<NT>;
#pragma unroll
  for (int r = 0; r < NT / 2; ++r) dsq_wgmma::fence_reg(acc[r]);
  dsq_wgmma::fence();
  const uint64_t da = dsq_wgmma::desc_sw128(a_tile), db = dsq_wgmma::desc_sw128(b_rows);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) Mma::run(acc, da + 2 * ks, db + 2 * ks, ks > 0 ? 1 : 0);
  dsq_wgmma::commit();
}
// A from registers (frag[step], wgmma.cuh's A fragment of each 32-wide step), B in shared memory.
template <int NT>
__device__ __forceinline__ void mma_rs(float (&acc)[NT / 2], const uint32_t (&frag)[4][4], const uint8_t* b_rows) {
  using Mma = dsq_wgmma::MmaE4M3<NT>;
#pragma unroll
  for (int r = 0; r < NT / 2; ++r) dsq_wgmma::fence_reg(acc[r]);
  dsq_wgmma::fence();
  const uint64_t db = dsq_wgmma::desc_sw128(b_rows);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) Mma::run_rs(acc, frag[ks], db + 2 * ks, ks > 0 ? 1 : 0);
  dsq_wgmma::commit();
}
// Returns when at most N started groups are running.
template <int N>
__device__ __forceinline__ void mma_wait() {
  dsq_wgmma::wait<N>();
}
// After the wait that retired acc's group: acc is read from here on.
template <int NT>
__device__ __forceinline__ void mma_done(float (&acc)[NT / 2]) {
#pragma unroll
  for (int r = 0; r < NT / 2; ++r) dsq_wgmma::fence_reg(acc[r]);
}
// After the wait that retired the group that read frag: frag may change from here on.
__device__ __forceinline__ void frag_done(uint32_t (&frag)[4][4]) {
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int r = 0; r < 4; ++r) dsq_wgmma::fence_reg_u(frag[s][r]);
}

}  // namespace dsq_sm90

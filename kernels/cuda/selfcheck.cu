// kernels/cuda/selfcheck.cu: on-device checks of the hardware paths against the header's software
// definitions, for the fp32 bit patterns [start, start + count): fp8_encode2 (the e4m3fn convert on
// sm_89+) vs fp8_encode2_software, and round_bf16 / round_fp16 (cvt.rn on sm_80+) vs their software
// forms. The mismatches are added to *out. Also exp_ds (SPEC §0.7) of an fp32 array, so that the header's
// exp_ds can be held to its golden vectors on the GPU itself (tests/gpu/test_compress_gpu.py). And the code the
// runtime picked for this file's kernels on the current device (dsq_kernel_code in dsaquant/abi.h).
#include "indexer.h"
#include "row16.cuh"

namespace dsqk {

__global__ void fp8_selfcheck_kernel(uint64_t start, uint64_t count, unsigned long long* out) {
  unsigned long long bad = 0;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint32_t b0 = static_cast<uint32_t>(start + i);
    const float x0 = u2f(b0), x1 = u2f(b0 ^ 0x80000000u);   // both signs of each pattern, swapped order
    bad += fp8_encode2(x0, x1, Fp8Flavour::e4m3fn) != fp8_encode2_software(x0, x1, Fp8Flavour::e4m3fn);
    bad += round_bf16(x0) != round_bf16_software(x0);
    bad += round_fp16(x0) != round_fp16_software(x0);
  }
  for (int s = 16; s >= 1; s >>= 1) bad += __shfl_xor_sync(0xFFFFFFFFu, bad, s);
  if ((threadIdx.x & 31) == 0 && bad) atomicAdd(out, bad);
}

__global__ void __launch_bounds__(256) exp_ds_kernel(const float* x, float* y, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = exp_ds(x[i]);
}

}  // namespace dsqk

int dsq_exp_ds_launch(const float* x, float* y, int64_t n, cudaStream_t stream) {
  if (n > 0) dsqk::exp_ds_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(x, y, n);
  return static_cast<int>(cudaGetLastError());
}

int dsq_fp8_selfcheck_launch(uint64_t start, uint64_t count, unsigned long long* out, cudaStream_t stream) {
  dsqk::fp8_selfcheck_kernel<<<1024, 256, 0, stream>>>(start, count, out);
  return static_cast<int>(cudaGetLastError());
}

int dsq_kernel_code_query(int* ptx, int* binary) {
  cudaFuncAttributes attr{};
  const cudaError_t err = cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(dsqk::exp_ds_kernel));
  if (err != cudaSuccess) {
    static_cast<void>(cudaGetLastError());   // not left behind for the next launch's cudaGetLastError
    return static_cast<int>(err);
  }
  *ptx = attr.ptxVersion;
  *binary = attr.binaryVersion;
  return 0;
}

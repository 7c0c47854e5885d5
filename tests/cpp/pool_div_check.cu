// tests/cpp/pool_div_check.cu: dsq::pool_weights (src/include/dsaquant/pool.h) against the correctly rounded division
// on the GPU: for each divisor S of a set (the edges of [1, 256] and a spread of mantissas of every binade), every
// fp32 dividend of [2^-100, 2) and 0, one column of one value through pool_weights, bit for bit against __fdiv_rn.
// Built and run by tests/gpu/test_compress_gpu.py::test_pool_weights_fast_path; prints "mismatches N of M".
#include <cstdio>
#include <vector>

#include "dsaquant/pool.h"

__global__ void check(const float* divisors, int n_div, uint32_t lo, uint32_t hi, unsigned long long* bad) {
  unsigned long long local = 0;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (int d = 0; d < n_div; ++d) {
    const float S = divisors[d];
    for (uint64_t u = lo + static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < hi; u += stride) {
      const float e = dsq::u2f(static_cast<uint32_t>(u));
      float v[1] = {e};
      dsq::pool_weights(v, S);
      if (dsq::f2u(v[0]) != dsq::f2u(__fdiv_rn(e, S))) ++local;
    }
    float z[1] = {0.0f};
    dsq::pool_weights(z, S);
    if (blockIdx.x == 0 && threadIdx.x == 0 && dsq::f2u(z[0]) != 0u) ++local;
  }
  if (local) atomicAdd(bad, local);
}

int main() {
  std::vector<float> ds = {1.0f, 2.0f, 4.0f, 8.0f, 128.0f, 256.0f};
  for (uint32_t b : {0x3F800001u, 0x3FFFFFFFu, 0x40FFFFFFu, 0x437FFFFFu, 0x3FC00000u, 0x3FAAAAABu}) ds.push_back(dsq::u2f(b));
  uint32_t x = 12345u;
  for (int i = 0; i < 400; ++i) {   // mantissas spread over each of the binades [1, 2) .. [128, 256)
    x = x * 1664525u + 1013904223u;
    ds.push_back(dsq::u2f(((127u + static_cast<uint32_t>(i % 8)) << 23) | (x >> 9)));
  }
  float* d_ds;
  unsigned long long* d_bad;
  cudaMalloc(&d_ds, ds.size() * sizeof(float));
  cudaMalloc(&d_bad, sizeof(unsigned long long));
  cudaMemcpy(d_ds, ds.data(), ds.size() * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemset(d_bad, 0, sizeof(unsigned long long));
  const uint32_t lo = 0x0D800000u, hi = 0x40000000u;   // [2^-100, 2)
  check<<<1024, 256>>>(d_ds, static_cast<int>(ds.size()), lo, hi, d_bad);
  unsigned long long bad = 0;
  const cudaError_t err = cudaMemcpy(&bad, d_bad, sizeof bad, cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) {
    std::printf("error %s\n", cudaGetErrorString(err));
    return 1;
  }
  std::printf("mismatches %llu of %llu\n", bad, static_cast<unsigned long long>(ds.size()) * ((hi - lo) + 1ull));
  return bad == 0 ? 0 : 2;
}

// tests/cpp/host_cuda/cuda_runtime.h: what the kernel sources take from CUDA, for a host compile under the block
// emulator of tests/cpp/fibers.h (tests/cpp/kstore_host.cpp puts this directory first on the include path, so the
// kernels' `#include <cuda_runtime.h>` finds it). Qualifiers are empty, the built-in indices are the running
// fiber's, the vector types are plain structs, a shuffle is a rendezvous of its mask's lanes, an atomic is a plain
// read-modify-write (fibers switch only at barriers and shuffles).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "fibers.h"

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __noinline__ __attribute__((noinline))

typedef int cudaError_t;
enum : int { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
typedef struct CUstream_st* cudaStream_t;
inline cudaError_t cudaGetLastError() { return cudaSuccess; }

// Runtime calls of launch helpers the emulated bodies share a header with: declared so that the headers compile;
// the emulator never calls them.
enum cudaStreamCaptureStatus : int { cudaStreamCaptureStatusNone = 0 };
enum cudaFuncAttribute : int { cudaFuncAttributeMaxDynamicSharedMemorySize, cudaFuncAttributePreferredSharedMemoryCarveout };
enum : int { cudaSharedmemCarveoutMaxShared = 100 };
[[noreturn]] inline void dsq_host_cuda_unavailable(const char* what) {
  throw std::runtime_error(std::string(what) + " is not emulated");
}
inline cudaError_t cudaGetDevice(int*) { dsq_host_cuda_unavailable("cudaGetDevice"); }
inline cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus*) {
  dsq_host_cuda_unavailable("cudaStreamIsCapturing");
}
template <class F>
cudaError_t cudaFuncSetAttribute(F, cudaFuncAttribute, int) { dsq_host_cuda_unavailable("cudaFuncSetAttribute"); }

struct dsq_host_uint3 {
  unsigned x, y, z;
};
#define threadIdx (dsq_host_uint3{static_cast<unsigned>(emu::thread_id()), 0u, 0u})
#define blockIdx (dsq_host_uint3{static_cast<unsigned>(emu::block_id()), 0u, 0u})

struct float4 {
  float x, y, z, w;
};
struct uint4 {
  unsigned x, y, z, w;
};
struct uint2 {
  unsigned x, y;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }

template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int /*width*/ = 32) {
  return emu::shuffle_xor_in(mask, v, lane_mask);
}
inline int atomicOr(int* p, int v) {
  const int old = *p;
  *p |= v;
  return old;
}
inline void __syncthreads() { emu::block_barrier(); }
inline size_t __cvta_generic_to_shared(const void* p) { return reinterpret_cast<size_t>(p); }

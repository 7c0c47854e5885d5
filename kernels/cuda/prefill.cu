// kernels/cuda/prefill.cu: the ragged prefill logits (docs/prefill.md `mqa_logits`, FP8 layout) on sm_90a FP8
// tensor cores. The block body is prefill_body.cuh (shared with the host emulator of the tests); this file supplies
// its layer (sm90_layer.cuh: cp.async copies, the warpgroup MMA of a tile, the 32-lane exchange), the kernels (one
// per H), the launch and the C interface (prefill.h). The kernel body exists in sm_90a code only; elsewhere dsq_mqa_logits
// returns cudaErrorNotSupported and the Python backend hands the call to the Triton kernel.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <mutex>

#include "device.h"
#include "prefill.h"
#include "sm90_layer.cuh"

namespace dsqpf {

#define PF_FN __device__ __forceinline__
using namespace dsq_sm90;   // the layer of prefill_body.cuh (sm90_layer.cuh); its MMAs are sm_90a code only

}  // namespace dsqpf

#include "prefill_body.cuh"

namespace dsqpf {
namespace {

#ifndef DSQ_PREFILL_MIN_BLOCKS   // resident blocks per SM asked of the register allocator
#define DSQ_PREFILL_MIN_BLOCKS 3
#endif

template <int H>
__global__ void __launch_bounds__(kThreads, DSQ_PREFILL_MIN_BLOCKS) mqa_logits_kernel(const DsqMqaLogitsArgs a,
                                                                                        int64_t tpc) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t dyn_smem[];
  // 1024-aligned (the 128-byte swizzle repeats every 1024 bytes)
  uint8_t* smem = dyn_smem + ((1024u - (static_cast<uint32_t>(__cvta_generic_to_shared(dyn_smem)) & 1023u)) & 1023u);
  mqa_logits_block<H>(a, blockIdx.x, blockIdx.y, tpc, smem);
#endif
}

constexpr int kDynSmem = kSmemBytes + 1024;

#ifdef DSQ_DEVICE_CODE
constexpr const char* kDeviceCode = DSQ_DEVICE_CODE;   // the build's targets (tools/build_native.py)
#else
constexpr const char* kDeviceCode = "";
#endif

// Whether the kernel that runs on device `dev` is the sm_90a one (a 9.0 device, and the code the runtime picked
// compiled from sm_90a, not a compute_80 PTX JIT), read once per device.
bool wgmma_on(int dev) {
  static std::once_flag once[dsqdev::kMaxDevices];
  static bool ok[dsqdev::kMaxDevices];
  std::call_once(once[dev], [dev] {
    const dsqdev::DeviceProps& p = dsqdev::device_props(dev);
    ok[dev] = false;
    if (p.error != 0 || p.cc_major != 9 || p.cc_minor != 0 || std::strstr(kDeviceCode, "_90a") == nullptr) return;
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, mqa_logits_kernel<64>) != cudaSuccess) {
      static_cast<void>(cudaGetLastError());
      return;
    }
    ok[dev] = attr.binaryVersion == 90 && attr.ptxVersion >= 90;
  });
  return ok[dev];
}

// Blocks of one kernel resident per SM, per device (for the split plan).
template <int H>
int resident(int dev) {
  static std::mutex mu;
  static int cache[dsqdev::kMaxDevices] = {};
  std::lock_guard<std::mutex> lock(mu);
  if (cache[dev] == 0) {
    int n = 0;
    cudaFuncSetAttribute(mqa_logits_kernel<H>, cudaFuncAttributeMaxDynamicSharedMemorySize, kDynSmem);
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, mqa_logits_kernel<H>, kThreads, kDynSmem) != cudaSuccess ||
        n < 1) {
      static_cast<void>(cudaGetLastError());
      n = 1;
    }
    cache[dev] = n;
  }
  return cache[dev];
}

template <int H>
int launch(const DsqMqaLogitsArgs& a, cudaStream_t stream) {
  const int sms = dsqdev::device_props(a.device).sm_count;
  const Plan p = plan(a, static_cast<int64_t>(resident<H>(a.device)) * sms);
  if (p.splits > 65535) return cudaErrorInvalidValue;
  const cudaError_t e = cudaFuncSetAttribute(mqa_logits_kernel<H>, cudaFuncAttributeMaxDynamicSharedMemorySize, kDynSmem);
  if (e != cudaSuccess) return e;
  mqa_logits_kernel<H><<<dim3(static_cast<unsigned>(p.row_blocks), static_cast<unsigned>(p.splits)), kThreads, kDynSmem,
                         stream>>>(a, p.tpc);
  return cudaGetLastError();
}

}  // namespace
}  // namespace dsqpf

extern "C" __attribute__((visibility("default"))) int dsq_mqa_logits(const DsqMqaLogitsArgs* args, void* stream) {
  using namespace dsqpf;
  if (args == nullptr) return cudaErrorInvalidValue;
  const DsqMqaLogitsArgs& a = *args;
  if (check(a) != 0) return cudaErrorInvalidValue;
  if (a.device < 0 || a.device >= dsqdev::kMaxDevices) return cudaErrorInvalidDevice;
  const dsqdev::DeviceScope scope(a.device);   // launch on the tensors' device, restore after
  if (scope.error() != 0) return scope.error();
  if (!wgmma_on(a.device)) return cudaErrorNotSupported;
  if (a.S == 0 || a.SKV == 0 || (a.compressed && a.W == 0)) return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (a.H) {
    case 16: return launch<16>(a, s);
    case 32: return launch<32>(a, s);
    case 64: return launch<64>(a, s);
    default: return launch<128>(a, s);
  }
}

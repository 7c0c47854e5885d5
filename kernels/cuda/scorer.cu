// scorer.cu: paged MQA logits (SPEC §7.4) on sm_90a FP8 tensor cores, for the fp8_132, packed68 and
// aiter_fp4 layouts (SPEC §6). The block body is scorer_body.cuh (shared with the host emulator of the tests);
// this file supplies its layer (sm90_layer.cuh, a warp vote, byte permutes, the error flag's atomic), the kernel,
// the work split and the C interface (scorer.h).
//
// Accuracy: the products are exact, the tensor cores' fp32 accumulation of the 128 products is not
// IEEE-ordered, so logits differ from the reference by summation error (docs/scorer.md has the bound).
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>

#include "device.h"
#include "launch.cuh"
#include "scorer.h"
#include "sm90_layer.cuh"

namespace dsqsc {

#define SC_FN __device__ __forceinline__
using namespace dsq_sm90;   // thread_id, block_sync, shfl_xor, cp16 .. cp_wait, async_fence, relu_nan, the MMAs
__device__ __forceinline__ bool any_sync(bool p) { return __any_sync(0xFFFFFFFFu, p) != 0; }
__device__ __forceinline__ void flag_or(int32_t* p, int v) { atomicOr(p, v); }

#ifdef DSQ_SCORER_PHASES
// A build for dev/scorer_phases.py: thread 0 of each of the first kPhaseBlocks blocks (by linear block index)
// records clock64 at phase boundary k < 28 of scorer_body.cuh (SC_PHASE) into row b of dsq_phases; at its end,
// the clock, the global timer, and 1 + its SM's index (words 28 .. 30; word 31: the global timer at its start).
constexpr int kPhaseBlocks = 4096;
__device__ unsigned long long dsq_phases[kPhaseBlocks * 32];
__device__ __forceinline__ unsigned phase_block() {
  return (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
}
__device__ __forceinline__ unsigned long long global_timer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void phase(int k) {
  const unsigned b = phase_block();
  if (threadIdx.x != 0 || b >= kPhaseBlocks || k >= 28) return;
  dsq_phases[b * 32 + k] = clock64();
  if (k == 0) dsq_phases[b * 32 + 31] = global_timer();
}
__device__ __forceinline__ void phase_end() {
  const unsigned b = phase_block();
  if (threadIdx.x != 0 || b >= kPhaseBlocks) return;
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  dsq_phases[b * 32 + 28] = clock64();
  dsq_phases[b * 32 + 29] = global_timer();
  dsq_phases[b * 32 + 30] = sm + 1u;
}
#define SC_PHASE(k) ::dsqsc::phase(k)
#define SC_PHASE_END() ::dsqsc::phase_end()
#endif

}  // namespace dsqsc

#include "scorer_body.cuh"

namespace {

using dsqsc::kThreads;
using dsqsc::kTile;
using dsqsc::smem_plan;

// Blocks per SM the register allocation must allow (1: no limit). FP4 tiles of 64 query rows keep one accumulator
// set and fit five blocks an SM (96 registers; scorer_body.cuh, DSQ_SCORER_DUAL_MAX_ROWS_FP4). Narrower FP4 tiles
// hold two accumulator and two A-fragment sets: packed68 kernels bounded to four blocks an SM (128 registers),
// aiter_fp4 ones, whose exponent gathers need more registers and spill at 128, to three; so measured best when
// tiles of 64 rows kept two sets (H100: packed68 (64, 1, 8192) 27.0 µs with four blocks against 27.7 with three,
// (1, 1, 65536) 6.3 against 7.2; aiter_fp4 (64, 1, 8192) 32.0 µs with three against 33.7 with four, (4, 1, 32768)
// uniform 11.5 against 12.0, (1, 1, 65536) 8.6 against 8.1). FP4 tiles of 128 rows (two 64-row accumulator sets
// and one fragment set) are bounded to three blocks an SM (168 registers, no spills). fp8_132 tiles of 128 rows
// are bounded to four blocks an SM (128 registers, no spills; unbounded they take 156 and fit three), which
// measured faster on the H100 at (4, 4, 32768) (16.1 µs against 16.35) and within 0.2 µs elsewhere; narrower
// fp8_132 tiles are not bounded (at most 164 registers).
#ifndef DSQ_SCORER_MIN_CTAS_FP8
#define DSQ_SCORER_MIN_CTAS_FP8 1
#endif
#ifndef DSQ_SCORER_MIN_CTAS_FP4
#define DSQ_SCORER_MIN_CTAS_FP4 4
#endif
#ifndef DSQ_SCORER_MIN_CTAS_AITER
#define DSQ_SCORER_MIN_CTAS_AITER 3
#endif
#ifndef DSQ_SCORER_MIN_CTAS_FP4_WIDE
#define DSQ_SCORER_MIN_CTAS_FP4_WIDE 3
#endif
#ifndef DSQ_SCORER_MIN_CTAS_FP8_WIDE
#define DSQ_SCORER_MIN_CTAS_FP8_WIDE 4
#endif
#ifndef DSQ_SCORER_MIN_CTAS_FP4_SINGLE
#define DSQ_SCORER_MIN_CTAS_FP4_SINGLE 5
#endif
template <int NT, int LAYOUT>
constexpr int kMinCtas = LAYOUT == DSQ_SCORER_FP8_132 && NT > 64 ? DSQ_SCORER_MIN_CTAS_FP8_WIDE
                         : LAYOUT == DSQ_SCORER_FP8_132        ? DSQ_SCORER_MIN_CTAS_FP8
                         : NT > 64                             ? DSQ_SCORER_MIN_CTAS_FP4_WIDE
                         : NT > dsqsc::dual_max_rows(true)     ? DSQ_SCORER_MIN_CTAS_FP4_SINGLE
                         : LAYOUT == DSQ_SCORER_PACKED68       ? DSQ_SCORER_MIN_CTAS_FP4
                                                               : DSQ_SCORER_MIN_CTAS_AITER;
constexpr bool is_fp4(int layout) { return layout != DSQ_SCORER_FP8_132; }

// A variant to time (dev/cuda_variants.sh "plain:" "prefetch:-DDSQ_SCORER_PREFETCH=1"), off by default: where the
// launch is a dependent one, a block's first loads are prefetched into L2 while the kernel ahead still runs
// (scorer_body.cuh prefetch_block), so that after the wait they hit L2: a block's time to its first product
// (about 3.7 µs of 11 at (4, 4, 32768) on the H100) is mostly such loads. With every block prefetching its q rows
// it measured (H100, dev/tune_scorer.py, two rounds, µs, plain then prefetch) 28.1, 28.1 against 27.0, 27.1 at
// (64, 1, 8192) fp8_132, 18.9, 18.9 against 18.6, 18.6 at (4, 4, 32768) packed68, 9.3, 9.3 against 8.9, 8.8 at
// (4, 1, 32768) fp8_132 and 10.7, 11.0 against 10.3, 10.4 at (4, 2, 32768) fp8_132, the FP4 layouts at (1, 1,
// 65536) and (4, 1, 32768) within 0.1, but 5.2, 5.1 against 6.2, 6.1 at (1, 1, 65536) fp8_132, where all the
// blocks of the grid prefetch the same q rows; the q rows are now prefetched by the blocks of the first split
// alone, a build not yet timed.
#ifndef DSQ_SCORER_PREFETCH
#define DSQ_SCORER_PREFETCH 0
#endif

// One kernel per layout (DSQ_SCORER_*): each holds only its own copy and expansion code.
template <int H, int NQ, int LAYOUT>
__global__ void __launch_bounds__(kThreads, kMinCtas<H * NQ, LAYOUT>)
    paged_logits_kernel(const DsqPagedLogitsArgs a, int tiles_per_cta, int n_pages, int p_shift, int prefetch) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t dyn_smem[];
  // 1024-aligned (the 128-byte swizzle repeats every 1024 bytes); offset from dyn_smem so that every
  // access stays a shared-memory access
  uint8_t* smem = dyn_smem + ((1024u - (static_cast<uint32_t>(__cvta_generic_to_shared(dyn_smem)) & 1023u)) & 1023u);
  // launch() below may make it a dependent launch (launch.cuh); then `prefetch` where DSQ_SCORER_PREFETCH is on
  dsq_launch::allow_dependents();
#if DSQ_SCORER_PREFETCH
  if (prefetch) dsqsc::prefetch_block<H, NQ, LAYOUT>(a, blockIdx.x, blockIdx.y, blockIdx.z, tiles_per_cta, p_shift);
#else
  static_cast<void>(prefetch);
#endif
  dsq_launch::wait_previous();
  dsqsc::paged_logits_block<H, NQ, LAYOUT>(a, blockIdx.x, blockIdx.y, blockIdx.z, tiles_per_cta, n_pages, p_shift,
                                           smem);
#endif
}

// ---- host side ---------------------------------------------------------------------------------------
#ifdef DSQ_DEVICE_CODE
constexpr const char* kDeviceCode = DSQ_DEVICE_CODE;   // the build's targets (tools/build_native.py)
#else
constexpr const char* kDeviceCode = "";
#endif

// Whether the scorer kernel that runs on the current device is the wgmma one. Its body exists only in sm_90a code
// (elsewhere the kernel is empty), so: a 9.0 device, a build that holds sm_90a code (compute_90 PTX or an sm_90
// cubin compile to the empty body too), and the code the runtime picked for the device compiled from it (not a
// compute_80 PTX JIT: ptxVersion 80). Otherwise dsq_paged_mqa_logits returns cudaErrorNotSupported.
bool has_wgmma_kernel(int major, int minor) {
  if (major != 9 || minor != 0 || std::strstr(kDeviceCode, "_90a") == nullptr) return false;
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, paged_logits_kernel<16, 1, DSQ_SCORER_FP8_132>) != cudaSuccess) {
    static_cast<void>(cudaGetLastError());   // not left behind for the next launch's cudaGetLastError
    return false;
  }
  return attr.binaryVersion == 90 && attr.ptxVersion >= 90;
}

// has_wgmma_kernel for device `dev` (0 <= dev < kMaxDevices, the current device), read once per device.
bool wgmma_on(int dev) {
  static std::once_flag once[dsqdev::kMaxDevices];
  static bool ok[dsqdev::kMaxDevices];
  std::call_once(once[dev], [dev] {
    const dsqdev::DeviceProps& p = dsqdev::device_props(dev);
    ok[dev] = p.error == 0 && has_wgmma_kernel(p.cc_major, p.cc_minor);
  });
  return ok[dev];
}

// CTAs of one kernel that fit on an SM at once (shared memory, registers), per device; the page list
// is counted at kPageAllowance entries (the split below keeps most launches within it).
constexpr int kPageAllowance = 256;
template <int H, int NQ, int LAYOUT>
int resident_ctas(int dev) {
  static std::mutex mu;
  static int cache[dsqdev::kMaxDevices] = {};
  std::lock_guard<std::mutex> lock(mu);
  if (dev < 0 || dev >= dsqdev::kMaxDevices) return 1;
  if (cache[dev] == 0) {
    const int bytes = smem_plan(H * NQ, is_fp4(LAYOUT), kPageAllowance).total + 1024;
    auto kernel = paged_logits_kernel<H, NQ, LAYOUT>;
    int n = 0;
    if (bytes > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, bytes) != cudaSuccess || n < 1) n = 1;
    cache[dev] = n;
  }
  return cache[dev];
}

template <int H, int NQ, int LAYOUT>
int launch(const DsqPagedLogitsArgs& a, int sms, cudaStream_t stream) {
  const int64_t slots = static_cast<int64_t>(resident_ctas<H, NQ, LAYOUT>(a.device)) * sms;
  const dsqsc::Plan p = dsqsc::plan(a, NQ, slots);
  const int bytes = smem_plan(H * NQ, is_fp4(LAYOUT), p.n_pages).total + 1024;
  auto kernel = paged_logits_kernel<H, NQ, LAYOUT>;
  if (bytes > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) return e;
  }
  // Programmatic stream serialization where the grid fills at least 85 % of the resident slots: the kernel's
  // blocks may be placed on SMs while the previous kernel in the stream drains (the kernel waits for its completion
  // before any global access), so its launch and block placement overlap that kernel's last blocks; in a CUDA
  // graph the dependency is captured as such. Grids that leave many slots free measured slower with it on the
  // H100 (FP4 tiles of 64 q rows at (4, 1, 32768) and (1, 1, 65536): 512 blocks, 78 % of five an SM), presumably
  // because blocks placed early go to the SMs that free up first, crowding some SMs while others idle.
  const int64_t blocks = static_cast<int64_t>(p.splits) * p.groups * a.B;
  const dsq_launch::Shape shape{dim3(p.splits, p.groups, static_cast<unsigned>(a.B)), dim3(kThreads),
                                static_cast<size_t>(bytes)};
  const bool dependent = blocks * 20 >= slots * 17;
  const int prefetch = dependent && DSQ_SCORER_PREFETCH != 0;
  return dsq_launch::launch(kernel, shape, stream, dependent, a, p.tiles_per_block, p.n_pages, p.p_shift, prefetch);
}

template <int L>
int dispatch_h(const DsqPagedLogitsArgs& a, int sms, cudaStream_t s) {
  const int nq = dsqsc::queries_per_block(a);
  switch (a.H) {
    case 16:
      return nq == 1 ? launch<16, 1, L>(a, sms, s) : nq == 2 ? launch<16, 2, L>(a, sms, s)
             : nq == 4 ? launch<16, 4, L>(a, sms, s) : launch<16, 8, L>(a, sms, s);
    case 32:
      return nq == 1 ? launch<32, 1, L>(a, sms, s) : nq == 2 ? launch<32, 2, L>(a, sms, s)
                                                          : launch<32, 4, L>(a, sms, s);
    case 64:
      return nq == 1 ? launch<64, 1, L>(a, sms, s) : launch<64, 2, L>(a, sms, s);
    default:
      return launch<128, 1, L>(a, sms, s);
  }
}

}  // namespace

extern "C" int dsq_paged_mqa_logits(const DsqPagedLogitsArgs* args, void* stream) {
  if (args == nullptr) return cudaErrorInvalidValue;
  const DsqPagedLogitsArgs& a = *args;
  if (a.device < 0 || a.device >= dsqdev::kMaxDevices) return cudaErrorInvalidDevice;
  const dsqdev::DeviceScope scope(static_cast<int>(a.device));   // launch on the tensors' device, restore after
  if (scope.error() != 0) return scope.error();
  if (!wgmma_on(a.device)) return cudaErrorNotSupported;   // wgmma: sm_90a code on a 9.0 device only
  if (!dsqsc::supported(a)) return cudaErrorNotSupported;
  if (a.B == 0 || a.N == 0 || a.max_seq_len == 0) return cudaSuccess;
  const int sms = dsqdev::device_props(a.device).sm_count;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return a.layout == DSQ_SCORER_FP8_132   ? dispatch_h<DSQ_SCORER_FP8_132>(a, sms, s)
         : a.layout == DSQ_SCORER_PACKED68 ? dispatch_h<DSQ_SCORER_PACKED68>(a, sms, s)
                                           : dispatch_h<DSQ_SCORER_AITER_FP4>(a, sms, s);
}

extern "C" int dsq_paged_mqa_logits_layout(int64_t* out, int n) {
  const int64_t v[] = {
      sizeof(DsqPagedLogitsArgs),
      offsetof(DsqPagedLogitsArgs, q), offsetof(DsqPagedLogitsArgs, q_scale), offsetof(DsqPagedLogitsArgs, weights),
      offsetof(DsqPagedLogitsArgs, context_lens), offsetof(DsqPagedLogitsArgs, block_table),
      offsetof(DsqPagedLogitsArgs, kv_cache), offsetof(DsqPagedLogitsArgs, kv_scale), offsetof(DsqPagedLogitsArgs, logits),
      offsetof(DsqPagedLogitsArgs, err_flag), offsetof(DsqPagedLogitsArgs, B), offsetof(DsqPagedLogitsArgs, N),
      offsetof(DsqPagedLogitsArgs, H), offsetof(DsqPagedLogitsArgs, num_blocks), offsetof(DsqPagedLogitsArgs, page_size),
      offsetof(DsqPagedLogitsArgs, max_blocks), offsetof(DsqPagedLogitsArgs, max_seq_len), offsetof(DsqPagedLogitsArgs, ld),
      offsetof(DsqPagedLogitsArgs, w_row), offsetof(DsqPagedLogitsArgs, w_head), offsetof(DsqPagedLogitsArgs, ctx_b),
      offsetof(DsqPagedLogitsArgs, ctx_n), offsetof(DsqPagedLogitsArgs, bt_b), offsetof(DsqPagedLogitsArgs, bt_k),
      offsetof(DsqPagedLogitsArgs, layout), offsetof(DsqPagedLogitsArgs, preshuffle), offsetof(DsqPagedLogitsArgs, w_dtype),
      offsetof(DsqPagedLogitsArgs, ctx_dtype), offsetof(DsqPagedLogitsArgs, bt_dtype), offsetof(DsqPagedLogitsArgs, out_dtype),
      offsetof(DsqPagedLogitsArgs, clean_logits), offsetof(DsqPagedLogitsArgs, device), offsetof(DsqPagedLogitsArgs, splits),
      offsetof(DsqPagedLogitsArgs, weight_scale)};
  const int total = static_cast<int>(sizeof(v) / sizeof(v[0]));
  for (int i = 0; i < n && i < total; ++i) out[i] = v[i];
  return total;
}

#ifdef DSQ_SCORER_PHASES
// dev/scorer_phases.py: clear != 0 zeroes the phase records; else copies the first n words of them to host `out`.
extern "C" __attribute__((visibility("default"))) int dsq_scorer_phases(unsigned long long* out, int n, int clear) {
  if (clear) {
    void* p = nullptr;
    const cudaError_t e = cudaGetSymbolAddress(&p, dsqsc::dsq_phases);
    return e != cudaSuccess ? e : cudaMemset(p, 0, sizeof(dsqsc::dsq_phases));
  }
  if (n < 0 || n > dsqsc::kPhaseBlocks * 32) return cudaErrorInvalidValue;
  return cudaMemcpyFromSymbol(out, dsqsc::dsq_phases, static_cast<size_t>(n) * sizeof(unsigned long long));
}
#endif

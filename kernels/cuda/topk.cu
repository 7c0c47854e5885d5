// kernels/cuda/topk.cu: top-k positions per row of a logits matrix (docs/topk.md), byte-identical to the
// reference (python/dsaquant/reference/topk.py) and the Triton kernel.
//
// One block of 1024 threads (256 on AMD) per row (or per row chunk, see below):
//   * Keys: each value becomes the order key, a uint32 that compares like the float (-0.0 taken as +0.0),
//     0 for NaN, -inf and positions outside the row's span.
//   * Threshold: up to four 8-bit radix passes from the top. A shared-memory histogram of the current digit
//     of the keys matching the digits fixed so far (4 copies, each shared by a quarter of the warps), then a scan over the 256 bins finds the digit where the
//     count of larger keys reaches the number still wanted. The passes stop early when that number equals
//     the whole bucket; if the first pass counts at most k candidates, all are taken.
//   * Compaction: tiles of 4 consecutive keys per thread, in position order; a block scan of the per-thread
//     counts of keys above the threshold and keys equal to it places the taken ones (equal keys: the first
//     `want` in position order) at deterministic slots.
//   * Sort: the taken (key << 32 | ~position) words are bitonic-sorted descending in shared memory, so the
//     order is value descending, position ascending; empty slots (0) become -1.
//   * Few long rows: the first launch splits every row into `chunks` pieces and writes each piece's
//     selection (keys, positions, in position order, padded with key 0) to the workspace; a second launch
//     selects from each row's candidates, whose buffer order is position order, so the tie rule holds.
#include <cuda_runtime.h>

#include <cstdint>

#include "dsaquant/arith.h"
#include "topk.h"

namespace {

#if defined(__HIP__)
constexpr int kThreads = 256;                  // AMD: the project's block size (four wave64 waves)
#else
constexpr int kThreads = 1024;
#endif
constexpr int kWarps = kThreads / 32;           // 32-lane groups (explicit shuffle width: wave64 too)
constexpr int kItems = 4;                      // consecutive keys per thread in the compaction
constexpr int kTile = kThreads * kItems;
constexpr int kBins = 256;
constexpr int kCopies = 4;                     // histogram copies, summed before the scan
constexpr int kMaxChunks = 8;
constexpr int kStageWhole = 0, kStageChunk = 1, kStageMerge = 2;

__device__ __forceinline__ uint32_t order_key_bits(uint32_t b) {
  const uint32_t mag = b & 0x7FFFFFFFu;
  if (mag > 0x7F800000u || b == 0xFF800000u) return 0u;   // NaN, -inf
  if (mag == 0u) b = 0u;                                 // -0.0 -> +0.0
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

template <int DT>
__device__ __forceinline__ uint32_t load_key(const void* row, int64_t p) {
  if (DT == 0) return order_key_bits(dsq::f2u(static_cast<const float*>(row)[p]));
  const uint16_t h = static_cast<const uint16_t*>(row)[p];
  if (DT == 1) return order_key_bits(static_cast<uint32_t>(h) << 16);   // bf16 -> fp32 exactly
  return order_key_bits(dsq::f2u(dsq::fp16_to_f32(h)));
}

__device__ __forceinline__ int64_t load_index(const void* p, int64_t i, int dt) {
  return dt == 4 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// (start, end) of a row, clamped: 0 <= start <= end <= L (reference.topk.row_spans).
__device__ __forceinline__ void row_span(const DsqTopkArgs& a, int64_t row, int64_t& start, int64_t& end) {
  if (a.form == DSQ_TOPK_DECODE_1D) {
    const int64_t b = row / a.next_n;
    start = 0;
    end = load_index(a.context_lens, b, a.index_dtype) - a.next_n + (row - b * a.next_n) + 1;
  } else if (a.form == DSQ_TOPK_DECODE_2D) {
    start = 0;
    end = load_index(a.context_lens, row, a.index_dtype);
  } else {
      start = load_index(a.ks, row, a.index_dtype);
      end = load_index(a.ke, row, a.index_dtype);
    }
    start = start < 0 ? 0 : (start > a.L ? a.L : start);
    end = end < 0 ? 0 : (end > a.L ? a.L : end);
    if (end < start) end = start;
  }

  // The elements of one block: keys and positions from the logits, or from the candidate buffers.
  struct Segment {
    const void* row;           // logits row
    int64_t start;             // position of element 0 (logits)
    int32_t n;                 // elements
    const uint32_t* ckey;      // candidates (merge stage)
    const int32_t* cpos;
  };

  template <int DT, bool CANDS>
  __device__ __forceinline__ void element(const Segment& s, int32_t i, uint32_t& key, int32_t& pos) {
    if (i >= s.n) {
      key = 0u;
      pos = 0;
    } else if (CANDS) {
      key = s.ckey[i];
      pos = s.cpos[i];
    } else {
      pos = static_cast<int32_t>(s.start + i);
      key = load_key<DT>(s.row, pos);
  }
}

struct Shared {
  unsigned long long sort[DSQ_TOPK_MAX_SORT];
  int hist[kCopies][kBins];   // warp w counts into copy w % kCopies (fewer warps contend per address)
  unsigned long long warp_sums[kWarps];
  int warp_ints[kWarps];
  int digit, above, in_bucket, total;
};

// Inclusive scan of one int per thread over the first 256 threads (others pass 0); every thread calls it.
__device__ __forceinline__ int scan256(int v, Shared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int t = __shfl_up_sync(0xFFFFFFFFu, v, off, 32);
    if (lane >= off) v += t;
  }
  if (lane == 31 && warp < kBins / 32) sh.warp_ints[warp] = v;
  __syncthreads();
  int before = 0;
  for (int w = 0; w < warp && w < kBins / 32; ++w) before += sh.warp_ints[w];
  __syncthreads();
  return v + before;
}

// Exclusive block scan of one 64-bit value per thread; `total` receives the block's sum.
__device__ __forceinline__ unsigned long long scan_block_exclusive(unsigned long long v, Shared& sh,
                                                                   unsigned long long& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long x = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const unsigned long long t = __shfl_up_sync(0xFFFFFFFFu, x, off, 32);
    if (lane >= off) x += t;
  }
  if (lane == 31) sh.warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    unsigned long long w = lane < kWarps ? sh.warp_sums[lane] : 0ull;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const unsigned long long t = __shfl_up_sync(0xFFFFFFFFu, w, off, 32);
      if (lane >= off) w += t;
    }
    if (lane < kWarps) sh.warp_sums[lane] = w;   // inclusive over warps
  }
  __syncthreads();
  const unsigned long long before = warp ? sh.warp_sums[warp - 1] : 0ull;
  total = sh.warp_sums[kWarps - 1];
  __syncthreads();
  return before + x - v;
}

template <int DT, int STAGE>
__global__ void __launch_bounds__(kThreads, 1) topk_kernel(const DsqTopkArgs a, int32_t chunks, int32_t chunk_len,
                                                        int32_t per, int32_t k_pad) {
  __shared__ Shared sh;
  const int tid = threadIdx.x;
  const int64_t row = STAGE == kStageChunk ? blockIdx.x / chunks : blockIdx.x;
  const int64_t chunk = STAGE == kStageChunk ? blockIdx.x - row * chunks : 0;
  int64_t start, end;
  row_span(a, row, start, end);

  uint32_t* const ws_key = static_cast<uint32_t*>(a.workspace);
  int32_t* const ws_pos = ws_key ? reinterpret_cast<int32_t*>(ws_key + a.rows * chunks * per) : nullptr;
  Segment s;
  s.row = static_cast<const char*>(a.logits) + row * a.row_stride * (DT == 0 ? 4 : 2);
  s.ckey = nullptr;
  s.cpos = nullptr;
  if (STAGE == kStageChunk) {
    s.start = start + chunk * chunk_len;
    const int64_t n = end - s.start;
    s.n = static_cast<int32_t>(n < 0 ? 0 : (n > chunk_len ? chunk_len : n));
  } else if (STAGE == kStageMerge) {
    s.start = 0;
    s.n = chunks * per;
    s.ckey = ws_key + row * chunks * per;
    s.cpos = ws_pos + row * chunks * per;
  } else {
    s.start = start;
    s.n = static_cast<int32_t>(end - start);
  }
  constexpr bool kCands = STAGE == kStageMerge;
  const int32_t k = static_cast<int32_t>(a.k < s.n ? a.k : s.n);   // wanted from this segment

  // ---- threshold
  uint32_t prefix = 0u;
  int lvl = 0;               // prefix 0 at level 0: every candidate is above it
  int want = k;
  for (int p = 0; p < 4; ++p) {
    const int shift = 24 - 8 * p;
    for (int b = tid; b < kCopies * kBins; b += kThreads) sh.hist[b / kBins][b % kBins] = 0;
    __syncthreads();
#pragma unroll 4
    for (int32_t i = tid; i < s.n; i += kThreads) {   // unrolled: several loads in flight per thread
      uint32_t key;
      int32_t pos;
      element<DT, kCands>(s, i, key, pos);
      const bool match = key != 0u && (p == 0 || (key >> (shift + 8)) == (prefix >> (shift + 8)));
      if (match) atomicAdd(&sh.hist[(tid >> 5) & (kCopies - 1)][(key >> shift) & 0xFFu], 1);
    }
    __syncthreads();
    // thread t < 256 holds bin 255 - t: the inclusive scan is the count of keys with a digit >= that bin
    int h = 0;
    if (tid < kBins)
      for (int c = 0; c < kCopies; ++c) h += sh.hist[c][kBins - 1 - tid];
    const int ge = scan256(h, sh);
    if (tid < kBins && ge >= want && ge - h < want) {
      sh.digit = kBins - 1 - tid;
      sh.above = ge - h;
      sh.in_bucket = h;
    }
    if (tid == kBins - 1) sh.total = ge;
    __syncthreads();
    const int total = sh.total;
    if (p == 0 && total <= a.k) break;           // at most k candidates: take them all
    prefix |= static_cast<uint32_t>(sh.digit) << shift;
    lvl = shift;
    want -= sh.above;
    const bool whole_bucket = want == sh.in_bucket;
    __syncthreads();                              // sh.digit etc. are rewritten by the next pass
    if (whole_bucket) break;
  }

  // ---- compaction in position order
  const uint32_t t_hi = prefix >> lvl;
  int taken = 0, eq_seen = 0;
  uint32_t* const dst_key = STAGE == kStageChunk ? ws_key + blockIdx.x * static_cast<int64_t>(per) : nullptr;
  int32_t* const dst_pos = STAGE == kStageChunk ? ws_pos + blockIdx.x * static_cast<int64_t>(per) : nullptr;
  for (int32_t base = 0; base < s.n; base += kTile) {
    uint32_t keys[kItems];
    int32_t poss[kItems];
    unsigned flags = 0u;    // bit j: above; bit 8 + j: equal
    int ngt = 0, neq = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      element<DT, kCands>(s, base + tid * kItems + j, keys[j], poss[j]);
      const uint32_t hi = keys[j] >> lvl;
      const bool gt = keys[j] != 0u && hi > t_hi;
      const bool eq = keys[j] != 0u && hi == t_hi;
      flags |= (gt ? 1u : 0u) << j;
      flags |= (eq ? 1u : 0u) << (8 + j);
      ngt += gt;
      neq += eq;
    }
    unsigned long long tile_total;
    const unsigned long long ex = scan_block_exclusive(
        (static_cast<unsigned long long>(neq) << 32) | static_cast<unsigned>(ngt), sh, tile_total);
    int gt_before = static_cast<int>(ex & 0xFFFFFFFFull);
    int eq_before = static_cast<int>(ex >> 32);
    const int eq_room = want - eq_seen > 0 ? want - eq_seen : 0;   // equal keys still to take
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const bool gt = (flags >> j) & 1u, eq = (flags >> (8 + j)) & 1u;
      const bool take = gt || (eq && eq_before < eq_room);
      if (take) {
        const int slot = taken + gt_before + (eq_before < eq_room ? eq_before : eq_room);
        if constexpr (STAGE == kStageChunk) {
          dst_key[slot] = keys[j];
          dst_pos[slot] = poss[j];
        } else {
          sh.sort[slot] = (static_cast<unsigned long long>(keys[j]) << 32) | static_cast<uint32_t>(~poss[j]);
        }
      }
      gt_before += gt;
      eq_before += eq;
    }
    const int tile_gt = static_cast<int>(tile_total & 0xFFFFFFFFull);
    const int tile_eq = static_cast<int>(tile_total >> 32);
    taken += tile_gt + (tile_eq < eq_room ? tile_eq : eq_room);
    eq_seen += tile_eq;
  }

  if constexpr (STAGE == kStageChunk) {
    for (int32_t j = taken + tid; j < per; j += kThreads) {   // pad: key 0 is never selected
      dst_key[j] = 0u;
      dst_pos[j] = -1;
    }
  } else {
  // ---- sort the taken words descending, write the row
  for (int32_t j = taken + tid; j < k_pad; j += kThreads) sh.sort[j] = 0ull;
  for (int size = 2; size <= k_pad; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      __syncthreads();
      for (int i = tid; i < k_pad / 2; i += kThreads) {
        const int lo = 2 * stride * (i / stride) + (i % stride);
        const int hi = lo + stride;
        const bool desc = (lo & size) == 0;
        const unsigned long long x = sh.sort[lo], y = sh.sort[hi];
        if ((x < y) == desc) {
          sh.sort[lo] = y;
          sh.sort[hi] = x;
        }
      }
    }
  }
  __syncthreads();
  int32_t* const out = a.out + row * a.k;
  const int32_t rel = a.relative ? static_cast<int32_t>(start) : 0;
  for (int64_t j = tid; j < a.k; j += kThreads) {
    int32_t v = -1;
    if (j < k_pad) {
      const unsigned long long w = sh.sort[j];
      if (w >> 32) v = static_cast<int32_t>(~static_cast<uint32_t>(w)) - rel;
    }
    out[j] = v;
  }
  }
}

template <int STAGE>
cudaError_t launch_stage(const DsqTopkArgs& a, int64_t grid, int32_t chunks, int32_t chunk_len, int32_t per,
                         int32_t k_pad, cudaStream_t stream) {
  switch (a.logits_dtype) {
    case 0: topk_kernel<0, STAGE><<<grid, kThreads, 0, stream>>>(a, chunks, chunk_len, per, k_pad); break;
    case 1: topk_kernel<1, STAGE><<<grid, kThreads, 0, stream>>>(a, chunks, chunk_len, per, k_pad); break;
    default: topk_kernel<2, STAGE><<<grid, kThreads, 0, stream>>>(a, chunks, chunk_len, per, k_pad); break;
  }
  return cudaGetLastError();
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int32_t dsq_topk_plan_chunks(int64_t rows, int64_t L, int64_t k,
                                                                             int32_t sms) {
  if (rows <= 0 || rows >= sms || k <= 0 || L < 8 * k) return 1;
  int64_t c = sms / rows;          // one 1024-thread block per SM: the chunks of every row in one wave
  if (c > kMaxChunks) c = kMaxChunks;
  if (c > L / (4 * k)) c = L / (4 * k);
  return static_cast<int32_t>(c < 1 ? 1 : c);
}

extern "C" __attribute__((visibility("default"))) int64_t dsq_topk_workspace_bytes(int64_t rows, int64_t L, int64_t k,
                                                                                 int32_t chunks) {
  if (chunks <= 1 || rows <= 0 || L <= 0 || k <= 0) return 0;
  const int64_t chunk_len = (L + chunks - 1) / chunks;
  const int64_t per = k < chunk_len ? k : chunk_len;
  return 2 * 4 * rows * chunks * per;
}

extern "C" __attribute__((visibility("default"))) int dsq_topk_indices(const DsqTopkArgs* args, void* stream_) {
  if (!args) return cudaErrorInvalidValue;
  const DsqTopkArgs& a = *args;
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_);
  if (a.rows < 0 || a.L < 0 || a.L > INT32_MAX || a.k < 1 || a.k > INT32_MAX || !a.out ||
      a.logits_dtype < 0 || a.logits_dtype > 2 || (a.index_dtype != 3 && a.index_dtype != 4) ||
      a.form < DSQ_TOPK_DECODE_1D || a.form > DSQ_TOPK_PREFILL || a.next_n < 1 ||
      (a.rows > 0 && a.L > 0 && !a.logits) || a.row_stride < 0)
    return cudaErrorInvalidValue;
  if (a.form == DSQ_TOPK_PREFILL ? (!a.ks || !a.ke) : !a.context_lens) return cudaErrorInvalidValue;
  if (a.chunks > 1024) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaSuccess;
  const int64_t m = a.k < a.L ? a.k : a.L;
  int32_t k_pad = 1;
  while (k_pad < m) k_pad <<= 1;
  if (k_pad > DSQ_TOPK_MAX_SORT) return cudaErrorInvalidValue;
  int32_t chunks = a.chunks > 0 ? a.chunks : 1;
  if (chunks > 1 && (a.L == 0 || !a.workspace || a.workspace_bytes < dsq_topk_workspace_bytes(a.rows, a.L, a.k, chunks)))
    chunks = 1;
  if (chunks > a.L) chunks = a.L > 0 ? static_cast<int32_t>(a.L) : 1;
  if (chunks == 1) return launch_stage<kStageWhole>(a, a.rows, 1, static_cast<int32_t>(a.L), 0, k_pad, stream);
  const int32_t chunk_len = static_cast<int32_t>((a.L + chunks - 1) / chunks);
  const int32_t per = static_cast<int32_t>(a.k < chunk_len ? a.k : chunk_len);
  const cudaError_t e = launch_stage<kStageChunk>(a, a.rows * chunks, chunks, chunk_len, per, k_pad, stream);
  if (e != cudaSuccess) return e;
  return launch_stage<kStageMerge>(a, a.rows, chunks, chunk_len, per, k_pad, stream);
}

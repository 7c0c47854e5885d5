// scorer.cu: paged MQA logits (SPEC §7.4) on sm_90a FP8 tensor cores, for the fp8_132, packed68 and
// aiter_fp4 layouts (SPEC §6).
//
// logits[b*N + n, p] = weight_scale * sum_h w[b*N + n, h] * relu(q[b, n, h, :] . k[p, :])
// for p < len(b, n), with q and k dequantized. One CTA = one warpgroup (128 threads) owns sequence b,
// a group of NQ queries (the wgmma N side is NT = NQ * H query rows) and a range of 64-position tiles
// of the context (a split: small batches still fill every SM). Tiles go in pairs:
//   * cp.async copies a pair's keys into shared memory (kAhead pairs ahead of the one computed), fp8
//     rows in the 128-byte swizzle that wgmma reads; positions past the context or whose page is out of
//     range are zero-filled, never read;
//   * both tiles' four m64nNTk32 wgmma (K = 128) are issued into two accumulator sets (NT <= 64), and
//     tile 2p's epilogue runs while tile 2p + 1's wgmma does: times the row scale, relu (NaN kept), times
//     the head weight, summed over the heads of each query (in-thread, then across the four lanes of a
//     row), times weight_scale, stored; -inf past the context;
//   * FP4 layouts feed wgmma's A operand from registers: each thread expands the packed E2M1 codes of its
//     own two rows to e4m3 (a prmt table lookup; every E2M1 value is exact in e4m3), with a row's four
//     UE8M0 block exponents folded into the values relative to the row's largest (value * 2^(6 - (emax
//     - e))): exact while a row's exponents span at most 14 binades (the usual case by far; beyond that
//     the small blocks round to e4m3 subnormals), and the row keeps one power-of-two scale 2^(emax - 133),
//     the role the fp32 scale plays in fp8_132. q rows get the same treatment once per CTA (in shared
//     memory, their k order permuted as the register fragments take it); their scale goes into the weights.
// No host synchronisation: the work split depends on the shapes, max_seq_len and the device only, so one captured
// CUDA graph serves any context lengths.
//
// Accuracy: the products are exact, the tensor cores' fp32 accumulation of the 128 products is not
// IEEE-ordered, so logits differ from the reference by summation error (docs/scorer.md has the bound).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>

#include "dsaquant/codes.h"
#include "dsaquant/layouts.h"
#include "device.h"
#include "ptx.cuh"
#include "scorer.h"
#include "wgmma.cuh"

namespace {

constexpr int kThreads = 128;
constexpr int kTile = 64;          // KV positions per tile: the wgmma M side
#ifndef DSQ_SCORER_STAGES
#define DSQ_SCORER_STAGES 4
#endif
constexpr int kStages = DSQ_SCORER_STAGES;   // tile stages in shared memory: pairs of tiles, kAhead + 1 pairs
constexpr int kAhead = kStages / 2 - 1;      // pairs in flight ahead of the one computed
static_assert(kStages % 2 == 0 && kAhead >= 1, "DSQ_SCORER_STAGES: an even number >= 4");
// CTAs per SM the register allocation must allow for tiles of NT <= 64 query rows (1: no limit). FP4 tiles
// hold two A-fragment sets besides the accumulators: bounded to 128 registers they fit four CTAs an SM, which
// measured faster than three on the small-batch shapes (fp8_132 measured faster unbounded, 111 registers).
#ifndef DSQ_SCORER_MIN_CTAS_FP8
#define DSQ_SCORER_MIN_CTAS_FP8 1
#endif
#ifndef DSQ_SCORER_MIN_CTAS_FP4
#define DSQ_SCORER_MIN_CTAS_FP4 4
#endif
template <int NT, bool FP4>
constexpr int kMinCtas = NT > 64 ? 1 : FP4 ? DSQ_SCORER_MIN_CTAS_FP4 : DSQ_SCORER_MIN_CTAS_FP8;
// The widest tile (query rows) that keeps two accumulator sets (the second tile's wgmma overlaps the first's
// epilogue); wider tiles keep one set, which leaves room for more resident CTAs. 128 is a variant to time
// (dev/cuda_variants.sh).
#ifndef DSQ_SCORER_DUAL_MAX_ROWS
#define DSQ_SCORER_DUAL_MAX_ROWS 64
#endif
constexpr int kPageOutOfRange = dsq::code(dsq::ErrFlag::page_out_of_range);
static_assert(DSQ_SCORER_FP8_132 == dsq::code(dsq::Layout::fp8_132) && DSQ_SCORER_PACKED68 == dsq::code(dsq::Layout::packed68) &&
                  DSQ_SCORER_AITER_FP4 == dsq::code(dsq::Layout::aiter_fp4),
              "scorer.h layout codes are dsaquant/codes.h's");
constexpr int kFoldShift = 6;      // E2M1 values are scaled by up to 2^6 (6 * 64 = 384 <= 448)
constexpr int kLutEntries = 33;    // exponent distances 0..31 (31: every value rounds to zero), 32: a zero scale

// Shared memory of one CTA, in bytes from a 1024-aligned base.
struct SmemPlan {
  int q, k, raw, scales, lut, w, pages, total;
};
__host__ __device__ inline SmemPlan smem_plan(int nt, bool fp4, int n_pages) {
  SmemPlan s{};
  s.q = 0;
  s.k = nt * 128;                                      // a multiple of 1024 (nt >= 16)
  if (fp4) {
    s.raw = s.k;                                       // kStages x 64 x 64 payload bytes
    s.scales = s.raw + kStages * kTile * 64;           // kStages x 512 exponent bytes
    s.lut = s.scales + kStages * 512;                  // kLutEntries e4m3 magnitude tables (8 bytes each)
    s.w = s.lut + kLutEntries * 8;
  } else {
    s.raw = s.lut = 0;
    s.scales = s.k + kStages * kTile * 128;            // kStages x 64 fp32 scales
    s.w = s.scales + kStages * kTile * 4;
  }
  s.pages = s.w + nt * 4;
  s.total = s.pages + n_pages * 4;
  return s;
}

using dsq_ptx::cp_async16;   // ptx.cuh
using dsq_ptx::cp_async_commit;
using dsq_ptx::cp_async_wait;
using dsq_ptx::fence_proxy_async;
using dsq_ptx::relu_nan;

__device__ __forceinline__ int64_t load_index(const void* p, int64_t i, int dtype) {
  return dtype == dsq::kI64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}
__device__ __forceinline__ float load_float(const void* p, int64_t i, int dtype) {
  if (dtype == dsq::kBF16) return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16);
  return static_cast<const float*>(p)[i];
}

// ---- FP4 -> e4m3 expansion ---------------------------------------------------------------------
// Two fp32 values -> two e4m3fn bytes (a in the low byte), round to nearest even, saturating.
__device__ __forceinline__ uint32_t cvt_e4m3x2(float a, float b) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;\n" : "=h"(r) : "f"(a), "f"(b));
  return r;
}
// The e4m3 codes of the eight E2M1 magnitudes times 2^t (t <= 6), as a prmt table (lo: m = 0..3).
// A zero-exponent block (scale 0) gets the all-zero table.
__device__ __forceinline__ void e2m1_table(int e, int emax, uint32_t& lo, uint32_t& hi) {
  const int t = max(kFoldShift - (emax - e), -40);
  const float s = e == 0 ? 0.f : __uint_as_float(static_cast<uint32_t>(t + 127) << 23);
  lo = cvt_e4m3x2(0.f, 0.5f * s) | (cvt_e4m3x2(s, 1.5f * s) << 16);
  hi = cvt_e4m3x2(2.f * s, 3.f * s) | (cvt_e4m3x2(4.f * s, 6.f * s) << 16);
}
// Eight packed E2M1 codes (SPEC §1: element 2i in the low nibble of byte i) -> eight e4m3 bytes:
// x = elements 0..3, y = elements 4..7. The magnitudes come from the table (prmt on the low three bits of
// each nibble); each nibble's sign bit (bit 3) is moved to bit 7 of its byte by one more prmt that picks
// the byte of w << 4 (even nibbles) or of w (odd nibbles).
__device__ __forceinline__ uint2 expand8(uint32_t w, uint32_t lo, uint32_t hi) {
  const uint32_t u = w << 4;
  uint2 r;
  r.x = __byte_perm(lo, hi, w & 0x7777u) | (__byte_perm(u, w, 0x5140u) & 0x80808080u);
  r.y = __byte_perm(lo, hi, (w >> 16) & 0x7777u) | (__byte_perm(u, w, 0x7362u) & 0x80808080u);
  return r;
}
// The magnitude table of exponent distance d = emax - e (fp4 rows fold their block exponents relative
// to the row's largest): the eight E2M1 magnitudes times 2^(6 - d), i.e. e2m1_table of a block d binades
// below its row's largest; d = 32 is a zero-scale block.
__device__ __forceinline__ void fp4_table(int d, uint32_t& lo, uint32_t& hi) {
  if (d >= 32) {
    lo = hi = 0;
  } else {
    e2m1_table(1, 1 + d, lo, hi);
  }
}
// The table entry of a block with exponent e in a row whose largest exponent is emax.
__device__ __forceinline__ int lut_index(int e, int emax) { return e == 0 ? 32 : min(emax - e, 31); }
// Byte offset of block j of row m in a stage of packed E2M1 rows: 16-byte chunks swizzled by row pair so
// that the eight rows a warp reads at once fall in distinct banks.
__device__ __forceinline__ int raw_chunk(int m, int j) { return m * 64 + ((j ^ ((m >> 1) & 3)) << 4); }
// The scale a row keeps after folding: 2^(emax - 127 - kFoldShift) from bits; 0 for an all-zero-scale
// row, NaN when a block has the NaN scale 255 (SPEC §3).
__device__ __forceinline__ float fold_scale(int emax) {
  if (emax == 255) return __uint_as_float(0x7FC00000u);
  if (emax == 0) return 0.f;
  const int e = emax - kFoldShift;
  return e >= 1 ? __uint_as_float(static_cast<uint32_t>(e) << 23) : __uint_as_float(1u << (e + 22));
}
__device__ __forceinline__ int max4(uint32_t e) {
  return max(max(static_cast<int>(e & 255), static_cast<int>((e >> 8) & 255)),
             max(static_cast<int>((e >> 16) & 255), static_cast<int>(e >> 24)));
}
// 128 e4m3 bytes of one row into a swizzled 128-byte row of shared memory.
__device__ __forceinline__ void store_chunk(uint8_t* tile, int row, int c, uint4 v) {
  *reinterpret_cast<uint4*>(tile + row * 128 + ((c ^ (row & 7)) << 4)) = v;
}
// One q row: four packed E2M1 blocks (64 bytes) with exponents e (block j in byte j) -> a swizzled e4m3
// row, each block's 32 values in the order the k side's register fragments use (wgmma.cuh): the first
// 16 bytes hold elements 8t + 0..3, the next 16 elements 8t + 4..7, t = 0..3. Returns the row's scale.
__device__ __forceinline__ float expand_q_row(const uint4 (&raw)[4], uint32_t e, uint8_t* tile, int row) {
  const int emax = max4(e);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t lo, hi;
    e2m1_table(static_cast<int>((e >> (8 * j)) & 255), emax, lo, hi);
    const uint2 p0 = expand8(raw[j].x, lo, hi), p1 = expand8(raw[j].y, lo, hi), p2 = expand8(raw[j].z, lo, hi),
                p3 = expand8(raw[j].w, lo, hi);
    store_chunk(tile, row, 2 * j, make_uint4(p0.x, p1.x, p2.x, p3.x));
    store_chunk(tile, row, 2 * j + 1, make_uint4(p0.y, p1.y, p2.y, p3.y));
  }
  return fold_scale(emax);
}

struct Geometry {
  int P, p_shift;  // page size; log2(P) when P is a power of two, else -1
  // p >= 0, P > 0: unsigned division where P is not a power of two
  __device__ __forceinline__ int page_of(int p) const {
    return p_shift >= 0 ? p >> p_shift : static_cast<int>(static_cast<unsigned>(p) / static_cast<unsigned>(P));
  }
  __device__ __forceinline__ int in_page(int p) const {
    return p_shift >= 0 ? p & (P - 1) : static_cast<int>(static_cast<unsigned>(p) % static_cast<unsigned>(P));
  }
};

template <int H, int NQ, bool FP4>
__global__ void __launch_bounds__(kThreads, kMinCtas<H * NQ, FP4>) paged_logits_kernel(const DsqPagedLogitsArgs a, int tiles_per_cta,
                                                                 int n_pages, int p_shift) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int NT = H * NQ;
  using Mma = dsq_wgmma::MmaE4M3<NT>;
  constexpr int kRegs = Mma::kRegs;
  extern __shared__ uint8_t dyn_smem[];
  // 1024-aligned (the 128-byte swizzle repeats every 1024 bytes); offset from dyn_smem so that every
  // access stays a shared-memory access
  uint8_t* smem = dyn_smem + ((1024u - (static_cast<uint32_t>(__cvta_generic_to_shared(dyn_smem)) & 1023u)) & 1023u);
  const SmemPlan plan = smem_plan(NT, FP4, n_pages);
  uint8_t* sq = smem + plan.q;
  float* sw = reinterpret_cast<float*>(smem + plan.w);
  int* spages = reinterpret_cast<int*>(smem + plan.pages);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int split = blockIdx.x, group = blockIdx.y;
  const int64_t b = blockIdx.z;
  const Geometry geo{static_cast<int>(a.page_size), p_shift};
  const int P = geo.P;
  const int max_seq = static_cast<int>(a.max_seq_len);

  const int n_tiles_all = (max_seq + kTile - 1) / kTile;
  const int t0 = split * tiles_per_cta;
  const int t1 = min(t0 + tiles_per_cta, n_tiles_all);
  if (t0 >= t1) return;

  // ---- the block-table entries of [t0*64, t1*64) into shared memory (-1: out of range), loaded
  // together with the context lengths (neither waits for the other) ---------------------------------
  const int e0 = geo.page_of(t0 * kTile);
  const int e_all = geo.page_of(min(t1 * kTile, max_seq) - 1) + 1;
  for (int e = e0 + tid; e < e_all; e += kThreads) {
    int64_t pg = e < a.max_blocks ? load_index(a.block_table, b * a.bt_b + static_cast<int64_t>(e) * a.bt_k, a.bt_dtype)
                                  : -1;
    spages[e - e0] = pg < 0 || pg >= a.num_blocks ? -1 : static_cast<int>(pg);
  }
  int len[NQ];
  bool valid[NQ];
  int ctx_max = 0;
#pragma unroll
  for (int qi = 0; qi < NQ; ++qi) {
    const int64_t n = static_cast<int64_t>(group) * NQ + qi;
    valid[qi] = n < a.N;
    int64_t c = valid[qi] ? load_index(a.context_lens, b * a.ctx_b + n * a.ctx_n, a.ctx_dtype) : 0;
    c = c < 0 ? 0 : (c > max_seq ? max_seq : c);
    len[qi] = static_cast<int>(c);
    ctx_max = max(ctx_max, len[qi]);
  }
  const int tc = max(t0, min((ctx_max + kTile - 1) / kTile, t1));   // tiles [t0, tc) read keys
  const int read_end = min(tc * kTile, ctx_max);                      // positions [t0*64, read_end) are read
  const int e1 = read_end > t0 * kTile ? geo.page_of(read_end - 1) + 1 : e0;
  __syncthreads();   // spages
  for (int e = e0 + tid; e < e1; e += kThreads)
    if (spages[e - e0] < 0) atomicOr(a.err_flag, kPageOutOfRange);

  uint8_t* sk = smem + plan.k;
  float* sscale = reinterpret_cast<float*>(smem + plan.scales);
  uint8_t* sraw = smem + plan.raw;
  uint8_t* sexp = smem + plan.scales;
  uint2* slut = reinterpret_cast<uint2*>(smem + plan.lut);
  const uint8_t* kv = a.kv_cache;
  // Page id of position p (>= 0), or -1 (out of range, past the context, or past the table).
  auto page_at = [&](int p) -> int { return p < read_end ? spages[geo.page_of(p) - e0] : -1; };

  // ---- copies of tile t into stage s -------------------------------------------------------------
  // The page of tile t when the whole tile lies in one page that is read (P >= 64, inside the read
  // range, a valid entry), else -1: such tiles take the copy path without per-row checks.
  auto whole_tile_page = [&](int t) -> int {
    const int base = t * kTile;
    return P >= kTile && base + kTile <= read_end ? spages[geo.page_of(base) - e0] : -1;
  };
  const int crow = tid >> 3, cchunk = tid & 7;   // fp8 copies: rows crow + 16 i, 16-byte chunk cchunk
  auto issue = [&](int t, int s) {
    const int base = t * kTile;
    const int wpg = whole_tile_page(t);
    if (wpg >= 0) {
      const int o0 = geo.in_page(base);
      if constexpr (!FP4) {
        const uint8_t* page = kv + static_cast<int64_t>(wpg) * P * dsq::kFp8132Row;
        uint8_t* dst_tile = sk + s * (kTile * 128) + ((cchunk ^ (crow & 7)) << 4);
        const uint8_t* src = page + dsq::fp8_132_data_offset_at(dsq::SlotPos{0, o0 + crow}, P, cchunk * 16, a.preshuffle != 0);
#pragma unroll
        for (int i = 0; i < 4; ++i) cp_async16(dst_tile + (crow + 16 * i) * 128, src + i * dsq::kFp8132Rows16);
        if (tid < kTile / 4)
          cp_async16(sscale + s * kTile + tid * 4, page + dsq::fp8_132_scale_offset_at(dsq::SlotPos{0, o0 + tid * 4}, P));
      } else if (a.layout == DSQ_SCORER_PACKED68) {
        const uint8_t* page = kv + static_cast<int64_t>(wpg) * P * dsq::kPacked68Row;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int q = tid + kThreads * i, m = q >> 2, c = q & 3;
          cp_async16(sraw + s * (kTile * 64) + raw_chunk(m, c),
                     page + dsq::packed68_payload_offset_at(dsq::SlotPos{0, o0 + m}, P, c * 16));
        }
        if (tid < kTile / 4)
          cp_async16(sexp + s * 512 + tid * 16, page + dsq::packed68_scale_offset_at(dsq::SlotPos{0, o0 + tid * 4}, P, 0));
      } else {
        const uint8_t* page = kv + static_cast<int64_t>(wpg) * P * 64;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int q = tid + kThreads * i, m = q >> 2, c = q & 3;
          cp_async16(sraw + s * (kTile * 64) + raw_chunk(m, c),
                     page + dsq::aiter_fp4_data_offset_at(dsq::SlotPos{0, o0 + m}, P, c * 16));
        }
        if (tid < P / 4) cp_async16(sexp + s * 512 + tid * 16, a.kv_scale + static_cast<int64_t>(wpg) * 4 * P + tid * 16);
      }
      return;
    }
    if constexpr (!FP4) {
      uint8_t* dst_tile = sk + s * (kTile * 128);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int q = tid + kThreads * i, m = q >> 3, c = q & 7, p = base + m;
        uint8_t* dst = dst_tile + m * 128 + ((c ^ (m & 7)) << 4);
        const int pg = page_at(p);
        if (pg >= 0)
          cp_async16(dst, kv + dsq::fp8_132_data_offset_at(dsq::SlotPos{pg, geo.in_page(p)}, P, c * 16, a.preshuffle != 0));
        else
          *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      }
      if (tid < kTile / 4) {
        const int m = tid * 4, p = base + m;
        uint8_t* dst = reinterpret_cast<uint8_t*>(sscale + s * kTile + m);
        const int pg = page_at(p);
        if (pg >= 0)
          cp_async16(dst, kv + dsq::fp8_132_scale_offset_at(dsq::SlotPos{pg, geo.in_page(p)}, P));
        else
          *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      }
    } else {
      uint8_t* dst_tile = sraw + s * (kTile * 64);
      const bool aiter = a.layout == DSQ_SCORER_AITER_FP4;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int q = tid + kThreads * i, m = q >> 2, c = q & 3, p = base + m;
        uint8_t* dst = dst_tile + raw_chunk(m, c);
        const int pg = page_at(p);
        if (pg >= 0) {
          const dsq::SlotPos sp{pg, geo.in_page(p)};
          cp_async16(dst, kv + (aiter ? dsq::aiter_fp4_data_offset_at(sp, P, c * 16)
                                      : dsq::packed68_payload_offset_at(sp, P, c * 16)));
        } else {
          *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
        }
      }
      uint8_t* dst_exp = sexp + s * 512;
      if (!aiter) {
        if (tid < kTile / 4) {
          const int m = tid * 4, p = base + m;
          const int pg = page_at(p);
          if (pg >= 0)
            cp_async16(dst_exp + m * 4, kv + dsq::packed68_scale_offset_at(dsq::SlotPos{pg, geo.in_page(p)}, P, 0));
          else
            *reinterpret_cast<uint4*>(dst_exp + m * 4) = make_uint4(0, 0, 0, 0);
        }
      } else {
        // The 4*P exponent bytes of each page the tile touches ([block][interleaved position]).
        const int per_page = P / 4;                          // 16-byte chunks per page
        const int chunks = P >= kTile ? per_page : kTile / 4;
        if (tid < chunks) {
          const int pi = P >= kTile ? 0 : tid / per_page, k = P >= kTile ? tid : tid % per_page;
          const int p = P >= kTile ? base : base + pi * P;
          const int pg = page_at(p);
          uint8_t* dst = dst_exp + pi * 4 * P + k * 16;
          if (pg >= 0)
            cp_async16(dst, a.kv_scale + static_cast<int64_t>(pg) * 4 * P + k * 16);
          else
            *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
        }
      }
    }
  };

  // ---- the pipeline --------------------------------------------------------------------------------
  const int n_tiles = tc - t0;
  const uint64_t desc_q = dsq_wgmma::desc_sw128(sq);
  const int m0 = warp * 16 + (lane >> 2);   // this thread's accumulator rows: m0 and m0 + 8
  const float wscale = a.weight_scale;
  // Tiles go in pairs: pair p = tiles 2p, 2p + 1 in stages 2p % kStages, 2p % kStages + 1; one cp.async
  // group per pair, kAhead pairs in flight ahead of the one computed.
  auto issue_pair = [&](int p) {
#pragma unroll
    for (int k = 0; k < 2; ++k)
      if (2 * p + k < n_tiles) issue(t0 + 2 * p + k, (2 * p + k) % kStages);
    cp_async_commit();
  };
#pragma unroll
  for (int p = 0; p < kAhead; ++p) issue_pair(p);

  // ---- q rows (NT x 128 e4m3, swizzled) and head weights, once per CTA ---------------------------
  if constexpr (!FP4) {
    constexpr int kPer = NT * 8 / kThreads;   // 16-byte chunks per thread (all loads first, then the stores)
    uint4 v[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int i = tid + k * kThreads, r = i >> 3, c = i & 7, qi = r / H, h = r % H;
      v[k] = make_uint4(0, 0, 0, 0);
      if (static_cast<int64_t>(group) * NQ + qi < a.N) {
        const int64_t row = (b * a.N + static_cast<int64_t>(group) * NQ + qi) * H + h;
        v[k] = *reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(a.q) + row * 128 + c * 16);
      }
    }
#pragma unroll
    for (int k = 0; k < kPer; ++k) store_chunk(sq, (tid + k * kThreads) >> 3, (tid + k * kThreads) & 7, v[k]);
    for (int r = tid; r < NT; r += kThreads) {
      const int qi = r / H, h = r % H;
      const int64_t n = static_cast<int64_t>(group) * NQ + qi;
      sw[r] = n < a.N ? load_float(a.weights, (b * a.N + n) * a.w_row + h * a.w_head, a.w_dtype) : 0.f;
    }
  } else {
    if (tid < kLutEntries) {   // the magnitude table of each exponent distance (fp4_table)
      uint32_t lo, hi;
      fp4_table(tid, lo, hi);
      slut[tid] = make_uint2(lo, hi);
    }
    for (int r = tid; r < NT; r += kThreads) {
      const int qi = r / H, h = r % H;
      const int64_t n = static_cast<int64_t>(group) * NQ + qi;
      uint4 raw[4] = {};
      uint32_t e = 0;
      float w = 0.f;
      if (n < a.N) {
        const int64_t t = b * a.N + n, row = t * H + h;
        const uint4* src = reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(a.q) + row * 64);
#pragma unroll
        for (int j = 0; j < 4; ++j) raw[j] = src[j];
        const uint8_t* qs = static_cast<const uint8_t*>(a.q_scale);
        if (a.layout == DSQ_SCORER_PACKED68) {
          e = *reinterpret_cast<const uint32_t*>(qs + row * 4);
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j) e |= static_cast<uint32_t>(qs[dsq::aiter_q_scale_offset(t, h, j, H)]) << (8 * j);
        }
        w = load_float(a.weights, t * a.w_row + h * a.w_head, a.w_dtype);
      }
      const float s = expand_q_row(raw, e, sq, r);
      sw[r] = n < a.N ? w * s : 0.f;
    }
  }
  fence_proxy_async();   // q rows written with st.shared, read by wgmma
  __syncthreads();       // q rows, weights, the FP4 table
  float wr[NT / 4];   // this thread's head weights: columns 8c + 2(lane%4) + j at 2c + j
#pragma unroll
  for (int c = 0; c < NT / 8; ++c) {
    wr[2 * c] = sw[8 * c + 2 * (lane & 3)];
    wr[2 * c + 1] = sw[8 * c + 2 * (lane & 3) + 1];
  }

  // Two accumulator sets: tile i + 1's wgmma runs while tile i's epilogue does. FP4 tiles feed wgmma
  // from registers (their A fragments, two sets as well: the instruction reads them until it completes).
  // Wide tiles (NT = 128: 64 accumulator registers) keep one set by default: two would halve the resident CTAs
  // (DSQ_SCORER_DUAL_MAX_ROWS).
  constexpr bool kDual = NT <= DSQ_SCORER_DUAL_MAX_ROWS;
  float acc[2][kRegs];
  uint32_t frag[2][FP4 ? 4 : 1][4];
  float rscale[2][2];   // the row scales of rows m0 and m0 + 8 (fp32 scales, or the FP4 fold scales)

  // Tile i (its stage landed and visible): read its row scales (FP4: build its A fragments), issue its
  // wgmma into acc[PB].
  auto start = [&](auto par, int i) {
    constexpr int PB = decltype(par)::value;
    const int stage = i % kStages;
    if constexpr (!FP4) {
      rscale[PB][0] = sscale[stage * kTile + m0];
      rscale[PB][1] = sscale[stage * kTile + m0 + 8];
    } else {
      const uint8_t* raw = sraw + stage * (kTile * 64);
      const uint8_t* ex = sexp + stage * 512;
      const int tq = lane & 3;
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int m = m0 + 8 * hr;
        uint32_t e;
        if (a.layout == DSQ_SCORER_PACKED68) {
          e = *reinterpret_cast<const uint32_t*>(ex + m * 4);
        } else {
          const int o = geo.in_page((t0 + i) * kTile + m);
          const uint8_t* region = ex + (P >= kTile ? 0 : (m / P) * 4 * P);
          const int sf = static_cast<int>(dsq::aiter_sflat(o, P));
          e = region[sf] | (region[P + sf] << 8) | (region[2 * P + sf] << 16) |
              (static_cast<uint32_t>(region[3 * P + sf]) << 24);
        }
        const int emax = max4(e);
        rscale[PB][hr] = fold_scale(emax);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint2 tab = slut[lut_index(static_cast<int>((e >> (8 * j)) & 255), emax)];
          const uint32_t w = *reinterpret_cast<const uint32_t*>(raw + raw_chunk(m, j) + 4 * tq);
          const uint2 x = expand8(w, tab.x, tab.y);
          frag[PB][j][hr] = x.x;        // k 4*tq + 0..3:      elements 8*tq + 0..3 of block j
          frag[PB][j][2 + hr] = x.y;    // k 16 + 4*tq + 0..3: elements 8*tq + 4..7 (q rows are permuted alike)
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRegs; ++r) dsq_wgmma::fence_reg(acc[PB][r]);
    dsq_wgmma::fence();
    if constexpr (!FP4) {
      const uint64_t desc_k = dsq_wgmma::desc_sw128(sk + stage * (kTile * 128));
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) Mma::run(acc[PB], desc_k + 2 * ks, desc_q + 2 * ks, ks > 0 ? 1 : 0);
    } else {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) Mma::run_rs(acc[PB], frag[PB][ks], desc_q + 2 * ks, ks > 0 ? 1 : 0);
    }
    dsq_wgmma::commit();
  };

  // Tile i's epilogue from acc[PB]: rows m0, m0 + 8; columns 8c + 2(lane%4) + j.
  // relu(acc * s) = s * relu(acc) for a row scale s >= 0 (or NaN): the scale is applied once per row
  // after the head sum. A warp with a negative fp8 scale (never written by a writer) scales first.
  auto epilogue = [&](auto par, int i) {
    constexpr int PB = decltype(par)::value;
    const int t = t0 + i;
    const float sk0 = rscale[PB][0], sk1 = rscale[PB][1];
    const int p0 = t * kTile + m0, p1 = p0 + 8;
    const bool whole = whole_tile_page(t) >= 0;
    const bool ok0 = whole || page_at(p0) >= 0, ok1 = whole || page_at(p1) >= 0;
    float s0[2 * NQ], s1[2 * NQ];   // two partial sums per query and row: shorter FMA chains
    auto head_sums = [&](auto scaled) {
#pragma unroll
      for (int k = 0; k < 2 * NQ; ++k) s0[k] = s1[k] = 0.f;
#pragma unroll
      for (int c = 0; c < NT / 8; ++c) {
        const int k = 2 * (c / (H / 8)) + (c & 1);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          float x0 = acc[PB][4 * c + j], x1 = acc[PB][4 * c + 2 + j];
          if constexpr (decltype(scaled)::value) {
            x0 *= sk0;
            x1 *= sk1;
          }
          s0[k] = fmaf(wr[2 * c + j], relu_nan(x0), s0[k]);
          s1[k] = fmaf(wr[2 * c + j], relu_nan(x1), s1[k]);
        }
      }
    };
    head_sums(std::false_type{});
    float post0 = sk0, post1 = sk1;
    if (!FP4 && __any_sync(0xFFFFFFFFu, sk0 < 0.f || sk1 < 0.f)) {   // rare: recompute scaled first
      post0 = post1 = 1.f;
      head_sums(std::true_type{});
    }
#pragma unroll
    for (int qi = 0; qi < NQ; ++qi) {
      float v0 = s0[2 * qi] + s0[2 * qi + 1], v1 = s1[2 * qi] + s1[2 * qi + 1];
      v0 += __shfl_xor_sync(0xFFFFFFFFu, v0, 1);
      v1 += __shfl_xor_sync(0xFFFFFFFFu, v1, 1);
      v0 += __shfl_xor_sync(0xFFFFFFFFu, v0, 2);
      v1 += __shfl_xor_sync(0xFFFFFFFFu, v1, 2);
      if ((lane & 3) == 0 && valid[qi]) {
        const int64_t row = (b * a.N + static_cast<int64_t>(group) * NQ + qi) * a.ld;
        const float ninf = -__int_as_float(0x7F800000);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int p = k == 0 ? p0 : p1;
          if (p >= max_seq) continue;
          const bool in_ctx = p < len[qi];
          if (!in_ctx && !a.clean_logits) continue;
          const float v = in_ctx && (k == 0 ? ok0 : ok1) ? (k == 0 ? v0 * post0 : v1 * post1) * wscale : ninf;
          if (a.out_dtype == dsq::kBF16)
            static_cast<uint16_t*>(a.logits)[row + p] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
          else
            static_cast<float*>(a.logits)[row + p] = v;
        }
      }
    }
  };

  // Pair p: wait for its copies and make them visible (the barrier also ends every read of the stages
  // of pair p - 1, so they are refilled with pair p + kAhead right after it), start both wgmma (tile 2p + 1's
  // operands are prepared while tile 2p's runs), then tile 2p's epilogue while tile 2p + 1's wgmma runs.
  // No wgmma is in flight across iterations (ptxas keeps both in flight only then). A tile past the last
  // runs its wgmma on a stage that holds no tile and skips its epilogue.
  for (int p = 0; 2 * p < n_tiles; ++p) {
    cp_async_wait<kAhead - 1>();
    if constexpr (!FP4) fence_proxy_async();
    __syncthreads();
    issue_pair(p + kAhead);
    const int i = 2 * p;
    if constexpr (!kDual) {   // one accumulator set: the two tiles one after the other
      start(std::integral_constant<int, 0>{}, i);
      dsq_wgmma::wait<0>();
#pragma unroll
      for (int r = 0; r < kRegs; ++r) dsq_wgmma::fence_reg(acc[0][r]);
      epilogue(std::integral_constant<int, 0>{}, i);
      if (i + 1 < n_tiles) {
        start(std::integral_constant<int, 0>{}, i + 1);
        dsq_wgmma::wait<0>();
#pragma unroll
        for (int r = 0; r < kRegs; ++r) dsq_wgmma::fence_reg(acc[0][r]);
        epilogue(std::integral_constant<int, 0>{}, i + 1);
      }
      continue;
    }
    start(std::integral_constant<int, 0>{}, i);
    start(std::integral_constant<int, 1>{}, i + 1);
    dsq_wgmma::wait<1>();
#pragma unroll
    for (int r = 0; r < kRegs; ++r) dsq_wgmma::fence_reg(acc[0][r]);
    epilogue(std::integral_constant<int, 0>{}, i);
    dsq_wgmma::wait<0>();
#pragma unroll
    for (int r = 0; r < kRegs; ++r) dsq_wgmma::fence_reg(acc[1][r]);
    if constexpr (FP4) {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int r = 0; r < 4; ++r) {   // the A fragments stay live until their wgmma completed
          dsq_wgmma::fence_reg_u(frag[0][ks][r]);
          dsq_wgmma::fence_reg_u(frag[1][ks][r]);
        }
    }
    if (i + 1 < n_tiles) epilogue(std::integral_constant<int, 1>{}, i + 1);
  }

  // ---- tiles past every query's context: -inf only ---------------------------------------------------
  if (a.clean_logits) {
    const int p_begin = tc * kTile, p_end = min(t1 * kTile, max_seq);
    const float ninf = -__int_as_float(0x7F800000);
#pragma unroll
    for (int qi = 0; qi < NQ; ++qi) {
      if (!valid[qi]) continue;
      const int64_t row = (b * a.N + static_cast<int64_t>(group) * NQ + qi) * a.ld;
      for (int p = p_begin + tid; p < p_end; p += kThreads) {
        if (a.out_dtype == dsq::kBF16)
          static_cast<uint16_t*>(a.logits)[row + p] = 0xFF80;   // bf16 -inf
        else
          static_cast<float*>(a.logits)[row + p] = ninf;
      }
    }
  }
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
  if (cudaFuncGetAttributes(&attr, paged_logits_kernel<16, 1, false>) != cudaSuccess) {
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
template <int H, int NQ, bool FP4>
int resident_ctas(int dev) {
  static std::mutex mu;
  static int cache[dsqdev::kMaxDevices] = {};
  std::lock_guard<std::mutex> lock(mu);
  if (dev < 0 || dev >= dsqdev::kMaxDevices) return 1;
  if (cache[dev] == 0) {
    const int bytes = smem_plan(H * NQ, FP4, kPageAllowance).total + 1024;
    auto kernel = paged_logits_kernel<H, NQ, FP4>;
    int n = 0;
    if (bytes > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, bytes) != cudaSuccess || n < 1) n = 1;
    cache[dev] = n;
  }
  return cache[dev];
}

template <int H, int NQ, bool FP4>
int launch(const DsqPagedLogitsArgs& a, int sms, cudaStream_t stream) {
  const int G = static_cast<int>((a.N + NQ - 1) / NQ);
  const int tiles = static_cast<int>((a.max_seq_len + kTile - 1) / kTile);
  int splits = a.splits;
  if (splits <= 0) {   // as many CTAs as fit on the device at once: one wave, no tail
    const int64_t ctas = a.B * G, slots = static_cast<int64_t>(resident_ctas<H, NQ, FP4>(a.device)) * sms;
    splits = static_cast<int>(slots / ctas);
  }
  splits = splits < 1 ? 1 : (splits > tiles ? tiles : splits);
  const int tpc = (tiles + splits - 1) / splits;
  splits = (tiles + tpc - 1) / tpc;
  const int P = static_cast<int>(a.page_size);
  const int n_pages = tpc * kTile / P + 2;
  int shift = -1;
  if ((P & (P - 1)) == 0) shift = __builtin_ctz(static_cast<unsigned>(P));
  const int bytes = smem_plan(H * NQ, FP4, n_pages).total + 1024;
  auto kernel = paged_logits_kernel<H, NQ, FP4>;
  if (bytes > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) return e;
  }
  kernel<<<dim3(splits, G, static_cast<unsigned>(a.B)), kThreads, bytes, stream>>>(a, tpc, n_pages, shift);
  return cudaGetLastError();
}

template <bool FP4>
int dispatch_h(const DsqPagedLogitsArgs& a, int sms, cudaStream_t s) {
  // queries per CTA: the next power of two >= N, up to 128 query rows (H * NQ <= 128)
  const int64_t cap = 128 / a.H;
  int64_t nq = 1;
  while (nq < a.N && nq < cap) nq *= 2;
  switch (a.H) {
    case 16:
      return nq == 1 ? launch<16, 1, FP4>(a, sms, s) : nq == 2 ? launch<16, 2, FP4>(a, sms, s)
             : nq == 4 ? launch<16, 4, FP4>(a, sms, s) : launch<16, 8, FP4>(a, sms, s);
    case 32:
      return nq == 1 ? launch<32, 1, FP4>(a, sms, s) : nq == 2 ? launch<32, 2, FP4>(a, sms, s)
                                                          : launch<32, 4, FP4>(a, sms, s);
    case 64:
      return nq == 1 ? launch<64, 1, FP4>(a, sms, s) : launch<64, 2, FP4>(a, sms, s);
    case 128:
      return launch<128, 1, FP4>(a, sms, s);
    default:
      return cudaErrorNotSupported;
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
  if (a.page_size < 4 || a.page_size % 4 || a.max_seq_len >= (int64_t{1} << 30)) return cudaErrorNotSupported;
  if (a.layout == DSQ_SCORER_AITER_FP4 && (a.page_size % 16 || a.page_size > 128 || (a.page_size < 64 && 64 % a.page_size)))
    return cudaErrorNotSupported;
  if (a.B == 0 || a.N == 0 || a.max_seq_len == 0) return cudaSuccess;
  const int sms = dsqdev::device_props(a.device).sm_count;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return a.layout == DSQ_SCORER_FP8_132 ? dispatch_h<false>(a, sms, s) : dispatch_h<true>(a, sms, s);
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

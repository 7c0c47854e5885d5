// kernels/cuda/topk_body.cuh: the top-k selection's block bodies (docs/topk.md), shared by the GPU kernels
// (kernels/cuda/topk.cu, hipified for AMD) and the host emulator of the tests (tests/cpp/topk_host.cpp), which
// runs them unchanged on the CPU.
//
// The includer supplies, in namespace dsqtopk, the SIMT layer: TOPK_FN (the qualifiers of a device function),
// thread_id(), block_sync(), shfl_up_i / shfl_up_u64 (32-lane groups: lane l gets lane l - off's value, its own
// for l < off), shfl_xor_u64 (lane l gets lane l ^ m's value), shared_add and global_add (atomic adds to shared
// and to global memory, returning the old value); the platform is DSQ_TOPK_AMD (1: 256-thread blocks and a
// 4096-word sort buffer).
//
// Keys: each value becomes the order key, a uint32 that compares like the float (-0.0 taken as +0.0), 0 for NaN,
// -inf and positions outside the row's span. A selected element is the word (key << 32 | ~position): words are
// unique and compare in the selection order (value descending, position ascending).
//
// Cached rows (`chunks` = -C, NVIDIA sm_90 on; cache_block): a cluster of C blocks a row, each reading its part
// of the row once into shared memory and its histogram; the threshold bin from the summed histograms; the words
// above and in it collected from the caches into the first block's shared memory, which selects, sorts and
// writes them as row_block does (details at cache_block).
//
// One block a row (`chunks` 0 or 1), row_block: a 4096-bin shared histogram of the top 12 bits of the row's keys
// gives the threshold bin b (as in the few-long-rows path below); a second read puts the words of the keys above
// b and in b into the sort buffer, which are sorted and the first k of them written (write_row: every key above b
// precedes every key in b; where the words do not spread over the sort's buckets, a radix selection over the words
// of bin b in shared memory first keeps the k - above largest of them, and only the k taken words are sorted).
// When bin b holds more than the buffer takes (a row of massive ties), the radix selection instead:
//   * Threshold: up to four 8-bit radix passes from the top. A shared-memory histogram of the current digit
//     of the keys matching the digits fixed so far (4 copies, each shared by a quarter of the warps), then a scan
//     over the 256 bins finds the digit where the count of larger keys reaches the number still wanted. The
//     passes stop early when that number equals the whole bucket; if the first pass counts at most k
//     candidates, all are taken.
//   * Compaction: tiles of 4 consecutive keys per thread, in position order; a block scan of the per-thread
//     counts of keys above the threshold and keys equal to it places the taken ones (equal keys: the first
//     `want` in position order) at deterministic slots.
//   * Sort: the taken words are bitonic-sorted descending (sort_desc: registers, warp shuffles and shared
//     memory); empty slots (0) become -1.
//
// Few long rows (`chunks` > 1): every row is read twice, by 2 * chunks blocks and by `chunks` blocks (a block of
// step 2 holds more registers: one an SM), and finished by one block:
//   1. hist_block: each block counts the top 12 bits of its keys (4096 bins) in shared memory and adds the
//      non-zero bins to the row's histogram in the workspace;
//   2. scatter_block: each block scans the row's histogram from the top for the threshold bin b, the bin where
//      the count of keys in higher bins reaches k (none when the row has at most k candidates: all are taken),
//      and appends the words of its keys above bin b to the row's "above" list (fewer than k) and those in bin b
//      to its "bin" list, each tile's slots reserved with one atomic add;
//   3. finish_block: one block per row (or kFinishGroups, each for a range of digits: finish_group) loads both
//      lists (their sum is at most kSortWords), keeps the k largest words and sorts and writes them (as
//      row_block), or, when bin b holds more than fits (a row of massive ties), runs the one-block selection on
//      the row instead. The lists' order depends on the atomics, their contents and the sorted result do not.
//
// Tuning macros (dev/cuda_variants.sh): DSQ_TOPK_LOADS, the 16-byte loads a thread has in flight when it reads a
// row (default 4; 8 measured slower); DSQ_TOPK_SORT_E, the words a thread holds in the sort (see kSortE);
// DSQ_TOPK_MERGE=1, the merge sort (sort_desc_merge) instead of the bitonic one where its two buffers fit;
// DSQ_TOPK_FINISH_GROUPS=G, the few-long-rows finish by G blocks a row, each sorting the words of a range of digits
// (finish_group); DSQ_TOPK_CACHE_KEYS, the keys a block of the cached-row path holds (0: no such path). The merge
// sort (0.5 to 4 µs slower) and the grouped finish (within 1.4 µs) measured no faster on the H100: off by default.
// Nor did spreading the cached-row path's selection and sort over its cluster, by ranges of digits (4.3 µs slower
// on 4 x 163840) or as a bitonic sort of two halves on two blocks (1.1 µs faster on 4 x 163840, 1.5 µs slower at
// k = 512, within 0.2 µs on the other shapes): the first block does it. With more than two blocks a row, gathering
// each block's words in its own shared memory and writing them to the first block's lists after a barrier that
// publishes the counts measured 0.1 to 0.2 µs slower (4 x 163840) than the remote atomic adds (cache_block).
#pragma once

#include <cstdint>

#include "dsaquant/arith.h"
#include "topk.h"

#ifndef DSQ_TOPK_AMD
#define DSQ_TOPK_AMD 0
#endif

namespace dsqtopk {

#if DSQ_TOPK_AMD
constexpr int kThreads = 256;                  // AMD: the project's block size (four wave64 waves)
constexpr int kSortWords = 4096;               // 32 KB of LDS for the sort buffer
#else
constexpr int kThreads = 1024;
constexpr int kSortWords = 8192;               // 64 KB of dynamic shared memory for the sort buffer
#endif
constexpr int kWarps = kThreads / 32;           // 32-lane groups (explicit shuffle width: wave64 too)
constexpr int kItems = 4;                      // consecutive keys per thread in the compaction
constexpr int kTile = kThreads * kItems;
constexpr int kBins = 256;
constexpr int kCopies = 4;                     // histogram copies, summed before the scan
constexpr int kMaxChunks = 1024;
constexpr int kBinCap = 8192;                  // workspace slots of a row's bin list (both platforms)
constexpr int kDigitBits = 12;                 // first-digit histogram of the few-long-rows path
constexpr int kDigits = 1 << kDigitBits;
constexpr int kDigitShift = 32 - kDigitBits;
constexpr int kDigitsPerThread = kDigits / kThreads;
constexpr int kScatterItems = 8;               // keys a thread holds per scatter tile
constexpr int kScatterTile = kThreads * kScatterItems;
static_assert(kSortWords >= DSQ_TOPK_MAX_SORT && kBinCap >= kSortWords, "sort buffer sizes");
// The cached-row path (cache_block): keys a block holds in shared memory (128 KB beside Shared: one block an SM),
// and the most blocks of a cluster that share a row. 0: no such path (AMD: the layer has no clusters, and 64 KB of
// LDS a block on gfx942).
#ifndef DSQ_TOPK_CACHE_KEYS
#define DSQ_TOPK_CACHE_KEYS (DSQ_TOPK_AMD ? 0 : 32768)
#endif
constexpr int kCacheKeys = DSQ_TOPK_CACHE_KEYS;
constexpr int kMaxCluster = 8;          // the most blocks whose caches the plan fills (rows up to 8 * kCacheKeys)
constexpr int kMaxSpread = 16;          // the most blocks a row (sm_90's non-portable cluster size)
constexpr int kMinSpreadKeys = 8192;    // the fewest keys a block of a spread row reads
// Blocks of a row up to which each block sums the row's histogram itself (cache_block; measured on the H100: 0.3 to
// 0.6 µs faster for 2 blocks a row, 2 µs slower for 8).
constexpr int kSumBlocks = 2;
// Blocks of a row above which the blocks other than the first stage their cached words before moving them into the
// first block's lists (cache_block; measured on the H100: 1.5 µs faster for 16 blocks a row, 0.5 µs slower for 4).
constexpr int kStageBlocks = 4;
// How the blocks of a cached row meet (cache_block's template parameter C): each sums the histograms and counts its
// own slots; the histograms added into the first block's and a slot a word reserved there; added, and the other
// blocks' words staged.
constexpr int kCollectSum = 0, kCollectAdd = 1, kCollectStage = 2;
inline int cache_collect(int blocks) {
  return blocks <= kSumBlocks ? kCollectSum : blocks <= kStageBlocks ? kCollectAdd : kCollectStage;
}
static_assert(kCacheKeys % 4 == 0, "DSQ_TOPK_CACHE_KEYS: whole 16-byte groups");

TOPK_FN uint32_t order_key_bits(uint32_t b) {
  const uint32_t mag = b & 0x7FFFFFFFu;
  if (mag > 0x7F800000u || b == 0xFF800000u) return 0u;   // NaN, -inf
  if (mag == 0u) b = 0u;                                 // -0.0 -> +0.0
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

template <int DT>
TOPK_FN uint32_t load_key(const void* row, int64_t p) {
  if (DT == 0) return order_key_bits(dsq::f2u(static_cast<const float*>(row)[p]));
  const uint16_t h = static_cast<const uint16_t*>(row)[p];
  if (DT == 1) return order_key_bits(static_cast<uint32_t>(h) << 16);   // bf16 -> fp32 exactly
  return order_key_bits(dsq::f2u(dsq::fp16_to_f32(h)));
}

// The key of element j of a 16-byte load holding 16 / size keys (little endian).
template <int DT>
TOPK_FN uint32_t key_in(const uint32_t (&w)[4], int j) {
  if (DT == 0) return order_key_bits(w[j]);
  const uint16_t h = static_cast<uint16_t>(w[j >> 1] >> (16 * (j & 1)));
  if (DT == 1) return order_key_bits(static_cast<uint32_t>(h) << 16);
  return order_key_bits(dsq::f2u(dsq::fp16_to_f32(h)));
}

struct alignas(16) Words16 {
  uint32_t w[4];
};

// 16-byte loads a thread issues before it uses any (for_each_key): f's shared-memory atomics and stores would
// otherwise hold each load back until the previous one's key is used (the compiler does not move a global load
// above a store through a pointer that may alias it).
#ifndef DSQ_TOPK_LOADS
#define DSQ_TOPK_LOADS 4
#endif
constexpr int kLoads = DSQ_TOPK_LOADS;
// The same in row_block's second read (collecting the candidates), at most 3: with 4 the row kernel's registers
// spill on sm_90a (its 1024 threads have 64 each).
constexpr int kCollectLoads = kLoads < 3 ? kLoads : 3;
#ifndef DSQ_TOPK_MERGE
#define DSQ_TOPK_MERGE 0
#endif
#ifndef DSQ_TOPK_FINISH_GROUPS
#define DSQ_TOPK_FINISH_GROUPS 1
#endif
constexpr int kFinishGroups = DSQ_TOPK_FINISH_GROUPS;   // blocks a row of the few-long-rows finish

// f(position, key) for every position of [lo, hi) of `row`, the block's threads together, in no particular order:
// 16-byte loads (four fp32 or eight 16-bit keys) from the first 16-byte aligned position on, LOADS in flight per
// thread, single keys for the unaligned head and the tail.
template <int DT, int LOADS = kLoads, class F>
TOPK_FN void for_each_key(const void* row, int64_t lo, int64_t hi, F f) {
  constexpr int kSize = DT == 0 ? 4 : 2;
  constexpr int kPer = 16 / kSize;
  const int tid = thread_id();
  const char* const base = static_cast<const char*>(row);
  const int64_t mis = static_cast<int64_t>(reinterpret_cast<uintptr_t>(base + lo * kSize) & 15u);
  int64_t a0 = lo + (16 - mis) % 16 / kSize;   // the first aligned position (elements are kSize-aligned)
  if (a0 > hi) a0 = hi;
  const int64_t n16 = (hi - a0) / kPer;
  for (int64_t p = lo + tid; p < a0; p += kThreads) f(p, load_key<DT>(row, p));
  const Words16* const v = reinterpret_cast<const Words16*>(base + a0 * kSize);
  for (int64_t i = tid; i < n16; i += kThreads * LOADS) {
    Words16 x[LOADS];
    DSQ_UNROLL
    for (int u = 0; u < LOADS; ++u)
      if (i + u * kThreads < n16) x[u] = v[i + u * kThreads];
    DSQ_UNROLL
    for (int u = 0; u < LOADS; ++u) {
      const int64_t iu = i + u * kThreads;
      if (iu < n16) {
        DSQ_UNROLL
        for (int j = 0; j < kPer; ++j) f(a0 + iu * kPer + j, key_in<DT>(x[u].w, j));
      }
    }
  }
  for (int64_t p = a0 + n16 * kPer + tid; p < hi; p += kThreads) f(p, load_key<DT>(row, p));
}

TOPK_FN unsigned long long word_of(uint32_t key, int64_t pos) {
  return (static_cast<unsigned long long>(key) << 32) | static_cast<uint32_t>(~static_cast<uint32_t>(pos));
}

TOPK_FN int64_t load_index(const void* p, int64_t i, int dt) {
  return dt == 4 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// (start, end) of a row, clamped: 0 <= start <= end <= L (reference.topk.row_spans).
TOPK_FN void row_span(const DsqTopkArgs& a, int64_t row, int64_t& start, int64_t& end) {
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

TOPK_FN const void* row_ptr(const DsqTopkArgs& a, int64_t row) {
  return static_cast<const char*>(a.logits) + row * a.row_stride * (a.logits_dtype == 0 ? 4 : 2);
}

// The workspace of the few-long-rows path (workspace_bytes): per row a histogram of kDigits ints and two
// counters (above, bin), then the above lists (k words a row) and the bin lists (kBinCap words a row).
struct Workspace {
  int* hist;
  int* counts;
  unsigned long long* above;
  unsigned long long* bins;
};

TOPK_FN Workspace workspace_of(void* base, int64_t rows, int64_t k) {
  Workspace w;
  w.hist = static_cast<int*>(base);
  w.counts = w.hist + rows * kDigits;
  w.above = reinterpret_cast<unsigned long long*>(w.counts + rows * 2);
  w.bins = w.above + rows * k;
  return w;
}

struct ScanShared {
  unsigned long long warp_sums[kWarps];
  int warp_ints[kWarps];
};

// Shared memory of row_block and finish_block.
// The threshold bin of a first-digit histogram (threshold_bin): its digit (-1 when every candidate is taken), the
// count of keys in higher bins and the count in it.
struct Threshold {
  int digit, above, in_bin;
};

// Shared memory of row_block and finish_block.
struct Shared {
  union {
    unsigned long long sort[kSortWords];
    int row_digits[kDigits];     // cache_block: the row's first-digit histogram, before any word is collected
  };
  union {
    int digits[kDigits];         // row_block's first-digit histogram
    int hist[kCopies][kBins];    // select_segment: warp w counts into copy w % kCopies (fewer warps per address)
  };
  ScanShared scan;
  Threshold th;
  int fill[2];
  int base[2];   // cache_block: a block's first slots in the first block's lists
  int digit, above, in_bucket, total;
  int crowded;   // bucket_sort_write: buckets holding more than kBucketMax words
};

// Shared memory of hist_block and scatter_block.
struct ChunkShared {
  int hist[kDigits];
  ScanShared scan;
  Threshold th;
  int base[2];
};

// Inclusive scan of one int per thread over the first 256 threads (others pass 0); every thread calls it.
TOPK_FN int scan256(int v, ScanShared& sh) {
  const int lane = thread_id() & 31, warp = thread_id() >> 5;
  DSQ_UNROLL
  for (int off = 1; off < 32; off <<= 1) {
    const int t = shfl_up_i(v, off);
    if (lane >= off) v += t;
  }
  if (lane == 31 && warp < kBins / 32) sh.warp_ints[warp] = v;
  block_sync();
  int before = 0;
  for (int w = 0; w < warp && w < kBins / 32; ++w) before += sh.warp_ints[w];
  block_sync();
  return v + before;
}

// Exclusive block scan of one 64-bit value per thread; `total` receives the block's sum.
TOPK_FN unsigned long long scan_block_exclusive(unsigned long long v, ScanShared& sh, unsigned long long& total) {
  const int lane = thread_id() & 31, warp = thread_id() >> 5;
  unsigned long long x = v;
  DSQ_UNROLL
  for (int off = 1; off < 32; off <<= 1) {
    const unsigned long long t = shfl_up_u64(x, off);
    if (lane >= off) x += t;
  }
  if (lane == 31) sh.warp_sums[warp] = x;
  block_sync();
  if (warp == 0) {
    unsigned long long w = lane < kWarps ? sh.warp_sums[lane] : 0ull;
    DSQ_UNROLL
    for (int off = 1; off < 32; off <<= 1) {
      const unsigned long long t = shfl_up_u64(w, off);
      if (lane >= off) w += t;
    }
    if (lane < kWarps) sh.warp_sums[lane] = w;   // inclusive over warps
  }
  block_sync();
  const unsigned long long before = warp ? sh.warp_sums[warp - 1] : 0ull;
  total = sh.warp_sums[kWarps - 1];
  block_sync();
  return before + x - v;
}

// The threshold bin of the first-digit histogram h[kDigits] (shared or global memory): the bin where the count
// of keys in higher bins reaches k (th.digit = -1, th.above = all, when there are at most k keys). Every thread
// calls it; th is valid on return.
TOPK_FN void threshold_bin(const int* h, int64_t k, ScanShared& scan, Threshold& th) {
  const int tid = thread_id();
  // thread t holds bins kDigits - 1 - (t * kDigitsPerThread + j), j = 0.., from the top
  int v[kDigitsPerThread];
  int sum = 0;
  DSQ_UNROLL
  for (int j = 0; j < kDigitsPerThread; ++j) {
    v[j] = h[kDigits - 1 - (tid * kDigitsPerThread + j)];
    sum += v[j];
  }
  unsigned long long total;
  int above = static_cast<int>(scan_block_exclusive(static_cast<unsigned long long>(sum), scan, total));
  if (tid == 0) th = Threshold{-1, static_cast<int>(total), 0};
  block_sync();
  if (total > static_cast<unsigned long long>(k)) {
    DSQ_UNROLL
    for (int j = 0; j < kDigitsPerThread; ++j) {
      if (above < k && above + v[j] >= k) th = Threshold{kDigits - 1 - (tid * kDigitsPerThread + j), above, v[j]};
      above += v[j];
    }
  }
  block_sync();
}

// Counts the keys at [lo, hi) of `row` into the first-digit histogram `digits` (zeroed here).
template <int DT>
TOPK_FN void count_digits(const void* row, int64_t lo, int64_t hi, int* digits) {
  for (int b = thread_id(); b < kDigits; b += kThreads) digits[b] = 0;
  block_sync();
  for_each_key<DT>(row, lo, hi, [digits](int64_t, uint32_t key) {
    if (key) shared_add(&digits[key >> kDigitShift], 1);
  });
  block_sync();
}

// One tile of N keys a thread: key j at position pos(j), 0 from `end` on. Returns the flags (bit j: key j's top
// bits, key >> shift, are above t; bit 16 + j: equal to t; never for key 0) and sets `ex` to the block-exclusive
// scan of the thread's (equal << 32 | above) counts and `total` to the tile's.
template <int DT, int N, class Pos>
TOPK_FN unsigned classify_tile(const void* row, Pos pos, int64_t end, int shift, int64_t t, uint32_t (&keys)[N],
                               ScanShared& scan, unsigned long long& ex, unsigned long long& total) {
  static_assert(N <= 16, "flag bits");
  unsigned flags = 0u;
  int ngt = 0, neq = 0;
  DSQ_UNROLL
  for (int j = 0; j < N; ++j) {
    const int64_t p = pos(j);
    keys[j] = p < end ? load_key<DT>(row, p) : 0u;
    const int64_t top = static_cast<int64_t>(keys[j] >> shift);
    const bool gt = keys[j] != 0u && top > t;
    const bool eq = keys[j] != 0u && top == t;
    flags |= (gt ? 1u : 0u) << j;
    flags |= (eq ? 1u : 0u) << (16 + j);
    ngt += gt;
    neq += eq;
  }
  ex = scan_block_exclusive((static_cast<unsigned long long>(neq) << 32) | static_cast<unsigned>(ngt), scan, total);
  return flags;
}

// From the digit histogram sh.hist (kCopies copies of kBins bins, filled): the digit where the count of larger
// digits stays below `want` and with the digit's own reaches it, into sh.digit, the count above it into sh.above and
// its own into sh.in_bucket (unset when the histogram holds fewer than `want`), the histogram's total into sh.total.
// Every thread calls it; the results are valid on return.
TOPK_FN void pick_digit(int want, Shared& sh) {
  const int tid = thread_id();
  // thread t < 256 holds bin 255 - t: the inclusive scan is the count with a digit >= that bin
  int h = 0;
  if (tid < kBins)
    for (int c = 0; c < kCopies; ++c) h += sh.hist[c][kBins - 1 - tid];
  const int ge = scan256(h, sh.scan);
  if (tid < kBins && ge >= want && ge - h < want) {
    sh.digit = kBins - 1 - tid;
    sh.above = ge - h;
    sh.in_bucket = h;
  }
  if (tid == kBins - 1) sh.total = ge;
  block_sync();
}

// The one-block selection of the keys at [start, start + n) of `row`: the min(k, candidates) largest words,
// unordered, into sh.sort[0, taken); returns taken.
template <int DT>
TOPK_FN int32_t select_segment(const void* row, int64_t start, int32_t n, int64_t k_arg, Shared& sh) {
  const int tid = thread_id();
  const int32_t k = static_cast<int32_t>(k_arg < n ? k_arg : n);   // wanted from this segment

  // ---- threshold
  uint32_t prefix = 0u;
  int lvl = 0;               // prefix 0 at level 0: every candidate is above it
  int want = k;
  for (int p = 0; p < 4; ++p) {
    const int shift = 24 - 8 * p;
    for (int b = tid; b < kCopies * kBins; b += kThreads) sh.hist[b / kBins][b % kBins] = 0;
    block_sync();
    DSQ_UNROLL_N(4)
    for (int32_t i = tid; i < n; i += kThreads) {   // unrolled: several loads in flight per thread
      const uint32_t key = load_key<DT>(row, start + i);
      const bool match = key != 0u && (p == 0 || (key >> (shift + 8)) == (prefix >> (shift + 8)));
      if (match) shared_add(&sh.hist[(tid >> 5) & (kCopies - 1)][(key >> shift) & 0xFFu], 1);
    }
    block_sync();
    pick_digit(want, sh);
    const int total = sh.total;
    if (p == 0 && total <= k_arg) break;         // at most k candidates: take them all
    prefix |= static_cast<uint32_t>(sh.digit) << shift;
    lvl = shift;
    want -= sh.above;
    const bool whole_bucket = want == sh.in_bucket;
    block_sync();                                 // sh.digit etc. are rewritten by the next pass
    if (whole_bucket) break;
  }

  // ---- compaction in position order
  const uint32_t t_hi = prefix >> lvl;
  int taken = 0, eq_seen = 0;
  for (int32_t base = 0; base < n; base += kTile) {
    uint32_t keys[kItems];
    unsigned long long ex, tile_total;
    const int64_t first = start + base + tid * kItems;   // consecutive keys a thread: position order
    const unsigned flags = classify_tile<DT>(row, [first](int j) { return first + j; }, start + n, lvl, t_hi, keys,
                                             sh.scan, ex, tile_total);
    int gt_before = static_cast<int>(ex & 0xFFFFFFFFull);
    int eq_before = static_cast<int>(ex >> 32);
    const int eq_room = want - eq_seen > 0 ? want - eq_seen : 0;   // equal keys still to take
    DSQ_UNROLL
    for (int j = 0; j < kItems; ++j) {
      const bool gt = (flags >> j) & 1u, eq = (flags >> (16 + j)) & 1u;
      if (gt || (eq && eq_before < eq_room)) {
        const int slot = taken + gt_before + (eq_before < eq_room ? eq_before : eq_room);
        sh.sort[slot] = word_of(keys[j], start + base + tid * kItems + j);
      }
      gt_before += gt;
      eq_before += eq;
    }
    const int tile_gt = static_cast<int>(tile_total & 0xFFFFFFFFull);
    const int tile_eq = static_cast<int>(tile_total >> 32);
    taken += tile_gt + (tile_eq < eq_room ? tile_eq : eq_room);
    eq_seen += tile_eq;
  }
  return taken;
}

// The stages of bitonic step `size` (a power of two) whose strides are below 32 E, from `stride` (a power of two
// below 32 E) down, on a thread's E consecutive words v, the first at index i0 of the sequence (i0 and size set
// the directions): partners closer than E are in the thread, the others in its 32-lane group (shuffles; the
// direction of the thread's words is the same for all of them there). Every lane of the group calls it.
template <int E>
TOPK_FN void bitonic_in_group(unsigned long long (&v)[E], int32_t i0, int32_t size, int32_t stride) {
  for (; stride >= E; stride >>= 1) {
    const bool larger = ((i0 & stride) == 0) == ((i0 & size) == 0);   // this thread keeps the larger words
    DSQ_UNROLL
    for (int e = 0; e < E; ++e) {
      const unsigned long long y = shfl_xor_u64(v[e], stride / E);
      if ((y > v[e]) == larger) v[e] = y;   // words are unique (padding zeros: either is right)
    }
  }
  DSQ_UNROLL
  for (int st = E / 2; st >= 1; st >>= 1) {
    if (st < size) {
      DSQ_UNROLL
      for (int e = 0; e < E; ++e) {
        if (e & st) continue;
        const unsigned long long x = v[e], y = v[e | st];
        if ((x < y) == (((i0 + e) & size) == 0)) {
          v[e] = y;
          v[e | st] = x;
        }
      }
    }
  }
}

// Bitonic sort, descending, of buf[0, n) (shared memory; n a power of two, 32 E <= n <= kThreads E). The first n / E
// threads (whole 32-lane groups) hold E consecutive words each in registers, thread t words t * E .. t * E + E - 1,
// for the stages of strides below 32 E (bitonic_in_group); farther partners meet in shared memory, where every
// thread of the block takes a share of the pairs. Few threads with many words each issue far fewer instructions
// than one word pair a thread: the sort is bound by instruction issue, not by latency.
template <int E>
TOPK_FN void sort_desc(unsigned long long* buf, int32_t n) {
  const int tid = thread_id();
  const int32_t i0 = tid * E;
  const bool holds = i0 < n;
  unsigned long long v[E];
  block_sync();
  if (holds) {
    DSQ_UNROLL
    for (int e = 0; e < E; ++e) v[e] = buf[i0 + e];
  }
  for (int32_t size = 2; size <= n; size <<= 1) {
    int32_t stride = size >> 1;
    if (stride >= 32 * E) {
      if (holds) {
        DSQ_UNROLL
        for (int e = 0; e < E; ++e) buf[i0 + e] = v[e];
      }
      for (; stride >= 32 * E; stride >>= 1) {
        block_sync();
        for (int32_t i = tid; i < n / 2; i += kThreads) {
          const int32_t lo = ((i & ~(stride - 1)) << 1) | (i & (stride - 1)), hi = lo + stride;   // stride: 2^m
          const unsigned long long x = buf[lo], y = buf[hi];
          if ((x < y) == ((lo & size) == 0)) {
            buf[lo] = y;
            buf[hi] = x;
          }
        }
      }
      block_sync();
      if (holds) {
        DSQ_UNROLL
        for (int e = 0; e < E; ++e) v[e] = buf[i0 + e];
      }
    }
    if (holds) bitonic_in_group<E>(v, i0, size, stride);
  }
  if (holds) {
    DSQ_UNROLL
    for (int e = 0; e < E; ++e) buf[i0 + e] = v[e];
  }
  block_sync();
}

// The merge sort (DSQ_TOPK_MERGE=1), descending, of buf[0, n) (shared memory with room for 2n words; n a power of
// two, 32 E <= n <= kThreads E); returns buf or buf + n, whichever holds the sorted words. Runs of 32 E words are
// sorted by one 32-lane group each (bitonic_in_group, E words a thread), then merged pairwise until one run is
// left, every thread of the block placing words of its own: a word's place in the merged run is its index in its
// run plus the count of the partner run's words that precede it, the larger ones (and the equal ones, padding
// zeros, when it is in the second run: a stable merge), found by a binary search of the partner run.
template <int E>
TOPK_FN unsigned long long* sort_desc_merge(unsigned long long* buf, int32_t n) {
  constexpr int32_t kRun = 32 * E;
  const int tid = thread_id();
  const int32_t i0 = tid * E;
  block_sync();
  if (i0 < n) {
    unsigned long long v[E];
    DSQ_UNROLL
    for (int e = 0; e < E; ++e) v[e] = buf[i0 + e];
    const int32_t r0 = (tid & 31) * E;   // the first word's index in its run: every run ends descending
    for (int32_t size = 2; size <= kRun; size <<= 1) bitonic_in_group<E>(v, r0, size, size >> 1);
    DSQ_UNROLL
    for (int e = 0; e < E; ++e) buf[i0 + e] = v[e];
  }
  unsigned long long* src = buf;
  unsigned long long* dst = buf + n;
  for (int32_t m = kRun; m < n; m <<= 1) {
    block_sync();
    for (int32_t i = tid; i < n; i += kThreads) {
      const unsigned long long x = src[i];
      const int32_t base = i & ~(2 * m - 1);
      const bool second = (i & m) != 0;
      const unsigned long long* const o = src + (second ? base : base + m);   // the partner run, descending
      int32_t c = 0;                                                          // its words before x
      for (int32_t step = m >> 1; step >= 1; step >>= 1)
        if (second ? o[c + step - 1] >= x : o[c + step - 1] > x) c += step;
      c += (second ? o[c] >= x : o[c] > x) ? 1 : 0;
      dst[base + (i & (m - 1)) + c] = x;
    }
    unsigned long long* const t = src;
    src = dst;
    dst = t;
  }
  block_sync();
  return src;
}

// Words a thread holds in the sort (sort_desc's E), twice as many for a sort longer than kThreads * kSortE.
// NVIDIA: 4 (the sort of 2048 words on 512 threads measured faster than on 256 threads holding 8 each); AMD: 8
// (its 256 threads sort 2048 words with 8 each, 4096 with 16).
#ifndef DSQ_TOPK_SORT_E
#define DSQ_TOPK_SORT_E (DSQ_TOPK_AMD ? 8 : 4)
#endif
constexpr int kSortE = DSQ_TOPK_SORT_E;
static_assert(kThreads * kSortE * 2 >= DSQ_TOPK_MAX_SORT, "the largest sort fits the block");

// The sort length of `count` words (1 <= count <= DSQ_TOPK_MAX_SORT): a power of two, at least 32 * kSortE.
TOPK_FN int32_t sort_pad(int32_t count) {
  int32_t n = 32 * kSortE;
  while (n < count) n <<= 1;
  return n;
}

// Sorts buf[0, count) descending (sh.sort: kSortWords words, room for the merge sort's two buffers where they fit;
// padded with 0 to sort_pad(count)) and writes the positions of the words (minus `rel`) to outputs first, first + 1,
// .. of the row, those below k.
TOPK_FN void sort_and_write_part(const DsqTopkArgs& a, int64_t row, int32_t rel, unsigned long long* buf,
                                 int32_t count, int32_t first) {
  if (count == 0) return;
  const int tid = thread_id();
  const int32_t n_pad = sort_pad(count);
  for (int32_t j = count + tid; j < n_pad; j += kThreads) buf[j] = 0ull;
  const unsigned long long* sorted = nullptr;
  if constexpr (DSQ_TOPK_MERGE != 0) {
    if (2 * n_pad <= kSortWords && n_pad <= kThreads * kSortE) sorted = sort_desc_merge<kSortE>(buf, n_pad);
  }
  if (!sorted) {
    sorted = buf;
    if constexpr (kThreads * kSortE >= DSQ_TOPK_MAX_SORT) {
      sort_desc<kSortE>(buf, n_pad);
    } else {
      if (n_pad <= kThreads * kSortE) sort_desc<kSortE>(buf, n_pad);
      else sort_desc<2 * kSortE>(buf, n_pad);
    }
  }
  int32_t* const out = a.out + row * a.k;
  for (int32_t j = tid; j < count && first + j < a.k; j += kThreads)
    out[first + j] = static_cast<int32_t>(~static_cast<uint32_t>(sorted[j])) - rel;
}

// ---- the bucket sort of a row's candidate words (write_row) ----------------------------------------------------
// The n words are spread over kDigits buckets by their keys, bucket (key - lo) >> shift for the row's
// smallest and largest candidate keys lo and hi (shift: the fewest bits that leave hi - lo >> shift below kDigits),
// so that bucket b's words all precede bucket b - 1's. A block scan of the bucket counts (from the top) gives each
// bucket's first output slot, the words are copied bucket by bucket into the second half of the sort buffer, and
// each word's place in its bucket is the count of its bucket's words larger than it: the outputs are written
// there. Random logits put a few words in a bucket (their counts are small), so the sort costs a few passes over
// the words instead of the log2(n)^2 / 2 stages of the bitonic network; only the first `limit` slots are written, so
// the words above and in the threshold bin are sorted as they are, without a selection first. Buckets of more than
// kBucketMax words (ties, outliers that stretch the range) send the row to the radix selection, whose k taken words
// are bucket-sorted again or, where they still crowd a bucket, bitonic-sorted. The result is the same either way:
// the order of unique words.
constexpr int kBucketMax = 32;

// The smallest and largest key of the words buf[0, n) (n >= 1). Every thread calls it.
TOPK_FN void key_range(const unsigned long long* buf, int32_t n, ScanShared& scan, uint32_t& lo, uint32_t& hi) {
  const int tid = thread_id(), lane = tid & 31, warp = tid >> 5;
  unsigned long long mx = 0ull, mn = 0xFFFFFFFFull;
  for (int32_t i = tid; i < n; i += kThreads) {
    const unsigned long long k = buf[i] >> 32;
    mx = k > mx ? k : mx;
    mn = k < mn ? k : mn;
  }
  auto warp_range = [](unsigned long long& x, unsigned long long& y) {
    DSQ_UNROLL
    for (int m = 16; m >= 1; m >>= 1) {
      const unsigned long long u = shfl_xor_u64(x, m), v = shfl_xor_u64(y, m);
      x = u > x ? u : x;
      y = v < y ? v : y;
    }
  };
  warp_range(mx, mn);
  if (lane == 0) {
    scan.warp_sums[warp] = mx;
    scan.warp_ints[warp] = static_cast<int>(static_cast<uint32_t>(mn));
  }
  block_sync();
  mx = lane < kWarps ? scan.warp_sums[lane] : 0ull;   // every warp reduces the warps' ranges
  mn = lane < kWarps ? static_cast<uint32_t>(scan.warp_ints[lane]) : 0xFFFFFFFFull;
  warp_range(mx, mn);
  block_sync();   // scan is reused
  lo = static_cast<uint32_t>(mn);
  hi = static_cast<uint32_t>(mx);
}

// Sorts the n unique words at sh.sort[0, n) (1 <= n <= kSortWords / 2) by buckets and writes the positions (minus
// rel) of the `limit` largest (limit <= n, limit <= k) to outputs 0 .. limit - 1 of the row. Returns false, having
// written nothing (sh.sort intact), when a bucket holds more than kBucketMax words. Every thread calls it.
TOPK_FN bool bucket_sort_write(const DsqTopkArgs& a, int64_t row, int32_t rel, int32_t n, int32_t limit, Shared& sh) {
  constexpr int kPer = kSortWords / 2 / kThreads;   // words a thread
  const int tid = thread_id();
  uint32_t lo, hi;
  key_range(sh.sort, n, sh.scan, lo, hi);
  int shift = 0;
  while (((hi - lo) >> shift) >= static_cast<uint32_t>(kDigits)) ++shift;
  int* const offs = sh.digits;   // the bucket counts, then each bucket's first slot, then one past its last
  for (int b = tid; b < kDigits; b += kThreads) offs[b] = 0;
  if (tid == 0) sh.crowded = 0;
  block_sync();
  auto bucket = [lo, shift](unsigned long long w) {
    return static_cast<int>((static_cast<uint32_t>(w >> 32) - lo) >> shift);
  };
  DSQ_UNROLL
  for (int j = 0; j < kPer; ++j) {
    const int32_t i = tid + j * kThreads;
    if (i < n) shared_add(&offs[bucket(sh.sort[i])], 1);
  }
  block_sync();
  // thread t holds buckets kDigits - 1 - (t * kDigitsPerThread + j), j = 0.., from the top (as threshold_bin)
  int v[kDigitsPerThread];
  int sum = 0, most = 0;
  DSQ_UNROLL
  for (int j = 0; j < kDigitsPerThread; ++j) {
    v[j] = offs[kDigits - 1 - (tid * kDigitsPerThread + j)];
    sum += v[j];
    most = v[j] > most ? v[j] : most;
  }
  unsigned long long total;
  int run = static_cast<int>(scan_block_exclusive(static_cast<unsigned long long>(sum), sh.scan, total));
  if (most > kBucketMax) shared_add(&sh.crowded, 1);
  DSQ_UNROLL
  for (int j = 0; j < kDigitsPerThread; ++j) {
    offs[kDigits - 1 - (tid * kDigitsPerThread + j)] = run;
    run += v[j];
  }
  block_sync();
  if (sh.crowded) return false;
  // each word to a slot of its bucket; offs[b] then ends as bucket b's last slot + 1 (bucket b + 1's was its first)
  unsigned long long* const by_bucket = sh.sort + kSortWords / 2;
  DSQ_UNROLL
  for (int j = 0; j < kPer; ++j) {
    const int32_t i = tid + j * kThreads;
    if (i < n) {
      const unsigned long long w = sh.sort[i];
      by_bucket[shared_add(&offs[bucket(w)], 1)] = w;
    }
  }
  block_sync();
  int32_t* const out = a.out + row * a.k;
  DSQ_UNROLL
  for (int j = 0; j < kPer; ++j) {
    const int32_t i = tid + j * kThreads;
    if (i < n) {
      const unsigned long long w = sh.sort[i];
      const int b = bucket(w);
      const int first = b + 1 < kDigits ? offs[b + 1] : 0, last = offs[b];   // the bucket's slots
      if (first >= limit) continue;   // the whole bucket ranks below the words written
      int rank = 0;
      for (int q = first; q < last; ++q) rank += by_bucket[q] > w ? 1 : 0;
      if (first + rank < limit) out[first + rank] = static_cast<int32_t>(~static_cast<uint32_t>(w)) - rel;
    }
  }
  return true;
}

// Outputs from, from + 1, .., k - 1 of the row: -1 (the row has fewer than k candidates).
TOPK_FN void pad_row(const DsqTopkArgs& a, int64_t row, int64_t from) {
  int32_t* const out = a.out + row * a.k;
  for (int64_t j = from + thread_id(); j < a.k; j += kThreads) out[j] = -1;
}

// The `want` largest of the n unique words at buf[0, n) (shared memory), whose keys share their top kDigitBits bits,
// moved to buf[0, want) in any order (0 < want < n <= kSortWords): a radix selection, 8 bits a pass from the top of
// the remaining 52 bits, over the words whose higher bits equal the prefix fixed so far, until the bucket of the
// prefix holds exactly the words still wanted (it does by the last bit at the latest: the words are unique). The
// words taken are then those whose bits from `lvl` up are at least the prefix's.
TOPK_FN void select_words(unsigned long long* buf, int32_t n, int32_t want, Shared& sh) {
  constexpr int kPer = kSortWords / kThreads;
  const int tid = thread_id();
  unsigned long long prefix = buf[0] >> (64 - kDigitBits) << (64 - kDigitBits);   // the words' common top bits
  int lvl = 64 - kDigitBits;                                          // bits lvl.. are fixed
  while (lvl > 0) {
    const int shift = lvl > 8 ? lvl - 8 : 0;
    const unsigned long long mask = (1ull << (lvl - shift)) - 1ull;
    for (int b = tid; b < kCopies * kBins; b += kThreads) sh.hist[b / kBins][b % kBins] = 0;
    block_sync();
    for (int32_t i = tid; i < n; i += kThreads) {
      const unsigned long long w = buf[i];
      if ((w >> lvl) == (prefix >> lvl))
        shared_add(&sh.hist[(tid >> 5) & (kCopies - 1)][static_cast<int>((w >> shift) & mask)], 1);
    }
    block_sync();
    pick_digit(want, sh);
    prefix |= static_cast<unsigned long long>(sh.digit) << shift;
    want -= sh.above;
    const bool whole_bucket = want == sh.in_bucket;
    lvl = shift;
    block_sync();   // sh.digit etc. are rewritten by the next pass
    if (whole_bucket) break;
  }
  // every thread reads its words before any is moved: the taken ones are compacted in place
  unsigned long long v[kPer];
  DSQ_UNROLL
  for (int j = 0; j < kPer; ++j) v[j] = tid + j * kThreads < n ? buf[tid + j * kThreads] : 0ull;
  if (tid == 0) sh.fill[0] = 0;
  block_sync();
  const unsigned long long t = prefix >> lvl;
  DSQ_UNROLL
  for (int j = 0; j < kPer; ++j)
    if (tid + j * kThreads < n && (v[j] >> lvl) >= t) buf[shared_add(&sh.fill[0], 1)] = v[j];
  block_sync();
}

// The row's k outputs from its candidates: `above` words at sh.sort[0, above), every one larger than the `in_bin`
// words at sh.sort[above, above + in_bin) (the keys above the threshold bin and those in it). When there are more
// than k, all of them are bucket-sorted and the first k written where the bucket sort takes them (a few more words
// sorted cost less than a radix selection's passes and barriers: on the H100 24.2 µs against 27.3 with the selection
// at 64 x 65536, k = 2048, and 19.2 against 21.2 at 4 x 163840; means of two rounds); else
// the k - above largest of the bin are selected first, so that only the k taken words are sorted.
TOPK_FN void write_row(const DsqTopkArgs& a, int64_t row, int32_t rel, int32_t above, int32_t in_bin, Shared& sh) {
  int32_t n = above + in_bin;
  if (n > a.k) {
    const int32_t k = static_cast<int32_t>(a.k);
    if (2 * n <= kSortWords && bucket_sort_write(a, row, rel, n, k, sh)) return;
    select_words(sh.sort + above, in_bin, k - above, sh);
    n = k;
  }
  if (n == 0 || 2 * n > kSortWords || !bucket_sort_write(a, row, rel, n, n, sh))
    sort_and_write_part(a, row, rel, sh.sort, n, 0);
  pad_row(a, row, n);
}

// One block a row: block `row`.
template <int DT>
TOPK_FN void row_block(const DsqTopkArgs& a, int64_t row, Shared& sh) {
  int64_t start, end;
  row_span(a, row, start, end);
  const int32_t rel = a.relative ? static_cast<int32_t>(start) : 0;
  const void* const src = row_ptr(a, row);
  count_digits<DT>(src, start, end, sh.digits);
  threshold_bin(sh.digits, a.k, sh.scan, sh.th);
  const Threshold th = sh.th;
  if (th.above + th.in_bin <= kSortWords) {
    // the keys above the threshold bin into sh.sort[0, above), those in it from above on, in any order
    if (thread_id() == 0) {
      sh.fill[0] = 0;
      sh.fill[1] = th.above;
    }
    block_sync();
    const int digit = th.digit;
    for_each_key<DT, kCollectLoads>(src, start, end, [&sh, digit](int64_t p, uint32_t key) {
      const int d = static_cast<int>(key >> kDigitShift);
      if (key != 0u && d >= digit) sh.sort[shared_add(&sh.fill[d > digit ? 0 : 1], 1)] = word_of(key, p);
    });
    block_sync();
    write_row(a, row, rel, th.above, th.in_bin, sh);
  } else {
    const int32_t taken = select_segment<DT>(src, start, static_cast<int32_t>(end - start), a.k, sh);
    block_sync();
    write_row(a, row, rel, taken, 0, sh);
  }
}

// Block `bid` of the rows x chunks grid: row bid / chunks, its share [lo, hi) of the row's span.
TOPK_FN void chunk_range(const DsqTopkArgs& a, int32_t chunks, int64_t bid, int64_t& row, int64_t& lo,
                         int64_t& hi) {
  row = bid / chunks;
  const int64_t c = bid - row * chunks;
  int64_t start, end;
  row_span(a, row, start, end);
  const int64_t per = (end - start + chunks - 1) / chunks;
  lo = start + c * per;
  hi = lo + per < end ? lo + per : end;
  if (lo > hi) lo = hi;
}

// Few long rows, step 1: the row's histogram of the top kDigitBits of its keys.
template <int DT>
TOPK_FN void hist_block(const DsqTopkArgs& a, int32_t chunks, int64_t bid, ChunkShared& sh) {
  int64_t row, lo, hi;
  chunk_range(a, chunks, bid, row, lo, hi);
  const Workspace w = workspace_of(a.workspace, a.rows, a.k);
  count_digits<DT>(row_ptr(a, row), lo, hi, sh.hist);
  int* const dst = w.hist + row * kDigits;
  for (int b = thread_id(); b < kDigits; b += kThreads) {
    const int h = sh.hist[b];
    if (h) global_add(&dst[b], h);
  }
}

// Few long rows, step 2: the threshold bin from the row's histogram, then this block's keys above it and in it
// appended to the row's lists.
template <int DT>
TOPK_FN void scatter_block(const DsqTopkArgs& a, int32_t chunks, int64_t bid, ChunkShared& sh) {
  const int tid = thread_id();
  int64_t row, lo, hi;
  chunk_range(a, chunks, bid, row, lo, hi);
  const Workspace w = workspace_of(a.workspace, a.rows, a.k);

  threshold_bin(w.hist + row * kDigits, a.k, sh.scan, sh.th);
  const int digit = sh.th.digit;

  const void* const src = row_ptr(a, row);
  unsigned long long* const above_list = w.above + row * a.k;
  unsigned long long* const bin_list = w.bins + row * kBinCap;
  // keys strided over the block (coalesced loads): the lists are unordered, the finish sorts them
  for (int64_t base = lo; base < hi; base += kScatterTile) {
    uint32_t keys[kScatterItems];
    unsigned long long ex, tile_total;
    const int64_t first = base + tid;
    const unsigned flags = classify_tile<DT>(src, [first](int j) { return first + j * kThreads; }, hi, kDigitShift,
                                             digit, keys, sh.scan, ex, tile_total);
    if (tid == 0) {
      const int tile_gt = static_cast<int>(tile_total & 0xFFFFFFFFull), tile_eq = static_cast<int>(tile_total >> 32);
      sh.base[0] = tile_gt ? global_add(&w.counts[row * 2], tile_gt) : 0;
      sh.base[1] = tile_eq ? global_add(&w.counts[row * 2 + 1], tile_eq) : 0;
    }
    block_sync();
    int gt_slot = sh.base[0] + static_cast<int>(ex & 0xFFFFFFFFull);
    int eq_slot = sh.base[1] + static_cast<int>(ex >> 32);
    block_sync();                             // sh.base is rewritten by the next tile
    DSQ_UNROLL
    for (int j = 0; j < kScatterItems; ++j) {
      const unsigned long long word = word_of(keys[j], base + j * kThreads + tid);
      if ((flags >> j) & 1u) above_list[gt_slot++] = word;              // fewer than k a row: always room
      if ((flags >> (16 + j)) & 1u) {
        if (eq_slot < kBinCap) bin_list[eq_slot] = word;
        ++eq_slot;
      }
    }
  }
}

// The output slot of each digit's first word into offs[kDigits] (shared memory): the count of the words selected
// from higher digits, every key of a digit above th.digit and `want` of th.digit's (none below it). Every thread
// calls it; offs is valid on return.
TOPK_FN void digit_offsets(const int* h, const Threshold& th, int want, int* offs, ScanShared& scan) {
  const int tid = thread_id();
  int v[kDigitsPerThread];   // thread t holds digits kDigits - 1 - (t * kDigitsPerThread + j), from the top
  int sum = 0;
  DSQ_UNROLL
  for (int j = 0; j < kDigitsPerThread; ++j) {
    const int d = kDigits - 1 - (tid * kDigitsPerThread + j);
    v[j] = d > th.digit ? h[d] : (d == th.digit ? want : 0);
    sum += v[j];
  }
  unsigned long long total;
  int before = static_cast<int>(scan_block_exclusive(static_cast<unsigned long long>(sum), scan, total));
  DSQ_UNROLL
  for (int j = 0; j < kDigitsPerThread; ++j) {
    offs[kDigits - 1 - (tid * kDigitsPerThread + j)] = before;
    before += v[j];
  }
  block_sync();
}

// Few long rows, step 3, with kFinishGroups blocks a row (DSQ_TOPK_FINISH_GROUPS): group g of the row's output
// slots [0, total) is its g-th of kFinishGroups equal parts; a digit belongs to the group of its first slot, so
// each block gathers the words of its digits from the above list (and the bin list, in the group of the threshold
// digit, whose want largest it selects), sorts them and writes them from its group's first slot on.
TOPK_FN void finish_group(const DsqTopkArgs& a, int64_t row, int group, int32_t rel, const Workspace& w,
                          int n_above, int n_bin, Shared& sh) {
  const int tid = thread_id();
  const int* const hist = w.hist + row * kDigits;
  threshold_bin(hist, a.k, sh.scan, sh.th);
  const Threshold th = sh.th;
  const int want = th.digit < 0 ? 0 : static_cast<int>(a.k) - th.above;   // taken from the threshold digit
  const int total = th.digit < 0 ? th.above : static_cast<int>(a.k);      // the row's selected words
  if (group == 0) pad_row(a, row, total);
  if (total == 0) return;
  digit_offsets(hist, th, want, sh.digits, sh.scan);
  const int* const offs = sh.digits;
  const auto group_of = [offs, total](int d) {
    return static_cast<int>(static_cast<int64_t>(offs[d]) * kFinishGroups / total);
  };
  if (tid == 0) {
    sh.fill[0] = 0;   // the group's words gathered
    sh.fill[1] = 0;   // its first slot: the words of the groups before it
  }
  block_sync();
  int before = 0;
  for (int d = tid; d < kDigits; d += kThreads) {
    const int sel = d > th.digit ? hist[d] : (d == th.digit ? want : 0);
    if (sel > 0 && group_of(d) < group) before += sel;
  }
  if (before) shared_add(&sh.fill[1], before);
  const unsigned long long* const above_list = w.above + row * a.k;
  for (int i = tid; i < n_above; i += kThreads) {
    const unsigned long long word = above_list[i];
    if (group_of(static_cast<int>(word >> (64 - kDigitBits))) == group) sh.sort[shared_add(&sh.fill[0], 1)] = word;
  }
  block_sync();
  const int n_mine = sh.fill[0], first = sh.fill[1];
  const bool has_bin = th.digit >= 0 && group_of(th.digit) == group;
  block_sync();   // offs and fill are reused by select_words
  int32_t n = n_mine;
  if (has_bin) {
    const unsigned long long* const bin_list = w.bins + row * kBinCap;
    for (int i = tid; i < n_bin; i += kThreads) sh.sort[n_mine + i] = bin_list[i];
    block_sync();
    if (n_bin > want) select_words(sh.sort + n_mine, n_bin, want, sh);
    n += want;
  }
  sort_and_write_part(a, row, rel, sh.sort, n, first);
}

// Few long rows, step 3: block `bid` finishes group bid % kFinishGroups of row bid / kFinishGroups (one block a row
// by default: both lists sorted together and the first k written). A threshold bin too full for the sort buffer
// falls back to the one-block selection of the row, by its first block.
template <int DT>
TOPK_FN void finish_block(const DsqTopkArgs& a, int64_t bid, Shared& sh) {
  const int64_t row = bid / kFinishGroups;
  const int group = static_cast<int>(bid - row * kFinishGroups);
  int64_t start, end;
  row_span(a, row, start, end);
  const int32_t rel = a.relative ? static_cast<int32_t>(start) : 0;
  const Workspace w = workspace_of(a.workspace, a.rows, a.k);
  const int n_above = w.counts[row * 2], n_bin = w.counts[row * 2 + 1];
  if (n_above + n_bin > kSortWords) {
    if (group != 0) return;
    const int32_t taken = select_segment<DT>(row_ptr(a, row), start, static_cast<int32_t>(end - start), a.k, sh);
    block_sync();
    write_row(a, row, rel, taken, 0, sh);
    return;
  }
  if constexpr (kFinishGroups > 1) {
    finish_group(a, row, group, rel, w, n_above, n_bin, sh);
  } else {
    const unsigned long long* const above_list = w.above + row * a.k;
    const unsigned long long* const bin_list = w.bins + row * kBinCap;
    // every load of the thread issued before its first store (the stores would hold later loads back)
    constexpr int kPer = kSortWords / kThreads;
    unsigned long long words[kPer];
    DSQ_UNROLL
    for (int j = 0; j < kPer; ++j) {
      const int i = thread_id() + j * kThreads;
      words[j] = i < n_above ? above_list[i] : (i < n_above + n_bin ? bin_list[i - n_above] : 0ull);
    }
    DSQ_UNROLL
    for (int j = 0; j < kPer; ++j) {
      const int i = thread_id() + j * kThreads;
      if (i < n_above + n_bin) sh.sort[i] = words[j];
    }
    block_sync();
    write_row(a, row, rel, n_above, n_bin, sh);
  }
}

#if DSQ_TOPK_CACHE_KEYS > 0
// Shared memory of cache_block: Shared and the keys of the block's part of the row.
struct CacheShared {
  Shared s;
  alignas(16) uint32_t keys[kCacheKeys];   // read as 16-byte groups
};

// The barrier of every thread of the row's blocks (a cluster barrier; the block barrier for one block): what a
// thread wrote to its block's or another block's shared memory before it is visible to all after it.
TOPK_FN void row_sync(int blocks) {
  if (blocks > 1)
    cluster_sync();
  else
    block_sync();
}

// Cached-row path: block `rank` of the `blocks` blocks (a cluster) that select row `row`. Each block reads its
// part of the row's span once, into the key cache and its first-digit histogram. The threshold bin b of the row's
// histogram (as row_block): up to kSumBlocks blocks, each block sums the blocks' histograms and finds b; more
// blocks add their histograms into the first block's, which finds b (fewer reads of other blocks' memory, one more
// cluster barrier). Each block then appends its cached keys above b and in b to the first block's two lists (that
// block's shared memory). Up to 2 blocks, each block counts its slots in its own shared memory, the first block's
// from the start of a list, the second's from its end. With more, each block reserves a slot a word by an atomic
// add on the first block's counters; with more than kStageBlocks, only the first block does, and every other block
// stages its words in its own sort buffer, then reserves a run of each list with one remote atomic add and copies
// the run (a remote atomic add a word is a round trip to the first block's SM, and with many blocks all of them
// contend for its two counters). The first block finishes the row as row_block does.
// A threshold bin too full for the sort buffer: the first block runs the one-block selection on the row.
// blocks * kCacheKeys >= the row's span (run() checks it).
// C: cache_collect(blocks); one instance each keeps the others' code out of its registers (the staged copy in the
// instance of 4 blocks measured 0.5 µs slower there, though it never ran).
template <int DT, int C>
TOPK_FN void cache_block(const DsqTopkArgs& a, int64_t row, int rank, int blocks, CacheShared& cs) {
  constexpr bool ADD = C != kCollectSum, STAGE = C == kCollectStage;
  Shared& sh = cs.s;
  const int tid = thread_id();
  int64_t start, end;
  row_span(a, row, start, end);
  const int64_t per = ((end - start + blocks - 1) / blocks + 3) / 4 * 4;   // <= kCacheKeys
  int64_t lo = start + rank * per;
  if (lo > end) lo = end;
  const int64_t hi = lo + per < end ? lo + per : end;
  const int32_t n = static_cast<int32_t>(hi - lo);
  const void* const src = row_ptr(a, row);

  // this block's keys, cached and counted; the first block's row histogram cleared (several blocks)
  uint32_t* const keys = cs.keys;
  int* const digits = sh.digits;
  for (int d = tid; d < kDigits; d += kThreads) {
    digits[d] = 0;
    if (ADD && rank == 0) sh.row_digits[d] = 0;
  }
  block_sync();
  // (16-bit keys: 3 loads in flight, eight keys each; with 4 the bf16 kernel spills registers on sm_90a)
  constexpr int kCacheLoads = DT == 0 ? kLoads : kCollectLoads;
  for_each_key<DT, kCacheLoads>(src, lo, hi, [keys, digits, lo](int64_t p, uint32_t key) {
    keys[p - lo] = key;
    if (key) shared_add(&digits[key >> kDigitShift], 1);
  });
  row_sync(blocks);   // every block's histogram complete, the first block's row histogram clear
  if constexpr (!ADD) {
    // every block sums the blocks' histograms (one read of each other block's bins) and finds the threshold bin
    for (int d = tid; d < kDigits; d += kThreads) {
      int sum = 0;
      for (int r = 0; r < blocks; ++r) sum += (r == rank ? digits : cluster_peer(digits, r))[d];
      sh.row_digits[d] = sum;
    }
    block_sync();
    threshold_bin(sh.row_digits, a.k, sh.scan, sh.th);
  } else {
    // every block adds its bins into the first block's row histogram, the first block finds the threshold bin
    int* const row_hist = rank == 0 ? sh.row_digits : cluster_peer(sh.row_digits, 0);
    for (int d = tid; d < kDigits; d += kThreads)
      if (digits[d]) shared_add(&row_hist[d], digits[d]);
    cluster_sync();
    if (rank == 0) threshold_bin(sh.row_digits, a.k, sh.scan, sh.th);
  }
  if (tid == 0) {   // the counters of the lists' slots, or of a block's staged words (see below)
    sh.fill[0] = 0;
    sh.fill[1] = ADD && rank == 0 ? sh.th.above : 0;
  }
  row_sync(blocks);   // the threshold and the zeroed slot counters published; no histogram is read any more
  Shared& first = rank == 0 ? sh : *cluster_peer(&sh, 0);
  const Threshold th = ADD ? first.th : sh.th;   // (summed: every block found the same)
  const bool fits = th.above + th.in_bin <= kSortWords;   // the same in every block

  if (fits) {
    const int digit = th.digit;
    const Words16* const kv = reinterpret_cast<const Words16*>(keys);
    const int32_t pos0 = static_cast<int32_t>(lo);   // positions are below 2^31
    for (int32_t i = tid; 4 * i < n; i += kThreads) {
      const Words16 w = kv[i];   // inside the cache: n <= per, a multiple of 4
      DSQ_UNROLL
      for (int j = 0; j < 4; ++j) {
        const uint32_t key = w.w[j];
        const int d = static_cast<int>(key >> kDigitShift);
        if (4 * i + j < n && key != 0u && d >= digit) {
          const unsigned long long word = word_of(key, pos0 + 4 * i + j);
          if constexpr (ADD) {
            if (!STAGE || rank == 0)
              first.sort[shared_add(&first.fill[d > digit ? 0 : 1], 1)] = word;
            else   // staged in the block's own buffer: words above the bin from 0, words in it from th.above
              sh.sort[d > digit ? shared_add(&sh.fill[0], 1) : th.above + shared_add(&sh.fill[1], 1)] = word;
          } else {   // slots counted by each block: the first block's from a list's start, the second's from its end
            const bool up = d > digit;
            const int slot = shared_add(&sh.fill[up ? 0 : 1], 1), len = up ? th.above : th.in_bin;
            first.sort[(up ? 0 : th.above) + (rank == 0 ? slot : len - 1 - slot)] = word;
          }
        }
      }
    }
    if (STAGE && rank != 0) {   // the staged words to the first block's lists: one slot reservation a list
      block_sync();
      const int n_up = sh.fill[0], n_bin = sh.fill[1];
      if (tid == 0) {
        sh.base[0] = n_up ? shared_add(&first.fill[0], n_up) : 0;
        sh.base[1] = n_bin ? shared_add(&first.fill[1], n_bin) : 0;
      }
      block_sync();
      const int b_up = sh.base[0], b_bin = sh.base[1];
      for (int i = tid; i < n_up; i += kThreads) first.sort[b_up + i] = sh.sort[i];
      for (int i = tid; i < n_bin; i += kThreads) first.sort[b_bin + i] = sh.sort[th.above + i];
    }
  }
  row_sync(blocks);   // every word in the first block's lists; no block touches another's memory after this
  if (rank != 0) return;
  const int32_t rel = a.relative ? static_cast<int32_t>(start) : 0;
  if (fits) {
    write_row(a, row, rel, th.above, th.in_bin, sh);
  } else {
    const int32_t taken = select_segment<DT>(src, start, static_cast<int32_t>(end - start), a.k, sh);
    block_sync();
    write_row(a, row, rel, taken, 0, sh);
  }
}
#endif

// The blocks a row of the cached-row path for rows of L positions: the fewest (a power of two) whose caches hold
// L keys; 0 when more than kMaxCluster would be needed or the build has no such path.
inline int32_t cache_blocks(int64_t L) {
  if (kCacheKeys == 0) return 0;
  int32_t c = 1;
  while (static_cast<int64_t>(c) * kCacheKeys < L) c *= 2;
  return c <= kMaxCluster ? c : 0;
}

// ---- host side: the plan, the workspace size, the argument check and the order of the launches

// Blocks a row of the cached-row path for `rows` rows of L positions: the fewest whose caches hold a row, doubled
// while the call's blocks stay within half of the SMs and a block reads at least kMinSpreadKeys keys (a row read by
// more SMs; measured on the H100: 4 x 163840 in 16 blocks 21.9 µs against 22.6 in 8, 16 x 65536 in 4 blocks 20.8
// µs against 24.4 in 2 and 28.8 in 8). 0 where the path cannot hold L.
inline int32_t spread_blocks(int64_t rows, int64_t L, int32_t sms) {
  int32_t c = cache_blocks(L);
  if (c == 0) return 0;
  while (2 * c <= kMaxSpread && rows * 2 * c <= sms / 2 && L >= static_cast<int64_t>(2 * c) * kMinSpreadKeys) c *= 2;
  return c;
}

inline int32_t plan_chunks(int64_t rows, int64_t L, int64_t k, int32_t sms) {
  // rows that the caches of at most kMaxCluster blocks hold: the cached-row path (each key read once)
  if (rows > 0 && k > 0 && cache_blocks(L) > 0) return -spread_blocks(rows, L, sms);
  // fewer than 3 blocks a row in a wave: one block a row is faster (one launch; measured on the H200)
  if (rows <= 0 || sms / rows < 3 || k <= 0 || L < 8 * k) return 1;
  int64_t c = sms / rows;   // step 2 in one wave of a block an SM (step 1 runs twice the blocks, two an SM)
  if (c > L / 4096) c = L / 4096;                                     // at least 4096 keys a block
  if (c > kMaxChunks) c = kMaxChunks;
  return static_cast<int32_t>(c < 2 ? 2 : c);
}

inline int64_t workspace_bytes(int64_t rows, int64_t L, int64_t k, int32_t chunks) {
  if (chunks <= 1 || rows <= 0 || L <= 0 || k <= 0) return 0;
  return rows * ((kDigits + 2) * 4 + (k + kBinCap) * 8);
}

// Runs a call on `dev`, which launches grids of the block bodies: dev.row<DT>(a), dev.memset(p, bytes),
// dev.hist<DT>(a, chunks), dev.scatter<DT>(a, chunks), dev.finish<DT>(a), each returning 0 or an error code, and
// where kCacheKeys > 0 dev.cache<DT>(a, blocks) (clusters of `blocks` blocks a row; -1: the device cannot).
// Returns 1 (cudaErrorInvalidValue) for bad arguments, before anything is launched.
template <int DT, class Dev>
int run_dtype(const DsqTopkArgs& a, int32_t chunks, Dev& dev) {
  if (chunks < 0) {   // the cached-row path, where the device runs it (dev.cache returns -1 where not)
    if constexpr (kCacheKeys > 0) {
      // a cluster size the device refuses (past 8 blocks the size is non-portable): the next smaller one that
      // still holds the row
      for (int32_t c = -chunks; c >= 1 && static_cast<int64_t>(c) * kCacheKeys >= a.L; c /= 2) {
        const int e = dev.template cache<DT>(a, c);
        if (e >= 0) return e;
      }
    }
    chunks = 1;
  }
  if (chunks == 1) return dev.template row<DT>(a);
  int e = dev.memset(a.workspace, static_cast<size_t>(a.rows) * (kDigits + 2) * sizeof(int));
  if (e == 0) e = dev.template hist<DT>(a, 2 * chunks);   // any split of a row adds up to its histogram
  if (e == 0) e = dev.template scatter<DT>(a, chunks);
  if (e == 0) e = dev.template finish<DT>(a);
  return e;
}

template <class Dev>
int run(const DsqTopkArgs* args, Dev& dev) {
  if (!args) return 1;
  const DsqTopkArgs& a = *args;
  if (a.rows < 0 || a.L < 0 || a.L > INT32_MAX || a.k < 1 || a.k > INT32_MAX || !a.out ||
      a.logits_dtype < 0 || a.logits_dtype > 2 || (a.index_dtype != 3 && a.index_dtype != 4) ||
      a.form < DSQ_TOPK_DECODE_1D || a.form > DSQ_TOPK_PREFILL || a.next_n < 1 ||
      (a.rows > 0 && a.L > 0 && !a.logits) || a.row_stride < 0)
    return 1;
  if (a.form == DSQ_TOPK_PREFILL ? (!a.ks || !a.ke) : !a.context_lens) return 1;
  if (a.chunks > kMaxChunks) return 1;
  if (a.rows == 0) return 0;
  const int64_t m = a.k < a.L ? a.k : a.L;
  int32_t k_pad = 1;
  while (k_pad < m) k_pad <<= 1;
  if (k_pad > DSQ_TOPK_MAX_SORT) return 1;
  int32_t chunks = a.chunks > 0 ? a.chunks : 1;
  if (chunks > 1 && (a.L == 0 || !a.workspace || a.workspace_bytes < workspace_bytes(a.rows, a.L, a.k, chunks)))
    chunks = 1;
  if (a.chunks < 0) {   // cached rows in -chunks blocks each: a power of two whose caches hold the row
    const int64_t c = -static_cast<int64_t>(a.chunks);
    if (kCacheKeys > 0 && c <= kMaxSpread && (c & (c - 1)) == 0 && c * kCacheKeys >= a.L)
      chunks = static_cast<int32_t>(-c);
  }
  switch (a.logits_dtype) {
    case 0: return run_dtype<0>(a, chunks, dev);
    case 1: return run_dtype<1>(a, chunks, dev);
    default: return run_dtype<2>(a, chunks, dev);
  }
}

}  // namespace dsqtopk
